// `offloadctl config check` run as a process: exit codes (0 valid, 1 invalid, 2 usage) and
// --json output that parses.
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <cctype>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace {

using ProcessRun = strata::testing::ProcessResult;  // out: stdout and stderr

std::string SourceDir() {
  const char* env = std::getenv("STRATA_SOURCE_DIR");
  return env != nullptr ? env : STRATA_SOURCE_DIR_DEFAULT;
}

ProcessRun Offloadctl(const std::string& args) {
  const char* bin = std::getenv("STRATA_OFFLOADCTL");
  EXPECT_NE(bin, nullptr) << "STRATA_OFFLOADCTL is not set (run through ctest)";
  return strata::testing::RunShell(std::string(bin ? bin : "offloadctl") + " " + args + " 2>&1");
}

std::filesystem::path TempDirPath() {
  const char* base = std::getenv("STRATA_TEST_TMPDIR");
  return std::filesystem::path(base ? base : "/tmp") /
         ("offloadctl_config_" + std::to_string(getpid()));
}

// Writes `text` to a file in this test's temp dir; returns its path.
std::string TempFile(const std::string& name, const std::string& text) {
  std::filesystem::create_directories(TempDirPath());
  std::string path = (TempDirPath() / name).string();
  std::ofstream(path) << text;
  return path;
}

class OffloadctlConfig : public ::testing::Test {
 protected:
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(TempDirPath(), ec);
  }
};

nlohmann::json ParseJson(const ProcessRun& r) { return strata::testing::ParseJson(r.out); }

const std::string kExample = SourceDir() + "/examples/ds_zero3_offload.json";

TEST_F(OffloadctlConfig, ValidConfigExitsZeroAndPrintsTheEffectiveConfig) {
  ProcessRun r = Offloadctl("config check " + kExample + " --world-size 8");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("effective config:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"train_batch_size\": 256"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("valid (0 warning(s))"), std::string::npos) << r.out;
}

TEST_F(OffloadctlConfig, JsonOutputParsesAndCarriesTheResult) {
  ProcessRun r =
      Offloadctl("config check " + kExample + " --json --set scheduler.params.total_num_steps=9");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["valid"], true);
  EXPECT_TRUE(j["errors"].empty());
  EXPECT_EQ(j["effective"]["zero_optimization"]["stage"], 3);
  EXPECT_EQ(j["effective"]["scheduler"]["params"]["total_num_steps"], 9);
  EXPECT_EQ(j["unresolved_auto"], nlohmann::json::array({"train_batch_size"}));
}

TEST_F(OffloadctlConfig, SetResolvesAccelerateAutoKeysWithPlainWords) {
  std::string fixture = SourceDir() + "/tests/data/ds_configs/accelerate_docs_ds_config_auto.json";
  ProcessRun r = Offloadctl("config check " + fixture +
                            " --json --set zero_optimization.stage=3"
                            " --set zero_optimization.offload_param.device=cpu"
                            " --set zero_optimization.offload_optimizer.device=nvme");
  // nvme without a path is an error now that the device is known.
  EXPECT_EQ(r.exit_code, 1) << r.out;
  nlohmann::json j = ParseJson(r);
  ASSERT_EQ(j["errors"].size(), 1u) << r.out;
  EXPECT_EQ(j["errors"][0]["path"], "zero_optimization.offload_optimizer.nvme_path");
  r = Offloadctl("config check " + fixture +
                 " --json --set zero_optimization.stage=3"
                 " --set zero_optimization.offload_optimizer.device=cpu");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  j = ParseJson(r);
  EXPECT_EQ(j["effective"]["zero_optimization"]["stage"], 3);
  EXPECT_EQ(j["effective"]["zero_optimization"]["offload_optimizer"]["device"], "cpu");
  EXPECT_EQ(j["effective"]["zero_optimization"]["offload_param"]["device"], "auto");
}

TEST_F(OffloadctlConfig, RangeErrorsAreReadable) {
  ProcessRun r = Offloadctl("config check " + kExample + " --world-size 0");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("must be >= 1, got 0"), std::string::npos) << r.out;
  size_t run = 0, longest = 0;
  for (char c : r.out) longest = std::max(longest, run = std::isdigit(c & 0xff) ? run + 1 : 0);
  EXPECT_LT(longest, 20u) << r.out;
  r = Offloadctl("config check " + kExample + " --hidden-size 1.5");
  EXPECT_EQ(r.exit_code, 2) << r.out;
}

