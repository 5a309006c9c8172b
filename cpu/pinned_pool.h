// PinnedPool: a byte-budgeted pool of host buffers fit for DMA to the disk and to the GPU.
//
// Every buffer is an anonymous mapping aligned to 2 MiB with MADV_HUGEPAGE (a 1 MiB O_DIRECT IO
// from one huge page is one segment, from 4 KiB pages 256, more than a virtio disk takes in one
// request: huge pages alone can make such IO several times faster), bound to a
// NUMA node when asked, locked (mlock), and handed to each HostMemoryRegistrar (cudaHostRegister
// when CUDA is built; io_uring fixed buffers are registered by the IoBackend's owner). Locking or
// registration that the OS refuses (RLIMIT_MEMLOCK, no GPU driver) does not fail the pool: the
// buffer is handed out unlocked/unregistered and note() says so, once per cause.
//
// Budget: the bytes mapped by the pool (buffers in use plus released ones kept for reuse) never
// exceed budget_bytes. An allocation that cannot fit even after dropping every cached mapping is
// ResourceExhausted, never an OOM kill. Sizes round up to 2 MiB. Released buffers are kept and
// reused for the same rounded size, so a steady training step does not map, lock or register.
//
// Thread safety: Allocate, buffer release and the accessors may be called from any thread.
// REQUIRES: the pool outlives every PinnedBuffer it handed out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"

namespace strata::cpu {

class Topology;

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// A hook that makes host memory DMA-able for some device (CUDA, an RDMA NIC). The pool calls
// Register once per new mapping and Unregister before unmapping it.
// Thread safety: called under the pool's lock, one call at a time.
class HostMemoryRegistrar {
 public:
  virtual ~HostMemoryRegistrar() = default;
  virtual std::string_view name() const = 0;
  // Non-OK (typically Unavailable) means "not registered": the pool stops asking this
  // registrar, notes the reason once and hands the memory out unregistered.
  virtual Status Register(void* base, size_t size_bytes) = 0;
  virtual void Unregister(void* base) = 0;
};

// cudaHostRegister when strata is built with CUDA (cpu/cuda_registrar_cuda.cc); nullptr without.
std::unique_ptr<HostMemoryRegistrar> MakeCudaHostRegistrar();

struct PinnedPoolOptions {
  // Most bytes the pool maps at once (in use + cached). Required, > 0. From the config's
  // offload buffer sizes; too small starves the pipeline, too large takes DRAM from the OS.
  size_t budget_bytes = 0;
  // Lock pages in memory (mlock). Costs nothing at run time; refused for non-root users beyond
  // RLIMIT_MEMLOCK (8 MiB here), in which case buffers stay unlocked.
  bool lock_memory = true;
  // MADV_HUGEPAGE. Off only to measure what huge pages buy.
  bool huge_pages = true;
  // Register with CUDA (cudaHostRegister) when strata is built with CUDA.
  bool register_with_cuda = true;
  // Bind memory to this NUMA node (hwloc logical index); -1: first-touch policy;
  // kNumaNodeOfCreator: the node of the thread calling Create (the IO/optimizer thread that will
  // use the buffers), or first-touch when it spans nodes. Binding needs `topology`.
  static constexpr int kNumaNodeOfCreator = -2;
  int numa_node = -1;
  const Topology* topology = nullptr;  // not owned; outlives the pool
  // Extra registrars (not owned; outlive the pool), called after CUDA's.
  std::vector<HostMemoryRegistrar*> registrars;
};

class PinnedPool;

// A move-only handle on one pool buffer; returns it to the pool when destroyed or Reset.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { Reset(); }

  void* data() const noexcept { return data_; }
  template <typename T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  // The size asked for; capacity_bytes() is the 2 MiB-rounded mapping (all of it usable).
  size_t size_bytes() const noexcept { return size_bytes_; }
  size_t capacity_bytes() const noexcept { return capacity_bytes_; }
  bool locked() const noexcept { return locked_; }
  // Registered with every registrar the pool had (false when any one refused).
  bool registered() const noexcept { return registered_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }
  // Returns the buffer to its pool; the handle becomes empty.
  void Reset() noexcept;

 private:
  friend class PinnedPool;
  PinnedPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t size_bytes_ = 0;
  size_t capacity_bytes_ = 0;
  bool locked_ = false;
  bool registered_ = false;
};

class PinnedPool {
 public:
  // InvalidArgument: budget_bytes is 0, or numa_node >= 0 without a topology or out of range.
  static Result<std::unique_ptr<PinnedPool>> Create(PinnedPoolOptions options);
  // REQUIRES: every buffer has been released. Unregisters, unlocks and unmaps everything.
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A buffer of at least size_bytes (rounded up to 2 MiB), contents unspecified.
  // InvalidArgument: size_bytes is 0. ResourceExhausted: it would take the pool over budget.
  // IOError: mmap failed (errno in the message).
  Result<PinnedBuffer> Allocate(size_t size_bytes);

  size_t budget_bytes() const noexcept { return options_.budget_bytes; }
  // Bytes mapped now (in use + cached) and in use by live buffers.
  size_t mapped_bytes() const;
  size_t in_use_bytes() const;
  // Highest mapped_bytes() ever seen; never above budget_bytes().
  size_t peak_mapped_bytes() const;
  // What degraded, one line per cause ("mlock refused: ..."); empty when nothing did.
  std::string note() const;
  // Whether the pool registers its buffers with CUDA (register_with_cuda, CUDA built): a buffer
  // with registered() is then page-locked for CUDA's copies.
  bool registers_with_cuda() const noexcept { return cuda_registrar_ != nullptr; }
  // Drops every cached (released) mapping.
  void Trim();

 private:
  struct Mapping {
    void* base = nullptr;
    size_t bytes = 0;
    bool locked = false;
    bool registered = false;
    uint64_t registered_mask = 0;  // bit i: registrars_[i] accepted it
  };
  explicit PinnedPool(PinnedPoolOptions options) : options_(std::move(options)) {}
  Result<Mapping> MapLocked(size_t bytes);  // REQUIRES: mu_ held
  void UnmapLocked(const Mapping& m);       // REQUIRES: mu_ held
  void AddNoteLocked(const std::string& line);
  void Release(PinnedBuffer& b) noexcept;
  friend class PinnedBuffer;

  PinnedPoolOptions options_;
  std::unique_ptr<HostMemoryRegistrar> cuda_registrar_;
  std::vector<HostMemoryRegistrar*> registrars_;  // CUDA's first, then options_.registrars
  std::vector<bool> refused_;                     // registrars_[i] refused once: not asked again
  mutable std::mutex mu_;
  std::multimap<size_t, Mapping> cached_;  // released mappings by size
  std::map<void*, Mapping> in_use_;        // live buffers by base address
  size_t mapped_bytes_ = 0;
  size_t in_use_bytes_ = 0;
  size_t peak_mapped_bytes_ = 0;
  bool lock_refused_ = false;
  std::string note_;
};

}  // namespace strata::cpu
