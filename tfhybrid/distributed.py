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

import re
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


# Tag set from the plan: whether this variable's gradient is synced sparse (allgather).
_SPARSE_SYNC_ATTR = "_tfhybrid_sparse_sync"


# Tags of shards in weight-sync mode: each replica steps alone, and every K steps the
# weights and optimizer state are averaged over the data group.
_SYNC_EVERY_ATTR = "_tfhybrid_sync_every"
# read by tfhybrid.optimizers.MomentumScaledRowWiseAdagrad: c = D in weight-sync mode
_MOMENTUM_SCALE_ATTR = "_tfhybrid_momentum_scale"


def mark_model_parallel(variable: tf.Variable, mesh: mesh_lib.Mesh,
                        sync_every: int | None = None) -> None:
    setattr(variable, _MODEL_PARALLEL_ATTR, True)
    if sync_every is not None:
        setattr(variable, _SYNC_EVERY_ATTR, int(sync_every))
        setattr(variable, _MOMENTUM_SCALE_ATTR, float(mesh.data_parallel))


def weight_sync_every(variable: tf.Variable) -> int | None:
    """K for a shard in weight-sync mode, else None (gradients are synced every step)."""
    return getattr(variable, _SYNC_EVERY_ATTR, None)


# Tag of variables that are never synced (the layer's empty alltoall anchor).
_LOCAL_ONLY_ATTR = "_tfhybrid_local_only"


def mark_local_only(variable: tf.Variable) -> None:
    setattr(variable, _LOCAL_ONLY_ATTR, True)


def mark_sparse_sync(variable: tf.Variable, sparse: bool) -> None:
    setattr(variable, _SPARSE_SYNC_ATTR, bool(sparse))


def is_model_parallel(variable: tf.Variable) -> bool:
    return bool(getattr(variable, _MODEL_PARALLEL_ATTR, False))


# ------------------------------------------------------------ byte counts
# Bytes this rank put on the wire, counted only while a benchmark enables it. The
# backward alltoall (registered by Horovod) sends back what the forward one received,
# so the forward call counts both directions.
_traffic: dict[str, tf.Variable] | None = None


def count_traffic() -> dict[str, tf.Variable]:
    """Starts counting sent bytes; returns {"alltoall": var, "allreduce": var} (int64)."""
    global _traffic
    if _traffic is None:
        _traffic = {k: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"{k}_bytes")
                    for k in ("alltoall", "allreduce")}
    return _traffic


def stop_counting_traffic() -> None:
    global _traffic
    _traffic = None


def _count(kind: str, num_bytes) -> None:
    if _traffic is not None:
        _traffic[kind].assign_add(tf.cast(num_bytes, tf.int64))


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


def _must_run(*tensors: Any) -> None:
    """Makes the traced function run the Horovod collectives behind ``tensors``.

    Horovod registers its collectives as stateless ops, so a ``tf.function`` drops one
    whose result this rank never uses, while the ranks that use it wait for it forever:
    a model position that owns no shard ignores the ids the forward alltoall brings it.
    The function's automatic control dependencies keep the op as an independent side
    effect instead: it runs before the function returns, in any order. Eager ops always
    run.
    """
    if tf.executing_eagerly():
        return
    manager = getattr(tf.compat.v1.get_default_graph(), "experimental_acd_manager", None)
    if manager is None:  # a TF1 graph runs what the session fetches; nothing to mark
        return
    ops = {}
    for tensor in tf.nest.flatten(tensors):
        # marking whatever op came out would leave the collective itself prunable
        if not tensor.op.type.startswith("Horovod"):
            raise ValueError(f"_must_run got {tensor.name!r}, made by a {tensor.op.type!r} "
                             "op; expected the output of a Horovod collective")
        ops[tensor.op.name] = tensor.op
    for name in sorted(ops):
        manager.run_independently(ops[name])


def alltoall(tensor: tf.Tensor, splits: tf.Tensor, process_set: Any, group_size: int,
             name: str, differentiable: bool = False):
    """``hvd.alltoall`` with a rank-independent name; skips the collective in a group of one.

    With ``differentiable=True`` its gradient is the reverse alltoall, also named.
    """
    if group_size == 1:
        return tensor, splits
    name = collective_name(name)
    if differentiable:
        received, received_splits = _alltoall_with_named_gradient(
            tensor, splits, process_set, name)
    else:
        received, received_splits = _bits_alltoall(tensor, splits, process_set, name)
    if _traffic is not None:
        me = process_set.rank()
        width = tensor.dtype.size * max(1, tensor.shape[1:].num_elements() or 1)
        others = lambda x: tf.reduce_sum(tf.cast(x, tf.int64)) - tf.cast(x[me], tf.int64)  # noqa: E731
        _count("alltoall", others(splits) * width)
        if differentiable:
            _count("alltoall", others(received_splits) * width)
    return received, received_splits


