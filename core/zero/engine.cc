// Engine: creation (placement, budgets, blocks) and the shared helpers (initial weights and
// read-back: engine_init.cc). See include/strata/engine.h for the contract.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <utility>

#include "core/plan/comm_model.h"
#include "core/zero/engine_internal.h"
#include "kernels/casts.h"
#include "kernels/quantize.h"
#include "sched/zero_layout.h"
#include "strata/device_kernels.h"
#include "strata/planner.h"

namespace strata {

using zero::SubGroup;

// ---------------------------------------------------------------------------------------------
// Model spec
// ---------------------------------------------------------------------------------------------

size_t ParamSpec::numel() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d > 0 ? d : 0);
  return n;
}

size_t GroupSpec::numel() const {
  size_t n = 0;
  for (const ParamSpec& p : params) n += p.numel();
  return n;
}

size_t ModelSpec::numel() const {
  size_t n = 0;
  for (const GroupSpec& g : groups) n += g.numel();
  return n;
}

Status ModelSpec::Validate() const {
  if (groups.empty()) return Status::InvalidArgument("model: no parameter groups");
  std::set<std::string> group_names;
  constexpr uint64_t kMaxElems = uint64_t{1} << 50;
  uint64_t total = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const GroupSpec& group = groups[g];
    const std::string where = "model.groups[" + std::to_string(g) + "]";
    if (group.name.empty()) return Status::InvalidArgument(where + ": empty name");
    if (!group_names.insert(group.name).second) {
      return Status::InvalidArgument(where + ": duplicate group name '" + group.name + "'");
    }
    if (group.params.empty()) {
      return Status::InvalidArgument(where + " ('" + group.name + "'): no parameters");
    }
    std::set<std::string> names;
    for (size_t p = 0; p < group.params.size(); ++p) {
      const ParamSpec& param = group.params[p];
      const std::string pw = where + ".params[" + std::to_string(p) + "]";
      if (param.name.empty()) return Status::InvalidArgument(pw + ": empty name");
      if (!names.insert(param.name).second) {
        return Status::InvalidArgument(pw + ": duplicate parameter name '" + param.name + "'");
      }
      uint64_t n = 1;  // an empty shape is a scalar (a 0-dim parameter: CLIP's logit_scale)
      for (int64_t d : param.shape) {
        if (d <= 0) {
          return Status::InvalidArgument(pw + " ('" + param.name + "'): dimension " +
                                         std::to_string(d) + " is not positive");
        }
        if (n > kMaxElems / static_cast<uint64_t>(d)) {
          return Status::InvalidArgument(pw + " ('" + param.name + "'): too many elements");
        }
        n *= static_cast<uint64_t>(d);
      }
      total += n;
      if (total > kMaxElems) return Status::InvalidArgument("model: too many elements");
    }
  }
  return Status::OK();
}

struct GatheredGroup::Owner {
  std::mutex mu;
  Engine* engine = nullptr;  // null once the engine is destroyed
};

GatheredGroup::GatheredGroup(GatheredGroup&& other) noexcept { *this = std::move(other); }

GatheredGroup& GatheredGroup::operator=(GatheredGroup&& other) noexcept {
  if (this == &other) return *this;
  GiveBack();
  owner_ = std::move(other.owner_);
  group_ = other.group_;
  dtype_ = other.dtype_;
  data_ = std::exchange(other.data_, nullptr);
  numel_ = std::exchange(other.numel_, 0);
  offsets_ = std::move(other.offsets_);
  hold_ = std::move(other.hold_);
  return *this;
}

GatheredGroup::~GatheredGroup() { GiveBack(); }

void GatheredGroup::GiveBack() noexcept {
  std::shared_ptr<Owner> owner = std::move(owner_);
  if (owner == nullptr) return;  // released, moved from, or not from Engine::Gather
  std::lock_guard<std::mutex> l(owner->mu);
  if (owner->engine != nullptr) {
    owner->engine->Release(std::move(*this));
    return;
  }
  // The engine is gone, and the store the hold would give its lease back to: keep it forever
  // rather than call into freed memory (in a list no one frees: reachable, so no leak report).
  static auto* kept_mu = new std::mutex;
  static auto* kept = new std::vector<std::shared_ptr<void>>;
  std::lock_guard<std::mutex> k(*kept_mu);
  kept->push_back(std::move(hold_));
}

const void* GatheredGroup::param(size_t i) const {
  if (i >= offsets_.size() || data_ == nullptr) return nullptr;
  return static_cast<const uint8_t*>(data_) + offsets_[i] * DTypeSize(dtype_);
}

// ---------------------------------------------------------------------------------------------
// Layout table
// ---------------------------------------------------------------------------------------------

namespace {

std::string Bytes(uint64_t b) {
  char buf[32];
  if (b >= (uint64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  } else if (b >= (uint64_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(b) / 1024);
  }
  return buf;
}

uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace

std::string EngineLayout::ToString() const {
  std::ostringstream o;
  o << "strata engine: ZeRO stage " << stage << ", optimizer offload "
    << OffloadDeviceName(offload_optimizer) << ", param offload "
    << OffloadDeviceName(offload_param) << ", " << DTypeName(dtype) << ", rank " << rank << "/"
    << world_size << ", " << params << " params, " << sub_groups << " optimizer sub-groups\n";
  if (grad_dtype != DType::kF32) {
    o << "  gradients: kept in " << DTypeName(grad_dtype)
      << " for the optimizer (one rank, one micro-step: final as reduced)\n";
  }
  if (optimizer_ratio < 1.0) {
    o << "  optimizer: " << std::lround(offloaded_fraction * 100) << "% offloaded ("
      << sub_groups - device_sub_groups << " of " << sub_groups
      << " sub-groups; offload_optimizer.ratio " << optimizer_ratio
      << "), the rest on the device\n";
  }
  o << "  tier   states        working       cache         total         budget\n";
  for (Tier t : kAllTiers) {
    char line[160];
    std::snprintf(line, sizeof line, "  %-6s %-13s %-13s %-13s %-13s %s\n",
                  std::string(TierName(t)).c_str(), Bytes(state_bytes[t]).c_str(),
                  Bytes(working_bytes[t]).c_str(), Bytes(cache_bytes[t]).c_str(),
                  Bytes(state_bytes[t] + working_bytes[t] + cache_bytes[t]).c_str(),
                  Bytes(budget_bytes[t]).c_str());
    o << line;
  }
  for (const std::string& n : notes) o << "  note: " << n << "\n";
  return o.str();
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

Status Engine::Impl::CheckNoGradBufferOut(const std::string& op, const char* why) const {
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].grad) {
      return Status::FailedPrecondition(op + ": group '" + model.groups[g].name +
                                        "' has a gradient buffer " + why);
    }
  }
  return Status::OK();
}

Status Engine::Impl::CheckHealthy() const {
  if (!failed.ok()) {
    return Status::FailedPrecondition(
        "engine failed earlier and refuses every call: create a new engine (from Python, "
        "strata.initialize) and load the last good checkpoint into it; the failure: " +
        failed.ToString());
  }
  if (!aside_blocks.empty()) {
    return Status::FailedPrecondition(
        "the engine's states are offloaded (OffloadStates): call ReloadStates first");
  }
  return Status::OK();
}

Status Engine::Impl::Fail(Status st) {
  if (!st.ok() && failed.ok()) {
    failed = st;
    const std::string why =
        "strata engine on rank " + std::to_string(rank) + " failed: " + st.ToString();
    if (opt.comm != nullptr) opt.comm->Abort(why);
    for (Communicator* c : {zpp.node.get(), zpp.cross.get(), zpp.group.get()}) {
      if (c != nullptr) c->Abort(why);
    }
  }
  return st;
}

Tier Engine::Impl::ComputeTier(Tier home) const {
  if (home == Tier::kDevice && opt.device->host_addressable()) return Tier::kDevice;
  return Tier::kHost;
}

Status Engine::Impl::ToHost(void* host, const void* dev, uint64_t bytes) {
  if (host == dev || bytes == 0) return Status::OK();
  if (opt.device->host_addressable()) {
    std::memcpy(host, dev, bytes);
    return Status::OK();
  }
  return CopySync(CopyDir::kDeviceToHost, host, dev, bytes);
}

Status Engine::Impl::ToDevice(void* dev, const void* host, uint64_t bytes) {
  if (host == dev || bytes == 0) return Status::OK();
  if (opt.device->host_addressable()) {
    std::memcpy(dev, host, bytes);
    return Status::OK();
  }
  return CopySync(CopyDir::kHostToDevice, dev, host, bytes);
}

namespace {

// CopySync bounces copies up to this size (the engine's words, statistics and orders).
constexpr uint64_t kBounceMax = uint64_t{1} << 20;

// A copy's host side of its own, owned jointly by the waiter and the copy's completion, so that
// a copy still queued when the waiter gives up (its deadline passed) moves bytes only to or from
// memory that is still there.
struct Bounce {
  explicit Bounce(uint64_t n) : bytes(std::make_unique_for_overwrite<uint8_t[]>(n)) {}
  std::unique_ptr<uint8_t[]> bytes;
  std::promise<Status> done;
};

// A copy the waiter gave up on.
Status LateCopy(CopyDir dir, uint64_t bytes) {
  return Status::DeadlineExceeded(std::string("device copy (") + std::string(CopyDirName(dir)) +
                                  ", " + std::to_string(bytes) + " bytes) did not finish");
}

}  // namespace

