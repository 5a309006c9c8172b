// The engine's internals (include/strata/engine.h), shared by engine.cc (create, layout),
// engine_init.cc (initial weights, read-back), engine_grad.cc (gather, gradient reduction) and
// engine_step.cc (the optimizer step).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/store/gather_scheduler.h"
#include "core/zero/loss_scaler.h"
#include "core/zero/lr_schedule.h"
#include "core/zero/serial_worker.h"
#include "core/zero/zero_collectives.h"
#include "kernels/adam.h"
#include "kernels/grad_stats.h"
#include "kernels/pool.h"
#include "sched/placement.h"
#include "sched/speculation_governor.h"
#include "sched/zero_partition.h"
#include "strata/engine.h"

namespace strata {

namespace zero {

// Elements each shard is padded to: fp32 shards are then multiples of 512 bytes (a whole number
// of O_DIRECT sectors inside any buffer), 16-bit ones of 256.
inline constexpr size_t kShardAlignElems = 128;

using Clock = std::chrono::steady_clock;

// Nanoseconds since t0 (the step timings).
inline uint64_t Since(Clock::time_point t0) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

// Adds `t` to `to`, field by field: the totals at each Step, and the step in progress in
// Engine::Stats (EngineStats::timings).
inline void AddTimings(const StepTimings& t, StepTimings* to) {
  to->gather_wait_ns += t.gather_wait_ns;
  to->gather_fetch_wait_ns += t.gather_fetch_wait_ns;
  to->reduce_wait_ns += t.reduce_wait_ns;
  to->grad_lease_wait_ns += t.grad_lease_wait_ns;
  to->optimizer_ns += t.optimizer_ns;
  to->optimizer_io_wait_ns += t.optimizer_io_wait_ns;
  to->step_ns += t.step_ns;
  to->speculative_optimizer_ns += t.speculative_optimizer_ns;
}

// One optimizer sub-group: a piece of one rank's shard of one group, with its four fp32 blocks.
struct SubGroup {
  size_t group = 0;
  int owner = 0;      // the rank whose shard this piece is (stage 0: any rank; else this rank)
  size_t offset = 0;  // elements into the owner's shard of the group
  size_t elems = 0;
  BlockId master = 0, exp_avg = 0, exp_avg_sq = 0, grad = 0;
  // Partial offload (offload_optimizer.ratio < 1): the four blocks stay on the device
  // (sched::DeviceResidentSubGroups); Impl::HomeOf gives each block's home.
  bool on_device = false;
  // Gradient statistics of the accumulated gradient, computed when it was last completed; or
  // still being computed by the device's kernels (Impl::CollectDeviceStats reads them back).
  bool stats_valid = false;
  bool stats_on_device = false;
  double sum_sq = 0;
  bool nonfinite = false;
};

// A stage-3 gathered copy of a group (shared by the engine's cache and the trainer's handle).
// At world size 1 without qwZ / hpZ the shard is the whole group:
// the trainer's handle then reads the gather scheduler's device copy itself (`shard`, handed
// back to the scheduler on Release; never kept in GroupState::cached: the scheduler's own
// keep / evict policy decides instead) and `buffer` stays empty.
struct GatheredCopy {
  DeviceBuffer buffer;
  std::optional<Lease> shard;
};

// What accumulating one reduced group produces, per sub-group of the group (in
// GroupState::sub_groups order); the engine's thread applies it (FinishAccumulate).
struct Accumulated {
  std::vector<std::optional<kernels::GradStats>> stats;  // the final gradient's, this rank's
  std::vector<Ticket> written;  // write-backs of completed NVMe-homed gradients
  uint64_t lease_wait_ns = 0;
};

// A reduction in flight: the group's gradient buffer and the reduced shard, then its
// accumulation into the fp32 gradients (started once the reduction has completed).
struct PendingReduce {
  size_t group = 0;
  DeviceBuffer full;   // the trainer's gradients; stage 0: then the all-gathered reduction
  DeviceBuffer shard;  // the reduce-scatter output (this rank's shard); empty at world size 1
  std::vector<CommHandle> handles;
  // qgZ: the quantized reduce-scatter running on its own thread (after the previous one).
  std::shared_future<Status> async;
  bool first = false, last = false;  // first / last micro-step of the accumulation window
  // Set when the accumulation started: its result (on the accumulate thread with
  // overlap_comm, else done already) and what it produced.
  std::shared_future<Status> accumulating;
  std::shared_ptr<Accumulated> accumulated;
  bool Ready() const;
  Status Wait(std::chrono::steady_clock::time_point deadline) const;
};

// Host memory a device's bytes are copied into before the CPU computes on them: one buffer,
// allocated at the first use at the size asked then (the largest it will be asked for), and
// page-locked with the device (Device::RegisterHost) when `pin`, so the copies are DMA rather
// than the driver's bounce through pageable memory; a later larger request reallocates. Used by
// one thread at a time (`mu`, held by the user).
class HostStaging {
 public:
  HostStaging() = default;
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;
  ~HostStaging() { Reset(); }
  // REQUIRES: mu held; `device` outlives this object.
  Result<uint8_t*> Get(Device* device, size_t bytes, bool pin) {
    if (bytes <= size_) return data_.get();
    Reset();
    const size_t rounded = (bytes + 4095) / 4096 * 4096;
    data_.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, rounded)));
    if (!data_)
      return Status::ResourceExhausted("host staging: " + std::to_string(rounded) + " bytes");
    size_ = rounded;
    if (pin && device->RegisterHost(data_.get(), size_).ok()) device_ = device;
    return data_.get();
  }
  bool pinned() const { return device_ != nullptr; }
  std::mutex mu;

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  void Reset() {
    if (device_ != nullptr) device_->UnregisterHost(data_.get()).IgnoreError();
    device_ = nullptr;
    data_.reset();
    size_ = 0;
  }
  std::unique_ptr<uint8_t[], Free> data_;
  size_t size_ = 0;
  Device* device_ = nullptr;  // set while data_ is registered with it
};

