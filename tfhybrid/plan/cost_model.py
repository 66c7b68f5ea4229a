"""Communication and compute cost model of a D x M mesh: what a plan's step costs.

Pure Python (no TensorFlow, no Horovod): it prices a :class:`~tfhybrid.plan.types.ShardingPlan`
on a :class:`ClusterSpec` for a :class:`Workload` and returns a :class:`Prediction`
(per-rank memory, bytes per collective per link, step time). Every byte count comes from
the planner's rules (:func:`tfhybrid.plan.traffic.position_traffic`, ``sync_bytes``,
``weight_sync_bytes``, ``optimizer_state_bytes``); this module adds only where the bytes go
(which links a collective crosses) and how long they take.

Placement. Ranks fill nodes in order: node = rank // ranks_per_node. Groups come from
:func:`tfhybrid.mesh.mesh_groups` (model_major: model group d = ranks d*M .. d*M+M-1, data
group p = {p, M+p, ...}; data_major the roles swapped). A rank's intra-node link carries
``intra_node_bandwidth`` bytes/s per direction; a node's NIC ``inter_node_bandwidth``
bytes/s per direction, shared by every rank of that node and every group crossing it
(all groups of one kind run their collective at the same time).

Collective costs (the design notes' "Collective costs"), group of n ranks, c of them on a
rank's node, α the latency of the link a message crosses:

* alltoall, rank q sends X_q spread evenly over the n-1 others:
  intra bytes of q = X_q (c-1)/(n-1); NIC bytes of a node = Σ_q on it X_q (n-c)/(n-1);
  t = max_q [(c-1) α_intra + (n-c) α_inter] + max(max intra / β_intra, max NIC / β_inter).
  Three per step: ids (forward), activations (forward), activation gradients (backward).
* ring allreduce of S bytes (ranks in rank order): every ring edge carries 2(n-1)/n · S;
  an edge between nodes loads the sender's NIC, one inside a node the sender's link;
  t = 2(n-1) α + max(max intra / β_intra, max NIC / β_inter), α = α_inter if the group
  spans nodes. ``allreduce="hierarchical"``: reduce-scatter inside the node (c ranks),
  ring over the k nodes, allgather inside: intra 2(c-1)/c · S per rank, NIC 2(k-1)/k · S
  per group, t = 2(c-1) α_intra + 2(k-1) α_inter + intra / β_intra + NIC / β_inter.
* ring allgather, rank part U: every edge carries (n-1) U; t = (n-1) α + link terms.

Syncs: a shard's data group syncs its gradient every step (dense allreduce or sparse
allgather, whichever moves fewer bytes: the planner's ``sync_is_sparse``) or, in weight
mode, allreduces weights + optimizer state every K steps (its cost / K per step);
data-parallel tables and the dense layers allreduce over all N ranks.

Step time = step_overhead + collective_overhead * (collective calls per step)
+ max over positions of [lookup bytes / lookup rate + apply bytes / apply rate]
+ dense_seconds_per_sample * b + Σ collective seconds
- overlap * min(compute, Σ seconds of the gradient syncs) (``ComputeRates.overlap``,
fitted: 0 means the collectives never run while the rank computes). Only the gradient
syncs (shard gradients, dense and replicated tables) can hide: Horovod reduces them in its
background thread while the backward pass goes on. The alltoalls sit on the critical path
(the forward needs the activations, the owners' apply needs their gradients) and a weight
sync runs between steps.

Memory per rank = table params + optimizer state (the planner's) + dense params and their
optimizer state + embedding activations held from forward to backward (planner's
``activation_bytes``).

The cost strategy that searches plans with this model is :mod:`tfhybrid.plan.cost_strategy`;
fitting :class:`ComputeRates` to measured steps is :mod:`tfhybrid.plan.calibration`.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from tfhybrid.mesh import LAYOUTS, mesh_groups
from tfhybrid.plan.traffic import PositionTraffic, positions_traffic
from tfhybrid.plan.types import (DTYPE_BYTES, OPTIMIZERS, REPLICA_SYNC, ShardingPlan,
                                 TableConfig, aligned_table, check_int, check_number,
                                 check_tables, format_bytes, optimizer_state_bytes)

ALLREDUCE_ALGORITHMS = ("ring", "hierarchical")
# Zipf exponent of the default unique-rows estimate: the design notes' kernel anchor
# (Zipf(1.05) ids) -- a typical CTR id skew
DEFAULT_ZIPF_EXPONENT = 1.05
# the dense layers' gradients and weights: float32
DENSE_VALUE_BYTES = 4


@dataclass(frozen=True)
class ComputeRates:
    """Measured compute rates of one rank (fit them: ``tfhybrid.plan.calibration``).

    ``lookup_bytes_per_s``: embedding lookup + combine, forward and backward, per byte
    of rows read (the planner's lookup bytes); ``apply_bytes_per_s``: per optimizer, the
    sparse apply's rate per byte of updated rows + their state; ``dense_seconds_per_sample``:
    the dense towers' forward + backward + apply; ``step_overhead_seconds``: fixed per step;
    ``collective_overhead_seconds``: software cost of one collective call; ``overlap``:
    the share of the shorter of compute and the gradient syncs that runs concurrently with
    the other (Horovod's background thread reduces one variable's gradient while the
    backward pass computes the next; 0 = strictly one after the other). ``math.inf`` rates mean free.

    >>> rates = ComputeRates(2e9, {"sgd": 1e9}, 1e-6, 1e-3, 1e-4)
    >>> rates.apply_rate("sgd"), ComputeRates.from_dict(rates.to_dict()) == rates
    (1000000000.0, True)
    """

    lookup_bytes_per_s: float
    apply_bytes_per_s: Any   # Mapping[str, float]; stored as sorted (name, rate) pairs
    dense_seconds_per_sample: float = 0.0
    step_overhead_seconds: float = 0.0
    collective_overhead_seconds: float = 0.0
    overlap: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.overlap, (int, float)) and not isinstance(self.overlap, bool)
                and 0.0 <= self.overlap <= 1.0):
            raise ValueError(f"overlap must be a number in [0, 1], got {self.overlap!r}")
        check_number("lookup_bytes_per_s", self.lookup_bytes_per_s, positive=True,
                      allow_inf=True)
        rates = self.apply_bytes_per_s
        pairs = tuple(sorted(rates.items() if isinstance(rates, Mapping) else rates))
        for name, rate in pairs:
            if name not in OPTIMIZERS:
                raise ValueError(f"apply_bytes_per_s: optimizer must be one of {OPTIMIZERS}, "
                                 f"got {name!r}")
            check_number(f"apply_bytes_per_s[{name!r}]", rate, positive=True, allow_inf=True)
        object.__setattr__(self, "apply_bytes_per_s",
                           tuple((str(n), float(r)) for n, r in pairs))
        for name in ("dense_seconds_per_sample", "step_overhead_seconds",
                     "collective_overhead_seconds"):
            check_number(name, getattr(self, name), positive=False)

    def apply_rate(self, optimizer: str) -> float:
        """The apply rate of ``optimizer``; ValueError naming it when none was measured."""
        for name, rate in self.apply_bytes_per_s:
            if name == optimizer:
                return rate
        raise ValueError(f"no apply_bytes_per_s for optimizer {optimizer!r}; have "
                         f"{[n for n, _ in self.apply_bytes_per_s]}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["apply_bytes_per_s"] = dict(self.apply_bytes_per_s)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ComputeRates:
        return cls(**dict(d))


class _JsonRoundTrip:
    """to_json / from_json over a class's own to_dict / from_dict."""

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, s: str):
        return cls.from_dict(json.loads(s))


