#include "nvme/swap_space.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "nvme/io_drain.h"
#include "nvme/leftovers.h"
#include "nvme/unit_hash.h"

namespace strata::nvme {

namespace {
size_t RoundUp(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }
std::string BlockName(uint64_t id) { return "swap block " + std::to_string(id); }
// An IO's user_data: its op slot and the unit of the op's block it transfers.
uint64_t UnitTag(size_t slot, size_t unit) { return (uint64_t{slot} << 32) | unit; }
size_t TagSlot(uint64_t tag) { return static_cast<size_t>(tag >> 32); }
size_t TagUnit(uint64_t tag) { return static_cast<size_t>(tag & 0xffffffffu); }
}  // namespace

std::string SwapFilePath(const std::string& dir, int rank) {
  return dir + "/strata-swap-rank" + std::to_string(rank) + ".swp";
}

Result<std::unique_ptr<SwapSpace>> SwapSpace::Create(const SwapSpaceOptions& options,
                                                     std::span<const SwapBlockSpec> blocks,
                                                     IoBackend* io) {
  if (io == nullptr) return Status::InvalidArgument("swap space: no IoBackend");
  if (options.paths.empty()) return Status::InvalidArgument("swap space: no nvme_path given");
  if (options.stripe_unit_bytes == 0 || options.stripe_unit_bytes % kIoAlignment != 0) {
    return Status::InvalidArgument("swap space: stripe_unit_bytes " +
                                   std::to_string(options.stripe_unit_bytes) +
                                   " is not a positive multiple of 4096");
  }
  if (options.max_inflight_ops == 0) {
    return Status::InvalidArgument("swap space: max_inflight_ops must be > 0");
  }
  std::unique_ptr<SwapSpace> s(new SwapSpace(options, io));
  // Static layout: unit k of block b goes to file (b + k) mod #paths, appended there. File sizes
  // first, arithmetically, so an absurd size is refused by the space check before any layout
  // memory is spent on it.
  const size_t nfiles = options.paths.size();
  const size_t unit = options.stripe_unit_bytes;
  s->file_sizes_.assign(nfiles, 0);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const SwapBlockSpec& spec = blocks[b];
    if (spec.size_bytes == 0) {
      return Status::InvalidArgument(BlockName(spec.id) + ": size_bytes is 0");
    }
    if (!s->index_.emplace(spec.id, b).second) {
      return Status::InvalidArgument(BlockName(spec.id) + ": registered twice");
    }
    const size_t extent = RoundUp(spec.size_bytes, kIoAlignment);
    const size_t full = extent / unit, last = extent % unit;
    for (size_t f = 0; f < nfiles; ++f) {
      const size_t k0 = (f + nfiles - b % nfiles) % nfiles;  // first k landing on file f
      s->file_sizes_[f] += (full / nfiles + (k0 < full % nfiles ? 1 : 0)) * unit;
    }
    if (last > 0) s->file_sizes_[(b + full) % nfiles] += last;
  }
  STRATA_RETURN_IF_ERROR(s->CheckPaths());
  STRATA_RETURN_IF_ERROR(s->CheckFreeSpace());
  std::vector<uint64_t> next_offset(nfiles, 0);
  for (size_t b = 0; b < blocks.size(); ++b) {
    Block block;
    block.id = blocks[b].id;
    block.extent_bytes = RoundUp(blocks[b].size_bytes, kIoAlignment);
    for (size_t off = 0, k = 0; off < block.extent_bytes; off += unit, ++k) {
      const uint32_t f = static_cast<uint32_t>((b + k) % nfiles);
      const size_t len = std::min(unit, block.extent_bytes - off);
      block.units.push_back(Unit{f, next_offset[f], len, off});
      next_offset[f] += len;
    }
    if (block.units.size() > 0xffffffffu) {
      return Status::InvalidArgument(BlockName(blocks[b].id) + ": more than 2^32 stripe units");
    }
    block.unit_sums.assign(block.units.size(), 0);
    block.pending_sums.assign(block.units.size(), 0);
    s->blocks_.push_back(std::move(block));
  }
  if (next_offset != s->file_sizes_) return Status::Internal("swap space: layout size mismatch");
  STRATA_RETURN_IF_ERROR(s->OpenFiles());
  for (size_t i = 0; i < nfiles; ++i) {
    STRATA_RETURN_IF_ERROR(io->RegisterFile(s->fds_[i], s->file_paths_[i]));
  }
  STRATA_RETURN_IF_ERROR(s->Preallocate());
  s->slots_.resize(options.max_inflight_ops);
  for (size_t i = options.max_inflight_ops; i-- > 0;) s->free_slots_.push_back(i);
  s->waiting_.reserve(options.max_inflight_ops);
  s->issuing_.reserve(options.max_inflight_ops);
  s->batch_.reserve(io->queue_depth());
  s->ready_ = BoundedQueue<SwapCompletion>(options.max_inflight_ops);
  s->io_out_.resize(io->queue_depth());
  return s;
}

