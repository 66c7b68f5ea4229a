"""Where a DistributedEmbedding's tables go: its plan on this mesh, as the layer uses it.

The layer hands ``LayerPlanner`` its tables and options once; the planner makes (or
checks a given) ``ShardingPlan`` from the mesh and the first batch's shapes, gives each
table the tier the plan puts it in, and names the features this rank is fed
(``LayerPlacement``). ``ShardingStrategy`` shows the plan in NVIDIA
distributed-embeddings' terms, ``dp_to_mp_input`` is DE's helper that turns
data-parallel ids into model-parallel ones, and ``on_host`` is DE's
``gpu_embedding_size`` rule.

Example::

    import tfhybrid
    from tfhybrid.plan.types import PlannerOptions
    from tfhybrid.sharding.placement import LayerPlanner
    from tfhybrid.sharding.tables import TableSpec
    mesh = tfhybrid.init(model_parallel=1)
    planner = LayerPlanner("emb", [TableSpec("t", 10, 4, "sum", "zeros")], [0], dp_input=True,
                           options=PlannerOptions("basic"))
    placement = planner.place(mesh, hotness=[1.0], local_batch=2, compute_dtype="float32")
    assert placement.plan.tables[0].name == "t" and placement.fed_features == [0]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Sequence

import tensorflow as tf

from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid.plan.planner import plan_sharding
from tfhybrid.plan.types import (COST_STRATEGY, Kind, PlannerOptions, ShardingPlan,
                                 TableConfig, TablePlacement, input_ids_per_position,
                                 table_ids_per_position)
from tfhybrid.sharding.tables import TableSpec, in_tier

_LOG = logging.getLogger("tfhybrid")


def mesh_for_layer() -> mesh_lib.Mesh:
    """The current mesh; without one, ``tfhybrid.init()``'s default, said in one line."""
    mesh = mesh_lib.initialized_mesh()
    if mesh is not None:
        return mesh
    mesh = mesh_lib.init()
    if mesh.model_parallel != mesh.size:
        _LOG.warning(
            "DistributedEmbedding: no tfhybrid.init() call; using model_parallel=%d "
            "(ranks per node) on %d ranks, mesh %dx%d. NVIDIA distributed-embeddings shards "
            "over all ranks: call tfhybrid.init(model_parallel=hvd.size()) first for that.",
            mesh.model_parallel, mesh.size, mesh.data_parallel, mesh.model_parallel)
    return mesh


def load_plan(plan: Any) -> ShardingPlan | None:
    """``plan=``: a ShardingPlan, its JSON (text or dict), or the path of a JSON file."""
    if plan is None or isinstance(plan, ShardingPlan):
        return plan
    if isinstance(plan, dict):
        return ShardingPlan.from_json(json.dumps(plan))
    if isinstance(plan, (str, os.PathLike)):
        text = str(plan)
        if not text.lstrip().startswith("{"):
            if not os.path.exists(text):
                raise ValueError(f"plan={text!r} is neither a ShardingPlan's JSON nor the "
                                 "path of a file")
            with open(text) as f:
                text = f.read()
        return ShardingPlan.from_json(text)
    raise ValueError(f"plan={plan!r} must be a tfhybrid.plan.ShardingPlan, its JSON, or "
                     "the path of a JSON file")


