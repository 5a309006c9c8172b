// Engine::Save and Engine::Load: every state of the engine to and from a checkpoint directory
// (format and crash-consistency protocol: core/zero/checkpoint_format.h).
//
// Save streams block by block into the rank's file (checkpoint_io.h StreamWriter: the bytes are
// gathered into aio.block_size chunks written O_DIRECT through an IoBackend, aio.queue_depth of
// them in flight, so thousands of small blocks become a few large writes). Each block is leased
// for reading on the tier the engine computes on; NVMe-homed blocks are fetched into host memory
// ahead of the writer, as many as fit a window of depth x chunk bytes (at most half the host
// budget free at the start), so the swap reads overlap the checkpoint writes. Host memory used:
// the window (inside the store's budget) plus the writer's depth x chunk staging buffers; never
// the shard. With SaveOptions keep_last, a save that will retire the oldest checkpoint takes its
// rank files instead of creating new ones (rank 0 moves it into `<tag>.tmp/recycled/` first;
// each rank overwrites its old file in place), and retires what is beyond keep_last after the
// commit (core/zero/checkpoint_retention.h).
//
// Load does the reverse in the same order (per group: param16, then master32, exp_avg,
// exp_avg_sq of the sub-groups ascending: the rank files' order), reading through StreamReaders
// (O_DIRECT read-ahead) into write leases, NVMe homes fetched ahead and written back behind,
// within the same window. Element ranges are global, which lets a rank read another rank's file
// (resharding).
//
// Collective structure (every rank calls; one small all-gather of two words per rank per
// agreement, through the engine's exchange buffer): Save agrees on the preconditions and the
// options every rank must share (before anything on disk changes), on rank 0's preparation of
// `<tag>.tmp/`, on the files (each rank's size and checksum, or its failure), and on rank 0's
// commit. Load agrees on the verified manifest (a hash of it) and on the loaded state.
// Any rank's failure becomes every rank's error; a failed collective fails the engine.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include <deque>

#include "core/zero/checkpoint_format.h"
#include "core/zero/checkpoint_io.h"
#include "core/zero/checkpoint_retention.h"
#include "core/zero/engine_internal.h"

