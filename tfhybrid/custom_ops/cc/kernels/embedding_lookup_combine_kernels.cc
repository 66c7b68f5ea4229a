// CPU kernels: EmbeddingLookupCombine, ResourceEmbeddingLookupCombine and
// EmbeddingLookupCombineGrad.
//
// Forward: bags are processed in parallel on TF's intra-op pool; each bag is summed
// by one thread in id order (float32 accumulation), so the output is deterministic.
// Backward: positions are grouped by id with a stable radix sort; each unique id's
// gradient row is summed by one thread in position order (deterministic).
// The row loops of both run at this process's dispatch level (isa_kernels.h), with the
// same results at every level.

#define EIGEN_USE_THREADS

#include <algorithm>
#include <string>
#include <vector>

#include "embedding_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace tensorflow {
namespace tfhybrid {

using CPUDevice = Eigen::ThreadPoolDevice;

template <typename T, typename Tidx, typename Tsplits>
void LookupCombineCompute(OpKernelContext* ctx, const Tensor& params, const std::string& table_name,
                          Combiner combiner) {
  KernelIsa isa;
  OP_REQUIRES_OK(ctx, GetKernelIsa(&isa));
  const Tensor& ids_t = ctx->input(1);
  const Tensor& splits_t = ctx->input(2);
  OP_REQUIRES(ctx, params.dims() == 2,
              errors::InvalidArgument("embedding table '", table_name,
                                      "': params must be 2-D, got shape ",
                                      params.shape().DebugString()));
  OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids_t.shape()),
              errors::InvalidArgument("embedding table '", table_name, "': ids must be 1-D, got ",
                                      ids_t.shape().DebugString()));
  OP_REQUIRES(ctx, TensorShapeUtils::IsVector(splits_t.shape()),
              errors::InvalidArgument("embedding table '", table_name,
                                      "': row_splits must be 1-D, got ",
                                      splits_t.shape().DebugString()));
  const int64 R = params.dim_size(0);
  const int64 D = params.dim_size(1);
  const int64 nnz = ids_t.NumElements();
  const Tidx* ids = ids_t.flat<Tidx>().data();
  const T* table = params.flat<T>().data();

  const int64 bad = FirstOutOfRange(ids, nnz, R);
  OP_REQUIRES(ctx, bad < 0, IdOutOfRangeError(table_name, ids, bad, R));
  AdviseHugePages(table, static_cast<size_t>(R * D) * sizeof(T));

  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  // Per-row cost in "cycles": D adds plus a likely cache miss on a random row.
  const int64 row_cost = 2 * D * static_cast<int64>(sizeof(T)) + 150;

  if (combiner == Combiner::kNone) {
    Tensor* out_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nnz, D}), &out_t));
    T* out = out_t->flat<T>().data();
    const int64 row_bytes = D * static_cast<int64>(sizeof(T));
    workers->ParallelFor(nnz, row_cost, [&](int64 begin, int64 end) {
      for (int64 p = begin; p < std::min(begin + kPrefetchDistance, end); ++p)
        PrefetchRow(table + static_cast<int64>(ids[p]) * D, row_bytes);
      for (int64 p = begin; p < end; ++p) {
        if (p + kPrefetchDistance < end) {
          PrefetchRow(table + static_cast<int64>(ids[p + kPrefetchDistance]) * D, row_bytes);
        }
        std::memcpy(out + p * D, table + static_cast<int64>(ids[p]) * D, row_bytes);
      }
    });
    return;
  }

  const int64 num_splits = splits_t.NumElements();
  const Tsplits* splits = splits_t.flat<Tsplits>().data();
  OP_REQUIRES_OK(ctx, ValidateRowSplits(splits, num_splits, nnz, table_name));
  const int64 B = num_splits - 1;
  Tensor* out_t = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({B, D}), &out_t));
  T* out = out_t->flat<T>().data();
  if (B == 0 || D == 0) return;
  const int64 avg_bag = std::max<int64>(1, nnz / B);
  const LookupCombineArgs<T, Tidx, Tsplits> args{table, D, ids, splits,
                                                 combiner == Combiner::kMean, out};
  const auto kernel = LookupCombineKernel<T, Tidx, Tsplits>(isa);
  workers->ParallelFor(B, avg_bag * row_cost + D, [&](int64 begin, int64 end) {
    std::vector<float> row_buf;
    if (!std::is_same<T, float>::value) row_buf.resize(D);
    kernel(args, begin, end, row_buf.data());
  });
}

