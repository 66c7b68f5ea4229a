"""What a checkpoint holds of an optimizer's state of ``DistributedEmbedding`` tables:
their slots, under names that do not depend on the mesh.

Keras optimizers track their slots by position in a list, and both the positions and
the shapes of table slots depend on the mesh. ``attach_optimizer`` (called by
``tfhybrid.DistributedOptimizer``) takes them out of the optimizer's lists (the views
below keep every other entry, numbered as before minus the table slots, which is the
same on every mesh) and adds the child ``tfhybrid_table_slots``: per
``DistributedEmbedding`` (``layer_<k>``, k its order among the optimizer's layers) the
attribute ``table_<t>_<slot>``, a full-table tensor like the tables (``tables``). A
row-wise slot (``[rows]``, row-wise AdaGrad) is stored broadcast over its shard's columns
and read back as the mean over the new shard's columns
(``tfhybrid.checkpoint.resharding.rowwise_weights``).

**Restore before build.** ``BackupAndRestore`` and ``load_weights`` may restore before
the optimizer has slots. TensorFlow then defers the missing children, as it does for
Keras' own lists; the optimizer's ``build`` (hooked by ``attach_optimizer`` through
``_tf_internals.install_build_hook``) hands the deferred restorations their new
objects, before the first step uses them.
"""

from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import roles
from tfhybrid import slot_owners
from tfhybrid.checkpoint import pieces
from tfhybrid.checkpoint import tables
from tfhybrid.optimizers import ROW_STATE_SLOT
from tfhybrid.sharding.rank_stores import table_key
from tfhybrid.sharding.stores import keeps_row_state, saved_layout_of

# The optimizer's checkpoint child (part of the checkpoint format).
SLOTS_CHILD = "tfhybrid_table_slots"

# optimizer -> its _OptimizerState (weak: the state dies with its optimizer)
_STATES: "weakref.WeakKeyDictionary[Any, _OptimizerState]" = weakref.WeakKeyDictionary()


# ----------------------------------------------------------- optimizer slots
def variables_of(optimizer: Any) -> list:
    # new Keras optimizers: a (callable) list property; legacy ones: a method
    found = optimizer.variables
    return list(found() if callable(found) and not isinstance(found, list) else found)


def slots_of(optimizer: Any, variable: tf.Variable,
             table: str | None = None) -> dict[str, tf.Variable]:
    """``variable``'s optimizer slots by slot name ("m", "accumulator", ...), from the
    optimizer that holds them (``slot_owners.slot_owner``; ``table``, a table key, picks
    the one of that table for a layer's anchor under per-table optimizers)."""
    owner = slot_owners.slot_owner(optimizer, variable, table)
    if owner is None:
        return {}
    state = roles.role_of(variable).row_accumulator
    if state is not None:
        # a table that keeps its rows' accumulator itself (a FIITED pool, a tier's
        # cache) has no other state
        return ({ROW_STATE_SLOT: state}
                if any(v is state for v in variables_of(owner)) else {})
    if hasattr(owner, "get_slot_names"):   # legacy Keras optimizers
        slots = {}
        for name in owner.get_slot_names():
            try:
                slots[name] = owner.get_slot(variable, name)
            except KeyError:   # no slot for this variable (yet)
                pass
        return slots
    # new Keras optimizers: only variables they were built with (a name check alone
    # would take another model's layer of the same name for this one)
    if not _tf_internals.built_for(owner, variable):
        return {}
    slots = {}
    for slot in variables_of(owner):
        slot_name = _tf_internals.is_slot_of(slot, variable)
        if slot_name is None:
            continue
        if slot_name in slots:
            raise ValueError(f"optimizer {type(owner).__name__} has two slots named "
                             f"{slot_name!r} for variable {variable.name!r}")
        slots[slot_name] = slot
    return slots


class _LayerSlots(_tf_internals.Trackable):
    """One layer's table slots in one optimizer: ``table_<t>_<slot>`` per table."""

    def __init__(self, optimizer: Any, layer: Any):
        self._optimizer = weakref.ref(optimizer)
        self._layer = weakref.ref(layer)

    def _gather_saveables_for_checkpoint(self) -> dict:
        optimizer, layer = self._optimizer(), self._layer()
        if optimizer is None or layer is None:
            return {}
        return {key: pieces.full_tensor_factory(full_shape, held)
                for key, (_, full_shape, held) in layer_slot_pieces(optimizer, layer).items()}


