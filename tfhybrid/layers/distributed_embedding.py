"""DistributedEmbedding: embedding tables sharded over the model groups of the mesh.

The Keras layer: its configuration, the plan (made once, from the mesh and the first
batch's shapes, or given: ``tfhybrid.sharding.placement``), the build that makes this
rank's stores (``tfhybrid.sharding.rank_stores``), ``call`` (the route's stages,
``tfhybrid.sharding.route``), whole-table weights (``tfhybrid.sharding.full_tables``)
and ``get_config``.

Gradients flow back through the route's alltoalls to the owners' shard variables;
``tfhybrid.DistributedGradientTape`` / ``DistributedOptimizer`` (``tfhybrid/distributed/``)
allreduce them over the right process set before the optimizer applies them.
"""

from __future__ import annotations

from typing import Any, Sequence

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import collectives
from tfhybrid import compression
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid.checkpoint import tables as checkpoint_tables
from tfhybrid.checkpoint import weights_file as checkpoint_weights_file
from tfhybrid.fiited import ChunkedTable
from tfhybrid.fiited.sharded import ShardedWidths
from tfhybrid.layers.embedding import Embedding
from tfhybrid.plan.types import dram_budget_bytes
from tfhybrid.plan.types import (COST_STRATEGY, DEFAULT_STRATEGY, Kind, OPTIMIZERS,
                                 PlannerOptions, REPLICA_SYNC, STRATEGIES, ShardingPlan)
from tfhybrid.sharding.full_tables import WholeTables
from tfhybrid.sharding.placement import (LayerPlanner, ShardingStrategy, dp_to_mp_input,
                                         ids_per_sample, load_plan, mesh_for_layer, on_host)
from tfhybrid.sharding.rank_stores import make_rank_stores, table_key
from tfhybrid.sharding.route import EmbeddingRoute
from tfhybrid.sharding.stores import StoreSet
from tfhybrid.sharding.tables import (TableSpec, check_custom_table, check_table_config,
                                      table_from_layer)

__all__ = ["DistributedEmbedding", "ShardingStrategy"]

_LOOKUP_CALLS = (tf.keras.layers.Embedding.call, Embedding.call)
# a dynamic table's counters that sum over its shards
DYNAMIC_COUNTS = ("size", "admissions", "evictions", "refusals", "hits", "misses",
                  "candidates")


def _as_layer(layer: Any) -> Any:
    if isinstance(layer, dict):
        return tf.keras.layers.deserialize(layer, custom_objects={"Embedding": Embedding})
    return layer


# NVIDIA distributed-embeddings' private helper, by its name there, for scripts that
# import it (``tfhybrid._dp_to_mp_input``)
_dp_to_mp_input = dp_to_mp_input


