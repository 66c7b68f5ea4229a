"""The cost model's compute rates, measured: what ``cost_model_validation.py`` would
otherwise fit (``tfhybrid.plan.cost_model.ComputeRates``).

For one workload of the emulated cluster's grid (``cluster_comm.py --workload``), in the
environment of its jobs: ``--ranks`` ranks of ``horovodrun --gloo`` on this machine's
cores, one thread each, every rank measuring at the same time (so each gets the share of
the cores it gets in a cluster job), on the app's synthetic batches (global batch / ranks
samples each):

* ``lookup_bytes_per_s``: tfhybrid's table-batched lookup + combine kernel over the
  workload's 26 tables (the forward), per byte of the planner's lookup bytes;
* ``apply_bytes_per_s["rowwise_adagrad"]``: the lookup's backward fused with row-wise
  AdaGrad (a step's time less the forward's), per byte of the planner's apply bytes;
* ``dense_seconds_per_sample``: the DLRM towers (the app's ``mlp`` and ``DotInteraction``
  on the embedding outputs' shapes) forward, backward and Adam, per sample;
* ``collective_overhead_seconds``: one Horovod call on a tiny tensor, alternating
  allreduce and alltoall, chained so each waits for the one before, per call.

The bytes come from the planner (``position_traffic`` of the one-position plan), the
definitions the model prices. Step overhead and the overlap are not measured here:
``cost_model_validation.py`` fits them. Each rank takes the median of ``--repeats`` timed
samples per figure, the compute phases taking turns, each sample as many calls as last
0.1 s (a few-millisecond call timed alone on a rank that shares a core would measure the
scheduler's slices); the figure is the median over the ranks, with their min-max beside
it. Writes ``rates_<workload>.json`` and ``rates_<workload>.txt`` into
--out.

Usage: .venv/bin/python benchmarks/cost_model_rates.py [--workload dlrm|second]
       [--ranks 4] [--repeats 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Callable

try:
    import _results  # beside this script; it puts the checkout first on sys.path
except ImportError:  # imported as benchmarks.cost_model_rates
    from benchmarks import _results
try:
    import cluster_comm  # beside this script: the workloads
except ImportError:
    from benchmarks import cluster_comm
from benchmarks._stats import timed_calls  # noqa: E402

LEARNING_RATE, EPSILON = 0.01, 1e-8
# a timed sample of a compute phase spans many of the scheduler's time slices
SAMPLE_SECONDS = 0.1
# each rate as the text file shows it: label, scale, unit
SHOWN = {"lookup_bytes_per_s": ("lookup (forward kernel)", 1e-9, "GB/s"),
         "apply_bytes_per_s": ("apply (backward + row-wise AdaGrad)", 1e-9, "GB/s"),
         "dense_seconds_per_sample": ("towers, per sample", 1e6, "us"),
         "collective_overhead_seconds": ("one collective call", 1e3, "ms")}
CHAINED_CALLS = 20   # collective calls per timed chain (half allreduce, half alltoall)


def interleaved_seconds(phases: dict[str, Callable[[], object]], repeats: int,
                        barrier: Callable[[], object] = lambda: None) -> dict[str, float]:
    """Median seconds per call of each phase, the phases taking turns ``repeats`` times.

    A phase's sample is as many calls as last ``SAMPLE_SECONDS``: a few-millisecond call
    timed alone on a rank that shares a core would measure the scheduler's slices, not the
    call. Taking turns keeps a drift of the machine from favouring one phase; ``barrier``
    (every rank at once) runs before the first turn.

    >>> got = interleaved_seconds({"a": lambda: sum(range(1000))}, repeats=3)
    >>> list(got), got["a"] > 0
    (['a'], True)
    """
    calls = {}
    for name, fn in phases.items():
        once = min(timed_calls(fn, 3, warmup=2))
        calls[name] = max(1, math.ceil(SAMPLE_SECONDS / max(once, 1e-6)))
    barrier()
    samples: dict[str, list[float]] = {name: [] for name in phases}
    for _ in range(repeats):
        for name, fn in phases.items():
            samples[name].append(sum(timed_calls(fn, calls[name], warmup=0)) / calls[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def _dense_and_labels(batch: tuple) -> tuple:
    features, labels = batch
    return features["dense"], labels


def worker(args: argparse.Namespace) -> int:
    """One rank: measures, and rank 0 writes every rank's figures to ``args.result``."""
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from tfhybrid import custom_ops
    from tfhybrid.plan.planner import plan_sharding
    from tfhybrid.plan.traffic import position_traffic
    from tfhybrid.plan.types import TableConfig
    from tfhybrid.train import data as data_lib
    from tfhybrid.train import models

    hvd.init()
    work = cluster_comm.WORKLOADS[args.workload]
    dim, local = work["embedding_dim"], work["global_batch"] // hvd.size()
    spec = data_lib.dataset_spec("synthetic", max_table_rows=work["max_table_rows"])
    batches = list(data_lib.make_dataset(
        "synthetic", "train", global_batch_size=work["global_batch"], rank=hvd.rank(),
        size=hvd.size(), max_table_rows=work["max_table_rows"], num_batches=8))
    rng = np.random.default_rng(hvd.rank())
    tables = [tf.Variable(rng.uniform(-0.05, 0.05, (rows, dim)).astype(np.float32))
              for rows in spec.table_rows]
    accumulators = [tf.Variable(np.zeros(rows, np.float32)) for rows in spec.table_rows]
    upstream = tf.constant(rng.standard_normal((local, dim * len(tables))), tf.float32)

    def ids_of(batch):
        return batch[0]["categorical"]

    def lookup(categorical):
        # one id per sample and table, split inside the traced function (not per call)
        ids = [categorical[:, t:t + 1] for t in range(len(tables))]
        return custom_ops.embedding_lookup_combine_concat(tables, ids, "sum",
                                                          use_custom_op=True)

    forward = tf.function(lookup)

    @tf.function
    def lookup_and_apply(categorical):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(lookup(categorical) * upstream)
        for table, accumulator, grad in zip(tables, accumulators,
                                            tape.gradient(loss, tables)):
            custom_ops.rowwise_adagrad_apply(table, accumulator, grad.indices, grad.values,
                                             LEARNING_RATE, EPSILON, use_custom_op=True)

    bottom = models.mlp([int(d) for d in work["bottom_mlp_dims"].split(",")], "bottom_mlp",
                        last_linear=False, seed=0)
    top = models.mlp([int(d) for d in work["top_mlp_dims"].split(",")], "top_mlp",
                     last_linear=True, seed=0)
    interaction = models.DotInteraction()
    adam = tf.keras.optimizers.Adam(1e-3)
    vectors = [tf.constant(rng.standard_normal((local, dim)), tf.float32) for _ in tables]
    loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def dense_step(dense, labels):
        with tf.GradientTape() as tape:
            tape.watch(vectors)
            logits = top(interaction([bottom(dense)] + vectors))
            loss = loss_fn(labels, logits)
        weights = bottom.trainable_variables + top.trainable_variables
        grads = tape.gradient(loss, weights + vectors)
        adam.apply_gradients(zip(grads[:len(weights)], weights))

    tiny = tf.zeros([hvd.size()], tf.float32)

    @tf.function
    def chained_collectives():
        x = tiny
        for i in range(CHAINED_CALLS // 2):
            x = hvd.allreduce(x, op=hvd.Sum, name=f"overhead_allreduce_{i}") * 0.0
            x = hvd.alltoall(x, name=f"overhead_alltoall_{i}")
        return x

    cycle = iter(range(10**9))

    def next_batch():
        return batches[next(cycle) % len(batches)]

    phases = {"forward": lambda: forward(ids_of(next_batch())),
              "lookup_and_apply": lambda: lookup_and_apply(ids_of(next_batch())),
              "dense": lambda: dense_step(*_dense_and_labels(next_batch()))}
    seconds = interleaved_seconds(phases, args.repeats,
                                  lambda: hvd.allreduce(tf.zeros([1]), name="phase_barrier"))
    hvd.allreduce(tf.zeros([1]), name="chain_barrier")
    seconds["collective_chain"] = statistics.median(
        timed_calls(chained_collectives, args.repeats, warmup=3))
    configs = [TableConfig(f"t{t}", rows, dim) for t, rows in enumerate(spec.table_rows)]
    plan = plan_sharding(configs, 1, 1, local_batch_size=local, optimizer="rowwise_adagrad")
    traffic = position_traffic(plan, configs, 0)
    mine = {"seconds": seconds, "lookup_bytes": traffic.lookup_bytes_per_sample * local,
            "apply_bytes": traffic.apply_bytes, "local_batch": local}
    everyone = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(everyone, f)
    return 0


def rates_of(ranks: list[dict]) -> dict:
    """The rates (median over the ranks) and each rate's min-max over them.

    >>> rank = {"seconds": {"forward": 0.01, "lookup_and_apply": 0.03125, "dense": 0.02,
    ...                     "collective_chain": 0.004}, "lookup_bytes": 1e6,
    ...         "apply_bytes": 2.125e6, "local_batch": 100}
    >>> rates = rates_of([rank])["rates"]
    >>> round(rates["lookup_bytes_per_s"]), round(rates["apply_bytes_per_s"]["rowwise_adagrad"])
    (100000000, 100000000)
    >>> rates["dense_seconds_per_sample"], rates["collective_overhead_seconds"]
    (0.0002, 0.0002)
    """
    def per_rank(r: dict) -> dict:
        s = r["seconds"]
        return {"lookup_bytes_per_s": r["lookup_bytes"] / s["forward"],
                "apply_bytes_per_s": r["apply_bytes"] / (s["lookup_and_apply"] - s["forward"]),
                "dense_seconds_per_sample": s["dense"] / r["local_batch"],
                "collective_overhead_seconds": s["collective_chain"] / CHAINED_CALLS}
    each = [per_rank(r) for r in ranks]
    median = {k: statistics.median(e[k] for e in each) for k in each[0]}
    spread = {k: [min(e[k] for e in each), max(e[k] for e in each)] for k in each[0]}
    median["apply_bytes_per_s"] = {"rowwise_adagrad": median["apply_bytes_per_s"]}
    return {"rates": median, "spread": spread}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="dlrm", choices=sorted(cluster_comm.WORKLOADS))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None,
                        help="results folder (default: benchmarks/results/cost_model_rates)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.ranks < 1 or args.repeats < 1:
        raise SystemExit(f"--ranks={args.ranks}, --repeats={args.repeats}: expected >= 1")
    out = _results.out_dir("cost_model_rates", False, args.out)
    os.makedirs(out, exist_ok=True)
    from tfhybrid.testing import provenance
    load = provenance.OtherLoad()
    result = tempfile.mktemp(prefix="tfhybrid-rates-", suffix=".json")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    command = [horovodrun, "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo",
               sys.executable, os.path.abspath(__file__), "--worker", "--workload",
               args.workload, "--repeats", str(args.repeats), "--result", result]
    done = subprocess.run(command, env=_results.child_env(
        TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1"), cwd=_results.ROOT,
        timeout=1200)
    if done.returncode != 0 or not os.path.exists(result):
        raise SystemExit(f"the measuring job failed (exit {done.returncode})")
    with open(result) as f:
        ranks = json.load(f)
    os.remove(result)
    measured = rates_of(ranks)
    work = cluster_comm.WORKLOADS[args.workload]
    lines = [f"workload {args.workload}: " + ", ".join(f"{k} {v}" for k, v in work.items()),
             f"{args.ranks} ranks at once, one thread each; median of {args.repeats} timed "
             f"samples per rank (each {SAMPLE_SECONDS:g} s of calls), then the median over "
             f"the ranks [min, max]", ""]
    for name, (label, scale, unit) in SHOWN.items():
        value = measured["rates"][name]
        value = value["rowwise_adagrad"] if isinstance(value, dict) else value
        low, high = measured["spread"][name]
        lines.append(f"{label:38} {value * scale:8.3f} {unit:9} [{low * scale:.3f}, "
                     f"{high * scale:.3f}]   ({name})")
    lines.append("")
    lines.append("per rank: " + "; ".join(
        f"rank {i}: " + ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in r["seconds"].items())
        for i, r in enumerate(ranks)))
    _results.write_text(os.path.join(out, f"rates_{args.workload}.txt"), lines, load)
    _results.write_json(os.path.join(out, f"rates_{args.workload}.json"),
                        {"workload": work, **measured, "ranks": ranks}, load)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
