"""Input samples/s per rank: the criteo_tsv reader against the criteo_binary reader, at 1, 2
and 4 ranks reading at once, unconstrained and with each rank capped to a CPU share, plus
preprocessing lines/s (issue 17).

``--lines`` Criteo-format lines in ``--files`` day files (random values, 8-digit hex ids,
some fields empty) are written, then converted by ``tfhybrid.train.preprocess`` (``--ids=hash``, so
both readers give identical batches: tests/test_criteo_binary.py). For each reader and
rank count N, N processes start together (a barrier once each has built its pipeline),
each iterating its own rank's share of the data (``make_dataset(..., rank=r, size=N)``,
global batch ``--batch``) and timing it after its first batch. A rank iterates whole
passes until its timed window reaches ``--min_seconds`` (at least one pass): one binary
pass takes tens of ms here, shorter than the 100 ms period in which a CPU quota is
enforced, so a one-pass window would not see the cap. A rank's figure is its samples /
seconds, the total is the sum over ranks.

Two modes run in the same invocation, interleaved so background load hits both alike:
``unconstrained`` (the ranks share the machine's cores as the scheduler likes) and, with
``--cpu_share s`` (default 0.5; 0 skips it), ``capped``: each rank process sits in a cgroup
of its own whose CPU quota is ``s`` of one CPU, so N ranks need N*s CPUs. With s = 0.5 and
N <= 4 the 2 cores of this machine are never oversubscribed, so the capped mode emulates a
machine with one (half-speed) core per rank: there the total can grow with the ranks when
no rank does another rank's work, which 4 ranks time-sharing 2 cores cannot show. cgroup v1
(``/sys/fs/cgroup/cpu``, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) or v2
(``/sys/fs/cgroup/cgroup.controllers`` listing ``cpu``, ``cpu.max``); needs root. The
groups (``tfhybrid_input_<pid>_<rank>``) are removed at the end, also on errors.

Each configuration runs ``--repeats`` times; the table gives, per mode, the median
[p25, p75] (min, max) of the per-rank figure and of the total, total(N) / total(1) and
binary / TSV of the per-rank medians measured in this run, the CPU a rank used (CPU seconds per
second of its window) and the CPU other processes used meanwhile (machine busy minus the
ranks). A rank process that does not report within ``--timeout`` seconds is killed and the
run fails. Writes ``results/input_throughput.{txt,json,png}``.

Usage: .venv/bin/python benchmarks/input_throughput.py [--lines 400000 --repeats 3
       --cpu_share 0.5]
"""

from __future__ import annotations

import argparse
import atexit
import errno
import multiprocessing
import os
import queue as queue_module
import shutil
import signal
import sys
import tempfile
import time
import traceback

import _results  # beside this script; it puts the checkout first on sys.path
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from benchmarks._cgroup import read_text as _read, write_text as _write  # noqa: E402
from benchmarks._stats import SPREAD_LEGEND, summarize  # noqa: E402

READERS = {"criteo_tsv": "tsv", "criteo_binary": "binary"}
CGROUP_V1 = "/sys/fs/cgroup/cpu"
CGROUP_V2 = "/sys/fs/cgroup"
PERIOD_US = 100_000        # the kernel's default CFS period
MAX_PASSES = 10_000        # only bounds num_batches; --min_seconds ends a rank long before


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


