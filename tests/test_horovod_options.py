"""Horovod's optimizer options on the mesh, with Horovod's meaning (issue 12, item 7).

``tfhybrid.DistributedOptimizer`` and ``tfhybrid.DistributedGradientTape`` take
``horovod.tensorflow(.keras)``'s keywords. Each synced gradient is checked against plain
Horovod collectives on the same values (dense variables: ``hvd.allreduce`` over all
ranks; shards: over their data group, with the layer's 1/M undone for ``hvd.Sum``), and
training with each option against one process on the global batch.
"""

import logging

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import distributed
from tfhybrid import roles
from tfhybrid import mesh as mesh_lib
from tests import _hybrid_case as hc

# four ranks hold groups of two both ways (2x2), and the 1D meshes of four;
# two ranks would only repeat them at a smaller size
HOROVOD_NP = (4,)

LR = 0.5


def _mesh():
    # 1 x 2 on two ranks, 2 x 2 on four
    return tfhybrid.init(model_parallel=2)


def _variables(mesh):
    """One variable of every kind the route tells apart."""
    dense = tf.Variable(tf.zeros([3, 2]), name="dense")
    shard = tf.Variable(tf.zeros([3, 2]), name="shard")
    roles.mark_model_parallel(shard, mesh)
    weight_sync = tf.Variable(tf.zeros([3, 2]), name="weight_sync_shard")
    roles.mark_model_parallel(weight_sync, mesh, sync_every=2)
    table = tf.Variable(tf.zeros([50, 2]), name="table")          # sparse sync planned
    roles.mark_sparse_sync(table, True)
    sparse_shard = tf.Variable(tf.zeros([50, 2]), name="sparse_shard")
    roles.mark_model_parallel(sparse_shard, mesh)
    roles.mark_sparse_sync(sparse_shard, True)
    return [dense, shard, weight_sync, table, sparse_shard]


def _gradients(mesh, values):
    """Rank-dependent gradients for ``_variables``: ``values(shape)`` makes each block."""
    rows = tf.constant([mesh.rank % 5, 7, 7], tf.int64)   # a duplicate row, too
    slices = lambda: tf.IndexedSlices(tf.constant(values([3, 2])), rows,  # noqa: E731
                                      tf.constant([50, 2], tf.int64))
    return [tf.constant(values([3, 2])) for _ in range(3)] + [slices(), slices()]


def _plain_horovod(grads, mesh, op, tag, compression=hvd.Compression.none):
    """What plain Horovod makes of each gradient: dense over all ranks, shards over their
    data group; a shard's Sum times M (the layer scaled its gradient by 1/M)."""
    n, m, d = mesh.size, mesh.model_parallel, mesh.data_parallel
    dense, shard, weight_sync, table, sparse_shard = grads

    def over_data_group(g, name):
        if d == 1:
            return tf.convert_to_tensor(g)
        return tf.convert_to_tensor(hvd.allreduce(g, op=op, name=f"{tag}_{name}",
                                                  process_set=mesh.data_process_set,
                                                  compression=compression))

    shard_factor = 1.0 if op == hvd.Average else float(m)
    return [
        hvd.allreduce(dense, op=op, name=f"{tag}_dense", compression=compression),
        over_data_group(shard, "shard") * shard_factor,
        weight_sync * (1.0 if op == hvd.Average else float(n)),
        tf.convert_to_tensor(hvd.allreduce(table, op=op, name=f"{tag}_table")),
        over_data_group(sparse_shard, "sparse_shard") * shard_factor,
    ]


def _dense(grads):
    return [tf.convert_to_tensor(g) for g in grads]


def _grid_values(rng):
    """Values fp16 rounds visibly (2**-12 off its grid) whose fp16 sums over 4 ranks and
    their halves and quarters are exact: multiples of 1/64 in +-[1, 2) plus 2**-12."""
    def make(shape):
        magnitude = 1.0 + rng.integers(1, 64, size=shape) / 64.0
        return (rng.choice([-1.0, 1.0], size=shape) * magnitude + 2.0 ** -12).astype(
            np.float32)
    return make


def _normal_values(rng):
    return lambda shape: rng.normal(size=shape).astype(np.float32)


