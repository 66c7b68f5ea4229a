"""tfhybrid.keras_rs.DistributedEmbedding on 2 x 2 (4 ranks) equals keras-rs's own layer
in one process on the global batch.

The keras-rs DCN model of tests/_keras_rs_case.py with per-id weights beside every
feature (a weighted sum, means and sqrtn bags), its tables row-sliced, column-sliced,
table-wise and replicated, built on a 2 x 2 mesh (both layouts) with the one import
changed: its outputs, and its tables and dense weights after 10 steps, equal keras-rs's
layer trained on the global batch in one process, within 1e-6: under ``fit`` and in a
custom loop (``tfhybrid.DistributedOptimizer``'s route), with SGD for everything (as
keras-rs on CPUs) and with the tables' own Adam beside the dense layers' SGD
(``table_optimizers="honour"``, as keras-rs on TPUs), on both layouts: every pair of
those once. Every rank trains that reference itself (keras-rs's layer runs no
collective). A checkpoint of the 2 x 2 model restores its tables on 1 x 4.
"""

import os
import shutil
import tempfile

import horovod.tensorflow as hvd
import keras
import keras_rs
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import keras_rs as tk
from tfhybrid import mesh as mesh_lib
from tests import _keras_rs_case as case

HOROVOD_NP = (4,)
KERAS = (3,)        # keras-rs needs Keras 3
TOLERANCE = 1e-6
LOCAL_BATCH = 4
STEPS = 10
LEARNING_RATE = 0.05


def make_table_optimizer():
    return keras.optimizers.Adam(0.01)


class KerasRsOnTheMeshTest(tf.test.TestCase):

    def test_2x2_equals_keras_rs_on_the_global_batch(self):
        world = HOROVOD_NP[0]
        data = case.data(LOCAL_BATCH * world * STEPS, seed=7, weighted=True)
        # keras-rs's run in one process depends on the tables' optimizer only
        references = {honour: self._reference(data, world, honour)
                      for honour in (False, True)}
        # layout x fit or loop x the tables' optimizer, every pair once
        for layout, loop, honour in (("model_major", False, False),
                                     ("model_major", True, True),
                                     ("data_major", False, True),
                                     ("data_major", True, False)):
            with self.subTest(layout=layout, loop=loop, honour=honour):
                self._check(layout, loop, honour, data, references[honour])

    @staticmethod
    def _reference(data, world, honour):
        """keras-rs's layer in one process on the global batches: its outputs on the
        first one before training, its initial and trained tables, its dense weights."""
        x, y = data
        configs = case.feature_configs(optimizer=make_table_optimizer())
        model, layer = case.model(keras_rs.layers.DistributedEmbedding, configs,
                                  weighted=True)
        first = np.asarray(model(case.tensors(case.rows(x, 0, LOCAL_BATCH * world))))
        initial = case.tables(layer)
        case.train_reference(model, layer, x, y, LOCAL_BATCH * world,
                             keras.optimizers.SGD(LEARNING_RATE),
                             make_table_optimizer if honour else None)
        return first, initial, case.tables(layer), case.dense_weights(model)

    def _check(self, layout, loop, honour, data, reference):
        want_first, initial, theirs, their_dense = reference
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=2, layout=layout)
        configs = case.feature_configs(optimizer=make_table_optimizer())
        ours, our_layer = case.model(tk.DistributedEmbedding, configs, weighted=True,
                                     mesh=mesh, sharding=case.SHARDING,
                                     table_optimizers="honour" if honour else "model")
        kinds = {t.name: t.kind for t in our_layer.plan.tables}
        self.assertEqual(kinds, {"country": "data_parallel", "item": "column_wise",
                                 "user": "row_wise", "words": "table_wise"})

        # forward: this rank's outputs on its share of the first global batch
        mine_x, mine_y = case.local_share(*data, LOCAL_BATCH, mesh.rank, mesh.size)
        first = case.rows(mine_x, 0, LOCAL_BATCH)
        mine = slice(mesh.rank * LOCAL_BATCH, (mesh.rank + 1) * LOCAL_BATCH)
        self.assertAllClose(ours(case.tensors(first)), want_first[mine], atol=TOLERANCE,
                            rtol=0)

        optimizer = tfhybrid.DistributedOptimizer(
            keras.optimizers.SGD(LEARNING_RATE),
            embedding_optimizer=our_layer.table_optimizer if honour else None)
        if loop:
            self._train_in_a_loop(ours, optimizer, mine_x, mine_y)
        else:
            ours.compile(optimizer=optimizer, loss="mse")
            ours.fit(case.dataset(mine_x, mine_y, LOCAL_BATCH), epochs=1, verbose=0)

        trained = case.tables(our_layer)
        self.assertEqual(sorted(trained), sorted(theirs))
        for name in theirs:
            self.assertAllClose(trained[name], theirs[name], atol=TOLERANCE, rtol=0,
                                msg=name)
            # the tables trained: rows moved from their initial values
            self.assertGreater(np.abs(trained[name] - initial[name]).max(), 1e-5, name)
        self.assertAllClose(case.dense_weights(ours), their_dense, atol=TOLERANCE, rtol=0)
        # every rank holds the same dense weights
        everyone = hvd.allgather_object(case.dense_weights(ours)[0])
        for other in everyone:
            self.assertAllEqual(other, everyone[0])
        if layout == "data_major" and honour:
            self._check_restored_on_1x4(ours, trained, configs)

    def _check_restored_on_1x4(self, model, trained, configs):
        """A checkpoint of the 2 x 2 model restores the same tables on 1 x 4."""
        folder = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
        if hvd.rank() == 0:
            self.addCleanup(shutil.rmtree, folder, ignore_errors=True)
        path = tf.train.Checkpoint(model=model).save(os.path.join(folder, "ckpt"))
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=4)
        restored, layer = case.model(tk.DistributedEmbedding, configs, weighted=True,
                                     mesh=mesh, sharding=case.SHARDING)
        tf.train.Checkpoint(model=restored).restore(path).assert_existing_objects_matched()
        tables = case.tables(layer)
        for name in trained:
            self.assertAllEqual(tables[name], trained[name], msg=name)
        for got, want in zip(case.dense_weights(restored), case.dense_weights(model)):
            self.assertAllEqual(got, want)
        hvd.join()

    def _train_in_a_loop(self, model, optimizer, x, y):
        """Steps of a custom loop whose ``optimizer.apply_gradients`` runs the route."""

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.mean_squared_error(
                    y, model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        for s in range(STEPS):
            step(case.tensors(case.rows(x, s * LOCAL_BATCH, (s + 1) * LOCAL_BATCH)),
                 y[s * LOCAL_BATCH:(s + 1) * LOCAL_BATCH])


if __name__ == "__main__":
    tf.test.main()