Status Engine::Impl::CopySync(CopyDir dir, void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0) return Status::OK();
  if (bytes > kBounceMax) return CopyDirect(dir, dst, src, bytes);
  const bool down = dir == CopyDir::kDeviceToHost;
  auto b = std::make_shared<Bounce>(bytes);
  std::future<Status> done = b->done.get_future();
  if (!down) std::memcpy(b->bytes.get(), src, bytes);
  STRATA_RETURN_IF_ERROR(
      opt.device->CopyAsync(dir, down ? b->bytes.get() : dst, down ? src : b->bytes.get(), bytes,
                            [b](Status st) { b->done.set_value(std::move(st)); }));
  if (done.wait_for(opt.timeout) != std::future_status::ready) return LateCopy(dir, bytes);
  STRATA_RETURN_IF_ERROR(done.get());
  if (down) std::memcpy(dst, b->bytes.get(), bytes);
  return Status::OK();
}

Status Engine::Impl::CopyDirect(CopyDir dir, void* dst, const void* src, uint64_t bytes) {
  if (bytes == 0) return Status::OK();
  STRATA_RETURN_IF_ERROR(CheckNoCopyOverran());
  auto done = std::make_shared<std::promise<Status>>();
  std::future<Status> f = done->get_future();
  STRATA_RETURN_IF_ERROR(
      opt.device->CopyAsync(dir, dst, src, bytes, [done](Status st) { done->set_value(st); }));
  if (f.wait_for(opt.timeout) != std::future_status::ready) {
    return CopyOverran(LateCopy(dir, bytes));
  }
  return f.get();
}

Status Engine::Impl::CheckNoCopyOverran() const {
  if (!copy_overran.load()) return Status::OK();
  return Status::FailedPrecondition(
      "an earlier device copy did not finish within the timeout and may still write the "
      "engine's host buffers");
}

Status Engine::Impl::CopyOverran(Status st) {
  copy_overran.store(true);
  return st;
}

Status Engine::Impl::ZeroDevice(void* ptr, uint64_t bytes) {
  if (opt.device->host_addressable()) {
    std::memset(ptr, 0, bytes);
    return Status::OK();
  }
  if (kernels::DeviceKernels* k = opt.device->kernels(); k != nullptr) {
    // On the device: otherwise a large group's gradient buffer is gigabytes of zeros copied
    // over the link, one synchronous copy per MiB.
    STRATA_RETURN_IF_ERROR(k->Zero(ptr, bytes));
    return k->Synchronize(timeout());
  }
  static const std::vector<uint8_t> zeros(size_t{1} << 20, 0);
  for (uint64_t off = 0; off < bytes; off += zeros.size()) {
    const uint64_t n = std::min<uint64_t>(zeros.size(), bytes - off);
    STRATA_RETURN_IF_ERROR(
        CopySync(CopyDir::kHostToDevice, static_cast<uint8_t*>(ptr) + off, zeros.data(), n));
  }
  return Status::OK();
}

Result<std::vector<uint32_t>> Engine::Impl::AllGatherWords(std::span<const uint32_t> mine) {
  const size_t k = mine.size();
  std::vector<uint32_t> all(static_cast<size_t>(world) * k);
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<ptrdiff_t>(rank * k));
  if (world == 1 || k == 0) return all;
  DeviceBuffer own;
  if (k > 4) {
    STRATA_ASSIGN_OR_RETURN(own, DeviceBuffer::Make(opt.device, all.size() * 4));
  }
  // The communicator moves 4-byte elements; as kF32 they are only moved, never summed.
  float* dev = static_cast<float*>(k > 4 ? own.get() : exchange.get());
  STRATA_RETURN_IF_ERROR(CopySync(CopyDir::kHostToDevice, dev + rank * k, mine.data(), k * 4));
  STRATA_ASSIGN_OR_RETURN(CommHandle h, opt.comm->AllGather(dev + rank * k, dev, k, DType::kF32));
  STRATA_RETURN_IF_ERROR(h.WaitUntil(deadline()));
  STRATA_RETURN_IF_ERROR(CopySync(CopyDir::kDeviceToHost, all.data(), dev, all.size() * 4));
  return all;
}

Result<std::vector<uint64_t>> Engine::Impl::FrozenFingerprints() {
  const size_t n = groups.size();
  std::vector<uint64_t> sum(n, 0);
  for (size_t g = 0; g < n; ++g) {
    if (!model.groups[g].trainable) sum[g] = groups[g].frozen_print_part;
  }
  if (placement.optimizer_partitioned && world > 1) {
    // Each rank initialised its own shard of every group: the parts add up over the ranks.
    std::vector<uint32_t> words(2 * n);
    std::memcpy(words.data(), sum.data(), n * sizeof(uint64_t));
    STRATA_ASSIGN_OR_RETURN(std::vector<uint32_t> all, AllGatherWords(words));
    std::fill(sum.begin(), sum.end(), 0);
    for (size_t r = 0; r < static_cast<size_t>(world); ++r) {
      for (size_t g = 0; g < n; ++g) {
        uint64_t part;
        std::memcpy(&part, all.data() + (r * n + g) * 2, sizeof(part));
        sum[g] += part;
      }
    }
  }
  for (size_t g = 0; g < n; ++g) {
    const zero::GroupState& gs = groups[g];
    if (model.groups[g].trainable || gs.frozen_changed || gs.frozen_print_unknown) {
      sum[g] = 0;
    } else if (gs.frozen_print_loaded != 0) {
      sum[g] = gs.frozen_print_loaded;
    }
  }
  return sum;
}

Result<int> Engine::Impl::FirstFailedRank(bool ok, std::string_view what) {
  Result<std::vector<uint32_t>> all = AllGatherWords({ok ? 1u : 0u, 0, 0, 0});
  if (!all.ok()) {
    return Status(all.status().code(), std::string(what) + " (agreeing across ranks): " +
                                           std::string(all.status().message()));
  }
  for (int r = 0; r < world; ++r) {
    if ((*all)[static_cast<size_t>(r) * 4] != 1u) return r;
  }
  return -1;
}

Status Engine::Impl::PublishParams(const SubGroup& s, const float* master, Lease& param) {
  uint8_t* dst = static_cast<uint8_t*>(param.data()) + ParamOffset(s) * elt;
  if (dtype == DType::kF32) {
    std::memcpy(dst, master, s.elems * sizeof(float));
  } else {
    STRATA_RETURN_IF_ERROR(kernels::Cast(master, DType::kF32, dst, dtype, s.elems));
  }
  param.MarkDirty();
  return Status::OK();
}

Status Engine::Impl::AllGatherUpdatedParams(bool frozen_too) {
  if (placement.params_partitioned || !placement.optimizer_partitioned || world == 1) {
    return Status::OK();
  }
  std::vector<Lease> leases;
  std::vector<CommHandle> handles;
  leases.reserve(groups.size());
  Status first;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!model.groups[g].trainable && !frozen_too) continue;  // a step never changes it
    const zero::GroupState& gs = groups[g];
    auto lease = store->Acquire(gs.param, Tier::kDevice, Access::kWrite, timeout());
    if (!lease.ok()) {
      first = lease.status();
      break;
    }
    uint8_t* data = static_cast<uint8_t*>(lease->data());
    auto h = opt.comm->AllGather(data + static_cast<size_t>(rank) * gs.shard.shard_elems * elt,
                                 data, gs.shard.shard_elems, dtype);
    if (!h.ok()) {
      first = h.status();
      break;
    }
    lease->MarkDirty();
    leases.push_back(std::move(*lease));
    handles.push_back(*h);
  }
  Status waited = zero::WaitAll(handles, deadline());
  if (first.ok()) first = waited;
  if (!first.ok()) {
    return Status(first.code(),
                  "all-gather of the updated parameters: " + std::string(first.message()));
  }
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Create
// ---------------------------------------------------------------------------------------------

