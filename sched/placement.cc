#include "sched/placement.h"

#include <algorithm>
#include <cassert>
#include <cmath>

namespace strata::sched {

Tier OffloadTier(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone:
      return Tier::kDevice;
    case OffloadDevice::kCpu:
      return Tier::kHost;
    case OffloadDevice::kNvme:
      return Tier::kNvme;
  }
  return Tier::kDevice;
}

Tier StatePlacement::Home(StateKind kind) const {
  switch (kind) {
    case StateKind::kParam16:
      return OffloadTier(offload_param);
    case StateKind::kGrad:
    case StateKind::kMaster32:
    case StateKind::kExpAvg:
    case StateKind::kExpAvgSq:
      return OffloadTier(offload_optimizer);
  }
  return Tier::kDevice;
}

Tier StatePlacement::SubGroupHome(StateKind kind, bool device_resident) const {
  return device_resident && kind != StateKind::kParam16 ? Tier::kDevice : Home(kind);
}

StatePlacement ResolvePlacement(int stage, OffloadDevice optimizer, OffloadDevice param,
                                double optimizer_ratio) {
  assert(stage >= 0 && stage <= 3);
  StatePlacement p;
  p.stage = stage;
  if (stage == 0 && optimizer != OffloadDevice::kNone) {
    p.notes.push_back("offload_optimizer needs ZeRO stage >= 1: ignored at stage 0");
    optimizer = OffloadDevice::kNone;
  }
  if (stage < 3 && optimizer == OffloadDevice::kNvme) {
    p.notes.push_back("offload_optimizer to nvme needs stage 3: DeepSpeed offloads to cpu instead");
    optimizer = OffloadDevice::kCpu;
  }
  if (stage < 3 && param != OffloadDevice::kNone) {
    p.notes.push_back("offload_param needs stage 3: ignored at stage " + std::to_string(stage));
    param = OffloadDevice::kNone;
  }
  optimizer_ratio = std::clamp(optimizer_ratio, 0.0, 1.0);
  if (optimizer_ratio < 1.0 && stage < 3 && optimizer != OffloadDevice::kNone) {
    p.notes.push_back(
        "offload_optimizer.ratio < 1 (partial offload) needs stage 3: the whole "
        "optimizer is offloaded at stage " +
        std::to_string(stage));
  }
  if (stage == 3 && optimizer != OffloadDevice::kNone) p.optimizer_ratio = optimizer_ratio;
  p.offload_optimizer = optimizer;
  p.offload_param = param;
  p.optimizer_partitioned = stage >= 1;
  p.grads_partitioned = stage >= 2;
  p.params_partitioned = stage >= 3;
  return p;
}

uint64_t DeviceResidentLimit(double ratio, uint64_t total_elems) {
  constexpr uint64_t kMillion = 1000000;
  const auto q = static_cast<uint64_t>(std::llround(std::clamp(ratio, 0.0, 1.0) * 1e6));
  const unsigned __int128 scaled = static_cast<unsigned __int128>(total_elems) * q;
  const auto offloaded = static_cast<uint64_t>((scaled + kMillion - 1) / kMillion);
  return total_elems - offloaded;
}

size_t DeviceResidentSubGroups(const StatePlacement& placement,
                               const std::vector<uint64_t>& sub_group_elems) {
  if (placement.optimizer_ratio >= 1.0) return 0;
  uint64_t total = 0;
  for (uint64_t e : sub_group_elems) total += e;
  uint64_t left = DeviceResidentLimit(placement.optimizer_ratio, total);
  size_t k = 0;
  while (k < sub_group_elems.size() && sub_group_elems[k] <= left) left -= sub_group_elems[k++];
  return k;
}

uint64_t StateElementBytes(StateKind kind, DType working, DType grad) {
  switch (kind) {
    case StateKind::kParam16:
      return DTypeSize(working);
    case StateKind::kGrad:
      return DTypeSize(grad);
    default:
      return 4;
  }
}

DType GradStateDType(DType working, int64_t gradient_accumulation_steps, int world,
                     const StatePlacement& placement) {
  const bool offloaded =
      placement.Home(StateKind::kGrad) != Tier::kDevice && placement.optimizer_ratio >= 1.0;
  const bool final_as_reduced = gradient_accumulation_steps == 1 && world == 1;
  return offloaded && final_as_reduced && DTypeSize(working) == 2 ? working : DType::kF32;
}

namespace {
uint64_t PageRound(uint64_t bytes) { return (bytes + 4095) / 4096 * 4096; }
}  // namespace

