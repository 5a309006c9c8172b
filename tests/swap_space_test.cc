// SwapSpace: striped layout, checksums against on-disk corruption, failed writes never verify,
// clear errors for bad paths / full disk / no O_DIRECT / leftovers after a crash.
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>

#include "nvme/sim_backend.h"
#include "nvme/swap_space.h"
#include "nvme/unit_hash.h"
#include "tests/io_test_util.h"

namespace strata {
// Readable parameter names in test listings ("iouring" instead of "1-byte object <01>").
inline void PrintTo(IoBackendKind k, std::ostream* os) { *os << IoBackendKindName(k); }
}  // namespace strata

namespace strata::nvme {
namespace {

using testing::AlignedBuf;
using testing::FillPattern;
using testing::MakeAligned;
using testing::TempDir;

constexpr size_t kUnit = 64 << 10;

std::unique_ptr<IoBackend> MakeBackend(IoBackendKind kind) {
  if (kind == IoBackendKind::kSimulated) {
    SimOptions o;
    o.seed = 4242;
    o.queue_depth = 8;
    return std::make_unique<SimBackend>(o);
  }
  IoBackendOptions o;
  o.kind = kind;
  o.queue_depth = 8;
  auto b = OpenIoBackend(o);
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  return std::move(b).value();
}

SwapSpaceOptions TwoPaths(const TempDir& dir) {
  std::filesystem::create_directories(dir.File("ssd0"));
  std::filesystem::create_directories(dir.File("ssd1"));
  SwapSpaceOptions o;
  o.paths = {dir.File("ssd0"), dir.File("ssd1")};
  o.stripe_unit_bytes = kUnit;
  o.max_inflight_ops = 4;
  return o;
}

const std::vector<SwapBlockSpec> kBlocks = {
    {7, 5000}, {8, kUnit}, {9, 5 * kUnit + 4096}, {10, 4096}};

class SwapContract : public ::testing::TestWithParam<IoBackendKind> {
 protected:
  void SetUp() override {
    io_ = MakeBackend(GetParam());
    auto s = SwapSpace::Create(TwoPaths(dir_), kBlocks, io_.get());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    swap_ = std::move(s).value();
  }
  TempDir dir_{"swap"};
  std::unique_ptr<IoBackend> io_;
  std::unique_ptr<SwapSpace> swap_;
};

TEST_P(SwapContract, BlocksRoundTripStripedOverBothPathsAsync) {
  std::vector<AlignedBuf> src, dst;
  std::vector<SwapOp> writes, reads;
  for (const SwapBlockSpec& b : kBlocks) {
    const size_t n = swap_->ExtentBytes(b.id);
    ASSERT_EQ(n % 4096, 0u);
    ASSERT_GE(n, b.size_bytes);
    src.push_back(MakeAligned(n));
    dst.push_back(MakeAligned(n));
    FillPattern(src.back().get(), n, b.id);
    writes.push_back({IoOp::kWrite, b.id, src.back().get(), b.id * 10});
    reads.push_back({IoOp::kRead, b.id, dst.back().get(), b.id * 10 + 1});
  }
  for (auto* batch : {&writes, &reads}) {
    ASSERT_TRUE(swap_->Submit(*batch).ok());
    std::vector<SwapCompletion> out(2);
    size_t done = 0;
    while (swap_->inflight_ops() > 0) {
      auto n = swap_->Reap(out, 1);
      ASSERT_TRUE(n.ok()) << n.status().ToString();
      for (size_t i = 0; i < *n; ++i) {
        EXPECT_TRUE(out[i].status.ok()) << out[i].status.ToString();
        EXPECT_EQ(out[i].user_data, out[i].block_id * 10 + (batch == &reads ? 1 : 0));
      }
      done += *n;
    }
    EXPECT_EQ(done, kBlocks.size());
  }
  for (size_t i = 0; i < kBlocks.size(); ++i) {
    EXPECT_EQ(std::memcmp(src[i].get(), dst[i].get(), kBlocks[i].size_bytes), 0) << i;
  }
  // Block 9 spans 6 units alternating over both files.
  auto pieces = swap_->Layout(9);
  ASSERT_EQ(pieces.size(), 6u);
  EXPECT_NE(pieces[0].file, pieces[1].file);
  EXPECT_EQ(pieces[0].file, pieces[2].file);
  // Preallocated: the files hold every unit.
  for (size_t f = 0; f < swap_->files().size(); ++f) {
    struct stat st {};
    ASSERT_EQ(stat(swap_->files()[f].c_str(), &st), 0);
    EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, swap_->file_bytes(f));
  }
}

TEST_P(SwapContract, FlippedByteOnDiskIsCorruptionNamingTheBlock) {
  const size_t n = swap_->ExtentBytes(9);
  AlignedBuf src = MakeAligned(n), dst = MakeAligned(n);
  FillPattern(src.get(), n, 1);
  ASSERT_TRUE(swap_->Write(9, src.get()).ok());
  ASSERT_TRUE(swap_->Read(9, dst.get()).ok());
  // Flip one byte in the third unit, straight on disk.
  const auto piece = swap_->Layout(9)[2];
  int fd = open(piece.file.c_str(), O_RDWR | O_DIRECT);
  ASSERT_GE(fd, 0);
  AlignedBuf page = MakeAligned(4096);
  ASSERT_EQ(pread(fd, page.get(), 4096, static_cast<off_t>(piece.offset)), 4096);
  page.get()[123] ^= 0x10;
  ASSERT_EQ(pwrite(fd, page.get(), 4096, static_cast<off_t>(piece.offset)), 4096);
  close(fd);
  Status s = swap_->Read(9, dst.get());
  EXPECT_TRUE(s.IsCorruption()) << s.ToString();
  EXPECT_NE(s.message().find("swap block 9"), std::string_view::npos) << s.ToString();
  // Other blocks are unaffected; rewriting heals the block.
  ASSERT_TRUE(swap_->Write(9, src.get()).ok());
  EXPECT_TRUE(swap_->Read(9, dst.get()).ok());
}

TEST_P(SwapContract, ReadingANeverWrittenBlockIsFailedPrecondition) {
  AlignedBuf buf = MakeAligned(swap_->ExtentBytes(10));
  Status s = swap_->Read(10, buf.get());
  EXPECT_EQ(s.code(), Status::Code::kFailedPrecondition) << s.ToString();
  EXPECT_TRUE(swap_->Read(12345, buf.get()).IsNotFound());
}

TEST_P(SwapContract, MisalignedBufferIsAProgrammerError) {
  AlignedBuf buf = MakeAligned(2 * 4096);
#ifdef NDEBUG
  EXPECT_TRUE(swap_->Write(10, buf.get() + 8).IsInvalidArgument());
#else
  EXPECT_DEATH((void)swap_->Write(10, buf.get() + 8), "4 KiB-aligned");
#endif
}

TEST_P(SwapContract, CleanCloseRemovesTheFiles) {
  const auto files = swap_->files();
  ASSERT_EQ(files.size(), 2u);
  for (const auto& f : files) EXPECT_TRUE(std::filesystem::exists(f)) << f;
  ASSERT_TRUE(swap_->Close().ok());
  for (const auto& f : files) EXPECT_FALSE(std::filesystem::exists(f)) << f;
  // A new space can now be created on the same paths.
  auto again = SwapSpace::Create(TwoPaths(dir_), kBlocks, io_.get());
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

INSTANTIATE_TEST_SUITE_P(AllBackends, SwapContract,
                         ::testing::Values(IoBackendKind::kIoUring, IoBackendKind::kPosix,
                                           IoBackendKind::kSimulated),
                         [](const auto& info) {
                           return info.param == IoBackendKind::kIoUring
                                      ? std::string("iouring")
                                      : std::string(IoBackendKindName(info.param));
                         });

// The unit checksum is XXH3-64 whichever kernel computes it (the run-time dispatched one here when
// libxxhash has it): the sums in a swap file never depend on the machine's SIMD. Sizes around
// XXH3's internal boundaries (16, 128, 240 bytes; its 1 KiB stripe block) and unaligned starts.
TEST(SwapChecksum, UnitHashIsXxh3OfTheBytes) {
  std::mt19937_64 rng(11);
  std::vector<uint8_t> buf((size_t{1} << 20) + 64);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{128},
                   size_t{129}, size_t{240}, size_t{241}, size_t{1023}, size_t{1024}, size_t{1025},
                   size_t{4096}, size_t{1} << 20}) {
    for (size_t at : {size_t{0}, size_t{3}}) {
      EXPECT_EQ(nvme::UnitHash(buf.data() + at, n), XXH3_64bits(buf.data() + at, n))
          << n << " bytes at offset " << at;
    }
  }
  // It sees every byte: one flipped bit changes it.
  const uint64_t before = nvme::UnitHash(buf.data(), size_t{1} << 20);
  buf[777'777] ^= 0x10;
  EXPECT_NE(nvme::UnitHash(buf.data(), size_t{1} << 20), before);
}

TEST(SwapFaults, FailedWriteInvalidatesTheBlockUntilRewritten) {
  TempDir dir("swapfault");
  SimOptions so;
  so.seed = 99;
  SimBackend sim(so);
  auto s = SwapSpace::Create(TwoPaths(dir), kBlocks, &sim);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto& swap = *s;
  const size_t n = swap->ExtentBytes(9);
  AlignedBuf v1 = MakeAligned(n), v2 = MakeAligned(n), back = MakeAligned(n);
  FillPattern(v1.get(), n, 1);
  FillPattern(v2.get(), n, 2);
  ASSERT_TRUE(swap->Write(9, v1.get()).ok());
  sim.InjectFault(IoOp::kWrite, SimFault::kTorn);
  Status w = swap->Write(9, v2.get());
  EXPECT_TRUE(w.IsIOError()) << w.ToString() << " seed " << sim.seed();
  EXPECT_NE(w.message().find("swap block 9"), std::string_view::npos) << w.ToString();
  Status r = swap->Read(9, back.get());
  EXPECT_TRUE(r.IsCorruption()) << r.ToString();
  EXPECT_NE(r.message().find("last write failed"), std::string_view::npos) << r.ToString();
  ASSERT_TRUE(swap->Write(9, v2.get()).ok());
  ASSERT_TRUE(swap->Read(9, back.get()).ok());
  EXPECT_EQ(std::memcmp(back.get(), v2.get(), n), 0);
}

// The core guarantee under random faults: a read that succeeds returns exactly the last
// successfully written version; a block whose last write failed never verifies. ENOSPC included
// (a disk filling up in the middle of a striped write; issue 12).
TEST(SwapFaults, RandomFaultsNeverYieldWrongData) {
  TempDir dir("swaprandom");
  SimOptions so;
  so.seed = 314159;
  so.queue_depth = 8;
  so.p_eio = 0.04;
  so.p_enospc = 0.04;
  so.p_torn = 0.04;
  so.p_short = 0.1;
  so.p_eintr = 0.05;
  so.p_eagain = 0.05;
  so.p_zero_read = 0.02;
  SimBackend sim(so);
  auto s = SwapSpace::Create(TwoPaths(dir), kBlocks, &sim);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto& swap = *s;
  std::mt19937_64 rng(so.seed);
  std::map<uint64_t, int64_t> expected;  // block -> version; -1: last write failed
  AlignedBuf buf = MakeAligned(8 * kUnit), want = MakeAligned(8 * kUnit);
  int ok_reads = 0, failed_writes = 0, refused_reads = 0;
  for (int64_t v = 1; v <= 400; ++v) {
    const SwapBlockSpec& b = kBlocks[rng() % kBlocks.size()];
    const size_t n = swap->ExtentBytes(b.id);
    if (rng() % 2 == 0 || expected.count(b.id) == 0) {
      FillPattern(buf.get(), n, static_cast<uint64_t>(v));
      Status w = swap->Write(b.id, buf.get());
      expected[b.id] = w.ok() ? v : -1;
      failed_writes += w.ok() ? 0 : 1;
      continue;
    }
    Status r = swap->Read(b.id, buf.get());
    if (r.ok()) {
      ASSERT_GE(expected[b.id], 0) << "a block whose last write failed verified; seed " << so.seed;
      FillPattern(want.get(), n, static_cast<uint64_t>(expected[b.id]));
      ASSERT_EQ(std::memcmp(buf.get(), want.get(), n), 0) << "wrong data; seed " << so.seed;
      ++ok_reads;
    } else {
      // Corruption only for a block whose last write failed, or an injected zero-length read.
      if (r.IsCorruption() && r.message().find("zero-length read") == std::string_view::npos) {
        EXPECT_EQ(expected[b.id], -1) << r.ToString() << " seed " << so.seed;
      }
      ++refused_reads;
    }
  }
  EXPECT_GT(ok_reads, 50) << "seed " << so.seed;
  EXPECT_GT(failed_writes, 5) << "seed " << so.seed;
  EXPECT_GT(refused_reads, 5) << "seed " << so.seed;
}

TEST(SwapFaults, ReadErrorNamesBlockFileAndErrno) {
  TempDir dir("swapeio");
  SimBackend sim(SimOptions{});
  auto s = SwapSpace::Create(TwoPaths(dir), kBlocks, &sim);
  ASSERT_TRUE(s.ok());
  AlignedBuf buf = MakeAligned((*s)->ExtentBytes(8));
  ASSERT_TRUE((*s)->Write(8, buf.get()).ok());
  sim.InjectFault(IoOp::kRead, SimFault::kEio);
  Status r = (*s)->Read(8, buf.get());
  EXPECT_TRUE(r.IsIOError()) << r.ToString();
  EXPECT_NE(r.message().find("swap block 8"), std::string_view::npos) << r.ToString();
  EXPECT_NE(r.message().find("strata-swap-rank0.swp"), std::string_view::npos) << r.ToString();
  EXPECT_NE(r.message().find("errno 5"), std::string_view::npos) << r.ToString();
}

TEST(SwapErrors, BadPathsAndSpecsAreClear) {
  TempDir dir("swaperr");
  SimBackend sim(SimOptions{});
  SwapSpaceOptions o;
  o.paths = {dir.File("missing")};
  Status s = SwapSpace::Create(o, kBlocks, &sim).status();
  EXPECT_TRUE(s.IsNotFound()) << s.ToString();
  EXPECT_NE(s.message().find("missing"), std::string_view::npos);

  {
    std::FILE* f = std::fopen(dir.File("plainfile").c_str(), "w");
    std::fclose(f);
  }
  o.paths = {dir.File("plainfile")};
  s = SwapSpace::Create(o, kBlocks, &sim).status();
  EXPECT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_NE(s.message().find("not a directory"), std::string_view::npos) << s.ToString();

  o.paths = {};
  EXPECT_TRUE(SwapSpace::Create(o, kBlocks, &sim).status().IsInvalidArgument());
  o.paths = {dir.path()};
  o.stripe_unit_bytes = 1000;
  EXPECT_TRUE(SwapSpace::Create(o, kBlocks, &sim).status().IsInvalidArgument());
  o.stripe_unit_bytes = kUnit;
  const std::vector<SwapBlockSpec> dup = {{1, 4096}, {1, 8192}};
  EXPECT_TRUE(SwapSpace::Create(o, dup, &sim).status().IsInvalidArgument());
  const std::vector<SwapBlockSpec> empty = {{1, 0}};
  EXPECT_TRUE(SwapSpace::Create(o, empty, &sim).status().IsInvalidArgument());
  // Nothing was left behind by the failed attempts.
  EXPECT_FALSE(std::filesystem::exists(SwapFilePath(dir.path(), 0)));
}

TEST(SwapErrors, DiskTooSmallFailsAtCreateWithEnospc) {
  TempDir dir("swapfull");
  SimBackend sim(SimOptions{});
  SwapSpaceOptions o;
  o.paths = {dir.path()};
  const std::vector<SwapBlockSpec> huge = {{1, size_t{1} << 50}};  // 1 PiB
  Status s = SwapSpace::Create(o, huge, &sim).status();
  EXPECT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_NE(s.message().find("No space left"), std::string_view::npos) << s.ToString();
  EXPECT_NE(s.message().find(dir.path()), std::string_view::npos) << s.ToString();
  EXPECT_FALSE(std::filesystem::exists(SwapFilePath(dir.path(), 0)));
}

// --- the scratch of runs that died ---------------------------------------------------------

// Runs `body` in a forked child and returns its exit status (-1: it did not exit normally).
int InChild(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) std::_Exit(body());
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// A "training run" in a forked child: creates the swap space of `o` and dies (_exit) without
// closing it, leaving its files.
void RunThatDies(const SwapSpaceOptions& o) {
  ASSERT_EQ(InChild([&] {
              SimBackend sim(SimOptions{});
              auto s = SwapSpace::Create(o, kBlocks, &sim);
              std::_Exit(s.ok() ? 0 : 2);  // before `s` closes the space
              return 2;
            }),
            0);
}

// A live process holding the swap space of `o` open until destroyed (then killed).
class LiveRun {
 public:
  explicit LiveRun(const SwapSpaceOptions& o) {
    int ready[2], hold[2];
    if (pipe(ready) != 0 || pipe(hold) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      close(ready[0]);
      close(hold[1]);
      SimBackend sim(SimOptions{});
      auto s = SwapSpace::Create(o, kBlocks, &sim);
      const char ok = s.ok() ? 'y' : 'n';
      (void)!write(ready[1], &ok, 1);
      char c;
      (void)!read(hold[0], &c, 1);  // until the parent closes its end
      std::_Exit(0);
    }
    close(ready[1]);
    close(hold[0]);
    hold_ = hold[1];
    char c = 0;
    started_ = read(ready[0], &c, 1) == 1 && c == 'y';
    close(ready[0]);
  }
  ~LiveRun() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    close(hold_);
    waitpid(pid_, nullptr, 0);
  }
  bool started() const { return started_; }

