"""What a checkpoint holds of a ``DistributedEmbedding``: its tables, under names that do
not depend on the mesh, through TensorFlow's own checkpoints.

Every Keras and TensorFlow path (``model.save_weights`` / ``load_weights``,
``tf.train.Checkpoint`` + ``CheckpointManager``, ``ModelCheckpoint``,
``BackupAndRestore``) walks the object graph and asks each object for its state; this
module answers for the layer (``slots`` answers for the optimizer):

- **Tables.** The layer's checkpoint children are replaced by one node, ``tables``,
  whose attribute ``table_<t>`` is table t as ONE tensor of its full shape
  ``[rows, dim]``. Each rank offers the rectangles it holds (its shards, or the whole of
  a data-parallel table) as slices of that tensor (``pieces``); the writer
  (``tfhybrid/checkpoint/writer.py``) writes every slice once. Restoring asks for the
  rectangles of the CURRENT plan, and TensorFlow's reader assembles each from the saved
  slices that overlap it, so a checkpoint restores onto any mesh and any plan. Names
  depend on the table's index in the layer (checked by shape), not on Keras' per-process
  layer names. The per-shard variables are not checkpoint children: their names and
  number depend on the mesh.
- **FIITED tables** (``dims="adaptive"``) are saved compactly: only their present
  chunks, whose shape depends on the saved layout. So a restore must know that layout
  before it asks for slices: the restore hook (``_tf_internals.install_restore_hook``)
  makes the path of the checkpoint being restored known while TensorFlow gathers what
  each object restores, and the table reads the saved chunk counts from it first
  (``_ChunkedTableSaveable``).
- **Restore before build.** ``BackupAndRestore`` and ``load_weights`` may restore before
  a subclassed model has its layer. TensorFlow then defers the missing children, as it
  does for Keras' own lists; the layer (``register_layer``, at the end of its build)
  hands the deferred restorations its tables before the first step uses them.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import fiited
from tfhybrid.checkpoint import pieces
from tfhybrid.checkpoint import resharding
from tfhybrid.checkpoint import writer

# The layer's checkpoint child (part of the checkpoint format).
TABLES_CHILD = "tables"

# Built layers, so that an optimizer can tell which of its slots belong to tables.
# each built layer and its checkpoint node (held weakly: a dropped model leaves)
_NODES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------ the layer
class _LayerTables(_tf_internals.Trackable):
    """The ``tables`` node of a built layer: one full-table attribute per table."""

    def __init__(self, layer: Any):
        self._layer = weakref.ref(layer)

    def _gather_saveables_for_checkpoint(self) -> dict:
        layer = self._layer()
        if layer is None:
            return {}
        return {f"table_{t}": (
                    _chunked_factory(layer, t, held) if table.chunks else
                    pieces.full_tensor_factory((table.rows, table.dim),
                                               [pieces.variable_piece(rect, var)
                                                for rect, var in held]))
                for t, (table, held) in enumerate(zip(layer.table_specs,
                                                      pieces.layer_pieces(layer)))}


# the keys of a FIITED table's layout and utility, after its values' key
COUNTS_SUFFIX, UTILITY_SUFFIX = "_chunk_counts", "_utility"


class CompactLayout(NamedTuple):
    """Where the rows of a FIITED table sit in its checkpoint's compact values tensor.

    The tensor is ``[present chunks, chunk_dim]``, chunk-major: chunk 0 of every row that
    holds it (rows in order), then chunk 1, ... So any shard's part of one chunk column
    (its rows that hold that chunk) is one contiguous run of rows, whatever the mesh.

    >>> layout = CompactLayout.of(np.array([2, 0, 1, 2]), 2)
    >>> layout.present, layout.runs(2, 4, 0, 2)   # rows 2..3, chunks 0..1: (chunk, start, n)
    (5, [(0, 1, 2), (1, 4, 1)])
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


class _ChunkedTableSaveable(_tf_internals.SaveableObject):
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
        return pieces.in_chunks(self._table, rect)

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


def _chunked_factory(layer: Any, t: int, variables: list) -> Callable:
    held = [(rect, fiited.table_of(var)) for rect, var in variables]

    def record(counts: np.ndarray) -> None:
        layer.whole_chunk_counts[t] = counts.astype(layer.whole_chunk_counts[t].dtype)

    return lambda name: _ChunkedTableSaveable(name, layer.table_specs[t], held,
                                              layer.whole_chunk_counts[t], record)


def register_layer(layer: Any) -> None:
    """Called at the end of ``DistributedEmbedding.build``: the layer's tables become its
    checkpoint node, and a restore that ran before the build gets them now."""
    # from now on, saves that hold its shards are written by all ranks together, and a
    # restore names the checkpoint it reads (a FIITED table's saved shape depends on it)
    writer.install()
    _tf_internals.install_restore_hook()
    node = _LayerTables(layer)
    _NODES[layer] = node
    _tf_internals.restore_waiting_child(layer, TABLES_CHILD, node)


def layer_children(layer: Any, children: dict, save_type: Any) -> dict:
    """``DistributedEmbedding._trackable_children``: in a checkpoint, only the tables.

    Everything else the layer tracks is mesh-dependent (shard variables and the dicts
    holding them) or holds no state (the Embedding layers that describe the tables).
    SavedModel export keeps Keras' children.
    """
    if save_type != _tf_internals.SaveType.CHECKPOINT:
        return children
    node = _NODES.get(layer)
    return {TABLES_CHILD: node} if node is not None else {}


def built_layers() -> list:
    """The built ``DistributedEmbedding`` layers that are alive, in no particular order."""
    return list(_NODES)
