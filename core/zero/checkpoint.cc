// Engine::Save and Engine::Load: every state of the engine to and from a checkpoint directory
// (format and crash-consistency protocol: core/zero/checkpoint_format.h).
//
// Save streams block by block: each block is leased for reading on the tier the engine computes
// on (an NVMe-homed block is fetched into host memory), appended to the rank's file straight from
// the lease, and released before the one after next is fetched; the next block's fetch overlaps
// the current write. So at most two blocks are staged in host memory, within the budget the
// optimizer pipeline already reserves, and no rank ever holds its shard in DRAM. Load does the
// reverse: a write lease per block, filled by pread from the checkpoint files (from any rank's
// file: the element ranges are global, which is what lets a rank read another rank's part),
// released, and written back to NVMe before the next block.
//
// Collective structure (every rank calls; one small all-gather of two words per rank per
// agreement, through the engine's exchange buffer): Save agrees on the preconditions (rank 0 has
// prepared `<tag>.tmp/`), on the files (each rank's size and checksum, or its failure), and on
// rank 0's commit. Load agrees on the verified manifest (a hash of it) and on the loaded state.
// Any rank's failure becomes every rank's error; a failed collective fails the engine.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "core/zero/checkpoint_format.h"
#include "core/zero/engine_internal.h"

