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

Status CudaQuantizeInt8(DType, const void*, size_t, size_t, int8_t*, float*, uint64_t*, void*) {
  return NoCuda();
}
Status CudaDequantizeInt8(const int8_t*, const float*, size_t, size_t, DType, void*, void*) {
  return NoCuda();
}
Status CudaDequantizeAddInt8(const int8_t*, const float*, size_t, size_t, float*, void*) {
  return NoCuda();
}

}  // namespace strata::kernels
