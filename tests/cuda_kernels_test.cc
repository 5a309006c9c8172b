// The CUDA kernels (kernels/cuda_kernels.h) against the CPU kernels, over adversarial inputs
// (NaN with payloads, signaling NaN, Inf, subnormals, values near FLT_MAX, rounding ties, random
// 16-bit patterns) and sizes around every block and chunk boundary.
//
// Two layers:
//   ReferenceTest  runs without a GPU: the per-element code the kernels are built from
//                  (kernels/cuda_math.h, compiled here for the host) against the CPU SIMD kernels,
//                  bit for bit, on every target this CPU has (Adam) and the AVX2 target
//                  (chunk sums). Plus argument validation, which happens before any CUDA call.
//   CudaKernelsTest  needs a GPU (GTEST_SKIP with the reason otherwise): the kernels themselves
//                  against that host reference and the CPU kernels. Equality is bitwise except
//                  that a NaN must only meet a NaN (cuda_kernels.h: NaN bits differ by design).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernels/adam.h"
#include "kernels/adam_math.h"
#include "kernels/casts.h"
#include "kernels/cuda_kernels.h"
#include "kernels/cuda_math.h"
#include "kernels/grad_stats.h"
#include "kernels/quantize.h"
#include "kernels/quantize_math.h"
#include "kernels/simd.h"
#include "kernels/targets.h"
#include "strata/dtype.h"

