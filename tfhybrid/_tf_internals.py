"""The one door between tfhybrid and TensorFlow's and Keras' private structures.

This is the only module of tfhybrid that imports ``tensorflow.python`` (or Keras'
``src``) and the only one that patches a TensorFlow or Keras class or instance. TF
upgrades break exactly these places, so each switch names the versions it covers and
why the private structure is read at all. Supported: TensorFlow 2.15 and 2.21, with
tf-keras of the same version or (2.21) Keras 3 as ``tf.keras``: ``KERAS_MAJOR`` says
which, and every difference between the two Kerases that tfhybrid meets is switched
here (``OptimizerBase``, ``add_weight``, ``tf_variable``, slot names, ``built_for``)
or in a store's variable access. Every hook checks the TF range when it is installed
and refuses another version, naming it and the hook.

Checkpoints hold tables and their slots under mesh-independent keys through TF's own
extension points: ``_gather_saveables_for_checkpoint`` nodes (the layer's ``tables``,
the optimizer's ``tfhybrid_table_slots``) and ``Trackable`` children that stand in for
an optimizer's numbered lists. Five hooks remain, each where TF or Keras has no public
one, each installed by an explicit, idempotent call, never by an import:

- ``install_saver_hook`` patches ``MultiDeviceSaver.save``: every Keras and TF save path
  ends there, and a save of sharded tables needs every rank to write its part of one
  checkpoint; TF's savers write a whole checkpoint per process. The checkpoint writer
  (``tfhybrid/checkpoint/writer.py``) installs it when a ``DistributedEmbedding`` is
  built, and reads the saver through ``saver_entries`` / ``registered_savers``.
- ``install_restore_hook`` patches ``CheckpointPosition.gather_ops_or_named_saveables``:
  a FIITED table's saved shape depends on the checkpoint being read, and TF tells a
  saveable nothing about it; the hook names the path (``restoring_path``) while TF
  gathers. Installed with the saver hook (``tfhybrid/checkpoint/tables.py``).
- ``install_slot_guard`` wraps the Keras optimizers' slot factories (and Keras 3's
  ``build``): a slot per entry of a tiered table's cache would be wrong, and Keras has no
  hook to refuse one. Installed when a ``tfhybrid.tiers.CachedTable`` is made.
- ``install_build_hook`` replaces ``build`` of an optimizer instance: Keras makes tracked
  lists there, and TF hands a waiting restoration to a new list by position; the hook
  holds waiting restorations back so the mesh-independent views get them. Installed
  when an optimizer is attached (``tfhybrid/checkpoint/slots.py``).

- ``install_weights_file_hook`` (Keras 3) patches ``saving_lib.save_weights_only``: a
  ``.weights.h5`` of sharded tables needs every rank's part and one writer
  (``tfhybrid/checkpoint/weights_file.py``), and ``replace_own_variables`` gives an
  optimizer the weights-file state that ``load_own_variables`` reads. With it,
  ``install_backup_cleanup_hook`` patches ``BackupAndRestore.on_train_end``: every rank
  runs the callback, and one rank must delete the backup, once the others are done.

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

import contextlib
import contextvars
import os
import re
import sys
from typing import Any, Callable, Iterator

import numpy as np
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


def _keras_major() -> int:
    """The major version of the Keras that ``tf.keras`` is: 2 (tf-keras, or TF <= 2.15's
    own) or 3. TF >= 2.16 picks Keras 3 unless ``TF_USE_LEGACY_KERAS`` is set before its
    first use of ``tf.keras``; that choice is the user's. Any other Keras is refused here,
    naming it, rather than failing far from the cause."""
    # tf.keras of TF <= 2.15 has no __version__; the package defining its Model has
    package = sys.modules[tf.keras.Model.__module__.split(".")[0]]
    version = getattr(tf.keras, "__version__", None) or getattr(package, "__version__", "")
    major = version.split(".")[0]
    if major not in ("2", "3"):
        raise ImportError(
            f"tfhybrid runs with Keras 2 (tf-keras) or Keras 3 as tf.keras, but tf.keras is "
            f"Keras {version!r} (TensorFlow {tf.__version__}); TF_USE_LEGACY_KERAS is "
            f"{os.environ.get('TF_USE_LEGACY_KERAS')!r}")
    return int(major)


# Which Keras tf.keras is: every difference between Keras 2 and 3 that tfhybrid meets is
# switched on this, in this module or in a store's variable access.
KERAS_MAJOR = _keras_major()
KERAS_3 = KERAS_MAJOR == 3


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


def add_weight(add: Callable[..., Any], *, autocast: bool = True, **kwargs: Any) -> Any:
    """Calls a layer's ``add_weight`` (``add``) with keyword arguments; ``autocast=False``
    keeps the weight's dtype under a mixed-precision policy. Keras 2 calls that argument
    ``experimental_autocast``, Keras 3 ``autocast``."""
    kwargs["autocast" if KERAS_3 else "experimental_autocast"] = autocast
    return add(**kwargs)


def tf_variable(variable: Any) -> Any:
    """The ``tf.Variable`` that holds a weight's value. A Keras 3 weight is a
    ``keras.Variable`` wrapping one (its ``.value`` would be cast under a mixed-precision
    scope); a Keras 2 weight, like any ``tf.Variable``, is its own. Everything tfhybrid
    does to a variable's storage (sparse reads, scatters, handles, identity) goes
    through this."""
    if KERAS_3 and isinstance(variable, tf.keras.Variable):
        return variable._value
    return variable


def table_variable(add: Callable[..., Any] | None, initial_value: Any, *, name: str,
                   trainable: bool = True, shape: Any = None, table: str | None = None,
                   name_scope: bool = False) -> tf.Variable:
    """A variable of a table that a layer holds (a FIITED pool, a tier's cache, their
    per-row state), as the ``tf.Variable`` the table reads and updates, from
    ``initial_value`` (a tensor, or a callable giving one, called outside any function
    being traced). ``add`` is the layer's ``add_weight`` (None: a table on its own);
    ``shape`` the static shape when not the initial value's (a ``None`` dimension lets
    ``assign`` resize it, as a pool's adjustment does); ``table`` the table's name.

    Keras 2, or no ``add``: a plain ``tf.Variable`` ("<table>/<name>" with
    ``name_scope``, else "<name>", as tfhybrid always named them); a Keras 2 layer
    tracks, trains and checkpoints the variables of a ``tf.Module`` it holds. Keras 3
    tracks only ``keras.Variable`` s made through the layer: ``add`` makes the weight,
    named "<table>_<name>" (Keras 3 names a weight by its own name alone, forbids "/" in
    it, and gradient syncs name their collectives by it: each table's must differ, alike
    on every rank), and the ``tf.Variable`` inside it (``tf_variable``) is returned, so
    that checkpoints find it where the table holds it, as in Keras 2. Keras 3 makes a
    weight's ``tf.Variable`` of fixed shape, so a resizable one replaces it (its
    ``_value``), made in the same name scope, and the weight records the ``None``
    dimension (``_shape``) for its own ``assign``.
    """
    if not KERAS_3 or add is None:
        with tf.name_scope(table) if table and name_scope else contextlib.nullcontext():
            return tf.Variable(initial_value, trainable=trainable, name=name, shape=shape)
    name = f"{table}_{name}" if table else name
    with real_variables():
        value = tf.convert_to_tensor(initial_value() if callable(initial_value)
                                     else initial_value)
        resizable = shape is not None and not tf.TensorShape(shape).is_fully_defined()
        static = value.shape
        if resizable:   # a placeholder of no entries until the resizable one replaces it
            static = [0 if size is None else size for size in tf.TensorShape(shape)]
        weight = add_weight(
            add, name=name, shape=tuple(static), dtype=value.dtype, trainable=trainable,
            initializer=lambda shape, dtype=None: (tf.zeros(shape, dtype) if resizable
                                                   else value),
            autocast=False)
        if resizable:
            outer = weight._value.name.rpartition("/")[0]
            with tf.name_scope(f"{outer}/" if outer else ""):
                weight._value = tf.Variable(value, trainable=trainable, name=name,
                                            shape=shape)
            weight._shape = tuple(tf.TensorShape(shape).as_list())
    return weight._value


def is_slot_of(slot: Any, variable: Any) -> str | None:
    """The slot name ("m", "accumulator", ...) if ``slot`` is a new-style Keras
    optimizer's slot of ``variable`` by Keras' naming rule, else None.

    Keras 2 names a slot "<slot>/<variable path>" (Adam's "m/dense/kernel", with name
    scopes in front when built inside ``apply_gradients``) and tfhybrid's row-wise
    optimizers "<variable path>/accumulator"; Keras 3 names it "<variable path with _
    for />_<slot>" (``add_variable_from_reference``).
    """
    if slot is variable:
        return None
    if KERAS_3:
        prefix = _keras_3_slot_prefix(variable)
        name = slot.name
        return name[len(prefix):] or None if name.startswith(prefix) else None
    shared = variable_path(variable)
    name = slot.name.split(":")[0]
    match = re.search(r"(^|/)" + re.escape(shared) + r"(/|:|$)", name)
    if match is None:
        return None
    # "m/<var>" -> "m", "<var>/accumulator" -> "accumulator"; name scopes in front
    # ("Adam/m/<var>" when built inside apply_gradients) are dropped; a variable that
    # merely has the same name (plain tf.Variables are all "Variable") is no slot
    suffix = name[match.end():].strip("/")
    return suffix or name[:match.start()].strip("/").rsplit("/", 1)[-1] or None


def state_name(optimizer: Any, variable: Any, slot: str) -> str:
    """The name Keras would give ``optimizer``'s slot ``slot`` of ``variable`` (see
    ``is_slot_of``), for a slot an optimizer makes itself."""
    if KERAS_3:
        return f"{_keras_3_slot_prefix(variable)}{slot}"
    return f"{variable_path(variable)}/{slot}"


def _keras_3_slot_prefix(variable: Any) -> str:
    # Keras 3's add_variable_from_reference: a Keras weight by its path, anything else
    # by its name
    if hasattr(variable, "path"):
        return f"{variable.path.replace('/', '_')}_"
    return f"{str(variable.name).replace('/', '_').replace(':', '_')}_"


@contextlib.contextmanager
def real_variables() -> Iterator[None]:
    """Makes the variables created inside real ones, now, also where Keras 3 builds a
    layer symbolically. Keras 3 builds a subclassed model by tracing its ``call`` in a
    scratch graph under a "stateless scope", where a weight's ``tf.Variable`` comes only
    after the scope ends; a ``DistributedEmbedding`` records each weight's role at build
    time, and its stores work on the ``tf.Variable`` itself (``tf_variable``)."""
    if not KERAS_3:
        yield
        return
    from keras.src.backend.common import global_state
    stateless = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        with tf.init_scope():
            yield
    finally:
        global_state.set_global_attribute("stateless_scope", stateless)


def in_symbolic_call() -> bool:
    """True while Keras 3 calls layers on symbolic tensors in a scratch graph whose ops
    never run: to build a layer whose ``build`` is Keras' default (a subclassed model's,
    on its first call), or to infer output specs (``compute_output_spec``, under its
    ``SymbolicScope``). Keras 2 builds by the real call: always False."""
    if not KERAS_3:
        return False
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    return in_symbolic_scope()


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


def scattering_sgd(learning_rate: float) -> Any:
    """A plain SGD (no momentum) that scatters a sparse gradient into the rows it
    touches and keeps no state per variable. Keras 2's new SGD keeps a momentum slot for
    every variable even at momentum 0 and updates it densely (a pass over every table
    per step, twice the memory), so Keras 2 takes its legacy SGD; Keras 3's SGD makes no
    slot at momentum 0 and scatters ``IndexedSlices`` (``assign_sub`` ->
    ``scatter_sub``)."""
    if KERAS_3:
        return tf.keras.optimizers.SGD(learning_rate)
    return tf.keras.optimizers.legacy.SGD(learning_rate)


def without_xla_update() -> dict:
    """Keyword arguments of a Keras optimizer that keep its update out of XLA: Keras 2's
    ``jit_compile=False``; Keras 3 optimizers take no such argument (their update is
    compiled with the model's step, as ``model.compile(jit_compile=...)`` says)."""
    return {} if KERAS_3 else {"jit_compile": False}


def built_for(optimizer: Any, variable: Any) -> bool:
    """Whether a (non-legacy) Keras ``optimizer`` was built with ``variable``: its slots
    are indexed by the variable's key."""
    # Keras 2 indexes slots in _index_dict, Keras 3 in _trainable_variables_indices
    index = getattr(optimizer, "_trainable_variables_indices" if KERAS_3 else "_index_dict",
                    {})
    return optimizer._var_key(variable) in index


# ------------------------------------------------------------------ loss scaling
# Keras 2's LossScaleOptimizer takes gradients already unscaled (the user, or its own
# ``minimize``, calls ``get_unscaled_gradients``); Keras 3's takes the gradients of the
# scaled loss and unscales them in ``apply``, as does any Keras 3 optimizer with a fixed
# ``loss_scale_factor`` (Keras 3's form of Keras 2's ``dynamic=False``).
def _is_loss_scale_optimizer(optimizer: Any) -> bool:
    return isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)


