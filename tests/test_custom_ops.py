"""Tests for tfhybrid's custom embedding ops (EmbeddingLookupCombine and its gradient,
the table-batched ResourceEmbeddingLookupCombineConcat, RowwiseAdagradApply), against
the pure-TF path and numpy references.

Run: OMP_NUM_THREADS=1 python -m tests.test_custom_ops

The custom-op tests FAIL if the library cannot be loaded. With
TFHYBRID_DISABLE_CUSTOM_OPS=1 only the pure-TF tests run (op tests are skipped).
The kernels run at this process's dispatch level (TFHYBRID_KERNEL_ISA, default the best
the CPU has); tests/test_kernel_isa.py runs these tests once per level.
"""

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfhybrid import custom_ops as co  # noqa: E402

DISABLED = os.environ.get("TFHYBRID_DISABLE_CUSTOM_OPS", "").strip().lower() in ("1", "true", "yes")
if DISABLED:
    print("TFHYBRID_DISABLE_CUSTOM_OPS=1: custom-op tests are SKIPPED; only the pure-TF path "
          "is tested.", file=sys.stderr)

ATOL = 1e-6
RTOL = 1e-6


def _paths():
    """use_custom_op values under test: the op (unless disabled) and pure TF."""
    return [False] if DISABLED else [True, False]


def require_op(test):
    if DISABLED:
        test.skipTest("custom ops disabled by TFHYBRID_DISABLE_CUSTOM_OPS=1")
    if not co.custom_ops_available():
        test.fail(f"custom-op library failed to load: {co.load_error()}")


# ------------------------------------------------------------------ numpy references


def np_lookup(params, bags, combiner):
    """bags: list of lists of ids. combiner 'sum' | 'mean'."""
    d = params.shape[1]
    out = np.zeros((len(bags), d), np.float64)
    for b, bag in enumerate(bags):
        for i in bag:
            out[b] += params[i]
        if combiner == "mean" and bag:
            out[b] /= len(bag)
    return out


def np_lookup_grad(num_rows, bags, upstream, combiner):
    g = np.zeros((num_rows, upstream.shape[1]), np.float64)
    for b, bag in enumerate(bags):
        for i in bag:
            g[i] += upstream[b] / (len(bag) if combiner == "mean" else 1)
    return g


def np_rowwise_adagrad(w, v, indices, grad, lr, eps, c, wd):
    """FBGEMM exact row-wise Adagrad, float64; decay after the gradient step."""
    w = w.astype(np.float64).copy()
    v = v.astype(np.float64).copy()
    grad = grad.astype(np.float32).astype(np.float64)
    for i in np.unique(indices):
        g = grad[indices == i].sum(axis=0)
        v[i] += np.mean(g * g)
        w[i] -= lr * g / (np.sqrt(v[i] / c) + eps)
        if wd > 0:
            w[i] -= lr * wd * w[i]
    return w, v


def _dense(x):
    if isinstance(x, tf.IndexedSlices):
        return tf.convert_to_tensor(x).numpy()
    return x.numpy()


# ------------------------------------------------------------------ library


class LibraryTest(tf.test.TestCase):

    def test_library_loaded(self):
        require_op(self)
        self.assertTrue(co.custom_ops_available())

    def test_auto_path_uses_op_on_cpu(self):
        require_op(self)
        p = tf.Variable(tf.ones([4, 2]))

        @tf.function
        def f():
            return co.embedding_lookup_combine(p, tf.constant([[0, 1]]))

        ops = {op.type for op in f.get_concrete_function().graph.get_operations()}
        self.assertIn("ResourceEmbeddingLookupCombine", ops)

    def test_kernel_isa_is_the_requested_level(self):
        require_op(self)
        supported = co.supported_kernel_isas()
        self.assertEqual(supported[0], "generic")
        want = os.environ.get("TFHYBRID_KERNEL_ISA", "").strip().lower()
        # Unset (or auto): the best level of this CPU, else exactly the one requested.
        self.assertEqual(co.kernel_isa(), supported[-1] if want in ("", "auto") else want)


# ------------------------------------------------------------------ lookup


