// TieredStore::SetAside / RestoreAside (include/strata/store.h): device-homed blocks moved into
// host memory outside the budgets and back, bit for bit; the device tier's room freed meanwhile;
// every operation on a block set aside refused by name; the checks that change nothing; a
// restore the device has no room for leaving the rest aside until a later call.
#include <cstring>
#include <vector>

#include "tests/store_test_util.h"

namespace strata::testing {
namespace {

class StoreAsideTest : public StoreTest {};

// Writes a distinct pattern (byte i = seed + i) into device-homed block `id`.
void Pattern(Store& store, BlockId id, uint8_t seed) {
  auto l = store.Acquire(id, Tier::kDevice, Access::kWrite, kWait);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  auto* p = static_cast<uint8_t*>(l->data());
  for (uint64_t i = 0; i < l->size_bytes(); ++i) p[i] = static_cast<uint8_t>(seed + i);
  l->MarkDirty();
}

bool HasPattern(Store& store, BlockId id, uint8_t seed) {
  auto l = store.Acquire(id, Tier::kDevice, Access::kRead, kWait);
  EXPECT_TRUE(l.ok()) << l.status().ToString();
  if (!l.ok()) return false;
  const auto* p = static_cast<const uint8_t*>(l->data());
  for (uint64_t i = 0; i < l->size_bytes(); ++i) {
    if (p[i] != static_cast<uint8_t>(seed + i)) return false;
  }
  return true;
}

TEST_F(StoreAsideTest, BlocksComeBackBitForBitAndTheirRoomIsFreeMeanwhile) {
  Open(Budgets{.device_blocks = 3});
  const BlockId a = Reg("a", Tier::kDevice), b = Reg("b", Tier::kDevice, kBlock - 100);
  const BlockId c = Reg("c", Tier::kDevice);
  Pattern(*store_, a, 1);
  Pattern(*store_, b, 2);
  Pattern(*store_, c, 3);
  const uint64_t device_in_use = device_->stats().used_bytes;
  const BlockId ab[] = {a, b};
  ASSERT_TRUE(store_->SetAside(ab, /*pin=*/true).ok());
  EXPECT_EQ(store_->aside_bytes(), 2 * kBlock);  // b's room is rounded as its device copy was
  EXPECT_EQ(store_->TakeStats(false).used_bytes[Tier::kDevice], kBlock);
  EXPECT_EQ(device_->stats().used_bytes, device_in_use - 2 * kBlock);
  EXPECT_EQ(store_->residency(a, Tier::kDevice), Residency::kAbsent);
  // The device tier's room is free: two new blocks fit where a and b were.
  const BlockId d = Reg("d", Tier::kDevice), e = Reg("e", Tier::kDevice);
  EXPECT_TRUE(HasPattern(*store_, c, 3));  // the others are untouched
  // Every operation on a block set aside is refused by name.
  for (const Status& st :
       {store_->Acquire(a, Tier::kDevice, Access::kRead, kWait).status(),
        store_->Acquire(b, Tier::kHost, Access::kWrite, kWait).status(),
        store_->Fetch(a, Tier::kHost).Wait(kWait), store_->WriteBack(a).Wait(kWait),
        store_->Evict(b, Tier::kHost).Wait(kWait)}) {
    EXPECT_TRUE(st.code() == Status::Code::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.message().find("set aside"), std::string::npos) << st.ToString();
  }
  // No room to restore while d and e hold it: ResourceExhausted naming the block and the tier,
  // nothing lost.
  Status st = store_->RestoreAside(ab);
  EXPECT_TRUE(st.IsResourceExhausted()) << st.ToString();
  EXPECT_NE(st.message().find("block 'a'"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("hbm"), std::string::npos) << st.ToString();
  EXPECT_EQ(store_->aside_bytes(), 2 * kBlock);
  EXPECT_NE(d, e);
  ExpectWithinBudgets();
}

TEST_F(StoreAsideTest, ARestoreWithRoomForSomeLeavesTheRestAsideForALaterCall) {
  Open(Budgets{.device_blocks = 2});
  const BlockId a = Reg("a", Tier::kDevice), b = Reg("b", Tier::kDevice);
  Pattern(*store_, a, 10);
  Pattern(*store_, b, 20);
  const BlockId ab[] = {a, b};
  ASSERT_TRUE(store_->SetAside(ab, /*pin=*/false).ok());
  const BlockId x = Reg("x", Tier::kDevice);  // takes one block's room meanwhile
  Status st = store_->RestoreAside(ab);
  ASSERT_TRUE(st.IsResourceExhausted()) << st.ToString();
  EXPECT_NE(st.message().find("block 'b'"), std::string::npos) << st.ToString();
  EXPECT_TRUE(HasPattern(*store_, a, 10));
  EXPECT_EQ(store_->aside_bytes(), kBlock);
  EXPECT_EQ(store_->Acquire(b, Tier::kDevice, Access::kRead, kWait).status().code(),
            Status::Code::kFailedPrecondition);
  EXPECT_NE(x, a);
  ExpectWithinBudgets();
}

TEST_F(StoreAsideTest, RestoreFinishesOnceTheRoomIsBack) {
  Open(Budgets{.device_blocks = 2, .host_blocks = 2});
  const BlockId a = Reg("a", Tier::kDevice), b = Reg("b", Tier::kDevice);
  const BlockId h = Reg("h", Tier::kHost);
  Pattern(*store_, a, 5);
  Pattern(*store_, b, 6);
  const BlockId ab[] = {a, b};
  ASSERT_TRUE(store_->SetAside(ab, /*pin=*/true).ok());
  // Meanwhile the device tier caches a host-homed block; a restore then has room for one block.
  Write(h, Tier::kDevice, 7);
  EXPECT_TRUE(store_->RestoreAside(ab).IsResourceExhausted());
  ASSERT_TRUE(store_->Evict(h, Tier::kDevice).Wait(kWait).ok());
  ASSERT_TRUE(store_->RestoreAside(ab).ok());
  EXPECT_EQ(store_->aside_bytes(), 0u);
  EXPECT_TRUE(HasPattern(*store_, a, 5));
  EXPECT_TRUE(HasPattern(*store_, b, 6));
  EXPECT_EQ(Read(h, Tier::kHost), 7);
  EXPECT_TRUE(store_->RestoreAside(ab).ok());  // nothing aside: nothing to do
  ExpectWithinBudgets();
}

TEST_F(StoreAsideTest, ChecksChangeNothing) {
  Open(Budgets{.device_blocks = 4});
  const BlockId a = Reg("a", Tier::kDevice), h = Reg("h", Tier::kHost);
  const BlockId cached = Reg("cached", Tier::kDevice);
  Pattern(*store_, a, 9);
  Pattern(*store_, cached, 4);
  ASSERT_TRUE(store_->Fetch(cached, Tier::kHost).Wait(kWait).ok());  // a host copy too
  uint64_t aside = 0;  // what is set aside before each refused call, and after it
  const auto refused = [&](std::vector<BlockId> ids, const char* what) {
    Status st = store_->SetAside(ids, true);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find(what), std::string::npos) << st.ToString();
    EXPECT_EQ(store_->aside_bytes(), aside);
  };
  refused({a, h}, "not homed on the device");
  refused({a, a}, "named twice");
  refused({a, cached}, "another tier");
  refused({a, 99}, "no block 99");
  {
    auto lease = store_->Acquire(a, Tier::kDevice, Access::kRead, kWait);
    ASSERT_TRUE(lease.ok());
    refused({a}, "leased");
  }
  EXPECT_TRUE(HasPattern(*store_, a, 9));
  const BlockId just_a[] = {a};
  ASSERT_TRUE(store_->SetAside(just_a, true).ok());
  aside = kBlock;
  refused({a}, "set aside already");
  ASSERT_TRUE(store_->RestoreAside(just_a).ok());
  EXPECT_TRUE(HasPattern(*store_, a, 9));
  EXPECT_TRUE(store_->RestoreAside(std::vector<BlockId>{99}).IsInvalidArgument());
}

// The page-locked memory a restore empties is kept and reused (no new registration), and given
// up when a call needs more, or asks for unlocked memory; the bytes round-trip every time.
TEST_F(StoreAsideTest, PageLockedMemoryIsKeptForTheNextSetAside) {
  Open(Budgets{.device_blocks = 4});
  const BlockId a = Reg("a", Tier::kDevice), b = Reg("b", Tier::kDevice);
  const BlockId both[] = {a, b}, just_a[] = {a};
  for (int round = 0; round < 3; ++round) {
    Pattern(*store_, a, static_cast<uint8_t>(round));
    Pattern(*store_, b, static_cast<uint8_t>(round + 100));
    ASSERT_TRUE(store_->SetAside(both, /*pin=*/true).ok());
    EXPECT_EQ(store_->aside_kept_bytes(), 0u);  // in use, not kept
    ASSERT_TRUE(store_->RestoreAside(both).ok());
    EXPECT_EQ(store_->aside_kept_bytes(), 2 * kBlock);
    EXPECT_TRUE(HasPattern(*store_, a, static_cast<uint8_t>(round)));
    EXPECT_TRUE(HasPattern(*store_, b, static_cast<uint8_t>(round + 100)));
  }
  // A smaller set fits in it; a restore of part of an arena keeps nothing yet.
  ASSERT_TRUE(store_->SetAside(just_a, true).ok());
  EXPECT_EQ(store_->aside_kept_bytes(), 0u);
  ASSERT_TRUE(store_->RestoreAside(just_a).ok());
  EXPECT_EQ(store_->aside_kept_bytes(), 2 * kBlock);
  ASSERT_TRUE(store_->SetAside(both, true).ok());
  const BlockId just_b[] = {b};
  ASSERT_TRUE(store_->RestoreAside(just_a).ok());
  EXPECT_EQ(store_->aside_kept_bytes(), 0u);  // b still uses it
  ASSERT_TRUE(store_->RestoreAside(just_b).ok());
  EXPECT_EQ(store_->aside_kept_bytes(), 2 * kBlock);
  // Unlocked memory asked for: the kept arena goes.
  ASSERT_TRUE(store_->SetAside(both, /*pin=*/false).ok());
  ASSERT_TRUE(store_->RestoreAside(both).ok());
  EXPECT_EQ(store_->aside_kept_bytes(), 0u);
  EXPECT_TRUE(HasPattern(*store_, a, 2));
}

}  // namespace
}  // namespace strata::testing
