// The rendezvous stores against hostile peers and planted files (issue 12, section 2): symlinks
// and foreign directories.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cpu/rendezvous/rendezvous.h"
#include "tests/multiprocess.h"

namespace strata {
namespace {

using std::chrono::milliseconds;

std::string Str(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(FileKvStoreSecurity, ASymlinkPlantedAtTheTempNameIsNotFollowed) {
  const std::string root = testing::UniqueTestDir("filekv_symlink");
  const std::string dir = root + "/store";
  const std::string victim = root + "/victim";
  { std::ofstream(victim) << "precious"; }
  auto store = cpu::FileKvStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  // The temp names a rank of this process would use: "<key>.tmp.<pid>" and
  // "<key>.tmp.<pid>.<n>"; each points at the victim.
  const std::string base = dir + "/strata%2fgloo%2f0.tmp." + std::to_string(::getpid());
  std::vector<std::string> planted = {base};
  for (int n = 0; n < 8; ++n) planted.push_back(base + "." + std::to_string(n));
  for (const auto& p : planted) ASSERT_EQ(::symlink(victim.c_str(), p.c_str()), 0) << p;
  const std::vector<uint8_t> addr = {'1', '0', '.', '0', '.', '0', '.', '1'};
  ASSERT_TRUE((*store)->Set("strata/gloo/0", addr).ok());
  EXPECT_EQ(ReadAll(victim), "precious") << "the rank wrote through a planted symlink";
  auto got = (*store)->Get("strata/gloo/0", milliseconds(100));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, addr);
  struct stat st {};
  ASSERT_EQ(::lstat((dir + "/strata%2fgloo%2f0").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  for (const auto& p : planted) {
    ASSERT_EQ(::lstat(p.c_str(), &st), 0) << p;
    EXPECT_TRUE(S_ISLNK(st.st_mode)) << p << " was replaced";
  }
}

TEST(FileKvStoreSecurity, AKeyIsNeverReadThroughASymlink) {
  const std::string root = testing::UniqueTestDir("filekv_keylink");
  const std::string victim = root + "/secret-file";
  { std::ofstream(victim) << "not a rendezvous value"; }
  auto store = cpu::FileKvStore::Open(root + "/store");
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_EQ(::symlink(victim.c_str(), (root + "/store/k").c_str()), 0);
  auto got = (*store)->Get("k", milliseconds(100));
  ASSERT_FALSE(got.ok()) << "read through a symlink: " << Str(*got);
  EXPECT_TRUE(got.status().IsCorruption()) << got.status().ToString();
}

TEST(FileKvStoreSecurity, TheDirectoryMustBeThisUsersAlone) {
  const std::string root = testing::UniqueTestDir("filekv_perms");
  // Created 0700.
  ASSERT_TRUE(cpu::FileKvStore::Open(root + "/fresh").ok());
  struct stat st {};
  ASSERT_EQ(::stat((root + "/fresh").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  // An existing directory that others may write is refused; 0755 of this user is fine.
  const std::string shared = root + "/shared";
  ASSERT_EQ(::mkdir(shared.c_str(), 0700), 0);
  for (mode_t mode : {0777, 0775, 0757, 01777}) {
    ASSERT_EQ(::chmod(shared.c_str(), mode), 0);
    auto s = cpu::FileKvStore::Open(shared);
    ASSERT_FALSE(s.ok()) << "accepted mode " << std::oct << mode;
    EXPECT_TRUE(s.status().IsInvalidArgument()) << s.status().ToString();
    EXPECT_NE(s.status().ToString().find("writable"), std::string::npos) << s.status().ToString();
  }
  ASSERT_EQ(::chmod(shared.c_str(), 0755), 0);
  EXPECT_TRUE(cpu::FileKvStore::Open(shared).ok());
  // A directory of another user is refused, whatever its mode.
  std::string foreign = "/usr";
  if (::geteuid() == 0) {
    foreign = root + "/foreign";
    ASSERT_EQ(::mkdir(foreign.c_str(), 0700), 0);
    ASSERT_EQ(::chown(foreign.c_str(), 65534, 65534), 0);
  }
  ASSERT_EQ(::stat(foreign.c_str(), &st), 0);
  ASSERT_NE(st.st_uid, ::geteuid());
  auto s = cpu::FileKvStore::Open(foreign);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().ToString().find("owned by uid"), std::string::npos) << s.status().ToString();
}

}  // namespace
}  // namespace strata
