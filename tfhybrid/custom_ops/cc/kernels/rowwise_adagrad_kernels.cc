// CPU kernels: RowwiseAdagradApply and EmbeddingLookupCombineGradRowwiseAdagrad (FBGEMM
// EXACT_ROWWISE_ADAGRAD semantics).
//
// Duplicate indices are grouped with a stable radix sort (positions in input order
// within each row); every unique row is then finished by a single thread:
//   g      = sum of its gradient rows (float32, input order)
//   v     += mean_j(g_j^2)
//   w     -= (lr / (sqrt(v / scale) + epsilon)) * g
//   if weight_decay > 0: w -= (lr * weight_decay) * w      (decoupled, after the step)
// The update is in place on the variables' buffers, under their exclusive locks
// (same protocol as TF's ResourceSparseApply* kernels). Results are bitwise
// independent of the number of threads and of the dispatch level of the row loop
// (isa_kernels.h).
//
// EmbeddingLookupCombineGradRowwiseAdagrad is EmbeddingLookupCombineGrad followed by
// RowwiseAdagradApply in one pass: each unique row's gradient is summed from the bags'
// upstream gradient straight into the update, bitwise as the two ops give it, without
// writing the [U, D] gradient rows out and reading them back, and with the summation's
// work overlapping the misses on the table's random rows.

#define EIGEN_USE_THREADS

#include <string>
#include <vector>

#include "embedding_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/platform/strcat.h"

namespace tensorflow {
namespace tfhybrid {

using CPUDevice = Eigen::ThreadPoolDevice;

// What a row-wise AdaGrad kernel updates: var (input 0) and accum (input 1), and the
// scalars lr, epsilon, scale, weight_decay (inputs first_scalar .. first_scalar + 3).
struct RowwiseState {
  Tensor var, accum;
  float lr, eps, scale, weight_decay;
};

// Checks var / accum / the scalars and runs update(state) under the variables'
// exclusive locks (address order), in sparse access mode on the buffers themselves (no
// copy unless a concurrent reader holds the buffer).
template <typename Update>
void UpdateLockedRowwiseState(OpKernelContext* ctx, const char* op, int first_scalar,
                              Update update) {
  // Check dtypes first: the locking helpers below are instantiated for float.
  for (int i = 0; i < 2; ++i) {
    core::RefCountPtr<Var> v;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, i), &v));
    tf_shared_lock ml(*v->mu());
    OP_REQUIRES(ctx, v->tensor()->dtype() == DT_FLOAT,
                errors::InvalidArgument(op, ": ", i == 0 ? "var" : "accum",
                                        " must be float32, got ",
                                        DataTypeString(v->tensor()->dtype())));
  }
  for (int i = first_scalar; i < first_scalar + 4; ++i) {
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(ctx->input(i).shape()),
                errors::InvalidArgument(op, ": input ", i, " must be a scalar"));
  }
  auto locks = MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
      ctx, /*do_lock=*/true, /*sparse=*/true, {0, 1});
  RowwiseState state;
  OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, float>(
                          ctx, 0, /*lock_held=*/true, /*sparse=*/true, &state.var));
  OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, float>(
                          ctx, 1, /*lock_held=*/true, /*sparse=*/true, &state.accum));
  OP_REQUIRES(ctx, state.var.IsInitialized() && state.accum.IsInitialized(),
              errors::FailedPrecondition(op, ": var or accum is not initialized"));
  OP_REQUIRES(ctx, state.var.dtype() == DT_FLOAT && state.accum.dtype() == DT_FLOAT,
              errors::InvalidArgument(op, ": var and accum must be float32"));
  OP_REQUIRES(ctx, state.var.dims() == 2,
              errors::InvalidArgument(op, ": var must be 2-D, got ",
                                      state.var.shape().DebugString()));
  const int64 R = state.var.dim_size(0);
  OP_REQUIRES(ctx, state.accum.NumElements() == R && state.accum.dims() >= 1 &&
                       state.accum.dim_size(0) == R,
              errors::InvalidArgument(op, ": accum must have shape [", R, "], got ",
                                      state.accum.shape().DebugString()));
  state.lr = ctx->input(first_scalar).scalar<float>()();
  state.eps = ctx->input(first_scalar + 1).scalar<float>()();
  state.scale = ctx->input(first_scalar + 2).scalar<float>()();
  state.weight_decay = ctx->input(first_scalar + 3).scalar<float>()();
  update(state);
}

