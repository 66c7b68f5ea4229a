// Bodies of the dispatched hot loops declared in isa_kernels.h.
//
// No include guard on purpose: isa_kernels.cc includes this file once per dispatch
// level, each time inside its own namespace (isa_generic, isa_avx2, isa_avx512) and,
// for the AVX levels, inside a `#pragma GCC target` region, so every function here
// exists once per level under a distinct name. TFHYBRID_ISA_LEVEL (0, 1, 2) is set
// before each inclusion; standard, Eigen and intrinsics headers are included by
// isa_kernels.cc before the first inclusion, outside any target region, so that no
// inline function shared with the baseline code is compiled with AVX instructions.
//
// Every loop accumulates each output element in the same order at any vector width,
// and the library is compiled with -ffp-contract=off: all levels give bitwise-identical
// results (see isa_kernels.h).

#if !defined(TFHYBRID_ISA_LEVEL)
#error "isa_kernels_impl.h is included only by isa_kernels.cc, with TFHYBRID_ISA_LEVEL set"
#endif

// ---------------------------------------------------------------- row conversions

// dst[0, n) = float(src[0, n)). Exact for every T (F16C's conversion equals Eigen's).
template <typename T>
inline void ToFloats(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// dst[0, n) = T(src[0, n)), rounded to nearest even like Eigen's scalar conversion.
template <typename T>
inline void FromFloats(const float* __restrict src, T* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if TFHYBRID_ISA_LEVEL >= 1
template <>
inline void ToFloats<Eigen::half>(const Eigen::half* __restrict src, float* __restrict dst,
                                  int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void FromFloats<Eigen::half>(const float* __restrict src, Eigen::half* __restrict dst,
                                    int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) dst[i] = static_cast<Eigen::half>(src[i]);
}
#endif  // TFHYBRID_ISA_LEVEL >= 1

enum class RowOp { kSet, kAdd, kSetScaled, kAddScaled };

// acc[0, n) (=|+=) x[0, n) (* sc).
template <RowOp kOp>
inline void ApplyRow(const float* __restrict x, float sc, float* __restrict acc, int64_t n) {
  for (int64_t d = 0; d < n; ++d) {
    if (kOp == RowOp::kSet) acc[d] = x[d];
    if (kOp == RowOp::kAdd) acc[d] += x[d];
    if (kOp == RowOp::kSetScaled) acc[d] = x[d] * sc;
    if (kOp == RowOp::kAddScaled) acc[d] += x[d] * sc;
  }
}

// ApplyRow on a row of T: float rows directly, others converted in L1-sized chunks.
template <RowOp kOp, typename T>
inline void RowInto(const T* __restrict src, float sc, float* __restrict acc, int64_t D) {
  if constexpr (std::is_same<T, float>::value) {
    ApplyRow<kOp>(src, sc, acc, D);
  } else {
    constexpr int64_t kChunk = 64;
    float tmp[kChunk];
    for (int64_t s = 0; s < D; s += kChunk) {
      const int64_t n = std::min(kChunk, D - s);
      ToFloats(src + s, tmp, n);
      ApplyRow<kOp>(tmp, sc, acc + s, n);
    }
  }
}

// ---------------------------------------------------------------- streaming stores

// dst[0, D) = src[0, D) with non-temporal stores; D % 16 == 0, dst 64-byte aligned.
inline void StreamRow(float* __restrict dst, const float* __restrict src, int64_t D) {
#if TFHYBRID_ISA_LEVEL >= 2
  for (int64_t d = 0; d < D; d += 16) _mm512_stream_ps(dst + d, _mm512_loadu_ps(src + d));
#elif TFHYBRID_ISA_LEVEL >= 1
  for (int64_t d = 0; d < D; d += 8) _mm256_stream_ps(dst + d, _mm256_loadu_ps(src + d));
#elif defined(TFHYBRID_X86)
  for (int64_t d = 0; d < D; d += 4) _mm_stream_ps(dst + d, _mm_loadu_ps(src + d));
#else
  std::memcpy(dst, src, D * sizeof(float));
#endif
}

inline void StreamFence() {
#if defined(TFHYBRID_X86)
  _mm_sfence();
#endif
}

// ---------------------------------------------------------------- float vectors

#if TFHYBRID_ISA_LEVEL >= 1
// One register of floats at this level. Only plain loads, stores and single IEEE
// operations (no FMA): each lane computes exactly what the scalar loop computes for its
// element.
#if TFHYBRID_ISA_LEVEL >= 2
using FloatVec = __m512;
constexpr int64_t kVecLanes = 16;
#define TFHYBRID_VEC(op) _mm512_##op
#else
using FloatVec = __m256;
constexpr int64_t kVecLanes = 8;
#define TFHYBRID_VEC(op) _mm256_##op
#endif
inline FloatVec VecLoad(const float* p) { return TFHYBRID_VEC(loadu_ps)(p); }
inline void VecStore(float* p, FloatVec v) { TFHYBRID_VEC(storeu_ps)(p, v); }
inline FloatVec VecAdd(FloatVec x, FloatVec y) { return TFHYBRID_VEC(add_ps)(x, y); }
inline FloatVec VecMul(FloatVec x, FloatVec y) { return TFHYBRID_VEC(mul_ps)(x, y); }
inline FloatVec VecSet(float x) { return TFHYBRID_VEC(set1_ps)(x); }
inline FloatVec VecDiv(FloatVec x, float y) { return TFHYBRID_VEC(div_ps)(x, VecSet(y)); }
#undef TFHYBRID_VEC  // defined again at the next inclusion, for that level
// The registers one strip of a row sum is held in (of the 16 / 32 the level has).
constexpr int kMaxStripVecs = 8;

// Calls fn(std::integral_constant<int, min(n, kMaxStripVecs)>()) for n >= 1 (callers
// pass a positive count of whole vectors): one loop body compiled per strip width, so
// that its accumulators are registers.
template <typename Fn>
inline void WithStripVecs(int64_t n, Fn fn) {
  switch (n) {
    case 1: fn(std::integral_constant<int, 1>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    case 3: fn(std::integral_constant<int, 3>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
    case 5: fn(std::integral_constant<int, 5>()); break;
    case 6: fn(std::integral_constant<int, 6>()); break;
    case 7: fn(std::integral_constant<int, 7>()); break;
    default: fn(std::integral_constant<int, kMaxStripVecs>()); break;
  }
}

// Calls fn(column, std::integral_constant<int, n>()) for consecutive strips of n vectors
// (n <= kMaxStripVecs) that cover columns [0, D); D is a multiple of kVecLanes.
template <typename Fn>
inline void ForEachStrip(int64_t D, Fn fn) {
  for (int64_t column = 0; column < D;) {
    WithStripVecs((D - column) / kVecLanes, [&](auto strip) {
      fn(column, strip);
      column += decltype(strip)::value * kVecLanes;
    });
  }
}
#endif  // TFHYBRID_ISA_LEVEL >= 1

// ---------------------------------------------------------------- forward

#if TFHYBRID_ISA_LEVEL >= 1
// LookupCombineRange for float tables whose width is a multiple of kVecLanes: each bag's
// sum is accumulated in registers, kMaxStripVecs vectors of columns at a time, and its
// output row is stored once. Same additions in the same order as the scalar loop.
// Accumulating in the output row itself (a row of a buffer far larger than the caches)
// kept fewer table rows in flight: every bag's first store misses, and the adds behind
// it wait on it. kRowVecs > 0: the width is kRowVecs vectors (one strip), known at
// compile time (the row's prefetches unrolled, its address arithmetic constant); 0: any
// multiple of kVecLanes. The table-batched op on the 8 x 1M x 64 forward (TF profiler, 2 threads):
// 2.18 ms accumulating in the output, 1.66 ms in registers at a run-time width, 1.11 ms
// at a compile-time width.
template <int kRowVecs, typename Tidx, typename Tsplits>
void LookupCombineRangeInRegisters(const LookupCombineArgs<float, Tidx, Tsplits>& a,
                                   int64_t begin, int64_t end) {
  const float* __restrict table = a.table;
  const Tidx* __restrict ids = a.ids;
  const int64_t D = kRowVecs > 0 ? kRowVecs * kVecLanes : a.D;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(float));
  auto row = [&](int64_t p) { return table + static_cast<int64_t>(ids[p]) * D; };
  const int64_t prefetch_end = static_cast<int64_t>(a.splits[end]);
  const int64_t first = static_cast<int64_t>(a.splits[begin]);
  for (int64_t p = first; p < std::min(first + kPrefetchDistance, prefetch_end); ++p)
    PrefetchRow(row(p), row_bytes);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t s = static_cast<int64_t>(a.splits[b]);
    const int64_t e = static_cast<int64_t>(a.splits[b + 1]);
    float* __restrict out = a.out + b * a.out_stride;
    if (s == e) {
      std::fill(out, out + D, 0.0f);
      continue;
    }
    auto sum_strip = [&](int64_t column, auto strip) {
      constexpr int kVecs = decltype(strip)::value;
      const bool prefetch = column == 0;  // the whole row, once per id
      if (prefetch && s + kPrefetchDistance < prefetch_end)
        PrefetchRow(row(s + kPrefetchDistance), row_bytes);
      FloatVec acc[kVecs];
      const float* __restrict src = row(s) + column;
      for (int i = 0; i < kVecs; ++i) acc[i] = VecLoad(src + i * kVecLanes);
      for (int64_t p = s + 1; p < e; ++p) {
        if (prefetch && p + kPrefetchDistance < prefetch_end)
          PrefetchRow(row(p + kPrefetchDistance), row_bytes);
        src = row(p) + column;
        for (int i = 0; i < kVecs; ++i) acc[i] = VecAdd(acc[i], VecLoad(src + i * kVecLanes));
      }
      if (a.mean) {
        const float cnt = static_cast<float>(e - s);
        for (int i = 0; i < kVecs; ++i) acc[i] = VecDiv(acc[i], cnt);
      }
      for (int i = 0; i < kVecs; ++i) VecStore(out + column + i * kVecLanes, acc[i]);
    };
    if constexpr (kRowVecs > 0) {
      sum_strip(0, std::integral_constant<int, kRowVecs>());
    } else {
      ForEachStrip(D, sum_strip);
    }
  }
}
#endif  // TFHYBRID_ISA_LEVEL >= 1

// LookupCombineRange's loop through memory (kWeighted: each row times its weight, a
// multiply and then the add, as the backward scales).
template <bool kWeighted, typename T, typename Tidx, typename Tsplits>
void LookupCombineRangeInMemory(const LookupCombineArgs<T, Tidx, Tsplits>& a,
                                int64_t begin, int64_t end, float* scratch) {
  const T* __restrict table = a.table;
  const Tidx* __restrict ids = a.ids;
  const int64_t D = a.D;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  auto row = [&](int64_t p) { return table + static_cast<int64_t>(ids[p]) * D; };
  // The prefetch runs kPrefetchDistance ids ahead, across bag boundaries, up to the
  // last id of this range; warm up its pipeline first.
  const int64_t prefetch_end = static_cast<int64_t>(a.splits[end]);
  const int64_t first = static_cast<int64_t>(a.splits[begin]);
  for (int64_t p = first; p < std::min(first + kPrefetchDistance, prefetch_end); ++p)
    PrefetchRow(row(p), row_bytes);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t s = static_cast<int64_t>(a.splits[b]);
    const int64_t e = static_cast<int64_t>(a.splits[b + 1]);
    float* __restrict acc;
    if constexpr (std::is_same<T, float>::value) {
      acc = a.out + b * a.out_stride;
    } else {
      acc = scratch;
    }
    if (s == e) {
      std::fill(acc, acc + D, 0.0f);
    } else {
      // The first row outside the loop: with a branch between the two vector loops in
      // the loop body, the forward of the -march=native build (znver3 tuning) measured
      // ~10% slower.
      if (s + kPrefetchDistance < prefetch_end) PrefetchRow(row(s + kPrefetchDistance), row_bytes);
      if constexpr (kWeighted) {
        RowInto<RowOp::kSetScaled>(row(s), a.weights[s], acc, D);
      } else {
        RowInto<RowOp::kSet>(row(s), 1.0f, acc, D);
      }
      for (int64_t p = s + 1; p < e; ++p) {
        if (p + kPrefetchDistance < prefetch_end) PrefetchRow(row(p + kPrefetchDistance), row_bytes);
        if constexpr (kWeighted) {
          RowInto<RowOp::kAddScaled>(row(p), a.weights[p], acc, D);
        } else {
          RowInto<RowOp::kAdd>(row(p), 1.0f, acc, D);
        }
      }
      if (!kWeighted && a.mean) {
        const float cnt = static_cast<float>(e - s);
        for (int64_t d = 0; d < D; ++d) acc[d] /= cnt;
      }
    }
    if constexpr (!std::is_same<T, float>::value) FromFloats(acc, a.out + b * a.out_stride, D);
  }
}

template <typename T, typename Tidx, typename Tsplits>
void LookupCombineRange(const LookupCombineArgs<T, Tidx, Tsplits>& a, int64_t begin,
                        int64_t end, float* scratch) {
  if (a.weights != nullptr) return LookupCombineRangeInMemory<true>(a, begin, end, scratch);
#if TFHYBRID_ISA_LEVEL >= 1
  if constexpr (std::is_same<T, float>::value) {
    if (a.D > 0 && a.D % kVecLanes == 0) {
      const int64_t vecs = a.D / kVecLanes;
      if (vecs > kMaxStripVecs) return LookupCombineRangeInRegisters<0>(a, begin, end);
      return WithStripVecs(vecs, [&](auto row_vecs) {
        LookupCombineRangeInRegisters<decltype(row_vecs)::value>(a, begin, end);
      });
    }
  }
#endif
  LookupCombineRangeInMemory<false>(a, begin, end, scratch);
}

// ---------------------------------------------------------------- backward

// Calls fn(std::integral_constant<Combiner, c>()): one loop body compiled per combiner.
template <typename Fn>
inline void WithCombiner(Combiner c, Fn fn) {
  switch (c) {
    case Combiner::kNone:
      fn(std::integral_constant<Combiner, Combiner::kNone>());
      break;
    case Combiner::kSum:
      fn(std::integral_constant<Combiner, Combiner::kSum>());
      break;
    case Combiner::kMean:
      fn(std::integral_constant<Combiner, Combiner::kMean>());
      break;
    case Combiner::kWeighted:
      fn(std::integral_constant<Combiner, Combiner::kWeighted>());
      break;
  }
}

// The gradient row that sorted position k reads: the position itself (kNone) or its bag.
template <Combiner C>
inline int64_t SourceRow(const uint32_t* perm, const int32_t* sample_of, int64_t k) {
  const int64_t p = perm ? static_cast<int64_t>(perm[k]) : k;
  return C == Combiner::kNone ? p : static_cast<int64_t>(sample_of[p]);
}

#if TFHYBRID_ISA_LEVEL >= 1
// SumSegment for float gradients whose width is a multiple of kVecLanes: the sum is held
// in registers, kMaxStripVecs vectors of columns at a time, and stored to acc once,
// instead of every add reading back the store of the one before (a hot id's segment has
// thousands of positions). The 8 x 1M x 64 train step measured 2.4% faster (paired
// builds, 16 rounds, 95% interval [0.7%, 4.8%]).
template <Combiner C>
inline void SumSegmentInRegisters(const float* grad, int64_t D, int64_t ld,
                                  const uint32_t* perm, const int32_t* sample_of,
                                  const float* inv_count, const float* weights,
                                  int64_t ks, int64_t ke,
                                  int64_t ahead, int64_t prefetch_end, float* __restrict acc) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(float));
  ForEachStrip(D, [&](int64_t column, auto strip) {
    constexpr int kVecs = decltype(strip)::value;
    const bool prefetch = ahead > 0 && column == 0;  // the whole row, once per position
    // x = the strip of the row position k reads, scaled by its bag's inv_count for kMean
    // (a multiply, then the add: the scalar loop's rounding, as the library is built
    // without FMA contraction).
    auto load = [&](int64_t k, FloatVec* x) {
      if (prefetch && k + ahead < prefetch_end)
        PrefetchRow(grad + SourceRow<C>(perm, sample_of, k + ahead) * ld, row_bytes);
      const int64_t r = SourceRow<C>(perm, sample_of, k);
      const float* __restrict src = grad + r * ld + column;
      for (int i = 0; i < kVecs; ++i) x[i] = VecLoad(src + i * kVecLanes);
      if (C == Combiner::kMean || C == Combiner::kWeighted) {
        const FloatVec scale = VecSet(C == Combiner::kMean ? inv_count[r]
                                                           : weights[perm ? perm[k] : k]);
        for (int i = 0; i < kVecs; ++i) x[i] = VecMul(x[i], scale);
      }
    };
    FloatVec sum[kVecs], x[kVecs];
    load(ks, sum);
    for (int64_t k = ks + 1; k < ke; ++k) {
      load(k, x);
      for (int i = 0; i < kVecs; ++i) sum[i] = VecAdd(sum[i], x[i]);
    }
    for (int i = 0; i < kVecs; ++i) VecStore(acc + column + i * kVecLanes, sum[i]);
  });
}
#endif  // TFHYBRID_ISA_LEVEL >= 1

