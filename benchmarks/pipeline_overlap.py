"""How much of a step's input and ids alltoall TrainPipeline hides (issue 16).

One job per link setting (`horovodrun` on tfhybrid.testing.cluster's emulated nodes;
"loopback" = veth without shaping), each rank training the same hybrid click model in
five modes on the same data:

- **plain**: Keras' train step as a tf.function, phases one after another (what
  ``model.fit`` runs without a pipeline; ``TrainPipeline(enabled=False)``);
- **route**: the route of a batch on its own (read it, check its ids on every rank,
  send them to their owners), a call of its own with its own Python and sync;
- **step**: the pipelined step with no route at all (each step reuses ids routed
  before: the same work on stale ids), the floor a pipeline can reach;
- **pipelined**: ``TrainPipeline.progress``: in step t's function, batch t+2's
  preparation starts once the step's rows go out and batch t+1's route collectives
  once they have arrived;
- **at_start**: the same, but batch t+1's collectives start with the function (the
  placement TrainPipeline used before), as the comparison.

The modes take turns in short blocks (default 40 blocks x 4 steps per mode, after one
unrecorded call that starts a pipeline), so a drift of the machine or the link falls on
every mode alike. Figures are medians over every step of a mode, with 95% intervals from
resampling whole blocks (2000 draws); each ratio is computed on the same draws.

Each link setting runs ``--runs`` times (default 2), each run a job of its own; the
headline is TrainPipeline's own choice (``pipelined``) in every run, with the end-to-end
ratio plain / pipelined beside it, and their medians over the runs. A run writes
``benchmarks/results/pipeline_overlap/{table,points}_<towers>.*`` (``--quick``: a temporary
folder), its provenance header first; the jobs run in the emulated nodes, outside this
process tree, so the header cannot tell other load from theirs and says so.

Hidden share, two ways: of the route's cost in a plain step, (plain - pipelined) /
(plain - step), the time pipelining can remove; and of the route on its own, (plain -
pipelined) / route, which also counts that call's own Python and sync. The input yields
whole batches (as the app's readers do). The CPU column is rank 0's process CPU time per
step (all its threads). Every figure is measured; ranks step together (collectives),
rank 0 reports.

Usage: .venv/bin/python benchmarks/pipeline_overlap.py [--links loopback,1000]
       [--topologies 2x2,2x1] [--towers small|dlrm] [--blocks 40] [--runs 2] [--quick]
Runs as root (network namespaces); small towers about 3 minutes per link setting at
the defaults, NVIDIA DLRM's towers about 8.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

import _results  # beside this script; it puts the checkout first on sys.path

PYTHON = sys.executable
# 1D: one model group over both nodes, so the ids alltoall crosses the link
WORKLOAD = dict(tables=16, rows=20000, dim=32, hotness=8, dense=13, global_batch=2048,
                zipf=1.05)
# the jobs' variables besides _results.child_env's: one compute thread per rank; two
# inter-op threads, so that the read-ahead's function can run beside the step's (with one
# they take turns), as the app sets them when pipelining
EXTRA_ENV = dict(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2")
MODES = ("plain", "route", "step", "after_rows", "at_start", "pipelined")
PIPELINED = ("after_rows", "at_start", "pipelined")
LABELS = {"after_rows": "route collectives once the rows arrive",
          "at_start": "route collectives at the step's start",
          "pipelined": "TrainPipeline (the faster of the two, chosen by timing)"}
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


def worker(steps: int, blocks: int, warmup: int, out: str, towers: str) -> None:
    import tensorflow as tf
    import tfhybrid
    from tfhybrid.sharding import phases
    from tfhybrid.pipeline import TRIAL_STEPS, TrainPipeline
    import horovod.tensorflow as hvd
    hvd.init()
    w = dict(WORKLOAD, ranks=hvd.size(), model_parallel=hvd.size(),   # 1D: M = N
             towers=towers)
    mesh = tfhybrid.init(model_parallel=w["model_parallel"])
    model = _model(mesh, w)
    iterator = iter(_dataset(mesh.rank, w, batches=64))
    plain = TrainPipeline(model, enabled=False)
    pipeline = TrainPipeline(model)

    class StepAlone(TrainPipeline):
        """The pipelined step without the route: every step reuses the ids routed for
        the first batch of its block (stale ids, the same work), so that plain - step
        is what the route adds to a plain step."""
        def _step_and_route(self, after_rows, batch, routed, sending, after, ended):
            phase = phases.Stepping(self._layers, routed)
            with phases.PhaseScope(phase):
                outputs = self._train_step(batch)
            return outputs, routed, tf.constant(False), tf.constant(""), sending

    def forced(after_rows: bool) -> TrainPipeline:
        """A TrainPipeline with its placement fixed instead of chosen by timing."""
        chosen = TrainPipeline(model)
        chosen.placement = after_rows
        return chosen

    pipelines = {"pipelined": pipeline, "after_rows": forced(True),
                 "at_start": forced(False), "step": StepAlone(model)}
    # per mode: each block's step times and this process's CPU seconds per step
    times: dict[str, list] = {mode: [] for mode in MODES}
    cpu: dict[str, list] = {mode: [] for mode in MODES}

    def run(mode: str, count: int) -> tuple[list, list]:
        wall, used = [], []
        # the block's first call of a pipelined mode also routes its first batch on its
        # own (the pipeline starts); it is not one of the block's steps
        for i in range(-1 if mode in pipelines else 0, count):
            start, start_cpu = time.perf_counter(), time.process_time()
            if mode == "plain":
                plain.progress(iterator)
            elif mode == "route":
                pipeline._read(iterator)
            else:
                pipelines[mode].progress(iterator)
            if i >= 0:
                wall.append(time.perf_counter() - start)
                used.append(time.process_time() - start_cpu)
        for p in pipelines.values():
            p.detach()   # the next mode starts from a fresh read (nothing in flight)
        return wall, used

    for mode in MODES:
        run(mode, warmup)
    while pipeline.placement is None:   # TrainPipeline times both placements first
        run("pipelined", 2 * TRIAL_STEPS)
    # short blocks, the modes in turn: a drift of the machine or the link falls on every
    # mode alike, and the statistics resample whole blocks
    for _ in range(blocks):
        for mode in MODES:
            wall, used = run(mode, steps)
            times[mode].append(wall)
            cpu[mode].append(used)
    if mesh.rank == 0:
        with open(out, "w") as f:
            json.dump({"workload": w, "times": times, "cpu": cpu,
                       "placement": "after_rows" if pipeline.placement else "at_start"}, f)


# ------------------------------------------------------------------ launcher
def _summary(measured: dict) -> dict:
    """Per mode the median step over all blocks with a 95% bootstrap interval (blocks
    resampled), and per pipelined mode the hidden share of the route and plain/mode,
    each with its interval from the same resampled blocks."""
    times, cpu = measured["times"], measured["cpu"]
    blocks = len(times["plain"])
    rng = np.random.default_rng(12345)
    draws = [rng.integers(0, blocks, blocks) for _ in range(2000)]

    def pooled(values, chosen=None):
        chosen = range(blocks) if chosen is None else chosen
        return float(np.median([t for b in chosen for t in values[b]]))

    def interval(statistic):
        low, high = np.percentile([statistic(d) for d in draws], [2.5, 97.5])
        return dict(median=statistic(None), low=float(low), high=float(high))

    out = {mode: interval(lambda d, m=mode: pooled(times[m], d)) for mode in MODES}
    out.update({f"{mode}_cpu": dict(median=pooled(cpu[mode])) for mode in MODES})
    out["route_in_step"] = interval(lambda d: pooled(times["plain"], d)
                                    - pooled(times["step"], d))
    for mode in PIPELINED:
        out[f"of_step_{mode}"] = interval(lambda d, m=mode: (
            pooled(times["plain"], d) - pooled(times[m], d))
            / (pooled(times["plain"], d) - pooled(times["step"], d)))
        out[f"hidden_{mode}"] = interval(lambda d, m=mode: (
            pooled(times["plain"], d) - pooled(times[m], d)) / pooled(times["route"], d))
        out[f"speedup_{mode}"] = interval(lambda d, m=mode: pooled(times["plain"], d)
                                          / pooled(times[m], d))
    out["at_start_minus_after_rows"] = interval(lambda d: pooled(times["at_start"], d)
                                                - pooled(times["after_rows"], d))
    out["placement"] = measured["placement"]
    out["steps_per_mode"] = sum(len(b) for b in times["plain"])
    return out


def _modes_in(points: list[dict]) -> tuple:
    """The pipelined modes every point measured (an older run may lack one)."""
    return tuple(m for m in PIPELINED if all(m in p["summary"] for p in points))


def table(points: list[dict]) -> str:
    pipelined = _modes_in(points)
    measured = [m for m in MODES if m not in PIPELINED or m in pipelined]
    header = (f"{'nodes x ranks, link #run':>24} {'plain ms':>18} {'route ms':>18} "
              f"{'step ms':>18} {'plain-step':>16} "
              + "".join(f"{mode + ' ms':>18} {'of route':>16} {'of plain-step':>16} "
                        f"{'plain/' + mode:>20} "
                        for mode in pipelined)
              + f"{'at_start-after_rows':>18} {'chosen':>10} "
              f"{'CPU ms ' + '/'.join(measured):>34}")
    lines = [header, "-" * len(header)]

    def cell(s, scale=1e3, fmt="{:.1f}", suffix=""):
        return (fmt.format(scale * s["median"]) + suffix + " [" + fmt.format(scale * s["low"])
                + ", " + fmt.format(scale * s["high"]) + "]")
    for p in points:
        s = p["summary"]
        cpu_ms = "/".join(f"{1e3 * s[mode + '_cpu']['median']:.1f}" for mode in measured)
        run = f"{p['link']} #{p['run'] + 1}"
        lines.append(f"{run:>24} {cell(s['plain']):>18} {cell(s['route']):>18} "
                     f"{cell(s['step']):>18} {cell(s['route_in_step']):>16} "
                     + "".join(f"{cell(s[mode]):>18} "
                               f"{cell(s['hidden_' + mode], 100, '{:.0f}', '%'):>16} "
                               f"{cell(s['of_step_' + mode], 100, '{:.0f}', '%'):>16} "
                               f"{cell(s['speedup_' + mode], 1, '{:.3f}'):>20} "
                               for mode in pipelined)
                     + f"{cell(s['at_start_minus_after_rows']):>18} {s['placement']:>10} "
                     f"{cpu_ms:>34}")
    return "\n".join(lines)


def headline(points: list[dict]) -> list[str]:
    """Per link setting, TrainPipeline's own choice in each run and the median over runs:
    the share of the route's cost in a plain step it hides, and plain / pipelined."""
    lines = ["TrainPipeline's own choice (pipelined), per run: share of plain-step hidden "
             "[95% interval], plain/pipelined [95% interval], placement chosen"]
    for link in dict.fromkeys(p["link"] for p in points):
        runs = [p for p in points if p["link"] == link]
        cells = [f"{100 * p['summary']['of_step_pipelined']['median']:.0f}% "
                 f"[{100 * p['summary']['of_step_pipelined']['low']:.0f}, "
                 f"{100 * p['summary']['of_step_pipelined']['high']:.0f}] "
                 f"{p['summary']['speedup_pipelined']['median']:.3f}x "
                 f"[{p['summary']['speedup_pipelined']['low']:.3f}, "
                 f"{p['summary']['speedup_pipelined']['high']:.3f}] "
                 f"{p['summary']['placement']}" for p in runs]
        hidden = np.median([p["summary"]["of_step_pipelined"]["median"] for p in runs])
        speedup = np.median([p["summary"]["speedup_pipelined"]["median"] for p in runs])
        lines.append(f"  {link}: " + "; ".join(f"run {i + 1}: {c}" for i, c in
                                                enumerate(cells))
                     + f"; median over {len(runs)} run(s): {100 * hidden:.0f}% hidden, "
                     f"{speedup:.3f}x end to end")
    return lines