class EmbeddingLookupCombineTest(tf.test.TestCase):
    DIM = 16  # row width: one vector at the AVX-512 level, two at AVX2

    def setUp(self):
        super().setUp()
        self.rng = np.random.default_rng(1234)
        self.R, self.D = 50, self.DIM
        self.params_np = self.rng.uniform(-1, 1, (self.R, self.D)).astype(np.float32)

    def _check_forward(self, ids, bags, dense_shape=None):
        for use_op in _paths():
            for as_var in (False, True):
                params = tf.Variable(self.params_np) if as_var else tf.constant(self.params_np)
                for combiner in ("sum", "mean", None):
                    if combiner is None and isinstance(ids, tf.RaggedTensor):
                        got = co.embedding_lookup_combine(params, ids, None, use_custom_op=use_op)
                        self.assertIsInstance(got, tf.RaggedTensor)
                        want = self.params_np[np.concatenate([np.asarray(b, int) for b in bags])]
                        self.assertAllClose(got.flat_values.numpy(), want, atol=ATOL, rtol=RTOL)
                        continue
                    got = co.embedding_lookup_combine(params, ids, combiner, use_custom_op=use_op)
                    if combiner is None:
                        want = self.params_np[np.asarray(ids)]
                        self.assertEqual(tuple(got.shape), tuple(dense_shape) + (self.D,))
                    else:
                        want = np_lookup(self.params_np, bags, combiner)
                        self.assertEqual(tuple(got.shape), (len(bags), self.D))
                    self.assertAllClose(got.numpy(), want, atol=ATOL, rtol=RTOL,
                                        msg=f"use_op={use_op} var={as_var} combiner={combiner}")

    def test_dense_one_hot(self):
        for dtype in (tf.int32, tf.int64):
            ids_np = self.rng.integers(0, self.R, 12)
            ids = tf.constant(ids_np, dtype)
            self._check_forward(ids, [[i] for i in ids_np], dense_shape=(12,))

    def test_dense_multi_hot(self):
        for dtype in (tf.int32, tf.int64):
            ids_np = self.rng.integers(0, self.R, (9, 5))
            ids_np[0, :] = 3  # duplicates inside a bag
            ids = tf.constant(ids_np, dtype)
            self._check_forward(ids, [list(r) for r in ids_np], dense_shape=(9, 5))

    def test_ragged_with_empty_bags(self):
        bags = [[1, 2, 3], [], [7, 7], [0], [], [49, 48, 47, 46, 45, 44]]
        for dtype in (tf.int32, tf.int64):
            for splits_dtype in (tf.int32, tf.int64):
                ids = tf.RaggedTensor.from_row_lengths(
                    tf.constant(sum(bags, []), dtype),
                    tf.constant([len(b) for b in bags], splits_dtype))
                self._check_forward(ids, bags)

    def test_half_and_bfloat16_params(self):
        ids_np = self.rng.integers(0, self.R, (6, 4))
        bags = [list(r) for r in ids_np]
        for dtype in (tf.float16, tf.bfloat16):
            params = tf.cast(tf.constant(self.params_np), dtype)
            want = np_lookup(tf.cast(params, tf.float32).numpy(), bags, "mean")
            for use_op in _paths():
                got = co.embedding_lookup_combine(params, tf.constant(ids_np), "mean",
                                                  use_custom_op=use_op)
                self.assertEqual(got.dtype, dtype)
                self.assertAllClose(tf.cast(got, tf.float32).numpy(), want, atol=1e-2, rtol=1e-2)

    def _grads(self, ids, combiner, use_op, upstream):
        params = tf.Variable(self.params_np)
        with tf.GradientTape() as tape:
            out = co.embedding_lookup_combine(params, ids, combiner, use_custom_op=use_op)
            loss = tf.reduce_sum(out * upstream)
        return out, tape.gradient(loss, params)

    def test_gradients(self):
        cases = []
        ids_np = self.rng.integers(0, self.R, (8, 6))
        ids_np[:, 0] = 5  # a heavily duplicated id
        cases.append((tf.constant(ids_np, tf.int64), [list(r) for r in ids_np]))
        ids_1h = self.rng.integers(0, self.R, 10)
        cases.append((tf.constant(ids_1h, tf.int32), [[i] for i in ids_1h]))
        bags = [[4, 4, 9], [], [1], [2, 3, 4, 4, 4], []]
        cases.append((tf.ragged.constant(bags, tf.int32), bags))
        for ids, bags in cases:
            for combiner in ("sum", "mean", None):
                if combiner is None and isinstance(ids, tf.RaggedTensor):
                    continue
                shape = (len(bags), self.D) if combiner else tuple(ids.shape) + (self.D,)
                upstream = tf.constant(self.rng.uniform(-1, 1, shape).astype(np.float32))
                results = {}
                for use_op in _paths():
                    _, g = self._grads(ids, combiner, use_op, upstream)
                    self.assertIsInstance(g, tf.IndexedSlices)
                    results[use_op] = _dense(g)
                if combiner is None:
                    flat_ids = np.reshape(ids.numpy(), [-1])
                    want = np_lookup_grad(self.R, [[i] for i in flat_ids],
                                          upstream.numpy().reshape(-1, self.D), "sum")
                else:
                    want = np_lookup_grad(self.R, bags, upstream.numpy(), combiner)
                for use_op, got in results.items():
                    self.assertAllClose(got, want, atol=ATOL, rtol=RTOL,
                                        msg=f"use_op={use_op} combiner={combiner}")
                if len(results) == 2:
                    self.assertAllClose(results[True], results[False], atol=ATOL, rtol=RTOL)

    def test_gradient_on_variable_is_unique_sorted_indexed_slices(self):
        require_op(self)
        ids = tf.constant([[7, 3, 7], [3, 3, 1], [9, 0, 7]], tf.int64)
        for fn in (lambda f: f, tf.function):
            params = tf.Variable(self.params_np)

            def step():
                with tf.GradientTape() as tape:
                    out = co.embedding_lookup_combine(params, ids, "sum", use_custom_op=True)
                    loss = tf.reduce_sum(out)
                return tape.gradient(loss, params)

            g = fn(step)()
            self.assertIsInstance(g, tf.IndexedSlices)
            self.assertAllEqual(g.indices.numpy(), [0, 1, 3, 7, 9])
            self.assertAllEqual(g.values.numpy()[:, 0], [1, 1, 3, 3, 1])
            self.assertAllEqual(g.dense_shape.numpy(), [self.R, self.D])

    def test_grad_op_directly(self):
        require_op(self)
        lib = co.load_library()
        grad = tf.constant(self.rng.uniform(-1, 1, (3, 4)).astype(np.float32))
        ids = tf.constant([5, 2, 5, 5, 0], tf.int32)
        splits = tf.constant([0, 2, 2, 5], tf.int64)
        u, rows = lib.embedding_lookup_combine_grad(grad, ids, splits, tf.constant(6, tf.int64),
                                                    tf.zeros([0]), combiner="mean",
                                                    table_name="t")
        self.assertAllEqual(u.numpy(), [0, 2, 5])
        g = grad.numpy()
        want = np.stack([g[2] / 3, g[0] / 2, g[0] / 2 + g[2] / 3 + g[2] / 3])
        self.assertAllClose(rows.numpy(), want, atol=ATOL, rtol=RTOL)

    def test_out_of_range_ids(self):
        for use_op in _paths():
            for bad in (12345, -7):
                for as_var in (False, True):
                    params = tf.Variable(self.params_np) if as_var else tf.constant(self.params_np)
                    ids = tf.constant([[1, 2], [bad, 3]], tf.int64)
                    with self.assertRaises(tf.errors.InvalidArgumentError) as cm:
                        co.embedding_lookup_combine(params, ids, table_name="user",
                                                    use_custom_op=use_op)
                    self.assertIn("user", str(cm.exception))
                    self.assertIn(str(bad), str(cm.exception))

                    @tf.function
                    def f(i):
                        return co.embedding_lookup_combine(params, i, "mean",  # noqa: B023
                                                           table_name="user",
                                                           use_custom_op=use_op)  # noqa: B023
                    with self.assertRaises(tf.errors.InvalidArgumentError) as cm:
                        f(tf.ragged.constant([[1], [], [2, bad]], tf.int32))
                    self.assertIn("user", str(cm.exception))
                    self.assertIn(str(bad), str(cm.exception))

    def test_inside_keras_model(self):
        class Emb(tf.keras.layers.Layer):
            def __init__(self, use_op):
                super().__init__()
                self.use_op = use_op

            def build(self, _):
                self.table = self.add_weight("table", [20, 4], initializer="ones")

            def call(self, ids):
                return co.embedding_lookup_combine(self.table, ids, "mean",
                                                   use_custom_op=self.use_op)

        for use_op in _paths():
            inp = tf.keras.Input([3], dtype=tf.int64)
            model = tf.keras.Model(inp, tf.keras.layers.Dense(1)(Emb(use_op)(inp)))
            model.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.1), loss="mse")
            x = np.random.default_rng(0).integers(0, 20, (32, 3))
            hist = model.fit(x, np.zeros([32, 1]), epochs=2, batch_size=8, verbose=0)
            self.assertLess(hist.history["loss"][-1], hist.history["loss"][0] + 1e-6)


