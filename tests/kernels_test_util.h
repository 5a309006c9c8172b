// Shared fixtures for the kernel tests: every TEST_P runs once per compiled Highway target that
// this CPU supports (forcing dispatch to it), as Highway's own TestWithParamTarget does.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/simd.h"
#include "kernels/targets.h"
#include "strata/dtype.h"

namespace strata::kernels {

class TargetTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    ForceTargetForTest(GetParam());
    ASSERT_EQ(ActiveKernelTarget(), GetParam()) << "dispatch did not switch target";
    // The code that runs is really that target's: its fp32 vector width says so.
    const std::string name = KernelTargetName(GetParam());
    size_t want = 0;  // 0: a target this check does not know
    if (name == "AVX3" || name == "AVX3_DL") want = 16;
    if (name == "AVX2") want = 8;
    if (name == "SSE4" || name == "SSSE3") want = 4;
    if (name == "SCALAR") want = 1;
    if (want != 0) {
      EXPECT_EQ(simd::LanesF32(), want) << name;
    }
  }
  void TearDown() override { ForceTargetForTest(0); }

  // Sizes around the vector width N (the kernels process 2N per iteration) plus large ones.
  static std::vector<size_t> Sizes() {
    const size_t n = simd::LanesF32();
    return {0,    1,    n - 1 == 0 ? 2 : n - 1, n, n + 1, 2 * n - 1, 2 * n, 2 * n + 1, 3 * n + 1,
            1000, 70001};
  }
};

// Stores `x` as an element of dtype `t`: for bf16/fp16 its bits (rounded to nearest even) go to
// *bits and the value they represent to *value; for fp32 *value = x and *bits is left alone.
inline void StoreAs(DType t, float x, uint16_t* bits, float* value) {
  if (t == DType::kBF16) {
    *bits = FloatToBf16(x).bits;
    *value = Bf16ToFloat(bf16_t{*bits});
  } else if (t == DType::kF16) {
    *bits = FloatToHalf(x).bits;
    *value = HalfToFloat(f16_t{*bits});
  } else {
    *value = x;
  }
}

inline std::string TargetParamName(const ::testing::TestParamInfo<int64_t>& info) {
  return KernelTargetName(info.param);
}

#define STRATA_INSTANTIATE_FOR_TARGETS(suite)                                                \
  INSTANTIATE_TEST_SUITE_P(Targets, suite,                                                   \
                           ::testing::ValuesIn(::strata::kernels::SupportedKernelTargets()), \
                           ::strata::kernels::TargetParamName)

}  // namespace strata::kernels
