"""Where a benchmark writes its results: its folder under ``benchmarks/results/`` for a
full run, and a scratch folder for ``--quick``, so that checking a script never
overwrites the figures the docs quote. ``--out`` still chooses any folder.

>>> out_dir("dct_quality", quick=False).endswith("benchmarks/results/dct_quality")
True
>>> "benchmarks/results" in out_dir("dct_quality", quick=True)
False
"""

from __future__ import annotations

import os
import tempfile

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def out_dir(name: str, quick: bool, given: str | None = None) -> str:
    """``given`` if set; else ``results/<name>`` for a full run and a new temporary
    folder (its path printed by the caller) for a quick one."""
    if given:
        return given
    if quick:
        return tempfile.mkdtemp(prefix=f"tfhybrid-{name}-quick-")
    return os.path.join(RESULTS, name)
