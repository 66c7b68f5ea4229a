// CPU kernels for FIITED's chunk pool (tfhybrid/fiited/table.py): ChunkedEmbeddingLookup,
// ChunkedEmbeddingLookupCombine and ChunkedRowwiseAdagradApply; and the same update on a
// tiered FIITED table's cache (tfhybrid/tiers/chunked_cached_table.py),
// CachedChunkedRowwiseAdagradApply.
//
// Row r's chunks are pool rows [row_offsets[r], row_offsets[r + 1]), side by side, so a
// row's present entries are one contiguous run of the flat pool: a lookup is one copy per
// id plus zeros, an update touches that run only. Ids are grouped with the same stable
// radix sort as RowwiseAdagradApply, so duplicates are summed in input order and the
// result does not depend on the number of threads.

#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "embedding_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace tensorflow {
namespace tfhybrid {

using CPUDevice = Eigen::ThreadPoolDevice;

// Checks the offsets against the pool and the width; returns the row count.
inline Status CheckOffsets(const Tensor& offsets_t, int64 pool_rows, int64 chunk_dim, int64 dim,
                           int64* rows) {
  if (!TensorShapeUtils::IsVector(offsets_t.shape()) || offsets_t.NumElements() < 1) {
    return errors::InvalidArgument("row_offsets must be a non-empty vector, got ",
                                   offsets_t.shape().DebugString());
  }
  if (chunk_dim <= 0 || dim % chunk_dim != 0) {
    return errors::InvalidArgument("dim ", dim, " is not a multiple of the chunk width ",
                                   chunk_dim);
  }
  const int32* off = offsets_t.flat<int32>().data();
  *rows = offsets_t.NumElements() - 1;
  const int64 chunks = dim / chunk_dim;
  if (off[0] != 0 || off[*rows] > pool_rows) {
    return errors::InvalidArgument("row_offsets must start at 0 and end within the pool's ",
                                   pool_rows, " chunks");
  }
  for (int64 r = 0; r < *rows; ++r) {
    const int64 k = static_cast<int64>(off[r + 1]) - off[r];
    if (k < 0 || k > chunks) {
      return errors::InvalidArgument("row ", r, " holds ", k, " chunks, expected 0..", chunks);
    }
  }
  return OkStatus();
}

// Checks a lookup's pool ([S, chunk width]), row offsets and ids; returns the row count.
template <typename Tidx>
inline Status CheckLookup(const Tensor& pool_t, const Tensor& offsets_t, const Tidx* ids,
                          int64 n, int64 dim, const std::string& table_name, int64* rows) {
  if (pool_t.dims() != 2) {
    return errors::InvalidArgument("pool must be 2-D, got ", pool_t.shape().DebugString());
  }
  TF_RETURN_IF_ERROR(CheckOffsets(offsets_t, pool_t.dim_size(0), pool_t.dim_size(1), dim, rows));
  const int64 bad = FirstOutOfRange(ids, n, *rows);
  return bad < 0 ? OkStatus() : IdOutOfRangeError(table_name, ids, bad, *rows);
}

template <typename Tidx>
class ChunkedEmbeddingLookupOp : public OpKernel {
 public:
  explicit ChunkedEmbeddingLookupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& pool_t = ctx->input(0);
    const Tensor& ids_t = ctx->input(2);
    const int64 n = ids_t.NumElements();
    const Tidx* ids = ids_t.flat<Tidx>().data();
    int64 rows = 0;
    OP_REQUIRES_OK(ctx, CheckLookup(pool_t, ctx->input(1), ids, n, dim_, "chunked", &rows));
    const int64 cd = pool_t.dim_size(1);
    Tensor* out_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim_}), &out_t));
    float* out = out_t->flat<float>().data();
    const float* pool = pool_t.flat<float>().data();
    AdviseHugePages(pool, pool_t.TotalBytes());
    const int32* off = ctx->input(1).flat<int32>().data();
    const int64 dim = dim_;
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    workers->ParallelFor(n, 2 * dim * 4 + 150, [&](int64 begin, int64 end) {
      for (int64 p = begin; p < end; ++p) {
        const int64 r = static_cast<int64>(ids[p]);
        const int64 held = (static_cast<int64>(off[r + 1]) - off[r]) * cd;
        std::memcpy(out + p * dim, pool + static_cast<int64>(off[r]) * cd, held * sizeof(float));
        std::memset(out + p * dim + held, 0, (dim - held) * sizeof(float));
      }
    });
  }

 private:
  int64 dim_;
};

