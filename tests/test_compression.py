"""DCT's mechanics on one process (tfhybrid/compression.py, issue 14).

The multi-rank behaviour (the route, the layer's alltoall, bytes) is in test_dct.py.
"""

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import compression
from tfhybrid import mesh as mesh_lib
from tfhybrid.compression import DCT
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.train import app as train_app


class ConfigTest(tf.test.TestCase):

    def test_round_trip_and_defaults(self):
        dct = DCT(dp_keep=0.01, mp_keep=None, refresh_every=7)
        self.assertEqual(DCT.from_config(dct.get_config()), dct)
        self.assertEqual(compression.as_dct(dct.get_config()), dct)
        self.assertIsNone(compression.as_dct(None))
        # a model's options dict arrives wrapped by TF's tracking (not a Mapping)
        holder = tf.Module()
        holder.options = {"dct": dct.get_config()}
        self.assertEqual(compression.as_dct(holder.options["dct"]), dct)
        # numpy scalars (a sweep's values) become plain numbers, so configs stay JSON
        config = DCT(dp_keep=np.float32(0.5), refresh_every=np.int64(3)).get_config()
        self.assertEqual(config, {"dp_keep": 0.5, "mp_keep": 0.02, "refresh_every": 3})
        self.assertIs(type(config["refresh_every"]), int)

    def test_bad_values_name_the_value(self):
        for bad, word in ((dict(dp_keep=0.0), "dp_keep=0.0"), (dict(mp_keep=1.5), "mp_keep=1.5"),
                          (dict(dp_keep=True), "dp_keep=True"),
                          (dict(refresh_every=0), "refresh_every=0"),
                          (dict(refresh_every=2.0), "refresh_every=2.0")):
            with self.assertRaisesRegex(ValueError, word):
                DCT(**bad)
        with self.assertRaisesRegex(ValueError, "unknown DCT settings"):
            DCT.from_config({"dp_keep": 0.1, "keep": 0.2})
        with self.assertRaisesRegex(ValueError, "dct=0.1"):
            compression.as_dct(0.1)

    def test_kept_count(self):
        self.assertEqual(compression.kept_count(1000, 0.003), 3)
        self.assertEqual(compression.kept_count(10, 0.001), 1)     # at least one
        self.assertEqual(compression.kept_count(10, 1.0), 10)
        self.assertEqual(compression.kept_count(0, 0.5), 0)
        self.assertEqual(compression.position_dtype(256), tf.uint8)
        self.assertEqual(compression.position_dtype(257), tf.int16)
        self.assertEqual(compression.position_dtype(40000), tf.int32)

    def test_layer_config_round_trips(self):
        tfhybrid.init(model_parallel=1)
        try:
            layer = DistributedEmbedding([Embedding(10, 4, combiner="sum")],
                                         dct=DCT(dp_keep=None, mp_keep=0.25))
            config = layer.get_config()
            self.assertEqual(config["dct"], {"dp_keep": None, "mp_keep": 0.25,
                                             "refresh_every": 2000})
            self.assertEqual(DistributedEmbedding.from_config(config).dct, layer.dct)
        finally:
            mesh_lib.reset()

    def test_app_flags_are_checked(self):
        for name in ("dct_dp_keep", "dct_mp_keep"):
            with self.assertRaisesRegex(ValueError, f"--{name}=0.0 must be a fraction"):
                train_app.TrainConfig(**{name: 0.0}).validate()
        with self.assertRaisesRegex(ValueError, "--dct_refresh_every=0"):
            train_app.TrainConfig(dct_refresh_every=0).validate()

    def test_tape_without_optimizer_refuses_dp_thresholding(self):
        tfhybrid.init(model_parallel=1)
        try:
            with self.assertRaisesRegex(ValueError, "pass the optimizer too"):
                tfhybrid.DistributedGradientTape(tf.GradientTape(), dct=DCT())
        finally:
            mesh_lib.reset()


