"""Where a benchmark's paths and child environment come from: the checkout (``ROOT``), the
results folders, and the environment of the processes a benchmark starts.

A benchmark writes its results into its folder under ``benchmarks/results/`` for a full
run, and into a scratch folder for ``--quick``, so that checking a script never
overwrites the figures the docs quote. ``--out`` still chooses any folder.

>>> out_dir("dct_quality", quick=False).endswith("benchmarks/results/dct_quality")
True
>>> "benchmarks/results" in out_dir("dct_quality", quick=True)
False
>>> RESULTS == os.path.join(ROOT, "benchmarks", "results")
True

A child gets this checkout as its import path, one OpenMP thread and TF's C++ logs from
errors up, unless the caller says otherwise (``None``: as this process has it):

>>> env = child_env(TF_NUM_INTRAOP_THREADS="1")
>>> env["PYTHONPATH"] == ROOT, env["OMP_NUM_THREADS"], env["TF_NUM_INTRAOP_THREADS"]
(True, '1', '1')
>>> child_env(OMP_NUM_THREADS=None).get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")
True
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from tfhybrid.testing.provenance import OtherLoad

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# The scripts import this checkout's tfhybrid (not one installed elsewhere, nor another
# tree's on PYTHONPATH) and their helpers as ``benchmarks._stats`` etc., which only this
# folder on sys.path makes importable: importing this module puts it first, for them all.
# (dlrm_throughput.py imports it only in its parent process for that reason.)
sys.path.insert(0, ROOT)

# The figures are measured with Keras 2 (tf-keras) as tf.keras: the Keras of the baselines
# (distributed-embeddings, NVIDIA's TF2 DLRM example, TF 2.15), so that a comparison runs
# one Keras on both sides. Set before any tf.keras use (TensorFlow reads it then); an
# exported TF_USE_LEGACY_KERAS=0 measures Keras 3 instead. Children inherit it.
KERAS_ENV = "TF_USE_LEGACY_KERAS"
os.environ.setdefault(KERAS_ENV, "1")


def out_dir(name: str, quick: bool, given: str | None = None) -> str:
    """``given`` if set; else ``results/<name>`` for a full run and a new temporary
    folder (its path printed by the caller) for a quick one."""
    if given:
        return given
    if quick:
        return tempfile.mkdtemp(prefix=f"tfhybrid-{name}-quick-")
    return os.path.join(RESULTS, name)


def child_env(**extra: str | None) -> dict[str, str]:
    """This process's environment for a benchmark's child (a worker, or the horovodrun of
    a job): ``PYTHONPATH`` is ROOT alone (an inherited one is replaced, so the child runs
    this tree's tfhybrid), ``OMP_NUM_THREADS=1`` (ranks share the machine's cores) and
    ``TF_CPP_MIN_LOG_LEVEL=2``. ``extra`` adds variables or overrides these; a ``None``
    value leaves that variable as this process has it (set or not)."""
    chosen = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT,
              **extra}
    return dict(os.environ, **{name: value for name, value in chosen.items()
                               if value is not None})


# the header's load line of a run whose jobs run in tfhybrid.testing.cluster's nodes: their
# processes are not this one's children, so other load cannot be told from theirs
LOAD_NOT_MEASURED = ("# other load: not measured (the jobs run in the emulated nodes, "
                     "outside this process tree)")


def write_text(path: str, lines: Sequence[str], load: "OtherLoad | None") -> None:
    """Writes a results file, its provenance header first (the command as this process
    was started, commit, date, CPU and the ``load`` other work put on the machine during
    the run, started with the measurements; None where the run's work happens outside
    this process tree, and ``lines`` then start with ``LOAD_NOT_MEASURED``), then
    ``lines``; prints the file and where it went."""
    from tfhybrid.testing import provenance   # after sys.path holds this checkout
    text = "\n".join(provenance.header(sys.argv, load=load) + list(lines)) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(text + f"\n(written to {path})", flush=True)


def provenance_record(load: "OtherLoad | None") -> dict[str, str]:
    """The provenance header as a mapping (``{"command": ..., "commit": ..., ...}``), for
    results that are not text: JSON files carry it as their ``"provenance"`` field and
    PNG plots as text chunks (``save_figure``)."""
    from tfhybrid.testing import provenance
    lines = provenance.header(sys.argv, load=load) if load else (
        provenance.header(sys.argv) + [LOAD_NOT_MEASURED])
    return dict(line[2:].split(": ", 1) for line in lines)


def write_json(path: str, payload: dict[str, Any], load: "OtherLoad | None") -> None:
    """Writes ``payload`` as JSON with its ``"provenance"`` (``provenance_record``) first;
    ``load`` as for ``write_text``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        # numpy scalars as plain numbers
        json.dump({"provenance": provenance_record(load), **payload}, f, indent=1,
                  default=lambda value: value.item() if hasattr(value, "item") else float(value))


def save_figure(figure, path: str, load: "OtherLoad | None") -> None:
    """Saves a matplotlib figure as PNG with the provenance record in its text chunks."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110, metadata={
        key.capitalize(): value for key, value in provenance_record(load).items()})
