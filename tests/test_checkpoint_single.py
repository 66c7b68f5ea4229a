"""Checkpoints in one process: a save killed mid-write, errors, rotation, subclassed models
and restores that run before the model or the optimizer is built."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import tensorflow as tf

import tfhybrid
from tfhybrid.testing import faults
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.train import checkpoint
from tests.test_checkpoint import (ROOT, TABLE_KEY, TABLES, THRESHOLDS, batch, build_model,
                                   child_env, embedding_of, init_weights, make_optimizer,
                                   snapshot, train_step)


def _names(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


class _Base(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.mesh = tfhybrid.init(model_parallel=1)
        self.directory = tempfile.mkdtemp(prefix="tfhybrid-ckpt-single-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _trained(self, steps=1, **kwargs):
        model = build_model(self.mesh, **kwargs)
        init_weights(model)
        optimizer = make_optimizer(self.mesh)
        for step in range(steps):
            train_step(model, optimizer, *batch(step, self.mesh))
        return model, optimizer

    def assertSnapshotEqual(self, got, want):
        self.assertEqual(got["iterations"], want["iterations"])
        for a, b in zip(got["tables"] + got["dense"], want["tables"] + want["dense"]):
            self.assertAllEqual(a, b)
        for a, b in zip(got["slots"], want["slots"]):
            self.assertEqual(sorted(a), sorted(b))
            for cols in a:
                self.assertAllEqual(a[cols], b[cols])


class CrashTest(_Base):

    def test_sigkill_during_save_leaves_the_last_checkpoint_intact(self):
        model, optimizer = self._trained(steps=1)
        first = checkpoint.save(self.directory, model, optimizer, step=1)
        saved = snapshot(model, optimizer)

        # the child trains 2 steps and saves step 2, sleeping once its part is written
        env = child_env()
        env.update(faults.pause_save_env(1, 600))
        log = open(os.path.join(self.directory, "child.log"), "w")
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.test_checkpoint", "child-save", self.directory,
             "2"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            staging = None
            while staging is None and time.time() < deadline and child.poll() is None:
                for name in os.listdir(self.directory):
                    folder = os.path.join(self.directory, name)
                    if name.startswith("ckpt-2_temp-") and any(
                            f.endswith(".index") for f in os.listdir(folder)):
                        staging = folder
                time.sleep(0.02)
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
            child.wait()
            log.close()
        self.assertIsNotNone(staging,
                             open(os.path.join(self.directory, "child.log")).read()[-3000:])
        self.assertEqual(child.returncode, -signal.SIGKILL)

        # the killed save left its part, and nothing else changed
        self.assertTrue(os.path.isdir(staging))
        self.assertEqual(checkpoint.latest(self.directory), first)
        self.assertEqual([n for n in _names(self.directory) if n.startswith("ckpt-2.")], [])

        # a fresh model restores step 1 exactly
        fresh = build_model(self.mesh)
        fresh_optimizer = make_optimizer(self.mesh)
        self.assertEqual(checkpoint.restore(self.directory, fresh, fresh_optimizer), 1)
        self.assertSnapshotEqual(snapshot(fresh, fresh_optimizer), saved)

        # the next save of that prefix commits and removes the leftover part
        checkpoint.save(self.directory, fresh, fresh_optimizer, step=2)
        self.assertEqual(checkpoint.latest(self.directory),
                         os.path.join(self.directory, "ckpt-2"))
        self.assertFalse(os.path.exists(staging))


class ErrorTest(_Base):

    def test_empty_and_missing_directories(self):
        model, optimizer = self._trained(steps=0)
        self.assertIsNone(checkpoint.latest(self.directory))
        with self.assertRaisesRegex(FileNotFoundError,
                                    rf"no checkpoint in '{self.directory}'"):
            checkpoint.restore(self.directory, model, optimizer)
        missing = os.path.join(self.directory, "ckpt-7")
        with self.assertRaisesRegex(FileNotFoundError, rf"'{missing}' does not exist"):
            checkpoint.restore(missing, model, optimizer)

    def test_a_flipped_byte_fails_the_checksum(self):
        model, optimizer = self._trained(steps=1)
        path = checkpoint.save(self.directory, model, optimizer, step=1)
        (data,) = [n for n in _names(self.directory) if ".data-" in n]
        with open(os.path.join(self.directory, data), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0x01]))
        with self.assertRaisesRegex(RuntimeError, r"failed on 1 rank\(s\): rank 0: "
                                                  r"DataLossError: .*Checksum does not match"):
            checkpoint.restore(path, build_model(self.mesh), make_optimizer(self.mesh))

    def test_mismatched_architecture(self):
        model, optimizer = self._trained(steps=1)
        path = checkpoint.save(self.directory, model, optimizer, step=1)

        tables = [t if t[0] != "mid" else ("mid", 61, 6) for t in TABLES]
        with self.assertRaisesRegex(RuntimeError,
                                    "InvalidArgumentError: .*" +
                                    TABLE_KEY.format(2).replace(".", r"\.") +
                                    r"; shape in shape_and_slice spec \[61,6\] does not "
                                    r"match the shape stored in checkpoint: \[60,6\]"):
            checkpoint.restore(path, build_model(self.mesh, tables=tables),
                               make_optimizer(self.mesh))
        with self.assertRaisesRegex(ValueError, r"incompatible tensor with shape \(1,\) when "
                                                r"attempting to restore variable with shape "
                                                r"\(4,\)"):
            checkpoint.restore(path, build_model(self.mesh, hidden=(8, 4)),
                               make_optimizer(self.mesh))

        other_mesh = build_model(self.mesh)
        mesh_lib.reset()
        with self.assertRaisesRegex(ValueError, "no mesh: call tfhybrid.init"):
            checkpoint.save(self.directory, other_mesh, None, step=2)
        self.mesh = tfhybrid.init(model_parallel=1)
        with self.assertRaisesRegex(ValueError, r"step=-1 must be an int >= 0"):
            checkpoint.save(self.directory, model, optimizer, step=-1)
        with self.assertRaisesRegex(ValueError, r"keep=0 must be an int >= 1"):
            checkpoint.save(self.directory, model, optimizer, step=2, keep=0)
        self.assertEqual(checkpoint.latest(self.directory), path)


class RotationTest(_Base):

    def test_keep_newest_saves_and_latest(self):
        model, optimizer = self._trained(steps=0)
        for step in (1, 2, 3, 4):
            path = checkpoint.save(self.directory, model, optimizer, step=step, keep=2)
            self.assertEqual(path, os.path.join(self.directory, f"ckpt-{step}"))
        self.assertEqual([n for n in _names(self.directory) if n.endswith(".index")],
                         ["ckpt-3.index", "ckpt-4.index"])
        self.assertEqual(checkpoint.restore(self.directory, model, optimizer), 4)
        self.assertEqual(checkpoint.restore(os.path.join(self.directory, "ckpt-3"), model,
                                            optimizer), 3)
        # saving a step again replaces it, and it becomes the latest
        checkpoint.save(self.directory, model, optimizer, step=3, keep=2)
        self.assertEqual(checkpoint.latest(self.directory),
                         os.path.join(self.directory, "ckpt-3"))


class _Click(tf.keras.Model):
    """A subclassed model: the layers are attributes, not a functional graph."""

    def __init__(self, mesh, **thresholds):
        super().__init__()
        self.embedding = DistributedEmbedding(
            [Embedding(rows, dim, combiner="sum", name=name) for name, rows, dim in TABLES],
            mesh=mesh, **dict(THRESHOLDS, **thresholds))
        self.hidden = tf.keras.layers.Dense(8, activation="relu")
        self.head = tf.keras.layers.Dense(1)

    def call(self, ids):
        return self.head(self.hidden(tf.concat(self.embedding(ids), axis=1)))


class SubclassedModelTest(_Base):

    def _model(self, build=True, **thresholds):
        model = _Click(self.mesh, **thresholds)
        if build:
            model(batch(0, self.mesh)[0])
            init_weights(model)
        return model, make_optimizer(self.mesh, tf.keras.optimizers.Adam(0.01))

    def _weights(self, model) -> list:
        return embedding_of(model).get_weights() + [
            w for layer in (model.hidden, model.head) for w in layer.get_weights()]

    def test_adam_state_restores_and_training_continues(self):
        model, optimizer = self._model()
        for step in range(2):
            train_step(model, optimizer, *batch(step, self.mesh))
        checkpoint.save(self.directory, model, optimizer, step=2)
        train_step(model, optimizer, *batch(2, self.mesh))
        want = self._weights(model)

        # the data-parallel table "tiny" becomes a model-parallel (table-wise) shard
        fresh, fresh_optimizer = self._model(data_parallel_threshold=None)
        self.assertEqual(embedding_of(fresh).plan.table("tiny").kind, "table_wise")
        self.assertEqual(checkpoint.restore(self.directory, fresh, fresh_optimizer), 2)
        self.assertEqual(int(fresh_optimizer.iterations.numpy()), 2)
        # Adam's m and v are made in the first step, and get their saved values first
        train_step(fresh, fresh_optimizer, *batch(2, self.mesh))
        for a, b in zip(self._weights(fresh), want):
            self.assertAllClose(a, b, atol=1e-6, rtol=1e-6)

    def test_restore_before_the_model_is_built(self):
        model, optimizer = self._model()
        train_step(model, optimizer, *batch(0, self.mesh))
        path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(
            os.path.join(self.directory, "weights"))
        train_step(model, optimizer, *batch(1, self.mesh))
        want = self._weights(model)

        # the restore waits for the layer's tables and the optimizer's slots
        fresh, fresh_optimizer = self._model(build=False)
        status = tf.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).read(path)
        train_step(fresh, fresh_optimizer, *batch(1, self.mesh))
        status.assert_consumed()
        for a, b in zip(self._weights(fresh), want):
            self.assertAllClose(a, b, atol=1e-6, rtol=1e-6)

    def test_model_without_optimizer_state(self):
        model, _ = self._model()
        path = checkpoint.save(self.directory, model, None, step=5)
        self.assertEqual(sorted(k for k, _ in tf.train.list_variables(path)
                                if not k.startswith("_")),
                         ["model/embedding/tables/.ATTRIBUTES/table_0",
                          "model/embedding/tables/.ATTRIBUTES/table_1",
                          "model/embedding/tables/.ATTRIBUTES/table_2",
                          "model/embedding/tables/.ATTRIBUTES/table_3",
                          "model/head/bias/.ATTRIBUTES/VARIABLE_VALUE",
                          "model/head/kernel/.ATTRIBUTES/VARIABLE_VALUE",
                          "model/hidden/bias/.ATTRIBUTES/VARIABLE_VALUE",
                          "model/hidden/kernel/.ATTRIBUTES/VARIABLE_VALUE",
                          "save_counter/.ATTRIBUTES/VARIABLE_VALUE"])
        fresh, optimizer = self._model()
        for layer in (fresh.hidden, fresh.head):
            layer.set_weights([w + 1 for w in layer.get_weights()])
        # the optimizer stays as it is: the checkpoint has no state for it
        self.assertEqual(checkpoint.restore(path, fresh, optimizer), 5)
        self.assertEqual(int(optimizer.iterations.numpy()), 0)
        for a, b in zip(self._weights(fresh), self._weights(model)):
            self.assertAllEqual(a, b)


if __name__ == "__main__":
    tf.test.main()