class CpuCaps:
    """One cgroup per rank index with a CPU quota of ``share`` CPUs, reused by every run and
    removed by :meth:`remove_all` (called from ``finally`` and, as a backstop, ``atexit``)."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.groups: dict[int, str] = {}
        if os.path.exists(os.path.join(CGROUP_V1, "cpu.cfs_quota_us")):
            self.kind, self.root = "v1", CGROUP_V1
        elif "cpu" in _read(os.path.join(CGROUP_V2, "cgroup.controllers")).split():
            self.kind, self.root = "v2", CGROUP_V2
            # v2 gives a child group the cpu files only if its parent enables the controller
            control = os.path.join(CGROUP_V2, "cgroup.subtree_control")
            if "cpu" not in _read(control).split():
                _write(control, "+cpu")
        else:
            raise RuntimeError(
                f"--cpu_share needs a cgroup CPU controller: neither "
                f"{os.path.join(CGROUP_V1, 'cpu.cfs_quota_us')} (v1) exists nor does "
                f"{os.path.join(CGROUP_V2, 'cgroup.controllers')} (v2) list 'cpu'; "
                f"run with --cpu_share 0 to measure the unconstrained mode only")
        atexit.register(self.remove_all)

    def group(self, rank: int) -> str:
        """The group of rank index ``rank``, created with its quota on first use."""
        if rank in self.groups:
            return self.groups[rank]
        path = os.path.join(self.root, f"tfhybrid_input_{os.getpid()}_{rank}")
        try:
            os.mkdir(path)
        except OSError as e:
            raise RuntimeError(f"cannot create cgroup {path} ({self.kind}): {e}") from e
        self.groups[rank] = path
        quota = int(self.share * PERIOD_US)
        if self.kind == "v1":
            _write(os.path.join(path, "cpu.cfs_period_us"), str(PERIOD_US))
            _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
        else:
            _write(os.path.join(path, "cpu.max"), f"{quota} {PERIOD_US}")
        return path

    @staticmethod
    def add(path: str, pid: int) -> None:
        # cgroup.procs moves every thread of the process (v1 and v2); `tasks` would move one
        _write(os.path.join(path, "cgroup.procs"), str(pid))

    @staticmethod
    def throttling(path: str) -> dict[str, int]:
        """cpu.stat's counters (v1: nr_throttled, throttled_time ns; v2: ..., throttled_usec)."""
        stats = {}
        for line in _read(os.path.join(path, "cpu.stat")).splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                stats[key] = int(value)
        return stats

    def remove_all(self) -> None:
        for rank, path in list(self.groups.items()):
            # an exited task leaves its group a moment after its parent sees it exit
            for attempt in range(50):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or attempt == 49:
                        print(f"warning: could not remove cgroup {path}: {e}", file=sys.stderr)
                        break
                    time.sleep(0.1)
            del self.groups[rank]


def _in_group(path: str) -> bool:
    """Whether this process's cpu cgroup (v1 line naming cpu, or v2's '0::') is ``path``."""
    name = "/" + os.path.basename(path)
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, where = line.split(":", 2)
        if (controllers == "" or "cpu" in controllers.split(",")) and where.endswith(name):
            return True
    return False


def _machine_busy() -> float:
    """CPU seconds all processes of the machine have used (/proc/stat, not idle/iowait)."""
    fields = [int(v) for v in _read("/proc/stat").splitlines()[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _rank(name: str, folder: str, rank: int, size: int, batch: int, batches_per_pass: int,
          min_seconds: float, group: str | None, timeout: float, barrier, results) -> None:
    try:
        if group is not None:
            # the parent moves this process right after starting it; wait for that so no
            # measured work runs outside the quota
            deadline = time.monotonic() + 30.0
            while not _in_group(group):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank} was not moved into cgroup {group}")
                time.sleep(0.01)
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        from tfhybrid.train import data
        dataset = data.make_dataset(name, "train", global_batch_size=batch, rank=rank,
                                    size=size, data_dir=folder, max_table_rows=100_000,
                                    num_batches=batches_per_pass * MAX_PASSES)
        barrier.wait(timeout)            # every rank starts together
        iterator = iter(dataset)
        next(iterator)                   # the pipeline is up
        start, cpu, busy = time.perf_counter(), time.process_time(), _machine_busy()
        samples, batches = 0, 1
        for features, _ in iterator:
            samples += int(features["dense"].shape[0])
            batches += 1
            if batches % batches_per_pass == 0 and time.perf_counter() - start >= min_seconds:
                break
        seconds = time.perf_counter() - start
        results.put(("ok", rank, samples, seconds, time.process_time() - cpu,
                     _machine_busy() - busy))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def _run(context, caps: CpuCaps | None, name: str, folder: str, size: int, batch: int,
         batches_per_pass: int, min_seconds: float, timeout: float) -> dict:
    """One configuration once: ``size`` rank processes, in their cgroups if ``caps``."""
    results, barrier = context.Queue(), context.Barrier(size)
    processes, groups = [], []
    try:
        for rank in range(size):
            group = caps.group(rank) if caps else None
            process = context.Process(target=_rank, daemon=True, args=(
                name, folder, rank, size, batch, batches_per_pass, min_seconds, group,
                timeout, barrier, results))
            process.start()
            if group is not None:
                caps.add(group, process.pid)
                groups.append(group)
            processes.append(process)
        before = [CpuCaps.throttling(g) for g in groups]
        reports: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(reports) < size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} x{size}: {size - len(reports)} rank(s) did not "
                                   f"report within --timeout {timeout:.0f} s")
            try:
                message = results.get(timeout=1.0)
            except queue_module.Empty:
                # a rank killed from outside reports nothing; do not wait out the timeout
                dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{name} x{size}: a rank exited with {dead[0]}")
                continue
            if message[0] == "error":
                raise RuntimeError(f"{name} x{size}, rank {message[1]}:\n{message[2]}")
            reports[message[1]] = message[2:]
        for process in processes:
            process.join(30)
        throttled = [{key: CpuCaps.throttling(g).get(key, 0) - b.get(key, 0)
                      for key in ("nr_periods", "nr_throttled")} for g, b in zip(groups, before)]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    rates = [reports[r][0] / reports[r][1] for r in range(size)]
    cpu = [reports[r][2] / reports[r][1] for r in range(size)]
    # rank 0's window: the machine's busy CPUs minus what the ranks themselves used
    other = reports[0][3] / reports[0][1] - sum(cpu)
    return {"per_rank": rates, "total": sum(rates), "cpu_per_rank": cpu, "other_cpus": other,
            "throttled": throttled}


