"""Model predictions: weak scaling of 1D (M = N) vs 2D (M from the cost planner), 8 to 4096 ranks.

NOTHING HERE IS MEASURED. Every number this script prints is a prediction of
``tfhybrid.plan`` from published hardware figures and the assumptions below; the only
measured figure shown is the 2D paper's own, with its source.

Hardware (NVIDIA DGX H100; sources: NVIDIA DGX H100 datasheet and user guide, NVIDIA's
"Introducing NVIDIA HGX H100" technical blog):
  * 8 H100 SXM GPUs per node, 80 GB HBM3 each;
  * NVLink 4 through NVSwitch: 900 GB/s bidirectional per GPU = 450 GB/s per direction;
  * 8 ConnectX-7 ports at 400 Gb/s per node = 3.2 Tb/s = 400 GB/s per direction per node.
Assumed (not published figures): NVLink latency 2 us, InfiniBand latency 5 us per message,
hierarchical allreduce (NCCL-like), compute rates below.

Model (assumption: Zhang et al., "Two-dimensional Sparse Parallelism for Large Scale Deep
Learning Recommendation Model Training", Meta, arXiv:2508.03854, 2025, reports "trillions
of parameters" and "nearly linear training speed scaling up to 4K GPUs"; the issue quotes
90% weak-scaling efficiency at 4096 GPUs. The paper's exact table count, sizes, pooling and
batch were not found in the text available here, so this DLRM is an assumption of that
scale): 32 tables x 50M rows x 128 float32 (819 GB of embeddings, 0.2 T parameters),
pooled, 20 ids per sample each, row-wise AdaGrad, 50M dense parameters (Adam), 512 samples
per GPU, Zipf(1.05) ids.

Weak scaling: the per-rank batch is fixed; efficiency(N) = per-rank throughput at N /
per-rank throughput at the smallest N where that scheme fits in memory.

Overlap (the share of the gradient syncs that hides behind compute, ``ComputeRates.overlap``)
is shown at both bounds the validation on the emulated cluster gives: 0 (nothing hides)
and the value that validation fitted (``benchmarks/results/cluster_comm/validation.json``),
with the bound its held-out points support named.

Writes the table to --out (default benchmarks/results/scale_extrapolation.txt) and the plot
beside it (.png).

Usage: python benchmarks/scale_extrapolation.py [--out PATH.txt] [--validation JSON]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import _results  # beside this script; it puts the checkout first on sys.path

from tfhybrid import plan as planning  # noqa: E402
from tfhybrid.plan import ClusterSpec, ComputeRates, TableConfig, Workload  # noqa: E402

GPUS_PER_NODE = 8
HBM_BYTES = 80 * 10**9
NVLINK_BYTES_PER_S = 450e9          # per direction per GPU (900 GB/s bidirectional)
NODE_IB_BYTES_PER_S = 8 * 400e9 / 8  # 8 x 400 Gb/s ConnectX-7, per direction per node
PAPER_EFFICIENCY_AT_4096 = 0.90     # as quoted in issue 13 for arXiv:2508.03854
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# assumed H100 rates (order of magnitude from HBM3's 3.35 TB/s; not measured)
RATES = ComputeRates(lookup_bytes_per_s=1.5e12,
                     apply_bytes_per_s={"rowwise_adagrad": 1.0e12, "adam": 1.0e12},
                     dense_seconds_per_sample=4e-6, step_overhead_seconds=1e-3,
                     collective_overhead_seconds=2e-5)
TABLES = tuple(TableConfig(f"t{i}", 50_000_000, 128, hotness=20.0) for i in range(32))
WORKLOAD = Workload(TABLES, local_batch_size=512, dense_parameters=50_000_000,
                    optimizer="rowwise_adagrad", dense_optimizer="adam")


def cluster(ranks: int, overlap: float = 0.0) -> ClusterSpec:
    return ClusterSpec(ranks // GPUS_PER_NODE, GPUS_PER_NODE, NVLINK_BYTES_PER_S,
                       NODE_IB_BYTES_PER_S, 2e-6, 5e-6, HBM_BYTES,
                       dataclasses.replace(RATES, overlap=overlap), allreduce="hierarchical")


def least_memory(ranks: int, m: int) -> int:
    """Per-rank memory of the even split (every table row-wise) on M = m."""
    plan = planning.plan_with_kinds(TABLES, ranks // m, m, [("row_wise", m)] * len(TABLES),
                                   optimizer=WORKLOAD.optimizer,
                                   local_batch_size=WORKLOAD.local_batch_size)
    return planning.predict(plan, "model_major", cluster(ranks),
                              WORKLOAD).memory_per_rank_bytes


def one_d(ranks: int, overlap: float = 0.0) -> dict:
    try:
        # refine=False: the tables are alike, so the whole-model candidates span the choice
        plan = planning.plan_mesh(TABLES, 1, ranks, "model_major", cluster(ranks, overlap),
                                    WORKLOAD, refine=False)
    except ValueError:
        return {"fits": False, "memory": least_memory(ranks, ranks)}
    pred = planning.predict(plan, "model_major", cluster(ranks, overlap), WORKLOAD)
    return {"fits": True, "memory": pred.memory_per_rank_bytes, "step": pred.step_seconds,
            "m": ranks, "layout": "-", "pred": pred}


def two_d(ranks: int, workload: Workload = WORKLOAD, overlap: float = 0.0) -> dict:
    # M >= 8: below a node's worth of ranks no M fits these tables' 819 GB
    candidates = [m for m in (8, 16, 32, 64, 128, 256) if m <= ranks]
    try:
        plan, layout, pred = planning.plan_for_cluster(TABLES, cluster(ranks, overlap), workload,
                                                         model_parallel=candidates,
                                                         refine=False)
    except ValueError:
        return {"fits": False, "memory": least_memory(ranks, max(candidates))}
    return {"fits": True, "memory": pred.memory_per_rank_bytes, "step": pred.step_seconds,
            "m": plan.model_parallel, "layout": layout, "pred": pred}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(_results.RESULTS,
                                                      "scale_extrapolation.txt"))
    parser.add_argument("--replica_sync", default="gradients", choices=planning.REPLICA_SYNC,
                        help="how 2D keeps a shard's D replicas in step (1D has none)")
    parser.add_argument("--sync_every", type=int, default=1,
                        help="K, steps between weight syncs (--replica_sync=weights)")
    parser.add_argument("--validation", default=os.path.join(
        _results.RESULTS, "cluster_comm", "validation.json"),
        help="cost_model_validation.py's validation.json: the fitted overlap")
    args = parser.parse_args()
    with open(args.validation) as f:
        validation = json.load(f)
    fitted_overlap = validation["rates"]["overlap"]
    supported = validation["supported_overlap"]
    from tfhybrid.testing import provenance
    load = provenance.OtherLoad()
    say: list[str] = []
    workload_2d = WORKLOAD.with_settings(replica_sync=args.replica_sync,
                                         sync_every=args.sync_every)
    rows = [(n, one_d(n), two_d(n, workload_2d)) for n in RANKS]
    hidden_rows = [(n, one_d(n, fitted_overlap), two_d(n, workload_2d, fitted_overlap))
                   for n in RANKS]

    def efficiency(results: list[dict]) -> list[float | None]:
        base = next((r for r in results if r["fits"]), None)
        if base is None:
            return [None] * len(results)
        per_rank = 1 / base["step"]
        return [(1 / r["step"]) / per_rank if r["fits"] else None for r in results]

    eff1 = efficiency([r[1] for r in rows])
    eff2 = efficiency([r[2] for r in rows])
    hidden_eff1 = efficiency([r[1] for r in hidden_rows])
    hidden_eff2 = efficiency([r[2] for r in hidden_rows])
    say.append("MODEL PREDICTIONS (tfhybrid.plan), not measurements. Assumptions: DGX H100 "
               "nodes (8 GPUs, 80 GB, NVLink 450 GB/s/dir/GPU, 8x400 Gb/s IB/node), latencies "
               "2 us / 5 us, 32 tables x 50M x 128 fp32, 20 ids/sample/table, batch 512/GPU, "
               "row-wise AdaGrad, 50M dense params; see the script's docstring. 2D replicas "
               f"sync by {args.replica_sync}"
               + (f" every {args.sync_every} steps." if args.replica_sync == "weights" else "."))
    header = (f"{'ranks':>5}  {'1D step ms':>10}  {'1D eff':>6}  {'1D GB/rank':>10}  "
              f"{'2D M':>5}  {'layout':>11}  {'2D step ms':>10}  {'2D eff':>6}  "
              f"{'2D GB/rank':>10}")
    say.append(header)
    for (n, a, b), e1, e2 in zip(rows, eff1, eff2):
        step1 = f"{a['step'] * 1e3:.3f}" if a["fits"] else "OOM"
        step2 = f"{b['step'] * 1e3:.3f}" if b["fits"] else "OOM"
        say.append(f"{n:>5}  {step1:>10}  {f'{e1:.1%}' if e1 is not None else '-':>6}  "
                   f"{a['memory'] / 1e9:>9.1f}{' ' if a['fits'] else '*'}  "
                   f"{b.get('m', '-'):>5}  {b.get('layout', '-'):>11}  {step2:>10}  "
                   f"{f'{e2:.1%}' if e2 is not None else '-':>6}  "
                   f"{b['memory'] / 1e9:>9.1f}{' ' if b['fits'] else '*'}")
    say.append("* = over the 80 GB per GPU (memory of the even row-wise split shown).")
    say.append("")
    say.append(f"overlap bounds (share of the gradient syncs hidden behind compute): the table "
               f"above at overlap 0; at the overlap fitted on the emulated cluster "
               f"({fitted_overlap:g}, {os.path.relpath(args.validation, _results.ROOT)}), "
               f"efficiency:")
    say.append(f"{'ranks':>5}  {'1D eff':>6}  {'2D eff':>6}")
    for (n, _, _), e1, e2 in zip(hidden_rows, hidden_eff1, hidden_eff2):
        say.append(f"{n:>5}  {f'{e1:.1%}' if e1 is not None else '-':>6}  "
                   f"{f'{e2:.1%}' if e2 is not None else '-':>6}")
    summaries = {s["overlap"]: s for s in validation["held_out_by_overlap"]}
    say.append("the validation's held-out points: " + "; ".join(
        f"at overlap {o:g} {s['inside']} of {s['points']} within +-20% (median error "
        f"{s['median_error']:.1%})" for o, s in sorted(summaries.items()))
        + f"; they support overlap {supported:g}")
    say.append(f"Reported (measured, not ours): 2D sparse parallelism, "
               f"{PAPER_EFFICIENCY_AT_4096:.0%} weak-scaling efficiency at 4096 GPUs (Zhang et "
               "al., Meta, arXiv:2508.03854, as quoted in issue 13; the abstract says "
               "'nearly linear ... up to 4K GPUs').")
    last = rows[-1][2]
    if last["fits"]:
        say.append(f"\nmodel prediction at 4096 ranks, 2D plan:\n{last['pred'].describe()}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ns = [n for n, _, _ in rows]
    for effs, label, marker, style in (
            (eff1, "1D (M = N), overlap 0", "o", "-"),
            (eff2, "2D (M by cost planner), overlap 0", "s", "-"),
            (hidden_eff1, f"1D, overlap {fitted_overlap:g} (fitted)", "o", "--"),
            (hidden_eff2, f"2D, overlap {fitted_overlap:g} (fitted)", "s", "--")):
        pts = [(n, e) for n, e in zip(ns, effs) if e is not None]
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle=style,
                     label=label)
    ax1.scatter([4096], [PAPER_EFFICIENCY_AT_4096], marker="*", s=200, color="red",
                label="2D paper, reported (arXiv:2508.03854)", zorder=5)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("ranks (H100 GPUs)")
    ax1.set_ylabel("weak-scaling efficiency")
    ax1.set_title("Predicted weak scaling (DGX H100 assumptions)")
    ax1.legend(fontsize=8)
    for idx, label, marker in ((1, "1D", "o"), (2, "2D", "s")):
        ax2.plot(ns, [r[idx]["memory"] / 1e9 for r in rows], marker=marker, label=label)
        oom = [(n, r[idx]["memory"] / 1e9) for n, r in zip(ns, rows) if not r[idx]["fits"]]
        if oom:
            ax2.scatter([p[0] for p in oom], [p[1] for p in oom], marker="x", s=120,
                        color="black", zorder=5)
    ax2.axhline(HBM_BYTES / 1e9, color="red", linestyle="--", label="80 GB HBM3")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("ranks")
    ax2.set_ylabel("predicted memory per rank (GB); x = out of memory")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    _results.write_text(args.out, "\n".join(say).splitlines(), load)
    _results.save_figure(fig, os.path.splitext(args.out)[0] + ".png", load)


if __name__ == "__main__":
    main()