namespace {

Status CheckDirectory(const std::string& dir) {
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      // DeepSpeed creates a missing path; strata does not, so that a mistyped or unmounted
      // path never fills another disk.
      return Status::NotFound("nvme_path '" + dir +
                              "' does not exist: create the directory on the NVMe's "
                              "filesystem (strata does not create it)");
    }
    return Status::FromErrno(errno, "stat nvme_path", dir);
  }
  if (!S_ISDIR(st.st_mode)) return Status::IOError("nvme_path '" + dir + "' is not a directory");
  if (access(dir.c_str(), W_OK) != 0) return Status::FromErrno(errno, "nvme_path not writable", dir);
  return Status::OK();
}

bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// Another rank starting in the same path holds each file's lock for a moment while it scans
// (ReclaimStrataFiles), which makes this rank's own leftover look live: rescanned, 10 ms apart
// and bounded, before it counts as held by a live process. Leftovers removed by every pass add
// up.
constexpr int kOwnFileRescans = 200;

Result<StrataFileScan> ReclaimPath(const std::string& dir, const std::string& own) {
  std::vector<LeftoverEntry> reclaimed;
  for (int pass = 0;; ++pass) {
    STRATA_ASSIGN_OR_RETURN(StrataFileScan scan, ReclaimStrataFiles(dir));
    reclaimed.insert(reclaimed.end(), scan.leftovers.begin(), scan.leftovers.end());
    if (!Contains(scan.live, own) || pass == kOwnFileRescans) {
      scan.leftovers = std::move(reclaimed);
      return scan;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// The swap files this process's swap spaces hold. A second engine of the same rank in this
// process (a teacher beside a student, two runs in one script) finds its file locked by its own
// process, which a scan cannot tell from another live process: it is refused at once, saying
// so, instead of after the rescans with "another live process".
std::mutex& HeldHereMu() {
  static std::mutex mu;
  return mu;
}
std::set<std::string>& HeldHere() {
  static std::set<std::string> paths;
  return paths;
}
bool IsHeldHere(const std::string& path) {
  std::lock_guard<std::mutex> l(HeldHereMu());
  return HeldHere().count(path) != 0;
}

// What stops this rank from starting in a path after the reclaim: its own file held by a live
// process or not strata's to use, or a leftover that could not be removed.
Status CheckScan(const StrataFileScan& scan, const std::string& own, int rank) {
  if (Contains(scan.live, own)) {
    return Status::FailedPrecondition("swap file '" + own +
                                      "' is in use by another live process of rank " +
                                      std::to_string(rank));
  }
  // Symbolic links, FIFOs, devices, other users' files: never followed, opened, reused or
  // removed. Only the one in the way of this rank's file stops the start.
  for (const ForeignEntry& f : scan.foreign) {
    if (f.path == own) {
      return Status::FailedPrecondition("'" + own + "' is " + f.why +
                                        ", not a swap file strata may use; remove it or choose "
                                        "another nvme_path");
    }
  }
  if (!scan.failed.empty()) {
    const ForeignEntry& f = scan.failed.front();
    return Status::FailedPrecondition("could not remove '" + f.path +
                                      "', left by a run that did not close cleanly: " + f.why);
  }
  return Status::OK();
}

// The one-line notice of a reclaim.
std::string ReclaimNotice(const std::vector<LeftoverEntry>& reclaimed) {
  uint64_t bytes = 0;
  std::string names;
  for (const LeftoverEntry& e : reclaimed) {
    bytes += e.disk_bytes;
    names += (names.empty() ? "'" : ", '") + e.path + "'";
  }
  return "reclaimed " + std::to_string(reclaimed.size()) +
         " file(s) left by a run that did not close cleanly (" + std::to_string(bytes) +
         " bytes on disk): " + names;
}

}  // namespace

// Each path must be an existing writable directory. Strata files there that no live process
// holds locked are the scratch of runs that died (any rank's swap file, benchmark scratch
// files): removed (ReclaimStrataFiles, the decision `offloadctl clean` makes), and said in one
// line on stderr and in note(). Files a live process holds (another rank of this job, another
// job) and files that are not strata's are left alone.
Status SwapSpace::CheckPaths() {
  std::vector<LeftoverEntry> reclaimed;
  Status status;
  for (const std::string& dir : options_.paths) {
    status = CheckDirectory(dir);
    if (!status.ok()) break;
    const std::string own = SwapFilePath(dir, options_.rank);
    if (IsHeldHere(own)) {
      status = Status::FailedPrecondition(
          "swap file '" + own + "' is in use by another strata engine of rank " +
          std::to_string(options_.rank) + " in this process: give each engine its own nvme_path");
      break;
    }
    Result<StrataFileScan> scan = ReclaimPath(dir, own);
    if (!scan.ok()) {
      status = scan.status();
      break;
    }
    reclaimed.insert(reclaimed.end(), scan->leftovers.begin(), scan->leftovers.end());
    status = CheckScan(*scan, own, options_.rank);
    if (!status.ok()) break;
  }
  if (!reclaimed.empty()) {  // said even when a later path stops the start
    note_ = ReclaimNotice(reclaimed);
    std::fprintf(stderr, "strata: %s\n", note_.c_str());
  }
  return status;
}

// Free space per filesystem, so a disk too small fails with one clear message before anything
// is allocated. Filesystems that do not account space (ramfs: f_blocks == 0) are not checked.
Status SwapSpace::CheckFreeSpace() const {
  std::map<dev_t, std::pair<uint64_t, std::string>> need;
  for (size_t i = 0; i < options_.paths.size(); ++i) {
    struct stat st {};
    if (stat(options_.paths[i].c_str(), &st) != 0) {
      return Status::FromErrno(errno, "stat nvme_path", options_.paths[i]);
    }
    auto& [bytes, where] = need[st.st_dev];
    bytes += file_sizes_[i];
    if (where.empty()) where = options_.paths[i];
  }
  for (const auto& [dev, what] : need) {
    struct statvfs vfs {};
    if (statvfs(what.second.c_str(), &vfs) != 0)
      return Status::FromErrno(errno, "statvfs", what.second);
    if (vfs.f_blocks == 0) continue;
    const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (what.first > avail) {
      return Status::FromErrno(ENOSPC,
                               "preallocate swap space: need " + std::to_string(what.first) +
                                   " bytes, " + std::to_string(avail) + " available on",
                               what.second);
    }
  }
  return Status::OK();
}

// Creates the files and opens them O_DIRECT. On failure the files created so far are removed
// again (by the destructor: closed_ is still false).
Status SwapSpace::OpenFiles() {
  for (const std::string& dir : options_.paths) {
    const std::string path = SwapFilePath(dir, options_.rank);
    int err = 0;
    int lock_fd = CreateLockedFile(path, 0, &err);  // held until Close: marks the file live
    if (lock_fd < 0) {
      if (err == EEXIST) {
        return Status::FailedPrecondition("swap file '" + path +
                                          "' appeared while starting (another process of rank " +
                                          std::to_string(options_.rank) + "?)");
      }
      return Status::FromErrno(err, "create swap file", path);
    }
    file_paths_.push_back(path);
    lock_fds_.push_back(lock_fd);
    {
      std::lock_guard<std::mutex> l(HeldHereMu());
      HeldHere().insert(path);
    }
    int fd = open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
    if (fd >= 0) {
      fds_.push_back(fd);
      continue;
    }
    if (errno != EINVAL) return Status::FromErrno(errno, "open O_DIRECT", path);
    if (!options_.allow_buffered_io) {
      return Status::InvalidArgument("nvme_path '" + dir +
                                     "': the filesystem does not support O_DIRECT (open returned "
                                     "EINVAL; tmpfs on older kernels, ramfs); use a disk-backed "
                                     "path or allow buffered IO explicitly");
    }
    fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return Status::FromErrno(errno, "open", path);
    fds_.push_back(fd);
    if (!note_.empty()) note_ += "; ";
    note_ += "nvme_path '" + dir + "' has no O_DIRECT: using buffered IO there";
  }
  return Status::OK();
}

Status SwapSpace::Preallocate() {
  for (size_t i = 0; i < fds_.size(); ++i) {
    if (file_sizes_[i] == 0) continue;
    // Through the backend, so tests can fail it after the free-space check passed.
    STRATA_RETURN_IF_ERROR(io_->Allocate(fds_[i], file_sizes_[i]));
  }
  return Status::OK();
}

SwapSpace::~SwapSpace() { Close().IgnoreError(); }

Status SwapSpace::Close() {
  closed_ = true;
  if (lock_fds_.empty()) return Status::OK();
  // Every op must be finished before a file is closed or unlinked: the kernel may still write
  // into the caller's buffers or read from the files. Errors do not stop the wait.
  Status first;
  std::vector<SwapCompletion> sink(slots_.size() + 1);
  int failures = 0;
  while (inflight_ops_ > 0) {
    Result<size_t> got = Reap(sink, 1);
    if (got.ok()) {
      failures = 0;
      continue;
    }
    if (first.ok()) first = got.status();
    if (++failures >= kMaxDrainFailures) {
      return Status::IOError("swap space close: " + std::to_string(inflight_ops_) +
                             " ops still in flight after " + std::to_string(failures) +
                             " failed reaps (" + first.ToString() +
                             "); files kept open and on disk");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Unlink before the lock goes, so no scan ever sees our file unlocked (as a leftover).
  Status result;
  for (size_t i = 0; i < file_paths_.size(); ++i) {
    if (unlink(file_paths_[i].c_str()) != 0 && result.ok()) {
      result = Status::FromErrno(errno, "remove swap file", file_paths_[i]);
    }
  }
  for (int fd : fds_) {
    io_->UnregisterFile(fd);
    close(fd);
  }
  for (int fd : lock_fds_) close(fd);
  {
    std::lock_guard<std::mutex> l(HeldHereMu());
    for (const std::string& path : file_paths_) HeldHere().erase(path);
  }
  fds_.clear();
  lock_fds_.clear();
  return result;
}

size_t SwapSpace::ExtentBytes(uint64_t block_id) const {
  auto it = index_.find(block_id);
  return it == index_.end() ? 0 : blocks_[it->second].extent_bytes;
}

std::vector<SwapSpace::Piece> SwapSpace::Layout(uint64_t block_id) const {
  std::vector<Piece> out;
  auto it = index_.find(block_id);
  if (it == index_.end()) return out;
  for (const Unit& u : blocks_[it->second].units) {
    out.push_back(Piece{file_paths_[u.file], u.offset, u.length_bytes});
  }
  return out;
}

Status SwapSpace::Submit(std::span<const SwapOp> ops) {
  if (closed_) return Status::FailedPrecondition("swap space is closed");
  for (const SwapOp& op : ops) {
    auto it = index_.find(op.block_id);
    if (it == index_.end()) return Status::NotFound(BlockName(op.block_id) + " is not registered");
    const bool aligned = reinterpret_cast<uintptr_t>(op.buffer) % kIoAlignment == 0;
    assert(op.buffer != nullptr && aligned && "swap buffers must be 4 KiB-aligned");
    if (op.buffer == nullptr || !aligned) {
      return Status::InvalidArgument(BlockName(op.block_id) +
                                     ": buffer is null or not 4096-aligned (a programmer error)");
    }
    const Block& b = blocks_[it->second];
    if (op.op == IoOp::kRead && b.state == Block::State::kNeverWritten && b.pending_writes == 0) {
      bool written_before = false;  // by an earlier op of this batch
      for (const SwapOp* e = ops.data(); e != &op; ++e) {
        written_before |= e->op == IoOp::kWrite && e->block_id == op.block_id;
      }
      if (!written_before) {
        return Status::FailedPrecondition(BlockName(op.block_id) + " was never written");
      }
    }
  }
  if (inflight_ops_ + ops.size() > slots_.size()) {
    return Status::ResourceExhausted("swap space: " + std::to_string(inflight_ops_) +
                                     " ops in flight + " + std::to_string(ops.size()) + " > " +
                                     std::to_string(slots_.size()));
  }
  for (const SwapOp& op : ops) {
    const size_t slot = free_slots_.back();
    free_slots_.pop_back();
    OpSlot& s = slots_[slot];
    s = OpSlot{};
    s.op = op;
    s.block_index = index_.at(op.block_id);
    s.used = true;
    Block& b = blocks_[s.block_index];
    if (op.op == IoOp::kWrite) ++b.pending_writes;
    s.units_left = b.units.size();
    waiting_.push_back(slot);
  }
  inflight_ops_ += ops.size();
  Pump();
  return Status::OK();
}

// Submission order per block: an op starts only when no earlier op on its block is waiting and
// the block's running ops allow it (reads share, a write runs alone).
void SwapSpace::StartWaitingOps() {
  ++scan_epoch_;
  size_t keep = 0;
  for (size_t slot : waiting_) {
    OpSlot& s = slots_[slot];
    Block& b = blocks_[s.block_index];
    const bool is_write = s.op.op == IoOp::kWrite;
    const bool free = is_write ? (!b.running_write && b.running_reads == 0) : !b.running_write;
    if (b.scan_mark != scan_epoch_ && free) {
      s.started = true;
      if (is_write) {
        b.running_write = true;
      } else {
        ++b.running_reads;
      }
      issuing_.push_back(slot);
    } else {
      b.scan_mark = scan_epoch_;  // later ops on this block wait behind this one
      waiting_[keep++] = slot;
    }
  }
  waiting_.resize(keep);
}

// The first op at or after *cursor in issuing_ going `dir` with units left (the cursor moves
// there); issuing_.size() when there is none.
size_t SwapSpace::NextUnitOp(IoOp dir, size_t* cursor) const {
  for (; *cursor < issuing_.size(); ++*cursor) {
    const OpSlot& s = slots_[issuing_[*cursor]];
    if (s.op.op == dir && s.next_unit < blocks_[s.block_index].units.size()) return *cursor;
  }
  return issuing_.size();
}

// Reads and writes take turns unit by unit (each direction in its ops' start order), so a disk
// that serves both directions at once has both in its queue. Issuing op by op in start order
// sent the units of the ops queued first all together: when the optimizer's read-ahead and
// write-behind fall into step (a tight host budget frees a sub-group's buffer only when its write
// completes), the disk saw runs of reads alone and of writes alone, each slower than both
// directions at once on a disk that serves them in parallel.
void SwapSpace::Pump() {
  StartWaitingOps();
  while (!issuing_.empty() && io_->inflight() < io_->queue_depth()) {
    const size_t room = io_->queue_depth() - io_->inflight();
    batch_.clear();
    size_t read_cursor = 0, write_cursor = 0;
    const auto cursor = [&](IoOp d) { return d == IoOp::kWrite ? &write_cursor : &read_cursor; };
    while (batch_.size() < room) {
      IoOp dir = write_turn_ ? IoOp::kWrite : IoOp::kRead;
      size_t k = NextUnitOp(dir, cursor(dir));
      if (k == issuing_.size()) {  // nothing left this way: the other direction goes on
        dir = dir == IoOp::kWrite ? IoOp::kRead : IoOp::kWrite;
        k = NextUnitOp(dir, cursor(dir));
        if (k == issuing_.size()) break;
      }
      write_turn_ = dir == IoOp::kRead;  // the other direction next, in this call or the next
      const size_t slot = issuing_[k];
      OpSlot& s = slots_[slot];
      const size_t u = s.next_unit++;  // counted as issued; taken back if the submit fails
      const Unit& unit = blocks_[s.block_index].units[u];
      char* data = static_cast<char*>(s.op.buffer) + unit.block_offset;
      batch_.push_back(IoRequest{s.op.op, fds_[unit.file], unit.offset, data, unit.length_bytes,
                                 UnitTag(slot, u)});
    }
    Status st = io_->Submit(batch_);
    if (!st.ok()) {  // the backend queued none of batch_ (all or nothing)
      for (const IoRequest& r : batch_) --slots_[TagSlot(r.user_data)].next_unit;
      FailUnissued(st);
      return;
    }
    for (const IoRequest& r : batch_) {
      // The write's sum of this unit (pair assertion with the verify as a read's unit
      // completes), taken while the disk already works on it: the caller leaves the buffer
      // unchanged until the op completes and the device only reads it, so the sum is of the
      // bytes written. Only Reap, on this thread and after this loop, completes the op.
      const OpSlot& s = slots_[TagSlot(r.user_data)];
      if (s.op.op == IoOp::kWrite) {
        blocks_[s.block_index].pending_sums[TagUnit(r.user_data)] =
            TimedHash(r.buffer, r.length_bytes);
      }
    }
    size_t keep = 0;
    for (size_t slot : issuing_) {
      const OpSlot& s = slots_[slot];
      if (s.next_unit < blocks_[s.block_index].units.size()) issuing_[keep++] = slot;
    }
    issuing_.resize(keep);
  }
}

// Every op with units not yet issued gets `error`; those with nothing left in flight finish
// now, the others when their issued units complete. Exactly one completion per op either way.
void SwapSpace::FailUnissued(const Status& error) {
  auto fail = [&](size_t slot) {
    OpSlot& s = slots_[slot];
    const size_t unissued = blocks_[s.block_index].units.size() - s.next_unit;
    if (s.first_error.ok()) s.first_error = error.WithContext(BlockName(s.op.block_id));
    s.units_left -= unissued;  // next_unit stays: the units that really reached the backend
    if (s.units_left == 0) FinishOp(slot);
  };
  for (size_t slot : issuing_) fail(slot);
  issuing_.clear();
  for (size_t slot : waiting_) fail(slot);
  waiting_.clear();
}

void SwapSpace::FinishOp(size_t slot) {
  OpSlot& s = slots_[slot];
  Block& b = blocks_[s.block_index];
  Status st = std::move(s.first_error);
  // Units that reached the backend: a failed write with none of them leaves the old version.
  const bool issued_any = s.next_unit > 0;
  if (s.started) {
    if (s.op.op == IoOp::kWrite) {
      b.running_write = false;
    } else {
      --b.running_reads;
    }
  }
  if (s.op.op == IoOp::kWrite) {
    --b.pending_writes;
    if (st.ok()) {
      b.state = Block::State::kValid;
      b.unit_sums.swap(b.pending_sums);
    } else if (issued_any) {
      b.state = Block::State::kInvalid;  // some units may have landed: never verify a mix
    }
  } else if (st.ok()) {
    if (b.state == Block::State::kNeverWritten) {
      st = Status::FailedPrecondition(BlockName(b.id) + " was never written");
    } else if (b.state != Block::State::kValid) {
      st = Status::Corruption(BlockName(b.id) + ": its last write failed; no valid version");
    }
    // Units were verified as they completed (VerifyUnit); a mismatch is already in `st`.
  }
  ready_.push_back(SwapCompletion{s.op.user_data, b.id, std::move(st)});
  s.used = false;
  free_slots_.push_back(slot);
}

// A read's unit just landed: its bytes against the sum recorded by the block's last write. Only
// a valid block is checked here; FinishOp fails reads of blocks never written or invalid.
Status SwapSpace::VerifyUnit(const OpSlot& s, size_t u) {
  const Block& b = blocks_[s.block_index];
  if (b.state != Block::State::kValid) return Status::OK();
  const Unit& unit = b.units[u];
  const char* data = static_cast<const char*>(s.op.buffer) + unit.block_offset;
  if (TimedHash(data, unit.length_bytes) == b.unit_sums[u]) return Status::OK();
  return Status::Corruption(BlockName(b.id) + ": checksum mismatch in stripe unit " +
                            std::to_string(u) + " (" + std::to_string(unit.length_bytes) +
                            " bytes from '" + file_paths_[unit.file] + "' offset " +
                            std::to_string(unit.offset) + "): data on disk changed");
}

uint64_t SwapSpace::TimedHash(const void* data, size_t size_bytes) {
  const bool idle = io_->inflight() == 0;
  const auto start = std::chrono::steady_clock::now();
  const uint64_t sum = UnitHash(data, size_bytes);
  const auto ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  checksum_time_.ns += ns;
  checksum_time_.bytes += size_bytes;
  if (idle) checksum_time_.idle_ns += ns;
  return sum;
}

Result<size_t> SwapSpace::Reap(std::span<SwapCompletion> out, size_t min_complete) {
  const size_t want = std::min(min_complete, inflight_ops_);
  do {
    Pump();
    if (io_->inflight() == 0) break;  // nothing issued: every op has finished (see Pump)
    const size_t need = ready_.size() < want ? 1 : 0;
    STRATA_ASSIGN_OR_RETURN(size_t n, io_->Reap(io_out_, need));
    // Refill the queue first: the checksums of the reads that just landed are then computed
    // while the disk works on the next units, not with its queue short of them.
    if (n > 0) Pump();
    for (size_t i = 0; i < n; ++i) {
      const size_t slot = TagSlot(io_out_[i].user_data);
      OpSlot& s = slots_[slot];
      if (!io_out_[i].status.ok() && s.first_error.ok()) {
        s.first_error = io_out_[i].status.WithContext(BlockName(s.op.block_id));
      }
      if (io_out_[i].status.ok() && s.op.op == IoOp::kRead && s.first_error.ok()) {
        s.first_error = VerifyUnit(s, TagUnit(io_out_[i].user_data));
      }
      if (--s.units_left == 0) FinishOp(slot);
    }
    if (n == 0 && need == 0) break;
  } while (ready_.size() < want ||
           ((!issuing_.empty() || !waiting_.empty()) && io_->inflight() < io_->queue_depth()));
  Pump();  // ops unblocked by the last completions start now, not at the next call
  const size_t n = std::min(out.size(), ready_.size());
  for (size_t i = 0; i < n; ++i) out[i] = ready_.pop_front();
  inflight_ops_ -= n;
  return n;
}

Status SwapSpace::Write(uint64_t block_id, const void* buffer) {
  if (inflight_ops_ != 0) return Status::FailedPrecondition("SwapSpace::Write with ops in flight");
  SwapOp op{IoOp::kWrite, block_id, const_cast<void*>(buffer), 0};
  STRATA_RETURN_IF_ERROR(Submit({&op, 1}));
  SwapCompletion c;
  STRATA_RETURN_IF_ERROR(Reap({&c, 1}, 1).status());
  return c.status;
}

Status SwapSpace::Read(uint64_t block_id, void* buffer) {
  if (inflight_ops_ != 0) return Status::FailedPrecondition("SwapSpace::Read with ops in flight");
  SwapOp op{IoOp::kRead, block_id, buffer, 0};
  STRATA_RETURN_IF_ERROR(Submit({&op, 1}));
  SwapCompletion c;
  STRATA_RETURN_IF_ERROR(Reap({&c, 1}, 1).status());
  return c.status;
}

}  // namespace strata::nvme
