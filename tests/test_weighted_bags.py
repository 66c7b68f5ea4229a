"""Per-id weights and ``sqrtn`` through DistributedEmbedding, against a NumPy reference of
``tf.nn.safe_embedding_lookup_sparse``'s rule (a sum keeps every id; mean and sqrtn drop
ids of weight <= 0 and divide by sum(w) and sqrt(sum(w ** 2))): outputs after every
step and rows after 10 steps within 1e-6, with row-wise AdaGrad and with SGD, for dense,
ragged and sparse ids, with the C++ kernels and the pure-TF path, on 1x1, 1x4 and 2x2
(both layouts), with dp_input True and False, and through every storage kind that
combines (FIITED, a disk tier, a tier of FIITED chunks, a dynamic table; a user's own
layer class has no combiner, so takes no weights); DCT-MP
carries weights of 1 exactly as no weights. The reference is checked against
``tf.nn.safe_embedding_lookup_sparse`` itself. Bad weights are named.
"""

import re
import tempfile

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.compression import DCT
from tfhybrid.layers import DistributedEmbedding, DynamicEmbedding, Embedding
from tfhybrid.optimizers import RowWiseAdagrad

HOROVOD_NP = (1, 4)
KERAS = (2, 3)

LR, EPS, STEPS, LOCAL_BATCH = 0.05, 1e-8, 10, 3
# (name, rows, dim, form): with the thresholds below "rows" is row-sliced over every
# position, "wide" column-sliced, "bag" table-wise and "tiny" replicated
TABLES = (("rows", 96, 4, "dense"), ("wide", 64, 4, "ragged"), ("bag", 40, 2, "sparse"),
          ("tiny", 10, 2, "dense"))
PLANNER = dict(data_parallel_threshold=30, row_slice_threshold=270,
               column_slice_threshold=200)


def _bags(rng, rows, form, n):
    """n bags of ids (lists) and their weights: fixed hotness 3 for dense tables, 0-4 ids
    (empty bags included) otherwise; weights in [-0.5, 2], some exactly 0."""
    sizes = [3] * n if form == "dense" else rng.integers(0, 5, n).tolist()
    ids = [rng.integers(0, rows, s).tolist() for s in sizes]
    weights = [np.round(rng.uniform(-0.5, 2.0, s), 1).astype(np.float32).tolist()
               for s in sizes]
    return ids, weights


def _as_input(form, ids, weights):
    if form == "dense":
        return tf.constant(ids, tf.int64), tf.constant(weights, tf.float32)
    ragged = (tf.ragged.constant(ids, tf.int64, ragged_rank=1, inner_shape=()),
              tf.ragged.constant(weights, tf.float32, ragged_rank=1, inner_shape=()))
    if form == "ragged":
        return ragged
    return ragged[0].to_sparse(), ragged[1].to_sparse()


def _reference(tables, combiners, batches, coefficients, optimizer, column_slices):
    """Per step, each feature's outputs on the global batch, and the final tables: float64
    NumPy, bag by bag, with the loss mean over the global batch of sum(out * coeff).
    Row-wise AdaGrad keeps one accumulator per row of each of a table's
    ``column_slices`` (a column-sliced table's shards are tables of their own)."""
    tables = [t.astype(np.float64).copy() for t in tables]
    accumulators = [np.zeros([len(t), len(cuts)]) for t, cuts in zip(tables, column_slices)]
    outputs = []
    for step, features in enumerate(batches):
        step_out, grads = [], []
        for f, (ids, weights) in enumerate(features):
            table, combiner = tables[f], combiners[f]
            out = np.zeros([len(ids), table.shape[1]])
            grad = np.zeros_like(table)
            for b, (bag_ids, bag_weights) in enumerate(zip(ids, weights)):
                kept = [(i, w) for i, w in zip(bag_ids, bag_weights)
                        if combiner == "sum" or w > 0]
                if combiner == "sum":
                    denominator = 1.0
                elif combiner == "mean":
                    denominator = sum(w for _, w in kept)
                else:
                    denominator = np.sqrt(sum(w * w for _, w in kept))
                if not kept or denominator == 0:
                    continue
                for i, w in kept:
                    out[b] += w * table[i] / denominator
                    grad[i] += w / denominator * coefficients[step][f][b] / len(ids)
            step_out.append(out)
            grads.append(grad)
        outputs.append(step_out)
        for f, grad in enumerate(grads):
            touched = sorted({i for bag in features[f][0] for i in bag})
            for i in touched:
                if optimizer == "sgd":
                    tables[f][i] -= LR * grad[i]
                    continue
                for c, (first, last) in enumerate(column_slices[f]):
                    g = grad[i, first:last]
                    accumulators[f][i, c] += np.mean(g ** 2)
                    tables[f][i, first:last] -= LR * g / (np.sqrt(accumulators[f][i, c]) + EPS)
    return outputs, tables


