"""The cost strategy: each table's kind, and the mesh, chosen by predicted step time.

:func:`plan_mesh` is ``plan_sharding(strategy="cost")`` on a fixed D x M mesh;
:func:`plan_for_cluster` also chooses M and the layout. Candidates are priced with
:func:`tfhybrid.plan.cost_model.predict` and built with
:func:`tfhybrid.plan.strategies.plan_with_kinds`.
"""

from __future__ import annotations

from typing import Sequence

from tfhybrid.mesh import LAYOUTS
from tfhybrid.plan.cost_model import ClusterSpec, Prediction, Workload, predict
from tfhybrid.plan.strategies import plan_with_kinds
from tfhybrid.plan.types import (COST_STRATEGY, Kind, ShardingPlan, TableConfig,
                                 check_tables, shard_bytes)


def _kind_options(t: TableConfig, m: int) -> list[tuple[str, int]]:
    if t.keyed:   # a keyed table has one kind: its keys' hash owns them
        return [(Kind.HASH_WISE, m)]
    options = [(Kind.TABLE_WISE, 1), (Kind.DATA_PARALLEL, 1)]
    if m > 1:
        if t.rows >= 2:
            options.append((Kind.ROW_WISE, min(m, t.rows)))
        widths = {n for n in (2, 4, 8, min(m, t.dim)) if 2 <= n <= min(m, t.dim)}
        options += [(Kind.COLUMN_WISE, n) for n in sorted(widths)]
    return options


def _table_bytes(t: TableConfig, optimizer: str) -> int:
    return sum(shard_bytes(t, t.rows, t.dim, optimizer))


# coordinate descent runs while M * tables is at most this (each evaluation prices every
# position); larger meshes choose among the whole-model candidates only
_DESCENT_LIMIT = 2048


def plan_mesh(tables: Sequence[TableConfig], data_parallel: int, model_parallel: int,
              layout: str, cluster: ClusterSpec, workload: Workload,
              refine: bool | None = None) -> ShardingPlan:
    """The cost strategy on a fixed D x M mesh: each table's kind minimizing step time.

    Candidates: every table table-wise; every table row-wise; tables above 1/M of the
    model row-wise, the rest table-wise; tables under 1/(64 M) of the model data-parallel
    with the rest table-wise. The best is refined by coordinate descent (each table in
    decreasing size: table_wise, data_parallel, row_wise over min(M, rows), column_wise
    over 2, 4, 8, min(M, dim) slices; two passes) when M * tables <= 2048. Plans over
    ``cluster.memory_per_rank`` lose to any that fits; ValueError naming the budget when
    none fits. ``refine`` forces the descent on or off (None: the size rule above).
    """
    if not isinstance(cluster, ClusterSpec) or not isinstance(workload, Workload):
        raise ValueError(f"strategy={COST_STRATEGY!r} needs cluster=ClusterSpec(...) and "
                         f"workload=Workload(...), got cluster={cluster!r}, "
                         f"workload={workload!r}")
    tables = check_tables(tables)
    if tuple(tables) != workload.tables:
        raise ValueError(f"tables {[t.name for t in tables]} are not the workload's "
                         f"{[t.name for t in workload.tables]}")
    m = model_parallel

    def build(kinds: Sequence[tuple[str, int]], predicted: Sequence = ()) -> ShardingPlan:
        return plan_with_kinds(
            tables, data_parallel, m, kinds, optimizer=workload.optimizer,
            local_batch_size=workload.local_batch_size, replica_sync=workload.replica_sync,
            sync_every=workload.sync_every, comm_dtype=workload.comm_dtype,
            unique_rows=workload.unique_rows, layout=layout, predicted=predicted)

    def score(kinds: Sequence[tuple[str, int]]) -> tuple[float, float, Prediction]:
        pred = predict(build(kinds), layout, cluster, workload)
        over = max(0, pred.memory_per_rank_bytes - pred.memory_budget_bytes)
        return over, pred.step_seconds, pred

    sizes = [_table_bytes(t, workload.optimizer) for t in tables]
    total = sum(sizes)
    options = [_kind_options(t, m) for t in tables]
    whole = (Kind.TABLE_WISE, 1)
    row_wise = [next((o for o in opts if o[0] == Kind.ROW_WISE), whole) for opts in options]
    candidates = [[whole] * len(tables), row_wise,
                  [rw if s * m > total else whole for s, rw in zip(sizes, row_wise)],
                  [(Kind.DATA_PARALLEL, 1) if s * 64 * m < total else whole for s in sizes]]
    # a table with one option (a keyed table's hash_wise) has it in every candidate
    candidates = [[opts[0] if len(opts) == 1 else kind for kind, opts in zip(kinds, options)]
                  for kinds in candidates]
    best_kinds, best = None, None
    for kinds in candidates:
        scored = score(kinds)
        if best is None or scored[:2] < best[:2]:
            best_kinds, best = list(kinds), scored
    if refine if refine is not None else m * len(tables) <= _DESCENT_LIMIT:
        for _ in range(2):
            improved = False
            for ti in sorted(range(len(tables)), key=lambda i: -sizes[i]):
                for option in options[ti]:
                    if option == best_kinds[ti]:
                        continue
                    trial = best_kinds[:ti] + [option] + best_kinds[ti + 1:]
                    scored = score(trial)
                    if scored[:2] < best[:2]:
                        best_kinds, best, improved = trial, scored, True
            if not improved:
                break
    over, _, pred = best
    if over > 0:
        raise ValueError(f"no sharding of these tables on D x M = {data_parallel} x {m} "
                         f"({layout}) fits memory_per_rank={cluster.memory_per_rank} bytes; "
                         f"the best needs {pred.memory_per_rank_bytes} bytes per rank")
    return build(best_kinds, pred.as_plan_data())


