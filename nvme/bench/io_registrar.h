// IoBufferRegistrar: lets a PinnedPool register its buffers with an IoBackend (io_uring fixed
// buffers), so every pool buffer is zero-pin IO memory without the owner registering each one.
//
// Thread safety: the pool calls a registrar under its own lock from whichever thread allocates
// or trims, while an IoBackend is single-threaded. Use this only when the backend's owner thread
// is also the only thread that allocates from, releases to (when it may unmap: Trim, destructor)
// the pool; otherwise register buffers explicitly on the owner thread.
// REQUIRES: the backend outlives the pool.
#pragma once

#include <string_view>

#include "cpu/pinned_pool.h"
#include "strata/io.h"

namespace strata::nvme {

class IoBufferRegistrar final : public cpu::HostMemoryRegistrar {
 public:
  explicit IoBufferRegistrar(IoBackend* io) : io_(io) {}
  std::string_view name() const override { return "io_uring fixed buffers"; }
  Status Register(void* base, size_t size_bytes) override {
    return io_->RegisterBuffer(base, size_bytes);
  }
  void Unregister(void* base) override { io_->UnregisterBuffer(base); }

 private:
  IoBackend* io_;
};

}  // namespace strata::nvme
