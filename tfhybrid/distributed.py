"""The route of a gradient over the mesh, in one place, and the broadcast.

``DistributedOptimizer`` and ``DistributedGradientTape`` both hand their gradients to one
``GradientRoute``, so the two cannot differ. The module is long because the route is one
piece of arithmetic that must be read whole to be checked against the design notes (sync,
clipping, weight sync, broadcast share its process-set rules). The route, in the order it
runs:

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

   A gradient is synced once: a ``DistributedOptimizer`` skips the gradients a
   ``DistributedGradientTape`` returned (they carry a tag), and an optimizer handed to
   the tape as ``optimizer=`` never syncs. (A second average of equal values would
   change nothing but the traffic; a second ``hvd.Sum`` would multiply by N again, and a
   second fp16 compression would round again.)
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
``DistributedOptimizer``). A gradient transformed after the tape (a loss scale's
unscaling, say) is a new, untagged tensor: a ``DistributedOptimizer`` syncs it again,
while the tape's own ``optimizer=`` applies it as it is.

**Horovod's options** (``horovod.tensorflow(.keras)``'s keywords, with Horovod's meaning;
``SyncOptions`` holds them):

- ``op=hvd.Average`` (default): step 1 as above. ``op=hvd.Sum``: every synced gradient is
  the gradient of the *sum* of the N ranks' losses, ``sum_r grad L_r``: N times the
  Average result, for every kind of variable alike. For a dense variable or a data-
  parallel table that is Horovod's plain sum over the N ranks. A shard's gradient arrives
  already scaled by 1/M (``G_d / M``), so its sum is *not* the plain sum over its data
  group (that would be ``sum_d G_d / M``, M times too small next to the dense
  variables): it is that sum times M, ``sum_d G_d``. A weight-sync shard steps on
  ``N * G_d / M``. Other ops (``hvd.Adasum``, ``Min``, ``Max``, ``Product``) raise
  ``ValueError``.
- ``compression`` (``hvd.Compression.none`` / ``hvd.Compression.fp16`` / any object with
  Horovod's ``compress``/``decompress``): every gradient value that crosses the wire in
  step 1 is compressed before and decompressed after (fp16: sent and summed in 16 bits,
  returned in its own dtype). Gradients that cross no wire (a group of one, weight-sync
  shards) are left alone, as Horovod leaves them on one rank.
- ``sparse_as_dense``: IndexedSlices gradients are densified before step 1, so they go in
  the dense allreduce (and reach the optimizer dense).
- ``gradient_predivide_factor=f`` (Average only): each gradient is scaled by 1/f before
  the sum and f/n after it (n: its process set's size).
- ``backward_passes_per_step=k`` (``DistributedOptimizer`` only), with
  ``average_aggregated_gradients``: as Horovod's ``LocalGradientAggregationHelper``, each
  call of ``apply_gradients`` adds its local (unsynced) gradients to local accumulators;
  every k-th call runs steps 1-5 on the sum (divided by k if
  ``average_aggregated_gradients``) and zeroes the accumulators. The other calls apply
  nothing and only advance every optimizer's ``iterations``, so ``iterations`` counts
  passes, as under Horovod (weight-sync's K counts applied steps).
- ``device_dense`` / ``device_sparse``: the devices of the dense allreduce and of the
  sparse allgathers. ``name``: the prefix of the collectives' names.
- ``num_groups`` / ``groups``: accepted and ignored with one log line; each process set's
  dense gradients already go in one grouped allreduce (they only change Horovod's fusion).
- ``process_set``: only the global set (or None): each gradient's process set comes from
  the mesh (all ranks, or a shard's data group). ``scale_local_gradients``: only True
  (tfhybrid scales shard gradients by the rule above; there are no Horovod local
  variables).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from typing import Any, Callable, Sequence

import tensorflow as tf
import horovod.tensorflow as hvd

from tfhybrid import _tf_internals  # first: checks which Keras tf.keras is
from tfhybrid import collectives
from tfhybrid import compression as compression_lib
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid import tiers
from tfhybrid.checkpoint import slots as checkpoint_slots
from tfhybrid.checkpoint import weights_file as checkpoint_weights_file
from tfhybrid.plan.traffic import sync_is_sparse
from tfhybrid.slot_owners import base_optimizer, is_embedding, mark_embedding, slot_owner
from tfhybrid.slot_owners import is_loss_scaling as _is_loss_scaling

_LOG = logging.getLogger("tfhybrid")

# ------------------------------------------------------------------ variable roles
# DistributedEmbedding records what each of its variables is (tfhybrid.roles); the route
# reads those roles.
# Without a static row count, a sparse gradient is sent sparse when its table is at least
# this many elements: every rank sees the same static shapes, so all choose alike.
_SPARSE_DEFAULT_MIN_ELEMENTS = 1 << 16


def mark_model_parallel(variable: tf.Variable, mesh: mesh_lib.Mesh,
                        sync_every: int | None = None, table_key: str | None = None) -> None:
    """A variable on one position of every model group (a shard, or its row state)."""
    roles.assign(variable, model_parallel=True)
    if table_key is not None:
        roles.assign(variable, table_key=table_key)
    if sync_every is not None:
        roles.assign(variable, sync_every=int(sync_every),
                     momentum_scale=float(mesh.data_parallel))


def mark_anchor(variable: tf.Variable, sharded_table_keys: Sequence[str]) -> None:
    """The layer's alltoall anchor: never synced, and it names the layer's sharded tables."""
    roles.assign(variable, local_only=True, sharded_tables=tuple(sharded_table_keys))
    mark_embedding(variable)


def mark_sparse_sync(variable: tf.Variable, sparse: bool) -> None:
    roles.assign(variable, sparse_sync=bool(sparse))


def is_model_parallel(variable: tf.Variable) -> bool:
    return roles.role_of(variable).model_parallel


def weight_sync_every(variable: tf.Variable) -> int | None:
    """K for a shard in weight-sync mode, else None (gradients are synced every step)."""
    return roles.role_of(variable).sync_every


# ------------------------------------------------------------ Horovod's options
_OP_NAMES = {hvd.Average: "hvd.Average", hvd.Sum: "hvd.Sum", hvd.Adasum: "hvd.Adasum",
             hvd.Min: "hvd.Min", hvd.Max: "hvd.Max", hvd.Product: "hvd.Product"}
_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        _LOG.info(message)


def forget_logged_notes() -> None:
    """Forgets which one-time notes (how Horovod's options were taken) were logged, so
    the next use logs them again, as in a new process."""
    _LOGGED.clear()


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    """How step 1 sends gradients: Horovod's allreduce options (see the module doc).

    Build it with ``sync_options``, which checks the values.
    """

    op: int = hvd.Average
    compression: Any = hvd.Compression.none
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    device_dense: str = ""
    device_sparse: str = ""
    name: str = "tfhybrid"


def _is_global_process_set(process_set: Any) -> bool:
    return process_set is None or process_set is hvd.global_process_set or getattr(
        process_set, "process_set_id", None) == 0


def sync_options(*, op: Any = hvd.Average, compression: Any = hvd.Compression.none,
                 sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                 device_dense: str = "", device_sparse: str = "", name: str | None = None,
                 num_groups: int = 0, groups: Any = None, process_set: Any = None,
                 scale_local_gradients: bool = True) -> SyncOptions:
    """Checks Horovod's allreduce keywords and returns them as ``SyncOptions``.

    Values tfhybrid cannot honour raise ``ValueError`` naming the value; ``num_groups`` and
    ``groups`` are accepted and ignored (one log line). See the module doc.
    """
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(
            f"op={_OP_NAMES.get(op, repr(op))} is not supported: tfhybrid syncs gradients "
            "with op=hvd.Average (the default) or op=hvd.Sum")
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise ValueError(f"compression={compression!r} is not a Horovod compressor; pass "
                         "hvd.Compression.none, hvd.Compression.fp16 or an object with "
                         "compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx)")
    if not isinstance(sparse_as_dense, bool):
        raise ValueError(f"sparse_as_dense={sparse_as_dense!r} must be True or False")
    if isinstance(gradient_predivide_factor, bool) or not isinstance(
            gradient_predivide_factor, (int, float)) or not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be a "
                         "number > 0")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} splits an "
                         f"average; it needs op=hvd.Average, not op={_OP_NAMES[op]}")
    for key, device in (("device_dense", device_dense), ("device_sparse", device_sparse)):
        if not isinstance(device, str):
            raise ValueError(f"{key}={device!r} must be a device string ('' for the default)")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name={name!r} must be a string")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups={num_groups!r} must be an int >= 0")
    if groups is not None and not (isinstance(groups, list) or (
            isinstance(groups, int) and not isinstance(groups, bool) and groups > 0)):
        raise ValueError(f"groups={groups!r} must be an int > 0 or a list of lists of "
                         "variables")
    if num_groups or groups is not None:
        _log_once("tfhybrid: num_groups/groups are ignored: each process set's dense "
                  "gradients already go in one grouped allreduce")
    if not _is_global_process_set(process_set):
        raise ValueError(
            f"process_set={process_set!r} is not supported: tfhybrid reduces each gradient "
            "over its own process set of the mesh (all ranks, or a shard's data group); "
            "pass mesh= to choose the ranks")
    if scale_local_gradients is not True:
        raise ValueError(
            f"scale_local_gradients={scale_local_gradients!r} is not supported: tfhybrid has "
            "no Horovod local variables; it scales model-parallel shards by its own rule")
    return SyncOptions(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                       gradient_predivide_factor=float(gradient_predivide_factor),
                       device_dense=device_dense, device_sparse=device_sparse,
                       name=name or "tfhybrid")


# ------------------------------------------------------------------ 1. sync
def _sparse_is_cheaper(grad: tf.IndexedSlices, variable: tf.Variable, group_size: int
                       ) -> bool:
    planned = roles.role_of(variable).sparse_sync
    if planned is not None:
        return planned
    rows = variable.shape[0]
    width = max(1, variable.shape.num_elements() // max(1, rows))
    touched = grad.indices.shape[0]
    if touched is None:
        return rows * width >= _SPARSE_DEFAULT_MIN_ELEMENTS
    return sync_is_sparse(rows, width, touched, group_size)


def allreduce_gradients(grads: Sequence[Any], variables: Sequence[tf.Variable],
                        mesh: mesh_lib.Mesh | None = None,
                        options: SyncOptions | None = None,
                        thresholder: compression_lib.GradientThresholder | None = None,
                        loss_scale: tf.Tensor | None = None) -> list:
    """Step 1: reduces each gradient over its process set (see the module doc).

    With ``op=hvd.Average`` each gradient becomes its average over its process set; with
    ``op=hvd.Sum`` N times that (the gradient of the sum of the ranks' losses). Dense
    gradients of one process set go in one grouped allreduce; IndexedSlices stay sparse
    (an allgather, then 1/n: their concatenation stands for the sum) where that moves
    fewer bytes, unless ``options.sparse_as_dense``.

    With a ``thresholder`` (DCT-DP) each gradient that would cross a wire as a dense
    allreduce and whose kept entries are cheaper as (index, value) pairs sends only its
    entries above the threshold, as pairs; the rest waits in its residual, stored by the
    route once the step is known to apply (``GradientRoute._vote_and_commit``). Gradients
    that travel as rows (IndexedSlices: shard replicas, replicated tables) stay as they
    are: they are sparse already, and a residual would cost a copy of the table.
    ``loss_scale``: the factor the gradients carry (a tape under loss scaling), which
    the thresholds must not see.
    """
    mesh = mesh or mesh_lib.current_mesh()
    options = options or SyncOptions()
    average = options.op == hvd.Average
    predivide = options.gradient_predivide_factor
    compression = options.compression
    reduced: list = list(grads)
    refresh = None   # DCT-DP: whether this step recomputes thresholds

    def gathered(values, indices, var, group_size, process_set, post):
        """(index, value) pairs of every rank of the group, the values scaled so that
        their sum is the synced gradient (``post``: the factor after a sum)."""
        factor = 1.0 / group_size if average else post
        if group_size > 1:
            name = f"{options.name}_sync_{var.name}"
            with tf.device(options.device_sparse):
                if average and predivide != 1.0:
                    values = values * tf.cast(1.0 / predivide, values.dtype)
                    factor = post
                wire, ctx = compression.compress(values)
                collectives.count("allreduce",
                                  tf.size(wire, out_type=tf.int64) * wire.dtype.size
                                  + tf.size(indices, out_type=tf.int64)
                                  * indices.dtype.size, name, process_set)
                wire = collectives.allgather(wire, group_size, name + "_values",
                                             process_set)
                indices = collectives.allgather(indices, group_size, name + "_indices",
                                                process_set)
                values = compression.decompress(wire, ctx)
        if factor != 1.0:
            values = values * tf.cast(factor, values.dtype)
        return values, indices
    # (process set key, wire dtype) -> (process set, group size, [(index, wire, ctx)])
    dense_groups: dict[tuple[str, str], tuple[Any, int, list]] = {}
    for i, (grad, var) in enumerate(zip(grads, variables)):
        if grad is None or roles.role_of(var).local_only:
            continue
        if options.sparse_as_dense and isinstance(grad, tf.IndexedSlices):
            grad = reduced[i] = tf.convert_to_tensor(grad)
        if weight_sync_every(var) is not None:
            # the replica steps on its own G_d / M, the gradient of the mean loss over its
            # model group's samples; no collective here (Sum: N times that)
            if not average:
                reduced[i] = _scaled(grad, float(mesh.size))
            continue
        if is_model_parallel(var):
            key, process_set, group_size = "data", mesh.data_process_set, mesh.data_parallel
        else:
            key, process_set, group_size = "global", hvd.global_process_set, mesh.size
        # the factor after the sum: the average's 1/n, or for Sum N/n (1 for a variable
        # reduced over all ranks; M for a shard, whose gradient the layer scaled by 1/M)
        post = predivide / group_size if average else mesh.size / group_size
        if isinstance(grad, tf.IndexedSlices) and (
                group_size == 1 or _sparse_is_cheaper(grad, var, group_size)):
            values, indices = gathered(grad.values, grad.indices, var, group_size,
                                       process_set, post)
            reduced[i] = tf.IndexedSlices(values, indices, grad.dense_shape)
            continue
        grad = tf.convert_to_tensor(grad)
        if group_size == 1:
            reduced[i] = grad if average else _scaled(grad, post)
            continue
        if thresholder is not None and thresholder.goes_sparse(var, group_size):
            if refresh is None:   # once per step that thresholds anything
                refresh = thresholder.begin_step()
            mask, sent = thresholder.select(grad, var, refresh, loss_scale)
            indices = tf.cast(tf.where(mask)[:, 0], tf.int32)
            values, indices = gathered(tf.gather(sent, indices), indices, var,
                                       group_size, process_set, post)
            reduced[i] = compression_lib.scatter_sum(values, indices, var.shape)
            continue
        wire, ctx = compression.compress(grad)
        dense_groups.setdefault((key, wire.dtype.name), (process_set, group_size, []))[
            2].append((i, wire, ctx))
    for key, dtype in sorted(dense_groups):
        process_set, group_size, members = dense_groups[(key, dtype)]
        suffix = "" if dtype == "float32" else f"_{dtype}"
        name = f"{options.name}_sync_{key}{suffix}"
        # the variable's shape: a densified IndexedSlices has no static shape
        collectives.count("allreduce", sum(variables[i].shape.num_elements()
                                           * wire.dtype.size for i, wire, _ in members),
                          name, process_set)
        if average:
            pre, post = 1.0 / predivide, predivide / group_size
        else:
            pre, post = 1.0, mesh.size / group_size
        with tf.device(options.device_dense):
            summed = collectives.grouped_allreduce(
                [wire for _, wire, _ in members], op=hvd.Sum,
                name=name, process_set=process_set,
                prescale_factor=pre, postscale_factor=post)
        for (i, _, ctx), value in zip(members, summed):
            reduced[i] = compression.decompress(value, ctx)
    return [rows_once(g, v) for g, v in zip(reduced, variables)]


# Ops whose first output holds distinct values: a sparse gradient indexed by one of them
# (the fused lookup's backward, or an earlier ``rows_once``) has each row once already.
_DISTINCT_INDEX_OPS = frozenset({"Unique", "UniqueV2", "EmbeddingLookupCombineGrad"})


def rows_once(grad: Any, variable: tf.Variable) -> Any:
    """A sparse ``grad`` of ``variable`` with each row once, duplicates summed in the
    order they came; other gradients, and those of weight-sync shards (which step on their
    own replica's gradient, joined by no collective), as they are.

    A sparse gradient repeats rows where several lookups of one table met in the tape (a
    shared table) or where an allgather joined the ranks' rows. Keras 3's stock
    optimizers update each repeat on its own (Adagrad adds g1**2 + g2**2, not
    (g1 + g2)**2), so without this a step would depend on which rank sent which rows,
    that is on the mesh; Keras 2's sum them, and so does this, for every optimizer.
    Indices an op known to make distinct values (``_DISTINCT_INDEX_OPS``) are kept as
    they are, so a traced step pays nothing for gradients that are unique already."""
    if not isinstance(grad, tf.IndexedSlices) or weight_sync_every(variable) is not None:
        return grad
    indices = grad.indices
    if not tf.executing_eagerly() and hasattr(indices, "op") \
            and indices.op.type in _DISTINCT_INDEX_OPS and indices.value_index == 0:
        return grad
    rows, position = tf.unique(indices)
    return tf.IndexedSlices(tf.math.unsorted_segment_sum(grad.values, position, tf.size(rows)),
                            rows, grad.dense_shape)


def _mark_synced(grad: Any) -> Any:
    """Tags a gradient as synced (a DistributedGradientTape's output), so no optimizer
    syncs it again; tags are Python attributes, so a transformed gradient is a new,
    untagged tensor."""
    if grad is not None:
        try:
            roles.assign(grad, synced=True)
        except (AttributeError, TypeError):
            pass
    return grad


def _is_synced(grad: Any) -> bool:
    return roles.role_of(grad).synced


def _scaled(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype),
                                grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


# ------------------------------------------------------- 2. overflow agreement
def _agree_on_overflow(grads: list, mesh: mesh_lib.Mesh) -> tuple[list, tf.Tensor | None]:
    """Makes every rank see a non-finite gradient if any rank has one; also returns
    whether every rank's gradients are finite (None on one rank: nothing was voted).

    The loss-scale optimizer skips a step and lowers its scale when a gradient overflows.
    Shards differ between ranks, so without this one rank could skip while another steps,
    and their loss scales would drift apart.
    """
    if mesh.size == 1:
        return grads, None
    # a rank with no gradient still joins the vote
    everywhere = collectives.allreduce(tf.cast(_all_finite(grads), tf.float32), op=hvd.Min,
                                       name="tfhybrid_all_finite")
    poison = tf.where(everywhere > 0, 0.0, float("nan"))
    return [None if g is None else _plus(g, poison) for g in grads], everywhere > 0


def _all_finite(grads: list) -> tf.Tensor:
    """Whether this rank's gradients (None ones skipped) are all finite."""
    present = [g for g in grads if g is not None]
    if not present:
        return tf.constant(True)
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(_values(g))) for g in present])


def _values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _plus(grad, value):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values + tf.cast(value, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad + tf.cast(value, grad.dtype)


# ------------------------------------------------------------------ 3. clipping
def _clip_settings(optimizer: Any) -> dict[str, float]:
    """The optimizer's clipping, as Keras applies it: ``clipnorm`` or ``global_clipnorm``
    (never both), else ``clipvalue``."""
    base = base_optimizer(optimizer)
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
                         for key in roles.role_of(v).sharded_tables})
    shard_sums = {key: [] for key in table_keys}
    own_norms: list = [None] * len(grads)
    for i, (grad, var) in enumerate(zip(grads, variables)):
        if grad is None or roles.role_of(var).local_only:
            continue
        key = roles.role_of(var).table_key
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
        if grad is None or roles.role_of(var).local_only:
            continue
        square = own_norms[i] if own_norms[i] is not None else table_norms[
            roles.role_of(var).table_key]
        clipped[i] = _scaled(grad, limit / tf.maximum(tf.sqrt(square), limit))
    return clipped


