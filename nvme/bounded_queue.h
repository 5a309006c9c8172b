// BoundedQueue: a FIFO of fixed capacity on one preallocated array (a ring), for the IO paths'
// completion and wait queues, so the steady state allocates nothing (std::deque allocates and
// frees chunks as it moves). Pushing onto a full queue is a programmer error (asserted): every
// user sizes it to the bound it already enforces (queue depth, ops in flight).
//
// Thread safety: a value type; one owner at a time.
#pragma once

#include <cassert>
#include <cstddef>
#include <utility>
#include <vector>

namespace strata::nvme {

template <class T>
class BoundedQueue {
 public:
  explicit BoundedQueue(size_t capacity = 0) : items_(capacity) {}

  size_t capacity() const noexcept { return items_.size(); }
  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }

  // REQUIRES: size() < capacity().
  void push_back(T item) {
    assert(size_ < items_.size() && "BoundedQueue over capacity");
    items_[(head_ + size_) % items_.size()] = std::move(item);
    ++size_;
  }
  // REQUIRES: !empty().
  T& front() { return items_[head_]; }
  T pop_front() {
    assert(size_ > 0);
    T item = std::move(items_[head_]);
    head_ = (head_ + 1) % items_.size();
    --size_;
    return item;
  }

 private:
  std::vector<T> items_;
  size_t head_ = 0;
  size_t size_ = 0;
};

}  // namespace strata::nvme
