"""Keras callbacks for training on the mesh with ``model.fit``."""

from __future__ import annotations

import tensorflow as tf

from tfhybrid import _tf_internals  # first: checks which Keras tf.keras is
from tfhybrid import collectives
from tfhybrid import distributed
from tfhybrid import mesh as mesh_lib
from tfhybrid import slot_owners
from tfhybrid.layers.distributed_embedding import DistributedEmbedding
from tfhybrid.optimizer_traits import Trains, trains_of


class BroadcastGlobalVariablesCallback(tf.keras.callbacks.Callback):
    """Horovod's and DE's broadcast callback: after the first batch, every rank's model
    and optimizer variables become those of ``root_rank``'s replica.

    As ``horovod.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback`` (and DE's
    hybrid version of it), it broadcasts once, at the end of the first training batch,
    when ``fit`` has built the model and the optimizer, the model's variables and then
    the optimizer's (its slots, ``iterations``, a loss scale, and a
    ``DistributedOptimizer``'s embedding optimizer's). The rule of
    ``tfhybrid.broadcast_variables`` applies: replicated variables come from global rank
    ``root_rank``; each model-parallel shard and its slots come from its copy in
    ``root_rank``'s replica, inside its data group. The first step itself is taken from
    each rank's own starting weights, as under Horovod. ``device`` is where the broadcasts
    run (Horovod's argument); ``register_local_var(var)`` (Horovod's) keeps a variable out
    of the broadcast.

    Example::

        model.fit(ds, callbacks=[tfhybrid.BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank: int = 0, device: str = "",
                 mesh: mesh_lib.Mesh | None = None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self._mesh = mesh
        self.broadcast_done = False
        self._local_vars: set = set()

    def register_local_var(self, var: tf.Variable) -> None:
        """Keeps ``var`` out of the broadcast (Horovod's worker-local variables)."""
        self._local_vars.add(_tf_internals.tf_variable(var).ref())

    def _broadcast(self) -> None:
        """The one rule: model variables, then optimizer variables, once."""
        if self.broadcast_done:
            return
        model_variables = list(self.model.variables) if self.model.built else []
        if not model_variables:
            return  # nothing built yet: try again after the next batch
        variables = [v for v in model_variables + distributed.optimizer_variables(
            getattr(self.model, "optimizer", None))
            if _tf_internals.tf_variable(v).ref() not in self._local_vars]
        with tf.device(self.device):
            distributed.broadcast_variables(variables, self.root_rank,
                                            self._mesh or mesh_lib.current_mesh())
        self.broadcast_done = True

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._broadcast()


class BroadcastVariables(BroadcastGlobalVariablesCallback):
    """``BroadcastGlobalVariablesCallback`` that broadcasts before the first step when it
    can: at the start of training if the model already has its weights (so every rank
    takes the first step from the same weights), else after the first batch, once
    ``fit`` has built the model. Until then ranks may hold different dense weights, so the
    first step is exact only when every rank starts equal (seeded initializers); build
    the model before ``fit`` (call it on a batch) to broadcast before the first step. It
    never counts as done while the model has no weights. ``tfhybrid.callbacks.defaults``
    holds one.

    Example::

        model.fit(ds, callbacks=[tfhybrid.callbacks.BroadcastVariables()])
    """

    def __init__(self, root_rank: int = 0, mesh: mesh_lib.Mesh | None = None,
                 device: str = ""):
        super().__init__(root_rank, device, mesh)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._broadcast()


class SyncReplicas(tf.keras.callbacks.Callback):
    """Averages weight-sync shards and their optimizer state over their data groups.

    ``tfhybrid.DistributedOptimizer`` already syncs every ``sync_every`` steps inside the
    train step; this callback adds a sync every ``every_n_batches`` batches (if set) and at
    the end of every epoch, so evaluation and checkpoints see identical replicas.

    Example::

        model.fit(ds, callbacks=[tfhybrid.callbacks.SyncReplicas()])
    """

    def __init__(self, every_n_batches: int | None = None, mesh: mesh_lib.Mesh | None = None):
        super().__init__()
        if every_n_batches is not None and (
                isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int)
                or every_n_batches < 1):
            raise ValueError(f"every_n_batches={every_n_batches!r} must be None or an int >= 1")
        self.every_n_batches = every_n_batches
        self._mesh = mesh

    def _sync(self) -> None:
        distributed.sync_replicas(self.model, self.model.optimizer,
                                  self._mesh or mesh_lib.current_mesh())

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.every_n_batches and (batch + 1) % self.every_n_batches == 0:
            self._sync()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._sync()


