"""Step 5 of the route: weight-sync mode (``replica_sync="weights"``), where a shard's
replicas step on their own gradients and are averaged, with their optimizer state, over
their data group every K steps; and where an optimizer keeps a variable's slots.

Example (one process: nothing to average, so the weights stay)::

    import tensorflow as tf
    import tfhybrid
    tfhybrid.init(model_parallel=1)
    tfhybrid.sync_replicas([tf.Variable([1.0])])
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
import horovod.tensorflow as hvd

from tfhybrid import _tf_internals
from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid.slot_owners import slot_owner


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
    shards = [v for v in variables if roles.weight_sync_every(v) is not None]
    if mesh.data_parallel == 1 or not shards:
        return
    state = [_tf_internals.tf_variable(s)
             for v in shards for s in [v] + optimizer_state_of(optimizer, v)]
    # a table that keeps its rows' accumulator itself (a dynamic table's, reset with
    # each new key) averages it with its rows, whatever the optimizer
    kept = [roles.role_of(v).row_accumulator for v in shards]
    state += [_tf_internals.tf_variable(a) for a in kept
              if a is not None and not any(_tf_internals.tf_variable(a) is s for s in state)]
    outside = [roles.role_of(v).rows_outside for v in shards
               if roles.role_of(v).rows_outside is not None]
    # a table with rows outside its variable (a tier) averages its row state with it,
    # whatever the optimizer
    state += [s for t in outside for s in t.replica_state
              if not any(s is kept for kept in state)]
    averaged = collectives.grouped_allreduce([tf.convert_to_tensor(v) for v in state],
                                             op=hvd.Average, name="tfhybrid_weight_sync",
                                             process_set=mesh.data_process_set)
    collectives.count("allreduce", sum(v.shape.num_elements() * v.dtype.size for v in state),
                      "tfhybrid_weight_sync", mesh.data_process_set)
    assigned = [var.assign(value, read_value=False) for var, value in zip(state, averaged)]
    for table in outside:
        # the rest of such a shard (a tier's): the rows its replicas wrote back since the
        # last sync, read once the cache is averaged (a row the cache then gives up
        # carries the average)
        name = f"tfhybrid_weight_sync_{table.name}"

        def average(tensors, name=name):
            collectives.count("allreduce", sum(tf.size(t, tf.int64) * t.dtype.size
                                               for t in tensors), name, mesh.data_process_set)
            return collectives.grouped_allreduce(tensors, op=hvd.Average, name=name,
                                                 process_set=mesh.data_process_set)
        with tf.control_dependencies([op for op in assigned if op is not None]):
            table.sync_replicas(average)


def sync_if_due(optimizer: Any, variables: Sequence[tf.Variable],
                 mesh: mesh_lib.Mesh, passes_per_step: int = 1) -> None:
    shards = [v for v in variables if roles.weight_sync_every(v) is not None]
    if not shards or mesh.data_parallel == 1:
        return
    every = min(roles.weight_sync_every(v) for v in shards)
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


def tag_shard_state(optimizer: Any, variables: Sequence[tf.Variable],
                     done: set) -> None:
    """Tags the optimizer slots of model-parallel shards (at trace time, once they exist),
    so ``broadcast_variables`` sends them inside the shard's data group. ``done`` holds
    the (optimizer, shard) pairs already tagged."""
    for var in variables:
        key = (id(optimizer), _tf_internals.tf_variable(var).ref())
        if not roles.is_model_parallel(var) or key in done:
            continue
        slots = optimizer_state_of(optimizer, var)
        for slot in slots:
            roles.assign(slot, shard_state=True)
        if slots:
            done.add(key)

