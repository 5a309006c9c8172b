// Google Benchmark for the Gloo communicator's widen / accumulate / round loops
// (cpu/host_reduce.h), SIMD against the scalar reference in the same run (not part of the test
// run):
//   build/cpu/host_reduce_benchmark
// Each benchmark runs both on the same buffers (one ring segment: GlooCommOptions::scratch_elems,
// 1 Mi elements) every iteration and reports the SIMD pass's time, bytes/s over the bytes the loop
// must move, and `speedup` = scalar time / SIMD time over the whole run (a ratio measured side by
// side, so a noisy shared machine moves both). The SIMD target is the best this CPU supports
// (`target` in the context line).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu/host_reduce.h"
#include "kernels/targets.h"

namespace strata {
namespace {

constexpr size_t kElems = size_t{1} << 20;

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Runs `simd` and `scalar` once per iteration; reports the SIMD time and the speedup.
template <class Simd, class Scalar>
void SideBySide(benchmark::State& state, uint64_t bytes, const Simd& simd, const Scalar& scalar) {
  double simd_s = 0, scalar_s = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    scalar();
    const auto t1 = Clock::now();
    simd();
    const auto t2 = Clock::now();
    scalar_s += Seconds(t0, t1);
    simd_s += Seconds(t1, t2);
    state.SetIterationTime(Seconds(t1, t2));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["speedup"] = simd_s > 0 ? scalar_s / simd_s : 0;
}

struct Buffers {
  std::vector<uint16_t> half = std::vector<uint16_t>(kElems);
  std::vector<float> f32 = std::vector<float>(kElems), partial = std::vector<float>(kElems),
                     out = std::vector<float>(kElems);
  std::vector<uint16_t> out16 = std::vector<uint16_t>(kElems);
  explicit Buffers(DType dt) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-4.0f, 4.0f);
    for (size_t i = 0; i < kElems; ++i) {
      f32[i] = u(rng);
      partial[i] = u(rng);
    }
    host_reduce_ref::StoreFloat(dt, f32.data(), half.data(), kElems);
  }
};

DType Dt(const benchmark::State& state) { return static_cast<DType>(state.range(0)); }

// The first ring step: widen this rank's segment, times the predivide.
void BM_LoadScaled(benchmark::State& state) {
  const DType dt = Dt(state);
  Buffers b(dt);
  SideBySide(
      state, kElems * (DTypeSize(dt) + 4),
      [&] { LoadScaled(dt, b.half.data(), b.out.data(), kElems, 0.5f); },
      [&] { host_reduce_ref::LoadScaled(dt, b.half.data(), b.out.data(), kElems, 0.5f); });
}

// Every later ring step: received partial + own widened contribution.
void BM_AccumulateScaled(benchmark::State& state) {
  const DType dt = Dt(state);
  Buffers b(dt);
  SideBySide(
      state, kElems * (DTypeSize(dt) + 8),
      [&] { AccumulateScaled(dt, b.half.data(), b.partial.data(), b.out.data(), kElems, 1.0f); },
      [&] {
        host_reduce_ref::AccumulateScaled(dt, b.half.data(), b.partial.data(), b.out.data(), kElems,
                                          1.0f);
      });
}

// The end of the reduce-scatter: the fp32 sum rounded once to the 16-bit dtype.
void BM_StoreFloat(benchmark::State& state) {
  const DType dt = Dt(state);
  Buffers b(dt);
  SideBySide(
      state, kElems * (4 + DTypeSize(dt)),
      [&] { StoreFloat(dt, b.f32.data(), b.out16.data(), kElems); },
      [&] { host_reduce_ref::StoreFloat(dt, b.f32.data(), b.out16.data(), kElems); });
}

void Dtypes(benchmark::internal::Benchmark* b) {
  b->ArgName("dtype")->Arg(static_cast<int>(DType::kBF16))->Arg(static_cast<int>(DType::kF16));
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_LoadScaled)->Apply(Dtypes);
BENCHMARK(BM_AccumulateScaled)->Apply(Dtypes);
BENCHMARK(BM_StoreFloat)->Apply(Dtypes);

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext(
      "target", strata::kernels::KernelTargetName(strata::kernels::ActiveKernelTarget()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
