"""Embedding memory saved vs held-out AUC: FIITED against the two simple ways to save the
same bytes (issue 15).

One process trains a DLRM (bottom MLP, dot interaction, top MLP; Adam on the dense
layers, row-wise AdaGrad on the tables) whose tables are :class:`tfhybrid.fiited.ChunkedTable`
s, in one training loop that every arm shares (same initial values, same samples, same
optimizers):

* ``dense``: no table is ever resized (a ChunkedTable then equals a dense table bit for bit,
  tests/test_fiited.py), the baseline measured in the same run;
* ``fiited``: every ``--adjust_every`` steps each table is re-divided by utility
  (:meth:`ChunkedTable.adjust`), its budget going linearly from the whole table to
  ``target`` over the first half of training;
* ``uniform``: every row one smaller width from the first step, chosen so the table (plus
  its AdaGrad accumulator) takes FIITED's final bytes of that table;
* ``frequency``: the most frequently looked-up rows (counted over the training samples
  before training, like a vocabulary threshold) keep their full width, the others are
  dropped (read as zeros), as many as FIITED's bytes pay for (plus a 4-byte row map).

Bytes counted per table: FIITED's pool of present chunks + 4-byte row offsets + per-row
accumulator and utility; uniform: rows x (width + 1) x 4; frequency: kept rows x (dim + 1)
x 4 + rows x 4; dense: rows x (dim + 1) x 4. Memory saved = 1 - bytes / dense bytes.

Prints the table (AUC difference to the same seed's dense model: mean and min-max over the
seeds), writes results.json, table.txt and fiited_quality.png into --out.

Usage: .venv/bin/python benchmarks/fiited_quality.py [--seeds 3] [--targets 0.25 0.125]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _results  # beside this script; it puts the checkout first on sys.path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfhybrid.fiited import ChunkedTable  # noqa: E402
from tfhybrid.train import data, models  # noqa: E402

EMBEDDING_DIM = 32
BOTTOM = (64, EMBEDDING_DIM)
TOP = (64, 32, 1)
DENSE_LR, TABLE_LR = 0.003, 0.05
DATASETS = {
    # name: (batch, train steps, dataset options)
    "synthetic": (1024, 600, {"max_table_rows": 20000}),
    "movielens": (256, 1250, {}),          # 4 epochs of the 80k training ratings
}


def _initial(rows: int, seed: int, table: int) -> np.ndarray:
    rng = np.random.default_rng([seed, table])
    return rng.uniform(-0.05, 0.05, size=(rows, EMBEDDING_DIM)).astype(np.float32)


class _Model(tf.Module):
    """DLRM around a list of ChunkedTables, trained by its own step."""

    def __init__(self, tables: list[ChunkedTable], dense_features: int, seed: int):
        super().__init__()
        self.tables = tables
        self.bottom = models.mlp(BOTTOM, "bottom_mlp", last_linear=False, seed=seed)
        self.interaction = models.DotInteraction(name="interaction")
        self.top = models.mlp(TOP, "top_mlp", last_linear=True, seed=seed)
        self.bottom.build([None, dense_features])
        self.top.build([None, EMBEDDING_DIM + (len(tables) + 1) * len(tables) // 2])
        self.dense_vars = self.bottom.trainable_variables + self.top.trainable_variables
        self.optimizer = tf.keras.optimizers.Adam(DENSE_LR)

    def logits(self, dense, rows):
        return self.top(self.interaction([self.bottom(dense)] + rows))

    def lookups(self, categorical):
        return [t.lookup(categorical[:, i]) for i, t in enumerate(self.tables)]

    @tf.function
    def train_step(self, features, labels):
        categorical = features["categorical"]
        rows = self.lookups(categorical)
        with tf.GradientTape() as tape:
            tape.watch(rows)
            loss = tf.reduce_mean(tf.keras.losses.binary_crossentropy(
                labels, self.logits(features["dense"], rows), from_logits=True))
        grads = tape.gradient(loss, self.dense_vars + rows)
        n = len(self.dense_vars)
        self.optimizer.apply_gradients(zip(grads[:n], self.dense_vars))
        for i, table in enumerate(self.tables):
            table.apply(categorical[:, i], grads[n + i], TABLE_LR)
        return loss

    @tf.function
    def predict(self, features):
        return tf.sigmoid(self.logits(features["dense"], self.lookups(features["categorical"])))


def _frequencies(name: str, spec, batch: int, steps: int, seed: int, options: dict):
    counts = [np.zeros(r, np.int64) for r in spec.table_rows]
    for features, _ in data.make_dataset(name, "train", global_batch_size=batch, seed=seed,
                                         num_batches=steps, **options):
        cat = features["categorical"].numpy()
        for t, c in enumerate(counts):
            c += np.bincount(cat[:, t], minlength=len(c))
    return counts


def _auc(model: _Model, name: str, batch: int, seed: int, options: dict) -> float:
    auc = tf.keras.metrics.AUC(num_thresholds=2000)
    for features, labels in data.make_dataset(name, "eval", global_batch_size=batch,
                                              seed=seed, **options):
        auc.update_state(labels, model.predict(features))
    return float(auc.result())


def run_arm(name: str, arm: str, seed: int, target: float | None, matched: list | None,
            args) -> dict:
    batch, steps, options = DATASETS[name]
    steps = args.steps or steps
    spec = data.dataset_spec(name, seed=seed, **options)
    rows = spec.table_rows
    chunks = {"dense": args.chunks, "fiited": args.chunks, "uniform": EMBEDDING_DIM,
              "frequency": 1}[arm]
    tables = [ChunkedTable(r, EMBEDDING_DIM, chunks, initial_value=_initial(r, seed, t),
                           min_chunks=args.min_chunks if arm == "fiited" else 0,
                           utility_decay=args.utility_decay,
                           position_power=args.position_power, name=f"table_{t}")
              for t, r in enumerate(rows)]
    table_bytes = [r * (EMBEDDING_DIM + 1) * 4 for r in rows]
    if arm == "uniform":
        widths = [max(0, b // (4 * r) - 1) for b, r in zip(matched, rows)]
        for t, w in zip(tables, widths):
            t.resize(np.full(t.rows, min(w, EMBEDDING_DIM), np.int64))
        table_bytes = [r * (min(w, EMBEDDING_DIM) + 1) * 4 for r, w in zip(rows, widths)]
    elif arm == "frequency":
        freq = _frequencies(name, spec, batch, steps, seed, options)
        table_bytes = []
        for t, f, b in zip(tables, freq, matched):
            kept = int(np.clip((b - 4 * t.rows) // ((EMBEDDING_DIM + 1) * 4), 0, t.rows))
            keep = np.zeros(t.rows, np.int64)
            keep[np.argsort(-f, kind="stable")[:kept]] = 1
            t.resize(keep)
            table_bytes.append(kept * (EMBEDDING_DIM + 1) * 4 + 4 * t.rows)
    model = _Model(tables, spec.dense_features, seed)
    train = data.make_dataset(name, "train", global_batch_size=batch, seed=seed,
                              num_batches=steps, **options)
    start = time.perf_counter()
    for step, (features, labels) in enumerate(train, 1):
        model.train_step(features, labels)
        if arm == "fiited" and step % args.adjust_every == 0:
            ramp = min(1.0, step / (steps / 2))
            for t in tables:
                t.adjust(1.0 - (1.0 - target) * ramp)
    seconds = time.perf_counter() - start
    if arm == "fiited":
        table_bytes = [t.memory_bytes()["total"] for t in tables]
    dense_bytes = sum(r * (EMBEDDING_DIM + 1) * 4 for r in rows)
    result = {"dataset": name, "arm": arm, "seed": seed, "target": target,
              "auc": _auc(model, name, batch, seed, options), "bytes": sum(table_bytes),
              "table_bytes": table_bytes, "dense_bytes": dense_bytes,
              "saved": 1.0 - sum(table_bytes) / dense_bytes, "steps": steps,
              "train_seconds": seconds}
    print(f"  {name:9} seed {seed} {arm:9} target {target!s:6} AUC {result['auc']:.4f} "
          f"saved {result['saved']:6.1%} ({seconds:.0f} s)", flush=True)
    return result


def _table(results: list[dict]) -> str:
    lines = [f"{'dataset':9} {'method':9} {'target':>6} {'memory saved':>14} "
             f"{'AUC':>7} {'AUC - dense: mean (min, max)':>30}  seeds",
             "-" * 90]
    base = {(r["dataset"], r["seed"]): r["auc"] for r in results if r["arm"] == "dense"}
    groups: dict = {}
    for r in results:
        groups.setdefault((r["dataset"], r["arm"], r["target"]), []).append(r)
    for (name, arm, target), rs in groups.items():
        diffs = [r["auc"] - base[(name, r["seed"])] for r in rs]
        saved = [r["saved"] for r in rs]
        lines.append(f"{name:9} {arm:9} {target!s:>6} {np.mean(saved):13.1%} "
                     f"{np.mean([r['auc'] for r in rs]):7.4f} "
                     f"{np.mean(diffs):+10.4f} ({min(diffs):+.4f}, {max(diffs):+.4f})"
                     f"      {len(rs)}")
    return "\n".join(lines)


def _plot(results: list[dict], path: str, load) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = sorted({r["dataset"] for r in results})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        base = {r["seed"]: r["auc"] for r in results if r["dataset"] == name
                and r["arm"] == "dense"}
        for arm, marker in (("fiited", "o"), ("uniform", "s"), ("frequency", "^")):
            pts: dict = {}
            for r in results:
                if r["dataset"] == name and r["arm"] == arm:
                    pts.setdefault(r["target"], []).append(
                        (r["saved"], r["auc"] - base[r["seed"]]))
            xs = sorted(pts)
            ax.errorbar([100 * np.mean([p[0] for p in pts[x]]) for x in xs],
                        [np.mean([p[1] for p in pts[x]]) for x in xs],
                        yerr=[[np.mean([p[1] for p in pts[x]]) - min(p[1] for p in pts[x])
                               for x in xs],
                              [max(p[1] for p in pts[x]) - np.mean([p[1] for p in pts[x]])
                               for x in xs]],
                        marker=marker, capsize=3, label=arm)
        ax.axhline(0, color="black", lw=1)
        ax.axhline(-0.001, color="grey", lw=1, ls="--", label="-0.001")
        ax.axvline(65, color="grey", lw=1, ls=":", label="65% saved")
        ax.set(title=name, xlabel="embedding memory saved (%)",
               ylabel="held-out AUC - dense model's (same seed)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    _results.save_figure(fig, path, load)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.25, 0.1875, 0.125],
                        help="FIITED's final share of each table's chunks")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--adjust_every", type=int, default=50)
    parser.add_argument("--utility_decay", type=float, default=0.99)
    parser.add_argument("--chunks", type=int, default=8, help="FIITED: chunks per row")
    parser.add_argument("--min_chunks", type=int, default=1,
                        help="FIITED: chunks every row keeps")
    parser.add_argument("--position_power", type=float, default=3.0,
                        help="FIITED: chunk j of a row scores utility / (j + 1) ** this")
    parser.add_argument("--arms", nargs="*", default=["uniform", "frequency"],
                        help="the same-bytes baselines to run beside dense and FIITED")
    parser.add_argument("--steps", type=int, default=0, help="override the training steps")
    parser.add_argument("--out", default=os.path.join(_results.RESULTS, "fiited_quality"))
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(2)
    from tfhybrid.testing import provenance
    load = provenance.OtherLoad()
    results = []
    for name in args.datasets:
        for seed in range(args.seeds):
            results.append(run_arm(name, "dense", seed, None, None, args))
            for target in args.targets:
                fiited = run_arm(name, "fiited", seed, target, None, args)
                results.append(fiited)
                for arm in args.arms:
                    results.append(run_arm(name, arm, seed, target, fiited["table_bytes"],
                                           args))
    table = _table(results)
    print("\n" + table)
    _results.write_json(os.path.join(args.out, "results.json"),
                        {"settings": vars(args), "embedding_dim": EMBEDDING_DIM,
                         "results": results}, load)
    _results.write_text(os.path.join(args.out, "table.txt"), table.splitlines(), load)
    _plot(results, os.path.join(args.out, "fiited_quality.png"), load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
