// `offloadctl bench adam`: fused Adam/AdamW step throughput per dtype path for 1..N threads,
// next to the DRAM bandwidth measured in the same run (the non-temporal triad is the ceiling a
// streaming kernel can reach).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kernels/bench/adam_bench.h"
#include "kernels/bench/dram_bench.h"
#include "kernels/pool.h"
#include "kernels/targets.h"
#include "strata/planner.h"
#include "tools/offloadctl/bench_common.h"
#include "tools/offloadctl/cli_flags.h"
#include "tools/offloadctl/commands.h"

namespace strata::cli {
namespace {

struct Opts {
  std::string params = "64M";
  int threads = 0;
  int reps = 5;
  uint64_t array_bytes = uint64_t{256} << 20;
  bool bind = false;
  bool stream_state = false;
  bool json = false;
  std::vector<std::string> paths;
};

nlohmann::json RowJson(const kernels::AdamBenchRow& row) {
  return {{"threads", row.threads},
          {"params_per_s", row.params_per_s},
          {"effective_bytes_per_s", row.effective_bytes_per_s},
          {"nt_triad_bytes_per_s", row.nt_triad_bytes_per_s}};
}

// The --dtype-path names as paths; nullopt, with *error set, when one is unknown.
std::optional<std::vector<kernels::AdamPath>> ParsePaths(const std::vector<std::string>& names,
                                                         std::string* error) {
  if (names.empty()) return kernels::AllAdamPaths();
  std::vector<kernels::AdamPath> paths;
  for (const std::string& name : names) {
    const size_t before = paths.size();
    for (const auto& p : kernels::AllAdamPaths()) {
      if (p.Name() == name) paths.push_back(p);
    }
    if (paths.size() == before) {
      *error = "unknown --dtype-path '" + name + "'; known:";
      for (const auto& p : kernels::AllAdamPaths()) *error += " " + p.Name();
      return std::nullopt;
    }
  }
  return paths;
}

void PrintJson(size_t params, double nt, const kernels::DramReport& dram,
               const std::vector<kernels::AdamBenchResult>& adam) {
  nlohmann::json paths = nlohmann::json::object();
  for (const auto& r : adam) {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& row : r.rows) rows.push_back(RowJson(row));
    paths[r.path.Name()] = {
        {"grad", DTypeName(r.path.grad)},
        {"out", r.path.out ? std::string(DTypeName(*r.path.out)) : std::string("none")},
        {"bytes_per_param", r.bytes_per_param},
        {"params_per_s", r.best.params_per_s},
        {"effective_bytes_per_s", r.best.effective_bytes_per_s},
        {"threads", r.best.threads},
        {"ratio_to_nt_triad", nt > 0 ? r.best.effective_bytes_per_s / nt : 0.0},
        {"rows", rows}};
  }
  const nlohmann::json out = {{"params", params},
                              {"target", kernels::KernelTargetName(kernels::ActiveKernelTarget())},
                              {"nt_triad_bytes_per_s", nt},
                              {"triad_bytes_per_s", dram.best.triad_bytes_per_s},
                              {"dram", DramJson(dram)},
                              {"paths", paths}};
  std::printf("%s\n", out.dump(2).c_str());
}

void PrintTable(size_t params, double nt, const kernels::DramReport& dram,
                const std::vector<kernels::AdamBenchResult>& adam) {
  PrintDramTable(dram);
  std::printf("\nFused Adam/AdamW over %zu params (target %s)\n", params,
              kernels::KernelTargetName(kernels::ActiveKernelTarget()).c_str());
  std::printf("%-22s %6s %8s %10s %10s %14s %10s\n", "path", "B/par", "threads", "Gparams/s",
              "GB/s", "nt triad GB/s", "ratio");
  for (const auto& r : adam) {
    for (const auto& row : r.rows) {
      std::printf("%-22s %6zu %8d %10.3f %10.2f %14.2f %10.3f\n", r.path.Name().c_str(),
                  r.bytes_per_param, row.threads, row.params_per_s / 1e9,
                  row.effective_bytes_per_s / 1e9, row.nt_triad_bytes_per_s / 1e9,
                  row.effective_bytes_per_s / row.nt_triad_bytes_per_s);
    }
  }
  std::printf(
      "(nt triad: interleaved with the Adam steps on the same threads; run best %.2f "
      "GB/s)\n",
      nt / 1e9);
}

int Fail(const Opts& o, const Status& s) {
  return Failure("bench adam", s.ToString(), kExitInvalid, o.json);
}

int Run(const Opts& o) {
  // The parameter count as `plan --params` reads it (decimal suffixes: 64M = 64e6).
  const Result<double> count = ParseParamCount(o.params);
  if (!count.ok()) {
    return Failure("bench adam", "--params: " + std::string(count.status().message()), kExitUsage,
                   o.json);
  }
  const std::optional<size_t> params = static_cast<size_t>(*count);
  std::string unknown;
  std::optional<std::vector<kernels::AdamPath>> paths = ParsePaths(o.paths, &unknown);
  if (!paths) return Failure("bench adam", unknown, kExitUsage, o.json);

  kernels::DramBenchOptions dopt;
  dopt.array_bytes = o.array_bytes;
  dopt.max_threads = o.threads;
  dopt.reps = o.reps;
  dopt.bind_threads = o.bind;
  auto dram = kernels::MeasureDram(dopt);
  if (!dram.ok()) return Fail(o, dram.status());
  // A second set of arrays for the nt triads interleaved with the Adam steps.
  auto pool = kernels::KernelPool::Create({.threads = o.threads, .bind_threads = o.bind});
  if (!pool.ok()) return Fail(o, pool.status());
  auto probe = kernels::DramProbe::Create(dopt.array_bytes, **pool);
  if (!probe.ok()) return Fail(o, probe.status());

  kernels::AdamBenchOptions aopt;
  aopt.reference = &*probe;
  aopt.paths = std::move(*paths);
  aopt.params = *params;
  aopt.max_threads = o.threads;
  aopt.reps = o.reps;
  aopt.bind_threads = o.bind;
  aopt.stream_state = o.stream_state;
  auto adam = kernels::MeasureAdam(aopt);
  if (!adam.ok()) return Fail(o, adam.status());

  // The run's nt triad: the best of the DRAM pass and of the triads interleaved with Adam.
  double nt = dram->best.nt_triad_bytes_per_s;
  for (const auto& r : *adam) {
    for (const auto& row : r.rows) nt = std::max(nt, row.nt_triad_bytes_per_s);
  }
  if (o.json) {
    PrintJson(*params, nt, *dram, *adam);
  } else {
    PrintTable(*params, nt, *dram, *adam);
  }
  return kExitOk;
}

}  // namespace

