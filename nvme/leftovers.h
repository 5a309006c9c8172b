// Files strata leaves on an nvme_path while it runs (swap files, benchmark scratch files), and
// how a later run tells a crashed run's leftovers from files a live process is using.
//
// Every such file is created already holding an exclusive flock (made under a temporary name,
// locked, then renamed into place without replacing anything), and the lock lives as long as
// the owning process keeps its lock descriptor. The kernel drops the lock when the process dies,
// so a strata file nobody holds locked is a leftover of a run that did not close cleanly.
//
// Thread safety: free functions on the filesystem; safe to call from any thread.
#pragma once

#include <string>
#include <vector>

#include "strata/status.h"

namespace strata::nvme {

// Creates `path` (O_RDWR|O_CREAT|O_EXCL|O_CLOEXEC|extra_flags, mode 0600) holding an exclusive
// flock on the returned descriptor. Returns -1 with *err set (EEXIST: `path` exists; EINVAL with
// O_DIRECT: the filesystem has no O_DIRECT).
int CreateLockedFile(const std::string& path, int extra_flags, int* err);

// Whether `name` is one of strata's files: strata-swap-rank<N>.swp or strata-bench-<N>.dat.
bool IsStrataFileName(const std::string& name);

struct StrataFileScan {
  std::vector<std::string> leftovers;  // strata files no live process holds (full paths)
  std::vector<std::string> live;       // strata files a live process holds locked
};

// Lists the strata files directly under `dir`. IOError: the directory cannot be read.
Result<StrataFileScan> ScanStrataFiles(const std::string& dir);

}  // namespace strata::nvme
