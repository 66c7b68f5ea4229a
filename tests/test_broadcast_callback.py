"""Broadcast with DE's semantics, and Horovod's broadcast callback (issue 12, item 8).

``tfhybrid.broadcast_variables`` after a step, with every kind of variable (shards,
data-parallel tables, dense layers, both optimizers' slots): replicated variables become
root's, each shard (and its slots) the copy in root's replica, and then the replicas are
one model (equal outputs; an SGD step equals one process). The callback broadcasts after
the first batch, as Horovod's does (checked against Horovod's own callback).
"""

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import distributed
from tfhybrid import roles
from tfhybrid import mesh as mesh_lib
from tfhybrid import optimizers
from tests import _hybrid_case as hc

KERAS_3 = tfhybrid.keras_major() == 3

# four ranks hold groups of two both ways (2x2), and the 1D meshes of four;
# two ranks would only repeat them at a smaller size
HOROVOD_NP = (4,)
KERAS = (2, 3)


def _mesh():
    # 1 x 2 on two ranks (each shard has one copy), 2 x 2 on four
    return tfhybrid.init(model_parallel=2)


def _replica_of(mesh, rank):
    return next(d for d, group in enumerate(mesh.model_groups) if rank in group)


def _names(variable):
    """Every name Keras knows ``variable`` by (Keras 3 weights have a path too)."""
    return {variable.name.split(":")[0], getattr(variable, "path", None) or ""} - {""}


def _named_after(slot, shard_name):
    # Keras 2 names a slot "<slot>/<variable path>" or "<variable path>/<slot>"; Keras 3
    # "<variable path with _ for />_<slot>"
    return any(f"/{shard_name}/" in f"/{name}/"
               or name.startswith(shard_name.replace("/", "_") + "_")
               for name in _names(slot))


def _on_one_position(variables):
    """The test's own view: shards, and any variable named after one (its slots)."""
    shards = [v for v in variables if roles.is_model_parallel(v)]
    names = [n for s in shards for n in _names(s)]
    return [roles.is_model_parallel(v) or any(_named_after(v, n) for n in names)
            for v in variables]


def _perturb(variables, rank):
    """Makes every rank's copy of every variable its own."""
    for j, var in enumerate(variables):
        dtype = tf.as_dtype(var.dtype)   # Keras 3 weights name their dtype by a string
        if dtype.is_floating:
            var.assign_add(tf.fill(tf.shape(var), 0.01 * (rank + 1) * (j % 7 + 1)))
        elif dtype.is_integer:
            var.assign_add(tf.cast(rank + 1, dtype))


def _local_steps(case, rank, steps):
    parts = [case.local_batch_of(s, rank) for s in steps]
    ids = [hc.concat_samples([p[0][f] for p in parts]) for f in range(len(case.tables))]
    return ids, np.concatenate([p[1] for p in parts])