namespace {

Status RequireResolved(bool is_auto, std::string_view path) {
  if (!is_auto) return Status::OK();
  return Status::InvalidArgument(std::string(path) +
                                 ": \"auto\" is not resolved (pass its value when parsing the "
                                 "config, ParseOptions::auto_values)");
}

// The planner's view of the engine's ZeRO++ settings (its byte model is the engine's ledger).
ZeroPlusPlus PlannerZpp(const zero::ZppState& zpp) {
  ZeroPlusPlus p;
  p.quantized_weights = zpp.qwz;
  p.quantized_gradients = zpp.qgz;
  p.hpz_partition_size = zpp.hpz;
  p.block = static_cast<double>(kernels::kQuantBlock);
  return p;
}

// ZeRO++ settings (docs/collectives.md, "ZeRO++"). As DeepSpeed, they are stage-3 features (qwZ
// quantizes the parameter all-gather, hpZ partitions the gathered copy, qgZ replaces the
// partitioned gradient reduction); below stage 3 they are refused (ZeroPlusPlusStageProblem, the
// config check's rule too).
Status ResolveZpp(const ZeroSettings& z, int world, int ranks_per_node, zero::ZppState* out) {
  zero::ZppState& zpp = *out;
  const ZeroPlusPlus& want = z.zero_plus_plus;
  zpp.qwz = want.quantized_weights;
  zpp.qgz = want.quantized_gradients;
  if (want.hpz_partition_size < 0) {
    return Status::InvalidArgument(
        "zero_optimization.zero_hpz_partition_size: " + std::to_string(want.hpz_partition_size) +
        " is not a rank count >= 0 (0 and 1: off)");
  }
  // 0 is off, as in DeepSpeed (its field is ge=0 and every use tests > 1).
  zpp.hpz = static_cast<int>(std::clamp<int64_t>(want.hpz_partition_size, 1, 1 << 24));
  if (!zpp.any()) return Status::OK();
  std::string below = ZeroPlusPlusStageProblem(z.stage, zpp.qwz, zpp.qgz, zpp.hpz);
  if (!below.empty()) return Status::InvalidArgument(below);
  if (ranks_per_node < 0) {
    return Status::InvalidArgument("EngineOptions.ranks_per_node: must be >= 0");
  }
  if (ranks_per_node == 0) {
    STRATA_ASSIGN_OR_RETURN(ranks_per_node, RanksPerNodeFromEnv(world));
  }
  if (world % ranks_per_node != 0) {
    return Status::InvalidArgument(
        "EngineOptions.ranks_per_node: " + std::to_string(ranks_per_node) +
        " does not divide the world size " + std::to_string(world));
  }
  zpp.local = ranks_per_node;
  zpp.nodes = world / ranks_per_node;
  zpp.group_is_intra = zpp.local % zpp.hpz == 0;
  // The planner's rule for the hpZ group (divides the world; within a node or whole nodes).
  Capacity capacity;
  capacity.gpus_per_node = zpp.local;
  capacity.nodes = zpp.nodes;
  return plan::ValidateZeroPlusPlus(PlannerZpp(zpp), capacity);
}

// Builds the sub-communicators ZeRO++ uses (collective on `comm`: every rank calls it with the
// same settings, in the same place).
Status SplitZppComms(Communicator& comm, zero::ZppState* zpp) {
  if (zpp->qgz) {
    STRATA_ASSIGN_OR_RETURN(HierarchicalComms h, SplitHierarchical(comm, zpp->local));
    zpp->node = std::move(h.intra);
    zpp->cross = std::move(h.inter);
  }
  // hpZ's own communicator even when its group is the node: qgZ's run on another thread.
  if (zpp->hpz > 1) {
    STRATA_ASSIGN_OR_RETURN(zpp->group, comm.Split(comm.rank() / zpp->hpz, comm.rank()));
  }
  return Status::OK();
}

// What Create's steps hand on: the config's settings, and the parts of the layout the budgets and
// the store are sized by.
struct CreateState {
  ResolvedZero resolved;
  uint64_t prefetch_elems = 0;     // stage3_prefetch_bucket_size
  uint64_t store_cache_bytes = 0;  // the store's device copies of param shards: its own budget
  uint64_t swap_bytes = 0;         // host copies of NVMe-homed blocks in use: the rest is cache
  // The speculation's room given to the host cache (sched::SpeculationRoomCaches): added to the
  // default host budget.
  uint64_t cache_room_bytes = 0;
};

// One optimizer group's hyperparameters: the config's, with the group's own values over them.
Status ResolveOptimizerGroup(const kernels::AdamHyper& base, const OptimizerGroupOptions& o,
                             size_t index, Engine::Impl& e) {
  kernels::AdamHyper h = base;
  if (o.lr) h.lr = *o.lr;
  if (o.beta1) h.beta1 = *o.beta1;
  if (o.beta2) h.beta2 = *o.beta2;
  if (o.eps) h.eps = *o.eps;
  if (o.weight_decay) h.weight_decay = *o.weight_decay;
  kernels::AdamShard probe;
  Status st = kernels::ValidateAdam(h, probe);
  if (!st.ok()) {
    return Status::InvalidArgument("optimizer_groups[" + std::to_string(index) +
                                   "]: " + std::string(st.message()));
  }
  e.hyper.push_back(h);
  e.own_lr.push_back(o.lr);
  e.client_betas.push_back(false);
  return Status::OK();
}

// The working dtype, the optimizer's hyperparameters (per optimizer group), the loss scaler and
// the lr schedule.
Status ResolveOptimizer(const EngineConfig& c, const ResolvedZero& r,
                        const std::vector<OptimizerGroupOptions>& groups, Engine::Impl& e) {
  for (const ResolvedZero::Defaulted& d : r.defaulted) {
    if (d.sizes_engine) return RequireResolved(true, d.path);
  }
  if (r.precision_conflict) {
    return Status::InvalidArgument("fp16.enabled and bf16.enabled are both true");
  }
  e.dtype = r.dtype;
  e.elt = DTypeSize(e.dtype);
  const OptimizerConfig& oc = c.optimizer;
  // A model whose every group is frozen (one that only runs forward: a reference model, a
  // teacher) keeps no optimizer state and needs no "optimizer" section, as under DeepSpeed.
  const bool trains = std::any_of(e.model.groups.begin(), e.model.groups.end(),
                                  [](const GroupSpec& g) { return g.trainable; });
  const bool none_needed = oc.type == OptimizerType::kNone && !trains;
  if (oc.type != OptimizerType::kAdam && oc.type != OptimizerType::kAdamW && !none_needed) {
    return Status::InvalidArgument("optimizer.type: the engine runs Adam or AdamW (got " +
                                   std::string(OptimizerTypeName(oc.type)) +
                                   "); add an \"optimizer\" section");
  }
  STRATA_RETURN_IF_ERROR(RequireResolved(oc.lr.is_auto(), "optimizer.params.lr"));
  STRATA_RETURN_IF_ERROR(RequireResolved(oc.betas.is_auto(), "optimizer.params.betas"));
  STRATA_RETURN_IF_ERROR(RequireResolved(oc.eps.is_auto(), "optimizer.params.eps"));
  STRATA_RETURN_IF_ERROR(
      RequireResolved(oc.weight_decay.is_auto(), "optimizer.params.weight_decay"));
  kernels::AdamHyper base;
  base.beta1 = oc.betas.value_or({0.9, 0.999}).first;
  base.beta2 = oc.betas.value_or({0.9, 0.999}).second;
  base.eps = oc.eps.value_or(1e-8);
  base.weight_decay = oc.weight_decay.value_or(0.0);
  // DeepSpeed: "AdamW" always decouples; "Adam" does when adam_w_mode (default true).
  base.decoupled_weight_decay = oc.type == OptimizerType::kAdamW || oc.adam_w_mode;
  base.bias_correction = oc.bias_correction;
  base.lr = oc.lr.value_or(1e-3);
  const std::vector<OptimizerGroupOptions> one(1);
  const std::vector<OptimizerGroupOptions>& og = groups.empty() ? one : groups;
  for (size_t i = 0; i < og.size(); ++i) {
    STRATA_RETURN_IF_ERROR(ResolveOptimizerGroup(base, og[i], i, e));
  }
  for (size_t g = 0; g < e.model.groups.size(); ++g) {
    if (e.model.groups[g].optimizer_group >= og.size()) {
      return Status::InvalidArgument(
          "model.groups[" + std::to_string(g) + "] ('" + e.model.groups[g].name +
          "'): optimizer_group " + std::to_string(e.model.groups[g].optimizer_group) +
          " is out of range (" + std::to_string(og.size()) + " optimizer group(s))");
    }
  }
  STRATA_ASSIGN_OR_RETURN(zero::LossScaler scaler, zero::LossScaler::FromConfig(c));
  e.scaler.emplace(std::move(scaler));
  STRATA_ASSIGN_OR_RETURN(zero::LrSchedule schedule, zero::LrSchedule::FromConfig(c));
  e.schedule.emplace(std::move(schedule));
  for (const std::string& n : e.schedule->notes()) e.layout.notes.push_back(n);
  e.last_lr = e.LrFor(0);
  return Status::OK();
}

Status CheckAccumulationSteps(double gas) {
  if (!(gas >= 1) || gas > static_cast<double>(int64_t{1} << 30)) {
    return Status::InvalidArgument("gradient_accumulation_steps: " +
                                   std::to_string(static_cast<int64_t>(gas)) +
                                   " is not a positive count");
  }
  return Status::OK();
}

// What multiplies each reduced gradient: the averaging over ranks, then over micro-steps (with
// fp16 in the loss scale instead: Impl::LossScaleDividesGas).
float PostScale(const Engine::Impl& e, int gas) {
  const int divisor = e.LossScaleDividesGas() ? 1 : gas;
  return static_cast<float>(static_cast<double>(e.reduce_scale) / divisor);
}

// Accumulation, clipping and the averaging of the reduced gradient.
Status ResolveGradients(const EngineConfig& c, const ResolvedZero& r, Engine::Impl& e) {
  STRATA_RETURN_IF_ERROR(RequireResolved(c.gradient_clipping.is_auto(), "gradient_clipping"));
  const double gas = r.zero.gradient_accumulation_steps;
  STRATA_RETURN_IF_ERROR(CheckAccumulationSteps(gas));
  e.gas = static_cast<int>(gas);
  e.clip = c.gradient_clipping.value_or(0.0);
  if (!(e.clip >= 0) || !std::isfinite(e.clip)) {
    return Status::InvalidArgument("gradient_clipping: must be a finite value >= 0");
  }
  std::string division =
      GradientDivisionProblem(c.prescale_gradients, c.gradient_predivide_factor, e.world);
  if (!division.empty()) return Status::InvalidArgument(division);
  if (c.prescale_gradients || c.gradient_predivide_factor == static_cast<double>(e.world)) {
    e.predivide = true;
    e.post_scale = 1.0f;
  } else {
    e.post_scale = static_cast<float>(1.0 / e.world);
  }
  e.reduce_scale = e.post_scale;
  e.post_scale = PostScale(e, e.gas);
  return Status::OK();
}

// Element counts of the config (non-negative, as the engine holds them).
uint64_t Elems(double v) { return v > 0 ? static_cast<uint64_t>(v) : 0; }

// Placement (the planner's rule), ZeRO++, overlap, sub-groups and the stage-3 limits.
Status ResolvePlacement(const ResolvedZero& r, const EngineOptions& options, Engine::Impl& e,
                        CreateState* cs) {
  const ZeroSettings& z = r.zero;
  if (z.stage < 0 || z.stage > 3) {
    return Status::InvalidArgument("zero_optimization.stage: " + std::to_string(z.stage) +
                                   " is not 0..3");
  }
  e.placement =
      sched::ResolvePlacement(z.stage, z.offload_optimizer, z.offload_param, z.optimizer_ratio);
  for (const std::string& n : e.placement.notes) e.layout.notes.push_back(n);
  e.grad_dtype = sched::GradStateDType(e.dtype, e.gas, e.world, e.placement);
  STRATA_RETURN_IF_ERROR(ResolveZpp(z, e.world, options.ranks_per_node, &e.zpp));
  e.overlap_comm = z.overlap_comm.value_or(false);
  if (options.overlap_step) {
    // The job runs the CPU Adam beside the trainer's gathers: the optimizer state must be
    // offloaded (the CPU's pool, not the device's kernels) and the gathers must not use the pool
    // (qwZ quantizes on it) or need the step's all-gather (stages 1-2 publish params in Step).
    e.overlap_step = e.placement.params_partitioned &&
                     e.placement.Home(StateKind::kMaster32) != Tier::kDevice && !e.zpp.any() &&
                     e.placement.optimizer_ratio >= 1.0;
    if (!e.overlap_step) {
      e.layout.notes.push_back(
          "overlap_step: not applied (it needs stage 3 with offload_optimizer cpu or nvme, ratio "
          "1, and no ZeRO++); Step runs the optimizer before it returns");
    }
  }
  if (z.sub_group_size < 0) {
    return Status::InvalidArgument("zero_optimization.sub_group_size: must be >= 0");
  }
  // 0 is valid DeepSpeed: each tensor its own sub-group, sized by the largest tensor.
  uint64_t largest_tensor = 0;
  for (const GroupSpec& g : e.model.groups) {
    for (const ParamSpec& p : g.params) largest_tensor = std::max<uint64_t>(largest_tensor, p.numel());
  }
  e.sub_group_elems = sched::SubGroupElems(Elems(z.sub_group_size), largest_tensor,
                                           zero::kShardAlignElems);
  const auto buffer_count = static_cast<int64_t>(z.optimizer_buffer_count);
  e.pipeline_buffers = static_cast<uint32_t>(std::clamp<int64_t>(buffer_count, 1, 64));
  if (buffer_count < 3 && e.placement.offload_optimizer == OffloadDevice::kNvme) {
    e.layout.notes.push_back("offload_optimizer.buffer_count " + std::to_string(buffer_count) +
                             ": the optimizer step overlaps NVMe reads and writes from 3 buffers "
                             "on; it runs slower, not wrong");
  }
  e.persistence_elems = Elems(z.param_persistence_threshold);
  e.model_persistence_elems = Elems(z.model_persistence_threshold);
  e.reuse_distance_elems = Elems(z.max_reuse_distance);
  e.max_live_elems = Elems(z.max_live_parameters);
  cs->prefetch_elems = Elems(z.prefetch_bucket_size);
  return Status::OK();
}

// The shards and sub-groups of this rank (the rule of sched/zero_layout.h, which also sizes them).
Status PartitionGroups(Engine::Impl& e) {
  std::vector<size_t> numels;
  for (const GroupSpec& g : e.model.groups) numels.push_back(g.numel());
  STRATA_ASSIGN_OR_RETURN(e.partition,
                          sched::PlanPartition(numels, e.world, zero::kShardAlignElems));
  e.persistent = sched::PersistentGroups(numels, e.persistence_elems, e.model_persistence_elems);
  e.groups.resize(e.model.groups.size());
  for (size_t g = 0; g < e.model.groups.size(); ++g) {
    zero::GroupState& gs = e.groups[g];
    gs.numel = numels[g];
    gs.shard = e.partition.groups[g];
    size_t off = 0;
    for (const ParamSpec& p : e.model.groups[g].params) {
      gs.param_offsets.push_back(off);
      off += p.numel();
    }
    // A frozen group's pieces only say what its initialisation writes (no states).
    const bool trainable = e.model.groups[g].trainable;
    std::vector<SubGroup>& into = trainable ? e.subs : e.frozen_pieces;
    const int first_owner = e.placement.optimizer_partitioned ? e.rank : 0;
    const int end_owner = e.placement.optimizer_partitioned ? e.rank + 1 : e.world;
    for (int owner = first_owner; owner < end_owner; ++owner) {
      for (size_t o = 0; o < gs.shard.shard_elems; o += e.sub_group_elems) {
        SubGroup s;
        s.group = g;
        s.owner = owner;
        s.offset = o;
        s.elems = std::min(e.sub_group_elems, gs.shard.shard_elems - o);
        if (trainable) gs.sub_groups.push_back(e.subs.size());
        into.push_back(s);
      }
    }
  }
  // Partial offload: the first sub-groups in forward order stay on the device.
  std::vector<uint64_t> elems;
  for (const SubGroup& s : e.subs) elems.push_back(s.elems);
  const size_t resident = sched::DeviceResidentSubGroups(e.placement, elems);
  for (size_t i = 0; i < resident; ++i) e.subs[i].on_device = true;
  return Status::OK();
}

// ZeRO++'s state and working bytes: the hpZ secondary copy (a state: it lives from the first
// gather to the next step) and the quantized collectives' wire buffers (device) and fp32 sums
// (host).
void LayOutZpp(const sched::StateLayout& states, const EngineOptions& options, Engine::Impl& e) {
  EngineLayout& L = e.layout;
  L.quantized_weights = e.zpp.qwz;
  L.quantized_gradients = e.zpp.qgz;
  L.hpz_partition_size = e.zpp.hpz;
  L.ranks_per_node = e.zpp.local;
  if (e.zpp.hpz > 1) {
    // The planner's figure, for each group's padded size (what the secondary buffers hold).
    for (const zero::GroupState& gs : e.groups) {
      L.hpz_secondary_bytes += static_cast<uint64_t>(
          ZeroPlusPlusComm(PlannerZpp(e.zpp), static_cast<double>(gs.shard.padded_elems(e.world)),
                           static_cast<double>(e.elt), static_cast<double>(e.elt), e.zpp.local,
                           e.zpp.nodes)
              .hpz_secondary_bytes_per_gpu);
    }
    L.state_bytes[Tier::kDevice] += L.hpz_secondary_bytes;
    L.notes.push_back("hpZ: a secondary copy of 1/" + std::to_string(e.zpp.hpz) +
                      " of the 16-bit params on the device (" + Bytes(L.hpz_secondary_bytes) +
                      "); later gathers in a step stay within groups of " +
                      std::to_string(e.zpp.hpz) + " ranks");
  }
  const zero::ZppWorkingBytes w = zero::ZppWorking(
      e.zpp.qwz, e.zpp.qgz, e.world, e.zpp.nodes, states.largest_shard, states.largest_padded,
      e.elt, options.device->host_addressable());
  L.working_bytes[Tier::kDevice] += w.device;
  L.working_bytes[Tier::kHost] += w.host;
}

// The engine's device working set: the shared rule (sched/placement.h, DeviceWorkingSet), the
// same items `offloadctl plan` lists. ZeRO++'s wire buffers are LayOutZpp's.
void LayOutDeviceWorking(const sched::StateLayout& states, const EngineOptions& options,
                         Engine::Impl& e, CreateState* cs) {
  sched::DeviceWorkingInput dw;
  dw.world = e.world;
  dw.largest_group_elems = states.largest_padded;
  dw.largest_group_numel = states.largest_numel;
  dw.largest_shard_elems = states.largest_shard;
  dw.total_group_elems = states.total_padded;
  dw.grad_group_elems = states.largest_trainable_padded;  // frozen groups take no gradient
  dw.grad_shard_elems = states.largest_trainable_shard;
  dw.param_elem_bytes = e.elt;
  dw.grad_elem_bytes = e.elt;
  dw.overlap_comm = e.overlap_comm;
  dw.quantized_gradients = e.zpp.qgz;
  dw.quantized_weights = e.zpp.qwz;
  dw.max_live_elems = e.max_live_elems;
  dw.reuse_distance_elems = e.reuse_distance_elems;
  dw.prefetch_elems = cs->prefetch_elems;
  dw.persistence_elems = e.persistence_elems;
  dw.model_persistence_elems = e.model_persistence_elems;
  dw.device_kernels = !options.device->host_addressable();
  dw.device_sub_groups = states.device_sub_groups;
  dw.sub_groups = states.sub_groups;
  dw.sub_group_elems = states.sub_group_elems;
  dw.device_sub_group_elems = states.device_sub_group_elems;
  dw.optimizer_buffers = e.pipeline_buffers;
  dw.largest_sub_group_elems = states.largest_sub;
  dw.copy_alignment = kIoAlignment;
  for (const sched::DeviceWorkingItem& it : sched::DeviceWorkingSet(e.placement, dw)) {
    e.layout.working_bytes[Tier::kDevice] += it.bytes;
    if (it.store_cache) cs->store_cache_bytes += it.bytes;
  }
  // Recycled gradient buffers (Impl::spare_grads): as many as the rule above counts, each the
  // size it counts.
  e.grad_buffer_bytes = states.largest_trainable_padded * e.elt;
  e.grad_buffer_cap = sched::OneRankGradBuffers(e.placement, e.overlap_comm, dw.device_kernels);
}

// The host working set: the optimizer pipeline's sub-groups in flight (NVMe-homed state is paged
// through host memory), parameter shards staged from NVMe, and on a device the host cannot
// address the states computed on the host whose home is that device, and a group's gradient
// staged to the host (Impl::grad_staging: at most a sub-group's). (The rules are shared with
// the planner: sched/placement.h.)
void LayOutHostWorking(const sched::StateLayout& states, const ZeroSettings& z,
                       const EngineOptions& options, Engine::Impl& e, CreateState* cs) {
  // Partial offload: only the offloaded sub-groups page through the buffers.
  const uint64_t offloaded = e.subs.size() - states.device_sub_groups;
  if ((e.placement.Home(StateKind::kMaster32) == Tier::kNvme ||
       e.placement.Home(StateKind::kGrad) == Tier::kNvme) &&
      offloaded > 0) {
    cs->swap_bytes += sched::OptimizerSwapBufferBytes(e.pipeline_buffers, states.largest_sub,
                                                      offloaded, DTypeSize(e.grad_dtype));
  }
  if (e.placement.Home(StateKind::kParam16) == Tier::kNvme) {
    cs->swap_bytes += sched::ParamSwapBufferBytes(static_cast<int64_t>(z.param_buffer_count),
                                                  states.largest_shard, e.dtype);
  }
  e.layout.working_bytes[Tier::kHost] += cs->swap_bytes;
  e.largest_sub_elems = states.largest_sub;
  if (!options.device->host_addressable()) {
    const uint64_t sub_bytes = 4 * RoundUp(states.largest_sub * 4, 4096);
    e.layout.working_bytes[Tier::kHost] += 2 * sub_bytes + states.largest_padded * e.elt;
  }
}

// offload_optimizer.speculative_step, where it applies (the optimizer offloaded: its Adam runs on
// the CPU beside the backward): the rollback copies' host bytes, by the rule the planner shares
// (sched::SpeculationBufferBytes). Unset, the key means on, unless that room holds the rank's
// whole NVMe-homed state as host cache instead (sched::SpeculationRoomCaches: CheckBudgets'
// default budget then keeps the room).
void LayOutSpeculation(const EngineOptions& options, Engine::Impl& e, CreateState* cs) {
  const OffloadOptimizerConfig& o = options.config.zero.offload_optimizer;
  EngineLayout& L = e.layout;
  uint64_t elems = 0;  // offloaded (partial offload: the device-resident ones step in Step)
  for (const SubGroup& s : e.subs) elems += s.on_device ? 0 : s.elems;
  // Stage 3: the trainer's gathered copies are its own (stages 0-2 hand out the param replica
  // the step writes, for the whole step in the Python adapter).
  const bool applies = e.placement.params_partitioned &&
                       e.placement.Home(StateKind::kMaster32) != Tier::kDevice && elems > 0;
  uint64_t bytes = 0;
  if (applies) {
    const uint64_t given = options.budget_bytes[Tier::kHost];
    const uint64_t need = L.state_bytes[Tier::kHost] + L.working_bytes[Tier::kHost];
    const uint64_t room = given == 0 ? UINT64_MAX : given - std::min(given, need);
    bytes = sched::SpeculationBufferBytes(o.speculation_buffer_size, elems, e.elt, room);
    const uint64_t cacheable =
        sched::CacheableNvmeBytes(L.state_bytes[Tier::kNvme], cs->swap_bytes);
    // Whether or not overlap_step keeps the speculation off: the memory is the same either way.
    if (sched::SpeculationRoomCaches(o.speculative_step, cacheable, bytes)) {
      cs->cache_room_bytes = cacheable;
      L.notes.push_back(
          "speculative_step: off by default: the room its rollback copies would take (" +
          Bytes(bytes) + ") keeps all " + Bytes(L.state_bytes[Tier::kNvme]) +
          " of NVMe-homed state in host memory instead (" + Bytes(cacheable) +
          " cached beside the swap buffers' " + Bytes(L.state_bytes[Tier::kNvme] - cacheable) +
          "; written home only when flushed or evicted); speculative_step true turns it on");
      return;
    }
  }
  if (!sched::SpeculationOn(o.speculative_step, options.overlap_step)) {
    if (!o.speculative_step.has_value()) {
      L.notes.push_back(
          "speculative_step: off by default while each optimizer step runs behind the next "
          "forward (it would make Step wait for the step's work); speculative_step true turns it "
          "on");
    }
    return;
  }
  if (!applies) {
    if (o.speculative_step.has_value()) {
      L.notes.push_back(
          "speculative_step: not applied (it needs stage 3 with offload_optimizer cpu or nvme "
          "and a trainable group); Step runs the whole optimizer step");
    }
    return;
  }
  if (bytes == 0) {
    L.notes.push_back(
        "speculative_step: not applied (no room for its rollback copies: "
        "offload_optimizer.speculation_buffer_size or the host budget)");
    return;
  }
  e.spec = std::make_unique<zero::Speculation>(o.speculative_step);
  e.spec->buffer_bytes = bytes;
  // Made now, untouched until used: the host budget counts it from the start (Stats' peak too).
  e.spec->arena.reset(new uint8_t[bytes]);
  e.ResetSpeculation();
  L.working_bytes[Tier::kHost] += bytes;
  const uint64_t per_elem = sched::SpeculationBytesPerElement(e.elt);
  L.notes.push_back(
      "speculative_step: a group's Adam runs during the backward once its gradient "
      "is final, undone exactly when the step is clipped or skipped; rollback "
      "copies of up to " +
      std::to_string(bytes / per_elem) + " of " + std::to_string(elems) + " optimizer elements (" +
      Bytes(bytes) + " host)");
}

// Bytes per tier: the states (sched/zero_layout.h), ZeRO++'s, and the working sets.
void LayOut(const EngineOptions& options, Engine::Impl& e, CreateState* cs) {
  EngineLayout& L = e.layout;
  L.stage = e.placement.stage;
  L.offload_optimizer = e.placement.offload_optimizer;
  L.offload_param = e.placement.offload_param;
  L.dtype = e.dtype;
  L.grad_dtype = e.grad_dtype;
  L.world_size = e.world;
  L.rank = e.rank;
  L.params = e.model.numel();
  L.sub_groups = e.subs.size();
  L.optimizer_ratio = e.placement.optimizer_ratio;
  sched::StateLayoutInput in;
  in.world = e.world;
  for (const GroupSpec& g : e.model.groups) in.groups.push_back({g.numel(), 1, g.trainable});
  in.sub_group_elems = e.sub_group_elems;
  in.shard_align_elems = zero::kShardAlignElems;
  in.block_align_bytes = kIoAlignment;  // the store carves host and NVMe space in these units
  auto width = [&](StateKind k) {
    return static_cast<double>(sched::StateElementBytes(k, e.dtype, e.grad_dtype));
  };
  in.widths = {width(StateKind::kParam16), width(StateKind::kGrad), width(StateKind::kMaster32),
               width(StateKind::kExpAvg), width(StateKind::kExpAvgSq)};
  const sched::StateLayout states = sched::LayOutStates(e.placement, in);
  for (Tier t : kAllTiers) L.state_bytes[t] += static_cast<uint64_t>(states.tier_bytes[t]);
  L.device_sub_groups = states.device_sub_groups;
  L.offloaded_fraction =
      states.sub_group_elems > 0
          ? static_cast<double>(states.sub_group_elems - states.device_sub_group_elems) /
                static_cast<double>(states.sub_group_elems)
          : 1.0;
  LayOutZpp(states, options, e);
  LayOutDeviceWorking(states, options, e, cs);
  LayOutHostWorking(states, cs->resolved.zero, options, e, cs);
  LayOutSpeculation(options, e, cs);
}

// Budgets (0: the device's own; host and NVMe: what the layout needs), checked per tier.
Status CheckBudgets(const EngineOptions& options, Engine::Impl& e, const CreateState& cs) {
  EngineLayout& L = e.layout;
  L.budget_bytes = options.budget_bytes;
  if (L.budget_bytes[Tier::kDevice] == 0)
    L.budget_bytes[Tier::kDevice] = options.device->stats().budget_bytes;
  const uint64_t host_need = L.state_bytes[Tier::kHost] + L.working_bytes[Tier::kHost];
  if (L.budget_bytes[Tier::kHost] == 0)
    L.budget_bytes[Tier::kHost] = host_need + sched::kHostBudgetSlackBytes + cs.cache_room_bytes;
  // The store keeps NVMe-homed blocks cached in whatever host budget the working set leaves.
  L.cache_bytes[Tier::kHost] = sched::HostCacheBytes(L.budget_bytes[Tier::kHost], host_need,
                                                     L.state_bytes[Tier::kNvme], cs.swap_bytes);
  // Every NVMe-homed block then fits: the engine writes none home (Engine::Impl).
  e.nvme_state_cached = L.state_bytes[Tier::kNvme] > 0 &&
                        L.cache_bytes[Tier::kHost] ==
                            sched::CacheableNvmeBytes(L.state_bytes[Tier::kNvme], cs.swap_bytes);
  if (L.budget_bytes[Tier::kNvme] == 0) L.budget_bytes[Tier::kNvme] = L.state_bytes[Tier::kNvme];
  for (Tier t : kAllTiers) {
    const uint64_t need = L.state_bytes[t] + L.working_bytes[t];
    if (need > L.budget_bytes[t]) {
      return Status::ResourceExhausted(
          "the placement does not fit the " + std::string(TierName(t)) + " tier of rank " +
          std::to_string(e.rank) + ": it needs " + Bytes(need) + " (" + Bytes(L.state_bytes[t]) +
          " of states, " + Bytes(L.working_bytes[t]) + " working) and the budget is " +
          Bytes(L.budget_bytes[t]) + "\n" + L.ToString());
    }
  }
  return Status::OK();
}

// The store: homes plus caches. The device share excludes the engine's own device buffers.
Status OpenStore(const EngineConfig& c, EngineOptions& options, Engine::Impl& e,
                 const CreateState& cs) {
  EngineLayout& L = e.layout;
  const ZeroSettings& z = cs.resolved.zero;
  const Tier param_home = e.placement.Home(StateKind::kParam16);
  const Tier opt_home = e.placement.Home(StateKind::kMaster32);
  TieredStoreOptions so;
  so.device = options.device;
  // The hpZ secondary copy is a device state the engine allocates itself, not a store block.
  // The param shards it caches on the device are its own blocks: they stay in its share.
  so.device_budget_bytes = L.budget_bytes[Tier::kDevice] - L.working_bytes[Tier::kDevice] +
                           cs.store_cache_bytes - L.hpz_secondary_bytes;
  // The speculation's rollback copies are the engine's own host memory, beside the store's.
  so.host_budget_bytes = L.budget_bytes[Tier::kHost] - (e.spec ? e.spec->buffer_bytes : 0);
  so.rank = e.rank;
  so.io_deadline = options.timeout;
  const bool pin = z.optimizer_pin_memory || z.param_pin_memory;
  e.pin_host = pin;
  so.use_pinned_pool = options.use_pinned_pool;  // huge pages either way
  so.lock_host_memory = pin;
  if (options.use_pinned_pool && !pin &&
      (opt_home != Tier::kDevice || param_home != Tier::kDevice)) {
    L.notes.push_back(
        options.device->host_addressable()
            ? "pin_memory is false: host buffers are not page-locked (no mlock)"
            : "pin_memory is false: host buffers are not page-locked (no mlock), so every copy "
              "between them and the device is synchronous, staged by the driver, and waits for "
              "the device's queue (set offload_*.pin_memory true for asynchronous copies)");
  }
  if (L.state_bytes[Tier::kNvme] > 0) {
    so.nvme_capacity_bytes = L.budget_bytes[Tier::kNvme];
    so.nvme_paths = options.nvme_paths;
    if (so.nvme_paths.empty()) {
      const ZeroConfig& zc = c.zero;
      if (opt_home == Tier::kNvme) so.nvme_paths.push_back(zc.offload_optimizer.nvme_path);
      if (param_home == Tier::kNvme &&
          zc.offload_param.nvme_path != zc.offload_optimizer.nvme_path) {
        so.nvme_paths.push_back(zc.offload_param.nvme_path);
      }
    }
    for (const std::string& p : so.nvme_paths) {
      if (p.empty()) {
        return Status::InvalidArgument(
            "zero_optimization.offload_*.nvme_path: required when a state lives on nvme");
      }
    }
    if (options.io) {
      so.io = std::move(options.io);
    } else {
      IoBackendOptions io;
      io.kind = options.io_kind;
      io.queue_depth =
          static_cast<size_t>(std::clamp<int64_t>(c.aio.queue_depth, 1, kAioMaxQueueDepth));
      STRATA_ASSIGN_OR_RETURN(so.io, OpenIoBackend(io));
    }
  }
  STRATA_ASSIGN_OR_RETURN(e.store, OpenTieredStore(std::move(so)));
  e.host_blocks_locked = e.store->host_page_locked();
  return Status::OK();
}

// One block per state of each group (param16) and of each sub-group (master32, exp_avg,
// exp_avg_sq, grad), the blocks sched::LayOutStates counted.
Status RegisterBlocks(Engine::Impl& e, std::vector<BlockId>* shard_blocks) {
  const Tier param_home = e.placement.Home(StateKind::kParam16);
  const std::string r = std::to_string(e.rank);
  for (size_t g = 0; g < e.groups.size(); ++g) {
    zero::GroupState& gs = e.groups[g];
    const std::string& name = e.model.groups[g].name;
    BlockSpec b;
    b.dtype = e.dtype;
    b.kind = StateKind::kParam16;
    b.home = param_home;
    if (e.placement.params_partitioned) {
      b.name = name + ".param16[r" + r + "]";
      b.size_bytes = gs.shard.shard_elems * e.elt;
    } else {
      b.name = name + ".param16[full r" + r + "]";
      b.size_bytes = gs.shard.padded_elems(e.world) * e.elt;
    }
    STRATA_ASSIGN_OR_RETURN(gs.param, e.store->Register(b));
    shard_blocks->push_back(gs.param);
    size_t k = 0;
    for (size_t si : gs.sub_groups) {
      SubGroup& s = e.subs[si];
      const std::string tag = "[r" + r +
                              (s.owner != e.rank ? " of r" + std::to_string(s.owner) : "") +
                              " sg" + std::to_string(k++) + "]";
      auto reg = [&](StateKind kind) {
        BlockSpec sb;
        sb.name = name + "." + std::string(StateKindName(kind)) + tag;
        sb.size_bytes = s.elems * sched::StateElementBytes(kind, e.dtype, e.grad_dtype);
        sb.dtype = kind == StateKind::kGrad ? e.grad_dtype : DType::kF32;
        sb.kind = kind;
        sb.home = e.HomeOf(s, kind);
        return e.store->Register(sb);
      };
      STRATA_ASSIGN_OR_RETURN(s.master, reg(StateKind::kMaster32));
      STRATA_ASSIGN_OR_RETURN(s.exp_avg, reg(StateKind::kExpAvg));
      STRATA_ASSIGN_OR_RETURN(s.exp_avg_sq, reg(StateKind::kExpAvgSq));
      STRATA_ASSIGN_OR_RETURN(s.grad, reg(StateKind::kGrad));
    }
  }
  if (e.layout.state_bytes[Tier::kNvme] > 0) STRATA_RETURN_IF_ERROR(e.store->OpenNvme());
  // The store's note (buffered IO, reclaimed swap files of a dead run) once NVMe is open.
  if (!e.store->note().empty()) e.layout.notes.push_back(e.store->note());
  return Status::OK();
}

// Stage 3's gather scheduler over the param shards, and the CPU optimizer's threads.
Status StartSchedulers(const EngineOptions& options, const std::vector<BlockId>& shard_blocks,
                       Engine::Impl& e, const CreateState& cs) {
  if (e.placement.params_partitioned) {
    // The limits count full parameters; the prefetcher works on this rank's shards.
    const sched::ShardLimits lim = sched::PerRankShardLimits(cs.prefetch_elems, e.max_live_elems,
                                                             e.reuse_distance_elems, e.world);
    const auto pc = sched::PrefetchConfig::FromNumel(lim.prefetch_elems, lim.max_live_elems,
                                                     lim.reuse_distance_elems, e.elt);
    e.gather =
        std::make_unique<store::GatherScheduler>(e.store.get(), shard_blocks, pc, e.persistent);
    // overlap_step: no prefetch of a group whose update the step running behind has not
    // written yet (the copy it brought would be replaced: NVMe reads for nothing).
    Engine::Impl* impl = &e;
    // speculative_step: nor of a group whose Adam the backward's speculation has queued.
    e.gather->set_held([impl](sched::GroupId g) {
      return (impl->deferred && !impl->deferred->updated[g].load(std::memory_order_acquire)) ||
             (impl->spec && impl->spec->group_queued[g] != 0);
    });
  }
  kernels::PoolOptions pool_options;
  pool_options.threads = std::max(0, options.optimizer_threads);
  STRATA_ASSIGN_OR_RETURN(e.pool, kernels::KernelPool::Create(pool_options));
  return Status::OK();
}

}  // namespace

