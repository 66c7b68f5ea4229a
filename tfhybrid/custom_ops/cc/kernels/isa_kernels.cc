// Runtime dispatch of the embedding kernels' hot loops (see isa_kernels.h).
//
// isa_kernels_impl.h is compiled here three times: as baseline code (namespace
// isa_generic) and, on x86-64 with GCC, inside `#pragma GCC target` regions for AVX2
// (isa_avx2) and AVX-512 (isa_avx512). The rest of the library is
// built for the baseline CPU and reaches the AVX variants only through the function
// pointers returned below, after ActiveKernelIsa() has checked the CPU: a node without
// AVX2 never executes an AVX2 instruction.

#include "isa_kernels.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

// The AVX levels need GCC's `#pragma GCC target` (clang builds get the generic level).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TFHYBRID_X86 1
#include <immintrin.h>
#endif

// Target features of each AVX level on top of the level below. The level's code region
// (`#pragma GCC target`) and the CPU check in BestSupportedKernelIsa() both read these.
#define TFHYBRID_AVX2_FEATURES "avx2,fma,f16c"
#define TFHYBRID_AVX512_FEATURES "avx512f,avx512bw,avx512vl,avx512dq,avx512cd"

#define TFHYBRID_PRAGMA(x) _Pragma(#x)
#define TFHYBRID_TARGET(features) TFHYBRID_PRAGMA(GCC target(features))

