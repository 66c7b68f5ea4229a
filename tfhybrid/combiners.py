"""How a bag's rows combine: one rule for every table, store, route and kernel caller.

For a bag of rows eᵢ with per-id weights wᵢ (1 without weights), as
``tf.nn.embedding_lookup_sparse`` defines them:

- ``sum`` = Σ wᵢ·eᵢ;
- ``mean`` = Σ wᵢ·eᵢ / Σ wᵢ (without weights: over the bag's length, at least 1);
- ``sqrtn`` = Σ wᵢ·eᵢ / √(Σ wᵢ²) (without weights: over √length).

An empty bag, or one whose denominator is 0, gives zeros. The kernels add the weighted
rows (``sum``). Without weights, a ``mean`` or ``sqrtn`` divides where whole bags are
known, by :func:`combined_bags`, so a bag split over row shards divides once, after its
parts are added. With weights, ``DistributedEmbedding`` divides each id's weight by its
bag's divisor where it reads the bag (:func:`normalized_weights`), so the lookup, the
route and the backward only add weighted rows: a division of every bag's [width] sum,
and its gradient, cost more than the rest of a weighted step's extra work. For ``mean``
and ``sqrtn`` it drops ids of weight ≤ 0 before (:func:`kept_in_bags`), as
``tf.nn.safe_embedding_lookup_sparse`` does (a sum keeps them).

Example::

    import tensorflow as tf
    from tfhybrid.combiners import bag_means, combined_bags, normalized_weights
    sums = tf.constant([[4.0, 2.0], [0.0, 0.0]])
    assert bag_means(sums, tf.constant([2, 0])).numpy().tolist() == [[2.0, 1.0], [0.0, 0.0]]
    sqrtn = combined_bags(tf.constant([[6.0]]), "sqrtn", tf.constant([2]),
                          tf.constant([3.0, 4.0]))
    assert sqrtn.numpy().tolist() == [[6.0 / 5.0]]
    shares = normalized_weights("mean", tf.constant([[1.0, 3.0], [0.0, 0.0]]))
    assert shares.numpy().tolist() == [[0.25, 0.75], [0.0, 0.0]]
"""

from __future__ import annotations

import tensorflow as tf

from tfhybrid.plan import types as plan_types

# what every store's lookup combines by: the plan's combiners that combine
COMBINERS = tuple(c for c in plan_types.COMBINERS if c is not None)


def bag_means(sums: tf.Tensor, lengths: tf.Tensor) -> tf.Tensor:
    """[bags, width] ``sums`` divided by each bag's length (at least 1)."""
    counts = tf.cast(tf.maximum(lengths, 1), sums.dtype)
    return sums / counts[:, None]


def weight_denominators(combiner: str, weights) -> tf.Tensor:
    """[bags] each bag's divisor for weighted ``mean`` (Σ w) or ``sqrtn`` (√Σ w²), from
    its ``weights`` ([bags, hotness] dense or ragged, zeros where an id is dropped)."""
    if combiner == "mean":
        return tf.reduce_sum(weights, axis=1)
    return tf.sqrt(tf.reduce_sum(weights * weights, axis=1))


def normalized_weights(combiner: str, weights):
    """Each id's weight over its bag's divisor (:func:`weight_denominators`), in the form
    of ``weights`` ([bags, hotness] dense or ragged, zeros where an id is dropped): the
    weights whose weighted sum is the bag's ``mean`` or ``sqrtn``. A bag whose divisor is
    0 has only zero weights, so it sums to zeros."""
    denominators = weight_denominators(combiner, weights)
    # a zero divisor means every weight of the bag is 0: dividing them by 1 keeps them
    divisors = tf.where(denominators > 0, denominators, tf.ones_like(denominators))
    return weights / divisors[:, None]


def combined_bags(sums: tf.Tensor, combiner: str, lengths: tf.Tensor,
                  weights: tf.Tensor | None = None) -> tf.Tensor:
    """[bags, width] weighted ``sums`` of bags (``lengths`` ids each, ``weights`` per id
    or None) combined by ``combiner`` (module docstring). ``ValueError`` names an
    unknown combiner."""
    if combiner not in COMBINERS:
        raise ValueError(f"combiner={combiner!r} is unknown; expected one of {COMBINERS}")
    if combiner == "sum":
        return sums
    if weights is None:
        if combiner == "mean":
            return bag_means(sums, lengths)
        counts = tf.cast(tf.maximum(lengths, 1), sums.dtype)
        return sums / tf.sqrt(counts)[:, None]
    bags = tf.RaggedTensor.from_row_lengths(tf.cast(weights, sums.dtype),
                                            tf.cast(lengths, tf.int64), validate=False)
    return tf.math.divide_no_nan(sums, weight_denominators(combiner, bags)[:, None])


def kept_in_bags(ids: tf.Tensor, lengths: tf.Tensor, kept: tf.Tensor,
                 weights: tf.Tensor | None = None):
    """The ``ids`` where ``kept`` holds, and how many of them each bag (``lengths``) has:
    bags with some of their ids left out (a row shard's part, a dynamic table's keys
    without a slot, ids of weight <= 0). With ``weights`` (one per id), also theirs:
    (ids, counts, weights)."""
    # a bag's count is the difference of the running count of kept ids at its two ends:
    # a third of the ops of tf.repeat + a segment sum, built at every trace
    lengths = tf.cast(lengths, tf.int64)
    kept_before = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(tf.cast(kept, tf.int64))], 0)
    ends = tf.cumsum(lengths)
    counts = tf.gather(kept_before, ends) - tf.gather(kept_before, ends - lengths)
    positions = tf.reshape(tf.where(kept), [-1])
    if weights is None:
        return tf.gather(ids, positions), counts
    return tf.gather(ids, positions), counts, tf.gather(weights, positions)
