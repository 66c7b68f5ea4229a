"""The placement strategies: each table's kind, its shards' owners, each position's order.

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

Every plan a strategy makes carries its positions' byte estimates
(:func:`tfhybrid.plan.traffic.rank_estimates`). ``plan_sharding``
(:mod:`tfhybrid.plan.planner`) picks the strategy, the cost strategy included.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from tfhybrid.plan.traffic import EstimateSettings, rank_estimates
from tfhybrid.plan.types import (COST_STRATEGY, DE_STRATEGIES, KINDS, Kind, PlannerOptions,
                                 Shard, ShardingPlan, TableConfig, TablePlacement, check_int,
                                 check_optional_int, check_settings, check_tables,
                                 shard_bytes)


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _snake(m: int) -> Iterator[int]:
    while True:
        yield from range(m)
        yield from range(m - 1, -1, -1)


# (row_start, row_end, col_start, col_end, owner) of one shard, per table
_Layout = list[tuple[str, list[tuple[int, int, int, int, int | None]]]]


def _layout_bytes_balanced(tables: Sequence[TableConfig], m: int, options: PlannerOptions,
                           shard_load: Callable[..., int]
                           ) -> tuple[_Layout, list[list[int]]]:
    """tfhybrid's own planner: (kind, shards) per table and each position's table order."""
    col_thr, row_thr, dp_thr = options.thresholds
    # Geometry first: (kind, [(r0, r1, c0, c1), ...]) per table.
    geometry: _Geometry = []
    for t in tables:
        elements = t.rows * t.dim
        full = [(0, t.rows, 0, t.dim)]
        if t.keyed:
            geometry.append(_keyed_geometry(t, m))
        elif dp_thr is not None and elements <= dp_thr and t.cache_rows is None:
            geometry.append((Kind.DATA_PARALLEL, full))
        elif m > 1 and row_thr is not None and elements > row_thr:
            geometry.append((Kind.ROW_WISE, [(r0, r1, 0, t.dim)
                                            for r0, r1 in _split(t.rows, min(m, t.rows))]))
        elif m > 1 and col_thr is not None and elements > col_thr:
            n = min(-(-elements // col_thr), m, t.dim)
            if n > 1:
                geometry.append((Kind.COLUMN_WISE, [(0, t.rows, c0, c1)
                                                   for c0, c1 in _split(t.dim, n)]))
            else:
                geometry.append((Kind.TABLE_WISE, full))
        else:
            geometry.append((Kind.TABLE_WISE, full))
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
            if kind == Kind.DATA_PARALLEL:
                owners[ti, c0, r0] = None
            elif kind in (Kind.ROW_WISE, Kind.HASH_WISE):
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


def _layout_de(tables: Sequence[TableConfig], m: int, options: PlannerOptions
               ) -> tuple[_Layout, list[list[int]]]:
    """DE's DistEmbeddingStrategy placement: (kind, shards) per table, positions' orders."""
    strategy = options.strategy
    col_thr, row_thr, dp_thr = options.thresholds
    elements = [t.rows * t.dim for t in tables]
    dp, tp, rw = [], [], []
    for ti, e in enumerate(elements):
        if tables[ti].keyed:
            rw.append(ti)   # served as DE serves row-sliced tables, by hash
        elif dp_thr is not None and e <= dp_thr and tables[ti].cache_rows is None:
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
            layout.append((Kind.DATA_PARALLEL, [(0, t.rows, 0, t.dim, None)]))
        elif ti in tp:
            layout.append((Kind.COLUMN_WISE if len(shards[ti]) > 1 else Kind.TABLE_WISE,
                           shards[ti]))
        elif t.keyed:
            kind, geoms = _keyed_geometry(t, m)
            layout.append((kind, [(*g, i) for i, g in enumerate(geoms)]))
        elif m == 1:
            layout.append((Kind.TABLE_WISE, [(0, t.rows, 0, t.dim, 0)]))
        else:
            layout.append((Kind.ROW_WISE, [(r0, r1, 0, t.dim, i) for i, (r0, r1)
                                        in enumerate(_split(t.rows, min(m, t.rows)))]))
    # DE serves row-sliced tables after the table-parallel ones, in table order
    for p in range(m):
        order[p] += [ti for ti in rw if any(s[4] == p for s in layout[ti][1])]
    return layout, order


def _load_function(tables: Sequence[TableConfig], optimizer: str,
                   memory_budget_bytes: int | None) -> Callable[..., int]:
    def load_of(ti: int, r0: int, r1: int, c0: int, c1: int) -> int:
        param, opt = shard_bytes(tables[ti], r1 - r0, c1 - c0, optimizer)
        if memory_budget_bytes is not None and param + opt > memory_budget_bytes:
            raise ValueError(
                f"table {tables[ti].name!r}: shard rows {r0}:{r1} cols {c0}:{c1} needs "
                f"{param + opt} bytes, over memory_budget_bytes={memory_budget_bytes}")
        return param + opt
    return load_of


def _finish_plan(tables: list[TableConfig], d: int, m: int, options: PlannerOptions,
                 layout: _Layout, order: list[list[int]],
                 memory_budget_bytes: int | None, local_batch_size: int,
                 settings: EstimateSettings,
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

    ranks = rank_estimates(tables, placements, m, local_batch_size, d, settings)
    return ShardingPlan(d, m, options.strategy, placements, ranks, *options.thresholds,
                        local_batch_size,
                        tuple(tuple(o) for o in order), settings.optimizer,
                        settings.replica_sync, settings.sync_every, settings.comm_dtype,
                        mesh_layout, predicted)


def _keyed_geometry(t: TableConfig, m: int) -> tuple[str, list[tuple[int, int, int, int]]]:
    """A keyed table on every position: position p holds the keys with mix64(k) mod M ==
    p, in its share of the capacity (``rows``) as near-equal slot ranges."""
    if t.rows < m:
        raise ValueError(f"table {t.name!r} is keyed with capacity {t.rows}, fewer slots "
                         f"than the {m} positions of a model group; expected capacity >= {m}")
    return Kind.HASH_WISE, [(r0, r1, 0, t.dim) for r0, r1 in _split(t.rows, m)]


def _kind_geometry(t: TableConfig, kind: str, n: int, m: int
                   ) -> tuple[str, list[tuple[int, int, int, int]]]:
    full = [(0, t.rows, 0, t.dim)]
    if t.keyed or kind == Kind.HASH_WISE:
        if not t.keyed or kind != Kind.HASH_WISE:
            raise ValueError(f"table {t.name!r}: hash_wise is the one kind of a keyed "
                             f"table, and only of one; got kind {kind!r} for keyed="
                             f"{t.keyed}")
        return _keyed_geometry(t, m)
    if kind == Kind.DATA_PARALLEL:
        return Kind.DATA_PARALLEL, full
    if kind == Kind.TABLE_WISE or n == 1:
        return Kind.TABLE_WISE, full
    if kind == Kind.COLUMN_WISE:
        if not 1 <= n <= min(m, t.dim):
            raise ValueError(f"table {t.name!r}: column_wise needs 1 <= shards <= "
                             f"min(M={m}, dim={t.dim}), got {n}")
        return Kind.COLUMN_WISE, [(0, t.rows, c0, c1) for c0, c1 in _split(t.dim, n)]
    if kind == Kind.ROW_WISE:
        if not 1 <= n <= min(m, t.rows):
            raise ValueError(f"table {t.name!r}: row_wise needs 1 <= shards <= "
                             f"min(M={m}, rows={t.rows}), got {n}")
        return Kind.ROW_WISE, [(r0, r1, 0, t.dim) for r0, r1 in _split(t.rows, n)]
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
    check_settings(optimizer, replica_sync, sync_every, comm_dtype)
    check_optional_int("memory_budget_bytes", memory_budget_bytes)
    tables = check_tables(tables)
    kinds = list(kinds)
    if len(kinds) != len(tables):
        raise ValueError(f"kinds has {len(kinds)} entries for {len(tables)} tables")
    m = model_parallel
    geometry = [_kind_geometry(t, kind, n, m) for t, (kind, n) in zip(tables, kinds)]
    load_of = _load_function(tables, optimizer, memory_budget_bytes)
    layout_, order = _deal(geometry, m, load_of)
    settings = EstimateSettings(optimizer, replica_sync, sync_every, comm_dtype, unique_rows)
    return _finish_plan(tables, data_parallel, m, PlannerOptions(strategy), layout_, order,
                        memory_budget_bytes, local_batch_size, settings,
                        layout, tuple((str(k), float(v)) for k, v in predicted))


def plan_with_strategy(tables: Sequence[TableConfig], data_parallel: int, model_parallel: int,
                       options: PlannerOptions = PlannerOptions()) -> ShardingPlan:
    """The plan of one of :data:`~tfhybrid.plan.types.STRATEGIES` (DE's or
    ``bytes_balanced``; the rules are ``plan_sharding``'s), without the disk tier.

    >>> plan = plan_with_strategy([TableConfig("a", 100, 8)], 1, 2, PlannerOptions("basic"))
    >>> [(t.kind, len(t.shards)) for t in plan.tables]
    [('column_wise', 2)]
    """
    check_int("data_parallel", data_parallel, 1)
    check_int("model_parallel", model_parallel, 1)
    if options.strategy == COST_STRATEGY:
        raise ValueError(f"strategy={COST_STRATEGY!r} prices plans on a cluster: use "
                         "tfhybrid.plan.cost_strategy.plan_mesh")
    tables = check_tables(tables)
    m = model_parallel
    load_of = _load_function(tables, options.optimizer, options.memory_budget_bytes)
    if options.strategy in DE_STRATEGIES:
        layout, order = _layout_de(tables, m, options)
    else:   # bytes_balanced, tfhybrid's own
        layout, order = _layout_bytes_balanced(tables, m, options, load_of)
    settings = EstimateSettings(options.optimizer, options.replica_sync, options.sync_every,
                                options.comm_dtype, options.unique_rows)
    return _finish_plan(tables, data_parallel, m, options, layout, order,
                        options.memory_budget_bytes, options.local_batch_size, settings)
