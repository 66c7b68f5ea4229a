"""The sharding planner's import path: every name here is re-exported from ``tfhybrid.plan``.

The planner is a package now, one job per module (see ``tfhybrid.plan``): the plan's types
and constants in ``tfhybrid.plan.types``, the disk tier in ``tfhybrid.plan.tiers``, the
byte model in ``tfhybrid.plan.traffic``, the placements in ``tfhybrid.plan.strategies``
and ``plan_sharding`` in ``tfhybrid.plan.planner``. This module defines nothing; it keeps
``tfhybrid.planner.X`` working for users, scripts and saved code.

>>> from tfhybrid.plan.planner import plan_sharding as entry
>>> plan_sharding is entry
True
"""

from __future__ import annotations

from tfhybrid.plan.planner import plan_sharding
from tfhybrid.plan.strategies import plan_with_kinds, plan_with_strategy
from tfhybrid.plan.tiers import (BUDGET_TIERS, TIER_BYTES_PER_ROW, TIER_BYTES_PER_SLOT,
                                 TIER_FIITED_BYTES_PER_ROW, TIER_FIITED_BYTES_PER_SLOT,
                                 TIER_OPTIMIZERS, TIER_PINNED_STEPS, dram_budget_bytes,
                                 place_in_tiers, shard_cache_rows, tier_dram_bytes)
from tfhybrid.plan.traffic import (PositionTraffic, position_traffic, positions_traffic,
                                   sync_bytes, sync_is_sparse, weight_sync_bytes)
from tfhybrid.plan.types import (ALL_STRATEGIES, COMBINERS, COST_STRATEGY,
                                 DEFAULT_STRATEGY, DEFAULT_SYNC_VALUE_BYTES, DE_STRATEGIES,
                                 DTYPE_BYTES, ID_BYTES_LARGE, ID_BYTES_SMALL, INDEX_BYTES,
                                 KINDS, OPTIMIZER_STATE, OPTIMIZERS, REPLICA_SYNC, STRATEGIES,
                                 Kind, PlannerOptions, RankEstimate, Shard, ShardingPlan,
                                 TableConfig, TablePlacement, aligned_table, check_int,
                                 check_tables, format_bytes, input_ids_per_position,
                                 optimizer_state_bytes, table_ids_per_position)

__all__ = ["TableConfig", "Shard", "TablePlacement", "RankEstimate", "PositionTraffic",
           "ShardingPlan", "plan_sharding", "plan_with_kinds", "position_traffic",
           "positions_traffic", "place_in_tiers", "shard_cache_rows", "tier_dram_bytes",
           "BUDGET_TIERS", "TIER_OPTIMIZERS", "TIER_PINNED_STEPS",
           "sync_is_sparse", "sync_bytes", "weight_sync_bytes", "optimizer_state_bytes",
           "input_ids_per_position", "table_ids_per_position", "DTYPE_BYTES", "COMBINERS",
           "STRATEGIES", "ALL_STRATEGIES", "COST_STRATEGY", "DE_STRATEGIES",
           "DEFAULT_STRATEGY", "OPTIMIZERS", "OPTIMIZER_STATE", "REPLICA_SYNC", "KINDS",
           "check_int", "Kind", "PlannerOptions", "plan_with_strategy",
           # public before the package too, outside the old __all__
           "TIER_BYTES_PER_ROW", "TIER_BYTES_PER_SLOT", "TIER_FIITED_BYTES_PER_ROW",
           "TIER_FIITED_BYTES_PER_SLOT", "dram_budget_bytes", "DEFAULT_SYNC_VALUE_BYTES",
           "ID_BYTES_LARGE", "ID_BYTES_SMALL", "INDEX_BYTES", "aligned_table",
           "check_tables", "format_bytes"]
