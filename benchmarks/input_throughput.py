"""Input samples/s per rank: the criteo_tsv reader against the criteo_binary reader, at 1, 2
and 4 ranks reading at once, plus preprocessing lines/s (issue 17).

``--lines`` Criteo-format lines in ``--files`` day files (random values, 8-digit hex ids,
some fields empty) are written, then converted by ``tfhybrid.train.preprocess`` (``--ids=hash``, so
both readers give identical batches: tests/test_criteo_binary.py). For each reader and
rank count N, N processes start together, each iterating its own rank's share of one
pass (``make_dataset(..., rank=r, size=N)``, global batch ``--batch``) and timing it
after its first batch; a rank's figure is its samples / seconds, the total is the sum
over ranks. Each configuration runs ``--repeats`` times; the table gives the median
[p25, p75] (min, max) of the per-rank figure and of the total, and the binary/TSV ratio
of the medians measured in this run. Writes ``results/input_throughput.{txt,json,png}``.

Usage: .venv/bin/python benchmarks/input_throughput.py [--lines 200000 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from benchmarks._stats import SPREAD_LEGEND, summarize  # noqa: E402

READERS = {"criteo_tsv": "tsv", "criteo_binary": "binary"}


def _write_tsv(path: str, lines: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    block = 10_000
    with open(path, "w") as f:
        for start in range(0, lines, block):
            n = min(block, lines - start)
            labels = rng.integers(0, 2, n)
            ints = rng.integers(-3, 5000, (n, 13)).astype(str)
            ints[rng.random((n, 13)) < 0.2] = ""
            hexes = np.char.zfill(np.char.mod("%x", rng.integers(0, 2**32, (n, 26))), 8)
            hexes[rng.random((n, 26)) < 0.15] = ""
            for i in range(n):
                f.write("\t".join([str(labels[i]), *ints[i], *hexes[i]]) + "\n")


def _rank(job) -> tuple[int, float]:
    name, folder, rank, size, batch, start_at = job
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from tfhybrid.train import data
    dataset = data.make_dataset(name, "train", global_batch_size=batch, rank=rank, size=size,
                                data_dir=folder, max_table_rows=100_000)
    while time.time() < start_at:   # every rank starts together
        time.sleep(0.001)
    iterator = iter(dataset)
    next(iterator)                   # the pipeline is up
    start, samples = time.perf_counter(), 0
    for features, _ in iterator:
        samples += int(features["dense"].shape[0])
    return samples, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=4, help="train day files")
    parser.add_argument("--batch", type=int, default=16384, help="global batch")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="preprocessing processes")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    from tfhybrid.train.preprocess import preprocess
    work = tempfile.mkdtemp(prefix="tfhybrid-input-")
    tsv, binary = os.path.join(work, "tsv"), os.path.join(work, "binary")
    # train in --files day files, so the preprocessing workers share them
    os.makedirs(os.path.join(tsv, "train"))
    os.makedirs(os.path.join(tsv, "eval"))
    for day in range(args.files):
        _write_tsv(os.path.join(tsv, "train", f"day_{day}"), args.lines // args.files,
                   seed=day)
    _write_tsv(os.path.join(tsv, "eval", f"day_{args.files}"), args.batch, seed=args.files)
    converted = preprocess(tsv, binary, workers=args.workers, log=lambda _: None)["train"]
    preprocess_rate = converted["lines"] / converted["seconds"]
    print(f"preprocessing: {converted['lines']:,} lines in {converted['seconds']:.2f} s = "
          f"{preprocess_rate:,.0f} lines/s ({args.workers} workers)\n")
    folders = {"criteo_tsv": tsv, "criteo_binary": binary}
    results = []
    context = multiprocessing.get_context("spawn")
    for size in args.ranks:
        for name in READERS:
            per_rank, totals = [], []
            for _ in range(args.repeats):
                with context.Pool(size) as pool:
                    start_at = time.time() + 8.0   # imports first, then the start line
                    timed = pool.map(_rank, [(name, folders[name], r, size, args.batch,
                                              start_at) for r in range(size)])
                rates = [samples / seconds for samples, seconds in timed]
                per_rank += rates
                totals.append(sum(rates))
            results.append({"reader": name, "ranks": size, "per_rank": per_rank,
                            "total": totals})
            print(f"  {READERS[name]:6s} x{size}: per rank "
                  f"{summarize(per_rank).format(1e-3, 1)} k samples/s", flush=True)
    lines = [f"{args.lines:,} train lines in {args.files} files, global batch {args.batch}; "
             f"preprocessing (worker start-up included) "
             f"{preprocess_rate:,.0f} lines/s with {args.workers} workers; {args.repeats} "
             f"repeats; k samples/s, {SPREAD_LEGEND}", "",
             f"{'reader':8s} {'ranks':>5s}  {'per rank':>40s}  {'total':>40s}  binary/tsv"]
    for row in results:
        other = next(r for r in results if r["ranks"] == row["ranks"]
                     and r["reader"] != row["reader"])
        ratio = (np.median(row["per_rank"]) / np.median(other["per_rank"])
                 if row["reader"] == "criteo_binary" else None)
        lines.append(f"{READERS[row['reader']]:8s} {row['ranks']:5d}  "
                     f"{summarize(row['per_rank']).format(1e-3, 1):>40s}  "
                     f"{summarize(row['total']).format(1e-3, 1):>40s}  "
                     + (f"{ratio:.1f}x" if ratio else ""))
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "input_throughput.txt"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "input_throughput.json"), "w") as f:
        json.dump({"settings": vars(args), "preprocess_lines_per_s": preprocess_rate,
                   "results": results}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, label in READERS.items():
        rows = [r for r in results if r["reader"] == name]
        ranks = [r["ranks"] for r in rows]
        axes[0].plot(ranks, [np.median(r["per_rank"]) for r in rows], "o-", label=label)
        axes[1].plot(ranks, [np.median(r["total"]) for r in rows], "o-", label=label)
    for ax, title in zip(axes, ("per rank", "total")):
        ax.set_xlabel("ranks reading at once")
        ax.set_ylabel("samples/s")
        ax.set_yscale("log")
        ax.set_xticks(args.ranks)
        ax.set_title(f"input samples/s, {title}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "input_throughput.png"), dpi=100)
    print(f"wrote {args.out}/input_throughput.txt, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
