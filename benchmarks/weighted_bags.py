"""Weighted bags' lookup + train step against unweighted ones, on the same ids.

The kernel workload of ``benchmarks/dynamic_tables.py`` (8 tables x 1M rows x 64, batch
4096, 8 ids per bag, Zipf(1.05) ids, a new batch every step, loss = sum(output * a fixed
upstream gradient)), one step = lookup + backward + row-wise AdaGrad, through
tfhybrid's ``DistributedEmbedding`` on one process (the default path: the C++ kernels,
the fused backward + AdaGrad):

- ``sum`` and ``mean``: the ids alone;
- ``weighted_sum``, ``weighted_mean`` and ``weighted_sqrtn``: the same ids with per-id
  weights in [0.1, 2) (none dropped: the same rows are read and trained).

Each path runs in a fresh process with TensorFlow's default thread pools, one at a time,
in an order that rotates over the rounds; a path's figure is its step time, median over
the rounds of each run's median step, with the spread of every timed step. Ratios are
taken per round.

Usage: .venv/bin/python benchmarks/weighted_bags.py [--quick] [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import _results  # beside this script, as are _rounds, _stats and dynamic_tables
import _rounds
import _stats
from dynamic_tables import BATCH, DIM, EPSILON, HOTNESS, LEARNING_RATE, ROWS, TABLES, ZIPF
from dynamic_tables import zipf_ids

NAME = "weighted_bags"
LINE = "@weighted_bags "
WARMUP = 3
# (path, combiner, weighted)
PATHS = (("sum", "sum", False), ("weighted_sum", "sum", True), ("mean", "mean", False),
         ("weighted_mean", "mean", True), ("weighted_sqrtn", "sqrtn", True))
RATIOS = (("weighted_sum", "sum", "goal <= 1.15"), ("weighted_mean", "mean", "goal <= 1.15"),
          ("weighted_sqrtn", "mean", "sqrtn's own division beside mean's"))
QUICK = dict(rounds=1, steps=4, rows=50_000, batch=512)
FULL = dict(rounds=3, steps=20, rows=ROWS, batch=BATCH)


def worker(args: argparse.Namespace) -> None:
    ids = np.load(os.path.join(args.data, "ids.npy"))
    weights = np.load(os.path.join(args.data, "weights.npy"))
    upstream = np.load(os.path.join(args.data, "upstream.npy"))
    import tensorflow as tf
    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding, Embedding
    from tfhybrid.optimizers import RowWiseAdagrad
    tfhybrid.init(model_parallel=1)
    initializer = tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=3)
    layer = DistributedEmbedding([Embedding(args.rows, DIM, combiner=args.combiner,
                                            name=f"t{t}", embeddings_initializer=initializer)
                                  for t in range(TABLES)])
    optimizer = RowWiseAdagrad(LEARNING_RATE, epsilon=EPSILON)
    weighted = args.weighted == "1"

    @tf.function
    def step(batch, batch_weights, upstream):
        with tf.GradientTape() as tape:
            out = tf.concat(layer(batch, weights=batch_weights if weighted else None,
                                  training=True), axis=1)
            loss = tf.reduce_sum(out * upstream)
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    upstream = tf.constant(upstream)
    seconds = []
    for b in range(len(ids)):
        batch = [tf.constant(ids[b, t]) for t in range(TABLES)]
        batch_weights = [tf.constant(weights[b, t]) for t in range(TABLES)]
        start = time.perf_counter()
        loss = float(step(batch, batch_weights, upstream))
        if b >= WARMUP:
            seconds.append(time.perf_counter() - start)
        if not np.isfinite(loss):
            raise RuntimeError(f"{args.path}: loss {loss} at step {b}")
    print(LINE + json.dumps({"seconds": seconds, "tf": tf.__version__,
                             "kernel_isa": _kernel_isa()}), flush=True)


def _kernel_isa() -> str:
    from tfhybrid import custom_ops
    return custom_ops.kernel_isa() if custom_ops.custom_ops_available() else "none"


def run_path(path: tuple, data: str, rows: int) -> dict:
    name, combiner, weighted = path
    return _rounds.worker_result(name, [
        sys.executable, os.path.abspath(__file__), "--worker", "--path", name, "--combiner",
        combiner, "--weighted", "1" if weighted else "0", "--data", data, "--rows",
        str(rows)], LINE)


def main() -> int:
    parser = _rounds.parser_with(__doc__.splitlines()[0], ("path", "combiner", "weighted",
                                                           "data"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    settings = _rounds.settings_of(args, QUICK, FULL)
    from tfhybrid.testing import provenance
    load = provenance.OtherLoad()
    out = _results.out_dir(NAME, args.quick, args.out)
    os.makedirs(out, exist_ok=True)
    data = tempfile.mkdtemp(prefix="tfhybrid-weighted-bags-")
    ids = zipf_ids(settings["rows"], WARMUP + settings["steps"], settings["batch"])
    rng = np.random.default_rng(9)
    np.save(os.path.join(data, "ids.npy"), ids)
    np.save(os.path.join(data, "weights.npy"),
            rng.uniform(0.1, 2.0, ids.shape).astype(np.float32))
    np.save(os.path.join(data, "upstream.npy"),
            rng.normal(0, 1, [settings["batch"], TABLES * DIM]).astype(np.float32))

    runs = _rounds.run_rounds(PATHS, settings["rounds"],
                              lambda path: run_path(path, data, settings["rows"]))

    lines = provenance.header(sys.argv, load=load) + [
        f"# workload: {TABLES} tables x {settings['rows']:,} rows x {DIM}, batch "
        f"{settings['batch']}, {HOTNESS} ids/bag, Zipf({ZIPF}), a new batch every step "
        f"({WARMUP} warm-up + {settings['steps']} timed); DistributedEmbedding on one "
        f"process, RowWiseAdagrad; {settings['rounds']} rounds, each path a fresh process, "
        "TF's default threads",
        f"# step time (ms): {_stats.SPREAD_LEGEND} over every timed step; headline: median "
        "over rounds of each run's median", ""]
    medians = {}
    for name, combiner, weighted in PATHS:
        results = runs[name]
        medians[name] = [float(np.median(x["seconds"])) for x in results]
        pooled = _stats.summarize([s for x in results for s in x["seconds"]])
        lines.append(f"{name:16s} {combiner:6s} weights={'yes' if weighted else 'no ':3s} "
                     f"{np.median(medians[name]) * 1e3:8.1f} ms  {pooled.format(1e3, 1)}  "
                     f"(TF {results[-1]['tf']}, kernels {results[-1]['kernel_isa']})")
    lines.append("")
    lines += [_rounds.per_round_ratio(medians, *ratio) for ratio in RATIOS]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "runs.json"), "w") as f:
        json.dump({"provenance": lines[:5], "settings": settings, "runs": runs}, f)
    shutil.rmtree(data, ignore_errors=True)
    print(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
