#include "nvme/leftovers.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace strata::nvme {

namespace {

bool AllDigits(const std::string& s, size_t begin, size_t end) {
  if (begin >= end) return false;
  for (size_t i = begin; i < end; ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
  }
  return true;
}

bool Matches(const std::string& name, const char* prefix, const char* suffix) {
  const size_t p = std::strlen(prefix), s = std::strlen(suffix);
  return name.size() > p + s && name.compare(0, p, prefix) == 0 &&
         name.compare(name.size() - s, s, suffix) == 0 && AllDigits(name, p, name.size() - s);
}

bool IsFinalName(const std::string& name) {
  return Matches(name, "strata-swap-rank", ".swp") || Matches(name, "strata-bench-", ".dat");
}

constexpr char kCreating[] = ".creating-";

// The pid in "<final name>.creating-<pid>"; 0 for any other name.
pid_t CreatingPid(const std::string& name) {
  const size_t at = name.rfind(kCreating);
  if (at == std::string::npos || !IsFinalName(name.substr(0, at))) return 0;
  const size_t b = at + std::strlen(kCreating);
  if (!AllDigits(name, b, name.size()) || name.size() - b > 9) return 0;
  return static_cast<pid_t>(std::stol(name.substr(b)));
}

// A key of cpu::FileKvStore (letters, digits, '_', '-', '%'-escapes, and '~' before the SHA-256
// of a long key), or its temp file "<key>.tmp.<pid>.<seq>".
bool IsRendezvousKeyName(const std::string& name) {
  size_t end = name.size();
  const size_t tmp = name.find(".tmp.");
  if (tmp != std::string::npos) {
    const size_t dot = name.find('.', tmp + 5);
    if (dot == std::string::npos || !AllDigits(name, tmp + 5, dot) ||
        !AllDigits(name, dot + 1, name.size())) {
      return false;
    }
    end = tmp;
  }
  if (end == 0) return false;
  for (size_t i = 0; i < end; ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (!std::isalnum(c) && c != '_' && c != '-' && c != '%' && c != '~') return false;
  }
  return true;
}

std::string KindOf(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISREG(mode)) return "a regular file";
  return "not a regular file";
}

bool SameFile(const struct stat& a, const struct stat& b) {
  return a.st_ino == b.st_ino && a.st_dev == b.st_dev;
}

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

enum class Contents : uint8_t { kTop, kTopWithRunDirs, kStoreRun, kCommRun };
enum class Seen : uint8_t { kGone, kLeftover, kOther };

// One scan: visits strata names under a directory, classifies each (leftover, live, foreign),
// and with `remove` unlinks leftovers while holding their lock.
class Scanner {
 public:
  Scanner(bool remove, StrataFileScan* out) : remove_(remove), uid_(geteuid()), out_(out) {}

  // *empty_after: every entry of the directory is a leftover (removed, or removable).
  Status ScanDir(int dirfd, const std::string& path, Contents contents, bool* empty_after);

 private:
  Seen Foreign(const std::string& path, std::string why) {
    out_->foreign.push_back({path, std::move(why)});
    return Seen::kOther;
  }
  Seen Failed(const std::string& path, int err) {
    out_->failed.push_back({path, std::strerror(err)});
    return Seen::kOther;
  }
  Seen Live(const std::string& path) {
    out_->live.push_back(path);
    return Seen::kOther;
  }
  Seen Visit(int dirfd, const std::string& dir, const std::string& name, Contents contents);
  Seen VisitFile(int dirfd, const std::string& path, const std::string& name,
                 const struct stat& st);
  Seen VisitRunDir(int dirfd, const std::string& path, const std::string& name,
                   const struct stat& st);
  Seen VisitEngineDir(int dirfd, const std::string& path, const std::string& name);

  const bool remove_;
  const uid_t uid_;
  StrataFileScan* out_;
};

