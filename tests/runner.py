"""The test command: runs every tf.test module, single-process and under horovodrun.

Modules are ``tests/test_*.py``. A module that declares ``HOROVOD_NP = (2, 4)`` at top
level runs once per listed size under ``horovodrun -np N -H localhost:N --gloo`` (a
TestCase class may narrow its sizes with its own ``HOROVOD_NP``); others run in a plain
process. Two lanes run jobs side by side, each taking the next job it may run from one
schedule (``Schedule``). A job serves every module of its kind and size, one after
another, taking the next as it ends one (a start-up of TensorFlow costs about 3 s of
CPU, of TensorFlow and Horovod on four ranks about 10 s), unless the module sets
``OWN_PROCESS = True``. A test passes only if it passed on every rank; a rank that dies
or a module that overruns its time limit fails that module, and a new job goes on with
the next one. The last line is ``N passed, N failed``.

A module runs under Keras 2 (tf-keras) unless it declares ``KERAS = (2, 3)``; ``--keras 3``
runs those modules with Keras 3 as ``tf.keras`` (``TF_USE_LEGACY_KERAS=0``), as a user of
TensorFlow >= 2.16 gets it by default.

Usage: python -m tests.runner [-k SUBSTRING] [--subset NAME] [--keras 2|3] [--list]
"""

from __future__ import annotations

import argparse
import ast
import atexit
import concurrent.futures
import dataclasses
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
# TensorFlow stack: every version switch and hook in tfhybrid/_tf_internals/ (the
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
# A module's time limit bounds a hang (Horovod's stall shutdown never fires under Gloo).
# Four ranks beside another job's four took 480 s for a module that takes 300 s alone on
# a slower machine kind, so a multi-rank module gets more
SINGLE_TIMEOUT_S = 480
MULTI_TIMEOUT_S = 720
# jobs that run at once. One-process jobs use one thread each, one per core; a
# multi-rank job's ranks often all wait in a collective (a quarter to a third of an np=4
# job's time left the cores idle), and a job beside it then computes
LANES = 2
# how often the runner looks for a module's reports (a shared job waits this long, at
# most, to be told its next module)
POLL_S = 0.2
SLOWEST_SHOWN = 15


def discover() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py")))


def _declared(path: str, name: str):
    """A module-level constant's value, read without importing the module (imports
    cost seconds); None when the module does not set it."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def declared_sizes(path: str) -> tuple[int, ...]:
    """The module's ``HOROVOD_NP`` (the rank counts to run it at), default (1,)."""
    sizes = _declared(path, "HOROVOD_NP")
    return (1,) if sizes is None else tuple(int(n) for n in sizes)


def declared_kerases(path: str) -> tuple[int, ...]:
    """The Keras major versions the module runs under (``KERAS = (2, 3)``), default
    (2,): Keras 2 (tf-keras) is the suite's stack, Keras 3 a second run of the modules
    written for both (``--keras 3``)."""
    kerases = _declared(path, "KERAS")
    return (2,) if kerases is None else tuple(int(k) for k in kerases)


def keras_env(keras: int) -> dict[str, str]:
    """The environment that makes TensorFlow's ``tf.keras`` Keras ``keras`` (TF reads
    ``TF_USE_LEGACY_KERAS`` once, at its first use of ``tf.keras``).

    >>> keras_env(3)
    {'TF_USE_LEGACY_KERAS': '0'}
    """
    if keras not in (2, 3):
        raise ValueError(f"keras={keras!r}; expected 2 or 3")
    return {"TF_USE_LEGACY_KERAS": "1" if keras == 2 else "0"}


def declared_timeout(path: str, size: int) -> int:
    """The module's ``RUN_TIMEOUT_S`` (a module that starts its own jobs may need more
    than one run's default), else the default for its size."""
    timeout = _declared(path, "RUN_TIMEOUT_S")
    if timeout is not None:
        return int(timeout)
    return SINGLE_TIMEOUT_S if size == 1 else MULTI_TIMEOUT_S


def owns_process(path: str) -> bool:
    """Whether a module needs a process (or job) of its own (it sets process-wide state
    at import, such as a plain ``hvd.init()``): ``OWN_PROCESS = True``."""
    return bool(_declared(path, "OWN_PROCESS"))


def fills_cores(path: str) -> bool:
    """Whether a module that starts jobs keeps both cores busy by itself
    (``FILLS_CORES = True``: training jobs of several ranks back to back). Its stage
    runs it after the modules that mostly wait (for a stall to be noticed, a shaped link,
    a killed job), which overlap with the one-process modules at little cost; by the
    time it starts, those no longer compete with it for the cores."""
    return bool(_declared(path, "FILLS_CORES"))


