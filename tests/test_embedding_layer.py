"""tfhybrid.layers.Embedding, ConcatOneHotEmbedding and IntegerLookup as drop-ins for
distributed-embeddings' (DE) ``distributed_embeddings.python.layers.embedding`` module.

Each test checks values against numpy or a plain Keras layer. Single process.
"""

from __future__ import annotations

import inspect
import os
import re
import tempfile
import textwrap

import numpy as np
import tensorflow as tf

import tfhybrid.layers
from tfhybrid import custom_ops
from tfhybrid.layers import (ConcatEmbedding, ConcatOneHotEmbedding, CPUInitializer, Embedding,
                             IntegerLookup)
from tfhybrid.layers import embedding as embedding_module

KERAS = (2, 3)

TABLE = np.array([[1., 2.], [3., 4.], [5., 6.]], np.float32)
FUSED_OP = "ResourceEmbeddingLookupCombine"


def _layer(combiner=None, use_custom_kernel=True, table=TABLE):
    layer = Embedding(table.shape[0], table.shape[1], combiner=combiner,
                      use_custom_kernel=use_custom_kernel)
    layer.build((None,))
    layer.set_weights([table])
    return layer


def _reduce(rows: np.ndarray, combiner: str) -> np.ndarray:
    return rows.sum(-2) if combiner == "sum" else rows.mean(-2)


def _graph_op_types(fn, *args) -> set[str]:
    return {op.type for op in tf.function(fn).get_concrete_function(*args).graph.get_operations()}


