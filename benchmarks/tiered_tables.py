"""Tables on disk behind a DRAM cache (tfhybrid.tiers) against the same tables in memory
(issue 16, "Memory tiers").

**Throughput.** One DLRM (``--tables`` tables of ``--rows`` x ``--dim``, one Zipf(1.05) id
per table per sample, the hot rows scattered over the table; bottom MLP over 13 dense
features, dot interaction, top MLP, by default of NVIDIA's TF2 DLRM's widths, smaller with
``--bottom_mlp`` / ``--top_mlp`` (where the tables' share of the step is larger); row-wise
AdaGrad for every variable; batch ``--batch``) trained three ways on the same batches
from the same initial weights: every table in memory (``tfhybrid.layers.Embedding``, the
fused C++ lookup and AdaGrad kernels), and every table in the tier with a cache of 25% and
of 10% of its rows (the same kernels on the cache). The configurations take turns,
``--repeats`` rounds of ``--steps`` timed steps each (after a warm-up that lasts until
every cache is full), so drift of the machine hits them alike; printed: samples/s median
[p25, p75] (min, max), the ratio to in-memory, and the cache hit rate (distinct ids per
batch found cached) over the timed steps. The first steps are checked equal: the tier
must not change the losses. The stores are files in ``--store_dir``; with RAM to spare
the kernel keeps their pages, so this measures the tier's own cost (index, loads,
write-backs), not a disk.

**Scale.** One table of ``--scale_rows`` x ``--dim`` whose rows and row-wise state are at
least 4x the cache and larger than the memory the process may hold: the training runs in a
process whose memory cgroup (v1 ``memory.limit_in_bytes``, or v2 ``memory.max``) is
``--scale_limit_mib``; the kernel then has to drop the store's file pages, and what the
process holds itself (anonymous memory) is the cache, the index and TF. The same table in
memory is run under the same limit to show that it does not fit (the kernel kills it).
Printed: table and limit sizes, steps, samples/s, the hit rate, peak RSS (VmHWM) and the
group's peak usage.

**FIITED in the tier** (``--adaptive 0.35``): the tables have FIITED's per-row widths
(``dims="adaptive"``) in memory (a chunk pool) and in the tier, pruned to that share of
their chunks after the warm-up; the DRAM column shows what each holds.

Usage: .venv/bin/python benchmarks/tiered_tables.py [--out benchmarks/results/tiered_tables.txt]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import _results  # beside this script; it puts the checkout first on sys.path
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from benchmarks import _tbe_workload as workload_lib  # noqa: E402
from benchmarks._cgroup import read_text, write_text  # noqa: E402
from benchmarks._stats import SPREAD_LEGEND, summarize  # noqa: E402

DENSE_FEATURES = 13
CACHE_SHARES = (None, 0.25, 0.10)     # None: the tables in memory
CHECK_STEPS = 3                       # steps whose losses must agree across configurations
MEMORY_V1 = "/sys/fs/cgroup/memory"
MEMORY_V2 = "/sys/fs/cgroup"
CHILD_LINE = "@tiered_tables "


def _label(share: float | None) -> str:
    return "in memory" if share is None else f"tier, {share:.0%} cached"


def _model(args, share: float | None, store_dir: str, rows: int, tables: int):
    import tensorflow as tf
    from tfhybrid.layers import Embedding
    from tfhybrid.train.models import DotInteraction, mlp

    tier = {} if share is None else dict(cache_rows=max(1, int(rows * share)),
                                         store_dir=store_dir)
    if args.adaptive is not None:   # FIITED: per-row widths, in memory and in the tier
        tier.update(dims="adaptive", chunks=args.chunks, target_memory=args.adaptive)
    embeddings = [Embedding(rows, args.dim, combiner="sum", name=f"table_{t}",
                            embeddings_initializer=tf.keras.initializers.RandomUniform(
                                -0.05, 0.05, seed=t + 1), **tier)
                  for t in range(tables)]
    bottom = mlp(args.bottom_mlp + [args.dim], "bottom_mlp", last_linear=False, seed=0)
    top = mlp(args.top_mlp + [1], "top_mlp", last_linear=True, seed=0)
    interaction = DotInteraction()

    def call(dense, ids):
        vectors = [bottom(dense)] + [e(ids[:, t:t + 1]) for t, e in enumerate(embeddings)]
        return top(interaction(vectors))
    return embeddings, call, (bottom, top)


def _train_step(call, optimizer, variables):
    import tensorflow as tf
    loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)

    # the variables are closed over, not arguments: a Keras 3 weight passed into a
    # tf.function is not the variable its optimizer indexes (Keras 3 fails to build)
    @tf.function
    def step(dense, ids, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, call(dense, ids))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    return step


def _batches(args, rows: int, tables: int, count: int):
    workload = workload_lib.Workload(tables=tables, rows=rows, dim=args.dim,
                                     batch=args.batch, hotness=1, zipf_alpha=args.zipf,
                                     seed=args.seed)
    ids = workload_lib.zipf_ids(workload, count)[..., 0].transpose(0, 2, 1)  # [n, b, t]
    rng = np.random.default_rng(args.seed)
    dense = rng.random((count, args.batch, DENSE_FEATURES), np.float32)
    labels = (rng.random((count, args.batch, 1)) < 0.5).astype(np.float32)
    return ids, dense, labels


class _Config:
    """One way of holding the tables, its model, step and cache statistics."""

    def __init__(self, args, share, store_dir, rows, tables):
        from tfhybrid.optimizers import RowWiseAdagrad
        self.share = share
        self.embeddings, call, self.towers = _model(args, share, store_dir, rows, tables)
        bottom, top = self.towers
        for embedding in self.embeddings:
            embedding.build(None)
        bottom.build((None, DENSE_FEATURES))
        features = 1 + tables                  # the interaction: the bottom output + pairs
        top.build((None, args.dim + features * (features - 1) // 2))
        self.variables = [w for layer in self.embeddings + [bottom, top]
                          for w in layer.trainable_weights]
        self.step = _train_step(call, RowWiseAdagrad(0.05), self.variables)

    def run(self, dense, ids, labels) -> float:
        return float(self.step(dense, ids, labels))

    def caches_full(self) -> bool:
        return all(e.table.stats()["cached_rows"] == e.table.cache_rows
                   for e in self.embeddings) if self.share is not None else True

    def cache_counts(self) -> tuple[int, int]:
        if self.share is None:
            return 0, 0
        stats = [e.table.stats() for e in self.embeddings]
        return sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)


def throughput(args) -> dict:
    store = tempfile.mkdtemp(prefix="tfhybrid-tiered-", dir=args.store_dir)
    atexit.register(shutil.rmtree, store, ignore_errors=True)
    ids, dense, labels = _batches(args, args.rows, args.tables, args.batches)
    configs = []
    for share in CACHE_SHARES:
        folder = os.path.join(store, "memory" if share is None else f"cache{share}")
        os.makedirs(folder)
        configs.append(_Config(args, share, folder, args.rows, args.tables))
    # the same start for every configuration: the in-memory tables' initial rows
    for config in configs[1:]:
        for mine, reference in zip(config.embeddings, configs[0].embeddings):
            mine.table.write_rows(0, reference.embeddings.numpy() if args.adaptive is None
                                  else reference.table.to_dense().numpy())
    losses = {}
    cursor = {id(c): 0 for c in configs}

    def steps(config, n):
        for _ in range(n):
            i = cursor[id(config)] % args.batches
            cursor[id(config)] += 1
            loss = config.run(dense[i], ids[i], labels[i])
            if cursor[id(config)] <= CHECK_STEPS:
                losses.setdefault(cursor[id(config)], []).append(loss)

    for config in configs[1:]:
        for mine, reference in zip(config.towers, configs[0].towers):
            mine.set_weights(reference.get_weights())
    # steady state: every cache full, so the timed steps evict as training goes on
    warmup = {}
    for config in configs:
        steps(config, args.warmup)
        while not config.caches_full() and cursor[id(config)] < args.max_warmup:
            steps(config, 10)
        warmup[config.share] = (cursor[id(config)], config.caches_full())
    for step, values in losses.items():
        if len(set(values)) != 1:
            raise RuntimeError(f"step {step}: the configurations' losses differ: {values}")
    if args.adaptive is not None:
        # FIITED prunes to its target, after the same steps everywhere (so from the same
        # utilities: the same widths, checked), and the timed steps run on rows of mixed
        # widths
        trained = max(cursor.values())
        for config in configs:
            steps(config, trained - cursor[id(config)])
        widths = []
        for config in configs:
            for embedding in config.embeddings:
                embedding.adjust()
            widths.append([e.table.chunks_per_row() for e in config.embeddings])
        for other in widths[1:]:
            if any((a != b).any() for a, b in zip(other, widths[0])):
                raise RuntimeError("the configurations pruned different chunks")
    rates = {c.share: [] for c in configs}
    counts = {c.share: c.cache_counts() for c in configs}
    for _ in range(args.repeats):
        for config in configs:
            start = time.perf_counter()
            steps(config, args.steps)
            rates[config.share].append(args.steps * args.batch /
                                       (time.perf_counter() - start))
    result = {}
    baseline = summarize(rates[None]).median
    for config in configs:
        hits, misses = (np.subtract(config.cache_counts(), counts[config.share]))
        summary = summarize(rates[config.share])
        result[_label(config.share)] = {
            "samples_per_s": rates[config.share], "median": summary.median,
            "summary": summary.format(1e-3, 1), "vs_memory": summary.median / baseline,
            "hit_rate": None if config.share is None else hits / max(1, hits + misses),
            "cache_rows": None if config.share is None else max(1, int(args.rows *
                                                                        config.share)),
            "warmup_steps": warmup[config.share][0], "cache_full": warmup[config.share][1],
            "dram_bytes": sum(_dram_bytes(e) for e in config.embeddings)}
    return result


def _dram_bytes(embedding) -> int:
    """What one table holds in memory: a dense table and its accumulator; a FIITED pool
    with its row index and row state; a tier's cache with its index."""
    table = getattr(embedding, "table", None)
    if table is None:
        return int(np.prod(embedding.embeddings.shape)) * 4 + embedding.input_dim * 4
    memory = table.memory_bytes()
    if "cache" in memory:
        return memory["cache"] + memory["index"]
    return memory["total"]


