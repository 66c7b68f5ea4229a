"""The test command: runs every tf.test module, single-process and under horovodrun.

Modules are ``tests/test_*.py``. A module that declares
``HOROVOD_NP = (2, 4)`` at top level runs once per listed size under
``horovodrun -np N -H localhost:N --gloo`` (a TestCase class may narrow its sizes with
its own ``HOROVOD_NP``): the modules of one size are dealt into two jobs that run side
by side, each running its modules one after another (a start-up of TensorFlow and
Horovod on four ranks costs about 10 s of the machine), unless a module sets
``OWN_PROCESS = True``. Others run in plain
processes, each a few modules one after another (an import of TensorFlow costs about 3 s
of CPU), two such processes at a time unless the module sets ``RUN_ALONE = True``. A test
passes only if it passed on every rank; a rank that dies or a module that overruns its
time limit fails that module, and the job starts again with the next one. The last
line is ``N passed, N failed``.

Usage: python -m tests.runner [-k SUBSTRING] [--subset NAME] [--list]
"""

from __future__ import annotations

import argparse
import ast
import atexit
import concurrent.futures
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# tfhybrid's import sets TF_USE_LEGACY_KERAS=1 where Keras 3 is installed; the ranks
# inherit it, as from a user's job script that exports it, since test modules use
# tf.keras before importing tfhybrid (test_keras_version checks the import without it)
import tfhybrid  # noqa: E402,F401

# Each rank gets one thread (2 cores shared by up to 4 ranks), and Horovod gives up on
# a stalled collective quickly, so a broken test fails in about a minute, never hangs.
TEST_ENV = {
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "10",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "45",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "60",
    # Horovod's background loop coordinates the ranks every cycle even when idle: four
    # idle ranks took 0.8 of the 2 cores at 0.5 ms, 0.19 at 5 ms and 0.06 at 20 ms; at
    # 20 ms test_dct and test_pipeline took 15% and 22% less CPU than at 5 ms
    "HOROVOD_CYCLE_TIME": "20",
    "PYTHONDONTWRITEBYTECODE": "1",
}
# Named subsets (--subset). "tf-compat" is what CI runs on the other supported
# TensorFlow stack: every version switch and hook in tfhybrid/_tf_internals.py (the
# checkpoint writer's view of the saver, an optimizer's cached checkpoint children, the
# Keras 2 check that every import makes) and each module that broke when TF moved on
# (checkpoints, optimizer slots, FIITED, tiers), plus the op library, which is built
# against each TF's C++ ABI.
SUBSETS = {
    "tf-compat": (
        "tests/test_checkpoint.py",
        "tests/test_checkpoint_single.py",
        "tests/test_keras_checkpoint.py",
        "tests/test_keras_version.py",
        "tests/test_tf_internals.py",
        "tests/test_optimizers.py",
        "tests/test_fiited.py",
        "tests/test_tiers.py",
        "tests/test_mixed_precision.py",
        "tests/test_custom_ops.py",
    ),
}
SINGLE_TIMEOUT_S = 480
PAIRED_WORKERS = 2  # one-process modules run with one thread each: one per core
# one-process modules are dealt into this many processes (fewer start-ups of TensorFlow;
# enough of them that the two workers end close together)
PAIRED_PROCESSES = 8
# multi-rank modules of one size are dealt into this many jobs that run side by side: a
# job's ranks often all wait in a collective (a quarter to a third of an np=4 job's
# time left the cores idle), and the other job's ranks then compute
SHARED_JOBS = 2
MULTI_TIMEOUT_S = 480
SLOWEST_SHOWN = 15


def discover() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py")))


