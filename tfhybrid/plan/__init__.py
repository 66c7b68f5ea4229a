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

``tfhybrid.planner`` and ``tfhybrid.cost_model`` re-export these names for existing code.
"""
