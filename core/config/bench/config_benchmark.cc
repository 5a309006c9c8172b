// Google Benchmark for the DeepSpeed config reader (not part of the test run):
//   build/core/config/config_benchmark --benchmark_filter=long_key
// Check/<shape>/<MiB>: CheckDeepSpeedConfig over a large config of each shape that was once
// quadratic (issue 12, section 5), in bytes/s; JsonParse/<shape>/<MiB> parses the same text with
// plain nlohmann::json, the reference. Linear means the bytes/s stay flat as the size grows.
#include <benchmark/benchmark.h>

#include <string>

#include <nlohmann/json.hpp>

#include "core/config/bench/large_configs.h"
#include "strata/config.h"

namespace strata::config {
namespace {

void BM_Check(benchmark::State& state, LargeShape shape, size_t bytes) {
  const std::string text = LargeConfig(shape, bytes);
  for (auto _ : state) {
    ConfigCheck c = CheckDeepSpeedConfig(text);
    benchmark::DoNotOptimize(c);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}

void BM_JsonParse(benchmark::State& state, LargeShape shape, size_t bytes) {
  const std::string text = LargeConfig(shape, bytes);
  for (auto _ : state) {
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    benchmark::DoNotOptimize(j);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}

// Registered by name ("Check/long_key/16") rather than by index arguments.
const bool kRegistered = [] {
  for (const char* kind : {"Check", "JsonParse"}) {
    for (LargeShape shape : kLargeShapes) {
      for (size_t mib : {1, 4, 16}) {
        const std::string name = std::string(kind) + "/" + std::string(LargeShapeName(shape)) +
                                 "/" + std::to_string(mib);
        benchmark::RegisterBenchmark(name.c_str(), kind[0] == 'C' ? BM_Check : BM_JsonParse, shape,
                                     mib << 20)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
  }
  return true;
}();

}  // namespace
}  // namespace strata::config

BENCHMARK_MAIN();
