// The ZeRO memory planner: see include/strata/planner.h for the model. The placement rules
// follow DeepSpeed's behaviour (stage_1_and_2.py, stage3.py, the swappers) where strata does
// the same thing, and docs/design.md where it differs (gradient shards live with the optimizer).
#include "strata/planner.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>

#include "core/plan/comm_model.h"
#include "sched/placement.h"
#include "sched/zero_layout.h"

namespace strata {
namespace {

std::string Fmt(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// Memory rules shared with the engine (sched/placement.h): the gradient shard the optimizer
// consumes is held in fp32 (accumulated there across micro-steps), or in the working 16-bit
// width where it is final as reduced (sched::GradStateDType: one rank, one micro-step, the
// optimizer offloaded), whatever width the recipe reduces it in (recipe.grad_bytes: the bytes on
// the wire, and in the reduce buckets).
double GradStateBytes(const PlanInput& in, const sched::StatePlacement& rules) {
  // A recipe whose gradients are fp32 on the wire (fp32-grads) has no 16-bit gradient to keep.
  const DType working =
      in.recipe.param_bytes == 2 && in.recipe.grad_bytes == 2 ? DType::kBF16 : DType::kF32;
  const DType grad =
      sched::GradStateDType(working, static_cast<int64_t>(in.zero.gradient_accumulation_steps),
                            static_cast<int>(in.capacity.Ranks()), rules);
  return static_cast<double>(sched::StateElementBytes(StateKind::kGrad, working, grad));
}

// The offloaded gradient's item name, with its width.
std::string OffloadedGrads(const PlanInput& in, const sched::StatePlacement& rules) {
  return GradStateBytes(in, rules) == 4 ? "grads (fp32)" : "grads (16-bit, final as reduced)";
}

// Elements of the largest group (the unit the engine gathers and reduces): the caller's figure,
// else DeepSpeed's reduce_bucket_size (its largest reduction unit), never more than the model.
double LargestGroup(const PlanInput& in) {
  const double g =
      in.largest_group_params > 0 ? in.largest_group_params : in.zero.reduce_bucket_size;
  return std::min(g, in.params);
}

// The states of a rank by the engine's layout rule (sched/zero_layout.h) for a model of
// `params` elements in groups of the largest group's size (the last one shorter), with the
// recipe's widths. Exact elements, no alignment: the planner counts what the states hold.
sched::StateLayout PlannedStates(const PlanInput& in, const sched::StatePlacement& rules) {
  const Recipe& r = in.recipe;
  auto elems = [](double v) { return static_cast<uint64_t>(std::min(std::ceil(v), 0x1p60)); };
  const uint64_t psi = elems(in.params), group = std::max<uint64_t>(1, elems(LargestGroup(in)));
  sched::StateLayoutInput li;
  li.world = static_cast<int>(in.capacity.Ranks());
  // Trainable groups first, then the frozen ones (params only), each in groups of `group`.
  const uint64_t trainable = in.trainable_params > 0 ? elems(in.trainable_params) : psi;
  const uint64_t frozen = psi - std::min(psi, trainable);
  const uint64_t train = psi - frozen;
  li.groups = {{group, train / group}, {train % group, 1}, {group, frozen / group, false},
               {frozen % group, 1, false}};
  // sub_group_size 0: one sub-group per tensor, the largest group standing in for the largest
  // tensor (the planner knows no tensors).
  li.sub_group_elems = sched::SubGroupElems(elems(in.zero.sub_group_size), group, 1);
  li.widths = {r.param_bytes, GradStateBytes(in, rules), r.master_bytes, r.momentum_bytes,
               r.variance_bytes};
  return sched::LayOutStates(rules, li);
}

// Elements of the largest optimizer sub-group of a rank: the layout's, whose groups are the
// largest group given or else reduce_bucket_size elements (LargestGroup), each rank's part cut by
// sub_group_size as the engine cuts it (0, not counted, when sub_group_size is 0 and no group is
// given: each tensor a sub-group, and no tensor is known).
double LargestSubGroup(const PlanInput& in, const sched::StateLayout& states, double shard) {
  if (in.largest_group_params <= 0 && in.zero.sub_group_size <= 0) return 0;
  return std::min(static_cast<double>(states.largest_sub), shard);
}

// Host bytes per rank of the optimizer's NVMe swap buffers (the engine's rule).
double OptimizerSwapBuffers(const PlanInput& in, const sched::StatePlacement& rules,
                            const sched::StateLayout& states, double shard) {
  const double sub = LargestSubGroup(in, states, shard);
  if (sub <= 0) return 0;
  // The sub-groups a rank offloads cap the buffers (not known, taken as many, without the
  // group); none offloaded (partial offload at ratio 0): no buffers.
  if (states.sub_groups > 0 && states.device_sub_groups == states.sub_groups) return 0;
  const uint64_t sub_groups =
      in.largest_group_params > 0 ? states.sub_groups - states.device_sub_groups : 0;
  return static_cast<double>(sched::OptimizerSwapBufferBytes(
      static_cast<int64_t>(in.zero.optimizer_buffer_count), static_cast<uint64_t>(sub), sub_groups,
      static_cast<uint64_t>(GradStateBytes(in, rules))));
}

// Host bytes per rank of the param NVMe swap buffers: buffer_count shards of the largest group
// (buffer_size elements when the largest group is not given).
double ParamSwapBuffers(const PlanInput& in, double shard) {
  const double ranks = static_cast<double>(in.capacity.Ranks());
  const double largest = in.largest_group_params > 0 ? std::ceil(in.largest_group_params / ranks)
                                                     : std::min(in.zero.param_buffer_size, shard);
  const DType working = in.recipe.param_bytes >= 4 ? DType::kF32 : DType::kBF16;
  return static_cast<double>(sched::ParamSwapBufferBytes(
      static_cast<int64_t>(in.zero.param_buffer_count), static_cast<uint64_t>(largest), working));
}

struct Builder {
  Placement& p;
  const sched::StatePlacement& rules;
  const sched::StateLayout& states;  // PlannedStates
  void Add(Tier tier, std::string name, double bytes, bool pinned = false) {
    if (bytes <= 0) return;
    p.items.push_back(PlanItem{tier, std::move(name), bytes, pinned});
  }
  // The bytes of the items so far on `tier`, per node.
  double Sum(Tier tier) const {
    double sum = 0;
    for (const PlanItem& it : p.items) sum += it.tier == tier ? it.bytes : 0;
    return sum;
  }
};

// A per-node figure as whole bytes per rank (the engine's unit), for the shared sched/ rules.
uint64_t PerRankBytes(double per_node, double gpus_per_node) {
  return static_cast<uint64_t>(std::min(std::ceil(per_node / gpus_per_node), 0x1p60));
}

void PlaceHbm(const PlanInput& in, int stage, Builder& b) {
  const Recipe& r = in.recipe;
  const ZeroSettings& z = in.zero;
  const double psi = in.params;
  const bool opt_off = b.p.offload_optimizer != OffloadDevice::kNone;
  const bool param_off = b.p.offload_param != OffloadDevice::kNone;
  const bool overlap = z.overlap_comm.value_or(stage == 3);

  // The gradient shards the optimizer consumes are partitioned with the optimizer (a stage-1
  // rank keeps the reduced shard only; full gradients are the working set's buffers below).
  const sched::StateLayout& st = b.states;
  if (!b.rules.params_partitioned) {
    b.Add(Tier::kDevice, "params, full replica", st.param_bytes);
  } else if (!param_off) {
    b.Add(Tier::kDevice, "params, 1/N shard", st.param_bytes);
  }
  if (!b.rules.optimizer_partitioned) {
    b.Add(Tier::kDevice, "grads (fp32), full replica", st.grad_bytes);
    b.Add(Tier::kDevice, "optimizer state (master+m+v), full replica", st.optimizer_bytes);
  } else if (!opt_off) {
    b.Add(Tier::kDevice, "grads (fp32), 1/N shard", st.grad_bytes);
    b.Add(Tier::kDevice, "optimizer state (master+m+v), 1/N shard", st.optimizer_bytes);
  } else {
    // Partial offload: the sub-groups the ratio keeps on the device.
    b.Add(Tier::kDevice, "grads (fp32), device-resident sub-groups (ratio)", st.device_grad_bytes);
    b.Add(Tier::kDevice, "optimizer state (master+m+v), device-resident sub-groups (ratio)",
          st.device_optimizer_bytes);
  }

  // The engine's device working set, by the engine's own rule (sched/placement.h): per-group
  // gradient buffers and gathered groups, not DeepSpeed's buckets.
  const double ranks = static_cast<double>(in.capacity.Ranks());
  const double group = LargestGroup(in);
  // The rule counts in 64-bit integers: element counts clamped to 2^50 (1e15) and bytes per
  // element to 256, so its products cannot overflow; a fractional width rounds up.
  auto elems = [](double v) { return static_cast<uint64_t>(std::min(std::ceil(v), 0x1p50)); };
  auto width = [](double v) { return static_cast<uint64_t>(std::min(std::ceil(v), 256.0)); };
  sched::DeviceWorkingInput dw;
  dw.world = static_cast<int>(in.capacity.Ranks());
  dw.largest_group_elems = elems(group);
  dw.largest_shard_elems = elems(group / ranks);
  dw.total_group_elems = elems(psi);
  // Gradient buffers: the largest group that trains (frozen ones take none).
  const double grad_group = in.trainable_params > 0 ? std::min(group, in.trainable_params) : group;
  dw.grad_group_elems = elems(grad_group);
  dw.grad_shard_elems = elems(grad_group / ranks);
  dw.param_elem_bytes = width(r.param_bytes);
  dw.grad_elem_bytes = width(r.grad_bytes);
  dw.overlap_comm = overlap;
  dw.quantized_gradients = stage == 3 && z.zero_plus_plus.quantized_gradients;
  dw.quantized_weights = stage == 3 && z.zero_plus_plus.quantized_weights;
  dw.max_live_elems = elems(z.max_live_parameters);
  dw.reuse_distance_elems = elems(z.max_reuse_distance);
  dw.prefetch_elems = elems(z.prefetch_bucket_size);
  dw.persistence_elems = elems(z.param_persistence_threshold);
  dw.model_persistence_elems = elems(z.model_persistence_threshold);
  dw.device_kernels = in.capacity.device_kernels;
  dw.optimizer_buffers = static_cast<uint64_t>(std::clamp(z.optimizer_buffer_count, 1.0, 64.0));
  dw.largest_sub_group_elems = elems(LargestSubGroup(in, b.states, psi / ranks));
  dw.device_sub_groups = b.states.device_sub_groups;
  dw.sub_groups = b.states.sub_groups;
  dw.sub_group_elems = b.states.sub_group_elems;
  dw.device_sub_group_elems = b.states.device_sub_group_elems;
  for (const sched::DeviceWorkingItem& it : sched::DeviceWorkingSet(b.rules, dw)) {
    b.Add(Tier::kDevice, it.name, static_cast<double>(it.bytes));
  }
  b.Add(Tier::kDevice, "activations (caller estimate)", in.activation_bytes_per_gpu);
}

// The store's host cache of NVMe-homed blocks (sched::HostCacheBytes): the host capacity per rank
// is the engine's host budget; what the working set leaves of it fills with cached copies, up to
// the NVMe-homed bytes beyond the swap buffers. Per node, one item.
// `swap`: the swap buffers' bytes per node (host copies of NVMe-homed blocks already counted).
void PlaceHostCache(const PlanInput& in, double swap, Builder& b) {
  const double g = in.capacity.gpus_per_node;
  const double need = b.Sum(Tier::kHost), nvme = b.Sum(Tier::kNvme);
  auto bytes = [g](double v) { return PerRankBytes(v, g); };
  const double cache =
      g * static_cast<double>(sched::HostCacheBytes(bytes(in.capacity.dram_bytes_per_node),
                                                    bytes(need), bytes(nvme), bytes(swap)));
  // Pinned like the swap buffers: the same store memory.
  b.Add(Tier::kHost, "cache of NVMe-homed blocks (what the budget leaves)", cache, true);
  b.p.host_cache_bytes_per_node = cache;
}

// The bytes of one rank's NVMe-homed blocks the store may cache on the host
// (sched::CacheableNvmeBytes), from the NVMe items so far. `swap`: as PlaceHostCache's.
uint64_t CacheableNvmePerRank(const PlanInput& in, double swap, const Builder& b) {
  const double g = in.capacity.gpus_per_node;
  return sched::CacheableNvmeBytes(PerRankBytes(b.Sum(Tier::kNvme), g), PerRankBytes(swap, g));
}

// The speculative step's rollback copies (sched::SpeculationBufferBytes, the engine's rule) at
// stage 3 with the optimizer offloaded: per rank, of its offloaded optimizer elements, within what
// the host capacity leaves of the items so far. Per node, one item; none where that room caches
// the rank's whole NVMe-homed state instead (sched::SpeculationRoomCaches: PlaceHostCache then
// lists it, and true is returned). `swap`: as PlaceHostCache's.
bool PlaceSpeculation(const PlanInput& in, int stage, double swap, Builder& b) {
  const ZeroSettings& z = in.zero;
  if (stage != 3 || b.p.offload_optimizer == OffloadDevice::kNone) return false;
  const double g = in.capacity.gpus_per_node;
  const double need = b.Sum(Tier::kHost);
  const double dram = in.capacity.dram_bytes_per_node;
  const uint64_t room = dram > 0 ? static_cast<uint64_t>(std::max(0.0, (dram - need) / g))
                                 : std::numeric_limits<uint64_t>::max();
  // The rank's offloaded optimizer elements (partial offload: the device's step in Step).
  const auto elems =
      static_cast<uint64_t>((b.states.optimizer_bytes - b.states.device_optimizer_bytes) / 12);
  const auto param_elem = static_cast<uint64_t>(in.recipe.param_bytes);
  const double bytes = static_cast<double>(sched::SpeculationBufferBytes(
      static_cast<int64_t>(z.speculation_buffer_size), elems, param_elem, room));
  const uint64_t cacheable = CacheableNvmePerRank(in, swap, b);
  const std::optional<bool> key =
      z.speculative_step_given ? std::optional<bool>(true) : std::nullopt;
  // Also where the speculation is off for overlap_step (bench engine's planner figures).
  if (sched::SpeculationRoomCaches(key, cacheable, static_cast<uint64_t>(bytes))) return true;
  if (!z.speculative_step) return false;
  b.Add(Tier::kHost, "speculative step rollback copies (master+m+v+param of what it holds)",
        g * bytes);
  return false;
}

// Host and NVMe items, per node, and the per-step traffic they cause.
void PlaceOffload(const PlanInput& in, int stage, Builder& b) {
  const Recipe& r = in.recipe;
  const ZeroSettings& z = in.zero;
  const double g_per_node = in.capacity.gpus_per_node;
  const double shard = in.params / static_cast<double>(in.capacity.Ranks());
  // The trainable part's shard: what the optimizer reads, writes and sends back.
  const double tshard = (in.trainable_params > 0 ? in.trainable_params : in.params) /
                        static_cast<double>(in.capacity.Ranks());
  const double k = z.gradient_accumulation_steps;
  const sched::StateLayout& st = b.states;
  Placement& p = b.p;
  // Partial offload: only the offloaded sub-groups' states, gradients and traffic leave the
  // device (all of them at ratio 1).
  const double off_opt = st.optimizer_bytes - st.device_optimizer_bytes;
  const double off_grad = st.grad_bytes - st.device_grad_bytes;
  const double off_share = p.optimizer_offloaded_fraction;

  double pcie = 0, nvme_io = 0, swap = 0;
  double opt_buffers = 0;  // per node; noted already where they outweigh the state they page
  bool buffers_noted = false;
  switch (p.offload_optimizer) {
    case OffloadDevice::kNone:
      break;
    case OffloadDevice::kCpu:
      b.Add(Tier::kHost, "optimizer state (master+m+v), 1/N shard per GPU", g_per_node * off_opt,
            z.optimizer_pin_memory);
      b.Add(Tier::kHost, OffloadedGrads(in, b.rules) + ", 1/N shard per GPU", g_per_node * off_grad,
            z.optimizer_pin_memory);
      break;
    case OffloadDevice::kNvme: {
      // sub_group_size 0: each tensor is a sub-group, the largest one's shard sets the buffers.
      const double sub_group = LargestSubGroup(in, st, shard);
      if (z.sub_group_size == 0 && in.largest_group_params == 0) {
        p.notes.push_back(
            "sub_group_size 0 makes each parameter tensor a sub-group: the optimizer swap "
            "buffers hold the largest one's shard, not counted without --largest-group");
      }
      const double buffers = OptimizerSwapBuffers(in, b.rules, st, shard);
      b.Add(Tier::kHost, "optimizer swap buffers, min(count + 1, sub-groups) x 4",
            g_per_node * buffers, true);
      swap += g_per_node * buffers;
      opt_buffers = g_per_node * buffers;
      buffers_noted = buffers > 0 && buffers >= off_opt;
      if (buffers_noted) {
        p.notes.push_back(
            "optimizer swap buffers ((" + Fmt(z.optimizer_buffer_count) + " + 1) x " +
            Fmt(sub_group) + " elements" +
            (in.largest_group_params > 0
                 ? ""
                 : ", without --largest-group a group taken as reduce_bucket_size elements") +
            ") take as much DRAM as the optimizer state itself: lower sub_group_size for NVMe "
            "offload");
      }
      b.Add(Tier::kNvme, "optimizer state (master+m+v), 1/N shard per GPU", g_per_node * off_opt);
      b.Add(Tier::kNvme, OffloadedGrads(in, b.rules) + ", 1/N shard per GPU",
            g_per_node * off_grad);
      // Step: read and write master/m/v once; grads written each micro-step and read back
      // (accumulation, then the step): 2k reads+writes.
      nvme_io += off_share *
                 (2 * r.OptimizerBytes() * tshard + 2 * k * GradStateBytes(in, b.rules) * tshard);
      break;
    }
  }
  if (p.offload_optimizer != OffloadDevice::kNone) {
    // Reduced grad shard to the host each micro-step (stage >= 2) or once (stage 1).
    pcie += off_share * (stage >= 2 ? k : 1) * r.grad_bytes * tshard;
    // The updated param16 shard back to the GPU, unless params live on the host anyway.
    if (p.offload_param == OffloadDevice::kNone) pcie += off_share * r.param_bytes * tshard;
  }

  if (p.offload_param != OffloadDevice::kNone) {
    // Forward and backward each copy the local shard up before the all-gather.
    pcie += 2 * k * r.param_bytes * shard;
    if (p.offload_optimizer == OffloadDevice::kNone) pcie += r.param_bytes * shard;
  }
  if (p.offload_param == OffloadDevice::kCpu) {
    b.Add(Tier::kHost, "params, 1/N shard per GPU", g_per_node * st.param_bytes,
          z.param_pin_memory);
  } else if (p.offload_param == OffloadDevice::kNvme) {
    // The swap buffers; what the host budget leaves beyond the working set is the store's
    // cache (PlaceHostCache; max_in_cpu is not used).
    b.Add(Tier::kHost, "param swap buffers (buffer_count x largest shard)",
          g_per_node * ParamSwapBuffers(in, shard), true);
    swap += g_per_node * ParamSwapBuffers(in, shard);
    b.Add(Tier::kNvme, "params, 1/N shard per GPU", g_per_node * st.param_bytes);
    p.nvme_param_bytes_per_node = g_per_node * st.param_bytes;
    // Read for forward and backward of each micro-step, written after the step.
    nvme_io += (2 * k + 1) * r.param_bytes * shard;
  }
  const double dram = in.capacity.dram_bytes_per_node;
  if (opt_buffers > 0 && !buffers_noted && dram > 0 && b.Sum(Tier::kHost) > dram) {
    p.notes.push_back("host DRAM does not hold the setting: the optimizer swap buffers take " +
                      Fmt(opt_buffers / 1e9) + " GB per node of the " +
                      Fmt(b.Sum(Tier::kHost) / 1e9) +
                      " GB; each holds one sub-group, so a smaller sub_group_size shrinks them");
  }
  // The engine's default budget then caches every NVMe-homed block and writes none home
  // (Engine::Impl::nvme_state_cached): a step moves no NVMe bytes.
  if (PlaceSpeculation(in, stage, swap, b)) nvme_io = 0;
  PlaceHostCache(in, swap, b);
  // The same where the DRAM capacity leaves room for every NVMe-homed block (the engine's rule):
  // after the first step's reads nothing moves until a checkpoint or Flush. A cache of part of
  // them is counted as none: each step visits every block once, in the same order.
  const uint64_t cacheable = CacheableNvmePerRank(in, swap, b);
  if (cacheable > 0 && PerRankBytes(p.host_cache_bytes_per_node, g_per_node) >= cacheable) {
    nvme_io = 0;
  }
  p.pcie_bytes_per_gpu = pcie;
  p.nvme_io_bytes_per_node = g_per_node * nvme_io;
  p.nvme_io_seconds = p.nvme_io_bytes_per_node / in.capacity.nvme_bytes_per_s_per_node;
  p.nvme_required_bytes_per_s = p.nvme_io_bytes_per_node / in.target_step_seconds;
}

Status CheckPositive(double v, const char* name) {
  if (!(v > 0) || !std::isfinite(v)) {
    return Status::InvalidArgument(std::string(name) + " must be a positive number, got " + Fmt(v));
  }
  return Status::OK();
}

Status CheckNonNegative(double v, const char* name) {
  if (!std::isfinite(v)) {
    return Status::InvalidArgument(std::string(name) + " must be finite, got " + Fmt(v));
  }
  if (!(v >= 0)) {
    return Status::InvalidArgument(std::string(name) + " must be >= 0, got " + Fmt(v));
  }
  return Status::OK();
}

}  // namespace

std::optional<OffloadDevice> ParseOffloadDevice(std::string_view s) noexcept {
  if (s == "none") return OffloadDevice::kNone;
  if (s == "cpu") return OffloadDevice::kCpu;
  if (s == "nvme") return OffloadDevice::kNvme;
  return std::nullopt;
}

const std::vector<Recipe>& KnownRecipes() {
  static const std::vector<Recipe> kRecipes = {
      {"bf16-adam", 2, 2, 4, 4, 4},   // mixed precision, fp32 master and Adam states
      {"fp16-adam", 2, 2, 4, 4, 4},   // the same ledger with fp16 params and grads
      {"fp32-grads", 2, 4, 4, 4, 4},  // grads reduced and accumulated in fp32
      {"no-master", 2, 2, 0, 4, 4},   // bf16 params updated in place, fp32 Adam states
      {"bf16-pure", 2, 2, 0, 2, 2},   // everything bf16
      {"adam8bit", 2, 2, 4, 1, 1},    // 8-bit Adam states (block scales not counted)
      {"fp32", 4, 4, 0, 4, 4},        // full fp32 training
  };
  return kRecipes;
}

Result<Recipe> ParseRecipe(std::string_view spec) {
  for (const Recipe& r : KnownRecipes()) {
    if (r.name == spec) return r;
  }
  if (spec.find(':') == std::string_view::npos) {
    std::string names;
    for (const Recipe& r : KnownRecipes()) names += (names.empty() ? "" : ", ") + r.name;
    return Status::InvalidArgument("unknown recipe '" + std::string(spec) + "': expected one of " +
                                   names + " or P:G:MASTER:M:V bytes per parameter");
  }
  double v[5];
  size_t i = 0;
  std::string_view rest = spec;
  for (; i < 5; ++i) {
    const size_t colon = rest.find(':');
    std::string_view field = rest.substr(0, colon);
    const char* end = field.data() + field.size();
    auto [ptr, ec] = std::from_chars(field.data(), end, v[i]);
    if (ec != std::errc() || ptr != end || field.empty() || !(v[i] >= 0) || !std::isfinite(v[i])) {
      return Status::InvalidArgument("recipe '" + std::string(spec) + "': field " +
                                     std::to_string(i + 1) + " '" + std::string(field) +
                                     "' is not a byte count >= 0");
    }
    if (colon == std::string_view::npos) break;
    rest = rest.substr(colon + 1);
  }
  if (i != 4) {
    return Status::InvalidArgument("recipe '" + std::string(spec) +
                                   "': expected 5 fields P:G:MASTER:M:V");
  }
  Recipe r{std::string(spec), v[0], v[1], v[2], v[3], v[4]};
  if (!(r.TotalBytes() > 0)) {
    return Status::InvalidArgument("recipe '" + std::string(spec) + "' has 0 bytes per parameter");
  }
  return r;
}

Result<double> ParseParamCount(std::string_view s) {
  const std::string orig(s);
  double mult = 1;
  if (!s.empty()) {
    switch (s.back()) {
      case 'k':
      case 'K':
        mult = 1e3;
        break;
      case 'm':
      case 'M':
        mult = 1e6;
        break;
      case 'b':
      case 'B':
      case 'g':
      case 'G':
        mult = 1e9;
        break;
      case 't':
      case 'T':
        mult = 1e12;
        break;
      default:
        break;
    }
    if (mult != 1) s.remove_suffix(1);
  }
  double v = 0;
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || ptr != end || !std::isfinite(v) || !(v > 0)) {
    return Status::InvalidArgument("parameter count '" + orig +
                                   "': expected a positive number such as 7e9, 7B, 350M or 1.5T");
  }
  // A count of parameters is a whole number >= 1 once the suffix is applied (7.5B is fine, 7.5
  // is not). Decimal fractions times a power of ten carry a little binary error: allow 1e-9.
  const double total = v * mult, whole = std::round(total);
  if (whole < 1 || std::fabs(total - whole) > 1e-9 * whole) {
    return Status::InvalidArgument("parameter count '" + orig + "' is " + Fmt(total) +
                                   " parameters: expected a whole number >= 1 (e.g. 7e9, 7B, "
                                   "7.5B, 350M)");
  }
  return whole;
}

double LedgerBytesPerGpu(const Recipe& r, int stage, double psi, int64_t ranks) {
  const double n = static_cast<double>(ranks);
  const double p = r.param_bytes, g = r.grad_bytes, o = r.OptimizerBytes();
  switch (stage) {
    case 0:
      return (p + g + o) * psi;
    case 1:
      return (p + g) * psi + o * psi / n;
    case 2:
      return p * psi + (g + o) * psi / n;
    default:
      return (p + g + o) * psi / n;
  }
}

Status ValidatePlanInput(const PlanInput& in) {
  STRATA_RETURN_IF_ERROR(CheckPositive(in.params, "params"));
  if (in.params > kMaxPlanParams) {
    // Every byte count stays exact in 64 bits below this (20 B per parameter and buffers).
    return Status::InvalidArgument("params " + Fmt(in.params) + " is beyond the " +
                                   Fmt(kMaxPlanParams) + " the planner counts exactly");
  }
  STRATA_RETURN_IF_ERROR(CheckNonNegative(in.largest_group_params, "largest group params"));
  if (in.largest_group_params > in.params) {
    return Status::InvalidArgument("largest group params (" + Fmt(in.largest_group_params) +
                                   ") exceed params (" + Fmt(in.params) + ")");
  }
  STRATA_RETURN_IF_ERROR(CheckNonNegative(in.trainable_params, "trainable params"));
  if (in.trainable_params > in.params) {
    return Status::InvalidArgument("trainable params (" + Fmt(in.trainable_params) +
                                   ") exceed params (" + Fmt(in.params) + ")");
  }
  STRATA_RETURN_IF_ERROR(CheckNonNegative(in.activation_bytes_per_gpu, "activation bytes"));
  STRATA_RETURN_IF_ERROR(CheckPositive(in.target_step_seconds, "target step seconds"));
  const Recipe& r = in.recipe;
  for (double v :
       {r.param_bytes, r.grad_bytes, r.master_bytes, r.momentum_bytes, r.variance_bytes}) {
    STRATA_RETURN_IF_ERROR(CheckNonNegative(v, ("recipe " + r.name + " bytes").c_str()));
    if (v > kMaxRecipeBytes) {
      return Status::InvalidArgument("recipe " + r.name + ": " + Fmt(v) +
                                     " bytes per parameter for one state; at most " +
                                     Fmt(kMaxRecipeBytes) + " (fp64 Adam state is 8)");
    }
  }
  const Capacity& c = in.capacity;
  if (c.gpus_per_node < 1) return Status::InvalidArgument("gpus per node must be >= 1");
  if (c.nodes < 1) return Status::InvalidArgument("nodes must be >= 1");
  if (c.Ranks() > kMaxPlanRanks) {
    return Status::InvalidArgument("gpus per node x nodes = " + std::to_string(c.gpus_per_node) +
                                   " x " + std::to_string(c.nodes) + " = " +
                                   std::to_string(c.Ranks()) + " ranks; at most " +
                                   std::to_string(kMaxPlanRanks) + " are planned");
  }
  STRATA_RETURN_IF_ERROR(CheckNonNegative(c.hbm_bytes_per_gpu, "HBM capacity"));
  STRATA_RETURN_IF_ERROR(CheckNonNegative(c.dram_bytes_per_node, "host DRAM capacity"));
  STRATA_RETURN_IF_ERROR(CheckNonNegative(c.nvme_bytes_per_node, "NVMe capacity"));
  STRATA_RETURN_IF_ERROR(CheckPositive(c.nvme_bytes_per_s_per_node, "NVMe bandwidth"));
  const ZeroSettings& z = in.zero;
  if (z.stage < 0 || z.stage > 3) {
    return Status::InvalidArgument("zero_optimization.stage must be 0..3, got " +
                                   std::to_string(z.stage));
  }
  // The JSON paths of the DeepSpeed keys, so a config's value is named as the user wrote it.
  for (auto [v, path] : {
           std::pair{z.optimizer_buffer_count, "zero_optimization.offload_optimizer.buffer_count"},
           std::pair{z.param_buffer_count, "zero_optimization.offload_param.buffer_count"},
           std::pair{z.param_buffer_size, "zero_optimization.offload_param.buffer_size"},
           std::pair{z.max_in_cpu, "zero_optimization.offload_param.max_in_cpu"},
           std::pair{z.reduce_bucket_size, "zero_optimization.reduce_bucket_size"},
           std::pair{z.allgather_bucket_size, "zero_optimization.allgather_bucket_size"},
           std::pair{z.prefetch_bucket_size, "zero_optimization.stage3_prefetch_bucket_size"},
           std::pair{z.max_live_parameters, "zero_optimization.stage3_max_live_parameters"},
           std::pair{z.max_reuse_distance, "zero_optimization.stage3_max_reuse_distance"},
           std::pair{z.param_persistence_threshold,
                     "zero_optimization.stage3_param_persistence_threshold"},
           std::pair{z.model_persistence_threshold,
                     "zero_optimization.stage3_model_persistence_threshold"},
           // 0 is DeepSpeed's "one sub-group per parameter tensor" (its rule: ge=0).
           std::pair{z.sub_group_size, "zero_optimization.sub_group_size"},
       }) {
    STRATA_RETURN_IF_ERROR(CheckNonNegative(v, path));
  }
  STRATA_RETURN_IF_ERROR(plan::ValidateZeroPlusPlus(z.zero_plus_plus, c));
  if (!(z.gradient_accumulation_steps >= 1)) {
    return Status::InvalidArgument("gradient_accumulation_steps must be >= 1, got " +
                                   Fmt(z.gradient_accumulation_steps));
  }
  return Status::OK();
}

Placement Place(const PlanInput& in, int stage, OffloadDevice optimizer, OffloadDevice param,
                double ratio) {
  Placement p;
  p.stage = stage;
  // The rules the engine applies too (sched/placement.h).
  sched::StatePlacement rules = sched::ResolvePlacement(stage, optimizer, param, ratio);
  p.notes = std::move(rules.notes);
  p.offload_optimizer = rules.offload_optimizer;
  p.offload_param = rules.offload_param;
  const sched::StateLayout states = PlannedStates(in, rules);
  p.optimizer_ratio = rules.optimizer_ratio;
  if (states.sub_group_elems > 0) {
    p.optimizer_offloaded_fraction =
        static_cast<double>(states.sub_group_elems - states.device_sub_group_elems) /
        static_cast<double>(states.sub_group_elems);
  }
  Builder b{p, rules, states};
  PlaceHbm(in, stage, b);
  PlaceOffload(in, stage, b);
  p.comm = plan::StageComm(in, stage);
  if (stage == 3) {
    const Stage3Comm s3 =
        ZeroPlusPlusComm(in.zero.zero_plus_plus, in.params, in.recipe.param_bytes,
                         in.recipe.grad_bytes, in.capacity.gpus_per_node, in.capacity.nodes);
    b.Add(Tier::kDevice,
          "hpZ secondary params, 1/k shard (k = " +
              std::to_string(in.zero.zero_plus_plus.hpz_partition_size) + ")",
          s3.hpz_secondary_bytes_per_gpu);
  }
  plan::NoteZeroPlusPlus(in, stage, &p.notes);
  for (const PlanItem& it : p.items) {
    switch (it.tier) {
      case Tier::kDevice:
        p.hbm_bytes_per_gpu += it.bytes;
        break;
      case Tier::kHost:
        p.host_bytes_per_node += it.bytes;
        if (it.pinned) p.host_pinned_bytes_per_node += it.bytes;
        break;
      case Tier::kNvme:
        p.nvme_bytes_per_node += it.bytes;
        break;
    }
  }
  p.fits_hbm = p.hbm_bytes_per_gpu <= in.capacity.hbm_bytes_per_gpu;
  p.fits_host = p.host_bytes_per_node <= in.capacity.dram_bytes_per_node;
  p.fits_nvme = p.nvme_bytes_per_node <= in.capacity.nvme_bytes_per_node;
  return p;
}

Result<Plan> MakePlan(const PlanInput& in) {
  STRATA_RETURN_IF_ERROR(ValidatePlanInput(in));
  Plan plan;
  plan.input = in;
  const int64_t ranks = in.capacity.Ranks();
  for (int s = 0; s < 4; ++s) {
    plan.ledger_bytes_per_gpu[s] = LedgerBytesPerGpu(in.recipe, s, in.params, ranks);
    plan.stages[s] =
        Place(in, s, in.zero.offload_optimizer, in.zero.offload_param, in.zero.optimizer_ratio);
  }
  if (in.has_configured) {
    plan.configured = Place(in, in.zero.stage, in.zero.offload_optimizer, in.zero.offload_param,
                            in.zero.optimizer_ratio);
  }
  using D = OffloadDevice;
  // Partial optimizer offload (offload_optimizer.ratio) between no offload and a full one at
  // stage 3: the smallest share offloaded that fits comes first.
  const struct {
    int stage;
    D opt, param;
    double ratio;
  } kLadder[] = {
      {0, D::kNone, D::kNone, 1},   {1, D::kNone, D::kNone, 1},   {2, D::kNone, D::kNone, 1},
      {3, D::kNone, D::kNone, 1},   {3, D::kCpu, D::kNone, 0.25}, {3, D::kCpu, D::kNone, 0.5},
      {3, D::kCpu, D::kNone, 0.75}, {3, D::kCpu, D::kNone, 1},    {3, D::kCpu, D::kCpu, 1},
      {3, D::kNvme, D::kCpu, 1},    {3, D::kNvme, D::kNvme, 1}};
  for (const auto& step : kLadder) {
    plan.ladder.push_back(Place(in, step.stage, step.opt, step.param, step.ratio));
    if (!plan.recommended && plan.ladder.back().Fits()) {
      plan.recommended = plan.ladder.size() - 1;
    }
  }
  plan.fits = plan.configured ? plan.configured->Fits() : plan.recommended.has_value();
  return plan;
}

}  // namespace strata
