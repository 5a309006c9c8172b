// Partial optimizer offload (zero_optimization.offload_optimizer.ratio, sched/placement.h
// DeviceResidentSubGroups): the first sub-groups in forward order keep their optimizer states and
// gradient on the device, the rest are offloaded. Where a state lives never changes a result:
// every ratio trains to the full offload's bits, the layout counts each tier's bytes by the rule,
// and a checkpoint saved at one ratio resumes at another bit for bit. Model and harness:
// engine_test_model.h.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine_test_model.h"

namespace strata::testing {
namespace {

struct Case {
  int world;
  const char* opt;
  const char* param;
  const char* precision;
};

std::string Config(const Case& c, double ratio) {
  const std::string precision = c.precision;
  return WithOffloadRatio(R"({
  "train_micro_batch_size_per_gpu": 3,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "bf16": {"enabled": )" + std::string(precision == "bf16" ? "true" : "false") +
                              R"(},
  "fp16": {"enabled": )" + std::string(precision == "fp16" ? "true" : "false") +
                              R"(, "initial_scale_power": 8},
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": ")" +
                              c.opt +
                              R"(", "nvme_path": "/tmp"},
    "offload_param": {"device": ")" +
                              c.param +
                              R"(", "nvme_path": "/tmp"},
    "sub_group_size": 256,
    "stage3_param_persistence_threshold": 64
  }
})",
                          ratio);
}

std::string Name(const Case& c, double ratio) {
  return "world " + std::to_string(c.world) + " opt " + c.opt + " param " + c.param + " " +
         c.precision + " ratio " + std::to_string(ratio);
}

// Stage 3, optimizer on cpu and nvme, params on every tier, 1 and 2 ranks.
constexpr Case kCases[] = {{1, "cpu", "none", "bf16"},
                           {1, "nvme", "nvme", "fp32"},
                           {2, "cpu", "cpu", "fp16"},
                           {2, "nvme", "none", "bf16"},
                           {2, "nvme", "cpu", "bf16"}};

// Ratios 0.5 and 0 train to the bits of ratio 1 (the full offload) over several steps, and each
// rank's layout moves exactly the device-resident sub-groups' blocks from the offload tier to the
// device: 4 blocks each, whole 4 KiB units offloaded (sub-groups of 256 fp32 elements: one unit
// per block), their exact 16 B per element on the device.
TEST(PartialOffload, EveryRatioTrainsToTheFullOffloadsBits) {
  constexpr int kSteps = 4;
  for (const Case& c : kCases) {
    RunSpec spec;
    spec.world = c.world;
    spec.steps = kSteps;
    spec.config_json = Config(c, 1.0);
    const RunResult full = RunEngine(spec);
    ASSERT_TRUE(full.status.ok()) << Name(c, 1.0) << ": " << full.status.ToString();
    const auto init = RunReference(c.world, 0, 1, 0.01f, 0.01f);
    ASSERT_FALSE(BitEqual(full.master, init)) << "training did not move the weights";
    const Tier off = std::string(c.opt) == "cpu" ? Tier::kHost : Tier::kNvme;
    for (const EngineLayout& l : full.layouts) {
      EXPECT_EQ(l.device_sub_groups, 0u);
      EXPECT_EQ(l.offloaded_fraction, 1.0);
      EXPECT_EQ(l.ToString().find("% offloaded"), std::string::npos);
    }
    for (double ratio : {0.5, 0.0}) {
      const std::string name = Name(c, ratio);
      spec.config_json = Config(c, ratio);
      const RunResult part = RunEngine(spec);
      ASSERT_TRUE(part.status.ok()) << name << ": " << part.status.ToString();
      EXPECT_TRUE(BitEqual(part.master, full.master))
          << name << " differs from ratio 1 by " << MaxAbsDiff(part.master, full.master);
      ASSERT_EQ(part.reports.size(), full.reports.size());
      for (size_t i = 0; i < full.reports.size(); ++i) {
        EXPECT_EQ(part.reports[i].grad_norm, full.reports[i].grad_norm) << name << " step " << i;
        EXPECT_EQ(part.reports[i].skipped, full.reports[i].skipped) << name << " step " << i;
      }
      for (size_t r = 0; r < part.layouts.size(); ++r) {
        const EngineLayout& l = part.layouts[r];
        const EngineLayout& f = full.layouts[r];
        SCOPED_TRACE(name + " rank " + std::to_string(r));
        EXPECT_EQ(l.optimizer_ratio, ratio);
        if (ratio == 0.0) {
          EXPECT_EQ(l.device_sub_groups, l.sub_groups);
          EXPECT_EQ(l.offloaded_fraction, 0.0);
        } else {
          EXPECT_GT(l.device_sub_groups, 0u);
          EXPECT_LT(l.device_sub_groups, l.sub_groups);
          EXPECT_GE(l.offloaded_fraction, ratio);
        }
        const uint64_t moved_units = 4 * l.device_sub_groups * 4096;
        EXPECT_EQ(f.state_bytes[off] - l.state_bytes[off], moved_units);
        const uint64_t gained = l.state_bytes[Tier::kDevice] - f.state_bytes[Tier::kDevice];
        EXPECT_EQ(gained % 16, 0u);
        // Sub-groups of 128 (a shard's aligned rest) to 256 elements.
        EXPECT_GE(gained, 16 * 128 * l.device_sub_groups);
        EXPECT_LE(gained, 16 * 256 * l.device_sub_groups);
        EXPECT_NE(
            l.ToString().find("% offloaded (" + std::to_string(l.sub_groups - l.device_sub_groups) +
                              " of " + std::to_string(l.sub_groups) + " sub-groups"),
            std::string::npos)
            << l.ToString();
      }
    }
  }
}