// Bags of ids summed through the pool: out[b] = sum of bag b's rows (each row's chunks,
// zeros past them), in id order. Its gradient does not depend on the storage: it is
// EmbeddingLookupCombineGrad's (tfhybrid/custom_ops/__init__.py).
template <typename Tidx>
class ChunkedEmbeddingLookupCombineOp : public OpKernel {
 public:
  explicit ChunkedEmbeddingLookupCombineOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &table_name_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<Var> v;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &v));
    {
      tf_shared_lock ml(*v->mu());
      OP_REQUIRES(ctx, v->tensor()->IsInitialized() && v->tensor()->dtype() == DT_FLOAT,
                  errors::InvalidArgument("embedding table '", table_name_,
                                          "': the pool must be an initialized float32 variable"));
    }
    // As ResourceGather: sparse access mode, then the pool is read in place under a
    // shared lock. No tensor of the pool outlives the op, so the optimizer's in-place
    // update later in the step never has to copy the pool.
    OP_REQUIRES_OK(ctx, EnsureSparseVariableAccess<CPUDevice, float>(ctx, v.get()));
    tf_shared_lock ml(*v->mu());
    const Tensor& pool_t = *v->tensor();
    const Tensor& ids_t = ctx->input(2);
    const Tensor& splits_t = ctx->input(3);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids_t.shape()) &&
                         TensorShapeUtils::IsVector(splits_t.shape()),
                errors::InvalidArgument("ids and row_splits must be 1-D"));
    const int64 n = ids_t.NumElements();
    const Tidx* ids = ids_t.flat<Tidx>().data();
    int64 rows = 0;
    OP_REQUIRES_OK(ctx, CheckLookup(pool_t, ctx->input(1), ids, n, dim_, table_name_, &rows));
    const int64 cd = pool_t.dim_size(1);
    const int64 num_splits = splits_t.NumElements();
    const int64* splits = splits_t.flat<int64>().data();
    OP_REQUIRES_OK(ctx, ValidateRowSplits(splits, num_splits, n, table_name_));
    const int64 bags = num_splits - 1;
    Combiner combiner = Combiner::kSum;
    const float* weights = nullptr;
    OP_REQUIRES_OK(ctx, ReadIdWeights(ctx->input(4), n, Combiner::kSum, table_name_, &combiner,
                                      &weights));
    Tensor* out_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({bags, dim_}), &out_t));
    float* out = out_t->flat<float>().data();
    if (bags == 0) return;
    const float* pool = pool_t.flat<float>().data();
    AdviseHugePages(pool, pool_t.TotalBytes());
    const int32* off = ctx->input(1).flat<int32>().data();
    const int64 dim = dim_;
    auto run = [&](int64 p) {  // the present run of id p's row
      const int64 r = static_cast<int64>(ids[p]);
      return std::make_pair(pool + static_cast<int64>(off[r]) * cd,
                            (static_cast<int64>(off[r + 1]) - off[r]) * cd);
    };
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64 avg_bag = std::max<int64>(1, n / bags);
    workers->ParallelFor(bags, avg_bag * (2 * dim * 4 + 150) + dim, [&](int64 begin, int64 end) {
      const int64 first = splits[begin], last = splits[end];
      for (int64 p = first; p < std::min(first + kPrefetchDistance, last); ++p) {
        const auto r = run(p);
        PrefetchRow(r.first, r.second * static_cast<int64>(sizeof(float)));
      }
      for (int64 b = begin; b < end; ++b) {
        float* o = out + b * dim;
        std::memset(o, 0, dim * sizeof(float));
        for (int64 p = splits[b]; p < splits[b + 1]; ++p) {
          if (p + kPrefetchDistance < last) {
            const auto ahead = run(p + kPrefetchDistance);
            PrefetchRow(ahead.first, ahead.second * static_cast<int64>(sizeof(float)));
          }
          const auto r = run(p);
          const float* src = r.first;
          if (weights == nullptr) {
            for (int64 d = 0; d < r.second; ++d) o[d] += src[d];
          } else {
            // the row times its weight, then the add: the dense kernels' rounding
            const float w = weights[p];
            for (int64 d = 0; d < r.second; ++d) o[d] += src[d] * w;
          }
        }
      }
    });
  }

 private:
  int64 dim_;
  std::string table_name_;
};