def layer_slot_pieces(optimizer: Any, layer: Any) -> dict[str, tuple[int, tuple, list]]:
    """``table_<t>_<slot>`` -> (t, the slot's full shape, the pieces this rank holds) of
    every table slot of ``layer`` in ``optimizer``: what checkpoints and weights files
    hold of them."""
    found = {}
    for t, (table, held) in enumerate(zip(layer.table_specs, pieces.layer_pieces(layer))):
        # the anchor is on every rank, so its slot names are the same everywhere even
        # where a rank holds no shard of a table (per-table optimizers: in the table's)
        names = sorted(slots_of(optimizer, layer.anchor, table_key(layer.name, table)))
        layout = saved_layout_of(table)
        if layout is not None and layout.saves_row_state:
            continue   # its kind's saved layout holds its rows' state (a dynamic table's)
        # a table that keeps its rows' state itself (as its storage kind says) has its
        # rows' accumulator as its only state (slots_of): a momentum-free SGD's "m",
        # which carries nothing from step to step, has no place there. Every rank knows
        # which tables these are.
        table_names = ([n for n in names if n == ROW_STATE_SLOT]
                       if keeps_row_state(table) else names)
        per_slot: dict[str, list[pieces.Piece]] = {name: [] for name in table_names}
        # a kind's own saved layout may place the row-wise slot otherwise (a FIITED
        # table's per chunk column, its column slices holding whole chunks); else it is
        # broadcast over every column
        full_shape = layout.slot_shape(table) if layout else (table.rows, table.dim)
        for rect, var in held:
            if layout is not None:
                rect = layout.slot_rect(table, rect)
            slots = slots_of(optimizer, var)
            if sorted(slots) != table_names:
                raise ValueError(
                    f"the optimizer gives table {table.name!r} of layer "
                    f"{layer.name!r} the slots {sorted(slots)} but tfhybrid saves "
                    f"{table_names} for it (the layer's anchor has {names})")
            for name, slot in slots.items():
                per_slot[name].append(pieces.slot_piece(rect, slot))
        for name, slot_pieces in per_slot.items():
            found[f"table_{t}_{name}"] = (t, full_shape, slot_pieces)
    return found


class _DerivedChildren(_tf_internals.Trackable):
    """A checkpoint node whose children are computed (``_trackable_children``), so a
    lookup asks that, and a restore that ran before they existed reaches them later."""

    def _lookup_dependency(self, name, cached_dependencies=None):
        children = cached_dependencies or self._trackable_children()
        return children.get(name)

    def restore_deferred(self) -> None:
        for name, child in self._trackable_children().items():
            self._handle_deferred_dependencies(name, child)


class _WithoutTableSlots(_DerivedChildren):
    """An optimizer's tracked list, minus the tables and their slots, numbered as a list.

    It stands in for the list in checkpoints: the other entries (iterations, the slots
    of dense variables) keep positions that are the same on every mesh.
    """

    def __init__(self, state: "_OptimizerState", source: Any):
        self._state = state
        self.source = source

    def follow(self, source: Any) -> None:
        """Stands in for ``source`` now (the list Keras made in place of the last one)."""
        self.source = source

    def entries(self) -> list:
        # Keras 3 also tracks the variables it trains (``_trainable_variables``), whose
        # shards are mesh-dependent too; the layer's checkpoint holds them
        left_out = self._state.table_slot_ids() | self._state.table_variable_ids()
        return [v for v in self.source if id(v) not in left_out]

    def _trackable_children(self, save_type=_tf_internals.SaveType.CHECKPOINT, **kwargs):
        return {str(i): v for i, v in enumerate(self.entries())}



class _TableSlots(_DerivedChildren):
    """The optimizer's ``tfhybrid_table_slots`` node: ``layer_<k>`` per layer it holds
    table slots of, k in the order the optimizer holds them (the same on every mesh:
    every rank holds each layer's anchor)."""

    def __init__(self, state: "_OptimizerState"):
        self._state = state
        self._children: "weakref.WeakKeyDictionary[Any, _LayerSlots]" = \
            weakref.WeakKeyDictionary()

    def _trackable_children(self, save_type=_tf_internals.SaveType.CHECKPOINT, **kwargs):
        optimizer = self._state.optimizer()
        if optimizer is None:
            return {}
        children = {}
        for k, layer in enumerate(self._state.layers()):
            if layer not in self._children:
                self._children[layer] = _LayerSlots(optimizer, layer)
            children[f"layer_{k}"] = self._children[layer]
        return children



