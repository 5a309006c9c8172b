// Engine: the optimizer step during the backward (offload_optimizer.speculative_step), after
// DeepSpeed's SuperOffload: "speculation, then validation".
//
// Once a group's gradient is final in the backward (its last micro-step accumulated), a worker
// thread (zero::SerialWorker) runs its sub-groups' CPU Adam with the coefficients of an applied,
// unclipped step (grad scale 1 / loss scale, the next step's lr and count), first copying each
// sub-group's master, m, v and working params into a bounded host arena (piece by piece beside the
// Adam, kernels::AdamStepSaving). Step validates: when the step is applied with exactly those
// coefficients, the work stands and only the other sub-groups step; otherwise (clipped, skipped on
// overflow, an lr changed after the backward began) every speculated sub-group is restored from its
// copies and stepped again with the right coefficients, or not at all. Either way the state is bit
// for bit what the step without speculation makes: the same kernel on the same inputs.
//
// Once Step has kept the work, the groups the worker has not begun step without copies; with
// overlap_step, Step does not wait for them: the worker's last job goes to the deferred step
// (zero::SpeculationTail), which waits for it before stepping the rest behind the next forward.
//
// Bounds: the arena (EngineLayout's host working set) caps the elements speculated per step;
// the groups beyond it step in Step. The NVMe read-ahead and write-behind of a speculated
// sub-group are the step pipeline's (offload_optimizer.buffer_count). Policy: a step after one
// that needed clipping or was skipped does not speculate, so a run that clips every step pays
// one rollback, not one per step; with the key unset, sched::SpeculationGovernor times steps
// both ways and keeps the faster.
//
// Anything that must see the state from before the step while the speculation holds groups (a
// Gather of a queued group, Save, Load, ReadMaster) cancels it first: the worker finishes, its
// work is undone and the step runs as without.
#include <cstring>
#include <utility>

#include "core/zero/engine_internal.h"

namespace strata {

using zero::Speculation;
using zero::SubGroup;

namespace {

bool SameHyper(const kernels::AdamHyper& a, const kernels::AdamHyper& b) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
         a.weight_decay == b.weight_decay && a.decoupled_weight_decay == b.decoupled_weight_decay &&
         a.bias_correction == b.bias_correction && a.step == b.step &&
         a.grad_scale == b.grad_scale && a.stream_state == b.stream_state;
}

bool SameHyper(const std::vector<kernels::AdamHyper>& a, const std::vector<kernels::AdamHyper>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!SameHyper(a[i], b[i])) return false;
  }
  return true;
}

// Bytes of sub-group s's copies in the arena: master, m, v (fp32) and its working params.
uint64_t CopyBytes(const SubGroup& s, size_t elt) {
  return static_cast<uint64_t>(s.elems) * sched::SpeculationBytesPerElement(elt);
}

}  // namespace

namespace zero {

void PooledCopy(kernels::KernelPool& pool, size_t count, uint8_t* const* to,
                const uint8_t* const* from, const size_t* widths, size_t n) {
  auto copy = [&](int, size_t b, size_t e) {
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(to[i] + b * widths[i], from[i] + b * widths[i], (e - b) * widths[i]);
    }
  };
  pool.ForEachTile(n, 0, copy);
}

}  // namespace zero

void Engine::Impl::ResetSpeculation() {
  Speculation& sp = *spec;
  sp.open = !sp.skip_next && sp.governor.Speculate();
  sp.engaged = false;
  sp.used = 0;
  sp.offset.assign(subs.size(), Speculation::kNone);
  sp.handed.clear();
  sp.group_queued.assign(groups.size(), 0);
  sp.final_pending.assign(groups.size(), 0);
  std::lock_guard<std::mutex> lock(sp.mu);  // no worker runs here; the field is the worker's
  sp.validated = false;
}

