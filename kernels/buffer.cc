#include "kernels/buffer.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <utility>

namespace strata::kernels {
namespace {
constexpr size_t kHuge = size_t{2} << 20;
}

Result<HugeBuffer> HugeBuffer::Allocate(size_t bytes) {
  HugeBuffer b;
  if (bytes == 0) return b;
  const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
  // Over-map by 2 MiB and trim, so the region starts on a huge-page boundary.
  void* raw =
      mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return Status::FromErrno(errno, "mmap of a kernel buffer");
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + size + kHuge;
  if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - aligned - size);
  b.data_ = reinterpret_cast<void*>(aligned);
  b.size_ = size;
  (void)madvise(b.data_, size, MADV_HUGEPAGE);  // advisory: fine if refused
  return b;
}

HugeBuffer::~HugeBuffer() {
  if (data_ != nullptr) munmap(data_, size_);
}

HugeBuffer::HugeBuffer(HugeBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

HugeBuffer& HugeBuffer::operator=(HugeBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace strata::kernels
