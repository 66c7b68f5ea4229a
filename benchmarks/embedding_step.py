"""Step time, samples/s and bytes on the wire of a DistributedEmbedding training step.

Runs a synthetic model (8 tables of every placement kind, fixed multi-hot ids, a small
dense head) on the 4-rank meshes 1x4, 2x2 and 4x1 under horovodrun, and the same global
batch in one process as the baseline. For each mesh it prints the step time, samples/s,
and the alltoall / allreduce bytes each rank sent per step, measured by counting the
collectives' payloads and as the planner predicted.

Usage: .venv/bin/python benchmarks/embedding_step.py [--local_batch 256] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name, rows, dim, hotness
TABLES = [("t0", 200_000, 32, 4), ("t1", 100_000, 64, 2), ("t2", 50_000, 32, 8),
          ("t3", 20_000, 16, 1), ("t4", 5_000, 32, 3), ("t5", 1_000, 16, 1),
          ("t6", 400_000, 16, 2), ("t7", 300, 8, 1)]
THRESHOLDS = dict(data_parallel_threshold=20_000, column_slice_threshold=2_000_000,
                  row_slice_threshold=5_000_000)


def worker(args) -> None:
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd

    import tfhybrid
    from tfhybrid import collectives
    from tfhybrid.layers import DistributedEmbedding, Embedding
    from tfhybrid.train.step import click_train_step

    mesh = tfhybrid.init(model_parallel=args.model_parallel)
    b = args.local_batch
    layer = DistributedEmbedding(
        [Embedding(rows, dim, combiner="sum", name=name) for name, rows, dim, _ in TABLES],
        mesh=mesh, strategy="bytes_balanced", **THRESHOLDS)
    head = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(1)])
    rng = np.random.default_rng(mesh.rank)
    batches = [([tf.constant(rng.integers(0, rows, size=[b, h]))
                 for _, rows, _, h in TABLES],
                tf.constant(rng.integers(0, 2, size=[b, 1]).astype(np.float32)))
               for _ in range(4)]
    optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), mesh=mesh)
    traffic = collectives.count_traffic()

    def step(ids, labels):
        return click_train_step(layer, head, optimizer, ids, labels)

    if not args.eager:
        step = tf.function(step)
    for i in range(3):
        t0 = time.perf_counter()
        step(*batches[i % 4])
        if os.environ.get("TFHYBRID_BENCH_VERBOSE"):
            print(f"rank {mesh.rank} warm-up step {i}: {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    for v in traffic.values():
        v.assign(0)
    step(*batches[0])
    measured = {k: int(v.numpy()) for k, v in traffic.items()}
    hvd.allreduce(tf.constant(0.0))  # line every rank up before timing
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(*batches[i % 4])
    loss.numpy()
    seconds = (time.perf_counter() - start) / args.steps
    estimate = layer.plan.ranks[mesh.model_position]
    dense_bytes = sum(v.shape.num_elements() * 4 for v in head.trainable_variables)
    row = dict(rank=mesh.rank, seconds=seconds,
               alltoall=measured["alltoall"], allreduce=measured["allreduce"],
               alltoall_plan=estimate.alltoall_bytes_per_step,
               allreduce_plan=estimate.sync_bytes_per_step
               + (dense_bytes if mesh.size > 1 else 0))
    rows = hvd.allgather_object(row)
    if mesh.rank == 0:
        if args.describe:
            print(layer.plan.describe(), file=sys.stderr)
        print("RESULT " + json.dumps(dict(D=mesh.data_parallel, M=mesh.model_parallel,
                                          N=mesh.size, rows=rows)))


def launch(np_: int, model_parallel: int, args, threads: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker",
           "--model_parallel", str(model_parallel), "--local_batch", str(args.local_batch),
           "--steps", str(args.steps)] + (["--describe"] if args.describe else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TF_NUM_INTRAOP_THREADS=str(threads),
               TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="120")
    if np_ > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(np_),
               "-H", f"localhost:{np_}", "--gloo"] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"benchmark run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model_parallel", type=int, default=1)
    parser.add_argument("--local_batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--describe", action="store_true", help="print each plan")
    parser.add_argument("--eager", action="store_true", help="run the step eagerly")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    world = 4
    print(f"tables: {len(TABLES)}, local batch {args.local_batch}, global batch "
          f"{args.local_batch * world}; {args.steps} timed steps after 3 warm-up")
    # baseline: the same global batch in one process using both cores
    base_args = argparse.Namespace(**dict(vars(args), local_batch=args.local_batch * world))
    baseline = launch(1, 1, base_args, threads=2)
    base_s = baseline["rows"][0]["seconds"]
    print(f"\n{'mesh DxM':>9} {'step ms':>9} {'samples/s':>10} {'vs 1 proc':>9} "
          f"{'alltoall B/step (measured / plan)':>36} {'allreduce B/step (measured / plan)':>36}")
    print(f"{'1x1':>9} {base_s * 1e3:9.1f} {args.local_batch * world / base_s:10.0f} "
          f"{1.0:9.2f}x {'0 / 0':>36} {'0 / 0':>36}")
    for d, m in ((1, 4), (2, 2), (4, 1)):
        result = launch(world, m, args, threads=1)
        seconds = max(r["seconds"] for r in result["rows"])
        def mean(key):
            return sum(r[key] for r in result["rows"]) / world
        a2a = f"{mean('alltoall'):,.0f} / {mean('alltoall_plan'):,.0f}"
        ar = f"{mean('allreduce'):,.0f} / {mean('allreduce_plan'):,.0f}"
        print(f"{d}x{m}".rjust(9) + f" {seconds * 1e3:9.1f} "
              f"{args.local_batch * world / seconds:10.0f} {base_s / seconds:9.2f}x "
              f"{a2a:>36} {ar:>36}")
    print("\nbytes are per rank per step, averaged over the 4 ranks; alltoall counts ids out,"
          " rows back and their gradients; allreduce counts dense allreduce payloads plus"
          " sparse allgather payloads (the plan assumes every looked-up id is unique, an"
          " upper bound)")


if __name__ == "__main__":
    main()