namespace strata {

using zero::SubGroup;
namespace ckpt = zero::ckpt;

namespace {

constexpr uint64_t kFailMarker = ~uint64_t{0};

// All-gathers two 64-bit words per rank. A failure of the collective is returned as is.
Status ExchangeWords(Engine::Impl& e, uint64_t a, uint64_t b,
                     std::vector<std::pair<uint64_t, uint64_t>>* out) {
  std::array<uint32_t, 4> mine;
  std::memcpy(mine.data(), &a, 8);
  std::memcpy(mine.data() + 2, &b, 8);
  STRATA_ASSIGN_OR_RETURN(std::vector<uint32_t> all, e.AllGatherWords(mine));
  out->assign(static_cast<size_t>(e.world), {0, 0});
  for (size_t r = 0; r < out->size(); ++r) {
    std::memcpy(&(*out)[r].first, all.data() + r * 4, 8);
    std::memcpy(&(*out)[r].second, all.data() + r * 4 + 2, 8);
  }
  return Status::OK();
}

// Every rank learns whether every rank's `local` is OK; returns `local` where it failed, else
// Aborted naming the first failed rank. `value` travels along (out: every rank's).
Status Agree(Engine::Impl& e, const Status& local, const std::string& what, uint64_t value = 0,
             std::vector<uint64_t>* values = nullptr) {
  std::vector<std::pair<uint64_t, uint64_t>> words;
  Status st = ExchangeWords(e, local.ok() ? value : kFailMarker,
                            local.ok() ? 0 : static_cast<uint64_t>(local.code()), &words);
  if (!st.ok()) {
    std::string msg = what + ": rank agreement: " + std::string(st.message());
    if (st.code() == Status::Code::kDeadlineExceeded) {
      msg +=
          " (collective: every rank must call it at the same point; a rank that did not, as "
          "in a script that saves only on rank 0, leaves the others waiting here)";
    }
    return e.Fail(Status(st.code(), msg));
  }
  if (!local.ok()) return local;
  for (int r = 0; r < e.world; ++r) {
    if (words[r].first == kFailMarker && words[r].second != 0) {
      return Status::Aborted(what + ": rank " + std::to_string(r) + " failed (" +
                             std::string(CodeName(static_cast<Status::Code>(words[r].second))) +
                             "; its error is in that rank's result)");
    }
  }
  if (values != nullptr) {
    values->clear();
    for (const auto& w : words) values->push_back(w.first);
  }
  return Status::OK();
}

// Save and Load need no gathered group out and no gradient buffer taken (a backward in
// progress). Load also needs the accumulation window closed (no reduction since the last Step):
// the loaded state would meet gradients computed from other weights. Save inside a window is
// allowed (`in_window`), as DeepSpeed's save_checkpoint: SettleWindowForSave readies it.
Status CheckBoundary(const Engine::Impl& e, const char* op, bool in_window) {
  STRATA_RETURN_IF_ERROR(e.CheckHealthy());
  if (e.outstanding_gathers > 0) {
    return Status::FailedPrecondition(std::string(op) + ": " +
                                      std::to_string(e.outstanding_gathers) +
                                      " gathered group(s) not released");
  }
  for (size_t g = 0; g < e.groups.size(); ++g) {
    if (e.groups[g].grad) {
      return Status::FailedPrecondition(
          std::string(op) + ": group '" + e.model.groups[g].name +
          "' has a gradient buffer not yet reduced (a backward in progress); checkpoints are "
          "taken between backwards");
    }
    if (!in_window && (e.groups[g].reductions > 0 || !e.pending.empty())) {
      return Status::FailedPrecondition(
          std::string(op) + ": mid-accumulation (group '" + e.model.groups[g].name +
          "' has gradients since the last Step); a checkpoint loads at an accumulation "
          "boundary, between Step and the next micro-step's gradients (from Python: after the "
          "engine.step() that applied them), where it cannot meet gradients computed from "
          "other weights (DiscardGradients drops them, if that is what is meant)");
    }
  }
  return Status::OK();
}

// Save inside an accumulation window writes the state of the last Step, as DeepSpeed does: the
// window's gradients are not saved and stay for the Step that applies them. The reductions
// still running finish first, and an optimizer step speculated from the window's final
// gradients is undone (Step redoes it), so the file holds the state from before it. At a
// boundary both are no-ops: nothing is pending and no speculation is engaged.
Status SettleWindowForSave(Engine::Impl& e) {
  STRATA_RETURN_IF_ERROR(e.DrainReductions(true));
  if (e.spec && e.spec->engaged) STRATA_RETURN_IF_ERROR(e.CancelSpeculation());
  return Status::OK();
}

ckpt::Manifest BaseManifest(const Engine::Impl& e, const std::string& tag) {
  ckpt::Manifest m;
  m.tag = tag;
  m.world_size = e.world;
  m.stage = e.layout.stage;
  m.precision = e.dtype == DType::kF16 ? "fp16" : e.dtype == DType::kBF16 ? "bf16" : "fp32";
  m.param_dtype = e.dtype == DType::kF16 ? "F16" : e.dtype == DType::kBF16 ? "BF16" : "F32";
  m.offload_optimizer = std::string(OffloadDeviceName(e.layout.offload_optimizer));
  m.offload_param = std::string(OffloadDeviceName(e.layout.offload_param));
  for (size_t g = 0; g < e.groups.size(); ++g) {
    ckpt::GroupEntry ge;
    ge.name = e.model.groups[g].name;
    for (const ParamSpec& p : e.model.groups[g].params) ge.params.push_back({p.name, p.shape});
    ge.numel = e.groups[g].numel;
    ge.shard_elems = e.groups[g].shard.shard_elems;
    ge.trainable = e.model.groups[g].trainable;
    ge.changed = !ge.trainable && e.groups[g].frozen_changed;
    m.groups.push_back(std::move(ge));
  }
  m.global_step = e.global_step;
  m.skipped_steps = e.skipped_steps;
  m.applied_steps = e.applied_steps;
  m.adam_step_base = e.adam_step_base;
  m.lr_step_base = e.lr_step_base;
  m.last_lr = e.last_lr;
  const zero::LossScalerState ls = e.scaler->state();
  m.scale = ls.scale;
  m.scaler_iteration = ls.iteration;
  m.scaler_last_overflow = ls.last_overflow_iteration;
  m.scaler_hysteresis_left = ls.hysteresis_left;
  m.config_json = EffectiveConfigJson(e.opt.config);
  return m;
}

// One block's piece of a rank file, in file order.
struct Piece {
  BlockId block = 0;
  Tier tier = Tier::kHost;
  uint64_t offset_bytes = 0;  // into the block
  uint64_t bytes = 0;
};

// The pieces of this rank's file in file order: per group param16 (the rank's shard of it), then
// master32, exp_avg, exp_avg_sq of the sub-groups this rank owns; nothing of a group `m` excludes.
Result<std::vector<Piece>> RankPieces(const Engine::Impl& e, const ckpt::Manifest& m) {
  const Tier param_tier = e.ComputeTier(e.placement.Home(StateKind::kParam16));
  std::vector<Piece> out;
  for (const zero::GroupState& gs : e.groups) {
    if (m.groups[&gs - e.groups.data()].excluded) continue;
    const uint64_t s = gs.shard.shard_elems;
    const uint64_t off =
        e.placement.params_partitioned ? 0 : static_cast<uint64_t>(e.rank) * s * e.elt;
    out.push_back({gs.param, param_tier, off, s * e.elt});
    if (!e.model.groups[&gs - e.groups.data()].trainable) continue;  // param16 only
    for (int k = 1; k < 4; ++k) {
      uint64_t covered = 0;
      for (size_t si : gs.sub_groups) {
        const SubGroup& sg = e.subs[si];
        if (sg.owner != e.rank) continue;
        const BlockId b = k == 1 ? sg.master : k == 2 ? sg.exp_avg : sg.exp_avg_sq;
        out.push_back({b, e.ComputeTier(e.HomeOf(sg, StateKind::kMaster32)), 0, sg.elems * 4});
        covered += sg.elems;
      }
      if (covered != s) {
        return Status::Internal(
            "checkpoint: the sub-groups of '" + e.model.groups[&gs - e.groups.data()].name +
            "' cover " + std::to_string(covered) + " of " + std::to_string(s) + " shard elements");
      }
    }
  }
  return out;
}

// The engine's checkpoint streams: its aio settings and IO backend kind.
ckpt::StreamOptions StreamOpts(const Engine::Impl& e) {
  const AioConfig& a = e.opt.config.aio;
  ckpt::StreamOptions o = ckpt::StreamOptionsFromAio(a.block_size, a.queue_depth,
                                                     a.intra_op_parallelism, e.opt.io_kind);
  o.sim_seed = 1000 + static_cast<uint64_t>(e.rank);
  return o;
}

// Bytes of blocks fetched ahead of (and written back behind) the stream: depth x chunk, or
// buffer_count of the largest optimizer blocks when that is more (so large blocks overlap too),
// at most half the host budget free now (what the optimizer pipeline reserved is free between
// steps).
uint64_t WindowBytes(Engine::Impl& e, const ckpt::StreamOptions& o) {
  const StoreStats st = e.store->TakeStats(false);
  const uint64_t budget = st.budget_bytes[Tier::kHost], used = st.used_bytes[Tier::kHost];
  const uint64_t free_bytes = budget > used ? budget - used : 0;
  uint64_t largest = 0;
  for (const SubGroup& sg : e.subs) largest = std::max<uint64_t>(largest, sg.elems * 4);
  const uint64_t want = std::max<uint64_t>(o.chunk_bytes * o.depth, e.pipeline_buffers * largest);
  return std::min<uint64_t>(want, free_bytes / 2);
}

// Keeps blocks fetched onto their compute tier ahead of use: Ahead(i) issues fetches for the
// items after i while their host allocations fit the window (item i itself always); Done(i)
// gives its bytes back and, with `drop`, evicts a copy this window fetched (write-back first
// when dirty), so the copies a save or load passes over never fill the host tier (a full tier
// makes every later fetch evict). A fetch's error comes back from the Acquire of the block.
class FetchWindow {
 public:
  FetchWindow(Engine::Impl& e, uint64_t window_bytes) : e_(e), window_(window_bytes) {}
  // `overwrite`: the caller replaces every byte (Access::kOverwrite), so the block is not read
  // ahead; a copy it makes off its home is still evicted behind, as a fetched one is.
  void Add(BlockId b, Tier t, bool overwrite = false) {
    items_.push_back({b, t, false, overwrite});
  }
  void Ahead(size_t i) {
    while (next_ < items_.size() && (next_ <= i || ahead_ + Bytes(next_) <= window_)) {
      Item& it = items_[next_];
      const Residency r = e_.store->residency(it.block, it.tier);
      if (e_.store->spec(it.block).home != it.tier && !IsResident(r)) {
        if (!it.overwrite) (void)e_.store->Fetch(it.block, it.tier);
        it.fetched = true;
      }
      ahead_ += Bytes(next_++);
    }
  }
  // The eviction's ticket when one was issued (empty otherwise).
  Ticket Done(size_t i, bool drop) {
    ahead_ -= Bytes(i);
    if (!drop || !items_[i].fetched) return Ticket();
    return e_.store->Evict(items_[i].block, items_[i].tier);
  }