class EmbeddingLookupCombineOddWidthTest(EmbeddingLookupCombineTest):
    # 67 = 4 x 16 + 3: full vectors and a tail at every dispatch level (4, 8, 16 floats;
    # F16C blocks of 8 halves; float16 / bfloat16 rows converted in chunks of 64).
    DIM = 67


class EmbeddingLookupCombineWideTest(EmbeddingLookupCombineTest):
    # 144 = 9 x 16: rows wider than the registers one bag's sum is held in (8 vectors),
    # so each bag is summed in strips: 8 + 1 vectors at AVX-512, 8 + 8 + 2 at AVX2.
    DIM = 144


# ------------------------------------------------------------------ rowwise adagrad


class RowwiseAdagradTest(tf.test.TestCase):
    DIM = 12  # row width: shorter than one AVX-512 vector

    def _run(self, use_op, graph, c, wd, grad_dtype, idx_dtype, steps=4):
        rng = np.random.default_rng(7)
        R, D, N = 30, self.DIM, 40
        w0 = rng.uniform(-1, 1, (R, D)).astype(np.float32)
        v0 = rng.uniform(0, 0.5, R).astype(np.float32)
        var = tf.Variable(w0)
        accum = tf.Variable(v0)
        w_ref, v_ref = w0.astype(np.float64), v0.astype(np.float64)
        lr, eps = 0.05, 1e-3

        def apply(i, g):
            co.rowwise_adagrad_apply(var, accum, i, g, lr, eps, scale=c, weight_decay=wd,
                                            use_custom_op=use_op)
        fn = tf.function(apply) if graph else apply
        for _ in range(steps):
            idx = rng.integers(0, R // 2, N)  # many duplicates
            idx[:5] = 3
            g = rng.normal(0, 1, (N, D)).astype(np.float32).astype(grad_dtype)
            fn(tf.constant(idx, idx_dtype), tf.constant(g))
            w_ref, v_ref = np_rowwise_adagrad(w_ref, v_ref, idx, g, lr, eps, c, wd)
        return var.numpy(), accum.numpy(), w_ref, v_ref

    def test_matches_numpy(self):
        for use_op in _paths():
            for graph in (False, True):
                for c, wd, gdt, idt in ((1.0, 0.0, np.float32, tf.int64),
                                        (4.0, 0.01, np.float32, tf.int32),
                                        (1.0, 0.05, np.float16, tf.int64),
                                        (4.0, 0.0, np.float16, tf.int32),
                                        (2.0, 0.02, tf.bfloat16.as_numpy_dtype, tf.int64)):
                    w, v, w_ref, v_ref = self._run(use_op, graph, c, wd, gdt, idt)
                    msg = f"use_op={use_op} graph={graph} c={c} wd={wd} grad={gdt.__name__}"
                    self.assertAllClose(v, v_ref, atol=ATOL, rtol=RTOL, msg=msg)
                    self.assertAllClose(w, w_ref, atol=ATOL, rtol=RTOL, msg=msg)

    def test_epsilon_matters(self):
        # Zero accumulator + tiny grads: epsilon dominates the denominator.
        for use_op in _paths():
            var = tf.Variable(tf.zeros([3, 4]))
            accum = tf.Variable(tf.zeros([3]))
            co.rowwise_adagrad_apply(var, accum, tf.constant([1]), tf.fill([1, 4], 1e-3), 0.1, 1e-3,
                                     use_custom_op=use_op)
            # v = 1e-6, sqrt(v) = 1e-3, w = -0.1 * 1e-3 / (1e-3 + 1e-3) = -0.05
            self.assertAllClose(var.numpy()[1], [-0.05] * 4, atol=ATOL, rtol=1e-5)
            self.assertAllEqual(var.numpy()[[0, 2]], np.zeros([2, 4]))

    def test_paths_agree(self):
        if DISABLED:
            self.skipTest("custom ops disabled")
        a = self._run(True, True, 4.0, 0.01, np.float16, tf.int64)
        b = self._run(False, True, 4.0, 0.01, np.float16, tf.int64)
        self.assertAllClose(a[0], b[0], atol=ATOL, rtol=RTOL)
        self.assertAllClose(a[1], b[1], atol=ATOL, rtol=RTOL)

    def test_out_of_range_index(self):
        for use_op in _paths():
            for bad in (99, -1):
                var = tf.Variable(tf.zeros([5, 2]))
                accum = tf.Variable(tf.zeros([5]))
                with self.assertRaises(tf.errors.InvalidArgumentError) as cm:
                    co.rowwise_adagrad_apply(var, accum, tf.constant([0, bad]), tf.ones([2, 2]),
                                             0.1, 1e-8, use_custom_op=use_op)
                self.assertIn(str(bad), str(cm.exception))
                self.assertAllEqual(var.numpy(), np.zeros([5, 2]))


class RowwiseAdagradOddWidthTest(RowwiseAdagradTest):
    DIM = 37  # 2 x 16 + 5 = 4 x 8 + 5: full vectors and a tail at every dispatch level


class RowwiseAdagradWideTest(RowwiseAdagradTest):
    DIM = 144  # whole vectors at the AVX levels: gradient sums in register strips


def _flat_ids(ids):
    return (ids.flat_values if isinstance(ids, tf.RaggedTensor) else tf.reshape(ids, [-1])).numpy()


class FusedBackwardAdagradTest(tf.test.TestCase):
    """Row-wise AdaGrad on exactly the custom-op lookup's gradient, in a tf.function, runs
    as one kernel (EmbeddingLookupCombineGradRowwiseAdagrad) with bitwise the result of
    the lookup's backward kernel followed by the AdaGrad kernel."""
    FUSED = "EmbeddingLookupCombineGradRowwiseAdagrad"

    def _train(self, fuse, combiner, ids_list, dim, steps=3):
        """(outputs, table, accumulator, op types of the step's graph) after training on
        ids_list; fuse=False passes the gradient through tf.identity, so the update cannot
        see where it came from and takes the two-kernel route."""
        rng = np.random.default_rng(11)
        rows = 50
        table = tf.Variable(rng.normal(0, 1, (rows, dim)).astype(np.float32))
        accum = tf.Variable(rng.uniform(0, 0.5, rows).astype(np.float32))
        out_shape = co.embedding_lookup_combine(table, ids_list[0], combiner,
                                                use_custom_op=True).shape
        upstream = tf.constant(rng.normal(0, 1, out_shape).astype(np.float32))

        @tf.function
        def step(ids):
            with tf.GradientTape() as tape:
                out = co.embedding_lookup_combine(table, ids, combiner, use_custom_op=True)
                loss = tf.reduce_sum(out * upstream)
            grad = tape.gradient(loss, table)
            values = grad.values if fuse else tf.identity(grad.values)
            co.rowwise_adagrad_apply(table, accum, grad.indices, values, 0.05, 1e-3,
                                     scale=2.0, weight_decay=0.01, use_custom_op=True)
            return out

        outputs = [step(ids).numpy() for ids in ids_list[:steps]]
        graph = step.get_concrete_function(ids_list[0]).graph
        return outputs, table.numpy(), accum.numpy(), {op.type for op in graph.get_operations()}

    def _check(self, combiner, ids_list, dim):
        fused = self._train(True, combiner, ids_list, dim)
        plain = self._train(False, combiner, ids_list, dim)
        self.assertIn(self.FUSED, fused[3])
        self.assertNotIn("RowwiseAdagradApply", fused[3])
        self.assertNotIn(self.FUSED, plain[3])
        self.assertIn("RowwiseAdagradApply", plain[3])
        for a, b in zip(fused[0], plain[0]):
            self.assertAllEqual(a, b)
        self.assertAllEqual(fused[1], plain[1])
        self.assertAllEqual(fused[2], plain[2])
        # and the update happened: every row looked up moved, the others did not
        initial = np.random.default_rng(11).normal(0, 1, (50, dim)).astype(np.float32)
        looked_up = np.unique(np.concatenate([_flat_ids(ids) for ids in ids_list]))
        moved = np.any(fused[1] != initial, axis=1)
        self.assertAllEqual(np.flatnonzero(moved), looked_up)

    def test_dense_bags_sum_and_mean(self):
        require_op(self)
        rng = np.random.default_rng(0)
        for combiner in ("sum", "mean"):
            for idx_dtype in (tf.int32, tf.int64):
                for dim in (64, 37):  # streaming stores on the two-kernel route; a tail
                    ids_list = [tf.constant(rng.integers(0, 20, (33, 6)), idx_dtype)
                                for _ in range(3)]
                    with self.subTest(combiner=combiner, ids=idx_dtype.name, dim=dim):
                        self._check(combiner, ids_list, dim)

    def test_ragged_bags_with_empty_ones(self):
        require_op(self)
        rng = np.random.default_rng(1)
        ids_list = []
        for _ in range(3):
            lengths = rng.integers(0, 7, 40)
            lengths[::9] = 0
            ids_list.append(tf.RaggedTensor.from_row_lengths(
                tf.constant(rng.integers(0, 25, lengths.sum()), tf.int64), lengths))
        for combiner in ("sum", "mean"):
            with self.subTest(combiner=combiner):
                self._check(combiner, ids_list, 16)

    def test_rows_without_combiner(self):
        require_op(self)
        rng = np.random.default_rng(2)
        self._check(None, [tf.constant(rng.integers(0, 20, (17, 3))) for _ in range(3)], 24)

    def test_bad_input_is_refused_before_any_update(self):
        require_op(self)
        lib = co.require_library()
        table = tf.Variable(tf.ones([5, 4]))
        accum = tf.Variable(tf.zeros([5]))
        scalars = [tf.constant(x, tf.float32) for x in (0.1, 1e-8, 1.0, 0.0)]
        cases = [  # (grad, ids, row_splits, what the error must name)
            (tf.ones([2, 4]), tf.constant([0, 7], tf.int64), tf.constant([0, 1, 2], tf.int64),
             "embedding table 'clicks' got id 7, expected ids in [0, 5)"),
            (tf.ones([2, 4]), tf.constant([0, 1], tf.int64), tf.constant([0, 2], tf.int64),
             "grad has 2 rows, expected 1 (one per bag)"),
            (tf.ones([2, 3]), tf.constant([0, 1], tf.int64), tf.constant([0, 1, 2], tf.int64),
             "with 4 columns"),
        ]
        for grad, ids, splits, expected in cases:
            with self.subTest(expected=expected):
                with self.assertRaises(tf.errors.InvalidArgumentError) as cm:
                    lib.embedding_lookup_combine_grad_rowwise_adagrad(
                        table.handle, accum.handle, grad, ids, splits, *scalars,
                        tf.zeros([0]), combiner="sum", table_name="clicks")
                self.assertIn(expected, str(cm.exception))
                self.assertAllEqual(table.numpy(), np.ones([5, 4]))
                self.assertAllEqual(accum.numpy(), np.zeros([5]))


# ------------------------------------------------------------------ determinism

_DETERMINISM_SCRIPT = textwrap.dedent("""
    import hashlib, sys
    import numpy as np
    import tensorflow as tf
    n = int(sys.argv[1])
    tf.config.threading.set_intra_op_parallelism_threads(n)
    from tfhybrid import custom_ops as co
    assert co.custom_ops_available(), co.load_error()
    h = hashlib.sha256()

    def digest(*xs):
        for x in xs:
            h.update(x.numpy().tobytes())

    # 1. float32 table, D = 64 (gradient rows written with streaming stores), mean of
    #    Zipf ids; row-wise AdaGrad with scale and weight decay, on duplicated gradient
    #    rows (the two kernels) and on exactly the lookup's gradient (the fused kernel).
    rng = np.random.default_rng(0)
    R, D, B, H = 5000, 64, 4096, 8
    ids = np.minimum(rng.zipf(1.05, (B, H)) - 1, R - 1) % R
    up = tf.constant(rng.normal(0, 1, (B, D)).astype(np.float32))

    def train(duplicate):
        # duplicate: the update gets every gradient row twice (the copy rounded to
        # float16), so it takes the two-kernel route; else it gets exactly the lookup's
        # gradient and runs fused with the backward.
        table = tf.Variable(rng.normal(0, 1, (R, D)).astype(np.float32))
        accum = tf.Variable(tf.zeros([R]))

        @tf.function
        def step(ids):
            with tf.GradientTape() as tape:
                out = co.embedding_lookup_combine(table, ids, "mean", use_custom_op=True)
                loss = tf.reduce_sum(out * up)
            g = tape.gradient(loss, table)
            idx, val = g.indices, g.values
            if duplicate:
                idx = tf.concat([idx, idx[::-1]], 0)
                val = tf.concat([val, tf.cast(tf.cast(val, tf.float16), tf.float32)], 0)
            co.rowwise_adagrad_apply(table, accum, idx, val, 0.01, 1e-3, 4.0, 0.01,
                                     use_custom_op=True)
            return out, g.indices, g.values

        for s in range(3):
            digest(*step(tf.constant(np.roll(ids, s, axis=0), tf.int64)))
        digest(table, accum)

    train(duplicate=True)
    train(duplicate=False)

    # 2. D = 37 (full vectors and tails at every level), ragged bags with empty ones, sum;
    #    bfloat16 and float16 gradients into AdaGrad.
    rng = np.random.default_rng(1)
    R, D, B = 3000, 37, 700
    lengths = rng.integers(0, 12, B)
    lengths[::50] = 0
    ids = tf.RaggedTensor.from_row_lengths(rng.integers(0, R, lengths.sum()), lengths)
    table = tf.Variable(rng.normal(0, 1, (R, D)).astype(np.float32))
    accum = tf.Variable(tf.fill([R], 0.1))
    up = tf.constant(rng.normal(0, 1, (B, D)).astype(np.float32))
    for grad_dtype in (tf.bfloat16, tf.float16):
        with tf.GradientTape() as tape:
            out = co.embedding_lookup_combine(table, ids, "sum", use_custom_op=True)
            loss = tf.reduce_sum(out * up)
        g = tape.gradient(loss, table)
        co.rowwise_adagrad_apply(table, accum, g.indices, tf.cast(g.values, grad_dtype), 0.05,
                                 1e-6, use_custom_op=True)
        digest(out, g.indices, g.values)
    digest(table, accum)

    # 3. float16 and bfloat16 tables, D = 67 (F16C blocks of 8 and conversion chunks of 64,
    #    both with tails): mean forward and gradient, and the plain gather (combiner None).
    rng = np.random.default_rng(2)
    R, D = 2000, 67
    ids = tf.constant(rng.integers(0, R, (300, 5)))
    up = tf.constant(rng.normal(0, 1, (300, D)).astype(np.float32))
    for dtype in (tf.float16, tf.bfloat16):
        params = tf.cast(tf.constant(rng.normal(0, 1, (R, D))), dtype)
        with tf.GradientTape() as tape:
            tape.watch(params)
            out = co.embedding_lookup_combine(params, ids, "mean", use_custom_op=True)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * up)
        g = tape.gradient(loss, params)
        digest(out, g.indices, g.values,
               co.embedding_lookup_combine(params, ids, None, use_custom_op=True))

    # 3b. per-id weights: weighted sqrtn forward, its gradient, and the fused backward +
    #     AdaGrad of a weighted sum, D = 64 (register strips) and 37 (tails)
    rng = np.random.default_rng(5)
    for D in (64, 37):
        lengths = rng.integers(0, 9, 500)
        ids = tf.RaggedTensor.from_row_lengths(rng.integers(0, 800, lengths.sum()), lengths)
        weights = ids.with_flat_values(tf.constant(rng.uniform(0.1, 2, lengths.sum()),
                                                   tf.float32))
        table = tf.Variable(rng.normal(0, 1, (800, D)).astype(np.float32))
        accum = tf.Variable(tf.zeros([800]))
        up = tf.constant(rng.normal(0, 1, (500, D)).astype(np.float32))

        @tf.function
        def weighted_step():
            with tf.GradientTape() as tape:
                out = co.embedding_lookup_combine(table, ids, "sum", use_custom_op=True,
                                                  weights=weights)
                loss = tf.reduce_sum(out * up)
            g = tape.gradient(loss, table)
            co.rowwise_adagrad_apply(table, accum, g.indices, g.values, 0.05, 1e-6,
                                     use_custom_op=True)
            return out

        with tf.GradientTape() as tape:
            out = co.embedding_lookup_combine(table, ids, "sqrtn", use_custom_op=True,
                                              weights=weights)
            loss = tf.reduce_sum(out * up)
        g = tape.gradient(loss, table)
        digest(out, g.indices, g.values, weighted_step(), table, accum)

    # 4. table-batched bags and each table's fused backward + AdaGrad reading its columns
    #    of the shared upstream gradient. Widths: 64 and 16 one register strip, 37 a
    #    tail, 144 strips of 8 + 1 (AVX-512) or 8 + 8 + 2 (AVX2), 24 whole vectors at AVX2
    #    only.
    rng = np.random.default_rng(3)
    widths = (64, 37, 16, 144, 24)
    tables = [tf.Variable(rng.normal(0, 1, (1000, d)).astype(np.float32)) for d in widths]
    accums = [tf.Variable(tf.zeros([1000])) for _ in widths]
    ids = [tf.constant(rng.integers(0, 1000, (2000, 4))) for _ in widths]
    up = tf.constant(rng.normal(0, 1, (2000, sum(widths))).astype(np.float32))

    @tf.function
    def batched_step():
        with tf.GradientTape() as tape:
            out = co.embedding_lookup_combine_concat(tables, ids, "mean", use_custom_op=True)
            loss = tf.reduce_sum(out * up)
        for t, a, g in zip(tables, accums, tape.gradient(loss, tables)):
            co.rowwise_adagrad_apply(t, a, g.indices, g.values, 0.05, 1e-6,
                                     use_custom_op=True)
        return out

    for _ in range(2):
        digest(batched_step())
    digest(*tables, *accums)

    # 5. sum over ragged int32 ids and splits with empty bags, at widths the register
    #    paths take (64, 144), and the backward's rows of a column window of a shared
    #    upstream gradient (the two-kernel route's first kernel).
    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 9, 500).astype(np.int32)
    lengths[::7] = 0
    ids = tf.RaggedTensor.from_row_lengths(
        rng.integers(0, 800, lengths.sum()).astype(np.int32), lengths)
    widths = (64, 144)
    tables = [tf.Variable(rng.normal(0, 1, (800, d)).astype(np.float32)) for d in widths]
    up = tf.constant(rng.normal(0, 1, (500, sum(widths))).astype(np.float32))
    with tf.GradientTape() as tape:
        out = co.embedding_lookup_combine_concat(tables, [ids, ids], "sum",
                                                 use_custom_op=True)
        loss = tf.reduce_sum(out * up)
    grads = tape.gradient(loss, tables)
    digest(out, *[g.indices for g in grads], *[g.values for g in grads])
    print("DIGEST", co.kernel_isa(), h.hexdigest())
""")


class LookupCombineConcatTest(tf.test.TestCase):
    """embedding_lookup_combine_concat: several tables' bags in one op, equal bit for bit
    to a lookup per table and a concat, forward, gradient and fused row-wise AdaGrad."""
    WIDTHS = (64, 37, 16)

    def _tables(self, dtype=tf.float32, seed=0):
        rng = np.random.default_rng(seed)
        return [tf.Variable(tf.cast(rng.normal(0, 1, (40 + 10 * t, d)), dtype))
                for t, d in enumerate(self.WIDTHS)]

    def _ids(self, seed=0, batch=21):
        """dense int64, ragged (empty bags included) and dense int32 [B] ids."""
        rng = np.random.default_rng(seed)
        lengths = rng.integers(0, 6, batch)
        lengths[::4] = 0
        return [tf.constant(rng.integers(0, 40, (batch, 3))),
                tf.RaggedTensor.from_row_lengths(
                    tf.constant(rng.integers(0, 50, lengths.sum()), tf.int64), lengths),
                tf.constant(rng.integers(0, 60, batch), tf.int32)]

    @staticmethod
    def _per_table(tables, ids, combiner):
        return tf.concat([co.embedding_lookup_combine(t, i, combiner, use_custom_op=True)
                          for t, i in zip(tables, ids)], axis=1)

    def test_forward_equals_per_table_lookups_and_numpy(self):
        require_op(self)
        ids = self._ids()
        for dtype in (tf.float32, tf.float16, tf.bfloat16):
            tables = self._tables(dtype)
            for combiner in ("sum", "mean"):
                with self.subTest(dtype=dtype.name, combiner=combiner):
                    out = co.embedding_lookup_combine_concat(tables, ids, combiner,
                                                             use_custom_op=True)
                    self.assertEqual(out.shape, [21, sum(self.WIDTHS)])
                    self.assertEqual(out.dtype, dtype)
                    self.assertAllEqual(out, self._per_table(tables, ids, combiner))
                    if dtype == tf.float32:
                        bags = [[list(np.atleast_1d(b)) for b in x.numpy()]
                                if not isinstance(x, tf.RaggedTensor) else x.to_list()
                                for x in ids]
                        expected = np.concatenate(
                            [np_lookup(t.numpy(), b, combiner) for t, b in zip(tables, bags)],
                            axis=1)
                        self.assertAllClose(out, expected, atol=ATOL, rtol=RTOL)

    def test_gradient_is_each_tables_own(self):
        require_op(self)
        tables, ids = self._tables(), self._ids(1)
        upstream = tf.constant(np.random.default_rng(1).normal(
            0, 1, (21, sum(self.WIDTHS))).astype(np.float32))
        for combiner in ("sum", "mean"):
            with tf.GradientTape(persistent=True) as tape:
                batched = tf.reduce_sum(co.embedding_lookup_combine_concat(
                    tables, ids, combiner, use_custom_op=True) * upstream)
                per_table = tf.reduce_sum(self._per_table(tables, ids, combiner) * upstream)
            for got, want in zip(tape.gradient(batched, tables),
                                 tape.gradient(per_table, tables)):
                self.assertIsInstance(got, tf.IndexedSlices)
                self.assertAllEqual(got.indices, want.indices)
                self.assertAllEqual(got.values, want.values)

    def _train(self, batched, fuse, steps=3):
        """(outputs, tables, accumulators, the step's ops) after row-wise AdaGrad steps."""
        tables = self._tables(seed=4)
        accums = [tf.Variable(tf.fill([int(t.shape[0])], 0.1)) for t in tables]
        ids_list = [self._ids(s) for s in range(steps)]
        upstream = tf.constant(np.random.default_rng(5).normal(
            0, 1, (21, sum(self.WIDTHS))).astype(np.float32))

        @tf.function
        def step(ids):
            with tf.GradientTape() as tape:
                out = (co.embedding_lookup_combine_concat(tables, ids, "mean",
                                                          use_custom_op=True)
                       if batched else self._per_table(tables, ids, "mean"))
                loss = tf.reduce_sum(out * upstream)
            for t, a, g in zip(tables, accums, tape.gradient(loss, tables)):
                values = g.values if fuse else tf.identity(g.values)
                co.rowwise_adagrad_apply(t, a, g.indices, values, 0.05, 1e-3,
                                         weight_decay=0.01, use_custom_op=True)
            return out

        outputs = [step(ids).numpy() for ids in ids_list]
        ops = step.get_concrete_function(ids_list[0]).graph.get_operations()
        return outputs, [t.numpy() for t in tables], [a.numpy() for a in accums], ops

    def test_fused_adagrad_reads_each_tables_columns_in_place(self):
        require_op(self)
        batched = self._train(batched=True, fuse=True)
        fused = [op for op in batched[3]
                 if op.type == FusedBackwardAdagradTest.FUSED]
        self.assertLen(fused, len(self.WIDTHS))
        starts = np.cumsum((0,) + self.WIDTHS)
        self.assertCountEqual([list(op.get_attr("grad_columns")) for op in fused],
                              [[int(a), int(b)] for a, b in zip(starts[:-1], starts[1:])])
        for other in (self._train(batched=False, fuse=True),
                      self._train(batched=True, fuse=False)):
            for got, want in zip(batched[:3], other[:3]):
                for a, b in zip(got, want):
                    self.assertAllEqual(a, b)

    def test_a_table_twice(self):
        require_op(self)
        table = self._tables()[0]
        ids = [tf.constant([[1, 2], [3, 3]]), tf.constant([[0, 39], [5, 6]])]
        self.assertAllEqual(co.embedding_lookup_combine_concat([table, table], ids),
                            self._per_table([table, table], ids, "sum"))

    def test_other_tables_take_per_table_lookups(self):
        tables, ids = self._tables(), self._ids()
        mixed = [tables[0].numpy(), tables[1], tables[2]]  # a tensor among variables
        self.assertAllClose(co.embedding_lookup_combine_concat(mixed, ids, "mean"),
                            co.embedding_lookup_combine_concat(tables, ids, "mean"),
                            atol=ATOL, rtol=RTOL)
        with self.assertRaisesRegex(ValueError, "tf.Variable tables of one dtype"):
            co.embedding_lookup_combine_concat(mixed, ids, use_custom_op=True)

    def test_bad_input_is_named(self):
        require_op(self)
        tables, ids = self._tables(), self._ids()
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    "embedding table 'c' has 20 bags, expected 21"):
            co.embedding_lookup_combine_concat(tables, ids[:2] + [ids[2][:20]],
                                               table_names=["a", "b", "c"])
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    "embedding table 'b' got id 50, expected ids in"):
            co.embedding_lookup_combine_concat(
                tables, [ids[0], tf.ragged.constant([[50]] * 21, tf.int64), ids[2]],
                table_names=["a", "b", "c"])
        with self.assertRaisesRegex(ValueError, "one ids tensor per table"):
            co.embedding_lookup_combine_concat(tables, ids[:2])
        with self.assertRaisesRegex(ValueError, "combiner must be 'sum' or 'mean'"):
            co.embedding_lookup_combine_concat(tables, ids, None)
        with self.assertRaisesRegex(ValueError, "table_names has 1 names, expected 3"):
            co.embedding_lookup_combine_concat(tables, ids, table_names=["a"])
        lib = co.require_library()
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"table 't': grad_columns \[60, 70\) exceed the "
                                    "gradient's 64 columns"):
            lib.embedding_lookup_combine_grad(tf.ones([2, 64]), [1, 2], [0, 1, 2],
                                              tf.constant(10, tf.int64), tf.zeros([0]),
                                              table_name="t", grad_columns=[60, 70])