def loss_scale(optimizer: Any) -> Any:
    """The factor ``optimizer`` scales losses by now, or None when it scales none.
    Keras 2: a LossScaleOptimizer's ``loss_scale``. Keras 3: a LossScaleOptimizer's
    ``dynamic_scale`` (a variable made by ``build``; ``initial_scale`` before, which is
    what its ``scale_loss`` uses then), else the optimizer's ``loss_scale_factor``."""
    if optimizer is None:
        return None
    if not KERAS_3:
        return optimizer.loss_scale if _is_loss_scale_optimizer(optimizer) else None
    if _is_loss_scale_optimizer(optimizer):
        return optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale
    return getattr(optimizer, "loss_scale_factor", None)


def applied_gradient_scale(optimizer: Any, variables: list | None = None) -> Any:
    """The factor the gradients handed to ``optimizer.apply_gradients`` carry (None:
    they are unscaled). Keras 2: None (its LossScaleOptimizer is handed unscaled
    gradients). Keras 3: ``loss_scale(optimizer)``; a LossScaleOptimizer not yet built
    is built for ``variables`` first, as its ``apply`` would, so the scale read is the
    variable its step updates."""
    if not KERAS_3:
        return None
    if _is_loss_scale_optimizer(optimizer) and not optimizer.built:
        if variables is None:
            raise ValueError(f"{optimizer!r} is not built: pass the variables it applies to")
        with tf.keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(list(variables))
        optimizer.built = True
    return loss_scale(optimizer)


