"""Build tfhybrid's custom-op library: ``python -m tfhybrid.custom_ops.build [--force]``.

Compiles every ``cc/**/*.cc`` into ``tfhybrid/custom_ops/_tfhybrid_ops.tf<X.Y>.so`` (one
library per TensorFlow minor version, whose C++ ABI it is built against, so venvs of
two TF versions can share a checkout) with g++ and TensorFlow's own compile/link flags. The build is skipped when the library is newer
than all sources (``*.cc``, ``*.h``) and this script and was built for the same target
CPU (see below), unless ``--force``.

The default build is portable: baseline x86-64-v2 code (no -march off x86-64), with the
hot loops also compiled for AVX2 and AVX-512 and chosen at run time
(``cc/kernels/isa_kernels.h``; ``TFHYBRID_KERNEL_ISA`` caps the level). One build, e.g.
a venv on a shared file system, then runs on every node of a cluster with mixed CPU
generations instead of dying with SIGILL on the older ones.

Environment: ``CXX`` (compiler, default g++), ``TFHYBRID_CXXFLAGS`` (extra flags),
``TFHYBRID_MARCH_NATIVE=1`` (opt-in: all code for this machine's CPU, ``-march=native``;
the library may then crash with SIGILL on another CPU). ``TFHYBRID_NO_MARCH_NATIVE=1``,
the opt-out from when -march=native was the default, is still accepted and means the
default build.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tensorflow as tf

from tfhybrid.custom_ops import library_name

HERE = Path(__file__).resolve().parent
CC_DIR = HERE / "cc"
LIB_NAME = library_name(tf.__version__)
LIB_PATH = HERE / LIB_NAME

# The flags BUILD (Bazel) uses too, defined once in flags.bzl
def _bzl_constants(path: Path) -> dict:
    tree = ast.parse(path.read_text(), str(path))
    return {target.id: ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) for target in node.targets
            if isinstance(target, ast.Name)}


_SHARED = _bzl_constants(HERE / "flags.bzl")
PORTABLE_MARCH_X86_64 = _SHARED["PORTABLE_MARCH_X86_64"]
NATIVE_MARCH = "native"
COMMON_FLAGS = _SHARED["OPT_COPTS"] + ["-fPIC", "-shared"] + _SHARED["KERNEL_COPTS"]

_TRUE = ("1", "true", "yes")
_FALSE = ("", "0", "false", "no")


def sources() -> list[Path]:
    return sorted(p for p in CC_DIR.rglob("*.cc"))


def _inputs() -> list[Path]:
    return sources() + sorted(CC_DIR.rglob("*.h")) + [Path(__file__).resolve()]


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "")
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected one of {', '.join(_TRUE + _FALSE[1:])} "
                     "or unset")


def march_native_requested() -> bool:
    """True if the environment opts in to a -march=native build."""
    native = _env_flag("TFHYBRID_MARCH_NATIVE")
    if native and _env_flag("TFHYBRID_NO_MARCH_NATIVE"):
        raise ValueError("TFHYBRID_MARCH_NATIVE=1 and TFHYBRID_NO_MARCH_NATIVE=1 contradict "
                         "each other; unset one (the portable build is the default)")
    return native


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"C++ compiler {cxx!r} not found (install g++ or set CXX)")
    return cxx


def target_march(cxx: str, native: bool) -> str | None:
    """The -march value of a build (None: no -march, the compiler's default target)."""
    if native:
        return NATIVE_MARCH
    machine = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True).stdout
    if machine.startswith(("x86_64-", "amd64-")):
        return PORTABLE_MARCH_X86_64
    return None


def _target_flags(cxx: str, native: bool) -> list[str]:
    """-march (if any) followed by TFHYBRID_CXXFLAGS, in command-line order."""
    march = target_march(cxx, native)
    return ([f"-march={march}"] if march else []) + shlex.split(
        os.environ.get("TFHYBRID_CXXFLAGS", ""))


def _effective_march(flags) -> str | None:
    """The -march that wins in a sequence of flags (the last one), or None."""
    marches = [f.split("=", 1)[1] for f in flags if f.startswith("-march=")]
    return marches[-1] if marches else None


