// The engine on a real GPU: CudaDevice + NCCL (one rank) trains the equivalence model to the same
// bits as HostDevice + Gloo, for every precision, with states on the device (gradients, norms and
// Adam run by the CUDA kernels in place: Device::kernels), the host and NVMe.
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

}  // namespace
}  // namespace strata::testing
