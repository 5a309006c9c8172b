// Helpers shared by the `offloadctl bench` subcommands: counts with K/M/G suffixes, and the DRAM
// report (bench dram) that bench adam repeats as its same-run reference.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "kernels/bench/dram_bench.h"

namespace strata::cli {

// "64M" -> 64 * 2^20, "1000" -> 1000, "2G" -> 2^31 (binary multiples: K = 1024). nullopt when
// `s` is not a positive count.
std::optional<size_t> ParseCount(const std::string& s);

// Defined in cmd_bench_dram.cc.
nlohmann::json DramJson(const kernels::DramReport& report);
void PrintDramTable(const kernels::DramReport& report);

}  // namespace strata::cli