Communicator* zero::ZppState::hpz_comm() const { return group.get(); }

// Create's steps: resolve the config (ResolveZeroSettings, shared with the planner), partition,
// lay out the bytes per tier, then, agreed across ranks, check the budgets, open the store,
// register the blocks and start the schedulers.
Result<std::unique_ptr<Engine>> Engine::Create(const ModelSpec& model, EngineOptions options) {
  STRATA_RETURN_IF_ERROR(model.Validate());
  if (options.device == nullptr) return Status::InvalidArgument("EngineOptions.device is null");
  if (options.comm == nullptr) return Status::InvalidArgument("EngineOptions.comm is null");
  auto impl = std::make_unique<Impl>();
  Impl& e = *impl;
  e.model = model;
  e.rank = options.comm->rank();
  e.world = options.comm->world_size();
  const EngineConfig& c = options.config;
  CreateState cs;
  cs.resolved = ResolveZeroSettings(c);
  STRATA_RETURN_IF_ERROR(ResolveOptimizer(c, cs.resolved, options.optimizer_groups, e));
  STRATA_RETURN_IF_ERROR(ResolveGradients(c, cs.resolved, e));
  STRATA_RETURN_IF_ERROR(ResolvePlacement(cs.resolved, options, e, &cs));
  STRATA_RETURN_IF_ERROR(PartitionGroups(e));
  LayOut(options, e, &cs);
  // From here on a rank can fail for reasons of its own (its budgets, its disk): the ranks agree
  // before any returns, so that no rank is left waiting for a peer that gave up.
  e.opt.device = options.device;
  e.opt.comm = options.comm;
  e.opt.timeout = options.timeout;
  STRATA_ASSIGN_OR_RETURN(e.exchange,
                          DeviceBuffer::Make(options.device, static_cast<uint64_t>(e.world) * 16));
  STRATA_RETURN_IF_ERROR(e.AgreeOnSetup(c, options.optimizer_groups));
  // Collective, so before anything a rank may fail on its own (the config is the same on every
  // rank, as AgreeOnSetup checked; a failed split fails the communicator, and the peers with it).
  STRATA_RETURN_IF_ERROR(SplitZppComms(*options.comm, &e.zpp));
  Status built = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(CheckBudgets(options, e, cs));
    STRATA_RETURN_IF_ERROR(OpenStore(c, options, e, cs));
    std::vector<BlockId> shard_blocks;
    STRATA_RETURN_IF_ERROR(RegisterBlocks(e, &shard_blocks));
    return StartSchedulers(options, shard_blocks, e, cs);
  }();
  STRATA_ASSIGN_OR_RETURN(int failed_rank, e.FirstFailedRank(built.ok(), "engine creation"));
  if (!built.ok()) return built;
  if (failed_rank >= 0) {
    return Status::Aborted("rank " + std::to_string(failed_rank) +
                           " could not create its engine (its own error says why); every rank "
                           "refuses");
  }
  e.opt = std::move(options);
  e.opt.io.reset();
  e.totals.store.budget_bytes = e.layout.budget_bytes;
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