struct GroupState {
  size_t numel = 0;
  sched::GroupShard shard;
  std::vector<size_t> param_offsets;
  BlockId param = 0;                     // stage 3: this rank's shard; else the full group
  std::vector<size_t> sub_groups;        // indices into Impl::subs that this rank steps
  DeviceBuffer grad;                     // from GradBuffer until ReduceGradients
  int reductions = 0;                    // in the current accumulation window
  std::shared_ptr<GatheredCopy> cached;  // stage 3: kept after Release (persistent / reuse)
  // hpZ: this rank's slice (1/k of the padded group, 16-bit) of the group as the step's first
  // (global) all-gather delivered it; valid while secondary_epoch == Impl::gather_epoch (the same
  // step: a Step or a checkpoint Load comes between epochs).
  DeviceBuffer secondary;
  int64_t secondary_epoch = -1;
  int gathered = 0;  // Gather handles of this group not yet released
  // A frozen group whose values are no longer its initial ones (WriteParams; a Load of a
  // checkpoint that says so): a Save with exclude_frozen keeps it (its values exist nowhere else).
  bool frozen_changed = false;
  // A frozen group: this rank's part of the fingerprint of its initial values
  // (ckpt::FrozenFingerprint over the pieces it initialised), and, where a checkpoint gave the
  // values instead, that checkpoint's fingerprint of them (0: this rank's parts count).
  uint64_t frozen_print_part = 0;
  uint64_t frozen_print_loaded = 0;
  bool frozen_print_unknown = false;  // loaded from a checkpoint without its fingerprint
};

// ZeRO++ (issue 14): the settings and the sub-communicators (owned; null where unused).
struct ZppState {
  bool qwz = false;                     // zero_quantized_weights
  bool qgz = false;                     // zero_quantized_gradients
  int hpz = 1;                          // zero_hpz_partition_size (1: off)
  int local = 1;                        // ranks per node (L)
  int nodes = 1;                        // world / L
  std::unique_ptr<Communicator> node;   // qgZ: the L ranks of this rank's node
  std::unique_ptr<Communicator> cross;  // qgZ: the ranks with this rank's local index
  std::unique_ptr<Communicator> group;  // hpZ: the k ranks of this rank's hpZ group
  bool group_is_intra = true;           // the hpZ group lies within one node
  bool any() const { return qwz || qgz || hpz > 1; }
  // hpZ's communicator: its own group, or the node communicator when the group is the node.
  Communicator* hpz_comm() const;
};

// EngineOptions::overlap_step: the Adam pipeline of the last Step, running on its own thread
// behind the next forward. The trainer's thread waits for a group's update (WaitForUpdate) or
// for all of it (JoinDeferredStep); nothing else of the engine is shared with the job while it
// runs (it reads the sub-groups and the param block ids, which no caller changes meanwhile).
// speculative_step's work still stepping the backward's last groups when an overlap_step Step
// keeps it: handed to the DeferredStep, which waits for it before stepping the rest.
struct SpeculationTail {
  SpeculationTail() = default;
  SpeculationTail(SpeculationTail&&) = default;
  SpeculationTail& operator=(SpeculationTail&&) = delete;
  ~SpeculationTail() {  // a Step that failed before launching the job still waits for the work
    if (done.valid()) done.wait();
  }
  std::shared_future<Status> done;  // the last job posted to the speculation's worker
  std::vector<size_t> groups;       // the groups it was handed (all of their offloaded sub-groups)
};

struct DeferredStep {
  explicit DeferredStep(size_t groups) : updated(groups) {}
  std::vector<std::atomic<bool>> updated;  // per group: all its sub-groups stepped (set under mu)
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;  // guarded by mu
  Status status;          // guarded by mu; the job's result once finished
  StepTimings timings;    // the job's; read after the join
  std::thread thread;
};

