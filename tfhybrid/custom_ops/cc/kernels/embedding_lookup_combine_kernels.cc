// CPU kernels: EmbeddingLookupCombine, ResourceEmbeddingLookupCombine,
// ResourceEmbeddingLookupCombineConcat and EmbeddingLookupCombineGrad.
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
#include <memory>
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

// The checks of a lookup's inputs: params [R, D], ids [nnz] in [0, R) and, when bags
// are combined, row_splits [B + 1] valid for nnz ids.
template <typename T, typename Tidx, typename Tsplits>
Status CheckLookupInputs(const Tensor& params, const Tensor& ids_t, const Tensor& splits_t,
                         bool combined, const std::string& table_name) {
  if (params.dims() != 2) {
    return errors::InvalidArgument("embedding table '", table_name,
                                   "': params must be 2-D, got shape ",
                                   params.shape().DebugString());
  }
  if (!TensorShapeUtils::IsVector(ids_t.shape())) {
    return errors::InvalidArgument("embedding table '", table_name, "': ids must be 1-D, got ",
                                   ids_t.shape().DebugString());
  }
  if (!TensorShapeUtils::IsVector(splits_t.shape())) {
    return errors::InvalidArgument("embedding table '", table_name,
                                   "': row_splits must be 1-D, got ",
                                   splits_t.shape().DebugString());
  }
  const int64 R = params.dim_size(0);
  const int64 nnz = ids_t.NumElements();
  const Tidx* ids = ids_t.flat<Tidx>().data();
  const int64 bad = FirstOutOfRange(ids, nnz, R);
  if (bad >= 0) return IdOutOfRangeError(table_name, ids, bad, R);
  if (!combined) return OkStatus();
  return ValidateRowSplits(splits_t.flat<Tsplits>().data(), splits_t.NumElements(), nnz,
                           table_name);
}

// A table variable that a lookup may read: initialized, of dtype T.
template <typename T>
Status CheckTableVariable(Var* v, const std::string& table_name) {
  tf_shared_lock ml(*v->mu());
  if (!v->tensor()->IsInitialized()) {
    return errors::FailedPrecondition("embedding table '", table_name,
                                      "': variable is not initialized");
  }
  if (v->tensor()->dtype() != DataTypeToEnum<T>::value) {
    return errors::InvalidArgument("embedding table '", table_name, "': variable dtype ",
                                   DataTypeString(v->tensor()->dtype()), " does not match ",
                                   DataTypeString(DataTypeToEnum<T>::value));
  }
  return OkStatus();
}

template <typename T, typename Tidx, typename Tsplits>
void LookupCombineCompute(OpKernelContext* ctx, const Tensor& params, const std::string& table_name,
                          Combiner combiner) {
  KernelIsa isa;
  OP_REQUIRES_OK(ctx, GetKernelIsa(&isa));
  const Tensor& ids_t = ctx->input(1);
  const Tensor& splits_t = ctx->input(2);
  OP_REQUIRES_OK(ctx, (CheckLookupInputs<T, Tidx, Tsplits>(
                          params, ids_t, splits_t, combiner != Combiner::kNone, table_name)));
  const int64 R = params.dim_size(0);
  const int64 D = params.dim_size(1);
  const int64 nnz = ids_t.NumElements();
  const float* weights = nullptr;
  Combiner run = combiner;
  OP_REQUIRES_OK(ctx, ReadIdWeights(ctx->input(3), nnz, combiner, table_name, &run, &weights));
  (void)run;  // the forward needs only the weights
  const Tidx* ids = ids_t.flat<Tidx>().data();
  const T* table = params.flat<T>().data();
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
  const int64 B = num_splits - 1;
  Tensor* out_t = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({B, D}), &out_t));
  T* out = out_t->flat<T>().data();
  if (B == 0 || D == 0) return;
  const int64 avg_bag = std::max<int64>(1, nnz / B);
  const LookupCombineArgs<T, Tidx, Tsplits> args{
      table, D, ids, splits, combiner == Combiner::kMean, out, D, weights};
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
    OP_REQUIRES_OK(ctx, CheckTableVariable<T>(v.get(), table_name_));
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

// Bags per block in ResourceEmbeddingLookupCombineConcat: 64 rows of the output stay in
// L2 while each table writes its columns of them.
constexpr int64 kBagBlock = 64;

