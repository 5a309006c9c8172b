// nvme/write_content.h: what the disk references write is random and never the same 4 KiB
// block twice, so a compressing or deduplicating disk cannot make a reference cheap.
#include "nvme/write_content.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace strata::nvme {
namespace {

constexpr size_t kBlocks = 64;

std::vector<std::string> Blocks(const std::vector<unsigned char>& buf) {
  std::vector<std::string> out;
  for (size_t off = 0; off < buf.size(); off += kStampBytes) {
    out.emplace_back(reinterpret_cast<const char*>(buf.data() + off), kStampBytes);
  }
  return out;
}

TEST(WriteContent, FilledBlocksAreAllDifferentAndNotAPattern) {
  std::vector<unsigned char> buf(kBlocks * kStampBytes + 5, 0);
  FillIncompressible(buf.data(), buf.size(), 1);
  // The 5-byte tail is written too.
  EXPECT_NE(std::string(buf.end() - 5, buf.end()), std::string(5, '\0'));
  buf.resize(kBlocks * kStampBytes);
  const auto blocks = Blocks(buf);
  EXPECT_EQ(std::set<std::string>(blocks.begin(), blocks.end()).size(), kBlocks);
  // Byte values are spread (a repeating ramp or constant would not be).
  std::set<unsigned char> values(buf.begin(), buf.end());
  EXPECT_EQ(values.size(), 256u);
  std::vector<unsigned char> other(buf.size());
  FillIncompressible(other.data(), other.size(), 2);
  EXPECT_NE(buf, other);  // seeds differ
}

TEST(WriteContent, EveryWriteOfTheSameBufferIsNewAtEveryBlock) {
  std::vector<unsigned char> buf(kBlocks * kStampBytes);
  FillIncompressible(buf.data(), buf.size(), 7);
  std::set<std::string> seen;
  for (int write = 0; write < 8; ++write) {
    StampUnique(buf.data(), buf.size());
    for (const std::string& b : Blocks(buf)) EXPECT_TRUE(seen.insert(b).second) << write;
  }
  EXPECT_EQ(seen.size(), 8 * kBlocks);
}

}  // namespace
}  // namespace strata::nvme