class _Case:
    """The global batches, loss coefficients and starting tables of one run."""

    def __init__(self, world, combiners, seed=0):
        rng = np.random.default_rng(seed)
        n = world * LOCAL_BATCH
        self.combiners = combiners
        self.tables = [rng.normal(0, 0.3, [rows, dim]).astype(np.float32)
                       for _, rows, dim, _ in TABLES]
        self.batches = [[_bags(rng, rows, form, n) for _, rows, _, form in TABLES]
                        for _ in range(STEPS)]
        self.coefficients = [[rng.normal(size=[n, dim]).astype(np.float32)
                              for _, _, dim, _ in TABLES] for _ in range(STEPS)]

    def local(self, step, samples):
        """Each feature's (ids, weights) input for the global batch's ``samples``."""
        return [_as_input(form, [ids[s] for s in samples], [w[s] for s in samples])
                for (_, _, _, form), (ids, w) in zip(TABLES, self.batches[step])]

    def reference(self, optimizer, plan=None):
        """The reference's outputs and tables; ``plan``: the layer's, whose column
        slices keep row-wise accumulators of their own."""
        slices = [[(0, dim)] for _, _, dim, _ in TABLES]
        if plan is not None:
            for t, placement in enumerate(plan.tables):
                if placement.kind == "column_wise":
                    slices[t] = [(s.col_start, s.col_end) for s in placement.shards]
        return _reference(self.tables, self.combiners, self.batches, self.coefficients,
                          optimizer, slices)


