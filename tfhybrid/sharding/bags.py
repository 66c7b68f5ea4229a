"""The route's first stage: a DistributedEmbedding's inputs as bags of ids.

Every fed feature becomes :class:`Bags`: its ids and how many of them each bag holds
(one bag per sample with a combiner, one per id without), whatever form it came in
(``[batch]``, ``[batch, hotness]`` with the hotness known now or only at run time, or
ragged). With ``dp_input=False`` each rank holds the model group's whole batch of its own
features; an input that cannot work there is not raised on this rank alone (the others
would wait in a collective) but reported through the id check (``id_check.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import tensorflow as tf

from tfhybrid import mesh as mesh_lib
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

    def bags_of(self, inputs) -> tuple[dict, Any, dict]:
        """The fed features as bags, the local batch, and dp_input=False's bad inputs."""
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        fed = self.fed_features
        if len(inputs) != len(fed):
            raise ValueError(f"DistributedEmbedding got {len(inputs)} inputs; expected "
                             f"{len(fed)}" + ("" if self.dp_input else
                                              f" (features {fed}, dp_input=False)"))
        raw = dict(zip(fed, inputs))
        invalid: dict[int, str] = {}
        if self.dp_input:
            bags = {f: self._as_bags(f, x) for f, x in raw.items()}
            return bags, bags[0].batch, invalid
        local_batch = self._local_batch_of_group(inputs[0])
        start = tf.cast(self.mesh.model_position, local_batch.dtype) * local_batch
        bags = {}
        for f, x in raw.items():
            if self.plan.tables[self.input_table_map[f]].kind == Kind.DATA_PARALLEL:
                # a replicated table looks up only this rank's share of the batch
                x = x[start:start + local_batch]
            bags[f], invalid[f] = self._as_model_parallel_bags(f, x)
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

    def _as_model_parallel_bags(self, feature: int, ids) -> tuple[Bags, str]:
        """dp_input=False: this rank's bags, or a stand-in and the reason they are bad.

        Only this rank sees this feature, so raising here would leave the other ranks
        waiting in a collective; the reason travels in the validation instead.
        """
        table = self.tables[self.input_table_map[feature]]
        one_per_sample = ("with dp_input=False a table without a combiner takes one id per "
                          "sample ([batch] ids), because the other ranks must know its "
                          "output shape")
        try:
            bags = self._as_bags(feature, ids)
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

    def _as_bags(self, feature: int, ids) -> Bags:
        table = self.tables[self.input_table_map[feature]]
        if isinstance(ids, tf.RaggedTensor):
            if table.combiner is None:
                raise ValueError(
                    f"feature {feature} (table {table.name!r}) is ragged, which needs a "
                    "combiner ('sum' or 'mean'); the table has combiner=None")
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
