"""Tiered tables (cache_rows) inside DistributedEmbedding: sharded, they train as in memory.

Each shard a rank owns keeps its rows in a file with a DRAM cache in front. The replicas
of a shard load the ids of all of them each step, so their caches stay alike slot for
slot and the gradient sync adds rows at the same slots: training equals the same layer
with every table in memory, bit for bit, on a 2x2 mesh (column-, row- and table-wise
shards, a replicated table beside them), with SGD and row-wise AdaGrad, pipelined or
not, while rows are evicted, written back and reloaded; in weight-sync mode too.
"""

import dataclasses
import shutil
import tempfile

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.callbacks import FiitedAdjust
from tfhybrid.optimizers import RowWiseAdagrad
from tfhybrid.pipeline import TrainPipeline
from tests import _hybrid_case as hc

HOROVOD_NP = (4,)
KERAS = (2, 3)

# Per step the global batch (4 samples) names up to 12 distinct ids of "wide" and "bag"
# and 8 of "rows" (all may fall in one row shard); a cache holds the rows of two steps
# (a pipeline loads a batch's rows while the step before runs on its own), about what
# these caches hold, so rows keep moving.
CACHE_ROWS = {"wide": 24, "rows": 32, "bag": 24}
STEPS = 20


def _case(world, seed, steps=STEPS, store_dir=None):
    return hc.Case(hc.PLACEMENT_TABLES, local_batch=1, steps=steps, world=world, seed=seed,
                   cache_rows=CACHE_ROWS if store_dir else None, store_dir=store_dir)


def _trained(case, mesh, make_optimizer, pipeline=False, model=None, callbacks=None,
             **layer_kwargs):
    if model is None:
        model, layer = case.distributed_model(mesh, **layer_kwargs)
        model.compile(optimizer=tfhybrid.DistributedOptimizer(make_optimizer()),
                      loss=hc.loss_fn)
    if pipeline:
        TrainPipeline(model)
    ids, labels = case.local_data(mesh.rank)
    history = model.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0,
                        callbacks=callbacks)
    return model, history.history["loss"]


class _SaveAfterBatches(tf.keras.callbacks.Callback):
    """Saves a checkpoint after each of ``batches`` (its flush writes every used cached
    row back) and keeps the weights each one holds."""

    def __init__(self, batches, directory):
        super().__init__()
        self.batches, self.directory = batches, directory
        self.saved = {}   # checkpoint path -> the weights saved

    def on_train_batch_end(self, batch, logs=None):
        if batch in self.batches:
            path = tf.train.Checkpoint(model=self.model).save(f"{self.directory}/ckpt")
            self.saved[path] = _weights(self.model)


def _layer(model):
    return next(layer for layer in model.layers
                if isinstance(layer, tfhybrid.layers.DistributedEmbedding))


def _weights(model):
    return hc.table_weights(_layer(model)) + hc.dense_weights(model)


def _tiered_by_key(layer) -> dict:
    """This rank's tiered shards of ``layer``, by "<table>_<shard>"."""
    return {f"{t}_{s}": store.cache for (t, s), store in layer.stores.items()
            if store.cache is not None}


def _tiered(layer) -> list:
    return list(_tiered_by_key(layer).values())


