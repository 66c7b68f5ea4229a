"""Every collective runs on every rank in every way of training, and edge input is exact.

Meshes where positions own no shard are the hard case: such a rank never reads what the
ids alltoall brings it, and a traced function that drops the collective hangs its owner.
Each way a user trains (eager, ``tf.function``, a ``call`` decorated with ``tf.function``
inside ``fit``, ``fit``, a custom loop with ``DistributedGradientTape``, ``evaluate``,
``predict``) must equal single-process training on the global batch.
"""

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding
from tests import _hybrid_case as hc

# four ranks only: they cover M=4 (the 1D route a 1x2 mesh takes) and 2x2
HOROVOD_NP = (4,)
KERAS = (2, 3)

LR = 0.5


class _Nested(tf.keras.Model):
    """A model whose ``call`` is a ``tf.function``: ``fit`` traces it as a nested function."""

    def __init__(self, inner):
        # named: Keras 3 derives "__nested" from the class, and refuses a leading "_"
        super().__init__(name="nested")
        self.inner = inner

    @tf.function
    def call(self, inputs):
        return self.inner(inputs)


def _train_reference(case):
    model = case.reference_model()
    optimizer = tf.keras.optimizers.SGD(LR)
    for step in range(case.steps):
        ids, labels = case.global_batch(step)
        with tf.GradientTape() as tape:
            loss = hc.loss_fn(labels, model(ids))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model


def _train(case, mesh, how):
    model, layer = case.distributed_model(mesh)
    optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(LR))
    if how in ("fit", "nested fit"):
        trained = _Nested(model) if how == "nested fit" else model
        trained.compile(optimizer=optimizer, loss=hc.loss_fn)
        ids, labels = case.local_data(mesh.rank)
        trained.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0)
        return model, layer
    plain = tf.keras.optimizers.SGD(LR)

    def step(ids, labels):
        with tf.GradientTape() as tape:
            loss = hc.loss_fn(labels, model(ids, training=True))
        if how == "tape":
            tape = tfhybrid.DistributedGradientTape(tape, optimizer=plain)
            grads = tape.gradient(loss, model.trainable_variables)
            plain.apply_gradients(zip(grads, model.trainable_variables))
        else:
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

    if how in ("tf.function", "tape"):
        step = tf.function(step)
    for s in range(case.steps):
        step(*case.local_batch_of(s, mesh.rank))
    return model, layer


class TracingPathsTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _assert_equal_to_reference(self, model, layer, reference, case, what):
        for got, want in zip(hc.table_weights(layer), hc.reference_tables(reference, case)):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6, msg=what)
        for got, want in zip(hc.dense_weights(model), hc.dense_weights(reference)):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6, msg=what)

    def test_every_way_of_training_runs_every_collective(self):
        world = hc.world_size()
        case = hc.Case(hc.IDLE_TABLES, local_batch=4, steps=3, world=world)
        reference = _train_reference(case)
        # every way on 2 x 2; on 1 x 4 (more positions without a shard) the two ways
        # users train, so each way meets idle positions and each mesh both user paths
        every_way = ("eager", "tf.function", "nested fit", "fit", "tape")
        for model_parallel in sorted({world, 2}):
            for how in every_way if model_parallel == 2 else ("fit", "tape"):
                with self.subTest(model_parallel=model_parallel, how=how):
                    mesh = tfhybrid.init(model_parallel=model_parallel)
                    model, layer = _train(case, mesh, how)
                    # the case this test is about: some positions own no shard
                    owners = {s.owner for t in layer.plan.tables if t.kind != "data_parallel"
                              for s in t.shards}
                    self.assertLess(len(owners), model_parallel)
                    self._assert_equal_to_reference(model, layer, reference, case,
                                                    f"M={model_parallel} {how}")
                mesh_lib.reset()

    def test_evaluate_and_predict_with_idle_positions(self):
        world = hc.world_size()
        case = hc.Case(hc.IDLE_TABLES, local_batch=4, steps=2, world=world, seed=3)
        reference = case.reference_model()
        for model_parallel in sorted({world, 2}):
            # plain and nested on 2 x 2; on 1 x 4 the nested model, which holds the plain
            for nested in (False, True) if model_parallel == 2 else (True,):
                with self.subTest(model_parallel=model_parallel, nested=nested):
                    mesh = tfhybrid.init(model_parallel=model_parallel)
                    model, _ = case.distributed_model(mesh)
                    served = _Nested(model) if nested else model
                    served.compile(optimizer=tfhybrid.DistributedOptimizer(
                        tf.keras.optimizers.SGD(LR)), loss=hc.loss_fn)
                    ids, labels = case.local_data(mesh.rank)
                    predicted = served.predict(ids, batch_size=case.local_batch, verbose=0)
                    loss = served.evaluate(ids, labels, batch_size=case.local_batch,
                                           verbose=0)
                    want = np.concatenate([
                        reference(case.global_batch(s)[0]).numpy()[mesh.rank::world]
                        for s in range(case.steps)])
                    self.assertAllClose(predicted, want, atol=1e-6, rtol=1e-6)
                    want_loss = float(hc.loss_fn(case.labels, reference(case.ids)))
                    averaged = float(hvd.allreduce(tf.constant(loss), op=hvd.Average,
                                                   name=f"loss_{model_parallel}_{nested}"))
                    self.assertAllClose(averaged, want_loss, atol=1e-6, rtol=1e-5)
                mesh_lib.reset()

    def test_keep_alive_reads_each_collective_in_a_traced_function(self):
        # Why the collective survives: a stateful op reads its output, so Grappler can
        # neither prune it nor turn it into a NoOp. Check that structure directly.
        world = hc.world_size()
        mesh = tfhybrid.init(model_parallel=world)
        layer = DistributedEmbedding([Embedding(64, 4, combiner="sum", name="only")],
                                     mesh=mesh)
        ids = tf.constant(np.arange(6).reshape([2, 3]))
        graph = tf.function(lambda x: layer([x])[0]).get_concrete_function(ids).graph
        collectives = [op for op in graph.get_operations() if op.type.startswith("Horovod")]
        self.assertNotEmpty(collectives)
        keepers = [op for op in graph.get_operations() if op.type == "Assert"
                   and op.name.split("/")[-1].startswith("tfhybrid_collective_issued")]
        read = set()
        for keeper in keepers:
            for tensor in keeper.inputs[1:]:
                frontier = [tensor.op]
                while frontier:   # walk back through reshape/slice to the collective
                    op = frontier.pop()
                    if op.type.startswith("Horovod"):
                        read.add(op.name)
                    elif op.type in ("Reshape", "StridedSlice", "Bitcast"):
                        frontier.append(op.inputs[0].op)
        self.assertEqual(read, {op.name for op in collectives})