def _mode(share: float) -> str:
    return "unconstrained" if share == 0 else f"capped {share:g} CPU/rank"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=400_000)
    parser.add_argument("--files", type=int, default=4, help="train day files")
    parser.add_argument("--batch", type=int, default=16384, help="global batch")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="preprocessing processes")
    parser.add_argument("--cpu_share", type=float, default=0.5,
                        help="CPUs per rank process in the capped mode (0: unconstrained only)")
    parser.add_argument("--min_seconds", type=float, default=2.0,
                        help="each rank's timed window, in whole passes, at least this long")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a run's rank processes get to report before being killed")
    parser.add_argument("--out", default=_results.RESULTS)
    args = parser.parse_args()
    if args.cpu_share < 0 or 0 < args.cpu_share < 0.01:
        parser.error(f"--cpu_share={args.cpu_share}: expected 0 or at least 0.01 (the "
                     f"kernel's smallest quota is 1 ms per {PERIOD_US // 1000} ms period)")
    cpus = len(os.sched_getaffinity(0))
    if args.cpu_share * max(args.ranks) > cpus:
        print(f"warning: {max(args.ranks)} ranks x {args.cpu_share:g} CPU exceed the {cpus} "
              f"CPUs here, so the capped ranks time-share too", file=sys.stderr)
    shares = [0.0] + ([args.cpu_share] if args.cpu_share > 0 else [])
    # SIGTERM would otherwise skip the finally below and leave groups and processes behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    caps = CpuCaps(args.cpu_share) if args.cpu_share > 0 else None
    started = time.time()
    from tfhybrid.testing import provenance
    load = provenance.OtherLoad()
    work = tempfile.mkdtemp(prefix="tfhybrid-input-")
    try:
        from tfhybrid.train.preprocess import preprocess
        tsv, binary = os.path.join(work, "tsv"), os.path.join(work, "binary")
        # train in --files day files, so the preprocessing workers share them
        os.makedirs(os.path.join(tsv, "train"))
        os.makedirs(os.path.join(tsv, "eval"))
        for day in range(args.files):
            _write_tsv(os.path.join(tsv, "train", f"day_{day}"), args.lines // args.files,
                       seed=day)
        _write_tsv(os.path.join(tsv, "eval", f"day_{args.files}"), args.batch,
                   seed=args.files)
        converted = preprocess(tsv, binary, workers=args.workers, log=lambda _: None)["train"]
        preprocess_rate = converted["lines"] / converted["seconds"]
        print(f"preprocessing: {converted['lines']:,} lines in {converted['seconds']:.2f} s = "
              f"{preprocess_rate:,.0f} lines/s ({args.workers} workers)\n")
        # both readers drop each pass's remainder of a global batch
        batches_per_pass = converted["lines"] // args.batch
        folders = {"criteo_tsv": tsv, "criteo_binary": binary}
        runs: dict[tuple, list[dict]] = {}
        context = multiprocessing.get_context("spawn")
        # repeats outermost and the modes side by side, so a burst of background load
        # lands on every configuration rather than on one mode's repeats
        for repeat in range(args.repeats):
            for size in args.ranks:
                for name in READERS:
                    for share in shares:
                        run = _run(context, caps if share else None, name, folders[name],
                                   size, args.batch, batches_per_pass, args.min_seconds,
                                   args.timeout)
                        runs.setdefault((share, name, size), []).append(run)
                        print(f"  [{repeat + 1}/{args.repeats}] {_mode(share):22s} "
                              f"{READERS[name]:6s} x{size}: total {run['total'] / 1e3:,.1f} "
                              f"k samples/s, CPU/rank "
                              f"{np.median(run['cpu_per_rank']):.2f}, others "
                              f"{run['other_cpus']:.2f} CPUs", flush=True)
    finally:
        if caps is not None:
            caps.remove_all()
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.time() - started

    results = []
    for (share, name, size), repeats in runs.items():
        results.append({"mode": _mode(share), "cpu_share": share or None, "reader": name,
                        "ranks": size,
                        "per_rank": [r for run in repeats for r in run["per_rank"]],
                        "total": [run["total"] for run in repeats],
                        "cpu_per_rank": [c for run in repeats for c in run["cpu_per_rank"]],
                        "other_cpus": [run["other_cpus"] for run in repeats],
                        "throttled": [run["throttled"] for run in repeats]})

    def find(share: float, name: str, size: int) -> dict | None:
        return next((r for r in results if r["mode"] == _mode(share) and r["reader"] == name
                     and r["ranks"] == size), None)

    lines = [f"{cpus} CPUs; run time {elapsed / 60:.1f} min; other processes may have used "
             f"the CPU meanwhile (column 'others')",
             f"{args.lines:,} train lines in {args.files} files, global batch {args.batch}; "
             f"preprocessing (worker start-up included) "
             f"{preprocess_rate:,.0f} lines/s with {args.workers} workers; {args.repeats} "
             f"repeats; each rank timed over whole passes, >= {args.min_seconds:g} s; "
             f"k samples/s, {SPREAD_LEGEND}"]
    if caps is not None:
        lines.append(f"capped: each rank process in its own cgroup {caps.kind} "
                     f"({caps.root}/tfhybrid_input_<pid>_<rank>), quota "
                     f"{int(args.cpu_share * PERIOD_US)} us per {PERIOD_US} us period = "
                     f"{args.cpu_share:g} CPU; N ranks need N x {args.cpu_share:g} CPUs")
    lines.append("CPU/rank: CPU seconds a rank used per second of its window (median); "
                 "others: CPUs busy outside the ranks during rank 0's window (median)")
    for share in shares:
        lines += ["", f"{_mode(share)}:",
                  f"{'reader':8s} {'ranks':>5s}  {'per rank':>45s}  {'total':>45s}  "
                  f"{f'vs {min(args.ranks)} rank':>9s}  {'binary/tsv':>10s}  "
                  f"{'CPU/rank':>8s}  {'others':>6s}"]
        for name in READERS:
            for size in args.ranks:
                row = find(share, name, size)
                one = find(share, name, min(args.ranks))
                scaling = np.median(row["total"]) / np.median(one["total"])
                ratio = ""
                if name == "criteo_binary":
                    tsv_row = find(share, "criteo_tsv", size)
                    ratio = np.median(row["per_rank"]) / np.median(tsv_row["per_rank"])
                    ratio = f"{ratio:.1f}x"
                lines.append(f"{READERS[name]:8s} {size:5d}  "
                             f"{summarize(row['per_rank']).format(1e-3, 1):>45s}  "
                             f"{summarize(row['total']).format(1e-3, 1):>45s}  "
                             f"{scaling:8.2f}x  {ratio:>10s}  "
                             f"{np.median(row['cpu_per_rank']):8.2f}  "
                             f"{np.median(row['other_cpus']):6.2f}")
    _results.write_text(os.path.join(args.out, "input_throughput.txt"), lines, load)
    _results.write_json(os.path.join(args.out, "input_throughput.json"),
                        {"cpus": cpus, "seconds": elapsed,
                         "cgroup": None if caps is None else {"kind": caps.kind,
                                                              "root": caps.root,
                                                              "period_us": PERIOD_US},
                         "settings": vars(args), "batches_per_pass": batches_per_pass,
                         "preprocess_lines_per_s": preprocess_rate, "results": results}, load)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(shares), figsize=(5.5 * len(shares), 4.2), sharey=True,
                             squeeze=False)
    for ax, share in zip(axes[0], shares):
        for name, label in READERS.items():
            rows = [find(share, name, size) for size in args.ranks]
            medians = np.array([np.median(r["total"]) for r in rows])
            spread = np.array([[m - np.percentile(r["total"], 25),
                                np.percentile(r["total"], 75) - m]
                               for m, r in zip(medians, rows)]).T
            line = ax.errorbar(args.ranks, medians, yerr=spread, fmt="o-", capsize=3,
                               label=label)
            # what the total would be if it grew in proportion to the ranks
            ax.plot(args.ranks, medians[0] * np.array(args.ranks) / args.ranks[0], ":",
                    color=line[0].get_color(), label=f"{label}, x ranks")
        ax.set_xlabel("ranks reading at once")
        ax.set_ylabel("total input samples/s")
        ax.set_yscale("log")
        # set from the data: zero-length error bars otherwise stretch the log axis to ~1
        totals = [t for r in results for t in r["total"]]
        ax.set_ylim(min(totals) / 2, max(totals) * 3 * max(args.ranks))
        ax.set_xticks(args.ranks)
        ax.set_title(f"{_mode(share)} ({cpus} CPUs)")
        ax.legend(fontsize=8)
    fig.suptitle(f"total input samples/s, median [p25, p75] of {args.repeats}")
    fig.tight_layout()
    _results.save_figure(fig, os.path.join(args.out, "input_throughput.png"), load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
