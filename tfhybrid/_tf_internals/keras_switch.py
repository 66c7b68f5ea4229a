"""Where Keras 2 and Keras 3 differ for tfhybrid's layers, tables and models: how a
weight is made and which ``tf.Variable`` holds it, slot names, symbolic builds, step
counters. Each function switches on ``KERAS_3`` and says what each Keras does."""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterator

import tensorflow as tf

from tfhybrid._tf_internals.reads import variable_path
from tfhybrid._tf_internals.versions import KERAS_3


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
