"""Training-step time of a DLRM-like model: fp32 vs fp16/bf16, with and without XLA towers.

One process, a DistributedEmbedding of 8 tables and a 512-256-128-1 MLP over the
concatenated embeddings, batch 4096, SGD. The baseline is fp32 without XLA, in the same run.

Usage: .venv/bin/python benchmarks/mixed_xla_step.py [--steps 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time


def measure(policy: str, xla: bool, args) -> float:
    import numpy as np
    import tensorflow as tf

    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding, Embedding, XlaCompiled
    from tfhybrid.train.step import click_train_step

    tf.keras.mixed_precision.set_global_policy(policy)
    mesh = tfhybrid.init(model_parallel=1)
    embedding = DistributedEmbedding(
        [Embedding(100_000, 64, combiner="sum", name=f"t{i}") for i in range(8)], mesh=mesh)
    tower = tf.keras.Sequential([tf.keras.layers.Dense(512, activation="relu"),
                                 tf.keras.layers.Dense(256, activation="relu"),
                                 tf.keras.layers.Dense(128, activation="relu"),
                                 tf.keras.layers.Dense(1),
                                 tf.keras.layers.Activation("linear", dtype="float32")])
    head = XlaCompiled(tower) if xla else tower
    optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), mesh=mesh)
    rng = np.random.default_rng(0)
    ids = [tf.constant(rng.integers(0, 100_000, size=[args.batch, 4])) for _ in range(8)]
    labels = tf.constant(rng.integers(0, 2, size=[args.batch, 1]).astype(np.float32))
    step = tf.function(lambda: click_train_step(embedding, head, optimizer, ids, labels))
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    loss.numpy()
    seconds = (time.perf_counter() - start) / args.steps
    tfhybrid.mesh.reset()
    tf.keras.mixed_precision.set_global_policy("float32")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    print(f"batch {args.batch}, {args.steps} timed steps after 3 warm-up, {args.threads} threads")
    base = None
    for policy, xla in (("float32", False), ("float32", True), ("mixed_float16", False),
                        ("mixed_float16", True), ("mixed_bfloat16", False),
                        ("mixed_bfloat16", True)):
        seconds = measure(policy, xla, args)
        base = base or seconds
        print(f"{policy:15s} xla={'on ' if xla else 'off'}  {seconds * 1e3:8.1f} ms/step  "
              f"{args.batch / seconds:9.0f} samples/s  {base / seconds:5.2f}x vs fp32 no-XLA")


if __name__ == "__main__":
    main()