def _checked_arguments(embeddings: Sequence[Any], strategy: str,
                       given_plan: ShardingPlan | None, dp_input: Any, replica_sync: Any,
                       sync_every: Any, gpu_embedding_size: Any, use_custom_kernel: Any,
                       row_slice: Any, optimizer: Any, memory_budget: Any,
                       store_dir: Any) -> str:
    """ValueError naming the first of ``DistributedEmbedding``'s arguments that is wrong;
    else the strategy that places the tables (a given plan's own)."""
    dram_budget_bytes(memory_budget, None)   # ValueError naming a bad budget
    if memory_budget is not None and not (isinstance(store_dir, str) and store_dir):
        raise ValueError(f"memory_budget={memory_budget!r} may move tables into the "
                         "disk tier, which needs store_dir (the folder of their files); "
                         f"got store_dir={store_dir!r}")
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
    if not embeddings:
        raise ValueError("embeddings is empty; expected at least one Embedding layer")
    if not isinstance(dp_input, bool):
        raise ValueError(f"dp_input={dp_input!r} must be True (each rank feeds its own "
                         "local batch of every feature) or False (each rank feeds the "
                         "features of its own shards for its model group's batch)")
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is unknown; expected None or one of "
                         f"{OPTIMIZERS}")
    if strategy == COST_STRATEGY and given_plan is None:
        raise ValueError(
            f"strategy={strategy!r} needs the cluster and workload: make the plan with "
            "tfhybrid.plan.plan_for_cluster(tables, cluster, workload) and pass "
            "it as plan=")
    if given_plan is not None:
        strategy = given_plan.strategy
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
    return strategy


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
        the planner's options (see ``tfhybrid.plan.plan_sharding``), named as in
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
        ``"adam"``, ... ``tfhybrid.plan.OPTIMIZERS``), so that the plan's memory and
        weight-sync bytes count its state; ``None``: ``"sgd"`` (no state).
      plan: a ``tfhybrid.plan.ShardingPlan`` (or its JSON, or the path of a JSON
        file) to execute as it is, e.g. from ``tfhybrid.plan.plan_for_cluster``;
        it must be for this mesh's D x M (and layout, where the plan names one) and for
        these tables. The strategy and threshold arguments are then unused.
      dct: a ``tfhybrid.compression.DCT`` whose ``mp_keep`` thresholds the alltoall that
        returns rows (DCT-MP): per sample, each owner sends only the largest
        ``mp_keep`` share of its entries (plus their positions), and their gradients
        return at the same positions. ``None`` (default): everything is sent.
      memory_budget: ``{"dram": bytes}`` per rank: the planner moves the largest tables
        into the disk tier (a file per shard behind a DRAM cache, as a
        ``tfhybrid.layers.Embedding`` with ``cache_rows``) until every rank fits
        (``tfhybrid.plan.place_in_tiers``). A table layer with ``cache_rows`` is in
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
        _tf_internals.install_autograph_rule()
        super().__init__(**kwargs)
        self._given_plan = load_plan(plan)
        strategy = _checked_arguments(
            embeddings, strategy, self._given_plan, dp_input, replica_sync, sync_every,
            gpu_embedding_size, use_custom_kernel, row_slice, optimizer, memory_budget,
            store_dir)
        self.memory_budget = None if memory_budget is None else dict(memory_budget)
        self.store_dir = store_dir
        self.dct = compression.as_dct(dct)
        # DCT-MP: the share of each sample's returned rows the alltoall carries
        self._mp_keep = None if self.dct is None else self.dct.mp_keep
        self.replica_sync = replica_sync
        self.sync_every = sync_every
        self.optimizer_name = optimizer
        self._embedding_layers = [_as_layer(e) for e in embeddings]
        self._tables = [table_from_layer(e, custom=type(e).call not in _LOOKUP_CALLS)
                        for e in self._embedding_layers]
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
        # the planner's options travel as one object (ValueError naming a bad threshold)
        self.planner_options = PlannerOptions(strategy, column_slice_threshold,
                                              row_slice_threshold, data_parallel_threshold)
        self.dp_input = dp_input
        self.gpu_embedding_size = gpu_embedding_size
        self.use_custom_kernel = use_custom_kernel
        self._mesh = mesh
        self.plan: ShardingPlan | None = None
        self._placement = None
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
    def column_slice_threshold(self) -> int | None:
        return self.planner_options.column_slice_threshold

    @property
    def row_slice_threshold(self) -> int | None:
        return self.planner_options.row_slice_threshold

    @property
    def data_parallel_threshold(self) -> int | None:
        return self.planner_options.data_parallel_threshold

    @property
    def mesh(self) -> mesh_lib.Mesh | None:
        """The mesh the layer shards over: the one given, or ``tfhybrid.init()``'s once
        the plan is made (None before)."""
        return self._mesh

    @property
    def embedding_layers(self) -> list:
        """The Keras embedding layers that describe the tables (their weights unused)."""
        return list(self._embedding_layers)

    @property
    def table_specs(self) -> list[TableSpec]:
        """Each table as the layer shards it (after the plan: with its tier)."""
        return list(self._tables)

    @property
    def stores(self) -> StoreSet:
        """The built layer's stores on this rank, by (table, shard); a replicated table
        is shard 0 (``tfhybrid.sharding.stores``)."""
        self._whole("stores")
        return self._stores

    @property
    def anchor(self) -> tf.Variable:
        """The built layer's empty variable that every rank has (it rides along with the
        rows so every tape runs the backward alltoall, and names the optimizer's slots
        alike on every rank)."""
        self._whole("anchor")
        return self._anchor

    @property
    def whole_chunk_counts(self) -> dict:
        """Per FIITED table, every row's chunk count as every rank planned it at the last
        adjustment (or read it from a restored checkpoint); checkpoints update it."""
        self._whole("whole_chunk_counts")
        return self._whole_chunk_counts

    @property
    def strategy(self) -> "ShardingStrategy":
        """The placement in DE's terms: ``.name``, ``.input_ids_list``, ``.table_ids``.

        The plan is fixed the first time it is needed (this property, or the first
        batch); it compares equal to its strategy name.
        """
        if self._placement is None:
            self._make_plan(hotness=[1.0] * len(self._tables), local_batch=1)
        return self._placement.strategy

    def _make_plan(self, hotness: Sequence[float], local_batch: int) -> None:
        if self._mesh is None:
            self._mesh = mesh_for_layer()
        planner = LayerPlanner(
            self.name, self._tables, self.input_table_map, self.dp_input,
            self.planner_options, self._given_plan, self.optimizer_name, self.replica_sync,
            self.sync_every, self.memory_budget, self.store_dir)
        placement = planner.place(self._mesh, hotness, local_batch, self.compute_dtype)
        # plain data: set past Keras' __setattr__, which would track its lists
        object.__setattr__(self, "_placement", placement)
        self.plan = placement.plan
        self._tables = placement.tables

    # ------------------------------------------------------------------ build
    def build(self, input_shape):
        # the roles and stores need the weights' variables now (see real_variables)
        with _tf_internals.real_variables():
            self._build_stores(input_shape)
        super().build(input_shape)
        self._register_for_checkpoints()

    def _build_stores(self, input_shape) -> None:
        shapes = input_shape if isinstance(input_shape, (list, tuple)) else [input_shape]
        shapes = [_ids_shape(shape) for shape in shapes]
        if self.plan is None:
            if len(shapes) != len(self.input_table_map):
                raise ValueError(f"DistributedEmbedding got {len(shapes)} inputs; expected "
                                 f"{len(self.input_table_map)} (one per input_table_map "
                                 "entry)")
            self._make_plan(*ids_per_sample(shapes, range(len(shapes)), self.input_table_map,
                                            len(self._tables)))
        fed = self._placement.fed_features
        mesh = self._mesh
        if len(shapes) != len(fed):
            raise ValueError(
                f"DistributedEmbedding got {len(shapes)} inputs; expected {len(fed)}: "
                + ("one per input_table_map entry" if self.dp_input else
                   f"with dp_input=False, the features "
                   f"layer.strategy.input_ids_list[{mesh.rank}]={fed}"))
        for t, table in enumerate(self._tables):
            check_table_config(self._embedding_layers[t], table, self.plan.tables[t])
            if table.custom_class is not None:
                check_custom_table(table, self.plan.tables[t])
        # ids per step per table, as this rank is fed: sparse or dense gradient syncs
        hotness, local_batch = ids_per_sample(
            shapes, fed, self.input_table_map, len(self._tables),
            1 if self.dp_input else mesh.model_parallel)
        made = make_rank_stores(
            self.name, mesh, self.plan, self._tables, self._embedding_layers, hotness,
            local_batch, self.sync_every if self.replica_sync == "weights" else None,
            self.use_custom_kernel, self.add_weight,
            on_host(self.plan, mesh.model_position, self.gpu_embedding_size, self.name),
            self.data_parallel_threshold,
            [max(1, self.input_table_map.count(t)) for t in range(len(self._tables))])
        # Tracked, so their variables are this layer's weights: what the stores have
        # Keras track (a custom table's shards, instances of its layer; table objects),
        # the variables of replicated tables and of the shards this rank owns
        self._store_objects = made.tracked
        self._table_vars = made.table_vars
        self._shard_vars = made.shard_vars
        # plain objects: set past Keras' __setattr__, which would track them. Per FIITED
        # table, every row's chunk count as every rank planned it at the last adjustment
        # (or read it from a restored checkpoint): where a shard's chunks go in the
        # compact checkpoint depends on the rows other ranks hold
        object.__setattr__(self, "_stores", made.stores)
        object.__setattr__(self, "_whole_chunk_counts", {
            t: np.full([table.rows], table.chunks, np.min_scalar_type(table.chunks))
            for t, table in enumerate(self._tables) if table.chunks})
        # The backward alltoall must run on every rank of the model group, but the tape
        # skips it on a rank whose sent rows touch no trainable variable (a position that
        # owns no shard). This empty variable rides along with the rows, so every rank's
        # tape needs the backward alltoall.
        self._anchor = _tf_internals.add_weight(
            self.add_weight, name="alltoall_anchor", shape=[0], initializer="zeros",
            dtype=tf.float32, autocast=False)
        # it also names the sharded tables, so every rank (owner or not) joins the same
        # norm allreduce when the optimizer clips
        roles.mark_anchor(self._anchor, [
            table_key(self.name, self._tables[t]) for t, placement in
            enumerate(self.plan.tables) if placement.kind != Kind.DATA_PARALLEL])
        object.__setattr__(self, "_route_stages", EmbeddingRoute(
            self.name, mesh, self.plan, self._tables, self.input_table_map, fed,
            self.dp_input, self._stores, self._anchor, self.compute_dtype, self._mp_keep,
            self.replica_sync))
        object.__setattr__(self, "_whole_tables", WholeTables(
            self.name, mesh, self.plan, self._tables, self._stores))
        object.__setattr__(self, "_sharded_widths", ShardedWidths(
            self.name, mesh, self.plan, self._tables, self._stores,
            self._whole_chunk_counts))

    # ------------------------------------------------------------------ call
    def call(self, inputs, weights=None, training=None):
        """The embeddings of ``inputs`` (one entry per fed feature: dense, ragged or
        sparse ids, or an ``(ids, weights)`` pair); ``weights``: None, or per-id float
        weights beside them, one entry per input (None for an unweighted feature), as
        keras-rs takes them (``tfhybrid.combiners``)."""
        if _tf_internals.in_xla_context():
            raise ValueError(
                f"DistributedEmbedding {self.name!r} is being compiled with XLA "
                "(jit_compile=True), but its Horovod alltoall/allgather cannot be compiled. "
                "Use model.compile(jit_compile=False) and wrap the dense towers in "
                "tfhybrid.layers.XlaCompiled(...) to run them under XLA.")
        outputs, local_batch = self._route_stages.forward(inputs, self, training, weights)
        self._add_activity_losses(outputs, local_batch)
        return outputs

    @property
    def route(self) -> EmbeddingRoute:
        """The built layer's route: its stages, ``prepare`` / ``exchange`` / ...
        (``tfhybrid.sharding.route``)."""
        if not self.built:
            raise ValueError(f"DistributedEmbedding {self.name!r}.route exists once the "
                             "layer is built (called on a batch, or its model built)")
        return self._route_stages

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
        mine = dp_to_mp_input(dict(enumerate(dp_inputs)), wanted, self._mesh)
        return [mine[f] for f in strategy.input_ids_list[self._mesh.rank]]

    # ------------------------------------------------------- full tables
    def get_weights(self, all_ranks: bool = False, tables: Sequence[int] | None = None
                    ) -> list:
        """The full tables, gathered in chunks.

        Every rank must call it. Returns a list of numpy arrays (one per table, or per
        index of ``tables``) on rank 0, or on every rank with ``all_ranks=True``; other
        ranks get ``[]``. Beyond the returned tables, it needs one chunk of memory
        (``tfhybrid.sharding.full_tables.CHUNK_BYTES``).
        """
        return self._whole("get_weights").get_weights(all_ranks, tables)

    def set_weights(self, weights: Sequence[Any], chunk: int | None = None,
                    use_lock: bool = False) -> None:
        """Slices full tables (one per table, every rank passes the same) onto the plan.

        As in NVIDIA distributed-embeddings, an entry may be a path to a ``.npy`` file
        (memory-mapped, so only the rows this rank holds are read), and ``chunk`` bounds
        the elements written at once. ``use_lock`` (DE: ranks take turns to bound host
        memory) is accepted; it is not needed, since no rank ever copies a whole table.
        ``None`` leaves a table as it is (a dynamic table takes only None: its rows have
        no fixed order; ``get_weights`` gives them in this mesh's slot order).
        """
        self._whole("set_weights").set_weights(weights, chunk)

    def _whole(self, method: str) -> WholeTables:
        if not self.built:
            raise ValueError(
                f"DistributedEmbedding {self.name!r}.{method} needs the layer built: call "
                "it on a batch of ids first (or build the model), so the plan and the "
                "shards exist")
        return self._whole_tables

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
        self._whole("adjust")
        return self._sharded_widths.adjust(
            lambda table: table.target_memory if target_memory is None else target_memory)

    @property
    def has_adaptive_tables(self) -> bool:
        """Whether the built layer has ``dims="adaptive"`` tables for :meth:`adjust`."""
        return self.built and any(table.chunks for table in self._tables)

    def adjust_ramp(self, ramp: float) -> dict[str, int]:
        """:meth:`adjust` with each table's budget ``ramp`` (0 to 1) of the way from the
        whole table to its ``target_memory`` (``FiitedAdjust``'s schedule)."""
        self._whole("adjust")
        return self._sharded_widths.adjust(
            lambda table: 1.0 - (1.0 - table.target_memory) * ramp)

    def chunks_per_row(self) -> list:
        """Per table, how many chunks each row holds (None for a dense table); every
        rank must call it (the counts of shards are gathered over the model group)."""
        self._whole("chunks_per_row")
        return self._sharded_widths.chunks_per_row()

    def table_stats(self) -> dict[str, dict]:
        """Per dynamic table (by name): its size and capacity, admissions, evictions,
        refusals, hits, misses and hit rate, summed over the model group's shards. A
        collective: every rank must call it (``tfhybrid.callbacks.DynamicTableStats``
        logs it on rank 0 every N steps)."""
        self._whole("table_stats")
        mesh = self._mesh
        found = {}
        for t, table in enumerate(self._tables):
            if table.keyed is None:
                continue
            mine = self._stores.get(t, mesh.model_position)
            counts = mine.stats()
            values = tf.constant([counts[name] for name in DYNAMIC_COUNTS], tf.int64)
            if mesh.model_parallel > 1:
                values = collectives.allreduce(values, hvd.Sum,
                                               f"tfhybrid_{self.name}_stats_{t}",
                                               mesh.model_process_set)
            summed = dict(zip(DYNAMIC_COUNTS, (int(v) for v in values.numpy())))
            summed["capacity"] = table.rows
            looked = summed["hits"] + summed["misses"]
            summed["hit_rate"] = summed["hits"] / looked if looked else 0.0
            found[table.name] = summed
        return found

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of this rank's tables and shards in memory: ``"embedding"`` (tables,
        FIITED pools with their row index, tiered shards' caches with theirs) and
        ``"dense"``, what the same shards take as dense tables in memory; ``"store"``,
        the tiered shards' files."""
        return self._whole("memory_bytes").memory_bytes()

    # ------------------------------------------------------------ config
    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            embeddings=[tf.keras.layers.serialize(e) for e in self._embedding_layers],
            strategy=self.planner_options.strategy,
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

    # ---------------------------------------- checkpoints: delegation only
    # A checkpoint holds each table whole, under a name that does not depend on the mesh,
    # so it restores onto any mesh; see tfhybrid/checkpoint/tables.py.
    def _register_for_checkpoints(self) -> None:
        checkpoint_tables.register_layer(self)
        checkpoint_weights_file.install()

    def load_own_variables(self, store: Any) -> None:
        """Reads a Keras weights or ``.keras`` file's whole tables onto this rank's plan."""
        checkpoint_weights_file.load_layer(self, store)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type != "checkpoint" and getattr(self._mesh, "size", 1) > 1:
            self._refuse_whole_model_save("a SavedModel (model.save, or ModelCheckpoint "
                                          "with save_weights_only=False)")
        return checkpoint_tables.layer_children(
            self, super()._trackable_children(save_type, **kwargs), save_type)

    def save_own_variables(self, store: Any) -> None:
        """Writes each table whole into a Keras weights or ``.keras`` file."""
        # a .keras file (model.save) is written by each rank that saves; only a Keras 3
        # weights file is written by all ranks together (checkpoint/weights_file.py)
        if getattr(self._mesh, "size", 1) > 1 and not checkpoint_weights_file.saving_together():
            self._refuse_whole_model_save("a .keras file (model.save)")
        checkpoint_weights_file.save_layer(self, store)

    def _refuse_whole_model_save(self, what: str) -> None:
        raise ValueError(
            f"DistributedEmbedding {self.name!r}: saving {what} on {self._mesh.size} ranks "
            "would have every rank write its own shards to one file. Save the weights "
            "instead (model.save_weights, tf.train.Checkpoint, ModelCheckpoint("
            "save_weights_only=True) or BackupAndRestore: every rank, same path), which "
            "restore onto any mesh; for serving, export a single-process model")
    # ---------------------------------------- end of the checkpoints block


def _ids_shape(shape: Any) -> Any:
    """An input's ids' shape: the first of an ``(ids, weights)`` pair's shapes (a pair is
    a list or tuple of shapes, where one tensor's shape is a tuple of sizes)."""
    if isinstance(shape, (list, tuple)) and len(shape) == 2 and all(
            isinstance(s, (list, tuple, tf.TensorShape)) for s in shape):
        return shape[0]
    return shape