def _eager_step(model, optimizer, ids, labels):
    with tf.GradientTape() as tape:
        loss = hc.loss_fn(labels, model(ids, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def _all_variables(model):
    return list(model.variables) + distributed.optimizer_variables(model.optimizer)


def _assert_outputs_match(test, model, case):
    """Every rank's outputs on the same samples are equal: the replicas are one model."""
    ids, _ = case.local_batch_of(1, 0)
    outputs = hvd.allgather_object(model(ids).numpy(), name="outputs_match")
    for other in outputs[1:]:
        test.assertAllClose(other, outputs[0], atol=1e-6, rtol=1e-6)


class BroadcastVariablesTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_after_a_step_every_copy_becomes_its_root_replicas(self):
        mesh = _mesh()
        root = mesh.size - 1              # on four ranks, in replica 1
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=2, world=mesh.size, seed=31)
        model, layer = case.distributed_model(mesh)
        optimizer = tfhybrid.DistributedOptimizer(
            tf.keras.optimizers.Adam(0.01), embedding_optimizer=optimizers.RowWiseAdagrad(0.1))
        # eager steps: nothing to trace
        _eager_step(model, optimizer, *case.local_batch_of(0, mesh.rank))
        variables = list(model.variables) + distributed.optimizer_variables(optimizer)
        local = _on_one_position(variables)
        # slots of shards are among them (Adam's for dense layers, AdaGrad's for tables)
        owns_shards = any(roles.is_model_parallel(v) for v in variables)
        slots = [v for v, one in zip(variables, local)
                 if one and not roles.is_model_parallel(v)]
        self.assertEqual(bool(slots), owns_shards)
        _perturb(variables, mesh.rank)
        # positions hold different shards, so the lists line up per kind: replicated
        # variables on every rank, shards and their slots inside each data group
        kinds = {False: [v for v, one in zip(variables, local) if not one],
                 True: [v for v, one in zip(variables, local) if one]}
        before = hvd.allgather_object({k: [v.numpy() for v in vs] for k, vs in kinds.items()},
                                      name="before")
        tfhybrid.broadcast_variables(variables, root_rank=root)
        shard_root = mesh.model_groups[_replica_of(mesh, root)][mesh.model_position]
        for one, listed in kinds.items():
            source = shard_root if one else root
            for j, var in enumerate(listed):
                self.assertAllEqual(var, before[source][one][j], msg=f"{var.name} from {source}")
                if mesh.rank != source and var.shape.num_elements():   # it really changed
                    self.assertNotAllClose(before[mesh.rank][one][j], before[source][one][j])
        _assert_outputs_match(self, model, case)
        # the replicas are one model: an SGD step from here equals one process
        reference = case.reference_model()
        tables = hc.table_weights(layer)
        for table, values in zip(case.tables, tables):
            reference.get_layer(table.name).set_weights([values])
        reference.get_layer("hidden").set_weights(model.get_layer("hidden").get_weights())
        reference.get_layer("logit").set_weights(model.get_layer("logit").get_weights())
        _eager_step(model, tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.5)),
                    *case.local_batch_of(1, mesh.rank))
        ids, labels = case.global_batch(1)
        sgd = tf.keras.optimizers.SGD(0.5)
        with tf.GradientTape() as tape:
            loss = hc.loss_fn(labels, reference(ids))
        grads = tape.gradient(loss, reference.trainable_variables)
        sgd.apply_gradients(zip(grads, reference.trainable_variables))
        for got, want in zip(hc.table_weights(layer), hc.reference_tables(reference, case)):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
        for got, want in zip(hc.dense_weights(model), hc.dense_weights(reference)):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)

    def test_untagged_slots_by_name_and_mismatched_lists(self):
        mesh = _mesh()
        root = mesh.size - 1
        dense = tf.Variable([float(mesh.rank)] * 2, name="dense")
        shard = tf.Variable([10.0 * mesh.rank] * 3, name=f"layer/shard_{mesh.model_position}")
        roles.mark_model_parallel(shard, mesh)
        # a slot no route tagged, made by a plain Keras optimizer (named as it names slots)
        slot = tf.keras.optimizers.SGD(momentum=0.9).add_variable_from_reference(shard, "m")
        slot.assign([100.0 * mesh.rank] * 3)
        tfhybrid.broadcast_variables([dense, shard, slot], root_rank=root)
        shard_root = mesh.model_groups[_replica_of(mesh, root)][mesh.model_position]
        self.assertAllEqual(dense, [float(root)] * 2)
        self.assertAllEqual(shard, [10.0 * shard_root] * 3)
        self.assertAllEqual(slot, [100.0 * shard_root] * 3)
        # lists that differ between ranks raise on every rank instead of hanging
        extra = [tf.Variable([1.0, 2.0])] if mesh.rank == 0 else []
        with self.assertRaisesRegex(ValueError, "rank 0's variables differ|differ from rank 0"):
            tfhybrid.broadcast_variables([dense] + extra, root_rank=0)
        with self.assertRaisesRegex(ValueError, "root_rank=7"):
            tfhybrid.broadcast_variables([dense], root_rank=7)
        with self.assertRaisesRegex(ValueError, "process_set="):
            tfhybrid.broadcast_variables([dense], process_set=mesh.model_process_set
                                         if mesh.data_parallel > 1 else
                                         mesh.data_process_set)


class BroadcastCallbackTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _dense_run(self, mesh, callback, build_first=False):
        """A Keras model whose ranks start from different weights, fit for three steps;
        ``callback=None`` broadcasts by hand with Horovod after the first of them."""
        model = tf.keras.Sequential([
            tf.keras.layers.Dense(3, activation="tanh",
                                  kernel_initializer=tf.keras.initializers.GlorotUniform(
                                      seed=mesh.rank)),
            tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.GlorotUniform(
                seed=100 + mesh.rank))])
        model.compile(optimizer=tfhybrid.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
        rng = np.random.default_rng(5)
        x = rng.normal(size=[6 * mesh.size, 4]).astype(np.float32)
        y = rng.normal(size=[6 * mesh.size, 1]).astype(np.float32)
        if build_first:
            model(x[:1])
        x, y = x[mesh.rank::mesh.size], y[mesh.rank::mesh.size]
        if callback is None:
            model.fit(x[:2], y[:2], batch_size=2, verbose=0)
            hvd.broadcast_variables([v.value if hasattr(v, "path") else v
                                     for v in _all_variables(model)], root_rank=mesh.size - 1)
            x, y = x[2:], y[2:]
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0,
                  callbacks=[] if callback is None else [callback])
        return [v.numpy() for v in _all_variables(model)]

    def test_broadcasts_after_the_first_batch_like_horovods_callback(self):
        mesh = _mesh()
        root = mesh.size - 1
        callback = tfhybrid.BroadcastGlobalVariablesCallback(root, device="")
        ours = self._dense_run(mesh, callback)
        self.assertTrue(callback.broadcast_done)
        if KERAS_3:
            # Horovod's Keras callback cannot run in Keras 3 (it calls .ref() on Keras
            # weights): its rule, a broadcast after the first batch, is done by hand
            horovods = self._dense_run(mesh, None)
        else:
            import horovod.tensorflow.keras as hvd_keras
            horovods = self._dense_run(
                mesh, hvd_keras.callbacks.BroadcastGlobalVariablesCallback(root))
        self.assertEqual(len(ours), len(horovods))
        for got, want in zip(ours, horovods):    # weights, momenta and iterations
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
        everyone = hvd.allgather_object(ours, name="dense_run")
        for other in everyone:
            for got, want in zip(other, ours):
                self.assertAllEqual(got, want)
        # broadcasting before the first step (BroadcastVariables on a built model) is a
        # different run: the timing above is Horovod's
        earlier = self._dense_run(mesh, tfhybrid.callbacks.BroadcastVariables(root),
                                  build_first=True)
        self.assertNotAllClose(earlier[0], ours[0])

    def test_on_the_hybrid_model_equals_a_broadcast_after_the_first_step(self):
        mesh = _mesh()
        root = mesh.size - 1
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=3, world=mesh.size, seed=37)

        def start():
            model, layer = case.distributed_model(mesh)
            _perturb(list(model.variables), mesh.rank)   # replicas start apart
            model.compile(optimizer=tfhybrid.DistributedOptimizer(
                tf.keras.optimizers.SGD(0.5, momentum=0.9)), loss=hc.loss_fn)
            return model, layer

        model, layer = start()
        ids, labels = _local_steps(case, mesh.rank, range(3))
        model.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0,
                  callbacks=[tfhybrid.BroadcastGlobalVariablesCallback(root)])
        by_hand, by_hand_layer = start()
        ids, labels = _local_steps(case, mesh.rank, [0])
        by_hand.fit(ids, labels, batch_size=case.local_batch, verbose=0)
        tfhybrid.broadcast_variables(_all_variables(by_hand), root_rank=root)
        ids, labels = _local_steps(case, mesh.rank, [1, 2])
        by_hand.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0)
        for got, want in zip(_all_variables(model), _all_variables(by_hand)):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6, msg=got.name)
        for got, want in zip(hc.table_weights(layer), hc.table_weights(by_hand_layer)):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
        _assert_outputs_match(self, model, case)


if __name__ == "__main__":
    tf.test.main()
