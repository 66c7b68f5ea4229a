"""Dynamic tables' lookup + train step against fixed tables and TFRA, on the same keys.

The kernel workload (8 tables, batch 4096, 8 ids per bag, Zipf(1.05) ids over 1M rows,
width 64, sum combiner, the 8 bags side by side, loss = sum(output * a fixed upstream
gradient)), one step = lookup + backward + optimizer apply, in one process:

- ``fixed``: tfhybrid's ``DistributedEmbedding`` of 8 ``Embedding(1M, 64)`` tables on the
  ids as rows, ``RowWiseAdagrad`` (TF 2.21, the default path);
- ``dynamic``: the same layer of 8 ``DynamicEmbedding(64, capacity=1M)`` tables on the
  same ids as raw keys (each id through a fixed 64-bit bijection), ``RowWiseAdagrad``;
- on TF 2.15.1, where TFRA 0.7.2 loads: ``dynamic`` again, and TFRA's
  ``de.keras.layers.Embedding`` (its CPU cuckoo hash table) on the same keys, bags
  summed, through ``de.DynamicEmbeddingOptimizer``: with SGD on both sides (the same
  update, Keras' legacy ``SGD`` class on both), and with their AdaGrads (tfhybrid's row-wise, TFRA's element-wise Keras
  Adagrad: a different optimizer, labelled so).

Every step sees a new batch of the stream, so new keys keep arriving (no eviction: the
capacity holds every key). Each path runs in a fresh process with TensorFlow's default
thread pools, one path at a time, in an order that rotates over the rounds; a path's
figure is its step time, median over the rounds of each run's median step, with the
spread of every timed step. Ratios are taken per round, against the path named. The
memory of a dynamic table's slot is its variables' bytes over its capacity.

Usage: .venv/bin/python benchmarks/dynamic_tables.py [--quick] [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

import _results  # beside this script, as are _rounds and _stats
import _rounds
import _stats

NAME = "dynamic_tables"
LINE = "@dynamic_tables "
TABLES, ROWS, DIM, BATCH, HOTNESS, ZIPF = 8, 1_000_000, 64, 4096, 8, 1.05
LEARNING_RATE, EPSILON = 0.01, 1e-8
WARMUP = 3
GOLDEN = 0x9E3779B97F4A7C15
# (path, venv, library, optimizer)
PATHS = (("fixed", ".venv", "tfhybrid_fixed", "rowwise_adagrad"),
         ("dynamic", ".venv", "tfhybrid_dynamic", "rowwise_adagrad"),
         ("dynamic_tf2.15", ".venv-tf2.15", "tfhybrid_dynamic", "rowwise_adagrad"),
         ("tfra_tf2.15", ".venv-tfra", "tfra", "adagrad"),
         ("dynamic_tf2.15_sgd", ".venv-tf2.15", "tfhybrid_dynamic", "sgd"),
         ("tfra_tf2.15_sgd", ".venv-tfra", "tfra", "sgd"))
# (numerator, denominator, what the ratio says)
RATIOS = (("dynamic", "fixed", "goal <= 1.5"),
          ("dynamic_tf2.15_sgd", "tfra_tf2.15_sgd", "goal < 1: the same SGD update"),
          ("dynamic_tf2.15", "tfra_tf2.15",
           "tfhybrid row-wise AdaGrad vs TFRA element-wise Adagrad"))
QUICK = dict(rounds=1, steps=4, rows=50_000, batch=512)
FULL = dict(rounds=3, steps=20, rows=ROWS, batch=BATCH)


def keys_of(ids: np.ndarray) -> np.ndarray:
    """The raw key of each id: (id + 1) * an odd constant mod 2**64, a bijection."""
    with np.errstate(over="ignore"):
        return ((ids.astype(np.uint64) + np.uint64(1)) * np.uint64(GOLDEN)).view(np.int64)


def zipf_ids(rows: int, batches: int, batch: int, seed: int = 7) -> np.ndarray:
    """int64 [batches, tables, batch, hotness]: Zipf(ZIPF) over ``rows`` per table, hot rows
    scattered by a fixed permutation per table."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -ZIPF)
    cdf /= cdf[-1]
    permutations = [rng.permutation(rows) for _ in range(TABLES)]
    ids = np.empty([batches, TABLES, batch, HOTNESS], np.int64)
    for b in range(batches):
        for t in range(TABLES):
            ranks = np.minimum(np.searchsorted(cdf, rng.random([batch, HOTNESS])), rows - 1)
            ids[b, t] = permutations[t][ranks]
    return ids


