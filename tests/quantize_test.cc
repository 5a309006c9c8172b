// Block INT8 quantization (kernels/quantize.h): the documented error bound per block for every
// source dtype, block size and output dtype; adversarial blocks (ties, outliers, zeros, -0,
// subnormals, Inf, NaN, partial blocks, n = 0); the SIMD kernels against the scalar reference bit
// for bit on every compiled target; the pooled calls against the plain ones.
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "kernels/pool.h"
#include "kernels/quantize.h"
#include "kernels_test_util.h"
#include "strata/dtype.h"

namespace strata::kernels {
namespace {

constexpr DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// Values of one dtype, kept as raw storage plus their exact fp32 values.
struct Input {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> bits;  // bf16/fp16 storage
  std::vector<float> value;    // what each element represents

  explicit Input(DType t) : dtype(t) {}
  void Push(float x) {
    uint16_t b = 0;
    float v = 0;
    StoreAs(dtype, x, &b, &v);
    f32.push_back(x);
    bits.push_back(b);
    value.push_back(v);
  }
  const void* data() const {
    return dtype == DType::kF32 ? static_cast<const void*>(f32.data()) : bits.data();
  }
  size_t size() const { return value.size(); }
};

// Blocks of random values, each block with its own magnitude (log-uniform), within the dtype's
// range; some blocks hold subnormals of the dtype.
Input RandomInput(DType t, size_t n, size_t block, uint32_t seed) {
  std::mt19937 rng(seed);
  const int lo = t == DType::kF16 ? -26 : -140, hi = t == DType::kF16 ? 15 : 100;
  std::uniform_int_distribution<int> exp(lo, hi);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Input in(t);
  float mag = 1;
  for (size_t i = 0; i < n; ++i) {
    if (i % block == 0) mag = std::ldexp(1.0f, exp(rng));
    in.Push(u(rng) * mag);
  }
  return in;
}

// The bound of quantize.h for an element of a finite block, in double.
double Bound(double scale, double amax, DType out) {
  double b = scale / 2 + std::ldexp(amax, -22) + std::ldexp(1.0, -142);
  if (out == DType::kBF16) b += std::ldexp(amax, -8) + std::ldexp(1.0, -133);
  if (out == DType::kF16) b += std::ldexp(amax, -10) + std::ldexp(1.0, -25);
  return b;
}

float ReadOut(DType t, const std::vector<uint32_t>& raw, size_t i) {
  if (t == DType::kF32) return std::bit_cast<float>(raw[i]);
  const uint16_t b = static_cast<uint16_t>(raw[i]);
  return t == DType::kBF16 ? Bf16ToFloat(bf16_t{b}) : HalfToFloat(f16_t{b});
}

// Dequantizes into a dst of dtype `t`, returned widened as 32-bit words (one per element).
std::vector<uint32_t> Dequant(const std::vector<int8_t>& q, const std::vector<float>& scales,
                              size_t block, DType t) {
  std::vector<uint32_t> out(q.size());
  if (t == DType::kF32) {
    EXPECT_TRUE(DequantizeInt8(q.data(), scales.data(), q.size(), block, t, out.data()).ok());
  } else {
    std::vector<uint16_t> o(q.size());
    EXPECT_TRUE(DequantizeInt8(q.data(), scales.data(), q.size(), block, t, o.data()).ok());
    for (size_t i = 0; i < o.size(); ++i) out[i] = o[i];
  }
  return out;
}

struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> scales;
  size_t nonfinite = 0;
};

Quantized Quantize(const Input& in, size_t block) {
  Quantized r;
  r.q.assign(in.size(), 99);
  r.scales.assign(QuantBlocks(in.size(), block), -1.0f);
  Result<size_t> n =
      QuantizeInt8(in.dtype, in.data(), in.size(), block, r.q.data(), r.scales.data());
  EXPECT_TRUE(n.ok()) << n.status().ToString();
  r.nonfinite = n.ok() ? *n : 0;
  return r;
}

// Checks every element of `in` against the bound for each output dtype, and the scales' formula.
void CheckBound(const Input& in, size_t block, const Quantized& r) {
  for (size_t b = 0; b < r.scales.size(); ++b) {
    double amax = 0;
    for (size_t i = b * block; i < std::min(in.size(), (b + 1) * block); ++i) {
      amax = std::max(amax, std::fabs(static_cast<double>(in.value[i])));
    }
    float want = static_cast<float>(amax) / 127.0f;
    if (std::isinf(want * 127.0f)) want = std::nextafter(want, 0.0f);  // amax near FLT_MAX
    ASSERT_EQ(std::bit_cast<uint32_t>(r.scales[b]), std::bit_cast<uint32_t>(want)) << "block " << b;
  }
  for (DType out : kDTypes) {
    const std::vector<uint32_t> deq = Dequant(r.q, r.scales, block, out);
    for (size_t i = 0; i < in.size(); ++i) {
      const size_t b = i / block;
      double amax = static_cast<double>(r.scales[b]) * 127;  // within 2^-24 relative
      amax *= 1 + std::ldexp(1.0, -23);
      uint16_t b16 = 0;
      float rounded = 0;
      StoreAs(out, in.value[i], &b16, &rounded);
      if (std::isinf(rounded) || std::isinf(ReadOut(out, deq, i))) {
        // Beyond the 16-bit dtype's range (an fp32 source): the output is the dtype's rounding
        // of the fp32 dequantized value, Inf only where that value is out of range too.
        const float d32 = static_cast<float>(r.q[i]) * r.scales[b];
        uint16_t w = 0;
        float want = 0;
        StoreAs(out, d32, &w, &want);
        ASSERT_EQ(ReadOut(out, deq, i), want) << i;
        continue;
      }
      const double err = std::fabs(static_cast<double>(in.value[i]) - ReadOut(out, deq, i));
      ASSERT_LE(err, Bound(r.scales[b], amax, out))
          << DTypeName(in.dtype) << " -> " << DTypeName(out) << " block " << block << " i " << i
          << " x " << in.value[i] << " q " << int{r.q[i]} << " scale " << r.scales[b];
      ASSERT_GE(r.q[i], -127);
    }
  }
}

TEST(QuantizeTest, ErrorBoundRandomEveryDTypeAndBlockSize) {
  for (DType t : kDTypes) {
    for (size_t block : {size_t{1}, size_t{7}, size_t{64}, size_t{1000}, kQuantBlock}) {
      const Input in = RandomInput(t, 3 * block + block / 2 + 5, block, 17 + block);
      const Quantized r = Quantize(in, block);
      EXPECT_EQ(r.nonfinite, 0u);
      CheckBound(in, block, r);
    }
  }
}

TEST(QuantizeTest, AdversarialFiniteBlocks) {
  const float sub = std::numeric_limits<float>::denorm_min();
  for (DType t : kDTypes) {
    // The largest finite value and a huge outlier of the dtype.
    const float max = t == DType::kF32    ? std::numeric_limits<float>::max()
                      : t == DType::kBF16 ? Bf16ToFloat(bf16_t{0x7f7f})
                                          : 65504.0f;
    const float huge = t == DType::kF16 ? 60000.0f : 1e30f;
    const std::vector<std::vector<float>> blocks = {
        {3.0f, 3.0f, 3.0f, 3.0f},                          // all equal: exactly +-127
        {-3.0f, -3.0f, -3.0f, -3.0f},                      //
        {127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 126.5f},  // scale 1: ties go to even
        {huge, 1e-3f, -1e-3f, 2e-3f, 1e-30f},              // one huge outlier among tiny values
        {0.0f, 0.0f, 0.0f},                                // zeros: scale 0
        {-0.0f, -0.0f, 0.0f},                              // -0: +0 out
        {sub, -sub, 3 * sub, 0.0f},                        // amax/127 underflows: scale 0
        {1e-39f, -2e-39f, 5e-40f},                         // subnormal scale
        {max, -1.0f, -max},                                // the dtype's extremes
        {6.0e-8f, -3.0e-8f, 6.1e-5f},                      // fp16 subnormals
    };
    Input in(t);
    const size_t block = 8;
    for (const auto& b : blocks) {
      for (size_t i = 0; i < block; ++i) in.Push(i < b.size() ? b[i] : 0.0f);
    }
    in.Push(5.0f);  // a partial last block of 3
    in.Push(-1.0f);
    in.Push(0.25f);
    const Quantized r = Quantize(in, block);
    EXPECT_EQ(r.nonfinite, 0u) << DTypeName(t);
    CheckBound(in, block, r);
    EXPECT_EQ(r.q[0], 127);  // all equal
    EXPECT_EQ(r.q[block], -127);
    if (t == DType::kF32) {  // the scale-1 block (ties) and the fp32-only underflow
      EXPECT_EQ(r.scales[2], 1.0f);
      const int8_t want[] = {127, 0, 2, 2, 0, -2, 126};
      for (int i = 0; i < 7; ++i) EXPECT_EQ(r.q[2 * block + i], want[i]) << i;
      EXPECT_EQ(r.scales[6], 0.0f);  // underflow
      for (size_t i = 0; i < block; ++i) EXPECT_EQ(r.q[6 * block + i], 0);
    }
    for (size_t i = 0; i < block; ++i) EXPECT_EQ(r.q[4 * block + i], 0);  // zeros
    EXPECT_EQ(r.scales[5], 0.0f);
    const std::vector<uint32_t> deq = Dequant(r.q, r.scales, block, DType::kF32);
    EXPECT_EQ(deq[5 * block], 0u) << "-0 dequantizes to +0";
  }
}

TEST(QuantizeTest, NonFiniteBlockIsNaNNeverZero) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType t : kDTypes) {
    Input in(t);
    const size_t block = 4;
    for (float x : {1.0f, inf, 2.0f, 3.0f}) in.Push(x);   // block 0: +Inf
    for (float x : {1.0f, 2.0f, 3.0f, 4.0f}) in.Push(x);  // block 1: finite
    for (float x : {-inf, 0.0f, 0.0f, 0.0f}) in.Push(x);  // block 2: -Inf
    for (float x : {0.5f, 0.5f, nan, 0.5f}) in.Push(x);   // block 3: NaN
    in.Push(nan);                                         // block 4 (partial): NaN alone
    const Quantized r = Quantize(in, block);
    EXPECT_EQ(r.nonfinite, 4u) << DTypeName(t);
    for (size_t b : {0, 2, 3, 4}) {
      EXPECT_EQ(std::bit_cast<uint32_t>(r.scales[b]), 0x7fc00000u) << b;
    }
    EXPECT_EQ(r.scales[1], 4.0f / 127.0f);
    for (DType out : kDTypes) {
      const std::vector<uint32_t> deq = Dequant(r.q, r.scales, block, out);
      for (size_t i = 0; i < in.size(); ++i) {
        EXPECT_EQ(std::isnan(ReadOut(out, deq, i)), i / block != 1) << DTypeName(out) << " " << i;
      }
    }
    std::vector<float> acc(in.size(), 1.0f);
    ASSERT_TRUE(DequantizeAddInt8(r.q.data(), r.scales.data(), in.size(), block, acc.data()).ok());
    for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(std::isnan(acc[i]), i / block != 1) << i;
  }
}

