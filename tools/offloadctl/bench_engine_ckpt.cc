// `offloadctl bench engine --save-dir`: checkpoint saves and loads judged against the disk in the
// same run (see bench_engine.h MeasureCheckpoint).
//
// The method. A virtual disk's rate swings (2x between two measurements a minute apart was
// seen), so one reference and one save decide nothing. The bench runs --save-repeat pairs; each
// pair is one disk reference and one checkpoint (a save into <save_dir>/bench-v<N>/s<i>, then a
// load of it), in alternating order (pair 0 checkpoint first, pair 1 reference first, ...), so a
// drift in either direction lands on both sides as often. Each pair gets its own ratio: the
// disk's time for the bytes the save moves (checkpoint bytes at the reference's new-file rate, or
// its overwrite rate when the save recycled files; the swap reads at its read rate; swap writes at
// its overwrite rate) over the save's time; the figure is the median of the pairs' ratios.
//
// The reference is what the save's streams would get from an idle disk: every rank writes (then
// overwrites, then reads) a scratch file of its own rank file's size at once, with the
// checkpoint streams' chunk size and depth (ckpt::TimeDiskPass), all starting after a barrier;
// a pass's rate is the total bytes over the slowest rank's time, as a collective save is timed.
//
// Retention: the saves use SaveOptions from --keep-last / --no-recycle-files, else the config's
// `checkpoint` section. With keep_last 0 (keep every checkpoint) rank 0 removes the checkpoints
// older than `latest` before each pair, outside the timed part, so the disk holds at most two.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "core/zero/checkpoint_format.h"
#include "core/zero/checkpoint_retention.h"
#include "tools/offloadctl/bench_engine.h"

namespace strata::cli {

namespace ckpt = zero::ckpt;

namespace {

using Clock = std::chrono::steady_clock;

double Sec(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The three reference passes on every rank at once (see the header comment). Each rank's file
// holds `bytes` rounded up to whole chunks; rates count every rank's bytes.
Result<ckpt::DiskReference> MeasureDiskAllRanks(Communicator& comm, const std::string& dir,
                                                uint64_t bytes, const ckpt::StreamOptions& so,
                                                std::chrono::milliseconds timeout) {
  ckpt::DiskReference d;
  d.chunk_bytes = so.chunk_bytes;
  d.depth = so.depth;
  const uint64_t mine =
      (std::max<uint64_t>(bytes, 1) + so.chunk_bytes - 1) / so.chunk_bytes * so.chunk_bytes;
  const std::string path = ckpt::DiskReferencePath(dir);
  bool buffered = false;
  Status st;
  for (ckpt::DiskPass pass :
       {ckpt::DiskPass::kWriteFresh, ckpt::DiskPass::kOverwrite, ckpt::DiskPass::kRead}) {
    STRATA_RETURN_IF_ERROR(AllGatherDoubles(comm, {0.0}, timeout).status());  // start together
    double s = -1;
    if (st.ok()) {
      auto t = ckpt::TimeDiskPass(path, mine, so, pass, &buffered);
      st = t.status();
      if (t.ok()) s = *t;
    }
    STRATA_ASSIGN_OR_RETURN(std::vector<double> all,
                            AllGatherDoubles(comm, {s, static_cast<double>(mine)}, timeout));
    double slowest = 0, total = 0;
    for (size_t r = 0; r < all.size(); r += 2) {
      if (all[r] < 0 && st.ok()) {
        st = Status::Aborted("disk reference: rank " + std::to_string(r / 2) + " failed");
      }
      slowest = std::max(slowest, all[r]);
      total += all[r + 1];
    }
    d.bytes = static_cast<uint64_t>(total);
    const double rate = slowest > 0 ? total / slowest : 0;
    if (pass == ckpt::DiskPass::kWriteFresh) d.write_fresh_bytes_per_s = rate;
    if (pass == ckpt::DiskPass::kOverwrite) d.write_overwrite_bytes_per_s = rate;
    if (pass == ckpt::DiskPass::kRead) d.read_bytes_per_s = rate;
  }
  std::error_code removed;
  std::filesystem::remove(path, removed);  // a file left behind is not worth failing the bench
  STRATA_RETURN_IF_ERROR(st.WithContext("disk reference " + path));
  if (buffered) d.note = "buffered IO (O_DIRECT refused under " + dir + ")";
  return d;
}

// Whether the next save into `dir` with `o` will recycle a retired checkpoint's files.
bool WillRecycle(const std::string& dir, const SaveOptions& o) {
  if (o.keep_last == 0 || !o.recycle_files) return false;
  auto tag = ckpt::RecycleCandidate(dir, o.keep_last);
  return tag.ok() && !tag->empty();
}

// Every rank learns whether every rank's `local` is OK (collective): `local` where it failed,
// Aborted naming the first other rank that failed.
Status AgreeOk(Communicator& comm, const Status& local, std::chrono::milliseconds timeout) {
  STRATA_ASSIGN_OR_RETURN(std::vector<double> all,
                          AllGatherDoubles(comm, {local.ok() ? 0.0 : 1.0}, timeout));
  STRATA_RETURN_IF_ERROR(local);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] != 0) return Status::Aborted("rank " + std::to_string(r) + " failed");
  }
  return Status::OK();
}

