"""tfhybrid.optimizers: RowWiseAdagrad / MomentumScaledRowWiseAdagrad against numpy.

Every numeric test runs twice: on the C++ kernel path (``use_custom_op=True``) and on the
pure-TF path (``use_custom_op=False``). If the custom-op library cannot be loaded the
kernel-path tests FAIL; they are skipped only when ``TFHYBRID_DISABLE_CUSTOM_OPS=1``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python tests/test_optimizers.py``
"""

import os
import re

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfhybrid
from tfhybrid import installed_keras_major
from tfhybrid import roles
from tfhybrid.custom_ops import custom_ops_available
from tfhybrid.optimizers import MomentumScaledRowWiseAdagrad, RowWiseAdagrad
from tfhybrid.testing.graphs import traced_op_types

KERAS_3 = tfhybrid.keras_major() == 3

_DISABLED = os.environ.get("TFHYBRID_DISABLE_CUSTOM_OPS", "").strip().lower() in (
    "1", "true", "yes")
_PATHS = (("kernel", True), ("pure_tf", False))
_ATOL = _RTOL = 1e-6
KERAS = (2, 3)


def _require_path(test: tf.test.TestCase, use_custom_op: bool) -> None:
    # Only the explicit environment switch may skip the kernel path; a library that
    # fails to load makes rowwise_adagrad_apply(use_custom_op=True) raise -> test fails.
    if use_custom_op and _DISABLED:
        test.skipTest("custom ops disabled by TFHYBRID_DISABLE_CUSTOM_OPS=1")


# ------------------------------------------------------------- numpy reference
# Written from the algorithm's definition, not from the op: float64 throughout.
def np_rowwise_step(w, v, indices, grads, lr, eps, c, wd):
    """One exact row-wise AdaGrad step on the rows named by `indices` (dups summed)."""
    w, v = w.astype(np.float64).copy(), v.astype(np.float64).copy()
    summed = {}
    for i, g in zip(np.asarray(indices).tolist(), np.asarray(grads, np.float64)):
        summed[i] = summed.get(i, 0.0) + g
    for i, g in summed.items():
        v[i] += np.mean(g * g)
        w[i] -= lr * g / (np.sqrt(v[i] / c) + eps)
        if wd > 0:
            w[i] -= lr * wd * w[i]
    return w, v


def np_elementwise_step(w, acc, grad, lr, eps, c, wd):
    """Element-wise AdaGrad step (the fallback for variables that are not 2-D)."""
    w, acc = w.astype(np.float64).copy(), acc.astype(np.float64).copy()
    g = np.asarray(grad, np.float64)
    acc += g * g
    w -= lr * g / (np.sqrt(acc / c) + eps)
    if wd > 0:
        w -= lr * wd * w
    return w, acc


# ------------------------------------------------------------------- cases
_ROWS, _DIM, _UNTOUCHED = 12, 4, 3  # the last _UNTOUCHED rows never get a gradient

# name, optimizer class kwargs, momentum scale attribute on the variable, c, grad dtype
_SPARSE_CASES = (
    ("c1_dups_eps", dict(cls=RowWiseAdagrad, epsilon=1e-3), None, 1.0, np.float32),
    ("c1_ignores_attr", dict(cls=RowWiseAdagrad, epsilon=1e-3), 4.0, 1.0, np.float32),
    ("c4_arg", dict(cls=MomentumScaledRowWiseAdagrad, momentum_scale=4.0, epsilon=1e-3),
     None, 4.0, np.float32),
    ("c4_attr", dict(cls=MomentumScaledRowWiseAdagrad, epsilon=1e-3), 4.0, 4.0, np.float32),
    ("arg_beats_attr", dict(cls=MomentumScaledRowWiseAdagrad, momentum_scale=4.0,
                            epsilon=1e-3), 9.0, 4.0, np.float32),
    ("no_attr_is_c1", dict(cls=MomentumScaledRowWiseAdagrad, epsilon=1e-3), None, 1.0,
     np.float32),
    ("weight_decay", dict(cls=RowWiseAdagrad, epsilon=1e-3, weight_decay=0.2,
                          initial_accumulator_value=0.1), None, 1.0, np.float32),
    ("fp16_grads", dict(cls=MomentumScaledRowWiseAdagrad, momentum_scale=4.0, epsilon=1e-3,
                        weight_decay=0.05), None, 4.0, np.float16),
)


