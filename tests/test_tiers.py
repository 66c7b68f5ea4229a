"""A table on disk behind a DRAM cache (tfhybrid.tiers): exactness, eviction, checkpoints."""

from __future__ import annotations

import os
import shutil
import tempfile
import unittest

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.optimizers import RowWiseAdagrad
from tfhybrid.plan import tier_dram_bytes
from tfhybrid.fiited import ChunkedTable
from tfhybrid.tiers import CachedTable, ChunkedCachedTable

KERAS_3 = tfhybrid.keras_major() == 3

KERAS = (2, 3)

ROWS, DIM, CACHE, HOT, BATCH = 1000, 8, 100, 3, 32


def _data(steps=30, seed=0):
    rng = np.random.default_rng(seed)
    # Zipf ids: a hot head that stays cached and a tail that keeps evicting
    ids = (rng.zipf(1.2, size=(steps * BATCH, HOT)) % ROWS).astype(np.int64)
    return ids, rng.random((steps * BATCH, 1)).astype(np.float32)


def _model(store_dir=None, policy="lru", combiner="sum", cache_rows=CACHE):
    kwargs = ({} if store_dir is None else
              dict(cache_rows=cache_rows, store_dir=store_dir, cache_policy=policy))
    ids = tf.keras.Input((HOT,), dtype=tf.int64)
    rows = Embedding(ROWS, DIM, combiner=combiner, name="table", **kwargs)(ids)
    if combiner is None:
        rows = tf.keras.layers.Flatten()(rows)
    out = tf.keras.layers.Dense(1, kernel_initializer="ones", name="head")(rows)
    return tf.keras.Model(ids, out)


def _weights_path(folder: str) -> str:
    """Where save_weights writes: Keras 3 writes a weights file, named .weights.h5."""
    path = os.path.join(folder, "ckpt", "weights")
    if KERAS_3:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return f"{path}.weights.h5"
    return path


