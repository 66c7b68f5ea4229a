"""DLRM training on an emulated multi-node cluster: 1D vs 2D, gradient vs weight sync,
fp32 vs fp16 communication, over links of chosen bandwidth (issue 13, section 2).

Each point is one real job, `horovodrun -H node0:R,node1:R,... --gloo` of
`python -m tfhybrid.train` (Keras `fit`), on tfhybrid.testing.cluster's namespaces,
with the nodes' NICs shaped by tc to the given rate (or unshaped: "loopback" below means
veth without shaping, where the two cores, not the link, are the limit). Per point it
prints what the job measured:

- step time: median and p25-p75 over the timed steps (after the warm-up);
- samples/s over the timed steps (it includes the periodic weight syncs, which a
  median step hides);
- bytes per step on node0's link, each direction, read off the host's NIC counters;
- bytes per step that one rank's alltoalls and allreduces sent (tfhybrid's counters).

Configurations (M = ranks per model group, D = N / M replicas):
  1D            M = N: every alltoall spans all nodes
  2D-mm         M = ranks per node, model-major: alltoalls inside a node, shard replica
                sync (gradients) across nodes
  2D-dm         M = ranks per node, data-major: alltoalls across nodes, replica sync inside
  2D-mm-w<K>    as 2D-mm with weight + optimizer-state sync every K steps
  *-fp16        activations, their gradients and the gradient allreduces sent as float16
  *-dct         (with --dct) DCT at its default keep fractions (tfhybrid.compression)

The whole grid runs ``--runs`` times, one run after the other (so a passing disturbance
touches one run, not every repeat of a point); ``merge`` makes one point per configuration
from them, its step times the median over the runs with their min-max beside it. Writes
points.json (every run's points, with a provenance record: the input of
benchmarks/cost_model_validation.py), table.txt (the merged points) and a PNG plot into
--out. Runs as root (network namespaces); about 37 minutes per run of the full grid.

Usage: .venv/bin/python benchmarks/cluster_comm.py [--quick] [--runs N] [--workload W]
       [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

try:
    import _results  # beside this script; it puts the checkout first on sys.path
except ImportError:  # imported as benchmarks.cluster_comm, its folder not on sys.path
    from benchmarks import _results
from tfhybrid.testing import cluster as cluster_lib  # noqa: E402
try:
    from dct_quality import keep_fraction  # beside this script
except ImportError:  # imported as benchmarks.cluster_comm
    from benchmarks.dct_quality import keep_fraction

PYTHON = sys.executable
# the DLRM every point trains: 26 Criteo-like tables capped at MAX_ROWS rows of width DIM,
# so that the lookups' alltoall (global batch x 26 x DIM values each way) is comparable
# to the compute of 4 ranks on 2 cores
WORKLOAD = dict(global_batch=2048, embedding_dim=32, bottom_mlp_dims="64,32",
                top_mlp_dims="64,32,1", max_table_rows=20000, embedding_optimizer=
                "rowwise_adagrad", dense_optimizer="adam")
# --workload: the grid's DLRM, and a second one with other table sizes, width, batch and
# towers, which plays no part in fitting the cost model (cost_model_validation.py holds
# all of its points out)
WORKLOADS = {"dlrm": WORKLOAD,
             "second": dict(global_batch=1024, embedding_dim=16, bottom_mlp_dims="256,16",
                            top_mlp_dims="256,128,1", max_table_rows=60000,
                            embedding_optimizer="rowwise_adagrad", dense_optimizer="adam")}
SYNC_EVERY = 8


def configurations(nodes: int, ranks_per_node: int, dct: bool = False) -> list[dict]:
    """The configurations measured on one topology (see the module docstring); with
    ``dct``, 1D and 2D-mm without and with DCT at its default keep fractions."""
    n = nodes * ranks_per_node
    two_d = ranks_per_node if ranks_per_node > 1 else max(1, n // 2)
    out = [dict(name="1D", model_parallel=n, layout="model_major"),
           dict(name="2D-mm", model_parallel=two_d, layout="model_major"),
           dict(name=f"2D-mm-w{SYNC_EVERY}", model_parallel=two_d, layout="model_major",
                replica_sync="weights", sync_every=SYNC_EVERY),
           dict(name="1D-fp16", model_parallel=n, layout="model_major",
                communication="float16"),
           dict(name="2D-mm-fp16", model_parallel=two_d, layout="model_major",
                communication="float16")]
    if dct:
        return [out[0], dict(out[0], name="1D-dct", dct=True),
                out[1], dict(out[1], name="2D-mm-dct", dct=True)]
    if ranks_per_node > 1:
        # with one rank per node every group crosses nodes: the layouts are the same
        out.insert(2, dict(name="2D-dm", model_parallel=two_d, layout="data_major"))
    return out


def _dct_flags(mp_keep: str = "default") -> list[str]:
    """The app's flags for DCT at its defaults (tfhybrid.compression.DCT), DCT-MP's keep
    fraction ``mp_keep`` (a fraction, "off" or "default")."""
    from tfhybrid.compression import DCT
    settings = DCT().get_config()
    if mp_keep != "default":
        settings["mp_keep"] = keep_fraction(mp_keep)
    return [f"--dct_{k}={v}" for k, v in settings.items() if v is not None]


def run_point(cluster: cluster_lib.EmulatedCluster, config: dict, steps: int,
              warmup: int, timeout: float, dct_mp_keep: str = "default",
              workload: dict = WORKLOAD) -> dict:
    metrics = tempfile.mktemp(prefix="tfhybrid-cluster-comm-", suffix=".json")
    flags = [f"--model_parallel={config['model_parallel']}", f"--layout={config['layout']}",
             f"--replica_sync={config.get('replica_sync', 'gradients')}",
             f"--sync_every={config.get('sync_every', 1)}",
             f"--communication={config.get('communication', 'float32')}",
             f"--batch_size={workload['global_batch']}",
             f"--embedding_dim={workload['embedding_dim']}",
             f"--bottom_mlp_dims={workload['bottom_mlp_dims']}",
             f"--top_mlp_dims={workload['top_mlp_dims']}",
             f"--max_table_rows={workload['max_table_rows']}",
             f"--embedding_optimizer={workload['embedding_optimizer']}",
             f"--dense_optimizer={workload['dense_optimizer']}",
             f"--steps={steps}", f"--warmup_steps={warmup}", "--eval_batches=1",
             "--count_traffic", f"--metrics_json={metrics}", "--threads=1"]
    if config.get("dct"):
        flags += _dct_flags(dct_mp_keep)
    started = time.time()
    measured = cluster.run_for_json(
        [PYTHON, "-m", "tfhybrid.train", "--model=dlrm", "--dataset=synthetic", *flags],
        metrics, timeout, config["name"], cwd=_results.ROOT,
        env=_results.child_env(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1"))
    return {**config, "wall_seconds": time.time() - started, **measured}


def _key(point: dict) -> tuple:
    return point["topology"], point["bandwidth_mbit"], point["name"]


def merge(runs: list[list[dict]]) -> list[dict]:
    """One point per configuration (topology, link, name) that every run measured: the
    first run's record with its step figures replaced by their medians over the runs;
    ``run_steps`` keeps each run's mean step (global batch / samples per second), the
    figure the cost model is checked against, and ``mean_step_seconds`` is their median.

    >>> a = dict(topology="2x2", bandwidth_mbit=None, name="1D", global_batch=8,
    ...          samples_per_second=80.0, step_seconds_median=0.1, step_seconds_p25=0.09,
    ...          step_seconds_p75=0.11)
    >>> b = dict(a, samples_per_second=40.0, step_seconds_median=0.2)
    >>> [m] = merge([[a], [b], [a]])
    >>> m["run_steps"], m["mean_step_seconds"], m["step_seconds_median"]
    ([0.1, 0.2, 0.1], 0.1, 0.1)
    """
    by_key = [{_key(p): p for p in points} for points in runs]
    merged = []
    for point in runs[0]:
        if not all(_key(point) in run for run in by_key):
            continue
        same = [run[_key(point)] for run in by_key]
        steps = [p["global_batch"] / p["samples_per_second"] for p in same]
        merged.append({**point, **{
            field: statistics.median(p[field] for p in same)
            for field in ("samples_per_second", "step_seconds_median", "step_seconds_p25",
                          "step_seconds_p75")},
            "run_steps": steps, "mean_step_seconds": statistics.median(steps)})
    return merged


def _mb(x: float) -> str:
    return f"{x / 1e6:7.2f}"


def table(points: list[dict]) -> str:
    """One line per point; a merged point (``merge``) adds its runs' mean steps."""
    header = (f"{'topology':8} {'link':>9} {'config':12} {'step ms (p25-p75)':>22} "
              f"{'samples/s':>10} {'link MB/step out':>16} {'in':>7} "
              f"{'a2a MB/rank':>11} {'allred MB/rank':>14}  runs' mean step ms")
    lines = [header, "-" * len(header)]
    for p in points:
        link = "loopback" if p["bandwidth_mbit"] is None else f"{p['bandwidth_mbit']:g} Mb/s"
        step = (f"{1e3 * p['step_seconds_median']:7.1f} ({1e3 * p['step_seconds_p25']:.0f}-"
                f"{1e3 * p['step_seconds_p75']:.0f})")
        net = p.get("host_network_bytes_per_step", {"sent": 0, "received": 0})
        coll = p["collective_bytes_per_step"]
        lines.append(f"{p['topology']:8} {link:>9} {p['name']:12} {step:>22} "
                     f"{p['samples_per_second']:10.0f} {_mb(net['sent']):>16} "
                     f"{_mb(net['received']):>7} {_mb(coll['alltoall']):>11} "
                     f"{_mb(coll['allreduce']):>14}  "
                     + " ".join(f"{1e3 * s:.1f}" for s in p.get("run_steps", ())))
    return "\n".join(lines)


