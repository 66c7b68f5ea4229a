"""tfhybrid.plan's predicted step time against the emulated cluster's measurements
(issue 13, section 3).

Input: the points.json that benchmarks/cluster_comm.py wrote (every point carries the
plan its run executed, the table sizes and the dense parameter count). The model is
fitted in two parts, each on its own points:

* on the unshaped ("loopback") points, where communication is nearly free: five compute
  figures (step overhead, per-collective overhead, lookup and optimizer byte rates, dense
  time per sample) and the unshaped link's rate (a 1-D search; the two cores, not the
  veth, set it);
* on the points of the fastest shaped link (1000 Mbit/s): the overlap of communication
  with compute (a 1-D search over [0, 1]), the one figure unshaped points cannot show.

Every other point (the slower links) is then predicted from the bandwidth tc gave its
links, and compared with what its job measured: the mean step (global batch / samples per
second over the timed steps, which includes the periodic weight syncs), with the median
and p25-p75 beside it.

The link rate the model sees is tc's rate times TCP's goodput share (1448 payload bytes in
each 1514-byte frame, ACKs aside).

points.json holds every run of the grid (several files: their runs together); a point's
measured step is the median over the runs (``cluster_comm.merge``), printed with their
min-max. Writes validation.txt (the table and the count within +-20%, with a provenance
header naming the points' files and their commits), validation.json and
cost_model_validation.png (scatter) into --out.

Rates a microbenchmark can measure (lookup and apply bytes/s, dense seconds per sample, a
collective call's overhead: ``cost_model_rates.py``, ``--rates``) are taken as measured, and
only the step overhead and the overlap (and the unshaped link) are fitted; the same fit with
every rate fitted is reported beside it.

A second workload's points (``--other_workload``, cluster_comm.py ``--workload second``:
other table sizes, width, batch and towers) are all held out: predicted with the rates and
overlap fitted on the first, and reported as they come.

Usage: .venv/bin/python benchmarks/cost_model_validation.py [--points P [P ...]]
       [--other_workload P [P ...]] [--rates DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import _results  # beside this script; it puts the checkout first on sys.path
import cluster_comm  # noqa: E402  (beside this script: the points' format and merge)
from tfhybrid import plan as planning  # noqa: E402
from tfhybrid.plan import TableConfig  # noqa: E402

# TCP payload per Ethernet frame at MTU 1500 (timestamps on): the share of tc's rate
# that carries data
TCP_GOODPUT = 1448 / 1514
TOLERANCE = 0.20
# no netem here: a message's latency is the software stack's, tens of microseconds
LATENCY_S = 50e-6
# machine memory shared by the ranks (24 GiB), for the memory check only
MACHINE_MEMORY = 24 * 2**30
# the unshaped link: searched over this geometric grid (bytes/s)
UNSHAPED_GRID = [0.02e9 * 1.25 ** i for i in range(32)]


def _workload(point: dict, embedding_dim: int) -> planning.Workload:
    names = [t["name"] for t in point["plan"]["tables"]]
    tables = tuple(TableConfig(name, rows, embedding_dim)
                   for name, rows in zip(names, point["table_rows"]))
    ranks = point["nodes"] * point["ranks_per_node"]
    return planning.Workload(tables=tables, local_batch_size=point["global_batch"] // ranks,
                               dense_parameters=point["dense_parameters"],
                               optimizer=point["plan"]["optimizer"], dense_optimizer="adam")


def _model_point(point: dict) -> dict:
    bw = point["bandwidth_mbit"]
    return {"nodes": point["nodes"], "ranks_per_node": point["ranks_per_node"],
            "bandwidth_bytes_per_s": None if bw is None else bw * 1e6 / 8 * TCP_GOODPUT,
            "model_parallel": point["model_parallel"], "layout": point["layout"],
            "replica_sync": point.get("replica_sync", "gradients"),
            "sync_every": point.get("sync_every", 1),
            "comm_dtype": "float16" if point.get("communication") == "float16" else None,
            "step_seconds": point["mean_step_seconds"],
            "plan": json.dumps(point["plan"])}


def _default_rates(overlap: float = 0.0) -> planning.ComputeRates:
    # a starting point only: calibrate replaces every figure the points determine
    return planning.ComputeRates(1e9, {"rowwise_adagrad": 1e9}, 1e-5, 0.01, 1e-3, overlap)


def _template(nodes: int, per_node: int, unshaped: float, rates=None) -> planning.ClusterSpec:
    rates = rates or _default_rates()
    return planning.ClusterSpec(nodes=nodes, ranks_per_node=per_node,
                                  intra_node_bandwidth=unshaped, inter_node_bandwidth=unshaped,
                                  intra_node_latency=LATENCY_S, inter_node_latency=LATENCY_S,
                                  memory_per_rank=MACHINE_MEMORY // (nodes * per_node),
                                  rates=rates)


def _relative_errors(rows) -> list[float]:
    return [abs(ratio - 1.0) for _, _, _, ratio in rows]


OVERLAP_GRID = [i / 40 for i in range(41)]


def held_out_errors(points: list[dict], template: planning.ClusterSpec,
                    workload: planning.Workload) -> dict:
    """How well ``template``'s rates predict ``points``: the overlap, the count within
    TOLERANCE, and the median and largest relative error.

    >>> rates = planning.ComputeRates(1e9, {"rowwise_adagrad": 1e9}, overlap=0.5)
    >>> sorted(held_out_errors([], _template(2, 2, 1e9, rates), None))
    ['inside', 'max_error', 'median_error', 'overlap', 'points']
    """
    errors = sorted(_relative_errors(planning.validate(points, template, workload))
                    if points else [])
    return {"overlap": template.rates.overlap, "points": len(errors),
            "inside": sum(e <= TOLERANCE for e in errors),
            "median_error": statistics.median(errors) if errors else 0.0,
            "max_error": errors[-1] if errors else 0.0}


def fit_overlap(points: list[dict], rates, unshaped: float, workload) -> float:
    """The overlap in OVERLAP_GRID minimizing the worst relative error on ``points``."""
    def worst(overlap):
        rows = planning.validate(
            points, _template(2, 2, unshaped, dataclasses.replace(rates, overlap=overlap)),
            workload)
        return max(_relative_errors(rows)), statistics.mean(_relative_errors(rows))
    return min(OVERLAP_GRID, key=worst)


# the rates cost_model_rates.py measures: kept as measured, never fitted
MEASURED_RATES = ("lookup_bytes_per_s", "apply_bytes_per_s", "dense_seconds_per_sample",
                  "collective_overhead_seconds")


def fit(points: list[dict], workload: planning.Workload, overlap: float = 0.0,
        measured: planning.ComputeRates | None = None):
    """(rates, unshaped link rate) minimizing the worst relative error on ``points``; with
    ``measured`` rates, only what they leave out (the step overhead) is fitted."""
    best = None
    for unshaped in UNSHAPED_GRID:
        start = (_default_rates(overlap) if measured is None
                 else dataclasses.replace(measured, overlap=overlap))
        template = _template(2, 2, unshaped, start)
        try:
            rates = planning.calibrate(points, template, workload,
                                         measured=() if measured is None else MEASURED_RATES)
        except ValueError:
            continue
        rows = planning.validate(points, _template(2, 2, unshaped, rates), workload)
        score = (max(_relative_errors(rows)), statistics.mean(_relative_errors(rows)))
        if best is None or score < best[0]:
            best = (score, rates, unshaped)
    if best is None:
        raise RuntimeError("calibration failed at every unshaped link rate")
    return best[1], best[2]


def measured_rates(path: str, workload: dict) -> planning.ComputeRates | None:
    """The rates cost_model_rates.py measured for ``workload`` (its rates_<name>.json), or
    None when ``path`` does not exist; SystemExit when it holds another workload."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        recorded = json.load(f)
    if recorded["workload"] != workload:
        raise SystemExit(f"{path} measured another workload: {recorded['workload']}")
    return planning.ComputeRates(**recorded["rates"])


