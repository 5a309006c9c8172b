// `offloadctl bench dram` and `offloadctl bench adam`, run as a user would (small sizes: these
// check the output contract, not speed).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <cstdio>

#include <algorithm>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace {

using CliRun = strata::testing::ProcessResult;

// The binary: $STRATA_OFFLOADCTL (set by ctest), else the path CMake compiled in.
const char* OffloadctlPath() {
  const char* env = std::getenv("STRATA_OFFLOADCTL");
  return env != nullptr && *env != '\0' ? env : STRATA_OFFLOADCTL_PATH;
}

CliRun Offloadctl(const std::string& args) {
  const char* bin = OffloadctlPath();
  if (bin == nullptr) return CliRun{};
  return strata::testing::RunShell(std::string(bin) + " " + args + " 2>/dev/null");
}

TEST(OffloadctlBenchKernelsTest, DramJsonHasBestOfRows) {
  CliRun r = Offloadctl("bench dram --array-size 4M --threads 2 --reps 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["rows"].size(), 2u);
  double best_nt = 0;
  for (const auto& row : j["rows"]) {
    EXPECT_GT(row["copy_bytes_per_s"].get<double>(), 0);
    EXPECT_GT(row["triad_bytes_per_s"].get<double>(), 0);
    best_nt = std::max(best_nt, row["nt_triad_bytes_per_s"].get<double>());
  }
  EXPECT_EQ(j["nt_triad_bytes_per_s"].get<double>(), best_nt);
  EXPECT_GT(j["triad_bytes_per_s"].get<double>(), 0);
  EXPECT_EQ(j["array_bytes"].get<size_t>(), size_t{4} << 20);
  EXPECT_FALSE(j["target"].get<std::string>().empty());
}

TEST(OffloadctlBenchKernelsTest, AdamJsonPerPath) {
  CliRun r = Offloadctl("bench adam --params 64K --threads 2 --reps 1 --array-size 2M --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["params"].get<size_t>(), size_t{64000});  // a count, as plan --params reads it
  const double nt = j["nt_triad_bytes_per_s"].get<double>();
  EXPECT_GT(nt, 0);
  // The run's best nt triad: the DRAM pass or a triad interleaved with the Adam steps.
  EXPECT_GE(nt, j["dram"]["nt_triad_bytes_per_s"].get<double>());
  ASSERT_EQ(j["paths"].size(), 9u);
  const auto& p = j["paths"]["grad_bf16_out_bf16"];
  EXPECT_EQ(p["bytes_per_param"].get<int>(), 28);
  EXPECT_EQ(j["paths"]["grad_fp32_out_fp16"]["bytes_per_param"].get<int>(), 30);
  EXPECT_EQ(j["paths"]["grad_fp16_out_none"]["bytes_per_param"].get<int>(), 26);
  for (const auto& [name, path] : j["paths"].items()) {
    const double pps = path["params_per_s"].get<double>();
    EXPECT_GT(pps, 0) << name;
    EXPECT_DOUBLE_EQ(path["effective_bytes_per_s"].get<double>(),
                     pps * path["bytes_per_param"].get<double>())
        << name;
    EXPECT_DOUBLE_EQ(path["ratio_to_nt_triad"].get<double>(),
                     path["effective_bytes_per_s"].get<double>() / nt)
        << name;
    ASSERT_EQ(path["rows"].size(), 2u) << name;
    for (const auto& row : path["rows"]) {
      EXPECT_GT(row["nt_triad_bytes_per_s"].get<double>(), 0) << name;
      EXPECT_LE(row["nt_triad_bytes_per_s"].get<double>(), nt) << name;
    }
  }
}

TEST(OffloadctlBenchKernelsTest, AdamPathSubset) {
  CliRun r = Offloadctl(
      "bench adam --params 4K --threads 1 --reps 1 --array-size 1M --json "
      "--dtype-path grad_fp16_out_bf16");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["paths"].size(), 1u);
  EXPECT_EQ(j["paths"]["grad_fp16_out_bf16"]["bytes_per_param"].get<int>(), 28);
}

TEST(OffloadctlBenchKernelsTest, BadArgumentsAreUsageErrors) {
  EXPECT_EQ(Offloadctl("bench adam --params 0").exit_code, 2);
  EXPECT_EQ(Offloadctl("bench adam --params 12Q").exit_code, 2);
  EXPECT_EQ(Offloadctl("bench adam --threads -1").exit_code, 2);
  EXPECT_EQ(Offloadctl("bench dram --reps 0").exit_code, 2);
  EXPECT_EQ(Offloadctl("bench adam --dtype-path grad_int8_out_none").exit_code, 2);
  EXPECT_EQ(Offloadctl("bench adam --path grad_int8_out_none").exit_code, 2);
  EXPECT_EQ(Offloadctl("bench dram --array-size 512K").exit_code, 2);  // below 1M
  EXPECT_EQ(Offloadctl("bench dram --array-mib 0").exit_code, 2);
}

TEST(OffloadctlBenchKernelsTest, ParamsReadLikePlansAndSizesTakeSuffixes) {
  CliRun r = Offloadctl(
      "bench adam --params 7e3 --threads 1 --reps 1 --array-size 1M --json "
      "--dtype-path grad_fp32_out_none");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out)["params"].get<size_t>(), size_t{7000});
  EXPECT_EQ(Offloadctl("bench adam --params 1.5").exit_code, 2);  // not a whole count
}

}  // namespace