class EmbeddingTest(tf.test.TestCase):

    def test_dense_ids_without_combiner_are_table_rows(self):
        for kernel in (True, False):
            layer = _layer(use_custom_kernel=kernel)
            for ids in ([0, 1, 0], [[0, 1], [2, 0]], [[[0, 1], [2, 0], [1, 2]]]):
                ids = np.array(ids, np.int64)
                self.assertAllEqual(layer(ids), TABLE[ids])

    def test_combiner_reduces_last_dimension_of_2d_and_3d_ids(self):
        ids3 = np.array([[[0, 1], [2, 0], [1, 2]], [[2, 2], [0, 0], [1, 0]]], np.int64)
        for kernel in (True, False):
            for combiner in ("sum", "mean"):
                layer = _layer(combiner, kernel)
                self.assertAllClose(layer(ids3[0]), _reduce(TABLE[ids3[0]], combiner))
                out = layer(ids3)
                self.assertEqual(out.shape, (2, 3, 2))
                self.assertAllClose(out, _reduce(TABLE[ids3], combiner))

    def test_de_3d_mean_example_in_a_keras_model(self):
        # DE's test: [[[0, 1], [2, 0], [1, 2]]] with mean gives [[[2, 3], [3, 4], [4, 5]]].
        layer = Embedding(3, 2, combiner="mean")
        model = tf.keras.Sequential([layer])
        layer.set_weights([TABLE])
        for run_eagerly in (True, False):
            model.run_eagerly = run_eagerly
            out = model.predict(np.array([[[0, 1], [2, 0], [1, 2]]], np.int64), verbose=0)
            self.assertAllEqual(out, [[[2, 3], [3, 4], [4, 5]]])

    def test_ragged_ids_without_combiner_give_what_keras_gives(self):
        ids = tf.ragged.constant([[1, 2, 2], [0], [1, 2]], dtype=tf.int64)
        reference = tf.keras.layers.Embedding(3, 2)
        reference.build((None,))
        reference.set_weights([TABLE])
        for kernel in (True, False):
            out = _layer(use_custom_kernel=kernel)(ids)
            self.assertIsInstance(out, tf.RaggedTensor)
            self.assertAllEqual(out.row_splits, ids.row_splits)
            self.assertAllEqual(out.flat_values, reference(ids).flat_values)
            self.assertAllEqual(out.flat_values, TABLE[ids.flat_values.numpy()])

    def test_ragged_ids_without_combiner_in_a_functional_model(self):
        layer = Embedding(3, 2)
        inputs = tf.keras.Input(shape=(None,), dtype=tf.int64, ragged=True)
        model = tf.keras.Model(inputs, layer(inputs))
        layer.set_weights([TABLE])
        ids = tf.ragged.constant([[1, 2, 2], [0], [1, 2]], dtype=tf.int64)
        out = model.predict(ids, verbose=0)
        self.assertAllEqual(out.to_list(), [[TABLE[i].tolist() for i in row]
                                            for row in ids.to_list()])

    def test_ragged_and_sparse_ids_with_combiner(self):
        rows = [[1, 2, 2], [0], [], [1, 2]]
        ragged = tf.ragged.constant(rows, dtype=tf.int64)
        # sparse rows as DE's test builds them: a row's ids are combined whatever their columns
        sparse = tf.SparseTensor(indices=[[0, 0], [0, 1], [0, 3], [1, 2], [3, 0], [3, 1]],
                                 values=tf.constant([1, 2, 2, 0, 1, 2], tf.int64),
                                 dense_shape=[4, 4])
        for kernel in (True, False):
            for combiner in ("sum", "mean"):
                expected = [_reduce(TABLE[r], combiner) if r else [0., 0.] for r in rows]
                layer = _layer(combiner, kernel)
                self.assertAllClose(layer(ragged), expected)
                self.assertAllClose(layer(sparse), expected)

    def test_float_ids_are_cast_as_keras_does(self):
        ids = np.array([[0., 1.7], [2., 0.2]], np.float32)
        reference = tf.keras.layers.Embedding(3, 2)
        reference.build((None,))
        reference.set_weights([TABLE])
        for kernel in (True, False):
            self.assertAllEqual(_layer(None, kernel)(ids), reference(ids))
            self.assertAllEqual(_layer("sum", kernel)(ids), tf.reduce_sum(reference(ids), 1))
            ragged = tf.ragged.constant([[0., 1.7], [2.]], dtype=tf.float32)
            self.assertAllEqual(_layer(None, kernel)(ragged).flat_values,
                                TABLE[[0, 1, 2]])
        # a Sequential model feeds int ids as floats: DE's 2-D sum example still holds
        layer = Embedding(3, 2, combiner="sum")
        model = tf.keras.Sequential([layer])
        layer.set_weights([TABLE])
        self.assertAllEqual(model.predict(np.array([[0, 1], [2, 0]], np.int64), verbose=0),
                            [[4, 6], [6, 8]])

    def test_one_d_ids_with_combiner_are_one_id_per_sample(self):
        # tfhybrid's documented behaviour (DE raises ValueError here; an INFO line says so)
        with self.assertLogs("tfhybrid.layers.embedding", level="INFO") as logs:
            out = _layer("mean")(np.array([2, 0], np.int64))
        self.assertAllEqual(out, TABLE[[2, 0]])
        self.assertIn("distributed-embeddings raises", logs.output[0])

    def test_sum_gradient_equals_flat_lookup_gradient(self):
        ids = tf.constant([[0, 1, 0]], tf.int64)
        reference = tf.keras.layers.Embedding(3, 2)
        reference.build((None,))
        reference.set_weights([TABLE])
        with tf.GradientTape() as tape:
            ref_out = reference(tf.reshape(ids, [-1]))
        ref_grad = tf.convert_to_tensor(tape.gradient(ref_out, reference.embeddings))
        self.assertAllEqual(ref_grad, [[2, 2], [1, 1], [0, 0]])
        for kernel in (True, False):
            for combiner, scale in (("sum", 1.0), ("mean", 1.0 / 3)):
                layer = _layer(combiner, kernel)
                with tf.GradientTape() as tape:
                    out = layer(ids)
                grad = tf.convert_to_tensor(tape.gradient(out, layer.embeddings))
                self.assertAllClose(grad, ref_grad * scale)
            layer = _layer(None, kernel)
            with tf.GradientTape() as tape:
                out = layer(tf.reshape(ids, [-1]))
            self.assertAllEqual(tf.convert_to_tensor(tape.gradient(out, layer.embeddings)),
                                ref_grad)

    def test_use_custom_kernel_picks_the_path_and_both_agree(self):
        rng = np.random.default_rng(0)
        table = rng.normal(size=(50, 4)).astype(np.float32)
        lengths = rng.integers(0, 5, size=16)
        ids = tf.RaggedTensor.from_row_lengths(
            rng.integers(0, 50, size=int(lengths.sum())), lengths)
        fused = _layer("mean", True, table)
        plain = _layer("mean", False, table)
        self.assertAllClose(fused(ids), plain(ids), rtol=1e-6, atol=1e-6)
        self.assertAllClose(plain(ids), [table[r].mean(0) if r else np.zeros(4)
                                         for r in ids.to_list()], rtol=1e-6, atol=1e-6)
        self.assertEqual(FUSED_OP in _graph_op_types(fused, ids),
                         custom_ops.custom_ops_available())
        self.assertNotIn(FUSED_OP, _graph_op_types(plain, ids))

    def test_jit_compile_uses_plain_gathers(self):
        ids = tf.constant([[0, 2], [1, 1]], tf.int64)
        for combiner in (None, "sum", "mean"):
            layer = _layer(combiner)
            compiled = tf.function(lambda x, layer=layer: layer(x), jit_compile=True)
            self.assertAllClose(compiled(ids), layer(ids))

    def test_output_shapes_and_mixed_precision(self):
        layer = Embedding(10, 3, combiner="sum")
        self.assertEqual(layer.compute_output_shape((4, 5, 6)), (4, 5, 3))
        self.assertEqual(layer.compute_output_shape((4, 6)), (4, 3))
        half = Embedding(3, 2, combiner="mean", dtype="mixed_float16")
        half.build((None,))
        half.set_weights([TABLE])
        out = half(tf.constant([[0, 1]]))
        self.assertEqual(out.dtype, tf.float16)
        self.assertEqual(half.embeddings.dtype, tf.float32)
        self.assertAllClose(out, [[2., 3.]])

    def test_config_round_trips_and_accepts_keras_configs(self):
        layer = Embedding(7, 3, combiner="mean", use_custom_kernel=False, name="t",
                          embeddings_initializer="zeros")
        config = layer.get_config()
        self.assertEqual((config["combiner"], config["use_custom_kernel"]), ("mean", False))
        clone = Embedding.from_config(config)
        self.assertEqual(clone.get_config(), config)
        keras_config = tf.keras.layers.Embedding(7, 3, name="k").get_config()
        from_keras = Embedding.from_config(keras_config)
        self.assertEqual((from_keras.combiner, from_keras.use_custom_kernel), (None, True))

    def test_invalid_arguments_raise_value_errors_naming_them(self):
        cases = [
            (lambda: Embedding(5, 2, combiner="max"), "'max'"),
            (lambda: Embedding(5, 2, combiner="indices_weight"), "indices_weight"),
            (lambda: Embedding(5, 2, use_custom_kernel="yes"), "use_custom_kernel='yes'"),
            (lambda: Embedding(5, 2, combiner="sum", mask_zero=True), "mask_zero"),
            (lambda: Embedding(0, 2), "input_dim"),
            (lambda: _layer("sum")(tf.ragged.constant([[[0], [1]], [[2]]])), "[batch, None]"),
            (lambda: _layer("sum")(tf.SparseTensor([[0, 0, 0]], [1], [1, 1, 1])),
             "max_hotness"),
        ]
        for make, text in cases:
            with self.assertRaisesRegex(ValueError, re.escape(text)):
                make()

    def test_out_of_range_id_names_the_table(self):
        for kernel in (True, False):
            with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "got id 3"):
                _layer("sum", kernel)(tf.constant([[0, 3]]))

    def test_cpu_initializer_gives_the_wrapped_values(self):
        init = CPUInitializer(tf.keras.initializers.RandomUniform(seed=3))
        plain = tf.keras.initializers.RandomUniform(seed=3)
        self.assertAllEqual(init((4, 2)), plain((4, 2)))
        clone = CPUInitializer.from_config(init.get_config())
        self.assertAllEqual(clone((4, 2)), plain((4, 2)))


