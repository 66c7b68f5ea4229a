"""A digest of short 2x2 training runs: one line per storage kind x optimizer.

Each case builds a small model on a 2 x 2 mesh (4 ranks under ``horovodrun``): a
``DistributedEmbedding`` whose tables are row-wise, column-wise, table-wise and
replicated (the planner's thresholds below), a dense tower, and trains it with
``model.fit`` for a few steps on fixed data. Its digest is the SHA-256 of every loss,
every full table (``get_weights(all_ranks=True)``) and every dense weight afterwards.
A refactor that must leave training unchanged shows it by an identical file before and
after. Digests depend on the TensorFlow stack and on the Keras that runs them (their
kernels and optimizers round differently), so the file's header and name say both;
compare files of one stack and one Keras.

Storage kinds: ``table`` (tfhybrid's C++ kernel table), ``keras_layer`` (a plain
``tf.keras.layers.Embedding`` as the table), ``fiited`` (``dims="adaptive"``: per-row
dimensions in a chunk pool) and ``tiered`` (rows on disk behind a DRAM cache). Optimizers:
SGD, Adagrad, Adam (tables by RowWiseAdagrad, as ``embedding_optimizer``), RowWiseAdagrad
and MomentumScaledRowWiseAdagrad; FIITED and tiered tables train with the row-wise
optimizers only (the others are refused by design). Equal digests across storage kinds
are expected: a tiered table trains bit for bit as one in memory, and a FIITED table
that was not yet pruned as a plain one.

Usage: .venv/bin/python scripts/training_digest.py [--output FILE] [--cases a:b,...]
           [--keras 2|3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS, MODEL_PARALLEL = 4, 2
LOCAL_BATCH, STEPS = 8, 6
# (name, rows, dim, hotness) with the thresholds below on 2x2: row-wise, column-wise,
# table-wise and replicated tables
TABLES = [("rows", 4000, 8, 3), ("cols", 900, 16, 2), ("whole", 600, 8, 1),
          ("small", 50, 4, 2)]
THRESHOLDS = dict(data_parallel_threshold=300, column_slice_threshold=10_000,
                  row_slice_threshold=30_000)
STORAGES = ("table", "keras_layer", "fiited", "tiered")
OPTIMIZERS = ("sgd", "adagrad", "adam", "rowwise_adagrad", "momentum_rowwise_adagrad")
ROW_WISE = ("rowwise_adagrad", "momentum_rowwise_adagrad")


def all_cases() -> list[str]:
    return [f"{storage}:{optimizer}" for storage in STORAGES for optimizer in OPTIMIZERS
            if storage in ("table", "keras_layer") or optimizer in ROW_WISE]


def _tables(storage: str, store_dir: str):
    import tensorflow as tf

    from tfhybrid.layers import Embedding
    made = []
    for name, rows, dim, _ in TABLES:
        if storage == "keras_layer":
            made.append(tf.keras.layers.Embedding(rows, dim, name=name))
            continue
        extra = {}
        if storage == "fiited" and name != "small":
            extra = dict(dims="adaptive", chunks=4)
        if storage == "tiered" and name == "rows":
            extra = dict(cache_rows=600, store_dir=store_dir)
        made.append(Embedding(rows, dim, combiner="sum", name=name, **extra))
    return made


def _optimizer(name: str):
    import tensorflow as tf

    import tfhybrid
    from tfhybrid.optimizers import MomentumScaledRowWiseAdagrad, RowWiseAdagrad
    made = {"sgd": lambda: tf.keras.optimizers.SGD(0.2),
            "adagrad": lambda: tf.keras.optimizers.Adagrad(0.2),
            "adam": lambda: tf.keras.optimizers.Adam(0.01),
            "rowwise_adagrad": lambda: RowWiseAdagrad(0.2),
            "momentum_rowwise_adagrad":
                lambda: MomentumScaledRowWiseAdagrad(0.2, momentum_scale=0.5)}[name]()
    if name == "adam":
        return tfhybrid.DistributedOptimizer(made, embedding_optimizer=RowWiseAdagrad(0.2))
    return tfhybrid.DistributedOptimizer(made)


def _run_case(case: str, mesh, store_dir: str) -> str:
    """Trains one case on every rank; returns its digest (the same on every rank)."""
    import numpy as np
    import tensorflow as tf

    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding

    storage, optimizer_name = case.split(":")
    tf.keras.utils.set_random_seed(0)
    inputs = [tf.keras.Input([hotness], dtype=tf.int64, name=f"{name}_ids")
              for name, _, _, hotness in TABLES]
    layer = DistributedEmbedding(_tables(storage, store_dir), mesh=mesh, **THRESHOLDS)
    embedded = layer(inputs)
    # a plain Keras table returns [batch, hotness, dim]: summed like the others (Keras
    # layers, since Keras 3 takes no TF op on symbolic tensors; its shapes are tuples)
    embedded = [tf.keras.layers.Lambda(lambda e: tf.reduce_sum(e, axis=1))(e)
                if len(e.shape) == 3 else e for e in embedded]
    hidden = tf.keras.layers.Dense(8, activation="relu")(
        tf.keras.layers.Concatenate(axis=1)(embedded))
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(hidden))
    rng = np.random.default_rng(0)     # the same start on every rank
    layer.set_weights([rng.normal(0, 0.1, w.shape).astype(np.float32)
                       for w in layer.get_weights(all_ranks=True)])
    for dense in model.layers[-2:]:
        dense.set_weights([rng.normal(0, 0.3, w.shape).astype(np.float32)
                           for w in dense.get_weights()])
    model.compile(optimizer=_optimizer(optimizer_name),
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    data = np.random.default_rng(1)
    n = STEPS * LOCAL_BATCH * mesh.size
    ids = [data.integers(0, rows, [n, hotness]) for _, rows, _, hotness in TABLES]
    labels = data.integers(0, 2, [n, 1]).astype(np.float32)
    history = model.fit([x[mesh.rank::mesh.size] for x in ids], labels[mesh.rank::mesh.size],
                        batch_size=LOCAL_BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=tfhybrid.callbacks.defaults())
    digest = hashlib.sha256()
    digest.update(np.asarray(history.history["loss"], np.float64).tobytes())
    for weights in layer.get_weights(all_ranks=True):
        digest.update(np.ascontiguousarray(weights).tobytes())
    for dense in model.layers[-2:]:
        for weights in dense.get_weights():
            digest.update(np.ascontiguousarray(weights).tobytes())
    return digest.hexdigest()


def _rank_main(cases: list[str], output: str) -> None:
    import tfhybrid

    mesh = tfhybrid.init(model_parallel=MODEL_PARALLEL)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            store_dir = os.path.join(tmp, case.replace(":", "_"), f"rank{mesh.rank}")
            lines.append(f"{case:<36}{_run_case(case, mesh, store_dir)}")
    # the last gather runs in each model group; a rank that exits while another group
    # still gathers shuts Horovod down under it (horovod.tensorflow has no barrier)
    import horovod.tensorflow as hvd
    import tensorflow as tf
    hvd.allreduce(tf.constant(0.0), name="training_digest_end")
    if mesh.rank == 0:
        with open(output, "w") as f:
            f.write("\n".join(lines) + "\n")


def _keras_major() -> int:
    """The Keras the ranks run as tf.keras, asked of a fresh interpreter with this
    process's environment (TensorFlow decides it at its first tf.keras use)."""
    # tfhybrid's own answer: tf-keras' tf.keras has no __version__
    code = "import tfhybrid; print(tfhybrid.keras_major())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT),
                          check=True)
    return int(done.stdout.split()[-1])


