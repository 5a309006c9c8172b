// Placement rules: where each model state of a rank lives (its home tier) and which states are
// partitioned, from the ZeRO stage and the config's offload devices, with DeepSpeed's rules for
// the combinations it does not run as written. One pure function, shared by the memory planner
// (core/plan) and the engine (core/zero), so the plan `offloadctl plan` prints is the placement
// the engine builds.
//
// Rules (DeepSpeed stage_1_and_2.py / stage3.py behaviour), applied in this order:
//   - offload_optimizer at stage 0 is ignored (there is no optimizer partition to offload).
//   - offload_optimizer to nvme below stage 3 becomes cpu (DeepSpeed swaps optimizer state to
//     NVMe only in stage 3).
//   - offload_param below stage 3 is ignored (only stage 3 partitions parameters).
// Each rule that changes the request adds a note in words. Homes that follow:
//   - param16: the param offload device at stage 3 (cpu -> host, nvme -> nvme), else device.
//   - grad (the reduced gradient shard handed to the optimizer), master32, exp_avg, exp_avg_sq:
//     the optimizer offload device (cpu -> host, nvme -> nvme), else device. Gradient shards live
//     with the optimizer that consumes them.
//   - partitioned: optimizer state from stage 1, gradients from stage 2, parameters at stage 3;
//     a state that is not partitioned is a full replica on every rank.
//   - partial optimizer offload (offload_optimizer.ratio < 1, DeepSpeed's ZeRO-Offload++): at
//     stage 3 with the optimizer offloaded, only a share of a rank's optimizer sub-groups takes
//     the offload home; the rest keep master32, exp_avg, exp_avg_sq and their gradient on the
//     device (DeviceResidentSubGroups says which). Elsewhere the ratio does not apply (1).
//
// Thread safety: pure functions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/config.h"
#include "strata/store.h"

namespace strata::sched {

struct StatePlacement {
  int stage = 0;
  // The offload devices after the rules (what actually runs).
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;
  bool params_partitioned = false;
  bool grads_partitioned = false;
  bool optimizer_partitioned = false;
  // The share of the rank's optimizer sub-group elements that takes the offload home
  // (offload_optimizer.ratio, in [0, 1]): 1 unless stage 3 with the optimizer offloaded.
  double optimizer_ratio = 1.0;
  // One sentence per rule that changed the request.
  std::vector<std::string> notes;

