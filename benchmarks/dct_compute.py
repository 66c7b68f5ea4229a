"""DCT's own compute per step on one rank, against that rank's training step (issue 14).

The workload is benchmarks/cluster_comm.py's DLRM (26 tables of width 32, bottom MLP
64-32, top MLP 64-32-1) at its local batch on 4 ranks (2048 / 4 = 512 samples). In one
process, in the same run, it times with tf.function, each as the median of repeats:

- the baseline: one training step of that model on this rank (forward, backward, SGD;
  no collectives, so it is all compute);
- DCT-DP: ``GradientThresholder.select`` over every dense gradient of the model, on a
  step that reuses the thresholds (one compare per entry) and on a refresh step
  (a top-k per gradient; every ``refresh_every`` steps);
- DCT-MP: an owner's per-sample top-k over the rows it returns (``keep_largest``) and
  the receiver's rebuild (``scatter_kept``), forward and backward, for the widths an
  owner returns per sample on a 1D mesh of 4 (7 tables x 32) and a 2D mesh with M = 2
  (13 tables x 32).

Writes the table to --out (default benchmarks/results/dct_compute.txt).

Usage: .venv/bin/python benchmarks/dct_compute.py [--repeats 30] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import _results  # beside this script; it puts the checkout first on sys.path
from benchmarks import cluster_comm  # noqa: E402
from benchmarks._stats import SPREAD_LEGEND, summarize, timed_calls  # noqa: E402

RANKS = 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(_results.RESULTS, "dct_compute.txt"))
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import tfhybrid
    from tfhybrid import compression, roles
    from tfhybrid.train import data as data_lib
    from tfhybrid.train.models import build_model, example_batch

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    work = cluster_comm.WORKLOAD
    local_batch = work["global_batch"] // RANKS
    dim = work["embedding_dim"]
    tfhybrid.init(model_parallel=1)
    spec = data_lib.dataset_spec("synthetic", max_table_rows=work["max_table_rows"])
    model = build_model("dlrm", spec.table_rows, spec.dense_features, embedding_dim=dim,
                        bottom_mlp_dims=[int(x) for x in work["bottom_mlp_dims"].split(",")],
                        top_mlp_dims=[int(x) for x in work["top_mlp_dims"].split(",")])
    rng = np.random.default_rng(0)
    batch = {"dense": tf.constant(rng.random([local_batch, spec.dense_features]), tf.float32),
             "categorical": tf.constant(np.stack(
                 [rng.integers(0, rows, local_batch) for rows in spec.table_rows], 1),
                 tf.int32)}
    labels = tf.constant(rng.integers(0, 2, [local_batch, 1]), tf.float32)
    model(example_batch(model, local_batch))
    optimizer = tf.keras.optimizers.SGD(0.01)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.binary_crossentropy(
                labels, model(batch, training=True), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dense = [v for v in model.trainable_variables if not roles.is_embedding(v)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.binary_crossentropy(
            labels, model(batch, training=True), from_logits=True))
    dense_grads = tape.gradient(loss, dense)
    dct = compression.DCT()
    thresholder = compression.GradientThresholder(dct)

    def dp_select(refresh: bool):
        @tf.function
        def select():
            return [thresholder.select(g, v, tf.constant(refresh))[1]
                    for g, v in zip(dense_grads, dense)]
        return select

    def mp_round_trip(owners: int):
        width = math.ceil(len(spec.table_rows) / owners) * dim
        rows = tf.Variable(tf.random.normal([owners, local_batch, width]))
        upstream = tf.random.normal([owners, local_batch, width])

        @tf.function
        def round_trip():
            with tf.GradientTape() as tape:
                values, positions = compression.keep_largest(rows, dct.mp_keep)
                rebuilt = compression.scatter_kept(values, positions, width)
                loss = tf.reduce_sum(rebuilt * upstream)
            return tape.gradient(loss, rows)
        return round_trip, width

    entries = sum(v.shape.num_elements() for v in dense)
    from tfhybrid.testing import provenance
    load = provenance.OtherLoad()
    base = summarize(timed_calls(train_step, args.repeats))
    between = summarize(timed_calls(dp_select(False), args.repeats))
    refresh = summarize(timed_calls(dp_select(True), args.repeats))
    say = []
    say.append(f"one rank of {RANKS}: local batch {local_batch}, {len(dense)} dense variables "
               f"({entries:,} entries), DCT {dct.get_config()}; ms, {SPREAD_LEGEND}")
    say.append(f"  baseline: one training step          {base.format(1e3)}")
    say.append(f"  DCT-DP select, threshold reused      {between.format(1e3)}  "
               f"{between.median / base.median:6.1%} of the step")
    say.append(f"  DCT-DP select, refresh (top-k)       {refresh.format(1e3)}  "
               f"{refresh.median / base.median:6.1%} of the step, once every "
               f"{dct.refresh_every} steps")
    for label, owners in (("1D mesh of 4", 4), ("2D, M = 2", 2)):
        round_trip, width = mp_round_trip(owners)
        mp = summarize(timed_calls(round_trip, args.repeats))
        say.append(f"  DCT-MP {label:12} width {width:3}: top-k + rebuild, fwd + bwd "
                   f"{mp.format(1e3)}  {mp.median / base.median:6.1%} of the step")
    _results.write_text(args.out, say, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