// keep_last 0: every checkpoint but `latest` goes, untimed (see the header comment).
Status PruneOlder(const std::string& dir) {
  auto latest = ckpt::ResolveTag(dir, "");
  if (!latest.ok()) return Status::OK();  // none yet
  return ckpt::RetireBeyond(dir, 1, *latest);
}

}  // namespace

Status MeasureCheckpoint(const BenchEngineArgs& a, const CheckpointBench& c, Engine& engine,
                         VariantResult* r) {
  const std::string& dir = c.dir;
  const bool rank0 = c.comm.rank() == 0;
  Status cleared;
  if (rank0) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    if (ec) cleared = Status::IOError("remove " + dir + ": " + ec.message());
  }
  STRATA_RETURN_IF_ERROR(AgreeOk(c.comm, cleared, c.timeout));
  r->save_options = c.save_options;
  uint64_t my_file_bytes = 0;
  auto timed = [&](const std::string& what, double* s, double* swap_read, double* swap_write,
                   auto op) -> Status {
    c.say(what + " (" + dir + ")");
    const StoreStats before = engine.Stats().store;
    const auto t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(op().WithContext(what));
    *s = Sec(Clock::now() - t0);
    const StoreStats after = engine.Stats().store;
    *swap_read = static_cast<double>(NvmeRead(after) - NvmeRead(before));
    *swap_write = static_cast<double>(NvmeWrite(after) - NvmeWrite(before));
    return Status::OK();
  };
  for (int i = 0; i < a.save_repeat; ++i) {
    CheckpointPair pair;
    pair.reference_first = i % 2 == 1;  // pair 0 saves first: the reference needs its size
    const std::string tag = "s" + std::to_string(i);
    double my_swap[4] = {0, 0, 0, 0};  // save read, save write, load read, load write
    auto checkpoint = [&]() -> Status {
      const Status pruned = rank0 && c.save_options.keep_last == 0 ? PruneOlder(dir) : Status::OK();
      STRATA_RETURN_IF_ERROR(AgreeOk(c.comm, pruned, c.timeout));
      pair.recycled = WillRecycle(dir, c.save_options);
      STRATA_RETURN_IF_ERROR(timed("checkpoint save " + tag, &pair.save_s, &my_swap[0], &my_swap[1],
                                   [&] { return engine.Save(dir, tag, c.save_options); }));
      STRATA_RETURN_IF_ERROR(timed("checkpoint load " + tag, &pair.load_s, &my_swap[2], &my_swap[3],
                                   [&] { return engine.Load(dir, tag); }));
      std::error_code ec;
      my_file_bytes = std::filesystem::file_size(
          dir + "/" + tag + "/" + ckpt::Manifest::RankFileName(c.comm.rank()), ec);
      uint64_t total = 0;
      for (const auto& e : std::filesystem::directory_iterator(dir + "/" + tag, ec)) {
        total += e.file_size(ec);
      }
      r->checkpoint_bytes = total;
      return Status::OK();
    };
    auto reference = [&]() -> Result<ckpt::DiskReference> {
      c.say("measuring the disk under " + dir + " (" + std::to_string(c.comm.world_size()) +
            " stream(s) at once)");
      return MeasureDiskAllRanks(c.comm, dir, my_file_bytes, c.stream, c.timeout);
    };
    if (!pair.reference_first) STRATA_RETURN_IF_ERROR(checkpoint());
    STRATA_ASSIGN_OR_RETURN(pair.disk, reference());
    if (pair.reference_first) STRATA_RETURN_IF_ERROR(checkpoint());
    STRATA_ASSIGN_OR_RETURN(std::vector<double> swaps,
                            AllGatherDoubles(c.comm, {my_swap, my_swap + 4}, c.timeout));
    for (size_t k = 0; k < swaps.size(); k += 4) {
      pair.save_swap_read_bytes += swaps[k];
      pair.save_swap_write_bytes += swaps[k + 1];
      pair.load_swap_read_bytes += swaps[k + 2];
      pair.load_swap_write_bytes += swaps[k + 3];
    }
    r->checkpoint_pairs.push_back(pair);
  }
  r->checkpoint_host_peak_bytes = static_cast<double>(engine.Stats().peak_bytes[Tier::kHost]);
  r->checkpoint_stream_bytes = static_cast<double>(c.stream.chunk_bytes * c.stream.depth);
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------------