 private:
  pid_t pid_ = -1;
  int hold_ = -1;
  bool started_ = false;
};

constexpr char kMarker[] = "dead run";

void WriteMarker(const std::string& path) {
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path;
  EXPECT_EQ(pwrite(fd, kMarker, sizeof kMarker, 0), static_cast<ssize_t>(sizeof kMarker));
  close(fd);
}

bool HasMarker(const std::string& path) {
  char got[sizeof kMarker] = {};
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  const bool has = fd >= 0 && pread(fd, got, sizeof got, 0) == static_cast<ssize_t>(sizeof got) &&
                   std::memcmp(got, kMarker, sizeof got) == 0;
  if (fd >= 0) close(fd);
  return has;
}

ino_t Inode(const std::string& path) {
  struct stat st {};
  return lstat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

// The same rank after a crash, and another rank (e.g. after a world size change): the dead
// run's swap file and a killed benchmark's scratch file are removed, said on stderr and in
// note(), and the space starts.
TEST(SwapReclaim, FilesOfADeadRunAreReclaimedWithANotice) {
  for (int rank : {3, 4}) {
    TempDir dir("swapcrash");
    SwapSpaceOptions o;
    o.paths = {dir.path()};
    o.rank = 3;
    RunThatDies(o);
    const std::string leftover = SwapFilePath(dir.path(), 3);
    const std::string bench = dir.File("strata-bench-4242.dat");
    ASSERT_TRUE(std::filesystem::exists(leftover));
    WriteMarker(leftover);  // inode numbers are reused at once: the marker tells the files apart
    { std::fclose(std::fopen(bench.c_str(), "w")); }
    SimBackend sim(SimOptions{});
    o.rank = rank;
    ::testing::internal::CaptureStderr();
    auto s = SwapSpace::Create(o, kBlocks, &sim);
    const std::string err = ::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    const std::string& note = (*s)->note();
    EXPECT_NE(note.find("reclaimed 2 file(s) left by a run that did not close cleanly"),
              std::string::npos)
        << note;
    EXPECT_NE(note.find("'" + leftover + "'"), std::string::npos) << note;
    EXPECT_NE(note.find("'" + bench + "'"), std::string::npos) << note;
    EXPECT_EQ(err, "strata: " + note + "\n");
    EXPECT_FALSE(std::filesystem::exists(bench));
    if (rank == 3) {
      EXPECT_FALSE(HasMarker(leftover)) << "the dead run's file must not be reused";
    } else {
      EXPECT_FALSE(std::filesystem::exists(leftover));
    }
    ASSERT_TRUE((*s)->Close().ok());
  }
}

TEST(SwapReclaim, NothingToReclaimSaysNothing) {
  TempDir dir("swapquiet");
  SwapSpaceOptions o;
  o.paths = {dir.path()};
  SimBackend sim(SimOptions{});
  ::testing::internal::CaptureStderr();
  auto s = SwapSpace::Create(o, kBlocks, &sim);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->note(), "");
}