// Several tables' bags side by side in one [B, sum of widths] output, like FBGEMM's
// table-batched bags: one op reads every table in place and writes each bag straight
// into its columns, so no per-table output is concatenated afterwards. The bags of all
// tables share one ParallelFor over blocks of kBagBlock bags, each table in turn.
template <typename T, typename Tidx, typename Tsplits>
class ResourceEmbeddingLookupCombineConcatOp : public OpKernel {
 public:
  explicit ResourceEmbeddingLookupCombineConcatOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string combiner;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("combiner", &combiner));
    OP_REQUIRES(ctx, combiner == "sum" || combiner == "mean",
                errors::InvalidArgument("combiner must be 'sum' or 'mean', got '", combiner,
                                        "'"));
    mean_ = combiner == "mean";
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_names", &table_names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &num_tables_));
    OP_REQUIRES(ctx, static_cast<int>(table_names_.size()) == num_tables_,
                errors::InvalidArgument("table_names has ", table_names_.size(),
                                        " names, expected one per table (", num_tables_, ")"));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("widths", &widths_));
    OP_REQUIRES(ctx, static_cast<int>(widths_.size()) == num_tables_,
                errors::InvalidArgument("widths has ", widths_.size(),
                                        " values, expected one per table (", num_tables_, ")"));
  }

  void Compute(OpKernelContext* ctx) override {
    KernelIsa isa;
    OP_REQUIRES_OK(ctx, GetKernelIsa(&isa));
    const int N = num_tables_;
    OpInputList ids_list, splits_list;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids_list));
    OP_REQUIRES_OK(ctx, ctx->input_list("row_splits", &splits_list));
    std::vector<core::RefCountPtr<Var>> vars(N);
    for (int t = 0; t < N; ++t) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, t), &vars[t]));
      OP_REQUIRES_OK(ctx, CheckTableVariable<T>(vars[t].get(), table_names_[t]));
    }
    // As in ResourceEmbeddingLookupCombine: sparse access mode first (it may take the
    // exclusive lock), then each distinct variable under one shared lock, in address
    // order like TF's multi-variable kernels (a table passed twice is locked once: a
    // second shared lock could wait behind a queued writer).
    std::vector<Var*> distinct;
    for (int t = 0; t < N; ++t) {
      OP_REQUIRES_OK(ctx, EnsureSparseVariableAccess<CPUDevice, T>(ctx, vars[t].get()));
      distinct.push_back(vars[t].get());
    }
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    std::vector<std::unique_ptr<tf_shared_lock>> locks;
    for (Var* v : distinct) locks.push_back(std::make_unique<tf_shared_lock>(*v->mu()));

    std::vector<LookupCombineArgs<T, Tidx, Tsplits>> args(N);
    std::vector<int64> first_column(N);
    int64 B = -1, width = 0, nnz_total = 0;
    for (int t = 0; t < N; ++t) {
      const Tensor& params = *vars[t]->tensor();
      const std::string& name = table_names_[t];
      OP_REQUIRES_OK(ctx, (CheckLookupInputs<T, Tidx, Tsplits>(params, ids_list[t],
                                                               splits_list[t], true, name)));
      const int64 nnz = ids_list[t].NumElements();
      const Tidx* ids = ids_list[t].flat<Tidx>().data();
      const int64 num_splits = splits_list[t].NumElements();
      const Tsplits* splits = splits_list[t].flat<Tsplits>().data();
      OP_REQUIRES(ctx, B < 0 || num_splits - 1 == B,
                  errors::InvalidArgument("embedding table '", name, "' has ", num_splits - 1,
                                          " bags, expected ", B, " (the first table's)"));
      OP_REQUIRES(ctx, params.dim_size(1) == widths_[t],
                  errors::InvalidArgument("embedding table '", name, "' has ",
                                          params.dim_size(1), " columns, expected ",
                                          widths_[t], " (the op's widths)"));
      B = num_splits - 1;
      const T* table = params.flat<T>().data();
      AdviseHugePages(table, static_cast<size_t>(params.NumElements()) * sizeof(T));
      args[t] = {table, params.dim_size(1), ids, splits, mean_, nullptr, 0};  // out: below
      first_column[t] = width;
      width += params.dim_size(1);
      nnz_total += nnz;
    }
    Tensor* out_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({B, width}), &out_t));
    T* out = out_t->flat<T>().data();
    for (int t = 0; t < N; ++t) {
      args[t].out = out + first_column[t];
      args[t].out_stride = width;
    }
    if (B == 0 || width == 0) return;
    // One item is one bag of every table: as in LookupCombineCompute, D adds per row
    // plus a likely cache miss, at the tables' average bag size.
    const int64 avg_bag = std::max<int64>(1, nnz_total / (N * B));
    const int64 cost = N * avg_bag * 150 + avg_bag * width * 2 * static_cast<int64>(sizeof(T));
    const auto kernel = LookupCombineKernel<T, Tidx, Tsplits>(isa);
    int64 max_d = 0;
    for (const auto& a : args) max_d = std::max(max_d, a.D);
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    workers->ParallelFor(B, cost, [&](int64 begin, int64 end) {
      std::vector<float> row_buf;
      if (!std::is_same<T, float>::value) row_buf.resize(max_d);
      for (int64 b = begin; b < end; b += kBagBlock) {
        const int64 stop = std::min(end, b + kBagBlock);
        for (int t = 0; t < N; ++t) {
          if (args[t].D > 0) kernel(args[t], b, stop, row_buf.data());
        }
      }
    });
  }

 private:
  bool mean_;
  int num_tables_;
  std::vector<std::string> table_names_;
  std::vector<int64_t> widths_;
};

