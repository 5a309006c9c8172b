// An LD_PRELOAD shim for command-line fault tests (clean_cli_test.cc): makes the calls a CLI
// test cannot fail otherwise return an error. Each is armed by an environment variable holding
// the errno to fail with; unset, the real call runs.
//   STRATA_FAULT_FDATASYNC=5     fdatasync fails with EIO
//   STRATA_FAULT_FALLOCATE=28    posix_fallocate fails with ENOSPC
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

namespace {
int Armed(const char* var) {
  const char* v = std::getenv(var);
  return v != nullptr ? std::atoi(v) : 0;
}
}  // namespace

extern "C" int fdatasync(int fd) {
  if (const int err = Armed("STRATA_FAULT_FDATASYNC")) {
    errno = err;
    return -1;
  }
  using Fn = int (*)(int);
  static Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "fdatasync"));
  return real(fd);
}

extern "C" int posix_fallocate(int fd, off_t offset, off_t len) {
  if (const int err = Armed("STRATA_FAULT_FALLOCATE")) return err;
  using Fn = int (*)(int, off_t, off_t);
  static Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "posix_fallocate"));
  return real(fd, offset, len);
}

extern "C" int posix_fallocate64(int fd, off_t offset, off_t len) {
  return posix_fallocate(fd, offset, len);
}
