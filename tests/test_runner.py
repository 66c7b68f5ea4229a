"""The test runner's own rules: what may run beside what, how lanes take jobs from the
schedule, how a shared job learns its modules, and how a module's declarations are read
without importing it."""

import doctest
import os
import shutil
import tempfile
import threading
import unittest

from tests import _rank_main, runner


def _module(text: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    return f.name


class ScheduleTest(unittest.TestCase):

    def test_docstring_examples(self):
        self.assertEqual(doctest.testmod(runner).failed, 0)

    def test_two_lanes_run_every_module_once_and_never_a_forbidden_pair(self):
        stages = [runner.Stage("starts_jobs", 1, ["app", "docs"], False),
                  runner.Stage("one", 1, [f"o{i}" for i in range(7)], True),
                  runner.Stage("ranks", 4, [f"r{i}" for i in range(5)], True),
                  runner.Stage("ranks", 2, ["p0"], True)]
        expected = sorted(m for stage in stages for m in stage.modules)
        schedule = runner.Schedule(stages)
        running, ran, pairs = [], [], []
        lock = threading.Lock()

        def lane():
            while (job := schedule.next_job()) is not None:
                stage, module = job
                with lock:
                    pairs.extend((stage.kind, other) for other in running)
                    running.append(stage.kind)
                while module is not None:
                    with lock:
                        ran.append(module)
                    module = schedule.take(stage) if stage.shared else None
                with lock:
                    running.remove(stage.kind)
                schedule.job_ended(stage)

        lanes = [threading.Thread(target=lane) for _ in range(runner.LANES)]
        for thread in lanes:
            thread.start()
        for thread in lanes:
            thread.join(timeout=30)
        self.assertFalse(any(thread.is_alive() for thread in lanes), "a lane is stuck")
        self.assertEqual(sorted(ran), expected)
        self.assertTrue(all(runner.may_run_beside(a, b) for a, b in pairs), pairs)

    def test_stages_come_in_lane_order_the_longest_module_first(self):
        long_one = _module("x = 1\n" * 50)
        short_one = _module("x = 1\n")
        starts = _module("STARTS_JOBS = True\n")
        # the longest module, but it fills the cores: last in its stage
        fills = _module("STARTS_JOBS = True\nFILLS_CORES = True\n" + "x = 1\n" * 80)
        own = _module("OWN_PROCESS = True\n")
        for path in (long_one, short_one, starts, fills, own):
            self.addCleanup(os.remove, path)
        plan = [(short_one, 1), (long_one, 1), (own, 4), (short_one, 4), (long_one, 2),
                (fills, 1), (starts, 1)]
        got = [(s.kind, s.size, s.modules, s.shared) for s in runner.stages(plan)]
        self.assertEqual(got, [("starts_jobs", 1, [starts, fills], False),
                               ("one", 1, [long_one, short_one], True),
                               ("ranks", 4, [short_one], True),
                               ("ranks", 4, [own], False),
                               ("ranks", 2, [long_one], True)])
        unshared = runner.stages(plan, share=False)
        self.assertFalse(any(stage.shared for stage in unshared))


class SharedJobTest(unittest.TestCase):

    def test_ranks_read_the_modules_the_runner_names_then_the_end(self):
        job_dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, job_dir)
        runner.name_next_module(job_dir, 0, "tests/test_mesh.py")
        runner.name_next_module(job_dir, 1, None)
        self.assertEqual(_rank_main.next_module(job_dir, 0), "tests/test_mesh.py")
        self.assertIsNone(_rank_main.next_module(job_dir, 1))
        self.assertEqual(sorted(os.listdir(job_dir)), ["next.0", "next.1"])


class DeclarationsTest(unittest.TestCase):

    def test_declarations_are_read_without_importing(self):
        # importing this module would fail: the runner must not import it
        path = _module("import no_such_module\nHOROVOD_NP = (2, 4)\nOWN_PROCESS = True\n")
        self.addCleanup(os.remove, path)
        self.assertEqual(runner.declared_sizes(path), (2, 4))
        self.assertTrue(runner.owns_process(path))
        self.assertEqual(runner.job_kind(path, 2), "ranks")
        self.assertEqual(runner.job_kind(path, 1), "one")
        self.assertEqual(runner.declared_timeout(path, 1), runner.SINGLE_TIMEOUT_S)
        starts = _module("import no_such_module\nSTARTS_JOBS = True\n")
        self.addCleanup(os.remove, starts)
        self.assertEqual(runner.job_kind(starts, 1), "starts_jobs")

    def test_modules_run_under_keras_2_unless_they_declare_both(self):
        both = _module("import no_such_module\nKERAS = (2, 3)\n")
        self.addCleanup(os.remove, both)
        plain = _module("import no_such_module\n")
        self.addCleanup(os.remove, plain)
        self.assertEqual(runner.declared_kerases(both), (2, 3))
        self.assertEqual(runner.declared_kerases(plain), (2,))
        self.assertEqual(runner.keras_env(2), {"TF_USE_LEGACY_KERAS": "1"})
        with self.assertRaisesRegex(ValueError, "keras=4"):
            runner.keras_env(4)


if __name__ == "__main__":
    unittest.main()
