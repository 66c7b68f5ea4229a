"""What an optimizer can train, as it advertises it, so a table's storage can check it
against what it needs without importing the optimizer.

A storage kind whose rows move or are only partly present (a FIITED pool's chunk
prefixes, a tiered table's DRAM cache) cannot take a slot shaped like its variable: the
slot would not follow the rows. Its guard asks :func:`trains_of` instead:

- ``Trains.ROW_STATE``: the optimizer keeps one accumulator per row in the variable the
  table names (``tfhybrid.roles``' ``row_accumulator``), and lets a table that applies its
  own rows (``row_step``) take the step: ``tfhybrid.optimizers``' row-wise AdaGrads,
  which advertise it with :func:`advertises`;
- ``Trains.NO_STATE``: it carries nothing from step to step (SGD without momentum);
- ``Trains.DENSE_STATE``: any other optimizer, whose slots are shaped like the variable.

Example::

    import tensorflow as tf
    import tfhybrid
    from tfhybrid.optimizer_traits import Trains, trains_of
    from tfhybrid.optimizers import RowWiseAdagrad
    assert trains_of(RowWiseAdagrad()) is Trains.ROW_STATE
    assert trains_of(tf.keras.optimizers.SGD()) is Trains.NO_STATE
    assert trains_of(tf.keras.optimizers.SGD(momentum=0.9)) is Trains.DENSE_STATE
    if tfhybrid.keras_major() == 2:   # tf-keras' legacy SGD
        assert trains_of(tf.keras.optimizers.legacy.SGD()) is Trains.NO_STATE
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import tensorflow as tf


class Trains(enum.Enum):
    """The state an optimizer keeps for the variables it trains (see the module doc).

    Example::

        from tfhybrid.optimizer_traits import Trains
        assert Trains("row_state") is Trains.ROW_STATE
    """
    ROW_STATE = "row_state"
    NO_STATE = "no_state"
    DENSE_STATE = "dense_state"


_ADVERTISED: dict[type, Trains] = {}


def advertises(trains: Trains) -> Callable[[type], type]:
    """A class decorator: the optimizer class (and its subclasses) train ``trains``."""
    if not isinstance(trains, Trains):
        raise ValueError(f"trains={trains!r} must be a tfhybrid.optimizer_traits.Trains")

    def register(cls: type) -> type:
        _ADVERTISED[cls] = trains
        return cls
    return register


def _sgd_classes() -> tuple[type, ...]:
    """Keras' SGD, and tf-keras' legacy one (Keras 3 refuses to import its legacy names)."""
    try:
        return (tf.keras.optimizers.SGD, tf.keras.optimizers.legacy.SGD)
    except (ImportError, AttributeError):
        return (tf.keras.optimizers.SGD,)


_SGD_CLASSES = _sgd_classes()


def _momentum_free_sgd(optimizer: Any) -> bool:
    # Keras 2.15's SGD makes a momentum slot even at momentum 0, but then resets it every
    # step (m = 0 * m + update), so its slots carry nothing from step to step; the legacy
    # SGD makes none at momentum 0
    return isinstance(optimizer, _SGD_CLASSES) and not optimizer.nesterov and \
        float(optimizer.momentum) == 0.0


def trains_of(optimizer: Any) -> Trains:
    """What ``optimizer`` keeps for a variable it trains: what its class (or a base)
    advertises, else ``NO_STATE`` for SGD without momentum, else ``DENSE_STATE``."""
    for cls in type(optimizer).__mro__:
        if cls in _ADVERTISED:
            return _ADVERTISED[cls]
    return Trains.NO_STATE if _momentum_free_sgd(optimizer) else Trains.DENSE_STATE
