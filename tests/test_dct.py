"""DCT on the mesh: the route's thresholded gradient sync (DCT-DP) and the layer's
thresholded alltoall (DCT-MP).

- keep = 1, forced through both halves' thresholding code (unforced, DCT would not
  engage: nothing can be left out), trains like no DCT on every kind of placement, 1D and
  2D, to 1e-6 (the kept pairs are summed in another order than the dense allreduce);
- the applied updates sum to the raw gradients minus the residuals (1e-6);
- per sample, the returned rows are the full rows at the kept positions, and the
  tables' gradient is the full gradient masked by the same positions (column slices,
  combiners, 16-bit wire);
- at the default keep fractions the byte counters show >= 100x less data-parallel and
  >= 20x less alltoall traffic (positions included);
- under loss scaling a tape thresholds the unscaled gradient.
"""

from unittest import mock

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import collectives
from tfhybrid import compression
from tfhybrid import distributed
from tfhybrid import mesh as mesh_lib
from tfhybrid.compression import DCT
from tfhybrid.layers import DistributedEmbedding, Embedding
from tests import _hybrid_case as hc
from tests import test_distributed_embedding as de

KERAS_3 = tfhybrid.keras_major() == 3

# four ranks only: they cover 1x4 (the 1D route a 1x2 mesh takes) and 2x2
HOROVOD_NP = (4,)
KERAS = (2, 3)

LOCAL_BATCH = 4


def _meshes():
    """M for a 1D mesh, and 2 (a 2 x 2 mesh) on four ranks. Starts Horovod the way
    tfhybrid does (with process sets), then forgets the mesh."""
    world = tfhybrid.init(model_parallel=1).size
    mesh_lib.reset()
    # 1D, and 2 x 2 on four ranks
    return hc.meshes_for_this_keras([world] + ([2] if world == 4 else []))


class _Model(tf.keras.Model):
    """test_distributed_embedding's model (every kind of placement) with a DCT option."""

    def __init__(self, tables, mesh, dct=None, dtype=None, thresholds=None):
        # Keras 3 name scopes refuse the "__model" its class name would give
        super().__init__(name="dct_model")
        self.embedding = DistributedEmbedding(
            [Embedding(rows, dim, combiner=c, name=name) if c else
             tf.keras.layers.Embedding(rows, dim, name=name)
             for name, rows, dim, c in tables],
            mesh=mesh, input_table_map=[t for t, _ in de.FEATURES], dct=dct, dtype=dtype,
            **(de.THRESHOLDS if thresholds is None else thresholds))
        self.hidden = tf.keras.layers.Dense(8, activation="relu")
        self.head = tf.keras.layers.Dense(1)

    def call(self, inputs):
        outs = self.embedding(inputs)
        flat = tf.concat([tf.reshape(tf.cast(o, tf.float32), [tf.shape(o)[0], -1])
                          for o in outs], axis=1)
        return self.head(self.hidden(flat))


def _data(seed, world, steps):
    tables = de.make_tables(seed)
    rng = np.random.default_rng(seed + 1)
    batch = LOCAL_BATCH * world
    return tables, [(de.make_batch(rng, tables, batch),
                     rng.integers(0, 2, size=[batch, 1]).astype(np.float32))
                    for _ in range(steps)]


def _trained(mesh, dct, tables, batches, dtype=None):
    """The local variables before and after training ``batches`` from seeded weights."""
    lo, hi = mesh.rank * LOCAL_BATCH, (mesh.rank + 1) * LOCAL_BATCH
    tf.keras.utils.set_random_seed(11)
    full = [np.random.default_rng(i).normal(size=[rows, dim]).astype(np.float32) * 0.1
            for i, (_, rows, dim, _) in enumerate(tables)]
    model = _Model(tables, mesh, dct, dtype)
    model(de.to_tensors(batches[0][0], lo, hi))
    model.embedding.set_weights(full)
    before = [v.numpy() for v in model.trainable_variables]
    optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), mesh=mesh,
                                              dct=dct)

    @tf.function(reduce_retracing=True)
    def step(inputs, labels):
        with tf.GradientTape() as tape:
            loss = de.logistic_loss(labels, model(inputs))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for features, labels in batches:
        step(de.to_tensors(features, lo, hi), tf.constant(labels[lo:hi]))
    return before, [v.numpy() for v in model.trainable_variables]


