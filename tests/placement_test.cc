// The placement rules shared by the planner and the engine (sched/placement.h): every stage and
// offload combination against a table written from DeepSpeed's behaviour.
#include "sched/placement.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "strata/planner.h"

namespace strata::sched {
namespace {

constexpr auto N = OffloadDevice::kNone;
constexpr auto C = OffloadDevice::kCpu;
constexpr auto V = OffloadDevice::kNvme;
constexpr auto D = Tier::kDevice;
constexpr auto H = Tier::kHost;
constexpr auto S = Tier::kNvme;  // storage

struct Row {
  int stage;
  OffloadDevice opt_in, param_in;
  OffloadDevice opt_out, param_out;
  Tier param16, optimizer;  // homes of param16 and of grad/master/m/v
  size_t notes;
};

// 4 stages x 3 optimizer devices x 3 param devices.
constexpr Row kTable[] = {
    {0, N, N, N, N, D, D, 0}, {0, N, C, N, N, D, D, 1}, {0, N, V, N, N, D, D, 1},
    {0, C, N, N, N, D, D, 1}, {0, C, C, N, N, D, D, 2}, {0, C, V, N, N, D, D, 2},
    {0, V, N, N, N, D, D, 1}, {0, V, C, N, N, D, D, 2}, {0, V, V, N, N, D, D, 2},
    {1, N, N, N, N, D, D, 0}, {1, N, C, N, N, D, D, 1}, {1, N, V, N, N, D, D, 1},
    {1, C, N, C, N, D, H, 0}, {1, C, C, C, N, D, H, 1}, {1, C, V, C, N, D, H, 1},
    {1, V, N, C, N, D, H, 1}, {1, V, C, C, N, D, H, 2}, {1, V, V, C, N, D, H, 2},
    {2, N, N, N, N, D, D, 0}, {2, N, C, N, N, D, D, 1}, {2, N, V, N, N, D, D, 1},
    {2, C, N, C, N, D, H, 0}, {2, C, C, C, N, D, H, 1}, {2, C, V, C, N, D, H, 1},
    {2, V, N, C, N, D, H, 1}, {2, V, C, C, N, D, H, 2}, {2, V, V, C, N, D, H, 2},
    {3, N, N, N, N, D, D, 0}, {3, N, C, N, C, H, D, 0}, {3, N, V, N, V, S, D, 0},
    {3, C, N, C, N, D, H, 0}, {3, C, C, C, C, H, H, 0}, {3, C, V, C, V, S, H, 0},
    {3, V, N, V, N, D, S, 0}, {3, V, C, V, C, H, S, 0}, {3, V, V, V, V, S, S, 0},
};

TEST(Placement, EveryStageAndOffloadCombination) {
  for (const Row& r : kTable) {
    const std::string where = "stage " + std::to_string(r.stage) + " optimizer " +
                              std::string(OffloadDeviceName(r.opt_in)) + " param " +
                              std::string(OffloadDeviceName(r.param_in));
    const StatePlacement p = ResolvePlacement(r.stage, r.opt_in, r.param_in);
    EXPECT_EQ(p.offload_optimizer, r.opt_out) << where;
    EXPECT_EQ(p.offload_param, r.param_out) << where;
    EXPECT_EQ(p.Home(StateKind::kParam16), r.param16) << where;
    for (StateKind k :
         {StateKind::kGrad, StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      EXPECT_EQ(p.Home(k), r.optimizer) << where << " " << StateKindName(k);
    }
    EXPECT_EQ(p.notes.size(), r.notes) << where;
    EXPECT_EQ(p.optimizer_partitioned, r.stage >= 1) << where;
    EXPECT_EQ(p.grads_partitioned, r.stage >= 2) << where;
    EXPECT_EQ(p.params_partitioned, r.stage >= 3) << where;
  }
}

TEST(Placement, NotesSayWhatChanged) {
  const StatePlacement p = ResolvePlacement(2, V, C);
  ASSERT_EQ(p.notes.size(), 2u);
  EXPECT_NE(p.notes[0].find("nvme needs stage 3"), std::string::npos) << p.notes[0];
  EXPECT_NE(p.notes[1].find("offload_param needs stage 3"), std::string::npos) << p.notes[1];
}

// The planner takes its offload devices and notes from the same rules.
TEST(Placement, PlannerAppliesTheSameRules) {
  PlanInput in;
  in.params = 1e9;
  for (const Row& r : kTable) {
    const Placement plan = Place(in, r.stage, r.opt_in, r.param_in);
    const StatePlacement rules = ResolvePlacement(r.stage, r.opt_in, r.param_in);
    EXPECT_EQ(plan.offload_optimizer, rules.offload_optimizer) << r.stage;
    EXPECT_EQ(plan.offload_param, rules.offload_param) << r.stage;
    // The rules' notes come first; the planner may add its own (swap buffer sizes) after them.
    ASSERT_GE(plan.notes.size(), rules.notes.size()) << r.stage;
    for (size_t i = 0; i < rules.notes.size(); ++i) EXPECT_EQ(plan.notes[i], rules.notes[i]);
  }
}

uint64_t Total(const std::vector<DeviceWorkingItem>& items, bool store_cache_only = false) {
  uint64_t sum = 0;
  for (const DeviceWorkingItem& it : items) {
    if (!store_cache_only || it.store_cache) sum += it.bytes;
  }
  return sum;
}

// The device working set by hand: 2 ranks, largest group 1000 elements (shard 500), 4000 in all
// (4 groups), 2-byte params and grads, groups above the persistence threshold, the optimizer
// not run by device kernels (HostDevice).
TEST(DeviceWorking, ItemsFollowStageOverlapAndLimits) {
  DeviceWorkingInput in;
  in.world = 2;
  in.largest_group_elems = 1000;
  in.largest_shard_elems = 500;
  in.total_group_elems = 4000;
  in.persistence_elems = 0;
  in.device_kernels = false;
  // Stage 0: one gradient buffer + its shard, 1500 x 2 B, + the norm exchange 2 x 16 B. The
  // optimizer is not partitioned: nothing is read back.
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(0, N, N), in)), 3000u + 32);
  // Stage 2: the fp32 read-back of a group (4000 B) is larger than the gradient buffers (3000 B):
  // its excess counts.
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(2, N, N), in)), 4000u + 32);
  // overlap_comm: three in flight (9000 B), more than the read-back.
  in.overlap_comm = true;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(2, N, N), in)), 9000u + 32);
  // Stage 3: + gathered groups. The reuse distance (1e9) keeps all 4; max_live 1000 caps the kept
  // copies at 1, + the one in use: 2 x 1000 x 2 B.
  in.max_live_elems = 1000;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, N), in)), 9032u + 2000 * 2);
  in.max_live_elems = 1000000;  // all 4
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, N), in)), 9032u + 4000 * 2);
  // A reuse distance of 4000 keeps the last 4000 / (2 x 1000) + 1 = 3 groups of forward.
  in.reuse_distance_elems = 4000;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, N), in)), 9032u + 3000 * 2);
  // 0 keeps only the last (used again at once); at least two are counted (a trainer may hold
  // two groups).
  in.reuse_distance_elems = 0;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, N), in)), 9032u + 2000 * 2);
  // Persistent groups (1000 <= the threshold) are all kept, whatever the reuse distance.
  in.persistence_elems = 1000;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, N), in)), 9032u + 4000 * 2);
  in.persistence_elems = 0;
  in.reuse_distance_elems = 1000000000;
  // Params on the host: + the store's shards on the device, all 4 kept: 2000 x 2 B.
  const auto cpu = DeviceWorkingSet(ResolvePlacement(3, N, C), in);
  EXPECT_EQ(Total(cpu, true), 2000u * 2);
  EXPECT_EQ(Total(cpu), 9032u + 8000 + 4000);
  // Reuse distance 2000: 2 kept; the prefetch window (1000 / 2 = 500 shard elements) is 1 shard.
  in.reuse_distance_elems = 2000;
  in.prefetch_elems = 1000;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, C), in), true), 2u * 500 * 2);
  // A prefetch window of 3 shards (3000 / 2 = 1500 elements) is more than the 2 kept.
  in.prefetch_elems = 3000;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, C), in), true), 3u * 500 * 2);
  // max_live 1001 -> 501 shard elements per rank: 1 shard + the one needed now.
  in.reuse_distance_elems = 1000000000;
  in.max_live_elems = 1001;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, V), in), true), 2u * 500 * 2);
  // The optimizer on a device with kernels (CUDA) and params off it: the param shards the step
  // writes, one per pipeline buffer (4 of the 4 groups), and the statistics slot of the rank's
  // one 5000-element sub-group (2 chunks + 2, 8 B each: an upper bound of 1 flag + 2 sums).
  in.device_kernels = true;
  in.largest_sub_group_elems = 5000;
  in.sub_groups = 1;
  in.sub_group_elems = 5000;
  const auto dev = DeviceWorkingSet(ResolvePlacement(3, N, C), in);
  EXPECT_EQ(Total(dev, true), 2u * 500 * 2 + 4 * 500 * 2);
  EXPECT_EQ(Total(dev), 9032u + 2000 * 2 + 2 * 500 * 2 + 4 * 500 * 2 + 32);
  // ... not when the optimizer is offloaded too.
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, C, C), in), true), 2u * 500 * 2);
  // One rank: the reduction is the identity, read from the trainer's buffer, and nothing is
  // read back even with a partitioned optimizer. One buffer, or three where the CPU accumulates
  // behind the backward (overlap_comm; a device without kernels, or gradients offloaded), or two
  // where the device's kernels accumulate in place with overlap_comm (one held back by the
  // trainer).
  DeviceWorkingInput one;
  one.device_kernels = false;
  one.largest_group_elems = one.largest_shard_elems = one.total_group_elems = 100;
  one.sub_groups = 1;
  one.sub_group_elems = 100;
  one.grad_elem_bytes = 4;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(2, N, N), one)), 400u + 16);
  one.overlap_comm = true;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(2, N, N), one)), 3 * 400u + 16);
  one.device_kernels = true;  // device-resident gradients: its kernels accumulate in place
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(2, N, N), one)), 2 * 400u + 16 + 24);  // stats
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(2, C, N), one)), 3 * 400u + 16);
  one.overlap_comm = false;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(2, N, N), one)), 400u + 16 + 24);
  one.overlap_comm = true;
  one.device_kernels = false;
  // qgZ reduces through its buffers even on one rank: 3 x (group + shard). Stage 3 on one rank
  // gathers nothing: the trainer reads the param shard (the whole group) itself.
  one.quantized_gradients = true;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, N), one)), 2400u + 16);
  // Params on the host: the store's shard copies stand in for the gathered groups, at least the
  // two a trainer may hold at once (one group here: one).
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, C), one), true), 100u * 2);
  one.total_group_elems = 400;
  one.reuse_distance_elems = 0;  // kept: the last one; no prefetch window
  one.prefetch_elems = 0;
  one.persistence_elems = 0;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, C), one), true), 2u * 100 * 2);
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, C), one)), 2400u + 16 + 2 * 100 * 2);
  // qwZ dequantizes into gathered buffers even on one rank: two of them, and the store keeps
  // the one shard it uses.
  one.quantized_weights = true;
  EXPECT_EQ(Total(DeviceWorkingSet(ResolvePlacement(3, N, C), one)),
            2400u + 16 + 2 * 100 * 2 + 100 * 2);
}