def _params():
    out = []
    for path_name, use_op in _PATHS:
        for name, kwargs, attr, c, gdtype in _SPARSE_CASES:
            out.append((f"{name}_{path_name}", use_op, kwargs, attr, c, gdtype))
    return out


def _sparse_batches(rng, steps, gdtype):
    """(ids, values) per step; ids repeat on purpose and skip the last rows."""
    batches = []
    for _ in range(steps):
        ids = rng.integers(0, _ROWS - _UNTOUCHED, size=7)
        ids = np.concatenate([ids, ids[:2], ids[:1]])  # guaranteed duplicates
        vals = rng.normal(size=(ids.size, _DIM)).astype(gdtype)
        batches.append((ids.astype(np.int64), vals))
    return batches


class LibraryTest(tf.test.TestCase):

    def test_custom_op_library_loads(self):
        if _DISABLED:
            self.skipTest("custom ops disabled by TFHYBRID_DISABLE_CUSTOM_OPS=1")
        self.assertTrue(custom_ops_available(),
                        "tfhybrid custom-op library is not loadable; build it with "
                        "`python -m tfhybrid.custom_ops.build`")


class RowWiseAdagradNumericsTest(tf.test.TestCase, parameterized.TestCase):

    def _run_sparse(self, use_op, kwargs, attr, c, gdtype, steps=5, in_function=False):
        kwargs = dict(kwargs)
        cls = kwargs.pop("cls")
        lr = 0.05
        rng = np.random.default_rng(7)
        w0 = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
        var = tf.Variable(w0)
        if attr is not None:
            roles.assign(var, momentum_scale=attr)
        opt = cls(learning_rate=lr, use_custom_op=use_op, **kwargs)
        eps = kwargs.get("epsilon", 1e-8)
        wd = kwargs.get("weight_decay", 0.0)
        init_acc = kwargs.get("initial_accumulator_value", 0.0)
        ref_w, ref_v = w0.astype(np.float64), np.full([_ROWS], init_acc, np.float64)

        def apply(ids, vals):
            grad = tf.IndexedSlices(vals, ids, tf.constant([_ROWS, _DIM], tf.int64))
            opt.apply_gradients([(grad, var)])

        if in_function:
            apply = tf.function(apply)
        for ids, vals in _sparse_batches(rng, steps, gdtype):
            apply(tf.constant(ids), tf.constant(vals))
            # fp16 case: the reference sees exactly the float16-rounded values.
            ref_w, ref_v = np_rowwise_step(ref_w, ref_v, ids, vals.astype(np.float32), lr,
                                           eps, c, wd)
            self.assertAllClose(var.numpy(), ref_w, atol=_ATOL, rtol=_RTOL)
            self.assertAllClose(opt.accumulator_of(var).numpy(), ref_v, atol=_ATOL, rtol=_RTOL)
        # Rows that never had a gradient: bit-for-bit unchanged, including decay (wd > 0).
        self.assertAllEqual(var.numpy()[-_UNTOUCHED:], w0[-_UNTOUCHED:])
        self.assertAllEqual(opt.accumulator_of(var).numpy()[-_UNTOUCHED:],
                            np.full([_UNTOUCHED], init_acc, np.float32))
        self.assertEqual(int(opt.iterations.numpy()), steps)
        return var

    @parameterized.named_parameters(*_params())
    def test_sparse_matches_numpy(self, use_op, kwargs, attr, c, gdtype):
        _require_path(self, use_op)
        self._run_sparse(use_op, kwargs, attr, c, gdtype)

    @parameterized.named_parameters(*_PATHS)
    def test_sparse_in_tf_function(self, use_op):
        _require_path(self, use_op)
        self._run_sparse(use_op, dict(cls=MomentumScaledRowWiseAdagrad, epsilon=1e-3,
                                      weight_decay=0.1), 4.0, 4.0, np.float32, steps=4,
                         in_function=True)

    @parameterized.named_parameters(*_PATHS)
    def test_fbgemm_exact_rowwise_adagrad_c1(self, use_op):
        """With c = 1 the update is FBGEMM's EXACT_ROWWISE_ADAGRAD (weight_decay_mode NONE).

        Per unique row (duplicates summed): momentum1[i] += sum_j(g_ij^2) / D;
        w_i -= lr / (sqrt(momentum1[i]) + eps) * g_i -- the same as `np_rowwise_step`
        with c = 1 and wd = 0. (FBGEMM's *decoupled* weight decay multiplies the pre-step
        weight by (1 - lr * wd); ours decays the post-step weight, so the two agree only
        without weight decay.)
        """
        _require_path(self, use_op)
        lr, eps = 0.3, 1e-4
        rng = np.random.default_rng(11)
        w0 = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
        var = tf.Variable(w0)
        opt = RowWiseAdagrad(learning_rate=lr, epsilon=eps, use_custom_op=use_op)
        w, m1 = w0.astype(np.float64), np.zeros([_ROWS])
        for ids, vals in _sparse_batches(rng, 4, np.float32):
            opt.apply_gradients([(tf.IndexedSlices(tf.constant(vals), tf.constant(ids),
                                                   tf.constant([_ROWS, _DIM])), var)])
            # FBGEMM-style formulation, spelled out separately from np_rowwise_step.
            uniq, inv = np.unique(ids, return_inverse=True)
            g = np.zeros([uniq.size, _DIM])
            np.add.at(g, inv, vals.astype(np.float64))
            m1[uniq] += np.sum(g * g, axis=1) / _DIM
            w[uniq] -= (lr / (np.sqrt(m1[uniq]) + eps))[:, None] * g
            self.assertAllClose(var.numpy(), w, atol=_ATOL, rtol=_RTOL)

    @parameterized.named_parameters(
        *[(f"{p}_{d.__name__}", use_op, d) for p, use_op in _PATHS
          for d in (np.float32, np.float16)])
    def test_dense_2d_gradients(self, use_op, gdtype):
        _require_path(self, use_op)
        lr, eps, wd, c = 0.05, 1e-3, 0.1, 2.0
        rng = np.random.default_rng(3)
        w0 = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
        var = tf.Variable(w0)
        opt = MomentumScaledRowWiseAdagrad(learning_rate=lr, epsilon=eps, weight_decay=wd,
                                           momentum_scale=c, initial_accumulator_value=0.5,
                                           use_custom_op=use_op)
        ref_w, ref_v = w0.astype(np.float64), np.full([_ROWS], 0.5)
        step = tf.function(lambda g: opt.apply_gradients([(g, var)]))
        for i in range(4):
            g = rng.normal(size=(_ROWS, _DIM)).astype(gdtype)
            g[0] = 0  # a zero-gradient row is still "touched": it gets the decay
            (step if i % 2 else lambda x: opt.apply_gradients([(x, var)]))(tf.constant(g))
            ref_w, ref_v = np_rowwise_step(ref_w, ref_v, np.arange(_ROWS),
                                           g.astype(np.float32), lr, eps, c, wd)
            self.assertAllClose(var.numpy(), ref_w, atol=_ATOL, rtol=_RTOL)
            self.assertAllClose(opt.accumulator_of(var).numpy(), ref_v, atol=_ATOL,
                                rtol=_RTOL)
        self.assertEqual(opt.accumulator_of(var).shape, [_ROWS])

    @parameterized.named_parameters(*_PATHS)
    def test_non_2d_variables_use_elementwise_adagrad(self, use_op):
        _require_path(self, use_op)
        lr, eps, wd, c = 0.1, 1e-3, 0.05, 4.0
        rng = np.random.default_rng(5)
        b0 = rng.normal(size=[6]).astype(np.float32)
        s0 = np.float32(1.5)
        k0 = rng.normal(size=[3, 2, 2]).astype(np.float32)
        bias, scalar, kernel = tf.Variable(b0), tf.Variable(s0), tf.Variable(k0)
        opt = MomentumScaledRowWiseAdagrad(learning_rate=lr, epsilon=eps, weight_decay=wd,
                                           momentum_scale=c, initial_accumulator_value=0.1,
                                           use_custom_op=use_op)
        refs = {"b": (b0, np.full([6], 0.1)), "s": (s0, np.float64(0.1)),
                "k": (k0, np.full([3, 2, 2], 0.1))}
        for _ in range(4):
            gb = rng.normal(size=[6]).astype(np.float32)
            gs = np.float32(rng.normal())
            # Sparse gradient of the 3-D variable along axis 0, with a duplicate slice.
            k_ids = np.array([2, 0, 2])
            k_vals = rng.normal(size=[3, 2, 2]).astype(np.float32)
            opt.apply_gradients([
                (tf.constant(gb), bias), (tf.constant(gs), scalar),
                (tf.IndexedSlices(tf.constant(k_vals), tf.constant(k_ids),
                                  tf.constant([3, 2, 2])), kernel)])
            refs["b"] = np_elementwise_step(*refs["b"], gb, lr, eps, c, wd)
            refs["s"] = np_elementwise_step(*refs["s"], gs, lr, eps, c, wd)
            kw, ka = refs["k"]
            kw, ka = kw.astype(np.float64).copy(), ka.copy()
            kg = np.zeros_like(ka)
            np.add.at(kg, k_ids, k_vals.astype(np.float64))
            for i in np.unique(k_ids):
                kw[i], ka[i] = np_elementwise_step(kw[i], ka[i], kg[i], lr, eps, c, wd)
            refs["k"] = (kw, ka)
            for name, var in (("b", bias), ("s", scalar), ("k", kernel)):
                self.assertAllClose(var.numpy(), refs[name][0], atol=_ATOL, rtol=_RTOL)
                self.assertAllClose(opt.accumulator_of(var).numpy(), refs[name][1],
                                    atol=_ATOL, rtol=_RTOL)
        self.assertAllEqual(kernel.numpy()[1], k0[1])  # slice 1 never had a gradient
        self.assertEqual(opt.accumulator_of(bias).shape, [6])

    @parameterized.named_parameters(*_PATHS)
    def test_learning_rate_schedule(self, use_op):
        _require_path(self, use_op)
        schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1,
                                                                  decay_rate=0.5)
        rng = np.random.default_rng(9)
        w0 = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
        var = tf.Variable(w0)
        opt = RowWiseAdagrad(learning_rate=schedule, epsilon=1e-3, use_custom_op=use_op)
        ref_w, ref_v = w0.astype(np.float64), np.zeros([_ROWS])
        for step, (ids, vals) in enumerate(_sparse_batches(rng, 4, np.float32)):
            opt.apply_gradients([(tf.IndexedSlices(tf.constant(vals), tf.constant(ids),
                                                   tf.constant([_ROWS, _DIM])), var)])
            ref_w, ref_v = np_rowwise_step(ref_w, ref_v, ids, vals, 0.1 * 0.5 ** step, 1e-3,
                                           1.0, 0.0)
            self.assertAllClose(var.numpy(), ref_w, atol=_ATOL, rtol=_RTOL)

    def test_exclude_from_weight_decay(self):
        var = tf.Variable(tf.ones([4, 2]), name="no_decay_table")
        opt = RowWiseAdagrad(learning_rate=0.1, weight_decay=0.5, use_custom_op=False)
        opt.exclude_from_weight_decay(var_names=["no_decay"])
        opt.apply_gradients([(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]),
                                               tf.constant([4, 2])), var)])
        self.assertAllClose(var.numpy()[0], [0.9, 0.9], atol=1e-6)  # no 0.5 * 0.1 decay

    def test_base_class_weight_decay_is_off(self):
        opt = RowWiseAdagrad(weight_decay=0.3)
        self.assertIsNone(opt.weight_decay)  # the Keras base must not decay all rows
        self.assertEqual(opt.rowwise_weight_decay, 0.3)
        self.assertEqual(opt.get_config()["weight_decay"], 0.3)
        if KERAS_3:
            # Keras 3 optimizers have no jit_compile (they compile with the model's step);
            # a Keras 2 config that names it still loads
            self.assertNotIn("jit_compile", opt.get_config())
            clone = RowWiseAdagrad.from_config(dict(opt.get_config(), jit_compile=False))
            self.assertEqual(clone.get_config(), opt.get_config())
        else:
            self.assertFalse(opt.jit_compile)

    def test_bad_momentum_scale_attribute(self):
        var = tf.Variable(tf.ones([4, 2]))
        roles.assign(var, momentum_scale=-3.0)
        opt = MomentumScaledRowWiseAdagrad(use_custom_op=False)
        with self.assertRaisesRegex(ValueError, re.escape("-3.0")):
            opt.apply_gradients([(tf.ones([4, 2]), var)])


