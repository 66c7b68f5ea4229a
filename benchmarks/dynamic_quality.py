"""Held-out AUC of dynamic tables at half the keys against unbounded ones (issue 62).

Each point is one real job of the training app in one process, ``python -m
tfhybrid.train --dataset=synthetic_open --dynamic_tables=...``: DLRM on the open-world
stream, whose keys keep arriving and going cold. For each seed it trains twice from the
same start on the same samples:

- **unbounded**: every dynamic table's capacity is the number of distinct keys it sees
  in training (counted here from the stream, ``data.open_distinct_keys``: the training
  batches plus the one the app's pipeline reads ahead), so nothing is evicted; the
  script checks that the run admitted exactly that many keys and evicted none;
- **half**: each table's capacity is half its distinct keys (rounded up), ``evict=lfu``.

Both admit a key at its first sighting. Two sets of dynamic features:

- ``all``: every one of the 26 categorical features is a dynamic table;
- ``drifting``: the 8 features whose keys turn over (at least
  ``data.OPEN_STABLE_BELOW`` slots), the 18 small attribute-like ones in fixed tables
  (keys hashed into their rows, as without dynamic tables), the same in both arms.

The goal, stated here and checked against the measurement (not assumed): the mean over
the seeds of AUC(half) - AUC(unbounded) within +-0.002. The table prints each seed's
pair and the mean difference per set, with whether the goal was met.

Writes results.json and table.txt into --out.

Usage: .venv/bin/python benchmarks/dynamic_quality.py [--seeds 3] [--steps 1000]
       [--sets all,drifting] [--out DIR] [--quick]
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
GOAL = 0.002   # |mean AUC(half) - AUC(unbounded)| at most this
# the model both arms share: the Makefile's pair of optimizers, make run's DLRM widths
COMMON = ["--model=dlrm", "--dataset=synthetic_open", "--batch_size=1024",
          "--embedding_dim=16", "--bottom_mlp_dims=64,16", "--top_mlp_dims=64,32,1",
          "--embedding_optimizer=rowwise_adagrad", "--embedding_learning_rate=0.05",
          "--dense_optimizer=adam", "--dense_learning_rate=0.003", "--warmup_steps=5",
          "--max_table_rows=100000"]
MAX_TABLE_ROWS = 100_000   # as in COMMON: the stream's slots per table
SETS = ("all", "drifting")


def dynamic_features(which: str) -> list[int]:
    """The categorical columns made dynamic tables in set ``which``."""
    from tfhybrid.train import data
    rows = data.scaled_cardinalities(1e-3, MAX_TABLE_ROWS)
    if which == "all":
        return list(range(len(rows)))
    return [t for t, r in enumerate(rows) if r >= data.OPEN_STABLE_BELOW]


def train(seed: int, features: list[int], capacities: list[int], args) -> dict:
    """One job's metrics."""
    with tempfile.TemporaryDirectory(prefix="tfhybrid-dynq-") as tmp:
        metrics = os.path.join(tmp, "metrics.json")
        command = [PYTHON, "-m", "tfhybrid.train", *COMMON, f"--steps={args.steps}",
                   f"--seed={seed}", f"--metrics_json={metrics}",
                   f"--dynamic_tables={','.join(str(t) for t in features)}",
                   f"--dynamic_capacity={','.join(str(c) for c in capacities)}",
                   "--dynamic_evict=lfu"]
        done = subprocess.run(command, env=_results.child_env(), cwd=_results.ROOT,
                              capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0 or not os.path.exists(metrics):
            raise RuntimeError(f"seed {seed} capacities {capacities} failed "
                               f"({done.returncode}):\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")
        with open(metrics) as f:
            return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000, help="training steps of 1024")
    parser.add_argument("--sets", default=",".join(SETS),
                        help="comma-separated sets of dynamic features (all, drifting)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("--quick", action="store_true",
                        help="one seed, the drifting set, 40 steps")
    parser.add_argument("--out", help="results folder (default: benchmarks/results/"
                        "dynamic_quality; with --quick a temporary folder, so a check never "
                        "overwrites the published results)")
    args = parser.parse_args()
    args.out = _results.out_dir("dynamic_quality", args.quick, args.out)
    sets = args.sets.split(",")
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        parser.error(f"--sets: {unknown} unknown; expected some of {', '.join(SETS)}")
    if args.quick:
        args.seeds, args.steps, sets = 1, 40, ["drifting"]
    os.makedirs(args.out, exist_ok=True)

    import numpy as np
    from tfhybrid.testing import provenance   # after _results put this checkout first
    from tfhybrid.train import data
    load = provenance.OtherLoad()   # the jobs are this process's children: their CPU is ours
    # the keys the tables see: the training batches and the one the pipeline reads ahead
    samples = (args.steps + 1) * 1024
    print(f"DLRM on synthetic_open, {args.steps} steps of 1024, one process; dynamic "
          f"tables at half their distinct keys (lfu) vs unbounded; seeds 0..{args.seeds - 1}; "
          f"sets {sets}", flush=True)
    runs: list[dict] = []
    lines = [f"goal: |mean AUC(half) - AUC(unbounded)| <= {GOAL} over the seeds",
             f"{args.steps} steps of 1024 samples (key lifetime {data.OPEN_KEY_LIFETIME} "
             f"samples), eval on the {data.SYNTHETIC_EVAL_SAMPLES} samples that follow"]
    for which in sets:
        features = dynamic_features(which)
        differences = []
        for seed in range(args.seeds):
            distinct = data.open_distinct_keys(samples, max_table_rows=MAX_TABLE_ROWS,
                                               seed=seed)
            keys = [distinct[t] for t in features]
            pair = {}
            for arm, capacities in (("unbounded", keys),
                                    ("half", [(k + 1) // 2 for k in keys])):
                started = time.time()
                metrics = train(seed, features, capacities, args)
                totals = metrics["dynamic_tables"]["totals"]
                if arm == "unbounded" and (totals["admissions"] != sum(keys)
                                           or totals["evictions"] or totals["refusals"]):
                    raise RuntimeError(f"seed {seed}: the unbounded arm admitted "
                                       f"{totals['admissions']} keys (counted {sum(keys)}), "
                                       f"evicted {totals['evictions']}, refused "
                                       f"{totals['refusals']}: the counted keys are wrong")
                seconds = time.time() - started
                runs.append(dict(set=which, seed=seed, arm=arm, auc=metrics["auc"],
                                 logloss=metrics["logloss"], best_auc=metrics["best_auc"],
                                 capacity=sum(capacities), distinct_keys=sum(keys),
                                 features=len(features), totals=totals,
                                 tables=metrics["dynamic_tables"]["tables"],
                                 seconds=seconds))
                pair[arm] = metrics["auc"]
                print(f"  {which:8} seed {seed} {arm:9}: AUC {metrics['auc']:.4f} "
                      f"(teacher {metrics['best_auc']:.4f}), {sum(capacities):,} rows for "
                      f"{sum(keys):,} keys, {totals['evictions']:,} evictions, "
                      f"{totals['refusals']:,} refusals, hit rate {totals['hit_rate']:.4f}, "
                      f"{seconds:.0f} s", flush=True)
            differences.append(pair["half"] - pair["unbounded"])
            line = (f"{which:8} seed {seed}: unbounded AUC {pair['unbounded']:.4f}, half AUC "
                    f"{pair['half']:.4f}, half - unbounded {differences[-1]:+.4f}")
            lines.append(line)
        mean = float(np.mean(differences))
        line = (f"{which:8} ({len(features)} dynamic tables) mean AUC(half) - AUC(unbounded) "
                f"{mean:+.4f} over {len(differences)} seeds [min {min(differences):+.4f}, "
                f"max {max(differences):+.4f}]: goal |mean| <= {GOAL} "
                f"{'met' if abs(mean) <= GOAL else 'MISSED'}")
        lines.append(line)
        print(line, flush=True)
    seconds = summarize([r["seconds"] for r in runs])
    lines.append(f"job wall time (s): {seconds.format(digits=0)}")
    _results.write_json(os.path.join(args.out, "results.json"),
                        dict(goal=GOAL, steps=args.steps, common=COMMON, runs=runs), load)
    _results.write_text(os.path.join(args.out, "table.txt"), lines, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
