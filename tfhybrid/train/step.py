"""One training step of a click model, the whole data path top to bottom.

ids -> alltoall -> lookup -> alltoall   (DistributedEmbedding.call)
    -> dense head -> loss               (this rank's local batch)
    -> gradients                        (the backward alltoalls return row gradients to owners)
    -> allreduce -> optimizer           (tfhybrid.DistributedOptimizer.apply_gradients)
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfhybrid import _tf_internals


def flatten_and_concat(outputs: Sequence[tf.Tensor]) -> tf.Tensor:
    """Joins per-feature embeddings ([b, d] or [b, h, d]) into one [b, sum] tensor."""
    return tf.concat([tf.reshape(o, [tf.shape(o)[0], -1]) for o in outputs], axis=1)


def click_train_step(embedding: tf.keras.layers.Layer, head: tf.keras.layers.Layer,
                     optimizer: tf.keras.optimizers.Optimizer, ids: Sequence,
                     labels: tf.Tensor) -> tf.Tensor:
    """Trains ``head(embedding(ids))`` on click labels for one step; returns the loss.

    ``optimizer`` should be a ``tfhybrid.DistributedOptimizer`` so the gradients are
    reduced over the mesh before they are applied.

    Example (one process)::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding, Embedding
        from tfhybrid.train.step import click_train_step
        tfhybrid.init(model_parallel=1)
        embedding = DistributedEmbedding([Embedding(10, 4, combiner="sum")])
        optimizer = tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
        loss = click_train_step(embedding, tf.keras.layers.Dense(1), optimizer,
                                [tf.constant([[1, 2]])], tf.constant([[1.0]]))
    """
    with tf.GradientTape() as tape:
        outputs = embedding(ids)                     # ids -> alltoall -> lookup -> alltoall
        logits = head(flatten_and_concat(outputs))   # dense towers
        loss = tf.reduce_mean(tf.keras.losses.binary_crossentropy(
            labels, tf.cast(logits, tf.float32), from_logits=True))
        # fp16 gradients underflow without loss scaling
        target = _tf_internals.scaled_loss(optimizer, loss)
    variables = embedding.trainable_variables + head.trainable_variables
    grads = tape.gradient(target, variables)         # backward alltoalls to the owners
    # Keras 2's loss-scale optimizer takes them unscaled, Keras 3's unscales them itself
    grads = _tf_internals.gradients_to_apply(optimizer, grads)
    optimizer.apply_gradients(zip(grads, variables))  # allreduce over the mesh, then update
    return loss
