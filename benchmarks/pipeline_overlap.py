"""How much of a step's input and ids alltoall TrainPipeline hides (issue 16).

One job per link setting (`horovodrun` on tfhybrid.testing.cluster's emulated nodes;
"loopback" = veth without shaping), each rank training the same hybrid click model in
three modes, interleaved in repeats, on the same data:

- **plain**: Keras' train step as a tf.function, phases one after another (what
  ``model.fit`` runs without a pipeline; ``TrainPipeline(enabled=False)``);
- **route**: the route of a batch on its own (read it, check its ids on every rank,
  send them to their owners): the part of the plain step that pipelining can take off
  the step's path;
- **pipelined**: ``TrainPipeline.progress``: in step t's function, batch t+1's route
  collectives and batch t+2's preparation run beside the step.

Hidden share of the route = (plain - pipelined) / route, per repeat, from the medians
of the same job. The input yields whole batches (as the app's readers do): a
per-sample slice-and-batch pipeline cost more CPU per batch (6.5 ms) than the route, so
"route alone" measured the input producer rather than the route. The CPU column is
rank 0's process CPU time per step (all its threads), which says whether the two cores
had room for the route beside the step. Every figure is measured; ranks step together
(collectives), rank 0 reports.

Usage: .venv/bin/python benchmarks/pipeline_overlap.py [--links loopback,1000] [--quick]
Runs as root (network namespaces); about 8 minutes at the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PYTHON = sys.executable
# 1D: one model group over both nodes, so the ids alltoall crosses the link
WORKLOAD = dict(tables=16, rows=20000, dim=32, hotness=8, dense=13, global_batch=2048,
                zipf=1.05)
# one compute thread per rank; two inter-op threads, so that the read-ahead's function can
# run beside the step's (with one they take turns), as the app sets them when pipelining
ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
       "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}
MODES = ("plain", "route", "pipelined")
# (bottom MLP before the last layer of width dim, top MLP before the logit): small towers
# leave a step mostly communication; NVIDIA's TF2 DLRM towers give it compute to hide behind
TOWERS = {"small": ([], [64, 32]), "dlrm": ([512, 256], [1024, 1024, 512, 256])}


# ------------------------------------------------------------------ one rank
def _model(mesh, w: dict):
    import tensorflow as tf
    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding, Embedding
    ids = [tf.keras.Input([w["hotness"]], dtype=tf.int64, name=f"ids_{t}")
           for t in range(w["tables"])]
    dense = tf.keras.Input([w["dense"]], name="dense_features")
    tables = [Embedding(w["rows"], w["dim"], combiner="sum", name=f"table_{t}",
                        embeddings_initializer=tf.keras.initializers.RandomUniform(
                            -0.05, 0.05, seed=t)) for t in range(w["tables"])]
    embedded = DistributedEmbedding(tables, mesh=mesh, optimizer="rowwise_adagrad")(ids)
    bottom = dense
    for width in TOWERS[w["towers"]][0] + [w["dim"]]:
        bottom = tf.keras.layers.Dense(width, activation="relu")(bottom)
    hidden = tf.keras.layers.Concatenate()([bottom] + embedded)
    for width in TOWERS[w["towers"]][1]:
        hidden = tf.keras.layers.Dense(width, activation="relu")(hidden)
    logits = tf.keras.layers.Dense(1)(hidden)
    model = tf.keras.Model([ids, dense], logits)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(
        tfhybrid.optimizers.RowWiseAdagrad(0.05)),
        loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def _dataset(rank: int, w: dict, batches: int):
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(rank)
    local = w["global_batch"] // w["ranks"]
    n = local * batches
    ids = [np.minimum(rng.zipf(w["zipf"], size=[n, w["hotness"]]) - 1, w["rows"] - 1)
           for _ in range(w["tables"])]
    dense = rng.normal(size=[n, w["dense"]]).astype(np.float32)
    labels = rng.integers(0, 2, size=[n, 1]).astype(np.float32)
    # whole batches as the dataset's elements (as the app's binary reader yields them): a
    # per-sample slice-and-batch pipeline would cost more CPU per batch than the route
    def batched(a):
        return a.reshape((batches, local) + a.shape[1:])
    data = tf.data.Dataset.from_tensor_slices(
        ((tuple(batched(x) for x in ids), batched(dense)), batched(labels)))
    return data.repeat().prefetch(2)


def worker(steps: int, repeats: int, warmup: int, out: str, towers: str) -> None:
    import numpy as np
    import tfhybrid
    from tfhybrid.pipeline import TrainPipeline
    import horovod.tensorflow as hvd
    hvd.init()
    w = dict(WORKLOAD, ranks=hvd.size(), model_parallel=hvd.size(),   # 1D: M = N
             towers=towers)
    mesh = tfhybrid.init(model_parallel=w["model_parallel"])
    model = _model(mesh, w)
    iterator = iter(_dataset(mesh.rank, w, batches=64))
    plain = TrainPipeline(model, enabled=False)
    pipeline = TrainPipeline(model)
    times: dict[str, list] = {mode: [] for mode in MODES}
    cpu: dict[str, list] = {mode: [] for mode in MODES}   # this process's CPU s per step

    def run(mode: str, count: int, record: bool) -> None:
        for _ in range(count):
            start, start_cpu = time.perf_counter(), time.process_time()
            if mode == "plain":
                plain.progress(iterator)
            elif mode == "pipelined":
                pipeline.progress(iterator)
            else:
                pipeline._read(iterator)
            if record:
                times[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - start_cpu)
        pipeline.detach()   # the next mode starts from a fresh read (nothing in flight)

    for mode in MODES:
        run(mode, warmup, record=False)
    per_repeat = []
    for _ in range(repeats):
        before = {k: len(v) for k, v in times.items()}
        for mode in MODES:
            run(mode, steps, record=True)
        per_repeat.append({k: float(np.median(v[before[k]:])) for k, v in times.items()})
        per_repeat[-1].update({f"{k}_cpu": float(np.median(v[before[k]:]))
                               for k, v in cpu.items()})
    if mesh.rank == 0:
        with open(out, "w") as f:
            json.dump({"workload": w, "repeats": per_repeat}, f)


# ------------------------------------------------------------------ launcher
def _summary(repeats: list[dict]) -> dict:
    """Median over repeats of each repeat's median, the spread, and the hidden share."""
    out = {}
    for key in MODES + tuple(f"{mode}_cpu" for mode in MODES):
        values = [r[key] for r in repeats]
        out[key] = dict(median=statistics.median(values), low=min(values), high=max(values))
    hidden = [(r["plain"] - r["pipelined"]) / r["route"] for r in repeats]
    out["hidden_share"] = dict(median=statistics.median(hidden), low=min(hidden),
                               high=max(hidden))
    out["speedup"] = dict(median=statistics.median(r["plain"] / r["pipelined"]
                                                   for r in repeats))
    return out