TEST_F(OffloadctlConfig, DeeplyNestedJsonIsAnErrorNotACrash) {
  // 100k levels once overflowed the stack (SIGSEGV). The error names where nesting got too deep.
  std::string text = "{\"a\":\n " + std::string(100000, '[') + std::string(100000, ']') + "}";
  ProcessRun r = Offloadctl("config check " + TempFile("deep.json", text));
  EXPECT_EQ(r.exit_code, 1) << r.out.substr(0, 2000);
  EXPECT_NE(r.out.find("nesting deeper than 64"), std::string::npos) << r.out.substr(0, 2000);
  EXPECT_NE(r.out.find("line 2"), std::string::npos) << r.out.substr(0, 2000);
  // 64 levels are still parsed (and judged on their content).
  std::string ok = "{\"zz\": " + std::string(63, '[') + std::string(63, ']') + "}";
  r = Offloadctl("config check " + TempFile("ok.json", ok));
  EXPECT_EQ(r.out.find("nesting deeper"), std::string::npos) << r.out;
}

TEST_F(OffloadctlConfig, InvalidConfigExitsOneWithPathsInJson) {
  std::string path = TempFile("bad.json", R"({"zero_optimization": {"stage": 4,
      "offload_param": {"device": "gpu"}}, "fp16": {"enabled": true}, "bf16": {"enabled": true}})");
  ProcessRun text = Offloadctl("config check " + path);
  EXPECT_EQ(text.exit_code, 1) << text.out;
  EXPECT_NE(text.out.find("error: zero_optimization.stage"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("INVALID (3 error(s)"), std::string::npos) << text.out;
  ProcessRun js = Offloadctl("config check " + path + " --json");
  EXPECT_EQ(js.exit_code, 1);
  nlohmann::json j = ParseJson(js);
  EXPECT_EQ(j["valid"], false);
  ASSERT_EQ(j["errors"].size(), 3u);
  EXPECT_EQ(j["errors"][0]["path"], "zero_optimization.stage");
  EXPECT_EQ(j["errors"][0]["kind"], "range");
  EXPECT_FALSE(j.contains("effective"));
}

TEST_F(OffloadctlConfig, MalformedJsonReportsLineAndColumn) {
  std::string path = TempFile("malformed.json", "{\n  \"train_batch_size\": 8,\n  oops\n}");
  ProcessRun r = Offloadctl("config check " + path + " --json");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  nlohmann::json j = ParseJson(r);
  ASSERT_EQ(j["errors"].size(), 1u);
  EXPECT_EQ(j["errors"][0]["kind"], "syntax");
  EXPECT_EQ(j["errors"][0]["line"], 3);
  EXPECT_EQ(j["errors"][0]["column"], 3);
}

TEST_F(OffloadctlConfig, BinaryGarbageIsInvalidAndTheJsonStillParses) {
  std::string garbage = "{\"a\": \"";
  for (int i = 0; i < 256; ++i) garbage += static_cast<char>(255 - i);
  ProcessRun r = Offloadctl("config check " + TempFile("garbage.json", garbage) + " --json");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["valid"], false);
  EXPECT_EQ(j["errors"][0]["kind"], "syntax");
}