def plan_for_cluster(tables: Sequence[TableConfig], cluster: ClusterSpec, workload: Workload,
                     layouts: Sequence[str] = LAYOUTS,
                     model_parallel: Sequence[int] | None = None,
                     refine: bool | None = None) -> tuple[ShardingPlan, str, Prediction]:
    """Chooses M (a divisor of the cluster's ranks), the layout and the tables' kinds.

    Minimizes predicted step time under ``cluster.memory_per_rank`` over every M in
    ``model_parallel`` (default: all divisors) and layout (M = 1 and M = N are the same in
    both layouts: only the first is tried; ``refine`` as in :func:`plan_mesh`). Returns (plan, layout, prediction); ValueError
    naming the budget when no mesh fits.

    >>> from tfhybrid.plan.cost_model import ComputeRates
    >>> rates = ComputeRates(1e9, {"rowwise_adagrad": 1e9})
    >>> slow = ClusterSpec(2, 2, 1e10, 1e7, 0.0, 0.0, 1 << 30, rates)
    >>> tables = (TableConfig("a", 10_000, 16, hotness=8.0), TableConfig("b", 10_000, 16))
    >>> plan, layout, pred = plan_for_cluster(tables, slow, Workload(tables, 256))
    >>> (plan.model_parallel, layout) != (4, "model_major") and pred.fits
    True
    """
    n = cluster.ranks
    divisors = [m for m in range(1, n + 1) if n % m == 0]
    if model_parallel is not None:
        bad = [m for m in model_parallel if m not in divisors]
        if bad:
            raise ValueError(f"model_parallel {bad} do not divide the cluster's {n} ranks")
        divisors = list(model_parallel)
    for lay in layouts:
        if lay not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {lay!r}")
    best: tuple[ShardingPlan, str, Prediction] | None = None
    failures = []
    for m in divisors:
        for lay in (layouts[:1] if m in (1, n) else layouts):
            try:
                plan = plan_mesh(tables, n // m, m, lay, cluster, workload, refine)
            except ValueError as e:
                failures.append(str(e))
                continue
            pred = predict(plan, lay, cluster, workload)
            if best is None or pred.step_seconds < best[2].step_seconds:
                best = (plan, lay, pred)
    if best is None:
        raise ValueError(f"no mesh of {n} ranks fits memory_per_rank="
                         f"{cluster.memory_per_rank} bytes: " + "; ".join(failures[:3]))
    return best
