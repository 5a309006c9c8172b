// `offloadctl plan` run as a process (binary from env STRATA_OFFLOADCTL): exit codes, JSON that
// parses and carries the hand-computed figures of planner_test, and the readable report.
#include <sys/wait.h>
#include <unistd.h>
#include <cctype>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace {

using RunResult = strata::testing::ProcessResult;  // out: stdout, plus stderr when asked

RunResult RunPlan(const std::string& args, bool with_stderr = false) {
  const char* bin = std::getenv("STRATA_OFFLOADCTL");
  EXPECT_NE(bin, nullptr) << "STRATA_OFFLOADCTL is not set (run through ctest)";
  if (bin == nullptr) return RunResult{};
  return strata::testing::RunShell(std::string("'") + bin + "' plan " + args +
                                   (with_stderr ? " 2>&1" : " 2>/dev/null"));
}

std::string SourceFile(const std::string& rel) {
  const char* dir = std::getenv("STRATA_SOURCE_DIR");
  return std::string(dir ? dir : ".") + "/" + rel;
}

nlohmann::json ParseJson(const RunResult& r) { return strata::testing::ParseJson(r.out); }

TEST(OffloadctlPlan, SevenBOnEightGpusJson) {
  const RunResult r = RunPlan("--params 7B --gpus 8 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = ParseJson(r);
  ASSERT_TRUE(j.is_object());
  EXPECT_DOUBLE_EQ(j["input"]["params"].get<double>(), 7e9);
  EXPECT_EQ(j["input"]["ranks"].get<int>(), 8);
  // The ZeRO ledger: 112, 38.5, 26.25, 14 GB.
  EXPECT_DOUBLE_EQ(j["ledger"][0]["bytes_per_gpu"].get<double>(), 112e9);
  EXPECT_DOUBLE_EQ(j["ledger"][1]["bytes_per_gpu"].get<double>(), 38.5e9);
  EXPECT_DOUBLE_EQ(j["ledger"][2]["bytes_per_gpu"].get<double>(), 26.25e9);
  EXPECT_DOUBLE_EQ(j["ledger"][3]["bytes_per_gpu"].get<double>(), 14e9);
  EXPECT_EQ(j["ledger"][1]["formula"].get<std::string>(), "4Ψ + 12Ψ/N");
  // No configured setting: stage 1 is the first that fits 80 GB: params 14 + optimizer shard
  // 10.5 + the fp32 gradient shard the engine keeps 3.5 (sched/zero_layout.h; the full
  // gradients exist only in the gradient buffers) + 2 of working set (gradient buffers and the
  // fp32 read-back of a group, groups taken as reduce_bucket_size = 5e8 elements) = 30 GB, + 8 x
  // 16 B of norm exchange + the device Adam's gradient statistics, 8 B x (213624 chunks of the
  // rank's 8.75e8 elements + 2 x its 14 sub-groups).
  EXPECT_TRUE(j["configured"].is_null());
  EXPECT_EQ(j["recommended"].get<int>(), 1);
  EXPECT_DOUBLE_EQ(j["ladder"][1]["hbm_bytes_per_gpu"].get<double>(),
                   30e9 + 128 + 8 * (213624 + 2 * 14));
  EXPECT_DOUBLE_EQ(j["stages"][3]["comm"]["ratio_to_ddp"].get<double>(), 1.5);
  EXPECT_TRUE(j["fits"].get<bool>());
}

TEST(OffloadctlPlan, NodesAndRecipe) {
  const RunResult r = RunPlan("--params 7e9 --gpus 4 --nodes 2 --recipe fp32-grads --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["input"]["ranks"].get<int>(), 8);
  EXPECT_DOUBLE_EQ(j["input"]["recipe"]["total_bytes"].get<double>(), 18);
  // fp32 grads, stage 2: 2 x 7 + 16 x 7 / 8 = 14 + 14 = 28 GB.
  EXPECT_DOUBLE_EQ(j["ledger"][2]["bytes_per_gpu"].get<double>(), 28e9);
  // Stage 1 moves 4 + 2 bytes per param against DDP's 2 x 4: 0.75x.
  EXPECT_DOUBLE_EQ(j["stages"][1]["comm"]["ratio_to_ddp"].get<double>(), 0.75);
}

// A count without a unit (7 for 7B) is planned as given, with a note that says so.
TEST(OffloadctlPlan, ACountWithoutAUnitIsNoted) {
  RunResult r = RunPlan("--params 7 --gpus 8");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("--params 7 is 7 parameters: a model's count takes a unit (7M, 7B)"),
            std::string::npos)
      << r.out;
  for (const char* given : {"7B", "500K", "1e5"}) {
    r = RunPlan(std::string("--params ") + given + " --gpus 8");
    EXPECT_EQ(r.out.find("takes a unit"), std::string::npos) << given << ": " << r.out;
  }
}

TEST(OffloadctlPlan, NothingFitsExitsOne) {
  const RunResult r = RunPlan("--params 7B --gpus 8 --hbm-gb 1 --json");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  const nlohmann::json j = ParseJson(r);
  EXPECT_TRUE(j["recommended"].is_null());
  EXPECT_FALSE(j["fits"].get<bool>());
}

TEST(OffloadctlPlan, ConfiguredSettingDecidesTheExitCode) {
  // Stage 0 needs 113 GB per GPU: does not fit although stage 1 would.
  RunResult r = RunPlan("--params 7B --gpus 8 --stage 0");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("DOES NOT FIT"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("<- recommended"), std::string::npos) << r.out;
  // Stage 3 with both offloads to cpu: 5.625 GB HBM (tests/planner_test.cc: gradient buffers
  // 3.375 + 2 gathered groups 2 + 2 param shards 0.25 + 128 B), 8 x (12 + 4 fp32 grads + 2) B x
  // 8.75e8 = 126 GB DRAM per node, + the speculative step's rollback copies of a quarter of the
  // optimizer elements, 8 x 8.75e8 / 4 x 14 B = 24.5 GB.
  r = RunPlan("--params 7B --gpus 8 --stage 3 --offload-optimizer cpu --offload-param cpu --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = ParseJson(r);
  EXPECT_DOUBLE_EQ(j["configured"]["hbm_bytes_per_gpu"].get<double>(), 5.625e9 + 128);
  EXPECT_DOUBLE_EQ(j["configured"]["host_bytes_per_node"].get<double>(), 126e9 + 24.5e9);
}

TEST(OffloadctlPlan, ExampleConfig) {
  const std::string cfg = SourceFile("examples/ds_zero3_offload.json");
  const RunResult r = RunPlan("--params 7B --gpus 8 --config '" + cfg + "' --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = ParseJson(r);
  const nlohmann::json& z = j["input"]["zero"];
  EXPECT_EQ(z["stage"].get<int>(), 3);
  EXPECT_EQ(z["offload_optimizer"].get<std::string>(), "cpu");
  EXPECT_EQ(z["offload_param"].get<std::string>(), "cpu");
  EXPECT_DOUBLE_EQ(z["stage3_prefetch_bucket_size"].get<double>(), 5e8);
  EXPECT_DOUBLE_EQ(z["gradient_accumulation_steps"].get<double>(), 8);
  EXPECT_EQ(j["input"]["recipe"]["name"].get<std::string>(), "bf16-adam");
  // HBM: groups of reduce_bucket_size 5e8: gradient buffers 3 x (5e8 + 6.25e7) x 2 B
  // (overlap_comm) = 3.375 + the 2 groups the reuse distance 1e9 keeps (1e9 / (2 x 5e8) + 1)
  // gathered, 2 x 5e8 x 2 = 2, and their shards 2 x 6.25e7 x 2 = 0.25 + 8 x 16 B.
  // stage3_prefetch_bucket_size (5e8: a window of 1 group) is less than what is kept.
  EXPECT_DOUBLE_EQ(j["configured"]["hbm_bytes_per_gpu"].get<double>(), 5.625e9 + 128);
  // Both offloads pinned: 8 x 18 B (fp32 grads) x 8.75e8 = 126 GB per node, all pinned.
  EXPECT_DOUBLE_EQ(j["configured"]["host_pinned_bytes_per_node"].get<double>(), 126e9);
  // PCIe with 8 micro-steps: grads 8 x 1.75 + shard up 2 x 8 x 1.75 = 42 GB per GPU.
  EXPECT_DOUBLE_EQ(j["configured"]["pcie_bytes_per_gpu"].get<double>(), 42e9);
}

TEST(OffloadctlPlan, ReadableReport) {
  const RunResult r = RunPlan("--params 7B --gpus 8");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* want : {"112.00 GB", "38.50 GB", "26.25 GB", "14.00 GB", "16Ψ/N", "1.50x DDP",
                           "<- recommended", "Verdict: FITS"}) {
    EXPECT_NE(r.out.find(want), std::string::npos) << want << " missing in:\n" << r.out;
  }
}

// --trainable: the ledger keeps the full fine-tune's formulas and says so; the settings below
// it count the trainable part (a LoRA run's optimizer state is small).
TEST(OffloadctlPlan, TrainableSaysTheLedgerCountsAFullFineTune) {
  const RunResult r = RunPlan("--params 7B --trainable 20M --gpus 1 --hbm-gb 24");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("112.00 GB"), std::string::npos) << r.out;  // 16 x 7B
  EXPECT_NE(r.out.find("the settings below train 20M of them"), std::string::npos) << r.out;
  EXPECT_EQ(RunPlan("--params 7B --gpus 1").out.find("the settings below train"),
            std::string::npos);
}

TEST(OffloadctlPlan, UsageErrorsExitTwo) {
  for (const char* args :
       {"", "--params abc", "--params 7B --gpus 0", "--params 7B --nodes 0",
        "--params 7B --recipe bogus", "--params 7B --offload-param disk", "--params 7B --stage 4",
        "--params 7B --hbm-gb -1", "--params 7B --config /nonexistent/ds.json",
        "--params 7B --largest-group x", "--params 7B --no-such-flag"}) {
    const RunResult r = RunPlan(args, /*with_stderr=*/true);
    EXPECT_EQ(r.exit_code, 2) << "plan " << args << "\n" << r.out;
  }
  const RunResult r = RunPlan("--params 7X", true);
  EXPECT_NE(r.out.find("--params"), std::string::npos) << r.out;
  // A ratio with nothing offloaded was planned as no offload, silently.
  const RunResult ratio = RunPlan("--params 13B --stage 3 --offload-ratio 0.5", true);
  EXPECT_EQ(ratio.exit_code, 2) << ratio.out;
  EXPECT_NE(ratio.out.find("needs an offloaded optimizer"), std::string::npos) << ratio.out;
  EXPECT_EQ(RunPlan("--params 13B --stage 3 --offload-ratio 0.5 --offload-optimizer cpu").exit_code,
            0);
  // CLI::Range let "nan" through, and the flag then counted as not given.
  const RunResult nan = RunPlan("--params 13B --stage 3 --offload-ratio nan", true);
  EXPECT_EQ(nan.exit_code, 2) << nan.out;
  EXPECT_NE(nan.out.find("'nan' is not a number"), std::string::npos) << nan.out;
  // A fraction of a micro-step was printed as "(2.5 micro-steps)"; config check refuses it too.
  const RunResult ga = RunPlan("--params 7B --grad-accum 2.5", true);
  EXPECT_EQ(ga.exit_code, 2) << ga.out;
  EXPECT_NE(ga.out.find("--grad-accum: a whole number of micro-steps, not 2.5"), std::string::npos)
      << ga.out;
}

// One GPU: nothing moves between ranks, said so (the ratio to DDP's zero bytes read 350.50x).
TEST(OffloadctlPlan, OneRankHasNoCollectives) {
  const RunResult r = RunPlan(
      "--params 7B --gpus 1 --trainable 20M --stage 3 "
      "--offload-optimizer cpu");
  EXPECT_NE(r.out.find("collectives none (one rank)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("x DDP's all-reduce)\n"), std::string::npos) << r.out;
}

// A count beyond what the planner counts exactly is refused (the figures had saturated, and
// "fits" with them); an unknown command is named as such, not "A subcommand is required".
TEST(OffloadctlPlan, HugeCountsAndUnknownCommandsAreUsageErrors) {
  RunResult r = RunPlan("--params 1e19 --gpus 4096 --nodes 4096 --hbm-gb 2000", true);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("beyond"), std::string::npos) << r.out;
  const char* bin = std::getenv("STRATA_OFFLOADCTL");
  ASSERT_NE(bin, nullptr);
  r = strata::testing::RunShell(std::string("'") + bin + "' bogus 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("unknown command 'bogus'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("plan, config"), std::string::npos) << r.out;
}

// True when `s` holds a run of more than 20 digits (CLI11's DBL_MAX limit printed in full).
bool HasHugeNumber(const std::string& s) {
  size_t run = 0;
  for (char c : s) {
    run = std::isdigit(static_cast<unsigned char>(c)) ? run + 1 : 0;
    if (run > 20) return true;
  }
  return false;
}

TEST(OffloadctlPlan, RangeErrorsAreReadable) {
  RunResult r = RunPlan("--params 7B --hbm-gb -1", true);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("must be >= 0, got -1"), std::string::npos) << r.out;
  EXPECT_FALSE(HasHugeNumber(r.out)) << r.out;
  r = RunPlan("--params 7B --nvme-gbps 0", true);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("must be > 0, got 0"), std::string::npos) << r.out;
  EXPECT_FALSE(HasHugeNumber(r.out)) << r.out;
}

