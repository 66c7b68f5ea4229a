// The hot loops of tfhybrid's embedding kernels, compiled once per instruction-set level
// (isa_kernels.cc) and chosen at run time.
//
// The library itself is built for a baseline CPU (x86-64-v2, or no -march off x86) so
// that one build, e.g. a venv on a shared file system, runs on every node of a cluster
// with mixed CPU generations. Only the loops below carry AVX2 / AVX-512 code; the
// kernels (TF plumbing, validation, sorting) call them through the function pointers
// returned by the *Kernel(isa) getters, with isa = ActiveKernelIsa().
//
// Every level computes bitwise-identical results: each output element is accumulated
// in the same order at any vector width, and the library is compiled with
// -ffp-contract=off (no FMA contraction on the levels that have FMA). This matters for
// hybrid parallelism: the D data-parallel copies of a shard apply the same update on
// different nodes and must stay equal even when the nodes pick different levels.
//
// This header is TensorFlow-free apart from Eigen's half / bfloat16 types.
#ifndef TFHYBRID_CUSTOM_OPS_CC_KERNELS_ISA_KERNELS_H_
#define TFHYBRID_CUSTOM_OPS_CC_KERNELS_ISA_KERNELS_H_

#include <cstdint>
#include <string>

#include "Eigen/Core"

