"""How a sharded table's rows are owned: which of a bag's ids a shard serves, and which
ids are valid at all. One object per sharding kind (:data:`OWNERSHIP`), asked by the
route (``sharding/route.py``: the ids each owner is sent) and by the id check
(``sharding/id_check.py``: what is a bad id), so a new way of owning rows (a hash of the
key, say) is one new class and one registration here, not edits through the route.

Today every kind owns rows by position: a row-wise shard the range
``[row_start, row_end)`` of the plan (:class:`RowRanges`), every other shard (table-wise,
a column slice, a replica) all rows (:class:`AllRows`); valid ids are ``[0, rows)``.

Example::

    import tensorflow as tf
    from tfhybrid.plan.types import Kind
    from tfhybrid.sharding.ownership import ownership_of
    ids, lengths = tf.constant([1, 7, 5], tf.int64), tf.constant([2, 1], tf.int64)
    rows, counts = ownership_of(Kind.ROW_WISE).shard_ids(ids, lengths, 4, 8)
    assert rows.numpy().tolist() == [3, 1] and counts.numpy().tolist() == [1, 1]
    assert ownership_of(Kind.TABLE_WISE).id_bound(10) == 10
"""

from __future__ import annotations

from typing import Protocol

import tensorflow as tf

from tfhybrid.plan.types import Kind


class Ownership(Protocol):
    """What the route, the id check and the stores ask of a sharding kind."""

    # whether the kind's shards split a table's rows between them (each id goes to one
    # shard: fewer ids per shard, a row-wise norm sees part of the table, a custom
    # layer cannot serve part of a row range)
    splits_rows: bool

    def shard_ids(self, ids: tf.Tensor, lengths: tf.Tensor, row_start: int, row_end: int
                  ) -> tuple[tf.Tensor, tf.Tensor]:
        """Of a feature's bags (``ids``, bag ``lengths``), the ids the shard of rows
        ``[row_start, row_end)`` serves, as its own row indices, and how many of them
        each bag has."""

    def id_bound(self, rows: int) -> int:
        """Ids of a table of ``rows`` rows are valid in ``[0, id_bound)``."""


class AllRows:
    """A shard that serves every row of its table (table-wise, a column slice, a
    data-parallel replica): every id, as it is.

    Example::

        import tensorflow as tf
        from tfhybrid.sharding.ownership import AllRows
        ids = tf.constant([3, 0], tf.int64)
        assert AllRows().shard_ids(ids, tf.constant([2]), 0, 4)[0] is ids
    """

    splits_rows = False

    def shard_ids(self, ids: tf.Tensor, lengths: tf.Tensor, row_start: int, row_end: int
                  ) -> tuple[tf.Tensor, tf.Tensor]:
        del row_start, row_end
        return ids, lengths

    def id_bound(self, rows: int) -> int:
        return rows


class RowRanges(AllRows):
    """A row-wise shard serves the ids in its rows ``[row_start, row_end)``, as rows of
    the shard (id - row_start).

    Example::

        import tensorflow as tf
        from tfhybrid.sharding.ownership import RowRanges
        rows, counts = RowRanges().shard_ids(tf.constant([0, 5, 6], tf.int64),
                                             tf.constant([3], tf.int64), 5, 10)
        assert rows.numpy().tolist() == [0, 1] and counts.numpy().tolist() == [2]
    """

    splits_rows = True

    def shard_ids(self, ids: tf.Tensor, lengths: tf.Tensor, row_start: int, row_end: int
                  ) -> tuple[tf.Tensor, tf.Tensor]:
        inside = tf.logical_and(ids >= row_start, ids < row_end)
        # a bag's count is the difference of the running count of inside ids at its two
        # ends: a third of the ops of tf.repeat + a segment sum, built at every trace
        lengths = tf.cast(lengths, tf.int64)
        inside_before = tf.concat([tf.zeros([1], tf.int64),
                                   tf.cumsum(tf.cast(inside, tf.int64))], 0)
        ends = tf.cumsum(lengths)
        counts = tf.gather(inside_before, ends) - tf.gather(inside_before, ends - lengths)
        return tf.gather(ids, tf.reshape(tf.where(inside), [-1])) - row_start, counts


# each sharding kind's way of owning rows
OWNERSHIP: dict[str, Ownership] = {Kind.TABLE_WISE: AllRows(), Kind.COLUMN_WISE: AllRows(),
                                   Kind.DATA_PARALLEL: AllRows(), Kind.ROW_WISE: RowRanges()}


def ownership_of(kind: str) -> Ownership:
    """How shards of ``kind`` own rows; ``ValueError`` naming an unknown kind."""
    if kind not in OWNERSHIP:
        raise ValueError(f"sharding kind {kind!r} has no way of owning rows; expected one "
                         f"of {sorted(OWNERSHIP)}")
    return OWNERSHIP[kind]