// A checkpoint saved at ratio 0.5 (2 ranks, optimizer and params on NVMe) loads at ratio 1 and
// at ratio 0 and continues to the uninterrupted run's bits: the checkpoint does not depend on
// where the states lived.
TEST(PartialOffload, CheckpointSavedAtOneRatioResumesAtAnother) {
  const Case c{2, "nvme", "nvme", "bf16"};
  const std::string dir = UniqueTestDir("ckpt_partial_offload");
  RunSpec base;
  base.world = c.world;
  base.steps = 6;
  base.config_json = Config(c, 1.0);
  const RunResult full = RunEngine(base);
  ASSERT_TRUE(full.status.ok()) << full.status.ToString();

  RunSpec first = base;
  first.config_json = Config(c, 0.5);
  first.steps = 3;
  first.after_step = [&](int, int step, Engine& e) -> Status {
    return step == 2 ? e.Save(dir, "half") : Status::OK();
  };
  const RunResult saved = RunEngine(first);
  ASSERT_TRUE(saved.status.ok()) << saved.status.ToString();
  ASSERT_GT(saved.layouts[0].device_sub_groups, 0u);

  for (double ratio : {1.0, 0.0}) {
    RunSpec resume = base;
    resume.config_json = Config(c, ratio);
    resume.first_step = 3;
    resume.init = [&](int, Engine& e) -> Status {
      STRATA_RETURN_IF_ERROR(e.Load(dir, "half"));
      if (e.global_step() != 3) return Status::Internal("global_step not restored");
      return Status::OK();
    };
    const RunResult resumed = RunEngine(resume);
    ASSERT_TRUE(resumed.status.ok()) << ratio << ": " << resumed.status.ToString();
    EXPECT_TRUE(BitEqual(resumed.master, full.master))
        << "resumed at ratio " << ratio << " diverged by "
        << MaxAbsDiff(resumed.master, full.master);
  }
  std::filesystem::remove_all(dir);
}

// The budgets are checked with the split: a device budget that holds the full offload but not
// the device-resident sub-groups refuses ratio 0, naming the device (hbm) tier.
TEST(PartialOffload, DeviceBudgetCountsTheResidentSubGroups) {
  const Case c{1, "cpu", "none", "bf16"};
  RunSpec spec;
  spec.steps = 1;
  spec.config_json = Config(c, 1.0);
  const RunResult full = RunEngine(spec);
  ASSERT_TRUE(full.status.ok()) << full.status.ToString();
  const EngineLayout& f = full.layouts[0];
  // 16 KiB of room, and a 4 KiB page per group and buffer (HostDevice allocates whole pages, the
  // layout counts device bytes exactly); ratio 0 keeps all 3840 sub-group elements (60 KiB of
  // states) on the device.
  spec.device_budget =
      f.state_bytes[Tier::kDevice] + f.working_bytes[Tier::kDevice] + 16384 + 4 * 4096;
  spec.config_json = Config(c, 0.0);
  const RunResult none = RunEngine(spec);
  ASSERT_FALSE(none.status.ok());
  EXPECT_NE(none.status.ToString().find("hbm tier"), std::string::npos) << none.status.ToString();
  spec.config_json = Config(c, 1.0);
  const RunResult again = RunEngine(spec);
  EXPECT_TRUE(again.status.ok()) << again.status.ToString();
}

}  // namespace
}  // namespace strata::testing