def table(points: list[dict]) -> str:
    header = (f"{'nodes x ranks, link':>20} {'plain ms':>16} {'route ms':>16} "
              f"{'pipelined ms':>16} {'CPU ms plain/route/piped':>24} {'route hidden':>20} {'plain/pipelined':>15}")
    lines = [header, "-" * len(header)]

    def cell(s, scale=1e3, fmt="{:.1f}"):
        return (fmt.format(scale * s["median"]) + " (" + fmt.format(scale * s["low"]) + "-"
                + fmt.format(scale * s["high"]) + ")")
    for p in points:
        s = p["summary"]
        cpu_ms = "/".join(f"{1e3 * s[mode + '_cpu']['median']:.1f}" for mode in MODES)
        lines.append(f"{p['link']:>20} {cell(s['plain']):>16} {cell(s['route']):>16} "
                     f"{cell(s['pipelined']):>16} "
                     f"{cpu_ms:>24} "
                     f"{cell(s['hidden_share'], 100, '{:.0f}%'):>20} "
                     f"{s['speedup']['median']:>14.2f}x")
    return "\n".join(lines)


def plot(points: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.25
    for i, p in enumerate(points):
        s = p["summary"]
        ax.bar(i - width, 1e3 * s["plain"]["median"], width, color="tab:gray",
               label="plain" if i == 0 else None)
        ax.bar(i, 1e3 * s["route"]["median"], width, color="tab:orange",
               label="route alone: input + id check + ids alltoall" if i == 0 else None)
        ax.bar(i + width, 1e3 * s["pipelined"]["median"], width, color="tab:green",
               label="pipelined" if i == 0 else None)
        ax.text(i, 1e3 * s["plain"]["median"] * 1.04,
                f"{100 * s['hidden_share']['median']:.0f}% hidden", ha="center", fontsize=9)
    ax.set_xticks(range(len(points)), [p["link"] for p in points])
    ax.set(ylabel="ms / step (median of repeats)",
           title="TrainPipeline: the route of batch t+1 during step t (measured)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--links", default="loopback,1000",
                        help="Mbit/s per NIC, comma-separated; 'loopback' = unshaped")
    parser.add_argument("--topologies", default="2x2,2x1",
                        help="nodes x ranks per node, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode/repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--towers", choices=sorted(TOWERS), default="small")
    parser.add_argument("--quick", action="store_true", help="8 steps x 2 repeats")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "pipeline_overlap"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats, args.warmup = 8, 2, 3
    if args.worker:
        worker(args.steps, args.repeats, args.warmup, args.worker, args.towers)
        return 0
    from tfhybrid.testing import cluster as cluster_lib
    os.makedirs(args.out, exist_ok=True)
    w = WORKLOAD
    print(f"workload: {w['tables']} tables x {w['rows']} rows x {w['dim']}, {w['hotness']} "
          f"ids per bag (Zipf {w['zipf']}), global batch {w['global_batch']}, 1D (one "
          f"model group over every rank: the ids cross the link), {args.towers} towers "
          f"{TOWERS[args.towers]}; {args.repeats} repeats "
          f"x {args.steps} steps per mode", flush=True)
    points = []
    for topology in args.topologies.split(","):
        nodes, per_node = (int(x) for x in topology.split("x"))
        with cluster_lib.EmulatedCluster(nodes, per_node) as cluster:
            for link in args.links.split(","):
                cluster.set_bandwidth(None if link == "loopback" else float(link))
                result = tempfile.mktemp(prefix="tfhybrid-pipeline-", suffix=".json")
                command = [PYTHON, os.path.abspath(__file__), f"--worker={result}",
                           f"--steps={args.steps}", f"--repeats={args.repeats}",
                           f"--warmup={args.warmup}", f"--towers={args.towers}"]
                measured = cluster.run_for_json(command, result, args.timeout,
                                                f"{topology} {link}", env=ENV, cwd=ROOT)
                name = f"{topology} " + (link if link == "loopback" else f"{link} Mb/s")
                points.append(dict(link=name, **measured,
                                   summary=_summary(measured["repeats"])))
                print(table(points[-1:]).splitlines()[-1], flush=True)
    text = table(points)
    print("\n" + text)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "points.json"), "w") as f:
        json.dump(points, f, indent=1)
    plot(points, os.path.join(args.out, "pipeline_overlap.png"))
    print(f"\nwrote {args.out}/table.txt, points.json, pipeline_overlap.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
