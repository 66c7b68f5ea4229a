"""Checkpoints and weights files of a 2 x 2 mesh restore onto 2 x 2, 1 x 4 and 4 x 1
meshes, in Keras 3 (the code runs under Keras 2 too).

``tf.train.Checkpoint`` and ``model.save_weights`` (Keras 3: a ``.weights.h5`` file that
rank 0 writes with each table whole; Keras 2: a TensorFlow checkpoint) of a model whose
tables train with row-wise AdaGrad and dense layers with Adam. The restored model has the
tables and dense weights bit for bit, and on the same mesh one more step on the same
global batch gives the weights the uninterrupted model gets: the optimizers' state came
back too.
"""

import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.optimizers import RowWiseAdagrad

KERAS_3 = tfhybrid.keras_major() == 3

HOROVOD_NP = (4,)
# Keras 2's checkpoints, save_weights included, and their continuation after a restore
# are tests/test_checkpoint.py's (which runs under both); this module is Keras 3's
KERAS = (3,)

# big: row-wise, wide: column-wise on M >= 2, mid: table-wise, tiny: replicated
TABLES = [("big", 300, 8), ("wide", 100, 8), ("mid", 60, 6), ("tiny", 20, 4)]
THRESHOLDS = dict(data_parallel_threshold=100, row_slice_threshold=2000,
                  column_slice_threshold=600)
GLOBAL_BATCH, STEPS = 16, 3