namespace strata {

using zero::SubGroup;
namespace ckpt = zero::ckpt;

namespace {

constexpr uint64_t kFailMarker = ~uint64_t{0};

// All-gathers two words per rank. A failure of the collective is returned as is.
Status ExchangeWords(Engine::Impl& e, uint64_t a, uint64_t b,
                     std::vector<std::pair<uint64_t, uint64_t>>* out) {
  out->assign(static_cast<size_t>(e.world), {0, 0});
  (*out)[static_cast<size_t>(e.rank)] = {a, b};
  if (e.world == 1) return Status::OK();
  uint64_t mine[2] = {a, b};
  std::vector<uint64_t> all(static_cast<size_t>(e.world) * 2);
  float* dev = static_cast<float*>(e.exchange.get());
  STRATA_RETURN_IF_ERROR(e.CopySync(CopyDir::kHostToDevice, dev + e.rank * 4, mine, sizeof mine));
  STRATA_ASSIGN_OR_RETURN(CommHandle h, e.opt.comm->AllGather(dev + e.rank * 4, dev, 4, DType::kF32));
  STRATA_RETURN_IF_ERROR(h.WaitUntil(e.deadline()));
  STRATA_RETURN_IF_ERROR(e.CopySync(CopyDir::kDeviceToHost, all.data(), dev, all.size() * 8));
  for (int r = 0; r < e.world; ++r) (*out)[static_cast<size_t>(r)] = {all[r * 2], all[r * 2 + 1]};
  return Status::OK();
}

// Every rank learns whether every rank's `local` is OK; returns `local` where it failed, else
// Aborted naming the first failed rank. `value` travels along (out: every rank's).
Status Agree(Engine::Impl& e, const Status& local, const std::string& what, uint64_t value = 0,
             std::vector<uint64_t>* values = nullptr) {
  std::vector<std::pair<uint64_t, uint64_t>> words;
  Status st = ExchangeWords(e, local.ok() ? value : kFailMarker,
                            local.ok() ? 0 : static_cast<uint64_t>(local.code()), &words);
  if (!st.ok()) return e.Fail(Status(st.code(), what + ": rank agreement: " + std::string(st.message())));
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

// Save and Load need the accumulation window closed: no gathered group out, no gradient buffer,
// no reduction since the last Step.
Status CheckBoundary(const Engine::Impl& e, const char* op) {
  STRATA_RETURN_IF_ERROR(e.CheckHealthy());
  if (e.outstanding_gathers > 0) {
    return Status::FailedPrecondition(std::string(op) + ": " + std::to_string(e.outstanding_gathers) +
                                      " gathered group(s) not released");
  }
  for (size_t g = 0; g < e.groups.size(); ++g) {
    if (e.groups[g].grad || e.groups[g].reductions > 0 || !e.pending.empty()) {
      return Status::FailedPrecondition(
          std::string(op) + ": mid-accumulation (group '" + e.model.groups[g].name +
          "' has gradients since the last Step); checkpoints are taken between Step and the next "
          "micro-step's gradients");
    }
  }
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
    m.groups.push_back(std::move(ge));
  }
  m.global_step = e.global_step;
  m.skipped_steps = e.skipped_steps;
  m.applied_steps = e.applied_steps;
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
// master32, exp_avg, exp_avg_sq of the sub-groups this rank owns.
Result<std::vector<Piece>> RankPieces(const Engine::Impl& e) {
  const Tier param_tier = e.ComputeTier(e.placement.Home(StateKind::kParam16));
  const Tier opt_tier = e.ComputeTier(e.placement.Home(StateKind::kMaster32));
  std::vector<Piece> out;
  for (const zero::GroupState& gs : e.groups) {
    const uint64_t s = gs.shard.shard_elems;
    const uint64_t off = e.placement.params_partitioned ? 0 : static_cast<uint64_t>(e.rank) * s * e.elt;
    out.push_back({gs.param, param_tier, off, s * e.elt});
    for (int k = 1; k < 4; ++k) {
      uint64_t covered = 0;
      for (size_t si : gs.sub_groups) {
        const SubGroup& sg = e.subs[si];
        if (sg.owner != e.rank) continue;
        const BlockId b = k == 1 ? sg.master : k == 2 ? sg.exp_avg : sg.exp_avg_sq;
        out.push_back({b, opt_tier, 0, sg.elems * 4});
        covered += sg.elems;
      }
      if (covered != s) {
        return Status::Internal("checkpoint: the sub-groups of '" + e.model.groups[&gs - e.groups.data()].name +
                                "' cover " + std::to_string(covered) + " of " + std::to_string(s) +
                                " shard elements");
      }
    }
  }
  return out;
}

Result<ckpt::FileEntry> WriteRankFile(Engine::Impl& e, const ckpt::Manifest& m,
                                      const std::string& path) {
  uint64_t data_start = 0;
  const std::string header = ckpt::RankFileHeader(m, e.rank, &data_start, nullptr);
  STRATA_ASSIGN_OR_RETURN(ckpt::FileWriter w, ckpt::FileWriter::Create(path));
  STRATA_RETURN_IF_ERROR(w.Append(header.data(), header.size()));
  STRATA_ASSIGN_OR_RETURN(const std::vector<Piece> pieces, RankPieces(e));
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& p = pieces[i];
    // Overlap: the next block's hop to the compute tier runs while this one is written.
    if (i + 1 < pieces.size()) {
      const Piece& n = pieces[i + 1];
      if (e.store->spec(n.block).home != n.tier && n.block != p.block) (void)e.store->Fetch(n.block, n.tier);
    }
    STRATA_ASSIGN_OR_RETURN(Lease l, e.store->Acquire(p.block, p.tier, Access::kRead, e.timeout()));
    if (p.offset_bytes + p.bytes > l.size_bytes()) {
      return Status::Internal("checkpoint: block " + e.store->spec(p.block).name + " is smaller than its piece");
    }
    STRATA_RETURN_IF_ERROR(w.Append(static_cast<const uint8_t*>(l.data()) + p.offset_bytes, p.bytes));
  }
  STRATA_RETURN_IF_ERROR(w.Finish());
  ckpt::FileEntry f;
  f.name = ckpt::Manifest::RankFileName(e.rank);
  f.rank = e.rank;
  f.size_bytes = w.size_bytes();
  f.xxh3 = w.xxh3();
  return f;
}

// Rank 0, once every part is durable: manifest, rename, latest.
Status Commit(const std::string& dir, const std::string& tag, const ckpt::Manifest& m) {
  const std::string tmp = dir + "/" + tag + ".tmp", final_dir = dir + "/" + tag;
  STRATA_RETURN_IF_ERROR(ckpt::WriteSmallFile(tmp + "/" + ckpt::kManifestName, m.ToJson(), false));
  STRATA_RETURN_IF_ERROR(ckpt::FsyncDir(tmp));
  STRATA_RETURN_IF_ERROR(ckpt::RenamePath(tmp, final_dir));
  STRATA_RETURN_IF_ERROR(ckpt::FsyncDir(dir));
  return ckpt::WriteSmallFile(dir + "/" + ckpt::kLatestName, tag + "\n", true);
}

}  // namespace

Status Engine::Save(const std::string& dir, const std::string& tag,
                    std::span<const uint8_t> client_state) {
  Impl& e = *impl_;
  ckpt::ArmCrashHookFromEnv();
  const std::string what = "checkpoint save of '" + tag + "' to " + dir;
  Status local = CheckBoundary(e, "Save");
  if (local.ok() && tag.empty()) local = Status::InvalidArgument("Save: empty tag");
  if (local.ok()) local = ckpt::ResolveTag(dir, tag).status();
  if (local.ok() && tag.size() > 4 && tag.compare(tag.size() - 4, 4, ".tmp") == 0) {
    local = Status::InvalidArgument("Save: a tag may not end in .tmp (the name of an unfinished save)");
  }
  const std::string tmp = dir + "/" + tag + ".tmp";
  if (local.ok() && e.rank == 0) {
    if (ckpt::PathExists(dir + "/" + tag)) {
      local = Status::FailedPrecondition("Save: checkpoint " + dir + "/" + tag +
                                         " already exists (tags are never overwritten)");
    }
    // A `<tag>.tmp` left by a save that crashed is garbage: start over.
    if (local.ok()) local = ckpt::RemoveTree(tmp);
    if (local.ok()) {
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) local = Status::IOError("create " + dir + ": " + ec.message());
    }
    if (local.ok()) local = ckpt::MakeDir(tmp);
  }
  STRATA_RETURN_IF_ERROR(Agree(e, local, what));

