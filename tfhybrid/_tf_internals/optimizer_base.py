"""``OptimizerBase``: the Keras optimizer base class of tfhybrid's own optimizers, with
what Keras 2 and Keras 3 name differently behind one interface."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tfhybrid._tf_internals.hooks import install_autograph_rule
from tfhybrid._tf_internals.keras_switch import state_name
from tfhybrid._tf_internals.versions import KERAS_3


class OptimizerBase(tf.keras.optimizers.Optimizer):
    """``tf.keras.optimizers.Optimizer`` with the parts Keras 2 and Keras 3 name
    differently behind one interface, for tfhybrid's own optimizers.

    A subclass implements ``apply_step(gradient, variable, learning_rate)`` (Keras 2
    calls ``update_step(gradient, variable)``, Keras 3 ``update_step(gradient, variable,
    learning_rate)``), makes its state in ``build`` with ``add_state`` and finds it with
    ``state_index``. ``jit_compile`` is Keras 2's (Keras 3 optimizers compile with the
    model, so it is dropped there).

    Example::

        import tensorflow as tf
        from tfhybrid._tf_internals import OptimizerBase

        class Halve(OptimizerBase):
            def apply_step(self, gradient, variable, learning_rate):
                variable.assign(variable / 2)

        weight = tf.Variable([4.0])
        Halve(0.1).apply_gradients([(tf.constant([1.0]), weight)])
        assert weight.numpy()[0] == 2.0
    """

    def __init__(self, learning_rate: Any, name: str | None = None,
                 jit_compile: bool = False, **kwargs: Any):
        install_autograph_rule()
        if KERAS_3:
            super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        else:
            super().__init__(name=name, jit_compile=jit_compile, **kwargs)
            self._learning_rate = self._build_learning_rate(learning_rate)

    def apply_step(self, gradient: Any, variable: Any, learning_rate: Any) -> Any:
        raise NotImplementedError

    if KERAS_3:
        def update_step(self, gradient, variable, learning_rate):
            return self.apply_step(gradient, variable, learning_rate)
    else:
        def update_step(self, gradient, variable):
            return self.apply_step(gradient, variable, self.learning_rate)

    def state_index(self, variable: Any) -> int:
        """The position of ``variable`` among the variables the optimizer was built with."""
        if KERAS_3:
            return self._get_variable_index(variable)
        return self._index_dict[self._var_key(variable)]

    def add_state(self, variable: Any, slot: str, shape: Any, dtype: Any,
                  fill_value: float) -> Any:
        """A new slot ``slot`` of ``variable`` of ``shape`` and ``dtype``, every entry
        ``fill_value``, placed with ``variable`` and tracked (saved with the optimizer)."""
        name = state_name(self, variable, slot)

        def initial(shape=shape, dtype=dtype):
            return tf.fill(shape, tf.constant(fill_value, dtype))

        if KERAS_3:
            return self.add_variable(shape=shape, dtype=dtype, name=name,
                                     initializer=initial)
        with tf.distribute.get_strategy().extended.colocate_vars_with(variable):
            state = tf.Variable(initial(), name=name, dtype=dtype, trainable=False)
        self._variables.append(state)
        return state

    def track_state(self, state: Any) -> None:
        """Saves ``state`` (a variable made elsewhere) with the optimizer's variables."""
        if KERAS_3:
            self._track_variable(state)
        else:
            self._variables.append(state)

    def get_config(self) -> dict:
        config = super().get_config()
        if not KERAS_3:
            # Keras 3's base writes it; Keras 2's returns a numpy float32 for a variable,
            # and a Python float is JSON-friendly
            value = self._serialize_hyperparameter(self._learning_rate)
            config["learning_rate"] = (float(value) if isinstance(value, (float, np.floating))
                                       else value)
        return config