class DynamicTableKernelsTest(tf.test.TestCase):
    """The dynamic tables' small kernels against their pure-TF forms, at the level the
    process runs (tests/test_kernel_isa.py runs this class at every level)."""

    def test_keyed_rows_are_the_tf_ops_rows_bit_for_bit(self):
        require_op(self)
        from tfhybrid.dynamic.initial_rows import KeyedInitializer
        keys = tf.constant(np.random.default_rng(6).integers(-2**63, 2**63 - 1, 777),
                           tf.int64)
        for init, dim in ((KeyedInitializer("uniform", -0.05, 0.05, 0), 64),
                          (KeyedInitializer("uniform", -3.0, 1e-3, 2**63 + 5), 13),
                          (KeyedInitializer("normal", 0.1, 0.3, 9), 7)):
            np.testing.assert_array_equal(init.rows(keys, dim, use_custom_op=True),
                                          init.rows(keys, dim, use_custom_op=False),
                                          err_msg=f"{init} dim {dim}")

    def test_held_slots_are_the_kept_ids_of_each_bag(self):
        require_op(self)
        from tfhybrid.combiners import kept_in_bags
        rng = np.random.default_rng(7)
        lengths = rng.integers(0, 6, 50)
        slots = rng.integers(-1, 9, int(lengths.sum())).astype(np.int32)
        got = co.dynamic_held_slots(slots, lengths)
        want = kept_in_bags(tf.constant(slots), tf.constant(lengths), slots >= 0)
        for g, w in zip(got, want):
            self.assertAllEqual(g, w)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "sum to"):
            co.dynamic_held_slots(slots, lengths + 1)


