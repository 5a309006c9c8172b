#include "sched/zero_layout.h"

#include <algorithm>
#include <cmath>

namespace strata::sched {

uint64_t ShardElems(uint64_t numel, int world, uint64_t align) {
  const auto w = static_cast<uint64_t>(world);
  const uint64_t per_rank = (numel + w - 1) / w;
  return (per_rank + align - 1) / align * align;
}

uint64_t SubGroupElems(uint64_t sub_group_size, uint64_t largest_tensor_elems, uint64_t align) {
  const uint64_t size = sub_group_size > 0 ? sub_group_size : largest_tensor_elems;
  return std::max(align, size / align * align);
}

uint64_t SubGroupsOf(uint64_t shard_elems, uint64_t sub_group_elems) {
  return (shard_elems + sub_group_elems - 1) / sub_group_elems;
}

namespace {

// Bytes of one block of `elems` elements of `width` bytes homed on `home`.
double BlockBytes(uint64_t elems, double width, Tier home, uint64_t align) {
  const double bytes = static_cast<double>(elems) * width;
  if (home == Tier::kDevice || align <= 1) return bytes;
  const auto a = static_cast<double>(align);
  return std::ceil(bytes / a) * a;
}

}  // namespace

StateLayout LayOutStates(const StatePlacement& placement, const StateLayoutInput& in) {
  const Tier param_home = placement.Home(StateKind::kParam16);
  const Tier opt_home = placement.Home(StateKind::kMaster32);
  const Tier grad_home = placement.Home(StateKind::kGrad);
  const StateWidths& w = in.widths;
  const uint64_t a = in.block_align_bytes;
  const uint64_t owners = placement.optimizer_partitioned ? 1 : static_cast<uint64_t>(in.world);
  // One sub-group's optimizer states and gradient.
  auto opt_of = [&](uint64_t e) {
    return BlockBytes(e, w.master, opt_home, a) + BlockBytes(e, w.exp_avg, opt_home, a) +
           BlockBytes(e, w.exp_avg_sq, opt_home, a);
  };
  auto grad_of = [&](uint64_t e) { return BlockBytes(e, w.grad, grad_home, a); };

  StateLayout L;
  for (const GroupRun& run : in.groups) {
    if (run.count == 0) continue;
    const uint64_t shard = ShardElems(run.numel, in.world, in.shard_align_elems);
    const uint64_t padded = shard * static_cast<uint64_t>(in.world);
    const auto n = static_cast<double>(run.count);
    L.largest_numel = std::max(L.largest_numel, run.numel);
    L.largest_padded = std::max(L.largest_padded, padded);
    L.largest_shard = std::max(L.largest_shard, shard);
    L.total_padded += padded * run.count;
    L.param_bytes +=
        n * BlockBytes(placement.params_partitioned ? shard : padded, w.param, param_home, a);
    if (shard == 0 || !run.trainable) continue;
    L.largest_trainable_padded = std::max(L.largest_trainable_padded, padded);
    L.largest_trainable_shard = std::max(L.largest_trainable_shard, shard);
    // Per owner's shard: `full` sub-groups of sub_group_elems and one of the rest.
    const uint64_t sub = std::min(in.sub_group_elems, shard);
    const uint64_t full = shard / sub, rest = shard % sub;
    const double per_shard_opt = static_cast<double>(full) * opt_of(sub) + (rest ? opt_of(rest) : 0);
    const double per_shard_grad =
        static_cast<double>(full) * grad_of(sub) + (rest ? grad_of(rest) : 0);
    const double copies = n * static_cast<double>(owners);
    L.optimizer_bytes += copies * per_shard_opt;
    L.grad_bytes += copies * per_shard_grad;
    L.sub_groups += run.count * owners * (full + (rest ? 1 : 0));
    L.largest_sub = std::max(L.largest_sub, sub);
  }
  L.tier_bytes[param_home] += L.param_bytes;
  L.tier_bytes[opt_home] += L.optimizer_bytes;
  L.tier_bytes[grad_home] += L.grad_bytes;
  return L;
}

}  // namespace strata::sched
