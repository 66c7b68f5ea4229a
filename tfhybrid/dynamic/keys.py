"""Keys of a dynamic table: 64-bit values, the position that owns each, string keys.

A key is any int64, negative ones included (read as its 64 bits, two's complement).

- ``mix64(k)``, the one 64-bit mixer: splitmix64's finalizer, on unsigned 64-bit words
  (every product modulo 2**64)::

      z = k
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
      z = (z ^ (z >> 27)) * 0x94D049BB133111EB
      z = z ^ (z >> 31)

  Each step is invertible, so ``mix64`` is a bijection: distinct keys never share a
  mixed value, and nearby keys (1, 2, 3, ...) spread over all 64 bits.
- ``owner_of(k, M) = mix64(k) mod M`` (unsigned): the position, inside each model group
  of M ranks, whose shard holds key k.
- ``string_keys(s)``: a string's key is TensorFlow's 64-bit FarmHash fingerprint
  (``tf.fingerprint``, the ``Fingerprint64`` of ``tf.strings.to_hash_bucket_fast``), its
  8 bytes read as a little-endian int64. Two distinct strings share a key with
  probability 2**-64, so among n distinct strings some pair does with probability about
  n**2 / 2**65: 3e-8 for a million strings, 0.03 for a billion. Strings that share a key
  share one row.

Example::

    import tensorflow as tf
    from tfhybrid.dynamic.keys import mix64, owner_of, string_keys
    assert int(mix64(tf.constant([1], tf.int64))[0]) == 0x5692161D100B05E5
    assert owner_of(tf.constant([1], tf.int64), 4).numpy().tolist() == [1]
    assert string_keys(tf.constant(["a", "a", "b"])).numpy()[0] == \\
        string_keys(tf.constant(["a"])).numpy()[0]
"""

from __future__ import annotations

import tensorflow as tf

# splitmix64's finalizer: its shifts and odd multipliers
_MIX_STEPS = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB))
_LAST_SHIFT = 31


def as_words(keys: tf.Tensor) -> tf.Tensor:
    """int64 (or uint64) ``keys`` as unsigned 64-bit words, bit for bit."""
    keys = tf.convert_to_tensor(keys)
    if keys.dtype == tf.uint64:
        return keys
    if keys.dtype != tf.int64:
        raise ValueError(f"dynamic-table keys must be int64 (or strings, through "
                         f"string_keys); got {keys.dtype.name}")
    return tf.bitcast(keys, tf.uint64)


def mix64(keys: tf.Tensor) -> tf.Tensor:
    """splitmix64's finalizer of each key's 64 bits (module docstring), as uint64."""
    z = as_words(keys)
    for shift, multiplier in _MIX_STEPS:
        z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(shift, tf.uint64)))
        z = z * tf.constant(multiplier, tf.uint64)
    return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(_LAST_SHIFT,
                                                                           tf.uint64)))


def owner_of(keys: tf.Tensor, positions: int) -> tf.Tensor:
    """The position (int32) of a model group of ``positions`` ranks that owns each key:
    ``mix64(key) mod positions``."""
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(f"positions must be an int >= 1 (the model group's size); got "
                         f"{positions!r}")
    owners = tf.math.floormod(mix64(keys), tf.constant(positions, tf.uint64))
    return tf.cast(owners, tf.int32)


def string_keys(strings: tf.Tensor) -> tf.Tensor:
    """The int64 key of each string: its 64-bit FarmHash fingerprint (module docstring)."""
    strings = tf.convert_to_tensor(strings)
    if strings.dtype != tf.string:
        raise ValueError(f"string_keys takes strings; got {strings.dtype.name}")
    flat = tf.reshape(strings, [-1])
    # tf.fingerprint gives 8 bytes per string, little-endian
    keys = tf.bitcast(tf.fingerprint(flat), tf.int64)
    return tf.reshape(keys, tf.shape(strings))


def as_keys(values: tf.Tensor, key_dtype: str, owner: str) -> tf.Tensor:
    """``values`` as int64 keys: strings (``key_dtype="string"``) as their fingerprints
    (:func:`string_keys`), integers as they are; ``ValueError`` names ``owner`` (the
    layer or feature) and a dtype it does not take."""
    if key_dtype == "string":
        if values.dtype != tf.string:
            raise ValueError(f"{owner} takes string keys (key_dtype=tf.string), got "
                             f"{values.dtype.name}")
        return string_keys(values)
    if not values.dtype.is_integer:
        raise ValueError(f"{owner} takes integer ids, got {values.dtype.name}")
    return tf.cast(values, tf.int64)
