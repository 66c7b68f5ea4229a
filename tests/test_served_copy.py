"""The served copy's lookups (tfhybrid.serving.served_copy.ServedTables) against training's.

One process, no store: for every combiner, dense bags, ragged bags and one id per
example, with and without per-id weights (weights of 0 and below among them), the plain
TF lookups a SavedModel holds give what ``DistributedEmbedding`` (its C++ kernels) gives
on the same table. They share no arithmetic helper with the kernels' lookups.
"""

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.serving.served_copy import ServedTables

KERAS = (2, 3)
ROWS, WIDTH = 30, 4


def _inputs(rng: np.random.Generator) -> dict:
    lengths = np.array([0, 3, 1, 4, 2])
    count = int(lengths.sum())
    return {
        "dense": (tf.constant(rng.integers(0, ROWS, [5, 3]), tf.int32),
                  tf.constant(rng.choice([-1.0, 0.0, 0.5, 2.0], [5, 3]), tf.float32)),
        "ragged": (tf.RaggedTensor.from_row_lengths(
                       rng.integers(0, ROWS, [count]).astype(np.int32), lengths),
                   tf.RaggedTensor.from_row_lengths(
                       rng.choice([-1.0, 0.0, 0.5, 2.0], [count]).astype(np.float32),
                       lengths)),
        "one": (tf.constant(rng.integers(0, ROWS, [5]), tf.int32),
                tf.constant([2.0, -1.0, 0.0, 0.5, 3.0], tf.float32))}


class ServedTablesTest(tf.test.TestCase):

    def test_lookups_and_combiners_equal_training_layers(self):
        tfhybrid.init(model_parallel=1)
        rng = np.random.default_rng(3)
        for combiner in ("sum", "mean", "sqrtn"):
            layer = DistributedEmbedding([Embedding(
                ROWS, WIDTH, combiner=combiner, name="table",
                embeddings_initializer=tf.keras.initializers.RandomUniform(-1, 1, seed=1))])
            served = None
            for form, (ids, weights) in _inputs(rng).items():
                for weighted in (False, True):
                    with self.subTest(combiner=combiner, ids=form, weighted=weighted):
                        feed = [(ids, weights)] if weighted else [ids]
                        (trained,) = layer(feed)
                        if served is None:
                            served = ServedTables("table", {0: layer.get_weights()[0]},
                                                  [(0, combiner, WIDTH, False)], "float32")
                        (got,) = served(feed)
                        self.assertEqual(got.shape, trained.shape)
                        self.assertAllClose(got, trained, rtol=1e-6, atol=1e-6)
                        # the weights matter: a weighted bag differs from an unweighted one
                        if weighted and form != "one" or combiner == "sum" and weighted:
                            (plain,) = served([ids])
                            self.assertGreater(float(tf.reduce_max(tf.abs(got - plain))), 0.0)


if __name__ == "__main__":
    tf.test.main()