def _declared(path: str, name: str):
    """A module-level constant's value, read without importing the module (imports
    cost seconds); None when the module does not set it."""
    tree = ast.parse(open(path).read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def declared_sizes(path: str) -> tuple[int, ...]:
    """The module's ``HOROVOD_NP`` (the rank counts to run it at), default (1,)."""
    sizes = _declared(path, "HOROVOD_NP")
    return (1,) if sizes is None else tuple(int(n) for n in sizes)


def declared_timeout(path: str, size: int) -> int:
    """The module's ``RUN_TIMEOUT_S`` (a module that starts its own jobs may need more
    than one run's default), else the default for its size."""
    timeout = _declared(path, "RUN_TIMEOUT_S")
    if timeout is not None:
        return int(timeout)
    return SINGLE_TIMEOUT_S if size == 1 else MULTI_TIMEOUT_S


def runs_alone(path: str, size: int) -> bool:
    """Whether the module needs the machine to itself: every multi-rank run (its ranks
    share the cores), and a one-process module that declares ``RUN_ALONE = True``
    (it starts jobs of its own). Other one-process modules use one thread each, so two
    of them run side by side on the machine's cores."""
    return size > 1 or bool(_declared(path, "RUN_ALONE"))


def owns_process(path: str) -> bool:
    """Whether a module needs a process (or job) of its own (it sets process-wide state
    at import, such as a plain ``hvd.init()``): ``OWN_PROCESS = True``."""
    return bool(_declared(path, "OWN_PROCESS"))


def deal(paths: list[str], count: int,
         size: Callable[[str], int] | None = None) -> list[list[str]]:
    """``paths`` dealt into at most ``count`` non-empty lists of about equal total
    ``size`` (default: lines of code, a rough guess at a module's time): each path, the
    largest first, goes to the lightest list; each list keeps the given order.

    >>> deal(["a", "b", "c"], 2, size={"a": 5, "b": 3, "c": 3}.get)
    [['a'], ['b', 'c']]
    >>> deal(["a"], 3, size=len)
    [['a']]
    """
    sizes = {path: (size or _lines)(path) for path in paths}   # each file read once
    lists: list[list[str]] = [[] for _ in range(min(count, len(paths)))]
    totals = [0] * len(lists)
    for path in sorted(paths, key=sizes.get, reverse=True):
        lightest = totals.index(min(totals))
        lists[lightest].append(path)
        totals[lightest] += sizes[path]
    return [sorted(chosen, key=paths.index) for chosen in lists]


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def read_reports(report_dir: str, size: int) -> tuple[dict[str, dict], list[int]]:
    """Merges the ranks' reports: ({test_id: outcome}, ranks that wrote none).

    A test passes only if it passed on every rank; the details of every failing rank
    are kept.
    """
    reports = {}
    for rank in range(size):
        report = os.path.join(report_dir, f"rank{rank}.json")
        if os.path.exists(report):
            reports[rank] = json.load(open(report))["tests"]
    merged: dict[str, dict] = {}
    for rank, tests in sorted(reports.items()):
        for test_id, outcome in tests.items():
            seen = merged.setdefault(test_id, {"status": "pass", "detail": "", "seconds": 0.0})
            # the slowest rank's time is the test's time: the others wait for it
            seen["seconds"] = max(seen["seconds"], outcome.get("seconds", 0.0))
            if outcome["status"] == "fail":
                seen["status"] = "fail"
                seen["detail"] += f"--- rank {rank} ---\n{outcome['detail']}\n"
            elif outcome["status"] == "skip" and seen["status"] == "pass":
                seen["status"], seen["detail"] = "skip", outcome["detail"]
    return merged, sorted(set(range(size)) - set(reports))


def _launch(inner: list[str], size: int, python: str, log) -> subprocess.Popen:
    env = dict(os.environ, **TEST_ENV)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = inner
    if size > 1:
        horovodrun = os.path.join(os.path.dirname(python), "horovodrun")
        cmd = [horovodrun, "-np", str(size), "-H", f"localhost:{size}", "--gloo",
               "--start-timeout", "60"] + inner
    return subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True,
                            stdout=log, stderr=subprocess.STDOUT)


def _outcome(merged: dict, missing: list[int], crash: str) -> tuple[dict, str]:
    if crash.startswith("exit code") and not missing and any(
            seen["status"] == "fail" for seen in merged.values()):
        # a rank exits non-zero because a test failed: that failure is already counted
        crash = ""
    if missing:
        crash = (crash + "; " if crash else "") + f"no report from rank(s) {missing}"
    return merged, crash


