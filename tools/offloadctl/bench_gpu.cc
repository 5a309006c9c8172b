// bench_gpu.h's NCCL communicator and PCIe reference (CUDA builds).
#include <algorithm>
#include <chrono>
#include <utility>

#include <cuda_runtime_api.h>

#include "gpu/cuda_check.h"
#include "gpu/nccl_comm.h"
#include "tools/offloadctl/bench_gpu.h"

namespace strata::cli {
namespace {

// The reference's buffers and timing events, released however the measurement ends.
struct PcieBuffers {
  void* host = nullptr;
  void* dev = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  ~PcieBuffers() {
    if (stream) cudaStreamSynchronize(stream);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    if (dev) cudaFree(dev);
    if (host) cudaFreeHost(host);
  }
};

// The best of `repeats` copies of `bytes` in `kind`, GB/s.
Result<double> BestRate(PcieBuffers& b, cudaMemcpyKind kind, size_t bytes, int repeats) {
  void* dst = kind == cudaMemcpyHostToDevice ? b.dev : b.host;
  const void* src = kind == cudaMemcpyHostToDevice ? b.host : b.dev;
  float best_ms = 0;
  for (int i = 0; i < repeats; ++i) {
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.start, b.stream));
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, b.stream));
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.stop, b.stream));
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.stop));
    float ms = 0;
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, b.start, b.stop));
    if (ms > 0 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
  }
  if (best_ms <= 0) return Status::Internal("PCIe reference: no copy was timed");
  return static_cast<double>(bytes) / (best_ms * 1e-3) / 1e9;
}

}  // namespace

Result<std::unique_ptr<Communicator>> MakeEngineNccl(int rank, int world, int ordinal,
                                                     KvStore* store, const std::string& store_key,
                                                     std::chrono::milliseconds timeout) {
  NcclCommOptions o;
  o.rank = rank;
  o.world_size = world;
  o.device = ordinal;
  o.store = store;
  o.store_key = store_key;
  o.timeout = timeout;
  return CreateNcclCommunicator(o);
}

Result<PcieReference> MeasurePcie(int ordinal, size_t bytes, int repeats) {
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  PcieBuffers b;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMallocHost(&b.host, bytes));
  STRATA_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.dev, bytes));
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
  STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&b.start));
  STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&b.stop));
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(b.dev, 0, bytes, b.stream));
  PcieReference r;
  // One untimed copy each way first: the link and the pages are warm for the timed ones.
  STRATA_RETURN_IF_ERROR(BestRate(b, cudaMemcpyHostToDevice, bytes, 1).status());
  STRATA_ASSIGN_OR_RETURN(r.h2d_gbps, BestRate(b, cudaMemcpyHostToDevice, bytes, repeats));
  STRATA_RETURN_IF_ERROR(BestRate(b, cudaMemcpyDeviceToHost, bytes, 1).status());
  STRATA_ASSIGN_OR_RETURN(r.d2h_gbps, BestRate(b, cudaMemcpyDeviceToHost, bytes, repeats));
  return r;
}

}  // namespace strata::cli
