"""Shared by the dynamic-table tests: the documented key function of a new row, a dict
of key -> row trained by hand, and a DistributedEmbedding of dynamic tables trained on
the mesh against it (forward and rows after every step, the C++ kernels on).

The references share no arithmetic with tfhybrid: splitmix64 and the row formula are
written out on Python ints, and the optimizer step on numpy float64.
"""

import math

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.layers import DistributedEmbedding, DynamicEmbedding
from tfhybrid.optimizers import RowWiseAdagrad

WORD = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z &= WORD
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & WORD
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & WORD
    return z ^ (z >> 31)


def initial_row(low: float, high: float, seed: int, key: int, dim: int) -> np.ndarray:
    """RandomUniform(low, high)'s row of ``key``, from the documented formula."""
    state = _mix((key & WORD) ^ _mix((seed + GOLDEN) & WORD))
    return np.array([low + (high - low) * (_mix((state + (j + 1) * GOLDEN) & WORD) >> 11)
                     / float(1 << 53) for j in range(dim)], np.float32)


def reference_training(batches, dim, low, high, seed, lr, eps, combiner):
    """Per-step outputs and the final rows of a dict of key -> row under row-wise AdaGrad,
    for the loss sum(outputs * weights) with fixed weights."""
    rows, accumulators, outputs = {}, {}, []
    for keys, weights in batches:
        for k in keys.ravel().tolist():
            if k not in rows:
                rows[k] = initial_row(low, high, seed, k, dim).astype(np.float64)
                accumulators[k] = 0.0
        bag = np.array([[rows[k] for k in sample] for sample in keys.tolist()])
        out = bag.sum(axis=1)
        if combiner == "mean":
            out = out / keys.shape[1]
        outputs.append(out)
        grads = {}
        for b, sample in enumerate(keys.tolist()):
            for k in sample:
                g = weights[b] / (keys.shape[1] if combiner == "mean" else 1.0)
                grads[k] = grads.get(k, 0.0) + g
        for k, g in grads.items():
            accumulators[k] += float(np.mean(g * g))
            rows[k] = rows[k] - lr * g / (math.sqrt(accumulators[k]) + eps)
    return outputs, rows



DIM, LR, EPS, LOW, HIGH, SEED = 4, 0.05, 1e-8, -0.5, 0.5, 11
UNIVERSE = np.array([-(1 << 62), -17, -1, 0, 3, 99, 1 << 33, (1 << 63) - 1, 12, 7, 5, 8,
                     1 << 50, -(1 << 40), 31, 64])


def global_batches(steps, batch, hotness, seed=5):
    """(keys [batch, hotness], weights [batch, DIM]) of each step's global batch."""
    rng = np.random.default_rng(seed)
    return [(UNIVERSE[rng.integers(0, len(UNIVERSE), [batch, hotness])],
             rng.normal(size=[batch, DIM]).astype(np.float32)) for _ in range(steps)]