  // The home tier of a rank's copy of `kind` (for the optimizer's states and the gradient: the
  // home of an offloaded sub-group).
  Tier Home(StateKind kind) const;
  // The home of `kind` for a sub-group that DeviceResidentSubGroups keeps on the device
  // (`device_resident`): the device for the optimizer's states and the gradient; else Home.
  Tier SubGroupHome(StateKind kind, bool device_resident) const;
};

// The tier an offload device puts a state on (none -> device, cpu -> host, nvme -> nvme).
Tier OffloadTier(OffloadDevice d);

// REQUIRES: 0 <= stage <= 3 (the config reader and the planner validate it first).
// `optimizer_ratio` is offload_optimizer.ratio, clamped to [0, 1]; below stage 3 a ratio < 1 is
// ignored with a note (the config checks refuse it there), and with no optimizer offload it has
// no effect.
StatePlacement ResolvePlacement(int stage, OffloadDevice optimizer, OffloadDevice param,
                                double optimizer_ratio = 1.0);

// Partial optimizer offload: which of a rank's optimizer sub-groups stay on the device.
//
// The ratio r (placement.optimizer_ratio) is taken to the nearest millionth, q = round(r x 1e6).
// Of the rank's T sub-group elements, at least ceil(T x q / 1e6) are offloaded (integer
// arithmetic, exact), so the device keeps at most D = T - ceil(T x q / 1e6) elements: the
// longest prefix of the sub-groups, in forward order (group 0's first sub-group first), whose
// elements add up to no more than D. Those are the sub-groups whose gradients become final last
// in backward, so the CPU work left after the backward (the offloaded sub-groups' Adam) is the
// earliest to be ready. Consequences: r = 1 keeps none (every sub-group offloaded: the full
// offload); r = 0 keeps all (the optimizer as with no offload, the param offload unchanged);
// the device share never exceeds 1 - r, so a single sub-group stays only when r = 0, and a
// sub-group larger than what is left ends the prefix (none after it stays).
// DeepSpeed (stage3.py, subgroup_to_device) counts sub-groups, not elements, and offloads the
// first int(r x n) of them; strata keeps the first ones on the device, for the reason above.
//
// Returns k: sub-groups [0, k) of `sub_group_elems` (the rank's sub-groups in forward order)
// stay on the device; 0 whenever optimizer_ratio is 1 (or the optimizer is not offloaded: then
// Home is the device for all of them anyway).
size_t DeviceResidentSubGroups(const StatePlacement& placement,
                               const std::vector<uint64_t>& sub_group_elems);
// D above: the elements the device may keep of `total_elems` at ratio `ratio`.
uint64_t DeviceResidentLimit(double ratio, uint64_t total_elems);

// Memory rules shared by the engine's layout (core/zero/engine.cc) and the planner's memory
// items (core/plan/planner.cc): one formula each, so `offloadctl plan` and the engine's peak
// agree.
//
// Bytes per element of a rank's copy of `kind`: param16 in the working dtype; the optimizer
// states (master32, exp_avg, exp_avg_sq) in fp32; the gradient shard handed to the optimizer in
// GradStateDType's dtype (`grad`).
uint64_t StateElementBytes(StateKind kind, DType working, DType grad = DType::kF32);

// The dtype of the gradient shard the optimizer consumes. fp32 where it is accumulated: across
// micro-steps (gradient_accumulation_steps > 1) or scaled on its way in (the 1 / world average
// of several ranks), since a 16-bit accumulator would round every partial sum; DeepSpeed keeps
// fp32 gradient partitions on its offload path too. The working dtype (16-bit) where the reduced
// gradient is already final as it arrives: one rank, one micro-step, a 16-bit working dtype and
// every sub-group's optimizer offloaded (its gradient on the host or NVMe; a device-resident
// gradient stays fp32 for the device's kernels). There the fp32 copy would hold exactly the same
// values (float(g) * 1, -0 kept: kernels/casts.h), so the step's bits do not change, while the
// CPU Adam reads 2 bytes of gradient per element instead of 4, the host keeps 2 instead of 4,
// and the backward writes no fp32 copy (ZeRO-Offload on one GPU: 14 instead of 16 host bytes per
// parameter, and about a quarter less memory traffic per element between the gradient's copy to
// the host and the Adam).
DType GradStateDType(DType working, int64_t gradient_accumulation_steps, int world,
                     const StatePlacement& placement);

// Host memory the optimizer step pages NVMe-homed optimizer state through: `buffer_count`
// (offload_optimizer.buffer_count, clamped to [1, 64]) sub-groups in the step pipeline plus the
// one being accumulated, each four blocks (master32, exp_avg, exp_avg_sq in fp32, the gradient
// in `grad_elem_bytes`: GradStateDType's) of `sub_group_elems` elements in whole 4 KiB pages (the
// store's IO alignment), never more sub-groups than the rank has (`sub_groups`; 0: not known,
// taken as many). Not DeepSpeed's buffer_count x sub_group x 4 B: strata's buffers hold whole
// sub-groups, gradient included.
uint64_t OptimizerSwapBufferBytes(int64_t buffer_count, uint64_t sub_group_elems,
                                  uint64_t sub_groups = 0, uint64_t grad_elem_bytes = 4);

// Host memory NVMe-homed parameter shards are staged through: `buffer_count`
// (offload_param.buffer_count, clamped to [2, 64]) shards of the largest group, in whole 4 KiB
// pages. Beyond these the store keeps whatever the host budget leaves room for (HostCacheBytes);
// DeepSpeed's max_in_cpu is not used.
uint64_t ParamSwapBufferBytes(int64_t buffer_count, uint64_t largest_shard_elems, DType working);

// The host cache. The swap buffers above are the store's host copies of NVMe-homed blocks while
// they are in use; released, a copy stays cached (clean) and the store evicts the least recently
// used ones only when the host budget is full (include/strata/store.h). So a rank's host memory
// grows to its working set `need` (host-homed states and the buffers) plus
//   min(NVMe-homed bytes beyond the swap buffers, budget - need)
// and stays there: with a budget well above the working set, every NVMe-homed block ends up in
// DRAM and the step reads nothing from NVMe. This is not a leak: the budget is the bound (and
// with a pinned pool it is allocated at open anyway), and the cache saves NVMe reads. The engine
// reports it in its layout (EngineLayout::cache_bytes) and the planner lists it as its own host
// item, both from this rule, so the peak the engine measures is the plan's whatever the budget.
// REQUIRES: nothing; every operand may be 0 (no NVMe tier: 0).
uint64_t HostCacheBytes(uint64_t budget_bytes, uint64_t need_bytes, uint64_t nvme_state_bytes,
                        uint64_t swap_buffer_bytes);

// The NVMe-homed bytes beyond the swap buffers: what the host cache may hold (HostCacheBytes is
// at most this; equal to it, the cache holds every NVMe-homed block).
inline uint64_t CacheableNvmeBytes(uint64_t nvme_state_bytes, uint64_t swap_buffer_bytes) {
  return nvme_state_bytes - std::min(nvme_state_bytes, swap_buffer_bytes);
}

// Host memory for the speculative step's rollback copies (offload_optimizer.speculative_step):
// per element of a sub-group stepped during the backward, its fp32 master, exp_avg and
// exp_avg_sq and its working param (`param_elem_bytes`), copied before its Adam writes them.
// `configured_elems` (offload_optimizer.speculation_buffer_size) >= 0: that many elements, at
// most the `speculable_elems` (the rank's offloaded optimizer elements); < 0 (auto): a
// quarter of them, or all of them up to kSpeculationFloorBytes of copies where that is more (a
// small model, a LoRA adapter: the whole step overlaps the backward for memory no training host
// misses), and no more than `host_room` (the host budget less the rest of the working set;
// UINT64_MAX when no budget was given), so that the default never makes a placement not fit.
inline constexpr uint64_t kSpeculationFloorBytes = uint64_t{256} << 20;
uint64_t SpeculationBufferBytes(int64_t configured_elems, uint64_t speculable_elems,
                                uint64_t param_elem_bytes, uint64_t host_room);

// The rollback copies' bytes per element: fp32 master, exp_avg, exp_avg_sq and the working param.
inline uint64_t SpeculationBytesPerElement(uint64_t param_elem_bytes) {
  return 3 * sizeof(float) + param_elem_bytes;
}

// Whether the speculative step is on (where it applies: stage 3, the optimizer offloaded): the
// config's offload_optimizer.speculative_step, else on (each step's mode then timed both ways,
// sched::SpeculationGovernor) unless `overlap_step`
// (EngineOptions::overlap_step; the planner plans without it): the step behind the next forward
// already hides the optimizer there. Both on, a kept speculation's worker finishes behind the
// next forward with the rest of the step, but it is no faster than either alone (bench engine,
// 200M params, 30 ms compute per layer: optimizer on cpu 1.005 s per step against 0.987 s with
// overlap_step alone; on NVMe 3.01 s against 2.59 s, the speculation's pipelines keeping the disk
// less busy in the forward).
inline bool SpeculationOn(std::optional<bool> configured, bool overlap_step) {
  return configured.value_or(!overlap_step);
}

// Whether the speculative step's room (`speculation_bytes`, from SpeculationBufferBytes) goes to
// the store's host cache instead, with no rollback copies (with overlap_step too, where the
// speculation is off unless asked for: the same memory either way): the key unset, and the rank's
// NVMe-homed bytes beyond the swap buffers (`cacheable_nvme_bytes`, HostCacheBytes' operand) in
// (0, speculation_bytes]. At equal host memory a model that small is better served by keeping its
// whole NVMe-homed state cached in DRAM (the engine then writes none of it home:
// Engine::Impl::nvme_state_cached) than by rollback copies with the state paged in from NVMe.
// Partly cached state is no such gain (the step touches every block once, cyclically: an LRU cache
// smaller than that keeps nothing it will use), hence the whole of it or nothing.
inline bool SpeculationRoomCaches(std::optional<bool> configured, uint64_t cacheable_nvme_bytes,
                                  uint64_t speculation_bytes) {
  return !configured.has_value() && cacheable_nvme_bytes > 0 &&
         cacheable_nvme_bytes <= speculation_bytes;
}

// Whether the engine accumulates each reduced gradient into the fp32 gradients on a thread of
// its own, behind the trainer's backward (core/zero/engine_grad.cc), so that up to two groups'
// gradient buffers stay in flight after ReduceGradients returns even on one rank: with
// overlap_comm, where the CPU accumulates them (gradients offloaded, or a device without kernels
// of its own; the device's kernels accumulate device-resident gradients in place).
inline bool AccumulatesBehind(bool overlap_comm, bool accumulated_on_host) {
  return overlap_comm && accumulated_on_host;
}

// The gradient buffers one rank (the identity reduction, no qgZ) has at once, each at most the
// largest group: three where the accumulation runs behind the backward (AccumulatesBehind), two
// with overlap_comm (the trainer's and one it holds back, or the one the device's kernels still
// read), else one. DeviceWorkingSet counts them; the engine recycles up to that many
// (Engine::GradBuffer with a caller stream). `device_kernels`: the device computes on its own
// memory (DeviceWorkingInput::device_kernels).
inline uint64_t OneRankGradBuffers(const StatePlacement& placement, bool overlap_comm,
                                   bool device_kernels) {
  if (AccumulatesBehind(overlap_comm,
                        placement.Home(StateKind::kGrad) != Tier::kDevice || !device_kernels)) {
    return 3;
  }
  return overlap_comm ? 2 : 1;
}

// The host budget the engine takes when none is given: the working set plus a slack for the
// store's staging (the prefetcher stages upcoming NVMe-homed param shards into host memory), so
// that the slack is the whole host cache of HostCacheBytes.
inline constexpr uint64_t kHostBudgetSlackBytes = uint64_t{16} << 20;

// The engine's device working set: what it allocates on the device besides the homes of the
// states, per rank. One rule for the engine's layout (core/zero/engine.cc: budgets and the table
// Create prints) and the planner's HBM items (core/plan/planner.cc), so `offloadctl plan` predicts
// the peak the engine reaches (checked within 10 % by tests/plan_engine_memory_test.cc).
//
// strata reduces and gathers per group, not in DeepSpeed's buckets: reduce_bucket_size and
// allgather_bucket_size allocate nothing here (DeepSpeed's 4.5 x bucket figure for stages 1-2
// does not apply), and the largest group sets the size of every buffer. Items:
//   - gradient buffers: the trainer writes one group's gradient (the full padded group, in the
//     wire dtype) and the reduce-scatter writes its shard; with overlap_comm up to two more
//     groups are reducing behind the trainer's backward: 3 x (group + shard), else 1 x (a
//     trainer that holds one buffer back, Engine::GradBuffer, makes the engine keep one fewer
//     in flight). One rank (without qgZ): the reduction is the identity, no shard: one group,
//     two with overlap_comm (the trainer's and the one it holds back), or three where the
//     accumulation runs behind the backward (AccumulatesBehind).
//   - read-back staging: Engine::ReadMaster all-gathers one group's fp32 master on several
//     ranks with a partitioned optimizer (4 B x the largest trainable group; at stage 3 the
//     largest group, a frozen one's params widened too). Between steps, when no gradient buffer
//     is allocated: only its excess over the gradient buffers counts.
//   - norm exchange: 16 B per rank.
//   - stage 3, gathered groups and (params off the device) the store's param shards on the
//     device: as many as Stage3Residency says the step's trace keeps at once. One rank (without
//     qwZ): no gathered groups, the shard is the whole group and the trainer reads the store's
//     copy (core/zero/engine_grad.cc, Gather).
//   - optimizer on the device (Home(kMaster32), or device-resident sub-groups of a partial
//     offload) run by the device's kernels (`device_kernels`: a device the host cannot address)
//     with params off it: the step writes the new 16-bit params into a device
//     copy of the param shard, fetched ahead like the states: one shard per pipeline buffer
//     (`optimizer_buffers`), store blocks; and the gradient statistics: a slot for each of
//     those sub-groups (Engine::Impl::CollectDeviceStats reads them all back at Step, so the
//     backward waits for no kernel), 8 B per 4096-element chunk (kernels::kStatsChunk) plus 8,
//     counted as 8 x (ceil(elements / 4096) + 2 x sub-groups).
// Not here: ZeRO++'s wire buffers (core/zero/zero_collectives.h) and hpZ's secondary copy (a
// state), which both sides add from their own ZeRO++ rules.
struct DeviceWorkingInput {
  int world = 1;
  uint64_t largest_group_elems = 0;  // the largest group, padded (all ranks' shards)
  // Its parameters, unpadded (0: largest_group_elems): the reuse distance counts these.
  uint64_t largest_group_numel = 0;
  uint64_t largest_shard_elems = 0;  // a rank's shard of it
  uint64_t total_group_elems = 0;    // every group, padded
  // The largest group that takes gradients, padded, and a rank's shard of it (frozen groups
  // take none; 0 when every group is frozen). Unset: the largest group's.
  std::optional<uint64_t> grad_group_elems, grad_shard_elems;
  uint64_t param_elem_bytes = 2;  // gathered params and param shards (the working dtype)
  uint64_t grad_elem_bytes = 2;   // gradients as the trainer writes and reduces them
  bool overlap_comm = false;
  bool quantized_gradients = false;  // qgZ (stage 3): reduces through its own wire buffers
  bool quantized_weights = false;    // qwZ (stage 3): gathers into a buffer even on one rank
  // The stage-3 limits, in full parameters as DeepSpeed gives them.
  uint64_t max_live_elems = 1000000000;        // stage3_max_live_parameters
  uint64_t reuse_distance_elems = 1000000000;  // stage3_max_reuse_distance
  uint64_t prefetch_elems = 50000000;          // stage3_prefetch_bucket_size
  uint64_t persistence_elems = 100000;         // stage3_param_persistence_threshold
  uint64_t model_persistence_elems = UINT64_MAX;  // stage3_model_persistence_threshold
  // The optimizer step on the device (see above).
  bool device_kernels = true;
  // Partial offload: the rank's sub-groups whose optimizer state stays on the device
  // (DeviceResidentSubGroups); with any, the step runs on the device for them as above.
  uint64_t device_sub_groups = 0;
  // The rank's optimizer sub-groups and their elements, all and device-resident ones
  // (StateLayout): the gradient statistics keep a slot for each the device's kernels complete.
  uint64_t sub_groups = 0, sub_group_elems = 0, device_sub_group_elems = 0;
  uint64_t optimizer_buffers = 4;  // the step pipeline's buffers (offload_optimizer.buffer_count)
  uint64_t largest_sub_group_elems = 0;  // a rank's largest optimizer sub-group
  // The unit a store copy of a param shard is sized in: the engine passes kIoAlignment (a
  // TieredStore block takes whole 4 KiB units on every tier, and the engine gives the store
  // exactly the items marked store_cache); 1 (the planner): the seed's exact bytes.
  uint64_t copy_alignment = 1;
};

// Stage 3: how many groups' copies the engine holds on the device at the peak of a step. The
// trace is taken as a trainer's step runs it (docs/design.md, "One training step"; `offloadctl
// bench engine` does exactly this): the L = total / largest groups gathered once each in forward
// order, then once each in reverse for backward, one at a time, every group the size of the
// largest. Released copies are kept by two rules that read the same config:
//   - the engine's gathered copies (core/zero/engine_grad.cc, Release) and the store's param
//     shards (sched/prefetcher.h, KeepAfterRelease) stay when the group is used again within
//     stage3_max_reuse_distance gathered elements. In that trace group i, released in forward,
//     comes back after 2 (L - 1 - i) groups: the last `kept` = min(L, R / (2 x group) + 1)
//     groups of forward are kept across the turn into backward (the shards likewise across the
//     turn into the next step's forward), plus the persistent groups (sched::PersistentGroups:
//     at most model_persistence / group of them, each no larger than
//     stage3_param_persistence_threshold);
//   - stage3_max_live_parameters caps the engine's kept copies (floor(max_live / group)), and
//     the prefetcher evicts shards to stay under it before it fetches and after a release
//     (floor(max_live / group) plus the one needed now); persistent shards stay regardless.
// So stage3_max_live_parameters bounds the copies only when the reuse distance would keep more:
// with DeepSpeed's defaults (1e9 both) a model whose groups are 1/16 of max_live or larger
// keeps half as much as the max_live cap (the reuse distance counts both directions).
//   gathered = min(L, max(2, min(kept - 1, cap) + 1)): the copies kept before the last layer
//     plus the one in use; at least two, as a trainer may hold a second group at once (tied
//     weights; the engine drops its kept copies to make room when the device is full).
//   shards = min(L, max(kept, lookahead + 1), cap + 1): the kept shards, or the prefetch window
//     (the one needed now and stage3_prefetch_bucket_size / group - 1 more) when that is larger.
// A trainer whose trace differs (a layer used twice, groups of very different sizes) keeps a
// different set; the caps above still hold, and nothing exceeds the device budget: both the
// store and the engine drop kept copies first when it is full.
struct Stage3Residency {
  uint64_t groups = 0;    // L
  uint64_t kept = 0;      // groups the reuse distance keeps across a turn of the trace
  uint64_t gathered = 0;  // the engine's full copies at the peak
  uint64_t shards = 0;    // the store's param shards on the device at the peak
};
// REQUIRES: largest_group_elems > 0.
Stage3Residency Stage3Peak(const DeviceWorkingInput& in);

// Stage 3: which groups stay whole on every rank for the whole run (DeepSpeed's
// mark_persistent_parameters, per group in model order): a group of at most `param_threshold`
// elements (stage3_param_persistence_threshold) while the persistent elements, it included, stay
// within `model_threshold` (stage3_model_persistence_threshold; a group that would pass it is
// skipped and a later, smaller one may still fit). The engine and its prefetcher both read it.
std::vector<bool> PersistentGroups(std::span<const size_t> numels, uint64_t param_threshold,
                                   uint64_t model_threshold);

struct DeviceWorkingItem {
  std::string name;
  uint64_t bytes = 0;
  // True for the store's param shards on the device: they are store blocks, inside the store's
  // device budget; the rest are the engine's own buffers.
  bool store_cache = false;
};

// REQUIRES: world >= 1. Items of 0 bytes are left out.
std::vector<DeviceWorkingItem> DeviceWorkingSet(const StatePlacement& placement,
                                                const DeviceWorkingInput& in);

// DeepSpeed's stage-3 limits count full parameters; the store's prefetcher and cache work on a
// rank's shards, so each becomes 1/N of itself in shard elements (rounded up; 0 stays 0). The
// engine's PrefetchConfig and DeviceWorkingSet's shard cache both take them from here.
struct ShardLimits {
  uint64_t prefetch_elems = 0;        // stage3_prefetch_bucket_size
  uint64_t max_live_elems = 0;        // stage3_max_live_parameters
  uint64_t reuse_distance_elems = 0;  // stage3_max_reuse_distance
};
// REQUIRES: world >= 1.
ShardLimits PerRankShardLimits(uint64_t prefetch, uint64_t max_live, uint64_t reuse_distance,
                               int world);

}  // namespace strata::sched