TEST(QuantizeTest, EmptyAndInvalidArguments) {
  int8_t q = 0;
  float s = 0;
  float x = 1;
  EXPECT_EQ(*QuantizeInt8(DType::kF32, nullptr, 0, kQuantBlock, nullptr, nullptr), 0u);
  EXPECT_TRUE(DequantizeInt8(nullptr, nullptr, 0, kQuantBlock, DType::kBF16, nullptr).ok());
  EXPECT_TRUE(DequantizeAddInt8(nullptr, nullptr, 0, kQuantBlock, nullptr).ok());
  EXPECT_EQ(QuantizeInt8(DType::kI8, &x, 1, 1, &q, &s).status().code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(QuantizeInt8(DType::kF32, &x, 1, 0, &q, &s).status().code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(QuantizeInt8(DType::kF32, nullptr, 1, 1, &q, &s).status().code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(DequantizeInt8(&q, &s, 1, 1, DType::kI8, &x).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(DequantizeAddInt8(&q, nullptr, 1, 1, &x).code(), Status::Code::kInvalidArgument);
}

TEST(QuantizeTest, WireLayout) {
  constexpr Int8Wire w = Int8WireLayout(10, 4);
  static_assert(w.payload_bytes == 10 && w.scales_offset == 12 && w.scale_count == 3 &&
                w.total_bytes == 24);
  EXPECT_EQ(Int8WireLayout(0, kQuantBlock).total_bytes, 0u);
  EXPECT_EQ(Int8WireLayout(2 * kQuantBlock, kQuantBlock).total_bytes, 2 * kQuantBlock + 8);
}

// The SIMD kernels against the scalar reference, bit for bit, on every compiled target.
class QuantizeTargetTest : public TargetTest {};

TEST_P(QuantizeTargetTest, SimdMatchesReferenceBitForBit) {
  const size_t lanes = simd::LanesF32();
  for (DType t : kDTypes) {
    for (size_t block : {size_t{1}, size_t{3}, 2 * lanes + 1, size_t{256}, kQuantBlock}) {
      for (size_t n : Sizes()) {
        Input in = RandomInput(t, n, block, static_cast<uint32_t>(n * 31 + block));
        if (n > 5) {  // ties, a non-finite block, zeros
          in.Push(std::numeric_limits<float>::quiet_NaN());
          in.Push(0.0f);
        }
        const Quantized r = Quantize(in, block);
        std::vector<int8_t> q_ref(in.size());
        std::vector<float> s_ref(r.scales.size());
        const size_t nf =
            QuantizeInt8Reference(t, in.data(), in.size(), block, q_ref.data(), s_ref.data());
        ASSERT_EQ(r.nonfinite, nf);
        ASSERT_EQ(0, std::memcmp(r.q.data(), q_ref.data(), q_ref.size()))
            << DTypeName(t) << " n " << in.size() << " block " << block;
        ASSERT_EQ(0, std::memcmp(r.scales.data(), s_ref.data(), 4 * s_ref.size()));
        for (DType out : kDTypes) {
          const std::vector<uint32_t> got = Dequant(r.q, r.scales, block, out);
          std::vector<uint32_t> want(in.size());
          std::vector<uint16_t> want16(in.size());
          DequantizeInt8Reference(
              r.q.data(), r.scales.data(), in.size(), block, out,
              out == DType::kF32 ? static_cast<void*>(want.data()) : want16.data());
          if (out != DType::kF32) {
            for (size_t i = 0; i < in.size(); ++i) want[i] = want16[i];
          }
          ASSERT_EQ(got, want) << DTypeName(out) << " n " << in.size() << " block " << block;
        }
        std::vector<float> acc(in.size()), acc_ref(in.size());
        for (size_t i = 0; i < acc.size(); ++i) acc[i] = acc_ref[i] = in.value[i] * 0.75f;
        ASSERT_TRUE(
            DequantizeAddInt8(r.q.data(), r.scales.data(), in.size(), block, acc.data()).ok());
        DequantizeAddInt8Reference(r.q.data(), r.scales.data(), in.size(), block, acc_ref.data());
        ASSERT_EQ(0, std::memcmp(acc.data(), acc_ref.data(), 4 * acc.size()));
      }
    }
  }
}

TEST_P(QuantizeTargetTest, PooledMatchesPlain) {
  PoolOptions opt;
  opt.threads = 3;
  opt.tile_elems = 1024;
  auto pool = KernelPool::Create(opt);
  ASSERT_TRUE(pool.ok());
  for (size_t block : {size_t{1000}, kQuantBlock}) {
    Input in = RandomInput(DType::kBF16, 5 * 4096 + 77, block, 5);
    in.value[9000] = std::numeric_limits<float>::infinity();  // one non-finite block
    in.bits[9000] = FloatToBf16(in.value[9000]).bits;
    const Quantized r = Quantize(in, block);
    EXPECT_EQ(r.nonfinite, 1u);
    std::vector<int8_t> q(in.size());
    std::vector<float> s(r.scales.size());
    Result<size_t> nf =
        QuantizeInt8(**pool, in.dtype, in.data(), in.size(), block, q.data(), s.data());
    ASSERT_TRUE(nf.ok());
    EXPECT_EQ(*nf, 1u);
    EXPECT_EQ(q, r.q);
    EXPECT_EQ(0, std::memcmp(s.data(), r.scales.data(), 4 * s.size()));
    std::vector<uint16_t> out(in.size()), out_ref(in.size());
    ASSERT_TRUE(
        DequantizeInt8(**pool, q.data(), s.data(), q.size(), block, DType::kF16, out.data()).ok());
    DequantizeInt8Reference(q.data(), s.data(), q.size(), block, DType::kF16, out_ref.data());
    EXPECT_EQ(out, out_ref);
    std::vector<float> acc(in.size(), 0.5f), acc_ref(in.size(), 0.5f);
    ASSERT_TRUE(DequantizeAddInt8(**pool, q.data(), s.data(), q.size(), block, acc.data()).ok());
    DequantizeAddInt8Reference(q.data(), s.data(), q.size(), block, acc_ref.data());
    EXPECT_EQ(0, std::memcmp(acc.data(), acc_ref.data(), 4 * acc.size()));
  }
}

STRATA_INSTANTIATE_FOR_TARGETS(QuantizeTargetTest);

}  // namespace
}  // namespace strata::kernels
