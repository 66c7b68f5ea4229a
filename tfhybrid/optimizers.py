"""Row-wise AdaGrad optimizers for embedding tables (Keras 2 and Keras 3 ``Optimizer``).

Public API::

    RowWiseAdagrad(learning_rate=0.01, initial_accumulator_value=0.0, epsilon=1e-8,
                   weight_decay=0.0, name="RowWiseAdagrad", *, use_custom_op=None,
                   jit_compile=False, **kwargs)
    MomentumScaledRowWiseAdagrad(..., momentum_scale=None, ...)

Both subclass the *new* ``tf.keras.optimizers.Optimizer`` (not Keras 2's legacy one),
through ``_tf_internals.OptimizerBase``, which names what Keras 2 and 3 call differently. The sparse
update is :func:`tfhybrid.custom_ops.rowwise_adagrad_apply` (FBGEMM
``EXACT_ROWWISE_ADAGRAD``), which runs a fused C++ kernel on CPU when the custom-op library
is available and a pure-TF fallback otherwise.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals  # first: checks which Keras tf.keras is
from tfhybrid import roles
from tfhybrid.custom_ops import custom_ops_available, rowwise_adagrad_apply
from tfhybrid.optimizer_traits import Trains, advertises

# the slot name of the row-wise optimizers' per-row state ("<var>/accumulator"), also
# the one slot a FIITED pool or a tiered table holds (their checkpoints use it)
ROW_STATE_SLOT = "accumulator"

__all__ = ["RowWiseAdagrad", "MomentumScaledRowWiseAdagrad"]

_LOG = logging.getLogger(__name__)

_LearningRateSchedule = tf.keras.optimizers.schedules.LearningRateSchedule



def _is_real_number(x: Any) -> bool:
    # bool is an int subclass; True as a learning rate is almost surely a bug.
    return isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(
        x, (bool, np.bool_))


def _check_non_negative(name: str, value: Any) -> float:
    if not _is_real_number(value) or not math.isfinite(float(value)) or float(value) < 0:
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
    return float(value)


def _check_learning_rate(value: Any) -> Any:
    if isinstance(value, _LearningRateSchedule):
        return value
    if not _is_real_number(value) or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError("learning_rate must be a finite float > 0 or a "
                         f"tf.keras.optimizers.schedules.LearningRateSchedule, got {value!r}")
    return float(value)


def _check_momentum_scale(value: Any, what: str = "momentum_scale") -> float:
    if not _is_real_number(value) or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{what} must be a finite float > 0, got {value!r}")
    return float(value)


@tf.keras.utils.register_keras_serializable(package="tfhybrid")
@advertises(Trains.ROW_STATE)
class RowWiseAdagrad(_tf_internals.OptimizerBase):
    """Exact row-wise AdaGrad (FBGEMM ``EXACT_ROWWISE_ADAGRAD``) for embedding tables.

    For every 2-D variable ``w`` of shape ``[rows, d]`` the optimizer keeps ONE float32
    accumulator per row (slot ``"<var>/accumulator"``, shape ``[rows]``). For each updated
    row ``i`` with gradient row ``g_i`` (duplicate sparse ids are summed first)::

        v_i += mean_j(g_ij ** 2)
        w_i -= lr * g_i / (sqrt(v_i / c) + epsilon)
        if weight_decay > 0:
            w_i -= lr * weight_decay * w_i        # decoupled, after the step

    ``c`` (the momentum scale) is 1 here; see :class:`MomentumScaledRowWiseAdagrad`.

    * ``tf.IndexedSlices`` gradients (embedding lookups) update, and decay, ONLY the rows
      they name; all other rows and their accumulators stay bit-for-bit unchanged.
    * Dense gradients of a 2-D variable touch every row, so every row is updated and
      decayed (a zero gradient row still gets the weight decay).
    * Variables that are not 2-D (biases, scalars, conv kernels) fall back to element-wise
      AdaGrad with an accumulator of the variable's shape:
      ``acc += g**2; w -= lr * g / (sqrt(acc / c) + epsilon)``, then the same decay.

    Weight decay is handled here, not by the Keras base class (whose ``weight_decay``
    decays *every* row of every variable on each step); ``exclude_from_weight_decay()``
    is honoured. ``jit_compile`` defaults to False because the fused C++ kernel (and the
    ``tf.unique``-based dedup) cannot be XLA-compiled; Keras ignores ``jit_compile=True``
    on CPU-only machines anyway. For the same reason do not pass ``jit_compile=True`` to
    ``model.compile`` (its default in TF 2.15 does not XLA-compile on CPU).

    Args:
      learning_rate: float > 0 or a ``LearningRateSchedule``.
      initial_accumulator_value: float >= 0, the accumulators' initial value.
      epsilon: float >= 0 added to the denominator.
      weight_decay: float >= 0, decoupled weight decay (touched rows only).
      name: optimizer name.
      use_custom_op: None (auto: C++ kernel when available and the variable is on CPU),
        True (require the kernel) or False (pure TF); forwarded to
        ``tfhybrid.custom_ops.rowwise_adagrad_apply``.
      jit_compile: defaults to False (see above).
      **kwargs: the other Keras base-optimizer arguments (clipnorm, clipvalue,
        global_clipnorm, use_ema, ...).

    Example::

        import tensorflow as tf
        from tfhybrid.optimizers import RowWiseAdagrad
        table = tf.Variable(tf.ones([4, 2]))
        opt = RowWiseAdagrad(learning_rate=0.1)
        grad = tf.IndexedSlices(tf.constant([[1.0, 1.0]]), tf.constant([2]),
                                tf.constant([4, 2]))
        opt.apply_gradients([(grad, table)])
        # row 2 -> 1 - 0.1 * 1 / (sqrt(1) + 1e-8) = 0.9; rows 0, 1, 3 unchanged
        print(table.numpy())
    """

    def __init__(self, learning_rate=0.01, initial_accumulator_value=0.0, epsilon=1e-8,
                 weight_decay=0.0, name="RowWiseAdagrad", *, use_custom_op: bool | None = None,
                 jit_compile: bool = False, **kwargs):
        learning_rate = _check_learning_rate(learning_rate)
        initial_accumulator_value = _check_non_negative("initial_accumulator_value",
                                                        initial_accumulator_value)
        epsilon = _check_non_negative("epsilon", epsilon)
        # A config from get_config() round-trips weight_decay=0.0; None means "no decay" too.
        weight_decay = _check_non_negative("weight_decay",
                                           0.0 if weight_decay is None else weight_decay)
        if use_custom_op not in (None, True, False):
            raise ValueError(f"use_custom_op must be None, True or False, got {use_custom_op!r}")
        # weight_decay=None keeps the base class from decaying every row of every variable
        # in apply_gradients(); our decay runs inside update_step on touched rows only.
        super().__init__(learning_rate, name=name, weight_decay=None,
                         jit_compile=jit_compile, **kwargs)
        self.initial_accumulator_value = initial_accumulator_value
        self.epsilon = epsilon
        self.rowwise_weight_decay = weight_decay
        self.use_custom_op = use_custom_op

    # ------------------------------------------------------------------ state
    def build(self, var_list):
        """Creates one accumulator per variable (per row for 2-D variables)."""
        if getattr(self, "_accumulators", None) is not None:
            return
        super().build(var_list)
        self._accumulators = [self._add_accumulator(var) for var in var_list]

    def accumulator_of(self, variable: tf.Variable) -> tf.Variable:
        """The squared-gradient accumulator of ``variable`` (one value per row of a 2-D
        variable; for a FIITED pool or a tiered cache, the one its table keeps)."""
        return self._accumulators[self.state_index(variable)]

    def _add_accumulator(self, var: tf.Variable) -> tf.Variable:
        kept = roles.role_of(var).row_accumulator
        if kept is not None:
            # the table keeps its rows' accumulators (a FIITED pool's one per logical row
            # whatever its chunks do; a tiered cache's, which move with their rows between
            # the cache and the store); tracked here so the optimizer saves them too
            self.track_state(kept)
            return kept
        if var.shape.rank == 2:
            shape = [var.shape[0] if var.shape[0] is not None else tf.shape(var)[0]]
        else:
            shape = tf.shape(var) if not var.shape.is_fully_defined() else var.shape
        # float32 state even for float16/bfloat16 variables: accumulated squares overflow
        # and lose precision in half types (float64 variables keep float64).
        dtype = tf.float64 if var.dtype == tf.float64 else tf.float32
        return self.add_state(var, ROW_STATE_SLOT, shape, dtype,
                              self.initial_accumulator_value)

    # ----------------------------------------------------------- base hooks
    def _deduplicate_sparse_grad(self, grads):
        # The base class sums duplicate sparse ids with unsorted_segment_sum in the
        # gradient dtype, i.e. in float16 for half gradients. rowwise_adagrad_apply (and
        # our element-wise fallback) sum duplicates themselves, in float32, so skip it.
        return list(grads)

    def _apply_weight_decay(self, variables):
        # Belt and braces: the base class must never decay whole variables (see __init__).
        return

    def _momentum_scale(self, variable) -> float:
        """The scale c in sqrt(v / c) for `variable`; always 1 for RowWiseAdagrad."""
        del variable
        return 1.0

    # ---------------------------------------------------------------- update
    def apply_step(self, gradient, variable, learning_rate):
        """Applies one row-wise (2-D) or element-wise (other ranks) AdaGrad step."""
        variable = _tf_internals.tf_variable(variable)
        accumulator = _tf_internals.tf_variable(self.accumulator_of(variable))
        lr = tf.cast(learning_rate, tf.float32)
        scale = self._momentum_scale(variable)  # Python float, fixed at trace time
        wd = self.rowwise_weight_decay if self._use_weight_decay(variable) else 0.0
        stepper = roles.role_of(variable).row_step
        if stepper is not None:
            return stepper.apply_pool_gradient(gradient, lr, self.epsilon, scale, wd)
        if variable.shape.rank == 2:
            if isinstance(gradient, tf.IndexedSlices):
                return self._sparse_rowwise(variable, accumulator, gradient, lr, scale, wd)
            return self._dense_rowwise(variable, accumulator, gradient, lr, scale, wd)
        return self._elementwise(variable, accumulator, gradient, lr, scale, wd)

    def _sparse_rowwise(self, var, acc, grad: tf.IndexedSlices, lr, scale: float, wd: float):
        if var.dtype == tf.float32:
            return rowwise_adagrad_apply(var, acc, grad.indices, grad.values, lr, self.epsilon,
                                         scale=scale, weight_decay=wd,
                                         use_custom_op=self.use_custom_op)
        # The op wants float32 tables; other dtypes take the same math through the
        # element-wise helper on the touched rows.
        indices, values = _sum_duplicates(grad.indices, grad.values)
        g = tf.cast(values, acc.dtype)
        v = tf.gather(acc, indices) + tf.reduce_mean(tf.square(g), axis=1)
        w = tf.cast(tf.gather(var, indices), acc.dtype)
        w = _step(w, g, (tf.sqrt(v / scale) + self.epsilon)[:, None], lr, wd, acc.dtype)
        acc.scatter_update(tf.IndexedSlices(v, indices))
        var.scatter_update(tf.IndexedSlices(tf.cast(w, var.dtype), indices))

    def _dense_rowwise(self, var, acc, grad, lr, scale: float, wd: float):
        grad = tf.convert_to_tensor(grad)
        kernel_possible = (var.dtype == tf.float32 and self.use_custom_op is not False
                           and (self.use_custom_op or custom_ops_available()))
        if kernel_possible:
            # Every row is touched: the fused kernel on all rows is one pass over the table.
            rows = tf.shape(var, out_type=tf.int64)[0]
            return rowwise_adagrad_apply(var, acc, tf.range(rows), grad, lr, self.epsilon,
                                         scale=scale, weight_decay=wd,
                                         use_custom_op=self.use_custom_op)
        # Pure TF: plain dense math (no sort/unique/scatter needed when all rows change).
        g = tf.cast(grad, acc.dtype)
        v = acc + tf.reduce_mean(tf.square(g), axis=1)
        w = _step(tf.cast(var, acc.dtype), g, (tf.sqrt(v / scale) + self.epsilon)[:, None],
                  lr, wd, acc.dtype)
        acc.assign(v)
        var.assign(tf.cast(w, var.dtype))

    def _elementwise(self, var, acc, grad, lr, scale: float, wd: float):
        if isinstance(grad, tf.IndexedSlices):
            # Slices along axis 0 of an N-D (N != 2) variable: update those slices only.
            indices, values = _sum_duplicates(grad.indices, grad.values)
            g = tf.cast(values, acc.dtype)
            v = tf.gather(acc, indices) + tf.square(g)
            w = tf.cast(tf.gather(var, indices), acc.dtype)
            w = _step(w, g, tf.sqrt(v / scale) + self.epsilon, lr, wd, acc.dtype)
            acc.scatter_update(tf.IndexedSlices(v, indices))
            var.scatter_update(tf.IndexedSlices(tf.cast(w, var.dtype), indices))
            return
        g = tf.cast(grad, acc.dtype)
        v = acc + tf.square(g)
        w = _step(tf.cast(var, acc.dtype), g, tf.sqrt(v / scale) + self.epsilon, lr, wd,
                  acc.dtype)
        acc.assign(v)
        var.assign(tf.cast(w, var.dtype))

    # ---------------------------------------------------------------- config
    def get_config(self) -> dict:
        config = super().get_config()
        config.update({
            "initial_accumulator_value": self.initial_accumulator_value,
            "epsilon": self.epsilon,
            "weight_decay": self.rowwise_weight_decay,
            "use_custom_op": self.use_custom_op,
        })
        return config


@tf.keras.utils.register_keras_serializable(package="tfhybrid")
class MomentumScaledRowWiseAdagrad(RowWiseAdagrad):
    """Row-wise AdaGrad whose accumulator is divided by a momentum scale ``c``.

    Same update as :class:`RowWiseAdagrad` but with ``w_i -= lr * g_i / (sqrt(v_i / c) +
    epsilon)``. ``c`` is ``momentum_scale`` when given; when None it is read per variable
    (at trace time, as a Python float) from the variable's role
    (``tfhybrid.roles.role_of(variable).momentum_scale``), which
    ``tfhybrid.layers.DistributedEmbedding`` sets to the number of data-parallel replicas
    D on its shard variables in weight-sync mode; variables without it use 1. Changing
    it after a ``tf.function`` has traced the step needs a retrace.

    Args:
      momentum_scale: None or a float > 0.
      (others as in :class:`RowWiseAdagrad`)

    Example::

        import tensorflow as tf
        from tfhybrid import roles
        from tfhybrid.optimizers import MomentumScaledRowWiseAdagrad
        table = tf.Variable(tf.ones([4, 2]))
        roles.assign(table, momentum_scale=4.0)   # what DistributedEmbedding would set
        opt = MomentumScaledRowWiseAdagrad(learning_rate=0.1)
        grad = tf.IndexedSlices(tf.constant([[1.0, 1.0]]), tf.constant([1]),
                                tf.constant([4, 2]))
        opt.apply_gradients([(grad, table)])
        # row 1 -> 1 - 0.1 * 1 / (sqrt(1 / 4) + 1e-8) = 0.8
        print(table.numpy())
    """

    def __init__(self, learning_rate=0.01, initial_accumulator_value=0.0, epsilon=1e-8,
                 weight_decay=0.0, momentum_scale=None, name="MomentumScaledRowWiseAdagrad",
                 *, use_custom_op: bool | None = None, jit_compile: bool = False, **kwargs):
        if momentum_scale is not None:
            momentum_scale = _check_momentum_scale(momentum_scale)
        super().__init__(learning_rate=learning_rate,
                         initial_accumulator_value=initial_accumulator_value, epsilon=epsilon,
                         weight_decay=weight_decay, name=name, use_custom_op=use_custom_op,
                         jit_compile=jit_compile, **kwargs)
        self.momentum_scale = momentum_scale

    def _momentum_scale(self, variable) -> float:
        if self.momentum_scale is not None:
            return self.momentum_scale
        value = _momentum_scale_role(variable)
        if value is None:
            return 1.0
        return _check_momentum_scale(
            value, f"the momentum_scale role of variable "
                   f"{getattr(variable, 'name', variable)!r}")

    def get_config(self) -> dict:
        config = super().get_config()
        config["momentum_scale"] = self.momentum_scale
        return config


# ----------------------------------------------------------------- helpers
def _momentum_scale_role(variable) -> Any:
    """The momentum scale recorded for `variable`, or for its tf.distribute container
    (strategies hand update_step the per-device component, which has no role)."""
    for candidate in [variable] + _tf_internals.distributed_containers(variable):
        value = roles.role_of(candidate).momentum_scale
        if value is not None:
            return value
    return None


def _sum_duplicates(indices: tf.Tensor, values: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(unique indices, float32/64 values summed per index, in input order)."""
    compute = tf.float64 if values.dtype == tf.float64 else tf.float32
    unique, pos = tf.unique(indices)
    summed = tf.math.unsorted_segment_sum(tf.cast(values, compute), pos, tf.size(unique))
    return unique, summed


def _step(w: tf.Tensor, g: tf.Tensor, denom: tf.Tensor, lr, wd: float, dtype) -> tf.Tensor:
    """AdaGrad step then decoupled decay, the order rowwise_adagrad_apply uses."""
    lr = tf.cast(lr, dtype)
    w = w - lr * g / denom
    if wd > 0:
        w = w - lr * tf.cast(wd, dtype) * w
    return w
