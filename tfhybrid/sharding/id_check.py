"""The route's id check: ids in range, batch sizes and hotness alike, inputs supported.

Each rank builds its row of the check alone (:meth:`IdCheck.report`, a stage of
``EmbeddingRoute.prepare``); one allgather gives every rank every row, and every rank
derives the same ``(holds, message)`` checks from them (:meth:`IdCheck.checks`, in
``EmbeddingRoute.exchange``). So bad input on one rank fails on every rank at once, with
the table, the id and the rank named, and no rank is left waiting in a collective.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid.sharding import phases
from tfhybrid.sharding.ownership import ownership_of
from tfhybrid.sharding.tables import TableSpec

# per feature in a rank's id report: bad id?, the first bad id, bad input?, bags per
# sample, bad weights?
REPORT_FIELDS = 5


class IdCheck:
    """The id check of one DistributedEmbedding on one rank (module docstring).

    ``kinds``: each table's sharding kind, whose way of owning rows says which ids are
    valid (``sharding/ownership.py``). ``bags`` are the route's: per fed feature, an
    object with ``values`` (ids), ``per_sample`` (bags per sample) and ``unsupported``
    (a bool, or a bool tensor).

    In one process, as in the example, the check gathers only this rank's row.

    Example::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding
        tfhybrid.init(model_parallel=1)
        layer = DistributedEmbedding([tf.keras.layers.Embedding(10, 4)])
        layer([tf.constant([1, 2])])
        bags, batch, invalid = layer.route.bags_of([tf.constant([3, 12])])
        report = layer.route.id_check.report(bags, batch, invalid)
        checks, _ = layer.route.id_check.checks(report, (), read_ahead=False)
        assert [bool(holds) for holds, _ in checks] == [True, False, True, True, True]
    """

    def __init__(self, name: str, mesh: mesh_lib.Mesh, tables: Sequence[TableSpec],
                 input_table_map: Sequence[int], dp_input: bool, kinds: Sequence[str]):
        self.name = name
        self.mesh = mesh
        self.tables = list(tables)
        self.input_table_map = list(input_table_map)
        self.dp_input = dp_input
        # each table's first and last valid id, as its sharding kind owns rows
        self.id_ranges = [ownership_of(kind).id_range(t.rows)
                          for kind, t in zip(kinds, self.tables)]

    def report(self, bags: dict, batch, invalid: dict, ended=None) -> tf.Tensor:
        """This rank's row of the check (:meth:`checks`): [batch, (bad?, first
        bad id, bad input?, bags per sample, bad weights?) per feature] (zeros for a
        feature it does not feed), and with ``ended`` (``TrainPipeline``'s read-ahead)
        whether its input has ended.

        Every fed feature's ids are checked at once, as one list with each id's feature
        beside it: a trace then holds a few ops for all features, not a dozen per feature
        (a step's graph is built on every rank, and this check was most of the layer's).
        The ids are those given, ids of weight <= 0 that a weighted mean drops included:
        a bad id is bad input whatever its weight.
        """
        num_features = len(self.input_table_map)
        fed = [f for f in range(num_features) if f in bags]
        head = [tf.reshape(tf.cast(batch, tf.int64), [1])]
        tail = [] if ended is None else [tf.reshape(tf.cast(ended, tf.int64), [1])]
        if not fed:
            return tf.reshape(tf.concat(
                head + [tf.zeros([num_features * REPORT_FIELDS], tf.int64)] + tail, 0), [1, -1])
        given = [bags[f].values if bags[f].given_values is None else bags[f].given_values
                 for f in fed]
        values = tf.concat([tf.cast(v, tf.int64) for v in given], 0)
        sizes = tf.stack([tf.size(v, out_type=tf.int64) for v in given])
        total = tf.size(values, out_type=tf.int64)
        places = tf.range(total)
        # each id's feature: how many features end at or before its place (a dozen ops,
        # where tf.repeat builds a hundred)
        feature_of = tf.reshape(tf.raw_ops.UpperBound(
            sorted_inputs=tf.reshape(tf.cumsum(sizes), [1, -1]),
            values=tf.reshape(places, [1, -1]), out_type=tf.int64), [-1])
        first, last = zip(*[self.id_ranges[self.input_table_map[f]] for f in fed])
        bad = tf.logical_or(values < tf.gather(tf.constant(first, tf.int64), feature_of),
                            values > tf.gather(tf.constant(last, tf.int64), feature_of))
        # each feature's first bad id, by its place in the list (past the end: none; the
        # list is padded with one good id there, so an empty list has an element too)
        first_place = tf.math.unsorted_segment_min(
            tf.where(bad, places, total), feature_of, len(fed))
        first_place = tf.minimum(first_place, total)   # a feature without ids: past the end
        any_bad = first_place < total
        first_bad = tf.where(any_bad, tf.gather(tf.concat([values, [0]], 0), first_place),
                             tf.zeros([], tf.int64))

        def scalars(items: list) -> tf.Tensor:
            # one constant when every item is known now, else one stacked tensor
            if not any(tf.is_tensor(x) for x in items):
                return tf.constant([int(x) for x in items], tf.int64)
            return tf.stack([tf.cast(x, tf.int64) for x in items])

        bad_input = scalars([tf.logical_or(bool(invalid.get(f)), bags[f].unsupported)
                             if tf.is_tensor(bags[f].unsupported)
                             else bool(invalid.get(f)) or bool(bags[f].unsupported)
                             for f in fed])
        per_sample = scalars([bags[f].per_sample for f in fed])
        bad_weights = scalars([bags[f].bad_weights for f in fed])
        rows = tf.stack([tf.cast(any_bad, tf.int64), first_bad, bad_input, per_sample,
                         bad_weights], 1)
        if len(fed) < num_features:   # zeros for the features this rank does not feed
            rows = tf.scatter_nd(tf.constant(fed, tf.int64)[:, None], rows,
                                 [num_features, REPORT_FIELDS])
        return tf.reshape(tf.concat(head + [tf.reshape(rows, [-1])] + tail, 0), [1, -1])

    def checks(self, report: tf.Tensor, reasons: tuple, read_ahead: bool
               ) -> tuple[list, Any]:
        """Checks that every id is in range, every weight finite and one per id, and
        every rank has the same batch size (and, with ``dp_input=True``, the same bags per
        sample: an owner reads every rank's ids by its own).

        After one allgather of every rank's :meth:`report` every rank holds the same
        ``(holds, message)`` checks, so all raise alike and none is left in a collective.
        ``reasons``: why this rank's input is not supported, if it is not. For a
        read-ahead the ranks must also agree on whether their input has ended, and the
        second value is whether they all have (else None).
        """
        num_features = len(self.input_table_map)
        everyone = collectives.allgather(report, self.mesh.size,
                                         f"tfhybrid_{self.name}_validate")
        sizes = everyone[:, 0]
        flags = tf.reshape(everyone[:, 1:1 + REPORT_FIELDS * num_features],
                           [self.mesh.size, num_features, REPORT_FIELDS])
        names = tf.constant([self.tables[t].name for t in self.input_table_map])
        # for the message: a fixed table's rows (a dynamic table's keys are never bad)
        rows = tf.constant([min(self.id_ranges[t][1], 2**63 - 2) + 1
                            for t in self.input_table_map], tf.int64)

        def first(mask):
            where = tf.argmax(tf.cast(tf.reshape(mask, [-1]), tf.int32))
            return where, where // num_features, where % num_features

        bad_any = flags[:, :, 0] > 0
        where, bad_rank, bad_feature = first(bad_any)
        id_message = tf.strings.join([
            "DistributedEmbedding: embedding table '", tf.gather(names, bad_feature),
            "' got id ",
            tf.strings.as_string(tf.reshape(flags, [-1, REPORT_FIELDS])[where, 1]),
            " on rank ", tf.strings.as_string(bad_rank), "; expected ids in [0, ",
            tf.strings.as_string(tf.gather(rows, bad_feature)), ")"])
        def feature_failure(field: int, what: list) -> tuple:
            # where a feature's flag is set: (any rank's flag, the first one named)
            bad = flags[:, :, field] > 0
            _, rank, feature = first(bad)
            return bad, tf.strings.join([
                "DistributedEmbedding: feature ", tf.strings.as_string(feature),
                " (table '", tf.gather(names, feature), "') on rank ",
                tf.strings.as_string(rank)] + what)

        bad_input, input_message = feature_failure(
            2, [" is not a supported input; that rank's log says why"]
            + [f" (here: {reason})" for reason in reasons])
        bad_weights, weights_message = feature_failure(
            4, [" has a NaN or infinite weight, or ragged weights that are not one per "
                "id; expected finite weights of its ids' shape"])
        # the word is part of the template: a string argument would print in quotes
        batch_message = tf.strings.format(
            f"DistributedEmbedding: {'local' if self.dp_input else 'model-group'} batch "
            "sizes differ across ranks; batch size of rank 0..{}: {}",
            [self.mesh.size - 1, sizes], summarize=-1)
        checks = [(tf.logical_not(tf.reduce_any(bad_input)), input_message),
                  (tf.logical_not(tf.reduce_any(bad_any)), id_message),
                  (tf.logical_not(tf.reduce_any(bad_weights)), weights_message),
                  (tf.reduce_all(tf.equal(sizes, sizes[0])), batch_message)]
        if self.dp_input:
            per_sample = flags[:, :, 3]
            checks.append((tf.reduce_all(tf.equal(per_sample, per_sample[:1])),
                           tf.strings.format(
                               "DistributedEmbedding: the hotness of a table without a "
                               "combiner differs across ranks; bags per sample of each "
                               "feature on rank 0..{}: {}",
                               [self.mesh.size - 1, per_sample], summarize=-1)))
        all_ended = None
        if read_ahead:
            ended_ranks = everyone[:, -1] > 0
            checks.append((tf.equal(tf.reduce_any(ended_ranks), tf.reduce_all(ended_ranks)),
                           tf.strings.format(
                               phases.ENDED_MESSAGE,
                               [tf.boolean_mask(tf.range(self.mesh.size), ended_ranks)],
                               summarize=-1)))
            all_ended = tf.reduce_all(ended_ranks)
        return checks, all_ended


def first_failure(checks: list) -> tf.Tensor:
    """The message of the first ``(holds, message)`` check that fails, or ""."""
    holds = tf.stack([h for h, _ in checks])
    messages = tf.stack([m for _, m in checks])
    return tf.where(tf.reduce_all(holds), tf.constant(""),
                    tf.gather(messages, tf.argmin(tf.cast(holds, tf.int32))))
