// SwapSpace: the NVMe home of model-state blocks, one preallocated O_DIRECT file per nvme_path
// per rank, with a static extent layout and an xxHash checksum per stripe unit of each block.
//
// Layout: blocks are known when the space is created. Each block's extent (its size rounded up
// to 4 KiB) is cut into stripe units; unit k of a block goes to file (first + k) mod #paths, so a
// block larger than one unit is spread over every path and several SSDs add their bandwidth, and
// the units become independent IOs that keep the queue full. Files are preallocated (fallocate)
// at Create: a disk too small fails there, before training starts.
//
// Integrity: every write records XXH3-64 of each stripe unit's bytes (nvme/unit_hash.h; hashed
// right after the unit was submitted, while the disk works on it; the block's new sums replace
// the old ones once all of its units completed); every read verifies each unit as it completes,
// after the queue was refilled with the next units. Hashing unit by unit, off the path from one
// submission to the next, keeps the queue full: a whole-block hash (50 MB: milliseconds) on the
// owner thread let every IO in flight finish meanwhile and the disk idle. A flipped byte on disk is
// Corruption naming the block and the unit, never silently wrong data. A write that fails in any
// unit marks the block invalid (its extent may be half-written); reading it is Corruption until it
// is written successfully again.
//
// Lifecycle: Create removes the strata files left behind on its paths by runs that did not close
// cleanly (every rank's swap file, benchmark scratch files: the files no live process holds
// locked, as nvme/leftovers.h and `offloadctl clean` decide; never reused, each named in one
// line on stderr and in note()), so a crashed run's script simply runs again. Files a live
// process holds (another rank, another job) are left alone; this rank's own held by one is
// refused. Anything else under a strata name (a symbolic link, FIFO, device, directory, another
// user's file) is never followed, opened for IO or removed; the one in the way of this rank's
// file is refused by name. A failed Create leaves nothing behind. Close (or the destructor) waits for IO in flight and removes the
// files.
//
// Async use: Submit a batch of block reads/writes, Reap their completions (one per op, after all
// of its units finished and, for reads, the checksum was verified). Read/Write are the
// synchronous forms.
//
// Ordering: ops on the same block apply in submission order. An op waits (unissued) while an
// earlier op on its block is still running, except that reads run alongside reads; so a read
// submitted after a write returns the written version (write-behind then read-ahead), and two
// writes never interleave their units. Ops on different blocks run in parallel; their units go
// out with reads and writes taking turns (each direction in start order), so the disk has both
// in its queue whenever both are waiting.
//
// Errors: an op that was accepted always ends in exactly one completion. A backend that refuses
// to submit (a hard io_uring error) fails the units not yet issued, and their ops complete with
// that error; a write none of whose units went out leaves the block's previous version valid.
//
// Thread safety: not thread-safe; one owner thread drives it (and its IoBackend, which it uses
// exclusively while it has IO in flight).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "nvme/bounded_queue.h"
#include "strata/io.h"
#include "strata/status.h"

namespace strata::nvme {

struct SwapBlockSpec {
  uint64_t id = 0;
  size_t size_bytes = 0;  // > 0; the extent is this rounded up to 4 KiB
};

struct SwapSpaceOptions {
  // Directories (DeepSpeed's nvme_path, one per SSD). Each gets one file per rank.
  std::vector<std::string> paths;
  int rank = 0;
  // Bytes per stripe unit: a multiple of 4 KiB. Larger units mean fewer IOs, smaller ones spread
  // a block over more paths and keep more IOs in flight. 1 MiB: large enough for O_DIRECT IO at
  // queue depth 32 to reach a typical disk's full speed.
  size_t stripe_unit_bytes = size_t{1} << 20;
  // Filesystems without O_DIRECT (tmpfs) are refused unless this allows buffered IO there
  // (page cache: extra copies and memory the budget does not see).
  bool allow_buffered_io = false;
  // Block ops in flight at once (each may span several stripe units).
  size_t max_inflight_ops = 64;
};

// The swap file strata uses for `rank` under `dir`.
std::string SwapFilePath(const std::string& dir, int rank);

struct SwapOp {
  IoOp op = IoOp::kRead;
  uint64_t block_id = 0;
  // 4 KiB-aligned, at least ExtentBytes(block_id) long; caller-owned until the op is reaped.
  void* buffer = nullptr;
  uint64_t user_data = 0;
};

struct SwapCompletion {
  uint64_t user_data = 0;
  uint64_t block_id = 0;
  // OK; IOError (errno, file, block); Corruption (checksum mismatch, or a block whose last write
  // failed); FailedPrecondition (reading a block never written).
  Status status;
};

class SwapSpace {
 public:
  // Creates and preallocates the files. `io` is not owned, outlives the space, and is used only
  // by it while ops are in flight.
  // InvalidArgument: no paths, duplicate or empty blocks, bad stripe unit, a filesystem without
  //   O_DIRECT and allow_buffered_io unset. NotFound: a path does not exist.
  // IOError: a path is not a writable directory, or preallocation failed (ENOSPC names the path
  //   and the bytes needed; the free-space check before it, or IoBackend::Allocate after it).
  //   FailedPrecondition: files from an earlier run are in the way (all named), a live process of
  //   this rank uses the path, or this rank's file name is taken by something that is not this
  //   user's regular file (named, with what it is).
  static Result<std::unique_ptr<SwapSpace>> Create(const SwapSpaceOptions& options,
                                                   std::span<const SwapBlockSpec> blocks,
                                                   IoBackend* io);
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Waits for IO in flight (through Reap errors) and removes the files. Idempotent.
  // IOError: unlink failed, or the backend could not drain its IO (then the files are kept open
  // and on disk, never closed under IO in flight; a later Close or the destructor tries again).
  Status Close();

