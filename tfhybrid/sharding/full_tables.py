"""Whole tables from their shards, and back: every rank of the mesh takes part.

``WholeTables`` serves ``DistributedEmbedding.get_weights`` / ``set_weights`` (NVIDIA
distributed-embeddings' API: full tables in, full tables out, in chunks so that no rank
holds more than the tables it returns plus one chunk), the FIITED adjustment that plans
each sharded table whole from its shards' utilities, the chunk counts per row and the
memory the stores take. It reads rows only through the stores' protocol
(``tfhybrid.sharding.stores``).

Example (one process; under horovodrun every rank calls the same)::

    import tensorflow as tf
    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding
    tfhybrid.init(model_parallel=1)
    layer = DistributedEmbedding([tf.keras.layers.Embedding(10, 4)])
    layer([tf.constant([1, 2])])
    layer.set_weights([tf.ones([10, 4]).numpy()])
    assert layer.get_weights()[0].sum() == 40.0
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid.fiited import plan_chunk_counts
from tfhybrid.plan.types import Kind, ShardingPlan
from tfhybrid.sharding.stores import StoreSet
from tfhybrid.sharding.tables import TableSpec

# Full-table gathers and scatters move at most this many bytes per collective, so a
# table never needs more than its own size plus one chunk of extra memory.
CHUNK_BYTES = 8 * 1024 * 1024


def row_chunks(rows: int, width: int, chunk_bytes: int | None = None
               ) -> Iterator[tuple[int, int]]:
    """(start, stop) row ranges of at most ``chunk_bytes`` (float32) each.

    >>> list(row_chunks(5, 1, chunk_bytes=8))
    [(0, 2), (2, 4), (4, 5)]
    """
    step = max(1, (chunk_bytes or CHUNK_BYTES) // max(1, 4 * width))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


class WholeTables:
    """One layer's tables as wholes, over the shards its ranks hold (module docstring).

    Every method is collective over the mesh (or the model group): every rank calls it.

    Example::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding
        tfhybrid.init(model_parallel=1)
        layer = DistributedEmbedding([tf.keras.layers.Embedding(10, 4)])
        layer([tf.constant([1, 2])])
        assert layer.memory_bytes()["embedding"] == 10 * 4 * 4
    """

    def __init__(self, name: str, mesh: mesh_lib.Mesh, plan: ShardingPlan,
                 tables: Sequence[TableSpec], stores: StoreSet,
                 whole_chunk_counts: dict[int, np.ndarray]):
        self._name = name
        self._mesh = mesh
        self._plan = plan
        self._tables = list(tables)
        self._stores = stores
        # per FIITED table, every row's chunk count as every rank planned it at the last
        # adjustment (the layer's dict: checkpoints read and restore it too)
        self._whole_chunk_counts = whole_chunk_counts

    def get_weights(self, all_ranks: bool = False) -> list:
        """The full tables, on rank 0 (every rank with ``all_ranks``); others get []."""
        mesh = self._mesh
        keep = all_ranks or mesh.rank == 0
        full_tables = []
        for t, (table, placement) in enumerate(zip(self._tables, self._plan.tables)):
            full = np.empty([table.rows, table.dim], np.float32) if keep else None
            replicated = placement.kind == Kind.DATA_PARALLEL
            for s, shard in enumerate(placement.shards):
                width = shard.col_end - shard.col_start
                store = self._stores.get(t, 0 if replicated else s)
                for start, stop in row_chunks(shard.row_end - shard.row_start, width):
                    if replicated and not keep:
                        continue
                    local = (tf.convert_to_tensor(store.read_rows(start, stop))
                             if store is not None else tf.zeros([0, width], tf.float32))
                    if not replicated:
                        local = collectives.allgather(local, mesh.model_parallel,
                                                      f"tfhybrid_{self._name}_get_weights",
                                                      mesh.model_process_set)
                    if keep:
                        full[shard.row_start + start:shard.row_start + stop,
                             shard.col_start:shard.col_end] = local.numpy()
            full_tables.append(full)
        return full_tables if keep else []

    def set_weights(self, weights: Sequence[Any], chunk: int | None = None) -> None:
        """Slices full tables (arrays or ``.npy`` paths, memory-mapped) onto the stores
        this rank holds; ``chunk`` bounds the elements written at once."""
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
            placement = self._plan.tables[t]
            for s, shard in enumerate(placement.shards):
                store = self._stores.get(t, s)
                if store is None:
                    continue
                width = shard.col_end - shard.col_start
                for start, stop in row_chunks(shard.row_end - shard.row_start, width,
                                              None if chunk is None else 4 * chunk):
                    store.write_rows(start, np.asarray(
                        full[shard.row_start + start:shard.row_start + stop,
                             shard.col_start:shard.col_end], np.float32))

    def adjust(self, target_of: Callable[[TableSpec], float]) -> dict[str, int]:
        """FIITED's adjustment of every adaptive table to ``target_of(table)`` of its
        chunks; returns the chunks each keeps, by table name.

        A sharded table is planned whole from its shards' utilities summed over the
        model group (a column slice's utility is its part of the row's), and each shard
        keeps its part of that plan, so every mesh prunes alike.
        """
        adaptive = [t for t, table in enumerate(self._tables) if table.chunks]
        if not adaptive:
            raise ValueError(f"DistributedEmbedding {self._name!r}.adjust(): no table has "
                             "dims='adaptive'")
        mesh = self._mesh
        sharded = [t for t in adaptive if self._plan.tables[t].kind != Kind.DATA_PARALLEL]
        # each sharded table's utility per row, whole: this rank's shards in place, summed
        # over the model group (every row is held by one shard per column slice)
        utilities = []
        for t in sharded:
            whole = np.zeros([self._tables[t].rows], np.float32)
            for s, shard in enumerate(self._plan.tables[t].shards):
                chunked = self._stores.fiited(t, s)
                if chunked is not None:
                    whole[shard.row_start:shard.row_end] += chunked.utility.numpy()
            utilities.append(whole)
        if utilities and mesh.model_parallel > 1:
            summed = collectives.allreduce(tf.constant(np.concatenate(utilities)), hvd.Sum,
                                           f"tfhybrid_{self._name}_fiited_utility",
                                           mesh.model_process_set).numpy()
            utilities = np.split(summed, np.cumsum([len(u) for u in utilities])[:-1])
        kept = {}
        for t in adaptive:
            table, placement = self._tables[t], self._plan.tables[t]
            target = target_of(table)
            if placement.kind == Kind.DATA_PARALLEL:
                # every rank's copy has the same utility (its gradient is synced)
                chunked = self._stores.fiited(t, 0)
                kept[table.name] = chunked.adjust(target)["present"]
                self._whole_chunk_counts[t] = chunked.chunks_per_row().astype(
                    np.min_scalar_type(table.chunks))
                continue
            counts = plan_chunk_counts(utilities[sharded.index(t)], table.chunks, target)
            kept[table.name] = int(counts.sum())
            self._whole_chunk_counts[t] = counts.astype(np.min_scalar_type(table.chunks))
            for s, shard in enumerate(placement.shards):
                chunked = self._stores.fiited(t, s)
                if chunked is None:
                    continue
                # the row's chunks that fall in this column slice (a prefix of them)
                first = shard.col_start // table.chunk_dim
                chunked.resize(np.clip(counts[shard.row_start:shard.row_end] - first, 0,
                                       chunked.chunks))
        return kept

    def chunks_per_row(self) -> list:
        """Per table, how many chunks each row holds (None for a dense table)."""
        mesh = self._mesh
        counts = []
        for t, (table, placement) in enumerate(zip(self._tables, self._plan.tables)):
            if not table.chunks:
                counts.append(None)
                continue
            if placement.kind == Kind.DATA_PARALLEL:
                counts.append(self._stores.fiited(t, 0).chunks_per_row())
                continue
            whole = np.zeros([table.rows], np.int32)
            for s, shard in enumerate(placement.shards):
                chunked = self._stores.fiited(t, s)
                if chunked is not None:
                    whole[shard.row_start:shard.row_end] += chunked.chunks_per_row()
            if mesh.model_parallel > 1:
                whole = collectives.allreduce(tf.constant(whole), hvd.Sum,
                                              f"tfhybrid_{self._name}_fiited_counts",
                                              mesh.model_process_set).numpy()
            counts.append(whole)
        return counts

    def memory_bytes(self) -> dict[str, int]:
        """This rank's stores' bytes: ``"embedding"`` in memory, ``"dense"`` what they
        take as dense tables, ``"store"`` in the disk tier's files."""
        held = {"embedding": 0, "dense": 0, "store": 0}
        for _, store in self._stores.items():
            for key, nbytes in store.memory_bytes().items():
                held[key] += nbytes
        return held
