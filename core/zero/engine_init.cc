// Engine: initial weights (every rank fills its own, or rank 0 sends each rank what it stores)
// and the read-back of the fp32 master. See include/strata/engine.h for the contract.
//
// InitFromRank0's protocol. Every rank walks the same sequence of sub-group pieces (the
// sub-groups are cut from each shard at the same offsets on every rank, and at stage 0 every rank
// holds all of them), so the collectives match without any other agreement:
//   1. rank 0 validates its tensors and broadcasts a 16-byte header (verdict, piece size); on a
//      bad verdict every rank returns InvalidArgument before any data moves and nothing is
//      written (the engine stays healthy: a corrected call may follow).
//   2. for each sub-group, piece by piece (at most `piece` elements per rank): rank 0 packs, for
//      each rank j, the elements rank j stores at that place, copies them to the device and
//      - stage 1-3 (the master is partitioned): all-to-all, rank j receiving its piece from rank
//        0 (the other ranks' chunks are zeros and are dropped: the only way to scatter with the
//        Communicator's collectives);
//      - stage 0 (replicated): broadcast of the one piece every rank stores;
//      every rank copies what it received into its master lease. fp32 throughout: the master is
//      exactly rank 0's values (any bit pattern: -0, subnormals, NaN payloads).
//   3. as InitParameters: the working params are rounded from the master and stage 1-2 all-gather
//      them into their replicas.
//   4. rank 0 broadcasts a second header: whether its values held to the end (InitFromRank0Fill's
//      fill may fail part way; rank 0 then sends zeros for the rest, so that the collectives of
//      step 2 still match, and every rank returns an error here).
// Memory: two device buffers and one host buffer of world x piece floats; piece is chosen from
// `window_bytes` so that they stay within it, and no rank ever holds a whole group or the model.
// Errors: a failed or timed-out collective (a dead peer) fails the engine with the group and the
// piece named; each wait is bounded by EngineOptions::timeout.
#include <algorithm>
#include <cstring>
#include <functional>
#include <string>

#include <xxhash.h>

#include "core/zero/checkpoint_format.h"
#include "core/zero/engine_internal.h"
#include "kernels/casts.h"
#include "nlohmann/json.hpp"