namespace strata::kernels {
namespace {

namespace cm = cuda_math;

// Sizes around the elementwise block (256), the chunk-sum lanes (16) and chunk (4096), and the
// CPU vector widths (2 * 8, 2 * 16).
const size_t kSizes[] = {0,   1,   2,   7,    15,   16,   17,   31,   32,   33,
                         255, 256, 257, 1000, 4095, 4096, 4097, 8191, 12289};
const size_t kLargeSizes[] = {(1u << 20) + 5};
const DType kGradTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const std::optional<DType> kOutTypes[] = {std::nullopt, DType::kBF16, DType::kF16};

// ----------------------------------------------------------------------------------------------
// Adversarial data

// clang-format off
const uint32_t kSpecialF32[] = {
    0x7fc00000u, 0xffc00000u, 0x7fa00001u /* sNaN */, 0xff812345u /* -sNaN */, 0x7fc0beefu,
    0x7f800000u, 0xff800000u, 0x7f7fffffu, 0xff7fffffu, 0x7e967699u /* 1e38 */,
    0x00000001u, 0x80000001u, 0x007fffffu, 0x00400000u, 0x00800000u, 0x00000000u, 0x80000000u,
    0x477fefffu, 0x477ff000u /* fp16 overflow edge */, 0x3f808000u, 0x3f818000u /* bf16 ties */,
    0x33000000u, 0x33000001u, 0x387fc000u /* fp16 subnormal edges */, 0x3f800000u, 0xbf800000u};
// clang-format on

// A value of about 2^[lo_exp, hi_exp), random sign, or (with `specials`) 1 time in 16 a special
// value.
float Adversarial(std::mt19937& rng, int lo_exp, int hi_exp, bool nonneg = false,
                  bool specials = true) {
  if (specials && rng() % 16 == 0) {
    const float s = std::bit_cast<float>(kSpecialF32[rng() % std::size(kSpecialF32)]);
    return nonneg && !std::isnan(s) ? std::abs(s) : s;
  }
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> exp(lo_exp, hi_exp - 1);
  const float x = std::ldexp(mant(rng), exp(rng));
  return nonneg || rng() % 2 ? x : -x;
}

// A gradient of dtype t: n elements as raw bytes (fp32, or 16-bit patterns where, with
// `specials`, 1 in 16 is a random bit pattern: every NaN payload, Inf, subnormal).
std::vector<uint8_t> MakeGrad(DType t, size_t n, std::mt19937& rng, int lo_exp, int hi_exp,
                              bool specials = true) {
  std::vector<uint8_t> bytes(n * DTypeSize(t));
  for (size_t i = 0; i < n; ++i) {
    const float x = Adversarial(rng, lo_exp, hi_exp, false, specials);
    if (t == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &x, 4);
    } else {
      uint16_t h = specials && rng() % 16 == 0 ? static_cast<uint16_t>(rng())
                   : t == DType::kBF16         ? FloatToBf16(x).bits
                                               : FloatToHalf(x).bits;
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

// Mismatches between a and b where equal means same bits, or both NaN. Describes the first.
template <class T>
size_t Mismatches(const T* want, const T* got, size_t n, std::string* first) {
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool both_nan =
        std::isnan(static_cast<double>(want[i])) && std::isnan(static_cast<double>(got[i]));
    if (both_nan || std::memcmp(&want[i], &got[i], sizeof(T)) == 0) continue;
    if (bad++ == 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "[%zu] want %a got %a", i, static_cast<double>(want[i]),
                    static_cast<double>(got[i]));
      *first = buf;
    }
  }
  return bad;
}
// 16-bit outputs: same bits, or both NaN of the format.
size_t Mismatches16(DType t, const uint16_t* want, const uint16_t* got, size_t n,
                    std::string* first) {
  auto is_nan = [t](uint16_t h) {
    return t == DType::kBF16 ? (h & 0x7fffu) > 0x7f80u : (h & 0x7fffu) > 0x7c00u;
  };
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    if (want[i] == got[i] || (is_nan(want[i]) && is_nan(got[i]))) continue;
    if (bad++ == 0) {
      char buf[80];
      std::snprintf(buf, sizeof buf, "[%zu] want 0x%04x got 0x%04x", i, unsigned{want[i]},
                    unsigned{got[i]});
      *first = buf;
    }
  }
  return bad;
}

#define EXPECT_SAME(want, got, n, what)                                                     \
  do {                                                                                      \
    std::string first_;                                                                     \
    const size_t bad_ = Mismatches((want), (got), (n), &first_);                            \
    EXPECT_EQ(bad_, 0u) << (what) << ": " << bad_ << " of " << (n) << "; first " << first_; \
  } while (0)

// ----------------------------------------------------------------------------------------------
// Adam cases and the host reference

struct AdamCase {
  AdamCase(size_t n, DType grad_t, std::optional<DType> out_t, uint32_t seed)
      : p(n), m(n), v(n), out(n, 0xdeadu), grad_t(grad_t), out_t(out_t) {
    std::mt19937 rng(seed);
    for (size_t i = 0; i < n; ++i) {
      p[i] = Adversarial(rng, -30, 8);
      m[i] = Adversarial(rng, -60, 4);
      v[i] = Adversarial(rng, -140, 8, /*nonneg=*/true);
    }
    grad = MakeGrad(grad_t, n, rng, -50, 24);
  }
  AdamShard View(void* grad_ptr = nullptr) {
    return {p.data(),
            m.data(),
            v.data(),
            grad_ptr ? grad_ptr : grad.data(),
            grad_t,
            out_t ? out.data() : nullptr,
            out_t.value_or(DType::kBF16),
            p.size()};
  }
  std::vector<float> p, m, v;
  std::vector<uint8_t> grad;
  std::vector<uint16_t> out;
  DType grad_t;
  std::optional<DType> out_t;
};

std::vector<AdamHyper> Hypers() {
  std::vector<AdamHyper> hs(5);
  hs[0].weight_decay = 0.01f;            // AdamW, step 1
  hs[1].decoupled_weight_decay = false;  // Adam + L2, loss-scale-like grad_scale
  hs[1].weight_decay = 0.1f;
  hs[1].step = 7;
  hs[1].grad_scale = 1.0f / 3.0f;
  hs[2].bias_correction = false;  // no decay, big grad_scale
  hs[2].grad_scale = 65536.0f;
  hs[2].lr = 0.37f;
  hs[3].beta2 = 0.95f;  // late step, bc -> 1
  hs[3].eps = 1e-6f;
  hs[3].step = 1000000;
  hs[3].weight_decay = 0.2f;
  hs[4].lr = 0.0f;  // step_size 0: 0 * Inf makes NaN
  hs[4].beta1 = 0.0f;
  hs[4].step = 3;
  return hs;
}

// The step as the CUDA kernel computes it, on the host (adam_math.h).
void ReferenceAdam(const AdamHyper& h, const AdamShard& s) {
  const simd::AdamArgs a = simd::FoldAdamArgs(h, s);
  for (size_t i = 0; i < s.n; ++i) {
    const float g = a.grad_elem == simd::kElemF32    ? cm::LoadElem<simd::kElemF32>(s.grad, i)
                    : a.grad_elem == simd::kElemBF16 ? cm::LoadElem<simd::kElemBF16>(s.grad, i)
                                                     : cm::LoadElem<simd::kElemF16>(s.grad, i);
    float p = s.master[i], m = s.exp_avg[i], v = s.exp_avg_sq[i];
    if (a.l2) {
      adam_math::AdamElement<true>(a, g, p, m, v);
    } else {
      adam_math::AdamElement<false>(a, g, p, m, v);
    }
    s.master[i] = p;
    s.exp_avg[i] = m;
    s.exp_avg_sq[i] = v;
    auto* out = static_cast<uint16_t*>(s.param_out);
    if (a.out_elem == simd::kElemBF16) out[i] = cm::Narrow<simd::kElemBF16>(p);
    if (a.out_elem == simd::kElemF16) out[i] = cm::Narrow<simd::kElemF16>(p);
  }
}

void ExpectSameState(const AdamCase& want, const AdamCase& got, const std::string& what) {
  const size_t n = want.p.size();
  EXPECT_SAME(want.p.data(), got.p.data(), n, what + " master");
  EXPECT_SAME(want.m.data(), got.m.data(), n, what + " exp_avg");
  EXPECT_SAME(want.v.data(), got.v.data(), n, what + " exp_avg_sq");
  std::string first;
  const DType ot = want.out_t.value_or(DType::kBF16);
  const size_t bad = Mismatches16(ot, want.out.data(), got.out.data(), n, &first);
  EXPECT_EQ(bad, 0u) << what << " param_out: " << bad << " of " << n << "; first " << first;
}

std::string CaseName(size_t n, DType gt, std::optional<DType> ot, size_t hyper) {
  return "n=" + std::to_string(n) + " grad=" + std::string(DTypeName(gt)) +
         " out=" + (ot ? std::string(DTypeName(*ot)) : "none") + " hyper#" + std::to_string(hyper);
}

std::optional<int64_t> TargetNamed(const std::string& name) {
  for (int64_t t : SupportedKernelTargets()) {
    if (KernelTargetName(t) == name) return t;
  }
  return std::nullopt;
}

struct ForcedTarget {
  explicit ForcedTarget(int64_t t) { ForceTargetForTest(t); }
  ~ForcedTarget() { ForceTargetForTest(0); }
};

// ----------------------------------------------------------------------------------------------
// Chunk sums: the host reference

double ReferenceChunk(const void* g, DType t, size_t begin, size_t count) {
  double lanes[cm::kChunkLanes];
  for (int j = 0; j < cm::kChunkLanes; ++j) {
    lanes[j] = t == DType::kF32    ? cm::ChunkLaneSum<simd::kElemF32>(g, begin, count, j)
               : t == DType::kBF16 ? cm::ChunkLaneSum<simd::kElemBF16>(g, begin, count, j)
                                   : cm::ChunkLaneSum<simd::kElemF16>(g, begin, count, j);
  }
  return cm::CombineChunkLanes(lanes);
}

std::vector<double> ReferenceChunks(const void* g, DType t, size_t n) {
  std::vector<double> out;
  for (size_t c = 0; c < n; c += kStatsChunk) {
    out.push_back(ReferenceChunk(g, t, c, std::min(kStatsChunk, n - c)));
  }
  return out;
}

// The CPU kernel's chunk sums on the target dispatch uses now.
std::vector<double> CpuChunks(const void* g, DType t, size_t n) {
  const int elem = t == DType::kF32    ? simd::kElemF32
                   : t == DType::kBF16 ? simd::kElemBF16
                                       : simd::kElemF16;
  std::vector<double> out;
  for (size_t c = 0; c < n; c += kStatsChunk) {
    out.push_back(simd::SumSquares(g, elem, c, std::min(kStatsChunk, n - c)));
  }
  return out;
}

// Gradients for the chunk sums. kNarrow: magnitudes near 1, where the summation order shows in
// the last bits; kWide: from subnormal to near FLT_MAX; both without NaN/Inf so that the sums
// compare as numbers. kNonFinite: kWide with the specials (NaN, Inf) left in.
enum StatsData { kNarrow, kWide, kNonFinite };
const StatsData kStatsData[] = {kNarrow, kWide, kNonFinite};

std::vector<uint8_t> StatsGrad(DType t, size_t n, uint32_t seed, StatsData data) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> g =
      data == kNarrow ? MakeGrad(t, n, rng, -3, 3, false) : MakeGrad(t, n, rng, -149, 127);
  if (data != kNonFinite) {
    for (size_t i = 0; i < n; ++i) {
      if (t == DType::kF32) {
        float x;
        std::memcpy(&x, g.data() + 4 * i, 4);
        if (!std::isfinite(x)) x = 1.5f;
        std::memcpy(g.data() + 4 * i, &x, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, g.data() + 2 * i, 2);
        const uint16_t exp_mask = t == DType::kBF16 ? 0x7f80u : 0x7c00u;
        if ((h & exp_mask) == exp_mask) h = 0x3c00u;
        std::memcpy(g.data() + 2 * i, &h, 2);
      }
    }
  }
  return g;
}

