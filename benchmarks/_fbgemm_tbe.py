"""FBGEMM's CPU TBE as a worker of benchmarks/optimizer_apply.py, run with the python of
.venv-bench (`make bench-setup`: a CPU torch and fbgemm-gpu-cpu), so the TF venv never
imports torch.

It loads the ids and the upstream gradient the parent saved (.npy), builds the same
initial tables, and answers one JSON command per stdin line:
  {"command": "check"}  forward and one step on batch 0 from the initial state, saves the
                        output and the updated rows / accumulators for the parent to
                        compare, then puts the touched rows back to the initial state;
  {"command": "run", "kind": "fwd" | "step", "warm": i, "batches": [j, ...]}
                        one untimed call on batch i, then times one call per batch j;
  {"command": "quit"}.
Answers are `_tbe_workload.format_worker_line` lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

import _tbe_workload as workload_lib  # beside this script (run as one: its folder is on sys.path)


def send(kind: str, payload: object) -> None:
    print(workload_lib.format_worker_line(kind, payload), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=Path, required=True, help="folder the parent wrote")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--huge-pages", action="store_true",
                        help="back the tables and accumulators with huge pages, as "
                             "tfhybrid's kernels do with theirs")
    args = parser.parse_args()

    import torch
    import fbgemm_gpu
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (EmbeddingLocation,
                                                                      PoolingMode)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

    torch.set_num_threads(args.threads)
    workload = workload_lib.Workload.load(args.inputs)
    ids = np.load(args.inputs / workload_lib.IDS_FILE)
    upstream = torch.from_numpy(np.load(args.inputs / workload_lib.UPSTREAM_FILE))

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(workload.rows, workload.dim, EmbeddingLocation.HOST,
                          ComputeDevice.CPU)] * workload.tables,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=workload_lib.LEARNING_RATE, eps=workload_lib.EPSILON,
        pooling_mode=PoolingMode.SUM, weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32)
    weights = tbe.split_embedding_weights()
    accumulators = [state[0] for state in tbe.split_optimizer_states()]
    with torch.no_grad():
        for t, table in enumerate(weights):
            table.copy_(torch.from_numpy(workload_lib.initial_table(workload, t)))
            accumulators[t].zero_()
    if args.huge_pages:
        # the tables are views of one flat buffer, the accumulators of another
        storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                    for t in weights + accumulators}
        for address, nbytes in sorted(storages):
            workload_lib.advise_huge_pages(address, nbytes)

    # TBE's input layout: all tables' ids in one flat tensor, table-major, with the offset
    # of every (table, sample) bag; built before timing, like the TF paths' tensors.
    bag_offsets = torch.arange(workload.tables * workload.batch + 1,
                               dtype=torch.int64) * workload.hotness
    flat_ids = [torch.from_numpy(np.ascontiguousarray(batch_ids.reshape(-1)))
                for batch_ids in ids]

    def forward(batch: int) -> torch.Tensor:
        with torch.no_grad():  # like the TF forward: no tape
            return tbe(flat_ids[batch], bag_offsets)  # [B, tables * dim]: the concat

    def step(batch: int) -> torch.Tensor:
        loss = (tbe(flat_ids[batch], bag_offsets) * upstream).sum()
        loss.backward()  # the row-wise AdaGrad update is fused into TBE's backward
        return loss.detach()

    functions: dict[str, Callable[[int], torch.Tensor]] = {"fwd": forward, "step": step}
    send("ready", {"torch": torch.__version__, "fbgemm_gpu": fbgemm_gpu.__version__,
                   "threads": torch.get_num_threads(),
                   "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                   "huge_pages_mb": workload_lib.anon_huge_mb()})
    for line in sys.stdin:
        command = json.loads(line)
        if command["command"] == "quit":
            return 0
        if command["command"] == "check":
            touched = [torch.from_numpy(u)
                       for u in workload_lib.unique_ids_per_table(ids[0])]
            initial_rows = [weights[t][u].clone() for t, u in enumerate(touched)]
            np.save(args.inputs / workload_lib.FBGEMM_FORWARD_FILE, forward(0).numpy())
            step(0)
            with torch.no_grad():
                rows = [weights[t][u].numpy() for t, u in enumerate(touched)]
                accums = [accumulators[t][u].numpy() for t, u in enumerate(touched)]
                for t, u in enumerate(touched):  # back to the initial state
                    weights[t][u] = initial_rows[t]
                    accumulators[t][u] = 0.0
            np.save(args.inputs / workload_lib.FBGEMM_ROWS_FILE, np.concatenate(rows))
            np.save(args.inputs / workload_lib.FBGEMM_ACCUM_FILE, np.concatenate(accums))
            send("checked", {})
        elif command["command"] == "run":
            function = functions[command["kind"]]
            function(command["warm"])  # untimed: re-warm caches after the other paths ran
            seconds = []
            for batch in command["batches"]:
                start = time.perf_counter()
                function(batch)
                seconds.append(time.perf_counter() - start)
            send("times", {"seconds": seconds})
        else:
            raise ValueError(f"FBGEMM worker: unknown command {line.strip()!r}")
    raise RuntimeError("FBGEMM worker: stdin closed without quit")


if __name__ == "__main__":
    sys.exit(main())
