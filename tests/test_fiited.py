"""FIITED's chunked table (tfhybrid.fiited): storage, lookup, row-wise AdaGrad, adjustment."""

from __future__ import annotations

import itertools
import os
import re
import tempfile
import unittest

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import custom_ops
from tfhybrid.fiited import ChunkedTable

KERAS_3 = tfhybrid.keras_major() == 3

KERAS = (2, 3)

ROWS, DIM, CHUNKS = 50, 8, 4


def _batches(steps=4, n=40, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, ROWS // 2, size=n).astype(np.int64)   # duplicates, cold rows
        yield tf.constant(ids), tf.constant(rng.normal(size=(n, DIM)).astype(np.float32))


def _dense_reference(initial):
    var = tf.Variable(initial)
    accum = tf.Variable(tf.zeros([ROWS]))
    return var, accum


class NothingPrunedTest(unittest.TestCase):

    def test_lookup_and_adagrad_equal_a_dense_table_bit_for_bit(self):
        # the pure-TF paths of both (CppPathTest holds the C++ kernels to a reference)
        table = ChunkedTable(ROWS, DIM, CHUNKS, seed=3, use_custom_op=False)
        var, accum = _dense_reference(table.to_dense())
        for ids, grad in _batches():
            table.apply(ids, grad, learning_rate=0.05, epsilon=1e-8, weight_decay=0.01)
            custom_ops.rowwise_adagrad_apply(var, accum, ids, grad, 0.05, 1e-8,
                                             weight_decay=0.01, use_custom_op=False)
        np.testing.assert_array_equal(table.to_dense().numpy(), var.numpy())
        np.testing.assert_array_equal(table.accumulator.numpy(), accum.numpy())
        ids = tf.constant([[1, 2], [2, 49]])
        np.testing.assert_array_equal(table.lookup(ids).numpy(),
                                      tf.gather(var, ids).numpy())
        self.assertEqual(table.present_chunks(), ROWS * CHUNKS)

    def test_chunked_kernels_equal_the_pure_tf_path_after_pruning(self):
        tables = [ChunkedTable(ROWS, DIM, CHUNKS, seed=8, min_chunks=0, use_custom_op=op)
                  for op in (True, False)]
        for step, (ids, grad) in enumerate(_batches(steps=6, seed=4)):
            for table in tables:
                table.apply(ids, grad, learning_rate=0.05, weight_decay=0.01)
                if step == 2:   # prune, some rows to nothing, then keep training
                    table.adjust(target_memory=0.3)
            # the C++ lookup copies exactly the rows of the table's dense form
            np.testing.assert_array_equal(tables[0].lookup(ids).numpy(),
                                          tables[0].to_dense().numpy()[ids.numpy()])
            np.testing.assert_allclose(tables[0].to_dense().numpy(),
                                       tables[1].to_dense().numpy(), rtol=1e-5, atol=1e-7)
        self.assertEqual(tables[0].chunks_per_row().tolist(),
                         tables[1].chunks_per_row().tolist())
        self.assertIn(0, tables[0].chunks_per_row().tolist())
        np.testing.assert_allclose(tables[0].accumulator.numpy(),
                                   tables[1].accumulator.numpy(), rtol=1e-5)
        np.testing.assert_allclose(tables[0].utility.numpy(), tables[1].utility.numpy(),
                                   rtol=1e-5)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "got id 50"):
            custom_ops.chunked_lookup(tables[0].pool, tables[0].row_offsets,
                                      tf.constant([50]), DIM, use_custom_op=True)

    def test_fused_lookup_combine_equals_the_pure_tf_path_after_pruning(self):
        from tfhybrid.custom_ops import coalesce_rows
        tables = [ChunkedTable(ROWS, DIM, CHUNKS, seed=9, min_chunks=0, use_custom_op=op)
                  for op in (True, False)]
        for table in tables:
            table.utility.assign(tf.range(ROWS, dtype=tf.float32))
            table.adjust(target_memory=0.4)
        self.assertIn(0, tables[0].chunks_per_row().tolist())
        ragged = tf.ragged.constant([[3, 7, 3, 49], [], [0, 25, 25]], dtype=tf.int64)
        dense = tf.constant([[1, 2, 2], [48, 30, 1]], dtype=tf.int32)
        for ids in (ragged, dense):
            for combiner in ("sum", "mean"):
                results = []
                for table in tables:
                    with tf.GradientTape() as tape:
                        out = table.lookup_combine(ids, combiner)
                        loss = tf.reduce_sum(out * tf.range(1.0, DIM + 1.0))
                    grad = tape.gradient(loss, table.pool)
                    results.append((out, *coalesce_rows(grad.indices, grad.values)))
                (out, ids_op, rows_op), (want, ids_tf, rows_tf) = results
                np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-6)
                np.testing.assert_array_equal(ids_op.numpy(), ids_tf.numpy())
                np.testing.assert_allclose(rows_op.numpy(), rows_tf.numpy(), rtol=1e-6)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "got id 50"):
            tables[0].lookup_combine(tf.constant([[50]]))

    def test_traced_apply_equals_eager(self):
        eager, traced = ChunkedTable(ROWS, DIM, CHUNKS, seed=5), ChunkedTable(ROWS, DIM,
                                                                               CHUNKS, seed=5)
        step = tf.function(lambda i, g: traced.apply(i, g, learning_rate=0.1))
        for ids, grad in _batches(seed=2):
            eager.apply(ids, grad, learning_rate=0.1)
            step(ids, grad)
        np.testing.assert_array_equal(eager.to_dense().numpy(), traced.to_dense().numpy())