#include "sum_squares_impl.h"

// FIITED's row-wise AdaGrad, whatever holds the rows. Each distinct index i of
// [0, num_ids) gets its gradient rows summed in input order (g, [dim]); with h =
// layout.held(i) entries at layout.weights(i): accum[i] += SumSquares(those h entries of
// g) * (1/h), those entries step by -lr * g / (sqrt(accum[i] / scale) + eps), then weight decay.
// utility (utility_rows entries) decays everywhere, then utility[layout.utility_row(i)] +=
// utility_weight * |g|^2. A pool (ChunkedRowwiseAdagradApply) and a tiered table's cache
// (CachedChunkedRowwiseAdagradApply) differ only in the layout, so a row updates alike in
// both, bit for bit.
struct ChunkedApplyScalars {
  float lr, eps, scale, wd, utility_decay, utility_weight;
};

inline Status ReadChunkedApplyScalars(OpKernelContext* ctx, std::initializer_list<int> lr_eps_scale_wd,
                                      int utility_decay, int utility_weight,
                                      ChunkedApplyScalars* s) {
  std::vector<int> at(lr_eps_scale_wd);
  at.push_back(utility_decay);
  at.push_back(utility_weight);
  for (int i : at) {
    if (!TensorShapeUtils::IsScalar(ctx->input(i).shape())) {
      return errors::InvalidArgument("input ", i, " must be a scalar");
    }
  }
  s->lr = ctx->input(at[0]).scalar<float>()();
  s->eps = ctx->input(at[1]).scalar<float>()();
  s->scale = ctx->input(at[2]).scalar<float>()();
  s->wd = ctx->input(at[3]).scalar<float>()();
  s->utility_decay = ctx->input(utility_decay).scalar<float>()();
  s->utility_weight = ctx->input(utility_weight).scalar<float>()();
  return OkStatus();
}

template <typename Tidx, typename Layout>
void ApplyChunkedRowwise(OpKernelContext* ctx, const Tidx* indices, int64 n, int64 num_ids,
                         const float* grad, int64 dim, float* accum, float* utility,
                         int64 utility_rows, const Layout& layout,
                         const ChunkedApplyScalars& s) {
  ScratchHandle scratch;
  if (n > 0) GroupById(indices, n, num_ids, &*scratch);
  const Grouping& g = scratch->g;
  const int64 u_count = n > 0 ? g.num_unique() : 0;
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  // the utility's decay touches every row, in the same pass as nothing else: one
  // multiply per row (a rows-long TF op would read and write it three times)
  workers->ParallelFor(utility_rows, 2, [&](int64 begin, int64 end) {
    for (int64 r = begin; r < end; ++r) utility[r] *= s.utility_decay;
  });
  if (u_count == 0) return;
  const float decay = s.wd > 0.0f ? s.lr * s.wd : 0.0f;
  auto pos = [&](int64 k) -> int64 { return g.perm.empty() ? k : static_cast<int64>(g.perm[k]); };
  const int64 avg_seg = std::max<int64>(1, n / u_count);
  workers->ParallelFor(u_count, avg_seg * 3 * dim + 8 * dim + 300, [&](int64 begin, int64 end) {
    std::vector<float> acc(dim);
    for (int64 u = begin; u < end; ++u) {
      const int64 ks = g.seg_start[u], ke = g.seg_start[u + 1];
      std::memcpy(acc.data(), grad + pos(ks) * dim, dim * sizeof(float));
      for (int64 k = ks + 1; k < ke; ++k) {
        const float* row = grad + pos(k) * dim;
        for (int64 d = 0; d < dim; ++d) acc[d] += row[d];
      }
      const int64 i = g.unique_ids[u];
      const int64 held = layout.held(i);
      float squares = 0.0f;
      for (int64 d = 0; d < dim; ++d) squares += acc[d] * acc[d];
      // utility: the row's squared summed gradient, weighted (after the decay above)
      utility[layout.utility_row(i)] += s.utility_weight * squares;
      // the held entries' mean square as the dense kernel takes a row's (its lanes, then
      // a multiply by the reciprocal), so a row holding every entry updates bit for bit
      // like a dense table's
      const float v = accum[i] + (held > 0 ? SumSquares(acc.data(), held) *
                                                 (1.0f / static_cast<float>(held))
                                           : 0.0f);
      accum[i] = v;
      const float mult = s.lr / (std::sqrt(v / s.scale) + s.eps);
      float* w = layout.weights(i);
      for (int64 d = 0; d < held; ++d) {
        const float stepped = w[d] - mult * acc[d];
        w[d] = decay != 0.0f ? stepped - decay * stepped : stepped;
      }
    }
  });
}

