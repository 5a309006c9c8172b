// Engine: gathering parameters (stage 3: shard fetch + all-gather, with the prefetching gather
// scheduler) and reducing gradients into the fp32 accumulated gradient of each sub-group.
#include <algorithm>
#include <cstring>

#include "core/zero/engine_internal.h"
#include "kernels/casts.h"
#include "kernels/grad_stats.h"

namespace strata {

using zero::SubGroup;

namespace {

using zero::Clock;
using zero::Since;

Status WithContext(const Status& st, const std::string& what) {
  if (st.ok()) return st;
  return Status(st.code(), what + ": " + std::string(st.message()));
}

// acc = (overwrite ? 0 : acc) + float(grad) * scale, element by element (one multiply, one add;
// the same expression for every placement, so results never depend on where acc lives).
Status AccumulateHost(float* acc, const void* grad, DType dtype, float scale, bool overwrite,
                      size_t n) {
  constexpr size_t kChunk = 16384;
  float tmp[kChunk];
  for (size_t b = 0; b < n; b += kChunk) {
    const size_t m = std::min(kChunk, n - b);
    const float* g;
    if (dtype == DType::kF32) {
      g = static_cast<const float*>(grad) + b;
    } else {
      STRATA_RETURN_IF_ERROR(kernels::Cast(static_cast<const uint8_t*>(grad) + b * DTypeSize(dtype),
                                           dtype, tmp, DType::kF32, m));
      g = tmp;
    }
    float* a = acc + b;
    if (overwrite) {
      for (size_t i = 0; i < m; ++i) a[i] = g[i] * scale;
    } else {
      for (size_t i = 0; i < m; ++i) {
        const float prod = g[i] * scale;
        a[i] = a[i] + prod;
      }
    }
  }
  return Status::OK();
}

struct AccumulateArgs {
  float* acc;
  const uint8_t* grad;
  DType dtype;
  float scale;
  bool overwrite;
  Status status[64];
};

// Element-wise, so the split over the pool's threads never changes a bit.
Status AccumulatePooled(kernels::KernelPool& pool, float* acc, const void* grad, DType dtype,
                        float scale, bool overwrite, size_t n) {
  if (n < (size_t{1} << 16) || pool.threads() > 64) {
    return AccumulateHost(acc, grad, dtype, scale, overwrite, n);
  }
  AccumulateArgs a{acc, static_cast<const uint8_t*>(grad), dtype, scale, overwrite, {}};
  pool.ForEachTile(
      n, 0,
      [](void* ctx, int slot, size_t b, size_t e) {
        auto* x = static_cast<AccumulateArgs*>(ctx);
        Status st = AccumulateHost(x->acc + b, x->grad + b * DTypeSize(x->dtype), x->dtype,
                                   x->scale, x->overwrite, e - b);
        if (!st.ok() && x->status[slot].ok()) x->status[slot] = st;
      },
      &a);
  for (int i = 0; i < pool.threads(); ++i) STRATA_RETURN_IF_ERROR(a.status[i]);
  return Status::OK();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Gather / Release
// ---------------------------------------------------------------------------------------------

Result<GatheredGroup> Engine::Impl::Gather(size_t g) {
  STRATA_RETURN_IF_ERROR(CheckHealthy());
  if (g >= groups.size()) {
    return Status::InvalidArgument("Gather: group " + std::to_string(g) + " out of range (" +
                                   std::to_string(groups.size()) + " groups)");
  }
  const auto t0 = Clock::now();
  zero::GroupState& gs = groups[g];
  const std::string& name = model.groups[g].name;
  GatheredGroup out;
  out.group_ = g;
  out.dtype_ = dtype;
  out.numel_ = gs.numel;
  out.offsets_ = gs.param_offsets;
  if (!placement.params_partitioned) {
    auto lease = store->Acquire(gs.param, Tier::kDevice, Access::kRead, timeout());
    if (!lease.ok()) return Fail(WithContext(lease.status(), "gather of group '" + name + "'"));
    out.data_ = lease->data();
    out.hold_ = std::make_shared<Lease>(std::move(*lease));
  } else if (gs.cached) {
    out.data_ = gs.cached->buffer.get();
    out.hold_ = gs.cached;
  } else {
    if (!in_step) {
      gather->BeginStep();
      in_step = true;
    }
    auto shard = gather->Gather(static_cast<sched::GroupId>(g), timeout());
    if (!shard.ok()) return Fail(WithContext(shard.status(), "gather of group '" + name + "'"));
    const uint64_t bytes = gs.shard.padded_elems(world) * elt;
    auto full = DeviceBuffer::Make(opt.device, bytes);
    if (!full.ok() && full.status().code() == Status::Code::kResourceExhausted &&
        cached_elems > 0) {
      // Make room: drop the kept copies (they are re-gathered when needed).
      for (zero::GroupState& other : groups) other.cached.reset();
      cached_elems = 0;
      full = DeviceBuffer::Make(opt.device, bytes);
    }
    if (!full.ok()) {
      return Fail(WithContext(full.status(), "gathered buffer of group '" + name + "'"));
    }
    auto h = opt.comm->AllGather(shard->data(), full->get(), gs.shard.shard_elems, dtype);
    Status st = h.ok() ? h->WaitUntil(deadline()) : h.status();
    gather->Release(static_cast<sched::GroupId>(g), std::move(*shard));
    if (!st.ok()) return Fail(WithContext(st, "all-gather of group '" + name + "'"));
    auto copy = std::make_shared<zero::GatheredCopy>();
    copy->buffer = std::move(*full);
    out.data_ = copy->buffer.get();
    out.hold_ = std::move(copy);
  }
  ++outstanding_gathers;
  timings.gather_wait_ns += Since(t0);
  return out;
}

void Engine::Impl::Release(GatheredGroup gathered) {
  if (!gathered) return;
  --outstanding_gathers;
  if (!placement.params_partitioned || !failed.ok()) return;  // the lease / copy goes with it
  const size_t g = gathered.group_;
  zero::GroupState& gs = groups[g];
  auto copy = std::static_pointer_cast<zero::GatheredCopy>(gathered.hold_);
  const uint64_t padded = gs.shard.padded_elems(world);
  bool keep = gs.numel <= persistence_elems;
  if (!keep && gather != nullptr) {
    // Kept when the recorded trace uses it again within stage3_max_reuse_distance elements.
    const sched::Trace& trace = gather->trace();
    if (trace.replaying()) {
      const size_t pos = trace.position();
      const size_t next = trace.NextUse(static_cast<sched::GroupId>(g), pos);
      if (next != sched::kNever) {
        uint64_t between = 0;
        for (size_t i = pos; i < next && between <= reuse_distance_elems; ++i) {
          between += groups[trace.recorded()[i]].numel;
        }
        keep = between <= reuse_distance_elems;
      }
    }
  }
  if (keep && gs.cached != copy) {
    if (cached_elems + padded > max_live_elems) return;  // stage3_max_live_parameters
    if (gs.cached) cached_elems -= padded;
    gs.cached = std::move(copy);
    cached_elems += padded;
  } else if (!keep && gs.cached == copy && copy) {
    gs.cached.reset();
    cached_elems -= padded;
  }
}

// ---------------------------------------------------------------------------------------------
// Gradients
// ---------------------------------------------------------------------------------------------

Status Engine::Impl::ReduceGradients(size_t g) {
  STRATA_RETURN_IF_ERROR(CheckHealthy());
  if (g >= groups.size()) {
    return Status::InvalidArgument("ReduceGradients: group " + std::to_string(g) + " out of range");
  }
  zero::GroupState& gs = groups[g];
  const std::string& name = model.groups[g].name;
  if (!gs.grad) {
    return Status::FailedPrecondition(
        "ReduceGradients: group '" + name +
        "' has no gradient buffer this micro-step (GradBuffer first)");
  }
  if (gs.reductions >= gas) {
    return Status::FailedPrecondition("ReduceGradients: group '" + name + "' was already reduced " +
                                      std::to_string(gas) +
                                      " times (gradient_accumulation_steps) since the last Step");
  }
  const auto t0 = Clock::now();
  zero::PendingReduce p;
  p.group = g;
  p.full = std::move(gs.grad);
  p.first = gs.reductions == 0;
  ++gs.reductions;
  p.last = gs.reductions == gas;
  auto shard = DeviceBuffer::Make(opt.device, gs.shard.shard_elems * elt);
  if (!shard.ok())
    return Fail(WithContext(shard.status(), "reduced gradient of group '" + name + "'"));
  p.shard = std::move(*shard);
  ReduceOptions ro;
  ro.predivide = predivide;
  auto rs = opt.comm->ReduceScatter(p.full.get(), p.shard.get(), gs.shard.shard_elems, dtype, ro);
  if (!rs.ok()) return Fail(WithContext(rs.status(), "reduce-scatter of group '" + name + "'"));
  p.handles.push_back(*rs);
  if (!placement.optimizer_partitioned && world > 1) {
    // Stage 0: every rank steps the whole model; the reduced shards are all-gathered (the second
    // half of an all-reduce), so every rank sees exactly the values their owner reduced.
    auto ag = opt.comm->AllGather(p.shard.get(), p.full.get(), gs.shard.shard_elems, dtype);
    if (!ag.ok())
      return Fail(WithContext(ag.status(), "all-gather of the gradient of group '" + name + "'"));
    p.handles.push_back(*ag);
  }
  pending.push_back(std::move(p));
  // Without overlap_comm the reduction completes now; with it, up to two stay in flight behind
  // the trainer's backward (the device working set counts three gradient buffers).
  Status st = DrainReductions(!overlap_comm);
  while (st.ok() && pending.size() > 2) {
    auto& front = pending.front();
    st = zero::WaitAll(front.handles, deadline());
    if (st.ok()) st = DrainReductions(false);
  }
  timings.reduce_wait_ns += Since(t0);
  return st;
}

Status Engine::Impl::DrainReductions(bool all) {
  while (!pending.empty()) {
    zero::PendingReduce& p = pending.front();
    if (!all) {
      bool ready = true;
      for (const CommHandle& h : p.handles) ready = ready && h.Ready();
      if (!ready) break;
    }
    const std::string& name = model.groups[p.group].name;
    Status st = zero::WaitAll(p.handles, deadline());
    if (!st.ok()) return Fail(WithContext(st, "gradient reduction of group '" + name + "'"));
    st = Accumulate(p);
    if (!st.ok()) return Fail(WithContext(st, "gradient accumulation of group '" + name + "'"));
    pending.pop_front();
  }
  return Status::OK();
}

Status Engine::Impl::Accumulate(zero::PendingReduce& p) {
  const zero::GroupState& gs = groups[p.group];
  const Tier tier = ComputeTier(placement.Home(StateKind::kGrad));
  std::vector<uint8_t> staged;
  for (size_t si : gs.sub_groups) {
    SubGroup& s = subs[si];
    const uint8_t* src = placement.optimizer_partitioned
                             ? static_cast<const uint8_t*>(p.shard.get()) + s.offset * elt
                             : static_cast<const uint8_t*>(p.full.get()) + FullOffset(s) * elt;
    if (!opt.device->host_addressable()) {
      staged.resize(s.elems * elt);
      STRATA_RETURN_IF_ERROR(CopySync(CopyDir::kDeviceToHost, staged.data(), src, staged.size()));
      src = staged.data();
    }
    // The first micro-step replaces the gradient: no read of the old one (from NVMe).
    const Access access = p.first ? Access::kOverwrite : Access::kWrite;
    STRATA_ASSIGN_OR_RETURN(Lease acc, store->Acquire(s.grad, tier, access, timeout()));
    float* a = static_cast<float*>(acc.data());
    STRATA_RETURN_IF_ERROR(AccumulatePooled(*pool, a, src, dtype, post_scale, p.first, s.elems));
    acc.MarkDirty();
    s.stats_valid = false;
    if (p.last && s.owner == rank) {
      STRATA_ASSIGN_OR_RETURN(kernels::GradStats st,
                              kernels::ComputeGradStats(*pool, a, DType::kF32, s.elems));
      s.sum_sq = st.sum_sq;
      s.nonfinite = st.nonfinite;
      s.stats_valid = true;
    }
  }
  return Status::OK();
}

}  // namespace strata
