"""The one door between tfhybrid and TensorFlow's and Keras' private structures.

This is the only module of tfhybrid that imports ``tensorflow.python`` (or Keras'
``src``) and the only one that patches a TensorFlow or Keras class or instance. TF
upgrades break exactly these places, so each switch names the versions it covers and
why the private structure is read at all. Supported: TensorFlow 2.15 and 2.21 (with
tf-keras of the same version); every hook checks that range when it is installed and
refuses another version, naming it and the hook.

Checkpoints hold tables and their slots under mesh-independent keys through TF's own
extension points: ``_gather_saveables_for_checkpoint`` nodes (the layer's ``tables``,
the optimizer's ``tfhybrid_table_slots``) and ``Trackable`` children that stand in for
an optimizer's numbered lists. Four hooks remain, each where TF has no public one, each
installed by an explicit, idempotent call, never by an import:

- ``install_saver_hook`` patches ``MultiDeviceSaver.save``: every Keras and TF save path
  ends there, and a save of sharded tables needs every rank to write its part of one
  checkpoint; TF's savers write a whole checkpoint per process. The checkpoint writer
  (``tfhybrid/checkpoint/writer.py``) installs it when a ``DistributedEmbedding`` is
  built, and reads the saver through ``saver_entries`` / ``registered_savers``.
- ``install_restore_hook`` patches ``CheckpointPosition.gather_ops_or_named_saveables``:
  a FIITED table's saved shape depends on the checkpoint being read, and TF tells a
  saveable nothing about it; the hook names the path (``restoring_path``) while TF
  gathers. Installed with the saver hook (``tfhybrid/checkpoint/tables.py``).
- ``install_slot_guard`` wraps the Keras optimizers' slot factories: a slot per entry of
  a tiered table's cache would be wrong, and Keras has no hook to refuse one. Installed
  when a ``tfhybrid.tiers.CachedTable`` is made.
- ``install_build_hook`` replaces ``build`` of an optimizer instance: Keras makes tracked
  lists there, and TF hands a waiting restoration to a new list by position; the hook
  holds waiting restorations back so the mesh-independent views get them. Installed
  when an optimizer is attached (``tfhybrid/checkpoint/slots.py``).

and two read-only uses: autograph's module rules (``_skip_autograph``: tfhybrid is
exempt from conversion, as TF and Keras exempt themselves; there is only a per-function
decorator), and the queries ``in_xla_context`` and ``variable_accessed``. TF's legacy
checkpoint classes (``SaveableObject``, ``SaveSpec``, ``Trackable``, ``ListWrapper``) and
the raw save ops (``save_v2``, ``merge_v2_checkpoints``) are handed out from here too.

Example::

    from tfhybrid import _tf_internals
    assert _tf_internals.TF_VERSION >= (2, 15)
"""

from __future__ import annotations

import contextvars
import os
import sys
from typing import Any, Callable

import tensorflow as tf
from tensorflow.python.checkpoint import functional_saver
from tensorflow.python.checkpoint import restore as restore_lib
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import gen_io_ops
from tensorflow.python.ops import io_ops
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.trackable import data_structures
from tensorflow.python.training.saving import saveable_object


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


TF_VERSION = _version(tf.__version__)
# The TensorFlow versions every hook below was written for and tested on (2.15 and 2.21,
# with the switches between them); another version may have moved what they patch.
HOOKS_WRITTEN_FOR = ((2, 15), (2, 21))


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


def registered_savers(saver: Any) -> dict:
    """The checkpoint savers registered with a ``MultiDeviceSaver`` (by name), which
    write their own files and so cannot take part in a save written by all ranks."""
    return saver._registered_savers


# ------------------------------------------------------------------ classes and queries
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


# ------------------------------------------------------------------ Keras' structures
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


def built_for(optimizer: Any, variable: Any) -> bool:
    """Whether a (non-legacy) Keras ``optimizer`` was built with ``variable``: its slots
    are indexed by the variable's key."""
    return optimizer._var_key(variable) in getattr(optimizer, "_index_dict", {})


def count_train_step(model: Any) -> Any:
    """Adds one to ``model``'s step counter, as Keras' own train function does after each
    ``train_step`` (``model.fit``'s callbacks and logs read it)."""
    return model._train_counter.assign_add(1)