# ---------------------------------------------------------------- scale, under a limit
class _MemoryGroup:
    """A memory cgroup of its own with a limit, removed at exit."""

    def __init__(self, limit_bytes: int):
        if os.path.exists(os.path.join(MEMORY_V1, "memory.limit_in_bytes")):
            self.kind, root = "v1", MEMORY_V1
        elif "memory" in read_text(os.path.join(MEMORY_V2, "cgroup.controllers")).split():
            self.kind, root = "v2", MEMORY_V2
        else:
            raise RuntimeError(f"the scale run needs a memory cgroup: neither "
                               f"{MEMORY_V1}/memory.limit_in_bytes (v1) nor 'memory' in "
                               f"{MEMORY_V2}/cgroup.controllers (v2); --scale_rows 0 skips it")
        self.path = os.path.join(root, f"tfhybrid_tiered_{os.getpid()}_{time.time_ns()}")
        os.mkdir(self.path)
        atexit.register(self.remove)
        limit_file = "memory.limit_in_bytes" if self.kind == "v1" else "memory.max"
        write_text(os.path.join(self.path, limit_file), str(limit_bytes))
        if self.kind == "v1":   # no swap: the limit is what the process may hold
            swap = os.path.join(self.path, "memory.memsw.limit_in_bytes")
            if os.path.exists(swap):
                write_text(swap, str(limit_bytes))

    def add_self(self) -> None:
        write_text(os.path.join(self.path, "cgroup.procs"), str(os.getpid()))

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.kind == "v1" else "memory.peak"
        text = read_text(os.path.join(self.path, name)).strip()
        return int(text) if text.isdigit() else None

    def oom_kills(self) -> int:
        for line in read_text(os.path.join(self.path, "memory.oom_control" if self.kind ==
                                           "v1" else "memory.events")).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def _scale_child(args) -> None:
    """One configuration of the scale run, inside the group (the parent put it there)."""
    share = None if args.child_share < 0 else args.child_share
    store = tempfile.mkdtemp(prefix="tfhybrid-tiered-scale-", dir=args.store_dir)
    try:
        config = _Config(args, share, store, args.scale_rows, 1)
        ids, dense, labels = _batches(args, args.scale_rows, 1, args.batches)
        start, done = time.perf_counter(), 0
        config.run(dense[0], ids[0], labels[0])
        first = time.perf_counter() - start
        start = time.perf_counter()
        for step in range(1, args.scale_steps):
            i = step % args.batches
            config.run(dense[i], ids[i], labels[i])
            done += 1
        seconds = time.perf_counter() - start
        hits, misses = config.cache_counts()
        status = {}
        for line in read_text("/proc/self/status").splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                status[key] = int(value.split()[0]) * 1024
        print(CHILD_LINE + json.dumps({
            "steps": args.scale_steps, "first_step_s": first,
            "samples_per_s": done * args.batch / seconds,
            "hit_rate": hits / max(1, hits + misses) if share is not None else None,
            "writebacks": config.embeddings[0].table.stats()["writebacks"]
            if share is not None else None,
            "memory": config.embeddings[0].table.memory_bytes() if share is not None
            else None, **status}), flush=True)
    finally:
        shutil.rmtree(store, ignore_errors=True)