def _map_values(grad, fn):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


# ------------------------------------------------------------------ 5. weight sync
def optimizer_state_of(optimizer: Any, variable: tf.Variable) -> list[tf.Variable]:
    """The optimizer's slot variables for ``variable`` (accumulators, momenta...), from
    the embedding optimizer where one holds the tables."""
    optimizer = slot_owner(optimizer, variable)
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
    return [v for v in optimizer.variables if _tf_internals.is_slot_of(v, variable)]


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
    state = [_tf_internals.tf_variable(s)
             for v in shards for s in [v] + optimizer_state_of(optimizer, v)]
    tiered = [tiers.table_of(v) for v in shards if tiers.table_of(v) is not None]
    # a tiered shard's cache holds its rows' row state, whatever the optimizer
    state += [t.cache_accumulator for t in tiered
              if not any(s is t.cache_accumulator for s in state)]
    averaged = collectives.grouped_allreduce([tf.convert_to_tensor(v) for v in state],
                                             op=hvd.Average, name="tfhybrid_weight_sync",
                                             process_set=mesh.data_process_set)
    collectives.count("allreduce", sum(v.shape.num_elements() * v.dtype.size for v in state),
                      "tfhybrid_weight_sync", mesh.data_process_set)
    assigned = [var.assign(value, read_value=False) for var, value in zip(state, averaged)]
    for table in tiered:
        # the rest of a tiered shard: the rows its replicas wrote back since the last
        # sync, read once the cache is averaged (a row the cache then gives up carries
        # the average)
        name = f"tfhybrid_weight_sync_{table.name}"

        def average(tensors, name=name):
            collectives.count("allreduce", sum(tf.size(t, tf.int64) * t.dtype.size
                                               for t in tensors), name, mesh.data_process_set)
            return collectives.grouped_allreduce(tensors, op=hvd.Average, name=name,
                                                 process_set=mesh.data_process_set)
        with tf.control_dependencies([op for op in assigned if op is not None]):
            table.sync_replicas(average)


