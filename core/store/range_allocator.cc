#include "core/store/range_allocator.h"

#include <algorithm>
#include <cassert>

namespace strata::store {

RangeAllocator::RangeAllocator(uint64_t capacity_bytes, uint64_t align_bytes)
    : capacity_(capacity_bytes / align_bytes * align_bytes), align_(align_bytes) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::optional<uint64_t> RangeAllocator::Allocate(uint64_t size_bytes) {
  const uint64_t n = Round(std::max<uint64_t>(size_bytes, 1));
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < n) continue;
    const uint64_t off = it->first, rest = it->second - n;
    free_.erase(it);
    if (rest > 0) free_.emplace(off + n, rest);
    used_ += n;
    return off;
  }
  return std::nullopt;
}

void RangeAllocator::Free(uint64_t offset, uint64_t size_bytes) {
  uint64_t n = Round(std::max<uint64_t>(size_bytes, 1));
  assert(used_ >= n);
  used_ -= n;
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + n == next->first) {
    n += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += n;
      return;
    }
  }
  free_.emplace(offset, n);
}

uint64_t RangeAllocator::largest_free_bytes() const {
  uint64_t m = 0;
  for (const auto& [off, n] : free_) m = std::max(m, n);
  return m;
}

}  // namespace strata::store
