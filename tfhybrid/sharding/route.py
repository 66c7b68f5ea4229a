"""The route of a DistributedEmbedding's ids and rows, as named stages.

One step of the forward, as :meth:`EmbeddingRoute.forward` runs it:

1. ``bags_of``: the fed features as bags (ids and bag lengths);
2. ``prepare`` (this rank alone): the id check's report and the ids for their owners,
   what the collectives will send; ``TrainPipeline`` runs it a batch ahead;
3. ``exchange`` (collectives): every rank checks every rank's report (one allgather, so
   bad input fails on every rank at once instead of hanging a collective), then the ids
   travel to the position owning each shard (one ``alltoall`` in the model group);
   tiered shards' ids become cache slots;
4. ``look_up_and_return``: each owner sums the bags of all M ranks of its model group
   from its stores, and the rows return in one ``alltoall`` (DCT-MP thresholds it), its
   gradient the reverse alltoall;
5. column slices are concatenated, row-slice partials summed, means divided, and
   data-parallel tables looked up locally.

Gradients then flow back through the same alltoalls to the owners' stores' variables;
``tfhybrid.DistributedGradientTape`` / ``DistributedOptimizer`` sync them over the right
process set. The route reads the plan and the stores and owns no variable but the anchor
the layer gives it.

Example (one process: a 1x1 mesh routes to itself)::

    import tensorflow as tf
    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding
    tfhybrid.init(model_parallel=1)
    layer = DistributedEmbedding([tf.keras.layers.Embedding(10, 4)])
    layer([tf.constant([1, 2])])
    bags, batch, invalid = layer.route.bags_of([tf.constant([3, 4])])
    assert int(batch) == 2 and sorted(bags) == [0]
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import tensorflow as tf

from tfhybrid import collectives
from tfhybrid import compression
from tfhybrid import mesh as mesh_lib
from tfhybrid import pipeline as pipeline_lib
from tfhybrid.plan.types import Kind, ShardingPlan
from tfhybrid.sharding.stores import StoreSet
from tfhybrid.sharding.tables import TableSpec
from tfhybrid.tiers import CachedTable

_LOG = logging.getLogger("tfhybrid")

# per feature in a rank's id report: bad id?, the first bad id, bad input?, bags per sample
_REPORT_FIELDS = 4


@dataclasses.dataclass(frozen=True)
class RouteEntry:
    """One (feature, shard) pair that crosses the model-group alltoall."""
    feature: int
    table: int
    shard: int          # index into the table's shards
    owner: int          # position in the model group
    row_start: int
    row_end: int
    width: int


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


class EmbeddingRoute:
    """The stages that take one DistributedEmbedding's ids to their owners and the rows
    back (module docstring), for one built layer on one rank.

    Made by the layer's ``build`` from its plan and stores; ``layer.route`` gives it.
    ``TrainPipeline`` calls :meth:`prepare` a batch ahead and :meth:`exchange` a step
    ahead; a plain call runs :meth:`forward`.

    Example::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding
        tfhybrid.init(model_parallel=1)
        layer = DistributedEmbedding([tf.keras.layers.Embedding(10, 4)])
        layer([tf.constant([1, 2])])
        assert [len(r) for r in layer.route.routes] == [1]
    """

    def __init__(self, name: str, mesh: mesh_lib.Mesh, plan: ShardingPlan,
                 tables: Sequence[TableSpec], input_table_map: Sequence[int],
                 fed_features: Sequence[int], dp_input: bool, stores: StoreSet,
                 anchor: tf.Variable, compute_dtype: Any, mp_keep: float | None,
                 replica_sync: str):
        self.name = name
        self.mesh = mesh
        self.plan = plan
        self.tables = list(tables)
        self.input_table_map = list(input_table_map)
        self.fed_features = list(fed_features)
        self.dp_input = dp_input
        self.stores = stores
        # the empty variable that rides along with the rows (the layer's build says why)
        self.anchor = anchor
        self.compute_dtype = compute_dtype
        # DCT-MP: the share of each sample's returned rows the alltoall carries
        self.mp_keep = mp_keep
        self.replica_sync = replica_sync
        # the (feature, shard) pairs each position serves, in one fixed order that every
        # rank derives from the same plan
        self.routes: list[list[RouteEntry]] = [[] for _ in range(mesh.model_parallel)]
        for feature, t in enumerate(self.input_table_map):
            placement = plan.tables[t]
            if placement.kind == Kind.DATA_PARALLEL:
                continue
            for s, shard in enumerate(placement.shards):
                self.routes[shard.owner].append(RouteEntry(
                    feature, t, s, shard.owner, shard.row_start, shard.row_end,
                    shard.col_end - shard.col_start))
        self.wire_id_dtype = (tf.int32 if all(t.rows < 2**31 for t in self.tables)
                              else tf.int64)
        compute = tf.as_dtype(compute_dtype)
        # under mixed precision, rows and their gradients cross in 16 bits
        self.wire_float = compute if compute in (tf.float16, tf.bfloat16) else tf.float32

    def forward(self, inputs: Any, caller: Any) -> tuple[list, Any]:
        """The layer's outputs for ``inputs`` and the local batch; ``caller`` (the layer)
        is who a ``TrainPipeline`` phase knows the route by."""
        bags, local_batch, invalid = self.bags_of(inputs)
        phase = pipeline_lib.phase_of(caller)
        if phase is not None and phase.routing:
            # TrainPipeline reads this batch ahead: it keeps what the route will send (its
            # collectives run in the next step's function) and stops here
            phase.hand_over(caller, *self.prepare(bags, local_batch, invalid, phase.ended))
            return self.placeholders(bags), local_batch
        if phase is None:
            # 1-3. validate on every rank together, then ids to their owners
            bags, routed = self.checked_route(bags, local_batch, invalid)
        else:
            # TrainPipeline routed (and validated) this batch during the previous step
            routed = phase.take(caller)

        # 4. model-parallel features through the model group
        partials = (self.look_up_and_return(bags, local_batch, routed, phase)
                    if any(self.routes) else {})

        outputs = []
        for f, t in enumerate(self.input_table_map):
            placement = self.plan.tables[t]
            if placement.kind == Kind.DATA_PARALLEL:
                # 5. data-parallel tables: local lookup
                outputs.append(self.finish(bags[f], self.stores.lookup_sum(
                    t, 0, bags[f].values, bags[f].lengths)))
                continue
            if placement.kind == Kind.COLUMN_WISE:
                summed = tf.concat([partials[(f, s)] for s in range(len(placement.shards))],
                                   axis=1)
            else:  # table_wise is one shard; row_wise partial sums add up
                summed = tf.add_n([partials[(f, s)] for s in range(len(placement.shards))])
            if self.dp_input:
                outputs.append(self.finish(bags[f], summed))
            else:
                # the owners already divided means; one bag per sample (checked)
                outputs.append(tf.cast(summed, self.compute_dtype))
        return outputs, local_batch

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

    def checked_route(self, bags: dict, batch, invalid: dict) -> tuple[dict, list]:
        """Steps 1-2: the checked bags and the ids of the routes this position owns.

        The routed ids are ``[ids of each owned route] + [bag lengths of each]``, for the
        model group's samples in rank order: what :meth:`look_up_and_return` looks up (a tiered
        shard's ids as cache slots, its rows loaded). A failed check raises on every
        rank before any id leaves this one.
        """
        sending, facts = self.prepare(bags, batch, invalid)
        routed, _, _, asserts = self.exchange(sending, facts)
        with tf.control_dependencies(asserts):
            bags = {f: dataclasses.replace(b, values=tf.identity(b.values))
                    for f, b in bags.items()}
        return bags, routed

    def prepare(self, bags: dict, batch, invalid: dict, ended=None
                       ) -> tuple[list, tuple]:
        """The route's first half, on this rank alone: what its collectives will send,
        as a list of tensors (the id check's report, the batch, and the ids for their
        owners, or with ``dp_input=False`` this position's own route ids), and the
        trace-time facts that :meth:`exchange` reads them by.

        ``ended`` (a bool tensor, ``TrainPipeline``'s) says that this rank's input has
        ended and ``bags`` only stand in for a batch; the ranks agree on it in the same
        allgather that checks the ids. A pipeline prepares batch t+2 during step t and
        sends it during step t+1, so nothing here may touch a variable.
        """
        report = self._id_report(bags, batch, invalid, ended)
        mine = self.routes[self.mesh.model_position]
        parts = []
        if any(self.routes):
            if self.dp_input:
                parts = list(self._ids_payload(bags))
            else:
                # the input already holds the model group's batch of this position's
                # features
                shard_ids = [self._shard_ids(bags[r.feature], r) for r in mine]
                parts = [ids for ids, _ in shard_ids] + [n for _, n in shard_ids]
        # bags per sample of each route: ints where the hotness is static; a hotness
        # known only at run time (None here) travels as a tensor after the parts, so
        # that a pipeline's read-ahead carries it to the step that sends
        per_route = [bags[r.feature].per_sample for r in mine] if self.dp_input else []
        static = tuple(k if isinstance(k, int) else None for k in per_route)
        run_time = [tf.cast(k, tf.int64) for k in per_route if not isinstance(k, int)]
        reasons = [reason for reason in invalid.values() if reason] + [
            f"if so, {bag.unsupported_reason}" for bag in bags.values()
            if bag.unsupported_reason]
        facts = (tuple(reasons[:1]), static,
                 ended is not None)
        return [report, tf.cast(batch, tf.int64)] + parts + run_time, facts

    def exchange(self, sending: list, facts: tuple) -> tuple[list, Any, Any, list]:
        """The route's second half: its collectives on what :meth:`prepare` made,
        and what follows them. Returns the routed ids (see :meth:`checked_route`), whether every
        rank's input has ended and the first failed check's message ("" if none), both
        only for a prepared read-ahead (else None), and otherwise the checks as asserts
        that every id waits for.

        The only variables it touches are tiered shards' caches, where it fills slots
        that neither this batch nor the one before uses (``pinned_calls``), so
        ``TrainPipeline`` may run it a step ahead.
        """
        reasons, static_per_route, read_ahead = facts
        run_time = iter(sending[len(sending) - static_per_route.count(None):])
        bags_per_route = tuple(next(run_time) if k is None else k for k in static_per_route)
        report, batch = sending[0], sending[1]
        parts = list(sending[2:len(sending) - static_per_route.count(None)])
        checks, all_ended = self._id_checks(report, reasons, read_ahead)
        if read_ahead:
            # TrainPipeline raises after the step it runs beside has finished, so that a
            # bad batch read ahead cannot cut that step's update short
            failure, asserts = _first_failure(checks), []
        else:
            failure = None
            asserts = [tf.debugging.Assert(holds, [message]) for holds, message in checks]
        if not any(self.routes):
            return [], all_ended, failure, asserts
        if asserts:
            with tf.control_dependencies(asserts):
                parts = [tf.identity(part) for part in parts]
        if self.dp_input:
            route_ids, route_lengths = self._ids_received(parts[0], parts[1], batch,
                                                          bags_per_route)
        else:
            half = len(parts) // 2
            route_ids, route_lengths = parts[:half], parts[half:]
        # a tiered shard's ids become cache slots, their rows loaded now: read ahead by
        # a pipeline, the rows are in the cache before the step that looks them up
        for i, r in enumerate(self.routes[self.mesh.model_position]):
            cached = self.stores.cache(r.table, r.shard)
            if cached is not None:
                route_ids[i] = self._cache_slots(cached, route_ids[i],
                                                 f"{r.feature}_{r.shard}")
        return route_ids + route_lengths, all_ended, failure, asserts

    def placeholders(self, bags: dict) -> list:
        """Zeros shaped like the outputs: a read-ahead's forward stops at this layer, and
        what follows only needs to trace."""
        outputs = []
        for f, t in enumerate(self.input_table_map):
            bag = bags[f]
            zeros = tf.zeros([tf.size(bag.lengths), self.tables[t].dim], tf.float32)
            outputs.append(self.finish(bag, zeros) if self.dp_input
                           else tf.cast(zeros, self.compute_dtype))
        return outputs

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

    def _as_model_parallel_bags(self, feature: int, ids) -> tuple["Bags", str]:
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
            return self._as_bags(feature, tf.zeros([batch], tf.int64)), str(error)

    def _as_bags(self, feature: int, ids) -> "Bags":
        table = self.tables[self.input_table_map[feature]]
        if isinstance(ids, tf.RaggedTensor):
            if table.combiner is None:
                raise ValueError(
                    f"feature {feature} (table {table.name!r}) is ragged, which needs a "
                    "combiner ('sum' or 'mean'); the table has combiner=None")
            values = tf.cast(ids.flat_values, tf.int64)
            lengths = tf.cast(ids.row_lengths(), tf.int64)
            return Bags(values, lengths, tf.size(lengths, out_type=tf.int64), 1, None,
                              table.combiner)
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise ValueError(f"feature {feature} (table {table.name!r}) has dtype "
                             f"{ids.dtype.name}; expected integer ids")
        if ids.shape.rank not in (1, 2):
            raise ValueError(f"feature {feature} (table {table.name!r}) has shape "
                             f"{ids.shape}; expected [batch] or [batch, hotness]")
        values = tf.reshape(tf.cast(ids, tf.int64), [-1])
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

    def _id_report(self, bags: dict, batch, invalid: dict, ended=None) -> tf.Tensor:
        """This rank's row of the id check (:meth:`_id_checks`): [batch, (bad?, first
        bad id, bad input?, bags per sample) per feature] (zeros for a feature it does not
        feed), and with ``ended`` (``TrainPipeline``'s read-ahead) whether its input has
        ended.

        Every fed feature's ids are checked at once, as one list with each id's feature
        beside it: a trace then holds a few ops for all features, not a dozen per feature
        (a step's graph is built on every rank, and this check was most of the layer's).
        """
        num_features = len(self.input_table_map)
        fed = [f for f in range(num_features) if f in bags]
        head = [tf.reshape(tf.cast(batch, tf.int64), [1])]
        tail = [] if ended is None else [tf.reshape(tf.cast(ended, tf.int64), [1])]
        if not fed:
            return tf.reshape(tf.concat(
                head + [tf.zeros([num_features * _REPORT_FIELDS], tf.int64)] + tail, 0), [1, -1])
        values = tf.concat([tf.cast(bags[f].values, tf.int64) for f in fed], 0)
        sizes = tf.stack([tf.size(bags[f].values, out_type=tf.int64) for f in fed])
        total = tf.size(values, out_type=tf.int64)
        places = tf.range(total)
        # each id's feature: how many features end at or before its place (a dozen ops,
        # where tf.repeat builds a hundred)
        feature_of = tf.reshape(tf.raw_ops.UpperBound(
            sorted_inputs=tf.reshape(tf.cumsum(sizes), [1, -1]),
            values=tf.reshape(places, [1, -1]), out_type=tf.int64), [-1])
        limits = tf.constant([self.tables[self.input_table_map[f]].rows for f in fed],
                             tf.int64)
        bad = tf.logical_or(values < 0, values >= tf.gather(limits, feature_of))
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
        rows = tf.stack([tf.cast(any_bad, tf.int64), first_bad, bad_input, per_sample], 1)
        if len(fed) < num_features:   # zeros for the features this rank does not feed
            rows = tf.scatter_nd(tf.constant(fed, tf.int64)[:, None], rows,
                                 [num_features, _REPORT_FIELDS])
        return tf.reshape(tf.concat(head + [tf.reshape(rows, [-1])] + tail, 0), [1, -1])

    def _id_checks(self, report: tf.Tensor, reasons: tuple, read_ahead: bool
                   ) -> tuple[list, Any]:
        """Checks that every id is in range and every rank has the same batch size (and,
        with ``dp_input=True``, the same bags per sample: an owner reads every rank's
        ids by its own).

        After one allgather of every rank's :meth:`_id_report` every rank holds the same
        ``(holds, message)`` checks, so all raise alike and none is left in a collective.
        ``reasons``: why this rank's input is not supported, if it is not. For a
        read-ahead the ranks must also agree on whether their input has ended, and the
        second value is whether they all have (else None).
        """
        num_features = len(self.input_table_map)
        everyone = collectives.allgather(report, self.mesh.size,
                                         f"tfhybrid_{self.name}_validate")
        sizes = everyone[:, 0]
        flags = tf.reshape(everyone[:, 1:1 + _REPORT_FIELDS * num_features],
                           [self.mesh.size, num_features, _REPORT_FIELDS])
        names = tf.constant([self.tables[t].name for t in self.input_table_map])
        rows = tf.constant([self.tables[t].rows for t in self.input_table_map], tf.int64)

        def first(mask):
            where = tf.argmax(tf.cast(tf.reshape(mask, [-1]), tf.int32))
            return where, where // num_features, where % num_features

        bad_any = flags[:, :, 0] > 0
        where, bad_rank, bad_feature = first(bad_any)
        id_message = tf.strings.join([
            "DistributedEmbedding: embedding table '", tf.gather(names, bad_feature),
            "' got id ",
            tf.strings.as_string(tf.reshape(flags, [-1, _REPORT_FIELDS])[where, 1]),
            " on rank ", tf.strings.as_string(bad_rank), "; expected ids in [0, ",
            tf.strings.as_string(tf.gather(rows, bad_feature)), ")"])
        bad_input = flags[:, :, 2] > 0
        _, input_rank, input_feature = first(bad_input)
        input_message = tf.strings.join([
            "DistributedEmbedding: feature ", tf.strings.as_string(input_feature),
            " (table '", tf.gather(names, input_feature), "') on rank ",
            tf.strings.as_string(input_rank), " is not a supported input; that rank's log "
            "says why"] + [f" (here: {reason})" for reason in reasons])
        batch_message = tf.strings.format(
            "DistributedEmbedding: {} batch sizes differ across ranks; batch size of "
            "rank 0..{}: {}", ["local" if self.dp_input else "model-group",
                               self.mesh.size - 1, sizes], summarize=-1)
        checks = [(tf.logical_not(tf.reduce_any(bad_input)), input_message),
                  (tf.logical_not(tf.reduce_any(bad_any)), id_message),
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
                               pipeline_lib.ENDED_MESSAGE,
                               [tf.boolean_mask(tf.range(self.mesh.size), ended_ranks)],
                               summarize=-1)))
            all_ended = tf.reduce_all(ended_ranks)
        return checks, all_ended

    def _shard_ids(self, bag: "Bags", route: RouteEntry) -> tuple[tf.Tensor, tf.Tensor]:
        """The route's ids (relative to its shard) and the number of them in each bag."""
        if self.plan.tables[route.table].kind != Kind.ROW_WISE:
            return bag.values, bag.lengths
        inside = tf.logical_and(bag.values >= route.row_start, bag.values < route.row_end)
        # a bag's count is the difference of the running count of inside ids at its two
        # ends: a third of the ops of tf.repeat + a segment sum, built at every trace
        lengths = tf.cast(bag.lengths, tf.int64)
        inside_before = tf.concat([tf.zeros([1], tf.int64),
                                   tf.cumsum(tf.cast(inside, tf.int64))], 0)
        ends = tf.cumsum(lengths)
        counts = tf.gather(inside_before, ends) - tf.gather(inside_before, ends - lengths)
        return (tf.gather(bag.values, tf.reshape(tf.where(inside), [-1])) - route.row_start,
                counts)

    def _ids_payload(self, bags: dict) -> tuple[tf.Tensor, tf.Tensor]:
        """dp_input=True, step 2's input: to each position of the model group, the bag
        lengths and then the ids of its routes, in one buffer, and each one's size."""
        wire = self.wire_id_dtype
        # to each position, [lengths of its routes | ids of its routes]
        payloads, sizes = [], []
        for routes in self.routes:
            lengths, values = [], []
            for r in routes:
                owner_ids, bag_lengths = self._shard_ids(bags[r.feature], r)
                lengths.append(tf.cast(bag_lengths, wire))
                values.append(tf.cast(owner_ids, wire))
            payload = tf.concat(lengths + values, 0) if routes else tf.zeros([0], wire)
            payloads.append(payload)
            sizes.append(tf.size(payload, out_type=tf.int32))
        return tf.concat(payloads, 0), tf.stack(sizes)

    def _ids_received(self, payload: tf.Tensor, sizes: tf.Tensor, batch,
                      bags_per_route: tuple) -> tuple[list, list]:
        """dp_input=True, step 2: every rank sends each owner the ids of its routes
        (:meth:`_ids_payload`). Returns, for each route this position owns (of
        ``bags_per_route`` bags per sample), the ids and bag lengths of all M ranks'
        samples, in rank order."""
        mesh = self.mesh
        group = mesh.model_parallel
        received, received_sizes = collectives.alltoall(
            payload, sizes, mesh.model_process_set, group, f"tfhybrid_{self.name}_ids")
        mine = self.routes[mesh.model_position]
        header = batch * sum(bags_per_route)
        route_lengths = [[] for _ in mine]
        route_ids = [[] for _ in mine]
        for chunk in tf.split(received, received_sizes, num=group):
            head = tf.cast(chunk[:header], tf.int64)
            lengths = tf.split(head, [batch * k for k in bags_per_route], num=len(mine)) \
                if mine else []
            counts = tf.stack([tf.reduce_sum(x) for x in lengths]) if mine else None
            ids = tf.split(chunk[header:], counts, num=len(mine)) if mine else []
            for i in range(len(mine)):
                route_lengths[i].append(lengths[i])
                route_ids[i].append(ids[i])
        return ([tf.cast(tf.concat(x, 0), tf.int64) for x in route_ids],
                [tf.concat(x, 0) for x in route_lengths])

    def look_up_and_return(self, bags: dict, batch, routed: list, pipeline_step=None
                           ) -> dict:
        """Steps 3-4: owner lookups of the routed ids (:meth:`checked_route`), rows back.

        Returns each (feature, shard)'s rows for this rank's samples. ``pipeline_step``
        (a ``TrainPipeline`` step's phase, or None) is handed the rows as they go into
        the alltoall and as they come out: the read-ahead's work waits for them.
        """
        mesh = self.mesh
        group = mesh.model_parallel
        mine = self.routes[mesh.model_position]
        route_ids, route_lengths = routed[:len(mine)], routed[len(mine):]

        # 3. owner: look up and sum the bags of all M ranks of the model group
        sums = []
        for i, r in enumerate(mine):
            summed = self.stores.lookup_sum(r.table, r.shard, route_ids[i], route_lengths[i])
            if not self.dp_input and self.tables[r.table].combiner == "mean":
                # only the owner sees whole bags here (a row shard's ids are a part)
                counts = tf.maximum(bags[r.feature].lengths, 1)
                summed = summed / tf.cast(counts, summed.dtype)[:, None]
            sums.append(tf.reshape(summed, [group, -1]))   # [source, bags * width]
        if group == 1:
            return self._kept_here(mine, sums)

        # 4. send each source its rows back: one flat buffer per source
        # a sample's values from each owner: its bags' rows of every route, in order
        def sample_width(routes):
            return sum((bags[r.feature].per_sample if self.dp_input else 1) * r.width
                       for r in routes)

        # A keep share that drops nothing (1.0, or narrow vectors) sends as without DCT:
        # a top-k over every entry would only cost time.
        owner_widths = [sample_width(self.routes[o]) for o in range(group)]
        thresholded = self.mp_keep is not None and group > 1 and any(
            compression.may_drop(w, self.mp_keep) for w in owner_widths)
        if thresholded:
            # DCT-MP: each sample keeps its largest entries; positions cross as small ints
            # of one type for the whole group (the widest owner's), as Horovod requires
            static_widths = all(isinstance(w, int) for w in owner_widths)
            wire_positions = compression.position_dtype(
                max(max(owner_widths), 1) if static_widths else None)
        if mine and thresholded:
            # the sample count is given: a route of zero-hot bags has width 0
            rows = tf.concat([tf.reshape(x, [group, batch, sample_width([r])])
                              for x, r in zip(sums, mine)], axis=2)   # [source, sample, W]
            kept, positions = compression.keep_largest(rows, self.mp_keep)
            back = tf.reshape(kept, [-1])
            back_positions = tf.reshape(tf.cast(positions, wire_positions), [-1])
            back_sizes = tf.fill([group], tf.cast(tf.size(back) // group, tf.int32))
        elif mine:
            back = tf.reshape(tf.concat(sums, axis=1), [-1])
            back_sizes = tf.fill([group], tf.cast(tf.size(back) // group, tf.int32))
        else:
            # Nothing to send, but only once the checks hold: in a traced step an owner
            # whose check fails never joins this alltoall, and ops without inputs would
            # start it at once (the bags wait for the checks; a read-ahead's raise later).
            with tf.control_dependencies([bag.values for bag in bags.values()]):
                back = tf.zeros([0], tf.float32)
                back_sizes = tf.zeros([group], tf.int32)
                if thresholded:
                    back_positions = tf.zeros([0], wire_positions)
        if thresholded:
            # not differentiable: the values' gradient returns to the same positions
            returned_positions, _ = collectives.alltoall(
                back_positions, back_sizes, mesh.model_process_set, group,
                f"tfhybrid_{self.name}_positions")
        # The backward alltoall sums the M ranks' gradients of their own mean losses; 1/M
        # (in float32) makes the shard's gradient that of the model group's mean loss, so
        # the optimizer's sync is a plain average (tfhybrid/distributed.py). Every rank,
        # owner or not, scales: the ops before a collective must be the same on every
        # rank, or the backward alltoall's name scope, and so its name, would differ.
        back = _scale_gradient(back, 1.0 / group)
        # under mixed precision, rows and their gradients cross in 16 bits
        back = tf.concat([tf.cast(back, self.wire_float),
                          tf.cast(self.anchor, self.wire_float)], 0)
        if pipeline_step is not None:
            pipeline_step.sending(back)
        returned, returned_sizes = collectives.alltoall(
            back, back_sizes, mesh.model_process_set, group, f"tfhybrid_{self.name}_rows",
            differentiable=True)
        if pipeline_step is not None:
            pipeline_step.arrived(returned)
        partials = {}
        if thresholded:
            position_chunks = tf.split(returned_positions, returned_sizes, num=group)
        for owner, chunk in enumerate(tf.split(returned, returned_sizes, num=group)):
            routes = self.routes[owner]
            if not routes:
                continue
            if thresholded:
                # back to [sample, W] with zeros where the owner sent nothing, then
                # flat in the unthresholded order: route after route, sample-major
                width = owner_widths[owner]
                k = compression.kept_count(width, self.mp_keep)
                rows = compression.scatter_kept(tf.reshape(tf.cast(chunk, tf.float32),
                                                           [batch, k]),
                                                tf.reshape(position_chunks[owner], [batch, k]),
                                                width)
                chunk = tf.concat([tf.reshape(part, [-1]) for part in tf.split(
                    rows, [sample_width([r]) for r in routes], num=len(routes), axis=1)], 0)
            # with dp_input=False every feature here has one bag per sample (checked)
            widths = [batch * (bags[r.feature].per_sample if self.dp_input else 1) * r.width
                      for r in routes]
            for r, part in zip(routes, tf.split(chunk, widths, num=len(routes))):
                # partial sums add up in float32 even when they travelled in 16 bits
                partials[(r.feature, r.shard)] = tf.cast(tf.reshape(part, [-1, r.width]),
                                                         tf.float32)
        return partials

    def _kept_here(self, mine: list, sums: list) -> dict:
        """Step 4 in a model group of one: this rank owns every route and keeps its rows.

        The alltoall would be the identity, but packing the rows into its one flat buffer
        and splitting them out again copies every row twice per step, and its gradient
        twice more (a profile of a 1x1 DLRM step: 9 ms of SplitV and 7 ms of ConcatV2
        per step). The values are those of the exchange: rows still round through the
        wire's 16 bits under mixed precision, so that every mesh computes alike.
        """
        partials = {}
        for r, summed in zip(mine, sums):
            if self.wire_float != tf.float32:
                summed = tf.cast(summed, self.wire_float)
            partials[(r.feature, r.shard)] = tf.cast(tf.reshape(summed, [-1, r.width]),
                                                     tf.float32)
        # the anchor stays on the tape, as through the exchange (an empty sum adds 0)
        first = (mine[0].feature, mine[0].shard)
        partials[first] = partials[first] + tf.reduce_sum(self.anchor)
        return partials

    def _cache_slots(self, cached: CachedTable, ids: tf.Tensor, route: str) -> tf.Tensor:
        """The cache slots of a tiered shard's ``ids`` (its routed ids), their rows
        loaded first.

        Every replica of the shard (its data group) loads the ids of all of them, in
        one call with the same set of ids: their caches then make the same choices and
        stay alike, slot for slot, so the replicas' gradients (rows at slots) add up
        as those of a table in memory. The cache must hold the group's distinct ids.
        """
        mesh = self.mesh
        # Valid ids pass unchanged. A batch read ahead whose check failed is never looked
        # up (TrainPipeline raises after the step beside it), and its bad ids must not
        # fail the host step inside that step's function.
        ids = tf.clip_by_value(ids, 0, cached.rows - 1)
        if mesh.data_parallel == 1:
            return cached.slots(ids)
        everyone = collectives.allgather(ids, mesh.data_parallel,
                                         f"tfhybrid_{self.name}_tier_ids_{route}",
                                         mesh.data_process_set)
        after = []
        if self.replica_sync == "weights":
            # A weight sync rewrites every slot, so rows must not move in or out while it
            # runs: a pipeline reads batch t+1's rows in step t's function, and reading
            # the cache here orders that after the step's last write to it (its sync).
            after = [cached.cache.read_value()]
        with tf.control_dependencies(after):
            slots = cached.slots(tf.concat([everyone, ids], 0))
        return slots[tf.size(everyone):]

    def finish(self, bag, summed):
        if bag.combiner == "mean":
            counts = tf.cast(tf.maximum(bag.lengths, 1), summed.dtype)
            summed = summed / counts[:, None]
        if bag.out_shape is not None:
            # the batch, not -1: with zero hotness the size says nothing about it
            summed = tf.reshape(summed, [bag.batch, bag.out_shape, summed.shape[-1]])
        return tf.cast(summed, self.compute_dtype)


def _first_failure(checks: list) -> tf.Tensor:
    """The message of the first ``(holds, message)`` check that fails, or ""."""
    holds = tf.stack([h for h, _ in checks])
    messages = tf.stack([m for _, m in checks])
    return tf.where(tf.reduce_all(holds), tf.constant(""),
                    tf.gather(messages, tf.argmin(tf.cast(holds, tf.int32))))


@tf.custom_gradient
def _scale_gradient_by(x, factor):
    return tf.identity(x), lambda grad: (grad * factor, None)


def _scale_gradient(x: tf.Tensor, factor: float) -> tf.Tensor:
    """``x`` itself, whose gradient is multiplied by ``factor`` (in float32)."""
    if factor == 1.0:
        return x
    return _scale_gradient_by(x, tf.constant(factor, x.dtype))