def _sync_if_due(optimizer: Any, variables: Sequence[tf.Variable],
                 mesh: mesh_lib.Mesh, passes_per_step: int = 1) -> None:
    shards = [v for v in variables if weight_sync_every(v) is not None]
    if not shards or mesh.data_parallel == 1:
        return
    every = min(weight_sync_every(v) for v in shards)
    # every rank has the same step count, so all take the same branch of the cond;
    # ``iterations`` counts backward passes, K counts applied steps
    steps = optimizer.iterations
    if passes_per_step > 1:
        steps = tf.math.floordiv(steps, passes_per_step)
    due = tf.equal(tf.math.floormod(steps, every), 0)

    def sync():
        sync_replicas(shards, optimizer, mesh)
        return tf.constant(True)

    tf.cond(due, sync, lambda: tf.constant(False))


def _tag_shard_state(optimizer: Any, variables: Sequence[tf.Variable],
                     done: set) -> None:
    """Tags the optimizer slots of model-parallel shards (at trace time, once they exist),
    so ``broadcast_variables`` sends them inside the shard's data group. ``done`` holds
    the (optimizer, shard) pairs already tagged."""
    for var in variables:
        key = (id(optimizer), _tf_internals.tf_variable(var).ref())
        if not is_model_parallel(var) or key in done:
            continue
        slots = optimizer_state_of(optimizer, var)
        for slot in slots:
            roles.assign(slot, shard_state=True)
        if slots:
            done.add(key)