uint64_t OptimizerSwapBufferBytes(int64_t buffer_count, uint64_t sub_group_elems,
                                  uint64_t sub_groups, uint64_t grad_elem_bytes) {
  auto buffers = static_cast<uint64_t>(std::clamp<int64_t>(buffer_count, 1, 64)) + 1;
  if (sub_groups > 0) buffers = std::min(buffers, sub_groups);
  const uint64_t states =
      3 * PageRound(sub_group_elems * StateElementBytes(StateKind::kMaster32, DType::kF32));
  return buffers * (states + PageRound(sub_group_elems * grad_elem_bytes));
}

uint64_t ParamSwapBufferBytes(int64_t buffer_count, uint64_t largest_shard_elems, DType working) {
  const auto buffers = static_cast<uint64_t>(std::clamp<int64_t>(buffer_count, 2, 64));
  return buffers * PageRound(largest_shard_elems * StateElementBytes(StateKind::kParam16, working));
}

uint64_t HostCacheBytes(uint64_t budget_bytes, uint64_t need_bytes, uint64_t nvme_state_bytes,
                        uint64_t swap_buffer_bytes) {
  const uint64_t room = budget_bytes - std::min(budget_bytes, need_bytes);
  return std::min(CacheableNvmeBytes(nvme_state_bytes, swap_buffer_bytes), room);
}

uint64_t SpeculationBufferBytes(int64_t configured_elems, uint64_t speculable_elems,
                                uint64_t param_elem_bytes, uint64_t host_room) {
  const uint64_t per_elem = SpeculationBytesPerElement(param_elem_bytes);
  if (configured_elems >= 0) {
    return std::min(static_cast<uint64_t>(configured_elems), speculable_elems) * per_elem;
  }
  const uint64_t floor_elems = std::min(speculable_elems, kSpeculationFloorBytes / per_elem);
  return std::min(std::max(speculable_elems / 4, floor_elems) * per_elem, host_room);
}

namespace {
uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }
}  // namespace

ShardLimits PerRankShardLimits(uint64_t prefetch, uint64_t max_live, uint64_t reuse_distance,
                               int world) {
  assert(world >= 1);
  const auto n = static_cast<uint64_t>(world);
  return ShardLimits{CeilDiv(prefetch, n), CeilDiv(max_live, n), CeilDiv(reuse_distance, n)};
}

std::vector<bool> PersistentGroups(std::span<const size_t> numels, uint64_t param_threshold,
                                   uint64_t model_threshold) {
  std::vector<bool> persistent(numels.size(), false);
  uint64_t total = 0;
  for (size_t g = 0; g < numels.size(); ++g) {
    const uint64_t n = numels[g];
    if (n > param_threshold || n > model_threshold - std::min(total, model_threshold)) continue;
    persistent[g] = true;
    total += n;
  }
  return persistent;
}

Stage3Residency Stage3Peak(const DeviceWorkingInput& in) {
  assert(in.largest_group_elems > 0);
  const uint64_t group = in.largest_group_elems;
  Stage3Residency r;
  r.groups = std::max<uint64_t>(1, CeilDiv(in.total_group_elems, group));
  const uint64_t numel = in.largest_group_numel > 0 ? in.largest_group_numel : group;
  // Persistent groups (PersistentGroups: at most model_persistence / numel of them) are kept on
  // top of those the reuse distance keeps.
  const uint64_t reused = std::min(r.groups, in.reuse_distance_elems / (2 * numel) + 1);
  const uint64_t persistent =
      numel <= in.persistence_elems ? std::min(r.groups, in.model_persistence_elems / numel) : 0;
  r.kept = std::min(r.groups, persistent + reused);
  const uint64_t cap = in.max_live_elems / group;
  r.gathered = std::min(r.groups, std::max<uint64_t>(2, std::min(r.kept - 1, cap) + 1));
  // The prefetcher counts a rank's shards against max_live / N.
  const uint64_t shard = std::max<uint64_t>(1, in.largest_shard_elems);
  const ShardLimits lim =
      PerRankShardLimits(in.prefetch_elems, in.max_live_elems, 0, std::max(1, in.world));
  const uint64_t window = std::max<uint64_t>(1, lim.prefetch_elems / shard);
  // Persistent shards are never evicted, whatever max_live says.
  r.shards = std::min(r.groups, std::max(persistent, std::min(std::max(r.kept, window),
                                                              lim.max_live_elems / shard + 1)));
  return r;
}

