"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient`` runs the route's
steps 1-2; with ``optimizer=``, that optimizer's ``apply_gradients`` runs steps 3-5."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import horovod.tensorflow as hvd

from tfhybrid import _tf_internals
from tfhybrid import compression as compression_lib
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid.distributed import optimizer as optimizer_lib
from tfhybrid.distributed import options as options_lib
from tfhybrid.distributed.route import GradientRoute
from tfhybrid.slot_owners import is_loss_scaling


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so ``gradient`` returns gradients synced over the mesh.

    ``gradient`` runs the sync (and, with a loss-scale optimizer or the mixed_float16
    policy, the overflow vote), with Horovod's options: ``op``, ``compression``,
    ``sparse_as_dense``, ``gradient_predivide_factor``, ``device_dense``,
    ``device_sparse``, and (accepted, see the package doc) ``num_groups``, ``groups``,
    ``process_set``, ``scale_local_gradients``. ``op=hvd.Sum`` returns N times the
    average for every variable, shards included (the package doc says why a shard's sum
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
        self._options = options_lib.sync_options(
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
            optimizer_lib.route_optimizer(optimizer, mesh)
        # the optimizer's own route where it has one, so both halves share one object
        self._route = optimizer_lib.route_of(optimizer) or GradientRoute(mesh)
        self._route.use_dct(dct)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=None,
                 **kwargs):
        """Synced gradients. ``use_generic_names`` (Horovod's) is accepted: tfhybrid's
        collectives always have generic, rank-independent names."""
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        if self._optimizer is None and any(roles.weight_sync_every(v) is not None
                                           for v in flat_sources):
            raise ValueError(
                "these variables include shards in weight-sync mode (replica_sync="
                "'weights'), whose replicas are averaged after the optimizer steps; pass "
                "the optimizer: tfhybrid.DistributedGradientTape(tape, optimizer=opt), or "
                "apply with tfhybrid.DistributedOptimizer(opt)")
        loss_scale = None
        if self._optimizer is not None:
            loss_scaling = is_loss_scaling(self._optimizer)
            # a tape's gradients are those of the scaled loss (Keras 3: also of a fixed
            # loss_scale_factor, which skips no step)
            loss_scale = _tf_internals.loss_scale(self._optimizer)
        else:
            loss_scaling = tf.keras.mixed_precision.global_policy().name == "mixed_float16"
        flat_grads = self._route.sync(tf.nest.flatten(grads), flat_sources, loss_scaling,
                                      self._options, loss_scale)
        return tf.nest.pack_sequence_as(grads, [roles.mark_synced(g) for g in flat_grads])

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)

