"""What a checkpoint holds of a ``DistributedEmbedding``: tables and their optimizer state
under names that do not depend on the mesh, through TensorFlow's own checkpoints.

Every Keras and TensorFlow path (``model.save_weights`` / ``load_weights``,
``tf.train.Checkpoint`` + ``CheckpointManager``, ``ModelCheckpoint``,
``BackupAndRestore``) walks the object graph and asks each object for its state; this
module answers for the layer and for the optimizer:

- **Tables.** The layer's checkpoint children are replaced by one node, ``tables``,
  whose attribute ``table_<t>`` is table t as ONE tensor of its full shape
  ``[rows, dim]``. Each rank offers the rectangles it holds (its shards, or the whole of
  a data-parallel table) as slices of that tensor; the writer
  (``tfhybrid/_checkpoint_writer.py``) writes every slice once. Restoring asks for the
  rectangles of the CURRENT plan, and TensorFlow's reader assembles each from the saved
  slices that overlap it, so a checkpoint restores onto any mesh and any plan. Names
  depend on the table's index in the layer (checked by shape), not on Keras' per-process
  layer names. The per-shard variables are not checkpoint children: their names and
  number depend on the mesh.
- **FIITED tables** (``dims="adaptive"``) are saved compactly: only their present
  chunks, whose shape depends on the saved layout. So a restore must know that layout
  before it asks for slices: ``_install_restore_hook`` makes the path of the checkpoint
  being restored known while TensorFlow gathers what each object restores, and the
  table reads the saved chunk counts from it first (``_ChunkedTableSaveable``).
- **Optimizer slots of tables.** Keras optimizers track their slots by position in a
  list, and both the positions and the shapes of table slots depend on the mesh.
  ``attach_optimizer`` (called by ``tfhybrid.DistributedOptimizer``) takes them out of
  the optimizer's lists (the views below keep every other entry, numbered as before
  minus the table slots, which is the same on every mesh) and adds the child
  ``tfhybrid_table_slots``: per ``DistributedEmbedding`` (``layer_<k>``, k its order
  among the optimizer's layers) the attribute ``table_<t>_<slot>``, a full-table tensor
  like the tables. A row-wise slot (``[rows]``, row-wise AdaGrad) is stored broadcast
  over its shard's columns and read back as the mean over the new shard's columns
  (``tfhybrid._resharding.rowwise_weights``).
- **Restore before build.** ``BackupAndRestore`` and ``load_weights`` may restore before
  the optimizer has slots (or a subclassed model its layer). TensorFlow then defers the
  missing children, as it does for Keras' own lists; the layer (``register_layer``, at
  the end of its build) and the optimizer (its ``build``, wrapped by
  ``attach_optimizer``) hand the deferred restorations their new objects, before the
  first step uses them.
"""

from __future__ import annotations

import contextvars
import re
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import restore as restore_lib
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.trackable import data_structures
from tensorflow.python.training.saving import saveable_object

from tfhybrid import _checkpoint_writer
from tfhybrid import _resharding
from tfhybrid import _tf_internals
from tfhybrid import distributed
from tfhybrid import fiited
from tfhybrid import tiers
from tfhybrid.optimizers import ROW_STATE_SLOT
from tfhybrid.plan.types import Kind

# The layer's and the optimizer's checkpoint children (part of the checkpoint format).
TABLES_CHILD = "tables"
SLOTS_CHILD = "tfhybrid_table_slots"

# Built layers, so that an optimizer can tell which of its slots belong to tables.
_LAYERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
# optimizer -> its _OptimizerState (weak: the state dies with its optimizer)
_STATES: "weakref.WeakKeyDictionary[Any, _OptimizerState]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------ slices
class _Piece(NamedTuple):
    """One rectangle of a full-table tensor that this rank holds."""
    rect: _resharding.Rect
    dtype: tf.DType
    device: str
    read: Callable[[], tf.Tensor]          # the rectangle's values, [rows, cols]
    assign: Callable[[tf.Tensor], Any]     # writes restored [rows, cols] values back