// ---------------------------------------------------------------------------------------------
// Engine forwarding
// ---------------------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)), owner_(std::make_shared<GatheredGroup::Owner>()) {
  owner_->engine = this;
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> l(owner_->mu);
    owner_->engine = nullptr;  // handles still out give nothing back from here
  }
  if (!impl_) return;
  // An overlapped step uses the store and the pool: let it end (its error is moot now).
  if (impl_->deferred && impl_->deferred->thread.joinable()) impl_->deferred->thread.join();
  impl_->FinishSpeculation().IgnoreError();  // so does the speculation's worker
  // Reductions in flight use buffers this engine owns: finish them (errors are moot now).
  for (auto& p : impl_->pending) p.Wait(impl_->deadline()).IgnoreError();
  if (impl_->last_qgz.valid()) impl_->last_qgz.wait();
  impl_->accumulator.reset();  // runs the accumulations posted, which read those buffers
  impl_->pending.clear();
  if (impl_->copy_overran.load()) {
    // A copy past its deadline may still move bytes to or from host memory this engine holds
    // (CopyDirect): it must land before that memory goes. The communicators are aborted first
    // (Fail; a no-op where the overrun failed the engine already), so that a copy queued behind
    // one of their collectives runs.
    impl_->Fail(Status::DeadlineExceeded("a device copy did not finish")).IgnoreError();
    impl_->opt.device->Synchronize().IgnoreError();
  }
  impl_->DropKeptCopies();
  impl_->gather.reset();
}

