"""XLA: dense towers compiled, collectives outside; jit_compile on the model is refused."""

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding, XlaCompiled
from tfhybrid.train.step import click_train_step

HOROVOD_NP = (1, 2)


def _tower():
    return tf.keras.Sequential([
        tf.keras.layers.Dense(16, activation="relu", kernel_initializer="glorot_uniform"),
        tf.keras.layers.Dense(1)])


class XlaTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _train(self, mesh, tower, steps=4):
        embedding = DistributedEmbedding(
            [Embedding(200, 8, combiner="sum", name="a"), Embedding(60, 4, combiner="mean",
                                                                     name="b")], mesh=mesh)
        rng = np.random.default_rng(mesh.rank)
        batches = [([tf.constant(rng.integers(0, 60, size=[8, 3]))] * 2,
                    tf.constant(rng.integers(0, 2, size=[8, 1]).astype(np.float32)))
                   for _ in range(steps)]
        embedding(batches[0][0])
        init = np.random.default_rng(9)
        embedding.set_weights([init.normal(0, 0.1, [200, 8]).astype(np.float32),
                               init.normal(0, 0.1, [60, 4]).astype(np.float32)])
        tower(tf.zeros([1, 12]))
        tower.set_weights([init.normal(0, 0.3, w.shape).astype(np.float32)
                           for w in tower.get_weights()])
        optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.2), mesh=mesh)
        step = tf.function(lambda ids, labels: click_train_step(embedding, tower, optimizer,
                                                                ids, labels))
        return [float(step(ids, labels)) for ids, labels in batches]

    def test_xla_tower_equals_plain_tower(self):
        world = tfhybrid.init(model_parallel=1).size
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=world)
        plain = self._train(mesh, _tower())
        compiled = self._train(mesh, XlaCompiled(_tower()))
        self.assertAllClose(compiled, plain, atol=1e-5, rtol=1e-5)
        self.assertNotAllClose(plain[0], plain[-1])  # it trained

    def test_model_jit_compile_raises_what_to_do(self):
        mesh = tfhybrid.init(model_parallel=1)
        ids = tf.keras.Input([2], dtype=tf.int64)
        out = DistributedEmbedding([Embedding(10, 4, combiner="sum")], mesh=mesh)([ids])[0]
        model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(out))
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        with self.assertRaisesRegex(ValueError, r"XlaCompiled"):
            model.fit(np.ones([4, 2], np.int64), np.ones([4, 1]), verbose=0)


if __name__ == "__main__":
    tf.test.main()
