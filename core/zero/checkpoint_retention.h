// Retention of the checkpoints in a directory (SaveOptions::keep_last, include/strata/checkpoint.h)
// and the recycling of the oldest one's rank files by the next save.
//
// A checkpoint leaves the tag namespace in one rename before any of its files is touched, and the
// directory is fsynced right after, so a crash at any point leaves every tag either complete (its
// manifest and files as committed) or absent:
//   retire   <dir>/<old>  ->  <dir>/<old>.tmp  (a name no load reads, what a crashed save of
//            <old> leaves), fsync <dir>, then remove the tree;
//   recycle  <dir>/<old>  ->  <dir>/<new>.tmp/recycled  (inside the new save's scratch directory,
//            which the save removes if it is there at its start), fsync <dir>; each rank then
//            renames recycled/rank<r>.safetensors to <new>.tmp/rank<r>.safetensors and overwrites
//            it in place (StreamWriter::Create with `reuse`), and the rest of recycled/ is removed
//            before the commit renames <new>.tmp.
// `latest`'s tag is never retired or recycled.
//
// The renames and directory fsyncs are durable operations of the CheckpointEnv passed (the save's).
//
// One saver per directory: SaveLock (rank 0 holds it from the save's preparation to its
// commit) refuses a second process saving into the same directory, which would have removed the
// first one's unfinished files (two jobs given one output directory). Under it, every `*.tmp` of
// the directory is a crashed save's (or retire's) leftover, and the save removes them all.
//
// Thread safety: free functions over files; one saver per directory (SaveLock).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/zero/checkpoint_io.h"
#include "strata/status.h"

namespace strata::zero::ckpt {

// An exclusive flock(2) on the directory itself, released when destroyed (or by the process's
// end, a crash included). Acquire: FailedPrecondition naming `dir` when another process holds
// it; InvalidArgument when `dir` exists and is not a directory; IOError with errno otherwise.
// Advisory, and local to a machine on file systems whose flock is (NFS may not carry it).
class SaveLock {
 public:
  static Result<SaveLock> Acquire(const std::string& dir);
  SaveLock(SaveLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  SaveLock& operator=(SaveLock&&) = delete;
  SaveLock(const SaveLock&) = delete;
  ~SaveLock();

 private:
  explicit SaveLock(int fd) : fd_(fd) {}
  int fd_;
};

// Removes every `*.tmp` entry of `dir`: what saves and retires that crashed left (their tags never
// committed). REQUIRES: the caller holds dir's SaveLock. IOError naming the entry.
Status RemoveUnfinishedSaves(const std::string& dir);

// The name of the recycled checkpoint inside a save's `<tag>.tmp/`.
inline constexpr const char* kRecycledName = "recycled";

struct CheckpointEntry {
  std::string tag;
  int64_t committed_ns = 0;  // mtime of its manifest.json: when its save committed
};

// The checkpoints of `dir` (subdirectories with a manifest.json, not ending in ".tmp"), oldest
// first (committed_ns, then tag). IOError naming `dir` when it cannot be listed; a missing `dir`
// has none.
Result<std::vector<CheckpointEntry>> ListCheckpoints(const std::string& dir);

// The tags to remove so that `keep_last` remain once `adding` more are committed (0: none), oldest
// first, never `protect` (latest's tag).
std::vector<std::string> TagsBeyond(const std::vector<CheckpointEntry>& all, size_t keep_last,
                                    size_t adding, const std::string& protect);

// Removes checkpoint `tag` of `dir` (see the header comment). Missing is fine.
Status RetireCheckpoint(const std::string& dir, const std::string& tag,
                        CheckpointEnv& env = DefaultEnv());

// Moves checkpoint `tag` of `dir` into `tmp_dir`/recycled (see the header comment).
// REQUIRES: tmp_dir exists inside dir and holds no `recycled`.
Status RecycleCheckpoint(const std::string& dir, const std::string& tag, const std::string& tmp_dir,
                         CheckpointEnv& env = DefaultEnv());

// The checkpoint whose files a save into `dir` with keep_last (> 0) and recycle_files would take
// (the oldest beyond keep_last once it commits, never `latest`'s); "" when none would be.
Result<std::string> RecycleCandidate(const std::string& dir, size_t keep_last);

// A save's first step with SaveOptions keep_last > 0 and recycle_files: when committing one more
// checkpoint will put the oldest beyond keep_last, moves it into `tmp_dir` (RecycleCheckpoint)
// for its rank files to be reused. `latest`'s tag is never taken. OK when there is none to take.
Status RecycleOldest(const std::string& dir, size_t keep_last, const std::string& tmp_dir,
                     CheckpointEnv& env = DefaultEnv());

// A save's last step with keep_last > 0: retires the checkpoints beyond the newest keep_last,
// never `committed` (the tag just saved, now `latest`).
Status RetireBeyond(const std::string& dir, size_t keep_last, const std::string& committed,
                    CheckpointEnv& env = DefaultEnv());

}  // namespace strata::zero::ckpt