template <typename T, typename Tidx, typename Tsplits>
class EmbeddingLookupCombineOp : public OpKernel {
 public:
  explicit EmbeddingLookupCombineOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadLookupAttrs(ctx, &combiner_, &table_name_));
  }

  void Compute(OpKernelContext* ctx) override {
    LookupCombineCompute<T, Tidx, Tsplits>(ctx, ctx->input(0), table_name_, combiner_);
  }

 private:
  Combiner combiner_;
  std::string table_name_;
};

template <typename T, typename Tidx, typename Tsplits>
class ResourceEmbeddingLookupCombineOp : public OpKernel {
 public:
  explicit ResourceEmbeddingLookupCombineOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadLookupAttrs(ctx, &combiner_, &table_name_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<Var> v;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &v));
    {
      tf_shared_lock ml(*v->mu());
      OP_REQUIRES(ctx, v->tensor()->IsInitialized(),
                  errors::FailedPrecondition("embedding table '", table_name_,
                                             "': variable is not initialized"));
      OP_REQUIRES(ctx, v->tensor()->dtype() == DataTypeToEnum<T>::value,
                  errors::InvalidArgument("embedding table '", table_name_, "': variable dtype ",
                                          DataTypeString(v->tensor()->dtype()),
                                          " does not match ",
                                          DataTypeString(DataTypeToEnum<T>::value)));
    }
    // Same protocol as ResourceGather: sparse access mode, then read the buffer in
    // place under a shared lock (no copy of the table).
    OP_REQUIRES_OK(ctx, EnsureSparseVariableAccess<CPUDevice, T>(ctx, v.get()));
    tf_shared_lock ml(*v->mu());
    const Tensor& params = *v->tensor();
    LookupCombineCompute<T, Tidx, Tsplits>(ctx, params, table_name_, combiner_);
  }

 private:
  Combiner combiner_;
  std::string table_name_;
};