def _bits_alltoall(x, splits, process_set, name):
    # Horovod has no bfloat16 alltoall on CPU: move the 16 bits untouched as int16.
    if x.dtype == tf.bfloat16:
        received, received_splits = hvd.alltoall(tf.bitcast(x, tf.int16), splits=splits,
                                                 name=name, process_set=process_set)
        _must_run(received)
        return tf.bitcast(received, tf.bfloat16), received_splits
    received, received_splits = hvd.alltoall(x, splits=splits, name=name,
                                             process_set=process_set)
    _must_run(received)
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
    _must_run(gathered)
    return gathered


def _sparse_is_cheaper(grad: tf.IndexedSlices, variable: tf.Variable) -> bool:
    planned = getattr(variable, _SPARSE_SYNC_ATTR, None)
    if planned is not None:
        return planned
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
        if grad is None or getattr(var, _LOCAL_ONLY_ATTR, False):
            continue
        if weight_sync_every(var) is not None:
            # weight-sync mode: the replica steps on its own G_d / M, the gradient of the
            # mean loss over its model group's samples; no collective here
            reduced[i] = _scaled(grad, 1.0 / mesh.model_parallel)
            continue
        if is_model_parallel(var):
            process_set, group_size = mesh.data_process_set, mesh.data_parallel
        else:
            process_set, group_size = hvd.global_process_set, mesh.size
        if isinstance(grad, tf.IndexedSlices) and (
                group_size == 1 or _sparse_is_cheaper(grad, var)):
            values, indices = grad.values, grad.indices
            if group_size > 1:
                _count("allreduce", tf.size(values, out_type=tf.int64) * values.dtype.size
                       + tf.size(indices, out_type=tf.int64) * indices.dtype.size)
                name = collective_name(f"tfhybrid_sync_{var.name}")
                values = hvd.allgather(values, name=name + "_values", process_set=process_set)
                indices = hvd.allgather(indices, name=name + "_indices",
                                        process_set=process_set)
                _must_run(values, indices)
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
        # the variable's shape: a densified IndexedSlices has no static shape
        _count("allreduce", sum(variables[i].shape.num_elements() * grads[i].dtype.size
                                for i in members))
        summed = hvd.grouped_allreduce(
            [tf.convert_to_tensor(grads[i]) for i in members], op=hvd.Sum,
            postscale_factor=scale, process_set=process_set,
            name=collective_name(f"tfhybrid_sync_{key}"))
        _must_run(summed)
        for i, value in zip(members, summed):
            reduced[i] = value
    return reduced


def _scaled(grad, factor: float):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype),
                                grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


