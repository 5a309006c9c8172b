// ZeRO partitioning (pure) and the bucketed collectives over the Gloo backend with 2 and 4 ranks:
// padded shards, bucket boundaries, results against a local reference, and the byte ledger
// (stage 3 moves 1.5x the traffic of stages 0-2).
#include <gtest/gtest.h>

#include <cstring>

#include "core/zero_collectives.h"
#include "cpu/gloo_comm.h"
#include "cpu/rendezvous.h"
#include "sched/zero_partition.h"
#include "tests/multiprocess.h"

namespace strata {
namespace {

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
  auto fs = FileKvStore::Open(dir);
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

  // The ledger: stage 3 = 2 gathers + 1 reduce-scatter of the padded model; stages 0-2 = one
  // all-reduce of the gradients. Per rank, a ring sends (N-1)/N of the payload for each gather
  // and the reduce-scatter, 2(N-1)/N for the all-reduce: stage 3 moves 1.5x.
  const uint64_t elt = DTypeSize(dt), n = static_cast<uint64_t>(world);
  const uint64_t model_bytes = plan->full_total_elems * elt;
  const CommStats s3 = c.stats();
  const uint64_t stage3 = s3.total_sent_bytes();
  if (s3.of(CommOp::kAllGather).sent_bytes != 2 * model_bytes * (n - 1) / n) return "AG bytes";
  if (s3.of(CommOp::kReduceScatter).sent_bytes != model_bytes * (n - 1) / n) return "RS bytes";
  if (s3.of(CommOp::kAllGather).calls != 2 * numels.size()) return "AG calls";
  c.ResetStats();
  auto ar = c.AllReduce(grads.data(), grads.data(), grads.size(), dt);
  if (!ar.ok()) return ar.status().ToString();
  st = ar->WaitUntil(deadline());
  if (!st.ok()) return st.ToString();
  const uint64_t stage012 = c.stats().total_sent_bytes();
  if (stage012 != 2 * model_bytes * (n - 1) / n) return "AR bytes";
  if (2 * stage3 != 3 * stage012) {
    return "ledger: stage 3 sent " + std::to_string(stage3) + ", stages 0-2 " +
           std::to_string(stage012);
  }
  return "";
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
