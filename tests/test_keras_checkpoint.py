"""Keras' own checkpoints of sharded tables: fit on 2x2, killed mid-save, resumed on 1x4.

Two 4-rank jobs (``python -m tests.test_keras_checkpoint child-2x2|child-1x4 <dir>``
under horovodrun), started from this one plain process, as ``tests/test_faults.py`` does:

1. **2x2**: an uninterrupted ``fit`` with ``ModelCheckpoint`` on every rank (the
   reference); then the same ``fit`` with ``BackupAndRestore`` and ``ModelCheckpoint`` on
   every rank, paused in the middle of its backup at the end of epoch 3 (each rank has
   written its part, nothing is committed) and killed there: SIGKILL to every process.
2. **1x4**: the same ``fit`` with the same callbacks resumes from epoch 2's backup on the
   new plan (row-sliced table re-cut from 2 to 4 slices, optimizer slots with it); and
   ``load_weights`` of the reference's last ``ModelCheckpoint`` file.

The resumed run must end with the reference's weights (1e-6), the loaded weights must
equal them exactly, and the killed save must have left epoch 2's backup the latest.
Row-wise AdaGrad applies the tables and Adam the dense layers, so the state of both
optimizers has to follow the tables onto the new mesh.

A third, 2-rank job adds ``ModelCheckpoint`` on rank 0 only, the usual Horovod habit:
rank 0 must fail with an error that says what to do, and the job must end, not hang.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from unittest import mock

import numpy as np
import tensorflow as tf

import tfhybrid
from tests.runner import TEST_ENV

KERAS_3 = tfhybrid.keras_major() == 3

# it starts multi-process jobs of its own: tests/runner.py runs it beside one-process
# modules only
STARTS_JOBS = True
# its kill-and-resume jobs took 247 s alone on TF 2.15 here, and past 480 s beside
# other jobs
RUN_TIMEOUT_S = 900
KERAS = (2, 3)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
RANKS = 4
# rows: row-wise (2 slices on 2x2, 4 on 1x4), mid: table-wise, tiny: data-parallel; no
# table is column-sliced, so row-wise AdaGrad steps alike on both meshes
TABLES = [("rows", 256, 4), ("mid", 60, 4), ("tiny", 16, 2)]
THRESHOLDS = dict(data_parallel_threshold=100, row_slice_threshold=500)
HOTNESS = 2
LOCAL_BATCH = 4
STEPS_PER_EPOCH = 2
EPOCHS = 4
# the 2x2 job's saves: the reference's ModelCheckpoint (one per epoch), then per epoch
# the BackupAndRestore backup and the ModelCheckpoint; this one is epoch 3's backup
PAUSED_SAVE = EPOCHS + 2 * 2 + 1
JOB_TIMEOUT_S = 400
# Keras 3 writes weights only to ".weights.h5" files (one per save, written by rank 0);
# Keras 2 to TF checkpoints (an index and a data file per writing rank)
WEIGHTS_SUFFIX = ".weights.h5" if KERAS_3 else ""


# ------------------------------------------------------- the jobs' side
def _build(mesh):
    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding, Embedding
    from tfhybrid.optimizers import RowWiseAdagrad

    ids = [tf.keras.Input([HOTNESS], dtype=tf.int64, name=f"{name}_ids")
           for name, *_ in TABLES]
    layer = DistributedEmbedding(
        [Embedding(rows, dim, combiner="sum", name=name) for name, rows, dim in TABLES],
        mesh=mesh, **THRESHOLDS)
    hidden = tf.keras.layers.Dense(8, activation="relu")(
        tf.keras.layers.Concatenate(axis=1)(layer(ids)))
    model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(hidden))
    # the same start on every rank and mesh
    rng = np.random.default_rng(0)
    layer.set_weights([rng.normal(0, 0.1, [rows, dim]).astype(np.float32)
                       for _, rows, dim in TABLES])
    for dense in model.layers[-2:]:
        dense.set_weights([rng.normal(0, 0.3, w.shape).astype(np.float32)
                           for w in dense.get_weights()])
    model.compile(
        optimizer=tfhybrid.DistributedOptimizer(
            tf.keras.optimizers.Adam(0.01), mesh=mesh,
            embedding_optimizer=RowWiseAdagrad(0.05)),
        loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    return model, layer


def _fit(model, rank: int, callbacks: list) -> None:
    """This rank's samples of every global batch; every epoch sees the same batches."""
    rng = np.random.default_rng(1)
    n = STEPS_PER_EPOCH * LOCAL_BATCH * RANKS
    ids = [rng.integers(0, rows, size=[n, HOTNESS]) for _, rows, _ in TABLES]
    labels = rng.integers(0, 2, size=[n, 1]).astype(np.float32)
    model.fit([x[rank::RANKS] for x in ids], labels[rank::RANKS], batch_size=LOCAL_BATCH,
              epochs=EPOCHS, shuffle=False, callbacks=callbacks, verbose=0)