namespace {

struct PairFigures {
  double save_disk_s = 0, load_disk_s = 0, save_ratio = 0, load_ratio = 0;
};

// The disk's time for what one pair's save and load move, and the ratios (header comment).
PairFigures Judge(const CheckpointPair& p, double bytes) {
  const ckpt::DiskReference& d = p.disk;
  PairFigures f;
  if (d.write_fresh_bytes_per_s <= 0 || d.write_overwrite_bytes_per_s <= 0 ||
      d.read_bytes_per_s <= 0) {
    return f;
  }
  const double write_rate = p.recycled ? d.write_overwrite_bytes_per_s : d.write_fresh_bytes_per_s;
  f.save_disk_s = bytes / write_rate + p.save_swap_read_bytes / d.read_bytes_per_s +
                  p.save_swap_write_bytes / d.write_overwrite_bytes_per_s;
  f.load_disk_s = (bytes + p.load_swap_read_bytes) / d.read_bytes_per_s +
                  p.load_swap_write_bytes / d.write_overwrite_bytes_per_s;
  f.save_ratio = p.save_s > 0 ? f.save_disk_s / p.save_s : 0;
  f.load_ratio = p.load_s > 0 ? f.load_disk_s / p.load_s : 0;
  return f;
}

}  // namespace

nlohmann::json CheckpointJson(const VariantResult& r) {
  const double bytes = static_cast<double>(r.checkpoint_bytes);
  nlohmann::json pairs = nlohmann::json::array();
  std::vector<double> save_s, load_s, save_ratio, load_ratio, new_ratio, recycled_ratio;
  std::vector<double> fresh, over, read, save_rd, save_wr, load_rd, load_wr;
  for (const CheckpointPair& p : r.checkpoint_pairs) {
    const PairFigures f = Judge(p, bytes);
    const ckpt::DiskReference& d = p.disk;
    pairs.push_back(
        {{"order", p.reference_first ? "reference, checkpoint" : "checkpoint, reference"},
         {"files", p.recycled ? "recycled" : "new"},
         {"save_s", p.save_s},
         {"load_s", p.load_s},
         {"save_ratio", f.save_ratio},
         {"load_ratio", f.load_ratio},
         {"save_swap_read_bytes", p.save_swap_read_bytes},
         {"save_swap_write_bytes", p.save_swap_write_bytes},
         {"load_swap_read_bytes", p.load_swap_read_bytes},
         {"load_swap_write_bytes", p.load_swap_write_bytes},
         {"disk_write_fresh_bytes_per_s", d.write_fresh_bytes_per_s},
         {"disk_write_overwrite_bytes_per_s", d.write_overwrite_bytes_per_s},
         {"disk_read_bytes_per_s", d.read_bytes_per_s}});
    save_s.push_back(p.save_s);
    load_s.push_back(p.load_s);
    save_ratio.push_back(f.save_ratio);
    load_ratio.push_back(f.load_ratio);
    (p.recycled ? recycled_ratio : new_ratio).push_back(f.save_ratio);
    fresh.push_back(d.write_fresh_bytes_per_s);
    over.push_back(d.write_overwrite_bytes_per_s);
    read.push_back(d.read_bytes_per_s);
    save_rd.push_back(p.save_swap_read_bytes);
    save_wr.push_back(p.save_swap_write_bytes);
    load_rd.push_back(p.load_swap_read_bytes);
    load_wr.push_back(p.load_swap_write_bytes);
  }
  const ckpt::DiskReference none;
  const ckpt::DiskReference& d0 = r.checkpoint_pairs.empty() ? none : r.checkpoint_pairs[0].disk;
  const bool measured = Median(fresh) > 0 && Median(over) > 0 && Median(read) > 0;
  auto median_or_null = [](const std::vector<double>& v) {
    return v.empty() ? nlohmann::json() : nlohmann::json(Median(v));
  };
  return {{"bytes", r.checkpoint_bytes},
          {"pairs", pairs},
          {"keep_last", r.save_options.keep_last},
          {"recycle_files", r.save_options.recycle_files},
          {"reference_streams", r.world_size},
          {"save_s", Median(save_s)},
          {"load_s", Median(load_s)},
          {"save_ratio", Median(save_ratio)},
          {"load_ratio", Median(load_ratio)},
          {"save_new_files_ratio", median_or_null(new_ratio)},
          {"save_recycled_ratio", median_or_null(recycled_ratio)},
          {"save_swap_read_bytes", Median(save_rd)},
          {"save_swap_write_bytes", Median(save_wr)},
          {"load_swap_read_bytes", Median(load_rd)},
          {"load_swap_write_bytes", Median(load_wr)},
          {"disk_measured", measured},
          {"disk_reference_bytes", d0.bytes},
          {"disk_chunk_bytes", d0.chunk_bytes},
          {"disk_queue_depth", d0.depth},
          {"disk_write_fresh_bytes_per_s", Median(fresh)},
          {"disk_write_overwrite_bytes_per_s", Median(over)},
          {"disk_read_bytes_per_s", Median(read)},
          {"disk_note", d0.note},
          {"host_peak_bytes", r.checkpoint_host_peak_bytes},
          {"host_budget_bytes", r.budget_bytes[static_cast<size_t>(Tier::kHost)]},
          {"stream_buffer_bytes", r.checkpoint_stream_bytes},
          {"save_vs_disk_write",
           measured && Median(save_s) > 0 ? bytes / Median(save_s) / Median(fresh) : 0.0},
          {"load_vs_disk_read",
           measured && Median(load_s) > 0 ? bytes / Median(load_s) / Median(read) : 0.0}};
}