class ConfigAndValidationTest(tf.test.TestCase):

    def test_get_config_round_trip(self):
        schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
        opts = [
            RowWiseAdagrad(learning_rate=0.25, initial_accumulator_value=0.5, epsilon=1e-3,
                           weight_decay=0.01, name="rw", use_custom_op=False, clipnorm=2.0),
            RowWiseAdagrad(learning_rate=schedule, use_custom_op=True),
            MomentumScaledRowWiseAdagrad(learning_rate=0.5, initial_accumulator_value=0.1,
                                         epsilon=1e-4, weight_decay=0.2, momentum_scale=4.0,
                                         use_custom_op=None),
            MomentumScaledRowWiseAdagrad(),
        ]
        for opt in opts:
            config = opt.get_config()
            clone = type(opt).from_config(opt.get_config())
            self.assertIs(type(clone), type(opt))
            self.assertEqual(clone.get_config(), config)
            # Through the Keras registry too (package "tfhybrid").
            revived = tf.keras.optimizers.deserialize(tf.keras.optimizers.serialize(opt))
            self.assertIs(type(revived), type(opt))
            self.assertEqual(revived.get_config(), config)
        config = opts[0].get_config()
        self.assertEqual((config["learning_rate"], config["initial_accumulator_value"],
                          config["epsilon"], config["weight_decay"], config["use_custom_op"],
                          config["name"], config["clipnorm"]),
                         (0.25, 0.5, 1e-3, 0.01, False, "rw", 2.0))
        # Keras 3 optimizers have no jit_compile: the model's compile decides
        self.assertEqual(config.get("jit_compile"), None if KERAS_3 else False)
        self.assertEqual(opts[2].get_config()["momentum_scale"], 4.0)
        self.assertIsNone(opts[3].get_config()["momentum_scale"])
        # a schedule survives the round trip as the schedule, not its current value
        schedule = opts[1].get_config()["learning_rate"]
        self.assertEqual(schedule["class_name"], "ExponentialDecay")
        self.assertEqual(type(opts[1]).from_config(opts[1].get_config())
                         .get_config()["learning_rate"], schedule)

    def test_bad_args_name_the_value(self):
        bad = [
            (RowWiseAdagrad, dict(learning_rate=0.0), "0.0"),
            (RowWiseAdagrad, dict(learning_rate=-0.5), "-0.5"),
            (RowWiseAdagrad, dict(learning_rate="fast"), "'fast'"),
            (RowWiseAdagrad, dict(epsilon=-1e-3), "-0.001"),
            (RowWiseAdagrad, dict(weight_decay=-0.25), "-0.25"),
            (RowWiseAdagrad, dict(initial_accumulator_value=-2.0), "-2.0"),
            (MomentumScaledRowWiseAdagrad, dict(momentum_scale=0.0), "0.0"),
            (MomentumScaledRowWiseAdagrad, dict(momentum_scale=-4.0), "-4.0"),
            (MomentumScaledRowWiseAdagrad, dict(learning_rate=-7.0), "-7.0"),
        ]
        for cls, kwargs, text in bad:
            with self.assertRaisesRegex(ValueError, re.escape(text), msg=str(kwargs)):
                cls(**kwargs)