// Another live engine's file (another process, here rank 0 of another job) is never touched,
// by another rank starting beside it or by the same rank, which is refused.
TEST(SwapReclaim, AFileALiveProcessHoldsIsNeverTouched) {
  TempDir dir("swaplive-proc");
  SwapSpaceOptions o;
  o.paths = {dir.path()};
  const std::string held = SwapFilePath(dir.path(), 0);
  {
    LiveRun other(o);
    ASSERT_TRUE(other.started());
    const ino_t inode = Inode(held);
    SimBackend sim(SimOptions{});
    o.rank = 1;
    auto beside = SwapSpace::Create(o, kBlocks, &sim);
    ASSERT_TRUE(beside.ok()) << beside.status().ToString();
    EXPECT_EQ((*beside)->note(), "");
    o.rank = 0;
    Status same = SwapSpace::Create(o, kBlocks, &sim).status();
    EXPECT_EQ(same.code(), Status::Code::kFailedPrecondition) << same.ToString();
    EXPECT_NE(same.message().find("'" + held + "' is in use by another live process"),
              std::string_view::npos)
        << same.ToString();
    EXPECT_EQ(Inode(held), inode) << "a live process's file was replaced or removed";
  }  // killed now: its file is a leftover
  SimBackend sim(SimOptions{});
  auto after = SwapSpace::Create(o, kBlocks, &sim);
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_NE((*after)->note().find("'" + held + "'"), std::string::npos) << (*after)->note();
}