// offload_optimizer.speculative_step (engine_speculate.cc): the Adam of each group whose
// gradient is final, run during the backward on a thread of its own (a SerialWorker) with the
// coefficients of an unclipped, applied step, from copies kept to undo it. The trainer's thread
// queues groups and posts a job per group; a job steps every group queued by then through one
// pipeline (so the NVMe reads of groups queued meanwhile overlap), which leaves the jobs posted
// for those groups nothing to do. The trainer's thread owns everything but the shared part
// below; the jobs read the sub-groups, the param block ids and `offset` of what they were handed
// (written before the hand-over, under mu).
struct Speculation {
  static constexpr uint64_t kNone = ~uint64_t{0};
  explicit Speculation(std::optional<bool> configured) : governor(configured) {}
  uint64_t buffer_bytes = 0;         // the bound of the rollback copies (the layout's)
  std::unique_ptr<uint8_t[]> arena;  // buffer_bytes, made at Create
  // This step (the trainer's thread):
  bool open = false;       // groups may still be queued (reset by every Step)
  bool engaged = false;    // the coefficients are fixed and a group was queued
  bool skip_next = false;  // the last step was clipped or skipped: this one does not speculate
  // Whether a step speculates at all: the key, or (unset) timed both ways. Fed each step's time,
  // from one Step's return to the next (GovernSpeculation).
  sched::SpeculationGovernor governor;
  std::optional<std::chrono::steady_clock::time_point> last_step_end;
  bool behind = false;  // its worker went behind the next forward (SpeculationTail): the
                        // per-step state is reset once the deferred step has waited for it
  float grad_scale = 1;
  std::vector<kernels::AdamHyper> hyper;  // per optimizer group, grad_scale folded in
  uint64_t used = 0;                      // arena bytes handed out
  std::vector<uint64_t> offset;           // per sub-group: its copy in the arena, or kNone
  std::vector<size_t> handed;             // sub-groups queued, in order
  std::vector<uint8_t> group_queued;      // per group (read by the prefetcher's held rule)
  std::vector<uint8_t> final_pending;     // per group: final while gathered (queued at Release)
  size_t cancelled = 0;  // sub-groups undone by CancelSpeculation since the last Step
  // The last job posted this step (jobs run in order: when it is done, all are); invalid when
  // none is outstanding.
  std::shared_future<Status> posted;
  // Shared with the jobs:
  std::mutex mu;
  std::deque<size_t> queue;  // groups to step
  bool validated = false;    // Step kept the work: the groups not yet begun step without copies
  Status status;             // the jobs' first error
  StepTimings timings;       // the jobs' (optimizer_ns)
  // Last: destroyed first, while what its jobs use still exists.
  SerialWorker worker;
};

// Copies n elements of each of `count` arrays (element sizes `widths`) from `from[i]` to `to[i]`
// on the pool's threads, a tile of every array at a time: the copies are memory-bound, and one
// thread moves a 1B-param sub-group's 14 GB at a fraction of the machine's bandwidth. (The
// speculation's rollback copies; a 16-bit gradient's copy into its block.)
void PooledCopy(kernels::KernelPool& pool, size_t count, uint8_t* const* to,
                const uint8_t* const* from, const size_t* widths, size_t n);

}  // namespace zero

struct Engine::Impl {
  ModelSpec model;
  EngineOptions opt;
  EngineLayout layout;
  sched::StatePlacement placement;
  sched::PartitionPlan partition;
  DType dtype = DType::kBF16;
  size_t elt = 2;
  int rank = 0, world = 1;
  int gas = 1;             // gradient_accumulation_steps
  // The optimizer's gradient shards (sched::GradStateDType): fp32, or the working dtype where the
  // reduced gradient is final as it arrives (the accumulation is then a copy).
  DType grad_dtype = DType::kF32;
  bool predivide = false;  // ReduceOptions::predivide
  float reduce_scale = 1;  // the averaging over ranks (1 with predivide, else 1 / world)
  // Multiplies the reduced gradient: reduce_scale / gas, or reduce_scale alone with fp16, whose
  // loss scale takes the 1 / gas (LossScaleDividesGas).
  float post_scale = 1;
  // fp16: the averaging over micro-steps is in the loss scale the backward multiplies by
  // (Engine::LossScale is the scale / gas), as DeepSpeed's backward divides the loss by
  // gradient_accumulation_steps before scaling it, so that a 16-bit gradient overflows where
  // DeepSpeed's does; the micro-steps' gradients are then summed.
  bool LossScaleDividesGas() const { return dtype == DType::kF16; }
  double clip = 0;         // gradient_clipping
  bool overlap_comm = false;
  bool overlap_step = false;  // EngineOptions::overlap_step, where it applies
  size_t sub_group_elems = 0;
  uint32_t pipeline_buffers = 4;
  uint64_t persistence_elems = 0, reuse_distance_elems = 0, max_live_elems = 0;
  uint64_t model_persistence_elems = UINT64_MAX;
  // Groups kept whole on every rank (sched::PersistentGroups, set with the partition).
  std::vector<bool> persistent;
  // Per optimizer group (GroupSpec::optimizer_group): the hyperparameters (a step's lr, step
  // count and gradient scale are StepHyper's), the group's own lr (OptimizerGroupOptions::lr),
  // SetLearningRates' values (empty until called) and whether SetHyperparameters gave the group
  // its betas (then the schedule's, OneCycle's cycle_momentum, no longer apply to it).
  std::vector<kernels::AdamHyper> hyper;
  std::vector<std::optional<double>> own_lr;
  std::vector<double> client_lrs;
  std::vector<bool> client_betas;
  std::optional<zero::LossScaler> scaler;
  std::optional<zero::LrSchedule> schedule;