// The 2B run that showed the gap (`bench engine --params 2B --layers 32 --stage 3`, params on
// NVMe, DeepSpeed's defaults): 32 groups of 62.5e6; the reuse distance 1e9 keeps the last
// 1e9 / 1.25e8 + 1 = 9 of forward; max_live's 16 never binds. The engine measured 9 gathered
// groups and 9 shards (2.38 GB with the gradient buffer); the old max_live cap said 18 + 18.
TEST(DeviceWorking, Stage3PeakFollowsTheReuseDistanceNotMaxLive) {
  DeviceWorkingInput in;
  in.largest_group_elems = in.largest_shard_elems = 62500000;
  in.total_group_elems = 2000000000;
  Stage3Residency r = Stage3Peak(in);
  EXPECT_EQ(r.groups, 32u);
  EXPECT_EQ(r.kept, 9u);
  EXPECT_EQ(r.gathered, 9u);
  EXPECT_EQ(r.shards, 9u);
  // On 4 ranks the same counts: the limits and the shards both divide by N.
  in.world = 4;
  in.largest_shard_elems = 62500000 / 4;
  r = Stage3Peak(in);
  EXPECT_EQ(r.gathered, 9u);
  EXPECT_EQ(r.shards, 9u);
  // max_live below what the reuse distance keeps: it binds (4 kept copies + 1 in use; the
  // prefetcher keeps 4 shards + the one needed now).
  in.max_live_elems = 250000000;
  r = Stage3Peak(in);
  EXPECT_EQ(r.gathered, 5u);
  EXPECT_EQ(r.shards, 5u);
  // A model smaller than the reuse distance: everything stays.
  in.max_live_elems = 1000000000;
  in.total_group_elems = 8 * 62500000;
  r = Stage3Peak(in);
  EXPECT_EQ(r.groups, 8u);
  EXPECT_EQ(r.gathered, 8u);
  EXPECT_EQ(r.shards, 8u);
}

