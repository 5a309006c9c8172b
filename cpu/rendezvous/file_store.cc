#include "cpu/rendezvous/file_store.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

namespace strata::cpu {
namespace {
using Clock = std::chrono::steady_clock;
constexpr size_t kMaxValueBytes = 16u << 20;  // as the TCP store's
constexpr int kTempNameTries = 64;
// The longest file name a key is stored under as itself (escaped). File names end at 255 bytes
// (NAME_MAX) and the temp name adds ".tmp.<pid>.<seq>" (up to 36 bytes); a longer key is stored
// under its first kHashedPrefixBytes and its SHA-256, so that every key the TCP store takes (up to
// 4 KiB) works here too, not just those that fit a name.
constexpr size_t kMaxPlainNameBytes = 200;
constexpr size_t kHashedPrefixBytes = 96;

std::string Octal(mode_t mode) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0%03o", static_cast<unsigned>(mode & 07777));
  return buf;
}

// Reads a whole regular file of at most kMaxValueBytes. kCorruption otherwise.
Result<std::vector<uint8_t>> ReadKeyFile(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::FromErrno(errno, "file store: fstat", path);
  if (!S_ISREG(st.st_mode)) {
    return Status::Corruption("file store: '" + path +
                              "' is not a regular file; something other than a rank put it there");
  }
  std::vector<uint8_t> v;
  uint8_t chunk[64 << 10];
  while (true) {
    const ssize_t r = ::read(fd, chunk, sizeof(chunk));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::FromErrno(errno, "file store: read", path);
    if (r == 0) return v;
    if (v.size() + static_cast<size_t>(r) > kMaxValueBytes) {
      return Status::Corruption("file store: '" + path + "' is larger than 16 MiB");
    }
    v.insert(v.end(), chunk, chunk + r);
  }
}
}  // namespace

Result<std::unique_ptr<FileKvStore>> FileKvStore::Open(const std::string& dir) {
  if (dir.empty()) return Status::InvalidArgument("file store: empty directory");
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Status::FromErrno(errno, "file store: mkdir", dir);
  }
  // Every check below is on the descriptor the store then works through, so replacing the path
  // afterwards changes nothing.
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOTDIR) {
      return Status::InvalidArgument("file store: '" + dir + "' is not a directory");
    }
    return Status::FromErrno(errno, "file store: open", dir);
  }
  struct stat st {};
  std::string problem;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::FromErrno(err, "file store: fstat", dir);
  }
  if (st.st_uid != ::geteuid()) {
    problem = "is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
              std::to_string(::geteuid()) +
              "): its owner could read or plant rendezvous keys; use a directory of your own";
  } else if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    problem = "is group- or world-writable (mode " + Octal(st.st_mode) +
              "): anyone who may write there could plant rendezvous keys or symlinks; run "
              "`chmod go-w` on it or use a fresh directory (the store creates it 0700)";
  }
  if (!problem.empty()) {
    ::close(fd);
    return Status::InvalidArgument("file store: '" + dir + "' " + problem);
  }
  return std::unique_ptr<FileKvStore>(new FileKvStore(dir, fd));
}

FileKvStore::~FileKvStore() { ::close(dir_fd_); }

Result<std::string> FileKvStore::NameOf(std::string_view key) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string name;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '-' || c == '_') {
      name += static_cast<char>(c);
    } else {
      name += '%';
      name += kHex[c >> 4];
      name += kHex[c & 15];
    }
  }
  if (name.size() <= kMaxPlainNameBytes) return name;
  // "<prefix>~<sha256 hex>": '~' is never in an escaped name (it becomes %7e), so a hashed name
  // cannot be a plain one. The prefix ends before a "%XX" it would cut.
  size_t cut = kHashedPrefixBytes;
  for (size_t k = 1; k <= 2; ++k) {
    if (name[cut - k] == '%') cut -= k;
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int md_len = 0;
  if (::EVP_Digest(key.data(), key.size(), md, &md_len, EVP_sha256(), nullptr) != 1) {
    return Status::Internal("file store: SHA-256 failed in libcrypto");
  }
  name.resize(cut);
  name += '~';
  for (unsigned int i = 0; i < md_len; ++i) {
    name += kHex[md[i] >> 4];
    name += kHex[md[i] & 15];
  }
  return name;
}

Status FileKvStore::Set(std::string_view key, std::span<const uint8_t> value) {
  STRATA_ASSIGN_OR_RETURN(const std::string name, NameOf(key));
  const std::string path = dir_ + "/" + name;
  // A fresh temp name: O_EXCL fails on anything already there (a leftover, a planted file or
  // symlink, a concurrent writer), which is then left alone and the next name tried.
  std::string tmp;
  int fd = -1;
  for (int i = 0; i < kTempNameTries && fd < 0; ++i) {
    tmp = name + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(temp_seq_++);
    fd = ::openat(dir_fd_, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST)
      return Status::FromErrno(errno, "file store: open", dir_ + "/" + tmp);
  }
  if (fd < 0) {
    return Status::IOError("file store: " + std::to_string(kTempNameTries) + " temp names for '" +
                           path + "' already exist (planted files?)");
  }
  auto fail = [&](int err, const char* op) {
    ::unlinkat(dir_fd_, tmp.c_str(), 0);
    return Status::FromErrno(err, op, dir_ + "/" + tmp);
  };
  size_t done = 0;
  while (done < value.size()) {
    const ssize_t w = ::write(fd, value.data() + done, value.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int err = errno;
      ::close(fd);
      return fail(err, "file store: write");
    }
    done += static_cast<size_t>(w);
  }
  if (::close(fd) != 0) return fail(errno, "file store: close");
  if (::renameat(dir_fd_, tmp.c_str(), dir_fd_, name.c_str()) != 0) {
    return fail(errno, "file store: rename");
  }
  return Status::OK();
}

Result<std::vector<uint8_t>> FileKvStore::Get(std::string_view key,
                                              std::chrono::milliseconds timeout) {
  STRATA_ASSIGN_OR_RETURN(const std::string name, NameOf(key));
  const std::string path = dir_ + "/" + name;
  const auto deadline = Clock::now() + timeout;
  auto sleep = std::chrono::milliseconds(1);
  while (true) {
    // O_NONBLOCK: a FIFO planted under the name must not block the open.
    const int fd = ::openat(dir_fd_, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) {
      auto v = ReadKeyFile(fd, path);
      ::close(fd);
      return v;
    }
    if (errno == ELOOP) {
      return Status::Corruption("file store: '" + path +
                                "' is a symbolic link; a key is never read through one");
    }
    if (errno != ENOENT) return Status::FromErrno(errno, "file store: open", path);
    if (Clock::now() >= deadline) {
      return Status::DeadlineExceeded("file store: key '" + std::string(key) +
                                      "' did not appear in " + dir_ + " within " +
                                      std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::milliseconds(20));
  }
}

Status FileKvStore::Delete(std::string_view key) {
  STRATA_ASSIGN_OR_RETURN(const std::string name, NameOf(key));
  if (::unlinkat(dir_fd_, name.c_str(), 0) != 0 && errno != ENOENT) {
    return Status::FromErrno(errno, "file store: unlink", dir_ + "/" + name);
  }
  return Status::OK();
}
}  // namespace strata::cpu