class MetricAverage(tf.keras.callbacks.Callback):
    """Replaces each epoch's (and evaluation's) logs with their average over all ranks.

    Each rank sees only its own shard of the data, so its loss and metrics are local;
    this makes every rank report the global figures (equal shards: the plain mean).

    Example::

        model.fit(ds, callbacks=[tfhybrid.callbacks.MetricAverage()],
                  verbose=1 if tfhybrid.current_mesh().rank == 0 else 0)
    """

    def __init__(self, mesh: mesh_lib.Mesh | None = None):
        super().__init__()
        self._mesh = mesh

    def _average(self, logs: dict | None) -> None:
        mesh = self._mesh or mesh_lib.current_mesh()
        if not logs or mesh.size == 1:
            return
        import horovod.tensorflow as hvd
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float)))
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        averaged = collectives.allreduce(values, op=hvd.Average,
                                         name="tfhybrid_metric_average")
        for key, value in zip(keys, averaged.numpy()):
            logs[key] = float(value)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._average(logs)

    def on_test_end(self, logs: dict | None = None) -> None:
        self._average(logs)


class ConsistentSteps(tf.keras.callbacks.Callback):
    """Checks at the start of ``fit`` that every rank will run the same number of steps.

    A rank whose input ends early leaves the others waiting in a collective; checking the
    step counts first turns that into a ``ValueError`` on every rank, naming each rank's
    count. Input of unknown length needs ``steps_per_epoch``.

    Example::

        model.fit(ds, steps_per_epoch=100, callbacks=[tfhybrid.callbacks.ConsistentSteps()])
    """

    def __init__(self, mesh: mesh_lib.Mesh | None = None):
        super().__init__()
        self._mesh = mesh

    def on_train_begin(self, logs: dict | None = None) -> None:
        mesh = self._mesh or mesh_lib.current_mesh()
        steps = self.params.get("steps") if self.params else None
        counts = [steps]
        if mesh.size > 1:
            import horovod.tensorflow as hvd
            counts = hvd.allgather_object(steps, name="tfhybrid_consistent_steps")
        if any(c is None for c in counts) or len(set(counts)) > 1:
            listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
            raise ValueError(
                f"steps per epoch differ across ranks or are unknown ({listed}); shard the "
                "input evenly over the ranks and pass steps_per_epoch to fit")