class ConcatOneHotEmbeddingTest(tf.test.TestCase):

    SIZES = [3, 5, 7, 11]

    def test_lookup_reads_each_features_own_rows(self):
        ids = np.array([[1, 2, 3, 4], [2, 4, 6, 10]], np.int32)
        offsets = np.cumsum([0] + self.SIZES)
        for kernel in (True, False):
            layer = ConcatOneHotEmbedding(self.SIZES, 3, use_custom_kernel=kernel)
            out = layer(ids)
            self.assertEqual(layer.params.shape, (26, 3))
            self.assertAllEqual(layer.offsets, offsets)
            params = layer.params.numpy()
            self.assertEqual(out.shape, (2, 4, 3))
            self.assertAllEqual(out, params[ids + offsets[:-1]])
            self.assertAllEqual(layer(ids.astype(np.int64)), out)
            self.assertAllEqual(layer(ids.astype(np.float32)), out)
            self.assertEqual(FUSED_OP in _graph_op_types(layer, ids),
                             kernel and custom_ops.custom_ops_available())

    def test_gradient_reaches_only_the_looked_up_rows(self):
        layer = ConcatOneHotEmbedding([2, 3], 2)
        ids = tf.constant([[1, 0], [1, 2]])
        with tf.GradientTape() as tape:
            out = layer(ids)
        grad = tf.convert_to_tensor(tape.gradient(out, layer.params))
        self.assertAllEqual(grad, [[0, 0], [2, 2], [1, 1], [0, 0], [1, 1]])

    def test_id_outside_its_feature_raises(self):
        layer = ConcatOneHotEmbedding([3, 5], 2, name="cat")
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"feature 0 got id 3, expected ids in \[0, 3\)"):
            layer(tf.constant([[3, 0]]))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"feature 1 got id 5, expected ids in \[0, 5\)"):
            tf.function(layer)(tf.constant([[0, 0], [1, 5]]))

    def test_bad_arguments_raise_value_errors(self):
        with self.assertRaisesRegex(ValueError, r"feature_sizes\[1\]=0"):
            ConcatOneHotEmbedding([3, 0], 2)
        with self.assertRaisesRegex(ValueError, "feature_sizes=\\[\\]"):
            ConcatOneHotEmbedding([], 2)
        with self.assertRaisesRegex(ValueError, "embedding_width=2.5"):
            ConcatOneHotEmbedding([3], 2.5)
        with self.assertRaisesRegex(ValueError, r"\[batch, 2\].*\(2, 3\)"):
            ConcatOneHotEmbedding([3, 4], 2)(tf.zeros([2, 3], tf.int32))

    def test_config_round_trips_and_old_name(self):
        layer = ConcatOneHotEmbedding([3, 4], 2, embeddings_initializer="ones", name="c")
        config = layer.get_config()
        clone = ConcatOneHotEmbedding.from_config(config)
        self.assertEqual(clone.get_config(), config)
        self.assertAllEqual(clone(tf.constant([[0, 3]])), np.ones([1, 2, 2]))
        self.assertIs(ConcatEmbedding, ConcatOneHotEmbedding)


