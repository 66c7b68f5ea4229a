"""A script written for NVIDIA distributed-embeddings (DE) runs on tfhybrid unchanged.

DE's only layout is pure model parallelism over all ranks after a plain ``hvd.init()``,
so this module calls ``hvd.init()`` itself, as such a script does, and uses M = N (and
M = 1). Each test is written from DE's documented behaviour: the same numbers as plain
Keras layers on the global batch (forward 1e-6, tables 1e-5 after an SGD step).
"""

import logging
import os
import tempfile

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.sharding.placement import on_host
from tfhybrid.sharding.stores import CustomLayerTable
from tests import _de_case as de

KERAS_3 = tfhybrid.keras_major() == 3

# four ranks hold groups of two both ways (2x2), and the 1D meshes of four;
# two ranks would only repeat them at a smaller size
HOROVOD_NP = (4,)
KERAS = (2, 3)
# its hvd.init() at import must be the job's first: a job of its own (tests/runner.py)
OWN_PROCESS = True

hvd.init()   # what a DE script does first: static process sets

TABLES = [[11, 7], [5, 8], [3, 8], [5, 8], [12, 25], [3, 12], [7, 13]]


class GatherEmbedding(tf.keras.layers.Layer):
    """A custom table layer as DE users write them: its own weight and ``call``."""

    def __init__(self, input_dim, output_dim, **kwargs):
        super().__init__(**kwargs)
        self.input_dim = input_dim
        self.output_dim = output_dim

    def build(self, _):
        self.params = self.add_weight(name="params", shape=[self.input_dim, self.output_dim])

    def call(self, inputs):
        return tf.gather(self.params, inputs) * 2.0   # its own call, visibly

    def get_config(self):
        return dict(super().get_config(), input_dim=self.input_dim,
                    output_dim=self.output_dim)


class DeCompatTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        tfhybrid.init(model_parallel=hvd.size())

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_hvd_init_first_model_parallel_over_all_ranks(self):
        mesh = tfhybrid.current_mesh()
        self.assertEqual((mesh.data_parallel, mesh.model_parallel), (1, hvd.size()))
        de.run_step(self, TABLES, strategy="basic")

    def test_hvd_init_first_pure_data_parallel(self):
        mesh_lib.reset()
        tfhybrid.init(model_parallel=1)
        de.run_step(self, TABLES, strategy="basic")

    def test_hvd_init_first_two_dimensional_says_what_to_do(self):
        if hvd.size() < 4:
            mesh_lib.reset()
            with self.assertRaisesRegex(ValueError, "model_parallel=3"):
                tfhybrid.init(model_parallel=3)
            return
        mesh_lib.reset()
        with self.assertRaisesRegex(RuntimeError, r"hvd.init\(process_sets='dynamic'\)"):
            tfhybrid.init(model_parallel=2)

    def test_layer_without_tfhybrid_init_uses_the_existing_horovod(self):
        mesh_lib.reset()
        layer = de.run_step(self, TABLES[:3])
        self.assertEqual(layer.mesh.size, hvd.size())

    def test_default_strategy_and_each_de_strategy(self):
        for strategy in ("basic", "memory_balanced", "memory_optimized"):
            layer = de.run_step(self, TABLES, strategy=strategy)
            self.assertEqual(layer.strategy, strategy)
            for tables in layer.strategy.table_ids:
                self.assertEqual(len(tables), len(set(tables)))

    def test_model_parallel_input(self):
        de.run_step(self, TABLES, strategy="basic", dp_input=False)

    def test_model_parallel_input_shared_tables(self):
        for strategy in ("basic", "memory_balanced"):
            de.run_step(self, TABLES, strategy=strategy, dp_input=False,
                        input_table_map=[0, 1, 2, 3, 4, 5, 6, 4, 0, 2])

    def test_model_parallel_input_multi_hot_and_ragged(self):
        de.run_step(self, TABLES, combiner="sum", hotness=5, strategy="basic",
                    dp_input=False)
        de.run_step(self, TABLES, combiner="mean", hotness=3, ragged=True,
                    strategy="memory_balanced", dp_input=False)

    def test_model_parallel_input_sliced_tables(self):
        # more ranks than tables: every rank gets a column slice
        layer = de.run_step(self, [[100, 8]], strategy="memory_balanced", dp_input=False)
        self.assertLen(layer.plan.tables[0].shards, hvd.size())
        de.run_step(self, [[10, 4], [11, 2], [4, 2], [4, 2]], strategy="memory_balanced",
                    dp_input=False, column_slice_threshold=10)
        de.run_step(self, [[40, 4], [30, 6]], combiner="mean", hotness=3, ragged=True,
                    dp_input=False, row_slice_threshold=100, input_table_map=[0, 1, 0])

    def test_dp_to_mp_input_helper(self):
        de.run_step(self, TABLES, combiner="sum", hotness=2, ragged=True, strategy="basic",
                    dp_input=False, use_dp_to_mp=True)
        de.run_step(self, TABLES, strategy="memory_balanced", dp_input=False,
                    use_dp_to_mp=True, input_table_map=[0, 1, 2, 3, 4, 5, 6, 1])

    def test_dp_to_mp_input_function(self):
        # DE's free function: features by id, ranks by rank; dense, ragged, and a rank
        # that receives nothing
        size, rank = hvd.size(), hvd.rank()
        global_ids = de.global_ids(TABLES, [0, 1, 2], size * de.LOCAL_BATCH, hotness=2,
                                   ragged=True)
        dense = tf.reshape(tf.range(size * de.LOCAL_BATCH * 2, dtype=tf.int64), [-1, 2])
        first = rank * de.LOCAL_BATCH
        dp = {0: global_ids[0][first:first + de.LOCAL_BATCH],
              2: global_ids[2][first:first + de.LOCAL_BATCH],
              5: dense[first:first + de.LOCAL_BATCH]}
        wanted = {r: [] for r in range(size)}
        wanted[0] = [5, 0]
        wanted[size - 1] += [2]
        got = tfhybrid._dp_to_mp_input(dp, wanted)
        self.assertEqual(list(got), wanted[rank])
        expected = {0: global_ids[0], 2: global_ids[2], 5: dense}
        for f, ids in got.items():
            want = expected[f]
            if isinstance(want, tf.RaggedTensor):
                self.assertAllEqual(ids.row_lengths(), want.row_lengths())
                self.assertAllEqual(ids.flat_values, want.flat_values)
            else:
                self.assertAllEqual(ids, want)
        with self.assertRaisesRegex(ValueError, r"no features \[7\]"):
            tfhybrid._dp_to_mp_input(dp, {0: [7]})

    def test_model_parallel_input_indivisible_batch(self):
        layer = tfhybrid.DistributedEmbedding(de.make_layers(TABLES), dp_input=False)
        inputs = [tf.zeros([hvd.size() * 2 - 1], tf.int64)
                  for _ in layer.strategy.input_ids_list[hvd.rank()]]
        with self.assertRaisesRegex(ValueError, "not divisible"):
            layer(inputs)

    def test_model_parallel_input_wrong_feature_count(self):
        layer = tfhybrid.DistributedEmbedding(de.make_layers(TABLES), dp_input=False)
        wanted = layer.strategy.input_ids_list[hvd.rank()]
        with self.assertRaisesRegex(ValueError, rf"expected {len(wanted)}"):
            layer([tf.zeros([hvd.size()], tf.int64)] * (len(wanted) + 1))

    def test_de_keyword_arguments(self):
        with self.assertLogs("tfhybrid", logging.INFO) as logs:
            de.run_step(self, TABLES, strategy="basic", gpu_embedding_size=32000)
        self.assertIn("every table is in host memory", "\n".join(logs.output))
        de.run_step(self, TABLES, combiner="sum", hotness=2, use_custom_kernel=False)
        with self.assertRaisesRegex(ValueError, "gpu_embedding_size=-1"):
            tfhybrid.DistributedEmbedding(de.make_layers(TABLES), gpu_embedding_size=-1)

    def test_gpu_embedding_size_puts_tables_past_the_budget_in_host_memory(self):
        # the placement rule, as on a GPU machine (this one has none: GPUs are faked)
        real = tf.config.list_logical_devices
        tf.config.list_logical_devices = lambda kind=None: (
            ["/GPU:0"] if kind == "GPU" else real(kind))
        try:
            layer = tfhybrid.DistributedEmbedding(de.make_layers(TABLES), strategy="basic",
                                                  gpu_embedding_size=0)
            layer.strategy
            position = layer.mesh.model_position
            self.assertTrue(all(on_host(layer.plan, position, 0).values()))
            first = [4 * r * d for t, (r, d) in enumerate(TABLES)
                     if layer.plan.tables[t].shards[0].owner == position][0]
            layer.gpu_embedding_size = first
            tiers = list(on_host(layer.plan, position, first).values())
            self.assertEqual(tiers, [False] + [True] * (len(tiers) - 1))
            layer.gpu_embedding_size = 0   # every rank then has a table on the host
            with self.assertLogs("tfhybrid", logging.INFO) as logs:
                layer([tf.zeros([2], tf.int64)] * len(TABLES))
            self.assertIn("live in host memory", "\n".join(logs.output))
        finally:
            tf.config.list_logical_devices = real

    def test_custom_embedding_layer(self):
        layer = de.run_step(
            self, TABLES, strategy="basic",
            layer_factory=lambda: [GatherEmbedding(r, d, name=f"g{i}")
                                   for i, (r, d) in enumerate(TABLES)])
        custom = [store for _, store in layer.stores.items()
                  if isinstance(store, CustomLayerTable)]
        self.assertTrue(custom or hvd.size() > len(TABLES))

    def test_custom_layer_that_pools_is_refused(self):
        class Pooling(GatherEmbedding):
            def call(self, inputs):
                return tf.reduce_sum(tf.gather(self.params, inputs), axis=-2)
        layer = tfhybrid.DistributedEmbedding([Pooling(10, 4, name="p")])
        with self.assertRaisesRegex(ValueError, "custom embedding layer 'p'"):
            layer([tf.zeros([2], tf.int64)])

    def test_regularizer_constraint_and_mask(self):
        de.run_step(self, TABLES, strategy="basic",
                    embedding_kwargs=dict(embeddings_regularizer=tf.keras.regularizers.L2(0.1),
                                          activity_regularizer=tf.keras.regularizers.L1(0.01)))
        # Keras' legacy optimizers refuse constraints on sparse gradients
        layer = de.run_step(self, TABLES, strategy="basic",
                            optimizer=tf.keras.optimizers.SGD,
                            embedding_kwargs=dict(
                                embeddings_constraint=tf.keras.constraints.NonNeg()))
        for table in layer.get_weights(all_ranks=True):
            self.assertGreaterEqual(table.min(), 0.0)
        masked = tfhybrid.DistributedEmbedding(
            [tf.keras.layers.Embedding(10, 4, mask_zero=True, name="m"),
             tf.keras.layers.Embedding(10, 4, name="n")])
        ids = [tf.constant([0, 3, 0]), tf.constant([0, 1, 2])]
        masked(ids)
        masks = masked.compute_mask(ids)
        self.assertAllEqual(masks[0], [False, True, False])
        self.assertIsNone(masks[1])

    def test_config_the_plan_cannot_honour_is_named(self):
        layer = tfhybrid.DistributedEmbedding(
            [tf.keras.layers.Embedding(100, 8, name="u",
                                       embeddings_constraint=tf.keras.constraints.UnitNorm())],
            row_slice_threshold=10)
        with self.assertRaisesRegex(ValueError, "embeddings_constraint"):
            layer([tf.zeros([2], tf.int64)])
        layer = tfhybrid.DistributedEmbedding(
            [tf.keras.layers.Embedding(10, 4, name="d", dtype="float64")])
        with self.assertRaisesRegex(ValueError, "dtype='float64'"):
            layer([tf.zeros([2], tf.int64)])
        with self.assertRaisesRegex(ValueError, "mask_zero"):
            tfhybrid.DistributedEmbedding(
                [tf.keras.layers.Embedding(10, 4, mask_zero=True)], dp_input=False)

    def test_set_weights_from_npy_files_and_chunks(self):
        layer = tfhybrid.DistributedEmbedding(de.make_layers(TABLES), strategy="basic")
        layer([tf.zeros([2], tf.int64)] * len(TABLES))
        rng = np.random.default_rng(5)
        full = [rng.standard_normal(shape).astype(np.float32) for shape in TABLES]
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for i, table in enumerate(full):
                paths.append(os.path.join(tmp, f"{i}.npy"))
                np.save(paths[-1], table)
            layer.set_weights(paths, chunk=16)
        for got, want in zip(layer.get_weights(all_ranks=True), full):
            self.assertAllEqual(got, want)

    def test_unseeded_initializers_leave_the_ranks_random_streams_alike(self):
        # ranks hold different numbers of tables; a replicated table and a layer built
        # after the embedding must still start alike on every rank, as one seed promises
        tf.keras.utils.set_random_seed(3)
        layer = tfhybrid.DistributedEmbedding(
            de.make_layers(TABLES), strategy="memory_balanced", data_parallel_threshold=40)
        layer([tf.zeros([2], tf.int64)] * len(TABLES))
        dense = tf.keras.layers.Dense(3)
        dense(tf.zeros([1, 4]))
        replicated = [v for v in layer.trainable_variables if v.shape == (3, 12)]
        self.assertLen(replicated, 1)
        for value in (replicated[0], dense.kernel):
            gathered = hvd.allgather(tf.expand_dims(tf.convert_to_tensor(value), 0))
            for other in tf.unstack(gathered)[1:]:
                self.assertAllEqual(other, gathered[0])

    def test_whole_model_save_on_many_ranks_is_refused(self):
        inputs = [tf.keras.Input([], dtype=tf.int64) for _ in TABLES[:2]]
        outputs = tfhybrid.DistributedEmbedding(de.make_layers(TABLES[:2]))(inputs)
        model = tf.keras.Model(inputs, tf.keras.layers.Concatenate()(outputs))
        with tempfile.TemporaryDirectory() as tmp:
            # Keras 2 also writes a SavedModel; Keras 3 only .keras files (model.export
            # writes a SavedModel, of the layer's single-rank view)
            paths = ["m.keras"] + ([] if KERAS_3 else ["saved"])
            for path in paths:
                with self.assertRaisesRegex(ValueError, "save_weights"):
                    model.save(os.path.join(tmp, path))

    def test_set_weights_before_build(self):
        layer = tfhybrid.DistributedEmbedding(de.make_layers(TABLES))
        with self.assertRaises(ValueError):
            layer.set_weights([np.zeros(shape, np.float32) for shape in TABLES])


if __name__ == "__main__":
    tf.test.main()
