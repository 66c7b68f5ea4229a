"""Where tfhybrid depends on TensorFlow's and Keras' private structures, by version.

TensorFlow upgrades break exactly these places, so each switch names the versions it
covers and why the private structure is read at all. Supported: TensorFlow 2.15 and
2.21 (with tf-keras of the same version).

Checkpoints hold tables and their slots under mesh-independent keys through TF's own
extension points: ``_gather_saveables_for_checkpoint`` nodes (the layer's ``tables``,
the optimizer's ``tfhybrid_table_slots``) and ``Trackable`` children that stand in for
an optimizer's numbered lists. Five patches remain, each where TF has no public hook:

- ``MultiDeviceSaver.save`` (``_checkpoint_writer.install``): every Keras and TF save
  path ends there, and a save of sharded tables needs every rank to write its part of
  one checkpoint; TF's savers write a whole checkpoint per process. Reads the saver's
  entries through ``saver_entries`` below.
- ``CheckpointPosition.gather_ops_or_named_saveables`` (``layers/_checkpointing``): a
  FIITED table's saved shape depends on the checkpoint being read, and TF tells a
  saveable nothing about it; the hook names the path while TF gathers.
- the Keras optimizers' slot factories (``tiers``): a slot per entry of a tiered table's
  cache would be wrong, and Keras has no hook to refuse one.
- ``build`` of an optimizer instance (``layers/_checkpointing._after_build``): Keras
  makes tracked lists there, and TF hands a waiting restoration to a new list by
  position; the wrapper hands it to the mesh-independent view instead.
- autograph's module rules (``_skip_autograph``): tfhybrid is exempt from conversion,
  as TF and Keras exempt themselves; there is only a per-function decorator.

Example::

    from tfhybrid import _tf_internals
    assert _tf_internals.TF_VERSION >= (2, 15)
"""

from __future__ import annotations

import os
import sys
from typing import Any

import tensorflow as tf
from tensorflow.python.training.saving import saveable_object


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


TF_VERSION = _version(tf.__version__)


def _require_keras_2() -> None:
    """tfhybrid's layers, optimizers and callbacks are Keras 2 classes: with Keras 3
    as ``tf.keras`` (TF >= 2.16 without ``TF_USE_LEGACY_KERAS=1``) they would fail far
    from the cause, so fail here, naming it."""
    # tf.keras of TF <= 2.15 has no __version__; the package defining its Model has
    package = sys.modules[tf.keras.Model.__module__.split(".")[0]]
    version = getattr(tf.keras, "__version__", None) or getattr(package, "__version__", "")
    if not version.startswith("2."):
        if os.environ.get("TF_USE_LEGACY_KERAS") in ("1", "true", "True"):
            # the variable is set (tfhybrid's import sets it), yet TF chose Keras 3: TF
            # reads it once, and something used tf.keras first (horovod.tensorflow does)
            cause = ("tf.keras was used before tfhybrid was imported (e.g. by `import "
                     "horovod.tensorflow`), when TF_USE_LEGACY_KERAS was not yet set; "
                     "export TF_USE_LEGACY_KERAS=1 before Python starts (horovodrun "
                     "passes it on), or import tfhybrid first")
        else:
            cause = (f"install tf-keras=={tf.__version__} and export "
                     "TF_USE_LEGACY_KERAS=1 before Python starts, or import tfhybrid "
                     "before anything uses tf.keras (TF reads the variable once)")
        raise ImportError(
            f"tfhybrid needs Keras 2 (tf-keras) as tf.keras, but tf.keras is Keras "
            f"{version!r} (TensorFlow {tf.__version__}): {cause}. TF_USE_LEGACY_KERAS "
            f"is {os.environ.get('TF_USE_LEGACY_KERAS')!r}")


_require_keras_2()


def _skip_autograph(package: str) -> None:
    """Tells autograph not to convert ``package``'s functions, as TF's own rules do for
    ``tensorflow``, ``keras`` and ``tf_keras``.

    tfhybrid's graph code branches and loops on Python values only (the plan, static
    shapes), never on tensors: every rank must trace the same collectives, which a
    ``tf.cond`` around one could not promise. Converting it changes no op and costs
    time: a process spent 5 s of a 16 s test module (40% of an np=4 run's samples)
    transpiling the layer's and the gradient route's methods on first trace. A user's
    own function, and a user's subclass overriding a method, are still converted.
    The rules are a module-level tuple read on every conversion (TF 2.15 to 2.21).
    """
    from tensorflow.python.autograph.core import config

    rule = config.DoNotConvert(package)
    if not any(isinstance(r, config.DoNotConvert) and r.matches(package)
               for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (rule,) + tuple(config.CONVERSION_RULES)


_skip_autograph(__name__.split(".")[0])
# TF 2.16 reorganised MultiDeviceSaver (tensors by task instead of savers by device)
# and tf-keras 2.16 began caching an optimizer's checkpoint children
_SAVER_BY_TASK = TF_VERSION >= (2, 16)


def saver_entries(saver: Any) -> list[tuple[str, str, Any]]:
    """(checkpoint key, slice spec, tensor or SaveSpec) of everything a
    ``MultiDeviceSaver`` holds, for a save that every rank takes part in.

    TensorFlow has no public view of what a save is about to write; the writer needs
    it to decide which rank writes which piece. TF <= 2.15 keeps one
    ``_SingleDeviceSaver`` per device (``_single_device_savers``); TF >= 2.16 keeps
    ``ShardableTensor`` records per task (``_shardable_tensors_by_task``).
    """
    out = []
    if not _SAVER_BY_TASK:
        for device_saver in saver._single_device_savers.values():
            for key, slices in device_saver._tensor_slice_dict.items():
                for spec, value in slices.items():
                    if isinstance(value, saveable_object.SaveSpec):
                        if value._tensor is None:   # recorded in the graph, no value
                            continue
                        key, spec = value.name, value.slice_spec
                    out.append((key, spec, value))
        return out
    for records in saver._shardable_tensors_by_task.values():
        for record in records:
            if record.tensor is not None:   # a plain tensor, wrapped by the saver
                out.append((record.checkpoint_key, record._tensor_save_spec.slice_spec,
                            record.tensor))
                continue
            value = record._tensor_save_spec
            if value._tensor is None:       # recorded in the graph, no value
                continue
            out.append((value.name, value.slice_spec, value))
    return out


def forget_checkpoint_children(optimizer: Any) -> None:
    """Drops an optimizer's cached checkpoint children, after one was replaced.

    tf-keras >= 2.16 computes ``Optimizer._trackable_children`` once and keeps it in
    ``_coalesced_children`` (with a copy of each tracked list): a child tracked later
    (a list a build makes, or the views that keep table slots out of the numbered
    lists) would never be seen or saved. tf-keras <= 2.15 does not cache.
    """
    if "_coalesced_children" in vars(optimizer):
        del optimizer._coalesced_children
