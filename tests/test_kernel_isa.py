"""Tests of the portable op library: runtime dispatch of the kernels' hot loops
(cc/kernels/isa_kernels.h) and the baseline code around them.

- Every dispatch level this CPU supports passes the op tests of tests/test_custom_ops.py
  (lookup + combine forward and backward, row-wise AdaGrad; against numpy and the
  pure-TF path; duplicates, weight decay, float16 / bfloat16, odd row widths). The
  level is fixed per process, so each level runs them in its own process with
  TFHYBRID_KERNEL_ISA set. (That all levels give the same bits is
  test_custom_ops.DeterminismTest.test_bitwise_identical_across_kernel_isas.)
- The best level found matches the CPU's flags; a bad TFHYBRID_KERNEL_ISA is an error
  naming it.
- The library's baseline code has no AVX instruction: only the dispatched AVX2 / AVX-512
  variants do, and the AVX2 variant has no AVX-512 instruction, so the library cannot
  die with SIGILL on an older x86-64 CPU.
- build.py builds the portable library by default (-march=native is opt-in), and
  Bazel's BUILD takes its flags from the same file (flags.bzl).

Run: OMP_NUM_THREADS=1 python -m tests.test_kernel_isa
"""

import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import unittest
from pathlib import Path
from unittest import mock

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import tensorflow as tf  # noqa: E402

from tfhybrid import custom_ops as co  # noqa: E402
from tfhybrid.custom_ops import build  # noqa: E402
from tests import test_custom_ops as ops_test  # noqa: E402

# The op tests each level runs: the kernels' checks against numpy and the pure-TF path.
# (DeterminismTest's subprocesses run at the default level, and its cross-level digest
# covers the fused, table-batched and column-window routes at every level; the chunked
# tables' kernels have no dispatched loops.)
_OP_TEST_CLASSES = ("LibraryTest", "EmbeddingLookupCombineTest",
                    "EmbeddingLookupCombineOddWidthTest", "EmbeddingLookupCombineWideTest",
                    "RowwiseAdagradTest", "RowwiseAdagradOddWidthTest",
                    "RowwiseAdagradWideTest", "FusedBackwardAdagradTest",
                    "LookupCombineConcatTest", "DynamicTableKernelsTest",
                    "WeightedLookupTest")

# What each level needs, as /proc/cpuinfo names it (the test's own statement of the
# levels; isa_kernels.cc has the library's).
_LEVEL_CPU_FLAGS = {"avx2": {"avx2", "fma", "f16c"},
                    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                               "avx512dq", "avx512cd"}}

_IS_X86_64 = platform.machine() in ("x86_64", "AMD64")