namespace tensorflow {
namespace tfhybrid {

namespace isa_generic {
#define TFHYBRID_ISA_LEVEL 0
#include "isa_kernels_impl.h"
#undef TFHYBRID_ISA_LEVEL
}  // namespace isa_generic

#if defined(TFHYBRID_X86)
#pragma GCC push_options
TFHYBRID_TARGET(TFHYBRID_AVX2_FEATURES)
namespace isa_avx2 {
#define TFHYBRID_ISA_LEVEL 1
#include "isa_kernels_impl.h"
#undef TFHYBRID_ISA_LEVEL
}  // namespace isa_avx2
// Successive target pragmas accumulate: this region has the AVX2 features too.
TFHYBRID_TARGET(TFHYBRID_AVX512_FEATURES)
namespace isa_avx512 {
#define TFHYBRID_ISA_LEVEL 2
#include "isa_kernels_impl.h"
#undef TFHYBRID_ISA_LEVEL
}  // namespace isa_avx512
#pragma GCC pop_options
#endif  // TFHYBRID_X86

namespace {

constexpr const char* kIsaNames[kNumKernelIsas] = {"generic", "avx2", "avx512"};
constexpr const char* kIsaEnv = "TFHYBRID_KERNEL_ISA";

#if defined(TFHYBRID_X86)
// 1 if the CPU (and the OS, for AVX state) has `feature`, 0 if not, -1 for a name this
// table does not know. __builtin_cpu_supports only takes string literals.
int CpuHasFeature(const std::string& feature) {
#define TFHYBRID_CPU_FEATURE(name) \
  if (feature == name) return __builtin_cpu_supports(name) ? 1 : 0;
  TFHYBRID_CPU_FEATURE("avx2")
  TFHYBRID_CPU_FEATURE("fma")
  TFHYBRID_CPU_FEATURE("f16c")
  TFHYBRID_CPU_FEATURE("avx512f")
  TFHYBRID_CPU_FEATURE("avx512bw")
  TFHYBRID_CPU_FEATURE("avx512vl")
  TFHYBRID_CPU_FEATURE("avx512dq")
  TFHYBRID_CPU_FEATURE("avx512cd")
#undef TFHYBRID_CPU_FEATURE
  return -1;
}

// Whether the CPU has every feature of a comma-separated list. An unknown name aborts:
// it is a bug in the lists above, and silently losing a level would hide it.
bool CpuHasAll(const char* features) {
  std::string list(features);
  size_t start = 0;
  bool all = true;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    const std::string name = list.substr(start, comma - start);
    const int has = CpuHasFeature(name);
    if (has < 0) {
      std::fprintf(stderr, "tfhybrid isa_kernels.cc: no CPU check for target feature '%s'\n",
                   name.c_str());
      std::abort();
    }
    all = all && has == 1;
    start = comma + 1;
  }
  return all;
}
#endif  // TFHYBRID_X86

struct IsaChoice {
  KernelIsa isa = KernelIsa::kGeneric;
  std::string error;
};

IsaChoice ChooseIsa() {
  IsaChoice choice;
  const KernelIsa best = BestSupportedKernelIsa();
  choice.isa = best;
  const char* env = std::getenv(kIsaEnv);
  std::string want = env == nullptr ? "" : env;
  std::transform(want.begin(), want.end(), want.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (want.empty() || want == "auto") return choice;
  for (int i = 0; i < kNumKernelIsas; ++i) {
    if (want != kIsaNames[i]) continue;
    if (i > static_cast<int>(best)) {
      choice.error = std::string(kIsaEnv) + "='" + env + "' asks for " + kIsaNames[i] +
                     " kernels, but this CPU (or this build) supports at most '" +
                     KernelIsaName(best) + "'";
    } else {
      choice.isa = static_cast<KernelIsa>(i);
    }
    return choice;
  }
  choice.error = std::string(kIsaEnv) + "='" + env + "' is not one of auto, ";
  for (int i = 0; i < kNumKernelIsas; ++i) {
    choice.error += kIsaNames[i];
    if (i + 1 < kNumKernelIsas) choice.error += ", ";
  }
  return choice;
}

}  // namespace

const char* KernelIsaName(KernelIsa isa) { return kIsaNames[static_cast<int>(isa)]; }

KernelIsa BestSupportedKernelIsa() {
#if defined(TFHYBRID_X86)
  __builtin_cpu_init();
  if (CpuHasAll(TFHYBRID_AVX2_FEATURES)) {
    return CpuHasAll(TFHYBRID_AVX512_FEATURES) ? KernelIsa::kAvx512 : KernelIsa::kAvx2;
  }
#endif
  return KernelIsa::kGeneric;
}

bool ActiveKernelIsa(KernelIsa* isa, std::string* error) {
  static const IsaChoice choice = ChooseIsa();  // once per process (thread-safe)
  *isa = choice.isa;
  if (!choice.error.empty()) {
    *error = choice.error;
    return false;
  }
  return true;
}

// ---------------------------------------------------------------- kernel getters

// TFHYBRID_PICK(isa, function template-id): that function of the level's namespace.
#if defined(TFHYBRID_X86)
#define TFHYBRID_PICK(isa, ...)         \
  switch (isa) {                        \
    case KernelIsa::kAvx512:            \
      return &isa_avx512::__VA_ARGS__;  \
    case KernelIsa::kAvx2:              \
      return &isa_avx2::__VA_ARGS__;    \
    case KernelIsa::kGeneric:           \
      break;                            \
  }                                     \
  return &isa_generic::__VA_ARGS__
#else
#define TFHYBRID_PICK(isa, ...) return &isa_generic::__VA_ARGS__
#endif

template <typename T, typename Tidx, typename Tsplits>
LookupCombineFn<T, Tidx, Tsplits> LookupCombineKernel(KernelIsa isa) {
  TFHYBRID_PICK(isa, LookupCombineRange<T, Tidx, Tsplits>);
}

template <typename T>
GradSegmentsFn<T> GradSegmentsKernel(KernelIsa isa) {
  TFHYBRID_PICK(isa, GradSegmentsRange<T>);
}

template <typename Tgrad>
RowwiseAdagradFn<Tgrad> RowwiseAdagradKernel(KernelIsa isa) {
  TFHYBRID_PICK(isa, RowwiseAdagradRange<Tgrad>);
}

KeyedUniformFn KeyedUniformKernel(KernelIsa isa) { TFHYBRID_PICK(isa, KeyedUniformRange); }

#undef TFHYBRID_PICK

// Every type combination the kernels register (see the REGISTER_KERNEL_BUILDER lists).
#define TFHYBRID_INSTANTIATE_LOOKUP(T, Tidx, Tsplits) \
  template LookupCombineFn<T, Tidx, Tsplits> LookupCombineKernel<T, Tidx, Tsplits>(KernelIsa);
#define TFHYBRID_INSTANTIATE_T(T)                        \
  TFHYBRID_INSTANTIATE_LOOKUP(T, int32_t, int32_t)       \
  TFHYBRID_INSTANTIATE_LOOKUP(T, int32_t, int64_t)       \
  TFHYBRID_INSTANTIATE_LOOKUP(T, int64_t, int32_t)       \
  TFHYBRID_INSTANTIATE_LOOKUP(T, int64_t, int64_t)       \
  template GradSegmentsFn<T> GradSegmentsKernel<T>(KernelIsa); \
  template RowwiseAdagradFn<T> RowwiseAdagradKernel<T>(KernelIsa);

TFHYBRID_INSTANTIATE_T(float)
TFHYBRID_INSTANTIATE_T(Eigen::half)
TFHYBRID_INSTANTIATE_T(Eigen::bfloat16)

#undef TFHYBRID_INSTANTIATE_T
#undef TFHYBRID_INSTANTIATE_LOOKUP

}  // namespace tfhybrid
}  // namespace tensorflow
