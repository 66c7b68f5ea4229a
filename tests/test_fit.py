"""model.fit / evaluate / predict on a hybrid-parallel model, against custom loops."""

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding
from tfhybrid.train.step import click_train_step

HOROVOD_NP = (4,)
KERAS = (2, 3)

LOCAL_BATCH = 8
STEPS = 6
TABLES = [("user", 300, 8, "sum"), ("item", 120, 6, "mean"), ("tiny", 20, 4, "sum")]


def _model(mesh):
    ids = [tf.keras.Input([3], dtype=tf.int64, name=name) for name, *_ in TABLES]
    embedded = DistributedEmbedding(
        [Embedding(rows, dim, combiner=c, name=name) for name, rows, dim, c in TABLES],
        mesh=mesh, data_parallel_threshold=100, row_slice_threshold=2000)(ids)
    hidden = tf.keras.layers.Dense(8, activation="relu")(
        tf.keras.layers.Concatenate(axis=1)(embedded))
    return tf.keras.Model(ids, tf.keras.layers.Dense(1)(hidden))


def _data(mesh, seed=0):
    rng = np.random.default_rng(seed)
    n = LOCAL_BATCH * mesh.size * STEPS
    features = {name: rng.integers(0, rows, size=[n, 3]) for name, rows, *_ in TABLES}
    labels = rng.integers(0, 2, size=[n, 1]).astype(np.float32)
    return features, labels


def _local(mesh, features, labels):
    # rank r takes sample rows r, r+N, ... so each global batch is split over the ranks
    pick = lambda x: x[mesh.rank::mesh.size]  # noqa: E731
    return {k: pick(v) for k, v in features.items()}, pick(labels)


class FitTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _init_weights(self, model, seed=1):
        rng = np.random.default_rng(seed)
        embedding = model.layers[len(TABLES)]
        embedding.set_weights([rng.normal(0, 0.1, [rows, dim]).astype(np.float32)
                               for _, rows, dim, _ in TABLES])
        for layer in model.layers[len(TABLES) + 1:]:
            layer.set_weights([rng.normal(0, 0.3, w.shape).astype(np.float32)
                               for w in layer.get_weights()])
        return embedding

    def test_fit_equals_custom_loop_on_2x2(self):
        mesh = tfhybrid.init(model_parallel=2)
        features, labels = _data(mesh)
        local_x, local_y = _local(mesh, features, labels)
        loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)

        fitted = _model(mesh)
        embedding = self._init_weights(fitted)
        fitted.compile(optimizer=tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.3)),
                       loss=loss_fn)
        history = fitted.fit(local_x, local_y, batch_size=LOCAL_BATCH, epochs=2, shuffle=False,
                             verbose=tfhybrid.callbacks.verbose(),
                             callbacks=tfhybrid.callbacks.defaults())
        self.assertEqual(tfhybrid.callbacks.verbose(), 1 if mesh.rank == 0 else 0)

        looped = _model(mesh)
        loop_embedding = self._init_weights(looped)
        optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.3))

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, looped(x, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, looped.trainable_variables),
                                          looped.trainable_variables))

        for _ in range(2):
            for i in range(STEPS):
                sl = slice(i * LOCAL_BATCH, (i + 1) * LOCAL_BATCH)
                step({k: tf.constant(v[sl]) for k, v in local_x.items()},
                     tf.constant(local_y[sl]))
        for got, want in zip(embedding.get_weights(all_ranks=True),
                             loop_embedding.get_weights(all_ranks=True)):
            self.assertAllClose(got, want, atol=1e-5, rtol=1e-5)
        for got, want in zip(fitted.layers[-1].get_weights(), looped.layers[-1].get_weights()):
            self.assertAllClose(got, want, atol=1e-5, rtol=1e-5)
        # MetricAverage: every rank reports the same (global) loss
        losses = hvd.allgather_object(history.history["loss"])
        for other in losses:
            self.assertAllClose(other, losses[0])

    def test_evaluate_and_predict_match_single_process(self):
        mesh = tfhybrid.init(model_parallel=2, layout="data_major")
        features, labels = _data(mesh, seed=5)
        local_x, local_y = _local(mesh, features, labels)
        model = _model(mesh)
        embedding = self._init_weights(model, seed=2)
        loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)
        model.compile(optimizer=tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                      loss=loss_fn)
        logged = {}
        catch = tf.keras.callbacks.LambdaCallback(
            on_test_end=lambda logs: logged.update(logs))
        local_loss = model.evaluate(local_x, local_y, batch_size=LOCAL_BATCH, verbose=0,
                                    callbacks=[tfhybrid.callbacks.MetricAverage(), catch])
        local_pred = model.predict(local_x, batch_size=LOCAL_BATCH, verbose=0)

        # the single-process reference: plain Keras layers with the same weights
        full_tables = embedding.get_weights(all_ranks=True)
        ids = [tf.keras.Input([3], dtype=tf.int64, name=name) for name, *_ in TABLES]
        embedded = [Embedding(rows, dim, combiner=c, name=f"ref_{name}")(x)
                    for (name, rows, dim, c), x in zip(TABLES, ids)]
        hidden = tf.keras.layers.Dense(8, activation="relu")(
            tf.keras.layers.Concatenate(axis=1)(embedded))
        reference = tf.keras.Model(ids, tf.keras.layers.Dense(1)(hidden))
        for layer, table in zip(reference.layers[len(TABLES):2 * len(TABLES)], full_tables):
            layer.set_weights([table])
        reference.layers[-2].set_weights(model.layers[-2].get_weights())
        reference.layers[-1].set_weights(model.layers[-1].get_weights())
        want_pred = reference.predict(features, batch_size=64, verbose=0)
        want_loss = float(loss_fn(labels, want_pred))

        self.assertAllClose(local_pred, want_pred[mesh.rank::mesh.size], atol=1e-6, rtol=1e-6)
        # evaluate returns this rank's loss; with equal shards their average over the ranks
        # is the global loss, which MetricAverage puts in the logs every callback sees
        averaged = float(hvd.allreduce(tf.constant(local_loss), op=hvd.Average))
        self.assertAllClose(averaged, want_loss, atol=1e-6, rtol=1e-5)
        self.assertAllClose(logged["loss"], want_loss, atol=1e-6, rtol=1e-5)