def run_module(path: str, size: int, python: str, log_path: str
               ) -> tuple[dict[str, dict], str]:
    """Runs one module at one size in a job of its own; returns ({test_id: outcome},
    a crash message). The run's output goes to ``log_path``; the caller shows it only
    on failure.
    """
    report_dir = tempfile.mkdtemp(prefix="tfhybrid-test-")
    inner = [python, os.path.join(ROOT, "tests", "_rank_main.py"), path, report_dir]
    timeout = declared_timeout(path, size)
    crash = ""
    with open(log_path, "w") as log:
        proc = _launch(inner, size, python, log)
        try:
            code = proc.wait(timeout=timeout)
            if code != 0:
                crash = f"exit code {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            crash = f"killed after {timeout} s"
    merged, missing = read_reports(report_dir, size)
    shutil.rmtree(report_dir, ignore_errors=True)
    return _outcome(merged, missing, crash)


def _reported(report_dir: str, size: int) -> bool:
    return all(os.path.exists(os.path.join(report_dir, f"rank{r}.json")) for r in range(size))


def _module_seconds(report_dir: str) -> float:
    seconds = [json.load(open(p))["seconds"]
               for p in glob.glob(os.path.join(report_dir, "rank*.json"))]
    return max(seconds, default=0.0)


def run_shared(paths: list[str], size: int, python: str, log_path: str,
               done: Callable[[str, dict[str, dict], str, float], None]) -> None:
    """Runs modules of one size one after another in shared jobs; calls
    ``done(path, {test_id: outcome}, crash message, seconds)`` as each one ends.

    Each module keeps its own time limit, counted from the end of the one before. A
    module that overruns it, or during which a rank dies, fails; the job is ended and a
    new one runs the modules after it.
    """
    finished = 0
    with open(log_path, "w") as log:
        while finished < len(paths):
            pending = paths[finished:]
            report_root = tempfile.mkdtemp(prefix="tfhybrid-test-")
            dirs = [os.path.join(report_root, str(i)) for i in range(len(pending))]
            inner = [python, os.path.join(ROOT, "tests", "_rank_main.py"), "--modules",
                     report_root] + pending
            log.write(f"### job of {len(pending)} module(s) at np={size}\n")
            log.flush()
            proc = _launch(inner, size, python, log)
            current, started, crash = 0, time.time(), ""

            def report_finished() -> None:
                nonlocal current, started
                while current < len(pending) and _reported(dirs[current], size):
                    merged, missing = read_reports(dirs[current], size)
                    done(pending[current], *_outcome(merged, missing, ""),
                         _module_seconds(dirs[current]))
                    current, started = current + 1, time.time()

            while True:
                report_finished()
                code = proc.poll()
                if code is not None:
                    report_finished()   # reports written just before the exit
                    if current < len(pending):
                        crash = f"exit code {code}"
                    break
                if current == len(pending):
                    # every module reported: the job is ending (a stuck exit is ended)
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                    break
                timeout = declared_timeout(pending[current], size)
                if time.time() - started > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    crash = f"killed after {timeout} s"
                    break
                time.sleep(0.5)
            if current < len(pending):
                merged, missing = read_reports(dirs[current], size)
                done(pending[current], *_outcome(merged, missing, crash),
                     time.time() - started)
                current += 1
            finished += current
            shutil.rmtree(report_root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only modules whose path contains this")
    parser.add_argument("--subset", choices=sorted(SUBSETS),
                        help="only the modules of this named subset")
    parser.add_argument("--list", action="store_true", help="list modules and sizes")
    parser.add_argument("--no-share", action="store_true",
                        help="every module in a process (multi-rank: a horovodrun job) of its own "
                             "(to isolate one module from what others leave behind)")
    parser.add_argument("--logs", default=os.path.join(ROOT, ".test-reports"),
                        help="folder for each run's full output")
    args = parser.parse_args()
    python = sys.executable
    chosen = set(SUBSETS[args.subset]) if args.subset else None
    unknown = sorted((chosen or set()) - {os.path.relpath(p, ROOT) for p in discover()})
    if unknown:
        parser.error(f"subset {args.subset!r} names modules that do not exist: {unknown}")
    plan = [(path, size) for path in discover() if args.k in path
            and (chosen is None or os.path.relpath(path, ROOT) in chosen)
            for size in declared_sizes(path)]
    if args.list:
        for path, size in plan:
            print(f"{os.path.relpath(path, ROOT)}  np={size}")
        return 0
    os.makedirs(args.logs, exist_ok=True)
    # every job's temporary files go to one folder of this run, removed when it ends:
    # what a test or a docstring example leaves in the temporary directory goes too
    scratch = tempfile.mkdtemp(prefix="tfhybrid-suite-")
    os.environ["TMPDIR"] = tempfile.tempdir = scratch
    atexit.register(shutil.rmtree, scratch, True)
    passed = failed = skipped = 0
    failures = []
    timings: list[tuple[float, str]] = []
    started = time.time()

    def run(path: str, size: int) -> tuple[str, str, dict, str, float]:
        name = f"{os.path.relpath(path, ROOT)} [np={size}]"
        t0 = time.time()
        log_path = os.path.join(args.logs, f"{os.path.basename(path)[:-3]}.np{size}.log")
        outcomes, crash = run_module(path, size, python, log_path)
        return name, log_path, outcomes, crash, time.time() - t0

    def record(name: str, log_path: str, outcomes: dict, crash: str, seconds: float,
               size: int) -> None:
        nonlocal passed, failed, skipped
        print(f"==> {name}", flush=True)
        for test_id, outcome in sorted(outcomes.items()):
            label = f"{test_id} [np={size}]"
            timings.append((outcome["seconds"], label))
            if outcome["status"] == "pass":
                passed += 1
            elif outcome["status"] == "skip":
                skipped += 1
                print(f"SKIP {label}: {outcome['detail']}")
            else:
                failed += 1
                failures.append((label, outcome["detail"]))
        if crash:
            failed += 1
            tail = open(log_path, errors="replace").read()[-6000:]
            failures.append((name, f"the run failed: {crash}\n... last output ({log_path}):\n{tail}"))
        # the suite's clock beside each module: what overlapped what, where time went
        print(f"    {len(outcomes)} tests in {seconds:.1f} s, ended at "
              f"{time.time() - started:.0f} s"
              + (f"; RUN FAILED: {crash}" if crash else ""), flush=True)

    lock = threading.Lock()   # the workers' reports reach one tally

    def run_jobs(jobs: list[list[str]], size: int, workers: int) -> None:
        """Each list of modules in one shared process or job, ``workers`` at a time."""
        def run_job(index: int, modules: list[str]) -> None:
            log_path = os.path.join(args.logs, f"shared.np{size}.{index}.log")

            def done(module, outcomes, crash, seconds):
                with lock:
                    record(f"{os.path.relpath(module, ROOT)} [np={size}]", log_path,
                           outcomes, crash, seconds, size)

            run_shared(modules, size, python, log_path, done)

        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for future in [pool.submit(run_job, i, modules)
                           for i, modules in enumerate(jobs)]:
                future.result()

    # one-process modules that may share the machine first: dealt into a few processes
    # (or one each: --no-share, OWN_PROCESS), two processes at a time; then the rest
    paired = [path for path, size in plan if not runs_alone(path, size)]
    shareable = [] if args.no_share else [p for p in paired if not owns_process(p)]
    run_jobs(deal(shareable, PAIRED_PROCESSES) + [[p] for p in paired if p not in shareable],
             1, PAIRED_WORKERS)
    shared = {}   # size: modules that share its jobs, run where the first of them is
    for path, size in plan:
        if size > 1 and not (args.no_share or owns_process(path)):
            shared.setdefault(size, []).append(path)
    for path, size in plan:
        if size > 1 and path in shared.get(size, ()):
            if path == shared[size][0]:
                run_jobs(deal(shared[size], SHARED_JOBS), size, SHARED_JOBS)
        elif runs_alone(path, size):
            record(*run(path, size), size)
    for label, detail in failures:
        print(f"\nFAIL {label}\n{detail}")
    # where the suite's time goes, so the slowest tests are the first ones trimmed
    print("\nslowest tests:")
    for seconds, label in sorted(timings, reverse=True)[:SLOWEST_SHOWN]:
        print(f"  {seconds:7.1f} s  {label}")
    with open(os.path.join(args.logs, "timings.txt"), "w") as every:
        every.writelines(f"{seconds:7.1f} s  {label}\n"
                         for seconds, label in sorted(timings, reverse=True))
    print(f"(every test's time: {os.path.relpath(args.logs, ROOT)}/timings.txt)")
    print(f"\ntotal {time.time() - started:.0f} s")
    tail = f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")
    print(tail)
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
