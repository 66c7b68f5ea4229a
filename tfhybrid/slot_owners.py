"""Which optimizer holds a variable's slots: the embedding optimizer for the variables
whose role (``tfhybrid.roles``) says they are ``DistributedEmbedding``'s (of per-table
optimizers, the one of the variable's table), and the optimizer a loss-scale optimizer
wraps.

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


class PerTableOptimizers:
    """An embedding optimizer made of several Keras optimizers, each training (and
    holding the slots of) its own tables: ``tfhybrid.table_optimizers.TableOptimizers``.
    The gradient route applies each one's share of the gradients (``split``), and
    checkpoints ask each for its tables' slots (``optimizer_for``).

    Example::

        import tensorflow as tf
        from tfhybrid import slot_owners
        class Both(slot_owners.PerTableOptimizers):
            def __init__(self):
                self.optimizers = [tf.keras.optimizers.SGD(), tf.keras.optimizers.Adam()]
        assert len(slot_owners.each_optimizer(Both())) == 2
    """

    optimizers: list

    def optimizer_for(self, variable: Any, table: str | None = None) -> Any:
        """The optimizer of ``variable``'s table; for a variable every table of a layer
        shares (its anchor), that of ``table`` (a table key) if given, else one that
        holds its slots."""
        raise NotImplementedError

    def split(self, variables: list) -> list[tuple[Any, list[int]]]:
        """(optimizer, the positions in ``variables`` it applies), for every optimizer,
        in the same order on every rank."""
        raise NotImplementedError

    def build(self, var_list: list) -> None:
        """Builds every optimizer with its share of ``var_list``."""
        raise NotImplementedError

    @property
    def built(self) -> bool:
        """Whether every optimizer has made its slots (they are built one by one)."""
        raise NotImplementedError


def each_optimizer(optimizer: Any) -> list:
    """The Keras optimizers an embedding optimizer is: itself, or each of per-table
    optimizers'; [] for None."""
    if optimizer is None:
        return []
    if isinstance(optimizer, PerTableOptimizers):
        return list(optimizer.optimizers)
    return [optimizer]


def tables_built(optimizer: Any) -> bool:
    """False while the per-table optimizers of ``optimizer`` (a DistributedOptimizer's
    embedding optimizer) are not all built: a restore of table slots waits for them."""
    embedding_optimizer = getattr(optimizer, "embedding_optimizer", None)
    return not isinstance(embedding_optimizer, PerTableOptimizers) or embedding_optimizer.built


def slot_owner(optimizer: Any, variable: tf.Variable, table: str | None = None) -> Any:
    """The optimizer that holds ``variable``'s slots (a loss scale's inner one; the
    embedding optimizer for tables when there is one, of per-table optimizers the
    table's), or None. ``table`` (a table key) picks the optimizer of that table for a
    variable every table of a layer shares (its anchor)."""
    embedding_optimizer = getattr(optimizer, "embedding_optimizer", None)
    if embedding_optimizer is not None and roles.is_embedding(variable):
        optimizer = embedding_optimizer
        if isinstance(optimizer, PerTableOptimizers):
            optimizer = optimizer.optimizer_for(variable, table)
    return base_optimizer(optimizer)
