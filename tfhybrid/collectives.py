"""Horovod collectives as tfhybrid issues them: named alike on every rank, never pruned.

Every collective tfhybrid issues goes through this module, for three reasons:

- **Names.** Horovod matches a collective across ranks by name; in a graph its default
  name comes from the input tensor, which differs between ranks that own different
  shards. ``collective_name`` builds names every rank repeats alike.
- **Never pruned.** A traced function drops a stateless op whose result it never reads,
  and Horovod's collectives are stateless ops; ``must_run`` keeps each one alive on
  every rank, in any tracing context (eager, ``tf.function``, nested functions, Keras'
  ``fit``/``evaluate``/``predict``).
- **Byte counts** for the benchmarks (``count_traffic``).
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf
import horovod.tensorflow as hvd


# ------------------------------------------------------------ byte counts
# Bytes this rank put on the wire, counted only while a benchmark enables it. The
# backward alltoall (registered by Horovod) sends back what the forward one received,
# so the forward call counts both directions. Each count also goes to its collective's
# own counter, keyed "<collective name>@<process set id>".
_traffic: dict[str, tf.Variable] | None = None
_traffic_by_collective: dict[str, tf.Variable] = {}


def count_traffic() -> dict[str, tf.Variable]:
    """Starts counting sent bytes; returns {"alltoall": var, "allreduce": var} (int64)."""
    global _traffic
    if _traffic is None:
        _traffic = {k: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"{k}_bytes")
                    for k in ("alltoall", "allreduce")}
    return _traffic


def traffic_by_collective() -> dict[str, int]:
    """Bytes counted so far per collective and process set (see ``count``)."""
    return {key: int(v.numpy()) for key, v in sorted(_traffic_by_collective.items())}


def reset_traffic() -> None:
    """Zeroes every counter (the totals and the per-collective ones)."""
    for v in list((_traffic or {}).values()) + list(_traffic_by_collective.values()):
        v.assign(0)


def stop_counting_traffic() -> None:
    global _traffic
    _traffic = None
    _traffic_by_collective.clear()


def count(kind: str, num_bytes, name: str | None = None, process_set: Any = None) -> None:
    """Adds ``num_bytes`` to ``kind``'s total and, with a ``name``, to that collective's
    counter in its process set (the global set by default)."""
    if _traffic is None:
        return
    num_bytes = tf.cast(num_bytes, tf.int64)
    _traffic[kind].assign_add(num_bytes)
    if name is not None:
        set_id = getattr(process_set, "process_set_id", 0) or 0
        key = f"{name}@{set_id}"
        if key not in _traffic_by_collective:
            with tf.init_scope():
                _traffic_by_collective[key] = tf.Variable(
                    0, dtype=tf.int64, trainable=False,
                    name=re.sub(r"[^A-Za-z0-9_]", "_", key) + "_bytes")
        _traffic_by_collective[key].assign_add(num_bytes)


# --------------------------------------------------------------- collectives
def collective_name(base: str) -> str:
    """A Horovod op name that is the same on every rank.

    Horovod matches a collective across ranks by name, and in a graph its default name
    comes from the input tensor's name, which differs between ranks whose graphs differ
    (positions own different shards). Names built here depend only on ``base`` and on how
    often it was used in this graph, which every rank repeats alike.
    """
    base = re.sub(r"[^A-Za-z0-9_]", "_", base)
    if tf.executing_eagerly():
        return base
    return tf.compat.v1.get_default_graph().unique_name(base, mark_as_used=True).replace("/", "_")


def must_run(*tensors: Any) -> None:
    """Makes every traced function that holds the Horovod collectives behind ``tensors``
    run them, on every rank, however deeply the function is nested.

    Horovod registers its collectives as stateless ops, so a traced function drops one
    whose result this rank never reads, while the ranks that read it wait forever: a
    model position that owns no shard ignores the ids the forward alltoall brings it.
    A control dependency does not help: Grappler turns a stateless op whose outputs feed
    only control edges into a NoOp. What keeps it is a stateful op that reads its data:
    TF runs every stateful op of a function (its automatic control dependencies make
    them outputs of the function, and a call of a function that holds one is a
    ``StatefulPartitionedCall``, whose inlining keeps them). ``Assert`` on a constant
    ``True`` is the cheapest such op; it reads one element of each collective's output
    (on a GPU only that element crosses to the host). Public API only; eager ops always run.
    """
    if tf.executing_eagerly():
        return
    seen, data = set(), []
    # every collective of every trace comes here: the slices share their constants and
    # skip tensor indexing's Python: 2 ops per collective instead of 6, in half the time
    flat, zero, one = tf.constant([-1]), tf.constant([0]), tf.constant([1])
    for tensor in tf.nest.flatten(tensors):
        # a dependency on whatever op came out would leave the collective itself prunable
        if not tensor.op.type.startswith("Horovod"):
            raise ValueError(f"must_run got {tensor.name!r}, made by a {tensor.op.type!r} "
                             "op; expected the output of a Horovod collective")
        if tensor.name not in seen:
            seen.add(tensor.name)
            # its first element, or none of an empty one (a strided slice clamps)
            data.append(tf.raw_ops.StridedSlice(input=tf.reshape(tensor, flat), begin=zero,
                                                end=one, strides=one))
    tf.raw_ops.Assert(condition=tf.constant(True), data=data,
                      name="tfhybrid_collective_issued")


def alltoall(tensor: tf.Tensor, splits: tf.Tensor, process_set: Any, group_size: int,
             name: str, differentiable: bool = False):
    """``hvd.alltoall`` with a rank-independent name; skips the collective in a group of one.

    With ``differentiable=True`` its gradient is the reverse alltoall, also named.
    """
    if group_size == 1:
        return tensor, splits
    base, name = name, collective_name(name)
    if differentiable:
        received, received_splits = _alltoall_with_named_gradient(
            tensor, splits, process_set, name)
    else:
        received, received_splits = _bits_alltoall(tensor, splits, process_set, name)
    if _traffic is not None:
        me = process_set.rank()
        width = tensor.dtype.size * max(1, tensor.shape[1:].num_elements() or 1)
        others = lambda x: tf.reduce_sum(tf.cast(x, tf.int64)) - tf.cast(x[me], tf.int64)  # noqa: E731
        count("alltoall", others(splits) * width, base, process_set)
        if differentiable:
            count("alltoall", others(received_splits) * width, base + "_grad", process_set)
    return received, received_splits


def _bits_alltoall(x, splits, process_set, name):
    # Horovod has no bfloat16 alltoall on CPU: move the 16 bits untouched as int16.
    if x.dtype == tf.bfloat16:
        received, received_splits = hvd.alltoall(tf.bitcast(x, tf.int16), splits=splits,
                                                 name=name, process_set=process_set)
        must_run(received)
        return tf.bitcast(received, tf.bfloat16), received_splits
    received, received_splits = hvd.alltoall(x, splits=splits, name=name,
                                             process_set=process_set)
    must_run(received)
    return received, received_splits


def _alltoall_with_named_gradient(tensor, splits, process_set, name):
    @tf.custom_gradient
    def forward(x):
        received, received_splits = _bits_alltoall(x, splits, process_set, name)

        def backward(grad_received, grad_splits=None):
            # the gradient crosses the wire in the forward's dtype (16 bits under AMP)
            sent_back, _ = _bits_alltoall(tf.cast(grad_received, x.dtype), received_splits,
                                          process_set, name + "_grad")
            return sent_back

        return (received, received_splits), backward

    return forward(tensor)


def allgather(tensor: tf.Tensor, group_size: int, name: str,
              process_set: Any = None) -> tf.Tensor:
    """``hvd.allgather`` (global by default) that skips the collective in a group of one."""
    if group_size == 1:
        return tensor
    gathered = hvd.allgather(tensor, name=collective_name(name),
                             process_set=process_set or hvd.global_process_set)
    must_run(gathered)
    return gathered


def allreduce(tensor: tf.Tensor, op: Any, name: str, process_set: Any = None) -> tf.Tensor:
    """``hvd.allreduce`` (global by default), named alike on every rank, never pruned."""
    reduced = hvd.allreduce(tensor, op=op, name=collective_name(name),
                            process_set=process_set or hvd.global_process_set)
    must_run(reduced)
    return reduced


def leave_together(name: str) -> None:
    """Every rank waits here for every other (a global allreduce of a zero): after
    collectives inside process sets, a rank that goes on alone and ends its script would
    shut Horovod down under a set still at work."""
    allreduce(tf.zeros([1]), hvd.Sum, name)


def grouped_allreduce(tensors: list, op: Any, name: str, process_set: Any = None,
                      postscale_factor: float = 1.0, prescale_factor: float = 1.0) -> list:
    """``hvd.grouped_allreduce``: one negotiation for many tensors of one dtype; named,
    never pruned. The scale factors apply inside Horovod, in the tensors' dtype."""
    reduced = hvd.grouped_allreduce(tensors, op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor,
                                    process_set=process_set or hvd.global_process_set,
                                    name=collective_name(name))
    must_run(reduced)
    return reduced


def broadcast(tensor: tf.Tensor, root_rank: int, name: str,
              process_set: Any = None) -> tf.Tensor:
    """``hvd.broadcast`` (global by default), named alike on every rank, never pruned.

    ``root_rank`` is a global rank, also inside a process set (Horovod's convention).
    """
    received = hvd.broadcast(tensor, root_rank, name=collective_name(name),
                             process_set=process_set or hvd.global_process_set)
    must_run(received)
    return received