def _save_snapshot(model, layer, rank: int, path: str) -> None:
    """Full tables, dense weights and both optimizers' step counts, written by rank 0."""
    tables = layer.get_weights(all_ranks=True)    # a collective: every rank calls it
    if rank == 0:
        optimizer = model.optimizer
        np.savez(path, *tables, *[w for d in model.layers[-2:] for w in d.get_weights()],
                 iterations=[int(optimizer.iterations.numpy()),
                             int(optimizer.embedding_optimizer.iterations.numpy())])


def _callbacks(directory: str) -> list:
    return [tf.keras.callbacks.BackupAndRestore(os.path.join(directory, "backup")),
            tf.keras.callbacks.ModelCheckpoint(
                os.path.join(directory, "weights-{epoch:02d}" + WEIGHTS_SUFFIX),
                save_weights_only=True)]


def _job_main(mode: str, directory: str) -> int:
    import tfhybrid
    from tfhybrid.testing import faults

    faults.install_from_env()   # the parent's pause of a save, if it asks for one
    mesh = tfhybrid.init(model_parallel=4 if mode == "child-1x4" else 2)
    reference = os.path.join(directory, "reference")
    if mode == "child-rank0-only":
        # the Horovod habit: checkpoints from rank 0 only
        model, _ = _build(mesh)
        _fit(model, mesh.rank, [tf.keras.callbacks.ModelCheckpoint(
            os.path.join(directory, "weights-{epoch:02d}" + WEIGHTS_SUFFIX),
            save_weights_only=True)] if mesh.rank == 0 else [])
        return 0
    if mode == "child-2x2":
        model, layer = _build(mesh)
        _fit(model, mesh.rank, [tf.keras.callbacks.ModelCheckpoint(
            os.path.join(reference, "weights-{epoch:02d}" + WEIGHTS_SUFFIX),
            save_weights_only=True)])
        _save_snapshot(model, layer, mesh.rank, os.path.join(directory, "reference.npz"))
        model, layer = _build(mesh)
        _fit(model, mesh.rank, _callbacks(directory))     # paused and killed in epoch 3
        return 1
    model, layer = _build(mesh)
    _fit(model, mesh.rank, _callbacks(directory))
    _save_snapshot(model, layer, mesh.rank, os.path.join(directory, "resumed.npz"))
    model, layer = _build(mesh)
    model.load_weights(os.path.join(reference, f"weights-{EPOCHS:02d}{WEIGHTS_SUFFIX}"))
    _save_snapshot(model, layer, mesh.rank, os.path.join(directory, "loaded.npz"))
    return 0


