"""How a FIITED table is saved: compactly, in a layout that fits any mesh.

A FIITED table's kind (``dims="adaptive"``) answers for its saved layout here, as
``tfhybrid.sharding.stores`` registers it (:data:`COMPACT_CHUNKS`); the checkpoint and the
weights file ask it:

- **Checkpoints** hold only the present chunks, ``[present chunks, chunk_dim]`` in
  :class:`CompactLayout`'s order, with each row's chunk count and its utility. Their
  shape depends on the saved layout, so a restore reads the saved counts first, from the
  checkpoint the restore hook (``_tf_internals.install_restore_hook``) names.
- **Weights files** hold the table whole (as a dense table's), its rows' chunk counts
  ``[rows]`` and utilities ``[rows, chunks]``; a load sets the layout before the values.
- **Optimizer slots** of the table are saved per chunk column (its column slices hold
  whole chunks).

Example::

    import numpy as np
    from tfhybrid.fiited.saved import CompactLayout
    layout = CompactLayout.of(np.array([2, 0, 1]), chunks=2)
    assert layout.present == 3 and layout.starts.tolist() == [0, 2]
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import roles
from tfhybrid.checkpoint import resharding
from tfhybrid.checkpoint import writer


def in_chunks(table: Any, rect: resharding.Rect) -> resharding.Rect:
    """``rect`` of a FIITED table in chunk columns (its slices hold whole chunks)."""
    return resharding.Rect(rect.row_start, rect.row_end, rect.col_start // table.chunk_dim,
                           rect.col_end // table.chunk_dim)


# the keys of a FIITED table's layout and utility, after its values' key
COUNTS_SUFFIX, UTILITY_SUFFIX = "_chunk_counts", "_utility"


class CompactLayout(NamedTuple):
    """Where the rows of a FIITED table sit in its checkpoint's compact values tensor.

    The tensor is ``[present chunks, chunk_dim]``, chunk-major: chunk 0 of every row that
    holds it (rows in order), then chunk 1, ... So any shard's part of one chunk column
    (its rows that hold that chunk) is one contiguous run of rows, whatever the mesh.

    Example::

        import numpy as np
        from tfhybrid.fiited.saved import CompactLayout
        layout = CompactLayout.of(np.array([2, 0, 1, 2]), 2)
        # rows 2..3, chunks 0..1, as (chunk, first tensor row, rows)
        assert layout.present == 5 and layout.runs(2, 4, 0, 2) == [(0, 1, 2), (1, 4, 1)]
    """
    counts: np.ndarray      # [rows] chunks each row holds
    starts: np.ndarray      # [chunks] first row of each chunk column in the tensor
    present: int            # the tensor's rows

    @staticmethod
    def of(counts: np.ndarray, chunks: int) -> "CompactLayout":
        counts = np.asarray(counts, np.int64)
        holding = _rows_holding(counts, chunks)
        return CompactLayout(counts, np.concatenate([[0], np.cumsum(holding)[:-1]]),
                             int(holding.sum()))

    def runs(self, row_start: int, row_end: int, chunk_start: int, chunk_end: int
             ) -> list[tuple[int, int, int]]:
        """(chunk, first tensor row, rows) of rows [row_start, row_end) for each chunk in
        [chunk_start, chunk_end) that some of them hold."""
        chunks = len(self.starts)
        before = _rows_holding(self.counts[:row_start], chunks)
        inside = _rows_holding(self.counts[row_start:row_end], chunks)
        return [(j, int(self.starts[j] + before[j]), int(inside[j]))
                for j in range(chunk_start, chunk_end) if inside[j]]


def _rows_holding(counts: np.ndarray, chunks: int) -> np.ndarray:
    """[chunks]: how many of the rows with these chunk ``counts`` hold each chunk."""
    rows_with = np.bincount(counts, minlength=chunks + 1)       # rows per count
    return np.cumsum(rows_with[::-1])[::-1][1:]                 # rows with count > j


class _CompactSaveable(_tf_internals.SaveableObject):
    """A FIITED table (``dims="adaptive"``) as three tensors that fit any mesh:

    - its values under the table's own key, compact: only the present chunks,
      ``[present chunks, chunk_dim]`` in :class:`CompactLayout`'s order;
    - each row's chunk count, ``<key>_chunk_counts``: ``[rows]`` int32 (a row holds a
      prefix of its chunks);
    - its utility, ``<key>_utility``: ``[rows, chunks]``, each shard's row utility spread
      evenly over the chunk columns it holds, so a restore onto other column slices sums
      its columns and every row's total (what the adjustment plans by) is kept.

    Each rank offers its shards' parts: a run of the values tensor per chunk column, its
    rows of the counts (from the first column slice) and its rectangle of the utility.
    Where the runs lie depends on the whole table's layout: a save takes the layer's
    (``whole_counts``), a restore the checkpoint's (read before the values, through the
    path ``_tf_internals.restoring_path`` names). The pools are resized to that layout before the values
    land.
    """

    def __init__(self, name: str, table: Any, held: list, whole_counts: np.ndarray,
                 on_restore: Callable[[np.ndarray], None]):
        self._table, self._held, self._on_restore = table, held, on_restore
        restoring = _tf_internals.restoring_path()
        if restoring is not None:
            whole_counts = _saved_counts(restoring, name, table)
        self._layout = CompactLayout.of(whole_counts, table.chunks)
        self._runs = []
        for rect, _ in held:
            chunk_rect = self._chunk_rect(rect)
            self._runs.append(self._layout.runs(chunk_rect.row_start, chunk_rect.row_end,
                                                chunk_rect.col_start, chunk_rect.col_end))
        values_shape = (self._layout.present, table.chunk_dim)
        by_chunk = (table.rows, table.chunks)
        specs = []

        def spec(read, full_shape, rect, suffix, dtype, device):
            specs.append(writer.PieceSpec(
                read, resharding.slice_spec(full_shape, rect), name + suffix, dtype,
                device, rect.shape if len(full_shape) == 2 else rect.shape[:1]))

        for (rect, chunked), runs in zip(held, self._runs):
            first = self._chunk_rect(rect).col_start
            for j, start, rows in runs:
                spec(self._column_reader(chunked, j - first, rows), values_shape,
                     resharding.Rect(start, start + rows, 0, table.chunk_dim), "",
                     tf.float32, chunked.storage.device)
        for rect, chunked in held:
            if rect.col_start == 0:      # every row once: the first column slice's rows
                counts = self._layout.counts[rect.row_start:rect.row_end].astype(np.int32)
                spec(lambda counts=counts: tf.constant(counts), (table.rows,), rect,
                     COUNTS_SUFFIX, tf.int32, chunked.storage.device)
        for rect, chunked in held:
            spec(lambda chunked=chunked: tf.tile(
                     chunked.utility.read_value()[:, None] / chunked.chunks,
                     [1, chunked.chunks]),
                 by_chunk, self._chunk_rect(rect), UTILITY_SUFFIX, tf.float32,
                 chunked.storage.device)
        super().__init__(None, specs, name)

    def _chunk_rect(self, rect: resharding.Rect) -> resharding.Rect:
        return in_chunks(self._table, rect)

    @staticmethod
    def _column_reader(chunked: Any, chunk: int, rows: int) -> Callable[[], tf.Tensor]:
        def read() -> tf.Tensor:
            values = chunked.read_chunk_column(chunk)
            if values.shape[0] != rows:
                raise ValueError(f"FIITED table {chunked.name!r}: its pool holds chunk "
                                 f"{chunk} for {values.shape[0]} rows but the layer's "
                                 f"layout says {rows}; every rank must adjust alike")
            return values
        return read

    @property
    def device(self) -> str:
        return self.specs[0].device if self.specs else "/cpu:0"

    def restore(self, restored_tensors, restored_shapes):
        del restored_shapes
        if not tf.executing_eagerly():
            raise RuntimeError("a FIITED table is restored eagerly (its pool is resized)")
        values = iter(restored_tensors)
        columns = []
        for (rect, chunked), runs in zip(self._held, self._runs):
            chunk_rect = self._chunk_rect(rect)
            counts = self._layout.counts[rect.row_start:rect.row_end]
            chunked.resize(np.clip(counts - chunk_rect.col_start, 0, chunked.chunks))
            columns.append([(j - chunk_rect.col_start, next(values)) for j, _, _ in runs])
        # the counts were read before (they placed the values); skip their pieces
        for rect, _ in self._held:
            if rect.col_start == 0:
                next(values)
        for (_, chunked), chunk_values in zip(self._held, columns):
            for chunk, column in chunk_values:
                chunked.write_chunk_column(chunk, column)
            chunked.utility.assign(tf.reduce_sum(next(values), axis=1))
        self._on_restore(self._layout.counts)
        return tf.no_op()


def _saved_counts(path: str, name: str, table: Any) -> np.ndarray:
    """The chunk count of every row of ``table`` in the checkpoint at ``path``."""
    reader = tf.train.load_checkpoint(path)
    key = name + COUNTS_SUFFIX
    if not reader.has_tensor(key):
        raise ValueError(f"checkpoint {path!r} holds table {table.name!r} without a FIITED "
                         f"chunk layout ({key!r}): it was saved as a dense table, or by a "
                         "tfhybrid whose FIITED checkpoints were not compact; restore it "
                         "into a layer of the same kind")
    counts = reader.get_tensor(key)
    if counts.shape != (table.rows,) or counts.min(initial=0) < 0 or counts.max(
            initial=0) > table.chunks:
        raise ValueError(f"checkpoint {path!r}: {key!r} must be {table.rows} chunk counts in "
                         f"[0, {table.chunks}], got shape {counts.shape} with values in "
                         f"[{counts.min(initial=0)}, {counts.max(initial=0)}]")
    # (an all-pruned table saved no values)
    saved = reader.get_variable_to_shape_map().get(name, [int(counts.sum()), table.chunk_dim])
    if list(saved) != [int(counts.sum()), table.chunk_dim]:
        raise ValueError(f"checkpoint {path!r} holds table {table.name!r} as {list(saved)} "
                         f"present chunks; its layout and {table.chunks} chunks of "
                         f"{table.chunk_dim} columns need [{int(counts.sum())}, "
                         f"{table.chunk_dim}]")
    return counts.astype(np.int64)


def _held_tables(held: list) -> list[tuple[resharding.Rect, Any]]:
    """(rect, the FIITED table whose pool or cache the variable is) of held pieces."""
    return [(rect, roles.role_of(variable).table) for rect, variable in held]


class CompactChunks:
    """The saved layout of a FIITED table (module docstring). ``held``: the (rect,
    variable) pairs of the table this rank holds (``checkpoint.pieces.layer_pieces``).

    Example::

        from tfhybrid.fiited.saved import COMPACT_CHUNKS
        assert COMPACT_CHUNKS.weights_file_keys(2) == ["table_2_chunk_counts",
                                                       "table_2_utility"]
    """

    # its row-wise slots are saved as the optimizer's, per chunk column
    saves_row_state = False

    def checkpoint_saveable(self, layer: Any, t: int, held: list) -> Callable:
        """A saveable factory (``_gather_saveables_for_checkpoint``) of table ``t``."""
        tables = _held_tables(held)

        def record(counts: np.ndarray) -> None:
            layer.whole_chunk_counts[t] = counts.astype(layer.whole_chunk_counts[t].dtype)

        return lambda name: _CompactSaveable(name, layer.table_specs[t], tables,
                                             layer.whole_chunk_counts[t], record)

    @staticmethod
    def weights_file_keys(t: int) -> list[str]:
        """The keys a weights file holds for table ``t`` besides ``table_<t>``."""
        return [f"table_{t}{suffix}" for suffix in (COUNTS_SUFFIX, UTILITY_SUFFIX)]

    def save_to_weights_file(self, layer: Any, t: int, held: list, store: Any,
                             contributes: bool,
                             all_sum: Callable[[np.ndarray, str], np.ndarray]) -> None:
        """Writes table ``t``'s chunk counts and utilities (each shard's spread over its
        chunk columns, as a checkpoint holds them) to the weights-file ``store``;
        ``contributes``: this rank adds its pieces (each once over the replicas);
        ``all_sum`` sums an array over every rank (a collective)."""
        spec = layer.table_specs[t]
        utility = np.zeros([spec.rows, spec.chunks], np.float32)
        if contributes:
            for rect, chunked in _held_tables(held):
                cols = in_chunks(spec, rect)
                utility[cols.row_start:cols.row_end, cols.col_start:cols.col_end] = \
                    chunked.utility.numpy()[:, None] / chunked.chunks
        utility = all_sum(utility, f"tfhybrid_weights_file_utility_{t}")
        store[f"table_{t}{COUNTS_SUFFIX}"] = np.asarray(layer.whole_chunk_counts[t], np.int32)
        store[f"table_{t}{UTILITY_SUFFIX}"] = utility

    def load_layout_from_weights_file(self, layer: Any, t: int, held: list,
                                      store: Any) -> None:
        """Before the values: resizes the held pools to the file's chunk counts."""
        spec = layer.table_specs[t]
        counts = np.asarray(store[f"table_{t}{COUNTS_SUFFIX}"])
        utility = np.asarray(store[f"table_{t}{UTILITY_SUFFIX}"])
        if (counts.shape != (spec.rows,) or counts.min(initial=0) < 0
                or counts.max(initial=0) > spec.chunks
                or utility.shape != (spec.rows, spec.chunks)):
            raise ValueError(
                f"the weights file holds FIITED table {spec.name!r} as chunk counts of "
                f"shape {counts.shape} in [{counts.min(initial=0)}, "
                f"{counts.max(initial=0)}] and utilities of shape {utility.shape}; it "
                f"needs {spec.rows} counts in [0, {spec.chunks}] and [{spec.rows}, "
                f"{spec.chunks}] utilities")
        for rect, chunked in _held_tables(held):
            cols = in_chunks(spec, rect)
            chunked.resize(np.clip(counts[cols.row_start:cols.row_end] - cols.col_start,
                                   0, chunked.chunks))
        layer.whole_chunk_counts[t] = counts.astype(layer.whole_chunk_counts[t].dtype)

    def load_state_from_weights_file(self, layer: Any, t: int, held: list,
                                     store: Any) -> None:
        """After the values: the held rows' utilities."""
        spec = layer.table_specs[t]
        utility = np.asarray(store[f"table_{t}{UTILITY_SUFFIX}"])
        for rect, chunked in _held_tables(held):
            cols = in_chunks(spec, rect)
            chunked.utility.assign(utility[cols.row_start:cols.row_end,
                                           cols.col_start:cols.col_end].sum(axis=1))

    @staticmethod
    def slot_shape(spec: Any) -> tuple[int, int]:
        """The full shape of a row-wise optimizer slot of the table: per chunk column."""
        return (spec.rows, spec.chunks)

    @staticmethod
    def slot_rect(spec: Any, rect: resharding.Rect) -> resharding.Rect:
        """``rect`` of the table in its slot's chunk columns."""
        return in_chunks(spec, rect)


# the one instance the storage kinds register
COMPACT_CHUNKS = CompactChunks()