// acc[0, D) = sum over k in [ks, ke), in k order, of the gradient row k reads (row r
// at grad + r * ld; scaled by its bag's inv_count for kMean, by its position's weight
// for kWeighted): the one summation of
// GradSegments and of the fused AdaGrad, so both give bitwise the same row. With
// ahead > 0 it also prefetches the row of position k + ahead while below prefetch_end.
template <typename T, Combiner C>
inline void SumSegment(const T* grad, int64_t D, int64_t ld, const uint32_t* perm,
                       const int32_t* sample_of, const float* inv_count,
                       const float* weights, int64_t ks, int64_t ke, int64_t ahead,
                       int64_t prefetch_end, float* __restrict acc) {
#if TFHYBRID_ISA_LEVEL >= 1
  if constexpr (std::is_same<T, float>::value) {
    if (D > 0 && D % kVecLanes == 0 && ks < ke) {
      return SumSegmentInRegisters<C>(grad, D, ld, perm, sample_of, inv_count, weights, ks,
                                      ke, ahead, prefetch_end, acc);
    }
  }
#endif
  for (int64_t k = ks; k < ke; ++k) {
    if (ahead > 0 && k + ahead < prefetch_end)
      PrefetchRow(grad + SourceRow<C>(perm, sample_of, k + ahead) * ld, D * sizeof(T));
    const int64_t r = SourceRow<C>(perm, sample_of, k);
    const T* __restrict src = grad + r * ld;
    if (C == Combiner::kMean || C == Combiner::kWeighted) {
      const float scale = C == Combiner::kMean ? inv_count[r] : weights[perm ? perm[k] : k];
      if (k == ks) {
        RowInto<RowOp::kSetScaled>(src, scale, acc, D);
      } else {
        RowInto<RowOp::kAddScaled>(src, scale, acc, D);
      }
    } else if (k == ks) {
      RowInto<RowOp::kSet>(src, 1.0f, acc, D);
    } else {
      RowInto<RowOp::kAdd>(src, 1.0f, acc, D);
    }
  }
}

