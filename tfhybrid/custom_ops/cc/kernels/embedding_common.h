// Shared helpers for tfhybrid's embedding kernels: the dispatch level of the hot loops
// (isa_kernels.h), id validation and a deterministic "group positions by id" (stable
// radix sort).
#ifndef TFHYBRID_CUSTOM_OPS_CC_KERNELS_EMBEDDING_COMMON_H_
#define TFHYBRID_CUSTOM_OPS_CC_KERNELS_EMBEDDING_COMMON_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <memory>
#include <type_traits>
#include <vector>

#include "absl/strings/str_join.h"
#include "huge_pages.h"
#include "isa_kernels.h"
#include "tensorflow/core/framework/bfloat16.h"
#include "tensorflow/core/framework/numeric_types.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/lib/core/errors.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/platform/types.h"

namespace tensorflow {
namespace tfhybrid {

using int64 = std::int64_t;

// The dispatch level for this process's kernels (see isa_kernels.h); an error names a
// bad TFHYBRID_KERNEL_ISA.
inline Status GetKernelIsa(KernelIsa* isa) {
  std::string error;
  if (!ActiveKernelIsa(isa, &error)) return errors::InvalidArgument(error);
  return OkStatus();
}

// Streaming (non-temporal) row stores: rows must be 64-byte multiples at 64-byte
// aligned addresses. Disable with TFHYBRID_NO_STREAMING_STORES=1.
inline bool StreamingStoresEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("TFHYBRID_NO_STREAMING_STORES");
    return !(v != nullptr && v[0] == '1');
  }();
  return enabled;
}

inline bool StreamableRows(const void* base, int64 row_bytes) {
  return StreamingStoresEnabled() && row_bytes % 64 == 0 &&
         reinterpret_cast<uintptr_t>(base) % 64 == 0;
}

// The combiner and table_name attrs of the ops that take a lookup's ids and bags
// (TFHYBRID_LOOKUP_ATTRS in embedding_ops.cc).
inline Status ReadLookupAttrs(OpKernelConstruction* ctx, Combiner* combiner,
                              std::string* table_name) {
  std::string name;
  TF_RETURN_IF_ERROR(ctx->GetAttr("combiner", &name));
  if (name == "none") {
    *combiner = Combiner::kNone;
  } else if (name == "sum") {
    *combiner = Combiner::kSum;
  } else if (name == "mean") {
    *combiner = Combiner::kMean;
  } else {
    return errors::InvalidArgument("unknown combiner '", name, "'");
  }
  return ctx->GetAttr("table_name", table_name);
}

// The grad_columns attr of a lookup's backward ops: empty (the gradient's every column)
// or [begin, end). Tables looked up side by side into one output
// (ResourceEmbeddingLookupCombineConcat) share its upstream gradient; each table's
// backward reads its own columns in place instead of a sliced copy.
inline Status ReadGradColumns(OpKernelConstruction* ctx, std::vector<int64>* columns) {
  std::vector<int64_t> attr;
  TF_RETURN_IF_ERROR(ctx->GetAttr("grad_columns", &attr));
  if (!attr.empty() && (attr.size() != 2 || attr[0] < 0 || attr[1] < attr[0])) {
    return errors::InvalidArgument("grad_columns must be [] or [begin, end) with 0 <= begin "
                                   "<= end, got [", absl::StrJoin(attr, ", "), "]");
  }
  columns->assign(attr.begin(), attr.end());
  return OkStatus();
}

// The window `columns` (ReadGradColumns) of a gradient `width` columns wide: its first
// column and its width.
inline Status GradWindow(const std::vector<int64>& columns, int64 width,
                         const std::string& table_name, int64* begin, int64* D) {
  if (columns.empty()) {
    *begin = 0;
    *D = width;
    return OkStatus();
  }
  if (columns[1] > width) {
    return errors::InvalidArgument("embedding table '", table_name, "': grad_columns [",
                                   columns[0], ", ", columns[1], ") exceed the gradient's ",
                                   width, " columns");
  }
  *begin = columns[0];
  *D = columns[1] - columns[0];
  return OkStatus();
}

// Returns the position of the first id outside [0, num_rows), or -1.
template <typename Tidx>
inline int64 FirstOutOfRange(const Tidx* ids, int64 n, int64 num_rows) {
  // Negative ids become huge when widened to int64 and compared unsigned.
  const uint64_t limit = static_cast<uint64_t>(num_rows);
  auto bad = [limit](Tidx id) {
    return static_cast<uint64_t>(static_cast<int64>(id)) >= limit;
  };
  // Branch-free scan in blocks; only locate the exact position on failure.
  constexpr int64 kBlock = 256;
  for (int64 s = 0; s < n; s += kBlock) {
    const int64 e = std::min(n, s + kBlock);
    bool any = false;
    for (int64 i = s; i < e; ++i) any |= bad(ids[i]);
    if (any) {
      for (int64 i = s; i < e; ++i)
        if (bad(ids[i])) return i;
    }
  }
  return -1;
}