def _float32_rowwise_adagrad(w, v, held, ids, grad, lr, eps, scale, wd):
    """Row-wise AdaGrad on a dense float32 numpy table, step by step in the order the C++
    kernels document (cc/kernels/sum_squares_impl.h): a row's gradient rows added in
    input order; the squares of its first ``held[i]`` entries into 16 lanes (entry d into
    lane d % 16 while 16 remain, the rest into lane 0), the lanes added as a tree, times
    1/held; then the step and the decay on those entries. Every operation is one float32
    operation, so the result is exact, not approximate."""
    f = np.float32
    w, v = w.copy(), v.copy()
    lr, eps, scale = f(lr), f(eps), f(scale)
    decay = lr * f(wd)
    for i in dict.fromkeys(ids.tolist()):
        rows = grad[ids == i]
        g = rows[0].copy()
        for row in rows[1:]:
            g = g + row
        h = int(held[i])
        if h == 0:
            continue
        lanes = np.zeros(16, f)
        whole = h - h % 16
        for d in range(0, whole, 16):
            lanes = lanes + g[d:d + 16] * g[d:d + 16]
        for d in range(whole, h):
            lanes[0] = lanes[0] + g[d] * g[d]
        for width in (8, 4, 2, 1):
            lanes[:width] = lanes[:width] + lanes[width:2 * width]
        v[i] = v[i] + lanes[0] * (f(1) / f(h))
        mult = lr / (np.sqrt(v[i] / scale) + eps)
        stepped = w[i, :h] - mult * g[:h]
        w[i, :h] = stepped - decay * stepped if wd else stepped
    return w, v