# ------------------------------------------------------------------ the route
def _made_eagerly(next_creator: Callable, **kwargs) -> tf.Variable:
    """A variable creator: a variable made while executing eagerly needs no lifting
    out of a tf.function, and is marked so. A tf.function traces its first call a second
    time when that call made variables it might have to lift; Keras builds an optimizer
    under ``tf.init_scope`` inside the first step, so without the mark every ``fit``
    and every traced custom step traced its whole step twice."""
    if tf.executing_eagerly():
        kwargs["experimental_enable_variable_lifting"] = False
    return next_creator(**kwargs)


class GradientRoute:
    """The whole path of a gradient over the mesh (steps 1-5 of the module doc).

    ``DistributedOptimizer`` runs ``apply``, which syncs every gradient no tape synced
    before. ``DistributedGradientTape`` runs ``sync`` in ``gradient``; an optimizer
    handed to the tape as ``optimizer=`` gets a route with ``sync_in_apply=False``, whose
    ``apply`` runs steps 3-5 only. ``backward_passes_per_step=k`` accumulates k calls of
    ``apply`` before one step (see the module doc).
    """

    def __init__(self, mesh: mesh_lib.Mesh | None = None, embedding_optimizer: Any = None,
                 options: SyncOptions | None = None, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, sync_in_apply: bool = True,
                 dct: compression_lib.DCT | None = None):
        self._mesh = mesh
        # DCT-DP: per-variable residuals and thresholds, kept as long as the route
        self.thresholder: compression_lib.GradientThresholder | None = None
        self.use_dct(dct)
        self.embedding_optimizer = embedding_optimizer
        self.options = options or SyncOptions()
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self.sync_in_apply = sync_in_apply
        # backward_passes_per_step > 1: local sums of the gradients, and the pass count
        self._accumulators: dict[Any, tf.Variable] = {}
        self._passes: tf.Variable | None = None
        self._tagged: set = set()
        self._warned_synced = False

    @property
    def mesh(self) -> mesh_lib.Mesh:
        return self._mesh or mesh_lib.current_mesh()

    def use_dct(self, dct: compression_lib.DCT | None) -> None:
        """Thresholds the data-parallel gradients with ``dct.dp_keep`` (DCT-DP)."""
        dct = compression_lib.as_dct(dct)
        if dct is None or dct.dp_keep is None:
            return
        if self.thresholder is not None:
            if (self.thresholder.dct.dp_keep, self.thresholder.dct.refresh_every) != (
                    dct.dp_keep, dct.refresh_every):
                raise ValueError(f"dct={dct!r} differs from {self.thresholder.dct!r}, which "
                                 "this optimizer's gradients are already thresholded with")
            return
        self.thresholder = compression_lib.GradientThresholder(dct)

    def sync(self, grads: Sequence[Any], variables: Sequence[tf.Variable],
             loss_scaling: bool, options: SyncOptions | None = None,
             loss_scale: tf.Tensor | None = None) -> list:
        """Steps 1-2: the sync, then the overflow vote when a loss scale is in use.
        ``loss_scale``: the factor the gradients still carry (a tape's). Variables it
        makes (DCT's residuals) are made as ``apply``'s are."""
        with tf.variable_creator_scope(_made_eagerly):
            grads = allreduce_gradients(grads, variables, self.mesh,
                                        options or self.options, self.thresholder, loss_scale)
            return self._vote_and_commit(grads, loss_scaling)

    def _vote_and_commit(self, grads: list, loss_scaling: bool) -> list:
        """Step 2, the overflow vote under loss scaling; then DCT-DP stores this step's
        residuals only if the gradients are finite (on every rank, where there was a
        vote): a skipped step must not drop what the residuals held."""
        applied = None
        if loss_scaling:
            grads, applied = _agree_on_overflow(grads, self.mesh)
        if self.thresholder is not None and self.thresholder.staged:
            self.thresholder.commit(_all_finite(grads) if applied is None else applied)
        return grads

    def _sync_unsynced(self, grads: list, variables: list, loss_scaling: bool) -> list:
        """Step 1 for the gradients no tape synced; step 2 for all. Every rank runs the
        vote, whichever gradients it had left to sync."""
        todo = [i for i, g in enumerate(grads) if g is not None and not _is_synced(g)]
        if self.thresholder is not None and len(todo) < sum(g is not None for g in grads) \
                and not self._warned_synced:
            self._warned_synced = True
            tf.get_logger().warning(
                "tfhybrid: gradients reached this optimizer already synced by a "
                "DistributedGradientTape without optimizer=: DCT-DP did not threshold "
                "them. Pass optimizer= to the tape (its dct= then applies) to compress.")
        synced = allreduce_gradients([grads[i] for i in todo], [variables[i] for i in todo],
                                     self.mesh, self.options, self.thresholder)
        grads = list(grads)
        for i, grad in zip(todo, synced):
            grads[i] = grad
        return self._vote_and_commit(grads, loss_scaling)

    def apply(self, optimizer: Any, apply_fn: Callable, grads_and_vars: Any,
              *args: Any, **kwargs: Any) -> Any:
        """Steps 1-5; ``apply_fn`` is the optimizer's own ``apply_gradients``.

        What the first step makes (both optimizers' slots, accumulators, residuals) is
        made eagerly and marked so (``_made_eagerly``): the step is traced once.
        """
        # before the eager mark: a Keras 3 loss-scale optimizer first built here, inside
        # a traced step, must make TF trace the step again, since the step scaled its
        # loss by the constant initial scale (scale_loss before build) and the next
        # trace reads the scale variable
        pairs = _unscaled(optimizer, list(grads_and_vars))
        with tf.variable_creator_scope(_made_eagerly):
            if self.backward_passes_per_step > 1:
                return self._accumulate_then_apply(optimizer, apply_fn, pairs, args, kwargs)
            return self._apply(optimizer, apply_fn, pairs, args, kwargs)

    def _apply(self, optimizer: Any, apply_fn: Callable, pairs: list, args: tuple,
               kwargs: dict) -> Any:
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self.sync_in_apply:
            grads = self._sync_unsynced(grads, variables, _is_loss_scaling(optimizer))
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
            # each sparse row once whatever the mesh; synced gradients have that already
            # (at no cost here when traced), a gradient made after the tape may not
            group_pairs = [(rows_once(g, variables[i]), variables[i])
                           for g, i in zip(clipped, members)]
            if owner is optimizer:
                results.append(_tf_internals.apply_unscaled(optimizer, apply_group,
                                                            group_pairs, *args, **kwargs))
            else:
                results.append(self._apply_unless_skipped(optimizer, apply_group,
                                                          group_pairs))
        _tag_shard_state(optimizer, variables, self._tagged)
        result = results[0] if results else None
        # weight-sync mode: every K steps (counted after this step) average the replicas
        with tf.control_dependencies([r for r in results if r is not None]
                                     if not tf.executing_eagerly() else []):
            _sync_if_due(optimizer, variables, mesh, self.backward_passes_per_step)
        return result

    # ------------------------------------------------ backward_passes_per_step > 1
    def _accumulator(self, variable: tf.Variable) -> tf.Variable:
        variable = _tf_internals.tf_variable(variable)
        key = variable.ref()
        if key not in self._accumulators:
            name = variable.name.split(":")[0].replace("/", "_") + "_tfhybrid_accumulated"
            with tf.init_scope(), tf.device(variable.device or None):
                self._accumulators[key] = tf.Variable(
                    tf.zeros(variable.shape, variable.dtype.base_dtype), trainable=False,
                    name=name)
        return self._accumulators[key]

    def _pass_counter(self) -> tf.Variable:
        if self._passes is None:
            with tf.init_scope():
                self._passes = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="tfhybrid_backward_passes")
        return self._passes

    def _accumulate_then_apply(self, optimizer: Any, apply_fn: Callable, pairs: list,
                               args: tuple, kwargs: dict) -> Any:
        """Horovod's local gradient aggregation: k calls, one step (see the module doc).

        Every rank calls ``apply_gradients`` equally often, so all take the same branch.
        IndexedSlices are added into dense accumulators (duplicate rows summed), so the
        k-th call syncs them dense.
        """
        k = self.backward_passes_per_step
        accumulators = []
        for grad, var in pairs:
            if grad is None:
                accumulators.append(None)
                continue
            acc = self._accumulator(var)
            if isinstance(grad, tf.IndexedSlices):
                acc.scatter_add(tf.IndexedSlices(tf.cast(grad.values, acc.dtype),
                                                 grad.indices))
            else:
                acc.assign_add(tf.cast(grad, acc.dtype))
            accumulators.append(acc)
        # a tape's synced gradients sum to a synced gradient
        synced = [_is_synced(g) for g, _ in pairs]
        variables = [v for _, v in pairs]
        passes = self._pass_counter().assign_add(1)

        def step():
            summed = []
            for acc, was_synced in zip(accumulators, synced):
                if acc is None:
                    summed.append(None)
                    continue
                value = acc.read_value()
                if self.average_aggregated_gradients:
                    value = value * tf.cast(1.0 / k, value.dtype)
                summed.append(_mark_synced(value) if was_synced else value)
            self._apply(optimizer, apply_fn, list(zip(summed, variables)), args, kwargs)
            for acc in accumulators:
                if acc is not None:
                    acc.assign(tf.zeros_like(acc))
            self._passes.assign(0)
            return tf.constant(True)

        def count_pass():
            # as Horovod's helper: iterations counts every backward pass
            for owner in (optimizer, self.embedding_optimizer):
                if owner is not None:
                    owner.iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(tf.equal(passes, k), step, count_pass)
        return optimizer.iterations

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


