"""Horovod's allreduce keywords, checked once: ``SyncOptions`` and ``sync_options``.

``DistributedOptimizer`` and ``DistributedGradientTape`` take Horovod's keywords with
Horovod's meaning (the package docstring lists them); both check them here, so the two
accept and refuse the same values.

Example::

    import horovod.tensorflow as hvd
    from tfhybrid.distributed.options import sync_options
    options = sync_options(op=hvd.Sum, compression=hvd.Compression.fp16)
    assert options.op == hvd.Sum and options.name == "tfhybrid"
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import horovod.tensorflow as hvd

_LOG = logging.getLogger("tfhybrid")

_OP_NAMES = {hvd.Average: "hvd.Average", hvd.Sum: "hvd.Sum", hvd.Adasum: "hvd.Adasum",
             hvd.Min: "hvd.Min", hvd.Max: "hvd.Max", hvd.Product: "hvd.Product"}
_LOGGED: set[str] = set()


def log_once(message: str) -> None:
    """Logs ``message`` the first time it comes in this process."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        _LOG.info(message)


def forget_logged_notes() -> None:
    """Forgets which one-time notes (how Horovod's options were taken) were logged, so
    the next use logs them again, as in a new process."""
    _LOGGED.clear()


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    """How step 1 sends gradients: Horovod's allreduce options (see the package doc).

    Build it with ``sync_options``, which checks the values.

    Example::

        from tfhybrid.distributed import SyncOptions, sync_options
        assert sync_options() == SyncOptions()
    """

    op: int = hvd.Average
    compression: Any = hvd.Compression.none
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    device_dense: str = ""
    device_sparse: str = ""
    name: str = "tfhybrid"


def is_global_process_set(process_set: Any) -> bool:
    return process_set is None or process_set is hvd.global_process_set or getattr(
        process_set, "process_set_id", None) == 0


def sync_options(*, op: Any = hvd.Average, compression: Any = hvd.Compression.none,
                 sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                 device_dense: str = "", device_sparse: str = "", name: str | None = None,
                 num_groups: int = 0, groups: Any = None, process_set: Any = None,
                 scale_local_gradients: bool = True) -> SyncOptions:
    """Checks Horovod's allreduce keywords and returns them as ``SyncOptions``.

    Values tfhybrid cannot honour raise ``ValueError`` naming the value; ``num_groups`` and
    ``groups`` are accepted and ignored (one log line). See the module doc.
    """
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(
            f"op={_OP_NAMES.get(op, repr(op))} is not supported: tfhybrid syncs gradients "
            "with op=hvd.Average (the default) or op=hvd.Sum")
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise ValueError(f"compression={compression!r} is not a Horovod compressor; pass "
                         "hvd.Compression.none, hvd.Compression.fp16 or an object with "
                         "compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx)")
    if not isinstance(sparse_as_dense, bool):
        raise ValueError(f"sparse_as_dense={sparse_as_dense!r} must be True or False")
    if isinstance(gradient_predivide_factor, bool) or not isinstance(
            gradient_predivide_factor, (int, float)) or not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be a "
                         "number > 0")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} splits an "
                         f"average; it needs op=hvd.Average, not op={_OP_NAMES[op]}")
    for key, device in (("device_dense", device_dense), ("device_sparse", device_sparse)):
        if not isinstance(device, str):
            raise ValueError(f"{key}={device!r} must be a device string ('' for the default)")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name={name!r} must be a string")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups={num_groups!r} must be an int >= 0")
    if groups is not None and not (isinstance(groups, list) or (
            isinstance(groups, int) and not isinstance(groups, bool) and groups > 0)):
        raise ValueError(f"groups={groups!r} must be an int > 0 or a list of lists of "
                         "variables")
    if num_groups or groups is not None:
        log_once("tfhybrid: num_groups/groups are ignored: each process set's dense "
                  "gradients already go in one grouped allreduce")
    if not is_global_process_set(process_set):
        raise ValueError(
            f"process_set={process_set!r} is not supported: tfhybrid reduces each gradient "
            "over its own process set of the mesh (all ranks, or a shard's data group); "
            "pass mesh= to choose the ranks")
    if scale_local_gradients is not True:
        raise ValueError(
            f"scale_local_gradients={scale_local_gradients!r} is not supported: tfhybrid has "
            "no Horovod local variables; it scales model-parallel shards by its own rule")
    return SyncOptions(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                       gradient_predivide_factor=float(gradient_predivide_factor),
                       device_dense=device_dense, device_sparse=device_sparse,
                       name=name or "tfhybrid")

