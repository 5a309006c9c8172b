// `offloadctl bench engine`: the real engine on tiny synthetic models, run as a user would (the
// built binary): the JSON carries the figures the issue names with sane relations between them
// (NVMe bytes only with an NVMe tier, peaks within budgets, comm bytes against the ledger on 2
// ranks under `offloadctl launch`), the sweep reports what does not fit instead of failing, and
// bad flags are usage errors naming the flag. Timings are reported, never asserted.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/zero/engine_stats_json.h"
#include "strata/device.h"
#include "tests/io_test_util.h"
#include "tests/test_util.h"

namespace {

using strata::testing::ProcessResult;

std::string Ctl() {
  // ctest sets STRATA_OFFLOADCTL; the build path is the fallback (gtest_discover_tests passes
  // only the first ENVIRONMENT entry with CMake 3.25).
  const char* bin = std::getenv("STRATA_OFFLOADCTL");
  return bin != nullptr ? bin : STRATA_OFFLOADCTL_PATH;
}

// Runs `offloadctl bench engine ARGS` (stderr: `redirect`).
ProcessResult Bench(const std::string& args, const std::string& redirect = "2>/dev/null") {
  return strata::testing::RunShell("timeout 120 " + Ctl() + " bench engine " + args + " " +
                                   redirect);
}

nlohmann::json Json(const ProcessResult& r) {
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

// Rank 0's stdout under `offloadctl launch -n 2` (or `launch_args`), without the "[rank 0] "
// prefixes.
nlohmann::json LaunchJson(const std::string& args, const std::string& launch_args = "-n 2") {
  const ProcessResult r =
      strata::testing::RunShell("timeout 120 " + Ctl() + " launch " + launch_args + " -- " + Ctl() +
                                " bench engine " + args + " 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  std::istringstream in(r.out);
  std::string line, text;
  const std::string tag = "[rank 0] ";
  while (std::getline(in, line)) {
    if (line.rfind(tag, 0) == 0 && line.find("bench engine:") == std::string::npos) {
      text += line.substr(tag.size()) + "\n";
    }
  }
  auto j = nlohmann::json::parse(text, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

void ExpectWithinBudgets(const nlohmann::json& j) {
  for (const char* t : {"device", "host", "nvme"}) {
    EXPECT_LE(j["peak_bytes"][t].get<double>(), j["budget_bytes"][t].get<double>())
        << j["variant"] << " " << t;
  }
}

// "engine_stats": rank 0's Engine::Stats through zero::EngineStatsJson, the serializer the Python
// binding's Engine.stats() returns: the same keys at every level (bytes_moved aside: it names
// the tier pairs that moved bytes) and the counters of the run (warm-up steps included).
void ExpectEngineStats(const nlohmann::json& got, int steps) {
  const nlohmann::json want = strata::zero::EngineStatsJson(strata::EngineStats{});
  std::vector<std::pair<const nlohmann::json*, const nlohmann::json*>> todo = {{&got, &want}};
  while (!todo.empty()) {
    const auto [g, w] = todo.back();
    todo.pop_back();
    ASSERT_EQ(g->is_object(), w->is_object()) << *g;
    if (!w->is_object()) continue;
    ASSERT_EQ(g->size(), w->size()) << *g;
    for (const auto& [key, value] : w->items()) {
      ASSERT_TRUE(g->contains(key)) << key << " " << *g;
      if (key != "bytes_moved") todo.push_back({&(*g)[key], &value});
    }
  }
  EXPECT_EQ(got["global_step"], steps);
  EXPECT_GT(got["store"]["bytes_moved"]["host->nvme"].get<double>(), 0.0);
  EXPECT_GT(got["gather_fetch_wait_ns"].get<double>(), 0.0);
  EXPECT_GT(got["step_ns"].get<double>(), 0.0);
  EXPECT_GE(got["step_ns"].get<double>(), got["optimizer_ns"].get<double>());  // Step holds it
}

constexpr const char* kTiny = " --params 2M --layers 4 --steps 2 --io-backend posix ";
// A model whose state outgrows its default host budget, so that it is paged through NVMe each
// step: kTiny's state fits in the swap buffers, and (the key unset) a small model's state is
// cached in the speculation's room; in either case nothing is read or written per step.
constexpr const char* kPaged =
    " --params 8M --layers 16 --steps 2 --io-backend posix --speculative-step off ";

// `phases`: forward, backward and optimizer each timed and their NVMe bytes counted, per
// measured step. Nothing runs between them but the loop, so they fill the mean step and their
// bytes add up to the step's (IO completes inside the phase that waits for it). With the split
// paired reference each phase's bytes at its read and write rates give the phase's bound.
void ExpectPhasesCoverTheStep(const nlohmann::json& j, bool split) {
  const nlohmann::json& ph = j["phases"];
  double secs = 0, rd = 0, wr = 0, busy = 0, hashed = 0;
  for (const char* k : {"forward", "backward", "optimizer"}) {
    ASSERT_TRUE(ph.contains(k)) << ph;
    const nlohmann::json& x = ph[k];
    EXPECT_GT(x["seconds"].get<double>(), 0.0) << k;
    EXPECT_GE(x["io_busy_fraction"].get<double>(), 0.0) << k;
    busy += x["io_busy_fraction"].get<double>() * x["seconds"].get<double>();
    // The trainer's waits on the store lie inside the phase, on its one thread.
    EXPECT_GE(x["store_wait_fraction"].get<double>(), 0.0) << k;
    EXPECT_LE(x["store_wait_fraction"].get<double>(), 1.0 + 1e-9) << k;
    // The store's parked time is read where a phase starts and ends: inside the phase.
    EXPECT_GE(x["host_room_wait_fraction"].get<double>(), 0.0) << k;
    EXPECT_LE(x["host_room_wait_fraction"].get<double>(), 1.0 + 1e-9) << k;
    EXPECT_GE(x["copy_busy_fraction"].get<double>(), 0.0) << k;
    // The checksums are hashed on the IO thread inside the phase; the idle part is a part.
    EXPECT_GE(x["checksum_idle_fraction"].get<double>(), 0.0) << k;
    EXPECT_LE(x["checksum_idle_fraction"].get<double>(), x["checksum_fraction"].get<double>()) << k;
    hashed += x["checksum_fraction"].get<double>() * x["seconds"].get<double>();
    secs += x["seconds"].get<double>();
    rd += x["nvme_read_bytes"].get<double>();
    wr += x["nvme_write_bytes"].get<double>();
    EXPECT_NEAR(x["nvme_bytes_per_s"].get<double>(),
                (x["nvme_read_bytes"].get<double>() + x["nvme_write_bytes"].get<double>()) /
                    x["seconds"].get<double>(),
                1e-3)
        << k;
    EXPECT_EQ(x.contains("io_efficiency_split"), split) << k;
    if (split) {
      const double bound =
          x["nvme_read_bytes"].get<double>() / ph["split_read_bytes_per_s"].get<double>() +
          x["nvme_write_bytes"].get<double>() / ph["split_write_bytes_per_s"].get<double>();
      EXPECT_NEAR(x["disk_bound_split_s"].get<double>(), bound, 1e-9) << k;
      EXPECT_NEAR(x["io_efficiency_split"].get<double>(), bound / x["seconds"].get<double>(), 1e-9)
          << k;
    }
  }
  const double mean = j["step_s_mean"].get<double>();
  if (j["world_size"].get<int>() == 1) {  // ranks' phases are the slowest's each: not additive
    EXPECT_LE(secs, mean * (1 + 1e-9));
    EXPECT_GE(secs, 0.9 * mean);
    // The disk's busy time falls inside the phases (one IO's latency may cross in from before).
    EXPECT_LE(busy, 1.1 * secs + 0.05);
  }
  // NVMe bytes moved, so the IO thread hashed some (each written unit, each unit read).
  EXPECT_GT(hashed, 0.0);
  // Every Gather asks the store for the group's copy: the forward waited on it, if briefly.
  EXPECT_GT(ph["forward"]["store_wait_fraction"].get<double>(), 0.0);
  // The optimizer's reads and writes complete inside it: the disk was busy there.
  EXPECT_GT(ph["optimizer"]["io_busy_fraction"].get<double>(), 0.0);
  const double step_rd = j["nvme_read_bytes_per_step"].get<double>();
  const double step_wr = j["nvme_write_bytes_per_step"].get<double>();
  EXPECT_LE(rd, step_rd + 1);
  EXPECT_LE(wr, step_wr + 1);
  EXPECT_GE(rd, 0.95 * step_rd);
  EXPECT_GE(wr, 0.95 * step_wr);
  // Stage 3 with the optimizer on NVMe: the optimizer writes its states home; the forward only
  // reads.
  EXPECT_GT(ph["optimizer"]["nvme_write_bytes"].get<double>(), 0.0);
  EXPECT_EQ(ph["forward"]["nvme_write_bytes"].get<double>(), 0.0);
}

TEST(BenchEngineCli, PairedSplitReferenceRewritesTheSwapFilesAfterEachStep) {
  // --disk-reference-paired-split: after each measured step a pass over the engine's own swap
  // files moves that step's NVMe reads and writes (rounded up to 1 MiB units) in read-only and
  // write-only phases timed apart, rewriting their bytes unchanged: the engine then trains on,
  // verifying its checksums on every read. io_efficiency_paired_split is the median of
  // (read phases + write phases) / step.
  strata::testing::TempDir dir("bench-paired");
  const std::string args =
      " --params 8M --layers 16 --steps 3 --io-backend posix --stage 3 --offload-optimizer nvme "
      "--offload-param nvme --disk-reference-paired-split --speculative-step off --nvme-path " +
      dir.path();
  const ProcessResult r = Bench(args + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = Json(r);
  const auto steps = j["step_s_all"].get<std::vector<double>>();
  ASSERT_EQ(steps.size(), 3u);
  const nlohmann::json& sp = j["disk_reference_paired_split"];
  ASSERT_TRUE(sp["measured"].get<bool>()) << j.dump();
  const auto split_s = sp["seconds"].get<std::vector<double>>();
  const auto split_rd = sp["read_seconds"].get<std::vector<double>>();
  const auto split_wr = sp["write_seconds"].get<std::vector<double>>();
  const auto reads = sp["read_bytes"].get<std::vector<double>>();
  const auto writes = sp["write_bytes"].get<std::vector<double>>();
  const auto split_ratios = sp["ratios"].get<std::vector<double>>();
  ASSERT_EQ(split_s.size(), 3u);
  ASSERT_EQ(split_ratios.size(), 3u);
  const double unit = 1 << 20;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_GT(split_rd[i], 0.0) << i;
    EXPECT_GT(split_wr[i], 0.0) << i;
    EXPECT_NEAR(split_s[i], split_rd[i] + split_wr[i], 1e-9) << i;  // one rank
    EXPECT_NEAR(split_ratios[i], split_s[i] / steps[i], 1e-9) << i;
    // Each pass moved one step's bytes (the mean step's within a unit's rounding per step).
    EXPECT_GT(reads[i], 0.0) << i;
    EXPECT_GT(writes[i], 0.0) << i;
    EXPECT_EQ(std::fmod(reads[i], unit), 0.0) << i;
  }
  const double sum_rd = reads[0] + reads[1] + reads[2], sum_wr = writes[0] + writes[1] + writes[2];
  EXPECT_NEAR(sum_rd / 3, j["nvme_read_bytes_per_step"].get<double>(), unit);
  EXPECT_NEAR(sum_wr / 3, j["nvme_write_bytes_per_step"].get<double>(), unit);
  std::vector<double> sorted = split_ratios;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(j["io_efficiency_paired_split"].get<double>(), sorted[1]);
  // Over the swap files' whole units: the NVMe footprint, less a partial last unit.
  EXPECT_NEAR(sp["span_bytes"].get<double>(), j["peak_bytes"]["nvme"].get<double>(), unit);
  ExpectPhasesCoverTheStep(j, /*split=*/true);
  // With the key given (unset, the speculation's room would cache all of this small model's
  // state: nothing read, no pass) this model outgrows the host budget: the forward reads
  // parameters, the backward writes finished gradients home, the optimizer reads its states.
  // A phase counts the bytes whose IO completed in it, and the gradients' write-home is
  // asynchronous: on a loaded machine it can complete after the backward's last call, so the
  // backward's writes are checked together with the optimizer's.
  const auto& ph = j["phases"];
  EXPECT_GT(ph["forward"]["nvme_read_bytes"].get<double>(), 0.0);
  EXPECT_GT(ph["backward"]["nvme_write_bytes"].get<double>() +
                ph["optimizer"]["nvme_write_bytes"].get<double>(),
            0.0);
  EXPECT_GT(ph["optimizer"]["nvme_read_bytes"].get<double>(), 0.0);
  // The text form prints it; with --overlap-step the pass is refused, naming the flag.
  const ProcessResult text = Bench(args);
  ASSERT_EQ(text.exit_code, 0) << text.out;
  EXPECT_NE(text.out.find("paired, split"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("of the split disk"), std::string::npos) << text.out;
  const ProcessResult both = Bench(args + " --overlap-step", "2>&1");
  EXPECT_NE(both.exit_code, 0) << both.out;
  EXPECT_NE(both.out.find("--disk-reference-paired-split"), std::string::npos) << both.out;
}

TEST(BenchEngineCli, NvmeRunCarriesTheIssuesFigures) {
  strata::testing::TempDir dir("bench-engine");
  const ProcessResult r = Bench(std::string(kPaged) +
                                "--stage 3 --offload-optimizer nvme --offload-param nvme "
                                "--json --nvme-path " +
                                dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = Json(r);
  for (const char* k : {"step_s", "breakdown", "stall_fraction", "nvme_bytes_per_step",
                        "comm_bytes_per_rank", "ledger_comm_bytes_per_rank", "peak_bytes",
                        "budget_bytes", "plan_bytes", "planner_bytes"}) {
    EXPECT_TRUE(j.contains(k)) << k;
  }
  for (const char* k : {"gather_wait_s", "reduce_wait_s", "optimizer_s", "optimizer_io_wait_s"}) {
    EXPECT_GE(j["breakdown"][k].get<double>(), 0.0) << k;
  }
  EXPECT_EQ(j["offload_optimizer"], "nvme");
  EXPECT_EQ(j["offload_param"], "nvme");
  EXPECT_GT(j["step_s"].get<double>(), 0.0);
  EXPECT_GT(j["nvme_bytes_per_step"].get<double>(), 0.0);
  EXPECT_GE(j["stall_fraction"].get<double>(), 0.0);
  EXPECT_LE(j["stall_fraction"].get<double>(), 1.0);
  EXPECT_EQ(j["comm_bytes_per_rank"].get<double>(), 0.0);  // one rank
  EXPECT_GT(j["plan_bytes"]["nvme"].get<double>(), 0.0);
  ExpectWithinBudgets(j);
  ExpectPhasesCoverTheStep(j, /*split=*/false);
  ExpectEngineStats(j["engine_stats"], 3 + 2);  // the default warm-up and kPaged's steps
  // The run's own directory is gone; nothing else was left behind.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// --save-dir: the JSON reports the checkpoint's times, bytes and their ratios to the disk, and
// what the run left under the directory is a checkpoint `offloadctl ckpt verify` accepts, of
// the reported size (the checkpoint directory is the one holding `latest`, wherever the bench
// puts it under --save-dir).
TEST(BenchEngineCli, SaveDirWritesACheckpointThatVerifies) {
  strata::testing::TempDir dir("bench-engine-verify");
  const std::string save = dir.path() + "/ckpt";
  const ProcessResult r = Bench(std::string(kTiny) +
                                "--stage 3 --offload-optimizer nvme --offload-param nvme "
                                "--json --nvme-path " +
                                dir.path() + " --save-dir " + save);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = Json(r);
  ASSERT_TRUE(j.contains("checkpoint")) << j;
  const nlohmann::json& c = j["checkpoint"];
  for (const char* k : {"save_s", "load_s", "bytes", "save_vs_disk_write", "load_vs_disk_read"}) {
    ASSERT_TRUE(c.contains(k)) << k << " " << c;
    EXPECT_GT(c[k].get<double>(), 0.0) << k << " " << c;
  }
  std::string ckpt_dir;
  for (const auto& e : std::filesystem::recursive_directory_iterator(save)) {
    if (e.path().filename() == "latest") ckpt_dir = e.path().parent_path().string();
  }
  ASSERT_FALSE(ckpt_dir.empty()) << "no `latest` under " << save;
  const ProcessResult v =
      strata::testing::RunShell("timeout 60 " + Ctl() + " ckpt verify " + ckpt_dir + " 2>&1");
  EXPECT_EQ(v.exit_code, 0) << v.out;
  EXPECT_NE(v.out.find("is valid"), std::string::npos) << v.out;
  const ProcessResult ins =
      strata::testing::RunShell("timeout 60 " + Ctl() + " ckpt inspect --json " + ckpt_dir);
  ASSERT_EQ(ins.exit_code, 0) << ins.out;
  const nlohmann::json m = Json(ins);
  EXPECT_EQ(m["stage"], 3);
  EXPECT_EQ(m["offload_optimizer"], "nvme");
  // The reported bytes: the files the manifest lists plus the manifest itself.
  const double listed = m["total_bytes"].get<double>(), bytes = c["bytes"].get<double>();
  EXPECT_GE(bytes, listed) << c;
  EXPECT_LE(bytes, listed + 65536) << c;
  // About 2M params (the layers' shapes round it) of at least 3 x 4 bytes each (master, Adam m
  // and v) besides the 16-bit params.
  EXPECT_GE(listed, 12.0 * 1.9e6) << m;
}

TEST(BenchEngineCli, NoNvmeTierMovesNoNvmeBytes) {
  const ProcessResult r = Bench(std::string(kTiny) + "--stage 3 --offload-optimizer cpu --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = Json(r);
  EXPECT_EQ(j["nvme_bytes_per_step"].get<double>(), 0.0);
  EXPECT_EQ(j["plan_bytes"]["nvme"].get<double>(), 0.0);
  EXPECT_GT(j["peak_bytes"]["host"].get<double>(), 0.0);  // the optimizer state lives there
  ExpectWithinBudgets(j);
}

// --overlap-step: the optimizer steps run behind the next forward; the measured steps still hold
// exactly --steps of them (the warm-up's waited for first, the last one's before the run ends),
// so the NVMe bytes per step are the step's own, never more than without; stage 2 says it is not
// applied.
TEST(BenchEngineCli, OverlapStepMeasuresWholeSteps) {
  strata::testing::TempDir dir("bench-engine-overlap");
  const std::string args = std::string(kPaged) +
                           "--stage 3 --offload-optimizer nvme --offload-param nvme "
                           "--json --nvme-path " +
                           dir.path();
  const ProcessResult plain = Bench(args);
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  const ProcessResult over = Bench(args + " --overlap-step");
  ASSERT_EQ(over.exit_code, 0) << over.out;
  const nlohmann::json p = Json(plain), o = Json(over);
  EXPECT_FALSE(p["overlap_step"].get<bool>());
  EXPECT_TRUE(o["overlap_step"].get<bool>());
  EXPECT_EQ(o["step_s_all"].size(), 2u);
  for (const auto& n : o["notes"])
    EXPECT_EQ(n.get<std::string>().find("overlap_step"), std::string::npos) << n;
  EXPECT_GT(o["nvme_write_bytes_per_step"].get<double>(), 0.0);
  // Every measured step's optimizer writes its state: the same writes as without.
  EXPECT_EQ(o["nvme_write_bytes_per_step"].get<double>(),
            p["nvme_write_bytes_per_step"].get<double>());
  EXPECT_LE(o["nvme_read_bytes_per_step"].get<double>(),
            p["nvme_read_bytes_per_step"].get<double>());
  ExpectWithinBudgets(o);
  const ProcessResult stage2 =
      Bench(std::string(kTiny) + "--stage 2 --offload-optimizer cpu --overlap-step --json");
  ASSERT_EQ(stage2.exit_code, 0) << stage2.out;
  const nlohmann::json s2 = Json(stage2);
  bool noted = false;
  for (const auto& n : s2["notes"])
    noted = noted || n.get<std::string>().find("overlap_step: not applied") != std::string::npos;
  EXPECT_TRUE(noted) << stage2.out;
}

// --grad-norm sets the synthetic gradient's norm against the synthetic config's clip at 1.0:
// below it no step clips and speculative_step keeps its work; above it every measured step clips,
// and the speculation, undone once in the warm-up, is not tried again.
TEST(BenchEngineCli, GradNormDecidesClippingAndTheSpeculation) {
  const std::string args = std::string(kTiny) +
                           "--stage 3 --offload-optimizer cpu --speculative-step on "
                           "--compute-ms 1 --json";
  const ProcessResult below = Bench(args);
  ASSERT_EQ(below.exit_code, 0) << below.out;
  const nlohmann::json b = Json(below);
  EXPECT_EQ(b["grad_norm"].get<double>(), 0.5);
  EXPECT_EQ(b["clipped_steps"].get<int>(), 0);
  EXPECT_GT(b["breakdown"]["speculated_sub_groups"].get<double>(), 0.0);
  EXPECT_EQ(b["breakdown"]["rolled_back_sub_groups"].get<double>(), 0.0);
  const ProcessResult above = Bench(args + " --grad-norm 4");
  ASSERT_EQ(above.exit_code, 0) << above.out;
  const nlohmann::json a = Json(above);
  EXPECT_EQ(a["clipped_steps"].get<int>(), 2);
  EXPECT_EQ(a["skipped_steps"].get<int>(), 0);
  EXPECT_EQ(a["breakdown"]["speculated_sub_groups"].get<double>(), 0.0);
  EXPECT_EQ(a["breakdown"]["rolled_back_sub_groups"].get<double>(), 0.0);
  // The text form says so.
  const ProcessResult text =
      Bench(std::string(kTiny) + "--stage 3 --offload-optimizer cpu --grad-norm 4");
  ASSERT_EQ(text.exit_code, 0) << text.out;
  EXPECT_NE(text.out.find("of 2 measured steps 2 clipped (--grad-norm 4)"), std::string::npos)
      << text.out;
}

// Two ranks: stage 2 moves one all-reduce of the gradients, stage 3 1.5x that when every layer is
// gathered again in backward (reuse distance 0; the bias groups sit between a layer's forward and
// backward use, and are persistent, so they are gathered once: within 1 % here).
TEST(BenchEngineCli, TwoRanksCommMatchesTheLedger) {
  const std::string model =
      " --params 2M --layers 4 --bias-groups --max-reuse-distance 0 --steps 2 --json ";
  const nlohmann::json s2 = LaunchJson(model + "--stage 2");
  const nlohmann::json s3 = LaunchJson(model + "--stage 3");
  ASSERT_TRUE(s2.contains("comm_bytes_per_rank")) << s2;
  ASSERT_TRUE(s3.contains("comm_bytes_per_rank")) << s3;
  EXPECT_EQ(s2["world_size"], 2);
  EXPECT_EQ(s2["ranks"].size(), 2u);
  const double c2 = s2["comm_bytes_per_rank"].get<double>();
  const double c3 = s3["comm_bytes_per_rank"].get<double>();
  EXPECT_GT(c2, 0.0);
  EXPECT_NEAR(c2 / s2["ledger_comm_bytes_per_rank"].get<double>(), 1.0, 0.01);
  EXPECT_NEAR(c3 / s3["ledger_comm_bytes_per_rank"].get<double>(), 1.0, 0.01);
  EXPECT_NEAR(s3["ledger_comm_bytes_per_rank"].get<double>() /
                  s2["ledger_comm_bytes_per_rank"].get<double>(),
              1.5, 1e-9);
  EXPECT_NEAR(c3 / c2, 1.5, 0.015);
  ExpectWithinBudgets(s2);
  ExpectWithinBudgets(s3);
}

// The paired split reference on 2 ranks: after each step every rank rewrites its own swap files
// at once; the pass moves all ranks' bytes of that step, its time is the slowest rank's, and the
// phases' bytes are both ranks'.
TEST(BenchEngineCli, TwoRanksPairedPassesMoveEveryRanksBytes) {
  strata::testing::TempDir dir("bench-paired-2");
  const nlohmann::json j = LaunchJson(
      " --params 8M --layers 8 --steps 3 --io-backend posix --stage 3 --offload-optimizer nvme "
      "--offload-param nvme --disk-reference-paired-split --speculative-step off --json "
      "--nvme-path " +
      dir.path());
  ASSERT_TRUE(j.contains("disk_reference_paired_split")) << j;
  EXPECT_EQ(j["world_size"], 2);
  ASSERT_EQ(j["ranks"].size(), 2u);
  const nlohmann::json& sp = j["disk_reference_paired_split"];
  ASSERT_TRUE(sp["measured"].get<bool>()) << j.dump();
  const auto reads = sp["read_bytes"].get<std::vector<double>>();
  const auto writes = sp["write_bytes"].get<std::vector<double>>();
  ASSERT_EQ(reads.size(), 3u);
  const double unit = 1 << 20;
  double rank_rd = 0, rank_wr = 0;
  for (const auto& r : j["ranks"]) {
    EXPECT_GT(r["nvme_read_bytes_per_step"].get<double>(), 0.0);
    rank_rd += r["nvme_read_bytes_per_step"].get<double>();
    rank_wr += r["nvme_write_bytes_per_step"].get<double>();
  }
  EXPECT_EQ(j["nvme_read_bytes_per_step"].get<double>(), rank_rd);
  // Each rank's pass rounds its own bytes up to whole units.
  EXPECT_NEAR((reads[0] + reads[1] + reads[2]) / 3, rank_rd, 2 * unit);
  EXPECT_NEAR((writes[0] + writes[1] + writes[2]) / 3, rank_wr, 2 * unit);
  const auto split_s = sp["seconds"].get<std::vector<double>>();
  const auto split_rd = sp["read_seconds"].get<std::vector<double>>();
  const auto split_wr = sp["write_seconds"].get<std::vector<double>>();
  ASSERT_EQ(split_s.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    // The slowest rank's read + write, at most the slowest read plus the slowest write.
    EXPECT_GT(split_s[i], 0.0) << i;
    EXPECT_LE(split_s[i], split_rd[i] + split_wr[i] + 1e-9) << i;
    EXPECT_GE(split_s[i], std::max(split_rd[i], split_wr[i])) << i;
  }
  ExpectPhasesCoverTheStep(j, /*split=*/true);
  ExpectWithinBudgets(j);
}

// ZeRO++ flags on 4 ranks laid out as 2 nodes of 2: the measured bytes per link equal the
// planner's ledger, and qwZ + hpZ + qgZ cut the inter-node bytes below 0.35x plain stage 3.
TEST(BenchEngineCli, ZeroPlusPlusOnTwoNodesMatchesTheLedger) {
  // Bias groups keep the last layer from being kept for backward (reuse distance 0 still keeps a
  // group used again right away), so every layer is gathered twice, as the ledger counts.
  const std::string model =
      " --params 2M --layers 4 --bias-groups --max-reuse-distance 0 --steps 1 --json ";
  const std::string launch = "-n 4 --ranks-per-node 2";
  const nlohmann::json plain = LaunchJson(model + "--stage 3", launch);
  const nlohmann::json zpp = LaunchJson(model + "--stage 3 --qwz --qgz --hpz 2", launch);
  for (const nlohmann::json* j : {&plain, &zpp}) {
    ASSERT_TRUE(j->contains("comm_bytes_per_rank_split")) << *j;
    EXPECT_EQ((*j)["ranks_per_node"], 2);
    for (const char* link : {"intra_node", "inter_node"}) {
      EXPECT_NEAR((*j)["comm_bytes_per_rank_split"][link].get<double>() /
                      (*j)["ledger_comm_bytes_per_rank_split"][link].get<double>(),
                  1.0, 0.01)
          << link << " " << *j;
    }
  }
  EXPECT_EQ(zpp["zero_pp"]["hpz_partition_size"], 2);
  EXPECT_TRUE(zpp["zero_pp"]["quantized_weights"].get<bool>());
  EXPECT_GT(zpp["zero_pp"]["hpz_secondary_bytes"].get<double>(), 0.0);
  EXPECT_LT(zpp["comm_bytes_per_rank_split"]["inter_node"].get<double>(),
            0.35 * plain["comm_bytes_per_rank_split"]["inter_node"].get<double>());
}

TEST(BenchEngineCli, SweepReportsWhatDoesNotFitAndRecommends) {
  strata::testing::TempDir dir("bench-engine-sweep");
  // 2M params: stages 0-2 hold 16 B/param on the device (32 MB), over a 20 MB budget.
  const ProcessResult r =
      Bench(std::string(kTiny) + "--sweep --device-gb 0.02 --json --nvme-path " + dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = Json(r);
  ASSERT_EQ(j["variants"].size(), 7u) << j;
  int fit = 0;
  for (const auto& v : j["variants"]) {
    EXPECT_TRUE(v.contains("planner_bytes")) << v;
    if (!v["fits"].get<bool>()) {
      EXPECT_NE(v["refused"].get<std::string>().find("does not fit"), std::string::npos) << v;
      continue;
    }
    ++fit;
    EXPECT_GT(v["step_s"].get<double>(), 0.0);
    ExpectWithinBudgets(v);
  }
  EXPECT_FALSE(j["variants"][0]["fits"].get<bool>()) << j["variants"][0];  // stage 0
  EXPECT_TRUE(j["variants"][6]["fits"].get<bool>()) << j["variants"][6];   // opt + param on nvme
  // The partial offload (half of the optimizer on the device) between no offload and the full one.
  EXPECT_EQ(j["variants"][3]["variant"], "stage 3 + opt cpu (ratio 0.5)") << j["variants"][3];
  EXPECT_GE(fit, 2);
  ASSERT_FALSE(j["recommendation"].is_null());
  double fastest = 1e9;
  for (const auto& v : j["variants"]) {
    if (v["fits"].get<bool>()) fastest = std::min(fastest, v["step_s"].get<double>());
  }
  EXPECT_EQ(j["recommendation"]["step_s"].get<double>(), fastest);
  // The table says the same.
  const ProcessResult text = Bench(std::string(kTiny) + "--sweep --device-gb 0.02");
  ASSERT_EQ(text.exit_code, 0) << text.out;
  EXPECT_NE(text.out.find("does not fit"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("recommendation: "), std::string::npos) << text.out;
}

TEST(BenchEngineCli, ASettingThatDoesNotFitExitsOne) {
  const ProcessResult r = Bench(std::string(kTiny) + "--stage 0 --device-gb 0.02 --json");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  const nlohmann::json j = Json(r);
  EXPECT_FALSE(j["fits"].get<bool>());
  EXPECT_NE(j["refused"].get<std::string>().find("hbm"), std::string::npos) << j;
}

TEST(BenchEngineCli, BadFlagsAreUsageErrorsNamingTheFlag) {
  for (const char* args :
       {"--stage 4", "--offload-optimizer moon", "--offload-param disk", "--params lots",
        "--layers 0", "--steps 0", "--dtype int8", "--io-backend floppy", "--max-reuse-distance x",
        "--speculation-buffer xyz", "--host-gb -1", "--sweep --stage 3", "--device gpu"}) {
    const ProcessResult r = Bench(args, "2>&1");
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.out;
    const std::string flag = std::string(args).substr(0, std::string(args).find(' '));
    EXPECT_NE(r.out.find(flag == "--sweep" ? "--stage" : flag), std::string::npos) << args << "\n"
                                                                                   << r.out;
  }
}

// --device: host runs on the HostDevice stand-in without PCIe figures; cuda runs on the GPU where
// one is usable (the JSON names it and carries the link's figures; the optimizer on the host
// moves bytes both ways every step) and is otherwise an error that says so.
TEST(BenchEngineCli, DeviceHostOrCuda) {
  const std::string args =
      " --params 1M --layers 2 --steps 1 --warmup-steps 0 --stage 3 --offload-optimizer cpu "
      "--compute-ms 1 --json";
  const ProcessResult host = Bench("--device host" + args);
  ASSERT_EQ(host.exit_code, 0) << host.out;
  const nlohmann::json h = Json(host);
  EXPECT_EQ(h["device"], "host-standin") << h;
  EXPECT_TRUE(h["pcie"].is_null()) << h;
  EXPECT_FALSE(h.contains("device_peak_used_bytes")) << h;
  strata::CudaDeviceOptions probe;
  probe.budget_bytes = 1 << 20;
  if (!strata::CreateCudaDevice(probe).ok()) {
    const ProcessResult cuda = Bench("--device cuda" + args, "2>&1");
    EXPECT_EQ(cuda.exit_code, 1) << cuda.out;
    EXPECT_NE(cuda.out.find("--device cuda: no usable GPU 0"), std::string::npos) << cuda.out;
    return;
  }
  const ProcessResult cuda = Bench("--device cuda" + args);
  ASSERT_EQ(cuda.exit_code, 0) << cuda.out;
  const nlohmann::json c = Json(cuda);
  EXPECT_EQ(c["device"].get<std::string>().rfind("cuda:0 ", 0), 0u) << c["device"];
  const nlohmann::json& x = c["pcie"];
  ASSERT_TRUE(x.is_object()) << c;
  for (const char* k : {"ref_h2d_gbps", "ref_d2h_gbps", "h2d_bytes_per_step", "d2h_bytes_per_step",
                        "bound_s", "step_vs_bound"}) {
    EXPECT_GT(x[k].get<double>(), 0.0) << k << " " << x;
  }
  EXPECT_GT(c["device_peak_used_bytes"].get<double>(), 0.0) << c;
  // The spin kernel's time passes on the GPU, waited for inside the step.
  EXPECT_GE(c["step_s"].get<double>(), 0.9 * c["breakdown"]["compute_s"].get<double>()) << c;
}

TEST(BenchEngineCli, EngineErrorsExitOneNamingTheProblem) {
  strata::testing::TempDir dir("bench-engine-cfg");
  const std::string cfg = dir.File("ds.json");
  FILE* f = std::fopen(cfg.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD"}})", f);
  std::fclose(f);
  const ProcessResult r = Bench(std::string(kTiny) + "--config " + cfg, "2>&1");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("optimizer.type"), std::string::npos) << r.out;
}

// --save-dir: --save-repeat pairs of a checkpoint (save + load) and a disk reference (same bytes,
// chunk and depth), in alternating order, each pair judged on its own and the figure their
// median; --keep-last reaches the saves' SaveOptions (keep_last 2: the third save recycles the
// first's files, two checkpoints remain).
TEST(BenchEngineCli, SaveDirPairsReferenceAndCheckpoint) {
  strata::testing::TempDir dir("bench-engine-save");
  const std::string save = dir.path() + "/save";
  const ProcessResult r = Bench(std::string(kTiny) +
                                "--stage 3 --offload-optimizer nvme --offload-param nvme "
                                "--json --save-repeat 3 --keep-last 2 "
                                "--nvme-path " +
                                dir.path() + " --save-dir " + save);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json c = Json(r)["checkpoint"];
  const double bytes = c["bytes"].get<double>();
  EXPECT_GT(bytes, 2e6 * 4 * 3);  // at least the fp32 master, m and v of 2M params
  EXPECT_EQ(c["keep_last"], 2);
  EXPECT_EQ(c["recycle_files"], true);
  EXPECT_EQ(c["reference_streams"], 1);
  EXPECT_TRUE(c["disk_measured"].get<bool>());
  EXPECT_GE(c["disk_reference_bytes"].get<double>(), bytes - 65536);
  EXPECT_EQ(c["disk_chunk_bytes"].get<double>(), 1 << 20);
  EXPECT_LE(c["host_peak_bytes"].get<double>(), c["host_budget_bytes"].get<double>());
  const nlohmann::json& pairs = c["pairs"];
  ASSERT_EQ(pairs.size(), 3u) << c;
  std::vector<double> ratios;
  for (size_t i = 0; i < pairs.size(); ++i) {
    const nlohmann::json& p = pairs[i];
    EXPECT_EQ(p["order"], i % 2 ? "reference, checkpoint" : "checkpoint, reference") << i;
    EXPECT_EQ(p["files"], i < 2 ? "new" : "recycled") << i;
    EXPECT_GT(p["save_s"].get<double>(), 0) << i;
    EXPECT_GT(p["load_s"].get<double>(), 0) << i;
    // The load writes the NVMe-homed states back to their swap files.
    EXPECT_GE(p["load_swap_write_bytes"].get<double>(), 2e6 * 4 * 3) << i;
    // Each pair's ratio: its own reference's time for the bytes moved over the save's time.
    const double write =
        p[i < 2 ? "disk_write_fresh_bytes_per_s" : "disk_write_overwrite_bytes_per_s"]
            .get<double>();
    const double disk_s =
        bytes / write +
        p["save_swap_read_bytes"].get<double>() / p["disk_read_bytes_per_s"].get<double>() +
        p["save_swap_write_bytes"].get<double>() /
            p["disk_write_overwrite_bytes_per_s"].get<double>();
    EXPECT_NEAR(p["save_ratio"].get<double>(), disk_s / p["save_s"].get<double>(), 1e-9) << i;
    ratios.push_back(p["save_ratio"].get<double>());
  }
  std::sort(ratios.begin(), ratios.end());
  EXPECT_DOUBLE_EQ(c["save_ratio"].get<double>(), ratios[1]);
  EXPECT_DOUBLE_EQ(c["save_recycled_ratio"].get<double>(), pairs[2]["save_ratio"].get<double>());
  EXPECT_TRUE(std::filesystem::exists(save + "/bench-v0/s1/manifest.json"));
  EXPECT_TRUE(std::filesystem::exists(save + "/bench-v0/s2/manifest.json"));
  EXPECT_FALSE(std::filesystem::exists(save + "/bench-v0/s0"));
}

// The config's `checkpoint` section sets the bench's retention (keep_last 2: the third save
// recycles); --no-recycle-files overrides recycle_files (the third save writes new files).
TEST(BenchEngineCli, SaveDirRetentionFromTheConfig) {
  strata::testing::TempDir dir("bench-engine-keep");
  const std::string cfg = dir.File("ds.json");
  std::ofstream(cfg) << R"({"train_micro_batch_size_per_gpu": 1,
                            "checkpoint": {"keep_last": 2, "recycle_files": true}})";
  const std::string args = std::string(kTiny) +
                           "--stage 3 --offload-optimizer nvme --json "
                           "--save-repeat 3 --config " +
                           cfg + " --nvme-path " + dir.path() + " --save-dir " + dir.path() +
                           "/save";
  for (bool no_recycle : {false, true}) {
    const ProcessResult r = Bench(args + (no_recycle ? " --no-recycle-files" : ""));
    ASSERT_EQ(r.exit_code, 0) << r.out;
    const nlohmann::json c = Json(r)["checkpoint"];
    EXPECT_EQ(c["keep_last"], 2) << c;
    EXPECT_EQ(c["recycle_files"], !no_recycle) << c;
    ASSERT_EQ(c["pairs"].size(), 3u) << c;
    EXPECT_EQ(c["pairs"][2]["files"], no_recycle ? "new" : "recycled") << c;
    EXPECT_FALSE(std::filesystem::exists(dir.path() + "/save/bench-v0/s0"));
  }
}

// Two ranks: the reference is both ranks' streams at once, over both rank files' bytes.
TEST(BenchEngineCli, SaveDirReferenceIsEveryRankAtOnce) {
  strata::testing::TempDir dir("bench-engine-save2");
  const nlohmann::json j = LaunchJson(std::string(kTiny) +
                                      "--stage 3 --offload-optimizer nvme --json "
                                      "--save-repeat 2 --nvme-path " +
                                      dir.path() + " --save-dir " + dir.path() + "/save");
  ASSERT_TRUE(j.contains("checkpoint")) << j;
  const nlohmann::json& c = j["checkpoint"];
  EXPECT_EQ(c["reference_streams"], 2);
  ASSERT_EQ(c["pairs"].size(), 2u);
  // Both rank files (each rounded up to whole chunks), not rank 0's alone.
  const double bytes = c["bytes"].get<double>();
  EXPECT_GE(c["disk_reference_bytes"].get<double>(), bytes - 65536) << c;
  EXPECT_LE(c["disk_reference_bytes"].get<double>(), bytes + 2.0 * (1 << 20)) << c;
  EXPECT_GT(c["save_ratio"].get<double>(), 0) << c;
}

}  // namespace
