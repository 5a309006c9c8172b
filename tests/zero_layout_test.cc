// sched::LayOutStates, the one layout rule of a rank's states, and the proof that the planner and
// the engine take their state bytes from it: for the same model and DeepSpeed config, the bytes
// `Place()` lists per tier are the bytes the engine's layout budgets (both from
// ResolveZeroSettings + LayOutStates).
#include "sched/zero_layout.h"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "strata/config.h"
#include "strata/planner.h"
#include "tests/engine_test_model.h"

namespace strata {
namespace {

using D = OffloadDevice;

TEST(ZeroLayout, ShardAndSubGroupRules) {
  EXPECT_EQ(sched::ShardElems(1000, 3, 1), 334u);
  EXPECT_EQ(sched::ShardElems(1000, 3, 128), 384u);
  EXPECT_EQ(sched::ShardElems(0, 4, 128), 0u);
  // sub_group_size, rounded down to the alignment, at least one unit; 0: the largest tensor.
  EXPECT_EQ(sched::SubGroupElems(1000, 5000, 128), 896u);
  EXPECT_EQ(sched::SubGroupElems(100, 5000, 128), 128u);
  EXPECT_EQ(sched::SubGroupElems(0, 5000, 128), 4992u);
  EXPECT_EQ(sched::SubGroupElems(0, 5000, 1), 5000u);
  EXPECT_EQ(sched::SubGroupsOf(1000, 300), 4u);
  EXPECT_EQ(sched::SubGroupsOf(900, 300), 3u);
}

TEST(ZeroLayout, BytesPerHomeByHand) {
  // Stage 2, optimizer on the host, 2 ranks; groups of 1000 and 3 x 260 elements, shards
  // aligned to 16: 512 and 3 x 144; sub-groups of 200: 512 -> 200 + 200 + 112, 144 -> 144.
  const sched::StatePlacement pl = sched::ResolvePlacement(2, D::kCpu, D::kNone);
  sched::StateLayoutInput in;
  in.world = 2;
  in.groups = {{1000, 1}, {260, 3}};
  in.sub_group_elems = 200;
  in.shard_align_elems = 16;
  in.block_align_bytes = 512;
  in.widths = {2, 4, 4, 4, 4};
  const sched::StateLayout L = sched::LayOutStates(pl, in);
  // Params (device, exact): full padded groups, (1024 + 3 x 288) x 2 B.
  EXPECT_EQ(L.param_bytes, (1024.0 + 3 * 288) * 2);
  // Host blocks in 512 B units: 200 x 4 = 800 -> 1024, 112 x 4 = 448 -> 512, 144 x 4 -> 1024.
  const double grad = 2 * 1024 + 512 + 3 * 1024;
  EXPECT_EQ(L.grad_bytes, grad);
  EXPECT_EQ(L.optimizer_bytes, 3 * grad);
  EXPECT_EQ(L.tier_bytes[Tier::kHost], 4 * grad);
  EXPECT_EQ(L.tier_bytes[Tier::kDevice], L.param_bytes);
  EXPECT_EQ(L.sub_groups, 3u + 3u);
  EXPECT_EQ(L.largest_sub, 200u);
  EXPECT_EQ(L.largest_shard, 512u);
  EXPECT_EQ(L.largest_padded, 1024u);
  EXPECT_EQ(L.largest_numel, 1000u);
  EXPECT_EQ(L.total_padded, 1024u + 3 * 288);
  // Stage 0: every rank steps every rank's sub-groups (a full replica of the optimizer).
  const sched::StateLayout L0 = sched::LayOutStates(sched::ResolvePlacement(0, D::kNone, D::kNone), in);
  EXPECT_EQ(L0.sub_groups, 2 * L.sub_groups);
  // Device-homed: exact bytes, 2 x (1024 + 3 x 288) x 4 B of gradients.
  EXPECT_EQ(L0.grad_bytes, 2 * (512.0 + 3 * 144) * 4);
  // Stage 3: the param shard only.
  const sched::StateLayout L3 = sched::LayOutStates(sched::ResolvePlacement(3, D::kNone, D::kNone), in);
  EXPECT_EQ(L3.param_bytes, (512.0 + 3 * 144) * 2);
}

// A model of `groups` groups of `numel` elements, one tensor each.
ModelSpec Uniform(int groups, size_t numel) {
  ModelSpec m;
  for (int g = 0; g < groups; ++g) {
    GroupSpec gs;
    gs.name = "layer" + std::to_string(g);
    gs.params.push_back({gs.name + ".weight", {static_cast<int64_t>(numel)}});
    m.groups.push_back(gs);
  }
  return m;
}

// The planner's state items (params, grads, optimizer state) per rank and tier.
PerTier<double> PlannedStateBytes(const Placement& p, int gpus_per_node) {
  PerTier<double> out{};
  for (const PlanItem& it : p.items) {
    const bool state = it.name.rfind("params, ", 0) == 0 || it.name.rfind("grads ", 0) == 0 ||
                       it.name.rfind("optimizer state", 0) == 0;
    if (!state) continue;
    out[it.tier] += it.tier == Tier::kDevice ? it.bytes : it.bytes / gpus_per_node;
  }
  return out;
}

TEST(ZeroLayout, PlannerAndEngineLayTheSameStates) {
  // Sizes whose blocks fill whole 4 KiB units and whose shards need no alignment padding, so the
  // planner's exact bytes and the engine's store units agree to the byte.
  constexpr int kWorld = 2, kGroups = 3;
  constexpr size_t kNumel = 16384;  // shards of 8192; sub-groups of 2048 -> 8 KiB fp32 blocks
  struct Case {
    int stage;
    const char* opt;
    const char* param;
    const char* precision;
    double ratio = 1.0;  // offload_optimizer.ratio (partial offload at stage 3)
  };
  const Case cases[] = {{0, "none", "none", "bf16"},     {1, "none", "none", "bf16"},
                        {2, "cpu", "none", "fp16"},      {3, "none", "none", "bf16"},
                        {3, "cpu", "cpu", "bf16"},       {3, "nvme", "nvme", "fp16"},
                        {2, "none", "none", "fp32"},     {3, "nvme", "cpu", "fp32"},
                        {3, "cpu", "none", "bf16", 0.5}, {3, "nvme", "nvme", "fp16", 0.3},
                        {3, "cpu", "cpu", "bf16", 0.0},  {3, "nvme", "cpu", "fp32", 0.75}};
  for (const Case& c : cases) {
    const std::string where = "stage " + std::to_string(c.stage) + " optimizer " + c.opt +
                              " params " + c.param + " " + c.precision + " ratio " +
                              std::to_string(c.ratio);
    const std::string json =
        std::string("{\"train_micro_batch_size_per_gpu\": 1, \"") +
        (std::string(c.precision) == "fp32" ? "bf16" : c.precision) +
        "\": {\"enabled\": " + (std::string(c.precision) == "fp32" ? "false" : "true") +
        "}, \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": "
        "0.001}}, \"zero_optimization\": {\"stage\": " +
        std::to_string(c.stage) +
        ", \"sub_group_size\": 2048, \"offload_optimizer\": "
        "{\"device\": \"" +
        c.opt + "\", \"nvme_path\": \"/tmp\", \"ratio\": " + std::to_string(c.ratio) +
        "}, \"offload_param\": "
        "{\"device\": \"" +
        c.param + "\", \"nvme_path\": \"/tmp\"}}}";
    // The engine, on kWorld ranks.
    auto parsed = ParseDeepSpeedConfig(json);
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    const std::string dir = testing::UniqueTestDir("zero_layout");
    std::vector<EngineLayout> layouts(kWorld);
    const std::vector<Status> st = testing::OnHostRanks(
        kWorld, dir + "/rdzv", parsed->config, [&](int r, EngineOptions eo) -> Status {
          eo.io_kind = IoBackendKind::kSimulated;
          eo.nvme_paths = {dir};
          STRATA_ASSIGN_OR_RETURN(auto engine,
                                  Engine::Create(Uniform(kGroups, kNumel), std::move(eo)));
          layouts[r] = engine->layout();
          return Status::OK();
        });
    for (const Status& s : st) ASSERT_TRUE(s.ok()) << where << ": " << s.ToString();
    const EngineLayout& engine = layouts[0];
    // The planner, from the same config.
    PlanInput in;
    std::vector<std::string> notes;
    ApplyEngineConfig(parsed->config, &in, &notes);
    in.params = kGroups * static_cast<double>(kNumel);
    in.largest_group_params = kNumel;
    in.capacity.gpus_per_node = kWorld;
    in.capacity.nodes = 1;
    const Placement plan = Place(in, in.zero.stage, in.zero.offload_optimizer,
                                 in.zero.offload_param, in.zero.optimizer_ratio);
    const PerTier<double> planned = PlannedStateBytes(plan, kWorld);
    EXPECT_EQ(engine.sub_groups, kGroups * (c.stage == 0 ? kWorld : 1) * (kNumel / kWorld / 2048))
        << where;
    for (Tier t : kAllTiers) {
      EXPECT_EQ(static_cast<double>(engine.state_bytes[t]), planned[t])
          << where << ", tier " << TierName(t);
    }
    // The same share offloaded on both sides; 12 sub-groups of 2048 per rank, so each ratio
    // here keeps a whole number of them: floor((1 - r) x 12) on the device.
    EXPECT_DOUBLE_EQ(engine.offloaded_fraction, plan.optimizer_offloaded_fraction) << where;
    if (c.stage == 3 && std::string(c.opt) != "none") {
      const auto kept = static_cast<size_t>((1 - c.ratio) * 12 + 1e-9);
      EXPECT_EQ(engine.device_sub_groups, kept) << where;
    }
  }
}

// The partial-offload prefix LayOutStates walks over runs of groups is DeviceResidentSubGroups'
// over the listed sub-groups: uneven groups, a short last sub-group, frozen runs, every ratio.
TEST(ZeroLayout, PartialOffloadRunsAgreeWithTheListedRule) {
  sched::StateLayoutInput in;
  in.world = 1;
  in.sub_group_elems = 100;
  in.groups = {{250, 3}, {40, 1}, {1000, 1, false}, {130, 2}, {100, 1}};
  in.block_align_bytes = 4096;
  in.widths = {2, 4, 4, 4, 4};
  // The sub-groups in forward order, as the engine cuts them.
  std::vector<uint64_t> elems;
  for (const sched::GroupRun& run : in.groups) {
    if (!run.trainable) continue;
    for (uint64_t k = 0; k < run.count; ++k) {
      for (uint64_t o = 0; o < run.numel; o += 100)
        elems.push_back(std::min<uint64_t>(100, run.numel - o));
    }
  }
  for (double ratio : {0.0, 0.01, 0.1, 0.25, 0.33, 0.5, 0.61, 0.75, 0.9, 0.99, 1.0}) {
    for (D opt : {D::kCpu, D::kNvme}) {
      const sched::StatePlacement p = sched::ResolvePlacement(3, opt, D::kNone, ratio);
      const size_t k = sched::DeviceResidentSubGroups(p, elems);
      const sched::StateLayout L = sched::LayOutStates(p, in);
      EXPECT_EQ(L.device_sub_groups, k) << ratio;
      uint64_t kept = 0;
      for (size_t i = 0; i < k; ++i) kept += elems[i];
      EXPECT_EQ(L.device_sub_group_elems, kept) << ratio;
      EXPECT_EQ(L.sub_group_elems, 250u * 3 + 40 + 130 * 2 + 100);
      // Device blocks exact (16 B per element), offloaded ones in whole 4 KiB units per block.
      EXPECT_EQ(L.device_optimizer_bytes + L.device_grad_bytes, 16.0 * static_cast<double>(kept));
      EXPECT_EQ(L.tier_bytes[Tier::kDevice], L.param_bytes + 16.0 * static_cast<double>(kept))
          << ratio;
      EXPECT_EQ(L.tier_bytes[sched::OffloadTier(opt)],
                static_cast<double>(4 * 4096 * (elems.size() - k)))
          << ratio;
    }
  }
}

}  // namespace
}  // namespace strata
