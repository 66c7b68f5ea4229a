"""The route of a gradient over the mesh, in one place, and the broadcast.

``DistributedOptimizer`` and ``DistributedGradientTape`` both hand their gradients to one
``GradientRoute``, so the two cannot differ. The route, in the order it runs:

1. **sync** (``allreduce_gradients``): each gradient is averaged over its process set.
   Why that equals single-process training on the global batch (see the design notes):
   with rank losses ``L_r = (1/b) sum_{s in r} l_s`` and the reference
   ``L = (1/N) sum_r L_r``,

   - a dense variable or a data-parallel table needs ``(1/N) sum_r grad L_r``: the
     average over all N ranks;
   - a model-parallel shard in replica d receives ``G_d / M`` from the layer (the
     alltoall backward sums the M ranks' ``grad L_r``, and the layer scales it by 1/M:
     the gradient of its model group's mean loss); the reference needs
     ``(1/N) sum_d G_d = (1/D) sum_d G_d / M``: the average over its data group;
   - a shard in weight-sync mode steps on its own replica's ``G_d / M`` (no collective).

   Every step is an average, so syncing twice (a ``DistributedGradientTape`` whose
   gradients a ``DistributedOptimizer`` applies) changes nothing but the traffic.
2. **overflow agreement** (loss scaling): if any rank's gradient is not finite, every
   rank's is made so, and every loss-scale optimizer skips the step together.
3. **clipping** with norms over the whole mesh: each shard counted once, each
   replicated variable once; per-table norms for ``clipnorm``. The optimizer's own
   clipping then finds nothing left to clip.
4. **apply**: the optimizer's own ``apply_gradients``; tables may go to a separate
   ``embedding_optimizer``.
5. **weight sync** every K steps (``replica_sync="weights"``): shard weights and their
   optimizer state averaged over the data group.

A ``DistributedGradientTape`` runs steps 1-2 in ``gradient``; steps 3-5 run where the
optimizer applies, so they need the optimizer: pass it as ``optimizer=`` (or apply with a
``DistributedOptimizer``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import tensorflow as tf
import horovod.tensorflow as hvd

from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib

# ------------------------------------------------------------------ variable tags
# DistributedEmbedding tags its variables; the route reads the tags.
# Shards live on one position of every model group: reduced over their data group,
# broadcast from its first member.
_MODEL_PARALLEL_ATTR = "_tfhybrid_model_parallel"
# Whether this variable's gradient is synced sparse (allgather), from the plan.
_SPARSE_SYNC_ATTR = "_tfhybrid_sparse_sync"
# Shards in weight-sync mode: each replica steps alone, and every K steps the weights and
# optimizer state are averaged over the data group.
_SYNC_EVERY_ATTR = "_tfhybrid_sync_every"
# read by tfhybrid.optimizers.MomentumScaledRowWiseAdagrad: c = D in weight-sync mode
_MOMENTUM_SCALE_ATTR = "_tfhybrid_momentum_scale"
# Never synced (the layer's empty alltoall anchor).
_LOCAL_ONLY_ATTR = "_tfhybrid_local_only"
# Variables of DistributedEmbedding (tables, shards, anchor): an embedding optimizer's.
_EMBEDDING_ATTR = "_tfhybrid_embedding"
# On a shard: the key of its whole table, whose norm the shards share (clipnorm).
_TABLE_KEY_ATTR = "_tfhybrid_table_key"
# On the anchor, which every rank has: the keys of all sharded tables of the layer, so
# every rank joins the same norm allreduce even where it owns no shard.
_SHARDED_TABLES_ATTR = "_tfhybrid_sharded_tables"
# Without a static row count, a sparse gradient is sent sparse when its table is at least
# this many elements: every rank sees the same static shapes, so all choose alike.
_SPARSE_DEFAULT_MIN_ELEMENTS = 1 << 16


def mark_model_parallel(variable: tf.Variable, mesh: mesh_lib.Mesh,
                        sync_every: int | None = None, table_key: str | None = None) -> None:
    setattr(variable, _MODEL_PARALLEL_ATTR, True)
    if table_key is not None:
        setattr(variable, _TABLE_KEY_ATTR, table_key)
    if sync_every is not None:
        setattr(variable, _SYNC_EVERY_ATTR, int(sync_every))
        setattr(variable, _MOMENTUM_SCALE_ATTR, float(mesh.data_parallel))


def mark_embedding(variable: tf.Variable) -> None:
    setattr(variable, _EMBEDDING_ATTR, True)


def mark_anchor(variable: tf.Variable, sharded_table_keys: Sequence[str]) -> None:
    """The layer's alltoall anchor: never synced, and it names the layer's sharded tables."""
    setattr(variable, _LOCAL_ONLY_ATTR, True)
    setattr(variable, _SHARDED_TABLES_ATTR, tuple(sharded_table_keys))
    mark_embedding(variable)


def mark_sparse_sync(variable: tf.Variable, sparse: bool) -> None:
    setattr(variable, _SPARSE_SYNC_ATTR, bool(sparse))


def is_model_parallel(variable: tf.Variable) -> bool:
    return bool(getattr(variable, _MODEL_PARALLEL_ATTR, False))


def is_embedding(variable: tf.Variable) -> bool:
    return bool(getattr(variable, _EMBEDDING_ATTR, False))


def weight_sync_every(variable: tf.Variable) -> int | None:
    """K for a shard in weight-sync mode, else None (gradients are synced every step)."""
    return getattr(variable, _SYNC_EVERY_ATTR, None)


# ------------------------------------------------------------------ 1. sync
def _sparse_is_cheaper(grad: tf.IndexedSlices, variable: tf.Variable) -> bool:
    planned = getattr(variable, _SPARSE_SYNC_ATTR, None)
    if planned is not None:
        return planned
    rows = variable.shape[0]
    width = max(1, variable.shape.num_elements() // max(1, rows))
    touched = grad.indices.shape[0]
    if touched is None:
        return rows * width >= _SPARSE_DEFAULT_MIN_ELEMENTS
    # an allgather moves (ids + values) per touched row; an allreduce the whole table
    return touched * (width + 1) < rows * width


def allreduce_gradients(grads: Sequence[Any], variables: Sequence[tf.Variable],
                        mesh: mesh_lib.Mesh | None = None) -> list:
    """Step 1: averages each gradient over its process set (see the module doc).

    Dense gradients of one process set go in one grouped allreduce; IndexedSlices stay
    sparse (an allgather, then 1/n: their concatenation stands for the sum) where that
    moves fewer bytes.
    """
    mesh = mesh or mesh_lib.current_mesh()
    reduced: list = list(grads)
    dense_groups: dict[str, tuple[Any, list[int]]] = {}
    for i, (grad, var) in enumerate(zip(grads, variables)):
        if grad is None or getattr(var, _LOCAL_ONLY_ATTR, False):
            continue
        if weight_sync_every(var) is not None:
            # the replica steps on its own G_d / M, the gradient of the mean loss over its
            # model group's samples; no collective here
            continue
        if is_model_parallel(var):
            process_set, group_size = mesh.data_process_set, mesh.data_parallel
        else:
            process_set, group_size = hvd.global_process_set, mesh.size
        if isinstance(grad, tf.IndexedSlices) and (
                group_size == 1 or _sparse_is_cheaper(grad, var)):
            values, indices = grad.values, grad.indices
            if group_size > 1:
                collectives.count("allreduce",
                                  tf.size(values, out_type=tf.int64) * values.dtype.size
                                  + tf.size(indices, out_type=tf.int64) * indices.dtype.size)
                name = f"tfhybrid_sync_{var.name}"
                values = collectives.allgather(values, group_size, name + "_values",
                                               process_set)
                indices = collectives.allgather(indices, group_size, name + "_indices",
                                                process_set)
            reduced[i] = tf.IndexedSlices(values * tf.cast(1.0 / group_size, values.dtype),
                                          indices, grad.dense_shape)
            continue
        grad = tf.convert_to_tensor(grad)
        if group_size == 1:
            reduced[i] = grad
            continue
        key = "global" if process_set is hvd.global_process_set else "data"
        dense_groups.setdefault(key, (process_set, []))[1].append(i)
    for key in sorted(dense_groups):
        process_set, members = dense_groups[key]
        # the variable's shape: a densified IndexedSlices has no static shape
        collectives.count("allreduce", sum(variables[i].shape.num_elements()
                                           * grads[i].dtype.size for i in members))
        group_size = mesh.size if key == "global" else mesh.data_parallel
        summed = collectives.grouped_allreduce(
            [tf.convert_to_tensor(grads[i]) for i in members], op=hvd.Sum,
            name=f"tfhybrid_sync_{key}", process_set=process_set,
            postscale_factor=1.0 / group_size)
        for i, value in zip(members, summed):
            reduced[i] = value
    return reduced


def _scaled(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype),
                                grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


# ------------------------------------------------------- 2. overflow agreement
def _agree_on_overflow(grads: list, mesh: mesh_lib.Mesh) -> list:
    """Makes every rank see a non-finite gradient if any rank has one.

    The loss-scale optimizer skips a step and lowers its scale when a gradient overflows.
    Shards differ between ranks, so without this one rank could skip while another steps,
    and their loss scales would drift apart.
    """
    present = [g for g in grads if g is not None]
    if mesh.size == 1:
        return grads
    if present:
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(_values(g)))
                                for g in present])
    else:  # a rank with no gradient still joins the vote
        finite = tf.constant(True)
    everywhere = collectives.allreduce(tf.cast(finite, tf.float32), op=hvd.Min,
                                       name="tfhybrid_all_finite")
    poison = tf.where(everywhere > 0, 0.0, float("nan"))
    return [None if g is None else _plus(g, poison) for g in grads]


def _values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _plus(grad, value):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values + tf.cast(value, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad + tf.cast(value, grad.dtype)


def _is_loss_scaling(optimizer: Any) -> bool:
    return isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)


def _base_optimizer(optimizer: Any) -> Any:
    """The optimizer a loss-scale optimizer wraps (it holds the slots and the clipping)."""
    while optimizer is not None and _is_loss_scaling(optimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


# ------------------------------------------------------------------ 3. clipping
def _clip_settings(optimizer: Any) -> dict[str, float]:
    """The optimizer's clipping, as Keras applies it: ``clipnorm`` or ``global_clipnorm``
    (never both), else ``clipvalue``."""
    base = _base_optimizer(optimizer)
    settings = {}
    for name in ("clipnorm", "global_clipnorm", "clipvalue"):
        value = getattr(base, name, None)
        if value is not None and float(value) > 0:
            settings[name] = float(value)
    if "clipnorm" in settings or "global_clipnorm" in settings:
        settings.pop("clipvalue", None)
    return settings


def _coalesced(grad):
    """An IndexedSlices with each row once (duplicates summed): its values are the
    gradient's own rows, so their norm is the gradient's norm."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    unique, position = tf.unique(grad.indices)
    return tf.IndexedSlices(tf.math.unsorted_segment_sum(grad.values, position,
                                                         tf.size(unique)),
                            unique, grad.dense_shape)


