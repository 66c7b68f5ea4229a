"""Sharded tables in the disk tier on a mesh: the app with --dram_budget against the same
run in memory (issue 16, "Memory tiers" inside DistributedEmbedding).

Each configuration is one job of ``python -m tfhybrid.train`` (``horovodrun -np 4``,
``--model_parallel=2``: a 2x2 mesh on this machine), on the same synthetic data, seed and
flags; only ``--dram_budget`` differs. The in-memory run goes first in every round and
measures this rank's embedding bytes; the tiered runs get a budget of that times
``--shares`` (the planner then moves the largest tables to the disk tier, each with the
largest cache that fits). The configurations take turns for ``--repeats`` rounds, so
drift hits them alike. Printed per configuration: the app's samples/s (its own timing,
after its warm-up), median (min-max) over the rounds, the ratio of medians to in
memory, rank 0's embedding DRAM and files, the tables in the tier and their cache share,
and the tier's hit rate (distinct ids of a step found cached). The final train loss of
each round is checked equal across the configurations: the tier must not change it.

Usage: .venv/bin/python benchmarks/tiered_mesh.py [--repeats 3] [--steps 60] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import _results  # beside this script
PYTHON = sys.executable
HOROVODRUN = os.path.join(os.path.dirname(PYTHON), "horovodrun")


def _flags(args) -> list[str]:
    return ["--model=dlrm", "--dataset=synthetic", f"--steps={args.steps}",
            f"--batch_size={args.batch}", "--eval_batches=1", f"--embedding_dim={args.dim}",
            f"--bottom_mlp_dims=64,{args.dim}", "--top_mlp_dims=64,32,1",
            f"--max_table_rows={args.rows}", f"--cardinality_scale={args.scale}",
            "--optimizer=sgd",
            "--embedding_optimizer=rowwise_adagrad", f"--warmup_steps={args.warmup}",
            "--model_parallel=2", f"--seed={args.seed}"]


def _run(args, work: str, label: str, extra: list[str]) -> dict:
    out = os.path.join(work, f"{label}.json")
    command = [HOROVODRUN, "-np", "4", "-H", "localhost:4", "--gloo", PYTHON, "-m",
               "tfhybrid.train"] + _flags(args) + extra + [f"--metrics_json={out}"]
    done = subprocess.run(command, env=_results.child_env(), cwd=_results.ROOT,
                          capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4096, help="global batch")
    parser.add_argument("--rows", type=int, default=500_000, help="--max_table_rows")
    parser.add_argument("--scale", type=float, default=0.01,
                        help="--cardinality_scale (of Criteo-1TB's tables)")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--shares", default="0.5,0.25",
                        help="budgets as shares of the in-memory run's embedding DRAM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--quick", action="store_true", help="1 round of 20 steps")
    parser.add_argument("--out", help="results folder (default: benchmarks/results/"
                        "tiered_mesh; with --quick a temporary folder, so a check never "
                        "overwrites the published results)")
    args = parser.parse_args()
    args.out = _results.out_dir("tiered_mesh", args.quick, args.out)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 20, 5
    shares = [float(s) for s in args.shares.split(",")]
    labels = ["in memory"] + [f"budget {s:.0%} of it" for s in shares]
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    from tfhybrid.testing import provenance
    load = provenance.OtherLoad()   # the jobs are this process's children: their CPU is ours
    with tempfile.TemporaryDirectory(prefix="tfhybrid-tiered-mesh-") as work:
        for round_ in range(args.repeats):
            memory = _run(args, work, f"memory{round_}", [])
            runs[labels[0]].append(memory)
            dram = memory["embedding_memory"]["embedding"]
            for share, label in zip(shares, labels[1:]):
                store = os.path.join(work, f"store{round_}_{share}")
                run = _run(args, work, f"tier{round_}_{share}",
                           [f"--dram_budget={int(share * dram)}", f"--store_dir={store}"])
                run["budget"] = int(share * dram)
                if run["train_loss"] != memory["train_loss"]:
                    raise AssertionError(f"{label}: train loss {run['train_loss']} differs "
                                         f"from in memory {memory['train_loss']}")
                runs[label].append(run)
                print(f"round {round_ + 1}/{args.repeats} {label}: "
                      f"{run['samples_per_second']:,.0f} samples/s", flush=True)
            print(f"round {round_ + 1}/{args.repeats} in memory: "
                  f"{memory['samples_per_second']:,.0f} samples/s", flush=True)

    base = statistics.median(r["samples_per_second"] for r in runs[labels[0]])
    lines = [f"2x2 mesh (4 ranks, 2 cores), DLRM bottom 64-{args.dim} top 64-32-1, "
             f"Criteo-1TB's tables x {args.scale:g} (<= {args.rows:,} rows) x {args.dim}, global batch {args.batch}, "
             f"{args.steps} steps ({args.warmup} warm-up), {args.repeats} rounds; samples/s "
             "median (min-max); memory and tiers are rank 0's", "",
             f"{'configuration':>22} {'k samples/s':>22} {'x memory':>9} {'DRAM MB':>8} "
             f"{'files MB':>9} {'tables in tier (cache %)':>34} {'hit rate':>9}"]
    points = {}
    for label in labels:
        rates = [r["samples_per_second"] for r in runs[label]]
        last = runs[label][-1]
        plan = last["plan"]["tables"]
        tiered = [t for t in plan if t["cache_rows"]]
        shares_held = [t["cache_rows"] / max(s["row_end"] for s in t["shards"])
                       for t in tiered]
        where = (f"{len(tiered)} ({min(shares_held):.0%}-{max(shares_held):.0%})"
                 if tiered else "0")
        memory = last["embedding_memory"]
        hit = last.get("tier_hit_rate")
        median = statistics.median(rates)
        lines.append(f"{label:>22} {median / 1e3:>9.1f} ({min(rates) / 1e3:.1f}-"
                     f"{max(rates) / 1e3:.1f}) {median / base:>8.2f}x "
                     f"{memory['embedding'] / 1e6:>8.2f} {memory['store'] / 1e6:>9.2f} "
                     f"{where:>34} {'' if hit is None else f'{hit:.1%}':>9}")
        points[label] = dict(samples_per_second=rates, ratio=median / base,
                             embedding_memory=memory, tier_hit_rate=hit,
                             budget=last.get("budget"), tables_in_tier=len(tiered))
    _results.write_text(os.path.join(args.out, "table.txt"), lines, load)
    _results.write_json(os.path.join(args.out, "points.json"), {"points": points}, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
