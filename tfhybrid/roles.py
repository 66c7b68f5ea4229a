"""What each variable (or gradient) is to tfhybrid, in one registry.

``DistributedEmbedding`` builds its variables from the plan and records here what the plan
says of each: a table of the layer, a model-parallel shard (of which table, synced how),
the anchor, a variable of a table object (a pool, a cache). The gradient route, broadcasts,
weight syncs, optimizers and checkpoints ask :func:`role_of` instead of reading attributes
stuck on TensorFlow objects, so the facts have one writer, one reader API, and a Keras 3
variable can take a ``tf.Variable``'s place.

Entries are keyed by object identity and dropped when the object is collected. A Keras 3
weight and the ``tf.Variable`` inside it (``_tf_internals.tf_variable``) share one entry:
Keras 3 hands optimizers the inner variable.

Example::

    import tensorflow as tf
    from tfhybrid import roles
    shard = tf.Variable(tf.zeros([4, 2]))
    roles.assign(shard, model_parallel=True, table_key="layer/users")
    assert roles.role_of(shard).model_parallel
    assert roles.role_of(tf.Variable(1.0)) == roles.Role()
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any, Sequence

from tfhybrid import _tf_internals

if TYPE_CHECKING:
    from tfhybrid.mesh import Mesh


@dataclasses.dataclass
class Role:
    """The facts recorded for one object (defaults: none of them).

    Example::

        from tfhybrid.roles import Role
        assert not Role().embedding and Role(sync_every=3).sync_every == 3
    """
    # a DistributedEmbedding variable (tables, shards, anchor): an embedding optimizer's
    embedding: bool = False
    # lives on one position of every model group: reduced over its data group,
    # broadcast from its first member
    model_parallel: bool = False
    # a shard: the key of its whole table, whose norm the shards share (clipnorm)
    table_key: str | None = None
    # a shard in weight-sync mode: K, the steps between averages over its data group
    sync_every: int | None = None
    # MomentumScaledRowWiseAdagrad's c for this variable (D in weight-sync mode)
    momentum_scale: float | None = None
    # never synced (the layer's empty alltoall anchor)
    local_only: bool = False
    # the anchor, which every rank has: the keys of all sharded tables of the layer, so
    # every rank joins the same norm allreduce even where it owns no shard
    sharded_tables: tuple[str, ...] = ()
    # whether the gradient is synced sparse (allgather), as the plan chose; None: decide
    # from the shape
    sparse_sync: bool | None = None
    # an optimizer slot of a model-parallel shard: broadcast inside its data group
    shard_state: bool = False
    # a gradient a DistributedGradientTape returned: synced already, never again
    synced: bool = False
    # The table object whose trained variable it is (a chunk pool's, a DRAM cache's),
    # held weakly (a table holds its variables, and the registry must not keep either
    # alive): its kind's module asks it (its slot guard, its saved layout).
    table_ref: weakref.ref | None = None
    # Held weakly too: the variable in which the variable's table keeps its row-wise
    # optimizer state (a FIITED pool's per-row accumulators, a tiered cache's per-slot
    # ones, which move with the rows), which a row-wise optimizer uses instead of a slot
    # of its own; and the table that takes the optimizer's row-wise step itself
    # (``apply_pool_gradient``: a FIITED pool, whose update reads the chunks each row
    # holds).
    row_accumulator_ref: weakref.ref | None = None
    row_step_ref: weakref.ref | None = None
    # The table that keeps rows of the variable outside it (a disk tier's file), held
    # weakly: weight syncs, broadcasts and checkpoints hand it its rows
    # (``replica_state``, ``sync_replicas(average)``, ``broadcast_rows(broadcast)``,
    # ``whole()`` / ``assign_whole(value)``, ``name``); and, for a row-state variable
    # (a tier's cache accumulator), the table keeping its rows outside it
    # (``whole(accumulator=True)`` / ``assign_whole(value, accumulator=True)``).
    rows_outside_ref: weakref.ref | None = None
    state_outside_ref: weakref.ref | None = None

    def record(self, facts: dict[str, Any]) -> None:
        """Sets ``facts`` (field names, checked by ``assign``)."""
        for name, value in facts.items():
            setattr(self, name, value)

    table = property(lambda self: _dereferenced(self.table_ref))
    row_accumulator = property(lambda self: _dereferenced(self.row_accumulator_ref))
    row_step = property(lambda self: _dereferenced(self.row_step_ref))
    rows_outside = property(lambda self: _dereferenced(self.rows_outside_ref))
    state_outside = property(lambda self: _dereferenced(self.state_outside_ref))


def _dereferenced(ref: weakref.ref | None) -> Any:
    """What a weak reference of a role holds (None once it is gone, or if never set)."""
    return None if ref is None else ref()


_ROLES: dict[int, tuple[weakref.ref, Role]] = {}
_HELD_WEAKLY = ("table", "row_accumulator", "row_step", "rows_outside", "state_outside")


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _ROLES.get(key)
    if entry is not None and entry[0] is ref:
        del _ROLES[key]


def role_of(obj: Any) -> Role:
    """The facts recorded for ``obj`` (a fresh default ``Role()`` when none are)."""
    obj = _tf_internals.tf_variable(obj)
    entry = _ROLES.get(id(obj))
    if entry is None or entry[0]() is not obj:
        return Role()
    return entry[1]


def assign(obj: Any, **facts: Any) -> Role:
    """Records ``facts`` (``Role`` field names; the objects of ``_HELD_WEAKLY``,
    ``table`` to ``state_outside``, are kept weakly) for ``obj``, keeping those set
    before; returns its role. ValueError names an unknown fact."""
    for name in _HELD_WEAKLY:
        if name in facts:
            table = facts.pop(name)
            facts[f"{name}_ref"] = None if table is None else weakref.ref(table)
    unknown = sorted(set(facts) - {f.name for f in dataclasses.fields(Role)})
    if unknown:
        raise ValueError(f"unknown role facts {unknown}; expected fields of "
                         f"tfhybrid.roles.Role")
    obj = _tf_internals.tf_variable(obj)
    key = id(obj)
    entry = _ROLES.get(key)
    if entry is None or entry[0]() is not obj:
        ref = weakref.ref(obj, lambda dead, key=key: _forget(key, dead))
        entry = (ref, Role())
        _ROLES[key] = entry
    entry[1].record(facts)
    return entry[1]



# ------------------------------------------------------------------ writers and readers
# DistributedEmbedding records what each of its variables is; the gradient route,
# broadcasts and checkpoints read it back through these.
def mark_embedding(variable: Any) -> None:
    """A variable of DistributedEmbedding (tables, shards, anchor): an embedding
    optimizer's."""
    assign(variable, embedding=True)


