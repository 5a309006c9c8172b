// Maps a public DType to the kernels' element code (kernels/simd.h), for the dispatching .cc files.
#pragma once

#include "kernels/simd.h"
#include "strata/dtype.h"

namespace strata::kernels {

// The simd::Elem of `t`, or -1 for a dtype the kernels do not take (callers turn it into an
// InvalidArgument naming the dtype).
inline int ElemOf(DType t) {
  switch (t) {
    case DType::kF32:
      return simd::kElemF32;
    case DType::kBF16:
      return simd::kElemBF16;
    case DType::kF16:
      return simd::kElemF16;
    default:
      return -1;
  }
}

}  // namespace strata::kernels