def scale(args) -> dict:
    limit = args.scale_limit_mib << 20
    table_bytes = args.scale_rows * (args.dim + 1) * 4
    cache_rows = int(args.scale_rows * args.scale_share)
    if table_bytes < 4 * cache_rows * (args.dim + 1) * 4 or table_bytes <= limit:
        raise ValueError(f"--scale_rows {args.scale_rows} x --dim {args.dim}: the table "
                         f"({table_bytes >> 20} MiB with its state) must be >= 4x the cache "
                         f"and larger than --scale_limit_mib {args.scale_limit_mib}")
    results = {"table_mib": table_bytes / 2**20, "limit_mib": args.scale_limit_mib,
               "cache_rows": cache_rows, "rows": args.scale_rows}
    for label, share in (("tier", args.scale_share), ("in memory", -1.0)):
        group = _MemoryGroup(limit)
        command = [sys.executable, os.path.abspath(__file__), "--child_share", str(share)] + \
            [f"--{k}={v}" for k, v in vars(args).items()
             if k in ("dim", "batch", "zipf", "seed", "batches", "scale_rows",
                      "scale_steps", "store_dir") and v is not None] + \
            [f"--bottom_mlp={','.join(map(str, args.bottom_mlp))}",
             f"--top_mlp={','.join(map(str, args.top_mlp))}"]
        started = time.perf_counter()
        try:
            proc = subprocess.run(command, preexec_fn=group.add_self, capture_output=True,
                                  text=True, timeout=args.scale_timeout)
            out, err, code = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, err, code = e.stdout or "", e.stderr or "", "timeout"
        record = {"exit": code, "seconds": time.perf_counter() - started,
                  "group_peak": group.peak(), "oom_kills": group.oom_kills()}
        for line in (out or "").splitlines():
            if line.startswith(CHILD_LINE):
                record.update(json.loads(line[len(CHILD_LINE):]))
        results[label] = record
        group.remove()
        # the tier must finish; the table in memory may only fail by the memory limit
        finished = code == 0 and "steps" in record
        if not finished and (share >= 0 or not record["oom_kills"]):
            tail = "\n".join(str(err or "").splitlines()[-15:])
            raise RuntimeError(f"the scale run's {label!r} child failed (exit {code}, "
                               f"{record['oom_kills']} OOM kills):\n{tail}")
    return results


