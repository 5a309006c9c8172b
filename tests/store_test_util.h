// The fixture of the TieredStore tests: a store over the HostDevice and the simulated IO
// backend (seeded latencies, reordered completions, injected faults) with budgets counted in
// blocks, and helpers to write, persist and read whole blocks. Every wait is bounded; a failing
// helper prints the seed.
#pragma once

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "nvme/sim_backend.h"
#include "strata/store.h"
#include "tests/io_test_util.h"

namespace strata::testing {

inline constexpr auto kWait = std::chrono::seconds(20);
inline constexpr uint64_t kBlock = 16 << 10;

struct Budgets {
  uint64_t device_blocks = 4, host_blocks = 4, nvme_blocks = 64;
};

class StoreTest : public ::testing::Test {
 protected:
  // Opens the store over a HostDevice and a SimBackend seeded with `seed`. `customize` may
  // change the options (or wrap device_ / the backend) before the store opens.
  void Open(Budgets b, uint64_t seed = 7,
            const std::function<void(TieredStoreOptions&)>& customize = {}) {
    seed_ = seed;
    HostDeviceOptions ho;
    ho.budget_bytes = 64 << 20;
    auto dev = CreateHostDevice(ho);
    ASSERT_TRUE(dev.ok());
    device_ = std::move(dev).value();
    nvme::SimOptions so;
    so.seed = seed;
    so.queue_depth = 8;
    auto sim = std::make_unique<nvme::SimBackend>(so);
    sim_ = sim.get();
    TieredStoreOptions o;
    o.device_budget_bytes = b.device_blocks * kBlock;
    o.host_budget_bytes = b.host_blocks * kBlock;
    o.nvme_capacity_bytes = b.nvme_blocks * kBlock;
    o.device = device_.get();
    o.io = std::move(sim);
    o.nvme_paths = {dir_.path()};
    o.use_pinned_pool = false;
    if (customize) customize(o);
    auto s = OpenTieredStore(std::move(o));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(s).value();
  }
  BlockId Reg(const std::string& name, Tier home, uint64_t size = kBlock) {
    auto id = store_->Register(BlockSpec{name, size, DType::kBF16, StateKind::kParam16, home});
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    return id.ok() ? *id : 0;
  }
  // Writes `v` into every byte of block `id` through a write lease on `tier`.
  void Write(BlockId id, Tier tier, uint8_t v) {
    auto l = store_->Acquire(id, tier, Access::kWrite, kWait);
    ASSERT_TRUE(l.ok()) << l.status().ToString() << " seed " << seed_ << "\n"
                        << store_->DebugString();
    std::memset(l->data(), v, l->size_bytes());
    l->MarkDirty();
  }
  // Makes `v` the value of NVMe-homed block `id` on NVMe only (written back, host copy evicted).
  void Persist(BlockId id, uint8_t v) {
    Write(id, Tier::kHost, v);
    ASSERT_TRUE(store_->WriteBack(id).Wait(kWait).ok());
    ASSERT_TRUE(store_->Evict(id, Tier::kHost).Wait(kWait).ok());
  }
  // Every byte of block `id` on `tier`, or -1 when they differ.
  int Read(BlockId id, Tier tier) {
    auto l = store_->Acquire(id, tier, Access::kRead, kWait);
    EXPECT_TRUE(l.ok()) << l.status().ToString() << " seed " << seed_ << "\n"
                        << store_->DebugString();
    if (!l.ok()) return -2;
    const uint8_t* p = static_cast<const uint8_t*>(l->data());
    for (uint64_t i = 1; i < l->size_bytes(); ++i) {
      if (p[i] != p[0]) return -1;
    }
    return p[0];
  }
  void ExpectWithinBudgets() {
    StoreStats s = store_->TakeStats(false);
    for (Tier t : kAllTiers) {
      EXPECT_LE(s.peak_bytes[t], s.budget_bytes[t]) << "tier " << TierName(t);
    }
  }

  uint64_t seed_ = 0;
  TempDir dir_{"store"};
  std::unique_ptr<Device> device_;
  nvme::SimBackend* sim_ = nullptr;
  std::unique_ptr<Store> store_;
};

// Polls `pred` every millisecond until it holds (true) or kWait passed (false).
template <class P>
bool Eventually(P pred) {
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace strata::testing
