"""FIITED's chunked table against the dense table it replaces: forward and train-step time
at 0%, 65% and 90% of the chunks pruned.

Every path runs the same step on the same ids (the kernel benchmark's workload,
benchmarks/_tbe_workload.py: Zipf ids, sum combiner, a fixed upstream gradient, the exact
row-wise AdaGrad step with duplicate ids summed first):

* ``dense, fused C++``: tfhybrid's fused lookup+combine op and row-wise AdaGrad kernel
  (what a dense ``tfhybrid.layers.Embedding`` runs);
* ``dense, pure TF``: the same math in plain TF ops (the ops' fallback);
* ``chunked, p% pruned``: ``tfhybrid.fiited.ChunkedTable.lookup_combine`` with its C++
  kernels (one fused gather-and-sum through the row offsets, whose gradient arrives
  coalesced from the dense kernel's backward; the row-wise AdaGrad on the chunks rows
  hold; the utility update in TF ops), with p% of each table's chunks pruned by utility
  (a random utility per row, so which rows shrink does not follow the ids);
* ``chunked pure TF, 0% pruned``: the same table on its plain-TF path.

Each path in turn builds its tables, times --repeats runs of --iters steps and frees
them. Writes ``benchmarks/results/fiited_speed/table.txt`` (``--quick``: a small
workload into a scratch folder) and prints it: per path the median [p25, p75] (min, max)
milliseconds over the rounds, its ratio to the fused dense path, and the pool's bytes.

Usage: .venv/bin/python benchmarks/fiited_speed.py [--quick] [--tables 4 --rows 250000 --dim 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _results  # beside this script; puts the checkout first on sys.path
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import _tbe_workload as workload_lib  # noqa: E402
from benchmarks._stats import SPREAD_LEGEND, summarize  # noqa: E402
from tfhybrid import custom_ops  # noqa: E402
from tfhybrid.fiited import ChunkedTable  # noqa: E402
from tfhybrid.testing import provenance  # noqa: E402

LR, EPS = workload_lib.LEARNING_RATE, workload_lib.EPSILON


def dense_fns(tables, accumulators, use_op: bool):
    def forward(ids):
        return [custom_ops.embedding_lookup_combine(t, ids[i], combiner="sum",
                                                    use_custom_op=use_op)
                for i, t in enumerate(tables)]

    def train(ids, upstream):
        with tf.GradientTape() as tape:
            out = tf.concat(forward(ids), axis=1)
            loss = tf.reduce_sum(out * upstream)
        grads = tape.gradient(loss, tables)
        for t, a, g in zip(tables, accumulators, grads):
            custom_ops.rowwise_adagrad_apply(t, a, g.indices, g.values, LR, EPS,
                                             use_custom_op=use_op)
        return loss
    return tf.function(lambda ids: tf.concat(forward(ids), axis=1)), tf.function(train)


def chunked_fns(tables):
    def forward(ids):
        return tf.concat([t.lookup_combine(ids[i]) for i, t in enumerate(tables)], axis=1)

    def train(ids, upstream):
        pools = [t.pool for t in tables]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(forward(ids) * upstream)
        for t, g in zip(tables, tape.gradient(loss, pools)):
            t.apply_pool_gradient(g, LR, EPS)
        return loss
    return tf.function(forward), tf.function(train)


def timed(fn, args_of, first: int, iters: int) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` calls on steps first, first + 1..."""
    start = time.perf_counter()
    for k in range(iters):
        result = fn(*args_of(first + k))
    _ = result.numpy() if hasattr(result, "numpy") else None
    return (time.perf_counter() - start) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--hotness", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--pruned", type=float, nargs="+", default=[0.0, 0.65, 0.9])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="a small workload and 2 repeats, written to a scratch folder")
    parser.add_argument("--out", help="folder of table.txt (default: "
                                      "benchmarks/results/fiited_speed)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats, args.iters, args.warmup = 20_000, 2, 2, 1
    out = _results.out_dir("fiited_speed", args.quick, args.out)
    load = provenance.OtherLoad()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if not custom_ops.custom_ops_available():
        raise SystemExit("the C++ ops are not built (make setup builds them)")
    work = workload_lib.Workload(args.tables, args.rows, args.dim, args.batch, args.hotness,
                                 args.alpha, seed=0)
    batches = args.warmup + args.iters * args.repeats
    ids = workload_lib.zipf_ids(work, batches)
    upstream = tf.constant(workload_lib.upstream_gradient(work))
    initial = [workload_lib.initial_table(work, t) for t in range(args.tables)]
    ids_t = [tf.constant(ids[b]) for b in range(batches)]
    lines = [f"workload: {args.tables} tables x {args.rows} x {args.dim} float32, batch "
             f"{args.batch}, {args.hotness} ids per bag, Zipf({args.alpha}), sum, row-wise "
             f"AdaGrad; {args.chunks} chunks per row; {args.threads} threads; "
             f"{args.repeats} x {args.iters} timed steps per path", ""]

    # one path's tables at a time, as a user's process holds one kind: with all six alive
    # and taking turns, the pure-TF paths' large temporaries slowed whichever ran next
    forward_args = lambda k: (ids_t[k % batches],)  # noqa: E731
    train_args = lambda k: (ids_t[k % batches], upstream)  # noqa: E731
    seconds, pool_bytes = {}, {}

    def measure(label, forward, train, pool):
        # the forward's runs back to back, then the train step's, each after its own
        # warm-up (a pure-TF train step between forwards made them 10x slower)
        seconds[label] = ([], [])
        for fn, args_of, out in ((forward, forward_args, seconds[label][0]),
                                 (train, train_args, seconds[label][1])):
            timed(fn, args_of, 0, args.warmup)
            out.extend(timed(fn, args_of, args.warmup + r * args.iters, args.iters)
                       for r in range(args.repeats))
        pool_bytes[label] = pool

    for use_op, label in ((True, "dense, fused C++"), (False, "dense, pure TF")):
        tables = [tf.Variable(x) for x in initial]
        accums = [tf.Variable(tf.zeros([args.rows])) for _ in initial]
        measure(label, *dense_fns(tables, accums, use_op), args.tables * args.rows * args.dim * 4)
        del tables, accums
    rng = np.random.default_rng(1)
    for pruned, use_op in [(p, None) for p in args.pruned] + [(0.0, False)]:
        tables = [ChunkedTable(args.rows, args.dim, args.chunks, initial_value=x, min_chunks=0,
                               use_custom_op=use_op) for x in initial]
        if pruned > 0:
            for t in tables:
                t.utility.assign(rng.random(args.rows).astype(np.float32))
                t.adjust(1.0 - pruned)
        label = "chunked" if use_op is None else "chunked pure TF"
        measure(f"{label}, {pruned:.0%} pruned", *chunked_fns(tables),
                sum(t.memory_bytes()["pool"] for t in tables))
        del tables

    base = next(iter(seconds))
    base_fwd, base_step = (summarize(x).median for x in seconds[base])
    header = (f"{'path':28} {'forward ms ' + SPREAD_LEGEND:>44} {'x fused':>8}   "
              f"{'train step ms':>40} {'x fused':>8}  pool MB")
    lines += [header, "-" * len(header)]
    for label, (forward_seconds, step_seconds) in seconds.items():
        fwd, step, pool = summarize(forward_seconds), summarize(step_seconds), pool_bytes[label]
        lines.append(f"{label:28} {fwd.format(1e3):>44} {fwd.median / base_fwd:8.2f}   "
                     f"{step.format(1e3):>40} {step.median / base_step:8.2f}  "
                     f"{pool / 2**20:7.1f}")
    _results.write_text(os.path.join(out, "table.txt"), lines, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