// The host cache: what the budget leaves beyond the working set, at most the NVMe-homed bytes
// the swap buffers do not already hold.
TEST(HostCache, IsWhatTheBudgetLeavesUpToTheNvmeBytes) {
  EXPECT_EQ(HostCacheBytes(8000, 5000, 100000, 1000), 3000u);  // the budget binds
  EXPECT_EQ(HostCacheBytes(80000, 5000, 10000, 1000), 9000u);  // the NVMe bytes bind
  EXPECT_EQ(HostCacheBytes(4000, 5000, 10000, 1000), 0u);      // over budget: no room
  EXPECT_EQ(HostCacheBytes(8000, 5000, 0, 0), 0u);             // nothing on NVMe
  EXPECT_EQ(HostCacheBytes(8000, 5000, 500, 1000), 0u);        // buffers hold it all
}

// The speculative step's rollback copies (14 bytes an element at 16-bit, 16 at fp32): a given
// size is capped at the offloaded elements; auto is a quarter of them, or all of them up to
// kSpeculationFloorBytes where that is more, within the host room.
TEST(SpeculationBuffer, AutoIsAQuarterOrASmallModelWholeWithinTheRoom) {
  constexpr uint64_t kNoBudget = UINT64_MAX;
  EXPECT_EQ(SpeculationBytesPerElement(2), 14u);
  EXPECT_EQ(SpeculationBufferBytes(1000, 5000, 2, kNoBudget), 1000u * 14);
  EXPECT_EQ(SpeculationBufferBytes(9000, 5000, 2, 0), 5000u * 14);  // given: the room is not asked
  EXPECT_EQ(SpeculationBufferBytes(0, 5000, 2, kNoBudget), 0u);
  // A small model: all of it (12.7M fp32 elements, 203 MB of copies).
  EXPECT_EQ(SpeculationBufferBytes(-1, 12'700'000, 4, kNoBudget), 12'700'000u * 16);
  // Beyond the floor, the floor's elements until a quarter is more.
  const uint64_t floor_elems = kSpeculationFloorBytes / 14;
  EXPECT_EQ(SpeculationBufferBytes(-1, 2 * floor_elems, 2, kNoBudget), floor_elems * 14);
  EXPECT_EQ(SpeculationBufferBytes(-1, 8 * floor_elems, 2, kNoBudget), 2 * floor_elems * 14);
  // The host room caps auto.
  EXPECT_EQ(SpeculationBufferBytes(-1, 12'700'000, 4, 1000), 1000u);
  EXPECT_EQ(SpeculationBufferBytes(-1, 0, 4, kNoBudget), 0u);
}

