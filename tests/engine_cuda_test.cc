// The engine on a real GPU: CudaDevice + NCCL (one rank) trains the equivalence model to the same
// bits as HostDevice + Gloo, for every precision, with states on the device (gradients, norms and
// Adam run by the CUDA kernels in place: Device::kernels), the host and NVMe; and across an
// OffloadStates / ReloadStates between steps.
// Skips only when no GPU is present, or (the bit comparison) on a CPU without the AVX2 target
// (device_equivalence.h).
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>

#include "device_equivalence.h"
#include "engine_test_model.h"
#include "strata/device_kernels.h"

namespace strata::testing {
namespace {

// Skips without a GPU or without the AVX2 CPU target; else forces that target, with which the
// CPU kernels round as the CUDA ones.
class EngineCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    auto probe = CreateCudaDevice({});
    if (!probe.ok()) GTEST_SKIP() << "no GPU: " << probe.status().ToString();
    ASSERT_NE((*probe)->kernels(), nullptr) << "CudaDevice offers no kernels";
    const std::optional<int64_t> avx2 = Avx2Target();
    if (!avx2) GTEST_SKIP() << kNoAvx2;
    forced_.emplace(*avx2);
  }
  std::optional<ForcedTarget> forced_;
};

// Case c trained on HostDevice + Gloo, then on CudaDevice + NCCL: the same bits.
void ExpectCudaRunsAsTheHost(const DeviceCase& c, const std::string& precision) {
  RunSpec spec = c.Spec(precision);
  spec.device_budget = 256ull << 20;
  RunResult host = RunEngine(spec);
  ASSERT_TRUE(host.status.ok()) << host.status.ToString();
  spec.cuda = true;
  RunResult gpu = RunEngine(spec);
  ASSERT_TRUE(gpu.status.ok()) << gpu.status.ToString();
  ExpectSameRun(gpu, host);
}

// The device-resident cases (stages 0-3, gradient accumulation, params on the host) at one rank.
TEST_F(EngineCuda, DeviceResidentStateSameBitsAsTheHostStandIn) {
  for (const std::string precision : kDevicePrecisions) {
    for (const DeviceCase& c : kDeviceCases) {
      if (c.world != 1) continue;  // NCCL at one rank; several ranks are the emulated test's
      SCOPED_TRACE(c.Name(precision));
      ExpectCudaRunsAsTheHost(c, precision);
    }
  }
}

// Offloaded state (host and NVMe) with a device the host cannot address.
TEST_F(EngineCuda, SameBitsAsTheHostStandIn) {
  for (const std::string precision : kDevicePrecisions) {
    for (auto [stage, opt, param] : {std::tuple{2, "cpu", "none"}, std::tuple{3, "nvme", "cpu"}}) {
      const DeviceCase c{1, stage, opt, param, 1};
      SCOPED_TRACE(c.Name(precision));
      ExpectCudaRunsAsTheHost(c, precision);
    }
  }
}

// OffloadStates between steps on the GPU: the device's memory in use drops to the engine's
// small buffers (and the pool's cache is trimmed), ReloadStates brings the states back, and the
// run ends with the bits of one that never lent the GPU out.
TEST_F(EngineCuda, OffloadStatesBetweenStepsGivesTheSameBits) {
  for (auto [stage, opt] : {std::tuple{3, "none"}, std::tuple{2, "cpu"}}) {
    const DeviceCase c{1, stage, opt, "none", 1};
    SCOPED_TRACE(c.Name("bf16"));
    RunSpec spec = c.Spec("bf16");
    spec.device_budget = 256ull << 20;
    spec.cuda = true;
    RunResult plain = RunEngine(spec);
    ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
    spec.before_step = [](int, int step, Engine& e) {
      if (step == 0) return;
      ASSERT_TRUE(e.OffloadStates().ok());
      EXPECT_TRUE(e.states_offloaded());
      EXPECT_EQ(e.Stats().store.used_bytes[Tier::kDevice], 0u);
      ASSERT_TRUE(e.ReloadStates().ok());
    };
    RunResult lent = RunEngine(spec);
    ASSERT_TRUE(lent.status.ok()) << lent.status.ToString();
    ExpectSameRun(lent, plain);
  }
}

}  // namespace
}  // namespace strata::testing
