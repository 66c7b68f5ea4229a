"""The app's precision choice (tfhybrid/train/precision.py): measured, said, agreed."""

import json
import os
import tempfile
import unittest

import numpy as np

from tfhybrid.train import precision
from tfhybrid.train.precision import GemmSpeed
from tests.test_train_app import COMMON_FLAGS, _cli

KERAS = (2, 3)


def _speed(float32_ms, half_ms, dtype="bfloat16"):
    return GemmSpeed(dtype, (512, 64, 64), float32_ms, half_ms)


class ChooseTest(unittest.TestCase):

    def test_a_slower_16_bit_gemm_is_said_with_its_figures(self):
        chosen, note = precision.choose("bf16", _speed(1.0, 2.0))
        self.assertEqual(chosen, "bf16")   # as asked
        self.assertIn("--mixed_precision=bf16 will be slower than float32", note)
        self.assertIn("2.00 ms in bfloat16 against 1.00 ms in float32", note)
        self.assertIn("0.50x float32's speed", note)
        self.assertIn("--communication=float16", note)
        chosen, note = precision.choose("fp16", _speed(1.0, 8.0, "float16"))
        self.assertEqual(chosen, "fp16")
        self.assertIn("0.12x", note)

    def test_a_faster_16_bit_gemm_runs_without_a_word(self):
        self.assertEqual(precision.choose("bf16", _speed(2.0, 1.0)), ("bf16", None))
        # within timing noise of float32: not called slower
        self.assertEqual(precision.choose("bf16", _speed(1.0, 1.04)), ("bf16", None))

    def test_auto_takes_bf16_only_where_it_is_faster(self):
        chosen, note = precision.choose("auto", _speed(2.0, 1.0))
        self.assertEqual(chosen, "bf16")
        self.assertIn("2.00x", note)
        for half_ms in (1.0, 2.0):   # as fast, or slower: float32
            chosen, note = precision.choose("auto", _speed(1.0, half_ms))
            self.assertEqual(chosen, "none")
            self.assertIn("--mixed_precision=auto: float32", note)

    def test_none_measures_nothing_and_bad_values_are_named(self):
        self.assertEqual(precision.choose("none", None), ("none", None))
        with self.assertRaisesRegex(ValueError, "'fp8' is unknown"):
            precision.choose("fp8", _speed(1.0, 1.0))
        with self.assertRaisesRegex(ValueError, "'bf16' needs a measured GEMM speed"):
            precision.choose("bf16", None)

    def test_measure_gemm_times_both_types(self):
        speed = precision.measure_gemm("bfloat16", 64, 32, 16, repeats=3)
        self.assertEqual((speed.dtype, speed.shape), ("bfloat16", (64, 32, 16)))
        for ms in (speed.float32_ms, speed.half_ms):
            self.assertTrue(np.isfinite(ms) and ms > 0, ms)
        self.assertAlmostEqual(speed.ratio, speed.float32_ms / speed.half_ms)
        with self.assertRaisesRegex(ValueError, "dtype='float64' must be one of"):
            precision.measure_gemm("float64", 4, 4, 4)
        with self.assertRaisesRegex(ValueError, "k=0 must be an int >= 1"):
            precision.measure_gemm("float16", 4, 0, 4)


class AppTest(unittest.TestCase):

    def test_auto_is_chosen_alike_on_every_rank_and_said(self):
        with tempfile.TemporaryDirectory() as work:
            metrics = os.path.join(work, "metrics.json")
            flags = [f for f in COMMON_FLAGS if not f.startswith("--steps")]
            done = _cli(flags + ["--steps=3", "--model_parallel=2", "--mixed_precision=auto",
                                 f"--metrics_json={metrics}"], np_=2)
            self.assertEqual(done.returncode, 0, done.stderr[-3000:])
            with open(metrics) as f:
                chosen = json.load(f)["mixed_precision"]
        # rank 0 says it once, with the figures the choice followed
        self.assertEqual(done.stderr.count("--mixed_precision=auto:"), 1, done.stderr[-3000:])
        said = "auto: bf16" if chosen == "bf16" else "auto: float32"
        self.assertIn(said, done.stderr)
        self.assertIn("GEMM took", done.stderr)
        self.assertIn(chosen, ("bf16", "none"))


if __name__ == "__main__":
    unittest.main()