TEST(OffloadctlPlan, ParamsMustBeAWholeNumber) {
  RunResult r = RunPlan("--params 7.5", true);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("whole number"), std::string::npos) << r.out;
  r = RunPlan("--params 7.5B --json");
  EXPECT_NE(r.exit_code, 2) << r.out;
}

TEST(OffloadctlPlan, InvalidConfigExitsOneNamingThePath) {
  const char* tmp = std::getenv("STRATA_TEST_TMPDIR");
  const std::filesystem::path dir = std::filesystem::path(tmp ? tmp : "/tmp") /
                                    ("offloadctl_plan_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::filesystem::path cfg = dir / "bad.json";
  std::ofstream(cfg) << R"({ "zero_optimization": { "stage": 4 } })";
  const RunResult r = RunPlan("--params 7B --config '" + cfg.string() + "'", true);
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("zero_optimization.stage"), std::string::npos) << r.out;
  std::filesystem::remove_all(dir);
}

// N = gpus x nodes is computed in 64 bits: 3 x 1431655766 wrapped to N = 2 in an int and
// "fit"; 65536 x 65536 gave N = 0 and "inf GB". Too many ranks is a usage error naming N.
TEST(OffloadctlPlan, RanksAreComputedIn64Bits) {
  RunResult r = RunPlan("--params 7B --gpus 3 --nodes 1431655766", true);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("4294967298 ranks"), std::string::npos) << r.out;
  r = RunPlan("--params 7B --gpus 65536 --nodes 65536", true);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_EQ(r.out.find("inf"), std::string::npos) << r.out;
  r = RunPlan("--params 7B --gpus 8 --nodes 300000 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(ParseJson(r)["input"]["ranks"].get<int64_t>(), 2400000);
}

