// Access::kOverwrite (include/strata/store.h): a write lease on a copy that is reserved but not
// filled, for callers that replace every byte (the engine's gradients at the first micro-step).
// No NVMe read and no device copy happen for it; released without MarkDirty the unfilled copy is
// dropped and the old bytes stay readable; it is as exclusive as a write lease.
#include <cstring>

#include <gtest/gtest.h>

#include "strata/store.h"
#include "tests/store_test_util.h"

namespace strata::store {
namespace {

using namespace std::chrono_literals;
using testing::kBlock;
using testing::kWait;
using testing::StoreTest;

uint64_t NvmeReads(Store& s) { return s.TakeStats(false).bytes_moved[Tier::kNvme][Tier::kHost]; }

TEST_F(StoreTest, OverwriteOfAnNvmeBlockReadsNothing) {
  Open({});
  BlockId b = Reg("grad", Tier::kNvme);
  Persist(b, 0x11);
  const uint64_t before = NvmeReads(*store_);
  {
    auto l = store_->Acquire(b, Tier::kHost, Access::kOverwrite, kWait);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    EXPECT_EQ(l->access(), Access::kOverwrite);
    std::memset(l->data(), 0x22, l->size_bytes());
    l->MarkDirty();
  }
  EXPECT_EQ(NvmeReads(*store_), before);  // the old bytes were never read
  EXPECT_EQ(store_->residency(b, Tier::kHost), Residency::kDirty);
  EXPECT_EQ(store_->residency(b, Tier::kNvme), Residency::kStale);
  ASSERT_TRUE(store_->WriteBack(b).Wait(kWait).ok());
  ASSERT_TRUE(store_->Evict(b, Tier::kHost).Wait(kWait).ok());
  EXPECT_EQ(Read(b, Tier::kHost), 0x22);  // written back and read from NVMe (checksum verified)
  EXPECT_EQ(NvmeReads(*store_), before + kBlock);
  ExpectWithinBudgets();
}

TEST_F(StoreTest, OverwriteReleasedCleanDropsTheUnfilledCopy) {
  Open({});
  BlockId b = Reg("grad", Tier::kNvme);
  Persist(b, 0x33);
  {
    auto l = store_->Acquire(b, Tier::kHost, Access::kOverwrite, kWait);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    std::memset(l->data(), 0x44, l->size_bytes() / 2);  // half written, never marked dirty
  }
  EXPECT_EQ(store_->residency(b, Tier::kHost), Residency::kAbsent);
  EXPECT_EQ(store_->residency(b, Tier::kNvme), Residency::kValid);
  EXPECT_EQ(Read(b, Tier::kHost), 0x33);  // the old bytes, fetched from NVMe
}

TEST_F(StoreTest, OverwriteOfAValidCopyIsAWriteLease) {
  Open({});
  BlockId b = Reg("grad", Tier::kNvme);
  Persist(b, 0x55);
  EXPECT_EQ(Read(b, Tier::kHost), 0x55);  // now valid on the host
  {
    auto l = store_->Acquire(b, Tier::kHost, Access::kOverwrite, kWait);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    EXPECT_EQ(static_cast<const uint8_t*>(l->data())[0], 0x55);
  }  // released clean: a valid copy is kept, as after a write lease
  EXPECT_EQ(store_->residency(b, Tier::kHost), Residency::kValid);
  EXPECT_EQ(Read(b, Tier::kHost), 0x55);
}

TEST_F(StoreTest, OverwriteOnTheDeviceCopiesNothingUp) {
  Open({});
  BlockId b = Reg("param", Tier::kHost);
  Write(b, Tier::kHost, 0x66);
  const uint64_t copies = store_->TakeStats(false).bytes_moved[Tier::kHost][Tier::kDevice];
  {
    auto l = store_->Acquire(b, Tier::kDevice, Access::kOverwrite, kWait);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    std::memset(l->data(), 0x77, l->size_bytes());  // HostDevice memory is host-addressable
    l->MarkDirty();
  }
  EXPECT_EQ(store_->TakeStats(false).bytes_moved[Tier::kHost][Tier::kDevice], copies);
  EXPECT_EQ(store_->residency(b, Tier::kHost), Residency::kStale);
  EXPECT_EQ(Read(b, Tier::kDevice), 0x77);
  ASSERT_TRUE(store_->WriteBack(b).Wait(kWait).ok());
  EXPECT_EQ(Read(b, Tier::kHost), 0x77);
}

TEST_F(StoreTest, OverwriteWaitsForReaders) {
  Open({});
  BlockId b = Reg("grad", Tier::kNvme);
  Persist(b, 0x12);
  auto reader = store_->Acquire(b, Tier::kHost, Access::kRead, kWait);
  ASSERT_TRUE(reader.ok());
  auto w = store_->Acquire(b, Tier::kHost, Access::kOverwrite, 50ms);
  EXPECT_TRUE(w.status().IsDeadlineExceeded()) << w.status().ToString();
  EXPECT_EQ(static_cast<const uint8_t*>(reader->data())[0], 0x12);
  reader->Release();
  auto w2 = store_->Acquire(b, Tier::kHost, Access::kOverwrite, kWait);
  ASSERT_TRUE(w2.ok()) << w2.status().ToString();
}

}  // namespace
}  // namespace strata::store