def _squared_norm(grad) -> tf.Tensor:
    return tf.reduce_sum(tf.square(tf.cast(_values(grad), tf.float32)))


def _clip(grads: list, variables: Sequence[tf.Variable], settings: dict[str, float],
          mesh: mesh_lib.Mesh) -> list:
    """Step 3: clips like a single process clips the global batch's gradient.

    A dense variable's gradient is equal on every rank after the sync, so its norm is
    local. A table sharded over a model group has its norm spread over the group's ranks;
    one allreduce over all ranks of the per-table sums, divided by D (each model group
    holds every table once), gives every rank the same norms. In weight-sync mode, where
    replicas differ, that is their mean, so all ranks still clip dense variables alike.
    """
    if not settings:
        return grads
    grads = [None if g is None else _coalesced(g) for g in grads]
    if "clipvalue" in settings:
        limit = settings["clipvalue"]
        return [None if g is None else _map_values(
            g, lambda v: tf.clip_by_value(v, -limit, limit)) for g in grads]
    table_keys = sorted({key for v in variables
                         for key in getattr(v, _SHARDED_TABLES_ATTR, ())})
    shard_sums = {key: [] for key in table_keys}
    own_norms: list = [None] * len(grads)
    for i, (grad, var) in enumerate(zip(grads, variables)):
        if grad is None or getattr(var, _LOCAL_ONLY_ATTR, False):
            continue
        key = getattr(var, _TABLE_KEY_ATTR, None)
        if key is None:
            own_norms[i] = _squared_norm(grad)
        elif key not in shard_sums:
            raise ValueError(
                f"variable {var.name!r} is a shard of table {key!r}, but its layer's "
                "alltoall_anchor is not among the variables; pass all of the layer's "
                "trainable_variables so every rank clips with the same norms")
        else:
            shard_sums[key].append(_squared_norm(grad))
    table_norms = {}
    if table_keys:
        local = tf.stack([tf.add_n(shard_sums[k]) if shard_sums[k] else tf.constant(0.0)
                          for k in table_keys])
        if mesh.size > 1:
            local = collectives.allreduce(local, op=hvd.Sum, name="tfhybrid_clip_norms")
        totals = local / float(mesh.data_parallel)
        table_norms = {k: totals[j] for j, k in enumerate(table_keys)}
    if "global_clipnorm" in settings:
        limit = settings["global_clipnorm"]
        squares = [n for n in own_norms if n is not None] + list(table_norms.values())
        norm = tf.sqrt(tf.add_n(squares)) if squares else tf.constant(0.0)
        factor = limit / tf.maximum(norm, limit)
        return [None if g is None else _scaled(g, factor) for g in grads]
    limit = settings["clipnorm"]
    clipped = list(grads)
    for i, (grad, var) in enumerate(zip(grads, variables)):
        if grad is None or getattr(var, _LOCAL_ONLY_ATTR, False):
            continue
        square = own_norms[i] if own_norms[i] is not None else table_norms[
            getattr(var, _TABLE_KEY_ATTR)]
        clipped[i] = _scaled(grad, limit / tf.maximum(tf.sqrt(square), limit))
    return clipped


