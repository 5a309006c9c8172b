// The ZeRO engine: a data-parallel ZeRO-0/1/2/3 optimizer whose model states live on GPU HBM,
// pinned host DRAM or NVMe, as a DeepSpeed config says. A trainer embeds it and calls it at four
// points of every step (docs/design.md, "One training step"):
//
// clang-format off
//   // In a function returning strata::Status. model, options, fill, steps, micro_steps,
//   // loss, forward and backward are the trainer's.
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<strata::Engine> engine,   // plan printed / refused
//                           strata::Engine::Create(model, std::move(options)));  // here
//   STRATA_RETURN_IF_ERROR(engine->InitParameters(fill));  // or InitFromFullTensors, InitFromRank0
//   const size_t groups = model.groups.size();
//   for (int64_t step = 0; step < steps; ++step) {
//     for (int64_t micro = 0; micro < micro_steps; ++micro) {  // gradient_accumulation_steps
//       for (size_t g = 0; g < groups; ++g) {                   // forward order
//         STRATA_ASSIGN_OR_RETURN(strata::GatheredGroup p, engine->Gather(g));
//         forward(p);
//         engine->Release(std::move(p));
//       }
//       for (size_t g = groups; g-- > 0;) {                     // reverse order
//         STRATA_ASSIGN_OR_RETURN(strata::GatheredGroup p, engine->Gather(g));
//         STRATA_ASSIGN_OR_RETURN(void* grad, engine->GradBuffer(g));  // zeroed, on the device
//         backward(p, loss * engine->LossScale(), grad);
//         engine->Release(std::move(p));
//         STRATA_RETURN_IF_ERROR(engine->ReduceGradients(g));          // async reduce-scatter
//       }
//     }
//     STRATA_ASSIGN_OR_RETURN(strata::StepReport report, engine->Step());  // clip, Adam, params
//   }
// clang-format on
//
// Model: ordered groups of named parameters (a group is gathered together: one layer). A group's
// parameters lie back to back in one flat buffer of the precision's dtype (bf16, fp16 or fp32);
// rank r owns shard r of it (sched/zero_partition.h), padded to 128 elements.
//
// What lives where (sched/placement.h, the rule the planner uses too):
//   - working params: stage 0-2 a full replica of every group on the device; stage 3 the rank's
//     shard on the param home (offload_param: device | host | nvme), gathered per group into a
//     device buffer by all-gather and freed on Release unless persistent
//     (numel <= stage3_param_persistence_threshold, while the persistent elements stay within
//     stage3_model_persistence_threshold: sched::PersistentGroups) or used again within
//     stage3_max_reuse_distance elements of gathering (the recorded trace says so).
//   - fp32 master, Adam m and v, and the fp32 accumulated gradient: per optimizer sub-group (a
//     group's shard cut into pieces of at most sub_group_size elements) on the optimizer home
//     (offload_optimizer: device | host | nvme); partitioned from stage 1, a full replica at stage
//     0.
//   - gradient buffers the trainer writes: one full group on the device from GradBuffer(g) until
//     ReduceGradients(g) has reduced it (then freed).
//
// Numerics (one path for every stage and placement, so placement never changes a bit):
//   - every stage reduce-scatters each group's gradient in the precision's dtype (Gloo sums
//     16-bit in fp32, rounded once); stage 0 then all-gathers the reduced shards (together: an
//     all-reduce's bytes). The reduced shard is accumulated into the fp32 gradient as
//     acc = acc + g * s with s = post-scale / gradient_accumulation_steps (the first micro-step
//     stores g * s), so the accumulated gradient is the mean over micro-steps.
//   - the global norm: each rank sums squares over the sub-groups it owns (kernels/grad_stats.h,
//     exact within a sub-group), the per-rank sums are all-gathered and added in rank order: the
//     same figure on every rank and for every stage. An inf/NaN anywhere is an overflow on all.
//   - clipping and unscaling as DeepSpeed (docs/deepspeed-compat.md): combined scale =
//     loss_scale x max(1, ((norm / loss_scale) + 1e-6) / gradient_clipping); the fused SIMD Adam
//     (kernels/adam.h) applies 1 / combined scale, weight decay and the update in one pass and
//     emits the new 16-bit params; stage 1-2 then all-gather the updated shards.
//   - device-resident state (home: the device) on a device the host cannot address (CudaDevice)
//     is computed there, in place, by the device's kernels (Device::kernels(): accumulation,
//     chunk sums of squares, Adam with its param output, casts; the same formula and roundings),
//     never staged through the host; only the chunk sums cross. On HostDevice the CPU kernels
//     run on its memory.
//   - averaging: the reduction predivides by the world size when prescale_gradients is set or
//     gradient_predivide_factor equals the world size; otherwise it sums and the post-scale is
//     gradient_predivide_factor / world_size (DeepSpeed's default: 1 / world_size).
//   - LR schedules WarmupLR, WarmupDecayLR, WarmupCosineLR; the fp16 dynamic loss scaler;
//     skipped (overflow) steps do not advance the LR schedule. core/zero/loss_scaler.h and
//     core/zero/lr_schedule.h hold those rules.
// ZeRO++ (stage 3 only; docs/collectives.md, "ZeRO++"; the bytes are the planner's
// ZeroPlusPlusComm):
//   - qwZ (zero_quantized_weights): each Gather quantizes the rank's 16-bit shard block-wise to
//     INT8 + one fp32 scale per kernels::kQuantBlock elements (kernels/quantize.h), all-gathers
//     that and dequantizes into the gathered buffer. Only the gathered copies are quantized; the
//     fp32 master, the optimizer and the param shards never are. A NaN / Inf weight fails the
//     Gather naming the parameter.
//   - hpZ (zero_hpz_partition_size k; k divides the world and lies within a node or spans whole
//     nodes): the first Gather of a group in a step is the global all-gather (quantized with
//     qwZ) and keeps the rank's 1/k slice of the result (16-bit, on the device: in the layout and
//     the budget); later Gathers of it in the same step all-gather those slices within the k
//     consecutive ranks only. hpZ alone gives the same bits as plain stage 3.
//   - qgZ (zero_quantized_gradients, INT8): ReduceGradients quantizes the gradient, all-to-alls
//     within the node (EngineOptions::ranks_per_node), sums in fp32 in local-rank order,
//     re-quantizes, all-to-alls across nodes among ranks with the same local index and sums in
//     fp32 in node order: the rank's shard, rounded once to the working dtype. It runs on a
//     thread of its own, one group after another, overlapping the trainer's next backward like
//     the plain reduce-scatter with overlap_comm. A NaN / Inf gradient makes its block NaN, so
//     fp16 overflow still skips the step on every rank.
// Differences from DeepSpeed, on purpose: gradients are reduced every micro-step at every stage
// (DeepSpeed stage 0-1 reduce once per boundary), so with gradient_accumulation_steps > 1
// stages 0-1 move that many times the bytes; sub-groups never span two groups.
//
// Failure model: every error names the block, group, peer or operation. An error in Gather,
// ReduceGradients or Step leaves the engine failed: every later call returns FailedPrecondition
// quoting the first error, and the communicator is aborted so peers fail fast instead of waiting
// for their timeouts. Recovery is a checkpoint load into a new engine. No wait is unbounded:
// each is bounded by EngineOptions::timeout.
//
// Threads: the trainer calls from one thread. Collectives run on the communicator's threads, IO
// and copies on the store's; the optimizer step runs on the calling thread, overlapping its NVMe
// reads ahead and writes behind (offload_optimizer.buffer_count sub-groups in flight).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/checkpoint.h"
#include "strata/comm.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/io.h"
#include "strata/status.h"
#include "strata/store.h"

