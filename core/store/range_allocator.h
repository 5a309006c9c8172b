// RangeAllocator: first-fit sub-allocation of [0, capacity) in aligned units, with coalescing
// frees. The tiered store carves its pinned host slab with it, so a step's hot path never maps
// memory. (The NVMe swap files are laid out by nvme::SwapSpace, statically, when the tier opens.)
//
// Thread safety: not thread-safe; the owner serializes.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace strata::store {

class RangeAllocator {
 public:
  RangeAllocator(uint64_t capacity_bytes, uint64_t align_bytes);

  // Offset of a free range of `size_bytes` rounded up to the alignment; nullopt when no single
  // free range is large enough (fragmentation or full).
  std::optional<uint64_t> Allocate(uint64_t size_bytes);
  // REQUIRES: `offset` came from Allocate with the same size and was not freed since.
  void Free(uint64_t offset, uint64_t size_bytes);

  uint64_t Round(uint64_t size_bytes) const { return (size_bytes + align_ - 1) / align_ * align_; }
  uint64_t capacity_bytes() const { return capacity_; }
  uint64_t used_bytes() const { return used_; }
  uint64_t largest_free_bytes() const;

 private:
  uint64_t capacity_;
  uint64_t align_;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> free_;  // offset -> size, disjoint, never adjacent
};

}  // namespace strata::store
