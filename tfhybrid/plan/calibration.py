"""Calibration of the cost model: :class:`~tfhybrid.plan.cost_model.ComputeRates` fitted
to measured step times, and how far predictions land from measurements.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping, Sequence

from tfhybrid.plan.cost_model import ClusterSpec, ComputeRates, Workload, predict
from tfhybrid.plan.strategies import plan_with_strategy
from tfhybrid.plan.types import PlannerOptions, ShardingPlan, check_int, check_number


# A measured point (one benchmark configuration), as the emulated-cluster benchmark writes it:
#   nodes, ranks_per_node: the emulated cluster;
#   bandwidth_bytes_per_s: the shaped inter-node link (None = loopback: inter-node traffic
#     as fast as the template's intra-node link);
#   model_parallel, layout, replica_sync ("gradients"/"weights"), sync_every,
#   comm_dtype ("float32"/"float16"): the run's settings;
#   step_seconds: the median step time;
#   optional: "plan" (ShardingPlan JSON the run executed; default: plan_sharding with the
#     default strategy and the workload's settings), "workload" (a Workload dict replacing
#     the shared one).
_POINT_KEYS = ("nodes", "ranks_per_node", "bandwidth_bytes_per_s", "model_parallel", "layout",
               "replica_sync", "sync_every", "comm_dtype", "step_seconds")


def point_setup(point: Mapping[str, Any], cluster_template: ClusterSpec,
                workload: Workload) -> tuple[ShardingPlan, str, ClusterSpec, Workload]:
    """(plan, layout, cluster, workload) a measured point ran: the template's cluster with
    the point's nodes and bandwidth, the workload with the point's sync settings, and the
    point's plan (default: the default strategy's). ValueError naming what is missing."""
    missing = [k for k in _POINT_KEYS if k not in point]
    if missing:
        raise ValueError(f"measured point misses {missing}: {dict(point)!r}")
    check_number("step_seconds", point["step_seconds"], positive=True)
    if "workload" in point:
        workload = Workload.from_dict(point["workload"])
    workload = workload.with_settings(replica_sync=point["replica_sync"],
                                      sync_every=point["sync_every"],
                                      comm_dtype=point["comm_dtype"])
    bandwidth = point["bandwidth_bytes_per_s"]
    cluster = replace(cluster_template, nodes=point["nodes"],
                      ranks_per_node=point["ranks_per_node"],
                      inter_node_bandwidth=(cluster_template.intra_node_bandwidth
                                            if bandwidth is None else bandwidth))
    m = point["model_parallel"]
    if "plan" in point:
        plan = ShardingPlan.from_json(point["plan"])
    else:
        check_int("model_parallel", m, 1)
        if cluster.ranks % m:
            raise ValueError(f"model_parallel={m} does not divide {cluster.ranks} ranks")
        plan = plan_with_strategy(workload.tables, cluster.ranks // m, m, PlannerOptions(
            optimizer=workload.optimizer, local_batch_size=workload.local_batch_size,
            replica_sync=workload.replica_sync, sync_every=workload.sync_every,
            comm_dtype=workload.comm_dtype, unique_rows=workload.unique_rows))
    return plan, point["layout"], cluster, workload


def _solve_non_negative(rows: list[list[float]], target: list[float]) -> list[float]:
    """Least squares with coefficients >= 0 (drop the most negative column, refit)."""
    import numpy as np
    a, y = np.asarray(rows, dtype=float), np.asarray(target, dtype=float)
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        if active:
            # scale columns so a byte count and a constant weigh alike
            scale = np.maximum(np.abs(a[:, active]).max(axis=0), 1e-300)
            sol, *_ = np.linalg.lstsq(a[:, active] / scale, y, rcond=None)
            coef[active] = sol / scale
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            return [float(c) for c in coef]
        active.remove(min(negative, key=lambda j: coef[j]))


# the ComputeRates figures calibrate fits, in its design matrix's column order
FITTED_RATES = ("step_overhead_seconds", "collective_overhead_seconds", "lookup_bytes_per_s",
                "apply_bytes_per_s", "dense_seconds_per_sample")


def calibrate(points: Sequence[Mapping[str, Any]], cluster_template: ClusterSpec,
              workload: Workload, measured: Sequence[str] = ()) -> ComputeRates:
    """Fits ComputeRates to measured step times by non-negative least squares.

    Each point is priced with the template's links (its bandwidth replaced by the point's)
    and rates; the model is linear in (step overhead, collective overhead, 1/lookup rate,
    1/apply rate, dense seconds per sample), so those are fitted to step_seconds minus
    the predicted communication. Columns the points cannot tell apart (e.g. the dense
    time when every point has the same batch, which equals a constant) keep the
    template's value. Loopback points (bandwidth None) carry most of the compute signal.

    ``measured``: names from :data:`FITTED_RATES` whose template values were measured
    (a microbenchmark): they are kept as they are and only the others are fitted.
    """
    if len(points) < 2:
        raise ValueError(f"calibrate needs at least 2 measured points, got {len(points)}")
    unknown = [name for name in measured if name not in FITTED_RATES]
    if unknown:
        raise ValueError(f"measured={list(measured)!r}: {unknown} are not rates calibrate "
                         f"fits; expected names from {FITTED_RATES}")
    import numpy as np
    rates = cluster_template.rates
    design, target = [], []
    for point in points:
        plan, layout, cluster, work = point_setup(point, cluster_template, workload)
        pred = predict(plan, layout, cluster, work)
        design.append([1.0, pred.collective_calls, pred.lookup_bytes, pred.apply_bytes,
                       float(work.local_batch_size)])
        # the overlap term taken as rates.overlap * (gradient syncs): the fitted points are
        # meant to be ones whose communication is the shorter part (loopback)
        target.append(point["step_seconds"] - pred.communication_seconds
                      + rates.overlap * pred.behind_compute_seconds)
    a = np.asarray(design)
    template = [rates.step_overhead_seconds, rates.collective_overhead_seconds,
                1 / rates.lookup_bytes_per_s, 1 / rates.apply_rate(workload.optimizer),
                rates.dense_seconds_per_sample]
    # keep the columns that add rank, in the order above
    kept: list[int] = []
    for j in (j for j in range(a.shape[1]) if FITTED_RATES[j] not in measured):
        trial = kept + [j]
        cols = a[:, trial] / np.maximum(np.abs(a[:, trial]).max(axis=0), 1e-300)
        if np.abs(a[:, j]).max() > 0 and np.linalg.matrix_rank(cols, tol=1e-9) == len(trial):
            kept.append(j)
    fixed = [j for j in range(a.shape[1]) if j not in kept]
    y = np.asarray(target) - (a[:, fixed] @ np.asarray([template[j] for j in fixed])
                              if fixed else 0.0)
    coef = _solve_non_negative(a[:, kept].tolist(), list(y))
    fitted = list(template)
    for j, c in zip(kept, coef):
        fitted[j] = c
    apply_rates = dict(rates.apply_bytes_per_s)
    apply_rates[workload.optimizer] = 1 / fitted[3] if fitted[3] > 0 else math.inf
    return ComputeRates(1 / fitted[2] if fitted[2] > 0 else math.inf, apply_rates,
                        fitted[4], fitted[0], fitted[1], rates.overlap)


def validate(points: Sequence[Mapping[str, Any]], cluster_template: ClusterSpec,
             workload: Workload) -> list[tuple[Mapping[str, Any], float, float, float]]:
    """(point, predicted seconds, measured seconds, predicted / measured) for each point."""
    rows = []
    for point in points:
        plan, layout, cluster, work = point_setup(point, cluster_template, workload)
        predicted = predict(plan, layout, cluster, work).step_seconds
        measured = float(point["step_seconds"])
        rows.append((point, predicted, measured, predicted / measured))
    return rows