namespace strata {

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;  // every dimension > 0
  size_t numel() const;
};

struct GroupSpec {
  std::string name;  // "layer3"; used in block names and every error about the group
  std::vector<ParamSpec> params;
  // The optimizer parameter group (torch's param_groups) whose hyperparameters the group's Adam
  // uses: an index into EngineOptions::optimizer_groups (0 when that is empty). One group, one
  // set of hyperparameters: a module whose parameters sit in two optimizer groups is two groups.
  uint32_t optimizer_group = 0;
  // false: a frozen group (requires_grad=False: a fine-tune's base weights). Only its working
  // params are stored (on their home, partitioned at stage 3): no gradient, no fp32 master, no
  // Adam state, so it costs the working dtype's bytes per element. GradBuffer and
  // ReduceGradients refuse it, Step leaves it unchanged, Save keeps its params, ReadMaster
  // returns them in fp32.
  bool trainable = true;
  size_t numel() const;
};

struct ModelSpec {
  std::vector<GroupSpec> groups;  // in forward order
  size_t numel() const;
  // InvalidArgument naming the first problem: no groups, an empty group, a duplicate or empty
  // name, a non-positive dimension, an element count that overflows.
  Status Validate() const;
};

// One optimizer parameter group's hyperparameters (torch's param_groups[i]); each unset one is
// the config's optimizer.params value. The config's scheduler, when it has one, sets every
// group's lr at every step, as DeepSpeed's schedulers do; without one a group keeps its lr.
// Engine::SetLearningRates overrides both (a client scheduler).
struct OptimizerGroupOptions {
  std::optional<double> lr;
  std::optional<double> beta1, beta2;
  std::optional<double> eps;
  std::optional<double> weight_decay;
};

// Engine::RestoreProgress: where a run stands in another trainer's checkpoint (DeepSpeed's
// global_steps and skipped_steps, its Adam's step, its LR scheduler's position and its fp16 loss
// scaler), for a resume whose weights and moments were written with WriteState.
struct TrainingProgress {
  int64_t global_step = 0;        // steps taken, counting skipped ones
  int64_t skipped_steps = 0;      // of which skipped (fp16 overflow): <= global_step
  int64_t optimizer_step = 0;     // Adam's step count: the next step's bias correction is +1
  int64_t schedule_position = 0;  // the config's LR schedule's steps taken
  // fp16's dynamic loss scaler (DeepSpeed's cur_scale, cur_iter, last_overflow_iter,
  // cur_hysteresis); loss_scale 0 leaves the scaler as the config starts it. Fitted to this
  // engine's fp16 section as a checkpoint's is (static scaling keeps the configured scale).
  double loss_scale = 0;
  int64_t scaler_iteration = 0;
  int64_t scaler_last_overflow = -1;
  int64_t scaler_hysteresis_left = 0;
};

// Engine::OffloadStates: which states leave the device (DeepSpeed's engine.offload_states).
struct OffloadStatesOptions {
  // The kinds whose device-homed blocks move; nullopt: every kind (an empty list: none, only the
  // device copies are dropped). DeepSpeed's OffloadStateTypeEnum names them lp_params
  // (kParam16), hp_params (kMaster32), optim_states (kExpAvg, kExpAvgSq) and lp_grads (kGrad);
  // its contiguous_grad_buffer is the device copies dropped in any case.
  std::optional<std::vector<StateKind>> kinds;
  // Page-lock the host memory they move into (Device::RegisterHost), so the copies back are DMA.
  // That memory is then kept after ReloadStates for the next OffloadStates (Store::SetAside), as
  // DeepSpeed keeps its pinned buffers; false frees it at each reload.
  bool pin_memory = true;
};

