"""The D x M mesh: process-set membership, collectives inside groups, and errors.

Runs in one process and under horovodrun with 2 and 4 ranks.
"""

import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import mesh as mesh_lib

HOROVOD_NP = (1, 2, 4)


def _divisors(n):
    return [m for m in range(1, n + 1) if n % m == 0]


class MeshLayoutMathTest(tf.test.TestCase):
    """The pure group arithmetic, checked against hand-written N = 4 layouts."""

    def test_n4_groups_by_hand(self):
        expected = {
            (1, "model_major"): (((0,), (1,), (2,), (3,)), ((0, 1, 2, 3),)),
            (2, "model_major"): (((0, 1), (2, 3)), ((0, 2), (1, 3))),
            (4, "model_major"): (((0, 1, 2, 3),), ((0,), (1,), (2,), (3,))),
            (1, "data_major"): (((0,), (1,), (2,), (3,)), ((0, 1, 2, 3),)),
            (2, "data_major"): (((0, 2), (1, 3)), ((0, 1), (2, 3))),
            (4, "data_major"): (((0, 1, 2, 3),), ((0,), (1,), (2,), (3,))),
        }
        for (m, layout), groups in expected.items():
            self.assertEqual(mesh_lib.mesh_groups(4, m, layout), groups, (m, layout))

    def test_every_rank_once_per_grouping(self):
        for n in (1, 2, 4, 6, 8, 12):
            for m in _divisors(n):
                for layout in mesh_lib.LAYOUTS:
                    model_groups, data_groups = mesh_lib.mesh_groups(n, m, layout)
                    self.assertEqual(sorted(sum(model_groups, ())), list(range(n)))
                    self.assertEqual(sorted(sum(data_groups, ())), list(range(n)))
                    self.assertLen(model_groups, n // m)
                    self.assertLen(data_groups, m)
                    for d, group in enumerate(model_groups):
                        for p, rank in enumerate(group):
                            self.assertEqual(data_groups[p][d], rank)

    def test_layout_errors_name_the_numbers(self):
        with self.assertRaisesRegex(ValueError, r"6 ranks .*model_parallel=4"):
            mesh_lib.mesh_groups(6, 4)
        with self.assertRaisesRegex(ValueError, r"model_parallel=0 must be in \[1, 4\]"):
            mesh_lib.mesh_groups(4, 0)
        with self.assertRaisesRegex(ValueError, r"model_parallel=5 must be in \[1, 4\]"):
            mesh_lib.mesh_groups(4, 5)
        with self.assertRaisesRegex(ValueError, r"layout='diagonal' is unknown"):
            mesh_lib.mesh_groups(4, 2, "diagonal")


class MeshCollectivesTest(tf.test.TestCase):
    """Builds every mesh the world size allows and runs collectives inside its groups."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _check_mesh(self, m, layout):
        mesh = tfhybrid.init(model_parallel=m, layout=layout)
        n = hvd.size()
        model_groups, data_groups = mesh_lib.mesh_groups(n, m, layout)
        self.assertEqual((mesh.size, mesh.rank), (n, hvd.rank()))
        self.assertEqual((mesh.data_parallel, mesh.model_parallel), (n // m, m))
        self.assertIn(mesh.rank, mesh.model_group_ranks)
        self.assertIn(mesh.rank, mesh.data_group_ranks)
        self.assertEqual(mesh.model_group_ranks, model_groups[mesh.replica])
        self.assertEqual(mesh.data_group_ranks, data_groups[mesh.model_position])
        self.assertEqual(mesh.model_group_ranks[mesh.model_position], mesh.rank)
        self.assertEqual(mesh.data_group_ranks[mesh.data_position], mesh.rank)
        # each process set holds exactly the expected ranks
        self.assertEqual(list(mesh.model_process_set.ranks), list(mesh.model_group_ranks))
        self.assertEqual(list(mesh.data_process_set.ranks), list(mesh.data_group_ranks))
        self.assertEqual(mesh.model_process_set.rank(), mesh.model_position)
        self.assertEqual(mesh.data_process_set.rank(), mesh.data_position)
        self.assertIn(f"{mesh.rank}*", str(mesh))

        # alltoall with uneven splits: position p sends q+p+1 values to position q,
        # each value encoding (source rank, destination position, index).
        p = mesh.model_position
        splits = [q + p + 1 for q in range(m)]
        payload = np.concatenate([
            [1000 * mesh.rank + 100 * q + i for i in range(splits[q])] for q in range(m)
        ]).astype(np.float32)
        received, received_splits = hvd.alltoall(
            tf.constant(payload), splits=tf.constant(splits, tf.int32),
            process_set=mesh.model_process_set)
        expected_splits = [p + src + 1 for src in range(m)]
        expected = np.concatenate([
            [1000 * mesh.model_group_ranks[src] + 100 * p + i for i in range(p + src + 1)]
            for src in range(m)]).astype(np.float32)

        # allreduce inside the data group sums exactly that group's ranks
        summed = hvd.allreduce(tf.constant([float(mesh.rank), 1.0]), op=hvd.Sum,
                               process_set=mesh.data_process_set)
        self.assertAllEqual(received_splits, expected_splits)
        self.assertAllEqual(received, expected)
        self.assertAllEqual(summed, [float(sum(mesh.data_group_ranks)),
                                     float(len(mesh.data_group_ranks))])

    def test_every_mesh_of_this_world(self):
        for m in _divisors(hvd.size() if hvd.is_initialized() else 1):
            for layout in mesh_lib.LAYOUTS:
                with self.subTest(model_parallel=m, layout=layout):
                    self._check_mesh(m, layout)
                mesh_lib.reset()

    def test_default_model_parallel_is_local_size(self):
        mesh = tfhybrid.init()
        self.assertEqual(mesh.model_parallel, hvd.local_size())

    def test_second_init_same_args_returns_same_mesh(self):
        first = tfhybrid.init(model_parallel=1)
        self.assertIs(tfhybrid.init(model_parallel=1), first)
        self.assertIs(tfhybrid.current_mesh(), first)

    def test_second_init_with_other_model_parallel_raises(self):
        n = hvd.size() if hvd.is_initialized() else 1
        tfhybrid.init(model_parallel=n)
        other = 1 if n > 1 else None
        if other is None:
            # with one rank the only other M is invalid anyway; a different layout is not
            with self.assertRaisesRegex(ValueError, r"layout='model_major'.*'data_major'"):
                tfhybrid.init(model_parallel=1, layout="data_major")
        else:
            with self.assertRaisesRegex(
                    ValueError, rf"model_parallel={n}.*model_parallel=1"):
                tfhybrid.init(model_parallel=1)

    def test_init_errors_name_the_numbers(self):
        n = hvd.size() if hvd.is_initialized() else 1
        with self.assertRaisesRegex(ValueError, r"model_parallel=0 must be in"):
            tfhybrid.init(model_parallel=0)
        with self.assertRaisesRegex(ValueError, rf"model_parallel={n + 1} must be in \[1, {n}\]"):
            tfhybrid.init(model_parallel=n + 1)
        with self.assertRaisesRegex(ValueError, r"layout='rows' is unknown"):
            tfhybrid.init(model_parallel=1, layout="rows")
        with self.assertRaisesRegex(ValueError, r"model_parallel='2' must be an int"):
            tfhybrid.init(model_parallel="2")
        if n == 4:
            with self.assertRaisesRegex(ValueError, r"4 ranks are not divisible by model_parallel=3"):
                tfhybrid.init(model_parallel=3)

    def test_current_mesh_before_init_raises(self):
        with self.assertRaisesRegex(ValueError, "tfhybrid.init"):
            tfhybrid.current_mesh()


if __name__ == "__main__":
    tf.test.main()


class FusionTest(tf.test.TestCase):
    """Every collective call sums its elements in one order, however Horovod's cycles
    fall: ``init`` starts Horovod with group fusion off, so a grouped allreduce issued
    beside another is never packed into a shared buffer (a tensor's place in the buffer
    decides the order in which a ring allreduce adds it)."""

    def test_a_sum_is_the_same_alone_and_beside_another_call(self):
        from tfhybrid import collectives
        mesh = tfhybrid.init(model_parallel=1)
        self.addCleanup(mesh_lib.reset)
        if mesh.size < 3:
            self.skipTest("one or two ranks add in one order whatever the buffer")
        self.assertEqual(os.environ.get(mesh_lib.FUSION_ENV), mesh_lib.FUSION_DEFAULT)
        # values whose float32 sum depends on the order: 1e8 + 1 rounds to 1e8
        rng = np.random.default_rng(7)
        big = rng.choice([-1e8, 1e8], size=[mesh.size, 64]).astype(np.float32)
        ones = rng.choice([-1.0, 1.0], size=[mesh.size, 64]).astype(np.float32)
        mine = tf.constant(np.where(np.arange(mesh.size)[:, None] % 2 == 0, big, ones)[
            mesh.rank])
        other = tf.constant(np.full([37], float(mesh.rank), np.float32))

        @tf.function
        def alone():
            return collectives.grouped_allreduce([mine], hvd.Sum, "fusion_alone")[0]

        @tf.function
        def beside():
            # issued together: both are ready in the same Horovod cycle
            first = collectives.grouped_allreduce([other], hvd.Sum, "fusion_first")[0]
            second = collectives.grouped_allreduce([mine], hvd.Sum, "fusion_second")[0]
            return first, second

        want = alone().numpy()
        for _ in range(5):
            _, got = beside()
            self.assertAllEqual(got, want)