Status Scanner::ScanDir(int dirfd, const std::string& path, Contents contents, bool* empty_after) {
  // Names first, then visits: removing entries while readdir walks the directory is allowed but
  // leaves it unspecified which entries the walk still returns.
  const int list_fd = fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
  DIR* d = list_fd >= 0 ? fdopendir(list_fd) : nullptr;
  if (d == nullptr) {
    const int err = errno;
    if (list_fd >= 0) close(list_fd);
    return Status::FromErrno(err, "list nvme_path", path);
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  bool all = true;
  for (const std::string& name : names) {
    if (Visit(dirfd, path, name, contents) == Seen::kOther) all = false;
  }
  *empty_after = all;
  return Status::OK();
}

Seen Scanner::Visit(int dirfd, const std::string& dir, const std::string& name, Contents contents) {
  const bool top = contents == Contents::kTop || contents == Contents::kTopWithRunDirs;
  const bool file_name =
      IsStrataFileName(name) || (contents == Contents::kCommRun && IsRendezvousKeyName(name));
  const bool dir_name = contents == Contents::kTopWithRunDirs && IsRunDirName(name);
  const std::string path = dir + "/" + name;
  if (contents == Contents::kTopWithRunDirs && IsEngineDirName(name)) {
    return VisitEngineDir(dirfd, path, name);
  }
  if (!file_name && !dir_name) {
    // The user's own files next to strata's are none of our business; inside a per-run
    // directory an unknown name keeps the directory (and is said).
    return top ? Seen::kGone : Foreign(path, "a name strata does not use");
  }
  struct stat st {};
  if (fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return errno == ENOENT ? Seen::kGone : Failed(path, errno);
  }
  if (S_ISLNK(st.st_mode)) return Foreign(path, KindOf(st.st_mode));
  if (st.st_uid != uid_) {
    return Foreign(path, KindOf(st.st_mode) + " owned by uid " + std::to_string(st.st_uid) +
                             ", not by this user (uid " + std::to_string(uid_) + ")");
  }
  if (dir_name) {
    if (!S_ISDIR(st.st_mode)) return Foreign(path, KindOf(st.st_mode));
    return VisitRunDir(dirfd, path, name, st);
  }
  if (!S_ISREG(st.st_mode)) return Foreign(path, KindOf(st.st_mode));
  return VisitFile(dirfd, path, name, st);
}

Seen Scanner::VisitFile(int dirfd, const std::string& path, const std::string& name,
                        const struct stat& st) {
  // O_NONBLOCK: a FIFO put here since the fstatat must not block the open; O_NOFOLLOW: nor may
  // a symbolic link put here since be followed.
  Fd f{openat(dirfd, name.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC)};
  if (f.fd < 0) {
    if (errno == ENOENT) return Seen::kGone;
    if (errno == ELOOP) return Foreign(path, "a symbolic link");
    return Foreign(path, std::string("cannot be opened (") + std::strerror(errno) + ")");
  }
  struct stat now {};
  if (fstat(f.fd, &now) != 0) return Failed(path, errno);
  if (!S_ISREG(now.st_mode)) return Foreign(path, KindOf(now.st_mode));
  if (!SameFile(now, st)) return Seen::kOther;  // replaced meanwhile: the next scan looks again
  if (flock(f.fd, LOCK_EX | LOCK_NB) != 0) return Live(path);
  // Locked by us now: still the file at that name (not unlinked by its owner meanwhile)?
  struct stat again {};
  if (fstatat(dirfd, name.c_str(), &again, AT_SYMLINK_NOFOLLOW) != 0 || !SameFile(again, now)) {
    return Seen::kGone;
  }
  if (const pid_t pid = CreatingPid(name); pid > 0 && (kill(pid, 0) == 0 || errno == EPERM)) {
    return Live(path);  // being made right now (locked a moment later)
  }
  LeftoverEntry e{path, static_cast<uint64_t>(now.st_size),
                  static_cast<uint64_t>(now.st_blocks) * 512, false};
  // Unlinked while we hold the lock: no live process can own this file.
  if (remove_ && unlinkat(dirfd, name.c_str(), 0) != 0) return Failed(path, errno);
  out_->leftovers.push_back(std::move(e));
  return Seen::kLeftover;
}

Seen Scanner::VisitEngineDir(int dirfd, const std::string& path, const std::string& name) {
  Fd f{openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)};
  struct stat st {};
  if (f.fd < 0 || fstat(f.fd, &st) != 0 || st.st_uid != uid_) {
    return Seen::kOther;  // not a directory of this user's (a link, a file): not looked into
  }
  bool empty_after = false;
  if (Status s = ScanDir(f.fd, path, Contents::kTop, &empty_after); !s.ok()) {
    out_->failed.push_back({path, std::string(s.message())});
  }
  return Seen::kOther;  // the directory stays
}

