"""The route's first stage: a DistributedEmbedding's inputs as bags of ids.

Every fed feature becomes :class:`Bags`: its ids and how many of them each bag holds
(one bag per sample with a combiner, one per id without), whatever form it came in
(``[batch]``, ``[batch, hotness]`` with the hotness known now or only at run time,
ragged, or a ``tf.SparseTensor``), and its per-id weights where given (of the ids' form;
with ``mean`` and ``sqrtn`` ids of weight <= 0 are dropped, as
``tf.nn.safe_embedding_lookup_sparse`` drops them). With ``dp_input=False`` each rank holds the model group's whole batch of its own
features; an input that cannot work there is not raised on this rank alone (the others
would wait in a collective) but reported through the id check (``id_check.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import tensorflow as tf

from tfhybrid import mesh as mesh_lib
from tfhybrid.combiners import kept_in_bags, normalized_weights
from tfhybrid.plan.types import Kind, ShardingPlan
from tfhybrid.sharding.tables import TableSpec, ids_as_int64, takes_strings

_LOG = logging.getLogger("tfhybrid")


@dataclasses.dataclass(frozen=True)
class Bags:
    """One feature as bags: ``values`` ids, ``lengths`` ids per bag."""
    values: tf.Tensor
    lengths: tf.Tensor       # [batch * per_sample]
    batch: tf.Tensor         # samples (int64): per_sample may be 0 (zero hotness)
    # bags per sample: hotness for combiner=None, else 1; an int64 scalar tensor when
    # the hotness is known only at run time
    per_sample: int | tf.Tensor
    out_shape: Any           # None, or the trailing shape for combiner=None
    combiner: str | None
    # dp_input=False: whether this rank's input turns out unsupported at run time (a
    # bool tensor), and why; the validation reports it with the static reasons
    unsupported: Any = False
    unsupported_reason: str = ""
    # per-id float32 weights beside ``values`` (None: unweighted), and whether the given
    # weights were bad at run time: NaN or infinite, or ragged rows of other lengths than
    # the ids' (a bool tensor the id check reports on every rank)
    weights: tf.Tensor | None = None
    bad_weights: Any = False
    # the ids as given, where ids of weight <= 0 left ``values`` (None: ``values``): the
    # id check reads every given id, in a list whose length the trace knows
    given_values: tf.Tensor | None = None


class BagReader:
    """Reads one DistributedEmbedding's inputs as :class:`Bags` on one rank (module
    docstring); ``EmbeddingRoute.bags_of`` is its stage in the route. The example runs
    in one process.

    Example::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding, Embedding
        tfhybrid.init(model_parallel=1)
        layer = DistributedEmbedding([Embedding(10, 4, combiner="sum", name="t")],
                                     input_table_map=[0, 0])
        layer([tf.constant([1, 2]), tf.constant([[1, 2], [3, 4]])])
        bags, batch, _ = layer.route.bag_reader.bags_of(
            [tf.constant([1, 2]), tf.ragged.constant([[1, 2, 3], [4]])])
        assert int(batch) == 2 and bags[1].lengths.numpy().tolist() == [3, 1]
    """

    def __init__(self, name: str, mesh: mesh_lib.Mesh, plan: ShardingPlan,
                 tables: Sequence[TableSpec], input_table_map: Sequence[int],
                 fed_features: Sequence[int], dp_input: bool):
        self.name = name
        self.mesh = mesh
        self.plan = plan
        self.tables = list(tables)
        self.input_table_map = list(input_table_map)
        self.fed_features = list(fed_features)
        self.dp_input = dp_input

    def bags_of(self, inputs, weights=None) -> tuple[dict, Any, dict]:
        """The fed features as bags, the local batch, and dp_input=False's bad inputs.

        ``weights``: None, or one entry per input (None for an unweighted feature); an
        input may also be an ``(ids, weights)`` pair."""
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        fed = self.fed_features
        if len(inputs) != len(fed):
            raise ValueError(f"DistributedEmbedding got {len(inputs)} inputs; expected "
                             f"{len(fed)}" + ("" if self.dp_input else
                                              f" (features {fed}, dp_input=False)"))
        inputs, weights = ids_and_weights(inputs, weights)
        raw = {f: (_as_ragged(x), _as_ragged(w))
               for f, x, w in zip(fed, inputs, weights)}
        invalid: dict[int, str] = {}
        if self.dp_input:
            bags = {f: self._as_bags(f, x, w) for f, (x, w) in raw.items()}
            return bags, bags[fed[0]].batch, invalid
        local_batch = self._local_batch_of_group(raw[fed[0]][0])
        start = tf.cast(self.mesh.model_position, local_batch.dtype) * local_batch
        bags = {}
        for f, (x, w) in raw.items():
            if self.plan.tables[self.input_table_map[f]].kind == Kind.DATA_PARALLEL:
                # a replicated table looks up only this rank's share of the batch
                x = x[start:start + local_batch]
                w = None if w is None else w[start:start + local_batch]
            bags[f], invalid[f] = self._as_model_parallel_bags(f, x, w)
        return bags, local_batch, invalid

    def _local_batch_of_group(self, ids) -> tf.Tensor:
        """dp_input=False: the model group's batch G fed here, divided by M (int64)."""
        group = self.mesh.model_parallel
        rows = ids.nrows() if isinstance(ids, tf.RaggedTensor) else None
        static = (ids.shape[0] if not isinstance(ids, tf.RaggedTensor) else
                  tf.get_static_value(rows))
        if static is not None and int(static) % group:
            raise ValueError(
                f"DistributedEmbedding {self.name!r} (dp_input=False): the model group's "
                f"batch size {int(static)} is not divisible by the {group} ranks of the "
                "model group; feed a batch that splits evenly")
        if rows is None:
            rows = tf.shape(tf.convert_to_tensor(ids), out_type=tf.int64)[0]
        rows = tf.cast(rows, tf.int64)
        with tf.control_dependencies([tf.debugging.assert_equal(
                rows % group, tf.constant(0, tf.int64),
                message=f"DistributedEmbedding {self.name!r} (dp_input=False): the model "
                        f"group's batch size is not divisible by the {group} ranks of the "
                        "model group")]):
            return tf.identity(rows // group)

    def _as_model_parallel_bags(self, feature: int, ids, weights=None) -> tuple[Bags, str]:
        """dp_input=False: this rank's bags, or a stand-in and the reason they are bad.

        Only this rank sees this feature, so raising here would leave the other ranks
        waiting in a collective; the reason travels in the validation instead.
        """
        table = self.tables[self.input_table_map[feature]]
        one_per_sample = ("with dp_input=False a table without a combiner takes one id per "
                          "sample ([batch] ids), because the other ranks must know its "
                          "output shape")
        try:
            bags = self._as_bags(feature, ids, weights)
            if not isinstance(bags.per_sample, int):
                # the hotness is known only at run time: one id per sample holds or the
                # validation stops every rank (the bags are read as one id per sample)
                return dataclasses.replace(
                    bags, lengths=tf.ones_like(bags.values), per_sample=1, out_shape=None,
                    unsupported=tf.not_equal(bags.per_sample, 1),
                    unsupported_reason=f"feature {feature} (table {table.name!r}, "
                    f"combiner=None) has a hotness other than 1 at run time; "
                    f"{one_per_sample}"), ""
            if bags.per_sample != 1:
                raise ValueError(
                    f"feature {feature} (table {table.name!r}, combiner=None) has shape "
                    f"{ids.shape}; {one_per_sample}")
            return bags, ""
        except ValueError as error:
            _LOG.error("DistributedEmbedding %r: %s", self.name, error)
            batch = (ids.nrows() if isinstance(ids, tf.RaggedTensor)
                     else tf.shape(tf.convert_to_tensor(ids), out_type=tf.int64)[0])
            stand_in = tf.zeros([batch], tf.string if takes_strings(table) else tf.int64)
            return self._as_bags(feature, stand_in), str(error)

    def _as_bags(self, feature: int, ids, weights=None) -> Bags:
        bags = self._as_unweighted_bags(feature, ids)
        if weights is None:
            return bags
        table = self.tables[self.input_table_map[feature]]
        if table.combiner is None:
            raise ValueError(f"feature {feature} (table {table.name!r}) has weights, which "
                             "need a combiner ('sum', 'mean' or 'sqrtn'); the table has "
                             "combiner=None")
        if not isinstance(weights, tf.RaggedTensor):
            weights = tf.convert_to_tensor(weights)
        flat, lengths_match = _flat_weights(feature, table.name, ids, weights)
        # weights are inputs, not trained: nothing differentiates through them (their
        # divisors included), so the backward is the rows' alone
        flat = tf.stop_gradient(flat)
        # a NaN or infinite weight fails on every rank in the id check (checked before
        # the ids of weight <= 0 are dropped), as do ragged weights not one per id
        bad = tf.logical_not(tf.reduce_all(tf.math.is_finite(flat)))
        if lengths_match is not None:
            bad = tf.logical_or(bad, tf.logical_not(lengths_match))
            # the bad stand-ins below are never looked up: the check stops every rank
            flat = tf.cond(lengths_match, lambda: flat,
                           lambda: tf.ones_like(bags.values, tf.float32))
        if table.combiner == "sum":
            return dataclasses.replace(bags, weights=flat, bad_weights=bad)
        positive = flat > 0
        # the bag's divisor goes into its ids' weights here, where the whole bag is read
        # (tfhybrid.combiners): from the kept weights in their bags' shape, a sum over
        # each row of a dense [batch, hotness], where a segment sum costs more
        kept_weights = tf.where(positive, flat, tf.zeros_like(flat))
        if isinstance(weights, tf.RaggedTensor):
            in_bags = tf.RaggedTensor.from_row_lengths(kept_weights, bags.lengths,
                                                       validate=False)
            shares = normalized_weights(table.combiner, in_bags).flat_values
        else:
            shape = tf.shape(weights)
            in_bags = tf.reshape(kept_weights, shape if weights.shape.rank == 2
                                 else tf.concat([shape, [1]], 0))
            shares = tf.reshape(normalized_weights(table.combiner, in_bags), [-1])
        values, lengths = bags.values, tf.cast(bags.lengths, tf.int64)
        # ids of weight <= 0 leave their bags, only in a batch that has any
        values, lengths, kept = tf.cond(
            tf.reduce_all(positive), lambda: (values, lengths, shares),
            lambda: kept_in_bags(values, lengths, positive, shares))
        # the weighted sum of each bag is now its mean or sqrtn: nothing divides later
        return dataclasses.replace(bags, values=values, lengths=lengths, weights=kept,
                                   bad_weights=bad, combiner="sum",
                                   given_values=bags.values)

    def _as_unweighted_bags(self, feature: int, ids) -> Bags:
        table = self.tables[self.input_table_map[feature]]
        if isinstance(ids, tf.RaggedTensor):
            if table.combiner is None:
                raise ValueError(
                    f"feature {feature} (table {table.name!r}) is ragged, which needs a "
                    "combiner ('sum', 'mean' or 'sqrtn'); the table has combiner=None")
            values = ids_as_int64(table, feature, ids.flat_values)
            lengths = tf.cast(ids.row_lengths(), tf.int64)
            return Bags(values, lengths, tf.size(lengths, out_type=tf.int64), 1, None,
                              table.combiner)
        ids = tf.convert_to_tensor(ids)
        if ids.shape.rank not in (1, 2):
            raise ValueError(f"feature {feature} (table {table.name!r}) has shape "
                             f"{ids.shape}; expected [batch] or [batch, hotness]")
        values = tf.reshape(ids_as_int64(table, feature, ids), [-1])
        if ids.shape.rank == 1:
            return Bags(values, tf.ones_like(values), tf.size(values, out_type=tf.int64),
                              1, None, table.combiner)
        # A pipeline traced from a Sequence or a generator knows only the rank: the
        # hotness is then read at run time, as tf.keras.layers.Embedding does.
        hotness = ids.shape[1]
        if hotness is None:
            hotness = tf.shape(ids, out_type=tf.int64)[1]
        if table.combiner is None:
            # no combiner: each id is a bag of one, reshaped to [batch, hotness, dim]
            return Bags(values, tf.ones_like(values),
                              tf.shape(ids, out_type=tf.int64)[0], hotness, hotness, None)
        lengths = tf.fill([tf.shape(ids, out_type=tf.int64)[0]],
                          tf.cast(hotness, tf.int64))
        return Bags(values, lengths, tf.size(lengths, out_type=tf.int64), 1, None,
                          table.combiner)


def ids_and_weights(inputs: list, weights) -> tuple[list, list]:
    """The ids and the weights (None where unweighted) of each input: ``weights`` given
    beside the inputs, or ``(ids, weights)`` pairs among them (the served copy's
    ``ServedTables`` reads them by the same rule)."""
    if weights is not None:
        weights = list(weights) if isinstance(weights, (list, tuple)) else [weights]
        if len(weights) != len(inputs):
            raise ValueError(f"DistributedEmbedding got {len(weights)} weights for "
                             f"{len(inputs)} inputs; expected one per input (None for an "
                             "unweighted feature)")
    else:
        weights = [None] * len(inputs)
    ids = []
    for f, (x, w) in enumerate(zip(inputs, weights)):
        if isinstance(x, (list, tuple)):
            if len(x) != 2 or w is not None:
                raise ValueError(f"input {f} is a {type(x).__name__} of {len(x)}; expected "
                                 "ids, or an (ids, weights) pair with no weights= entry")
            x, w = x
        ids.append(x)
        weights[f] = w
    return ids, weights


def _as_ragged(x):
    """A ``tf.SparseTensor`` as the ragged tensor of its rows (others as they are)."""
    if isinstance(x, tf.SparseTensor):
        if x.shape.rank != 2:
            raise ValueError(f"sparse input of shape {x.shape}; expected [batch, None]")
        return tf.RaggedTensor.from_sparse(x)
    return x


def _flat_weights(feature: int, table_name: str, ids, weights) -> tuple[tf.Tensor, Any]:
    """A feature's weights as float32 in the ids' order, and for ragged weights whether
    their rows have the ids' lengths (a bool tensor; None for dense); ``ValueError``
    naming the feature when their form, static shape or dtype does not match its
    ids'."""
    where = f"feature {feature} (table {table_name!r})"
    if isinstance(weights, tf.RaggedTensor) != isinstance(ids, tf.RaggedTensor):
        raise ValueError(f"{where}: its weights are "
                         f"{'ragged' if isinstance(weights, tf.RaggedTensor) else 'dense'} "
                         f"but its ids are "
                         f"{'ragged' if isinstance(ids, tf.RaggedTensor) else 'dense'}; "
                         "expected weights of the ids' form and shape")
    if isinstance(weights, tf.RaggedTensor):
        dtype = weights.dtype
        flat = weights.flat_values
        weight_splits = tf.cast(weights.row_splits, tf.int64)
        id_splits = tf.cast(ids.row_splits, tf.int64)
        matches = tf.cond(tf.equal(tf.size(weight_splits), tf.size(id_splits)),
                          lambda: tf.reduce_all(tf.equal(weight_splits, id_splits)),
                          lambda: tf.constant(False))
        shape_ok = weights.shape.is_compatible_with(ids.shape)
    else:
        weights = tf.convert_to_tensor(weights)
        dtype = weights.dtype
        flat = tf.reshape(weights, [-1])
        shape_ok = weights.shape.is_compatible_with(tf.convert_to_tensor(ids).shape)
        matches = None
    if not dtype.is_floating:
        raise ValueError(f"{where}: its weights have dtype {dtype.name}; expected a float "
                         "dtype (float32, float16, bfloat16 or float64)")
    if not shape_ok:
        raise ValueError(f"{where}: its weights have shape {weights.shape}; expected the "
                         f"shape of its ids, {ids.shape}")
    return tf.cast(flat, tf.float32), matches
