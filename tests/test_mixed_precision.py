"""16-bit activations on the wire: fp16 and bf16 rows cross the alltoall in 16 bits."""

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import tfhybrid
from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, Embedding
from tests import _hybrid_case as hc

KERAS_3 = tfhybrid.keras_major() == 3

# four ranks only: they cover 1x4 (the 1D route a 1x2 mesh takes) and 2x2
HOROVOD_NP = (4,)
KERAS = (2, 3)


def _loss_scale(optimizer):
    """The factor a LossScaleOptimizer scales losses by now: Keras 2 calls it
    ``loss_scale``; Keras 3 ``dynamic_scale``, a variable its build makes (before it, the
    scale is ``initial_scale``)."""
    if not KERAS_3:
        return float(optimizer.loss_scale)
    return float(optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale)


def _as_applied(optimizer, grads):
    """Unscaled gradients as a LossScaleOptimizer's ``apply_gradients`` takes them: Keras 2
    takes them unscaled; Keras 3 takes the gradients of the scaled loss and unscales them
    itself."""
    if not KERAS_3:
        return grads
    return grads * _loss_scale(optimizer)


def _world():
    world = tfhybrid.init(model_parallel=1).size
    mesh_lib.reset()
    return world


class MixedPrecisionTest(tf.test.TestCase):

    def tearDown(self):
        tf.keras.mixed_precision.set_global_policy("float32")
        collectives.stop_counting_traffic()
        mesh_lib.reset()
        super().tearDown()

    def test_bfloat16_crosses_bit_exactly(self):
        mesh = tfhybrid.init(model_parallel=_world())
        rng = np.random.default_rng(mesh.rank)
        bits = rng.integers(-2**15, 2**15, size=[4 * mesh.size], dtype=np.int16)
        values = tf.bitcast(tf.constant(bits), tf.bfloat16)
        splits = tf.constant([4] * mesh.size, tf.int32)
        received, _ = collectives.alltoall(values, splits, mesh.model_process_set, mesh.size,
                                           "test_bf16")
        everyone = hvd.allgather_object(bits)
        want = np.concatenate([everyone[src][4 * mesh.rank:4 * mesh.rank + 4]
                               for src in range(mesh.size)])
        self.assertEqual(received.dtype, tf.bfloat16)
        np.testing.assert_array_equal(tf.bitcast(received, tf.int16).numpy(), want)

    def _step_bytes_and_outputs(self, policy):
        tf.keras.mixed_precision.set_global_policy(policy)
        mesh = tfhybrid.init(model_parallel=_world())
        layer = DistributedEmbedding(
            [Embedding(300, 16, combiner="sum", name="a"),
             Embedding(200, 8, combiner="mean", name="b")], mesh=mesh)
        ids = [tf.constant(np.random.default_rng(mesh.rank).integers(0, 200, size=[8, 3]))] * 2
        layer(ids)
        rng = np.random.default_rng(0)
        layer.set_weights([rng.standard_normal([300, 16]).astype(np.float32),
                           rng.standard_normal([200, 8]).astype(np.float32)])
        traffic = collectives.count_traffic()
        for v in traffic.values():
            v.assign(0)
        with tf.GradientTape() as tape:
            outputs = layer(ids)
            loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in outputs])
        grads = tape.gradient(loss, layer.trainable_variables)
        row_bytes = int(traffic["alltoall"].numpy())
        collectives.stop_counting_traffic()
        mesh_lib.reset()
        return layer, outputs, grads, row_bytes

    def test_tables_stay_float32_and_rows_travel_in_16_bits(self):
        _, ref_out, ref_grads, fp32_bytes = self._step_bytes_and_outputs("float32")
        for policy, dtype in (("mixed_float16", tf.float16), ("mixed_bfloat16", tf.bfloat16)):
            layer, outputs, grads, bytes_16 = self._step_bytes_and_outputs(policy)
            self.assertTrue(all(v.dtype == tf.float32 for v in layer.weights))
            self.assertTrue(all(o.dtype == dtype for o in outputs))
            for got, want in zip(outputs, ref_out):
                self.assertAllClose(tf.cast(got, tf.float32), want, atol=0.1, rtol=2e-2)
            for got, want in zip(grads, ref_grads):
                self.assertAllClose(tf.convert_to_tensor(got), tf.convert_to_tensor(want),
                                    atol=1e-2, rtol=1e-2)
            # ids are the same int32s; the rows and their gradients take half the bytes
            ids_bytes = self._id_bytes(layer)
            self.assertEqual(bytes_16 - ids_bytes, (fp32_bytes - ids_bytes) // 2, policy)

    def test_loss_scale_skips_together(self):
        tf.keras.mixed_precision.set_global_policy("mixed_float16")
        mesh = tfhybrid.init(model_parallel=1)
        optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), mesh=mesh)
        self.assertIsInstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
        w = tf.Variable([1.0, 2.0])
        start_scale = _loss_scale(optimizer)
        # only the last rank overflows; every rank must skip and lower its scale
        bad = float("inf") if mesh.rank == mesh.size - 1 else 1.0
        optimizer.apply_gradients([(_as_applied(optimizer, tf.constant([bad, 1.0])), w)])
        self.assertAllEqual(w, [1.0, 2.0])
        scales = hvd.allgather_object(_loss_scale(optimizer))
        self.assertEqual(scales, [start_scale / 2] * mesh.size)
        optimizer.apply_gradients([(_as_applied(optimizer, tf.constant([1.0, 1.0])), w)])
        self.assertAllClose(w, [0.9, 1.9])

    def test_fit_loss_in_16_bits_stays_close_to_float32(self):
        world = _world()
        losses = {}
        for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
            tf.keras.mixed_precision.set_global_policy(policy)
            mesh = tfhybrid.init(model_parallel=max(1, world // 2))
            ids = [tf.keras.Input([3], dtype=tf.int64, name=n) for n in ("a", "b")]
            embedded = DistributedEmbedding(
                [Embedding(24, 8, combiner="sum", name="a"),
                 Embedding(100, 8, combiner="mean", name="b")], mesh=mesh)(ids)
            hidden = tf.keras.layers.Dense(16, activation="relu")(
                tf.keras.layers.Concatenate(axis=1)(embedded))
            logits = tf.keras.layers.Dense(1)(hidden)
            logits = tf.keras.layers.Activation("linear", dtype="float32")(logits)
            model = tf.keras.Model(ids, logits)
            init = np.random.default_rng(3)
            model.set_weights([init.normal(0, 0.2, w.shape).astype(np.float32)
                               if w.size else w for w in model.get_weights()])
            rng = np.random.default_rng(mesh.rank)
            x = {"a": rng.integers(0, 24, size=[160, 3]), "b": rng.integers(0, 100, size=[160, 3])}
            # a planted signal the model can learn in 20 steps: small ids of "a" click
            y = (x["a"].sum(axis=1, keepdims=True) < 36).astype(np.float32)
            model.compile(optimizer=tfhybrid.DistributedOptimizer(
                tf.keras.optimizers.SGD(0.5), mesh=mesh),
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 20 steps
            loss = model.evaluate(x, y, batch_size=32, verbose=0)
            losses[policy] = float(hvd.allreduce(tf.constant(loss), op=hvd.Average))
            mesh_lib.reset()
        print("loss after 20 steps:", losses)
        self.assertLess(losses["float32"], 0.68)  # it learned something: ln 2 = 0.693
        self.assertAllClose(losses["mixed_float16"], losses["float32"], atol=1e-2)
        self.assertAllClose(losses["mixed_bfloat16"], losses["float32"], atol=1e-2)

    def test_fit_with_idle_positions_skips_overflow_everywhere_and_tracks_float32(self):
        # One table lives on position 0, so every other position owns no shard: their
        # traced train step ignores the ids the forward alltoall brings them, and this
        # fit used to hang there. The last rank's first batch overflows float16 (sample
        # weight 1e4 at loss scale 2**15), so every rank must skip step 1 and halve its
        # scale; steps 2..STEPS must then match float32 training on the global batches.
        world = _world()
        steps, local_batch, rows, dim = 4, 8, 40, 4
        rng = np.random.default_rng(11)
        table = rng.normal(0, 0.3, [rows, dim]).astype(np.float32)
        kernel = rng.normal(0, 0.3, [dim, 1]).astype(np.float32)
        bias = np.zeros([1], np.float32)
        ids = rng.integers(0, rows, size=[steps * local_batch * world, 3])
        labels = rng.integers(0, 2, size=[steps * local_batch * world, 1]).astype(np.float32)

        def make_inner():
            # initial_accumulator_value > 0 keeps each update a smooth function of its
            # gradient, so float16 rounding moves the weights by a bounded amount
            return tfhybrid.optimizers.RowWiseAdagrad(0.1, initial_accumulator_value=0.1)

        want = self._float32_reference(make_inner(), table, kernel, bias, ids, labels,
                                       first_step=1, batch=local_batch * world)
        for model_parallel in sorted({world, world // 2} - {1}, reverse=True):
            with self.subTest(model_parallel=model_parallel):
                tf.keras.mixed_precision.set_global_policy("mixed_float16")
                mesh = tfhybrid.init(model_parallel=model_parallel)
                x = {"ids": ids[mesh.rank::mesh.size]}
                y = labels[mesh.rank::mesh.size]
                weight = np.ones([len(y)], np.float32)
                if mesh.rank == mesh.size - 1:
                    weight[:local_batch] = 1e4
                model = self._one_table_model(mesh, rows, dim)
                model.layers[1].set_weights([table])
                model.layers[2].set_weights([kernel, bias])
                optimizer = tfhybrid.DistributedOptimizer(
                    tf.keras.mixed_precision.LossScaleOptimizer(make_inner(),
                                                                initial_scale=2**15),
                    mesh=mesh)
                model.compile(optimizer=optimizer,
                              loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
                trace = []  # (loss, loss scale, iterations) after each batch

                def after_batch(batch, logs, trace=trace, optimizer=optimizer):
                    trace.append((float(logs["loss"]), _loss_scale(optimizer),
                                  int(optimizer.iterations)))

                record = tf.keras.callbacks.LambdaCallback(on_train_batch_end=after_batch)
                model.fit(x, y, sample_weight=weight, batch_size=local_batch, epochs=1,
                          shuffle=False, verbose=0, callbacks=[record])

                self.assertLen(trace, steps)
                self.assertTrue(all(np.isfinite(loss) for loss, _, _ in trace), trace)
                # one skip, on every rank: the scale halves once and never grows back
                self.assertEqual([s for _, s, _ in trace], [2.0**14] * steps)
                # Keras 2's LossScaleOptimizer counts a skipped step in iterations,
                # Keras 3's counts the applied ones
                first = 0 if KERAS_3 else 1
                self.assertEqual([i for _, _, i in trace], list(range(first, steps + first)))
                full_table, = model.layers[1].get_weights(all_ranks=True)
                dense = model.layers[2].get_weights()
                everyone = hvd.allgather_object((full_table, dense, trace))
                for other_table, other_dense, other_trace in everyone:
                    # ranks hold the same weights bit for bit, not merely close ones
                    np.testing.assert_array_equal(other_table, full_table)
                    for got, mine in zip(other_dense, dense):
                        np.testing.assert_array_equal(got, mine)
                    self.assertEqual([s for _, s, _ in other_trace],
                                     [s for _, s, _ in trace])
                # Gradients here stay below 0.1, and float16 keeps them to ~2**-11 relative
                # per rounding, a few roundings deep. With accumulators >= 0.1 an update
                # errs by at most lr / sqrt(0.1) = 0.32 times its gradient's error: about
                # 1e-4 over the 3 applied steps (measured: 3e-5). The weights move 5e-3
                # (table) to 5e-2 (head) in those steps, and the 1e4-weighted step, applied
                # anywhere, would move them ~0.1 or make them NaN.
                for got, ref in zip([full_table] + dense, want):
                    self.assertAllClose(got, ref, atol=3e-4, rtol=0)
            mesh_lib.reset()

    def test_16_bit_training_equals_one_process_in_the_same_precision(self):
        # The reference is the same network in one process under the same policy, so
        # both round to the same 16-bit type; they differ only in where they round. The
        # reference rounds each looked-up row to 16 bits before it sums a bag, tfhybrid
        # sums a bag in float32 and rounds once before the alltoall (which carries the
        # 16-bit values exactly: test_bfloat16_crosses_bit_exactly). Both then run the
        # same dense ops. So a forward value errs by a few roundings of its type: bf16
        # keeps 8 significand bits (2**-9 relative), fp16 11 (2**-12). Gradients here
        # stay below 0.2 and lr is 0.5, so 6 steps of at most ~4 such roundings move a
        # weight by at most 6 * 0.5 * 0.2 * 4 * 2**-9 = 4.7e-3 (bf16), 5.9e-4 (fp16).
        world = _world()
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=6, world=world, seed=23)
        bounds = {"mixed_bfloat16": 4.7e-3, "mixed_float16": 5.9e-4}
        # each precision on 2 x 2 (both halves of the route) and one 1D mesh: bf16
        # where the rows stay on their rank (M = 1), fp16 where they all travel (M = N)
        # (each Keras its share: hc.meshes_for_this_keras)
        meshes = {"mixed_bfloat16": hc.meshes_for_this_keras(sorted({1, 2})),
                  "mixed_float16": hc.meshes_for_this_keras(sorted({2, world}))}
        for policy, bound in bounds.items():
            tf.keras.mixed_precision.set_global_policy(policy)
            reference = case.reference_model()
            optimizer = tf.keras.optimizers.SGD(0.5)
            if policy == "mixed_float16":
                optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
            for step in range(case.steps):
                ids, labels = case.global_batch(step)
                with tf.GradientTape() as tape:
                    loss = hc.loss_fn(labels, reference(ids))
                    if policy == "mixed_float16":
                        loss = (optimizer.scale_loss(loss) if KERAS_3
                                else optimizer.get_scaled_loss(loss))
                grads = tape.gradient(loss, reference.trainable_variables)
                if policy == "mixed_float16" and not KERAS_3:
                    # Keras 3's LossScaleOptimizer unscales in apply_gradients
                    grads = optimizer.get_unscaled_gradients(grads)
                optimizer.apply_gradients(zip(grads, reference.trainable_variables))
            for model_parallel in meshes[policy]:
                with self.subTest(policy=policy, model_parallel=model_parallel):
                    mesh = tfhybrid.init(model_parallel=model_parallel)
                    model, layer = case.distributed_model(mesh)
                    model.compile(optimizer=tfhybrid.DistributedOptimizer(
                        tf.keras.optimizers.SGD(0.5)), loss=hc.loss_fn)
                    ids, labels = case.local_data(mesh.rank)
                    model.fit(ids, labels, batch_size=case.local_batch, shuffle=False,
                              verbose=0)
                    got = hc.table_weights(layer) + hc.dense_weights(model)
                    want = hc.reference_tables(reference, case) + hc.dense_weights(reference)
                    worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
                    print(f"{policy} M={model_parallel}: largest weight difference {worst:.2e}")
                    for g, w in zip(got, want):
                        self.assertAllClose(g, w, atol=bound, rtol=0)
                mesh_lib.reset()

    @staticmethod
    def _one_table_model(mesh, rows, dim):
        ids = tf.keras.Input([3], dtype=tf.int64, name="ids")
        embedded, = DistributedEmbedding(
            [Embedding(rows, dim, combiner="sum", name="only")], mesh=mesh)([ids])
        logits = tf.keras.layers.Dense(1)(embedded)
        # the loss in float32, as Keras recommends under mixed_float16
        logits = tf.keras.layers.Activation("linear", dtype="float32")(logits)
        return tf.keras.Model(ids, logits)

    @staticmethod
    def _float32_reference(optimizer, table, kernel, bias, ids, labels, first_step, batch):
        """Single-process float32 training on global batches first_step.. (0-based)."""
        tf.keras.mixed_precision.set_global_policy("float32")
        embedding = Embedding(*table.shape, combiner="sum", name="reference_table")
        head = tf.keras.layers.Dense(1, name="reference_head")
        embedding(tf.constant(ids[:1]))
        head(tf.zeros([1, table.shape[1]]))
        embedding.set_weights([table])
        head.set_weights([kernel, bias])
        variables = embedding.trainable_variables + head.trainable_variables
        loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)
        for step in range(first_step, len(ids) // batch):
            part = slice(step * batch, (step + 1) * batch)
            with tf.GradientTape() as tape:
                loss = loss_fn(labels[part], head(embedding(tf.constant(ids[part]))))
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return [v.numpy() for v in variables]

    def _id_bytes(self, layer):
        # header + ids this rank sent: what the plan counts as (L + n) * 4 per remote route
        mesh = layer.mesh
        total = 0
        for routes in layer.route.routes:
            for r in routes:
                if r.owner != mesh.model_position:
                    total += (8 + 8 * 3) * 4
        return total


if __name__ == "__main__":
    tf.test.main()
