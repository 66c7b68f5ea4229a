"""IntegerLookup: raw int64 categories -> contiguous embedding rows, vocabulary built on the fly."""

from __future__ import annotations

import logging
import operator
from typing import Any

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals

__all__ = ["IntegerLookup"]

_LOG = logging.getLogger(__name__)

OOV_TOKEN = -1
OOV_INDEX = 0
# DenseHashTable reserves two keys; the extremes of int64 are the categories least likely
# to be real (distributed-embeddings reserves -2 and -3 and fails on them).
_EMPTY_KEY = np.iinfo(np.int64).min
_DELETED_KEY = np.iinfo(np.int64).min + 1


class IntegerLookup(tf.keras.layers.Layer):
    """Maps integer categories to contiguous indices, growing the vocabulary as it goes.

    The vocabulary starts empty. Each call looks its keys up; keys not yet in the
    vocabulary are added, in order of first appearance in the (row-major flattened)
    batch, and get the next free indices 1, 2, ... until ``max_tokens`` keys are held.
    After that, unseen keys map to the out-of-vocabulary index 0. The OOV token ``-1``
    always maps to 0 and is never added. Output: int64, the shape of the input (dense,
    ``tf.RaggedTensor`` or ``tf.SparseTensor``). So the indices are rows of an embedding
    table with ``capacity = max_tokens + 1`` rows, row 0 shared by every OOV key.

    This is distributed-embeddings' ``IntegerLookup``: the same mapping as its CPU path,
    and, like its GPU path, ``use_gpu=True`` also keeps ``count``: how often each index
    was returned (``count[0]`` starts at 1, the reserved OOV row). tfhybrid has no GPU
    hash table, so both run on the CPU (an INFO line says so for ``use_gpu=True``); the
    mapping is deterministic, where distributed-embeddings' GPU path may assign indices
    in a different order.

    ``get_vocabulary()`` returns ``[-1, key_at_1, key_at_2, ...]``: the layout of
    ``tf.keras.layers.IntegerLookup(vocabulary=...).get_vocabulary()``, so
    ``tf.keras.layers.IntegerLookup(vocabulary=layer.get_vocabulary()[1:])`` maps every key
    as this layer now does. The table is tracked, so ``tf.train.Checkpoint`` saves it.

    Args:
      max_tokens: how many keys the vocabulary may hold (indices ``1..max_tokens``).
      use_gpu: keep per-index frequency counts in ``count`` (int64), as
        distributed-embeddings' GPU path does.

    Example::

        import tensorflow as tf
        from tfhybrid.layers import IntegerLookup
        lookup = IntegerLookup(max_tokens=3)
        lookup(tf.constant([12, 36, 12], tf.int64))            # adds 12 -> 1, 36 -> 2
        out = lookup(tf.constant([[36, 7], [99, -1]], tf.int64))  # 7 -> 3; 99 is OOV
        assert out.numpy().tolist() == [[2, 3], [0, 0]]
        assert lookup.get_vocabulary() == [-1, 12, 36, 7]
    """

    def __init__(self, max_tokens: int, use_gpu: bool = True, **kwargs: Any):
        _tf_internals.install_autograph_rule()
        kwargs.setdefault("dtype", tf.int64)
        # Ids must never be autocast to a float compute dtype.
        kwargs["autocast"] = False
        super().__init__(**kwargs)
        try:
            max_tokens = operator.index(max_tokens)  # ints, numpy ints, int scalar tensors
        except TypeError:
            raise ValueError(f"max_tokens={max_tokens!r}; expected a non-negative integer") \
                from None
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens!r}; expected a non-negative integer")
        if not isinstance(use_gpu, bool):
            raise ValueError(f"use_gpu={use_gpu!r}; expected True or False")
        self.max_tokens = int(max_tokens)
        self.capacity = self.max_tokens + 1
        self.use_gpu = use_gpu
        self.table = None
        self.count = None
        if use_gpu:
            _LOG.info("IntegerLookup %r: tfhybrid has no GPU hash table; use_gpu=True runs "
                      "the CPU table (same mapping) and keeps frequency counts", self.name)

    def build(self, input_shape=None):
        # The table outlives the call that builds it (Keras 2 builds under init_scope,
        # Keras 3 inside a tf.function's graph when first called there)
        with tf.init_scope(), tf.device("/CPU:0"):
            # Keys map to 1..max_tokens; absent keys to the default, the OOV index.
            self.table = tf.lookup.experimental.DenseHashTable(
                key_dtype=tf.int64, value_dtype=tf.int64, default_value=OOV_INDEX,
                empty_key=_EMPTY_KEY, deleted_key=_DELETED_KEY, name="vocabulary")
            if self.use_gpu:
                # Index 0 starts at 1: the OOV row is reserved, as in distributed-embeddings.
                initial = np.zeros([self.capacity], np.int64)
                initial[OOV_INDEX] = 1
                self.count = tf.Variable(initial, trainable=False, name="count")
        self.built = True

    def call(self, inputs):
        if isinstance(inputs, tf.RaggedTensor):
            return inputs.with_flat_values(self._lookup(inputs.flat_values))
        if isinstance(inputs, tf.SparseTensor):
            return tf.SparseTensor(inputs.indices, self._lookup(inputs.values),
                                   inputs.dense_shape)
        keys = tf.convert_to_tensor(inputs)
        return tf.reshape(self._lookup(tf.reshape(keys, [-1])), tf.shape(keys))

    def _lookup(self, keys):
        """[N] keys -> [N] int64 indices, adding unseen keys while there is room."""
        if not keys.dtype.is_integer:
            raise ValueError(f"IntegerLookup {self.name!r}: keys must be integers; got "
                             f"{keys.dtype.name}")
        with tf.device("/CPU:0"):
            keys = tf.cast(keys, tf.int64)
            # The table's reserved keys cannot be looked up: treat them as the OOV token.
            keys = tf.where((keys == _EMPTY_KEY) | (keys == _DELETED_KEY),
                            tf.constant(OOV_TOKEN, tf.int64), keys)
            if self.max_tokens > 0:
                self._insert_new(keys)
            values = self._find(keys)
            if self.count is not None:
                self.count.scatter_add(tf.IndexedSlices(tf.ones_like(values), values))
            return values

    def _find(self, keys):
        values = self.table.lookup(keys)
        values.set_shape(keys.shape)  # a traced DenseHashTable lookup has no static shape
        return values

    def _insert_new(self, keys):
        unique, _ = tf.unique(keys)  # first-appearance order
        unseen = tf.logical_and(self._find(unique) == OOV_INDEX, unique != OOV_TOKEN)
        held = self.table.size()
        room = tf.maximum(tf.constant(self.max_tokens, tf.int64) - held, 0)
        new_keys = tf.boolean_mask(unique, unseen)[:room]
        num_new = tf.size(new_keys, out_type=tf.int64)
        self.table.insert(new_keys, tf.range(held + 1, held + 1 + num_new))

    @property
    def num_empty_slot(self) -> int:
        """How many more keys the vocabulary can take."""
        held = 0 if self.table is None else int(self.table.size())
        return self.max_tokens - held

    def get_vocabulary(self) -> list[int]:
        """``[-1] + keys`` in index order: entry ``i`` is the key that maps to index ``i``."""
        if self.table is None:
            return [OOV_TOKEN]
        with tf.device("/CPU:0"):
            keys, values = self.table.export()
        keys, values = keys.numpy(), values.numpy()
        used = (keys != _EMPTY_KEY) & (keys != _DELETED_KEY)
        keys, values = keys[used], values[used]
        return [OOV_TOKEN] + keys[np.argsort(values, kind="stable")].tolist()

    def compute_output_shape(self, input_shape):
        return tf.TensorShape(input_shape)

    def get_config(self) -> dict:
        return dict(super().get_config(), max_tokens=self.max_tokens, use_gpu=self.use_gpu)
