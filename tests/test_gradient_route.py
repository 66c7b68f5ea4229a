"""One gradient route: the tape equals the optimizer, and both equal one process.

``DistributedGradientTape`` and ``DistributedOptimizer`` hand their gradients to the same
route (sync, overflow vote, clipping over the mesh, apply, weight sync), so a custom loop
with the tape and ``fit`` with the optimizer must end with the same weights, for every
optimizer and mode. And with the route's sync, every optimizer trains the hybrid model
exactly as one process trains the global batch. Below it, the routing itself: which
process set, which scale, sparse or dense, and the broadcast (``RoutingTest``, on every
mesh of 1, 2 and 4 ranks).
"""

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import distributed
from tfhybrid import roles
from tfhybrid import mesh as mesh_lib
from tfhybrid import optimizers
from tfhybrid.testing import graphs
from tests import _hybrid_case as hc

KERAS_3 = tfhybrid.keras_major() == 3

HOROVOD_NP = (1, 2, 4)
KERAS = (2, 3)
# the model-level tests: four ranks only; they cover 1x4, 2x2 and 4x1, every route a
# 2-rank mesh takes
MODEL_SIZES = (4,)

# fp16 runs skip this step together: one rank's sample weights are infinite there
OVERFLOW_STEP, OVERFLOW_RANK = 3, 1


def _configs():
    # plain SGD takes a subset of global_clipnorm's route (the clip aside), so it is
    # not run on its own
    return {
        "rowwise_adagrad": dict(make=lambda: optimizers.RowWiseAdagrad(0.1)),
        "ms_rowwise_adagrad_weight_sync": dict(
            make=lambda: optimizers.MomentumScaledRowWiseAdagrad(0.1),
            layer=dict(replica_sync="weights", sync_every=2)),
        "fp16_loss_scale_with_overflow": dict(
            make=lambda: tf.keras.optimizers.SGD(0.5), policy="mixed_float16"),
        "global_clipnorm": dict(make=lambda: tf.keras.optimizers.SGD(0.5,
                                                                     global_clipnorm=0.05)),
    }


def _sample_weights(case, rank, poisoned):
    weights = np.ones([case.local_batch * case.steps], np.float32)
    if poisoned and rank == OVERFLOW_RANK:
        weights[OVERFLOW_STEP * case.local_batch:(OVERFLOW_STEP + 1) * case.local_batch] = \
            np.inf
    return weights


def _fit(case, mesh, config):
    model, layer = case.distributed_model(mesh, **config.get("layer", {}))
    optimizer = tfhybrid.DistributedOptimizer(config["make"]())
    model.compile(optimizer=optimizer, loss=hc.loss_fn)
    ids, labels = case.local_data(mesh.rank)
    model.fit(ids, labels, sample_weight=_sample_weights(case, mesh.rank, "policy" in config),
              batch_size=case.local_batch, shuffle=False, verbose=0)
    return model, layer, optimizer


def _tape_loop(case, mesh, config):
    model, layer = case.distributed_model(mesh, **config.get("layer", {}))
    optimizer = config["make"]()
    if "policy" in config:
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    weights = _sample_weights(case, mesh.rank, "policy" in config)

    @tf.function
    def step(ids, labels, sample_weight):
        with tf.GradientTape() as tape:
            loss = hc.loss_fn(labels, model(ids, training=True), sample_weight)
            if "policy" in config:
                loss = (optimizer.scale_loss(loss) if KERAS_3
                        else optimizer.get_scaled_loss(loss))
        tape = tfhybrid.DistributedGradientTape(tape, optimizer=optimizer)
        grads = tape.gradient(loss, model.trainable_variables)
        if "policy" in config and not KERAS_3:
            # Keras 3's LossScaleOptimizer unscales in apply_gradients
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for s in range(case.steps):
        ids, labels = case.local_batch_of(s, mesh.rank)
        step(ids, labels, weights[s * case.local_batch:(s + 1) * case.local_batch])
    return model, layer, optimizer


def _loss_scale(optimizer):
    """A LossScaleOptimizer's current scale: Keras 2 calls it ``loss_scale``, Keras 3
    ``dynamic_scale``."""
    return tf.convert_to_tensor(optimizer.dynamic_scale if KERAS_3
                                else optimizer.loss_scale)


def _meshes(world):
    return hc.meshes_for_this_keras(
        [m for m in range(1, world + 1) if world % m == 0 and 1 < world])


