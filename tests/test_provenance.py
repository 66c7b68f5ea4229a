"""The results files' provenance header names the command, commit, date and the CPU's
vector extensions (the figures of bf16 and of the op library depend on them), and a
benchmark's quick check writes outside the published results."""

from __future__ import annotations

import doctest
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

from tfhybrid.testing import provenance


class ProvenanceTest(unittest.TestCase):

    def test_doctests(self):
        self.assertEqual(doctest.testmod(provenance).failed, 0)

    def test_avx512_with_bf16_is_named(self):
        text = provenance.cpu_description({
            "model name": "AMD EPYC 9R45", "cpu family": "26", "model": "2",
            "flags": "avx2 avx512f avx512_bf16 avx512_vnni"})
        self.assertIn("AVX-512, AVX-512 BF16, AVX-512 VNNI", text)
        self.assertNotIn("no AVX-512", text)
        self.assertNotIn("AMX", text)

    def test_the_machine_running_the_test_is_described(self):
        lines = provenance.header(["benchmarks/x.py"])
        self.assertRegex(lines[1], r"^# commit: [0-9a-f]{7}")
        self.assertRegex(lines[3], r"^# CPU: .+, (no )?AVX2.*, \d+ logical cores$")
        self.assertEqual(len(lines), 4)

    def test_rewritten_results_do_not_make_the_code_dirty(self):
        repo = tempfile.mkdtemp(prefix="tfhybrid-provenance-git-")
        self.addCleanup(shutil.rmtree, repo, True)
        results = os.path.join(repo, provenance.RESULTS_DIR)
        page = os.path.join(repo, provenance.RENDERED_PAGE)
        os.makedirs(results)
        os.makedirs(os.path.dirname(page))

        def git(*args):
            subprocess.run(["git", "-C", repo, "-c", "user.name=t", "-c", "user.email=t@t",
                            *args], check=True, capture_output=True)
        for path in ("code.py", os.path.join(results, "table.txt"), page):
            with open(os.path.join(repo, path), "w") as f:
                f.write("1\n")
        git("init", "-q")
        git("add", ".")
        git("commit", "-q", "-m", "x")
        clean = provenance.commit(repo)
        self.assertRegex(clean, r"^[0-9a-f]{7,}$")
        with open(os.path.join(results, "table.txt"), "w") as f:
            f.write("2\n")   # a benchmark rewrote its results: the code is the commit's
        self.assertEqual(provenance.commit(repo), clean)
        with open(page, "w") as f:
            f.write("2\n")   # and the page was rendered from them
        self.assertEqual(provenance.commit(repo), clean)
        with open(os.path.join(repo, "code.py"), "w") as f:
            f.write("2\n")
        self.assertEqual(provenance.commit(repo), clean + "-dirty")

    def test_the_load_of_other_work_is_measured(self):
        # a child process keeps one core busy: other work, as this process sees it
        load = provenance.OtherLoad()
        busy = subprocess.Popen([sys.executable, "-c",
                                 "import time\nend = time.time() + 1.5\n"
                                 "while time.time() < end: pass"])
        self.addCleanup(busy.kill)
        time.sleep(1.5)
        busy_cores = load.cores()
        busy.wait()
        self.assertGreater(busy_cores, 0.5)
        line = provenance.header(["benchmarks/x.py"], load=load)[4]
        self.assertRegex(line, r"^# other load: \d+\.\d\d of \d+ cores \(mean over the run\)$")


def _load_results_helper():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks", "_results.py")
    spec = importlib.util.spec_from_file_location("_results", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ResultsFolderTest(unittest.TestCase):

    def test_quick_runs_never_write_into_the_published_results(self):
        results = _load_results_helper()
        self.assertEqual(doctest.testmod(results).failed, 0)
        quick = results.out_dir("tiered_mesh", quick=True)
        self.addCleanup(shutil.rmtree, quick, True)
        self.assertTrue(os.path.isdir(quick))
        self.assertNotEqual(os.path.commonpath([quick, results.RESULTS]), results.RESULTS)
        self.assertEqual(results.out_dir("tiered_mesh", quick=False),
                         os.path.join(results.RESULTS, "tiered_mesh"))
        self.assertEqual(results.out_dir("tiered_mesh", quick=True, given="/x"), "/x")

    def test_json_and_png_results_carry_the_header(self):
        results = _load_results_helper()
        folder = tempfile.mkdtemp(prefix="tfhybrid-provenance-")
        self.addCleanup(shutil.rmtree, folder, True)
        load = provenance.OtherLoad()
        results.write_json(os.path.join(folder, "points.json"), {"points": [1.5]}, load)
        with open(os.path.join(folder, "points.json")) as f:
            written = json.load(f)
        self.assertEqual(written["points"], [1.5])
        self.assertEqual(sorted(written["provenance"]),
                         ["CPU", "command", "commit", "date", "other load"])
        self.assertRegex(written["provenance"]["commit"], r"^[0-9a-f]{7}")
        # a run whose work is outside this process tree says so instead of a figure
        results.write_json(os.path.join(folder, "cluster.json"), {}, None)
        with open(os.path.join(folder, "cluster.json")) as f:
            self.assertIn("not measured", json.load(f)["provenance"]["other load"])

        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from PIL import Image
        figure = plt.figure(figsize=(1, 1))
        results.save_figure(figure, os.path.join(folder, "plot.png"), load)
        plt.close(figure)
        chunks = Image.open(os.path.join(folder, "plot.png")).text
        self.assertEqual(chunks["Commit"], written["provenance"]["commit"])
        self.assertEqual(chunks["Command"], written["provenance"]["command"])
        self.assertIn("cores", chunks["Other load"])


if __name__ == "__main__":
    unittest.main()
