// `offloadctl bench nvme` end to end: valid JSON with the keys scripts depend on, the aio block
// with DeepSpeed's names and JSON booleans, scratch file removed, clear errors and exit codes.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/io_test_util.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using Ran = testing::ProcessResult;  // out: stdout, plus stderr when asked

Ran Offloadctl(const std::string& args, bool with_stderr = true) {
  const char* bin = std::getenv("STRATA_OFFLOADCTL");
  if (bin == nullptr) bin = STRATA_OFFLOADCTL_PATH;
  return testing::RunShell(std::string(bin) + " " + args +
                           (with_stderr ? " 2>&1" : " 2>/dev/null"));
}

TEST(BenchNvmeCli, SinglePointJsonCarriesThroughputAndAioBlock) {
  testing::TempDir dir("benchcli");
  Ran r = Offloadctl(
      "bench nvme --path " + dir.path() + " --size 16M --block-size 1M --queue-depth 4 --json",
      /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_GT(j["read_bytes_per_s"].get<double>(), 0);
  EXPECT_GT(j["write_bytes_per_s"].get<double>(), 0);
  EXPECT_EQ(j["size_bytes"].get<uint64_t>(), 16u << 20);
  ASSERT_EQ(j["results"].size(), 1u);
  EXPECT_GT(j["results"][0]["read_latency_us"]["p99"].get<double>(), 0);
  const auto& aio = j["aio"];
  EXPECT_EQ(aio["block_size"].get<uint64_t>(), 1u << 20);
  EXPECT_EQ(aio["queue_depth"].get<int>(), 4);
  EXPECT_EQ(aio["thread_count"].get<int>(), 1);
  EXPECT_TRUE(aio["single_submit"].is_boolean());
  EXPECT_TRUE(aio["overlap_events"].is_boolean());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "scratch file left behind";
}

TEST(BenchNvmeCli, SweepOverPosixReportsEveryPointAndTheBest) {
  testing::TempDir dir("benchsweep");
  Ran r =
      Offloadctl("bench nvme --path " + dir.path() +
                 " --size 8M --block-size 256K,1M --queue-depth 2,4 --threads 1,2 --backend posix");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("[8/8]"), std::string::npos) << r.out;  // progress on the sweep
  EXPECT_NE(r.out.find("<- best"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"aio\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("backend posix"), std::string::npos) << r.out;
}

TEST(BenchNvmeCli, BadInputGetsClearErrorsAndExitCodes) {
  testing::TempDir dir("benchbad");
  Ran missing = Offloadctl("bench nvme --path " + dir.File("nope") + " --size 8M");
  EXPECT_EQ(missing.exit_code, 1) << missing.out;
  EXPECT_NE(missing.out.find("nope"), std::string::npos) << missing.out;
  Ran bad_size = Offloadctl("bench nvme --path " + dir.path() + " --size lots");
  EXPECT_EQ(bad_size.exit_code, 2) << bad_size.out;
  EXPECT_NE(bad_size.out.find("--size"), std::string::npos) << bad_size.out;
  Ran bad_bs = Offloadctl("bench nvme --path " + dir.path() + " --size 8M --block-size 1000");
  EXPECT_EQ(bad_bs.exit_code, 1) << bad_bs.out;
  EXPECT_NE(bad_bs.out.find("multiple of 4096"), std::string::npos) << bad_bs.out;
  Ran no_path = Offloadctl("bench nvme");
  EXPECT_EQ(no_path.exit_code, 2) << no_path.out;
}

}  // namespace
}  // namespace strata
