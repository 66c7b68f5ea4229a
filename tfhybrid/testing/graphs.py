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


def trace_count(function: Any) -> int:
    """How many times ``function`` (a ``tf.function``) has traced so far: a step that
    builds its optimizer must trace once, not again on its second call.

    Example::

        >>> import tensorflow as tf
        >>> double = tf.function(lambda x: 2 * x)
        >>> _ = double(tf.constant(1.0)), double(tf.constant(2.0))
        >>> trace_count(double)
        1
    """
    # a Keras 3 train function calls a tf.function per step from the loop's: the step
    # is traced as often as the most-traced of them
    return max((len(_tf_internals.traced_functions(inner))
                for inner in _tf_internals.tf_functions_in(function)), default=0)


def traced_variables(function: Any) -> list:
    """The variables every graph ``function`` (a ``tf.function``) has traced reads or
    writes, each once.

    Example::

        >>> import tensorflow as tf
        >>> v = tf.Variable(1.0, name="counted")
        >>> bump = tf.function(lambda: v.assign_add(1.0))
        >>> _ = bump()
        >>> [x.name for x in traced_variables(bump)]
        ['counted:0']
    """
    seen = {}
    for concrete in _tf_internals.traced_functions(function):
        for variable in concrete.variables:
            seen.setdefault(id(variable), variable)
    return list(seen.values())