def library_march(lib: Path) -> str | None:
    """The -march a library was compiled with, from the switches GCC recorded in it
    (-frecord-gcc-switches; -march=native appears expanded, e.g. znver3). None if it
    has none (built off x86-64, or by another build system)."""
    return _effective_march(m.decode() for m in re.findall(rb"-march=[\w.-]+",
                                                             Path(lib).read_bytes()))


def _expected_march(cxx: str, native: bool) -> str | None:
    """What library_march() of a fresh build would report."""
    march = _effective_march(_target_flags(cxx, native))
    if march == NATIVE_MARCH:  # GCC records the CPU name -march=native stands for
        out = subprocess.run([cxx, "-march=native", "-Q", "--help=target"],
                             capture_output=True, text=True).stdout
        found = re.search(r"^\s*-march=\s*(\S+)\s*$", out, re.M)
        march = found.group(1) if found else None
    return march


def build_command(output: Path, native: bool | None = None) -> list[str]:
    """The compiler command line; native=None reads TFHYBRID_MARCH_NATIVE."""
    if native is None:
        native = march_native_requested()
    cxx = _compiler()
    cmd = [cxx] + COMMON_FLAGS + [f"-I{CC_DIR / 'kernels'}"]
    cmd += tf.sysconfig.get_compile_flags()
    cmd += _target_flags(cxx, native)
    cmd += [str(s) for s in sources()]
    cmd += ["-o", str(output)]
    cmd += tf.sysconfig.get_link_flags()
    return cmd


def is_up_to_date(lib: Path = LIB_PATH, native: bool | None = None) -> bool:
    """The library exists, is newer than every input and was built for the target CPU
    a build would use now (portable, or -march=native: switching rebuilds)."""
    lib = Path(lib)
    if not lib.exists():
        return False
    lib_mtime = lib.stat().st_mtime
    if not all(p.stat().st_mtime <= lib_mtime for p in _inputs()):
        return False
    if native is None:
        native = march_native_requested()
    return library_march(lib) == _expected_march(_compiler(), native)


def build(force: bool = False, verbose: bool = True, output: Path = LIB_PATH,
          native: bool | None = None) -> Path:
    """Builds the library at `output` if needed; returns its path. native=None reads
    TFHYBRID_MARCH_NATIVE. Raises RuntimeError on failure."""
    output = Path(output)
    srcs = sources()
    if not srcs:
        raise RuntimeError(f"no C++ sources under {CC_DIR}")
    if not force and is_up_to_date(output, native):
        if verbose:
            print(f"tfhybrid custom ops: {output} is up to date (use --force to rebuild)")
        return output
    # Compile to a temporary file in the same directory, then rename atomically so a
    # concurrently importing process never sees a half-written library.
    fd, tmp = tempfile.mkstemp(prefix=".tmp_tfhybrid_ops_", suffix=".so", dir=output.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        cmd = build_command(tmp_path, native)
        if verbose:
            print("tfhybrid custom ops: building", output, flush=True)
            print(" ".join(shlex.quote(c) for c in cmd), flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"compiling the tfhybrid custom ops failed (exit {proc.returncode}):\n{proc.stdout}")
        if verbose and proc.stdout.strip():
            print(proc.stdout, flush=True)
        os.chmod(tmp_path, 0o755)
        os.replace(tmp_path, output)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()
    if verbose:
        print(f"tfhybrid custom ops: built {output}")
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--quiet", action="store_true", help="print only errors")
    parser.add_argument("--output", type=Path, default=LIB_PATH,
                        help=f"where to write the library (default {LIB_PATH})")
    parser.add_argument("--march-native", action="store_true",
                        help="build for this machine's CPU (like TFHYBRID_MARCH_NATIVE=1)")
    args = parser.parse_args(argv)
    try:
        build(force=args.force, verbose=not args.quiet, output=args.output,
              native=True if args.march_native else None)
    except Exception as e:  # noqa: BLE001 - report any failure with a clear message
        print(f"ERROR: tfhybrid custom-op build failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
