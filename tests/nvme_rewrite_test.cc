// nvme::RunNvmeRewrite, the paired split reference of `bench engine
// --disk-reference-paired-split`: it moves the step's reads and writes over existing files in
// place in read-only and write-only phases timed apart, leaves every byte of them as it was (the
// disk really saw the writes), and refuses bad input by name.
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
  for (const Case& c : cases) {
    NvmeRewriteOptions o;
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
    // Both phases ran and are timed apart, inside the pass's time.
    EXPECT_GT(r->read_seconds, 0.0) << c.what;
    EXPECT_GT(r->write_seconds, 0.0) << c.what;
    EXPECT_LE(r->read_seconds + r->write_seconds, r->seconds) << c.what;
    EXPECT_TRUE(ReadFile(fa) == a) << c.what << ": a.swp changed";
    EXPECT_TRUE(ReadFile(fb) == b) << c.what << ": b.swp changed";
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