template <typename T, typename Tidx, typename Tsplits>
class EmbeddingLookupCombineGradOp : public OpKernel {
 public:
  explicit EmbeddingLookupCombineGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadLookupAttrs(ctx, &combiner_, &table_name_));
    OP_REQUIRES_OK(ctx, ReadGradColumns(ctx, &grad_columns_));
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
    int64 first_column = 0, D = 0;
    OP_REQUIRES_OK(ctx, GradWindow(grad_columns_, grad_t.dim_size(1), table_name_,
                                   &first_column, &D));
    const Tidx* ids = ids_t.flat<Tidx>().data();
    const T* grad = grad_t.flat<T>().data() + first_column;
    OP_REQUIRES(ctx, nnz < (int64{1} << 32),
                errors::InvalidArgument("too many ids in one call: ", nnz));

    const int64 bad = FirstOutOfRange(ids, nnz, R);
    OP_REQUIRES(ctx, bad < 0, IdOutOfRangeError(table_name_, ids, bad, R));

    Combiner combiner = combiner_;
    const float* weights = nullptr;
    OP_REQUIRES_OK(ctx, ReadIdWeights(ctx->input(4), nnz, combiner_, table_name_, &combiner,
                                      &weights));
    ScratchHandle scratch;
    OP_REQUIRES_OK(ctx, MapPositionsToGradRows<Tsplits>(combiner, splits_t, nnz,
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
    // Rows are summed (in registers at the AVX levels, stored to a small buffer) and
    // then written with streaming stores when possible: the [U, D] output is several MB
    // per table and is read only later by the optimizer, so write-allocating it into the
    // cache costs an extra memory read.
    const GradSegmentsArgs<T> args{
        combiner, g.perm.empty() ? nullptr : g.perm.data(), g.seg_start.data(),
        scratch->sample_of.data(), scratch->inv_count.data(), grad, D, grad_t.dim_size(1),
        rows,
        std::is_same<T, float>::value && StreamableRows(rows, D * sizeof(float)), weights};
    const auto kernel = GradSegmentsKernel<T>(isa);
    workers->ParallelFor(U, cost, [&](int64 begin, int64 end) {
      std::vector<float> row_buf(D);
      kernel(args, begin, end, row_buf.data());
    });
  }

 private:
  Combiner combiner_;
  std::string table_name_;
  std::vector<int64> grad_columns_;
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
  REGISTER_KERNEL_BUILDER(Name("ResourceEmbeddingLookupCombineConcat")                   \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("dtype")                                \
                              .TypeConstraint<Tidx>("Tindices")                          \
                              .TypeConstraint<Tsplits>("Tsplits"),                       \
                          ResourceEmbeddingLookupCombineConcatOp<T, Tidx, Tsplits>);     \
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
