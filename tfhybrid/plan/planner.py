"""The planner's entry: :func:`plan_sharding` picks a strategy and places the disk tier.

It stands above the strategies (:mod:`tfhybrid.plan.strategies`) and the cost strategy
(:mod:`tfhybrid.plan.cost_strategy`), which both build on the byte model
(:mod:`tfhybrid.plan.traffic`) and the plan's types (:mod:`tfhybrid.plan.types`).
"""

from __future__ import annotations

from typing import Any, Sequence

from tfhybrid.plan.cost_strategy import plan_mesh
from tfhybrid.plan.strategies import plan_with_strategy
from tfhybrid.plan.tiers import place_in_tiers
from tfhybrid.plan.types import (COST_STRATEGY, PLANNER_OPTION_NAMES, PlannerOptions,
                                 ShardingPlan, TableConfig, check_int, check_tables,
                                 dram_budget_bytes)


def plan_sharding(tables: Sequence[TableConfig], data_parallel: int, model_parallel: int,
                  options: PlannerOptions | None = None, **keywords: Any) -> ShardingPlan:
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
    time ``tfhybrid.plan.predict`` gives for this D x M mesh in ``layout`` on
    ``cluster`` (a ``ClusterSpec``) running ``workload`` (a ``Workload`` whose tables are
    ``tables``; its optimizer, batch, sync mode and comm dtype are the plan's), under
    ``cluster.memory_per_rank``; the plan records the layout and the predictions
    (:meth:`ShardingPlan.describe` prints them). ``tfhybrid.plan.plan_for_cluster``
    also chooses M and the layout.

    **Options** are one :class:`~tfhybrid.plan.types.PlannerOptions` (``options=``), or
    its fields as keywords (``strategy="basic"``, ``optimizer="adam"``, ...), which make
    one; not both. Load = param + optimizer bytes. With ``memory_budget_bytes`` a shard or
    position over budget raises ValueError naming the table and the bytes.
    ``memory_budget`` (``{"dram": bytes}``, per rank) instead moves tables into the disk
    tier until every position fits (:func:`place_in_tiers`); a table's ``cache_rows``
    puts it there explicitly, and a tiered table is never replicated. ``optimizer``,
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
    >>> plan_sharding([TableConfig("only", 100, 8)], 1, 4,
    ...               options=PlannerOptions("basic")).table("only") == de.table("only")
    True
    """
    check_int("data_parallel", data_parallel, 1)
    check_int("model_parallel", model_parallel, 1)
    options = planner_options(options, keywords)
    dram_budget = dram_budget_bytes(options.memory_budget, options.memory_budget_bytes)
    tables = check_tables(tables)
    if options.strategy == COST_STRATEGY:
        plan = plan_mesh(tables, data_parallel, model_parallel, options.layout,
                         options.cluster, options.workload)
    else:
        plan = plan_with_strategy(tables, data_parallel, model_parallel, options)
    return plan if dram_budget is None else place_in_tiers(plan, dram_budget, tables)


def planner_options(options: PlannerOptions | None, keywords: dict[str, Any]
                    ) -> PlannerOptions:
    """The one ``PlannerOptions`` of ``options=`` or of its fields given as keywords;
    ``TypeError`` names a keyword that is not a field, ``ValueError`` a mix of both."""
    unknown = sorted(set(keywords) - set(PLANNER_OPTION_NAMES))
    if unknown:
        raise TypeError(f"plan_sharding got unknown options {unknown}; expected "
                        f"PlannerOptions fields {list(PLANNER_OPTION_NAMES)}")
    if options is None:
        return PlannerOptions(**keywords)
    if not isinstance(options, PlannerOptions):
        raise ValueError(f"options must be a PlannerOptions, got {options!r}")
    if keywords:
        given = ", ".join(f"{name}={value!r}" for name, value in sorted(keywords.items()))
        raise ValueError(f"options=PlannerOptions(...) and the keywords {given} both set "
                         "planner options: give one of them")
    return options
