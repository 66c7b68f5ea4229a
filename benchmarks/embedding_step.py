"""Step time, samples/s and bytes on the wire of a DistributedEmbedding training step:
N ranks on every D x M mesh vs one process with the same threads, batch and optimizer.

A synthetic model (8 tables covering every placement kind, fixed multi-hot ids, a small
dense head, sum combiner, SGD(0.01) through tfhybrid.DistributedOptimizer) trains on the
same global batch in every configuration:
- the baseline: one process with ranks x threads_per_rank intra-op threads;
- each mesh D x M with D * M = ranks (horovodrun --gloo on this machine), every rank with
  threads_per_rank intra-op threads and the local batch global / ranks.
So the baseline and the meshes get the same total threads; by default ranks = the machine's
CPU count, so neither is oversubscribed (the script says so when it is).

Per configuration it prints the step time, median with its spread over the timed steps
(each step's time is the slowest rank's), samples/s at the median, the ratio of medians to
the baseline of this run, and the alltoall / allreduce bytes each rank sent per step,
counted from the collectives' payloads and as the planner predicted.

Usage: .venv/bin/python benchmarks/embedding_step.py [--quick] [--ranks 2]
           [--threads_per_rank 1] [--local_batch 256] [--steps 20] [--rows_scale 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _results  # beside this script, as is _stats
import _stats

# name, rows (before --rows_scale), dim, hotness
TABLES = [("t0", 200_000, 32, 4), ("t1", 100_000, 64, 2), ("t2", 50_000, 32, 8),
          ("t3", 20_000, 16, 1), ("t4", 5_000, 32, 3), ("t5", 1_000, 16, 1),
          ("t6", 400_000, 16, 2), ("t7", 300, 8, 1)]
THRESHOLDS = dict(data_parallel_threshold=20_000, column_slice_threshold=2_000_000,
                  row_slice_threshold=5_000_000)
LEARNING_RATE = 0.01
WARMUP_STEPS = 3
DISTINCT_BATCHES = 4  # cycled: the input pipeline is not what is measured
QUICK = dict(local_batch=64, steps=5)
FULL = dict(local_batch=256, steps=20)


def scaled_tables(rows_scale: float) -> list[tuple[str, int, int, int]]:
    return [(name, max(1, round(rows * rows_scale)), dim, hotness)
            for name, rows, dim, hotness in TABLES]


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import tfhybrid  # first: it selects tf-keras before horovod touches tf.keras
    import horovod.tensorflow as hvd
    from tfhybrid import collectives
    from tfhybrid.layers import DistributedEmbedding, Embedding
    from tfhybrid.train.step import click_train_step

    tables = scaled_tables(args.rows_scale)
    mesh = tfhybrid.init(model_parallel=args.model_parallel)
    b = args.local_batch
    layer = DistributedEmbedding(
        [Embedding(rows, dim, combiner="sum", name=name) for name, rows, dim, _ in tables],
        mesh=mesh, strategy="bytes_balanced", **THRESHOLDS)
    head = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(1)])
    rng = np.random.default_rng(mesh.rank)
    batches = [([tf.constant(rng.integers(0, rows, size=[b, h]))
                 for _, rows, _, h in tables],
                tf.constant(rng.integers(0, 2, size=[b, 1]).astype(np.float32)))
               for _ in range(DISTINCT_BATCHES)]
    optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(LEARNING_RATE),
                                              mesh=mesh)
    traffic = collectives.count_traffic()

    def step(ids, labels):
        return click_train_step(layer, head, optimizer, ids, labels)

    if not args.eager:
        step = tf.function(step)
    for i in range(WARMUP_STEPS):
        start = time.perf_counter()
        step(*batches[i % DISTINCT_BATCHES])
        if os.environ.get("TFHYBRID_BENCH_VERBOSE"):
            print(f"rank {mesh.rank} warm-up step {i}: {time.perf_counter() - start:.1f} s",
                  file=sys.stderr, flush=True)
    for v in traffic.values():
        v.assign(0)
    step(*batches[0])
    measured = {k: int(v.numpy()) for k, v in traffic.items()}
    if mesh.size > 1:
        hvd.allreduce(tf.constant(0.0))  # line every rank up before timing
    step_seconds = []
    for i in range(args.steps):
        start = time.perf_counter()
        step(*batches[i % DISTINCT_BATCHES]).numpy()
        step_seconds.append(time.perf_counter() - start)
    estimate = layer.plan.ranks[mesh.model_position]
    dense_bytes = sum(v.shape.num_elements() * 4 for v in head.trainable_variables)
    row = dict(rank=mesh.rank, step_seconds=step_seconds,
               threads=tf.config.threading.get_intra_op_parallelism_threads(),
               alltoall=measured["alltoall"], allreduce=measured["allreduce"],
               alltoall_plan=estimate.alltoall_bytes_per_step,
               allreduce_plan=estimate.sync_bytes_per_step
               + (dense_bytes if mesh.size > 1 else 0))
    rows = hvd.allgather_object(row) if mesh.size > 1 else [row]
    if mesh.rank == 0:
        if args.describe:
            print(layer.plan.describe(), file=sys.stderr)
        print("RESULT " + json.dumps(dict(D=mesh.data_parallel, M=mesh.model_parallel,
                                          N=mesh.size, rows=rows)))


def launch(processes: int, model_parallel: int, local_batch: int, threads: int,
           args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker",
           "--model_parallel", str(model_parallel), "--local_batch", str(local_batch),
           "--steps", str(args.steps), "--threads", str(threads),
           "--rows_scale", str(args.rows_scale)] + (["--describe"] if args.describe else [])
    if args.eager:
        cmd.append("--eager")
    env = _results.child_env(OMP_NUM_THREADS=str(threads),
                             HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="120")
    if processes > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np",
               str(processes), "-H", f"localhost:{processes}", "--gloo"] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"benchmark run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def meshes(ranks: int) -> list[tuple[int, int]]:
    """Every (D, M) with D * M = ranks, M descending."""
    return [(ranks // m, m) for m in range(ranks, 0, -1) if ranks % m == 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: " + ", ".join(f"--{k} {v}" for k, v in QUICK.items())
                        + " (unless given)")
    parser.add_argument("--ranks", type=int, default=os.cpu_count() or 1,
                        help="processes of every mesh (default: the CPU count)")
    parser.add_argument("--threads_per_rank", type=int, default=1)
    parser.add_argument("--local_batch", type=int, help=f"default {FULL['local_batch']}")
    parser.add_argument("--steps", type=int, help=f"timed steps (default {FULL['steps']})")
    parser.add_argument("--rows_scale", type=float, default=1.0,
                        help="multiplies every table's rows")
    parser.add_argument("--describe", action="store_true", help="print each plan")
    parser.add_argument("--eager", action="store_true", help="run the step eagerly")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model_parallel", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.ranks, args.threads_per_rank, args.local_batch, args.steps) < 1:
        parser.error("--ranks, --threads_per_rank, --local_batch and --steps must be >= 1")
    if args.worker:
        worker(args)
        return
    cores = os.cpu_count() or 1
    total_threads = args.ranks * args.threads_per_rank
    global_batch = args.local_batch * args.ranks
    tables = scaled_tables(args.rows_scale)
    table_mb = sum(rows * dim * 4 for _, rows, dim, _ in tables) / 2**20
    print(f"{len(tables)} tables ({table_mb:,.0f} MB fp32; rows x dim x hotness: "
          + ", ".join(f"{r:,}x{d}x{h}" for _, r, d, h in tables) + f"), sum combiner, dense "
          f"head 64-1, SGD({LEARNING_RATE}) via tfhybrid.DistributedOptimizer; global batch "
          f"{global_batch}; {args.steps} timed steps after {WARMUP_STEPS} warm-up; "
          f"{'eager' if args.eager else 'tf.function'}")
    print(f"{cores} CPUs; baseline: 1 process x {total_threads} intra-op threads, batch "
          f"{global_batch}; meshes: {args.ranks} ranks x {args.threads_per_rank} intra-op "
          f"threads, local batch {args.local_batch}; inter-op threads 1 everywhere"
          + (f"; OVERSUBSCRIBED: {total_threads} threads on {cores} CPUs"
             if total_threads > cores else ""))
    print(f"step ms: {_stats.SPREAD_LEGEND} (a step's time is its slowest rank's); ratio = "
          "median step time of the baseline / the mesh's (> 1: the mesh is faster); bytes "
          "per rank per step, measured / planned")
    print(f"{'config':>8} {'step ms':<34} {'samples/s':>10} {'ratio':>6} "
          f"{'alltoall B/step':>24} {'allreduce B/step':>24}")

    def report(label: str, result: dict, baseline_median: float | None) -> float:
        per_step = [max(steps) for steps in zip(*(r["step_seconds"] for r in result["rows"]))]
        summary = _stats.summarize(per_step)
        ranks = len(result["rows"])

        def mean(key: str) -> float:
            return sum(r[key] for r in result["rows"]) / ranks
        ratio = baseline_median / summary.median if baseline_median else 1.0
        print(f"{label:>8} {summary.format(1e3, 1):<34} {global_batch / summary.median:10,.0f} "
              f"{ratio:5.2f}x {mean('alltoall'):>11,.0f} / {mean('alltoall_plan'):<10,.0f}"
              f" {mean('allreduce'):>11,.0f} / {mean('allreduce_plan'):<10,.0f}", flush=True)
        return summary.median

    baseline = launch(1, 1, global_batch, total_threads, args)
    baseline_median = report("1 proc", baseline, None)
    for d, m in meshes(args.ranks):
        report(f"{d}x{m}", launch(args.ranks, m, args.local_batch, args.threads_per_rank, args),
               baseline_median)
    print("bytes: averaged over the ranks; alltoall counts ids out, rows back and their "
          "gradients; allreduce counts dense allreduce payloads plus sparse allgather "
          "payloads (the plan assumes every looked-up id is unique, an upper bound)")


if __name__ == "__main__":
    main()
