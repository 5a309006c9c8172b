// KernelPool: the threads the CPU kernels run on. A oneTBB arena of a fixed number of threads
// (the calling thread included), optionally with each worker bound to its own core by hwloc.
// Work is cut into fixed tiles of `tile_elems` elements; tile k is always [k*tile, (k+1)*tile),
// whatever the thread count, so kernels whose per-element work does not depend on neighbours
// (Adam, casts) and reductions that merge tile partials exactly (grad_stats.h) give bitwise
// identical results for any thread count.
//
// Thread safety: ForEachTile may be called from several threads at once (they share the arena's
// threads). Creating and destroying a pool is not thread-safe with respect to that pool.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "strata/status.h"

namespace strata::kernels {

struct PoolOptions {
  // Threads in the arena, the calling thread included. 0: one per logical CPU this process may
  // run on. More threads than cores only adds contention on a memory-bound kernel.
  int threads = 0;
  // Bind each TBB worker thread to one core (round robin over the cores hwloc reports). The
  // calling thread is never rebound. Helps on multi-socket machines; harmless elsewhere.
  bool bind_threads = false;
  // Elements per tile. A tile should fit in L2 with all the streams of a kernel (Adam: 28 bytes
  // per element with bf16 grad and param out, so 64 Ki elements = 1.75 MiB). Must be > 0;
  // rounded up to a multiple of 1024 so streaming stores stay aligned at every tile start.
  size_t tile_elems = 64 * 1024;
};

class KernelPool {
 public:
  // InvalidArgument: threads < 0 or tile_elems == 0. Unavailable: bind_threads was asked and
  // hwloc could not load the topology.
  static Result<std::unique_ptr<KernelPool>> Create(const PoolOptions& options);
  ~KernelPool();
  KernelPool(const KernelPool&) = delete;
  KernelPool& operator=(const KernelPool&) = delete;

  int threads() const noexcept;
  size_t tile_elems() const noexcept;
  // Workers whose hwloc binding failed so far (the kernel still ran on them, unbound).
  int bind_failures() const noexcept;

  // Calls fn(ctx, slot, begin, end) for every tile of [0, n) of `tile` elements (0: tile_elems())
  // and returns when all calls have returned. `slot` in [0, threads()) names the thread running
  // the call (for per-thread partials). Tiles are handed out statically: thread j gets a
  // contiguous run of tiles. REQUIRES: fn does not throw.
  using TileFn = void (*)(void* ctx, int slot, size_t begin, size_t end);
  void ForEachTile(size_t n, size_t tile, TileFn fn, void* ctx);

  // Per-thread scratch for reductions (a call's partials), made at Create so a pooled reduction
  // allocates nothing: threads() slots of kScratchSlotBytes, each 64-byte aligned (no false
  // sharing). A Scratch is held by one call at a time; a caller that finds it taken by a
  // concurrent call on another thread gets a private heap copy (allocates, still correct).
  static constexpr size_t kScratchSlotBytes = 256;
  struct alignas(64) ScratchSlot {
    unsigned char bytes[kScratchSlotBytes];
  };
  class Scratch {
   public:
    Scratch(Scratch&& other) noexcept;
    Scratch& operator=(Scratch&&) = delete;
    ~Scratch();
    // Raw storage of slot i in [0, threads()); the caller constructs what it keeps there.
    void* slot(int i) const { return slots_[i].bytes; }

   private:
    friend class KernelPool;
    Scratch(ScratchSlot* slots, void* lock, std::unique_ptr<ScratchSlot[]> owned);
    ScratchSlot* slots_;
    void* lock_;  // the pool's mutex while held, else nullptr
    std::unique_ptr<ScratchSlot[]> owned_;
  };
  Scratch AcquireScratch();

  template <class F>  // F: void(int slot, size_t begin, size_t end)
  void ForEachTile(size_t n, size_t tile, F& f) {
    ForEachTile(
        n, tile,
        [](void* ctx, int slot, size_t b, size_t e) { (*static_cast<F*>(ctx))(slot, b, e); }, &f);
  }

 private:
  struct Impl;
  explicit KernelPool(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Rounds a requested tile up to the pool's alignment unit (1024 elements).
size_t RoundTile(size_t tile_elems);

// Thread counts a benchmark sweeps for "1..max": 1, 2, 4, ... (powers of two below max) and max
// itself, so a many-core machine is measured in a few steps. max_threads 0: one per logical CPU.
std::vector<int> ThreadLadder(int max_threads);

}  // namespace strata::kernels
