"""Dense ids whose hotness is known only at run time.

Keras traces ``fit``'s train function from the data adapter's specs; over a
``keras.utils.Sequence`` or a Python generator only the rank of each input is known
(``[None, None]``). Such ids must train exactly as the same ids with a static hotness,
and as one process on the global batch.
"""

import itertools
import os
import tempfile

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.compression import DCT
from tfhybrid.layers import DistributedEmbedding, Embedding
from tests import _de_case as de

HOROVOD_NP = (4,)

LOCAL_BATCH = 4
STEPS = 3
LEARNING_RATE = 0.3
# (name, rows, dim, combiner, hotness): with the thresholds below, on 2x2 and 1x4:
# row-wise, column-wise, table-wise (no combiner) and two replicated tables
TABLES = [("rows", 400, 8, "sum", 3), ("cols", 120, 16, "mean", 2),
          ("plain", 60, 4, None, 2), ("tiny", 10, 4, "sum", 2), ("tiny_seq", 12, 3, None, 3)]
THRESHOLDS = dict(data_parallel_threshold=100, column_slice_threshold=1000,
                  row_slice_threshold=3000)
NUMERICAL = 2


def _global_data(world: int, seed: int = 3):
    """Every rank's batches of every step: numerical, ids per feature, labels."""
    rng = np.random.default_rng(seed)
    n = LOCAL_BATCH * world * STEPS
    numerical = rng.normal(0, 1, [n, NUMERICAL]).astype(np.float32)
    ids = [rng.integers(0, rows, [n, hot]) for _, rows, _, _, hot in TABLES]
    labels = rng.integers(0, 2, [n, 1]).astype(np.float32)
    return numerical, ids, labels


def _rank_batches(mesh, numerical, ids, labels):
    """This rank's share of each global batch, in step order: rank r takes rows
    r, r + N, ... of the data, so global batch s is rows [s*N*b, (s+1)*N*b)."""
    pick = lambda x: x[mesh.rank::mesh.size]  # noqa: E731
    return pick(numerical), [pick(x) for x in ids], pick(labels)


class _Batches(tf.keras.utils.Sequence):
    """A distributed-embeddings script's input: ((numerical, [ids per feature]), labels)."""

    def __init__(self, numerical, ids, labels):
        super().__init__()
        self.numerical, self.ids, self.labels = numerical, ids, labels

    def __len__(self):
        return len(self.labels) // LOCAL_BATCH

    def __getitem__(self, i):
        part = slice(i * LOCAL_BATCH, (i + 1) * LOCAL_BATCH)
        return (self.numerical[part], [x[part] for x in self.ids]), self.labels[part]


def _generator(numerical, ids, labels):
    batches = _Batches(numerical, ids, labels)
    # fit reads one epoch of it: steps_per_epoch says where the epoch ends
    for i in range(len(batches)):
        yield batches[i]


class _Model(tf.keras.Model):
    """A subclassed model as distributed-embeddings' examples write them; it records
    the id shapes its call was traced with."""

    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding
        self.head = tf.keras.layers.Dense(1, name="head")
        self.traced_shapes = []

    def call(self, inputs):
        numerical, ids = inputs
        self.traced_shapes.append([tuple(x.shape) for x in ids])
        embedded = self.embedding(list(ids))
        # the script knows its features' widths (the traced shapes do not)
        flat = [tf.reshape(e, [-1, dim * (hot if combiner is None else 1)])
                for e, (_, _, dim, combiner, hot) in zip(embedded, TABLES)]
        return self.head(tf.concat(flat + [numerical], axis=1))


def _head_width():
    return sum(dim * (hot if combiner is None else 1)
               for _, _, dim, combiner, hot in TABLES) + NUMERICAL


def _start(seed: int = 1):
    rng = np.random.default_rng(seed)
    tables = [rng.normal(0, 0.3, [rows, dim]).astype(np.float32)
              for _, rows, dim, _, _ in TABLES]
    kernel = rng.normal(0, 0.3, [_head_width(), 1]).astype(np.float32)
    return tables, kernel


