// ZeRO partitioning (pure) and the bucketed collectives over the Gloo backend with 2 and 4 ranks:
// padded shards, bucket boundaries, results against a local reference, and the byte ledger
// (stage 3 moves 1.5x the traffic of stages 0-2).
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <mutex>

#include "core/zero/zero_collectives.h"
#include "cpu/gloo_comm.h"
#include "cpu/rendezvous/rendezvous.h"
#include "sched/zero_partition.h"
#include "strata/planner.h"
#include "tests/multiprocess.h"

namespace strata {
namespace {
using sched::GroupShard;
using sched::PlanBuckets;
using sched::PlanPartition;
using zero::WaitAll;
using zero::ZeroCollectives;

using std::chrono::milliseconds;

TEST(ZeroPartition, PadsShardsToAlignmentAndLaysGroupsBackToBack) {
  const std::vector<size_t> numels = {10, 1, 0, 64};
  auto plan = PlanPartition(numels, 4, 4);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->groups.size(), 4u);
  EXPECT_EQ(plan->groups[0].shard_elems, 4u);  // ceil(10/4)=3 -> 4
  EXPECT_EQ(plan->groups[1].shard_elems, 4u);  // 1 -> 4
  EXPECT_EQ(plan->groups[2].shard_elems, 0u);
  EXPECT_EQ(plan->groups[3].shard_elems, 16u);
  EXPECT_EQ(plan->groups[3].shard_offset, 8u);
  EXPECT_EQ(plan->groups[3].full_offset, 32u);
  EXPECT_EQ(plan->shard_total_elems, 24u);
  EXPECT_EQ(plan->full_total_elems, 96u);
  // Group 0 (10 real elements, shards of 4): ranks own [0,4) [4,8) [8,10) and nothing.
  EXPECT_EQ(plan->groups[0].OwnedBegin(2), 8u);
  EXPECT_EQ(plan->groups[0].OwnedEnd(2), 10u);
  EXPECT_EQ(plan->groups[0].OwnedBegin(3), plan->groups[0].OwnedEnd(3));
  EXPECT_TRUE(PlanPartition(numels, 0, 4).status().IsInvalidArgument());
  EXPECT_TRUE(PlanPartition(numels, 2, 0).status().IsInvalidArgument());
}

TEST(ZeroPartition, BucketsRespectTheLimitAndIsolateLargeGroups) {
  const std::vector<size_t> numels = {8, 8, 8, 100, 8, 8};  // padded full: 8 8 8 100 8 8 (w=2,a=1)
  auto plan = PlanPartition(numels, 2, 1);
  ASSERT_TRUE(plan.ok());
  auto b = PlanBuckets(*plan, 0, 6, 16);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->size(), 4u);
  EXPECT_EQ((*b)[0].first, 0u);
  EXPECT_EQ((*b)[0].end, 2u);  // 8 + 8 = 16 fits exactly
  EXPECT_EQ((*b)[1].end, 3u);
  EXPECT_EQ((*b)[2].first, 3u);  // 100 > 16: alone
  EXPECT_EQ((*b)[2].end, 4u);
  EXPECT_EQ((*b)[3].full_elems, 16u);
  auto one = PlanBuckets(*plan, 1, 3, 1u << 30);
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0].full_elems, 16u);
  EXPECT_TRUE(PlanBuckets(*plan, 0, 6, 0).status().IsInvalidArgument());
  EXPECT_TRUE(PlanBuckets(*plan, 2, 7, 8).status().IsInvalidArgument());
}

// Global parameter element j of group g, and rank r's gradient of it: small integers (exact).
float Param(size_t g, size_t j) {
  return static_cast<float>(static_cast<int>((g * 31 + j) % 23) - 11);
}
float Grad(int r, size_t g, size_t j) {
  return static_cast<float>(static_cast<int>((g * 7 + j * 3 + r * 5) % 19) - 9);
}

