"""``DistributedOptimizer``: a copy of a Keras optimizer whose ``apply_gradients`` runs the
whole route; and the route a ``DistributedGradientTape`` adds to the optimizer it is
given (``route_optimizer``), found again by ``route_of``."""

from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf
import horovod.tensorflow as hvd

from tfhybrid import _tf_internals
from tfhybrid import compression as compression_lib
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid.checkpoint import slots as checkpoint_slots
from tfhybrid.checkpoint import weights_file as checkpoint_weights_file
from tfhybrid.distributed import options as options_lib
from tfhybrid.distributed.route import GradientRoute
from tfhybrid.slot_owners import is_loss_scaling
from tfhybrid.table_optimizers import TableOptimizers


def _keep_table_state_in_checkpoints(optimizer: Any) -> None:
    """Checkpoints keep the optimizer's slots of DistributedEmbedding tables under
    mesh-independent names, so they restore onto another mesh
    (tfhybrid/checkpoint/slots.py)."""
    checkpoint_slots.attach_optimizer(optimizer)
    checkpoint_weights_file.attach_optimizer(optimizer)


def route_optimizer(optimizer: Any, mesh: mesh_lib.Mesh | None) -> None:
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
# user's), and of the classes DistributedOptimizer makes (every instance of one, copies
# Keras makes from its config included, applies through its route).
_ADDED_ROUTES: "weakref.WeakKeyDictionary[Any, GradientRoute]" = weakref.WeakKeyDictionary()
_CLASS_ROUTES: "weakref.WeakKeyDictionary[type, GradientRoute]" = weakref.WeakKeyDictionary()


def route_of(optimizer: Any) -> "GradientRoute | None":
    """The gradient route that ``optimizer`` applies through: a DistributedOptimizer's,
    or the one a DistributedGradientTape gave it; None for a plain optimizer."""
    if optimizer is None:
        return None
    # a subclass of a routed class applies through the route it inherits
    route = next((_CLASS_ROUTES[cls] for cls in type(optimizer).__mro__
                  if cls in _CLASS_ROUTES), None)
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
            tables = [v for v in var_list if roles.is_embedding(v)]
            if tables:
                embedding_optimizer.build(tables)
            var_list = [v for v in var_list if not roles.is_embedding(v)]
        return super().build(var_list)


def DistributedOptimizer(optimizer: tf.keras.optimizers.Optimizer,
                         mesh: mesh_lib.Mesh | None = None,
                         embedding_optimizer: Any = None,
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
    other variable; each clips with its own settings over its own variables. A dict
    ``{"table name": optimizer, ...}`` (or a ``tfhybrid.table_optimizers.TableOptimizers``)
    gives each table an optimizer of its own (every table needs one; a key may also be
    ``"<layer name>/<table name>"``): each applies, clips and checkpoints its tables'
    gradients and slots as a single embedding optimizer does all of them.

    Horovod's keywords (``horovod.tensorflow.keras.DistributedOptimizer``'s, and
    ``use_locking`` of ``horovod.tensorflow``'s) keep Horovod's meaning; the package doc
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
    options = options_lib.sync_options(
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
        options_lib.log_once("tfhybrid: use_locking=True is ignored: Keras optimizers take no locks")
    if isinstance(embedding_optimizer, dict):
        # one optimizer per table (ValueError names a key or optimizer that is not one)
        embedding_optimizer = TableOptimizers(embedding_optimizer)
    if embedding_optimizer is not None and not isinstance(embedding_optimizer,
                                                          TableOptimizers):
        if is_loss_scaling(embedding_optimizer) or isinstance(embedding_optimizer,
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
            and not is_loss_scaling(optimizer)):
        # Keras would wrap us in a loss-scale optimizer whose skip decision is local;
        # wrapping it inside lets every rank agree on each skip (sync.agree_on_overflow).
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    base = optimizer.__class__
    route = GradientRoute(mesh, embedding_optimizer, options, backward_passes_per_step,
                          average_aggregated_gradients, dct=dct)
    # legacy Keras optimizers make their slots per variable, in apply_gradients
    mixins = (_RoutedApply, _RoutedBuild) if hasattr(base, "build") else (_RoutedApply,)
    cls = type(base.__name__, mixins + (base,), {"_gradient_route": route})
    _CLASS_ROUTES[cls] = route
    routed = cls.from_config(optimizer.get_config())
    if embedding_optimizer is not None:
        # a checkpoint child, so checkpoints of the optimizer hold its slots too (under
        # the name checkpoints have always used for it)
        _tf_internals.track_child(routed, "_tfhybrid_embedding_optimizer",
                                  embedding_optimizer)
    _keep_table_state_in_checkpoints(routed)
    return routed

