"""tfhybrid.sharding: every store kind answers the protocol alike; the examples run."""

import doctest
import inspect
import tempfile
import textwrap

import numpy as np
import tensorflow as tf

import tfhybrid  # before tf.keras is used: checks which Keras it is
from tfhybrid import custom_ops
from tfhybrid.fiited import ChunkedTable
from tfhybrid.fiited import saved as fiited_saved, sharded as fiited_sharded
from tfhybrid.sharding import (bags, full_tables, id_check, ownership, placement, rank_stores,
                               route, stores, tables)
from tfhybrid.optimizer_traits import Trains
from tfhybrid.plan.types import Shard
from tfhybrid.tiers import CachedTable, ChunkedCachedTable

ROWS, WIDTH = 40, 4


def _values() -> np.ndarray:
    return np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH) / 7.0


def _stores(directory: str) -> dict:
    """One store of each kind, every one holding _values() (all built on the C++ ops
    where the library is built, as users run them)."""
    start = tf.constant(_values())
    custom = tf.keras.layers.Embedding(ROWS, WIDTH, embeddings_initializer="zeros")
    custom.build(tf.TensorShape([None]))
    made = {
        "kernel": stores.KernelTable(tf.Variable(tf.zeros([ROWS, WIDTH])), "t",
                                     use_custom_kernel=True),
        "fiited": stores.FiitedPool(ChunkedTable(ROWS, WIDTH, 2, initial_value=start,
                                                 name="fiited")),
        "tiered": stores.TieredCache(
            CachedTable(ROWS, WIDTH, ROWS, directory, name="tiered",
                        initializer=lambda a, b: np.zeros([b - a, WIDTH], np.float32)),
            "t", use_custom_kernel=True),
        "tiered_fiited": stores.TieredCache(
            ChunkedCachedTable(ROWS, WIDTH, ROWS, directory, chunks=2, name="tiered_fiited",
                               initializer=lambda a, b: np.zeros([b - a, WIDTH], np.float32)),
            "t", use_custom_kernel=True),
        "custom": stores.CustomLayerTable(custom, combiner=None),
    }
    for store in made.values():
        store.write_rows(0, _values())
    return made


class StoreProtocolTest(tf.test.TestCase):

    def test_every_kind_reads_back_what_was_written(self):
        with tempfile.TemporaryDirectory() as directory:
            for kind, store in _stores(directory).items():
                self.assertAllEqual(np.asarray(store.read_rows(3, 9)), _values()[3:9],
                                    msg=kind)

    def test_every_kind_sums_bags_like_a_numpy_table(self):
        # the users' path: the C++ kernels (the suite builds them; fails if missing)
        custom_ops.require_library()
        replicas = stores.ShardReplicas("layer", tfhybrid.init(model_parallel=1), "gradients")
        ids = np.array([0, 5, 5, 39, 7, 2, 1], np.int64)
        bags = {"pooled": np.array([3, 0, 1, 3], np.int64),
                # a custom layer without a combiner looks up one id per bag
                "one per bag": np.ones([len(ids)], np.int64)}
        with tempfile.TemporaryDirectory() as directory:
            for kind, store in _stores(directory).items():
                for shape, lengths in bags.items():
                    if kind == "custom" and shape == "pooled":
                        continue
                    # the reference: plain numpy sums of the written values
                    ends = np.cumsum(lengths)
                    expected = np.stack([_values()[ids[end - n:end]].sum(axis=0)
                                         for n, end in zip(lengths, ends)])
                    # the rows each store reads for routed ids (a tier's cache slots),
                    # as the route asks for them
                    looked_up = store.rows_of(tf.constant(ids), replicas, "t")
                    got = store.lookup(looked_up, tf.constant(lengths))
                    self.assertAllClose(got, expected, rtol=0, atol=1e-5,
                                        msg=f"{kind}, {shape}")
                    # mean: the sum over the bag's length, zeros for an empty bag
                    mean = store.lookup(looked_up, tf.constant(lengths), "mean")
                    self.assertAllClose(mean, expected / np.maximum(lengths, 1)[:, None],
                                        rtol=0, atol=1e-5, msg=f"{kind}, {shape}, mean")

    def test_every_kind_weighs_bags_like_a_numpy_table(self):
        # weighted sum / mean / sqrtn of the written rows, as the route asks for them
        custom_ops.require_library()
        replicas = stores.ShardReplicas("layer", tfhybrid.init(model_parallel=1), "gradients")
        ids = np.array([0, 5, 5, 39, 7, 2, 1], np.int64)
        lengths = np.array([3, 0, 1, 3], np.int64)
        weights = np.array([0.5, 2.0, 1.5, 3.0, 0.25, 1.0, 2.0], np.float32)
        rows = _values()[ids] * weights[:, None]
        ends = np.cumsum(lengths)
        sums = np.stack([rows[end - n:end].sum(axis=0) for n, end in zip(lengths, ends)])
        divisors = {"sum": np.ones(len(lengths)),
                    "mean": [weights[end - n:end].sum() for n, end in zip(lengths, ends)],
                    "sqrtn": [np.sqrt((weights[end - n:end] ** 2).sum())
                              for n, end in zip(lengths, ends)]}
        with tempfile.TemporaryDirectory() as directory:
            for kind, store in _stores(directory).items():
                if kind == "custom":
                    continue   # a user's layer without a combiner: one id per bag
                looked_up = store.rows_of(tf.constant(ids), replicas, "t")
                for combiner, divisor in divisors.items():
                    got = store.lookup(looked_up, tf.constant(lengths), combiner,
                                       tf.constant(weights))
                    want = np.where(np.asarray(divisor)[:, None] > 0,
                                    sums / np.maximum(np.asarray(divisor), 1e-30)[:, None], 0)
                    self.assertAllClose(got, want, rtol=0, atol=1e-5, msg=f"{kind} {combiner}")

    def test_an_unknown_combiner_is_named(self):
        ids, lengths = tf.constant([1, 2], tf.int64), tf.constant([1, 1], tf.int64)
        with tempfile.TemporaryDirectory() as directory:
            for kind, store in _stores(directory).items():
                with self.assertRaisesRegex(
                        ValueError, r"combiner='max' is unknown.*\('sum', 'mean', 'sqrtn'\)",
                        msg=kind):
                    store.lookup(ids, lengths, "max")

    def test_every_kind_names_the_optimizers_that_train_it(self):
        with tempfile.TemporaryDirectory() as directory:
            made = _stores(directory)
        self.assertEqual(made["kernel"].trained_by, frozenset(Trains))
        self.assertEqual(made["fiited"].trained_by, {Trains.ROW_STATE})
        self.assertEqual(made["tiered"].trained_by, {Trains.ROW_STATE, Trains.NO_STATE})
        self.assertEqual(made["tiered_fiited"].trained_by, {Trains.ROW_STATE})
        # and what Keras tracks for the layer, and which have per-row widths
        self.assertIsNone(made["kernel"].tracked)
        self.assertEqual({k for k, store in made.items() if store.widths is not None},
                         {"fiited", "tiered_fiited"})

    def test_memory_names_the_same_keys_for_every_kind(self):
        with tempfile.TemporaryDirectory() as directory:
            for kind, store in _stores(directory).items():
                memory = store.memory_bytes()
                self.assertEqual(set(memory), {"embedding", "dense", "store"}, kind)
                self.assertEqual(memory["dense"], ROWS * WIDTH * 4, kind)


