"""The results files' provenance header names the command, commit, date and the CPU's
vector extensions (the figures of bf16 and of the op library depend on them)."""

from __future__ import annotations

import doctest
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


if __name__ == "__main__":
    unittest.main()
