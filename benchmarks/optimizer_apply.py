"""Embedding forward and train step: tfhybrid's kernels vs its anchors, measured in one run.

Workload (design notes, "Anchors to measure against"): 8 tables of 1,000,000 x 64 fp32,
batch 4096, 8 ids per bag (dense [4096, 8] per table), Zipf(1.05) ids bounded to the table
(inverse CDF, hot rows scattered by a fixed permutation per table), combiner sum.
--scale s multiplies the rows and the batch (--quick: s = 1/16, few repeats).

Every path computes the same output, one [batch, 8 * 64] tensor (the concat of the 8
pooled bags, what FBGEMM's TBE returns), and the same optimizer, EXACT_ROWWISE_ADAGRAD
(duplicate ids summed first, one accumulator per row: v += mean_j g_j^2,
w -= lr * g / (sqrt(v) + eps)), on the same ids, initial tables and upstream gradient:
  (a) tfhybrid: the 8 tables' bags in one op writing the concat directly
      (embedding_lookup_combine_concat, FBGEMM's table-batched form), then each table's
      backward fused with the row-wise AdaGrad, reading its columns of the upstream
      gradient in place (EmbeddingLookupCombineGradRowwiseAdagrad: the update takes
      exactly the lookup's gradient), the tables moved to huge pages by the kernels
      (docs/building-ops.md, "Huge pages");
  (s) the same with one EmbeddingLookupCombine per table and tf.concat (the route before
      the table-batched op: the concat copies the bags, its gradient slices the
      upstream gradient);
  (u) the same with the gradient passed through tf.identity, so the update cannot see
      where it came from: the backward kernel writes the [unique, 64] gradient rows and
      RowwiseAdagradApply reads them (the route before the fused kernel);
  (n) the same with TFHYBRID_HUGE_PAGES=0: its tables stay in TF's small pages;
  (b) TF composite: tf.gather + tf.math.segment_sum, and the same row-wise AdaGrad written
      with TF ops (tf.unique + unsorted_segment_sum + gathers + scatter updates);
  (c) FBGEMM's CPU TBE (SplitTableBatchedEmbeddingBagsCodegen, EXACT_ROWWISE_ADAGRAD fused
      into its backward) from `make bench-setup`'s .venv-bench, in worker processes that
      read the ids this process saved (.npy): the TF venv never imports torch. Without
      that venv, (c) is reported as not measured. It runs in each page policy tfhybrid
      runs in: small pages (as torch allocates them) beside (n), and huge pages beside
      (a), its tables and accumulators advised exactly as tfhybrid's kernels advise
      theirs; and in each OpenMP wait policy (libgomp's default, and PASSIVE), its
      faster one being its figure (--fbgemm-variants).
"forward" is a forward pass returning the concat; "train step" is forward + backward +
optimizer apply, loss = sum(output * upstream). Both return once computed (CPU, eager
calls of tf.function / torch are synchronous).

Before timing, the paths' outputs are compared on batch 0 (the forward, and the rows and
accumulators after one step from the initial state; the touched rows are then put back).
Timing runs in rounds rotating over the paths and over forward / train step, each block
after one untimed call, so a shared machine's drifting load hits every path alike. It
prints per path and kind the median with its spread over the timed calls, and ratios of
those medians: nothing but what this run measured, then the pairings: FBGEMM against
tfhybrid in the same page policy. A full run writes
benchmarks/results/optimizer_apply/table.txt (--quick: a temporary folder; --out: any),
its provenance header first.

--compare-builds times path (a) with the portable library (baseline x86-64 code, hot
loops dispatched at run time to AVX2 / AVX-512) against a -march=native build of the same
sources, each in its own worker process (two libraries registering the same ops cannot
share a process), alternating in --ab-rounds rounds; it prints each build's medians with
spread and the median over rounds of the paired ratio portable / native with a bootstrap
95% interval, and whether the train-step losses are bitwise equal.

Usage: .venv/bin/python benchmarks/optimizer_apply.py [--quick | --scale 0.25] [--out DIR]
           [--threads 2] [--iters 15] [--rounds 3] [--paths a,n,b,c] [--thp]
           [--fbgemm-variants small:default,huge:passive]
       .venv/bin/python benchmarks/optimizer_apply.py --compare-builds [--ab-rounds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

# beside this script; _results puts the checkout first on sys.path (for tfhybrid)
import _results
import _stats
import _tbe_workload as workload_lib

BENCH_PYTHON = Path(_results.ROOT) / ".venv-bench" / "bin" / "python"  # `make bench-setup`
FBGEMM_WORKER = Path(__file__).resolve().parent / "_fbgemm_tbe.py"
FULL_ROWS, FULL_BATCH = 1_000_000, 4096  # --scale 1
QUICK_SCALE = 1 / 16
# Differences of outputs relative to max(1, |reference|): float32 sums in another order
# differ by ~1e-7 of the largest accumulated term; a wrong kernel differs by far more.
AGREEMENT_TOLERANCE = 1e-4
PATH_LABELS = {"a": "(a) tfhybrid kernels", "s": "(s) (a), per-table + concat",
               "u": "(u) (a), two kernels",
               "n": "(n) (a), small pages",
               "b": "(b) TF composite", "c": "(c) FBGEMM CPU TBE"}
# FBGEMM's runs: (pages, OMP_WAIT_POLICY), "default" leaving libgomp's own policy. Each is
# a worker of its own (a page policy is set when its tables are made).
FBGEMM_PAGES = ("small", "huge")
FBGEMM_WAITS = ("default", "passive")
FBGEMM_VARIANTS = tuple(f"{pages}:{wait}" for pages in FBGEMM_PAGES for wait in FBGEMM_WAITS)
# each FBGEMM page policy is paired with tfhybrid's path in the same policy
PAIRED_PATH = {"small": "n", "huge": "a"}


def label(name: str) -> str:
    """A path's label; an FBGEMM variant is named "c:<pages>:<wait>"."""
    if name.startswith("c:"):
        _, pages, wait = name.split(":")
        return f"(c) FBGEMM {pages} pages, OMP {wait}"
    return PATH_LABELS[name]


