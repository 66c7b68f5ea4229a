"""The op library's compiler flags, defined once: BUILD loads this file and
tfhybrid/custom_ops/build.py reads it (plain assignments of literals only, so Python's
ast reads it too)."""

# Every build: -ffp-contract=off keeps FMA contraction out of every dispatch level (and of
# -march=native builds), so all of them give bitwise-identical results
# (cc/kernels/isa_kernels.h); -frecord-gcc-switches records the flags in the library,
# which build.py's is_up_to_date() reads to notice a library built for another target CPU.
KERNEL_COPTS = [
    "-Wall",
    "-Wno-sign-compare",
    "-Wno-unused-function",
    "-fvisibility-inlines-hidden",
    "-ffp-contract=off",
    "-frecord-gcc-switches",
]

# Optimisation and language level (Bazel: -c opt, --copt=-O3, --cxxopt=-std=c++17 in
# .bazelrc; build.py passes them itself).
OPT_COPTS = ["-std=c++17", "-O3", "-DNDEBUG"]

# Baseline of the portable build on x86-64 (SSSE3, SSE4.2, POPCNT): every CPU with AVX
# has it, and TensorFlow's own wheels need AVX, so it excludes no CPU TF runs on. The hot
# loops are also compiled for AVX2 / AVX-512 and chosen at run time.
PORTABLE_MARCH_X86_64 = "x86-64-v2"
