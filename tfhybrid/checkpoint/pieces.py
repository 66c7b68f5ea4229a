"""The rectangles of full-table tensors that a rank holds, as checkpoint saveables.

A checkpoint holds each ``DistributedEmbedding`` table, and each optimizer slot of a
table, as ONE tensor of the table's full shape; each rank offers the rectangles it holds
under the layer's current plan (its shards, or the whole of a data-parallel table) as
slices of it, and restores the rectangles of the current plan (``resharding``). The
layer's tables (``tables``) and the optimizer's slots (``slots``) are both made of these.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import roles
from tfhybrid.checkpoint import resharding
from tfhybrid.checkpoint import writer
from tfhybrid.plan.types import Kind


# ------------------------------------------------------------------ slices
class Piece(NamedTuple):
    """One rectangle of a full-table tensor that this rank holds."""
    rect: resharding.Rect
    dtype: tf.DType
    device: str
    read: Callable[[], tf.Tensor]          # the rectangle's values, [rows, cols]
    assign: Callable[[tf.Tensor], Any]     # writes restored [rows, cols] values back


class FullTensorSaveable(_tf_internals.SaveableObject):
    """The pieces this rank holds of one full-table tensor (possibly none).

    A legacy ``SaveableObject``, because TensorFlow 2.15 pairs restored slices with the
    wrong names when one ``_serialize_to_tensors`` name has several slices; this restores
    each slice to its own piece.
    """

    def __init__(self, name: str, full_shape: tuple[int, int], pieces: list[Piece]):
        self._pieces = pieces
        specs = [writer.PieceSpec(
            p.read, resharding.slice_spec(full_shape, p.rect), name, p.dtype, p.device,
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


def full_tensor_factory(full_shape: tuple[int, int], pieces: list[Piece]) -> Callable:
    """A saveable factory (``_gather_saveables_for_checkpoint``) of one full-table tensor."""
    return lambda name: FullTensorSaveable(name, full_shape, pieces)


def _write_rows(variable: tf.Variable, value: tf.Tensor) -> Any:
    # scatter_update writes in place; assign would make a second copy of a big table
    rows = tf.shape(value, out_type=tf.int64)[0]
    return variable.scatter_update(tf.IndexedSlices(tf.cast(value, variable.dtype),
                                                    tf.range(rows)))


def variable_piece(rect: resharding.Rect, variable: tf.Variable) -> Piece:
    """A table's variable (a shard, a whole table, or a slot of its shape) as ``rect``."""
    outside = roles.role_of(variable).rows_outside
    if outside is not None:
        # a variable whose rows live outside it (a tier's cache): the piece is the whole
        # shard, in row order, from its file and cache
        return Piece(rect, tf.float32, "/cpu:0", outside.whole, outside.assign_whole)
    variable = _tf_internals.tf_variable(variable)
    return Piece(rect, variable.dtype, variable.device, variable.read_value,
                 lambda value: _write_rows(variable, value))


def slot_piece(rect: resharding.Rect, slot: tf.Variable) -> Piece:
    """A slot as a rectangle of its table: row-wise slots broadcast over the columns."""
    slot = _tf_internals.tf_variable(slot)
    outside = roles.role_of(slot).state_outside
    if outside is None and resharding.slot_layout(slot.shape.as_list(), rect) == "full":
        return variable_piece(rect, slot)
    rows, cols = rect.shape
    if outside is not None:   # row state whose rows live outside it (a tier's), in order
        read_rows = lambda: outside.whole(accumulator=True)  # noqa: E731
        write_rows = lambda value: outside.assign_whole(value, accumulator=True)  # noqa: E731
    else:
        read_rows = slot.read_value
        write_rows = lambda value: _write_rows(slot, value)  # noqa: E731

    def read() -> tf.Tensor:
        return tf.broadcast_to(read_rows()[:, None], [rows, cols])

    def assign(value: tf.Tensor) -> Any:
        # the mean over this shard's columns: each saved column slice counts with the
        # columns it shares with this shard (see resharding.rowwise_weights)
        return write_rows(tf.reduce_mean(tf.cast(value, tf.float64), axis=1))

    return Piece(rect, slot.dtype, "/cpu:0" if outside is not None else slot.device, read,
                 assign)


def layer_pieces(layer: Any) -> list[list[tuple[resharding.Rect, tf.Variable]]]:
    """Per table, the (rectangle, variable) pairs this rank holds under the layer's plan."""
    position = layer.mesh.model_position
    held = []
    for t, placement in enumerate(layer.plan.tables):
        pieces = resharding.held_pieces(placement.kind, placement.shards, position)
        replicated = placement.kind == Kind.DATA_PARALLEL
        held.append([(rect, layer.stores.get(t, 0 if replicated else s).variable)
                     for s, rect in pieces])
    return held
