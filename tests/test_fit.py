"""model.fit / evaluate / predict on a hybrid-parallel model, against custom loops."""

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding

HOROVOD_NP = (4,)

LOCAL_BATCH = 8
STEPS = 6
TABLES = [("user", 300, 8, "sum"), ("item", 120, 6, "mean"), ("tiny", 20, 4, "sum")]


def _model(mesh):
    ids = [tf.keras.Input([3], dtype=tf.int64, name=name) for name, *_ in TABLES]
    embedded = DistributedEmbedding(
        [Embedding(rows, dim, combiner=c, name=name) for name, rows, dim, c in TABLES],
        mesh=mesh, data_parallel_threshold=100, row_slice_threshold=2000)(ids)
    hidden = tf.keras.layers.Dense(8, activation="relu")(tf.concat(embedded, axis=1))
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
        mesh_lib._reset_for_tests()
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
        hidden = tf.keras.layers.Dense(8, activation="relu")(tf.concat(embedded, axis=1))
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


class StepsTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib._reset_for_tests()
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
