"""A DLRM on a 2 x 2 mesh equals one process, in Keras 2 and in Keras 3.

Row-wise AdaGrad trains the tables and Adam the dense layers, through ``model.fit`` and
through a custom loop with ``DistributedGradientTape``. The reference is the same DLRM with whole ``tf.keras`` tables in
this process, trained on the global batch: Keras' own Adam for its dense layers and a
NumPy row-wise AdaGrad, written here from the formula, for its tables.
"""

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.optimizers import RowWiseAdagrad
from tfhybrid.plan.types import Kind
from tfhybrid.train.models import DLRM

HOROVOD_NP = (4,)
KERAS = (2, 3)

ROWS = [400, 60, 9]       # sharded on a 2 x 2 mesh, sharded, replicated
DENSE, DIM = 5, 4
LOCAL_BATCH, STEPS = 8, 10
TABLE_LR, DENSE_LR, EPSILON = 0.05, 0.003, 1e-8
TOLERANCE = 1e-6


def _model(distributed):
    return DLRM(ROWS, DENSE, DIM, bottom_mlp_dims=[8, DIM], top_mlp_dims=[8, 1], seed=7,
                distributed=distributed,
                embedding_options=dict(data_parallel_threshold=40) if distributed else None)


def _global_batches():
    rng = np.random.default_rng(3)
    n = LOCAL_BATCH * 4 * STEPS
    dense = rng.random([n, DENSE]).astype(np.float32)
    categorical = np.stack([rng.integers(0, r, n) for r in ROWS], 1).astype(np.int64)
    labels = rng.integers(0, 2, [n, 1]).astype(np.float32)
    return dense, categorical, labels


def _rowwise_adagrad(table, accumulator, indices, values):
    """One exact row-wise AdaGrad step on NumPy arrays: duplicate rows summed first."""
    grad = np.zeros_like(table, dtype=np.float64)
    np.add.at(grad, indices, values.astype(np.float64))
    rows = np.unique(indices)
    accumulator[rows] += np.mean(grad[rows] ** 2, axis=1)
    table[rows] -= (TABLE_LR * grad[rows]
                    / (np.sqrt(accumulator[rows]) + EPSILON)[:, None]).astype(np.float32)


def _reference(batches):
    """(initial tables, logits before training, logits after, tables, dense weights) in
    one process."""
    dense, categorical, labels = batches
    model = _model(distributed=False)
    full = {"dense": tf.constant(dense), "categorical": tf.constant(categorical)}
    before = model(full).numpy()
    tables = [w.numpy().copy() for w in model.embedding.trainable_weights]
    initial_tables = [t.copy() for t in tables]
    accumulators = [np.zeros(t.shape[0]) for t in tables]
    table_ids = {id(w): t for t, w in enumerate(model.embedding.trainable_weights)}
    adam = tf.keras.optimizers.Adam(DENSE_LR)
    loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)
    step_size = LOCAL_BATCH * 4
    for step in range(STEPS):
        rows = slice(step * step_size, (step + 1) * step_size)
        x = {"dense": tf.constant(dense[rows]), "categorical": tf.constant(categorical[rows])}
        with tf.GradientTape() as tape:
            loss = loss_fn(labels[rows], model(x, training=True))
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        dense_pairs = []
        for grad, var in zip(grads, variables):
            t = table_ids.get(id(var))
            if t is None:
                dense_pairs.append((grad, var))
                continue
            grad = tf.convert_to_tensor(grad) if not isinstance(grad, tf.IndexedSlices) \
                else grad
            if isinstance(grad, tf.IndexedSlices):
                indices, values = grad.indices.numpy(), grad.values.numpy()
            else:
                indices, values = np.arange(tables[t].shape[0]), grad.numpy()
            _rowwise_adagrad(tables[t], accumulators[t], indices, values)
            var.assign(tables[t])
        adam.apply_gradients(dense_pairs)
    after = model(full).numpy()
    dense_weights = [w.numpy() for layer in (model.bottom_mlp, model.top_mlp)
                     for w in layer.weights]
    return initial_tables, before, after, tables, dense_weights


class KerasParityTest(tf.test.TestCase):
    """Under ``fit`` and a custom loop: logits and weights equal one process's."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.batches = _global_batches()
        cls.reference = _reference(cls.batches)

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _local(self, mesh):
        # rank r takes samples r, r + N, ... of each global batch
        dense, categorical, labels = self.batches
        pick = lambda a: a[mesh.rank::mesh.size]  # noqa: E731
        return {"dense": pick(dense), "categorical": pick(categorical)}, pick(labels)

    def _distributed(self):
        mesh = tfhybrid.init(model_parallel=2)
        model = _model(distributed=True)
        x, y = self._local(mesh)
        features = {k: tf.constant(v) for k, v in x.items()}
        model(features)
        # the dense layers start equal by their seeds; the tables from the reference's
        model.embedding.set_weights(self.reference[0])
        before = model(features).numpy()
        optimizer = tfhybrid.DistributedOptimizer(
            tf.keras.optimizers.Adam(DENSE_LR),
            embedding_optimizer=RowWiseAdagrad(TABLE_LR, epsilon=EPSILON))
        return mesh, model, x, y, before, optimizer

    def _check(self, mesh, model, x, before):
        _, want_before, want_after, want_tables, want_dense = self.reference
        pick = lambda a: a[mesh.rank::mesh.size]  # noqa: E731
        self.assertAllClose(before, pick(want_before), atol=TOLERANCE, rtol=0)
        after = model({k: tf.constant(v) for k, v in x.items()}).numpy()
        self.assertAllClose(after, pick(want_after), atol=TOLERANCE, rtol=0)
        # training moved the weights: equality is not the starting point's
        self.assertGreater(np.max(np.abs(pick(want_after) - pick(want_before))), 1e-3)
        for got, want in zip(model.embedding.get_weights(all_ranks=True), want_tables):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)
        got_dense = [w.numpy() for layer in (model.bottom_mlp, model.top_mlp)
                     for w in layer.weights]
        self.assertEqual(len(got_dense), len(want_dense))
        for got, want in zip(got_dense, want_dense):
            self.assertAllClose(got, want, atol=TOLERANCE, rtol=0)

    def test_fit_equals_one_process(self):
        mesh, model, x, y, before, optimizer = self._distributed()
        kinds = {placement.kind for placement in model.embedding.plan.tables}
        self.assertIn(Kind.DATA_PARALLEL, kinds)
        self.assertGreater(len(kinds - {Kind.DATA_PARALLEL}), 0, kinds)
        model.compile(optimizer=optimizer,
                      loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=tfhybrid.callbacks.defaults())
        self._check(mesh, model, x, before)

    def test_custom_loop_equals_one_process(self):
        mesh, model, x, y, before, optimizer = self._distributed()
        loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)

        @tf.function
        def step(features, labels):
            # the tape, given the optimizer, syncs; the optimizer's apply then does not
            with tfhybrid.DistributedGradientTape(tf.GradientTape(),
                                                  optimizer=optimizer) as tape:
                loss = loss_fn(labels, model(features, training=True))
            variables = model.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

        for i in range(STEPS):
            rows = slice(i * LOCAL_BATCH, (i + 1) * LOCAL_BATCH)
            step({k: tf.constant(v[rows]) for k, v in x.items()}, tf.constant(y[rows]))
        self._check(mesh, model, x, before)


if __name__ == "__main__":
    tf.test.main()
