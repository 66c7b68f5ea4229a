"""dp_input=False on 2D meshes: each rank feeds its position's features for its model
group's batch, and training equals plain Keras layers on the global batch.

Also ``_dp_to_mp_input``, which turns a data-parallel batch into that input. (The 1D,
distributed-embeddings style cases are in ``test_de_compat.py``.)
"""

import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tests import _de_case as de

HOROVOD_NP = (2, 4)

TABLES = [[40, 6], [9, 4], [25, 5], [60, 3], [8, 7]]


def _meshes(size):
    """(M, layout) pairs: every split of the ranks into model groups but the trivial."""
    return [(m, layout) for m in range(1, size) if size % m == 0
            for layout in ("model_major", "data_major")]


class ModelParallelInputTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _each_mesh(self, check):
        world = tfhybrid.init(model_parallel=1).size
        mesh_lib.reset()
        for m, layout in _meshes(world):
            with self.subTest(model_parallel=m, layout=layout):
                tfhybrid.init(model_parallel=m, layout=layout)
                check()
                mesh_lib.reset()

    def test_one_hot_shared_tables(self):
        self._each_mesh(lambda: de.run_step(
            self, TABLES, strategy="memory_balanced", dp_input=False,
            input_table_map=[0, 1, 2, 3, 4, 0, 2]))

    def test_ragged_mean_over_row_and_column_slices(self):
        self._each_mesh(lambda: de.run_step(
            self, TABLES, combiner="mean", hotness=3, ragged=True, dp_input=False,
            row_slice_threshold=200, column_slice_threshold=100,
            data_parallel_threshold=40, input_table_map=[0, 1, 2, 3, 4, 3]))

    def test_multi_hot_sum_through_dp_to_mp_input(self):
        self._each_mesh(lambda: de.run_step(
            self, TABLES, combiner="sum", hotness=2, dp_input=False, use_dp_to_mp=True,
            strategy="basic"))


if __name__ == "__main__":
    tf.test.main()