  ckpt::Manifest m = BaseManifest(e, tag);
  auto part = WriteRankFile(e, m, tmp + "/" + ckpt::Manifest::RankFileName(e.rank));
  local = part.status();
  ckpt::FileEntry client;
  if (local.ok() && e.rank == 0 && !client_state.empty()) {
    auto w = ckpt::FileWriter::Create(tmp + "/" + ckpt::kClientStateName);
    local = w.status();
    if (local.ok()) local = w->Append(client_state.data(), client_state.size());
    if (local.ok()) local = w->Finish();
    if (local.ok()) client = {ckpt::kClientStateName, -1, w->size_bytes(), w->xxh3()};
  }
  if (!local.ok()) local = Status(local.code(), what + ": " + std::string(local.message()));
  std::vector<std::pair<uint64_t, uint64_t>> words;
  Status st = ExchangeWords(e, local.ok() ? part->size_bytes : kFailMarker,
                            local.ok() ? part->xxh3 : static_cast<uint64_t>(local.code()), &words);
  if (!st.ok()) return e.Fail(Status(st.code(), what + ": rank agreement: " + std::string(st.message())));
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
    local = Commit(dir, tag, m);
    if (!local.ok()) local = Status(local.code(), what + ": " + std::string(local.message()));
  }
  return Agree(e, local, what);
}

// ---------------------------------------------------------------------------------------------
// Load
// ---------------------------------------------------------------------------------------------

