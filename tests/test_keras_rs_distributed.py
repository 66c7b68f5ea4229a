"""tfhybrid.keras_rs.DistributedEmbedding on 2 x 2 (4 ranks) equals keras-rs's own layer
in one process on the global batch.

The keras-rs DCN model of tests/_keras_rs_case.py with per-id weights beside every
feature (a weighted sum, means and sqrtn bags), its tables row-sliced, column-sliced,
table-wise and replicated, built on a 2 x 2 mesh (both layouts) with the one import
changed: its outputs, and its tables and dense weights after 10 steps, equal keras-rs's
layer trained on the global batch in one process, within 1e-6: under ``fit`` and in a
custom loop (``tfhybrid.DistributedOptimizer``'s route), with SGD for everything (as
keras-rs on CPUs), with the tables' own Adam beside the dense layers' SGD, and with a
different optimizer on each table (SGD, Adagrad, Adam, FTRL; both
``table_optimizers="honour"``, as keras-rs on TPUs), on both layouts: every pair of
layout and loop once for SGD and for the tables' own, and Adam on every table once.
Every rank trains that reference itself (keras-rs's layer runs no collective; the
tables' own optimizers are applied by hand, each to its table). A checkpoint of the
2 x 2 model with a different optimizer on each table restores its tables and every
table's optimizer state on 1 x 4, equal to the reference's.
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


# how the tables are trained: by the model's optimizer, by Adam each (one embedding
# optimizer), or each by its own (case.MIXED_OPTIMIZERS, one per table)
TABLE_OPTIMIZERS = {"model": None, "adam": make_table_optimizer,
                    "mixed": case.MIXED_OPTIMIZERS}


def table_configs(tables):
    own = TABLE_OPTIMIZERS[tables]
    return case.feature_configs(optimizer={n: make() for n, make in own.items()}
                                if isinstance(own, dict) else make_table_optimizer())


class KerasRsOnTheMeshTest(tf.test.TestCase):

    def test_2x2_equals_keras_rs_on_the_global_batch(self):
        world = HOROVOD_NP[0]
        data = case.data(LOCAL_BATCH * world * STEPS, seed=7, weighted=True)
        # keras-rs's run in one process depends on the tables' optimizers only
        references = {tables: self._reference(data, world, tables)
                      for tables in TABLE_OPTIMIZERS}
        # layout x fit or loop x the model's or the tables' own optimizers, every pair
        # once; Adam on every table (one embedding optimizer) once
        for layout, loop, tables in (("model_major", False, "model"),
                                     ("model_major", True, "mixed"),
                                     ("data_major", False, "mixed"),
                                     ("data_major", True, "model"),
                                     ("data_major", True, "adam")):
            with self.subTest(layout=layout, loop=loop, tables=tables):
                self._check(layout, loop, tables, data, references[tables])

    @staticmethod
    def _reference(data, world, tables):
        """keras-rs's layer in one process on the global batches: its outputs on the
        first one before training, its initial and trained tables, its dense weights,
        and each table's optimizer slots by slot name (none for "model")."""
        x, y = data
        model, layer = case.model(keras_rs.layers.DistributedEmbedding,
                                  table_configs(tables), weighted=True)
        first = np.asarray(model(case.tensors(case.rows(x, 0, LOCAL_BATCH * world))))
        initial = case.tables(layer)
        owners = case.train_reference(model, layer, x, y, LOCAL_BATCH * world,
                                      keras.optimizers.SGD(LEARNING_RATE),
                                      TABLE_OPTIMIZERS[tables])
        variables = {v.path.split("/")[-2]: v for v in layer.trainable_variables}
        slots = {name: case.slots(owner, variables[name]) for name, owner in owners.items()}
        return first, initial, case.tables(layer), case.dense_weights(model), slots

    def _check(self, layout, loop, tables, data, reference):
        want_first, initial, theirs, their_dense, their_slots = reference
        honour = tables != "model"
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=2, layout=layout)
        configs = table_configs(tables)
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
        if layout == "data_major" and tables == "mixed":
            self._check_restored_on_1x4(ours, our_layer, optimizer, trained, configs,
                                        their_slots)

    def _check_restored_on_1x4(self, model, our_layer, optimizer, trained, configs,
                               their_slots):
        """A checkpoint of the 2 x 2 model and its optimizer holds each table's slots
        equal to the reference's, and restores the same tables and slots on 1 x 4."""
        folder = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
        if hvd.rank() == 0:
            self.addCleanup(shutil.rmtree, folder, ignore_errors=True)
        path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
            os.path.join(folder, "ckpt"))
        saved = self._table_slots(path, [t.name for t in our_layer.plan.tables])
        # SGD keeps no slots; the others keep theirs, as the reference's
        self.assertEqual({n: sorted(s) for n, s in saved.items()},
                         {n: sorted(s) for n, s in their_slots.items() if s})
        for name, slots in saved.items():
            for slot, value in slots.items():
                self.assertAllClose(value, their_slots[name][slot], atol=TOLERANCE, rtol=0,
                                    msg=f"{name} {slot}")
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=4)
        restored, layer = case.model(tk.DistributedEmbedding, configs, weighted=True,
                                     mesh=mesh, sharding=case.SHARDING,
                                     table_optimizers="honour")
        again = tfhybrid.DistributedOptimizer(keras.optimizers.SGD(LEARNING_RATE),
                                              embedding_optimizer=layer.table_optimizer)
        tf.train.Checkpoint(model=restored, optimizer=again).restore(
            path).assert_existing_objects_matched()
        again.build(restored.trainable_variables)   # the slots, restored as they are made
        tables = case.tables(layer)
        for name in trained:
            self.assertAllEqual(tables[name], trained[name], msg=name)
        for got, want in zip(case.dense_weights(restored), case.dense_weights(model)):
            self.assertAllEqual(got, want)
        # saved again on 1 x 4, every table's slots are the ones restored
        resaved = self._table_slots(tf.train.Checkpoint(model=restored, optimizer=again).save(
            os.path.join(folder, "again")), [t.name for t in layer.plan.tables])
        self.assertEqual(sorted(resaved), sorted(saved))
        for name, slots in saved.items():
            self.assertEqual(sorted(resaved[name]), sorted(slots), name)
            for slot, value in slots.items():
                self.assertAllEqual(resaved[name][slot], value, msg=f"{name} {slot}")
        hvd.join()

    @staticmethod
    def _table_slots(path, names):
        """Table name -> slot name -> the full slot a checkpoint holds (its tables'
        slots are saved whole, ``table_<t>_<slot>``, t the table's place in the plan)."""
        found = {}
        for key, _ in tf.train.list_variables(path):
            if "tfhybrid_table_slots" not in key:
                continue
            t, slot = key.rsplit("/", 1)[1][len("table_"):].split("_", 1)
            found.setdefault(names[int(t)], {})[slot] = tf.train.load_variable(path, key)
        return found

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
