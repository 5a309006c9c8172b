// Fused Adam / AdamW optimizer step over one shard, in place, on the CPU (SIMD, dynamic dispatch
// to the best Highway target of the running machine).
//
// One pass per element reads the fp32 master weight p, the fp32 moments m and v and the gradient
// (fp32, bf16 or fp16), and writes p, m, v and optionally the new parameter as bf16 or fp16
// (rounded to nearest even, NaN kept), so no separate unscale, clip, decay or cast pass exists.
// The result is torch.optim.AdamW's / torch.optim.Adam's (single-tensor, non-amsgrad,
// maximize=False, fp32 CPU tensors: what they run for CPU parameters) bit for bit: the same
// operations in the same order with the same fp32 roundings, the hyper-parameters folded from
// doubles as torch's Python floats are. kernels/adam_math.h lists them; in short, with t = `step`
// (1 on the first call):
//
//   g  = grad * grad_scale                       (grad_scale = 1/loss_scale * clip coefficient,
//                                                 one fp32 multiply as clip_grad_norm_'s)
//   Adam (L2):      g  = g + weight_decay * p    (one FMA)
//   AdamW:          p  = p * (1 - lr * weight_decay)
//   m  = lerp(m, g, 1 - beta1)                   (ATen's lerp: one FMA)
//   v  = v * beta2 + ((1 - beta2) * g) * g       (one FMA)
//   bc1 = 1 - beta1^t,  bc2 = 1 - beta2^t         (both 1 when bias_correction is off)
//   p  = p + (-(lr / bc1) * m) / (sqrt(v) / sqrt(bc2) + eps)
//   param_out = round_to_nearest_even(p)          (when asked)
//
// One exception: torch's CPU sqrt is MKL's vsSqrt (VML_HA) where torch is built with MKL (x86
// wheels), within an ulp of the IEEE square root this uses, so torch's own result on such a build
// differs in the last bit of some denominators. With an IEEE sqrt (builds without MKL, or torch's
// step run with a correctly rounded sqrt) the results are equal bit for bit.
// A NaN or Inf in the gradient propagates into p, m and v exactly as in PyTorch: check
// GradStats (grad_stats.h) first and skip the step on overflow.
//
// Determinism: an element's result depends only on its own inputs and the hyper-parameters, never
// on the thread count, the tile size or its position in the shard (the vector tail runs the same
// code), nor on the SIMD target: targets without FMA run the element code with std::fma.
//
// Thread safety: calls on disjoint shards may run concurrently; a shard must not be touched by
// anyone else during a call. The step allocates nothing (the pooled one reuses oneTBB's recycled
// task objects).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "strata/device_kernels.h"
#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::kernels {

class KernelPool;

// AdamHyper and AdamShard: include/strata/device_kernels.h (public: a device's kernels take
// them too).

// Bytes one parameter moves through memory: 24 (p, m, v read and written) + gradient + output.
size_t AdamBytesPerParam(DType grad_dtype, std::optional<DType> param_out_dtype);

// Checks hyper-parameters and shard: InvalidArgument names the offending field (null array with
// n > 0, grad dtype not fp32/bf16/fp16, param_out dtype not bf16/fp16, step < 1, beta outside
// [0, 1), eps <= 0, lr or weight_decay negative or non-finite, grad_scale non-finite).
Status ValidateAdam(const AdamHyper& hyper, const AdamShard& shard);

// Runs the step on the calling thread. Errors: as ValidateAdam; on error nothing is written.
Status AdamStep(const AdamHyper& hyper, const AdamShard& shard);

// Runs the step over the pool's tiles. Same results, bit for bit, as AdamStep.
Status AdamStep(KernelPool& pool, const AdamHyper& hyper, const AdamShard& shard);

// Where AdamStepSaving copies the shard's values from before the step: shard.n fp32 values each
// of master, exp_avg and exp_avg_sq, and shard.n working params of param_elem_bytes each from
// `param_from` (the param block the step writes; fp32 params included, which AdamStep does not
// write itself).
struct AdamSave {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* param_from = nullptr;
  void* param_to = nullptr;
  size_t param_elem_bytes = 0;
};

// AdamStep over the pool's tiles that first copies each piece of the state into `save` while
// the piece is in the cache (the speculative step's rollback copies): the same bits as copying
// the whole shard and then AdamStep, with one read of the old state instead of two. Errors: as
// ValidateAdam, or a null `save` array; on error nothing is written.
Status AdamStepSaving(KernelPool& pool, const AdamHyper& hyper, const AdamShard& shard,
                      const AdamSave& save);

}  // namespace strata::kernels