def _report(args, tput: dict | None, big: dict | None, started: float) -> str:
    mib = 2**20
    lines = [f"{os.cpu_count()} CPUs; run time {(time.perf_counter() - started) / 60:.1f} min"]
    if tput is not None:
        lines += [
            "",
            f"throughput: DLRM (bottom MLP {args.bottom_mlp + [args.dim]}, top MLP "
            f"{args.top_mlp + [1]}), {args.tables} tables x {args.rows:,} x {args.dim}, one "
            f"Zipf({args.zipf}) id per table per sample, batch {args.batch}, row-wise "
            f"AdaGrad; {args.batches} distinct batches, cycled; {args.repeats} rounds x "
            f"{args.steps} steps after a warm-up of >= {args.warmup} steps that lasts until "
            f"each cache is full (steps and whether it was full: column 'warm-up'); k "
            f"samples/s, {SPREAD_LEGEND}; the first {CHECK_STEPS} losses are equal in every "
            "configuration (checked)",
            f"{'tables':<22}{'cache rows':>12}  {'k samples/s':<34}{'x memory':>9}"
            f"{'hit rate':>10}{'warm-up':>14}{'DRAM MiB':>10}"]
        if args.adaptive is not None:
            lines.insert(-1, f"FIITED tables (dims='adaptive', {args.chunks} chunks per "
                         f"row), pruned to {args.adaptive:.0%} of their chunks after the "
                         "warm-up (the same widths in every configuration, checked); "
                         "DRAM: pools and their row index and state, or caches and "
                         "their index")
        for label, row in tput.items():
            lines.append(f"{label:<22}{row['cache_rows'] or '-':>12}  {row['summary']:<34}"
                         f"{row['vs_memory']:>8.2f}x"
                         f"{'' if row['hit_rate'] is None else format(row['hit_rate'], '.1%'):>10}"
                         f"{row['warmup_steps']:>8} {'full' if row['cache_full'] else 'NOT full':>5}"
                         f"{row['dram_bytes'] / mib:>10.1f}")
    if big is not None:
        lines += [
            "",
            f"scale: one table of {big['rows']:,} x {args.dim} ({big['table_mib']:.0f} MiB "
            f"with its row-wise state), cache {big['cache_rows']:,} rows "
            f"({args.scale_share:.1%}), process memory limit {big['limit_mib']} MiB "
            f"(cgroup), {args.scale_steps} steps of {args.batch}"]
        for label in ("tier", "in memory"):
            r = big[label]
            ok = r["exit"] == 0 and "steps" in r
            line = f"{label:<10} exit {r['exit']}, OOM kills {r['oom_kills']}, "
            if ok:
                line += (f"{r['steps']} steps done, {r['samples_per_s'] / 1e3:.1f} k "
                         f"samples/s after the first step, "
                         f"peak RSS {r['VmHWM'] / mib:.0f} MiB (anonymous "
                         f"{r['RssAnon'] / mib:.0f} MiB, file {r['RssFile'] / mib:.0f} "
                         f"MiB at the end)")
                if r.get("hit_rate") is not None:
                    line += (f", hit rate {r['hit_rate']:.1%}, {r['writebacks']:,} rows "
                             "written back")
            else:
                line += "did not finish"
            peak = r["group_peak"]
            line += f"; group peak {peak / mib:.0f} MiB" if peak else ""
            lines.append(line)
    return "\n".join(lines)