  std::unique_ptr<kernels::KernelPool> pool;  // the CPU optimizer's threads
  std::unique_ptr<Store> store;
  std::unique_ptr<store::GatherScheduler> gather;  // stage 3
  std::vector<zero::GroupState> groups;
  std::vector<zero::SubGroup> subs;
  // Frozen groups (GroupSpec::trainable false): their shards cut as sub-groups would be, with no
  // blocks; what the initialisation writes into their params.
  std::vector<zero::SubGroup> frozen_pieces;
  std::deque<zero::PendingReduce> pending;
  std::shared_future<Status> last_qgz;  // the latest qgZ reduction started (they run in order)
  // overlap_comm: the accumulations the CPU runs (AccumulatesBehind), in order.
  // Declared after the store and the pool it uses, so it is joined before they go.
  std::unique_ptr<zero::SerialWorker> accumulator;
  DeviceBuffer exchange;  // world * 4 words: AllGatherWords' buffer
  // Device kernels: per sub-group, [the overflow flag][its chunk sums], from stats_word[si]
  // (8-byte words); the sub-groups whose sums are queued and not yet read back.
  DeviceBuffer device_stats;
  std::vector<size_t> stats_word;
  std::vector<size_t> stats_queued;
  zero::ZppState zpp;

  int64_t global_step = 0, skipped_steps = 0, applied_steps = 0;
  // Applied steps before the Adam state, and the LR schedule, (re)started (LoadOptions): Adam's
  // step is applied_steps - adam_step_base + 1, the schedule's applied_steps - lr_step_base.
  int64_t adam_step_base = 0, lr_step_base = 0;
  double last_lr = 0;
  bool in_step = false;      // a Gather since the last Step began the trace's step
  int64_t gather_epoch = 0;  // counts the steps in which groups were gathered (hpZ)
  int outstanding_gathers = 0;
  int grad_buffers_out = 0;  // GradBuffer taken, ReduceGradients not yet called
  // The sequence of group collectives (gathers, reductions) this rank started since the last
  // Step, hashed (TraceCollective); Step's exchange compares it across ranks (ExchangeStats).
  static constexpr uint64_t kCollectiveTraceSeed = 1469598103934665603ull;  // FNV-1a's basis
  uint64_t collective_trace = kCollectiveTraceSeed;
  // Gradient buffers kept for the next GradBuffer where the engine orders caller streams (one
  // rank on CUDA): each the largest trainable group's size (`grad_buffer_bytes`), reused in the
  // kernels' stream order, so the backward allocates nothing after the first buffers (on CUDA an
  // allocation waits on the host for the device's frees). Alive ones, these included, at most
  // `grad_buffer_cap` (sched::OneRankGradBuffers, the device working set's count).
  std::vector<DeviceBuffer> spare_grads;
  uint64_t grad_buffer_bytes = 0;
  uint64_t grad_buffer_cap = 1;
  // A device the host cannot address, gradients accumulated on the host: each sub-group's
  // reduced gradient is copied here first, in pieces through two halves (AccumulateStaged; within
  // the host working set's group-sized item); page-locked with pin_memory (`pin_host`).
  zero::HostStaging grad_staging;
  bool pin_host = false;
  // The store's host blocks are page-locked for the device's copies (Store::host_page_locked):
  // a device copy may land in them directly.
  bool host_blocks_locked = false;
  uint64_t largest_sub_elems = 0;  // the largest optimizer sub-group: sizes grad_staging
  uint64_t cached_elems = 0;
  // Drops every gathered copy kept after its Release (GroupState::cached): after the params
  // changed (Step, Load, WriteParams), or to make room on the device.
  void DropKeptCopies() {
    for (zero::GroupState& gs : groups) gs.cached.reset();
    cached_elems = 0;
  }
  // OffloadStates: the blocks set aside in host memory (Store::SetAside) until ReloadStates.
  std::vector<BlockId> aside_blocks;
  Status failed;                                 // the first error that failed the engine
  std::atomic<bool> copy_overran{false};         // CopyOverran (set on any thread)
  std::vector<Ticket> grad_write_behind;         // CheckGradWriteBehind; one per sub-group at most
  // The host budget caches every NVMe-homed block (CheckBudgets): the engine writes none of
  // them home (not the step's state, not a finished gradient, not a rollback), as nothing will
  // need their room. Each stays newest in host memory; the store writes one home only if it must
  // evict it after all, and Flush writes them all.
  bool nvme_state_cached = false;
  std::unique_ptr<zero::DeferredStep> deferred;  // overlap_step: the step running behind
  std::unique_ptr<zero::Speculation> spec;       // speculative_step, where it applies
  StepTimings timings;                           // since the last Step
  EngineStats totals;