class PerSampleTopKTest(tf.test.TestCase):
    """DCT-MP's selection: values + positions forward, the same positions backward."""

    def test_keeps_each_rows_largest_entries(self):
        rows = tf.constant(np.random.default_rng(0).normal(size=[3, 5, 40]), tf.float32)
        values, positions = compression.keep_largest(rows, 0.1)     # 4 of 40
        self.assertEqual(values.shape, [3, 5, 4])
        self.assertEqual(positions.dtype, tf.uint8)
        rebuilt = compression.scatter_kept(values, positions, 40).numpy()
        x = rows.numpy()
        fourth = np.sort(np.abs(x), axis=-1)[..., -4:-3]
        self.assertAllEqual(rebuilt, np.where(np.abs(x) >= fourth, x, 0.0))

    def test_backward_mask_equals_forward_mask(self):
        rows = tf.constant(np.random.default_rng(1).normal(size=[6, 30]), tf.float32)
        upstream = tf.constant(np.random.default_rng(2).normal(size=[6, 30]), tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(rows)
            values, positions = compression.keep_largest(rows, 0.2)
            rebuilt = compression.scatter_kept(values, positions, 30)
            loss = tf.reduce_sum(rebuilt * upstream)
        grad = tape.gradient(loss, rows).numpy()
        sent = rebuilt.numpy() != 0
        self.assertAllEqual(grad, np.where(sent, upstream.numpy(), 0.0))
        self.assertEqual(int(sent.sum()), 6 * 6)

    def test_keep_one_sends_everything_unchanged(self):
        rows = tf.constant(np.random.default_rng(3).normal(size=[4, 9]), tf.float32)
        values, positions = compression.keep_largest(rows, 1.0)
        self.assertAllEqual(compression.scatter_kept(values, positions, 9), rows)


def _select(thresholder, grad, var, refresh, **kwargs):
    """One step's selection, stored as the route does for a step that applies."""
    mask, kept = thresholder.select(grad, var, refresh, **kwargs)
    thresholder.commit(tf.constant(True))
    return mask, kept


class GradientThresholderTest(tf.test.TestCase):
    """DCT-DP's selection and residual on one rank."""

    def test_residual_accounts_for_every_entry(self):
        thresholder = compression.GradientThresholder(DCT(dp_keep=0.1, refresh_every=4))
        var = tf.Variable(tf.zeros([10, 8]))
        rng = np.random.default_rng(4)
        raw, sent = np.zeros([80]), np.zeros([80])
        for step in range(13):
            grad = rng.normal(size=[10, 8]).astype(np.float32)
            raw += grad.reshape(-1)
            refresh = thresholder.begin_step()
            self.assertEqual(bool(refresh), step % 4 == 0)
            mask, kept = _select(thresholder, tf.constant(grad), var, refresh)
            self.assertAllEqual(kept.numpy() != 0, mask.numpy())
            if step % 4 == 0:
                self.assertEqual(int(mask.numpy().sum()), 8)      # the top 10% exactly
            sent += kept.numpy()
        residual = thresholder.residual(var).numpy().reshape(-1)
        self.assertAllClose(sent, raw - residual, atol=1e-6, rtol=0)
        self.assertGreater(np.abs(residual).sum(), 0)

    def test_threshold_is_recomputed_when_the_kept_share_drifts(self):
        thresholder = compression.GradientThresholder(DCT(dp_keep=0.05, refresh_every=1000))
        var = tf.Variable(tf.zeros([400]))
        rng = np.random.default_rng(5)
        target = compression.kept_count(400, 0.05)
        for _ in range(40):
            grad = tf.constant(rng.normal(size=[400]).astype(np.float32))
            mask, _ = _select(thresholder, grad, var, thresholder.begin_step())
            self.assertLessEqual(int(mask.numpy().sum()), int(compression.KEPT_DRIFT * target))

    def test_keep_one_sends_the_gradient_as_it_is(self):
        thresholder = compression.GradientThresholder(DCT(dp_keep=1.0))
        var = tf.Variable(tf.zeros([5, 3]))
        grad = tf.constant(np.random.default_rng(6).normal(size=[5, 3]), tf.float32)
        for _ in range(3):
            mask, kept = _select(thresholder, grad, var, thresholder.begin_step())
            self.assertAllEqual(tf.reshape(kept, [5, 3]), grad)
            self.assertAllEqual(thresholder.residual(var), tf.zeros([5, 3]))

    def test_overflow_sends_one_marker_and_leaves_the_state_alone(self):
        thresholder = compression.GradientThresholder(DCT(dp_keep=0.25))
        var = tf.Variable(tf.zeros([8]))
        first = tf.constant([1.0, -2.0, 3.0, 0.5, 0.1, -0.2, 0.3, 4.0])
        _select(thresholder, first, var, thresholder.begin_step())
        residual = thresholder.residual(var).numpy().copy()
        bad = tf.constant([0.0, np.inf, 0.0, 0.0, np.nan, 0.0, 0.0, 0.0], tf.float32)
        mask, kept = _select(thresholder, bad, var, thresholder.begin_step())
        # the first non-finite entry goes (every rank learns of the overflow), not all
        self.assertTrue(mask.numpy()[1])
        self.assertFalse(mask.numpy()[4])
        self.assertTrue(np.isinf(kept.numpy()[1]))
        self.assertAllEqual(thresholder.residual(var), residual)

    def test_a_skipped_step_keeps_the_residual(self):
        thresholder = compression.GradientThresholder(DCT(dp_keep=0.25))
        var = tf.Variable(tf.zeros([8]))
        grad = tf.constant([1.0, -2.0, 3.0, 0.5, 0.1, -0.2, 0.3, 4.0])
        _select(thresholder, grad, var, thresholder.begin_step())
        residual = thresholder.residual(var).numpy().copy()
        self.assertGreater(np.abs(residual).sum(), 0)
        # another rank overflowed: the route commits False, the step is not applied
        thresholder.select(grad, var, thresholder.begin_step())
        thresholder.commit(tf.constant(False))
        self.assertAllEqual(thresholder.residual(var), residual)

    def test_zeros_are_never_sent(self):
        # fewer non-zero entries than the target: a threshold of zero must not send all
        thresholder = compression.GradientThresholder(DCT(dp_keep=0.5))
        var = tf.Variable(tf.zeros([100]))
        grad = np.zeros([100], np.float32)
        grad[[3, 50]] = [1.0, -2.0]
        for _ in range(3):
            mask, kept = _select(thresholder, tf.constant(grad), var,
                                 thresholder.begin_step())
            self.assertEqual(int(mask.numpy().sum()), 2)
            self.assertAllEqual(kept, grad)

    def test_half_precision_gradients_keep_a_float32_residual(self):
        thresholder = compression.GradientThresholder(DCT(dp_keep=0.1))
        var = tf.Variable(tf.zeros([20]))
        grad = tf.constant(np.linspace(1e-4, 2e-3, 20), tf.float16)
        _, kept = _select(thresholder, grad, var, thresholder.begin_step())
        self.assertEqual(kept.dtype, tf.float16)
        self.assertEqual(thresholder.residual(var).dtype, tf.float32)
        self.assertAllClose(thresholder.residual(var).numpy() + kept.numpy(),
                            grad.numpy(), atol=1e-6, rtol=0)

    def test_loss_scale_does_not_move_the_threshold(self):
        grads = [tf.constant(np.random.default_rng(7 + i).normal(size=[50]), tf.float32)
                 for i in range(5)]
        plain = compression.GradientThresholder(DCT(dp_keep=0.1))
        scaled = compression.GradientThresholder(DCT(dp_keep=0.1))
        a, b = tf.Variable(tf.zeros([50])), tf.Variable(tf.zeros([50]))
        for g in grads:
            _, kept = _select(plain, g, a, plain.begin_step())
            _, kept_scaled = _select(scaled, g * 1024.0, b, scaled.begin_step(),
                                     loss_scale=tf.constant(1024.0))
            self.assertAllEqual(kept_scaled, kept * 1024.0)
        self.assertAllEqual(plain.residual(a), scaled.residual(b))


if __name__ == "__main__":
    tf.test.main()
