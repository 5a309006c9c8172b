// Helpers for IO tests: a unique temporary directory and aligned buffers.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>

#include <gtest/gtest.h>

namespace strata::testing {

// A fresh directory under $STRATA_TEST_TMPDIR (or /tmp), removed with its contents.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "io") {
    const char* base = std::getenv("STRATA_TEST_TMPDIR");
    std::filesystem::path root = base != nullptr ? base : "/tmp";
    std::filesystem::create_directories(root);
    std::string tmpl = (root / ("strata-" + tag + "-XXXXXX")).string();
    char* made = mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr) << "mkdtemp " << tmpl;
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<char, FreeDeleter>;

inline AlignedBuf MakeAligned(size_t bytes, size_t align = 4096) {
  return AlignedBuf(
      static_cast<char*>(std::aligned_alloc(align, (bytes + align - 1) / align * align)));
}

inline void FillPattern(char* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = rng();
    std::memcpy(p + i, &v, std::min<size_t>(8, n - i));
  }
}

// Opens (creating) `path` for O_DIRECT read/write and sizes it to `size` bytes.
inline int OpenDirect(const std::string& path, size_t size) {
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  EXPECT_GE(fd, 0) << "open " << path << ": " << std::strerror(errno);
  if (fd >= 0 && size > 0) {
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
  }
  return fd;
}

}  // namespace strata::testing
