// Collective volume per rank: plain ZeRO stages and ZeRO++ at stage 3 (the scheme and the
// intra/inter-node rule are in include/strata/planner.h, at ZeroPlusPlus).
#include <algorithm>
#include <string>
#include <vector>

#include "core/plan/comm_model.h"
#include "strata/planner.h"

namespace strata {
namespace {

// Per-rank bytes of a ring collective of `bytes` per rank over rings that cross node
// boundaries (or not): a fraction 1/L of them inter-node when `crosses`.
CommBytes Ring(double bytes, bool crosses, int ranks_per_node) {
  CommBytes c;
  c.inter_node = crosses ? bytes / ranks_per_node : 0;
  c.intra_node = bytes - c.inter_node;
  return c;
}

double Frac(int64_t m) { return m > 1 ? double(m - 1) / double(m) : 0.0; }

CommBytes Sum(const CommBytes& a, const CommBytes& b) {
  return CommBytes{a.intra_node + b.intra_node, a.inter_node + b.inter_node};
}

}  // namespace

Stage3Comm ZeroPlusPlusComm(const ZeroPlusPlus& zpp, double params, double param_bytes,
                            double grad_bytes, int gpus_per_node, int nodes) {
  const int64_t n = int64_t{gpus_per_node} * nodes;
  const int l = gpus_per_node;
  const bool multi_node = nodes > 1;
  const double int8_bytes = 1 + 4 / zpp.block;  // INT8 + one fp32 scale per block
  const double gather_bytes = zpp.quantized_weights ? int8_bytes : param_bytes;
  Stage3Comm c;
  c.param_gather_forward = Ring(Frac(n) * gather_bytes * params, multi_node, l);
  const int64_t k = zpp.hpz_partition_size;
  if (k > 1) {
    // Within consecutive groups of k ranks: inside a node when k <= L, else k / L whole nodes.
    c.param_gather_backward = Ring(Frac(k) * param_bytes * params, k > l, l);
    c.hpz_secondary_bytes_per_gpu = param_bytes * params / static_cast<double>(k);
  } else {
    c.param_gather_backward = c.param_gather_forward;
  }
  if (zpp.quantized_gradients) {
    const int64_t across = n / l;  // ranks with the same local index: one per node
    c.grad_reduce_scatter.intra_node = Frac(l) * params * int8_bytes;
    c.grad_reduce_scatter.inter_node = Frac(across) * (params / l) * int8_bytes;
  } else {
    c.grad_reduce_scatter = Ring(Frac(n) * grad_bytes * params, multi_node, l);
  }
  c.total = Sum(Sum(c.param_gather_forward, c.param_gather_backward), c.grad_reduce_scatter);
  return c;
}

namespace plan {

CommVolume StageComm(const PlanInput& in, int stage) {
  const Recipe& r = in.recipe;
  const Capacity& cap = in.capacity;
  const double psi = in.params;
  // Frozen parameters take no gradient and no step: only the trainable ones are reduced (by DDP
  // too) and, below stage 3, all-gathered after the step; stage 3 gathers every parameter.
  const double t = in.trainable_params > 0 ? std::min(in.trainable_params, psi) : psi;
  const double c = Frac(cap.Ranks());
  const bool multi_node = cap.nodes > 1;
  CommVolume v;
  v.ddp_bytes_per_rank = c * 2 * r.grad_bytes * t;  // all-reduce = reduce-scatter + all-gather
  v.ddp_inter_node_bytes_per_rank =
      Ring(v.ddp_bytes_per_rank, multi_node, cap.gpus_per_node).inter_node;
  switch (stage) {
    case 0:  // all-reduce grads
      v.split = Ring(c * 2 * r.grad_bytes * t, multi_node, cap.gpus_per_node);
      break;
    case 1:  // reduce-scatter grads, all-gather the updated params
    case 2:
      v.split = Ring(c * (r.grad_bytes + r.param_bytes) * t, multi_node, cap.gpus_per_node);
      break;
    default: {
      const ZeroPlusPlus& zpp = in.zero.zero_plus_plus;
      const Stage3Comm all =
          ZeroPlusPlusComm(zpp, psi, r.param_bytes, r.grad_bytes, cap.gpus_per_node, cap.nodes);
      const Stage3Comm trained =
          ZeroPlusPlusComm(zpp, t, r.param_bytes, r.grad_bytes, cap.gpus_per_node, cap.nodes);
      v.split = Sum(Sum(all.param_gather_forward, all.param_gather_backward),
                    trained.grad_reduce_scatter);
      v.zero_plus_plus = zpp.Any();
    }
  }
  v.bytes_per_rank = v.split.Total();
  // The coefficient, defined for N = 1 too: the same model with (N-1)/N taken as 1.
  PlanInput two = in;
  if (cap.Ranks() == 1) {
    // One rank moves nothing; report the ratio a data-parallel run of this setting would have:
    // the coefficients of the formulas (every term of a ring scales with the same (N-1)/N).
    two.capacity.gpus_per_node = 2;
    two.capacity.nodes = 1;
    two.zero.zero_plus_plus.hpz_partition_size = 1;
    const CommVolume w = StageComm(two, stage);
    v.ratio = w.ratio;
  } else {
    v.ratio = v.ddp_bytes_per_rank > 0 ? v.bytes_per_rank / v.ddp_bytes_per_rank : 0;
  }
  return v;
}

Status ValidateZeroPlusPlus(const ZeroPlusPlus& zpp, const Capacity& capacity) {
  const int64_t k = zpp.hpz_partition_size;
  const int64_t n = capacity.Ranks();
  const int64_t l = capacity.gpus_per_node;
  const std::string path = "zero_optimization.zero_hpz_partition_size";
  if (k < 0) return Status::InvalidArgument(path + " must be >= 0, got " + std::to_string(k));
  if (k > 1) {
    if (n % k != 0) {
      return Status::InvalidArgument(path + " = " + std::to_string(k) +
                                     " must divide the world size " + std::to_string(n));
    }
    if (l % k != 0 && k % l != 0) {
      return Status::InvalidArgument(
          path + " = " + std::to_string(k) + " must divide gpus_per_node = " + std::to_string(l) +
          " or be a multiple of it: an hpZ group lies within a node or spans whole nodes");
    }
  }
  if (!(zpp.block > 0)) {
    return Status::InvalidArgument("ZeRO++ quantization block must be > 0");
  }
  return Status::OK();
}

void NoteZeroPlusPlus(const PlanInput& in, int stage, std::vector<std::string>* notes) {
  const ZeroPlusPlus& zpp = in.zero.zero_plus_plus;
  if (stage == 3 || !zpp.Any() || !in.has_configured || in.zero.stage != stage) return;
  notes->push_back(
      "ZeRO++ (zero_quantized_weights / zero_quantized_gradients / zero_hpz_partition_size) acts "
      "at stage 3 only: not in this stage-" +
      std::to_string(stage) + " row (the engine refuses the keys below stage 3)");
}

}  // namespace plan
}  // namespace strata