def scaled_loss(optimizer: Any, loss: Any) -> Any:
    """``loss`` times ``optimizer``'s loss scale, to take gradients of (Keras 2:
    ``get_scaled_loss`` of a LossScaleOptimizer; Keras 3: ``scale_loss``)."""
    if KERAS_3:
        return optimizer.scale_loss(loss)
    return optimizer.get_scaled_loss(loss) if _is_loss_scale_optimizer(optimizer) else loss


def gradients_to_apply(optimizer: Any, grads: list) -> list:
    """The gradients of ``scaled_loss`` as ``optimizer.apply_gradients`` takes them:
    Keras 2 unscaled (``get_unscaled_gradients``); Keras 3 as they are (its optimizers
    unscale in ``apply``)."""
    if KERAS_3 or not _is_loss_scale_optimizer(optimizer):
        return list(grads)
    return optimizer.get_unscaled_gradients(grads)


def apply_unscaled(optimizer: Any, apply: Callable[..., Any], pairs: list, *args: Any,
                   **kwargs: Any) -> Any:
    """Applies (gradient, variable) ``pairs`` already divided by
    ``applied_gradient_scale(optimizer)``; ``apply`` is ``optimizer``'s own
    ``apply_gradients``. Keras 2, or no scale: ``apply(pairs, ...)``.

    Keras 3's own ``apply`` would divide them again, so its steps run here: a
    LossScaleOptimizer's as Keras 3's ``LossScaleOptimizer.apply`` runs them (all
    gradients finite: the inner optimizer applies them, and after
    ``dynamic_growth_steps`` finite steps in a row the scale doubles; else the step is
    skipped, ``iterations`` stays and the scale halves); an optimizer with a
    ``loss_scale_factor`` applies them with the factor off for the call.
    """
    if applied_gradient_scale(optimizer) is None:
        return apply(pairs, *args, **kwargs)
    if not _is_loss_scale_optimizer(optimizer):
        factor = optimizer.loss_scale_factor
        optimizer.loss_scale_factor = None
        try:
            return apply(pairs, *args, **kwargs)
        finally:
            optimizer.loss_scale_factor = factor
    grads = [g for g, _ in pairs]

    def finite_step():
        optimizer.inner_optimizer.apply_gradients(pairs)
        grow = tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1)

        def doubled():
            optimizer.step_counter.assign(0)
            optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 2.0)
            return tf.constant(True)

        def counted():
            optimizer.step_counter.assign_add(1)
            return tf.constant(False)

        tf.cond(grow, doubled, counted)
        return tf.constant(True)

    def skipped_step():
        optimizer.step_counter.assign(0)
        optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
        return tf.constant(False)

    # its check_finite would densify a table's IndexedSlices
    present = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads
               if g is not None]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in present]
                           or [tf.constant(True)])
    tf.cond(finite, finite_step, skipped_step)
    return optimizer.iterations


