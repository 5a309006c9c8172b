// The engine on a real GPU: CudaDevice + NCCL (one rank) trains the equivalence model to the same
// bits as HostDevice + Gloo, for every precision, with states on the device, the host and NVMe.
// Skips only when no GPU is present.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "engine_test_model.h"

namespace strata::testing {
namespace {

std::string Config(int stage, const char* opt, const char* param, const std::string& precision) {
  return std::string(R"({"train_micro_batch_size_per_gpu": 3,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "bf16": {"enabled": )") +
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

TEST(EngineCuda, SameBitsAsTheHostStandIn) {
  auto probe = CreateCudaDevice({});
  if (!probe.ok()) GTEST_SKIP() << "no GPU: " << probe.status().ToString();
  probe->reset();
  for (const std::string precision : {"fp32", "bf16", "fp16"}) {
    for (auto [stage, opt, param] : {std::tuple{0, "none", "none"}, std::tuple{2, "cpu", "none"},
                                     std::tuple{3, "none", "none"}, std::tuple{3, "nvme", "cpu"}}) {
      RunSpec spec;
      spec.config_json = Config(stage, opt, param, precision);
      spec.device_budget = 256ull << 20;
      RunResult host = RunEngine(spec);
      ASSERT_TRUE(host.status.ok()) << host.status.ToString();
      spec.cuda = true;
      RunResult gpu = RunEngine(spec);
      ASSERT_TRUE(gpu.status.ok()) << gpu.status.ToString();
      ASSERT_EQ(gpu.master.size(), host.master.size());
      for (size_t g = 0; g < host.master.size(); ++g) {
        EXPECT_EQ(
            0, std::memcmp(gpu.master[g].data(), host.master[g].data(), host.master[g].size() * 4))
            << precision << " stage " << stage << " opt " << opt << " param " << param << " group "
            << g;
      }
    }
  }
}

}  // namespace
}  // namespace strata::testing