# ------------------------------------------------------- the test's side
def _die_with_parent() -> None:
    """In the child: SIGKILL when this test process dies (the runner kills a module that
    overruns), so no job outlives its test."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def _kill_job(pid: int) -> None:
    """SIGKILL to horovodrun and every process under it (the ranks run under helpers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start(mode: str, directory: str, env: dict, ranks: int = RANKS
           ) -> tuple[subprocess.Popen, str]:
    full_env = {**os.environ, **TEST_ENV, **env}
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    log = os.path.join(directory, f"{mode}.log")
    command = [HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
               "--start-timeout", "60", sys.executable, "-m", "tests.test_keras_checkpoint",
               mode, directory]
    job = subprocess.Popen(command, env=full_env, cwd=ROOT, preexec_fn=_die_with_parent,
                           stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return job, log


def _tail(path: str) -> str:
    return open(path, errors="replace").read()[-5000:]


def _load(path: str) -> dict:
    data = np.load(path)
    arrays = [data[f"arr_{i}"] for i in range(len(data.files) - 1)]
    return {"tables": arrays[:len(TABLES)], "dense": arrays[len(TABLES):],
            "iterations": data["iterations"].tolist()}


class KillAndResumeTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.directory = tempfile.mkdtemp(prefix="tfhybrid-keras-ckpt-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def assertSnapshotClose(self, got, want, tolerance, what):
        self.assertEqual(got["iterations"], [EPOCHS * STEPS_PER_EPOCH] * 2, what)
        self.assertEqual(want["iterations"], [EPOCHS * STEPS_PER_EPOCH] * 2, what)
        for (name, *_), a, b in zip(TABLES, got["tables"], want["tables"]):
            self.assertAllClose(a, b, atol=tolerance, rtol=tolerance, msg=f"{what}: {name}")
        self.assertLen(got["dense"], 4)
        for a, b in zip(got["dense"], want["dense"]):
            self.assertAllClose(a, b, atol=tolerance, rtol=tolerance, msg=f"{what}: dense")

    def test_fit_killed_mid_save_resumes_on_1x4_like_the_uninterrupted_run(self):
        from tfhybrid.testing import faults
        backup = os.path.join(self.directory, "backup")
        # Keras 2 backs up into TF checkpoints under "chief"; Keras 3 into one weights
        # file and a note of the epoch. A part of a save under way: Keras 2's parts are in
        # a temporary folder per save; every rank writes Keras 3's file under a temporary
        # name, and rank 0's is moved into place
        chief = os.path.join(backup, "chief")
        if KERAS_3:
            # the backup's temporary names carry no epoch: epoch 3's are those written
            # after epoch 2's ModelCheckpoint file
            parts_under_way, parts_expected = (
                os.path.join(backup, ".tfhybrid-rank*-latest.weights.h5"), RANKS)
            epoch_2 = os.path.join(self.directory, "weights-02" + WEIGHTS_SUFFIX)
        else:
            # ranks 0 and 1 (replica 0) write parts; ranks 2 and 3 hold copies only
            parts_under_way, parts_expected = (
                os.path.join(chief, "ckpt-3_temp-*", "part-*.index"), 2)
            epoch_2 = self.directory

        # 1. 2x2: every rank pauses after writing its part of epoch 3's backup; kill all
        job, log = _start("child-2x2", self.directory,
                          faults.pause_save_env(PAUSED_SAVE, 600))
        deadline, parts = time.time() + JOB_TIMEOUT_S, []
        try:
            while len(parts) < parts_expected and time.time() < deadline and job.poll() is None:
                parts = glob.glob(parts_under_way) if os.path.exists(epoch_2) else []
                time.sleep(0.05)
        finally:
            if job.poll() is None:
                _kill_job(job.pid)
            job.wait()
        self.assertLen(parts, parts_expected, _tail(log))
        reference = _load(os.path.join(self.directory, "reference.npz"))
        # the killed save changed nothing: epoch 2's backup is the latest, and complete
        if KERAS_3:
            with open(os.path.join(backup, "training_metadata.json")) as f:
                self.assertEqual(json.load(f)["epoch"], 2)
            self.assertTrue(os.path.exists(os.path.join(backup, "latest.weights.h5")))
        else:
            self.assertEqual(tf.train.latest_checkpoint(chief), os.path.join(chief, "ckpt-2"))
            self.assertEqual(glob.glob(os.path.join(chief, "ckpt-3.*")), [])
        written = ["weights-01", "weights-02"]
        if KERAS_3:
            self.assertEqual(sorted(os.path.basename(p) for p in glob.glob(
                os.path.join(self.directory, "weights-*"))), [w + WEIGHTS_SUFFIX for w in written])
            # ModelCheckpoint on every rank wrote one file per epoch, nothing else
            self.assertEqual(sorted(os.listdir(os.path.join(self.directory, "reference"))),
                             [f"weights-{e:02d}{WEIGHTS_SUFFIX}" for e in range(1, EPOCHS + 1)])
        else:
            self.assertEqual(sorted(os.path.basename(p) for p in glob.glob(
                os.path.join(self.directory, "weights-*.index"))), [w + ".index" for w in written])
            # ModelCheckpoint on every rank wrote one checkpoint: an index, a data file per
            # writing rank, nothing left of the parts
            self.assertEqual(sorted(os.listdir(os.path.join(self.directory, "reference"))),
                             ["checkpoint"] + [f"weights-{e:02d}.{suffix}"
                                               for e in range(1, EPOCHS + 1)
                                               for suffix in ("data-00000-of-00002",
                                                              "data-00001-of-00002", "index")])

        # 2. 1x4: BackupAndRestore resumes at epoch 3; load_weights of the reference
        job, log = _start("child-1x4", self.directory, {})
        try:
            code = job.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_job(job.pid)
            job.wait()
            code = "timeout"
        self.assertEqual(code, 0, _tail(log))
        self.assertSnapshotClose(_load(os.path.join(self.directory, "resumed.npz")),
                                 reference, 1e-6, "resumed on 1x4")
        self.assertSnapshotClose(_load(os.path.join(self.directory, "loaded.npz")),
                                 reference, 0.0, "load_weights on 1x4")
        # a finished fit deletes its backup; the resumed epochs were checkpointed
        self.assertFalse(os.path.exists(chief))
        self.assertFalse(glob.glob(os.path.join(backup, "*")))
        self.assertTrue(glob.glob(os.path.join(self.directory, "weights-04*")))


class SharedFolderTest(tf.test.TestCase):
    """ModelCheckpoint and BackupAndRestore, on every rank, each check that their folder
    is missing and then create it; another rank can create it in between. The rank that
    loses that race must go on, or the others wait for it in the save's collectives."""

    def test_a_folder_made_by_another_rank_after_the_check_is_used(self):
        from tfhybrid.layers import DistributedEmbedding, Embedding
        ids = tf.keras.Input([HOTNESS], dtype=tf.int64)
        layer = DistributedEmbedding([Embedding(16, 2, combiner="sum", name="t")])
        model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(layer([ids])[0]))
        model.compile(optimizer="sgd", loss="mse")
        folder = os.path.join(self.get_temp_dir(), "made-by-another-rank")
        os.makedirs(folder)
        if KERAS_3:
            from keras.src.utils import file_utils as checks
        else:
            # the gfile module tf-keras' callbacks call (its own tensorflow.compat.v2)
            checks = sys.modules[tf.keras.callbacks.ModelCheckpoint.__module__].tf.io.gfile
        real_exists, asked = checks.exists, []

        def exists_before_the_other_rank(path):
            if os.path.normpath(os.fspath(path)) != folder:
                return real_exists(path)
            asked.append(path)
            return False

        with mock.patch.object(checks, "exists", side_effect=exists_before_the_other_rank):
            model.fit(np.zeros([4, HOTNESS], np.int64), np.zeros([4, 1], np.float32),
                      epochs=1, verbose=0, callbacks=[
                          tf.keras.callbacks.ModelCheckpoint(
                              os.path.join(folder, "weights-{epoch:02d}" + WEIGHTS_SUFFIX),
                              save_weights_only=True),
                          tf.keras.callbacks.BackupAndRestore(folder)])
        # the callbacks checked the folder, were told it was missing, and went on (both in
        # Keras 3; tf-keras' BackupAndRestore creates its folder without a check)
        self.assertGreaterEqual(len(asked), 2 if KERAS_3 else 1)
        self.assertIn("weights-01" + (WEIGHTS_SUFFIX or ".index"), os.listdir(folder))
        if KERAS_3:
            # a file where the folder should be is still an error
            from keras.src.utils import file_utils
            in_the_way = os.path.join(folder, "a-file")
            open(in_the_way, "w").close()
            with self.assertRaises(FileExistsError):
                file_utils.makedirs(in_the_way)


class RankZeroOnlyTest(tf.test.TestCase):

    def test_model_checkpoint_on_rank_0_only_fails_instead_of_hanging(self):
        from tfhybrid.checkpoint import writer
        directory = tempfile.mkdtemp(prefix="tfhybrid-keras-rank0-")
        self.addCleanup(shutil.rmtree, directory, True)
        job, log = _start("child-rank0-only", directory,
                          {writer.JOIN_SECONDS_ENV: "5"}, ranks=2)
        try:
            code = job.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_job(job.pid)
            job.wait()
            self.fail(f"the job hung:\n{_tail(log)}")
        output = open(log, errors="replace").read()
        self.assertNotEqual(code, 0, output[-5000:])
        self.assertRegex(output, r"\[0\]<stderr>:ValueError: rank 0 began saving checkpoint "
                                 r"'.*weights-01(\.weights\.h5)?', which holds sharded "
                                 r"DistributedEmbedding "
                                 r"tables, and the other ranks did not join within 5 s .* add "
                                 r"ModelCheckpoint / BackupAndRestore .* on EVERY rank")
        self.assertEqual(glob.glob(os.path.join(directory, "weights-01*")), [])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("child-"):
        sys.exit(_job_main(sys.argv[1], sys.argv[2]))
    tf.test.main()