namespace {

// What of the checkpoint this engine cannot take; empty when compatible.
Status CheckCompatible(const Engine::Impl& e, const ckpt::Manifest& m) {
  std::vector<std::string> diffs;
  const ModelSpec& model = e.model;
  if (m.groups.size() != model.groups.size()) {
    diffs.push_back(std::to_string(m.groups.size()) + " groups in the checkpoint, " +
                    std::to_string(model.groups.size()) + " in the model");
  }
  auto shape_str = [](const std::vector<int64_t>& s) {
    std::string o = "[";
    for (size_t i = 0; i < s.size(); ++i) o += (i ? "," : "") + std::to_string(s[i]);
    return o + "]";
  };
  for (size_t g = 0; g < std::min(m.groups.size(), model.groups.size()); ++g) {
    const auto& cg = m.groups[g];
    const auto& mg = model.groups[g];
    if (cg.name != mg.name) diffs.push_back("group " + std::to_string(g) + ": '" + cg.name + "' in the checkpoint, '" + mg.name + "' in the model");
    if (cg.params.size() != mg.params.size()) {
      diffs.push_back("group '" + mg.name + "': " + std::to_string(cg.params.size()) +
                      " params in the checkpoint, " + std::to_string(mg.params.size()) + " in the model");
    }
    for (size_t p = 0; p < std::min(cg.params.size(), mg.params.size()); ++p) {
      if (cg.params[p].name != mg.params[p].name || cg.params[p].shape != mg.params[p].shape) {
        diffs.push_back(cg.name + "." + cg.params[p].name + shape_str(cg.params[p].shape) +
                        " in the checkpoint, " + mg.name + "." + mg.params[p].name +
                        shape_str(mg.params[p].shape) + " in the model");
      }
    }
  }
  if (!diffs.empty()) {
    std::string msg = "the checkpoint's model spec differs from the engine's:";
    for (size_t i = 0; i < diffs.size() && i < 20; ++i) msg += "\n  " + diffs[i];
    if (diffs.size() > 20) msg += "\n  ... and " + std::to_string(diffs.size() - 20) + " more";
    return Status::FailedPrecondition(msg);
  }
  const ckpt::Manifest mine = BaseManifest(e, m.tag);
  if (m.precision != mine.precision) {
    return Status::FailedPrecondition("the checkpoint's precision is " + m.precision +
                                      ", the engine's " + mine.precision +
                                      " (converting precision on load is not implemented)");
  }
  // Another world size or stage is fine: the files hold global element ranges per group, and
  // RangeReader cuts any range this engine's layout asks for out of whichever ranks' files hold
  // it (resharding on load).
  return Status::OK();
}

// Fills one block (or its range) through a write lease; NVMe homes are written back before the
// next block so host memory holds one block at a time.
Status LoadBlock(Engine::Impl& e, ckpt::RangeReader& rd, BlockId b, Tier tier, size_t g, size_t kind,
                 uint64_t global_begin, uint64_t elems, uint64_t block_offset_bytes) {
  {
    STRATA_ASSIGN_OR_RETURN(Lease l, e.store->Acquire(b, tier, Access::kWrite, e.timeout()));
    STRATA_RETURN_IF_ERROR(
        rd.Read(g, kind, global_begin, elems, static_cast<uint8_t*>(l.data()) + block_offset_bytes));
    l.MarkDirty();
  }
  if (e.store->spec(b).home == Tier::kNvme) STRATA_RETURN_IF_ERROR(e.store->WriteBack(b).Wait(e.timeout()));
  return Status::OK();
}

Status LoadState(Engine::Impl& e, const std::string& tag_dir, const ckpt::Manifest& m) {
  ckpt::RangeReader rd(tag_dir, m);
  const Tier param_tier = e.ComputeTier(e.placement.Home(StateKind::kParam16));
  const Tier opt_tier = e.ComputeTier(e.placement.Home(StateKind::kMaster32));
  for (size_t g = 0; g < e.groups.size(); ++g) {
    const zero::GroupState& gs = e.groups[g];
    const uint64_t s = gs.shard.shard_elems;
    if (e.placement.params_partitioned) {
      STRATA_RETURN_IF_ERROR(LoadBlock(e, rd, gs.param, param_tier, g, 0, e.rank * s, s, 0));
    } else {
      STRATA_RETURN_IF_ERROR(
          LoadBlock(e, rd, gs.param, param_tier, g, 0, 0, gs.shard.padded_elems(e.world), 0));
    }
    for (size_t si : gs.sub_groups) {
      const SubGroup& sg = e.subs[si];
      const BlockId blocks[3] = {sg.master, sg.exp_avg, sg.exp_avg_sq};
      for (size_t k = 1; k < 4; ++k) {
        STRATA_RETURN_IF_ERROR(LoadBlock(e, rd, blocks[k - 1], opt_tier, g, k, e.FullOffset(sg), sg.elems, 0));
      }
    }
  }
  zero::LossScalerState ls;
  ls.scale = m.scale;
  ls.iteration = m.scaler_iteration;
  ls.last_overflow_iteration = m.scaler_last_overflow;
  ls.hysteresis_left = m.scaler_hysteresis_left;
  STRATA_RETURN_IF_ERROR(e.scaler->Restore(ls));
  e.global_step = m.global_step;
  e.skipped_steps = m.skipped_steps;
  e.applied_steps = m.applied_steps;
  e.last_lr = m.last_lr;
  // Gathered copies kept from before are stale now.
  for (zero::GroupState& gs : e.groups) gs.cached.reset();
  e.cached_elems = 0;
  return Status::OK();
}

}  // namespace

Status Engine::Load(const std::string& dir, const std::string& tag,
                    std::vector<uint8_t>* client_state) {
  Impl& e = *impl_;
  std::string what = "checkpoint load from " + dir;
  Status local = CheckBoundary(e, "Load");
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
      if (local.ok() && m.tag != *t) {
        local = Status::Corruption(dir + "/" + *t + "/" + ckpt::kManifestName + ": names tag '" + m.tag + "'");
      }
    }
  }
  if (local.ok()) local = CheckCompatible(e, m);
  if (local.ok()) {
    // Each rank checks its share of the files (file i on rank i % world).
    std::vector<size_t> mine;
    for (size_t i = 0; i < m.files.size(); ++i) {
      if (static_cast<int>(i % static_cast<size_t>(e.world)) == e.rank) mine.push_back(i);
    }
    if (!mine.empty()) local = ckpt::VerifyFiles(dir, m, mine);
    const std::string text = m.ToJson();
    manifest_hash = XXH3_64bits(text.data(), text.size()) & ~(uint64_t{1} << 63);
  }
  if (!local.ok()) local = Status(local.code(), what + ": " + std::string(local.message()));
  std::vector<uint64_t> hashes;
  STRATA_RETURN_IF_ERROR(Agree(e, local, what, manifest_hash, &hashes));
  for (uint64_t h : hashes) {
    if (h != manifest_hash) {
      return Status::FailedPrecondition(what + ": the ranks read different manifests (is `latest` "
                                               "being replaced, or is the directory not shared?)");
    }
  }
  const std::string tag_dir = dir + "/" + m.tag;
  local = LoadState(e, tag_dir, m);
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
  return Agree(e, local, what);
}

}  // namespace strata
