#include "cpu/pinned_pool.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include "cpu/topology.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace strata::cpu {

namespace {
size_t RoundUp(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

std::string MemlockLimit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return "unknown";
  if (rl.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(rl.rlim_cur) + " bytes";
}
}  // namespace

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = other.pool_;
    data_ = other.data_;
    size_bytes_ = other.size_bytes_;
    capacity_bytes_ = other.capacity_bytes_;
    locked_ = other.locked_;
    registered_ = other.registered_;
    other.pool_ = nullptr;
    other.data_ = nullptr;
    other.size_bytes_ = other.capacity_bytes_ = 0;
  }
  return *this;
}

void PinnedBuffer::Reset() noexcept {
  if (pool_ != nullptr && data_ != nullptr) pool_->Release(*this);
  pool_ = nullptr;
  data_ = nullptr;
  size_bytes_ = capacity_bytes_ = 0;
  locked_ = registered_ = false;
}

Result<std::unique_ptr<PinnedPool>> PinnedPool::Create(PinnedPoolOptions options) {
  if (options.budget_bytes == 0) {
    return Status::InvalidArgument("pinned pool: budget_bytes must be > 0");
  }
  if (options.numa_node == PinnedPoolOptions::kNumaNodeOfCreator) {
    if (options.topology == nullptr) {
      return Status::InvalidArgument("pinned pool: kNumaNodeOfCreator given without a topology");
    }
    options.numa_node = options.topology->CurrentNumaNode();  // -1 when the thread spans nodes
  }
  if (options.numa_node < -1) {
    return Status::InvalidArgument("pinned pool: numa_node " + std::to_string(options.numa_node) +
                                   " is not a node, -1 or kNumaNodeOfCreator");
  }
  if (options.numa_node >= 0) {
    if (options.topology == nullptr) {
      return Status::InvalidArgument("pinned pool: numa_node " + std::to_string(options.numa_node) +
                                     " given without a topology");
    }
    if (options.numa_node >= options.topology->numa_nodes()) {
      return Status::InvalidArgument("pinned pool: numa_node " + std::to_string(options.numa_node) +
                                     " out of range (machine has " +
                                     std::to_string(options.topology->numa_nodes()) + ")");
    }
  }
  std::unique_ptr<PinnedPool> pool(new PinnedPool(std::move(options)));
  if (pool->options_.register_with_cuda) {
    pool->cuda_registrar_ = MakeCudaHostRegistrar();
    if (pool->cuda_registrar_) pool->registrars_.push_back(pool->cuda_registrar_.get());
  }
  for (HostMemoryRegistrar* r : pool->options_.registrars) {
    if (r != nullptr) pool->registrars_.push_back(r);
  }
  if (pool->registrars_.size() > 64) {
    return Status::InvalidArgument("pinned pool: more than 64 registrars");
  }
  pool->refused_.assign(pool->registrars_.size(), false);
  return pool;
}

PinnedPool::~PinnedPool() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [size, m] : cached_) UnmapLocked(m);
  // Leaked buffers are a programmer error; unmapping them would turn a leak into a crash later.
  cached_.clear();
}

void PinnedPool::AddNoteLocked(const std::string& line) {
  if (!note_.empty()) note_ += "\n";
  note_ += line;
}