def _unscaled(optimizer: Any, pairs: list) -> list:
    """``pairs`` with each gradient divided by the loss scale it carries into
    ``optimizer.apply_gradients``: Keras 3 hands an optimizer the gradients of the scaled
    loss (Keras 2 unscaled ones). Unscaled first, the route syncs, votes, thresholds and
    clips the same gradients under both Kerases, and ``_tf_internals.apply_unscaled``
    applies them without a second division. A tape's tag stays on."""
    scale = _tf_internals.applied_gradient_scale(optimizer, [v for _, v in pairs])
    if scale is None:
        return pairs
    scale = tf.convert_to_tensor(scale)
    out = []
    for grad, var in pairs:
        if grad is not None:
            unscaled = _map_values(grad, lambda v: v / tf.cast(scale, v.dtype))
            grad = _mark_synced(unscaled) if _is_synced(grad) else unscaled
        out.append((grad, var))
    return out


# ------------------------------------------------------------------ tape
class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so ``gradient`` returns gradients synced over the mesh.

    ``gradient`` runs the sync (and, with a loss-scale optimizer or the mixed_float16
    policy, the overflow vote), with Horovod's options: ``op``, ``compression``,
    ``sparse_as_dense``, ``gradient_predivide_factor``, ``device_dense``,
    ``device_sparse``, and (accepted, see the module doc) ``num_groups``, ``groups``,
    ``process_set``, ``scale_local_gradients``. ``op=hvd.Sum`` returns N times the
    average for every variable, shards included (the module doc says why a shard's sum
    is M times its data group's sum).

    ``dct=tfhybrid.compression.DCT(...)`` (with ``optimizer=``, which keeps the residuals)
    thresholds the data-parallel gradients (DCT-DP), on the unscaled gradient under loss
    scaling.

    Clipping, a separate embedding optimizer and weight-sync mode happen where the
    optimizer applies: pass the optimizer as ``optimizer=`` and the tape makes its
    ``apply_gradients`` run the rest of the route (steps 3-5: it applies the tape's
    gradients as they are and never syncs them again), or apply with a
    ``DistributedOptimizer`` (which syncs only gradients no tape synced: a gradient
    transformed after the tape is a new tensor, and is synced again). Weight-sync shards
    without either raise ``ValueError``.

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
                 mesh: mesh_lib.Mesh | None = None, *, device_dense: str = "",
                 device_sparse: str = "", compression: Any = hvd.Compression.none,
                 sparse_as_dense: bool = False, op: Any = hvd.Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Any = None, process_set: Any = None,
                 scale_local_gradients: bool = True,
                 dct: compression_lib.DCT | None = None):
        if optimizer is not None and not hasattr(optimizer, "apply_gradients"):
            raise ValueError(
                f"optimizer={optimizer!r} is not a Keras optimizer; Horovod's options of "
                "tfhybrid.DistributedGradientTape are keywords (device_dense=..., "
                "compression=...)")
        if mesh is not None and not isinstance(mesh, mesh_lib.Mesh):
            raise ValueError(f"mesh={mesh!r} is not a tfhybrid Mesh; pass Horovod's options "
                             "by keyword")
        self._tape = tape
        self._optimizer = optimizer
        self._options = sync_options(
            op=op, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, device_dense=device_dense,
            device_sparse=device_sparse, num_groups=num_groups,
            groups=groups, process_set=process_set,
            scale_local_gradients=scale_local_gradients)
        dct = compression_lib.as_dct(dct)
        if dct is not None and dct.dp_keep is not None and optimizer is None:
            raise ValueError(
                f"dct={dct!r} keeps a residual per variable from step to step; pass the "
                "optimizer too (DistributedGradientTape(tape, optimizer=opt, dct=...)), so "
                "the residuals live as long as it does")
        if optimizer is not None:
            _route_optimizer(optimizer, mesh)
        # the optimizer's own route where it has one, so both halves share one object
        self._route = route_of(optimizer) or GradientRoute(mesh)
        self._route.use_dct(dct)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=None,
                 **kwargs):
        """Synced gradients. ``use_generic_names`` (Horovod's) is accepted: tfhybrid's
        collectives always have generic, rank-independent names."""
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        if self._optimizer is None and any(weight_sync_every(v) is not None
                                           for v in flat_sources):
            raise ValueError(
                "these variables include shards in weight-sync mode (replica_sync="
                "'weights'), whose replicas are averaged after the optimizer steps; pass "
                "the optimizer: tfhybrid.DistributedGradientTape(tape, optimizer=opt), or "
                "apply with tfhybrid.DistributedOptimizer(opt)")
        loss_scale = None
        if self._optimizer is not None:
            loss_scaling = _is_loss_scaling(self._optimizer)
            # a tape's gradients are those of the scaled loss (Keras 3: also of a fixed
            # loss_scale_factor, which skips no step)
            loss_scale = _tf_internals.loss_scale(self._optimizer)
        else:
            loss_scaling = tf.keras.mixed_precision.global_policy().name == "mixed_float16"
        flat_grads = self._route.sync(tf.nest.flatten(grads), flat_sources, loss_scaling,
                                      self._options, loss_scale)
        return tf.nest.pack_sequence_as(grads, [_mark_synced(g) for g in flat_grads])

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)