  // --- helpers (engine.cc) ---
  std::chrono::nanoseconds timeout() const { return opt.timeout; }
  std::chrono::steady_clock::time_point deadline() const {
    return std::chrono::steady_clock::now() + opt.timeout;
  }
  // OK, or FailedPrecondition quoting the error that failed the engine.
  // Also FailedPrecondition while the states are offloaded (OffloadStates): the check of every
  // call that uses them.
  Status CheckHealthy() const;
  // OK, or FailedPrecondition "<op>: group '<name>' has a gradient buffer <why>" for the first
  // group whose gradient buffer is out (GradBuffer given, ReduceGradients not yet called).
  Status CheckNoGradBufferOut(const std::string& op, const char* why) const;
  // Records `st` as the engine's failure (the first one wins), aborts the communicator; returns
  // `st` for chaining.
  Status Fail(Status st);
  // The home of sub-group s's block of `kind` (its own: partial offload keeps some on the device).
  Tier HomeOf(const zero::SubGroup& s, StateKind kind) const {
    return placement.SubGroupHome(kind, s.on_device);
  }
  // Where the CPU computes on (or copies) a state whose home is `home`: host memory it can
  // address. Device-resident state that the device's kernels compute: DeviceKernelsFor.
  Tier ComputeTier(Tier home) const;
  // Blocking copies through the device's streams (host <-> device). A copy may still be queued
  // when the wait for it gives up (DeadlineExceeded after opt.timeout: a device stream held up
  // behind a collective that never comes, or a hung kernel), and then moves its bytes later.
  // CopySync is for host memory the caller frees on return: up to 1 MiB it copies through host
  // memory of its own, which the copy's completion keeps alive; a larger one is CopyDirect's
  // (the callers' large buffers are pageable vectors, which CUDA stages or copies before
  // cudaMemcpyAsync returns). CopyDirect is for host memory the engine holds until it is
  // destroyed (store blocks, the staging buffers): the copy uses it directly, and a copy past its
  // deadline marks the engine (CopyOverran).
  Status CopySync(CopyDir dir, void* dst, const void* src, uint64_t bytes);
  Status CopyDirect(CopyDir dir, void* dst, const void* src, uint64_t bytes);
  // A copy into or out of engine-held host memory is past its deadline: sets copy_overran
  // (any thread; returns `st`, which fails the engine where the trainer's thread sees it), so
  // that no later copy uses that memory (CheckNoCopyOverran) and ~Engine waits for the device's
  // copies before the memory goes.
  Status CopyOverran(Status st);
  // FailedPrecondition once copy_overran is set.
  Status CheckNoCopyOverran() const;
  Status ZeroDevice(void* ptr, uint64_t bytes);
  // Every rank's 32-bit words (the same count on each), rank-major, through one all-gather (world
  // 1: `mine` alone); four words or fewer go through `exchange`, more through a buffer of their
  // own. Collective. A failed collective is returned as is: the caller names it.
  Result<std::vector<uint32_t>> AllGatherWords(std::span<const uint32_t> mine);
  Result<std::vector<uint32_t>> AllGatherWords(const std::array<uint32_t, 4>& mine) {
    return AllGatherWords(std::span<const uint32_t>(mine));
  }
  // Every frozen group's fingerprint (ckpt::FrozenFingerprint of its values when they are the
  // ones it was initialised with or loaded as such; 0 for trainable or changed groups, or when
  // unknown): collective where the groups' initial values are spread over the ranks.
  Result<std::vector<uint64_t>> FrozenFingerprints();
  // A collective in which every rank says whether its part of `what` succeeded (Create's last
  // step, WriteParams' values): -1 when all did, else the first rank that did not.
  Result<int> FirstFailedRank(bool ok, std::string_view what);
  // Create's first collective: every rank's model and training config against rank 0's (a
  // fingerprint of each), so that ranks started with another model, stage, precision, batch,
  // clipping, optimizer or schedule are refused at once, naming what differs, instead of
  // pairing collectives that do not match (a hang until the timeout) or stepping their own
  // shards with their own lr. The offload sections, paths and IO settings may differ per rank.
  Status AgreeOnSetup(const EngineConfig& c, const std::vector<OptimizerGroupOptions>& groups);
  // Element range in the group's full (padded) buffer of sub-group s.
  size_t FullOffset(const zero::SubGroup& s) const {
    return static_cast<size_t>(s.owner) * groups[s.group].shard.shard_elems + s.offset;
  }
  // The param block's element offset of sub-group s (stage 3: in the shard; else in the full
  // buffer).
  size_t ParamOffset(const zero::SubGroup& s) const {
    return placement.params_partitioned ? s.offset : FullOffset(s);
  }
  // Whether this rank's optimizer step writes every element of each of its param blocks, so it
  // need not read the old params: stage 3, where a param block is this rank's shard and its
  // sub-groups cover all of it, padding included. Stages 1-2: a param block is the full group,
  // of which this rank steps only its partition.
  bool ParamBlockReplaced() const {
    return placement.params_partitioned && placement.optimizer_partitioned;
  }
  // Writes the working params of sub-group s from its fp32 master values into the leased param
  // block (rounding to the working dtype).
  Status PublishParams(const zero::SubGroup& s, const float* master, Lease& param);
  // FailedPrecondition for `op` on frozen group g (GroupSpec::trainable false).
  Status FrozenRefusal(const char* op, size_t g) const {
    return Status::FailedPrecondition(std::string(op) + ": group '" + model.groups[g].name +
                                      "' is frozen (trainable false): it takes no gradient");
  }
  // Stage 1-2: all-gathers every trainable group's updated shards into the full param replicas
  // (and the frozen groups' when `frozen_too`: their initialisation).
  Status AllGatherUpdatedParams(bool frozen_too = false);

