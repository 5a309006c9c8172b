// Engine: device-resident state computed by the device's own kernels (strata/device_kernels.h).
//
// When a state's home is a device the host cannot address (CudaDevice), the engine does not fetch
// it to the host: gradient accumulation, the gradient norm's chunk sums, the fused Adam step with
// its param_out cast, and the fp32 param copy run on the device, in place, through the device's
// compute stream. The kernels compute what the CPU kernels compute, bit for bit on FMA targets
// (cuda_kernels.h), so a result still does not depend on where a state lives.
//
// Ordering: inputs are complete before a kernel is enqueued (reductions are waited for, leases
// are held, copies are synchronous), and every function here synchronizes the compute stream
// before it releases a lease or returns, so the store, the copy streams and the communicator
// only ever see finished results. Only the chunk sums (8 bytes per 4096 elements) and the
// overflow flag cross to the host.
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "core/zero/engine_internal.h"
#include "strata/device_kernels.h"

namespace strata {

using zero::SubGroup;

kernels::DeviceKernels* Engine::Impl::DeviceKernelsFor(Tier home) const {
  if (home != Tier::kDevice || opt.device->host_addressable()) return nullptr;
  return opt.device->kernels();
}

Result<kernels::GradStats> Engine::Impl::GradStatsAt(Tier tier, const float* grad, size_t n) {
  kernels::DeviceKernels* k = tier == Tier::kDevice ? DeviceKernelsFor(tier) : nullptr;
  if (k == nullptr) return kernels::ComputeGradStats(*pool, grad, DType::kF32, n);
  // Scratch: [the overflow flag, padded to 8 bytes][chunk sums], for the largest sub-group,
  // allocated once: 8 bytes per kStatsChunk (4096) elements.
  const size_t chunks = (n + kernels::kStatsChunk - 1) / kernels::kStatsChunk;
  if (!stats_scratch) {
    size_t largest = 0;
    for (const SubGroup& s : subs) largest = std::max(largest, s.elems);
    const size_t max_chunks = (largest + kernels::kStatsChunk - 1) / kernels::kStatsChunk;
    STRATA_ASSIGN_OR_RETURN(stats_scratch,
                            DeviceBuffer::Make(opt.device, sizeof(double) * (1 + max_chunks)));
  }
  if (sizeof(double) * (1 + chunks) > stats_scratch.size_bytes()) {
    return Status::Internal("gradient statistics: " + std::to_string(n) +
                            " elements exceed the largest sub-group");
  }
  auto* base = static_cast<uint8_t*>(stats_scratch.get());
  STRATA_RETURN_IF_ERROR(k->ChunkSumSquares(grad, DType::kF32, n,
                                            reinterpret_cast<double*>(base + sizeof(double)),
                                            reinterpret_cast<bool*>(base)));
  STRATA_RETURN_IF_ERROR(k->Synchronize(timeout()));
  std::vector<double> host(1 + chunks);
  STRATA_RETURN_IF_ERROR(
      CopySync(CopyDir::kDeviceToHost, host.data(), base, host.size() * sizeof(double)));
  bool flag = false;
  std::memcpy(&flag, host.data(), sizeof flag);
  kernels::ExactSum acc;
  for (size_t c = 0; c < chunks; ++c) acc.Add(host[1 + c]);
  kernels::GradStats st;
  st.nonfinite = acc.nonfinite() || flag;
  st.sum_sq = st.nonfinite ? std::numeric_limits<double>::infinity() : acc.Value();
  return st;
}

Status Engine::Impl::ZeroGradAt(Tier tier, float* grad, size_t n) {
  if (tier == Tier::kDevice) return ZeroDevice(grad, n * sizeof(float));
  std::memset(grad, 0, n * sizeof(float));
  return Status::OK();
}

Status Engine::Impl::AdamOnDevice(kernels::DeviceKernels& k, const SubGroup& s,
                                  const kernels::AdamHyper& h, Lease& master, Lease& m, Lease& v,
                                  const Lease& grad, Lease& param) {
  uint8_t* out = static_cast<uint8_t*>(param.data()) + ParamOffset(s) * elt;
  const kernels::AdamShard shard = AdamShardFor(s, master, m, v, grad, param);
  STRATA_RETURN_IF_ERROR(k.AdamStep(h, shard));
  if (dtype == DType::kF32) {
    STRATA_RETURN_IF_ERROR(k.Cast(shard.master, DType::kF32, out, DType::kF32, s.elems));
  }
  STRATA_RETURN_IF_ERROR(k.Synchronize(timeout()));
  master.MarkDirty();
  m.MarkDirty();
  v.MarkDirty();
  param.MarkDirty();
  return Status::OK();
}

}  // namespace strata
