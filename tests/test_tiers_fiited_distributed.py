"""FIITED tables (``dims="adaptive"``) in the disk tier on a 2x2 mesh: they prune and
train as the adaptive tables in memory, bit for bit, pipelined or not; the broadcast
sends the root replica's rows, utility and widths; checkpoints move between the tier and
memory and onto another mesh. (The tier's other distributed tests:
``tests/test_tiers_distributed.py``.)
"""

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.callbacks import FiitedAdjust
from tfhybrid.optimizers import RowWiseAdagrad
from tests import _hybrid_case as hc
from tests import _tier_case as tc

HOROVOD_NP = (4,)
# Keras 2 only: the mesh half of these tables holds no Keras code, and their Keras 3
# paths (variables, slots, checkpoints) run in tests/test_tiers.py and tests/test_fiited.py under Keras 3,
# which keeps the Keras 3 run of the suite inside CI's time
KERAS = (2,)


class AdaptiveTierTest(tc.TierDir):
    """FIITED tables (dims="adaptive") in the tier: the same pruning and training as the
    adaptive tables in memory, on the same mesh, bit for bit; checkpoints move between
    the two and onto another mesh."""

    TARGET = 0.6
    ADJUST = dict(every_n_batches=4, ramp_batches=8)

    def _case(self, world, seed, steps=tc.STEPS, tiered=True):
        return hc.Case(hc.PLACEMENT_TABLES, local_batch=1, steps=steps, world=world,
                       seed=seed, adaptive_target=self.TARGET,
                       cache_rows=tc.CACHE_ROWS if tiered else None,
                       store_dir=self.fresh_dir() if tiered else None)

    def _trained(self, case, mesh, pipeline=False, model=None):
        return tc.trained(case, mesh, lambda: RowWiseAdagrad(0.1), pipeline, model=model,
                        callbacks=[FiitedAdjust(**self.ADJUST)])

    def test_tiered_fiited_tables_train_and_prune_as_in_memory_bit_for_bit(self):
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        memory, memory_loss = self._trained(self._case(world, 67, tiered=False), mesh)
        want_counts = tc.layer_of(memory).chunks_per_row()
        for pipeline in (False, True):
            with self.subTest(pipeline=pipeline):
                tiered, tiered_loss = self._trained(self._case(world, 67), mesh, pipeline)
                layer = tc.layer_of(tiered)
                self.assertEqual({p.kind for p in layer.plan.tables},
                                 {"column_wise", "row_wise", "table_wise", "data_parallel"})
                self.assertEqual(tiered_loss, memory_loss)
                self.assert_same(tc.weights(tiered), tc.weights(memory))
                counts = layer.chunks_per_row()
                for got, want, table in zip(counts, want_counts, layer.table_specs):
                    self.assertAllEqual(got, want)
                    # pruning happened, and unevenly
                    self.assertEqual(got.sum(), int(self.TARGET * table.rows * table.dim))
                    self.assertGreater(len(set(got.tolist())), 1)
                tiered_shards = [t for t in tc.tiered(layer)]
                # a tiered shard's per-row widths are its tier's own
                tiered_stores = [store for _, store in layer.stores.items()
                                 if "hits" in store.stats()]
                self.assertTrue(tiered_stores)
                self.assertTrue(all(store.widths is not None and store.widths is store.tracked
                                    for store in tiered_stores))
                self.assertGreater(sum(hvd.allgather_object(
                    sum(t.stats()["writebacks"] for t in tiered_shards))), 0)

    def test_broadcast_sends_the_root_replicas_rows_utility_and_widths(self):
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        model, _ = self._trained(self._case(world, 83, steps=8), mesh)
        layer = tc.layer_of(model)
        for table in tc.tiered(layer):   # make the replicas differ
            table.write_rows(0, np.full([table.rows, table.dim], float(mesh.rank),
                                        np.float32))
            table.utility.assign(tf.fill([table.rows], float(mesh.rank)))
        tfhybrid.broadcast_variables(model.variables + model.optimizer.variables,
                                     root_rank=0)
        root_replica = next(d for d, group in enumerate(mesh.model_groups) if 0 in group)
        root = mesh.model_groups[root_replica][mesh.model_position]
        for table in tc.tiered(layer):
            held = table.chunks_per_row()[:, None] * table.chunk_dim
            want = np.where(np.arange(table.dim)[None, :] < held, float(root), 0.0)
            self.assertAllEqual(table.read_rows(0, table.rows), want)
            self.assertAllEqual(table.utility.numpy(), np.full([table.rows], float(root)))

    def test_checkpoint_moves_between_the_tier_and_memory_and_meshes(self):
        world = hc.world_size()
        path = self.shared_dir()
        mesh = tfhybrid.init(model_parallel=2)
        model, _ = self._trained(self._case(world, 73, steps=12), mesh)
        saved, saved_counts = tc.weights(model), tc.layer_of(model).chunks_per_row()
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(f"{path}/ckpt")
        then = self._case(world, 79, steps=4, tiered=False)
        tc.trained(then, mesh, lambda: RowWiseAdagrad(0.1), model=model)
        want = tc.weights(model)
        for model_parallel, tiered in ((world, False), (world, True), (2, True)):
            mesh_lib.reset()
            with self.subTest(model_parallel=model_parallel, tiered=tiered):
                mesh = tfhybrid.init(model_parallel=model_parallel)
                restored, layer = self._case(world, 73, tiered=tiered).distributed_model(mesh)
                restored.compile(optimizer=tfhybrid.DistributedOptimizer(RowWiseAdagrad(0.1)),
                                 loss=hc.loss_fn)
                tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(
                    f"{path}/ckpt").assert_existing_objects_matched()
                self.assert_same(tc.weights(restored), saved)
                for got, want_counts in zip(layer.chunks_per_row(), saved_counts):
                    self.assertAllEqual(got, want_counts)
                # the row state came back too: training goes on as it would have
                tc.trained(then, mesh, lambda: RowWiseAdagrad(0.1), model=restored)
                for g, w in zip(tc.weights(restored), want):
                    if model_parallel == 2:
                        self.assertAllEqual(g, w)
                    else:   # another mesh sums in another order
                        self.assertAllClose(g, w, atol=1e-6, rtol=1e-6)