class FiitedAdjust(tf.keras.callbacks.Callback):
    """Runs FIITED's adjustment of every ``dims="adaptive"`` table in the model
    (``tfhybrid.layers.Embedding`` layers, and tables inside a ``DistributedEmbedding``,
    which every rank adjusts at the same batch).

    Every ``every_n_batches`` training batches each adaptive layer keeps
    ``target_memory`` of its chunks (:meth:`tfhybrid.layers.Embedding.adjust`); with
    ``ramp_batches`` the budget goes linearly from the whole table to the layer's
    ``target_memory`` over that many batches, so rows are pruned as their utility becomes
    known. The adjustment resizes the tables' pools, which only an optimizer whose state is
    per logical row can follow (:class:`tfhybrid.optimizers.RowWiseAdagrad` and its
    momentum-scaled variant): any other raises ValueError at the start of ``fit``.

    Example::

        import numpy as np
        import tensorflow as tf
        from tfhybrid.callbacks import FiitedAdjust
        from tfhybrid.layers import Embedding
        from tfhybrid.optimizers import RowWiseAdagrad
        table = Embedding(100, 8, combiner="sum", dims="adaptive", chunks=4,
                          target_memory=0.5)
        model = tf.keras.Sequential([table, tf.keras.layers.Dense(1)])
        model.compile(RowWiseAdagrad(0.1), "mse")
        x, y = np.random.randint(0, 100, (64, 3)), np.random.rand(64, 1)
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[FiitedAdjust(every_n_batches=4)])
        assert table.table.present_chunks() == 200
    """

    def __init__(self, every_n_batches: int = 1000, ramp_batches: int = 0):
        super().__init__()
        for name, value, low in (("every_n_batches", every_n_batches, 1),
                                 ("ramp_batches", ramp_batches, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.every_n_batches = every_n_batches
        self.ramp_batches = ramp_batches
        self._batches = 0

    def _layers(self) -> list:
        # adaptive Embedding layers and DistributedEmbedding layers with adaptive tables
        # (whose own Embedding layers only describe tables: never built)
        return [layer for layer in _tf_internals.layers_in(self.model)
                if getattr(layer, "has_adaptive_tables", False)]

    def on_train_begin(self, logs: dict | None = None) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        # a DistributedOptimizer may train the tables with its own embedding optimizer
        # (or one per table)
        optimizers = slot_owners.each_optimizer(
            getattr(optimizer, "embedding_optimizer", None)) or [optimizer]
        for optimizer in optimizers:
            optimizer = slot_owners.base_optimizer(optimizer)   # inside a loss scale one
            if self._layers() and trains_of(optimizer) is not Trains.ROW_STATE:
                raise ValueError(
                    f"FiitedAdjust resizes the adaptive tables, which "
                    f"{type(optimizer).__name__}'s per-entry state cannot follow; compile "
                    "with tfhybrid.optimizers.RowWiseAdagrad")

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches += 1
        if self._batches % self.every_n_batches:
            return
        ramp = 1.0 if not self.ramp_batches else min(1.0, self._batches / self.ramp_batches)
        for layer in self._layers():
            layer.adjust_ramp(ramp)


class DynamicTableStats(tf.keras.callbacks.Callback):
    """Every ``every_n_batches`` training batches, collects each ``DistributedEmbedding``'s
    dynamic-table counters (``table_stats()``: size, capacity, admissions, evictions,
    refusals, hit rate, summed over the model group; every rank takes part) and logs
    them on rank 0. ``history`` keeps what was collected, as (batch, stats) pairs.

    Example::

        # one process; under horovodrun the same code shards the table
        import numpy as np
        import tensorflow as tf
        import tfhybrid
        from tfhybrid.callbacks import DynamicTableStats
        from tfhybrid.layers import DistributedEmbedding, DynamicEmbedding
        from tfhybrid.optimizers import RowWiseAdagrad
        tfhybrid.init(model_parallel=1)
        keys = tf.keras.Input([2], dtype=tf.int64)
        users = DynamicEmbedding(4, 100, combiner="sum", name="users")
        out = DistributedEmbedding([users])([keys])[0]
        model = tf.keras.Model(keys, tf.keras.layers.Dense(1)(out))
        model.compile(RowWiseAdagrad(0.1), "mse")
        stats = DynamicTableStats(every_n_batches=2)
        model.fit(np.arange(16).reshape(8, 2), np.zeros([8, 1]), batch_size=2, verbose=0,
                  callbacks=[stats])
        assert stats.history[-1][1]["users"]["size"] == 16
    """

    def __init__(self, every_n_batches: int = 1000):
        super().__init__()
        if isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int) or \
                every_n_batches < 1:
            raise ValueError(f"every_n_batches must be an int >= 1, got {every_n_batches!r}")
        self.every_n_batches = every_n_batches
        self.history: list[tuple[int, dict]] = []
        self._batches = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches += 1
        if self._batches % self.every_n_batches:
            return
        found = {}
        for layer in _tf_internals.layers_in(self.model):
            if isinstance(layer, DistributedEmbedding):
                found.update(layer.table_stats())
        self.history.append((self._batches, found))
        if found and mesh_lib.current_mesh().rank == 0:
            for name, stats in found.items():
                tf.get_logger().info(
                    "dynamic table %r after %d batches: %d of %d rows, %d admitted, "
                    "%d evicted, %d refused, hit rate %.3f", name, self._batches,
                    stats["size"], stats["capacity"], stats["admissions"],
                    stats["evictions"], stats["refusals"], stats["hit_rate"])


def verbose(level: int = 1, mesh: mesh_lib.Mesh | None = None) -> int:
    """``level`` on rank 0 and 0 elsewhere: pass as ``fit(verbose=...)`` so only rank 0
    draws the progress bar and prints logs."""
    return level if (mesh or mesh_lib.current_mesh()).rank == 0 else 0


def defaults(mesh: mesh_lib.Mesh | None = None) -> list:
    """The callbacks a hybrid-parallel ``fit`` wants: same start, same step count, global logs.

    Example::

        model.fit(ds, callbacks=tfhybrid.callbacks.defaults(),
                  verbose=tfhybrid.callbacks.verbose())
    """
    return [BroadcastVariables(mesh=mesh), ConsistentSteps(mesh=mesh), MetricAverage(mesh=mesh)]


__all__ = ["BroadcastGlobalVariablesCallback", "BroadcastVariables", "SyncReplicas", "MetricAverage", "ConsistentSteps",
           "FiitedAdjust", "verbose", "defaults"]
