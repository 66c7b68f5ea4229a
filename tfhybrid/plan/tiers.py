"""The disk tier in a plan: which tables move out of DRAM, and the DRAM a tiered shard takes.

``memory_budget={"dram": bytes}`` (per rank) makes :func:`place_in_tiers` move tables into
the disk tier (``tfhybrid.tiers``) until every position fits; a table's ``cache_rows`` is
how many of its rows stay in DRAM.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from tfhybrid.plan.types import (KEYED_SLOT_BYTES, Kind, Shard, ShardingPlan, TableConfig,
                                 check_int, optimizer_state_bytes)

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

    >>> from tfhybrid.plan.planner import plan_sharding
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
            keyed = nrows * KEYED_SLOT_BYTES if tables[ti].keyed else 0
            return (nrows * width * 4 + keyed
                    + optimizer_state_bytes(nrows, width, plan.optimizer))
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
                   and placements[ti].kind not in (Kind.DATA_PARALLEL, Kind.HASH_WISE) and least[ti] < rows_of[ti]
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
