#include "kernels/adam.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "kernels/elem.h"
#include "kernels/pool.h"
#include "kernels/simd.h"

namespace strata::kernels {

namespace {

// torch's scalars: Python doubles, folded in double, each rounded to fp32 where an ATen kernel
// takes it (Scalar::to<float>).
float F32(double x) { return static_cast<float>(x); }

// m.lerp_(g, 1 - beta1): ATen picks the form by the fp32 weight's size.
void FoldLerp(double beta1, simd::AdamArgs& a) {
  const float w = F32(1.0 - beta1);
  a.lerp_from_end = !(std::abs(w) < 0.5f);
  a.lerp_coeff = a.lerp_from_end ? w - 1.0f : w;
}

// torch's bias corrections: Python's float ** is C's pow, step a float.
void FoldBiasCorrection(const AdamHyper& h, simd::AdamArgs& a) {
  const double t = static_cast<double>(h.step);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
  a.neg_step_size = F32(-(h.lr / bc1));
  a.bc2_sqrt = F32(std::pow(bc2, 0.5));
}

void FoldWeightDecay(const AdamHyper& h, simd::AdamArgs& a) {
  a.l2 = !h.decoupled_weight_decay && h.weight_decay != 0.0;
  a.l2_weight_decay = F32(h.weight_decay);
  a.decay = h.decoupled_weight_decay && h.weight_decay != 0.0 ? F32(1.0 - h.lr * h.weight_decay)
                                                               : 1.0f;
}

}  // namespace

// The CUDA step (cuda_kernels.cu) folds through here too, so both run on the same coefficients.
simd::AdamArgs simd::FoldAdamArgs(const AdamHyper& h, const AdamShard& s) {
  simd::AdamArgs a;
  a.master = s.master;
  a.exp_avg = s.exp_avg;
  a.exp_avg_sq = s.exp_avg_sq;
  a.grad = s.grad;
  a.grad_elem = ElemOf(s.grad_dtype);
  a.param_out = s.param_out;
  a.out_elem = s.param_out == nullptr ? simd::kElemNone : ElemOf(s.param_out_dtype);
  a.stream_state = h.stream_state;
  FoldLerp(h.beta1, a);
  a.beta2 = F32(h.beta2);
  a.one_minus_beta2 = F32(1.0 - h.beta2);
  a.eps = F32(h.eps);
  FoldBiasCorrection(h, a);
  FoldWeightDecay(h, a);
  a.grad_scale = h.grad_scale;
  return a;
}

namespace {

Status Bad(const std::string& what) { return Status::InvalidArgument("adam step: " + what); }

}  // namespace

size_t AdamBytesPerParam(DType grad_dtype, std::optional<DType> param_out_dtype) {
  return 24 + DTypeSize(grad_dtype) + (param_out_dtype ? DTypeSize(*param_out_dtype) : 0);
}

Status ValidateAdam(const AdamHyper& h, const AdamShard& s) {
  if (!std::isfinite(h.lr) || h.lr < 0) return Bad("lr must be finite and >= 0");
  if (!(h.beta1 >= 0 && h.beta1 < 1)) return Bad("beta1 must be in [0, 1)");
  if (!(h.beta2 >= 0 && h.beta2 < 1)) return Bad("beta2 must be in [0, 1)");
  if (!(h.eps > 0) || !std::isfinite(h.eps)) return Bad("eps must be finite and > 0");
  if (!std::isfinite(h.weight_decay) || h.weight_decay < 0) {
    return Bad("weight_decay must be finite and >= 0");
  }
  if (h.step < 1) return Bad("step must be >= 1 (got " + std::to_string(h.step) + ")");
  if (!std::isfinite(h.grad_scale)) return Bad("grad_scale must be finite");
  if (ElemOf(s.grad_dtype) < 0) {
    return Bad("grad dtype must be fp32, bf16 or fp16, not " +
               std::string(DTypeName(s.grad_dtype)));
  }
  if (s.param_out != nullptr && s.param_out_dtype != DType::kBF16 &&
      s.param_out_dtype != DType::kF16) {
    return Bad("param_out dtype must be bf16 or fp16, not " +
               std::string(DTypeName(s.param_out_dtype)));
  }
  if (s.n > 0 && (s.master == nullptr || s.exp_avg == nullptr || s.exp_avg_sq == nullptr ||
                  s.grad == nullptr)) {
    return Bad("master, exp_avg, exp_avg_sq and grad must be non-null when n > 0");
  }
  return Status::OK();
}

Status AdamStep(const AdamHyper& hyper, const AdamShard& shard) {
  STRATA_RETURN_IF_ERROR(ValidateAdam(hyper, shard));
  if (shard.n == 0) return Status::OK();
  simd::AdamRange(simd::FoldAdamArgs(hyper, shard), 0, shard.n);
  return Status::OK();
}

Status AdamStep(KernelPool& pool, const AdamHyper& hyper, const AdamShard& shard) {
  STRATA_RETURN_IF_ERROR(ValidateAdam(hyper, shard));
  const simd::AdamArgs args = simd::FoldAdamArgs(hyper, shard);
  auto body = [&args](int /*slot*/, size_t begin, size_t end) {
    simd::AdamRange(args, begin, end);
  };
  pool.ForEachTile(shard.n, 0, body);
  return Status::OK();
}

Status AdamStepSaving(KernelPool& pool, const AdamHyper& hyper, const AdamShard& shard,
                      const AdamSave& save) {
  STRATA_RETURN_IF_ERROR(ValidateAdam(hyper, shard));
  if (shard.n > 0 &&
      (save.master == nullptr || save.exp_avg == nullptr || save.exp_avg_sq == nullptr ||
       save.param_from == nullptr || save.param_to == nullptr || save.param_elem_bytes == 0)) {
    return Status::InvalidArgument("AdamStepSaving: a save array is null");
  }
  const simd::AdamArgs args = simd::FoldAdamArgs(hyper, shard);
  // Pieces of 16 Ki elements: about 300 KB of state and gradient, within a core's L2.
  constexpr size_t kPiece = size_t{1} << 14;
  const auto* param_from = static_cast<const uint8_t*>(save.param_from);
  auto* param_to = static_cast<uint8_t*>(save.param_to);
  const size_t pb = save.param_elem_bytes;
  auto body = [&](int /*slot*/, size_t begin, size_t end) {
    for (size_t b = begin; b < end; b += kPiece) {
      const size_t e = std::min(end, b + kPiece);
      const size_t bytes = (e - b) * sizeof(float);
      std::memcpy(save.master + b, shard.master + b, bytes);
      std::memcpy(save.exp_avg + b, shard.exp_avg + b, bytes);
      std::memcpy(save.exp_avg_sq + b, shard.exp_avg_sq + b, bytes);
      std::memcpy(param_to + b * pb, param_from + b * pb, (e - b) * pb);
      simd::AdamRange(args, b, e);
    }
  };
  pool.ForEachTile(shard.n, 0, body);
  return Status::OK();
}

}  // namespace strata::kernels
