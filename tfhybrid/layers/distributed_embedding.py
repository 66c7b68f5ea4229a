"""DistributedEmbedding: embedding tables sharded over the model groups of the mesh.

The forward data path of one step, in the order ``call`` runs it:

1. every rank checks its ids and the ranks agree on the local batch size (one tiny
   allgather), so bad input fails on every rank at once instead of hanging a collective;
2. ids of model-parallel tables are routed to the position that owns each shard
   (row-wise tables by row range) and sent with one ``alltoall`` in the model group;
3. each owner looks up and sum-combines the ids of all M ranks of its model group;
4. the results return with one ``alltoall`` (Horovod registers its gradient: the reverse
   alltoall), column slices are concatenated, row-slice partials are summed, and a mean
   divides by the bag size;
5. data-parallel tables are looked up locally.

Gradients then flow back through the same alltoalls to the owners' shard variables;
``tfhybrid.DistributedGradientTape`` / ``DistributedOptimizer`` (``tfhybrid/distributed.py``)
allreduce them over the right process set before the optimizer applies them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
from typing import Any, Sequence

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfhybrid import collectives
from tfhybrid import compression
from tfhybrid import custom_ops
from tfhybrid import distributed
from tfhybrid import fiited
from tfhybrid import mesh as mesh_lib
from tfhybrid import pipeline as pipeline_lib
from tfhybrid import tiers
from tfhybrid.fiited import ChunkedTable, plan_chunk_counts
from tfhybrid.layers.embedding import Embedding
from tfhybrid.plan.planner import plan_sharding
from tfhybrid.plan.tiers import TIER_PINNED_STEPS, dram_budget_bytes, shard_cache_rows
from tfhybrid.plan.traffic import sync_is_sparse
from tfhybrid.plan.types import (COST_STRATEGY, DEFAULT_STRATEGY, OPTIMIZERS, REPLICA_SYNC,
                                 STRATEGIES, Kind, Shard, ShardingPlan, TableConfig,
                                 TablePlacement, input_ids_per_position,
                                 table_ids_per_position)
from tfhybrid.tiers import CachedTable, ChunkedCachedTable


_LOG = logging.getLogger("tfhybrid")

# Full-table gathers and scatters move at most this many bytes per collective, so a
# table never needs more than its own size plus one chunk of extra memory.
_CHUNK_BYTES = 8 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class _Table:
    name: str
    rows: int
    dim: int
    combiner: str | None
    initializer: Any
    # a layer class with its own ``call`` (not Keras' or tfhybrid's Embedding): every
    # shard is an instance of it, made from its config with the shard's shape
    custom_class: Any = None
    custom_config: Any = None
    # FIITED (``dims="adaptive"``): chunks per row of the whole table, and the share of
    # them kept; None for a dense table
    chunks: int | None = None
    target_memory: float | None = None
    # a table in the disk tier (``cache_rows``): each shard keeps the same share of its
    # rows in a DRAM cache, its store in ``store_dir``
    cache_rows: int | None = None
    store_dir: str | None = None
    cache_policy: str = "lru"

    @property
    def chunk_dim(self) -> int:
        return self.dim // self.chunks


@dataclasses.dataclass(frozen=True)
class _Route:
    """One (feature, shard) pair that crosses the model-group alltoall."""
    feature: int
    table: int
    shard: int          # index into the table's shards
    owner: int          # position in the model group
    row_start: int
    row_end: int
    width: int


_LOOKUP_CALLS = (tf.keras.layers.Embedding.call, Embedding.call)


def _as_layer(layer: Any) -> Any:
    if isinstance(layer, dict):
        return tf.keras.layers.deserialize(layer, custom_objects={"Embedding": Embedding})
    return layer


def _table_from_layer(layer: Any) -> _Table:
    config = layer.get_config() if isinstance(layer, tf.keras.layers.Layer) else {}
    if not {"input_dim", "output_dim"} <= set(config or {}):
        raise ValueError(
            "embeddings must hold tf.keras.layers.Embedding / tfhybrid.layers.Embedding "
            "layers, or Keras layers whose get_config() has input_dim and output_dim (a "
            f"custom embedding layer); got {layer!r}")
    custom = type(layer).call not in _LOOKUP_CALLS
    initializer = getattr(layer, "embeddings_initializer", None)
    if initializer is not None:
        initializer = tf.keras.initializers.get(initializer)
        init_config = initializer.get_config()
        if "seed" in init_config and init_config["seed"] is None:
            # An unseeded initializer draws its seed from Python's random when first
            # called, and only the ranks that hold the table call it: the ranks' random
            # streams (hence replicated tables and later layers) would drift apart.
            # Drawn here, for every table on every rank, the streams stay alike, and the
            # table starts the same on every mesh.
            initializer = type(initializer).from_config(
                dict(init_config, seed=random.randint(1, 2**31 - 2)))
    return _Table(name=layer.name, rows=int(config["input_dim"]),
                  dim=int(config["output_dim"]),
                  combiner=getattr(layer, "combiner", None),
                  initializer=initializer,
                  custom_class=type(layer) if custom else None,
                  custom_config=config if custom else None,
                  **({"chunks": int(config["chunks"]),
                      "target_memory": float(config["target_memory"])}
                     if config.get("dims") == "adaptive" else {}),
                  **({"cache_rows": int(config["cache_rows"]),
                      "store_dir": config["store_dir"],
                      "cache_policy": config.get("cache_policy", "lru")}
                     if config.get("cache_rows") is not None else {}))


def _custom_shard_layer(table: _Table, rows: int, width: int, name: str) -> Any:
    return table.custom_class.from_config(
        dict(table.custom_config, input_dim=rows, output_dim=width, name=name))


def _check_custom_table(table: _Table, placement: Any) -> None:
    """A custom table layer runs on its shards' ids, so it must look up each id alone."""
    if placement.kind == Kind.ROW_WISE:
        raise ValueError(
            f"embedding layer {table.name!r} is a custom layer ({table.custom_class.__name__})"
            f", which the plan would split row_wise; raise row_slice_threshold above its "
            f"{table.rows * table.dim} elements (a custom call cannot look up part of a row "
            "range)")
    # probed eagerly, on every rank alike, so a bad layer fails everywhere at once
    with tf.init_scope():
        probe = _custom_shard_layer(table, 3, 2, f"{table.name}_probe")
        ids = tf.constant([[0, 1], [2, 0]], tf.int64)
        probe.build(tf.TensorShape([None]))
        probe.built = True
        got = tf.TensorShape(probe(ids).shape)
    if got != tf.TensorShape([2, 2, 2]) or len(probe.weights) != 1:
        raise ValueError(
            f"custom embedding layer {table.name!r} ({table.custom_class.__name__}) must map "
            "ids of shape S to outputs of shape S + [output_dim] with one [input_dim, "
            f"output_dim] weight; on ids [2, 2] with output_dim=2 it gave {got} and has "
            f"{len(probe.weights)} weights")


def _check_table_config(layer: Any, table: _Table, placement: Any) -> None:
    """Raises ``ValueError`` for a Keras Embedding setting the plan cannot honour."""
    if table.chunks:
        for shard in placement.shards:
            if shard.col_start % table.chunk_dim or shard.col_end % table.chunk_dim:
                raise ValueError(
                    f"embedding layer {table.name!r} (dims='adaptive', chunks={table.chunks}"
                    f" of {table.chunk_dim} columns) is split into columns "
                    f"[{shard.col_start}, {shard.col_end}), which cut a chunk; choose "
                    "chunks so that each column slice holds whole chunks, or raise "
                    "column_slice_threshold above the table's size")
    variable_dtype = tf.as_dtype(layer.dtype_policy.variable_dtype)
    if variable_dtype != tf.float32:
        raise ValueError(
            f"embedding layer {table.name!r} has dtype={variable_dtype.name!r}; tables are "
            "stored in float32 (use a mixed precision policy such as 'mixed_float16' for "
            "16-bit compute and communication)")
    constraint = getattr(layer, "embeddings_constraint", None)
    if constraint is None or len(placement.shards) == 1:
        return
    axis = constraint.get_config().get("axis") if hasattr(constraint, "get_config") else None
    axes = set(axis if isinstance(axis, (list, tuple)) else [axis]) if axis is not None else set()
    # a norm over an axis the plan splits would see only part of its vector
    split = {0} if placement.kind == Kind.ROW_WISE else {1, -1}
    if axes & split or (axis is None and not isinstance(
            constraint, tf.keras.constraints.NonNeg)):
        raise ValueError(
            f"embedding layer {table.name!r} has embeddings_constraint={constraint!r}, "
            f"which needs whole {'columns' if 0 in split else 'rows'}, but the plan splits "
            f"the table {placement.kind} into {len(placement.shards)} shards; raise "
            "row_slice_threshold / column_slice_threshold above its size, or use an "
            "element-wise constraint")


def _mesh_for_layer() -> mesh_lib.Mesh:
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


def _dp_to_mp_input(dp_inputs: dict, rank_to_local_features: dict,
                    mesh: mesh_lib.Mesh | None = None) -> dict:
    """NVIDIA distributed-embeddings' helper: data-parallel ids to model-parallel ones.

    ``dp_inputs`` maps each feature to this rank's ids (a ``tf.Tensor`` or a
    ``tf.RaggedTensor``); ``rank_to_local_features`` maps each global rank to the
    features it should receive. Returns ``{feature: ids}`` for this rank's features, for
    its model group's batch (the global batch when M = N, DE's only layout), samples in
    rank order. Every rank must call it with the same ``rank_to_local_features``: each
    wanted feature is one allgather in the model group (two for a ragged one).
    """
    mesh = mesh or _mesh_for_layer()
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


def _load_plan(plan: Any) -> ShardingPlan | None:
    """``plan=``: a ShardingPlan, its JSON, or the path of a JSON file."""
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
    raise ValueError(f"plan={plan!r} must be a tfhybrid.planner.ShardingPlan, its JSON, or "
                     "the path of a JSON file")


# per feature in a rank's id report: bad id?, the first bad id, bad input?, bags per sample
_REPORT_FIELDS = 4