def _keep_table_state_in_checkpoints(optimizer: Any) -> None:
    """Checkpoints keep the optimizer's slots of DistributedEmbedding tables under
    mesh-independent names, so they restore onto another mesh
    (tfhybrid/checkpoint/slots.py)."""
    checkpoint_slots.attach_optimizer(optimizer)
    checkpoint_weights_file.attach_optimizer(optimizer)


def _route_optimizer(optimizer: Any, mesh: mesh_lib.Mesh | None) -> None:
    """Makes ``optimizer.apply_gradients`` run the route's steps 3-5 (once per optimizer):
    the tape that was given the optimizer has synced its gradients already."""
    if route_of(optimizer) is not None:
        return
    route = GradientRoute(mesh, sync_in_apply=False)
    _ADDED_ROUTES[optimizer] = route
    _tf_internals.wrap_apply_gradients(
        optimizer, lambda own_apply, grads_and_vars, *args, **kwargs: route.apply(
            optimizer, own_apply, grads_and_vars, *args, **kwargs))
    _keep_table_state_in_checkpoints(optimizer)


# The routes of optimizers a DistributedGradientTape was given (their own class is the
# user's; a DistributedOptimizer's class carries its route).
_ADDED_ROUTES: "weakref.WeakKeyDictionary[Any, GradientRoute]" = weakref.WeakKeyDictionary()