// ----------------------------------------------------------------------------------------------
// ReferenceTest: no GPU needed.

TEST(ReferenceTest, AdamElementMatchesCpuOnEveryTarget) {
  const std::vector<int64_t> targets = SupportedKernelTargets();
  const std::vector<AdamHyper> hypers = Hypers();
  for (int64_t target : targets) {
    ForcedTarget forced(target);
    for (size_t n : kSizes) {
      for (DType gt : kGradTypes) {
        for (std::optional<DType> ot : kOutTypes) {
          for (size_t hi = 0; hi < hypers.size(); ++hi) {
            const std::string what = KernelTargetName(target) + " " + CaseName(n, gt, ot, hi);
            AdamCase cpu(n, gt, ot, static_cast<uint32_t>(n * 31 + hi));
            AdamCase ref = cpu;
            ASSERT_TRUE(AdamStep(hypers[hi], cpu.View()).ok());
            ReferenceAdam(hypers[hi], ref.View());
            ExpectSameState(cpu, ref, what);
          }
        }
      }
    }
  }
}

TEST(ReferenceTest, ChunkSumsMatchCpuAvx2) {
  const std::optional<int64_t> avx2 = TargetNamed("AVX2");
  if (!avx2) GTEST_SKIP() << "this CPU has no AVX2 target";
  ForcedTarget forced(*avx2);
  for (DType t : kGradTypes) {
    for (size_t n : {size_t{1}, size_t{15}, size_t{17}, size_t{4095}, size_t{4096}, size_t{4097},
                     3 * kStatsChunk + 100}) {
      for (StatsData data : kStatsData) {
        const bool finite = data != kNonFinite;
        const auto g = StatsGrad(t, n, static_cast<uint32_t>(n), data);
        const auto want = CpuChunks(g.data(), t, n);
        const auto got = ReferenceChunks(g.data(), t, n);
        ASSERT_EQ(want.size(), got.size());
        EXPECT_SAME(want.data(), got.data(), want.size(),
                    std::string(DTypeName(t)) + " n=" + std::to_string(n) + " data#" +
                        std::to_string(data));
        // Merged as ComputeGradStats merges: the same bits.
        ExactSum acc;
        for (double s : got) acc.Add(s);
        const GradStats cpu = ComputeGradStats(g.data(), t, n).value();
        EXPECT_EQ(std::bit_cast<uint64_t>(cpu.sum_sq), std::bit_cast<uint64_t>(acc.Value()));
        EXPECT_EQ(cpu.nonfinite, acc.nonfinite());
        if (finite) {
          EXPECT_FALSE(acc.nonfinite());
        }
      }
    }
  }
}