std::vector<DeviceWorkingItem> DeviceWorkingSet(const StatePlacement& placement,
                                                const DeviceWorkingInput& in) {
  assert(in.world >= 1);
  std::vector<DeviceWorkingItem> items;
  auto add = [&](std::string name, uint64_t bytes, bool store_cache = false) {
    if (bytes > 0) items.push_back({std::move(name), bytes, store_cache});
  };
  const uint64_t group = in.largest_group_elems, shard = in.largest_shard_elems;
  const uint64_t align = std::max<uint64_t>(1, in.copy_alignment);
  const uint64_t shard_copy = CeilDiv(shard * in.param_elem_bytes, align) * align;
  const uint64_t in_flight = in.overlap_comm ? 3 : 1;
  const bool identity = in.world == 1 && !in.quantized_gradients;
  const uint64_t ggroup = in.grad_group_elems.value_or(group);
  const uint64_t gshard = in.grad_shard_elems.value_or(shard);
  const bool behind = AccumulatesBehind(
      in.overlap_comm, placement.Home(StateKind::kGrad) != Tier::kDevice || !in.device_kernels);
  const uint64_t grads = identity
                             ? OneRankGradBuffers(placement, in.overlap_comm, in.device_kernels) *
                                   ggroup * in.grad_elem_bytes
                             : in_flight * (ggroup + gshard) * in.grad_elem_bytes;
  add(identity && behind ? "gradient buffers, 3 groups (one rank: accumulated behind the backward)"
      : identity && in.overlap_comm
          ? "gradient buffers, 2 groups (one rank, reduced in place; overlap_comm: one held back)"
      : identity        ? "gradient buffer, one group (one rank: reduced in place)"
      : in.overlap_comm ? "gradient buffers, 3 x (group + shard) (overlap_comm)"
                        : "gradient buffers, group + shard",
      grads);
  if (placement.optimizer_partitioned && in.world > 1) {
    // ReadMaster's all-gather: a trained group's master, or at stage 3 a frozen group's params
    // widened (below stage 3 a frozen group is whole on every rank: nothing to gather).
    const uint64_t read_group = placement.params_partitioned ? group : ggroup;
    const uint64_t read_back = read_group * StateElementBytes(StateKind::kMaster32, DType::kF32);
    add("fp32 read-back of a group, beyond the gradient buffers",
        read_back > grads ? read_back - grads : 0);
  }
  add("norm exchange", static_cast<uint64_t>(in.world) * 16);
  const bool params_home_device = placement.Home(StateKind::kParam16) == Tier::kDevice;
  const bool optimizer_on_device =
      placement.Home(StateKind::kMaster32) == Tier::kDevice || in.device_sub_groups > 0;
  if (optimizer_on_device && in.device_kernels) {
    if (!params_home_device) {
      add("param shards the device optimizer writes (buffer_count)",
          std::min<uint64_t>(
              std::max<uint64_t>(1, in.optimizer_buffers),
              std::max<uint64_t>(1, CeilDiv(in.total_group_elems, std::max<uint64_t>(1, group)))) *
              shard_copy,
          /*store_cache=*/true);
    }
    const bool all = placement.Home(StateKind::kMaster32) == Tier::kDevice;
    const uint64_t slots = all ? in.sub_groups : in.device_sub_groups;
    const uint64_t elems = all ? in.sub_group_elems : in.device_sub_group_elems;
    add("gradient statistics (a slot per device sub-group: 8 B per 4096 elements + 16)",
        8 * (CeilDiv(elems, 4096) + 2 * slots));
  }
  if (!placement.params_partitioned || group == 0) return items;
  const Stage3Residency r = Stage3Peak(in);
  const bool aliased = in.world == 1 && !in.quantized_weights;  // Gather hands out the shard
  if (!aliased) {
    add("gathered groups (" + std::to_string(r.gathered) + " of " + std::to_string(r.groups) +
            ": kept + in use)",
        std::min(in.total_group_elems, r.gathered * group) * in.param_elem_bytes);
  }
  if (!params_home_device) {
    // Aliased, the shards are also the groups in use: at least as many as would be gathered.
    const uint64_t shards = aliased ? std::max(r.shards, r.gathered) : r.shards;
    const uint64_t total_shards = CeilDiv(in.total_group_elems, static_cast<uint64_t>(in.world));
    add("param shards on the device (" + std::to_string(shards) + " of " +
            std::to_string(r.groups) +
            (aliased ? ": kept, prefetched or in use)" : ": kept or prefetched)"),
        std::min(total_shards * in.param_elem_bytes + r.groups * (align - 1),  // rounding slack
                 shards * shard_copy),
        /*store_cache=*/true);
  }
  return items;
}

}  // namespace strata::sched
