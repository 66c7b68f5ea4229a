"""This rank's stores of a DistributedEmbedding, made from its placement, with their roles.

A replicated table is one store on every rank; a sharded table is one store per shard
this rank's position owns. Each store's variables are then recorded in the roles
registry (``tfhybrid.roles``) as the gradient route, broadcast, weight sync, optimizers
and checkpoints need them: an embedding optimizer's, replicated or on one position of
every model group (with the weight-sync K and the table they belong to), synced sparse
or dense.

Example::

    import tensorflow as tf
    import tfhybrid
    from tfhybrid.plan.types import PlannerOptions
    from tfhybrid.sharding.placement import LayerPlanner
    from tfhybrid.sharding.rank_stores import make_rank_stores
    from tfhybrid.sharding.tables import TableSpec
    mesh = tfhybrid.init(model_parallel=1)
    tables = [TableSpec("t", 10, 4, "sum", tf.keras.initializers.Zeros())]
    placement = LayerPlanner("emb", tables, [0], True, PlannerOptions()).place(
        mesh, [1.0], 2, "float32")
    layer = tf.keras.layers.Layer()
    made = make_rank_stores("emb", mesh, placement.plan, placement.tables,
                            [tf.keras.layers.Embedding(10, 4)], hotness=[1.0],
                            local_batch=2, weight_sync_every=None,
                            use_custom_kernel=False, add_weight=layer.add_weight)
    assert made.stores.get(0, 0).variable.shape == (10, 4)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid.plan.traffic import sync_is_sparse
from tfhybrid.plan.types import Kind, ShardingPlan
from tfhybrid.sharding import stores as stores_lib
from tfhybrid.sharding.ownership import ownership_of
from tfhybrid.sharding.stores import StoreSet
from tfhybrid.sharding.tables import TableSpec


@dataclasses.dataclass
class RankStores:
    """The stores, and the variables and objects the layer tracks for Keras (so they are
    its weights): replicated tables' variables by table, shards' by (table, shard), and
    what each store has Keras track besides (``TableStore.tracked``: a table object, the
    user's layer) by ``"<table>_<shard>"``."""

    stores: StoreSet
    table_vars: dict = dataclasses.field(default_factory=dict)
    shard_vars: dict = dataclasses.field(default_factory=dict)
    tracked: dict = dataclasses.field(default_factory=dict)


def table_key(layer_name: str, table: TableSpec) -> str:
    """The name the roles registry and the anchor know a sharded table by."""
    return f"{layer_name}/{table.name}"


def make_rank_stores(layer_name: str, mesh: mesh_lib.Mesh, plan: ShardingPlan,
                     tables: Sequence[TableSpec], embedding_layers: Sequence[Any],
                     hotness: Sequence[float], local_batch: int,
                     weight_sync_every: int | None, use_custom_kernel: bool,
                     add_weight: Callable[..., tf.Variable],
                     host_placement: dict[tuple[int, int], bool] | None = None,
                     data_parallel_threshold: int | None = None,
                     readers: Sequence[int] | None = None) -> RankStores:
    """Makes this rank's stores of ``plan`` and records their roles.

    ``hotness`` and ``local_batch`` (ids per step, as the rank is fed) choose each
    variable's sparse or dense gradient sync; ``weight_sync_every`` is K in
    ``replica_sync="weights"`` mode (None: gradients are synced); ``host_placement``
    names the stores that live in host memory (``placement.on_host``); ``readers``, the
    features that read each table (one each when None).
    """
    made = RankStores(StoreSet())
    context = stores_lib.StoreContext(
        layer_name, mesh.rank, use_custom_kernel, add_weight,
        {t.name: n for t, n in zip(tables, readers or [1] * len(tables))})
    position = mesh.model_position

    def add(t: int, s: int, name: str, shard: Any) -> stores_lib.TableStore:
        # each shard lives on one position, so a regularizer's loss is counted once per
        # replica, and the gradient sync averages the replicas
        layer = embedding_layers[t]
        host = bool(host_placement and host_placement.get((t, s)))
        with tf.device("/CPU:0") if host else contextlib.nullcontext():
            store = stores_lib.create_store(
                tables[t], shard, name, context,
                regularizer=getattr(layer, "embeddings_regularizer", None),
                constraint=getattr(layer, "embeddings_constraint", None))
        if store.tracked is not None:
            made.tracked[f"{t}_{s}"] = store.tracked
        made.stores.add(t, s, store)
        return store

    for t, (table, placement) in enumerate(zip(tables, plan.tables)):
        ids_per_step = local_batch * hotness[t]
        not_replicable = stores_lib.kind_of(table).not_replicable
        if placement.kind == Kind.DATA_PARALLEL and not_replicable is not None:
            raise ValueError(
                f"table {table.name!r} {not_replicable(table)} but the plan replicates it "
                "(data_parallel): raise its size above "
                f"data_parallel_threshold={data_parallel_threshold} or keep it in memory "
                "(a replicated table is small)")
        if placement.kind == Kind.DATA_PARALLEL:
            store = add(t, 0, table.name, placement.shards[0])
            var = store.variable
            made.table_vars[t] = var
            roles.mark_embedding(var)
            roles.mark_sparse_sync(var, store.sparse_sync or sync_is_sparse(
                table.rows, table.dim, ids_per_step, mesh.size))
            continue
        if ownership_of(placement.kind).splits_rows:
            ids_per_step /= len(placement.shards)
        for s, shard in enumerate(placement.shards):
            if shard.owner != position:
                continue
            store = add(t, s, f"{table.name}_shard_{s}", shard)
            var = store.variable
            roles.mark_model_parallel(var, mesh, weight_sync_every,
                                            table_key=table_key(layer_name, table))
            roles.mark_embedding(var)
            roles.mark_sparse_sync(var, store.sparse_sync or sync_is_sparse(
                shard.row_end - shard.row_start, shard.col_end - shard.col_start,
                mesh.model_parallel * ids_per_step, mesh.data_parallel))
            # the store's row state lives on the shard's position too (broadcast and
            # checkpointed with the shard)
            for state in store.row_state:
                roles.mark_model_parallel(state, mesh)
            made.shard_vars[(t, s)] = var
    return made