// What is not strata's is never touched, also while a dead run's file is reclaimed beside it:
// other names, a FIFO, a symbolic link (nor its target) and a directory under strata names.
TEST(SwapReclaim, FilesThatAreNotStrataAreNeverTouched) {
  TempDir dir("swapforeign"), elsewhere("swapforeign-target");
  SwapSpaceOptions o;
  o.paths = {dir.path()};
  o.rank = 2;
  RunThatDies(o);
  const std::string target = elsewhere.File("precious.dat");
  { std::fclose(std::fopen(target.c_str(), "w")); }
  const std::vector<std::string> plain = {dir.File("notes.txt"), dir.File("strata-bench-x.dat"),
                                          dir.File("strata-swap-rank0.swp.bak")};
  for (const std::string& p : plain) std::fclose(std::fopen(p.c_str(), "w"));
  ASSERT_EQ(mkfifo(SwapFilePath(dir.path(), 5).c_str(), 0600), 0);
  ASSERT_EQ(symlink(target.c_str(), dir.File("strata-bench-7.dat").c_str()), 0);
  ASSERT_EQ(mkdir(SwapFilePath(dir.path(), 6).c_str(), 0700), 0);
  SimBackend sim(SimOptions{});
  auto s = SwapSpace::Create(o, kBlocks, &sim);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_NE((*s)->note().find("reclaimed 1 file(s)"), std::string::npos) << (*s)->note();
  for (const std::string& p : plain) EXPECT_TRUE(std::filesystem::exists(p)) << p;
  EXPECT_TRUE(std::filesystem::is_fifo(SwapFilePath(dir.path(), 5)));
  EXPECT_TRUE(std::filesystem::is_symlink(dir.File("strata-bench-7.dat")));
  EXPECT_TRUE(std::filesystem::exists(target));
  EXPECT_TRUE(std::filesystem::is_directory(SwapFilePath(dir.path(), 6)));
}