def route_of(optimizer: Any) -> "GradientRoute | None":
    """The gradient route that ``optimizer`` applies through: a DistributedOptimizer's,
    or the one a DistributedGradientTape gave it; None for a plain optimizer."""
    if optimizer is None:
        return None
    route = getattr(type(optimizer), "_gradient_route", None)
    return route if route is not None else _ADDED_ROUTES.get(optimizer)


# -------------------------------------------------------------- optimizer
class _RoutedApply:
    _gradient_route: GradientRoute

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        return self._gradient_route.apply(self, super().apply_gradients, grads_and_vars,
                                          *args, **kwargs)

    @property
    def embedding_optimizer(self) -> Any:
        """The optimizer of the embedding tables, or None (this one applies them too)."""
        return self._gradient_route.embedding_optimizer


class _RoutedBuild:
    """``build`` of a new Keras optimizer with an embedding optimizer: Keras may build
    an optimizer with every trainable variable (tf-keras >= 2.16's BackupAndRestore does,
    before it restores), and the tables' slots belong to the embedding optimizer."""
    _gradient_route: GradientRoute

    def build(self, var_list):
        embedding_optimizer = self._gradient_route.embedding_optimizer
        var_list = list(var_list)
        if embedding_optimizer is not None:
            tables = [v for v in var_list if is_embedding(v)]
            if tables:
                embedding_optimizer.build(tables)
            var_list = [v for v in var_list if not is_embedding(v)]
        return super().build(var_list)


def DistributedOptimizer(optimizer: tf.keras.optimizers.Optimizer,
                         mesh: mesh_lib.Mesh | None = None,
                         embedding_optimizer: tf.keras.optimizers.Optimizer | None = None,
                         *, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = hvd.Compression.none,
                         sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = hvd.Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = None,
                         scale_local_gradients: bool = True, use_locking: bool = False,
                         dct: compression_lib.DCT | None = None):
    """Returns a copy of a Keras optimizer whose ``apply_gradients`` runs the whole route.

    Works in custom loops and in ``model.fit`` (which calls ``apply_gradients``). Under
    the ``mixed_float16`` policy it wraps the optimizer in a ``LossScaleOptimizer`` first
    (as ``model.compile`` would), and all ranks skip a step together when any rank's
    gradients overflow. Its ``apply_gradients`` takes gradients as the Keras in use
    hands them to a LossScaleOptimizer: Keras 2 unscaled (``get_unscaled_gradients``),
    Keras 3 those of ``scale_loss(loss)`` (also of a fixed ``loss_scale_factor``); the
    route unscales Keras 3's first, so both Kerases sync, clip and skip the same
    gradients. ``embedding_optimizer`` (row-wise AdaGrad, say) then applies the
    gradients of ``DistributedEmbedding``'s tables, and ``optimizer`` those of every
    other variable; each clips with its own settings over its own variables.

    Horovod's keywords (``horovod.tensorflow.keras.DistributedOptimizer``'s, and
    ``use_locking`` of ``horovod.tensorflow``'s) keep Horovod's meaning; the module doc
    lists them. In short: ``op=hvd.Sum`` makes every gradient N times the average (for a
    shard, M times the sum over its data group, since the layer already scaled it by
    1/M); ``compression`` sends gradients compressed; ``sparse_as_dense`` densifies
    IndexedSlices first; ``backward_passes_per_step=k`` sums k calls' local gradients
    (divided by k with ``average_aggregated_gradients``) and steps on every k-th call,
    while ``iterations`` counts every call. Gradients a ``DistributedGradientTape``
    returned are not synced again. ``dct=tfhybrid.compression.DCT(...)`` thresholds the
    data-parallel gradients (DCT-DP: only the largest entries are sent, the rest carried
    over in a per-rank residual; tfhybrid/compression.py).

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
    if mesh is not None and not isinstance(mesh, mesh_lib.Mesh):
        raise ValueError(
            f"mesh={mesh!r} is not a tfhybrid Mesh: tfhybrid.DistributedOptimizer's second "
            "argument is the mesh; pass Horovod's options by keyword (name=..., "
            "compression=...)")
    options = sync_options(
        op=op, compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, device_dense=device_dense,
        device_sparse=device_sparse, name=name, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be an "
                         "int >= 1")
    if not isinstance(average_aggregated_gradients, bool):
        raise ValueError(f"average_aggregated_gradients={average_aggregated_gradients!r} "
                         "must be True or False")
    if use_locking:
        _log_once("tfhybrid: use_locking=True is ignored: Keras optimizers take no locks")
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
    if not hasattr(optimizer, "apply_gradients") or not hasattr(optimizer, "get_config"):
        raise ValueError(f"optimizer={optimizer!r} is not a Keras optimizer")
    if (tf.keras.mixed_precision.global_policy().name == "mixed_float16"
            and not _is_loss_scaling(optimizer)):
        # Keras would wrap us in a loss-scale optimizer whose skip decision is local;
        # wrapping it inside lets every rank agree on each skip (_agree_on_overflow).
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    base = optimizer.__class__
    route = GradientRoute(mesh, embedding_optimizer, options, backward_passes_per_step,
                          average_aggregated_gradients, dct=dct)
    # legacy Keras optimizers make their slots per variable, in apply_gradients
    mixins = (_RoutedApply, _RoutedBuild) if hasattr(base, "build") else (_RoutedApply,)
    cls = type(base.__name__, mixins + (base,), {"_gradient_route": route})
    routed = cls.from_config(optimizer.get_config())
    if embedding_optimizer is not None:
        # a checkpoint child, so checkpoints of the optimizer hold its slots too (under
        # the name checkpoints have always used for it)
        _tf_internals.track_child(routed, "_tfhybrid_embedding_optimizer",
                                  embedding_optimizer)
    _keep_table_state_in_checkpoints(routed)
    return routed


# -------------------------------------------------------------- broadcast
def optimizer_variables(optimizer: Any) -> list:
    """An optimizer's variables (new Keras: a property; legacy: a method), with those of
    a DistributedOptimizer's embedding optimizer."""
    if optimizer is None:
        return []
    found = optimizer.variables
    found = list(found() if callable(found) and not isinstance(found, list) else found)
    embedding_optimizer = getattr(optimizer, "embedding_optimizer", None)
    if embedding_optimizer is not None:
        found += optimizer_variables(embedding_optimizer)
    return found