 private:
  struct Item {
    BlockId block;
    Tier tier;
    bool fetched;
    bool overwrite;
  };
  uint64_t Bytes(size_t i) const {
    return (e_.store->spec(items_[i].block).size_bytes + kIoAlignment - 1) / kIoAlignment *
           kIoAlignment;
  }
  Engine::Impl& e_;
  uint64_t window_;
  std::vector<Item> items_;
  size_t next_ = 0;
  uint64_t ahead_ = 0;
};

// Writes this rank's file at `path`; `reuse`: a recycled file is there, overwritten in place.
Result<ckpt::FileEntry> WriteRankFile(Engine::Impl& e, const ckpt::Manifest& m,
                                      const std::string& path, bool reuse, CheckpointEnv& env) {
  uint64_t data_start = 0;
  const std::string header = ckpt::RankFileHeader(m, e.rank, &data_start, nullptr);
  ckpt::StreamOptions so = StreamOpts(e);
  so.env = &env;
  STRATA_ASSIGN_OR_RETURN(const std::vector<Piece> pieces, RankPieces(e, m));
  uint64_t total = header.size();
  for (const Piece& p : pieces) total += p.bytes;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<ckpt::StreamWriter> w,
                          ckpt::StreamWriter::Create(path, so, total, reuse));
  STRATA_RETURN_IF_ERROR(w->Append(header.data(), header.size()));
  FetchWindow window(e, WindowBytes(e, so));
  for (const Piece& p : pieces) window.Add(p.block, p.tier);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& p = pieces[i];
    window.Ahead(i);
    {
      STRATA_ASSIGN_OR_RETURN(Lease l,
                              e.store->Acquire(p.block, p.tier, Access::kRead, e.timeout()));
      if (p.offset_bytes + p.bytes > l.size_bytes()) {
        return Status::Internal("checkpoint: block " + e.store->spec(p.block).name +
                                " is smaller than its piece");
      }
      STRATA_RETURN_IF_ERROR(
          w->Append(static_cast<const uint8_t*>(l.data()) + p.offset_bytes, p.bytes));
    }
    (void)window.Done(i, true);
  }
  STRATA_RETURN_IF_ERROR(w->Finish());
  ckpt::FileEntry f;
  f.name = ckpt::Manifest::RankFileName(e.rank);
  f.rank = e.rank;
  f.size_bytes = w->size_bytes();
  f.xxh3 = w->xxh3();
  return f;
}

}  // namespace

SaveOptions SaveOptionsFromConfig(const CheckpointConfig& config) {
  SaveOptions o;
  o.keep_last = static_cast<size_t>(std::max<int64_t>(config.keep_last, 0));
  o.recycle_files = config.recycle_files;
  return o;
}

Status Engine::Save(const std::string& dir, const std::string& tag,
                    std::span<const uint8_t> client_state) {
  return Save(dir, tag, SaveOptionsFromConfig(impl_->opt.config.checkpoint), client_state);
}

