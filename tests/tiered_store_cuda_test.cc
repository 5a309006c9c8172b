// TieredStore over the CUDA device (LABELS gpu; skipped without a GPU): a device-homed block is
// zero-filled on the GPU from the store's registered zero extent, in several copies when it is
// larger than the extent, and its bytes round-trip device -> host -> device; a pinned host slab
// is page-locked for CUDA.
#include <chrono>
#include <cstring>

#include <gtest/gtest.h>

#include "strata/store.h"

namespace strata::store {
namespace {

using namespace std::chrono_literals;

// A CUDA device with a 64 MiB budget; Unavailable (the test skips) without a GPU.
Result<std::unique_ptr<Device>> Gpu() {
  CudaDeviceOptions co;
  co.budget_bytes = 64 << 20;
  return CreateCudaDevice(co);
}

#define SKIP_WITHOUT_GPU(dev)                                                \
  if (!(dev).ok() && (dev).status().code() == Status::Code::kUnavailable) { \
    GTEST_SKIP() << "no GPU: " << (dev).status().ToString();                \
  }                                                                          \
  ASSERT_TRUE((dev).ok()) << (dev).status().ToString()

TEST(StoreCuda, DeviceHomeIsZeroFilledAndRoundTrips) {
  auto dev = Gpu();
  SKIP_WITHOUT_GPU(dev);
  TieredStoreOptions o;
  o.device_budget_bytes = 32 << 20;
  o.host_budget_bytes = 16 << 20;
  o.device = dev->get();
  o.use_pinned_pool = false;
  o.io_deadline = 10s;
  auto s = OpenTieredStore(std::move(o));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  Store& store = **s;
  const uint64_t size = (3 << 20) + 5;  // four copies from the 1 MiB zero extent
  auto id = store.Register({"d", size, DType::kBF16, StateKind::kParam16, Tier::kDevice});
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  auto count = [&](uint8_t v) {
    auto l = store.Acquire(*id, Tier::kHost, Access::kRead, 10s);  // device -> host
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    if (!l.ok()) return uint64_t{0};
    const uint8_t* p = static_cast<const uint8_t*>(l->data());
    uint64_t n = 0;
    for (uint64_t i = 0; i < size; ++i) n += p[i] == v;
    return n;
  };
  EXPECT_EQ(count(0), size);
  {
    auto w = store.Acquire(*id, Tier::kHost, Access::kWrite, 10s);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    std::memset(w->data(), 7, size);
    w->MarkDirty();
  }
  ASSERT_TRUE(store.WriteBack(*id).Wait(10s).ok());  // host -> device home
  ASSERT_TRUE(store.Evict(*id, Tier::kHost).Wait(10s).ok());
  EXPECT_EQ(count(7), size);
}

// The host slab of a store with the pinned pool and locking (pin_memory) is page-locked for
// CUDA's copies (a device copy may land in a host block directly: the engine's 16-bit gradients);
// without locking it is not.
TEST(StoreCuda, PinnedHostSlabIsPageLockedForCuda) {
  auto dev = Gpu();
  SKIP_WITHOUT_GPU(dev);
  for (const bool lock : {true, false}) {
    TieredStoreOptions o;
    o.device_budget_bytes = 8 << 20;
    o.host_budget_bytes = 8 << 20;
    o.device = dev->get();
    o.use_pinned_pool = true;
    o.lock_host_memory = lock;
    o.io_deadline = 10s;
    auto s = OpenTieredStore(std::move(o));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    // Locking may be refused (RLIMIT_MEMLOCK): then the store says so in its note.
    if (lock && !(*s)->host_page_locked()) {
      EXPECT_NE((*s)->note().find("lock"), std::string::npos) << (*s)->note();
    }
    if (!lock) EXPECT_FALSE((*s)->host_page_locked());
  }
}

}  // namespace
}  // namespace strata::store