// One rule in one place: a config `config check` accepts is planned. axolotl's published
// zero3_bf16_cpuoffload_all.json has sub_group_size 0 (valid DeepSpeed), which plan refused
// with exit 2 ("must be a positive number").
TEST(OffloadctlPlan, ConfigsThatConfigCheckAcceptsArePlanned) {
  const std::string cfg =
      SourceFile("tests/data/ds_configs/axolotl_zero3_bf16_cpuoffload_all.json");
  const RunResult r = RunPlan("--params 7B --config '" + cfg + "' --json", true);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("must be"), std::string::npos) << r.out;
}

TEST(OffloadctlPlan, HelpDescribesEveryOption) {
  const RunResult r = RunPlan("--help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* opt : {"--params",
                          "--gpus",
                          "--nodes",
                          "--hbm-gb",
                          "--dram-gb",
                          "--nvme-gb",
                          "--nvme-gbps",
                          "--activations-gb",
                          "--largest-group",
                          "--recipe",
                          "--config",
                          "--stage",
                          "--offload-optimizer",
                          "--offload-param",
                          "--grad-accum",
                          "--step-seconds",
                          "--json",
                          "--zero-quantized-weights",
                          "--zero-quantized-gradients",
                          "--zero-hpz-partition-size"}) {
    EXPECT_NE(r.out.find(opt), std::string::npos) << opt;
  }
}