  // Device <-> host through the device's copies (a memcpy when the device is host-addressable).
  Status ToHost(void* host, const void* dev, uint64_t bytes);
  Status ToDevice(void* dev, const void* host, uint64_t bytes);

  // --- engine_grad.cc ---
  Result<GatheredGroup> Gather(size_t g);
  // Stage 3, one rank, no qwZ / hpZ: the shard is the whole group, and Gather hands out the
  // gather scheduler's device copy of it (GatheredCopy::shard; sched::DeviceWorkingSet counts no
  // gathered groups then).
  bool AliasesShard() const { return world == 1 && !zpp.qwz && zpp.hpz <= 1; }
  // Engine::orders_caller_streams: one rank without qgZ (the reduction is the identity: only the
  // device's own streams read the buffer), a device that orders caller streams and has kernels.
  bool OrdersCallerStreams() const {
    return world == 1 && !zpp.qgz && opt.device->orders_caller_streams() &&
           opt.device->kernels() != nullptr;
  }
  // Stage 3: the all-gather of group g from this rank's `shard` into `full` (plain, qwZ or hpZ;
  // fills the hpZ secondary slice on the step's first gather).
  Status GatherInto(size_t g, const void* shard, void* full);
  // qwZ: the error for a shard that holds a NaN or Inf, naming the parameter.
  Status NonFiniteWeight(size_t g, const void* host_shard) const;
  // qgZ: the hierarchical quantized reduce-scatter of `full` into this rank's `shard`.
  Status QuantizedReduceScatter(size_t g, const void* full, void* shard);
  // With `caller_stream` (Engine::Release's second form): ordered after that stream's work on
  // the device where OrdersCallerStreams and the memory is freed or reused (not GathersAliasHome).
  Status Release(GatheredGroup gathered, std::optional<uintptr_t> caller_stream = std::nullopt);
  // Engine::gathers_alias_home.
  bool GathersAliasHome() const;
  // Group g's gathered copy is kept after Release whatever the trace says (ds_persist).
  bool Persistent(size_t g) const;
  // Release's part for the handle itself: stage 3 keeps the copy (persistence, reuse distance)
  // or lets it go with the handle.
  void DropGathered(GatheredGroup gathered);
  Status ReduceGradients(size_t g, std::optional<uintptr_t> caller_stream);
  // Completes pending reductions and their accumulations (all, or only those already finished
  // when `all` is false); an accumulation starts once its reduction has completed.
  Status DrainReductions(bool all);
  // Starts the collectives of reduction p (more than one rank, or qgZ).
  Status StartReduction(zero::PendingReduce& p);
  // Completes the oldest pending reduction and its accumulation, waiting as needed.
  Status DrainFront();
  // Waits for reduction p (its error fails the engine, naming the group), then starts its
  // accumulation: on the accumulate thread when AccumulatesBehind, else here.
  Status StartAccumulate(zero::PendingReduce& p);
  // Whether p's accumulation runs behind the trainer on the accumulate thread
  // (sched::AccumulatesBehind): overlap_comm, and the CPU accumulates every sub-group's gradient
  // (staged from a device it cannot address by a blocking copy on that thread).
  bool AccumulatesBehind(const zero::PendingReduce& p) const;
  // Accumulates p's reduced gradient into its sub-groups' fp32 gradients (the first micro-step
  // overwrites), computing the final gradient's statistics and starting the write-back of
  // NVMe-homed ones. Touches only the store, the pool and `out`: it runs on the accumulate
  // thread.
  Status Accumulate(const zero::PendingReduce& p, zero::Accumulated* out);
  // GradBuffer's buffer for group g, zeroed: a spare one (spare_grads) or a new one; with a
  // caller stream (where OrdersCallerStreams), zeroed by the kernels ahead of that stream's later
  // work, else zeroed on return.
  Result<DeviceBuffer> NewGradBuffer(size_t g, std::optional<uintptr_t> caller_stream);
  // A reduced gradient buffer, done with: kept in spare_grads where it can be reused, else freed.
  void RecycleGradBuffer(DeviceBuffer buffer);
  // Accumulate's host path from a device the host cannot address: the n-element reduced gradient
  // at device address src copied into grad_staging in pieces, each accumulated into acc while
  // the next is copied; with `stats`, the whole gradient's statistics (the same bits as one
  // walk: the pieces start on kStatsChunk boundaries).
  Status AccumulateStaged(const uint8_t* src, float* acc, bool overwrite, size_t n,
                          std::optional<kernels::GradStats>* stats);
  // The copies behind AccumulateStaged: the n elements at device address src, copied into
  // grad_staging in pieces; use(piece, first element, count) runs on each while the next is
  // copied.
  Status StageFromDevice(const uint8_t* src, size_t n,
                         const std::function<Status(const uint8_t*, size_t, size_t)>& use);
  // Accumulate where the gradient is kept in the working dtype (grad_dtype): the n reduced
  // elements at src, final as they are (one micro-step, nothing to scale), copied into the host
  // block `dst`, with `stats` their statistics.
  Status CopyFinalGrad(const uint8_t* src, void* dst, size_t n,
                       std::optional<kernels::GradStats>* stats);
  // The engine's part of a finished accumulation: the statistics, the write-backs to watch,
  // the lease waits, and (last micro-step) the speculation's turn.
  void FinishAccumulate(const zero::PendingReduce& p);
  // The write-backs of completed NVMe-homed gradients that Accumulate starts (nobody waits on
  // them there) are part of the step: Step fails with the first failure among them, before its
  // Adam for those already finished (wait false) and after it for the rest (wait true, which
  // also forgets them). A failed write loses nothing (the store keeps the newer copy), but it is
  // never silent.
  Status CheckGradWriteBehind(bool wait);
  // The rule CheckGradWriteBehind applies to grad_write_behind, for any such tickets (an
  // overlapped step takes them along): the first failure, as "gradient write-behind: ...",
  // among those finished (or all, waiting, with `wait`).
  Status WriteBehindError(const std::vector<Ticket>& tickets, bool wait) const;

