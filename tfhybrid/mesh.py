"""The D x M process mesh: N Horovod ranks as D data-parallel replicas x model groups of M.

Layouts (see ``mesh_groups``):

- ``model_major``: model group d holds ranks [d*M, ..., d*M+M-1] (contiguous, so the
  alltoall stays inside a node); data group p holds ranks {p, M+p, 2M+p, ...}.
- ``data_major``: data group p holds ranks [p*D, ..., p*D+D-1] (contiguous, so the
  replica allreduce stays inside a node, as in Meta's 2D sparse parallelism); model group
  d holds ranks {d, D+d, 2D+d, ...}.

Every shard of a model-parallel table lives on one position p of every model group; its
D copies form data group p.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

LAYOUTS = ("model_major", "data_major")

# Horovod's stall limits, read once by hvd.init. Horovod's own default never shuts a
# stalled job down, so a rank that stops calling collectives (an exception, a hang,
# input that ended early) would leave the others waiting forever; ``init`` sets these
# seconds wherever the environment sets nothing (the train app's --stall_check_seconds
# and --stall_shutdown_seconds set them before it). Horovod 0.28.1's Gloo controller
# never acts on them (see tfhybrid.train.app._StallWatchdog, which does).
STALL_CHECK_ENV = "HOROVOD_STALL_CHECK_TIME_SECONDS"
STALL_SHUTDOWN_ENV = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
STALL_DEFAULTS = {STALL_CHECK_ENV: 60, STALL_SHUTDOWN_ENV: 600}
# Horovod fuses the collectives that are ready in one cycle into one buffer, and a
# tensor's place in that buffer decides the order in which a ring allreduce adds its
# elements. Which calls share a buffer depends on timing, so with fusion across calls a
# sum could change in its last bit from run to run (a pipelined step and the plain loop
# ended a few ulp apart after other models had run in the process). tfhybrid already puts
# each step's syncs of one process set and dtype into one grouped allreduce; with this,
# every call keeps a buffer of its own. Read once by hvd.init; a user's setting wins.
FUSION_ENV = "HOROVOD_DISABLE_GROUP_FUSION"
FUSION_DEFAULT = "1"

_MESH: "Mesh | None" = None
# process sets this module registered, so a reset can remove exactly those
_OWNED_PROCESS_SETS: list[Any] = []


def _validate(size: int, model_parallel: Any, layout: Any) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; expected one of {LAYOUTS}")
    if isinstance(model_parallel, bool) or not isinstance(model_parallel, int):
        raise ValueError(f"model_parallel={model_parallel!r} must be an int (or None)")
    if model_parallel < 1 or model_parallel > size:
        raise ValueError(
            f"model_parallel={model_parallel} must be in [1, {size}] for {size} ranks")
    if size % model_parallel != 0:
        raise ValueError(
            f"{size} ranks are not divisible by model_parallel={model_parallel}; "
            f"expected a divisor of {size}")


def mesh_groups(size: int, model_parallel: int, layout: str = "model_major"
                ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Returns (model_groups, data_groups) of a D x M mesh, as tuples of global ranks.

    ``model_groups[d][p]`` is the rank at position p of replica d, and
    ``data_groups[p][d]`` is the same rank. Pure Python, no Horovod needed:

    >>> mesh_groups(4, 2, "model_major")
    (((0, 1), (2, 3)), ((0, 2), (1, 3)))
    >>> mesh_groups(4, 2, "data_major")
    (((0, 2), (1, 3)), ((0, 1), (2, 3)))
    """
    _validate(size, model_parallel, layout)
    model = model_parallel
    data = size // model
    if layout == "model_major":
        rank_at = lambda d, p: d * model + p  # noqa: E731
    else:
        rank_at = lambda d, p: p * data + d  # noqa: E731
    model_groups = tuple(tuple(rank_at(d, p) for p in range(model)) for d in range(data))
    data_groups = tuple(tuple(rank_at(d, p) for d in range(data)) for p in range(model))
    return model_groups, data_groups