class _TempDir(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="tfhybrid-tiers-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def fresh_dir(self) -> str:
        """A folder of its own, for a table that lives beside the test's others."""
        return tempfile.mkdtemp(dir=self.dir)


class TieredTrainingTest(_TempDir):

    def _pair(self, optimizer, steps_per_execution=1, **kwargs):
        """A tiered model and an in-memory one with the same initial weights."""
        tiered, memory = _model(self.fresh_dir(), **kwargs), _model(**{
            k: v for k, v in kwargs.items() if k == "combiner"})
        table = tiered.get_layer("table").table
        memory.get_layer("table").embeddings.assign(table.read_rows(0, ROWS))
        memory.get_layer("head").set_weights(tiered.get_layer("head").get_weights())
        tiered.compile(optimizer(), "mse", steps_per_execution=steps_per_execution)
        memory.compile(optimizer(), "mse", steps_per_execution=steps_per_execution)
        return tiered, memory, table

    def _assert_same_training(self, optimizer, **kwargs):
        tiered, memory, table = self._pair(optimizer, **kwargs)
        ids, labels = _data()
        got = tiered.fit(ids, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        want = memory.fit(ids, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        self.assertEqual(got.history["loss"], want.history["loss"])
        np.testing.assert_array_equal(table.read_rows(0, ROWS),
                                      memory.get_layer("table").embeddings.numpy())
        stats = table.stats()
        # the test means something only if rows were evicted, written back and reloaded
        self.assertGreater(stats["writebacks"], 0)
        self.assertGreater(stats["hits"], 0)
        self.assertGreater(stats["misses"], CACHE)
        self.assertEqual(tiered.evaluate(ids, labels, verbose=0),
                         memory.evaluate(ids, labels, verbose=0))
        np.testing.assert_array_equal(tiered.predict(ids[:64], verbose=0),
                                      memory.predict(ids[:64], verbose=0))
        return tiered, memory, table

    def test_sgd_equals_the_table_in_memory_bit_for_bit(self):
        self._assert_same_training(lambda: tf.keras.optimizers.SGD(0.1))

    def test_rowwise_adagrad_equals_the_table_in_memory_with_its_state(self):
        for policy in ("lru", "lfu"):
            with self.subTest(policy=policy):
                _, memory, table = self._assert_same_training(
                    lambda: RowWiseAdagrad(0.1), policy=policy)
                accumulator = [v for v in memory.optimizer.variables
                               if "accumulator" in v.name][0]
                np.testing.assert_array_equal(table.read_accumulator(0, ROWS),
                                              accumulator.numpy())

    def test_mean_and_no_combiner_equal_the_table_in_memory(self):
        for combiner in ("mean", None):
            with self.subTest(combiner=combiner):
                self._assert_same_training(lambda: RowWiseAdagrad(0.1), combiner=combiner)

    def test_several_steps_per_call_keep_the_steps_in_order(self):
        # fit's loop over steps inside one tf.function: each step's cache fill follows
        # the previous step's update
        self._assert_same_training(lambda: RowWiseAdagrad(0.1), steps_per_execution=4)

    def test_layer_weights_are_the_table_in_row_order(self):
        tiered, memory, table = self._pair(lambda: RowWiseAdagrad(0.1))
        ids, labels = _data(steps=8)
        tiered.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0)
        layer = tiered.get_layer("table")
        accumulator = table.read_accumulator(0, ROWS)
        (weights,) = layer.get_weights()
        np.testing.assert_array_equal(weights, table.read_rows(0, ROWS))
        layer.set_weights([weights * 2])
        np.testing.assert_array_equal(layer.get_weights()[0], weights * 2)
        # the optimizer's row state stays, as Keras keeps slots across set_weights
        np.testing.assert_array_equal(table.read_accumulator(0, ROWS), accumulator)
        with self.assertRaisesRegex(ValueError, r"takes one table; got 2"):
            layer.set_weights([weights, weights])
        with self.assertRaisesRegex(ValueError, r"SparseTensor"):
            Embedding(ROWS, DIM, cache_rows=CACHE, store_dir=self.fresh_dir())(
                tf.sparse.from_dense(tf.constant([[1, 0]])))

    def test_a_checkpoint_holds_the_table_not_the_cache(self):
        tiered, _, table = self._pair(lambda: RowWiseAdagrad(0.1))
        ids, labels = _data()
        tiered.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        values, accumulator = table.read_rows(0, ROWS), table.read_accumulator(0, ROWS)
        path = _weights_path(self.dir)
        tiered.save_weights(path)
        # the store on disk equals the table after the flush of the save
        np.testing.assert_array_equal(np.asarray(table.store), values)
        # a fresh model with a different cache state restores the same table and
        # continues exactly as the saved one does
        restored = _model(self.fresh_dir())
        restored.compile(RowWiseAdagrad(0.1), "mse")
        restored.fit(ids[:BATCH], labels[:BATCH], verbose=0)   # builds the optimizer
        restored.load_weights(path)
        restored_table = restored.get_layer("table").table
        np.testing.assert_array_equal(restored_table.read_rows(0, ROWS), values)
        np.testing.assert_array_equal(restored_table.read_accumulator(0, ROWS), accumulator)
        a = tiered.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0)
        b = restored.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0)
        self.assertEqual(a.history["loss"], b.history["loss"])
        np.testing.assert_array_equal(restored_table.read_rows(0, ROWS),
                                      table.read_rows(0, ROWS))


CHUNKS = 4


