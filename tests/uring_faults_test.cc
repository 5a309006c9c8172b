// The real io_uring backend under scripted faults (UringFaults): hard submit errors leave
// nothing queued (all or nothing), cleanup waits for IO in flight even when the ring reports
// errors, and every rewritten CQE outcome (EAGAIN, EINTR, short IO, hard errors) is handled.
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "nvme/io_progress.h"
#include "nvme/uring_backend.h"
#include "tests/io_test_util.h"

namespace strata::nvme {
namespace {

using testing::AlignedBuf;
using testing::FillPattern;
using testing::MakeAligned;
using testing::OpenDirect;
using testing::TempDir;

constexpr size_t kQd = 8;
constexpr size_t kBytes = 1 << 20;

class UringUnderFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    IoBackendOptions o;
    o.kind = IoBackendKind::kIoUring;
    o.queue_depth = kQd;
    auto b = UringBackend::Open(o, faults_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    io_ = std::move(b).value();
    path_ = dir_.File("data");
    fd_ = OpenDirect(path_, kBytes);
    ASSERT_GE(fd_, 0);
    ASSERT_TRUE(io_->RegisterFile(fd_, path_).ok());
    src_ = MakeAligned(kBytes);
    dst_ = MakeAligned(kBytes);
    FillPattern(src_.get(), kBytes, 17);
  }
  void TearDown() override {
    if (io_ != nullptr) io_->UnregisterFile(fd_);
    io_.reset();
    if (fd_ >= 0) close(fd_);
  }
  std::vector<IoRequest> Batch(IoOp op, char* buf, size_t n, uint64_t tag) {
    std::vector<IoRequest> v;
    const size_t len = kBytes / n;
    for (size_t i = 0; i < n; ++i) v.push_back({op, fd_, i * len, buf + i * len, len, tag + i});
    return v;
  }
  bool RoundTrips() {
    std::memset(dst_.get(), 0, kBytes);
    return io_->Read(fd_, 0, dst_.get(), kBytes).ok() &&
           std::memcmp(src_.get(), dst_.get(), kBytes) == 0;
  }

  TempDir dir_{"uringfault"};
  std::shared_ptr<UringFaults> faults_ = std::make_shared<UringFaults>();
  std::unique_ptr<UringBackend> io_;
  std::string path_;
  int fd_ = -1;
  AlignedBuf src_, dst_;
};

// Regression: a hard io_uring_submit error used to leave the batch's slots taken, inflight()
// raised and its SQEs in the ring, so the next entry issued them anyway (a second time, once the
// caller retried).
TEST_F(UringUnderFaults, HardSubmitErrorQueuesNothingAndIssuesNothingLater) {
  int fail = 1;
  *faults_ = UringFaults({.submit_result = [&] { return fail-- > 0 ? -ENOMEM : 0; }});
  auto writes = Batch(IoOp::kWrite, src_.get(), 4, 100);
  Status s = io_->Submit(writes);
  ASSERT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_NE(s.message().find("errno 12"), std::string_view::npos) << s.ToString();
  EXPECT_EQ(io_->inflight(), 0u);
  // The caller retries: every request completes exactly once, and nothing else shows up.
  ASSERT_TRUE(io_->Submit(writes).ok());
  std::vector<IoCompletion> out(kQd);
  std::vector<int> seen(4, 0);
  while (io_->inflight() > 0) {
    auto n = io_->Reap(out, 1);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    for (size_t i = 0; i < *n; ++i) {
      ASSERT_TRUE(out[i].status.ok()) << out[i].status.ToString();
      ASSERT_GE(out[i].user_data, 100u);
      ASSERT_LT(out[i].user_data, 104u);
      ++seen[out[i].user_data - 100];
    }
  }
  EXPECT_EQ(seen, std::vector<int>(4, 1));
  for (int i = 0; i < 100; ++i) {  // a stray second issue would surface here (or as Internal)
    auto n = io_->Reap(out, 0);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    ASSERT_EQ(*n, 0u);
  }
  EXPECT_TRUE(RoundTrips());
}

// The real thing behind the hook: a SINGLE_ISSUER ring entered from another thread is -EEXIST.
TEST(UringSingleIssuer, SubmitFromAnotherThreadFailsAndLeavesNothingInFlight) {
  IoBackendOptions o;
  o.kind = IoBackendKind::kIoUring;
  o.single_issuer = true;
  o.queue_depth = 4;
  auto io = UringBackend::Open(o);
  ASSERT_TRUE(io.ok()) << io.status().ToString();
  if ((io->get()->setup_flags() & IORING_SETUP_SINGLE_ISSUER) == 0) {
    GTEST_SKIP() << "kernel refused SINGLE_ISSUER: " << (*io)->note();
  }
  TempDir dir("uringsingle");
  int fd = OpenDirect(dir.File("f"), 16384);
  AlignedBuf buf = MakeAligned(16384);
  FillPattern(buf.get(), 16384, 3);
  std::vector<IoRequest> w;
  for (size_t i = 0; i < 4; ++i)
    w.push_back({IoOp::kWrite, fd, i * 4096, buf.get() + i * 4096, 4096, i});
  Status s;
  std::thread other([&] { s = (*io)->Submit(w); });
  other.join();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("errno 17"), std::string_view::npos) << s.ToString();  // EEXIST
  EXPECT_EQ((*io)->inflight(), 0u);
  ASSERT_TRUE((*io)->Execute(w).ok());  // the owner thread carries on; each write once
  EXPECT_EQ((*io)->inflight(), 0u);
  close(fd);
}