class IntegerLookupTest(tf.test.TestCase):

    def test_de_list_example_matches_keras(self):
        vocab = [12, 36, 1138, 42]
        data = [[12, 1138, 42], [42, 1000, 36]]
        for use_gpu in (True, False):
            layer = IntegerLookup(max_tokens=4, use_gpu=use_gpu)
            layer(tf.constant(vocab, tf.int64))
            out = layer(tf.constant(data, tf.int64))
            self.assertEqual(out.dtype, tf.int64)
            self.assertAllEqual(out, [[1, 3, 4], [4, 0, 2]])
            self.assertAllEqual(out, tf.keras.layers.IntegerLookup(vocabulary=vocab)(data))
            self.assertEqual(layer.get_vocabulary(), [-1] + vocab)

    def test_vocabulary_from_duplicates_matches_native_keras(self):
        rng = np.random.default_rng(1)
        for use_gpu in (True, False):
            keys = rng.integers(0, 200, size=300)
            first_seen = list(dict.fromkeys(keys.tolist()))
            layer = IntegerLookup(max_tokens=len(first_seen), use_gpu=use_gpu)
            self.assertAllEqual(layer(keys), [first_seen.index(k) + 1 for k in keys])
            self.assertEqual(layer.get_vocabulary(), [-1] + first_seen)
            reference = tf.keras.layers.IntegerLookup(vocabulary=layer.get_vocabulary()[1:])
            data = tf.range(0, 256, dtype=tf.int64)
            self.assertAllEqual(layer(data), reference(data))

    def test_capacity_oov_and_first_appearance_order(self):
        layer = IntegerLookup(max_tokens=3, use_gpu=False)
        self.assertEqual(layer.capacity, 4)
        self.assertAllEqual(layer(tf.constant([9, -1, 9, 4], tf.int64)), [1, 0, 1, 2])
        self.assertEqual(layer.num_empty_slot, 1)
        # one slot left: 8 (seen first) takes it, 5 and 3 are out of vocabulary
        self.assertAllEqual(layer(tf.constant([[8, 5], [4, 3]], tf.int64)), [[3, 0], [2, 0]])
        self.assertAllEqual(layer(tf.constant([5, 8, -1], tf.int64)), [0, 3, 0])
        self.assertEqual(layer.get_vocabulary(), [-1, 9, 4, 8])
        self.assertEqual(layer.num_empty_slot, 0)
        self.assertIsNone(layer.count)
        empty = IntegerLookup(max_tokens=0)
        self.assertAllEqual(empty(tf.constant([1, 2], tf.int64)), [0, 0])

    def test_use_gpu_counts_how_often_each_index_is_returned(self):
        layer = IntegerLookup(max_tokens=2, use_gpu=True)
        outs = [layer(tf.constant(batch, tf.int64)).numpy()
                for batch in ([3, 3, 4, 9, 4], [[9, 3], [7, -1]])]
        expected = np.bincount(np.concatenate([o.ravel() for o in outs]), minlength=3)
        expected[0] += 1  # the reserved OOV row starts at 1
        self.assertAllEqual(layer.count, expected)
        self.assertAllEqual(expected, [5, 3, 2])

    def test_graph_mode_keeps_growing_the_vocabulary(self):
        layer = IntegerLookup(max_tokens=5, use_gpu=True)
        step = tf.function(layer)
        self.assertAllEqual(step(tf.constant([5, 6, 5], tf.int64)), [1, 2, 1])
        self.assertAllEqual(step(tf.constant([7, 5, 8], tf.int64)), [3, 1, 4])
        inputs = tf.keras.Input(shape=(2,), dtype=tf.int64)
        model = tf.keras.Model(inputs, layer(inputs))
        self.assertAllEqual(model.predict(np.array([[9, 6], [10, 8]]), verbose=0),
                            [[5, 2], [0, 4]])
        self.assertEqual(layer.get_vocabulary(), [-1, 5, 6, 7, 8, 9])

    def test_ragged_and_sparse_keys_keep_their_structure(self):
        layer = IntegerLookup(max_tokens=10)
        ragged = layer(tf.ragged.constant([[5, 9], [], [5]], dtype=tf.int64))
        self.assertEqual(ragged.to_list(), [[1, 2], [], [1]])
        sparse = layer(tf.sparse.from_dense(tf.constant([[9, 0], [0, 7]], tf.int64)))
        self.assertAllEqual(sparse.indices, [[0, 0], [1, 1]])
        self.assertAllEqual(sparse.values, [2, 3])
        self.assertAllEqual(layer(tf.constant([np.iinfo(np.int64).min, -2, -3], tf.int64)),
                            [0, 4, 5])

    def test_checkpoint_restores_vocabulary_and_counts(self):
        layer = IntegerLookup(max_tokens=4, use_gpu=True)
        layer(tf.constant([30, 10, 20, 30], tf.int64))
        path = tf.train.Checkpoint(lookup=layer).save(
            os.path.join(tempfile.mkdtemp(prefix="tfhybrid-lookup-"), "ckpt"))
        restored = IntegerLookup(max_tokens=4, use_gpu=True)
        restored.build(None)
        tf.train.Checkpoint(lookup=restored).restore(path).assert_consumed()
        self.assertEqual(restored.get_vocabulary(), [-1, 30, 10, 20])
        self.assertAllEqual(restored.count, layer.count)
        self.assertAllEqual(restored(tf.constant([20, 40], tf.int64)), [3, 4])

    def test_config_and_bad_arguments(self):
        layer = IntegerLookup(max_tokens=np.int64(7), use_gpu=False, name="lk")
        clone = IntegerLookup.from_config(layer.get_config())
        self.assertEqual(clone.get_config(), layer.get_config())
        self.assertEqual((clone.max_tokens, clone.use_gpu), (7, False))
        self.assertEqual(IntegerLookup(tf.constant(3)).capacity, 4)
        for kwargs, text in (({"max_tokens": -1}, "max_tokens=-1"),
                             ({"max_tokens": 2.5}, "max_tokens=2.5"),
                             ({"max_tokens": 2, "use_gpu": "no"}, "use_gpu='no'")):
            with self.assertRaisesRegex(ValueError, text):
                IntegerLookup(**kwargs)
        with self.assertRaisesRegex(ValueError, "keys must be integers; got float32"):
            IntegerLookup(3)(tf.constant([1.5]))


class ModuleTest(tf.test.TestCase):

    NAMES = ("Embedding", "CPUInitializer", "ConcatOneHotEmbedding", "ConcatEmbedding",
             "IntegerLookup")

    def test_de_names_are_exported_from_both_paths(self):
        for name in self.NAMES:
            self.assertIs(getattr(embedding_module, name), getattr(tfhybrid.layers, name))
            self.assertIn(name, tfhybrid.layers.__all__)

    def test_docstring_examples_run(self):
        for cls in (Embedding, CPUInitializer, ConcatOneHotEmbedding, IntegerLookup):
            doc = inspect.getdoc(cls)
            self.assertIn("Example::", doc, cls.__name__)
            exec(textwrap.dedent(doc.split("Example::", 1)[1]), {})  # pylint: disable=exec-used


if __name__ == "__main__":
    tf.test.main()
