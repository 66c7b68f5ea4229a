"""Gradient routing and broadcast: which process set, which scale, sparse or dense."""

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import distributed
from tfhybrid import mesh as mesh_lib

HOROVOD_NP = (1, 2, 4)


def _meshes():
    world = tfhybrid.init(model_parallel=1).size
    mesh_lib.reset()
    return [(m, layout) for m in range(1, world + 1) if world % m == 0
            for layout in mesh_lib.LAYOUTS]


class RoutingTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_scales_and_groups(self):
        for m, layout in _meshes():
            mesh = tfhybrid.init(model_parallel=m, layout=layout)
            n = mesh.size
            dense = tf.Variable(tf.zeros([3]))
            shard = tf.Variable(tf.zeros([3]))
            distributed.mark_model_parallel(shard, mesh)
            value = float(mesh.rank + 1)
            got_dense, got_shard = distributed.allreduce_gradients(
                [tf.fill([3], value), tf.fill([3], value)], [dense, shard], mesh)
            # dense: the average over all N ranks; shard (whose gradient the layer already
            # scaled to its model group's mean): the average over its data group
            self.assertAllClose(got_dense, np.full(3, sum(range(1, n + 1)) / n))
            want_shard = sum(r + 1 for r in mesh.data_group_ranks) / mesh.data_parallel
            self.assertAllClose(got_shard, np.full(3, want_shard), msg=f"{m} {layout}")
            mesh_lib.reset()

    def test_sparse_stays_sparse_where_cheaper(self):
        mesh = tfhybrid.init(model_parallel=1)
        n = mesh.size
        big = tf.Variable(tf.zeros([1000, 8]))
        small = tf.Variable(tf.zeros([4, 8]))
        distributed.mark_sparse_sync(big, True)
        distributed.mark_sparse_sync(small, False)
        rows = tf.constant([mesh.rank % 4, 3], tf.int64)
        slices = tf.IndexedSlices(tf.ones([2, 8]), rows, tf.constant([1000, 8], tf.int64))
        small_slices = tf.IndexedSlices(tf.ones([2, 8]), rows, tf.constant([4, 8], tf.int64))
        got_big, got_small = distributed.allreduce_gradients(
            [slices, small_slices], [big, small], mesh)
        self.assertIsInstance(got_big, tf.IndexedSlices)
        if n > 1:  # with one rank nothing moves, so the gradient keeps its form
            self.assertNotIsInstance(got_small, tf.IndexedSlices)
        got_small = tf.convert_to_tensor(got_small)
        # both represent the same dense sum / N
        want = np.zeros([4, 8], np.float32)
        for r in range(n):
            want[r % 4] += 1.0 / n
            want[3] += 1.0 / n
        dense_big = tf.math.unsorted_segment_sum(got_big.values, got_big.indices, 1000)
        self.assertAllClose(dense_big[:4], want)
        self.assertAllClose(got_small, want)
        # an untagged variable falls back to the static shape rule, identically on all ranks
        plain = tf.Variable(tf.zeros([100000, 8]))
        got_plain, = distributed.allreduce_gradients(
            [tf.IndexedSlices(tf.ones([2, 8]), rows, tf.constant([100000, 8], tf.int64))],
            [plain], mesh)
        self.assertIsInstance(got_plain, tf.IndexedSlices)

    def test_tape_and_optimizer_route_the_same(self):
        mesh = tfhybrid.init(model_parallel=1)
        n = mesh.size
        w = tf.Variable([1.0, 2.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w) * float(mesh.rank + 1)
        tape = tfhybrid.DistributedGradientTape(tape)
        grad, = tape.gradient(loss, [w])
        mean_factor = sum(range(1, n + 1)) / n
        self.assertAllClose(grad, np.array([2.0, 4.0]) * mean_factor)
        opt = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
        opt.apply_gradients([(tf.constant([float(mesh.rank + 1)] * 2), w)])
        self.assertAllClose(w, np.array([1.0, 2.0]) - 0.1 * mean_factor)
        self.assertIsInstance(opt, tf.keras.optimizers.SGD)

    def test_broadcast_dense_from_root_and_shards_from_roots_replica(self):
        for m, layout in _meshes():
            mesh = tfhybrid.init(model_parallel=m, layout=layout)
            dense = tf.Variable([float(mesh.rank)] * 2)
            shard = tf.Variable([10.0 * mesh.rank] * 3)
            distributed.mark_model_parallel(shard, mesh)
            root = mesh.size - 1
            tfhybrid.broadcast_variables([dense, shard], root_rank=root, mesh=mesh)
            self.assertAllEqual(dense, [float(root)] * 2)
            # a shard comes from its copy in root's replica (as DE's broadcast)
            root_replica = next(d for d, g in enumerate(mesh.model_groups) if root in g)
            source = mesh.model_groups[root_replica][mesh.model_position]
            self.assertAllEqual(shard, [10.0 * source] * 3)
            mesh_lib.reset()


if __name__ == "__main__":
    tf.test.main()
