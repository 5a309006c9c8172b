// The IoBackend contract, run over every backend (TEST_P): round trips, one completion per
// request, bounded queue, validation, end-of-file, errors naming the file, draining on close.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cpu/pinned_pool.h"
#include "nvme/bench/io_registrar.h"
#include "nvme/sim_backend.h"
#include "nvme/uring_backend.h"
#include "strata/io.h"
#include "tests/io_test_util.h"

namespace strata {
// Readable parameter names in test listings ("iouring" instead of "1-byte object <01>").
inline void PrintTo(IoBackendKind k, std::ostream* os) { *os << IoBackendKindName(k); }
}  // namespace strata

namespace strata {
namespace {

using testing::AlignedBuf;
using testing::FillPattern;
using testing::MakeAligned;
using testing::OpenDirect;
using testing::TempDir;

constexpr size_t kQd = 8;

// `faults`: io_uring only, the ring opened directly with them (UringBackend::Open).
std::unique_ptr<IoBackend> Make(IoBackendKind kind,
                                std::shared_ptr<nvme::UringFaults> faults = nullptr) {
  if (kind == IoBackendKind::kSimulated) {
    nvme::SimOptions o;
    o.queue_depth = kQd;
    o.seed = 42;
    return std::make_unique<nvme::SimBackend>(o);
  }
  IoBackendOptions o;
  o.kind = kind;
  o.queue_depth = kQd;
  o.posix_threads = 3;
  if (faults != nullptr) {
    auto u = nvme::UringBackend::Open(o, std::move(faults));
    EXPECT_TRUE(u.ok()) << u.status().ToString();
    return u.ok() ? std::unique_ptr<IoBackend>(std::move(u).value()) : nullptr;
  }
  auto b = OpenIoBackend(o);
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  return b.ok() ? std::move(b).value() : nullptr;
}

class IoBackendContract : public ::testing::TestWithParam<IoBackendKind> {
 protected:
  void SetUp() override {
    backend_ = Make(GetParam());
    ASSERT_NE(backend_, nullptr);
    ASSERT_EQ(backend_->kind(), GetParam()) << backend_->note();
  }
  void TearDown() override {
    if (fd_ >= 0) {
      backend_->UnregisterFile(fd_);
      close(fd_);
    }
  }
  void OpenFile(size_t size) {
    path_ = dir_.File("data");
    fd_ = OpenDirect(path_, size);
    ASSERT_GE(fd_, 0);
    ASSERT_TRUE(backend_->RegisterFile(fd_, path_).ok());
  }

