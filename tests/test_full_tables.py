"""get_weights / set_weights move full tables in chunks, exactly, on any mesh."""

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.sharding import full_tables as full_tables_lib

HOROVOD_NP = (1, 2, 4)


class FullTablesTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self._chunk = full_tables_lib.CHUNK_BYTES
        full_tables_lib.CHUNK_BYTES = 48  # a few rows per chunk, so every path is chunked

    def tearDown(self):
        full_tables_lib.CHUNK_BYTES = self._chunk
        mesh_lib.reset()
        super().tearDown()

    def test_round_trip_every_kind(self):
        world = tfhybrid.init(model_parallel=1).size
        mesh_lib.reset()
        for m in [m for m in range(1, world + 1) if world % m == 0]:
            mesh = tfhybrid.init(model_parallel=m, layout="data_major")
            layer = DistributedEmbedding(
                [Embedding(37, 3, combiner="sum", name="small"),
                 Embedding(101, 5, combiner="sum", name="rows"),
                 Embedding(29, 6, combiner="mean", name="cols"),
                 Embedding(41, 4, combiner="sum", name="whole")],
                mesh=mesh, data_parallel_threshold=120, row_slice_threshold=500,
                column_slice_threshold=150)
            layer([tf.constant([[1]])] * 4)
            rng = np.random.default_rng(3)
            full = [rng.standard_normal([t.rows, t.dim]).astype(np.float32)
                    for t in layer.table_specs]
            layer.set_weights(full)
            got = layer.get_weights(all_ranks=True)
            for want, have in zip(full, got):
                self.assertAllEqual(have, want)
            on_root = layer.get_weights()
            if mesh.rank == 0:
                self.assertLen(on_root, 4)
                self.assertAllEqual(on_root[1], full[1])
            else:
                self.assertEqual(on_root, [])
            mesh_lib.reset()

    def test_set_weights_checks_shapes(self):
        mesh = tfhybrid.init(model_parallel=1)
        layer = DistributedEmbedding([Embedding(10, 2, combiner="sum", name="t")], mesh=mesh)
        layer([tf.constant([[1]])])
        with self.assertRaisesRegex(ValueError, r"table 't' has shape \(10, 3\); expected \(10, 2\)"):
            layer.set_weights([np.zeros([10, 3])])
        with self.assertRaisesRegex(ValueError, r"got 2 tables; expected 1"):
            layer.set_weights([np.zeros([10, 2])] * 2)


if __name__ == "__main__":
    tf.test.main()