TEST(DeviceWorking, ShardLimitsDivideFullParameterCounts) {
  const ShardLimits l = PerRankShardLimits(50000000, 1000000000, 7, 4);
  EXPECT_EQ(l.prefetch_elems, 12500000u);
  EXPECT_EQ(l.max_live_elems, 250000000u);
  EXPECT_EQ(l.reuse_distance_elems, 2u);                         // rounded up
  EXPECT_EQ(PerRankShardLimits(0, 8, 8, 4).prefetch_elems, 0u);  // 0 stays 0
  EXPECT_EQ(PerRankShardLimits(3, 3, 3, 1).max_live_elems, 3u);
}

// The planner lists the same device items (per-group buffers, not DeepSpeed's buckets).
TEST(DeviceWorking, PlannerListsTheSameItems) {
  PlanInput in;
  in.params = 4000;
  in.largest_group_params = 1000;
  in.capacity.gpus_per_node = 2;
  in.zero.max_live_parameters = 1000;
  const Placement p = Place(in, 3, C, C);
  DeviceWorkingInput dw;
  dw.world = 2;
  dw.largest_group_elems = 1000;
  dw.largest_shard_elems = 500;
  dw.total_group_elems = 4000;
  dw.overlap_comm = true;  // DeepSpeed's default at stage 3
  dw.max_live_elems = 1000;
  const auto items = DeviceWorkingSet(ResolvePlacement(3, C, C), dw);
  EXPECT_DOUBLE_EQ(p.hbm_bytes_per_gpu, static_cast<double>(Total(items)));
  for (const DeviceWorkingItem& it : items) {
    bool listed = false;
    for (const PlanItem& pi : p.items) listed |= pi.tier == D && pi.name == it.name;
    EXPECT_TRUE(listed) << it.name;
  }
}

