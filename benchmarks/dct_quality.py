"""Held-out AUC with DCT against uncompressed training at the same steps (issue 14).

Each point is one real job of the training app, ``horovodrun -np 2 ... python -m
tfhybrid.train --model_parallel=2``: a 1D mesh of two ranks, so both halves of DCT act
(the dense layers' gradients are synced over both ranks, the tables' rows cross the
alltoall). For each model (DLRM, DCN-v2) and dataset (synthetic planted-signal clicks,
MovieLens-100k) and each seed it trains twice from the same start on the same samples,
without DCT (the baseline, in the same run) and with it, and prints the held-out AUC of
both and their paired difference (mean and spread over the seeds).

The keep-fraction curves sweep one half at a time (the other off) on one seed and plot
the AUC difference to the same seed's baseline: where quality starts to drop.

Writes results.json, table.txt and keep_curve.png into --out.

Usage: .venv/bin/python benchmarks/dct_quality.py [--seeds 3] [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _results  # beside this script; it puts the checkout first on sys.path

from benchmarks._stats import summarize  # noqa: E402

PYTHON = sys.executable
HOROVODRUN = os.path.join(os.path.dirname(PYTHON), "horovodrun")
# the jobs' variables besides _results.child_env's
EXTRA_ENV = dict(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
                 HOROVOD_STALL_CHECK_TIME_SECONDS="30", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="120")
# the training both arms share: the Makefile's pair of optimizers
COMMON = ["--embedding_optimizer=rowwise_adagrad", "--embedding_learning_rate=0.05",
          "--dense_optimizer=adam", "--dense_learning_rate=0.003", "--embedding_dim=16",
          "--bottom_mlp_dims=64,16", "--top_mlp_dims=64,32,1", "--warmup_steps=0",
          "--threads=1"]
DATASETS = {
    "synthetic": ["--dataset=synthetic", "--batch_size=1024", "--eval_batches=16",
                  "--max_table_rows=20000"],
    # one pass over the 80k training ratings per epoch
    "movielens": ["--dataset=movielens", "--batch_size=256"],
}
MODELS = ("dlrm", "dcnv2")
CURVE_DP = (0.001, 0.003, 0.01, 0.03, 0.1)
CURVE_MP = (0.02, 0.05, 0.1, 0.25, 0.5)


def keep_fraction(text: str) -> float | None:
    """A keep-fraction flag's value: a float, or None for "off" (that half not used)."""
    return None if text == "off" else float(text)