def _layers():
    return [Embedding(rows, dim, combiner=combiner, name=name) if combiner
            else tf.keras.layers.Embedding(rows, dim, name=name)
            for name, rows, dim, combiner, _ in TABLES]


def _reference(numerical, ids, labels, world):
    """One process, plain layers, the global batch of N * b samples per step."""
    tables, kernel = _start()
    layers = _layers()
    head = tf.keras.layers.Dense(1)
    for layer, table, x in zip(layers, tables, ids):
        layer(tf.constant(x[:1]))
        layer.set_weights([table])
    head.build([None, _head_width()])
    head.set_weights([kernel, np.zeros([1], np.float32)])
    variables = [layer.trainable_variables[0] for layer in layers] + head.trainable_variables
    loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)
    optimizer = tf.keras.optimizers.SGD(LEARNING_RATE)
    batch = LOCAL_BATCH * world
    for step in range(STEPS):
        part = slice(step * batch, (step + 1) * batch)
        with tf.GradientTape() as tape:
            embedded = [layer(tf.constant(x[part])) for layer, x in zip(layers, ids)]
            flat = [tf.reshape(e, [batch, -1]) for e in embedded]
            logits = head(tf.concat(flat + [numerical[part]], axis=1))
            loss = loss_fn(labels[part], logits)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return [v.numpy() for v in variables]