void Engine::Impl::OnGradientFinal(size_t g) {
  if (!spec || !spec->open || !failed.ok()) return;
  Speculation& sp = *spec;
  const zero::GroupState& gs = groups[g];
  if (gs.gathered > 0) {
    // Its gathered copy may alias the param shard: its Adam starts once it is released.
    sp.final_pending[g] = 1;
    return;
  }
  sp.final_pending[g] = 0;
  // The offloaded sub-groups (partial offload: the device-resident ones step in Step).
  std::vector<size_t> mine;
  for (size_t i : gs.sub_groups) {
    if (!subs[i].on_device) mine.push_back(i);
  }
  if (mine.empty()) return;
  uint64_t bytes = 0;
  for (size_t i : mine) bytes += CopyBytes(subs[i], elt);
  if (sp.used + bytes > sp.buffer_bytes) return;  // its copies do not fit: it steps in Step
  if (!sp.engaged) {
    // The coefficients of an applied, unclipped step (what Step computes then, bit for bit).
    sp.grad_scale = static_cast<float>(1.0 / scaler->scale());
    sp.hyper = StepHyper(sp.grad_scale);
    sp.status = Status::OK();
    sp.engaged = true;
  }
  for (size_t i : mine) {
    sp.offset[i] = sp.used;
    sp.used += CopyBytes(subs[i], elt);
    sp.handed.push_back(i);
  }
  sp.group_queued[g] = 1;
  {
    std::lock_guard<std::mutex> lock(sp.mu);
    sp.queue.push_back(g);
  }
  sp.posted = sp.worker.Post([this] {
    SpeculateQueued();
    return Status::OK();  // its error is the speculation's (spec->status), reported by Step
  });
}

kernels::AdamSave Engine::Impl::SpeculationCopies(size_t i) const {
  uint8_t* at = spec->arena.get() + spec->offset[i];
  const size_t n = subs[i].elems;
  kernels::AdamSave c;
  c.master = reinterpret_cast<float*>(at);
  c.exp_avg = c.master + n;
  c.exp_avg_sq = c.exp_avg + n;
  c.param_to = c.exp_avg_sq + n;
  c.param_elem_bytes = elt;
  return c;
}

void Engine::Impl::SpeculateQueued() {
  Speculation& sp = *spec;
  std::vector<size_t> batch;
  bool save = true;
  {
    std::lock_guard<std::mutex> lock(sp.mu);
    batch.assign(sp.queue.begin(), sp.queue.end());
    sp.queue.clear();
    save = !sp.validated;
    // Empty: an earlier job took its group. Failed: the rest is dropped, the engine fails at Step.
    if (batch.empty() || !sp.status.ok()) return;
  }
  // The groups queued meanwhile go through one pipeline: their NVMe reads overlap.
  AdamRun run;
  for (size_t g : batch) {
    for (size_t i : groups[g].sub_groups) {
      if (sp.offset[i] != Speculation::kNone) run.order.push_back(i);
    }
  }
  run.hyper = sp.hyper;
  // Once Step has kept the speculation nothing will be undone: no copies (half again the
  // Adam's memory traffic) for the groups begun after that.
  if (save) run.save_to = [this](size_t i) { return SpeculationCopies(i); };
  StepTimings t;
  Status st = RunAdam(run, &t);
  std::lock_guard<std::mutex> lock(sp.mu);
  sp.timings.speculative_optimizer_ns += t.optimizer_ns;
  if (!st.ok() && sp.status.ok()) {
    sp.status = st.WithContext("during the backward (speculative_step)");
  }
}

Status Engine::Impl::FinishSpeculation() {
  if (!spec || !spec->posted.valid()) return Status::OK();
  Speculation& sp = *spec;
  std::exchange(sp.posted, {}).wait();  // the jobs run in order: every one posted has run
  Status st = CollectSpeculated(&timings);
  if (!st.ok()) return Fail(st);
  return Status::OK();
}

Status Engine::Impl::RollBackSpeculation() {
  Speculation& sp = *spec;
  const Tier param_home = placement.Home(StateKind::kParam16);
  const Tier param_tier = ComputeTier(param_home);
  std::vector<Ticket> written;
  std::vector<uint8_t> touched(groups.size(), 0);  // groups whose param block was restored
  for (size_t i : sp.handed) {
    const SubGroup& s = subs[i];
    const Tier opt_home = HomeOf(s, StateKind::kMaster32);  // offloaded: the CPU's
    const Tier opt_tier = ComputeTier(opt_home);
    const kernels::AdamSave c = SpeculationCopies(i);
    const BlockId states[3] = {s.master, s.exp_avg, s.exp_avg_sq};
    const BlockId pb = groups[s.group].param;
    {
      Lease l[4];
      for (int k = 0; k < 3; ++k) {
        STRATA_ASSIGN_OR_RETURN(l[k],
                                store->Acquire(states[k], opt_tier, Access::kOverwrite, timeout()));
      }
      STRATA_ASSIGN_OR_RETURN(l[3], store->Acquire(pb, param_tier, Access::kWrite, timeout()));
      uint8_t* const to[4] = {static_cast<uint8_t*>(l[0].data()),
                              static_cast<uint8_t*>(l[1].data()),
                              static_cast<uint8_t*>(l[2].data()),
                              static_cast<uint8_t*>(l[3].data()) + ParamOffset(s) * elt};
      const uint8_t* const from[4] = {
          reinterpret_cast<const uint8_t*>(c.master), reinterpret_cast<const uint8_t*>(c.exp_avg),
          reinterpret_cast<const uint8_t*>(c.exp_avg_sq), static_cast<const uint8_t*>(c.param_to)};
      const size_t widths[4] = {sizeof(float), sizeof(float), sizeof(float), elt};
      zero::PooledCopy(*pool, 4, to, from, widths, s.elems);
      for (Lease& x : l) x.MarkDirty();
    }
    // NVMe homes hold what the speculation wrote: the restored copies go home before Step goes
    // on, as the step pipeline's writes would (unless the host caches them: nvme_state_cached).
    if (opt_home == Tier::kNvme && !nvme_state_cached) {
      for (BlockId b : states) written.push_back(store->WriteBack(b));
    }
    touched[s.group] = 1;
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    if (param_home == Tier::kNvme && touched[g] && !nvme_state_cached)
      written.push_back(store->WriteBack(groups[g].param));
  }
  for (const Ticket& t : written) {
    Status st = t.Wait(timeout());
    if (!st.ok()) return st.WithContext("speculative_step rollback");
  }
  return Status::OK();
}

