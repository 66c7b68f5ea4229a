"""Sharding planner for hybrid (2D) embedding training: pure data, no TensorFlow.

The mesh is D data-parallel replicas x model groups of M ranks.  A rank's *position*
p in [0, M) is its index inside its model group; every model-parallel shard lives on
one position of every model group (so it has D copies).  The planner only sees (D, M)
and returns a :class:`ShardingPlan` that can be printed, saved as JSON and unit-tested
without TensorFlow or Horovod (TorchRec style).  Option names follow NVIDIA
distributed-embeddings (DE) so its users can migrate; thresholds are in ELEMENTS (rows*dim).

Strategies (see :func:`plan_sharding` for the exact rules):

* ``"basic"``, ``"memory_balanced"``, ``"memory_optimized"`` place tables exactly as DE's
  ``DistEmbeddingStrategy`` does with the same names, DE's "workers" being the M
  positions of a model group: power-of-two column slices (automatic when there are
  fewer table-parallel tables than positions, so no position idles), DE's round robin /
  sorted two-way deal / greedy least-loaded on element counts, and slices of one table
  that land on one position merged into one shard.
* ``"bytes_balanced"`` (:data:`DEFAULT_STRATEGY`) is tfhybrid's own planner: ceil(size /
  threshold) column slices, never two slices of a table on one position, dealt by bytes
  (dtype and optimizer state included) in snake order; positions may stay empty.

Every strategy also fixes each position's *table order* (:meth:`ShardingPlan.tables_on`),
the order in which the layer serves that position's shards; see
:func:`table_ids_per_position` and :func:`input_ids_per_position` (DE's ``table_ids`` and
``input_ids_list``).

Byte model: the wire format of ``tfhybrid.layers.DistributedEmbedding``, per position p.
Symbols: b = local_batch_size, h = hotness (ids per sample, summed over the table's
features), f = features reading the table, act = dtype bytes of the table, w = shard
width, M = model group size, idb = 8 if any model-parallel table has >= 2**31 rows else 4
(the layer sends every id in one buffer). A step sends, per (feature, shard) route, a
header of L bag lengths and the ids, and gets back one row of w values per bag:
L = b*f bags when pooled, b*h when combiner is None (every id is its own bag).
Only model-parallel shards produce all-to-all traffic; data-parallel tables add 0 to both
traffic figures (their gradients go through the allreduce).

* table_wise / column_wise shard owned by o, n = b*h ids:
    - p != o: alltoall += (L + n)*idb + act*L*w      (header+ids out, activation grad back)
    - p == o: alltoall += (M-1)*act*L*w              (activations to the M-1 others)
              local    += (L + n)*idb + 2*act*L*w    (own ids, own activations, own grad)
* row_wise table with k shards (owners 0..k-1), each owner gets n = b*h/k ids (uniform
  ids) and returns a partial row per bag (L*w values, zeros where it holds no id):
    - per owner o != p: alltoall += (L + n)*idb + act*L*w
    - if p owns a shard: alltoall += (M-1)*act*L*w;  local += (L + n)*idb + 2*act*L*w
* lookup_bytes_per_sample (per local sample): for each shard p owns, table_wise /
  column_wise M*h*w*act, row_wise M*(h/k)*w*act; plus h*dim*act per data_parallel table.
* param_bytes = elements*act; optimizer_bytes: sgd 0, adagrad elements*4,
  rowwise_adagrad shard_rows*4; data_parallel tables count on every position.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
COMBINERS = (None, "sum", "mean")
# DE's names with DE's placement, then tfhybrid's own planner
DE_STRATEGIES = ("basic", "memory_balanced", "memory_optimized")
STRATEGIES = DE_STRATEGIES + ("bytes_balanced",)
DEFAULT_STRATEGY = "bytes_balanced"
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
KINDS = ("data_parallel", "table_wise", "column_wise", "row_wise")

__all__ = ["TableConfig", "Shard", "TablePlacement", "RankEstimate", "ShardingPlan",
           "plan_sharding", "sync_is_sparse", "sync_bytes", "input_ids_per_position",
           "table_ids_per_position", "DTYPE_BYTES", "COMBINERS", "STRATEGIES",
           "DE_STRATEGIES", "DEFAULT_STRATEGY", "OPTIMIZERS", "KINDS"]


def _check_int(what: str, value: Any, minimum: int) -> None:
    # bool is an int subclass; True as a row count is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")


def _check_threshold(what: str, value: Any) -> None:
    if value is not None:
        _check_int(what, value, 1)


@dataclass(frozen=True)
class TableConfig:
    """One embedding table to shard; validated on construction.

    >>> TableConfig("user", rows=1000, dim=16, hotness=2.0).rows * 16
    16000
    """

    name: str
    rows: int
    dim: int
    dtype: str = "float32"
    hotness: float = 1.0
    combiner: str | None = "sum"
    features: int = 1   # input features that read this table (input_table_map)

    def __post_init__(self) -> None:
        _check_int(f"features of table {getattr(self, 'name', '?')!r}", self.features, 1)
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"table name must be a non-empty str, got {self.name!r}")
        _check_int(f"rows of table {self.name!r}", self.rows, 1)
        _check_int(f"dim of table {self.name!r}", self.dim, 1)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype of table {self.name!r} must be one of "
                             f"{sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        h = self.hotness
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not (0 < h < math.inf):
            raise ValueError(f"hotness of table {self.name!r} must be a finite number > 0, "
                             f"got {h!r}")
        if self.combiner not in COMBINERS:
            raise ValueError(f"combiner of table {self.name!r} must be one of {COMBINERS}, "
                             f"got {self.combiner!r}")


@dataclass(frozen=True)
class Shard:
    """A rectangle [row_start, row_end) x [col_start, col_end) of one table.

    ``owner`` is the position in the model group, None for data_parallel tables.

    >>> s = Shard("user", 0, 500, 0, 16, owner=1)
    >>> (s.row_end - s.row_start) * (s.col_end - s.col_start)
    8000
    """

    table: str
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    owner: int | None


@dataclass(frozen=True)
class TablePlacement:
    """How one table is split: its kind and its shards.

    >>> TablePlacement("t", "table_wise", (Shard("t", 0, 10, 0, 4, 0),)).shards[0].owner
    0
    """

    name: str
    kind: str
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class RankEstimate:
    """Estimated memory and traffic of one position (see the module docstring formulas).

    ``alltoall_bytes_per_step`` is what the rank SENDS on the wire per step (forward +
    backward); ``local_bytes_per_step`` is its own share that never leaves the rank.

    >>> RankEstimate(0, 1024, 0, 64.0, 160.0, 288.0).param_bytes
    1024
    """

    position: int
    param_bytes: int
    optimizer_bytes: int
    lookup_bytes_per_sample: float
    alltoall_bytes_per_step: float
    local_bytes_per_step: float
    # embedding-gradient sync this rank sends per step (see ``sync_bytes``); the dense
    # layers' allreduce is not the planner's to know and comes on top
    sync_bytes_per_step: float = 0.0


def _human(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.rjust(widths[i]) if i in right else c.ljust(widths[i])
                      for i, c in enumerate(r)).rstrip() for r in [header, *rows]]


@dataclass(frozen=True)
class ShardingPlan:
    """The result of :func:`plan_sharding`: plain data, JSON round-trippable.

    ``position_tables[p]`` lists the indices (into ``tables``) of the model-parallel
    tables with a shard on position p, in that position's order (see
    :meth:`tables_on`); each table at most once per position.  An empty tuple (a plan
    serialized before the field existed) means table order.

    >>> plan = plan_sharding([TableConfig("a", 100, 8), TableConfig("b", 50, 8)], 2, 2)
    >>> [s.table for s in plan.shards_on(0)], plan.table("b").kind
    (['a'], 'table_wise')
    >>> ShardingPlan.from_json(plan.to_json()) == plan
    True
    """

    data_parallel: int
    model_parallel: int
    strategy: str
    tables: tuple[TablePlacement, ...]
    ranks: tuple[RankEstimate, ...]
    column_slice_threshold: int | None
    row_slice_threshold: int | None
    data_parallel_threshold: int | None
    local_batch_size: int
    position_tables: tuple[tuple[int, ...], ...] = ()

    def table(self, name: str) -> TablePlacement:
        """The placement of table ``name``; ValueError if unknown."""
        for placement in self.tables:
            if placement.name == name:
                return placement
        raise ValueError(f"no table named {name!r} in this plan")

    def _check_position(self, position: int) -> None:
        _check_int("position", position, 0)
        if position >= self.model_parallel:
            raise ValueError(f"position must be < model_parallel={self.model_parallel}, "
                             f"got {position}")

    def tables_on(self, position: int) -> list[int]:
        """Indices of the tables with a model-parallel shard on ``position``, in its order.

        DE strategies: DE's ``table_ids`` order for table-wise and column-sliced tables
        (the order the strategy dealt them to this position, a table counted at its first
        slice here), then row-wise tables in table order. ``bytes_balanced``: table order.
        """
        self._check_position(position)
        if self.position_tables:
            return list(self.position_tables[position])
        return [t for t, pl in enumerate(self.tables)
                if any(s.owner == position for s in pl.shards)]

    def shards_on(self, position: int) -> list[Shard]:
        """Model-parallel shards owned by ``position``, in :meth:`tables_on` order.

        A table has one shard per position, except in a hand-built plan (then col, row).
        """
        out = []
        for t in self.tables_on(position):
            mine = [s for s in self.tables[t].shards if s.owner == position]
            out.extend(sorted(mine, key=lambda s: (s.col_start, s.row_start)))
        return out

    def to_json(self, indent: int | None = None) -> str:
        """Serialize; ``ShardingPlan.from_json(p.to_json()) == p`` holds exactly."""
        return json.dumps(asdict(self), indent=indent)

    @classmethod
    def from_json(cls, s: str) -> ShardingPlan:
        """Inverse of :meth:`to_json`; ValueError on malformed input."""
        try:
            d = json.loads(s)
            tables = tuple(
                TablePlacement(t["name"], t["kind"], tuple(Shard(**sh) for sh in t["shards"]))
                for t in d.pop("tables"))
            ranks = tuple(RankEstimate(**r) for r in d.pop("ranks"))
            order = tuple(tuple(int(t) for t in p) for p in d.pop("position_tables", ()))
            return cls(tables=tables, ranks=ranks, position_tables=order, **d)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a serialized ShardingPlan ({e!r}): {s[:200]!r}") from e

    def describe(self) -> str:
        """Human-readable summary: one line per table, then one line per position."""
        d, m = self.data_parallel, self.model_parallel
        lines = [f"ShardingPlan strategy={self.strategy}  mesh D x M = {d} x {m} ({d * m} ranks)"
                 f"  local_batch_size={self.local_batch_size}",
                 f"thresholds (elements): data_parallel={self.data_parallel_threshold} "
                 f"row_slice={self.row_slice_threshold} "
                 f"column_slice={self.column_slice_threshold}", ""]
        rows = []
        for t in self.tables:
            nrows = max(s.row_end for s in t.shards)
            dim = max(s.col_end for s in t.shards)
            parts = ", ".join(
                ("all" if s.owner is None else f"p{s.owner}")
                + f" r{s.row_start}:{s.row_end} c{s.col_start}:{s.col_end}" for s in t.shards)
            rows.append([t.name, str(nrows), str(dim), t.kind, parts])
        lines += _aligned(["table", "rows", "dim", "kind", "shards (owner rows cols)"],
                          rows, {1, 2})
        lines.append("")
        rows = [[f"p{r.position}", str(len(self.shards_on(r.position))), _human(r.param_bytes),
                 _human(r.optimizer_bytes), _human(r.lookup_bytes_per_sample),
                 _human(r.alltoall_bytes_per_step), _human(r.local_bytes_per_step),
                 _human(r.sync_bytes_per_step)]
                for r in self.ranks]
        lines += _aligned(["position", "shards", "params", "optimizer", "lookup/sample",
                           "alltoall sent/step", "local/step", "grad sync/step"], rows,
                          set(range(1, 8)))
        return "\n".join(lines)


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _shard_bytes(t: TableConfig, nrows: int, width: int, optimizer: str) -> tuple[int, int]:
    elements = nrows * width
    opt = {"sgd": 0, "adagrad": elements * 4, "rowwise_adagrad": nrows * 4}[optimizer]
    return elements * DTYPE_BYTES[t.dtype], opt


def _snake(m: int) -> Iterator[int]:
    while True:
        yield from range(m)
        yield from range(m - 1, -1, -1)


# (row_start, row_end, col_start, col_end, owner) of one shard, per table
_Layout = list[tuple[str, list[tuple[int, int, int, int, int | None]]]]


def _layout_bytes_balanced(tables: Sequence[TableConfig], m: int, col_thr: int | None,
                           row_thr: int | None, dp_thr: int | None,
                           shard_load: Callable[..., int]
                           ) -> tuple[_Layout, list[list[int]]]:
    """tfhybrid's own planner: (kind, shards) per table and each position's table order."""
    # Geometry first: (kind, [(r0, r1, c0, c1), ...]) per table.
    geometry: list[tuple[str, list[tuple[int, int, int, int]]]] = []
    for t in tables:
        elements = t.rows * t.dim
        full = [(0, t.rows, 0, t.dim)]
        if dp_thr is not None and elements <= dp_thr:
            geometry.append(("data_parallel", full))
        elif m > 1 and row_thr is not None and elements > row_thr:
            geometry.append(("row_wise", [(r0, r1, 0, t.dim)
                                          for r0, r1 in _split(t.rows, min(m, t.rows))]))
        elif m > 1 and col_thr is not None and elements > col_thr:
            n = min(-(-elements // col_thr), m, t.dim)
            if n > 1:
                geometry.append(("column_wise", [(0, t.rows, c0, c1)
                                                 for c0, c1 in _split(t.dim, n)]))
            else:
                geometry.append(("table_wise", full))
        else:
            geometry.append(("table_wise", full))

    holds: list[set[int]] = [set() for _ in range(m)]
    owners: dict[tuple[int, int, int], int | None] = {}
    placeable = []  # (bytes, table index, col_start, row_start)
    for ti, (kind, geoms) in enumerate(geometry):
        for i, (r0, r1, c0, c1) in enumerate(geoms):
            nbytes = shard_load(ti, r0, r1, c0, c1)
            if kind == "data_parallel":
                owners[ti, c0, r0] = None
            elif kind == "row_wise":
                owners[ti, c0, r0] = i
                holds[i].add(ti)
            else:
                placeable.append((nbytes, ti, c0, r0))

    # By bytes descending, dealt in snake order; a position skipped because it already
    # holds a slice of that table keeps its turn (waiting).
    turns, waiting = _snake(m), []
    for _, ti, c0, r0 in sorted(placeable, key=lambda x: (-x[0], x[1], x[2])):
        p = next((q for q in waiting if ti not in holds[q]), None)
        if p is not None:
            waiting.remove(p)
        else:
            p = next(turns)
            while ti in holds[p]:
                waiting.append(p)
                p = next(turns)
        owners[ti, c0, r0] = p
        holds[p].add(ti)

    layout = [(kind, [(r0, r1, c0, c1, owners[ti, c0, r0]) for r0, r1, c0, c1 in geoms])
              for ti, (kind, geoms) in enumerate(geometry)]
    order = [[ti for ti, (_, shards) in enumerate(layout) if any(s[4] == p for s in shards)]
             for p in range(m)]
    return layout, order


def _de_auto_column_threshold(elements: list[int], m: int) -> int | None:
    """DE's column_slice_threshold when none is given: while there are fewer pieces than
    positions, halve (floor) the largest piece; the threshold is one below the last
    piece halved. None when there are at least M tables."""
    pieces, threshold = list(elements), None
    while len(pieces) < m:
        pieces.sort()
        largest = pieces.pop()
        threshold = largest - 1
        pieces += [largest // 2, largest // 2]
    return threshold


def _de_slice_count(elements: int, threshold: int | None, cap: int) -> int:
    """DE's column slice count: the smallest power of two n with elements / n <= threshold,
    capped at ``cap`` = min(M, dim); no threshold is one slice."""
    n = 1
    if threshold is not None:
        # stopping at the cap gives DE's min(n, cap) and ends where DE would not (threshold < 1)
        while n < cap and elements > threshold * n:
            n *= 2
    return min(n, cap)


def _de_deal(strategy: str, m: int, slices: list[tuple[int, int]]) -> list[list[int]]:
    """DE's apply_strategy. ``slices``: (elements, table index) in table order, a table's
    slices consecutive. Returns, per position, the table index of every slice dealt to it,
    in the order dealt."""
    if strategy == "basic":
        # round robin in table order: slice k -> position k % M
        return [[t for _, t in slices[p::m]] for p in range(m)]
    # largest first; equal sizes: the higher table index first
    ranked = sorted(slices, reverse=True)
    if strategy == "memory_balanced":
        # ranked slices in rounds of 2M: position p takes the p-th of every round, then the
        # (2M-1-p)-th of every round (a snake deal, each position's list grouped by pass)
        ids = [t for _, t in ranked]
        return [ids[p::2 * m] + ids[2 * m - 1 - p::2 * m] for p in range(m)]
    # memory_optimized: each slice goes to the bin first in (elements, table list) order;
    # bins end in that order, bin k on position k
    bins: list[tuple[int, list[int]]] = [(0, []) for _ in range(m)]
    for size, t in ranked:
        load, ids = bins[0]
        bins[0] = (load + size, ids + [t])
        bins.sort()
    return [ids for _, ids in bins]


def _layout_de(strategy: str, tables: Sequence[TableConfig], m: int, col_thr: int | None,
               row_thr: int | None, dp_thr: int | None) -> tuple[_Layout, list[list[int]]]:
    """DE's DistEmbeddingStrategy placement: (kind, shards) per table, positions' orders."""
    elements = [t.rows * t.dim for t in tables]
    dp, tp, rw = [], [], []
    for ti, e in enumerate(elements):
        if dp_thr is not None and e <= dp_thr:
            dp.append(ti)
        elif row_thr is not None and e >= row_thr:   # DE: >= (its docs say "more than")
            rw.append(ti)
        else:
            tp.append(ti)

    if col_thr is None and tp:
        col_thr = _de_auto_column_threshold([elements[ti] for ti in tp], m)
    widths: dict[int, list[int]] = {}
    slices = []  # (elements, table index), table order
    for ti in tp:
        n = _de_slice_count(elements[ti], col_thr, min(m, tables[ti].dim))
        widths[ti] = [c1 - c0 for c0, c1 in _split(tables[ti].dim, n)]
        slices += [(tables[ti].rows * w, ti) for w in widths[ti]]
    # DE runs "basic" in a single process
    dealt = _de_deal("basic" if m == 1 else strategy, m, slices)

    # Merge a table's slices on one position into one shard. Slice widths are handed out in
    # position order (a table's slices in column order), so position p's columns of a table
    # are contiguous and follow those of the positions before it.
    order = [list(dict.fromkeys(d)) for d in dealt]
    next_col = dict.fromkeys(tp, 0)
    shards: dict[int, list[tuple[int, int, int, int, int | None]]] = {ti: [] for ti in tp}
    for p in range(m):
        for ti in order[p]:
            k = dealt[p].count(ti)
            w = sum(widths[ti][:k])
            del widths[ti][:k]
            shards[ti].append((0, tables[ti].rows, next_col[ti], next_col[ti] + w, p))
            next_col[ti] += w

    layout: _Layout = []
    for ti, t in enumerate(tables):
        if ti in dp:
            layout.append(("data_parallel", [(0, t.rows, 0, t.dim, None)]))
        elif ti in tp:
            layout.append(("column_wise" if len(shards[ti]) > 1 else "table_wise", shards[ti]))
        elif m == 1:
            layout.append(("table_wise", [(0, t.rows, 0, t.dim, 0)]))
        else:
            layout.append(("row_wise", [(r0, r1, 0, t.dim, i) for i, (r0, r1)
                                        in enumerate(_split(t.rows, min(m, t.rows)))]))
    # DE serves row-sliced tables after the table-parallel ones, in table order
    for p in range(m):
        order[p] += [ti for ti in rw if any(s[4] == p for s in layout[ti][1])]
    return layout, order


def plan_sharding(tables: Sequence[TableConfig], data_parallel: int, model_parallel: int, *,
                  strategy: str = DEFAULT_STRATEGY,
                  column_slice_threshold: int | None = None,
                  row_slice_threshold: int | None = None,
                  data_parallel_threshold: int | None = None,
                  memory_budget_bytes: int | None = None,
                  optimizer: str = "sgd",
                  local_batch_size: int = 1) -> ShardingPlan:
    """Decide the kind and owners of every table's shards and estimate per-position cost.

    **DE strategies** (``basic``, ``memory_balanced``, ``memory_optimized``) reproduce
    NVIDIA distributed-embeddings' ``DistEmbeddingStrategy`` on one model group of M
    positions (DE's workers). Groups by elements e = rows*dim: data_parallel if e <=
    data_parallel_threshold; else row-sliced if e >= row_slice_threshold (row_wise,
    min(M, rows) near-equal shards on positions 0..k-1; one table_wise shard when M == 1);
    else table-parallel. Each table-parallel table is cut into n = min(N, M, dim) column
    slices, N the smallest power of two with e / N <= column_slice_threshold, widths
    near-equal with the wider slices first. Without column_slice_threshold and with fewer
    table-parallel tables than M, the threshold is automatic: the largest of the tables'
    sizes is halved until there are M pieces, the threshold being one below the last
    piece halved (so no position idles; equal tables are all sliced, so there may be
    more slices than M). Slices (elements, table index) are then dealt:

    * ``basic``: in table order, slice k -> position k % M.
    * ``memory_balanced``: sorted by elements, then table index, descending; position p
      takes ranks p, p+2M, p+4M, ... then 2M-1-p, 4M-1-p, ... (in that order).
    * ``memory_optimized``: in the same descending order, each slice to the position
      whose (elements, table list) is smallest; positions are then numbered by that same
      (elements, table list) order, smallest first.

    With M == 1 DE always runs ``basic``. Slices of one table on one position merge into
    one shard (column_wise if the table keeps >= 2 shards, else table_wise); slice widths
    are consumed in position order, so a table's columns run over its positions in
    ascending order. A position serves its tables in first-dealt order, then its
    row-wise tables in table order (:meth:`ShardingPlan.tables_on`).

    **bytes_balanced** (:data:`DEFAULT_STRATEGY`, tfhybrid's own): data_parallel if e <=
    data_parallel_threshold, row_wise if e > row_slice_threshold and M > 1 (min(M, rows)
    shards on positions 0..k-1), column_wise if e > column_slice_threshold and M > 1
    (n = ceil(e / threshold) capped at min(M, dim), n == 1 falls back), else table_wise;
    no automatic slicing. Table-wise shards and column slices are dealt by bytes (param +
    optimizer state) descending in snake order 0..M-1, M-1..0, ..., never two slices of a
    table on one position (a position skipped for holding a slice of the same table keeps
    its turn); positions serve their tables in table order.

    Load = param + optimizer bytes.  With ``memory_budget_bytes`` a shard or position
    over budget raises ValueError naming the table and the bytes.

    >>> plan = plan_sharding([TableConfig("big", 10_000, 64), TableConfig("tiny", 10, 4)],
    ...                      data_parallel=2, model_parallel=4,
    ...                      column_slice_threshold=200_000, data_parallel_threshold=100)
    >>> [(t.kind, len(t.shards)) for t in plan.tables]
    [('column_wise', 4), ('data_parallel', 1)]
    >>> de = plan_sharding([TableConfig("only", 100, 8)], 1, 4, strategy="basic")
    >>> [(s.owner, s.col_start, s.col_end) for s in de.table("only").shards]
    [(0, 0, 2), (1, 2, 4), (2, 4, 6), (3, 6, 8)]
    """
    _check_int("data_parallel", data_parallel, 1)
    _check_int("model_parallel", model_parallel, 1)
    _check_int("local_batch_size", local_batch_size, 1)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    _check_threshold("column_slice_threshold", column_slice_threshold)
    _check_threshold("row_slice_threshold", row_slice_threshold)
    _check_threshold("data_parallel_threshold", data_parallel_threshold)
    _check_threshold("memory_budget_bytes", memory_budget_bytes)
    tables = list(tables)
    seen: set[str] = set()
    for t in tables:
        if not isinstance(t, TableConfig):
            raise ValueError(f"tables must be TableConfig instances, got {t!r}")
        if t.name in seen:
            raise ValueError(f"duplicate table name {t.name!r}")
        seen.add(t.name)
    m = model_parallel

    def load_of(ti: int, r0: int, r1: int, c0: int, c1: int) -> int:
        param, opt = _shard_bytes(tables[ti], r1 - r0, c1 - c0, optimizer)
        if memory_budget_bytes is not None and param + opt > memory_budget_bytes:
            raise ValueError(
                f"table {tables[ti].name!r}: shard rows {r0}:{r1} cols {c0}:{c1} needs "
                f"{param + opt} bytes, over memory_budget_bytes={memory_budget_bytes}")
        return param + opt

    thresholds = (column_slice_threshold, row_slice_threshold, data_parallel_threshold)
    if strategy == "bytes_balanced":
        layout, order = _layout_bytes_balanced(tables, m, *thresholds, load_of)
    else:
        layout, order = _layout_de(strategy, tables, m, *thresholds)

    placements = tuple(
        TablePlacement(t.name, kind, tuple(Shard(t.name, r0, r1, c0, c1, owner) for
                                           r0, r1, c0, c1, owner in sorted(
                                               shards, key=lambda s: (s[2], s[0]))))
        for t, (kind, shards) in zip(tables, layout))

    # Per-table bytes on each position (data_parallel tables count everywhere).
    on_position: list[dict[int, int]] = [{} for _ in range(m)]
    for ti, pl in enumerate(placements):
        for s in pl.shards:
            nbytes = load_of(ti, s.row_start, s.row_end, s.col_start, s.col_end)
            for p in (range(m) if s.owner is None else [s.owner]):
                on_position[p][ti] = on_position[p].get(ti, 0) + nbytes
    if memory_budget_bytes is not None:
        for p, per_table in enumerate(on_position):
            load = sum(per_table.values())
            if load > memory_budget_bytes:
                worst = min(per_table, key=lambda ti: (-per_table[ti], ti))
                raise ValueError(
                    f"position {p} needs {load} bytes, over memory_budget_bytes="
                    f"{memory_budget_bytes}; largest table there is {tables[worst].name!r} "
                    f"with {per_table[worst]} bytes")

    ranks = tuple(_estimate(p, tables, placements, m, local_batch_size, optimizer,
                            data_parallel)
                  for p in range(m))
    return ShardingPlan(data_parallel, m, strategy, placements, ranks, column_slice_threshold,
                        row_slice_threshold, data_parallel_threshold, local_batch_size,
                        tuple(tuple(o) for o in order))


def table_ids_per_position(plan: ShardingPlan) -> list[list[int]]:
    """For each position, the indices of the tables it holds a shard of, in its order.

    DE's ``table_ids`` (with indices into ``plan.tables``), extended with row-wise tables
    after the table-parallel ones; data-parallel tables are not listed. Each table appears
    at most once per position.

    >>> plan = plan_sharding([TableConfig("a", 100, 8), TableConfig("b", 10, 4)], 1, 3,
    ...                      strategy="basic")
    >>> table_ids_per_position(plan)
    [[0], [0], [1]]
    """
    return [plan.tables_on(p) for p in range(plan.model_parallel)]


def input_ids_per_position(plan: ShardingPlan, input_table_map: Sequence[int]
                           ) -> list[list[int]]:
    """For each position, the input features it looks up, in DE's ``input_ids_list`` order.

    For each table in :func:`table_ids_per_position` order, the features k with
    ``input_table_map[k] == table``, ascending. A feature appears once on every position
    holding a shard of its table (every column slice or row shard owner needs it);
    features of data-parallel tables appear nowhere.

    >>> plan = plan_sharding([TableConfig("a", 100, 8), TableConfig("b", 10, 4)], 1, 3,
    ...                      strategy="basic")
    >>> input_ids_per_position(plan, [1, 0, 1])
    [[1], [1], [0, 2]]
    """
    input_table_map = list(input_table_map)
    for k, t in enumerate(input_table_map):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < len(plan.tables):
            raise ValueError(f"input_table_map[{k}]={t!r} is not a table index in "
                             f"[0, {len(plan.tables)})")
    features: dict[int, list[int]] = {}
    for k, t in enumerate(input_table_map):
        features.setdefault(t, []).append(k)
    return [[k for t in tables for k in features.get(t, [])]
            for tables in table_ids_per_position(plan)]


def sync_is_sparse(rows: int, width: int, ids_per_step: float) -> bool:
    """True when an allgather of the touched rows moves fewer bytes than a dense allreduce.

    An allgather sends ``ids * (width + 1)`` values (rows plus their indices); a dense
    allreduce the whole ``rows * width`` table. ``ids_per_step`` counts looked-up ids, an
    upper bound on the unique rows a step touches.
    """
    return ids_per_step * (width + 1) < rows * width


def sync_bytes(rows: int, width: int, ids_per_step: float, group_size: int,
               value_bytes: int = 4, index_bytes: int = 8) -> float:
    """Bytes a rank sends to keep one variable's copies in step over ``group_size`` ranks.

    Sparse (allgather): ``ids * (width * value_bytes + index_bytes)``; dense (allreduce):
    the gradient's ``rows * width * value_bytes``; 0 for a group of one.
    """
    if group_size == 1:
        return 0.0
    if sync_is_sparse(rows, width, ids_per_step):
        return float(ids_per_step * (width * value_bytes + index_bytes))
    return float(rows * width * value_bytes)


def _estimate(p: int, tables: Sequence[TableConfig], placements: Sequence[TablePlacement],
              m: int, b: int, optimizer: str, d: int) -> RankEstimate:
    # Formulas are spelled out in the module docstring; keep the two in sync.
    param = opt = 0
    lookup = sent = local = sync = 0.0
    idb = 8 if any(t.rows >= 2**31 for t, pl in zip(tables, placements)
                   if pl.kind != "data_parallel") else 4
    for t, pl in zip(tables, placements):
        act, h = DTYPE_BYTES[t.dtype], float(t.hotness)
        bags = b * t.features if t.combiner is not None else b * h
        k = len(pl.shards)
        for s in pl.shards:
            w = s.col_end - s.col_start
            if s.owner is None or s.owner == p:
                pb, ob = _shard_bytes(t, s.row_end - s.row_start, w, optimizer)
                param, opt = param + pb, opt + ob
            nrows = s.row_end - s.row_start
            if pl.kind == "data_parallel":
                lookup += h * w * act
                sync += sync_bytes(nrows, w, b * h, m * d)
                continue
            ids = b * h / k if pl.kind == "row_wise" else b * h
            rows_back = act * bags * w
            if s.owner == p:
                sync += sync_bytes(nrows, w, m * ids, d)
                sent += (m - 1) * rows_back
                local += (bags + ids) * idb + 2 * rows_back
                lookup += m * (ids / b) * w * act
            else:
                sent += (bags + ids) * idb + rows_back
    return RankEstimate(p, param, opt, float(lookup), float(sent), float(local), sync)