class _OptimizerState:
    """What ``attach_optimizer`` keeps for one optimizer (and the ones inside it)."""

    def __init__(self, optimizer: Any):
        self.optimizer = weakref.ref(optimizer)
        self.slots_node = _TableSlots(self)
        # (optimizer, child name) -> its view; kept across builds, because restorations
        # that wait for entries are registered on the view
        self._views: dict[tuple[int, str], _WithoutTableSlots] = {}
        # the optimizers' variable counts when the views were last placed: Keras calls
        # build on every apply_gradients, and only a build that made slots matters
        self._built_counts: tuple[int, ...] | None = None

    def members(self) -> list:
        """The optimizer, the optimizers a loss scale wraps, and the embedding optimizer
        (each per-table one)."""
        optimizer = self.optimizer()
        found, todo = [], [optimizer]
        while todo:
            current = todo.pop(0)
            if current is None or any(current is f for f in found):
                continue
            found.append(current)
            todo += [getattr(current, "inner_optimizer", None)] + slot_owners.each_optimizer(
                getattr(current, "embedding_optimizer", None))
        return found

    def layers(self) -> list:
        """The built layers whose tables have slots here, in slot order."""
        optimizer = self.optimizer()
        order = []
        for layer in tables.built_layers():
            slots = list(slots_of(optimizer, layer.anchor).values())
            if slots:
                owner = slot_owners.slot_owner(optimizer, layer.anchor)
                position = next(i for i, v in enumerate(variables_of(owner))
                                if v is slots[0])
                order.append((position, id(layer), layer))
        return [layer for _, _, layer in sorted(order)]

    def table_slot_ids(self) -> set[int]:
        optimizer = self.optimizer()
        ids = set()
        for layer in self.layers():
            for var in layer.weights:
                ids.update(id(s) for s in slots_of(optimizer, var).values())
        return ids

    def table_variable_ids(self) -> set[int]:
        """The layers' own variables (shards, replicated tables, anchors), which an
        optimizer may track too."""
        return {id(v) for layer in tables.built_layers() for v in layer.weights}

    def install_views(self) -> None:
        """Puts a view in place of each list the optimizers track (Keras re-assigns
        some lists when it builds, so this runs again after every build)."""
        for member in self.members():
            # a cache of the children from before a build would hide the lists it made
            _tf_internals.forget_checkpoint_children(member)
            for name in list(_tf_internals.children_of(member)):
                # the tracked list itself: the children may hold a copy of it
                child = _tf_internals.child_named(member, name)
                if not isinstance(child, _tf_internals.ListWrapper):
                    continue
                view = self._views.setdefault((id(member), name),
                                              _WithoutTableSlots(self, child))
                view.follow(child)
                _tf_internals.track_child(member, name, view)
            _tf_internals.forget_checkpoint_children(member)

    def after_build(self) -> None:
        """Slots exist now: re-place the views, then restore what waited for them."""
        counts = tuple(len(variables_of(m)) for m in self.members())
        if counts == self._built_counts:
            return
        self._built_counts = counts
        self.install_views()
        for member in self.members():
            children = _tf_internals.children_of(member)
            for name in _tf_internals.waiting_children(member):
                if name in children:
                    _tf_internals.restore_waiting_child(member, name, children[name])
        for view in self._views.values():
            view.restore_deferred()
        # per-table optimizers build one by one: the tables' slots are restored once all
        # of them have theirs (a restoration reaches what exists when it is handed over)
        if slot_owners.tables_built(self.optimizer()):
            self.slots_node.restore_deferred()


def state_of(optimizer: Any) -> "_OptimizerState":
    """What ``attach_optimizer`` keeps for ``optimizer`` (its members, the layers whose
    table slots it holds); ValueError for an optimizer it was not given."""
    if optimizer not in _STATES:
        raise ValueError(f"optimizer {optimizer!r} is not attached: wrap it in "
                         "tfhybrid.DistributedOptimizer (or give it to a "
                         "DistributedGradientTape)")
    return _STATES[optimizer]


def attach_optimizer(optimizer: Any) -> None:
    """Makes ``optimizer``'s checkpoints hold the slots of ``DistributedEmbedding`` tables
    under mesh-independent names (see the module doc). Idempotent.

    ``tfhybrid.DistributedOptimizer`` calls it; so does ``DistributedGradientTape`` for
    the optimizer it is given.
    """
    if optimizer in _STATES:
        return
    state = _OptimizerState(optimizer)
    _STATES[optimizer] = state
    _tf_internals.track_child(optimizer, SLOTS_CHILD, state.slots_node)
    state.install_views()
    for member in state.members():
        # Keras builds inside the first apply_gradients, before it steps: restorations
        # that waited for the slots reach them through the views
        _tf_internals.install_build_hook(member, state.after_build)