class Report:
    """Lines printed as they come and kept for the results file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.extend(text.splitlines() or [""])


say = Report()
HUGE_PAGES_ENV = "TFHYBRID_HUGE_PAGES"
BANDWIDTH_BUFFER_MIB = 512  # per buffer (source and target): far beyond the caches
KINDS = {"fwd": "forward", "step": "train step"}
# (iters, rounds, warmup, ab_rounds) of a full run and of --quick
FULL_REPEATS, QUICK_REPEATS = (120, 12, 3, 60), (6, 3, 1, 4)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"--scale {QUICK_SCALE:g} and few repeats, for a smoke run")
    p.add_argument("--scale", type=float, help="multiplies rows and batch (default 1)")
    p.add_argument("--threads", type=int, default=2,
                   help="intra-op threads of TF and of torch (default 2)")
    p.add_argument("--inter-threads", type=int, default=0,
                   help="TF inter-op threads (0 = TF default)")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hotness", type=int, default=8)
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent")
    p.add_argument("--iters", type=int, help="timed calls per path and kind "
                   f"(default {FULL_REPEATS[0]}, --quick {QUICK_REPEATS[0]})")
    p.add_argument("--rounds", type=int, help="the timed calls are split in rounds "
                   f"rotating over the paths (default {FULL_REPEATS[1]})")
    p.add_argument("--warmup", type=int, help="untimed calls per path and kind first "
                   f"(default {FULL_REPEATS[2]}, --quick {QUICK_REPEATS[2]})")
    p.add_argument("--paths", default="a,n,b,c", help="comma list of a, s, u, n, b, c "
                   "(default a,n,b,c: the paths of the pairings, and TF's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench-python", type=Path, default=BENCH_PYTHON,
                   help="python with torch and fbgemm_gpu for path (c)")
    p.add_argument("--fbgemm-variants", default=",".join(FBGEMM_VARIANTS),
                   help="path (c)'s runs, comma list of <pages>:<wait> with pages in "
                        f"{FBGEMM_PAGES} and OMP_WAIT_POLICY in {FBGEMM_WAITS} "
                        "('default': libgomp's own); default: all four")
    p.add_argument("--out", help="folder of table.txt (default: benchmarks/results/"
                                 "optimizer_apply, --quick: a new temporary folder)")
    p.add_argument("--thp", action="store_true",
                   help="re-run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 so that large "
                        "allocations (the tables, of every path and worker) use transparent "
                        "huge pages")
    p.add_argument("--compare-builds", action="store_true",
                   help="path (a): portable library vs a -march=native build of the same "
                        "sources, in alternating worker processes")
    p.add_argument("--ab-rounds", type=int,
                   help="--compare-builds: rounds, each timing both builds "
                        f"(default {FULL_REPEATS[3]}, --quick {QUICK_REPEATS[3]})")
    p.add_argument("--ab-iters", type=int, default=5,
                   help="--compare-builds: timed forward and train steps per build per round")
    p.add_argument("--portable-lib", type=Path,
                   help="--compare-builds: this library instead of the portable build")
    p.add_argument("--native-lib", type=Path,
                   help="--compare-builds: this library instead of a fresh -march=native build")
    p.add_argument("--worker-lib", type=Path, help=argparse.SUPPRESS)  # internal
    p.add_argument("--worker-rows", type=int, help=argparse.SUPPRESS)  # internal
    p.add_argument("--worker-batch", type=int, help=argparse.SUPPRESS)  # internal
    args = p.parse_args()
    repeats = QUICK_REPEATS if args.quick else FULL_REPEATS
    for name, default in zip(("iters", "rounds", "warmup", "ab_rounds"), repeats):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.scale is None:
        args.scale = QUICK_SCALE if args.quick else 1.0
    if not 0 < args.scale <= 1:
        p.error(f"--scale must be in (0, 1], got {args.scale}")
    variants = [v.strip() for v in args.fbgemm_variants.split(",") if v.strip()]
    wrong = [v for v in variants if v not in FBGEMM_VARIANTS]
    if wrong or not variants:
        p.error(f"--fbgemm-variants={args.fbgemm_variants!r}: expected a comma list of "
                f"{', '.join(FBGEMM_VARIANTS)}")
    args.fbgemm_variants = variants
    for name in ("iters", "rounds", "warmup", "ab_rounds", "ab_iters", "tables", "hotness",
                 "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def workload_of(args: argparse.Namespace) -> workload_lib.Workload:
    rows = args.worker_rows or max(1, round(FULL_ROWS * args.scale))
    batch = args.worker_batch or max(1, round(FULL_BATCH * args.scale))
    return workload_lib.Workload(tables=args.tables, rows=rows, dim=args.dim, batch=batch,
                                 hotness=args.hotness, zipf_alpha=args.alpha, seed=args.seed)


# ------------------------------------------------------------------ machine accounting

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


# ------------------------------------------------------------------ the TF paths

def _import_tf(args: argparse.Namespace):
    """TensorFlow with the benchmark's thread settings."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    if args.inter_threads:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_threads)
    return tf


