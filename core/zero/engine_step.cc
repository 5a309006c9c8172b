// Engine: the optimizer step. Global norm and overflow agreed across ranks, the loss scaler and
// LR schedule, then the fused Adam per sub-group through the step pipeline (NVMe reads ahead,
// writes behind), and the new params published.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include "core/zero/engine_internal.h"
#include "kernels/grad_stats.h"
#include "sched/step_pipeline.h"

namespace strata {

using zero::SubGroup;

namespace {

using zero::Clock;
using zero::Since;

// Calls `done` once every ticket added has completed: OK, or the first error.
class TicketJoin {
 public:
  explicit TicketJoin(sched::StageDone done) : done_(std::move(done)) {}
  static void Start(std::shared_ptr<TicketJoin> self, const std::vector<Ticket>& tickets) {
    if (tickets.empty()) {
      self->done_(Status::OK());
      return;
    }
    self->left_.store(static_cast<int>(tickets.size()));
    for (const Ticket& t : tickets) {
      t.Then([self](Status st) {
        if (!st.ok()) {
          std::lock_guard<std::mutex> lock(self->mu_);
          if (self->first_.ok()) self->first_ = st;
        }
        if (self->left_.fetch_sub(1) == 1) {
          Status result;
          {
            std::lock_guard<std::mutex> lock(self->mu_);
            result = self->first_;
          }
          self->done_(result);
        }
      });
    }
  }

