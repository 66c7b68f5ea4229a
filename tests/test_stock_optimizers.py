"""A distributed-embeddings style custom loop with Keras' own optimizers equals one process.

distributed-embeddings' scripts (and the README's migration section) wrap the tape
without naming the optimizer, ``tfhybrid.DistributedGradientTape(tape)``, and apply with a
stock Keras optimizer. Keras 3's stock optimizers update each duplicate row of a sparse
gradient on its own (Adagrad adds g1**2 + g2**2, not (g1 + g2)**2), so the route must
hand out each row once, or the step depends on which rank sent which rows. Here
``Adagrad`` and ``Adam`` train row-sliced, column-sliced, table-wise and data-parallel
tables, two of them read by two features each, one fed ragged bags, on 2 x 2 (both
layouts) and 1 x 4 under Keras 3 (2 x 2 under Keras 2, see MESHES), and must equal the
same network in one process on the global batch whose table gradients are made dense
before the same optimizer applies them; the meshes must also equal one another. ``dp_input=False`` is checked on the layer alone.
"""

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.plan.types import Kind
from tests import _de_case as de

HOROVOD_NP = (4,)
KERAS = (2, 3)

# (name, rows, dim, combiner); with PLANNER on 2 x 2: "rows" row-sliced, "wide" in column
# slices, "bag" table-wise, "tiny" data-parallel. Rows far outnumber a step's ids, so the
# route syncs the gradients as rows (an allgather repeats rows across ranks)
TABLES = (("rows", 4000, 3, "sum"), ("wide", 1500, 4, "sum"), ("bag", 900, 2, "mean"),
          ("tiny", 300, 2, "sum"))
PLANNER = dict(data_parallel_threshold=1000, row_slice_threshold=10_000,
               column_slice_threshold=5000)
# feature -> (table, hotness); hotness -1: ragged bags, some empty. "rows" and "tiny" are
# each read by two features, so their gradients meet in the tape
FEATURES = ((0, 2), (1, 3), (2, -1), (3, 1), (0, 1), (3, 2))
# Keras 2's stock optimizers sum a sparse gradient's duplicate rows themselves, so under
# Keras 2 one mesh checks that the route hands out each row once; Keras 3's (which do
# not) run on every mesh
MESHES = (((2, "model_major"), (2, "data_major"), (4, "model_major"))
          if tfhybrid.keras_major() == 3 else ((2, "data_major"),))


def _meshes_for(optimizer: str) -> tuple:
    """AdaGrad on every mesh of ``MESHES``; Adam on the two layouts of 2 x 2, whose
    replicas group a row's duplicates differently (on 1 x 4 one rank holds them all)."""
    return MESHES if optimizer == "adagrad" else tuple(
        m for m in MESHES if m[0] == 2)


OPTIMIZERS = {"adagrad": lambda: tf.keras.optimizers.Adagrad(0.3),
              "adam": lambda: tf.keras.optimizers.Adam(0.01)}
WORLD, LOCAL_BATCH, STEPS, HIDDEN = 4, 4, 10, 4
TOLERANCE = 1e-6


def _data():
    """Ids per feature (numpy; ragged as (values, lengths)), labels and initial weights of
    the whole run, the same on every rank."""
    rng = np.random.default_rng(5)
    n = WORLD * LOCAL_BATCH * STEPS
    ids = []
    for table, hotness in FEATURES:
        rows = TABLES[table][1]
        if hotness < 0:
            lengths = rng.integers(0, 4, n)
            ids.append((rng.integers(0, rows, int(lengths.sum())), lengths))
        else:
            # a few hot rows, so every batch repeats rows within and across ranks
            ids.append(np.minimum(rng.zipf(1.3, [n, hotness]) - 1, rows - 1))
    labels = rng.integers(0, 2, [n, 1]).astype(np.float32)
    tables = [rng.normal(0, 0.3, [rows, dim]).astype(np.float32)
              for _, rows, dim, _ in TABLES]
    width = sum(TABLES[t][2] for t, _ in FEATURES)
    dense = [rng.normal(0, 0.5, [width, HIDDEN]).astype(np.float32),
             rng.normal(0, 0.1, [HIDDEN]).astype(np.float32),
             rng.normal(0, 0.5, [HIDDEN, 1]).astype(np.float32), np.zeros([1], np.float32)]
    return ids, labels, tables, dense


