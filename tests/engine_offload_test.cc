// Engine::OffloadStates / ReloadStates (include/strata/engine.h): training that lends the device
// out between steps gives the same bits as training that does not, on every placement, on the
// HostDevice and on the emulated device (memory the host cannot address), at one and two ranks;
// while offloaded the device tier holds nothing, the calls that use the states are refused
// without failing the engine, and a reload the device has no room for finishes later.
#include <string>

#include <gtest/gtest.h>

#include "device_equivalence.h"
#include "emulated_device.h"
#include "engine_test_model.h"

namespace strata::testing {
namespace {

struct Devices {
  std::vector<std::unique_ptr<EmulatedDevice>> per_rank;
};

void UseEmulated(RunSpec& spec, Devices& devices) {
  for (int r = 0; r < spec.world; ++r) {
    EmulatedDeviceOptions o;
    o.host.budget_bytes = spec.device_budget;
    auto d = EmulatedDevice::Create(o);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    devices.per_rank.push_back(std::move(*d));
  }
  spec.device = [&devices](int r) -> Device* { return devices.per_rank[r].get(); };
}

bool RefusedAsOffloaded(const Status& st) {
  return st.code() == Status::Code::kFailedPrecondition &&
         st.message().find("OffloadStates") != std::string::npos;
}

struct Case {
  int world, stage;
  const char* opt;
  const char* param;
  bool emulated;
};

std::string Name(const Case& c) {
  return "world " + std::to_string(c.world) + " stage " + std::to_string(c.stage) + " opt " +
         c.opt + " param " + c.param + (c.emulated ? " emulated" : " host");
}

TEST(EngineOffload, TrainingAcrossAnOffloadGivesTheSameBits) {
  for (const Case c : {Case{1, 1, "none", "none", false}, Case{1, 3, "none", "none", true},
                       Case{2, 3, "none", "none", false}, Case{2, 2, "cpu", "none", true},
                       Case{1, 3, "cpu", "cpu", false}, Case{1, 3, "nvme", "nvme", true}}) {
    SCOPED_TRACE(Name(c));
    RunSpec plain;
    plain.config_json = DeviceCaseConfig(c.stage, c.opt, c.param, "bf16", 1.0, 1);
    plain.world = c.world;
    Devices plain_devices;
    if (c.emulated) UseEmulated(plain, plain_devices);
    const RunResult ref = RunEngine(plain);
    ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();

    RunSpec lent = plain;
    Devices lent_devices;
    if (c.emulated) UseEmulated(lent, lent_devices);
    const bool device_state = std::string(c.opt) == "none" || std::string(c.param) == "none";
    lent.before_step = [&](int, int step, Engine& e) {
      if (step == 0) return;
      ASSERT_TRUE(e.OffloadStates().ok());
      EXPECT_EQ(e.states_offloaded(), device_state);
      EXPECT_EQ(e.Stats().store.used_bytes[Tier::kDevice], 0u);  // aside, or dropped
      if (!device_state) return;
      EXPECT_TRUE(RefusedAsOffloaded(e.Gather(0).status()));
      EXPECT_TRUE(RefusedAsOffloaded(e.GradBuffer(0).status()));
      EXPECT_TRUE(RefusedAsOffloaded(e.Step().status()));
      std::vector<float> master(e.model().groups[0].numel());
      EXPECT_TRUE(RefusedAsOffloaded(e.ReadMaster(0, master)));
      EXPECT_TRUE(e.health().ok());
      EXPECT_TRUE(e.Synchronize().ok());
      ASSERT_TRUE(e.OffloadStates().ok());  // again: nothing left to move
      ASSERT_TRUE(e.ReloadStates().ok());
      EXPECT_FALSE(e.states_offloaded());
      EXPECT_TRUE(e.ReloadStates().ok());  // nothing offloaded: nothing to do
    };
    const RunResult r = RunEngine(lent);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_TRUE(BitEqual(r.master, ref.master));
    for (size_t i = 0; i < r.reports.size(); ++i) {
      EXPECT_EQ(r.reports[i].grad_norm, ref.reports[i].grad_norm) << "step " << i;
    }
  }
}

// Chosen kinds only: the optimizer state leaves, the params stay and may still be gathered.
TEST(EngineOffload, OnlyTheChosenKindsLeave) {
  RunSpec spec;
  spec.config_json = DeviceCaseConfig(3, "none", "none", "fp32", 1.0, 1);
  spec.before_step = [&](int, int step, Engine& e) {
    if (step != 1) return;
    const uint64_t before = e.Stats().store.used_bytes[Tier::kDevice];
    OffloadStatesOptions o;
    o.kinds = std::vector<StateKind>{StateKind::kExpAvg, StateKind::kExpAvgSq};
    ASSERT_TRUE(e.OffloadStates(o).ok());
    const uint64_t after = e.Stats().store.used_bytes[Tier::kDevice];
    EXPECT_LT(after, before);
    EXPECT_GT(after, 0u);  // the params, masters and gradients stayed
    EXPECT_TRUE(RefusedAsOffloaded(e.Gather(0).status()));  // still refused: the step needs m, v
    o.kinds = std::vector<StateKind>{StateKind::kParam16};
    ASSERT_TRUE(e.OffloadStates(o).ok());  // a second call adds a kind
    EXPECT_LT(e.Stats().store.used_bytes[Tier::kDevice], after);
    ASSERT_TRUE(e.ReloadStates().ok());
    EXPECT_EQ(e.Stats().store.used_bytes[Tier::kDevice], before);
  };
  RunSpec plain = spec;
  plain.before_step = nullptr;
  const RunResult ref = RunEngine(plain);
  const RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_TRUE(BitEqual(r.master, ref.master));
}

// Mid-backward is refused, changing nothing; a reload without room finishes once room is back.
TEST(EngineOffload, RefusedMidBackwardAndAReloadWithoutRoomFinishesLater) {
  RunSpec spec;
  spec.config_json = DeviceCaseConfig(3, "none", "none", "fp32", 1.0, 1);
  Devices devices;
  UseEmulated(spec, devices);
  spec.before_step = [&](int, int step, Engine& e) {
    if (step != 1) return;
    {
      auto g = e.Gather(0);
      ASSERT_TRUE(g.ok());
      Status st = e.OffloadStates();
      EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
      EXPECT_NE(st.message().find("gathered"), std::string::npos) << st.ToString();
      e.Release(std::move(*g));
    }
    ASSERT_TRUE(e.OffloadStates().ok());
    // Other work takes the device's memory meanwhile: the reload cannot finish.
    Device& d = *devices.per_rank[0];
    const DeviceStats ds = d.stats();
    auto hog = d.Allocate(ds.budget_bytes - ds.used_bytes - 4096);
    ASSERT_TRUE(hog.ok()) << hog.status().ToString();
    Status st = e.ReloadStates();
    EXPECT_EQ(st.code(), Status::Code::kResourceExhausted) << st.ToString();
    EXPECT_NE(st.message().find("hbm"), std::string::npos) << st.ToString();
    EXPECT_TRUE(e.states_offloaded());
    EXPECT_TRUE(e.health().ok());
    ASSERT_TRUE(d.Free(*hog).ok());
    ASSERT_TRUE(e.ReloadStates().ok());
    EXPECT_FALSE(e.states_offloaded());
  };
  RunSpec plain = spec;
  plain.before_step = nullptr;
  Devices plain_devices;
  plain.device = nullptr;
  UseEmulated(plain, plain_devices);
  const RunResult ref = RunEngine(plain);
  const RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_TRUE(BitEqual(r.master, ref.master));
}

}  // namespace
}  // namespace strata::testing