def job_kind(path: str, size: int) -> str:
    """What a module's job is, for what may run beside it (``may_run_beside``):
    ``"ranks"`` (a horovodrun job), ``"starts_jobs"`` (a one-process module that declares
    ``STARTS_JOBS = True``: it starts multi-rank jobs of its own) or ``"one"`` (a plain
    process on one thread)."""
    if size > 1:
        return "ranks"
    return "starts_jobs" if _declared(path, "STARTS_JOBS") else "one"


def may_run_beside(kind: str, other: str) -> bool:
    """Whether jobs of these kinds may share the machine. A one-process job (one
    thread) fits beside anything; horovodrun jobs beside each other (their ranks take
    turns at the cores while others wait in collectives); a module that starts jobs of
    its own only beside one-process jobs: beside another's ranks, its jobs (a training
    job across an emulated link, a stall that must end a job within seconds) took
    nearly twice as long, and the suite as a whole did not end sooner.

    >>> may_run_beside("starts_jobs", "one"), may_run_beside("starts_jobs", "ranks")
    (True, False)
    >>> may_run_beside("ranks", "ranks"), may_run_beside("starts_jobs", "starts_jobs")
    (True, False)
    """
    return "one" in (kind, other) or kind == other == "ranks"


@dataclasses.dataclass
class Stage:
    """Modules of one kind and size, waiting to run, the longest first (lines of code,
    a rough guess at a module's time). ``shared``: a job runs them one after another,
    taking the next as it ends one (two jobs may take from one stage, and then end
    close together whatever each module's time turns out to be); else each module gets
    a job of its own."""
    kind: str
    size: int
    modules: list[str]
    shared: bool


class Schedule:
    """The suite's stages in order, for ``LANES`` lanes that each take the next job
    they may start: the first stage with modules waiting whose kind may run beside
    every job running now (``may_run_beside``), waiting while there is none.

    >>> schedule = Schedule([Stage("starts_jobs", 1, ["app", "docs"], False),
    ...                      Stage("one", 1, ["a", "b"], True),
    ...                      Stage("ranks", 4, ["r"], True)])
    >>> (first, app), (second, a) = schedule.next_job(), schedule.next_job()
    >>> app, a          # the second lane skips "docs": it may not run beside "app"
    ('app', 'a')
    >>> schedule.take(second), schedule.take(second)    # its job serves the stage
    ('b', None)
    >>> schedule.job_ended(first); schedule.job_ended(second)
    >>> third, docs = schedule.next_job()
    >>> docs
    'docs'
    >>> schedule.job_ended(third)
    >>> schedule.next_job()[1], schedule.next_job()
    ('r', None)
    """

    def __init__(self, stages: list[Stage]):
        self._stages = [stage for stage in stages if stage.modules]
        self._running: list[str] = []   # the kinds of the jobs running now
        self._changed = threading.Condition()

    def next_job(self) -> tuple[Stage, str] | None:
        """The stage the next job serves and its first module (blocks until one may
        start); None when no module is left for a new job."""
        with self._changed:
            while True:
                waiting = [stage for stage in self._stages if stage.modules]
                if not waiting:
                    return None
                for stage in waiting:
                    if all(may_run_beside(stage.kind, kind) for kind in self._running):
                        self._running.append(stage.kind)
                        return stage, stage.modules.pop(0)
                self._changed.wait()

    def take(self, stage: Stage) -> str | None:
        """The stage's next module for a job that serves it, or None: none left."""
        with self._changed:
            return stage.modules.pop(0) if stage.modules else None

    def job_ended(self, stage: Stage) -> None:
        with self._changed:
            self._running.remove(stage.kind)
            self._changed.notify_all()


def stages(plan: list[tuple[str, int]], share: bool = True) -> list[Stage]:
    """The plan's modules as stages, in the order lanes take them: modules that start
    jobs of their own (one at a time, beside one-process modules: the longest chain of
    the suite, so it starts first), one-process modules, then multi-rank ones by size,
    the largest first; in a stage, the longest module first, except that modules that
    fill the cores go last (``fills_cores``). With ``share=False`` every module gets a
    job of its own."""
    grouped: dict[tuple[str, int, bool], list[str]] = {}
    for path, size in plan:
        kind = job_kind(path, size)
        shared = share and kind != "starts_jobs" and not owns_process(path)
        grouped.setdefault((kind, size, shared), []).append(path)
    order = {"starts_jobs": 0, "one": 1, "ranks": 2}
    return [Stage(kind, size, sorted(paths, key=lambda p: (fills_cores(p), -_lines(p))),
                  shared)
            for (kind, size, shared), paths in sorted(
                grouped.items(), key=lambda item: (order[item[0][0]], -item[0][1],
                                                   not item[0][2]))]


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