// Map 2 MiB-aligned (over-map by 2 MiB, trim both ends), advise huge pages, bind to the node,
// then lock (which faults the pages in) or, when locking is refused, populate them anyway so
// the first IO does not pay the page faults.
Result<PinnedPool::Mapping> PinnedPool::MapLocked(size_t bytes) {
  size_t span = bytes + kHugePageBytes;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED)
    return Status::FromErrno(errno, "pinned pool: mmap of " + std::to_string(span) + " bytes");
  uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = RoundUp(start, kHugePageBytes);
  if (aligned > start) munmap(raw, aligned - start);
  size_t tail = (start + span) - (aligned + bytes);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  Mapping m{reinterpret_cast<void*>(aligned), bytes, false, false, 0};

  if (options_.huge_pages) madvise(m.base, bytes, MADV_HUGEPAGE);  // advisory: failure is fine
  if (options_.numa_node >= 0) {
    Status s = options_.topology->BindMemory(m.base, bytes, options_.numa_node);
    if (!s.ok()) {
      munmap(m.base, bytes);
      return s.WithContext("pinned pool");
    }
  }
  if (options_.lock_memory && !lock_refused_) {
    if (mlock(m.base, bytes) == 0) {
      m.locked = true;
    } else {
      lock_refused_ = true;
      AddNoteLocked(std::string(Status::FromErrno(errno, "mlock").message()) + "; RLIMIT_MEMLOCK " +
                    MemlockLimit() +
                    ": pinned buffers stay unlocked (grant CAP_IPC_LOCK or raise ulimit -l)");
    }
  }
  if (!m.locked && madvise(m.base, bytes, MADV_POPULATE_WRITE) != 0) {
    for (size_t off = 0; off < bytes; off += 4096) static_cast<volatile char*>(m.base)[off] = 0;
  }
  m.registered = true;
  for (size_t i = 0; i < registrars_.size(); ++i) {
    if (refused_[i]) {
      m.registered = false;
      continue;
    }
    Status s = registrars_[i]->Register(m.base, bytes);
    if (s.ok()) {
      m.registered_mask |= uint64_t{1} << i;
      continue;
    }
    // The refusing registrar is not asked again; earlier mappings stay registered with it.
    refused_[i] = true;
    m.registered = false;
    AddNoteLocked(std::string(registrars_[i]->name()) + " registration refused (" + s.ToString() +
                  "): pinned buffers are not registered with it");
  }
  return m;
}

void PinnedPool::UnmapLocked(const Mapping& m) {
  for (size_t i = 0; i < registrars_.size(); ++i) {
    if (m.registered_mask & (uint64_t{1} << i)) registrars_[i]->Unregister(m.base);
  }
  if (m.locked) munlock(m.base, m.bytes);
  munmap(m.base, m.bytes);
  mapped_bytes_ -= m.bytes;
}

Result<PinnedBuffer> PinnedPool::Allocate(size_t size_bytes) {
  if (size_bytes == 0) return Status::InvalidArgument("pinned pool: Allocate(0)");
  const size_t bytes = RoundUp(size_bytes, kHugePageBytes);
  std::lock_guard<std::mutex> lock(mu_);
  Mapping m;
  auto hit = cached_.find(bytes);
  if (hit != cached_.end()) {
    m = hit->second;
    cached_.erase(hit);
  } else {
    // Make room by dropping cached mappings of other sizes, largest first.
    while (mapped_bytes_ + bytes > options_.budget_bytes && !cached_.empty()) {
      auto last = std::prev(cached_.end());
      UnmapLocked(last->second);
      cached_.erase(last);
    }
    if (mapped_bytes_ + bytes > options_.budget_bytes) {
      return Status::ResourceExhausted("pinned pool: allocating " + std::to_string(size_bytes) +
                                       " bytes (" + std::to_string(bytes) +
                                       " rounded to 2 MiB) would exceed the budget of " +
                                       std::to_string(options_.budget_bytes) + " bytes (" +
                                       std::to_string(in_use_bytes_) + " in use)");
    }
    STRATA_ASSIGN_OR_RETURN(m, MapLocked(bytes));
    mapped_bytes_ += bytes;
    peak_mapped_bytes_ = std::max(peak_mapped_bytes_, mapped_bytes_);
  }
  in_use_[m.base] = m;
  in_use_bytes_ += m.bytes;
  PinnedBuffer b;
  b.pool_ = this;
  b.data_ = m.base;
  b.size_bytes_ = size_bytes;
  b.capacity_bytes_ = m.bytes;
  b.locked_ = m.locked;
  b.registered_ = m.registered;
  return b;
}

void PinnedPool::Release(PinnedBuffer& b) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_use_.find(b.data_);
  if (it == in_use_.end()) return;  // not ours: a programmer error, but never corrupt the pool
  in_use_bytes_ -= it->second.bytes;
  cached_.emplace(it->second.bytes, it->second);
  in_use_.erase(it);
}

void PinnedPool::Trim() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [size, m] : cached_) UnmapLocked(m);
  cached_.clear();
}

size_t PinnedPool::mapped_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_bytes_;
}
size_t PinnedPool::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_bytes_;
}
size_t PinnedPool::peak_mapped_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_mapped_bytes_;
}
std::string PinnedPool::note() const {
  std::lock_guard<std::mutex> lock(mu_);
  return note_;
}

}  // namespace strata::cpu