// Positions [0, n) grouped by id: perm lists positions sorted by (id, position);
// segment u covers perm[seg_start[u] .. seg_start[u+1]) and has id unique_ids[u]
// (ascending). Pure function of the input: deterministic for any thread count.
struct Grouping {
  std::vector<int64> unique_ids;
  std::vector<int64> seg_start;  // size U + 1
  std::vector<uint32_t> perm;    // empty when the identity (ids non-decreasing)
  int64 num_unique() const { return static_cast<int64>(unique_ids.size()); }
  int64 pos(int64 k) const { return perm.empty() ? k : static_cast<int64>(perm[k]); }
};

// Per-thread reusable scratch memory. Fresh multi-MB heap blocks are page-faulted
// (and zeroed by the kernel) on every call, which costs more than the sort itself.
struct Scratch {
  Grouping g;
  std::vector<uint64_t> keys, tmp;
  std::vector<int64> hist;
  std::vector<int32_t> sample_of;
  std::vector<float> inv_count;

  void Trim() {  // do not pin huge buffers forever after an unusually large call
    constexpr size_t kMaxBytes = size_t{64} << 20;
    if (keys.capacity() * sizeof(uint64_t) > kMaxBytes) {
      *this = Scratch();
    }
  }
};

// RAII access to this thread's Scratch (a private one if it is already in use).
class ScratchHandle {
 public:
  ScratchHandle() {
    if (!busy()) {
      busy() = true;
      owned_tls_ = true;
      s_ = &tls();
    } else {
      own_.reset(new Scratch);
      s_ = own_.get();
    }
  }
  ~ScratchHandle() {
    if (owned_tls_) {
      s_->Trim();
      busy() = false;
    }
  }
  Scratch* operator->() { return s_; }
  Scratch& operator*() { return *s_; }

 private:
  static Scratch& tls() {
    thread_local Scratch s;
    return s;
  }
  static bool& busy() {
    thread_local bool b = false;
    return b;
  }
  Scratch* s_ = nullptr;
  bool owned_tls_ = false;
  std::unique_ptr<Scratch> own_;
};

inline int BitsFor(int64 num_rows) {
  int bits = 1;
  while (bits < 63 && (int64{1} << bits) < num_rows) ++bits;
  return bits;
}

// LSD radix sort of packed (id << 32 | pos) keys on the id bits only. LSD is stable
// and the input is in position order, so equal ids stay in position order.
inline void RadixSortPacked(Scratch* s, int64 n, int id_bits) {
  std::vector<uint64_t>& keys = s->keys;
  if (n < 512) {  // keys are distinct (pos in the low bits): std::sort is exact
    std::sort(keys.begin(), keys.begin() + n);
    return;
  }
  const int passes = (id_bits + 10) / 11;
  const int digit = (id_bits + passes - 1) / passes;
  const uint64_t mask = (uint64_t{1} << digit) - 1;
  const int64 buckets = int64{1} << digit;
  if (static_cast<int64>(s->tmp.size()) < n) s->tmp.resize(n);
  s->hist.assign(static_cast<size_t>(buckets) * passes, 0);
  uint64_t* a = keys.data();
  uint64_t* b = s->tmp.data();
  int64* hist = s->hist.data();
  for (int64 i = 0; i < n; ++i) {
    const uint64_t k = a[i] >> 32;
    for (int p = 0; p < passes; ++p) ++hist[p * buckets + ((k >> (p * digit)) & mask)];
  }
  for (int p = 0; p < passes; ++p) {
    int64* h = hist + p * buckets;
    // Skip a pass whose digit is constant (common for the high digit).
    bool trivial = false;
    for (int64 j = 0; j < buckets; ++j) {
      if (h[j] == n) trivial = true;
      if (h[j] != 0) break;
    }
    if (trivial) continue;
    int64 sum = 0;
    for (int64 j = 0; j < buckets; ++j) {
      const int64 c = h[j];
      h[j] = sum;
      sum += c;
    }
    const int shift = 32 + p * digit;
    for (int64 i = 0; i < n; ++i) {
      const uint64_t v = a[i];
      b[h[(v >> shift) & mask]++] = v;
    }
    std::swap(a, b);
  }
  if (a != keys.data()) std::memcpy(keys.data(), a, n * sizeof(uint64_t));
}