def long_tailed_batches(steps, batch, hotness, seed=5, universe=48):
    """As :func:`global_batches`, on a long-tailed stream of ``universe`` raw 64-bit keys:
    a few keys come back often, most rarely."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        ranks = rng.zipf(1.3, [batch, hotness]) % universe
        batches.append(((ranks * 0x9E3779B97F4A7C1) % (1 << 62) - (1 << 61),
                        rng.normal(size=[batch, DIM]).astype(np.float32)))
    return batches


def dynamic_layer(combiner, capacity=64, name="keys", **options):
    return DynamicEmbedding(DIM, capacity=capacity, combiner=combiner, seed=SEED,
                            initializer=tf.keras.initializers.RandomUniform(LOW, HIGH),
                            name=name, **options)


def rows_by_key(layer) -> dict:
    """Every key this rank's shard of the layer's dynamic table holds, with its row."""
    table = layer.stores.get(0, layer.mesh.model_position).tracked
    keys, seen = table.slot_keys.numpy(), table.slot_seen.numpy()
    rows = table.rows.numpy()
    return {int(k): rows[s] for s, k in enumerate(keys) if seen[s] >= 0}


def check_mesh_against_dict(test, combiner, model_parallel, layout="model_major",
                            steps=10, local_batch=3, hotness=3, use_custom_kernel=True):
    """A DistributedEmbedding holding one dynamic table, trained in a custom loop with
    RowWiseAdagrad on this mesh, equals the dict of rows on the global batch: each
    rank's outputs after every step's forward, and every key's row after the last."""
    mesh_lib.reset()
    mesh = tfhybrid.init(model_parallel=model_parallel, layout=layout)
    world, rank = mesh.size, mesh.rank
    batches = global_batches(steps, world * local_batch, hotness)
    # the reference's loss is the mean over the global batch: its weights / B
    scaled = [(k, w / (world * local_batch)) for k, w in batches]
    want_out, want_rows = reference_training(scaled, DIM, LOW, HIGH, SEED, LR, EPS,
                                             combiner)
    layer = DistributedEmbedding([dynamic_layer(combiner)], mesh=mesh,
                                 use_custom_kernel=use_custom_kernel)
    optimizer = RowWiseAdagrad(learning_rate=LR, epsilon=EPS)
    mine = slice(rank * local_batch, (rank + 1) * local_batch)
    for (keys, weights), want in zip(batches, want_out):
        with tf.GradientTape() as tape:
            out = layer([tf.constant(keys[mine])], training=True)[0]
            loss = tf.reduce_sum(out * weights[mine]) / local_batch
        tape = tfhybrid.DistributedGradientTape(tape)
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        # want holds the sums of the scaled weights' rows: the outputs themselves
        np.testing.assert_allclose(out.numpy(), want[mine], rtol=0, atol=1e-6,
                                   err_msg=f"{combiner} {mesh}")
    held = rows_by_key(layer)
    for key, row in held.items():
        np.testing.assert_allclose(row, want_rows[key], rtol=0, atol=1e-6,
                                   err_msg=f"{combiner} key {key} on {mesh}")
    return layer, held, want_rows


def check_fit_against_dict(test, model_parallel, layout="model_major", steps=10,
                           local_batch=3, hotness=3):
    """As :func:`check_mesh_against_dict`, under Keras' ``fit`` with
    ``tfhybrid.DistributedOptimizer``: every key's row after ``steps`` steps, and the
    model's outputs for every rank's last batch (``predict``: nothing is admitted)."""
    mesh_lib.reset()
    mesh = tfhybrid.init(model_parallel=model_parallel, layout=layout)
    world, rank = mesh.size, mesh.rank
    batches = global_batches(steps, world * local_batch, hotness)
    scaled = [(k, w / (world * local_batch)) for k, w in batches]
    _, want_rows = reference_training(scaled, DIM, LOW, HIGH, SEED, LR, EPS, "sum")
    keys = tf.keras.Input(shape=[hotness], dtype=tf.int64)
    layer = DistributedEmbedding([dynamic_layer("sum")], mesh=mesh)
    model = tf.keras.Model(keys, layer([keys])[0])
    # the rank's loss: the mean over its batch of sum(outputs * weights)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(
        RowWiseAdagrad(learning_rate=LR, epsilon=EPS)),
        loss=lambda weights, out: tf.reduce_sum(out * weights) / local_batch)
    mine = slice(rank * local_batch, (rank + 1) * local_batch)
    x = np.concatenate([k[mine] for k, _ in batches])
    y = np.concatenate([w[mine] for _, w in batches])
    model.fit(x, y, batch_size=local_batch, epochs=1, shuffle=False, verbose=0)
    held = rows_by_key(layer)
    for key, row in held.items():
        np.testing.assert_allclose(row, want_rows[key], rtol=0, atol=1e-6,
                                   err_msg=f"fit: key {key} on {mesh}")
    last = batches[-1][0][mine]
    want = np.array([[want_rows[k] for k in sample] for sample in last.tolist()]).sum(1)
    np.testing.assert_allclose(model.predict(last, batch_size=local_batch, verbose=0),
                               want, rtol=0, atol=1e-6, err_msg=f"fit: predict on {mesh}")
    return layer, held, want_rows
