"""Steps 1 and 2 of the route: each gradient reduced over its process set
(``allreduce_gradients``), each sparse gradient's rows once (``rows_once``), and the
overflow vote under loss scaling (``agree_on_overflow``). The package docstring says why
the averages below equal one process on the global batch.

Example (one process: every process set is one rank, so the gradient stays)::

    import tensorflow as tf
    import tfhybrid
    from tfhybrid.distributed.sync import allreduce_gradients
    tfhybrid.init(model_parallel=1)
    w = tf.Variable([1.0, 2.0])
    assert allreduce_gradients([tf.constant([0.5, 1.0])], [w])[0].numpy().tolist() == [0.5, 1.0]
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
import horovod.tensorflow as hvd

from tfhybrid import collectives
from tfhybrid import compression as compression_lib
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid.distributed import gradients
from tfhybrid.distributed.options import SyncOptions
from tfhybrid.plan.traffic import sync_is_sparse

# Without a static row count, a sparse gradient is sent sparse when its table is at least
# this many elements: every rank sees the same static shapes, so all choose alike.
_SPARSE_DEFAULT_MIN_ELEMENTS = 1 << 16


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
    route once the step is known to apply (the route's step 2, ``GradientRoute.sync``). Gradients
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
        if roles.weight_sync_every(var) is not None:
            # the replica steps on its own G_d / M, the gradient of the mean loss over its
            # model group's samples; no collective here (Sum: N times that)
            if not average:
                reduced[i] = gradients.scaled(grad, float(mesh.size))
            continue
        if roles.is_model_parallel(var):
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
            reduced[i] = grad if average else gradients.scaled(grad, post)
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
    if not isinstance(grad, tf.IndexedSlices) or roles.weight_sync_every(variable) is not None:
        return grad
    indices = grad.indices
    if not tf.executing_eagerly() and hasattr(indices, "op") \
            and indices.op.type in _DISTINCT_INDEX_OPS and indices.value_index == 0:
        return grad
    return gradients.sum_duplicates(grad)


def agree_on_overflow(grads: list, mesh: mesh_lib.Mesh) -> tuple[list, tf.Tensor | None]:
    """Makes every rank see a non-finite gradient if any rank has one; also returns
    whether every rank's gradients are finite (None on one rank: nothing was voted).

    The loss-scale optimizer skips a step and lowers its scale when a gradient overflows.
    Shards differ between ranks, so without this one rank could skip while another steps,
    and their loss scales would drift apart.
    """
    if mesh.size == 1:
        return grads, None
    # a rank with no gradient still joins the vote
    everywhere = collectives.allreduce(tf.cast(all_finite(grads), tf.float32), op=hvd.Min,
                                       name="tfhybrid_all_finite")
    poison = tf.where(everywhere > 0, 0.0, float("nan"))
    return [None if g is None else gradients.plus(g, poison) for g in grads], everywhere > 0


def all_finite(grads: list) -> tf.Tensor:
    """Whether this rank's gradients (None ones skipped) are all finite."""
    present = [g for g in grads if g is not None]
    if not present:
        return tf.constant(True)
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(gradients.values_of(g))) for g in present])
