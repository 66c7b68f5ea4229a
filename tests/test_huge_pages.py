"""Tests that the kernels move a large table's buffer to transparent huge pages when they
first touch it (cc/kernels/huge_pages.h), unchanged in content, and that
TFHYBRID_HUGE_PAGES=0 leaves it in small pages.

Each case runs in a fresh process that keeps every buffer alive and measures how the
process's memory in huge pages grows while one kernel call runs: within one test process
a new buffer may land in memory that an earlier one left advised.

Run: python -m tests.test_huge_pages
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import tensorflow as tf  # noqa: E402

DISABLED = os.environ.get("TFHYBRID_DISABLE_CUSTOM_OPS", "").strip().lower() in ("1", "true", "yes")

# Prints, for a lookup and for a row-wise AdaGrad step, how much the process's memory in
# huge pages grew while the kernel ran, and whether the values are as expected (unchanged
# by the lookup; only row 0 changed by the step).
_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    sys.path.insert(0, {repo!r})
    from tfhybrid import custom_ops as co

    def huge_bytes():   # the whole process's; nothing else allocates during a call
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no AnonHugePages in smaps_rollup")

    def table(mib):   # over glibc's 32 MiB mmap threshold: a mapping of its own
        rng = np.random.default_rng(mib)
        return tf.Variable(rng.random([(mib << 20) // 1024, 256], np.float32))

    result = {{}}
    lookup = table(36)
    before = lookup.numpy()
    ids = tf.constant(np.arange(0, lookup.shape[0], 97).reshape(-1, 1))
    start = huge_bytes()
    out = co.embedding_lookup_combine(lookup, ids, "sum", use_custom_op=True)
    result["lookup_grew"] = huge_bytes() - start
    result["lookup_values_kept"] = bool(np.array_equal(lookup.numpy(), before)
                                        and np.array_equal(out.numpy(), before[ids[:, 0]]))
    result["bytes"] = [before.nbytes]
    step = table(40)
    before = step.numpy()
    accumulator = tf.Variable(tf.zeros([step.shape[0]]))
    grad = tf.ones([1, 256])
    start = huge_bytes()
    co.rowwise_adagrad_apply(step, accumulator, [0], grad, 0.1, 1e-8, use_custom_op=True)
    result["step_grew"] = huge_bytes() - start
    after = step.numpy()
    result["step_values_kept"] = bool(np.array_equal(after[1:], before[1:])
                                      and not np.array_equal(after[0], before[0]))
    result["bytes"].append(after.nbytes)
    print("RESULT " + json.dumps(result))
""")


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


def _run(**env) -> dict:
    done = subprocess.run([sys.executable, "-c", _SCRIPT.format(repo=str(_REPO))],
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env),
                          capture_output=True, text=True, timeout=300)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise AssertionError(f"the script failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


class HugePagesTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        if DISABLED:
            self.skipTest("custom ops disabled (TFHYBRID_DISABLE_CUSTOM_OPS=1)")
        if _thp_mode() != "madvise":
            # "always": every buffer starts in huge pages; "never": none can
            self.skipTest(f"transparent huge pages are '{_thp_mode()}' here; the test "
                          "needs 'madvise' to see what the kernels do")

    def test_kernels_move_large_tables_to_huge_pages(self):
        result = _run()
        lookup_bytes, step_bytes = result["bytes"]
        # at least the buffers' 2 MiB-aligned interiors
        self.assertGreaterEqual(result["lookup_grew"], lookup_bytes - (4 << 20))
        self.assertGreaterEqual(result["step_grew"], step_bytes - (4 << 20))
        self.assertTrue(result["lookup_values_kept"])
        self.assertTrue(result["step_values_kept"])

    def test_switched_off_by_the_environment(self):
        result = _run(TFHYBRID_HUGE_PAGES="0")
        self.assertLess(result["lookup_grew"], 2 << 20)
        self.assertLess(result["step_grew"], 2 << 20)
        self.assertTrue(result["lookup_values_kept"])
        self.assertTrue(result["step_values_kept"])


if __name__ == "__main__":
    tf.test.main()