class _TierDir(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp(prefix="tfhybrid-tiers-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def fresh_dir(self):
        return tempfile.mkdtemp(dir=self.dir)

    def shared_dir(self):
        """One directory for every rank: all ranks write one checkpoint together."""
        path = hvd.broadcast_object(tempfile.mkdtemp(prefix="tfhybrid-tier-ckpt-")
                                    if hvd.rank() == 0 else None)
        self.addCleanup(lambda: hvd.rank() == 0 and shutil.rmtree(path, True))
        return path

    def assert_same(self, got, want):
        self.assertEqual(len(got), len(want))
        for g, w in zip(got, want):
            self.assertAllEqual(g, w)


class ShardedTierTest(_TierDir):

    def test_sharded_tiers_train_as_tables_in_memory_bit_for_bit(self):
        world = hc.world_size()
        # (optimizer, model_parallel, the tiered runs: pipelined or not)
        runs = [("sgd", lambda: tf.keras.optimizers.SGD(0.5), 2, (False,)),
                ("rowwise_adagrad", lambda: RowWiseAdagrad(0.1), 2, (False, True)),
                ("rowwise_adagrad", lambda: RowWiseAdagrad(0.1), world, (False,))]
        for name, make, model_parallel, pipelines in runs:
            mesh_lib.reset()
            mesh = tfhybrid.init(model_parallel=model_parallel)
            memory, memory_loss = _trained(_case(world, seed=41), mesh, make)
            for pipeline in pipelines:
                with self.subTest(optimizer=name, model_parallel=model_parallel,
                                  pipeline=pipeline):
                    tiered_case = _case(world, seed=41, store_dir=self.fresh_dir())
                    tiered, tiered_loss = _trained(tiered_case, mesh, make, pipeline)
                    layer = _layer(tiered)
                    kinds = {p.kind for p in layer.plan.tables}
                    if model_parallel == 2:
                        self.assertEqual(kinds, {"column_wise", "row_wise", "table_wise",
                                                 "data_parallel"})
                    self.assertEqual(tiered_loss, memory_loss)
                    self.assert_same(_weights(tiered), _weights(memory))
                    # the comparison means something only if rows were written back and
                    # reloaded
                    stats = [t.stats() for t in _tiered(layer)]
                    moved = hvd.allgather_object(sum(s["writebacks"] for s in stats))
                    self.assertGreater(sum(moved), 0)
                    self.assertGreater(sum(hvd.allgather_object(
                        sum(s["misses"] for s in stats))), sum(CACHE_ROWS.values()))
                    # memory: the files hold the tiered shards (and their row state); as
                    # dense tables they would take what the layer in memory takes
                    held = layer.memory_bytes()
                    self.assertEqual(held["store"], sum(
                        t.rows * (t.dim + 1) * 4 for t in _tiered(layer)))
                    self.assertEqual(held["dense"], _layer(memory).memory_bytes()["dense"])

    def test_replicas_load_each_others_ids_and_keep_one_cache(self):
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        case = _case(world, seed=43, steps=5, store_dir=self.fresh_dir())
        model, _ = _trained(case, mesh, lambda: RowWiseAdagrad(0.1))
        layer = _layer(model)
        # every replica of a shard (its data group) holds the same rows in the same
        # slots, with the same values
        for key, table in sorted(_tiered_by_key(layer).items()):
            mine = (table.rows_in_slots(), table.cache.numpy(),
                    table.cache_accumulator.numpy())
            everyone = hvd.allgather_object(mine, process_set=mesh.data_process_set)
            for other in everyone[1:]:
                for a, b in zip(other, everyone[0]):
                    self.assertAllEqual(a, b)


class WeightSyncTierTest(_TierDir):

    def test_weight_sync_trains_as_tables_in_memory_bit_for_bit(self):
        """replica_sync='weights': between syncs the replicas train apart, files too;
        each sync averages the caches and the rows written back since the sync before,
        which is the whole of what differs, so training equals the tables in memory bit
        for bit (D = 2: a mean of two values is exact whatever the order)."""
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        sync = dict(replica_sync="weights", sync_every=3)
        for name, make, pipelines in (
                ("sgd", lambda: tf.keras.optimizers.SGD(0.5), (False,)),
                ("rowwise_adagrad", lambda: RowWiseAdagrad(0.1), (False, True))):
            memory, memory_loss = _trained(_case(world, seed=71, steps=12), mesh, make,
                                           **sync)
            for pipeline in pipelines:
                with self.subTest(optimizer=name, pipeline=pipeline):
                    # a checkpoint between two syncs (after step 5; K = 3) writes
                    # cached rows back, which must reach the next sync's average; one
                    # after a sync (step 6) holds what every replica holds
                    saving = _SaveAfterBatches((4, 5), self.shared_dir())
                    case = _case(world, seed=71, steps=12, store_dir=self.fresh_dir())
                    tiered, tiered_loss = _trained(case, mesh, make, pipeline,
                                                   callbacks=[saving], **sync)
                    self.assertEqual(tiered_loss, memory_loss)
                    self.assert_same(_weights(tiered), _weights(memory))
                    # rows left the caches between syncs, and the syncs averaged them in
                    # the files: the equality above needed the files' half
                    stats = [store.cache.stats() for _, store in _layer(tiered).stores.items()
                             if store.cache is not None]
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
                    self.assert_same(_weights(restored), weights)


class MemoryBudgetTest(_TierDir):

    def test_a_dram_budget_moves_the_large_table_to_disk_and_trains_as_in_memory(self):
        world = hc.world_size()
        tables = (hc.Table("big", 4000, 8, "sum", 2), hc.Table("small", 50, 4, "sum", 1))
        budget = 25_000   # "big" takes 128,000 bytes in memory
        mesh = tfhybrid.init(model_parallel=2)
        case = hc.Case(tables, local_batch=2, steps=20, world=world, seed=67)
        make = lambda: RowWiseAdagrad(0.1)  # noqa: E731
        memory, memory_loss = _trained(case, mesh, make)
        model, layer = case.distributed_model(mesh, memory_budget={"dram": budget},
                                              store_dir=self.fresh_dir())
        model.compile(optimizer=tfhybrid.DistributedOptimizer(make()), loss=hc.loss_fn)
        self.assertEqual([(t.name, t.cache_rows is not None) for t in layer.plan.tables],
                         [("big", True), ("small", False)])
        self.assertLessEqual(layer.memory_bytes()["embedding"], budget)
        model, loss = _trained(case, mesh, make, model=model)
        self.assertEqual(loss, memory_loss)
        self.assert_same(_weights(model), _weights(memory))
        moved = sum(hvd.allgather_object(
            sum(t.stats()["writebacks"] for t in _tiered(layer))))
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


class TierCheckpointTest(_TierDir):

    def test_checkpoint_restores_onto_another_mesh_and_into_memory(self):
        world = hc.world_size()
        make = lambda: RowWiseAdagrad(0.1)  # noqa: E731
        path = self.shared_dir()
        first = _case(world, seed=47, steps=10, store_dir=self.fresh_dir())
        then = _case(world, seed=53, steps=6)
        mesh = tfhybrid.init(model_parallel=2)
        model, _ = _trained(first, mesh, make)
        saved = _weights(model)
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(f"{path}/ckpt")
        # uninterrupted: the tiered model goes on
        _trained(dataclasses.replace(then, cache_rows=CACHE_ROWS, store_dir=self.fresh_dir()),
                 mesh, make, model=model)
        want = _weights(model)
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
                self.assert_same(_weights(restored), saved)
                # the row-wise state came back too: training goes on as it would have
                _trained(then, mesh, make, model=restored)
                got = _weights(restored)
                for g, w in zip(got, want):
                    if model_parallel == 2:
                        self.assertAllEqual(g, w)
                    else:   # another mesh sums in another order
                        self.assertAllClose(g, w, atol=1e-6, rtol=1e-6)


class AdaptiveTierTest(_TierDir):
    """FIITED tables (dims="adaptive") in the tier: the same pruning and training as the
    adaptive tables in memory, on the same mesh, bit for bit; checkpoints move between
    the two and onto another mesh."""

    TARGET = 0.6
    ADJUST = dict(every_n_batches=4, ramp_batches=8)

    def _case(self, world, seed, steps=STEPS, tiered=True):
        return hc.Case(hc.PLACEMENT_TABLES, local_batch=1, steps=steps, world=world,
                       seed=seed, adaptive_target=self.TARGET,
                       cache_rows=CACHE_ROWS if tiered else None,
                       store_dir=self.fresh_dir() if tiered else None)

    def _trained(self, case, mesh, pipeline=False, model=None):
        return _trained(case, mesh, lambda: RowWiseAdagrad(0.1), pipeline, model=model,
                        callbacks=[FiitedAdjust(**self.ADJUST)])

    def test_tiered_fiited_tables_train_and_prune_as_in_memory_bit_for_bit(self):
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        memory, memory_loss = self._trained(self._case(world, 67, tiered=False), mesh)
        want_counts = _layer(memory).chunks_per_row()
        for pipeline in (False, True):
            with self.subTest(pipeline=pipeline):
                tiered, tiered_loss = self._trained(self._case(world, 67), mesh, pipeline)
                layer = _layer(tiered)
                self.assertEqual({p.kind for p in layer.plan.tables},
                                 {"column_wise", "row_wise", "table_wise", "data_parallel"})
                self.assertEqual(tiered_loss, memory_loss)
                self.assert_same(_weights(tiered), _weights(memory))
                counts = layer.chunks_per_row()
                for got, want, table in zip(counts, want_counts, layer.table_specs):
                    self.assertAllEqual(got, want)
                    # pruning happened, and unevenly
                    self.assertEqual(got.sum(), int(self.TARGET * table.rows * table.dim))
                    self.assertGreater(len(set(got.tolist())), 1)
                tiered_shards = [t for t in _tiered(layer)]
                self.assertTrue(all(store.cache is store.fiited
                                    for _, store in layer.stores.items()
                                    if store.cache is not None))
                self.assertGreater(sum(hvd.allgather_object(
                    sum(t.stats()["writebacks"] for t in tiered_shards))), 0)

    def test_broadcast_sends_the_root_replicas_rows_utility_and_widths(self):
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        model, _ = self._trained(self._case(world, 83, steps=8), mesh)
        layer = _layer(model)
        for table in _tiered(layer):   # make the replicas differ
            table.write_rows(0, np.full([table.rows, table.dim], float(mesh.rank),
                                        np.float32))
            table.utility.assign(tf.fill([table.rows], float(mesh.rank)))
        tfhybrid.broadcast_variables(model.variables + model.optimizer.variables,
                                     root_rank=0)
        root_replica = next(d for d, group in enumerate(mesh.model_groups) if 0 in group)
        root = mesh.model_groups[root_replica][mesh.model_position]
        for table in _tiered(layer):
            held = table.chunks_per_row()[:, None] * table.chunk_dim
            want = np.where(np.arange(table.dim)[None, :] < held, float(root), 0.0)
            self.assertAllEqual(table.read_rows(0, table.rows), want)
            self.assertAllEqual(table.utility.numpy(), np.full([table.rows], float(root)))

    def test_checkpoint_moves_between_the_tier_and_memory_and_meshes(self):
        world = hc.world_size()
        path = self.shared_dir()
        mesh = tfhybrid.init(model_parallel=2)
        model, _ = self._trained(self._case(world, 73, steps=12), mesh)
        saved, saved_counts = _weights(model), _layer(model).chunks_per_row()
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(f"{path}/ckpt")
        then = self._case(world, 79, steps=4, tiered=False)
        _trained(then, mesh, lambda: RowWiseAdagrad(0.1), model=model)
        want = _weights(model)
        for model_parallel, tiered in ((world, False), (world, True), (2, True)):
            mesh_lib.reset()
            with self.subTest(model_parallel=model_parallel, tiered=tiered):
                mesh = tfhybrid.init(model_parallel=model_parallel)
                restored, layer = self._case(world, 73, tiered=tiered).distributed_model(mesh)
                restored.compile(optimizer=tfhybrid.DistributedOptimizer(RowWiseAdagrad(0.1)),
                                 loss=hc.loss_fn)
                tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(
                    f"{path}/ckpt").assert_existing_objects_matched()
                self.assert_same(_weights(restored), saved)
                for got, want_counts in zip(layer.chunks_per_row(), saved_counts):
                    self.assertAllEqual(got, want_counts)
                # the row state came back too: training goes on as it would have
                _trained(then, mesh, lambda: RowWiseAdagrad(0.1), model=restored)
                for g, w in zip(_weights(restored), want):
                    if model_parallel == 2:
                        self.assertAllEqual(g, w)
                    else:   # another mesh sums in another order
                        self.assertAllClose(g, w, atol=1e-6, rtol=1e-6)


class TierErrorsTest(_TierDir):

    def test_what_cannot_work_is_refused_naming_the_table(self):
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        case = _case(world, seed=59, steps=1, store_dir=self.fresh_dir())
        # the planner never replicates a tiered table; a plan made without the tier may
        _, in_memory = dataclasses.replace(case, cache_rows=None).distributed_model(mesh)
        self.assertEqual(in_memory.plan.table("tiny").kind, "data_parallel")
        replicated = dataclasses.replace(case, cache_rows={"tiny": 5})
        with self.assertRaisesRegex(ValueError, r"'tiny' has cache_rows=5.*replicates it"):
            replicated.distributed_model(mesh, plan=in_memory.plan)

    def test_broadcast_sends_the_files_of_the_root_replica(self):
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=2)
        case = _case(world, seed=61, steps=2, store_dir=self.fresh_dir())
        model, _ = _trained(case, mesh, lambda: RowWiseAdagrad(0.1))
        layer = _layer(model)
        # make the replicas differ, in rows that are cached and rows that are not
        for table in _tiered(layer):
            table.write_rows(0, np.full([table.rows, table.dim], float(mesh.rank),
                                        np.float32),
                             np.full([table.rows], float(mesh.rank), np.float32))
        tfhybrid.broadcast_variables(model.variables + model.optimizer.variables,
                                     root_rank=0)
        root_replica = next(d for d, group in enumerate(mesh.model_groups) if 0 in group)
        root = mesh.model_groups[root_replica][mesh.model_position]
        for table in _tiered(layer):
            self.assertAllEqual(table.read_rows(0, table.rows),
                                np.full([table.rows, table.dim], float(root)))
            self.assertAllEqual(table.read_accumulator(0, table.rows),
                                np.full([table.rows], float(root)))


if __name__ == "__main__":
    tf.test.main()
