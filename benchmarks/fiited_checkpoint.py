"""Checkpoint bytes and save/restore time of FIITED tables against the dense tables they
replace.

One process builds a ``DistributedEmbedding`` of ``--tables`` tables of ``--rows`` x
``--dim`` trained by ``RowWiseAdagrad``, once with dense tables and once with
``dims="adaptive"`` tables in ``--chunks`` chunks, pruned to each ``--targets`` share of
their chunks (by a random utility per row, so which rows shrink does not matter). Each
layer takes one training step, so the optimizer's accumulators exist, then is saved with
``tf.train.Checkpoint(layer=..., optimizer=...)`` and restored into a fresh layer of the
same kind, ``--repeats`` times. Prints the checkpoint's bytes on disk (``.data`` +
``.index`` files), split into the tables' values, the row-wise accumulators and FIITED's
layout (chunk counts and utility), its ratio to the dense checkpoint measured in the same
run, and the save and restore times as median [p25, p75] (min, max) ms. Writes them to
``benchmarks/results/fiited_checkpoint/table.txt`` (``--quick``: small tables, into a
scratch folder).

Usage: .venv/bin/python benchmarks/fiited_checkpoint.py [--quick] [--tables 4 --rows 250000 --dim 64]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile
import time

import _results  # beside this script; puts the checkout first on sys.path
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfhybrid  # noqa: E402
from benchmarks._stats import SPREAD_LEGEND, summarize  # noqa: E402
from tfhybrid import mesh as mesh_lib  # noqa: E402
from tfhybrid.layers import Embedding  # noqa: E402
from tfhybrid.optimizers import RowWiseAdagrad  # noqa: E402
from tfhybrid.testing import provenance  # noqa: E402


def build(args, target: float | None):
    """A trained one-process layer and its optimizer; ``target`` None: dense tables."""
    mesh_lib.reset()
    tfhybrid.init(model_parallel=1)
    adaptive = {} if target is None else dict(dims="adaptive", chunks=args.chunks,
                                              target_memory=target)
    layer = tfhybrid.DistributedEmbedding(
        [Embedding(args.rows, args.dim, combiner="sum", name=f"t{i}", **adaptive)
         for i in range(args.tables)])
    optimizer = tfhybrid.DistributedOptimizer(RowWiseAdagrad(0.05))
    rng = np.random.default_rng(0)
    ids = [tf.constant(rng.integers(0, args.rows, (1024, 4))) for _ in range(args.tables)]
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(x) for x in layer(ids)])
    grads = tape.gradient(loss, layer.trainable_variables)
    optimizer.apply_gradients(zip(grads, layer.trainable_variables))
    if target is not None:
        for _, store in layer.stores.items():
            widths = store.widths
            widths.utility.assign(rng.random(widths.utility.shape[0]).astype(np.float32))
        layer.adjust(target)
    return layer, optimizer


def key_bytes(path: str) -> dict[str, int]:
    """Bytes of the checkpoint's table tensors by kind (from their shapes and dtypes)."""
    reader = tf.train.load_checkpoint(path)
    dtypes = reader.get_variable_to_dtype_map()
    kinds = {"values": 0, "accumulator": 0, "layout": 0}
    for key, shape in tf.train.list_variables(path):
        match = re.search(r"/\.ATTRIBUTES/table_\d+(_\w+)?$", key)
        if match is None:
            continue
        suffix = match.group(1) or ""
        kind = ("values" if not suffix else "accumulator" if "accumulator" in suffix
                else "layout")
        kinds[kind] += int(np.prod(shape)) * dtypes[key].size
    return kinds


def measure(args, target: float | None) -> dict:
    layer, optimizer = build(args, target)
    saves, restores, disk = [], [], None
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            prefix = os.path.join(folder, f"ckpt{repeat}")
            start = time.perf_counter()
            path = tf.train.Checkpoint(layer=layer, optimizer=optimizer).write(prefix)
            saves.append(time.perf_counter() - start)
            disk = sum(os.path.getsize(f) for f in glob.glob(prefix + ".*"))
            kinds = key_bytes(path)
            fresh, fresh_optimizer = build(args, None if target is None else 1.0)
            start = time.perf_counter()
            tf.train.Checkpoint(layer=fresh, optimizer=fresh_optimizer).read(
                path).assert_existing_objects_matched()
            restores.append(time.perf_counter() - start)
            if repeat == 0:   # the restore is exact
                for got, want in zip(fresh.get_weights(), layer.get_weights()):
                    np.testing.assert_array_equal(got, want)
            del fresh, fresh_optimizer
    return dict(disk=disk, kinds=kinds, save=summarize(saves), restore=summarize(restores))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--targets", default="1.0,0.35,0.1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="20,000 rows and 1 repeat, written to a scratch folder")
    parser.add_argument("--out", help="folder of table.txt (default: "
                                      "benchmarks/results/fiited_checkpoint)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats = 20_000, 1
    out = _results.out_dir("fiited_checkpoint", args.quick, args.out)
    load = provenance.OtherLoad()
    tf.config.threading.set_intra_op_parallelism_threads(2)
    rows = [("dense", None)] + [(f"FIITED, {100 * (1 - float(t)):.0f}% pruned", float(t))
                                for t in args.targets.split(",")]
    results = [(name, measure(args, target)) for name, target in rows]
    dense = results[0][1]["disk"]
    lines = [f"{args.tables} tables x {args.rows} x {args.dim}, {args.chunks} chunks, "
             f"RowWiseAdagrad, one process; {args.repeats} repeats; MB; times {SPREAD_LEGEND}",
             f"{'checkpoint':<24}{'on disk':>9}{'x dense':>9}{'values':>9}{'accum':>9}"
             f"{'layout':>9}   save ms / restore ms"]
    for name, r in results:
        mb = {k: v / 2**20 for k, v in r["kinds"].items()}
        lines.append(f"{name:<24}{r['disk'] / 2**20:>9.1f}{r['disk'] / dense:>9.3f}"
                     f"{mb['values']:>9.1f}{mb['accumulator']:>9.1f}{mb['layout']:>9.1f}   "
                     f"{r['save'].format(1e3, 0)} / {r['restore'].format(1e3, 0)}")
    _results.write_text(os.path.join(out, "table.txt"), lines, load)


if __name__ == "__main__":
    main()
