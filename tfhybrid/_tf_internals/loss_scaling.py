"""Loss scaling as each Keras does it: Keras 2's ``LossScaleOptimizer`` takes unscaled
gradients, Keras 3's the gradients of the scaled loss; the route reads the scale and
applies unscaled gradients through these."""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tfhybrid._tf_internals.versions import KERAS_3


# Keras 2's LossScaleOptimizer takes gradients already unscaled (the user, or its own
# ``minimize``, calls ``get_unscaled_gradients``); Keras 3's takes the gradients of the
# scaled loss and unscales them in ``apply``, as does any Keras 3 optimizer with a fixed
# ``loss_scale_factor`` (Keras 3's form of Keras 2's ``dynamic=False``).
def is_loss_scale_optimizer(optimizer: Any) -> bool:
    return isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)


def loss_scale(optimizer: Any) -> Any:
    """The factor ``optimizer`` scales losses by now, or None when it scales none.
    Keras 2: a LossScaleOptimizer's ``loss_scale``. Keras 3: a LossScaleOptimizer's
    ``dynamic_scale`` (a variable made by ``build``; ``initial_scale`` before, which is
    what its ``scale_loss`` uses then), else the optimizer's ``loss_scale_factor``."""
    if optimizer is None:
        return None
    if not KERAS_3:
        return optimizer.loss_scale if is_loss_scale_optimizer(optimizer) else None
    if is_loss_scale_optimizer(optimizer):
        return optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale
    return getattr(optimizer, "loss_scale_factor", None)


def applied_gradient_scale(optimizer: Any, variables: list | None = None) -> Any:
    """The factor the gradients handed to ``optimizer.apply_gradients`` carry (None:
    they are unscaled). Keras 2: None (its LossScaleOptimizer is handed unscaled
    gradients). Keras 3: ``loss_scale(optimizer)``; a LossScaleOptimizer not yet built
    is built for ``variables`` first, as its ``apply`` would, so the scale read is the
    variable its step updates."""
    if not KERAS_3:
        return None
    if is_loss_scale_optimizer(optimizer) and not optimizer.built:
        if variables is None:
            raise ValueError(f"{optimizer!r} is not built: pass the variables it applies to")
        with tf.keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(list(variables))
        optimizer.built = True
    return loss_scale(optimizer)


def scaled_loss(optimizer: Any, loss: Any) -> Any:
    """``loss`` times ``optimizer``'s loss scale, to take gradients of (Keras 2:
    ``get_scaled_loss`` of a LossScaleOptimizer; Keras 3: ``scale_loss``)."""
    if KERAS_3:
        return optimizer.scale_loss(loss)
    return optimizer.get_scaled_loss(loss) if is_loss_scale_optimizer(optimizer) else loss


def gradients_to_apply(optimizer: Any, grads: list) -> list:
    """The gradients of ``scaled_loss`` as ``optimizer.apply_gradients`` takes them:
    Keras 2 unscaled (``get_unscaled_gradients``); Keras 3 as they are (its optimizers
    unscale in ``apply``)."""
    if KERAS_3 or not is_loss_scale_optimizer(optimizer):
        return list(grads)
    return optimizer.get_unscaled_gradients(grads)


def apply_unscaled(optimizer: Any, apply: Callable[..., Any], pairs: list, *args: Any,
                   **kwargs: Any) -> Any:
    """Applies (gradient, variable) ``pairs`` already divided by
    ``applied_gradient_scale(optimizer)``; ``apply`` is ``optimizer``'s own
    ``apply_gradients``. Keras 2, or no scale: ``apply(pairs, ...)``.

    Keras 3's own ``apply`` would divide them again, so its steps run here: a
    LossScaleOptimizer's as Keras 3's ``LossScaleOptimizer.apply`` runs them (all
    gradients finite: the inner optimizer applies them, and after
    ``dynamic_growth_steps`` finite steps in a row the scale doubles; else the step is
    skipped, ``iterations`` stays and the scale halves); an optimizer with a
    ``loss_scale_factor`` applies them with the factor off for the call.
    """
    if applied_gradient_scale(optimizer) is None:
        return apply(pairs, *args, **kwargs)
    if not is_loss_scale_optimizer(optimizer):
        factor = optimizer.loss_scale_factor
        optimizer.loss_scale_factor = None
        try:
            return apply(pairs, *args, **kwargs)
        finally:
            optimizer.loss_scale_factor = factor
    grads = [g for g, _ in pairs]

    def finite_step():
        optimizer.inner_optimizer.apply_gradients(pairs)
        grow = tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1)

        def doubled():
            optimizer.step_counter.assign(0)
            optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 2.0)
            return tf.constant(True)

        def counted():
            optimizer.step_counter.assign_add(1)
            return tf.constant(False)

        tf.cond(grow, doubled, counted)
        return tf.constant(True)

    def skipped_step():
        optimizer.step_counter.assign(0)
        optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
        return tf.constant(False)

    # its check_finite would densify a table's IndexedSlices
    present = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads
               if g is not None]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in present]
                           or [tf.constant(True)])
    tf.cond(finite, finite_step, skipped_step)
    return optimizer.iterations