std::string RunZeroStep(int r, int world, const std::string& dir, size_t bucket_elems) {
  auto fs = cpu::FileKvStore::Open(dir);
  if (!fs.ok()) return fs.status().ToString();
  GlooCommOptions o;
  o.rank = r;
  o.world_size = world;
  o.store = fs->get();
  o.timeout = milliseconds(30000);
  auto comm = CreateGlooCommunicator(o);
  if (!comm.ok()) return comm.status().ToString();
  Communicator& c = **comm;
  const std::vector<size_t> numels = {1000, 37, 5000, 1, 123, 0, 64};
  auto plan = PlanPartition(numels, world, 8);
  if (!plan.ok()) return plan.status().ToString();
  const DType dt = DType::kBF16;
  ZeroCollectives zc(&c, &*plan, dt);
  const auto deadline = [] { return std::chrono::steady_clock::now() + std::chrono::seconds(30); };

  // Local shards: the rank's owned real elements, zero padding.
  std::vector<bf16_t> shard(plan->shard_total_elems, bf16_t{0});
  for (size_t g = 0; g < numels.size(); ++g) {
    const GroupShard& s = plan->groups[g];
    for (size_t j = s.OwnedBegin(r); j < s.OwnedEnd(r); ++j) {
      shard[s.shard_offset + j - s.OwnedBegin(r)] = FloatToBf16(Param(g, j));
    }
  }
  auto buckets = PlanBuckets(*plan, 0, numels.size(), bucket_elems);
  if (!buckets.ok()) return buckets.status().ToString();

  // Forward and backward gathers (stage 3), then the gradient reduce-scatter.
  std::vector<bf16_t> full(plan->full_total_elems, bf16_t{0xffff});
  for (int pass = 0; pass < 2; ++pass) {
    auto hs = zc.AllGatherGroups(shard.data(), full.data(), 0, numels.size(), bucket_elems);
    if (!hs.ok()) return hs.status().ToString();
    if (hs->size() != buckets->size()) return "one handle per bucket expected";
    const Status st = WaitAll(*hs, deadline());
    if (!st.ok()) return st.ToString();
    for (size_t g = 0; g < numels.size(); ++g) {
      const GroupShard& s = plan->groups[g];
      for (size_t j = 0; j < s.padded_elems(world); ++j) {
        const float want = j < s.numel ? Param(g, j) : 0.0f;
        if (Bf16ToFloat(full[s.full_offset + j]) != want) {
          return "all-gather: group " + std::to_string(g) + " element " + std::to_string(j);
        }
      }
    }
  }
  std::vector<bf16_t> grads(plan->full_total_elems, bf16_t{0});
  for (size_t g = 0; g < numels.size(); ++g) {
    const GroupShard& s = plan->groups[g];
    for (size_t j = 0; j < s.numel; ++j) grads[s.full_offset + j] = FloatToBf16(Grad(r, g, j));
  }
  std::vector<bf16_t> grad_shard(plan->shard_total_elems, bf16_t{0xffff});
  auto rs = zc.ReduceScatterGroups(grads.data(), grad_shard.data(), 0, numels.size(), bucket_elems,
                                   {.predivide = true});
  if (!rs.ok()) return rs.status().ToString();
  Status st = WaitAll(*rs, deadline());
  if (!st.ok()) return st.ToString();
  for (size_t g = 0; g < numels.size(); ++g) {
    const GroupShard& s = plan->groups[g];
    for (size_t k = 0; k < s.shard_elems; ++k) {
      const size_t j = static_cast<size_t>(r) * s.shard_elems + k;
      float want = 0;
      if (j < s.numel) {
        for (int q = 0; q < world; ++q) want += Grad(q, g, j) / static_cast<float>(world);
      }
      if (Bf16ToFloat(grad_shard[s.shard_offset + k]) != Bf16ToFloat(FloatToBf16(want))) {
        return "reduce-scatter: group " + std::to_string(g) + " element " + std::to_string(j);
      }
    }
  }

  // The ledger, as the memory planner states it for this (padded) model with the bf16 recipe on
  // `world` ranks: stage 3 = 2 gathers + 1 reduce-scatter; stages 0-2 = one all-reduce's worth.
  PlanInput in;
  in.params = static_cast<double>(plan->full_total_elems);
  in.capacity.gpus_per_node = world;
  in.capacity.nodes = 1;
  const double ledger3 =
      Place(in, 3, OffloadDevice::kNone, OffloadDevice::kNone).comm.bytes_per_rank;
  const double ledger0 =
      Place(in, 0, OffloadDevice::kNone, OffloadDevice::kNone).comm.bytes_per_rank;
  const CommStats s3 = c.stats();
  const uint64_t stage3 = s3.total_sent_bytes();
  if (static_cast<double>(stage3) != ledger3) {
    return "ideal stage-3 bytes " + std::to_string(stage3) + " != ledger " +
           std::to_string(ledger3);
  }
  if (s3.of(CommOp::kAllGather).calls != 2 * numels.size()) return "AG calls";
  // On the wire: gathers move exactly the ideal bytes; the bf16 reduce-scatter sends its partial
  // sums in fp32, so twice the ideal.
  const CommOpBytes& ag = s3.of(CommOp::kAllGather);
  const CommOpBytes& rsb = s3.of(CommOp::kReduceScatter);
  if (ag.wire_sent_bytes != ag.sent_bytes || ag.wire_received_bytes != ag.received_bytes) {
    return "AG wire " + std::to_string(ag.wire_sent_bytes) + " vs ideal " +
           std::to_string(ag.sent_bytes);
  }
  if (rsb.wire_sent_bytes != 2 * rsb.sent_bytes ||
      rsb.wire_received_bytes != 2 * rsb.received_bytes) {
    return "RS wire " + std::to_string(rsb.wire_sent_bytes) + " vs ideal " +
           std::to_string(rsb.sent_bytes);
  }
  c.ResetStats();
  auto ar = c.AllReduce(grads.data(), grads.data(), grads.size(), dt);
  if (!ar.ok()) return ar.status().ToString();
  st = ar->WaitUntil(deadline());
  if (!st.ok()) return st.ToString();
  const CommStats s0 = c.stats();
  const uint64_t stage012 = s0.total_sent_bytes();
  if (static_cast<double>(stage012) != ledger0) {
    return "ideal stage-0 bytes " + std::to_string(stage012) + " != ledger " +
           std::to_string(ledger0);
  }
  if (2 * stage3 != 3 * stage012) {
    return "ledger: stage 3 sent " + std::to_string(stage3) + ", stages 0-2 " +
           std::to_string(stage012);
  }
  // bf16 all-reduce = fp32 reduce-scatter (2x) + bf16 all-gather (1x) of a 2x ideal: 1.5x.
  const CommOpBytes& arb = s0.of(CommOp::kAllReduce);
  if (2 * arb.wire_sent_bytes != 3 * arb.sent_bytes ||
      2 * arb.wire_received_bytes != 3 * arb.received_bytes) {
    return "AR wire " + std::to_string(arb.wire_sent_bytes) + " vs ideal " +
           std::to_string(arb.sent_bytes);
  }
  return "";
}