# ------------------------------------------------ the same update in Keras 2 and 3
class _Weights(tf.keras.layers.Layer):
    """Keras weights holding given values: what ``fit`` hands an optimizer (in Keras 3 a
    ``keras.Variable`` around a ``tf.Variable``, in Keras 2 a ``tf.Variable``)."""

    def __init__(self, values: dict, **kwargs):
        super().__init__(**kwargs)
        self.values = values
        self.by_name = {}

    def build(self, input_shape=None):
        for name, value in self.values.items():
            weight = self.add_weight(name=name, shape=value.shape, dtype=value.dtype.name,
                                     initializer="zeros")
            weight.assign(value)
            self.by_name[name] = weight
        self.built = True


def _updates_of_every_path() -> dict:
    """Every value and accumulator after each step of each update path of the row-wise
    optimizers (sparse and dense 2-D, element-wise, float16 gradients, float64 tables,
    weight decay, momentum scale by argument and by role, a schedule; eager and traced;
    C++ kernel and pure TF), with the Keras this process runs. Same inputs every run."""
    out = {}
    for path, use_op in _PATHS:
        if use_op and _DISABLED:
            continue
        rng = np.random.default_rng(21)
        values = {"table": rng.normal(size=(_ROWS, _DIM)).astype(np.float32),
                  "dense": rng.normal(size=(_ROWS, _DIM)).astype(np.float32),
                  "wide": rng.normal(size=(_ROWS, _DIM)),   # float64
                  "bias": rng.normal(size=[6]).astype(np.float32),
                  "scalar": np.float32(1.5) * np.ones([], np.float32),
                  "kernel": rng.normal(size=[3, 2, 2]).astype(np.float32)}
        for name, value in values.items():
            out[f"{path}/initial/{name}"] = value
        holder = _Weights(values)
        holder.build()
        w = holder.by_name
        roles.assign(w["dense"], momentum_scale=2.0)
        schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1,
                                                                  decay_rate=0.5)
        optimizers = {
            "table": RowWiseAdagrad(0.05, initial_accumulator_value=0.1, epsilon=1e-3,
                                    weight_decay=0.2, use_custom_op=use_op),
            "table_fp16": MomentumScaledRowWiseAdagrad(0.05, epsilon=1e-3, weight_decay=0.05,
                                                       momentum_scale=4.0,
                                                       use_custom_op=use_op),
            "dense": MomentumScaledRowWiseAdagrad(0.05, initial_accumulator_value=0.5,
                                                  epsilon=1e-3, weight_decay=0.1,
                                                  use_custom_op=use_op),
            "wide": RowWiseAdagrad(0.05, epsilon=1e-3, weight_decay=0.1,
                                   use_custom_op=use_op),
            "others": MomentumScaledRowWiseAdagrad(0.1, initial_accumulator_value=0.1,
                                                   epsilon=1e-3, weight_decay=0.05,
                                                   momentum_scale=4.0, use_custom_op=use_op),
            "schedule": RowWiseAdagrad(schedule, epsilon=1e-3, use_custom_op=use_op),
        }
        for step in range(4):
            ids, vals = _sparse_batches(rng, 1, np.float32)[0]
            shape = tf.constant([_ROWS, _DIM], tf.int64)
            sparse = tf.IndexedSlices(tf.constant(vals), tf.constant(ids), shape)
            half = tf.IndexedSlices(tf.constant(vals.astype(np.float16)), tf.constant(ids),
                                    shape)
            wide = tf.IndexedSlices(tf.constant(vals.astype(np.float64)), tf.constant(ids),
                                    shape)
            dense = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
            dense[0] = 0
            k_vals = rng.normal(size=[3, 2, 2]).astype(np.float32)
            applies = {
                "table": [(sparse, "table")],
                "table_fp16": [(half, "table")],
                "dense": [(tf.constant(dense), "dense")],
                "wide": [(wide, "wide")],
                "others": [(tf.constant(rng.normal(size=[6]).astype(np.float32)), "bias"),
                           (tf.constant(np.float32(rng.normal())), "scalar"),
                           (tf.IndexedSlices(tf.constant(k_vals), tf.constant([2, 0, 2]),
                                             tf.constant([3, 2, 2])), "kernel")],
                "schedule": [(sparse, "table")],
            }
            for name, opt in optimizers.items():
                pairs = [(grad, w[weight]) for grad, weight in applies[name]]
                if step % 2:   # traced steps and eager steps alike
                    tf.function(_applier(opt, pairs))()
                else:
                    opt.apply_gradients(pairs)
                for (_, weight), (_, var) in zip(applies[name], pairs):
                    key = f"{path}/{name}/{weight}/{step}"
                    out[key + "/value"] = var.numpy()
                    out[key + "/accumulator"] = opt.accumulator_of(var).numpy()
        out[f"{path}/iterations"] = np.array([int(o.iterations.numpy())
                                              for o in optimizers.values()])
    return out


