"""Sharding planner for hybrid (2D) embedding training: pure data, no TensorFlow.

The mesh is D data-parallel replicas x model groups of M ranks.  A rank's *position*
p in [0, M) is its index inside its model group; every model-parallel shard lives on
one position of every model group (so it has D copies).  The planner only sees (D, M)
and returns a :class:`ShardingPlan` that can be printed, saved as JSON and unit-tested
without TensorFlow or Horovod (TorchRec style).  Option names follow NVIDIA
distributed-embeddings so its users can migrate; thresholds are in ELEMENTS (rows*dim).

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
from typing import Any, Iterator, Sequence

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
COMBINERS = (None, "sum", "mean")
STRATEGIES = ("basic", "memory_balanced", "memory_optimized")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
KINDS = ("data_parallel", "table_wise", "column_wise", "row_wise")

__all__ = ["TableConfig", "Shard", "TablePlacement", "RankEstimate", "ShardingPlan",
           "plan_sharding", "sync_is_sparse", "sync_bytes", "DTYPE_BYTES", "COMBINERS", "STRATEGIES", "OPTIMIZERS", "KINDS"]


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

    def table(self, name: str) -> TablePlacement:
        """The placement of table ``name``; ValueError if unknown."""
        for placement in self.tables:
            if placement.name == name:
                return placement
        raise ValueError(f"no table named {name!r} in this plan")

    def shards_on(self, position: int) -> list[Shard]:
        """Model-parallel shards owned by ``position``: table order, then col, then row."""
        _check_int("position", position, 0)
        if position >= self.model_parallel:
            raise ValueError(f"position must be < model_parallel={self.model_parallel}, "
                             f"got {position}")
        out = []
        for placement in self.tables:
            mine = [s for s in placement.shards if s.owner == position]
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
            return cls(tables=tables, ranks=ranks, **d)
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
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


def _place(strategy: str, placeable: list[tuple[int, int, int, int]], base_load: list[int],
           base_holds: list[set[int]]) -> tuple[dict[tuple[int, int, int], int], list[int]]:
    """Owners {(table index, col_start, row_start): position} and the resulting loads."""
    m = len(base_load)
    load, holds = list(base_load), [set(h) for h in base_holds]
    owners: dict[tuple[int, int, int], int] = {}

    def assign(nbytes: int, ti: int, c0: int, r0: int, p: int) -> None:
        owners[ti, c0, r0] = p
        load[p] += nbytes
        holds[p].add(ti)

    by_size = sorted(placeable, key=lambda x: (-x[0], x[1], x[2]))
    if strategy == "basic":
        for k, (nbytes, ti, c0, r0) in enumerate(placeable):
            p = k % m
            while ti in holds[p]:
                p = (p + 1) % m
            assign(nbytes, ti, c0, r0, p)
    elif strategy == "memory_balanced":
        turns, waiting = _snake(m), []  # waiting: skipped positions keep their turn
        for nbytes, ti, c0, r0 in by_size:
            p = next((q for q in waiting if ti not in holds[q]), None)
            if p is not None:
                waiting.remove(p)
            else:
                p = next(turns)
                while ti in holds[p]:
                    waiting.append(p)
                    p = next(turns)
            assign(nbytes, ti, c0, r0, p)
    else:
        for nbytes, ti, c0, r0 in by_size:
            p = min((q for q in range(m) if ti not in holds[q]), key=lambda q: (load[q], q))
            assign(nbytes, ti, c0, r0, p)
        # Greedy least-loaded is a heuristic: with column slices pinned to distinct
        # positions it can lose to the snake deal by a few small tables.  Keeping the
        # better of the two makes "optimized <= balanced" (peak bytes) an invariant.
        snake_owners, snake_load = _place("memory_balanced", placeable, base_load, base_holds)
        if max(snake_load) < max(load):
            return snake_owners, snake_load
    return owners, load


def plan_sharding(tables: Sequence[TableConfig], data_parallel: int, model_parallel: int, *,
                  strategy: str = "memory_balanced",
                  column_slice_threshold: int | None = None,
                  row_slice_threshold: int | None = None,
                  data_parallel_threshold: int | None = None,
                  memory_budget_bytes: int | None = None,
                  optimizer: str = "sgd",
                  local_batch_size: int = 1) -> ShardingPlan:
    """Decide the kind and owners of every table's shards and estimate per-position cost.

    Kind priority: data_parallel (rows*dim <= data_parallel_threshold), row_wise
    (rows*dim > row_slice_threshold and M > 1; min(M, rows) shards on positions 0..k-1),
    column_wise (rows*dim > column_slice_threshold and M > 1; n = ceil(rows*dim /
    threshold) capped at min(M, dim), n == 1 falls back), else table_wise.  The strategy
    places table_wise shards and column slices ("placeable"), never two slices of one
    table on the same position, after row_wise shards are counted in the load:

    * ``basic``: placeable shard k (input order) -> position k % M, next free if taken.
    * ``memory_balanced``: by bytes descending, dealt in snake order 0..M-1, M-1..0, ...;
      a position skipped for holding a slice of the same table keeps its turn.
    * ``memory_optimized``: by bytes descending, each to the least-loaded position (ties
      -> lowest); if the memory_balanced deal has a strictly lower peak it is kept
      instead, so memory_optimized's peak is never above memory_balanced's.

    Load = param + optimizer bytes.  With ``memory_budget_bytes`` a shard or position
    over budget raises ValueError naming the table and the bytes.

    >>> plan = plan_sharding([TableConfig("big", 10_000, 64), TableConfig("tiny", 10, 4)],
    ...                      data_parallel=2, model_parallel=4,
    ...                      column_slice_threshold=200_000, data_parallel_threshold=100)
    >>> [(t.kind, len(t.shards)) for t in plan.tables]
    [('column_wise', 4), ('data_parallel', 1)]
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

    # Geometry first: (kind, [(r0, r1, c0, c1), ...]) per table.
    layout: list[tuple[str, list[tuple[int, int, int, int]]]] = []
    for t in tables:
        elements = t.rows * t.dim
        full = [(0, t.rows, 0, t.dim)]
        if data_parallel_threshold is not None and elements <= data_parallel_threshold:
            layout.append(("data_parallel", full))
        elif m > 1 and row_slice_threshold is not None and elements > row_slice_threshold:
            layout.append(("row_wise", [(r0, r1, 0, t.dim)
                                        for r0, r1 in _split(t.rows, min(m, t.rows))]))
        elif m > 1 and column_slice_threshold is not None and elements > column_slice_threshold:
            n = min(-(-elements // column_slice_threshold), m, t.dim)
            if n > 1:
                layout.append(("column_wise", [(0, t.rows, c0, c1)
                                               for c0, c1 in _split(t.dim, n)]))
            else:
                layout.append(("table_wise", full))
        else:
            layout.append(("table_wise", full))

    def load_of(ti: int, r0: int, r1: int, c0: int, c1: int) -> int:
        param, opt = _shard_bytes(tables[ti], r1 - r0, c1 - c0, optimizer)
        if memory_budget_bytes is not None and param + opt > memory_budget_bytes:
            raise ValueError(
                f"table {tables[ti].name!r}: shard rows {r0}:{r1} cols {c0}:{c1} needs "
                f"{param + opt} bytes, over memory_budget_bytes={memory_budget_bytes}")
        return param + opt

    load = [0] * m
    holds: list[set[int]] = [set() for _ in range(m)]
    owners: dict[tuple[int, int, int], int | None] = {}
    placeable = []  # (bytes, table index, col_start, row_start), input order
    for ti, (kind, geoms) in enumerate(layout):
        for i, (r0, r1, c0, c1) in enumerate(geoms):
            nbytes = load_of(ti, r0, r1, c0, c1)
            if kind == "data_parallel":
                owners[ti, c0, r0] = None
                load = [x + nbytes for x in load]
            elif kind == "row_wise":
                owners[ti, c0, r0] = i
                load[i] += nbytes
                holds[i].add(ti)
            else:
                placeable.append((nbytes, ti, c0, r0))

    chosen, load = _place(strategy, placeable, load, holds)
    owners.update(chosen)

    placements = tuple(
        TablePlacement(t.name, kind, tuple(Shard(t.name, r0, r1, c0, c1, owners[ti, c0, r0])
                                           for r0, r1, c0, c1 in geoms))
        for ti, (t, (kind, geoms)) in enumerate(zip(tables, layout)))

    if memory_budget_bytes is not None:
        for p in range(m):
            if load[p] > memory_budget_bytes:
                per_table = {}
                for ti, pl in enumerate(placements):
                    for s in pl.shards:
                        if s.owner in (None, p):
                            per_table[ti] = per_table.get(ti, 0) + load_of(
                                ti, s.row_start, s.row_end, s.col_start, s.col_end)
                worst = min(per_table, key=lambda ti: (-per_table[ti], ti))
                raise ValueError(
                    f"position {p} needs {load[p]} bytes, over memory_budget_bytes="
                    f"{memory_budget_bytes}; largest table there is {tables[worst].name!r} "
                    f"with {per_table[worst]} bytes")

    ranks = tuple(_estimate(p, tables, placements, m, local_batch_size, optimizer,
                            data_parallel)
                  for p in range(m))
    return ShardingPlan(data_parallel, m, strategy, placements, ranks, column_slice_threshold,
                        row_slice_threshold, data_parallel_threshold, local_batch_size)


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