// A communicator whose all-gathers stay in flight until it is aborted (bounded: a work gives up
// after 20 s), and whose submit number `fail_at` fails, as a full queue would.
class StallingWork final : public CommWork {
 public:
  Status WaitUntil(std::chrono::steady_clock::time_point deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    const auto cap = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    if (!cv_.wait_until(lock, std::min(deadline, cap), [&] { return done_; })) {
      return Status::DeadlineExceeded("stalling work still running");
    }
    return Status::Aborted("aborted");
  }
  bool Ready() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void Finish() {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

class StallingComm final : public Communicator {
 public:
  StallingComm(int world, int fail_at) : Communicator(0, world), fail_at_(fail_at) {}
  std::string_view backend() const noexcept override { return "stalling"; }
  void Abort(std::string_view) override {
    aborted = true;
    for (auto& w : works) w->Finish();
  }
  std::vector<std::shared_ptr<StallingWork>> works;
  bool aborted = false;

 protected:
  Result<CommHandle> DoAllGather(std::span<const AllGatherPart>, DType) override { return Next(); }
  Result<CommHandle> DoReduceScatter(std::span<const ReduceScatterPart>, DType,
                                     ReduceOptions) override {
    return Next();
  }
  Result<CommHandle> DoAllReduce(const void*, void*, size_t, DType, ReduceOptions) override {
    return Next();
  }
  Result<CommHandle> DoBroadcast(void*, size_t, DType, int) override { return Next(); }
  Result<CommHandle> DoBarrier() override { return Next(); }

 private:
  Result<CommHandle> Next() {
    if (static_cast<int>(works.size()) == fail_at_) {
      return Status::ResourceExhausted("queue full");
    }
    works.push_back(std::make_shared<StallingWork>());
    return CommHandle(works.back());
  }
  const int fail_at_;
};

TEST(ZeroCollectives, FailedSubmitFinishesEarlierBucketsBeforeReturning) {
  const std::vector<size_t> numels = {16, 16, 16};
  auto plan = PlanPartition(numels, 2, 1);
  ASSERT_TRUE(plan.ok());
  std::vector<float> shard(plan->shard_total_elems), full(plan->full_total_elems);
  for (int kind = 0; kind < 2; ++kind) {
    StallingComm comm(2, /*fail_at=*/2);  // buckets 0 and 1 submitted, bucket 2 fails
    ZeroCollectives zc(&comm, &*plan, DType::kF32);
    auto r = kind == 0 ? zc.AllGatherGroups(shard.data(), full.data(), 0, 3, 16)
                       : zc.ReduceScatterGroups(full.data(), shard.data(), 0, 3, 16);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(r.status().IsResourceExhausted()) << r.status().ToString();
    EXPECT_NE(r.status().ToString().find("bucket 2 of 3"), std::string::npos)
        << r.status().ToString();
    // Nothing submitted is still using the caller's buffers once the error is returned.
    ASSERT_EQ(comm.works.size(), 2u);
    EXPECT_TRUE(comm.aborted);
    for (const auto& w : comm.works) EXPECT_TRUE(w->Ready());
  }
  // A failure of the first bucket has nothing in flight: no abort.
  StallingComm first(2, /*fail_at=*/0);
  ZeroCollectives zc(&first, &*plan, DType::kF32);
  EXPECT_FALSE(zc.AllGatherGroups(shard.data(), full.data(), 0, 3, 16).ok());
  EXPECT_FALSE(first.aborted);
}

class ZeroCollectivesTest : public ::testing::TestWithParam<std::tuple<int, size_t>> {};

TEST_P(ZeroCollectivesTest, StepMatchesReferenceAndLedger) {
  const auto [world, bucket] = GetParam();
  const std::string dir = testing::UniqueTestDir("zero_step");
  auto codes = testing::RunRanks(world, [&](int r) { return RunZeroStep(r, world, dir, bucket); });
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(WorldsAndBuckets, ZeroCollectivesTest,
                         ::testing::Combine(::testing::Values(2, 4),
                                            // 1: every group alone; 2048: mixed; huge: one bucket
                                            ::testing::Values(size_t{1}, size_t{2048},
                                                              size_t{1} << 30)));

}  // namespace
}  // namespace strata