def name_next_module(job_dir: str, index: int, path: str | None) -> None:
    """Names a shared job's module ``index`` (None: the job ends), whole or not at all
    (its ranks poll for the file: ``tests/_rank_main.py --queue``)."""
    tmp = os.path.join(job_dir, f".next.{index}.tmp")
    with open(tmp, "w") as f:
        f.write(path or "")
    os.replace(tmp, os.path.join(job_dir, f"next.{index}"))


def _end(proc: subprocess.Popen, grace_s: float) -> None:
    """Waits for a job that has finished its work to exit; ends it if it does not."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_shared(first: str, take: Callable[[], str | None], size: int, python: str,
               log, done: Callable[[str, dict[str, dict], str, float], None]) -> None:
    """Runs modules of one size one after another in a job: ``first``, then each one
    ``take()`` gives as the one before ends, until it gives None. Calls ``done(path,
    {test_id: outcome}, crash message, seconds)`` as each module ends; the job's output
    goes to the open file ``log``.

    The ranks learn each module from a file the runner writes (``name_next_module``),
    so all run the same one. A module's time limit counts from when it is named. A module that
    overruns it, or during which a rank dies, fails; the job is ended and a new one goes
    on with the next module.
    """
    module: str | None = first
    while module is not None:
        job_dir = tempfile.mkdtemp(prefix="tfhybrid-test-")
        log.write(f"### job at np={size}\n")
        log.flush()
        index, crash = 0, ""
        name_next_module(job_dir, index, module)
        proc = _launch([python, os.path.join(ROOT, "tests", "_rank_main.py"), "--queue",
                        job_dir], size, python, log)
        started = time.time()
        while True:
            report_dir = os.path.join(job_dir, str(index))
            if _reported(report_dir, size):
                merged, missing = read_reports(report_dir, size)
                done(module, *_outcome(merged, missing, ""), _module_seconds(report_dir))
                module, index, started = take(), index + 1, time.time()
                name_next_module(job_dir, index, module)
                if module is None:
                    _end(proc, 60)
                    break
                continue
            code = proc.poll()
            if code is not None:
                if _reported(report_dir, size):
                    continue   # the reports were written just before the exit
                crash = f"exit code {code}"
                break
            timeout = declared_timeout(module, size)
            if time.time() - started > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                crash = f"killed after {timeout} s"
                break
            time.sleep(POLL_S)
        if crash:
            merged, missing = read_reports(report_dir, size)
            done(module, *_outcome(merged, missing, crash), time.time() - started)
            module = take()
        shutil.rmtree(job_dir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only modules whose path contains this")
    parser.add_argument("--subset", choices=sorted(SUBSETS),
                        help="only the modules of this named subset")
    parser.add_argument("--keras", type=int, choices=(2, 3), default=2,
                        help="the Keras that tf.keras is (3: the modules that declare "
                             "KERAS = (2, 3))")
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
    TEST_ENV.update(keras_env(args.keras))
    plan = [(path, size) for path in discover() if args.k in path
            and (chosen is None or os.path.relpath(path, ROOT) in chosen)
            and args.keras in declared_kerases(path)
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
            with open(log_path, errors="replace") as log:
                tail = log.read()[-6000:]
            failures.append((name, f"the run failed: {crash}\n... last output ({log_path}):\n{tail}"))
        # the suite's clock beside each module: what overlapped what, where time went
        print(f"    {len(outcomes)} tests in {seconds:.1f} s, ended at "
              f"{time.time() - started:.0f} s"
              + (f"; RUN FAILED: {crash}" if crash else ""), flush=True)

    lock = threading.Lock()   # the lanes' reports reach one tally
    schedule = Schedule(stages(plan, share=not args.no_share))

    def lane(number: int) -> None:
        """Runs jobs, one after another, as the schedule gives them."""
        while (job := schedule.next_job()) is not None:
            stage, first = job
            try:
                if not stage.shared:
                    outcome = run(first, stage.size)
                    with lock:
                        record(*outcome, stage.size)
                    continue
                log_path = os.path.join(args.logs, f"lane{number}.np{stage.size}.log")

                def done(module, outcomes, crash, seconds):
                    with lock:
                        record(f"{os.path.relpath(module, ROOT)} [np={stage.size}]",
                               log_path, outcomes, crash, seconds, stage.size)

                with open(log_path, "a") as log:
                    run_shared(first, lambda: schedule.take(stage), stage.size, python,
                               log, done)
            finally:
                schedule.job_ended(stage)

    for stale in glob.glob(os.path.join(args.logs, "lane*.log")):
        os.remove(stale)   # a lane's log collects its jobs of one size in this run
    with concurrent.futures.ThreadPoolExecutor(max_workers=LANES) as pool:
        for future in [pool.submit(lane, number) for number in range(LANES)]:
            future.result()
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
