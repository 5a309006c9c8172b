// io_uring refused -> posix fallback, for real: a forked child installs a seccomp filter that
// makes io_uring_setup fail with EPERM (what container runtimes do), then opens a backend.
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>

#include <gtest/gtest.h>

#include "strata/io.h"
#include "tests/io_test_util.h"

namespace strata {
namespace {

bool RefuseIoUring() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

[[noreturn]] void Fail(const std::string& why) {
  std::fprintf(stderr, "FAILED: %s\n", why.c_str());
  std::_Exit(1);
}

void ChildOpensPosixWhenIoUringIsRefused(const std::string& file) {
  if (!RefuseIoUring()) Fail("could not install the seccomp filter");
  IoBackendOptions o;
  o.kind = IoBackendKind::kIoUring;
  auto forced = OpenIoBackend(o);
  if (forced.ok() || !forced.status().IsUnavailable()) {
    Fail("kIoUring under seccomp: expected Unavailable, got " + forced.status().ToString());
  }
  o.kind = IoBackendKind::kAuto;
  auto b = OpenIoBackend(o);
  if (!b.ok()) Fail("kAuto: " + b.status().ToString());
  if ((*b)->kind() != IoBackendKind::kPosix) Fail("kAuto did not fall back to posix");
  const std::string note = (*b)->note();
  if (note.find("io_uring unavailable") == std::string::npos ||
      note.find("errno 1") == std::string::npos) {
    Fail("fallback note lacks the reason: " + note);
  }
  int fd = testing::OpenDirect(file, 1 << 20);
  testing::AlignedBuf src = testing::MakeAligned(1 << 20), dst = testing::MakeAligned(1 << 20);
  testing::FillPattern(src.get(), 1 << 20, 5);
  Status s = (*b)->Write(fd, 0, src.get(), 1 << 20);
  if (s.ok()) s = (*b)->Read(fd, 0, dst.get(), 1 << 20);
  if (!s.ok()) Fail("posix round trip: " + s.ToString());
  if (std::memcmp(src.get(), dst.get(), 1 << 20) != 0) Fail("posix round trip: data differs");
  std::fprintf(stderr, "fallback ok: %s\n", note.c_str());
  std::_Exit(0);
}

TEST(IoFallback, IoUringRefusedBySeccompFallsBackToPosixWithReason) {
  testing::TempDir dir("fallback");
  std::string file = dir.File("f");
  EXPECT_EXIT(ChildOpensPosixWhenIoUringIsRefused(file), ::testing::ExitedWithCode(0),
              "fallback ok: io_uring unavailable");
}

}  // namespace
}  // namespace strata