const ModelSpec& Engine::model() const { return impl_->model; }
const EngineLayout& Engine::layout() const { return impl_->layout; }
int Engine::rank() const { return impl_->rank; }
int Engine::world_size() const { return impl_->world; }
DType Engine::dtype() const { return impl_->dtype; }
double Engine::LossScale() const {
  const Impl& e = *impl_;
  return e.scaler->scale() / (e.LossScaleDividesGas() ? e.gas : 1);
}

double Engine::CurrentLossScale() const { return impl_->scaler->scale(); }
double Engine::lr() const { return impl_->LrFor(0); }
std::vector<double> Engine::lrs() const {
  std::vector<double> out;
  for (size_t og = 0; og < impl_->hyper.size(); ++og) out.push_back(impl_->LrFor(og));
  return out;
}

int64_t Engine::schedule_position() const { return impl_->applied_steps - impl_->lr_step_base; }

Status Engine::SetSchedulePosition(int64_t position) {
  if (position < 0) {
    return Status::InvalidArgument("SetSchedulePosition: position " + std::to_string(position) +
                                   " is negative");
  }
  impl_->lr_step_base = impl_->applied_steps - position;
  return Status::OK();
}

Status Engine::SetLearningRates(std::span<const double> lrs) {
  Impl& e = *impl_;
  if (lrs.empty()) {
    e.client_lrs.clear();  // the schedule's again
    return Status::OK();
  }
  if (lrs.size() != e.hyper.size()) {
    return Status::InvalidArgument("SetLearningRates: " + std::to_string(lrs.size()) +
                                   " value(s) for " + std::to_string(e.hyper.size()) +
                                   " optimizer group(s)");
  }
  for (size_t i = 0; i < lrs.size(); ++i) {
    if (!std::isfinite(lrs[i]) || lrs[i] < 0) {
      return Status::InvalidArgument("SetLearningRates: optimizer group " + std::to_string(i) +
                                     ": lr " + std::to_string(lrs[i]) +
                                     " is not a finite value >= 0");
    }
  }
  e.client_lrs.assign(lrs.begin(), lrs.end());
  return Status::OK();
}
std::vector<std::pair<double, double>> Engine::betas() const {
  std::vector<std::pair<double, double>> out;
  for (size_t og = 0; og < impl_->hyper.size(); ++og) out.push_back(impl_->BetasFor(og));
  return out;
}

