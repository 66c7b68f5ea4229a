"""The route of a gradient over the mesh, and the broadcast.

``DistributedOptimizer`` and ``DistributedGradientTape`` both hand their gradients to one
``GradientRoute``, so the two cannot differ. The route is one piece of arithmetic, checked
against the design notes here whole and kept in one module per step:

- ``options``: Horovod's keywords, checked once (``SyncOptions``);
- ``gradients``: arithmetic on a dense or ``IndexedSlices`` gradient;
- ``sync``: steps 1 and 2; ``clipping``: step 3; ``weight_sync``: step 5;
- ``route``: ``GradientRoute``, which runs them in order;
- ``tape``: ``DistributedGradientTape``; ``optimizer``: ``DistributedOptimizer``;
- ``broadcast``: ``broadcast_variables``.

What each variable is (a shard, its table, synced how) is its role (``tfhybrid.roles``),
written by the layer and read here. The route, in the order it runs:

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

from tfhybrid import _tf_internals  # noqa: F401 - first: checks which Keras tf.keras is
from tfhybrid.distributed.broadcast import broadcast_variables, optimizer_variables
from tfhybrid.distributed.optimizer import DistributedOptimizer, route_of
from tfhybrid.distributed.options import SyncOptions, forget_logged_notes, sync_options
from tfhybrid.distributed.route import GradientRoute
from tfhybrid.distributed.sync import allreduce_gradients, rows_once
from tfhybrid.distributed.tape import DistributedGradientTape
from tfhybrid.distributed.weight_sync import optimizer_state_of, sync_replicas

__all__ = ["DistributedGradientTape", "DistributedOptimizer", "GradientRoute", "SyncOptions",
           "allreduce_gradients", "broadcast_variables", "forget_logged_notes",
           "optimizer_state_of", "optimizer_variables", "route_of", "rows_once",
           "sync_options", "sync_replicas"]
