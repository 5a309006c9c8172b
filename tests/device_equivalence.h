// The equivalence cases a device path must pass against HostDevice (engine_device_test with the
// emulated device, engine_cuda_test with CudaDevice): the configs, the CPU kernel target that
// makes the CPU kernels round as the device kernels do, and the comparison of two runs.
//
// Bit equality of a device run with a HostDevice run needs the CPU kernels to round as the
// device kernels (kernels/cuda_kernels.h): the fused Adam on an FMA target and the chunk sums of
// squares on the AVX2 target (AVX-512 adds its lanes in another order). The comparisons force
// the AVX2 target for both runs (ForcedTarget) and skip, saying why, on a CPU without it.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <string>

#include "engine_test_model.h"
#include "kernels/targets.h"

namespace strata::testing {

inline std::string DeviceCaseConfig(int stage, const char* opt, const char* param,
                                    const std::string& precision, double clip, int gas) {
  return std::string(R"({"train_micro_batch_size_per_gpu": 3,
  "gradient_accumulation_steps": )") +
         std::to_string(gas) + R"(,
  "gradient_clipping": )" +
         std::to_string(clip) + R"(,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "bf16": {"enabled": )" +
         (precision == "bf16" ? "true" : "false") + R"(},
  "fp16": {"enabled": )" +
         (precision == "fp16" ? "true" : "false") + R"(, "initial_scale_power": 8},
  "zero_optimization": {"stage": )" +
         std::to_string(stage) + R"(, "sub_group_size": 256,
    "stage3_param_persistence_threshold": 64,
    "offload_optimizer": {"device": ")" +
         opt + R"(", "nvme_path": "/tmp"},
    "offload_param": {"device": ")" +
         param + R"(", "nvme_path": "/tmp"}}})";
}

struct DeviceCase {
  int world, stage;
  const char* opt;
  const char* param;
  int gas;  // gradient_accumulation_steps: 3 accumulates with an inexact scale (1/3)
  bool optimizer_on_device() const { return std::string(opt) == "none"; }
  std::string Name(const std::string& precision) const {
    return precision + " world " + std::to_string(world) + " stage " + std::to_string(stage) +
           " opt " + opt + " param " + param + " gas " + std::to_string(gas);
  }
  // Gradient clipping at 0.5 in every case: the norm's chunk sums then decide the update.
  RunSpec Spec(const std::string& precision) const {
    RunSpec spec;
    spec.world = world;
    spec.gas = gas;
    spec.config_json = DeviceCaseConfig(stage, opt, param, precision, 0.5, gas);
    return spec;
  }
};

// Stages 0-3 with the optimizer state on the device (the device kernels' path), params on the
// host (the device Adam writing a cached device copy), the optimizer on the host (the CPU
// kernels with a device the host cannot address), and 2 ranks.
inline constexpr DeviceCase kDeviceCases[] = {{1, 0, "none", "none", 1}, {1, 1, "none", "none", 3},
                                              {1, 2, "none", "none", 1}, {1, 3, "none", "none", 3},
                                              {1, 3, "none", "cpu", 1},  {1, 2, "cpu", "none", 3},
                                              {2, 0, "none", "none", 1}, {2, 3, "none", "none", 3}};
inline constexpr const char* kDevicePrecisions[] = {"fp32", "bf16", "fp16"};

inline std::optional<int64_t> Avx2Target() {
  for (int64_t t : kernels::SupportedKernelTargets()) {
    if (kernels::KernelTargetName(t) == "AVX2") return t;
  }
  return std::nullopt;
}
inline constexpr const char* kNoAvx2 =
    "this CPU has no AVX2 kernel target: its CPU kernels round differently from the device "
    "kernels (kernels/cuda_kernels.h), so bit equality is not expected";

// Forces a CPU kernel target for the scope.
class ForcedTarget {
 public:
  explicit ForcedTarget(int64_t target) { kernels::ForceTargetForTest(target); }
  ~ForcedTarget() { kernels::ForceTargetForTest(0); }
  ForcedTarget(const ForcedTarget&) = delete;
  ForcedTarget& operator=(const ForcedTarget&) = delete;
};

// The same master weights, and per step the same norm bits, loss scale and skip decision.
inline void ExpectSameRun(const RunResult& dev, const RunResult& host) {
  EXPECT_TRUE(BitEqual(dev.master, host.master)) << "master weights differ";
  ASSERT_EQ(dev.reports.size(), host.reports.size());
  for (size_t i = 0; i < host.reports.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(&dev.reports[i].grad_norm, &host.reports[i].grad_norm, sizeof(double)))
        << "step " << i << ": norm " << dev.reports[i].grad_norm << " vs "
        << host.reports[i].grad_norm;
    EXPECT_EQ(dev.reports[i].loss_scale, host.reports[i].loss_scale) << "step " << i;
    EXPECT_EQ(dev.reports[i].skipped, host.reports[i].skipped) << "step " << i;
  }
}

}  // namespace strata::testing