// The update itself, on the rows grouped in g: each unique row's gradient is the sum
// of the rows of `grad` that its positions read (by `combiner`, as in GradSegments).
template <typename Tgrad>
void ApplyRowwiseAdagrad(OpKernelContext* ctx, KernelIsa isa, RowwiseState* state,
                         const Grouping& g, int64 num_positions, Combiner combiner,
                         const int32_t* sample_of, const float* inv_count, const Tgrad* grad,
                         int64 grad_stride, const float* weights = nullptr) {
  const int64 D = state->var.dim_size(1);
  const int64 U = g.num_unique();
  if (U == 0 || D == 0) return;
  AdviseHugePages(state->var.flat<float>().data(), state->var.TotalBytes());
  AdviseHugePages(state->accum.flat<float>().data(), state->accum.TotalBytes());
  const float lr = state->lr;
  const float wd = state->weight_decay;
  const RowwiseAdagradArgs<Tgrad> args{g.unique_ids.data(),
                                       g.seg_start.data(),
                                       g.perm.empty() ? nullptr : g.perm.data(),
                                       combiner,
                                       sample_of,
                                       inv_count,
                                       grad,
                                       D,
                                       grad_stride,
                                       state->var.flat<float>().data(),
                                       state->accum.flat<float>().data(),
                                       lr,
                                       state->eps,
                                       state->scale,
                                       wd > 0.0f ? lr * wd : 0.0f,
                                       1.0f / static_cast<float>(D),
                                       weights};
  const auto kernel = RowwiseAdagradKernel<Tgrad>(isa);
  const int64 avg_seg = std::max<int64>(1, num_positions / U);
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  workers->ParallelFor(U, avg_seg * 3 * D + 8 * D + 300, [&](int64 begin, int64 end) {
    std::vector<float> row_buf(D);
    kernel(args, begin, end, row_buf.data());
  });
}

template <typename Tidx>
Status IndexOutOfRange(const char* op, const Tidx* indices, int64 pos, int64 num_rows) {
  return errors::InvalidArgument(op, " got index ", static_cast<int64>(indices[pos]),
                                 ", expected indices in [0, ", num_rows, ") (at position ",
                                 pos, ")");
}

template <typename Tidx, typename Tgrad>
class RowwiseAdagradApplyOp : public OpKernel {
 public:
  explicit RowwiseAdagradApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    constexpr const char* kOp = "RowwiseAdagradApply";
    KernelIsa isa;
    OP_REQUIRES_OK(ctx, GetKernelIsa(&isa));
    UpdateLockedRowwiseState(ctx, kOp, /*first_scalar=*/4, [&](RowwiseState& state) {
      const int64 R = state.var.dim_size(0);
      const int64 D = state.var.dim_size(1);
      const Tensor& indices_t = ctx->input(2);
      const Tensor& grad_t = ctx->input(3);
      OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices_t.shape()),
                  errors::InvalidArgument(kOp, ": indices must be 1-D, got ",
                                          indices_t.shape().DebugString()));
      const int64 N = indices_t.NumElements();
      OP_REQUIRES(ctx, grad_t.dims() == 2 && grad_t.dim_size(0) == N && grad_t.dim_size(1) == D,
                  errors::InvalidArgument(kOp, ": grad must have shape [", N, ", ", D,
                                          "], got ", grad_t.shape().DebugString()));
      OP_REQUIRES(ctx, N < (int64{1} << 32),
                  errors::InvalidArgument(kOp, ": too many indices: ", N));
      const Tidx* indices = indices_t.flat<Tidx>().data();
      const int64 bad = FirstOutOfRange(indices, N, R);
      OP_REQUIRES(ctx, bad < 0, IndexOutOfRange(kOp, indices, bad, R));
      if (N == 0) return;
      ScratchHandle scratch;
      GroupById(indices, N, R, &*scratch);
      ApplyRowwiseAdagrad<Tgrad>(ctx, isa, &state, scratch->g, N, Combiner::kNone, nullptr,
                                 nullptr, grad_t.flat<Tgrad>().data(), D);
    });
  }
};