// The update's variables, which must be float32: the rows' storage (input 0), their
// accumulators (input 1) and the table's utility (input `utility`).
inline Status CheckChunkedState(OpKernelContext* ctx, int utility) {
  for (int i : {0, 1, utility}) {
    core::RefCountPtr<Var> v;
    TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, i), &v));
    tf_shared_lock ml(*v->mu());
    if (v->tensor()->dtype() != DT_FLOAT) {
      return errors::InvalidArgument("input ", i, " (rows, accumulators, utility) must be a "
                                     "float32 variable");
    }
  }
  return OkStatus();
}

// Reads them, once the caller holds their locks (MaybeLockVariableInputMutexesInOrder).
inline Status ReadChunkedState(OpKernelContext* ctx, int utility, Tensor* rows_t,
                               Tensor* accum_t, Tensor* utility_t) {
  TF_RETURN_IF_ERROR(GetInputTensorFromVariable<CPUDevice, float>(ctx, 0, true, true, rows_t));
  TF_RETURN_IF_ERROR(
      GetInputTensorFromVariable<CPUDevice, float>(ctx, utility, true, true, utility_t));
  return GetInputTensorFromVariable<CPUDevice, float>(ctx, 1, true, true, accum_t);
}

// A pool: row r's entries are the flat pool from off[r] * cd, off[r + 1] - off[r] chunks.
struct PoolLayout {
  float* pool;
  const int32* off;
  int64 cd;
  float* weights(int64 r) const { return pool + static_cast<int64>(off[r]) * cd; }
  int64 held(int64 r) const { return (static_cast<int64>(off[r + 1]) - off[r]) * cd; }
  int64 utility_row(int64 r) const { return r; }
};

