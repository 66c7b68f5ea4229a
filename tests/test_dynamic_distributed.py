"""Dynamic tables sharded by key over the mesh (4 ranks): exact against a dict of rows on
1x4 and 2x2 (both layouts); the replicas of every shard hold bitwise the same key -> slot
map after every step while admission and eviction run; a checkpoint saved on 2x2 goes on
on 1x4 and 4x1 as if never stopped. (1x1: ``tests/test_dynamic_table.py``.)
"""

import os
import shutil
import tempfile

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.dynamic.table import STATE
from tfhybrid.layers import DistributedEmbedding, DynamicEmbedding
from tfhybrid.optimizers import RowWiseAdagrad
from tests import _dynamic_case as dc

HOROVOD_NP = (4,)
KERAS = (2, 3)
KERAS_3 = tfhybrid.keras_major() == 3


class ShardedDynamicTableTest(tf.test.TestCase):

    def test_every_mesh_equals_a_dict_of_rows(self):
        for model_parallel, layout in ((4, "model_major"), (2, "model_major"),
                                       (2, "data_major")):
            with self.subTest(model_parallel=model_parallel, layout=layout):
                layer, held, want = dc.check_mesh_against_dict(self, "sum", model_parallel,
                                                               layout)
                self.assertEqual(layer.plan.tables[0].kind, "hash_wise")
                # every key trained is held by the one position that owns it
                keys = hvd.allgather_object(sorted(held))
                group = sorted(k for r in _model_group(layer.mesh) for k in keys[r])
                self.assertEqual(group, sorted(want))

    def test_fit_on_every_mesh_equals_a_dict_of_rows(self):
        for model_parallel, layout in ((4, "model_major"), (2, "model_major"),
                                       (2, "data_major")):
            with self.subTest(model_parallel=model_parallel, layout=layout):
                layer, held, want = dc.check_fit_against_dict(self, model_parallel, layout)
                keys = hvd.allgather_object(sorted(held))
                group = sorted(k for r in _model_group(layer.mesh) for k in keys[r])
                self.assertEqual(group, sorted(want))

    def test_replicas_hold_the_same_map_after_every_step_while_evicting(self):
        for replica_sync in ("gradients", "weights"):
            with self.subTest(replica_sync=replica_sync):
                self._check_agreement(replica_sync)

    def _check_agreement(self, replica_sync):
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=2)
        # 16 slots over 2 positions for a long-tailed stream of keys, admitted on their
        # second sighting: admission, candidates and eviction all run
        layer = DistributedEmbedding([dc.dynamic_layer("sum", capacity=16, admit_after=2)],
                                     mesh=mesh, replica_sync=replica_sync, sync_every=2)
        optimizer = RowWiseAdagrad(learning_rate=dc.LR)
        batches = dc.long_tailed_batches(20, 4 * 2, 2, seed=9)
        mine = slice(mesh.rank * 2, mesh.rank * 2 + 2)
        for step, (keys, weights) in enumerate(batches):
            with tf.GradientTape() as tape:
                out = layer([tf.constant(keys[mine])], training=True)[0]
                loss = tf.reduce_sum(out * weights[mine])
            # in weight-sync mode the tape's optimizer averages the replicas every 2 steps
            grads = tfhybrid.DistributedGradientTape(tape, optimizer=optimizer).gradient(
                loss, layer.trainable_variables)
            optimizer.apply_gradients(zip(grads, layer.trainable_variables))
            synced = replica_sync == "gradients" or step % 2 == 1
            table = layer.stores.get(0, mesh.model_position).tracked
            # the map, its candidates and counters always; the rows and accumulators
            # where they are synced (every step, or at a weight sync)
            names = STATE + (("rows", "accumulator") if synced else ())
            state = [getattr(table, name).numpy() for name in names]
            everyone = hvd.allgather_object(state)
            for other in _data_group(mesh):
                for name, a, b in zip(names, state, everyone[other]):
                    self.assertAllEqual(a, b, msg=f"{replica_sync} step {step}: {name} "
                                                  f"differs between ranks {mesh.rank} and "
                                                  f"{other}")
        stats = layer.table_stats()["keys"]
        self.assertGreater(stats["evictions"], 0)
        self.assertGreater(stats["candidates"] + stats["admissions"], stats["size"])
        self.assertLessEqual(stats["size"], 16)

    def test_every_input_form_reaches_the_keys_owner(self):
        # fresh tables: a bag's output is the sum of its keys' initial rows on any mesh,
        # so each rank's output equals one process's DynamicEmbedding on its batch
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=2)
        strings = DynamicEmbedding(4, capacity=64, combiner="mean", key_dtype=tf.string,
                                   seed=5, name="names", admit_after=2, default_row=0.25)
        layer = DistributedEmbedding([dc.dynamic_layer("sum"), strings,
                                      dc.dynamic_layer(None, name="one_key")], mesh=mesh,
                                     input_table_map=[0, 0, 1, 2])
        rank = mesh.rank
        inputs = [tf.constant([[rank, -rank - 1, 2**40], [5, 6, 7]], tf.int64),
                  tf.ragged.constant([[7, 8, rank], []], tf.int64),
                  tf.ragged.constant([[f"user:{rank}", f"x:{rank}"], [f"y:{rank}"]]),
                  tf.constant([2**62 + rank, -5], tf.int64)]
        got = layer(inputs, training=True)
        # (the strings are seen once: not admitted, each reads the default row)
        alone = [dc.dynamic_layer("sum"), DynamicEmbedding(
            4, capacity=64, combiner="mean", key_dtype=tf.string, seed=5, admit_after=2,
            default_row=0.25), dc.dynamic_layer(None)]
        want = [alone[0](inputs[0]), alone[0](inputs[1]), alone[1](inputs[2]),
                alone[2](inputs[3])]
        for g, w in zip(got, want):
            self.assertAllClose(g, w, atol=1e-6)
        # every string is a candidate once, where its fingerprint's hash puts it: a
        # shard's replicas count the keys routed to any of them
        stats = layer.table_stats()["names"]
        self.assertEqual((stats["size"], stats["candidates"]), (0, 3 * mesh.size))

    def test_a_checkpoint_of_2x2_goes_on_on_other_meshes_as_if_never_stopped(self):
        steps, local_batch = 8, 3
        batches = dc.global_batches(steps, 4 * local_batch, 3, seed=13)
        scaled = [(k, w / (4 * local_batch)) for k, w in batches]
        _, want_rows = dc.reference_training(scaled, dc.DIM, dc.LOW, dc.HIGH, dc.SEED,
                                             dc.LR, dc.EPS, "sum")
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=2)
        directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
        try:
            layer, optimizer = _train(mesh, batches[:4], local_batch)
            path = tf.train.Checkpoint(layer=layer, optimizer=optimizer).save(
                os.path.join(directory, "ckpt"))
            for model_parallel in (4, 1):
                with self.subTest(model_parallel=model_parallel):
                    mesh_lib.reset()
                    mesh = tfhybrid.init(model_parallel=model_parallel)
                    fresh = DistributedEmbedding([dc.dynamic_layer("sum")], mesh=mesh)
                    fresh([tf.constant([[0, 0, 0]], tf.int64)], training=False)
                    fresh_optimizer = RowWiseAdagrad(learning_rate=dc.LR, epsilon=dc.EPS)
                    tf.train.Checkpoint(layer=fresh, optimizer=fresh_optimizer).restore(path)
                    _train(mesh, batches[4:], local_batch, fresh, fresh_optimizer)
                    held = dc.rows_by_key(fresh)
                    for key, row in held.items():
                        np.testing.assert_allclose(row, want_rows[key], rtol=0, atol=1e-6,
                                                   err_msg=f"key {key} on {mesh}")
                    keys = hvd.allgather_object(sorted(held))
                    group = sorted(k for r in _model_group(mesh) for k in keys[r])
                    self.assertEqual(group, sorted(want_rows))
        finally:
            hvd.allgather_object(0)   # every rank is done with the files
            if hvd.rank() == 0:
                shutil.rmtree(directory, ignore_errors=True)

    def test_save_weights_of_2x2_load_on_1x4_by_key(self):
        # Keras 3: a .weights.h5 file; Keras 2: a TensorFlow checkpoint prefix
        batches = dc.global_batches(6, 12, 3, seed=17)
        scaled = [(k, w / 12) for k, w in batches]
        _, want_rows = dc.reference_training(scaled, dc.DIM, dc.LOW, dc.HIGH, dc.SEED,
                                             dc.LR, dc.EPS, "sum")
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=2)
        directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
        path = os.path.join(directory, "w" + (".weights.h5" if KERAS_3 else ""))
        try:
            model, _ = _keras_model(mesh)
            _fit(model, mesh, batches[:3])
            model.save_weights(path)
            mesh_lib.reset()
            mesh = tfhybrid.init(model_parallel=4)
            fresh, layer = _keras_model(mesh)
            fresh.load_weights(path)
            _fit(fresh, mesh, batches[3:])
            held = dc.rows_by_key(layer)
            for key, row in held.items():
                np.testing.assert_allclose(row, want_rows[key], rtol=0, atol=1e-6,
                                           err_msg=f"key {key} on {mesh}")
            keys = hvd.allgather_object(sorted(held))
            self.assertEqual(sorted(k for r in _model_group(mesh) for k in keys[r]),
                             sorted(want_rows))
        finally:
            hvd.allgather_object(0)
            if hvd.rank() == 0:
                shutil.rmtree(directory, ignore_errors=True)

    def test_a_shard_too_small_for_its_keys_names_both_numbers(self):
        mesh_lib.reset()
        mesh = tfhybrid.init(model_parallel=2)
        directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
        try:
            layer, optimizer = _train(mesh, dc.global_batches(2, 12, 3), 3)
            path = tf.train.Checkpoint(layer=layer).save(os.path.join(directory, "ckpt"))
            small = DistributedEmbedding([dc.dynamic_layer("sum", capacity=4)], mesh=mesh)
            small([tf.constant([[0, 0, 0]], tf.int64)], training=False)
            with self.assertRaisesRegex(ValueError, r"\d+ keys are to be restored into "
                                                    r"this shard, which has capacity 2"):
                tf.train.Checkpoint(layer=small).restore(path)
        finally:
            hvd.allgather_object(0)
            if hvd.rank() == 0:
                shutil.rmtree(directory, ignore_errors=True)


