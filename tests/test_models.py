"""DLRM and DCN-v2: shapes, the dot interaction, config round trips, serving export."""

import tempfile

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.train.models import (DCNv2, DLRM, DotInteraction, build_model,
                                   export_for_serving, serving_copy)

KERAS_3 = tfhybrid.keras_major() == 3

ROWS = [50, 7, 300]


def _batch(n=16, seed=0):
    rng = np.random.default_rng(seed)
    features = {"dense": tf.constant(rng.random([n, 5]), tf.float32),
                "categorical": tf.constant(np.stack([rng.integers(0, r, n) for r in ROWS], 1),
                                           tf.int32)}
    labels = tf.constant(rng.integers(0, 2, [n, 1]), tf.float32)
    return features, labels


def _model(kind, **kwargs):
    if kind == "dlrm":
        return DLRM(ROWS, 5, 4, bottom_mlp_dims=[8, 4], top_mlp_dims=[8, 1], **kwargs)
    return DCNv2(ROWS, 5, 4, num_cross_layers=2, top_mlp_dims=[8, 1], **kwargs)


class ModelsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        tfhybrid.init(model_parallel=1)

    def tearDown(self):
        mesh_lib.reset()
        tf.keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    def test_dot_interaction_is_pairwise_dots(self):
        rng = np.random.default_rng(1)
        vectors = [rng.normal(size=[3, 4]).astype(np.float32) for _ in range(4)]
        out = DotInteraction()([tf.constant(v) for v in vectors]).numpy()
        pairs = [np.sum(vectors[i] * vectors[j], axis=1) for i in range(4) for j in range(i)]
        expected = np.concatenate([vectors[0], np.stack(pairs, 1)], axis=1)
        self.assertAllClose(out, expected, atol=1e-5)

    def test_logits_shape_and_dtype_under_mixed_precision(self):
        tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
        for kind in ("dlrm", "dcnv2"):
            logits = _model(kind)(_batch()[0])
            self.assertEqual(logits.shape, (16, 1))
            self.assertEqual(logits.dtype, tf.float32)

    def test_seeded_models_start_equal_and_config_round_trips(self):
        for kind in ("dlrm", "dcnv2"):
            first = _model(kind, seed=3)
            features = _batch()[0]
            expected = first(features).numpy()
            again = type(first).from_config(first.get_config())
            self.assertAllClose(again(features).numpy(), expected, atol=1e-6)
            other_seed = _model(kind, seed=4)
            self.assertNotAllClose(other_seed(features).numpy(), expected)

    def test_xla_towers_equal_plain(self):
        for kind in ("dlrm", "dcnv2"):
            features = _batch()[0]
            self.assertAllClose(_model(kind, xla=True)(features).numpy(),
                                _model(kind)(features).numpy(), atol=1e-5)

    def test_export_gives_the_trained_models_predictions(self):
        for kind, xla in (("dlrm", True), ("dcnv2", False)):
            model = _model(kind, xla=xla)
            model.compile(optimizer=tfhybrid.DistributedOptimizer(
                tf.keras.optimizers.SGD(0.5)),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
            features, labels = _batch(64)
            model.fit(features, labels, batch_size=16, epochs=2, verbose=0)
            expected = tf.sigmoid(model(features)).numpy()
            with tempfile.TemporaryDirectory() as export_dir:
                export_for_serving(model, export_dir)
                loaded = tf.saved_model.load(export_dir)
                got = loaded.signatures["serving_default"](**features)["probability"]
            self.assertAllClose(got.numpy(), expected, atol=1e-6)
            # the copy really holds the trained tables, not fresh ones
            copy = serving_copy(model, model.embedding.get_weights())
            trained = model.embedding.get_weights()
            for t, table in enumerate(copy.embedding.tables):
                self.assertAllEqual(table.get_weights()[0], trained[t])

    def test_cross_layers_compute_what_tf_recommenders_does(self):
        # TF Recommenders is the reference; it imports under Keras 2 only
        if KERAS_3:
            self.skipTest("tensorflow_recommenders refuses Keras 3 (its own import check)")
        import tensorflow_recommenders as tfrs
        from tfhybrid.train.models import Cross
        rng = np.random.default_rng(2)
        x0, x = (tf.constant(rng.normal(size=[6, 10]), tf.float32) for _ in range(2))
        for projection_dim in (None, 3):
            ours = Cross(projection_dim, seed=11)
            theirs = tfrs.layers.dcn.Cross(
                projection_dim=projection_dim,
                kernel_initializer=tf.keras.initializers.GlorotUniform(11))
            self.assertAllClose(ours(x0, x).numpy(), theirs(x0, x).numpy(), atol=0, rtol=0)
            self.assertEqual([w.shape for w in ours.weights],
                             [w.shape for w in theirs.weights])

    def test_bad_arguments_name_the_value(self):
        with self.assertRaisesRegex(ValueError, r"bottom_mlp_dims=\[8, 3\].*embedding_dim=4"):
            DLRM(ROWS, 5, 4, bottom_mlp_dims=[8, 3])
        with self.assertRaisesRegex(ValueError, r"top_mlp_dims=\[8, 2\]"):
            DCNv2(ROWS, 5, 4, top_mlp_dims=[8, 2])
        with self.assertRaisesRegex(ValueError, r"table_rows=\[50, 0\]"):
            DCNv2([50, 0], 5, 4)
        with self.assertRaisesRegex(ValueError, "model='wide'"):
            build_model("wide", ROWS, 5, embedding_dim=4)
        with self.assertRaisesRegex(ValueError, r"shape \(16, 2\); expected \[batch, 3\]"):
            _model("dlrm")({"dense": tf.zeros([16, 5]),
                            "categorical": tf.zeros([16, 2], tf.int32)})


class ExamplesTest(tf.test.TestCase):

    def test_docstring_examples_run(self):
        # the examples of the app's models and of the test helpers tests rely on
        import doctest
        from tfhybrid.testing import graphs
        from tfhybrid.train import data, models
        for module in (models, data, graphs):
            result = doctest.testmod(module)
            self.assertGreater(result.attempted, 0, module.__name__)
            self.assertEqual(result.failed, 0, module.__name__)


if __name__ == "__main__":
    tf.test.main()
