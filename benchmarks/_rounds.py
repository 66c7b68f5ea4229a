"""What benchmarks that run each path in a fresh process share: their command line, one
path's run (its result a JSON line on stdout), rounds whose order rotates, and ratios
taken per round.

>>> per_round_ratio({"a": [2.0, 3.0], "b": [1.0, 1.5]}, "a", "b", "goal")
'a / b: 2.000 (per round 2.000, 2.000); goal'
"""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any, Callable, Sequence

import numpy as np

import _results


def parser_with(description: str, hidden: Sequence[str]) -> argparse.ArgumentParser:
    """``--quick``, ``--rounds``, ``--steps``, ``--out``, and the worker's own arguments
    (``--worker``, ``--rows`` and each of ``hidden``), which users do not set."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int, help="timed steps per run")
    parser.add_argument("--out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in hidden:
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    return parser


def settings_of(args: argparse.Namespace, quick: dict, full: dict) -> dict:
    """The run's settings: ``quick`` or ``full``, with ``--rounds`` / ``--steps`` given."""
    settings = dict(quick if args.quick else full)
    for key in ("rounds", "steps"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return settings


def worker_result(name: str, argv: list[str], line: str) -> dict:
    """Runs one path's worker (``argv``) and returns the JSON after ``line`` on its
    stdout; ``RuntimeError`` with its stderr's end when it gives none."""
    done = subprocess.run(argv, capture_output=True, text=True,
                          env=_results.child_env(OMP_NUM_THREADS=None))
    for out in done.stdout.splitlines():
        if out.startswith(line):
            return json.loads(out[len(line):])
    raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-4000:]}")


def run_rounds(paths: Sequence[tuple], rounds: int, run_path: Callable[[tuple], dict]
               ) -> dict[str, list[dict]]:
    """Each path (named by its first item) once per round, the order rotated by one each
    round; every run's ``seconds`` median printed as it ends."""
    paths = list(paths)
    runs: dict[str, list[dict]] = {p[0]: [] for p in paths}
    for r in range(rounds):
        for path in paths[r % len(paths):] + paths[:r % len(paths)]:
            result = run_path(path)
            runs[path[0]].append(result)
            print(f"round {r + 1} {path[0]:20s} {np.median(result['seconds']) * 1e3:8.1f} ms",
                  flush=True)
    return runs


def per_round_ratio(medians: dict[str, list[float]], top: str, bottom: str, what: Any) -> str:
    """The line of one ratio: its median over the rounds, each round's, and what it says."""
    ratios = [a / b for a, b in zip(medians[top], medians[bottom])]
    return (f"{top} / {bottom}: {np.median(ratios):.3f} (per round "
            f"{', '.join(f'{x:.3f}' for x in ratios)}); {what}")