class EmptyInputTest(tf.test.TestCase):
    """A rank whose bags of a feature are all empty, or a feature of zero hotness."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_a_rank_without_ids_trains_like_one_process(self):
        world = hc.world_size()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=3, steps=2, world=world, seed=5,
                       empty_rank=1)
        # rank 1 really has no id of the ragged feature
        bag = [t.name for t in case.tables].index("bag")
        self.assertEqual(int(tf.size(case.local_batch_of(0, 1)[0][bag].flat_values)), 0)
        reference = _train_reference(case)
        for model_parallel in [m for m in range(1, world + 1) if world % m == 0]:
            for how in ("eager", "fit"):
                with self.subTest(model_parallel=model_parallel, how=how):
                    mesh = tfhybrid.init(model_parallel=model_parallel)
                    model, layer = _train(case, mesh, how)
                    for got, want in zip(hc.table_weights(layer),
                                         hc.reference_tables(reference, case)):
                        self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
                    for got, want in zip(hc.dense_weights(model),
                                         hc.dense_weights(reference)):
                        self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
                mesh_lib.reset()

    def test_zero_hotness_gives_the_single_process_shapes_and_zeros(self):
        world = hc.world_size()
        for model_parallel in [m for m in range(1, world + 1) if world % m == 0]:
            with self.subTest(model_parallel=model_parallel):
                mesh = tfhybrid.init(model_parallel=model_parallel)
                layers = [Embedding(30, 3, combiner="sum", name="s"),
                          Embedding(20, 2, name="plain")]
                layer = DistributedEmbedding(layers, mesh=mesh)
                empty = tf.zeros([4, 0], tf.int64)
                got = layer([empty, empty])
                want = [Embedding(30, 3, combiner="sum")(empty), Embedding(20, 2)(empty)]
                for g, w in zip(got, want):
                    self.assertEqual(g.shape, w.shape)
                    self.assertAllEqual(g, tf.zeros_like(w))
            mesh_lib.reset()


class BuildOrderTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_weights_of_an_unbuilt_layer_raise_value_error(self):
        tfhybrid.init(model_parallel=2)
        layer = DistributedEmbedding([Embedding(30, 3, combiner="sum", name="t")])
        with self.assertRaisesRegex(ValueError, "set_weights needs the layer built"):
            layer.set_weights([np.zeros([30, 3], np.float32)])
        with self.assertRaisesRegex(ValueError, "get_weights needs the layer built"):
            layer.get_weights()

    def test_broadcast_callback_waits_until_fit_has_built_the_model(self):
        mesh = tfhybrid.init(model_parallel=1)
        # every rank starts from different dense weights; fit builds the model
        model = tf.keras.Sequential([
            tf.keras.layers.Dense(3, kernel_initializer=tf.keras.initializers.GlorotUniform(
                seed=mesh.rank)),
            tf.keras.layers.Dense(1)])
        model.compile(optimizer=tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
                      loss="mse")
        callback = tfhybrid.callbacks.BroadcastVariables()
        rng = np.random.default_rng(0)
        x = rng.normal(size=[8, 5]).astype(np.float32)
        model.fit(x[mesh.rank::mesh.size], np.ones([8 // mesh.size, 1], np.float32),
                  batch_size=2, verbose=0, callbacks=[callback])
        self.assertTrue(callback.broadcast_done)
        everyone = hvd.allgather_object([w for w in model.get_weights()])
        for other in everyone[1:]:
            for got, want in zip(other, everyone[0]):
                self.assertAllEqual(got, want)


if __name__ == "__main__":
    tf.test.main()