def count_train_step(model: Any) -> Any:
    """Adds one to ``model``'s step counter, as Keras' own train function does after each
    ``train_step`` (``model.fit``'s callbacks and logs read it). Keras 2 counts in
    ``model._train_counter``; Keras 3 has no such counter (its epoch iterator counts the
    steps, and the optimizer its own iterations), so there is nothing to add: None."""
    if KERAS_3:
        return None
    return model._train_counter.assign_add(1)


def steps_per_execution(model: Any) -> int:
    """How many steps ``model.fit`` runs per call of its train function (compile's
    ``steps_per_execution``; 1 when unset). Keras 2 keeps it in a variable,
    ``model._steps_per_execution``; Keras 3 as the int ``model.steps_per_execution``."""
    if KERAS_3:
        return int(model.steps_per_execution or 1)
    steps = model._steps_per_execution
    return 1 if steps is None else int(steps.numpy())


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


# ------------------------------------------------------------------ optimizer base
class OptimizerBase(tf.keras.optimizers.Optimizer):
    """``tf.keras.optimizers.Optimizer`` with the parts Keras 2 and Keras 3 name
    differently behind one interface, for tfhybrid's own optimizers.

    A subclass implements ``apply_step(gradient, variable, learning_rate)`` (Keras 2
    calls ``update_step(gradient, variable)``, Keras 3 ``update_step(gradient, variable,
    learning_rate)``), makes its state in ``build`` with ``add_state`` and finds it with
    ``state_index``. ``jit_compile`` is Keras 2's (Keras 3 optimizers compile with the
    model, so it is dropped there).

    Example::

        import tensorflow as tf
        from tfhybrid._tf_internals import OptimizerBase

        class Halve(OptimizerBase):
            def apply_step(self, gradient, variable, learning_rate):
                variable.assign(variable / 2)

        weight = tf.Variable([4.0])
        Halve(0.1).apply_gradients([(tf.constant([1.0]), weight)])
        assert weight.numpy()[0] == 2.0
    """

    def __init__(self, learning_rate: Any, name: str | None = None,
                 jit_compile: bool = False, **kwargs: Any):
        if KERAS_3:
            super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        else:
            super().__init__(name=name, jit_compile=jit_compile, **kwargs)
            self._learning_rate = self._build_learning_rate(learning_rate)

    def apply_step(self, gradient: Any, variable: Any, learning_rate: Any) -> Any:
        raise NotImplementedError

    if KERAS_3:
        def update_step(self, gradient, variable, learning_rate):
            return self.apply_step(gradient, variable, learning_rate)
    else:
        def update_step(self, gradient, variable):
            return self.apply_step(gradient, variable, self.learning_rate)

    def state_index(self, variable: Any) -> int:
        """The position of ``variable`` among the variables the optimizer was built with."""
        if KERAS_3:
            return self._get_variable_index(variable)
        return self._index_dict[self._var_key(variable)]

    def add_state(self, variable: Any, slot: str, shape: Any, dtype: Any,
                  fill_value: float) -> Any:
        """A new slot ``slot`` of ``variable`` of ``shape`` and ``dtype``, every entry
        ``fill_value``, placed with ``variable`` and tracked (saved with the optimizer)."""
        name = state_name(self, variable, slot)

        def initial(shape=shape, dtype=dtype):
            return tf.fill(shape, tf.constant(fill_value, dtype))

        if KERAS_3:
            return self.add_variable(shape=shape, dtype=dtype, name=name,
                                     initializer=initial)
        with tf.distribute.get_strategy().extended.colocate_vars_with(variable):
            state = tf.Variable(initial(), name=name, dtype=dtype, trainable=False)
        self._variables.append(state)
        return state

    def track_state(self, state: Any) -> None:
        """Saves ``state`` (a variable made elsewhere) with the optimizer's variables."""
        if KERAS_3:
            self._track_variable(state)
        else:
            self._variables.append(state)

    def get_config(self) -> dict:
        config = super().get_config()
        if not KERAS_3:
            # Keras 3's base writes it; Keras 2's returns a numpy float32 for a variable,
            # and a Python float is JSON-friendly
            value = self._serialize_hyperparameter(self._learning_rate)
            config["learning_rate"] = (float(value) if isinstance(value, (float, np.floating))
                                       else value)
        return config


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
# the callbacks of an optimizer's build hook (install_build_hook)
_BUILD_HOOK_MARK = "_tfhybrid_build_callbacks"
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
# the slot factories of the Keras optimizers: Keras 2's new and legacy ones; Keras 3 has
# one kind (its ``optimizers.legacy`` names stubs that refuse to be built)
_SLOT_FACTORIES = (((lambda: tf.keras.optimizers.Optimizer, "add_variable_from_reference"),)
                   if KERAS_3 else
                   ((lambda: tf.keras.optimizers.Optimizer, "add_variable_from_reference"),
                    (lambda: tf.keras.optimizers.legacy.Optimizer, "add_slot")))


