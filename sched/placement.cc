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

}  // namespace strata::sched
