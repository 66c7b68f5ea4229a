"""A checkpoint written on a 2x2 mesh restores onto 2x2, 1x4, 4x1 and 1x1 meshes.

The app's ``tfhybrid.train.checkpoint`` (``tf.train.Checkpoint`` + ``CheckpointManager``)
saves a model with a row-wise, a column-wise, a table-wise and a data-parallel table,
trained with RowWiseAdagrad; the restores change the layout and the placement of tables
(data-parallel <-> model-parallel, a different column split). Tables and dense weights
come back bit-identical, row-wise accumulators exactly where the column split is kept
(column-weighted means where it is not), Adam's moments exactly everywhere, and a
restored 2x2 run continues like the uninterrupted one.

This file also holds the helpers of ``tests/test_checkpoint_single.py`` and the child
processes both start: ``python -m tests.test_checkpoint child-restore|child-save ...``.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from unittest import mock

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
from tensorflow.python.ops import io_ops

import tfhybrid
from tfhybrid.checkpoint import resharding
from tfhybrid.checkpoint import slots as checkpoint_slots
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.optimizers import RowWiseAdagrad
from tfhybrid.testing import faults
from tfhybrid.train import checkpoint

KERAS_3 = tfhybrid.keras_major() == 3

HOROVOD_NP = (4,)
KERAS = (2, 3)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_BATCH = 16
HOTNESS = 2
LEARNING_RATE = 0.1
# big: row_wise, wide: column_wise (2 slices for M >= 2), mid: table_wise, tiny: data_parallel
TABLES = [("big", 300, 8), ("wide", 100, 8), ("mid", 60, 6), ("tiny", 20, 4)]
THRESHOLDS = dict(data_parallel_threshold=100, row_slice_threshold=2000,
                  column_slice_threshold=600)
TRAIN_STEPS = 3
# the layer's place in the model's object graph is Keras' (2: layer_with_weights-0,
# 3: _operations/<k>); what tfhybrid names is from "tables" on
TABLE_KEY = "tables/.ATTRIBUTES/table_{}"
SLOT_KEY = "optimizer/tfhybrid_table_slots/layer_0/.ATTRIBUTES/table_{}_{}"


# ---------------------------------------------------------------- helpers
def _model_key(saved: dict, key: str) -> str:
    """``key`` under the model's path to the layer, as Keras names it: the one saved
    key of table 0 that ends in it."""
    found = [k for k in saved if k.startswith("model/") and k.endswith(key.format(0))]
    if len(found) != 1:
        raise AssertionError(f"{len(found)} saved keys end in {key.format(0)!r}: {found}")
    return found[0][:-len(key.format(0))] + key
def build_model(mesh, tables=TABLES, hidden=(8,), **thresholds) -> tf.keras.Model:
    """ids of the tables -> DistributedEmbedding -> Dense(8) -> Dense(1)."""
    ids = [tf.keras.Input([HOTNESS], dtype=tf.int64, name=f"{name}_ids")
           for name, *_ in tables]
    embedded = DistributedEmbedding(
        [Embedding(rows, dim, combiner="sum", name=name) for name, rows, dim in tables],
        mesh=mesh, **dict(THRESHOLDS, **thresholds))(ids)
    x = tf.keras.layers.Concatenate(axis=1)(embedded)
    for units in hidden:
        x = tf.keras.layers.Dense(units, activation="relu")(x)
    return tf.keras.Model(ids, tf.keras.layers.Dense(1)(x))


def embedding_of(model) -> DistributedEmbedding:
    return next(layer for layer in model.layers if isinstance(layer, DistributedEmbedding))


def dense_weights(model) -> list:
    return [w for layer in model.layers if isinstance(layer, tf.keras.layers.Dense)
            for w in layer.get_weights()]


def init_weights(model, seed=0) -> None:
    """The same weights on every rank (initializers would draw per rank)."""
    rng = np.random.default_rng(seed)
    embedding_of(model).set_weights([rng.normal(0, 0.1, [rows, dim]).astype(np.float32)
                                     for _, rows, dim in TABLES])
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.Dense):
            layer.set_weights([rng.normal(0, 0.3, w.shape).astype(np.float32)
                               for w in layer.get_weights()])


def batch(step: int, mesh) -> tuple[list, tf.Tensor]:
    """This rank's slice of global batch ``step`` (the same global batch on any mesh)."""
    rng = np.random.default_rng(100 + step)
    ids = [rng.integers(0, rows, size=[GLOBAL_BATCH, HOTNESS]) for _, rows, _ in TABLES]
    labels = rng.integers(0, 2, size=[GLOBAL_BATCH, 1]).astype(np.float32)
    local = GLOBAL_BATCH // mesh.size
    lo, hi = mesh.rank * local, (mesh.rank + 1) * local
    return [tf.constant(x[lo:hi]) for x in ids], tf.constant(labels[lo:hi])


