// SwapSpace under concurrency and backend failures: ops on one block apply in submission order
// (reordered completions from the simulated backend), a refused submit is delivered exactly once
// per op, Close waits out IO in flight through Reap errors, and reads and writes queued together
// take turns unit by unit.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "nvme/sim_backend.h"
#include "nvme/swap_space.h"
#include "nvme/uring_backend.h"
#include "tests/io_test_util.h"

namespace strata::nvme {
namespace {

using testing::AlignedBuf;
using testing::FillPattern;
using testing::MakeAligned;
using testing::TempDir;

constexpr size_t kUnit = 64 << 10;
const std::vector<SwapBlockSpec> kBlocks = {{7, 5000}, {8, kUnit}, {9, 5 * kUnit + 4096}};

SwapSpaceOptions TwoPaths(const TempDir& dir, size_t max_ops) {
  std::filesystem::create_directories(dir.File("ssd0"));
  std::filesystem::create_directories(dir.File("ssd1"));
  SwapSpaceOptions o;
  o.paths = {dir.File("ssd0"), dir.File("ssd1")};
  o.stripe_unit_bytes = kUnit;
  o.max_inflight_ops = max_ops;
  return o;
}

std::vector<SwapCompletion> ReapAll(SwapSpace& swap) {
  std::vector<SwapCompletion> all, out(2);
  while (swap.inflight_ops() > 0) {
    auto n = swap.Reap(out, 1);
    EXPECT_TRUE(n.ok()) << n.status().ToString();
    if (!n.ok()) break;
    for (size_t i = 0; i < *n; ++i) all.push_back(out[i]);
  }
  return all;
}

// Forwards to a backend and records the direction of every request submitted.
class RecordingBackend final : public IoBackend {
 public:
  explicit RecordingBackend(IoBackend* inner) : inner_(inner) {}
  IoBackendKind kind() const noexcept override { return inner_->kind(); }
  size_t queue_depth() const noexcept override { return inner_->queue_depth(); }
  size_t inflight() const noexcept override { return inner_->inflight(); }
  Status Submit(std::span<const IoRequest> batch) override {
    Status s = inner_->Submit(batch);
    if (s.ok()) {
      for (const IoRequest& r : batch) ops.push_back(r.op == IoOp::kRead ? 'R' : 'W');
    }
    return s;
  }
  Result<size_t> Reap(std::span<IoCompletion> out, size_t min_complete) override {
    return inner_->Reap(out, min_complete);
  }
  Status Allocate(int fd, uint64_t length_bytes) override {
    return inner_->Allocate(fd, length_bytes);
  }
  std::string ops;

