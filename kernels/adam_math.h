// One element of the fused Adam step, written once for every side as kernels/quantize_math.h is:
// nvcc compiles it into the CUDA kernel (cuda_kernels.cu), the SIMD targets without a fused
// multiply-add run it per element (adam_simd.cc), and the tests compile it for the host. The
// SIMD targets with FMA run the same operations on vectors (adam_simd.cc's Update).
//
// The operations and roundings are torch.optim.Adam's single-tensor step on CPU fp32 tensors
// (what torch.optim.Adam / AdamW run for CPU parameters), each ATen kernel's fp32 arithmetic:
//
//   g = g * grad_scale                         (as torch's clip_grad_norm_: an fp32 multiply)
//   Adam (L2):  g = g.add(p, alpha=wd)         fma(p, wd, g)
//   AdamW:      p.mul_(1 - lr * wd)            p * decay
//   m.lerp_(g, 1 - beta1)                      |w| < 0.5: fma(w, g - m, m)
//                                              else:      fma(w - 1, g - m, g)
//   v.mul_(beta2).addcmul_(g, g, 1 - beta2)    fma((1 - beta2) * g, g, v * beta2)
//   denom = (v.sqrt() / bc2_sqrt).add_(eps)    sqrt(v) / bc2_sqrt + eps
//   p.addcdiv_(m, denom, value=-step_size)     p + (-step_size * m) / denom
//
// The scalars are torch's: Python doubles folded in double and rounded to fp32 once
// (simd::FoldAdamArgs). Each primitive is one IEEE operation, round to nearest even (cuda_math.h);
// a host file that includes this builds with -ffp-contract=off.
//
// Thread safety: pure functions.
#pragma once

#include "kernels/cuda_math.h"
#include "kernels/simd.h"

namespace strata::kernels::adam_math {

// ATen's vectorized lerp(start, end, weight) for a weight w folded as lerp_coeff (w, or w - 1
// when |w| >= 0.5) and lerp_from_end (|w| >= 0.5).
STRATA_HD float Lerp(const simd::AdamArgs& a, float start, float end) {
  const float diff = cuda_math::Sub(end, start);
  return cuda_math::Fma(a.lerp_coeff, diff, a.lerp_from_end ? end : start);
}

template <bool kL2>
STRATA_HD void AdamElement(const simd::AdamArgs& a, float g, float& p, float& m, float& v) {
  g = cuda_math::Mul(g, a.grad_scale);
  if constexpr (kL2) g = cuda_math::Fma(p, a.l2_weight_decay, g);
  p = cuda_math::Mul(p, a.decay);
  m = Lerp(a, m, g);
  v = cuda_math::Fma(cuda_math::Mul(a.one_minus_beta2, g), g, cuda_math::Mul(v, a.beta2));
  const float denom =
      cuda_math::Add(cuda_math::Div(cuda_math::Sqrt(v), a.bc2_sqrt), a.eps);
  p = cuda_math::Add(p, cuda_math::Div(cuda_math::Mul(a.neg_step_size, m), denom));
}

}  // namespace strata::kernels::adam_math