template <typename T, Combiner C>
void GradSegmentsRangeFor(const GradSegmentsArgs<T>& a, int64_t begin, int64_t end,
                          float* scratch) {
  constexpr int64_t kAhead = 4;  // positions ahead to prefetch gradient rows
  const int64_t D = a.D;
  const int64_t k_end = a.seg_start[end];
#if defined(TFHYBRID_X86)
  const bool stream = std::is_same<T, float>::value && a.stream;
#else
  const bool stream = false;
#endif
  for (int64_t u = begin; u < end; ++u) {
    float* __restrict acc = scratch;
    if constexpr (std::is_same<T, float>::value) {
      if (!stream) acc = a.rows + u * D;
    }
    SumSegment<T, C>(a.grad, D, a.grad_stride, a.perm, a.sample_of, a.inv_count, a.weights,
                     a.seg_start[u], a.seg_start[u + 1], kAhead, k_end, acc);
    if constexpr (std::is_same<T, float>::value) {
      if (stream) StreamRow(a.rows + u * D, acc, D);
    } else {
      FromFloats(acc, a.rows + u * D, D);
    }
  }
  if (stream) StreamFence();
}

template <typename T>
void GradSegmentsRange(const GradSegmentsArgs<T>& a, int64_t begin, int64_t end,
                       float* scratch) {
  WithCombiner(a.combiner, [&](auto c) {
    GradSegmentsRangeFor<T, decltype(c)::value>(a, begin, end, scratch);
  });
}

