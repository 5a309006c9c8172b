// Engine: gathering parameters (stage 3: shard fetch + all-gather, with the prefetching gather
// scheduler) and reducing gradients into the fp32 accumulated gradient of each sub-group.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <optional>

#include "core/zero/engine_internal.h"
#include "kernels/casts.h"
#include "kernels/grad_stats.h"
#include "kernels/quantize.h"
#include "strata/device_kernels.h"

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
// the same expression for every placement and as the CUDA kernel, so results never depend on
// where acc lives): kernels::AccumulateGrad, the widening cast fused in (one pass over memory; a
// cast into a scratch then a scalar loop cost the backward 0.3 s of its 1.2 s at 1B params on two
// cores). Element-wise, so the split over the pool's threads never changes a bit.
Status AccumulatePooled(kernels::KernelPool& pool, float* acc, const void* grad, DType dtype,
                        float scale, bool overwrite, size_t n) {
  if (n < (size_t{1} << 16)) return kernels::AccumulateGrad(acc, grad, dtype, scale, overwrite, n);
  return kernels::AccumulateGrad(pool, acc, grad, dtype, scale, overwrite, n);
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
  if (spec && spec->group_queued[g] != 0) {
    // speculative_step has stepped (or is stepping) g during this backward: the trainer must
    // see the params from before the step.
    STRATA_RETURN_IF_ERROR(CancelSpeculation());
  }
  const auto t0 = Clock::now();
  zero::GroupState& gs = groups[g];
  const std::string& name = model.groups[g].name;
  GatheredGroup out;
  out.group_ = g;
  out.dtype_ = dtype;
  out.numel_ = gs.numel;
  out.offsets_ = gs.param_offsets;
  // Every handle given out is counted until its Release (Step refuses while any is out; the
  // speculative step waits for the group's).
  auto handed_out = [&] {
    ++outstanding_gathers;
    ++gs.gathered;
    timings.gather_wait_ns += Since(t0);
    return std::move(out);
  };
  if (!placement.params_partitioned) {
    const auto f0 = Clock::now();
    auto lease = store->Acquire(gs.param, Tier::kDevice, Access::kRead, timeout());
    timings.gather_fetch_wait_ns += Since(f0);
    if (!lease.ok()) return Fail(WithContext(lease.status(), "gather of group '" + name + "'"));
    out.data_ = lease->data();
    out.hold_ = std::make_shared<Lease>(std::move(*lease));
  } else if (Status up = WaitForUpdate(g); !up.ok()) {
    return up;  // overlap_step: the step running behind failed (the engine has failed)
  } else if (gs.cached) {
    out.data_ = gs.cached->buffer.get();
    out.hold_ = gs.cached;
  } else {
    if (!in_step) {
      gather->BeginStep();
      in_step = true;
      ++gather_epoch;
    }
    const auto f0 = Clock::now();
    auto shard = gather->Gather(static_cast<sched::GroupId>(g), timeout());
    timings.gather_fetch_wait_ns += Since(f0);
    if (!shard.ok()) return Fail(WithContext(shard.status(), "gather of group '" + name + "'"));
    if (AliasesShard()) {
      // One rank: the shard is the whole group. The trainer reads the scheduler's device copy
      // itself until Release (no buffer, no copy); Step refuses while it is held, and with
      // overlap_step WaitForUpdate above has seen g's update written before the lease was taken.
      auto copy = std::make_shared<zero::GatheredCopy>();
      out.data_ = shard->data();
      copy->shard.emplace(std::move(*shard));
      out.hold_ = std::move(copy);
      return handed_out();
    }
    const uint64_t bytes = gs.shard.padded_elems(world) * elt;
    auto full = DeviceBuffer::Make(opt.device, bytes);
    if (!full.ok() && full.status().code() == Status::Code::kResourceExhausted &&
        cached_elems > 0) {
      DropKeptCopies();  // make room (they are re-gathered when needed)
      full = DeviceBuffer::Make(opt.device, bytes);
    }
    if (!full.ok()) {
      return Fail(WithContext(full.status(), "gathered buffer of group '" + name + "'"));
    }
    Status st = GatherInto(g, shard->data(), full->get());
    gather->Release(static_cast<sched::GroupId>(g), std::move(*shard));
    if (!st.ok()) return Fail(CollectiveError(st, "all-gather of group '" + name + "'"));
    auto copy = std::make_shared<zero::GatheredCopy>();
    copy->buffer = std::move(*full);
    out.data_ = copy->buffer.get();
    out.hold_ = std::move(copy);
  }
  return handed_out();
}

Status Engine::Impl::CollectiveError(const Status& st, const std::string& what) const {
  Status out = WithContext(st, what);
  if (st.code() != Status::Code::kDeadlineExceeded || world == 1) return out;
  // A peer that is alive but runs other collectives looks the same as one that hangs.
  return Status(out.code(), std::string(out.message()) +
                                " (a rank that has not joined it failed, hangs, or started other "
                                "collectives: " +
                                std::string(kSameCollectivesRule) + ")");
}

