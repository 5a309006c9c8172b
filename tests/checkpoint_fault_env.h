// CheckpointEnv doubles for the checkpoint fault tests (include/strata/checkpoint.h; leveldb's
// FaultInjectionTestEnv is the model): passed to Engine::Save in SaveOptions::env, or to
// ReshardCheckpoint in StreamOptions::env, they inject faults through the seam production code
// calls, so no test hook lives in core/.
//
//   CrashAtEnv     the process dies (_exit(kCrashExitCode)) at the k-th durable operation of the
//                  save: a file's creation, a write, an fsync, a mkdir, a directory fsync, a
//                  rename (DurableOp), and every chunk write of a rank file (counted in its
//                  stream's backend, wrapped by CrashingBackend). A write it dies at is torn: the
//                  first half of its bytes land over the old contents.
//   SimFaultEnv    scripts a simulated-backend fault (nvme::SimFault: a torn write that reports
//                  EIO, or a silently lost one) on the nth write of the first stream over a file
//                  whose path contains a given part, while the process keeps running.
//   FlipByteEnv    damages a small file (the manifest) as it lands: just before its fsync, the
//                  byte right after the first occurrence of a given text is XORed with 1 on disk,
//                  and the save goes on as if the write had been good (a silent media error).
//
// Thread safety: all may be shared by the ranks of one process (their counters are atomic).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nvme/sim_backend.h"
#include "strata/checkpoint.h"
#include "strata/io.h"

namespace strata::testing {

// The exit status of a process a CrashAtEnv stopped.
inline constexpr int kCrashExitCode = 77;

// Writes the first half of `bytes` at `offset` of the file open as `fd` (through a descriptor
// of its own without O_DIRECT, so any length lands), then ends the process: a torn write.
[[noreturn]] inline void TearAndDie(int fd, const void* data, uint64_t bytes, uint64_t offset) {
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  const int wfd = ::open(self.c_str(), O_WRONLY | O_CLOEXEC);
  if (wfd >= 0) (void)!::pwrite(wfd, data, bytes / 2, static_cast<off_t>(offset));
  ::_exit(kCrashExitCode);
}

class CrashAtEnv;

// A stream's backend under CrashAtEnv: every write request submitted is one durable operation;
// at the one the env dies at, the writes in flight are completed first, then the request is torn.
class CrashingBackend final : public IoBackend {
 public:
  CrashingBackend(std::unique_ptr<IoBackend> inner, CrashAtEnv& env)
      : inner_(std::move(inner)), env_(env) {}

  IoBackendKind kind() const noexcept override { return inner_->kind(); }
  size_t queue_depth() const noexcept override { return inner_->queue_depth(); }
  size_t inflight() const noexcept override { return inner_->inflight(); }
  std::string note() const override { return inner_->note(); }
  inline Status Submit(std::span<const IoRequest> batch) override;
  Result<size_t> Reap(std::span<IoCompletion> out, size_t min_complete) override {
    return inner_->Reap(out, min_complete);
  }
  Status RegisterFile(int fd, std::string_view path) override {
    return inner_->RegisterFile(fd, path);
  }
  void UnregisterFile(int fd) override { inner_->UnregisterFile(fd); }
  Status RegisterBuffer(void* base, size_t size_bytes) override {
    return inner_->RegisterBuffer(base, size_bytes);
  }
  void UnregisterBuffer(void* base) override { inner_->UnregisterBuffer(base); }
  Status Allocate(int fd, uint64_t length_bytes) override {
    return inner_->Allocate(fd, length_bytes);
  }

 private:
  std::unique_ptr<IoBackend> inner_;
  CrashAtEnv& env_;
};

// Dies at the k-th durable operation (k > 0; 0 never dies). See the header comment.
class CrashAtEnv final : public CheckpointEnv {
 public:
  explicit CrashAtEnv(int64_t crash_at) : crash_at_(crash_at) {}

  void BeforeDurableOp(const DurableOp& op) override {
    if (!Count()) return;
    if (op.kind == DurableOp::Kind::kWrite) TearAndDie(op.fd, op.data, op.bytes, op.offset);
    ::_exit(kCrashExitCode);
  }
  std::unique_ptr<IoBackend> StreamBackend(std::string_view,
                                           std::unique_ptr<IoBackend> opened) override {
    return std::make_unique<CrashingBackend>(std::move(opened), *this);
  }
  // Counts one durable operation; true when the process must die at it.
  bool Count() { return crash_at_ > 0 && ++ops_ == crash_at_; }

 private:
  const int64_t crash_at_;
  std::atomic<int64_t> ops_{0};
};

inline Status CrashingBackend::Submit(std::span<const IoRequest> batch) {
  for (const IoRequest& r : batch) {
    if (r.op != IoOp::kWrite || !env_.Count()) continue;
    std::vector<IoCompletion> done(inner_->queue_depth());
    while (inner_->inflight() > 0 && inner_->Reap(done, 1).ok()) {
    }
    TearAndDie(r.fd, r.buffer, r.length_bytes, r.offset);
  }
  return inner_->Submit(batch);
}

// Scripts `fault` on the `nth` write (1-based) of the first simulated checkpoint stream opened
// over a path containing `path_part`.
class SimFaultEnv final : public CheckpointEnv {
 public:
  SimFaultEnv(std::string path_part, nvme::SimFault fault, int nth)
      : path_part_(std::move(path_part)), fault_(fault), nth_(nth) {}

  std::unique_ptr<IoBackend> StreamBackend(std::string_view path,
                                           std::unique_ptr<IoBackend> opened) override {
    if (opened->kind() != IoBackendKind::kSimulated ||
        path.find(path_part_) == std::string_view::npos || fired_.exchange(true)) {
      return opened;
    }
    // kSimulated is nvme::SimBackend's kind alone.
    auto& sim = static_cast<nvme::SimBackend&>(*opened);
    if (nth_ > 1) sim.InjectFault(IoOp::kWrite, nvme::SimFault::kNone, nth_ - 1);
    sim.InjectFault(IoOp::kWrite, fault_, 1);
    return opened;
  }

 private:
  const std::string path_part_;
  const nvme::SimFault fault_;
  const int nth_;
  std::atomic<bool> fired_{false};
};

// Flips the byte after the first `after` in the first file synced whose path ends in `suffix`.
class FlipByteEnv final : public CheckpointEnv {
 public:
  FlipByteEnv(std::string suffix, std::string after)
      : suffix_(std::move(suffix)), after_(std::move(after)) {}

  void BeforeDurableOp(const DurableOp& op) override {
    if (op.kind != DurableOp::Kind::kSync || !op.path.ends_with(suffix_) || fired_.exchange(true)) {
      return;
    }
    const std::string path(op.path);
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return;
    std::string text(static_cast<size_t>(::lseek(fd, 0, SEEK_END)), '\0');
    const size_t at = ::pread(fd, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size())
                          ? text.find(after_)
                          : std::string::npos;
    if (at != std::string::npos && at + after_.size() < text.size()) {
      const char c = static_cast<char>(text[at + after_.size()] ^ 1);
      flipped_ = ::pwrite(fd, &c, 1, static_cast<off_t>(at + after_.size())) == 1;
    }
    ::close(fd);
  }
  bool flipped() const { return flipped_; }

 private:
  const std::string suffix_, after_;
  std::atomic<bool> fired_{false};
  std::atomic<bool> flipped_{false};
};

}  // namespace strata::testing