  TempDir dir_{"contract"};
  std::unique_ptr<IoBackend> backend_;
  std::string path_;
  int fd_ = -1;
};

TEST_P(IoBackendContract, WriteThenReadRoundTrips) {
  constexpr size_t kBlock = 64 << 10, kBlocks = 40;  // more blocks than the queue depth
  OpenFile(kBlock * kBlocks);
  AlignedBuf src = MakeAligned(kBlock * kBlocks), dst = MakeAligned(kBlock * kBlocks);
  FillPattern(src.get(), kBlock * kBlocks, 7);
  std::vector<IoRequest> writes, reads;
  for (size_t i = 0; i < kBlocks; ++i) {
    writes.push_back({IoOp::kWrite, fd_, i * kBlock, src.get() + i * kBlock, kBlock, i});
    reads.push_back({IoOp::kRead, fd_, i * kBlock, dst.get() + i * kBlock, kBlock, i});
  }
  ASSERT_TRUE(backend_->Execute(writes).ok());
  std::memset(dst.get(), 0, kBlock * kBlocks);
  ASSERT_TRUE(backend_->Execute(reads).ok());
  EXPECT_EQ(std::memcmp(src.get(), dst.get(), kBlock * kBlocks), 0);
  EXPECT_EQ(backend_->inflight(), 0u);
}

TEST_P(IoBackendContract, EveryRequestCompletesExactlyOnce) {
  OpenFile(kQd * 4096);
  AlignedBuf buf = MakeAligned(kQd * 4096);
  FillPattern(buf.get(), kQd * 4096, 1);
  std::vector<IoRequest> batch;
  for (size_t i = 0; i < kQd; ++i) {
    batch.push_back({IoOp::kWrite, fd_, i * 4096, buf.get() + i * 4096, 4096, 1000 + i});
  }
  ASSERT_TRUE(backend_->Submit(batch).ok());
  EXPECT_EQ(backend_->inflight(), kQd);
  std::multiset<uint64_t> seen;
  std::vector<IoCompletion> out(3);  // smaller than the batch: reaped in pieces
  while (backend_->inflight() > 0) {
    auto n = backend_->Reap(out, 1);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    ASSERT_GE(*n, 1u);
    for (size_t i = 0; i < *n; ++i) {
      EXPECT_TRUE(out[i].status.ok()) << out[i].status.ToString();
      EXPECT_EQ(out[i].bytes_transferred, 4096u);
      seen.insert(out[i].user_data);
    }
  }
  ASSERT_EQ(seen.size(), kQd);
  for (size_t i = 0; i < kQd; ++i) EXPECT_EQ(seen.count(1000 + i), 1u) << i;
}

TEST_P(IoBackendContract, PollingWithoutWaitingMakesProgress) {
  OpenFile(4096);
  AlignedBuf buf = MakeAligned(4096);
  IoRequest r{IoOp::kWrite, fd_, 0, buf.get(), 4096, 5};
  ASSERT_TRUE(backend_->Submit({&r, 1}).ok());
  std::vector<IoCompletion> out(1);
  size_t got = 0;
  // Bounded by time, not by a count of polls: a loaded machine may run the backend's worker
  // later than a million polls take (it did under ctest -j2), and a backend that completes only
  // inside a blocking wait never gets there at all.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (got == 0 && std::chrono::steady_clock::now() < deadline) {
    auto n = backend_->Reap(out, 0);
    ASSERT_TRUE(n.ok());
    got = *n;
    if (got == 0) std::this_thread::yield();
  }
  ASSERT_EQ(got, 1u);
  EXPECT_EQ(out[0].user_data, 5u);
}

TEST_P(IoBackendContract, OverQueueDepthIsResourceExhaustedAndQueuesNothing) {
  OpenFile((kQd + 1) * 4096);
  AlignedBuf buf = MakeAligned((kQd + 1) * 4096);
  std::vector<IoRequest> batch;
  for (size_t i = 0; i <= kQd; ++i) {
    batch.push_back({IoOp::kRead, fd_, i * 4096, buf.get() + i * 4096, 4096, i});
  }
  Status s = backend_->Submit(batch);
  EXPECT_TRUE(s.IsResourceExhausted()) << s.ToString();
  EXPECT_EQ(backend_->inflight(), 0u);
  ASSERT_TRUE(backend_->Submit(std::span(batch).first(kQd)).ok());
  s = backend_->Submit(std::span(batch).last(1));
  EXPECT_TRUE(s.IsResourceExhausted()) << s.ToString();
  std::vector<IoCompletion> out(kQd);
  size_t total = 0;
  while (total < kQd) {
    auto n = backend_->Reap(out, kQd - total);
    ASSERT_TRUE(n.ok());
    total += *n;
  }
  EXPECT_EQ(backend_->inflight(), 0u);
}

TEST_P(IoBackendContract, MisalignedRequestsAreInvalidArgument) {
  OpenFile(16384);
  AlignedBuf buf = MakeAligned(16384);
  const IoRequest bad[] = {
      {IoOp::kRead, fd_, 1, buf.get(), 4096, 0},        // offset
      {IoOp::kRead, fd_, 0, buf.get(), 100, 0},         // length
      {IoOp::kRead, fd_, 0, buf.get() + 512, 4096, 0},  // buffer
      {IoOp::kRead, fd_, 0, buf.get(), 0, 0},           // empty
      {IoOp::kRead, -1, 0, buf.get(), 4096, 0},         // fd
  };
  for (const IoRequest& r : bad) {
    Status s = backend_->Submit({&r, 1});
    EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
  }
  // A batch with one bad request queues none of it.
  const IoRequest mixed[] = {{IoOp::kRead, fd_, 0, buf.get(), 4096, 0}, bad[0]};
  EXPECT_TRUE(backend_->Submit(mixed).IsInvalidArgument());
  EXPECT_EQ(backend_->inflight(), 0u);
}

TEST_P(IoBackendContract, ReadBeyondEndOfFileIsCorruptionNamingTheFile) {
  OpenFile(4096);
  AlignedBuf buf = MakeAligned(8192);
  Status s = backend_->Read(fd_, 8192, buf.get(), 4096);
  EXPECT_TRUE(s.IsCorruption()) << s.ToString();
  EXPECT_NE(s.message().find(path_), std::string_view::npos) << s.ToString();
  // Straddling the end: the first page comes back, the rest is a zero-length read.
  s = backend_->Read(fd_, 0, buf.get(), 8192);
  EXPECT_TRUE(s.IsCorruption()) << s.ToString();
}

TEST_P(IoBackendContract, OsErrorIsIOErrorWithErrnoAndFile) {
  OpenFile(4096);
  std::string ro_path = dir_.File("readonly");
  int ro = open(ro_path.c_str(), O_RDONLY | O_CREAT, 0644);
  ASSERT_GE(ro, 0);
  ASSERT_TRUE(backend_->RegisterFile(ro, ro_path).ok());
  AlignedBuf buf = MakeAligned(4096);
  Status s = backend_->Write(ro, 0, buf.get(), 4096);
  EXPECT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_NE(s.message().find("errno 9"), std::string_view::npos) << s.ToString();  // EBADF
  EXPECT_NE(s.message().find(ro_path), std::string_view::npos) << s.ToString();
  backend_->UnregisterFile(ro);
  close(ro);
}

TEST_P(IoBackendContract, ExecuteRefusesWhileOtherIoIsInFlight) {
  OpenFile(8192);
  AlignedBuf buf = MakeAligned(8192);
  IoRequest r{IoOp::kRead, fd_, 0, buf.get(), 4096, 0};
  ASSERT_TRUE(backend_->Submit({&r, 1}).ok());
  Status s = backend_->Read(fd_, 4096, buf.get() + 4096, 4096);
  EXPECT_EQ(s.code(), Status::Code::kFailedPrecondition) << s.ToString();
  std::vector<IoCompletion> out(1);
  ASSERT_TRUE(backend_->Reap(out, 1).ok());
}

TEST_P(IoBackendContract, RegisteredBufferIsUsedTransparently) {
  constexpr size_t kBytes = 256 << 10;
  OpenFile(kBytes);
  AlignedBuf buf = MakeAligned(kBytes, 2 << 20);
  FillPattern(buf.get(), kBytes, 3);
  Status reg = backend_->RegisterBuffer(buf.get(), kBytes);
  if (GetParam() == IoBackendKind::kIoUring) {
    EXPECT_TRUE(reg.ok()) << reg.ToString();
    EXPECT_TRUE(backend_->RegisterBuffer(buf.get(), kBytes).IsInvalidArgument());  // twice
  } else {
    EXPECT_TRUE(reg.IsUnavailable()) << reg.ToString();
  }
  ASSERT_TRUE(backend_->Write(fd_, 0, buf.get() + 4096, kBytes - 4096).ok());
  AlignedBuf back = MakeAligned(kBytes);
  ASSERT_TRUE(backend_->Read(fd_, 0, back.get(), kBytes - 4096).ok());
  EXPECT_EQ(std::memcmp(back.get(), buf.get() + 4096, kBytes - 4096), 0);
  backend_->UnregisterBuffer(buf.get());
}

TEST_P(IoBackendContract, DestroyingTheBackendWaitsForInFlightWrites) {
  constexpr size_t kBytes = 1 << 20;
  OpenFile(kBytes);
  AlignedBuf src = MakeAligned(kBytes);
  FillPattern(src.get(), kBytes, 9);
  std::vector<IoRequest> batch;
  for (size_t i = 0; i < kQd; ++i) {
    batch.push_back(
        {IoOp::kWrite, fd_, i * (kBytes / kQd), src.get() + i * (kBytes / kQd), kBytes / kQd, i});
  }
  size_t inflight_at_queue_exit = 12345;
  if (GetParam() == IoBackendKind::kIoUring) {  // the ring must not be closed under IO
    auto faults = std::make_shared<nvme::UringFaults>();
    faults->before_queue_exit = [&](size_t n) { inflight_at_queue_exit = n; };
    backend_->UnregisterFile(fd_);
    backend_ = Make(GetParam(), faults);
    ASSERT_NE(backend_, nullptr);
    ASSERT_TRUE(backend_->RegisterFile(fd_, path_).ok());
  }
  ASSERT_TRUE(backend_->Submit(batch).ok());
  backend_->UnregisterFile(fd_);  // the fd stays open; only the name table entry goes
  backend_.reset();
  if (GetParam() == IoBackendKind::kIoUring) {
    EXPECT_EQ(inflight_at_queue_exit, 0u);
  }
  AlignedBuf back = MakeAligned(kBytes);
  ASSERT_EQ(pread(fd_, back.get(), kBytes, 0), static_cast<ssize_t>(kBytes));
  EXPECT_EQ(std::memcmp(back.get(), src.get(), kBytes), 0);
  close(fd_);
  fd_ = -1;
}

INSTANTIATE_TEST_SUITE_P(AllBackends, IoBackendContract,
                         ::testing::Values(IoBackendKind::kIoUring, IoBackendKind::kPosix,
                                           IoBackendKind::kSimulated),
                         [](const auto& info) {
                           std::string n(IoBackendKindName(info.param));
                           n.erase(std::remove(n.begin(), n.end(), '_'), n.end());
                           return n;
                         });

TEST(IoBufferRegistrar, PoolBuffersBecomeFixedBuffersOfTheRing) {
  IoBackendOptions o;
  o.kind = IoBackendKind::kIoUring;
  auto io = nvme::UringBackend::Open(o);
  ASSERT_TRUE(io.ok()) << io.status().ToString();
  nvme::IoBufferRegistrar reg(io->get());
  cpu::PinnedPoolOptions po;
  po.budget_bytes = 8 << 20;
  po.registrars = {&reg};
  po.register_with_cuda = false;
  {
    auto pool = cpu::PinnedPool::Create(po);
    ASSERT_TRUE(pool.ok());
    auto a = (*pool)->Allocate(2 << 20);
    auto b = (*pool)->Allocate(4 << 20);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(a->registered() && b->registered()) << (*pool)->note();
    EXPECT_EQ((*io)->registered_buffers(), 1u + 1u);
    TempDir dir("registrar");
    int fd = OpenDirect(dir.File("f"), 2 << 20);
    FillPattern(a->as<char>(), 2 << 20, 11);
    ASSERT_TRUE((*io)->Write(fd, 0, a->data(), 2 << 20).ok());
    ASSERT_TRUE((*io)->Read(fd, 0, b->data(), 2 << 20).ok());
    EXPECT_EQ(std::memcmp(a->data(), b->data(), 2 << 20), 0);
    close(fd);
  }
  EXPECT_EQ((*io)->registered_buffers(), 0u);  // unregistered before unmapping
}

TEST(UringBackend, SingleIssuerRingWorksForItsCreatingThread) {
  IoBackendOptions o;
  o.kind = IoBackendKind::kIoUring;
  o.single_issuer = true;
  o.queue_depth = 4;
  auto io = nvme::UringBackend::Open(o);
  ASSERT_TRUE(io.ok()) << io.status().ToString();
  // Kernel 6.1+ accepts the flags; older ones fall back to plain flags with a note.
  if ((*io)->note().empty()) {
    EXPECT_NE((*io)->setup_flags() & IORING_SETUP_SINGLE_ISSUER, 0u);
    EXPECT_NE((*io)->setup_flags() & IORING_SETUP_DEFER_TASKRUN, 0u);
  }
  TempDir dir("single");
  int fd = OpenDirect(dir.File("f"), 64 << 10);
  ASSERT_TRUE((*io)->RegisterFile(fd, dir.File("f")).ok());
  AlignedBuf src = MakeAligned(64 << 10), dst = MakeAligned(64 << 10);
  FillPattern(src.get(), 64 << 10, 8);
  std::vector<IoRequest> w, r;
  for (size_t i = 0; i < 16; ++i) {
    w.push_back({IoOp::kWrite, fd, i * 4096, src.get() + i * 4096, 4096, i});
    r.push_back({IoOp::kRead, fd, i * 4096, dst.get() + i * 4096, 4096, i});
  }
  ASSERT_TRUE((*io)->Execute(w).ok());
  ASSERT_TRUE((*io)->Execute(r).ok());
  EXPECT_EQ(std::memcmp(src.get(), dst.get(), 64 << 10), 0);
  (*io)->UnregisterFile(fd);
  close(fd);
}

TEST(OpenIoBackend, RejectsBadOptions) {
  IoBackendOptions o;
  o.queue_depth = 0;
  EXPECT_TRUE(OpenIoBackend(o).status().IsInvalidArgument());
  o.queue_depth = 5000;
  EXPECT_TRUE(OpenIoBackend(o).status().IsInvalidArgument());
  o.queue_depth = 4;
  o.posix_threads = 0;
  EXPECT_TRUE(OpenIoBackend(o).status().IsInvalidArgument());
}

TEST(OpenIoBackend, AutoPicksIoUringWhereTheKernelAllowsIt) {
  IoBackendOptions o;
  auto b = OpenIoBackend(o);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  // This machine allows io_uring (kernel.io_uring_disabled = 0); a refusal is tested in
  // io_fallback_test under seccomp.
  EXPECT_EQ((*b)->kind(), IoBackendKind::kIoUring) << (*b)->note();
}

}  // namespace
}  // namespace strata
