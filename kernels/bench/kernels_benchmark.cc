// Google Benchmark for the CPU kernels (not part of the test run):
//   build/kernels/kernels_benchmark --benchmark_filter=Adam
// Reports bytes/s with the bytes each kernel must move (Adam: AdamBytesPerParam), single thread
// and over a KernelPool of all CPUs. ZeRO++'s INT8 quantize / dequantize count the bytes they
// must move: the 16-bit (or fp32) values, the INT8 values and the scales (the second pass of
// quantize rereads a block from L1/L2 and is not counted). Figures on a shared machine are noisy;
// compare against the DRAM triad measured in the same run (BM_NtTriad).
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>

#include "kernels/adam.h"
#include "kernels/buffer.h"
#include "kernels/casts.h"
#include "kernels/grad_stats.h"
#include "kernels/pool.h"
#include "kernels/quantize.h"
#include "kernels/simd.h"
#include "kernels/targets.h"

namespace strata::kernels {
namespace {

constexpr size_t kParams = size_t{16} << 20;  // 16 Mi params: 448 MiB for the bf16/bf16 path

HugeBuffer Zeroed(size_t bytes) {
  auto b = HugeBuffer::Allocate(bytes);
  if (!b.ok()) std::abort();
  std::memset(b->data(), 0, bytes);
  return std::move(b).value();
}

KernelPool& AllThreads() {
  static std::unique_ptr<KernelPool> pool = [] {
    auto p = KernelPool::Create({});
    if (!p.ok()) std::abort();
    return std::move(p).value();
  }();
  return *pool;
}

// state.range(0): grad dtype, range(1): out dtype (-1 none), range(2): threads (0 single call).
void BM_Adam(benchmark::State& state) {
  const auto grad_t = static_cast<DType>(state.range(0));
  const std::optional<DType> out_t =
      state.range(1) < 0 ? std::nullopt : std::optional<DType>(static_cast<DType>(state.range(1)));
  HugeBuffer p = Zeroed(kParams * 4), m = Zeroed(kParams * 4), v = Zeroed(kParams * 4);
  HugeBuffer g = Zeroed(kParams * 4), o = Zeroed(kParams * 2);
  AdamShard shard{p.as<float>(),
                  m.as<float>(),
                  v.as<float>(),
                  g.data(),
                  grad_t,
                  out_t ? o.data() : nullptr,
                  out_t.value_or(DType::kBF16),
                  kParams};
  AdamHyper hyper;
  hyper.weight_decay = 0.01f;
  for (auto _ : state) {
    ++hyper.step;
    Status s = state.range(2) ? AdamStep(AllThreads(), hyper, shard) : AdamStep(hyper, shard);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
  }
  const double bytes = static_cast<double>(AdamBytesPerParam(grad_t, out_t));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kParams * bytes));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * kParams));
  state.SetLabel(KernelTargetName(ActiveKernelTarget()));
}
BENCHMARK(BM_Adam)
    ->ArgsProduct({{static_cast<int>(DType::kF32), static_cast<int>(DType::kBF16),
                    static_cast<int>(DType::kF16)},
                   {-1, static_cast<int>(DType::kBF16)},
                   {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_NtTriad(benchmark::State& state) {
  const size_t n = kParams * 2;
  HugeBuffer a = Zeroed(n * 4), b = Zeroed(n * 4), c = Zeroed(n * 4);
  auto body = [&](int, size_t lo, size_t hi) {
    simd::StreamTriad(a.as<float>() + lo, b.as<float>() + lo, c.as<float>() + lo, 3.0f, hi - lo,
                      state.range(0) != 0);
  };
  for (auto _ : state) AllThreads().ForEachTile(n, RoundTile(n / AllThreads().threads() + 1), body);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * 12));
}
BENCHMARK(BM_NtTriad)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_GradStats(benchmark::State& state) {
  const auto t = static_cast<DType>(state.range(0));
  HugeBuffer g = Zeroed(kParams * 4);
  for (auto _ : state) {
    auto r = ComputeGradStats(AllThreads(), g.data(), t, kParams);
    benchmark::DoNotOptimize(r);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kParams * DTypeSize(t)));
}
BENCHMARK(BM_GradStats)
    ->Arg(static_cast<int>(DType::kF32))
    ->Arg(static_cast<int>(DType::kBF16))
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_CastF32ToBf16(benchmark::State& state) {
  HugeBuffer in = Zeroed(kParams * 4), out = Zeroed(kParams * 2);
  for (auto _ : state) {
    Status s = Cast(AllThreads(), in.data(), DType::kF32, out.data(), DType::kBF16, kParams);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kParams * 6));
}
BENCHMARK(BM_CastF32ToBf16)->Unit(benchmark::kMillisecond)->UseRealTime();

