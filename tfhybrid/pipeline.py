"""TrainPipeline: the next batch's ids alltoall runs beside this step's compute.

A step of a hybrid model runs its phases one after another: read the batch, check its ids
on every rank (one allgather), send them to their owners (one ``alltoall`` in the model
group), look up, exchange rows, run the towers, sync and apply gradients. Only the look-up
needs the tables as the previous step left them. ``TrainPipeline`` splits the route
(``DistributedEmbedding.route``'s ``prepare`` / ``exchange``) and runs, in one
function, step t, the route's collectives for batch t+1 on what the call before
prepared, and the preparation of batch t+2; they share no variable. The preparation
runs while the step waits for its rows; the collectives cross beside the look-ups or,
once the rows have arrived, beside the towers, whichever the pipeline timed faster; and
step t+1 then starts at the look-up with those routed ids. The look-up still follows
step t's update, so the results are those of the plain loop, bit for bit
(TorchRec's ``TrainPipelineSparseDist`` makes the same promise). Batches come from the
input pipeline's own prefetch.

How the ids of a batch are found without running the model: the route calls the model on
the batch's inputs (``training=False``) with every ``DistributedEmbedding`` in routing
mode; each routes its ids, hands them over and returns zeros, and once the last layer has
handed over the forward stops. So any model works whose embedding ids are computed from
its inputs before the towers run, functional or subclassed.

The route's checks (ids in range, equal batch sizes, and whether every rank has another
batch) do not stop the function: they come back as a message that ``progress`` raises on
every rank after the step has finished, so a bad batch read ahead cannot cut the update of
the step beside it short.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Iterator

import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid.sharding import phases

_LOG = logging.getLogger("tfhybrid")

# Where batch t+1's route collectives start in step t's function: True, once the step's
# rows have arrived (beside the towers); False, with the function (beside the look-ups).
# Which is faster depends on the model and the machine (benchmarks/pipeline_overlap.py
# times both, forced, beside the pipeline's own choice; the gap has ranged from 0 to 9 ms
# a step, either way, across tower sizes and runs). Both give the same results bit for
# bit, so a pipeline times both, alternating, over its first pipelined steps (after one
# untimed call of each, which traces) and keeps the one with the least mean over the
# ranks of each rank's median step.
PLACEMENTS = (True, False)
_PLACEMENT_NAMES = {True: "once the step's rows have arrived", False: "with the step"}
TRIAL_STEPS = 12   # timed steps per placement


def _relaxed(spec: Any) -> Any:
    """``spec`` with any batch size: the ids alltoall's output varies from step to step,
    and a ragged or last batch may be shorter, but each function traces once."""
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensorSpec([None] + spec.shape[1:], spec.dtype, spec.ragged_rank,
                                   spec.row_splits_dtype, spec.flat_values_spec)
    if isinstance(spec, tf.SparseTensorSpec):
        return tf.SparseTensorSpec([None] + spec.shape[1:], spec.dtype)
    if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
        return tf.TensorSpec([None] + spec.shape[1:], spec.dtype)
    return spec


def _signature_of(value: Any) -> Any:
    try:
        return tf.nest.map_structure(lambda v: _relaxed(tf.type_spec_from_value(v)), value)
    except (TypeError, ValueError):
        return None   # not all tensors: the function retraces as tf.function would


def _traced(fn: Callable, example: tuple) -> tuple[Callable, list | None]:
    """``fn`` traced once for arguments like ``example`` (any batch size) followed by a
    bool (this rank's input has ended), and that input signature; None when the
    arguments are not all tensors (then it retraces as ``tf.function`` would)."""
    signature = _signature_of(example)
    if signature is not None:
        signature = list(signature) + [tf.TensorSpec([], tf.bool)]
    return tf.function(fn, input_signature=signature, reduce_retracing=True), signature


def _raise_failure(failure: tf.Tensor) -> None:
    message = failure.numpy().decode()
    if message:
        raise tf.errors.InvalidArgumentError(None, None, message)


def _end_of_input() -> tuple:
    return (StopIteration, tf.errors.OutOfRangeError)


class TrainPipeline:
    """Runs training steps with the next batch's ids already sent to their owners.

    Beside step t, in the same function, batch t+1's ids are checked on every rank and
    sent through the model group's ``alltoall`` (the route's stage 3; the stages are
    numbered in ``tfhybrid.sharding.phases``), their payload prepared in the call before,
    and batch t+2's are prepared. Step t+1
    then starts at the look-up, after step t's update, so the weights are those of the
    plain loop bit for bit. Batch t+1's collectives run beside the look-ups or, once the
    step's rows have arrived, beside the towers: over its first 2 * (TRIAL_STEPS + 1)
    pipelined steps the pipeline times both, alternating, and the ranks keep the faster.

    Args:
      model: the Keras model holding one or more ``DistributedEmbedding`` layers.
      train_step: ``train_step(batch)`` for a custom loop (the Python function; a
        ``tf.function`` is unwrapped). ``None``: Keras' ``model.train_step``, and
        ``model.fit`` / ``train_on_batch`` run through the pipeline until :meth:`detach`.
      model_inputs: ``model_inputs(batch)`` gives what the model is called on; ``None``:
        ``x`` of Keras' ``(x, y[, sample_weight])`` batches.
      enabled: ``False`` runs the same steps one after another (for debugging).

    ``progress(iterator)`` trains one batch and returns what the train step returned. It
    reads two batches ahead of the step it runs; at the end of the input it trains the
    last batch, and the call after raises ``StopIteration``.

    Example (one process; under horovodrun the same code overlaps the alltoall)::

        import tensorflow as tf
        import tfhybrid
        from tfhybrid.layers import DistributedEmbedding, Embedding
        tfhybrid.init(model_parallel=1)
        ids = tf.keras.Input([], dtype=tf.int64)
        vectors = DistributedEmbedding([Embedding(100, 4)])([ids])[0]
        model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(vectors))
        model.compile(tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), "mse")
        tfhybrid.TrainPipeline(model)          # model.fit now reads ahead
        model.fit(tf.data.Dataset.from_tensor_slices(
            (tf.range(8, dtype=tf.int64), tf.ones([8, 1]))).batch(4), verbose=0)
    """

    def __init__(self, model: tf.keras.Model, train_step: Callable | None = None,
                 model_inputs: Callable | None = None, enabled: bool = True):
        _tf_internals.install_autograph_rule()
        if not isinstance(model, tf.keras.Model):
            raise ValueError(f"TrainPipeline needs a tf.keras.Model; got {model!r}")
        if train_step is not None and not callable(train_step):
            raise ValueError(f"train_step={train_step!r} must be callable (batch -> outputs)")
        if model_inputs is not None and not callable(model_inputs):
            raise ValueError(f"model_inputs={model_inputs!r} must be callable "
                             "(batch -> the model's inputs)")
        self.model = model
        self.enabled = bool(enabled)
        self._keras = train_step is None
        self._train_step = (self._keras_step if self._keras
                            else getattr(train_step, "python_function", train_step))
        self._model_inputs = model_inputs or (
            lambda batch: tf.keras.utils.unpack_x_y_sample_weight(batch)[0])
        # found by their class (a layer's route exists once it is built, and a subclassed
        # model builds its layers on the first batch)
        self._layers = [m for m in _tf_internals.layers_in(model)
                        if hasattr(type(m), "route")]
        # (iterator, batch t and its routed ids, batch t+1 and what its route sends)
        self._pending: tuple | None = None
        self._last_batch = None   # stands in for a batch once this rank's input ended
        self._route_fn = self._prepare_fn = self._plain_fn = None
        # per placement (PLACEMENTS): the traced step, and (concrete function, flat
        # input specs) for _call_fused
        self._fused_fns: dict[bool, Any] = {}
        self._fused_flat: dict[bool, tuple | None] = {}
        # None while both placements are timed (seconds per step, untimed first call
        # left out), then the faster one
        self._placement: bool | None = None
        self._trial: dict[bool, list] = {p: [] for p in PLACEMENTS}
        if self._keras:
            _tf_internals.replace_make_train_function(model, self._make_train_function)

    # ------------------------------------------------------------ custom loops
    def progress(self, iterator: Iterator) -> Any:
        """Trains the next batch of ``iterator`` and returns the train step's outputs."""
        if not self.enabled or not self._layers:
            if self._plain_fn is None:
                self._plain_fn = tf.function(self._train_step, reduce_retracing=True)
            return self._plain_fn(next(iterator))
        if self._pending is None or self._pending[0] is not iterator:
            # a batch read ahead from another iterator is one the plain loop never reads
            self._pending = self._start(iterator)
            if self._pending is None:
                raise StopIteration
        _, batch, routed, following, sending = self._pending
        self._pending = None
        after, ended = self._next_batch(iterator)
        placement = self._next_placement()
        started = time.perf_counter()
        outputs, routed_next, all_ended, failure, sending_next = self._call_fused(
            placement, (batch, routed, sending, self._model_inputs(after),
                        tf.constant(ended)))
        # the step has finished: a bad batch read ahead fails only now, on every rank
        _raise_failure(failure)
        if self._placement is None:
            self._time_placement(placement, time.perf_counter() - started)
        if not bool(all_ended):
            self._pending = (iterator, following, routed_next, after, sending_next)
        return outputs

    def _next_placement(self) -> bool:
        """The placement of this step's route collectives: the chosen one, or while
        both are timed, each in turn."""
        if self._placement is not None:
            return self._placement
        if self._layers[0].mesh.size == 1:
            # no rows cross a collective: both placements are the same function
            self._placement = PLACEMENTS[0]
            return self._placement
        counts = {p: len(self._trial[p]) for p in PLACEMENTS}
        return min(PLACEMENTS, key=lambda p: (counts[p], PLACEMENTS.index(p)))

    def _time_placement(self, placement: bool, seconds: float) -> None:
        """Records a step of ``placement`` (the first, which traced, as None); once
        both have TRIAL_STEPS, the ranks agree on the faster in one allgather (every
        rank gets here at the same step: they step together)."""
        self._trial[placement].append(None if not self._trial[placement] else seconds)
        if any(len(self._trial[p]) < TRIAL_STEPS + 1 for p in PLACEMENTS):
            return
        from tfhybrid import collectives
        medians = [statistics.median(self._trial[p][1:]) for p in PLACEMENTS]
        everyone = collectives.allgather(tf.constant([medians], tf.float64),
                                         self._layers[0].mesh.size,
                                         "tfhybrid_pipeline_placement").numpy()
        # every rank computes the same choice from the same numbers
        mean = everyone.mean(axis=0)
        self._placement = PLACEMENTS[int(mean.argmin())]
        if self._layers[0].mesh.rank == 0:   # the same numbers on every rank
            timed = ", ".join(f"{1e3 * m:.1f} ms {_PLACEMENT_NAMES[p]}"
                              for p, m in zip(PLACEMENTS, mean))
            _LOG.info("TrainPipeline: the next batch's route collectives start %s (median "
                      "step, mean over the ranks: %s)", _PLACEMENT_NAMES[self._placement],
                      timed)

    def _call_fused(self, placement: bool, args: tuple) -> tuple:
        """``_step_and_route(placement, *args)`` as one traced function, called
        through its one concrete function with the arguments already flat.

        ``tf.function``'s own call matches every argument against the input signature
        each step: with a batch, the batch read ahead and two tensors per route, about
        70 tensors, that cost 1.6 ms of Python per step (a pipelined step of the
        benchmark's small model on one process: 9.4 ms, 7.7 ms called flat), CPU the
        route is meant to save. The signature is fixed, so the match only confirms each
        tensor's dtype and shape, which are checked here; anything else takes the
        checked path (which retraces or raises)."""
        if placement not in self._fused_fns:
            def fused(batch, routed, sending, after, ended):
                return self._step_and_route(placement, batch, routed, sending, after, ended)
            fn, signature = _traced(fused, args[:-1])
            self._fused_fns[placement], self._fused_flat[placement] = fn, None
            if signature is not None:
                concrete = fn.get_concrete_function(*args)
                if _tf_internals.has_flat_call(concrete):
                    self._fused_flat[placement] = (concrete, tf.nest.flatten(
                        signature, expand_composites=True))
        fused_flat = self._fused_flat[placement]
        flat = tf.nest.flatten(args, expand_composites=True)
        if fused_flat is not None and len(flat) == len(fused_flat[1]) and all(
                t.dtype == spec.dtype and spec.shape.is_compatible_with(t.shape)
                for t, spec in zip(flat, fused_flat[1])):
            concrete = fused_flat[0]
            return _tf_internals.call_concrete(concrete, flat)
        return self._fused_fns[placement](*args)

    # ------------------------------------------------------------ what it chose
    @property
    def placement(self) -> bool | None:
        """Where the next batch's route goes in the step (a member of ``PLACEMENTS``:
        True once the step's rows have arrived, False with the step), the same on every
        rank; None while both are being timed."""
        return self._placement

    @placement.setter
    def placement(self, placement: bool) -> None:
        # a fixed placement instead of the timed choice (to measure one placement alone)
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
        self._placement = placement

    @property
    def trial_seconds(self) -> dict[bool, list]:
        """Per placement, the step times the choice is made from (the first step of each,
        which traces, is None and not counted)."""
        return {p: list(times) for p, times in self._trial.items()}

    @property
    def traced_steps(self) -> dict[bool, Any]:
        """Per placement timed or chosen so far, the traced pipelined step (a
        ``tf.function``: its graph shows what the route waits for)."""
        return dict(self._fused_fns)

    @property
    def layers(self) -> list:
        """The DistributedEmbedding layers whose routes it runs ahead."""
        return list(self._layers)

    def detach(self) -> None:
        """``model.fit`` runs Keras' own train function again (a read-ahead is dropped)."""
        if self._keras:
            _tf_internals.restore_make_train_function(self.model, self._make_train_function)
        self._pending = None

    # ------------------------------------------------------------ the phases
    def _next_batch(self, iterator: Iterator) -> tuple[Any, bool]:
        """The next batch, or (once this rank's input has ended) the last one again as a
        stand-in: whether every rank has another batch is agreed in the id check's
        allgather, and the check fails on every rank if only some ranks' input ended."""
        try:
            self._last_batch = next(iterator)
            return self._last_batch, False
        except _end_of_input():
            return self._last_batch, True

    def _start(self, iterator: Iterator) -> tuple | None:
        """What the first step of ``iterator`` needs (``_pending``): its first batch,
        routed on its own, and the second, prepared; None if the input is empty."""
        first = self._read(iterator, first=True)
        if first is None:
            return None
        following, ended = self._next_batch(iterator)
        inputs = self._model_inputs(following)
        if self._prepare_fn is None:
            self._prepare_fn, _ = _traced(
                lambda inputs, ended: [p.sending for p in self._prepare(inputs, ended)],
                (inputs,))
        return first + (following, self._prepare_fn(inputs, tf.constant(ended)))

    def _read(self, iterator: Iterator, first: bool = False) -> tuple | None:
        """The next batch and its routed ids, on their own (the first batch of an
        iterator); None at the end of the input on every rank. Before the first batch
        there is no stand-in, so the ranks agree in a collective of their own."""
        batch, ended = self._next_batch(iterator)
        if first:
            self._agree_on_first(not ended)
        if ended and (first or batch is None):
            return None
        if self._route_fn is None:
            self._route_fn, _ = _traced(self._route, (self._model_inputs(batch),))
        routed, all_ended, failure = self._route_fn(self._model_inputs(batch),
                                                    tf.constant(ended))
        _raise_failure(failure)
        if bool(all_ended):
            return None
        return iterator, batch, routed

    def _agree_on_first(self, present: bool) -> None:
        """Raises on every rank when some ranks' input is empty and others' is not, rather
        than leave those with a batch waiting in its collectives."""
        from tfhybrid import collectives
        mesh = self._layers[0].mesh
        if mesh.size == 1:
            return
        flags = collectives.allgather(tf.constant([[int(present)]], tf.int32), mesh.size,
                                      "tfhybrid_pipeline_first").numpy().reshape(-1)
        if flags.min() != flags.max():
            ended = [r for r, f in enumerate(flags) if not f]
            raise ValueError(phases.ENDED_MESSAGE.format(ended))

    def _route(self, inputs: Any, ended: tf.Tensor) -> tuple[list, tf.Tensor, tf.Tensor]:
        """Stages 1-3 of every DistributedEmbedding for ``inputs``: the routed ids,
        whether every rank's input has ended, and the first failed check's message (or
        "")."""
        return self._exchange(self._prepare(inputs, ended))

    def _prepare(self, inputs: Any, ended: tf.Tensor) -> list[phases.Prepared]:
        """Stages 1-2 of every DistributedEmbedding's route for ``inputs``: per layer,
        what its collectives will send and the facts to read it by
        (``EmbeddingRoute.prepare``)."""
        phase = phases.Routing(self._layers, ended)
        with phases.PhaseScope(phase):
            try:
                self.model(inputs, training=False)
            except Exception:   # noqa: BLE001 (autograph may rewrap AllRouted)
                if not phase.complete:
                    raise
        missing = [layer.name for layer in self._layers if id(layer) not in phase.prepared]
        if missing:
            raise ValueError(f"TrainPipeline: calling the model did not reach "
                             f"DistributedEmbedding layers {missing}; a pipelined model "
                             "calls every DistributedEmbedding in each forward pass")
        return [phase.prepared[id(layer)] for layer in self._layers]

    def _exchange(self, prepared: list[phases.Prepared]
                  ) -> tuple[list, tf.Tensor, tf.Tensor]:
        """Stage 3: every layer's collectives on what ``_prepare`` made; the routed ids,
        whether every rank's input has ended, and the first failed check's message (or
        "")."""
        routed, failures, all_ended = [], [], None
        for layer, layer_prepared in zip(self._layers, prepared):
            exchanged = layer.route.exchange(layer_prepared)
            routed.append(exchanged.routed)
            failures.append(exchanged.failure)
            all_ended = exchanged.all_ended if all_ended is None else all_ended
        failures = tf.stack(failures)
        failure = tf.gather(failures, tf.argmax(tf.cast(failures != "", tf.int32)))
        return routed, all_ended, failure

    def _step_and_route(self, after_rows: bool, batch: Any, routed: list, sending: list,
                        after: Any, ended: tf.Tensor) -> tuple:
        """Step t on its routed ids, the collectives of batch t+1's route on what the
        call before prepared (``sending``), and the preparation of batch t+2 (``after``),
        in one function. Returns the step's outputs, batch t+1's routed ids, whether
        every rank's input ended there and its failed check's message, and what batch
        t+2's route will send.

        The three share no variable. Batch t+2's preparation (its id check and its ids'
        payload, on this rank alone) starts once the step's rows go into their alltoall,
        so its CPU work runs while the rank waits for them. Batch t+1's collectives start
        once the step's rows have arrived (``after_rows``), crossing while the towers
        compute, or with the function, crossing while the step looks up its rows: where
        the link and Horovod's one queue of collectives have the longer idle window
        depends on the model (``PLACEMENTS``). A route in one piece used neither:
        Horovod's timeline showed its collectives issued with the rows alltoall and run
        before it, and its CPU beside the look-ups.
        """
        phase = phases.Stepping(self._layers, routed)
        with phases.PhaseScope(phase):
            outputs = self._train_step(batch)
        phase.check_all_taken()
        with tf.control_dependencies(phase.sent):
            prepared_next = self._prepare(after, ended)
        if after_rows:
            with tf.control_dependencies(phase.received):
                sending = tf.nest.map_structure(tf.identity, sending)
        # the facts are trace-time values of a layer and a batch structure, alike for
        # every batch of the function's signature: batch t+2's read batch t+1's tensors
        routed_next, all_ended, failure = self._exchange(
            [phases.Prepared(list(sent), p.facts) for sent, p in zip(sending, prepared_next)])
        return (outputs, routed_next, all_ended, failure,
                [p.sending for p in prepared_next])

    # ------------------------------------------------------------ Keras
    def _keras_step(self, batch: Any) -> Any:
        """Keras' step as its own train function runs it (and counts it)."""
        outputs = self.model.train_step(batch)
        with tf.control_dependencies([t for t in tf.nest.flatten(outputs) if tf.is_tensor(t)]):
            _tf_internals.count_train_step(self.model)
        return outputs

    def _make_train_function(self, keras_make: Callable[..., Any], force: bool = False
                             ) -> Callable:
        if not self.enabled:
            return keras_make(force=force)

        def train_function(iterator):
            steps = _tf_internals.steps_per_execution(self.model)
            outputs = None
            for _ in range(steps):
                try:
                    outputs = self.progress(iterator)
                except _end_of_input():
                    if outputs is None:
                        raise
                    break
            return outputs

        return train_function