template <typename Tidx, typename Tsplits>
class EmbeddingLookupCombineGradRowwiseAdagradOp : public OpKernel {
 public:
  explicit EmbeddingLookupCombineGradRowwiseAdagradOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadLookupAttrs(ctx, &combiner_, &table_name_));
    OP_REQUIRES_OK(ctx, ReadGradColumns(ctx, &grad_columns_));
  }

  void Compute(OpKernelContext* ctx) override {
    constexpr const char* kOp = "EmbeddingLookupCombineGradRowwiseAdagrad";
    KernelIsa isa;
    OP_REQUIRES_OK(ctx, GetKernelIsa(&isa));
    UpdateLockedRowwiseState(ctx, kOp, /*first_scalar=*/5, [&](RowwiseState& state) {
      const int64 R = state.var.dim_size(0);
      const int64 D = state.var.dim_size(1);
      const Tensor& grad_t = ctx->input(2);
      const Tensor& ids_t = ctx->input(3);
      OP_REQUIRES(ctx, grad_t.dims() == 2,
                  errors::InvalidArgument(kOp, ": grad must be 2-D, got ",
                                          grad_t.shape().DebugString()));
      int64 first_column = 0, columns = 0;
      OP_REQUIRES_OK(ctx, GradWindow(grad_columns_, grad_t.dim_size(1), table_name_,
                                     &first_column, &columns));
      const std::string window =
          grad_columns_.empty() ? std::string()
                                : strings::StrCat(" at grad_columns [", first_column, ", ",
                                                  first_column + columns, ")");
      OP_REQUIRES(ctx, columns == D,
                  errors::InvalidArgument(kOp, ": grad must be 2-D with ", D,
                                          " columns (the table's), got ",
                                          grad_t.shape().DebugString(), window));
      OP_REQUIRES(ctx, TensorShapeUtils::IsVector(ids_t.shape()),
                  errors::InvalidArgument(kOp, ": ids must be 1-D, got ",
                                          ids_t.shape().DebugString()));
      const int64 nnz = ids_t.NumElements();
      OP_REQUIRES(ctx, nnz < (int64{1} << 32),
                  errors::InvalidArgument(kOp, ": too many ids in one call: ", nnz));
      const Tidx* ids = ids_t.flat<Tidx>().data();
      const int64 bad = FirstOutOfRange(ids, nnz, R);
      OP_REQUIRES(ctx, bad < 0, IdOutOfRangeError(table_name_, ids, bad, R));
      Combiner combiner = combiner_;
      const float* weights = nullptr;
      OP_REQUIRES_OK(ctx, ReadIdWeights(ctx->input(9), nnz, combiner_, table_name_, &combiner,
                                        &weights));
      ScratchHandle scratch;
      OP_REQUIRES_OK(ctx, MapPositionsToGradRows<Tsplits>(combiner, ctx->input(4), nnz,
                                                          grad_t.dim_size(0), table_name_,
                                                          &*scratch));
      if (nnz == 0) return;
      GroupById(ids, nnz, R, &*scratch);
      ApplyRowwiseAdagrad<float>(ctx, isa, &state, scratch->g, nnz, combiner,
                                 scratch->sample_of.data(), scratch->inv_count.data(),
                                 grad_t.flat<float>().data() + first_column,
                                 grad_t.dim_size(1), weights);
    });
  }

 private:
  Combiner combiner_;
  std::string table_name_;
  std::vector<int64> grad_columns_;
};

// Both kernels read their four scalars (lr, epsilon, scale, weight_decay) on the host.
#define TFHYBRID_ADAGRAD_KERNEL(op_name)    \
  Name(op_name)                             \
      .Device(DEVICE_CPU)                   \
      .HostMemory("lr")                     \
      .HostMemory("epsilon")                \
      .HostMemory("scale")                  \
      .HostMemory("weight_decay")

#define TFHYBRID_REGISTER_ADAGRAD(Tidx, Tgrad)                                             \
  REGISTER_KERNEL_BUILDER(TFHYBRID_ADAGRAD_KERNEL("RowwiseAdagradApply")                  \
                              .TypeConstraint<Tidx>("Tindices")                            \
                              .TypeConstraint<Tgrad>("Tgrad"),                             \
                          RowwiseAdagradApplyOp<Tidx, Tgrad>);

#define TFHYBRID_REGISTER_FUSED(Tidx, Tsplits)                                             \
  REGISTER_KERNEL_BUILDER(TFHYBRID_ADAGRAD_KERNEL("EmbeddingLookupCombineGradRowwiseAdagrad") \
                              .TypeConstraint<Tidx>("Tindices")                            \
                              .TypeConstraint<Tsplits>("Tsplits"),                         \
                          EmbeddingLookupCombineGradRowwiseAdagradOp<Tidx, Tsplits>);

TFHYBRID_REGISTER_ADAGRAD(int32, float)
TFHYBRID_REGISTER_ADAGRAD(int32, Eigen::half)
TFHYBRID_REGISTER_ADAGRAD(int32, bfloat16)
TFHYBRID_REGISTER_ADAGRAD(int64_t, float)
TFHYBRID_REGISTER_ADAGRAD(int64_t, Eigen::half)
TFHYBRID_REGISTER_ADAGRAD(int64_t, bfloat16)
TFHYBRID_REGISTER_FUSED(int32, int32)
TFHYBRID_REGISTER_FUSED(int32, int64_t)
TFHYBRID_REGISTER_FUSED(int64_t, int32)
TFHYBRID_REGISTER_FUSED(int64_t, int64_t)

#undef TFHYBRID_REGISTER_FUSED
#undef TFHYBRID_REGISTER_ADAGRAD
#undef TFHYBRID_ADAGRAD_KERNEL

}  // namespace tfhybrid
}  // namespace tensorflow
