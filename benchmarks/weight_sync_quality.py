"""Held-out logloss of weight-sync (2D sparse) training against gradient sync.

Synthetic click data with a planted signal: every table row has a hidden teacher weight and
a click is drawn with probability sigmoid(sum of the teacher weights of a sample's ids).
On 4 ranks, for D = 2 (2x2 mesh) and D = 4 (4x1 mesh), it trains the same model from the
same start on the same samples three ways and prints the held-out logloss:

- gradient sync every step, row-wise AdaGrad (the exact baseline);
- weight sync every K steps, momentum-scaled row-wise AdaGrad with c = D;
- weight sync every K steps, c = 1 (plain row-wise AdaGrad).

The teacher's own logloss (the best achievable) is printed too.

Usage: .venv/bin/python benchmarks/weight_sync_quality.py [--steps 300] [--sync_every 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import _results  # beside this script

TABLES = [("a", 5000, 8), ("b", 2000, 8), ("c", 20000, 8), ("d", 800, 8)]
HOTNESS = 2


def _data(rng, teacher, n):
    import numpy as np
    ids = [rng.zipf(1.2, size=[n, HOTNESS]) % rows for _, rows, _ in TABLES]
    logit = sum(teacher[t][x].sum(axis=1) for t, x in enumerate(ids)) - 0.5
    p = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < p).astype(np.float32)[:, None]
    return ids, labels, p


def worker(args) -> None:
    import numpy as np
    import tensorflow as tf
    import tfhybrid  # first: it selects tf-keras before horovod touches tf.keras
    import horovod.tensorflow as hvd
    from tfhybrid.layers import DistributedEmbedding, Embedding
    from tfhybrid.optimizers import MomentumScaledRowWiseAdagrad, RowWiseAdagrad
    from tfhybrid.train.step import click_train_step

    mesh = tfhybrid.init(model_parallel=args.model_parallel)
    rng = np.random.default_rng(0)
    teacher = [rng.normal(0, 0.6, size=rows) for _, rows, _ in TABLES]
    global_batch = args.local_batch * mesh.size
    train = [_data(rng, teacher, global_batch) for _ in range(args.steps)]
    held_ids, held_labels, held_p = _data(rng, teacher, 20000)
    teacher_logloss = float(-np.mean(held_labels[:, 0] * np.log(held_p)
                                     + (1 - held_labels[:, 0]) * np.log(1 - held_p)))
    lo, hi = mesh.rank * args.local_batch, (mesh.rank + 1) * args.local_batch

    def run(replica_sync, optimizer):
        layer = DistributedEmbedding(
            [Embedding(rows, dim, combiner="sum", name=name,
                       embeddings_initializer=tf.keras.initializers.RandomUniform(
                           -0.05, 0.05, seed=1))
             for name, rows, dim in TABLES],
            mesh=mesh, replica_sync=replica_sync, sync_every=args.sync_every,
            row_slice_threshold=50_000, column_slice_threshold=10_000)
        head = tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.Constant(0.1))
        layer([tf.constant(x[:2]) for x in train[0][0]])
        head(tf.zeros([1, sum(d for *_, d in TABLES)]))
        tfhybrid.broadcast_variables(layer.weights + head.weights, mesh=mesh)
        optimizer = tfhybrid.DistributedOptimizer(optimizer, mesh=mesh)

        step = tf.function(lambda ids, labels: click_train_step(layer, head, optimizer, ids,
                                                                labels))

        for ids, labels, _ in train:
            step([tf.constant(x[lo:hi]) for x in ids], tf.constant(labels[lo:hi]))
        tfhybrid.sync_replicas(layer.weights, optimizer, mesh)  # the last partial period
        # held-out logloss over the global held-out set, split over the ranks
        share = len(held_labels) // mesh.size
        a, b = mesh.rank * share, (mesh.rank + 1) * share
        logits = head(tf.concat(layer([tf.constant(x[a:b]) for x in held_ids]), axis=1))
        losses = tf.keras.losses.binary_crossentropy(held_labels[a:b], logits,
                                                     from_logits=True)
        return float(hvd.allreduce(tf.reduce_mean(losses), op=hvd.Average))

    d = mesh.data_parallel
    results = {
        "gradient sync": run("gradients", RowWiseAdagrad(args.learning_rate)),
        f"weight sync, c = D = {d}": run(
            "weights", MomentumScaledRowWiseAdagrad(args.learning_rate)),
        "weight sync, c = 1": run(
            "weights", MomentumScaledRowWiseAdagrad(args.learning_rate, momentum_scale=1.0)),
    }
    if mesh.rank == 0:
        print("RESULT " + json.dumps(dict(D=d, M=mesh.model_parallel, teacher=teacher_logloss,
                                          results=results)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model_parallel", type=int, default=2)
    parser.add_argument("--local_batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync_every", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=0.05)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"{args.steps} steps of global batch {args.local_batch * 4} on 4 ranks; weight sync "
          f"every K = {args.sync_every} steps; row-wise AdaGrad lr {args.learning_rate}")
    for model_parallel in (2, 1):
        cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "4", "-H",
               "localhost:4", "--gloo", sys.executable, os.path.abspath(__file__), "--worker",
               "--model_parallel", str(model_parallel), "--local_batch", str(args.local_batch),
               "--steps", str(args.steps), "--sync_every", str(args.sync_every),
               "--learning_rate", str(args.learning_rate)]
        env = _results.child_env(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        line = next((l for l in out.stdout.splitlines() if "RESULT " in l), None)
        if line is None:
            raise RuntimeError(f"run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        result = json.loads(line.split("RESULT ", 1)[1])
        base = result["results"]["gradient sync"]
        print(f"\nD = {result['D']} replicas x M = {result['M']} (teacher logloss "
              f"{result['teacher']:.4f})")
        for name, value in result["results"].items():
            print(f"  {name:28s} held-out logloss {value:.4f}  ({(value / base - 1) * 100:+.2f}%"
                  " vs gradient sync)")


if __name__ == "__main__":
    main()
