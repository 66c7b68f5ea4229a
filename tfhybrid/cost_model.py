"""The cost model's import path: every name here is re-exported from ``tfhybrid.plan``.

The prediction (ClusterSpec, Workload, predict, ...) is ``tfhybrid.plan.cost_model``, the
cost strategy (plan_mesh, plan_for_cluster) ``tfhybrid.plan.cost_strategy`` and the fit
of compute rates (calibrate, validate) ``tfhybrid.plan.calibration``. This module defines
nothing; it keeps ``tfhybrid.cost_model.X`` working for users, scripts and benchmarks.

>>> from tfhybrid.plan.cost_model import predict as priced
>>> predict is priced
True
"""

from __future__ import annotations

from tfhybrid.plan.calibration import calibrate, point_setup, validate
from tfhybrid.plan.cost_model import (ALLREDUCE_ALGORITHMS, DEFAULT_ZIPF_EXPONENT,
                                      DENSE_VALUE_BYTES, ClusterSpec, CollectiveCost,
                                      ComputeRates, Prediction, Workload,
                                      expected_unique_rows, predict)
from tfhybrid.plan.cost_strategy import plan_for_cluster, plan_mesh

__all__ = ["ComputeRates", "ClusterSpec", "Workload", "CollectiveCost", "Prediction",
           "predict", "plan_mesh", "plan_for_cluster", "calibrate", "validate",
           "expected_unique_rows", "ALLREDUCE_ALGORITHMS", "DEFAULT_ZIPF_EXPONENT",
           # public before the package too, outside the old __all__
           "DENSE_VALUE_BYTES", "point_setup"]