Status Engine::Save(const std::string& dir, const std::string& tag, const SaveOptions& options,
                    std::span<const uint8_t> client_state) {
  Impl& e = *impl_;
  const bool recycle = options.keep_last > 0 && options.recycle_files;
  CheckpointEnv& env = options.env != nullptr ? *options.env : ckpt::DefaultEnv();
  const std::string what = "checkpoint save of '" + tag + "' to " + dir;
  Status local = e.JoinDeferredStep();  // overlap_step: the step running behind first
  if (local.ok()) local = CheckBoundary(e, "Save", /*in_window=*/true);
  if (local.ok()) local = SettleWindowForSave(e);
  if (local.ok() && tag.empty()) local = Status::InvalidArgument("Save: empty tag");
  if (local.ok()) local = ckpt::ResolveTag(dir, tag).status();
  if (local.ok() && tag.size() > 4 && tag.compare(tag.size() - 4, 4, ".tmp") == 0) {
    local =
        Status::InvalidArgument("Save: a tag may not end in .tmp (the name of an unfinished save)");
  }
  // Every rank lays out its file as rank 0's manifest says: they must agree on exclude_frozen,
  // before anything on disk changes (a refused save leaves every checkpoint as it was).
  std::vector<uint64_t> excluding;
  STRATA_RETURN_IF_ERROR(Agree(e, local, what, options.exclude_frozen ? 1 : 0, &excluding));
  for (int r = 1; r < e.world; ++r) {
    if (excluding[r] != excluding[0]) {
      return Status::InvalidArgument(what + ": the ranks disagree on exclude_frozen (rank 0: " +
                                     (excluding[0] ? "true" : "false") + ", rank " +
                                     std::to_string(r) + ": " + (excluding[r] ? "true" : "false") +
                                     "); nothing was saved");
    }
  }
  const std::string tmp = dir + "/" + tag + ".tmp";
  std::optional<ckpt::SaveLock> lock;  // rank 0's, to the commit (checkpoint_retention.h)
  if (local.ok() && e.rank == 0) {
    std::error_code ec;
    if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
      local = Status::InvalidArgument("Save: '" + dir + "' is not a directory");
    } else if (!std::filesystem::is_directory(dir, ec)) {
      std::filesystem::create_directories(dir, ec);
      if (ec) local = Status::IOError("create " + dir + ": " + ec.message());
    }
    if (local.ok()) {
      Result<ckpt::SaveLock> held = ckpt::SaveLock::Acquire(dir);
      local = held.status();
      if (held.ok()) lock.emplace(std::move(*held));
    }
    // Under the lock every `*.tmp` is a crashed save's (or retire's) garbage: start over.
    if (local.ok()) local = ckpt::RemoveUnfinishedSaves(dir);
    if (local.ok()) local = ckpt::MakeDir(tmp, env);
    // The checkpoint this save will retire gives up its files (checkpoint_retention.h).
    if (local.ok() && recycle) local = ckpt::RecycleOldest(dir, options.keep_last, tmp, env);
  }
  // Rank 0 made the directory the others write into.
  STRATA_RETURN_IF_ERROR(Agree(e, local, what));

  ckpt::Manifest m = BaseManifest(e, tag);
  for (ckpt::GroupEntry& g : m.groups) {
    g.excluded = options.exclude_frozen && !g.trainable && !g.changed;
  }
  if (std::any_of(m.groups.begin(), m.groups.end(), [](const auto& g) { return !g.trainable; })) {
    Result<std::vector<uint64_t>> prints = e.FrozenFingerprints();
    if (!prints.ok()) return e.Fail(prints.status().WithContext(what + ": frozen fingerprints"));
    for (size_t g = 0; g < m.groups.size(); ++g) m.groups[g].fingerprint = (*prints)[g];
  }
  const std::string path = tmp + "/" + ckpt::Manifest::RankFileName(e.rank);
  const std::string recycled =
      tmp + "/" + ckpt::kRecycledName + "/" + ckpt::Manifest::RankFileName(e.rank);
  const bool reuse = recycle && ckpt::PathExists(recycled);
  const Status moved = reuse ? ckpt::RenamePath(recycled, path, env) : Status::OK();
  Result<ckpt::FileEntry> part =
      moved.ok() ? WriteRankFile(e, m, path, reuse, env) : Result<ckpt::FileEntry>(moved);
  local = part.status();
  if (!local.ok() && e.rank != 0 && !ckpt::PathExists(tmp)) {
    // Rank 0 made the folder before the ranks agreed to write: it is not on this rank's view
    // of the filesystem.
    local = Status(local.code(),
                   std::string(local.message()) + " ('" + tmp +
                       "', which rank 0 created, is not there on this rank: the checkpoint "
                       "directory must be one every rank sees, a shared filesystem; node-local "
                       "storage (use_node_local_storage, save_on_each_node) is not supported)");
  }
  ckpt::FileEntry client;
  if (local.ok() && e.rank == 0 && !client_state.empty()) {
    auto w = ckpt::FileWriter::Create(tmp + "/" + ckpt::kClientStateName, env);
    local = w.status();
    if (local.ok()) local = w->Append(client_state.data(), client_state.size());
    if (local.ok()) local = w->Finish();
    if (local.ok()) client = {ckpt::kClientStateName, -1, w->size_bytes(), w->xxh3()};
  }
  if (!local.ok()) local = Status(local.code(), what + ": " + std::string(local.message()));
  std::vector<std::pair<uint64_t, uint64_t>> words;
  Status st = ExchangeWords(e, local.ok() ? part->size_bytes : kFailMarker,
                            local.ok() ? part->xxh3 : static_cast<uint64_t>(local.code()), &words);
  if (!st.ok())
    return e.Fail(Status(st.code(), what + ": rank agreement: " + std::string(st.message())));
  if (!local.ok()) return local;
  for (int r = 0; r < e.world; ++r) {
    if (words[r].first == kFailMarker) {
      return Status::Aborted(what + ": rank " + std::to_string(r) + " could not write its part");
    }
    m.files.push_back({ckpt::Manifest::RankFileName(r), r, words[r].first, words[r].second});
  }
  if (!client_state.empty()) {
    m.has_client_state = true;
    if (e.rank == 0) m.files.push_back(client);
  }
  if (e.rank == 0) {
    // What the ranks did not reuse of a recycled checkpoint must not end up inside the new one.
    local = recycle ? ckpt::RemoveTree(tmp + "/" + ckpt::kRecycledName) : Status::OK();
    if (local.ok()) local = ckpt::CommitCheckpoint(dir, m, env, options.update_latest);
    if (!local.ok()) local = Status(local.code(), what + ": " + std::string(local.message()));
    if (local.ok() && options.keep_last > 0) {
      local = ckpt::RetireBeyond(dir, options.keep_last, tag, env);
      if (!local.ok()) {
        local =
            Status(local.code(), what + ": saved (it is `latest` and loads), but removing " +
                                     "older checkpoints failed: " + std::string(local.message()));
      }
    }
  }
  return Agree(e, local, what);
}

