"""Tiered tables (cache_rows) inside DistributedEmbedding: sharded, they train as in memory.

Each shard a rank owns keeps its rows in a file with a DRAM cache in front. The replicas
of a shard load the ids of all of them each step, so their caches stay alike slot for
slot and the gradient sync adds rows at the same slots: training equals the same layer
with every table in memory, bit for bit, on a 2x2 mesh (column-, row- and table-wise
shards, a replicated table beside them), with SGD and row-wise AdaGrad, pipelined or
not, while rows are evicted, written back and reloaded; in weight-sync mode too. (FIITED
tables in the tier: ``tests/test_tiers_fiited_distributed.py``.)
"""

import dataclasses

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.optimizers import RowWiseAdagrad
from tests import _hybrid_case as hc
from tests import _tier_case as tc

HOROVOD_NP = (4,)
# Keras 2 only: the mesh half of these tables holds no Keras code, and their Keras 3
# paths (variables, slots, checkpoints) run in tests/test_tiers.py under Keras 3,
# which keeps the Keras 3 run of the suite inside CI's time
KERAS = (2,)


class ShardedTierTest(tc.TierDir):

    def test_sharded_tiers_train_as_tables_in_memory_bit_for_bit(self):
        world = hc.world_size()
        # (optimizer, model_parallel, the tiered runs: pipelined or not): each mesh
        # trains pipelined and not, row-wise AdaGrad too, SGD pipelined
        runs = [("sgd", lambda: tf.keras.optimizers.SGD(0.5), 2, (True,)),
                ("rowwise_adagrad", lambda: RowWiseAdagrad(0.1), 2, (False,)),
                ("rowwise_adagrad", lambda: RowWiseAdagrad(0.1), world, (True,))]
        for name, make, model_parallel, pipelines in runs:
            mesh_lib.reset()
            mesh = tfhybrid.init(model_parallel=model_parallel)
            memory, memory_loss = tc.trained(tc.case(world, seed=41), mesh, make)
            for pipeline in pipelines:
                with self.subTest(optimizer=name, model_parallel=model_parallel,
                                  pipeline=pipeline):
                    tiered_case = tc.case(world, seed=41, store_dir=self.fresh_dir())
                    tiered, tiered_loss = tc.trained(tiered_case, mesh, make, pipeline)
                    layer = tc.layer_of(tiered)
                    kinds = {p.kind for p in layer.plan.tables}
                    if model_parallel == 2:
                        self.assertEqual(kinds, {"column_wise", "row_wise", "table_wise",
                                                 "data_parallel"})
                    self.assertEqual(tiered_loss, memory_loss)
                    self.assert_same(tc.weights(tiered), tc.weights(memory))
                    # the comparison means something only if rows were written back and
                    # reloaded
                    stats = [t.stats() for t in tc.tiered(layer)]
                    moved = hvd.allgather_object(sum(s["writebacks"] for s in stats))
                    self.assertGreater(sum(moved), 0)
                    self.assertGreater(sum(hvd.allgather_object(
                        sum(s["misses"] for s in stats))), sum(tc.CACHE_ROWS.values()))
                    # memory: the files hold the tiered shards (and their row state); as
                    # dense tables they would take what the layer in memory takes
                    held = layer.memory_bytes()
                    self.assertEqual(held["store"], sum(
                        t.rows * (t.dim + 1) * 4 for t in tc.tiered(layer)))
                    self.assertEqual(held["dense"], tc.layer_of(memory).memory_bytes()["dense"])

    def test_replicas_load_each_others_ids_and_keep_one_cache(self):
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        case = tc.case(world, seed=43, steps=5, store_dir=self.fresh_dir())
        model, _ = tc.trained(case, mesh, lambda: RowWiseAdagrad(0.1))
        layer = tc.layer_of(model)
        # every replica of a shard (its data group) holds the same rows in the same
        # slots, with the same values
        for key, table in sorted(tc.tiered_by_key(layer).items()):
            mine = (table.rows_in_slots(), table.cache.numpy(),
                    table.cache_accumulator.numpy())
            everyone = hvd.allgather_object(mine, process_set=mesh.data_process_set)
            for other in everyone[1:]:
                for a, b in zip(other, everyone[0]):
                    self.assertAllEqual(a, b)