class KeepOneTest(tf.test.TestCase):
    """At keep = 1.0 neither half of DCT engages by itself (nothing can be left out), so
    the test forces both onto their thresholding code: every entry then passes, and the
    run must train as without DCT."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_forced_thresholding_at_keep_one_trains_like_no_dct(self):
        calls = {"keep_largest": 0, "select": 0}
        keep_largest, select = compression.keep_largest, compression.GradientThresholder.select

        def counted_keep_largest(*args, **kwargs):
            calls["keep_largest"] += 1
            return keep_largest(*args, **kwargs)

        def counted_select(self, *args, **kwargs):
            calls["select"] += 1
            return select(self, *args, **kwargs)

        forced = [mock.patch.object(compression, "may_drop", lambda size, keep: True),
                  mock.patch.object(compression.GradientThresholder, "goes_sparse",
                                    lambda self, variable, group_size: True),
                  mock.patch.object(compression, "keep_largest", counted_keep_largest),
                  mock.patch.object(compression.GradientThresholder, "select",
                                    counted_select)]
        # one mesh in each Keras (2 x 2 under Keras 3, 1D under Keras 2), in float32
        # and fp16 (fp16 changes what travels, not where)
        for m in _meshes()[-1:]:
            for dtype in (None, "mixed_float16"):
                with self.subTest(model_parallel=m, dtype=dtype):
                    mesh = tfhybrid.init(model_parallel=m)
                    tables, batches = _data(100 + m, mesh.size, 4)
                    start, off = _trained(mesh, None, tables, batches, dtype)
                    before = dict(calls)
                    for patch in forced:
                        patch.start()
                    try:
                        _, on = _trained(mesh, DCT(dp_keep=1.0, mp_keep=1.0), tables,
                                         batches, dtype)
                    finally:
                        for patch in forced:
                            patch.stop()
                    # both halves' thresholding ran (traced into the step)
                    self.assertGreater(calls["keep_largest"], before["keep_largest"])
                    self.assertGreater(calls["select"], before["select"])
                    self.assertEqual(len(off), len(on))
                    for a, b in zip(off, on):
                        self.assertAllClose(a, b, atol=1e-6, rtol=1e-6)
                    # training moved the weights, so the equality is not trivial
                    self.assertGreater(max(np.abs(a - b).max() for a, b in zip(off, start)
                                           if a.size), 1e-3)
                    mesh_lib.reset()


class EveryPlacementTest(tf.test.TestCase):
    """Thresholding on for real (keep < 1) over every kind of placement, row-wise partial
    sums and a zero-hot feature (a route of width 0) included."""

    def tearDown(self):
        de.FEATURES = self._features
        mesh_lib.reset()
        super().tearDown()

    def test_trains_on_every_placement(self):
        self._features = de.FEATURES
        de.FEATURES = de.FEATURES + [(3, "multihot0")]
        for m in _meshes():
            with self.subTest(model_parallel=m):
                mesh = tfhybrid.init(model_parallel=m)
                tables, batches = _data(200 + m, mesh.size, 3)
                start, off = _trained(mesh, None, tables, batches)
                _, on = _trained(mesh, DCT(dp_keep=0.1, mp_keep=0.3), tables, batches)
                for a, b in zip(start, on):
                    self.assertTrue(np.all(np.isfinite(b)))
                moved = max(np.abs(a - b).max() for a, b in zip(start, on) if a.size)
                self.assertGreater(moved, 1e-3)
                # something was left out: the runs differ
                self.assertGreater(max(np.abs(a - b).max() for a, b in zip(off, on)
                                       if a.size), 1e-4)
                mesh_lib.reset()


class ResidualTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_updates_sum_to_raw_gradients_minus_residuals(self):
        mesh = tfhybrid.init(model_parallel=1)
        n = mesh.size
        dct = DCT(dp_keep=0.05, refresh_every=3)
        w = tf.Variable(tf.zeros([40, 25]), name="w")
        optimizer = tf.keras.optimizers.SGD(1.0)
        rng = np.random.default_rng(1234)   # the same draws on every rank
        raw = np.zeros([40, 25])
        applied = np.zeros([40, 25])
        for step in range(10):
            grads = rng.normal(size=[n, 40, 25]).astype(np.float32)
            raw += grads.astype(np.float64).mean(axis=0)
            mine = tf.constant(grads[mesh.rank])
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * mine)
            tape = tfhybrid.DistributedGradientTape(tape, optimizer=optimizer, dct=dct)
            [synced] = tape.gradient(loss, [w])
            self.assertIsInstance(synced, tf.Tensor)
            applied += synced.numpy()
            # the kept entries went as pairs: a small share of the whole
            self.assertLess(np.count_nonzero(synced.numpy()), 0.5 * 1000)
            optimizer.apply_gradients([(synced, w)])
        residual = distributed.route_of(optimizer).thresholder.residual(w)
        mean_residual = hvd.allreduce(tf.convert_to_tensor(residual), op=hvd.Average,
                                      name="test_dct_residual").numpy()
        self.assertAllClose(applied, raw - mean_residual, atol=1e-6, rtol=0)
        self.assertAllClose(-w.numpy(), applied, atol=1e-5, rtol=0)
        self.assertGreater(np.abs(mean_residual).max(), 0.1)


class MaskTest(tf.test.TestCase):
    """Per sample, what returns is the full rows at the kept positions, and the tables'
    gradient is the full gradient at the same positions."""

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _check(self, m, dtype, tol):
        mesh = tfhybrid.init(model_parallel=m)
        lo, hi = mesh.rank * LOCAL_BATCH, (mesh.rank + 1) * LOCAL_BATCH
        # no row slices: a row-sliced table's samples are partial sums of two owners
        thresholds = dict(data_parallel_threshold=400, column_slice_threshold=1000,
                          row_slice_threshold=10 ** 9)
        tables, batches = _data(300 + m, mesh.size, 1)
        inputs = de.to_tensors(batches[0][0], lo, hi)
        models = [_Model(tables, mesh, dct, dtype, thresholds)
                  for dct in (None, DCT(dp_keep=None, mp_keep=0.3))]
        full = [np.random.default_rng(i).normal(size=[rows, dim]).astype(np.float32)
                for i, (_, rows, dim, _) in enumerate(tables)]
        for model in models:
            model(inputs)
            model.embedding.set_weights(full)
        kinds = {p.kind for p in models[0].embedding.plan.tables}
        if m > 1:
            self.assertIn("column_wise", kinds)
            self.assertIn("table_wise", kinds)
        whole, kept = (model.embedding(inputs) for model in models)
        masks = []
        for f, (a, b) in enumerate(zip(whole, kept)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            sent = b != 0
            masks.append(sent.astype(np.float32))
            self.assertAllClose(b, np.where(sent, a, 0.0), atol=tol, rtol=tol,
                                msg=f"feature {f}")
        share = np.mean(np.concatenate([x.reshape(-1) for x in masks]))
        if m > 1:
            self.assertLess(share, 0.9)           # something was left out
        self.assertGreater(share, 0.2)

        upstream = [tf.constant(np.random.default_rng(50 + f).normal(size=x.shape),
                                tf.float32) for f, x in enumerate(masks)]
        grads = []
        for model, weights in ((models[0], masks), (models[1], None)):
            variables = model.embedding.trainable_variables
            with tf.GradientTape() as tape:
                outs = model.embedding(inputs)
                loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32) * u * (
                    1.0 if weights is None else weights[f]))
                    for f, (o, u) in enumerate(zip(outs, upstream))])
            grads.append([tf.convert_to_tensor(g).numpy()
                          for g in tape.gradient(loss, variables)])
        for a, b in zip(*grads):
            self.assertAllClose(a, b, atol=tol, rtol=tol)

    def test_backward_mask_equals_forward_mask(self):
        for m in _meshes():
            for dtype, tol in ((None, 1e-6), ("mixed_float16", 2e-3),
                               ("mixed_bfloat16", 2e-2)):
                with self.subTest(model_parallel=m, dtype=dtype):
                    self._check(m, dtype, tol)
                    mesh_lib.reset()


class BytesTest(tf.test.TestCase):

    def tearDown(self):
        collectives.stop_counting_traffic()
        mesh_lib.reset()
        super().tearDown()

    def _traffic(self, mesh, dct, steps=6):
        """Bytes per step this rank sent: (data-parallel gradients, the rows' alltoall)."""
        tables = [Embedding(500, 32, combiner="sum", name=f"t{i}") for i in range(4)]
        # data_parallel_threshold=1: every table sharded, none replicated
        layer = DistributedEmbedding(tables, mesh=mesh, dct=dct, data_parallel_threshold=1)
        hidden = tf.keras.layers.Dense(256, activation="relu")
        head = tf.keras.layers.Dense(1)
        optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), mesh=mesh,
                                                  dct=dct)
        rng = np.random.default_rng(mesh.rank)
        collectives.count_traffic()

        @tf.function(reduce_retracing=True)
        def step(ids, labels):
            with tf.GradientTape() as tape:
                flat = tf.concat(layer(ids), axis=1)
                loss = de.logistic_loss(labels, head(hidden(flat)))
            variables = (layer.trainable_variables + hidden.trainable_variables
                         + head.trainable_variables)
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables))

        for i in range(steps + 1):
            if i == 1:
                collectives.reset_traffic()   # the first step traces
            ids = [tf.constant(rng.integers(0, 500, size=[32, 2])) for _ in tables]
            step(ids, tf.constant(rng.integers(0, 2, size=[32, 1]).astype(np.float32)))
        counted = collectives.traffic_by_collective()
        # the dense layers' gradients (global set, "@0"); a 2D mesh's shard replicas keep
        # their sparse row sync, which DCT-DP leaves alone
        data_parallel = sum(v for k, v in counted.items() if "_sync_" in k and
                            k.endswith("@0"))
        rows = sum(v for k, v in counted.items() if "_rows" in k or "_positions" in k)
        collectives.stop_counting_traffic()
        return data_parallel / steps, rows / steps

    def test_default_keep_fractions_cut_the_bytes(self):
        for m in _meshes():
            with self.subTest(model_parallel=m):
                mesh = tfhybrid.init(model_parallel=m)
                dp_off, mp_off = self._traffic(mesh, None)
                dp_on, mp_on = self._traffic(mesh, DCT())
                self.assertGreater(dp_off, 0)
                self.assertGreater(mp_off, 0)
                self.assertGreaterEqual(dp_off / dp_on, 100.0,
                                        msg=f"data-parallel {dp_off} -> {dp_on} bytes/step")
                self.assertGreaterEqual(mp_off / mp_on, 20.0,
                                        msg=f"alltoall rows {mp_off} -> {mp_on} bytes/step")
                mesh_lib.reset()