# An optimizer that makes no slot for a variable (SGD without momentum: Keras 3's, and
# Keras 2's legacy one) would pass the slot guards unseen, so the guards also see each
# variable an optimizer is built with (with slot name None)
_BUILDS = (((lambda: tf.keras.optimizers.Optimizer, "build"),) if KERAS_3 else
           ((lambda: tf.keras.optimizers.Optimizer, "build"),
            (lambda: tf.keras.optimizers.legacy.Optimizer, "_create_all_weights")))


def install_slot_guard(check: Callable[[Any, Any, Any], None]) -> None:
    """Runs ``check(optimizer, variable, slot_name)`` before any Keras optimizer (new or
    legacy) makes a slot for ``variable``, and ``check(optimizer, variable, None)`` for
    each variable before an optimizer is built with it; it raises to refuse.
    Idempotent."""
    _check_version("Keras optimizer slot factory")
    for factories, guard in ((_SLOT_FACTORIES, _guarded_slots), (_BUILDS, _guarded_build)):
        for base, name in factories:
            owner = next(k for k in base().__mro__ if name in vars(k))
            if not getattr(vars(owner)[name], _HOOK_MARK, False):
                setattr(owner, name, guard(vars(owner)[name]))
    if check not in _SLOT_GUARDS:
        _SLOT_GUARDS.append(check)