# ------------------------------------------------------------ weight sync
def _optimizer_state_of(optimizer: Any, variable: tf.Variable) -> list[tf.Variable]:
    """The optimizer's slot variables for ``variable`` (accumulators, momenta...)."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "get_slot_names"):  # legacy Keras optimizers
        slots = []
        for name in optimizer.get_slot_names():
            try:
                slots.append(optimizer.get_slot(variable, name))
            except KeyError:
                pass
        return slots
    # New Keras optimizers name slots "<prefix>/<var>" (tfhybrid's "<var>/accumulator");
    # the boundaries keep shard_1 from matching shard_10.
    pattern = re.compile(r"(^|/)" + re.escape(variable._shared_name) + r"(/|:|$)")
    return [v for v in optimizer.variables if v is not variable and pattern.search(v.name)]


def sync_replicas(model_or_variables: Any, optimizer: Any = None,
                  mesh: mesh_lib.Mesh | None = None) -> None:
    """Averages weight-sync shards and their optimizer state over their data groups.

    ``model_or_variables`` is a Keras model/layer or a list of variables; ``optimizer``
    defaults to ``model.optimizer``. Every rank must call it at the same step. Shards in
    gradient-sync mode and dense variables are already equal and are left alone.

    Example (one process: nothing to average, so the weights stay)::

        import tensorflow as tf
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        tfhybrid.sync_replicas([tf.Variable([1.0])])
    """
    mesh = mesh or mesh_lib.current_mesh()
    if hasattr(model_or_variables, "weights"):
        optimizer = optimizer if optimizer is not None else getattr(
            model_or_variables, "optimizer", None)
        variables = model_or_variables.weights
    else:
        variables = list(model_or_variables)
    shards = [v for v in variables if weight_sync_every(v) is not None]
    if mesh.data_parallel == 1 or not shards:
        return
    state = [s for v in shards for s in [v] + _optimizer_state_of(optimizer, v)]
    averaged = hvd.grouped_allreduce([tf.convert_to_tensor(v) for v in state], op=hvd.Average,
                                     process_set=mesh.data_process_set,
                                     name=collective_name("tfhybrid_weight_sync"))
    _must_run(averaged)
    _count("allreduce", sum(v.shape.num_elements() * v.dtype.size for v in state))
    for var, value in zip(state, averaged):
        var.assign(value)


def _sync_if_due(optimizer: Any, variables: Sequence[tf.Variable],
                 mesh: mesh_lib.Mesh) -> None:
    shards = [v for v in variables if weight_sync_every(v) is not None]
    if not shards or mesh.data_parallel == 1:
        return
    every = min(weight_sync_every(v) for v in shards)
    # every rank has the same step count, so all take the same branch of the cond
    due = tf.equal(tf.math.floormod(optimizer.iterations, every), 0)

    def sync():
        sync_replicas(shards, optimizer, mesh)
        return tf.constant(True)

    tf.cond(due, sync, lambda: tf.constant(False))


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
        mesh = self._tfhybrid_mesh or mesh_lib.current_mesh()
        variables = [v for _, v in pairs]
        grads = allreduce_gradients([g for g, _ in pairs], variables, mesh)
        if isinstance(self, tf.keras.mixed_precision.LossScaleOptimizer):
            grads = _agree_on_overflow(grads, mesh)
        result = super().apply_gradients(zip(grads, variables), *args, **kwargs)
        # weight-sync mode: every K steps (counted after this step) average the replicas
        with tf.control_dependencies([result] if result is not None else []):
            _sync_if_due(self, variables, mesh)
        return result


def _agree_on_overflow(grads: list, mesh: mesh_lib.Mesh) -> list:
    """Makes every rank see a non-finite gradient if any rank has one.

    The loss-scale optimizer skips a step and lowers its scale when a gradient overflows.
    Shards differ between ranks, so without this one rank could skip while another steps,
    and their loss scales would drift apart.
    """
    present = [g for g in grads if g is not None]
    if not present or mesh.size == 1:
        return grads
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(
        g.values if isinstance(g, tf.IndexedSlices) else g)) for g in present])
    everywhere = hvd.allreduce(tf.cast(finite, tf.float32), op=hvd.Min,
                               name=collective_name("tfhybrid_all_finite"))
    _must_run(everywhere)
    poison = tf.where(everywhere > 0, 0.0, float("nan"))
    return [None if g is None else _plus(g, poison) for g in grads]


def _plus(grad, value):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values + tf.cast(value, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad + tf.cast(value, grad.dtype)


def DistributedOptimizer(optimizer: tf.keras.optimizers.Optimizer,
                         mesh: mesh_lib.Mesh | None = None):
    """Returns a copy of a Keras optimizer whose ``apply_gradients`` reduces over the mesh.

    Works in custom loops and in ``model.fit`` (which calls ``apply_gradients``). Under
    the ``mixed_float16`` policy it wraps the optimizer in a ``LossScaleOptimizer`` first
    (as ``model.compile`` would), and all ranks skip a step together when any rank's
    gradients overflow.

    Example (one process)::

        import tensorflow as tf
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        opt = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
        w = tf.Variable([1.0])
        opt.apply_gradients([(tf.constant([1.0]), w)])   # w == [0.9] on one rank
    """
    if (tf.keras.mixed_precision.global_policy().name == "mixed_float16"
            and not isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)):
        # Keras would wrap us in a loss-scale optimizer whose skip decision is local;
        # wrapping it inside lets every rank agree on each skip (_agree_on_overflow).
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
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
    if not 0 <= root_rank < mesh.size:
        raise ValueError(f"root_rank={root_rank} is not a rank in [0, {mesh.size})")
    # Horovod's root_rank is a global rank, also inside a process set
    if mesh.size > 1:
        for var in dense:
            var.assign(hvd.broadcast(var, root_rank, process_set=hvd.global_process_set))
    if mesh.data_parallel > 1:
        for var in shards:
            var.assign(hvd.broadcast(var, mesh.data_group_ranks[0],
                                     process_set=mesh.data_process_set))