class WeightSyncTierTest(tc.TierDir):

    def test_weight_sync_trains_as_tables_in_memory_bit_for_bit(self):
        """replica_sync='weights': between syncs the replicas train apart, files too;
        each sync averages the caches and the rows written back since the sync before,
        which is the whole of what differs, so training equals the tables in memory bit
        for bit (D = 2: a mean of two values is exact whatever the order)."""
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        sync = dict(replica_sync="weights", sync_every=3)
        # row-wise AdaGrad: the sync averages rows and their state (SGD's rows alone
        # are a part of it)
        for name, make, pipelines in (
                ("rowwise_adagrad", lambda: RowWiseAdagrad(0.1), (False, True)),):
            memory, memory_loss = tc.trained(tc.case(world, seed=71, steps=12), mesh, make,
                                           **sync)
            for pipeline in pipelines:
                with self.subTest(optimizer=name, pipeline=pipeline):
                    # a checkpoint between two syncs (after step 5; K = 3) writes
                    # cached rows back, which must reach the next sync's average; one
                    # after a sync (step 6) holds what every replica holds
                    saving = tc.SaveAfterBatches((4, 5), self.shared_dir())
                    case = tc.case(world, seed=71, steps=12, store_dir=self.fresh_dir())
                    tiered, tiered_loss = tc.trained(case, mesh, make, pipeline,
                                                   callbacks=[saving], **sync)
                    self.assertEqual(tiered_loss, memory_loss)
                    self.assert_same(tc.weights(tiered), tc.weights(memory))
                    # rows left the caches between syncs, and the syncs averaged them in
                    # the files: the equality above needed the files' half
                    stats = [table.stats() for table in tc.tiered(tc.layer_of(tiered))]
                    for key in ("writebacks", "synced_rows"):
                        self.assertGreater(sum(hvd.allgather_object(
                            sum(s[key] for s in stats))), 0, key)
                    # the synced checkpoint restores into the tables in memory
                    path, weights = list(saving.saved.items())[-1]
                    restored, _ = dataclasses.replace(
                        case, cache_rows=None, store_dir=None).distributed_model(mesh, **sync)
                    restored.compile(optimizer=tfhybrid.DistributedOptimizer(make()),
                                     loss=hc.loss_fn)
                    tf.train.Checkpoint(model=restored).read(
                        path).assert_existing_objects_matched()
                    self.assert_same(tc.weights(restored), weights)


class MemoryBudgetTest(tc.TierDir):

    def test_a_dram_budget_moves_the_large_table_to_disk_and_trains_as_in_memory(self):
        world = hc.world_size()
        tables = (hc.Table("big", 4000, 8, "sum", 2), hc.Table("small", 50, 4, "sum", 1))
        budget = 25_000   # "big" takes 128,000 bytes in memory
        mesh = tfhybrid.init(model_parallel=2)
        case = hc.Case(tables, local_batch=2, steps=20, world=world, seed=67)
        make = lambda: RowWiseAdagrad(0.1)  # noqa: E731
        memory, memory_loss = tc.trained(case, mesh, make)
        model, layer = case.distributed_model(mesh, memory_budget={"dram": budget},
                                              store_dir=self.fresh_dir())
        model.compile(optimizer=tfhybrid.DistributedOptimizer(make()), loss=hc.loss_fn)
        self.assertEqual([(t.name, t.cache_rows is not None) for t in layer.plan.tables],
                         [("big", True), ("small", False)])
        self.assertLessEqual(layer.memory_bytes()["embedding"], budget)
        model, loss = tc.trained(case, mesh, make, model=model)
        self.assertEqual(loss, memory_loss)
        self.assert_same(tc.weights(model), tc.weights(memory))
        moved = sum(hvd.allgather_object(
            sum(t.stats()["writebacks"] for t in tc.tiered(layer))))
        self.assertGreater(moved, 0)
        # the layer's config carries the budget and folder; a bad budget fails at once
        config = layer.get_config()
        self.assertEqual((config["memory_budget"], config["store_dir"]),
                         ({"dram": budget}, layer.store_dir))
        with self.assertRaisesRegex(ValueError, r"needs store_dir"):
            tfhybrid.layers.DistributedEmbedding(case.embedding_layers(),
                                                 memory_budget={"dram": budget})
        with self.assertRaisesRegex(ValueError, r"'hbm'"):
            tfhybrid.layers.DistributedEmbedding(case.embedding_layers(), store_dir=self.dir,
                                                 memory_budget={"hbm": budget})


