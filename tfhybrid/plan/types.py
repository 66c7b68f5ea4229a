"""The planner's vocabulary: constants, kinds, tables, shards, plans and their checks.

The mesh is D data-parallel replicas x model groups of M ranks.  A rank's *position*
p in [0, M) is its index inside its model group; every model-parallel shard lives on
one position of every model group (so it has D copies).  A :class:`ShardingPlan` sees
only (D, M): plain data that can be printed, saved as JSON and unit-tested without
TensorFlow or Horovod (TorchRec style).  Option names follow NVIDIA
distributed-embeddings (DE) so its users can migrate; thresholds are in ELEMENTS
(rows*dim).  The strategies that make plans are in :mod:`tfhybrid.plan.strategies`,
the byte model behind :class:`RankEstimate` in :mod:`tfhybrid.plan.traffic`.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Sequence

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# a table's combiner (None: one row per id); tfhybrid.combiners says how each combines
COMBINERS = (None, "sum", "mean", "sqrtn")
# DE's names with DE's placement, then tfhybrid's own planner
DE_STRATEGIES = ("basic", "memory_balanced", "memory_optimized")
STRATEGIES = DE_STRATEGIES + ("bytes_balanced",)
DEFAULT_STRATEGY = "bytes_balanced"
# optimizer -> (state bytes per element, state bytes per row): float32 slots
OPTIMIZER_STATE = {"sgd": (0, 0), "adagrad": (4, 0), "adam": (8, 0),
                   "rowwise_adagrad": (0, 4), "ms_rowwise_adagrad": (0, 4)}
OPTIMIZERS = tuple(OPTIMIZER_STATE)
# how a shard's D copies stay in step (see the layer's replica_sync)
REPLICA_SYNC = ("gradients", "weights")
# chooses M's tables' kinds by predicted step time: tfhybrid.plan.cost_strategy
COST_STRATEGY = "cost"
ALL_STRATEGIES = STRATEGIES + (COST_STRATEGY,)
# ids on the wire: int32 unless a model-parallel table needs int64 (a keyed table's
# keys are always int64)
ID_BYTES_SMALL, ID_BYTES_LARGE = 4, 8
# a keyed (dynamic) table's bookkeeping per slot besides its row and optimizer state, as
# the planner counts it: key and last call seen (int64), sightings (int32) and two to
# four int32 index buckets (a power of two at least twice the slots), 28 to 36 bytes;
# with admit_after > 1 as much again for the admission candidates
KEYED_SLOT_BYTES = 32
# a sparse gradient row's index, as Horovod's allgather sends it (int64)
INDEX_BYTES = 8
# gradient sync values when no comm_dtype is given (float32 gradients)
DEFAULT_SYNC_VALUE_BYTES = 4


class Kind(enum.StrEnum):
    """How one table is split over a model group's positions.

    A plan stores the plain string (JSON round-trips it as such); a member compares equal
    to its value, so code compares against ``Kind.X`` while plans hold ``'x'``.

    >>> Kind.ROW_WISE == "row_wise", Kind("column_wise").value
    (True, 'column_wise')
    """

    DATA_PARALLEL = "data_parallel"   # every rank holds the whole table
    TABLE_WISE = "table_wise"         # one position holds the whole table
    COLUMN_WISE = "column_wise"       # column slices on distinct positions
    ROW_WISE = "row_wise"             # row shards on positions 0..k-1
    HASH_WISE = "hash_wise"           # a keyed table: key k on position mix64(k) mod M


# the kinds' plain values, for messages that list them as before the enum existed
KINDS = tuple(kind.value for kind in Kind)


def check_int(what: str, value: Any, minimum: int) -> None:
    """Raises ``ValueError`` naming ``what`` and ``value`` unless it is an ``int`` >=
    ``minimum`` (a plan is plain data that round-trips through JSON, so numpy integers
    are refused too)."""
    # bool is an int subclass; True as a row count is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")


def check_optional_int(what: str, value: Any, minimum: int = 1) -> None:
    """:func:`check_int` unless ``value`` is None (an option left unset)."""
    if value is not None:
        check_int(what, value, minimum)


def check_number(what: str, value: Any, *, positive: bool, allow_inf: bool = False) -> None:
    """Raises ``ValueError`` naming ``what`` and ``value`` unless it is a real number (not
    NaN; finite unless ``allow_inf``) > 0 (``positive``) or >= 0."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and not math.isnan(value) and (allow_inf or math.isfinite(value))
          and (value > 0 if positive else value >= 0))
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{what} must be a {'' if allow_inf else 'finite '}number {bound}, "
                         f"got {value!r}")


