"""Dynamic tables: open-world keys (any int64, or strings), rows made from the key.

- ``keys``: the one 64-bit mixer (``mix64``), a key's owner inside a model group
  (``owner_of``) and string keys (``string_keys``);
- ``initial_rows``: a new row as a function of (table seed, key) only
  (``KeyedInitializer``).

Example::

    import tensorflow as tf
    from tfhybrid.dynamic import KeyedInitializer, owner_of
    keys = tf.constant([7, -3, 2**62], tf.int64)
    assert owner_of(keys, 4).shape == (3,)
    rows = KeyedInitializer.of("uniform", seed=1).rows(keys, 8)
    assert rows.shape == (3, 8)
"""

from tfhybrid.dynamic.initial_rows import KeyedInitializer
from tfhybrid.dynamic.keys import mix64, owner_of, string_keys

__all__ = ["KeyedInitializer", "mix64", "owner_of", "string_keys"]
