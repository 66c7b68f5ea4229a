"""DLRM training throughput (samples/s after warm-up) in NVIDIA's TF2 DLRM configuration.

The configuration of NVIDIA's TF2 DLRM example: Criteo-1TB's 26 tables capped at
1,000,000 rows, embedding dim 128, bottom MLP 512-256-128, top MLP 1024-1024-512-256-1,
global batch 4096, SGD. Each case runs in its own job (``horovodrun`` for two
processes) through ``model.fit``, as a user would train:

- meshes: 1 process, 2x1 (two data-parallel replicas) and 1x2 (tables split over two ranks);
- fp32 and bf16 (``mixed_bfloat16``), with and without XLA-compiled dense towers.

The baseline of every ratio is the 1-process fp32 run without XLA of the same run.
NVIDIA's own code is not run here, so no ratio to it is printed: a figure of it from
another day would not be a measurement (issue 13's benchmarks run it in the same run).

Usage: .venv/bin/python benchmarks/dlrm_throughput.py [--steps 30] [--warmup 5]
           [--cases 1x1:fp32,1x1:bf16:xla,...] [--max_table_rows 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CASES = tuple(f"{mesh}:{precision}{xla}" for mesh in ("1x1", "2x1", "1x2")
                      for precision in ("fp32", "bf16") for xla in ("", ":xla"))


def _child(args) -> None:
    """One case, in this process (one rank of a horovodrun job for 2-process meshes)."""
    import numpy as np
    import tensorflow as tf

    import tfhybrid
    from tfhybrid.train.data import CRITEO_1TB_CARDINALITIES
    from tfhybrid.train.models import DLRM, example_batch

    cores = os.cpu_count() or 1
    ranks = int(os.environ.get("HOROVOD_LOCAL_SIZE", "1"))
    threads = max(1, cores // ranks)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    tf.keras.mixed_precision.set_global_policy(
        "mixed_bfloat16" if args.precision == "bf16" else "float32")
    mesh = tfhybrid.init(model_parallel=args.model_parallel)
    rows = [min(r, args.max_table_rows) for r in CRITEO_1TB_CARDINALITIES]
    model = DLRM(rows, 13, 128, bottom_mlp_dims=[512, 256, 128],
                 top_mlp_dims=[1024, 1024, 512, 256, 1], xla=args.xla)
    local = args.batch // mesh.size
    model(example_batch(model, local))
    # the app's SGD (see tfhybrid/train/app.py): sparse row updates, no momentum slots
    model.compile(optimizer=tfhybrid.DistributedOptimizer(
                      tf.keras.optimizers.legacy.SGD(0.01)),
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(mesh.rank)
    # a few different batches, cycled: the input pipeline is not what is measured
    batches = [({"dense": rng.random([local, 13], np.float32),
                 "categorical": np.stack([rng.integers(0, r, local) for r in rows],
                                         1).astype(np.int32)},
                rng.integers(0, 2, [local, 1]).astype(np.float32)) for _ in range(4)]
    data = tf.data.Dataset.from_tensor_slices(
        tf.nest.map_structure(lambda *x: np.stack(x), *batches)).repeat().prefetch(2)
    times = []

    class Timer(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(tf.timestamp().numpy())

    model.fit(data, steps_per_epoch=args.warmup + args.steps, verbose=0,
              callbacks=tfhybrid.callbacks.defaults() + [Timer()])
    if mesh.rank == 0:
        seconds = times[-1] - times[args.warmup - 1]
        with open(args.out, "w") as f:
            json.dump({"samples_per_second": args.steps * args.batch / seconds,
                       "step_ms": 1000 * seconds / args.steps}, f)


def _run_case(case: str, args) -> dict:
    parts = case.split(":")
    mesh, precision, xla = parts[0], parts[1], "xla" in parts[2:]
    data_parallel, model_parallel = (int(x) for x in mesh.split("x"))
    size = data_parallel * model_parallel
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", "--out", out,
                   "--precision", precision, "--model_parallel", str(model_parallel),
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--batch", str(args.batch), "--max_table_rows", str(args.max_table_rows)]
        if xla:
            command.append("--xla")
        if size > 1:
            command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np",
                       str(size), "-H", f"localhost:{size}", "--gloo"] + command
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        if done.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
            raise RuntimeError(f"case {case} failed (exit {done.returncode}):\n{tail}")
        with open(out) as f:
            return dict(json.load(f), size=size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help="mesh:precision[:xla], comma separated")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--max_table_rows", type=int, default=1_000_000)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--model_parallel", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--xla", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error(f"--warmup={args.warmup} and --steps={args.steps} must be >= 1")
    if args.child:
        _child(args)
        return
    cases = args.cases.split(",")
    print(f"DLRM, NVIDIA TF2 config: 26 tables capped at {args.max_table_rows:,} rows x 128, "
          f"bottom 512-256-128, top 1024-1024-512-256-1, batch {args.batch}, SGD; "
          f"{args.steps} timed steps after {args.warmup} warm-up steps")
    print(f"{'case':<16}{'step ms':>10}{'samples/s':>12}{'vs 1x1 fp32':>13}")
    baseline = None
    for case in cases:
        result = _run_case(case, args)
        rate = result["samples_per_second"]
        if case == "1x1:fp32":
            baseline = rate
        ratio = f"{rate / baseline:.2f}x" if baseline else "-"
        print(f"{case:<16}{result['step_ms']:>10.1f}{rate:>12,.0f}{ratio:>13}", flush=True)


if __name__ == "__main__":
    main()
