"""FIITED inside DistributedEmbedding: every mesh trains and prunes as one process does.

A sharded adaptive table is planned whole (its shards' utilities summed over the model
group) and each shard keeps its part of the plan, so a 2x2 or 1x4 mesh takes the same
pruning decisions as one process on the global batch, and ends with the same tables.
"""

import math
import os
import shutil
import tempfile

import horovod.tensorflow as hvd
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.callbacks import FiitedAdjust
from tfhybrid.optimizers import RowWiseAdagrad
from tests import _hybrid_case as hc

KERAS_3 = tfhybrid.keras_major() == 3

HOROVOD_NP = (4,)
KERAS = (2, 3)

TARGET = 0.6
# adjustments at batches 3, 6, 9, 12: budgets 0.87, 0.73, 0.6, 0.6 of the chunks
ADJUST = dict(every_n_batches=3, ramp_batches=9)
# Row-wise AdaGrad's mean of g^2 covers a column slice's own columns (see
# test_gradient_route), so the training comparison keeps rows whole; column slices are
# checked on the decision they share with one process (ColumnSliceTest).
_NO_COLUMN_SLICES = dict(column_slice_threshold=None)


def _reference(case, steps_per_adjust=ADJUST):
    model = case.reference_model()
    model.compile(optimizer=RowWiseAdagrad(0.1), loss=hc.loss_fn)
    ids, labels = case.ids, case.labels[:case.local_batch * case.world * case.steps]
    model.fit(ids, labels, batch_size=case.local_batch * case.world, shuffle=False,
              verbose=0, callbacks=[FiitedAdjust(**steps_per_adjust)])
    return model


def _reference_counts(model, case):
    return [model.get_layer(t.name).table.chunks_per_row() for t in case.tables]


def _compiled(case, mesh, **layer_kwargs):
    model, layer = case.distributed_model(mesh, **layer_kwargs)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(RowWiseAdagrad(0.1)),
                  loss=hc.loss_fn)
    return model, layer


def _fit(model, case, mesh, adjust=ADJUST):
    ids, labels = case.local_data(mesh.rank)
    model.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0,
              callbacks=[FiitedAdjust(**adjust)])


def _distributed(case, mesh, adjust=ADJUST, **layer_kwargs):
    model, layer = _compiled(case, mesh, **layer_kwargs)
    _fit(model, case, mesh, adjust)
    return model, layer


class FiitedMeshTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_every_mesh_prunes_and_trains_as_one_process(self):
        world = hc.world_size()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=12, world=world, seed=23,
                       adaptive_target=TARGET)
        reference = _reference(case)
        want_counts = _reference_counts(reference, case)
        for table, counts in zip(case.tables, want_counts):
            # pruning happened, and unevenly: the test compares real decisions
            self.assertEqual(counts.sum(), math.floor(TARGET * table.rows * table.dim))
            self.assertGreater(len(set(counts.tolist())), 1)
        for model_parallel in hc.meshes_for_this_keras(sorted({2, world})):
            with self.subTest(model_parallel=model_parallel):
                mesh = tfhybrid.init(model_parallel=model_parallel)
                model, layer = _distributed(case, mesh, **_NO_COLUMN_SLICES)
                kinds = {p.kind for p in layer.plan.tables}
                self.assertTrue({"row_wise", "table_wise", "data_parallel"} <= kinds, kinds)
                for got, want in zip(layer.chunks_per_row(), want_counts):
                    self.assertAllEqual(got, want)
                for got, want in zip(hc.table_weights(layer),
                                     hc.reference_tables(reference, case)):
                    self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
                for got, want in zip(hc.dense_weights(model), hc.dense_weights(reference)):
                    self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
                # this rank's pools hold exactly its shards' part of the kept chunks
                for t, placement in enumerate(layer.plan.tables):
                    for s, shard in enumerate(placement.shards):
                        store = layer.route.stores.get(t, s)
                        chunked = None if store is None else store.widths
                        if chunked is not None:
                            part = want_counts[t][shard.row_start:shard.row_end]
                            self.assertEqual(chunked.pool_slots(), int(part.sum()))
            mesh_lib.reset()


class ColumnSliceTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_column_slices_take_one_process_decision(self):
        # one step, then the adjustment: the utilities come from the same gradients
        world = hc.world_size()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=1, world=world, seed=29,
                       adaptive_target=TARGET)
        once = dict(every_n_batches=1)
        want_counts = _reference_counts(_reference(case, once), case)
        mesh = tfhybrid.init(model_parallel=2)
        _, layer = _distributed(case, mesh, adjust=once)
        self.assertIn("column_wise", {p.kind for p in layer.plan.tables})
        for got, want in zip(layer.chunks_per_row(), want_counts):
            self.assertAllEqual(got, want)


