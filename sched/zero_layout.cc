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

namespace {

// Partial offload: the device-resident prefix of a rank's sub-groups (DeviceResidentSubGroups'
// rule) walked over the runs without listing them: whole groups while they fit, then the
// sub-groups of the first group that does not, in order, until one does not fit.
class ResidentPrefix {
 public:
  explicit ResidentPrefix(uint64_t limit) : left_(limit) {}
  // Of `count` groups with `full` sub-groups of `sub` elements and one of `rest` (0: none) each:
  // the whole groups that stay, and the sub-groups of the next group that stay (sub-groups of
  // `sub`, and whether its `rest` stays too).
  struct Taken {
    uint64_t groups = 0, subs = 0;
    bool rest = false;
  };
  Taken Take(uint64_t count, uint64_t full, uint64_t sub, uint64_t rest) {
    Taken t;
    if (done_) return t;
    const uint64_t shard = full * sub + rest;
    t.groups = std::min(count, left_ / shard);
    left_ -= t.groups * shard;
    if (t.groups == count) return t;
    done_ = true;  // the next group does not fit whole: the prefix ends inside it
    t.subs = std::min(full, left_ / sub);
    left_ -= t.subs * sub;
    t.rest = t.subs == full && rest > 0 && rest <= left_;
    return t;
  }

 private:
  uint64_t left_;
  bool done_ = false;
};

}  // namespace

StateLayout LayOutStates(const StatePlacement& placement, const StateLayoutInput& in) {
  const Tier param_home = placement.Home(StateKind::kParam16);
  const StateWidths& w = in.widths;
  const uint64_t a = in.block_align_bytes;
  const uint64_t owners = placement.optimizer_partitioned ? 1 : static_cast<uint64_t>(in.world);
  // One sub-group's optimizer states and gradient, offloaded or device-resident.
  auto opt_of = [&](uint64_t e, bool resident) {
    const Tier home = placement.SubGroupHome(StateKind::kMaster32, resident);
    return BlockBytes(e, w.master, home, a) + BlockBytes(e, w.exp_avg, home, a) +
           BlockBytes(e, w.exp_avg_sq, home, a);
  };
  auto grad_of = [&](uint64_t e, bool resident) {
    return BlockBytes(e, w.grad, placement.SubGroupHome(StateKind::kGrad, resident), a);
  };
  // The rank's sub-group elements, for the device-resident limit (ratio < 1 only).
  uint64_t total_sub_elems = 0;
  for (const GroupRun& run : in.groups) {
    if (run.trainable) {
      total_sub_elems += run.count * owners * ShardElems(run.numel, in.world, in.shard_align_elems);
    }
  }
  ResidentPrefix resident(placement.optimizer_ratio < 1.0
                              ? DeviceResidentLimit(placement.optimizer_ratio, total_sub_elems)
                              : 0);

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
    const uint64_t copies = run.count * owners;
    // Sub-groups of `e` elements: `k` offloaded and `d` device-resident.
    auto add = [&](uint64_t e, uint64_t k, uint64_t d) {
      const auto off = static_cast<double>(k), dev = static_cast<double>(d);
      L.optimizer_bytes += off * opt_of(e, false) + dev * opt_of(e, true);
      L.grad_bytes += off * grad_of(e, false) + dev * grad_of(e, true);
      L.device_optimizer_bytes += dev * opt_of(e, true);
      L.device_grad_bytes += dev * grad_of(e, true);
      L.device_sub_groups += d;
      L.device_sub_group_elems += d * e;
    };
    const ResidentPrefix::Taken t = resident.Take(copies, full, sub, rest);
    const uint64_t subs_dev = t.groups * full + t.subs;
    add(sub, copies * full - subs_dev, subs_dev);
    if (rest > 0) {
      const uint64_t rest_dev = t.groups + (t.rest ? 1 : 0);
      add(rest, copies - rest_dev, rest_dev);
    }
    L.sub_groups += copies * (full + (rest ? 1 : 0));
    L.sub_group_elems += copies * shard;
    L.largest_sub = std::max(L.largest_sub, sub);
  }
  const double off_opt = L.optimizer_bytes - L.device_optimizer_bytes;
  const double off_grad = L.grad_bytes - L.device_grad_bytes;
  L.tier_bytes[param_home] += L.param_bytes;
  L.tier_bytes[placement.Home(StateKind::kMaster32)] += off_opt;
  L.tier_bytes[placement.Home(StateKind::kGrad)] += off_grad;
  L.tier_bytes[Tier::kDevice] += L.device_optimizer_bytes + L.device_grad_bytes;
  return L;
}

}  // namespace strata::sched
