"""A dynamic table's new row: a function of (table seed, key) only.

So a key gets the same starting row on any mesh, in any order of arrival and after any
eviction (a re-admitted key starts again from it). Entry j of key k's row is drawn from
64 random bits, splitmix64's stream started at a state made of the key and the seed
(``mix64`` is ``tfhybrid.dynamic.keys.mix64``, ``G = 0x9E3779B97F4A7C15`` splitmix64's
increment, every sum and product modulo 2**64)::

    state(k) = mix64(k ^ mix64(seed + G))
    bits(k, j) = mix64(state(k) + (j + 1) * G)
    u(k, j) = (bits(k, j) >> 11) * 2**-53              in [0, 1), 53 bits

- ``"zeros"`` or a number c: every entry is 0 or c (``Zeros``, ``Ones``, ``Constant``);
- ``RandomUniform(minval, maxval)`` (or ``"uniform"``: [-0.05, 0.05), Keras' default):
  ``minval + (maxval - minval) * u(k, j)``;
- ``RandomNormal(mean, stddev)`` (or ``"normal"``: 0, 0.05): Box-Muller on two draws,
  ``mean + stddev * sqrt(-2 ln(1 - u(k, 2j))) * cos(2 pi u(k, 2j + 1))``.

Computed in float64, then rounded to float32. The seed is the table's; an initializer's
own ``seed``, if set, replaces it. An initializer whose values depend on the table's
shape (Glorot, He, LeCun, ``VarianceScaling``, ``Orthogonal``, ``Identity``) has no
meaning for a table whose rows come and go, and is refused by name, as is any other.

Example::

    import tensorflow as tf
    from tfhybrid.dynamic.initial_rows import KeyedInitializer
    init = KeyedInitializer.of(tf.keras.initializers.RandomUniform(-1.0, 1.0), seed=3)
    a = init.rows(tf.constant([5, 9], tf.int64), 4)
    b = init.rows(tf.constant([9], tf.int64), 4)       # in another order, alone
    assert (a.numpy()[1] == b.numpy()[0]).all()
    assert KeyedInitializer.of("zeros").rows(tf.constant([5], tf.int64), 2).numpy().sum() == 0
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import tensorflow as tf

from tfhybrid import custom_ops
from tfhybrid.dynamic.keys import as_words, mix64

# splitmix64's increment (the golden ratio's 64 bits)
GOLDEN = 0x9E3779B97F4A7C15
# Keras' defaults for its random initializers
UNIFORM_DEFAULT = (-0.05, 0.05)
NORMAL_DEFAULT = (0.0, 0.05)
KINDS = ("constant", "uniform", "normal")


@dataclasses.dataclass(frozen=True)
class KeyedInitializer:
    """A dynamic table's rows as functions of (seed, key) (module docstring):
    ``kind`` is ``"constant"`` (``low`` is the value), ``"uniform"`` ([``low``, ``high``))
    or ``"normal"`` (mean ``low``, standard deviation ``high``).

    Example::

        import tensorflow as tf
        from tfhybrid.dynamic.initial_rows import KeyedInitializer
        init = KeyedInitializer.of(0.5)
        assert init.rows(tf.constant([1, 2], tf.int64), 3).numpy().tolist() == [[0.5] * 3] * 2
        assert KeyedInitializer(**init.get_config()) == init
    """
    kind: str = "constant"
    low: float = 0.0
    high: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is unknown; expected one of {KINDS}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"seed must be an int; got {self.seed!r}")
        for name in ("low", "high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
                    not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number; got {value!r}")

    @staticmethod
    def of(initializer: Any, seed: int | None = None) -> "KeyedInitializer":
        """The keyed form of ``initializer`` (``"zeros"``, ``"ones"``, ``"uniform"``,
        ``"normal"``, a number, or a Keras ``Zeros`` / ``Ones`` / ``Constant`` /
        ``RandomUniform`` / ``RandomNormal``; a ``KeyedInitializer`` as it is), with
        ``seed`` unless the initializer has its own. ``ValueError`` names any other."""
        if isinstance(initializer, KeyedInitializer):
            return initializer
        table_seed = 0 if seed is None else int(seed)
        if isinstance(initializer, numbers.Real) and not isinstance(initializer, bool):
            return KeyedInitializer("constant", float(initializer), seed=table_seed)
        names = {"zeros": ("constant", 0.0, 0.0), "ones": ("constant", 1.0, 0.0),
                 "uniform": ("uniform",) + UNIFORM_DEFAULT,
                 "normal": ("normal",) + NORMAL_DEFAULT}
        if isinstance(initializer, str) and initializer in names:
            kind, low, high = names[initializer]
            return KeyedInitializer(kind, low, high, table_seed)
        name = type(initializer).__name__
        config = initializer.get_config() if hasattr(initializer, "get_config") else None
        if config is not None:
            own = config.get("seed")
            seed_of = table_seed if own is None else int(own)
            if name == "Zeros":
                return KeyedInitializer("constant", 0.0, seed=seed_of)
            if name == "Ones":
                return KeyedInitializer("constant", 1.0, seed=seed_of)
            if name == "Constant" and isinstance(config.get("value"), numbers.Real):
                return KeyedInitializer("constant", float(config["value"]), seed=seed_of)
            if name == "RandomUniform":
                return KeyedInitializer("uniform", float(config["minval"]),
                                        float(config["maxval"]), seed_of)
            if name == "RandomNormal":
                return KeyedInitializer("normal", float(config["mean"]),
                                        float(config["stddev"]), seed_of)
        shape_bound = ("Glorot", "He", "Lecun", "LeCun", "VarianceScaling", "Orthogonal",
                       "Identity")
        why = (" (its values depend on the table's shape, which a dynamic table does not "
               "have)" if name.startswith(shape_bound) else "")
        shown = repr(initializer) if isinstance(initializer, (str, type(None))) else name
        raise ValueError(
            f"a dynamic table's initializer must make each row from its key alone; got "
            f"{shown}{why}; expected 'zeros', a number, 'uniform', 'normal', or "
            "tf.keras.initializers Zeros, Ones, Constant(value), RandomUniform or "
            "RandomNormal")

    def get_config(self) -> dict:
        return dataclasses.asdict(self)

    def rows(self, keys: tf.Tensor, dim: int, use_custom_op: bool | None = None
             ) -> tf.Tensor:
        """[len(keys), dim] float32: the initial row of each int64 key; drawn by the C++
        ``DynamicKeyedRows`` where the op library is loaded (``use_custom_op``: None),
        else (or with False) by TensorFlow ops, the formula's reference."""
        keys = tf.reshape(as_words(keys), [-1])
        if self.kind == "constant":
            return tf.fill(tf.stack([tf.size(keys), dim]), tf.constant(self.low, tf.float32))
        if use_custom_op is not False and (use_custom_op or
                                           custom_ops.custom_ops_available()):
            return custom_ops.dynamic_keyed_rows(tf.bitcast(keys, tf.int64), self.kind,
                                                 self.low, self.high, self.seed, dim)
        draws = dim if self.kind == "uniform" else 2 * dim
        u = self._uniforms(keys, draws)
        if self.kind == "uniform":
            values = self.low + (self.high - self.low) * u
        else:
            radius = tf.sqrt(-2.0 * tf.math.log1p(-u[:, 0::2]))
            values = self.low + self.high * radius * tf.cos(2.0 * math.pi * u[:, 1::2])
        return tf.cast(values, tf.float32)

    def _uniforms(self, words: tf.Tensor, draws: int) -> tf.Tensor:
        """[len(words), draws] float64: u(k, j) of the module docstring."""
        golden = tf.constant(GOLDEN, tf.uint64)
        seed_word = mix64(tf.reshape(tf.constant(self.seed % 2**64, tf.uint64) + golden,
                                     [1]))
        state = mix64(tf.bitwise.bitwise_xor(words, seed_word))
        steps = (tf.range(1, draws + 1, dtype=tf.int64))
        offsets = tf.bitcast(steps, tf.uint64) * golden
        bits = mix64(state[:, None] + offsets[None, :])
        top = tf.bitwise.right_shift(bits, tf.constant(11, tf.uint64))
        return tf.cast(top, tf.float64) * (2.0 ** -53)
