"""Dynamic Communication Thresholding (DCT; Gupta et al., KDD 2021, arXiv 2010.08899).

DCT cuts both kinds of hybrid-parallel traffic with a hard threshold:

- **DCT-DP** (the data-parallel gradient sync, ``GradientThresholder``): each rank keeps,
  per dense gradient, only the entries with ``|g| >= tau`` and sends them as (index,
  value) pairs; what it does not send stays in a per-rank *residual* that is added to
  the next step's gradient (error feedback), so an update is delayed, never lost. ``tau``
  is the ``dp_keep`` quantile of ``|g + residual|`` (a top-k), recomputed every
  ``refresh_every`` steps and reused in between (one compare per entry), unless the
  entries above it grow past ``KEPT_DRIFT`` times the target: residuals grow while a
  threshold stands still, and the kept share (so the bytes) would creep up. Whether the
  kept entries go as an allgather of pairs or in the dense allreduce is decided by bytes,
  with the planner's one rule (``planner.sync_is_sparse``).
- **DCT-MP** (the embedding alltoall, ``keep_largest`` / ``scatter_kept``): each sample's
  vector of looked-up rows that an owner returns keeps only its ``ceil(mp_keep * width)``
  largest-magnitude entries, sent as values plus their positions in the smallest integer
  type that holds them; the receiver rebuilds the vector with zeros elsewhere. The
  backward alltoall then carries the gradient at exactly those positions: it is the
  gradient of the same gather and scatter (the forward's mask, by construction).

``DCT`` is the one configuration object: pass it to ``DistributedEmbedding(dct=...)``
(its ``mp_keep``) and to ``DistributedOptimizer(dct=...)`` or
``DistributedGradientTape(..., optimizer=..., dct=...)`` (its ``dp_keep`` and
``refresh_every``). Off (``None``) by default.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid.plan.traffic import sync_is_sparse


@dataclasses.dataclass(frozen=True)
class DCT:
    """What DCT keeps. ``None`` turns a half off.

    - ``dp_keep``: the share of each data-parallel gradient's entries a rank sends per
      step (the top ``dp_keep`` by magnitude at each threshold refresh), in (0, 1];
    - ``mp_keep``: the share of each sample's embedding vector an owner returns through
      the alltoall (per sample, the largest ``ceil(mp_keep * width)`` entries), in (0, 1];
    - ``refresh_every``: steps between recomputations of the data-parallel threshold.

    The defaults cut the bytes each rank sends, index overhead included, >= 110x for
    data-parallel gradients (at most ``KEPT_DRIFT * dp_keep * (4 + 4)`` bytes per entry
    against 4: 167x right after a refresh) and >= 20x for the alltoall's rows and their
    gradients at 40 or more values per sample and owner (per kept 4-byte value a 1-byte
    position forward, the value alone backward).

    Example::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.compression import DCT
        tfhybrid.init(model_parallel=1)
        dct = DCT(dp_keep=0.01, mp_keep=0.05, refresh_every=1000)
        opt = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), dct=dct)
        assert DCT.from_config(dct.get_config()) == dct
    """

    dp_keep: float | None = 0.003
    mp_keep: float | None = 0.02
    refresh_every: int = 2000

    def __post_init__(self) -> None:
        for name in ("dp_keep", "mp_keep"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                    0.0 < value <= 1.0):
                raise ValueError(f"{name}={value!r} must be a fraction in (0, 1] or None")
            object.__setattr__(self, name, float(value))   # numpy scalars: plain data
        every = self.refresh_every
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(f"refresh_every={every!r} must be an int >= 1 (steps)")
        object.__setattr__(self, "refresh_every", int(every))

    def get_config(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DCT:
        unknown = set(config) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown DCT settings {sorted(unknown)} in {dict(config)!r}")
        return cls(**config)


def as_dct(value: Any) -> DCT | None:
    """``None``, a ``DCT`` or its config dict (a layer's ``get_config``) -> DCT or None."""
    if value is None or isinstance(value, DCT):
        return value
    # a config dict, also as Keras's tracking wrapper of one (a model's attribute)
    if isinstance(value, Mapping) or callable(getattr(value, "keys", None)):
        return DCT.from_config(dict(value))
    raise ValueError(f"dct={value!r} must be a tfhybrid.compression.DCT, its config dict or "
                     "None")


# a threshold is recomputed early once this many times the target entries pass it
KEPT_DRIFT = 1.5


def kept_count(size: int | tf.Tensor, keep: float) -> int | tf.Tensor:
    """How many of ``size`` entries a keep fraction sends (at least one of a non-empty
    row). ``size`` may be an integer tensor (a width known only at run time); the count
    is then an int64 tensor, computed in float64 as the integer case is."""
    if isinstance(size, int):
        return max(1, min(size, math.ceil(keep * size))) if size else 0
    size = tf.cast(size, tf.int64)
    count = tf.cast(tf.math.ceil(keep * tf.cast(size, tf.float64)), tf.int64)
    return tf.where(size > 0, tf.maximum(tf.constant(1, tf.int64), tf.minimum(size, count)),
                    tf.constant(0, tf.int64))


def may_drop(size: int | tf.Tensor, keep: float) -> bool:
    """Whether a keep fraction can leave out any of ``size`` entries: for a width known
    only at run time, whenever it is below 1."""
    if isinstance(size, int):
        return kept_count(size, keep) < size
    return keep < 1.0


# ------------------------------------------------------------------ DCT-DP
class GradientThresholder:
    """DCT-DP's state and selection for the gradient route (tfhybrid.distributed).

    Per variable it holds the residual (what was not sent yet, in float32 whatever the
    gradient's dtype, so that small entries add up) and the current threshold; one
    counter schedules the refreshes. The state is per rank and lives as long as the
    optimizer's route; checkpoints do not hold it (a restored job starts with empty
    residuals: the entries still waiting in them at the save are dropped).

    ``select`` stages each variable's new residual and threshold; ``commit`` stores them
    once the route knows whether the step is applied, so a step the loss-scale optimizer
    skips (an overflow on any rank) leaves every residual as it was, and nothing it held
    is lost.
    """

    def __init__(self, dct: DCT):
        if dct.dp_keep is None:
            raise ValueError("GradientThresholder needs a DCT with dp_keep set")
        self.dct = dct
        self._residuals: dict[Any, tf.Variable] = {}
        self._thresholds: dict[Any, tf.Variable] = {}
        self._steps: tf.Variable | None = None
        # (residual, its new value, threshold, its new value) of this step's selections
        self._staged: list[tuple[tf.Variable, tf.Tensor, tf.Variable, tf.Tensor]] = []

    def _state(self, variable: tf.Variable) -> tuple[tf.Variable, tf.Variable]:
        variable = _tf_internals.tf_variable(variable)
        key = variable.ref()
        if key not in self._residuals:
            base = variable.name.split(":")[0].replace("/", "_")
            with tf.init_scope(), tf.device(variable.device or None):
                self._residuals[key] = tf.Variable(
                    tf.zeros(variable.shape, tf.float32), trainable=False,
                    name=base + "_dct_residual")
                self._thresholds[key] = tf.Variable(
                    0.0, dtype=tf.float32, trainable=False, name=base + "_dct_threshold")
        return self._residuals[key], self._thresholds[key]

    def residual(self, variable: tf.Variable) -> tf.Variable:
        """The residual of ``variable`` (created on first use)."""
        return self._state(variable)[0]

    def begin_step(self) -> tf.Tensor:
        """Advances the step counter; True on the steps that recompute thresholds (the
        first, then every ``refresh_every``-th)."""
        if self._steps is None:
            with tf.init_scope():
                self._steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                          name="tfhybrid_dct_steps")
        step = self._steps.assign_add(1) - 1
        return tf.equal(step % self.dct.refresh_every, 0)

    def kept(self, variable: tf.Variable) -> int:
        return kept_count(variable.shape.num_elements(), self.dct.dp_keep)

    def goes_sparse(self, variable: tf.Variable, group_size: int) -> bool:
        """Whether the variable's gradient is thresholded at all: its kept entries travel
        as (index, value) pairs when the planner's bytes rule (one value per index) says
        pairs are cheaper than the dense allreduce. Otherwise the dense allreduce goes
        as it is (thresholding would delay entries and save no bytes). Static, so every
        rank decides alike."""
        return sync_is_sparse(variable.shape.num_elements(), 1,
                              self.kept(variable), group_size)

    def select(self, grad: tf.Tensor, variable: tf.Variable, refresh: tf.Tensor,
               loss_scale: tf.Tensor | None = None) -> tuple[tf.Tensor, tf.Tensor]:
        """(mask, entries): which entries of ``grad + residual`` to send, and those
        entries (flat, in ``grad``'s dtype). Stages the residual (the entries not sent)
        for ``commit``.

        Entries of magnitude zero are never sent (they carry nothing, and a threshold of
        zero would otherwise send every entry). ``loss_scale``: the gradient is scaled by
        it (a tape under loss scaling); the threshold and the residual are kept unscaled,
        and the entries are returned scaled again. On an overflow (a non-finite entry)
        one non-finite entry is sent with the kept ones, so every rank learns of it as
        through a dense allreduce, and the staged state is the old one.
        """
        residual, threshold = self._state(variable)
        flat = tf.cast(tf.reshape(grad, [-1]), tf.float32)
        if loss_scale is not None:
            flat = flat / tf.cast(loss_scale, tf.float32)
        total = flat + tf.reshape(residual, [-1])
        finite = tf.math.is_finite(total)
        magnitude = tf.where(finite, tf.abs(total), tf.zeros_like(total))
        k = self.kept(variable)

        def refreshed():
            # the k-th largest magnitude: keeps the top dp_keep of this gradient
            return tf.math.top_k(magnitude, k, sorted=True).values[k - 1]

        if k >= variable.shape.num_elements():
            tau = tf.zeros([], tf.float32)     # keep everything, whatever came before
        else:
            stale = threshold.read_value()
            passing = tf.logical_and(magnitude >= stale, magnitude > 0)
            drifted = tf.reduce_sum(tf.cast(passing, tf.int64)) > int(KEPT_DRIFT * k)
            tau = tf.cond(tf.logical_or(refresh, drifted), refreshed, lambda: stale)
        all_finite = tf.reduce_all(finite)
        first_overflow = tf.one_hot(tf.argmax(tf.cast(tf.logical_not(finite), tf.int32)),
                                    tf.size(total), on_value=True, off_value=False)
        mask = tf.logical_or(tf.logical_and(magnitude >= tau, magnitude > 0),
                             tf.logical_and(first_overflow, tf.logical_not(all_finite)))
        left = tf.reshape(tf.where(mask, tf.zeros_like(total), total), residual.shape)
        self._staged.append((residual, tf.where(all_finite, left, residual),
                             threshold, tf.where(all_finite, tau, threshold)))
        sent = tf.where(mask, total, tf.zeros_like(total))
        if loss_scale is not None:
            sent = sent * tf.cast(loss_scale, tf.float32)
        return mask, tf.cast(sent, grad.dtype)

    @property
    def staged(self) -> bool:
        """Whether ``select`` ran since the last ``commit``."""
        return bool(self._staged)

    def commit(self, applied: tf.Tensor) -> None:
        """Stores the staged residuals and thresholds if ``applied`` (the step's synced
        gradients are finite on every rank), else keeps the old ones."""
        for residual, left, threshold, tau in self._staged:
            residual.assign(tf.where(applied, left, residual))
            threshold.assign(tf.where(applied, tau, threshold))
        self._staged = []