struct EngineOptions {
  // The parsed DeepSpeed config (config.h; "auto" values resolved). Read: precision (fp16 / bf16
  // / fp32), optimizer (Adam / AdamW), scheduler, gradient_clipping,
  // gradient_accumulation_steps, prescale_gradients and gradient_predivide_factor (from
  // unacted_keys), zero_optimization (stage, offloads, buffer_count, sub_group_size,
  // overlap_comm, stage3_* keys).
  EngineConfig config;
  // Not owned; must outlive the engine. The communicator's rank and world size are the engine's.
  Device* device = nullptr;
  Communicator* comm = nullptr;
  // Byte budgets per tier (0 for the device: the device's own budget). The engine refuses to
  // start (ResourceExhausted naming the tier) when its placement does not fit them.
  PerTier<uint64_t> budget_bytes{};
  // NVMe: the directories of the swap files (one per SSD). Empty: the config's
  // offload_optimizer.nvme_path / offload_param.nvme_path. The IO backend (io.h) to use for
  // them; null: OpenIoBackend with `io_kind`.
  std::vector<std::string> nvme_paths;
  std::unique_ptr<IoBackend> io;
  IoBackendKind io_kind = IoBackendKind::kAuto;
  // The store's host slab from a PinnedPool: huge pages whatever pin_memory says (a 1 MiB
  // O_DIRECT IO from 4 KiB pages is split in two requests on a virtio disk: store.h,
  // TieredStoreOptions::lock_host_memory), locked and CUDA-registered only when the config's
  // offload_optimizer or offload_param pin_memory asks. False: plain aligned memory.
  bool use_pinned_pool = true;
  // Threads of the CPU optimizer (fused Adam and gradient statistics), the calling thread
  // included. 0: one per CPU this process may run on. Results are the same bits for any count.
  int optimizer_threads = 0;
  // Bound on every wait (a collective, a fetch, an IO). Past it the operation fails with
  // DeadlineExceeded naming it and the engine fails.
  std::chrono::milliseconds timeout{300000};
  // ZeRO++ (zero_quantized_gradients, zero_hpz_partition_size): ranks per node, the hierarchy
  // its sub-communicators follow (node n holds ranks [n * L, (n + 1) * L)). 0: the
  // LOCAL_WORLD_SIZE environment variable (torchrun, `offloadctl launch`), else 1 rank per node.
  // Must divide the world size.
  int ranks_per_node = 0;
  // The optimizer step runs behind the next forward (stage 3 with offload_optimizer cpu or nvme;
  // elsewhere a layout note says it is not applied and Step runs as without). Step returns once
  // the norm, the overflow check and the clipping are agreed and the Adam pipeline has started;
  // Gather(g) waits for group g's update, so the numbers are the same bits as without. What it
  // buys: the forward's params come from the host copies the optimizer has just written instead
  // of being read again from NVMe, and the forward's gathers overlap the optimizer's IO.
  // Trade-off: a failure of the step (an IO error, a checksum, a deadline; named as without)
  // comes back from the next call that waits for it, not from Step, and fails the engine then.
  // GradBuffer (so the backward, and ReduceGradients after it), Step, Save, Load, ReadMaster and
  // Synchronize wait for the whole step first; the Init calls are refused once a step was taken.
  // The step's optimizer timings are reported by the next Step.
  bool overlap_step = false;
  // The optimizer parameter groups GroupSpec::optimizer_group indexes. Empty: one group with the
  // config's hyperparameters. InvalidArgument (naming the group and the field) for an index out
  // of range or a hyperparameter Adam refuses.
  std::vector<OptimizerGroupOptions> optimizer_groups;
};

// The full parameters of one group on the device (Gather). Move-only; give it back with Release.
// A handle destroyed without Release (a trainer's exception unwinding past it, a backward that
// raised) is given back as Release would give it, its error dropped, so Step, Save and Load go
// on: destroying it is a Release, with Release's rules (the trainer's thread; on a GPU, the
// trainer's kernels that read the group complete first). One that outlives its engine gives
// nothing back (the engine's memory is gone with the engine).
class GatheredGroup {
 public:
  GatheredGroup() = default;
  GatheredGroup(GatheredGroup&& other) noexcept;
  GatheredGroup& operator=(GatheredGroup&& other) noexcept;
  ~GatheredGroup();
  size_t group() const { return group_; }
  DType dtype() const { return dtype_; }
  // Device pointer to the group's flat buffer (numel elements of dtype(), then padding).
  const void* data() const { return data_; }
  // Device pointer to parameter `i` of the group (its numel elements, row-major).
  const void* param(size_t i) const;
  size_t numel() const { return numel_; }
  explicit operator bool() const { return data_ != nullptr; }

  struct Owner;  // the engine that gave the handle out, while it lives (engine.cc)

 private:
  friend class Engine;
  void GiveBack() noexcept;  // to its owner, where it has one
  std::shared_ptr<Owner> owner_;
  size_t group_ = 0;
  DType dtype_ = DType::kBF16;
  const void* data_ = nullptr;
  size_t numel_ = 0;
  std::vector<size_t> offsets_;  // per param, elements
  std::shared_ptr<void> hold_;   // keeps the engine's gathered copy alive
};

// Timings of one Step and of the micro-steps since the previous one (nanoseconds).
struct StepTimings {
  uint64_t gather_wait_ns = 0;        // Gather calls: fetch + all-gather waits
  uint64_t gather_fetch_wait_ns = 0;  // of which: blocked on the store for the group's copy
  uint64_t reduce_wait_ns = 0;        // waits for reductions and gradient accumulation
  // Blocked on the store for an accumulator's lease: part of reduce_wait_ns, except where the
  // accumulation runs behind the backward on the engine's own thread (overlap_comm, gradients
  // accumulated on the host): then counted when the accumulation is collected, which may be in
  // the Step that follows.
  uint64_t grad_lease_wait_ns = 0;
  uint64_t optimizer_ns = 0;          // the Adam pipeline (compute + waits for its IO)
  uint64_t optimizer_io_wait_ns = 0;  // of which: waiting for reads and writes
  uint64_t step_ns = 0;               // the whole Step call
  // offload_optimizer.speculative_step: the Adam run during the backward (on its own thread,
  // overlapping it; not part of optimizer_ns), rolled-back work included.
  uint64_t speculative_optimizer_ns = 0;
};