def _guarded_build(build: Callable) -> Callable:
    """``build`` (an optimizer's ``build(variables)``, a legacy one's
    ``_create_all_weights(variables)``) behind the installed guards."""
    def guarded_build(self, variables, *args, **kwargs):
        variables = list(variables)
        for variable in variables:
            for check in _SLOT_GUARDS:
                check(self, variable, None)
        return build(self, variables, *args, **kwargs)
    setattr(guarded_build, _HOOK_MARK, True)
    return guarded_build


def _guarded_slots(create: Callable) -> Callable:
    """``create`` (an optimizer's slot factory) behind the installed guards."""
    def create_slot(self, *args, **kwargs):
        # Keras 2's new optimizers: (model_variable, variable_name); its legacy ones:
        # (var, slot_name); Keras 3: (reference_variable, name)
        variable = args[0] if args else next(
            (kwargs[k] for k in ("model_variable", "var", "reference_variable")
             if k in kwargs), None)
        slot_name = args[1] if len(args) > 1 else next(
            (kwargs[k] for k in ("variable_name", "slot_name", "name") if k in kwargs), None)
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
    # a mark of its own: the build it wraps may be a class's, guarded by a slot guard
    callbacks = getattr(own_build, _BUILD_HOOK_MARK, None)
    if callbacks is not None:
        if after_build not in callbacks:
            callbacks.append(after_build)
        return
    callbacks = [after_build]

    def build(*args, **kwargs):
        waiting = dict(optimizer._deferred_dependencies)
        optimizer._deferred_dependencies.clear()
        # Keras 2 builds under tf.init_scope; Keras 3 inside the traced step, where the
        # restorations below would become ops of every step instead of running once
        with tf.init_scope():
            try:
                return own_build(*args, **kwargs)
            finally:
                for name, positions in waiting.items():
                    optimizer._deferred_dependencies.setdefault(name, []).extend(positions)
                for callback in callbacks:
                    callback()

    setattr(build, _BUILD_HOOK_MARK, callbacks)
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


