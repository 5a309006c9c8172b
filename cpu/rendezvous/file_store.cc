#include "cpu/rendezvous/file_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

namespace strata::cpu {
namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

// ---------------------------------------------------------------------------
// FileKvStore
// ---------------------------------------------------------------------------
Result<std::unique_ptr<FileKvStore>> FileKvStore::Open(const std::string& dir) {
  if (dir.empty()) return Status::InvalidArgument("file store: empty directory");
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return Status::FromErrno(errno, "file store: mkdir", dir);
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return Status::FromErrno(errno, "file store: stat", dir);
  if (!S_ISDIR(st.st_mode))
    return Status::InvalidArgument("file store: '" + dir + "' is not a directory");
  return std::unique_ptr<FileKvStore>(new FileKvStore(dir));
}

std::string FileKvStore::PathOf(std::string_view key) const {
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
  return dir_ + "/" + name;
}

Status FileKvStore::Set(std::string_view key, std::span<const uint8_t> value) {
  const std::string path = PathOf(key);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno(errno, "file store: open", tmp);
  size_t done = 0;
  while (done < value.size()) {
    const ssize_t w = ::write(fd, value.data() + done, value.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int err = errno;
      ::close(fd);
      return Status::FromErrno(err, "file store: write", tmp);
    }
    done += static_cast<size_t>(w);
  }
  if (::close(fd) != 0) return Status::FromErrno(errno, "file store: close", tmp);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return Status::FromErrno(errno, "file store: rename", path);
  }
  return Status::OK();
}

Result<std::vector<uint8_t>> FileKvStore::Get(std::string_view key,
                                              std::chrono::milliseconds timeout) {
  const std::string path = PathOf(key);
  const auto deadline = Clock::now() + timeout;
  auto sleep = std::chrono::milliseconds(1);
  while (true) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::vector<uint8_t> v((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      return v;
    }
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
  const std::string path = PathOf(key);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Status::FromErrno(errno, "file store: unlink", path);
  }
  return Status::OK();
}
}  // namespace strata::cpu