class StoreSetTest(tf.test.TestCase):

    def test_finds_stores_by_table_and_shard(self):
        with tempfile.TemporaryDirectory() as directory:
            made = _stores(directory)
            held = stores.StoreSet()
            for index, kind in enumerate(("kernel", "fiited", "tiered", "custom")):
                held.add(index, 0, made[kind])
            self.assertIs(held.get(1, 0), made["fiited"])
            self.assertIsNone(held.get(0, 0).widths)
            self.assertIsNotNone(held.get(1, 0).widths)
            self.assertIsNone(held.get(1, 1))
            self.assertEqual(len(list(held.items())), 4)


class OwnershipTest(tf.test.TestCase):

    def test_row_ranges_route_each_id_to_the_one_shard_that_owns_it(self):
        rng = np.random.default_rng(3)
        ids = rng.integers(0, 100, 40)
        lengths = np.array([5, 0, 10, 25])
        cuts = [0, 30, 31, 77, 100]
        owned = []
        for start, end in zip(cuts, cuts[1:]):
            rows, counts = ownership.ownership_of("row_wise").shard_ids(
                tf.constant(ids, tf.int64), tf.constant(lengths, tf.int64),
                Shard("t", start, end, 0, 1, 0), 4)
            # the reference: a plain loop over the bags
            bags = np.split(ids, np.cumsum(lengths)[:-1])
            self.assertAllEqual(counts, [np.sum((b >= start) & (b < end)) for b in bags])
            self.assertAllEqual(rows, [i - start for i in ids if start <= i < end])
            owned += [i for i in ids if start <= i < end]
        self.assertCountEqual(owned, ids)

    def test_an_unknown_kind_is_named(self):
        with self.assertRaisesRegex(ValueError, "'diagonal'"):
            ownership.ownership_of("diagonal")


class ExamplesTest(tf.test.TestCase):

    def test_module_and_class_examples_run(self):
        for module in (tables, stores, route, bags, id_check, full_tables, placement,
                       rank_stores, ownership, fiited_saved, fiited_sharded):
            self.assertEqual(doctest.testmod(module).failed, 0, module.__name__)
            docs = [inspect.getdoc(module)] + [
                inspect.getdoc(cls) for _, cls in inspect.getmembers(module, inspect.isclass)
                if cls.__module__ == module.__name__ and not cls.__name__.startswith("_")
                and "Example::" in (inspect.getdoc(cls) or "")]
            for doc in docs:
                if "Example::" in doc:
                    exec(textwrap.dedent(doc.split("Example::", 1)[1]), {})  # pylint: disable=exec-used

    def test_public_classes_have_examples(self):
        for module in (stores, route, bags, id_check, full_tables, placement, rank_stores,
                       ownership, fiited_saved, fiited_sharded):
            for name, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ != module.__name__ or name.startswith("_"):
                    continue
                if name in ("TableStore", "RowWidths", "SavedLayout", "StoreContext",
                            "RouteEntry", "Bags", "LayerPlacement", "RankStores",
                            "Ownership"):
                    continue    # protocols and plain records
                self.assertIn("Example::", inspect.getdoc(cls), f"{module.__name__}.{name}")


if __name__ == "__main__":
    tf.test.main()