def _samples(ids, labels, rows):
    """Tensors of the samples ``rows`` of every feature, and their labels."""
    out = []
    for x in ids:
        if isinstance(x, tuple):
            values, lengths = x
            starts = np.concatenate([[0], np.cumsum(lengths)])
            out.append(tf.RaggedTensor.from_row_lengths(
                tf.constant(np.concatenate([values[starts[r]:starts[r + 1]] for r in rows]),
                            tf.int64), lengths[rows]))
        else:
            out.append(tf.constant(x[rows], tf.int64))
    return out, tf.constant(labels[rows])


class WholeTables(tf.keras.layers.Layer):
    """The reference's tables: whole, in this process, combined by hand from a gather."""

    def build(self, input_shape):
        self.tables = [self.add_weight(name=name, shape=[rows, dim], initializer="zeros")
                       for name, rows, dim, _ in TABLES]

    def call(self, ids):
        out = []
        for (table, _), x in zip(FEATURES, ids):
            rows = tf.gather(self.tables[table], x)
            summed = tf.reduce_sum(rows, axis=1)
            if TABLES[table][3] == "mean":
                count = tf.cast(x.row_lengths() if isinstance(x, tf.RaggedTensor)
                                else tf.shape(x)[1:2], tf.float32)
                summed = summed / tf.maximum(count, 1.0)[:, None]
            out.append(summed)
        return out


class Tower(tf.keras.Model):
    """Embeddings side by side, then a small dense tower."""

    def __init__(self, embed):
        super().__init__()
        self.embed = embed
        self.hidden = tf.keras.layers.Dense(HIDDEN, activation="relu")
        self.logit = tf.keras.layers.Dense(1)

    def call(self, ids):
        embedded = [tf.reshape(e, [-1, TABLES[t][2]])
                    for e, (t, _) in zip(self.embed(ids), FEATURES)]
        return self.logit(self.hidden(tf.concat(embedded, axis=1)))


def _loss(labels, logits):
    return tf.keras.losses.BinaryCrossentropy(from_logits=True)(labels, logits)


def _reference(data, make_optimizer):
    """(logits before, logits after, tables, dense weights) of one process on the global
    batch, each table gradient made dense before the optimizer applies it."""
    ids, labels, tables, dense = data
    model = Tower(WholeTables())
    everything, _ = _samples(ids, labels, np.arange(len(labels)))
    model(everything)
    for variable, value in zip(model.embed.tables, tables):
        variable.assign(value)
    model.hidden.set_weights(dense[:2])
    model.logit.set_weights(dense[2:])
    before = model(everything).numpy()
    optimizer = make_optimizer()
    size = WORLD * LOCAL_BATCH
    for step in range(STEPS):
        x, y = _samples(ids, labels, np.arange(step * size, (step + 1) * size))
        with tf.GradientTape() as tape:
            loss = _loss(y, model(x, training=True))
        variables = model.trainable_variables
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
        optimizer.apply_gradients(zip(grads, variables))
    return (before, model(everything).numpy(), [v.numpy() for v in model.embed.tables],
            model.hidden.get_weights() + model.logit.get_weights())


