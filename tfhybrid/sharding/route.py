"""The route of a DistributedEmbedding's ids and rows, as named stages.

One step of the forward, as :meth:`EmbeddingRoute.forward` runs it:

1. ``bags_of``: the fed features as bags (ids and bag lengths);
2. ``prepare`` (this rank alone): the id check's report (``sharding/id_check.py``) and
   the ids for their owners, what the collectives will send; ``TrainPipeline`` runs it
   a batch ahead;
3. ``exchange`` (collectives): every rank checks every rank's report (one allgather, so
   bad input fails on every rank at once instead of hanging a collective), then the ids
   travel to the position owning each shard (one ``alltoall`` in the model group);
   each store turns them into the rows it reads (a tiered shard's cache slots);
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
from typing import Any, Sequence

import tensorflow as tf

from tfhybrid import collectives
from tfhybrid import compression
from tfhybrid.combiners import combined_bags
from tfhybrid import mesh as mesh_lib
from tfhybrid.plan.types import Kind, ShardingPlan
from tfhybrid.sharding.bags import BagReader, Bags
from tfhybrid.sharding import phases
from tfhybrid.sharding.id_check import IdCheck, first_failure
from tfhybrid.sharding.ownership import ownership_of
from tfhybrid.sharding.stores import ShardReplicas, StoreSet
from tfhybrid.sharding.tables import TableSpec


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
        self.dp_input = dp_input
        self.stores = stores
        # the empty variable that rides along with the rows (the layer's build says why)
        self.anchor = anchor
        self.compute_dtype = compute_dtype
        # DCT-MP: the share of each sample's returned rows the alltoall carries
        self.mp_keep = mp_keep
        self.replica_sync = replica_sync
        self.bag_reader = BagReader(name, mesh, plan, tables, input_table_map,
                                    fed_features, dp_input)
        # what a tiered shard's store needs to load its replicas' ids alike
        self.replicas = ShardReplicas(name, mesh, replica_sync)
        self.id_check = IdCheck(name, mesh, tables, input_table_map, dp_input,
                                [plan.tables[t].kind for t in range(len(self.tables))])
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
        # a dynamic table's keys are any int64
        self.wire_id_dtype = (tf.int32 if all(t.rows < 2**31 and t.keyed is None
                                              for t in self.tables) else tf.int64)
        compute = tf.as_dtype(compute_dtype)
        # under mixed precision, rows and their gradients cross in 16 bits
        self.wire_float = compute if compute in (tf.float16, tf.bfloat16) else tf.float32

    def forward(self, inputs: Any, caller: Any, training: Any = None, weights: Any = None
                ) -> tuple[list, Any]:
        """The layer's outputs for ``inputs`` (with per-id ``weights``, one entry per
        input or None) and the local batch; ``caller`` (the layer) is who a
        ``TrainPipeline`` phase knows the route by; ``training=False``: the stores only
        find rows (a dynamic table admits no key)."""
        bags, local_batch, invalid = self.bags_of(inputs, weights)
        phase = phases.phase_of(caller)
        if phase is not None and phase.routing:
            # TrainPipeline reads this batch ahead: it keeps what the route will send (its
            # collectives run in the next step's function) and stops here
            phase.hand_over(caller, self.prepare(bags, local_batch, invalid, phase.ended))
            return self.placeholders(bags), local_batch
        if phase is None:
            # 2-3. validate on every rank together, then ids to their owners
            bags, routed = self.checked_route(bags, local_batch, invalid,
                                              inference=training is False)
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
                outputs.append(self.finish(bags[f], self.stores.lookup(
                    t, 0, bags[f].values, bags[f].lengths, weights=bags[f].weights)))
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

    def bags_of(self, inputs, weights=None) -> tuple[dict, Any, dict]:
        """Stage 1 (:class:`~tfhybrid.sharding.bags.BagReader`): the fed features as bags
        (with their per-id weights), the local batch, and dp_input=False's bad inputs."""
        return self.bag_reader.bags_of(inputs, weights)

    def checked_route(self, bags: dict, batch, invalid: dict, inference: bool = False
                      ) -> tuple[dict, list]:
        """Stages 2-3: the checked bags and the ids of the routes this position owns.

        The routed ids are :class:`~tfhybrid.sharding.phases.Exchanged`'s ``routed``,
        what :meth:`look_up_and_return` looks up (a tiered shard's ids as cache slots, its
        rows loaded). A failed check raises on every rank before any id leaves this one.
        """
        exchanged = self.exchange(self.prepare(bags, batch, invalid, inference=inference))
        with tf.control_dependencies(exchanged.asserts):
            bags = {f: dataclasses.replace(b, values=tf.identity(b.values))
                    for f, b in bags.items()}
        return bags, exchanged.routed

    def prepare(self, bags: dict, batch, invalid: dict, ended=None, inference: bool = False
                ) -> phases.Prepared:
        """Stage 2, the route's first half, on this rank alone: what its collectives will
        send (the id check's report, the batch, and the ids for their owners, or with
        ``dp_input=False`` this position's own route ids) and the trace-time facts that
        :meth:`exchange` reads them by.

        ``ended`` (a bool tensor, ``TrainPipeline``'s) says that this rank's input has
        ended and ``bags`` only stand in for a batch; the ranks agree on it in the same
        allgather that checks the ids. A pipeline prepares batch t+2 during step t and
        sends it during step t+1, so nothing here may touch a variable. ``inference``:
        the stores will only find rows (``training=False``).
        """
        report = self.id_check.report(bags, batch, invalid, ended)
        mine = self.routes[self.mesh.model_position]
        parts = []
        if any(self.routes):
            if self.dp_input:
                parts = list(self._ids_payload(bags))
            else:
                # the input already holds the model group's batch of this position's
                # features
                shard_ids = [self._shard_ids(bags[r.feature], r) for r in mine]
                parts = ([ids for ids, *_ in shard_ids] + [n for _, n, *_ in shard_ids]
                         + [w for _, _, *w in shard_ids for w in w])
        # bags per sample of each route: ints where the hotness is static; a hotness
        # known only at run time (None here) travels as a tensor after the parts, so
        # that a pipeline's read-ahead carries it to the step that sends
        per_route = [bags[r.feature].per_sample for r in mine] if self.dp_input else []
        static = tuple(k if isinstance(k, int) else None for k in per_route)
        run_time = [tf.cast(k, tf.int64) for k in per_route if not isinstance(k, int)]
        reasons = [reason for reason in invalid.values() if reason] + [
            f"if so, {bag.unsupported_reason}" for bag in bags.values()
            if bag.unsupported_reason]
        weighted = tuple(bags[r.feature].weights is not None for r in mine)
        facts = phases.RouteFacts(reasons=tuple(reasons[:1]), bags_per_route=static,
                                  read_ahead=ended is not None, inference=inference,
                                  weighted=weighted)
        return phases.Prepared([report, tf.cast(batch, tf.int64)] + parts + run_time, facts)

    def exchange(self, prepared: phases.Prepared) -> phases.Exchanged:
        """Stage 3, the route's second half: its collectives on what :meth:`prepare`
        made, and what follows them (:class:`~tfhybrid.sharding.phases.Exchanged`).

        The only variables it touches are tiered shards' caches, where it fills slots
        that neither this batch nor the one before uses (``pinned_calls``), so
        ``TrainPipeline`` may run it a step ahead.
        """
        facts, sending = prepared.facts, prepared.sending
        counted = len(sending) - facts.run_time_counts
        run_time = iter(sending[counted:])
        bags_per_route = tuple(next(run_time) if k is None else k
                               for k in facts.bags_per_route)
        report, batch = sending[0], sending[1]
        parts = list(sending[2:counted])
        checks, all_ended = self.id_check.checks(report, facts.reasons, facts.read_ahead)
        if facts.read_ahead:
            # TrainPipeline raises after the step it runs beside has finished, so that a
            # bad batch read ahead cannot cut that step's update short
            failure, asserts = first_failure(checks), []
        else:
            failure = None
            asserts = [tf.debugging.Assert(holds, [message]) for holds, message in checks]
        if not any(self.routes):
            return phases.Exchanged([], all_ended, failure, asserts)
        if asserts:
            with tf.control_dependencies(asserts):
                parts = [tf.identity(part) for part in parts]
        if self.dp_input:
            route_ids, route_lengths, route_weights = self._ids_received(
                parts[0], parts[1], batch, bags_per_route, facts.weighted)
        else:
            count = len(facts.weighted)
            route_ids, route_lengths = parts[:count], parts[count:2 * count]
            route_weights = parts[2 * count:]
        # the routed ids become the rows each store reads (a tiered shard's cache
        # slots, their rows loaded now: read ahead by a pipeline, the rows are in the
        # cache before the step that looks them up)
        for i, r in enumerate(self.routes[self.mesh.model_position]):
            route_ids[i] = self.stores.get(r.table, r.shard).rows_of(
                route_ids[i], self.replicas, f"{r.feature}_{r.shard}",
                insert=not facts.inference)
        return phases.Exchanged(route_ids + route_lengths + route_weights, all_ended, failure,
                                asserts)

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

    def _shard_ids(self, bag: Bags, route: RouteEntry) -> tuple:
        """The route's ids (relative to its shard) and the number of them in each bag,
        as its table's kind owns rows (``sharding/ownership.py``), and their weights
        where the feature has them (a third value)."""
        return ownership_of(self.plan.tables[route.table].kind).shard_ids(
            bag.values, bag.lengths, route, self.mesh.model_parallel, bag.weights)

    def _ids_payload(self, bags: dict) -> tuple[tf.Tensor, tf.Tensor]:
        """dp_input=True, stage 2's payload: to each position of the model group, the bag
        lengths, the ids and the weights (of weighted features) of its routes, in one
        buffer, and each one's size."""
        wire = self.wire_id_dtype
        # to each position, [lengths of its routes | ids of its routes | weights of its
        # weighted routes, float32 bits as ints: one alltoall carries them all, exactly]
        payloads, sizes = [], []
        for routes in self.routes:
            lengths, values, weights = [], [], []
            for r in routes:
                owner_ids, bag_lengths, *owner_weights = self._shard_ids(bags[r.feature], r)
                lengths.append(tf.cast(bag_lengths, wire))
                values.append(tf.cast(owner_ids, wire))
                weights += [tf.cast(tf.bitcast(w, tf.int32), wire) for w in owner_weights]
            payload = (tf.concat(lengths + values + weights, 0) if routes
                       else tf.zeros([0], wire))
            payloads.append(payload)
            sizes.append(tf.size(payload, out_type=tf.int32))
        return tf.concat(payloads, 0), tf.stack(sizes)

    def _ids_received(self, payload: tf.Tensor, sizes: tf.Tensor, batch,
                      bags_per_route: tuple, weighted: tuple) -> tuple[list, list, list]:
        """dp_input=True, stage 3: every rank sends each owner the ids of its routes
        (:meth:`_ids_payload`). Returns, for each route this position owns (of
        ``bags_per_route`` bags per sample), the ids and bag lengths of all M ranks'
        samples, in rank order, and the weights of the ``weighted`` ones."""
        mesh = self.mesh
        group = mesh.model_parallel
        received, received_sizes = collectives.alltoall(
            payload, sizes, mesh.model_process_set, group, f"tfhybrid_{self.name}_ids")
        mine = self.routes[mesh.model_position]
        header = batch * sum(bags_per_route)
        route_lengths = [[] for _ in mine]
        route_ids = [[] for _ in mine]
        route_weights = [[] for _ in mine]
        with_weights = [i for i, w in enumerate(weighted) if w]
        for chunk in tf.split(received, received_sizes, num=group):
            head = tf.cast(chunk[:header], tf.int64)
            lengths = tf.split(head, [batch * k for k in bags_per_route], num=len(mine)) \
                if mine else []
            counts = [tf.reduce_sum(x) for x in lengths]
            if not mine:
                continue
            if with_weights:
                total = tf.add_n(counts)
                body = chunk[header:header + total]
                bits = tf.split(tf.cast(chunk[header + total:], tf.int32),
                                tf.stack([counts[i] for i in with_weights]),
                                num=len(with_weights))
                for i, b in zip(with_weights, bits):
                    route_weights[i].append(tf.bitcast(b, tf.float32))
            else:
                body = chunk[header:]
            ids = tf.split(body, tf.stack(counts), num=len(mine))
            for i in range(len(mine)):
                route_lengths[i].append(lengths[i])
                route_ids[i].append(ids[i])
        return ([tf.cast(tf.concat(x, 0), tf.int64) for x in route_ids],
                [tf.concat(x, 0) for x in route_lengths],
                [tf.concat(route_weights[i], 0) for i in with_weights])

    def look_up_and_return(self, bags: dict, batch, routed: list, pipeline_step=None
                           ) -> dict:
        """Stage 4: owner lookups of the routed ids (:meth:`checked_route`), rows back.

        Returns each (feature, shard)'s rows for this rank's samples. ``pipeline_step``
        (a ``TrainPipeline`` step's phase, or None) is handed the rows as they go into
        the alltoall and as they come out: the read-ahead's work waits for them.
        """
        mesh = self.mesh
        group = mesh.model_parallel
        mine = self.routes[mesh.model_position]
        route_ids, route_lengths = routed[:len(mine)], routed[len(mine):2 * len(mine)]
        received_weights = iter(routed[2 * len(mine):])

        # 4. owner: look up and sum the bags of all M ranks of the model group (each row
        # times its weight in weighted bags)
        sums = []
        for i, r in enumerate(mine):
            bag = bags[r.feature]
            weights = None if bag.weights is None else next(received_weights)
            summed = self.stores.lookup(r.table, r.shard, route_ids[i], route_lengths[i],
                                        weights=weights)
            if not self.dp_input and bag.combiner in ("mean", "sqrtn"):
                # only the owner sees whole bags here (a row shard's ids are a part)
                summed = combined_bags(summed, bag.combiner, bag.lengths)
            sums.append(tf.reshape(summed, [group, -1]))   # [source, bags * width]
        if group == 1:
            return self._kept_here(mine, sums)

        # 4, continued: send each source its rows back: one flat buffer per source
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
        # the optimizer's sync is a plain average (tfhybrid/distributed/sync.py). Every rank,
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
        """Stage 4 in a model group of one: this rank owns every route and keeps its rows.

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

    def finish(self, bag, summed):
        if bag.combiner in ("mean", "sqrtn"):
            # whole bags are here, the sums of every shard added up (a weighted bag's
            # divisor is in its weights already, and its combiner "sum")
            summed = combined_bags(summed, bag.combiner, bag.lengths)
        if bag.out_shape is not None:
            # the batch, not -1: with zero hotness the size says nothing about it
            summed = tf.reshape(summed, [bag.batch, bag.out_shape, summed.shape[-1]])
        return tf.cast(summed, self.compute_dtype)


@tf.custom_gradient
def _scale_gradient_by(x, factor):
    return tf.identity(x), lambda grad: (grad * factor, None)


def _scale_gradient(x: tf.Tensor, factor: float) -> tf.Tensor:
    """``x`` itself, whose gradient is multiplied by ``factor`` (in float32)."""
    if factor == 1.0:
        return x
    return _scale_gradient_by(x, tf.constant(factor, x.dtype))