def plot(points: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    topologies = sorted({p["topology"] for p in points})
    fig, axes = plt.subplots(2, len(topologies), figsize=(6.5 * len(topologies), 9),
                             squeeze=False)
    for col, topo in enumerate(topologies):
        mine = [p for p in points if p["topology"] == topo]
        names = list(dict.fromkeys(p["name"] for p in mine))
        for name in names:
            series = sorted((p for p in mine if p["name"] == name and p["bandwidth_mbit"]),
                            key=lambda p: p["bandwidth_mbit"])
            if not series:
                continue
            bw = [p["bandwidth_mbit"] for p in series]
            med = [1e3 * p["step_seconds_median"] for p in series]
            lo = [m - 1e3 * p["step_seconds_p25"] for m, p in zip(med, series)]
            hi = [1e3 * p["step_seconds_p75"] - m for m, p in zip(med, series)]
            axes[0][col].errorbar(bw, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
            axes[1][col].plot(bw, [p["host_network_bytes_per_step"]["sent"] / 1e6
                                   for p in series], marker="o", label=name)
        axes[0][col].set(title=f"{topo}: step time (median, p25-p75)",
                         xlabel="link bandwidth (Mbit/s)", ylabel="ms / step", xscale="log")
        axes[1][col].set(title=f"{topo}: bytes out of node0 per step",
                         xlabel="link bandwidth (Mbit/s)", ylabel="MB / step", xscale="log")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("tfhybrid DLRM on an emulated cluster (measured)")
    fig.tight_layout()
    _results.save_figure(fig, path, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="2x2,4x1",
                        help="nodes x ranks per node, comma-separated")
    parser.add_argument("--bandwidths", default="loopback,1000,500,250",
                        help="Mbit/s per NIC; 'loopback' = unshaped")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--runs", type=int, default=3,
                        help="runs of the whole grid, one after another")
    parser.add_argument("--quick", action="store_true",
                        help="one run: 2x2, loopback, 1000 and 250 Mbit/s, 1D and 2D-mm, "
                             "12 steps, into a scratch folder unless --out")
    parser.add_argument("--dct", action="store_true",
                        help="1D and 2D-mm, each without and with DCT (issue 14)")
    parser.add_argument("--dct_mp_keep", default="default",
                        help="with --dct: DCT-MP's keep fraction, or off (DCT-DP alone); "
                             "default: DCT's own")
    parser.add_argument("--workload", default="dlrm", choices=sorted(WORKLOADS),
                        help="the DLRM every point trains (module docstring)")
    parser.add_argument("--out", help="results folder (default: benchmarks/results/"
                        "cluster_comm; with --quick a temporary folder)")
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    args.out = _results.out_dir("cluster_comm", args.quick, args.out)
    if args.quick:
        # three links: what cost_model_validation.py needs to fit and hold points out
        args.topologies, args.bandwidths, args.only = "2x2", "loopback,1000,250", "1D,2D-mm"
        args.steps, args.warmup, args.runs = 12, 4, 1
    if args.runs < 1:
        raise SystemExit(f"--runs={args.runs}: expected at least 1")
    os.makedirs(args.out, exist_ok=True)
    bandwidths = [None if b == "loopback" else float(b) for b in args.bandwidths.split(",")]
    only = set(filter(None, args.only.split(",")))
    runs: list[list[dict]] = []
    print(f"workload {args.workload}: DLRM, 26 tables <= {workload['max_table_rows']} rows "
          f"x {workload['embedding_dim']}, towers {workload['bottom_mlp_dims']} / "
          f"{workload['top_mlp_dims']}, global batch {workload['global_batch']}, "
          f"{workload['embedding_optimizer']} tables / {workload['dense_optimizer']} dense, "
          f"{args.steps} steps ({args.warmup} warm-up), {args.runs} run(s) of the grid",
          flush=True)
    for run in range(args.runs):
        runs.append([])
        for topo in args.topologies.split(","):
            nodes, per_node = (int(x) for x in topo.split("x"))
            with cluster_lib.EmulatedCluster(nodes, per_node) as cluster:
                print(f"\nrun {run + 1} of {args.runs}, {topo}: cluster "
                      f"{cluster.host_flag()} up in {cluster.setup_seconds:.1f} s", flush=True)
                for bw in bandwidths:
                    cluster.set_bandwidth(bw)
                    for config in configurations(nodes, per_node, args.dct):
                        if only and config["name"] not in only:
                            continue
                        point = run_point(cluster, config, args.steps, args.warmup,
                                          args.timeout, args.dct_mp_keep, workload)
                        point.update(topology=topo, nodes=nodes, ranks_per_node=per_node,
                                     bandwidth_mbit=bw, run=run)
                        runs[-1].append(point)
                        print(table([point]).splitlines()[-1], flush=True)
                        # every point as it comes: a run cut short keeps what it measured
                        _results.write_json(os.path.join(args.out, "points.json"),
                                            {"workload": workload, "runs": runs}, None)
            print(f"{topo}: torn down in {cluster.teardown_seconds:.1f} s", flush=True)
    merged = merge(runs)
    header = [_results.LOAD_NOT_MEASURED,
              f"# merged: {len(runs)} run(s) of the grid, one after another; step figures "
              f"are the median over the runs, then each run's mean step"] + (
        [f"DCT {_dct_flags(args.dct_mp_keep)}"] if args.dct else [])
    _results.write_text(os.path.join(args.out, "table.txt"),
                        header + table(merged).splitlines(), None)
    plot(merged, os.path.join(args.out, "step_time_and_bytes.png"))
    print(f"\nwrote {args.out}/points.json, table.txt, step_time_and_bytes.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