  // The reduced gradient of sub-group s in pending reduction p (device memory): this rank's
  // shard (stage 1-3); stage 0 and one rank (no shard): the full buffer.
  const uint8_t* ReducedGrad(const zero::PendingReduce& p, const zero::SubGroup& s) const {
    return placement.optimizer_partitioned && p.shard
               ? static_cast<const uint8_t*>(p.shard.get()) + s.offset * elt
               : static_cast<const uint8_t*>(p.full.get()) + FullOffset(s) * elt;
  }

  // --- engine_device.cc: device-resident state computed by the device's own kernels ---
  // The device's kernels when state whose home is `home` is computed where it lives by them: the
  // home is the device, the host cannot address it and it offers kernels (CudaDevice). Else null:
  // the CPU kernels compute on host-addressable memory (ComputeTier).
  kernels::DeviceKernels* DeviceKernelsFor(Tier home) const;
  // The device's kernels: queue sub-group si's chunk sums into its slot of device_stats
  // (stats_on_device until collected); no wait.
  Status QueueDeviceStats(size_t si, const float* grad);
  // Waits for the queued chunk sums, reads them back in one copy and merges each sub-group's
  // exactly (stats_valid). A no-op when none is queued.
  Status CollectDeviceStats();
  // Zeroes n gradient elements (grad_dtype) at `grad`, memory of `tier`.
  Status ZeroGradAt(Tier tier, void* grad, size_t n);
  // Sub-group s's Adam arguments over its leased blocks: fp32 master/m/v, the grad_dtype grad, and
  // at 16-bit precision param_out into the sub-group's range of the param block (fp32: none; the
  // caller copies the master there). One rule for the host and the device path.
  kernels::AdamShard AdamShardFor(const zero::SubGroup& s, Lease& master, Lease& m, Lease& v,
                                  const Lease& grad, Lease& param) const;
  // RunAdam's compute stage on the device for sub-group s: the fused Adam with the param_out
  // cast (fp32: a device copy) into the leased param block, synchronized before it returns
  // unless `queued` (the caller synchronizes once its last sub-group is queued: RunAdam, where
  // every block stays home on the device and nobody reads a group before the step ends).
  Status AdamOnDevice(kernels::DeviceKernels& k, const zero::SubGroup& s,
                      const kernels::AdamHyper& h, Lease& master, Lease& m, Lease& v,
                      const Lease& grad, Lease& param, bool queued = false);