class _FullTensorSaveable(saveable_object.SaveableObject):
    """The pieces this rank holds of one full-table tensor (possibly none).

    A legacy ``SaveableObject``, because TensorFlow 2.15 pairs restored slices with the
    wrong names when one ``_serialize_to_tensors`` name has several slices; this restores
    each slice to its own piece.
    """

    def __init__(self, name: str, full_shape: tuple[int, int], pieces: list[_Piece]):
        self._pieces = pieces
        specs = [_checkpoint_writer.PieceSpec(
            p.read, _resharding.slice_spec(full_shape, p.rect), name, p.dtype, p.device,
            p.rect.shape) for p in pieces]
        super().__init__(None, specs, name)

    @property
    def device(self) -> str:
        # a rank may hold no piece of a table; the base class would read specs[0]
        return self.specs[0].device if self.specs else "/cpu:0"

    def restore(self, restored_tensors, restored_shapes):
        del restored_shapes  # every slice was read in the shape of its piece
        return tf.group([piece.assign(value)
                         for piece, value in zip(self._pieces, restored_tensors)])


def _factory(full_shape: tuple[int, int], pieces: list[_Piece]) -> Callable:
    return lambda name: _FullTensorSaveable(name, full_shape, pieces)


def _write_rows(variable: tf.Variable, value: tf.Tensor) -> Any:
    # scatter_update writes in place; assign would make a second copy of a big table
    rows = tf.shape(value, out_type=tf.int64)[0]
    return variable.scatter_update(tf.IndexedSlices(tf.cast(value, variable.dtype),
                                                    tf.range(rows)))


def _variable_piece(rect: _resharding.Rect, variable: tf.Variable) -> _Piece:
    cached = tiers.table_of(variable)
    if cached is not None:
        # a tiered shard's variable is its cache: the piece is the whole shard, in row
        # order, from its file and cache
        return _Piece(rect, tf.float32, "/cpu:0", cached.whole, cached.assign_whole)
    return _Piece(rect, variable.dtype, variable.device, variable.read_value,
                  lambda value: _write_rows(variable, value))


def _slot_piece(rect: _resharding.Rect, slot: tf.Variable) -> _Piece:
    """A slot as a rectangle of its table: row-wise slots broadcast over the columns."""
    cached = tiers.accumulator_table_of(slot)
    if cached is None and _resharding.slot_layout(slot.shape.as_list(), rect) == "full":
        return _variable_piece(rect, slot)
    rows, cols = rect.shape
    if cached is not None:   # a tiered shard's row state, in row order
        read_rows = lambda: cached.whole(accumulator=True)  # noqa: E731
        write_rows = lambda value: cached.assign_whole(value, accumulator=True)  # noqa: E731
    else:
        read_rows = slot.read_value
        write_rows = lambda value: _write_rows(slot, value)  # noqa: E731

    def read() -> tf.Tensor:
        return tf.broadcast_to(read_rows()[:, None], [rows, cols])

    def assign(value: tf.Tensor) -> Any:
        # the mean over this shard's columns: each saved column slice counts with the
        # columns it shares with this shard (see _resharding.rowwise_weights)
        return write_rows(tf.reduce_mean(tf.cast(value, tf.float64), axis=1))

    return _Piece(rect, slot.dtype, "/cpu:0" if cached is not None else slot.device, read,
                  assign)


# ------------------------------------------------------------------ the layer
def _held(layer: Any) -> list[list[tuple[_resharding.Rect, tf.Variable]]]:
    """Per table, the (rectangle, variable) pairs this rank holds under the layer's plan."""
    position = layer._mesh.model_position
    held = []
    for t, placement in enumerate(layer.plan.tables):
        pieces = _resharding.held_pieces(placement.kind, placement.shards, position)
        held.append([(rect, layer._table_vars[t] if placement.kind == Kind.DATA_PARALLEL
                      else layer._shard_vars[(t, s)]) for s, rect in pieces])
    return held


class _LayerTables(trackable_base.Trackable):
    """The ``tables`` node of a built layer: one full-table attribute per table."""

    def __init__(self, layer: Any):
        self._layer = weakref.ref(layer)

    def _gather_saveables_for_checkpoint(self) -> dict:
        layer = self._layer()
        if layer is None:
            return {}
        return {f"table_{t}": (_chunked_factory(layer, t, pieces) if table.chunks else
                               _factory((table.rows, table.dim),
                                        [_variable_piece(rect, var) for rect, var in pieces]))
                for t, (table, pieces) in enumerate(zip(layer._tables, _held(layer)))}


# the keys of a FIITED table's layout and utility, after its values' key
COUNTS_SUFFIX, UTILITY_SUFFIX = "_chunk_counts", "_utility"

# The checkpoint a restore is reading, while TensorFlow gathers the objects to restore:
# a FIITED table's compact values have a shape that only the saved layout tells.
_RESTORING: "contextvars.ContextVar[str | None]" = contextvars.ContextVar(
    "tfhybrid_restoring", default=None)


