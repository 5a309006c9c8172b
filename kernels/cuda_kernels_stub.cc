// cuda_kernels.h when strata is built without CUDA (STRATA_CUDA=OFF): nothing is available and
// every call returns Unavailable, before looking at its arguments.
#include "kernels/cuda_kernels.h"

namespace strata::kernels {
namespace {

Status NoCuda() {
  return Status::Unavailable("CUDA kernels: built without CUDA (STRATA_CUDA=OFF)");
}

}  // namespace

bool CudaKernelsAvailable() { return false; }

Status CudaAdamStep(const AdamHyper&, const AdamShard&, void*) { return NoCuda(); }

Status CudaAccumulateGrad(float*, const void*, DType, float, bool, size_t, void*) {
  return NoCuda();
}

Status CudaChunkSumSquares(const void*, DType, size_t, double*, bool*, void*) { return NoCuda(); }

Status CudaCast(const void*, DType, void*, DType, size_t, void*) { return NoCuda(); }

}  // namespace strata::kernels
