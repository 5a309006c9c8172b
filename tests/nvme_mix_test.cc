// nvme::RunNvmeMix, the io_efficiency reference of `bench engine`: it moves the requested
// read/write mix (rounded up to whole blocks) over every directory, with several streams,
// reports the time, and leaves no file behind; bad arguments are refused by name; each stream's
// IO cycles through buffer_bytes of memory (whole blocks, capped at what it moves, at least the
// depth); the passes touch span_bytes of file. nvme::RunNvmeRewrite, the paired reference of
// `bench engine --disk-reference-paired`: it moves the mix over existing files in place and leaves
// every byte of them as it was (the disk really saw the writes), and refuses bad input by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

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

// Bytes this process caused to be written to storage (/proc/self/io write_bytes; -1 when the
// kernel does not account IO).
int64_t StorageWriteBytes() {
  std::ifstream in("/proc/self/io");
  std::string key;
  int64_t v;
  while (in >> key >> v) {
    if (key == "write_bytes:") return v;
  }
  return -1;
}

std::string RandomFile(const std::string& path, size_t bytes, uint32_t seed) {
  std::string data(bytes, '\0');
  std::mt19937 rng(seed);
  for (char& c : data) c = static_cast<char>(rng());
  std::ofstream(path, std::ios::binary).write(data.data(), static_cast<std::streamsize>(bytes));
  return data;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(NvmeRewrite, MovesTheMixInPlaceAndLeavesEveryByte) {
  TempDir d("rewrite");
  constexpr size_t kBlock = 64 << 10;
  const std::string fa = d.path() + "/a.swp", fb = d.path() + "/b.swp";
  // 20 whole blocks; 13 whole blocks and a 4 KiB tail the pass must not touch: a span of 33.
  const std::string a = RandomFile(fa, 20 * kBlock, 1), b = RandomFile(fb, 13 * kBlock + 4096, 2);
  struct Case {
    const char* what;
    uint64_t reads, writes;  // bytes asked
    uint64_t read_units, write_units;
    IoBackendKind backend;
  };
  const Case cases[] = {
      {"fewer writes than reads", 24 * kBlock + 1, 10 * kBlock, 25, 10, IoBackendKind::kPosix},
      {"more writes than reads (some units twice)", 5 * kBlock, 12 * kBlock, 5, 12,
       IoBackendKind::kAuto},
      {"more reads than the files hold (revisited)", 40 * kBlock, 40 * kBlock, 40, 40,
       IoBackendKind::kAuto},
  };
  for (const Case& c0 : cases) {
   for (bool split : {false, true}) {
    Case c = c0;
    const std::string what = std::string(c0.what) + (split ? " (split)" : "");
    c.what = what.c_str();
    NvmeRewriteOptions o;
    o.split = split;
    o.files = {fa, fb};
    o.block_bytes = kBlock;
    o.queue_depth = 4;
    o.buffer_bytes = 6 * kBlock;
    o.read_bytes = c.reads;
    o.write_bytes = c.writes;
    o.first_unit = 7;
    o.backend = c.backend;
    const int64_t w0 = StorageWriteBytes();
    auto r = RunNvmeRewrite(o);
    ASSERT_TRUE(r.ok()) << c.what << ": " << r.status().ToString();
    EXPECT_EQ(r->read_bytes, c.read_units * kBlock) << c.what;
    EXPECT_EQ(r->write_bytes, c.write_units * kBlock) << c.what;
    EXPECT_EQ(r->span_bytes, 33 * kBlock) << c.what;
    EXPECT_GT(r->seconds, 0.0) << c.what;
    EXPECT_FALSE(r->backend.empty()) << c.what;
    if (w0 >= 0) {  // the writes reached the storage layer: not a pass that only read
      EXPECT_GE(StorageWriteBytes() - w0, static_cast<int64_t>(c.write_units * kBlock)) << c.what;
    }
    if (split) {  // both phases ran and are timed apart, inside the pass's time
      EXPECT_GT(r->read_seconds, 0.0) << c.what;
      EXPECT_GT(r->write_seconds, 0.0) << c.what;
      EXPECT_LE(r->read_seconds + r->write_seconds, r->seconds) << c.what;
    } else {
      EXPECT_EQ(r->read_seconds, 0.0) << c.what;
      EXPECT_EQ(r->write_seconds, 0.0) << c.what;
    }
    EXPECT_TRUE(ReadFile(fa) == a) << c.what << ": a.swp changed";
    EXPECT_TRUE(ReadFile(fb) == b) << c.what << ": b.swp changed";
   }
  }
}

TEST(NvmeRewrite, RefusesBadArgumentsByName) {
  TempDir d("rewrite-bad");
  const std::string f = d.path() + "/s.swp";
  RandomFile(f, 4 << 20, 3);
  NvmeRewriteOptions o;
  o.files = {f};
  o.read_bytes = 1 << 20;
  o.write_bytes = 1 << 20;
  o.backend = IoBackendKind::kPosix;
  auto expect = [](const NvmeRewriteOptions& bad, Status::Code code, const std::string& names,
                   const char* what) {
    auto r = RunNvmeRewrite(bad);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), code) << what << ": " << r.status().ToString();
    EXPECT_NE(r.status().ToString().find(names), std::string::npos)
        << what << ": " << r.status().ToString();
  };
  NvmeRewriteOptions bad = o;
  bad.files = {};
  expect(bad, Status::Code::kInvalidArgument, "no file", "no file");
  bad = o;
  bad.read_bytes = 0;
  expect(bad, Status::Code::kInvalidArgument, "no read", "writes without reads");
  bad = o;
  bad.block_bytes = 1000;
  expect(bad, Status::Code::kInvalidArgument, "1000", "block not a multiple of 4 KiB");
  bad = o;
  bad.queue_depth = 0;
  expect(bad, Status::Code::kInvalidArgument, "queue depth", "zero depth");
  bad = o;
  bad.files = {d.path() + "/missing.swp"};
  expect(bad, Status::Code::kNotFound, "missing.swp", "a missing file");
  bad = o;
  bad.block_bytes = 8 << 20;  // larger than the 4 MiB file
  expect(bad, Status::Code::kInvalidArgument, "no whole block", "no whole block");
  bad = o;
  bad.files = {d.path()};
  expect(bad, Status::Code::kInvalidArgument, "not a regular file", "a directory");
}

}  // namespace
}  // namespace strata::nvme