Status Engine::SetHyperparameters(std::span<const OptimizerGroupOptions> groups) {
  Impl& e = *impl_;
  const auto bad = [](size_t og, std::string_view what) {
    return Status::InvalidArgument("SetHyperparameters: optimizer group " + std::to_string(og) +
                                   ": " + std::string(what));
  };
  if (groups.size() != e.hyper.size()) {
    return Status::InvalidArgument("SetHyperparameters: " + std::to_string(groups.size()) +
                                   " group(s) for " + std::to_string(e.hyper.size()) +
                                   " optimizer group(s)");
  }
  std::vector<double> lrs;
  std::vector<kernels::AdamHyper> next = e.hyper;
  for (size_t og = 0; og < groups.size(); ++og) {
    const OptimizerGroupOptions& o = groups[og];
    if (o.lr.has_value() != groups[0].lr.has_value()) {
      return bad(og, "lr is given for some groups and not others (give every group's or none)");
    }
    if (o.lr) lrs.push_back(*o.lr);
    if (o.beta1.has_value() != o.beta2.has_value()) {
      return bad(og, "beta1 and beta2 go together");
    }
    kernels::AdamHyper& h = next[og];
    if (o.beta1) {
      h.beta1 = *o.beta1;
      h.beta2 = *o.beta2;
    }
    h.eps = o.eps.value_or(h.eps);
    h.weight_decay = o.weight_decay.value_or(h.weight_decay);
    kernels::AdamHyper probe = h;
    probe.lr = o.lr.value_or(0.0);
    kernels::AdamShard empty;
    if (Status st = kernels::ValidateAdam(probe, empty); !st.ok()) return bad(og, st.message());
  }
  if (!lrs.empty()) STRATA_RETURN_IF_ERROR(SetLearningRates(lrs));
  for (size_t og = 0; og < groups.size(); ++og) {
    if (groups[og].beta1) e.client_betas[og] = true;
  }
  e.hyper = std::move(next);
  return Status::OK();
}