template <typename Tidx>
class ChunkedRowwiseAdagradApplyOp : public OpKernel {
 public:
  explicit ChunkedRowwiseAdagradApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    // the variables: pool, accum and utility
    const int kUtility = 9;
    OP_REQUIRES_OK(ctx, CheckChunkedState(ctx, kUtility));
    auto locks = MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
        ctx, /*do_lock=*/true, /*sparse=*/true, {0, 1, kUtility});
    Tensor pool_t, accum_t, utility_t;
    OP_REQUIRES_OK(ctx, ReadChunkedState(ctx, kUtility, &pool_t, &accum_t, &utility_t));
    OP_REQUIRES(ctx, pool_t.dims() == 2,
                errors::InvalidArgument("pool must be 2-D, got ", pool_t.shape().DebugString()));
    const Tensor& grad_t = ctx->input(4);
    const Tensor& indices_t = ctx->input(3);
    OP_REQUIRES(ctx, grad_t.dims() == 2 && grad_t.dim_size(0) == indices_t.NumElements(),
                errors::InvalidArgument("grad must be [N, dim] for N indices, got ",
                                        grad_t.shape().DebugString()));
    const int64 cd = pool_t.dim_size(1);
    const int64 dim = grad_t.dim_size(1);
    int64 rows = 0;
    OP_REQUIRES_OK(ctx, CheckOffsets(ctx->input(2), pool_t.dim_size(0), cd, dim, &rows));
    OP_REQUIRES(ctx, accum_t.NumElements() == rows && utility_t.NumElements() == rows,
                errors::InvalidArgument("accum and utility must have ", rows, " entries, got ",
                                        accum_t.NumElements(), " and ",
                                        utility_t.NumElements()));
    ChunkedApplyScalars s;
    OP_REQUIRES_OK(ctx, ReadChunkedApplyScalars(ctx, {5, 6, 7, 8}, 10, 11, &s));
    const int64 n = indices_t.NumElements();
    OP_REQUIRES(ctx, n < (int64{1} << 32), errors::InvalidArgument("too many indices: ", n));
    const Tidx* indices = indices_t.flat<Tidx>().data();
    const int64 bad = FirstOutOfRange(indices, n, rows);
    OP_REQUIRES(ctx, bad < 0, IdOutOfRangeError("chunked", indices, bad, rows));
    float* pool = pool_t.flat<float>().data();
    AdviseHugePages(pool, pool_t.TotalBytes());
    const PoolLayout layout{pool, ctx->input(2).flat<int32>().data(), cd};
    ApplyChunkedRowwise(ctx, indices, n, rows, grad_t.flat<float>().data(), dim,
                        accum_t.flat<float>().data(), utility_t.flat<float>().data(), rows,
                        layout, s);
  }
};

// A tiered table's cache ([slots, dim]): slot i holds row slot_rows[i] with
// slot_chunks[i] chunks of cd entries; the entries past them are zeros that stay zeros.
struct CacheLayout {
  float* cache;
  const int32* slot_chunks;
  const int64* slot_rows;
  int64 dim, cd;
  float* weights(int64 i) const { return cache + i * dim; }
  int64 held(int64 i) const { return static_cast<int64>(slot_chunks[i]) * cd; }
  int64 utility_row(int64 i) const { return slot_rows[i]; }
};

template <typename Tidx>
class CachedChunkedRowwiseAdagradApplyOp : public OpKernel {
 public:
  explicit CachedChunkedRowwiseAdagradApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk_dim", &cd_));
  }

  void Compute(OpKernelContext* ctx) override {
    // the variables: cache, its accumulator and the table's utility
    const int kUtility = 10;
    OP_REQUIRES_OK(ctx, CheckChunkedState(ctx, kUtility));
    auto locks = MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
        ctx, /*do_lock=*/true, /*sparse=*/true, {0, 1, kUtility});
    Tensor cache_t, accum_t, utility_t;
    OP_REQUIRES_OK(ctx, ReadChunkedState(ctx, kUtility, &cache_t, &accum_t, &utility_t));
    const Tensor& chunks_t = ctx->input(2);
    const Tensor& rows_t = ctx->input(3);
    const Tensor& indices_t = ctx->input(4);
    const Tensor& grad_t = ctx->input(5);
    OP_REQUIRES(ctx, cache_t.dims() == 2 && grad_t.dims() == 2 &&
                         grad_t.dim_size(1) == cache_t.dim_size(1) &&
                         grad_t.dim_size(0) == indices_t.NumElements(),
                errors::InvalidArgument("cache must be [slots, dim] and grad [N, dim] for N "
                                        "indices, got ", cache_t.shape().DebugString(), " and ",
                                        grad_t.shape().DebugString()));
    const int64 slots = cache_t.dim_size(0), dim = cache_t.dim_size(1);
    OP_REQUIRES(ctx, cd_ > 0 && dim % cd_ == 0,
                errors::InvalidArgument("dim ", dim, " is not a multiple of chunk_dim ", cd_));
    OP_REQUIRES(ctx, accum_t.NumElements() == slots && chunks_t.NumElements() == slots &&
                         rows_t.NumElements() == slots,
                errors::InvalidArgument("accum, slot_chunks and slot_rows must have one entry "
                                        "per cache slot (", slots, ")"));
    const int32* slot_chunks = chunks_t.flat<int32>().data();
    const int64* slot_rows = rows_t.flat<int64>().data();
    const int64 utility_rows = utility_t.NumElements();
    const int64 n = indices_t.NumElements();
    OP_REQUIRES(ctx, n < (int64{1} << 32), errors::InvalidArgument("too many indices: ", n));
    const Tidx* indices = indices_t.flat<Tidx>().data();
    const int64 bad = FirstOutOfRange(indices, n, slots);
    OP_REQUIRES(ctx, bad < 0, IdOutOfRangeError("cache", indices, bad, slots));
    for (int64 p = 0; p < n; ++p) {   // only the slots named: the others may be unfilled
      const int64 i = static_cast<int64>(indices[p]);
      OP_REQUIRES(ctx, slot_rows[i] >= 0 && slot_rows[i] < utility_rows &&
                           slot_chunks[i] >= 0 && slot_chunks[i] * cd_ <= dim,
                  errors::InvalidArgument("cache slot ", i, " holds row ", slot_rows[i], " with ",
                                          slot_chunks[i], " chunks; expected a row in [0, ",
                                          utility_rows, ") and at most ", dim / cd_, " chunks"));
    }
    ChunkedApplyScalars s;
    OP_REQUIRES_OK(ctx, ReadChunkedApplyScalars(ctx, {6, 7, 8, 9}, 11, 12, &s));
    const CacheLayout layout{cache_t.flat<float>().data(), slot_chunks, slot_rows, dim, cd_};
    ApplyChunkedRowwise(ctx, indices, n, slots, grad_t.flat<float>().data(), dim,
                        accum_t.flat<float>().data(), utility_t.flat<float>().data(),
                        utility_rows, layout, s);
  }

 private:
  int64 cd_;
};