class SyncOptionsTest(tf.test.TestCase):
    """Each option on one gradient of every kind, against plain Horovod."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_average_and_sum_equal_plain_horovod_for_every_kind_of_variable(self):
        mesh = _mesh()
        variables = _variables(mesh)
        grads = _gradients(mesh, _normal_values(np.random.default_rng(100 + mesh.rank)))
        results = {}
        for op, tag in ((hvd.Average, "average"), (hvd.Sum, "sum")):
            got = distributed.allreduce_gradients(grads, variables, mesh,
                                                  distributed.sync_options(op=op))
            # sparse gradients stay sparse where planned, as before
            self.assertIsInstance(got[3], tf.IndexedSlices)
            want = _plain_horovod(grads, mesh, op, tag)
            for g, w, v in zip(_dense(got), want, variables):
                self.assertAllClose(g, w, atol=1e-6, rtol=1e-6, msg=f"{tag} {v.name}")
            results[tag] = _dense(got)
        # Sum is the gradient of the sum of the N ranks' losses: N x Average, for dense
        # variables and shards alike
        for s, a, v in zip(results["sum"], results["average"], variables):
            self.assertAllClose(s, a * mesh.size, atol=1e-5, rtol=1e-6, msg=v.name)

    def test_fp16_compression_sends_16_bits_and_returns_float32(self):
        mesh = _mesh()
        variables = _variables(mesh)
        rng = np.random.default_rng(200 + mesh.rank)
        grads = _gradients(mesh, _grid_values(rng))
        fp16 = hvd.Compression.fp16
        for op, tag in ((hvd.Average, "fp16_average"), (hvd.Sum, "fp16_sum")):
            got = distributed.allreduce_gradients(
                grads, variables, mesh, distributed.sync_options(op=op, compression=fp16))
            plain = distributed.allreduce_gradients(grads, variables, mesh,
                                                    distributed.sync_options(op=op))
            for g in got:
                self.assertEqual(tf.convert_to_tensor(g).dtype, tf.float32)
            # the dense variable against plain Horovod with the same compression
            self.assertAllEqual(got[0], hvd.allreduce(grads[0], op=op, compression=fp16,
                                                      name=f"{tag}_plain"))
            # every gradient that crossed the wire equals the uncompressed route run on
            # its fp16-rounded values (these sums are exact in fp16)
            rounded = [tf.cast(tf.cast(g, tf.float16), tf.float32)
                       if not isinstance(g, tf.IndexedSlices) else tf.IndexedSlices(
                           tf.cast(tf.cast(g.values, tf.float16), tf.float32), g.indices,
                           g.dense_shape) for g in grads]
            want = distributed.allreduce_gradients(rounded, variables, mesh,
                                                   distributed.sync_options(op=op))
            crossed = [0, 3] + ([1, 4] if mesh.data_parallel > 1 else [])
            for i in crossed:
                self.assertAllEqual(_dense(got)[i], _dense(want)[i], msg=f"{tag} {i}")
                # and the rounding is visible: 2**-12 per rank, far above 1e-6
                self.assertNotAllClose(_dense(got)[i], _dense(plain)[i], atol=1e-5)
            # nothing crossed the wire for a weight-sync shard (or a group of one): as
            # Horovod on one rank, no compression
            for i in [2] + ([1, 4] if mesh.data_parallel == 1 else []):
                self.assertAllEqual(_dense(got)[i], _dense(plain)[i])

    def test_gradient_predivide_factor_splits_the_average(self):
        mesh = _mesh()
        variables = _variables(mesh)
        grads = _gradients(mesh, _grid_values(np.random.default_rng(300 + mesh.rank)))
        got = distributed.allreduce_gradients(
            grads, variables, mesh, distributed.sync_options(gradient_predivide_factor=2.0))
        want = _plain_horovod(grads, mesh, hvd.Average, "predivide")
        for g, w, v in zip(_dense(got), want, variables):
            self.assertAllClose(g, w, atol=1e-6, rtol=1e-6, msg=v.name)
        # Horovod's own predivide on the dense variable: the same numbers
        plain = hvd.allreduce(grads[0], op=hvd.Average, prescale_factor=0.5,
                              postscale_factor=2.0, name="predivide_plain")
        self.assertAllEqual(got[0], plain)

    def test_sparse_as_dense_densifies_before_the_sync(self):
        mesh = _mesh()
        variables = _variables(mesh)
        grads = _gradients(mesh, _normal_values(np.random.default_rng(400 + mesh.rank)))
        got = distributed.allreduce_gradients(grads, variables, mesh,
                                              distributed.sync_options(sparse_as_dense=True))
        for g in got:
            self.assertNotIsInstance(g, tf.IndexedSlices)
        want = _plain_horovod(grads, mesh, hvd.Average, "sparse_as_dense")
        for g, w, v in zip(got, want, variables):
            self.assertAllClose(g, w, atol=1e-6, rtol=1e-6, msg=v.name)
        # the tape too
        table = variables[3]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, [mesh.rank % 5, 7, 7]))
        tape = tfhybrid.DistributedGradientTape(tape, sparse_as_dense=True)
        grad, = tape.gradient(loss, [table])
        self.assertNotIsInstance(grad, tf.IndexedSlices)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, [mesh.rank % 5, 7, 7]))
        grad_sparse, = tfhybrid.DistributedGradientTape(tape).gradient(loss, [table])
        self.assertIsInstance(grad_sparse, tf.IndexedSlices)
        self.assertAllClose(grad, tf.convert_to_tensor(grad_sparse), atol=1e-6)

    def test_tape_sum_equals_plain_horovod_and_is_not_synced_twice(self):
        mesh = _mesh()
        n = mesh.size
        c = tf.constant([float(mesh.rank + 1), 2.0 * mesh.rank])
        w = tf.Variable([1.0, 2.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * c)
        tape = tfhybrid.DistributedGradientTape(tape, op=hvd.Sum)
        grad, = tape.gradient(loss, [w], use_generic_names=True)   # Horovod's keyword
        summed = hvd.allreduce(c, op=hvd.Sum, name="tape_sum_plain")
        self.assertAllClose(grad, summed, atol=1e-6)
        # a DistributedOptimizer applies the tape's gradient as it is...
        opt = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), op=hvd.Sum)
        opt.apply_gradients([(grad, w)])
        self.assertAllClose(w, np.array([1.0, 2.0]) - summed, atol=1e-6)
        # ...and syncs (here: sums) a gradient no tape synced
        opt.apply_gradients([(c, w)])
        self.assertAllClose(w, np.array([1.0, 2.0]) - 2 * summed, atol=1e-6)
        self.assertAllClose(summed, np.array([n * (n + 1) / 2, n * (n - 1)]))
        # a plain optimizer handed to the tape applies its gradients as they are, also
        # after they were transformed (a loss scale's unscaling makes new tensors)
        plain = tf.keras.optimizers.SGD(1.0)
        w.assign([1.0, 2.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * c) * 4.0
        tape = tfhybrid.DistributedGradientTape(tape, optimizer=plain, op=hvd.Sum)
        grad, = tape.gradient(loss, [w])
        plain.apply_gradients([(grad / 4.0, w)])
        self.assertAllClose(w, np.array([1.0, 2.0]) - summed, atol=1e-6)

    def test_backward_passes_per_step_steps_every_kth_call(self):
        mesh = _mesh()
        n, k = mesh.size, 3
        dense = tf.Variable([1.0, 2.0])
        shard = tf.Variable([3.0, 4.0])
        roles.mark_model_parallel(shard, mesh)
        opt = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(1.0),
                                            backward_passes_per_step=k,
                                            average_aggregated_gradients=True)
        passes = [tf.constant([float(mesh.rank + p), 1.0]) for p in range(2 * k)]
        for p, grad in enumerate(passes):
            opt.apply_gradients([(grad, dense), (grad * 2.0, shard)])
            self.assertEqual(int(opt.iterations), p + 1)   # every pass counts
            done = (p + 1) // k
            # the average over the k passes, then over the ranks (shards: data group)
            want_dense = np.array([1.0, 2.0])
            want_shard = np.array([3.0, 4.0])
            for step in range(done):
                window = np.mean([g.numpy() for g in passes[step * k:(step + 1) * k]], 0)
                mean_rank = np.mean([r + np.mean(range(step * k, (step + 1) * k))
                                     for r in range(n)])
                data_rank = np.mean([r + np.mean(range(step * k, (step + 1) * k))
                                     for r in mesh.data_group_ranks])
                want_dense -= np.array([mean_rank, window[1]])
                want_shard -= 2.0 * np.array([data_rank, window[1]])
            self.assertAllClose(dense, want_dense, atol=1e-6, msg=f"pass {p}")
            self.assertAllClose(shard, want_shard, atol=1e-6, msg=f"pass {p}")

    def test_horovods_keywords_are_accepted_or_refused_by_value(self):
        mesh = _mesh()
        distributed.forget_logged_notes()
        with self.assertLogs("tfhybrid", logging.INFO) as logs:
            opt = tfhybrid.DistributedOptimizer(
                tf.keras.optimizers.SGD(0.1), name="DistributedSGD", device_dense="/cpu:0",
                device_sparse="/cpu:0", compression=hvd.Compression.fp16,
                sparse_as_dense=True, gradient_predivide_factor=2.0, op=hvd.Average,
                backward_passes_per_step=1, average_aggregated_gradients=False,
                num_groups=2, groups=None, process_set=hvd.global_process_set,
                scale_local_gradients=True, use_locking=False)
        self.assertEqual(len([r for r in logs.output if "num_groups" in r]), 1)
        self.assertIsInstance(opt, tf.keras.optimizers.SGD)
        w = tf.Variable([1.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * 2.0)
        tape = tfhybrid.DistributedGradientTape(
            tape, device_dense="", device_sparse="", compression=hvd.Compression.none,
            sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
            num_groups=0, groups=[[w]], process_set=hvd.global_process_set,
            scale_local_gradients=True)
        grad, = tape.gradient(loss, [w])
        self.assertAllClose(grad, [2.0])
        refused = [
            (dict(op=hvd.Adasum), "op=hvd.Adasum"),
            (dict(op=hvd.Max), "op=hvd.Max"),
            (dict(compression="fp16"), "compression='fp16'"),
            (dict(process_set=mesh.data_process_set), "process_set="),
            (dict(op=hvd.Sum, gradient_predivide_factor=2.0), "gradient_predivide_factor=2.0"),
            (dict(scale_local_gradients=False), "scale_local_gradients=False"),
            (dict(groups=-1), "groups=-1"),
        ]
        for kwargs, message in refused:
            with self.subTest(**{k: repr(v) for k, v in kwargs.items()}):
                with self.assertRaisesRegex(ValueError, message.replace("(", r"\(")):
                    tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), **kwargs)
                with self.assertRaisesRegex(ValueError, message.replace("(", r"\(")):
                    tfhybrid.DistributedGradientTape(tf.GradientTape(), **kwargs)
        with self.assertRaisesRegex(ValueError, "backward_passes_per_step=0"):
            tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                          backward_passes_per_step=0)
        # Horovod's Keras optimizer takes name as its second argument; ours takes the mesh
        with self.assertRaisesRegex(ValueError, "mesh='DistributedSGD'.*by keyword"):
            tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), "DistributedSGD")


# ------------------------------------------------------------------ training
def _reference(case, lr, passes=1, average=False):
    """One process on the global batch; with ``passes`` > 1 the gradients of ``passes``
    batches are summed (or averaged) at the same weights, then applied."""
    model = case.reference_model()
    opt = tf.keras.optimizers.SGD(lr)
    variables = model.trainable_variables
    summed = None
    for step in range(case.steps):
        ids, labels = case.global_batch(step)
        with tf.GradientTape() as tape:
            loss = hc.loss_fn(labels, model(ids))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
        summed = grads if summed is None else [a + g for a, g in zip(summed, grads)]
        if (step + 1) % passes == 0:
            if average:
                summed = [g / passes for g in summed]
            opt.apply_gradients(zip(summed, variables))
            summed = None
    return model


def _fit(case, mesh, layer_kwargs=None, **optimizer_kwargs):
    model, layer = case.distributed_model(mesh, **(layer_kwargs or {}))
    optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(LR), **optimizer_kwargs)
    model.compile(optimizer=optimizer, loss=hc.loss_fn)
    ids, labels = case.local_data(mesh.rank)
    model.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0)
    return model, layer, optimizer


class TrainingWithOptionsTest(tf.test.TestCase):
    """The hybrid model (every placement) trained with each option equals one process."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _assert_equal_models(self, model, layer, reference, case, msg):
        for got, want in zip(hc.table_weights(layer), hc.reference_tables(reference, case)):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6, msg=msg)
        for got, want in zip(hc.dense_weights(model), hc.dense_weights(reference)):
            self.assertAllClose(got, want, atol=1e-6, rtol=1e-6, msg=msg)

    def test_sum_sparse_as_dense_and_predivide_train_like_one_process(self):
        mesh = _mesh()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=3, world=mesh.size, seed=23)
        # op=Sum steps on N x the mean gradient: one process with N x the learning rate
        summed = _reference(case, LR * mesh.size)
        averaged = _reference(case, LR)
        self.assertNotAllClose(hc.dense_weights(summed), hc.dense_weights(averaged))
        runs = {
            "fit_sum": (lambda: _fit(case, mesh, op=hvd.Sum), summed),
            "weight_sync_sum": (lambda: _fit(case, mesh, dict(replica_sync="weights",
                                                             sync_every=1), op=hvd.Sum),
                                summed),
            "fit_sparse_as_dense_predivide": (
                lambda: _fit(case, mesh, sparse_as_dense=True, gradient_predivide_factor=2.0),
                averaged),
        }
        for name, (train, reference) in runs.items():
            with self.subTest(run=name):
                model, layer, _ = train()
                self._assert_equal_models(model, layer, reference, case, name)

    def test_backward_passes_per_step_accumulates_like_horovod(self):
        mesh = _mesh()
        # five passes with k = 2: two steps on the sums of two passes' gradients (Horovod's
        # default, average_aggregated_gradients=False), and the fifth pass stays local
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=5, world=mesh.size, seed=29)
        reference = _reference(case, LR, passes=2)
        model, layer, optimizer = _fit(case, mesh, backward_passes_per_step=2)
        self._assert_equal_models(model, layer, reference, case, "k=2")
        # as Horovod's helper: iterations counts every pass
        self.assertEqual(int(optimizer.iterations), case.steps)


if __name__ == "__main__":
    tf.test.main()