class DistributedEmbedding(tf.keras.layers.Layer):
    """Embedding tables sharded table-, column- or row-wise over the mesh's model groups.

    Args:
      embeddings: ``tf.keras.layers.Embedding`` or ``tfhybrid.layers.Embedding`` layers,
        one per table (their weights are not used; they carry the configuration). A
        seeded uniform or normal ``embeddings_initializer`` gives the same initial tables
        on every mesh, so runs on different meshes start from the same point. A
        ``dims="adaptive"`` table (FIITED) is stored as chunk pools, one per shard, and
        :meth:`adjust` (or ``tfhybrid.callbacks.FiitedAdjust``) re-divides its chunks.
      mesh: a ``tfhybrid.Mesh``; ``None`` takes ``tfhybrid.init()``'s mesh.
      strategy, column_slice_threshold, row_slice_threshold, data_parallel_threshold:
        the planner's options (see ``tfhybrid.planner.plan_sharding``), named as in
        NVIDIA distributed-embeddings; thresholds count elements (rows * dim).
      input_table_map: for each input feature, the index of its table, so features can
        share a table. ``None`` means feature i uses table i.
      dp_input: ``True`` (default): each rank feeds its own local batch of every
        feature (data-parallel input). ``False`` (DE's model-parallel input): rank r
        feeds its model group's batch of the features in ``strategy.input_ids_list[r]``.
      replica_sync: how a shard's D copies stay in step. ``"gradients"`` (default,
        exact): its gradient is allreduced over its data group every step.
        ``"weights"`` (Meta's 2D sparse mode): each replica steps on its own gradient,
        and every ``sync_every`` steps ``tfhybrid.DistributedOptimizer`` averages the
        shard weights and optimizer state over the data group (also
        ``tfhybrid.sync_replicas(model)`` and ``tfhybrid.callbacks.SyncReplicas``).
        ``MomentumScaledRowWiseAdagrad`` then scales its accumulators by c = D.
      sync_every: K, the steps between weight syncs in ``"weights"`` mode.
      optimizer: the tables' optimizer as the planner names it (``"rowwise_adagrad"``,
        ``"adam"``, ... ``tfhybrid.planner.OPTIMIZERS``), so that the plan's memory and
        weight-sync bytes count its state; ``None``: ``"sgd"`` (no state).
      plan: a ``tfhybrid.planner.ShardingPlan`` (or its JSON, or the path of a JSON
        file) to execute as it is, e.g. from ``tfhybrid.cost_model.plan_for_cluster``;
        it must be for this mesh's D x M (and layout, where the plan names one) and for
        these tables. The strategy and threshold arguments are then unused.
      dct: a ``tfhybrid.compression.DCT`` whose ``mp_keep`` thresholds the alltoall that
        returns rows (DCT-MP): per sample, each owner sends only the largest
        ``mp_keep`` share of its entries (plus their positions), and their gradients
        return at the same positions. ``None`` (default): everything is sent.
      memory_budget: ``{"dram": bytes}`` per rank: the planner moves the largest tables
        into the disk tier (a file per shard behind a DRAM cache, as a
        ``tfhybrid.layers.Embedding`` with ``cache_rows``) until every rank fits
        (``tfhybrid.planner.place_in_tiers``). A table layer with ``cache_rows`` is in
        the tier whatever the budget. Tiered tables train as in memory, bit for bit, with
        SGD (no momentum) or ``RowWiseAdagrad`` and ``replica_sync="gradients"``.
      store_dir: the folder of the tiered shards' files for tables the budget tiers (each
        rank writes in its own ``rank<r>`` subfolder).

    Inputs are a list with one entry per feature: int ids ``[batch]``, ``[batch, hotness]``
    or a ``tf.RaggedTensor`` ``[batch, None]``. Outputs are what the single-process layers
    would give: ``[batch, dim]`` with a combiner or for ``[batch]`` ids, and
    ``[batch, hotness, dim]`` for a table without a combiner. The hotness may be unknown
    when the step is traced (Keras' ``fit`` over a ``keras.utils.Sequence`` or a Python
    generator sees ``[None, None]`` ids): it is then read at run time, every bag of a
    batch that long, and must be the same on every rank for a table without a combiner
    (the validation stops every rank otherwise). The planner counts such a feature as
    one id per sample; a ``plan`` you pass is used as it is. With ``dp_input=False`` a
    table without a combiner takes one id per sample, checked at run time.

    Example (one process; under horovodrun the same code shards over the mesh)::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding, Embedding
        tfhybrid.init(model_parallel=1)
        layer = DistributedEmbedding([Embedding(1000, 8, combiner="sum"),
                                      tf.keras.layers.Embedding(50, 4)])
        user, item = layer([tf.constant([[1, 2], [3, 4]]), tf.constant([7, 9])])
        assert user.shape == (2, 8) and item.shape == (2, 4)
    """

    def __init__(self, embeddings: Sequence[Any], mesh: mesh_lib.Mesh | None = None,
                 strategy: str = DEFAULT_STRATEGY,
                 column_slice_threshold: int | None = None,
                 row_slice_threshold: int | None = None,
                 data_parallel_threshold: int | None = None,
                 input_table_map: Sequence[int] | None = None,
                 dp_input: bool = True, replica_sync: str = "gradients",
                 sync_every: int = 1, gpu_embedding_size: int | None = None,
                 use_custom_kernel: bool = True, row_slice: Any = None,
                 optimizer: str | None = None,
                 plan: ShardingPlan | str | None = None,
                 dct: compression.DCT | None = None,
                 memory_budget: dict[str, int] | None = None, store_dir: str | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        dram_budget_bytes(memory_budget, None)   # ValueError naming a bad budget now
        if memory_budget is not None and not (isinstance(store_dir, str) and store_dir):
            raise ValueError(f"memory_budget={memory_budget!r} may move tables into the "
                             "disk tier, which needs store_dir (the folder of their files); "
                             f"got store_dir={store_dir!r}")
        self.memory_budget = None if memory_budget is None else dict(memory_budget)
        self.store_dir = store_dir
        self.dct = compression.as_dct(dct)
        # DCT-MP: the share of each sample's returned rows the alltoall carries
        self._mp_keep = None if self.dct is None else self.dct.mp_keep
        if row_slice is not None:
            # DE 0.1's placeholder argument, which DE itself rejected when set
            raise ValueError(f"row_slice={row_slice!r} is not supported; use "
                             "row_slice_threshold (elements above which a table is split "
                             "by rows)")
        if replica_sync not in REPLICA_SYNC:
            raise ValueError(f"replica_sync={replica_sync!r} is unknown; expected one of "
                             f"{REPLICA_SYNC}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r} must be an int >= 1")
        self.replica_sync = replica_sync
        self.sync_every = sync_every
        if not embeddings:
            raise ValueError("embeddings is empty; expected at least one Embedding layer")
        if not isinstance(dp_input, bool):
            raise ValueError(f"dp_input={dp_input!r} must be True (each rank feeds its own "
                             "local batch of every feature) or False (each rank feeds the "
                             "features of its own shards for its model group's batch)")
        if optimizer is not None and optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is unknown; expected None or one of "
                             f"{OPTIMIZERS}")
        self.optimizer_name = optimizer
        self._given_plan = _load_plan(plan)
        if strategy == COST_STRATEGY and self._given_plan is None:
            raise ValueError(
                f"strategy={strategy!r} needs the cluster and workload: make the plan with "
                "tfhybrid.cost_model.plan_for_cluster(tables, cluster, workload) and pass "
                "it as plan=")
        if self._given_plan is not None:
            strategy = self._given_plan.strategy
        elif strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is unknown; expected one of "
                             f"{STRATEGIES}")
        if gpu_embedding_size is not None and (
                isinstance(gpu_embedding_size, bool) or not isinstance(gpu_embedding_size, int)
                or gpu_embedding_size < 0):
            raise ValueError(f"gpu_embedding_size={gpu_embedding_size!r} must be None or an "
                             "int >= 0 (bytes of tables per GPU; the rest live in host memory)")
        if not isinstance(use_custom_kernel, bool):
            raise ValueError(f"use_custom_kernel={use_custom_kernel!r} must be True or False")
        self._embedding_layers = [_as_layer(e) for e in embeddings]
        self._tables = [_table_from_layer(e) for e in self._embedding_layers]
        names = [t.name for t in self._tables]
        if len(set(names)) != len(names):
            raise ValueError(f"embedding layer names must be unique; got {names}")
        adaptive = [t.name for t in self._tables if t.chunks]
        if adaptive and replica_sync == "weights":
            # each replica would prune by its own utility, and replicas whose pools differ
            # cannot be averaged
            raise ValueError(f"tables {adaptive} have dims='adaptive' (FIITED), which needs "
                             "replica_sync='gradients' (every replica then sees the same "
                             f"utility and prunes alike); got replica_sync={replica_sync!r}")
        if input_table_map is None:
            input_table_map = list(range(len(self._tables)))
        input_table_map = [int(t) for t in input_table_map]
        for feature, table in enumerate(input_table_map):
            if not 0 <= table < len(self._tables):
                raise ValueError(f"input_table_map[{feature}]={table} is not a table index "
                                 f"in [0, {len(self._tables)})")
        self.input_table_map = input_table_map
        self._strategy_name = strategy
        self.column_slice_threshold = column_slice_threshold
        self.row_slice_threshold = row_slice_threshold
        self.data_parallel_threshold = data_parallel_threshold
        self.dp_input = dp_input
        self.gpu_embedding_size = gpu_embedding_size
        self.use_custom_kernel = use_custom_kernel
        self._mesh = mesh
        self.plan: ShardingPlan | None = None
        self._strategy: ShardingStrategy | None = None
        masked = [layer.name for layer in self._embedding_layers
                  if getattr(layer, "mask_zero", False)]
        if not dp_input and masked:
            raise ValueError(f"embedding layers {masked} set mask_zero=True, which needs "
                             "dp_input=True (with dp_input=False a rank does not see the "
                             "ids of the features it receives rows for)")
        if not dp_input:
            # a model-parallel input is chosen by the plan, which the user needs before
            # the first batch (``layer.strategy.input_ids_list``)
            self._make_plan(hotness=[1.0] * len(self._tables), local_batch=1)

    @property
    def strategy(self) -> "ShardingStrategy":
        """The placement in DE's terms: ``.name``, ``.input_ids_list``, ``.table_ids``.

        The plan is fixed the first time it is needed (this property, or the first
        batch); it compares equal to its strategy name.
        """
        if self._strategy is None:
            self._make_plan(hotness=[1.0] * len(self._tables), local_batch=1)
        return self._strategy

    def _make_plan(self, hotness: Sequence[float], local_batch: int) -> None:
        if self._mesh is None:
            self._mesh = _mesh_for_layer()
        mesh = self._mesh
        features = [max(1, self.input_table_map.count(t)) for t in range(len(self._tables))]
        if self._given_plan is not None:
            self.plan = self._checked_plan(self._given_plan, mesh)
        else:
            self.plan = self._planned(mesh, hotness, local_batch, features)
        self._tables = [self._in_tier(table, placement)
                        for table, placement in zip(self._tables, self.plan.tables)]
        self._strategy = ShardingStrategy(self._strategy_name, self.plan, mesh,
                                          self.input_table_map)
        # the features this rank's inputs hold, in order
        self._fed_features = (list(range(len(self.input_table_map))) if self.dp_input
                              else self._strategy.input_ids_list[mesh.rank])
        # every rank checks every rank, so all raise together (none waits in a collective)
        idle = [r for r, ids in enumerate(self._strategy.input_ids_list) if not ids]
        if not self.dp_input and idle:
            raise ValueError(
                f"dp_input=False: ranks {idle} would feed no feature (their positions hold "
                f"no table; plan: {self.plan.describe()}); lower column_slice_threshold, use "
                "strategy='basic' or 'memory_balanced' (they slice tables so every position "
                "holds one), or use fewer ranks per model group")

    def _in_tier(self, table: _Table, placement: TablePlacement) -> _Table:
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
                                   store_dir=store_dir)

    def _planned(self, mesh: mesh_lib.Mesh, hotness: Sequence[float], local_batch: int,
                 features: Sequence[int]) -> ShardingPlan:
        compute = tf.as_dtype(self.compute_dtype)
        return plan_sharding(
            [TableConfig(t.name, t.rows, t.dim, hotness=max(h, 1.0),
                         combiner=t.combiner, features=f, cache_rows=t.cache_rows,
                         adaptive=bool(t.chunks))
             for t, h, f in zip(self._tables, hotness, features)],
            mesh.data_parallel, mesh.model_parallel, strategy=self._strategy_name,
            column_slice_threshold=self.column_slice_threshold,
            row_slice_threshold=self.row_slice_threshold,
            data_parallel_threshold=self.data_parallel_threshold,
            local_batch_size=local_batch, optimizer=self.optimizer_name or "sgd",
            replica_sync=self.replica_sync, sync_every=self.sync_every,
            comm_dtype=(compute.name if compute in (tf.float16, tf.bfloat16) else None),
            layout=mesh.layout, memory_budget=self.memory_budget)

    def _checked_plan(self, plan: ShardingPlan, mesh: mesh_lib.Mesh
                      ) -> ShardingPlan:
        """``plan`` if it fits this mesh and these tables; ValueError naming what differs."""
        if (plan.data_parallel, plan.model_parallel) != (mesh.data_parallel,
                                                         mesh.model_parallel):
            raise ValueError(
                f"plan is for a D x M = {plan.data_parallel} x {plan.model_parallel} mesh; "
                f"this mesh is {mesh.data_parallel} x {mesh.model_parallel} (start with "
                f"tfhybrid.init(model_parallel={plan.model_parallel}))")
        # a cost plan's predictions hold for one layout; other plans place alike in both
        if (plan.strategy == COST_STRATEGY and plan.layout
                and plan.layout != mesh.layout):
            raise ValueError(f"plan is for layout={plan.layout!r}; this mesh is "
                             f"{mesh.layout!r}")
        got = [(p.name, max(s.row_end for s in p.shards), max(s.col_end for s in p.shards))
               for p in plan.tables]
        want = [(t.name, t.rows, t.dim) for t in self._tables]
        if got != want:
            raise ValueError(f"plan's tables (name, rows, dim) {got} are not this layer's "
                             f"{want}")
        return plan

    # ------------------------------------------------------------------ build
    def build(self, input_shape):
        shapes = input_shape if isinstance(input_shape, (list, tuple)) else [input_shape]
        if self.plan is None:
            if len(shapes) != len(self.input_table_map):
                raise ValueError(f"DistributedEmbedding got {len(shapes)} inputs; expected "
                                 f"{len(self.input_table_map)} (one per input_table_map "
                                 "entry)")
            hotness = [0.0] * len(self._tables)
            local_batch = 1
            for feature, shape in enumerate(shapes):
                shape = tf.TensorShape(shape)
                h = shape[1] if shape.rank == 2 and shape[1] is not None else 1
                hotness[self.input_table_map[feature]] += float(h)
                local_batch = shape[0] or local_batch
            self._make_plan(hotness, local_batch)
        if len(shapes) != len(self._fed_features):
            raise ValueError(
                f"DistributedEmbedding got {len(shapes)} inputs; expected "
                f"{len(self._fed_features)}: "
                + ("one per input_table_map entry" if self.dp_input else
                   f"with dp_input=False, the features "
                   f"layer.strategy.input_ids_list[{self._mesh.rank}]="
                   f"{self._fed_features}"))
        mesh = self._mesh
        # ids per step per table, for choosing sparse or dense gradient syncs
        hotness = [0.0] * len(self._tables)
        local_batch = 1
        for feature, shape in zip(self._fed_features, shapes):
            shape = tf.TensorShape(shape)
            h = shape[1] if shape.rank == 2 and shape[1] is not None else 1
            hotness[self.input_table_map[feature]] += float(h)
            if shape[0]:
                local_batch = shape[0] if self.dp_input else max(
                    1, shape[0] // mesh.model_parallel)
        position = mesh.model_position
        for t in range(len(self._tables)):
            _check_table_config(self._embedding_layers[t], self._tables[t],
                                self.plan.tables[t])
            if self._tables[t].custom_class is not None:
                _check_custom_table(self._tables[t], self.plan.tables[t])
        # a custom table's shards are instances of its layer (tracked, so their weights
        # are this layer's), keyed like _table_vars / _shard_vars
        self._custom_shards: dict[tuple[int, int], Any] = {}
        on_host = self._memory_tiers(position)
        # variables: one per data-parallel table, one per model-parallel shard we own
        self._table_vars: dict[int, tf.Variable] = {}
        self._shard_vars: dict[tuple[int, int], tf.Variable] = {}
        # FIITED tables and shards, keyed "<table>_<shard>" (a tracked dict: their
        # variables are the layer's weights); the variable above is the table's pool
        self._chunked_tables: dict[str, ChunkedTable | ChunkedCachedTable] = {}
        # tiered shards (cache_rows), keyed alike; the variable above is the shard's cache
        self._cached_tables: dict[str, CachedTable] = {}
        # per FIITED table, every row's chunk count as every rank planned it at the last
        # adjustment (or read it from a restored checkpoint): where a shard's chunks go
        # in the compact checkpoint depends on the rows other ranks hold (plain data:
        # set past Keras' __setattr__, which would track the dict)
        object.__setattr__(self, "_whole_chunk_counts", {
            t: np.full([table.rows], table.chunks, np.min_scalar_type(table.chunks))
            for t, table in enumerate(self._tables) if table.chunks})
        for t, (table, placement) in enumerate(zip(self._tables, self.plan.tables)):
            ids_per_step = local_batch * hotness[t]
            if placement.kind == Kind.DATA_PARALLEL and table.cache_rows:
                raise ValueError(
                    f"table {table.name!r} has cache_rows={table.cache_rows} (a disk tier) "
                    "but the plan replicates it (data_parallel): raise its size above "
                    f"data_parallel_threshold={self.data_parallel_threshold} or keep it in "
                    "memory (a replicated table is small)")
            if placement.kind == Kind.DATA_PARALLEL:
                self._table_vars[t] = self._add_table_weight(
                    t, 0, table.name, placement.shards[0], on_host[(t, 0)])
                distributed.mark_embedding(self._table_vars[t])
                distributed.mark_sparse_sync(self._table_vars[t], bool(table.chunks) or
                                             sync_is_sparse(table.rows, table.dim,
                                                            ids_per_step, mesh.size))
                continue
            if placement.kind == Kind.ROW_WISE:
                ids_per_step /= len(placement.shards)
            for s, shard in enumerate(placement.shards):
                if shard.owner != position:
                    continue
                var = self._add_table_weight(t, s, f"{table.name}/shard_{s}", shard,
                                             on_host[(t, s)])
                distributed.mark_model_parallel(
                    var, mesh, self.sync_every if self.replica_sync == "weights" else None,
                    table_key=self._table_key(t))
                distributed.mark_embedding(var)
                # a pool's gradient is rows at logical ids, which only the sparse sync
                # (and the pool's own apply) can place
                distributed.mark_sparse_sync(var, bool(table.chunks) or sync_is_sparse(
                    shard.row_end - shard.row_start, shard.col_end - shard.col_start,
                    mesh.model_parallel * ids_per_step, mesh.data_parallel))
                chunked = self._chunked(t, s)
                if chunked is not None:
                    # the pool's row state lives on the shard's position too (broadcast
                    # and checkpointed with the shard)
                    for state in chunked.row_state:
                        distributed.mark_model_parallel(state, mesh)
                cached = self._cached(t, s)
                if cached is not None:
                    distributed.mark_model_parallel(cached.cache_accumulator, mesh)
                    # a cache's gradient rows are at slots, which the replicas share
                    distributed.mark_sparse_sync(var, True)
                self._shard_vars[(t, s)] = var
        # The backward alltoall must run on every rank of the model group, but the tape
        # skips it on a rank whose sent rows touch no trainable variable (a position that
        # owns no shard). This empty variable rides along with the rows, so every rank's
        # tape needs the backward alltoall.
        self._anchor = self.add_weight(name="alltoall_anchor", shape=[0], initializer="zeros",
                                       dtype=tf.float32, experimental_autocast=False)
        # it also names the sharded tables, so every rank (owner or not) joins the same
        # norm allreduce when the optimizer clips
        distributed.mark_anchor(self._anchor, [
            self._table_key(t) for t, placement in enumerate(self.plan.tables)
            if placement.kind != Kind.DATA_PARALLEL])
        # routes: the (feature, shard) pairs each position serves, in one fixed order that
        # every rank derives from the same plan
        self._routes: list[list[_Route]] = [[] for _ in range(mesh.model_parallel)]
        for feature, t in enumerate(self.input_table_map):
            placement = self.plan.tables[t]
            if placement.kind == Kind.DATA_PARALLEL:
                continue
            for s, shard in enumerate(placement.shards):
                self._routes[shard.owner].append(_Route(
                    feature, t, s, shard.owner, shard.row_start, shard.row_end,
                    shard.col_end - shard.col_start))
        self._wire_id_dtype = tf.int32 if all(t.rows < 2**31 for t in self._tables) else tf.int64
        compute = tf.as_dtype(self.compute_dtype)
        self._wire_float = compute if compute in (tf.float16, tf.bfloat16) else tf.float32
        super().build(input_shape)
        self._register_for_checkpoints()

    def _memory_tiers(self, position: int) -> dict[tuple[int, int], bool]:
        """Which of this rank's tables and shards live in host memory (DE's
        ``gpu_embedding_size``: past that many bytes per GPU, tables go to the host)."""
        mine = []   # (table, shard, bytes), in plan order
        for t, placement in enumerate(self.plan.tables):
            for s, shard in enumerate(placement.shards):
                if placement.kind == Kind.DATA_PARALLEL or shard.owner == position:
                    mine.append(((t, s), 4 * (shard.row_end - shard.row_start)
                                 * (shard.col_end - shard.col_start)))
                if placement.kind == Kind.DATA_PARALLEL:
                    break
        if not tf.config.list_logical_devices("GPU"):
            if self.gpu_embedding_size is not None:
                _LOG.info("DistributedEmbedding %r: no GPU is visible, so every table is in "
                          "host memory (gpu_embedding_size=%d is not needed)", self.name,
                          self.gpu_embedding_size)
            return {key: False for key, _ in mine}
        budget = float("inf") if self.gpu_embedding_size is None else self.gpu_embedding_size
        on_host, used = {}, 0
        for key, nbytes in mine:
            on_host[key] = used + nbytes > budget
            used += 0 if on_host[key] else nbytes
        if any(on_host.values()):
            _LOG.info("DistributedEmbedding %r: %d of this rank's %d tables/shards exceed "
                      "gpu_embedding_size=%d bytes and live in host memory", self.name,
                      sum(on_host.values()), len(mine), self.gpu_embedding_size)
        return on_host

    def _add_table_weight(self, table: int, index: int, name: str, shard: Shard,
                          on_host: bool) -> tf.Variable:
        """One table's (or shard's) variable, with its Keras layer's regularizer and
        constraint; each shard lives on one position, so a regularizer's loss is counted
        once per replica, and the gradient sync averages the replicas."""
        layer = self._embedding_layers[table]
        rows, width = shard.row_end - shard.row_start, shard.col_end - shard.col_start
        with tf.device("/CPU:0") if on_host else contextlib.nullcontext():
            if self._tables[table].cache_rows:
                return self._add_cached_shard(table, index, name, shard)
            if self._tables[table].chunks:
                with tf.init_scope():
                    initial = _slice_initializer(self._tables[table], shard)(
                        [rows, width], dtype=tf.float32)
                chunked = ChunkedTable(
                    rows, width, width // self._tables[table].chunk_dim,
                    initial_value=initial, name=name.replace("/", "_"),
                    use_custom_op=None if self.use_custom_kernel else False)
                self._chunked_tables[f"{table}_{index}"] = chunked
                return chunked.pool
            if self._tables[table].custom_class is not None:
                custom = _custom_shard_layer(self._tables[table], rows, width,
                                             name.replace("/", "_"))
                custom.build(tf.TensorShape([None]))
                # as Keras' own first call would: a build that does not call
                # super().build() leaves built False, and the call would build again
                custom.built = True
                self._custom_shards[(table, index)] = custom
                return custom.weights[0]
            return self.add_weight(
                name=name, shape=[rows, width],
                initializer=_slice_initializer(self._tables[table], shard),
                regularizer=getattr(layer, "embeddings_regularizer", None),
                constraint=getattr(layer, "embeddings_constraint", None),
                dtype=tf.float32, experimental_autocast=False)

    def _add_cached_shard(self, table: int, index: int, name: str,
                          shard: Shard) -> tf.Variable:
        """A tiered shard: its rows in a file of this rank's, a cache in front (with
        FIITED's per-row widths for an adaptive table)."""
        spec = self._tables[table]
        rows, width = shard.row_end - shard.row_start, shard.col_end - shard.col_start

        def initializer(start, stop):
            # a seeded table draws the shard's slice of the whole table's values
            piece = dataclasses.replace(shard, row_start=shard.row_start + start,
                                        row_end=shard.row_start + stop)
            with tf.device("/CPU:0"):
                return _slice_initializer(spec, piece)([stop - start, width],
                                                       dtype=tf.float32).numpy()

        # one folder per rank (the ranks may share store_dir); the table's name, which
        # its variables and so their gradient syncs' collectives carry, is the same on
        # every replica
        directory = os.path.join(spec.store_dir, f"rank{self._mesh.rank}")
        os.makedirs(directory, exist_ok=True)
        tier = dict(initializer=initializer, policy=spec.cache_policy,
                    name=re.sub(r"\W", "_", f"{self.name}_{name}"),
                    pinned_calls=TIER_PINNED_STEPS)
        cache_rows = shard_cache_rows(spec.cache_rows, spec.rows, rows)
        with tf.init_scope():   # the host side works eagerly, also when built in a trace
            if spec.chunks:
                cached = ChunkedCachedTable(
                    rows, width, cache_rows, directory, chunks=width // spec.chunk_dim,
                    use_custom_op=None if self.use_custom_kernel else False, **tier)
                self._chunked_tables[f"{table}_{index}"] = cached
            else:
                cached = CachedTable(rows, width, cache_rows, directory, **tier)
        self._cached_tables[f"{table}_{index}"] = cached
        return cached.cache

    def _cached(self, table: int, shard: int) -> CachedTable | None:
        """The tier of table ``table``'s shard ``shard`` if this rank holds it."""
        return self._cached_tables.get(f"{table}_{shard}")

    def _row_store(self, table: int, shard: int) -> ChunkedTable | CachedTable | None:
        """The FIITED pool or the tier that keeps the shard's rows, if either does (their
        ``read_rows`` / ``write_rows`` take the shard's rows in row order)."""
        chunked = self._chunked(table, shard)
        return chunked if chunked is not None else self._cached(table, shard)

    def _table_key(self, table: int) -> str:
        return f"{self.name}/{self._tables[table].name}"

    def _chunked(self, table: int, shard: int) -> ChunkedTable | ChunkedCachedTable | None:
        """The FIITED pool (or tiered FIITED table) of table ``table``'s shard ``shard``
        (0 for a replicated table) if this rank holds it and the table is adaptive."""
        return self._chunked_tables.get(f"{table}_{shard}")

    # ------------------------------------------------------------------ call
    def call(self, inputs):
        if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            raise ValueError(
                f"DistributedEmbedding {self.name!r} is being compiled with XLA "
                "(jit_compile=True), but its Horovod alltoall/allgather cannot be compiled. "
                "Use model.compile(jit_compile=False) and wrap the dense towers in "
                "tfhybrid.layers.XlaCompiled(...) to run them under XLA.")
        bags, local_batch, invalid = self._bags_of(inputs)
        phase = pipeline_lib.phase_of(self)
        if phase is not None and phase.routing:
            # TrainPipeline reads this batch ahead: it keeps what the route will send (its
            # collectives run in the next step's function) and stops here
            phase.hand_over(self, *self._route_prepare(bags, local_batch, invalid,
                                                       phase.ended))
            return self._placeholders(bags)
        if phase is None:
            # 1-2. validate on every rank together, then ids to their owners
            bags, routed = self._route(bags, local_batch, invalid)
        else:
            # TrainPipeline routed (and validated) this batch during the previous step
            routed = phase.take(self)

        # 3-4. model-parallel features through the model group
        partials = (self._exchange(bags, local_batch, routed, phase)
                    if any(self._routes) else {})

        outputs = []
        for f, t in enumerate(self.input_table_map):
            placement = self.plan.tables[t]
            if placement.kind == Kind.DATA_PARALLEL:
                # 5. data-parallel tables: local lookup
                outputs.append(self._finish(bags[f], self._lookup_sum(
                    (t, 0), self._table_vars[t], bags[f].values, bags[f].lengths)))
                continue
            if placement.kind == Kind.COLUMN_WISE:
                summed = tf.concat([partials[(f, s)] for s in range(len(placement.shards))],
                                   axis=1)
            else:  # table_wise is one shard; row_wise partial sums add up
                summed = tf.add_n([partials[(f, s)] for s in range(len(placement.shards))])
            if self.dp_input:
                outputs.append(self._finish(bags[f], summed))
            else:
                # the owners already divided means; one bag per sample (checked)
                outputs.append(tf.cast(summed, self.compute_dtype))
        self._add_activity_losses(outputs, local_batch)
        return outputs

    def _bags_of(self, inputs) -> tuple[dict, Any, dict]:
        """The fed features as bags, the local batch, and dp_input=False's bad inputs."""
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        fed = self._fed_features
        if len(inputs) != len(fed):
            raise ValueError(f"DistributedEmbedding got {len(inputs)} inputs; expected "
                             f"{len(fed)}" + ("" if self.dp_input else
                                              f" (features {fed}, dp_input=False)"))
        raw = dict(zip(fed, inputs))
        invalid: dict[int, str] = {}
        if self.dp_input:
            bags = {f: self._as_bags(f, x) for f, x in raw.items()}
            return bags, bags[0].batch, invalid
        local_batch = self._local_batch_of_group(inputs[0])
        start = tf.cast(self._mesh.model_position, local_batch.dtype) * local_batch
        bags = {}
        for f, x in raw.items():
            if self.plan.tables[self.input_table_map[f]].kind == Kind.DATA_PARALLEL:
                # a replicated table looks up only this rank's share of the batch
                x = x[start:start + local_batch]
            bags[f], invalid[f] = self._as_model_parallel_bags(f, x)
        return bags, local_batch, invalid

    def _route(self, bags: dict, batch, invalid: dict) -> tuple[dict, list]:
        """Steps 1-2: the checked bags and the ids of the routes this position owns.

        The routed ids are ``[ids of each owned route] + [bag lengths of each]``, for the
        model group's samples in rank order: what ``_exchange`` looks up (a tiered
        shard's ids as cache slots, its rows loaded). A failed check raises on every
        rank before any id leaves this one.
        """
        sending, facts = self._route_prepare(bags, batch, invalid)
        routed, _, _, asserts = self._route_exchange(sending, facts)
        with tf.control_dependencies(asserts):
            bags = {f: dataclasses.replace(b, values=tf.identity(b.values))
                    for f, b in bags.items()}
        return bags, routed

    def _route_prepare(self, bags: dict, batch, invalid: dict, ended=None
                       ) -> tuple[list, tuple]:
        """The route's first half, on this rank alone: what its collectives will send,
        as a list of tensors (the id check's report, the batch, and the ids for their
        owners, or with ``dp_input=False`` this position's own route ids), and the
        trace-time facts that :meth:`_route_exchange` reads them by.

        ``ended`` (a bool tensor, ``TrainPipeline``'s) says that this rank's input has
        ended and ``bags`` only stand in for a batch; the ranks agree on it in the same
        allgather that checks the ids. A pipeline prepares batch t+2 during step t and
        sends it during step t+1, so nothing here may touch a variable.
        """
        report = self._id_report(bags, batch, invalid, ended)
        mine = self._routes[self._mesh.model_position]
        parts = []
        if any(self._routes):
            if self.dp_input:
                parts = list(self._ids_payload(bags))
            else:
                # the input already holds the model group's batch of this position's
                # features
                shard_ids = [self._shard_ids(bags[r.feature], r) for r in mine]
                parts = [ids for ids, _ in shard_ids] + [n for _, n in shard_ids]
        # bags per sample of each route: ints where the hotness is static; a hotness
        # known only at run time (None here) travels as a tensor after the parts, so
        # that a pipeline's read-ahead carries it to the step that sends
        per_route = [bags[r.feature].per_sample for r in mine] if self.dp_input else []
        static = tuple(k if isinstance(k, int) else None for k in per_route)
        run_time = [tf.cast(k, tf.int64) for k in per_route if not isinstance(k, int)]
        reasons = [reason for reason in invalid.values() if reason] + [
            f"if so, {bag.unsupported_reason}" for bag in bags.values()
            if bag.unsupported_reason]
        facts = (tuple(reasons[:1]), static,
                 ended is not None)
        return [report, tf.cast(batch, tf.int64)] + parts + run_time, facts

    def _route_exchange(self, sending: list, facts: tuple) -> tuple[list, Any, Any, list]:
        """The route's second half: its collectives on what :meth:`_route_prepare` made,
        and what follows them. Returns the routed ids (see :meth:`_route`), whether every
        rank's input has ended and the first failed check's message ("" if none), both
        only for a prepared read-ahead (else None), and otherwise the checks as asserts
        that every id waits for.

        The only variables it touches are tiered shards' caches, where it fills slots
        that neither this batch nor the one before uses (``pinned_calls``), so
        ``TrainPipeline`` may run it a step ahead.
        """
        reasons, static_per_route, read_ahead = facts
        run_time = iter(sending[len(sending) - static_per_route.count(None):])
        bags_per_route = tuple(next(run_time) if k is None else k for k in static_per_route)
        report, batch = sending[0], sending[1]
        parts = list(sending[2:len(sending) - static_per_route.count(None)])
        checks, all_ended = self._id_checks(report, reasons, read_ahead)
        if read_ahead:
            # TrainPipeline raises after the step it runs beside has finished, so that a
            # bad batch read ahead cannot cut that step's update short
            failure, asserts = _first_failure(checks), []
        else:
            failure = None
            asserts = [tf.debugging.Assert(holds, [message]) for holds, message in checks]
        if not any(self._routes):
            return [], all_ended, failure, asserts
        if asserts:
            with tf.control_dependencies(asserts):
                parts = [tf.identity(part) for part in parts]
        if self.dp_input:
            route_ids, route_lengths = self._ids_received(parts[0], parts[1], batch,
                                                          bags_per_route)
        else:
            half = len(parts) // 2
            route_ids, route_lengths = parts[:half], parts[half:]
        # a tiered shard's ids become cache slots, their rows loaded now: read ahead by
        # a pipeline, the rows are in the cache before the step that looks them up
        for i, r in enumerate(self._routes[self._mesh.model_position]):
            cached = self._cached(r.table, r.shard)
            if cached is not None:
                route_ids[i] = self._cache_slots(cached, route_ids[i],
                                                 f"{r.feature}_{r.shard}")
        return route_ids + route_lengths, all_ended, failure, asserts

    def _placeholders(self, bags: dict) -> list:
        """Zeros shaped like the outputs: a read-ahead's forward stops at this layer, and
        what follows only needs to trace."""
        outputs = []
        for f, t in enumerate(self.input_table_map):
            bag = bags[f]
            zeros = tf.zeros([tf.size(bag.lengths), self._tables[t].dim], tf.float32)
            outputs.append(self._finish(bag, zeros) if self.dp_input
                           else tf.cast(zeros, self.compute_dtype))
        return outputs

    def _add_activity_losses(self, outputs: list, local_batch) -> None:
        """A table layer's ``activity_regularizer``, divided by the batch as Keras does.

        The per-rank mean over the local batch, averaged by the gradient sync, is the
        reference's mean over the global batch (for regularizers that sum over samples).
        """
        for f, out in enumerate(outputs):
            regularizer = getattr(self._embedding_layers[self.input_table_map[f]],
                                  "activity_regularizer", None)
            if regularizer is not None:
                self.add_loss(regularizer(out) / tf.cast(local_batch, out.dtype))

    def compute_mask(self, inputs, mask=None):
        """Keras' ``mask_zero``: ``ids != 0`` for each feature of a table that sets it
        (and has no combiner); ``None`` for the others."""
        if not any(getattr(layer, "mask_zero", False) for layer in self._embedding_layers):
            return None
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        masks = []
        for f, ids in enumerate(inputs):
            layer = self._embedding_layers[self.input_table_map[f]]
            masks.append(tf.not_equal(ids, 0) if getattr(layer, "mask_zero", False)
                         and getattr(layer, "combiner", None) is None else None)
        return masks

    def _dp_to_mp_input(self, dp_inputs: Sequence[Any]) -> list:
        """Turns a data-parallel batch (every feature, this rank's samples) into this
        rank's ``dp_input=False`` input: ``strategy.input_ids_list[rank]``'s features for
        the model group's batch. Every rank of the mesh must call it."""
        dp_inputs = list(dp_inputs) if isinstance(dp_inputs, (list, tuple)) else [dp_inputs]
        if len(dp_inputs) != len(self.input_table_map):
            raise ValueError(f"_dp_to_mp_input got {len(dp_inputs)} inputs; expected "
                             f"{len(self.input_table_map)} (one per input_table_map entry)")
        strategy = self.strategy
        wanted = dict(enumerate(strategy.input_ids_list))
        mine = _dp_to_mp_input(dict(enumerate(dp_inputs)), wanted, self._mesh)
        return [mine[f] for f in strategy.input_ids_list[self._mesh.rank]]

    def _local_batch_of_group(self, ids) -> tf.Tensor:
        """dp_input=False: the model group's batch G fed here, divided by M (int64)."""
        group = self._mesh.model_parallel
        rows = ids.nrows() if isinstance(ids, tf.RaggedTensor) else None
        static = (ids.shape[0] if not isinstance(ids, tf.RaggedTensor) else
                  tf.get_static_value(rows))
        if static is not None and int(static) % group:
            raise ValueError(
                f"DistributedEmbedding {self.name!r} (dp_input=False): the model group's "
                f"batch size {int(static)} is not divisible by the {group} ranks of the "
                "model group; feed a batch that splits evenly")
        if rows is None:
            rows = tf.shape(tf.convert_to_tensor(ids), out_type=tf.int64)[0]
        rows = tf.cast(rows, tf.int64)
        with tf.control_dependencies([tf.debugging.assert_equal(
                rows % group, tf.constant(0, tf.int64),
                message=f"DistributedEmbedding {self.name!r} (dp_input=False): the model "
                        f"group's batch size is not divisible by the {group} ranks of the "
                        "model group")]):
            return tf.identity(rows // group)

    def _as_model_parallel_bags(self, feature: int, ids) -> tuple["_Bags", str]:
        """dp_input=False: this rank's bags, or a stand-in and the reason they are bad.

        Only this rank sees this feature, so raising here would leave the other ranks
        waiting in a collective; the reason travels in the validation instead.
        """
        table = self._tables[self.input_table_map[feature]]
        one_per_sample = ("with dp_input=False a table without a combiner takes one id per "
                          "sample ([batch] ids), because the other ranks must know its "
                          "output shape")
        try:
            bags = self._as_bags(feature, ids)
            if not isinstance(bags.per_sample, int):
                # the hotness is known only at run time: one id per sample holds or the
                # validation stops every rank (the bags are read as one id per sample)
                return dataclasses.replace(
                    bags, lengths=tf.ones_like(bags.values), per_sample=1, out_shape=None,
                    unsupported=tf.not_equal(bags.per_sample, 1),
                    unsupported_reason=f"feature {feature} (table {table.name!r}, "
                    f"combiner=None) has a hotness other than 1 at run time; "
                    f"{one_per_sample}"), ""
            if bags.per_sample != 1:
                raise ValueError(
                    f"feature {feature} (table {table.name!r}, combiner=None) has shape "
                    f"{ids.shape}; {one_per_sample}")
            return bags, ""
        except ValueError as error:
            _LOG.error("DistributedEmbedding %r: %s", self.name, error)
            batch = (ids.nrows() if isinstance(ids, tf.RaggedTensor)
                     else tf.shape(tf.convert_to_tensor(ids), out_type=tf.int64)[0])
            return self._as_bags(feature, tf.zeros([batch], tf.int64)), str(error)

    # --------------------------------------------------------------- helpers
    @dataclasses.dataclass(frozen=True)
    class _Bags:
        """One feature as bags: ``values`` ids, ``lengths`` ids per bag."""
        values: tf.Tensor
        lengths: tf.Tensor       # [batch * per_sample]
        batch: tf.Tensor         # samples (int64): per_sample may be 0 (zero hotness)
        # bags per sample: hotness for combiner=None, else 1; an int64 scalar tensor when
        # the hotness is known only at run time
        per_sample: int | tf.Tensor
        out_shape: Any           # None, or the trailing shape for combiner=None
        combiner: str | None
        # dp_input=False: whether this rank's input turns out unsupported at run time (a
        # bool tensor), and why; the validation reports it with the static reasons
        unsupported: Any = False
        unsupported_reason: str = ""

    def _as_bags(self, feature: int, ids) -> "_Bags":
        table = self._tables[self.input_table_map[feature]]
        if isinstance(ids, tf.RaggedTensor):
            if table.combiner is None:
                raise ValueError(
                    f"feature {feature} (table {table.name!r}) is ragged, which needs a "
                    "combiner ('sum' or 'mean'); the table has combiner=None")
            values = tf.cast(ids.flat_values, tf.int64)
            lengths = tf.cast(ids.row_lengths(), tf.int64)
            return self._Bags(values, lengths, tf.size(lengths, out_type=tf.int64), 1, None,
                              table.combiner)
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise ValueError(f"feature {feature} (table {table.name!r}) has dtype "
                             f"{ids.dtype.name}; expected integer ids")
        if ids.shape.rank not in (1, 2):
            raise ValueError(f"feature {feature} (table {table.name!r}) has shape "
                             f"{ids.shape}; expected [batch] or [batch, hotness]")
        values = tf.reshape(tf.cast(ids, tf.int64), [-1])
        if ids.shape.rank == 1:
            return self._Bags(values, tf.ones_like(values), tf.size(values, out_type=tf.int64),
                              1, None, table.combiner)
        # A pipeline traced from a Sequence or a generator knows only the rank: the
        # hotness is then read at run time, as tf.keras.layers.Embedding does.
        hotness = ids.shape[1]
        if hotness is None:
            hotness = tf.shape(ids, out_type=tf.int64)[1]
        if table.combiner is None:
            # no combiner: each id is a bag of one, reshaped to [batch, hotness, dim]
            return self._Bags(values, tf.ones_like(values),
                              tf.shape(ids, out_type=tf.int64)[0], hotness, hotness, None)
        lengths = tf.fill([tf.shape(ids, out_type=tf.int64)[0]],
                          tf.cast(hotness, tf.int64))
        return self._Bags(values, lengths, tf.size(lengths, out_type=tf.int64), 1, None,
                          table.combiner)

    def _id_report(self, bags: dict, batch, invalid: dict, ended=None) -> tf.Tensor:
        """This rank's row of the id check (:meth:`_id_checks`): [batch, (bad?, first
        bad id, bad input?, bags per sample) per feature] (zeros for a feature it does not
        feed), and with ``ended`` (``TrainPipeline``'s read-ahead) whether its input has
        ended."""
        num_features = len(self.input_table_map)
        report = [tf.reshape(tf.cast(batch, tf.int64), [1])]
        for f in range(num_features):
            if f not in bags:
                report.append(tf.zeros([_REPORT_FIELDS], tf.int64))
                continue
            bag = bags[f]
            rows = self._tables[self.input_table_map[f]].rows
            # padded with one good id, so a rank with no ids for this feature (empty
            # bags, zero hotness) still has an element to take the argmax of
            values = tf.concat([bag.values, tf.zeros([1], bag.values.dtype)], 0)
            bad = tf.logical_or(values < 0, values >= rows)
            first_bad = tf.gather(values, tf.argmax(tf.cast(bad, tf.int32)))
            any_bad = tf.reduce_any(bad)
            report += [tf.reshape(tf.cast(any_bad, tf.int64), [1]),
                       tf.reshape(tf.where(any_bad, first_bad, 0), [1]),
                       tf.reshape(tf.cast(tf.logical_or(bool(invalid.get(f)),
                                                        bag.unsupported), tf.int64), [1]),
                       tf.reshape(tf.cast(bag.per_sample, tf.int64), [1])]
        if ended is not None:
            report.append(tf.reshape(tf.cast(ended, tf.int64), [1]))
        return tf.reshape(tf.concat(report, 0), [1, -1])

    def _id_checks(self, report: tf.Tensor, reasons: tuple, read_ahead: bool
                   ) -> tuple[list, Any]:
        """Checks that every id is in range and every rank has the same batch size (and,
        with ``dp_input=True``, the same bags per sample: an owner reads every rank's
        ids by its own).

        After one allgather of every rank's :meth:`_id_report` every rank holds the same
        ``(holds, message)`` checks, so all raise alike and none is left in a collective.
        ``reasons``: why this rank's input is not supported, if it is not. For a
        read-ahead the ranks must also agree on whether their input has ended, and the
        second value is whether they all have (else None).
        """
        num_features = len(self.input_table_map)
        everyone = collectives.allgather(report, self._mesh.size,
                                         f"tfhybrid_{self.name}_validate")
        sizes = everyone[:, 0]
        flags = tf.reshape(everyone[:, 1:1 + _REPORT_FIELDS * num_features],
                           [self._mesh.size, num_features, _REPORT_FIELDS])
        names = tf.constant([self._tables[t].name for t in self.input_table_map])
        rows = tf.constant([self._tables[t].rows for t in self.input_table_map], tf.int64)

        def first(mask):
            where = tf.argmax(tf.cast(tf.reshape(mask, [-1]), tf.int32))
            return where, where // num_features, where % num_features

        bad_any = flags[:, :, 0] > 0
        where, bad_rank, bad_feature = first(bad_any)
        id_message = tf.strings.join([
            "DistributedEmbedding: embedding table '", tf.gather(names, bad_feature),
            "' got id ",
            tf.strings.as_string(tf.reshape(flags, [-1, _REPORT_FIELDS])[where, 1]),
            " on rank ", tf.strings.as_string(bad_rank), "; expected ids in [0, ",
            tf.strings.as_string(tf.gather(rows, bad_feature)), ")"])
        bad_input = flags[:, :, 2] > 0
        _, input_rank, input_feature = first(bad_input)
        input_message = tf.strings.join([
            "DistributedEmbedding: feature ", tf.strings.as_string(input_feature),
            " (table '", tf.gather(names, input_feature), "') on rank ",
            tf.strings.as_string(input_rank), " is not a supported input; that rank's log "
            "says why"] + [f" (here: {reason})" for reason in reasons])
        batch_message = tf.strings.format(
            "DistributedEmbedding: {} batch sizes differ across ranks; batch size of "
            "rank 0..{}: {}", ["local" if self.dp_input else "model-group",
                               self._mesh.size - 1, sizes], summarize=-1)
        checks = [(tf.logical_not(tf.reduce_any(bad_input)), input_message),
                  (tf.logical_not(tf.reduce_any(bad_any)), id_message),
                  (tf.reduce_all(tf.equal(sizes, sizes[0])), batch_message)]
        if self.dp_input:
            per_sample = flags[:, :, 3]
            checks.append((tf.reduce_all(tf.equal(per_sample, per_sample[:1])),
                           tf.strings.format(
                               "DistributedEmbedding: the hotness of a table without a "
                               "combiner differs across ranks; bags per sample of each "
                               "feature on rank 0..{}: {}",
                               [self._mesh.size - 1, per_sample], summarize=-1)))
        all_ended = None
        if read_ahead:
            ended_ranks = everyone[:, -1] > 0
            checks.append((tf.equal(tf.reduce_any(ended_ranks), tf.reduce_all(ended_ranks)),
                           tf.strings.format(
                               pipeline_lib.ENDED_MESSAGE,
                               [tf.boolean_mask(tf.range(self._mesh.size), ended_ranks)],
                               summarize=-1)))
            all_ended = tf.reduce_all(ended_ranks)
        return checks, all_ended

    def _shard_ids(self, bag: "_Bags", route: _Route) -> tuple[tf.Tensor, tf.Tensor]:
        """The route's ids (relative to its shard) and the number of them in each bag."""
        if self.plan.tables[route.table].kind != Kind.ROW_WISE:
            return bag.values, bag.lengths
        inside = tf.logical_and(bag.values >= route.row_start, bag.values < route.row_end)
        bag_index = tf.repeat(tf.range(tf.size(bag.lengths, out_type=tf.int64)), bag.lengths)
        return (tf.boolean_mask(bag.values, inside) - route.row_start,
                tf.math.unsorted_segment_sum(tf.cast(inside, tf.int64), bag_index,
                                             tf.size(bag.lengths)))

    def _ids_payload(self, bags: dict) -> tuple[tf.Tensor, tf.Tensor]:
        """dp_input=True, step 2's input: to each position of the model group, the bag
        lengths and then the ids of its routes, in one buffer, and each one's size."""
        wire = self._wire_id_dtype
        # to each position, [lengths of its routes | ids of its routes]
        payloads, sizes = [], []
        for routes in self._routes:
            lengths, values = [], []
            for r in routes:
                owner_ids, bag_lengths = self._shard_ids(bags[r.feature], r)
                lengths.append(tf.cast(bag_lengths, wire))
                values.append(tf.cast(owner_ids, wire))
            payload = tf.concat(lengths + values, 0) if routes else tf.zeros([0], wire)
            payloads.append(payload)
            sizes.append(tf.size(payload, out_type=tf.int32))
        return tf.concat(payloads, 0), tf.stack(sizes)

    def _ids_received(self, payload: tf.Tensor, sizes: tf.Tensor, batch,
                      bags_per_route: tuple) -> tuple[list, list]:
        """dp_input=True, step 2: every rank sends each owner the ids of its routes
        (:meth:`_ids_payload`). Returns, for each route this position owns (of
        ``bags_per_route`` bags per sample), the ids and bag lengths of all M ranks'
        samples, in rank order."""
        mesh = self._mesh
        group = mesh.model_parallel
        received, received_sizes = collectives.alltoall(
            payload, sizes, mesh.model_process_set, group, f"tfhybrid_{self.name}_ids")
        mine = self._routes[mesh.model_position]
        header = batch * sum(bags_per_route)
        route_lengths = [[] for _ in mine]
        route_ids = [[] for _ in mine]
        for chunk in tf.split(received, received_sizes, num=group):
            head = tf.cast(chunk[:header], tf.int64)
            lengths = tf.split(head, [batch * k for k in bags_per_route], num=len(mine)) \
                if mine else []
            counts = tf.stack([tf.reduce_sum(x) for x in lengths]) if mine else None
            ids = tf.split(chunk[header:], counts, num=len(mine)) if mine else []
            for i in range(len(mine)):
                route_lengths[i].append(lengths[i])
                route_ids[i].append(ids[i])
        return ([tf.cast(tf.concat(x, 0), tf.int64) for x in route_ids],
                [tf.concat(x, 0) for x in route_lengths])

    def _exchange(self, bags: dict, batch, routed: list, pipeline_step=None) -> dict:
        """Steps 3-4: owner lookups of the routed ids (``_route``), embeddings back.

        Returns each (feature, shard)'s rows for this rank's samples. ``pipeline_step``
        (a ``TrainPipeline`` step's phase, or None) is handed the rows as they go into
        the alltoall and as they come out: the read-ahead's work waits for them.
        """
        mesh = self._mesh
        group = mesh.model_parallel
        mine = self._routes[mesh.model_position]
        route_ids, route_lengths = routed[:len(mine)], routed[len(mine):]

        # 3. owner: look up and sum the bags of all M ranks of the model group
        sums = []
        for i, r in enumerate(mine):
            summed = self._lookup_sum((r.table, r.shard), self._shard_vars[(r.table, r.shard)],
                                      route_ids[i], route_lengths[i])
            if not self.dp_input and self._tables[r.table].combiner == "mean":
                # only the owner sees whole bags here (a row shard's ids are a part)
                counts = tf.maximum(bags[r.feature].lengths, 1)
                summed = summed / tf.cast(counts, summed.dtype)[:, None]
            sums.append(tf.reshape(summed, [group, -1]))   # [source, bags * width]
        if group == 1:
            return self._kept_here(mine, sums)

        # 4. send each source its rows back: one flat buffer per source
        # a sample's values from each owner: its bags' rows of every route, in order
        def sample_width(routes):
            return sum((bags[r.feature].per_sample if self.dp_input else 1) * r.width
                       for r in routes)

        # A keep share that drops nothing (1.0, or narrow vectors) sends as without DCT:
        # a top-k over every entry would only cost time.
        owner_widths = [sample_width(self._routes[o]) for o in range(group)]
        thresholded = self._mp_keep is not None and group > 1 and any(
            compression.may_drop(w, self._mp_keep) for w in owner_widths)
        if thresholded:
            # DCT-MP: each sample keeps its largest entries; positions cross as small ints
            # of one type for the whole group (the widest owner's), as Horovod requires
            static_widths = all(isinstance(w, int) for w in owner_widths)
            wire_positions = compression.position_dtype(
                max(max(owner_widths), 1) if static_widths else None)
        if mine and thresholded:
            # the sample count is given: a route of zero-hot bags has width 0
            rows = tf.concat([tf.reshape(x, [group, batch, sample_width([r])])
                              for x, r in zip(sums, mine)], axis=2)   # [source, sample, W]
            kept, positions = compression.keep_largest(rows, self._mp_keep)
            back = tf.reshape(kept, [-1])
            back_positions = tf.reshape(tf.cast(positions, wire_positions), [-1])
            back_sizes = tf.fill([group], tf.cast(tf.size(back) // group, tf.int32))
        elif mine:
            back = tf.reshape(tf.concat(sums, axis=1), [-1])
            back_sizes = tf.fill([group], tf.cast(tf.size(back) // group, tf.int32))
        else:
            # Nothing to send, but only once the checks hold: in a traced step an owner
            # whose check fails never joins this alltoall, and ops without inputs would
            # start it at once (the bags wait for the checks; a read-ahead's raise later).
            with tf.control_dependencies([bag.values for bag in bags.values()]):
                back = tf.zeros([0], tf.float32)
                back_sizes = tf.zeros([group], tf.int32)
                if thresholded:
                    back_positions = tf.zeros([0], wire_positions)
        if thresholded:
            # not differentiable: the values' gradient returns to the same positions
            returned_positions, _ = collectives.alltoall(
                back_positions, back_sizes, mesh.model_process_set, group,
                f"tfhybrid_{self.name}_positions")
        # The backward alltoall sums the M ranks' gradients of their own mean losses; 1/M
        # (in float32) makes the shard's gradient that of the model group's mean loss, so
        # the optimizer's sync is a plain average (tfhybrid/distributed.py). Every rank,
        # owner or not, scales: the ops before a collective must be the same on every
        # rank, or the backward alltoall's name scope, and so its name, would differ.
        back = _scale_gradient(back, 1.0 / group)
        # under mixed precision, rows and their gradients cross in 16 bits
        back = tf.concat([tf.cast(back, self._wire_float),
                          tf.cast(self._anchor, self._wire_float)], 0)
        if pipeline_step is not None:
            pipeline_step.sending(back)
        returned, returned_sizes = collectives.alltoall(
            back, back_sizes, mesh.model_process_set, group, f"tfhybrid_{self.name}_rows",
            differentiable=True)
        if pipeline_step is not None:
            pipeline_step.arrived(returned)
        partials = {}
        if thresholded:
            position_chunks = tf.split(returned_positions, returned_sizes, num=group)
        for owner, chunk in enumerate(tf.split(returned, returned_sizes, num=group)):
            routes = self._routes[owner]
            if not routes:
                continue
            if thresholded:
                # back to [sample, W] with zeros where the owner sent nothing, then
                # flat in the unthresholded order: route after route, sample-major
                width = owner_widths[owner]
                k = compression.kept_count(width, self._mp_keep)
                rows = compression.scatter_kept(tf.reshape(tf.cast(chunk, tf.float32),
                                                           [batch, k]),
                                                tf.reshape(position_chunks[owner], [batch, k]),
                                                width)
                chunk = tf.concat([tf.reshape(part, [-1]) for part in tf.split(
                    rows, [sample_width([r]) for r in routes], num=len(routes), axis=1)], 0)
            # with dp_input=False every feature here has one bag per sample (checked)
            widths = [batch * (bags[r.feature].per_sample if self.dp_input else 1) * r.width
                      for r in routes]
            for r, part in zip(routes, tf.split(chunk, widths, num=len(routes))):
                # partial sums add up in float32 even when they travelled in 16 bits
                partials[(r.feature, r.shard)] = tf.cast(tf.reshape(part, [-1, r.width]),
                                                         tf.float32)
        return partials

    def _kept_here(self, mine: list, sums: list) -> dict:
        """Step 4 in a model group of one: this rank owns every route and keeps its rows.

        The alltoall would be the identity, but packing the rows into its one flat buffer
        and splitting them out again copies every row twice per step, and its gradient
        twice more (a profile of a 1x1 DLRM step: 9 ms of SplitV and 7 ms of ConcatV2
        per step). The values are those of the exchange: rows still round through the
        wire's 16 bits under mixed precision, so that every mesh computes alike.
        """
        partials = {}
        for r, summed in zip(mine, sums):
            if self._wire_float != tf.float32:
                summed = tf.cast(summed, self._wire_float)
            partials[(r.feature, r.shard)] = tf.cast(tf.reshape(summed, [-1, r.width]),
                                                     tf.float32)
        # the anchor stays on the tape, as through the exchange (an empty sum adds 0)
        first = (mine[0].feature, mine[0].shard)
        partials[first] = partials[first] + tf.reduce_sum(self._anchor)
        return partials

    def _cache_slots(self, cached: CachedTable, ids: tf.Tensor, route: str) -> tf.Tensor:
        """The cache slots of a tiered shard's ``ids`` (its routed ids), their rows
        loaded first.

        Every replica of the shard (its data group) loads the ids of all of them, in
        one call with the same set of ids: their caches then make the same choices and
        stay alike, slot for slot, so the replicas' gradients (rows at slots) add up
        as those of a table in memory. The cache must hold the group's distinct ids.
        """
        mesh = self._mesh
        # Valid ids pass unchanged. A batch read ahead whose check failed is never looked
        # up (TrainPipeline raises after the step beside it), and its bad ids must not
        # fail the host step inside that step's function.
        ids = tf.clip_by_value(ids, 0, cached.rows - 1)
        if mesh.data_parallel == 1:
            return cached.slots(ids)
        everyone = collectives.allgather(ids, mesh.data_parallel,
                                         f"tfhybrid_{self.name}_tier_ids_{route}",
                                         mesh.data_process_set)
        after = []
        if self.replica_sync == "weights":
            # A weight sync rewrites every slot, so rows must not move in or out while it
            # runs: a pipeline reads batch t+1's rows in step t's function, and reading
            # the cache here orders that after the step's last write to it (its sync).
            after = [cached.cache.read_value()]
        with tf.control_dependencies(after):
            slots = cached.slots(tf.concat([everyone, ids], 0))
        return slots[tf.size(everyone):]

    def _lookup_sum(self, key: tuple[int, int], var, ids, lengths):
        """The sum of each bag's rows of one table or shard (``key``: table, shard)."""
        ragged = tf.RaggedTensor.from_row_lengths(ids, lengths, validate=False)
        chunked = self._chunked(*key)
        if chunked is not None:
            return chunked.lookup_combine(ragged)
        custom = self._custom_shards.get(key)
        if custom is not None:
            # without a combiner every bag is one id (checked in _check_custom_table)
            out = custom(ragged if self._tables[key[0]].combiner else ids)
            return tf.cast(out, tf.float32)
        # use_custom_kernel=True: the C++ op where it is built (else pure TF)
        return custom_ops.embedding_lookup_combine(
            var, ragged, combiner="sum", table_name=self._tables[key[0]].name,
            use_custom_op=None if self.use_custom_kernel else False)

    def _finish(self, bag, summed):
        if bag.combiner == "mean":
            counts = tf.cast(tf.maximum(bag.lengths, 1), summed.dtype)
            summed = summed / counts[:, None]
        if bag.out_shape is not None:
            # the batch, not -1: with zero hotness the size says nothing about it
            summed = tf.reshape(summed, [bag.batch, bag.out_shape, summed.shape[-1]])
        return tf.cast(summed, self.compute_dtype)

    # ------------------------------------------------------- full tables
    def get_weights(self, all_ranks: bool = False) -> list:
        """The full tables, gathered in chunks.

        Every rank must call it. Returns a list of numpy arrays (one per table) on rank 0,
        or on every rank with ``all_ranks=True``; other ranks get ``[]``. Beyond the
        returned tables, it needs one chunk of memory (``_CHUNK_BYTES``).
        """
        self._require_built("get_weights")
        mesh = self._mesh
        keep = all_ranks or mesh.rank == 0
        full_tables = []
        for t, (table, placement) in enumerate(zip(self._tables, self.plan.tables)):
            full = np.empty([table.rows, table.dim], np.float32) if keep else None
            replicated = placement.kind == Kind.DATA_PARALLEL
            for s, shard in enumerate(placement.shards):
                width = shard.col_end - shard.col_start
                var = self._table_vars[t] if replicated else self._shard_vars.get((t, s))
                for start, stop in _chunks(shard.row_end - shard.row_start, width):
                    if replicated and not keep:
                        continue
                    # a gather reads only the chunk; a dense read of a variable that saw
                    # sparse updates copies the whole table first
                    # FIITED pools and tiered shards read their rows themselves
                    held = self._row_store(t, s) if var is not None else None
                    local = (tf.convert_to_tensor(held.read_rows(start, stop)) if held is not None
                             else tf.gather(var, tf.range(start, stop)) if var is not None
                             else tf.zeros([0, width], tf.float32))
                    if not replicated:
                        local = collectives.allgather(local, mesh.model_parallel,
                                                      f"tfhybrid_{self.name}_get_weights",
                                                      mesh.model_process_set)
                    if keep:
                        full[shard.row_start + start:shard.row_start + stop,
                             shard.col_start:shard.col_end] = local.numpy()
            full_tables.append(full)
        return full_tables if keep else []

    def _require_built(self, method: str) -> None:
        if not self.built:
            raise ValueError(
                f"DistributedEmbedding {self.name!r}.{method} needs the layer built: call "
                "it on a batch of ids first (or build the model), so the plan and the "
                "shards exist")

    def set_weights(self, weights: Sequence[Any], chunk: int | None = None,
                    use_lock: bool = False) -> None:
        """Slices full tables (one per table, every rank passes the same) onto the plan.

        As in NVIDIA distributed-embeddings, an entry may be a path to a ``.npy`` file
        (memory-mapped, so only the rows this rank holds are read), and ``chunk`` bounds
        the elements written at once. ``use_lock`` (DE: ranks take turns to bound host
        memory) is accepted; it is not needed, since no rank ever copies a whole table.
        """
        self._require_built("set_weights")
        if len(weights) != len(self._tables):
            raise ValueError(f"set_weights got {len(weights)} tables; expected "
                             f"{len(self._tables)}")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 1):
            raise ValueError(f"chunk={chunk!r} must be None or an int >= 1 (elements)")
        weights = [np.load(w, mmap_mode="r") if isinstance(w, (str, bytes)) or hasattr(
            w, "__fspath__") else w for w in weights]
        for t, (table, full) in enumerate(zip(self._tables, weights)):
            if tuple(np.shape(full)) != (table.rows, table.dim):
                raise ValueError(f"set_weights: table {table.name!r} has shape "
                                 f"{np.shape(full)}; expected {(table.rows, table.dim)}")
            placement = self.plan.tables[t]
            targets = ([(self._table_vars[t], 0, placement.shards[0])]
                       if placement.kind == Kind.DATA_PARALLEL else
                       [(v, s, placement.shards[s])
                        for (tt, s), v in self._shard_vars.items() if tt == t])
            for var, s, shard in targets:
                width = shard.col_end - shard.col_start
                # a FIITED row keeps its width (pruned entries are dropped); a tiered
                # shard writes its file and the rows it caches
                held = self._row_store(t, s)
                for start, stop in _chunks(shard.row_end - shard.row_start, width,
                                           None if chunk is None else 4 * chunk):
                    values = np.asarray(full[shard.row_start + start:shard.row_start + stop,
                                             shard.col_start:shard.col_end], np.float32)
                    if held is not None:
                        held.write_rows(start, values)
                        continue
                    # scatter_update writes in place; a sliced assign may copy the table
                    var.scatter_update(tf.IndexedSlices(values, tf.range(start, stop)))

    # ------------------------------------------------------------ FIITED
    def adjust(self, target_memory: float | None = None) -> dict[str, int]:
        """FIITED's adjustment of every ``dims="adaptive"`` table: keep ``target_memory``
        (default: each table layer's) of the table's chunks, divided by row utility.

        Every rank must call it (``tfhybrid.callbacks.FiitedAdjust`` does, at the same
        batch everywhere): a sharded table is planned whole, from its shards' utilities
        summed over the model group (a column slice's utility is its part of the row's),
        and each shard keeps its part of that plan, so every mesh prunes alike. Returns
        the chunks each adaptive table keeps, by table name."""
        if target_memory is not None:
            ChunkedTable.check_target(target_memory)
        return self._adjust(lambda table: table.target_memory if target_memory is None
                            else target_memory)

    def _fiited_adaptive(self) -> bool:
        """Whether :meth:`adjust` has tables to adjust (the FiitedAdjust callback asks)."""
        return self.built and any(table.chunks for table in self._tables)

    def _fiited_adjust(self, ramp: float) -> None:
        """The FiitedAdjust callback's step: each table's budget ``ramp`` of the way from
        the whole table to its ``target_memory``."""
        self._adjust(lambda table: 1.0 - (1.0 - table.target_memory) * ramp)

    def _adjust(self, target_of) -> dict[str, int]:
        self._require_built("adjust")
        adaptive = [t for t, table in enumerate(self._tables) if table.chunks]
        if not adaptive:
            raise ValueError(f"DistributedEmbedding {self.name!r}.adjust(): no table has "
                             "dims='adaptive'")
        mesh = self._mesh
        sharded = [t for t in adaptive if self.plan.tables[t].kind != Kind.DATA_PARALLEL]
        # each sharded table's utility per row, whole: this rank's shards in place, summed
        # over the model group (every row is held by one shard per column slice)
        utilities = []
        for t in sharded:
            whole = np.zeros([self._tables[t].rows], np.float32)
            for s, shard in enumerate(self.plan.tables[t].shards):
                chunked = self._chunked(t, s)
                if chunked is not None:
                    whole[shard.row_start:shard.row_end] += chunked.utility.numpy()
            utilities.append(whole)
        if utilities and mesh.model_parallel > 1:
            summed = collectives.allreduce(tf.constant(np.concatenate(utilities)), hvd.Sum,
                                           f"tfhybrid_{self.name}_fiited_utility",
                                           mesh.model_process_set).numpy()
            utilities = np.split(summed, np.cumsum([len(u) for u in utilities])[:-1])
        kept = {}
        for t in adaptive:
            table, placement = self._tables[t], self.plan.tables[t]
            target = target_of(table)
            if placement.kind == Kind.DATA_PARALLEL:
                # every rank's copy has the same utility (its gradient is synced)
                chunked = self._chunked(t, 0)
                kept[table.name] = chunked.adjust(target)["present"]
                self._whole_chunk_counts[t] = chunked.chunks_per_row().astype(
                    np.min_scalar_type(table.chunks))
                continue
            counts = plan_chunk_counts(utilities[sharded.index(t)], table.chunks, target)
            kept[table.name] = int(counts.sum())
            self._whole_chunk_counts[t] = counts.astype(np.min_scalar_type(table.chunks))
            for s, shard in enumerate(placement.shards):
                chunked = self._chunked(t, s)
                if chunked is None:
                    continue
                # the row's chunks that fall in this column slice (a prefix of them)
                first = shard.col_start // table.chunk_dim
                chunked.resize(np.clip(counts[shard.row_start:shard.row_end] - first, 0,
                                       chunked.chunks))
        return kept

    def chunks_per_row(self) -> list:
        """Per table, how many chunks each row holds (None for a dense table); every
        rank must call it (the counts of shards are gathered over the model group)."""
        self._require_built("chunks_per_row")
        mesh = self._mesh
        counts = []
        for t, (table, placement) in enumerate(zip(self._tables, self.plan.tables)):
            if not table.chunks:
                counts.append(None)
                continue
            if placement.kind == Kind.DATA_PARALLEL:
                counts.append(self._chunked(t, 0).chunks_per_row())
                continue
            whole = np.zeros([table.rows], np.int32)
            for s, shard in enumerate(placement.shards):
                chunked = self._chunked(t, s)
                if chunked is not None:
                    whole[shard.row_start:shard.row_end] += chunked.chunks_per_row()
            if mesh.model_parallel > 1:
                whole = collectives.allreduce(tf.constant(whole), hvd.Sum,
                                              f"tfhybrid_{self.name}_fiited_counts",
                                              mesh.model_process_set).numpy()
            counts.append(whole)
        return counts

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of this rank's tables and shards in memory: ``"embedding"`` (tables,
        FIITED pools with their row index, tiered shards' caches with theirs) and
        ``"dense"``, what the same shards take as dense tables in memory; ``"store"``,
        the tiered shards' files."""
        self._require_built("memory_bytes")
        held = {"embedding": 0, "dense": 0, "store": 0}
        for var in list(self._table_vars.values()) + list(self._shard_vars.values()):
            chunked = fiited.table_of(var)
            cached = tiers.table_of(var)
            if cached is not None:
                memory = cached.memory_bytes()
                held["embedding"] += memory["cache"] + memory["index"]
                held["dense"] += cached.rows * cached.dim * 4
                held["store"] += memory["store"]
            elif chunked is None:
                nbytes = int(np.prod(var.shape)) * var.dtype.size
                held["embedding"] += nbytes
                held["dense"] += nbytes
            else:
                memory = chunked.memory_bytes()
                held["embedding"] += memory["pool"] + memory["zero_chunk"] + memory[
                    "row_offsets"]
                held["dense"] += chunked.rows * chunked.dim * 4
        return held

    # ------------------------------------------------------------ config
    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            embeddings=[tf.keras.layers.serialize(e) for e in self._embedding_layers],
            strategy=self._strategy_name,
            column_slice_threshold=self.column_slice_threshold,
            row_slice_threshold=self.row_slice_threshold,
            data_parallel_threshold=self.data_parallel_threshold,
            input_table_map=list(self.input_table_map),
            dp_input=self.dp_input, replica_sync=self.replica_sync,
            sync_every=self.sync_every, gpu_embedding_size=self.gpu_embedding_size,
            use_custom_kernel=self.use_custom_kernel, optimizer=self.optimizer_name,
            plan=None if self._given_plan is None else self._given_plan.to_json(),
            dct=None if self.dct is None else self.dct.get_config(),
            memory_budget=self.memory_budget, store_dir=self.store_dir)
        return config

    @classmethod
    def from_config(cls, config: dict) -> "DistributedEmbedding":
        config = dict(config)
        config["embeddings"] = [
            tf.keras.layers.deserialize(e, custom_objects={"Embedding": Embedding})
            for e in config["embeddings"]]
        return cls(**config)

    # ---------------------------------------- checkpoints (issue 12): delegation only
    # A checkpoint holds each table whole, under a name that does not depend on the mesh,
    # so it restores onto any mesh; see tfhybrid/layers/_checkpointing.py. Imported
    # here, not at the top, so that this block stays the only checkpoint code here.
    def _register_for_checkpoints(self) -> None:
        from tfhybrid.layers import _checkpointing
        _checkpointing.register_layer(self)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        from tfhybrid.layers import _checkpointing
        if save_type != "checkpoint" and getattr(self._mesh, "size", 1) > 1:
            self._refuse_whole_model_save("a SavedModel (model.save, or ModelCheckpoint "
                                          "with save_weights_only=False)")
        return _checkpointing.layer_children(
            self, super()._trackable_children(save_type, **kwargs), save_type)

    def save_own_variables(self, store):
        # Keras' .keras format: each rank would write its own shards to the same file
        if getattr(self._mesh, "size", 1) > 1:
            self._refuse_whole_model_save("a .keras file (model.save)")
        super().save_own_variables(store)

    def _refuse_whole_model_save(self, what: str) -> None:
        raise ValueError(
            f"DistributedEmbedding {self.name!r}: saving {what} on {self._mesh.size} ranks "
            "would have every rank write its own shards to one file. Save the weights "
            "instead (model.save_weights, tf.train.Checkpoint, ModelCheckpoint("
            "save_weights_only=True) or BackupAndRestore: every rank, same path), which "
            "restore onto any mesh; for serving, export a single-process model")
    # ---------------------------------------- end of the checkpoints block


# Seeded tables are drawn in blocks of this many rows, each from its own seed, so any
# shard's slice can be drawn alone and equals the same slice of the whole table.
_INIT_BLOCK_ROWS = 4096
_SHAPE_FREE_INITIALIZERS = (tf.keras.initializers.RandomUniform,
                            tf.keras.initializers.RandomNormal,
                            tf.keras.initializers.TruncatedNormal)


def _slice_initializer(table: _Table, shard: Shard) -> Any:
    """The shard's slice of the table's initial value, the same on every mesh.

    Only for seeded initializers whose values do not depend on the shape (uniform and
    normal ones); any other initializer is applied to the shard itself, which gives
    different (equally distributed) values on different meshes.
    """
    config = table.initializer.get_config()
    if (not isinstance(table.initializer, _SHAPE_FREE_INITIALIZERS)
            or config.get("seed") is None):
        return table.initializer

    def initial_value(shape, dtype=tf.float32, **kwargs):
        blocks = []
        first = shard.row_start // _INIT_BLOCK_ROWS
        for block in range(first, -(-shard.row_end // _INIT_BLOCK_ROWS)):
            start = block * _INIT_BLOCK_ROWS
            rows = min(_INIT_BLOCK_ROWS, table.rows - start)
            seeded = type(table.initializer).from_config(
                dict(config, seed=(int(config["seed"]) * 1_000_003 + block) % (2**31 - 1)))
            values = seeded([rows, table.dim], dtype=dtype)
            blocks.append(values[max(shard.row_start, start) - start:
                                 min(shard.row_end, start + rows) - start,
                                 shard.col_start:shard.col_end])
        return tf.concat(blocks, axis=0) if len(blocks) > 1 else blocks[0]

    return initial_value


def _first_failure(checks: list) -> tf.Tensor:
    """The message of the first ``(holds, message)`` check that fails, or ""."""
    holds = tf.stack([h for h, _ in checks])
    messages = tf.stack([m for _, m in checks])
    return tf.where(tf.reduce_all(holds), tf.constant(""),
                    tf.gather(messages, tf.argmin(tf.cast(holds, tf.int32))))


@tf.custom_gradient
def _scale_gradient_by(x, factor):
    return tf.identity(x), lambda grad: (grad * factor, None)


def _scale_gradient(x: tf.Tensor, factor: float) -> tf.Tensor:
    """``x`` itself, whose gradient is multiplied by ``factor`` (in float32)."""
    if factor == 1.0:
        return x
    return _scale_gradient_by(x, tf.constant(factor, x.dtype))


def _chunks(rows: int, width: int, chunk_bytes: int | None = None):
    step = max(1, (chunk_bytes or _CHUNK_BYTES) // max(1, 4 * width))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)