def _scaled_loss(optimizer, loss):
    """Keras 2's LossScaleOptimizer scales with ``get_scaled_loss``, Keras 3's optimizers
    (a LossScaleOptimizer, or any with a ``loss_scale_factor``) with ``scale_loss``."""
    if KERAS_3:
        return optimizer.scale_loss(loss)
    return optimizer.get_scaled_loss(loss)


def _to_apply(optimizer, grads):
    """Keras 2's LossScaleOptimizer applies unscaled gradients; Keras 3's optimizers take
    the gradients of the scaled loss and unscale them in ``apply_gradients``."""
    if KERAS_3:
        return grads
    return optimizer.get_unscaled_gradients(grads)


class LossScaleTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def test_tape_thresholds_the_unscaled_gradient(self):
        mesh = tfhybrid.init(model_parallel=1)
        rng = np.random.default_rng(77)
        grads = rng.normal(size=[6, mesh.size, 300]).astype(np.float32)
        results = []
        for scaled in (False, True):
            w = tf.Variable(tf.zeros([300]), name=f"w{int(scaled)}")
            optimizer = tf.keras.optimizers.SGD(0.5)
            if scaled and KERAS_3:
                # Keras 3's fixed loss scale is the optimizer's own (its
                # LossScaleOptimizer is dynamic only)
                optimizer = tf.keras.optimizers.SGD(0.5, loss_scale_factor=1024.0)
            elif scaled:
                optimizer = tf.keras.mixed_precision.LossScaleOptimizer(
                    optimizer, dynamic=False, initial_scale=1024.0)
            for g in grads:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(w * g[mesh.rank])
                    if scaled:
                        loss = _scaled_loss(optimizer, loss)
                tape = tfhybrid.DistributedGradientTape(
                    tape, optimizer=optimizer, dct=DCT(dp_keep=0.05, refresh_every=4))
                synced = tape.gradient(loss, [w])
                if scaled:
                    synced = _to_apply(optimizer, synced)
                optimizer.apply_gradients(zip(synced, [w]))
            results.append(w.numpy())
        self.assertAllEqual(results[0], results[1])
        self.assertGreater(np.abs(results[0]).max(), 0)

    def test_an_overflow_on_one_rank_keeps_every_residual(self):
        mesh = tfhybrid.init(model_parallel=1)
        rng = np.random.default_rng(78)
        w = tf.Variable(tf.zeros([300]), name="w_overflow")
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(
            tf.keras.optimizers.SGD(0.5), dynamic=True, initial_scale=8.0)
        dct = DCT(dp_keep=0.05, refresh_every=4)
        residuals = []
        for step in range(2):
            grad = rng.normal(size=[mesh.size, 300]).astype(np.float32)[mesh.rank]
            if step == 1 and mesh.rank == 0:
                grad[7] = np.inf            # only rank 0 overflows
            with tf.GradientTape() as tape:
                loss = _scaled_loss(optimizer, tf.reduce_sum(w * grad))
            tape = tfhybrid.DistributedGradientTape(tape, optimizer=optimizer, dct=dct)
            synced = _to_apply(optimizer, tape.gradient(loss, [w]))
            optimizer.apply_gradients(zip(synced, [w]))
            residuals.append(distributed.route_of(optimizer).thresholder.residual(w).numpy())
        # the skipped step left every rank's residual (what waits to be sent) as it was
        self.assertGreater(np.abs(residuals[0]).max(), 0)
        self.assertAllEqual(residuals[1], residuals[0])
        scale = optimizer.dynamic_scale if KERAS_3 else optimizer.loss_scale
        self.assertEqual(float(scale), 4.0)   # the step was skipped


if __name__ == "__main__":
    tf.test.main()