class FitOverSequenceTest(tf.test.TestCase):
    """``fit`` over a Sequence and a generator of dense multi-hot ids: the traced
    hotness is unknown, and training equals static shapes and one process."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _fit(self, mesh, feed: str, data) -> tuple[list, list]:
        numerical, ids, labels = _rank_batches(mesh, *data)
        tables, kernel = _start()
        model = _Model(DistributedEmbedding(_layers(), mesh=mesh, **THRESHOLDS))
        first = (tf.constant(numerical[:LOCAL_BATCH]),
                 [tf.constant(x[:LOCAL_BATCH]) for x in ids])
        if feed == "static":
            model(first)
        else:
            # built as fit builds it from a Sequence: the hotness is unknown, and the
            # planner counts one id per sample
            tf.function(model.__call__, input_signature=[(
                tf.TensorSpec([None, NUMERICAL], tf.float32),
                [tf.TensorSpec([None, None], tf.int64) for _ in ids])])(first)
        model.embedding.set_weights(tables)
        model.head.set_weights([kernel, np.zeros([1], np.float32)])
        model.traced_shapes.clear()
        model.compile(optimizer=tfhybrid.DistributedOptimizer(
            tf.keras.optimizers.SGD(LEARNING_RATE)),
            loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
        if feed == "sequence":
            model.fit(_Batches(numerical, ids, labels), epochs=1, shuffle=False, verbose=0)
        elif feed == "generator":
            model.fit(_generator(numerical, ids, labels), steps_per_epoch=STEPS, epochs=1,
                      verbose=0)
        else:
            model.fit((numerical, ids), labels, batch_size=LOCAL_BATCH, epochs=1,
                      shuffle=False, verbose=0)
        weights = (model.embedding.get_weights(all_ranks=True)
                   + [model.head.get_weights()[0]])
        return weights, model.traced_shapes

    def test_sequence_and_generator_equal_static_shapes_and_one_process(self):
        world = tfhybrid.init(model_parallel=1).size
        mesh_lib.reset()
        data = _global_data(world)
        want = _reference(*data, world)
        want = want[:len(TABLES)] + [want[len(TABLES)]]   # the tables and the kernel
        # 2 x 2 holds the whole comparison; 1 x 4 (another route) a generator, which
        # traces the unknown hotness as a Sequence does, against one process
        for model_parallel in (2, 4):
            mesh = tfhybrid.init(model_parallel=model_parallel)
            static = None   # 1 x 4: against one process only
            if model_parallel == 2:
                static, static_shapes = self._fit(mesh, "static", data)
                self.assertTrue(all(shape[1] is not None
                                    for shapes in static_shapes for shape in shapes))
                for got, expected in zip(static, want):
                    self.assertAllClose(got, expected, atol=1e-5, rtol=1e-5)
            for feed in ("sequence", "generator") if model_parallel == 2 else ("generator",):
                with self.subTest(model_parallel=model_parallel, feed=feed):
                    weights, shapes = self._fit(mesh, feed, data)
                    # the point of the test: fit traced ids of unknown hotness
                    self.assertTrue(shapes)
                    self.assertTrue(all(shape == (None, None)
                                        for traced in shapes for shape in traced), shapes)
                    for got, expected in zip(weights, static or []):
                        self.assertAllClose(got, expected, atol=1e-6, rtol=1e-6)
                    for got, expected in zip(weights, want):
                        self.assertAllClose(got, expected, atol=1e-5, rtol=1e-5)
            mesh_lib.reset()


class LayerStepTest(tf.test.TestCase):
    """One traced SGD step of the layer alone (``_de_case``), its ids of unknown
    hotness, against plain Keras layers on the global batch."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_both_input_modes_and_every_kind(self):
        sizes = [[400, 8], [120, 16], [60, 4], [10, 4]]
        # pairwise: every pair of values of any two of the three factors (mesh,
        # combiner, input mode) meets in some run, in 6 runs instead of the product's 10
        runs = [(2, "sum", True), (4, "sum", False), (4, "mean", True), (2, "mean", False),
                (2, None, True), (4, None, True)]
        # (model-parallel input without a combiner takes one id per sample: the next test)
        for model_parallel, combiner, dp_input in runs:
            with self.subTest(model_parallel=model_parallel, combiner=combiner,
                              dp_input=dp_input):
                tfhybrid.init(model_parallel=model_parallel)
                de.run_step(self, sizes, combiner=combiner, hotness=3,
                            unknown_hotness=True, dp_input=dp_input, **THRESHOLDS)
                mesh_lib.reset()

    def test_model_parallel_input_without_combiner_takes_one_id_per_sample(self):
        tfhybrid.init(model_parallel=2)
        sizes = [[400, 8], [60, 4]]
        de.run_step(self, sizes, combiner=None, hotness=1, unknown_hotness=True,
                    dp_input=False, **THRESHOLDS)
        mesh_lib.reset()
        tfhybrid.init(model_parallel=2)
        # a hotness of 2 at run time stops every rank with the reason, not a hang
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"not a supported input.*hotness other than 1 at run "
                                    r"time"):
            de.run_step(self, sizes, combiner=None, hotness=2, unknown_hotness=True,
                        dp_input=False, **THRESHOLDS)

    def test_hotness_that_differs_across_ranks_stops_every_rank(self):
        mesh = tfhybrid.init(model_parallel=2)
        layer = DistributedEmbedding([tf.keras.layers.Embedding(60, 4, name="plain")],
                                     mesh=mesh, **THRESHOLDS)
        forward = tf.function(layer, input_signature=[
            [tf.TensorSpec([None, None], tf.int64)]])
        hotness = 2 + mesh.rank % 2
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"hotness of a table without a combiner differs across "
                                    r"ranks"):
            forward([tf.zeros([LOCAL_BATCH, hotness], tf.int64)])


