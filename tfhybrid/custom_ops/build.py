"""Build tfhybrid's custom-op library: ``python -m tfhybrid.custom_ops.build [--force]``.

Compiles every ``cc/**/*.cc`` into ``tfhybrid/custom_ops/_tfhybrid_ops.so`` with g++ and
TensorFlow's own compile/link flags. The build is skipped when the library is newer
than all sources (``*.cc``, ``*.h``) and this script, unless ``--force``.
Environment: ``CXX`` (compiler, default g++), ``TFHYBRID_CXXFLAGS`` (extra flags),
``TFHYBRID_NO_MARCH_NATIVE=1`` (portable build without -march=native).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CC_DIR = HERE / "cc"
LIB_NAME = "_tfhybrid_ops.so"
LIB_PATH = HERE / LIB_NAME


def sources() -> list[Path]:
    return sorted(p for p in CC_DIR.rglob("*.cc"))


def _inputs() -> list[Path]:
    return sources() + sorted(CC_DIR.rglob("*.h")) + [Path(__file__).resolve()]


def is_up_to_date(lib: Path = LIB_PATH) -> bool:
    if not lib.exists():
        return False
    lib_mtime = lib.stat().st_mtime
    return all(p.stat().st_mtime <= lib_mtime for p in _inputs())


def build_command(output: Path) -> list[str]:
    import tensorflow as tf  # deferred: only the build needs TF's flags

    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"C++ compiler {cxx!r} not found (install g++ or set CXX)")
    cmd = [cxx, "-std=c++17", "-O3", "-DNDEBUG", "-fPIC", "-shared", "-Wall", "-Wno-sign-compare",
           "-Wno-unused-function", "-fvisibility-inlines-hidden"]
    if os.environ.get("TFHYBRID_NO_MARCH_NATIVE", "") not in ("1", "true"):
        cmd.append("-march=native")
    cmd += [f"-I{CC_DIR / 'kernels'}"]
    cmd += tf.sysconfig.get_compile_flags()
    cmd += shlex.split(os.environ.get("TFHYBRID_CXXFLAGS", ""))
    cmd += [str(s) for s in sources()]
    cmd += ["-o", str(output)]
    cmd += tf.sysconfig.get_link_flags()
    return cmd


def build(force: bool = False, verbose: bool = True) -> Path:
    """Builds the library if needed; returns its path. Raises RuntimeError on failure."""
    srcs = sources()
    if not srcs:
        raise RuntimeError(f"no C++ sources under {CC_DIR}")
    if not force and is_up_to_date():
        if verbose:
            print(f"tfhybrid custom ops: {LIB_PATH} is up to date (use --force to rebuild)")
        return LIB_PATH
    # Compile to a temporary file in the same directory, then rename atomically so a
    # concurrently importing process never sees a half-written library.
    fd, tmp = tempfile.mkstemp(prefix=".tmp_tfhybrid_ops_", suffix=".so", dir=HERE)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        cmd = build_command(tmp_path)
        if verbose:
            print("tfhybrid custom ops: building", LIB_PATH, flush=True)
            print(" ".join(shlex.quote(c) for c in cmd), flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"compiling the tfhybrid custom ops failed (exit {proc.returncode}):\n{proc.stdout}")
        if verbose and proc.stdout.strip():
            print(proc.stdout, flush=True)
        os.chmod(tmp_path, 0o755)
        os.replace(tmp_path, LIB_PATH)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()
    if verbose:
        print(f"tfhybrid custom ops: built {LIB_PATH}")
    return LIB_PATH


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--quiet", action="store_true", help="print only errors")
    args = parser.parse_args(argv)
    try:
        build(force=args.force, verbose=not args.quiet)
    except Exception as e:  # noqa: BLE001 - report any failure with a clear message
        print(f"ERROR: tfhybrid custom-op build failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