// Regression: the destructor used to stop draining at the first failed Reap and close the ring
// with IO in flight.
TEST_F(UringUnderFaults, DestructorDrainsThroughReapErrorsBeforeQueueExit) {
  size_t at_exit = 99;
  int fail = 5;
  *faults_ = UringFaults({.enter_result = [&] { return fail-- > 0 ? -ENOMEM : 0; },
                          .before_queue_exit = [&](size_t n) { at_exit = n; }});
  ASSERT_TRUE(io_->Submit(Batch(IoOp::kWrite, src_.get(), kQd, 0)).ok());
  io_->UnregisterFile(fd_);
  io_.reset();
  EXPECT_EQ(at_exit, 0u) << "io_uring_queue_exit with requests in flight";
  ASSERT_EQ(pread(fd_, dst_.get(), kBytes, 0), static_cast<ssize_t>(kBytes));
  EXPECT_EQ(std::memcmp(src_.get(), dst_.get(), kBytes), 0);
}

TEST_F(UringUnderFaults, DestructorWithoutFaultsFindsNothingInFlight) {
  size_t at_exit = 99;
  *faults_ = UringFaults({.before_queue_exit = [&](size_t n) { at_exit = n; }});
  ASSERT_TRUE(io_->Submit(Batch(IoOp::kWrite, src_.get(), kQd, 0)).ok());
  EXPECT_EQ(io_->inflight(), kQd);
  io_->UnregisterFile(fd_);
  io_.reset();
  EXPECT_EQ(at_exit, 0u);
}

// Regression: Execute used to return on a failed Reap with requests still in flight.
TEST_F(UringUnderFaults, ExecuteReturnsOnlyOnceNothingIsInFlightAfterAReapError) {
  int fail = 2;
  *faults_ = UringFaults({.enter_result = [&] { return fail-- > 0 ? -ENOMEM : 0; }});
  Status s = io_->Execute(Batch(IoOp::kWrite, src_.get(), 2 * kQd, 0));
  EXPECT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_EQ(io_->inflight(), 0u);
  *faults_ = UringFaults({});
  ASSERT_TRUE(io_->Write(fd_, 0, src_.get(), kBytes).ok());
  EXPECT_TRUE(RoundTrips());
}

TEST_F(UringUnderFaults, EintrAndShortCompletionsAreReissued) {
  int calls = 0;
  *faults_ = UringFaults({.cqe_res = [&](const IoRequest& r, size_t done, int res) {
    ++calls;
    if (calls % 3 == 1) return -EINTR;
    if (res > 4096 && done == 0) return 4096;  // short: the rest is re-issued
    return res;
  }});
  ASSERT_TRUE(io_->Execute(Batch(IoOp::kWrite, src_.get(), kQd, 0)).ok());
  EXPECT_TRUE(RoundTrips());
  EXPECT_GT(calls, static_cast<int>(3 * kQd));
}

// Regression: short transfers shared one 64-retry budget with EINTR/EAGAIN, so a transfer that
// kept moving 4 KiB at a time failed after 64 pieces.
TEST_F(UringUnderFaults, ProgressResetsTheRetryBudget) {
  *faults_ = UringFaults({.cqe_res = [](const IoRequest& r, size_t done, int res) {
    return res > 4096 ? 4096 : res;  // 256 pieces for 1 MiB
  }});
  ASSERT_TRUE(io_->Write(fd_, 0, src_.get(), kBytes).ok());
  EXPECT_TRUE(RoundTrips());
}

// Regression: EAGAIN was re-issued at once, so the whole retry budget burned within one drain.
TEST_F(UringUnderFaults, EagainBacksOffBeforeReissuing) {
  int eagains = 10;
  *faults_ = UringFaults({.cqe_res = [&](const IoRequest&, size_t, int res) {
    return eagains-- > 0 ? -EAGAIN : res;
  }});
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(io_->Write(fd_, 0, src_.get(), 4096).ok());
  const auto waited = std::chrono::steady_clock::now() - t0;
  uint64_t min_ns = 0;
  for (int i = 1; i <= 10; ++i) min_ns += RetryBackoffNs(i);
  // A lower bound that the backoff sleeps guarantee, not a speed measurement.
  EXPECT_GE(std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count(),
            static_cast<int64_t>(min_ns));
}

TEST_F(UringUnderFaults, EndlessEagainGivesUpAsIOError) {
  *faults_ = UringFaults({.cqe_res = [](const IoRequest&, size_t, int) { return -EAGAIN; }});
  Status s = io_->Read(fd_, 0, dst_.get(), 4096);
  EXPECT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_NE(s.message().find("gave up"), std::string_view::npos) << s.ToString();
}

TEST_F(UringUnderFaults, HardCqeErrorIsIOErrorNamingErrnoAndFile) {
  *faults_ = UringFaults({.cqe_res = [](const IoRequest&, size_t, int) { return -EIO; }});
  Status s = io_->Write(fd_, 8192, src_.get(), 4096);
  EXPECT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_NE(s.message().find("errno 5"), std::string_view::npos) << s.ToString();
  EXPECT_NE(s.message().find(path_), std::string_view::npos) << s.ToString();
  EXPECT_EQ(io_->inflight(), 0u);
}

// Finding: a short O_DIRECT transfer that is not a multiple of 4096 used to be re-issued from an
// unaligned offset and fail as a confusing EINVAL.
TEST_F(UringUnderFaults, UnalignedShortTransferOnODirectNamesTheCount) {
  *faults_ = UringFaults(
      {.cqe_res = [](const IoRequest&, size_t done, int res) { return done == 0 ? 1000 : res; }});
  Status s = io_->Read(fd_, 0, dst_.get(), 8192);
  EXPECT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_NE(s.message().find("short transfer of 1000 bytes"), std::string_view::npos)
      << s.ToString();
}

}  // namespace
}  // namespace strata::nvme