def train_step(model, optimizer, ids, labels) -> None:
    with tf.GradientTape() as tape:
        logits = model(ids, training=True)
        loss = tf.reduce_mean(tf.keras.losses.binary_crossentropy(
            labels, logits, from_logits=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def make_optimizer(mesh, optimizer=None):
    return tfhybrid.DistributedOptimizer(optimizer or RowWiseAdagrad(LEARNING_RATE), mesh=mesh)


def gather_slots(layer, optimizer) -> list[list[tuple[tuple, dict]]]:
    """Per table, [(rect, {slot name: values})] of every shard, gathered from all ranks."""
    mesh = layer.mesh
    items = []
    for t, placement in enumerate(layer.plan.tables):
        if placement.kind == "data_parallel":
            pairs = ([(layer.stores.get(t, 0).variable, placement.shards[0])]
                     if mesh.rank == 0 else [])
        else:
            pairs = [(layer.stores.get(t, s).variable, shard)
                     for s, shard in enumerate(placement.shards)
                     if mesh.replica == 0 and layer.stores.get(t, s) is not None]
        for var, shard in pairs:
            slots = {key: s.numpy() for key, s in
                     checkpoint_slots.slots_of(optimizer, var).items()}
            items.append((t, (shard.row_start, shard.row_end, shard.col_start, shard.col_end),
                          slots))
    out: list[list] = [[] for _ in TABLES]
    for rank_items in hvd.allgather_object(items, name="test_checkpoint_slots"):
        for t, rect, slots in rank_items:
            out[t].append((rect, slots))
    return out


def row_slots(gathered) -> list[dict]:
    """Row-wise accumulators per table: {(col_start, col_end): [rows] values}."""
    out = []
    for (_, rows, _), shards in zip(TABLES, gathered):
        by_cols: dict = {}
        for (r0, r1, c0, c1), slots in shards:
            (values,) = slots.values()
            by_cols.setdefault((c0, c1), np.full([rows], np.nan, np.float32))[r0:r1] = values
        out.append(by_cols)
    return out


def snapshot(model, optimizer) -> dict:
    """Full tables, dense weights, row-wise slots and iterations (a collective)."""
    layer = embedding_of(model)
    return {"tables": layer.get_weights(all_ranks=True), "dense": dense_weights(model),
            "slots": row_slots(gather_slots(layer, optimizer)),
            "iterations": int(optimizer.iterations.numpy())}


def expected_row_slot(saved: dict, cols: tuple[int, int]) -> np.ndarray:
    """A new column slice's accumulator from the saved ones (see resharding.rowwise_weights)."""
    weights = resharding.rowwise_weights(cols, list(saved))
    total = sum(np.asarray(values, np.float64) * w
                for w, values in zip(weights, saved.values()) if w > 0)
    return total.astype(np.float32)


def child_env() -> dict:
    """The environment for a plain single-process child: no Horovod job to join."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}


def save_snapshot(path: str, snap: dict) -> None:
    arrays = {f"table{t}": x for t, x in enumerate(snap["tables"])}
    arrays.update({f"dense{i}": x for i, x in enumerate(snap["dense"])})
    for t, by_cols in enumerate(snap["slots"]):
        arrays.update({f"slot{t}_{c0}_{c1}": v for (c0, c1), v in by_cols.items()})
    arrays["iterations"] = np.array(snap["iterations"])
    arrays["step"] = np.array(snap.get("step", -1))
    np.savez(path, **arrays)


def load_snapshot(path: str) -> dict:
    data = np.load(path)
    slots = [dict() for _ in TABLES]
    for key in data.files:
        if key.startswith("slot"):
            t, c0, c1 = (int(x) for x in key[4:].split("_"))
            slots[t][(c0, c1)] = data[key]
    return {"tables": [data[f"table{t}"] for t in range(len(TABLES))],
            "dense": [data[f"dense{i}"] for i in range(sum(k.startswith("dense")
                                                           for k in data.files))],
            "slots": slots, "iterations": int(data["iterations"])}


def _child_main(argv: list[str]) -> int:
    """Child processes of the tests: one plain process, a 1x1 mesh."""
    mode = argv[0]
    faults.install_from_env()   # the parent's pause of a save, if it asks for one
    mesh = tfhybrid.init(model_parallel=1)
    model = build_model(mesh)
    optimizer = make_optimizer(mesh)
    if mode == "child-restore":        # child-restore <checkpoint> <out.npz>
        step = checkpoint.restore(argv[1], model, optimizer)
        snap = snapshot(model, optimizer)
        snap["step"] = step
        save_snapshot(argv[2], snap)
        return 0
    if mode == "child-save":           # child-save <directory> <step>
        init_weights(model)
        step = int(argv[2])
        for i in range(step):
            train_step(model, optimizer, *batch(i, mesh))
        checkpoint.save(argv[1], model, optimizer, step=step)
        return 0
    raise SystemExit(f"unknown child mode {mode!r}")


# ------------------------------------------------------------------ tests
def _barrier(name: str) -> None:
    hvd.allgather_object(0, name=name)


def _shared_tempdir(prefix: str) -> str:
    made = tempfile.mkdtemp(prefix=prefix) if hvd.rank() == 0 else None
    return hvd.broadcast_object(made, root_rank=0, name=f"{prefix}dir")


class ReshardTest(tf.test.TestCase):
    """One 2x2 checkpoint (setUpClass), restored onto several meshes."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        mesh = tfhybrid.init(model_parallel=2)
        cls.directory = _shared_tempdir("tfhybrid-ckpt-test-")
        model = build_model(mesh)
        init_weights(model)
        optimizer = make_optimizer(mesh)
        for step in range(TRAIN_STEPS):
            train_step(model, optimizer, *batch(step, mesh))
        cls.path = checkpoint.save(cls.directory, model, optimizer, step=TRAIN_STEPS)
        cls.saved = snapshot(model, optimizer)
        cls.saved_plan = embedding_of(model).plan
        # the uninterrupted run's next step
        train_step(model, optimizer, *batch(TRAIN_STEPS, mesh))
        cls.continued = snapshot(model, optimizer)
        mesh_lib.reset()

    @classmethod
    def tearDownClass(cls):
        _barrier("test_checkpoint_done")
        if hvd.rank() == 0:
            shutil.rmtree(cls.directory, ignore_errors=True)
        super().tearDownClass()

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    # ------------------------------------------------------------ checks
    def _restore(self, model_parallel, layout="model_major", **thresholds):
        mesh = tfhybrid.init(model_parallel=model_parallel, layout=layout)
        _barrier("test_checkpoint_mesh")   # every rank has registered the process sets
        model = build_model(mesh, **thresholds)
        optimizer = make_optimizer(mesh)
        self.assertEqual(checkpoint.restore(self.directory, model, optimizer), TRAIN_STEPS)
        return mesh, model, optimizer

    def _assert_restored(self, snap):
        self.assertEqual(snap["iterations"], TRAIN_STEPS)
        for got, want in zip(snap["tables"], self.saved["tables"]):
            self.assertAllEqual(got, want)
        self.assertLen(snap["dense"], 4)
        for got, want in zip(snap["dense"], self.saved["dense"]):
            self.assertAllEqual(got, want)
        for (name, *_), got, saved in zip(TABLES, snap["slots"], self.saved["slots"]):
            self.assertNotEmpty(got)
            for cols, values in got.items():
                self.assertFalse(np.isnan(values).any(), f"table {name} cols {cols}")
                if cols in saved:      # same column split: exact
                    self.assertAllEqual(values, saved[cols], msg=f"{name} {cols}")
                else:
                    self.assertAllClose(values, expected_row_slot(saved, cols), rtol=1e-6,
                                        atol=0, msg=f"{name} {cols}")

    def _assert_continues(self, model, optimizer, mesh):
        train_step(model, optimizer, *batch(TRAIN_STEPS, mesh))
        snap = snapshot(model, optimizer)
        self.assertEqual(snap["iterations"], TRAIN_STEPS + 1)
        for got, want in zip(snap["tables"] + snap["dense"],
                             self.continued["tables"] + self.continued["dense"]):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)

    # ------------------------------------------------------------- tests
    def test_saved_tensors_are_whole_tables_under_mesh_free_names(self):
        self.assertEqual([t.kind for t in self.saved_plan.tables],
                         ["row_wise", "column_wise", "table_wise", "data_parallel"])
        saved = dict(tf.train.list_variables(self.path))
        table_key = _model_key(saved, TABLE_KEY)
        for t, (_, rows, dim) in enumerate(TABLES):
            self.assertEqual(saved[table_key.format(t)], [rows, dim])
            # the row-wise accumulator is stored broadcast over the table's columns
            self.assertEqual(saved[SLOT_KEY.format(t, "accumulator")], [rows, dim])
        self.assertEqual([k for k in saved if "shard" in k or "distributed_embedding" in k],
                         [])
        reader = tf.train.load_checkpoint(self.path)
        for t, table in enumerate(self.saved["tables"]):
            self.assertAllEqual(reader.get_tensor(table_key.format(t)), table)
        self.assertEqual(reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"),
                         TRAIN_STEPS)
        # one index, one data file per rank that wrote (replica 0: ranks 0 and 1), and
        # nothing left of the parts (the other tests add their own files here)
        self.assertEqual(sorted(n for n in os.listdir(self.directory)
                                if n.startswith(("ckpt", "checkpoint"))),
                         ["checkpoint", "ckpt-3.data-00000-of-00002",
                          "ckpt-3.data-00001-of-00002", "ckpt-3.index"])
        self.assertEqual(checkpoint.latest(self.directory), self.path)

    def test_2x2_restores_exactly_and_continues_like_the_uninterrupted_run(self):
        mesh, model, optimizer = self._restore(2)
        self._assert_restored(snapshot(model, optimizer))
        self._assert_continues(model, optimizer, mesh)

        # a rank that fails to write makes every rank raise; step 3 stays the latest
        real = io_ops.save_v2

        def broken(prefix, *args, **kwargs):
            raise OSError("disk full (test)")

        try:
            with mock.patch.object(io_ops, "save_v2", broken if mesh.rank == 1 else real):
                with self.assertRaisesRegex(OSError, r"failed on 1 rank\(s\): rank 1: "
                                                     r"OSError: disk full \(test\)"):
                    checkpoint.save(self.directory, model, optimizer, step=TRAIN_STEPS + 1)
        finally:
            _barrier("test_checkpoint_failed_save")
        self.assertEqual(checkpoint.latest(self.directory), self.path)
        self.assertEqual([n for n in os.listdir(self.directory)
                          if n.startswith(f"ckpt-{TRAIN_STEPS + 1}")], [])

    def test_2x2_data_major_with_a_sharded_table_made_data_parallel(self):
        # mid (360 elements) becomes data-parallel; replicas are now rank pairs (0, 1)...
        mesh, model, optimizer = self._restore(2, layout="data_major",
                                               data_parallel_threshold=400)
        self.assertEqual([t.kind for t in embedding_of(model).plan.tables],
                         ["row_wise", "column_wise", "data_parallel", "data_parallel"])
        self._assert_restored(snapshot(model, optimizer))
        self._assert_continues(model, optimizer, mesh)

    def test_1x4_with_a_new_column_split(self):
        # wide is cut into 3 column slices instead of 2: its row-wise accumulators become
        # column-weighted means (see resharding.rowwise_weights)
        mesh, model, optimizer = self._restore(4, column_slice_threshold=300)
        plan = embedding_of(model).plan
        self.assertEqual((mesh.data_parallel, mesh.model_parallel), (1, 4))
        # mid (360 elements) is now column-sliced too: its slices get the whole table's
        # accumulator
        self.assertEqual([(t.kind, len(t.shards)) for t in plan.tables],
                         [("row_wise", 4), ("column_wise", 3), ("column_wise", 2),
                          ("data_parallel", 1)])
        self._assert_restored(snapshot(model, optimizer))

    def test_4x1_with_a_data_parallel_table_made_model_parallel(self):
        mesh, model, optimizer = self._restore(1, data_parallel_threshold=None)
        self.assertEqual((mesh.data_parallel, mesh.model_parallel), (4, 1))
        self.assertEqual([t.kind for t in embedding_of(model).plan.tables],
                         ["table_wise"] * 4)
        snap = snapshot(model, optimizer)
        self._assert_restored(snap)
        # wide's two slices merged into one accumulator (0, 8)
        self.assertEqual(list(snap["slots"][1]), [(0, 8)])

    def test_1x1_in_a_single_process(self):
        # rank 0 restores the checkpoint in a plain one-process child; the others wait on
        # the file system, not in a collective (Horovod would call that a stall)
        out = os.path.join(self.directory, "single.npz")
        status = out + ".status"
        try:
            if hvd.rank() == 0:
                try:
                    child = subprocess.run(
                        [sys.executable, "-m", "tests.test_checkpoint", "child-restore",
                         self.path, out], cwd=ROOT, env=child_env(), capture_output=True,
                        text=True, timeout=300)
                finally:
                    with open(status, "w") as f:
                        f.write("done")
                self.assertEqual(child.returncode, 0, child.stderr[-3000:])
                snap = load_snapshot(out)
                self.assertEqual(int(np.load(out)["step"]), TRAIN_STEPS)
                self._assert_restored(snap)
                for by_cols in snap["slots"]:
                    self.assertEqual(len(by_cols), 1)   # every table whole on 1x1
            else:
                deadline = time.time() + 330
                while not os.path.exists(status) and time.time() < deadline:
                    time.sleep(0.2)
                self.assertTrue(os.path.exists(status), "rank 0's child did not finish")
        finally:
            _barrier("test_checkpoint_single")


class FullShapeSlotTest(tf.test.TestCase):
    """Adam's [rows, cols] slots reshard exactly like their tables."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _full_slots(self, layer, optimizer) -> list[dict]:
        out = []
        for (_, rows, dim), shards in zip(TABLES, gather_slots(layer, optimizer)):
            full: dict = {}
            for (r0, r1, c0, c1), slots in shards:
                for key, values in slots.items():
                    full.setdefault(key, np.full([rows, dim], np.nan, np.float32))[
                        r0:r1, c0:c1] = values
            out.append(full)
        return out

    def test_adam_2x2_to_1x4(self):
        mesh = tfhybrid.init(model_parallel=2)
        directory = _shared_tempdir("tfhybrid-ckpt-adam-")
        try:
            model = build_model(mesh)
            init_weights(model)
            optimizer = make_optimizer(mesh, tf.keras.optimizers.Adam(0.01))
            train_step(model, optimizer, *batch(0, mesh))
            checkpoint.save(directory, model, optimizer, step=1)
            saved = self._full_slots(embedding_of(model), optimizer)
            tables = embedding_of(model).get_weights(all_ranks=True)
            mesh_lib.reset()

            mesh = tfhybrid.init(model_parallel=4)
            model = build_model(mesh, column_slice_threshold=300, data_parallel_threshold=None)
            optimizer = make_optimizer(mesh, tf.keras.optimizers.Adam(0.01))
            self.assertEqual(checkpoint.restore(directory, model, optimizer), 1)
            self.assertEqual(int(optimizer.iterations.numpy()), 1)
            for got, want in zip(embedding_of(model).get_weights(all_ranks=True), tables):
                self.assertAllEqual(got, want)
            restored = self._full_slots(embedding_of(model), optimizer)
            for (name, *_), got, want in zip(TABLES, restored, saved):
                # Adam's own slot names: Keras 2's and Keras 3's
                self.assertEqual(sorted(got), ["momentum", "velocity"] if
                                 KERAS_3 else ["m", "v"])
                for key in want:
                    self.assertFalse(np.isnan(got[key]).any())
                    self.assertAllEqual(got[key], want[key], msg=f"{name} {key}")
        finally:
            _barrier("test_checkpoint_adam_done")
            if hvd.rank() == 0:
                shutil.rmtree(directory, ignore_errors=True)


class SaveTogetherTest(tf.test.TestCase):
    """Every rank must save, to the same path (a save on rank 0 alone: see
    tests/test_keras_checkpoint.py, since it leaves that rank unable to go on)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.mesh = tfhybrid.init(model_parallel=2)
        cls.directory = _shared_tempdir("tfhybrid-ckpt-together-")
        cls.model = build_model(cls.mesh)

    @classmethod
    def tearDownClass(cls):
        _barrier("test_checkpoint_together_done")
        if hvd.rank() == 0:
            shutil.rmtree(cls.directory, ignore_errors=True)
        mesh_lib.reset()
        super().tearDownClass()

    def test_ranks_saving_to_different_paths_raise(self):
        # Keras 3 saves weights to .weights.h5 files, Keras 2 to checkpoint prefixes
        path = os.path.join(self.directory, "per_rank", f"weights-{hvd.rank()}"
                            + (".weights.h5" if KERAS_3 else ""))
        with self.assertRaisesRegex(ValueError, r"different paths: rank 0: .*weights-0[.a-z5]*', "
                                                r"rank 1: .*weights-1"):
            self.model.save_weights(path)
        self.assertEqual(glob.glob(path + "*"), [])
        # and then every rank saves to one path, from all ranks: Keras 2's checkpoint
        # has a data file per writing rank, Keras 3's weights file is one file
        path = os.path.join(self.directory, "together", "weights")
        # Keras 3 writes into an existing folder, as h5py does
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if KERAS_3:
            self.model.save_weights(path + ".weights.h5")
            expected = ["weights.weights.h5"]
        else:
            self.model.save_weights(path)
            expected = ["weights.data-00000-of-00002", "weights.data-00001-of-00002",
                        "weights.index"]
        self.assertEqual(sorted(os.path.basename(p) for p in glob.glob(path + "*")),
                         expected)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("child-"):
        sys.exit(_child_main(sys.argv[1:]))
    tf.test.main()
