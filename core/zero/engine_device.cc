// Engine: device-resident state computed by the device's own kernels (strata/device_kernels.h).
//
// When a state's home is a device the host cannot address (CudaDevice), the engine does not fetch
// it to the host: gradient accumulation, the gradient norm's chunk sums, the fused Adam step with
// its param_out cast, and the fp32 param copy run on the device, in place, through the device's
// compute stream. The kernels compute what the CPU kernels compute, bit for bit on FMA targets
// (cuda_kernels.h), so a result still does not depend on where a state lives.
//
// Ordering: inputs are complete before a kernel is enqueued (reductions are waited for, leases
// are held, copies are synchronous). The gradient statistics are the one thing left running: a
// completed gradient's chunk sums go to the sub-group's own slot of `device_stats` and are read
// back for every sub-group at once by CollectDeviceStats (Step), so the backward's reductions
// wait for no kernel. Everything else synchronizes the compute stream before it returns. A
// device-homed gradient is read by nothing but these kernels until Step, and the trainer's
// buffers they read are freed stream-ordered (Device::Free). Only the chunk sums (8 bytes per
// 4096 elements) and the overflow flags cross to the host.
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

namespace {
size_t Chunks(size_t n) { return (n + kernels::kStatsChunk - 1) / kernels::kStatsChunk; }
}  // namespace

Status Engine::Impl::QueueDeviceStats(size_t si, const float* grad) {
  kernels::DeviceKernels* k = DeviceKernelsFor(Tier::kDevice);
  if (!device_stats) {
    // A slot per sub-group whose gradient the device's kernels complete on this rank:
    // [the overflow flag, padded to 8 bytes][its chunk sums]. Within the working set's item
    // (sched::DeviceWorkingSet, "gradient statistics").
    stats_word.assign(subs.size(), 0);
    size_t words = 0;
    for (size_t i = 0; i < subs.size(); ++i) {
      if (subs[i].owner != rank || !DeviceKernelsFor(HomeOf(subs[i], StateKind::kGrad))) continue;
      stats_word[i] = words;
      words += 1 + Chunks(subs[i].elems);
    }
    STRATA_ASSIGN_OR_RETURN(
        device_stats, DeviceBuffer::Make(opt.device, sizeof(double) * std::max<size_t>(1, words)));
  }
  SubGroup& s = subs[si];
  const size_t end = stats_word[si] + 1 + Chunks(s.elems);
  if (s.owner != rank || sizeof(double) * end > device_stats.size_bytes()) {
    return Status::Internal("gradient statistics: sub-group " + std::to_string(si) +
                            " has no slot on the device");
  }
  auto* slot = static_cast<double*>(device_stats.get()) + stats_word[si];
  STRATA_RETURN_IF_ERROR(
      k->ChunkSumSquares(grad, DType::kF32, s.elems, slot + 1, reinterpret_cast<bool*>(slot)));
  if (!s.stats_on_device) stats_queued.push_back(si);
  s.stats_on_device = true;
  s.stats_valid = false;
  return Status::OK();
}

Status Engine::Impl::CollectDeviceStats() {
  if (stats_queued.empty()) return Status::OK();
  STRATA_RETURN_IF_ERROR(DeviceKernelsFor(Tier::kDevice)->Synchronize(timeout()));
  size_t words = 0;
  for (size_t si : stats_queued)
    words = std::max(words, stats_word[si] + 1 + Chunks(subs[si].elems));
  std::vector<double> host(words);
  STRATA_RETURN_IF_ERROR(
      CopySync(CopyDir::kDeviceToHost, host.data(), device_stats.get(), words * sizeof(double)));
  for (size_t si : stats_queued) {
    SubGroup& s = subs[si];
    const double* slot = host.data() + stats_word[si];
    bool flag = false;
    std::memcpy(&flag, slot, sizeof flag);
    kernels::ExactSum acc;
    for (size_t c = 0; c < Chunks(s.elems); ++c) acc.Add(slot[1 + c]);
    s.nonfinite = acc.nonfinite() || flag;
    s.sum_sq = s.nonfinite ? std::numeric_limits<double>::infinity() : acc.Value();
    s.stats_valid = true;
    s.stats_on_device = false;
  }
  stats_queued.clear();
  return Status::OK();
}

Status Engine::Impl::ZeroGradAt(Tier tier, void* grad, size_t n) {
  const uint64_t bytes = n * DTypeSize(grad_dtype);
  if (tier == Tier::kDevice) return ZeroDevice(grad, bytes);
  std::memset(grad, 0, bytes);
  return Status::OK();
}

Status Engine::Impl::AdamOnDevice(kernels::DeviceKernels& k, const SubGroup& s,
                                  const kernels::AdamHyper& h, Lease& master, Lease& m, Lease& v,
                                  const Lease& grad, Lease& param, bool queued) {
  uint8_t* out = static_cast<uint8_t*>(param.data()) + ParamOffset(s) * elt;
  const kernels::AdamShard shard = AdamShardFor(s, master, m, v, grad, param);
  STRATA_RETURN_IF_ERROR(k.AdamStep(h, shard));
  if (dtype == DType::kF32) {
    STRATA_RETURN_IF_ERROR(k.Cast(shard.master, DType::kF32, out, DType::kF32, s.elems));
  }
  if (!queued) STRATA_RETURN_IF_ERROR(k.Synchronize(timeout()));
  master.MarkDirty();
  m.MarkDirty();
  v.MarkDirty();
  param.MarkDirty();
  return Status::OK();
}

}  // namespace strata