// The ranks of a rerun start together in a path holding the dead run's files of every rank:
// each reclaims what it finds, and one rank's momentary lock on another's leftover (its scan)
// never makes that rank refuse its own file. Each round's ranks die without closing, so the
// next round starts over their files.
TEST(SwapReclaim, RanksStartingTogetherAllStartOverTheirDeadFiles) {
  TempDir dir("swapranks");
  constexpr int kRanks = 4, kRounds = 8;
  for (int r = 0; r < kRanks; ++r) {
    SwapSpaceOptions o;
    o.paths = {dir.path()};
    o.rank = r;
    RunThatDies(o);
  }
  for (int round = 0; round < kRounds; ++round) {
    int go[2];
    ASSERT_EQ(pipe(go), 0);
    std::vector<pid_t> pids;
    for (int r = 0; r < kRanks; ++r) {
      const pid_t pid = fork();
      if (pid == 0) {
        close(go[1]);
        char c;
        (void)!read(go[0], &c, 1);  // all ranks released at once
        SimBackend sim(SimOptions{});
        SwapSpaceOptions o;
        o.paths = {dir.path()};
        o.rank = r;
        auto s = SwapSpace::Create(o, kBlocks, &sim);
        if (!s.ok()) std::fprintf(stderr, "rank %d: %s\n", r, s.status().ToString().c_str());
        std::_Exit(s.ok() ? 0 : 1);  // dies holding its files
      }
      pids.push_back(pid);
    }
    close(go[0]);
    close(go[1]);
    for (pid_t pid : pids) {
      int status = 0;
      ASSERT_EQ(waitpid(pid, &status, 0), pid);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "round " << round;
    }
  }
}