class CachedChunkedAdagradTest(tf.test.TestCase):
    """CachedChunkedRowwiseAdagradApply: FIITED's update on a tiered table's cache (its
    equality with the pool's kernel, step by step and in training, is in
    tests/test_tiers.py)."""

    def _state(self):
        cache = tf.Variable(tf.reshape(tf.range(24, dtype=tf.float32), [3, 8]))
        accum = tf.Variable(tf.zeros([3]))
        utility = tf.Variable(tf.ones([10]))
        return cache, accum, utility

    def _apply(self, cache, accum, utility, slots, slot_chunks, slot_rows, chunk_dim=2):
        co.cached_chunked_rowwise_adagrad_apply(
            cache, accum, tf.constant(slot_chunks, tf.int32), tf.constant(slot_rows, tf.int64),
            chunk_dim, tf.constant(slots), tf.ones([len(slots), 8]), 0.5, 1e-8, 1.0, 0.0,
            utility, 0.5)

    def test_updates_the_chunks_a_slot_holds_and_its_row_utility(self):
        require_op(self)
        cache, accum, utility = self._state()
        before = cache.numpy()
        # slot 2 is unfilled (row -1): not named, so not checked
        self._apply(cache, accum, utility, [0, 1, 0], [2, 4, 0], [7, 3, -1])
        after = cache.numpy()
        # slot 0: two duplicates summed (g = 2), 2 chunks of 2 held: 4 entries step
        self.assertAllClose(accum.numpy(), [4.0, 1.0, 0.0])
        self.assertAllClose(after[0, :4], before[0, :4] - 0.5 * 2.0 / 2.0)
        self.assertAllEqual(after[0, 4:], before[0, 4:])
        self.assertAllClose(after[1], before[1] - 0.5)
        self.assertAllEqual(after[2], before[2])
        # utility: everything halves, then row 7 gains 0.5 * |g|^2 = 0.5 * 8 * 4, row 3
        # 0.5 * 8
        want = np.full(10, 0.5, np.float32)
        want[7] += 16.0
        want[3] += 4.0
        self.assertAllClose(utility.numpy(), want)

    def test_bad_input_is_refused_by_name_before_any_update(self):
        require_op(self)
        cases = [([3], [2, 2, 2], [0, 1, 2], r"cache.*got id 3"),
                 ([1], [2, 2, 2], [0, 10, 2], r"cache slot 1 holds row 10 .*\[0, 10\)"),
                 ([1], [2, 5, 2], [0, 1, 2], r"cache slot 1 holds row 1 with 5 chunks.*at "
                                             r"most 4 chunks")]
        for slots, slot_chunks, slot_rows, message in cases:
            with self.subTest(message=message):
                cache, accum, utility = self._state()
                with self.assertRaisesRegex(tf.errors.InvalidArgumentError, message):
                    self._apply(cache, accum, utility, slots, slot_chunks, slot_rows)
                self.assertAllEqual(cache.numpy(), self._state()[0].numpy())
                self.assertAllEqual(utility.numpy(), np.ones(10))
        cache, accum, utility = self._state()
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"dim 8 is not a multiple of chunk_dim 3"):
            self._apply(cache, accum, utility, [0], [1, 1, 1], [0, 1, 2], chunk_dim=3)