Seen Scanner::VisitRunDir(int dirfd, const std::string& path, const std::string& name,
                          const struct stat& st) {
  Fd f{openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)};
  if (f.fd < 0) {
    if (errno == ENOENT) return Seen::kGone;
    if (errno == ELOOP || errno == ENOTDIR) return Seen::kOther;  // replaced meanwhile
    return Foreign(path, std::string("cannot be opened (") + std::strerror(errno) + ")");
  }
  struct stat now {};
  if (fstat(f.fd, &now) != 0) return Failed(path, errno);
  if (!SameFile(now, st)) return Seen::kOther;
  if (flock(f.fd, LOCK_EX | LOCK_NB) != 0) return Live(path);
  struct stat again {};
  if (fstatat(dirfd, name.c_str(), &again, AT_SYMLINK_NOFOLLOW) != 0 || !SameFile(again, now)) {
    return Seen::kGone;
  }
  const bool store_run =
      name.compare(0, std::strlen(kBenchStoreDirPrefix), kBenchStoreDirPrefix) == 0 ||
      name.compare(0, std::strlen(kBenchEngineDirPrefix), kBenchEngineDirPrefix) == 0;
  const Contents inside = store_run ? Contents::kStoreRun : Contents::kCommRun;
  bool empty_after = false;
  Status s = ScanDir(f.fd, path, inside, &empty_after);
  if (!s.ok()) {
    out_->failed.push_back({path, std::string(s.message())});
    return Seen::kOther;
  }
  if (!empty_after) return Seen::kOther;  // something in it stays: so does the directory
  LeftoverEntry e{path, 0, static_cast<uint64_t>(now.st_blocks) * 512, true};
  if (remove_ && unlinkat(dirfd, name.c_str(), AT_REMOVEDIR) != 0) return Failed(path, errno);
  out_->leftovers.push_back(std::move(e));
  return Seen::kLeftover;
}

Result<StrataFileScan> Scan(const std::string& dir, Contents contents, bool remove) {
  Fd f{open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (f.fd < 0) return Status::FromErrno(errno, "list nvme_path", dir);
  StrataFileScan scan;
  Scanner scanner(remove, &scan);
  bool empty_after = false;
  STRATA_RETURN_IF_ERROR(scanner.ScanDir(f.fd, dir, contents, &empty_after));
  return scan;
}

}  // namespace

bool IsStrataFileName(const std::string& name) {
  return IsFinalName(name) || CreatingPid(name) > 0;
}

bool IsRunDirName(const std::string& name) {
  for (const char* prefix : {kBenchStoreDirPrefix, kBenchEngineDirPrefix, kBenchCommDirPrefix}) {
    const size_t p = std::strlen(prefix);
    if (name.size() != p + 6 || name.compare(0, p, prefix) != 0) continue;
    bool ok = true;
    for (size_t i = p; i < name.size(); ++i) {
      ok &= std::isalnum(static_cast<unsigned char>(name[i])) != 0;
    }
    if (ok) return true;
  }
  return false;
}