def distinct_meshes(size: int) -> list[tuple[int, str]]:
    """Every (model_parallel, layout) of ``size`` ranks whose groups differ from the
    ones before it: with M = 1 or M = N both layouts give the same groups, so a check
    over every mesh runs each of those once.

    >>> distinct_meshes(4)
    [(1, 'model_major'), (2, 'model_major'), (2, 'data_major'), (4, 'model_major')]
    """
    seen, meshes = set(), []
    for model_parallel in range(1, size + 1):
        if size % model_parallel:
            continue
        for layout in LAYOUTS:
            groups = mesh_groups(size, model_parallel, layout)
            if groups not in seen:
                seen.add(groups)
                meshes.append((model_parallel, layout))
    return meshes


@dataclasses.dataclass(frozen=True)
class Mesh:
    """This rank's view of the D x M mesh, with its two Horovod process sets.

    Example (one process, no horovodrun needed)::

        import tfhybrid
        mesh = tfhybrid.init(model_parallel=1)
        print(mesh)                    # draws the grid
        assert (mesh.data_parallel, mesh.model_parallel) == (1, 1)
    """

    size: int
    rank: int
    model_parallel: int
    data_parallel: int
    layout: str
    model_groups: tuple[tuple[int, ...], ...]
    data_groups: tuple[tuple[int, ...], ...]
    # Horovod ProcessSet objects (global_process_set where a group spans every rank)
    model_process_set: Any = dataclasses.field(compare=False, repr=False)
    data_process_set: Any = dataclasses.field(compare=False, repr=False)

    @property
    def replica(self) -> int:
        """Index d of this rank's model group (its data-parallel replica)."""
        return next(d for d, group in enumerate(self.model_groups) if self.rank in group)

    @property
    def model_position(self) -> int:
        """Position p of this rank inside its model group (= index of its data group)."""
        return self.model_groups[self.replica].index(self.rank)

    @property
    def data_position(self) -> int:
        """Position of this rank inside its data group (= its replica index)."""
        return self.replica

    @property
    def model_group_ranks(self) -> tuple[int, ...]:
        return self.model_groups[self.replica]

    @property
    def data_group_ranks(self) -> tuple[int, ...]:
        return self.data_groups[self.model_position]

    @property
    def shape(self) -> tuple[int, int]:
        """(D, M)."""
        return self.data_parallel, self.model_parallel

    def __str__(self) -> str:
        width = max(len(str(self.size - 1)) + 2, 4)
        header = "replica \\ position".ljust(18) + "".join(
            f"p{p}".rjust(width) for p in range(self.model_parallel))
        lines = [f"Mesh {self.data_parallel} x {self.model_parallel} "
                 f"(D x M, {self.size} ranks, {self.layout}); this rank {self.rank} = *",
                 header]
        for d, group in enumerate(self.model_groups):
            cells = "".join((f"{r}*" if r == self.rank else f"{r} ").rjust(width)
                            for r in group)
            lines.append(f"d{d}".ljust(18) + cells)
        return "\n".join(lines)


class _SingleRankSet:
    """Stands for a group of one rank when Horovod cannot register process sets.

    tfhybrid skips every collective over a group of one (it would be the identity), so
    it never hands this to Horovod. It is what lets a script call ``hvd.init()`` itself
    (static process sets) and still use M = N or M = 1.
    """

    def __init__(self, rank: int):
        self.ranks = [rank]

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"_SingleRankSet(rank={self.ranks[0]})"


def _process_set_for(hvd: Any, ranks: Sequence[int]) -> Any:
    # A group spanning every rank is the global set; Horovod rejects a second set
    # with the same ranks, and the global one needs no registration.
    if len(ranks) == hvd.size():
        return hvd.global_process_set
    if len(ranks) == 1 and os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
        # Horovod started without dynamic sets (a plain hvd.init()); where it can, a
        # real set is registered, so a user's own hvd calls may take mesh process sets
        return _SingleRankSet(ranks[0])
    process_set = hvd.add_process_set(list(ranks))
    _OWNED_PROCESS_SETS.append(process_set)
    return process_set


