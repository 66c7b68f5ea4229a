"""Where a table's rows live: one store class per kind, one protocol for all.

A store holds one table of a rank (a replicated table) or one shard of it, and answers
the same questions whatever it keeps: the rows it reads for routed ids (``rows_of``: a
tier's cache slots), their bags combined (``lookup``), its rows in row order for
whole-table reads and writes (``read_rows`` / ``write_rows``), the variables it keeps
per row besides the one trained (``row_state``), whether its gradient must be synced
sparse (``sparse_sync``), the optimizers that can train it (``trained_by``), what the
layer tracks for Keras (``tracked``), its per-row widths if it has them (``widths``),
its counters (``stats``) and its memory. The kinds:

- ``KernelTable``: a dense variable, looked up by the fused C++ kernel (pure TF where
  the op library is not built);
- ``FiitedPool``: a FIITED table's chunk pool (``tfhybrid.fiited.ChunkedTable``);
- ``TieredCache``: a disk-tier shard behind its DRAM cache (``tfhybrid.tiers``), with
  FIITED's per-row widths for an adaptive table; its routed ids are cache slots;
- ``CustomLayerTable``: an instance of the user's own embedding layer class.

Each storage kind is one entry of :data:`STORAGE_KINDS` (a :class:`StorageKind`): how its
store is made, and what its saved form adds to the table's values (``saved_layout``: a
FIITED table's compact chunks, ``tfhybrid.fiited.saved``). ``create_store`` makes the
store of the kind the table's spec names (``TableSpec.storage``); checkpoints ask
:func:`saved_layout_of` and :func:`keeps_row_state`. The layer keeps the stores in a
``StoreSet`` keyed by (table, shard).

Example::

    import tensorflow as tf
    from tfhybrid.sharding.stores import KernelTable
    store = KernelTable(tf.Variable(tf.ones([4, 2])), "t", use_custom_kernel=False)
    ids, lengths = tf.constant([0, 1, 3], tf.int64), tf.constant([2, 1], tf.int64)
    assert store.lookup(ids, lengths).numpy().tolist() == [[2.0, 2.0], [1.0, 1.0]]
    assert store.lookup(ids, lengths, "mean").numpy().tolist() == [[1.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import collectives
from tfhybrid.combiners import COMBINERS, combined_bags
from tfhybrid import custom_ops
from tfhybrid import mesh as mesh_lib
from tfhybrid.dynamic.saved import KEYED_ENTRIES
from tfhybrid.dynamic.table import DynamicTable
from tfhybrid.fiited import ChunkedTable
from tfhybrid.fiited.saved import COMPACT_CHUNKS
from tfhybrid.optimizer_traits import Trains
from tfhybrid.plan.tiers import TIER_PINNED_STEPS, shard_cache_rows
from tfhybrid.plan.types import Shard
from tfhybrid.sharding.tables import (CUSTOM, DYNAMIC, FIITED, KERNEL, TIERED,
                                      TIERED_FIITED, TableSpec, custom_shard_layer,
                                      slice_initializer)
from tfhybrid.tiers import CachedTable, ChunkedCachedTable


class RowWidths(Protocol):
    """A store's per-row widths (FIITED's chunk prefixes: a FIITED pool's, or a tier's
    over FIITED chunks), as the mesh-wide adjustment (``tfhybrid.fiited.sharded``) asks."""

    chunks: int
    utility: tf.Variable     # [rows]: what the adjustment divides the chunks by

    def chunks_per_row(self) -> np.ndarray: ...

    def adjust(self, target_memory: float) -> dict: ...

    def resize(self, chunks_per_row: Any) -> dict: ...


class SavedLayout(Protocol):
    """What a kind's saved form adds to its table's ``[rows, dim]`` values, for
    checkpoints (``tfhybrid.checkpoint.tables``), weights files
    (``tfhybrid.checkpoint.weights_file``) and optimizer slots
    (``tfhybrid.checkpoint.slots``). ``held``: the (rect, variable) pairs of table ``t``
    this rank holds. ``tfhybrid.fiited.saved.CompactChunks`` is one."""

    def checkpoint_saveable(self, layer: Any, t: int, held: list) -> Callable: ...

    def weights_file_keys(self, t: int) -> list[str]: ...

    def save_to_weights_file(self, layer: Any, t: int, held: list, store: Any,
                             contributes: bool, all_sum: Callable) -> None: ...

    def load_layout_from_weights_file(self, layer: Any, t: int, held: list,
                                      store: Any) -> None: ...

    def load_state_from_weights_file(self, layer: Any, t: int, held: list,
                                     store: Any) -> None: ...

    def slot_shape(self, spec: TableSpec) -> tuple[int, int]: ...

    def slot_rect(self, spec: TableSpec, rect: Any) -> Any: ...

    # whether its saved form holds its rows' optimizer state too (then the table has
    # no optimizer slots in a checkpoint)
    saves_row_state: bool


class TableStore(Protocol):
    """What every store answers (see the module docstring)."""

    variable: tf.Variable    # what the optimizer trains and the gradient route syncs
    # the variables it keeps per row (or per cache slot) besides ``variable``, which
    # live, are broadcast and checkpointed where the shard is
    row_state: tuple
    # True: its gradient must be synced sparse (rows at logical ids or at cache slots,
    # which only the sparse sync places); None: as the sizes make cheaper
    sparse_sync: bool | None
    # the optimizers that can train it, by what they keep (``optimizer_traits``): its
    # table's slot guard refuses the others
    trained_by: frozenset
    # what the layer tracks for Keras besides ``variable`` (a table object, the user's
    # layer), so its variables are the layer's weights; None: nothing
    tracked: Any
    # its per-row widths, if its rows have them (else None)
    widths: RowWidths | None

    def rows_of(self, ids: tf.Tensor, replicas: "ShardReplicas", route: str,
                insert: bool = True) -> tf.Tensor:
        """The rows ``lookup`` reads for routed ``ids`` (a tier's cache slots, their
        rows loaded; a dynamic table's slots; the ids themselves elsewhere); ``route``
        names the collectives; ``insert=False`` (inference): a dynamic table only
        finds keys."""

    def lookup(self, ids: tf.Tensor, lengths: tf.Tensor, combiner: str = "sum",
               weights: tf.Tensor | None = None) -> tf.Tensor:
        """[bags, width]: each bag's rows (``lengths`` ids each), each times its weight
        where ``weights`` (one per id) are given, combined by ``combiner``
        (:data:`COMBINERS`; an empty bag is zeros)."""

    def read_rows(self, start: int, stop: int) -> Any: ...

    def write_rows(self, start: int, values: np.ndarray) -> None: ...

    def memory_bytes(self) -> dict[str, int]: ...

    def stats(self) -> dict[str, Any]:
        """Its counters (a cache's hits and misses); {} where it keeps none."""


def combined(bag_sums: Callable[..., tf.Tensor], ids: tf.Tensor, lengths: tf.Tensor,
             combiner: str, weights: tf.Tensor | None, table_name: str) -> tf.Tensor:
    """A store's ``lookup`` from its ``bag_sums(ids, lengths, weights)`` (weighted
    sums): the one rule of the combiners for every kind (``tfhybrid.combiners``: zeros
    for an empty bag). ``ValueError`` names an unknown combiner."""
    if combiner not in COMBINERS:
        raise ValueError(f"table {table_name!r}: combiner={combiner!r} is unknown to its "
                         f"store; expected one of {COMBINERS}")
    return combined_bags(bag_sums(ids, lengths, weights), combiner, lengths, weights)


def _ragged_weights(weights: tf.Tensor | None, lengths: tf.Tensor) -> Any:
    """Per-id weights as the bags' ragged weights (None stays None)."""
    if weights is None:
        return None
    return tf.RaggedTensor.from_row_lengths(weights, lengths, validate=False)


@dataclasses.dataclass(frozen=True)
class ShardReplicas:
    """The replicas of this rank's shards (its data group), as a store may need them to
    turn routed ids into rows: a tier's replicas load every replica's ids alike.

    In one process there is no other replica.

    Example::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.sharding.stores import ShardReplicas
        replicas = ShardReplicas("emb", tfhybrid.init(model_parallel=1), "gradients")
        assert replicas.gather(tf.constant([1, 2], tf.int64), "t") is None
    """
    layer_name: str
    mesh: mesh_lib.Mesh
    replica_sync: str

    def gather(self, ids: tf.Tensor, route: str) -> tf.Tensor | None:
        """Every replica's ``ids``, in data-group order (None with one replica)."""
        if self.mesh.data_parallel == 1:
            return None
        return collectives.allgather(ids, self.mesh.data_parallel,
                                     f"tfhybrid_{self.layer_name}_tier_ids_{route}",
                                     self.mesh.data_process_set)


def _dense_bytes(variable: tf.Variable) -> dict[str, int]:
    # tf.as_dtype: a Keras 3 weight names its dtype by a string
    nbytes = int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size
    return {"embedding": nbytes, "dense": nbytes, "store": 0}


class KernelTable:
    """A dense table (or shard) in one variable.

    Example::

        import tensorflow as tf
        from tfhybrid.sharding.stores import KernelTable
        store = KernelTable(tf.Variable(tf.zeros([3, 2])), "t", use_custom_kernel=False)
        store.write_rows(1, [[1.0, 2.0]])
        assert store.read_rows(1, 2).numpy().tolist() == [[1.0, 2.0]]
    """

    row_state: tuple = ()
    sparse_sync = None
    # a dense variable: every optimizer's slots fit it
    trained_by = frozenset(Trains)
    tracked = None
    widths = None

    def __init__(self, variable: tf.Variable, table_name: str, use_custom_kernel: bool):
        self.variable = variable
        # the tf.Variable under a Keras 3 weight: lookups, scatters and reads go to it
        self._storage = _tf_internals.tf_variable(variable)
        self._table_name = table_name
        self._use_custom_kernel = use_custom_kernel

    def rows_of(self, ids: tf.Tensor, replicas: ShardReplicas, route: str,
                insert: bool = True) -> tf.Tensor:
        del replicas, route, insert
        return ids

    def lookup(self, ids: tf.Tensor, lengths: tf.Tensor, combiner: str = "sum",
               weights: tf.Tensor | None = None) -> tf.Tensor:
        return combined(self._bag_sums, ids, lengths, combiner, weights, self._table_name)

    def _bag_sums(self, ids: tf.Tensor, lengths: tf.Tensor, weights: Any = None
                  ) -> tf.Tensor:
        ragged = tf.RaggedTensor.from_row_lengths(ids, lengths, validate=False)
        # use_custom_kernel=True: the C++ op where it is built (else pure TF)
        return custom_ops.embedding_lookup_combine(
            self._storage, ragged, combiner="sum", table_name=self._table_name,
            use_custom_op=None if self._use_custom_kernel else False,
            weights=_ragged_weights(weights, lengths))

    def read_rows(self, start: int, stop: int) -> tf.Tensor:
        # a gather reads only the rows; a dense read of a variable that saw sparse
        # updates copies the whole table first
        return tf.gather(self._storage, tf.range(start, stop))

    def write_rows(self, start: int, values: np.ndarray) -> None:
        # scatter_update writes in place; a sliced assign may copy the table
        self._storage.scatter_update(
            tf.IndexedSlices(values, tf.range(start, start + len(values))))

    def memory_bytes(self) -> dict[str, int]:
        return _dense_bytes(self.variable)

    def stats(self) -> dict[str, Any]:
        return {}


class FiitedPool:
    """A FIITED table (or shard): its chunk pool, rows of per-row widths.

    Example::

        import tensorflow as tf
        from tfhybrid.fiited import ChunkedTable
        from tfhybrid.sharding.stores import FiitedPool
        store = FiitedPool(ChunkedTable(4, 4, 2, initial_value=tf.ones([4, 4]), name="t"))
        assert store.read_rows(0, 1).numpy().tolist() == [[1.0, 1.0, 1.0, 1.0]]
    """

    # a pool's gradient is rows at logical ids, which only the sparse sync (and the
    # pool's own apply) can place
    sparse_sync = True

    def __init__(self, table: ChunkedTable):
        self._table = table
        self.variable = table.pool
        self.trained_by = table.trained_by
        self.tracked = table
        self.widths = table

    @property
    def row_state(self) -> tuple:
        return tuple(self._table.row_state)

    def rows_of(self, ids: tf.Tensor, replicas: ShardReplicas, route: str,
                insert: bool = True) -> tf.Tensor:
        del replicas, route, insert
        return ids

    def lookup(self, ids: tf.Tensor, lengths: tf.Tensor, combiner: str = "sum",
               weights: tf.Tensor | None = None) -> tf.Tensor:
        return combined(self._bag_sums, ids, lengths, combiner, weights, self._table.name)

    def _bag_sums(self, ids: tf.Tensor, lengths: tf.Tensor, weights: Any = None
                  ) -> tf.Tensor:
        return self._table.lookup_combine(
            tf.RaggedTensor.from_row_lengths(ids, lengths, validate=False), "sum", weights)

    def read_rows(self, start: int, stop: int) -> tf.Tensor:
        return tf.convert_to_tensor(self._table.read_rows(start, stop))

    def write_rows(self, start: int, values: np.ndarray) -> None:
        # a row keeps its width: pruned entries are dropped
        self._table.write_rows(start, values)

    def memory_bytes(self) -> dict[str, int]:
        memory = self._table.memory_bytes()
        return {"embedding": memory["pool"] + memory["zero_chunk"] + memory["row_offsets"],
                "dense": self._table.rows * self._table.dim * 4, "store": 0}

    def stats(self) -> dict[str, Any]:
        return {}


class TieredCache:
    """A disk-tier shard: its rows in a file, a DRAM cache in front; looked up at cache
    slots (the route turns routed ids into slots, loading their rows first). An adaptive
    table's tier (``ChunkedCachedTable``) keeps FIITED's per-row widths.

    Example::

        import tempfile
        import tensorflow as tf
        from tfhybrid.sharding.stores import TieredCache
        from tfhybrid.tiers import CachedTable
        table = CachedTable(100, 2, 8, tempfile.mkdtemp(), name="t",
                            initializer=lambda start, stop: [[1.0, 1.0]] * (stop - start))
        store = TieredCache(table, "t", use_custom_kernel=False)
        assert store.read_rows(5, 6).tolist() == [[1.0, 1.0]]
    """

    # a cache's gradient rows are at slots, which the replicas share
    sparse_sync = True

    def __init__(self, table: CachedTable, table_name: str, use_custom_kernel: bool):
        self._tier = table
        # an adaptive tier keeps FIITED's per-row widths: its lookups and widths are
        # its own
        self._chunked = table if isinstance(table, ChunkedCachedTable) else None
        self.variable = table.cache
        self.trained_by = table.trained_by
        self.tracked = table
        self.widths = self._chunked
        self._table_name = table_name
        self._use_custom_kernel = use_custom_kernel

    @property
    def row_state(self) -> tuple:
        # an adaptive tier's per-slot state holds its accumulators
        if self._chunked is not None:
            return tuple(self._chunked.row_state)
        return (self._tier.cache_accumulator,)

    def rows_of(self, ids: tf.Tensor, replicas: ShardReplicas, route: str,
                insert: bool = True) -> tf.Tensor:
        """The cache slots of routed ``ids``, their rows loaded first (also in inference,
        ``insert=False``: the cache must hold what it looks up).

        Every replica of the shard (its data group) loads the ids of all of them, in
        one call with the same set of ids: their caches then make the same choices and
        stay alike, slot for slot, so the replicas' gradients (rows at slots) add up
        as those of a table in memory. The cache must hold the group's distinct ids.
        """
        del insert
        # Valid ids pass unchanged. A batch read ahead whose check failed is never looked
        # up (TrainPipeline raises after the step beside it), and its bad ids must not
        # fail the host step inside that step's function.
        ids = tf.clip_by_value(ids, 0, self._tier.rows - 1)
        everyone = replicas.gather(ids, route)
        if everyone is None:
            return self._tier.slots(ids)
        after = []
        if replicas.replica_sync == "weights":
            # A weight sync rewrites every slot, so rows must not move in or out while it
            # runs: a pipeline reads batch t+1's rows in step t's function, and reading
            # the cache here orders that after the step's last write to it (its sync).
            after = [self.variable.read_value()]
        with tf.control_dependencies(after):
            slots = self._tier.slots(tf.concat([everyone, ids], 0))
        return slots[tf.size(everyone):]

    def lookup(self, slots: tf.Tensor, lengths: tf.Tensor, combiner: str = "sum",
               weights: tf.Tensor | None = None) -> tf.Tensor:
        return combined(self._bag_sums, slots, lengths, combiner, weights, self._table_name)

    def _bag_sums(self, slots: tf.Tensor, lengths: tf.Tensor, weights: Any = None
                  ) -> tf.Tensor:
        ragged = tf.RaggedTensor.from_row_lengths(slots, lengths, validate=False)
        if self._chunked is not None:
            return self._chunked.lookup_combine(ragged, "sum", weights)
        return custom_ops.embedding_lookup_combine(
            self.variable, ragged, combiner="sum", table_name=self._table_name,
            use_custom_op=None if self._use_custom_kernel else False,
            weights=_ragged_weights(weights, lengths))

    def read_rows(self, start: int, stop: int) -> Any:
        return self._tier.read_rows(start, stop)

    def write_rows(self, start: int, values: np.ndarray) -> None:
        # writes the file and the rows the cache holds
        self._tier.write_rows(start, values)

    def memory_bytes(self) -> dict[str, int]:
        memory = self._tier.memory_bytes()
        return {"embedding": memory["cache"] + memory["index"],
                "dense": self._tier.rows * self._tier.dim * 4, "store": memory["store"]}

    def stats(self) -> dict[str, Any]:
        return self._tier.stats()


class DynamicShard:
    """A dynamic table's shard (``tfhybrid.dynamic.DynamicTable``): open-world keys in a
    fixed number of slots, looked up at the slots the route finds for the keys.

    Its replicas (the shard's data group) keep the same key -> slot map: each finds or
    inserts the keys of all of them, in one call with the same keys, so they admit,
    evict and initialize alike, and their gradients (rows at slots) add up as those of
    one table.

    Example::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.dynamic.table import DynamicTable
        from tfhybrid.sharding.stores import DynamicShard, ShardReplicas
        store = DynamicShard(DynamicTable(4, 2, initializer=1.0), "t")
        replicas = ShardReplicas("emb", tfhybrid.init(model_parallel=1), "gradients")
        slots = store.rows_of(tf.constant([-9, 2**40], tf.int64), replicas, "f0")
        assert store.lookup(slots, tf.constant([2], tf.int64)).numpy().tolist() == [[2.0, 2.0]]
    """

    # rows at slots, which the replicas share
    sparse_sync = True
    widths = None

    def __init__(self, table: DynamicTable, table_name: str):
        self._table = table
        self._table_name = table_name
        self.variable = table.rows
        self.row_state = table.row_state
        self.trained_by = table.trained_by
        self.tracked = table

    def rows_of(self, ids: tf.Tensor, replicas: ShardReplicas, route: str,
                insert: bool = True) -> tf.Tensor:
        """The slots of routed keys ``ids``, the keys of every replica inserted first in
        one call (class docstring): -1 where a key has none. ``insert=False`` only
        finds them, changing nothing (every replica alike: no collective)."""
        if not insert:
            return self._table.slots(ids, insert=False)
        everyone = replicas.gather(ids, route)
        if everyone is None:
            return self._table.slots(ids)
        after = []
        if replicas.replica_sync == "weights":
            # as a tier's cache: a weight sync rewrites every row, so new keys' rows are
            # written after the step's last write (its sync), never beside it
            after = [self.variable.read_value()]
        with tf.control_dependencies(after):
            inserted = self._table.slots(everyone)
        with tf.control_dependencies([inserted]):
            return self._table.slots(ids, insert=False)

    def lookup(self, slots: tf.Tensor, lengths: tf.Tensor, combiner: str = "sum",
               weights: tf.Tensor | None = None) -> tf.Tensor:
        if combiner not in COMBINERS:
            raise ValueError(f"table {self._table_name!r}: combiner={combiner!r} is unknown "
                             f"to its store; expected one of {COMBINERS}")
        # the table combines itself: a key without a slot still counts in its bag
        return self._table.lookup(slots, lengths, combiner, weights)

    def read_rows(self, start: int, stop: int) -> tf.Tensor:
        """The rows of slots [start, stop): a whole-table read gives a dynamic table's
        rows in the slot order of this mesh (its checkpoints hold them by key)."""
        return self._table.rows[start:stop]

    def write_rows(self, start: int, values: np.ndarray) -> None:
        del start, values
        raise ValueError(f"table {self._table_name!r} is a dynamic table: its slots hold "
                         "keys in no fixed order, so rows cannot be written by index; "
                         "restore it by key from a checkpoint or weights file, or pass "
                         "None for it to set_weights")

    def memory_bytes(self) -> dict[str, int]:
        memory = self._table.memory_bytes()
        return {"embedding": memory["total"], "dense": memory["rows"], "store": 0}

    def stats(self) -> dict[str, Any]:
        return self._table.stats()


class CustomLayerTable(KernelTable):
    """A shard that is an instance of the user's own embedding layer (one
    ``[rows, width]`` weight), called on the shard's ids; its rows are read and written
    as a kernel table's.

    Example::

        import tensorflow as tf
        from tfhybrid.sharding.stores import CustomLayerTable
        layer = tf.keras.layers.Embedding(4, 2, embeddings_initializer="ones")
        layer.build(tf.TensorShape([None]))
        store = CustomLayerTable(layer, combiner=None)
        ids, lengths = tf.constant([3], tf.int64), tf.constant([1], tf.int64)
        assert store.lookup(ids, lengths).numpy().tolist() == [[1.0, 1.0]]
    """

    def __init__(self, layer: tf.keras.layers.Layer, combiner: str | None):
        super().__init__(layer.weights[0], layer.name, use_custom_kernel=False)
        self.tracked = layer
        self._layer = layer
        self._combiner = combiner

    def _bag_sums(self, ids: tf.Tensor, lengths: tf.Tensor, weights: Any = None
                  ) -> tf.Tensor:
        if weights is not None:
            # the user's layer gives rows; the weighted sum is TF's
            rows = tf.cast(self._layer(ids), tf.float32) * tf.cast(weights, tf.float32)[:, None]
            return tf.math.unsorted_segment_sum(rows, tf.ragged.row_splits_to_segment_ids(
                tf.concat([[0], tf.cumsum(tf.cast(lengths, tf.int64))], 0)), tf.size(lengths))
        # without a combiner every bag is one id (checked when the layer is built)
        ragged = tf.RaggedTensor.from_row_lengths(ids, lengths, validate=False)
        return tf.cast(self._layer(ragged if self._combiner else ids), tf.float32)


@dataclasses.dataclass(frozen=True)
class StoreContext:
    """What creating a store needs from the layer that owns it."""
    layer_name: str
    rank: int
    use_custom_kernel: bool
    # the layer's add_weight for a kernel table's variable (Keras then tracks it, with
    # the table layer's regularizer and constraint)
    add_weight: Callable[..., tf.Variable]
    # per table name, the features that read it (a dynamic table finds keys once per
    # feature and step)
    calls_per_step: dict = dataclasses.field(default_factory=dict)


def create_store(spec: TableSpec, shard: Shard, name: str,
                 context: StoreContext, regularizer: Any = None,
                 constraint: Any = None) -> TableStore:
    """The store of ``spec``'s ``shard`` (the whole table for a replicated one) of the
    storage kind the spec names (:data:`STORAGE_KINDS`), its rows initialized to the
    shard's slice of the table; ``ValueError`` names an unknown kind."""
    return kind_of(spec).make(spec, shard, name, context, regularizer, constraint)


def kind_of(spec: TableSpec) -> "StorageKind":
    """The storage kind ``spec`` names; ``ValueError`` names an unknown one."""
    kind = STORAGE_KINDS.get(spec.storage)
    if kind is None:
        raise ValueError(f"table {spec.name!r}: storage kind {spec.storage!r} has no store; "
                         f"expected one of {sorted(STORAGE_KINDS)}")
    return kind


def saved_layout_of(spec: TableSpec) -> SavedLayout | None:
    """What ``spec``'s kind saves besides its values (None: only its values)."""
    return kind_of(spec).saved_layout


def keeps_row_state(spec: TableSpec) -> bool:
    """Whether ``spec``'s kind keeps its rows' optimizer state itself (a FIITED pool's
    accumulators, a tier's, which move with the rows): its only optimizer state."""
    return kind_of(spec).keeps_row_state


def _kernel_store(spec: TableSpec, shard: Shard, name: str, context: StoreContext,
                  regularizer: Any, constraint: Any) -> KernelTable:
    rows, width = shard.row_end - shard.row_start, shard.col_end - shard.col_start
    variable = _tf_internals.add_weight(
        context.add_weight, name=name, shape=[rows, width],
        initializer=slice_initializer(spec, shard), regularizer=regularizer,
        constraint=constraint, dtype=tf.float32, autocast=False)
    return KernelTable(variable, spec.name, context.use_custom_kernel)


def _fiited_store(spec: TableSpec, shard: Shard, name: str, context: StoreContext,
                  regularizer: Any, constraint: Any) -> FiitedPool:
    del regularizer, constraint   # only a kernel table's variable takes them
    rows, width = shard.row_end - shard.row_start, shard.col_end - shard.col_start
    with tf.init_scope():
        initial = slice_initializer(spec, shard)([rows, width], dtype=tf.float32)
    return FiitedPool(ChunkedTable(rows, width, width // spec.chunk_dim,
                                   initial_value=initial, name=name.replace("/", "_"),
                                   use_custom_op=None if context.use_custom_kernel else False,
                                   add_weight=context.add_weight))


def _tiered_store(spec: TableSpec, shard: Shard, name: str, context: StoreContext,
                  regularizer: Any, constraint: Any) -> TieredCache:
    del regularizer, constraint   # only a kernel table's variable takes them
    return TieredCache(_cached_shard(spec, shard, name, context), spec.name,
                       context.use_custom_kernel)


def _custom_store(spec: TableSpec, shard: Shard, name: str, context: StoreContext,
                  regularizer: Any, constraint: Any) -> CustomLayerTable:
    del context, regularizer, constraint   # the user's layer holds its own
    rows, width = shard.row_end - shard.row_start, shard.col_end - shard.col_start
    custom = custom_shard_layer(spec, rows, width, name.replace("/", "_"))
    custom.build(tf.TensorShape([None]))
    # as Keras' own first call would: a build that does not call super().build()
    # leaves built False, and the call would build again
    _tf_internals.mark_built(custom)
    return CustomLayerTable(custom, spec.combiner)


def _dynamic_store(spec: TableSpec, shard: Shard, name: str, context: StoreContext,
                   regularizer: Any, constraint: Any) -> DynamicShard:
    del regularizer, constraint   # only a kernel table's variable takes them
    rules = spec.keyed
    # a slot is found once per feature that reads the table in a step, and a pipeline
    # finds the next batch's keys during this step: rows of both stay pinned, and the
    # ttl counts steps
    calls = context.calls_per_step.get(spec.name, 1)
    with tf.init_scope():
        table = DynamicTable(
            shard.row_end - shard.row_start, shard.col_end - shard.col_start,
            initializer=spec.initializer, admit_after=rules.admit_after,
            evict=rules.evict, ttl_steps=None if rules.ttl_steps is None
            else rules.ttl_steps * calls, pinned_calls=TIER_PINNED_STEPS * calls,
            use_custom_op=None if context.use_custom_kernel else False,
            name=re.sub(r"\W", "_", f"{context.layer_name}_{name}"),
            add_weight=context.add_weight, default_row=rules.default_row)
    return DynamicShard(table, spec.name)


def _cached_shard(spec: TableSpec, shard: Shard, name: str,
                  context: StoreContext) -> CachedTable:
    """A tiered shard: its rows in a file of this rank's, a cache in front (with FIITED's
    per-row widths for an adaptive table)."""
    rows, width = shard.row_end - shard.row_start, shard.col_end - shard.col_start

    def initializer(start, stop):
        # a seeded table draws the shard's slice of the whole table's values
        piece = dataclasses.replace(shard, row_start=shard.row_start + start,
                                    row_end=shard.row_start + stop)
        with tf.device("/CPU:0"):
            return slice_initializer(spec, piece)([stop - start, width],
                                                  dtype=tf.float32).numpy()

    # one folder per rank (the ranks may share store_dir); the table's name, which its
    # variables and so their gradient syncs' collectives carry, is the same on every
    # replica
    directory = os.path.join(spec.store_dir, f"rank{context.rank}")
    os.makedirs(directory, exist_ok=True)
    tier = dict(initializer=initializer, policy=spec.cache_policy,
                name=re.sub(r"\W", "_", f"{context.layer_name}_{name}"),
                pinned_calls=TIER_PINNED_STEPS, add_weight=context.add_weight)
    cache_rows = shard_cache_rows(spec.cache_rows, spec.rows, rows)
    with tf.init_scope():   # the host side works eagerly, also when built in a trace
        if spec.storage == TIERED_FIITED:
            return ChunkedCachedTable(
                rows, width, cache_rows, directory, chunks=width // spec.chunk_dim,
                use_custom_op=None if context.use_custom_kernel else False, **tier)
        return CachedTable(rows, width, cache_rows, directory, **tier)


class StoreSet:
    """This rank's stores of one layer, keyed by (table, shard); a replicated table is
    shard 0.

    Example::

        import tensorflow as tf
        from tfhybrid.sharding.stores import KernelTable, StoreSet
        stores = StoreSet()
        stores.add(0, 0, KernelTable(tf.Variable(tf.ones([2, 2])), "t", False))
        assert stores.get(0, 0).variable.shape == (2, 2) and stores.get(1, 0) is None
    """

    def __init__(self) -> None:
        self._stores: dict[tuple[int, int], TableStore] = {}

    def add(self, table: int, shard: int, store: TableStore) -> None:
        self._stores[(table, shard)] = store

    def get(self, table: int, shard: int) -> TableStore | None:
        """The store of table ``table``'s shard ``shard`` if this rank holds it."""
        return self._stores.get((table, shard))

    def items(self) -> Iterator[tuple[tuple[int, int], TableStore]]:
        return iter(self._stores.items())

    def lookup(self, table: int, shard: int, ids: tf.Tensor, lengths: tf.Tensor,
               combiner: str = "sum", weights: tf.Tensor | None = None) -> tf.Tensor:
        """Each bag's rows of one table or shard held here (each times its weight
        where ``weights`` are given), combined."""
        return self._stores[(table, shard)].lookup(ids, lengths, combiner, weights)


def _in_disk_tier(spec: TableSpec) -> str:
    return f"has cache_rows={spec.cache_rows} (a disk tier)"


@dataclasses.dataclass(frozen=True)
class StorageKind:
    """One storage kind: how its store is made and what it saves.

    Example::

        from tfhybrid.sharding.stores import STORAGE_KINDS
        assert STORAGE_KINDS["kernel"].saved_layout is None
        assert STORAGE_KINDS["fiited"].keeps_row_state
    """
    # (spec, shard, name, context, regularizer, constraint) -> its store
    make: Callable[..., TableStore]
    # what its saved form adds to the table's values (None: only the values)
    saved_layout: SavedLayout | None = None
    # it keeps its rows' optimizer state itself (``keeps_row_state``)
    keeps_row_state: bool = False
    # why a plan may not replicate it, in the words of the user's options (a disk
    # tier's rows stay in its shard's files): spec -> text; None: it may
    not_replicable: Callable[[TableSpec], str] | None = None


# the one place a kind's name meets its store
STORAGE_KINDS: dict[str, StorageKind] = {
    KERNEL: StorageKind(_kernel_store),
    FIITED: StorageKind(_fiited_store, COMPACT_CHUNKS, keeps_row_state=True),
    TIERED: StorageKind(_tiered_store, keeps_row_state=True,
                        not_replicable=_in_disk_tier),
    TIERED_FIITED: StorageKind(_tiered_store, COMPACT_CHUNKS, keeps_row_state=True,
                               not_replicable=_in_disk_tier),
    CUSTOM: StorageKind(_custom_store),
    DYNAMIC: StorageKind(_dynamic_store, KEYED_ENTRIES, keeps_row_state=True)}
