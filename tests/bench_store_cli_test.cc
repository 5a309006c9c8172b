// `offloadctl bench store`: runs end to end on small sizes, prints valid JSON with the figures
// the issue names, keeps peaks within budgets, and rejects bad options with exit code 2.
// (Figures are not asserted: timings belong to benchmarks.)
#include <cstdio>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/io_test_util.h"

namespace {

struct CliRun {
  int exit_code;
  std::string out;
};

CliRun Offloadctl(const std::string& args) {
  // ctest sets STRATA_OFFLOADCTL; the build path is the fallback (the shared strata_add_test
  // currently passes only the first of its ENVIRONMENT entries).
  const char* bin = std::getenv("STRATA_OFFLOADCTL");
  if (bin == nullptr) bin = STRATA_OFFLOADCTL_PATH;
  std::string cmd = std::string("timeout 300 ") + bin + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  int rc = pclose(p);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

TEST(BenchStoreCli, JsonCarriesStallFractionAndPipelineRatio) {
  strata::testing::TempDir dir("bench-store");
  CliRun r = Offloadctl(
      "bench store --json --layers 6 --group-mb 1 --device-mb 3 --host-mb 16 "
      "--prefetch-mb 2 --compute-ms 0.5 --steps 3 --subgroups 5 --subgroup-mb 1 "
      "--io posix --dir " +
      dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  ASSERT_TRUE(j.contains("stall_fraction"));
  ASSERT_TRUE(j.contains("pipeline_ratio"));
  EXPECT_GE(j["stall_fraction"].get<double>(), 0.0);
  EXPECT_GT(j["pipeline_ratio"].get<double>(), 0.0);
  EXPECT_EQ(j["param_step"]["trace_divergences"].get<int>(), 0);
  for (const char* t : {"device", "host", "nvme"}) {
    EXPECT_LE(j["peak_bytes"][t].get<uint64_t>(), j["budget_bytes"][t].get<uint64_t>()) << t;
  }
  // Forward then backward over 6 groups: every step moves at least 12 groups to the device.
  EXPECT_GE(j["param_step"]["bytes_host_to_device"].get<uint64_t>(), 6u << 20);
}

TEST(BenchStoreCli, BadOptionsAreUsageErrors) {
  CliRun r = Offloadctl("bench store --home moon");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--home"), std::string::npos) << r.out;
  r = Offloadctl("bench store --layers 0");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  r = Offloadctl("bench store --io floppy");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  r = Offloadctl("bench store --read-ahead -1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
}

}  // namespace