template <typename T, typename Tidx, typename Tsplits>
class EmbeddingLookupCombineGradOp : public OpKernel {
 public:
  explicit EmbeddingLookupCombineGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadLookupAttrs(ctx, &combiner_, &table_name_));
  }

  void Compute(OpKernelContext* ctx) override {
    KernelIsa isa;
    OP_REQUIRES_OK(ctx, GetKernelIsa(&isa));
    const Tensor& grad_t = ctx->input(0);
    const Tensor& ids_t = ctx->input(1);
    const Tensor& splits_t = ctx->input(2);
    const Tensor& num_rows_t = ctx->input(3);
    OP_REQUIRES(ctx, grad_t.dims() == 2,
                errors::InvalidArgument("grad must be 2-D, got ", grad_t.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids_t.shape()),
                errors::InvalidArgument("ids must be 1-D"));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(num_rows_t.shape()),
                errors::InvalidArgument("num_rows must be a scalar"));
    const int64 R = num_rows_t.scalar<int64_t>()();
    const int64 nnz = ids_t.NumElements();
    const int64 D = grad_t.dim_size(1);
    const Tidx* ids = ids_t.flat<Tidx>().data();
    const T* grad = grad_t.flat<T>().data();
    OP_REQUIRES(ctx, nnz < (int64{1} << 32),
                errors::InvalidArgument("too many ids in one call: ", nnz));

    const int64 bad = FirstOutOfRange(ids, nnz, R);
    OP_REQUIRES(ctx, bad < 0, IdOutOfRangeError(table_name_, ids, bad, R));

    ScratchHandle scratch;
    OP_REQUIRES_OK(ctx, MapPositionsToGradRows<Tsplits>(combiner_, splits_t, nnz,
                                                        grad_t.dim_size(0), table_name_,
                                                        &*scratch));
    GroupById(ids, nnz, R, &*scratch);
    const Grouping& g = scratch->g;
    const int64 U = g.num_unique();

    Tensor* uniq_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({U}), &uniq_t));
    Tidx* uniq = uniq_t->flat<Tidx>().data();
    for (int64 u = 0; u < U; ++u) uniq[u] = static_cast<Tidx>(g.unique_ids[u]);
    Tensor rows_t;
    OP_REQUIRES_OK(ctx, rows_out_.Get(ctx, DataTypeToEnum<T>::value, U, D, &rows_t));
    ctx->set_output(1, rows_t);
    T* rows = rows_t.flat<T>().data();
    if (U == 0 || D == 0) return;

    const int64 avg_seg = std::max<int64>(1, nnz / U);
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64 cost = avg_seg * (3 * D + 20) + 2 * D;
    // Rows are summed in a small buffer and then written with streaming stores when
    // possible: the [U, D] output is several MB per table and is read only later by
    // the optimizer, so write-allocating it into the cache costs an extra memory read.
    const GradSegmentsArgs<T> args{
        combiner_, g.perm.empty() ? nullptr : g.perm.data(), g.seg_start.data(),
        scratch->sample_of.data(), scratch->inv_count.data(), grad, D, rows,
        std::is_same<T, float>::value && StreamableRows(rows, D * sizeof(float))};
    const auto kernel = GradSegmentsKernel<T>(isa);
    workers->ParallelFor(U, cost, [&](int64 begin, int64 end) {
      std::vector<float> row_buf(D);
      kernel(args, begin, end, row_buf.data());
    });
  }

 private:
  Combiner combiner_;
  std::string table_name_;
  ReusableOutput rows_out_;
};

#define TFHYBRID_REGISTER_LOOKUP(T, Tidx, Tsplits)                                       \
  REGISTER_KERNEL_BUILDER(Name("EmbeddingLookupCombine")                                 \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tidx>("Tindices")                          \
                              .TypeConstraint<Tsplits>("Tsplits"),                       \
                          EmbeddingLookupCombineOp<T, Tidx, Tsplits>);                   \
  REGISTER_KERNEL_BUILDER(Name("ResourceEmbeddingLookupCombine")                         \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("dtype")                                \
                              .TypeConstraint<Tidx>("Tindices")                          \
                              .TypeConstraint<Tsplits>("Tsplits"),                       \
                          ResourceEmbeddingLookupCombineOp<T, Tidx, Tsplits>);           \
  REGISTER_KERNEL_BUILDER(Name("EmbeddingLookupCombineGrad")                             \
                              .Device(DEVICE_CPU)                                        \
                              .HostMemory("num_rows")                                    \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tidx>("Tindices")                          \
                              .TypeConstraint<Tsplits>("Tsplits"),                       \
                          EmbeddingLookupCombineGradOp<T, Tidx, Tsplits>);

#define TFHYBRID_REGISTER_LOOKUP_T(T)            \
  TFHYBRID_REGISTER_LOOKUP(T, int32, int32)      \
  TFHYBRID_REGISTER_LOOKUP(T, int32, int64_t)    \
  TFHYBRID_REGISTER_LOOKUP(T, int64_t, int32)    \
  TFHYBRID_REGISTER_LOOKUP(T, int64_t, int64_t)

TFHYBRID_REGISTER_LOOKUP_T(float)
TFHYBRID_REGISTER_LOOKUP_T(Eigen::half)
TFHYBRID_REGISTER_LOOKUP_T(bfloat16)

#undef TFHYBRID_REGISTER_LOOKUP_T
#undef TFHYBRID_REGISTER_LOOKUP

}  // namespace tfhybrid
}  // namespace tensorflow