def _map_values(grad, fn):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


# ------------------------------------------------------------------ 5. weight sync
def _optimizer_state_of(optimizer: Any, variable: tf.Variable) -> list[tf.Variable]:
    """The optimizer's slot variables for ``variable`` (accumulators, momenta...), from
    the embedding optimizer where one holds the tables."""
    embedding_optimizer = getattr(optimizer, "embedding_optimizer", None)
    if embedding_optimizer is not None and is_embedding(variable):
        optimizer = embedding_optimizer
    optimizer = _base_optimizer(optimizer)
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
    averaged = collectives.grouped_allreduce([tf.convert_to_tensor(v) for v in state],
                                             op=hvd.Average, name="tfhybrid_weight_sync",
                                             process_set=mesh.data_process_set)
    collectives.count("allreduce", sum(v.shape.num_elements() * v.dtype.size for v in state))
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


# ------------------------------------------------------------------ the route
class GradientRoute:
    """The whole path of a gradient over the mesh (steps 1-5 of the module doc).

    ``DistributedOptimizer`` runs ``apply``; ``DistributedGradientTape`` runs ``sync`` in
    ``gradient`` and makes its optimizer run ``apply`` (whose sync then finds every
    gradient already equal to its average).
    """

    def __init__(self, mesh: mesh_lib.Mesh | None = None, embedding_optimizer: Any = None):
        self._mesh = mesh
        self.embedding_optimizer = embedding_optimizer

    @property
    def mesh(self) -> mesh_lib.Mesh:
        return self._mesh or mesh_lib.current_mesh()

    def sync(self, grads: Sequence[Any], variables: Sequence[tf.Variable],
             loss_scaling: bool) -> list:
        """Steps 1-2: the sync, then the overflow vote when a loss scale is in use."""
        grads = allreduce_gradients(grads, variables, self.mesh)
        if loss_scaling:
            grads = _agree_on_overflow(grads, self.mesh)
        return grads

    def apply(self, optimizer: Any, apply_fn: Callable, grads_and_vars: Any,
              *args: Any, **kwargs: Any) -> Any:
        """Steps 1-5; ``apply_fn`` is the optimizer's own ``apply_gradients``."""
        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        grads = self.sync(grads, variables, _is_loss_scaling(optimizer))
        mesh = self.mesh
        groups = [(optimizer, apply_fn, list(range(len(pairs))))]
        if self.embedding_optimizer is not None:
            tables = [i for i, v in enumerate(variables) if is_embedding(v)]
            dense = [i for i, v in enumerate(variables) if not is_embedding(v)]
            groups = [(optimizer, apply_fn, dense),
                      (self.embedding_optimizer, self.embedding_optimizer.apply_gradients,
                       tables)]
        results = []
        for owner, apply_group, members in groups:
            if not members:
                continue
            clipped = _clip([grads[i] for i in members], [variables[i] for i in members],
                            _clip_settings(owner), mesh)
            group_pairs = list(zip(clipped, [variables[i] for i in members]))
            if owner is optimizer:
                results.append(apply_group(group_pairs, *args, **kwargs))
            else:
                results.append(self._apply_unless_skipped(optimizer, apply_group,
                                                          group_pairs))
        result = results[0] if results else None
        # weight-sync mode: every K steps (counted after this step) average the replicas
        with tf.control_dependencies([r for r in results if r is not None]
                                     if not tf.executing_eagerly() else []):
            _sync_if_due(optimizer, variables, mesh)
        return result

    @staticmethod
    def _apply_unless_skipped(optimizer: Any, apply_fn: Callable, pairs: list) -> Any:
        """The embedding optimizer's step, skipped with the loss-scale optimizer's."""
        if not _is_loss_scaling(optimizer):
            return apply_fn(pairs)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(_values(g)))
                                for g, _ in pairs if g is not None] or [tf.constant(True)])

        def step():
            apply_fn(pairs)
            return tf.constant(True)

        return tf.cond(finite, step, lambda: tf.constant(False))