#define TFHYBRID_REGISTER_CHUNKED(Tidx)                                                \
  REGISTER_KERNEL_BUILDER(                                                             \
      Name("ChunkedEmbeddingLookup").Device(DEVICE_CPU).TypeConstraint<Tidx>("Tindices"), \
      ChunkedEmbeddingLookupOp<Tidx>);                                                 \
  REGISTER_KERNEL_BUILDER(Name("ChunkedEmbeddingLookupCombine")                        \
                              .Device(DEVICE_CPU)                                      \
                              .TypeConstraint<Tidx>("Tindices"),                       \
                          ChunkedEmbeddingLookupCombineOp<Tidx>);                      \
  REGISTER_KERNEL_BUILDER(Name("ChunkedRowwiseAdagradApply")                           \
                              .Device(DEVICE_CPU)                                      \
                              .HostMemory("lr")                                        \
                              .HostMemory("epsilon")                                   \
                              .HostMemory("scale")                                     \
                              .HostMemory("weight_decay")                              \
                              .HostMemory("utility_decay")                             \
                              .HostMemory("utility_weight")                            \
                              .TypeConstraint<Tidx>("Tindices"),                       \
                          ChunkedRowwiseAdagradApplyOp<Tidx>);                        \
  REGISTER_KERNEL_BUILDER(Name("CachedChunkedRowwiseAdagradApply")                     \
                              .Device(DEVICE_CPU)                                      \
                              .HostMemory("slot_chunks")                               \
                              .HostMemory("slot_rows")                                 \
                              .HostMemory("lr")                                        \
                              .HostMemory("epsilon")                                   \
                              .HostMemory("scale")                                     \
                              .HostMemory("weight_decay")                              \
                              .HostMemory("utility_decay")                             \
                              .HostMemory("utility_weight")                            \
                              .TypeConstraint<Tidx>("Tindices"),                       \
                          CachedChunkedRowwiseAdagradApplyOp<Tidx>);

TFHYBRID_REGISTER_CHUNKED(int32)
TFHYBRID_REGISTER_CHUNKED(int64_t)

#undef TFHYBRID_REGISTER_CHUNKED

}  // namespace tfhybrid
}  // namespace tensorflow