def _model(mesh):
    ids = [tf.keras.Input([2], dtype=tf.int64, name=f"{name}_ids") for name, *_ in TABLES]
    embedding = DistributedEmbedding(
        [Embedding(rows, dim, combiner="sum", name=name) for name, rows, dim in TABLES],
        mesh=mesh, **THRESHOLDS)
    hidden = tf.keras.layers.Dense(8, activation="relu", kernel_initializer=
                                   tf.keras.initializers.GlorotUniform(1))(
        tf.keras.layers.Concatenate(axis=1)(embedding(ids)))
    model = tf.keras.Model(ids, tf.keras.layers.Dense(
        1, kernel_initializer=tf.keras.initializers.GlorotUniform(2))(hidden))
    model.compile(optimizer=tfhybrid.DistributedOptimizer(
                      tf.keras.optimizers.Adam(0.01),
                      embedding_optimizer=RowWiseAdagrad(0.1)),
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    return model, embedding


def _batches(mesh, steps, seed):
    """This rank's samples of ``steps`` global batches (the same batches on any mesh)."""
    rng = np.random.default_rng(seed)
    n = GLOBAL_BATCH * steps
    ids = [rng.integers(0, rows, [n, 2]) for _, rows, _ in TABLES]
    labels = rng.integers(0, 2, [n, 1]).astype(np.float32)
    return [x[mesh.rank::mesh.size] for x in ids], labels[mesh.rank::mesh.size]


def _fit(model, mesh, steps, seed):
    x, y = _batches(mesh, steps, seed)
    model.fit(x, y, batch_size=GLOBAL_BATCH // mesh.size, shuffle=False, verbose=0,
              callbacks=tfhybrid.callbacks.defaults())


def _dense(model):
    return [w.numpy() for layer in model.layers if isinstance(layer, tf.keras.layers.Dense)
            for w in layer.weights]


class WeightsFilesTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _folder(self):
        """A folder every rank sees (this machine), removed after the test."""
        folder = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
        if hvd.rank() == 0:
            self.addCleanup(shutil.rmtree, folder, ignore_errors=True)
        return folder

    def _round_trip(self, save, restore):
        mesh = tfhybrid.init(model_parallel=2)
        folder = self._folder()
        model, embedding = _model(mesh)
        rng = np.random.default_rng(0)
        embedding.set_weights([rng.normal(0, 0.1, [rows, dim]).astype(np.float32)
                               for _, rows, dim in TABLES])
        _fit(model, mesh, STEPS, seed=1)
        path = save(model, os.path.join(folder, "saved"))
        saved_tables = embedding.get_weights(all_ranks=True)
        saved_dense = _dense(model)
        # the uninterrupted run's next step
        _fit(model, mesh, 1, seed=2)
        want_tables, want_dense = embedding.get_weights(all_ranks=True), _dense(model)
        # the same mesh continues exactly (optimizer state included); other meshes get
        # tables and dense weights bit for bit (a row-wise accumulator of a table whose
        # column split changes comes back as a column-weighted mean: docs/checkpoints.md)
        for model_parallel in (2, 4, 1):
            mesh_lib.reset()
            mesh = tfhybrid.init(model_parallel=model_parallel)
            restored, restored_embedding = _model(mesh)
            restored(_batches(mesh, 1, seed=3)[0])
            restore(restored, path)
            for got, want in zip(restored_embedding.get_weights(all_ranks=True),
                                 saved_tables):
                self.assertAllEqual(got, want)
            for got, want in zip(_dense(restored), saved_dense):
                self.assertAllEqual(got, want)
            if model_parallel != 2:
                continue
            _fit(restored, mesh, 1, seed=2)
            moved = [np.max(np.abs(a - b)) for a, b in zip(
                restored_embedding.get_weights(all_ranks=True), saved_tables)]
            self.assertGreater(max(moved), 1e-4, "the step changed nothing")
            for got, want in zip(restored_embedding.get_weights(all_ranks=True),
                                 want_tables):
                self.assertAllClose(got, want, atol=1e-6, rtol=0)
            for got, want in zip(_dense(restored), want_dense):
                self.assertAllClose(got, want, atol=1e-6, rtol=0)
        hvd.join()

    def test_tf_train_checkpoint_restores_onto_other_meshes(self):
        def save(model, prefix):
            return tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(prefix)

        def restore(model, path):
            tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(
                path).assert_existing_objects_matched()

        self._round_trip(save, restore)

    def test_save_weights_restores_onto_other_meshes(self):
        def save(model, prefix):
            # Keras 3 writes a weights file; Keras 2 a TensorFlow checkpoint
            path = prefix + ".weights.h5" if KERAS_3 else prefix
            model.save_weights(path)
            self.assertTrue(os.path.exists(path if KERAS_3
                                           else path + ".index"))
            return path

        self._round_trip(save, lambda model, path: model.load_weights(path))

    def _trained_and_saved(self, name):
        """(mesh, model, its embedding, the weights file) after one step on 2 x 2."""
        mesh = tfhybrid.init(model_parallel=2)
        folder = self._folder()
        model, embedding = _model(mesh)
        _fit(model, mesh, 1, seed=1)
        path = os.path.join(folder, name)
        model.save_weights(path)
        return mesh, model, embedding, path

    def test_optimizer_state_that_does_not_fit_is_refused_by_name(self):
        mesh, _, _, path = self._trained_and_saved("adam.weights.h5")
        # the same model with another optimizer: the tables load, the optimizer's state
        # cannot, and the first step says so instead of training on without it
        other, _ = _model(mesh)
        other.compile(optimizer=tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                      loss="mse")
        other(_batches(mesh, 1, seed=3)[0])
        other.load_weights(path)
        with self.assertRaisesRegex(ValueError, "the weights file holds the optimizer state"):
            _fit(other, mesh, 1, seed=2)
        hvd.join()

    def test_weights_file_holds_whole_tables_written_once(self):
        import h5py
        _, _, embedding, path = self._trained_and_saved("model.weights.h5")
        folder = os.path.dirname(path)
        tables = embedding.get_weights(all_ranks=True)
        with h5py.File(path, "r") as f:
            for t, table in enumerate(tables):
                self.assertAllEqual(f[f"layers/distributed_embedding/vars/table_{t}"][...],
                                    table)
            saved = sorted(f["optimizer/vars"].keys())
        self.assertIn("layer_0_table_0_accumulator", saved)
        # no staging file of any rank is left beside it
        self.assertEqual(sorted(os.listdir(folder)), ["model.weights.h5"])
        hvd.join()


if __name__ == "__main__":
    tf.test.main()