def _install_restore_hook() -> None:
    """Makes the path of the checkpoint being restored known while TensorFlow asks the
    objects what they restore (every restore path, eager or deferred, asks there)."""
    original = restore_lib.CheckpointPosition.gather_ops_or_named_saveables
    if getattr(original, "_tfhybrid_hook", False):
        return

    def gather_ops_or_named_saveables(position):
        token = _RESTORING.set(position.checkpoint.save_path_string)
        try:
            return original(position)
        finally:
            _RESTORING.reset(token)

    gather_ops_or_named_saveables._tfhybrid_hook = True
    restore_lib.CheckpointPosition.gather_ops_or_named_saveables = \
        gather_ops_or_named_saveables


def _in_chunks(table: Any, rect: _resharding.Rect) -> _resharding.Rect:
    """``rect`` of a FIITED table in chunk columns (its slices hold whole chunks)."""
    return _resharding.Rect(rect.row_start, rect.row_end, rect.col_start // table.chunk_dim,
                            rect.col_end // table.chunk_dim)


class _CompactLayout(NamedTuple):
    """Where the rows of a FIITED table sit in its checkpoint's compact values tensor.

    The tensor is ``[present chunks, chunk_dim]``, chunk-major: chunk 0 of every row that
    holds it (rows in order), then chunk 1, ... So any shard's part of one chunk column
    (its rows that hold that chunk) is one contiguous run of rows, whatever the mesh.

    >>> layout = _CompactLayout.of(np.array([2, 0, 1, 2]), 2)
    >>> layout.present, layout.runs(2, 4, 0, 2)   # rows 2..3, chunks 0..1: (chunk, start, n)
    (5, [(0, 1, 2), (1, 4, 1)])
    """
    counts: np.ndarray      # [rows] chunks each row holds
    starts: np.ndarray      # [chunks] first row of each chunk column in the tensor
    present: int            # the tensor's rows

    @staticmethod
    def of(counts: np.ndarray, chunks: int) -> "_CompactLayout":
        counts = np.asarray(counts, np.int64)
        holding = _rows_holding(counts, chunks)
        return _CompactLayout(counts, np.concatenate([[0], np.cumsum(holding)[:-1]]),
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


class _ChunkedTableSaveable(saveable_object.SaveableObject):
    """A FIITED table (``dims="adaptive"``) as three tensors that fit any mesh:

    - its values under the table's own key, compact: only the present chunks,
      ``[present chunks, chunk_dim]`` in :class:`_CompactLayout`'s order;
    - each row's chunk count, ``<key>_chunk_counts``: ``[rows]`` int32 (a row holds a
      prefix of its chunks);
    - its utility, ``<key>_utility``: ``[rows, chunks]``, each shard's row utility spread
      evenly over the chunk columns it holds, so a restore onto other column slices sums
      its columns and every row's total (what the adjustment plans by) is kept.

    Each rank offers its shards' parts: a run of the values tensor per chunk column, its
    rows of the counts (from the first column slice) and its rectangle of the utility.
    Where the runs lie depends on the whole table's layout: a save takes the layer's
    (``whole_counts``), a restore the checkpoint's (read before the values, through the
    path ``_RESTORING`` names). The pools are resized to that layout before the values
    land.
    """

    def __init__(self, name: str, table: Any, held: list, whole_counts: np.ndarray,
                 on_restore: Callable[[np.ndarray], None]):
        self._table, self._held, self._on_restore = table, held, on_restore
        restoring = _RESTORING.get()
        if restoring is not None:
            whole_counts = _saved_counts(restoring, name, table)
        self._layout = _CompactLayout.of(whole_counts, table.chunks)
        self._runs = []
        for rect, _ in held:
            chunk_rect = self._chunk_rect(rect)
            self._runs.append(self._layout.runs(chunk_rect.row_start, chunk_rect.row_end,
                                                chunk_rect.col_start, chunk_rect.col_end))
        values_shape = (self._layout.present, table.chunk_dim)
        by_chunk = (table.rows, table.chunks)
        specs = []

        def spec(read, full_shape, rect, suffix, dtype, device):
            specs.append(_checkpoint_writer.PieceSpec(
                read, _resharding.slice_spec(full_shape, rect), name + suffix, dtype,
                device, rect.shape if len(full_shape) == 2 else rect.shape[:1]))

        for (rect, chunked), runs in zip(held, self._runs):
            first = self._chunk_rect(rect).col_start
            for j, start, rows in runs:
                spec(self._column_reader(chunked, j - first, rows), values_shape,
                     _resharding.Rect(start, start + rows, 0, table.chunk_dim), "",
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

    def _chunk_rect(self, rect: _resharding.Rect) -> _resharding.Rect:
        return _in_chunks(self._table, rect)

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


def _chunked_factory(layer: Any, t: int, pieces: list) -> Callable:
    held = [(rect, fiited.table_of(var)) for rect, var in pieces]

    def record(counts: np.ndarray) -> None:
        layer._whole_chunk_counts[t] = counts.astype(layer._whole_chunk_counts[t].dtype)

    return lambda name: _ChunkedTableSaveable(name, layer._tables[t], held,
                                              layer._whole_chunk_counts[t], record)


def register_layer(layer: Any) -> None:
    """Called at the end of ``DistributedEmbedding.build``: the layer's tables become its
    checkpoint node, and a restore that ran before the build gets them now."""
    # from now on, saves that hold its shards are written by all ranks together
    _checkpoint_writer.install()
    _install_restore_hook()
    _LAYERS.add(layer)
    node = _LayerTables(layer)
    # set past Keras' __setattr__, which would track it as a child of its own
    object.__setattr__(layer, "_tfhybrid_tables", node)
    layer._handle_deferred_dependencies(TABLES_CHILD, node)


def layer_children(layer: Any, children: dict, save_type: Any) -> dict:
    """``DistributedEmbedding._trackable_children``: in a checkpoint, only the tables.

    Everything else the layer tracks is mesh-dependent (shard variables and the dicts
    holding them) or holds no state (the Embedding layers that describe the tables).
    SavedModel export keeps Keras' children.
    """
    if save_type != trackable_base.SaveType.CHECKPOINT:
        return children
    node = layer.__dict__.get("_tfhybrid_tables")
    return {TABLES_CHILD: node} if node is not None else {}


# ----------------------------------------------------------- optimizer slots
def _owner(optimizer: Any, variable: tf.Variable) -> Any:
    """The optimizer that holds ``variable``'s slots (a loss scale's inner one; the
    embedding optimizer for tables when there is one)."""
    embedding_optimizer = getattr(optimizer, "embedding_optimizer", None)
    if embedding_optimizer is not None and distributed.is_embedding(variable):
        optimizer = embedding_optimizer
    return distributed.base_optimizer(optimizer)


def _variables_of(optimizer: Any) -> list:
    # new Keras optimizers: a (callable) list property; legacy ones: a method
    found = optimizer.variables
    return list(found() if callable(found) and not isinstance(found, list) else found)


def _slots_of(optimizer: Any, variable: tf.Variable) -> dict[str, tf.Variable]:
    """``variable``'s optimizer slots by slot name ("m", "accumulator", ...)."""
    owner = _owner(optimizer, variable)
    if owner is None:
        return {}
    chunked, cached = fiited.table_of(variable), tiers.table_of(variable)
    if chunked is not None or cached is not None:
        # a FIITED pool's or tiered shard's only state is its rows' accumulator, which
        # the table holds
        state = chunked.accumulator if chunked is not None else cached.cache_accumulator
        return ({ROW_STATE_SLOT: state}
                if any(v is state for v in _variables_of(owner)) else {})
    if hasattr(owner, "get_slot_names"):   # legacy Keras optimizers
        slots = {}
        for name in owner.get_slot_names():
            try:
                slots[name] = owner.get_slot(variable, name)
            except KeyError:   # no slot for this variable (yet)
                pass
        return slots
    # new Keras optimizers: only variables they were built with (a name check alone
    # would take another model's layer of the same name for this one)
    if owner._var_key(variable) not in getattr(owner, "_index_dict", {}):
        return {}
    shared = variable._shared_name
    pattern = re.compile(r"(^|/)" + re.escape(shared) + r"(/|:|$)")
    slots = {}
    for slot in _variables_of(owner):
        name = slot.name.split(":")[0]
        match = pattern.search(name)
        if slot is variable or match is None:
            continue
        # "m/<var>" -> "m", "<var>/accumulator" -> "accumulator"; name scopes in front
        # ("Adam/m/<var>" when built inside apply_gradients) are dropped
        suffix = name[match.end():].strip("/")
        slot_name = suffix or name[:match.start()].strip("/").rsplit("/", 1)[-1]
        if slot_name in slots:
            raise ValueError(f"optimizer {type(owner).__name__} has two slots named "
                             f"{slot_name!r} for variable {variable.name!r}")
        slots[slot_name] = slot
    return slots


class _LayerSlots(trackable_base.Trackable):
    """One layer's table slots in one optimizer: ``table_<t>_<slot>`` per table."""

    def __init__(self, optimizer: Any, layer: Any):
        self._optimizer = weakref.ref(optimizer)
        self._layer = weakref.ref(layer)

    def _gather_saveables_for_checkpoint(self) -> dict:
        optimizer, layer = self._optimizer(), self._layer()
        if optimizer is None or layer is None:
            return {}
        # the anchor is on every rank, so its slot names are the same everywhere even
        # where a rank holds no shard of a table
        names = sorted(_slots_of(optimizer, layer._anchor))
        factories = {}
        for t, (table, pieces) in enumerate(zip(layer._tables, _held(layer))):
            # a FIITED pool's or tiered table's only state is its rows' accumulator
            # (_slots_of): a momentum-free SGD's "m", which carries nothing from step to
            # step, has no place there. Every rank knows which tables these are.
            table_names = ([n for n in names if n == ROW_STATE_SLOT]
                           if table.chunks or table.cache_rows else names)
            per_slot: dict[str, list[_Piece]] = {name: [] for name in table_names}
            # a FIITED table's row-wise slot is saved per chunk column (its column
            # slices hold whole chunks), not broadcast over every column
            full_shape = (table.rows, table.chunks) if table.chunks else (table.rows,
                                                                            table.dim)
            for rect, var in pieces:
                if table.chunks:
                    rect = _in_chunks(table, rect)
                slots = _slots_of(optimizer, var)
                if sorted(slots) != table_names:
                    raise ValueError(
                        f"the optimizer gives table {table.name!r} of layer "
                        f"{layer.name!r} the slots {sorted(slots)} but tfhybrid saves "
                        f"{table_names} for it (the layer's anchor has {names})")
                for name, slot in slots.items():
                    per_slot[name].append(_slot_piece(rect, slot))
            for name, slot_pieces in per_slot.items():
                factories[f"table_{t}_{name}"] = _factory(full_shape, slot_pieces)
        return factories


class _DerivedChildren(trackable_base.Trackable):
    """A checkpoint node whose children are computed (``_trackable_children``), so a
    lookup asks that, and a restore that ran before they existed reaches them later."""

    def _lookup_dependency(self, name, cached_dependencies=None):
        children = cached_dependencies or self._trackable_children()
        return children.get(name)

    def restore_deferred(self) -> None:
        for name, child in self._trackable_children().items():
            self._handle_deferred_dependencies(name, child)


class _WithoutTableSlots(_DerivedChildren):
    """An optimizer's tracked list, minus the slots of tables, numbered as a list.

    It stands in for the list in checkpoints: the other entries (iterations, the slots
    of dense variables) keep positions that are the same on every mesh.
    """

    def __init__(self, state: "_OptimizerState", source: Any):
        self._state = state
        self.source = source

    def entries(self) -> list:
        table_slots = self._state.table_slot_ids()
        return [v for v in self.source if id(v) not in table_slots]

    def _trackable_children(self, save_type=trackable_base.SaveType.CHECKPOINT, **kwargs):
        return {str(i): v for i, v in enumerate(self.entries())}



class _TableSlots(_DerivedChildren):
    """The optimizer's ``tfhybrid_table_slots`` node: ``layer_<k>`` per layer it holds
    table slots of, k in the order the optimizer holds them (the same on every mesh:
    every rank holds each layer's anchor)."""

    def __init__(self, state: "_OptimizerState"):
        self._state = state
        self._children: "weakref.WeakKeyDictionary[Any, _LayerSlots]" = \
            weakref.WeakKeyDictionary()

    def _trackable_children(self, save_type=trackable_base.SaveType.CHECKPOINT, **kwargs):
        optimizer = self._state.optimizer()
        if optimizer is None:
            return {}
        children = {}
        for k, layer in enumerate(self._state.layers()):
            if layer not in self._children:
                self._children[layer] = _LayerSlots(optimizer, layer)
            children[f"layer_{k}"] = self._children[layer]
        return children



class _OptimizerState:
    """What ``attach_optimizer`` keeps for one optimizer (and the ones inside it)."""

    def __init__(self, optimizer: Any):
        self.optimizer = weakref.ref(optimizer)
        self.slots_node = _TableSlots(self)
        # (optimizer, child name) -> its view; kept across builds, because restorations
        # that wait for entries are registered on the view
        self._views: dict[tuple[int, str], _WithoutTableSlots] = {}
        # the optimizers' variable counts when the views were last placed: Keras calls
        # build on every apply_gradients, and only a build that made slots matters
        self._built_counts: tuple[int, ...] | None = None

    def members(self) -> list:
        """The optimizer, the optimizers a loss scale wraps, and the embedding optimizer."""
        optimizer = self.optimizer()
        found, todo = [], [optimizer]
        while todo:
            current = todo.pop(0)
            if current is None or any(current is f for f in found):
                continue
            found.append(current)
            todo += [getattr(current, "inner_optimizer", None),
                     getattr(current, "embedding_optimizer", None)]
        return found

    def layers(self) -> list:
        """The built layers whose tables have slots here, in slot order."""
        optimizer = self.optimizer()
        order = []
        for layer in list(_LAYERS):
            slots = list(_slots_of(optimizer, layer._anchor).values())
            if slots:
                owner = _owner(optimizer, layer._anchor)
                position = next(i for i, v in enumerate(_variables_of(owner))
                                if v is slots[0])
                order.append((position, id(layer), layer))
        return [layer for _, _, layer in sorted(order)]

    def table_slot_ids(self) -> set[int]:
        optimizer = self.optimizer()
        ids = set()
        for layer in self.layers():
            for var in layer.weights:
                ids.update(id(s) for s in _slots_of(optimizer, var).values())
        return ids

    def install_views(self) -> None:
        """Puts a view in place of each list the optimizers track (Keras re-assigns
        some lists when it builds, so this runs again after every build)."""
        for member in self.members():
            # a cache of the children from before a build would hide the lists it made
            _tf_internals.forget_checkpoint_children(member)
            for name in list(member._trackable_children()):
                # the tracked list itself: the children may hold a copy of it
                child = member._lookup_dependency(name)
                if not isinstance(child, data_structures.ListWrapper):
                    continue
                view = self._views.setdefault((id(member), name),
                                              _WithoutTableSlots(self, child))
                view.source = child
                member._track_trackable(view, name=name, overwrite=True)
            _tf_internals.forget_checkpoint_children(member)

    def after_build(self) -> None:
        """Slots exist now: re-place the views, then restore what waited for them."""
        counts = tuple(len(_variables_of(m)) for m in self.members())
        if counts == self._built_counts:
            return
        self._built_counts = counts
        self.install_views()
        for member in self.members():
            children = member._trackable_children()
            for name in list(member._deferred_dependencies):
                if name in children:
                    member._handle_deferred_dependencies(name, children[name])
        for view in self._views.values():
            view.restore_deferred()
        self.slots_node.restore_deferred()


def attach_optimizer(optimizer: Any) -> None:
    """Makes ``optimizer``'s checkpoints hold the slots of ``DistributedEmbedding`` tables
    under mesh-independent names (see the module doc). Idempotent.

    ``tfhybrid.DistributedOptimizer`` calls it; so does ``DistributedGradientTape`` for
    the optimizer it is given.
    """
    if optimizer in _STATES:
        return
    state = _OptimizerState(optimizer)
    _STATES[optimizer] = state
    optimizer._track_trackable(state.slots_node, name=SLOTS_CHILD, overwrite=True)
    state.install_views()
    for member in state.members():
        _after_build(member, state)


def _after_build(member: Any, state: _OptimizerState) -> None:
    """Wraps ``member.build`` so that restorations that waited for its slots reach them
    through the views (Keras builds inside the first ``apply_gradients``, before it steps).

    Keras creates some tracked lists in ``build``; TensorFlow would hand a restoration
    waiting for such a list to the new list itself, whose positions are mesh-dependent.
    So the waiting restorations are held back during the build and handed to the views.
    """
    # legacy Keras optimizers make their slots in _create_all_weights
    method = "_create_all_weights" if hasattr(member, "get_slot_names") else "build"
    own_build = getattr(member, method)

    def build(*args, **kwargs):
        waiting = dict(member._deferred_dependencies)
        member._deferred_dependencies.clear()
        try:
            return own_build(*args, **kwargs)
        finally:
            for name, positions in waiting.items():
                member._deferred_dependencies.setdefault(name, []).extend(positions)
            state.after_build()

    # an instance attribute, as distributed._route_optimizer wraps apply_gradients
    object.__setattr__(member, method, build)