def install_weights_file_hook(save: Callable[..., Any]) -> None:
    """Makes Keras 3's ``model.save_weights`` call ``save(model, filepath, original,
    *args, **kwargs)`` in place of ``saving_lib.save_weights_only`` (``original``):
    Keras 3 writes a weights file from every process that saves, and a file of sharded
    tables needs every rank's part but one writer. Idempotent; one callback."""
    _check_version("Keras 3 save_weights_only")
    from keras.src.saving import saving_lib
    current = saving_lib.save_weights_only
    installed = getattr(current, _HOOK_MARK, None)
    if installed is save:
        return
    if installed is not None:
        raise RuntimeError("save_weights_only is hooked already, by another callback")

    def save_weights_only(model, filepath, *args, **kwargs):
        return save(model, filepath, current, *args, **kwargs)

    setattr(save_weights_only, _HOOK_MARK, save)
    saving_lib.save_weights_only = save_weights_only


def install_shared_folder_hook() -> None:
    """Makes Keras 3's ``file_utils.makedirs`` accept a local folder that exists once
    it returns. Keras' callbacks check that a folder is missing, then create it; when
    every rank of a job runs the callback, another rank can create it in between, and
    Keras' ``os.makedirs`` then fails on that rank alone, which leaves the others in a
    collective. A path that exists as a file still fails. Idempotent."""
    _check_version("Keras 3 file_utils.makedirs")
    from keras.src.utils import file_utils
    current = file_utils.makedirs
    if getattr(current, _HOOK_MARK, False):
        return

    def makedirs(path):
        try:
            return current(path)
        except FileExistsError:
            if file_utils.is_remote_path(path) or not os.path.isdir(path):
                raise
            return None

    setattr(makedirs, _HOOK_MARK, True)
    file_utils.makedirs = makedirs


def install_backup_cleanup_hook(clean_up: Callable[[Any, Callable[[], None]], None]) -> None:
    """Makes Keras 3's ``BackupAndRestore.on_train_end`` call ``clean_up(callback,
    own)`` (``own()`` runs Keras' own: it deletes the backup folder). Every rank of a
    job runs the callback and would delete the same files at once. Idempotent; one
    callback."""
    _check_version("Keras 3 BackupAndRestore.on_train_end")
    from keras.src.callbacks import backup_and_restore
    cls = backup_and_restore.BackupAndRestore
    current = cls.on_train_end
    installed = getattr(current, _HOOK_MARK, None)
    if installed is clean_up:
        return
    if installed is not None:
        raise RuntimeError("BackupAndRestore.on_train_end is hooked already, by another "
                           "callback")

    def on_train_end(self, logs=None):
        return clean_up(self, lambda: current(self, logs))

    setattr(on_train_end, _HOOK_MARK, clean_up)
    cls.on_train_end = on_train_end


def replace_own_variables(obj: Any, save: Callable[[Any], None],
                          load: Callable[[Any], None]) -> None:
    """Makes Keras 3's weights files ask ``save(store)`` / ``load(store)`` for ``obj``'s
    state (an optimizer whose class is the user's), in place of its own
    ``save_own_variables`` / ``load_own_variables``."""
    # instance attributes, past Keras' __setattr__, which would track them
    object.__setattr__(obj, "save_own_variables", save)
    object.__setattr__(obj, "load_own_variables", load)


def restore_waiting_child(parent: Any, name: str, child: Any) -> None:
    """Hands ``child`` a restoration that waits for ``parent``'s child ``name`` (a
    checkpoint read before the child existed), as TF does for a tracked attribute."""
    parent._handle_deferred_dependencies(name, child)


def track_child(parent: Any, name: str, child: Any) -> None:
    """Makes ``child`` a checkpoint dependency of ``parent`` named ``name``, as an
    attribute assignment would, without the attribute."""
    parent._track_trackable(child, name=name, overwrite=True)