def np_weighted(params, bags, weights, combiner):
    """tf.nn.embedding_lookup_sparse's weighted combiners, bag by bag, in float64."""
    out = np.zeros((len(bags), params.shape[1]))
    for b, (bag, w) in enumerate(zip(bags, weights)):
        denominator = {"sum": 1.0, "mean": sum(w), "sqrtn": np.sqrt(sum(x * x for x in w))}
        for i, x in zip(bag, w):
            out[b] += x * params[i].astype(np.float64)
        if bag and denominator[combiner]:
            out[b] /= denominator[combiner]
        elif bag:
            out[b] = 0
    return out


class WeightedLookupTest(tf.test.TestCase):
    """Per-id weights in the lookup, its backward and the fused backward + AdaGrad:
    against NumPy, and the C++ path against the pure-TF one."""

    def _case(self, width, seed=0):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(0, 6, 40)
        bags = [rng.integers(0, 30, n).tolist() for n in lengths]
        weights = [rng.uniform(-1, 2, n).astype(np.float32).tolist() for n in lengths]
        table = rng.normal(0, 1, (30, width)).astype(np.float32)
        return bags, weights, table, rng.normal(0, 1, (40, width)).astype(np.float32)

    def test_forward_and_gradient_equal_numpy(self):
        for width in (16, 5, 64):
            bags, weights, table, up = self._case(width)
            ids = tf.ragged.constant(bags, tf.int64, ragged_rank=1, inner_shape=())
            w = tf.ragged.constant(weights, tf.float32, ragged_rank=1, inner_shape=())
            for combiner in ("sum", "mean", "sqrtn"):
                want = np_weighted(table, bags, weights, combiner)
                for use in _paths():
                    with self.subTest(width=width, combiner=combiner, op=use):
                        var = tf.Variable(table)
                        with tf.GradientTape() as tape:
                            out = co.embedding_lookup_combine(var, ids, combiner,
                                                              use_custom_op=use, weights=w)
                            loss = tf.reduce_sum(out * up)
                        self.assertAllClose(out, want, rtol=0, atol=1e-5)
                        # the gradient of a row: sum over its places of w * g / denominator
                        grad = np.zeros_like(table, np.float64)
                        for b, (bag, ws) in enumerate(zip(bags, weights)):
                            d = {"sum": 1.0, "mean": sum(ws),
                                 "sqrtn": np.sqrt(sum(x * x for x in ws))}[combiner]
                            for i, x in zip(bag, ws):
                                grad[i] += x * up[b] / d if d else 0
                        self.assertAllClose(_dense(tape.gradient(loss, var)), grad,
                                            rtol=0, atol=1e-4)

    def test_half_tables_and_dense_ids(self):
        rng = np.random.default_rng(4)
        ids = tf.constant(rng.integers(0, 30, (20, 3)))
        w = tf.constant(rng.uniform(0.1, 2, (20, 3)).astype(np.float32))
        for dtype in (tf.float16, tf.bfloat16):
            params = tf.cast(tf.constant(rng.normal(0, 1, (30, 8))), dtype)
            got = [co.embedding_lookup_combine(params, ids, "mean", use_custom_op=use,
                                               weights=w) for use in _paths()]
            want = np_weighted(params.numpy().astype(np.float64), ids.numpy().tolist(),
                               w.numpy().tolist(), "mean")
            for g in got:
                self.assertAllClose(tf.cast(g, tf.float32), want, rtol=0, atol=2e-2)

    def test_fused_adagrad_equals_the_two_kernels(self):
        require_op(self)
        bags, weights, table, up = self._case(32, seed=2)
        ids = tf.ragged.constant(bags, tf.int64, ragged_rank=1, inner_shape=())
        w = tf.ragged.constant(weights, tf.float32, ragged_rank=1, inner_shape=())
        results = []
        for fused in (True, False):
            var, accum = tf.Variable(table), tf.Variable(tf.zeros([30]))

            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(co.embedding_lookup_combine(
                        var, ids, "sum", use_custom_op=True, weights=w) * up)
                g = tape.gradient(loss, var)
                # a copy of the values is another op: the two-kernel route
                values = g.values if fused else tf.identity(g.values)
                co.rowwise_adagrad_apply(var, accum, g.indices, values, 0.1, 1e-6,
                                         use_custom_op=True)

            step()
            results.append((var.numpy(), accum.numpy()))
        self.assertAllEqual(results[0][0], results[1][0])
        self.assertAllEqual(results[0][1], results[1][1])

    def test_bad_weights_are_named(self):
        ids = tf.constant([[1, 2]])
        with self.assertRaisesRegex(ValueError, "weights of shape"):
            co.embedding_lookup_combine(tf.ones([4, 2]), ids, "sum", weights=tf.ones([1, 3]))
        with self.assertRaisesRegex(ValueError, "need a combiner"):
            co.embedding_lookup_combine(tf.ones([4, 2]), ids, None, weights=tf.ones([1, 2]))
        if not DISABLED and co.custom_ops_available():
            lib = tf.load_op_library(co.library_path)
            with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "one per id"):
                lib.embedding_lookup_combine(tf.ones([4, 2]), [0, 1], [0, 2], [1.0])
            with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "combiner 'sum'"):
                lib.embedding_lookup_combine(tf.ones([4, 2]), [0, 1], [0, 2], [1.0, 2.0],
                                             combiner="mean")


