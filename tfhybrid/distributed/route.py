"""The route's one object: ``GradientRoute`` runs steps 1-5 of the package doc in order,
for ``DistributedOptimizer`` (``apply``) and ``DistributedGradientTape`` (``sync`` in
``gradient``, the rest where its optimizer applies), so the two cannot differ.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import compression as compression_lib
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid.distributed import clipping
from tfhybrid.distributed import gradients
from tfhybrid.distributed import sync
from tfhybrid.distributed import weight_sync
from tfhybrid.distributed.options import SyncOptions
from tfhybrid.slot_owners import PerTableOptimizers, each_optimizer, is_loss_scaling


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
    """The whole path of a gradient over the mesh (steps 1-5 of the package doc).

    ``DistributedOptimizer`` runs ``apply``, which syncs every gradient no tape synced
    before. ``DistributedGradientTape`` runs ``sync`` in ``gradient``; an optimizer
    handed to the tape as ``optimizer=`` gets a route with ``sync_in_apply=False``, whose
    ``apply`` runs steps 3-5 only. ``backward_passes_per_step=k`` accumulates k calls of
    ``apply`` before one step (see the package doc).

    Example (one process: the sync leaves the gradient, SGD steps by it)::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.distributed import GradientRoute
        tfhybrid.init(model_parallel=1)
        w, optimizer = tf.Variable([1.0]), tf.keras.optimizers.SGD(0.5)
        GradientRoute().apply(optimizer, optimizer.apply_gradients,
                              [(tf.constant([1.0]), w)])
        assert w.numpy().tolist() == [0.5]
    """

    def __init__(self, mesh: mesh_lib.Mesh | None = None, embedding_optimizer: Any = None,
                 options: SyncOptions | None = None, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, sync_in_apply: bool = True,
                 dct: compression_lib.DCT | None = None):
        _tf_internals.install_autograph_rule()
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
            grads = sync.allreduce_gradients(grads, variables, self.mesh,
                                        options or self.options, self.thresholder, loss_scale)
            return self._vote_and_commit(grads, loss_scaling)

    def _vote_and_commit(self, grads: list, loss_scaling: bool) -> list:
        """Step 2, the overflow vote under loss scaling; then DCT-DP stores this step's
        residuals only if the gradients are finite (on every rank, where there was a
        vote): a skipped step must not drop what the residuals held."""
        applied = None
        if loss_scaling:
            grads, applied = sync.agree_on_overflow(grads, self.mesh)
        if self.thresholder is not None and self.thresholder.staged:
            self.thresholder.commit(sync.all_finite(grads) if applied is None else applied)
        return grads

    def _sync_unsynced(self, grads: list, variables: list, loss_scaling: bool) -> list:
        """Step 1 for the gradients no tape synced; step 2 for all. Every rank runs the
        vote, whichever gradients it had left to sync."""
        todo = [i for i, g in enumerate(grads) if g is not None and not roles.is_synced(g)]
        if self.thresholder is not None and len(todo) < sum(g is not None for g in grads) \
                and not self._warned_synced:
            self._warned_synced = True
            tf.get_logger().warning(
                "tfhybrid: gradients reached this optimizer already synced by a "
                "DistributedGradientTape without optimizer=: DCT-DP did not threshold "
                "them. Pass optimizer= to the tape (its dct= then applies) to compress.")
        synced = sync.allreduce_gradients([grads[i] for i in todo], [variables[i] for i in todo],
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
        pairs = unscaled(optimizer, list(grads_and_vars))
        with tf.variable_creator_scope(_made_eagerly):
            if self.backward_passes_per_step > 1:
                return self._accumulate_then_apply(optimizer, apply_fn, pairs, args, kwargs)
            return self._apply(optimizer, apply_fn, pairs, args, kwargs)

    def _apply(self, optimizer: Any, apply_fn: Callable, pairs: list, args: tuple,
               kwargs: dict) -> Any:
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self.sync_in_apply:
            grads = self._sync_unsynced(grads, variables, is_loss_scaling(optimizer))
        mesh = self.mesh
        groups = [(optimizer, apply_fn, list(range(len(pairs))))]
        if self.embedding_optimizer is not None:
            tables = [i for i, v in enumerate(variables) if roles.is_embedding(v)]
            dense = [i for i, v in enumerate(variables) if not roles.is_embedding(v)]
            groups = [(optimizer, apply_fn, dense)] + [
                (owner, owner.apply_gradients, [tables[j] for j in members])
                for owner, members in _table_groups(self.embedding_optimizer,
                                                    [variables[i] for i in tables])]
        results = []
        for owner, apply_group, members in groups:
            if not members:
                continue
            clipped = clipping.clip([grads[i] for i in members], [variables[i] for i in members],
                            clipping.clip_settings(owner), mesh)
            # each sparse row once whatever the mesh; synced gradients have that already
            # (at no cost here when traced), a gradient made after the tape may not
            group_pairs = [(sync.rows_once(g, variables[i]), variables[i])
                           for g, i in zip(clipped, members)]
            if owner is optimizer:
                results.append(_tf_internals.apply_unscaled(optimizer, apply_group,
                                                            group_pairs, *args, **kwargs))
            else:
                results.append(self._apply_unless_skipped(optimizer, apply_group,
                                                          group_pairs))
        weight_sync.tag_shard_state(optimizer, variables, self._tagged)
        result = results[0] if results else None
        # weight-sync mode: every K steps (counted after this step) average the replicas
        with tf.control_dependencies([r for r in results if r is not None]
                                     if not tf.executing_eagerly() else []):
            weight_sync.sync_if_due(optimizer, variables, mesh, self.backward_passes_per_step)
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
        """Horovod's local gradient aggregation: k calls, one step (see the package doc).

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
        synced = [roles.is_synced(g) for g, _ in pairs]
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
                summed.append(roles.mark_synced(value) if was_synced else value)
            self._apply(optimizer, apply_fn, list(zip(summed, variables)), args, kwargs)
            for acc in accumulators:
                if acc is not None:
                    acc.assign(tf.zeros_like(acc))
            self._passes.assign(0)
            return tf.constant(True)

        def count_pass():
            # as Horovod's helper: iterations counts every backward pass
            for owner in [optimizer] + each_optimizer(self.embedding_optimizer):
                owner.iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(tf.equal(passes, k), step, count_pass)
        return optimizer.iterations

    @staticmethod
    def _apply_unless_skipped(optimizer: Any, apply_fn: Callable, pairs: list) -> Any:
        """The embedding optimizer's step, skipped with the loss-scale optimizer's."""
        if not is_loss_scaling(optimizer):
            return apply_fn(pairs)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(gradients.values_of(g)))
                                for g, _ in pairs if g is not None] or [tf.constant(True)])

        def step():
            apply_fn(pairs)
            return tf.constant(True)

        return tf.cond(finite, step, lambda: tf.constant(False))


def _table_groups(embedding_optimizer: Any, variables: list) -> list[tuple[Any, list[int]]]:
    """(optimizer, positions in ``variables``) of the embedding optimizer, or of each
    per-table one: each clips and applies its own (the same groups on every rank)."""
    if isinstance(embedding_optimizer, PerTableOptimizers):
        groups = embedding_optimizer.split(variables)
        if not embedding_optimizer.built:
            # all of them before any steps: Keras builds an optimizer in its first
            # apply, and a restore waiting for the tables' slots is handed over once
            # every one has them
            embedding_optimizer.build(variables)
        return groups
    return [(embedding_optimizer, list(range(len(variables))))]


def unscaled(optimizer: Any, pairs: list) -> list:
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
            unscaled = gradients.map_values(grad, lambda v: v / tf.cast(scale, v.dtype))
            grad = roles.mark_synced(unscaled) if roles.is_synced(grad) else unscaled
        out.append((grad, var))
    return out

