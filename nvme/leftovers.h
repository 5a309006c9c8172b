// Files strata leaves on an nvme_path while it runs (swap files, benchmark scratch files, the
// per-run directories of `offloadctl bench store`, `bench engine` and `bench comm`), and how a later run tells a
// crashed run's leftovers from what a live process is using.
//
// Every such file is created already holding an exclusive flock (made under a temporary name,
// locked, then renamed into place without replacing anything), and the lock lives as long as
// the owning process keeps its lock descriptor. Per-run directories are locked the same way
// (flock on the directory) right after they are made. The kernel drops the lock when the
// process dies, so a strata file or directory nobody holds locked is a leftover of a run that
// did not close cleanly. A temporary name (`<name>.creating-<pid>`) is unlocked for a moment while
// it is made: it is a leftover only once its pid is gone.
//
// Only strata's own names are ever considered, and of those only regular files (and, for the
// per-run names, directories) owned by this user: symbolic links, FIFOs, devices and other
// users' files are "foreign". A scan never follows a link, never blocks on a FIFO (opens use
// O_NOFOLLOW|O_NONBLOCK and fstat), and never removes anything foreign.
//
// Thread safety: free functions on the filesystem; safe to call from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata::nvme {

// Name prefixes of the per-run directories (followed by 6 letters or digits, as mkdtemp makes).
inline constexpr char kBenchStoreDirPrefix[] = "strata-bench-store-";
inline constexpr char kBenchCommDirPrefix[] = "strata-bench-comm.";
// `offloadctl bench engine`: one per rank and --nvme-path, holding that rank's swap file (the
// same contents as a bench store directory).
inline constexpr char kBenchEngineDirPrefix[] = "strata-bench-engine-";

// Creates `path` (O_RDWR|O_CREAT|O_EXCL|O_CLOEXEC|extra_flags, mode 0600) holding an exclusive
// flock on the returned descriptor. Returns -1 with *err set (EEXIST: `path` exists; EINVAL with
// O_DIRECT: the filesystem has no O_DIRECT). A failure leaves no file behind, not even the
// temporary one that the kernel creates before refusing O_DIRECT. A concurrent scan's probe of
// the new file's lock (ScanNvmePath, from another rank) is waited out (up to ~2 s), not an error.

int CreateLockedFile(const std::string& path, int extra_flags, int* err);

// A per-run directory, locked (flock) while this handle lives; the owner removes the directory
// before destroying the handle. Move-only.
class RunDir {
 public:
  RunDir() = default;
  RunDir(RunDir&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  RunDir& operator=(RunDir&& o) noexcept;
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;
  ~RunDir();
  const std::string& path() const noexcept { return path_; }

 private:
  friend Result<RunDir> CreateRunDir(const std::string& parent, const char* prefix);
  int fd_ = -1;
  std::string path_;
};

// A directory in an nvme_path where an engine of its own keeps its swap files (the Python
// integrations give each frozen model beside the trained one such an engine: strata-reference,
// strata-teacher, strata-reward-<i>, strata-precompute): "strata-" then lowercase letters,
// digits and '-', and not a per-run directory name. ScanNvmePath looks into it for strata files
// as into the nvme_path itself; the directory is never removed (it is not locked: an engine
// may be about to start there), and a link, a file or another user's entry under such a name is
// passed over as any name strata does not use is.
bool IsEngineDirName(const std::string& name);

// Makes `<parent>/<prefix>XXXXXX` (mode 0700) and locks it. `prefix` is kBenchStoreDirPrefix,
// kBenchEngineDirPrefix or kBenchCommDirPrefix. IOError (errno): the directory cannot be made or locked.
Result<RunDir> CreateRunDir(const std::string& parent, const char* prefix);

// Whether `name` is one of strata's files: strata-swap-rank<N>.swp or strata-bench-<N>.dat, or
// either of them followed by .creating-<pid> (the temporary name of CreateLockedFile).
bool IsStrataFileName(const std::string& name);
// Whether `name` is a per-run directory name (a prefix above and 6 letters or digits).
bool IsRunDirName(const std::string& name);

struct LeftoverEntry {
  std::string path;
  uint64_t size_bytes = 0;  // st_size (0 for a directory)
  uint64_t disk_bytes = 0;  // space it takes on disk (st_blocks * 512): what removing it frees
  bool directory = false;   // a per-run directory (empty once the files listed before it go)
};

struct ForeignEntry {
  std::string path;
  std::string why;  // "a symbolic link", "a FIFO", "owned by uid 65534", ...
};

struct StrataFileScan {
  // Strata files and per-run directories no live process holds, children before their
  // directory. After a scan with remove_leftovers: the ones removed.
  std::vector<LeftoverEntry> leftovers;
  std::vector<std::string> live;      // held locked by a live process
  std::vector<ForeignEntry> foreign;  // strata names that are not this user's plain files
  std::vector<ForeignEntry> failed;   // leftovers that could not be removed (why: errno text)
};

// Lists the strata files directly under `dir` (what a swap space starting there finds).
// IOError: the directory cannot be read.
Result<StrataFileScan> ScanStrataFiles(const std::string& dir);

// ScanStrataFiles that also removes each leftover it finds (the decision and the removal of
// ScanNvmePath with remove_leftovers, so nothing live or foreign is touched): what a swap space
// starting in `dir` does with the scratch of runs that died there. Per-run directories are left
// to `offloadctl clean`. IOError: the directory cannot be read.
Result<StrataFileScan> ReclaimStrataFiles(const std::string& dir);

// Lists the strata files directly under `dir`, the per-run directories there with their
// contents (strata files; rendezvous keys in a bench-comm directory) and the strata files in
// its engine directories (IsEngineDirName). With remove_leftovers,
// removes each leftover while holding its lock (so a live process never loses a file), and a
// per-run directory once it is empty. IOError: `dir` cannot be read.
Result<StrataFileScan> ScanNvmePath(const std::string& dir, bool remove_leftovers);

}  // namespace strata::nvme
