"""Dynamic tables in one process: the C++ find-or-insert against a model of its rules in
plain Python (dicts of keys), and DynamicEmbedding trained against a dict of key -> row
that starts from the documented key function and applies row-wise AdaGrad by hand."""

import math
import os
import tempfile

import numpy as np
import tensorflow as tf

import tfhybrid  # noqa: F401 - before tf.keras is used: checks which Keras it is
from tfhybrid import custom_ops
from tfhybrid.dynamic.table import DynamicTable
from tfhybrid.layers import DynamicEmbedding
from tfhybrid.optimizers import RowWiseAdagrad
from tests import _dynamic_case as dc
from tests._dynamic_case import initial_row

# the table and the layer hold in both Kerases
KERAS = (2, 3)

class RuleModel:
    """The find-or-insert rules (dynamic_table_kernels.cc's header) on dicts of keys."""

    def __init__(self, capacity, admit_after=1, evict="lfu", ttl=0, pinned=1):
        self.capacity, self.admit_after, self.evict = capacity, admit_after, evict
        self.ttl, self.pinned = ttl, pinned
        self.live = {}      # key -> [seen, count]
        self.cands = {}     # key -> [seen, count]
        self.counters = dict(admissions=0, evictions=0, refusals=0, hits=0, misses=0)
        self.call = 0

    def __call__(self, keys):
        self.call += 1
        call = self.call
        occurs = {}
        for k in keys:
            occurs[k] = occurs.get(k, 0) + 1
        missing = []
        for k in sorted(occurs):
            if k in self.live:
                self.live[k][0] = call
                self.live[k][1] += occurs[k]
                self.counters["hits"] += occurs[k]
            else:
                self.counters["misses"] += occurs[k]
                missing.append(k)
        if self.ttl:
            for k in [k for k, (seen, _) in self.live.items() if call - seen > self.ttl]:
                del self.live[k]
                self.counters["evictions"] += 1
        admit = []
        if self.admit_after <= 1:
            admit = [(k, occurs[k]) for k in missing]
        else:
            new = []
            for k in missing:
                if k in self.cands:
                    self.cands[k][0] = call
                    self.cands[k][1] += occurs[k]
                else:
                    new.append(k)
            replaceable = sorted((seen, k) for k, (seen, _) in self.cands.items() if seen < call)
            for k in new:
                if len(self.cands) < self.capacity:
                    self.cands[k] = [call, occurs[k]]
                elif replaceable:
                    _, old = replaceable.pop(0)
                    del self.cands[old]
                    self.cands[k] = [call, occurs[k]]
            for k in missing:
                if k in self.cands and self.cands[k][1] >= self.admit_after:
                    admit.append((k, self.cands.pop(k)[1]))
        free = self.capacity - len(self.live)
        victims = []
        if len(admit) > free and self.evict != "none":
            eligible = [k for k, (seen, _) in self.live.items() if seen <= call - self.pinned]
            if self.evict == "lfu":
                eligible.sort(key=lambda k: (self.live[k][1], self.live[k][0], k))
            else:
                eligible.sort(key=lambda k: (self.live[k][0], self.live[k][1], k))
            victims = eligible[:len(admit) - free]
        for k, count in admit:
            if free > 0:
                free -= 1
            elif victims:
                del self.live[victims.pop(0)]
                self.counters["evictions"] += 1
            else:
                self.counters["refusals"] += occurs[k]
                continue
            self.live[k] = [call, count]
            self.counters["admissions"] += 1
        return {k: k in self.live for k in keys}