 private:
  IoBackend* inner_;
};

// A write-behind and a read-ahead queued together reach the disk unit by unit in turns, so a
// disk serving both directions at once has both in its queue; issuing op by op sent all of the
// first op's units before any of the second's. Ops of one direction keep their start order.
TEST(SwapOrder, ReadsAndWritesQueuedTogetherTakeTurnsUnitByUnit) {
  TempDir dir("swaporder");
  SimOptions so;
  so.seed = 7;
  so.queue_depth = 4;
  SimBackend sim(so);
  RecordingBackend rec(&sim);
  SwapSpaceOptions o = TwoPaths(dir, 4);
  const std::vector<SwapBlockSpec> blocks = {{1, 6 * kUnit}, {2, 6 * kUnit}, {3, 2 * kUnit}};
  auto s = SwapSpace::Create(o, blocks, &rec);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto& swap = *s;
  std::vector<AlignedBuf> bufs;
  for (const SwapBlockSpec& b : blocks) {
    bufs.push_back(MakeAligned(swap->ExtentBytes(b.id)));
    FillPattern(bufs.back().get(), swap->ExtentBytes(b.id), b.id);
    ASSERT_TRUE(swap->Write(b.id, bufs.back().get()).ok());
  }
  AlignedBuf back2 = MakeAligned(swap->ExtentBytes(2)), back3 = MakeAligned(swap->ExtentBytes(3));
  FillPattern(bufs[0].get(), swap->ExtentBytes(1), 11);  // block 1's new version
  rec.ops.clear();
  // Write 1 (6 units) first, then reads of 2 (6 units) and 3 (2 units).
  std::vector<SwapOp> ops = {{IoOp::kWrite, 1, bufs[0].get(), 1},
                             {IoOp::kRead, 2, back2.get(), 2},
                             {IoOp::kRead, 3, back3.get(), 3}};
  ASSERT_TRUE(swap->Submit(ops).ok());
  std::vector<SwapCompletion> out(3);
  size_t done = 0;
  while (swap->inflight_ops() > 0) {
    auto n = swap->Reap(out, 1);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    for (size_t i = 0; i < *n; ++i) EXPECT_TRUE(out[i].status.ok()) << out[i].status.ToString();
    done += *n;
  }
  EXPECT_EQ(done, 3u);
  // 6 writes and 8 reads in turns, the reads left over at the end.
  EXPECT_EQ(rec.ops, "RWRWRWRWRWRWRR") << "seed " << sim.seed();
  EXPECT_EQ(std::memcmp(back2.get(), bufs[1].get(), swap->ExtentBytes(2)), 0);
  EXPECT_EQ(std::memcmp(back3.get(), bufs[2].get(), swap->ExtentBytes(3)), 0);
  AlignedBuf back1 = MakeAligned(swap->ExtentBytes(1));
  ASSERT_TRUE(swap->Read(1, back1.get()).ok());
  EXPECT_EQ(std::memcmp(back1.get(), bufs[0].get(), swap->ExtentBytes(1)), 0);
}

// Regression: a read submitted with (after) a write on the same block was checked against
// whichever checksum was current when it finished, and two writes interleaved their units: the
// write-behind then read-ahead pattern gave false Corruption or a mix of versions.
TEST(SwapOrder, OpsOnOneBlockApplyInSubmissionOrderUnderReordering) {
  const size_t n = 5 * kUnit + 4096;
  AlignedBuf v1 = MakeAligned(n), v2 = MakeAligned(n), v3 = MakeAligned(n);
  AlignedBuf a = MakeAligned(n), b = MakeAligned(n), c = MakeAligned(n);
  FillPattern(v1.get(), n, 1);
  FillPattern(v2.get(), n, 2);
  FillPattern(v3.get(), n, 3);
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    TempDir dir("swaporder");
    SimOptions so;
    so.seed = seed;
    so.queue_depth = 8;
    SimBackend sim(so);
    auto s = SwapSpace::Create(TwoPaths(dir, 8), kBlocks, &sim);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    SwapSpace& swap = **s;
    ASSERT_TRUE(swap.Write(9, v1.get()).ok());
    const SwapOp ops[] = {{IoOp::kRead, 9, a.get(), 0}, {IoOp::kWrite, 9, v2.get(), 1},
                          {IoOp::kRead, 9, b.get(), 2}, {IoOp::kWrite, 9, v3.get(), 3},
                          {IoOp::kRead, 9, c.get(), 4}, {IoOp::kWrite, 8, v1.get(), 5}};
    ASSERT_TRUE(swap.Submit(ops).ok());
    auto done = ReapAll(swap);
    ASSERT_EQ(done.size(), 6u) << "seed " << seed;
    for (const SwapCompletion& d : done) {
      EXPECT_TRUE(d.status.ok()) << d.status.ToString() << " op " << d.user_data << " seed "
                                 << seed;
    }
    EXPECT_EQ(std::memcmp(a.get(), v1.get(), n), 0) << "seed " << seed;
    EXPECT_EQ(std::memcmp(b.get(), v2.get(), n), 0) << "seed " << seed;
    EXPECT_EQ(std::memcmp(c.get(), v3.get(), n), 0) << "seed " << seed;
    ASSERT_TRUE(swap.Read(9, a.get()).ok()) << "seed " << seed;
    EXPECT_EQ(std::memcmp(a.get(), v3.get(), n), 0) << "seed " << seed;
  }
}

TEST(SwapOrder, ReadQueuedBehindTheFirstWriteOfABlockIsAccepted) {
  TempDir dir("swapfirst");
  SimBackend sim(SimOptions{});
  auto s = SwapSpace::Create(TwoPaths(dir, 4), kBlocks, &sim);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const size_t n = (*s)->ExtentBytes(8);
  AlignedBuf v = MakeAligned(n), back = MakeAligned(n);
  FillPattern(v.get(), n, 5);
  const SwapOp ops[] = {{IoOp::kWrite, 8, v.get(), 0}, {IoOp::kRead, 8, back.get(), 1}};
  ASSERT_TRUE((*s)->Submit(ops).ok());
  for (const SwapCompletion& d : ReapAll(**s)) EXPECT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_EQ(std::memcmp(v.get(), back.get(), n), 0);
}

class SwapOnUring : public ::testing::Test {
 protected:
  void SetUp() override {
    IoBackendOptions o;
    o.kind = IoBackendKind::kIoUring;
    o.queue_depth = 4;
    auto b = UringBackend::Open(o, faults_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    io_ = std::move(b).value();
    auto s = SwapSpace::Create(TwoPaths(dir_, 4), kBlocks, io_.get());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    swap_ = std::move(s).value();
    n_ = swap_->ExtentBytes(9);
    v1_ = MakeAligned(n_);
    v2_ = MakeAligned(n_);
    back_ = MakeAligned(n_);
    FillPattern(v1_.get(), n_, 1);
    FillPattern(v2_.get(), n_, 2);
  }
  TempDir dir_{"swapuring"};
  std::shared_ptr<UringFaults> faults_ = std::make_shared<UringFaults>();
  std::unique_ptr<UringBackend> io_;
  std::unique_ptr<SwapSpace> swap_;
  size_t n_ = 0;
  AlignedBuf v1_, v2_, back_;
};

// Regression: a failed backend submit returned an error from SwapSpace::Submit while the ops
// stayed accepted and their units queued (and io_uring's SQEs stayed in the ring), so the same
// IO went out again later and units_left wrapped.
TEST_F(SwapOnUring, RefusedSubmitCompletesEachOpOnceWithTheError) {
  ASSERT_TRUE(swap_->Write(9, v1_.get()).ok());
  int fail = 1;
  *faults_ = UringFaults({.submit_result = [&] { return fail-- > 0 ? -ENOMEM : 0; }});
  const SwapOp ops[] = {{IoOp::kWrite, 9, v2_.get(), 1}, {IoOp::kWrite, 8, v2_.get(), 2}};
  ASSERT_TRUE(swap_->Submit(ops).ok());  // accepted: the outcome is in the completions
  auto done = ReapAll(*swap_);
  ASSERT_EQ(done.size(), 2u);
  for (const SwapCompletion& d : done) {
    EXPECT_TRUE(d.status.IsIOError()) << d.status.ToString();
    EXPECT_NE(d.status.message().find("errno 12"), std::string_view::npos) << d.status.ToString();
  }
  EXPECT_EQ(io_->inflight(), 0u);
  EXPECT_EQ(swap_->inflight_ops(), 0u);
  std::vector<SwapCompletion> out(2);
  auto more = swap_->Reap(out, 0);
  ASSERT_TRUE(more.ok());
  EXPECT_EQ(*more, 0u) << "a second completion for the same op";
  // None of block 9's units went out: its previous version is still valid.
  ASSERT_TRUE(swap_->Read(9, back_.get()).ok());
  EXPECT_EQ(std::memcmp(back_.get(), v1_.get(), n_), 0);
}

TEST_F(SwapOnUring, RefusedSubmitHalfwayThroughAWriteInvalidatesTheBlock) {
  ASSERT_TRUE(swap_->Write(9, v1_.get()).ok());
  int submits = 0;  // block 9 has 6 units, queue depth 4: the second submit fails
  *faults_ = UringFaults({.submit_result = [&] { return ++submits == 2 ? -ENOMEM : 0; }});
  Status w = swap_->Write(9, v2_.get());
  EXPECT_TRUE(w.IsIOError()) << w.ToString();
  EXPECT_EQ(io_->inflight(), 0u);
  Status r = swap_->Read(9, back_.get());
  EXPECT_TRUE(r.IsCorruption()) << r.ToString();
  *faults_ = UringFaults({});
  ASSERT_TRUE(swap_->Write(9, v2_.get()).ok());
  ASSERT_TRUE(swap_->Read(9, back_.get()).ok());
  EXPECT_EQ(std::memcmp(back_.get(), v2_.get(), n_), 0);
}

// Regression: Close stopped draining at the first Reap error and then closed and unlinked the
// files with IO in flight.
TEST_F(SwapOnUring, CloseWaitsForIoInFlightThroughReapErrors) {
  const SwapOp ops[] = {{IoOp::kWrite, 9, v1_.get(), 1}, {IoOp::kWrite, 8, v2_.get(), 2}};
  ASSERT_TRUE(swap_->Submit(ops).ok());
  int fail = 3;
  *faults_ = UringFaults({.enter_result = [&] { return fail-- > 0 ? -ENOMEM : 0; }});
  const auto files = swap_->files();
  Status c = swap_->Close();
  EXPECT_TRUE(c.ok()) << c.ToString();
  EXPECT_EQ(io_->inflight(), 0u) << "files closed with IO in flight";
  EXPECT_EQ(swap_->inflight_ops(), 0u);
  for (const auto& f : files) EXPECT_FALSE(std::filesystem::exists(f)) << f;
}

}  // namespace
}  // namespace strata::nvme