def init(model_parallel: int | None = None, layout: str = "model_major") -> Mesh:
    """Initialises Horovod and builds the D x M mesh of process sets.

    Args:
      model_parallel: M, the ranks per model group. ``None`` means the number of ranks
        on this node (``hvd.local_size()``). M = N is pure model parallelism, M = 1 pure
        data parallelism.
      layout: ``"model_major"`` or ``"data_major"`` (see the module docstring).

    Returns the mesh; a second call with the same arguments returns the same mesh, and
    with a different M or layout raises ``ValueError``. Works in a plain single process.
    Every rank must call it (it registers process sets collectively).
    """
    global _MESH
    import horovod.tensorflow as hvd
    from tfhybrid import _tf_internals   # TensorFlow's: not at import, for tfhybrid.plan

    _tf_internals.install_autograph_rule()
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; expected one of {LAYOUTS}")
    if not hvd.is_initialized():
        # a user's own setting wins (see STALL_DEFAULTS and FUSION_ENV)
        for name, seconds in STALL_DEFAULTS.items():
            os.environ.setdefault(name, str(seconds))
        os.environ.setdefault(FUSION_ENV, FUSION_DEFAULT)
        hvd.init(process_sets="dynamic")
    resolved = hvd.local_size() if model_parallel is None else model_parallel
    size = hvd.size()
    _validate(size, resolved, layout)
    if _MESH is not None:
        if (_MESH.model_parallel, _MESH.layout) != (resolved, layout):
            raise ValueError(
                f"tfhybrid.init was already called with model_parallel="
                f"{_MESH.model_parallel}, layout={_MESH.layout!r}; cannot re-init with "
                f"model_parallel={resolved}, layout={layout!r} (call "
                "tfhybrid.mesh.reset() on every rank first to build another mesh)")
        return _MESH
    model_groups, data_groups = mesh_groups(size, resolved, layout)
    if any(len(g) not in (1, size) for g in model_groups + data_groups):
        _require_dynamic_process_sets(resolved, size)
    model_sets = [_process_set_for(hvd, g) for g in model_groups]
    data_sets = [_process_set_for(hvd, g) for g in data_groups]
    rank = hvd.rank()
    replica = next(d for d, g in enumerate(model_groups) if rank in g)
    position = model_groups[replica].index(rank)
    _MESH = Mesh(size=size, rank=rank, model_parallel=resolved,
                 data_parallel=size // resolved, layout=layout,
                 model_groups=model_groups, data_groups=data_groups,
                 model_process_set=model_sets[replica],
                 data_process_set=data_sets[position])
    return _MESH


def _require_dynamic_process_sets(model_parallel: int, size: int) -> None:
    # hvd.init() reads this variable once: process sets can only be added after it
    # when Horovod was started in dynamic mode.
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
        raise RuntimeError(
            f"tfhybrid.init(model_parallel={model_parallel}) on {size} ranks needs Horovod "
            "process sets for its model and data groups, but Horovod was initialised "
            "(hvd.init()) without dynamic process sets. Do one of: call "
            "tfhybrid.init(model_parallel=...) before hvd.init() (it initialises Horovod "
            "itself); call hvd.init(process_sets='dynamic') instead of hvd.init(); or launch "
            "with HOROVOD_DYNAMIC_PROCESS_SETS=1. (M = N and M = 1 need no process sets "
            "and work after a plain hvd.init().)")


def initialized_mesh() -> Mesh | None:
    """The mesh made by ``tfhybrid.init``, or None before that call (never initialises:
    for code that must behave alike with and without a mesh)."""
    return _MESH


def current_mesh() -> Mesh:
    """The mesh made by ``tfhybrid.init``; raises if ``init`` was not called yet."""
    if _MESH is None:
        raise ValueError("no mesh: call tfhybrid.init(model_parallel=...) first")
    return _MESH


def current_mesh_or_init() -> Mesh:
    """The current mesh, or a default ``init()`` one when none was made yet."""
    return _MESH if _MESH is not None else init()


def reset() -> None:
    """Drops the mesh and removes the process sets it registered, so that ``init`` can
    build another (with another M or layout). Every rank calls it, as it calls ``init``:
    removing a process set is collective. Horovod itself stays initialised."""
    global _MESH
    import horovod.tensorflow as hvd
    while _OWNED_PROCESS_SETS:
        hvd.remove_process_set(_OWNED_PROCESS_SETS.pop())
    _MESH = None
