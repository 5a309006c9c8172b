// STRATA_CUDA_RETURN_IF_ERROR / CudaStatus: the one way a CUDA runtime error becomes a Status.
// The message names the call, the CUDA error name and text, and file:line. No CUDA error ever
// aborts the process.
//
// Thread safety: stateless.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "strata/status.h"

namespace strata {

// OK for cudaSuccess; Unavailable for a missing/insufficient driver or no device;
// ResourceExhausted for out-of-memory; Internal otherwise.
inline Status CudaStatus(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return Status::OK();
  std::string m = std::string(call) + " failed: " + cudaGetErrorName(err) + " (" +
                  cudaGetErrorString(err) + ") at " + file + ":" + std::to_string(line);
  switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return Status::Unavailable(m);
    case cudaErrorMemoryAllocation:
      return Status::ResourceExhausted(m);
    default:
      return Status::Internal(m);
  }
}

}  // namespace strata

#define STRATA_CUDA_STATUS(call) ::strata::CudaStatus((call), #call, __FILE__, __LINE__)
#define STRATA_CUDA_RETURN_IF_ERROR(call) STRATA_RETURN_IF_ERROR(STRATA_CUDA_STATUS(call))
