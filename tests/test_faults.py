"""Faults end a multi-rank training job instead of hanging it, and leave a checkpoint that restores.

Runs `python -m tfhybrid.train` under `horovodrun -np 2` (a 1 x 2 mesh of a tiny DLRM) with
the test-only faults of `tfhybrid.testing.faults` (through the app's extension point)
and small stall limits, and checks that every rank exits non-zero, that the output names
the cause, and that the job ended within the stall shutdown limit of the fault plus a
margin (a "did not hang" bound, not a speed target). The module runs in one plain process
(no HOROVOD_NP): each test starts its own horovodrun.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

import tensorflow as tf

from tests.runner import TEST_ENV
from tfhybrid import mesh as mesh_lib
from tfhybrid.testing import faults
from tfhybrid.train import app as train_app
from tfhybrid.train import checkpoint

# it starts multi-process jobs of its own: tests/runner.py runs it beside one-process
# modules only
STARTS_JOBS = True

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
HOROVODRUN = os.path.join(os.path.dirname(PYTHON), "horovodrun")
RANKS = 2

STALL_CHECK_S, STALL_SHUTDOWN_S = 5, 20
STALL_FLAGS = [f"--stall_check_seconds={STALL_CHECK_S}",
               f"--stall_shutdown_seconds={STALL_SHUTDOWN_S}"]
# a job must end within this many seconds of its fault: it did not hang
ENDS_WITHIN_S = STALL_SHUTDOWN_S + 60
# hard cap of one horovodrun, start-up included, so that nothing can hang the suite
LAUNCH_TIMEOUT_S = 300
TINY = ["--model=dlrm", "--dataset=synthetic", "--batch_size=128", "--eval_batches=2",
        "--embedding_dim=4", "--bottom_mlp_dims=8,4", "--top_mlp_dims=8,1",
        "--max_table_rows=2000", "--warmup_steps=0", "--learning_rate=0.1"]

# horovodrun --prefix-output-with-timestamp starts every line with time.asctime()
_STAMPED = re.compile(r"(\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4})\[(\d+)\]<std\w+>:")


def _horovodrun(flags, env=None, timeout=LAUNCH_TIMEOUT_S):
    """Runs the app on RANKS ranks; returns (exit code, output, end time)."""
    full_env = {**os.environ, **TEST_ENV, **(env or {})}
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    # horovodrun's own "Process N exit with status code" lines must not sit in a buffer
    full_env["PYTHONUNBUFFERED"] = "1"
    command = [HOROVODRUN, "-np", str(RANKS), "-H", f"localhost:{RANKS}", "--gloo",
               "--start-timeout", "60", "--prefix-output-with-timestamp",
               PYTHON, "-m", "tfhybrid.train"] + flags
    proc = subprocess.Popen(command, env=full_env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # horovodrun terminates its ranks on SIGTERM; SIGKILL if it does not end
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        raise AssertionError(f"horovodrun did not end within {timeout} s:\n{output[-6000:]}")
    return proc.returncode, output, time.time()


def _rank_exit_codes(output):
    """{rank: status} of the ranks that exited non-zero, as horovodrun reports them."""
    return {int(rank): int(code) for rank, code in
            re.findall(r"Process (\d+) exit with status code (-?\d+)", output)}


def _first_stamp(output, text):
    """Time (epoch s) horovodrun stamped on the first output line that contains ``text``."""
    # a progress bar ends its lines with \r; horovodrun stamps those pieces too
    for piece in re.split(r"[\r\n]", output):
        if text in piece:
            stamp = _STAMPED.match(piece)
            if stamp:
                return time.mktime(time.strptime(stamp.group(1)))
    raise AssertionError(f"no stamped output line contains {text!r}:\n{output[-6000:]}")


def _tensors(prefix):
    """A checkpoint's values by key (reading them checks their checksums); its object
    graph and save counter aside."""
    reader = tf.train.load_checkpoint(prefix)
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
            if key not in ("_CHECKPOINTABLE_OBJECT_GRAPH",
                           "save_counter/.ATTRIBUTES/VARIABLE_VALUE")}


class FaultTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.work = tempfile.mkdtemp(prefix="tfhybrid-faults-")
        self.addCleanup(shutil.rmtree, self.work, ignore_errors=True)

    def assertJobFailed(self, code, output, end, cause, fault_line):
        """Every rank ended without success, the output names ``cause``, and the job
        ended within ENDS_WITHIN_S of the first line containing ``fault_line``.

        A rank ends either with its own non-zero exit or, when another rank failed
        first, by horovodrun's "Terminating remaining workers"; which of the two comes
        first is a race, and horovodrun does not report the exit of a rank it ended.
        """
        tail = output[-6000:]
        self.assertNotEqual(code, 0, tail)
        exits = _rank_exit_codes(output)
        self.assertTrue(exits, tail)
        self.assertNotIn(0, exits.values(), tail)
        terminated = re.search(r"Terminating remaining workers after failure of "
                               r"Process (\d+)", output)
        if sorted(exits) != list(range(RANKS)):
            self.assertIsNotNone(terminated, tail)
            self.assertIn(int(terminated.group(1)), exits, tail)
        # no rank finished training: none printed the final results line
        self.assertNotIn("eval: AUC", output, tail)
        self.assertIn(cause, output, tail)
        ended_after = end - _first_stamp(output, fault_line)
        print(f"{cause!r}: the job ended {ended_after:.0f} s after {fault_line!r}")
        self.assertLess(ended_after, ENDS_WITHIN_S, tail)

    def test_input_that_runs_out_on_one_rank_fails_every_rank(self):
        # fit's step count is --steps on every rank, so ConsistentSteps cannot see that
        # rank 1's input holds only 4 batches; without the app's check rank 1 would leave
        # fit early and rank 0 would wait for it in step 5's collectives
        code, output, end = _horovodrun(TINY + STALL_FLAGS + ["--steps=12", "--nopipeline"],
                                        env=faults.short_input_env(1, 4))
        self.assertJobFailed(code, output, end,
                             "rank 1: the training input ran out after 4 of 12 steps",
                             fault_line="Your input ran out of data")

    def test_pipelined_input_that_runs_out_on_one_rank_fails_every_rank(self):
        # the pipeline reads a batch ahead, so its ranks find out together, one step early
        code, output, end = _horovodrun(TINY + STALL_FLAGS + ["--steps=12"],
                                        env=faults.short_input_env(1, 4))
        cause = ("TrainPipeline: the input of ranks [1] ended while the other ranks had "
                 "another batch")
        self.assertJobFailed(code, output, end, cause, fault_line=cause)

    def test_rank_that_hangs_is_ended_by_the_stall_shutdown(self):
        # rank 1 blocks after step 6 without raising: nothing but the stall shutdown can
        # end the job, and its limit is the flag's, not the variable the user had set
        users_limit = str(STALL_SHUTDOWN_S * 10)
        code, output, end = _horovodrun(TINY + STALL_FLAGS + ["--steps=12"],
                                        env={**faults.fault_env(1, 6, hang=True),
                                             mesh_lib.STALL_SHUTDOWN_ENV: users_limit})
        self.assertIn(f"--stall_shutdown_seconds={STALL_SHUTDOWN_S} replaces "
                      f"{mesh_lib.STALL_SHUTDOWN_ENV}={users_limit}", output)
        self.assertJobFailed(code, output, end,
                             f"since step 6, beyond the stall shutdown limit of "
                             f"{STALL_SHUTDOWN_S} s",
                             fault_line="rank 1 hangs after step 6")
        # rank 0 was the one waiting in a collective: its error says why it failed
        self.assertIn("rank 0: Horovod shut down while this rank waited in a collective",
                      output)

    def test_rank_that_raises_ends_the_job_and_the_last_checkpoint_restores(self):
        ckpt = os.path.join(self.work, "ckpt")
        code, output, end = _horovodrun(
            TINY + STALL_FLAGS + ["--steps=16", f"--checkpoint_dir={ckpt}",
                                  "--checkpoint_every=5"],
            env=faults.fault_env(1, 12))
        self.assertJobFailed(code, output, end, "fault injected on rank 1 after step 12",
                             fault_line="rank 1 raises after step 12")

        # the saves of steps 5 and 10 are complete; nothing after the fault was written
        self.assertEqual(sorted(n for n in os.listdir(ckpt) if n.endswith(".index")),
                         ["ckpt-10.index", "ckpt-5.index"])
        self.assertEqual([n for n in os.listdir(ckpt) if "_temp" in n], [])
        latest = checkpoint.latest(ckpt)
        self.assertEqual(os.path.basename(latest), "ckpt-10")
        saved = _tensors(latest)

        # --restore --steps=0 loads it on the same mesh, evaluates, and saves step 10
        # again: the same values come out, so every table and slot was restored exactly
        metrics = os.path.join(self.work, "restored.json")
        code, output, _ = _horovodrun(TINY + ["--steps=0", "--restore",
                                              f"--checkpoint_dir={ckpt}",
                                              f"--metrics_json={metrics}"])
        self.assertEqual(code, 0, output[-6000:])
        with open(metrics) as f:
            restored = json.load(f)
        self.assertEqual(restored["steps"], 10)
        self.assertEqual(restored["eval_samples"], 256)
        resaved = _tensors(os.path.join(ckpt, "ckpt-10"))
        self.assertEqual(sorted(resaved), sorted(saved))
        for key, value in saved.items():
            self.assertAllEqual(resaved[key], value, msg=key)


class StallSettingsTest(tf.test.TestCase):
    """How the flags, the environment and tfhybrid's defaults combine (no Horovod job)."""

    CHECK, SHUTDOWN = mesh_lib.STALL_CHECK_ENV, mesh_lib.STALL_SHUTDOWN_ENV

    def _limits(self, environ, **flags):
        settings = train_app.stall_settings(train_app.TrainConfig(**flags), environ)
        return {name: seconds for name, (seconds, _) in settings.items()}

    def test_flag_beats_environment_beats_default(self):
        self.assertEqual(self._limits({}), mesh_lib.STALL_DEFAULTS)
        self.assertEqual(self._limits({self.CHECK: "7", self.SHUTDOWN: "70"}),
                         {self.CHECK: 7, self.SHUTDOWN: 70})
        self.assertEqual(self._limits({self.CHECK: "7", self.SHUTDOWN: "70"},
                                      stall_shutdown_seconds=30),
                         {self.CHECK: 7, self.SHUTDOWN: 30})

    def test_bad_values_name_themselves(self):
        for flags, message in [(dict(stall_check_seconds=0), "--stall_check_seconds=0"),
                               (dict(stall_shutdown_seconds=-5),
                                "--stall_shutdown_seconds=-5"),
                               (dict(stall_check_seconds=30, stall_shutdown_seconds=10),
                                "--stall_shutdown_seconds=10 is below "
                                "--stall_check_seconds=30")]:
            with self.assertRaisesRegex(ValueError, message):
                train_app.TrainConfig(**flags).validate()
        with self.assertRaisesRegex(ValueError, f"{self.SHUTDOWN}='soon'"):
            self._limits({self.SHUTDOWN: "soon"})
        # a shutdown flag below the default check interval could never fire
        with self.assertRaisesRegex(ValueError, f"--stall_shutdown_seconds=20 is below "
                                                f"tfhybrid's default {self.CHECK}=60"):
            self._limits({}, stall_shutdown_seconds=20)
        with self.assertRaisesRegex(ValueError, "HOROVOD_STALL_CHECK_DISABLE=1"):
            self._limits({"HOROVOD_STALL_CHECK_DISABLE": "1"}, stall_check_seconds=5)

    def test_flags_reach_the_environment_before_horovod_starts(self):
        import horovod.tensorflow as hvd
        self.assertFalse(hvd.is_initialized(), "the test needs a process without Horovod")
        config = train_app.TrainConfig(stall_check_seconds=5, stall_shutdown_seconds=20)
        with mock.patch.dict(os.environ, {self.SHUTDOWN: "45"}):
            os.environ.pop(self.CHECK, None)
            limits, notes = train_app.apply_stall_settings(config)
            self.assertEqual(os.environ[self.CHECK], "5")
            self.assertEqual(os.environ[self.SHUTDOWN], "20")
        self.assertEqual(limits, {self.CHECK: 5, self.SHUTDOWN: 20})
        # the flag replaced the user's variable, and says so
        self.assertEqual(notes, [f"--stall_shutdown_seconds=20 replaces {self.SHUTDOWN}=45 "
                                 "from the environment"])

    def test_test_hooks_name_a_malformed_value(self):
        with mock.patch.dict(os.environ, {faults.FAULT_ENV: "1:x"}):
            with self.assertRaisesRegex(ValueError, "TFHYBRID_TEST_FAIL_AT_STEP='1:x'"):
                faults.hook(faults.FAULT_ENV, 1, modes=("hang",))
        with mock.patch.dict(os.environ, {faults.FAULT_ENV: "1:3:hang"}):
            self.assertEqual(faults.hook(faults.FAULT_ENV, 1, ("hang",)), (3, "hang"))
            self.assertIsNone(faults.hook(faults.FAULT_ENV, 0, ("hang",)))
        self.assertEqual(faults.fault_env(1, 3, hang=True),
                         {faults.FAULT_ENV: "1:3:hang",
                          train_app.EXTENSIONS_ENV: "tfhybrid.testing.faults"})


if __name__ == "__main__":
    unittest.main()
