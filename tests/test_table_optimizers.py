"""Per-table optimizers for plain tfhybrid (``embedding_optimizer={"table": optimizer}``),
in one process, under both Kerases.

Each table trained by its own optimizer equals the same tables as plain variables, each
given its gradient (rows summed) by its own Keras optimizer by hand; a checkpoint
restored before the first step trains on exactly as the uninterrupted run; a table
without an optimizer and a loss-scaling one raise ``ValueError`` naming them. (keras-rs's
per-table optimizers on 2 x 2: tests/test_keras_rs_distributed.py.)
"""

import os

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib

KERAS = (2, 3)
TOLERANCE = 1e-6
ROWS = {"users": 30, "items": 20}
DIM = 4
STEPS = 5


def optimizers():
    return {"users": tf.keras.optimizers.Adagrad(0.3),
            "items": tf.keras.optimizers.Ftrl(0.3, l1_regularization_strength=0.01)}


def batches():
    rng = np.random.default_rng(3)
    return [{name: tf.constant(rng.integers(0, rows, [8, 3]), tf.int32)
             for name, rows in ROWS.items()} for _ in range(STEPS + 1)]


# a fixed projection of the embeddings, so the loss gives every row its own gradient
PROJECTION = tf.constant(np.random.default_rng(4).normal(size=[DIM, 1]), tf.float32)


def loss_of(outputs):
    return tf.add_n([tf.reduce_sum(tf.square(tf.matmul(out, PROJECTION) - 1.0))
                     for out in outputs])


class PerTableOptimizersTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        mesh_lib.reset()
        tfhybrid.init(model_parallel=1)

    def _ours(self, given=None):
        layer = tfhybrid.layers.DistributedEmbedding([
            tfhybrid.layers.Embedding(
                rows, DIM, combiner="sum", name=name,
                embeddings_initializer=tf.keras.initializers.RandomUniform(seed=i + 1))
            for i, (name, rows) in enumerate(ROWS.items())])
        layer([tf.zeros([1, 3], tf.int32)] * len(ROWS))
        optimizer = tfhybrid.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.1),
            embedding_optimizer=optimizers() if given is None else given)
        return layer, optimizer

    @staticmethod
    def _step(layer, optimizer, batch):
        with tf.GradientTape() as tape:
            loss = loss_of(layer([batch[name] for name in ROWS]))
        variables = layer.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    def test_each_table_trains_as_with_its_own_optimizer(self):
        layer, optimizer = self._ours()
        initial = layer.get_weights()
        tables = [tf.Variable(w) for w in initial]
        owners = [optimizers()[name] for name in ROWS]
        for batch in batches()[:STEPS]:
            self._step(layer, optimizer, batch)
            with tf.GradientTape() as tape:
                loss = loss_of([tf.reduce_sum(tf.gather(table, batch[name]), axis=1)
                                for table, name in zip(tables, ROWS)])
            for owner, table, grad in zip(owners, tables, tape.gradient(loss, tables)):
                # each row's gradient summed first, as the route hands it over
                owner.apply_gradients([(tf.convert_to_tensor(grad), table)])
        for ours, theirs, start, name in zip(layer.get_weights(), tables, initial, ROWS):
            self.assertAllClose(ours, theirs, atol=TOLERANCE, rtol=0, msg=name)
            self.assertGreater(np.abs(ours - start).max(), 1e-3, name)   # it trained
        per_table = optimizer.embedding_optimizer
        self.assertEqual(sorted(type(o).__name__ for o in per_table.optimizers),
                         ["Adagrad", "Ftrl"])

    def test_a_checkpoint_restored_before_the_first_step_trains_on_alike(self):
        data = batches()
        layer, optimizer = self._ours()
        for batch in data[:STEPS]:
            self._step(layer, optimizer, batch)
        path = tf.train.Checkpoint(layer=layer, optimizer=optimizer).save(
            os.path.join(self.get_temp_dir(), "ckpt"))
        restored, again = self._ours()
        tf.train.Checkpoint(layer=restored, optimizer=again).restore(
            path).assert_existing_objects_matched()
        for l, o in ((layer, optimizer), (restored, again)):
            self._step(l, o, data[STEPS])
        for got, want, name in zip(restored.get_weights(), layer.get_weights(), ROWS):
            self.assertAllEqual(got, want, msg=name)

    def test_a_table_without_an_optimizer_an_unknown_key_and_loss_scaling_raise(self):
        layer, optimizer = self._ours(given={"users": tf.keras.optimizers.Adagrad(0.1)})
        with self.assertRaisesRegex(ValueError, "items' has no optimizer"):
            self._step(layer, optimizer, batches()[0])
        layer, optimizer = self._ours(given={"users": tf.keras.optimizers.Adagrad(0.1),
                                             "items": tf.keras.optimizers.Adam(0.1),
                                             "itmes": tf.keras.optimizers.SGD(0.1)})
        with self.assertRaisesRegex(ValueError, r"name \['itmes'\], which no built"):
            self._step(layer, optimizer, batches()[0])
        scaled = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam())
        with self.assertRaisesRegex(ValueError, "table 'items'.*plain Keras optimizer"):
            tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                          embedding_optimizer={"items": scaled})


if __name__ == "__main__":
    tf.test.main()