void PrintCheckpoint(const nlohmann::json& c) {
  auto mbs = [](const nlohmann::json& v) { return v.get<double>() / 1e6; };
  // A ratio the run did not measure (no save of that kind) is null in the JSON: "n/a" here.
  auto ratio = [](const nlohmann::json& v) {
    char buf[32];
    if (v.is_null()) return std::string("n/a");
    std::snprintf(buf, sizeof buf, "x%.2f", v.get<double>());
    return std::string(buf);
  };
  std::printf(
      "  checkpoint %.2f GB, %zu reference/checkpoint pair(s), %d stream(s) in the reference: "
      "median save %.3f s (x%.2f the disk's time; new files %s, recycled %s), load %.3f s "
      "(x%.2f)\n",
      c["bytes"].get<double>() / 1e9, c["pairs"].size(), c["reference_streams"].get<int>(),
      c["save_s"].get<double>(), c["save_ratio"].get<double>(),
      ratio(c["save_new_files_ratio"]).c_str(), ratio(c["save_recycled_ratio"]).c_str(),
      c["load_s"].get<double>(), c["load_ratio"].get<double>());
  for (const auto& p : c["pairs"]) {
    std::printf(
        "    %-22s %-8s save %.3f s x%.2f, load %.3f s x%.2f; disk: new file %.0f MB/s, "
        "overwrite %.0f MB/s, read %.0f MB/s; swap read by the save %.2f GB\n",
        p["order"].get<std::string>().c_str(), p["files"].get<std::string>().c_str(),
        p["save_s"].get<double>(), p["save_ratio"].get<double>(), p["load_s"].get<double>(),
        p["load_ratio"].get<double>(), mbs(p["disk_write_fresh_bytes_per_s"]),
        mbs(p["disk_write_overwrite_bytes_per_s"]), mbs(p["disk_read_bytes_per_s"]),
        p["save_swap_read_bytes"].get<double>() / 1e9);
  }
  std::printf("    host: peak %.2f GB of a %.2f GB budget, plus %.0f MiB of stream buffers\n",
              c["host_peak_bytes"].get<double>() / 1e9, c["host_budget_bytes"].get<double>() / 1e9,
              c["stream_buffer_bytes"].get<double>() / (1 << 20));
}

}  // namespace strata::cli