# ------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> None:
    ids = np.load(os.path.join(args.data, "ids.npy"))
    upstream = np.load(os.path.join(args.data, "upstream.npy"))
    import tensorflow as tf
    if args.library == "tfra":
        step, held, memory = _tfra_step(tf, args)
    else:
        step, held, memory = _tfhybrid_step(tf, args)
    feeds = ids if args.library == "tfhybrid_fixed" else keys_of(ids)
    upstream = tf.constant(upstream)
    seconds = []
    for b in range(len(feeds)):
        batch = [tf.constant(feeds[b, t]) for t in range(TABLES)]
        start = time.perf_counter()
        loss = float(step(batch, upstream))
        if b >= WARMUP:
            seconds.append(time.perf_counter() - start)
        if not np.isfinite(loss):
            raise RuntimeError(f"{args.path}: loss {loss} at step {b}")
    result = {"seconds": seconds, "keys_held": held(), "memory": memory(),
              "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "tf": tf.__version__}
    print(LINE + json.dumps(result), flush=True)


def _tfhybrid_step(tf, args):
    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding, DynamicEmbedding, Embedding
    from tfhybrid.optimizers import RowWiseAdagrad
    tfhybrid.init(model_parallel=1)
    initializer = tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=3)
    if args.library == "tfhybrid_fixed":
        tables = [Embedding(args.rows, DIM, combiner="sum", name=f"t{t}",
                            embeddings_initializer=initializer) for t in range(TABLES)]
    else:
        tables = [DynamicEmbedding(DIM, capacity=args.rows, combiner="sum", name=f"t{t}",
                                   initializer=initializer, seed=3) for t in range(TABLES)]
    layer = DistributedEmbedding(tables)
    # SGD: the legacy Keras class TFRA's side runs too (the new one compiles its update
    # with XLA by default, which makes the table's sparse gradient dense)
    optimizer = (RowWiseAdagrad(LEARNING_RATE, epsilon=EPSILON)
                 if args.optimizer == "rowwise_adagrad"
                 else tf.keras.optimizers.legacy.SGD(LEARNING_RATE))

    @tf.function
    def step(batch, upstream):
        with tf.GradientTape() as tape:
            out = tf.concat(layer(batch, training=True), axis=1)
            loss = tf.reduce_sum(out * upstream)
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    def held():
        if args.library == "tfhybrid_fixed":
            return None
        return sum(stats["size"] for stats in layer.table_stats().values())

    def memory():
        if args.library == "tfhybrid_fixed":
            return None
        slots = [store.tracked for _, store in layer.stores.items()]
        per_slot = [t.memory_bytes()["total"] / t.capacity for t in slots]
        return {"bytes_per_slot": float(np.mean(per_slot)),
                "row_and_optimizer_bytes": DIM * 4 + (4 if args.optimizer ==
                                                      "rowwise_adagrad" else 0)}

    return step, held, memory


def _tfra_step(tf, args):
    from tensorflow_recommenders_addons import dynamic_embedding as de
    initializer = tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=3)
    tables = [de.keras.layers.Embedding(DIM, key_dtype=tf.int64, initializer=initializer,
                                        init_capacity=args.rows, name=f"t{t}")
              for t in range(TABLES)]
    inner = (tf.keras.optimizers.legacy.Adagrad(LEARNING_RATE, epsilon=EPSILON)
             if args.optimizer == "adagrad" else tf.keras.optimizers.legacy.SGD(LEARNING_RATE))
    optimizer = de.DynamicEmbeddingOptimizer(inner)
    variables = [v for table in tables for v in table.trainable_variables]

    @tf.function
    def step(batch, upstream):
        with tf.GradientTape() as tape:
            out = tf.concat([tf.reduce_sum(table(ids), axis=1)
                             for table, ids in zip(tables, batch)], axis=1)
            loss = tf.reduce_sum(out * upstream)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    return step, lambda: int(sum(int(t.params.size()) for t in tables)), lambda: None