// ---------------------------------------------------------------------------------------------
// Load
// ---------------------------------------------------------------------------------------------

namespace {

// "group.param", or the param's own name where it already starts with its module's (the
// Python adapter names parameters in full, and splits a module's frozen or other-optimizer-group
// parameters into "<module>#frozen", "<module>#1": the module is the name before '#').
std::string FullParamName(const std::string& group, const std::string& param) {
  const std::string module = group.substr(0, group.find('#'));
  return param.rfind(module + ".", 0) == 0 ? param : group + "." + param;
}

// "'a', 'b', 'c', 'd', 'e' and 3 more": the first five names, quoted, and how many others.
std::string NameList(const std::vector<std::string>& names) {
  constexpr size_t kShown = 5;
  std::string o;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) o += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > kShown) o += " and " + std::to_string(names.size() - kShown) + " more";
  return o;
}

std::string ShapeString(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? "," : "") + std::to_string(s[i]);
  return o + "]";
}

// What of the checkpoint this engine cannot take; empty when compatible. Parameters are matched
// by name, so a parameter added, removed or renamed is named as such (a positional comparison
// reports every group after it as different).
Status CheckCompatible(const Engine::Impl& e, const ckpt::Manifest& m, const LoadOptions& options) {
  std::vector<std::string> diffs;
  const ModelSpec& model = e.model;
  std::map<std::string, std::vector<int64_t>> saved, here;
  for (const auto& cg : m.groups) {
    for (const auto& p : cg.params) saved[FullParamName(cg.name, p.name)] = p.shape;
  }
  for (const auto& mg : model.groups) {
    for (const auto& p : mg.params) here[FullParamName(mg.name, p.name)] = p.shape;
  }
  for (const auto& [name, shape] : saved) {
    auto it = here.find(name);
    if (it == here.end()) {
      diffs.push_back(name + ShapeString(shape) + " is in the checkpoint, not in the model");
    } else if (it->second != shape) {
      diffs.push_back(name + ": " + ShapeString(shape) + " in the checkpoint, " +
                      ShapeString(it->second) + " in the model");
    }
  }
  for (const auto& [name, shape] : here) {
    if (!saved.contains(name)) {
      diffs.push_back(name + ShapeString(shape) + " is in the model, not in the checkpoint");
    }
  }
  // The same parameters, grouped or ordered otherwise (the files are laid out by group).
  for (size_t g = 0; diffs.empty() && g < std::max(m.groups.size(), model.groups.size()); ++g) {
    const bool both = g < m.groups.size() && g < model.groups.size();
    if (both && m.groups[g].name == model.groups[g].name &&
        m.groups[g].params.size() != model.groups[g].params.size()) {
      std::vector<std::string> in_ckpt, in_model;
      for (const auto& p : m.groups[g].params) in_ckpt.push_back(p.name);
      for (const auto& p : model.groups[g].params) in_model.push_back(p.name);
      diffs.push_back("the same parameters in other groups or another order: group " +
                      std::to_string(g) + " '" + model.groups[g].name + "' holds " +
                      NameList(in_ckpt) + " in the checkpoint, " + NameList(in_model) +
                      " in the model (a module's frozen parameters form a group of their own, "
                      "'<module>#frozen': were other parameters frozen?)");
    } else if (!both || m.groups[g].name != model.groups[g].name ||
               m.groups[g].params.size() != model.groups[g].params.size()) {
      diffs.push_back("the same parameters in other groups or another order: group " +
                      std::to_string(g) + " is " +
                      (g < m.groups.size() ? "'" + m.groups[g].name + "'" : "absent") +
                      " in the checkpoint, " +
                      (g < model.groups.size() ? "'" + model.groups[g].name + "'" : "absent") +
                      " in the model");
    }
    for (size_t p = 0; both && diffs.empty() && p < m.groups[g].params.size(); ++p) {
      if (m.groups[g].params[p].name != model.groups[g].params[p].name) {
        diffs.push_back("group '" + model.groups[g].name + "' orders its parameters otherwise: '" +
                        m.groups[g].params[p].name + "' in the checkpoint, '" +
                        model.groups[g].params[p].name +
                        "' in the model (a module's parameters in several optimizer param "
                        "groups form one group per param group, '<module>#<index>': does the "
                        "script list its param_groups in another order than at the save?)");
      }
    }
  }
  for (size_t g = 0; g < std::min(m.groups.size(), model.groups.size()); ++g) {
    if (!m.groups[g].trainable && model.groups[g].trainable &&
        m.groups[g].name == model.groups[g].name) {
      diffs.push_back("group '" + model.groups[g].name + "' is frozen in the checkpoint (" +
                      (m.groups[g].excluded ? "left out at save" : "no optimizer state saved") +
                      "), trainable in the model");
    }
  }
  if (!diffs.empty()) {
    std::string msg = "the checkpoint's model spec differs from the engine's:";
    for (size_t i = 0; i < diffs.size() && i < 20; ++i) msg += "\n  " + diffs[i];
    if (diffs.size() > 20) msg += "\n  ... and " + std::to_string(diffs.size() - 20) + " more";
    return Status::FailedPrecondition(msg);
  }
  std::vector<std::string> excluded;
  for (const ckpt::GroupEntry& g : m.groups) {
    if (g.excluded) excluded.push_back(g.name);
  }
  if (!excluded.empty() && !options.keep_excluded) {
    return Status::FailedPrecondition(
        "the checkpoint was saved without its " + std::to_string(excluded.size()) +
        " frozen group(s) " + NameList(excluded) +
        " (exclude_frozen_parameters=True): to keep this model's values for them, load it with "
        "load_checkpoint(load_module_strict=False) from Python, LoadOptions::keep_excluded from "
        "C++ (as transformers' Trainer resumes a PEFT model); those values must be the ones the "
        "run started from (the same pretrained weights)");
  }
  const ckpt::Manifest mine = BaseManifest(e, m.tag);
  if (m.precision != mine.precision) {
    return Status::FailedPrecondition(
        "the checkpoint's precision is " + m.precision + ", the engine's " + mine.precision +
        ": convert it first with `offloadctl ckpt reshard DIR --precision " + mine.precision +
        " --out DIR2` (ckpt::ReshardCheckpoint; precision changes only there)");
  }
  // Another world size or stage is fine: the files hold global element ranges per group, and
  // RangeReader cuts any range this engine's layout asks for out of whichever ranks' files hold
  // it (resharding on load).
  return Status::OK();
}

