// HugeBuffer: a move-only, 2 MiB-aligned anonymous memory region advised as transparent huge
// pages, for the large arrays the kernel benchmarks stream through (fewer TLB misses, aligned for
// non-temporal stores). Not pinned, not registered with any device.
//
// Thread safety: a value type; the memory may be used from any thread.
#pragma once

#include <cstddef>

#include "strata/status.h"

namespace strata::kernels {

class HugeBuffer {
 public:
  // Maps `bytes` (rounded up to 2 MiB). IOError (with errno) when mmap fails.
  static Result<HugeBuffer> Allocate(size_t bytes);
  HugeBuffer() = default;
  ~HugeBuffer();
  HugeBuffer(HugeBuffer&& other) noexcept;
  HugeBuffer& operator=(HugeBuffer&& other) noexcept;
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace strata::kernels
