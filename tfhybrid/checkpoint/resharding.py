"""Resharding math for checkpoints of sharded tables: pure Python, no TensorFlow.

A checkpoint stores every table (and every optimizer slot of a table) as ONE tensor of
the table's full shape ``[rows, dim]``, under a name that does not mention the mesh, cut
into *pieces*: rectangles of that tensor, each written once. Restoring onto any mesh asks
for the rectangles this rank holds under its own plan; the checkpoint reader assembles a
rectangle from whichever saved pieces overlap it (TensorFlow's partitioned-variable
format: a "shape and slice" spec per piece, one merged index).

This module decides the geometry:

- :func:`held_pieces`: the rectangles of a table a model position holds under a plan;
- :func:`slice_spec` / :func:`parse_slice_spec`: a rectangle as TensorFlow's spec string;
- :func:`assign_writers`: which rank writes which piece (each distinct piece once, by
  the lowest rank that holds it, so replicas never write twice);
- :func:`check_tiling`: the written pieces of a tensor cover it exactly once;
- :func:`reads`: which part of which saved piece fills which part of a target rectangle
  (what the reader does; here so it can be tested and explained);
- :func:`slot_layout` and :func:`rowwise_weights`: a row-wise optimizer slot (one value
  per row of a shard, e.g. row-wise AdaGrad's accumulator) is stored as its value
  broadcast over the shard's columns, so a new column split reads the columns it covers
  and takes their mean: exact when the split is unchanged or slices merge, the
  column-count weighted mean of the old slices otherwise.

>>> plan_rect = Rect(0, 50, 0, 8)
>>> slice_spec((100, 8), plan_rect)
'100 8 0,50:0,8'
>>> parse_slice_spec('100 8 0,50:0,8') == ((100, 8), plan_rect)
True
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Iterable, Sequence

from tfhybrid.plan.types import Kind

__all__ = ["Rect", "held_pieces", "slice_spec", "parse_slice_spec", "assign_writers",
           "check_tiling", "reads", "slot_layout", "rowwise_weights"]


@dataclasses.dataclass(frozen=True, order=True)
class Rect:
    """Rows [row_start, row_end) x columns [col_start, col_end) of a table.

    >>> Rect(0, 4, 2, 8).shape
    (4, 6)
    >>> Rect(0, 4, 0, 4).intersection(Rect(2, 6, 2, 8))
    Rect(row_start=2, row_end=4, col_start=2, col_end=4)
    """

    row_start: int
    row_end: int
    col_start: int
    col_end: int

    def __post_init__(self) -> None:
        values = (self.row_start, self.row_end, self.col_start, self.col_end)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values) or not (
                0 <= self.row_start <= self.row_end and 0 <= self.col_start <= self.col_end):
            raise ValueError(f"Rect{values} must be ints with 0 <= start <= end")

    @property
    def shape(self) -> tuple[int, int]:
        return self.row_end - self.row_start, self.col_end - self.col_start

    @property
    def size(self) -> int:
        rows, cols = self.shape
        return rows * cols

    def intersection(self, other: "Rect") -> "Rect | None":
        """The common rectangle, or None when they share no element."""
        r0, r1 = max(self.row_start, other.row_start), min(self.row_end, other.row_end)
        c0, c1 = max(self.col_start, other.col_start), min(self.col_end, other.col_end)
        return Rect(r0, r1, c0, c1) if r0 < r1 and c0 < c1 else None

    def relative_to(self, outer: "Rect") -> "Rect":
        """This rectangle in the coordinates of ``outer``, which must contain it."""
        if outer.intersection(self) != self:
            raise ValueError(f"{self} is not inside {outer}")
        return Rect(self.row_start - outer.row_start, self.row_end - outer.row_start,
                    self.col_start - outer.col_start, self.col_end - outer.col_start)


def held_pieces(kind: str, shards: Sequence, position: int) -> list[tuple[int, Rect]]:
    """(shard index, rectangle) of every part of one table that ``position`` holds.

    ``kind`` and ``shards`` are a ``tfhybrid.plan.TablePlacement``'s; a data-parallel
    table is held whole by every position.

    >>> from tfhybrid.plan.types import Shard
    >>> held_pieces(Kind.ROW_WISE, [Shard("t", 0, 5, 0, 4, 0), Shard("t", 5, 10, 0, 4, 1)], 1)
    [(1, Rect(row_start=5, row_end=10, col_start=0, col_end=4))]
    """
    def rect(shard) -> Rect:
        return Rect(shard.row_start, shard.row_end, shard.col_start, shard.col_end)

    if kind == Kind.DATA_PARALLEL:
        return [(0, rect(shards[0]))]
    return [(s, rect(shard)) for s, shard in enumerate(shards) if shard.owner == position]


def slice_spec(full_shape: Sequence[int], rect: Rect) -> str:
    """TensorFlow's "shape and slice" string of ``rect`` in a tensor of ``full_shape``.

    A 1-D ``full_shape`` ([rows]) takes the rectangle's rows.

    >>> slice_spec([10], Rect(2, 5, 0, 1))
    '10 2,3'
    """
    full_shape = [int(d) for d in full_shape]
    if len(full_shape) == 1:
        if rect.row_end > full_shape[0]:
            raise ValueError(f"{rect} does not fit in shape {full_shape}")
        return f"{full_shape[0]} {rect.row_start},{rect.row_end - rect.row_start}"
    if len(full_shape) != 2:
        raise ValueError(f"full_shape={full_shape} must be [rows] or [rows, dim]")
    if rect.row_end > full_shape[0] or rect.col_end > full_shape[1]:
        raise ValueError(f"{rect} does not fit in shape {full_shape}")
    rows, cols = rect.shape
    return (f"{full_shape[0]} {full_shape[1]} "
            f"{rect.row_start},{rows}:{rect.col_start},{cols}")


def parse_slice_spec(spec: str) -> tuple[tuple[int, ...], Rect]:
    """The inverse of :func:`slice_spec`: (full shape, rectangle)."""
    parts = spec.split(" ")
    try:
        full_shape = tuple(int(d) for d in parts[:-1])
        extents = [tuple(int(x) for x in axis.split(",")) for axis in parts[-1].split(":")]
    except ValueError:
        raise ValueError(f"slice spec {spec!r} is not 'dims... start,length:...'") from None
    if len(full_shape) not in (1, 2) or len(extents) != len(full_shape) or any(
            len(e) != 2 for e in extents):
        raise ValueError(f"slice spec {spec!r} must describe a 1-D or 2-D slice")
    (r0, rows), (c0, cols) = extents[0], (extents[1] if len(extents) == 2 else (0, 1))
    return full_shape, Rect(r0, r0 + rows, c0, c0 + cols)


def assign_writers(pieces_by_rank: Sequence[Iterable[tuple[str, str, Hashable]]]
                   ) -> list[list[tuple[str, str]]]:
    """Which (key, spec) pieces each rank writes: every distinct piece once, by the
    lowest rank that holds it.

    ``pieces_by_rank[r]`` lists rank r's ``(key, slice spec, signature)``; the signature
    (dtype and shape, say) must agree wherever a piece appears twice, since the copies
    are meant to be equal. Returns one list per rank, in its own order.

    >>> assign_writers([[("a", "", "f4"), ("t", "4 2 0,2:0,2", "f4")],
    ...                 [("a", "", "f4"), ("t", "4 2 2,2:0,2", "f4")],
    ...                 [("a", "", "f4"), ("t", "4 2 0,2:0,2", "f4")]])
    [[('a', ''), ('t', '4 2 0,2:0,2')], [('t', '4 2 2,2:0,2')], []]
    """
    first: dict[tuple[str, str], tuple[int, Hashable]] = {}
    writes: list[list[tuple[str, str]]] = []
    for rank, pieces in enumerate(pieces_by_rank):
        mine = []
        for key, spec, signature in pieces:
            seen = first.get((key, spec))
            if seen is None:
                first[(key, spec)] = (rank, signature)
                mine.append((key, spec))
            elif seen[1] != signature:
                raise ValueError(
                    f"checkpoint tensor {key!r} (slice {spec!r}) is {seen[1]} on rank "
                    f"{seen[0]} but {signature} on rank {rank}; every rank must save the "
                    "same model")
        writes.append(mine)
    return writes


def check_tiling(key: str, full_shape: Sequence[int], rects: Iterable[Rect]) -> None:
    """Raises ``ValueError`` unless ``rects`` cover a tensor of ``full_shape`` exactly once.

    >>> check_tiling("t", [4, 2], [Rect(0, 2, 0, 2), Rect(2, 4, 0, 1), Rect(2, 4, 1, 2)])
    >>> check_tiling("t", [4, 2], [Rect(0, 3, 0, 2), Rect(2, 4, 0, 2)])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: checkpoint tensor 't' [4, 2]: pieces Rect(...) and Rect(...) overlap
    """
    full_shape = [int(d) for d in full_shape]
    rows, cols = full_shape[0], (full_shape[1] if len(full_shape) > 1 else 1)
    rects = sorted(rects)
    whole = Rect(0, rows, 0, cols)
    for rect in rects:
        if whole.intersection(rect) != rect:
            raise ValueError(f"checkpoint tensor {key!r} {full_shape}: piece {rect} lies "
                             "outside it")
    for i, a in enumerate(rects):
        for b in rects[i + 1:]:
            if a.intersection(b) is not None:
                raise ValueError(f"checkpoint tensor {key!r} {full_shape}: pieces {a} and "
                                 f"{b} overlap")
    covered = sum(r.size for r in rects)
    if covered != rows * cols:
        raise ValueError(f"checkpoint tensor {key!r} {full_shape}: its pieces cover "
                         f"{covered} of its {rows * cols} elements")


def reads(target: Rect, saved: Sequence[Rect]) -> list[tuple[int, Rect, Rect]]:
    """How saved pieces fill ``target``: ``(piece index, rectangle inside that piece,
    rectangle inside target)`` for every piece that overlaps it, in piece order.

    Raises ``ValueError`` when the pieces leave part of ``target`` uncovered.

    >>> for index, inside_piece, inside_target in reads(
    ...         Rect(2, 6, 0, 4), [Rect(0, 4, 0, 4), Rect(4, 8, 0, 4)]):
    ...     print(index, inside_piece.shape, inside_piece.row_start, inside_target.row_start)
    0 (2, 4) 2 0
    1 (2, 4) 0 2
    """
    out = []
    covered = 0
    for index, piece in enumerate(saved):
        common = piece.intersection(target)
        if common is None:
            continue
        out.append((index, common.relative_to(piece), common.relative_to(target)))
        covered += common.size
    if covered != target.size:
        raise ValueError(f"the saved pieces cover {covered} of the {target.size} elements "
                         f"of {target}")
    return out


def slot_layout(slot_shape: Sequence[int | None], rect: Rect) -> str:
    """``"full"`` for an optimizer slot shaped like its shard (``[rows, cols]``: Adam's
    moments, AdaGrad's accumulator), ``"rowwise"`` for one value per row (``[rows]``:
    row-wise AdaGrad). Raises ``ValueError`` for any other shape.

    >>> slot_layout([5, 4], Rect(0, 5, 0, 4)), slot_layout([5], Rect(0, 5, 0, 4))
    ('full', 'rowwise')
    """
    shape = tuple(slot_shape)
    if shape == rect.shape:
        return "full"
    if shape == rect.shape[:1]:
        return "rowwise"
    raise ValueError(f"an optimizer slot of shape {list(shape)} belongs to no shard of "
                     f"{list(rect.shape)}: it must be [rows, cols] or [rows]")


def rowwise_weights(target_cols: tuple[int, int], saved_cols: Sequence[tuple[int, int]]
                    ) -> list[float]:
    """The weight of each saved column slice's row-wise value in a new column slice.

    A row-wise slot stored broadcast over its columns and read back as the mean over the
    new slice's columns gives each old slice the share of the new slice's columns it
    covers. The weights sum to 1 when the old slices cover the new one.

    >>> rowwise_weights((0, 8), [(0, 4), (4, 8)])       # two slices merge
    [0.5, 0.5]
    >>> rowwise_weights((2, 5), [(0, 4), (4, 8)])       # a new split
    [0.6666666666666666, 0.3333333333333333]
    """
    c0, c1 = target_cols
    if not 0 <= c0 < c1:
        raise ValueError(f"target_cols={target_cols} must be a non-empty column range")
    return [max(0, min(b1, c1) - max(b0, c0)) / (c1 - c0) for b0, b1 in saved_cols]