class TfState:
    """One TF path's tables and accumulators, with the batches and upstream gradient every
    path sees. Each path gets its own tables: tfhybrid's kernels move the buffers they
    touch to huge pages (TFHYBRID_HUGE_PAGES), which path (b), TF without tfhybrid, must
    not inherit."""

    def __init__(self, tf, workload: workload_lib.Workload, ids: np.ndarray,
                 upstream: np.ndarray):
        self.workload = workload
        self.tables = [tf.Variable(workload_lib.initial_table(workload, t), name=f"table{t}")
                       for t in range(workload.tables)]
        self.accumulators = [tf.Variable(tf.zeros([workload.rows]), name=f"accum{t}")
                             for t in range(workload.tables)]
        self.batches = [[tf.constant(batch_ids[t]) for t in range(workload.tables)]
                        for batch_ids in ids]
        self.upstream = tf.constant(upstream)


StepFunctions = dict[str, Callable[[Any], Any]]  # "fwd" / "step" -> call on one batch


def _loss(tf, output, upstream):
    return tf.reduce_sum(output * upstream)


def make_tfhybrid_fns(tf, co, state: TfState, fused: bool = True,
                      batched: bool = True) -> StepFunctions:
    """Path (a): tfhybrid's table-batched lookup-combine kernel and each table's backward
    fused with the row-wise AdaGrad; with fused=False, path (u): the backward kernel, then
    the AdaGrad kernel; with batched=False, path (s): a lookup per table and a concat."""
    def output(ids):
        if batched:
            return co.embedding_lookup_combine_concat(
                state.tables, [ids[t] for t in range(len(state.tables))], "sum",
                use_custom_op=True)
        return tf.concat([co.embedding_lookup_combine(table, table_ids, "sum",
                                                      use_custom_op=True)
                          for table, table_ids in zip(state.tables, ids)], axis=1)

    def apply(table, accumulator, grad):
        values = grad.values if fused else tf.identity(grad.values)
        co.rowwise_adagrad_apply(table, accumulator, grad.indices, values,
                                 workload_lib.LEARNING_RATE, workload_lib.EPSILON,
                                 use_custom_op=True)
    return _step_functions(tf, state, output, apply)


def make_composite_fns(tf, state: TfState) -> StepFunctions:
    """Path (b): what TF offers without tfhybrid, with the same output and optimizer."""
    workload = state.workload
    bag_of_id = tf.constant(np.repeat(np.arange(workload.batch), workload.hotness))

    def output(ids):
        return tf.concat([tf.math.segment_sum(tf.gather(table, tf.reshape(table_ids, [-1])),
                                              bag_of_id)
                          for table, table_ids in zip(state.tables, ids)], axis=1)

    def rowwise_adagrad(table, accumulator, grad):
        # gather's gradient holds one row per looked-up id: sum the duplicates first
        unique_ids, position = tf.unique(grad.indices)
        summed = tf.math.unsorted_segment_sum(grad.values, position, tf.size(unique_ids))
        v = tf.gather(accumulator, unique_ids) + tf.reduce_mean(tf.square(summed), axis=1)
        step_size = workload_lib.LEARNING_RATE / (tf.sqrt(v) + workload_lib.EPSILON)
        w = tf.gather(table, unique_ids) - step_size[:, None] * summed
        accumulator.scatter_update(tf.IndexedSlices(v, unique_ids))
        table.scatter_update(tf.IndexedSlices(w, unique_ids))

    return _step_functions(tf, state, output, rowwise_adagrad)


