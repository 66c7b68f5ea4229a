"""``DynamicEmbedding``: an embedding layer for open-world keys, in one process.

Keys are raw int64 values (negative ones included) or strings (their 64-bit fingerprint,
``tfhybrid.dynamic.keys``); no vocabulary pass maps them to rows first. The layer holds a
``tfhybrid.dynamic.table.DynamicTable`` of ``capacity`` rows.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid.dynamic.initial_rows import KeyedInitializer
from tfhybrid.dynamic.keys import as_keys
from tfhybrid.dynamic.table import EVICTION, DynamicTable, checked_default_row
from tfhybrid.plan.types import COMBINERS
KEY_DTYPES = ("int64", "string")


class DynamicEmbedding(tf.keras.layers.Layer):
    """Embeddings of open-world keys: a key gets a row of ``capacity`` when it has been
    seen ``admit_after`` times in training, starting from a row made of the key and
    ``seed`` alone (``initializer``: ``"zeros"``, a number, ``"uniform"``, ``"normal"``,
    Keras' ``RandomUniform`` / ``RandomNormal`` / ``Constant``); when the table is full,
    ``evict`` (``"lfu"``, ``"lru"``) frees the row of a key not seen in this step (its
    optimizer state goes with it), and ``evict=None`` refuses new keys. ``ttl_steps``
    frees rows unseen for that many training steps. A key without a row reads zeros and
    trains nothing (``default_row``: a number or ``output_dim`` numbers it reads instead
    of zeros). ``use_custom_kernel=True`` runs the C++ find-or-insert where the op
    library is built (else its NumPy twin, the same slots); ``False`` always the twin.

    Inputs as ``tfhybrid.layers.Embedding``'s: with ``combiner=None`` a row per key
    (dense ids of shape ``S`` give ``S + [output_dim]``, ragged ids a ragged result);
    with ``"sum"`` or ``"mean"`` the last dimension's keys are combined (a dense
    ``[batch]`` is one key per sample; ragged and sparse ``[batch, None]`` give
    ``[batch, output_dim]``; an empty bag gives zeros). ``key_dtype``: ``tf.int64`` or
    ``tf.string``. Keys are admitted only in training: a call with ``training=False``
    finds keys without changing the table. Train it with
    :class:`tfhybrid.optimizers.RowWiseAdagrad` (its accumulator is the table's own, reset
    with each new key) or SGD without momentum; other optimizers are refused by name.

    Example::

        import tensorflow as tf
        from tfhybrid.layers import DynamicEmbedding
        layer = DynamicEmbedding(4, capacity=100, combiner="sum", initializer=1.0)
        out = layer(tf.constant([[2**40, -5], [7, 7]], tf.int64))
        assert out.numpy().tolist() == [[2.0] * 4, [2.0] * 4]
        assert layer.table_stats()["size"] == 3
        names = DynamicEmbedding(2, capacity=10, key_dtype=tf.string)
        assert names(tf.constant(["user:1", "user:2"])).shape == (2, 2)
    """

    def __init__(self, output_dim: int, capacity: int, combiner: str | None = None,
                 key_dtype: Any = tf.int64, initializer: Any = "uniform", seed: int = 0,
                 admit_after: int = 1, evict: str | None = "lfu",
                 ttl_steps: int | None = None, use_custom_kernel: bool = True,
                 default_row: Any = None, **kwargs: Any):
        _tf_internals.install_autograph_rule()
        if combiner not in COMBINERS:
            raise ValueError(f"combiner={combiner!r} is unknown; expected one of {COMBINERS}")
        key_name = tf.as_dtype(key_dtype).name if not isinstance(key_dtype, str) else key_dtype
        if key_name not in KEY_DTYPES:
            raise ValueError(f"key_dtype={key_dtype!r} is unsupported; expected tf.int64 or "
                             "tf.string")
        if evict not in EVICTION:
            raise ValueError(f"evict={evict!r} is unknown; expected one of {EVICTION}")
        if not isinstance(use_custom_kernel, bool):
            raise ValueError(f"use_custom_kernel={use_custom_kernel!r}; expected True or False")
        super().__init__(**kwargs)
        # Keras 3: its C++ find-or-insert cannot be compiled, so fit's jit_compile="auto"
        # must not compile the model around it
        self.supports_jit = False
        # checked now, so that a bad value fails at construction
        self.keyed_initializer = KeyedInitializer.of(initializer, seed)
        for name, value, low in (("output_dim", output_dim, 1), ("capacity", capacity, 1),
                                 ("admit_after", admit_after, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if ttl_steps is not None and (isinstance(ttl_steps, bool)
                                      or not isinstance(ttl_steps, int) or ttl_steps < 1):
            raise ValueError(f"ttl_steps must be None or an int >= 1, got {ttl_steps!r}")
        self.default_row = checked_default_row(default_row, output_dim)
        self.output_dim = output_dim
        self.capacity = capacity
        self.combiner = combiner
        self.key_dtype = key_name
        self.seed = int(seed)
        self.admit_after = admit_after
        self.evict = evict
        self.ttl_steps = ttl_steps
        self.use_custom_kernel = use_custom_kernel
        self.table: DynamicTable | None = None

    def build(self, input_shape=None):
        self.table = DynamicTable(
            self.capacity, self.output_dim, initializer=self.keyed_initializer,
            seed=self.seed, admit_after=self.admit_after, evict=self.evict,
            ttl_steps=self.ttl_steps, name="table", add_weight=self.add_weight,
            use_custom_op=None if self.use_custom_kernel else False,
            default_row=self.default_row)
        self.built = True

    def call(self, inputs, training=None):
        keys = inputs
        if isinstance(keys, tf.SparseTensor):
            if self.combiner is None:
                raise ValueError(f"DynamicEmbedding {self.name!r}: a SparseTensor needs a "
                                 "combiner")
            counts = tf.math.bincount(tf.cast(keys.indices[:, 0], tf.int32),
                                      minlength=tf.cast(keys.dense_shape[0], tf.int32),
                                      dtype=tf.int64)
            order = tf.argsort(keys.indices[:, 0], stable=True)
            return self._bags(tf.gather(keys.values, order), counts, training)
        if isinstance(keys, tf.RaggedTensor):
            if self.combiner is None:
                return keys.with_flat_values(self._rows(keys.flat_values, training))
            if keys.ragged_rank != 1:
                raise ValueError(f"DynamicEmbedding {self.name!r}: ragged keys with a "
                                 f"combiner must be [batch, None], got {keys.shape}")
            return self._bags(keys.flat_values, keys.row_lengths(), training)
        keys = tf.convert_to_tensor(keys)
        if self.combiner is None or keys.shape.rank == 1:
            return self._rows(keys, training)
        flat = tf.reshape(keys, [-1])
        per_bag = tf.shape(keys, out_type=tf.int64)[-1]
        bags = tf.size(flat, out_type=tf.int64) // tf.maximum(per_bag, 1)
        combined = self._bags(flat, tf.fill([bags], per_bag), training)
        return tf.reshape(combined, tf.concat([tf.shape(keys)[:-1], [self.output_dim]], 0))

    def _keys(self, values: tf.Tensor) -> tf.Tensor:
        return as_keys(values, self.key_dtype, f"DynamicEmbedding {self.name!r}")

    def _slots(self, values: tf.Tensor, training) -> tf.Tensor:
        return self.table.slots(self._keys(values), insert=training is not False)

    def _rows(self, values: tf.Tensor, training) -> tf.Tensor:
        """One row per key, in the keys' shape plus ``[output_dim]``."""
        flat = tf.reshape(values, [-1])
        rows = self.table.lookup(self._slots(flat, training),
                                 tf.ones(tf.shape(flat), tf.int64))
        return tf.reshape(rows, tf.concat([tf.shape(values), [self.output_dim]], 0))

    def _bags(self, values: tf.Tensor, lengths: tf.Tensor, training) -> tf.Tensor:
        return self.table.lookup(self._slots(values, training), lengths, self.combiner)

    def compute_output_shape(self, input_shape):
        shape = tf.TensorShape(input_shape)
        if self.combiner is not None and shape.rank and shape.rank > 1:
            shape = shape[:-1]
        return shape.concatenate([self.output_dim])

    def table_stats(self) -> dict:
        """The table's counters (``DynamicTable.stats``): size, capacity, admissions,
        evictions, refusals, hits, misses, hit rate."""
        if self.table is None:
            raise ValueError(f"DynamicEmbedding {self.name!r}.table_stats() needs the layer "
                             "built: call it on a batch of keys first")
        return self.table.stats()

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(output_dim=self.output_dim, capacity=self.capacity,
                      combiner=self.combiner, key_dtype=self.key_dtype,
                      initializer=self.keyed_initializer.get_config(), seed=self.seed,
                      admit_after=self.admit_after, evict=self.evict,
                      ttl_steps=self.ttl_steps, use_custom_kernel=self.use_custom_kernel,
                      default_row=None if self.default_row is None
                      else list(self.default_row))
        return config

    @classmethod
    def from_config(cls, config: dict) -> "DynamicEmbedding":
        config = dict(config)
        initializer = config.pop("initializer")
        if isinstance(initializer, dict):
            initializer = KeyedInitializer(**initializer)
        return cls(initializer=initializer, **config)
