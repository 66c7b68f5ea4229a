"""Which optimizer holds a variable's slots: the embedding optimizer for the variables
whose role (``tfhybrid.roles``) says they are ``DistributedEmbedding``'s, and the
optimizer a loss-scale optimizer wraps.

The gradient route (``tfhybrid.distributed``) and checkpoints (``tfhybrid.checkpoint``)
both ask; neither owns the answer, so it lives below both.

Example::

    import tensorflow as tf
    from tfhybrid import roles, slot_owners
    table, kernel = tf.Variable([[1.0]]), tf.Variable([2.0])
    roles.mark_embedding(table)
    dense, embedding = tf.keras.optimizers.SGD(), tf.keras.optimizers.Adagrad()
    dense.embedding_optimizer = embedding
    assert slot_owners.slot_owner(dense, table) is embedding
    assert slot_owners.slot_owner(dense, kernel) is dense
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfhybrid import _tf_internals  # noqa: F401 - first: checks which Keras tf.keras is
from tfhybrid import roles


def is_loss_scaling(optimizer: Any) -> bool:
    return isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)


def base_optimizer(optimizer: Any) -> Any:
    """The optimizer a loss-scale optimizer wraps (it holds the slots and the clipping)."""
    while optimizer is not None and is_loss_scaling(optimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def slot_owner(optimizer: Any, variable: tf.Variable) -> Any:
    """The optimizer that holds ``variable``'s slots (a loss scale's inner one; the
    embedding optimizer for tables when there is one), or None."""
    embedding_optimizer = getattr(optimizer, "embedding_optimizer", None)
    if embedding_optimizer is not None and roles.is_embedding(variable):
        optimizer = embedding_optimizer
    return base_optimizer(optimizer)
