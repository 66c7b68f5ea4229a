"""One checkpoint from all ranks: how a save that holds sharded tables is written.

Every rank holds different shards of the ``DistributedEmbedding`` tables, so every rank
must take part in a save, and under Horovod every rank is handed the same path.
TensorFlow's saver writes a whole checkpoint from each process that calls it: N ranks
would write over each other's files, each without the shards it does not hold. Every
Keras and TensorFlow path (``save_weights``, ``tf.train.Checkpoint.write``/``save``,
``CheckpointManager``, ``ModelCheckpoint``, ``BackupAndRestore``) writes through
``MultiDeviceSaver.save``; ``install`` makes that step run this protocol (through the
saver hook of ``tfhybrid._tf_internals``) for any save
that holds slices of sharded tables (``PieceSpec``), and leave every other save alone:

1. **join**: one allgather, with a time limit, where the ranks agree on the path and
   list the pieces they hold. A rank that saves alone (a ``ModelCheckpoint`` added on
   rank 0 only) raises ``ValueError`` after ``JOIN_SECONDS_ENV`` seconds instead of
   hanging; ranks that save to different paths raise at once.
2. **write**: each distinct piece is written once, by the lowest rank that holds it
   (``resharding.assign_writers``): dense variables and the object graph by rank 0,
   each shard by its first replica. Each rank writes its own part,
   ``<prefix>_temp-<token>/part-<rank>``; the slices of every table must tile it,
   checked before any file is written.
3. **agree** that every part was written; a failure on any rank raises on every rank,
   and rank 0 removes the parts.
4. **commit**: rank 0 merges the parts into ``<prefix>.index`` and ``<prefix>.data-*``
   (TensorFlow's ``MergeV2Checkpoints``, as its own sharded saves do), and a last
   agreement keeps every rank from returning before the files exist.

Atomicity: before step 4 nothing at ``<prefix>`` changes. TensorFlow records the latest
checkpoint (the ``checkpoint`` file of ``CheckpointManager``, ``Checkpoint.save`` and so
``BackupAndRestore``, and of ``save_weights``) only after the save returns, so a kill at
any point leaves the previous checkpoint the latest one, complete and restorable; the
next save of the same prefix ignores the leftover ``_temp-*`` folder (rank 0 removes
leftovers of its prefix). Saving over an existing fixed prefix replaces its files in
place, as TensorFlow itself does; numbered prefixes (the managers', or a ModelCheckpoint
path with ``{epoch}``) never do.

All ranks must see the path at the same place: one machine, or a shared filesystem.
Restoring needs no agreement: each rank reads the slices it holds.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfhybrid import _tf_internals
from tfhybrid import collectives
from tfhybrid import mesh as mesh_lib
from tfhybrid.checkpoint import resharding

# Seconds a rank waits in step 1 for the others (a straggler may be a whole step
# behind); past it, the save raises instead of hanging.
JOIN_SECONDS_ENV = "TFHYBRID_CHECKPOINT_JOIN_SECONDS"
DEFAULT_JOIN_SECONDS = 300.0

_saves_started = 0
# Called on every rank with the number of the process's coordinated save, once the rank
# has written its part and before the ranks agree it was written (add_part_observer).
_PART_OBSERVERS: list[Callable[[int], None]] = []
# exception types a failing rank's error is raised as on every rank
_ERROR_TYPES = {cls.__name__: cls for cls in (
    FileNotFoundError, FileExistsError, PermissionError, OSError, ValueError, TypeError)}


class PieceSpec(_tf_internals.SaveSpec):
    """A slice of a full tensor that ranks hold different parts of (a sharded table).

    ``shape`` is the slice's own shape, so ranks can compare their copies of a piece
    before reading them; the value is read only by the rank that writes it.
    """

    def __init__(self, read: Any, spec: str, name: str, dtype: Any, device: str,
                 shape: tuple[int, ...]):
        super().__init__(read, spec, name, dtype=dtype, device=device)
        self.shape = tuple(shape)


def install() -> None:
    """Routes TensorFlow's checkpoint writes through ``_save`` (idempotent)."""
    _tf_internals.install_saver_hook(_save)


def add_part_observer(observer: Callable[[int], None]) -> None:
    """Calls ``observer(n)`` on every rank once it has written its part of the process's
    n-th coordinated save (n from 1), before the ranks agree that every part was
    written: the moment a save is under way on disk and not yet committed. Idempotent.
    ``tfhybrid.testing.faults`` pauses saves there to kill a job mid-save."""
    if observer not in _PART_OBSERVERS:
        _PART_OBSERVERS.append(observer)


def start_save() -> int:
    """Counts one more coordinated save of this process (checkpoints and Keras 3 weights
    files alike) and returns its number, which ``part_written`` passes on."""
    global _saves_started
    _saves_started += 1
    return _saves_started