def steps_per_execution(model: Any) -> int:
    """How many steps ``model.fit`` runs per call of its train function (compile's
    ``steps_per_execution``; 1 when unset)."""
    steps = model._steps_per_execution
    return 1 if steps is None else int(steps.numpy())


def call_concrete(concrete: Any, flat_args: list) -> Any:
    """Calls a traced ``ConcreteFunction`` with its flattened arguments, skipping the
    argument checks and flattening of ``__call__`` (see ``has_flat_call``)."""
    return concrete._call_flat(flat_args, concrete.captured_inputs)


def has_flat_call(concrete: Any) -> bool:
    """Whether ``call_concrete`` can call ``concrete``."""
    return hasattr(concrete, "_call_flat")


def traced_functions(function: Any) -> list:
    """Every ``ConcreteFunction`` a ``tf.function`` has traced so far."""
    return list(function._list_all_concrete_functions())


def children_of(parent: Any) -> dict:
    """``parent``'s checkpoint children by name."""
    return parent._trackable_children()


def child_named(parent: Any, name: str) -> Any:
    """``parent``'s checkpoint child ``name`` (None when it has none)."""
    return parent._lookup_dependency(name)


def waiting_children(parent: Any) -> list:
    """Names of ``parent``'s children that a checkpoint read before they existed."""
    return list(parent._deferred_dependencies)


# ------------------------------------------------------------------ hooks
def _check_version(hook: str) -> None:
    """Refuses to patch a TensorFlow the hook was not written for."""
    low, high = HOOKS_WRITTEN_FOR
    if not low <= TF_VERSION <= high:
        raise RuntimeError(
            f"tfhybrid's {hook} hook patches TensorFlow's private structures and was "
            f"written for TensorFlow {low[0]}.{low[1]} to {high[0]}.{high[1]}; this is "
            f"TensorFlow {tf.__version__}, where they may differ")


# a hook's mark on what it installed, holding the callback it calls
_HOOK_MARK = "_tfhybrid_hook"
SaveCallback = Callable[[Any, Any, Any, Callable[..., Any]], Any]


def install_saver_hook(save: SaveCallback) -> None:
    """Makes every checkpoint write call ``save(saver, file_prefix, options, original)``
    in place of ``MultiDeviceSaver.save``; ``original(saver, file_prefix, options)`` is
    TensorFlow's own. Idempotent; one callback per process."""
    _check_version("MultiDeviceSaver.save")
    current = functional_saver.MultiDeviceSaver.save
    installed = getattr(current, _HOOK_MARK, None)
    if installed is save:
        return
    if installed is not None:
        raise RuntimeError("MultiDeviceSaver.save is hooked already, by another callback")

    def hooked_save(saver: Any, file_prefix: Any, options: Any = None) -> Any:
        return save(saver, file_prefix, options, current)

    setattr(hooked_save, _HOOK_MARK, save)
    functional_saver.MultiDeviceSaver.save = hooked_save


# The checkpoint a restore is reading, while TensorFlow gathers the objects to restore
_RESTORING: "contextvars.ContextVar[str | None]" = contextvars.ContextVar(
    "tfhybrid_restoring", default=None)


def install_restore_hook() -> None:
    """Makes the path of the checkpoint being restored known (``restoring_path``) while
    TensorFlow asks the objects what they restore: every restore path, eager or
    deferred, asks there. Idempotent."""
    _check_version("CheckpointPosition.gather_ops_or_named_saveables")
    original = restore_lib.CheckpointPosition.gather_ops_or_named_saveables
    if getattr(original, _HOOK_MARK, False):
        return

    def gather_ops_or_named_saveables(position):
        token = _RESTORING.set(position.checkpoint.save_path_string)
        try:
            return original(position)
        finally:
            _RESTORING.reset(token)

    setattr(gather_ops_or_named_saveables, _HOOK_MARK, True)
    restore_lib.CheckpointPosition.gather_ops_or_named_saveables = \
        gather_ops_or_named_saveables


def restoring_path() -> str | None:
    """The checkpoint being restored while TensorFlow gathers what objects restore (with
    ``install_restore_hook``), else None."""
    return _RESTORING.get()


# checks that run before a Keras optimizer makes a slot, in the order installed
_SLOT_GUARDS: list[Callable[[Any, Any, Any], None]] = []
# the slot factories of the new and the legacy Keras optimizers
_SLOT_FACTORIES = ((lambda: tf.keras.optimizers.Optimizer, "add_variable_from_reference"),
                   (lambda: tf.keras.optimizers.legacy.Optimizer, "add_slot"))