@dataclass(frozen=True)
class ClusterSpec(_JsonRoundTrip):
    """Nodes, links and memory of a cluster (see the module docstring for the link model).

    Bandwidths in bytes/s per direction: ``intra_node_bandwidth`` of one rank's link to
    the others on its node, ``inter_node_bandwidth`` of a node's NIC(s) in total (shared
    by its ranks); latencies in seconds per message.

    >>> rates = ComputeRates(1e10, {"rowwise_adagrad": 1e10})
    >>> c = ClusterSpec(2, 2, 1e10, 1.25e8, 1e-6, 2e-5, 8 << 30, rates)
    >>> c.ranks, c.node_of(3), ClusterSpec.from_json(c.to_json()) == c
    (4, 1, True)
    """

    nodes: int
    ranks_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float
    memory_per_rank: int
    rates: ComputeRates
    allreduce: str = "ring"

    def __post_init__(self) -> None:
        check_int("nodes", self.nodes, 1)
        check_int("ranks_per_node", self.ranks_per_node, 1)
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            check_number(name, getattr(self, name), positive=True, allow_inf=True)
        for name in ("intra_node_latency", "inter_node_latency"):
            check_number(name, getattr(self, name), positive=False)
        check_int("memory_per_rank", self.memory_per_rank, 1)
        if not isinstance(self.rates, ComputeRates):
            raise ValueError(f"rates must be a ComputeRates, got {self.rates!r}")
        if self.allreduce not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"allreduce must be one of {ALLREDUCE_ALGORITHMS}, "
                             f"got {self.allreduce!r}")

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rates"] = self.rates.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterSpec:
        d = dict(d)
        try:
            d["rates"] = ComputeRates.from_dict(d["rates"])
            return cls(**d)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a ClusterSpec ({e!r}): {d!r}") from e