def _adaptive_model(store_dir=None, combiner="sum", custom=True):
    kwargs = {} if store_dir is None else dict(cache_rows=CACHE, store_dir=store_dir)
    ids = tf.keras.Input((HOT,), dtype=tf.int64)
    rows = Embedding(ROWS, DIM, combiner=combiner, name="table", dims="adaptive",
                     chunks=CHUNKS, target_memory=0.4, use_custom_kernel=custom,
                     **kwargs)(ids)
    if combiner is None:
        rows = tf.keras.layers.Flatten()(rows)
    out = tf.keras.layers.Dense(1, kernel_initializer="ones", name="head")(rows)
    model = tf.keras.Model(ids, out)
    model.compile(RowWiseAdagrad(0.1, use_custom_op=custom), "mse")
    return model


class AdaptiveTierTest(_TempDir):
    """FIITED's per-row widths (dims="adaptive") on a table in the tier."""

    def _pair(self, **kwargs):
        tiered, memory = _adaptive_model(self.fresh_dir(), **kwargs), _adaptive_model(**kwargs)
        table = tiered.get_layer("table").table
        memory.get_layer("table").table.write_rows(0, table.read_rows(0, ROWS))
        memory.get_layer("head").set_weights(tiered.get_layer("head").get_weights())
        return tiered, memory, table, memory.get_layer("table").table

    def _assert_same_tables(self, table, pool):
        np.testing.assert_array_equal(table.read_rows(0, ROWS), pool.to_dense().numpy())
        np.testing.assert_array_equal(table.read_accumulator(0, ROWS),
                                      pool.accumulator.numpy())
        np.testing.assert_array_equal(table.utility.numpy(), pool.utility.numpy())
        np.testing.assert_array_equal(table.chunks_per_row(), pool.chunks_per_row())

    def test_fit_with_adjustments_equals_the_adaptive_table_in_memory(self):
        from tfhybrid.callbacks import FiitedAdjust
        for combiner, custom in (("sum", True), ("mean", True), (None, True),
                                 ("sum", False), (None, False)):
            with self.subTest(combiner=combiner, custom_kernels=custom):
                tiered, memory, table, pool = self._pair(combiner=combiner, custom=custom)
                self.assertIsInstance(table, ChunkedCachedTable)
                self.assertIsInstance(pool, ChunkedTable)
                ids, labels = _data()
                histories = [model.fit(ids, labels, batch_size=BATCH, epochs=2,
                                       shuffle=False, verbose=0,
                                       callbacks=[FiitedAdjust(every_n_batches=7,
                                                               ramp_batches=20)])
                             for model in (tiered, memory)]
                self.assertEqual(histories[0].history["loss"],
                                 histories[1].history["loss"])
                self._assert_same_tables(table, pool)
                # it means something only if rows were pruned, evicted and reloaded
                self.assertEqual(table.present_chunks(), int(0.4 * ROWS * CHUNKS))
                self.assertGreater(len(set(table.chunks_per_row().tolist())), 2)
                stats = table.stats()
                self.assertGreater(stats["writebacks"], 0)
                self.assertGreater(stats["misses"], CACHE)
                # a pruned chunk reads zeros from the cache and from the store
                rows = table.read_rows(0, ROWS)
                held = table.chunks_per_row()[:, None] * (DIM // CHUNKS)
                self.assertTrue((rows[np.arange(DIM)[None, :] >= held] == 0).all())
                np.testing.assert_array_equal(tiered.predict(ids[:64], verbose=0),
                                              memory.predict(ids[:64], verbose=0))

    def test_the_table_equals_a_pool_step_by_step(self):
        # the table's own API, with weight decay and resizes between steps, both paths
        rng = np.random.default_rng(1)
        init = rng.uniform(-1, 1, (50, DIM)).astype(np.float32)
        for custom in (True, False):
            with self.subTest(custom_kernels=custom):
                table = ChunkedCachedTable(50, DIM, 12, self.fresh_dir(), chunks=CHUNKS,
                                           initializer=lambda a, b: init[a:b],
                                           use_custom_op=custom)
                pool = ChunkedTable(50, DIM, CHUNKS, initial_value=init,
                                    use_custom_op=custom)
                for step in range(40):
                    ids = tf.constant(rng.integers(0, 50, (6,)))
                    grad = rng.normal(size=(6, DIM)).astype(np.float32)
                    decay = 0.01 if step % 2 else 0.0
                    table.apply(table.slots(ids), grad, 0.1, weight_decay=decay)
                    pool.apply(ids, grad, 0.1, weight_decay=decay)
                    bags = tf.reshape(ids, [3, 2])
                    np.testing.assert_array_equal(
                        table.lookup_combine(table.slots(bags), "mean").numpy(),
                        pool.lookup_combine(bags, "mean").numpy())
                    if step % 10 == 9:
                        self.assertEqual(table.adjust(0.5), pool.adjust(0.5))
                np.testing.assert_array_equal(table.read_rows(0, 50), pool.to_dense().numpy())
                np.testing.assert_array_equal(table.utility.numpy(), pool.utility.numpy())
                np.testing.assert_array_equal(table.read_accumulator(0, 50),
                                              pool.accumulator.numpy())
                self.assertEqual(table.present_chunks(), 100)

    def test_a_checkpoint_keeps_the_widths_and_continues_exactly(self):
        from tfhybrid.callbacks import FiitedAdjust
        tiered, _, table, _ = self._pair()
        ids, labels = _data()
        tiered.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0,
                   callbacks=[FiitedAdjust(every_n_batches=5, ramp_batches=10)])
        path = _weights_path(self.dir)
        tiered.save_weights(path)
        restored = _adaptive_model(self.fresh_dir())
        restored.fit(ids[:BATCH], labels[:BATCH], verbose=0)   # builds the optimizer
        restored.load_weights(path)
        restored_table = restored.get_layer("table").table
        np.testing.assert_array_equal(restored_table.chunks_per_row(), table.chunks_per_row())
        np.testing.assert_array_equal(restored_table.read_rows(0, ROWS),
                                      table.read_rows(0, ROWS))
        np.testing.assert_array_equal(restored_table.utility.numpy(), table.utility.numpy())
        a = tiered.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0)
        b = restored.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0)
        self.assertEqual(a.history["loss"], b.history["loss"])
        np.testing.assert_array_equal(restored_table.read_rows(0, ROWS),
                                      table.read_rows(0, ROWS))

    def test_sgd_and_bad_values_are_refused_by_name(self):
        model = _adaptive_model(self.fresh_dir())
        model.compile(tf.keras.optimizers.SGD(0.1), "mse")
        ids, labels = _data(steps=1)
        with self.assertRaisesRegex(ValueError, r"SGD would update every entry of table "
                                                r"'table'.*RowWiseAdagrad"):
            model.fit(ids, labels, batch_size=BATCH, verbose=0)
        with self.assertRaisesRegex(ValueError, r"chunks=3 must divide dim=8"):
            ChunkedCachedTable(50, 8, 10, self.fresh_dir(), chunks=3)
        table = ChunkedCachedTable(50, 8, 10, self.fresh_dir(), chunks=4)
        with self.assertRaisesRegex(ValueError, r"chunks_per_row must lie in \[0, 4\]"):
            table.resize(np.full(50, 5))
        memory = table.memory_bytes()
        self.assertEqual(memory["cache"], 10 * 9 * 4)
        self.assertEqual(memory["store"], 50 * 9 * 4)
        # what the planner counts for a tiered FIITED shard is what it holds
        self.assertEqual(memory["cache"] + memory["index"],
                         tier_dram_bytes(50, 8, 10, adaptive=True))


