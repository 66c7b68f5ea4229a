"""A Keras 2 checkpoint of a model, read into the same model built in Keras 3.

Keras 2 (tf-keras) names a model's layers in a TensorFlow checkpoint by position: the
j-th layer of ``model.layers`` that has weights is ``layer_with_weights-<j>``, each of its
variables is named by the attribute that holds it (``kernel``, ``bias``), and a
``DistributedEmbedding``'s tables sit under ``tables``. Keras 3 names the same objects
differently, so ``tf.train.Checkpoint(model=model).read(path)`` binds nothing of a Keras 3
model to such a checkpoint, and Keras 3's ``load_weights`` reads only its own formats.
``load_keras_2_checkpoint`` reads through a Keras 2-shaped view of the model instead.

Example::

    import tfhybrid.checkpoint.keras_2 as keras_2
    left = keras_2.load_keras_2_checkpoint(model, "/ckpts/keras2/ckpt-4")
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid.checkpoint import tables

_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_LAYER_PREFIXES = ("layer_with_weights-", "layer-")


def load_keras_2_checkpoint(model: Any, path: str, name: str = "model") -> list[str]:
    """Reads ``model``'s weights from the Keras 2 checkpoint ``path``, onto any mesh.

    ``path`` is what Keras 2's ``model.save_weights`` wrote (the model is the root) or a
    ``tf.train.Checkpoint`` that holds the model as ``name``. Every weight of the model
    must be read, and every weight of the checkpoint's model must find its place; else
    ``ValueError`` names what is missing on each side. A Keras model inside the model is
    read by the same rule; another layer with layers inside it is refused, by name (Keras
    2 names its layers by the attributes that hold them). Returns the checkpoint's other
    keys, which it leaves unread: an optimizer's state does not carry over.
    """
    keys = [key for key, _ in tf.train.list_variables(path) if key != _GRAPH_KEY]
    rooted = any(key.startswith(_LAYER_PREFIXES) for key in keys)
    prefix = "" if rooted else f"{name}/"
    if not any(key.startswith(prefix + p) for key in keys for p in _LAYER_PREFIXES):
        raise ValueError(
            f"checkpoint {path!r} holds no Keras 2 model under {name!r}: its top-level "
            f"names are {sorted({key.split('/')[0] for key in keys})}")
    placed: list[str] = []
    nested: list[str] = []
    children = _keras_2_children(model, prefix, placed, nested)
    unplaced = [key for key in keys if key.startswith(prefix)
                and key[len(prefix):].startswith(_LAYER_PREFIXES)
                and not key.startswith(tuple(placed))]
    if nested or unplaced:
        raise ValueError(
            f"checkpoint {path!r} is Keras 2's: its model weights {unplaced} have no place "
            f"in this Keras 3 model" + (f" (layers with layers inside them, which Keras 2 "
                                        f"names by attribute: {nested})" if nested else ""))
    if rooted:
        checkpoint = tf.train.Checkpoint(**children)
    else:
        view = _tf_internals.Trackable()
        for child, node in children.items():
            _tf_internals.track_child(view, child, node)
        checkpoint = tf.train.Checkpoint(**{name: view})
    try:
        status = checkpoint.read(path)
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError) as e:
        raise ValueError(f"checkpoint {path!r} does not fit this Keras 3 model as Keras 2 "
                         f"names its weights: {e}") from None
    status.expect_partial()   # what is left (an optimizer's state) is returned
    return [key for key in keys if not key.startswith(tuple(placed))
            and not (key.startswith(prefix) and key[len(prefix):].startswith(_LAYER_PREFIXES))]


def _keras_2_children(model: Any, prefix: str, placed: list[str], nested: list[str]) -> dict:
    """``model``'s layers as Keras 2 names them in a checkpoint, as checkpoint nodes;
    adds the key prefixes they read to ``placed`` and the layers it cannot name to
    ``nested``."""
    children = {}
    for j, layer in enumerate(layer for layer in model.layers if layer.weights):
        child = f"layer_with_weights-{j}"
        node = _tf_internals.Trackable()
        if any(layer is built for built in tables.built_layers()):
            _tf_internals.track_child(node, "tables", _tf_internals.children_of(layer)["tables"])
            placed.append(f"{prefix}{child}/tables/")
        elif isinstance(layer, tf.keras.Model):
            # a model inside a model: Keras 2 names its layers by the same rule
            for name, inner in _keras_2_children(layer, f"{prefix}{child}/", placed,
                                                 nested).items():
                _tf_internals.track_child(node, name, inner)
        elif _tf_internals.layers_in(layer):
            nested.append(layer.name)
            continue
        else:
            for variable in layer.weights:
                attribute = variable.name.split(":")[0].rsplit("/", 1)[-1]
                _tf_internals.track_child(node, attribute, _tf_internals.tf_variable(variable))
                placed.append(f"{prefix}{child}/{attribute}/")
        children[child] = node
    return children