struct StepReport {
  int64_t global_step = 0;  // steps taken, counting skipped ones (DeepSpeed's global_steps)
  bool skipped = false;     // overflow: nothing applied
  double grad_norm = 0;     // global L2 norm of the unscaled, averaged gradients (inf on overflow)
  double loss_scale = 1;    // the scale used by this step
  double lr = 0;            // the learning rate used (of the last applied step when skipped)
  double clip_coefficient = 1;  // >= 1: gradients were divided by it
  // offload_optimizer.speculative_step: this rank's sub-groups whose Adam ran during the backward
  // and was kept, and those whose Adam ran then and was undone (the step was clipped or skipped,
  // or its learning rate was changed after the backward began) and, unless skipped, redone.
  size_t speculated_sub_groups = 0;
  size_t rolled_back_sub_groups = 0;
  StepTimings timings;
};

// offload_optimizer.speculative_step: the next step's mode and, with the key unset, what timing
// the steps both ways measured (the engine probes a few steps each way early on and every few
// hundred steps, and keeps the faster; the bits are the same either way).
struct SpeculationStats {
  bool applies = false;   // the engine has the speculative step (stage 3, optimizer offloaded)
  bool adaptive = false;  // the key unset: timed both ways
  bool next = false;      // the next step speculates (unless the last one was clipped or skipped)
  int probes = 0;         // probes completed
  double on_s = 0, off_s = 0;  // the last probe's median step times, speculating and not
};

struct EngineStats {
  int64_t global_step = 0;
  int64_t skipped_steps = 0;
  StoreStats store;  // bytes moved per tier pair, used / peak / budget per tier
  CommStats comm;    // bytes per collective kind (the communicator over all ranks)
  // ZeRO++: the sub-communicators' bytes. intra: within a node (qgZ's first all-to-all, hpZ's
  // secondary all-gather when the hpZ group lies within a node); inter: across nodes (qgZ's second
  // all-to-all, hpZ groups spanning nodes). Zero without ZeRO++.
  CommStats comm_intra, comm_inter;
  PerTier<uint64_t> peak_bytes{};  // engine-wide peak per tier (store + engine buffers)
  // Every step's StepTimings summed, including the micro-steps of the step in progress (up to
  // now; its step_ns counts once its Step returns), so a caller can time a phase by two Stats()
  // calls. The parts that are waits on the store (gather_fetch_wait_ns, grad_lease_wait_ns)
  // against the rest tell a store- or disk-bound backward from a CPU-bound one.
  StepTimings timings;
  SpeculationStats speculation;
};

// What the engine places where: per tier, bytes of this rank's states and buffers.
struct EngineLayout {
  int stage = 0;
  OffloadDevice offload_optimizer = OffloadDevice::kNone;  // effective
  OffloadDevice offload_param = OffloadDevice::kNone;
  DType dtype = DType::kBF16;
  // The optimizer's gradient shards: fp32, or the working dtype where the reduced gradient is
  // final as it arrives (one rank, one micro-step, the optimizer offloaded: sched::GradStateDType).
  DType grad_dtype = DType::kF32;
  int world_size = 1, rank = 0;
  size_t params = 0;                  // model elements
  size_t sub_groups = 0;              // optimizer sub-groups this rank steps
  // Partial optimizer offload (offload_optimizer.ratio < 1 at stage 3, sched/placement.h): the
  // ratio applied (1: every sub-group offloaded, or no offload), the sub-groups that stay on the
  // device (their states and gradient are in state_bytes[device]) and the share of the
  // sub-groups' elements offloaded (1 when none stays).
  double optimizer_ratio = 1.0;
  size_t device_sub_groups = 0;
  double offloaded_fraction = 1.0;
  PerTier<uint64_t> state_bytes{};    // homes of the states
  PerTier<uint64_t> working_bytes{};  // gathered groups, gradient buffers, pipeline staging
  PerTier<uint64_t> budget_bytes{};
  // Host: the store's cached copies of NVMe-homed blocks that the budget leaves room for beyond
  // states + working (sched::HostCacheBytes). Never refused for; the peak is states + working +
  // cache.
  PerTier<uint64_t> cache_bytes{};
  // ZeRO++ (docs/collectives.md, "ZeRO++"): what runs, and the hpZ secondary copy (16-bit, 1/k of every
  // group, on the device; included in state_bytes[device]).
  bool quantized_weights = false, quantized_gradients = false;
  int hpz_partition_size = 1, ranks_per_node = 1;
  uint64_t hpz_secondary_bytes = 0;
  std::vector<std::string> notes;  // placement rules applied, settings accepted but unused
  std::string ToString() const;    // the table Create prints
};

// Fills elements [begin, end) of parameter `param` of group `group` (row-major) into out[0..).
using ParamFill =
    std::function<void(size_t group, size_t param, size_t begin, size_t end, float* out)>;
// A ParamFill that may fail (Engine::InitFromRank0Fill): an error instead of the values.
using CheckedParamFill =
    std::function<Status(size_t group, size_t param, size_t begin, size_t end, float* out)>;