class TierCheckpointTest(tc.TierDir):

    def test_checkpoint_restores_onto_another_mesh_and_into_memory(self):
        world = hc.world_size()
        make = lambda: RowWiseAdagrad(0.1)  # noqa: E731
        path = self.shared_dir()
        first = tc.case(world, seed=47, steps=10, store_dir=self.fresh_dir())
        then = tc.case(world, seed=53, steps=6)
        mesh = tfhybrid.init(model_parallel=2)
        model, _ = tc.trained(first, mesh, make)
        saved = tc.weights(model)
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(f"{path}/ckpt")
        # uninterrupted: the tiered model goes on
        tc.trained(dataclasses.replace(then, cache_rows=tc.CACHE_ROWS, store_dir=self.fresh_dir()),
                 mesh, make, model=model)
        want = tc.weights(model)
        for model_parallel, tiered in ((2, True), (world, False), (world, True)):
            mesh_lib.reset()
            with self.subTest(model_parallel=model_parallel, tiered=tiered):
                mesh = tfhybrid.init(model_parallel=model_parallel)
                case = (dataclasses.replace(first, store_dir=self.fresh_dir()) if tiered
                        else dataclasses.replace(first, cache_rows=None, store_dir=None))
                restored, _ = case.distributed_model(mesh)
                restored.compile(optimizer=tfhybrid.DistributedOptimizer(make()),
                                 loss=hc.loss_fn)
                status = tf.train.Checkpoint(model=restored,
                                             optimizer=restored.optimizer).read(
                    f"{path}/ckpt")
                status.assert_existing_objects_matched()
                self.assert_same(tc.weights(restored), saved)
                # the row-wise state came back too: training goes on as it would have
                tc.trained(then, mesh, make, model=restored)
                got = tc.weights(restored)
                for g, w in zip(got, want):
                    if model_parallel == 2:
                        self.assertAllEqual(g, w)
                    else:   # another mesh sums in another order
                        self.assertAllClose(g, w, atol=1e-6, rtol=1e-6)


class TierErrorsTest(tc.TierDir):

    def test_what_cannot_work_is_refused_naming_the_table(self):
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        case = tc.case(world, seed=59, steps=1, store_dir=self.fresh_dir())
        # the planner never replicates a tiered table; a plan made without the tier may
        _, in_memory = dataclasses.replace(case, cache_rows=None).distributed_model(mesh)
        self.assertEqual(in_memory.plan.table("tiny").kind, "data_parallel")
        replicated = dataclasses.replace(case, cache_rows={"tiny": 5})
        with self.assertRaisesRegex(ValueError, r"'tiny' has cache_rows=5.*replicates it"):
            replicated.distributed_model(mesh, plan=in_memory.plan)

    def test_broadcast_sends_the_files_of_the_root_replica(self):
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        case = tc.case(world, seed=61, steps=2, store_dir=self.fresh_dir())
        model, _ = tc.trained(case, mesh, lambda: RowWiseAdagrad(0.1))
        layer = tc.layer_of(model)
        # make the replicas differ, in rows that are cached and rows that are not
        for table in tc.tiered(layer):
            table.write_rows(0, np.full([table.rows, table.dim], float(mesh.rank),
                                        np.float32),
                             np.full([table.rows], float(mesh.rank), np.float32))
        tfhybrid.broadcast_variables(model.variables + model.optimizer.variables,
                                     root_rank=0)
        root_replica = next(d for d, group in enumerate(mesh.model_groups) if 0 in group)
        root = mesh.model_groups[root_replica][mesh.model_position]
        for table in tc.tiered(layer):
            self.assertAllEqual(table.read_rows(0, table.rows),
                                np.full([table.rows, table.dim], float(root)))
            self.assertAllEqual(table.read_accumulator(0, table.rows),
                                np.full([table.rows], float(root)))


if __name__ == "__main__":
    tf.test.main()