class DistributedTierTest(_TempDir):
    """One process: DistributedEmbedding's tiered shard (the whole table) trains as in
    memory; tests/test_tiers_distributed.py runs the 2x2 and 1x4 meshes."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _model(self, store_dir=None):
        # two batches' rows at once: the layer pins the batch before (a pipeline's step)
        kwargs = {} if store_dir is None else dict(cache_rows=2 * CACHE, store_dir=store_dir)
        ids = tf.keras.Input((HOT,), dtype=tf.int64)
        layer = DistributedEmbedding([Embedding(
            ROWS, DIM, combiner="sum", name="table",
            embeddings_initializer=tf.keras.initializers.RandomUniform(seed=3), **kwargs)])
        out = tf.keras.layers.Dense(1, kernel_initializer="ones", name="head")(layer([ids])[0])
        model = tf.keras.Model(ids, out)
        model.compile(tfhybrid.DistributedOptimizer(RowWiseAdagrad(0.1)), "mse")
        return model, layer

    def test_one_process_equals_the_table_in_memory(self):
        tfhybrid.init(model_parallel=1)
        tiered, tiered_layer = self._model(self.fresh_dir())
        memory, memory_layer = self._model()
        # a seeded table starts alike in the tier and in memory
        np.testing.assert_array_equal(tiered_layer.get_weights()[0],
                                      memory_layer.get_weights()[0])
        ids, labels = _data()
        got = tiered.fit(ids, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        want = memory.fit(ids, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        self.assertEqual(got.history["loss"], want.history["loss"])
        np.testing.assert_array_equal(tiered_layer.get_weights()[0],
                                      memory_layer.get_weights()[0])
        stats = tiered_layer.route.stores.get(0, 0).stats()
        self.assertGreater(stats["writebacks"], 0)
        self.assertGreater(stats["misses"], 2 * CACHE)


class CachedTableTest(_TempDir):

    def test_eviction_follows_the_policy(self):
        # rows 1 and 2 fill a 2-row cache; row 1 is used twice, row 2 last: LRU evicts
        # row 1, LFU row 2
        for policy, evicted, kept in (("lru", 1, 2), ("lfu", 2, 1)):
            with self.subTest(policy=policy):
                table = CachedTable(10, 2, cache_rows=2, directory=self.dir, seed=0,
                                    policy=policy, name=f"t_{policy}")
                for row in (1, 1, 2, 3):
                    table.slots(tf.constant([row]))
                self.assertEqual(table.stats()["misses"], 3)
                table.slots(tf.constant([kept]))
                self.assertEqual(table.stats()["misses"], 3)
                table.slots(tf.constant([evicted]))
                self.assertEqual(table.stats()["misses"], 4)

    def test_pinned_calls_keep_the_batch_before_cached(self):
        # a pipeline loads batch t+1's rows while step t runs on batch t's slots
        for policy in ("lru", "lfu"):
            with self.subTest(policy=policy):
                table = CachedTable(10, 2, cache_rows=4, directory=self.fresh_dir(), seed=0,
                                    policy=policy, pinned_calls=2)
                table.slots(tf.constant([0, 1]))
                table.slots(tf.constant([2, 3]))
                table.slots(tf.constant([4, 5]))   # may evict only rows 0 and 1
                misses = table.stats()["misses"]
                table.slots(tf.constant([4, 5]))
                table.slots(tf.constant([2, 3]))   # still cached: the call before held them
                self.assertEqual(table.stats()["misses"], misses)
                with self.assertRaisesRegex(
                        tf.errors.InvalidArgumentError, r"one batch names 3 distinct ids and the call before "
                                    r"holds 2 more rows \(pinned_calls=2\) but the cache "
                                    r"holds cache_rows=4"):
                    table.slots(tf.constant([6, 7, 8]))

    def test_rows_written_while_cached_are_read_from_the_cache(self):
        table = CachedTable(20, 3, cache_rows=4, directory=self.dir, seed=1)
        slots = table.slots(tf.constant([5, 6]))
        table.write_rows(5, np.full((2, 3), 7.0), accumulator=[1.0, 2.0])
        np.testing.assert_array_equal(tf.gather(table.cache, slots).numpy(),
                                      np.full((2, 3), 7.0))
        np.testing.assert_array_equal(table.read_accumulator(5, 7), [1.0, 2.0])
        # the cache's change reaches the store at a flush, not before
        table.cache.scatter_add(tf.IndexedSlices(tf.ones([1, 3]), slots[:1]))
        np.testing.assert_array_equal(table.store[5], np.full(3, 7.0))
        np.testing.assert_array_equal(table.read_rows(5, 6)[0], np.full(3, 8.0))
        table.flush()
        np.testing.assert_array_equal(table.store[5], np.full(3, 8.0))

    def test_initial_rows_are_drawn_per_block_and_repeat_for_a_seed(self):
        a = CachedTable(30, 4, cache_rows=3, directory=self.dir, seed=2, name="a")
        b = CachedTable(30, 4, cache_rows=3, directory=self.dir, seed=2, name="b")
        np.testing.assert_array_equal(a.read_rows(0, 30), b.read_rows(0, 30))
        self.assertFalse(np.array_equal(a.read_rows(0, 1), a.read_rows(1, 2)))
        layer = Embedding(30, 4, cache_rows=3, store_dir=self.dir, name="seeded",
                          embeddings_initializer=tf.keras.initializers.RandomUniform(seed=5))
        layer.build(None)
        self.assertEqual(len(np.unique(layer.table.read_rows(0, 30), axis=0)), 30)

    def test_memory_counts_the_cache_and_index_not_the_store(self):
        table = CachedTable(1000, 8, cache_rows=100, directory=self.dir)
        memory = table.memory_bytes()
        self.assertEqual(memory["cache"], 100 * 9 * 4)
        self.assertEqual(memory["store"], 1000 * 9 * 4)
        self.assertEqual(os.path.getsize(table.paths[0]), 1000 * 8 * 4)
        self.assertEqual(os.path.getsize(table.paths[1]), 1000 * 4)
        # the planner's budget counts the same DRAM (tfhybrid.plan.place_in_tiers)
        self.assertEqual(memory["cache"] + memory["index"], tier_dram_bytes(1000, 8, 100))


class TieredErrorsTest(_TempDir):

    def test_bad_arguments_name_the_value(self):
        cases = [
            (dict(cache_rows=0, store_dir=self.dir), r"cache_rows=0"),
            (dict(cache_rows=True, store_dir=self.dir), r"cache_rows=True"),
            (dict(cache_rows=10), r"store_dir=None"),
            (dict(cache_rows=10, store_dir=self.dir, cache_policy="fifo"), r"'fifo'"),
            (dict(cache_rows=10, store_dir=self.dir, dims="adaptive", chunks=3),
             r"chunks=3 must be an int >= 1 that divides output_dim=4"),
            (dict(cache_rows=10, store_dir=self.dir, mask_zero=True, combiner=None),
             r"mask_zero"),
        ]
        for kwargs, message in cases:
            with self.subTest(kwargs=kwargs):
                with self.assertRaisesRegex(ValueError, message):
                    Embedding(100, 4, **kwargs)
        with self.assertRaisesRegex(ValueError, r"cache_rows=200 exceeds rows=100"):
            CachedTable(100, 4, cache_rows=200, directory=self.dir)
        live = CachedTable(100, 4, cache_rows=20, directory=self.dir, name="twice")
        with self.assertRaisesRegex(ValueError, r"another live table \('twice'\)"):
            CachedTable(100, 4, cache_rows=20, directory=self.dir, name="twice")
        del live
        with self.assertRaisesRegex(ValueError, r"directory='/nonexistent/x'"):
            CachedTable(100, 4, cache_rows=20, directory="/nonexistent/x")

    def test_a_batch_larger_than_the_cache_or_a_bad_id_is_refused(self):
        layer = Embedding(100, 4, combiner="sum", cache_rows=5, store_dir=self.dir)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"6 distinct ids but the cache holds cache_rows=5"):
            layer(tf.constant([[0, 1, 2], [3, 4, 5]]))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"got id 100, expected ids in \[0, 100\)"):
            layer(tf.constant([[0, 100]]))

    def test_optimizers_whose_slots_would_not_follow_the_rows_are_refused(self):
        ids, labels = _data(steps=1)
        optimizers = [("Adam", lambda: tf.keras.optimizers.Adam(0.1)),
                      ("SGD", lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9))]
        if not KERAS_3:   # Keras 3 has no legacy optimizers
            optimizers.append(("Adam", lambda: tf.keras.optimizers.legacy.Adam(0.1)))
        for name, make in optimizers:
            with self.subTest(optimizer=make()):
                model = _model(self.fresh_dir())
                model.compile(make(), "mse")
                with self.assertRaisesRegex(ValueError, rf"{name} keeps a .* slot per "
                                                        r"entry of table 'table'"):
                    model.fit(ids, labels, batch_size=BATCH, verbose=0)
        # the dense layers may keep any optimizer's slots
        model = _model()
        model.compile(tf.keras.optimizers.Adam(0.1), "mse")
        model.fit(ids, labels, batch_size=BATCH, verbose=0)

    def test_a_saved_model_is_refused_with_the_way_to_serve(self):
        for kwargs in ({}, dict(dims="adaptive", chunks=2)):
            with self.subTest(**kwargs):
                ids = tf.keras.Input((2,), dtype=tf.int64)
                layer = Embedding(100, 4, combiner="sum", cache_rows=5,
                                  store_dir=self.fresh_dir(), name="on_disk", **kwargs)
                model = tf.keras.Model(ids, layer(ids))
                model(tf.constant([[0, 1]]))
                with self.assertRaisesRegex(ValueError, r"'on_disk' lives in the disk tier"
                                                        r".*cannot be part of a SavedModel"
                                                        r".*set_weights"):
                    saved = os.path.join(self.fresh_dir(), "saved")
                    # Keras 3 writes a SavedModel with export; its save writes .keras files
                    if KERAS_3:
                        model.export(saved)
                    else:
                        model.save(saved)
                self.assertFalse(os.path.exists(os.path.join(saved, "saved_model.pb")))
                # the way it names: the table in memory, with this layer's weights
                memory = Embedding(100, 4, combiner="sum", **kwargs)
                memory.build(None)
                if kwargs:
                    memory.table.write_rows(0, layer.get_weights()[0])
                else:
                    memory.set_weights(layer.get_weights())
                np.testing.assert_array_equal(memory(tf.constant([[0, 1]])).numpy(),
                                              model(tf.constant([[0, 1]])).numpy())

    def test_docstring_examples_run(self):
        import inspect
        import textwrap
        for cls in (CachedTable, ChunkedCachedTable):
            doc = inspect.getdoc(cls)
            self.assertIn("Example::", doc, cls.__name__)
            exec(textwrap.dedent(doc.split("Example::", 1)[1]), {})  # pylint: disable=exec-used

    def test_xla_is_refused_naming_the_table(self):
        layer = Embedding(100, 4, combiner="sum", cache_rows=5, store_dir=self.dir,
                          name="on_disk")
        with self.assertRaisesRegex(ValueError, r"'on_disk'.*XLA"):
            tf.function(layer, jit_compile=True)(tf.constant([[0, 1]]))

    def test_config_round_trips(self):
        layer = Embedding(100, 4, combiner="mean", cache_rows=5, store_dir=self.dir,
                          cache_policy="lfu")
        config = layer.get_config()
        self.assertEqual((config["cache_rows"], config["store_dir"],
                          config["cache_policy"]), (5, self.dir, "lfu"))
        self.assertEqual(Embedding.from_config(config).get_config(), config)
        self.assertNotIn("cache_rows", Embedding(100, 4).get_config())


if __name__ == "__main__":
    tf.test.main()