def _layers(case, kind="kernel", store_dir=None):
    """The case's tables as layers of one storage kind (kernel, fiited, tier or
    tiered_fiited; a tier on two of them)."""
    layers = []
    for (name, rows, dim, _), combiner in zip(TABLES, case.combiners):
        options = {}
        if kind in ("fiited", "tiered_fiited"):
            options = dict(dims="adaptive", chunks=dim)
        if kind in ("tier", "tiered_fiited") and name in ("rows", "bag"):
            # big enough for two batches' distinct ids, small enough to evict
            options.update(cache_rows=rows * 9 // 10, store_dir=store_dir)
        layers.append(Embedding(rows, dim, combiner=combiner, name=name, **options))
    return layers


def _train(test, mesh, case, optimizer="adagrad", kind="kernel", dp_input=True,
           use_custom_kernel=True, store_dir=None, dct=None, unweighted=False,
           steps=STEPS):
    # DCT-MP drops entries: its runs are compared with each other, not the reference
    """Trains a DistributedEmbedding of the case's tables on this mesh in a custom loop;
    checks its outputs after every step against the reference. Returns its tables, its
    outputs and the reference's tables. ``unweighted``: the inputs' ids alone (for
    weights of 1)."""
    layer = DistributedEmbedding(_layers(case, kind, store_dir), mesh=mesh,
                                 dp_input=dp_input, use_custom_kernel=use_custom_kernel,
                                 dct=dct, **PLANNER)
    mine = list(range(mesh.rank * LOCAL_BATCH, (mesh.rank + 1) * LOCAL_BATCH))
    layer(_inputs(layer, mesh, case, 0, mine, dp_input, unweighted))
    want, want_tables = case.reference(optimizer, layer.plan)
    layer.set_weights(case.tables)
    opt = (RowWiseAdagrad(learning_rate=LR, epsilon=EPS) if optimizer == "adagrad"
           else tf.keras.optimizers.SGD(learning_rate=LR))
    outputs = []
    for step in range(steps):
        inputs = _inputs(layer, mesh, case, step, mine, dp_input, unweighted)
        with tf.GradientTape() as tape:
            out = layer(inputs, training=True)
            loss = tf.add_n([tf.reduce_sum(o * case.coefficients[step][f][mine])
                             for f, o in enumerate(out)]) / LOCAL_BATCH
        grads = tfhybrid.DistributedGradientTape(tape).gradient(
            loss, layer.trainable_variables)
        opt.apply_gradients(zip(grads, layer.trainable_variables))
        outputs.append([o.numpy() for o in out])
        if dct is None:
            for f, o in enumerate(out):
                np.testing.assert_allclose(
                    o.numpy(), want[step][f][mine], rtol=0, atol=1e-6,
                    err_msg=f"step {step} feature {f} ({case.combiners[f]}) on {mesh}")
    return layer.get_weights(all_ranks=True), outputs, want_tables


def _inputs(layer, mesh, case, step, mine, dp_input, unweighted):
    if dp_input:
        pairs = case.local(step, mine)
    else:
        # the model group's samples, in position order, of the features this rank feeds
        group = [s for r in mesh.model_group_ranks
                 for s in range(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)]
        every = case.local(step, group)
        pairs = [every[f] for f in layer.strategy.input_ids_list[mesh.rank]]
    return [ids for ids, _ in pairs] if unweighted else pairs


def _check_tables(test, got, want, what):
    test.assertLen(got, len(TABLES))
    for (name, *_), g, w in zip(TABLES, got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=f"{what}: table {name}")


class WeightedBagsTest(tf.test.TestCase):

    def _mesh(self, model_parallel, layout="model_major"):
        mesh_lib.reset()
        return tfhybrid.init(model_parallel=model_parallel, layout=layout)

    def _meshes(self):
        mesh = self._mesh(1)
        if mesh.size == 1:
            return [(1, "model_major")]
        return [(4, "model_major"), (2, "model_major"), (2, "data_major")]

    def test_the_reference_is_tensorflows_safe_embedding_lookup_sparse(self):
        case = _Case(2, ("sum", "mean", "sqrtn", "sqrtn"))
        want, _ = case.reference("sgd")
        for f, (ids, weights) in enumerate(case.batches[0]):
            sparse_ids = tf.ragged.constant(ids, tf.int64, ragged_rank=1,
                                            inner_shape=()).to_sparse()
            sparse_weights = tf.ragged.constant(weights, tf.float32, ragged_rank=1,
                                                inner_shape=()).to_sparse()
            got = tf.nn.safe_embedding_lookup_sparse(
                case.tables[f], sparse_ids, sparse_weights, combiner=case.combiners[f])
            self.assertAllClose(got, want[0][f], rtol=0, atol=1e-6)

    def test_every_mesh_equals_the_reference_with_adagrad(self):
        # every combiner on every sharding kind: each table takes each combiner once
        # over the three runs
        # over the meshes (and on 1x1 in turn) each table takes each combiner once
        rotations = [("sqrtn", "mean", "sum", "mean"), ("mean", "sqrtn", "sqrtn", "sum"),
                     ("sum", "sum", "mean", "sqrtn")]
        meshes = self._meshes()
        runs = (list(zip(meshes, rotations)) if len(meshes) == len(rotations)
                else [(meshes[0], r) for r in rotations])
        for (model_parallel, layout), combiners in runs:
            with self.subTest(model_parallel=model_parallel, layout=layout,
                              combiners=combiners):
                mesh = self._mesh(model_parallel, layout)
                case = _Case(mesh.size, combiners)
                got, _, want = _train(self, mesh, case)
                _check_tables(self, got, want, f"{combiners} on {mesh}")

    def test_sgd_and_the_pure_tf_path(self):
        for model_parallel, layout in self._meshes()[-1:]:
            mesh = self._mesh(model_parallel, layout)
            case = _Case(mesh.size, ("sqrtn", "mean", "sum", "sqrtn"), seed=3)
            for optimizer, custom in (("sgd", True), ("adagrad", False)):
                with self.subTest(optimizer=optimizer, use_custom_kernel=custom):
                    got, _, want = _train(self, mesh, case, optimizer,
                                          use_custom_kernel=custom)
                    _check_tables(self, got, want, f"{optimizer} custom={custom} on {mesh}")

    def test_dp_input_false(self):
        for model_parallel, layout in self._meshes()[-1:]:
            with self.subTest(model_parallel=model_parallel, layout=layout):
                mesh = self._mesh(model_parallel, layout)
                case = _Case(mesh.size, ("sqrtn", "mean", "sqrtn", "mean"), seed=4)
                got, _, want = _train(self, mesh, case, dp_input=False)
                _check_tables(self, got, want, f"dp_input=False on {mesh}")

    def test_every_storage_kind(self):
        for model_parallel, layout in self._meshes()[-2:-1]:
            mesh = self._mesh(model_parallel, layout)
            case = _Case(mesh.size, ("mean", "sqrtn", "sum", "sqrtn"), seed=5)
            with self.subTest(kind="fiited"):
                got, _, want = _train(self, mesh, case, kind="fiited")
                _check_tables(self, got, want, f"FIITED on {mesh}")
            for kind in ("tier", "tiered_fiited"):
                with self.subTest(kind=kind), tempfile.TemporaryDirectory() as store:
                    got, _, want = _train(self, mesh, case, kind=kind, store_dir=store)
                    _check_tables(self, got, want, f"{kind} on {mesh}")

    def test_dct_carries_weights_of_one_as_no_weights(self):
        mesh = self._mesh(*self._meshes()[-1])
        # sums: DCT-MP thresholds the rows that cross, a weighted mean's already divided
        # and an unweighted mean's sum, so only a sum crosses alike with and without
        case = _Case(mesh.size, ("sum",) * len(TABLES), seed=6)
        for features in case.batches:
            for ids, weights in features:
                weights[:] = [[1.0] * len(bag) for bag in ids]
        dct = DCT(mp_keep=0.5)
        got, outputs, _ = _train(self, mesh, case, dct=dct, steps=4)
        plain, plain_outputs, _ = _train(self, mesh, case, dct=dct, unweighted=True,
                                         steps=4)
        for a, b in zip(got + sum(outputs, []), plain + sum(plain_outputs, [])):
            self.assertAllEqual(a, b)

    def test_dynamic_table_with_weights(self):
        mesh = self._mesh(*self._meshes()[-1])
        rng = np.random.default_rng(7)
        keys = np.array([-(1 << 62), -3, 0, 5, 1 << 40, 77], np.int64)
        n = mesh.size * LOCAL_BATCH
        mine = slice(mesh.rank * LOCAL_BATCH, (mesh.rank + 1) * LOCAL_BATCH)
        layer = DistributedEmbedding([DynamicEmbedding(4, capacity=32, combiner="sqrtn",
                                                       initializer=0.1, name="keys")],
                                     mesh=mesh)
        rows, accumulators = {}, {}
        opt = RowWiseAdagrad(learning_rate=LR, epsilon=EPS)
        for _ in range(STEPS):
            ids = keys[rng.integers(0, len(keys), [n, 3])]
            weights = np.round(rng.uniform(-0.5, 2.0, [n, 3]), 1).astype(np.float32)
            coefficients = rng.normal(size=[n, 4]).astype(np.float32)
            with tf.GradientTape() as tape:
                out = layer([(tf.constant(ids[mine]), tf.constant(weights[mine]))],
                            training=True)[0]
                loss = tf.reduce_sum(out * coefficients[mine]) / LOCAL_BATCH
            grads = tfhybrid.DistributedGradientTape(tape).gradient(
                loss, layer.trainable_variables)
            opt.apply_gradients(zip(grads, layer.trainable_variables))
            # the reference: every key seen gets a row of 0.1 (admit_after=1)
            want, grad = np.zeros([n, 4]), {}
            for b in range(n):
                kept = [(k, w) for k, w in zip(ids[b], weights[b]) if w > 0]
                norm = np.sqrt(sum(w * w for _, w in kept))
                for k, w in kept:
                    row = rows.setdefault(int(k), np.full(4, 0.1))
                    want[b] += w * row / norm
                    grad[int(k)] = grad.get(int(k), 0.0) + w / norm * coefficients[b] / n
            np.testing.assert_allclose(out.numpy(), want[mine], rtol=0, atol=1e-6)
            for k, g in grad.items():
                accumulators[k] = accumulators.get(k, 0.0) + np.mean(g * g)
                rows[k] = rows[k] - LR * g / (np.sqrt(accumulators[k]) + EPS)


class BadWeightsTest(tf.test.TestCase):

    def _layer(self):
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=1)
        layer = DistributedEmbedding([Embedding(10, 2, combiner="mean", name="clicks"),
                                      Embedding(10, 2, combiner="sum", name="views")],
                                     mesh=mesh)
        return mesh, layer

    def test_shape_and_dtype_are_named_at_trace_time(self):
        _, layer = self._layer()
        ids = tf.constant([[1, 2], [3, 4]])
        for weights, words in ((tf.ones([2, 3]), "feature 1 (table 'views')"),
                               (tf.ones([2, 2], tf.int32), "dtype int32"),
                               (tf.ragged.constant([[1.0, 1.0], [1.0]]), "ragged")):
            with self.subTest(weights=words):
                with self.assertRaisesRegex(ValueError, re.escape(words)):
                    layer([ids, ids], weights=[None, weights])
        with self.assertRaisesRegex(ValueError, "1 weights for 2 inputs"):
            layer([ids, ids], weights=[None])

    def test_a_nan_weight_fails_on_every_rank_naming_the_feature(self):
        mesh, layer = self._layer()
        ids = tf.constant([[1, 2], [3, 4]])
        bad = np.ones([2, 2], np.float32)
        if mesh.rank == mesh.size - 1:
            bad[1, 0] = np.nan
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"feature 0 \(table 'clicks'\).*NaN or infinite"):
            layer([(ids, tf.constant(bad)), ids])

    def test_an_id_a_mean_drops_is_still_checked(self):
        mesh, layer = self._layer()
        ids = np.array([[1, 2], [3, 4]], np.int64)
        weights = np.ones([2, 2], np.float32)
        if mesh.rank == mesh.size - 1:
            ids[0, 1], weights[0, 1] = 12, 0.0   # outside the table, and weight 0
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"table 'clicks' got id 12 .*expected ids in \[0, 10\)"):
            layer([(tf.constant(ids), tf.constant(weights)), tf.constant(ids)])