def _traced_steps(layer, ids_per_step, unknown: bool, optimizer) -> tuple[list, list]:
    """SGD steps of ``sum of squares`` over the layer's outputs; returns each step's
    outputs and the tables after the last."""
    spec_shape = (lambda x: [None, None]) if unknown else (lambda x: [None, x.shape[1]])
    signature = [[tf.TensorSpec(spec_shape(x), tf.int64) for x in ids_per_step[0]]]

    @tf.function(input_signature=signature)
    def step(ids):
        with tf.GradientTape() as tape:
            outputs = layer(ids)
            loss = tf.add_n([tf.reduce_sum(tf.square(o)) for o in outputs])
        grads = tfhybrid.DistributedGradientTape(tape).gradient(loss,
                                                                layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return outputs

    outputs = [[o.numpy() for o in step([tf.constant(x) for x in ids])]
               for ids in ids_per_step]
    return outputs, layer.get_weights(all_ranks=True)


class StorageKindsTest(tf.test.TestCase):
    """DCT-MP, tiered and FIITED tables: ids of unknown hotness train bit for bit as the
    same ids with a static hotness."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _compare(self, make_layer, optimizer=lambda: tf.keras.optimizers.SGD(0.2),
                 hotness=(3, 2), rows=(400, 120)):
        mesh = tfhybrid.init(model_parallel=2)
        rng = np.random.default_rng(17 + mesh.rank)
        ids_per_step = [[rng.integers(0, r, [LOCAL_BATCH, h]) for r, h in zip(rows, hotness)]
                        for _ in range(STEPS)]
        results = []
        for unknown in (False, True):
            layer = make_layer(mesh)
            layer([tf.constant(x) for x in ids_per_step[0]])
            start = np.random.default_rng(5)
            layer.set_weights([start.normal(0, 0.3, w.shape).astype(np.float32)
                               for w in layer.get_weights(all_ranks=True)])
            results.append(_traced_steps(layer, ids_per_step, unknown,
                                         tfhybrid.DistributedOptimizer(optimizer())))
        (static_out, static_tables), (dynamic_out, dynamic_tables) = results
        for got, want in zip(dynamic_out, static_out):
            for g, w in zip(got, want):
                self.assertAllEqual(g, w)
        for got, want in zip(dynamic_tables, static_tables):
            self.assertAllEqual(got, want)

    def test_dct_model_parallel_thresholding(self):
        # without a combiner each sample returns hotness * width entries: a width known
        # only at run time, whose top entries the owner still picks
        def make(mesh):
            return DistributedEmbedding(
                [tf.keras.layers.Embedding(400, 8, name="a"), Embedding(120, 16, "sum",
                                                                       name="b")],
                mesh=mesh, dct=DCT(dp_keep=None, mp_keep=0.3), **THRESHOLDS)
        self._compare(make)

    def test_tiered_tables(self):
        store, runs = tempfile.mkdtemp(), itertools.count()

        def make(mesh):
            path = os.path.join(store, f"run{next(runs)}")   # a folder per rank
            return DistributedEmbedding(
                [Embedding(400, 8, combiner="sum", cache_rows=300, store_dir=path,
                           name="a"),
                 Embedding(120, 16, combiner="mean", name="b")],
                mesh=mesh, **THRESHOLDS)
        self._compare(make)

    def test_fiited_tables(self):
        def make(mesh):
            return DistributedEmbedding(
                [Embedding(400, 8, combiner="sum", dims="adaptive", chunks=4, name="a"),
                 Embedding(120, 16, combiner="mean", dims="adaptive", chunks=4, name="b")],
                mesh=mesh, **THRESHOLDS)
        self._compare(make, optimizer=lambda: tfhybrid.optimizers.RowWiseAdagrad(0.1))


class EmbeddingLayerTest(tf.test.TestCase):
    """``tfhybrid.layers.Embedding`` alone: ids of unknown hotness give what a static
    hotness gives, for every combiner and storage."""

    def test_every_combiner_and_storage(self):
        rng = np.random.default_rng(9)
        ids = tf.constant(rng.integers(0, 50, [LOCAL_BATCH, 3]))
        cases = [dict(combiner=c) for c in ("sum", "mean", None)] + [
            dict(combiner="sum", dims="adaptive", chunks=4),
            dict(combiner="mean", cache_rows=40, store_dir=tempfile.mkdtemp())]
        for kwargs in cases:
            with self.subTest(**{k: v for k, v in kwargs.items() if k != "store_dir"}):
                layer = Embedding(50, 8, **kwargs)
                want = layer(ids)
                traced = tf.function(layer, input_signature=[
                    tf.TensorSpec([None, None], tf.int64)])
                got = traced(ids)
                self.assertEqual(got.shape, want.shape)
                self.assertAllEqual(got, want)


if __name__ == "__main__":
    tf.test.main()
