"""What a traced ``tf.function`` runs: for tests that check which ops a path uses."""

from __future__ import annotations

from typing import Any

from tfhybrid import _tf_internals


def traced_op_types(function: Any) -> list[str]:
    """The op type of every node in every graph ``function`` (a ``tf.function``, such as
    a Keras model's ``train_function``) has traced, the functions they call included;
    a type appears once per node.

    Example::

        >>> import tensorflow as tf
        >>> square = tf.function(lambda x: x * x)
        >>> _ = square(tf.constant(2.0))
        >>> "Mul" in traced_op_types(square)
        True
    """
    types = []
    for concrete in _tf_internals.traced_functions(function):
        graph = concrete.graph
        types += [op.type for op in graph.get_operations()]
        types += [node.op for library_function in graph.as_graph_def().library.function
                  for node in library_function.node_def]
    return types
