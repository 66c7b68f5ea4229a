"""A Keras Embedding with a combiner: the single-table layer tfhybrid shards."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfhybrid import custom_ops

COMBINERS = (None, "sum", "mean")


class Embedding(tf.keras.layers.Embedding):
    """``tf.keras.layers.Embedding`` plus an optional combiner over each sample's ids.

    With ``combiner=None`` it is exactly the Keras layer. With ``"sum"`` or ``"mean"``,
    ids of shape ``[batch, hotness]`` or a ``tf.RaggedTensor`` ``[batch, None]`` give
    ``[batch, output_dim]`` (an empty bag gives zeros). It runs on tfhybrid's fused
    lookup+combine op where that is built, else on plain TF ops.

    Example::

        import tensorflow as tf
        from tfhybrid.layers import Embedding
        layer = Embedding(100, 8, combiner="mean")
        out = layer(tf.ragged.constant([[1, 2, 3], [4]]))
        assert out.shape == (2, 8)
    """

    def __init__(self, input_dim: int, output_dim: int, combiner: str | None = None,
                 **kwargs: Any):
        if combiner not in COMBINERS:
            raise ValueError(f"combiner={combiner!r} is unknown; expected one of {COMBINERS}")
        super().__init__(input_dim, output_dim, **kwargs)
        self.combiner = combiner

    def call(self, inputs):
        if self.combiner is None and not isinstance(inputs, tf.RaggedTensor):
            return super().call(inputs)
        if self.combiner is None:
            raise ValueError(
                f"Embedding {self.name!r}: a RaggedTensor input needs combiner='sum' or "
                "'mean'; got combiner=None")
        ids = inputs
        if not isinstance(ids, tf.RaggedTensor) and ids.shape.rank == 1:
            ids = tf.expand_dims(ids, 1)
        out = custom_ops.embedding_lookup_combine(
            self.embeddings, ids, combiner=self.combiner, table_name=self.name)
        return tf.cast(out, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        if self.combiner is None:
            return super().compute_output_shape(input_shape)
        return tf.TensorShape([input_shape[0], self.output_dim])

    def get_config(self) -> dict:
        return dict(super().get_config(), combiner=self.combiner)