def ids_per_sample(shapes: Sequence[Any], features: Sequence[int],
                   input_table_map: Sequence[int], tables: int, batch_divisor: int = 1
                   ) -> tuple[list[float], int]:
    """(ids per sample of each table, local batch) read from the input ``shapes`` of
    ``features``: a ``[batch, hotness]`` feature counts ``hotness``, any other one id. A
    batch dimension is divided by ``batch_divisor`` (a model group's batch fed whole).

    >>> ids_per_sample([[8, 3], [8], [16]], [0, 1, 2], [0, 0, 1], tables=2, batch_divisor=2)
    ([4.0, 1.0], 8)
    """
    hotness = [0.0] * tables
    local_batch = 1
    for feature, shape in zip(features, shapes):
        shape = tf.TensorShape(shape)
        hotness[input_table_map[feature]] += float(
            shape[1] if shape.rank == 2 and shape[1] is not None else 1)
        if shape[0]:
            local_batch = max(1, shape[0] // batch_divisor)
    return hotness, local_batch


class ShardingStrategy:
    """A plan as NVIDIA distributed-embeddings' ``layer.strategy`` shows it.

    ``input_ids_list[rank]``: the input features rank feeds with ``dp_input=False`` (its
    position's shards' features in the position's table order, then the features of
    data-parallel tables), for its model group's batch. ``table_ids[rank]``: the tables
    rank holds a shard of. Both have one entry per global rank. It compares equal to its
    strategy name.

    Example::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding
        tfhybrid.init(model_parallel=1)
        layer = DistributedEmbedding([tf.keras.layers.Embedding(10, 4)], strategy="basic")
        assert layer.strategy == "basic" and layer.strategy.input_ids_list == [[0]]
    """

    def __init__(self, name: str, plan: ShardingPlan, mesh: mesh_lib.Mesh,
                 input_table_map: Sequence[int]):
        self.name = name
        self.plan = plan
        by_position = input_ids_per_position(plan, input_table_map)
        tables_by_position = table_ids_per_position(plan)
        replicated = [f for f, t in enumerate(input_table_map)
                      if plan.tables[t].kind == Kind.DATA_PARALLEL]
        position_of = {rank: p for group in mesh.model_groups for p, rank in enumerate(group)}
        self.input_ids_list = [list(by_position[position_of[r]]) + replicated
                               for r in range(mesh.size)]
        self.table_ids = [list(tables_by_position[position_of[r]]) for r in range(mesh.size)]

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, ShardingStrategy):
            return self.name == other.name and self.plan == other.plan
        return self.name == other

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"ShardingStrategy({self.name!r}, input_ids_list={self.input_ids_list})"


@dataclasses.dataclass(frozen=True)
class LayerPlacement:
    """A layer's plan on one mesh: the plan, the tables with the tiers it gives them, DE's
    view of it, and the features this rank's inputs hold, in order."""

    plan: ShardingPlan
    tables: list[TableSpec]
    strategy: ShardingStrategy
    fed_features: list[int]