// One block (or a range of it) filled from the checkpoint.
struct Dest {
  BlockId block = 0;
  Tier tier = Tier::kHost;
  size_t group = 0, kind = 0;
  uint64_t global_begin = 0, elems = 0;
};

// What this rank loads, in the rank files' order: per group param16, then each optimizer state
// kind over the sub-groups ascending; nothing of a group `m` excludes (its values stay).
std::vector<Dest> LoadDests(const Engine::Impl& e, const ckpt::Manifest& m) {
  const Tier param_tier = e.ComputeTier(e.placement.Home(StateKind::kParam16));
  std::vector<Dest> out;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    if (m.groups[g].excluded) continue;
    const zero::GroupState& gs = e.groups[g];
    const uint64_t s = gs.shard.shard_elems;
    if (e.placement.params_partitioned) {
      out.push_back({gs.param, param_tier, g, 0, static_cast<uint64_t>(e.rank) * s, s});
    } else {
      out.push_back({gs.param, param_tier, g, 0, 0, gs.shard.padded_elems(e.world)});
    }
    std::vector<size_t> subs = gs.sub_groups;
    std::sort(subs.begin(), subs.end(), [&](size_t a, size_t b) {
      return e.FullOffset(e.subs[a]) < e.FullOffset(e.subs[b]);
    });
    for (size_t k = 1; k < ckpt::kNumStateKinds; ++k) {
      for (size_t si : subs) {
        const SubGroup& sg = e.subs[si];
        const BlockId b = k == 1 ? sg.master : k == 2 ? sg.exp_avg : sg.exp_avg_sq;
        const Tier opt_tier = e.ComputeTier(e.HomeOf(sg, StateKind::kMaster32));
        out.push_back({b, opt_tier, g, k, e.FullOffset(sg), sg.elems});
      }
    }
  }
  return out;
}

// Whether each rank reads exactly its own rank file, whole and in order (same world size and
// shard sizes): then the file's checksum is computed as it streams.
bool SameLayout(const Engine::Impl& e, const ckpt::Manifest& m) {
  if (m.world_size != e.world || m.groups.size() != e.groups.size()) return false;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    if (m.groups[g].shard_elems != e.groups[g].shard.shard_elems) return false;
  }
  return true;
}