def _model_group(mesh) -> list:
    """The ranks of this rank's model group."""
    return [r for r in range(mesh.size)
            if hvd_mesh_replica(mesh, r) == hvd_mesh_replica(mesh, mesh.rank)]


def _data_group(mesh) -> list:
    """The other ranks of this rank's data group (the replicas of its shards)."""
    return [r for r in range(mesh.size) if r != mesh.rank
            and hvd_mesh_position(mesh, r) == mesh.model_position]


def hvd_mesh_position(mesh, rank) -> int:
    """Rank ``rank``'s position in its model group, by the layout's rule."""
    if mesh.layout == "model_major":
        return rank % mesh.model_parallel
    return rank // mesh.data_parallel


def hvd_mesh_replica(mesh, rank) -> int:
    if mesh.layout == "model_major":
        return rank // mesh.model_parallel
    return rank % mesh.data_parallel


def _keras_model(mesh):
    """A model of one dynamic table, built and compiled for ``_fit``."""
    keys = tf.keras.Input(shape=[3], dtype=tf.int64)
    layer = DistributedEmbedding([dc.dynamic_layer("sum")], mesh=mesh)
    model = tf.keras.Model(keys, layer([keys])[0])
    model.compile(optimizer=tfhybrid.DistributedOptimizer(
        RowWiseAdagrad(learning_rate=dc.LR, epsilon=dc.EPS)),
        loss=lambda weights, out: tf.reduce_sum(out * weights) / 3)
    return model, layer


def _fit(model, mesh, batches):
    mine = slice(mesh.rank * 3, mesh.rank * 3 + 3)
    model.fit(np.concatenate([k[mine] for k, _ in batches]),
              np.concatenate([w[mine] for _, w in batches]), batch_size=3, epochs=1,
              shuffle=False, verbose=0)


def _train(mesh, batches, local_batch, layer=None, optimizer=None):
    """A dynamic table's layer trained on ``batches`` in a custom loop (the mean loss
    over the global batch, as ``_dynamic_case``)."""
    layer = layer or DistributedEmbedding([dc.dynamic_layer("sum")], mesh=mesh)
    optimizer = optimizer or RowWiseAdagrad(learning_rate=dc.LR, epsilon=dc.EPS)
    mine = slice(mesh.rank * local_batch, (mesh.rank + 1) * local_batch)
    for keys, weights in batches:
        with tf.GradientTape() as tape:
            out = layer([tf.constant(keys[mine])], training=True)[0]
            loss = tf.reduce_sum(out * weights[mine]) / local_batch
        grads = tfhybrid.DistributedGradientTape(tape).gradient(
            loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
    return layer, optimizer


if __name__ == "__main__":
    tf.test.main()