// Groups positions by id into s->g. Requires every id in [0, num_rows), n < 2^32.
template <typename Tidx>
inline void GroupById(const Tidx* ids, int64 n, int64 num_rows, Scratch* s) {
  Grouping* g = &s->g;
  g->unique_ids.clear();
  g->seg_start.clear();
  g->perm.clear();
  bool sorted = true;
  for (int64 i = 1; i < n; ++i) sorted &= ids[i - 1] <= ids[i];
  if (sorted) {
    for (int64 i = 0; i < n; ++i) {
      if (i == 0 || ids[i] != ids[i - 1]) {
        g->unique_ids.push_back(static_cast<int64>(ids[i]));
        g->seg_start.push_back(i);
      }
    }
    g->seg_start.push_back(n);
    return;
  }
  g->perm.resize(n);
  if (num_rows <= (int64{1} << 32)) {
    if (static_cast<int64>(s->keys.size()) < n) s->keys.resize(n);
    uint64_t* keys = s->keys.data();
    for (int64 i = 0; i < n; ++i)
      keys[i] = (static_cast<uint64_t>(ids[i]) << 32) | static_cast<uint64_t>(i);
    RadixSortPacked(s, n, BitsFor(num_rows));
    g->unique_ids.resize(n);
    g->seg_start.resize(n + 1);
    uint32_t* perm = g->perm.data();
    int64* uniq = g->unique_ids.data();
    int64* seg = g->seg_start.data();
    int64 u = 0;
    uint64_t prev = ~uint64_t{0};
    // Without a branch: every key writes slot u, and u moves past it only when the id is
    // new (about one key in three is, for Zipf ids, and a branch on it mispredicts
    // often: 30 -> 17 us per 32k keys, timed in isolation).
    for (int64 k = 0; k < n; ++k) {
      const uint64_t v = keys[k];
      const uint64_t id = v >> 32;
      perm[k] = static_cast<uint32_t>(v);
      uniq[u] = static_cast<int64>(id);
      seg[u] = k;
      u += id != prev;
      prev = id;
    }
    g->unique_ids.resize(u);
    g->seg_start.resize(u);
  } else {
    std::vector<std::pair<int64, uint32_t>> pairs(n);
    for (int64 i = 0; i < n; ++i) pairs[i] = {static_cast<int64>(ids[i]), static_cast<uint32_t>(i)};
    std::sort(pairs.begin(), pairs.end());
    for (int64 k = 0; k < n; ++k) {
      g->perm[k] = pairs[k].second;
      if (k == 0 || pairs[k].first != pairs[k - 1].first) {
        g->unique_ids.push_back(pairs[k].first);
        g->seg_start.push_back(k);
      }
    }
  }
  g->seg_start.push_back(n);
}

// A [rows, cols] output backed by one of a few buffers cached in the kernel and
// reused across calls while no one else holds them (avoids page-faulting a fresh
// multi-MB block on every step). Falls back to a fresh allocation (which replaces the
// least recently used cached buffer) when all cached buffers are still referenced.
class ReusableOutput {
 public:
  Status Get(OpKernelContext* ctx, DataType dtype, int64 rows, int64 cols, Tensor* out) {
    mutex_lock l(mu_);
    ++clock_;
    int victim = 0;
    for (int i = 0; i < kSlots; ++i) {
      Tensor& c = cache_[i];
      if (c.IsInitialized() && c.dtype() == dtype && c.dims() == 2 && c.dim_size(1) == cols &&
          c.dim_size(0) >= rows && c.RefCountIsOne()) {
        last_use_[i] = clock_;
        *out = c.Slice(0, rows);
        return OkStatus();
      }
      if (last_use_[i] < last_use_[victim]) victim = i;
    }
    // Headroom so that a slightly larger next call still reuses the buffer.
    const int64 cap = rows + rows / 4 + 16;
    Tensor fresh;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(dtype, TensorShape({cap, cols}), &fresh));
    cache_[victim] = fresh;
    last_use_[victim] = clock_;
    *out = fresh.Slice(0, rows);
    return OkStatus();
  }

 private:
  static constexpr int kSlots = 3;
  mutex mu_;
  Tensor cache_[kSlots] TF_GUARDED_BY(mu_);
  uint64_t last_use_[kSlots] TF_GUARDED_BY(mu_) = {0, 0, 0};
  uint64_t clock_ TF_GUARDED_BY(mu_) = 0;
};

// Splits that describe bags: non-decreasing, first 0, last nnz.
template <typename Tsplits>
inline Status ValidateRowSplits(const Tsplits* splits, int64 num_splits, int64 nnz,
                                const std::string& table_name) {
  if (num_splits < 1) {
    return errors::InvalidArgument("embedding table '", table_name,
                                   "': row_splits must have at least one element");
  }
  if (splits[0] != 0 || static_cast<int64>(splits[num_splits - 1]) != nnz) {
    return errors::InvalidArgument("embedding table '", table_name,
                                   "': row_splits must start at 0 and end at the number of ids (",
                                   nnz, "), got [", static_cast<int64>(splits[0]), ", ..., ",
                                   static_cast<int64>(splits[num_splits - 1]), "]");
  }
  for (int64 i = 1; i < num_splits; ++i) {
    if (splits[i] < splits[i - 1]) {
      return errors::InvalidArgument("embedding table '", table_name,
                                     "': row_splits must be non-decreasing");
    }
  }
  return OkStatus();
}

