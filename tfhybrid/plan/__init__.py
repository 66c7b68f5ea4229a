"""Sharding planning for hybrid (2D) embedding training: pure Python, no TensorFlow.

One module, one job; each imports only the ones listed before it:

- ``types``: constants, :class:`~tfhybrid.plan.types.Kind`, tables, shards, plans, checks;
- ``tiers``: which tables move into the disk tier under a DRAM budget;
- ``traffic``: the byte model (what a position sends, holds and syncs per step);
- ``strategies``: DE's and tfhybrid's placements, and plans with given kinds;
- ``cost_model``: a plan's predicted step time and memory on a cluster;
- ``cost_strategy``: kinds and mesh chosen by predicted step time;
- ``calibration``: compute rates fitted to measured steps;
- ``planner``: ``plan_sharding``, the entry that picks a strategy.

This package is the planner's public path: the names below are its API,
``from tfhybrid.plan import plan_sharding, TableConfig, plan_for_cluster``. The old paths
``tfhybrid.plan`` and ``tfhybrid.plan`` still re-export them for saved code, with a
``DeprecationWarning`` naming this one.

>>> from tfhybrid.plan import TableConfig, plan_sharding
>>> plan_sharding([TableConfig("t", 100, 8)], 1, 2).tables[0].name
't'
"""

from __future__ import annotations

from tfhybrid.plan.calibration import calibrate, point_setup, validate
from tfhybrid.plan.cost_model import (ALLREDUCE_ALGORITHMS, DEFAULT_ZIPF_EXPONENT,
                                      DENSE_VALUE_BYTES, ClusterSpec, CollectiveCost,
                                      ComputeRates, Prediction, Workload,
                                      expected_unique_rows, predict)
from tfhybrid.plan.cost_strategy import plan_for_cluster, plan_mesh
from tfhybrid.plan.planner import plan_sharding
from tfhybrid.plan.strategies import plan_with_kinds, plan_with_strategy
from tfhybrid.plan.tiers import (TIER_BYTES_PER_ROW, TIER_BYTES_PER_SLOT,
                                 TIER_FIITED_BYTES_PER_ROW, TIER_FIITED_BYTES_PER_SLOT,
                                 TIER_OPTIMIZERS, TIER_PINNED_STEPS, place_in_tiers,
                                 shard_cache_rows, tier_dram_bytes)
from tfhybrid.plan.traffic import (PositionTraffic, position_traffic, positions_traffic,
                                   sync_bytes, sync_is_sparse, weight_sync_bytes)
from tfhybrid.plan.types import (ALL_STRATEGIES, BUDGET_TIERS, COMBINERS, COST_STRATEGY,
                                 DEFAULT_STRATEGY, DEFAULT_SYNC_VALUE_BYTES, DE_STRATEGIES,
                                 DTYPE_BYTES, ID_BYTES_LARGE, ID_BYTES_SMALL, INDEX_BYTES,
                                 KINDS, OPTIMIZER_STATE, OPTIMIZERS, REPLICA_SYNC, STRATEGIES,
                                 Kind, PlannerOptions, RankEstimate, Shard, ShardingPlan,
                                 TableConfig, TablePlacement, aligned_table, check_int,
                                 check_tables, format_bytes, input_ids_per_position,
                                 dram_budget_bytes, optimizer_state_bytes,
                                 table_ids_per_position)

__all__ = sorted([
    "TableConfig", "Shard", "TablePlacement", "RankEstimate", "PositionTraffic",
    "ShardingPlan", "plan_sharding", "plan_with_kinds", "position_traffic",
    "positions_traffic", "place_in_tiers", "shard_cache_rows", "tier_dram_bytes",
    "BUDGET_TIERS", "TIER_OPTIMIZERS", "TIER_PINNED_STEPS", "sync_is_sparse", "sync_bytes",
    "weight_sync_bytes", "optimizer_state_bytes", "input_ids_per_position",
    "table_ids_per_position", "DTYPE_BYTES", "COMBINERS", "STRATEGIES", "ALL_STRATEGIES",
    "COST_STRATEGY", "DE_STRATEGIES", "DEFAULT_STRATEGY", "OPTIMIZERS", "OPTIMIZER_STATE",
    "REPLICA_SYNC", "KINDS", "check_int", "Kind", "PlannerOptions", "plan_with_strategy",
    "TIER_BYTES_PER_ROW", "TIER_BYTES_PER_SLOT", "TIER_FIITED_BYTES_PER_ROW",
    "TIER_FIITED_BYTES_PER_SLOT", "dram_budget_bytes", "DEFAULT_SYNC_VALUE_BYTES",
    "ID_BYTES_LARGE", "ID_BYTES_SMALL", "INDEX_BYTES", "aligned_table", "check_tables",
    "format_bytes", "ComputeRates", "ClusterSpec", "Workload", "CollectiveCost",
    "Prediction", "predict", "plan_mesh", "plan_for_cluster", "calibrate", "validate",
    "expected_unique_rows", "ALLREDUCE_ALGORITHMS", "DEFAULT_ZIPF_EXPONENT",
    "DENSE_VALUE_BYTES", "point_setup"
])