  // Queues block ops. All or nothing. NotFound: unknown block. InvalidArgument: misaligned or
  // null buffer (a programmer error: also asserted in debug builds). FailedPrecondition: a read
  // of a block never written (nor written by an op still pending). ResourceExhausted: more than
  // max_inflight_ops in flight. Once accepted (OK), IO failures arrive in the completions.
  Status Submit(std::span<const SwapOp> ops);
  // Moves up to out.size() completions into out, waiting for at least min(min_complete,
  // inflight_ops()). Returns how many.
  Result<size_t> Reap(std::span<SwapCompletion> out, size_t min_complete);
  size_t inflight_ops() const noexcept { return inflight_ops_; }

  // Synchronous forms. FailedPrecondition when other ops are in flight.
  Status Write(uint64_t block_id, const void* buffer);
  Status Read(uint64_t block_id, void* buffer);

  // Extent bytes of a block (size rounded up to 4 KiB); 0 when unknown.
  size_t ExtentBytes(uint64_t block_id) const;
  // Where a block's bytes live: (file, offset, length) per stripe unit, in block order.
  struct Piece {
    std::string file;
    uint64_t offset;
    size_t length_bytes;
  };
  std::vector<Piece> Layout(uint64_t block_id) const;
  const std::vector<std::string>& files() const noexcept { return file_paths_; }
  uint64_t file_bytes(size_t file_index) const { return file_sizes_.at(file_index); }
  // What Create reclaimed (files left by runs that did not close cleanly) and what degraded
  // (buffered IO on a path without O_DIRECT), one line each joined by "; "; empty otherwise.
  const std::string& note() const noexcept { return note_; }

  // What the checksums cost the thread that drives the space (the XXH3 of each unit written,
  // taken after its submit; each unit read verified as it lands, after the queue is refilled),
  // since the last call, which resets it. `idle_ns` is the part of `ns` spent with no IO in the
  // backend: time in which the disk waited for the hashing.
  struct ChecksumTime {
    uint64_t ns = 0;
    uint64_t bytes = 0;
    uint64_t idle_ns = 0;
  };
  ChecksumTime TakeChecksumTime() { return std::exchange(checksum_time_, ChecksumTime{}); }

 private:
  struct Unit {
    uint32_t file;
    uint64_t offset;
    size_t length_bytes;
    size_t block_offset;  // where the unit starts in the block's buffer
  };
  struct Block {
    uint64_t id;
    size_t extent_bytes;
    std::vector<Unit> units;
    enum class State : uint8_t { kNeverWritten, kValid, kInvalid } state = State::kNeverWritten;
    // XXH3-64 per unit: of the valid version, and of the write running now (one at a time per
    // block), swapped in when that write succeeds. Sized at Create.
    std::vector<uint64_t> unit_sums, pending_sums;
    // Ordering (see the header comment): ops running on the block, writes pending on it.
    uint32_t running_reads = 0;
    bool running_write = false;
    uint32_t pending_writes = 0;
    uint64_t scan_mark = 0;  // == scan_epoch_: an earlier op on the block is still waiting
  };
  struct OpSlot {
    SwapOp op;
    size_t block_index = 0;
    size_t next_unit = 0;   // units issued to the backend so far
    size_t units_left = 0;  // units not yet completed (issued or not)
    Status first_error;
    bool started = false;  // counted in the block's running_* (its units may be issued)
    bool used = false;
  };

  SwapSpace(SwapSpaceOptions options, IoBackend* io) : options_(std::move(options)), io_(io) {}
  Status CheckPaths();
  Status CheckFreeSpace() const;
  Status OpenFiles();
  Status Preallocate();
  // Starts waiting ops their block allows, then submits their units while the backend has
  // room. A refused submit fails every unit not yet issued (FailUnissued).
  void Pump();
  size_t NextUnitOp(IoOp dir, size_t* cursor) const;
  void StartWaitingOps();
  void FailUnissued(const Status& error);
  void FinishOp(size_t slot);
  Status VerifyUnit(const OpSlot& s, size_t unit);
  uint64_t TimedHash(const void* data, size_t size_bytes);  // UnitHash, counted in checksum_time_

  SwapSpaceOptions options_;
  IoBackend* io_;
  std::vector<std::string> file_paths_;
  std::vector<int> fds_;       // IO descriptors (O_DIRECT unless buffered IO was allowed)
  std::vector<int> lock_fds_;  // hold each file's flock (leftovers.h) until Close
  std::vector<uint64_t> file_sizes_;
  std::vector<Block> blocks_;
  std::unordered_map<uint64_t, size_t> index_;
  // Sized at Create (max_inflight_ops, the backend's queue depth): the IO path allocates nothing.
  std::vector<OpSlot> slots_;
  std::vector<size_t> free_slots_;
  std::vector<size_t> waiting_;  // ops not started yet, in submission order
  std::vector<size_t> issuing_;  // started ops with units not yet issued, in start order
  std::vector<IoRequest> batch_;
  bool write_turn_ = false;  // Pump's next unit goes this way (alternating, across calls too)
  BoundedQueue<SwapCompletion> ready_;
  std::vector<IoCompletion> io_out_;
  uint64_t scan_epoch_ = 0;
  size_t inflight_ops_ = 0;
  bool closed_ = false;
  std::string note_;
  ChecksumTime checksum_time_;
};

}  // namespace strata::nvme