class LayerPlanner:
    """Makes a DistributedEmbedding's placement: from its options, or a given plan checked
    against the mesh and the tables. Every rank makes the same one (the plan depends on
    the mesh's shape, never on the rank), so errors are raised by all ranks together.

    Example::

        import tfhybrid
        from tfhybrid.plan.types import PlannerOptions
        from tfhybrid.sharding.placement import LayerPlanner
        from tfhybrid.sharding.tables import TableSpec
        mesh = tfhybrid.init(model_parallel=1)
        planner = LayerPlanner("emb", [TableSpec("a", 10, 4, "sum", "zeros"),
                                       TableSpec("b", 5, 2, "sum", "zeros")],
                               [0, 1, 1], dp_input=True, options=PlannerOptions("basic"))
        placement = planner.place(mesh, [1.0, 2.0], local_batch=4, compute_dtype="float32")
        assert placement.strategy == "basic" and placement.fed_features == [0, 1, 2]
    """

    def __init__(self, layer_name: str, tables: Sequence[TableSpec],
                 input_table_map: Sequence[int], dp_input: bool,
                 options: PlannerOptions, given_plan: ShardingPlan | None = None,
                 optimizer: str | None = None, replica_sync: str = "gradients",
                 sync_every: int = 1, memory_budget: dict[str, int] | None = None,
                 store_dir: str | None = None):
        self.layer_name = layer_name
        self.tables = list(tables)
        self.input_table_map = list(input_table_map)
        self.dp_input = dp_input
        self.options = options
        self.given_plan = given_plan
        self.optimizer = optimizer
        self.replica_sync = replica_sync
        self.sync_every = sync_every
        self.memory_budget = memory_budget
        self.store_dir = store_dir

    def place(self, mesh: mesh_lib.Mesh, hotness: Sequence[float], local_batch: int,
              compute_dtype: Any) -> LayerPlacement:
        """The placement on ``mesh`` for ``hotness`` ids per sample of each table and
        ``local_batch`` samples per rank (what the planner's cost estimates use)."""
        features = [max(1, self.input_table_map.count(t)) for t in range(len(self.tables))]
        if self.given_plan is not None:
            plan = self._checked(self.given_plan, mesh)
        else:
            plan = self._planned(mesh, hotness, local_batch, features, compute_dtype)
        tables = [self._in_tier(table, placement)
                  for table, placement in zip(self.tables, plan.tables)]
        strategy = ShardingStrategy(self.options.strategy, plan, mesh, self.input_table_map)
        fed = (list(range(len(self.input_table_map))) if self.dp_input
               else strategy.input_ids_list[mesh.rank])
        idle = [r for r, ids in enumerate(strategy.input_ids_list) if not ids]
        if not self.dp_input and idle:
            raise ValueError(
                f"dp_input=False: ranks {idle} would feed no feature (their positions hold "
                f"no table; plan: {plan.describe()}); lower column_slice_threshold, use "
                "strategy='basic' or 'memory_balanced' (they slice tables so every position "
                "holds one), or use fewer ranks per model group")
        return LayerPlacement(plan, tables, strategy, fed)

    def _in_tier(self, table: TableSpec, placement: TablePlacement) -> TableSpec:
        """``table`` with the tier the plan gives it (a plan that names none keeps the
        layer's own ``cache_rows``)."""
        if placement.cache_rows is None or placement.cache_rows == table.cache_rows:
            return table
        store_dir = table.store_dir or self.store_dir
        if not store_dir:
            raise ValueError(f"the plan puts table {table.name!r} in the disk tier "
                             f"(cache_rows={placement.cache_rows}); pass store_dir=, the "
                             "folder of its files")
        return dataclasses.replace(table, cache_rows=placement.cache_rows,
                                   store_dir=store_dir, storage=in_tier(table))

    def _planned(self, mesh: mesh_lib.Mesh, hotness: Sequence[float], local_batch: int,
                 features: Sequence[int], compute_dtype: Any) -> ShardingPlan:
        compute = tf.as_dtype(compute_dtype)
        return plan_sharding(
            [TableConfig(t.name, t.rows, t.dim, hotness=max(h, 1.0), combiner=t.combiner,
                         features=f, cache_rows=t.cache_rows, adaptive=bool(t.chunks),
                         keyed=t.keyed is not None)
             for t, h, f in zip(self.tables, hotness, features)],
            mesh.data_parallel, mesh.model_parallel, options=dataclasses.replace(
                self.options, local_batch_size=local_batch,
                optimizer=self.optimizer or "sgd", replica_sync=self.replica_sync,
                sync_every=self.sync_every,
                comm_dtype=(compute.name if compute in (tf.float16, tf.bfloat16) else None),
                layout=mesh.layout, memory_budget=self.memory_budget))

    def _checked(self, plan: ShardingPlan, mesh: mesh_lib.Mesh) -> ShardingPlan:
        """``plan`` if it fits this mesh and these tables; ValueError naming what differs."""
        if (plan.data_parallel, plan.model_parallel) != (mesh.data_parallel,
                                                         mesh.model_parallel):
            raise ValueError(
                f"plan is for a D x M = {plan.data_parallel} x {plan.model_parallel} mesh; "
                f"this mesh is {mesh.data_parallel} x {mesh.model_parallel} (start with "
                f"tfhybrid.init(model_parallel={plan.model_parallel}))")
        # a cost plan's predictions hold for one layout; other plans place alike in both
        if plan.strategy == COST_STRATEGY and plan.layout and plan.layout != mesh.layout:
            raise ValueError(f"plan is for layout={plan.layout!r}; this mesh is "
                             f"{mesh.layout!r}")
        got = [(p.name, max(s.row_end for s in p.shards), max(s.col_end for s in p.shards))
               for p in plan.tables]
        want = [(t.name, t.rows, t.dim) for t in self.tables]
        if got != want:
            raise ValueError(f"plan's tables (name, rows, dim) {got} are not this layer's "
                             f"{want}")
        for table, placement in zip(self.tables, plan.tables):
            # keys are found only where their hash puts them: a keyed table is hash_wise
            # with a shard on every position, and no other table is
            keyed = table.keyed is not None
            owners = sorted(s.owner for s in placement.shards)
            if keyed != (placement.kind == Kind.HASH_WISE) or (
                    keyed and owners != list(range(mesh.model_parallel))):
                raise ValueError(
                    f"plan places table {table.name!r} {placement.kind} on positions "
                    f"{owners}; a dynamic table is hash_wise with one shard on each of the "
                    f"{mesh.model_parallel} positions, and only a dynamic table is")
        return plan


