"""Runs one test module's TestCases in this process and writes a JSON report.

Started by tests/runner.py for one module, or for a job that runs modules one after
another as the runner names them (``--queue``), in one process or once per rank under
horovodrun. The reports are the only channel back to the runner, so a rank that dies
leaves no report and the runner counts the module it was in as failed (and goes on with
the next in a new job).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
import unittest


class _RecordingResult(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}
        self._started: dict[str, float] = {}

    def startTest(self, test):
        self._started[test.id()] = time.time()
        super().startTest(test)

    def _record(self, test, status, detail=""):
        # a subtest's id is not a started test's: it is timed with its test
        started = self._started.get(test.id())
        self.outcomes[test.id()] = {
            "status": status, "detail": detail,
            "seconds": round(time.time() - started, 1) if started else 0.0}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "fail", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skip", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "fail", "expected failures are not allowed in this suite")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "fail", "unexpected success")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            self._record(subtest, "fail", self._exc_info_to_string(err, test))


def _flatten(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _flatten(item)
        else:
            yield item


def runs_at_this_size(test: unittest.TestCase) -> bool:
    """A TestCase class may name the rank counts it runs at (``HOROVOD_NP``, a subset of
    its module's): at the others it is not collected, so one module holds tests of one
    subject whatever sizes they need."""
    sizes = getattr(type(test), "HOROVOD_NP", None)
    return sizes is None or int(os.environ.get("HOROVOD_SIZE", "1")) in sizes


def run_module(path: str, selected: list[str], rank: int) -> tuple[dict[str, dict], float]:
    """Runs the module's tests (those whose id contains one of ``selected``, or all; at
    this size); returns ({test_id: outcome}, seconds)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    module_name = os.path.relpath(os.path.abspath(path), root)[:-3].replace(os.sep, ".")
    start = time.time()
    outcomes: dict[str, dict] = {}
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        suite = unittest.TestSuite(
            test for test in _flatten(unittest.defaultTestLoader.loadTestsFromModule(module))
            # tf.test.TestCase inherits a deprecated `test_session` that only skips
            if test.id().rsplit(".", 1)[-1] != "test_session" and runs_at_this_size(test)
            and (not selected or any(name in test.id() for name in selected)))
        result = unittest.TextTestRunner(
            stream=sys.stderr, verbosity=2 if rank == 0 else 0,
            resultclass=_RecordingResult).run(suite)
        outcomes = result.outcomes
    except BaseException:  # an import error must reach the report, not vanish
        outcomes[f"{module_name}.<import>"] = {"status": "fail",
                                               "detail": traceback.format_exc()}
    return outcomes, time.time() - start


def write_report(report_dir: str, rank: int, outcomes: dict, seconds: float) -> None:
    """Writes this rank's report whole or not at all (the runner polls for it)."""
    os.makedirs(report_dir, exist_ok=True)
    tmp = os.path.join(report_dir, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "seconds": seconds, "tests": outcomes}, f)
    os.replace(tmp, os.path.join(report_dir, f"rank{rank}.json"))


def _between_modules() -> None:
    """What one module may leave behind for the next in the same process: the mesh and
    its process sets, the global precision policy and Keras' graph and name counters.
    Every rank runs the same modules in the same order, so all reset alike."""
    import tensorflow as tf
    if "tfhybrid.mesh" in sys.modules:
        sys.modules["tfhybrid.mesh"].reset()
    tf.keras.mixed_precision.set_global_policy("float32")
    tf.keras.backend.clear_session()


# how long a shared job waits to be told its next module: the runner names it within a
# fraction of a second of the reports, so a longer wait means the runner is gone
NEXT_MODULE_WAIT_S = 300


def next_module(job_dir: str, index: int) -> str | None:
    """The module the runner names as the job's ``index``-th (file ``next.INDEX`` in the
    job's folder; empty: the job ends). Every rank reads the same file, so all run the
    same module."""
    named = os.path.join(job_dir, f"next.{index}")
    give_up = time.time() + NEXT_MODULE_WAIT_S
    while not os.path.exists(named):
        if time.time() > give_up:
            raise SystemExit(f"no module named in {named} within {NEXT_MODULE_WAIT_S} s")
        time.sleep(0.05)
    with open(named) as f:
        return f.read() or None


def main(argv: list[str]) -> int:
    """``PATH REPORT_DIR [NAME ...]``: one module (optionally only tests whose id contains
    a NAME), its report in REPORT_DIR. ``--queue JOB_DIR``: modules one after another in
    this process, each as the runner names it (``next_module``), the i-th one's report in
    JOB_DIR/i, written as it ends (one start-up of TensorFlow and Horovod serves them
    all)."""
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    if argv[1] == "--queue":
        job_dir, index = argv[2], 0
        while (path := next_module(job_dir, index)) is not None:
            if index:
                _between_modules()
            print(f"=== module {index}: {path}", file=sys.stderr, flush=True)
            outcomes, seconds = run_module(path, [], rank)
            write_report(os.path.join(job_dir, str(index)), rank, outcomes, seconds)
            index += 1
        # the reports carry every failure; a non-zero exit would make horovodrun end
        # the ranks still in the last module before they write theirs
        return 0
    path, report_dir = argv[1], argv[2]
    # optional: only the tests whose id contains one of these (e.g. "ParityTest.test_x")
    outcomes, seconds = run_module(path, argv[3:], rank)
    write_report(report_dir, rank, outcomes, seconds)
    return 0 if all(o["status"] != "fail" for o in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
