"""How a sharded table's rows are owned: which of a bag's ids a shard serves, and which
ids are valid at all. One object per sharding kind (:data:`OWNERSHIP`), asked by the
route (``sharding/route.py``: the ids each owner is sent) and by the id check
(``sharding/id_check.py``: what is a bad id), so a new way of owning rows is one new
class and one registration here, not edits through the route.

A row-wise shard owns the range ``[row_start, row_end)`` of the plan (:class:`RowRanges`);
a hash-wise shard (a dynamic table's) the keys k with ``mix64(k) mod M`` equal to its
position (:class:`KeyHashes`); every other shard (table-wise, a column slice, a replica)
all rows (:class:`AllRows`). Valid ids are ``[0, rows)``; a dynamic table's keys are
any int64.

Example::

    import tensorflow as tf
    from tfhybrid.plan.types import Kind, Shard
    from tfhybrid.sharding.ownership import ownership_of
    ids, lengths = tf.constant([1, 7, 5], tf.int64), tf.constant([2, 1], tf.int64)
    shard = Shard("t", 4, 8, 0, 2, owner=1)
    rows, counts = ownership_of(Kind.ROW_WISE).shard_ids(ids, lengths, shard, 2)
    assert rows.numpy().tolist() == [3, 1] and counts.numpy().tolist() == [1, 1]
    assert ownership_of(Kind.TABLE_WISE).id_range(10) == (0, 9)
"""

from __future__ import annotations

from typing import Any, Protocol

import tensorflow as tf

from tfhybrid.combiners import kept_in_bags
from tfhybrid.dynamic.keys import owner_of
from tfhybrid.plan.types import Kind

# every int64 is a key of a dynamic table
_ANY_KEY = (-2**63, 2**63 - 1)


class Ownership(Protocol):
    """What the route, the id check and the stores ask of a sharding kind."""

    # whether the kind's shards split a table's rows between them (each id goes to one
    # shard: fewer ids per shard, a row-wise norm sees part of the table, a custom
    # layer cannot serve part of a row range)
    splits_rows: bool

    def shard_ids(self, ids: tf.Tensor, lengths: tf.Tensor, shard: Any, positions: int,
                  weights: tf.Tensor | None = None) -> tuple:
        """Of a feature's bags (``ids``, bag ``lengths``), the ids that ``shard`` (with
        ``row_start``, ``row_end`` and ``owner``, its position in a model group of
        ``positions``) serves, as the ids its store takes, and how many each bag has;
        with per-id ``weights``, also theirs (a third value)."""

    def id_range(self, rows: int) -> tuple[int, int]:
        """The first and last valid id of a table of ``rows`` rows."""


class AllRows:
    """A shard that serves every row of its table (table-wise, a column slice, a
    data-parallel replica): every id, as it is.

    Example::

        import tensorflow as tf
        from tfhybrid.plan.types import Shard
        from tfhybrid.sharding.ownership import AllRows
        ids = tf.constant([3, 0], tf.int64)
        assert AllRows().shard_ids(ids, tf.constant([2]), Shard("t", 0, 4, 0, 2, 0), 1)[0] is ids
    """

    splits_rows = False

    def shard_ids(self, ids: tf.Tensor, lengths: tf.Tensor, shard: Any, positions: int,
                  weights: tf.Tensor | None = None) -> tuple:
        del shard, positions
        return (ids, lengths) if weights is None else (ids, lengths, weights)

    def id_range(self, rows: int) -> tuple[int, int]:
        return 0, rows - 1


class RowRanges(AllRows):
    """A row-wise shard serves the ids in its rows ``[row_start, row_end)``, as rows of
    the shard (id - row_start).

    Example::

        import tensorflow as tf
        from tfhybrid.plan.types import Shard
        from tfhybrid.sharding.ownership import RowRanges
        rows, counts = RowRanges().shard_ids(tf.constant([0, 5, 6], tf.int64),
                                             tf.constant([3], tf.int64),
                                             Shard("t", 5, 10, 0, 2, 1), 2)
        assert rows.numpy().tolist() == [0, 1] and counts.numpy().tolist() == [2]
    """

    splits_rows = True

    def shard_ids(self, ids: tf.Tensor, lengths: tf.Tensor, shard: Any, positions: int,
                  weights: tf.Tensor | None = None) -> tuple:
        del positions
        kept = kept_in_bags(ids, lengths, tf.logical_and(ids >= shard.row_start,
                                                         ids < shard.row_end), weights)
        return (kept[0] - shard.row_start,) + tuple(kept[1:])


class KeyHashes(AllRows):
    """A hash-wise shard (a dynamic table's, on position p of M) serves the keys with
    ``mix64(k) mod M == p`` (``tfhybrid.dynamic.keys.owner_of``), as they are: its store
    finds their slots. Every int64 is a valid key.

    Example::

        import tensorflow as tf
        from tfhybrid.dynamic.keys import owner_of
        from tfhybrid.plan.types import Shard
        from tfhybrid.sharding.ownership import KeyHashes
        keys = tf.constant([10, -3, 2**62], tf.int64)
        mine, counts = KeyHashes().shard_ids(keys, tf.constant([3]),
                                             Shard("t", 0, 8, 0, 2, 1), 2)
        assert mine.numpy().tolist() == [k for k, p in zip(keys.numpy(),
                                         owner_of(keys, 2).numpy()) if p == 1]
    """

    splits_rows = True

    def shard_ids(self, ids: tf.Tensor, lengths: tf.Tensor, shard: Any, positions: int,
                  weights: tf.Tensor | None = None) -> tuple:
        if positions == 1:
            return super().shard_ids(ids, tf.cast(lengths, tf.int64), shard, positions,
                                     weights)
        return kept_in_bags(ids, lengths, tf.equal(owner_of(ids, positions), shard.owner),
                            weights)

    def id_range(self, rows: int) -> tuple[int, int]:
        del rows
        return _ANY_KEY


# each sharding kind's way of owning rows
OWNERSHIP: dict[str, Ownership] = {Kind.TABLE_WISE: AllRows(), Kind.COLUMN_WISE: AllRows(),
                                   Kind.DATA_PARALLEL: AllRows(), Kind.ROW_WISE: RowRanges(),
                                   Kind.HASH_WISE: KeyHashes()}


def ownership_of(kind: str) -> Ownership:
    """How shards of ``kind`` own rows; ``ValueError`` naming an unknown kind."""
    if kind not in OWNERSHIP:
        raise ValueError(f"sharding kind {kind!r} has no way of owning rows; expected one "
                         f"of {sorted(OWNERSHIP)}")
    return OWNERSHIP[kind]
