// FileKvStore: a rendezvous KvStore of one file per key in a shared directory (see
// cpu/rendezvous/rendezvous.h). Values are written to a temp name, then renamed, so readers never
// see a partial value; Get polls for the file.
//
// The directory must be this user's alone: Open creates it 0700, or accepts an existing one only
// when the current user owns it and neither group nor others may write it, then keeps it open and
// works relative to that descriptor (a path swapped later changes nothing). Temp files are
// created O_EXCL|O_NOFOLLOW (a name planted in advance is skipped, a symlink never followed),
// key files are 0600, and Get opens keys O_NOFOLLOW and reads regular files only. A key of any
// length works: one too long for a file name is stored under its prefix and SHA-256.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "strata/comm.h"

namespace strata::cpu {

class FileKvStore final : public KvStore {
 public:
  // Opens `dir`, creating it (mode 0700) when missing. kIOError with errno when it cannot be
  // created or opened; kInvalidArgument when it is not a directory, is owned by another user, or
  // is group- or world-writable (the message says which, and how to fix it).
  static Result<std::unique_ptr<FileKvStore>> Open(const std::string& dir);
  ~FileKvStore() override;
  Status Set(std::string_view key, std::span<const uint8_t> value) override;
  // kCorruption when the key's name holds something other than a regular file (a symlink, a
  // FIFO) or a file larger than 16 MiB.
  Result<std::vector<uint8_t>> Get(std::string_view key,
                                   std::chrono::milliseconds timeout) override;
  Status Delete(std::string_view key) override;

 private:
  FileKvStore(std::string dir, int dir_fd) : dir_(std::move(dir)), dir_fd_(dir_fd) {}
  // The file name of `key`: escaped ("a/b" -> "a%2fb"); past 200 bytes, a prefix and SHA-256.
  static Result<std::string> NameOf(std::string_view key);
  std::string dir_;
  int dir_fd_;
  std::atomic<uint64_t> temp_seq_{0};  // temp names: "<key>.tmp.<pid>.<seq>"
};

}  // namespace strata::cpu