// The upstream gradient row each of nnz positions reads, for a backward of
// EmbeddingLookupCombine: for sum / mean, checks row_splits (B = grad_rows bags) and
// fills s->sample_of[p] (the bag of position p) and, for mean, s->inv_count[b]
// (1 / bag size; 0 for an empty bag); for none, checks one gradient row per id.
template <typename Tsplits>
inline Status MapPositionsToGradRows(Combiner combiner, const Tensor& splits_t, int64 nnz,
                                     int64 grad_rows, const std::string& table_name, Scratch* s) {
  if (combiner == Combiner::kNone) {
    if (grad_rows != nnz) {
      return errors::InvalidArgument("grad has ", grad_rows, " rows, expected ", nnz,
                                     " (one per id) for combiner 'none'");
    }
    return OkStatus();
  }
  if (!TensorShapeUtils::IsVector(splits_t.shape())) {
    return errors::InvalidArgument("row_splits must be 1-D, got ",
                                   splits_t.shape().DebugString());
  }
  const int64 num_splits = splits_t.NumElements();
  const Tsplits* splits = splits_t.flat<Tsplits>().data();
  TF_RETURN_IF_ERROR(ValidateRowSplits(splits, num_splits, nnz, table_name));
  const int64 B = num_splits - 1;
  if (grad_rows != B) {
    return errors::InvalidArgument("grad has ", grad_rows, " rows, expected ", B,
                                   " (one per bag)");
  }
  if (B >= (int64{1} << 31)) return errors::InvalidArgument("too many bags: ", B);
  if (static_cast<int64>(s->sample_of.size()) < nnz) s->sample_of.resize(nnz);
  if (combiner == Combiner::kMean && static_cast<int64>(s->inv_count.size()) < B)
    s->inv_count.resize(B);
  for (int64 b = 0; b < B; ++b) {
    const int64 start = static_cast<int64>(splits[b]);
    const int64 end = static_cast<int64>(splits[b + 1]);
    for (int64 p = start; p < end; ++p) s->sample_of[p] = static_cast<int32_t>(b);
    if (combiner == Combiner::kMean)
      s->inv_count[b] = end > start ? 1.0f / static_cast<float>(end - start) : 0.0f;
  }
  return OkStatus();
}

// A lookup's (or its backward's) per-id weights input: empty (no weights: `combiner` as
// it is) or one float32 per id, which only combiner 'sum' takes (a weighted mean or
// sqrtn is the weighted sum divided afterwards, by the caller that sees whole bags).
// Sets the combiner the kernels run (kWeighted with weights) and the weights (nullptr).
inline Status ReadIdWeights(const Tensor& weights_t, int64 nnz, Combiner combiner,
                            const std::string& table_name, Combiner* run,
                            const float** weights) {
  if (!TensorShapeUtils::IsVector(weights_t.shape())) {
    return errors::InvalidArgument("embedding table '", table_name, "': weights must be 1-D, got ",
                                   weights_t.shape().DebugString());
  }
  *run = combiner;
  *weights = nullptr;
  if (weights_t.NumElements() == 0 && nnz != 0) return OkStatus();
  if (weights_t.NumElements() != nnz) {
    return errors::InvalidArgument("embedding table '", table_name, "': got ",
                                   weights_t.NumElements(), " weights, expected ", nnz,
                                   " (one per id) or none");
  }
  if (nnz == 0) return OkStatus();
  if (combiner != Combiner::kSum) {
    return errors::InvalidArgument("embedding table '", table_name,
                                   "': per-id weights need combiner 'sum' (a weighted mean or "
                                   "sqrtn divides the weighted sums afterwards)");
  }
  *run = Combiner::kWeighted;
  *weights = weights_t.flat<float>().data();
  return OkStatus();
}

template <typename Tidx>
inline Status IdOutOfRangeError(const std::string& table_name, const Tidx* ids, int64 pos,
                                int64 num_rows) {
  return errors::InvalidArgument("embedding table '", table_name, "' got id ",
                                 static_cast<int64>(ids[pos]), ", expected ids in [0, ", num_rows,
                                 ") (at position ", pos, ")");
}

}  // namespace tfhybrid
}  // namespace tensorflow

#endif  // TFHYBRID_CUSTOM_OPS_CC_KERNELS_EMBEDDING_COMMON_H_