class IdlePositionsTest(tf.test.TestCase):
    """A one-table model: only position 0 owns a shard, the other positions own none.

    Their traced step never uses the ids the forward alltoall brings them; the
    collective must still run there, or the owner waits for it forever.
    """

    ROWS, DIM, STEPS = 40, 4, 3

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _start(self, world):
        rng = np.random.default_rng(7)
        n = LOCAL_BATCH * world * self.STEPS
        return (rng.normal(0, 0.3, [self.ROWS, self.DIM]).astype(np.float32),
                rng.normal(0, 0.3, [self.DIM, 1]).astype(np.float32),
                rng.integers(0, self.ROWS, size=[n, 3]),
                rng.integers(0, 2, size=[n, 1]).astype(np.float32))

    def _reference(self, table, kernel, ids, labels, batch):
        embedding = Embedding(self.ROWS, self.DIM, combiner="sum")
        head = tf.keras.layers.Dense(1)
        head(embedding(tf.constant(ids[:1])))
        embedding.set_weights([table])
        head.set_weights([kernel, np.zeros([1], np.float32)])
        optimizer = tf.keras.optimizers.SGD(0.5)
        variables = embedding.trainable_variables + head.trainable_variables
        loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)
        for step in range(len(ids) // batch):
            part = slice(step * batch, (step + 1) * batch)
            with tf.GradientTape() as tape:
                loss = loss_fn(labels[part], head(embedding(tf.constant(ids[part]))))
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return [v.numpy() for v in variables]

    def test_fit_and_traced_loop_when_positions_own_no_shard(self):
        world = tfhybrid.init(model_parallel=1).size
        mesh_lib.reset()
        table, kernel, ids, labels = self._start(world)
        want = self._reference(table, kernel, ids, labels, LOCAL_BATCH * world)
        for model_parallel in (world, world // 2):
            for how in ("fit", "tf.function"):
                with self.subTest(model_parallel=model_parallel, how=how):
                    mesh = tfhybrid.init(model_parallel=model_parallel)
                    local_ids = ids[mesh.rank::mesh.size]
                    local_labels = labels[mesh.rank::mesh.size]
                    embedding = DistributedEmbedding(
                        [Embedding(self.ROWS, self.DIM, combiner="sum", name="only")],
                        mesh=mesh)
                    head = tf.keras.layers.Dense(1)
                    optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.5))
                    inputs = tf.keras.Input([3], dtype=tf.int64)
                    model = tf.keras.Model(inputs, head(embedding([inputs])[0]))
                    embedding.set_weights([table])
                    head.set_weights([kernel, np.zeros([1], np.float32)])
                    if how == "fit":
                        model.compile(optimizer=optimizer,
                                      loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
                        model.fit(local_ids, local_labels, batch_size=LOCAL_BATCH,
                                  shuffle=False, verbose=0)
                    else:
                        @tf.function
                        def step(x, y):
                            return click_train_step(embedding, head, optimizer, [x], y)

                        for i in range(self.STEPS):
                            part = slice(i * LOCAL_BATCH, (i + 1) * LOCAL_BATCH)
                            step(tf.constant(local_ids[part]), tf.constant(local_labels[part]))
                    got = embedding.get_weights(all_ranks=True) + head.get_weights()
                    for value, expected in zip(got, want):
                        self.assertAllClose(value, expected, atol=1e-5, rtol=1e-5)
                mesh_lib.reset()


class StepsTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_uneven_input_fails_on_every_rank_before_training(self):
        mesh = tfhybrid.init(model_parallel=2)
        model = _model(mesh)
        model.compile(optimizer=tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                      loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
        features, labels = _data(mesh)
        # the last rank has one batch fewer
        n = LOCAL_BATCH * (STEPS - (1 if mesh.rank == mesh.size - 1 else 0))
        x = {k: v[:n] for k, v in features.items()}
        counts = ", ".join(f"rank {r}: {STEPS - (1 if r == mesh.size - 1 else 0)}"
                           for r in range(mesh.size))
        with self.assertRaisesRegex(ValueError, rf"steps per epoch differ.*\({counts}\)"):
            model.fit(x, labels[:n], batch_size=LOCAL_BATCH, verbose=0,
                      callbacks=[tfhybrid.callbacks.ConsistentSteps()])


if __name__ == "__main__":
    tf.test.main()