 private:
  sched::StageDone done_;
  std::atomic<int> left_{0};
  std::mutex mu_;
  Status first_;
};

}  // namespace

Status Engine::Impl::ComputeMissingStats() {
  for (size_t g = 0; g < groups.size(); ++g) {
    zero::GroupState& gs = groups[g];
    for (size_t si : gs.sub_groups) {
      SubGroup& s = subs[si];
      const Tier home = HomeOf(s, StateKind::kGrad);
      const Tier tier = DeviceKernelsFor(home) ? Tier::kDevice : ComputeTier(home);
      if (gs.reductions == 0) {
        // Not reduced in this window: its gradient is zero.
        STRATA_ASSIGN_OR_RETURN(Lease acc,
                                store->Acquire(s.grad, tier, Access::kOverwrite, timeout()));
        STRATA_RETURN_IF_ERROR(ZeroGradAt(tier, acc.data(), s.elems));
        acc.MarkDirty();
        s.sum_sq = 0;
        s.nonfinite = false;
        s.stats_valid = true;
      } else if (!s.stats_valid && !s.stats_on_device && s.owner == rank) {
        STRATA_ASSIGN_OR_RETURN(Lease acc, store->Acquire(s.grad, tier, Access::kRead, timeout()));
        if (tier == Tier::kDevice && DeviceKernelsFor(tier) != nullptr) {
          // collected below
          STRATA_RETURN_IF_ERROR(QueueDeviceStats(si, static_cast<const float*>(acc.data())));
          continue;
        }
        STRATA_ASSIGN_OR_RETURN(kernels::GradStats st,
                                kernels::ComputeGradStats(*pool, acc.data(), grad_dtype, s.elems));
        s.sum_sq = st.sum_sq;
        s.nonfinite = st.nonfinite;
        s.stats_valid = true;
      }
    }
  }
  return CollectDeviceStats();  // these and the backward's, queued by Accumulate: one read-back
}

void Engine::Impl::TraceCollective(char kind, size_t g) {
  // FNV-1a over the kind and the group id.
  const uint64_t words[2] = {static_cast<uint64_t>(kind), static_cast<uint64_t>(g)};
  for (uint64_t w : words) {
    for (int b = 0; b < 8; ++b) {
      collective_trace ^= (w >> (8 * b)) & 0xff;
      collective_trace *= 1099511628211ull;
    }
  }
}

Status Engine::Impl::ExchangeStats(double local_sum_sq, bool local_nonfinite, double* global_sum_sq,
                                   bool* global_nonfinite) {
  // Four words per rank: the double's bits, the overflow flag, and the collective trace folded
  // to 32 bits. The all-gather moves bytes; the sum runs here in rank order, identical on every
  // rank.
  std::array<uint32_t, 4> mine{};
  std::memcpy(mine.data(), &local_sum_sq, sizeof(double));
  mine[2] = local_nonfinite ? 1u : 0u;
  mine[3] = static_cast<uint32_t>(collective_trace ^ (collective_trace >> 32));
  collective_trace = kCollectiveTraceSeed;
  Result<std::vector<uint32_t>> all = AllGatherWords(mine);
  if (!all.ok()) {
    return Status(all.status().code(),
                  "gradient norm exchange: " + std::string(all.status().message()));
  }
  double sum = 0;
  bool nonfinite = false;
  std::vector<int> apart;  // the ranks whose trace differs from rank 0's
  for (size_t r = 0; r < static_cast<size_t>(world); ++r) {
    const uint32_t* w = all->data() + r * 4;
    double v;
    std::memcpy(&v, w, sizeof v);
    sum += v;
    nonfinite = nonfinite || w[2] != 0u || !std::isfinite(v);
    if (w[3] != (*all)[3]) apart.push_back(static_cast<int>(r));
  }
  if (!apart.empty()) {
    std::string ranks;
    for (int r : apart) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    return Status::FailedPrecondition(
        "Step: the ranks gathered or reduced different groups, or in different orders, since the "
        "last step (rank(s) " +
        ranks +
        " apart from rank 0), so the collectives paired one group's data with another's and "
        "this step's gradients are wrong; it is not applied. " +
        std::string(kSameCollectivesRule) +
        " (a module or parameter used on some ranks only, as a branch on the rank's data or "
        "random state, breaks this at stage 3, where each module's parameters are gathered when "
        "it runs)");
  }
  *global_sum_sq = sum;
  *global_nonfinite = nonfinite;
  return Status::OK();
}

kernels::AdamShard Engine::Impl::AdamShardFor(const SubGroup& s, Lease& master, Lease& m, Lease& v,
                                              const Lease& grad, Lease& param) const {
  kernels::AdamShard shard;
  shard.master = static_cast<float*>(master.data());
  shard.exp_avg = static_cast<float*>(m.data());
  shard.exp_avg_sq = static_cast<float*>(v.data());
  shard.grad = grad.data();
  shard.grad_dtype = grad_dtype;
  shard.n = s.elems;
  if (dtype != DType::kF32) {
    shard.param_out = static_cast<uint8_t*>(param.data()) + ParamOffset(s) * elt;
    shard.param_out_dtype = dtype;
  }
  return shard;
}

std::vector<kernels::AdamHyper> Engine::Impl::StepHyper(float grad_scale) const {
  std::vector<kernels::AdamHyper> hs = hyper;
  for (size_t og = 0; og < hs.size(); ++og) {
    hs[og].lr = LrFor(og);
    std::tie(hs[og].beta1, hs[og].beta2) = BetasFor(og);
    hs[og].step = applied_steps - adam_step_base + 1;
    hs[og].grad_scale = grad_scale;
  }
  return hs;
}

std::vector<size_t> Engine::Impl::StepOrder(const std::vector<uint64_t>& except) const {
  std::vector<size_t> order;
  for (const zero::GroupState& gs : groups) {
    for (size_t i : gs.sub_groups) {
      if (except.empty() || except[i] == zero::Speculation::kNone) order.push_back(i);
    }
  }
  return order;
}

Status Engine::Impl::RunAdam(const AdamRun& run, StepTimings* t) {
  const Tier param_home = placement.Home(StateKind::kParam16);
  // Per sub-group (partial offload keeps some on the device): its homes and where its step runs.
  // Device-resident optimizer state on a device with kernels: the step runs there, on the
  // gradient (same home) and on a device copy of the param block (fetched when not its home).
  struct Where {
    Tier opt_home, grad_home;
    kernels::DeviceKernels* on_device;
    Tier opt_tier, grad_tier, param_tier;
  };
  auto where = [&](const SubGroup& s) {
    Where w{HomeOf(s, StateKind::kMaster32), HomeOf(s, StateKind::kGrad), nullptr, {}, {}, {}};
    w.on_device = DeviceKernelsFor(w.opt_home);
    w.opt_tier = w.on_device ? Tier::kDevice : ComputeTier(w.opt_home);
    w.grad_tier = w.on_device ? Tier::kDevice : ComputeTier(w.grad_home);
    w.param_tier = w.on_device ? Tier::kDevice : ComputeTier(param_home);
    return w;
  };
  const std::vector<kernels::AdamHyper>& hs = run.hyper;
  const std::vector<size_t>& order = run.order;
  // Every sub-group on the device, whose blocks all stay home there (the param block too; a
  // sub-group stepped on the host would copy that block out under the queued kernels), in a step
  // no trainer reads a group of before it ends (no overlap_step): the kernels are only queued,
  // and synchronized once after the last, instead of once each.
  const bool queue_device =
      param_home == Tier::kDevice && !run.updated &&
      std::all_of(order.begin(), order.end(), [&](size_t i) { return where(subs[i]).on_device; });
  kernels::DeviceKernels* queued = nullptr;

  // Reads and writes share the buffer_count buffers as they free up: neither depth is capped
  // below what the buffers allow. A fixed split ((B-1)/2 ahead) left the disk idle whenever the
  // writes behind finished early (bench engine, 100M params, opt+param on nvme: io efficiency
  // 0.53); the buffers (and the host budget, which the store never exceeds) are the bound.
  sched::PipelineOptions po;
  po.buffers = pipeline_buffers;
  po.read_ahead = po.buffers - 1;
  po.write_behind = po.buffers - 1;
  sched::PipelineStages stages;
  stages.read = [&](size_t i, uint32_t, sched::StageDone done) -> Status {
    const SubGroup& s = subs[i];
    const Where w = where(s);
    std::vector<Ticket> tickets;
    if (w.opt_tier != w.opt_home) {
      for (BlockId b : {s.master, s.exp_avg, s.exp_avg_sq})
        tickets.push_back(store->Fetch(b, w.opt_tier));
    }
    if (w.grad_tier != w.grad_home) tickets.push_back(store->Fetch(s.grad, w.grad_tier));
    // The param block the Adam writes into (NVMe-homed params: staged ahead like the states),
    // unless the sub-groups replace all of it (ParamBlockReplaced): then nothing is read.
    if (w.param_tier != param_home && !ParamBlockReplaced())
      tickets.push_back(store->Fetch(groups[s.group].param, w.param_tier));
    TicketJoin::Start(std::make_shared<TicketJoin>(std::move(done)), tickets);
    return Status::OK();
  };
  // Time the compute spends in Acquire is IO wait too: a copy fetched ahead but evicted before
  // its Adam (it is evictable until leased) is read again there, behind the queue (bench engine,
  // 500M params, 4 GB host: 1.4-6.2 s per step, none of it counted as IO wait before).
  uint64_t acquire_ns = 0;
  stages.compute = [&](size_t i, uint32_t) -> Status {
    const SubGroup& s = subs[i];
    const Where w = where(s);
    const auto a0 = Clock::now();
    STRATA_ASSIGN_OR_RETURN(Lease master,
                            store->Acquire(s.master, w.opt_tier, Access::kWrite, timeout()));
    STRATA_ASSIGN_OR_RETURN(Lease m,
                            store->Acquire(s.exp_avg, w.opt_tier, Access::kWrite, timeout()));
    STRATA_ASSIGN_OR_RETURN(Lease v,
                            store->Acquire(s.exp_avg_sq, w.opt_tier, Access::kWrite, timeout()));
    STRATA_ASSIGN_OR_RETURN(Lease grad,
                            store->Acquire(s.grad, w.grad_tier, Access::kRead, timeout()));
    // The group's first sub-group overwrites a replaced param block: no read of the old bytes
    // (bench engine, 4B params on nvme: 8 GB of the step's 84 GB of reads). The later ones
    // write into the copy it made the newest (or its written-back home, when it was evicted).
    const Access param_access = ParamBlockReplaced() && groups[s.group].sub_groups.front() == i
                                    ? Access::kOverwrite
                                    : Access::kWrite;
    STRATA_ASSIGN_OR_RETURN(
        Lease param, store->Acquire(groups[s.group].param, w.param_tier, param_access, timeout()));
    acquire_ns += Since(a0);
    kernels::AdamSave save = run.save_to ? run.save_to(i) : kernels::AdamSave{};
    const kernels::AdamHyper& h = hs[model.groups[s.group].optimizer_group];
    if (w.on_device) {
      if (save.master != nullptr) return Status::Internal("optimizer step: copies of device state");
      if (queue_device) queued = w.on_device;
      return AdamOnDevice(*w.on_device, s, h, master, m, v, grad, param, queue_device);
    }
    const kernels::AdamShard shard = AdamShardFor(s, master, m, v, grad, param);
    if (save.master != nullptr) {
      save.param_from = static_cast<const uint8_t*>(param.data()) + ParamOffset(s) * elt;
      STRATA_RETURN_IF_ERROR(kernels::AdamStepSaving(*pool, h, shard, save));
    } else {
      STRATA_RETURN_IF_ERROR(kernels::AdamStep(*pool, h, shard));
    }
    if (dtype == DType::kF32) {
      std::memcpy(static_cast<uint8_t*>(param.data()) + ParamOffset(s) * elt, shard.master,
                  s.elems * sizeof(float));
    }
    master.MarkDirty();
    m.MarkDirty();
    v.MarkDirty();
    param.MarkDirty();
    return Status::OK();
  };
  stages.write = [&](size_t i, uint32_t, sched::StageDone done) -> Status {
    const SubGroup& s = subs[i];
    std::vector<Ticket> tickets;
    if (HomeOf(s, StateKind::kMaster32) == Tier::kNvme && !nvme_state_cached) {
      for (BlockId b : {s.master, s.exp_avg, s.exp_avg_sq}) tickets.push_back(store->WriteBack(b));
    }
    // The param block is the group's: written back once, after its last sub-group. Writing it
    // after each made the next sub-group's write lease wait for that write, and moved the block
    // once per sub-group (bench engine, 2B params, 2 sub-groups per group: 1.6x the param bytes).
    if (param_home == Tier::kNvme && groups[s.group].sub_groups.back() == i && !nvme_state_cached) {
      tickets.push_back(store->WriteBack(groups[s.group].param));
    }
    TicketJoin::Start(std::make_shared<TicketJoin>(std::move(done)), tickets);
    return Status::OK();
  };
  // The pipeline runs over `order`; map its index to the sub-group. A group is updated once its
  // last sub-group in the order has stepped.
  std::vector<size_t> last(groups.size(), SIZE_MAX);
  for (size_t k = 0; k < order.size(); ++k) last[subs[order[k]].group] = k;
  sched::PipelineStages mapped;
  mapped.read = [&](size_t i, uint32_t slot, sched::StageDone d) {
    return stages.read(order[i], slot, std::move(d));
  };
  mapped.compute = [&](size_t i, uint32_t slot) {
    Status st = stages.compute(order[i], slot);
    const size_t g = subs[order[i]].group;
    if (st.ok() && run.updated && last[g] == i) run.updated(g);
    return st;
  };
  mapped.write = [&](size_t i, uint32_t slot, sched::StageDone d) {
    return stages.write(order[i], slot, std::move(d));
  };
  sched::StepPipeline pipeline(po);
  sched::PipelineStats ps;
  const auto t0 = Clock::now();
  Status st = pipeline.Run(order.size(), mapped, &ps);
  if (queued != nullptr) {
    Status synced = queued->Synchronize(timeout());
    if (st.ok()) st = synced;
  }
  t->optimizer_ns += Since(t0);
  t->optimizer_io_wait_ns += ps.wait_read_ns + ps.wait_write_ns + acquire_ns;
  if (!st.ok()) return Status(st.code(), "optimizer step: " + std::string(st.message()));
  return Status::OK();
}

void Engine::Impl::LaunchDeferredStep(std::vector<kernels::AdamHyper> hs, std::vector<size_t> order,
                                      zero::SpeculationTail tail) {
  auto d = std::make_unique<zero::DeferredStep>(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) d->updated[g].store(true);
  for (size_t i : order) d->updated[subs[i].group].store(false);
  for (size_t g : tail.groups) d->updated[g].store(false);
  zero::DeferredStep* job = d.get();
  std::vector<Ticket> written_behind = std::move(grad_write_behind);
  grad_write_behind.clear();
  AdamRun run;
  run.order = std::move(order);
  run.hyper = std::move(hs);
  run.updated = [job](size_t g) {
    {
      std::lock_guard<std::mutex> lock(job->mu);
      job->updated[g].store(true, std::memory_order_release);
    }
    job->cv.notify_all();
  };
  job->thread = std::thread([this, job, run = std::move(run), tickets = std::move(written_behind),
                             tail = std::move(tail)]() mutable {
    Status st;
    if (tail.done.valid()) {  // the speculation's groups first: the forward's first
      std::exchange(tail.done, {}).wait();
      st = CollectSpeculated(&job->timings);
      if (st.ok()) {
        for (size_t g : tail.groups) run.updated(g);
      }
    }
    if (st.ok()) st = RunAdam(run, &job->timings);
    // The gradients written home during the backward: a failed write fails this step, as
    // CheckGradWriteBehind does for a step that runs in Step.
    Status written = WriteBehindError(tickets, /*wait=*/true);
    if (st.ok()) st = written;
    {
      std::lock_guard<std::mutex> lock(job->mu);
      job->status = st;
      job->finished = true;
    }
    job->cv.notify_all();
  });
  deferred = std::move(d);
}

Status Engine::Impl::JoinDeferredStep() {
  if (!deferred) return Status::OK();
  if (deferred->thread.joinable()) deferred->thread.join();
  std::unique_ptr<zero::DeferredStep> d = std::move(deferred);
  timings.optimizer_ns += d->timings.optimizer_ns;
  timings.optimizer_io_wait_ns += d->timings.optimizer_io_wait_ns;
  timings.speculative_optimizer_ns += d->timings.speculative_optimizer_ns;
  // The job waited for the speculation's jobs it was handed: the next backward may queue.
  if (spec && spec->behind) {
    spec->behind = false;
    ResetSpeculation();
  }
  if (!d->status.ok()) return Fail(d->status);
  return Status::OK();
}

Status Engine::Impl::WaitForUpdate(size_t g) {
  if (!deferred) return Status::OK();
  zero::DeferredStep& d = *deferred;
  if (d.updated[g].load(std::memory_order_acquire)) return Status::OK();
  {
    std::unique_lock<std::mutex> lock(d.mu);
    const bool ready = d.cv.wait_until(lock, deadline(), [&] {
      return d.updated[g].load(std::memory_order_acquire) || d.finished;
    });
    if (!ready) {
      return Fail(Status::DeadlineExceeded(
          "gather of group '" + model.groups[g].name +
          "': the optimizer step running behind (overlap_step) did not update it within the "
          "timeout"));
    }
    if (d.updated[g].load(std::memory_order_acquire)) return Status::OK();
  }
  // The step ended without updating g: it failed (its error, naming the block).
  Status st = JoinDeferredStep();
  if (!st.ok()) return st;
  return Status::Internal("gather of group '" + model.groups[g].name +
                          "': the overlapped optimizer step ended without updating it");
}

double Engine::Impl::LrFor(size_t og) const {
  if (!client_lrs.empty()) return client_lrs[og];
  return schedule->LrForStep(applied_steps - lr_step_base, own_lr[og]);
}

Status Engine::Impl::CheckScheduledBetas() const {
  for (size_t og = 0; og < hyper.size(); ++og) {
    if (!client_betas[og]) return schedule->CheckBetasForStep(applied_steps - lr_step_base);
  }
  return Status::OK();
}

std::pair<double, double> Engine::Impl::BetasFor(size_t og) const {
  if (!client_betas[og]) {
    if (auto b = schedule->BetasForStep(applied_steps - lr_step_base)) return *b;
  }
  return {hyper[og].beta1, hyper[og].beta2};
}

Status Engine::Impl::DiscardGradients() {
  STRATA_RETURN_IF_ERROR(CheckHealthy());
  STRATA_RETURN_IF_ERROR(JoinDeferredStep());
  Status st = DrainReductions(true);
  if (!st.ok()) return st;
  st = CheckGradWriteBehind(/*wait=*/true);
  if (st.ok() && spec) {
    // What it stepped ahead is rolled back. The next window speculates as this one would have,
    // and the governor does not time the dropped window as a step.
    const bool skip = spec->skip_next;
    StepReport unused;
    unused.loss_scale = scaler->scale();
    st = SettleSpeculation(false, 0, &unused, nullptr);
    spec->skip_next = skip;
    spec->last_step_end.reset();
    if (st.ok()) ResetSpeculation();
  }
  if (!st.ok()) return Fail(st);
  for (zero::GroupState& gs : groups) {
    if (gs.grad) {
      gs.grad = DeviceBuffer();  // freed behind the device's queues
      --grad_buffers_out;
    }
    gs.reductions = 0;  // the window's next reduction overwrites what was accumulated
  }
  stats_queued.clear();  // their kernels' results are never read
  for (SubGroup& s : subs) {
    s.stats_valid = false;
    s.stats_on_device = false;
  }
  collective_trace = kCollectiveTraceSeed;  // the dropped collectives paired, or failed above
  return Status::OK();
}

Result<StepReport> Engine::Impl::Step() {
  STRATA_RETURN_IF_ERROR(CheckHealthy());
  STRATA_RETURN_IF_ERROR(JoinDeferredStep());
  if (outstanding_gathers > 0) {
    return Status::FailedPrecondition("Step: " + std::to_string(outstanding_gathers) +
                                      " gathered group(s) not released");
  }
  STRATA_RETURN_IF_ERROR(CheckNoGradBufferOut("Step", "that was never reduced"));
  const auto t0 = Clock::now();
  StepReport report;
  Status st = DrainReductions(true);
  if (!st.ok()) return st;
  st = CheckGradWriteBehind(/*wait=*/false);
  if (!st.ok()) return Fail(st);
  st = ComputeMissingStats();
  if (!st.ok()) return Fail(Status(st.code(), "gradient statistics: " + std::string(st.message())));
  double local = 0;
  bool local_nonfinite = false;
  for (const SubGroup& s : subs) {
    if (s.owner != rank) continue;
    local += s.sum_sq;
    local_nonfinite = local_nonfinite || s.nonfinite;
  }
  double global_sum_sq = 0;
  bool overflow = false;
  st = ExchangeStats(local, local_nonfinite, &global_sum_sq, &overflow);
  if (!st.ok()) return Fail(st);

  bool launch = false;         // overlap_step: the Adam runs behind the next forward
  zero::SpeculationTail tail;  // with the speculation's worker, when it still runs
  float grad_scale = 1;
  std::vector<size_t> order;  // the sub-groups this Step steps (the speculation's are done)
  std::vector<kernels::AdamHyper> step_hyper;  // their coefficients
  report.global_step = ++global_step;
  report.loss_scale = scaler->scale();
  if (overflow) {
    report.skipped = true;
    report.grad_norm = std::numeric_limits<double>::infinity();
    report.lr = last_lr;
    ++skipped_steps;
    st = SettleSpeculation(false, 0, &report, nullptr);
    if (!st.ok()) return Fail(st);
    st = scaler->Update(true);
    if (!st.ok()) return Fail(st);
  } else {
    const double total_norm = std::sqrt(global_sum_sq);  // of the scaled, averaged gradients
    double combined = report.loss_scale;
    if (clip > 0) {
      const double c = ((total_norm / report.loss_scale) + 1e-6) / clip;
      if (c > 1) {
        combined = c * report.loss_scale;
        report.clip_coefficient = c;
      }
    }
    report.grad_norm = total_norm / report.loss_scale;
    report.lr = LrFor(0);
    grad_scale = static_cast<float>(1.0 / combined);
    st = CheckScheduledBetas();
    if (!st.ok()) return Fail(st);
    std::vector<uint64_t> kept;
    st = SettleSpeculation(true, grad_scale, &report, &kept, overlap_step ? &tail : nullptr);
    if (!st.ok()) return Fail(st);
    order = StepOrder(kept);
    step_hyper = StepHyper(grad_scale);
    if (overlap_step) {
      launch = true;  // below, once the bookkeeping the job must not race with is done
    } else {
      AdamRun run;
      run.order = std::move(order);
      run.hyper = std::move(step_hyper);
      st = RunAdam(run, &timings);
      if (st.ok()) st = AllGatherUpdatedParams();
      if (!st.ok()) return Fail(st);
    }
    ++applied_steps;
    last_lr = report.lr;
    st = scaler->Update(false);
    if (!st.ok()) return Fail(st);
    DropKeptCopies();  // the params changed: stale
  }
  if (!launch) {
    st = CheckGradWriteBehind(/*wait=*/true);
    if (!st.ok()) return Fail(st);
  }
  for (zero::GroupState& gs : groups) gs.reductions = 0;
  for (SubGroup& s : subs) s.stats_valid = false;
  if (gather && in_step) gather->EndStep();
  in_step = false;
  // Takes the write-behind tickets along.
  if (launch) LaunchDeferredStep(std::move(step_hyper), std::move(order), std::move(tail));
  timings.step_ns = Since(t0);
  GovernSpeculation();
  report.timings = timings;
  zero::AddTimings(timings, &totals.timings);
  timings = StepTimings{};
  return report;
}

}  // namespace strata
