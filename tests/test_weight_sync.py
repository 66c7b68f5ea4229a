"""Weight-sync mode: replicas step alone and are averaged every K steps."""

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid import roles
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.optimizers import MomentumScaledRowWiseAdagrad, RowWiseAdagrad
from tfhybrid.train.step import click_train_step

HOROVOD_NP = (2, 4)

LOCAL_BATCH = 4
TABLES = [("big", 300, 8), ("mid", 120, 6), ("small", 20, 4)]
THRESHOLDS = dict(data_parallel_threshold=100, row_slice_threshold=2000)


def _model(mesh, replica_sync, sync_every=1):
    layer = DistributedEmbedding(
        [Embedding(rows, dim, combiner="sum", name=name) for name, rows, dim in TABLES],
        mesh=mesh, replica_sync=replica_sync, sync_every=sync_every, **THRESHOLDS)
    head = tf.keras.layers.Dense(1)
    return layer, head


def _init(layer, head, batch):
    layer(batch)
    rng = np.random.default_rng(0)
    layer.set_weights([rng.standard_normal([rows, dim]).astype(np.float32) * 0.1
                       for _, rows, dim in TABLES])
    head(tf.zeros([1, sum(d for *_, d in TABLES)]))
    head.set_weights([np.linspace(-1, 1, sum(d for *_, d in TABLES),
                                  dtype=np.float32)[:, None], np.zeros([1], np.float32)])


def _batches(mesh, steps, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = [rng.integers(0, rows, size=[LOCAL_BATCH * mesh.size, 3])
               for _, rows, _ in TABLES]
        labels = rng.integers(0, 2, size=[LOCAL_BATCH * mesh.size, 1]).astype(np.float32)
        lo, hi = mesh.rank * LOCAL_BATCH, (mesh.rank + 1) * LOCAL_BATCH
        out.append(([tf.constant(x[lo:hi]) for x in ids], tf.constant(labels[lo:hi])))
    return out


def _train(layer, head, optimizer, batches):
    for ids, labels in batches:
        click_train_step(layer, head, optimizer, ids, labels)


class _Holder(tf.keras.Model):
    def __init__(self, layer):
        super().__init__()
        self.embedding = layer


class WeightSyncTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _mesh(self):
        world = tfhybrid.init(model_parallel=1).size
        mesh_lib.reset()
        # D = 2 replicas: 2x1 on two ranks, 2x2 on four
        return tfhybrid.init(model_parallel=world // 2)

    def test_sgd_with_k1_equals_gradient_sync(self):
        mesh = self._mesh()
        batches = _batches(mesh, 5)
        tables = {}
        for mode in ("gradients", "weights"):
            layer, head = _model(mesh, mode, sync_every=1)
            _init(layer, head, batches[0][0])
            optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), mesh=mesh)
            _train(layer, head, optimizer, batches)
            tables[mode] = (layer.get_weights(all_ranks=True), head.get_weights())
        for got, want in zip(tables["weights"][0] + tables["weights"][1],
                             tables["gradients"][0] + tables["gradients"][1]):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)

    def test_replicas_differ_between_syncs_and_agree_after(self):
        mesh = self._mesh()
        self.assertEqual(mesh.data_parallel, 2)
        layer, head = _model(mesh, "weights", sync_every=3)
        batches = _batches(mesh, 3, seed=2)
        _init(layer, head, batches[0][0])
        optimizer = tfhybrid.DistributedOptimizer(RowWiseAdagrad(0.1), mesh=mesh)
        shards = [v for v in layer.trainable_variables if "shard" in v.name]
        self.assertNotEmpty(shards)
        for v in shards:
            self.assertEqual(roles.role_of(v).momentum_scale, 2.0)

        def spread(variables):
            # largest difference between this shard's two replicas, seen by every rank
            import horovod.tensorflow as hvd
            values = tf.concat([tf.reshape(v, [-1]) for v in variables], 0)
            hi = hvd.allreduce(values, op=hvd.Max, process_set=mesh.data_process_set)
            lo = hvd.allreduce(values, op=hvd.Min, process_set=mesh.data_process_set)
            return float(tf.reduce_max(hi - lo))

        _train(layer, head, optimizer, batches[:1])
        accumulators = [a for v in shards
                        for a in tfhybrid.distributed.optimizer_state_of(optimizer, v)]
        self.assertLen(accumulators, len(shards))
        self.assertGreater(spread(shards), 1e-4)        # stepped alone
        self.assertGreater(spread(accumulators), 1e-6)
        _train(layer, head, optimizer, batches[1:])      # step 3: sync is due
        self.assertLess(spread(shards), 1e-7)
        self.assertLess(spread(accumulators), 1e-7)

    def test_sync_replicas_and_callback_average(self):
        mesh = self._mesh()
        layer, head = _model(mesh, "weights", sync_every=1000)
        batches = _batches(mesh, 1, seed=3)
        _init(layer, head, batches[0][0])
        shards = [v for v in layer.trainable_variables if "shard" in v.name]
        before = [v.numpy() for v in shards]
        for v in shards:
            v.assign_add(tf.fill(v.shape, float(mesh.replica)))
        tfhybrid.sync_replicas(layer, mesh=mesh)
        # replica d added d; the average over D = 2 replicas adds 0.5
        for v, b in zip(shards, before):
            self.assertAllClose(v, b + 0.5)
        model = _Holder(layer)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1))
        self.assertNotEmpty(model.weights)
        callback = tfhybrid.callbacks.SyncReplicas()
        callback.set_model(model)
        for v in shards:
            v.assign_add(tf.fill(v.shape, float(mesh.replica)))
        callback.on_epoch_end(0)
        for v, b in zip(shards, before):
            self.assertAllClose(v, b + 1.0)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, r"replica_sync='params' is unknown"):
            DistributedEmbedding([Embedding(5, 2)], replica_sync="params")
        with self.assertRaisesRegex(ValueError, r"sync_every=0 must be an int >= 1"):
            DistributedEmbedding([Embedding(5, 2)], replica_sync="weights", sync_every=0)
        with self.assertRaisesRegex(ValueError, r"every_n_batches=0"):
            tfhybrid.callbacks.SyncReplicas(every_n_batches=0)
        with self.assertRaisesRegex(ValueError, r"momentum_scale"):
            MomentumScaledRowWiseAdagrad(0.1, momentum_scale=-1.0)


if __name__ == "__main__":
    tf.test.main()
