"""``ChunkedCachedTable``: a tiered table whose rows hold FIITED chunk prefixes
(``dims="adaptive"`` with ``cache_rows``): the chunk pool is cached as a
``CachedTable``'s rows are."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import custom_ops
from tfhybrid import roles
from tfhybrid.custom_ops import coalesce_rows
from tfhybrid.fiited.table import MIN_CHUNKS, POSITION_POWER, ChunkOptions, \
    chunked_rowwise_rows, combine_bags, update_utility
from tfhybrid.optimizer_traits import Trains
from tfhybrid.tiers.cached_table import CachedTable


class ChunkedCachedTable(ChunkOptions, CachedTable):
    """A tiered table whose rows keep FIITED's chunk prefixes (``dims="adaptive"`` with
    ``cache_rows``): :class:`CachedTable`'s store and cache, with
    :class:`tfhybrid.fiited.ChunkedTable`'s per-row widths and its adjustment.

    Each row holds its first ``chunks_per_row()[i]`` chunks of ``dim // chunks`` entries;
    the entries past them are zeros, in the store and in the cache, and no update touches
    them, so a lookup is the cache's plain gather and a row reads, trains and resizes
    exactly as in a pool. Besides the cache and its index, DRAM holds per row its chunk
    count (1 byte) and FIITED's utility (4 bytes: the utility decays every step for every
    row, so it stays in memory, which keeps it exactly the pool's); per slot its row and
    chunk count, which the update reads. The store keeps every row at full width (a
    pruned chunk's entries are zeros on disk): the cache, not the file, is what DRAM
    holds. Train it with :class:`tfhybrid.optimizers.RowWiseAdagrad`.

    Example::

        import tempfile
        import tensorflow as tf
        from tfhybrid.tiers import ChunkedCachedTable
        table = ChunkedCachedTable(100, 8, cache_rows=10, directory=tempfile.mkdtemp(),
                                   chunks=4, seed=0)
        slots = table.slots(tf.constant([3, 7, 3]))
        table.apply(slots, tf.ones([3, 8]), learning_rate=0.1)
        table.adjust(target_memory=0.5)            # keep half of the 400 chunks
        assert table.present_chunks() == 200
        assert table.lookup(table.slots(tf.constant([3]))).shape == (1, 8)
    """

    # only a row-wise optimizer updates the chunks each row holds
    trained_by = frozenset({Trains.ROW_STATE})

    def __init__(self, rows: int, dim: int, cache_rows: int, directory: str, *,
                 chunks: int = 8, utility_decay: float = 0.99, min_chunks: int = MIN_CHUNKS,
                 position_power: float = POSITION_POWER, use_custom_op: bool | None = None,
                 **kwargs: Any):
        self._set_chunk_options(dim, chunks, utility_decay, min_chunks, position_power,
                                use_custom_op)
        if self.chunks > 255:
            raise ValueError(f"chunks={chunks}: a tiered table keeps each row's chunk count "
                             "in one byte; use at most 255 chunks")
        super().__init__(rows, dim, cache_rows, directory, **kwargs)
        self._row_chunks = np.full(self.rows, self.chunks, np.uint8)
        variable = functools.partial(_tf_internals.table_variable, kwargs.get("add_weight"),
                                     table=self.name, name_scope=True, trainable=False)
        self.utility = variable(lambda: tf.zeros([self.rows]), name="utility")
        # what each slot holds, for the update: its row (utility) and chunk count
        self.slot_rows = variable(lambda: tf.zeros([self.cache_rows], tf.int64),
                                  name="slot_rows")
        self.slot_chunks = variable(lambda: tf.zeros([self.cache_rows], tf.int32),
                                    name="slot_chunks")
        # the optimizer's route: a FIITED table's gradient goes to apply_pool_gradient
        roles.assign(self.cache, row_step=self)

    @property
    def accumulator(self) -> tf.Variable:
        """The row-wise AdaGrad state the optimizer lists: the cache's, per slot."""
        return self.cache_accumulator

    @property
    def storage(self) -> tf.Variable:
        """The variable the lookups read and the optimizer updates: the cache."""
        return self.cache

    @property
    def row_state(self) -> tuple:
        """The variables besides the cache that the table keeps per row or per slot
        (they live where the cache does, and are broadcast with it: a shard's replicas
        hold the same rows in the same slots)."""
        return (self.cache_accumulator, self.utility, self.slot_rows, self.slot_chunks)

    # ------------------------------------------------------------------ the cache
    def _host_written(self) -> tuple:
        return super()._host_written() + (self.slot_rows, self.slot_chunks)

    def _load(self, rows: np.ndarray) -> None:
        super()._load(rows)
        slots = self._slot_of_row[rows]
        self.slot_rows.scatter_update(tf.IndexedSlices(rows.astype(np.int64), slots))
        self.slot_chunks.scatter_update(
            tf.IndexedSlices(self._row_chunks[rows].astype(np.int32), slots))

    def lookup(self, slots: Any) -> tf.Tensor:
        """Rows at cache ``slots`` ([N]) as [N, dim]; a pruned chunk reads as zeros."""
        return custom_ops.embedding_lookup_combine(self.cache, slots, combiner=None,
                                                   table_name=self.name,
                                                   use_custom_op=self.use_custom_op)

    def lookup_combine(self, slots: Any, combiner: str = "sum", weights: Any = None
                       ) -> tf.Tensor:
        """:meth:`tfhybrid.fiited.ChunkedTable.lookup_combine` on cache ``slots``: the
        same bags through the dense fused kernel (zeros past a row's chunks add nothing)
        or the pool's pure-TF path."""
        fused = custom_ops.custom_op_used(self.use_custom_op, self.cache)
        return combine_bags(slots, combiner, self._gather,
                            self._fused_sums if fused else None, weights)

    def _gather(self, slots: tf.Tensor) -> tf.Tensor:
        return tf.gather(self.cache, slots)

    def _fused_sums(self, flat: tf.Tensor, splits: tf.Tensor, weights: Any = None
                    ) -> tf.Tensor:
        bags = tf.RaggedTensor.from_row_splits(flat, splits, validate=False)
        return custom_ops.embedding_lookup_combine(
            self.cache, bags, combiner="sum", table_name=self.name, use_custom_op=True,
            weights=None if weights is None else bags.with_flat_values(weights))

    # ------------------------------------------------------------------ training
    def apply(self, slots: Any, grad: Any, learning_rate: float, epsilon: float = 1e-8,
              scale: float = 1.0, weight_decay: float = 0.0) -> None:
        """:meth:`tfhybrid.fiited.ChunkedTable.apply` on the rows at cache ``slots``: the
        same row-wise AdaGrad on the entries each row holds, and the utility update."""
        slots = tf.reshape(tf.convert_to_tensor(slots), [-1])
        grad = tf.reshape(tf.convert_to_tensor(grad), [-1, self.dim])
        if custom_ops.custom_op_used(self.use_custom_op, self.cache, self.cache_accumulator):
            # the slots' rows and counts as the host side left them when it placed these
            # slots (it writes them eagerly, unseen by the graph's ordering)
            with tf.control_dependencies([slots]):
                slot_chunks, slot_rows = self.slot_chunks.read_value(), \
                    self.slot_rows.read_value()
            custom_ops.cached_chunked_rowwise_adagrad_apply(
                self.cache, self.cache_accumulator, slot_chunks, slot_rows, self.chunk_dim,
                slots, grad, learning_rate, epsilon, scale, weight_decay, self.utility,
                self.utility_decay)
            return
        unique_slots, g = coalesce_rows(slots, grad)
        rows = tf.gather(self.cache, unique_slots)
        chunk_present = (tf.range(self.chunks)[None, :]
                         < tf.gather(self.slot_chunks, unique_slots)[:, None])
        new_rows, new_accum = chunked_rowwise_rows(
            rows, tf.gather(self.cache_accumulator, unique_slots), g, chunk_present,
            learning_rate, epsilon, scale, weight_decay)
        held = tf.repeat(chunk_present, self.chunk_dim, axis=1)
        self.cache.scatter_update(tf.IndexedSlices(tf.where(held, new_rows, rows),
                                                   unique_slots))
        self.cache_accumulator.scatter_update(tf.IndexedSlices(new_accum, unique_slots))
        update_utility(self.utility, self.utility_decay,
                       tf.gather(self.slot_rows, unique_slots), g)

    def apply_pool_gradient(self, grad: Any, learning_rate: float, epsilon: float = 1e-8,
                            scale: float = 1.0, weight_decay: float = 0.0) -> None:
        """:meth:`apply` for the gradient a tape gives :attr:`cache` (``tf.IndexedSlices``
        at slots, or a dense ``[cache_rows, dim]`` tensor)."""
        if not isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
            grad = tf.IndexedSlices(grad, tf.range(tf.shape(grad)[0]))
        self.apply(grad.indices, grad.values, learning_rate, epsilon, scale, weight_decay)

    # ------------------------------------------------------------------ widths
    def chunks_per_row(self) -> np.ndarray:
        """How many chunks each row holds (a prefix of its chunks)."""
        return self._row_chunks.astype(np.int32)

    def present_chunks(self) -> int:
        return int(self._row_chunks.sum(dtype=np.int64))

    def resize(self, chunks_per_row: Any) -> dict:
        """Gives row i its first ``chunks_per_row[i]`` chunks: a row that shrinks has the
        entries it drops zeroed in the store and, if cached, in the cache; a row that
        grows finds zeros there already (as in a pool, a regrown chunk starts at zero).
        Returns ``freed``, ``grown`` and ``present`` chunk counts."""
        new_counts = self._checked_counts(chunks_per_row)
        old_counts = self._row_chunks.astype(np.int64)
        shrunk = np.flatnonzero(new_counts < old_counts)
        for chunk in range(self.chunks):
            rows = shrunk[(new_counts[shrunk] <= chunk) & (old_counts[shrunk] > chunk)]
            if rows.size:
                self.store[rows, chunk * self.chunk_dim:(chunk + 1) * self.chunk_dim] = 0.0
        cached = shrunk[self._slot_of_row[shrunk] >= 0]
        if cached.size:
            slots = self._slot_of_row[cached]
            values = tf.gather(self.cache, slots).numpy()
            values[np.arange(self.dim)[None, :]
                   >= (new_counts[cached] * self.chunk_dim)[:, None]] = 0.0
            self.cache.scatter_update(tf.IndexedSlices(values, slots))
        self._row_chunks[:] = new_counts
        filled = np.flatnonzero(self._row_of_slot >= 0)
        self.slot_chunks.scatter_update(tf.IndexedSlices(
            self._row_chunks[self._row_of_slot[filled]].astype(np.int32), filled))
        return {"freed": int(np.maximum(old_counts - new_counts, 0).sum()),
                "grown": int(np.maximum(new_counts - old_counts, 0).sum()),
                "present": int(new_counts.sum())}

    # ------------------------------------------------------------ whole rows
    def _column(self, chunk: int) -> tuple[np.ndarray, slice]:
        """The rows that hold chunk ``chunk`` (ascending) and its columns."""
        if not 0 <= chunk < self.chunks:
            raise ValueError(f"chunk={chunk!r} must lie in [0, {self.chunks})")
        rows = np.flatnonzero(self._row_chunks > chunk)
        return rows, slice(chunk * self.chunk_dim, (chunk + 1) * self.chunk_dim)

    def read_chunk_column(self, chunk: int) -> tf.Tensor:
        """Chunk ``chunk`` of every row that holds it, rows in order: ``[rows holding
        it, chunk_dim]`` (a checkpoint's compact form, as a pool gives it), read a block
        at a time; eagerly or inside a ``tf.function``."""
        def read():
            rows, columns = self._column(chunk)
            parts = [self.read_rows(start, stop)[rows[(rows >= start) & (rows < stop)]
                                                 - start, columns]
                     for start, stop in self.blocks()]
            return np.concatenate(parts) if parts else np.zeros([0, self.chunk_dim],
                                                                np.float32)
        values = tf.py_function(read, [], tf.float32, name=f"{self.name}_chunk_column")
        values.set_shape([None, self.chunk_dim])
        return values

    def write_chunk_column(self, chunk: int, values: Any) -> None:
        """The inverse of :meth:`read_chunk_column` under the current widths (store and
        cache)."""
        rows, columns = self._column(chunk)
        values = np.asarray(values, np.float32)
        if values.shape != (rows.size, self.chunk_dim):
            raise ValueError(f"write_chunk_column({chunk}): values of shape {values.shape};"
                             f" expected [{rows.size}, {self.chunk_dim}] (the rows that "
                             "hold the chunk)")
        self.store[rows, columns] = values
        held = self._slot_of_row[rows] >= 0
        if held.any():
            slots = self._slot_of_row[rows[held]]
            cached = tf.gather(self.cache, slots).numpy()
            cached[:, columns] = values[held]
            self.cache.scatter_update(tf.IndexedSlices(cached, slots))

    def write_rows(self, start: int, values: Any, accumulator: Any = None) -> None:
        """:meth:`CachedTable.write_rows`, the entries of pruned chunks dropped (the row
        keeps its width, as in a pool)."""
        values = np.array(values, np.float32)
        counts = getattr(self, "_row_chunks", None)   # None while the rows are first drawn
        if counts is not None and values.ndim == 2 and values.shape[1] == self.dim and \
                0 <= start and start + values.shape[0] <= self.rows:
            held = counts[start:start + values.shape[0]].astype(np.int64) * self.chunk_dim
            values[np.arange(self.dim)[None, :] >= held[:, None]] = 0.0
        super().write_rows(start, values, accumulator)

    def memory_bytes(self) -> dict:
        """:meth:`CachedTable.memory_bytes`, the index with the rows' chunk counts and
        utilities and the slots' rows and counts."""
        memory = super().memory_bytes()
        memory["index"] += self._row_chunks.nbytes + sum(
            v.shape.num_elements() * v.dtype.size
            for v in (self.utility, self.slot_rows, self.slot_chunks))
        return memory

    # ------------------------------------------------------------ checkpoints
    def _serialize_to_tensors(self):
        tensors = super()._serialize_to_tensors()
        tensors["chunks_per_row"] = tf.constant(self._row_chunks.astype(np.int32))
        return tensors

    def _restore(self, saved: dict, source: str) -> None:
        counts = saved["chunks_per_row"]
        utility = saved.get("utility")   # a TF checkpoint holds it as the variable
        if counts.shape != (self.rows,) or (utility is not None
                                            and utility.shape != (self.rows,)):
            raise ValueError(f"ChunkedCachedTable {self.name!r}: {source} holds chunk "
                             f"counts of shape {list(counts.shape)}"
                             + ("" if utility is None else
                                f" and utilities of shape {list(utility.shape)}")
                             + f"; this table has {self.rows} rows")
        counts = self._checked_counts(counts)
        super()._restore(saved, source)
        self._row_chunks[:] = counts
        if utility is not None:
            self.utility.assign(utility)

    def _state_arrays(self) -> dict:
        return dict(super()._state_arrays(), chunks_per_row=self._row_chunks.astype(np.int32),
                    utility=self.utility.numpy())