def check_settings(optimizer: Any, replica_sync: Any, sync_every: Any,
                   comm_dtype: Any) -> None:
    """Raises ``ValueError`` naming the first of the estimates' settings that is unknown."""
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
    # a dynamic table of open-world keys: ``rows`` is its capacity over the model group,
    # and it is always hash_wise (each position holds the keys it owns)
    keyed: bool = False

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
        if not isinstance(self.keyed, bool):
            raise ValueError(f"keyed of table {self.name!r} must be True or False, got "
                             f"{self.keyed!r}")
        if self.keyed and (self.cache_rows is not None or self.adaptive):
            raise ValueError(f"table {self.name!r} is keyed (a dynamic table), which keeps "
                             "its slots in memory at one width: cache_rows and adaptive "
                             "do not apply")


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

    >>> TablePlacement("t", Kind.TABLE_WISE, (Shard("t", 0, 10, 0, 4, 0),)).kind
    'table_wise'
    """

    name: str
    kind: str   # a Kind's value
    shards: tuple[Shard, ...]
    # the table lives in the disk tier with this many rows cached (each shard the same
    # share of its rows: tfhybrid.plan.tiers.shard_cache_rows); None: in memory
    cache_rows: int | None = None

    def __post_init__(self) -> None:
        # the plan holds plain strings, so its JSON and reprs read as before Kind existed
        if isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", self.kind.value)


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
    """The result of ``plan_sharding``: plain data, JSON round-trippable.

    ``position_tables[p]`` lists the indices (into ``tables``) of the model-parallel
    tables with a shard on position p, in that position's order (see
    :meth:`tables_on`); each table at most once per position.  An empty tuple (a plan
    serialized before the field existed) means table order.

    >>> from tfhybrid.plan.planner import plan_sharding
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

    def check_position(self, position: int) -> None:
        """ValueError naming ``position`` unless it is one of this plan's M positions."""
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
        self.check_position(position)
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
            lines += ["", "predicted by the cost model (tfhybrid.plan):"]
            lines += aligned_table(["quantity", "value"], [
                [name, f"{value * 1e3:.3f} ms" if name.endswith("_seconds") else
                 format_bytes(value) if name.endswith("_bytes") else f"{value:g}"]
                for name, value in self.predicted], {1})
        return "\n".join(lines)


def optimizer_state_bytes(rows: int, width: int, optimizer: str) -> int:
    """Bytes of ``optimizer``'s slots for a ``rows x width`` variable (:data:`OPTIMIZER_STATE`).

    >>> optimizer_state_bytes(1000, 64, "rowwise_adagrad"), optimizer_state_bytes(10, 4, "adam")
    (4000, 320)
    """
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    per_element, per_row = OPTIMIZER_STATE[optimizer]
    return rows * width * per_element + rows * per_row


def shard_bytes(t: TableConfig, nrows: int, width: int, optimizer: str) -> tuple[int, int]:
    """(param bytes, optimizer state bytes) of an ``nrows x width`` shard of ``t``.

    >>> shard_bytes(TableConfig("t", 100, 8), 50, 8, "adagrad")
    (1600, 1600)
    """
    param = nrows * width * DTYPE_BYTES[t.dtype]
    if t.keyed:   # a slot's key, its counters and its index buckets
        param += nrows * KEYED_SLOT_BYTES
    return param, optimizer_state_bytes(nrows, width, optimizer)


# the memory tiers a budget may name (the disk tier below them is unbounded)
BUDGET_TIERS = ("dram",)


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


