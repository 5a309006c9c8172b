// Trace, Prefetcher and StepPipeline (sched/).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "sched/placement.h"
#include "sched/prefetcher.h"
#include "sched/step_pipeline.h"
#include "sched/trace.h"

namespace strata::sched {
namespace {

using Kind = PrefetchAction::Kind;

void RunStep(Trace& t, const std::vector<GroupId>& order) {
  t.BeginStep();
  for (GroupId g : order) t.Record(g);
  t.EndStep();
}

TEST(TraceTest, RecordsThenReplays) {
  Trace t;
  std::vector<GroupId> fwd_bwd = {0, 1, 2, 2, 1, 0};
  t.BeginStep();
  EXPECT_FALSE(t.replaying());
  for (GroupId g : fwd_bwd) EXPECT_FALSE(t.Record(g));
  t.EndStep();
  EXPECT_EQ(t.recorded(), fwd_bwd);
  t.BeginStep();
  EXPECT_TRUE(t.replaying());
  for (GroupId g : fwd_bwd) EXPECT_TRUE(t.Record(g));
  t.EndStep();
  EXPECT_EQ(t.divergences(), 0u);
  EXPECT_EQ(t.NextUse(1, 0), 1u);
  EXPECT_EQ(t.NextUse(1, 2), 4u);
  EXPECT_EQ(t.NextUse(1, 5), kNever);
  EXPECT_EQ(t.NextUse(9, 0), kNever);
}

TEST(TraceTest, DivergenceIsDetectedAndReRecorded) {
  Trace t;
  RunStep(t, {0, 1, 2, 3});
  t.BeginStep();
  EXPECT_TRUE(t.Record(0));
  EXPECT_FALSE(t.Record(2));  // diverges here
  EXPECT_FALSE(t.replaying());
  EXPECT_FALSE(t.Record(1));
  t.EndStep();
  EXPECT_EQ(t.divergences(), 1u);
  EXPECT_EQ(t.recorded(), (std::vector<GroupId>{0, 2, 1}));
  // The new order replays cleanly.
  t.BeginStep();
  for (GroupId g : {0u, 2u, 1u}) EXPECT_TRUE(t.Record(g));
  t.EndStep();
  EXPECT_EQ(t.divergences(), 1u);
}

TEST(TraceTest, ShorterOrLongerStepIsADivergence) {
  Trace t;
  RunStep(t, {0, 1, 2});
  RunStep(t, {0, 1});  // ends early
  EXPECT_EQ(t.divergences(), 1u);
  EXPECT_EQ(t.recorded(), (std::vector<GroupId>{0, 1}));
  RunStep(t, {0, 1, 5});  // runs long
  EXPECT_EQ(t.divergences(), 2u);
  EXPECT_EQ(t.recorded(), (std::vector<GroupId>{0, 1, 5}));
}

// Trace 0..n-1 forward, then backward; the consumer stands at `pos`.
Trace FwdBwdAt(GroupId n, size_t pos) {
  std::vector<GroupId> order;
  for (GroupId g = 0; g < n; ++g) order.push_back(g);
  for (GroupId g = n; g-- > 0;) order.push_back(g);
  Trace t;
  RunStep(t, order);
  t.BeginStep();
  for (size_t i = 0; i < pos; ++i) t.Record(order[i]);
  return t;
}

PrefetchConfig Cfg(uint64_t bucket, uint64_t live) {
  PrefetchConfig c;
  c.prefetch_bucket_bytes = bucket;
  c.max_live_bytes = live;
  c.max_reuse_distance_bytes = 0;
  c.host_lookahead_bytes = 0;
  return c;
}

TEST(PrefetcherTest, NoPlanWithoutAReplayingTrace) {
  Trace t;
  t.BeginStep();
  std::vector<GroupView> v(4, GroupView{.size_bytes = 10});
  EXPECT_TRUE(Prefetcher(Cfg(100, 100)).Plan(t, v).empty());
}

TEST(PrefetcherTest, LookaheadIsBoundedByBytes) {
  Trace t = FwdBwdAt(8, 0);
  std::vector<GroupView> v(8, GroupView{.size_bytes = 10});
  auto plan = Prefetcher(Cfg(30, 1000)).Plan(t, v);
  std::vector<PrefetchAction> want = {
      {Kind::kFetchToDevice, 0, 0}, {Kind::kFetchToDevice, 1, 1}, {Kind::kFetchToDevice, 2, 2}};
  EXPECT_EQ(plan, want);
  // Already resident or in-flight groups count toward the window but are not fetched again.
  v[0].device = Residency::kValid;
  v[1].device = Residency::kInFlight;
  plan = Prefetcher(Cfg(30, 1000)).Plan(t, v);
  want = {{Kind::kFetchToDevice, 2, 2}};
  EXPECT_EQ(plan, want);
}

TEST(PrefetcherTest, LiveBytesCapStopsFetchingWhenNothingIsEvictable) {
  Trace t = FwdBwdAt(8, 2);  // consumer about to use group 2; 0 and 1 in use
  std::vector<GroupView> v(8, GroupView{.size_bytes = 10});
  v[0].device = v[1].device = Residency::kValid;
  v[0].in_use = v[1].in_use = true;
  auto plan = Prefetcher(Cfg(1000, 40)).Plan(t, v);
  std::vector<PrefetchAction> want = {{Kind::kFetchToDevice, 2, 2}, {Kind::kFetchToDevice, 3, 3}};
  EXPECT_EQ(plan, want);
}

TEST(PrefetcherTest, BeladyEvictsFarthestAndNeverWhatIsNeededSooner) {
  // Order 0 1 2 3 3 2 1 0, consumer at index 3 (next: group 3). Resident: 0, 1, 2 (released).
  Trace t = FwdBwdAt(4, 3);
  std::vector<GroupView> v(4, GroupView{.size_bytes = 10});
  for (GroupId g : {0u, 1u, 2u}) v[g].device = Residency::kValid;
  // Room for 3 groups: fetching 3 (needed at 3) must evict group 0 (next use 7), the farthest.
  auto plan = Prefetcher(Cfg(1000, 30)).Plan(t, v);
  std::vector<PrefetchAction> want = {{Kind::kEvictFromDevice, 0, kNever},
                                      {Kind::kFetchToDevice, 3, 3}};
  EXPECT_EQ(plan, want);
  // A victim needed sooner than the candidate is never taken: consumer at 0, groups 1 and 2
  // resident (needed at 1, 2), room for 2: fetching 0 (needed at 0) may evict 2, then 1 and 2
  // are needed before 3, so nothing more.
  Trace t0 = FwdBwdAt(4, 0);
  std::vector<GroupView> w(4, GroupView{.size_bytes = 10});
  w[1].device = w[2].device = Residency::kValid;
  plan = Prefetcher(Cfg(1000, 20)).Plan(t0, w);
  want = {{Kind::kEvictFromDevice, 2, kNever}, {Kind::kFetchToDevice, 0, 0}};
  EXPECT_EQ(plan, want);
}

TEST(PrefetcherTest, ChainsNvmeGroupsIntoHostBeyondTheDeviceWindow) {
  Trace t = FwdBwdAt(6, 0);
  std::vector<GroupView> v(6, GroupView{.size_bytes = 10, .home = Tier::kNvme});
  PrefetchConfig c = Cfg(20, 1000);
  c.host_lookahead_bytes = 30;
  v[3].host = Residency::kValid;  // already staged
  auto plan = Prefetcher(c).Plan(t, v);
  std::vector<PrefetchAction> want = {{Kind::kFetchToDevice, 0, 0},
                                      {Kind::kFetchToDevice, 1, 1},
                                      {Kind::kStageToHost, 2, 2},
                                      {Kind::kStageToHost, 4, 4}};
  EXPECT_EQ(plan, want);
}

TEST(PrefetcherTest, HeldGroupsAreNeitherFetchedNorStagedButCountInTheWindow) {
  // Groups 1 and 4 are held (their update is still being written: overlap_step). The same
  // windows as above: the device window covers 0-1, the host window 2-4.
  Trace t = FwdBwdAt(6, 0);
  std::vector<GroupView> v(6, GroupView{.size_bytes = 10, .home = Tier::kNvme});
  PrefetchConfig c = Cfg(20, 1000);
  c.host_lookahead_bytes = 30;
  v[1].held = v[4].held = true;
  auto plan = Prefetcher(c).Plan(t, v);
  std::vector<PrefetchAction> want = {{Kind::kFetchToDevice, 0, 0},
                                      {Kind::kStageToHost, 2, 2},
                                      {Kind::kStageToHost, 3, 3}};
  EXPECT_EQ(plan, want);
  // Released holds: the same plan as without.
  v[1].held = v[4].held = false;
  plan = Prefetcher(c).Plan(t, v);
  want = {{Kind::kFetchToDevice, 0, 0},
          {Kind::kFetchToDevice, 1, 1},
          {Kind::kStageToHost, 2, 2},
          {Kind::kStageToHost, 3, 3},
          {Kind::kStageToHost, 4, 4}};
  EXPECT_EQ(plan, want);
}

TEST(PrefetcherTest, ReleaseKeepsReusedAndPersistentGroups) {
  // Order 0 1 2 3 3 2 1 0; after using group 3 at index 3 (position 4), its next use is index 4.
  Trace t = FwdBwdAt(4, 4);
  std::vector<GroupView> v(4, GroupView{.size_bytes = 10});
  PrefetchConfig c = Cfg(100, 100);
  c.max_reuse_distance_bytes = 15;
  Prefetcher p(c);
  EXPECT_TRUE(p.KeepAfterRelease(3, t, v));   // distance 0
  EXPECT_TRUE(p.KeepAfterRelease(2, t, v));   // index 5: 10 bytes in between
  EXPECT_FALSE(p.KeepAfterRelease(0, t, v));  // index 7: 30 bytes
  // At the end of the step, group 0 (last in backward) is reused first in the next step.
  Trace end = FwdBwdAt(4, 8);
  EXPECT_TRUE(p.KeepAfterRelease(0, end, v));   // distance 0 across the step boundary
  EXPECT_FALSE(p.KeepAfterRelease(3, end, v));  // groups 0, 1, 2 (30 bytes) come first
  v[0].persistent = true;
  EXPECT_TRUE(Prefetcher(c).KeepAfterRelease(0, t, v));
  v[0].persistent = false;
  Trace none;
  none.BeginStep();
  EXPECT_FALSE(p.KeepAfterRelease(0, none, v));
}

// stage3_max_live_parameters holds after a release too, also when one group is larger than it (a
// Plan cannot make room for such a group, so it evicts nothing): the copies needed last go.
TEST(PrefetcherTest, OverMaxLiveEvictsTheCopiesNeededLast) {
  // Order 0 1 2 3 3 2 1 0; at position 4 group 3 is next, then 2, 1, 0.
  Trace t = FwdBwdAt(4, 4);
  std::vector<GroupView> v(4, GroupView{.size_bytes = 10, .device = Residency::kValid});
  PrefetchConfig c = Cfg(100, 40);
  EXPECT_TRUE(Prefetcher(c).OverMaxLive(t, v).empty());  // 40: within
  c.max_live_bytes = 35;
  EXPECT_EQ(Prefetcher(c).OverMaxLive(t, v), std::vector<GroupId>{0});  // needed last
  c.max_live_bytes = 0;
  v[2].in_use = true;      // in use: stays
  v[1].persistent = true;  // persistent: stays
  EXPECT_EQ(Prefetcher(c).OverMaxLive(t, v), (std::vector<GroupId>{0, 3}));
  v[0].device = Residency::kInFlight;  // counted, but not resident: not evicted
  EXPECT_EQ(Prefetcher(c).OverMaxLive(t, v), std::vector<GroupId>{3});
}

TEST(PrefetcherTest, FromNumelScalesByParamBytes) {
  auto c = PrefetchConfig::FromNumel(50, 100, 200, 2);
  EXPECT_EQ(c.prefetch_bucket_bytes, 100u);
  EXPECT_EQ(c.max_live_bytes, 200u);
  EXPECT_EQ(c.max_reuse_distance_bytes, 400u);
}

// DeepSpeed's mark_persistent_parameters, per group in model order: small groups persist while
// their running total stays within the model threshold; one that would pass it is skipped and a
// later, smaller one may still fit.
TEST(PersistentGroupsTest, ParamAndModelThresholds) {
  const std::vector<size_t> numels = {10, 50, 30, 200, 5};
  EXPECT_EQ(PersistentGroups(numels, 100, UINT64_MAX),
            (std::vector<bool>{true, true, true, false, true}));
  EXPECT_EQ(PersistentGroups(numels, 100, 45), (std::vector<bool>{true, false, true, false, true}));
  EXPECT_EQ(PersistentGroups(numels, 100, 0), (std::vector<bool>(5, false)));
  EXPECT_EQ(PersistentGroups(numels, 0, UINT64_MAX), (std::vector<bool>(5, false)));
}

// ---------------------------------------------------------------------------
// StepPipeline over a fake async executor: seeded random delays, completions reordered.
// ---------------------------------------------------------------------------
class FakeAsync {
 public:
  explicit FakeAsync(uint32_t seed) : rng_(seed) {
    worker_ = std::thread([this] { Run(); });
  }
  ~FakeAsync() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void Submit(std::function<void()> fn) {
    std::lock_guard<std::mutex> l(mu_);
    auto due = std::chrono::steady_clock::now() + std::chrono::microseconds(rng_() % 300);
    q_.emplace(due, std::move(fn));
    cv_.notify_all();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> l(mu_);
    while (!(stop_ && q_.empty())) {
      if (q_.empty()) {
        cv_.wait(l);
        continue;
      }
      auto due = q_.begin()->first;
      if (cv_.wait_until(l, due) == std::cv_status::no_timeout && q_.begin()->first < due) continue;
      if (std::chrono::steady_clock::now() < q_.begin()->first) continue;
      auto fn = std::move(q_.begin()->second);
      q_.erase(q_.begin());
      l.unlock();
      fn();
      l.lock();
    }
  }
  std::mt19937 rng_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<std::chrono::steady_clock::time_point, std::function<void()>> q_;
  bool stop_ = false;
  std::thread worker_;
};

struct PipelineCase {
  uint32_t read_ahead, write_behind, buffers;
};

class StepPipelineTest : public ::testing::TestWithParam<PipelineCase> {};

TEST_P(StepPipelineTest, OrderBuffersAndDepthsHold) {
  const PipelineCase pc = GetParam();
  constexpr size_t kCount = 40;
  FakeAsync io(1234);
  std::mutex mu;
  std::vector<int> owner(pc.buffers, -1);  // sub-group holding each slot
  std::vector<int> stage(kCount, 0);       // 1 read, 2 computed, 3 written
  std::vector<size_t> computed;
  bool violation = false;
  PipelineStages stages;
  stages.read = [&](size_t i, uint32_t slot, StageDone done) {
    std::lock_guard<std::mutex> l(mu);
    if (owner[slot] != -1) violation = true;
    owner[slot] = static_cast<int>(i);
    io.Submit([&, i, done] {
      {
        std::lock_guard<std::mutex> g(mu);
        stage[i] = 1;
      }
      done(Status::OK());
    });
    return Status::OK();
  };
  stages.compute = [&](size_t i, uint32_t slot) {
    std::lock_guard<std::mutex> l(mu);
    if (stage[i] != 1 || owner[slot] != static_cast<int>(i)) violation = true;
    stage[i] = 2;
    computed.push_back(i);
    return Status::OK();
  };
  stages.write = [&](size_t i, uint32_t slot, StageDone done) {
    io.Submit([&, i, slot, done] {
      {
        std::lock_guard<std::mutex> g(mu);
        if (stage[i] != 2 || owner[slot] != static_cast<int>(i)) violation = true;
        stage[i] = 3;
        owner[slot] = -1;
      }
      done(Status::OK());
    });
    return Status::OK();
  };
  PipelineStats st;
  StepPipeline p({pc.read_ahead, pc.write_behind, pc.buffers});
  ASSERT_TRUE(p.Run(kCount, stages, &st).ok());
  EXPECT_FALSE(violation);
  EXPECT_TRUE(std::all_of(stage.begin(), stage.end(), [](int s) { return s == 3; }));
  std::vector<size_t> want(kCount);
  for (size_t i = 0; i < kCount; ++i) want[i] = i;
  EXPECT_EQ(computed, want);
  EXPECT_LE(st.max_reads_in_flight, std::min(pc.read_ahead + 1, pc.buffers));
  EXPECT_LE(st.max_writes_in_flight, std::min(pc.write_behind + 1, pc.buffers));
}

INSTANTIATE_TEST_SUITE_P(Depths, StepPipelineTest,
                         ::testing::Values(PipelineCase{0, 0, 1}, PipelineCase{1, 1, 3},
                                           PipelineCase{2, 2, 5}, PipelineCase{4, 3, 4},
                                           PipelineCase{3, 0, 2}));

TEST(StepPipelineErrors, ReadErrorReachesTheCallerAndDrains) {
  FakeAsync io(99);
  std::atomic<int> outstanding{0};
  PipelineStages stages;
  stages.read = [&](size_t i, uint32_t, StageDone done) {
    ++outstanding;
    io.Submit([&, i, done] {
      --outstanding;
      done(i == 5 ? Status::IOError("EIO on sub-group file") : Status::OK());
    });
    return Status::OK();
  };
  stages.compute = [&](size_t, uint32_t) { return Status::OK(); };
  stages.write = [&](size_t, uint32_t, StageDone done) {
    ++outstanding;
    io.Submit([&, done] {
      --outstanding;
      done(Status::OK());
    });
    return Status::OK();
  };
  Status s = StepPipeline({2, 2, 5}).Run(20, stages);
  EXPECT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_NE(s.ToString().find("sub-group 5"), std::string::npos) << s.ToString();
  EXPECT_EQ(outstanding.load(), 0);
}

TEST(StepPipelineErrors, ComputeErrorAndBadOptions) {
  PipelineStages stages;
  stages.read = [](size_t, uint32_t, StageDone done) {
    done(Status::OK());
    return Status::OK();
  };
  stages.compute = [](size_t i, uint32_t) {
    return i == 2 ? Status::Corruption("nan in master weights") : Status::OK();
  };
  stages.write = [](size_t, uint32_t, StageDone done) {
    done(Status::OK());
    return Status::OK();
  };
  Status s = StepPipeline({1, 1, 3}).Run(10, stages);
  EXPECT_TRUE(s.IsCorruption());
  EXPECT_NE(s.ToString().find("sub-group 2"), std::string::npos);
  EXPECT_TRUE(StepPipeline({1, 1, 0}).Run(3, stages).IsInvalidArgument());
  EXPECT_TRUE(StepPipeline({1, 1, 2}).Run(3, PipelineStages{}).IsInvalidArgument());
}

}  // namespace
}  // namespace strata::sched