void RegisterBenchAdam(CLI::App& bench, int* exit_code) {
  auto* cmd = bench.add_subcommand(
      "adam",
      "Fused Adam/AdamW step: params/s and effective GB/s per dtype path for 1, 2, 4, ..., N "
      "threads, next to this run's DRAM triad");
  auto o = std::make_shared<Opts>();
  cmd->add_option("--params", o->params,
                  "Shard size in parameters, as plan's --params: 64M, 1.5B, 7e6 (decimal k/M/B; "
                  "needs ~30 bytes each)")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads,
                  "Measure 1, 2, 4, ... and THREADS threads (0: one per CPU)")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  cmd->add_option("--reps", o->reps, "Timed steps per path and thread count; the fastest counts")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  AddArraySize(cmd, &o->array_bytes, "Bytes per array of the DRAM reference benchmark");
  cmd->add_option("--dtype-path", o->paths,
                  "Measure only this dtype path, e.g. grad_bf16_out_bf16 (repeatable; "
                  "default: all nine grad {fp32,bf16,fp16} x out {none,bf16,fp16})")
      ->type_name("NAME")
      ->allow_extra_args(false);
  cmd->add_flag("--bind", o->bind, "Bind worker threads to cores (hwloc)");
  cmd->add_flag("--stream-state", o->stream_state,
                "Non-temporal stores for master/m/v too (the bf16/fp16 output always streams)");
  cmd->add_flag("--json", o->json,
                "Print one JSON object: per path params_per_s, bytes_per_param, "
                "effective_bytes_per_s, and nt_triad_bytes_per_s of the same run");
  cmd->callback([o, exit_code] { *exit_code = Run(*o); });
}

}  // namespace strata::cli