# ------------------------------------------------------------------ tape
class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so ``gradient`` returns gradients synced over the mesh.

    ``gradient`` runs the sync (and, with a loss-scale optimizer or the mixed_float16
    policy, the overflow vote). Clipping, a separate embedding optimizer and
    weight-sync mode happen where the optimizer applies: pass the optimizer as
    ``optimizer=`` and the tape makes its ``apply_gradients`` run the rest of the route
    (as ``DistributedOptimizer`` does), or apply with a ``DistributedOptimizer``. Weight-
    sync shards without either raise ``ValueError``.

    Example (one process)::

        import tensorflow as tf
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        w = tf.Variable([1.0, 2.0])
        optimizer = tf.keras.optimizers.SGD(0.1, global_clipnorm=1.0)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        tape = tfhybrid.DistributedGradientTape(tape, optimizer=optimizer)
        grads = tape.gradient(loss, [w])          # [[2., 4.]] on one rank
        optimizer.apply_gradients(zip(grads, [w]))  # clipped to norm 1 over the mesh
    """

    def __init__(self, tape: tf.GradientTape, optimizer: Any = None,
                 mesh: mesh_lib.Mesh | None = None):
        self._tape = tape
        self._optimizer = optimizer
        if optimizer is not None:
            _route_optimizer(optimizer, mesh)
        # the optimizer's own route where it has one, so both halves share one object
        self._route = getattr(optimizer, "_tfhybrid_route", None) or GradientRoute(mesh)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        if self._optimizer is None and any(weight_sync_every(v) is not None
                                           for v in flat_sources):
            raise ValueError(
                "these variables include shards in weight-sync mode (replica_sync="
                "'weights'), whose replicas are averaged after the optimizer steps; pass "
                "the optimizer: tfhybrid.DistributedGradientTape(tape, optimizer=opt), or "
                "apply with tfhybrid.DistributedOptimizer(opt)")
        if self._optimizer is not None:
            loss_scaling = _is_loss_scaling(self._optimizer)
        else:
            loss_scaling = tf.keras.mixed_precision.global_policy().name == "mixed_float16"
        flat_grads = self._route.sync(tf.nest.flatten(grads), flat_sources, loss_scaling)
        return tf.nest.pack_sequence_as(grads, flat_grads)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)


def _route_optimizer(optimizer: Any, mesh: mesh_lib.Mesh | None) -> None:
    """Makes ``optimizer.apply_gradients`` run the route's steps (once per optimizer)."""
    if getattr(optimizer, "_tfhybrid_route", None) is not None:
        return
    route = GradientRoute(mesh)
    own_apply = optimizer.apply_gradients

    def apply_gradients(grads_and_vars, *args, **kwargs):
        return route.apply(optimizer, own_apply, grads_and_vars, *args, **kwargs)

    optimizer._tfhybrid_route = route
    optimizer.apply_gradients = apply_gradients


