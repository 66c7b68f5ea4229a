"""The wrappers of dynamic tables' C++ ops (``cc/ops/dynamic_ops.cc``), re-exported by
``tfhybrid.custom_ops``; the library is required (``require_library``).

Example::

    import tensorflow as tf
    from tfhybrid import custom_ops
    if custom_ops.custom_ops_available():
        rows = custom_ops.dynamic_keyed_rows(tf.constant([5], tf.int64), "uniform", -1.0,
                                             1.0, seed=0, dim=4)
        assert rows.shape == (1, 4)
"""

from __future__ import annotations

import tensorflow as tf

# the package, used at call time only (it imports this module while it loads)
from tfhybrid import custom_ops


def dynamic_find_or_insert(table, keys, call, admit_after: int, evict: str, ttl: int,
                           pinned: int, insert: bool = True):
    """One call of a dynamic table's shard on int64 ``keys`` in C++ (the rules are in
    ``cc/kernels/dynamic_table_kernels.cc``): (each key's slot, -1 where not admitted;
    the slots that took a new key, whose rows and accumulators it initialized; those
    keys; with ``insert=False`` only finds, changing nothing). ``table``: a
    ``tfhybrid.dynamic.table.DynamicTable`` (its state, rows, accumulator, initializer)."""
    init, t = table.initializer, table
    return custom_ops.require_library().dynamic_find_or_insert(*[v.handle for v in (
        t.slot_keys, t.slot_seen, t.slot_count, t.index, t.cand_keys, t.cand_seen,
        t.cand_count, t.cand_index, t.counters, t.rows, t.accumulator)],
        tf.cast(keys, tf.int64), tf.cast(call, tf.int64), *_keyed(init.seed, init.low,
                                                                  init.high),
        admit_after=admit_after, evict=evict, ttl=ttl, pinned=pinned, insert=insert,
        init=init.kind)


def _keyed(seed: int, low: float, high: float) -> list:
    """A keyed initializer's op inputs: the seed's 64 bits, [low, high] in float64."""
    return [tf.bitcast(tf.constant(seed % 2**64, tf.uint64), tf.int64),
            tf.constant([low, high], tf.float64)]


def dynamic_keyed_rows(keys, kind: str, low: float, high: float, seed: int, dim: int):
    """[len(keys), dim] float32: each int64 key's initial row in C++, the formula of
    ``tfhybrid.dynamic.initial_rows`` (``kind`` ``"uniform"`` or ``"normal"``; ``low``,
    ``high`` its two numbers, in float64; ``seed`` the table's)."""
    return custom_ops.require_library().dynamic_keyed_rows(
        tf.reshape(tf.cast(keys, tf.int64), [-1]), *_keyed(seed, low, high), kind=kind,
        dim=dim)


def dynamic_held_slots(slots, lengths):
    """(the slots >= 0 of bags of ``lengths`` slots, how many each bag keeps) in C++:
    ``tfhybrid.combiners.kept_in_bags(slots, lengths, slots >= 0)`` in one pass."""
    return custom_ops.require_library().dynamic_held_slots(tf.cast(slots, tf.int32),
                                                           tf.cast(lengths, tf.int64))
