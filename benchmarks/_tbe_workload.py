"""The kernel workload of benchmarks/optimizer_apply.py, shared with its FBGEMM worker
(benchmarks/_fbgemm_tbe.py, which runs in another venv): numpy only, no TF, no torch.

Every path of the benchmark sees the same ids, the same initial tables, the same upstream
gradient and the same EXACT_ROWWISE_ADAGRAD step (duplicate ids summed first, then
`v += mean_j g_j**2`, `w -= lr * g / (sqrt(v) + eps)`, v starting at 0).
"""

from __future__ import annotations

import ctypes
import json
import mmap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

# the row-wise AdaGrad step of every path
LEARNING_RATE = 0.01
EPSILON = 1e-8
INITIAL_WEIGHT_RANGE = 0.05  # tables start uniform-like in [-range, range)

IDS_FILE = "ids.npy"            # int64 [batches, tables, batch, hotness]
UPSTREAM_FILE = "upstream.npy"  # float32 [batch, tables * dim]: d loss / d output
WORKLOAD_FILE = "workload.json"
# written by the FBGEMM worker for the agreement check (batch 0, from the initial state)
FBGEMM_FORWARD_FILE = "fbgemm_forward.npy"
FBGEMM_ROWS_FILE = "fbgemm_rows.npy"
FBGEMM_ACCUM_FILE = "fbgemm_accum.npy"

# MADV_COLLAPSE (Linux >= 6.1) is missing from older headers and from Python's mmap module
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)

# Worker processes answer on stdout in lines "<prefix><kind> <json>"; anything else they
# print (library warnings) is passed over.
WORKER_LINE_PREFIX = "@optimizer_apply "


@dataclass(frozen=True)
class Workload:
    tables: int
    rows: int
    dim: int
    batch: int
    hotness: int
    zipf_alpha: float
    seed: int

    def save(self, folder: Path) -> None:
        (folder / WORKLOAD_FILE).write_text(json.dumps(asdict(self)))

    @staticmethod
    def load(folder: Path) -> "Workload":
        return Workload(**json.loads((folder / WORKLOAD_FILE).read_text()))


def zipf_ids(workload: Workload, batches: int) -> np.ndarray:
    """int64 [batches, tables, batch, hotness]: per table a Zipf(alpha) over the rows,
    bounded by its inverse CDF, the hot rows scattered by a fixed permutation per table."""
    rng = np.random.default_rng(workload.seed)
    rank = np.arange(1, workload.rows + 1, dtype=np.float64)
    cdf = np.cumsum(rank ** -workload.zipf_alpha)
    cdf /= cdf[-1]
    permutations = [rng.permutation(workload.rows) for _ in range(workload.tables)]
    ids = np.empty((batches, workload.tables, workload.batch, workload.hotness), np.int64)
    for b in range(batches):
        for t in range(workload.tables):
            ranks = np.minimum(np.searchsorted(cdf, rng.random((workload.batch,
                                                                 workload.hotness))),
                               workload.rows - 1)
            ids[b, t] = permutations[t][ranks]
    return ids


def upstream_gradient(workload: Workload) -> np.ndarray:
    rng = np.random.default_rng(workload.seed + 1)
    return rng.normal(0, 1, (workload.batch, workload.tables * workload.dim)).astype(np.float32)


def initial_table(workload: Workload, table: int, chunk_rows: int = 1 << 16) -> np.ndarray:
    """float32 [rows, dim], from an integer hash of (table, row, column): the same bits in
    any numpy version (the two venvs hold different ones), no 2 GB file to share."""
    out = np.empty((workload.rows, workload.dim), np.float32)
    column = np.arange(workload.dim, dtype=np.uint32)[None, :]
    scale = np.float32(2 * INITIAL_WEIGHT_RANGE / 2**24)
    with np.errstate(over="ignore"):
        for start in range(0, workload.rows, chunk_rows):
            row = np.arange(start, min(start + chunk_rows, workload.rows), dtype=np.uint32)
            h = (row[:, None] * np.uint32(2654435761) + column * np.uint32(40503)
                 + np.uint32(table * 97 + workload.seed))
            # murmur3's finalizer: neighbouring rows get unrelated values
            h ^= h >> np.uint32(16)
            h *= np.uint32(0x85EBCA6B)
            h ^= h >> np.uint32(13)
            h *= np.uint32(0xC2B2AE35)
            h ^= h >> np.uint32(16)
            out[start:start + row.size] = ((h >> np.uint32(8)).astype(np.float32) * scale
                                           - np.float32(INITIAL_WEIGHT_RANGE))
    return out


def unique_ids_per_table(ids: np.ndarray) -> list[np.ndarray]:
    """ids [tables, batch, hotness] -> per table its distinct ids, ascending: the rows one
    step updates, in the order the agreement check compares them."""
    return [np.unique(table_ids) for table_ids in ids]


def format_worker_line(kind: str, payload: Any) -> str:
    return WORKER_LINE_PREFIX + kind + " " + json.dumps(payload)


def parse_worker_line(line: str) -> tuple[str, Any] | None:
    """(kind, payload) of a protocol line, None for any other output."""
    if not line.startswith(WORKER_LINE_PREFIX):
        return None
    kind, payload = line[len(WORKER_LINE_PREFIX):].rstrip("\n").split(" ", 1)
    return kind, json.loads(payload)


def anon_huge_mb() -> float:
    """This process's memory in transparent huge pages (AnonHugePages), in MiB."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def advise_huge_pages(address: int, nbytes: int) -> None:
    """Backs a buffer of another runtime (FBGEMM's torch tensors) with transparent huge
    pages the way tfhybrid's kernels back its tables
    (``tfhybrid/custom_ops/cc/kernels/huge_pages.h``): ``MADV_HUGEPAGE``, then
    ``MADV_COLLAPSE``, which converts the already written pages in place, over the
    buffer's interior aligned to the huge page size. Raises ``OSError`` when the kernel
    refuses the advice; whether the pages did collapse shows in :func:`anon_huge_mb`."""
    with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
        page = int(f.read())
    first = (address + page - 1) // page * page
    last = (address + nbytes) // page * page
    if last <= first:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(first), last - first, mmap.MADV_HUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    libc.madvise(ctypes.c_void_p(first), last - first, MADV_COLLAPSE)