def install_slot_guard(check: Callable[[Any, Any, Any], None]) -> None:
    """Runs ``check(optimizer, variable, slot_name)`` before any Keras optimizer (new or
    legacy) makes a slot for ``variable``; it raises to refuse the slot. Idempotent."""
    _check_version("Keras optimizer slot factory")
    for base, name in _SLOT_FACTORIES:
        owner = next(k for k in base().__mro__ if name in vars(k))
        if not getattr(vars(owner)[name], _HOOK_MARK, False):
            setattr(owner, name, _guarded_slots(vars(owner)[name]))
    if check not in _SLOT_GUARDS:
        _SLOT_GUARDS.append(check)


def _guarded_slots(create: Callable) -> Callable:
    """``create`` (an optimizer's slot factory) behind the installed guards."""
    def create_slot(self, *args, **kwargs):
        # new optimizers: (model_variable, variable_name); legacy ones: (var, slot_name)
        variable = args[0] if args else kwargs.get("model_variable", kwargs.get("var"))
        slot_name = args[1] if len(args) > 1 else kwargs.get(
            "variable_name", kwargs.get("slot_name"))
        for check in _SLOT_GUARDS:
            check(self, variable, slot_name)
        return create(self, *args, **kwargs)
    setattr(create_slot, _HOOK_MARK, True)
    return create_slot


def install_build_hook(optimizer: Any, after_build: Callable[[], None]) -> None:
    """Replaces ``optimizer``'s build (legacy Keras: ``_create_all_weights``, where they
    make slots) by one that holds back the restorations waiting for its children while
    Keras builds, puts them back, then calls ``after_build()`` (each callback installed,
    in order). Idempotent per optimizer and callback.

    Keras creates some tracked lists in ``build``; TensorFlow would hand a restoration
    waiting for such a list to the new list itself, whose positions are mesh-dependent;
    ``after_build`` hands them to the mesh-independent views instead.
    """
    _check_version("optimizer build")
    method = "_create_all_weights" if hasattr(optimizer, "get_slot_names") else "build"
    own_build = getattr(optimizer, method)
    callbacks = getattr(own_build, _HOOK_MARK, None)
    if callbacks is not None:
        if after_build not in callbacks:
            callbacks.append(after_build)
        return
    callbacks = [after_build]

    def build(*args, **kwargs):
        waiting = dict(optimizer._deferred_dependencies)
        optimizer._deferred_dependencies.clear()
        try:
            return own_build(*args, **kwargs)
        finally:
            for name, positions in waiting.items():
                optimizer._deferred_dependencies.setdefault(name, []).extend(positions)
            for callback in callbacks:
                callback()

    setattr(build, _HOOK_MARK, callbacks)
    # an instance attribute, past Keras' __setattr__, which would track it
    object.__setattr__(optimizer, method, build)


def wrap_apply_gradients(optimizer: Any, apply: Callable[..., Any]) -> None:
    """Makes ``optimizer.apply_gradients(...)`` call ``apply(own_apply, ...)`` on this
    instance (``own_apply`` is its method before), for an optimizer whose class is the
    user's. Idempotent per optimizer."""
    _check_version("optimizer apply_gradients")
    own_apply = optimizer.apply_gradients
    if getattr(own_apply, _HOOK_MARK, False):
        return

    def apply_gradients(*args, **kwargs):
        return apply(own_apply, *args, **kwargs)

    setattr(apply_gradients, _HOOK_MARK, True)
    # an instance attribute, past Keras' __setattr__, which would track it
    object.__setattr__(optimizer, "apply_gradients", apply_gradients)


def restore_waiting_child(parent: Any, name: str, child: Any) -> None:
    """Hands ``child`` a restoration that waits for ``parent``'s child ``name`` (a
    checkpoint read before the child existed), as TF does for a tracked attribute."""
    parent._handle_deferred_dependencies(name, child)


def track_child(parent: Any, name: str, child: Any) -> None:
    """Makes ``child`` a checkpoint dependency of ``parent`` named ``name``, as an
    attribute assignment would, without the attribute."""
    parent._track_trackable(child, name=name, overwrite=True)