Status Engine::Impl::CancelSpeculation() {
  if (!spec) return Status::OK();
  Speculation& sp = *spec;
  sp.open = false;
  if (!sp.engaged) return Status::OK();
  STRATA_RETURN_IF_ERROR(FinishSpeculation());
  Status st = RollBackSpeculation();
  if (!st.ok()) return Fail(st);
  sp.cancelled += sp.handed.size();
  ResetSpeculation();
  sp.open = false;  // closed for the rest of this step
  return Status::OK();
}

Status Engine::Impl::SettleSpeculation(bool applied, float grad_scale, StepReport* report,
                                       std::vector<uint64_t>* kept, zero::SpeculationTail* tail) {
  if (!spec) return Status::OK();
  Speculation& sp = *spec;
  // Read by the trainer's thread only (the worker reads `hyper` too, never writes it).
  const bool keep = sp.engaged && applied && grad_scale == sp.grad_scale &&
                    SameHyper(sp.hyper, StepHyper(grad_scale));
  // overlap_step: a kept speculation's last groups (the backward's tail: the forward's first)
  // finish behind the next forward, whose Gather waits for them as for the rest of the step.
  const bool behind = keep && tail != nullptr && sp.posted.valid();
  if (keep) {
    std::lock_guard<std::mutex> lock(sp.mu);
    sp.validated = true;  // the groups not begun step without copies
  }
  if (!behind) STRATA_RETURN_IF_ERROR(FinishSpeculation());
  report->rolled_back_sub_groups = std::exchange(sp.cancelled, 0);
  if (keep) {
    report->speculated_sub_groups = sp.handed.size();
    *kept = sp.offset;
  } else if (sp.engaged) {
    Status st = RollBackSpeculation();
    if (!st.ok()) return st;
    report->rolled_back_sub_groups += sp.handed.size();
  }
  sp.skip_next = !applied || grad_scale != static_cast<float>(1.0 / report->loss_scale);
  if (!behind) {
    ResetSpeculation();
    return Status::OK();
  }
  tail->done = std::exchange(sp.posted, {});
  for (size_t g = 0; g < groups.size(); ++g) {
    if (sp.group_queued[g] != 0) tail->groups.push_back(g);
  }
  // Until JoinDeferredStep resets it: nothing queued that a Gather must cancel (the deferred step
  // holds those groups), nothing more to queue.
  sp.group_queued.assign(groups.size(), 0);
  sp.open = false;
  sp.engaged = false;
  sp.behind = true;
  return Status::OK();
}

void Engine::Impl::GovernSpeculation() {
  if (!spec) return;
  Speculation& sp = *spec;
  const auto now = zero::Clock::now();
  if (sp.last_step_end) {
    sp.governor.OnStep(std::chrono::duration<double>(now - *sp.last_step_end).count());
  }
  sp.last_step_end = now;
  // Settled: no worker runs (one behind the next forward keeps the step's state until
  // JoinDeferredStep resets it).
  if (!sp.behind) ResetSpeculation();
}

Status Engine::Impl::CollectSpeculated(StepTimings* t) {
  Speculation& sp = *spec;
  std::lock_guard<std::mutex> lock(sp.mu);
  t->speculative_optimizer_ns += std::exchange(sp.timings, StepTimings{}).speculative_optimizer_ns;
  return sp.status;
}

}  // namespace strata