def _lives_on_one_position(variables: Sequence[tf.Variable]) -> list[bool]:
    """Which variables are shards or their optimizer slots: one copy per replica.

    Slots are known by the tag the route sets when it first applies, or else by name (a
    slot's name holds its variable's, as Keras and tfhybrid's optimizers name them).
    """
    flags = [is_model_parallel(v) or roles.role_of(v).shard_state
             for v in variables]
    shards = [v for v in variables if is_model_parallel(v)]
    return [flag or any(_tf_internals.is_slot_of(v, shard) for shard in shards)
            for v, flag in zip(variables, flags)]


def _signature(variables: Sequence[tf.Variable]) -> list[tuple]:
    return [(v.name, tuple(v.shape.as_list()), v.dtype.base_dtype.name) for v in variables]


def _check_broadcast_lists(replicated: list, shards: list, mesh: mesh_lib.Mesh) -> None:
    """Raises ``ValueError`` on every rank alike unless all ranks pass equal variable lists
    (shapes and dtypes; shards: equal inside each data group): a broadcast of mismatched
    lists would hang or mix variables up."""
    everyone = hvd.allgather_object(
        (mesh.model_position, _signature(replicated), _signature(shards)),
        name="tfhybrid_broadcast_check")
    # every rank runs the same comparisons on the same lists, so all raise alike
    first_of_position: dict[int, int] = {}
    for rank, (position, replicated_sig, shard_sig) in enumerate(everyone):
        first = first_of_position.setdefault(position, rank)
        for kind, other, want, got in (("replicated", 0, everyone[0][1], replicated_sig),
                                       ("model-parallel", first, everyone[first][2],
                                        shard_sig)):
            if [s[1:] for s in want] == [s[1:] for s in got]:
                continue
            detail = (f"it passes {len(got)} {kind} variables, rank {other} passes "
                      f"{len(want)}")
            for j, (a, b) in enumerate(zip(want, got)):
                if a[1:] != b[1:]:
                    detail = (f"its {kind} variable #{j} is {b[0]!r} {list(b[1])} {b[2]}, "
                              f"rank {other}'s is {a[0]!r} {list(a[1])} {a[2]}")
                    break
            raise ValueError(
                f"broadcast_variables: rank {rank}'s variables differ from rank {other}'s: "
                f"{detail}; every rank must pass its variables in the same order")


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int = 0,
                        mesh: mesh_lib.Mesh | None = None, *, process_set: Any = None,
                        inplace: bool = False) -> None:
    """Makes every copy of every variable equal to the copy in ``root_rank``'s replica.

    As DE's ``broadcast_variables`` (which replaces Horovod's for hybrid models), and
    typically called after the first step with the model's and the optimizer's
    variables:

    - replicated variables (dense layers, data-parallel tables, their optimizer slots,
      ``iterations``, loss scales) come from global rank ``root_rank``;
    - a model-parallel shard and its optimizer slots are broadcast inside the shard's
      data group only, from the member in ``root_rank``'s replica (the root itself may
      hold other shards). With D = 1 each shard has one copy and is left alone, as DE
      leaves its model-parallel variables alone. After it every replica is the same model,
      so every rank's outputs match.

    The layer's empty alltoall anchor is skipped. Every rank must call it with its
    variables in the same order; eagerly, mismatched lists raise ``ValueError`` on every
    rank (instead of a hang). ``process_set`` (Horovod's) may only be the global set;
    ``inplace`` is accepted (variables are always assigned in place).

    Example (one process: every variable is already its own root's)::

        import tensorflow as tf
        import tfhybrid
        tfhybrid.init(model_parallel=1)
        tfhybrid.broadcast_variables([tf.Variable([1.0])])
    """
    mesh = mesh or mesh_lib.current_mesh()
    if not _is_global_process_set(process_set):
        raise ValueError(f"process_set={process_set!r} is not supported: tfhybrid broadcasts "
                         "replicated variables over all ranks and shards over their data "
                         "groups")
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not (
            0 <= root_rank < mesh.size):
        raise ValueError(f"root_rank={root_rank!r} is not a rank in [0, {mesh.size})")
    variables = list(variables)
    one_position = _lives_on_one_position(variables)
    variables = [_tf_internals.tf_variable(v) for v in variables]
    replicated, shards = [], []
    for var, local in zip(variables, one_position):
        if roles.role_of(var).local_only or var.shape.num_elements() == 0:
            continue
        (shards if local else replicated).append(var)
    if mesh.size == 1:
        return
    if tf.executing_eagerly():
        _check_broadcast_lists(replicated, shards, mesh)
    # Horovod's root_rank is a global rank, also inside a process set: a shard's root is
    # the member of its data group in root_rank's replica
    root_replica = next(d for d, group in enumerate(mesh.model_groups) if root_rank in group)
    shard_root = mesh.model_groups[root_replica][mesh.model_position]

    def assign_all():
        for var in replicated:
            var.assign(collectives.broadcast(var, root_rank, "tfhybrid_broadcast",
                                             hvd.global_process_set))
        if mesh.data_parallel > 1:
            for var in shards:
                var.assign(collectives.broadcast(var, shard_root, "tfhybrid_broadcast_shard",
                                                 mesh.data_process_set))

    tiered = [tiers.table_of(var) for var in shards if tiers.table_of(var) is not None]
    if tf.executing_eagerly():
        # one function, so Horovod negotiates (and fuses) the broadcasts together
        tf.function(assign_all, autograph=False)()
    elif tiered and mesh.data_parallel > 1:
        raise ValueError(
            f"broadcast_variables inside a tf.function cannot send tiered tables "
            f"{[t.name for t in tiered]} (cache_rows: most rows are in files); call it "
            "eagerly, as tfhybrid.callbacks.BroadcastGlobalVariablesCallback does")
    else:
        assign_all()
    if mesh.data_parallel > 1:
        for table in tiered:
            _broadcast_tier(table, shard_root, mesh)
            table.mark_replicas_alike()


def _broadcast_tier(table: Any, root: int, mesh: mesh_lib.Mesh) -> None:
    """A tiered shard's rows and row state, file and cache, from ``root`` (its data
    group's member in the root replica), a block at a time."""
    table.flush()
    for start, stop in table.blocks():
        values, state = (collectives.broadcast(
            tf.constant(read(start, stop)), root, f"tfhybrid_broadcast_tier_{what}",
            mesh.data_process_set).numpy()
            for what, read in (("rows", table.read_rows),
                               ("state", table.read_accumulator)))
        table.write_rows(start, values, state)
