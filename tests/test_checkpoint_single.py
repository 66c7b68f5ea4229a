"""Checkpoints in one process: a save killed mid-write, errors, rotation, subclassed models."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.train import checkpoint
from tests.test_checkpoint import (ROOT, TABLES, THRESHOLDS, batch, build_model, child_env,
                                   embedding_of, init_weights, make_optimizer, snapshot,
                                   train_step)


def _names(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


class _Base(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.mesh = tfhybrid.init(model_parallel=1)
        self.directory = tempfile.mkdtemp(prefix="tfhybrid-ckpt-single-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def tearDown(self):
        mesh_lib._reset_for_tests()
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

        # the child trains 2 steps and saves step 2, sleeping after its first file
        env = child_env()
        env[checkpoint._PAUSE_ENV] = "600"
        log = open(os.path.join(self.directory, "child.log"), "w")
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.test_checkpoint", "child-save", self.directory,
             "2"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            tmp = None
            while tmp is None and time.time() < deadline and child.poll() is None:
                for name in os.listdir(self.directory):
                    folder = os.path.join(self.directory, name)
                    if name.startswith("ckpt-2.tmp-") and any(
                            f.endswith(".npy") for f in os.listdir(folder)):
                        tmp = folder
                time.sleep(0.02)
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
            child.wait()
            log.close()
        self.assertIsNotNone(tmp, open(os.path.join(self.directory, "child.log")).read()[-3000:])
        self.assertEqual(child.returncode, -signal.SIGKILL)

        # the killed save left its folder, and nothing else changed
        self.assertTrue(os.path.isdir(tmp))
        self.assertFalse(os.path.exists(os.path.join(tmp, checkpoint.MANIFEST)))
        self.assertEqual(checkpoint.latest(self.directory), first)
        self.assertNotIn("ckpt-2", _names(self.directory))
        manifest = json.load(open(os.path.join(first, checkpoint.MANIFEST)))
        for name, meta in manifest["files"].items():
            with open(os.path.join(first, name), "rb") as f:
                self.assertEqual(hashlib.sha256(f.read()).hexdigest(), meta["sha256"], name)

        # a fresh model restores step 1 exactly
        fresh = build_model(self.mesh)
        fresh_optimizer = make_optimizer(self.mesh)
        self.assertEqual(checkpoint.restore(self.directory, fresh, fresh_optimizer), 1)
        self.assertSnapshotEqual(snapshot(fresh, fresh_optimizer), saved)

        # the next save commits and removes the leftover folder
        third = checkpoint.save(self.directory, fresh, fresh_optimizer, step=3)
        self.assertEqual(checkpoint.latest(self.directory), third)
        self.assertEqual(_names(self.directory), ["child.log", "ckpt-1", "ckpt-3", "latest"])


class ErrorTest(_Base):

    def test_empty_and_missing_directories(self):
        model, optimizer = self._trained(steps=0)
        self.assertIsNone(checkpoint.latest(self.directory))
        with self.assertRaisesRegex(FileNotFoundError,
                                    rf"no checkpoint in '{self.directory}'"):
            checkpoint.restore(self.directory, model, optimizer)
        missing = os.path.join(self.directory, "nope")
        with self.assertRaisesRegex(FileNotFoundError, rf"'{missing}' does not exist"):
            checkpoint.restore(missing, model, optimizer)
        # a half-written folder (no manifest) is not a checkpoint either
        os.makedirs(os.path.join(self.directory, "ckpt-7"))
        with self.assertRaisesRegex(FileNotFoundError, "no checkpoint in"):
            checkpoint.restore(self.directory, model, optimizer)

    def test_a_flipped_byte_names_the_file_and_changes_nothing(self):
        model, optimizer = self._trained(steps=1)
        path = checkpoint.save(self.directory, model, optimizer, step=1)
        target = os.path.join(path, "e0-t1-s0.npy")
        with open(target, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x01]))

        fresh = build_model(self.mesh)
        fresh_optimizer = make_optimizer(self.mesh)
        fresh_optimizer.build(fresh.trainable_variables)
        before = snapshot(fresh, fresh_optimizer)
        with self.assertRaisesRegex(ValueError, r"checkpoint file '.*/ckpt-1/e0-t1-s0\.npy' "
                                                r"is corrupt: sha256"):
            checkpoint.restore(self.directory, fresh, fresh_optimizer)
        self.assertSnapshotEqual(snapshot(fresh, fresh_optimizer), before)

        os.remove(target)
        with self.assertRaisesRegex(FileNotFoundError, r"e0-t1-s0\.npy' is missing"):
            checkpoint.restore(path, fresh, fresh_optimizer)

    def test_corrupt_manifest(self):
        model, optimizer = self._trained(steps=0)
        path = checkpoint.save(self.directory, model, optimizer, step=0)
        manifest = os.path.join(path, checkpoint.MANIFEST)
        with open(manifest, "w") as f:
            f.write('{"format": "tfhybrid-checkpoint", "ver')
        with self.assertRaisesRegex(ValueError, rf"manifest '{manifest}' is corrupt"):
            checkpoint.restore(self.directory, model, optimizer)
        with open(manifest, "w") as f:
            json.dump({"format": "tfhybrid-checkpoint", "version": 99}, f)
        with self.assertRaisesRegex(ValueError, "has format version 99"):
            checkpoint.restore(path, model, optimizer)

    def test_mismatched_architecture(self):
        model, optimizer = self._trained(steps=1)
        path = checkpoint.save(self.directory, model, optimizer, step=1)

        tables = [t if t[0] != "mid" else ("mid", 61, 6) for t in TABLES]
        other = build_model(self.mesh, tables=tables)
        with self.assertRaisesRegex(ValueError, r"table 2 \('mid'\) of layer .* is 61x6; "
                                                r"the checkpoint's \('mid'\) is 60x6"):
            checkpoint.restore(path, other, make_optimizer(self.mesh))

        deeper = build_model(self.mesh, hidden=(8, 4))
        with self.assertRaisesRegex(ValueError, r"variable '7\.Dense/kernel' .* is float32 "
                                                r"\[8, 4\]; checkpoint .* holds float32 \[8, 1\]"):
            checkpoint.restore(path, deeper, make_optimizer(self.mesh))

        shallow = build_model(self.mesh, hidden=())
        with self.assertRaisesRegex(ValueError, r"variable '6\.Dense/kernel' .* is float32 "
                                                r"\[26, 1\]"):
            checkpoint.restore(path, shallow, make_optimizer(self.mesh))

        same = build_model(self.mesh)
        with self.assertRaisesRegex(ValueError, "holds the state of a RowWiseAdagrad "
                                                "optimizer; the optimizer given is a Adam"):
            checkpoint.restore(path, same, make_optimizer(self.mesh,
                                                          tf.keras.optimizers.Adam()))

        plain = tf.keras.Sequential([tf.keras.layers.Dense(1)])
        plain.build([None, 3])
        with self.assertRaisesRegex(ValueError, "contains no DistributedEmbedding layer"):
            checkpoint.save(self.directory, plain, None, step=2)
        self.assertEqual(checkpoint.latest(self.directory), path)

        with self.assertRaisesRegex(ValueError, r"step=-1 must be an int >= 0"):
            checkpoint.save(self.directory, model, optimizer, step=-1)
        with self.assertRaisesRegex(ValueError, r"keep=0 must be an int >= 1"):
            checkpoint.save(self.directory, model, optimizer, step=2, keep=0)


class RotationTest(_Base):

    def test_keep_newest_saves_and_latest_pointer(self):
        model, optimizer = self._trained(steps=0)
        for step in (1, 2, 3, 4):
            path = checkpoint.save(self.directory, model, optimizer, step=step, keep=2)
            self.assertEqual(path, os.path.join(self.directory, f"ckpt-{step}"))
        self.assertEqual(_names(self.directory), ["ckpt-3", "ckpt-4", "latest"])
        self.assertEqual(open(os.path.join(self.directory, "latest")).read(), "ckpt-4\n")
        self.assertEqual(checkpoint.restore(self.directory, model, optimizer), 4)

        # after going back, the newest SAVE is kept and is the latest, whatever its step
        self.assertEqual(checkpoint.restore(os.path.join(self.directory, "ckpt-3"), model,
                                            optimizer), 3)
        checkpoint.save(self.directory, model, optimizer, step=2, keep=2)
        self.assertEqual(_names(self.directory), ["ckpt-2", "ckpt-4", "latest"])
        self.assertEqual(checkpoint.latest(self.directory),
                         os.path.join(self.directory, "ckpt-2"))
        # saving a step again replaces it
        checkpoint.save(self.directory, model, optimizer, step=2, keep=2)
        self.assertEqual(_names(self.directory), ["ckpt-2", "ckpt-4", "latest"])

        # a lost pointer falls back to the most recent complete checkpoint
        os.remove(os.path.join(self.directory, "latest"))
        self.assertEqual(checkpoint.latest(self.directory),
                         os.path.join(self.directory, "ckpt-2"))


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

    def _model(self, **thresholds):
        model = _Click(self.mesh, **thresholds)
        model(batch(0, self.mesh)[0])
        init_weights(model)
        return model, make_optimizer(self.mesh, tf.keras.optimizers.Adam(0.01))

    def test_adam_state_restores_and_training_continues(self):
        model, optimizer = self._model()
        for step in range(2):
            train_step(model, optimizer, *batch(step, self.mesh))
        checkpoint.save(self.directory, model, optimizer, step=2)
        train_step(model, optimizer, *batch(2, self.mesh))
        want = embedding_of(model).get_weights() + model.get_weights()

        # the data-parallel table "tiny" becomes a model-parallel (table-wise) shard
        fresh, fresh_optimizer = self._model(data_parallel_threshold=None)
        self.assertEqual(embedding_of(fresh).plan.table("tiny").kind, "table_wise")
        self.assertEqual(checkpoint.restore(self.directory, fresh, fresh_optimizer), 2)
        self.assertEqual(int(fresh_optimizer.iterations.numpy()), 2)
        # Adam's bias correction reads iterations, its m and v are slots of every variable
        train_step(fresh, fresh_optimizer, *batch(2, self.mesh))
        got = embedding_of(fresh).get_weights() + fresh.get_weights()
        for a, b in zip(got[:len(TABLES)], want[:len(TABLES)]):
            self.assertAllClose(a, b, atol=1e-6, rtol=1e-6)
        dense_got = [w for layer in (fresh.hidden, fresh.head) for w in layer.get_weights()]
        dense_want = [w for layer in (model.hidden, model.head) for w in layer.get_weights()]
        for a, b in zip(dense_got, dense_want):
            self.assertAllClose(a, b, atol=1e-6, rtol=1e-6)

    def test_model_without_optimizer_state(self):
        model, _ = self._model()
        path = checkpoint.save(self.directory, model, None, step=5)
        manifest = json.load(open(os.path.join(path, checkpoint.MANIFEST)))
        self.assertIsNone(manifest["optimizer"])
        self.assertEqual(sorted(manifest["dense"]), ["1.Dense/bias", "1.Dense/kernel",
                                                     "2.Dense/bias", "2.Dense/kernel"])
        fresh, optimizer = self._model()
        for layer in (fresh.hidden, fresh.head):
            layer.set_weights([w + 1 for w in layer.get_weights()])
        # the optimizer stays as it is: the checkpoint has no state for it
        self.assertEqual(checkpoint.restore(path, fresh, optimizer), 5)
        self.assertEqual(int(optimizer.iterations.numpy()), 0)
        for a, b in zip(fresh.get_weights(), model.get_weights()):
            self.assertAllEqual(a, b)


if __name__ == "__main__":
    tf.test.main()
