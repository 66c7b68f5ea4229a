"""16-bit activations on the wire: fp16 and bf16 rows cross the alltoall in 16 bits."""

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import distributed
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding

HOROVOD_NP = (2, 4)


def _world():
    world = tfhybrid.init(model_parallel=1).size
    mesh_lib._reset_for_tests()
    return world


class MixedPrecisionTest(tf.test.TestCase):

    def tearDown(self):
        tf.keras.mixed_precision.set_global_policy("float32")
        distributed.stop_counting_traffic()
        mesh_lib._reset_for_tests()
        super().tearDown()

    def test_bfloat16_crosses_bit_exactly(self):
        mesh = tfhybrid.init(model_parallel=_world())
        rng = np.random.default_rng(mesh.rank)
        bits = rng.integers(-2**15, 2**15, size=[4 * mesh.size], dtype=np.int16)
        values = tf.bitcast(tf.constant(bits), tf.bfloat16)
        splits = tf.constant([4] * mesh.size, tf.int32)
        received, _ = distributed.alltoall(values, splits, mesh.model_process_set, mesh.size,
                                           "test_bf16")
        everyone = hvd.allgather_object(bits)
        want = np.concatenate([everyone[src][4 * mesh.rank:4 * mesh.rank + 4]
                               for src in range(mesh.size)])
        self.assertEqual(received.dtype, tf.bfloat16)
        np.testing.assert_array_equal(tf.bitcast(received, tf.int16).numpy(), want)

    def _step_bytes_and_outputs(self, policy):
        tf.keras.mixed_precision.set_global_policy(policy)
        mesh = tfhybrid.init(model_parallel=_world())
        layer = DistributedEmbedding(
            [Embedding(300, 16, combiner="sum", name="a"),
             Embedding(200, 8, combiner="mean", name="b")], mesh=mesh)
        ids = [tf.constant(np.random.default_rng(mesh.rank).integers(0, 200, size=[8, 3]))] * 2
        layer(ids)
        rng = np.random.default_rng(0)
        layer.set_weights([rng.standard_normal([300, 16]).astype(np.float32),
                           rng.standard_normal([200, 8]).astype(np.float32)])
        traffic = distributed.count_traffic()
        for v in traffic.values():
            v.assign(0)
        with tf.GradientTape() as tape:
            outputs = layer(ids)
            loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in outputs])
        grads = tape.gradient(loss, layer.trainable_variables)
        row_bytes = int(traffic["alltoall"].numpy())
        distributed.stop_counting_traffic()
        mesh_lib._reset_for_tests()
        return layer, outputs, grads, row_bytes

    def test_tables_stay_float32_and_rows_travel_in_16_bits(self):
        _, ref_out, ref_grads, fp32_bytes = self._step_bytes_and_outputs("float32")
        for policy, dtype in (("mixed_float16", tf.float16), ("mixed_bfloat16", tf.bfloat16)):
            layer, outputs, grads, bytes_16 = self._step_bytes_and_outputs(policy)
            self.assertTrue(all(v.dtype == tf.float32 for v in layer.weights))
            self.assertTrue(all(o.dtype == dtype for o in outputs))
            for got, want in zip(outputs, ref_out):
                self.assertAllClose(tf.cast(got, tf.float32), want, atol=0.1, rtol=2e-2)
            for got, want in zip(grads, ref_grads):
                self.assertAllClose(tf.convert_to_tensor(got), tf.convert_to_tensor(want),
                                    atol=1e-2, rtol=1e-2)
            # ids are the same int32s; the rows and their gradients take half the bytes
            ids_bytes = self._id_bytes(layer)
            self.assertEqual(bytes_16 - ids_bytes, (fp32_bytes - ids_bytes) // 2, policy)

    def test_loss_scale_skips_together(self):
        tf.keras.mixed_precision.set_global_policy("mixed_float16")
        mesh = tfhybrid.init(model_parallel=1)
        optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), mesh=mesh)
        self.assertIsInstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
        w = tf.Variable([1.0, 2.0])
        start_scale = float(optimizer.loss_scale)
        # only the last rank overflows; every rank must skip and lower its scale
        bad = float("inf") if mesh.rank == mesh.size - 1 else 1.0
        optimizer.apply_gradients([(tf.constant([bad, 1.0]), w)])
        self.assertAllEqual(w, [1.0, 2.0])
        scales = hvd.allgather_object(float(optimizer.loss_scale))
        self.assertEqual(scales, [start_scale / 2] * mesh.size)
        optimizer.apply_gradients([(tf.constant([1.0, 1.0]), w)])
        self.assertAllClose(w, [0.9, 1.9])

    def test_fit_loss_in_16_bits_stays_close_to_float32(self):
        world = _world()
        losses = {}
        for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
            tf.keras.mixed_precision.set_global_policy(policy)
            mesh = tfhybrid.init(model_parallel=max(1, world // 2))
            ids = [tf.keras.Input([3], dtype=tf.int64, name=n) for n in ("a", "b")]
            embedded = DistributedEmbedding(
                [Embedding(24, 8, combiner="sum", name="a"),
                 Embedding(100, 8, combiner="mean", name="b")], mesh=mesh)(ids)
            hidden = tf.keras.layers.Dense(16, activation="relu")(tf.concat(embedded, axis=1))
            logits = tf.keras.layers.Dense(1)(hidden)
            logits = tf.keras.layers.Activation("linear", dtype="float32")(logits)
            model = tf.keras.Model(ids, logits)
            init = np.random.default_rng(3)
            model.set_weights([init.normal(0, 0.2, w.shape).astype(np.float32)
                               if w.size else w for w in model.get_weights()])
            rng = np.random.default_rng(mesh.rank)
            x = {"a": rng.integers(0, 24, size=[160, 3]), "b": rng.integers(0, 100, size=[160, 3])}
            # a planted signal the model can learn in 20 steps: small ids of "a" click
            y = (x["a"].sum(axis=1, keepdims=True) < 36).astype(np.float32)
            model.compile(optimizer=tfhybrid.DistributedOptimizer(
                tf.keras.optimizers.SGD(0.5), mesh=mesh),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 20 steps
            loss = model.evaluate(x, y, batch_size=32, verbose=0)
            losses[policy] = float(hvd.allreduce(tf.constant(loss), op=hvd.Average))
            mesh_lib._reset_for_tests()
        print("loss after 20 steps:", losses)
        self.assertLess(losses["float32"], 0.68)  # it learned something: ln 2 = 0.693
        self.assertAllClose(losses["mixed_float16"], losses["float32"], atol=1e-2)
        self.assertAllClose(losses["mixed_bfloat16"], losses["float32"], atol=1e-2)

    def _id_bytes(self, layer):
        # header + ids this rank sent: what the plan counts as (L + n) * 4 per remote route
        plan = layer.plan
        mesh = layer._mesh
        total = 0
        for routes in layer._routes:
            for r in routes:
                if r.owner != mesh.model_position:
                    total += (8 + 8 * 3) * 4
        return total


if __name__ == "__main__":
    tf.test.main()
