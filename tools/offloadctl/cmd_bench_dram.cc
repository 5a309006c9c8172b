// `offloadctl bench dram`: STREAM-like DRAM bandwidth (copy, triad, non-temporal triad) for
// 1..N threads. The measurement lives in kernels/dram_bench.h so other benchmarks (bench adam)
// report it from the same run.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kernels/bench/dram_bench.h"
#include "kernels/targets.h"
#include "tools/offloadctl/bench_common.h"
#include "tools/offloadctl/cli_flags.h"
#include "tools/offloadctl/commands.h"

namespace strata::cli {

nlohmann::json DramJson(const kernels::DramReport& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : r.rows) {
    rows.push_back({{"threads", row.threads},
                    {"copy_bytes_per_s", row.copy_bytes_per_s},
                    {"triad_bytes_per_s", row.triad_bytes_per_s},
                    {"nt_triad_bytes_per_s", row.nt_triad_bytes_per_s}});
  }
  return {{"array_bytes", r.array_bytes},
          {"target", kernels::KernelTargetName(kernels::ActiveKernelTarget())},
          {"copy_bytes_per_s", r.best.copy_bytes_per_s},
          {"triad_bytes_per_s", r.best.triad_bytes_per_s},
          {"triad_threads", r.best_triad_threads},
          {"nt_triad_bytes_per_s", r.best.nt_triad_bytes_per_s},
          {"nt_triad_threads", r.best_nt_triad_threads},
          {"rows", rows}};
}

void PrintDramTable(const kernels::DramReport& r) {
  std::printf("DRAM (arrays of %.0f MiB, STREAM byte counting)\n",
              static_cast<double>(r.array_bytes) / (1 << 20));
  std::printf("%8s %12s %12s %14s\n", "threads", "copy GB/s", "triad GB/s", "nt triad GB/s");
  for (const auto& row : r.rows) {
    std::printf("%8d %12.2f %12.2f %14.2f\n", row.threads, row.copy_bytes_per_s / 1e9,
                row.triad_bytes_per_s / 1e9, row.nt_triad_bytes_per_s / 1e9);
  }
}

void RegisterBenchDram(CLI::App& bench, int* exit_code) {
  auto* cmd = bench.add_subcommand(
      "dram", "DRAM bandwidth: copy, triad and non-temporal triad for 1, 2, 4, ..., N threads");
  struct Opts {
    uint64_t array_bytes = uint64_t{256} << 20;
    int threads = 0;
    int reps = 5;
    bool bind = false;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  AddArraySize(cmd, &o->array_bytes,
               "Bytes per array (three arrays); must dwarf the last-level cache");
  cmd->add_option("--threads", o->threads,
                  "Measure 1, 2, 4, ... and THREADS threads (0: one per CPU)")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  cmd->add_option("--reps", o->reps, "Runs per kernel; the fastest counts")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_flag("--bind", o->bind, "Bind worker threads to cores (hwloc)");
  cmd->add_flag("--json", o->json, "Print one JSON object instead of a table");
  cmd->callback([o, exit_code] {
    kernels::DramBenchOptions opt;
    opt.array_bytes = o->array_bytes;
    opt.max_threads = o->threads;
    opt.reps = o->reps;
    opt.bind_threads = o->bind;
    auto r = kernels::MeasureDram(opt);
    if (!r.ok()) {
      *exit_code = Failure("bench dram", r.status().ToString(), kExitInvalid, o->json);
      return;
    }
    if (o->json) {
      std::printf("%s\n", DramJson(*r).dump(2).c_str());
    } else {
      PrintDramTable(*r);
    }
    *exit_code = kExitOk;
  });
}

}  // namespace strata::cli