// ZeRO++ (planner_zpp_test has the model): Ψ = 1e9 on 2 nodes x 4 GPUs, stage 3 with qwZ, qgZ
// and hpZ k = 4. Inter-node bytes per rank: 7/8 x 1e9 x (1 + 4/4096) / 4 (forward gather) + 0
// (backward, within the node) + 1/2 x 1e9/4 x (1 + 4/4096) (qgZ) = 344085693.359375, against plain
// stage 3's 3 x 7/8 x 2e9 / 4 = 1.3125e9. HBM gains the 2 B x 1e9 / 4 = 0.5 GB hpZ copy.
TEST(OffloadctlPlan, ZeroPlusPlusBytesAndRatios) {
  const std::string zpp =
      "--params 1B --gpus 4 --nodes 2 --stage 3 --zero-quantized-weights true "
      "--zero-quantized-gradients true --zero-hpz-partition-size 4";
  const RunResult r = RunPlan(zpp + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = ParseJson(r);
  const nlohmann::json& z = j["zero_plus_plus"];
  EXPECT_TRUE(z["zero_quantized_weights"].get<bool>());
  EXPECT_EQ(z["zero_hpz_partition_size"].get<int>(), 4);
  EXPECT_DOUBLE_EQ(z["stage3"]["total"]["inter_node_bytes"].get<double>(), 344085693.359375);
  EXPECT_DOUBLE_EQ(z["plain_stage3"]["total"]["inter_node_bytes"].get<double>(), 1.3125e9);
  EXPECT_DOUBLE_EQ(z["inter_node_ratio_to_plain_stage3"].get<double>(),
                   344085693.359375 / 1.3125e9);
  EXPECT_DOUBLE_EQ(z["stage3"]["param_gather_backward"]["inter_node_bytes"].get<double>(), 0);
  EXPECT_DOUBLE_EQ(z["stage3"]["hpz_secondary_bytes_per_gpu"].get<double>(), 5e8);
  // Total 2 x 875854492.1875 + 1.5e9 against DDP's 2 x 7/8 x 2e9 = 3.5e9.
  const double total = 2 * 875854492.1875 + 1.5e9;
  EXPECT_DOUBLE_EQ(j["configured"]["comm"]["bytes_per_rank"].get<double>(), total);
  EXPECT_DOUBLE_EQ(j["configured"]["comm"]["ratio_to_ddp"].get<double>(), total / 3.5e9);
  EXPECT_DOUBLE_EQ(j["configured"]["comm"]["inter_node_bytes_per_rank"].get<double>(),
                   344085693.359375);
  // The same run without the flags: HBM 0.5 GB less.
  const nlohmann::json plain =
      ParseJson(RunPlan("--params 1B --gpus 4 --nodes 2 --stage 3 --json"));
  EXPECT_DOUBLE_EQ(j["configured"]["hbm_bytes_per_gpu"].get<double>() -
                       plain["configured"]["hbm_bytes_per_gpu"].get<double>(),
                   5e8);
  const RunResult text = RunPlan(zpp);
  ASSERT_EQ(text.exit_code, 0);
  for (const char* want : {"ZeRO++ at stage 3: qwZ on, qgZ on, hpZ k = 4", "0.26x plain stage 3",
                           "hpZ secondary param copy: 0.50 GB", "0.93x DDP"}) {
    EXPECT_NE(text.out.find(want), std::string::npos) << want << "\n" << text.out;
  }
}

TEST(OffloadctlPlan, ZeroPlusPlusBadPartitionIsAUsageError) {
  const RunResult r =
      RunPlan("--params 1B --gpus 4 --nodes 2 --zero-hpz-partition-size 3", /*with_stderr=*/true);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("zero_hpz_partition_size"), std::string::npos) << r.out;
  EXPECT_EQ(RunPlan("--params 1B --zero-quantized-weights yes").exit_code, 2);
}

}  // namespace