// Partial optimizer offload (offload_optimizer.ratio): the device keeps the longest prefix of the
// sub-groups, in forward order, whose elements are at most total - ceil(total x ratio).
size_t Resident(double ratio, const std::vector<uint64_t>& elems, int stage = 3,
                OffloadDevice opt = C) {
  return DeviceResidentSubGroups(ResolvePlacement(stage, opt, N, ratio), elems);
}

TEST(PartialOffload, RatioOneOffloadsEverythingAndZeroNothing) {
  const std::vector<uint64_t> four(4, 100);
  EXPECT_EQ(Resident(1.0, four), 0u);
  EXPECT_EQ(Resident(0.0, four), 4u);
  EXPECT_EQ(Resident(0.0, four, 3, V), 4u);
  // Ratio 1 is exactly the full offload: the placement is the one without a ratio.
  const StatePlacement full = ResolvePlacement(3, C, N, 1.0);
  EXPECT_EQ(full.optimizer_ratio, 1.0);
  EXPECT_TRUE(full.notes.empty());
  for (StateKind k : {StateKind::kGrad, StateKind::kMaster32, StateKind::kExpAvg,
                      StateKind::kExpAvgSq, StateKind::kParam16}) {
    EXPECT_EQ(full.Home(k), ResolvePlacement(3, C, N).Home(k));
    EXPECT_EQ(full.SubGroupHome(k, false), full.Home(k));
  }
  // A device-resident sub-group: its optimizer states and gradient on the device, never params.
  const StatePlacement half = ResolvePlacement(3, V, V, 0.5);
  EXPECT_EQ(half.SubGroupHome(StateKind::kMaster32, true), D);
  EXPECT_EQ(half.SubGroupHome(StateKind::kGrad, true), D);
  EXPECT_EQ(half.SubGroupHome(StateKind::kExpAvgSq, true), D);
  EXPECT_EQ(half.SubGroupHome(StateKind::kParam16, true), S);
  EXPECT_EQ(half.SubGroupHome(StateKind::kMaster32, false), S);
}

