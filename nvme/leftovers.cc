#include "nvme/leftovers.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

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
}  // namespace

bool IsStrataFileName(const std::string& name) {
  return Matches(name, "strata-swap-rank", ".swp") || Matches(name, "strata-bench-", ".dat");
}

int CreateLockedFile(const std::string& path, int extra_flags, int* err) {
  // The temporary name does not match IsStrataFileName, so no scan sees the file unlocked.
  const std::string tmp = path + ".creating-" + std::to_string(getpid());
  int fd = open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | extra_flags, 0600);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0 ||
      renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) != 0) {
    *err = errno;
    unlink(tmp.c_str());
    close(fd);
    return -1;
  }
  return fd;
}

Result<StrataFileScan> ScanStrataFiles(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return Status::FromErrno(errno, "list nvme_path", dir);
  StrataFileScan scan;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (!IsStrataFileName(name)) continue;
    const std::string path = dir + "/" + name;
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;  // removed meanwhile
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      scan.live.push_back(path);
    } else {
      // Locked by us now: still the file at that name (not unlinked by its owner meanwhile)?
      struct stat a {
      }, b{};
      if (fstat(fd, &a) == 0 && stat(path.c_str(), &b) == 0 && a.st_ino == b.st_ino &&
          a.st_dev == b.st_dev) {
        scan.leftovers.push_back(path);
      }
    }
    close(fd);
  }
  closedir(d);
  return scan;
}

}  // namespace strata::nvme