@dataclass(frozen=True)
class PlannerOptions:
    """Every option of the planner, in one value, validated on construction:
    ``plan_sharding(tables, D, M, options=...)`` takes it (its keywords of the same names
    make one).

    - ``strategy`` and its thresholds (elements, rows*dim; None: no threshold):
      ``column_slice_threshold``, ``row_slice_threshold``, ``data_parallel_threshold``;
    - memory: ``memory_budget_bytes`` refuses a shard or position over it;
      ``memory_budget`` (``{"dram": bytes}`` per rank) moves tables into the disk tier
      until every position fits (one of the two);
    - what the estimates assume: ``optimizer`` (a key of :data:`OPTIMIZER_STATE`),
      ``local_batch_size``, ``replica_sync`` / ``sync_every``, ``comm_dtype`` (None: the
      tables' own), ``unique_rows`` (``(table, ids) -> distinct rows``);
    - for ``strategy="cost"``: ``cluster`` (a ``ClusterSpec``), ``workload`` (a
      ``Workload``) and the mesh ``layout``.

    >>> PlannerOptions("basic", column_slice_threshold=1000).thresholds
    (1000, None, None)
    >>> PlannerOptions(optimizer="adam", local_batch_size=64).optimizer
    'adam'
    >>> PlannerOptions("round_robin")
    Traceback (most recent call last):
    ...
    ValueError: strategy must be one of ('basic', 'memory_balanced', 'memory_optimized', \
'bytes_balanced', 'cost'), got 'round_robin'
    """

    strategy: str = DEFAULT_STRATEGY
    column_slice_threshold: int | None = None
    row_slice_threshold: int | None = None
    data_parallel_threshold: int | None = None
    memory_budget_bytes: int | None = None
    memory_budget: dict[str, int] | None = None
    optimizer: str = "sgd"
    local_batch_size: int = 1
    replica_sync: str = "gradients"
    sync_every: int = 1
    comm_dtype: str | None = None
    unique_rows: Callable[[TableConfig, float], float] | None = None
    cluster: Any = None
    workload: Any = None
    layout: str = "model_major"

    def __post_init__(self) -> None:
        if self.strategy not in ALL_STRATEGIES:
            raise ValueError(f"strategy must be one of {ALL_STRATEGIES}, "
                             f"got {self.strategy!r}")
        for name in ("column_slice_threshold", "row_slice_threshold",
                     "data_parallel_threshold", "memory_budget_bytes"):
            check_optional_int(name, getattr(self, name))
        check_settings(self.optimizer, self.replica_sync, self.sync_every, self.comm_dtype)
        dram_budget_bytes(self.memory_budget, self.memory_budget_bytes)
        check_int("local_batch_size", self.local_batch_size, 1)
        if self.unique_rows is not None and not callable(self.unique_rows):
            raise ValueError(f"unique_rows must be None or a function (table, ids) -> rows, "
                             f"got {self.unique_rows!r}")
        if self.strategy != COST_STRATEGY and (self.cluster is not None
                                              or self.workload is not None):
            raise ValueError(f"cluster and workload are for strategy={COST_STRATEGY!r}, "
                             f"not {self.strategy!r}")

    @property
    def thresholds(self) -> tuple[int | None, int | None, int | None]:
        """(column_slice, row_slice, data_parallel) thresholds, the order plans keep."""
        return (self.column_slice_threshold, self.row_slice_threshold,
                self.data_parallel_threshold)


# the names plan_sharding takes as keywords, each a PlannerOptions field
PLANNER_OPTION_NAMES = tuple(f.name for f in fields(PlannerOptions))


def table_ids_per_position(plan: ShardingPlan) -> list[list[int]]:
    """For each position, the indices of the tables it holds a shard of, in its order.

    DE's ``table_ids`` (with indices into ``plan.tables``), extended with row-wise tables
    after the table-parallel ones; data-parallel tables are not listed. Each table appears
    at most once per position.

    >>> from tfhybrid.plan.planner import plan_sharding
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

    >>> from tfhybrid.plan.planner import plan_sharding
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

