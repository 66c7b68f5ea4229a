"""Whole tables from their shards, and back: every rank of the mesh takes part.

``WholeTables`` serves ``DistributedEmbedding.get_weights`` / ``set_weights`` (NVIDIA
distributed-embeddings' API: full tables in, full tables out, in chunks so that no rank
holds more than the tables it returns plus one chunk) and the memory the stores take.
It reads rows only through the stores' protocol (``tfhybrid.sharding.stores``).

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

from typing import Any, Iterator, Sequence

import numpy as np
import tensorflow as tf

from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
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
                 tables: Sequence[TableSpec], stores: StoreSet):
        self._name = name
        self._mesh = mesh
        self._plan = plan
        self._tables = list(tables)
        self._stores = stores

    def get_weights(self, all_ranks: bool = False, tables: Sequence[int] | None = None
                    ) -> list:
        """The full tables (those indexed by ``tables``, else all), on rank 0 (every rank
        with ``all_ranks``); others get []."""
        mesh = self._mesh
        keep = all_ranks or mesh.rank == 0
        full_tables = []
        for t in range(len(self._tables)) if tables is None else tables:
            table, placement = self._tables[t], self._plan.tables[t]
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
        if mesh.size > 1:
            # each model group gathers on its own: every rank leaves together
            collectives.leave_together(f"tfhybrid_{self._name}_get_weights_done")
        return full_tables if keep else []

    def set_weights(self, weights: Sequence[Any], chunk: int | None = None) -> None:
        """Slices full tables (arrays or ``.npy`` paths, memory-mapped) onto the stores
        this rank holds; ``chunk`` bounds the elements written at once. ``None`` for a
        table leaves it as it is."""
        if len(weights) != len(self._tables):
            raise ValueError(f"set_weights got {len(weights)} tables; expected "
                             f"{len(self._tables)}")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 1):
            raise ValueError(f"chunk={chunk!r} must be None or an int >= 1 (elements)")
        weights = [None if w is None else
                   np.load(w, mmap_mode="r") if isinstance(w, (str, bytes)) or hasattr(
            w, "__fspath__") else w for w in weights]
        for t, (table, full) in enumerate(zip(self._tables, weights)):
            if full is None:
                continue
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

    def memory_bytes(self) -> dict[str, int]:
        """This rank's stores' bytes: ``"embedding"`` in memory, ``"dense"`` what they
        take as dense tables, ``"store"`` in the disk tier's files."""
        held = {"embedding": 0, "dense": 0, "store": 0}
        for _, store in self._stores.items():
            for key, nbytes in store.memory_bytes().items():
                held[key] += nbytes
        return held
