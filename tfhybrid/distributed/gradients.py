"""Arithmetic on one gradient that may be dense or ``tf.IndexedSlices``, shared by the
route's steps.

Example::

    import tensorflow as tf
    from tfhybrid.distributed import gradients
    grad = tf.IndexedSlices(tf.constant([[1.0], [2.0]]), tf.constant([3, 3]),
                            tf.constant([4, 1]))
    once = gradients.sum_duplicates(grad)
    assert once.indices.numpy().tolist() == [3] and once.values.numpy().tolist() == [[3.0]]
    assert gradients.scaled(grad, 2.0).values.numpy().tolist() == [[2.0], [4.0]]
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf


def values_of(grad: Any) -> tf.Tensor:
    """The numbers a gradient holds: an IndexedSlices' rows, or the dense tensor."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def map_values(grad: Any, fn: Callable[[tf.Tensor], tf.Tensor]) -> Any:
    """``grad`` with ``fn`` applied to its numbers (an IndexedSlices keeps its rows)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def scaled(grad: Any, factor: Any) -> Any:
    """``grad`` times ``factor`` (cast to the gradient's dtype)."""
    return map_values(grad, lambda v: v * tf.cast(factor, v.dtype))


def plus(grad: Any, value: Any) -> Any:
    """``grad`` plus ``value`` on each of its numbers (cast to the gradient's dtype)."""
    return map_values(grad, lambda v: v + tf.cast(value, v.dtype))


def sum_duplicates(grad: tf.IndexedSlices) -> tf.IndexedSlices:
    """An IndexedSlices with each row once, duplicates summed in the order they came:
    its values are the gradient's own rows, so their norm is the gradient's norm and a
    row-wise optimizer's update of them is the dense gradient's."""
    rows, position = tf.unique(grad.indices)
    return tf.IndexedSlices(tf.math.unsorted_segment_sum(grad.values, position, tf.size(rows)),
                            rows, grad.dense_shape)
