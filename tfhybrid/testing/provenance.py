"""The header of a results file: how to rerun it, on what code and on what machine.

A figure means little without the CPU's vector extensions: bf16 GEMMs are fast with
AVX-512 BF16 (or AMX) and slower than fp32 without them, and the op library picks its
kernels by ISA level. So the CPU line names them, as read from ``/proc/cpuinfo``.
Standard library only: a benchmark's parent process imports it without TensorFlow.

>>> lines = header(["benchmarks/x.py", "--quick"], python="/repo/.venv/bin/python",
...                root="/repo")
>>> [line.split(":")[0] for line in lines]
['# command', '# commit', '# date', '# CPU']
>>> lines[0]
'# command: .venv/bin/python benchmarks/x.py --quick'

A run also says how busy the machine was with other work while it measured
(:class:`OtherLoad`): a figure taken beside a compiler or a test suite is not one taken
on an idle machine, and the header shows which it was.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Sequence

# the /proc/cpuinfo flags that decide which kernels run, in the order they are named
_ISA_FLAGS = (("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"),
              ("avx512_vnni", "AVX-512 VNNI"), ("amx_tile", "AMX"))


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none)."""
    fields: dict[str, str] = {}
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    return fields


def cpu_description(cpuinfo: dict[str, str] | None = None) -> str:
    """The CPU's model, family/model numbers, logical cores and vector extensions.

    >>> cpu_description({"model name": "AMD EPYC", "cpu family": "25", "model": "1",
    ...                  "flags": "fma avx2"}).split(", ")[:3]
    ['AMD EPYC (family 25 model 1)', 'AVX2', 'no AVX-512']
    """
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    name = info.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in info:
        name += f" (family {info['cpu family']} model {info.get('model', '?')})"
    flags = set(info.get("flags", "").split())
    isa = ["AVX2" if "avx2" in flags else "no AVX2"]
    isa += [label for flag, label in _ISA_FLAGS if flag in flags]
    if "avx512f" not in flags:
        isa.append("no AVX-512")
    return ", ".join([name] + isa + [f"{os.cpu_count()} logical cores"])


def _busy_seconds() -> float:
    """CPU-seconds every core of the machine has spent busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU-seconds of this process and of the children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """The cores that work other than this run kept busy while it measured: the
    machine's busy CPU-seconds minus this process's and its finished children's, per
    second of the run. Start it before the first measurement; ``cores()`` at the end.

    >>> load = OtherLoad()
    >>> time.sleep(0.3)
    >>> 0.0 <= load.cores() <= os.cpu_count()
    True
    """

    def __init__(self) -> None:
        self._start = (time.monotonic(), _busy_seconds(), _own_seconds())

    def cores(self) -> float:
        """Mean cores busy with other work since this object was made, within [0, the
        machine's cores] (the machine's and the process's clocks tick apart, by up to a
        clock tick each: a run of a few seconds or more reads true)."""
        wall, busy, own = self._start
        elapsed = max(time.monotonic() - wall, 1e-9)
        other = (_busy_seconds() - busy) - (_own_seconds() - own)
        return min(max(other / elapsed, 0.0), float(os.cpu_count() or 1))

    def line(self) -> str:
        """The header line: ``# other load: 0.03 of 2 cores (mean over the run)``."""
        return (f"# other load: {self.cores():.2f} of {os.cpu_count()} cores "
                f"(mean over the run)")


# results files a run rewrites, and the page rendered from them (benchmarks/docs_page.py):
# their changes say nothing about the code that ran
RESULTS_DIR = os.path.join("benchmarks", "results")
RENDERED_PAGE = os.path.join("docs", "benchmarks.md")


def commit(root: str) -> str:
    """HEAD's short hash, with ``-dirty`` when a tracked file other than the results and
    the page rendered from them differs from it (the code that ran is not the commit's);
    ``unknown`` outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", root, *args], capture_output=True,
                              text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                  f":(exclude){RESULTS_DIR}", f":(exclude){RENDERED_PAGE}")
    return head + ("-dirty" if changed else "")


def header(argv: Sequence[str], python: str = sys.executable,
           root: str | None = None, load: OtherLoad | None = None) -> list[str]:
    """``# command``, ``# commit``, ``# date`` and ``# CPU`` lines for a results file,
    and ``# other load`` when the run's ``load`` is given.

    Args:
      argv: the script and its arguments (``sys.argv``), as a user would rerun them.
      python: the interpreter that ran it, shown relative to ``root``.
      root: the repository (default: the one holding this package).
      load: the :class:`OtherLoad` started with the run's measurements.
    """
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    return [f"# command: {shlex.join([os.path.relpath(python, root)] + list(argv))}",
            f"# commit: {commit(root)}",
            f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
            f"# CPU: {cpu_description()}"] + ([load.line()] if load else [])