namespace {

// With --json a failure is JSON on stdout too ({"error", "exit_code"}, the message also on
// stderr): a bad value, a config that fails, and a usage error CLI11 reports.
TEST(OffloadctlPlan, FailuresAreJsonWithJson) {
  struct Case {
    std::string args;
    int code;
    std::string says;
  };
  for (const Case& c :
       {Case{"--params 7B --largest-group 8B --json", 2, "exceed params"},
        Case{"--params 7B --no-such-flag --json", 2, "no-such-flag"},
        Case{"--params 7B --config /nonexistent/ds.json --json", 2, "/nonexistent/ds.json"}}) {
    const RunResult r = RunPlan(c.args);
    EXPECT_EQ(r.exit_code, c.code) << c.args << ": " << r.out;
    const nlohmann::json j = ParseJson(r);
    ASSERT_TRUE(j.is_object()) << c.args << ": " << r.out;
    EXPECT_EQ(j["exit_code"].get<int>(), c.code);
    EXPECT_NE(j["error"].get<std::string>().find(c.says), std::string::npos) << r.out;
  }
  const RunResult plain = RunPlan("--params 7B --largest-group 8B");  // without: stderr only
  EXPECT_EQ(plain.exit_code, 2);
  EXPECT_EQ(plain.out, "");
}

}  // namespace