def _stream(rng, calls, per_call, universe):
    """Long-tailed keys: a few hot ones, many seen once; negative and huge ones too."""
    keys = np.concatenate([np.arange(-universe // 2, universe // 2, dtype=np.int64),
                           np.array([-(1 << 63), (1 << 63) - 1, 1 << 40], np.int64)])
    weights = 1.0 / np.arange(1, len(keys) + 1) ** 1.1
    weights /= weights.sum()
    perm = rng.permutation(len(keys))
    return [keys[perm[rng.choice(len(keys), per_call, p=weights)]] for _ in range(calls)]


class FindOrInsertTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        custom_ops.require_library()   # the users' path: the C++ op (the suite builds it)

    def check_against_the_rules(self, capacity, **rules):
        # the C++ op, as users run it, and its NumPy twin
        for use_custom_op in (True, False):
            self.check_one_path(capacity, use_custom_op, **rules)

    def check_one_path(self, capacity, use_custom_op, **rules):
        model = RuleModel(capacity, rules.get("admit_after", 1), rules.get("evict") or "none",
                          rules.get("ttl_steps") or 0, rules.get("pinned_calls", 1))
        table = DynamicTable(capacity, 3, initializer="zeros", use_custom_op=use_custom_op,
                             **rules)
        for step, keys in enumerate(_stream(np.random.default_rng(capacity), 40, 24, 200)):
            slots = table.slots(tf.constant(keys)).numpy()
            admitted = model(keys.tolist())
            what = f"{rules}, C++ {use_custom_op}, call {step + 1}"
            self.assertEqual([s >= 0 for s in slots], [admitted[k] for k in keys.tolist()], what)
            slot_keys = table.slot_keys.numpy()
            for key, slot in zip(keys.tolist(), slots):
                if slot >= 0:
                    self.assertEqual(slot_keys[slot], key, what)
            held = {int(k): [int(s), int(c)] for k, s, c in zip(
                slot_keys, table.slot_seen.numpy(), table.slot_count.numpy()) if s >= 0}
            self.assertEqual(held, model.live, what)
            stats = table.stats()
            self.assertEqual({k: stats[k] for k in model.counters}, model.counters, what)
            self.assertEqual(stats["size"], len(model.live), what)
            # every held key is found where it is, without changing anything
            before = table.counters.numpy()
            found = table.slots(tf.constant(list(held) + [12345678901], tf.int64),
                                insert=False).numpy()
            self.assertEqual([slot_keys[s] for s in found[:-1]], list(held), what)
            self.assertEqual(found[-1], -1)   # a key never seen
            self.assertAllEqual(table.counters.numpy(), before)

    def test_lfu_and_lru_follow_the_rules(self):
        self.check_against_the_rules(16, evict="lfu")
        self.check_against_the_rules(17, evict="lru")

    def test_admission_candidates_and_expiry_follow_the_rules(self):
        self.check_against_the_rules(16, admit_after=3, evict="lfu")
        self.check_against_the_rules(12, admit_after=2, evict="lru", ttl_steps=3)
        self.check_against_the_rules(16, evict="lfu", ttl_steps=2, pinned_calls=2)

    def test_the_numpy_twin_gives_the_kernels_slots_bit_for_bit(self):
        rules = dict(admit_after=2, evict="lru", ttl_steps=4, pinned_calls=2)
        self.check_twins(20, 2, _stream(np.random.default_rng(9), 30, 32, 300), **rules)

    def test_the_kernel_writes_new_rows_as_the_twin_and_tf_ops_do(self):
        # the op writes new keys' rows and zero accumulators itself; calls of thousands
        # of missing keys (any int64, repeated) take its radix sort
        rng = np.random.default_rng(4)
        big = [np.concatenate([rng.integers(-2**63, 2**63 - 1, 1500), [-1, 0, 1, 2**63 - 1],
                               rng.integers(-40, 40, 600)]) for _ in range(3)]
        for init, dim in ((tf.keras.initializers.RandomUniform(-0.3, 0.2), 5),
                          (tf.keras.initializers.RandomNormal(0.1, 0.4), 3), (0.5, 2)):
            self.check_twins(3000, dim, big, initializer=init, seed=7, evict="lfu")

    def check_twins(self, capacity, dim, stream, **rules):
        """The C++ op and its NumPy twin (rows by TensorFlow's ops), call by call: the
        same slots, and the same state, rows and accumulators, bit for bit."""
        tables = [DynamicTable(capacity, dim, use_custom_op=op, **rules)
                  for op in (True, False)]
        for keys in stream:
            for t in tables:
                # a nonzero accumulator everywhere: a new key's slot must reset it
                t.accumulator.assign(t.accumulator + 1.0)
            got = [t.slots(tf.constant(keys, tf.int64)).numpy() for t in tables]
            self.assertAllEqual(got[0], got[1])
        for name in ("slot_keys", "slot_seen", "slot_count", "index", "cand_keys",
                     "cand_seen", "cand_count", "cand_index", "counters", "rows",
                     "accumulator"):
            self.assertAllEqual(getattr(tables[0], name), getattr(tables[1], name), name)

    def test_a_full_table_without_eviction_refuses_and_counts(self):
        self.check_against_the_rules(16, evict=None)
        table = DynamicTable(2, 2, initializer="ones", evict=None)
        self.assertAllEqual(table.slots(tf.constant([5, 6, 7, 7], tf.int64)), [0, 1, -1, -1])
        self.assertEqual(table.stats()["refusals"], 2)
        # a refused key reads zeros
        rows = table.lookup(tf.constant([0, -1], tf.int32), tf.constant([1, 1]))
        self.assertAllEqual(rows, [[1.0, 1.0], [0.0, 0.0]])

    def test_a_new_key_starts_from_its_initial_row_after_eviction(self):
        init = tf.keras.initializers.RandomUniform(-1.0, 1.0)
        table = DynamicTable(1, 4, initializer=init, seed=3, evict="lru")
        first = table.slots(tf.constant([42], tf.int64))
        table.rows.assign(tf.ones([1, 4]) * 9.0)
        table.accumulator.assign([5.0])
        table.slots(tf.constant([43], tf.int64))          # evicts 42
        table.slots(tf.constant([42], tf.int64))          # 42 again, from its key
        self.assertAllEqual(first, [0])
        np.testing.assert_allclose(table.rows.numpy()[0], initial_row(-1.0, 1.0, 3, 42, 4),
                                   rtol=0, atol=1e-7)
        self.assertEqual(float(table.accumulator.numpy()[0]), 0.0)

    def test_bad_arguments_are_named(self):
        for kwargs, message in ((dict(capacity=0), "capacity must be an integer >= 1"),
                                (dict(evict="fifo"), "evict='fifo' is unknown"),
                                (dict(admit_after=0), "admit_after must be an integer >= 1"),
                                (dict(ttl_steps=0), "ttl_steps must be an integer >= 1")):
            with self.assertRaisesRegex(ValueError, message):
                DynamicTable(**{"capacity": 4, "dim": 2, **kwargs})
        with self.assertRaisesRegex(ValueError, "keys must be int64, got int32"):
            DynamicTable(4, 2).slots(tf.constant([1]))


class DynamicEmbeddingTest(tf.test.TestCase):

    DIM, LR, EPS = 4, 0.05, 1e-8

    def _batches(self, steps=10, batch=6, hotness=3):
        rng = np.random.default_rng(5)
        universe = np.array([-(1 << 62), -17, -1, 0, 3, 99, 1 << 33, (1 << 63) - 1, 12, 7])
        return [(universe[rng.integers(0, len(universe), [batch, hotness])],
                 rng.normal(size=[batch, self.DIM]).astype(np.float32)) for _ in range(steps)]

    def _layer(self, combiner):
        return DynamicEmbedding(self.DIM, capacity=64, combiner=combiner,
                                initializer=tf.keras.initializers.RandomUniform(-0.5, 0.5),
                                seed=11)

    def test_a_custom_loop_equals_a_dict_of_rows(self):
        for combiner in ("sum", "mean"):
            batches = self._batches()
            want_out, want_rows = dc.reference_training(batches, self.DIM, -0.5, 0.5, 11,
                                                      self.LR, self.EPS, combiner)
            layer = self._layer(combiner)
            optimizer = RowWiseAdagrad(learning_rate=self.LR, epsilon=self.EPS)
            for (keys, weights), want in zip(batches, want_out):
                with tf.GradientTape() as tape:
                    out = layer(tf.constant(keys), training=True)
                    loss = tf.reduce_sum(out * weights)
                grads = tape.gradient(loss, layer.trainable_variables)
                optimizer.apply_gradients(zip(grads, layer.trainable_variables))
                np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-6,
                                           err_msg=combiner)
            got = layer.table
            for key, row in want_rows.items():
                slot = int(got.slots(tf.constant([key], tf.int64), insert=False)[0])
                np.testing.assert_allclose(got.rows.numpy()[slot], row, rtol=0, atol=1e-6,
                                           err_msg=f"{combiner} key {key}")

    def test_fit_equals_a_dict_of_rows(self):
        batches = self._batches(steps=8)
        _, want_rows = dc.reference_training(batches, self.DIM, -0.5, 0.5, 11, self.LR,
                                           self.EPS, "sum")
        keys = tf.keras.Input(shape=[3], dtype=tf.int64)
        layer = self._layer("sum")
        model = tf.keras.Model(keys, layer(keys))
        # loss = sum(outputs * weights): mean squared error's gradient would mix them
        model.compile(optimizer=RowWiseAdagrad(learning_rate=self.LR, epsilon=self.EPS),
                      loss=lambda weights, out: tf.reduce_sum(out * weights))
        x = np.concatenate([k for k, _ in batches])
        y = np.concatenate([w for _, w in batches])
        model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
        table = layer.table
        for key, row in want_rows.items():
            slot = int(table.slots(tf.constant([key], tf.int64), insert=False)[0])
            np.testing.assert_allclose(table.rows.numpy()[slot], row, rtol=0, atol=1e-6,
                                       err_msg=f"key {key}")
        # inference admits nothing
        before = layer.table_stats()
        model.predict(np.array([[555, 556, 557]]), verbose=0)
        self.assertEqual(layer.table_stats()["size"], before["size"])

    def test_inputs_of_every_shape(self):
        layer = DynamicEmbedding(2, capacity=50, initializer=1.0)
        self.assertEqual(layer(tf.constant([[1, 2, 3]], tf.int64)).shape, (1, 3, 2))
        ragged = layer(tf.ragged.constant([[1, 2], [3]], tf.int64))
        self.assertEqual(ragged.bounding_shape().numpy().tolist(), [2, 2, 2])
        bags = DynamicEmbedding(2, capacity=50, combiner="mean", initializer=1.0)
        self.assertAllEqual(bags(tf.ragged.constant([[1, 2], [], [3]], tf.int64)),
                            [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
        sparse = tf.sparse.from_dense(tf.constant([[4, 0], [5, 6]], tf.int64))
        self.assertAllEqual(DynamicEmbedding(2, capacity=50, combiner="sum",
                                             initializer=1.0)(sparse), [[1.0, 1.0], [2.0, 2.0]])
        self.assertEqual(bags(tf.constant([7, 8], tf.int64)).shape, (2, 2))
        strings = DynamicEmbedding(2, capacity=50, key_dtype=tf.string, initializer=1.0)
        out = strings(tf.constant(["a", "b", "a"]))
        self.assertAllEqual(out, [[1.0, 1.0]] * 3)
        self.assertEqual(strings.table_stats()["size"], 2)

    def test_a_key_without_a_slot_reads_the_default_row(self):
        # a full table without eviction refuses key 3: it reads the default row, which
        # trains nothing; the mean divides by the whole bag
        layer = DynamicEmbedding(2, capacity=2, combiner="mean", evict=None,
                                 initializer=1.0, default_row=[0.5, -4.0])
        keys = tf.constant([[1, 2, 3]], tf.int64)
        with tf.GradientTape() as tape:
            out = layer(keys, training=True)
        self.assertAllClose(out, [[(1 + 1 + 0.5) / 3, (1 + 1 - 4) / 3]])
        grad = tape.gradient(out, layer.trainable_variables)[0]
        self.assertAllEqual(sorted(tf.convert_to_tensor(grad.indices).numpy()), [0, 1])
        self.assertEqual(layer.table_stats()["refusals"], 1)
        self.assertEqual(DynamicEmbedding.from_config(layer.get_config()).default_row,
                         (0.5, -4.0))
        with self.assertRaisesRegex(ValueError, r"default_row=\[1, 2, 3\] must be None, "
                                                r"a number or 2 finite numbers"):
            DynamicEmbedding(2, capacity=2, default_row=[1, 2, 3])

    def test_sgd_without_momentum_trains_it(self):
        # (tf-keras 2.15's SGD makes a momentum slot even without momentum)
        layer = self._layer("sum")
        keys = tf.keras.Input(shape=[3], dtype=tf.int64)
        model = tf.keras.Model(keys, layer(keys))
        model.compile(optimizer=tf.keras.optimizers.SGD(0.5),
                      loss=lambda weights, out: tf.reduce_sum(out * weights))
        x = np.array([[1, 2, 3]])
        model.fit(x, np.ones([1, self.DIM], np.float32), verbose=0)
        # each row admitted at its initial value, then moved by -0.5
        start = sum(initial_row(-0.5, 0.5, 11, k, self.DIM) for k in (1, 2, 3))
        np.testing.assert_allclose(model.predict(x, verbose=0), [start - 1.5], atol=1e-6)

    def test_other_optimizers_are_refused_by_name(self):
        keys = tf.keras.Input(shape=[2], dtype=tf.int64)
        model = tf.keras.Model(keys, DynamicEmbedding(2, capacity=10, combiner="sum")(keys))
        model.compile(optimizer=tf.keras.optimizers.Adam(), loss="mse")
        with self.assertRaisesRegex(ValueError, r"Adam cannot train dynamic table"):
            model.fit(np.array([[1, 2]]), np.zeros([1, 2]), verbose=0)

    def test_config_round_trips_and_bad_options_are_named(self):
        layer = DynamicEmbedding(3, capacity=7, combiner="mean", key_dtype=tf.string,
                                 initializer="normal", seed=4, admit_after=2, evict="lru",
                                 ttl_steps=9)
        again = DynamicEmbedding.from_config(layer.get_config())
        self.assertEqual(again.get_config(), layer.get_config())
        for kwargs, message in ((dict(combiner="max"), "combiner='max' is unknown"),
                                (dict(key_dtype=tf.int32), "key_dtype=.*unsupported"),
                                (dict(initializer="glorot_uniform"), "expected 'zeros'"),
                                (dict(ttl_steps=0), "ttl_steps must be None or an int"),
                                (dict(evict="random"), "evict='random' is unknown")):
            with self.assertRaisesRegex(ValueError, message):
                DynamicEmbedding(2, capacity=4, **kwargs)

    def test_a_checkpoint_continues_the_table(self):
        layer = self._layer("sum")
        layer(tf.constant([[1, 2, 3]], tf.int64))
        with tempfile.TemporaryDirectory() as directory:
            path = tf.train.Checkpoint(layer=layer).save(os.path.join(directory, "ckpt"))
            fresh = self._layer("sum")
            fresh(tf.constant([[9, 9, 9]], tf.int64))
            tf.train.Checkpoint(layer=fresh).restore(path).assert_existing_objects_matched()
        keys = tf.constant([[3, 2, 1]], tf.int64)
        self.assertAllEqual(fresh(keys, training=False), layer(keys, training=False))
        self.assertEqual(fresh.table_stats(), layer.table_stats())

    def test_a_one_process_mesh_equals_a_dict_of_rows(self):
        for combiner in ("sum", "mean"):
            with self.subTest(combiner=combiner):
                dc.check_mesh_against_dict(self, combiner, model_parallel=1)
        # the pure-TF path (the op's NumPy twin, TF's lookup and initial rows) too
        dc.check_mesh_against_dict(self, "sum", model_parallel=1, use_custom_kernel=False)
        dc.check_fit_against_dict(self, model_parallel=1)

    def test_examples_run(self):
        import inspect
        import textwrap
        from tfhybrid import callbacks
        from tfhybrid.dynamic import saved, table as table_lib
        for obj in (table_lib, DynamicTable, DynamicEmbedding, saved, saved.KeyedEntries,
                    callbacks.DynamicTableStats):
            doc = inspect.getdoc(obj)
            exec(textwrap.dedent(doc.split("Example::", 1)[1]), {})  # pylint: disable=exec-used


if __name__ == "__main__":
    tf.test.main()