// state.range(0): source dtype; range(1): threads (0 single call).
void BM_QuantizeInt8(benchmark::State& state) {
  const auto t = static_cast<DType>(state.range(0));
  HugeBuffer in = Zeroed(kParams * DTypeSize(t)), q = Zeroed(kParams);
  HugeBuffer scales = Zeroed(QuantBlocks(kParams, kQuantBlock) * 4);
  // Nonzero values, so every block takes the quantizing path.
  if (t == DType::kF32) {
    for (size_t i = 0; i < kParams; ++i) in.as<float>()[i] = static_cast<float>(i % 251) - 125;
  } else {
    for (size_t i = 0; i < kParams; ++i) in.as<uint16_t>()[i] = 0x3f80 + i % 64;
  }
  for (auto _ : state) {
    Result<size_t> r =
        state.range(1)
            ? QuantizeInt8(AllThreads(), t, in.data(), kParams, kQuantBlock, q.as<int8_t>(),
                           scales.as<float>())
            : QuantizeInt8(t, in.data(), kParams, kQuantBlock, q.as<int8_t>(), scales.as<float>());
    if (!r.ok()) state.SkipWithError(r.status().ToString().c_str());
  }
  const double bytes =
      static_cast<double>(DTypeSize(t)) +
      Int8WireLayout(kParams, kQuantBlock).total_bytes / static_cast<double>(kParams);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kParams * bytes));
  state.SetLabel(KernelTargetName(ActiveKernelTarget()));
}
BENCHMARK(BM_QuantizeInt8)
    ->ArgsProduct({{static_cast<int>(DType::kF32), static_cast<int>(DType::kBF16)}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// state.range(0): destination dtype, or -1 for the fp32 dequantize-add; range(1): threads.
void BM_DequantizeInt8(benchmark::State& state) {
  const bool add = state.range(0) < 0;
  const DType t = add ? DType::kF32 : static_cast<DType>(state.range(0));
  HugeBuffer q = Zeroed(kParams), out = Zeroed(kParams * DTypeSize(t));
  HugeBuffer scales = Zeroed(QuantBlocks(kParams, kQuantBlock) * 4);
  for (size_t b = 0; b < QuantBlocks(kParams, kQuantBlock); ++b) scales.as<float>()[b] = 0.01f;
  for (size_t i = 0; i < kParams; ++i) q.as<int8_t>()[i] = static_cast<int8_t>(i % 255 - 127);
  const bool pool = state.range(1) != 0;
  for (auto _ : state) {
    Status s;
    if (add) {
      s = pool ? DequantizeAddInt8(AllThreads(), q.as<int8_t>(), scales.as<float>(), kParams,
                                   kQuantBlock, out.as<float>())
               : DequantizeAddInt8(q.as<int8_t>(), scales.as<float>(), kParams, kQuantBlock,
                                   out.as<float>());
    } else {
      s = pool ? DequantizeInt8(AllThreads(), q.as<int8_t>(), scales.as<float>(), kParams,
                                kQuantBlock, t, out.data())
               : DequantizeInt8(q.as<int8_t>(), scales.as<float>(), kParams, kQuantBlock, t,
                                out.data());
    }
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
  }
  // INT8 + scales in; the output written (and read too for the add).
  const double in_bytes =
      Int8WireLayout(kParams, kQuantBlock).total_bytes / static_cast<double>(kParams);
  const double bytes = in_bytes + (add ? 8.0 : static_cast<double>(DTypeSize(t)));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kParams * bytes));
  state.SetLabel(KernelTargetName(ActiveKernelTarget()));
}
BENCHMARK(BM_DequantizeInt8)
    ->ArgsProduct({{static_cast<int>(DType::kBF16), -1}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace strata::kernels

BENCHMARK_MAIN();