Status LoadState(Engine::Impl& e, const std::string& tag_dir, const ckpt::Manifest& m,
                 bool hash_own_file, const LoadOptions& options) {
  // Adam's m and v left fresh (zero) instead of read.
  auto fresh = [&](const Dest& d) { return !options.optimizer_states && d.kind >= 2; };
  const ckpt::StreamOptions so = StreamOpts(e);
  ckpt::RangeReader rd(tag_dir, m, so, hash_own_file ? e.rank : -1);
  const std::vector<Dest> dests = LoadDests(e, m);
  const uint64_t window_bytes = WindowBytes(e, so);
  FetchWindow window(e, window_bytes);
  // A range that covers its whole block replaces every byte: no read of the stale copy.
  auto covers_block = [&](const Dest& d) {
    return d.elems * m.ElemBytes(d.kind) == e.store->spec(d.block).size_bytes;
  };
  for (const Dest& d : dests) window.Add(d.block, d.tier, covers_block(d) || fresh(d));
  // Write-backs of NVMe homes in flight behind the reader, bounded by the same window.
  std::deque<std::pair<Ticket, uint64_t>> behind;
  uint64_t behind_bytes = 0;
  for (size_t i = 0; i < dests.size(); ++i) {
    const Dest& d = dests[i];
    window.Ahead(i);
    {
      const Access access = covers_block(d) || fresh(d) ? Access::kOverwrite : Access::kWrite;
      STRATA_ASSIGN_OR_RETURN(Lease l, e.store->Acquire(d.block, d.tier, access, e.timeout()));
      if (d.elems * m.ElemBytes(d.kind) > l.size_bytes()) {
        return Status::Internal("checkpoint: block " + e.store->spec(d.block).name +
                                " is smaller than its range");
      }
      if (fresh(d)) {
        std::memset(l.data(), 0, l.size_bytes());
      } else {
        STRATA_RETURN_IF_ERROR(rd.Read(d.group, d.kind, d.global_begin, d.elems, l.data()));
      }
      l.MarkDirty();
    }
    // NVMe homes: written back and dropped behind the reader, within the window.
    Ticket t = window.Done(i, true);
    if (e.store->spec(d.block).home == Tier::kNvme) {
      const uint64_t bytes = e.store->spec(d.block).size_bytes;
      behind.emplace_back(t.empty() ? e.store->WriteBack(d.block) : t, bytes);
      behind_bytes += bytes;
      while (behind_bytes > window_bytes && !behind.empty()) {
        STRATA_RETURN_IF_ERROR(behind.front().first.Wait(e.timeout()));
        behind_bytes -= behind.front().second;
        behind.pop_front();
      }
    }
  }
  for (const auto& [t, bytes] : behind) STRATA_RETURN_IF_ERROR(t.Wait(e.timeout()));
  if (hash_own_file) {
    const ckpt::FileEntry* own = nullptr;
    for (const ckpt::FileEntry& f : m.files) {
      if (f.rank == e.rank) own = &f;
    }
    if (own == nullptr)
      return Status::Corruption(tag_dir + ": the manifest lists no file of rank " +
                                std::to_string(e.rank));
    const ckpt::FileEntry& f = *own;
    const std::string path = tag_dir + "/" + f.name;
    auto sum = rd.FileXxh3(e.rank);
    uint64_t got = 0;
    if (sum.ok()) {
      got = *sum;
    } else {
      // Not read in order after all: hash it separately.
      uint64_t size = 0;
      STRATA_RETURN_IF_ERROR(ckpt::HashFile(path, &size, &got));
    }
    if (got != f.xxh3) {
      return Status::Corruption("checkpoint file " + path + " is damaged: XXH3 " +
                                ckpt::Hex64(got) + ", the manifest says " + ckpt::Hex64(f.xxh3));
    }
  }
  zero::LossScalerState ls;
  ls.scale = m.scale;
  ls.iteration = m.scaler_iteration;
  ls.last_overflow_iteration = m.scaler_last_overflow;
  ls.hysteresis_left = m.scaler_hysteresis_left;
  // A precision conversion dropped it (checkpoint_format.h): start as this engine's config says;
  // so does a change of fp16's loss scaling since the save (LossScaler::Fit).
  STRATA_ASSIGN_OR_RETURN(zero::LossScaler configured, zero::LossScaler::FromConfig(e.opt.config));
  ls = m.has_scaler_state ? configured.Fit(ls) : configured.state();
  STRATA_RETURN_IF_ERROR(e.scaler->Restore(ls));
  e.global_step = m.global_step;
  e.skipped_steps = m.skipped_steps;
  e.applied_steps = m.applied_steps;
  e.adam_step_base = options.optimizer_states ? m.adam_step_base : m.applied_steps;
  e.lr_step_base = options.lr_schedule ? m.lr_step_base : m.applied_steps;
  e.last_lr = options.lr_schedule ? m.last_lr : e.LrFor(0);
  // A frozen group read from the checkpoint holds its values: its initial ones only where the
  // checkpoint saved them as such (unchanged and frozen there too).
  for (size_t g = 0; g < e.groups.size(); ++g) {
    if (!e.model.groups[g].trainable && !m.groups[g].excluded) {
      e.groups[g].frozen_changed = m.groups[g].trainable || m.groups[g].changed;
      e.groups[g].frozen_print_loaded = m.groups[g].fingerprint;
      // Without one (a precision conversion dropped it): the values are no longer those this
      // engine fingerprinted, and theirs is not known.
      e.groups[g].frozen_print_unknown = m.groups[g].fingerprint == 0;
    }
  }
  e.DropKeptCopies();  // kept from before: stale now
  return Status::OK();
}

// The values this engine keeps for the groups the checkpoint left out must be those the saving run
// started from: refused, naming the groups, where both fingerprints are known and differ.
// Collective when the checkpoint has such groups (every rank reads the same manifest).
Status CheckExcludedValues(Engine::Impl& e, const ckpt::Manifest& m, const std::string& what) {
  auto refuse = [&](const std::vector<std::string>& names, const std::string& which,
                    const std::string& why) {
    return Status::FailedPrecondition(what + ": the checkpoint left out " +
                                      std::to_string(names.size()) + " frozen group(s) " + which +
                                      NameList(names) + why + "; nothing was changed)");
  };
  // Written since this engine started (WriteParams, or loaded as changed): not the values any
  // run started from. The same on every rank (WriteParams and Load are collective).
  std::vector<std::string> written;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    if (m.groups[g].excluded && e.groups[g].frozen_changed) written.push_back(m.groups[g].name);
  }
  if (!written.empty()) {
    return refuse(written,
                  "that this engine has written since it started (GatheredParameters with a "
                  "modifier rank, a fused adapter, or a checkpoint that had changed them): ",
                  "; their values are not the ones the saving run started from (load before "
                  "writing them, or from a checkpoint saved whole");
  }
  if (std::none_of(m.groups.begin(), m.groups.end(),
                   [](const auto& g) { return g.excluded && g.fingerprint != 0; })) {
    return Status::OK();
  }
  Result<std::vector<uint64_t>> prints = e.FrozenFingerprints();
  if (!prints.ok()) return e.Fail(prints.status().WithContext(what + ": frozen fingerprints"));
  std::vector<std::string> differ;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    const uint64_t mine = (*prints)[g], saved = m.groups[g].fingerprint;
    if (!m.groups[g].excluded || mine == 0 || saved == 0 || mine == saved) continue;
    differ.push_back(m.groups[g].name);
  }
  if (differ.empty()) return Status::OK();
  return refuse(differ, "whose values in this model are not the ones the saving run started from: ",
                " (their fingerprints differ: build the model from the same pretrained weights "
                "before loading");
}

}  // namespace

