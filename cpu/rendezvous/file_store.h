// FileKvStore: a rendezvous KvStore of one file per key in a shared directory (see
// cpu/rendezvous/rendezvous.h). Values are written to a temp name, then renamed, so readers never
// see a partial value; Get polls for the file. Thread-safe.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "strata/comm.h"

namespace strata::cpu {

class FileKvStore final : public KvStore {
 public:
  // Creates `dir` if missing. kIOError with errno when it cannot.
  static Result<std::unique_ptr<FileKvStore>> Open(const std::string& dir);
  Status Set(std::string_view key, std::span<const uint8_t> value) override;
  Result<std::vector<uint8_t>> Get(std::string_view key,
                                   std::chrono::milliseconds timeout) override;
  Status Delete(std::string_view key) override;

 private:
  explicit FileKvStore(std::string dir) : dir_(std::move(dir)) {}
  std::string PathOf(std::string_view key) const;
  std::string dir_;
};

}  // namespace strata::cpu
