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
* param_bytes = elements*act; optimizer_bytes = elements*e + shard_rows*r with (e, r) from
  :data:`OPTIMIZER_STATE` (float32 slots: sgd 0, adagrad 4 per element, adam 8 per element,
  rowwise_adagrad and ms_rowwise_adagrad 4 per row); data_parallel tables count on every
  position.
* replica sync of a shard over its data group (D copies), per step: ``"gradients"`` moves
  :func:`sync_bytes` (sparse allgather of the touched rows or dense allreduce, whichever is
  smaller); ``"weights"`` moves :func:`weight_sync_bytes` (the whole shard and its optimizer
  state; a tiered shard's cache and the rows its store took back) every K = sync_every
  steps, so 1/K of it per step. Data-parallel tables always
  sync gradients over all N ranks.
* comm_dtype (None = each table's dtype) is the dtype of the activations, their gradients
  and the gradient sync values on the wire; a weight sync moves the variables' own bytes.
  Gradient sync values are 4 bytes when comm_dtype is None.
* unique rows: the sync and apply formulas take the rows a step touches; by default the
  looked-up ids (an upper bound), or ``unique_rows(table, ids)`` when given (see
  ``tfhybrid.cost_model.Workload``).

:func:`position_traffic` breaks a position's bytes down by collective (ids, activations,
activation gradients, each sync); :class:`RankEstimate` holds the totals.
"""

from __future__ import annotations

import json
import math
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
COMBINERS = (None, "sum", "mean")
# DE's names with DE's placement, then tfhybrid's own planner
DE_STRATEGIES = ("basic", "memory_balanced", "memory_optimized")
STRATEGIES = DE_STRATEGIES + ("bytes_balanced",)
DEFAULT_STRATEGY = "bytes_balanced"
# optimizer -> (state bytes per element, state bytes per row): float32 slots
OPTIMIZER_STATE = {"sgd": (0, 0), "adagrad": (4, 0), "adam": (8, 0),
                   "rowwise_adagrad": (0, 4), "ms_rowwise_adagrad": (0, 4)}
OPTIMIZERS = tuple(OPTIMIZER_STATE)
KINDS = ("data_parallel", "table_wise", "column_wise", "row_wise")
# how a shard's D copies stay in step (see the layer's replica_sync)
REPLICA_SYNC = ("gradients", "weights")
# chooses M's tables' kinds by predicted step time: tfhybrid.cost_model
COST_STRATEGY = "cost"
ALL_STRATEGIES = STRATEGIES + (COST_STRATEGY,)
# ids on the wire: int32 unless a model-parallel table needs int64
ID_BYTES_SMALL, ID_BYTES_LARGE = 4, 8
# a sparse gradient row's index, as Horovod's allgather sends it (int64)
INDEX_BYTES = 8
# gradient sync values when no comm_dtype is given (float32 gradients)
DEFAULT_SYNC_VALUE_BYTES = 4

__all__ = ["TableConfig", "Shard", "TablePlacement", "RankEstimate", "PositionTraffic",
           "ShardingPlan", "plan_sharding", "plan_with_kinds", "position_traffic",
           "positions_traffic", "place_in_tiers", "shard_cache_rows", "tier_dram_bytes",
           "BUDGET_TIERS", "TIER_OPTIMIZERS", "TIER_PINNED_STEPS",
           "sync_is_sparse", "sync_bytes", "weight_sync_bytes", "optimizer_state_bytes",
           "input_ids_per_position", "table_ids_per_position", "DTYPE_BYTES", "COMBINERS",
           "STRATEGIES", "ALL_STRATEGIES", "COST_STRATEGY", "DE_STRATEGIES",
           "DEFAULT_STRATEGY", "OPTIMIZERS", "OPTIMIZER_STATE", "REPLICA_SYNC", "KINDS",
           "check_int"]


def check_int(what: str, value: Any, minimum: int) -> None:
    """Raises ``ValueError`` naming ``what`` and ``value`` unless it is an ``int`` >=
    ``minimum`` (a plan is plain data that round-trips through JSON, so numpy integers
    are refused too)."""
    # bool is an int subclass; True as a row count is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")


def _check_threshold(what: str, value: Any) -> None:
    if value is not None:
        check_int(what, value, 1)


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
    # rows kept in DRAM when the table lives in the disk tier (None: all in memory)
    cache_rows: int | None = None
    # FIITED's per-row widths (dims="adaptive"): in the tier, more DRAM per row and slot
    adaptive: bool = False

    def __post_init__(self) -> None:
        check_int(f"features of table {getattr(self, 'name', '?')!r}", self.features, 1)
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"table name must be a non-empty str, got {self.name!r}")
        check_int(f"rows of table {self.name!r}", self.rows, 1)
        check_int(f"dim of table {self.name!r}", self.dim, 1)
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
        if self.cache_rows is not None:
            check_int(f"cache_rows of table {self.name!r}", self.cache_rows, 1)
            if self.cache_rows > self.rows:
                raise ValueError(f"cache_rows of table {self.name!r} is {self.cache_rows}, "
                                 f"more than its {self.rows} rows")


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
    # the table lives in the disk tier with this many rows cached (each shard the same
    # share of its rows: :func:`shard_cache_rows`); None: in memory
    cache_rows: int | None = None


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


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches: ``format_bytes(3 << 20)`` is
    ``'3.00 MiB'``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def aligned_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                  right: set[int]) -> list[str]:
    """A text table's lines: columns padded to their widest cell, right-aligned where
    their index is in ``right``."""
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
    # what the estimates assume (plans saved before these fields existed read as defaults)
    optimizer: str = "sgd"
    replica_sync: str = "gradients"
    sync_every: int = 1
    comm_dtype: str | None = None
    # set by the cost strategy: the mesh layout it chose and its predictions as
    # (name, value) pairs (seconds, bytes), plain data so JSON round-trips exactly
    layout: str | None = None
    predicted: tuple[tuple[str, float], ...] = ()

    def table(self, name: str) -> TablePlacement:
        """The placement of table ``name``; ValueError if unknown."""
        for placement in self.tables:
            if placement.name == name:
                return placement
        raise ValueError(f"no table named {name!r} in this plan")

    def _check_position(self, position: int) -> None:
        check_int("position", position, 0)
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
                TablePlacement(t["name"], t["kind"], tuple(Shard(**sh) for sh in t["shards"]),
                               t.get("cache_rows"))
                for t in d.pop("tables"))
            ranks = tuple(RankEstimate(**r) for r in d.pop("ranks"))
            order = tuple(tuple(int(t) for t in p) for p in d.pop("position_tables", ()))
            predicted = tuple((str(k), float(v)) for k, v in d.pop("predicted", ()))
            return cls(tables=tables, ranks=ranks, position_tables=order, predicted=predicted,
                       **d)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a serialized ShardingPlan ({e!r}): {s[:200]!r}") from e

    def describe(self) -> str:
        """Human-readable summary: one line per table, then one line per position."""
        d, m = self.data_parallel, self.model_parallel
        lines = [f"ShardingPlan strategy={self.strategy}  mesh D x M = {d} x {m} ({d * m} ranks)"
                 f"  local_batch_size={self.local_batch_size}",
                 f"thresholds (elements): data_parallel={self.data_parallel_threshold} "
                 f"row_slice={self.row_slice_threshold} "
                 f"column_slice={self.column_slice_threshold}",
                 f"optimizer={self.optimizer} replica_sync={self.replica_sync}"
                 + (f" sync_every={self.sync_every}" if self.replica_sync == "weights" else "")
                 + f" comm_dtype={self.comm_dtype or 'table dtype'}"
                 + (f" layout={self.layout}" if self.layout else ""), ""]
        rows = []
        for t in self.tables:
            nrows = max(s.row_end for s in t.shards)
            dim = max(s.col_end for s in t.shards)
            parts = ", ".join(
                ("all" if s.owner is None else f"p{s.owner}")
                + f" r{s.row_start}:{s.row_end} c{s.col_start}:{s.col_end}" for s in t.shards)
            tier = ("memory" if t.cache_rows is None else
                    f"disk, {t.cache_rows} cached ({t.cache_rows / nrows:.0%})")
            rows.append([t.name, str(nrows), str(dim), t.kind, tier, parts])
        lines += aligned_table(["table", "rows", "dim", "kind", "tier",
                           "shards (owner rows cols)"], rows, {1, 2})
        lines.append("")
        rows = [[f"p{r.position}", str(len(self.shards_on(r.position))), format_bytes(r.param_bytes),
                 format_bytes(r.optimizer_bytes), format_bytes(r.lookup_bytes_per_sample),
                 format_bytes(r.alltoall_bytes_per_step), format_bytes(r.local_bytes_per_step),
                 format_bytes(r.sync_bytes_per_step)]
                for r in self.ranks]
        lines += aligned_table(["position", "shards", "params", "optimizer", "lookup/sample",
                           "alltoall sent/step", "local/step", "grad sync/step"], rows,
                          set(range(1, 8)))
        if self.predicted:
            lines += ["", "predicted by the cost model (tfhybrid.cost_model):"]
            lines += aligned_table(["quantity", "value"], [
                [name, f"{value * 1e3:.3f} ms" if name.endswith("_seconds") else
                 format_bytes(value) if name.endswith("_bytes") else f"{value:g}"]
                for name, value in self.predicted], {1})
        return "\n".join(lines)


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def optimizer_state_bytes(rows: int, width: int, optimizer: str) -> int:
    """Bytes of ``optimizer``'s slots for a ``rows x width`` variable (:data:`OPTIMIZER_STATE`).

    >>> optimizer_state_bytes(1000, 64, "rowwise_adagrad"), optimizer_state_bytes(10, 4, "adam")
    (4000, 320)
    """
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    per_element, per_row = OPTIMIZER_STATE[optimizer]
    return rows * width * per_element + rows * per_row


def _shard_bytes(t: TableConfig, nrows: int, width: int, optimizer: str) -> tuple[int, int]:
    return nrows * width * DTYPE_BYTES[t.dtype], optimizer_state_bytes(nrows, width, optimizer)


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
        if dp_thr is not None and elements <= dp_thr and t.cache_rows is None:
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
    return _deal(geometry, m, shard_load)


# (kind, [(row_start, row_end, col_start, col_end), ...]) per table
_Geometry = list[tuple[str, list[tuple[int, int, int, int]]]]


def _deal(geometry: _Geometry, m: int, shard_load: Callable[..., int]
          ) -> tuple[_Layout, list[list[int]]]:
    """Owners for a geometry: row_wise shard i on position i; table-wise shards and column
    slices by bytes descending in snake order, never two slices of a table on a position."""
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
        if dp_thr is not None and e <= dp_thr and tables[ti].cache_rows is None:
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
                  memory_budget: dict[str, int] | None = None,
                  optimizer: str = "sgd",
                  local_batch_size: int = 1,
                  replica_sync: str = "gradients",
                  sync_every: int = 1,
                  comm_dtype: str | None = None,
                  unique_rows: Callable[[TableConfig, float], float] | None = None,
                  cluster: Any = None, workload: Any = None,
                  layout: str = "model_major") -> ShardingPlan:
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

    **cost** (:data:`COST_STRATEGY`): each table's kind and shard count minimize the step
    time ``tfhybrid.cost_model.predict`` gives for this D x M mesh in ``layout`` on
    ``cluster`` (a ``ClusterSpec``) running ``workload`` (a ``Workload`` whose tables are
    ``tables``; its optimizer, batch, sync mode and comm dtype are the plan's), under
    ``cluster.memory_per_rank``; the plan records the layout and the predictions
    (:meth:`ShardingPlan.describe` prints them). ``tfhybrid.cost_model.plan_for_cluster``
    also chooses M and the layout.

    Load = param + optimizer bytes.  With ``memory_budget_bytes`` a shard or position
    over budget raises ValueError naming the table and the bytes. ``memory_budget``
    (``{"dram": bytes}``, per rank) instead moves tables into the disk tier until every
    position fits (:func:`place_in_tiers`); a table's ``cache_rows`` puts it there
    explicitly, and a tiered table is never replicated. ``optimizer``,
    ``replica_sync``/``sync_every``, ``comm_dtype`` and ``unique_rows`` change the
    estimates (module docstring), and the plan records them.

    >>> plan = plan_sharding([TableConfig("big", 10_000, 64), TableConfig("tiny", 10, 4)],
    ...                      data_parallel=2, model_parallel=4,
    ...                      column_slice_threshold=200_000, data_parallel_threshold=100)
    >>> [(t.kind, len(t.shards)) for t in plan.tables]
    [('column_wise', 4), ('data_parallel', 1)]
    >>> de = plan_sharding([TableConfig("only", 100, 8)], 1, 4, strategy="basic")
    >>> [(s.owner, s.col_start, s.col_end) for s in de.table("only").shards]
    [(0, 0, 2), (1, 2, 4), (2, 4, 6), (3, 6, 8)]
    """
    check_int("data_parallel", data_parallel, 1)
    check_int("model_parallel", model_parallel, 1)
    check_int("local_batch_size", local_batch_size, 1)
    if strategy not in ALL_STRATEGIES:
        raise ValueError(f"strategy must be one of {ALL_STRATEGIES}, got {strategy!r}")
    _check_settings(optimizer, replica_sync, sync_every, comm_dtype)
    _check_threshold("column_slice_threshold", column_slice_threshold)
    _check_threshold("row_slice_threshold", row_slice_threshold)
    _check_threshold("data_parallel_threshold", data_parallel_threshold)
    _check_threshold("memory_budget_bytes", memory_budget_bytes)
    dram_budget = dram_budget_bytes(memory_budget, memory_budget_bytes)
    tables = check_tables(tables)
    if strategy == COST_STRATEGY:
        from tfhybrid import cost_model  # imported here: cost_model imports this module
        plan = cost_model.plan_mesh(tables, data_parallel, model_parallel, layout, cluster,
                                    workload)
        return plan if dram_budget is None else place_in_tiers(plan, dram_budget, tables)
    if cluster is not None or workload is not None:
        raise ValueError(f"cluster and workload are for strategy={COST_STRATEGY!r}, not "
                         f"{strategy!r}")
    m = model_parallel

    thresholds = (column_slice_threshold, row_slice_threshold, data_parallel_threshold)
    load_of = _load_function(tables, optimizer, memory_budget_bytes)
    if strategy == "bytes_balanced":
        layout, order = _layout_bytes_balanced(tables, m, *thresholds, load_of)
    else:
        layout, order = _layout_de(strategy, tables, m, *thresholds)
    settings = _Settings(optimizer, replica_sync, sync_every, comm_dtype, unique_rows)
    plan = _finish_plan(tables, data_parallel, m, strategy, layout, order, thresholds,
                        memory_budget_bytes, local_batch_size, settings)
    return plan if dram_budget is None else place_in_tiers(plan, dram_budget, tables)


# the memory tiers a budget may name (the disk tier below them is unbounded)
BUDGET_TIERS = ("dram",)
# DRAM of a tiered shard besides its cached rows (tfhybrid.tiers.CachedTable): per row,
# its cache slot or -1 (int32); per cache slot, its row (int64), the policy's and the
# last lookup's step (2 x int64), two flags and the row's optimizer accumulator (float32)
TIER_BYTES_PER_ROW = 4
TIER_BYTES_PER_SLOT = 8 + 8 + 8 + 1 + 1 + 4
# and with FIITED's per-row widths (tfhybrid.tiers.ChunkedCachedTable): per row, its chunk
# count (uint8) and utility (float32); per slot, its row (int64) and chunk count (int32)
TIER_FIITED_BYTES_PER_ROW = 1 + 4
TIER_FIITED_BYTES_PER_SLOT = 8 + 4
# optimizers whose state a tier can keep: one value per row, which moves with the row
TIER_OPTIMIZERS = ("sgd", "rowwise_adagrad")
# steps whose rows a tiered shard's cache holds at once: the layer loads a batch's rows
# when it routes its ids, which a pipeline does while the step before still runs
TIER_PINNED_STEPS = 2


def dram_budget_bytes(memory_budget: Any, memory_budget_bytes: int | None) -> int | None:
    """The DRAM bytes per rank of a ``memory_budget`` dict (None without one); raises
    ``ValueError`` naming a malformed budget or one given together with
    ``memory_budget_bytes``."""
    if memory_budget is None:
        return None
    if not isinstance(memory_budget, dict) or set(memory_budget) - set(BUDGET_TIERS):
        raise ValueError(f"memory_budget={memory_budget!r} must be a dict of bytes per rank "
                         f"by tier, with keys from {BUDGET_TIERS}")
    if memory_budget_bytes is not None:
        raise ValueError(f"memory_budget={memory_budget!r} moves tables into the disk tier "
                         f"to fit; memory_budget_bytes={memory_budget_bytes} refuses plans "
                         "that do not fit in memory: give one of them")
    if "dram" not in memory_budget:
        return None
    check_int("memory_budget['dram']", memory_budget["dram"], 1)
    return memory_budget["dram"]


def shard_cache_rows(cache_rows: int, rows: int, shard_rows: int) -> int:
    """The cache of one shard of a tiered table: the table's cached share of the shard's
    rows, rounded up (at least 1 row, at most the shard).

    >>> shard_cache_rows(250, 1000, 500)
    125
    """
    return max(1, min(shard_rows, -(-cache_rows * shard_rows // rows)))


def tier_dram_bytes(shard_rows: int, width: int, cache_rows: int,
                    adaptive: bool = False) -> int:
    """DRAM of a tiered shard: its cached rows, their row state and the host index (with
    FIITED's per-row widths, ``adaptive``: each row's chunk count and utility too).

    >>> tier_dram_bytes(1000, 8, 100)
    10200
    """
    per_row = TIER_BYTES_PER_ROW + (TIER_FIITED_BYTES_PER_ROW if adaptive else 0)
    per_slot = TIER_BYTES_PER_SLOT + (TIER_FIITED_BYTES_PER_SLOT if adaptive else 0)
    return cache_rows * (width * 4 + per_slot) + shard_rows * per_row


def place_in_tiers(plan: ShardingPlan, dram_budget: int,
                   tables: Sequence[TableConfig]) -> ShardingPlan:
    """``plan`` with tables moved into the disk tier until every position's DRAM (tables
    in memory, optimizer state, tiered shards' caches and indexes) fits ``dram_budget``.

    While a position is over budget, its largest table still in memory (by its bytes on
    that position) moves to the disk tier, with the largest cache that lets that
    position fit. A cache holds at least the ids that :data:`TIER_PINNED_STEPS` steps
    may name (all N ranks' local batches: N * local_batch_size * hotness per step; ragged
    inputs count their hotness as the layer is told it), and a table whose least cache and index would take as much DRAM
    as its rows stays in memory. A tier keeps one optimizer value per row, so only :data:`TIER_OPTIMIZERS`
    can tier. ValueError, naming the position and its bytes, when moving every table
    that can move does not fit.

    >>> plan = plan_sharding([TableConfig("big", 100_000, 16), TableConfig("small", 100, 16)],
    ...                      1, 1, memory_budget={"dram": 1_000_000})
    >>> [(t.name, t.cache_rows) for t in plan.tables]
    [('big', 6314), ('small', None)]
    """
    check_int("dram budget", dram_budget, 1)
    placements = list(plan.tables)
    rows_of = [max(s.row_end for s in p.shards) for p in placements]
    ranks = plan.data_parallel * plan.model_parallel
    # the fewest rows a tiered table may cache: the pinned steps' ids of every rank
    least = [min(t.rows, math.ceil(TIER_PINNED_STEPS * ranks * plan.local_batch_size
                                   * t.hotness)) for t in tables]

    def dram_of(ti: int, shard: Shard, cache_rows: int | None) -> int:
        nrows, width = shard.row_end - shard.row_start, shard.col_end - shard.col_start
        if cache_rows is None:
            return nrows * width * 4 + optimizer_state_bytes(nrows, width, plan.optimizer)
        return tier_dram_bytes(nrows, width, shard_cache_rows(cache_rows, rows_of[ti], nrows),
                               tables[ti].adaptive)

    def loads() -> list[dict[int, int]]:
        on_position: list[dict[int, int]] = [{} for _ in range(plan.model_parallel)]
        for ti, placement in enumerate(placements):
            for shard in placement.shards:
                for p in (range(plan.model_parallel) if shard.owner is None
                          else [shard.owner]):
                    on_position[p][ti] = on_position[p].get(ti, 0) + dram_of(
                        ti, shard, placement.cache_rows)
        return on_position

    while True:
        over = [(sum(per_table.values()), p) for p, per_table in enumerate(loads())
                if sum(per_table.values()) > dram_budget]
        if not over:
            return dataclasses.replace(plan, tables=tuple(placements))
        load, p = max(over)
        per_table = loads()[p]
        mine_of = {ti: [s for s in placements[ti].shards if s.owner == p] for ti in per_table}
        # a table moves if its least cache (and index) takes less DRAM than its rows
        movable = [ti for ti in per_table if placements[ti].cache_rows is None
                   and placements[ti].kind != "data_parallel" and least[ti] < rows_of[ti]
                   and sum(dram_of(ti, s, least[ti]) for s in mine_of[ti]) < per_table[ti]]
        if not movable:
            raise ValueError(
                f"position {p} needs {load} bytes of DRAM with every table on it that "
                f"can move in the disk tier, over memory_budget['dram']={dram_budget}; use "
                "more ranks per model group or a larger budget")
        if plan.optimizer not in TIER_OPTIMIZERS:
            raise ValueError(
                f"position {p} needs {load} bytes, over memory_budget['dram']={dram_budget}, "
                f"and the disk tier keeps one optimizer value per row: optimizer="
                f"{plan.optimizer!r} keeps more (tiers take {TIER_OPTIMIZERS})")
        ti = max(movable, key=lambda t: (per_table[t], -t))
        room = dram_budget - (load - per_table[ti])
        mine = mine_of[ti]
        # the largest table-wide cache that fits on p (its shards there share it; the
        # bytes grow with the cache, so a bisection finds it); the least cache if none
        # fits, and the next round moves another table
        low, high = least[ti], rows_of[ti] - 1
        while low < high:
            middle = (low + high + 1) // 2
            if sum(dram_of(ti, s, middle) for s in mine) <= room:
                low = middle
            else:
                high = middle - 1
        placements[ti] = dataclasses.replace(placements[ti], cache_rows=low)


def _check_settings(optimizer: Any, replica_sync: Any, sync_every: Any,
                    comm_dtype: Any) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if replica_sync not in REPLICA_SYNC:
        raise ValueError(f"replica_sync must be one of {REPLICA_SYNC}, got {replica_sync!r}")
    check_int("sync_every", sync_every, 1)
    if comm_dtype is not None and comm_dtype not in DTYPE_BYTES:
        raise ValueError(f"comm_dtype must be None or one of {sorted(DTYPE_BYTES)}, "
                         f"got {comm_dtype!r}")


def check_tables(tables: Sequence[TableConfig]) -> list[TableConfig]:
    """``tables`` as a list, after checking each is a ``TableConfig`` with a unique name
    (``ValueError`` naming the offender otherwise)."""
    tables = list(tables)
    seen: set[str] = set()
    for t in tables:
        if not isinstance(t, TableConfig):
            raise ValueError(f"tables must be TableConfig instances, got {t!r}")
        if t.name in seen:
            raise ValueError(f"duplicate table name {t.name!r}")
        seen.add(t.name)
    return tables


def _load_function(tables: Sequence[TableConfig], optimizer: str,
                   memory_budget_bytes: int | None) -> Callable[..., int]:
    def load_of(ti: int, r0: int, r1: int, c0: int, c1: int) -> int:
        param, opt = _shard_bytes(tables[ti], r1 - r0, c1 - c0, optimizer)
        if memory_budget_bytes is not None and param + opt > memory_budget_bytes:
            raise ValueError(
                f"table {tables[ti].name!r}: shard rows {r0}:{r1} cols {c0}:{c1} needs "
                f"{param + opt} bytes, over memory_budget_bytes={memory_budget_bytes}")
        return param + opt
    return load_of


@dataclass(frozen=True)
class _Settings:
    """What the byte formulas assume besides the geometry (see the module docstring)."""
    optimizer: str = "sgd"
    replica_sync: str = "gradients"
    sync_every: int = 1
    comm_dtype: str | None = None
    unique_rows: Callable[[TableConfig, float], float] | None = None


def _finish_plan(tables: list[TableConfig], d: int, m: int, strategy: str, layout: _Layout,
                 order: list[list[int]], thresholds: tuple[int | None, ...],
                 memory_budget_bytes: int | None, local_batch_size: int, settings: _Settings,
                 mesh_layout: str | None = None,
                 predicted: tuple[tuple[str, float], ...] = ()) -> ShardingPlan:
    load_of = _load_function(tables, settings.optimizer, memory_budget_bytes)
    placements = tuple(
        TablePlacement(t.name, kind, tuple(Shard(t.name, r0, r1, c0, c1, owner) for
                                           r0, r1, c0, c1, owner in sorted(
                                               shards, key=lambda s: (s[2], s[0]))),
                       t.cache_rows)
        for t, (kind, shards) in zip(tables, layout))

    # Per-table bytes on each position (data_parallel tables count everywhere).
    if memory_budget_bytes is not None:
        on_position: list[dict[int, int]] = [{} for _ in range(m)]
        for ti, pl in enumerate(placements):
            for s in pl.shards:
                nbytes = load_of(ti, s.row_start, s.row_end, s.col_start, s.col_end)
                for p in (range(m) if s.owner is None else [s.owner]):
                    on_position[p][ti] = on_position[p].get(ti, 0) + nbytes
        for p, per_table in enumerate(on_position):
            load = sum(per_table.values())
            if load > memory_budget_bytes:
                worst = min(per_table, key=lambda ti: (-per_table[ti], ti))
                raise ValueError(
                    f"position {p} needs {load} bytes, over memory_budget_bytes="
                    f"{memory_budget_bytes}; largest table there is {tables[worst].name!r} "
                    f"with {per_table[worst]} bytes")

    ranks = tuple(_traffic(p, tables, placements, m, local_batch_size, d, settings)[0]
                  for p in range(m))
    column, row, dp = thresholds
    return ShardingPlan(d, m, strategy, placements, ranks, column, row, dp, local_batch_size,
                        tuple(tuple(o) for o in order), settings.optimizer,
                        settings.replica_sync, settings.sync_every, settings.comm_dtype,
                        mesh_layout, predicted)


def _kind_geometry(t: TableConfig, kind: str, n: int, m: int
                   ) -> tuple[str, list[tuple[int, int, int, int]]]:
    full = [(0, t.rows, 0, t.dim)]
    if kind in ("data_parallel", "table_wise") or (kind != "data_parallel" and n == 1):
        return ("table_wise" if kind != "data_parallel" else kind), full
    if kind == "column_wise":
        if not 1 <= n <= min(m, t.dim):
            raise ValueError(f"table {t.name!r}: column_wise needs 1 <= shards <= "
                             f"min(M={m}, dim={t.dim}), got {n}")
        return kind, [(0, t.rows, c0, c1) for c0, c1 in _split(t.dim, n)]
    if kind == "row_wise":
        if not 1 <= n <= min(m, t.rows):
            raise ValueError(f"table {t.name!r}: row_wise needs 1 <= shards <= "
                             f"min(M={m}, rows={t.rows}), got {n}")
        return kind, [(r0, r1, 0, t.dim) for r0, r1 in _split(t.rows, n)]
    raise ValueError(f"table {t.name!r}: kind must be one of {KINDS}, got {kind!r}")


def plan_with_kinds(tables: Sequence[TableConfig], data_parallel: int, model_parallel: int,
                    kinds: Sequence[tuple[str, int]], *, strategy: str = COST_STRATEGY,
                    optimizer: str = "sgd", local_batch_size: int = 1,
                    replica_sync: str = "gradients", sync_every: int = 1,
                    comm_dtype: str | None = None,
                    unique_rows: Callable[[TableConfig, float], float] | None = None,
                    memory_budget_bytes: int | None = None, layout: str | None = None,
                    predicted: Sequence[tuple[str, float]] = ()) -> ShardingPlan:
    """A plan with each table's ``(kind, shards)`` given (the cost strategy's candidates).

    ``column_wise`` n: n near-equal column slices (1 <= n <= min(M, dim));
    ``row_wise`` n: n row shards on positions 0..n-1 (1 <= n <= min(M, rows)); n == 1 is
    table_wise; ``table_wise`` and ``data_parallel`` ignore n. Table-wise shards and
    column slices are dealt as ``bytes_balanced`` deals them (bytes descending, snake order).

    >>> plan = plan_with_kinds([TableConfig("a", 100, 8), TableConfig("b", 40, 4)], 1, 2,
    ...                        [("column_wise", 2), ("data_parallel", 1)])
    >>> [(t.kind, [s.owner for s in t.shards]) for t in plan.tables]
    [('column_wise', [0, 1]), ('data_parallel', [None])]
    """
    check_int("data_parallel", data_parallel, 1)
    check_int("model_parallel", model_parallel, 1)
    check_int("local_batch_size", local_batch_size, 1)
    _check_settings(optimizer, replica_sync, sync_every, comm_dtype)
    _check_threshold("memory_budget_bytes", memory_budget_bytes)
    tables = check_tables(tables)
    kinds = list(kinds)
    if len(kinds) != len(tables):
        raise ValueError(f"kinds has {len(kinds)} entries for {len(tables)} tables")
    m = model_parallel
    geometry = [_kind_geometry(t, kind, n, m) for t, (kind, n) in zip(tables, kinds)]
    load_of = _load_function(tables, optimizer, memory_budget_bytes)
    layout_, order = _deal(geometry, m, load_of)
    settings = _Settings(optimizer, replica_sync, sync_every, comm_dtype, unique_rows)
    return _finish_plan(tables, data_parallel, m, strategy, layout_, order,
                        (None, None, None), memory_budget_bytes, local_batch_size, settings,
                        layout, tuple((str(k), float(v)) for k, v in predicted))


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


def sync_is_sparse(rows: int, width: int, ids_per_step: float, group_size: int) -> bool:
    """True when an allgather of the touched rows moves fewer bytes than a dense allreduce
    over ``group_size`` ranks.

    Per rank, an allgather receives the other ranks' ``ids * (width + 1)`` values (rows
    plus their indices), ``(n - 1) * ids * (width + 1)``; a ring allreduce sends and
    receives ``2 (n - 1) / n * rows * width``. So sparse wins while
    ``n * ids * (width + 1) < 2 * rows * width`` (for n = 2: ``ids * (width + 1) <
    rows * width``). ``ids_per_step`` counts looked-up ids, an upper bound on the unique
    rows a step touches. This one rule serves the planner, the cost model and the
    gradient sync (tfhybrid.distributed).
    """
    return group_size * ids_per_step * (width + 1) < 2 * rows * width


def sync_bytes(rows: int, width: int, ids_per_step: float, group_size: int,
               value_bytes: int = DEFAULT_SYNC_VALUE_BYTES,
               index_bytes: int = INDEX_BYTES) -> float:
    """Bytes a rank sends to keep one variable's copies in step over ``group_size`` ranks.

    Sparse (allgather): ``ids * (width * value_bytes + index_bytes)``; dense (allreduce):
    the gradient's ``rows * width * value_bytes``; 0 for a group of one.
    """
    if group_size == 1:
        return 0.0
    if sync_is_sparse(rows, width, ids_per_step, group_size):
        return float(ids_per_step * (width * value_bytes + index_bytes))
    return float(rows * width * value_bytes)


def weight_sync_bytes(rows: int, width: int, value_bytes: int, optimizer: str,
                      group_size: int, cache_rows: int | None = None,
                      written_rows: float = 0.0) -> float:
    """Bytes one weight sync averages per rank: the variable and its optimizer state.

    Dense over the group (every row may have moved); 0 for a group of one. Amortized over
    K steps by the callers (``sync_every``). A tiered shard (``cache_rows``) averages its
    cache and the ``written_rows`` its store took back since the sync before, each a
    float32 row and its float32 row state (``tfhybrid.tiers``), whatever the optimizer.

    >>> weight_sync_bytes(100, 8, 4, "rowwise_adagrad", 2)
    3600.0
    >>> weight_sync_bytes(100, 8, 4, "rowwise_adagrad", 2, cache_rows=10, written_rows=5)
    540.0
    """
    if group_size == 1:
        return 0.0
    if cache_rows is not None:
        return float((cache_rows + written_rows) * (width + 1) * 4)
    return float(rows * width * value_bytes + optimizer_state_bytes(rows, width, optimizer))


@dataclass(frozen=True)
class PositionTraffic:
    """One position's bytes per step, by collective (the totals are :class:`RankEstimate`).

    Alltoall phases (inside the model group; what this rank SENDS): ``ids_sent`` (forward,
    bag lengths + ids to the owners), ``activations_sent`` (forward, owned rows to the
    other positions), ``activation_grads_sent`` (backward, the gradients of the received
    rows back to their owners). Syncs: ``shard_allreduce_bytes`` is S of the dense
    allreduces over the data group and ``shard_allgather_bytes`` this rank's part of the
    sparse allgathers (gradient mode); ``shard_weight_sync_bytes`` is S of ONE weight sync
    (weight mode, every ``sync_every`` steps); ``replicated_*`` are the data-parallel
    tables' gradient syncs over all N ranks. ``apply_bytes``: rows the optimizer updates
    times (row bytes + state per row). ``activation_bytes``: embedding outputs and their
    gradients held from forward to backward (owner: M * rows back per owned shard; every
    rank: the rows it receives). ``*_count`` count the tensors each sync has.

    >>> t = TableConfig("t", 100, 8)
    >>> plan = plan_sharding([t], 2, 2, local_batch_size=4)
    >>> position_traffic(plan, [t], 0).activations_sent   # 4 bags * 8 values * 4 B to p1
    128.0
    """

    position: int
    param_bytes: int
    optimizer_bytes: int
    lookup_bytes_per_sample: float
    ids_sent: float
    activations_sent: float
    activation_grads_sent: float
    local_bytes: float
    activation_bytes: float
    shard_allreduce_bytes: float
    shard_allgather_bytes: float
    shard_weight_sync_bytes: float
    replicated_allreduce_bytes: float
    replicated_allgather_bytes: float
    apply_bytes: float
    shard_allreduce_count: int = 0
    shard_allgather_count: int = 0
    replicated_allreduce_count: int = 0
    replicated_allgather_count: int = 0


def position_traffic(plan: ShardingPlan, tables: Sequence[TableConfig], position: int, *,
                     unique_rows: Callable[[TableConfig, float], float] | None = None,
                     **overrides: Any) -> PositionTraffic:
    """:class:`PositionTraffic` of ``position`` for ``plan`` (built from ``tables``).

    The plan's optimizer, replica_sync, sync_every, comm_dtype and local_batch_size are
    used unless given in ``overrides`` (same names); ``unique_rows(table, ids)`` estimates
    the distinct rows among ``ids`` looked-up ids (default: ids).
    """
    plan._check_position(position)
    tables, settings, b = _traffic_setup(plan, tables, unique_rows, overrides)
    return _traffic(position, tables, plan.tables, plan.model_parallel, b,
                    plan.data_parallel, settings)[1]


def positions_traffic(plan: ShardingPlan, tables: Sequence[TableConfig], *,
                      unique_rows: Callable[[TableConfig, float], float] | None = None,
                      **overrides: Any) -> list[PositionTraffic]:
    """:func:`position_traffic` of every position, checking the inputs once."""
    tables, settings, b = _traffic_setup(plan, tables, unique_rows, overrides)
    return [_traffic(p, tables, plan.tables, plan.model_parallel, b, plan.data_parallel,
                     settings)[1] for p in range(plan.model_parallel)]


def _traffic_setup(plan: ShardingPlan, tables: Sequence[TableConfig],
                   unique_rows: Callable[[TableConfig, float], float] | None,
                   overrides: dict[str, Any]) -> tuple[list[TableConfig], _Settings, int]:
    tables = check_tables(tables)
    if [t.name for t in tables] != [p.name for p in plan.tables]:
        raise ValueError(f"tables {[t.name for t in tables]} are not the plan's "
                         f"{[p.name for p in plan.tables]}")
    for t, pl in zip(tables, plan.tables):
        shape = (max(s.row_end for s in pl.shards), max(s.col_end for s in pl.shards))
        if shape != (t.rows, t.dim):
            raise ValueError(f"table {t.name!r} is {t.rows} x {t.dim} but the plan's is "
                             f"{shape[0]} x {shape[1]}")
    unknown = set(overrides) - {"optimizer", "replica_sync", "sync_every", "comm_dtype",
                                "local_batch_size"}
    if unknown:
        raise ValueError(f"unknown overrides {sorted(unknown)}")
    get = lambda name: overrides.get(name, getattr(plan, name))  # noqa: E731
    _check_settings(get("optimizer"), get("replica_sync"), get("sync_every"),
                    get("comm_dtype"))
    check_int("local_batch_size", get("local_batch_size"), 1)
    settings = _Settings(get("optimizer"), get("replica_sync"), get("sync_every"),
                         get("comm_dtype"), unique_rows)
    return tables, settings, get("local_batch_size")


# row-wise tables with more shards than this are summed per position in closed form (the
# loop below, kept for smaller tables, adds in an order saved estimates depend on)
_ROW_SHARDS_LOOPED = 64


def _traffic(p: int, tables: Sequence[TableConfig], placements: Sequence[TablePlacement],
             m: int, b: int, d: int, settings: _Settings
             ) -> tuple[RankEstimate, PositionTraffic]:
    # Formulas are spelled out in the module docstring; keep the two in sync. The totals
    # (param .. sync) accumulate in the same order as always, so saved estimates and the
    # test digests stay bit-identical.
    optimizer, unique = settings.optimizer, settings.unique_rows
    weights_mode = settings.replica_sync == "weights"
    sync_value = (DTYPE_BYTES[settings.comm_dtype] if settings.comm_dtype
                  else DEFAULT_SYNC_VALUE_BYTES)
    per_element_state, per_row_state = OPTIMIZER_STATE[optimizer]
    param = opt = 0
    lookup = sent = local = sync = 0.0
    ids_sent = act_sent = grad_sent = held = 0.0
    shard_ar = shard_ag = shard_ws = rep_ar = rep_ag = apply = 0.0
    counts = {"shard_ar": 0, "shard_ag": 0, "rep_ar": 0, "rep_ag": 0}
    idb = ID_BYTES_LARGE if any(t.rows >= 2**31 for t, pl in zip(tables, placements)
                                if pl.kind != "data_parallel") else ID_BYTES_SMALL

    def touched(t: TableConfig, ids: float, nrows: int, share: int) -> float:
        """Distinct rows among the ids of a shard holding 1/share of the table's rows."""
        if unique is None:
            return ids
        return min(float(nrows), unique(t, ids * share) / share)

    for t, pl in zip(tables, placements):
        act, h = DTYPE_BYTES[t.dtype], float(t.hotness)
        wire = DTYPE_BYTES[settings.comm_dtype] if settings.comm_dtype else act
        bags = b * t.features if t.combiner is not None else b * h
        k = len(pl.shards)
        share = k if pl.kind == "row_wise" else 1
        shards = pl.shards
        if pl.kind == "row_wise" and k > _ROW_SHARDS_LOOPED:
            # every row shard p does not own costs it the same: count them at once (a
            # 4096-rank mesh would otherwise loop over M shards per table per position)
            if p < k and shards[p].owner == p:   # the planner puts row shard i on i
                own: tuple[Shard, ...] = (shards[p],)
            else:
                own = tuple(s for s in shards if s.owner == p)
            others = k - len(own)
            ids = b * h / k
            wire_back = wire * bags * t.dim
            ids_sent += others * (bags + ids) * idb
            grad_sent += others * wire_back
            sent += others * ((bags + ids) * idb + wire_back)
            held += 2 * others * wire_back
            shards = own
        for s in shards:
            w = s.col_end - s.col_start
            nrows = s.row_end - s.row_start
            row_bytes = w * act + w * per_element_state + per_row_state
            if s.owner is None or s.owner == p:
                pb, ob = _shard_bytes(t, nrows, w, optimizer)
                param, opt = param + pb, opt + ob
            if pl.kind == "data_parallel":
                lookup += h * w * act
                rows = touched(t, b * h, nrows, 1)
                nbytes = sync_bytes(nrows, w, rows, m * d, sync_value)
                sync += nbytes
                if m * d > 1:
                    if sync_is_sparse(nrows, w, rows, m * d):
                        rep_ag, counts["rep_ag"] = rep_ag + nbytes, counts["rep_ag"] + 1
                    else:
                        rep_ar, counts["rep_ar"] = rep_ar + nbytes, counts["rep_ar"] + 1
                apply += min(float(nrows), touched(t, m * d * b * h, nrows, 1)) * row_bytes
                held += 2 * wire * bags * w
                continue
            ids = b * h / k if pl.kind == "row_wise" else b * h
            wire_back = wire * bags * w   # act * bags * w without a comm_dtype
            held += 2 * wire_back
            if s.owner == p:
                group_rows = touched(t, m * ids, nrows, share)
                if weights_mode:
                    if pl.cache_rows:
                        # a tier's store takes back at most one row per row it loads: at
                        # most the group's distinct ids of K steps, never a cached row
                        cached = shard_cache_rows(pl.cache_rows, t.rows, nrows)
                        one_sync = weight_sync_bytes(
                            nrows, w, act, optimizer, d, cached,
                            min(float(nrows - cached), settings.sync_every * group_rows))
                    else:
                        one_sync = weight_sync_bytes(nrows, w, act, optimizer, d)
                    sync += one_sync / settings.sync_every
                    shard_ws += one_sync
                    applied = group_rows
                else:
                    nbytes = sync_bytes(nrows, w, group_rows, d, sync_value)
                    sync += nbytes
                    if d > 1:
                        if sync_is_sparse(nrows, w, group_rows, d):
                            shard_ag, counts["shard_ag"] = shard_ag + nbytes, counts["shard_ag"] + 1
                        else:
                            shard_ar, counts["shard_ar"] = shard_ar + nbytes, counts["shard_ar"] + 1
                    applied = touched(t, d * m * ids, nrows, share)
                apply += min(float(nrows), applied) * row_bytes
                sent += (m - 1) * wire_back
                local += (bags + ids) * idb + 2 * wire_back
                act_sent += (m - 1) * wire_back
                held += 2 * (m - 1) * wire_back
                lookup += m * (ids / b) * w * act
            else:
                sent += (bags + ids) * idb + wire_back
                ids_sent += (bags + ids) * idb
                grad_sent += wire_back
    estimate = RankEstimate(p, param, opt, float(lookup), float(sent), float(local), sync)
    traffic = PositionTraffic(p, param, opt, float(lookup), ids_sent, act_sent, grad_sent,
                              float(local), held, shard_ar, shard_ag, shard_ws, rep_ar, rep_ag,
                              apply, counts["shard_ar"], counts["shard_ag"], counts["rep_ar"],
                              counts["rep_ag"])
    return estimate, traffic