// ---------------------------------------------------------------- row-wise AdaGrad

#include "sum_squares_impl.h"

template <typename Tgrad, Combiner C>
void RowwiseAdagradRangeFor(const RowwiseAdagradArgs<Tgrad>& a, int64_t begin, int64_t end,
                            float* scratch) {
  constexpr int64_t kPrefetch = 8;       // unique rows ahead (var / accum)
  constexpr int64_t kGradPrefetch = 16;  // positions ahead (gradient rows), across rows
  const int64_t* uniq = a.unique_ids;
  const int64_t* seg = a.seg_start;
  const Tgrad* grad = a.grad;
  const int64_t D = a.D;
  float* w = a.w;
  float* v = a.v;
  float* __restrict acc = scratch;
  for (int64_t u = begin; u < std::min(begin + kPrefetch, end); ++u) {
    PrefetchRowForWrite(w + uniq[u] * D, D * sizeof(float));
    __builtin_prefetch(v + uniq[u], 1, 3);
  }
  // The first gradient rows; SumSegment then keeps kGradPrefetch of them in flight (a hot
  // id's positions are random bags: one miss each without it).
  for (int64_t k = seg[begin]; k < std::min(seg[begin] + kGradPrefetch, seg[end]); ++k)
    PrefetchRow(grad + SourceRow<C>(a.perm, a.sample_of, k) * a.grad_stride,
                D * sizeof(Tgrad));
  for (int64_t u = begin; u < end; ++u) {
    if (u + kPrefetch < end) {  // rows are random: keep several misses in flight
      const int64_t next = uniq[u + kPrefetch];
      PrefetchRowForWrite(w + next * D, D * sizeof(float));
      __builtin_prefetch(v + next, 1, 3);
    }
    SumSegment<Tgrad, C>(grad, D, a.grad_stride, a.perm, a.sample_of, a.inv_count,
                         a.weights, seg[u], seg[u + 1], kGradPrefetch, seg[end], acc);
    const int64_t row = uniq[u];
    const float vi = v[row] + SumSquares(acc, D) * a.inv_d;
    v[row] = vi;
    const float mult = a.lr / (std::sqrt(vi / a.scale) + a.eps);
    float* __restrict wr = w + row * D;
    if (a.decay != 0.0f) {
      const float decay = a.decay;
      for (int64_t d = 0; d < D; ++d) {
        const float stepped = wr[d] - mult * acc[d];
        wr[d] = stepped - decay * stepped;
      }
    } else {
      for (int64_t d = 0; d < D; ++d) wr[d] -= mult * acc[d];
    }
  }
}

template <typename Tgrad>
void RowwiseAdagradRange(const RowwiseAdagradArgs<Tgrad>& a, int64_t begin, int64_t end,
                         float* scratch) {
  WithCombiner(a.combiner, [&](auto c) {
    RowwiseAdagradRangeFor<Tgrad, decltype(c)::value>(a, begin, end, scratch);
  });
}

// ---------------------------------------------------------------- keyed rows

inline void KeyedUniformRange(const KeyedUniformArgs& a, int64_t begin, int64_t end) {
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
  const int64_t dim = a.dim;
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t state = a.states[i];
    float* __restrict row = a.rows + i * dim;
    for (int64_t j = 0; j < dim; ++j) {
      uint64_t z = state + static_cast<uint64_t>(j + 1) * kGolden;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      z ^= z >> 31;
      // (z >> 11) < 2^53: exact as a signed 64-bit integer and as a double
      const double u = static_cast<double>(static_cast<int64_t>(z >> 11)) * 0x1.0p-53;
      row[j] = static_cast<float>(a.low + a.span * u);
    }
  }
}