class DeterminismTest(tf.test.TestCase):

    def _digest(self, threads, isa=None):
        """sha256 of every output of _DETERMINISM_SCRIPT run in a fresh process, with
        `threads` intra-op threads at dispatch level `isa` (None: the default)."""
        env = dict(os.environ, TF_NUM_INTRAOP_THREADS=str(threads), TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=str(_REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if isa is not None:
            env["TFHYBRID_KERNEL_ISA"] = isa
        proc = subprocess.run([sys.executable, "-c", _DETERMINISM_SCRIPT, str(threads)], env=env,
                              cwd=str(_REPO), capture_output=True, text=True, timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("DIGEST")]
        self.assertLen(lines, 1, proc.stdout)
        _, ran_isa, digest = lines[0].split()
        if isa is not None:
            self.assertEqual(ran_isa, isa)
        return digest

    def test_bitwise_deterministic_across_threads_and_runs(self):
        require_op(self)
        digests = [self._digest(1), self._digest(2), self._digest(2), self._digest(1)]
        self.assertLen(set(digests), 1, digests)

    def test_bitwise_identical_across_kernel_isas(self):
        # Every dispatch level must compute exactly the same bits (isa_kernels.h): the
        # data-parallel copies of a shard may run on nodes that pick different levels.
        require_op(self)
        levels = co.supported_kernel_isas()
        digests = {isa: self._digest(2, isa) for isa in levels}
        self.assertLen(set(digests.values()), 1, digests)

    def test_in_process_repeatable(self):
        require_op(self)
        rng = np.random.default_rng(3)
        ids = tf.constant(rng.integers(0, 300, 50000), tf.int64)
        grad = tf.constant(rng.normal(0, 1, (50000, 32)).astype(np.float32))
        results = []
        for _ in range(3):
            var = tf.Variable(tf.ones([300, 32]))
            accum = tf.Variable(tf.zeros([300]))
            co.rowwise_adagrad_apply(var, accum, ids, grad, 0.1, 1e-3, use_custom_op=True)
            results.append(hashlib.sha256(var.numpy().tobytes() + accum.numpy().tobytes())
                           .hexdigest())
        self.assertLen(set(results), 1)


if __name__ == "__main__":
    tf.test.main()