def _applier(opt, pairs):
    """A function applying ``pairs`` (closed over: a tf.function's arguments would turn
    the weights into tensors)."""
    return lambda: opt.apply_gradients(pairs)


def _dump_updates(path: str) -> None:
    np.savez(path, **_updates_of_every_path())


class SameUpdateInBothKerasesTest(tf.test.TestCase):
    """Keras 2 (tf-keras) and Keras 3 give the same update, bit for bit: each runs every
    path of the row-wise optimizers on the same inputs in its own process."""

    def test_keras_2_and_keras_3_updates_are_bitwise_equal(self):
        if installed_keras_major() != 3:
            self.skipTest("no Keras 3 installed (TF <= 2.15): nothing to compare with")
        import subprocess
        import sys
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        folder = self.get_temp_dir()
        jobs = {}
        for keras, legacy in ((2, "1"), (3, "0")):
            env = dict(os.environ, TF_USE_LEGACY_KERAS=legacy,
                       PYTHONPATH=os.pathsep.join(
                           [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
            path = os.path.join(folder, f"keras{keras}.npz")
            code = ("import sys, tests.test_optimizers as t; "
                    "import tfhybrid; "
                    f"assert tfhybrid.keras_major() == {keras}, tfhybrid.keras_major(); "
                    "t._dump_updates(sys.argv[1])")
            jobs[keras] = (path, subprocess.Popen(
                [sys.executable, "-c", code, path], cwd=root, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for keras, (path, job) in jobs.items():
            log, _ = job.communicate(timeout=300)
            self.assertEqual(job.returncode, 0, f"Keras {keras}:\n{log[-4000:]}")
        keras2, keras3 = (np.load(jobs[k][0]) for k in (2, 3))
        self.assertEqual(sorted(keras2.files), sorted(keras3.files))
        self.assertGreater(len(keras2.files), 100)
        for key in keras2.files:
            a, b = keras2[key], keras3[key]
            self.assertEqual((a.dtype, a.shape), (b.dtype, b.shape), key)
            self.assertEqual(a.tobytes(), b.tobytes(),
                             f"{key}: Keras 2 {a.ravel()[:6]} != Keras 3 {b.ravel()[:6]}")
        # every path changed its values (else equality would say nothing)
        last = [k for k in keras2.files if k.endswith("/3/value")]
        self.assertLen(last, 2 * 8 if custom_ops_available() and not _DISABLED else 8)
        for key in last:
            path, _, weight = key.split("/")[:3]
            self.assertFalse(np.array_equal(keras2[key], keras2[f"{path}/initial/{weight}"]),
                             key)


def _tiny_model(seed: int) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([
        tf.keras.Input(shape=(3,), dtype=tf.int32),
        tf.keras.layers.Embedding(20, 4, name="emb"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(1, name="out"),
    ])


class KerasFitTest(tf.test.TestCase, parameterized.TestCase):
    """model.compile/fit with the optimizer, then checkpoint save/restore."""

    @parameterized.named_parameters(*_PATHS)
    def test_fit_touches_only_looked_up_rows_and_checkpoints(self, use_op):
        _require_path(self, use_op)
        model = _tiny_model(1)
        emb = model.get_layer("emb").embeddings
        emb0 = emb.numpy().copy()
        opt = MomentumScaledRowWiseAdagrad(learning_rate=0.1, weight_decay=0.01,
                                           initial_accumulator_value=0.25, momentum_scale=2.0,
                                           use_custom_op=use_op)
        model.compile(optimizer=opt, loss="mse")
        rng = np.random.default_rng(0)
        x = rng.integers(0, 12, size=(32, 3)).astype(np.int32)  # ids 12..19 never used
        y = rng.normal(size=(32, 1)).astype(np.float32)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        self.assertEqual(int(opt.iterations.numpy()), 8)

        used = np.unique(x)
        unused = np.setdiff1d(np.arange(20), used)
        self.assertAllEqual(emb.numpy()[unused], emb0[unused])  # weight decay skipped too
        self.assertTrue(np.all(np.abs(emb.numpy()[used] - emb0[used]) > 0))
        acc = opt.accumulator_of(emb)
        self.assertAllEqual(acc.numpy()[unused], np.full([unused.size], 0.25, np.float32))
        self.assertTrue(np.all(acc.numpy()[used] > 0.25))
        # The slot is an optimizer variable ("<var>/accumulator", one value per row).
        self.assertTrue(any(v is acc for v in opt.variables))
        self.assertIn("accumulator", acc.name)
        self.assertEqual(acc.shape, [20])

        prefix = os.path.join(self.get_temp_dir(), f"ckpt_{use_op}")
        path = tf.train.Checkpoint(model=model, optimizer=opt).save(prefix)

        for build_first in (True, False):
            model2 = _tiny_model(2)
            opt2 = MomentumScaledRowWiseAdagrad.from_config(opt.get_config())
            if build_first:
                opt2.build(model2.trainable_variables)
                tf.train.Checkpoint(model=model2, optimizer=opt2).restore(
                    path).assert_consumed()
            else:
                # Deferred restore: slots are created after restore() is called.
                status = tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path)
                opt2.build(model2.trainable_variables)
                status.assert_existing_objects_matched()
            for a, b in zip(model.weights, model2.weights):
                self.assertAllEqual(a.numpy(), b.numpy())
            self.assertLen(opt2.variables, len(opt.variables))
            for a, b in zip(opt.variables, opt2.variables):
                self.assertAllEqual(a.numpy(), b.numpy(), msg=f"{a.name} build_first="
                                    f"{build_first}")

        # The restored pair keeps training identically to the original.
        model2.compile(optimizer=opt2, loss="mse")
        model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
        model2.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
        self.assertAllClose(emb.numpy(), model2.get_layer("emb").embeddings.numpy(),
                            atol=1e-6, rtol=1e-6)


    def test_fit_fuses_the_lookup_backward_with_the_update(self):
        # In fit, a DistributedEmbedding table's gradient reaches the optimizer untouched,
        # so its backward and the row-wise AdaGrad run as one kernel; the result matches
        # the pure-TF path (bitwise equality with the two-kernel route is tested beside
        # the kernels, in tests/test_custom_ops.py).
        _require_path(self, True)
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding, Embedding

        tfhybrid.init(model_parallel=1)
        rng = np.random.default_rng(5)
        x = [rng.integers(0, 500, (64, 4)), rng.integers(0, 300, (64, 3))]
        y = rng.normal(size=(64, 1)).astype(np.float32)
        trained = {}
        for use_op in (True, False):
            tf.keras.utils.set_random_seed(3)
            layer = DistributedEmbedding([Embedding(500, 8, combiner="sum", name="clicks"),
                                          Embedding(300, 8, combiner="mean", name="views")])
            inputs = [tf.keras.Input([4], dtype=tf.int64), tf.keras.Input([3], dtype=tf.int64)]
            out = tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()(layer(inputs)))
            model = tf.keras.Model(inputs, out)
            model.compile(optimizer=tfhybrid.DistributedOptimizer(
                RowWiseAdagrad(0.05, use_custom_op=use_op)), loss="mse")
            model.fit(x, y, batch_size=16, epochs=2, verbose=0)
            trained[use_op] = [w.numpy() for w in model.weights]
            if use_op:
                op_types = traced_op_types(model.train_function)
                # every table lookup's update is fused (a graph may be listed twice)
                lookups = op_types.count("ResourceEmbeddingLookupCombine")
                self.assertGreaterEqual(lookups, 2, sorted(set(op_types)))
                self.assertEqual(op_types.count("EmbeddingLookupCombineGradRowwiseAdagrad"),
                                 lookups, sorted(set(op_types)))
        for fused, pure_tf in zip(trained[True], trained[False]):
            self.assertAllClose(fused, pure_tf, atol=1e-6, rtol=1e-6)

if __name__ == "__main__":
    tf.test.main()
