"""A distributed-embeddings style check: one SGD step of DistributedEmbedding against
plain Keras layers on the global batch, on any mesh and with either kind of input.

Every rank draws the same seeded global batch and the same full tables. The reference
runs the single-process layers on the global batch; the distributed layer runs on this
rank's share: its own samples (``dp_input=True``), or its position's features for its
model group's samples (``dp_input=False``). Each rank's loss is the mean over its own
samples, so averaging the ranks' gradients gives the reference's gradient of the mean
over the global batch.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid.layers import Embedding

KERAS_3 = tfhybrid.keras_major() == 3

LOCAL_BATCH = 3
LEARNING_RATE = 1.5


def global_ids(table_sizes, input_table_map, global_batch, hotness=None, ragged=False,
               seed=7):
    """One id tensor per feature for the global batch, the same on every rank."""
    rng = np.random.default_rng(seed)
    features = []
    for f, t in enumerate(input_table_map):
        rows = table_sizes[t][0]
        if hotness is None:
            features.append(tf.constant(rng.integers(0, rows, [global_batch]), tf.int64))
        elif ragged:
            lengths = rng.integers(0, hotness + 1, [global_batch])
            features.append(tf.RaggedTensor.from_row_lengths(
                tf.constant(rng.integers(0, rows, [int(lengths.sum())]), tf.int64), lengths))
        else:
            features.append(tf.constant(rng.integers(0, rows, [global_batch, hotness]),
                                        tf.int64))
    return features


def make_layers(table_sizes, combiner=None, **embedding_kwargs):
    if combiner is None:
        return [tf.keras.layers.Embedding(rows, dim, name=f"t{i}", **embedding_kwargs)
                for i, (rows, dim) in enumerate(table_sizes)]
    return [Embedding(rows, dim, combiner=combiner, name=f"t{i}", **embedding_kwargs)
            for i, (rows, dim) in enumerate(table_sizes)]


def loss_of(outputs, batch):
    # cumsum mixes the columns, so a column slice put in the wrong place shows
    return tf.add_n([tf.reduce_sum(tf.cumsum(tf.reshape(o, [batch, -1]), axis=1) ** 2)
                     for o in outputs]) / batch


def samples_of(x, start, stop):
    return x[start:stop]


def run_step(test, table_sizes, *, combiner=None, hotness=None, ragged=False,
             input_table_map=None, embedding_kwargs=None, use_dp_to_mp=False,
             layer_factory=None, optimizer=None,
             unknown_hotness=False, **layer_kwargs):
    """One forward and one SGD step; asserts outputs (1e-6) and tables (1e-5).

    ``unknown_hotness``: the layer is built and stepped in functions traced with every
    dimension of the ids unknown, as Keras traces ``fit`` over a Sequence.
    """
    input_table_map = input_table_map or list(range(len(table_sizes)))
    # DE's scripts use Keras 2's legacy SGD; Keras 3 has one SGD
    optimizer = optimizer or (tf.keras.optimizers.SGD if KERAS_3
                              else tf.keras.optimizers.legacy.SGD)
    make = layer_factory or (lambda: make_layers(table_sizes, combiner,
                                                 **(embedding_kwargs or {})))
    layer = tfhybrid.DistributedEmbedding(make(), input_table_map=input_table_map,
                                          **layer_kwargs)
    layer.strategy  # the plan (and the mesh, made here if the script made none)
    mesh = layer.mesh
    global_batch = LOCAL_BATCH * mesh.size
    ids = global_ids(table_sizes, input_table_map, global_batch, hotness, ragged)
    reference = make()
    rng = np.random.default_rng(11)
    full = [rng.standard_normal([rows, dim]).astype(np.float32) for rows, dim in table_sizes]
    for single, table in zip(reference, full):
        single.build(tf.TensorShape([None]))
        single.built = True   # a custom build may not say so itself
        single.set_weights([table])

    first = mesh.rank * LOCAL_BATCH
    local = [samples_of(x, first, first + LOCAL_BATCH) for x in ids]
    if layer_kwargs.get("dp_input", True):
        inputs = local
    elif use_dp_to_mp:
        inputs = layer._dp_to_mp_input(local)
    else:
        # the model group's samples, in position order (data_major groups are strided)
        inputs = [tf.concat([samples_of(ids[f], r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)
                             for r in mesh.model_group_ranks], axis=0)
                  for f in layer.strategy.input_ids_list[mesh.rank]]
    def forward_backward(inputs):
        with tf.GradientTape() as tape:
            outputs = layer(inputs)
            loss = loss_of(outputs, LOCAL_BATCH) + tf.add_n(layer.losses or [0.0])
        return outputs, tfhybrid.DistributedGradientTape(tape).gradient(
            loss, layer.trainable_variables)

    build = layer.__call__
    if unknown_hotness:
        signature = [[tf.TensorSpec([None] * x.shape.rank, x.dtype) for x in inputs]]
        build = tf.function(build, input_signature=signature)
        forward_backward = tf.function(forward_backward, input_signature=signature)
    build(inputs)
    layer.set_weights(full)
    outputs, grads = forward_backward(inputs)
    optimizer(LEARNING_RATE).apply_gradients(zip(grads, layer.trainable_variables))

    variables = [r.embeddings if hasattr(r, "embeddings") else r.weights[0]
                 for r in reference]
    with tf.GradientTape() as tape:
        expected = [reference[t](x) for x, t in zip(ids, input_table_map)]
        reference_loss = loss_of(expected, global_batch) + tf.add_n(
            [loss for r in reference for loss in r.losses] or [0.0])
    # dense: the one-process step on the global batch, whatever an optimizer would make
    # of a sparse gradient's repeated rows
    reference_grads = [tf.convert_to_tensor(g)
                       for g in tape.gradient(reference_loss, variables)]
    optimizer(LEARNING_RATE).apply_gradients(zip(reference_grads, variables))

    for got, want in zip(outputs, expected):
        want = samples_of(want, first, first + LOCAL_BATCH)
        if not layer_kwargs.get("dp_input", True) and combiner is None:
            # dp_input=False: one id per sample, [batch, dim] whatever the ids' shape
            want = tf.reshape(want, got.shape)
        test.assertAllClose(got, want, rtol=1e-6, atol=1e-6)
    for got, want in zip(layer.get_weights(all_ranks=True), variables):
        test.assertAllClose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    return layer
