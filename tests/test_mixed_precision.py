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
