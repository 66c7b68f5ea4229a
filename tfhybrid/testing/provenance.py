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
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
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


def header(argv: Sequence[str], python: str = sys.executable,
           root: str | None = None) -> list[str]:
    """``# command``, ``# commit``, ``# date`` and ``# CPU`` lines for a results file.

    Args:
      argv: the script and its arguments (``sys.argv``), as a user would rerun them.
      python: the interpreter that ran it, shown relative to ``root``.
      root: the repository (default: the one holding this package).
    """
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    commit = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    return [f"# command: {shlex.join([os.path.relpath(python, root)] + list(argv))}",
            f"# commit: {commit}",
            f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
            f"# CPU: {cpu_description()}"]
