"""ConcatOneHotEmbedding: many one-hot features looked up in one concatenated table."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import custom_ops

__all__ = ["ConcatOneHotEmbedding", "ConcatEmbedding"]


def _positive_int(value: Any, what: str) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or number <= 0:
        raise ValueError(f"{what}={value!r}; expected a positive integer")
    return number


class ConcatOneHotEmbedding(tf.keras.layers.Layer):
    """One-hot features whose tables of equal width are stored as one concatenated table.

    Feature ``f`` (with ``feature_sizes[f]`` rows) owns rows
    ``[offset_f, offset_f + feature_sizes[f])`` of a single ``[sum(feature_sizes),
    embedding_width]`` weight named ``params``, where ``offset_f`` is the sum of the sizes
    before it. Ids ``[batch, num_features]`` (column ``f`` holds feature ``f``'s id, in
    ``[0, feature_sizes[f])``) give ``[batch, num_features, embedding_width]``: one lookup
    for all features instead of one per table. This is distributed-embeddings'
    ``ConcatOneHotEmbedding`` (later renamed ``ConcatEmbedding``; both names work).

    Unlike distributed-embeddings, an id outside its own feature's range raises
    ``InvalidArgumentError`` naming the feature, instead of silently reading a
    neighbouring feature's rows. Float ids are cast to int32, as Keras' Embedding does.

    Args:
      feature_sizes: rows of each feature's table, e.g. ``[3, 5, 7]``.
      embedding_width: width of every embedding vector.
      embeddings_initializer: initializer of ``params`` (distributed-embeddings leaves the
        Keras default for a float weight, ``"glorot_uniform"``).
      use_custom_kernel: ``True`` runs tfhybrid's fused lookup op where it is built and the
        table is on a CPU, else plain TF ops; ``False`` always uses plain TF ops.

    Example::

        import tensorflow as tf
        from tfhybrid.layers import ConcatOneHotEmbedding
        layer = ConcatOneHotEmbedding([3, 5], 4)
        out = layer(tf.constant([[2, 0], [1, 4]]))   # feature 1's id 4 reads row 3 + 4
        assert out.shape == (2, 2, 4)
        assert layer.params.shape == (8, 4)
    """

    def __init__(self, feature_sizes: Sequence[int], embedding_width: int,
                 embeddings_initializer: Any = "glorot_uniform", use_custom_kernel: bool = True,
                 **kwargs: Any):
        _tf_internals.install_autograph_rule()
        super().__init__(**kwargs)
        if isinstance(feature_sizes, (str, bytes)) or not hasattr(feature_sizes, "__len__") \
                or len(feature_sizes) == 0:
            raise ValueError(f"feature_sizes={feature_sizes!r}; expected a non-empty list of "
                             f"positive integers")
        self.feature_sizes = [_positive_int(s, f"feature_sizes[{i}]")
                              for i, s in enumerate(feature_sizes)]
        self.embedding_width = _positive_int(embedding_width, "embedding_width")
        if not isinstance(use_custom_kernel, bool):
            raise ValueError(f"use_custom_kernel={use_custom_kernel!r}; expected True or False")
        self.use_custom_kernel = use_custom_kernel
        self.embeddings_initializer = tf.keras.initializers.get(embeddings_initializer)
        self._offsets_np = np.concatenate([[0], np.cumsum(self.feature_sizes)]).astype(np.int64)
        self.params = None

    @property
    def offsets(self) -> tf.Tensor:
        """First row of each feature, then the total row count (``num_features + 1``)."""
        return tf.constant(self._offsets_np, dtype=self._index_dtype())

    def _index_dtype(self):
        # int32 row ids unless the concatenated table is too tall for them.
        return tf.int64 if self._offsets_np[-1] > np.iinfo(np.int32).max else tf.int32

    def build(self, input_shape=None):
        self.params = _tf_internals.add_weight(
            self.add_weight, name="params",
            shape=[int(self._offsets_np[-1]), self.embedding_width],
            initializer=self.embeddings_initializer, autocast=False)
        self.built = True

    def call(self, inputs):
        if isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor)):
            raise ValueError(f"ConcatOneHotEmbedding {self.name!r}: ids must be a dense "
                             f"[batch, {len(self.feature_sizes)}] tensor; got "
                             f"{type(inputs).__name__}")
        ids = tf.convert_to_tensor(inputs)
        num_features = len(self.feature_sizes)
        if ids.shape.rank != 2 or ids.shape[1] not in (None, num_features):
            raise ValueError(f"ConcatOneHotEmbedding {self.name!r}: ids must be [batch, "
                             f"{num_features}] (one column per feature); got shape {ids.shape}")
        if not ids.dtype.is_integer:
            ids = tf.cast(ids, tf.int32)
        index_dtype = tf.int64 if tf.int64 in (ids.dtype, self._index_dtype()) else tf.int32
        ids = self._check_ranges(tf.cast(ids, index_dtype))
        rows = ids + tf.constant(self._offsets_np[:-1], dtype=index_dtype)
        # the tf.Variable inside a Keras 3 weight: the fused op reads a table by its handle
        out = custom_ops.embedding_lookup_combine(
            _tf_internals.tf_variable(self.params), rows, combiner=None, table_name=self.name,
            use_custom_op=None if self.use_custom_kernel else False)
        return tf.cast(out, self.compute_dtype)

    def _check_ranges(self, ids):
        """Fails if any id is outside its own feature's [0, size); returns `ids`."""
        sizes = tf.constant(self.feature_sizes, dtype=ids.dtype)
        bad = tf.logical_or(ids < 0, ids >= sizes)
        prefix = f"ConcatOneHotEmbedding {self.name!r}:"
        if tf.executing_eagerly():
            bad_np = bad.numpy()
            if bad_np.any():
                row, feature = (int(i) for i in np.argwhere(bad_np)[0])
                raise tf.errors.InvalidArgumentError(
                    None, None, f"{prefix} feature {feature} got id {int(ids[row, feature])}, "
                    f"expected ids in [0, {self.feature_sizes[feature]}) (sample {row})")
            return ids
        num_features = len(self.feature_sizes)
        first = tf.argmax(tf.cast(tf.reshape(bad, [-1]), tf.int32), output_type=tf.int64)
        feature = first % num_features
        # tf.strings.format reads "{}" as placeholders: keep the layer name's braces out.
        template = prefix.replace("{", "(").replace("}", ")")
        message = tf.strings.format(
            template + " feature {} got id {}, expected ids in [0, {}) (sample {})",
            [feature, tf.reshape(ids, [-1])[first], tf.gather(sizes, feature),
             first // num_features])
        check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [message])
        with tf.control_dependencies([check]):
            return tf.identity(ids)

    def compute_output_shape(self, input_shape):
        shape = tf.TensorShape(input_shape)
        return shape.concatenate([self.embedding_width])

    def get_config(self) -> dict:
        return dict(super().get_config(), feature_sizes=list(self.feature_sizes),
                    embedding_width=self.embedding_width,
                    embeddings_initializer=tf.keras.initializers.serialize(
                        self.embeddings_initializer),
                    use_custom_kernel=self.use_custom_kernel)


# distributed-embeddings' later name for the same layer.
ConcatEmbedding = ConcatOneHotEmbedding