void Engine::UseScheduleBetas() {
  std::fill(impl_->client_betas.begin(), impl_->client_betas.end(), false);
}

Status Engine::SetGradientAccumulationSteps(int64_t steps) {
  Impl& e = *impl_;
  STRATA_RETURN_IF_ERROR(e.CheckHealthy());
  STRATA_RETURN_IF_ERROR(CheckAccumulationSteps(static_cast<double>(steps)));
  for (size_t g = 0; g < e.groups.size(); ++g) {
    if (e.groups[g].reductions > 0 || e.groups[g].grad) {
      return Status::FailedPrecondition(
          "SetGradientAccumulationSteps: group '" + e.model.groups[g].name +
          "' has a gradient of this step already (between steps only: after Step, before the "
          "next backward)");
    }
  }
  const int gas = static_cast<int>(steps);
  if (sched::GradStateDType(e.dtype, gas, e.world, e.placement) != e.grad_dtype) {
    return Status::FailedPrecondition(
        "SetGradientAccumulationSteps: " + std::to_string(e.gas) + " -> " + std::to_string(gas) +
        ": this run keeps each gradient as it is reduced, in " +
        std::string(DTypeName(e.grad_dtype)) +
        " (one rank, accumulation 1, the optimizer offloaded); start it with "
        "gradient_accumulation_steps > 1 to change the accumulation later");
  }
  e.gas = gas;
  e.post_scale = PostScale(e, gas);
  return Status::OK();
}

int64_t Engine::gradient_accumulation_steps() const { return impl_->gas; }

int64_t Engine::global_step() const { return impl_->global_step; }
Status Engine::health() const { return impl_->failed; }
Status Engine::Synchronize() {
  STRATA_RETURN_IF_ERROR(impl_->JoinDeferredStep());
  STRATA_RETURN_IF_ERROR(impl_->FinishSpeculation());  // the backward's speculated Adam
  return impl_->failed.ok() ? Status::OK() : impl_->CheckHealthy();
}

Status Engine::Flush() {
  Impl& e = *impl_;
  STRATA_RETURN_IF_ERROR(Synchronize());
  if (e.outstanding_gathers > 0) {
    return Status::FailedPrecondition("Flush: " + std::to_string(e.outstanding_gathers) +
                                      " gathered group(s) not released");
  }
  Status st = e.store->Flush(e.timeout());
  if (!st.ok()) return e.Fail(Status(st.code(), "Flush: " + std::string(st.message())));
  return Status::OK();
}

std::vector<std::string> Engine::nvme_files() const { return impl_->store->nvme_files(); }

Result<GatheredGroup> Engine::Gather(size_t group) {
  Result<GatheredGroup> gathered = impl_->Gather(group);
  if (gathered.ok() && *gathered) gathered->owner_ = owner_;
  return gathered;
}
void Engine::Release(GatheredGroup gathered) {
  gathered.owner_.reset();  // given back here, not again when the handle goes
  impl_->Release(std::move(gathered)).IgnoreError();
}
Status Engine::Release(GatheredGroup gathered, uintptr_t caller_stream) {
  gathered.owner_.reset();
  return impl_->Release(std::move(gathered), caller_stream);
}
bool Engine::gathers_alias_home() const { return impl_->GathersAliasHome(); }
bool Engine::persistent(size_t g) const {
  return g < impl_->groups.size() && impl_->placement.params_partitioned && impl_->Persistent(g);
}
bool Engine::Impl::Persistent(size_t g) const { return g < persistent.size() && persistent[g]; }
std::vector<std::string> Engine::swap_files() const {
  return impl_->store != nullptr ? impl_->store->nvme_files() : std::vector<std::string>{};
}
bool Engine::Impl::GathersAliasHome() const {
  return placement.params_partitioned && AliasesShard() &&
         placement.Home(StateKind::kParam16) == Tier::kDevice && spec == nullptr;
}
Status Engine::ReduceGradients(size_t group, std::optional<uintptr_t> caller_stream) {
  return impl_->ReduceGradients(group, caller_stream);
}
Result<StepReport> Engine::Step() { return impl_->Step(); }
Status Engine::DiscardGradients() { return impl_->DiscardGradients(); }
bool Engine::orders_caller_streams() const { return impl_->OrdersCallerStreams(); }

Result<std::vector<uint32_t>> Engine::AgreeReductionOrder(std::span<const uint32_t> order) {
  Impl& e = *impl_;
  STRATA_RETURN_IF_ERROR(e.CheckHealthy());
  std::vector<bool> seen(e.groups.size(), false);
  size_t trainable = 0;
  for (size_t g = 0; g < e.groups.size(); ++g) trainable += e.model.groups[g].trainable ? 1 : 0;
  for (uint32_t g : order) {
    if (g >= e.groups.size() || !e.model.groups[g].trainable || seen[g]) {
      return Status::InvalidArgument("AgreeReductionOrder: group " + std::to_string(g) +
                                     (g >= e.groups.size()           ? " out of range"
                                      : !e.model.groups[g].trainable ? " is frozen"
                                                                     : " listed twice"));
    }
    seen[g] = true;
  }
  if (order.size() != trainable) {
    return Status::InvalidArgument("AgreeReductionOrder: " + std::to_string(order.size()) +
                                   " groups listed, the model has " + std::to_string(trainable) +
                                   " trainable ones");
  }
  std::vector<uint32_t> agreed(order.begin(), order.end());
  if (e.world == 1 || agreed.empty()) return agreed;
  const size_t bytes = agreed.size() * sizeof(uint32_t);
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dev, DeviceBuffer::Make(e.opt.device, bytes));
  STRATA_RETURN_IF_ERROR(e.CopySync(CopyDir::kHostToDevice, dev.get(), agreed.data(), bytes));
  STRATA_ASSIGN_OR_RETURN(CommHandle h, e.opt.comm->Broadcast(dev.get(), bytes, DType::kI8, 0));
  Status st = h.WaitUntil(e.deadline());
  if (!st.ok()) return e.Fail(e.CollectiveError(st, "agreeing on the reduction order"));
  STRATA_RETURN_IF_ERROR(e.CopySync(CopyDir::kDeviceToHost, agreed.data(), dev.get(), bytes));
  return agreed;
}

Result<void*> Engine::GradBuffer(size_t group, std::optional<uintptr_t> caller_stream) {
  Impl& e = *impl_;
  STRATA_RETURN_IF_ERROR(e.CheckHealthy());
  STRATA_RETURN_IF_ERROR(e.JoinDeferredStep());  // the backward's work shares the CPU pool
  if (group >= e.groups.size()) {
    return Status::InvalidArgument("GradBuffer: group " + std::to_string(group) + " out of range");
  }
  if (!e.model.groups[group].trainable) return e.FrozenRefusal("GradBuffer", group);
  zero::GroupState& gs = e.groups[group];
  if (!gs.grad) {
    STRATA_ASSIGN_OR_RETURN(gs.grad, e.NewGradBuffer(group, caller_stream));
    ++e.grad_buffers_out;
  }
  return gs.grad.get();
}

EngineStats Engine::Stats() const {
  const Impl& e = *impl_;
  EngineStats s = e.totals;
  zero::AddTimings(e.timings, &s.timings);  // the step in progress counts up to now
  s.global_step = e.global_step;
  s.skipped_steps = e.skipped_steps;
  s.store = e.store->TakeStats(false);
  s.comm = e.opt.comm->stats();
  if (e.zpp.node) s.comm_intra = e.zpp.node->stats();
  if (e.zpp.cross) s.comm_inter = e.zpp.cross->stats();
  if (e.zpp.group) {
    CommStats& to = e.zpp.group_is_intra ? s.comm_intra : s.comm_inter;
    const CommStats g = e.zpp.group->stats();
    for (size_t i = 0; i < kCommOpCount; ++i) {
      CommOpBytes& a = to.ops[i];
      const CommOpBytes& b = g.ops[i];
      a.calls += b.calls;
      a.payload_bytes += b.payload_bytes;
      a.sent_bytes += b.sent_bytes;
      a.received_bytes += b.received_bytes;
      a.wire_sent_bytes += b.wire_sent_bytes;
      a.wire_received_bytes += b.wire_received_bytes;
    }
  }
  const DeviceStats ds = e.opt.device->stats();
  s.peak_bytes = s.store.peak_bytes;
  if (e.spec) {
    s.peak_bytes[Tier::kHost] += e.spec->buffer_bytes;  // the rollback copies
    const sched::SpeculationGovernor& g = e.spec->governor;
    s.speculation = {.applies = true,
                     .adaptive = g.phase() != sched::SpeculationGovernor::Phase::kFixed,
                     .next = g.Speculate(),
                     .probes = g.verdict().probes,
                     .on_s = g.verdict().on_s,
                     .off_s = g.verdict().off_s};
  }
  s.peak_bytes[Tier::kDevice] = std::max<uint64_t>(s.peak_bytes[Tier::kDevice], ds.peak_used_bytes);
  return s;
}

}  // namespace strata