class CppPathTest(unittest.TestCase):
    """FIITED's C++ kernels (the path users run) against a dense float32 numpy table:
    equal bit for bit until pruning, and on the held entries after it, at widths under,
    over and at whole multiples of the kernels' 16 lanes."""

    SHAPES = ((12, 4), (40, 8), (64, 8))   # (dim, chunks)
    SETTINGS = ((0.05, 1e-8, 1.0, 0.0), (0.2, 1e-3, 4.0, 0.01))   # lr, eps, scale, decay

    def _batches(self, dim, seed):
        rng = np.random.default_rng(seed)
        for _ in range(4):
            ids = rng.integers(0, ROWS // 2, size=40)   # duplicates, rows never touched
            yield ids, rng.normal(size=(40, dim)).astype(np.float32)

    def test_a_pool_holding_every_entry_updates_as_a_dense_table_bit_for_bit(self):
        for (dim, chunks), (lr, eps, scale, wd) in itertools.product(self.SHAPES,
                                                                     self.SETTINGS):
            with self.subTest(dim=dim, chunks=chunks, scale=scale, weight_decay=wd):
                table = ChunkedTable(ROWS, dim, chunks, seed=dim, use_custom_op=True)
                w = start = table.to_dense().numpy()
                v = np.zeros([ROWS], np.float32)
                var, accum = tf.Variable(w), tf.Variable(v)
                held = np.full([ROWS], dim)
                for ids, grad in self._batches(dim, seed=dim + 1):
                    table.apply(tf.constant(ids), tf.constant(grad), learning_rate=lr,
                                epsilon=eps, scale=scale, weight_decay=wd)
                    custom_ops.rowwise_adagrad_apply(var, accum, tf.constant(ids),
                                                     tf.constant(grad), lr, eps, scale=scale,
                                                     weight_decay=wd, use_custom_op=True)
                    w, v = _float32_rowwise_adagrad(w, v, held, ids, grad, lr, eps, scale,
                                                    wd)
                np.testing.assert_array_equal(table.to_dense().numpy(), w)
                np.testing.assert_array_equal(table.accumulator.numpy(), v)
                # the dense kernel too: so the pool equals the dense table users replace
                np.testing.assert_array_equal(var.numpy(), w)
                np.testing.assert_array_equal(accum.numpy(), v)
                # the rows moved: the equality is not of untouched tables
                self.assertGreater(np.abs(w - start).max(), 1e-3)

    def test_a_pruned_pool_updates_its_held_entries_as_the_dense_reference(self):
        for dim, chunks in self.SHAPES:
            with self.subTest(dim=dim, chunks=chunks):
                table = ChunkedTable(ROWS, dim, chunks, seed=dim, min_chunks=0,
                                     use_custom_op=True)
                batches = list(self._batches(dim, seed=dim + 2))
                table.apply(tf.constant(batches[0][0]), tf.constant(batches[0][1]),
                            learning_rate=0.1)
                table.adjust(target_memory=0.45)
                held = table.chunks_per_row() * (dim // chunks)
                # held counts that are not powers of two: a reciprocal that rounds
                self.assertTrue(set(held.tolist()) - {0, 1, 2, 4, 8, 16, 32, 64})
                w, v = table.to_dense().numpy(), table.accumulator.numpy()
                for ids, grad in batches[1:]:
                    table.apply(tf.constant(ids), tf.constant(grad), learning_rate=0.1,
                                weight_decay=0.01)
                    w, v = _float32_rowwise_adagrad(w, v, held, ids, grad, 0.1, 1e-8, 1.0,
                                                    0.01)
                np.testing.assert_array_equal(table.to_dense().numpy(), w)
                np.testing.assert_array_equal(table.accumulator.numpy(), v)


class PruningTest(unittest.TestCase):

    def _trained(self, seed=0):
        table = ChunkedTable(ROWS, DIM, CHUNKS, seed=seed, utility_decay=0.9)
        for ids, grad in _batches(seed=seed):
            table.apply(ids, grad, learning_rate=0.05)
        return table

    def test_lookup_equals_dense_with_pruned_entries_zeroed(self):
        table = self._trained()
        before = table.to_dense().numpy()
        stats = table.adjust(target_memory=0.4)
        counts = table.chunks_per_row()
        self.assertEqual(stats["present"], int(0.4 * ROWS * CHUNKS))
        self.assertEqual(counts.sum(), stats["present"])
        # every row keeps a prefix of at least min_chunks (1) chunks
        self.assertTrue((counts >= 1).all())
        # rows never looked up (utility 0) lose chunks before rows that were
        utility = table.utility.numpy()
        self.assertGreater(counts[utility > 0].mean(), counts[utility == 0].mean())
        expected = before.copy()
        for i, k in enumerate(counts):
            expected[i, k * (DIM // CHUNKS):] = 0.0
        np.testing.assert_array_equal(table.to_dense().numpy(), expected)
        ids = tf.constant([0, 7, 30, 49, 7])
        np.testing.assert_array_equal(table.lookup(ids).numpy(), expected[ids.numpy()])

    def test_updates_touch_only_present_chunks(self):
        table = self._trained(seed=1)
        table.adjust(target_memory=0.5)
        dense = table.to_dense().numpy()
        accum = table.accumulator.numpy()
        counts = table.chunks_per_row()
        ids, grad = next(_batches(steps=1, seed=9))
        table.apply(ids, grad, learning_rate=0.1)
        # the reference: numpy over each row's held entries only
        cd = DIM // CHUNKS
        g = np.zeros((ROWS, DIM), np.float64)
        np.add.at(g, ids.numpy(), grad.numpy().astype(np.float64))
        for i in np.unique(ids.numpy()):
            held = counts[i] * cd
            accum[i] += np.mean(g[i, :held] ** 2)
            dense[i, :held] -= 0.1 * g[i, :held] / (np.sqrt(accum[i]) + 1e-8)
        np.testing.assert_allclose(table.to_dense().numpy(), dense, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(table.accumulator.numpy(), accum, rtol=1e-5)
        self.assertEqual(table.present_chunks(), counts.sum())

    def test_pool_bytes_are_the_present_chunks(self):
        table = self._trained(seed=2)
        full = table.memory_bytes()
        self.assertEqual(full["pool"], ROWS * DIM * 4)
        table.adjust(target_memory=0.25)
        mem = table.memory_bytes()
        chunk_bytes = (DIM // CHUNKS) * 4
        self.assertEqual(mem["pool"], table.present_chunks() * chunk_bytes)
        self.assertEqual(table.pool_slots(), table.present_chunks())
        self.assertEqual(mem["zero_chunk"], chunk_bytes)
        self.assertEqual(mem["total"], mem["pool"] + mem["zero_chunk"] + mem["row_offsets"]
                         + mem["row_state"])
        self.assertEqual(mem["row_offsets"], (ROWS + 1) * 4)
        self.assertEqual(mem["dense"], ROWS * (DIM + 1) * 4)

    def test_freed_chunks_are_reused_and_regrown_chunks_start_at_zero(self):
        table = self._trained(seed=3)
        table.adjust(target_memory=0.5)
        size = table.pool_slots()
        before = table.to_dense().numpy()
        # make the least useful rows the most useful: they must grow, others shrink
        counts = table.chunks_per_row()
        low = np.argsort(counts, kind="stable")[:5]
        utility = np.zeros(ROWS, np.float32)
        utility[low] = 100.0
        table.utility.assign(utility)
        stats = table.adjust(target_memory=0.5)
        self.assertGreater(stats["grown"], 0)
        self.assertEqual(stats["freed"], stats["grown"])     # the freed memory grows them
        self.assertEqual(table.pool_slots(), size)     # no new memory
        after = table.to_dense().numpy()
        cd = DIM // CHUNKS
        new_counts = table.chunks_per_row()
        for i in low:
            self.assertEqual(new_counts[i], CHUNKS)
            np.testing.assert_array_equal(after[i, :counts[i] * cd],
                                          before[i, :counts[i] * cd])
            np.testing.assert_array_equal(after[i, counts[i] * cd:], 0.0)

    def test_a_table_with_every_chunk_pruned_reads_zeros_and_trains(self):
        table = ChunkedTable(ROWS, DIM, CHUNKS, min_chunks=0, seed=6)
        table.resize(np.zeros(ROWS, np.int64))
        self.assertEqual((table.pool_slots(), table.present_chunks()), (0, 0))
        ids, grad = next(_batches(steps=1))
        step = tf.function(lambda i, g: table.apply(i, g, learning_rate=0.1))
        step(ids, grad)
        np.testing.assert_array_equal(table.lookup(ids).numpy(), 0.0)
        table.utility.assign(tf.range(ROWS, dtype=tf.float32))
        table.adjust(target_memory=0.1)              # the most useful rows regrow, as zeros
        self.assertEqual(table.present_chunks(), int(0.1 * ROWS * CHUNKS))
        np.testing.assert_array_equal(table.to_dense().numpy(), 0.0)

    def test_checkpoint_restores_a_pruned_table(self):
        table = self._trained(seed=4)
        table.adjust(target_memory=0.3)
        with tempfile.TemporaryDirectory() as d:
            path = tf.train.Checkpoint(table=table).save(os.path.join(d, "ckpt"))
            fresh = ChunkedTable(ROWS, DIM, CHUNKS, seed=99)
            tf.train.Checkpoint(table=fresh).restore(path).assert_consumed()
        np.testing.assert_array_equal(fresh.to_dense().numpy(), table.to_dense().numpy())
        np.testing.assert_array_equal(fresh.row_offsets.numpy(), table.row_offsets.numpy())
        self.assertEqual(fresh.memory_bytes(), table.memory_bytes())


class ErrorsTest(unittest.TestCase):

    def test_bad_arguments_name_the_value(self):
        with self.assertRaisesRegex(ValueError, "chunks=3 must divide dim=8"):
            ChunkedTable(10, 8, 3)
        with self.assertRaisesRegex(ValueError, r"rows must be an integer >= 1, got 0"):
            ChunkedTable(0, 8, 2)
        with self.assertRaisesRegex(ValueError, "min_chunks=5 exceeds chunks=4"):
            ChunkedTable(10, 8, 4, min_chunks=5)
        with self.assertRaisesRegex(ValueError, r"initial_value has shape \(2, 8\)"):
            ChunkedTable(10, 8, 4, initial_value=np.zeros((2, 8)))
        table = ChunkedTable(10, 8, 4)
        for bad in (0.0, 1.5, float("nan"), "half", True):
            with self.assertRaisesRegex(ValueError, "target_memory must be a number in"):
                table.adjust(bad)
        with self.assertRaisesRegex(ValueError, r"chunks_per_row must be 10 integers, got "
                                                r"shape \(3,\)"):
            table.resize([1, 2, 3])
        with self.assertRaisesRegex(ValueError, r"must lie in \[0, 4\], got values in "
                                                r"\[0, 5\]"):
            table.resize(np.array([0] * 9 + [5]))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "an id >= rows"):
            table.lookup(tf.constant([10]))
        with self.assertRaisesRegex(ValueError, "ids must be int32 or int64"):
            table.lookup(tf.constant([1.0]))


if __name__ == "__main__":
    unittest.main()


# --------------------------------------------------------------------------- the Keras layer
INIT = tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=1)


def _layers(combiner):
    from tfhybrid.layers import Embedding
    dense = Embedding(ROWS, DIM, combiner=combiner, embeddings_initializer=INIT,
                      use_custom_kernel=False)
    adaptive = Embedding(ROWS, DIM, combiner=combiner, embeddings_initializer=INIT,
                         dims="adaptive", chunks=CHUNKS, target_memory=0.5,
                         use_custom_kernel=False)
    return dense, adaptive


def _model(layer):
    from tfhybrid.optimizers import RowWiseAdagrad
    inputs = tf.keras.Input([3], dtype=tf.int32)
    outputs = tf.keras.layers.Dense(1, kernel_initializer="ones")(layer(inputs))
    model = tf.keras.Model(inputs, outputs)
    model.compile(RowWiseAdagrad(0.1, use_custom_op=False), "mse")
    return model


def _data(n=64):
    rng = np.random.default_rng(7)
    return rng.integers(0, ROWS, (n, 3)), rng.normal(size=(n, 1)).astype(np.float32)


class AdaptiveLayerTest(unittest.TestCase):

    def test_lookups_equal_the_dense_layer(self):
        ids = tf.constant([[1, 2, 2], [4, 49, 1]])
        ragged = tf.ragged.constant([[1, 2], [], [3, 3, 3]])
        for combiner in ("sum", "mean", None):
            dense, adaptive = _layers(combiner)
            np.testing.assert_array_equal(adaptive(ids).numpy(), dense(ids).numpy())
            got, want = adaptive(ragged), dense(ragged)
            if combiner is None:
                got, want = got.flat_values, want.flat_values
            np.testing.assert_array_equal(got.numpy(), want.numpy())
            # the pool is the layer's one trainable weight (a Keras 3 weight wraps it)
            self.assertEqual(len(adaptive.trainable_weights), 1)
            weight, = adaptive.trainable_weights
            self.assertEqual(weight.shape, adaptive.table.pool.shape)
            np.testing.assert_array_equal(weight.numpy(), adaptive.table.pool.numpy())

    def test_fit_equals_the_dense_layer_bit_for_bit_then_prunes(self):
        from tfhybrid.callbacks import FiitedAdjust
        for combiner in ("sum", "mean"):
            dense, adaptive = _layers(combiner)
            x, y = _data()
            dense_model, adaptive_model = _model(dense), _model(adaptive)
            for model in (dense_model, adaptive_model):
                model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
            np.testing.assert_array_equal(adaptive.table.to_dense().numpy(),
                                          dense.embeddings.numpy())
            accumulators = [v for v in dense_model.optimizer.variables
                            if v.shape == (ROWS,)]
            np.testing.assert_array_equal(adaptive.table.accumulator.numpy(),
                                          accumulators[0].numpy())
            # every 2 batches, ramping to the layer's 0.5 over 4 batches
            adaptive_model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                               callbacks=[FiitedAdjust(every_n_batches=2, ramp_batches=4)])
            self.assertEqual(adaptive.table.present_chunks(), ROWS * CHUNKS // 2)
            memory = adaptive.table.memory_bytes()
            self.assertLess(memory["total"], memory["dense"])

    def test_a_layer_first_built_inside_fit_trains_as_the_dense_layer(self):
        # a Sequential model without an Input builds its layers in fit's first step, which
        # Keras 3 traces: the pool must still be made from a value outside that function
        from tfhybrid.optimizers import RowWiseAdagrad
        dense, adaptive = _layers("sum")
        x, y = _data()
        for layer in (dense, adaptive):
            model = tf.keras.Sequential([layer, tf.keras.layers.Dense(
                1, kernel_initializer="ones")])
            model.compile(RowWiseAdagrad(0.1, use_custom_op=False), "mse")
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        np.testing.assert_array_equal(adaptive.table.to_dense().numpy(),
                                      dense.embeddings.numpy())

    def test_adjust_needs_the_row_wise_optimizer(self):
        from tfhybrid.callbacks import FiitedAdjust
        _, adaptive = _layers("sum")
        model = _model(adaptive)
        model.compile(tf.keras.optimizers.Adam(0.01), "mse")
        x, y = _data(16)
        with self.assertRaisesRegex(ValueError, "Adam's per-entry state cannot follow"):
            model.fit(x, y, verbose=0, callbacks=[FiitedAdjust(every_n_batches=1)])
        with self.assertRaisesRegex(ValueError, "every_n_batches must be an int >= 1, got 0"):
            FiitedAdjust(every_n_batches=0)

    def test_other_optimizers_are_refused_by_name(self):
        # SGD without momentum makes no slot: it is refused when it is built with the pool
        optimizers = [tf.keras.optimizers.SGD(0.1), tf.keras.optimizers.Adam(0.01)]
        if not KERAS_3:
            optimizers.append(tf.keras.optimizers.legacy.SGD(0.1))
        x, y = _data(16)
        for optimizer in optimizers:
            with self.subTest(optimizer=optimizer):
                _, adaptive = _layers("sum")
                model = _model(adaptive)
                model.compile(optimizer, "mse")
                with self.assertRaisesRegex(
                        ValueError, rf"{type(optimizer).__name__} cannot train table "
                        r"'\w+', a FIITED table \(dims='adaptive'\).*RowWiseAdagrad"):
                    model.fit(x, y, verbose=0)

    def test_config_round_trips_and_saved_model_serves(self):
        from tfhybrid.layers import Embedding
        _, adaptive = _layers("mean")
        config = adaptive.get_config()
        self.assertEqual((config["dims"], config["chunks"], config["target_memory"]),
                         ("adaptive", CHUNKS, 0.5))
        self.assertEqual(Embedding.from_config(config).get_config(), config)
        dense_config = Embedding(ROWS, DIM).get_config()
        self.assertNotIn("dims", dense_config)
        model = _model(adaptive)
        x, y = _data(32)
        model.fit(x, y, batch_size=16, verbose=0)
        adaptive.adjust(0.25)
        want = model.predict(x, verbose=0)
        with tempfile.TemporaryDirectory() as d:
            tf.saved_model.save(model, d)
            served = tf.saved_model.load(d)
            got = served.signatures["serving_default"](tf.constant(x, tf.int32))
        # the served graph may sum a bag in another order than the fused kernel
        np.testing.assert_allclose(list(got.values())[0].numpy(), want, rtol=1e-6,
                                   atol=1e-7)

    def test_bad_settings_name_the_value(self):
        from tfhybrid.layers import Embedding
        with self.assertRaisesRegex(ValueError, "dims='wide' is unknown"):
            Embedding(10, 8, dims="wide")
        with self.assertRaisesRegex(ValueError, "chunks=3 must be an int >= 1 that divides "
                                                "output_dim=8"):
            Embedding(10, 8, dims="adaptive", chunks=3)
        with self.assertRaisesRegex(ValueError, "target_memory must be a number in"):
            Embedding(10, 8, dims="adaptive", target_memory=0)
        with self.assertRaisesRegex(ValueError, r"does not support \['sparse'\]"):
            Embedding(10, 8, dims="adaptive", sparse=True)
        with self.assertRaisesRegex(ValueError, "adjust\\(\\) needs dims='adaptive'"):
            Embedding(10, 8).adjust()

    def test_distributed_embedding_rejects_what_it_cannot_shard(self):
        import tfhybrid
        from tfhybrid import mesh as mesh_lib
        from tfhybrid.layers import Embedding
        try:
            tfhybrid.init(model_parallel=1)
            with self.assertRaisesRegex(ValueError, r"tables \['t'\] have dims='adaptive' "
                                                    r"\(FIITED\), which needs replica_sync="
                                                    "'gradients'"):
                tfhybrid.DistributedEmbedding([Embedding(10, 8, dims="adaptive", name="t")],
                                              replica_sync="weights")
            # a plan whose column slices of 4 and 12 columns cut the 8-column chunks
            from tfhybrid import plan as planning
            plan = planning.plan_sharding([planning.TableConfig("t", 100, 16)], 1, 1)
            slices = ('"kind": "column_wise", "shards": ['
                      '{"table": "t", "row_start": 0, "row_end": 100, "col_start": 0, '
                      '"col_end": 4, "owner": 0}, {"table": "t", "row_start": 0, '
                      '"row_end": 100, "col_start": 4, "col_end": 16, "owner": 0}]')
            plan = planning.ShardingPlan.from_json(re.sub(
                r'"kind": "table_wise", "shards": \[[^\]]*\]', slices, plan.to_json()))
            layer = tfhybrid.DistributedEmbedding(
                [Embedding(100, 16, combiner="sum", dims="adaptive", chunks=2, name="t")],
                plan=plan)
            with self.assertRaisesRegex(ValueError, r"is split into columns \[0, 4\), which "
                                                    "cut a chunk"):
                layer([tf.constant([[1, 2]])])
        finally:
            mesh_lib.reset()

    def test_distributed_embedding_in_one_process_equals_the_layer(self):
        import tfhybrid
        from tfhybrid import mesh as mesh_lib
        from tfhybrid.layers import Embedding
        try:
            tfhybrid.init(model_parallel=1)
            init = tf.keras.initializers.RandomUniform(-0.1, 0.1, seed=4)
            make = lambda: Embedding(ROWS, DIM, combiner="sum", dims="adaptive",  # noqa
                                     chunks=CHUNKS, target_memory=0.5, name="t",
                                     embeddings_initializer=init)
            single = make()
            layer = tfhybrid.DistributedEmbedding([make()])
            ids = tf.constant(np.random.default_rng(1).integers(0, ROWS, (16, 3)))
            single(ids)
            layer([ids])
            single.table.write_rows(0, layer.get_weights()[0])
            from tfhybrid.optimizers import RowWiseAdagrad
            for embedding in (single, layer):
                opt = RowWiseAdagrad(0.1)
                for _ in range(3):
                    with tf.GradientTape() as tape:
                        out = embedding(ids if embedding is single else [ids])
                        loss = tf.reduce_sum(tf.square(out[0] if embedding is layer
                                                       else out))
                    variables = embedding.trainable_variables
                    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
            kept = layer.adjust()
            single.adjust()
            self.assertEqual(kept, {"t": ROWS * CHUNKS // 2})
            np.testing.assert_array_equal(layer.chunks_per_row()[0],
                                          single.table.chunks_per_row())
            np.testing.assert_allclose(layer.get_weights()[0], single.table.to_dense(),
                                       rtol=1e-6, atol=1e-7)
            self.assertEqual(layer.memory_bytes()["embedding"],
                             single.table.memory_bytes()["pool"]
                             + single.table.memory_bytes()["zero_chunk"]
                             + single.table.memory_bytes()["row_offsets"])
        finally:
            mesh_lib.reset()

class CompactCheckpointTest(unittest.TestCase):
    """A DistributedEmbedding checkpoint holds a FIITED table compactly: only the present
    chunks, each row's chunk count, and per-chunk-column row state."""

    def _layer(self, dims, seed=4):
        import tfhybrid
        from tfhybrid.layers import Embedding
        from tfhybrid.optimizers import RowWiseAdagrad
        init = tf.keras.initializers.RandomUniform(-0.1, 0.1, seed=seed)
        adaptive = dict(dims="adaptive", chunks=CHUNKS, target_memory=0.3) if dims else {}
        layer = tfhybrid.DistributedEmbedding(
            [Embedding(ROWS, DIM, combiner="sum", name="a", embeddings_initializer=init,
                       **adaptive),
             Embedding(ROWS, 4 * DIM, combiner="sum", name="b",
                       embeddings_initializer=init, **adaptive)])
        optimizer = tfhybrid.DistributedOptimizer(RowWiseAdagrad(0.1))
        ids = [tf.constant(np.random.default_rng(seed).integers(0, ROWS, (16, 3)))] * 2
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(tf.square(x)) for x in layer(ids)])
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return layer, optimizer

    def _keys(self, path):
        found = {}
        for key, shape in tf.train.list_variables(path):
            match = re.search(r"tables/\.ATTRIBUTES/table_(\d)(_\w+)?$", key)
            if match:
                found[f"table_{match.group(1)}{match.group(2) or ''}"] = shape
        return found

    def test_holds_only_present_chunks_and_restores_exactly(self):
        import tfhybrid
        from tfhybrid import mesh as mesh_lib
        try:
            tfhybrid.init(model_parallel=1)
            layer, optimizer = self._layer(dims="adaptive")
            layer.adjust()
            counts = layer.chunks_per_row()
            weights = layer.get_weights()
            with tempfile.TemporaryDirectory() as d:
                path = tf.train.Checkpoint(layer=layer, optimizer=optimizer).save(
                    os.path.join(d, "ckpt"))
                keys = self._keys(path)
                for t, dim in enumerate((DIM, 4 * DIM)):
                    # only the present chunks, chunk-major
                    self.assertEqual(keys[f"table_{t}"],
                                     [int(counts[t].sum()), dim // CHUNKS])
                    self.assertEqual(keys[f"table_{t}_chunk_counts"], [ROWS])
                    self.assertEqual(keys[f"table_{t}_utility"], [ROWS, CHUNKS])
                    reader = tf.train.load_checkpoint(path)
                    slot = [k for k, _ in tf.train.list_variables(path)
                            if k.endswith(f"table_{t}_accumulator")]
                    self.assertEqual(reader.get_tensor(slot[0]).shape, (ROWS, CHUNKS))
                    np.testing.assert_array_equal(
                        reader.get_tensor([k for k, _ in tf.train.list_variables(path)
                                           if k.endswith(f"table_{t}_chunk_counts")][0]),
                        counts[t])
                pools = [store.widths for _, store in layer.stores.items()
                         if store.widths is not None]
                wanted = {t: (table.accumulator.numpy(), table.utility.numpy())
                          for t, table in enumerate(pools)}
                mesh_lib.reset()
                tfhybrid.init(model_parallel=1)
                fresh, fresh_optimizer = self._layer(dims="adaptive", seed=9)
                tf.train.Checkpoint(layer=fresh, optimizer=fresh_optimizer).restore(
                    path).assert_existing_objects_matched()
            for got, want in zip(fresh.chunks_per_row(), counts):
                np.testing.assert_array_equal(got, want)
            for got, want in zip(fresh.get_weights(), weights):
                np.testing.assert_array_equal(got, want)
            pools = [store.widths for _, store in fresh.stores.items()
                     if store.widths is not None]
            self.assertEqual(len(pools), len(counts))
            for t, table in enumerate(pools):
                np.testing.assert_array_equal(table.accumulator.numpy(), wanted[t][0])
                np.testing.assert_array_equal(table.utility.numpy(), wanted[t][1])
                self.assertEqual(table.pool_slots(), int(counts[t].sum()))
            # the restored layout is the one the next save places chunks by
            with tempfile.TemporaryDirectory() as d:
                path = tf.train.Checkpoint(layer=fresh).save(os.path.join(d, "ckpt"))
                self.assertEqual(self._keys(path)["table_0"], [int(counts[0].sum()),
                                                               DIM // CHUNKS])
        finally:
            mesh_lib.reset()

    def test_compact_layout_places_every_shard_in_one_run_per_chunk(self):
        import doctest
        import sys
        from tfhybrid.fiited import saved
        self.assertEqual(doctest.testmod(sys.modules[saved.__name__]).failed, 0)
        counts = np.random.default_rng(3).integers(0, CHUNKS + 1, ROWS)
        layout = saved.CompactLayout.of(counts, CHUNKS)
        # chunk-major: every (row, chunk) present exactly once, in order
        order = [(j, i) for j in range(CHUNKS) for i in range(ROWS) if counts[i] > j]
        self.assertEqual(layout.present, len(order))
        for rows, chunks in (((0, ROWS), (0, CHUNKS)), ((7, 31), (1, 3))):
            for j, start, n in layout.runs(*rows, *chunks):
                self.assertEqual(order[start:start + n],
                                 [(j, i) for i in range(*rows) if counts[i] > j])

    def test_a_dense_checkpoint_is_refused_by_name(self):
        import tfhybrid
        from tfhybrid import mesh as mesh_lib
        try:
            tfhybrid.init(model_parallel=1)
            dense, _ = self._layer(dims=None)
            with tempfile.TemporaryDirectory() as d:
                path = tf.train.Checkpoint(layer=dense).save(os.path.join(d, "ckpt"))
                mesh_lib.reset()
                tfhybrid.init(model_parallel=1)
                adaptive, _ = self._layer(dims="adaptive")
                with self.assertRaisesRegex(ValueError, "holds table 'a' without a FIITED "
                                                        "chunk layout"):
                    tf.train.Checkpoint(layer=adaptive).restore(path)
        finally:
            mesh_lib.reset()

    def test_other_chunk_sizes_are_refused_by_name(self):
        import tfhybrid
        from tfhybrid import mesh as mesh_lib
        from tfhybrid.layers import Embedding
        try:
            layers = []
            for chunks in (CHUNKS, CHUNKS // 2):
                mesh_lib.reset()
                tfhybrid.init(model_parallel=1)
                layer = tfhybrid.DistributedEmbedding([Embedding(
                    ROWS, DIM, combiner="sum", name="a", dims="adaptive", chunks=chunks)])
                layer([tf.constant([[1, 2]])])
                layers.append(layer)
            layers[0].adjust(0.25)    # one chunk per row: counts fit both layers
            with tempfile.TemporaryDirectory() as d:
                path = tf.train.Checkpoint(layer=layers[0]).save(os.path.join(d, "ckpt"))
                # 4 chunks of 2 saved; 2 chunks of 4 asked for
                with self.assertRaisesRegex(ValueError, r"holds table 'a' as \[50, 2\] "
                                                        r"present chunks.*need \[50, 4\]"):
                    tf.train.Checkpoint(layer=layers[1]).restore(path)
        finally:
            mesh_lib.reset()
