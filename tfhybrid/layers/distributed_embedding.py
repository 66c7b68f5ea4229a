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

import dataclasses
from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfhybrid import collectives
from tfhybrid import custom_ops
from tfhybrid import distributed
from tfhybrid import mesh as mesh_lib
from tfhybrid import planner
from tfhybrid.layers.embedding import Embedding

REPLICA_SYNC = ("gradients", "weights")

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


def _table_from_layer(layer: Any) -> _Table:
    if isinstance(layer, dict):
        layer = tf.keras.layers.deserialize(layer, custom_objects={"Embedding": Embedding})
    if not isinstance(layer, tf.keras.layers.Embedding):
        raise ValueError(
            f"embeddings must hold tf.keras.layers.Embedding or tfhybrid.layers.Embedding "
            f"layers; got {layer!r}")
    return _Table(name=layer.name, rows=int(layer.input_dim), dim=int(layer.output_dim),
                  combiner=getattr(layer, "combiner", None),
                  initializer=tf.keras.initializers.get(layer.embeddings_initializer))


class DistributedEmbedding(tf.keras.layers.Layer):
    """Embedding tables sharded table-, column- or row-wise over the mesh's model groups.

    Args:
      embeddings: ``tf.keras.layers.Embedding`` or ``tfhybrid.layers.Embedding`` layers,
        one per table (their weights are not used; they carry the configuration). A
        seeded uniform or normal ``embeddings_initializer`` gives the same initial tables
        on every mesh, so runs on different meshes start from the same point.
      mesh: a ``tfhybrid.Mesh``; ``None`` takes ``tfhybrid.init()``'s mesh.
      strategy, column_slice_threshold, row_slice_threshold, data_parallel_threshold:
        the planner's options (see ``tfhybrid.planner.plan_sharding``), named as in
        NVIDIA distributed-embeddings; thresholds count elements (rows * dim).
      input_table_map: for each input feature, the index of its table, so features can
        share a table. ``None`` means feature i uses table i.
      dp_input: each rank feeds its own local batch (data-parallel input). Only
        ``True`` is supported.
      replica_sync: how a shard's D copies stay in step. ``"gradients"`` (default,
        exact): its gradient is allreduced over its data group every step.
        ``"weights"`` (Meta's 2D sparse mode): each replica steps on its own gradient,
        and every ``sync_every`` steps ``tfhybrid.DistributedOptimizer`` averages the
        shard weights and optimizer state over the data group (also
        ``tfhybrid.sync_replicas(model)`` and ``tfhybrid.callbacks.SyncReplicas``).
        ``MomentumScaledRowWiseAdagrad`` then scales its accumulators by c = D.
      sync_every: K, the steps between weight syncs in ``"weights"`` mode.

    Inputs are a list with one entry per feature: int ids ``[batch]``, ``[batch, hotness]``
    or a ``tf.RaggedTensor`` ``[batch, None]``. Outputs are what the single-process layers
    would give: ``[batch, dim]`` with a combiner or for ``[batch]`` ids, and
    ``[batch, hotness, dim]`` for a table without a combiner.

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
                 strategy: str = "memory_balanced",
                 column_slice_threshold: int | None = None,
                 row_slice_threshold: int | None = None,
                 data_parallel_threshold: int | None = None,
                 input_table_map: Sequence[int] | None = None,
                 dp_input: bool = True, replica_sync: str = "gradients",
                 sync_every: int = 1, **kwargs: Any):
        super().__init__(**kwargs)
        if replica_sync not in REPLICA_SYNC:
            raise ValueError(f"replica_sync={replica_sync!r} is unknown; expected one of "
                             f"{REPLICA_SYNC}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r} must be an int >= 1")
        self.replica_sync = replica_sync
        self.sync_every = sync_every
        if not embeddings:
            raise ValueError("embeddings is empty; expected at least one Embedding layer")
        if dp_input is not True:
            raise ValueError(f"dp_input={dp_input!r} is not supported; only dp_input=True "
                             "(each rank feeds its own local batch)")
        if strategy not in planner.STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is unknown; expected one of "
                             f"{planner.STRATEGIES}")
        self._embedding_layers = list(embeddings)
        self._tables = [_table_from_layer(e) for e in embeddings]
        names = [t.name for t in self._tables]
        if len(set(names)) != len(names):
            raise ValueError(f"embedding layer names must be unique; got {names}")
        if input_table_map is None:
            input_table_map = list(range(len(self._tables)))
        input_table_map = [int(t) for t in input_table_map]
        for feature, table in enumerate(input_table_map):
            if not 0 <= table < len(self._tables):
                raise ValueError(f"input_table_map[{feature}]={table} is not a table index "
                                 f"in [0, {len(self._tables)})")
        self.input_table_map = input_table_map
        self.strategy = strategy
        self.column_slice_threshold = column_slice_threshold
        self.row_slice_threshold = row_slice_threshold
        self.data_parallel_threshold = data_parallel_threshold
        self.dp_input = dp_input
        self._mesh = mesh
        self.plan: planner.ShardingPlan | None = None

    # ------------------------------------------------------------------ build
    def build(self, input_shape):
        if self._mesh is None:
            self._mesh = mesh_lib.current_mesh_or_init()
        shapes = input_shape if isinstance(input_shape, (list, tuple)) else [input_shape]
        if len(shapes) != len(self.input_table_map):
            raise ValueError(f"DistributedEmbedding got {len(shapes)} inputs; expected "
                             f"{len(self.input_table_map)} (one per input_table_map entry)")
        hotness = [0.0] * len(self._tables)
        features = [0] * len(self._tables)
        local_batch = 1
        for feature, shape in enumerate(shapes):
            shape = tf.TensorShape(shape)
            h = shape[1] if shape.rank == 2 and shape[1] is not None else 1
            hotness[self.input_table_map[feature]] += float(h)
            features[self.input_table_map[feature]] += 1
            local_batch = shape[0] or local_batch
        mesh = self._mesh
        self.plan = planner.plan_sharding(
            [planner.TableConfig(t.name, t.rows, t.dim, hotness=max(h, 1.0),
                                 combiner=t.combiner, features=max(f, 1))
             for t, h, f in zip(self._tables, hotness, features)],
            mesh.data_parallel, mesh.model_parallel, strategy=self.strategy,
            column_slice_threshold=self.column_slice_threshold,
            row_slice_threshold=self.row_slice_threshold,
            data_parallel_threshold=self.data_parallel_threshold,
            local_batch_size=local_batch)
        position = mesh.model_position
        # variables: one per data-parallel table, one per model-parallel shard we own
        self._table_vars: dict[int, tf.Variable] = {}
        self._shard_vars: dict[tuple[int, int], tf.Variable] = {}
        for t, (table, placement) in enumerate(zip(self._tables, self.plan.tables)):
            ids_per_step = local_batch * hotness[t]
            if placement.kind == "data_parallel":
                self._table_vars[t] = self.add_weight(
                    name=table.name, shape=[table.rows, table.dim],
                    initializer=_slice_initializer(table, placement.shards[0]),
                    dtype=tf.float32,
                    experimental_autocast=False)
                distributed.mark_embedding(self._table_vars[t])
                distributed.mark_sparse_sync(self._table_vars[t], planner.sync_is_sparse(
                    table.rows, table.dim, ids_per_step))
                continue
            if placement.kind == "row_wise":
                ids_per_step /= len(placement.shards)
            for s, shard in enumerate(placement.shards):
                if shard.owner != position:
                    continue
                var = self.add_weight(
                    name=f"{table.name}/shard_{s}",
                    shape=[shard.row_end - shard.row_start, shard.col_end - shard.col_start],
                    initializer=_slice_initializer(table, shard), dtype=tf.float32,
                    experimental_autocast=False)
                distributed.mark_model_parallel(
                    var, mesh, self.sync_every if self.replica_sync == "weights" else None,
                    table_key=self._table_key(t))
                distributed.mark_embedding(var)
                distributed.mark_sparse_sync(var, planner.sync_is_sparse(
                    shard.row_end - shard.row_start, shard.col_end - shard.col_start,
                    mesh.model_parallel * ids_per_step))
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
            if placement.kind != "data_parallel"])
        # routes: the (feature, shard) pairs each position serves, in one fixed order that
        # every rank derives from the same plan
        self._routes: list[list[_Route]] = [[] for _ in range(mesh.model_parallel)]
        for feature, t in enumerate(self.input_table_map):
            placement = self.plan.tables[t]
            if placement.kind == "data_parallel":
                continue
            for s, shard in enumerate(placement.shards):
                self._routes[shard.owner].append(_Route(
                    feature, t, s, shard.owner, shard.row_start, shard.row_end,
                    shard.col_end - shard.col_start))
        self._wire_id_dtype = tf.int32 if all(t.rows < 2**31 for t in self._tables) else tf.int64
        compute = tf.as_dtype(self.compute_dtype)
        self._wire_float = compute if compute in (tf.float16, tf.bfloat16) else tf.float32
        super().build(input_shape)

    def _table_key(self, table: int) -> str:
        return f"{self.name}/{self._tables[table].name}"

    # ------------------------------------------------------------------ call
    def call(self, inputs):
        if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            raise ValueError(
                f"DistributedEmbedding {self.name!r} is being compiled with XLA "
                "(jit_compile=True), but its Horovod alltoall/allgather cannot be compiled. "
                "Use model.compile(jit_compile=False) and wrap the dense towers in "
                "tfhybrid.layers.XlaCompiled(...) to run them under XLA.")
        inputs = inputs if isinstance(inputs, (list, tuple)) else [inputs]
        if len(inputs) != len(self.input_table_map):
            raise ValueError(f"DistributedEmbedding got {len(inputs)} inputs; expected "
                             f"{len(self.input_table_map)}")
        mesh = self._mesh
        bags = [self._as_bags(f, x) for f, x in enumerate(inputs)]
        batch = bags[0].batch

        # 1. validate on every rank, together
        checked = self._validate_everywhere(bags, batch)
        with tf.control_dependencies(checked):
            bags = [dataclasses.replace(b, values=tf.identity(b.values)) for b in bags]

        # 2-4. model-parallel features through the model group
        partials = self._exchange(bags, batch) if any(self._routes) else {}

        outputs = []
        for f, bag in enumerate(bags):
            t = self.input_table_map[f]
            table, placement = self._tables[t], self.plan.tables[t]
            if placement.kind == "data_parallel":
                # 5. data-parallel tables: local lookup
                summed = self._lookup_sum(self._table_vars[t], bag.values, bag.lengths,
                                          table.name)
            elif placement.kind == "column_wise":
                summed = tf.concat([partials[(f, s)] for s in range(len(placement.shards))],
                                   axis=1)
            else:  # table_wise is one shard; row_wise partial sums add up
                summed = tf.add_n([partials[(f, s)] for s in range(len(placement.shards))])
            outputs.append(self._finish(bag, summed))
        return outputs

    # --------------------------------------------------------------- helpers
    @dataclasses.dataclass(frozen=True)
    class _Bags:
        """One feature as bags: ``values`` ids, ``lengths`` ids per bag."""
        values: tf.Tensor
        lengths: tf.Tensor       # [batch * per_sample]
        batch: tf.Tensor         # samples (int64): per_sample may be 0 (zero hotness)
        per_sample: int          # bags per sample: hotness for combiner=None, else 1
        out_shape: Any           # None, or the static trailing shape for combiner=None
        combiner: str | None

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
        hotness = ids.shape[1]
        if hotness is None:
            raise ValueError(f"feature {feature} (table {table.name!r}) has an unknown "
                             "hotness; pass a RaggedTensor for variable-length bags")
        if table.combiner is None:
            # no combiner: each id is a bag of one, reshaped to [batch, hotness, dim]
            return self._Bags(values, tf.ones_like(values),
                              tf.shape(ids, out_type=tf.int64)[0], hotness, hotness, None)
        lengths = tf.fill([tf.shape(ids, out_type=tf.int64)[0]], tf.constant(hotness, tf.int64))
        return self._Bags(values, lengths, tf.size(lengths, out_type=tf.int64), 1, None,
                          table.combiner)

    def _validate_everywhere(self, bags, batch) -> list:
        """Asserts that every id is in range and every rank has the same batch size.

        Each rank contributes [batch, (bad?, first bad id) per feature]; after one
        allgather every rank raises the same error, so none is left in a collective.
        """
        report = [tf.reshape(batch, [1])]
        for f, bag in enumerate(bags):
            rows = self._tables[self.input_table_map[f]].rows
            # padded with one good id, so a rank with no ids for this feature (empty
            # bags, zero hotness) still has an element to take the argmax of
            values = tf.concat([bag.values, tf.zeros([1], bag.values.dtype)], 0)
            bad = tf.logical_or(values < 0, values >= rows)
            first_bad = tf.gather(values, tf.argmax(tf.cast(bad, tf.int32)))
            any_bad = tf.reduce_any(bad)
            report += [tf.reshape(tf.cast(any_bad, tf.int64), [1]),
                       tf.reshape(tf.where(any_bad, first_bad, 0), [1])]
        report = tf.reshape(tf.concat(report, 0), [1, -1])
        everyone = collectives.allgather(report, self._mesh.size,
                                         f"tfhybrid_{self.name}_validate")
        sizes = everyone[:, 0]
        flags = tf.reshape(everyone[:, 1:], [self._mesh.size, len(bags), 2])
        bad_any = flags[:, :, 0] > 0
        where = tf.argmax(tf.cast(tf.reshape(bad_any, [-1]), tf.int32))
        bad_rank = where // len(bags)
        bad_feature = where % len(bags)
        names = tf.constant([self._tables[t].name for t in self.input_table_map])
        rows = tf.constant([self._tables[t].rows for t in self.input_table_map], tf.int64)
        id_message = tf.strings.join([
            "DistributedEmbedding: embedding table '", tf.gather(names, bad_feature),
            "' got id ", tf.strings.as_string(tf.reshape(flags, [-1, 2])[where, 1]),
            " on rank ", tf.strings.as_string(bad_rank), "; expected ids in [0, ",
            tf.strings.as_string(tf.gather(rows, bad_feature)), ")"])
        batch_message = tf.strings.format(
            "DistributedEmbedding: local batch sizes differ across ranks; batch size of "
            "rank 0..{}: {}", [self._mesh.size - 1, sizes], summarize=-1)
        return [
            tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad_any)), [id_message]),
            tf.debugging.Assert(tf.reduce_all(tf.equal(sizes, sizes[0])), [batch_message]),
        ]

    def _exchange(self, bags, batch) -> dict:
        """Steps 2-4: ids out, owner lookups, embeddings back. Returns sums per route."""
        mesh = self._mesh
        group = mesh.model_parallel
        wire = self._wire_id_dtype
        # 2. route ids: to each position, [lengths of its routes | ids of its routes]
        payloads, sizes = [], []
        for routes in self._routes:
            lengths, values = [], []
            for r in routes:
                bag = bags[r.feature]
                if self.plan.tables[r.table].kind == "row_wise":
                    inside = tf.logical_and(bag.values >= r.row_start, bag.values < r.row_end)
                    owner_ids = tf.boolean_mask(bag.values, inside) - r.row_start
                    bag_index = tf.repeat(tf.range(tf.size(bag.lengths, out_type=tf.int64)),
                                          bag.lengths)
                    bag_lengths = tf.math.unsorted_segment_sum(
                        tf.cast(inside, tf.int64), bag_index, tf.size(bag.lengths))
                else:
                    owner_ids, bag_lengths = bag.values, bag.lengths
                lengths.append(tf.cast(bag_lengths, wire))
                values.append(tf.cast(owner_ids, wire))
            payload = tf.concat(lengths + values, 0) if routes else tf.zeros([0], wire)
            payloads.append(payload)
            sizes.append(tf.size(payload, out_type=tf.int32))
        received, received_sizes = collectives.alltoall(
            tf.concat(payloads, 0), tf.stack(sizes), mesh.model_process_set, group,
            f"tfhybrid_{self.name}_ids")

        # 3. owner: look up and sum the bags of all M ranks of the model group
        mine = self._routes[mesh.model_position]
        bags_per_route = [bags[r.feature].per_sample for r in mine]
        header = batch * int(sum(bags_per_route))
        from_sources = tf.split(received, received_sizes, num=group)
        route_lengths = [[] for _ in mine]
        route_ids = [[] for _ in mine]
        for chunk in from_sources:
            head = tf.cast(chunk[:header], tf.int64)
            lengths = tf.split(head, [batch * k for k in bags_per_route], num=len(mine)) \
                if mine else []
            counts = tf.stack([tf.reduce_sum(x) for x in lengths]) if mine else None
            ids = tf.split(chunk[header:], counts, num=len(mine)) if mine else []
            for i in range(len(mine)):
                route_lengths[i].append(lengths[i])
                route_ids[i].append(ids[i])
        sums = []
        for i, r in enumerate(mine):
            summed = self._lookup_sum(self._shard_vars[(r.table, r.shard)],
                                      tf.cast(tf.concat(route_ids[i], 0), tf.int64),
                                      tf.concat(route_lengths[i], 0),
                                      self._tables[r.table].name)
            sums.append(tf.reshape(summed, [group, -1]))   # [source, bags * width]

        # 4. send each source its rows back: one flat buffer per source
        if mine:
            back = tf.reshape(tf.concat(sums, axis=1), [-1])
            back_sizes = tf.fill([group], tf.cast(tf.size(back) // group, tf.int32))
        else:
            back = tf.zeros([0], tf.float32)
            back_sizes = tf.zeros([group], tf.int32)
        # The backward alltoall sums the M ranks' gradients of their own mean losses; 1/M
        # (in float32) makes the shard's gradient that of the model group's mean loss, so
        # the optimizer's sync is a plain average (tfhybrid/distributed.py). Every rank,
        # owner or not, scales: the ops before a collective must be the same on every
        # rank, or the backward alltoall's name scope, and so its name, would differ.
        back = _scale_gradient(back, 1.0 / group)
        # under mixed precision, rows and their gradients cross in 16 bits
        back = tf.concat([tf.cast(back, self._wire_float),
                          tf.cast(self._anchor, self._wire_float)], 0)
        returned, returned_sizes = collectives.alltoall(
            back, back_sizes, mesh.model_process_set, group, f"tfhybrid_{self.name}_rows",
            differentiable=True)
        partials = {}
        for owner, chunk in enumerate(tf.split(returned, returned_sizes, num=group)):
            routes = self._routes[owner]
            if not routes:
                continue
            widths = [batch * bags[r.feature].per_sample * r.width for r in routes]
            for r, part in zip(routes, tf.split(chunk, widths, num=len(routes))):
                # partial sums add up in float32 even when they travelled in 16 bits
                partials[(r.feature, r.shard)] = tf.cast(tf.reshape(part, [-1, r.width]),
                                                         tf.float32)
        return partials

    def _lookup_sum(self, var, ids, lengths, table_name):
        ragged = tf.RaggedTensor.from_row_lengths(ids, lengths, validate=False)
        return custom_ops.embedding_lookup_combine(var, ragged, combiner="sum",
                                                   table_name=table_name)

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
            replicated = placement.kind == "data_parallel"
            for s, shard in enumerate(placement.shards):
                width = shard.col_end - shard.col_start
                var = self._table_vars[t] if replicated else self._shard_vars.get((t, s))
                for start, stop in _chunks(shard.row_end - shard.row_start, width):
                    if replicated and not keep:
                        continue
                    # a gather reads only the chunk; a dense read of a variable that saw
                    # sparse updates copies the whole table first
                    local = (tf.gather(var, tf.range(start, stop)) if var is not None
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

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Slices full tables (one per table, every rank passes the same) onto the plan."""
        self._require_built("set_weights")
        if len(weights) != len(self._tables):
            raise ValueError(f"set_weights got {len(weights)} tables; expected "
                             f"{len(self._tables)}")
        for t, (table, full) in enumerate(zip(self._tables, weights)):
            if tuple(np.shape(full)) != (table.rows, table.dim):
                raise ValueError(f"set_weights: table {table.name!r} has shape "
                                 f"{np.shape(full)}; expected {(table.rows, table.dim)}")
            placement = self.plan.tables[t]
            targets = ([(self._table_vars[t], placement.shards[0])]
                       if placement.kind == "data_parallel" else
                       [(v, placement.shards[s]) for (tt, s), v in self._shard_vars.items()
                        if tt == t])
            for var, shard in targets:
                width = shard.col_end - shard.col_start
                for start, stop in _chunks(shard.row_end - shard.row_start, width):
                    # scatter_update writes in place; a sliced assign may copy the table
                    var.scatter_update(tf.IndexedSlices(
                        np.asarray(full[shard.row_start + start:shard.row_start + stop,
                                        shard.col_start:shard.col_end], np.float32),
                        tf.range(start, stop)))

    # ------------------------------------------------------------ config
    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            embeddings=[tf.keras.layers.serialize(e) for e in self._embedding_layers],
            strategy=self.strategy,
            column_slice_threshold=self.column_slice_threshold,
            row_slice_threshold=self.row_slice_threshold,
            data_parallel_threshold=self.data_parallel_threshold,
            input_table_map=list(self.input_table_map),
            dp_input=self.dp_input, replica_sync=self.replica_sync,
            sync_every=self.sync_every)
        return config

    @classmethod
    def from_config(cls, config: dict) -> "DistributedEmbedding":
        config = dict(config)
        config["embeddings"] = [
            tf.keras.layers.deserialize(e, custom_objects={"Embedding": Embedding})
            for e in config["embeddings"]]
        return cls(**config)


# Seeded tables are drawn in blocks of this many rows, each from its own seed, so any
# shard's slice can be drawn alone and equals the same slice of the whole table.
_INIT_BLOCK_ROWS = 4096
_SHAPE_FREE_INITIALIZERS = (tf.keras.initializers.RandomUniform,
                            tf.keras.initializers.RandomNormal,
                            tf.keras.initializers.TruncatedNormal)


def _slice_initializer(table: _Table, shard: planner.Shard) -> Any:
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


@tf.custom_gradient
def _scale_gradient_by(x, factor):
    return tf.identity(x), lambda grad: (grad * factor, None)


def _scale_gradient(x: tf.Tensor, factor: float) -> tf.Tensor:
    """``x`` itself, whose gradient is multiplied by ``factor`` (in float32)."""
    if factor == 1.0:
        return x
    return _scale_gradient_by(x, tf.constant(factor, x.dtype))


def _chunks(rows: int, width: int):
    step = max(1, _CHUNK_BYTES // max(1, 4 * width))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)
