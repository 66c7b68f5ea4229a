"""A table in a slower memory tier with a DRAM cache in front (ZionEX's memory hierarchy).

ZionEX (arXiv 2104.05158) trains tables larger than accelerator memory by keeping rows in
a slower tier (host DDR, SSD) and caching the hot ones in fast memory. FBGEMM's SSD
table-batched embedding, TorchRec's UVM caching and TF Recommenders Addons' RocksDB tables
do the same. Here the slow tier is a file on disk, memory-mapped, and the fast tier is a
``cache_rows``-row ``tf.Variable``:

* **store**: ``<directory>/<name>.values`` (``[rows, dim]`` float32) and
  ``<name>.accumulator`` (``[rows]`` float32, row-wise AdaGrad's state), little-endian,
  memory-mapped; only the rows the cache loads or writes back are touched, so a table of
  any size fits whatever the process may hold (the kernel may drop clean file pages);
* **cache**: ``cache`` (``[cache_rows, dim]``) and ``cache_accumulator``
  (``[cache_rows]``), the variables the lookups read and the optimizer updates;
* **index** (host): each row's cache slot or -1 (4 bytes per row); per slot its row, the
  policy's state (LRU: CLOCK's reference bit, an approximation of LRU that costs
  O(rows loaded) per batch; LFU: in how many steps it was used since loaded), the step of
  its last lookup and whether it was used since loaded.

Before a lookup, :meth:`CachedTable.slots` maps the batch's ids to cache slots: rows not
cached are loaded (value and accumulator) into slots that this batch does not use (with
``pinned_calls=2``, nor the batch of the call before, whose step a pipeline may still be
running), chosen by the policy, and a slot's previous row is written back first if it was used since it
was loaded (write-back). The lookup and the optimizer then work on the cache as on any
table, so training equals training the whole table in memory bit for bit (a row's
arithmetic does not depend on where it sits). The cache never holds stale rows: the
store is only read for rows not in the cache, and :meth:`flush` (run by every checkpoint
save) writes every used slot back.

In weight-sync mode (``replica_sync="weights"``) the replicas of a shard make the same
cache choices (they load the same ids), so their tables differ only in the cache and in
the rows written back since the last sync; :meth:`sync_replicas` averages those rows of
the store (the cache is averaged with the other weights) and no other row moves.

``tfhybrid.layers.Embedding(..., cache_rows=N, store_dir=path)`` is the Keras layer on it.
Train it with SGD without momentum or :class:`tfhybrid.optimizers.RowWiseAdagrad`, whose
per-row state the table keeps: any other Keras optimizer would keep a slot shaped like the
cache, which would not follow its rows, so creating one raises ``ValueError``.
"""

from __future__ import annotations

from tfhybrid.tiers.cached_table import POLICIES, CachedTable, accumulator_table_of, table_of
from tfhybrid.tiers.chunked_cached_table import ChunkedCachedTable

__all__ = ["CachedTable", "ChunkedCachedTable", "POLICIES", "table_of",
           "accumulator_table_of"]
