// offloadctl subcommands. Each Register* function adds one subcommand (with its --help text for
// every option) to `parent` and, when that subcommand runs, stores the process exit code in
// *exit_code: 0 ok, 1 the checked thing is invalid or does not fit, 2 usage error.
//
// Adding a subcommand: write tools/offloadctl/cmd_<name>.cc, declare its Register function here,
// call it from main.cc and add the file to tools/CMakeLists.txt.
#pragma once

namespace CLI {
class App;
}

namespace strata::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitInvalid = 1;
inline constexpr int kExitUsage = 2;

// Top-level commands.
void RegisterPlan(CLI::App& parent, int* exit_code);  // offloadctl plan (cmd_plan.cc)
void RegisterConfig(CLI::App& parent, int* exit_code);  // `config check` (cmd_config.cc)
void RegisterLaunch(CLI::App& parent, int* exit_code);  // offloadctl launch (cmd_launch.cc)
void RegisterClean(CLI::App& parent, int* exit_code);   // offloadctl clean (cmd_clean.cc)
void RegisterCkpt(CLI::App& parent, int* exit_code);    // `ckpt inspect|verify|export` (cmd_ckpt.cc)

// `offloadctl bench <what>` children.
void RegisterBenchNvme(CLI::App& bench, int* exit_code);  // cmd_bench_nvme.cc
void RegisterBenchComm(CLI::App& bench, int* exit_code);  // cmd_bench_comm.cc
void RegisterBenchDram(CLI::App& bench, int* exit_code);  // cmd_bench_dram.cc
void RegisterBenchAdam(CLI::App& bench, int* exit_code);  // cmd_bench_adam.cc
void RegisterBenchStore(CLI::App& bench, int* exit_code);  // cmd_bench_store.cc
void RegisterBenchEngine(CLI::App& bench, int* exit_code);  // cmd_bench_engine.cc

}  // namespace strata::cli
