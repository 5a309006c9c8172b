// Helpers shared by the `offloadctl bench` subcommands: the DRAM arrays' size option and the
// DRAM report (bench dram) that bench adam repeats as its same-run reference.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "kernels/bench/dram_bench.h"
#include "tools/offloadctl/cli_flags.h"

namespace strata::cli {

// `--array-size SIZE` (1M to 1T) of bench dram and bench adam, into *bytes.
void AddArraySize(CLI::App* cmd, uint64_t* bytes, const std::string& help);

// Defined in cmd_bench_dram.cc.
nlohmann::json DramJson(const kernels::DramReport& report);
void PrintDramTable(const kernels::DramReport& report);

}  // namespace strata::cli
