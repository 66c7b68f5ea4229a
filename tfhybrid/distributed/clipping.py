"""Step 3 of the route: clipping with norms over the whole mesh, as one process clips
the global batch's gradient (each shard counted once, each replicated variable once;
per-table norms for ``clipnorm``).

Example (one process: the norm of [3, 4] is 5, clipped to 1)::

    import tensorflow as tf
    import tfhybrid
    from tfhybrid.distributed.clipping import clip, clip_settings
    tfhybrid.init(model_parallel=1)
    settings = clip_settings(tf.keras.optimizers.SGD(global_clipnorm=1.0))
    w = tf.Variable([0.0, 0.0])
    clipped = clip([tf.constant([3.0, 4.0])], [w], settings, tfhybrid.current_mesh())
    assert abs(float(tf.norm(clipped[0])) - 1.0) < 1e-6
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
import horovod.tensorflow as hvd

from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid.distributed import gradients
from tfhybrid.slot_owners import base_optimizer


def clip_settings(optimizer: Any) -> dict[str, float]:
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


def _squared_norm(grad) -> tf.Tensor:
    return tf.reduce_sum(tf.square(tf.cast(gradients.values_of(grad), tf.float32)))


def clip(grads: list, variables: Sequence[tf.Variable], settings: dict[str, float],
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
    # each row once: its values' norm is then the gradient's norm
    grads = [gradients.sum_duplicates(g) if isinstance(g, tf.IndexedSlices) else g
             for g in grads]
    if "clipvalue" in settings:
        limit = settings["clipvalue"]
        return [None if g is None else gradients.map_values(
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
        return [None if g is None else gradients.scaled(g, factor) for g in grads]
    limit = settings["clipnorm"]
    clipped = list(grads)
    for i, (grad, var) in enumerate(zip(grads, variables)):
        if grad is None or roles.role_of(var).local_only:
            continue
        square = own_norms[i] if own_norms[i] is not None else table_norms[
            roles.role_of(var).table_key]
        clipped[i] = gradients.scaled(grad, limit / tf.maximum(tf.sqrt(square), limit))
    return clipped
