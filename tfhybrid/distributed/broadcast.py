"""``broadcast_variables``: every copy of every variable made equal to the root replica's
(replicated variables over all ranks, shards inside their data groups), as DE's
``broadcast_variables``; and ``optimizer_variables``, the list it is usually given."""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf
import horovod.tensorflow as hvd

from tfhybrid import _tf_internals
from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid.distributed.options import is_global_process_set


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
    flags = [roles.is_model_parallel(v) or roles.role_of(v).shard_state
             for v in variables]
    shards = [v for v in variables if roles.is_model_parallel(v)]
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
    if not is_global_process_set(process_set):
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

    outside = [roles.role_of(var).rows_outside for var in shards
               if roles.role_of(var).rows_outside is not None]
    if tf.executing_eagerly():
        # one function, so Horovod negotiates (and fuses) the broadcasts together
        tf.function(assign_all, autograph=False)()
    elif outside and mesh.data_parallel > 1:
        raise ValueError(
            f"broadcast_variables inside a tf.function cannot send tiered tables "
            f"{[t.name for t in outside]} (cache_rows: most rows are in files); call it "
            "eagerly, as tfhybrid.callbacks.BroadcastGlobalVariablesCallback does")
    else:
        assign_all()
    if mesh.data_parallel > 1:
        def from_root(values, what):
            # the shard's rows, from its data group's member in the root replica
            return collectives.broadcast(tf.constant(values), shard_root,
                                         f"tfhybrid_broadcast_tier_{what}",
                                         mesh.data_process_set).numpy()
        for table in outside:
            table.broadcast_rows(from_root)