Status Engine::Impl::GatherInto(size_t g, const void* shard, void* full) {
  TraceCollective('g', g);
  zero::GroupState& gs = groups[g];
  const size_t S = gs.shard.shard_elems;
  const bool hpz = zpp.hpz > 1;
  if (hpz && gs.secondary && gs.secondary_epoch == gather_epoch) {
    // hpZ, a later gather in this step: the k-rank group's secondary slices make up the group.
    Communicator* c = zpp.hpz_comm();
    STRATA_ASSIGN_OR_RETURN(CommHandle h,
                            c->AllGather(gs.secondary.get(), full,
                                         zero::HpzSecondaryElems(gs.shard, world, zpp.hpz), dtype));
    return h.WaitUntil(deadline());
  }
  if (!zpp.qwz) {
    STRATA_ASSIGN_OR_RETURN(CommHandle h, opt.comm->AllGather(shard, full, S, dtype));
    STRATA_RETURN_IF_ERROR(h.WaitUntil(deadline()));
  } else {
    // qwZ: quantize the shard, all-gather INT8 + scales, dequantize every rank's part.
    const kernels::Int8Wire w = kernels::Int8WireLayout(S, kernels::kQuantBlock);
    const size_t total = w.total_bytes * static_cast<size_t>(world);
    STRATA_ASSIGN_OR_RETURN(DeviceBuffer wire, DeviceBuffer::Make(opt.device, total));
    const bool direct = opt.device->host_addressable();
    std::vector<uint8_t> staged;
    uint8_t* host_wire = static_cast<uint8_t*>(wire.get());
    const void* host_shard = shard;
    if (!direct) {
      staged.resize(total + S * elt);
      host_wire = staged.data();
      host_shard = staged.data() + total;
      STRATA_RETURN_IF_ERROR(ToHost(staged.data() + total, shard, S * elt));
    }
    uint8_t* mine = host_wire + static_cast<size_t>(rank) * w.total_bytes;
    STRATA_ASSIGN_OR_RETURN(
        size_t bad, kernels::QuantizeInt8(*pool, dtype, host_shard, S, kernels::kQuantBlock,
                                          reinterpret_cast<int8_t*>(mine),
                                          reinterpret_cast<float*>(mine + w.scales_offset)));
    if (bad > 0) return NonFiniteWeight(g, host_shard);
    uint8_t* dev_mine =
        static_cast<uint8_t*>(wire.get()) + static_cast<size_t>(rank) * w.total_bytes;
    STRATA_RETURN_IF_ERROR(ToDevice(dev_mine, mine, w.total_bytes));
    STRATA_ASSIGN_OR_RETURN(CommHandle h,
                            opt.comm->AllGather(dev_mine, wire.get(), w.total_bytes, DType::kI8));
    STRATA_RETURN_IF_ERROR(h.WaitUntil(deadline()));
    STRATA_RETURN_IF_ERROR(ToHost(host_wire, wire.get(), total));
    std::vector<uint8_t> host_full;
    uint8_t* out = static_cast<uint8_t*>(full);
    if (!direct) {
      host_full.resize(static_cast<size_t>(world) * S * elt);
      out = host_full.data();
    }
    for (int r = 0; r < world; ++r) {
      const uint8_t* part = host_wire + static_cast<size_t>(r) * w.total_bytes;
      STRATA_RETURN_IF_ERROR(kernels::DequantizeInt8(
          *pool, reinterpret_cast<const int8_t*>(part),
          reinterpret_cast<const float*>(part + w.scales_offset), S, kernels::kQuantBlock, dtype,
          out + static_cast<size_t>(r) * S * elt));
    }
    STRATA_RETURN_IF_ERROR(ToDevice(full, out, host_full.size()));
  }
  if (hpz) {
    // The step's first gather of the group: keep this rank's slice for the later ones.
    const size_t slice = zero::HpzSecondaryElems(gs.shard, world, zpp.hpz);
    if (!gs.secondary) {
      STRATA_ASSIGN_OR_RETURN(gs.secondary, DeviceBuffer::Make(opt.device, slice * elt));
    }
    const int j = zpp.hpz_comm()->rank();
    const uint8_t* from = static_cast<const uint8_t*>(full) + static_cast<size_t>(j) * slice * elt;
    if (opt.device->host_addressable()) {
      std::memcpy(gs.secondary.get(), from, slice * elt);
    } else {
      std::vector<uint8_t> staged(slice * elt);
      STRATA_RETURN_IF_ERROR(ToHost(staged.data(), from, staged.size()));
      STRATA_RETURN_IF_ERROR(ToDevice(gs.secondary.get(), staged.data(), staged.size()));
    }
    gs.secondary_epoch = gather_epoch;
  }
  return Status::OK();
}

