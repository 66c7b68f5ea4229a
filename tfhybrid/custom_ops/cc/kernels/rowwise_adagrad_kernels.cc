// CPU kernel: RowwiseAdagradApply (FBGEMM EXACT_ROWWISE_ADAGRAD semantics).
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

#define EIGEN_USE_THREADS

#include <string>
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

template <typename Tidx, typename Tgrad>
class RowwiseAdagradApplyOp : public OpKernel {
 public:
  explicit RowwiseAdagradApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    KernelIsa isa;
    OP_REQUIRES_OK(ctx, GetKernelIsa(&isa));
    // Check dtypes first: the locking helpers below are instantiated for float.
    for (int i = 0; i < 2; ++i) {
      core::RefCountPtr<Var> v;
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, i), &v));
      tf_shared_lock ml(*v->mu());
      OP_REQUIRES(ctx, v->tensor()->dtype() == DT_FLOAT,
                  errors::InvalidArgument("RowwiseAdagradApply: ", i == 0 ? "var" : "accum",
                                          " must be float32, got ",
                                          DataTypeString(v->tensor()->dtype())));
    }
    // Exclusive locks on var and accum (address order), sparse access mode, and the
    // buffers themselves (no copy unless a concurrent reader holds the buffer).
    auto locks = MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
        ctx, /*do_lock=*/true, /*sparse=*/true, {0, 1});
    Tensor var_t, accum_t;
    OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, float>(
                            ctx, 0, /*lock_held=*/true, /*sparse=*/true, &var_t));
    OP_REQUIRES_OK(ctx, GetInputTensorFromVariable<CPUDevice, float>(
                            ctx, 1, /*lock_held=*/true, /*sparse=*/true, &accum_t));
    OP_REQUIRES(ctx, var_t.IsInitialized() && accum_t.IsInitialized(),
                errors::FailedPrecondition("RowwiseAdagradApply: var or accum is not initialized"));
    OP_REQUIRES(ctx, var_t.dtype() == DT_FLOAT && accum_t.dtype() == DT_FLOAT,
                errors::InvalidArgument("RowwiseAdagradApply: var and accum must be float32"));
    OP_REQUIRES(ctx, var_t.dims() == 2,
                errors::InvalidArgument("RowwiseAdagradApply: var must be 2-D, got ",
                                        var_t.shape().DebugString()));
    const int64 R = var_t.dim_size(0);
    const int64 D = var_t.dim_size(1);
    OP_REQUIRES(ctx, accum_t.NumElements() == R && accum_t.dims() >= 1 && accum_t.dim_size(0) == R,
                errors::InvalidArgument("RowwiseAdagradApply: accum must have shape [", R,
                                        "], got ", accum_t.shape().DebugString()));

    const Tensor& indices_t = ctx->input(2);
    const Tensor& grad_t = ctx->input(3);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices_t.shape()),
                errors::InvalidArgument("RowwiseAdagradApply: indices must be 1-D, got ",
                                        indices_t.shape().DebugString()));
    const int64 N = indices_t.NumElements();
    OP_REQUIRES(ctx, grad_t.dims() == 2 && grad_t.dim_size(0) == N && grad_t.dim_size(1) == D,
                errors::InvalidArgument("RowwiseAdagradApply: grad must have shape [", N, ", ",
                                        D, "], got ", grad_t.shape().DebugString()));
    for (int i = 4; i < 8; ++i) {
      OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(ctx->input(i).shape()),
                  errors::InvalidArgument("RowwiseAdagradApply: input ", i, " must be a scalar"));
    }
    const float lr = ctx->input(4).scalar<float>()();
    const float eps = ctx->input(5).scalar<float>()();
    const float scale = ctx->input(6).scalar<float>()();
    const float wd = ctx->input(7).scalar<float>()();
    OP_REQUIRES(ctx, N < (int64{1} << 32),
                errors::InvalidArgument("RowwiseAdagradApply: too many indices: ", N));

    const Tidx* indices = indices_t.flat<Tidx>().data();
    const int64 bad = FirstOutOfRange(indices, N, R);
    OP_REQUIRES(ctx, bad < 0,
                errors::InvalidArgument("RowwiseAdagradApply got index ",
                                        static_cast<int64>(indices[bad]),
                                        ", expected indices in [0, ", R, ") (at position ", bad,
                                        ")"));
    if (N == 0 || D == 0) return;
    AdviseHugePages(var_t.flat<float>().data(), var_t.TotalBytes());
    AdviseHugePages(accum_t.flat<float>().data(), accum_t.TotalBytes());

    ScratchHandle scratch;
    GroupById(indices, N, R, &*scratch);
    const Grouping& g = scratch->g;
    const int64 U = g.num_unique();

    const float inv_d = 1.0f / static_cast<float>(D);
    const float decay = wd > 0.0f ? lr * wd : 0.0f;
    const RowwiseAdagradArgs<Tgrad> args{g.unique_ids.data(),
                                         g.seg_start.data(),
                                         g.perm.empty() ? nullptr : g.perm.data(),
                                         grad_t.flat<Tgrad>().data(),
                                         D,
                                         var_t.flat<float>().data(),
                                         accum_t.flat<float>().data(),
                                         lr,
                                         eps,
                                         scale,
                                         decay,
                                         inv_d};
    const auto kernel = RowwiseAdagradKernel<Tgrad>(isa);
    const int64 avg_seg = std::max<int64>(1, N / U);
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    workers->ParallelFor(U, avg_seg * 3 * D + 8 * D + 300, [&](int64 begin, int64 end) {
      std::vector<float> row_buf(D);
      kernel(args, begin, end, row_buf.data());
    });
  }
};

#define TFHYBRID_REGISTER_ADAGRAD(Tidx, Tgrad)                   \
  REGISTER_KERNEL_BUILDER(Name("RowwiseAdagradApply")            \
                              .Device(DEVICE_CPU)                \
                              .HostMemory("lr")                  \
                              .HostMemory("epsilon")             \
                              .HostMemory("scale")               \
                              .HostMemory("weight_decay")        \
                              .TypeConstraint<Tidx>("Tindices")  \
                              .TypeConstraint<Tgrad>("Tgrad"),   \
                          RowwiseAdagradApplyOp<Tidx, Tgrad>);

TFHYBRID_REGISTER_ADAGRAD(int32, float)
TFHYBRID_REGISTER_ADAGRAD(int32, Eigen::half)
TFHYBRID_REGISTER_ADAGRAD(int32, bfloat16)
TFHYBRID_REGISTER_ADAGRAD(int64_t, float)
TFHYBRID_REGISTER_ADAGRAD(int64_t, Eigen::half)
TFHYBRID_REGISTER_ADAGRAD(int64_t, bfloat16)

#undef TFHYBRID_REGISTER_ADAGRAD

}  // namespace tfhybrid
}  // namespace tensorflow