# ------------------------------------------------------------------ the run
def run_path(path: tuple, data: str, rows: int) -> dict:
    name, venv, library, optimizer = path
    python = os.path.join(_results.ROOT, venv, "bin", "python")
    # TFRA's import needs setuptools < 70 (pkg_resources), which its venv holds
    return _rounds.worker_result(name, [
        python, os.path.abspath(__file__), "--worker", "--path", name, "--library", library,
        "--optimizer", optimizer, "--data", data, "--rows", str(rows)], LINE)


def main() -> int:
    parser = _rounds.parser_with(__doc__.splitlines()[0],
                                 ("path", "library", "optimizer", "data"))
    parser.add_argument("--paths", help="comma-separated paths to run (default: all; the "
                                        "ratios need their two)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    settings = _rounds.settings_of(args, QUICK, FULL)
    from tfhybrid.testing import provenance
    load = provenance.OtherLoad()
    out = _results.out_dir(NAME, args.quick, args.out)
    os.makedirs(out, exist_ok=True)
    # the stream's ids (tens of MB) live beside the run only
    data = tempfile.mkdtemp(prefix="tfhybrid-dynamic-tables-")
    ids = zipf_ids(settings["rows"], WARMUP + settings["steps"], settings["batch"])
    np.save(os.path.join(data, "ids.npy"), ids)
    rng = np.random.default_rng(8)
    np.save(os.path.join(data, "upstream.npy"),
            rng.normal(0, 1, [settings["batch"], TABLES * DIM]).astype(np.float32))
    distinct = sum(len(np.unique(ids[:, t])) for t in range(TABLES))

    chosen = [p for p in PATHS if not args.paths or p[0] in args.paths.split(",")]
    runs = _rounds.run_rounds(chosen, settings["rounds"],
                              lambda path: run_path(path, data, settings["rows"]))

    lines = provenance.header(sys.argv, load=load) + [
        f"# workload: {TABLES} tables x {settings['rows']:,} rows x {DIM}, batch "
        f"{settings['batch']}, {HOTNESS} ids/bag, Zipf({ZIPF}), a new batch every step "
        f"({WARMUP} warm-up + {settings['steps']} timed), {distinct:,} distinct keys in all; "
        f"{settings['rounds']} rounds, each path a fresh process, TF's default threads",
        f"# step time (ms): {_stats.SPREAD_LEGEND} over every timed step; headline: median "
        "over rounds of each run's median", ""]
    medians = {}
    for name, _, library, optimizer in chosen:
        results = runs[name]
        run_medians = [float(np.median(x["seconds"])) for x in results]
        medians[name] = run_medians
        pooled = _stats.summarize([s for x in results for s in x["seconds"]])
        last = results[-1]
        memory = last["memory"]
        extra = ""
        if memory:
            extra = (f", {memory['bytes_per_slot']:.2f} B/slot = row and optimizer "
                     f"{memory['row_and_optimizer_bytes']} + "
                     f"{memory['bytes_per_slot'] - memory['row_and_optimizer_bytes']:.2f}")
        held = "" if last["keys_held"] is None else f", keys held {last['keys_held']:,}"
        lines.append(f"{name:20s} TF {last['tf']:7s} {library:17s} {optimizer:16s} "
                     f"{np.median(run_medians) * 1e3:8.1f} ms  {pooled.format(1e3, 1)}"
                     f"{held}{extra}, max RSS {last['max_rss_mb']:.0f} MB")
    lines.append("")
    for top, bottom, what in RATIOS:
        if top not in medians or bottom not in medians:
            continue
        lines.append(_rounds.per_round_ratio(medians, top, bottom, what))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "runs.json"), "w") as f:
        # the provenance first: command, commit, date, CPU, other load
        json.dump({"provenance": lines[:5], "settings": settings,
                   "distinct_keys": distinct, "runs": runs}, f)
    shutil.rmtree(data, ignore_errors=True)
    print(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