Status Engine::Impl::NonFiniteWeight(size_t g, const void* host_shard) const {
  const zero::GroupState& gs = groups[g];
  const size_t S = gs.shard.shard_elems;
  std::vector<float> v(S);
  if (dtype == DType::kF32) {
    std::memcpy(v.data(), host_shard, S * 4);
  } else {
    (void)kernels::Cast(host_shard, dtype, v.data(), DType::kF32, S);
  }
  const GroupSpec& spec = model.groups[g];
  for (size_t i = 0; i < S; ++i) {
    if (std::isfinite(v[i])) continue;
    const size_t at = static_cast<size_t>(rank) * S + i;
    for (size_t p = 0; p < spec.params.size(); ++p) {
      if (at >= gs.param_offsets[p] && at < gs.param_offsets[p] + spec.params[p].numel()) {
        return Status::InvalidArgument(
            "zero_quantized_weights: parameter '" + spec.name + "." + spec.params[p].name +
            "' holds a non-finite value (" + std::to_string(v[i]) + " at element " +
            std::to_string(at - gs.param_offsets[p]) + "): it cannot be quantized");
      }
    }
  }
  return Status::InvalidArgument("zero_quantized_weights: group '" + spec.name +
                                 "' holds a non-finite value: it cannot be quantized");
}

Status Engine::Impl::Release(GatheredGroup gathered, std::optional<uintptr_t> caller_stream) {
  if (!gathered) return Status::OK();
  Status ordered;
  if (caller_stream && OrdersCallerStreams() && !GathersAliasHome()) {
    // Before the memory is rewritten (the store's copies into it, a speculative step's kernels)
    // or freed (ordered after every queue, so after these): the trainer's reads first.
    ordered = Fail(opt.device->WaitCallerStream(*caller_stream, kHostToDeviceQueue | kKernelQueue));
  }
  const size_t g = gathered.group_;
  --outstanding_gathers;
  --groups[g].gathered;
  DropGathered(std::move(gathered));  // the handle's lease or copy is gone (or kept) from here
  if (groups[g].gathered == 0 && spec && spec->final_pending[g]) {
    OnGradientFinal(g);  // its gradient became final while it was gathered
  }
  return ordered;
}