bool IsEngineDirName(const std::string& name) {
  constexpr char kPrefix[] = "strata-";
  const size_t p = std::strlen(kPrefix);
  if (name.size() <= p || name.compare(0, p, kPrefix) != 0 || IsRunDirName(name)) return false;
  for (size_t i = p; i < name.size(); ++i) {
    const char c = name[i];
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return true;
}

// 1 ms apart: a scan holds a file's lock for a fstatat and a kill(pid, 0).
constexpr int kProbeWaitTries = 2000;

namespace {

// One attempt of CreateLockedFile.
int CreateLockedOnce(const std::string& path, const std::string& tmp, int extra_flags, int* err) {
  int fd = open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | extra_flags, 0600);
  if (fd < 0) {
    *err = errno;
    // O_EXCL: anything but EEXIST means no file was there before this call. A filesystem
    // without O_DIRECT refuses it (EINVAL) only after creating the file: remove it again.
    if (*err != EEXIST) unlink(tmp.c_str());
    return -1;
  }
  // O_EXCL made the file ours, so a lock held on it is a scan's probe (ScanNvmePath takes each
  // file's lock for a moment to tell live from leftover; a rank starting beside another rank in
  // the same nvme_path scans it): wait that out, bounded, rather than fail the create (seen:
  // EngineMatrix at 4 ranks, "create swap file ... errno 11" once in a few runs).
  int locked = flock(fd, LOCK_EX | LOCK_NB);
  for (int tries = 0; locked != 0 && errno == EWOULDBLOCK && tries < kProbeWaitTries; ++tries) {
    usleep(1000);
    locked = flock(fd, LOCK_EX | LOCK_NB);
  }
  if (locked != 0 ||
      renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) != 0) {
    *err = errno;
    unlink(tmp.c_str());
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

int CreateLockedFile(const std::string& path, int extra_flags, int* err) {
  // The temporary name is unlocked for a moment; scans take it for a leftover only once its
  // pid is gone. A scan that cannot see this pid (another pid namespace sharing the directory)
  // may remove it in that moment: the rename then finds no file (ENOENT), and it is made again.
  const std::string tmp = path + kCreating + std::to_string(getpid());
  constexpr int kAttempts = 4;
  int fd = -1;
  for (int attempt = 0; attempt < kAttempts && fd < 0; ++attempt) {
    fd = CreateLockedOnce(path, tmp, extra_flags, err);
    if (fd < 0 && *err != ENOENT) break;
  }
  return fd;
}

RunDir& RunDir::operator=(RunDir&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) close(fd_);
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

RunDir::~RunDir() {
  if (fd_ >= 0) close(fd_);
}

Result<RunDir> CreateRunDir(const std::string& parent, const char* prefix) {
  // A concurrent `offloadctl clean` may take the new, empty, not yet locked directory for a
  // leftover and remove it: then the lock finds it gone (or clean holding it), and another is
  // made. Bounded: that race needs a clean at exactly that instant.
  constexpr int kAttempts = 8;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    std::string tmpl = parent + "/" + prefix + "XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) return Status::FromErrno(errno, "mkdtemp in", parent);
    const int fd = open(tmpl.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) {
      struct stat a {
      }, b{};
      if (flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &a) == 0 && lstat(tmpl.c_str(), &b) == 0 &&
          SameFile(a, b)) {
        RunDir d;
        d.fd_ = fd;
        d.path_ = std::move(tmpl);
        return d;
      }
      close(fd);
    }
    rmdir(tmpl.c_str());
  }
  return Status::IOError("could not make a locked per-run directory in '" + parent + "' in " +
                         std::to_string(kAttempts) + " attempts");
}

Result<StrataFileScan> ScanStrataFiles(const std::string& dir) {
  return Scan(dir, Contents::kTop, /*remove=*/false);
}

Result<StrataFileScan> ReclaimStrataFiles(const std::string& dir) {
  return Scan(dir, Contents::kTop, /*remove=*/true);
}

Result<StrataFileScan> ScanNvmePath(const std::string& dir, bool remove_leftovers) {
  return Scan(dir, Contents::kTopWithRunDirs, remove_leftovers);
}

}  // namespace strata::nvme