def _weights_file_entries(path: str) -> dict:
    """Every array of a Keras 3 weights file, by its name within its object."""
    import h5py
    found = {}
    with h5py.File(path, "r") as weights:
        weights.visititems(lambda name, item: found.__setitem__(
            name.rsplit("/", 1)[-1], item[()]) if isinstance(item, h5py.Dataset) else None)
    return found


class CheckpointTest(tf.test.TestCase):
    """A FIITED checkpoint holds whole tables (values, chunk layout, utility) under
    mesh-free names, so it restores onto another mesh and training goes on as if
    uninterrupted."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_restores_onto_other_meshes_and_continues_like_the_uninterrupted_run(self):
        world = hc.world_size()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=12, world=world, seed=31,
                       adaptive_target=TARGET)
        more = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=6, world=world, seed=37,
                       adaptive_target=TARGET)
        # the same directory on every rank (all ranks write one checkpoint together)
        made = tempfile.mkdtemp(prefix="tfhybrid-fiited-") if hvd.rank() == 0 else None
        directory = hvd.broadcast_object(made, root_rank=0, name="fiited_ckpt_dir")
        self.addCleanup(shutil.rmtree, directory, True)
        # Keras 3 writes save_weights as a weights file, which it names .weights.h5
        path = os.path.join(directory, "fiited_ckpt" + (
            ".weights.h5" if KERAS_3 else ""))

        mesh = tfhybrid.init(model_parallel=2)
        model, layer = _distributed(case, mesh, **_NO_COLUMN_SLICES)
        model.save_weights(path)
        saved_tables, saved_counts = hc.table_weights(layer), layer.chunks_per_row()
        if KERAS_3:
            # a weights file holds each table whole, with its layout and utilities
            entries = _weights_file_entries(path)
            for t, (table, counts) in enumerate(zip(case.tables, saved_counts)):
                self.assertAllEqual(entries[f"table_{t}_chunk_counts"], counts)
                self.assertEqual(entries[f"table_{t}"].shape, (table.rows, table.dim))
                self.assertEqual(entries[f"table_{t}_utility"].shape,
                                 (table.rows, table.dim))   # one column per chunk here
        else:
            # compact: each table's values are its present chunks (one column per chunk)
            shapes = dict(tf.train.list_variables(path))
            for t, (table, counts) in enumerate(zip(case.tables, saved_counts)):
                key = f"tables/.ATTRIBUTES/table_{t}"
                self.assertEqual([v for k, v in shapes.items() if k.endswith(key)],
                                 [[int(counts.sum()), 1]], table.name)
        _fit(model, more, mesh)
        want_tables, want_counts = hc.table_weights(layer), layer.chunks_per_row()
        want_dense = hc.dense_weights(model)
        mesh_lib.reset()

        # 4x1 (every table whole on each rank): exact restore, then the same training
        mesh = tfhybrid.init(model_parallel=1)
        model, layer = _compiled(case, mesh, **_NO_COLUMN_SLICES)
        model.load_weights(path)
        for got, want in zip(layer.chunks_per_row(), saved_counts):
            self.assertAllEqual(got, want)
        for got, want in zip(hc.table_weights(layer), saved_tables):
            self.assertAllEqual(got, want)
        _fit(model, more, mesh)
        for got, want in zip(layer.chunks_per_row(), want_counts):
            self.assertAllEqual(got, want)
        for got, want in zip(hc.table_weights(layer), want_tables):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
        for got, want in zip(hc.dense_weights(model), want_dense):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
        mesh_lib.reset()

        # 1x4 with column slices: the layout, values and each row's utility come back
        mesh = tfhybrid.init(model_parallel=world)
        model, layer = _compiled(case, mesh)
        self.assertIn("column_wise", {p.kind for p in layer.plan.tables})
        model.load_weights(path)
        for got, want in zip(layer.chunks_per_row(), saved_counts):
            self.assertAllEqual(got, want)
        for got, want in zip(hc.table_weights(layer), saved_tables):
            self.assertAllEqual(got, want)
        # a fresh adjustment plans from the restored utilities as the saved mesh would
        # have: re-planning at the target keeps the saved layout
        layer.adjust()
        for got, want in zip(layer.chunks_per_row(), saved_counts):
            self.assertAllEqual(got, want)