# -------------------------------------------------------------- optimizer
class _RoutedApply:
    _tfhybrid_route: GradientRoute

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        return self._tfhybrid_route.apply(self, super().apply_gradients, grads_and_vars,
                                          *args, **kwargs)

    @property
    def embedding_optimizer(self) -> Any:
        """The optimizer of the embedding tables, or None (this one applies them too)."""
        return self._tfhybrid_route.embedding_optimizer


def DistributedOptimizer(optimizer: tf.keras.optimizers.Optimizer,
                         mesh: mesh_lib.Mesh | None = None,
                         embedding_optimizer: tf.keras.optimizers.Optimizer | None = None):
    """Returns a copy of a Keras optimizer whose ``apply_gradients`` runs the whole route.

    Works in custom loops and in ``model.fit`` (which calls ``apply_gradients``). Under
    the ``mixed_float16`` policy it wraps the optimizer in a ``LossScaleOptimizer`` first
    (as ``model.compile`` would), and all ranks skip a step together when any rank's
    gradients overflow. ``embedding_optimizer`` (row-wise AdaGrad, say) then applies the
    gradients of ``DistributedEmbedding``'s tables, and ``optimizer`` those of every
    other variable; each clips with its own settings over its own variables.

    Example (one process)::

        import tensorflow as tf
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        opt = tfhybrid.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.1),
            embedding_optimizer=tfhybrid.optimizers.RowWiseAdagrad(0.05))
        w = tf.Variable([1.0])
        opt.apply_gradients([(tf.constant([1.0]), w)])   # w == [0.9] on one rank
    """
    if embedding_optimizer is not None:
        if _is_loss_scaling(embedding_optimizer) or isinstance(embedding_optimizer,
                                                               _RoutedApply):
            raise ValueError(
                f"embedding_optimizer={embedding_optimizer!r} must be a plain Keras "
                "optimizer; loss scaling and the mesh route come from the optimizer it is "
                "passed with")
        if not hasattr(embedding_optimizer, "apply_gradients"):
            raise ValueError(f"embedding_optimizer={embedding_optimizer!r} is not a Keras "
                             "optimizer")
    if isinstance(optimizer, _RoutedApply):
        raise ValueError("optimizer is already a tfhybrid.DistributedOptimizer")
    if (tf.keras.mixed_precision.global_policy().name == "mixed_float16"
            and not _is_loss_scaling(optimizer)):
        # Keras would wrap us in a loss-scale optimizer whose skip decision is local;
        # wrapping it inside lets every rank agree on each skip (_agree_on_overflow).
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    base = optimizer.__class__
    route = GradientRoute(mesh, embedding_optimizer)
    cls = type(base.__name__, (_RoutedApply, base), {"_tfhybrid_route": route})
    routed = cls.from_config(optimizer.get_config())
    if embedding_optimizer is not None:
        # an attribute, so checkpoints of the optimizer track its slots too
        routed._tfhybrid_embedding_optimizer = embedding_optimizer
    return routed


# -------------------------------------------------------------- broadcast
def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int = 0,
                        mesh: mesh_lib.Mesh | None = None) -> None:
    """Makes every copy of every variable equal to its root's.

    Dense variables come from global ``root_rank``; model-parallel shards come from the
    first member (replica 0) of their data group, since the root itself may not hold
    them. Every rank must call it with its variables in the same order.

    Example (one process: every variable is already its own root's)::

        import tensorflow as tf
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        tfhybrid.broadcast_variables([tf.Variable([1.0])])
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