  // --- engine_step.cc ---
  Result<StepReport> Step();
  Status DiscardGradients();
  // The lr optimizer group `og` uses in the next applied step: SetLearningRates' value, else the
  // group's own lr when the config has no schedule, else the schedule's.
  double LrFor(size_t og) const;
  Status ComputeMissingStats();
  Status ExchangeStats(double local_sum_sq, bool local_nonfinite, double* global_sum_sq,
                       bool* global_nonfinite);
  // Adds a collective on group g (kind 'g': all-gather of its parameters, 'r': reduction of its
  // gradient) to collective_trace. Every rank must start the same ones in the same order: a rank
  // that gathers or reduces another group at the same point pairs the two groups' data.
  void TraceCollective(char kind, size_t g);
  // What a group collective's pairing needs of the ranks; CollectiveError and Step's trace check
  // both name it.
  static constexpr std::string_view kSameCollectivesRule =
      "every rank must gather and reduce the same groups in the same order, so at ZeRO stage 3 "
      "every rank must run the same modules and take gradients through the same ones";
  // st (a group collective's failure) in context `what`; past its deadline with several ranks,
  // with the likely cause: ranks running other collectives.
  Status CollectiveError(const Status& st, const std::string& what) const;
  // One run of the fused Adam through the step pipeline.
  struct AdamRun {
    std::vector<size_t> order;              // the sub-groups to step, in this order
    std::vector<kernels::AdamHyper> hyper;  // per optimizer group, grad_scale folded in
    // Called once group g's sub-groups in `order` have all stepped (every group without one in
    // `order` counts as updated already).
    std::function<void(size_t group)> updated;
    // Where sub-group s's master, m, v and working params from before its Adam are copied
    // (SpeculationCopies; param_from is RunAdam's to fill), or null arrays for none:
    // kernels::AdamStepSaving copies them piece by piece beside the Adam. Host-run sub-groups
    // only.
    std::function<kernels::AdamSave(size_t s)> save_to;
  };
  Status RunAdam(const AdamRun& run, StepTimings* t);
  // This step's Adam coefficients: `hyper` with the lr and step of the next applied step and
  // `grad_scale` folded in.
  std::vector<kernels::AdamHyper> StepHyper(float grad_scale) const;
  // Optimizer group og's (beta1, beta2) for the next applied step.
  std::pair<double, double> BetasFor(size_t og) const;
  // The schedule's betas for the step about to be applied are ones Adam runs (OneCycle's
  // decay_mom_rate grows beta1 to 1): an error naming the key, not the kernel's.
  Status CheckScheduledBetas() const;
  // This rank's sub-groups, group by group in order, less those in `except` (empty: none).
  std::vector<size_t> StepOrder(const std::vector<uint64_t>& except = {}) const;
  // overlap_step: starts RunAdam over `order` with coefficients `hs` (and the wait for the
  // gradients' write-behind) on the DeferredStep's thread.
  // With `tail`, the job first joins the speculation's worker, then marks its groups updated.
  void LaunchDeferredStep(std::vector<kernels::AdamHyper> hs, std::vector<size_t> order,
                          zero::SpeculationTail tail);

  // --- engine_speculate.cc ---
  // Accumulate: group g's gradient is final for this step; queues its Adam when the speculation
  // is on, open, and its copies fit.
  void OnGradientFinal(size_t g);
  // Sub-group i's copies in the arena (handed to the speculation): four arrays of its elements,
  // fp32 master, exp_avg, exp_avg_sq, then the working params at param_to (param_from unset).
  kernels::AdamSave SpeculationCopies(size_t i) const;
  // A job of the speculation's worker: steps the groups queued by now.
  void SpeculateQueued();
  // Waits for the queued groups' Adam; the jobs' error fails the engine.
  Status FinishSpeculation();
  // The per-step state, for a step that has not begun its backward.
  void ResetSpeculation();
  // Restores every speculated sub-group from its copies (after FinishSpeculation).
  Status RollBackSpeculation();
  // A call that must see the params and state from before the step (a Gather of a queued group,
  // Save, Load, ReadMaster): finishes the worker, undoes what it did and closes the speculation
  // for this step. OK at once when nothing was queued.
  Status CancelSpeculation();
  // Step: after the norm, the overflow check and the coefficients are known. Finishes the
  // worker, keeps its work when the step is applied with the coefficients it used (sets
  // `*kept` to the sub-groups not to step again), else undoes it; counts both in `report`.
  // With `tail` (overlap_step) a worker whose work is kept is not waited for: it goes into
  // `*tail`, still running, and the per-step state waits for JoinDeferredStep.
  Status SettleSpeculation(bool applied, float grad_scale, StepReport* report,
                           std::vector<uint64_t>* kept, zero::SpeculationTail* tail = nullptr);
  // Once the last job posted has run (FinishSpeculation, or a deferred step's tail): the jobs'
  // timings into `t`, and their first error.
  Status CollectSpeculated(StepTimings* t);
  // The end of a Step: feeds the governor the time since the last one and opens the next step's
  // speculation as it says.
  void GovernSpeculation();
  // Waits for the deferred step (if any) and folds in its timings; its error fails the engine.
  Status JoinDeferredStep();
  // Gather: waits until group g's params hold the deferred step's update (or the step ended:
  // then its result), within the timeout.
  Status WaitForUpdate(size_t g);
};

}  // namespace strata
