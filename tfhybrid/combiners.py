"""How a bag's rows combine: one rule for every table, store and route.

``sum`` adds a bag's rows; ``mean`` divides that sum by the bag's length, ``max(length,
1)``, so an empty bag gives zeros (as ``tf.nn.embedding_lookup_sparse`` and
distributed-embeddings define it).

Example::

    import tensorflow as tf
    from tfhybrid.combiners import bag_means
    sums = tf.constant([[4.0, 2.0], [0.0, 0.0]])
    assert bag_means(sums, tf.constant([2, 0])).numpy().tolist() == [[2.0, 1.0], [0.0, 0.0]]
"""

from __future__ import annotations

import tensorflow as tf

# what every store's lookup combines by
COMBINERS = ("sum", "mean")


def bag_means(sums: tf.Tensor, lengths: tf.Tensor) -> tf.Tensor:
    """[bags, width] ``sums`` divided by each bag's length (at least 1)."""
    counts = tf.cast(tf.maximum(lengths, 1), sums.dtype)
    return sums / counts[:, None]


def kept_in_bags(ids: tf.Tensor, lengths: tf.Tensor, kept: tf.Tensor
                 ) -> tuple[tf.Tensor, tf.Tensor]:
    """The ``ids`` where ``kept`` holds, and how many of them each bag (``lengths``) has:
    bags with some of their ids left out (a row shard's part, a dynamic table's keys
    without a slot)."""
    # a bag's count is the difference of the running count of kept ids at its two ends:
    # a third of the ops of tf.repeat + a segment sum, built at every trace
    lengths = tf.cast(lengths, tf.int64)
    kept_before = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(tf.cast(kept, tf.int64))], 0)
    ends = tf.cumsum(lengths)
    counts = tf.gather(kept_before, ends) - tf.gather(kept_before, ends - lengths)
    return tf.gather(ids, tf.reshape(tf.where(kept), [-1])), counts
