"""The planner's byte model: what each position sends, holds and syncs per step.

Byte model: the wire format of ``tfhybrid.layers.DistributedEmbedding``, per position p.
Symbols: b = local_batch_size, h = hotness (ids per sample, summed over the table's
features), f = features reading the table, act = dtype bytes of the table, w = shard
width, M = model group size, idb = 8 if any model-parallel table has >= 2**31 rows else 4
(the layer sends every id in one buffer). A step sends, per (feature, shard) route, a
header of L bag lengths and the ids, and gets back one row of w values per bag:
L = b*f bags when pooled, b*h when combiner is None (every id is its own bag).
Only model-parallel shards produce all-to-all traffic; data-parallel tables add 0 to both
traffic figures (their gradients go through the allreduce).

* table_wise / column_wise shard owned by o, n = b*h ids:
    - p != o: alltoall += (L + n)*idb + act*L*w      (header+ids out, activation grad back)
    - p == o: alltoall += (M-1)*act*L*w              (activations to the M-1 others)
              local    += (L + n)*idb + 2*act*L*w    (own ids, own activations, own grad)
* row_wise table with k shards (owners 0..k-1), each owner gets n = b*h/k ids (uniform
  ids) and returns a partial row per bag (L*w values, zeros where it holds no id):
    - per owner o != p: alltoall += (L + n)*idb + act*L*w
    - if p owns a shard: alltoall += (M-1)*act*L*w;  local += (L + n)*idb + 2*act*L*w
* lookup_bytes_per_sample (per local sample): for each shard p owns, table_wise /
  column_wise M*h*w*act, row_wise M*(h/k)*w*act; plus h*dim*act per data_parallel table.
* param_bytes = elements*act; optimizer_bytes = elements*e + shard_rows*r with (e, r) from
  :data:`OPTIMIZER_STATE` (float32 slots: sgd 0, adagrad 4 per element, adam 8 per element,
  rowwise_adagrad and ms_rowwise_adagrad 4 per row); data_parallel tables count on every
  position.
* replica sync of a shard over its data group (D copies), per step: ``"gradients"`` moves
  :func:`sync_bytes` (sparse allgather of the touched rows or dense allreduce, whichever is
  smaller); ``"weights"`` moves :func:`weight_sync_bytes` (the whole shard and its optimizer
  state; a tiered shard's cache and the rows its store took back) every K = sync_every
  steps, so 1/K of it per step. Data-parallel tables always
  sync gradients over all N ranks.
* comm_dtype (None = each table's dtype) is the dtype of the activations, their gradients
  and the gradient sync values on the wire; a weight sync moves the variables' own bytes.
  Gradient sync values are 4 bytes when comm_dtype is None.
* unique rows: the sync and apply formulas take the rows a step touches; by default the
  looked-up ids (an upper bound), or ``unique_rows(table, ids)`` when given (see
  ``tfhybrid.plan.cost_model.Workload``).

:func:`position_traffic` breaks a position's bytes down by collective (ids, activations,
activation gradients, each sync); :func:`rank_estimates` gives the totals a plan keeps
(:class:`~tfhybrid.plan.types.RankEstimate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tfhybrid.plan.tiers import shard_cache_rows
from tfhybrid.plan.types import (DEFAULT_SYNC_VALUE_BYTES, DTYPE_BYTES, ID_BYTES_LARGE,
                                 ID_BYTES_SMALL, INDEX_BYTES, OPTIMIZER_STATE, Kind,
                                 RankEstimate, Shard, ShardingPlan, TableConfig,
                                 TablePlacement, check_int, check_settings, check_tables,
                                 optimizer_state_bytes, shard_bytes)

@dataclass(frozen=True)
class EstimateSettings:
    """What the byte formulas assume besides the geometry (see the module docstring).

    >>> EstimateSettings("adam", comm_dtype="float16").replica_sync
    'gradients'
    """

    optimizer: str = "sgd"
    replica_sync: str = "gradients"
    sync_every: int = 1
    comm_dtype: str | None = None
    unique_rows: Callable[[TableConfig, float], float] | None = None


def sync_is_sparse(rows: int, width: int, ids_per_step: float, group_size: int) -> bool:
    """True when an allgather of the touched rows moves fewer bytes than a dense allreduce
    over ``group_size`` ranks.

    Per rank, an allgather receives the other ranks' ``ids * (width + 1)`` values (rows
    plus their indices), ``(n - 1) * ids * (width + 1)``; a ring allreduce sends and
    receives ``2 (n - 1) / n * rows * width``. So sparse wins while
    ``n * ids * (width + 1) < 2 * rows * width`` (for n = 2: ``ids * (width + 1) <
    rows * width``). ``ids_per_step`` counts looked-up ids, an upper bound on the unique
    rows a step touches. This one rule serves the planner, the cost model and the
    gradient sync (tfhybrid.distributed).
    """
    return group_size * ids_per_step * (width + 1) < 2 * rows * width


def sync_bytes(rows: int, width: int, ids_per_step: float, group_size: int,
               value_bytes: int = DEFAULT_SYNC_VALUE_BYTES,
               index_bytes: int = INDEX_BYTES) -> float:
    """Bytes a rank sends to keep one variable's copies in step over ``group_size`` ranks.

    Sparse (allgather): ``ids * (width * value_bytes + index_bytes)``; dense (allreduce):
    the gradient's ``rows * width * value_bytes``; 0 for a group of one.
    """
    if group_size == 1:
        return 0.0
    if sync_is_sparse(rows, width, ids_per_step, group_size):
        return float(ids_per_step * (width * value_bytes + index_bytes))
    return float(rows * width * value_bytes)


def weight_sync_bytes(rows: int, width: int, value_bytes: int, optimizer: str,
                      group_size: int, cache_rows: int | None = None,
                      written_rows: float = 0.0) -> float:
    """Bytes one weight sync averages per rank: the variable and its optimizer state.

    Dense over the group (every row may have moved); 0 for a group of one. Amortized over
    K steps by the callers (``sync_every``). A tiered shard (``cache_rows``) averages its
    cache and the ``written_rows`` its store took back since the sync before, each a
    float32 row and its float32 row state (``tfhybrid.tiers``), whatever the optimizer.

    >>> weight_sync_bytes(100, 8, 4, "rowwise_adagrad", 2)
    3600.0
    >>> weight_sync_bytes(100, 8, 4, "rowwise_adagrad", 2, cache_rows=10, written_rows=5)
    540.0
    """
    if group_size == 1:
        return 0.0
    if cache_rows is not None:
        return float((cache_rows + written_rows) * (width + 1) * 4)
    return float(rows * width * value_bytes + optimizer_state_bytes(rows, width, optimizer))


@dataclass(frozen=True)
class PositionTraffic:
    """One position's bytes per step, by collective (the totals are :class:`RankEstimate`).

    Alltoall phases (inside the model group; what this rank SENDS): ``ids_sent`` (forward,
    bag lengths + ids to the owners), ``activations_sent`` (forward, owned rows to the
    other positions), ``activation_grads_sent`` (backward, the gradients of the received
    rows back to their owners). Syncs: ``shard_allreduce_bytes`` is S of the dense
    allreduces over the data group and ``shard_allgather_bytes`` this rank's part of the
    sparse allgathers (gradient mode); ``shard_weight_sync_bytes`` is S of ONE weight sync
    (weight mode, every ``sync_every`` steps); ``replicated_*`` are the data-parallel
    tables' gradient syncs over all N ranks. ``apply_bytes``: rows the optimizer updates
    times (row bytes + state per row). ``activation_bytes``: embedding outputs and their
    gradients held from forward to backward (owner: M * rows back per owned shard; every
    rank: the rows it receives). ``*_count`` count the tensors each sync has.

    >>> from tfhybrid.plan.planner import plan_sharding
    >>> t = TableConfig("t", 100, 8)
    >>> plan = plan_sharding([t], 2, 2, local_batch_size=4)
    >>> position_traffic(plan, [t], 0).activations_sent   # 4 bags * 8 values * 4 B to p1
    128.0
    """

    position: int
    param_bytes: int
    optimizer_bytes: int
    lookup_bytes_per_sample: float
    ids_sent: float
    activations_sent: float
    activation_grads_sent: float
    local_bytes: float
    activation_bytes: float
    shard_allreduce_bytes: float
    shard_allgather_bytes: float
    shard_weight_sync_bytes: float
    replicated_allreduce_bytes: float
    replicated_allgather_bytes: float
    apply_bytes: float
    shard_allreduce_count: int = 0
    shard_allgather_count: int = 0
    replicated_allreduce_count: int = 0
    replicated_allgather_count: int = 0


def position_traffic(plan: ShardingPlan, tables: Sequence[TableConfig], position: int, *,
                     unique_rows: Callable[[TableConfig, float], float] | None = None,
                     **overrides: Any) -> PositionTraffic:
    """:class:`PositionTraffic` of ``position`` for ``plan`` (built from ``tables``).

    The plan's optimizer, replica_sync, sync_every, comm_dtype and local_batch_size are
    used unless given in ``overrides`` (same names); ``unique_rows(table, ids)`` estimates
    the distinct rows among ``ids`` looked-up ids (default: ids).
    """
    plan.check_position(position)
    tables, settings, b = _traffic_setup(plan, tables, unique_rows, overrides)
    return _traffic(position, tables, plan.tables, plan.model_parallel, b,
                    plan.data_parallel, settings)[1]


def positions_traffic(plan: ShardingPlan, tables: Sequence[TableConfig], *,
                      unique_rows: Callable[[TableConfig, float], float] | None = None,
                      **overrides: Any) -> list[PositionTraffic]:
    """:func:`position_traffic` of every position, checking the inputs once."""
    tables, settings, b = _traffic_setup(plan, tables, unique_rows, overrides)
    return [_traffic(p, tables, plan.tables, plan.model_parallel, b, plan.data_parallel,
                     settings)[1] for p in range(plan.model_parallel)]


def _traffic_setup(plan: ShardingPlan, tables: Sequence[TableConfig],
                   unique_rows: Callable[[TableConfig, float], float] | None,
                   overrides: dict[str, Any]) -> tuple[list[TableConfig], EstimateSettings, int]:
    tables = check_tables(tables)
    if [t.name for t in tables] != [p.name for p in plan.tables]:
        raise ValueError(f"tables {[t.name for t in tables]} are not the plan's "
                         f"{[p.name for p in plan.tables]}")
    for t, pl in zip(tables, plan.tables):
        shape = (max(s.row_end for s in pl.shards), max(s.col_end for s in pl.shards))
        if shape != (t.rows, t.dim):
            raise ValueError(f"table {t.name!r} is {t.rows} x {t.dim} but the plan's is "
                             f"{shape[0]} x {shape[1]}")
    unknown = set(overrides) - {"optimizer", "replica_sync", "sync_every", "comm_dtype",
                                "local_batch_size"}
    if unknown:
        raise ValueError(f"unknown overrides {sorted(unknown)}")
    get = lambda name: overrides.get(name, getattr(plan, name))  # noqa: E731
    check_settings(get("optimizer"), get("replica_sync"), get("sync_every"),
                    get("comm_dtype"))
    check_int("local_batch_size", get("local_batch_size"), 1)
    settings = EstimateSettings(get("optimizer"), get("replica_sync"), get("sync_every"),
                         get("comm_dtype"), unique_rows)
    return tables, settings, get("local_batch_size")


def rank_estimates(tables: Sequence[TableConfig], placements: Sequence[TablePlacement],
                   model_parallel: int, local_batch_size: int, data_parallel: int,
                   settings: EstimateSettings) -> tuple[RankEstimate, ...]:
    """The :class:`~tfhybrid.plan.types.RankEstimate` of every position of a placement
    (inputs already checked: a strategy calls this while it builds a plan)."""
    return tuple(_traffic(p, tables, placements, model_parallel, local_batch_size,
                          data_parallel, settings)[0] for p in range(model_parallel))


# row-wise tables with more shards than this are summed per position in closed form (the
# loop below, kept for smaller tables, adds in an order saved estimates depend on)
_ROW_SHARDS_LOOPED = 64


def _traffic(p: int, tables: Sequence[TableConfig], placements: Sequence[TablePlacement],
             m: int, b: int, d: int, settings: EstimateSettings
             ) -> tuple[RankEstimate, PositionTraffic]:
    # Formulas are spelled out in the module docstring; keep the two in sync. The totals
    # (param .. sync) accumulate in the same order as always, so saved estimates and the
    # test digests stay bit-identical.
    optimizer, unique = settings.optimizer, settings.unique_rows
    weights_mode = settings.replica_sync == "weights"
    sync_value = (DTYPE_BYTES[settings.comm_dtype] if settings.comm_dtype
                  else DEFAULT_SYNC_VALUE_BYTES)
    per_element_state, per_row_state = OPTIMIZER_STATE[optimizer]
    param = opt = 0
    lookup = sent = local = sync = 0.0
    ids_sent = act_sent = grad_sent = held = 0.0
    shard_ar = shard_ag = shard_ws = rep_ar = rep_ag = apply = 0.0
    counts = {"shard_ar": 0, "shard_ag": 0, "rep_ar": 0, "rep_ag": 0}
    idb = ID_BYTES_LARGE if any(t.rows >= 2**31 or t.keyed for t, pl in zip(tables, placements)
                                if pl.kind != Kind.DATA_PARALLEL) else ID_BYTES_SMALL

    def touched(t: TableConfig, ids: float, nrows: int, share: int) -> float:
        """Distinct rows among the ids of a shard holding 1/share of the table's rows."""
        if unique is None:
            return ids
        return min(float(nrows), unique(t, ids * share) / share)

    for t, pl in zip(tables, placements):
        act, h = DTYPE_BYTES[t.dtype], float(t.hotness)
        wire = DTYPE_BYTES[settings.comm_dtype] if settings.comm_dtype else act
        bags = b * t.features if t.combiner is not None else b * h
        k = len(pl.shards)
        # row-wise and hash-wise shards each get their share of the ids
        splits = pl.kind in (Kind.ROW_WISE, Kind.HASH_WISE)
        share = k if splits else 1
        shards = pl.shards
        if splits and k > _ROW_SHARDS_LOOPED:
            # every row shard p does not own costs it the same: count them at once (a
            # 4096-rank mesh would otherwise loop over M shards per table per position)
            if p < k and shards[p].owner == p:   # the planner puts row shard i on i
                own: tuple[Shard, ...] = (shards[p],)
            else:
                own = tuple(s for s in shards if s.owner == p)
            others = k - len(own)
            ids = b * h / k
            wire_back = wire * bags * t.dim
            ids_sent += others * (bags + ids) * idb
            grad_sent += others * wire_back
            sent += others * ((bags + ids) * idb + wire_back)
            held += 2 * others * wire_back
            shards = own
        for s in shards:
            w = s.col_end - s.col_start
            nrows = s.row_end - s.row_start
            row_bytes = w * act + w * per_element_state + per_row_state
            if s.owner is None or s.owner == p:
                pb, ob = shard_bytes(t, nrows, w, optimizer)
                param, opt = param + pb, opt + ob
            if pl.kind == Kind.DATA_PARALLEL:
                lookup += h * w * act
                rows = touched(t, b * h, nrows, 1)
                nbytes = sync_bytes(nrows, w, rows, m * d, sync_value)
                sync += nbytes
                if m * d > 1:
                    if sync_is_sparse(nrows, w, rows, m * d):
                        rep_ag, counts["rep_ag"] = rep_ag + nbytes, counts["rep_ag"] + 1
                    else:
                        rep_ar, counts["rep_ar"] = rep_ar + nbytes, counts["rep_ar"] + 1
                apply += min(float(nrows), touched(t, m * d * b * h, nrows, 1)) * row_bytes
                held += 2 * wire * bags * w
                continue
            ids = b * h / k if splits else b * h
            wire_back = wire * bags * w   # act * bags * w without a comm_dtype
            held += 2 * wire_back
            if s.owner == p:
                group_rows = touched(t, m * ids, nrows, share)
                if weights_mode:
                    if pl.cache_rows:
                        # a tier's store takes back at most one row per row it loads: at
                        # most the group's distinct ids of K steps, never a cached row
                        cached = shard_cache_rows(pl.cache_rows, t.rows, nrows)
                        one_sync = weight_sync_bytes(
                            nrows, w, act, optimizer, d, cached,
                            min(float(nrows - cached), settings.sync_every * group_rows))
                    else:
                        one_sync = weight_sync_bytes(nrows, w, act, optimizer, d)
                    sync += one_sync / settings.sync_every
                    shard_ws += one_sync
                    applied = group_rows
                else:
                    nbytes = sync_bytes(nrows, w, group_rows, d, sync_value)
                    sync += nbytes
                    if d > 1:
                        if sync_is_sparse(nrows, w, group_rows, d):
                            shard_ag, counts["shard_ag"] = shard_ag + nbytes, counts["shard_ag"] + 1
                        else:
                            shard_ar, counts["shard_ar"] = shard_ar + nbytes, counts["shard_ar"] + 1
                    applied = touched(t, d * m * ids, nrows, share)
                apply += min(float(nrows), applied) * row_bytes
                sent += (m - 1) * wire_back
                local += (bags + ids) * idb + 2 * wire_back
                act_sent += (m - 1) * wire_back
                held += 2 * (m - 1) * wire_back
                lookup += m * (ids / b) * w * act
            else:
                sent += (bags + ids) * idb + wire_back
                ids_sent += (bags + ids) * idb
                grad_sent += wire_back
    estimate = RankEstimate(p, param, opt, float(lookup), float(sent), float(local), sync)
    traffic = PositionTraffic(p, param, opt, float(lookup), ids_sent, act_sent, grad_sent,
                              float(local), held, shard_ar, shard_ag, shard_ws, rep_ar, rep_ag,
                              apply, counts["shard_ar"], counts["shard_ag"], counts["rep_ar"],
                              counts["rep_ag"])
    return estimate, traffic