def _distributed(data, make_optimizer, mesh):
    """The same, on this rank of ``mesh``, through a DE-style loop; also every sparse
    gradient's indices the tape returned at the first step."""
    ids, labels, tables, dense = data
    layer = DistributedEmbedding(
        [Embedding(rows, dim, combiner=combiner, name=name)
         for name, rows, dim, combiner in TABLES],
        input_table_map=[t for t, _ in FEATURES], mesh=mesh, **PLANNER)
    model = Tower(layer)
    mine = np.arange(mesh.rank, len(labels), mesh.size)
    local, _ = _samples(ids, labels, mine)
    model(local)
    layer.set_weights(tables)
    model.hidden.set_weights(dense[:2])
    model.logit.set_weights(dense[2:])
    before = model(local).numpy()
    optimizer = make_optimizer()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(y, model(x, training=True))
        tape = tfhybrid.DistributedGradientTape(tape)   # no optimizer=, as DE writes it
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return [g.indices for g in grads if isinstance(g, tf.IndexedSlices)]

    size = mesh.size * LOCAL_BATCH
    sparse_indices = None
    for s in range(STEPS):
        x, y = _samples(ids, labels, np.arange(s * size + mesh.rank, (s + 1) * size,
                                               mesh.size))
        indices = step(x, y)
        sparse_indices = sparse_indices or [i.numpy() for i in indices]
    return (layer, before, model(local).numpy(), layer.get_weights(all_ranks=True),
            model.hidden.get_weights() + model.logit.get_weights(), sparse_indices, mine)


class StockOptimizerLoopTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.data = _data()

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_every_mesh_equals_one_process_and_each_other(self):
        for name, make in OPTIMIZERS.items():
            want_before, want_after, want_tables, want_dense = _reference(self.data, make)
            # training moved the weights: equality is not the starting point's
            self.assertGreater(np.max(np.abs(want_after - want_before)), 1e-3)
            by_mesh = {}
            for model_parallel, layout in _meshes_for(name):
                with self.subTest(optimizer=name, model_parallel=model_parallel,
                                  layout=layout):
                    mesh = tfhybrid.init(model_parallel=model_parallel, layout=layout)
                    self.assertEqual(mesh.size, WORLD)
                    try:
                        layer, before, after, tables, dense, indices, mine = _distributed(
                            self.data, make, mesh)
                    finally:
                        mesh_lib.reset()
                    if model_parallel == 2:
                        kinds = {p.kind for p in layer.plan.tables}
                        self.assertEqual(kinds, {Kind.ROW_WISE, Kind.COLUMN_WISE,
                                                 Kind.TABLE_WISE, Kind.DATA_PARALLEL})
                    self.assertAllClose(before, want_before[mine], atol=TOLERANCE, rtol=0)
                    self.assertAllClose(after, want_after[mine], atol=TOLERANCE, rtol=0)
                    for got, want in zip(tables + dense, want_tables + want_dense):
                        self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
                    # the data-parallel table's gradient at least, on every rank
                    self.assertNotEmpty(indices)
                    for i in indices:
                        self.assertEqual(len(np.unique(i)), len(i), i)
                    by_mesh[(model_parallel, layout)] = tables + dense
            self.assertLen(by_mesh, len(_meshes_for(name)))
            first, *others = by_mesh.values()
            for other in others:
                for a, b in zip(first, other):
                    self.assertAllClose(a, b, atol=TOLERANCE, rtol=0)

    def test_model_parallel_input_with_stock_adagrad(self):
        # dp_input=False: each rank feeds its position's features for its model group's
        # samples; one Adagrad step of the layer alone, a table read by three features
        for model_parallel, layout in MESHES:
            with self.subTest(model_parallel=model_parallel, layout=layout):
                tfhybrid.init(model_parallel=model_parallel, layout=layout)
                try:
                    de.run_step(self, [[40, 6], [9, 4], [25, 5], [60, 3]], combiner="sum",
                                hotness=3, dp_input=False,
                                input_table_map=[0, 1, 2, 3, 0, 0],
                                optimizer=tf.keras.optimizers.Adagrad,
                                data_parallel_threshold=40)
                finally:
                    mesh_lib.reset()


if __name__ == "__main__":
    tf.test.main()