class TapeEqualsOptimizerTest(tf.test.TestCase):
    HOROVOD_NP = MODEL_SIZES

    def tearDown(self):
        tf.keras.mixed_precision.set_global_policy("float32")
        mesh_lib.reset()
        super().tearDown()

    def test_fit_with_the_optimizer_equals_a_tape_loop(self):
        world = hc.world_size()
        model_parallel = 2   # 2x2 on four ranks, 1x2 on two
        # past the poisoned step, and four weight syncs at sync_every=2
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=8, world=world, seed=11)
        for name, config in _configs().items():
            with self.subTest(config=name):
                tf.keras.mixed_precision.set_global_policy(config.get("policy", "float32"))
                mesh = tfhybrid.init(model_parallel=model_parallel)
                fitted, fitted_layer, fit_optimizer = _fit(case, mesh, config)
                looped, looped_layer, loop_optimizer = _tape_loop(case, mesh, config)
                for got, want in zip(hc.table_weights(looped_layer),
                                     hc.table_weights(fitted_layer)):
                    self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
                for got, want in zip(hc.dense_weights(looped), hc.dense_weights(fitted)):
                    self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
                if "policy" in config:
                    # every rank skipped the poisoned step, so the scales agree everywhere
                    fit_scale, loop_scale = _loss_scale(fit_optimizer), _loss_scale(
                        loop_optimizer)
                    scales = tfhybrid.collectives.allgather(
                        tf.reshape(fit_scale, [1]), world, "scale_" + name)
                    self.assertAllEqual(scales, tf.fill([world], scales[0]))
                    self.assertAllEqual(fit_scale, loop_scale)
                    self.assertLess(float(fit_scale), 2.0 ** 15)
                mesh_lib.reset()
                tf.keras.mixed_precision.set_global_policy("float32")


def _train_reference(case, make_dense, make_tables=None, dense_gradients=False):
    """One process on the global batch; tables may take their own optimizer."""
    model = case.reference_model()
    dense_opt = make_dense()
    table_opt = make_tables() if make_tables else None
    table_vars = [model.get_layer(t.name).embeddings for t in case.tables]
    table_ids = {id(v) for v in table_vars}
    for step in range(case.steps):
        ids, labels = case.global_batch(step)
        with tf.GradientTape() as tape:
            loss = hc.loss_fn(labels, model(ids))
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        if dense_gradients:   # the gradient itself: duplicate ids summed before a norm
            grads = [tf.convert_to_tensor(g) for g in grads]
        if table_opt is None:
            dense_opt.apply_gradients(zip(grads, variables))
            continue
        pairs = list(zip(grads, variables))
        dense_opt.apply_gradients([p for p in pairs if id(p[1]) not in table_ids])
        table_opt.apply_gradients([p for p in pairs if id(p[1]) in table_ids])
    return model


# Row-wise AdaGrad keeps one accumulator per row of each shard; a column slice's mean of
# g^2 covers its own columns only, so column-sliced tables follow their own (documented)
# row-wise semantics, like TorchRec's column-wise shards. Row- and table-wise shards and
# replicated tables hold whole rows, and equal one process exactly.
_NO_COLUMN_SLICES = dict(column_slice_threshold=None)