def _env(**overrides):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=str(_REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(overrides)
    return env


class DispatchLevelTest(tf.test.TestCase):

    def test_each_level_passes_the_op_tests(self):
        ops_test.require_op(self)  # pylint: disable=protected-access
        want_count = sum(unittest.defaultTestLoader.loadTestsFromTestCase(
            getattr(ops_test, name)).countTestCases() for name in _OP_TEST_CLASSES)
        for isa in co.supported_kernel_isas():
            with self.subTest(isa=isa):
                proc = subprocess.run(
                    [sys.executable, str(Path(ops_test.__file__).resolve()), *_OP_TEST_CLASSES],
                    env=_env(TFHYBRID_KERNEL_ISA=isa), cwd=str(_REPO), capture_output=True,
                    text=True, timeout=900)
                out = proc.stdout + proc.stderr
                self.assertEqual(proc.returncode, 0, f"op tests at level {isa}:\n{out[-6000:]}")
                ran = re.search(r"^Ran (\d+) tests?", out, re.M)
                self.assertIsNotNone(ran, out[-3000:])
                self.assertEqual(int(ran.group(1)), want_count, out[-3000:])

    def test_best_level_matches_cpu_flags(self):
        ops_test.require_op(self)  # pylint: disable=protected-access
        flags = set()
        if _IS_X86_64 and os.path.exists("/proc/cpuinfo"):
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("flags"):
                        flags = set(line.split(":", 1)[1].split())
                        break
        want = ["generic"] + [isa for isa in ("avx2", "avx512")
                              if _LEVEL_CPU_FLAGS[isa] <= flags]
        self.assertEqual(co.supported_kernel_isas(), want)

    def test_bad_level_is_an_error_naming_it(self):
        ops_test.require_op(self)  # pylint: disable=protected-access
        script = textwrap.dedent("""
            import tensorflow as tf
            from tfhybrid import custom_ops as co
            try:
                co.embedding_lookup_combine(tf.ones([4, 2]), [[0, 1]])
            except ValueError as e:
                print("LOADER", e)
            lib = tf.load_op_library(co.library_path)  # direct use: the kernel says it
            try:
                lib.embedding_lookup_combine(tf.ones([4, 2]), [0, 1], [0, 2], tf.zeros([0]))
            except tf.errors.InvalidArgumentError as e:
                print("KERNEL", e.message)
        """)
        proc = subprocess.run([sys.executable, "-c", script], env=_env(TFHYBRID_KERNEL_ISA="sse9"),
                              cwd=str(_REPO), capture_output=True, text=True, timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        lines = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines()
                     if ln.startswith(("LOADER ", "KERNEL ")))
        for where in ("LOADER", "KERNEL"):
            self.assertIn(where, lines, proc.stdout)
            self.assertIn("TFHYBRID_KERNEL_ISA='sse9' is not one of auto, generic, avx2, avx512",
                          lines[where])


# objdump (AT&T syntax) evidence of an instruction beyond x86-64-v2: an AVX register,
# a VEX/EVEX mnemonic (AVX's all start with "v"), or BMI1/BMI2 (VEX-encoded, x86-64-v3).
_AVX_REGISTER = re.compile(r"%(?:[yz]mm\d+|xmm(?:1[6-9]|2\d|3[01])|k[0-7])\b")
_BMI = {"andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "mulx", "pdep", "pext", "rorx",
        "sarx", "shlx", "shrx"}
# AVX-512 only: its registers, its operand syntax ({%k1}, {z}, {1to16}) and mnemonics
# that have no VEX form.
_AVX512_REGISTER = re.compile(r"%(?:zmm\d+|[xy]mm(?:1[6-9]|2\d|3[01])|k[0-7])\b|\{")
_AVX512_MNEMONIC = re.compile(r"^(?:k[a-z]+|vpternlog|vmovdq[au](?:8|16|32|64)|vpermt2|"
                              r"vpermi2|valign|vrndscale|vscalef|vp?compress|vp?expand|"
                              r"vpconflict|vplzcnt|vpbroadcastm)")
_PREFIXES = {"rep", "repz", "repnz", "repe", "repne", "lock", "notrack", "bnd", "data16",
             "cs", "ds", "addr32"}


def _disassemble(lib: Path) -> dict:
    """{function name: [(mnemonic, operands)]} of a library, demangled."""
    objdump = shutil.which("objdump")
    if objdump is None:
        raise RuntimeError("objdump not found: install binutils (g++ needs it anyway)")
    proc = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(lib)],
                          capture_output=True, text=True, check=True)
    functions, current = {}, None
    for line in proc.stdout.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            current = functions.setdefault(header.group(1), [])
            continue
        parts = line.split("\t")
        if current is None or len(parts) < 2 or not parts[0].strip().endswith(":"):
            continue
        tokens = parts[-1].split(None, 1)
        while len(tokens) > 1 and tokens[0] in _PREFIXES:
            tokens = tokens[1].split(None, 1)
        if tokens:
            # Operands without objdump's "<symbol>" / "# address <symbol>" annotations
            # (demangled names contain braces, e.g. {lambda(long, long)#1}).
            operands = re.sub(r"\s*(?:#.*|<.*>)$", "", tokens[1]) if len(tokens) > 1 else ""
            current.append((tokens[0], operands))
    return functions


def _level_of(function: str) -> str:
    """The dispatch level a function belongs to (isa_kernels.cc's namespaces), from its
    demangled name or, where objdump leaves a long one mangled, the mangled form."""
    for isa in ("avx512", "avx2"):
        namespace = f"isa_{isa}"
        if (f"tfhybrid::{namespace}::" in function
                or f"8tfhybrid{len(namespace)}{namespace}" in function):
            return isa
    return "baseline"


def _needs_more_than_x86_64_v2(mnemonic, operands) -> bool:
    return (mnemonic.startswith("v") or mnemonic in _BMI
            or _AVX_REGISTER.search(operands) is not None)


def _needs_avx512(mnemonic, operands) -> bool:
    return (_AVX512_REGISTER.search(operands) is not None
            or _AVX512_MNEMONIC.match(mnemonic) is not None)