def _without_huge_pages(fns: StepFunctions) -> StepFunctions:
    """Path (n): path (a) with TFHYBRID_HUGE_PAGES=0 during each of its calls (the kernels
    read it per call), so its own tables stay in the small pages TF allocated them in:
    what the huge pages are worth, measured in the same run."""
    def wrapped(fn):
        def call(ids):
            before = os.environ.get(HUGE_PAGES_ENV)
            os.environ[HUGE_PAGES_ENV] = "0"
            try:
                return fn(ids)
            finally:
                if before is None:
                    del os.environ[HUGE_PAGES_ENV]
                else:
                    os.environ[HUGE_PAGES_ENV] = before
        return call
    return {kind: wrapped(fn) for kind, fn in fns.items()}


def _step_functions(tf, state: TfState, output, apply) -> StepFunctions:
    """The timed functions of a path: its forward, and forward + backward + ``apply``
    (table, accumulator, gradient) on every table; the paths differ only in those two."""
    @tf.function
    def forward(ids):
        return output(ids)

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = _loss(tf, output(ids), state.upstream)
        grads = tape.gradient(loss, state.tables)
        for table, accumulator, grad in zip(state.tables, state.accumulators, grads):
            apply(table, accumulator, grad)
        return loss
    return {"fwd": forward, "step": step}


# ------------------------------------------------------------------ worker processes

class Worker:
    """A process answering JSON commands on stdin with protocol lines on stdout."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None):
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, env=env)
        self.info: dict = {}

    def receive(self, kind: str) -> Any:
        for line in self.proc.stdout:
            parsed = workload_lib.parse_worker_line(line)
            if parsed is None:
                continue
            got, payload = parsed
            if got != kind:
                raise RuntimeError(f"{self.name} worker sent {got!r}, expected {kind!r}")
            return payload
        raise RuntimeError(f"{self.name} worker exited with code {self.proc.wait()} "
                           "(its errors are above)")

    def command(self, reply: str, **command: Any) -> Any:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.receive(reply)

    def run(self, kind: str, warm: int, batches: list[int]) -> dict:
        return self.command("times", command="run", kind=kind, warm=warm, batches=batches)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"command": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def start_fbgemm_worker(args: argparse.Namespace, inputs: Path, variant: str
                        ) -> Worker | str:
    """FBGEMM's worker in one "<pages>:<wait>" variant, or why path (c) is not measured."""
    if not args.bench_python.exists():
        return f"{args.bench_python} not found (`make bench-setup` creates it)"
    pages, wait = variant.split(":")
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if wait != "default":
        env["OMP_WAIT_POLICY"] = wait.upper()
    return Worker(f"c:{variant}", [str(args.bench_python), str(FBGEMM_WORKER), "--inputs",
                                   str(inputs), "--threads", str(args.threads)]
                  + (["--huge-pages"] if pages == "huge" else []), env=env)


# ------------------------------------------------------------------ agreement check