def is_embedding(variable: Any) -> bool:
    return role_of(variable).embedding


def mark_model_parallel(variable: Any, mesh: "Mesh", sync_every: int | None = None,
                        table_key: str | None = None) -> None:
    """A variable on one position of every model group (a shard, or its row state)."""
    assign(variable, model_parallel=True)
    if table_key is not None:
        assign(variable, table_key=table_key)
    if sync_every is not None:
        assign(variable, sync_every=int(sync_every), momentum_scale=float(mesh.data_parallel))


def mark_anchor(variable: Any, sharded_table_keys: Sequence[str]) -> None:
    """The layer's alltoall anchor: never synced, and it names the layer's sharded tables."""
    assign(variable, local_only=True, sharded_tables=tuple(sharded_table_keys))
    mark_embedding(variable)


def mark_sparse_sync(variable: Any, sparse: bool) -> None:
    assign(variable, sparse_sync=bool(sparse))


def is_model_parallel(variable: Any) -> bool:
    return role_of(variable).model_parallel


def weight_sync_every(variable: Any) -> int | None:
    """K for a shard in weight-sync mode, else None (gradients are synced every step)."""
    return role_of(variable).sync_every


def mark_synced(grad: Any) -> Any:
    """Tags a gradient as synced (a DistributedGradientTape's output), so no optimizer
    syncs it again; returns it. A transformed gradient is a new, untagged tensor; an
    object that cannot be held weakly stays untagged."""
    if grad is not None:
        try:
            assign(grad, synced=True)
        except (AttributeError, TypeError):
            pass
    return grad


def is_synced(grad: Any) -> bool:
    return role_of(grad).synced
