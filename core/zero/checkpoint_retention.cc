// Checkpoint retention and recycling (see checkpoint_retention.h).
#include "core/zero/checkpoint_retention.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <filesystem>

#include "core/zero/checkpoint_format.h"

namespace strata::zero::ckpt {

Result<SaveLock> SaveLock::Acquire(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOTDIR) {
      return Status::InvalidArgument("checkpoint directory '" + dir + "' is not a directory");
    }
    return Status::IOError("open checkpoint directory '" + dir + "': " + std::strerror(err));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return Status::FailedPrecondition(
          "checkpoint directory '" + dir +
          "' is being saved into by another process (one output directory per run)");
    }
    return Status::IOError("lock checkpoint directory '" + dir + "': " + std::strerror(err));
  }
  return SaveLock(fd);
}

SaveLock::~SaveLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

Status RemoveUnfinishedSaves(const std::string& dir) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return Status::IOError("list " + dir + ": " + ec.message());
  std::vector<std::string> garbage;
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0) {
      garbage.push_back(entry.path().string());
    }
  }
  for (const std::string& path : garbage) STRATA_RETURN_IF_ERROR(RemoveTree(path));
  return Status::OK();
}

Result<std::vector<CheckpointEntry>> ListCheckpoints(const std::string& dir) {
  std::vector<CheckpointEntry> out;
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) return out;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return Status::IOError("list checkpoints in " + dir + ": " + ec.message());
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    if (name.size() >= 4 && name.compare(name.size() - 4, 4, ".tmp") == 0) continue;
    if (!entry.is_directory(ec)) continue;
    struct stat st {};
    const std::string manifest = entry.path().string() + "/" + kManifestName;
    if (::stat(manifest.c_str(), &st) != 0) continue;
    out.push_back({name, int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec});
  }
  std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    return a.committed_ns != b.committed_ns ? a.committed_ns < b.committed_ns : a.tag < b.tag;
  });
  return out;
}

std::vector<std::string> TagsBeyond(const std::vector<CheckpointEntry>& all, size_t keep_last,
                                    size_t adding, const std::string& protect) {
  std::vector<std::string> out;
  if (keep_last == 0 || all.size() + adding <= keep_last) return out;
  size_t excess = all.size() + adding - keep_last;
  for (const CheckpointEntry& c : all) {
    if (excess == 0) break;
    if (c.tag == protect) continue;
    out.push_back(c.tag);
    --excess;
  }
  return out;
}

Status RetireCheckpoint(const std::string& dir, const std::string& tag, CheckpointEnv& env) {
  const std::string from = dir + "/" + tag, to = from + ".tmp";
  if (!PathExists(from)) return Status::OK();
  STRATA_RETURN_IF_ERROR(RemoveTree(to));  // a crashed save's leftover would block the rename
  STRATA_RETURN_IF_ERROR(RenamePath(from, to, env));
  STRATA_RETURN_IF_ERROR(FsyncDir(dir, env));
  return RemoveTree(to);
}

Status RecycleCheckpoint(const std::string& dir, const std::string& tag, const std::string& tmp_dir,
                         CheckpointEnv& env) {
  STRATA_RETURN_IF_ERROR(RenamePath(dir + "/" + tag, tmp_dir + "/" + kRecycledName, env));
  return FsyncDir(dir, env);
}

Result<std::string> RecycleCandidate(const std::string& dir, size_t keep_last) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<CheckpointEntry> all, ListCheckpoints(dir));
  auto latest = ResolveTag(dir, "");
  // An unreadable `latest` might name any of them: take none (the save then writes new files).
  if (!latest.ok() && latest.status().code() != Status::Code::kNotFound) return std::string();
  const std::vector<std::string> beyond =
      TagsBeyond(all, keep_last, 1, latest.ok() ? *latest : std::string());
  return beyond.empty() ? std::string() : beyond.front();
}

Status RecycleOldest(const std::string& dir, size_t keep_last, const std::string& tmp_dir,
                     CheckpointEnv& env) {
  STRATA_ASSIGN_OR_RETURN(const std::string tag, RecycleCandidate(dir, keep_last));
  return tag.empty() ? Status::OK() : RecycleCheckpoint(dir, tag, tmp_dir, env);
}

Status RetireBeyond(const std::string& dir, size_t keep_last, const std::string& committed,
                    CheckpointEnv& env) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<CheckpointEntry> all, ListCheckpoints(dir));
  for (const std::string& tag : TagsBeyond(all, keep_last, 0, committed)) {
    STRATA_RETURN_IF_ERROR(RetireCheckpoint(dir, tag, env));
  }
  return Status::OK();
}

}  // namespace strata::zero::ckpt
