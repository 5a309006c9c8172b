#include "sched/placement.h"

#include <algorithm>
#include <cassert>

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

StatePlacement ResolvePlacement(int stage, OffloadDevice optimizer, OffloadDevice param) {
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
  p.offload_optimizer = optimizer;
  p.offload_param = param;
  p.optimizer_partitioned = stage >= 1;
  p.grads_partitioned = stage >= 2;
  p.params_partitioned = stage >= 3;
  return p;
}

uint64_t StateElementBytes(StateKind kind, DType working) {
  return kind == StateKind::kParam16 ? DTypeSize(working) : 4;
}

namespace {
uint64_t PageRound(uint64_t bytes) { return (bytes + 4095) / 4096 * 4096; }
}  // namespace

uint64_t OptimizerSwapBufferBytes(int64_t buffer_count, uint64_t sub_group_elems) {
  const auto buffers = static_cast<uint64_t>(std::clamp<int64_t>(buffer_count, 1, 64));
  const uint64_t block =
      PageRound(sub_group_elems * StateElementBytes(StateKind::kGrad, DType::kF32));
  return (buffers + 1) * 4 * block;
}

uint64_t ParamSwapBufferBytes(int64_t buffer_count, uint64_t largest_shard_elems, DType working) {
  const auto buffers = static_cast<uint64_t>(std::clamp<int64_t>(buffer_count, 2, 64));
  return buffers * PageRound(largest_shard_elems * StateElementBytes(StateKind::kParam16, working));
}

namespace {
uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }
}  // namespace

ShardLimits PerRankShardLimits(uint64_t prefetch, uint64_t max_live, uint64_t reuse_distance,
                               uint64_t persistence, int world) {
  assert(world >= 1);
  const auto n = static_cast<uint64_t>(world);
  return ShardLimits{CeilDiv(prefetch, n), CeilDiv(max_live, n), CeilDiv(reuse_distance, n),
                     CeilDiv(persistence, n)};
}

std::vector<DeviceWorkingItem> DeviceWorkingSet(const StatePlacement& placement,
                                                const DeviceWorkingInput& in) {
  assert(in.world >= 1);
  std::vector<DeviceWorkingItem> items;
  auto add = [&](std::string name, uint64_t bytes, bool store_cache = false) {
    if (bytes > 0) items.push_back({std::move(name), bytes, store_cache});
  };
  const uint64_t group = in.largest_group_elems, shard = in.largest_shard_elems;
  const uint64_t in_flight = in.overlap_comm ? 3 : 1;
  const bool identity = in.world == 1 && !in.quantized_gradients;
  const uint64_t grads =
      identity ? group * in.grad_elem_bytes : in_flight * (group + shard) * in.grad_elem_bytes;
  add(identity          ? "gradient buffer, one group (one rank: reduced in place)"
      : in.overlap_comm ? "gradient buffers, 3 x (group + shard) (overlap_comm)"
                        : "gradient buffers, group + shard",
      grads);
  if (placement.optimizer_partitioned && in.world > 1) {
    const uint64_t read_back = group * StateElementBytes(StateKind::kMaster32, DType::kF32);
    add("fp32 read-back of a group, beyond the gradient buffers",
        read_back > grads ? read_back - grads : 0);
  }
  add("norm exchange", static_cast<uint64_t>(in.world) * 16);
  if (!placement.params_partitioned) return items;
  add("gathered groups (max_live + 2 in use)",
      std::min(in.total_group_elems, in.max_live_elems + 2 * group) * in.param_elem_bytes);
  if (placement.Home(StateKind::kParam16) != Tier::kDevice) {
    const uint64_t total_shards = CeilDiv(in.total_group_elems, static_cast<uint64_t>(in.world));
    const uint64_t live = PerRankShardLimits(0, in.max_live_elems, 0, 0, in.world).max_live_elems;
    add("param shards cached (max_live / N + 2 in use)",
        std::min(total_shards, live + 2 * shard) * in.param_elem_bytes, /*store_cache=*/true);
  }
  return items;
}

}  // namespace strata::sched