def scatter_sum(values: tf.Tensor, indices: tf.Tensor, shape: Any) -> tf.Tensor:
    """The dense tensor of ``shape`` whose flat entries are the sums of ``values`` at
    ``indices`` (several ranks' pairs, gathered)."""
    size = tf.TensorShape(shape).num_elements()
    summed = tf.math.unsorted_segment_sum(values, indices, size)
    return tf.reshape(summed, shape)


# ------------------------------------------------------------------ DCT-MP
def position_dtype(width: int | None) -> tf.DType:
    """The smallest integer type Horovod's alltoall moves that holds 0 .. width - 1
    (``None``: a width known only at run time, which any position may reach)."""
    if width is None:
        return tf.int32
    if width <= 256:
        return tf.uint8
    if width <= 1 << 15:
        return tf.int16
    return tf.int32


def keep_largest(rows: tf.Tensor, keep: float) -> tuple[tf.Tensor, tf.Tensor]:
    """Per row of ``rows`` ([..., width]) its ``kept_count(width, keep)`` largest-magnitude
    entries: (values [..., k], positions [..., k] as ``position_dtype(width)``).

    The values are a gather of ``rows``, so their gradient lands at the same positions.
    Ties go to the lower position (``tf.math.top_k``'s order), so every run picks alike.
    """
    width = rows.shape[-1]
    k = kept_count(width if width is not None else tf.shape(rows)[-1], keep)
    positions = tf.math.top_k(tf.abs(tf.stop_gradient(rows)),
                              k if isinstance(k, int) else tf.cast(k, tf.int32),
                              sorted=False).indices
    values = tf.gather(rows, positions, batch_dims=len(rows.shape) - 1)
    return values, tf.cast(positions, position_dtype(width))


def scatter_kept(values: tf.Tensor, positions: tf.Tensor, width: int) -> tf.Tensor:
    """``keep_largest``'s inverse: rows of ``width`` with ``values`` at ``positions`` and
    zeros elsewhere. Its gradient is the gather at ``positions`` (the forward's mask)."""
    lead = tf.shape(values, out_type=tf.int64)[:-1]
    k = tf.shape(values, out_type=tf.int64)[-1]
    width = tf.cast(width, tf.int64)
    flat_values = tf.reshape(values, [-1])
    rows = tf.reduce_prod(lead)
    # the flat index of each kept entry: its row * width + its position
    row_of = tf.repeat(tf.range(rows), k)
    index = row_of * width + tf.cast(tf.reshape(positions, [-1]), tf.int64)
    dense = tf.scatter_nd(index[:, None], flat_values, tf.reshape(rows * width, [1]))
    return tf.reshape(dense, tf.concat([lead, [width]], 0))