def part_written(save: int) -> None:
    """Tells the part observers that this rank has written its part of save ``save``."""
    for observer in _PART_OBSERVERS:
        observer(save)


def _save(self: Any, file_prefix: Any, options: Any, original: Callable[..., Any]) -> Any:
    """``MultiDeviceSaver.save``: the protocol above when the save holds pieces of
    sharded tables, else TensorFlow's own. One process runs the same protocol (its
    agreements are no-ops), so a save behaves alike on any mesh."""
    entries = _entries(self)
    mesh = mesh_lib.initialized_mesh()
    if mesh is None or not any(isinstance(value, PieceSpec) for _, _, value in entries):
        return original(self, file_prefix, options)
    if not tf.executing_eagerly():
        raise RuntimeError("a checkpoint of sharded DistributedEmbedding tables is written "
                           "by all ranks together; save eagerly, not inside a tf.function")
    if _tf_internals.registered_savers(self):
        raise ValueError(f"checkpoint savers registered for "
                         f"{sorted(_tf_internals.registered_savers(self))}"
                         " cannot be combined with sharded DistributedEmbedding tables")
    prefix = file_prefix.numpy().decode() if hasattr(file_prefix, "numpy") else str(
        file_prefix)
    _write_together(mesh, prefix, entries)
    return None


def _entries(saver: Any) -> list[tuple[str, str, Any]]:
    """(checkpoint key, slice spec, tensor or SaveSpec) of everything the saver holds."""
    return _tf_internals.saver_entries(saver)


def _signature(value: Any) -> str:
    """What copies of one piece on different ranks must agree on."""
    if isinstance(value, PieceSpec):
        return f"{tf.as_dtype(value.dtype).name}{list(value.shape)}"
    if isinstance(value, _tf_internals.SaveSpec):
        return tf.as_dtype(value.dtype).name
    return f"{value.dtype.name}{value.shape.as_list()}"


def _write_together(mesh: mesh_lib.Mesh, prefix: str, entries: list) -> None:
    save = start_save()
    pieces = [[key, spec, _signature(value)] for key, spec, value in entries]
    # 1. join
    joined = _exchange(mesh, "tfhybrid_checkpoint_join", {
        "prefix": prefix, "token": secrets.token_hex(6) if mesh.rank == 0 else "",
        "pieces": pieces}, timeout=_join_seconds(), prefix=prefix)
    _check_one_path(joined)
    writes = resharding.assign_writers(
        [[tuple(p) for p in r["pieces"]] for r in joined])
    _check_tilings(writes)
    staging = f"{prefix}_temp-{joined[0]['token']}"

    # 2. write this rank's part; errors are reported, so every rank reaches step 3
    local_error, wrote = None, False
    try:
        mine = set(writes[mesh.rank])
        chosen = [(key, spec, value) for key, spec, value in entries if (key, spec) in mine]
        if chosen:
            tf.io.gfile.makedirs(staging)
            _tf_internals.save_v2(_part(staging, mesh.rank, mesh.size),
                           [key for key, _, _ in chosen], [spec for _, spec, _ in chosen],
                           [v.tensor if isinstance(v, _tf_internals.SaveSpec) else v
                            for _, _, v in chosen])
            wrote = True
        part_written(save)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        local_error = e
    # 3. agree; every rank has stopped writing once it reaches the allgather
    try:
        written = agree(mesh, "tfhybrid_checkpoint_written", local_error,
                        f"writing checkpoint {prefix!r}", {"wrote": wrote})
    except Exception:
        if mesh.rank == 0 and tf.io.gfile.exists(staging):
            tf.io.gfile.rmtree(staging)
        raise

    # 4. commit
    local_error = None
    if mesh.rank == 0:
        try:
            parts = [_part(staging, r, mesh.size) for r, rec in enumerate(written)
                     if rec["wrote"]]
            _tf_internals.merge_v2_checkpoints(parts, prefix, delete_old_dirs=True)
            _remove_leftovers(prefix, staging)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            local_error = e
    agree(mesh, "tfhybrid_checkpoint_committed", local_error,
          f"committing checkpoint {prefix!r}")


def _part(staging: str, rank: int, size: int) -> str:
    return os.path.join(staging, f"part-{rank:05d}-of-{size:05d}")


def _check_tilings(writes: list[list[tuple[str, str]]]) -> None:
    """The written slices of every sliced tensor must cover it exactly once."""
    sliced: dict[str, list[str]] = {}
    for rank_writes in writes:
        for key, spec in rank_writes:
            if spec:
                sliced.setdefault(key, []).append(spec)
    for key, specs in sliced.items():
        parsed = [resharding.parse_slice_spec(s) for s in specs]
        shapes = {shape for shape, _ in parsed}
        if len(shapes) != 1:
            raise ValueError(f"checkpoint tensor {key!r} has slices of different full "
                             f"shapes {sorted(shapes)}")
        resharding.check_tiling(key, parsed[0][0], [rect for _, rect in parsed])


