// Helpers shared by the collective-communication tests (Gloo over loopback, NCCL on GPUs).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "strata/dtype.h"

namespace strata::testing {

// `v` as a buffer of `dt` elements (fp32 as is; bf16 and fp16 with the scalar RNE conversions).
inline std::vector<uint8_t> Encode(DType dt, const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * DTypeSize(dt));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else if (dt == DType::kBF16) {
      const bf16_t b = FloatToBf16(v[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      const f16_t h = FloatToHalf(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

}  // namespace strata::testing