// Arguments are checked on the host before any CUDA call, so this runs without a GPU too.
TEST(ReferenceTest, InvalidArgumentsRefusedBeforeAnyCudaCall) {
  float f = 0;
  uint16_t h = 0;
  double d = 0;
  bool b = false;
  AdamHyper hyper;
  AdamShard shard{&f, &f, &f, &f, DType::kF32, nullptr, DType::kBF16, 1};
  hyper.beta1 = 1.0f;
  EXPECT_TRUE(CudaAdamStep(hyper, shard, nullptr).IsInvalidArgument());
  hyper = AdamHyper{};
  shard.grad_dtype = DType::kI8;
  EXPECT_TRUE(CudaAdamStep(hyper, shard, nullptr).IsInvalidArgument());
  shard.grad_dtype = DType::kF32;
  shard.param_out = &h;
  shard.param_out_dtype = DType::kF32;
  EXPECT_TRUE(CudaAdamStep(hyper, shard, nullptr).IsInvalidArgument());
  shard = AdamShard{};
  EXPECT_TRUE(CudaAdamStep(hyper, shard, nullptr).ok());  // n == 0: nothing to do

  EXPECT_TRUE(CudaAccumulateGrad(&f, &f, DType::kI8, 1.0f, false, 1, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaAccumulateGrad(&f, &f, DType::kF32, NAN, false, 1, nullptr).IsInvalidArgument());
  EXPECT_TRUE(
      CudaAccumulateGrad(&f, &f, DType::kF32, INFINITY, true, 1, nullptr).IsInvalidArgument());
  EXPECT_TRUE(
      CudaAccumulateGrad(nullptr, &f, DType::kF32, 1.0f, false, 1, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaAccumulateGrad(nullptr, nullptr, DType::kF32, 1.0f, false, 0, nullptr).ok());

  EXPECT_TRUE(CudaChunkSumSquares(&f, DType::kI8, 1, &d, &b, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaChunkSumSquares(&f, DType::kF32, 1, nullptr, &b, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaChunkSumSquares(nullptr, DType::kF32, 1, &d, &b, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaChunkSumSquares(&f, DType::kF32, 1, &d, nullptr, nullptr).IsInvalidArgument());

  EXPECT_TRUE(CudaCast(&f, DType::kBF16, &h, DType::kF16, 1, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaCast(&f, DType::kI8, &f, DType::kF32, 1, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaCast(nullptr, DType::kF32, &h, DType::kBF16, 1, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaCast(nullptr, DType::kF32, nullptr, DType::kBF16, 0, nullptr).ok());
}

// ----------------------------------------------------------------------------------------------
// Block INT8 quantization (quantize.h): adversarial data for one dtype, as raw bytes.

std::vector<uint8_t> QuantInput(DType t, size_t n, size_t block, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes = MakeGrad(t, n, rng, -30, 17, /*specials=*/false);
  // A few blocks hold specials (NaN, Inf, subnormals, FLT_MAX): most stay finite.
  for (size_t b = 0; b * block < n; b += 3) {
    const size_t i = b * block + rng() % std::min(block, n - b * block);
    const float x = std::bit_cast<float>(kSpecialF32[rng() % std::size(kSpecialF32)]);
    if (t == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &x, 4);
    } else {
      const uint16_t h = t == DType::kBF16 ? FloatToBf16(x).bits : FloatToHalf(x).bits;
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

const size_t kQuantBlocks[] = {1, 7, 256, 1000, kQuantBlock};

TEST(ReferenceTest, QuantizeElementCodeMatchesCpuReference) {
  for (DType t : kGradTypes) {
    for (size_t block : kQuantBlocks) {
      const size_t n = 3 * block + 5;
      const std::vector<uint8_t> in = QuantInput(t, n, block, static_cast<uint32_t>(block));
      std::vector<int8_t> want_q(n), got_q(n);
      std::vector<float> want_s(QuantBlocks(n, block)), got_s(want_s.size());
      QuantizeInt8Reference(t, in.data(), n, block, want_q.data(), want_s.data());
      for (size_t b = 0; b < got_s.size(); ++b) {  // the kernel's steps, on the host
        const size_t begin = b * block, end = std::min(n, begin + block);
        uint32_t amax = 0;
        for (size_t i = begin; i < end; ++i) {
          const float x = t == DType::kF32    ? cm::LoadElem<simd::kElemF32>(in.data(), i)
                          : t == DType::kBF16 ? cm::LoadElem<simd::kElemBF16>(in.data(), i)
                                              : cm::LoadElem<simd::kElemF16>(in.data(), i);
          amax = std::max(amax, quantize_math::AbsBits(x));
        }
        got_s[b] = Int8BlockScale(amax);
        for (size_t i = begin; i < end; ++i) {
          const float x = t == DType::kF32    ? cm::LoadElem<simd::kElemF32>(in.data(), i)
                          : t == DType::kBF16 ? cm::LoadElem<simd::kElemBF16>(in.data(), i)
                                              : cm::LoadElem<simd::kElemF16>(in.data(), i);
          got_q[i] = quantize_math::QuantizeElement(x, got_s[b]);
        }
      }
      ASSERT_EQ(want_q, got_q) << DTypeName(t) << " block " << block;
      ASSERT_EQ(std::memcmp(want_s.data(), got_s.data(), 4 * got_s.size()), 0);
      std::vector<float> want_d(n), got_d(n);
      DequantizeInt8Reference(want_q.data(), want_s.data(), n, block, DType::kF32, want_d.data());
      for (size_t i = 0; i < n; ++i) {
        got_d[i] = quantize_math::DequantizeElement(want_q[i], want_s[i / block]);
      }
      ASSERT_EQ(std::memcmp(want_d.data(), got_d.data(), 4 * n), 0);
      // The accumulating form, over an accumulator that holds NaNs of its own too (where the
      // block is finite: with two NaN operands the CPU's choice follows the compiler's operand
      // order).
      std::vector<float> want_a(n), got_a(n);
      for (size_t i = 0; i < n; ++i) {
        const bool nan = i % 11 == 0 && !std::isnan(want_s[i / block]);
        want_a[i] = nan ? std::bit_cast<float>(0x7fc00123u) : static_cast<float>(i) * 0.25f;
        got_a[i] = want_a[i];
      }
      ASSERT_TRUE(DequantizeAddInt8(want_q.data(), want_s.data(), n, block, want_a.data()).ok());
      for (size_t i = 0; i < n; ++i) {
        got_a[i] = quantize_math::AccumulateElement(got_a[i], got_d[i]);
      }
      ASSERT_EQ(std::memcmp(want_a.data(), got_a.data(), 4 * n), 0)
          << DTypeName(t) << " block " << block;
    }
  }
}

TEST(ReferenceTest, QuantizeInvalidArgumentsRefusedBeforeAnyCudaCall) {
  float f = 0, s = 0;
  int8_t q = 0;
  EXPECT_TRUE(CudaQuantizeInt8(DType::kI8, &f, 1, 1, &q, &s, nullptr, nullptr).IsInvalidArgument());
  EXPECT_TRUE(
      CudaQuantizeInt8(DType::kF32, &f, 1, 0, &q, &s, nullptr, nullptr).IsInvalidArgument());
  EXPECT_TRUE(
      CudaQuantizeInt8(DType::kF32, nullptr, 1, 1, &q, &s, nullptr, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaDequantizeInt8(&q, &s, 1, 1, DType::kI8, &f, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaDequantizeInt8(&q, nullptr, 1, 1, DType::kF32, &f, nullptr).IsInvalidArgument());
  EXPECT_TRUE(CudaDequantizeAddInt8(&q, &s, 1, 0, &f, nullptr).IsInvalidArgument());
}

TEST(ReferenceTest, WithoutDeviceCallsAreUnavailable) {
  if (CudaKernelsAvailable()) GTEST_SKIP() << "a GPU is present: CudaKernelsTest covers it";
  // Valid arguments; the launch fails before any pointer is touched.
  float f = 0;
  EXPECT_TRUE(CudaAccumulateGrad(&f, &f, DType::kF32, 1.0f, false, 1, nullptr).IsUnavailable());
  AdamShard shard{&f, &f, &f, &f, DType::kF32, nullptr, DType::kBF16, 1};
  EXPECT_TRUE(CudaAdamStep(AdamHyper{}, shard, nullptr).IsUnavailable());
  int8_t q = 0;
  EXPECT_TRUE(CudaQuantizeInt8(DType::kF32, &f, 1, 1, &q, &f, nullptr, nullptr).IsUnavailable());
  EXPECT_TRUE(CudaDequantizeAddInt8(&q, &f, 1, 1, &f, nullptr).IsUnavailable());
}

// ----------------------------------------------------------------------------------------------
// CudaKernelsTest: the kernels on a GPU.

// Runs the kernels on a non-blocking stream; device memory is owned by the fixture (Release, or
// TearDown, frees it).
class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (!CudaKernelsAvailable()) {
      GTEST_SKIP() << "no GPU: cudaGetDeviceCount: "
                   << (err == cudaSuccess ? std::to_string(count) + " devices"
                                          : std::string(cudaGetErrorName(err)) + " (" +
                                                cudaGetErrorString(err) + ")");
    }
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    for (void* p : allocs_) cudaFree(p);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void* Alloc(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 1)), cudaSuccess);
    allocs_.push_back(p);
    return p;
  }
  // A device copy of v, complete before anything later on stream_ (a plain cudaMemcpy from
  // pageable memory may still be in flight on the legacy stream, which stream_ does not wait for).
  template <class T>
  T* Up(const std::vector<T>& v) {
    auto* d = static_cast<T*>(Alloc(v.size() * sizeof(T)));
    EXPECT_EQ(cudaMemcpyAsync(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return d;
  }
  // Waits for the stream, then copies n elements back into v.
  template <class T>
  void Down(const T* d, std::vector<T>& v) {
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(v.data(), d, v.size() * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  void Release() {
    for (void* p : allocs_) cudaFree(p);
    allocs_.clear();
  }

  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocs_;
};

TEST_F(CudaKernelsTest, AdamMatchesReferenceAndEveryCpuTarget) {
  const std::vector<AdamHyper> hypers = Hypers();
  const std::vector<int64_t> targets = SupportedKernelTargets();
  std::vector<size_t> sizes(std::begin(kSizes), std::end(kSizes));
  sizes.insert(sizes.end(), std::begin(kLargeSizes), std::end(kLargeSizes));
  for (size_t n : sizes) {
    for (DType gt : kGradTypes) {
      for (std::optional<DType> ot : kOutTypes) {
        for (size_t hi = 0; hi < hypers.size(); ++hi) {
          if (n > 100000 && hi > 1) continue;  // the large size on two hyper sets is enough
          const std::string what = CaseName(n, gt, ot, hi);
          AdamCase gpu(n, gt, ot, static_cast<uint32_t>(n * 31 + hi));
          AdamCase ref = gpu;
          float* p = Up(gpu.p);
          float* m = Up(gpu.m);
          float* v = Up(gpu.v);
          uint8_t* g = Up(gpu.grad);
          uint16_t* out = Up(gpu.out);
          AdamShard shard{p, m, v, g, gt, ot ? out : nullptr, ot.value_or(DType::kBF16), n};
          ASSERT_TRUE(CudaAdamStep(hypers[hi], shard, stream_).ok()) << what;
          Down(p, gpu.p);
          Down(m, gpu.m);
          Down(v, gpu.v);
          Down(out, gpu.out);  // untouched (0xdead) without param_out
          Release();
          ReferenceAdam(hypers[hi], ref.View());
          ExpectSameState(ref, gpu, "reference vs gpu " + what);
          for (int64_t target : targets) {
            ForcedTarget forced(target);
            AdamCase cpu(n, gt, ot, static_cast<uint32_t>(n * 31 + hi));
            ASSERT_TRUE(AdamStep(hypers[hi], cpu.View()).ok());
            ExpectSameState(cpu, gpu, KernelTargetName(target) + " vs gpu " + what);
          }
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST_F(CudaKernelsTest, AccumulateIsMulThenAdd) {
  for (size_t n : kSizes) {
    for (DType gt : kGradTypes) {
      for (float scale : {1.0f, 0.1f, -3.0f, 65536.0f, 1e-30f, 0.0f}) {
        for (bool overwrite : {false, true}) {
          std::mt19937 rng(static_cast<uint32_t>(n + 7));
          const auto grad = MakeGrad(gt, n, rng, -60, 30);
          std::vector<float> acc(n);
          for (float& a : acc)
            a = overwrite ? std::bit_cast<float>(0x7fbadbadu)  // never read
                          : Adversarial(rng, -60, 30);
          std::vector<float> want = acc, got = acc;
          for (size_t i = 0; i < n; ++i) {
            const float g = gt == DType::kF32    ? cm::LoadElem<simd::kElemF32>(grad.data(), i)
                            : gt == DType::kBF16 ? cm::LoadElem<simd::kElemBF16>(grad.data(), i)
                                                 : cm::LoadElem<simd::kElemF16>(grad.data(), i);
            want[i] = overwrite ? g * scale : acc[i] + g * scale;  // -ffp-contract=off
          }
          float* d_acc = Up(acc);
          ASSERT_TRUE(CudaAccumulateGrad(d_acc, Up(grad), gt, scale, overwrite, n, stream_).ok());
          Down(d_acc, got);
          Release();
          EXPECT_SAME(want.data(), got.data(), n,
                      "n=" + std::to_string(n) + " " + std::string(DTypeName(gt)) +
                          " scale=" + std::to_string(scale) + (overwrite ? " overwrite" : ""));
          std::vector<float> cpu = acc;  // the CPU kernel (every target: kernels_casts_test)
          ASSERT_TRUE(AccumulateGrad(cpu.data(), grad.data(), gt, scale, overwrite, n).ok());
          EXPECT_SAME(cpu.data(), got.data(), n,
                      "cpu vs gpu n=" + std::to_string(n) + " " + std::string(DTypeName(gt)));
        }
      }
    }
  }
  // A -0 product stays -0 when overwriting (not 0 + -0 = +0).
  const std::vector<float> neg_zero = {-0.0f};
  std::vector<float> got = {1.0f};
  float* d_acc = Up(got);
  ASSERT_TRUE(CudaAccumulateGrad(d_acc, Up(neg_zero), DType::kF32, 1.0f, true, 1, stream_).ok());
  Down(d_acc, got);
  EXPECT_EQ(std::bit_cast<uint32_t>(got[0]), 0x80000000u);
}

TEST_F(CudaKernelsTest, ChunkSumsMatchReferenceAndCpu) {
  const std::optional<int64_t> avx2 = TargetNamed("AVX2");
  for (DType t : kGradTypes) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{4095},
                     size_t{4096}, size_t{4097}, 40 * kStatsChunk + 3, (size_t{1} << 22) + 1}) {
      for (StatsData data : kStatsData) {
        const bool finite = data != kNonFinite;
        const std::string what =
            std::string(DTypeName(t)) + " n=" + std::to_string(n) + " data#" + std::to_string(data);
        const auto g = StatsGrad(t, n, static_cast<uint32_t>(n + 1), data);
        const size_t chunks = (n + kStatsChunk - 1) / kStatsChunk;
        std::vector<double> got(chunks, -1.0);
        std::vector<uint8_t> flag = {0x55};  // garbage: must be overwritten
        auto* d_sums = static_cast<double*>(Alloc(chunks * sizeof(double)));
        uint8_t* d_flag = Up(flag);
        ASSERT_TRUE(
            CudaChunkSumSquares(Up(g), t, n, d_sums, reinterpret_cast<bool*>(d_flag), stream_).ok())
            << what;
        Down(d_sums, got);
        Down(d_flag, flag);
        Release();
        const auto want = ReferenceChunks(g.data(), t, n);
        EXPECT_SAME(want.data(), got.data(), chunks, "reference vs gpu " + what);
        ExactSum acc;
        for (double s : got) acc.Add(s);
        EXPECT_EQ(flag[0], acc.nonfinite() ? 1 : 0) << what;
        if (finite) {
          EXPECT_FALSE(acc.nonfinite()) << what;
        }
        if (avx2) {  // bit for bit with the AVX2 target, chunk by chunk and merged
          ForcedTarget forced(*avx2);
          const auto cpu = CpuChunks(g.data(), t, n);
          EXPECT_SAME(cpu.data(), got.data(), chunks, "AVX2 vs gpu " + what);
          const GradStats stats = ComputeGradStats(g.data(), t, n).value();
          EXPECT_EQ(std::bit_cast<uint64_t>(stats.sum_sq), std::bit_cast<uint64_t>(acc.Value()))
              << what;
        }
        // The best target (AVX-512 may sum in another order): within the stated bound.
        const auto best = CpuChunks(g.data(), t, n);
        for (size_t c = 0; c < chunks; ++c) {
          if (!std::isfinite(best[c])) {
            EXPECT_FALSE(std::isfinite(got[c])) << what << " chunk " << c;
            continue;
          }
          EXPECT_NEAR(got[c], best[c], 2 * 4095 * 0x1p-53 * best[c]) << what << " chunk " << c;
        }
      }
    }
  }
}

TEST_F(CudaKernelsTest, CastsMatchCpuBitForBit) {
  // Widening: every 16-bit pattern.
  std::vector<uint16_t> all16(65536);
  for (size_t i = 0; i < all16.size(); ++i) all16[i] = static_cast<uint16_t>(i);
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<float> want(all16.size()), got(all16.size());
    ASSERT_TRUE(Cast(all16.data(), t, want.data(), DType::kF32, all16.size()).ok());
    float* d_out = static_cast<float*>(Alloc(got.size() * 4));
    ASSERT_TRUE(CudaCast(Up(all16), t, d_out, DType::kF32, all16.size(), stream_).ok());
    Down(d_out, got);
    Release();
    EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * 4), 0) << DTypeName(t);
  }
  // Narrowing: specials, random bit patterns (every class), ties, at many sizes.
  for (size_t n : {size_t{1}, size_t{255}, size_t{257}, size_t{1} << 20}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::vector<float> in(n);
    for (size_t i = 0; i < n; ++i) {
      in[i] = i < std::size(kSpecialF32) ? std::bit_cast<float>(kSpecialF32[i])
              : i % 3 == 0               ? std::bit_cast<float>(static_cast<uint32_t>(rng()))
              : i % 3 == 1 ? std::bit_cast<float>(static_cast<uint32_t>(rng()) & 0xffff8000u)
                           : Adversarial(rng, -30, 17);
    }
    const float* d_in = Up(in);
    for (DType t : {DType::kBF16, DType::kF16}) {
      std::vector<uint16_t> want(n), got(n);
      ASSERT_TRUE(Cast(in.data(), DType::kF32, want.data(), t, n).ok());
      auto* d_out = static_cast<uint16_t*>(Alloc(n * 2));
      ASSERT_TRUE(CudaCast(d_in, DType::kF32, d_out, t, n, stream_).ok());
      Down(d_out, got);
      EXPECT_EQ(std::memcmp(want.data(), got.data(), n * 2), 0) << DTypeName(t) << " n=" << n;
    }
    // Same dtype: a copy.
    std::vector<float> copy(n);
    auto* d_copy = static_cast<float*>(Alloc(n * 4));
    ASSERT_TRUE(CudaCast(d_in, DType::kF32, d_copy, DType::kF32, n, stream_).ok());
    Down(d_copy, copy);
    EXPECT_EQ(std::memcmp(in.data(), copy.data(), n * 4), 0) << "copy n=" << n;
    Release();
  }
}

TEST_F(CudaKernelsTest, EmptyChunkSumClearsTheFlag) {
  std::vector<uint8_t> flag = {1};
  uint8_t* d_flag = Up(flag);
  ASSERT_TRUE(CudaChunkSumSquares(nullptr, DType::kF32, 0, nullptr, reinterpret_cast<bool*>(d_flag),
                                  stream_)
                  .ok());
  Down(d_flag, flag);
  EXPECT_EQ(flag[0], 0);
}

TEST_F(CudaKernelsTest, QuantizeMatchesCpuBitForBit) {
  for (DType t : kGradTypes) {
    for (size_t block : kQuantBlocks) {
      for (size_t n : {size_t{0}, size_t{1}, block - 1 + (block == 1), block + 1, 5 * block + 3,
                       (size_t{1} << 20) + 5}) {
        const std::vector<uint8_t> in = QuantInput(t, n, block, static_cast<uint32_t>(n + block));
        const size_t nb = QuantBlocks(n, block);
        std::vector<int8_t> want_q(n), got_q(n);
        std::vector<float> want_s(nb), got_s(nb);
        Result<size_t> want_nf = QuantizeInt8(t, in.data(), n, block, want_q.data(), want_s.data());
        ASSERT_TRUE(want_nf.ok());
        auto* d_q = static_cast<int8_t*>(Alloc(n));
        auto* d_s = static_cast<float*>(Alloc(4 * nb));
        std::vector<uint64_t> nf = {12345};
        uint64_t* d_nf = Up(nf);
        ASSERT_TRUE(CudaQuantizeInt8(t, Up(in), n, block, d_q, d_s, d_nf, stream_).ok());
        Down(d_q, got_q);
        Down(d_s, got_s);
        Down(d_nf, nf);
        const std::string where = std::string(DTypeName(t)) + " block " + std::to_string(block) +
                                  " n " + std::to_string(n);
        EXPECT_EQ(nf[0], *want_nf) << where;
        ASSERT_EQ(want_q, got_q) << where;
        ASSERT_TRUE(nb == 0 || std::memcmp(want_s.data(), got_s.data(), 4 * nb) == 0) << where;
        for (DType out : kGradTypes) {
          std::vector<uint8_t> want(n * DTypeSize(out)), got(want.size());
          ASSERT_TRUE(
              DequantizeInt8(want_q.data(), want_s.data(), n, block, out, want.data()).ok());
          void* d_out = Alloc(got.size());
          ASSERT_TRUE(CudaDequantizeInt8(d_q, d_s, n, block, out, d_out, stream_).ok());
          Down(static_cast<uint8_t*>(d_out), got);
          EXPECT_EQ(want, got) << where << " -> " << DTypeName(out);
        }
        std::vector<float> acc(n), got_acc(n);
        for (size_t i = 0; i < n; ++i) acc[i] = static_cast<float>(i % 97) * 0.37f;
        float* d_acc = Up(acc);
        ASSERT_TRUE(DequantizeAddInt8(want_q.data(), want_s.data(), n, block, acc.data()).ok());
        ASSERT_TRUE(CudaDequantizeAddInt8(d_q, d_s, n, block, d_acc, stream_).ok());
        Down(d_acc, got_acc);
        EXPECT_TRUE(n == 0 || std::memcmp(acc.data(), got_acc.data(), 4 * n) == 0)
            << where << " add";
        Release();
      }
    }
  }
}

}  // namespace
}  // namespace strata::kernels
