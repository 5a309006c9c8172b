// nvme::RunNvmeMix, the io_efficiency reference of `bench engine`: it moves the requested
// read/write mix (rounded up to whole blocks) over every directory, with several streams,
// reports the time, and leaves no file behind; bad arguments are refused by name; each stream's
// IO cycles through buffer_bytes of memory (whole blocks, capped at what it moves, at least the
// depth); the passes touch span_bytes of file.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "io_test_util.h"
#include "nvme/bench/nvme_bench.h"

namespace strata::nvme {
namespace {

using strata::testing::TempDir;

NvmeMixOptions Small(const std::vector<std::string>& dirs) {
  NvmeMixOptions o;
  o.dirs = dirs;
  o.block_bytes = 64 << 10;
  o.queue_depth = 4;
  o.backend = IoBackendKind::kPosix;
  o.huge_pages = false;
  return o;
}

TEST(NvmeMix, MovesTheMixRoundedToBlocksAndRemovesItsFiles) {
  TempDir a("mix-a"), b("mix-b");
  for (IoBackendKind kind : {IoBackendKind::kPosix, IoBackendKind::kAuto}) {
    NvmeMixOptions o = Small({a.path(), b.path()});
    o.backend = kind;
    o.streams = 2;
    o.read_bytes = 3 * o.block_bytes + 1;  // 4 blocks
    o.write_bytes = 6 * o.block_bytes;
    auto r = RunNvmeMix(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->read_bytes, 4 * o.block_bytes);
    EXPECT_EQ(r->write_bytes, 6 * o.block_bytes);
    EXPECT_GT(r->seconds, 0.0);
    EXPECT_GT(r->prefill_write_bytes_per_s, 0.0);
    EXPECT_FALSE(r->backend.empty());
    EXPECT_TRUE(std::filesystem::is_empty(a.path()));
    EXPECT_TRUE(std::filesystem::is_empty(b.path()));
  }
}

TEST(NvmeMix, ReadOnlyWriteOnlyAndMoreStreamsThanUnits) {
  TempDir d("mix-one");
  for (auto [rd, wr] : {std::pair<uint64_t, uint64_t>{1 << 20, 0}, {0, 1 << 20}}) {
    NvmeMixOptions o = Small({d.path()});
    o.read_bytes = rd;
    o.write_bytes = wr;
    auto r = RunNvmeMix(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->read_bytes, rd);
    EXPECT_EQ(r->write_bytes, wr);
  }
  NvmeMixOptions o = Small({d.path()});
  o.read_bytes = o.block_bytes;
  o.streams = 3;  // two streams have nothing to do
  auto r = RunNvmeMix(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->read_bytes, o.block_bytes);
}

TEST(NvmeMix, CyclesThroughItsBufferMemoryCappedAtWhatEachStreamMoves) {
  TempDir d("mix-buf");
  struct Case {
    size_t buffer_bytes, streams;
    uint64_t units;
    size_t want_blocks;
    const char* what;
  };
  for (const Case& c : {Case{1 << 20, 1, 40, 16, "1 MiB of 64 KiB blocks"},
                        Case{(1 << 20) + 1000, 1, 40, 16, "rounded down to whole blocks"},
                        Case{1 << 20, 1, 10, 10, "capped at the units it moves"},
                        Case{1 << 20, 2, 20, 10, "per stream: half the units each"},
                        Case{0, 1, 40, 4, "0: the queue depth's blocks only"},
                        Case{64 << 10, 1, 40, 4, "never below the queue depth"}}) {
    NvmeMixOptions o = Small({d.path()});
    o.buffer_bytes = c.buffer_bytes;
    o.streams = c.streams;
    o.read_bytes = c.units / 2 * o.block_bytes;
    o.write_bytes = (c.units - c.units / 2) * o.block_bytes;
    auto r = RunNvmeMix(o);
    ASSERT_TRUE(r.ok()) << c.what << ": " << r.status().ToString();
    EXPECT_EQ(r->buffer_bytes, c.want_blocks * o.block_bytes) << c.what;
    EXPECT_EQ(r->read_bytes + r->write_bytes, c.units * o.block_bytes) << c.what;
  }
}

TEST(NvmeMix, SeveralPassesReportEachAndTheFastest) {
  TempDir d("mix-passes");
  NvmeMixOptions o = Small({d.path()});
  o.read_bytes = 8 * o.block_bytes;
  o.write_bytes = 8 * o.block_bytes;
  o.passes = 3;
  auto r = RunNvmeMix(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->pass_seconds.size(), 3u);
  for (double s : r->pass_seconds) EXPECT_GE(s, r->seconds);
  EXPECT_EQ(r->seconds, *std::min_element(r->pass_seconds.begin(), r->pass_seconds.end()));
  EXPECT_EQ(r->read_bytes + r->write_bytes, 16 * o.block_bytes);  // one pass's bytes
  EXPECT_TRUE(std::filesystem::is_empty(d.path()));
}

TEST(NvmeMix, SpansTheFileBytesAskedForWhateverItMoves) {
  TempDir a("mix-span-a"), b("mix-span-b");
  struct Case {
    uint64_t span_bytes;
    uint64_t want_blocks;
    const char* what;
  };
  // The pass moves 12 blocks (4 reads, 8 writes) over two directories.
  for (const Case& c : {Case{0, 12, "0: what a pass moves"},
                        Case{40 << 16, 40, "larger: its units spread over 40 blocks"},
                        Case{(5 << 16) + 100, 5, "smaller: 5 blocks revisited, rounded down"},
                        Case{100, 1, "never below one block"}}) {
    NvmeMixOptions o = Small({a.path(), b.path()});
    o.read_bytes = 4 * o.block_bytes;
    o.write_bytes = 8 * o.block_bytes;
    o.span_bytes = c.span_bytes;
    o.passes = 2;
    auto r = RunNvmeMix(o);
    ASSERT_TRUE(r.ok()) << c.what << ": " << r.status().ToString();
    EXPECT_EQ(r->span_bytes, c.want_blocks * o.block_bytes) << c.what;
    EXPECT_EQ(r->read_bytes, 4 * o.block_bytes) << c.what;
    EXPECT_EQ(r->write_bytes, 8 * o.block_bytes) << c.what;
    EXPECT_EQ(r->pass_seconds.size(), 2u) << c.what;
    EXPECT_TRUE(std::filesystem::is_empty(a.path())) << c.what;
    EXPECT_TRUE(std::filesystem::is_empty(b.path())) << c.what;
  }
}

TEST(NvmeMix, RefusesBadArguments) {
  TempDir d("mix-bad");
  NvmeMixOptions o = Small({d.path()});
  o.read_bytes = 1 << 20;
  auto expect_invalid = [](const NvmeMixOptions& bad, const char* what) {
    auto r = RunNvmeMix(bad);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_TRUE(r.status().IsInvalidArgument()) << what << ": " << r.status().ToString();
  };
  NvmeMixOptions bad = o;
  bad.read_bytes = 0;
  expect_invalid(bad, "nothing to move");
  bad = o;
  bad.block_bytes = 1000;
  expect_invalid(bad, "block not a multiple of 4 KiB");
  bad = o;
  bad.queue_depth = 0;
  expect_invalid(bad, "zero depth");
  bad = o;
  bad.streams = 0;
  expect_invalid(bad, "zero streams");
  bad = o;
  bad.passes = 0;
  expect_invalid(bad, "zero passes");
  bad = o;
  bad.dirs = {d.path(), d.path()};
  expect_invalid(bad, "directory twice");
  bad = o;
  bad.dirs = {d.path() + "/missing"};
  auto r = RunNvmeMix(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().IsNotFound()) << r.status().ToString();
}

}  // namespace
}  // namespace strata::nvme