def fit_rates_and_overlap(groups: dict, workload: planning.Workload,
                          measured: planning.ComputeRates | None):
    """(rates with the fitted overlap, unshaped link rate): the compute on the unshaped
    points, then the overlap on the fastest link's, twice (they depend a little on each
    other)."""
    overlap = 0.0
    for _ in range(2):
        rates, unshaped = fit([mp for mp, _ in groups["fit compute"]], workload, overlap,
                              measured)
        overlap = fit_overlap([mp for mp, _ in groups["fit overlap"]], rates, unshaped,
                              workload)
    return dataclasses.replace(rates, overlap=overlap), unshaped


def _read_points(paths: list[str]) -> tuple[list, list[str], list[dict]]:
    """(every run's points, "path (commit ...)" per file, each file's workload) of
    cluster_comm.py's points.json files, which must share one workload."""
    runs, sources, workloads = [], [], []
    for path in paths:
        with open(path) as f:
            recorded = json.load(f)
        workloads.append(recorded["workload"])
        if workloads[-1] != workloads[0]:
            raise SystemExit(f"{path}: another workload than {paths[0]}'s")
        runs += recorded["runs"] if "runs" in recorded else [recorded["points"]]
        source = recorded.get("provenance", {})
        sources.append(f"{os.path.relpath(path, _results.ROOT)} (commit "
                       f"{source.get('commit', 'not recorded')})")
    return runs, sources, workloads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_dir = os.path.join(_results.RESULTS, "cluster_comm")
    parser.add_argument("--points", nargs="+",
                        default=[os.path.join(default_dir, "points.json")],
                        help="cluster_comm.py's points.json (every run of its grid); "
                             "several files: their runs together (a file of one run, "
                             "written before --runs, holds \"points\")")
    parser.add_argument("--other_workload", nargs="*", default=[os.path.join(
        _results.RESULTS, "cluster_comm_second_workload", "points.json")],
        help="points.json of another workload (cluster_comm.py --workload second): every "
             "point held out, predicted by the rates fitted on --points")
    parser.add_argument("--rates", default=os.path.join(_results.RESULTS, "cost_model_rates"),
                        help="cost_model_rates.py's folder: rates measured per workload "
                             "(rates_dlrm.json, rates_second.json); without them every "
                             "rate is fitted")
    parser.add_argument("--out", default=default_dir)
    args = parser.parse_args()
    runs, sources, workloads = _read_points(args.points)
    measured = cluster_comm.merge(runs)
    dim = workloads[0]["embedding_dim"]
    workload = _workload(measured[0], dim)
    model_points = [_model_point(p) for p in measured]
    shaped = sorted({p["bandwidth_mbit"] for p in measured if p["bandwidth_mbit"]})
    if not shaped:
        raise SystemExit("need shaped points to fit the overlap and to predict")
    overlap_link = shaped[-1]

    def kind_of(p):
        if p["bandwidth_mbit"] is None:
            return "fit compute"
        return "fit overlap" if p["bandwidth_mbit"] == overlap_link else "held out"

    groups = {k: [(mp, p) for mp, p in zip(model_points, measured) if kind_of(p) == k]
              for k in ("fit compute", "fit overlap", "held out")}
    if len(groups["fit compute"]) < 2 or not groups["held out"]:
        raise SystemExit("need unshaped points, the fastest link's and slower links' points")
    rates_dir = args.rates
    measured = measured_rates(os.path.join(rates_dir, "rates_dlrm.json"), workloads[0])
    # the headline fits only what cost_model_rates.py cannot measure; every rate fitted
    # is shown beside it
    variants = {"every rate fitted": fit_rates_and_overlap(groups, workload, None)}
    if measured is not None:
        variants = {"measured rates": fit_rates_and_overlap(groups, workload, measured),
                    **variants}
    headline = next(iter(variants))
    rates, unshaped = variants[headline]
    overlap = rates.overlap
    lines = [_results.LOAD_NOT_MEASURED,
             f"# points: {', '.join(sources)}; {len(runs)} run(s) merged by "
             f"cluster_comm.merge",
             f"{headline}: "
             + ("lookup, apply, dense and per-collective rates from "
                f"{os.path.relpath(rates_dir, _results.ROOT)}/rates_dlrm.json; step overhead "
                if measured is not None else "compute ")
             + f"fitted on {len(groups['fit compute'])} unshaped points (unshaped link "
             f"{unshaped / 1e9:.2f} GB/s) and the overlap on {len(groups['fit overlap'])} "
             f"points at {overlap_link:g} Mbit/s: {rates}", "",
             f"measured: the mean step of each run (over its timed steps, weight syncs "
             f"included), median over {len(runs)} run(s)", ""]
    header = (f"{'topology':8} {'link':>10} {'config':12} {'measured ms':>11} "
              f"{'runs (min-max)':>16} {'predicted ms':>12} {'pred/meas':>9}  comm share")
    lines += [header, "-" * len(header)]

    def row(p: dict, mp: dict, template, work, kind: str) -> dict:
        [(_, predicted, measured_s, ratio)] = planning.validate([mp], template, work)
        pred = planning.predict(*planning.point_setup(mp, template, work))
        link = "unshaped" if p["bandwidth_mbit"] is None else f"{p['bandwidth_mbit']:g} Mb/s"
        spread = f"{1e3 * min(p['run_steps']):.0f}-{1e3 * max(p['run_steps']):.0f}"
        lines.append(f"{p['topology']:8} {link:>10} {p['name']:12} {1e3 * measured_s:11.1f} "
                     f"{spread:>16} {1e3 * predicted:12.1f} {ratio:9.2f}  "
                     f"{pred.communication_seconds / pred.step_seconds:5.0%}"
                     + ("" if abs(ratio - 1) <= TOLERANCE else "  OUTSIDE +-20%")
                     + ("" if kind in ("held out", "other workload") else f"  ({kind})"))
        return {"kind": kind, "topology": p["topology"], "name": p["name"],
                "bandwidth_mbit": p["bandwidth_mbit"], "measured_s": measured_s,
                "run_steps_s": p["run_steps"], "predicted_s": predicted, "ratio": ratio}

    template = _template(2, 2, unshaped, rates)
    rows_out = [row(p, mp, template, workload, kind)
                for kind, group in groups.items() for mp, p in group]
    # the held-out points at both bounds of what the gradient syncs may hide: the fitted
    # overlap and none (0), every other rate as fitted; the extrapolation shows both
    held_points = [mp for mp, _ in groups["held out"]]
    summaries = {}
    lines.append("")
    for name, (variant_rates, variant_unshaped) in variants.items():
        summaries[name] = [held_out_errors(held_points, _template(
            2, 2, variant_unshaped, at), workload) for at in (
                variant_rates, dataclasses.replace(variant_rates, overlap=0.0))]
        for summary in summaries[name]:
            lines.append(f"{name}, held-out points at overlap {summary['overlap']:g}"
                         f"{' (fitted)' if summary['overlap'] == variant_rates.overlap else ''}"
                         f": within +-{TOLERANCE:.0%} {summary['inside']} of "
                         f"{summary['points']}; |error| median "
                         f"{summary['median_error']:.1%}, max {summary['max_error']:.1%}")
    by_overlap = summaries[headline]
    supported = min(by_overlap, key=lambda s: (-s["inside"], s["median_error"]))
    lines.append(f"{headline}: the held-out points support overlap {supported['overlap']:g}")
    other_summary = None
    if args.other_workload:
        other_runs, other_sources, other_workloads = _read_points(args.other_workload)
        other = cluster_comm.merge(other_runs)
        other_dim = other_workloads[0]["embedding_dim"]
        # its own measured rates, if any, with the first workload's fitted step overhead
        # and overlap; else the first workload's rates
        other_measured = measured_rates(os.path.join(rates_dir, "rates_second.json"),
                                        other_workloads[0])
        other_rates = rates if other_measured is None or measured is None else \
            dataclasses.replace(other_measured, overlap=rates.overlap,
                                step_overhead_seconds=rates.step_overhead_seconds)
        lines += ["", f"a second workload, every point held out (fitted on none of it): "
                  f"{', '.join(other_sources)}; {len(other_runs)} run(s); "
                  + ", ".join(f"{k} {v}" for k, v in other_workloads[0].items()),
                  f"its rates: {other_rates}", "", header, "-" * len(header)]
        other_template = _template(2, 2, unshaped, other_rates)
        rows_out += [row(p, _model_point(p), other_template, _workload(p, other_dim),
                         "other workload") for p in other]
        errors = sorted(abs(r["ratio"] - 1) for r in rows_out if r["kind"] == "other workload")
        other_summary = {"points": len(errors), "inside": sum(e <= TOLERANCE for e in errors),
                         "median_error": statistics.median(errors), "max_error": errors[-1]}
        lines.append(f"second workload: within +-{TOLERANCE:.0%} {other_summary['inside']} of "
                     f"{other_summary['points']}; |error| median "
                     f"{other_summary['median_error']:.1%}, max "
                     f"{other_summary['max_error']:.1%}")
    _results.write_text(os.path.join(args.out, "validation.txt"), lines, None)
    _results.write_json(os.path.join(args.out, "validation.json"),
                        {"points": sources, "headline": headline, "rates": rates.to_dict(),
                         "unshaped_bytes_per_s": unshaped, "rows": rows_out,
                         "held_out_by_overlap": by_overlap,
                         "held_out_by_variant": summaries,
                         "supported_overlap": supported["overlap"],
                         "other_workload": other_summary}, None)
    _plot(rows_out, os.path.join(args.out, "cost_model_validation.png"))
    return 0


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 6))
    top = 1.15 * max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3
    xs = [0, top]
    ax.plot(xs, xs, color="black", lw=1)
    ax.fill_between(xs, [x * (1 - TOLERANCE) for x in xs], [x * (1 + TOLERANCE) for x in xs],
                    color="grey", alpha=0.2, label="+-20%")
    for kind, marker in (("fit compute", "s"), ("fit overlap", "^"), ("held out", "o"),
                         ("other workload", "D")):
        mine = [r for r in rows if r["kind"] == kind]
        ax.scatter([1e3 * r["measured_s"] for r in mine], [1e3 * r["predicted_s"] for r in mine],
                   marker=marker, label=f"{kind} ({len(mine)})")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured ms / step (mean)",
           ylabel="predicted ms / step", title="tfhybrid cost model vs emulated cluster")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _results.save_figure(fig, path, None)


if __name__ == "__main__":
    sys.exit(main())