TEST(PartialOffload, HalfKeepsTheFirstHalfByElements) {
  EXPECT_EQ(Resident(0.5, std::vector<uint64_t>(4, 100)), 2u);
  EXPECT_EQ(Resident(0.25, std::vector<uint64_t>(4, 100)), 3u);
  EXPECT_EQ(Resident(0.75, std::vector<uint64_t>(4, 100)), 1u);
  // Rounding: at least ceil(r x total) offloaded. 3 x 100 at 0.5: 150 offloaded at least, the
  // device keeps at most 150: one sub-group.
  EXPECT_EQ(Resident(0.5, std::vector<uint64_t>(3, 100)), 1u);
  // 0.07 x 100 is 7.000000000000001 in doubles; the millionth rule makes it 7 exactly: 93 kept.
  EXPECT_EQ(Resident(0.07, std::vector<uint64_t>(100, 1)), 93u);
  EXPECT_EQ(DeviceResidentLimit(0.07, 100), 93u);
  EXPECT_EQ(DeviceResidentLimit(0.9, 10), 1u);  // 1 - 0.9 is below 0.1 in doubles
  EXPECT_EQ(DeviceResidentLimit(0.5, 3), 1u);
  EXPECT_EQ(DeviceResidentLimit(1e-7, 100), 100u);  // below a millionth: 0
  EXPECT_EQ(DeviceResidentLimit(0.3, uint64_t{1} << 60),
            (uint64_t{1} << 60) - ((uint64_t{1} << 60) * 3 + 9) / 10);  // exact, no overflow
}

TEST(PartialOffload, OneSubGroupStaysOnlyAtRatioZero) {
  EXPECT_EQ(Resident(0.0, {1000}), 1u);
  EXPECT_EQ(Resident(0.000001, {1000}), 0u);
  EXPECT_EQ(Resident(0.5, {1000}), 0u);
  EXPECT_EQ(Resident(0.5, {}), 0u);
}

TEST(PartialOffload, UnevenSubGroupsEndThePrefixAtTheFirstThatDoesNotFit) {
  // Total 1000; ratio 0.5: the device keeps at most 500 elements.
  EXPECT_EQ(Resident(0.5, {100, 300, 200, 100, 300}), 2u);  // 400; 600 would not fit
  // The first sub-group larger than the limit ends the prefix: none stays, though a later
  // smaller one would fit.
  EXPECT_EQ(Resident(0.5, {600, 100, 100, 100, 100}), 0u);
  EXPECT_EQ(Resident(0.4, {600, 100, 100, 100, 100}), 1u);  // 600 fits exactly
}

TEST(PartialOffload, AppliesAtStageThreeWithTheOptimizerOffloadedOnly) {
  const std::vector<uint64_t> four(4, 100);
  // Below stage 3 the ratio is ignored with a note (the config checks refuse it there).
  const StatePlacement s2 = ResolvePlacement(2, C, N, 0.5);
  EXPECT_EQ(s2.optimizer_ratio, 1.0);
  ASSERT_EQ(s2.notes.size(), 1u);
  EXPECT_NE(s2.notes[0].find("ratio"), std::string::npos) << s2.notes[0];
  EXPECT_EQ(Resident(0.5, four, 2), 0u);
  // No optimizer offload: nothing to split (every home is the device anyway), no note.
  const StatePlacement none = ResolvePlacement(3, N, C, 0.5);
  EXPECT_EQ(none.optimizer_ratio, 1.0);
  EXPECT_TRUE(none.notes.empty());
  EXPECT_EQ(Resident(0.5, four, 3, N), 0u);
  // Out-of-range values are clamped.
  EXPECT_EQ(ResolvePlacement(3, C, N, -1).optimizer_ratio, 0.0);
  EXPECT_EQ(ResolvePlacement(3, C, N, 2).optimizer_ratio, 1.0);
}

}  // namespace
}  // namespace strata::sched
