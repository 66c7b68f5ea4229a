"""DLRM training step time and samples/s through model.fit, tfhybrid vs plain Keras, in one run.

The model of NVIDIA's TF2 DLRM example: Criteo-1TB's 26 tables capped at --max_table_rows
rows, embedding dim 128, 13 dense features, bottom MLP 512-256-128, top MLP
1024-1024-512-256-1, dot interaction, global batch 4096, SGD(0.01), binary cross-entropy.
Every case trains that model through ``model.fit`` in its own job (``horovodrun`` for two
processes), on the same cycled synthetic batches:

- ``keras:<precision>[:xla]``: the baseline, measured in the same run: the same model with
  whole ``tf.keras.layers.Embedding`` tables in one process (``DLRM(distributed=False)``),
  plain ``tf.keras.optimizers.legacy.SGD(0.01)``; no Horovod, no tfhybrid kernels;
- ``DxM:<precision>[:xla]``: tfhybrid, tables in a DistributedEmbedding on a D x M mesh,
  ``tfhybrid.DistributedOptimizer(SGD(0.01))``, tfhybrid's default callbacks.

Each process gets cores / processes intra- and inter-op threads. Per case it prints the
median step time with its spread over the timed steps (rank 0's step ends; ranks move in
lockstep through their collectives) and samples/s at the median step time, and the ratio
of medians to the baseline case of this run. NVIDIA's own TF2 DLRM is not run here (its
code is not installed on this machine), so nothing is compared with it: published figures
are not quoted beside these.

``--profile`` traces PROFILE_STEPS more steps after the timed ones with the TF profiler
(so the step times stay untraced) and prints, per case, where the op time goes (MLP
GEMMs, interaction, embeddings, updates, the rest), the time in which some op ran (the
union over compute threads), the host-only rest of the wall time, and the host threads'
largest outermost events (the step's function call, the iterator, Keras' work between
steps). A case may name
another checkout after ``@`` (``1x1:fp32@/tmp/before``): it imports that tree's tfhybrid,
so one run compares a change with the code before it. ``--venvs .venv,.venv-tf2.15`` runs
every case in each venv (each a TensorFlow stack ``make setup TF=...`` installs), so one
run compares the stacks; a case names its venv after ``%`` (``1x1:bf16%.venv-tf2.15``).
``--kerases 2,3`` runs every case
with each Keras as ``tf.keras`` (a case names its Keras as ``:k2`` or ``:k3``, e.g.
``1x1:fp32:k3``), interleaved in each round, so one run compares the two Kerases.
``--output FILE`` also writes what is printed to FILE at the end, under a header with the
command, commit, date, CPU, the other load on the machine during the run and each venv's
TensorFlow.

Usage: .venv/bin/python benchmarks/dlrm_throughput.py [--quick] [--steps 30] [--warmup 5]
           [--cases keras:fp32,1x1:fp32,1x2:bf16:xla,...] [--max_table_rows 1000000]
           [--profile] [--rounds 3] [--venvs .venv,.venv-tf2.15] [--keras 2|3]
           [--kerases 2,3] [--output FILE]
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import _stats  # beside this script
# _results is imported only in the parent's functions: it puts this checkout first on
# sys.path, and a case's child (this file, --child) must import the tfhybrid of the tree
# its PYTHONPATH names (a case's @TREE)

BASELINE_MESH = "keras"
DEFAULT_CASES = (f"{BASELINE_MESH}:fp32",) + tuple(
    f"{mesh}:{precision}{xla}" for mesh in ("1x1", "2x1", "1x2")
    for precision in ("fp32", "bf16") for xla in ("", ":xla"))
FULL = dict(cases=",".join(DEFAULT_CASES), steps=30, warmup=5, batch=4096,
            max_table_rows=1_000_000)
QUICK = dict(cases=f"{BASELINE_MESH}:fp32,1x1:fp32,1x2:fp32", steps=8, warmup=3, batch=512,
             max_table_rows=10_000)
EMBEDDING_DIM, DENSE_FEATURES = 128, 13
BOTTOM_MLP, TOP_MLP = [512, 256, 128], [1024, 1024, 512, 256, 1]
LEARNING_RATE = 0.01
DISTINCT_BATCHES = 4  # cycled: the input pipeline is not what is measured
PROFILE_STEPS = 5     # traced after the timed steps (--profile)


@dataclass(frozen=True)
class Case:
    name: str
    plain_keras: bool
    data_parallel: int
    model_parallel: int
    precision: str
    xla: bool
    tree: str = ""   # another checkout whose tfhybrid the case imports ("" = this one)
    venv: str = ""   # the venv whose Python runs the case ("" = this Python's)
    keras: str = ""  # "2" or "3": the Keras that is tf.keras ("" = as exported)

    @property
    def processes(self) -> int:
        return self.data_parallel * self.model_parallel

    @property
    def python(self) -> str:
        return os.path.join(self.venv, "bin", "python") if self.venv else sys.executable

    @staticmethod
    def parse(name: str) -> "Case":
        spec, _, tree = name.partition("@")
        if tree and not os.path.isdir(os.path.join(tree, "tfhybrid")):
            raise ValueError(f"case {name!r}: {tree!r} holds no tfhybrid package")
        spec, _, venv = spec.partition("%")
        if venv and not os.access(os.path.join(venv, "bin", "python"), os.X_OK):
            raise ValueError(f"case {name!r}: {venv!r} is not a venv (no bin/python)")
        parts = spec.split(":")
        kerases = [p[1:] for p in parts[2:] if p in ("k2", "k3")]
        if len(parts) < 2 or parts[1] not in ("fp32", "bf16") or len(kerases) > 1 or \
                any(p not in ("xla", "k2", "k3") for p in parts[2:]):
            raise ValueError(f"case {name!r}: expected "
                             f"<DxM|{BASELINE_MESH}>:<fp32|bf16>[:xla][:k2|:k3]")
        if parts[0] == BASELINE_MESH:
            data_parallel, model_parallel = 1, 1
        else:
            data_parallel, model_parallel = (int(x) for x in parts[0].split("x"))
        return Case(name, parts[0] == BASELINE_MESH, data_parallel, model_parallel, parts[1],
                    "xla" in parts[2:], tree, venv, kerases[0] if kerases else "")


def _child(args: argparse.Namespace) -> None:
    """One case in this process (one rank of a horovodrun job for 2-process meshes)."""
    import numpy as np
    import tensorflow as tf

    from tfhybrid import _tf_internals
    from tfhybrid.train.data import CRITEO_1TB_CARDINALITIES
    from tfhybrid.train.models import DLRM, example_batch

    case = Case.parse(args.case)
    threads = max(1, (os.cpu_count() or 1) // case.processes)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    tf.keras.mixed_precision.set_global_policy(
        "mixed_bfloat16" if case.precision == "bf16" else "float32")
    rows = [min(r, args.max_table_rows) for r in CRITEO_1TB_CARDINALITIES]
    sgd = _tf_internals.scattering_sgd(LEARNING_RATE)  # sparse row updates, no slots
    if case.plain_keras:
        rank, size = 0, 1
        model = DLRM(rows, DENSE_FEATURES, EMBEDDING_DIM, bottom_mlp_dims=BOTTOM_MLP,
                     top_mlp_dims=TOP_MLP, xla=case.xla, distributed=False)
        optimizer, callbacks = sgd, []
    else:
        import tfhybrid
        mesh = tfhybrid.init(model_parallel=case.model_parallel)
        rank, size = mesh.rank, mesh.size
        model = DLRM(rows, DENSE_FEATURES, EMBEDDING_DIM, bottom_mlp_dims=BOTTOM_MLP,
                     top_mlp_dims=TOP_MLP, xla=case.xla)
        optimizer = tfhybrid.DistributedOptimizer(sgd)
        callbacks = tfhybrid.callbacks.defaults()
    local = args.batch // size
    model(example_batch(model, local))
    model.compile(optimizer=optimizer,
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(rank)
    batches = [({"dense": rng.random([local, DENSE_FEATURES], np.float32),
                 "categorical": np.stack([rng.integers(0, r, local) for r in rows],
                                         1).astype(np.int32)},
                rng.integers(0, 2, [local, 1]).astype(np.float32))
               for _ in range(DISTINCT_BATCHES)]
    data = tf.data.Dataset.from_tensor_slices(
        tf.nest.map_structure(lambda *x: np.stack(x), *batches)).repeat().prefetch(2)
    step_ends: list[float] = []
    profile_dir = os.path.join(os.path.dirname(args.out), "profile") if args.profile else ""

    class StepEnds(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step_ends.append(float(tf.timestamp().numpy()))
            if profile_dir and batch == args.warmup + args.steps - 1:   # after the timed
                tf.profiler.experimental.start(profile_dir)

        def on_train_end(self, logs=None):
            if profile_dir:
                tf.profiler.experimental.stop()

    model.fit(data, steps_per_epoch=args.warmup + args.steps
              + (PROFILE_STEPS if profile_dir else 0), verbose=0,
              callbacks=callbacks + [StepEnds()])
    if rank == 0:
        # the end of the last warm-up step starts step 1
        timed = step_ends[args.warmup - 1:args.warmup + args.steps]
        result = {"step_seconds": [b - a for a, b in zip(timed, timed[1:])],
                  "threads": threads, "keras": _tf_internals.KERAS_MAJOR}
        if profile_dir:
            traced = step_ends[args.warmup + args.steps - 1:]
            result["profile_ms"] = {category: seconds * 1e3 / PROFILE_STEPS for
                                    category, seconds in
                                    _op_seconds_by_category(profile_dir).items()}
            result["profile_ms"]["wall"] = (traced[-1] - traced[0]) * 1e3 / PROFILE_STEPS
        with open(args.out, "w") as f:
            json.dump(result, f)


# Where a step's op time goes: the first category whose test matches an op's name scope
# and type (TF profiler events "scope/name:Type"); ops the same in every case fall alike.
MATMULS = ("MatMul", "_MklMatMul", "_FusedMatMul", "_MklNativeFusedMatMul", "_MklFusedMatMul")
SPARSE_UPDATES = ("ResourceScatterAdd", "ResourceScatterSub", "Neg", "RowwiseAdagradApply",
                  "ResourceSparseApplyAdagradV2", "ResourceScatterUpdate")
PROFILE_CATEGORIES = (
    ("embedding updates", lambda scope, op: op in SPARSE_UPDATES),
    ("dense updates", lambda scope, op: op.startswith("ResourceApply")),
    ("embeddings: lookup, backward, exchange", lambda scope, op: "embedding" in scope),
    ("interaction: forward, backward", lambda scope, op: "interaction" in scope),
    ("MLP GEMMs", lambda scope, op: op in MATMULS and "mlp" in scope),
    ("MLP other: bias, relu, backward", lambda scope, op: "mlp" in scope),
    ("other: loss, casts, Keras", lambda scope, op: True),
)


# the host-time rows: seconds in which no op of the step ran on any compute thread, and
# the host threads' own events (TraceMe: the step's function call, the executor, Keras'
# Python-side work between steps), each thread's outermost events by name
BUSY, HOST, HOST_EVENT = "ops running (union over threads)", "host only: no op running", \
    "host event: "
HOST_EVENTS_SHOWN = 6


def _op_seconds_by_category(profile_dir: str) -> dict[str, float]:
    """Seconds of TF op time in a profile, per PROFILE_CATEGORIES entry, summed over the
    threads that ran them (two ops at once both count); under ``BUSY`` the seconds in
    which at least one op ran, and under ``HOST_EVENT + name`` the outermost events of the
    threads that run no ops (the host's side of the step)."""
    import glob

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    totals = {name: 0.0 for name, _ in PROFILE_CATEGORIES}
    intervals: list[tuple[int, int]] = []
    host: dict[str, float] = {}
    for path in glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names = {key: meta.name for key, meta in plane.event_metadata.items()}
            for line in plane.lines:
                if not line.name.startswith("tf_Compute"):
                    if plane.name.startswith("/host:CPU"):
                        end = -1
                        for event in sorted(line.events, key=lambda e: e.offset_ps):
                            if event.offset_ps < end:   # nested in the one before
                                continue
                            end = event.offset_ps + event.duration_ps
                            name = names.get(event.metadata_id, "?").split("#")[0][:60]
                            host[name] = host.get(name, 0.0) + event.duration_ps * 1e-12
                    continue
                start = line.timestamp_ns * 1000
                for event in line.events:
                    scope, colon, op = names.get(event.metadata_id, "").rpartition(":")
                    if not colon or scope.endswith(":"):   # the executor's own events
                        continue                              # ("ExecutorState::Process")
                    category = next(name for name, test in PROFILE_CATEGORIES
                                    if test(scope.lower(), op))
                    totals[category] += event.duration_ps * 1e-12
                    intervals.append((start + event.offset_ps,
                                      start + event.offset_ps + event.duration_ps))
    busy, reach = 0, None
    for begin, finish in sorted(intervals):
        if reach is None or begin > reach:
            reach = begin
        if finish > reach:
            busy += finish - max(begin, reach)
            reach = finish
    totals[BUSY] = busy * 1e-12
    for name, seconds in sorted(host.items(), key=lambda kv: -kv[1])[:HOST_EVENTS_SHOWN]:
        totals[HOST_EVENT + name] = seconds
    return totals


def _run_case(case: Case, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [case.python, os.path.abspath(__file__), "--child", "--out", out,
                   "--case", case.name, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--batch", str(args.batch),
                   "--max_table_rows", str(args.max_table_rows)] + (
                       ["--profile"] if args.profile else [])
        if case.processes > 1:
            command = [os.path.join(os.path.dirname(case.python), "horovodrun"), "-np",
                       str(case.processes), "-H", f"localhost:{case.processes}",
                       "--gloo"] + command
        import _results
        # OMP_NUM_THREADS as inherited: a case sets its own thread counts
        env = _results.child_env(OMP_NUM_THREADS=None, PYTHONPATH=case.tree or _results.ROOT)
        if case.keras:
            env[_results.KERAS_ENV] = "1" if case.keras == "2" else "0"
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        if done.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
            raise RuntimeError(f"case {case.name} failed (exit {done.returncode}):\n{tail}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: " + ", ".join(f"--{k} {v}" for k, v in QUICK.items())
                        + " (unless given)")
    parser.add_argument("--cases", help="<DxM|keras>:<fp32|bf16>[:xla], comma separated "
                        f"(default {FULL['cases']})")
    parser.add_argument("--baseline", help="the case every ratio divides by (default: the "
                        "first keras case, else the first case)")
    parser.add_argument("--steps", type=int, help=f"timed steps (default {FULL['steps']})")
    parser.add_argument("--warmup", type=int,
                        help=f"untimed steps first (default {FULL['warmup']})")
    parser.add_argument("--batch", type=int, help=f"global batch (default {FULL['batch']})")
    parser.add_argument("--max_table_rows", type=int,
                        help=f"default {FULL['max_table_rows']:,}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole case list this many times, interleaved, so a "
                        "drifting machine load hits every case alike; a case's figures pool "
                        "its timed steps of every round, and each ratio also shows its range "
                        "over the rounds (default 1)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per case")
    parser.add_argument("--profile", action="store_true",
                        help=f"trace {PROFILE_STEPS} steps after the timed ones with the TF "
                        "profiler and print where each case's step time goes: op time "
                        "by category, the time some op ran, the host-only rest")
    parser.add_argument("--venvs", help="run every case in each of these venvs, comma "
                        "separated (e.g. .venv,.venv-tf2.15: both TensorFlow stacks)")
    parser.add_argument("--keras", choices=("2", "3"),
                        help="the Keras that tf.keras is in every case (sets "
                             "TF_USE_LEGACY_KERAS; default: as exported, else Keras 2, "
                             "benchmarks/_results.py)")
    parser.add_argument("--kerases", help="run every case with each of these Kerases as "
                        "tf.keras, comma separated (2,3: both side by side in one run; a "
                        "case names its Keras as :k2 or :k3)")
    parser.add_argument("--output", help="also write the printed results to this file, "
                        "under a header (command, commit, date, CPU, stacks)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error(f"--warmup={args.warmup}, --steps={args.steps} and "
                     f"--rounds={args.rounds} must be >= 1")
    if args.child:
        _child(args)
        return
    if args.keras:
        import _results
        os.environ[_results.KERAS_ENV] = "1" if args.keras == "2" else "0"
    names = args.cases.split(",")
    if args.kerases and not set(args.kerases.split(",")) <= {"2", "3"}:
        parser.error(f"--kerases={args.kerases}: expected 2, 3 or 2,3")
    if args.kerases:
        names = [f"{n}:k{k}" for k in args.kerases.split(",") for n in names]
    if args.venvs:
        names = [f"{n}%{venv}" for venv in args.venvs.split(",") for n in names]
    try:
        cases = [Case.parse(name) for name in names]
    except ValueError as error:
        parser.error(str(error))
    if args.output:
        global print
        print = _Tee(_stack_lines(cases))
    baseline = args.baseline or next((c.name for c in cases if c.plain_keras), cases[0].name)
    if baseline not in [c.name for c in cases]:
        parser.error(f"--baseline {baseline} is not one of --cases")
    cores = os.cpu_count() or 1
    print(f"DLRM (NVIDIA TF2 example's model): 26 tables capped at {args.max_table_rows:,} "
          f"rows x {EMBEDDING_DIM}, bottom {'-'.join(map(str, BOTTOM_MLP))}, top "
          f"{'-'.join(map(str, TOP_MLP))}, global batch {args.batch}, SGD({LEARNING_RATE}); "
          f"{args.steps} timed steps after {args.warmup} warm-up steps; {cores} CPUs, each "
          "process with cores / processes intra- and inter-op threads")
    print(f"keras = plain Keras in one process (no Horovod, no tfhybrid); DxM = tfhybrid "
          f"on D x M processes; ratios: median step time of {baseline} / the case's "
          f"(> 1: faster than {baseline}). Step time in ms, {_stats.SPREAD_LEGEND}.")
    header = (f"{'case':<16}{'procs x threads':>16}  {'step ms':<38}{'samples/s':>10}"
              f"{'ratio':>8}")
    print(header + ("  ratio per round" if args.rounds > 1 else ""))
    results: dict[str, _stats.Summary] = {}
    steps: dict[str, list[float]] = {}          # every round's timed steps, per case
    round_medians: dict[str, list[float]] = {}  # per case, each round's median step

    def report(case: Case, result: dict) -> None:
        summary = results[case.name]
        ratio = (f"{results[baseline].median / summary.median:.2f}x"
                 if baseline in results else "-")
        per_round = ""
        if args.rounds > 1:
            ratios = [b / c for b, c in zip(round_medians[baseline], round_medians[case.name])]
            per_round = f"  [{min(ratios):.2f}, {max(ratios):.2f}]"
        print(f"{_label(case.name):<16}{case.processes:>12} x {result['threads']:<2}  "
              f"{summary.format(1e3, 1):<38}{args.batch / summary.median:>10,.0f}{ratio:>8}"
              f"{per_round}", flush=True)

    # The baseline runs first in every round, so with one round every row can print its
    # ratio as soon as it is measured; with more, the rows print after the last round.
    profiles: dict[str, dict[str, float]] = {}
    ordered = sorted(cases, key=lambda c: c.name != baseline)
    threads: dict[str, dict] = {}
    for round_index in range(args.rounds):
        for case in ordered:
            result = _run_case(case, args)
            steps.setdefault(case.name, []).extend(result["step_seconds"])
            round_medians.setdefault(case.name, []).append(
                _stats.summarize(result["step_seconds"]).median)
            results[case.name] = _stats.summarize(steps[case.name])
            threads[case.name] = result
            if args.rounds == 1:
                report(case, result)
            if "profile_ms" in result:
                profiles[case.name] = result["profile_ms"]
        if args.rounds > 1:
            print(f"  round {round_index + 1} of {args.rounds} done", flush=True)
    if args.rounds > 1:
        print(header + "  ratio per round")
        for case in ordered:
            report(case, threads[case.name])
    kerases = sorted({result["keras"] for result in threads.values()})
    print(f"tf.keras: Keras {' and '.join(map(str, kerases))}"
          + (" in every case" if len(kerases) == 1 else ", by case"))
    _print_keras_ratios(cases, results, round_medians)
    if profiles:
        print_profiles(profiles, results)
    if args.output:
        print.write(args.output)


def _print_keras_ratios(cases: list[Case], results: dict[str, "_stats.Summary"],
                        round_medians: dict[str, list[float]]) -> None:
    """For each case run in both Kerases: Keras 2's median step over Keras 3's (>= 1:
    Keras 3 is as fast or faster), and its range over the rounds."""
    pairs = {}
    for case in cases:
        if case.keras:
            pairs.setdefault(case.name.replace(f":k{case.keras}", ""), {})[case.keras] = \
                case.name
    pairs = {spec: k for spec, k in pairs.items() if set(k) == {"2", "3"}}
    if not pairs:
        return
    print("Keras 3 against Keras 2 (median step ms of :k2 / of :k3; >= 1: Keras 3 as "
          "fast or faster; range over rounds):")
    for spec, names in pairs.items():
        two, three = names["2"], names["3"]
        per_round = [a / b for a, b in zip(round_medians[two], round_medians[three])]
        print(f"  {_label(spec):<14}{results[two].median / results[three].median:.2f}x  "
              f"[{min(per_round):.2f}, {max(per_round):.2f}]")


def _label(case_name: str) -> str:
    """A case's name with another tree shown by its last folder name and a venv by its
    TensorFlow version."""
    spec, _, tree = case_name.partition("@")
    spec, _, venv = spec.partition("%")
    if venv:
        spec += f" tf{_stack(venv)['tensorflow']}"
    return f"{spec}@{os.path.basename(os.path.normpath(tree))}" if tree else spec


_STACKS: dict[str, dict[str, str]] = {}


def _stack(venv: str) -> dict[str, str]:
    """The versions of a venv's TensorFlow stack, read from its packages' metadata."""
    if venv not in _STACKS:
        code = ("import json\nfrom importlib import metadata as m\nout = {}\n"
                "for d in ('tensorflow', 'tf-keras', 'numpy', 'horovod'):\n"
                "    try: out[d] = m.version(d)\n"
                "    except m.PackageNotFoundError: out[d] = '-'\nprint(json.dumps(out))")
        python = os.path.join(venv, "bin", "python") if venv else sys.executable
        _STACKS[venv] = json.loads(subprocess.run([python, "-c", code], check=True,
                                                  capture_output=True, text=True).stdout)
    return _STACKS[venv]


def _stack_lines(cases: list[Case]) -> list[str]:
    """Each venv's TensorFlow stack, as lines under the results file's header."""
    return [f"# stack {venv or sys.prefix}: "
            + ", ".join(f"{k} {v}" for k, v in _stack(venv).items())
            for venv in dict.fromkeys(c.venv for c in cases)]


class _Tee:
    """print() that also keeps each line, for the results file written at the end under
    its provenance header (with the other load measured from here to then)."""

    def __init__(self, first_lines: list[str]):
        import _results
        from tfhybrid.testing import provenance   # after _results puts this checkout first
        self._results = _results
        self._load = provenance.OtherLoad()
        self._lines = list(first_lines)
        self._print = builtins.print

    def __call__(self, *values, **kwargs) -> None:
        self._print(*values, **kwargs)
        self._lines.append(kwargs.get("sep", " ").join(map(str, values)))

    def write(self, path: str) -> None:
        self._results.write_text(path, self._lines, self._load)


def print_profiles(profiles: dict[str, dict[str, float]],
                   results: dict[str, _stats.Summary]) -> None:
    """Per category, each case's op time per step (ms, summed over compute threads:
    ops that overlap both count, so a column can exceed the step's wall time)."""
    names = list(profiles)
    width = max(14, *(len(_label(n)) + 2 for n in names))
    print("\nwhere the op time goes, ms per step summed over TF's compute threads "
          "(TF profiler, rank 0):")
    print(f"{'':<40}" + "".join(f"{_label(n):>{width}}" for n in names))
    for category, _ in PROFILE_CATEGORIES:
        print(f"{category:<40}" + "".join(f"{profiles[n][category]:>{width}.1f}"
                                          for n in names))
    categories = [c for c, _ in PROFILE_CATEGORIES]
    print(f"{'total op time':<40}" + "".join(
        f"{sum(profiles[n][c] for c in categories):>{width}.1f}" for n in names))
    print(f"{'wall time per step (mean, traced steps)':<40}" + "".join(
        f"{profiles[n]['wall']:>{width}.1f}" for n in names))
    print(f"{BUSY:<40}" + "".join(f"{profiles[n][BUSY]:>{width}.1f}" for n in names))
    print(f"{HOST:<40}" + "".join(f"{profiles[n]['wall'] - profiles[n][BUSY]:>{width}.1f}"
                                  for n in names))
    print(f"{'wall time per step (median, untraced)':<40}" + "".join(
        f"{results[n].median * 1e3:>{width}.1f}" for n in names))
    events = sorted({k for n in names for k in profiles[n] if k.startswith(HOST_EVENT)},
                    key=lambda k: -max(profiles[n].get(k, 0.0) for n in names))
    if events:
        print("host threads' outermost events, ms per step (each case's "
              f"{HOST_EVENTS_SHOWN} largest; '-': not among them):")
    for key in events:
        print(f"  {key[len(HOST_EVENT):][:38]:<38}" + "".join(
            f"{profiles[n][key]:>{width}.1f}" if key in profiles[n] else f"{'-':>{width}}"
            for n in names))


if __name__ == "__main__":
    main()