class SingleProcessParityTest(tf.test.TestCase):
    HOROVOD_NP = MODEL_SIZES

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _check(self, case, mesh, reference, make, layer_kwargs=None, **optimizer_kwargs):
        model, layer = case.distributed_model(mesh, **(layer_kwargs or {}))
        model.compile(optimizer=tfhybrid.DistributedOptimizer(make(), **optimizer_kwargs),
                      loss=hc.loss_fn)
        ids, labels = case.local_data(mesh.rank)
        model.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0)
        for got, want in zip(hc.table_weights(layer), hc.reference_tables(reference, case)):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)
        for got, want in zip(hc.dense_weights(model), hc.dense_weights(reference)):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6)

    def test_rowwise_optimizers_equal_one_process(self):
        world = hc.world_size()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=10, world=world, seed=13)
        # row-wise AdaGrad on every mesh of this Keras' share; the momentum-scaled one
        # differs in its update only (tests/test_optimizers.py), so on one of them
        for name, make, meshes in (
                ("rowwise", lambda: optimizers.RowWiseAdagrad(0.1), _meshes(world)),
                ("ms_rowwise", lambda: optimizers.MomentumScaledRowWiseAdagrad(0.1),
                 _meshes(world)[1:2] or _meshes(world))):
            reference = _train_reference(case, make)
            for model_parallel in meshes:
                with self.subTest(optimizer=name, model_parallel=model_parallel):
                    self._check(case, tfhybrid.init(model_parallel=model_parallel),
                                reference, make, layer_kwargs=_NO_COLUMN_SLICES)
                mesh_lib.reset()

    def test_clipping_equals_one_process_clipping_of_the_global_gradient(self):
        world = hc.world_size()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=6, world=world, seed=17)
        meshes = _meshes(world)
        unclipped = _train_reference(case, lambda: tf.keras.optimizers.SGD(0.5))
        # the global norm spans every shard, so it runs on every mesh with shards (on
        # M = 1 every table is replicated and the norm is Keras' own); a per-variable
        # norm or value sees one shard's own gradient, so one mesh each suffices
        sharded = [m for m in meshes if m > 1] or meshes
        for name, kwargs, on in (("global_clipnorm", dict(global_clipnorm=0.05), sharded),
                                 ("clipnorm", dict(clipnorm=0.02), meshes[-1:]),
                                 ("clipvalue", dict(clipvalue=0.01), meshes[1:2] or meshes)):
            make = lambda: tf.keras.optimizers.SGD(0.5, **kwargs)  # noqa: E731
            reference = _train_reference(case, make, dense_gradients=True)
            # the limit really bites, or the test would prove nothing
            self.assertNotAllClose(hc.dense_weights(reference), hc.dense_weights(unclipped))
            for model_parallel in on:
                with self.subTest(clip=name, model_parallel=model_parallel):
                    self._check(case, tfhybrid.init(model_parallel=model_parallel),
                                reference, make)
                mesh_lib.reset()

    def test_separate_embedding_and_dense_optimizers(self):
        world = hc.world_size()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=6, world=world, seed=19)
        make_dense = lambda: tf.keras.optimizers.Adam(0.01)  # noqa: E731
        make_tables = lambda: optimizers.RowWiseAdagrad(0.1)  # noqa: E731
        reference = _train_reference(case, make_dense, make_tables)
        # which optimizer takes which variable is decided before the route, alike on
        # every mesh: one mesh
        for model_parallel in _meshes(world)[-1:]:
            with self.subTest(model_parallel=model_parallel):
                mesh = tfhybrid.init(model_parallel=model_parallel)
                self._check(case, mesh, reference, make_dense, layer_kwargs=_NO_COLUMN_SLICES,
                            embedding_optimizer=make_tables())
            mesh_lib.reset()

    def test_weight_sync_needs_the_optimizer_on_the_tape(self):
        mesh = tfhybrid.init(model_parallel=1)
        case = hc.Case(hc.IDLE_TABLES, local_batch=2, steps=1, world=mesh.size)
        model, _ = case.distributed_model(mesh, replica_sync="weights", sync_every=2)
        ids, labels = case.local_batch_of(0, mesh.rank)
        with tf.GradientTape() as tape:
            loss = hc.loss_fn(labels, model(ids))
        with self.assertRaisesRegex(ValueError, "optimizer=opt"):
            tfhybrid.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)



class TraceOnceTest(tf.test.TestCase):
    """The first step builds the optimizers' slots, and is traced once: a tf.function
    traces its first call again when that call made variables, so without care every
    ``fit`` and every traced custom step would trace its whole route twice."""
    HOROVOD_NP = (1, 2)

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _compiled(self, optimizer):
        mesh = tfhybrid.init(model_parallel=1)
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=3, world=mesh.size)
        model, _ = case.distributed_model(mesh)
        if optimizer is not None:
            model.compile(optimizer=optimizer, loss=hc.loss_fn)
        return case, mesh, model

    def test_fit_traces_its_step_once(self):
        case, mesh, model = self._compiled(tfhybrid.DistributedOptimizer(
            tf.keras.optimizers.Adam(0.01), embedding_optimizer=optimizers.RowWiseAdagrad(0.1)))
        ids, labels = case.local_data(mesh.rank)
        model.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0)
        self.assertEqual(graphs.trace_count(model.train_function), 1)
        self.assertNotEmpty(model.optimizer.variables)

    def test_a_custom_step_traces_once(self):
        # the tape with optimizer=: its sync makes DCT's residuals, the apply the slots
        case, mesh, model = self._compiled(None)
        optimizer = tfhybrid.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.1, momentum=0.9),
            dct=tfhybrid.compression.DCT(dp_keep=0.25, mp_keep=None))

        @tf.function
        def step(ids, labels):
            with tf.GradientTape() as tape:
                loss = hc.loss_fn(labels, model(ids, training=True))
            grads = tfhybrid.DistributedGradientTape(tape, optimizer=optimizer).gradient(
                loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        for s in range(case.steps):
            step(*case.local_batch_of(s, mesh.rank))
        self.assertEqual(graphs.trace_count(step), 1)
        residuals = [v for v in graphs.traced_variables(step) if "dct_residual" in v.name]
        # DCT-DP thresholds on two ranks (keep < 1/N), so the traced step made them
        self.assertEqual(bool(residuals), mesh.size > 1, residuals)

    def test_the_count_sees_a_plain_keras_optimizer_trace_twice(self):
        # what DistributedOptimizer spares: Keras builds the slots inside the first
        # step, and TF 2.15 and 2.21 trace that step again
        case, mesh, model = self._compiled(tf.keras.optimizers.Adam(0.01))
        ids, labels = case.local_data(mesh.rank)
        model.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0)
        self.assertEqual(graphs.trace_count(model.train_function), 2)


