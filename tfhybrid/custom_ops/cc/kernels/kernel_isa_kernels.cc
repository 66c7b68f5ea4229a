// CPU kernel: TfhybridKernelIsa, which reports the dispatch level of the hot loops
// (isa_kernels.h) so that Python (tfhybrid.custom_ops.kernel_isa) and the tests can
// see which code path this process runs.

#include "embedding_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace tfhybrid {

class TfhybridKernelIsaOp : public OpKernel {
 public:
  explicit TfhybridKernelIsaOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    KernelIsa isa;
    OP_REQUIRES_OK(ctx, GetKernelIsa(&isa));
    Tensor* chosen = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &chosen));
    chosen->scalar<tstring>()() = KernelIsaName(isa);
    const int num_supported = static_cast<int>(BestSupportedKernelIsa()) + 1;
    Tensor* supported = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({num_supported}), &supported));
    for (int i = 0; i < num_supported; ++i) {
      supported->vec<tstring>()(i) = KernelIsaName(static_cast<KernelIsa>(i));
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TfhybridKernelIsa").Device(DEVICE_CPU), TfhybridKernelIsaOp);

}  // namespace tfhybrid
}  // namespace tensorflow
