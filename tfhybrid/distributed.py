"""Gradient routing over the mesh: the tape, the optimizer wrapper and the broadcast.

Why one scale serves every variable (see the design notes): with rank losses
``L_r = (1/b) sum_{s in r} l_s`` and the reference ``L = (1/N) sum_r L_r``,

- a dense variable or a data-parallel table needs ``(1/N) sum_r grad L_r``: the sum over
  all N ranks, times 1/N;
- a model-parallel shard in replica d already holds ``G_d = sum_{r in group d} grad L_r``
  (the alltoall backward summed it); the reference needs ``(1/N) sum_d G_d``: the sum
  over the shard's data group (its D copies), times 1/N.

So every gradient is summed over its process set (global, or the shard's data group)
and multiplied by 1/N, and training equals single-process training on the global batch.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
import horovod.tensorflow as hvd

from tfhybrid import mesh as mesh_lib

# Tag on shard variables: they live on one position of every model group, so they are
# reduced over their data group, and broadcast from its first member.
_MODEL_PARALLEL_ATTR = "_tfhybrid_model_parallel"
# Without a static row count, a sparse gradient is sent sparse when its table is at least
# this many elements: every rank sees the same static shapes, so all choose alike.
_SPARSE_DEFAULT_MIN_ELEMENTS = 1 << 16


def mark_model_parallel(variable: tf.Variable, mesh: mesh_lib.Mesh) -> None:
    setattr(variable, _MODEL_PARALLEL_ATTR, True)


def is_model_parallel(variable: tf.Variable) -> bool:
    return bool(getattr(variable, _MODEL_PARALLEL_ATTR, False))


# --------------------------------------------------------------- collectives
def alltoall(tensor: tf.Tensor, splits: tf.Tensor, process_set: Any, group_size: int):
    """``hvd.alltoall`` that skips the collective in a group of one."""
    if group_size == 1:
        return tensor, splits
    return hvd.alltoall(tensor, splits=splits, process_set=process_set)


def allgather(tensor: tf.Tensor, group_size: int,
              process_set: Any = None) -> tf.Tensor:
    """``hvd.allgather`` (global by default) that skips the collective in a group of one."""
    if group_size == 1:
        return tensor
    return hvd.allgather(tensor, process_set=process_set or hvd.global_process_set)


def _sparse_is_cheaper(grad: tf.IndexedSlices, variable: tf.Variable) -> bool:
    rows, width = variable.shape[0], max(1, variable.shape.num_elements() // max(1, variable.shape[0]))
    touched = grad.indices.shape[0]
    if touched is None:
        return rows * width >= _SPARSE_DEFAULT_MIN_ELEMENTS
    # an allgather moves (ids + values) per touched row; an allreduce the whole table
    return touched * (width + 1) < rows * width


def allreduce_gradients(grads: Sequence[Any], variables: Sequence[tf.Variable],
                        mesh: mesh_lib.Mesh | None = None) -> list:
    """Sums each gradient over its process set and scales it by 1/N (see module doc).

    Dense gradients of one process set go in one grouped allreduce; IndexedSlices stay
    sparse (an allgather) where that moves fewer bytes.
    """
    mesh = mesh or mesh_lib.current_mesh()
    scale = 1.0 / mesh.size
    reduced: list = list(grads)
    dense_groups: dict[str, tuple[Any, list[int]]] = {}
    for i, (grad, var) in enumerate(zip(grads, variables)):
        if grad is None:
            continue
        if is_model_parallel(var):
            process_set, group_size = mesh.data_process_set, mesh.data_parallel
        else:
            process_set, group_size = hvd.global_process_set, mesh.size
        if isinstance(grad, tf.IndexedSlices) and (
                group_size == 1 or _sparse_is_cheaper(grad, var)):
            values, indices = grad.values, grad.indices
            if group_size > 1:
                values = hvd.allgather(values, process_set=process_set)
                indices = hvd.allgather(indices, process_set=process_set)
            reduced[i] = tf.IndexedSlices(values * tf.cast(scale, values.dtype), indices,
                                          grad.dense_shape)
            continue
        grad = tf.convert_to_tensor(grad)
        if group_size == 1:
            reduced[i] = grad * tf.cast(scale, grad.dtype)
            continue
        key = "global" if process_set is hvd.global_process_set else "data"
        dense_groups.setdefault(key, (process_set, []))[1].append(i)
    for key in sorted(dense_groups):
        process_set, members = dense_groups[key]
        summed = hvd.grouped_allreduce(
            [tf.convert_to_tensor(grads[i]) for i in members], op=hvd.Sum,
            postscale_factor=scale, process_set=process_set)
        for i, value in zip(members, summed):
            reduced[i] = value
    return reduced


# ------------------------------------------------------------------- tape
class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so ``gradient`` returns mesh-reduced gradients.

    Example (one process)::

        import tensorflow as tf
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        w = tf.Variable([1.0, 2.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        tape = tfhybrid.DistributedGradientTape(tape)
        grad, = tape.gradient(loss, [w])       # [2., 4.] on one rank
    """

    def __init__(self, tape: tf.GradientTape, mesh: mesh_lib.Mesh | None = None):
        self._tape = tape
        self._mesh = mesh

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = allreduce_gradients(tf.nest.flatten(grads), flat_sources,
                                         self._mesh or mesh_lib.current_mesh())
        return tf.nest.pack_sequence_as(grads, flat_grads)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)


# -------------------------------------------------------------- optimizer
class _ReducingApply:
    _tfhybrid_mesh: mesh_lib.Mesh | None = None

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        pairs = [(g, v) for g, v in grads_and_vars]
        grads = allreduce_gradients([g for g, _ in pairs], [v for _, v in pairs],
                                    self._tfhybrid_mesh or mesh_lib.current_mesh())
        return super().apply_gradients(zip(grads, [v for _, v in pairs]), *args, **kwargs)


def DistributedOptimizer(optimizer: tf.keras.optimizers.Optimizer,
                         mesh: mesh_lib.Mesh | None = None):
    """Returns a copy of a Keras optimizer whose ``apply_gradients`` reduces over the mesh.

    Works in custom loops and in ``model.fit`` (which calls ``apply_gradients``).

    Example (one process)::

        import tensorflow as tf
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        opt = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
        w = tf.Variable([1.0])
        opt.apply_gradients([(tf.constant([1.0]), w)])   # w == [0.9] on one rank
    """
    base = optimizer.__class__
    cls = type(base.__name__, (_ReducingApply, base), {"_tfhybrid_mesh": mesh})
    return cls.from_config(optimizer.get_config())


# -------------------------------------------------------------- broadcast
def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int = 0,
                        mesh: mesh_lib.Mesh | None = None) -> None:
    """Makes every copy of every variable equal to its root's.

    Dense variables come from global ``root_rank``; model-parallel shards come from the
    first member (replica 0) of their data group, since the root itself may not hold
    them. Every rank must call it with its variables in the same order.
    """
    mesh = mesh or mesh_lib.current_mesh()
    dense = [v for v in variables if not is_model_parallel(v)]
    shards = [v for v in variables if is_model_parallel(v)]
    if dense and mesh.size > 1:
        hvd.broadcast_variables(dense, root_rank=root_rank)
    if shards and mesh.data_parallel > 1:
        hvd.broadcast_variables(shards, root_rank=mesh.data_group_ranks[0],
                                process_set=mesh.data_process_set)