def _meshes_and_layouts():
    world = tfhybrid.init(model_parallel=1).size
    mesh_lib.reset()
    return mesh_lib.distinct_meshes(world)


class RoutingTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_scales_and_groups(self):
        for m, layout in _meshes_and_layouts():
            mesh = tfhybrid.init(model_parallel=m, layout=layout)
            n = mesh.size
            dense = tf.Variable(tf.zeros([3]))
            shard = tf.Variable(tf.zeros([3]))
            roles.mark_model_parallel(shard, mesh)
            value = float(mesh.rank + 1)
            got_dense, got_shard = distributed.allreduce_gradients(
                [tf.fill([3], value), tf.fill([3], value)], [dense, shard], mesh)
            # dense: the average over all N ranks; shard (whose gradient the layer already
            # scaled to its model group's mean): the average over its data group
            self.assertAllClose(got_dense, np.full(3, sum(range(1, n + 1)) / n))
            want_shard = sum(r + 1 for r in mesh.data_group_ranks) / mesh.data_parallel
            self.assertAllClose(got_shard, np.full(3, want_shard), msg=f"{m} {layout}")
            mesh_lib.reset()

    def test_sparse_stays_sparse_where_cheaper(self):
        mesh = tfhybrid.init(model_parallel=1)
        n = mesh.size
        big = tf.Variable(tf.zeros([1000, 8]))
        small = tf.Variable(tf.zeros([4, 8]))
        roles.mark_sparse_sync(big, True)
        roles.mark_sparse_sync(small, False)
        rows = tf.constant([mesh.rank % 4, 3], tf.int64)
        slices = tf.IndexedSlices(tf.ones([2, 8]), rows, tf.constant([1000, 8], tf.int64))
        small_slices = tf.IndexedSlices(tf.ones([2, 8]), rows, tf.constant([4, 8], tf.int64))
        got_big, got_small = distributed.allreduce_gradients(
            [slices, small_slices], [big, small], mesh)
        self.assertIsInstance(got_big, tf.IndexedSlices)
        if n > 1:  # with one rank nothing moves, so the gradient keeps its form
            self.assertNotIsInstance(got_small, tf.IndexedSlices)
        got_small = tf.convert_to_tensor(got_small)
        # both represent the same dense sum / N
        want = np.zeros([4, 8], np.float32)
        for r in range(n):
            want[r % 4] += 1.0 / n
            want[3] += 1.0 / n
        dense_big = tf.math.unsorted_segment_sum(got_big.values, got_big.indices, 1000)
        self.assertAllClose(dense_big[:4], want)
        self.assertAllClose(got_small, want)
        # an untagged variable falls back to the static shape rule, identically on all ranks
        plain = tf.Variable(tf.zeros([100000, 8]))
        got_plain, = distributed.allreduce_gradients(
            [tf.IndexedSlices(tf.ones([2, 8]), rows, tf.constant([100000, 8], tf.int64))],
            [plain], mesh)
        self.assertIsInstance(got_plain, tf.IndexedSlices)

    def test_tape_and_optimizer_route_the_same(self):
        mesh = tfhybrid.init(model_parallel=1)
        n = mesh.size
        w = tf.Variable([1.0, 2.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w) * float(mesh.rank + 1)
        tape = tfhybrid.DistributedGradientTape(tape)
        grad, = tape.gradient(loss, [w])
        mean_factor = sum(range(1, n + 1)) / n
        self.assertAllClose(grad, np.array([2.0, 4.0]) * mean_factor)
        opt = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
        opt.apply_gradients([(tf.constant([float(mesh.rank + 1)] * 2), w)])
        self.assertAllClose(w, np.array([1.0, 2.0]) - 0.1 * mean_factor)
        self.assertIsInstance(opt, tf.keras.optimizers.SGD)

    def test_broadcast_dense_from_root_and_shards_from_roots_replica(self):
        for m, layout in _meshes_and_layouts():
            mesh = tfhybrid.init(model_parallel=m, layout=layout)
            dense = tf.Variable([float(mesh.rank)] * 2)
            shard = tf.Variable([10.0 * mesh.rank] * 3)
            roles.mark_model_parallel(shard, mesh)
            root = mesh.size - 1
            tfhybrid.broadcast_variables([dense, shard], root_rank=root, mesh=mesh)
            self.assertAllEqual(dense, [float(root)] * 2)
            # a shard comes from its copy in root's replica (as DE's broadcast)
            root_replica = next(d for d, g in enumerate(mesh.model_groups) if root in g)
            source = mesh.model_groups[root_replica][mesh.model_position]
            self.assertAllEqual(shard, [10.0 * source] * 3)
            mesh_lib.reset()



if __name__ == "__main__":
    tf.test.main()