def plot(points: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.8))
    bars = [("plain", "tab:gray", "plain"), ("step", "tab:blue", "step alone (no route)")] + [
        (mode, color, LABELS[mode])
        for mode, color in zip(PIPELINED, ("tab:green", "tab:olive", "tab:red"))
        if mode in _modes_in(points)]
    width = 0.8 / len(bars)
    for i, p in enumerate(points):
        s = p["summary"]
        for j, (mode, color, label) in enumerate(bars):
            x = i + (j - (len(bars) - 1) / 2) * width
            ax.bar(x, 1e3 * s[mode]["median"], width, color=color,
                   label=label if i == 0 else None,
                   yerr=[[1e3 * (s[mode]["median"] - s[mode]["low"])],
                         [1e3 * (s[mode]["high"] - s[mode]["median"])]], capsize=2)
        ax.text(i, 1e3 * s["plain"]["high"] * 1.03,
                " / ".join(f"{100 * s['of_step_' + m]['median']:.0f}%"
                           for m in _modes_in(points)) + " hidden", ha="center", fontsize=8)
    ax.set_xticks(range(len(points)), [f"{p['link']} #{p['run'] + 1}" for p in points])
    ax.set_yscale("log")   # steps of 20-250 ms in one figure, their gaps alike
    ax.set(ylabel="ms / step (median, 95% interval; log scale)",
           title="TrainPipeline: share of the route's cost in a plain step it hides")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _results.save_figure(fig, path, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--links", default="loopback,1000",
                        help="Mbit/s per NIC, comma-separated; 'loopback' = unshaped")
    parser.add_argument("--topologies", default="2x2,2x1",
                        help="nodes x ranks per node, comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode and block")
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--towers", choices=sorted(TOWERS), default="small")
    parser.add_argument("--runs", type=int, default=2,
                        help="independent jobs per link setting (default 2)")
    parser.add_argument("--quick", action="store_true", help="4 blocks x 4 steps, one run")
    parser.add_argument("--out", help="results folder (default: benchmarks/results/"
                        "pipeline_overlap; with --quick a temporary folder, so a check never "
                        "overwrites the published results)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs={args.runs} must be >= 1")
    if args.quick:
        args.steps, args.blocks, args.warmup, args.runs = 4, 4, 3, 1
    if args.worker:
        worker(args.steps, args.blocks, args.warmup, args.worker, args.towers)
        return 0
    from tfhybrid.testing import cluster as cluster_lib
    args.out = _results.out_dir("pipeline_overlap", args.quick, args.out)
    os.makedirs(args.out, exist_ok=True)
    w = WORKLOAD
    print(f"workload: {w['tables']} tables x {w['rows']} rows x {w['dim']}, {w['hotness']} "
          f"ids per bag (Zipf {w['zipf']}), global batch {w['global_batch']}, 1D (one "
          f"model group over every rank: the ids cross the link), {args.towers} towers "
          f"{TOWERS[args.towers]}; {args.blocks} blocks "
          f"x {args.steps} steps per mode, {args.runs} run(s) per link", flush=True)
    points = []
    for topology in args.topologies.split(","):
        nodes, per_node = (int(x) for x in topology.split("x"))
        with cluster_lib.EmulatedCluster(nodes, per_node) as cluster:
            for run, link in [(r, link) for r in range(args.runs)
                              for link in args.links.split(",")]:
                cluster.set_bandwidth(None if link == "loopback" else float(link))
                result = tempfile.mktemp(prefix="tfhybrid-pipeline-", suffix=".json")
                command = [PYTHON, os.path.abspath(__file__), f"--worker={result}",
                           f"--steps={args.steps}", f"--blocks={args.blocks}",
                           f"--warmup={args.warmup}", f"--towers={args.towers}"]
                measured = cluster.run_for_json(
                    command, result, args.timeout, f"{topology} {link}",
                    env=_results.child_env(**EXTRA_ENV), cwd=_results.ROOT)
                name = f"{topology} " + (link if link == "loopback" else f"{link} Mb/s")
                points.append(dict(link=name, run=run, **measured,
                                   summary=_summary(measured)))
                print(table(points[-1:]).splitlines()[-1], flush=True)
    _results.write_json(os.path.join(args.out, f"points_{args.towers}.json"),
                        {"points": points}, None)
    lines = [_results.LOAD_NOT_MEASURED, f"towers: {args.towers} {TOWERS[args.towers]}; "
             f"{args.blocks} blocks x {args.steps} steps per mode", ""] + headline(points) \
        + ["", "every run (rows in run order):", table(points)]
    _results.write_text(os.path.join(args.out, f"table_{args.towers}.txt"), lines, None)
    plot(points, os.path.join(args.out, f"pipeline_overlap_{args.towers}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