def _max_differences(value: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(max abs difference, max difference relative to max(1, |reference|))."""
    difference = np.abs(value.astype(np.float64) - reference)
    return (float(difference.max(initial=0.0)),
            float((difference / np.maximum(1.0, np.abs(reference))).max(initial=0.0)))


def check_agreement(tf, states: dict[str, TfState], tf_fns: dict[str, StepFunctions],
                    workers: dict[str, Worker], inputs: Path, ids: np.ndarray) -> bool:
    """Compares every path's forward output, and its rows and accumulators after one step
    from the initial state, on batch 0; puts the touched rows back afterwards."""
    touched = workload_lib.unique_ids_per_table(ids[0])
    results: dict[str, dict[str, np.ndarray]] = {}
    state = None
    for name, fns in tf_fns.items():
        state = states[name]
        initial_rows = [tf.gather(table, u).numpy() for table, u in zip(state.tables, touched)]
        forward = fns["fwd"](state.batches[0]).numpy()
        fns["step"](state.batches[0])
        results[name] = {
            "forward": forward,
            "rows": np.concatenate([tf.gather(table, u).numpy()
                                    for table, u in zip(state.tables, touched)]),
            "accumulators": np.concatenate([tf.gather(accumulator, u).numpy()
                                            for accumulator, u in zip(state.accumulators,
                                                                      touched)])}
        for table, accumulator, u, rows in zip(state.tables, state.accumulators, touched,
                                               initial_rows):
            table.scatter_update(tf.IndexedSlices(rows, u))
            accumulator.scatter_update(tf.IndexedSlices(np.zeros(u.size, np.float32), u))
    for name, worker in workers.items():   # one after another: they share the files
        worker.command("checked", command="check")
        results[name] = {"forward": np.load(inputs / workload_lib.FBGEMM_FORWARD_FILE),
                        "rows": np.load(inputs / workload_lib.FBGEMM_ROWS_FILE),
                        "accumulators": np.load(inputs / workload_lib.FBGEMM_ACCUM_FILE)}
    if len(results) < 2:
        say("agreement: fewer than two paths, nothing to compare")
        return True
    reference_name = next(iter(results))
    reference = results[reference_name]
    say(f"agreement on batch 0, vs {label(reference_name)}: max abs difference "
          f"(max relative to max(1, |value|)); tolerance {AGREEMENT_TOLERANCE:g} relative")
    agree = True
    for name, result in results.items():
        if name == reference_name:
            continue
        parts = []
        for what in ("forward", "rows", "accumulators"):
            absolute, relative = _max_differences(result[what], reference[what])
            agree &= relative <= AGREEMENT_TOLERANCE
            parts.append(f"{what} {absolute:.2e} ({relative:.2e})")
        say(f"  {label(name):36s} " + ", ".join(parts))
    workload = next(iter(states.values())).workload
    say(f"  (forward: the [{workload.batch}, {workload.tables * workload.dim}]"
          f" output; rows, accumulators: the {reference['accumulators'].size:,} rows one "
          "step updates)")
    return agree


# ------------------------------------------------------------------ the comparison

def compare_paths(args: argparse.Namespace) -> int:
    from tfhybrid.testing import provenance   # after _results put this checkout first
    load = provenance.OtherLoad()
    paths = [s.strip() for s in args.paths.split(",") if s.strip()]
    unknown = set(paths) - set(PATH_LABELS)
    if unknown:
        raise SystemExit(f"--paths: unknown {sorted(unknown)}; expected a, s, u, n, b, c")
    workload = workload_of(args)
    batch_count = args.warmup + args.iters
    ids = workload_lib.zipf_ids(workload, batch_count)
    upstream = workload_lib.upstream_gradient(workload)

    say(f"optimizer_apply: {os.cpu_count()} CPUs ({_cpu_model()}), intra-op threads "
          f"{args.threads} (TF and torch), TF inter-op threads {args.inter_threads or 'default'}")
    say(f"workload: {workload.tables} tables x {workload.rows:,} x {workload.dim} fp32 "
          f"(scale {args.scale:g}), batch {workload.batch}, {workload.hotness} ids/bag, "
          f"Zipf({workload.zipf_alpha}), combiner sum, output [{workload.batch}, "
          f"{workload.tables * workload.dim}]; EXACT_ROWWISE_ADAGRAD lr "
          f"{workload_lib.LEARNING_RATE:g} eps {workload_lib.EPSILON:g}")
    unique_rows = [sum(u.size for u in workload_lib.unique_ids_per_table(batch_ids))
                   for batch_ids in ids]
    say(f"ids per step: {ids[0].size:,}; unique rows per step (sum over tables), over the "
          f"{batch_count} batches: {_stats.summarize(unique_rows).format(digits=0)}")

    with tempfile.TemporaryDirectory(prefix="tfhybrid-optimizer-apply-") as folder:
        inputs = Path(folder)
        workers: dict[str, Worker] = {}
        if "c" in paths:
            workload.save(inputs)
            np.save(inputs / workload_lib.IDS_FILE, ids)
            np.save(inputs / workload_lib.UPSTREAM_FILE, upstream)
            for variant in args.fbgemm_variants:   # they build their tables meanwhile
                started = start_fbgemm_worker(args, inputs, variant)
                if isinstance(started, str):
                    say(f"{PATH_LABELS['c']}: NOT MEASURED: {started}")
                    break
                workers[started.name] = started
        try:
            tf = _import_tf(args)
            from tfhybrid import custom_ops as co

            states: dict[str, TfState] = {}
            tf_fns: dict[str, StepFunctions] = {}
            if "a" in paths:
                if co.custom_ops_available():
                    states["a"] = TfState(tf, workload, ids, upstream)
                    tf_fns["a"] = make_tfhybrid_fns(tf, co, states["a"])
                else:
                    say(f"{PATH_LABELS['a']}: NOT MEASURED: custom ops unavailable")
            variants = {"s": lambda st: make_tfhybrid_fns(tf, co, st, batched=False),
                        "u": lambda st: make_tfhybrid_fns(tf, co, st, fused=False),
                        "n": lambda st: _without_huge_pages(make_tfhybrid_fns(tf, co, st))}
            for name, make in variants.items():
                if name in paths and co.custom_ops_available():
                    states[name] = TfState(tf, workload, ids, upstream)
                    tf_fns[name] = make(states[name])
            if "b" in paths:
                states["b"] = TfState(tf, workload, ids, upstream)
                tf_fns["b"] = make_composite_fns(tf, states["b"])
            say(f"TF {tf.__version__}; tfhybrid kernels "
                  f"{co.kernel_isa() if 'a' in tf_fns else 'not used'}; transparent huge "
                  f"pages in use: {workload_lib.anon_huge_mb():,.0f} MB"
                  + ("" if args.thp else " (default malloc; see --thp)"))
            for name, worker in list(workers.items()):
                try:
                    worker.info = worker.receive("ready")
                    say(f"{label(name)}: fbgemm_gpu {worker.info['fbgemm_gpu']}, torch "
                        f"{worker.info['torch']}, {worker.info['threads']} threads, "
                        f"OMP_WAIT_POLICY {worker.info['omp_wait_policy']}, "
                        f"{worker.info['huge_pages_mb']:,.0f} MB in huge pages "
                        f"({args.bench_python})")
                except RuntimeError as error:
                    say(f"{label(name)}: NOT MEASURED: {error}")
                    worker.close()
                    del workers[name]
            if not check_agreement(tf, states, tf_fns, workers, inputs, ids):
                say("outputs DISAGREE beyond the tolerance: not timing")
                return 1
            code = time_paths(args, states, tf_fns, workers, float(np.median(unique_rows)))
        finally:
            for worker in workers.values():
                worker.close()
    # after the workers ended: their CPU time is this run's own, not other load
    out = _results.out_dir("optimizer_apply", args.quick, args.out)
    _results.write_text(os.path.join(out, "table.txt"), say.lines, load)
    return code


class CopyBandwidth:
    """The machine's memory bandwidth as `threads` threads copying disjoint parts of a
    buffer far larger than the caches (numpy copies release the GIL): bytes read plus
    bytes written per second, one sample per `measure()`."""

    def __init__(self, threads: int, mib: int = BANDWIDTH_BUFFER_MIB):
        self.source = np.ones(mib << 18, np.float32)
        self.target = np.zeros_like(self.source)
        self.threads = threads
        self.samples: list[float] = []

    def measure(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        parts = np.array_split(np.arange(self.source.size), self.threads)
        bounds = [(int(part[0]), int(part[-1]) + 1) for part in parts if part.size]

        def copy(bound):
            np.copyto(self.target[bound[0]:bound[1]], self.source[bound[0]:bound[1]])
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(copy, bounds))   # first touch of the target's pages: untimed
            start = time.perf_counter()
            list(pool.map(copy, bounds))
            seconds = time.perf_counter() - start
        self.samples.append(2 * self.source.nbytes / seconds)


def bytes_moved(workload: workload_lib.Workload, unique_rows: float) -> dict[str, float]:
    """The least memory traffic of each kind, per step (all tables): every unique row read
    once (repeated ids hit the caches), the output written; a train step also reads the
    upstream gradient, writes the unique rows back and reads and writes their accumulators."""
    row_bytes = workload.dim * 4
    output = workload.batch * workload.tables * row_bytes
    forward = unique_rows * row_bytes + output
    return {"fwd": forward,
            "step": forward + output + unique_rows * row_bytes + 2 * unique_rows * 4}


def print_bandwidth_limit(args: argparse.Namespace, bandwidth: CopyBandwidth,
                          workload: workload_lib.Workload, unique_rows: float,
                          summaries: dict, names: list[str]) -> None:
    rate = _stats.summarize(bandwidth.samples)
    say(f"memory-bandwidth limit: {args.threads} threads copy "
          f"{rate.format(1e-9)} GB/s (read + write, one sample per round); the least "
          f"traffic per step at the median unique rows ({unique_rows:,.0f}):")
    moved = bytes_moved(workload, unique_rows)
    for kind in KINDS:
        floor = moved[kind] / rate.median
        shares = ", ".join(f"{label(name)} {floor / summaries[(name, kind)].median:.0%}"
                           for name in names)
        say(f"  {KINDS[kind]}: {moved[kind] / 1e6:.1f} MB, {floor * 1e3:.2f} ms at that "
              f"rate; each path's median runs at this share of the limit: {shares}")


def _faster_wait(summaries: dict, names: list[str], pages: str, kind: str) -> str | None:
    """FBGEMM's variant in ``pages`` with the lower median for ``kind``, None if none ran."""
    ran = [n for n in names if n.startswith(f"c:{pages}:")]
    return min(ran, key=lambda n: summaries[(n, kind)].median) if ran else None


def print_pairings(seconds: dict, summaries: dict, names: list[str]) -> None:
    """FBGEMM against tfhybrid in the same page policy, FBGEMM at its faster OpenMP wait
    policy (per kind): the ratio of medians, FBGEMM / tfhybrid (> 1: tfhybrid faster),
    with the range of the same ratio per round."""
    lines = []
    for pages in FBGEMM_PAGES:
        ours = PAIRED_PATH[pages]
        if ours not in names:
            continue
        parts = []
        for kind in KINDS:
            theirs = _faster_wait(summaries, names, pages, kind)
            if theirs is None:
                continue
            ratio = summaries[(theirs, kind)].median / summaries[(ours, kind)].median
            per_round = [np.median(a) / np.median(b) for a, b in
                         zip(seconds[(theirs, kind)], seconds[(ours, kind)])]
            parts.append(f"{KINDS[kind]} {ratio:.2f}x [{min(per_round):.2f}, "
                         f"{max(per_round):.2f}] (OMP {theirs.split(':')[2]})")
        if parts:
            lines.append(f"  {pages} pages, {label(ours)} vs FBGEMM: " + "   ".join(parts))
    if lines:
        say("pairings in the same page policy, FBGEMM median / tfhybrid median (> 1: "
            "tfhybrid faster), FBGEMM at its faster OpenMP wait policy; in brackets the "
            "range of the same ratio per round:")
        for line in lines:
            say(line)


def time_paths(args: argparse.Namespace, states: dict[str, TfState],
               tf_fns: dict[str, StepFunctions],
               workers: dict[str, Worker], unique_rows: float) -> int:
    names = list(tf_fns) + list(workers)
    if not names:
        say("no path to time")
        return 1
    for name, fns in tf_fns.items():  # traces the tf.functions
        for kind, fn in fns.items():
            for batch in range(args.warmup):
                fn(states[name].batches[batch])
    say(f"transparent huge pages in use after the warm-up: {workload_lib.anon_huge_mb():,.0f} MB")
    for worker in workers.values():
        for kind in KINDS:
            worker.run(kind, 0, list(range(args.warmup)))

    per_round = max(1, args.iters // args.rounds)
    seconds: dict[tuple[str, str], list[list[float]]] = {
        (name, kind): [] for name in names for kind in KINDS}  # per round, its calls
    bandwidth = CopyBandwidth(args.threads)
    for r in range(args.rounds):
        bandwidth.measure()
        batches = [args.warmup + (r * per_round + j) % args.iters for j in range(per_round)]
        for name in names:
            for kind in KINDS:
                if name in workers:
                    seconds[(name, kind)].append(workers[name].run(kind, 0, batches)["seconds"])
                    continue
                fn = tf_fns[name][kind]
                fn(states[name].batches[0])  # untimed: re-warm caches after the other paths ran
                round_seconds = []
                for batch in batches:
                    start = time.perf_counter()
                    fn(states[name].batches[batch])  # returns once computed; no copy out
                    round_seconds.append(time.perf_counter() - start)
                seconds[(name, kind)].append(round_seconds)
    say(f"{args.rounds} rounds x {per_round} timed calls per path and kind, rotating over "
          f"the paths; times in ms, {_stats.SPREAD_LEGEND}:")
    summaries = {key: _stats.summarize([s for rnd in rounds for s in rnd])
                 for key, rounds in seconds.items()}
    for name in names:
        say(f"  {label(name):36s} " + "   ".join(
            f"{KINDS[kind]} {summaries[(name, kind)].format(1e3)}" for kind in KINDS))
    reference = names[0]
    if len(names) > 1:
        say(f"time ratios, median of the path / median of {label(reference)} "
              "(> 1: the reference is faster); in brackets the range of the same ratio "
              "per round:")
        for name in names[1:]:
            parts = []
            for kind in KINDS:
                ratio = summaries[(name, kind)].median / summaries[(reference, kind)].median
                per_round_ratios = [np.median(ours) / np.median(theirs) for ours, theirs in
                                    zip(seconds[(name, kind)], seconds[(reference, kind)])]
                parts.append(f"{KINDS[kind]} {ratio:.2f}x [{min(per_round_ratios):.2f}, "
                             f"{max(per_round_ratios):.2f}]")
            say(f"  {label(name):36s} " + "   ".join(parts))
    workload = next(iter(states.values())).workload if states else workload_of(args)
    print_bandwidth_limit(args, bandwidth, workload, unique_rows, summaries, names)
    print_pairings(seconds, summaries, names)
    return 0


# ------------------------------------------------------------------ --compare-builds

def build_worker(args: argparse.Namespace) -> int:
    """One build's worker: loads --worker-lib, sets up the workload, then answers "run"
    commands with the times of path (a)'s forward passes or train steps."""
    tf = _import_tf(args)
    from tfhybrid import custom_ops as co
    from tfhybrid.custom_ops import build as ops_build

    co.library_path = str(args.worker_lib)  # before the first load
    if not co.custom_ops_available():
        raise RuntimeError(f"worker: cannot load {args.worker_lib}: {co.load_error()}")
    workload = workload_of(args)
    state = TfState(tf, workload, workload_lib.zipf_ids(workload, args.warmup + args.iters),
                    workload_lib.upstream_gradient(workload))
    fns = make_tfhybrid_fns(tf, co, state)
    for batch in range(args.warmup):
        for fn in fns.values():
            fn(state.batches[batch])
    try:
        isa = co.kernel_isa()
    except RuntimeError:  # a library built before kernel dispatch (--native-lib)
        isa = "n/a (library without dispatch)"
    print(workload_lib.format_worker_line(
        "ready", {"isa": isa, "march": ops_build.library_march(args.worker_lib)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["command"] == "quit":
            return 0
        if command["command"] != "run" or command["kind"] not in fns:
            raise ValueError(f"worker: unknown command {line.strip()!r}")
        fn = fns[command["kind"]]
        fn(state.batches[command["warm"]])
        seconds, out = [], None
        for batch in command["batches"]:
            start = time.perf_counter()
            out = fn(state.batches[batch])
            seconds.append(time.perf_counter() - start)
        # The train step's loss: the same bits in both workers if the builds compute the
        # same (the tables evolve through the same sequence of steps).
        loss = float(out.numpy()).hex() if command["kind"] == "step" else None
        print(workload_lib.format_worker_line("times", {"seconds": seconds, "loss": loss}),
              flush=True)
    raise RuntimeError("worker: stdin closed without quit")


def compare_builds(args: argparse.Namespace) -> int:
    from tfhybrid.custom_ops import build as ops_build
    from tfhybrid.testing import provenance
    load = provenance.OtherLoad()

    workload = workload_of(args)
    print(f"optimizer_apply --compare-builds: {os.cpu_count()} CPUs ({_cpu_model()}), "
          f"intra-op threads {args.threads}")
    print(f"workload: path (a) tfhybrid kernels, {workload.tables} tables x {workload.rows:,} "
          f"x {workload.dim} fp32, batch {workload.batch}, {workload.hotness} ids/bag, "
          f"Zipf({workload.zipf_alpha}), combiner sum, concat, row-wise AdaGrad")
    tmp = Path(tempfile.mkdtemp(prefix="tfhybrid-bench-builds-"))
    workers: list[Worker] = []
    try:
        libs: dict[str, Path] = {}
        for name, given, native in (("portable", args.portable_lib, False),
                                    ("native", args.native_lib, True)):
            if given is not None:
                libs[name] = given
                continue
            if not native and ops_build.is_up_to_date(ops_build.LIB_PATH, native=False):
                libs[name] = ops_build.LIB_PATH
                print(f"{name} build: {libs[name]} (up to date)")
                continue
            start = time.perf_counter()
            libs[name] = ops_build.build(force=True, verbose=False, native=native,
                                         output=tmp / f"{name}{ops_build.LIB_NAME}")
            print(f"{name} build: {libs[name]} (built in {time.perf_counter() - start:.0f} s)",
                  flush=True)
        for name, lib in libs.items():
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker-lib", str(lib),
                    "--worker-rows", str(workload.rows), "--worker-batch", str(workload.batch)]
            for opt in ("threads", "inter_threads", "tables", "dim", "hotness", "alpha",
                        "iters", "warmup", "seed"):
                argv += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
            workers.append(Worker(name, argv))
        for worker, lib in zip(workers, libs.values()):
            worker.info = worker.receive("ready")
            print(f"{worker.name:9s} library {lib}: -march={worker.info['march']}, "
                  f"kernels {worker.info['isa']}", flush=True)

        # Per round and kind, the two builds run back to back (order flipped every round),
        # so both see nearly the same load from the rest of the machine.
        rounds: list[dict[tuple[str, str], dict]] = []
        next_batch = 0
        for r in range(args.ab_rounds):
            batches = [args.warmup + (next_batch + j) % args.iters for j in range(args.ab_iters)]
            next_batch += args.ab_iters
            order = workers if r % 2 == 0 else workers[::-1]
            rounds.append({(w.name, kind): w.run(kind, 0, batches)
                           for kind in KINDS for w in order})
    finally:
        for worker in workers:
            worker.close()
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    # after the workers ended: their CPU time is this run's own, not other load
    print(load.line())

    print(f"{args.ab_rounds} rounds x {args.ab_iters} timed calls per build and kind; in "
          "each round and kind the builds run back to back, order flipped every round")
    print(f"times (ms), {_stats.SPREAD_LEGEND} over all calls:")
    names = [w.name for w in workers]
    for kind in KINDS:
        for name in names:
            calls = [s for rnd in rounds for s in rnd[(name, kind)]["seconds"]]
            print(f"  {KINDS[kind]:10s} {name:9s} {_stats.summarize(calls).format(1e3)}")
    # Per round, median(portable) / median(native) of the back-to-back blocks, then the
    # median over rounds: the machine's load drifts between rounds (other users), which
    # the pooled times above include; the paired ratios cancel it.
    print("paired ratio portable / native per round (> 1: portable slower):")
    for kind in KINDS:
        paired = [np.median(rnd[("portable", kind)]["seconds"])
                  / np.median(rnd[("native", kind)]["seconds"]) for rnd in rounds]
        low, high = _stats.bootstrap_median_interval(paired)
        print(f"  {KINDS[kind]:10s} {_stats.summarize(paired).format(digits=3)}; 95% "
              f"bootstrap interval of the median [{low:.3f}, {high:.3f}]")
    same = all(rnd[("portable", "step")]["loss"] == rnd[("native", "step")]["loss"]
               for rnd in rounds)
    print(f"train-step losses bitwise equal between the builds in every round: {same}")
    return 0


def main() -> int:
    args = parse_args()
    if args.thp and "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", ""):
        env = dict(os.environ)
        env["GLIBC_TUNABLES"] = ":".join(
            x for x in (env.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=1") if x)
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    if args.worker_lib:
        return build_worker(args)
    if args.compare_builds:
        return compare_builds(args)
    return compare_paths(args)


if __name__ == "__main__":
    sys.exit(main())
