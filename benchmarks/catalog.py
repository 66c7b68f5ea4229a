"""Every published benchmark run: the one command behind each results file, and the runner
of them all (``make bench``).

Each :class:`Run` names a script, the arguments of its full run (the run whose files
under ``benchmarks/results/`` the docs quote), the files that run writes, and the
arguments of a quick check that exercises the same code in minutes and writes only into a
scratch folder (``{scratch}`` in the arguments). ``make bench`` runs every quick check;
``make bench BENCH=full`` runs every full run, rewriting the results files, each with its
provenance header (``_results``), and then renders docs/benchmarks.md from them
(``docs_page.py``). ``--only`` picks runs by name.

>>> names = [run.name for run in RUNS]
>>> len(names) == len(set(names))
True
>>> run = by_name("scale_extrapolation")
>>> run.command(quick=False)[:2]
['.venv/bin/python', 'benchmarks/scale_extrapolation.py']
>>> "{scratch}" in " ".join(run.command(quick=True))
True
>>> sorted({o for r in RUNS for o in r.outputs}) == sorted(o for r in RUNS for o in r.outputs)
True

Usage: .venv/bin/python benchmarks/catalog.py [--full] [--only NAME,...] [--list]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = ".venv/bin/python"


@dataclasses.dataclass(frozen=True)
class Run:
    """One results-producing command.

    ``outputs`` are paths under ``benchmarks/results`` (a folder ends in "/": every file
    in it). ``quick`` is None where no shorter run exercises the script (it is run only in
    full); ``root``: the run builds the emulated cluster (network namespaces).
    """
    name: str
    script: str
    args: tuple[str, ...]
    outputs: tuple[str, ...]
    quick: tuple[str, ...] | None
    root: bool = False
    python: str = PYTHON

    def command(self, quick: bool) -> list[str]:
        """The command line, relative to the checkout (``{scratch}``: the quick folder)."""
        args = self.quick if quick else self.args
        if args is None:
            raise ValueError(f"{self.name!r} has no quick check")
        return [self.python, self.script, *args]

    def shell(self) -> str:
        """The full run as a user types it (``sudo`` for the cluster's runs)."""
        return ("sudo " if self.root else "") + shlex.join(self.command(quick=False))


def _tiered(name: str, extra: tuple[str, ...], out: str) -> Run:
    return Run(name, "benchmarks/tiered_tables.py",
               ("--scale_rows", "0", *extra, "--out", f"benchmarks/results/{out}.txt"),
               (f"{out}.txt", f"{out}.json", f"{out}.png",),
               ("--scale_rows", "0", *extra, "--rows", "20000", "--batches", "20",
                "--warmup", "3", "--max_warmup", "20", "--steps", "3", "--repeats", "1",
                "--out", "{scratch}/" + out + ".txt"))


def _dlrm(name: str, cases: str, extra: tuple[str, ...], keras: tuple[str, ...] = ()) -> Run:
    """``keras``: ``("--keras", "3")`` for a run with another Keras, in its quick check too."""
    out = f"benchmarks/results/dlrm_throughput/{name}.txt"
    return Run(f"dlrm_throughput:{name}", "benchmarks/dlrm_throughput.py",
               ("--cases", cases, *extra, *keras, "--output", out),
               (f"dlrm_throughput/{name}.txt",),
               ("--quick", "--cases", cases, *keras, "--output", "{scratch}/" + name + ".txt"))


RUNS: tuple[Run, ...] = (
    Run("optimizer_apply", "benchmarks/optimizer_apply.py", (),
        ("optimizer_apply/",), ("--quick",)),
    _dlrm("keras_vs_1x1_fp32", "keras:fp32,1x1:fp32", ("--rounds", "3")),
    _dlrm("keras3_vs_1x1_fp32", "keras:fp32,1x1:fp32", ("--rounds", "3"), ("--keras", "3")),
    # both Kerases side by side, interleaved, with where each step's time goes
    _dlrm("kerases", "keras:fp32,1x1:fp32,keras:bf16,1x1:bf16",
          ("--rounds", "2", "--steps", "12", "--warmup", "3", "--profile"),
          ("--kerases", "2,3")),
    _dlrm("bf16_fp32", "keras:fp32,1x1:fp32,keras:bf16,1x1:bf16", ("--steps", "20")),
    _dlrm("xla_towers", "keras:fp32,1x1:fp32,1x1:fp32:xla,1x1:bf16,1x1:bf16:xla",
          ("--steps", "15", "--rounds", "3")),
    _dlrm("tf_stacks", "keras:fp32,keras:bf16,1x1:fp32,1x1:bf16,1x2:fp32,1x2:bf16",
          ("--venvs", ".venv,.venv-tf2.15", "--max_table_rows", "100000", "--steps", "15",
           "--warmup", "5", "--rounds", "2")),
    Run("input_throughput", "benchmarks/input_throughput.py", (),
        ("input_throughput.txt", "input_throughput.json", "input_throughput.png",),
        ("--lines", "20000", "--files", "2", "--batch", "2048", "--ranks", "1", "2",
         "--repeats", "1", "--min_seconds", "0.5", "--out", "{scratch}")),
    Run("cluster_comm", "benchmarks/cluster_comm.py", (),
        ("cluster_comm/points.json", "cluster_comm/table.txt",
                 "cluster_comm/step_time_and_bytes.png",),
        ("--quick", "--out", "{scratch}/cluster_comm"), root=True),
    # the cost model's second workload: every point held out by cost_model_validation
    Run("cluster_comm:second_workload", "benchmarks/cluster_comm.py",
        ("--workload", "second", "--topologies", "2x2", "--runs", "2",
         "--out", "benchmarks/results/cluster_comm_second_workload"),
        ("cluster_comm_second_workload/",), None, root=True),
    # the rates the cost model would otherwise fit, measured for each workload
    Run("cost_model_rates:dlrm", "benchmarks/cost_model_rates.py", (),
        ("cost_model_rates/rates_dlrm.json", "cost_model_rates/rates_dlrm.txt"),
        ("--repeats", "3", "--out", "{scratch}")),
    Run("cost_model_rates:second", "benchmarks/cost_model_rates.py",
        ("--workload", "second"),
        ("cost_model_rates/rates_second.json", "cost_model_rates/rates_second.txt"), None),
    # reads cluster_comm's points and the measured rates: in a quick check, those of the
    # quick runs above
    Run("cost_model_validation", "benchmarks/cost_model_validation.py", (),
        ("cluster_comm/validation.txt", "cluster_comm/validation.json",
                 "cluster_comm/cost_model_validation.png",),
        ("--points", "{scratch}/cluster_comm/points.json", "--other_workload",
         "--rates", "{scratch}", "--out", "{scratch}/cluster_comm")),
    Run("scale_extrapolation", "benchmarks/scale_extrapolation.py", (),
        ("scale_extrapolation.txt", "scale_extrapolation.png",),
        ("--out", "{scratch}/scale_extrapolation.txt")),
    Run("scale_extrapolation:weights_k100", "benchmarks/scale_extrapolation.py",
        ("--replica_sync", "weights", "--sync_every", "100",
         "--out", "benchmarks/results/scale_extrapolation_weights_k100.txt"),
        ("scale_extrapolation_weights_k100.txt", "scale_extrapolation_weights_k100.png",),
        None),
    Run("dct_cluster_dp_only", "benchmarks/cluster_comm.py",
        ("--dct", "--dct_mp_keep", "off", "--topologies", "2x2", "--bandwidths",
         "10000,1000,250", "--out", "benchmarks/results/dct_cluster_dp_only"),
        ("dct_cluster_dp_only/",), None, root=True),
    Run("dct_cluster", "benchmarks/cluster_comm.py",
        ("--dct", "--topologies", "2x2", "--bandwidths", "10000,1000,250",
         "--out", "benchmarks/results/dct_cluster"),
        ("dct_cluster/",), None, root=True),
    Run("dct_compute", "benchmarks/dct_compute.py", (), ("dct_compute.txt",),
        ("--repeats", "3", "--out", "{scratch}/dct_compute.txt")),
    Run("dct_quality", "benchmarks/dct_quality.py", (), ("dct_quality/",),
        ("--quick",)),
    Run("dct_quality:dp_only", "benchmarks/dct_quality.py",
        ("--mp_keep", "off", "--no_curve", "--out", "benchmarks/results/dct_quality_dp_only"),
        ("dct_quality_dp_only/",), None),
    Run("dct_quality:mp_keep_0.5", "benchmarks/dct_quality.py",
        ("--mp_keep", "0.5", "--no_curve", "--out",
         "benchmarks/results/dct_quality_mp_keep_0.5"),
        ("dct_quality_mp_keep_0.5/",), None),
    # dynamic tables' step against fixed tables and TFRA 0.7.2 (bench-setup's .venv-tfra)
    Run("dynamic_tables", "benchmarks/dynamic_tables.py", (), ("dynamic_tables/",),
        ("--quick", "--out", "{scratch}/dynamic_tables")),
    # weighted bags' lookup + train step against unweighted ones on the same ids
    Run("weighted_bags", "benchmarks/weighted_bags.py", (), ("weighted_bags/",),
        ("--quick", "--out", "{scratch}/weighted_bags")),
    # dynamic tables at half their distinct keys against unbounded ones
    Run("dynamic_quality", "benchmarks/dynamic_quality.py",
        ("--seeds", "3", "--steps", "1000", "--sets", "all,drifting",
         "--out", "benchmarks/results/dynamic_quality"),
        ("dynamic_quality/",), ("--quick", "--out", "{scratch}/dynamic_quality")),
    Run("fiited_quality", "benchmarks/fiited_quality.py", (), ("fiited_quality/",),
        ("--seeds", "1", "--targets", "0.25", "--datasets", "synthetic", "--steps", "60",
         "--arms", "uniform", "--out", "{scratch}")),
    Run("fiited_quality:16_chunks", "benchmarks/fiited_quality.py",
        ("--chunks", "16", "--targets", "0.125", "0.0625", "--arms", "uniform",
         "--out", "benchmarks/results/fiited_quality_16_chunks"),
        ("fiited_quality_16_chunks/",), None),
    Run("fiited_quality:deep", "benchmarks/fiited_quality.py",
        ("--targets", "0.0625", "0.03125", "--min_chunks", "0",
         "--out", "benchmarks/results/fiited_quality_deep"),
        ("fiited_quality_deep/",), None),
    Run("fiited_speed", "benchmarks/fiited_speed.py", (), ("fiited_speed/",),
        ("--quick",)),
    Run("fiited_checkpoint", "benchmarks/fiited_checkpoint.py", (),
        ("fiited_checkpoint/",), ("--quick",)),
    _tiered("tiered_tables", (), "tiered_tables"),
    _tiered("tiered_tables:small_towers", ("--bottom_mlp", "64", "--top_mlp", "128,64"),
            "tiered_tables_small_towers"),
    _tiered("tiered_tables:fiited", ("--adaptive", "0.35"), "tiered_tables_fiited"),
    _tiered("tiered_tables:fiited_small_towers",
            ("--adaptive", "0.35", "--bottom_mlp", "64", "--top_mlp", "128,64"),
            "tiered_tables_fiited_small_towers"),
    Run("tiered_tables:scale", "benchmarks/tiered_tables.py",
        ("--skip_throughput", "--out", "benchmarks/results/tiered_tables_scale.txt"),
        ("tiered_tables_scale.txt", "tiered_tables_scale.json",), None),
    Run("tiered_mesh", "benchmarks/tiered_mesh.py", (), ("tiered_mesh/",),
        ("--quick",)),
    Run("pipeline_overlap:dlrm", "benchmarks/pipeline_overlap.py",
        ("--towers", "dlrm", "--topologies", "2x2", "--links", "1000"),
        ("pipeline_overlap/points_dlrm.json", "pipeline_overlap/table_dlrm.txt",
                 "pipeline_overlap/pipeline_overlap_dlrm.png",), None, root=True),
    Run("pipeline_overlap:small", "benchmarks/pipeline_overlap.py",
        ("--towers", "small", "--topologies", "2x2", "--links", "1000"),
        ("pipeline_overlap/points_small.json", "pipeline_overlap/table_small.txt",
                 "pipeline_overlap/pipeline_overlap_small.png",),
        ("--quick", "--towers", "small", "--topologies", "2x2", "--links", "1000"),
        root=True),
    # serving: external tables in a local Redis Cluster against the all-inline SavedModel,
    # the export's write rate against redis-benchmark
    Run("serving", "benchmarks/serving.py", (), ("serving/",),
        ("--quick", "--out", "{scratch}/serving")),
    Run("training_digest", "scripts/training_digest.py",
        ("--keras", "3", "--output", "benchmarks/results/training_digest/tf2.21-keras3.txt"),
        ("training_digest/tf2.21-keras3.txt",),
        ("--keras", "3", "--cases", "table:sgd,keras_layer:adam",
         "--output", "{scratch}/digest-keras3.txt")),
    Run("training_digest:keras2", "scripts/training_digest.py",
        ("--keras", "2", "--output", "benchmarks/results/training_digest/tf2.21.txt"),
        ("training_digest/tf2.21.txt",),
        ("--keras", "2", "--cases", "table:sgd,keras_layer:adam",
         "--output", "{scratch}/digest-keras2.txt")),
    Run("training_digest:tf2.15", "scripts/training_digest.py",
        ("--output", "benchmarks/results/training_digest/tf2.15.txt"),
        ("training_digest/tf2.15.txt",), None, python=".venv-tf2.15/bin/python"),
)


def by_name(name: str) -> Run:
    """The run called ``name``; ValueError naming the known ones otherwise."""
    for run in RUNS:
        if run.name == name:
            return run
    raise ValueError(f"no benchmark run {name!r}; expected one of "
                     f"{', '.join(r.name for r in RUNS)}")


def owner_of(path: str) -> Run | None:
    """The run whose outputs include ``path`` (relative to ``benchmarks/results``)."""
    for run in RUNS:
        for output in run.outputs:
            if path == output or (output.endswith("/") and path.startswith(output)):
                return run
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="the full runs (rewrite benchmarks/results); default: quick checks")
    parser.add_argument("--only", default="", help="comma-separated run names")
    parser.add_argument("--list", action="store_true", help="print the full runs' commands")
    args = parser.parse_args()
    runs = [by_name(n) for n in args.only.split(",")] if args.only else list(RUNS)
    if args.list:
        for run in runs:
            print(f"{run.name:36} {run.shell()}")
        return 0
    if not args.full:
        runs = [run for run in runs if run.quick is not None]
    if any(run.root for run in runs) and os.geteuid() != 0:
        raise SystemExit("the emulated cluster's runs need root: "
                         + ", ".join(r.name for r in runs if r.root))
    scratch = tempfile.mkdtemp(prefix="tfhybrid-bench-")
    # every run's own temporary files go under the scratch folder too, so nothing a run
    # leaves behind (a killed child's folders) outlives the catalog's cleanup
    env = dict(os.environ, TMPDIR=scratch)
    failed = []
    for run in runs:
        command = [part.replace("{scratch}", scratch) for part in run.command(not args.full)]
        print(f"=== {run.name}: {shlex.join(command)}", flush=True)
        started = time.time()
        done = subprocess.run(command, cwd=ROOT, env=env)
        print(f"=== {run.name}: exit {done.returncode} after {time.time() - started:.0f} s",
              flush=True)
        if done.returncode != 0:
            failed.append(run.name)
    if args.full:
        # the page quotes the files just written: render it from them (it stops on a
        # figure whose file or line is gone, rather than print a stale one)
        page = subprocess.run([PYTHON, "benchmarks/docs_page.py"], cwd=ROOT)
        if page.returncode != 0:
            failed.append("docs_page")
    if args.full:
        # the full runs write benchmarks/results; the scratch holds only their temporaries
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{len(runs) - len(failed)} of {len(runs)} runs passed"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + ("" if args.full else f"; quick outputs in {scratch}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