class Engine {
 public:
  // Validates the model and config, places every state, checks the budgets, registers the blocks
  // and opens the NVMe tier. InvalidArgument names the config path or model field at fault
  // (unsupported optimizer or scheduler type, param offload below stage 3 is only a note);
  // ResourceExhausted names the tier that does not fit, with the bytes needed and the budget.
  static Result<std::unique_ptr<Engine>> Create(const ModelSpec& model, EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const ModelSpec& model() const;
  const EngineLayout& layout() const;
  int rank() const;
  int world_size() const;
  DType dtype() const;  // the working (16-bit or fp32) dtype

  // Sets the initial weights (collective: every rank calls it, before the first step). `fill` is
  // asked for the element ranges this rank stores (stage 3: its shards; below: everything); each
  // rank must fill the same values. Master weights get the fp32 values, working params their
  // rounding. Adam state starts at zero.
  Status InitParameters(const ParamFill& fill);
  // Overwrites the working (16-bit, or fp32) parameters of `groups` with fill's values rounded
  // to the working dtype, at any step (collective: every rank calls it with the same groups and
  // values). The fp32 masters and the Adam state stay as they are, so the next applied Step
  // recomputes these parameters from the masters: what DeepSpeed's GatheredParameters(...,
  // modifier_rank=...) does once its optimizer exists, e.g. a LoRA adapter fused into its base
  // weights before the model is saved. `fill` is asked for the element ranges this rank stores
  // of those groups only, all of them before anything is written: an error from `fill` is
  // returned on its rank, and InvalidArgument naming that rank on the others, with nothing
  // written on any rank (the engine stays usable). A step running behind
  // (overlap_step) is waited for and a speculated one undone first. InvalidArgument for a group
  // out of range; FailedPrecondition while a group is gathered or the engine has failed. Staging:
  // the fp32 values of this rank's pieces of those groups.
  Status WriteParams(std::span<const size_t> groups, const CheckedParamFill& fill);
  // Overwrites one parameter's `kind` (kMaster32, kExpAvg, kExpAvgSq) at any step, every other
  // value kept (collective: every rank calls it with the same group, param and kind, its fill
  // giving the values of the ranges that rank stores): what
  // DeepSpeed's safe_set_full_fp32_param / safe_set_full_optimizer_state do. `fill` is asked for
  // the ranges of parameter `param` of `group` this rank stores, in the parameter's own indices,
  // all of them before anything is written (a failed fill writes nothing on any rank, as
  // WriteParams). kMaster32 also rounds the working params from the new masters (and all-gathers
  // them where stages 1-2 keep replicas), as a step does (DeepSpeed leaves the working params
  // to the next step). A step running behind is waited for and a speculated one undone first.
  // InvalidArgument: group or param out of range, kParam16 or kGrad, a frozen group;
  // FailedPrecondition while a group is gathered, a gradient buffer is out or the engine failed.
  Status WriteOptimizerState(size_t group, size_t param, StateKind kind,
                             const CheckedParamFill& fill);
  // The same from full fp32 tensors: tensors[g][p] points at group g's parameter p (its numel
  // values, row-major). InvalidArgument naming the group or parameter for a wrong group or
  // parameter count or a null tensor.
  Status InitFromFullTensors(const std::vector<std::vector<const float*>>& tensors);
  // [begin, end) of a group of `numel` elements that rank `rank` (0 <= rank < world_size) stores
  // at stage 3: its shard, padding cut off (what InitParameters asks `fill` for there).
  // InvalidArgument when world_size < 1.
  static Result<std::pair<size_t, size_t>> OwnedRange(size_t numel, int world_size, int rank);

  // The staging bound of InitFromRank0 by default: 64 MiB per rank.
  static constexpr uint64_t kInitWindowBytes = 64ull << 20;
  // Initial weights held by rank 0 alone (collective: every rank calls it, before the first
  // step), e.g. loaded from a checkpoint file only rank 0 reads. Rank 0 passes the full fp32
  // tensors, tensors[g][p] = group g's parameter p (its numel values, row-major); every other
  // rank passes {} (what it passes is ignored). The engine sends each rank what it stores (stage
  // 1-3: its shard of every group; stage 0: everything), group by group and sub-group piece by
  // piece through the communicator, in fp32: afterwards every rank's state is bit for bit what
  // InitFromFullTensors with rank 0's tensors gives (master = the values, working params their
  // rounding, Adam state zero). Memory: at most `window_bytes` (rank 0's value counts) of staging
  // per rank (device buffers and rank 0's host packing; at least one element per rank): no staging
  // buffer holds a whole group, let alone the model (the states land in the engine's own blocks,
  // one sub-group lease at a time). The bytes: stage 0 broadcasts the model; stage 1-3 one
  // all-to-all per piece (rank 0's chunks carry the data).
  // Errors: InvalidArgument on rank 0 naming the group or parameter whose tensor has the wrong
  // count of values (its shape says how many), a null tensor, or the wrong number of groups or
  // parameters; on the other ranks InvalidArgument saying rank 0 refused. Nothing is written then
  // and the engine stays usable. A collective that fails or passes EngineOptions::timeout (a dead
  // peer) fails the engine with an error naming InitFromRank0, the group and the element range.
  // FailedPrecondition after the first step or when the engine has failed.
  Status InitFromRank0(const std::vector<std::vector<std::span<const float>>>& tensors,
                       uint64_t window_bytes = kInitWindowBytes);
  // InitFromRank0 with rank 0's values from `fill`, asked for each range as rank 0 sends it
  // (above one rank piece by piece within window_bytes; at one rank a sub-group's range of a
  // parameter at a time): rank 0 never holds the model's fp32 values at once. The other ranks'
  // fill is never called. There are no tensors whose sizes could be checked first: an error from
  // rank 0's fill makes it send zeros for the rest, and once every piece is sent rank 0 returns
  // that error and every other rank InvalidArgument saying rank 0's values failed. The engine
  // stays usable then (its state holds those zeros): initialise again, on every rank. Otherwise
  // as above.
  Status InitFromRank0Fill(const CheckedParamFill& fill, uint64_t window_bytes = kInitWindowBytes);

  // The group's full parameters on the device; blocks until resident and gathered, and prefetches
  // what the recorded trace says comes next. Keep at most a few gathered at once (each costs its
  // full size on the device).
  Result<GatheredGroup> Gather(size_t group);
  void Release(GatheredGroup gathered);
  // Release for a trainer that names the device stream its kernels read the group on (device.h):
  // where orders_caller_streams() and the release frees or reuses memory (not
  // gathers_alias_home()), that memory is rewritten only after the work queued on `caller_stream`
  // so far, ordered on the device, so the trainer need not wait for those kernels first.
  // Elsewhere the stream is ignored (the trainer waits, as for Release above). An error ordering
  // the stream fails the engine and is returned; the group is released all the same.
  Status Release(GatheredGroup gathered, uintptr_t caller_stream);
  // True when Gather's views are the parameters' device-resident home itself: one rank (no qwZ,
  // no hpZ), stage 3 with the parameters on the device, no speculative step. Release then neither
  // frees nor reuses that memory, and nothing writes it before Step, Load or InitParameters, so a
  // trainer on a device with streams of its own need not wait for its kernels that read a group
  // before releasing it (device.h), only before those calls. Fixed at Create.
  bool gathers_alias_home() const;
  // Whether group g is persistent at stage 3 (DeepSpeed's ds_persist): no larger than
  // stage3_param_persistence_threshold elements, in model order while the persistent elements
  // stay within stage3_model_persistence_threshold (sched::PersistentGroups); its gathered copy
  // is kept after Release as far as stage3_max_live_parameters allows. A trainer may
  // keep it gathered between steps (the Python adapter does: its parameters stay whole, as
  // DeepSpeed's persistent ones). False below stage 3 and for g out of range.
  bool persistent(size_t g) const;
  // This rank's swap files (one per nvme_path in use; none without NVMe homes): nvme_files(),
  // what the engine removes when destroyed. A trainer that cannot destroy its engine at its end
  // (several ranks, whose communicator's finalization waits for the others) removes them itself,
  // as the Python adapter does at exit.
  std::vector<std::string> swap_files() const;

  // The device buffer (the group's padded flat size, zeroed, the working dtype) the trainer
  // writes the group's gradients into for this micro-step. The same buffer until
  // ReduceGradients(group). With overlap_comm a trainer may take the next group's buffer before
  // it reduces this one (one held back, so that its host need not wait for its device's queue:
  // device.h); the engine then keeps fewer reductions in flight, so that the gradient buffers
  // alive stay within the working set (sched/placement.h, DeviceWorkingSet).
  // With `caller_stream`, the device stream the trainer writes the buffer on (device.h), where
  // orders_caller_streams(): the zeroing is ordered before that stream's later work instead of
  // being waited for. Elsewhere the stream is ignored.
  Result<void*> GradBuffer(size_t group, std::optional<uintptr_t> caller_stream = std::nullopt);
  // Starts reducing the group's gradient buffer and accumulating it into the fp32 gradient of
  // its sub-groups (asynchronous with overlap_comm; otherwise done on return). Each group once
  // per micro-step. With `caller_stream`, where orders_caller_streams(): the reduction runs after
  // the work queued on that stream so far (the trainer's writes of the buffer), so the trainer
  // need not wait for them first. Elsewhere the stream is ignored.
  Status ReduceGradients(size_t group, std::optional<uintptr_t> caller_stream = std::nullopt);
  // True where GradBuffer and ReduceGradients order a caller's stream on the device: one rank
  // (no qgZ: the reduction is the identity, no collective on a stream of its own) on a device
  // that orders caller streams (Device::orders_caller_streams: CudaDevice). Fixed at Create.
  bool orders_caller_streams() const;
  // Rank 0's `order` on every rank (collective: every rank calls it at the same point). The
  // groups' reductions pair across ranks by their order, so a trainer that reduces each group as
  // its gradients complete pairs different groups where one is unused on some rank this
  // micro-step; reducing in one agreed order (rank 0's, as DDP's buckets) keeps them paired, a
  // group unused on a rank reduced with zeros at its turn. `order` must list every trainable
  // group once: InvalidArgument naming the problem otherwise (nothing exchanged). Step also
  // checks the pairing: ranks that gathered or reduced different groups since the last step
  // fail it (FailedPrecondition; nothing applied).
  Result<std::vector<uint32_t>> AgreeReductionOrder(std::span<const uint32_t> order);

  // Drops the gradients taken since the last Step: every reduction of this accumulation window
  // (the reductions in flight complete first: their collectives pair with the peers') and the
  // gradient buffers still out (the trainer must no longer touch them, on the host or, where
  // streams are ordered, on its streams). The next GradBuffer starts a new window; nothing else
  // changes (step count, loss scale, learning rate). For a backward that raised part way, or a
  // micro-batch the trainer chooses to skip. Every rank must drop the same reductions: with
  // several ranks, call it where every rank does (a backward that raised at the same point on
  // each), else the ranks' reductions no longer pair and the next Step fails naming that.
  Status DiscardGradients();

  // The optimizer step at the accumulation boundary (collective). Waits for outstanding
  // reductions, computes the global norm, skips on overflow, else clips, runs Adam per sub-group
  // and publishes the new params.
  Result<StepReport> Step();

  // Multiply the loss by this before backward: 1 unless fp16, where it is the current loss
  // scale divided by gradient_accumulation_steps, as DeepSpeed's backward scales the loss it has
  // divided (so a 16-bit gradient overflows where DeepSpeed's does); the engine then sums the
  // micro-steps' gradients instead of averaging them.
  double LossScale() const;
  double CurrentLossScale() const;  // the fp16 loss scale itself (StepReport::loss_scale's)
  double lr() const;         // the learning rate the next step will use (optimizer group 0)
  // The learning rate of each optimizer group for the next step, as lr() for group 0.
  std::vector<double> lrs() const;
  // Sets the learning rate of every optimizer group (one value each, finite and >= 0) for this
  // and every later step until the next call: a trainer's own scheduler drives the engine this
  // way, and the config's schedule no longer applies. An empty list hands the lrs back to the
  // config's schedule (the groups' own lrs without one), at its current position: a value a
  // script wrote for one step, as DeepSpeed's scheduler overwrites it after that step.
  // InvalidArgument for another count or a bad value (nothing changed).
  Status SetLearningRates(std::span<const double> lrs);
  // The config's LR schedule's position: the number of schedule steps taken so far, from which
  // the next step's lr and betas follow (0 at the start; each applied step adds one). DeepSpeed's
  // scheduler object counts the same (its last_batch_iteration is this minus one), and a
  // script may move it as it moves that object: SetSchedulePosition(k) makes the next step use
  // the schedule's values after k steps, every later step counting on from there (a checkpoint
  // keeps it). InvalidArgument for k < 0.
  int64_t schedule_position() const;
  Status SetSchedulePosition(int64_t position);
  // Each optimizer group's (beta1, beta2) for the next step: the group's, or the config's
  // schedule's where it sets them (OneCycle with cycle_momentum, in every group).
  std::vector<std::pair<double, double>> betas() const;
  // Sets hyperparameters of every optimizer group (one entry each) for this and every later step:
  // what a trainer's scheduler or loop writes into torch's param_groups (torch's OneCycleLR and
  // CyclicLR cycle betas[0] with the lr). A field left unset keeps its value. lr, when given for
  // every group, is SetLearningRates; betas given for a group replace the schedule's (OneCycle's
  // cycle_momentum) for it. InvalidArgument, nothing changed, for the wrong count, lr given for
  // only some groups, beta1 without beta2 or a value Adam refuses (naming the group and field).
  Status SetHyperparameters(std::span<const OptimizerGroupOptions> groups);
  // Hands every group's betas back to the config's schedule where it sets them (OneCycle with
  // cycle_momentum) after SetHyperparameters gave some their own: betas a script wrote for one
  // step, as DeepSpeed's scheduler overwrites them after that step. Elsewhere the groups keep the
  // betas last set.
  void UseScheduleBetas();
  // Sets gradient_accumulation_steps for the steps that follow (DeepSpeed's
  // set_train_batch_size: the micro-batch stays, the accumulation changes): each reduced
  // gradient is divided by the new count, the bits those of an engine configured with it.
  // Between steps only: FailedPrecondition once a gradient of the next step was taken or
  // reduced. FailedPrecondition too where the gradients' storage depends on the count: at one
  // rank, accumulation 1, 16-bit working params and the optimizer offloaded, each gradient is
  // kept as reduced, in 16 bits (sched::GradStateDType); such a run starts at more than 1 to
  // change it later. InvalidArgument for a count < 1 or > 2^30. Nothing changes on an error.
  Status SetGradientAccumulationSteps(int64_t steps);
  int64_t gradient_accumulation_steps() const;
  int64_t global_step() const;
  EngineStats Stats() const;
  // OK, or the first error that failed the engine (an overlapped step's failure once a call has
  // waited for it).
  Status health() const;
  // Waits for the optimizer step running behind (EngineOptions::overlap_step; OK at once when
  // none runs) and returns its error, which fails the engine, or the engine's failure.
  Status Synchronize();
  // Brings the engine to rest between steps: waits as Synchronize, then writes every dirty copy
  // of a block back to its home and waits for every operation queued on the store (prefetches
  // included). On OK the engine has no IO in flight and starts none until the next call, so a
  // tool may measure the disk under the swap files meanwhile (`offloadctl bench engine
  // --disk-reference-paired-split` rewrites their bytes unchanged). Costs nothing after a Step but
  // the wait: Step leaves no dirty NVMe-homed copy, unless the host budget caches every
  // NVMe-homed block (then the engine writes none home, and Flush writes them all).
  // FailedPrecondition while gathered groups are held; a write-back's error (naming the block)
  // fails the engine.
  Status Flush();
  // Lends the device to other work between steps (DeepSpeed's offload_states: an RL trainer's
  // generation phase, an evaluation in another framework). Every device-homed block of the
  // chosen kinds moves into host memory outside the tiers' budgets (Store::SetAside), and every
  // device copy the engine keeps is dropped: kept gathered copies, hpZ slices, spare gradient
  // buffers, the store's cached copies of params homed on the host or NVMe. Their device memory
  // is then free (Stats: the device tier's used bytes and the device's own), and what the device
  // caches of it goes back to the system (Device::ReleaseCachedMemory). Waits for a step
  // running behind and for the store's queued operations first. Until ReloadStates the calls that
  // use the states (Gather, GradBuffer, ReduceGradients, Step, Save, Load, ReadMaster, the Init
  // calls, WriteParams) fail FailedPrecondition naming OffloadStates; the engine stays usable.
  // A second call moves the kinds the first left. FailedPrecondition while gathered groups are
  // held or gradient buffers are out (mid-backward); a copy that fails (a device fault) fails
  // the engine.
  Status OffloadStates(const OffloadStatesOptions& options = {});
  // Brings back everything OffloadStates moved, bit for bit. ResourceExhausted naming the block
  // and the tier when the device has no room for it (its other work still holds the memory):
  // the blocks that fit are back, the rest stay offloaded, and another call may finish.
  Status ReloadStates();
  // True from OffloadStates until a ReloadStates that brought everything back.
  bool states_offloaded() const;
  // This rank's NVMe swap files, one per nvme_path (empty without an NVMe tier). The engine owns
  // them: it removes them when destroyed.
  std::vector<std::string> nvme_files() const;

  // The group's fp32 master weights, numel values (collective). For tests and export.
  Status ReadMaster(size_t group, std::span<float> out);
  // The group's optimizer state `kind` whole, numel fp32 values (collective, as ReadMaster):
  // kMaster32 (ReadMaster), kExpAvg or kExpAvgSq (Adam's moments as of the last step; zeros
  // before the first), or kGrad: the gradient accumulated since the last Step, reduced over the
  // ranks and divided by gradient_accumulation_steps, not yet clipped and, with fp16, still
  // multiplied by the loss scale (what DeepSpeed's safe_get_full_grad returns between backward
  // and step); it waits for the reductions in flight, and is FailedPrecondition while a
  // gradient buffer is out or when no ReduceGradients came since the last Step.
  // InvalidArgument for kParam16, or for the moments or gradient of a frozen group (it has
  // none). What DeepSpeed's safe_get_full_optimizer_state / safe_get_full_grad read.
  Status ReadOptimizerState(size_t group, StateKind kind, std::span<float> out);

  // Checkpoints (docs/checkpoints.md; format and protocol in core/zero/checkpoint_format.h).
  // Both are collective (every rank calls them with the same arguments) and need no gathered
  // group out and no gradient buffer taken (FailedPrecondition otherwise, nothing written or
  // changed). Gradients are never saved. Save inside an accumulation window (ReduceGradients
  // since the last Step) writes the state of the last Step, as DeepSpeed's save_checkpoint, and
  // leaves the window's gradients for the Step that applies them (it waits for the reductions in
  // flight and undoes an optimizer step speculated from them, which that Step redoes). Load is
  // allowed only at an accumulation boundary: after Step (or before the first micro-step), with
  // no ReduceGradients since; otherwise FailedPrecondition ("mid-accumulation").
  //
  // Save writes every other state (working params, fp32 master, Adam m and v wherever they live,
  // the step counters, loss-scaler and LR-schedule position, the effective config, the model
  // spec, world size and stage) and `client_state` (the trainer's opaque bytes: data position,
  // RNG) to `<dir>/<tag>/`, crash-consistently: written into `<tag>.tmp/`, fsynced, renamed, then
  // `<dir>/latest` replaced atomically. A crash leaves the previous checkpoint as `latest` and
  // never a partial one that loads. Files go through the IO layer (O_DIRECT chunks of
  // aio.block_size, aio.queue_depth in flight); NVMe-homed state streams through host memory in a
  // bounded window (the host budget holds). InvalidArgument: empty tag, or one with '/', or ending
  // ".tmp"; FailedPrecondition: a group gathered or a gradient buffer out. A tag that exists
  // already is replaced in one step (renameat2 RENAME_EXCHANGE, docs/checkpoints.md): a crash
  // leaves the old checkpoint or the new one under it, never neither and never a mix; IOError
  // naming the file; Aborted: another rank failed (its own result says why). A failed collective
  // fails the engine. Retention as the config's `checkpoint` section says (SaveOptionsFromConfig:
  // keep_last, recycle_files; by default every checkpoint is kept).
  Status Save(const std::string& dir, const std::string& tag,
              std::span<const uint8_t> client_state = {});
  // The same, with retention and file recycling (include/strata/checkpoint.h SaveOptions). When
  // the save is committed but removing an older checkpoint fails, IOError says so (the new
  // checkpoint is `latest` and loads). SaveOptions::exclude_frozen leaves the frozen groups out
  // (their values must then come from elsewhere when the checkpoint is loaded:
  // LoadOptions::keep_excluded); the ranks must agree on it (InvalidArgument, nothing saved).
  Status Save(const std::string& dir, const std::string& tag, const SaveOptions& options,
              std::span<const uint8_t> client_state = {});
  // Restores the state of `<dir>/<tag>` (tag "" = the one `<dir>/latest` names) into this
  // engine; training then continues bit for bit as the run that saved it would have. Checks
  // first (manifest, every file's presence and size, rank file headers; at another layout also
  // every file's XXH3, spread over the ranks), changing nothing when that fails: NotFound /
  // Corruption naming the first missing or damaged file; FailedPrecondition for another format
  // version, a different model spec (the differing names and shapes listed), or another
  // precision (naming both; `offloadctl ckpt reshard --precision` converts a checkpoint).
  // At the same world size and shards each rank checks its own file's XXH3 as it
  // streams it: a file damaged inside is Corruption naming it and fails the engine. Another world
  // size or ZeRO stage (or placement) is fine: the checkpoint holds global element ranges, and each
  // rank reads the ranges its layout needs from whichever ranks' files hold them (resharding on
  // load; exact: every saved bit is restored). An IO error after verification fails the engine (its
  // blocks are then half loaded). `client_state` (optional) receives the saved blob (empty if
  // none).
  // `options` (checkpoint.h LoadOptions) may leave the Adam state or the LR schedule fresh; a
  // checkpoint without its frozen groups (SaveOptions::exclude_frozen) loads only with
  // keep_excluded (FailedPrecondition naming the groups otherwise), keeping this engine's values
  // for them.
  Status Load(const std::string& dir, const std::string& tag = "",
              std::vector<uint8_t>* client_state = nullptr, const LoadOptions& options = {});
  // Sets the step counters, the LR schedule's position and the loss scaler as `progress` says:
  // the rest of a resume from a checkpoint another trainer wrote, after WriteState put its fp32
  // masters and Adam moments in place (python/strata/utils/deepspeed_checkpoint.py). Training
  // then continues as that trainer's would: the next Step is global step global_step + 1 and Adam's
  // step optimizer_step + 1. Not collective, but every rank must set the same progress. At an
  // accumulation boundary only, as Load (FailedPrecondition otherwise); InvalidArgument, nothing
  // changed, for a negative count, skipped_steps > global_step, or a loss scale that is not
  // finite. optimizer_step may exceed the steps taken (DeepSpeed's fp16/bf16 optimizer without
  // ZeRO steps Adam once at its construction).
  Status RestoreProgress(const TrainingProgress& progress);

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  // InitFromRank0 and InitFromRank0Fill: rank 0's verdict on its tensors (their sizes), then the
  // protocol with rank 0's values from `fill`.
  Status InitFromRank0Impl(const Status& verdict, const CheckedParamFill& fill,
                           uint64_t window_bytes);
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<GatheredGroup::Owner> owner_;  // the handles Gather gives out point here
};

}  // namespace strata