namespace tensorflow {
namespace tfhybrid {

// Dispatch levels, lowest first. kGeneric is the library's baseline code.
enum class KernelIsa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr int kNumKernelIsas = 3;

// "generic", "avx2", "avx512": the values of TFHYBRID_KERNEL_ISA.
const char* KernelIsaName(KernelIsa isa);

// The highest level this CPU (and OS: AVX state enabled by XCR0) supports; kGeneric
// off x86 and when the library was built without the AVX variants.
KernelIsa BestSupportedKernelIsa();

// The level the kernels of this process use: BestSupportedKernelIsa(), or the lower
// level named by TFHYBRID_KERNEL_ISA (read once per process). Returns false and sets
// *error (naming the bad value) when the variable is not a level name ("" and "auto"
// mean the best) or names a level this CPU does not support.
bool ActiveKernelIsa(KernelIsa* isa, std::string* error);

// kWeighted: 'sum' with per-id weights (position p's row times weights[p]); the caller
// divides a weighted mean or sqrtn by its bags' weights (tfhybrid/combiners.py).
enum class Combiner { kNone, kSum, kMean, kWeighted };

// How far ahead (in ids) the forward prefetches table rows. Measured on the 8 x 1M x 64,
// Zipf(1.05) forward (2-core EPYC, interleaved in one process): 48 ran 5-10% faster
// than 16, and 64-128 no faster than 48.
constexpr int64_t kPrefetchDistance = 48;

inline void PrefetchRow(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

inline void PrefetchRowForWrite(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 1, 3);
}

// ---------------------------------------------------------------- forward (sum / mean)

// out[b] = sum (mean: / bag size; an empty bag gives zeros) over p in
// [splits[b], splits[b + 1]) of table[ids[p]] (times weights[p] when given), accumulated
// in float32 in id order.
// Ids must be in range; splits must be valid (the kernel checks both first).
template <typename T, typename Tidx, typename Tsplits>
struct LookupCombineArgs {
  const T* table;
  int64_t D;
  const Tidx* ids;
  const Tsplits* splits;
  bool mean;
  T* out;              // [B, out_stride]: bag b's row at out + b * out_stride
  int64_t out_stride;  // >= D; more when several tables write side by side
  const float* weights = nullptr;  // [nnz] per-id weights (sum only), or none
};

// Computes bags [begin, end). scratch: D floats (unused when T is float).
template <typename T, typename Tidx, typename Tsplits>
using LookupCombineFn = void (*)(const LookupCombineArgs<T, Tidx, Tsplits>& a, int64_t begin,
                                 int64_t end, float* scratch);

template <typename T, typename Tidx, typename Tsplits>
LookupCombineFn<T, Tidx, Tsplits> LookupCombineKernel(KernelIsa isa);

// ---------------------------------------------------------------- backward

// rows[u] = sum over k in [seg_start[u], seg_start[u + 1]), in k order, of the upstream
// gradient row that position perm[k] reads (grad[sample_of[p]] x inv_count[sample_of[p]]
// for mean, grad[sample_of[p]] x weights[p] for weighted, grad[sample_of[p]] for sum,
// grad[p] for none).
template <typename T>
struct GradSegmentsArgs {
  Combiner combiner;
  const uint32_t* perm;       // nullptr: the identity
  const int64_t* seg_start;   // [U + 1]
  const int32_t* sample_of;   // [nnz] bag of each position (sum / mean)
  const float* inv_count;     // [B] 1 / bag size (mean)
  const T* grad;              // [B, D] (sum / mean) or [nnz, D] (none)
  int64_t D;
  int64_t grad_stride;        // >= D: elements between gradient rows (a column window)
  T* rows;                    // [U, D]
  // T is float and rows are 64-byte multiples at 64-byte aligned addresses: write them
  // with non-temporal stores (x86; elsewhere ignored).
  bool stream;
  const float* weights = nullptr;  // [nnz] per-id weights (kWeighted)
};

// Computes rows [begin, end). scratch: D floats.
template <typename T>
using GradSegmentsFn = void (*)(const GradSegmentsArgs<T>& a, int64_t begin, int64_t end,
                                float* scratch);

template <typename T>
GradSegmentsFn<T> GradSegmentsKernel(KernelIsa isa);

// ---------------------------------------------------------------- row-wise AdaGrad

// For each distinct row u (id unique_ids[u]) with g = float32 sum over k in
// [seg_start[u], seg_start[u + 1]), in k order, of the gradient row that position
// perm[k] reads (exactly GradSegments' rows[u]; for combiner kNone, grad[perm[k]]):
//   v[id] += sum(g^2) * inv_d;  w[id] -= lr / (sqrt(v[id] / scale) + eps) * g;
//   then, if decay != 0, w[id] -= decay * w[id].
// With combiner kSum / kMean, grad holds one row per bag (the lookup's upstream
// gradient): the backward and the update in one pass, without the [U, D] rows between.
template <typename Tgrad>
struct RowwiseAdagradArgs {
  const int64_t* unique_ids;  // [U]
  const int64_t* seg_start;   // [U + 1]
  const uint32_t* perm;       // nullptr: the identity
  Combiner combiner;          // how a position finds its gradient row, as in GradSegments
  const int32_t* sample_of;   // [N] bag of each position (sum / mean)
  const float* inv_count;     // [B] 1 / bag size (mean)
  const Tgrad* grad;          // [N, D] (none) or [B, D] (sum / mean)
  int64_t D;
  int64_t grad_stride;        // >= D: elements between gradient rows (a column window)
  float* w;                   // [R, D]
  float* v;                   // [R]
  float lr, eps, scale, decay, inv_d;
  const float* weights = nullptr;  // [N] per-id weights (kWeighted)
};

// Updates rows [begin, end). scratch: D floats.
template <typename Tgrad>
using RowwiseAdagradFn = void (*)(const RowwiseAdagradArgs<Tgrad>& a, int64_t begin,
                                  int64_t end, float* scratch);

template <typename Tgrad>
RowwiseAdagradFn<Tgrad> RowwiseAdagradKernel(KernelIsa isa);

// ---------------------------------------------------------------- keyed rows

// Rows [begin, end) of a dynamic table's new keys' uniform initial rows
// (tfhybrid/dynamic/initial_rows.py): with state[i] the key's stream state,
//   rows[i, j] = float(low + span * ((mix64(state[i] + (j + 1) * G) >> 11) * 2^-53)),
// splitmix64's finalizer and increment G, every product and sum of the bits modulo 2^64.
// Integer arithmetic and one rounding per double operation: bitwise identical at every
// level.
struct KeyedUniformArgs {
  const uint64_t* states;  // [n]
  int64_t dim;
  double low, span;        // span = high - low
  float* rows;             // [n, dim]
};

using KeyedUniformFn = void (*)(const KeyedUniformArgs& a, int64_t begin, int64_t end);

KeyedUniformFn KeyedUniformKernel(KernelIsa isa);

}  // namespace tfhybrid
}  // namespace tensorflow

#endif  // TFHYBRID_CUSTOM_OPS_CC_KERNELS_ISA_KERNELS_H_