void Engine::Impl::DropGathered(GatheredGroup gathered) {
  if (!placement.params_partitioned || !failed.ok()) return;  // the lease / copy goes with it
  const size_t g = gathered.group_;
  zero::GroupState& gs = groups[g];
  auto copy = std::static_pointer_cast<zero::GatheredCopy>(gathered.hold_);
  if (copy && copy->shard) {
    // The scheduler's own copy (AliasesShard): back to it; it keeps or evicts the copy.
    gathered.hold_.reset();
    if (gather != nullptr) gather->Release(static_cast<sched::GroupId>(g), std::move(*copy->shard));
    return;
  }
  const uint64_t padded = gs.shard.padded_elems(world);
  bool keep = Persistent(g);
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

Status Engine::Impl::ReduceGradients(size_t g, std::optional<uintptr_t> caller_stream) {
  STRATA_RETURN_IF_ERROR(CheckHealthy());
  if (g >= groups.size()) {
    return Status::InvalidArgument("ReduceGradients: group " + std::to_string(g) + " out of range");
  }
  if (!model.groups[g].trainable) return FrozenRefusal("ReduceGradients", g);
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
  if (caller_stream && OrdersCallerStreams()) {
    // Before the buffer's readers (the accumulation's kernels, the copies that stage it to the
    // host): the trainer's writes first. The prefetch copies do not wait for the trainer.
    STRATA_RETURN_IF_ERROR(
        Fail(opt.device->WaitCallerStream(*caller_stream, kDeviceToHostQueue | kKernelQueue)));
  }
  const auto t0 = Clock::now();
  zero::PendingReduce p;
  p.group = g;
  p.full = std::move(gs.grad);
  --grad_buffers_out;
  p.first = gs.reductions == 0;
  ++gs.reductions;
  p.last = gs.reductions == gas;
  // One rank: the reduction is the identity (a sum of one term; predivide scales by 1/1), so
  // Accumulate reads the trainer's buffer itself: no collective, no shard buffer, no copy.
  if (world > 1 || zpp.qgz) {
    Status st = StartReduction(p);
    if (!st.ok()) return st;
  }
  pending.push_back(std::move(p));
  // Without overlap_comm the reduction and its accumulation complete now; with it, up to two
  // stay in flight behind the trainer's backward (the device working set counts three gradient
  // buffers), fewer while the trainer holds a buffer back (GradBuffer, engine.h).
  Status st = DrainReductions(!overlap_comm);
  while (st.ok() && !pending.empty() &&
         pending.size() + static_cast<size_t>(grad_buffers_out) > 2) {
    st = DrainFront();
  }
  timings.reduce_wait_ns += Since(t0);
  return st;
}

Result<DeviceBuffer> Engine::Impl::NewGradBuffer(size_t g, std::optional<uintptr_t> caller_stream) {
  const uint64_t bytes = groups[g].shard.padded_elems(world) * elt;
  const bool ordered = caller_stream && OrdersCallerStreams();
  DeviceBuffer buf;
  if (!spare_grads.empty()) {
    buf = std::move(spare_grads.back());
    spare_grads.pop_back();
  } else {
    // Where it may be kept for reuse, at the size every group fits.
    auto made = DeviceBuffer::Make(
        opt.device, OrdersCallerStreams() ? std::max(bytes, grad_buffer_bytes) : bytes);
    if (!made.ok()) {
      return Fail(Status(made.status().code(), "gradient buffer of group '" + model.groups[g].name +
                                                   "': " + std::string(made.status().message())));
    }
    buf = std::move(*made);
  }
  if (ordered) {
    // Cleared by the device's kernels, after those that read it last; the trainer's stream runs
    // its writes after that.
    STRATA_RETURN_IF_ERROR(Fail(opt.device->kernels()->Zero(buf.get(), bytes)));
    // Only the kernels': the buffer's earlier readers were the kernels, or staging copies the
    // host waited for before the buffer came back (AccumulateStaged); the trainer's work does not
    // wait for the copies in flight (prefetches, staged gradients).
    STRATA_RETURN_IF_ERROR(Fail(opt.device->OrderCallerStream(*caller_stream, kKernelQueue)));
  } else {
    STRATA_RETURN_IF_ERROR(Fail(ZeroDevice(buf.get(), bytes)));
  }
  return buf;
}

void Engine::Impl::RecycleGradBuffer(DeviceBuffer buffer) {
  // Alive besides it: the buffers the trainer holds, the other pending reductions' and the spares.
  const uint64_t alive =
      static_cast<uint64_t>(grad_buffers_out) + pending.size() - 1 + spare_grads.size();
  if (OrdersCallerStreams() && buffer && buffer.size_bytes() == grad_buffer_bytes &&
      alive < grad_buffer_cap) {
    spare_grads.push_back(std::move(buffer));
  }  // else freed here (stream-ordered)
}

Status Engine::Impl::StartReduction(zero::PendingReduce& p) {
  const size_t g = p.group;
  TraceCollective('r', g);
  zero::GroupState& gs = groups[g];
  const std::string& name = model.groups[g].name;
  auto shard = DeviceBuffer::Make(opt.device, gs.shard.shard_elems * elt);
  if (!shard.ok())
    return Fail(WithContext(shard.status(), "reduced gradient of group '" + name + "'"));
  p.shard = std::move(*shard);
  if (zpp.qgz) {
    // The two all-to-alls have quantization work between them: a thread runs them, after the
    // previous group's (the node and cross communicators are used by that thread only).
    std::shared_future<Status> prev = last_qgz;
    const void* full = p.full.get();
    void* out = p.shard.get();
    p.async = std::async(std::launch::async, [this, g, full, out, prev] {
                if (prev.valid()) prev.wait();
                return QuantizedReduceScatter(g, full, out);
              }).share();
    last_qgz = p.async;
  } else {
    ReduceOptions ro;
    ro.predivide = predivide;
    auto rs = opt.comm->ReduceScatter(p.full.get(), p.shard.get(), gs.shard.shard_elems, dtype, ro);
    if (!rs.ok()) return Fail(WithContext(rs.status(), "reduce-scatter of group '" + name + "'"));
    p.handles.push_back(*rs);
  }
  if (!placement.optimizer_partitioned && world > 1) {
    // Stage 0: every rank steps the whole model; the reduced shards are all-gathered (the second
    // half of an all-reduce), so every rank sees exactly the values their owner reduced.
    auto ag = opt.comm->AllGather(p.shard.get(), p.full.get(), gs.shard.shard_elems, dtype);
    if (!ag.ok())
      return Fail(WithContext(ag.status(), "all-gather of the gradient of group '" + name + "'"));
    p.handles.push_back(*ag);
  }
  return Status::OK();
}

namespace {

// One all-to-all's INT8 wire buffers: on the device, seen from the host directly or through
// staging copies (a device the host cannot address).
struct QuantWire {
  DeviceBuffer send_dev, recv_dev;
  std::vector<uint8_t> send_stage, recv_stage;
  uint8_t* send = nullptr;
  uint8_t* recv = nullptr;
  size_t bytes = 0;

  Status Make(Device* device, size_t n) {
    bytes = n;
    STRATA_ASSIGN_OR_RETURN(send_dev, DeviceBuffer::Make(device, n));
    STRATA_ASSIGN_OR_RETURN(recv_dev, DeviceBuffer::Make(device, n));
    if (device->host_addressable()) {
      send = static_cast<uint8_t*>(send_dev.get());
      recv = static_cast<uint8_t*>(recv_dev.get());
    } else {
      send_stage.resize(n);
      recv_stage.resize(n);
      send = send_stage.data();
      recv = recv_stage.data();
    }
    return Status::OK();
  }

  // Sends `send` (staged up first when needed), waits, and brings `recv` to the host.
  Status AllToAll(Engine::Impl& e, Communicator* c) {
    STRATA_RETURN_IF_ERROR(e.ToDevice(send_dev.get(), send, bytes));
    STRATA_ASSIGN_OR_RETURN(
        CommHandle h, c->AllToAll(send_dev.get(), recv_dev.get(),
                                  bytes / static_cast<size_t>(c->world_size()), DType::kI8));
    STRATA_RETURN_IF_ERROR(h.WaitUntil(e.deadline()));
    return e.ToHost(recv, recv_dev.get(), bytes);
  }
};

}  // namespace

// qgZ, after ZeRO++'s all-to-all scheme: rank r = n * L + l (node n, local index l) owns shard r.
//   1. Quantize each of the N shards of the gradient (INT8, kQuantBlock) and all-to-all within
//      the node: local peer l' receives the shards of the ranks with local index l'
//      (n' * L + l' for every node n').
//   2. Sum what the L local peers sent for those `nodes` shards in fp32, in local-index order.
//   3. Re-quantize the nodes partial sums; all-to-all across nodes among the ranks with local
//      index l: node n' receives its rank's shard.
//   4. Sum the nodes partial sums of shard r in fp32, in node order; predivide (1 / world); round
//      once to the working dtype.
// A hop with one rank (L == 1 or one node) moves nothing and is skipped, with its quantization.
// A NaN / Inf makes its block's scale NaN, so the sum is NaN and the step is skipped on every rank
// (the norm exchange).
Status Engine::Impl::QuantizedReduceScatter(size_t g, const void* full, void* shard) {
  const zero::GroupState& gs = groups[g];
  const size_t S = gs.shard.shard_elems;
  const int L = zpp.local, nodes = zpp.nodes;
  const kernels::Int8Wire w = kernels::Int8WireLayout(S, kernels::kQuantBlock);
  const size_t cw = w.total_bytes;
  const bool direct = opt.device->host_addressable();
  auto q_of = [&](uint8_t* chunk) { return reinterpret_cast<int8_t*>(chunk); };
  auto s_of = [&](uint8_t* chunk) { return reinterpret_cast<float*>(chunk + w.scales_offset); };
  // Host view of the gradient.
  std::vector<uint8_t> staged_full;
  const uint8_t* grad = static_cast<const uint8_t*>(full);
  if (!direct) {
    staged_full.resize(static_cast<size_t>(world) * S * elt);
    STRATA_RETURN_IF_ERROR(ToHost(staged_full.data(), full, staged_full.size()));
    grad = staged_full.data();
  }
  // Steps 1-2: partial[n'] = the node's sum of shard n' * L + l.
  std::vector<float> partial(static_cast<size_t>(nodes) * S, 0.0f);
  if (L == 1) {
    for (int n2 = 0; n2 < nodes; ++n2) {
      const uint8_t* src = grad + static_cast<size_t>(n2) * S * elt;
      float* dst = partial.data() + static_cast<size_t>(n2) * S;
      if (dtype == DType::kF32) {
        std::memcpy(dst, src, S * 4);
      } else {
        STRATA_RETURN_IF_ERROR(kernels::Cast(src, dtype, dst, DType::kF32, S));
      }
    }
  } else {
    QuantWire w1;
    STRATA_RETURN_IF_ERROR(w1.Make(opt.device, static_cast<size_t>(world) * cw));
    for (int l2 = 0; l2 < L; ++l2) {
      for (int n2 = 0; n2 < nodes; ++n2) {
        const size_t owner = static_cast<size_t>(n2) * L + l2;
        uint8_t* chunk = w1.send + (static_cast<size_t>(l2) * nodes + n2) * cw;
        STRATA_RETURN_IF_ERROR(kernels::QuantizeInt8(*pool, dtype, grad + owner * S * elt, S,
                                                     kernels::kQuantBlock, q_of(chunk), s_of(chunk))
                                   .status());
      }
    }
    STRATA_RETURN_IF_ERROR(w1.AllToAll(*this, zpp.node.get()));
    for (int l2 = 0; l2 < L; ++l2) {
      for (int n2 = 0; n2 < nodes; ++n2) {
        uint8_t* chunk = w1.recv + (static_cast<size_t>(l2) * nodes + n2) * cw;
        STRATA_RETURN_IF_ERROR(kernels::DequantizeAddInt8(
            *pool, q_of(chunk), s_of(chunk), S, kernels::kQuantBlock, partial.data() + n2 * S));
      }
    }
  }
  // Steps 3-4.
  std::vector<float> sum;
  if (nodes == 1) {
    sum = std::move(partial);
  } else {
    QuantWire w2;
    STRATA_RETURN_IF_ERROR(w2.Make(opt.device, static_cast<size_t>(nodes) * cw));
    for (int n2 = 0; n2 < nodes; ++n2) {
      uint8_t* chunk = w2.send + static_cast<size_t>(n2) * cw;
      STRATA_RETURN_IF_ERROR(kernels::QuantizeInt8(*pool, DType::kF32, partial.data() + n2 * S, S,
                                                   kernels::kQuantBlock, q_of(chunk), s_of(chunk))
                                 .status());
    }
    STRATA_RETURN_IF_ERROR(w2.AllToAll(*this, zpp.cross.get()));
    sum.assign(S, 0.0f);
    for (int n2 = 0; n2 < nodes; ++n2) {
      uint8_t* chunk = w2.recv + static_cast<size_t>(n2) * cw;
      STRATA_RETURN_IF_ERROR(kernels::DequantizeAddInt8(*pool, q_of(chunk), s_of(chunk), S,
                                                        kernels::kQuantBlock, sum.data()));
    }
  }
  if (predivide) {
    const float inv = 1.0f / static_cast<float>(world);
    for (float& v : sum) v *= inv;
  }
  std::vector<uint8_t> staged_out;
  uint8_t* out = static_cast<uint8_t*>(shard);
  if (!direct) {
    staged_out.resize(S * elt);
    out = staged_out.data();
  }
  if (dtype == DType::kF32) {
    std::memcpy(out, sum.data(), S * 4);
  } else {
    STRATA_RETURN_IF_ERROR(kernels::Cast(sum.data(), DType::kF32, out, dtype, S));
  }
  return ToDevice(shard, out, S * elt);
}

bool zero::PendingReduce::Ready() const {
  for (const CommHandle& h : handles) {
    if (!h.Ready()) return false;
  }
  return !async.valid() || async.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

Status zero::PendingReduce::Wait(std::chrono::steady_clock::time_point deadline) const {
  Status st = zero::WaitAll(handles, deadline);
  if (async.valid()) {
    if (async.wait_until(deadline) != std::future_status::ready) {
      return Status::DeadlineExceeded("quantized reduce-scatter (qgZ) did not finish");
    }
    if (st.ok()) st = async.get();
  }
  return st;
}

Status Engine::Impl::DrainReductions(bool all) {
  // Accumulations start in order, each once its reduction has completed.
  for (zero::PendingReduce& p : pending) {
    if (p.accumulated) continue;
    if (!all && !p.Ready()) break;
    STRATA_RETURN_IF_ERROR(StartAccumulate(p));
  }
  // And end in order.
  while (!pending.empty() && pending.front().accumulated) {
    if (!all && pending.front().accumulating.wait_for(std::chrono::seconds(0)) !=
                    std::future_status::ready) {
      break;
    }
    STRATA_RETURN_IF_ERROR(DrainFront());
  }
  return Status::OK();
}

Status Engine::Impl::DrainFront() {
  zero::PendingReduce& p = pending.front();
  const std::string& name = model.groups[p.group].name;
  if (!p.accumulated) STRATA_RETURN_IF_ERROR(StartAccumulate(p));
  // Bounded: each of its store leases waits at most the timeout.
  Status st = p.accumulating.get();
  if (!st.ok()) return Fail(WithContext(st, "gradient accumulation of group '" + name + "'"));
  FinishAccumulate(p);
  RecycleGradBuffer(std::move(p.full));
  pending.pop_front();
  return Status::OK();
}

bool Engine::Impl::AccumulatesBehind(const zero::PendingReduce& p) const {
  bool on_host = true;
  for (size_t si : groups[p.group].sub_groups) {
    on_host = on_host && DeviceKernelsFor(HomeOf(subs[si], StateKind::kGrad)) == nullptr;
  }
  return sched::AccumulatesBehind(overlap_comm, on_host);
}

Status Engine::Impl::StartAccumulate(zero::PendingReduce& p) {
  Status reduced = p.Wait(deadline());
  if (!reduced.ok()) {
    return Fail(CollectiveError(
        reduced, "gradient reduction of group '" + model.groups[p.group].name + "'"));
  }
  p.accumulated = std::make_shared<zero::Accumulated>();
  if (AccumulatesBehind(p)) {
    if (!accumulator) accumulator = std::make_unique<zero::SerialWorker>();
    // p stays where it is (a deque keeps its elements in place) until DrainFront pops it, after
    // the job has ended.
    const zero::PendingReduce* job = &p;
    zero::Accumulated* out = p.accumulated.get();
    p.accumulating = accumulator->Post([this, job, out] { return Accumulate(*job, out); });
    return Status::OK();
  }
  std::promise<Status> done;
  done.set_value(Accumulate(p, p.accumulated.get()));
  p.accumulating = done.get_future().share();
  return Status::OK();
}

Status Engine::Impl::Accumulate(const zero::PendingReduce& p, zero::Accumulated* out) {
  const zero::GroupState& gs = groups[p.group];
  out->stats.assign(gs.sub_groups.size(), std::nullopt);
  for (size_t k = 0; k < gs.sub_groups.size(); ++k) {
    const SubGroup& s = subs[gs.sub_groups[k]];
    const Tier home = HomeOf(s, StateKind::kGrad);
    // Device-resident gradients on a device with kernels accumulate there, in place; otherwise
    // on the host (staged from a device the host cannot address).
    kernels::DeviceKernels* dk = DeviceKernelsFor(home);
    const Tier tier = dk != nullptr ? Tier::kDevice : ComputeTier(home);
    const uint8_t* src = ReducedGrad(p, s);
    // The first micro-step replaces the gradient: no read of the old one (from NVMe).
    const Access access = p.first ? Access::kOverwrite : Access::kWrite;
    const auto l0 = Clock::now();
    auto leased = store->Acquire(s.grad, tier, access, timeout());
    out->lease_wait_ns += Since(l0);
    STRATA_ASSIGN_OR_RETURN(Lease acc, std::move(leased));
    float* a = static_cast<float*>(acc.data());
    const bool stats = p.last && s.owner == rank;  // the partition's final gradient
    std::optional<kernels::GradStats>& st = out->stats[k];
    if (grad_dtype != DType::kF32) {
      if (dk != nullptr || tier == Tier::kDevice) {
        return Status::Internal("gradient of '" + model.groups[p.group].name + "' kept in " +
                                std::string(DTypeName(grad_dtype)) + " on the device");
      }
      STRATA_RETURN_IF_ERROR(CopyFinalGrad(src, acc.data(), s.elems, stats ? &st : nullptr));
    } else if (dk != nullptr) {
      // Queued, not waited for: the trainer's buffer is freed stream-ordered behind these
      // kernels, and Step collects the statistics (engine_device.cc).
      STRATA_RETURN_IF_ERROR(dk->AccumulateGrad(a, src, dtype, post_scale, p.first, s.elems));
      if (stats) STRATA_RETURN_IF_ERROR(QueueDeviceStats(gs.sub_groups[k], a));
    } else if (!opt.device->host_addressable()) {
      STRATA_RETURN_IF_ERROR(AccumulateStaged(src, a, p.first, s.elems, stats ? &st : nullptr));
    } else if (stats) {
      // One walk accumulates and sums.
      STRATA_ASSIGN_OR_RETURN(
          st, kernels::AccumulateGradWithStats(*pool, a, src, dtype, post_scale, p.first, s.elems));
    } else {
      STRATA_RETURN_IF_ERROR(AccumulatePooled(*pool, a, src, dtype, post_scale, p.first, s.elems));
    }
    acc.MarkDirty();
    acc.Release();
    // A completed NVMe-homed gradient goes home now, beside the backward's param reads and the
    // next sub-group's accumulation, instead of when the host runs out of room: then the store
    // wrote every dirty gradient at once while the gathers it parked waited (bench engine, 1B
    // params on nvme, 3 GB host: 21 gradients, 2.6 GB, in one burst), and the optimizer drops
    // clean copies without a write. Not where the host caches all of them (nvme_state_cached).
    if (p.last && home == Tier::kNvme && tier != home && !nvme_state_cached) {
      out->written.push_back(store->WriteBack(s.grad));
    }
  }
  return Status::OK();
}

namespace {

// Staged gradients move in pieces of about an eighth of the largest sub-group, on kStatsChunk
// boundaries, at most 8 Mi elements (16 MiB of bf16): enough pieces for the copies to hide
// behind the accumulation, few enough that the per-copy cost stays small.
size_t StagePieceElems(uint64_t largest_sub) {
  constexpr size_t kMaxPiece = size_t{8} << 20;
  constexpr uint64_t kChunk = kernels::kStatsChunk;
  const uint64_t eighth = (largest_sub + 7) / 8;
  const uint64_t rounded = (eighth + kChunk - 1) / kChunk * kChunk;
  return static_cast<size_t>(std::clamp<uint64_t>(rounded, kChunk, kMaxPiece));
}

// The staging copies in flight (at most one per half): every exit waits for them, so no copy
// still writes the staging buffer once the next user holds it. One still running after
// `timeout` calls `overran` (CopyOverran's mark: the buffer has no next user).
struct StagingCopies {
  std::chrono::nanoseconds timeout;
  std::function<void()> overran;
  std::future<Status> half[2];
  ~StagingCopies() {
    for (std::future<Status>& f : half) {
      if (f.valid() && f.wait_for(timeout) != std::future_status::ready) overran();
    }
  }
};

}  // namespace

Status Engine::Impl::StageFromDevice(
    const uint8_t* src, size_t n,
    const std::function<Status(const uint8_t*, size_t, size_t)>& use) {
  std::lock_guard<std::mutex> lock(grad_staging.mu);
  STRATA_RETURN_IF_ERROR(CheckNoCopyOverran());
  const uint64_t most = std::max<uint64_t>(largest_sub_elems, n);
  const size_t piece = StagePieceElems(most);
  STRATA_ASSIGN_OR_RETURN(
      uint8_t * buf,
      grad_staging.Get(opt.device, (most > piece ? 2 * piece : most) * elt, pin_host));
  StagingCopies copies{opt.timeout, [this] { copy_overran.store(true); }, {}};
  // Piece i: elements [i * piece, + its length), staged in half i % 2.
  auto length = [&](size_t i) { return std::min(piece, n - i * piece); };
  auto staged = [&](size_t i) { return buf + (i % 2) * piece * elt; };
  auto start = [&](size_t i) -> Status {
    auto done = std::make_shared<std::promise<Status>>();
    copies.half[i % 2] = done->get_future();
    return opt.device->CopyAsync(CopyDir::kDeviceToHost, staged(i), src + i * piece * elt,
                                 length(i) * elt,
                                 [done](Status st) { done->set_value(std::move(st)); });
  };
  STRATA_RETURN_IF_ERROR(start(0));
  for (size_t i = 0, at = 0; at < n; ++i, at += piece) {
    // The next piece's copy (into the other half, whose use is done) runs beside this piece's.
    if (at + piece < n) STRATA_RETURN_IF_ERROR(start(i + 1));
    const size_t m = length(i);
    std::future<Status>& copied = copies.half[i % 2];
    if (copied.wait_for(opt.timeout) != std::future_status::ready) {
      return CopyOverran(Status::DeadlineExceeded("device copy (device->host, " +
                                                  std::to_string(m * elt) +
                                                  " bytes of a staged gradient) did not finish"));
    }
    STRATA_RETURN_IF_ERROR(copied.get());
    STRATA_RETURN_IF_ERROR(use(staged(i), at, m));
  }
  return Status::OK();
}

Status Engine::Impl::AccumulateStaged(const uint8_t* src, float* acc, bool overwrite, size_t n,
                                      std::optional<kernels::GradStats>* stats) {
  kernels::ExactSum sum;
  STRATA_RETURN_IF_ERROR(
      StageFromDevice(src, n, [&](const uint8_t* piece, size_t at, size_t m) -> Status {
        if (stats != nullptr) {
          return kernels::AccumulateGradAddStats(*pool, acc + at, piece, dtype, post_scale,
                                                 overwrite, m, &sum);
        }
        return AccumulatePooled(*pool, acc + at, piece, dtype, post_scale, overwrite, m);
      }));
  if (stats != nullptr) *stats = sum.Stats();
  return Status::OK();
}

Status Engine::Impl::CopyFinalGrad(const uint8_t* src, void* dst, size_t n,
                                   std::optional<kernels::GradStats>* stats) {
  if (post_scale != 1.0f || gas != 1 || DTypeSize(grad_dtype) != elt) {
    return Status::Internal("a gradient kept in " + std::string(DTypeName(grad_dtype)) +
                            " is scaled or accumulated (sched::GradStateDType)");
  }
  auto copy = [&](const uint8_t* from, size_t at, size_t m) -> Status {
    uint8_t* to = static_cast<uint8_t*>(dst) + at * elt;
    zero::PooledCopy(*pool, 1, &to, &from, &elt, m);
    return Status::OK();
  };
  if (opt.device->host_addressable()) {
    STRATA_RETURN_IF_ERROR(copy(src, 0, n));
  } else if (host_blocks_locked || !pin_host) {
    // Into the store's host block directly: page-locked by the pinned pool (an asynchronous
    // copy), or pageable as a staging buffer would be too.
    STRATA_RETURN_IF_ERROR(CopyDirect(CopyDir::kDeviceToHost, dst, src, n * elt));
  } else {
    // pin_memory without the pinned pool: the staging buffer is page-locked, the block is not.
    STRATA_RETURN_IF_ERROR(StageFromDevice(src, n, copy));
  }
  if (stats != nullptr) {
    STRATA_ASSIGN_OR_RETURN(*stats, kernels::ComputeGradStats(*pool, dst, grad_dtype, n));
  }
  return Status::OK();
}

void Engine::Impl::FinishAccumulate(const zero::PendingReduce& p) {
  const zero::GroupState& gs = groups[p.group];
  zero::Accumulated& out = *p.accumulated;
  for (size_t k = 0; k < gs.sub_groups.size(); ++k) {
    SubGroup& s = subs[gs.sub_groups[k]];
    s.stats_valid = out.stats[k].has_value();
    if (s.stats_valid) {
      s.sum_sq = out.stats[k]->sum_sq;
      s.nonfinite = out.stats[k]->nonfinite;
    }
  }
  timings.grad_lease_wait_ns += out.lease_wait_ns;
  for (Ticket& t : out.written) grad_write_behind.push_back(std::move(t));
  out.written.clear();
  if (p.last) OnGradientFinal(p.group);  // speculative_step: its Adam may start now
}

Status Engine::Impl::WriteBehindError(const std::vector<Ticket>& tickets, bool wait) const {
  Status first;
  for (const Ticket& t : tickets) {
    if (!wait && !t.ready()) continue;
    Status st = t.Wait(timeout());
    if (!st.ok() && first.ok()) first = st.WithContext("gradient write-behind");
  }
  return first;
}

Status Engine::Impl::CheckGradWriteBehind(bool wait) {
  Status first = WriteBehindError(grad_write_behind, wait);
  if (wait) grad_write_behind.clear();
  return first;
}

}  // namespace strata