TEST(SwapErrors, FilesOfLiveRanksAreNotLeftovers) {
  TempDir dir("swaplive");
  SimBackend sim(SimOptions{});
  SwapSpaceOptions o;
  o.paths = {dir.path()};
  o.rank = 0;
  auto r0 = SwapSpace::Create(o, kBlocks, &sim);
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  o.rank = 1;  // another rank of the same job on the same path
  auto r1 = SwapSpace::Create(o, kBlocks, &sim);
  EXPECT_TRUE(r1.ok()) << r1.status().ToString();
  // The same rank twice in this process (two engines of one script): in use, not a leftover,
  // refused at once (no rescans) naming this process.
  o.rank = 0;
  const auto t0 = std::chrono::steady_clock::now();
  Status s = SwapSpace::Create(o, kBlocks, &sim).status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  EXPECT_EQ(s.code(), Status::Code::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("'" + SwapFilePath(dir.path(), 0) +
                             "' is in use by another strata engine of rank 0 in this process: "
                             "give each engine its own nvme_path"),
            std::string_view::npos)
      << s.ToString();
  ASSERT_TRUE((*r0)->Close().ok());
  EXPECT_FALSE(std::filesystem::exists(SwapFilePath(dir.path(), 0)));
  auto again = SwapSpace::Create(o, kBlocks, &sim);
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

// ramfs has no O_DIRECT (tmpfs gained it in Linux 6.6). Mounted in a private mount namespace of
// a forked child, so nothing outside the test sees it.
void ChildOnRamfs(const std::string& mnt) {
  auto fail = [](const std::string& why) {
    std::fprintf(stderr, "FAILED: %s\n", why.c_str());
    std::_Exit(1);
  };
  if (unshare(CLONE_NEWNS) != 0 ||
      mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
      mount("none", mnt.c_str(), "ramfs", 0, nullptr) != 0) {
    std::fprintf(stderr, "no mount namespace here: %s\n", std::strerror(errno));
    std::_Exit(3);
  }
  SimBackend sim(SimOptions{});
  SwapSpaceOptions o;
  o.paths = {mnt};
  Status s = SwapSpace::Create(o, kBlocks, &sim).status();
  if (!s.IsInvalidArgument() || s.ToString().find("O_DIRECT") == std::string::npos) {
    fail("expected InvalidArgument naming O_DIRECT, got " + s.ToString());
  }
  if (std::filesystem::exists(SwapFilePath(mnt, 0))) fail("refused space left its file behind");
  o.allow_buffered_io = true;
  auto ok = SwapSpace::Create(o, kBlocks, &sim);
  if (!ok.ok()) fail("with allow_buffered_io: " + ok.status().ToString());
  AlignedBuf a = MakeAligned(8192), b = MakeAligned(8192);
  FillPattern(a.get(), 8192, 3);
  if (!(*ok)->Write(7, a.get()).ok() || !(*ok)->Read(7, b.get()).ok() ||
      std::memcmp(a.get(), b.get(), 5000) != 0) {
    fail("buffered round trip");
  }
  std::fprintf(stderr, "ramfs ok: %s | %s\n", s.ToString().c_str(), (*ok)->note().c_str());
  std::_Exit(0);
}

// Whether this process may create a mount namespace and mount ramfs (CAP_SYS_ADMIN).
bool CanMountRamfs(const std::string& mnt) {
  pid_t pid = fork();
  if (pid == 0) {
    bool ok = unshare(CLONE_NEWNS) == 0 &&
              mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0 &&
              mount("none", mnt.c_str(), "ramfs", 0, nullptr) == 0;
    std::_Exit(ok ? 0 : 3);
  }
  int status = 0;
  return pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
         WEXITSTATUS(status) == 0;
}

TEST(SwapErrors, FilesystemWithoutODirectIsRefusedUnlessBufferedIsAllowed) {
  TempDir dir("swapramfs");
  const std::string mnt = dir.File("mnt");
  std::filesystem::create_directories(mnt);
  if (!CanMountRamfs(mnt)) GTEST_SKIP() << "needs CAP_SYS_ADMIN to mount ramfs in a namespace";
  EXPECT_EXIT(ChildOnRamfs(mnt), ::testing::ExitedWithCode(0),
              "ramfs ok: InvalidArgument: .*O_DIRECT.*buffered IO there");
}

}  // namespace
}  // namespace strata::nvme
