"""What the route's stages hand each other, and what a ``TrainPipeline`` call is doing.

Below both the route (``sharding/route.py``) and the pipeline (``tfhybrid/pipeline.py``),
so that neither imports the other. The stages are numbered as in ``sharding/route.py``:

1. ``bags_of``: the fed features as bags;
2. ``prepare`` (this rank alone) returns a :class:`Prepared`: the tensors the
   collectives will send and the trace-time :class:`RouteFacts` to read them by;
3. ``exchange`` (the collectives) returns an :class:`Exchanged`: the routed ids, and the
   id check's outcome;
4. ``look_up_and_return``: owners' lookups, rows back;
5. ``finish``: slices joined, means divided, data-parallel tables looked up.

A ``TrainPipeline`` runs stage 2 a batch ahead and stage 3 a step ahead. While it calls
the model, a phase says what the call is for: :class:`Routing` (the read-ahead: each
layer hands over its :class:`Prepared` and the forward stops once all have) or
:class:`Stepping` (the step: each layer takes the ids routed for it a step earlier).

>>> facts = RouteFacts(reasons=(), bags_per_route=(1, None), read_ahead=False)
>>> facts.run_time_counts
1
>>> phase_of(object()) is None    # no pipeline call is running
True
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from tfhybrid import _tf_internals

_STATE = threading.local()

# when some ranks' input ended and others' did not ({}: the ranks that ran out); a
# template for str.format and tf.strings.format alike
ENDED_MESSAGE = ("TrainPipeline: the input of ranks {} ended while the other ranks had "
                 "another batch; every rank must feed the same number of batches")


@dataclasses.dataclass(frozen=True)
class RouteFacts:
    """Trace-time facts of a prepared batch: the same for every batch one traced
    function sees, so a pipeline may read batch t+1's tensors by batch t+2's facts.

    ``reasons``: why a failed id check failed, if the input says (at most one);
    ``bags_per_route``: bags per sample of each route this position owns, an int where
    the hotness is static, None where it travels as a tensor at the end of ``sending``;
    ``read_ahead``: a pipeline prepared it (the check's outcome comes back as a message
    instead of asserts); ``inference``: a call with ``training=False``, whose stores
    only find rows (a dynamic table admits no key); ``weighted``: for each route this
    position owns, whether its feature has per-id weights (their float32 bits follow
    the ids on the wire)."""
    reasons: tuple[str, ...]
    bags_per_route: tuple[int | None, ...]
    read_ahead: bool
    inference: bool = False
    weighted: tuple[bool, ...] = ()

    @property
    def run_time_counts(self) -> int:
        """How many of ``sending``'s tensors, at its end, are bags-per-sample counts."""
        return self.bags_per_route.count(None)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Stage 2's result: ``sending`` (tensors: the id check's report, the batch size,
    the ids for their owners, then the run-time counts) and its ``facts``."""
    sending: list
    facts: RouteFacts


@dataclasses.dataclass(frozen=True)
class Exchanged:
    """Stage 3's result. ``routed``: for each route this position owns, its ids, then
    each one's bag lengths (all M ranks' samples, in rank order); ``all_ended`` and
    ``failure`` (whether every rank's input has ended, and the first failed check's
    message or "") only for a read-ahead, else None; ``asserts``: otherwise, the checks,
    which every id waits for."""
    routed: list
    all_ended: Any
    failure: Any
    asserts: list


class Routing:
    """The read-ahead's forward: layers hand over what their routes will send (stage
    2), then it stops."""
    routing = True

    def __init__(self, layers: list, ended: Any):
        self._expected = {id(layer) for layer in layers}
        self.ended = ended             # this rank's input has ended: a stand-in batch
        self.prepared: dict[int, Prepared] = {}   # per layer

    @property
    def complete(self) -> bool:
        return self._expected <= set(self.prepared)

    def hand_over(self, layer: Any, prepared: Prepared) -> None:
        if id(layer) in self.prepared:
            raise ValueError(f"TrainPipeline: DistributedEmbedding {layer.name!r} was called "
                             "twice in one forward pass; a pipelined model calls each "
                             "DistributedEmbedding once per step")
        self.prepared[id(layer)] = prepared
        if self.complete:
            raise AllRouted("every DistributedEmbedding has its ids")


class AllRouted(Exception):
    """Stops the read-ahead's forward once the last layer has routed its ids."""


class Stepping:
    """The step's forward: each layer takes the ids routed for it a step earlier."""
    routing = False

    def __init__(self, layers: list, routed: list):
        self._routed = {id(layer): list(ids) for layer, ids in zip(layers, routed)}
        self._names = {id(layer): layer.name for layer in layers}
        self._taken: set[int] = set()
        self.sent: list = []       # each layer's rows as they enter its alltoall
        self.received: list = []   # ... and as they come out of it

    def sending(self, rows: Any) -> None:
        self.sent.append(rows)

    def arrived(self, rows: Any) -> None:
        self.received.append(rows)

    def take(self, layer: Any) -> list:
        key = id(layer)
        if key not in self._routed:
            raise ValueError(f"TrainPipeline: DistributedEmbedding {layer.name!r} is not one "
                             "of the model's layers the pipeline routes for; build the "
                             "pipeline on the model that calls it")
        if key in self._taken:
            raise ValueError(f"TrainPipeline: DistributedEmbedding {layer.name!r} was called "
                             "twice in one step; a pipelined model calls each "
                             "DistributedEmbedding once per step")
        self._taken.add(key)
        return self._routed[key]

    def check_all_taken(self) -> None:
        missing = sorted(name for key, name in self._names.items() if key not in self._taken)
        if missing:
            raise ValueError(
                f"TrainPipeline: the train step did not call DistributedEmbedding layers "
                f"{missing}, whose ids the pipeline routed; pass the Python train step (a "
                "tf.function traced elsewhere keeps its own routing) and call the model in it")


def phase_of(layer: Any) -> Routing | Stepping | None:
    """What ``layer`` is called for: None (a plain call), a read-ahead or a step. A call
    on symbolic tensors (Keras 3 building a model on its first call, inside the
    read-ahead's forward) is a plain call: its ops never run."""
    if _tf_internals.in_symbolic_call():
        return None
    return getattr(_STATE, "phase", None)


class PhaseScope:
    """``with PhaseScope(phase):`` the model calls inside are for ``phase``."""

    def __init__(self, phase: Routing | Stepping):
        self.phase = phase

    def __enter__(self) -> Routing | Stepping:
        self._outer = getattr(_STATE, "phase", None)
        _STATE.phase = self.phase
        return self.phase

    def __exit__(self, *exc_info) -> None:
        _STATE.phase = self._outer