def _header(argv: list[str]) -> str:
    from importlib import metadata

    sys.path.insert(0, ROOT)
    from tfhybrid.testing import provenance
    versions = ", ".join(f"{d} {metadata.version(d)}" for d in ("tensorflow", "tf-keras",
                                                                 "numpy", "horovod"))
    versions += f"; tf.keras: Keras {_keras_major()}"
    return "\n".join(provenance.header(argv) + [
        f"# stack: {versions}",
        f"# {RANKS} ranks, {RANKS // MODEL_PARALLEL} x {MODEL_PARALLEL} mesh, "
        f"2 epochs of {STEPS} steps of {LOCAL_BATCH} samples per rank; "
        "SHA-256 of the losses, full tables and dense weights"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(all_cases()),
                        help="storage:optimizer, comma separated (default: all)")
    parser.add_argument("--output", help="also write the digests to this file, under a "
                        "header (command, commit, date, CPU, stack)")
    parser.add_argument("--keras", choices=("2", "3"),
                        help="the Keras the ranks run as tf.keras (sets TF_USE_LEGACY_KERAS; "
                        "default: TensorFlow's choice). Digests differ between the two "
                        "(their optimizers round differently): compare files of one Keras")
    parser.add_argument("--rank-main", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.keras:
        os.environ["TF_USE_LEGACY_KERAS"] = "1" if args.keras == "2" else "0"
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in all_cases()]
    if unknown:
        parser.error(f"unknown cases {unknown}; expected some of {all_cases()}")
    if args.rank_main:
        _rank_main(cases, args.rank_main)
        return 0
    python = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "digests.txt")
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                   OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
                   TF_NUM_INTEROP_THREADS="1")
        command = [os.path.join(os.path.dirname(python), "horovodrun"), "-np", str(RANKS),
                   "-H", f"localhost:{RANKS}", "--gloo", python, os.path.abspath(__file__),
                   "--cases", args.cases, "--rank-main", out]
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=1800)
        if done.returncode != 0 or not os.path.exists(out):
            # every rank's output: the first rank to fail is rarely the last to print
            fd, log = tempfile.mkstemp(prefix="training_digest.", suffix=".log")
            with os.fdopen(fd, "w") as f:
                f.write(done.stdout + done.stderr)
            sys.stderr.write("\n".join((done.stdout + done.stderr).splitlines()[-40:])
                             + f"\ntraining_digest: the run failed; all ranks' output in {log}\n")
            return 1
        body = open(out).read()
    text = _header(sys.argv) + "\n" + body
    print(text, end="")
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
