"""FIITED: per-row embedding widths that training adjusts, as one storage kind.

- ``table``: the chunked table (``ChunkedTable``), its lookups, row-wise AdaGrad,
  utility and adjustment (:func:`plan_chunk_counts`);
- ``sharded``: the adjustment of a ``DistributedEmbedding``'s adaptive tables over the
  mesh (``ShardedWidths``), planned whole so every mesh prunes alike;
- ``saved``: how checkpoints and weights files hold the table compactly
  (``CompactChunks``), on any mesh.

Its store (``tfhybrid.sharding.stores.FiitedPool``) and its registration as the
``"fiited"`` storage kind are in ``tfhybrid.sharding.stores``.

Example::

    import tensorflow as tf
    from tfhybrid.fiited import ChunkedTable
    table = ChunkedTable(10, 8, chunks=4, seed=0)
    table.adjust(target_memory=0.5)
    assert table.present_chunks() == 20
"""

from tfhybrid.fiited.table import (MIN_CHUNKS, POSITION_POWER, ChunkedTable, ChunkOptions,
                                   checked_int, plan_chunk_counts, table_of)

__all__ = ["ChunkedTable", "ChunkOptions", "plan_chunk_counts", "table_of", "checked_int",
           "MIN_CHUNKS", "POSITION_POWER"]