def _remove_leftovers(prefix: str, staging: str) -> None:
    """Rank 0, after a commit: the staging folders of this prefix's killed saves."""
    directory, base = os.path.split(prefix)
    for name in tf.io.gfile.listdir(directory or "."):
        name = name.rstrip("/")
        path = os.path.join(directory, name)
        if name.startswith(f"{base}_temp-") and path != staging:
            tf.io.gfile.rmtree(path)
    if tf.io.gfile.exists(staging):
        tf.io.gfile.rmtree(staging)


def _join_seconds() -> float:
    value = os.environ.get(JOIN_SECONDS_ENV, "")
    try:
        seconds = float(value) if value else DEFAULT_JOIN_SECONDS
    except ValueError:
        raise ValueError(f"{JOIN_SECONDS_ENV}={value!r} must be a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{JOIN_SECONDS_ENV}={value!r} must be > 0")
    return seconds


# ------------------------------------------------------------------ agreement
def join(mesh: mesh_lib.Mesh, name: str, path: str) -> None:
    """Waits for every rank to begin saving ``path`` (at most ``JOIN_SECONDS_ENV``
    seconds): a rank that saves alone raises ``ValueError`` instead of hanging in the
    save's collectives, and ranks saving to different paths raise at once."""
    _check_one_path(_exchange(mesh, name, {"prefix": path}, timeout=_join_seconds(),
                              prefix=path))


def _check_one_path(joined: list[dict]) -> None:
    if len({r["prefix"] for r in joined}) > 1:
        raise ValueError(
            "the ranks save one checkpoint of sharded tables to different paths: "
            + ", ".join(f"rank {i}: {r['prefix']!r}" for i, r in enumerate(joined))
            + "; give every rank the same path (tfhybrid makes one rank write each piece)")



def _exchange(mesh: mesh_lib.Mesh, name: str, record: dict, timeout: float | None = None,
              prefix: str = "") -> list[dict]:
    """Allgathers one JSON record per rank; returns them by rank.

    With ``timeout``, the collective runs in a thread and a rank whose peers do not
    join in time raises: it stays inside an unmatched collective, so the job cannot go on.
    """
    data = tf.constant(np.frombuffer((json.dumps(record) + "\n").encode(), np.uint8))
    if timeout is None:
        gathered = collectives.allgather(data, mesh.size, name)
    else:
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = collectives.allgather(data, mesh.size, name)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                outcome["error"] = e

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise ValueError(
                f"rank {mesh.rank} began saving checkpoint {prefix!r}, which holds sharded "
                f"DistributedEmbedding tables, and the other ranks did not join within "
                f"{timeout:.0f} s ({JOIN_SECONDS_ENV}). Every rank holds different shards, "
                "so every rank must save, to the same path: add ModelCheckpoint / "
                "BackupAndRestore (or call save_weights, Checkpoint.save...) on EVERY rank, "
                "not only on rank 0; tfhybrid makes one rank write each piece. This rank "
                "is left inside an unmatched collective, so the job cannot continue.")
        if "error" in outcome:
            raise outcome["error"]
        gathered = outcome["value"]
    lines = bytes(np.asarray(gathered)).decode().split("\n")[:-1]
    if len(lines) != mesh.size:
        raise RuntimeError(f"{name}: got {len(lines)} records from {mesh.size} ranks")
    return [json.loads(line) for line in lines]


def agree(mesh: mesh_lib.Mesh, name: str, error: BaseException | None, what: str,
          record: dict | None = None) -> list[dict]:
    """Tells every rank whether any rank failed; raises the same error on every rank if so.

    ``error`` is this rank's failure (None: it succeeded), ``what`` what they were doing,
    ``record`` more JSON-able facts to share; returns every rank's record on success.
    Every rank must call it with the same ``name``.
    """
    if error is None:
        record = dict(record or {}, ok=True)
    else:
        record = {"ok": False, "type": type(error).__name__, "error": str(error)}
    records = _exchange(mesh, name, record)
    failed = [(r, rec) for r, rec in enumerate(records) if not rec["ok"]]
    if not failed:
        return records
    # ranks that failed alike are listed once
    by_error: dict[str, list[int]] = {}
    for r, rec in failed:
        by_error.setdefault(f"{rec['type']}: {rec['error']}", []).append(r)
    parts = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
             for text, ranks in by_error.items()]
    detail = "; ".join(parts[:4]) + (f"; and {len(parts) - 4} more" if len(parts) > 4 else "")
    cls = _ERROR_TYPES.get(failed[0][1]["type"], RuntimeError)
    raise cls(f"{what} failed on {len(failed)} rank(s): {detail}") from error
