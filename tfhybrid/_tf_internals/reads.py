"""Reads of TensorFlow's and Keras' private structures, each where no public API gives
the answer: what a checkpoint save holds, checkpoint children, traced functions, a
model's layers, a variable's path and containers. Each says which versions it covers.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import gen_io_ops
from tensorflow.python.ops import io_ops
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.trackable import data_structures
from tensorflow.python.training.saving import saveable_object

from tfhybrid._tf_internals.versions import TF_VERSION


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


def registered_savers(saver: Any) -> dict:
    """The checkpoint savers registered with a ``MultiDeviceSaver`` (by name), which
    write their own files and so cannot take part in a save written by all ranks."""
    return saver._registered_savers


# TF's legacy checkpoint classes: a ``SaveableObject`` restores each slice of one name to
# its own piece, which TF 2.15's ``_serialize_to_tensors`` path gets wrong
SaveableObject = saveable_object.SaveableObject


SaveSpec = saveable_object.SaveSpec


Trackable = trackable_base.Trackable


SaveType = trackable_base.SaveType


ListWrapper = data_structures.ListWrapper


def save_v2(prefix: Any, tensor_names: list, shape_and_slices: list, tensors: list) -> Any:
    """TF's raw save of tensors (or slices of them) to one checkpoint part. Looked up at
    each call, so that a test can replace TF's op to make a write fail."""
    return io_ops.save_v2(prefix, tensor_names, shape_and_slices, tensors)


def merge_v2_checkpoints(checkpoint_prefixes: list, destination_prefix: str,
                         delete_old_dirs: bool = True) -> Any:
    """TF's raw merge of checkpoint parts into one checkpoint (as its sharded saves do)."""
    return gen_io_ops.merge_v2_checkpoints(checkpoint_prefixes, destination_prefix,
                                           delete_old_dirs=delete_old_dirs)


def in_xla_context() -> bool:
    """True while tracing for XLA (``jit_compile``), in this graph or one it is nested in."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def variable_accessed(variable: Any) -> None:
    """Lets ``GradientTape`` / ``FuncGraph`` watch ``variable`` when it is read through its
    handle (what ``ResourceVariable.sparse_read`` does)."""
    resource_variable_ops.variable_accessed(variable)


# Read here, not at the call sites, so a Keras whose structures differ is met in this
# one module.
def variable_path(variable: Any) -> str:
    """A variable's full name without the ``:0`` output index (TF's ``_shared_name``):
    the prefix of the names Keras gives its slots."""
    return variable._shared_name


def layers_in(model: Any) -> list:
    """Every layer inside ``model``, nested ones too, each once, in Keras' order (what
    ``model.layers`` would list if it recursed)."""
    return list(model._flatten_layers(include_self=False))


def build_optimizer(optimizer: Any, variables: list) -> None:
    """Makes ``optimizer``'s slots for ``variables`` now, as Keras does at its first step
    (legacy optimizers: ``_create_all_weights``; the others: ``build``)."""
    if hasattr(optimizer, "get_slot_names"):
        optimizer._create_all_weights(variables)
    else:
        optimizer.build(variables)


def call_concrete(concrete: Any, flat_args: list) -> Any:
    """Calls a traced ``ConcreteFunction`` with its flattened arguments, skipping the
    argument checks and flattening of ``__call__`` (see ``has_flat_call``)."""
    return concrete._call_flat(flat_args, concrete.captured_inputs)


def has_flat_call(concrete: Any) -> bool:
    """Whether ``call_concrete`` can call ``concrete``."""
    return hasattr(concrete, "_call_flat")


def tf_functions_in(function: Any) -> list:
    """``function`` if it is a ``tf.function``, else the ``tf.function`` s it closes
    over: Keras 3's ``model.train_function`` is a Python function around the
    ``tf.function`` of its loop, which calls the one of a step."""
    found, todo, seen = [], [function], set()
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if hasattr(current, "_list_all_concrete_functions"):
            found.append(current)
            continue
        todo += [cell.cell_contents for cell in getattr(current, "__closure__", None) or ()
                 if callable(cell.cell_contents)]
    return found


def traced_functions(function: Any) -> list:
    """Every ``ConcreteFunction`` a ``tf.function`` (or the ones ``tf_functions_in``
    finds) has traced so far."""
    return [concrete for inner in tf_functions_in(function)
            for concrete in inner._list_all_concrete_functions()]


def children_of(parent: Any) -> dict:
    """``parent``'s checkpoint children by name."""
    return parent._trackable_children()


def child_named(parent: Any, name: str) -> Any:
    """``parent``'s checkpoint child ``name`` (None when it has none)."""
    return parent._lookup_dependency(name)


def waiting_children(parent: Any) -> list:
    """Names of ``parent``'s children that a checkpoint read before they existed."""
    return list(parent._deferred_dependencies)


def restore_waiting_child(parent: Any, name: str, child: Any) -> None:
    """Hands ``child`` a restoration that waits for ``parent``'s child ``name`` (a
    checkpoint read before the child existed), as TF does for a tracked attribute."""
    parent._handle_deferred_dependencies(name, child)


def track_child(parent: Any, name: str, child: Any) -> None:
    """Makes ``child`` a checkpoint dependency of ``parent`` named ``name``, as an
    attribute assignment would, without the attribute."""
    parent._track_trackable(child, name=name, overwrite=True)


def distributed_containers(variable: Any) -> list:
    """The ``tf.distribute`` variables that ``variable`` is a per-device component of
    (its own container and its handle's), which strategies hand an optimizer's
    ``update_step`` in their place: read through ``_distributed_container``, the only
    link TF keeps (TF 2.15 to 2.21)."""
    found = []
    for owner in (variable, getattr(variable, "handle", None)):
        container = getattr(owner, "_distributed_container", None)
        if callable(container):
            found.append(container())
    return found


def uses_one_hot_matmul(layer: Any) -> bool:
    """Whether a Keras 2 ``Embedding`` layer looks up by one-hot matmul
    (``_use_one_hot_matmul``, set for TPU embedding); Keras 3's has no such mode."""
    return bool(getattr(layer, "_use_one_hot_matmul", False))