@functools.lru_cache(maxsize=4096)
def expected_unique_rows(ids: float, rows: int,
                         zipf_exponent: float = DEFAULT_ZIPF_EXPONENT) -> float:
    """Expected distinct rows among ``ids`` draws from Zipf(``zipf_exponent``) over ``rows``.

    E = Σ_i 1 - exp(-ids · p_i), p_i = i^-s / Σ_j j^-s: exact for the first 2048 ranks,
    then over geometric buckets (ratio 1.02) at each bucket's geometric mean; 0 exponent
    is uniform ids, R (1 - exp(-ids / R)).

    >>> round(expected_unique_rows(1000, 10**6, 0.0))
    1000
    >>> expected_unique_rows(32768, 10**6) < 0.5 * 32768   # skewed ids repeat
    True
    """
    check_number("ids", ids, positive=False)
    check_int("rows", rows, 1)
    check_number("zipf_exponent", zipf_exponent, positive=False)
    if ids == 0:
        return 0.0
    if zipf_exponent == 0:
        return rows * -math.expm1(-ids / rows)
    exact = min(rows, 2048)
    # (count, representative rank) buckets
    buckets = [(1, float(i)) for i in range(1, exact + 1)]
    start = exact + 1
    while start <= rows:
        end = min(rows, max(start, int(start * 1.02)))
        buckets.append((end - start + 1, math.sqrt(start * end)))
        start = end + 1
    norm = sum(count * rank ** -zipf_exponent for count, rank in buckets)
    return sum(count * -math.expm1(-ids * rank ** -zipf_exponent / norm)
               for count, rank in buckets)


