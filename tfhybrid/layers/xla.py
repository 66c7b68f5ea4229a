"""XlaCompiled: runs a dense tower under XLA while collectives stay outside."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfhybrid import _tf_internals


class XlaCompiled(tf.keras.layers.Layer):
    """Wraps a layer (an MLP, an interaction) so its forward and backward run XLA-compiled.

    Horovod collectives cannot be compiled, so ``model.compile(jit_compile=True)`` fails on
    a model with a ``DistributedEmbedding``; compile the dense towers instead with this
    wrapper and keep ``jit_compile`` off for the model.

    Example::

        import tensorflow as tf
        from tfhybrid.layers import XlaCompiled
        tower = XlaCompiled(tf.keras.Sequential([tf.keras.layers.Dense(8, "relu"),
                                                 tf.keras.layers.Dense(1)]))
        out = tower(tf.ones([2, 4]))
        assert out.shape == (2, 1)
    """

    def __init__(self, layer: tf.keras.layers.Layer, **kwargs: Any):
        _tf_internals.install_autograph_rule()
        super().__init__(**kwargs)
        self.layer = layer
        self._compiled = tf.function(self._forward, jit_compile=True, reduce_retracing=True)

    def _forward(self, inputs, training=None):
        return self.layer(inputs, training=training)

    def build(self, input_shape):
        # variables are created here, outside the compiled function
        if not self.layer.built:
            self.layer.build(input_shape)
        super().build(input_shape)

    def call(self, inputs, training=None):
        return self._compiled(inputs, training=training)

    def get_config(self) -> dict:
        return dict(super().get_config(), layer=tf.keras.layers.serialize(self.layer))

    @classmethod
    def from_config(cls, config: dict) -> "XlaCompiled":
        config = dict(config)
        config["layer"] = tf.keras.layers.deserialize(config["layer"])
        return cls(**config)