// JSON keys may hold any character. Text output showed "a\u0000b" as "a" (printf stops at the
// NUL) and passed an ESC to the terminal; now control characters print as \xNN, in warnings and
// in the kept keys alike. --json carries them escaped by the JSON writer.
TEST_F(OffloadctlConfig, ControlCharactersInKeysArePrintedEscaped) {
  const std::string path =
      TempFile("ctl.json", R"({"train_batch_size": 8, "a\u0000b": 1, "c\u001b[31md": 2})");
  const ProcessRun r = Offloadctl("config check " + path);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("unknown key 'a\\x00b'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  a\\x00b = 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("c\\x1b[31md"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\0'), std::string::npos);
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos);
  const nlohmann::json j = ParseJson(Offloadctl("config check --json " + path));
  ASSERT_EQ(j["warnings"].size(), 2u) << j.dump();
  EXPECT_EQ(j["warnings"][0]["path"].get<std::string>(), std::string("a\0b", 3));
}

TEST_F(OffloadctlConfig, StrictMakesWarningsFail) {
  std::string fixture = SourceDir() + "/tests/data/ds_configs/hf_ds_config_zero3.json";
  EXPECT_EQ(Offloadctl("config check " + fixture).exit_code, 0);
  ProcessRun r = Offloadctl("config check " + fixture + " --strict --json");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  nlohmann::json j = ParseJson(r);
  EXPECT_TRUE(j["warnings"].empty());
  // Its deprecated key, and the batch sizes it leaves to a trainer.
  ASSERT_EQ(j["errors"].size(), 2u) << j.dump();
  std::set<std::string> kinds;
  for (const auto& e : j["errors"]) kinds.insert(e["kind"].get<std::string>());
  EXPECT_EQ(kinds, (std::set<std::string>{"deprecated", "unresolved_auto"}));
}

// A ZeRO-Infinity config with "auto" where DeepSpeed drops it (no trainer fills these keys):
// valid, each key named in a note with the default used; an error only under --strict.
TEST_F(OffloadctlConfig, AutoThatDeepSpeedDropsIsValidWithANoteNamingTheDefault) {
  std::string cfg = TempFile("infinity_auto.json", R"({"train_micro_batch_size_per_gpu": 1,
      "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3, "sub_group_size": "auto",
        "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto",
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_size": "auto",
          "buffer_count": "auto"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}},
      "aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 2}})");
  ProcessRun r = Offloadctl("config check " + cfg);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  for (const char* note :
       {"note: zero_optimization.stage3_max_live_parameters: \"auto\", which no trainer fills, "
        "is dropped as DeepSpeed drops it: DeepSpeed's default 1000000000 applies",
        "note: zero_optimization.sub_group_size: ",
        "note: zero_optimization.stage3_max_reuse_distance: ",
        "note: zero_optimization.offload_param.buffer_size: \"auto\", which no trainer fills, is "
        "dropped as DeepSpeed drops it: DeepSpeed's default 100000000 applies",
        "note: zero_optimization.offload_param.buffer_count: "}) {
    EXPECT_NE(r.out.find(note), std::string::npos) << note << "\n" << r.out;
  }
  EXPECT_NE(r.out.find("\"stage3_max_live_parameters\": 1000000000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("valid (0 warning(s))"), std::string::npos) << r.out;

  r = Offloadctl("config check " + cfg + " --json");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["notes"].size(), 5u) << r.out;
  EXPECT_TRUE(j["unresolved_auto"].empty()) << r.out;
  EXPECT_EQ(j["effective"]["zero_optimization"]["offload_param"]["buffer_count"], 5);

  r = Offloadctl("config check " + cfg + " --strict --json");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  j = ParseJson(r);
  ASSERT_EQ(j["errors"].size(), 5u) << r.out;
  EXPECT_EQ(j["errors"][0]["kind"], "type");
  EXPECT_GT(j["errors"][0]["line"].get<int>(), 0);
}

TEST_F(OffloadctlConfig, RequireResolvedFailsOnAuto) {
  std::string fixture = SourceDir() + "/tests/data/ds_configs/hf_ds_config_zero2.json";
  ProcessRun r = Offloadctl("config check " + fixture + " --require-resolved");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("optimizer.params.weight_decay"), std::string::npos) << r.out;
}

TEST_F(OffloadctlConfig, HereChecksTheNvmePath) {
  std::string dir = std::filesystem::path(TempFile("x", "")).parent_path().string();  // exists
  std::string good = TempFile("nvme_ok.json", R"({"train_batch_size": 8, "zero_optimization":
      {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                                                  dir + R"("}}})");
  ProcessRun ok = Offloadctl("config check " + good + " --here --json");
  EXPECT_EQ(ok.exit_code, 0) << ok.out;
  EXPECT_EQ(ParseJson(ok)["notes"].size(), 1u);
  std::string bad = TempFile("nvme_bad.json", R"({"train_batch_size": 8, "zero_optimization":
      {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent/strata"}}})");
  EXPECT_EQ(Offloadctl("config check " + bad).exit_code, 0);
  EXPECT_EQ(Offloadctl("config check " + bad + " --here").exit_code, 1);
}