namespace strata {

using zero::SubGroup;

namespace {

// Writes elements [b, b + n) of group g's padded flat buffer into out[0, n): each parameter's
// values from `fill`, zeros in the padding.
void FillFlat(const Engine::Impl& e, size_t g, size_t b, size_t n, const ParamFill& fill,
              float* out) {
  std::fill(out, out + n, 0.0f);
  const zero::GroupState& gs = e.groups[g];
  const size_t end = std::min(b + n, gs.numel);
  const auto& params = e.model.groups[g].params;
  for (size_t p = 0; p < params.size() && b < end; ++p) {
    const size_t po = gs.param_offsets[p], pn = params[p].numel();
    const size_t lo = std::max(b, po), hi = std::min(end, po + pn);
    if (lo < hi) fill(g, p, lo - po, hi - po, out + (lo - b));
  }
}

// OK while initial weights may be set: the engine is healthy and has taken no step.
Status CheckInitAllowed(const Engine::Impl& e, const char* op) {
  STRATA_RETURN_IF_ERROR(e.CheckHealthy());
  if (e.global_step > 0) {
    return Status::FailedPrecondition(std::string(op) + ": the engine has already taken steps");
  }
  return Status::OK();
}

// After the params were rewritten: copies made of the old values go (kept gathered groups, as
// after Step, and hpZ's secondary slices, which are reused within a step).
void ForgetCopiesOfOldParams(Engine::Impl& e) {
  e.DropKeptCopies();
  for (zero::GroupState& gs : e.groups) gs.secondary_epoch = -1;
}

// Fills the fp32 master of every sub-group this rank steps through `source` (given the
// sub-group and its zeroed master), rounds the working params from it, and all-gathers them
// where stage 1-2 keep full replicas.
using MasterSource = std::function<Status(const SubGroup& s, float* master)>;
Status InitMasters(Engine::Impl& e, const char* op, const MasterSource& source) {
  STRATA_RETURN_IF_ERROR(CheckInitAllowed(e, op));
  const Tier param_tier = e.ComputeTier(e.placement.Home(StateKind::kParam16));
  for (const SubGroup& s : e.subs) {
    const zero::GroupState& gs = e.groups[s.group];
    const Tier opt_tier = e.ComputeTier(e.HomeOf(s, StateKind::kMaster32));
    STRATA_ASSIGN_OR_RETURN(Lease master,
                            e.store->Acquire(s.master, opt_tier, Access::kWrite, e.timeout()));
    float* m = static_cast<float*>(master.data());
    std::fill(m, m + s.elems, 0.0f);
    STRATA_RETURN_IF_ERROR(source(s, m));
    master.MarkDirty();
    STRATA_ASSIGN_OR_RETURN(Lease param,
                            e.store->Acquire(gs.param, param_tier, Access::kWrite, e.timeout()));
    STRATA_RETURN_IF_ERROR(e.PublishParams(s, m, param));
  }
  // Frozen groups: the same values through a scratch piece straight into their params, their
  // fingerprint taken on the way (the initial values, whatever came before).
  for (zero::GroupState& gs : e.groups) {
    gs.frozen_print_part = gs.frozen_print_loaded = 0;
    gs.frozen_changed = gs.frozen_print_unknown = false;
  }
  std::vector<float> scratch;
  for (const SubGroup& s : e.frozen_pieces) {
    scratch.assign(s.elems, 0.0f);
    STRATA_RETURN_IF_ERROR(source(s, scratch.data()));
    zero::GroupState& gs = e.groups[s.group];
    gs.frozen_print_part +=
        zero::ckpt::FrozenFingerprint(e.FullOffset(s), scratch.data(), s.elems, gs.numel, e.dtype);
    STRATA_ASSIGN_OR_RETURN(Lease param, e.store->Acquire(e.groups[s.group].param, param_tier,
                                                          Access::kWrite, e.timeout()));
    STRATA_RETURN_IF_ERROR(e.PublishParams(s, scratch.data(), param));
  }
  // Initialised again after gathers (GatheredParameters(modifier_rank=...) before the first
  // step, or a frozen engine's, which never steps): a kept copy would be read instead.
  ForgetCopiesOfOldParams(e);
  return e.Fail(e.AllGatherUpdatedParams(/*frozen_too=*/true));
}

// InvalidArgument naming the first group or parameter whose tensor does not match the model.
Status CheckFullTensors(const ModelSpec& m, const char* op,
                        const std::vector<std::vector<std::span<const float>>>& tensors) {
  if (tensors.size() != m.groups.size()) {
    return Status::InvalidArgument(std::string(op) + ": " + std::to_string(tensors.size()) +
                                   " groups given, the model has " +
                                   std::to_string(m.groups.size()));
  }
  for (size_t g = 0; g < tensors.size(); ++g) {
    const GroupSpec& gs = m.groups[g];
    if (tensors[g].size() != gs.params.size()) {
      return Status::InvalidArgument(std::string(op) + ": group '" + gs.name + "' has " +
                                     std::to_string(gs.params.size()) + " parameters, " +
                                     std::to_string(tensors[g].size()) + " given");
    }
    for (size_t p = 0; p < tensors[g].size(); ++p) {
      const ParamSpec& ps = gs.params[p];
      const std::span<const float> t = tensors[g][p];
      if (t.data() == nullptr) {
        return Status::InvalidArgument(std::string(op) + ": null tensor for " + gs.name + "." +
                                       ps.name);
      }
      if (t.size() != ps.numel()) {
        std::string shape;
        for (int64_t d : ps.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
        return Status::InvalidArgument(std::string(op) + ": " + gs.name + "." + ps.name + " has " +
                                       std::to_string(t.size()) + " values, its shape [" + shape +
                                       "] needs " + std::to_string(ps.numel()));
      }
    }
  }
  return Status::OK();
}

// The header rank 0 broadcasts before any data (int8-moved bytes).
struct InitHeader {
  uint64_t ok = 0;           // 1: rank 0's values are valid (step 1) or held (step 4)
  uint64_t piece_elems = 0;  // elements per rank per transfer
};

constexpr char kOp[] = "InitFromRank0";

// InitFromRank0's errors of a collective or copy: name the operation and `what`, fail the engine.
Status InitFailed(Engine::Impl& e, const std::string& what, const Status& st) {
  return e.Fail(
      Status(st.code(), std::string(kOp) + ": " + what + ": " + std::string(st.message())));
}

// Rank 0's header, on every rank (rank 0 passes it in; the others' `header` is overwritten).
Status BroadcastHeader(Engine::Impl& e, InitHeader* header) {
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer hdr, DeviceBuffer::Make(e.opt.device, sizeof(*header)));
  if (e.rank == 0) STRATA_RETURN_IF_ERROR(e.ToDevice(hdr.get(), header, sizeof(*header)));
  STRATA_ASSIGN_OR_RETURN(CommHandle h,
                          e.opt.comm->Broadcast(hdr.get(), sizeof(*header), DType::kI8, 0));
  STRATA_RETURN_IF_ERROR(h.WaitUntil(e.deadline()));
  return e.ToHost(header, hdr.get(), sizeof(*header));
}

// Every failure, a local one (allocation, copy) too, fails the engine: the peers are, or will
// be, inside the same collective, and the communicator's abort ends their wait before the
// deadline.
Status ExchangeHeader(Engine::Impl& e, InitHeader* header) {
  Status st = BroadcastHeader(e, header);
  return st.ok() ? st : InitFailed(e, "the header from rank 0", st);
}

// The all-to-all's send and receive buffers (world x piece floats each; receive only when it
// scatters, and then the send buffer zeroed: the other ranks' chunks carry nothing, defined
// bytes all the same). A failure fails the engine, as in ExchangeHeader.
Status MakeStagingBuffers(Engine::Impl& e, uint64_t bytes, bool scatter, DeviceBuffer* send,
                          DeviceBuffer* recv) {
  Status st = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(*send, DeviceBuffer::Make(e.opt.device, bytes));
    if (!scatter) return Status::OK();
    STRATA_ASSIGN_OR_RETURN(*recv, DeviceBuffer::Make(e.opt.device, bytes));
    return e.ZeroDevice(send->get(), bytes);
  }();
  return st.ok() ? st : InitFailed(e, "the staging buffers", st);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Every rank fills its own
// ---------------------------------------------------------------------------------------------

Result<std::pair<size_t, size_t>> Engine::OwnedRange(size_t numel, int world_size, int rank) {
  const size_t n[] = {numel};
  STRATA_ASSIGN_OR_RETURN(const sched::PartitionPlan plan,
                          sched::PlanPartition(n, world_size, zero::kShardAlignElems));
  return std::make_pair(plan.groups[0].OwnedBegin(rank), plan.groups[0].OwnedEnd(rank));
}

Status Engine::InitParameters(const ParamFill& fill) {
  Impl& e = *impl_;
  return InitMasters(e, "InitParameters", [&](const SubGroup& s, float* m) {
    FillFlat(e, s.group, e.FullOffset(s), s.elems, fill, m);
    return Status::OK();
  });
}

namespace {
// Every rank says whether its values were filled (`filled`, collective): OK when all were;
// else this rank's own error, or InvalidArgument naming the first rank that failed, with
// nothing to be written on any rank.
Status AgreeOnFill(Engine::Impl& e, const Status& filled, const std::string& op) {
  Result<int> failed = e.FirstFailedRank(filled.ok(), op);
  if (!failed.ok()) return e.Fail(failed.status());
  if (!filled.ok()) return filled;
  if (*failed >= 0) {
    return Status::InvalidArgument(op + ": rank " + std::to_string(*failed) +
                                   "'s values failed (its own error names them); nothing was "
                                   "written");
  }
  return Status::OK();
}

// The values of each piece (its padded range of the group, zeros in the padding) from `fill`;
// its first error, with the rest not asked.
Status FillPieces(const Engine::Impl& e, const std::vector<const SubGroup*>& pieces,
                  const CheckedParamFill& fill, std::vector<std::vector<float>>* values) {
  values->resize(pieces.size());
  Status filled;
  for (size_t i = 0; i < pieces.size() && filled.ok(); ++i) {
    const SubGroup& s = *pieces[i];
    (*values)[i].resize(s.elems);
    FillFlat(
        e, s.group, e.FullOffset(s), s.elems,
        [&](size_t g, size_t p, size_t b, size_t end, float* out) {
          if (filled.ok()) filled = fill(g, p, b, end, out);
        },
        (*values)[i].data());
  }
  return filled;
}
}  // namespace

Status Engine::WriteParams(std::span<const size_t> groups, const CheckedParamFill& fill) {
  Impl& e = *impl_;
  STRATA_RETURN_IF_ERROR(e.JoinDeferredStep());
  STRATA_RETURN_IF_ERROR(e.CancelSpeculation());  // its params would overwrite these
  STRATA_RETURN_IF_ERROR(e.CheckHealthy());
  std::vector<bool> chosen(e.groups.size(), false);
  for (size_t g : groups) {
    if (g >= e.groups.size()) {
      return Status::InvalidArgument("WriteParams: group " + std::to_string(g) + " out of range");
    }
    chosen[g] = true;
  }
  if (e.outstanding_gathers > 0) {
    return Status::FailedPrecondition("WriteParams: " + std::to_string(e.outstanding_gathers) +
                                      " gathered group(s) not released");
  }
  // Every value first (this rank's pieces of the groups named): a fill that fails writes nothing.
  std::vector<const SubGroup*> pieces;
  for (const std::vector<SubGroup>* list : {&e.subs, &e.frozen_pieces}) {
    for (const SubGroup& s : *list) {
      if (chosen[s.group]) pieces.push_back(&s);
    }
  }
  std::vector<std::vector<float>> values;
  const Status filled = FillPieces(e, pieces, fill, &values);
  if (!filled.ok()) values.clear();
  STRATA_RETURN_IF_ERROR(AgreeOnFill(e, filled, "WriteParams"));
  const Tier param_tier = e.ComputeTier(e.placement.Home(StateKind::kParam16));
  for (size_t i = 0; i < pieces.size(); ++i) {
    const SubGroup& s = *pieces[i];
    auto param = e.store->Acquire(e.groups[s.group].param, param_tier, Access::kWrite, e.timeout());
    if (!param.ok()) return e.Fail(param.status());
    STRATA_RETURN_IF_ERROR(e.Fail(e.PublishParams(s, values[i].data(), *param)));
  }
  for (size_t g = 0; g < e.groups.size(); ++g) {
    if (chosen[g] && !e.model.groups[g].trainable) e.groups[g].frozen_changed = true;
  }
  ForgetCopiesOfOldParams(e);
  return e.Fail(e.AllGatherUpdatedParams(/*frozen_too=*/true));
}

Status Engine::InitFromFullTensors(const std::vector<std::vector<const float*>>& tensors) {
  const ModelSpec& m = impl_->model;
  // Raw pointers carry no size: they are taken to hold their parameter's numel values.
  std::vector<std::vector<std::span<const float>>> spans(tensors.size());
  for (size_t g = 0; g < tensors.size(); ++g) {
    for (size_t p = 0; p < tensors[g].size(); ++p) {
      const size_t n =
          g < m.groups.size() && p < m.groups[g].params.size() ? m.groups[g].params[p].numel() : 0;
      spans[g].emplace_back(tensors[g][p], tensors[g][p] ? n : 0);
    }
  }
  STRATA_RETURN_IF_ERROR(CheckFullTensors(m, "InitFromFullTensors", spans));
  return InitParameters([&](size_t g, size_t p, size_t b, size_t e, float* out) {
    std::memcpy(out, tensors[g][p] + b, (e - b) * sizeof(float));
  });
}

// ---------------------------------------------------------------------------------------------
// Rank 0 sends each rank what it stores (protocol at the top of the file)
// ---------------------------------------------------------------------------------------------

Status Engine::InitFromRank0(const std::vector<std::vector<std::span<const float>>>& tensors,
                             uint64_t window_bytes) {
  STRATA_RETURN_IF_ERROR(CheckInitAllowed(*impl_, kOp));
  const Status verdict =
      impl_->rank == 0 ? CheckFullTensors(impl_->model, kOp, tensors) : Status::OK();
  return InitFromRank0Impl(
      verdict,
      [&](size_t g, size_t p, size_t b, size_t end, float* out) {
        std::memcpy(out, tensors[g][p].data() + b, (end - b) * sizeof(float));
        return Status::OK();
      },
      window_bytes);
}

Status Engine::InitFromRank0Fill(const CheckedParamFill& fill, uint64_t window_bytes) {
  STRATA_RETURN_IF_ERROR(CheckInitAllowed(*impl_, kOp));
  return InitFromRank0Impl(Status::OK(), fill, window_bytes);
}

Status Engine::InitFromRank0Impl(const Status& verdict, const CheckedParamFill& fill,
                                 uint64_t window_bytes) {
  Impl& e = *impl_;
  const bool root = e.rank == 0;
  const size_t world = static_cast<size_t>(e.world);
  InitHeader header;
  if (root) {
    size_t largest = 1;
    for (const SubGroup& s : e.subs) largest = std::max(largest, s.elems);
    for (const SubGroup& s : e.frozen_pieces) largest = std::max(largest, s.elems);
    // Three buffers of world x piece floats (device send / receive, host pack) within the window.
    header.ok = verdict.ok() ? 1 : 0;
    header.piece_elems =
        std::clamp<uint64_t>(window_bytes / (3 * world * sizeof(float)), 1, largest);
  }
  if (world > 1) STRATA_RETURN_IF_ERROR(ExchangeHeader(e, &header));
  if (header.ok != 1) {
    if (root) return verdict;
    return Status::InvalidArgument(std::string(kOp) +
                                   ": rank 0 rejected its tensors (its own error names the group "
                                   "and parameter); nothing was written");
  }
  const size_t piece = static_cast<size_t>(header.piece_elems);
  const bool scatter = e.placement.optimizer_partitioned && world > 1;
  // Rank 0's values; after an error of its fill, zeros (every piece is still sent: step 4).
  Status fill_error;
  const ParamFill root_fill = [&](size_t g, size_t p, size_t b, size_t end, float* out) {
    if (fill_error.ok()) fill_error = fill(g, p, b, end, out);
    if (!fill_error.ok()) std::memset(out, 0, (end - b) * sizeof(float));
  };
  if (world == 1) {
    STRATA_RETURN_IF_ERROR(InitMasters(e, kOp, [&](const SubGroup& s, float* m) {
      FillFlat(e, s.group, e.FullOffset(s), s.elems, root_fill, m);
      return Status::OK();
    }));
    return fill_error;
  }
  const uint64_t buf_bytes = world * piece * sizeof(float);
  DeviceBuffer send, recv;
  STRATA_RETURN_IF_ERROR(MakeStagingBuffers(e, buf_bytes, scatter, &send, &recv));
  std::vector<float> pack(root ? world * piece : 0);
  STRATA_RETURN_IF_ERROR(InitMasters(e, kOp, [&](const SubGroup& s, float* m) -> Status {
    const size_t shard = e.groups[s.group].shard.shard_elems;
    for (size_t c = 0; c < s.elems; c += piece) {
      const size_t n = std::min(piece, s.elems - c);
      // Named only on error (a string per piece would cost more than a small piece's copy).
      auto what = [&] {
        return "group '" + e.model.groups[s.group].name + "' elements [" +
               std::to_string(s.offset + c) + ", " + std::to_string(s.offset + c + n) + ") of " +
               (scatter ? "each rank's shard" : "rank " + std::to_string(s.owner) + "'s shard");
      };
      const size_t ranks = scatter ? world : 1;
      if (root) {
        for (size_t j = 0; j < ranks; ++j) {
          const size_t at = (scatter ? j : static_cast<size_t>(s.owner)) * shard + s.offset + c;
          FillFlat(e, s.group, at, n, root_fill, pack.data() + j * n);
        }
        Status st = e.ToDevice(send.get(), pack.data(), ranks * n * sizeof(float));
        if (!st.ok()) return InitFailed(e, what(), st);
      }
      auto h = scatter ? e.opt.comm->AllToAll(send.get(), recv.get(), n, DType::kF32)
                       : e.opt.comm->Broadcast(send.get(), n, DType::kF32, 0);
      if (!h.ok()) return InitFailed(e, what(), h.status());
      Status st = h->WaitUntil(e.deadline());
      if (!st.ok()) return InitFailed(e, what(), st);
      // The all-to-all leaves rank 0's chunk for this rank at the start of recv.
      st = e.ToHost(m + c, scatter ? recv.get() : send.get(), n * sizeof(float));
      if (!st.ok()) return InitFailed(e, what(), st);
    }
    return Status::OK();
  }));
  // Step 4: whether rank 0's values held to the end.
  InitHeader done;
  done.ok = fill_error.ok() ? 1 : 0;
  STRATA_RETURN_IF_ERROR(ExchangeHeader(e, &done));
  if (root) return fill_error;
  if (done.ok == 1) return Status::OK();
  return Status::InvalidArgument(std::string(kOp) +
                                 ": rank 0's values failed part way (its own error names the "
                                 "parameter); this rank's state holds zeros from there: initialise "
                                 "again on every rank");
}

// ---------------------------------------------------------------------------------------------
// Read-back
// ---------------------------------------------------------------------------------------------

namespace {

// A frozen group's params widened to fp32 into `full` (the padded flat buffer): this rank's
// replica, or at stage 3 its shard all-gathered (collective then).
Status ReadFrozenParams(Engine::Impl& e, size_t g, std::vector<float>& full) {
  const zero::GroupState& gs = e.groups[g];
  const Tier tier = e.ComputeTier(e.placement.Home(StateKind::kParam16));
  const bool shard_only = e.placement.params_partitioned;
  const size_t shard = gs.shard.shard_elems;
  const size_t at = shard_only ? static_cast<size_t>(e.rank) * shard : 0;
  const size_t n = shard_only ? shard : full.size();
  {
    auto l = e.store->Acquire(gs.param, tier, Access::kRead, e.timeout());
    if (!l.ok()) return e.Fail(l.status());
    if (e.dtype == DType::kF32) {
      std::memcpy(full.data() + at, l->data(), n * sizeof(float));
    } else {
      STRATA_RETURN_IF_ERROR(kernels::Cast(l->data(), e.dtype, full.data() + at, DType::kF32, n));
    }
  }
  if (!shard_only || e.world == 1) return Status::OK();
  const uint64_t bytes = full.size() * sizeof(float);
  auto buf = DeviceBuffer::Make(e.opt.device, bytes);
  if (!buf.ok()) return e.Fail(buf.status());
  float* dev = static_cast<float*>(buf->get());
  STRATA_RETURN_IF_ERROR(
      e.Fail(e.CopySync(CopyDir::kHostToDevice, dev + at, full.data() + at, n * sizeof(float))));
  auto h = e.opt.comm->AllGather(dev + at, dev, shard, DType::kF32);
  if (!h.ok()) return e.Fail(h.status());
  STRATA_RETURN_IF_ERROR(e.Fail(h->WaitUntil(e.deadline())));
  return e.Fail(e.CopySync(CopyDir::kDeviceToHost, full.data(), dev, bytes));
}

// The accumulated gradient of `group` can be read: no gradient buffer is out (mid-backward),
// every reduction is accumulated (drained here), and there was one since the last Step.
Status GradReadable(Engine::Impl& e, size_t group, const std::string& op) {
  STRATA_RETURN_IF_ERROR(e.CheckNoGradBufferOut(op, "out (mid-backward)"));
  STRATA_RETURN_IF_ERROR(e.DrainReductions(true));
  // Device-resident gradients accumulate in kernels queued and not waited for.
  STRATA_RETURN_IF_ERROR(e.Fail(e.opt.device->Synchronize()));
  if (e.groups[group].reductions == 0) {
    return Status::FailedPrecondition(op + ": group '" + e.model.groups[group].name +
                                      "' has no gradient since the last Step");
  }
  return Status::OK();
}

}  // namespace

Status Engine::ReadMaster(size_t group, std::span<float> out) {
  return ReadOptimizerState(group, StateKind::kMaster32, out);
}

Status Engine::ReadOptimizerState(size_t group, StateKind kind, std::span<float> out) {
  Impl& e = *impl_;
  const std::string op = kind == StateKind::kMaster32 ? "ReadMaster" : "ReadOptimizerState";
  STRATA_RETURN_IF_ERROR(e.JoinDeferredStep());
  STRATA_RETURN_IF_ERROR(e.CancelSpeculation());  // the state from before this step
  STRATA_RETURN_IF_ERROR(e.CheckHealthy());
  if (kind == StateKind::kParam16) {
    return Status::InvalidArgument(op + ": " + std::string(StateKindName(kind)) +
                                   " is not an optimizer state (master32, exp_avg, exp_avg_sq, "
                                   "grad)");
  }
  if (group >= e.groups.size()) {
    return Status::InvalidArgument(op + ": group " + std::to_string(group) + " out of range");
  }
  const zero::GroupState& gs = e.groups[group];
  if (out.size() != gs.numel) {
    return Status::InvalidArgument(op + ": " + std::to_string(out.size()) +
                                   " values given, group '" + e.model.groups[group].name +
                                   "' has " + std::to_string(gs.numel));
  }
  std::vector<float> full(gs.shard.padded_elems(e.world), 0.0f);
  if (!e.model.groups[group].trainable) {
    if (kind != StateKind::kMaster32) {
      return Status::InvalidArgument(op + ": group '" + e.model.groups[group].name +
                                     "' is frozen and has no " + std::string(StateKindName(kind)));
    }
    STRATA_RETURN_IF_ERROR(ReadFrozenParams(e, group, full));
    std::copy(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(gs.numel), out.begin());
    return Status::OK();
  }
  if (kind == StateKind::kGrad) STRATA_RETURN_IF_ERROR(GradReadable(e, group, op));
  for (size_t si : gs.sub_groups) {
    const SubGroup& s = e.subs[si];
    const Tier tier = e.ComputeTier(e.HomeOf(s, kind));
    const BlockId block = kind == StateKind::kExpAvg     ? s.exp_avg
                          : kind == StateKind::kExpAvgSq ? s.exp_avg_sq
                          : kind == StateKind::kGrad     ? s.grad
                                                         : s.master;
    // Failing the engine aborts the all-gather below on the peers (no wait to the deadline).
    auto l = e.store->Acquire(block, tier, Access::kRead, e.timeout());
    if (!l.ok()) return e.Fail(l.status());
    float* at = full.data() + e.FullOffset(s);
    if (kind == StateKind::kGrad && e.grad_dtype != DType::kF32) {
      STRATA_RETURN_IF_ERROR(kernels::Cast(l->data(), e.grad_dtype, at, DType::kF32, s.elems));
    } else {
      std::memcpy(at, l->data(), s.elems * sizeof(float));
    }
  }
  if (e.placement.optimizer_partitioned && e.world > 1) {
    const uint64_t bytes = full.size() * sizeof(float);
    auto buf = DeviceBuffer::Make(e.opt.device, bytes);
    if (!buf.ok()) return e.Fail(buf.status());
    const size_t shard = gs.shard.shard_elems;
    float* dev = static_cast<float*>(buf->get());
    STRATA_RETURN_IF_ERROR(e.Fail(e.CopySync(CopyDir::kHostToDevice, dev + e.rank * shard,
                                             full.data() + e.rank * shard, shard * sizeof(float))));
    auto h = e.opt.comm->AllGather(dev + e.rank * shard, dev, shard, DType::kF32);
    if (!h.ok()) return e.Fail(h.status());
    STRATA_RETURN_IF_ERROR(e.Fail(h->WaitUntil(e.deadline())));
    STRATA_RETURN_IF_ERROR(e.Fail(e.CopySync(CopyDir::kDeviceToHost, full.data(), dev, bytes)));
  }
  std::copy(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(gs.numel), out.begin());
  return Status::OK();
}

namespace {

// The values of parameter `param` that each piece holds (its place in the piece, the values),
// from `fill`; the first error, with the rest not asked.
struct Patch {
  size_t at = 0;  // the first value's place in the piece
  std::vector<float> values;
};
Status FillPatches(const Engine::Impl& e, size_t group, size_t param,
                   const std::vector<const SubGroup*>& pieces, const CheckedParamFill& fill,
                   std::vector<Patch>* patches) {
  const zero::GroupState& gs = e.groups[group];
  const size_t po = gs.param_offsets[param];
  const size_t pn = e.model.groups[group].params[param].numel();
  patches->resize(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const size_t b = e.FullOffset(*pieces[i]);
    const size_t lo = std::max(b, po), hi = std::min(b + pieces[i]->elems, po + pn);
    if (lo >= hi) continue;
    Patch& patch = (*patches)[i];
    patch.at = lo - b;
    patch.values.assign(hi - lo, 0.0f);
    STRATA_RETURN_IF_ERROR(fill(group, param, lo - po, hi - po, patch.values.data()));
  }
  return Status::OK();
}

}  // namespace

Status Engine::WriteOptimizerState(size_t group, size_t param, StateKind kind,
                                   const CheckedParamFill& fill) {
  Impl& e = *impl_;
  const std::string op = "WriteOptimizerState";
  STRATA_RETURN_IF_ERROR(e.JoinDeferredStep());
  STRATA_RETURN_IF_ERROR(e.CancelSpeculation());  // its states would overwrite these
  STRATA_RETURN_IF_ERROR(e.CheckHealthy());
  if (kind != StateKind::kMaster32 && kind != StateKind::kExpAvg && kind != StateKind::kExpAvgSq) {
    return Status::InvalidArgument(op + ": " + std::string(StateKindName(kind)) +
                                   " cannot be written (master32, exp_avg, exp_avg_sq)");
  }
  if (group >= e.groups.size() || param >= e.model.groups[group].params.size()) {
    return Status::InvalidArgument(op + ": group " + std::to_string(group) + " parameter " +
                                   std::to_string(param) + " out of range");
  }
  if (!e.model.groups[group].trainable) {
    return Status::InvalidArgument(op + ": group '" + e.model.groups[group].name +
                                   "' is frozen and has no optimizer state");
  }
  if (e.outstanding_gathers > 0) {
    return Status::FailedPrecondition(op + ": " + std::to_string(e.outstanding_gathers) +
                                      " gathered group(s) not released");
  }
  STRATA_RETURN_IF_ERROR(e.CheckNoGradBufferOut(op, "out (mid-backward)"));
  std::vector<const SubGroup*> pieces;
  for (const SubGroup& s : e.subs) {
    if (s.group == group) pieces.push_back(&s);
  }
  std::vector<Patch> patches;
  STRATA_RETURN_IF_ERROR(AgreeOnFill(e, FillPatches(e, group, param, pieces, fill, &patches), op));
  const Tier param_tier = e.ComputeTier(e.placement.Home(StateKind::kParam16));
  for (size_t i = 0; i < pieces.size(); ++i) {
    const SubGroup& s = *pieces[i];
    if (patches[i].values.empty()) continue;  // none of the parameter in this piece
    const BlockId block = kind == StateKind::kExpAvg     ? s.exp_avg
                          : kind == StateKind::kExpAvgSq ? s.exp_avg_sq
                                                         : s.master;
    auto state =
        e.store->Acquire(block, e.ComputeTier(e.HomeOf(s, kind)), Access::kWrite, e.timeout());
    if (!state.ok()) return e.Fail(state.status());
    float* values = static_cast<float*>(state->data());
    std::copy(patches[i].values.begin(), patches[i].values.end(), values + patches[i].at);
    state->MarkDirty();
    if (kind != StateKind::kMaster32) continue;
    auto param_lease =
        e.store->Acquire(e.groups[group].param, param_tier, Access::kWrite, e.timeout());
    if (!param_lease.ok()) return e.Fail(param_lease.status());
    STRATA_RETURN_IF_ERROR(e.Fail(e.PublishParams(s, values, *param_lease)));
  }
  if (kind != StateKind::kMaster32) return Status::OK();
  ForgetCopiesOfOldParams(e);
  return e.Fail(e.AllGatherUpdatedParams(/*frozen_too=*/true));
}

namespace {

uint32_t Fingerprint(const std::string& text) {
  const uint64_t h = XXH3_64bits(text.data(), text.size());
  return static_cast<uint32_t>(h ^ (h >> 32));
}

}  // namespace

Status Engine::Impl::AgreeOnSetup(const EngineConfig& c,
                                  const std::vector<OptimizerGroupOptions>& groups) {
  if (world == 1) return Status::OK();
  std::string spec;
  for (const GroupSpec& g : model.groups) {
    spec += g.name + '|' + std::to_string(g.optimizer_group) + (g.trainable ? "t" : "f");
    for (const ParamSpec& p : g.params) {
      spec += '|' + p.name;
      for (int64_t d : p.shape) spec += ',' + std::to_string(d);
    }
    spec += '\n';
  }
  nlohmann::ordered_json eff = nlohmann::ordered_json::parse(EffectiveConfigJson(c, -1));
  nlohmann::ordered_json training;
  for (const char* k :
       {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
        "prescale_gradients", "gradient_predivide_factor", "fp16", "bf16", "zero_optimization"}) {
    training[k] = eff[k];
  }
  training["zero_optimization"].erase("offload_optimizer");
  training["zero_optimization"].erase("offload_param");
  nlohmann::ordered_json optimizer = {{"optimizer", eff["optimizer"]},
                                      {"scheduler", eff["scheduler"]}};
  for (const OptimizerGroupOptions& o : groups) {
    optimizer["groups"].push_back({o.lr.value_or(-1), o.beta1.value_or(-1), o.beta2.value_or(-1),
                                   o.eps.value_or(-1), o.weight_decay.value_or(-1)});
  }
  const std::array<uint32_t, 4> mine = {Fingerprint(spec), Fingerprint(training.dump()),
                                        Fingerprint(optimizer.dump()), 0};
  STRATA_ASSIGN_OR_RETURN(std::vector<uint32_t> all, AllGatherWords(mine));
  static constexpr const char* kWhat[] = {
      "model (its groups, parameter names and shapes, which are trainable)",
      "precision, zero_optimization settings, micro-batch, accumulation or clipping",
      "optimizer or LR schedule (type, lr, betas, eps, weight_decay, parameter groups)"};
  for (int r = 1; r < world; ++r) {
    for (size_t w = 0; w < 3; ++w) {
      if (all[static_cast<size_t>(r) * 4 + w] == all[w]) continue;
      return Status::InvalidArgument(
          "rank " + std::to_string(r) + "'s " + kWhat[w] +
          " differs from rank 0's: every rank must build the same model and pass the same "
          "config (the offload sections, nvme paths and aio may differ)");
    }
  }
  return Status::OK();
}

}  // namespace strata