def on_host(plan: ShardingPlan, position: int, gpu_embedding_size: int | None,
            layer_name: str = "") -> dict[tuple[int, int], bool]:
    """Which of ``position``'s tables and shards, by (table, shard), live in host memory:
    DE's ``gpu_embedding_size`` rule (past that many bytes per GPU, in plan order, tables
    go to the host). Without a visible GPU, none (everything is in host memory anyway)."""
    mine = []   # (table, shard, bytes), in plan order
    for t, placement in enumerate(plan.tables):
        for s, shard in enumerate(placement.shards):
            if placement.kind == Kind.DATA_PARALLEL or shard.owner == position:
                mine.append(((t, s), 4 * (shard.row_end - shard.row_start)
                             * (shard.col_end - shard.col_start)))
            if placement.kind == Kind.DATA_PARALLEL:
                break
    if not tf.config.list_logical_devices("GPU"):
        if gpu_embedding_size is not None:
            _LOG.info("DistributedEmbedding %r: no GPU is visible, so every table is in "
                      "host memory (gpu_embedding_size=%d is not needed)", layer_name,
                      gpu_embedding_size)
        return {key: False for key, _ in mine}
    budget = float("inf") if gpu_embedding_size is None else gpu_embedding_size
    host, used = {}, 0
    for key, nbytes in mine:
        host[key] = used + nbytes > budget
        used += 0 if host[key] else nbytes
    if any(host.values()):
        _LOG.info("DistributedEmbedding %r: %d of this rank's %d tables/shards exceed "
                  "gpu_embedding_size=%d bytes and live in host memory", layer_name,
                  sum(host.values()), len(mine), gpu_embedding_size)
    return host


def dp_to_mp_input(dp_inputs: dict, rank_to_local_features: dict,
                   mesh: mesh_lib.Mesh | None = None) -> dict:
    """NVIDIA distributed-embeddings' helper: data-parallel ids to model-parallel ones.

    ``dp_inputs`` maps each feature to this rank's ids (a ``tf.Tensor`` or a
    ``tf.RaggedTensor``); ``rank_to_local_features`` maps each global rank to the
    features it should receive. Returns ``{feature: ids}`` for this rank's features, for
    its model group's batch (the global batch when M = N, DE's only layout), samples in
    rank order. Every rank must call it with the same ``rank_to_local_features``: each
    wanted feature is one allgather in the model group (two for a ragged one).
    """
    mesh = mesh or mesh_for_layer()
    if set(rank_to_local_features) - set(range(mesh.size)):
        raise ValueError(f"rank_to_local_features has ranks "
                         f"{sorted(set(rank_to_local_features) - set(range(mesh.size)))}; "
                         f"expected ranks in [0, {mesh.size})")
    wanted = sorted({f for features in rank_to_local_features.values() for f in features})
    missing = [f for f in wanted if f not in dp_inputs]
    if missing:
        raise ValueError(f"dp_inputs has no features {missing}, which "
                         "rank_to_local_features asks for")
    gathered = {}
    for f in wanted:     # the same order on every rank: the collectives pair up by name
        def gather(x, part):
            return collectives.allgather(x, mesh.model_parallel,
                                         f"tfhybrid_dp_to_mp_{f}_{part}",
                                         mesh.model_process_set)
        ids = dp_inputs[f]
        if isinstance(ids, tf.RaggedTensor):
            gathered[f] = tf.RaggedTensor.from_row_lengths(
                gather(ids.flat_values, "values"), gather(ids.row_lengths(), "lengths"))
        else:
            gathered[f] = gather(tf.convert_to_tensor(ids), "ids")
    return {f: gathered[f] for f in rank_to_local_features.get(mesh.rank, [])}