// --params: the planner's bytes for the configured setting against the path's free space
// (bf16, stage 3, optimizer on NVMe, one rank: 12 bytes of optimizer state and 2 of gradient
// per parameter; figures in planner_config_test).
TEST_F(OffloadctlConfig, HereWithParamsComparesTheEnginesStateWithTheFreeSpace) {
  std::string dir = std::filesystem::path(TempFile("x", "")).parent_path().string();
  std::string cfg = TempFile("nvme_params.json", R"({"bf16": {"enabled": true},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                                                     dir + R"("}}})");
  ProcessRun r = Offloadctl("config check " + cfg + " --here --params 1M --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json j = ParseJson(r);
  ASSERT_EQ(j["nvme_paths"].size(), 1u) << r.out;
  EXPECT_EQ(j["nvme_paths"][0]["dir"], dir);
  EXPECT_GT(j["nvme_paths"][0]["free_bytes"].get<int64_t>(), 0);
  EXPECT_NE(j["notes"].dump().find("holds 14000000 bytes"), std::string::npos) << r.out;
  // 1e15 parameters are 14e15 bytes: no disk here has them. One rank: an error (the run could
  // not start); eight: a warning (they may run on several machines), an error under --strict.
  r = Offloadctl("config check " + cfg + " --here --params 1000T --json");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(ParseJson(r)["errors"].dump().find("needs 14000000000000000 bytes"), std::string::npos)
      << r.out;
  r = Offloadctl("config check " + cfg + " --here --params 1000T --world-size 8 --json");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(ParseJson(r)["warnings"].dump().find("other ranks may run on other machines"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(Offloadctl("config check " + cfg + " --here --params 1000T --world-size 8 --strict")
                .exit_code,
            1);
  EXPECT_EQ(Offloadctl("config check " + cfg + " --params 1M").exit_code, 2);  // needs --here
}

TEST_F(OffloadctlConfig, UnreadableFileIsInvalid) {
  ProcessRun r = Offloadctl("config check /nonexistent/strata/ds.json --json");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(ParseJson(r)["read_error"].get<std::string>().find("NotFound"), std::string::npos);
}

TEST_F(OffloadctlConfig, UsageErrorsExitTwo) {
  EXPECT_EQ(Offloadctl("config check").exit_code, 2);
  EXPECT_EQ(Offloadctl("config").exit_code, 2);
  EXPECT_EQ(Offloadctl("config check " + kExample + " --no-such-flag").exit_code, 2);
  EXPECT_EQ(Offloadctl("config check " + kExample + " --world-size 0").exit_code, 2);
  EXPECT_EQ(Offloadctl("config check " + kExample + " --world-size x").exit_code, 2);
  EXPECT_EQ(Offloadctl("config check " + kExample + " --set nokeyvalue").exit_code, 2);
}

TEST_F(OffloadctlConfig, HelpDescribesEveryOption) {
  ProcessRun r = Offloadctl("config check --help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* opt : {"--world-size", "--hidden-size", "--set", "--require-resolved",
                          "--strict", "--here", "--params", "--json"}) {
    EXPECT_NE(r.out.find(opt), std::string::npos) << opt << "\n" << r.out;
  }
}

}  // namespace

// A misspelt command word at any level is named with the commands it could be (CLI11 alone said
// "A subcommand is required"); a usage error a command finds itself is JSON on stdout under
// --json, as the parser's are.
TEST_F(OffloadctlConfig, UsageErrorsNameTheWordAndAreJsonUnderJson) {
  ProcessRun typo = Offloadctl("config chek x.json");
  EXPECT_EQ(typo.exit_code, 2) << typo.out;
  EXPECT_NE(typo.out.find("offloadctl config: unknown command 'chek' (the commands: check"),
            std::string::npos)
      << typo.out;
  typo = Offloadctl("bench nvm --nvme-path x");
  EXPECT_EQ(typo.exit_code, 2) << typo.out;
  EXPECT_NE(typo.out.find("offloadctl bench: unknown command 'nvm'"), std::string::npos)
      << typo.out;
  const char* bin = std::getenv("STRATA_OFFLOADCTL");
  ASSERT_NE(bin, nullptr);
  std::string cfg = TempFile("plain.json", R"({"train_micro_batch_size_per_gpu": 1})");
  for (const std::string& args :
       {std::string("config check ") + cfg + " --set foo --json", std::string("bench nvme --json"),
        std::string("bench comm --dtype int8 --json")}) {
    ProcessRun r = strata::testing::RunShell(std::string(bin) + " " + args + " 2>/dev/null");
    EXPECT_EQ(r.exit_code, 2) << args;
    nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(j.is_object()) << args << ": " << r.out;
    EXPECT_EQ(j["exit_code"], 2) << args;
    EXPECT_FALSE(j["error"].get<std::string>().empty()) << args;
  }
}