@dataclass(frozen=True)
class Workload(_JsonRoundTrip):
    """What one training step does: tables, batch, dense size, optimizer, sync mode.

    Hotness comes with each table (``TableConfig.hotness``: ids per sample summed over its
    features). ``unique_fraction`` (one number or one per table): distinct rows / looked-up
    ids in a step; None estimates them with :func:`expected_unique_rows` (Zipf with
    ``zipf_exponent``). ``comm_dtype``: None sends activations in each table's dtype.

    >>> w = Workload((TableConfig("t", 1000, 8, hotness=4.0),), local_batch_size=32,
    ...              unique_fraction=0.5)
    >>> w.unique_rows(w.tables[0], 128.0), Workload.from_json(w.to_json()) == w
    (64.0, True)
    """

    tables: tuple[TableConfig, ...]
    local_batch_size: int
    dense_parameters: int = 0
    optimizer: str = "rowwise_adagrad"
    dense_optimizer: str = "adam"
    replica_sync: str = "gradients"
    sync_every: int = 1
    comm_dtype: str | None = None
    unique_fraction: Any = None   # float | tuple[float, ...] | None
    zipf_exponent: float = DEFAULT_ZIPF_EXPONENT

    def __post_init__(self) -> None:
        tables = tuple(self.tables)
        object.__setattr__(self, "tables", tables)
        if not tables:
            raise ValueError("tables is empty; a workload needs at least one table")
        check_tables(tables)
        check_int("local_batch_size", self.local_batch_size, 1)
        check_int("dense_parameters", self.dense_parameters, 0)
        for name in ("optimizer", "dense_optimizer"):
            if getattr(self, name) not in OPTIMIZERS:
                raise ValueError(f"{name} must be one of {OPTIMIZERS}, "
                                 f"got {getattr(self, name)!r}")
        if self.replica_sync not in REPLICA_SYNC:
            raise ValueError(f"replica_sync must be one of {REPLICA_SYNC}, "
                             f"got {self.replica_sync!r}")
        check_int("sync_every", self.sync_every, 1)
        if self.comm_dtype is not None and self.comm_dtype not in DTYPE_BYTES:
            raise ValueError(f"comm_dtype must be None or one of {sorted(DTYPE_BYTES)}, "
                             f"got {self.comm_dtype!r}")
        fraction = self.unique_fraction
        if fraction is not None:
            values = (fraction,) if not isinstance(fraction, (tuple, list)) else tuple(fraction)
            if isinstance(fraction, (tuple, list)) and len(values) != len(tables):
                raise ValueError(f"unique_fraction has {len(values)} entries for "
                                 f"{len(tables)} tables")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                    raise ValueError(f"unique_fraction must be in (0, 1], got {v!r}")
            if isinstance(fraction, list):
                object.__setattr__(self, "unique_fraction", values)
        check_number("zipf_exponent", self.zipf_exponent, positive=False)

    def unique_rows(self, table: TableConfig, ids: float) -> float:
        """Distinct rows of ``table`` among ``ids`` looked-up ids (at most its rows)."""
        fraction = self.unique_fraction
        if isinstance(fraction, tuple):
            fraction = fraction[[t.name for t in self.tables].index(table.name)]
        if fraction is not None:
            return min(float(table.rows), fraction * ids)
        return expected_unique_rows(float(ids), table.rows, float(self.zipf_exponent))

    def with_settings(self, **changes: Any) -> Workload:
        """A copy with fields replaced (e.g. ``replica_sync``, ``comm_dtype``)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tables"] = [asdict(t) for t in self.tables]
        if isinstance(self.unique_fraction, tuple):
            d["unique_fraction"] = list(self.unique_fraction)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Workload:
        d = dict(d)
        try:
            d["tables"] = tuple(TableConfig(**t) for t in d["tables"])
            return cls(**d)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a Workload ({e!r}): {d!r}") from e


@dataclass(frozen=True)
class CollectiveCost:
    """One collective of a step: its group, bytes and predicted seconds.

    ``bytes_per_rank``: the largest S (allreduce), X (alltoall, sent) or U (allgather part)
    of a rank; ``max_intra_link_bytes`` / ``max_nic_bytes``: the most any rank's intra-node
    link / any node's NIC carries (per direction) for one call; ``calls_per_step``: 1, or
    1/K for a weight sync; ``seconds``: per step (per call * calls_per_step);
    ``behind_compute``: a gradient sync, which can run while the backward pass computes
    (``ComputeRates.overlap`` of it hides).
    """

    name: str
    kind: str               # alltoall | allreduce | allgather
    group: str              # model | data | all
    group_size: int
    spans_nodes: bool
    bytes_per_rank: float
    max_intra_link_bytes: float
    max_nic_bytes: float
    calls_per_step: float
    seconds: float
    behind_compute: bool = False


@dataclass(frozen=True)
class Prediction:
    """What :func:`predict` returns; ``describe()`` prints it, ``to_dict()`` serializes it."""

    data_parallel: int
    model_parallel: int
    layout: str
    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    overhead_seconds: float
    samples_per_second: float
    memory_per_rank_bytes: int
    memory_parts: tuple[tuple[str, float], ...]
    memory_budget_bytes: int
    collectives: tuple[CollectiveCost, ...]
    compute_parts: tuple[tuple[str, float], ...] = ()
    # what the compute rates divide (slowest position) and the collective calls per step
    lookup_bytes: float = 0.0
    apply_bytes: float = 0.0
    collective_calls: float = 0.0

    @property
    def behind_compute_seconds(self) -> float:
        """Seconds per step of the collectives that can run behind compute."""
        return sum(c.seconds for c in self.collectives if c.behind_compute)

    @property
    def fits(self) -> bool:
        return self.memory_per_rank_bytes <= self.memory_budget_bytes

    def collective(self, name: str) -> CollectiveCost:
        for c in self.collectives:
            if c.name == name:
                return c
        raise ValueError(f"no collective named {name!r}; have "
                         f"{[c.name for c in self.collectives]}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fits"] = self.fits
        return d

    def as_plan_data(self) -> tuple[tuple[str, float], ...]:
        """The figures a cost plan stores (see ``ShardingPlan.predicted``)."""
        wire = sum(c.bytes_per_rank * c.calls_per_step for c in self.collectives)
        return (("step_seconds", self.step_seconds),
                ("compute_seconds", self.compute_seconds),
                ("communication_seconds", self.communication_seconds),
                ("overhead_seconds", self.overhead_seconds),
                ("samples_per_second", self.samples_per_second),
                ("memory_per_rank_bytes", float(self.memory_per_rank_bytes)),
                ("memory_budget_bytes", float(self.memory_budget_bytes)),
                ("collective_bytes_per_rank_per_step_bytes", wire))

    def describe(self) -> str:
        def human(n: float) -> str:
            return format_bytes(n)
        lines = [f"Prediction (cost model): D x M = {self.data_parallel} x "
                 f"{self.model_parallel} {self.layout}: step {self.step_seconds * 1e3:.3f} ms "
                 f"= compute {self.compute_seconds * 1e3:.3f} + communication "
                 f"{self.communication_seconds * 1e3:.3f} + overhead "
                 f"{self.overhead_seconds * 1e3:.3f}; {self.samples_per_second:,.0f} samples/s",
                 f"memory per rank {human(self.memory_per_rank_bytes)} of "
                 f"{human(self.memory_budget_bytes)} ({'fits' if self.fits else 'DOES NOT FIT'}"
                 "): " + ", ".join(f"{k} {human(v)}" for k, v in self.memory_parts), ""]
        rows = [[c.name, c.kind, c.group, str(c.group_size), "yes" if c.spans_nodes else "no",
                 human(c.bytes_per_rank), human(c.max_intra_link_bytes), human(c.max_nic_bytes),
                 f"{c.calls_per_step:g}", f"{c.seconds * 1e3:.3f}"] for c in self.collectives]
        lines += aligned_table(["collective", "kind", "group", "n", "crosses nodes",
                           "bytes/rank", "max intra link", "max NIC", "calls/step",
                           "ms/step"], rows, set(range(3, 10)))
        if self.compute_parts:
            lines.append("")
            lines.append("compute (slowest position): " + ", ".join(
                f"{k} {v * 1e3:.3f} ms" for k, v in self.compute_parts))
        return "\n".join(lines)


# ------------------------------------------------------------------ link accounting
class _Links:
    """Bytes per rank link and per node NIC for one collective call."""

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        self.intra: dict[int, float] = {}
        self.nic: dict[int, float] = {}
        self.latency = 0.0
        self.spans = False

    def send(self, src: int, dst: int, nbytes: float) -> None:
        if nbytes <= 0:
            return
        c = self.cluster
        if c.node_of(src) == c.node_of(dst):
            self.intra[src] = self.intra.get(src, 0.0) + nbytes
        else:
            node = c.node_of(src)
            self.nic[node] = self.nic.get(node, 0.0) + nbytes

    def link_seconds(self, sequential: bool = False) -> float:
        c = self.cluster
        intra = max(self.intra.values(), default=0.0) / c.intra_node_bandwidth
        inter = max(self.nic.values(), default=0.0) / c.inter_node_bandwidth
        return intra + inter if sequential else max(intra, inter)


def _per_node(group: Sequence[int], cluster: ClusterSpec) -> dict[int, int]:
    counts: dict[int, int] = {}
    for q in group:
        counts[cluster.node_of(q)] = counts.get(cluster.node_of(q), 0) + 1
    return counts


def _alltoall(groups: Sequence[Sequence[int]], sent: Callable[[int], float],
              cluster: ClusterSpec) -> _Links:
    links = _Links(cluster)
    for group in groups:
        n = len(group)
        if n == 1:
            continue
        counts = _per_node(group, cluster)
        links.spans |= len(counts) > 1
        for q in group:
            c = counts[cluster.node_of(q)]
            x = sent(q)
            if x > 0:
                links.intra[q] = links.intra.get(q, 0.0) + x * (c - 1) / (n - 1)
                node = cluster.node_of(q)
                links.nic[node] = links.nic.get(node, 0.0) + x * (n - c) / (n - 1)
            links.latency = max(links.latency, (c - 1) * cluster.intra_node_latency
                                + (n - c) * cluster.inter_node_latency)
    return links


def _ring(groups: Sequence[Sequence[int]], size: Callable[[Sequence[int]], float],
          cluster: ClusterSpec, kind: str) -> tuple[_Links, bool]:
    """Allreduce (S = size(group)) or allgather (U = size(group)) over each group at once.

    Returns the links and whether the phases add up (hierarchical allreduce)."""
    links = _Links(cluster)
    hierarchical = kind == "allreduce" and cluster.allreduce == "hierarchical"
    for group in groups:
        n = len(group)
        s = size(group)
        if n == 1 or s <= 0:
            continue
        counts = _per_node(group, cluster)
        spans = len(counts) > 1
        links.spans |= spans
        alpha = cluster.inter_node_latency if spans else cluster.intra_node_latency
        if hierarchical and spans:
            k, c = len(counts), max(counts.values())
            for q in group:
                links.intra[q] = links.intra.get(q, 0.0) + 2 * (c - 1) / c * s
            for node in counts:
                links.nic[node] = links.nic.get(node, 0.0) + 2 * (k - 1) / k * s
            links.latency = max(links.latency, 2 * (c - 1) * cluster.intra_node_latency
                                + 2 * (k - 1) * cluster.inter_node_latency)
            continue
        ring = sorted(group)
        edge = 2 * (n - 1) / n * s if kind == "allreduce" else (n - 1) * s
        for a, b in zip(ring, ring[1:] + ring[:1]):
            links.send(a, b, edge)
        steps = 2 * (n - 1) if kind == "allreduce" else n - 1
        links.latency = max(links.latency, steps * alpha)
    return links, hierarchical


# ------------------------------------------------------------------ predict
def _position_of(layout: str, d: int, m: int) -> Callable[[int], int]:
    return (lambda r: r % m) if layout == "model_major" else (lambda r: r // d)


def _traffics(plan: ShardingPlan, workload: Workload) -> list[PositionTraffic]:
    return positions_traffic(
        plan, workload.tables, unique_rows=workload.unique_rows,
        optimizer=workload.optimizer, replica_sync=workload.replica_sync,
        sync_every=workload.sync_every, comm_dtype=workload.comm_dtype,
        local_batch_size=workload.local_batch_size)


def predict(plan: ShardingPlan, layout: str, cluster: ClusterSpec,
            workload: Workload) -> Prediction:
    """Per-rank memory, bytes per collective per link and step time of ``plan``.

    The plan's geometry is priced with the workload's settings (optimizer, batch, sync
    mode, comm dtype), whatever the plan recorded. ValueError when the mesh does not have
    ``cluster.ranks`` ranks, the layout is unknown or the tables differ.

    >>> rates = ComputeRates(1e9, {"rowwise_adagrad": 1e9})
    >>> cluster = ClusterSpec(2, 2, 1e10, 1.25e8, 0.0, 0.0, 1 << 30, rates)
    >>> tables = (TableConfig("a", 10_000, 16), TableConfig("b", 10_000, 16))
    >>> work = Workload(tables, local_batch_size=64)
    >>> from tfhybrid.plan.planner import plan_sharding
    >>> plan = plan_sharding(tables, 2, 2, optimizer="rowwise_adagrad")
    >>> fast, slow = (predict(plan, lay, cluster, work) for lay in ("model_major", "data_major"))
    >>> fast.collective("alltoall_activations").spans_nodes, slow.step_seconds > fast.step_seconds
    (False, True)
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(cluster, ClusterSpec):
        raise ValueError(f"cluster must be a ClusterSpec, got {cluster!r}")
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload, got {workload!r}")
    d, m = plan.data_parallel, plan.model_parallel
    n = d * m
    if n != cluster.ranks:
        raise ValueError(f"the plan's mesh has D x M = {d} x {m} = {n} ranks but the cluster "
                         f"has {cluster.nodes} nodes x {cluster.ranks_per_node} = "
                         f"{cluster.ranks}")
    traffic = _traffics(plan, workload)
    model_groups, data_groups = mesh_groups(n, m, layout)
    position = _position_of(layout, d, m)
    rates, b = cluster.rates, workload.local_batch_size
    k = workload.sync_every
    collectives: list[CollectiveCost] = []
    calls = 0.0

    def add(name: str, kind: str, group: str, groups: Sequence[Sequence[int]], links: _Links,
            per_rank: float, calls_per_step: float, sequential: bool = False,
            messages: int = 1, behind_compute: bool = False) -> None:
        """``messages`` calls share one call's bytes (sparse tensors: values, indices)."""
        nonlocal calls
        if per_rank <= 0 or len(groups[0]) == 1:
            return
        seconds = (links.latency * messages + links.link_seconds(sequential)) * calls_per_step
        collectives.append(CollectiveCost(
            name, kind, group, len(groups[0]), links.spans, per_rank,
            max(links.intra.values(), default=0.0), max(links.nic.values(), default=0.0),
            calls_per_step * messages, seconds, behind_compute))
        calls += calls_per_step * messages

    for name, attr in (("alltoall_ids", "ids_sent"), ("alltoall_activations",
                                                      "activations_sent"),
                       ("alltoall_activation_grads", "activation_grads_sent")):
        sent = [getattr(t, attr) for t in traffic]
        links = _alltoall(model_groups, lambda r: sent[position(r)], cluster)
        add(name, "alltoall", "model", model_groups, links, max(sent), 1.0)

    def data_sync(name: str, kind: str, attr: str, calls_per_step: float,
                  count_attr: str | None, behind_compute: bool) -> None:
        size = [getattr(t, attr) for t in traffic]
        links, seq = _ring(data_groups, lambda g: size[position(g[0])], cluster, kind)
        # sparse gradients go as two allgathers (values, indices) per tensor; Horovod fuses
        # the dense allreduces of one step into one call
        count = max(getattr(t, count_attr) for t in traffic) if count_attr else 1
        add(name, kind, "data", data_groups, links, max(size), calls_per_step, seq,
            2 * count if kind == "allgather" else 1, behind_compute)

    if workload.replica_sync == "weights":
        # between steps: nothing computes while the weights travel
        data_sync("shard_weight_sync", "allreduce", "shard_weight_sync_bytes", 1.0 / k, None,
                  False)
    else:
        data_sync("shard_grad_allreduce", "allreduce", "shard_allreduce_bytes", 1.0, None,
                  True)
        data_sync("shard_grad_allgather", "allgather", "shard_allgather_bytes", 1.0,
                  "shard_allgather_count", True)

    everyone = [tuple(range(n))]
    dense_bytes = workload.dense_parameters * DENSE_VALUE_BYTES
    replicated = max(t.replicated_allreduce_bytes for t in traffic)
    links, seq = _ring(everyone, lambda g: dense_bytes + replicated, cluster, "allreduce")
    add("dense_allreduce", "allreduce", "all", everyone, links, dense_bytes + replicated, 1.0,
        seq, behind_compute=True)
    gathered = max(t.replicated_allgather_bytes for t in traffic)
    links, seq = _ring(everyone, lambda g: gathered, cluster, "allgather")
    count = max(t.replicated_allgather_count for t in traffic)
    add("replicated_allgather", "allgather", "all", everyone, links, gathered, 1.0, False,
        2 * count, behind_compute=True)

    # compute: the slowest position
    apply_rate = rates.apply_rate(workload.optimizer)
    slowest = max(traffic, key=lambda t: t.lookup_bytes_per_sample * b
                  / rates.lookup_bytes_per_s + t.apply_bytes / apply_rate)
    lookup_bytes = slowest.lookup_bytes_per_sample * b
    parts = (lookup_bytes / rates.lookup_bytes_per_s, slowest.apply_bytes / apply_rate)
    dense_seconds = rates.dense_seconds_per_sample * b
    compute = sum(parts) + dense_seconds
    overhead = rates.step_overhead_seconds + rates.collective_overhead_seconds * calls
    communication = sum(c.seconds for c in collectives)
    behind = sum(c.seconds for c in collectives if c.behind_compute)
    step = compute + communication + overhead - rates.overlap * min(compute, behind)

    dense_memory = (dense_bytes + optimizer_state_bytes(
        workload.dense_parameters, 1, workload.dense_optimizer))
    worst = max(traffic, key=lambda t: t.param_bytes + t.optimizer_bytes + t.activation_bytes)
    memory_parts = (("tables", float(worst.param_bytes)),
                    ("optimizer state", float(worst.optimizer_bytes)),
                    ("dense + state", float(dense_memory)),
                    ("activations", worst.activation_bytes))
    memory = int(math.ceil(sum(v for _, v in memory_parts)))
    return Prediction(d, m, layout, step, compute, communication, overhead, n * b / step,
                      memory, memory_parts, cluster.memory_per_rank, tuple(collectives),
                      (("lookup", parts[0]), ("apply", parts[1]), ("dense", dense_seconds)),
                      lookup_bytes, slowest.apply_bytes, calls)