def train(model: str, dataset: str, seed: int, dct: dict | None, args) -> dict:
    """One job's metrics (rank 0's JSON)."""
    length = ([f"--steps={args.steps}"] if dataset == "synthetic"
              else [f"--epochs={args.epochs}"])
    dct_flags = [] if dct is None else [f"--dct_{k}={v}" for k, v in dct.items()
                                        if v is not None]
    with tempfile.TemporaryDirectory(prefix="tfhybrid-dct-") as tmp:
        metrics = os.path.join(tmp, "metrics.json")
        command = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo",
                   "--start-timeout", "60", PYTHON, "-m", "tfhybrid.train",
                   f"--model={model}", "--model_parallel=2", f"--seed={seed}",
                   f"--metrics_json={metrics}", *COMMON, *DATASETS[dataset], *length,
                   *dct_flags]
        done = subprocess.run(command, env=_results.child_env(**EXTRA_ENV), cwd=_results.ROOT,
                              capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0 or not os.path.exists(metrics):
            raise RuntimeError(f"{model}/{dataset}/seed {seed}/dct {dct} failed "
                               f"({done.returncode}):\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")
        with open(metrics) as f:
            return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="synthetic: training steps")
    parser.add_argument("--epochs", type=int, default=2, help="movielens: epochs")
    parser.add_argument("--dp_keep", type=keep_fraction, default=0.003, help="a fraction, or off")
    parser.add_argument("--mp_keep", type=keep_fraction, default=0.02, help="a fraction, or off")
    parser.add_argument("--refresh_every", type=int, default=100,
                        help="steps between threshold refreshes (DCT's L; runs here are "
                             "hundreds of steps long, the paper's millions)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--no_curve", action="store_true")
    parser.add_argument("--curve_datasets", default="synthetic",
                        help="datasets of the keep-fraction curves (comma-separated)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("--quick", action="store_true",
                        help="one seed, DLRM on synthetic, 60 steps, no curve")
    parser.add_argument("--out", help="results folder (default: benchmarks/results/"
                        "dct_quality; with --quick a temporary folder, so a check never "
                        "overwrites the published results)")
    args = parser.parse_args()
    args.out = _results.out_dir("dct_quality", args.quick, args.out)
    models, datasets = args.models.split(","), args.datasets.split(",")
    if args.quick:
        args.seeds, args.steps, args.no_curve = 1, 60, True
        models, datasets = ["dlrm"], ["synthetic"]
    os.makedirs(args.out, exist_ok=True)
    if "movielens" in datasets:
        # fetched once here, not by two ranks at once
        subprocess.run([PYTHON, "-m", "tfhybrid.train.data", "--fetch", "movielens"],
                       env=_results.child_env(**EXTRA_ENV), cwd=_results.ROOT, check=True,
                       timeout=600)
    dct = dict(dp_keep=args.dp_keep, mp_keep=args.mp_keep,
               refresh_every=args.refresh_every)
    print(f"DCT {dct} vs uncompressed; 2 ranks (1D mesh, M=2); synthetic {args.steps} "
          f"steps, movielens {args.epochs} epochs; seeds 0..{args.seeds - 1}", flush=True)

    from tfhybrid.testing import provenance   # after _results put this checkout first
    load = provenance.OtherLoad()   # the jobs are this process's children: their CPU is ours
    runs: list[dict] = []

    def record(model, dataset, seed, arm, settings):
        started = time.time()
        metrics = train(model, dataset, seed, settings, args)
        runs.append(dict(model=model, dataset=dataset, seed=seed, arm=arm, dct=settings,
                         auc=metrics["auc"], logloss=metrics["logloss"],
                         steps=metrics["steps"], seconds=time.time() - started))
        print(f"  {model:6} {dataset:10} seed {seed} {arm:>12}: AUC {metrics['auc']:.4f} "
              f"({metrics['steps']} steps, {time.time() - started:.0f} s)", flush=True)
        return metrics["auc"]

    lines = []
    for model in models:
        for dataset in datasets:
            base, with_dct = [], []
            for seed in range(args.seeds):
                base.append(record(model, dataset, seed, "baseline", None))
                with_dct.append(record(model, dataset, seed, "dct", dct))
            diffs = [b - a for a, b in zip(base, with_dct)]
            import numpy as np
            line = (f"{model:6} {dataset:10} baseline AUC {np.mean(base):.4f} "
                    f"(min {min(base):.4f}, max {max(base):.4f})  DCT {np.mean(with_dct):.4f} "
                    f"(min {min(with_dct):.4f}, max {max(with_dct):.4f})  "
                    f"DCT - baseline mean {np.mean(diffs):+.4f} per seed "
                    f"[{', '.join(f'{d:+.4f}' for d in diffs)}]")
            lines.append(line)
            print(line, flush=True)

    curves: dict[str, list] = {}
    if not args.no_curve:
        # one seed, DLRM: each half alone over its keep fractions
        for dataset in [d for d in args.curve_datasets.split(",") if d in datasets]:
            base = next(r["auc"] for r in runs if r["model"] == "dlrm"
                        and r["dataset"] == dataset and r["seed"] == 0
                        and r["arm"] == "baseline")
            for half, fractions in (("dp_keep", CURVE_DP), ("mp_keep", CURVE_MP)):
                points = []
                for keep in fractions:
                    settings = dict(dp_keep=None, mp_keep=None,
                                    refresh_every=args.refresh_every)
                    settings[half] = keep
                    auc = record("dlrm", dataset, 0, f"{half}={keep:g}", settings)
                    points.append((keep, auc - base))
                curves[f"{dataset} {half}"] = points
                line = (f"dlrm   {dataset:10} {half} curve (AUC - baseline, seed 0): "
                        + ", ".join(f"{k:g}: {d:+.4f}" for k, d in points))
                lines.append(line)
                print(line, flush=True)
        plot(curves, os.path.join(args.out, "keep_curve.png"), load)

    seconds = summarize([r["seconds"] for r in runs])
    lines.append(f"job wall time (s): {seconds.format(digits=0)}")
    _results.write_json(os.path.join(args.out, "results.json"),
                        dict(dct=dct, steps=args.steps, epochs=args.epochs, runs=runs,
                             curves=curves), load)
    _results.write_text(os.path.join(args.out, "table.txt"), [f"DCT {dct}"] + lines, load)
    return 0


def plot(curves: dict[str, list], path: str, load) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        ax.plot([k for k, _ in points], [d for _, d in points], marker="o", label=name)
    ax.axhline(-0.002, color="grey", linestyle="--", linewidth=1, label="-0.002 AUC")
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set(xscale="log", xlabel="keep fraction (the other half off)",
           ylabel="AUC(DCT) - AUC(uncompressed), seed 0",
           title="DCT: where quality starts to drop (DLRM, 2 ranks, measured)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _results.save_figure(fig, path, load)


if __name__ == "__main__":
    sys.exit(main())