Status Engine::Load(const std::string& dir, const std::string& tag,
                    std::vector<uint8_t>* client_state, const LoadOptions& options) {
  Impl& e = *impl_;
  std::string what = "checkpoint load from " + dir;
  Status local = e.JoinDeferredStep();  // overlap_step: the step running behind first
  if (local.ok()) local = CheckBoundary(e, "Load", /*in_window=*/false);
  ckpt::Manifest m;
  uint64_t manifest_hash = 0;
  if (local.ok()) {
    auto t = ckpt::ResolveTag(dir, tag);
    local = t.status();
    if (local.ok()) {
      what += " (tag '" + *t + "')";
      auto mm = ckpt::ReadManifest(dir, *t);
      local = mm.status();
      if (local.ok()) m = std::move(*mm);
    }
  }
  if (local.ok()) local = CheckCompatible(e, m, options);
  // Same layout: each rank checks its own rank file's checksum as it loads it (one pass over
  // the disk); up front only that every file exists with its size, and the client state. Another
  // layout: each rank checks its share of all files first (file i on rank i % world).
  const bool same_layout = local.ok() && SameLayout(e, m);
  if (local.ok()) {
    std::vector<size_t> mine;
    for (size_t i = 0; i < m.files.size(); ++i) {
      if (same_layout && m.files[i].rank >= 0) {
        if (local.ok()) local = ckpt::CheckFileSize(dir, m, i);
        // The rank's own file's header too, before anything changes: a damaged one would fail
        // the load half-way, and the engine with it.
        if (local.ok() && m.files[i].rank == e.rank) {
          local = ckpt::CheckRankFileHeader(dir + "/" + m.tag + "/" + m.files[i].name, m, e.rank)
                      .status();
        }
        continue;
      }
      if (static_cast<int>(i % static_cast<size_t>(e.world)) == e.rank) mine.push_back(i);
    }
    if (local.ok() && !mine.empty()) local = ckpt::VerifyFiles(dir, m, mine);
    const std::string text = m.ToJson();
    manifest_hash = XXH3_64bits(text.data(), text.size()) & ~(uint64_t{1} << 63);
  }
  if (!local.ok()) local = Status(local.code(), what + ": " + std::string(local.message()));
  std::vector<uint64_t> hashes;
  STRATA_RETURN_IF_ERROR(Agree(e, local, what, manifest_hash, &hashes));
  for (uint64_t h : hashes) {
    if (h != manifest_hash) {
      return Status::FailedPrecondition(what +
                                        ": the ranks read different manifests (is `latest` "
                                        "being replaced, or is the directory not shared?)");
    }
  }
  STRATA_RETURN_IF_ERROR(CheckExcludedValues(e, m, what));
  const std::string tag_dir = dir + "/" + m.tag;
  local = LoadState(e, tag_dir, m, same_layout, options);
  if (local.ok() && client_state != nullptr) {
    client_state->clear();
    if (m.has_client_state) {
      auto blob = ckpt::ReadWholeFile(tag_dir + "/" + ckpt::kClientStateName);
      local = blob.status();
      if (local.ok()) client_state->assign(blob->begin(), blob->end());
    }
  }
  if (!local.ok()) {
    // Some blocks may hold the checkpoint's values and others not: the engine is unusable.
    local = e.Fail(Status(local.code(), what + ": " + std::string(local.message())));
  }
  Status all = Agree(e, local, what);
  // Another rank's state is half loaded: this one cannot train with it either.
  if (!all.ok() && local.ok()) return e.Fail(all);
  return all;
}

Status Engine::RestoreProgress(const TrainingProgress& p) {
  Impl& e = *impl_;
  STRATA_RETURN_IF_ERROR(e.JoinDeferredStep());
  STRATA_RETURN_IF_ERROR(CheckBoundary(e, "RestoreProgress", /*in_window=*/false));
  auto bad = [](const std::string& why) {
    return Status::InvalidArgument("RestoreProgress: " + why + "; nothing changed");
  };
  if (p.global_step < 0 || p.skipped_steps < 0 || p.optimizer_step < 0 || p.schedule_position < 0) {
    return bad("global_step " + std::to_string(p.global_step) + ", skipped_steps " +
               std::to_string(p.skipped_steps) + ", optimizer_step " +
               std::to_string(p.optimizer_step) + ", schedule_position " +
               std::to_string(p.schedule_position) + ": a count is negative");
  }
  if (p.skipped_steps > p.global_step) {
    return bad("skipped_steps " + std::to_string(p.skipped_steps) + " exceeds global_step " +
               std::to_string(p.global_step));
  }
  if (!std::isfinite(p.loss_scale) || p.loss_scale < 0) {
    return bad("loss_scale " + std::to_string(p.loss_scale) + " is not a finite value >= 0");
  }
  STRATA_ASSIGN_OR_RETURN(zero::LossScaler configured, zero::LossScaler::FromConfig(e.opt.config));
  zero::LossScalerState ls = configured.state();
  if (p.loss_scale > 0) {
    zero::LossScalerState saved;
    saved.scale = p.loss_scale;
    saved.iteration = p.scaler_iteration;
    saved.last_overflow_iteration = p.scaler_last_overflow;
    saved.hysteresis_left = p.scaler_hysteresis_left;
    ls = configured.Fit(saved);
  }
  // Checked on a fresh scaler first, so that a state it refuses changes nothing here.
  if (Status st = configured.Restore(ls); !st.ok()) return bad(std::string(st.message()));
  STRATA_RETURN_IF_ERROR(e.scaler->Restore(ls));
  e.global_step = p.global_step;
  e.skipped_steps = p.skipped_steps;
  e.applied_steps = p.global_step - p.skipped_steps;
  e.adam_step_base = e.applied_steps - p.optimizer_step;
  e.lr_step_base = e.applied_steps - p.schedule_position;
  e.last_lr = e.LrFor(0);
  return Status::OK();
}

}  // namespace strata