class PortableBaselineTest(tf.test.TestCase):

    def test_baseline_code_has_no_avx_instructions(self):
        ops_test.require_op(self)  # pylint: disable=protected-access
        if not _IS_X86_64:
            self.skipTest(f"AVX dispatch exists on x86-64 only, this is {platform.machine()}")
        if build.march_native_requested():
            self.skipTest("TFHYBRID_MARCH_NATIVE=1: the library is built for this CPU on "
                          "request, not portable")
        lib = Path(co.library_path)
        self.assertEqual(build.library_march(lib), build.PORTABLE_MARCH_X86_64,
                         f"{lib} is not the portable build; rebuild it with `python -m "
                         "tfhybrid.custom_ops.build --force`")
        functions = _disassemble(lib)
        offenders, avx512_in_avx2, registers = [], [], {"avx2": set(), "avx512": set()}
        for name, instructions in functions.items():
            level = _level_of(name)
            for mnemonic, operands in instructions:
                if level == "baseline" and _needs_more_than_x86_64_v2(mnemonic, operands):
                    offenders.append(f"{name}: {mnemonic} {operands}")
                if level == "avx2" and _needs_avx512(mnemonic, operands):
                    avx512_in_avx2.append(f"{name}: {mnemonic} {operands}")
                if level != "baseline":
                    registers[level].update(re.findall(r"%([yz]mm)\d+", operands))
        self.assertEmpty(offenders, "AVX/BMI instructions outside the dispatched variants "
                                    "(would SIGILL on an older CPU):\n"
                         + "\n".join(offenders[:20]))
        self.assertEmpty(avx512_in_avx2, "AVX-512 instructions in the AVX2 variant:\n"
                         + "\n".join(avx512_in_avx2[:20]))
        # The dispatched variants exist and really use their vector registers (the
        # streaming stores alone use one full register of each width).
        self.assertIn("ymm", registers["avx2"])
        self.assertIn("zmm", registers["avx512"])
        self.assertGreater(sum(_level_of(n) == "baseline" for n in functions), 100)


class BuildFlagsTest(tf.test.TestCase):

    def _command(self, **env):
        clean = {k: v for k, v in os.environ.items()
                 if k not in ("TFHYBRID_MARCH_NATIVE", "TFHYBRID_NO_MARCH_NATIVE",
                              "TFHYBRID_CXXFLAGS")}
        with mock.patch.dict(os.environ, dict(clean, **env), clear=True):
            return build.build_command(Path("out.so"))

    def test_portable_by_default_native_on_request(self):
        portable = [f"-march={build.PORTABLE_MARCH_X86_64}"] if _IS_X86_64 else []
        for env, want in (({}, portable),
                          ({"TFHYBRID_NO_MARCH_NATIVE": "1"}, portable),  # the old opt-out
                          ({"TFHYBRID_MARCH_NATIVE": "0"}, portable),
                          ({"TFHYBRID_MARCH_NATIVE": "1"}, ["-march=native"])):
            cmd = self._command(**env)
            self.assertEqual([f for f in cmd if f.startswith("-march=")], want, env)
            self.assertIn("-ffp-contract=off", cmd)

    def test_bad_or_contradicting_settings_raise(self):
        with self.assertRaisesRegex(ValueError, "TFHYBRID_MARCH_NATIVE='maybe'"):
            self._command(TFHYBRID_MARCH_NATIVE="maybe")
        with self.assertRaisesRegex(ValueError, "TFHYBRID_MARCH_NATIVE=1 and "
                                                "TFHYBRID_NO_MARCH_NATIVE=1 contradict"):
            self._command(TFHYBRID_MARCH_NATIVE="1", TFHYBRID_NO_MARCH_NATIVE="1")

    def test_bazel_and_build_py_share_one_set_of_flags(self):
        rule = (_REPO / "BUILD").read_text()
        bazelrc = (_REPO / ".bazelrc").read_text()
        # BUILD takes the flags from flags.bzl, which build.py reads too
        self.assertIn('load("//:tfhybrid/custom_ops/flags.bzl", "KERNEL_COPTS", '
                      '"PORTABLE_MARCH_X86_64")', rule)
        self.assertIn('copts = KERNEL_COPTS + select(', rule)
        self.assertIn('"-march=" + PORTABLE_MARCH_X86_64', rule)
        self.assertNotIn('"-ffp-contract=off"', rule)   # no copy of a shared flag
        self.assertIn('"-march=native"', rule)
        self.assertIn("build:native --define=tfhybrid_march=native", bazelrc)
        for flag in ("-ffp-contract=off", "-Wno-sign-compare", "-fvisibility-inlines-hidden",
                     "-frecord-gcc-switches"):
            self.assertIn(flag, build.COMMON_FLAGS)
        self.assertEqual(build.PORTABLE_MARCH_X86_64, "x86-64-v2")


if __name__ == "__main__":
    tf.test.main()
