#include "kernels/pool.h"

#include <hwloc.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

namespace strata::kernels {
namespace {

constexpr size_t kTileUnit = 1024;

// Binds every worker that enters the arena to core (slot % cores).
class BindObserver : public tbb::task_scheduler_observer {
 public:
  BindObserver(tbb::task_arena& arena, hwloc_topology_t topo)
      : tbb::task_scheduler_observer(arena), topo_(topo) {
    cores_ = hwloc_get_nbobjs_by_type(topo_, HWLOC_OBJ_CORE);
    if (cores_ <= 0) cores_ = 0;
  }
  void on_scheduler_entry(bool is_worker) override {
    if (!is_worker || cores_ == 0) return;
    const int slot = tbb::this_task_arena::current_thread_index();
    hwloc_obj_t core = hwloc_get_obj_by_type(topo_, HWLOC_OBJ_CORE, slot % cores_);
    if (core == nullptr || hwloc_set_cpubind(topo_, core->cpuset, HWLOC_CPUBIND_THREAD) != 0) {
      failures_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  int failures() const { return failures_.load(std::memory_order_relaxed); }

 private:
  hwloc_topology_t topo_;
  int cores_ = 0;
  std::atomic<int> failures_{0};
};

}  // namespace

size_t RoundTile(size_t tile_elems) { return (tile_elems + kTileUnit - 1) / kTileUnit * kTileUnit; }

std::vector<int> ThreadLadder(int max_threads) {
  const int max = max_threads > 0 ? max_threads : tbb::this_task_arena::max_concurrency();
  std::vector<int> v;
  for (int t = 1; t < max; t *= 2) v.push_back(t);
  v.push_back(max);
  return v;
}

struct KernelPool::Impl {
  int threads = 1;
  size_t tile = kTileUnit;
  tbb::task_arena arena;
  std::unique_ptr<KernelPool::ScratchSlot[]> scratch;  // threads slots
  std::mutex scratch_mu;
  hwloc_topology_t topo = nullptr;
  std::unique_ptr<BindObserver> observer;

  ~Impl() {
    if (observer) observer->observe(false);
    observer.reset();
    if (topo != nullptr) hwloc_topology_destroy(topo);
  }
};

Result<std::unique_ptr<KernelPool>> KernelPool::Create(const PoolOptions& options) {
  if (options.threads < 0) {
    return Status::InvalidArgument("kernel pool: threads must be >= 0 (0 = all CPUs), got " +
                                   std::to_string(options.threads));
  }
  if (options.tile_elems == 0) return Status::InvalidArgument("kernel pool: tile_elems is 0");
  auto impl = std::make_unique<Impl>();
  impl->threads = options.threads > 0 ? options.threads : tbb::this_task_arena::max_concurrency();
  impl->tile = RoundTile(options.tile_elems);
  impl->scratch = std::make_unique<ScratchSlot[]>(static_cast<size_t>(impl->threads));
  impl->arena.initialize(impl->threads);
  if (options.bind_threads) {
    if (hwloc_topology_init(&impl->topo) != 0) {
      impl->topo = nullptr;
      return Status::Unavailable("kernel pool: hwloc_topology_init failed");
    }
    if (hwloc_topology_load(impl->topo) != 0) {
      return Status::Unavailable("kernel pool: hwloc_topology_load failed");
    }
    impl->observer = std::make_unique<BindObserver>(impl->arena, impl->topo);
    impl->observer->observe(true);
  }
  return std::unique_ptr<KernelPool>(new KernelPool(std::move(impl)));
}

KernelPool::KernelPool(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KernelPool::~KernelPool() = default;

int KernelPool::threads() const noexcept { return impl_->threads; }
size_t KernelPool::tile_elems() const noexcept { return impl_->tile; }
int KernelPool::bind_failures() const noexcept {
  return impl_->observer ? impl_->observer->failures() : 0;
}

KernelPool::Scratch::Scratch(ScratchSlot* slots, void* lock, std::unique_ptr<ScratchSlot[]> owned)
    : slots_(slots), lock_(lock), owned_(std::move(owned)) {}

KernelPool::Scratch::Scratch(Scratch&& other) noexcept
    : slots_(other.slots_), lock_(other.lock_), owned_(std::move(other.owned_)) {
  other.lock_ = nullptr;
}

KernelPool::Scratch::~Scratch() {
  if (lock_ != nullptr) static_cast<std::mutex*>(lock_)->unlock();
}

KernelPool::Scratch KernelPool::AcquireScratch() {
  if (impl_->scratch_mu.try_lock()) return Scratch(impl_->scratch.get(), &impl_->scratch_mu, {});
  auto owned = std::make_unique<ScratchSlot[]>(static_cast<size_t>(impl_->threads));
  ScratchSlot* slots = owned.get();
  return Scratch(slots, nullptr, std::move(owned));
}

void KernelPool::ForEachTile(size_t n, size_t tile, TileFn fn, void* ctx) {
  if (n == 0) return;
  const size_t t = tile == 0 ? impl_->tile : tile;
  const size_t tiles = (n + t - 1) / t;
  if (tiles == 1 || impl_->threads == 1) {
    // No parallelism to gain: run inline, still tile by tile (same partials as in parallel).
    for (size_t k = 0; k < tiles; ++k) fn(ctx, 0, k * t, std::min(n, (k + 1) * t));
    return;
  }
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer cannot see oneTBB's task hand-off (libtbb is not instrumented) and reports it
  // as races. Under TSan the same static split (thread j: a contiguous run of tiles) runs on
  // plain threads, so the kernels' own accesses are still checked with real concurrency.
  {
    const size_t per = (tiles + impl_->threads - 1) / impl_->threads;
    std::vector<std::thread> workers;
    for (int j = 0; j < impl_->threads; ++j) {
      workers.emplace_back([=] {
        for (size_t k = j * per; k < std::min(tiles, (j + 1) * per); ++k) {
          fn(ctx, j, k * t, std::min(n, (k + 1) * t));
        }
      });
    }
    for (auto& w : workers) w.join();
    return;
  }
#endif
  impl_->arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, tiles, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          const int slot = tbb::this_task_arena::current_thread_index();
          for (size_t k = r.begin(); k != r.end(); ++k) {
            fn(ctx, slot, k * t, std::min(n, (k + 1) * t));
          }
        },
        tbb::static_partitioner());
  });
}

}  // namespace strata::kernels