def _plot(tput: dict, path: str, title: str, load) -> None:
    """Samples/s of each configuration: every timed round as a dot, the median as a bar,
    the hit rate written above the tiers' bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for x, (label, row) in enumerate(tput.items()):
        rates = np.asarray(row["samples_per_s"]) / 1e3
        ax.bar(x, row["median"] / 1e3, color="tab:blue" if x == 0 else "tab:orange")
        ax.plot([x] * rates.size, rates, "k.", markersize=4)
        note = f"{row['vs_memory']:.2f}x" + ("" if row["hit_rate"] is None else
                                             f"\nhit {row['hit_rate']:.0%}")
        ax.annotate(note, (x, rates.max()), textcoords="offset points", xytext=(0, 4),
                    ha="center", fontsize=8)
    ax.set_xticks(range(len(tput)), list(tput), fontsize=8)
    ax.set_ylabel("k samples/s (median; dots: rounds)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    _results.save_figure(fig, path, load)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--bottom_mlp", default="512,256", help="bottom MLP widths before "
                        "the last, which is --dim (default: NVIDIA's TF2 DLRM's)")
    parser.add_argument("--top_mlp", default="1024,1024,512,256",
                        help="top MLP widths before the logit (default: NVIDIA's TF2 DLRM's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=int, default=400, help="distinct batches, cycled")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--max_warmup", type=int, default=1000,
                        help="warm-up steps at most while a cache is not yet full")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--store_dir", default=None, help="folder of the stores (default: "
                        "the system's temporary folder)")
    parser.add_argument("--scale_rows", type=int, default=16_000_000,
                        help="rows of the scale run's table (0 skips the scale run)")
    parser.add_argument("--scale_share", type=float, default=0.002,
                        help="the scale run's cache, a share of its rows (small enough "
                        "that it is full within a few steps and rows are written back)")
    parser.add_argument("--scale_limit_mib", type=int, default=1536)
    parser.add_argument("--scale_steps", type=int, default=60)
    parser.add_argument("--scale_timeout", type=int, default=1200)
    parser.add_argument("--skip_throughput", action="store_true")
    parser.add_argument("--adaptive", type=float, default=None,
                        help="FIITED tables (dims='adaptive') pruned to this share of their "
                        "chunks after the warm-up, in memory and in the tier")
    parser.add_argument("--chunks", type=int, default=4, help="with --adaptive: chunks "
                        "per row")
    parser.add_argument("--out", default=None, help="also write the table here (+ .json, "
                        "and a .png of the throughput)")
    parser.add_argument("--child_share", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.bottom_mlp = [int(w) for w in str(args.bottom_mlp).split(",") if w]
    args.top_mlp = [int(w) for w in str(args.top_mlp).split(",") if w]
    if args.child_share is not None:
        args.scale_share = args.child_share
        _scale_child(args)
        return 0
    from tfhybrid.testing import provenance
    load = provenance.OtherLoad()
    started = time.perf_counter()
    tput = None if args.skip_throughput else throughput(args)
    big = scale(args) if args.scale_rows else None
    text = _report(args, tput, big, started)
    if not args.out:
        print(text)
        return 0
    _results.write_text(args.out, text.splitlines(), load)
    _results.write_json(os.path.splitext(args.out)[0] + ".json",
                        {"throughput": tput, "scale": big}, load)
    if tput is not None:
        _plot(tput, os.path.splitext(args.out)[0] + ".png",
              f"DLRM towers {args.bottom_mlp + [args.dim]} / {args.top_mlp + [1]}, "
              f"{args.tables} x {args.rows:,} x {args.dim}, batch {args.batch}", load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
