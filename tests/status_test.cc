#include "strata/status.h"

#include <cerrno>
#include <string>

#include <gtest/gtest.h>

namespace strata {
namespace {

TEST(StatusTest, OkIsCheapAndEmpty) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), Status::Code::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(s.message().empty());
  EXPECT_EQ(sizeof(Status), sizeof(void*));
}

TEST(StatusTest, ErrorsCarryCodeAndMessage) {
  Status s = Status::Corruption("block 7: checksum mismatch");
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.IsCorruption());
  EXPECT_FALSE(s.IsIOError());
  EXPECT_EQ(s.ToString(), "Corruption: block 7: checksum mismatch");
  Status copy = s;
  EXPECT_EQ(copy, s);
  Status moved = std::move(copy);
  EXPECT_EQ(moved.ToString(), s.ToString());
  EXPECT_EQ(Status::ResourceExhausted("x").code(), Status::Code::kResourceExhausted);
  EXPECT_EQ(Status::Unavailable("x").ToString(), "Unavailable: x");
  EXPECT_EQ(Status::DeadlineExceeded("x").ToString(), "DeadlineExceeded: x");
}

TEST(StatusTest, OkCodeWithMessageIsOk) {
  Status s(Status::Code::kOk, "ignored");
  EXPECT_TRUE(s.ok());
}

TEST(StatusTest, WithContextPrefixes) {
  EXPECT_EQ(Status::NotFound("no such file").WithContext("open swap").ToString(),
            "NotFound: open swap: no such file");
  EXPECT_TRUE(Status::OK().WithContext("anything").ok());
}

TEST(StatusTest, FromErrnoNamesFileAndErrno) {
  Status s = Status::FromErrno(ENOSPC, "fallocate", "/nvme/swap.0");
  EXPECT_TRUE(s.IsIOError());
  std::string m(s.message());
  EXPECT_NE(m.find("fallocate"), std::string::npos);
  EXPECT_NE(m.find("/nvme/swap.0"), std::string::npos);
  EXPECT_NE(m.find("errno 28"), std::string::npos);
  EXPECT_NE(m.find("No space left"), std::string::npos);
}

Result<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd");
  return x / 2;
}

Status UseMacros(int x, int* out) {
  STRATA_ASSIGN_OR_RETURN(int h, Half(x));
  STRATA_ASSIGN_OR_RETURN(*out, Half(h));
  STRATA_RETURN_IF_ERROR(Status::OK());
  return Status::OK();
}

TEST(ResultTest, ValueOrStatus) {
  Result<int> r = Half(8);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 4);
  Result<int> e = Half(3);
  EXPECT_FALSE(e.ok());
  EXPECT_TRUE(e.status().IsInvalidArgument());
  Result<int> bad = Status::OK();  // a programmer error becomes Internal, never a fake value
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Status::Code::kInternal);
}

TEST(ResultTest, MacrosPropagate) {
  int out = -1;
  EXPECT_TRUE(UseMacros(8, &out).ok());
  EXPECT_EQ(out, 2);
  Status s = UseMacros(6, &out);  // 6 -> 3 -> odd
  EXPECT_TRUE(s.IsInvalidArgument());
  EXPECT_EQ(out, 2);
}

}  // namespace
}  // namespace strata
