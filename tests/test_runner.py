"""The test runner's own rules: how it deals one-process modules into shared processes
and reads a module's declarations without importing it."""

import doctest
import os
import tempfile
import unittest

from tests import runner


class DealTest(unittest.TestCase):

    def test_docstring_examples(self):
        self.assertEqual(doctest.testmod(runner).failed, 0)

    def test_every_module_runs_once_and_no_process_is_empty(self):
        paths = [f"m{i}" for i in range(11)]
        size = {p: (i * 7) % 5 + 1 for i, p in enumerate(paths)}.get
        for count in (1, 3, 8, 20):
            dealt = runner.deal(paths, count, size=size)
            self.assertEqual(sorted(p for chosen in dealt for p in chosen), sorted(paths))
            self.assertEqual(len(dealt), min(count, len(paths)))
            self.assertTrue(all(dealt))
            # each process keeps the suite's order
            self.assertTrue(all(chosen == sorted(chosen, key=paths.index)
                                for chosen in dealt))

    def test_the_largest_modules_go_to_different_processes(self):
        dealt = runner.deal(["big1", "big2", "a", "b"], 2,
                            size={"big1": 10, "big2": 10, "a": 1, "b": 1}.get)
        self.assertEqual(sorted(map(sorted, dealt)), [["a", "big1"], ["b", "big2"]])


class DeclarationsTest(unittest.TestCase):

    def test_declarations_are_read_without_importing(self):
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            # importing this module would fail: the runner must not import it
            f.write("import no_such_module\nHOROVOD_NP = (2, 4)\nOWN_PROCESS = True\n")
        self.addCleanup(os.remove, f.name)
        self.assertEqual(runner.declared_sizes(f.name), (2, 4))
        self.assertTrue(runner.owns_process(f.name))
        self.assertTrue(runner.runs_alone(f.name, 2))
        self.assertFalse(runner.runs_alone(f.name, 1))
        self.assertEqual(runner.declared_timeout(f.name, 1), runner.SINGLE_TIMEOUT_S)


if __name__ == "__main__":
    unittest.main()
