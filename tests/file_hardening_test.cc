// Issue 12, sections 3 and 7 (library side): things that are not regular files under strata's
// names in an nvme_path (FIFOs, symbolic links, devices, directories, other users' files) and
// as a DeepSpeed config; the `*.creating-<pid>` file of a failed O_DIRECT open. Every case that
// could block runs in a forked child under an alarm, so a regression fails instead of hanging.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "nvme/leftovers.h"
#include "nvme/sim_backend.h"
#include "nvme/swap_space.h"
#include "strata/config.h"
#include "tests/file_test_util.h"
#include "tests/io_test_util.h"

namespace strata::nvme {
namespace {

using testing::DeadPid;
using testing::NobodyUid;
using testing::TempDir;
using testing::WriteFile;

constexpr int kAlarmS = 20;

// Runs `body` in a forked child under an alarm: "" is success, anything else is what failed.
// A body that blocks (the bug this file guards against) dies of SIGALRM and fails the test.
void ExpectBounded(const std::function<std::string()>& body) {
  EXPECT_EXIT(
      {
        alarm(kAlarmS);
        const std::string err = body();
        if (!err.empty()) {
          std::fprintf(stderr, "FAILED: %s\n", err.c_str());
          std::_Exit(1);
        }
        std::fprintf(stderr, "bounded ok\n");
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "bounded ok");
}

template <typename T>
bool Has(const std::vector<T>& v, const std::string& path) {
  return std::any_of(v.begin(), v.end(), [&](const T& e) {
    if constexpr (std::is_same_v<T, std::string>) {
      return e == path;
    } else {
      return e.path == path;
    }
  });
}

std::string WhyForeign(const StrataFileScan& s, const std::string& path) {
  for (const ForeignEntry& f : s.foreign) {
    if (f.path == path) return f.why;
  }
  return "";
}

const std::vector<SwapBlockSpec> kBlocks = {{1, 8192}, {2, 4096}};

TEST(StrataNames, TemporaryAndPerRunNamesAreKnown) {
  const std::pair<const char*, bool> files[] = {{"strata-swap-rank3.swp", true},
                                                {"strata-bench-123.dat", true},
                                                {"strata-bench-123.dat.creating-456", true},
                                                {"strata-swap-rank0.swp.creating-1", true},
                                                {"strata-bench-123.dat.creating-", false},
                                                {"notes.txt.creating-12", false},
                                                {"strata-bench-x.dat", false}};
  for (const auto& [name, is] : files) EXPECT_EQ(IsStrataFileName(name), is) << name;
  const std::pair<const char*, bool> dirs[] = {{"strata-bench-store-AbC123", true},
                                               {"strata-bench-comm.x9Y8z7", true},
                                               {"strata-bench-engine-Q1w2E3", true},
                                               {"strata-bench-engine-Q1w2E", false},
                                               {"strata-bench-store-AbC12", false},
                                               {"strata-bench-store-AbC1234", false},
                                               {"strata-bench-comm.ab/cde", false}};
  for (const auto& [name, is] : dirs) EXPECT_EQ(IsRunDirName(name), is) << name;
  const std::pair<const char*, bool> engine_dirs[] = {{"strata-reference", true},
                                                      {"strata-reward-0", true},
                                                      {"strata-bench-store-AbC123", false},
                                                      {"strata-", false},
                                                      {"strata-Reference", false},
                                                      {"strata-swap-rank0.swp", false},
                                                      {"stratareference", false}};
  for (const auto& [name, is] : engine_dirs) EXPECT_EQ(IsEngineDirName(name), is) << name;
}

// The Python integrations give a frozen model's engine a directory of its own in the nvme_path
// (strata-reference, ...): a killed run leaves its swap file there, which the nvme_path's scan
// (offloadctl clean) must find, and it must leave alone what is live or not strata's there.
TEST(EngineDirectories, ScanLooksIntoThemAndKeepsThem) {
  TempDir dir("engine-dirs"), elsewhere("engine-dirs-target");
  const std::string engine = dir.File("strata-reference");
  ASSERT_EQ(mkdir(engine.c_str(), 0700), 0);
  const std::string leftover = SwapFilePath(engine, 0);
  WriteFile(leftover, 4096);
  int err = 0;
  const int live_fd = CreateLockedFile(SwapFilePath(engine, 1), 0, &err);
  ASSERT_GE(live_fd, 0) << std::strerror(err);
  WriteFile(engine + "/notes.txt", 16);
  // A link under an engine directory's name is not followed into its target.
  const std::string target = SwapFilePath(elsewhere.path(), 0);
  WriteFile(target, 4096);
  ASSERT_EQ(symlink(elsewhere.path().c_str(), dir.File("strata-teacher").c_str()), 0);

  auto listed = ScanStrataFiles(dir.path());  // a swap space's own scan: the nvme_path only
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_TRUE(listed->leftovers.empty());
  auto scan = ScanNvmePath(dir.path(), /*remove_leftovers=*/true);
  ASSERT_TRUE(scan.ok()) << scan.status().ToString();
  ASSERT_EQ(scan->leftovers.size(), 1u);
  EXPECT_EQ(scan->leftovers[0].path, leftover);
  EXPECT_EQ(scan->live, std::vector<std::string>{SwapFilePath(engine, 1)});
  EXPECT_TRUE(scan->failed.empty());
  EXPECT_FALSE(std::filesystem::exists(leftover));
  for (const std::string& kept : {engine, SwapFilePath(engine, 1), engine + "/notes.txt", target}) {
    EXPECT_TRUE(std::filesystem::exists(kept)) << kept;
  }
  close(live_fd);
}

// Found by the issue: the leftover scan opened a FIFO named like a swap file O_RDONLY without
// O_NONBLOCK, so SwapSpace::Create blocked forever.
TEST(ForeignFiles, FifoNamedLikeAnotherRanksSwapFileNeitherBlocksNorStopsCreate) {
  TempDir dir("fifo-other");
  ASSERT_EQ(mkfifo(SwapFilePath(dir.path(), 1).c_str(), 0600), 0);
  ASSERT_EQ(mkfifo(dir.File("strata-bench-7.dat").c_str(), 0600), 0);
  ExpectBounded([&]() -> std::string {
    SimBackend sim(SimOptions{});
    SwapSpaceOptions o;
    o.paths = {dir.path()};
    auto s = SwapSpace::Create(o, kBlocks, &sim);
    if (!s.ok()) return "Create: " + s.status().ToString();
    auto scan = ScanStrataFiles(dir.path());
    if (!scan.ok()) return scan.status().ToString();
    if (WhyForeign(*scan, SwapFilePath(dir.path(), 1)) != "a FIFO") return "FIFO not named";
    if (!scan->leftovers.empty()) return "a FIFO taken for a leftover";
    return "";
  });
}

TEST(ForeignFiles, FifoUnderThisRanksNameIsRefusedByName) {
  TempDir dir("fifo-own");
  const std::string own = SwapFilePath(dir.path(), 0);
  ASSERT_EQ(mkfifo(own.c_str(), 0600), 0);
  ExpectBounded([&]() -> std::string {
    SimBackend sim(SimOptions{});
    SwapSpaceOptions o;
    o.paths = {dir.path()};
    Status s = SwapSpace::Create(o, kBlocks, &sim).status();
    if (!(s.code() == Status::Code::kFailedPrecondition) ||
        s.ToString().find("'" + own + "' is a FIFO") == std::string::npos) {
      return "expected FailedPrecondition naming the FIFO, got " + s.ToString();
    }
    return "";
  });
  struct stat st {};
  ASSERT_EQ(lstat(own.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode)) << "a foreign file must never be removed";
}

// Found here: a symbolic link under a strata name was followed, so its target (anywhere) was
// reported as a leftover to delete, and one under this rank's name gave a misleading "appeared
// while starting".
TEST(ForeignFiles, SymbolicLinksAreNeverFollowed) {
  TempDir dir("symlink"), elsewhere("symlink-target");
  const std::string victim = elsewhere.File("precious.dat");
  WriteFile(victim, 4096);
  const std::string link = dir.File("strata-bench-99.dat");
  ASSERT_EQ(symlink(victim.c_str(), link.c_str()), 0);
  auto scan = ScanStrataFiles(dir.path());
  ASSERT_TRUE(scan.ok()) << scan.status().ToString();
  EXPECT_FALSE(Has(scan->leftovers, link)) << "the link's target was taken for a leftover";
  EXPECT_EQ(WhyForeign(*scan, link), "a symbolic link");

  const std::string own = SwapFilePath(dir.path(), 0);
  ASSERT_EQ(symlink(victim.c_str(), own.c_str()), 0);
  SimBackend sim(SimOptions{});
  SwapSpaceOptions o;
  o.paths = {dir.path()};
  Status s = SwapSpace::Create(o, kBlocks, &sim).status();
  EXPECT_TRUE((s.code() == Status::Code::kFailedPrecondition)) << s.ToString();
  EXPECT_NE(s.ToString().find("'" + own + "' is a symbolic link"), std::string::npos)
      << s.ToString();
  EXPECT_EQ(std::filesystem::file_size(victim), 4096u);
  EXPECT_TRUE(std::filesystem::is_symlink(own));
}

TEST(ForeignFiles, DirectoryAndDeviceUnderStrataNamesAreForeign) {
  TempDir dir("dev");
  const std::string own = SwapFilePath(dir.path(), 0);
  ASSERT_EQ(mkdir(own.c_str(), 0700), 0);
  const std::string dev = dir.File("strata-bench-3.dat");
  const bool have_dev = mknod(dev.c_str(), S_IFCHR | 0600, makedev(1, 3)) == 0;  // /dev/null
  ExpectBounded([&]() -> std::string {
    auto scan = ScanNvmePath(dir.path(), /*remove_leftovers=*/true);
    if (!scan.ok()) return scan.status().ToString();
    if (WhyForeign(*scan, own) != "a directory") return "directory not named";
    if (have_dev && WhyForeign(*scan, dev) != "a character device") return "device not named";
    SimBackend sim(SimOptions{});
    SwapSpaceOptions o;
    o.paths = {dir.path()};
    Status s = SwapSpace::Create(o, kBlocks, &sim).status();
    if (s.ToString().find("is a directory") == std::string::npos) return s.ToString();
    return "";
  });
  EXPECT_TRUE(std::filesystem::is_directory(own));
  if (have_dev) {
    EXPECT_TRUE(std::filesystem::is_character_file(dev));
  }
}

// As root a scan could open another user's file, so it was reported (and would have been
// removed) as this user's leftover.
TEST(ForeignFiles, AnotherUsersFilesAreNeitherLeftoversNorRemoved) {
  const int nobody = NobodyUid();
  if (nobody < 0) GTEST_SKIP() << "needs root to give a file to another user";
  TempDir dir("other-user");
  const std::string theirs = SwapFilePath(dir.path(), 1);
  const std::string own = SwapFilePath(dir.path(), 0);
  WriteFile(theirs, 8192);
  ASSERT_EQ(chown(theirs.c_str(), nobody, nobody), 0);
  auto scan = ScanNvmePath(dir.path(), /*remove_leftovers=*/true);
  ASSERT_TRUE(scan.ok()) << scan.status().ToString();
  EXPECT_TRUE(scan->leftovers.empty());
  EXPECT_NE(WhyForeign(*scan, theirs).find("owned by uid " + std::to_string(nobody)),
            std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(theirs));
  SimBackend sim(SimOptions{});
  SwapSpaceOptions o;
  o.paths = {dir.path()};
  {  // another rank's name: not in the way
    auto s = SwapSpace::Create(o, kBlocks, &sim);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
  }
  ASSERT_EQ(rename(theirs.c_str(), own.c_str()), 0);  // now under this rank's name
  Status s = SwapSpace::Create(o, kBlocks, &sim).status();
  EXPECT_TRUE((s.code() == Status::Code::kFailedPrecondition)) << s.ToString();
  EXPECT_NE(s.ToString().find("owned by uid " + std::to_string(nobody)), std::string::npos)
      << s.ToString();
  EXPECT_TRUE(std::filesystem::exists(own));
}

// The temporary name of a creation that died half-way is a leftover too, once its pid is gone
// (a starting swap space reclaims it); a live pid's is being made right now (kept).
TEST(CreatingFiles, KnownToTheScanByPid) {
  TempDir dir("creating");
  const std::string dead = dir.File("strata-bench-5.dat.creating-" + std::to_string(DeadPid()));
  const std::string alive = dir.File("strata-bench-6.dat.creating-" + std::to_string(getpid()));
  WriteFile(dead);
  WriteFile(alive);
  auto scan = ScanStrataFiles(dir.path());
  ASSERT_TRUE(scan.ok()) << scan.status().ToString();
  EXPECT_TRUE(Has(scan->leftovers, dead));
  EXPECT_TRUE(Has(scan->live, alive));
  EXPECT_FALSE(Has(scan->leftovers, alive));
  SimBackend sim(SimOptions{});
  SwapSpaceOptions o;
  o.paths = {dir.path()};
  auto s = SwapSpace::Create(o, kBlocks, &sim);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_NE((*s)->note().find("'" + dead + "'"), std::string::npos) << (*s)->note();
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_TRUE(std::filesystem::exists(alive));
}

// ramfs has no O_DIRECT: the kernel creates the file, then open fails with EINVAL. Mounted in a
// private mount namespace of a forked child.
bool MountRamfs(const std::string& mnt) {
  return unshare(CLONE_NEWNS) == 0 &&
         mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0 &&
         mount("none", mnt.c_str(), "ramfs", 0, nullptr) == 0;
}

bool CanMountRamfs(const std::string& mnt) {
  const pid_t pid = fork();
  if (pid == 0) std::_Exit(MountRamfs(mnt) ? 0 : 3);
  int st = 0;
  return pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

// Ranks that share an nvme_path scan it while others create their swap files there: a scan's
// probe of a file being created (it takes the lock for a moment) never fails that create.
TEST(CreatingFiles, ScansRacingCreatesNeverFailThem) {
  TempDir d("race");
  std::atomic<bool> stop{false};
  std::atomic<int> scans{0};
  std::thread scanner([&] {
    while (!stop) {
      auto scan = ScanNvmePath(d.path(), /*remove_leftovers=*/false);
      if (scan.ok()) ++scans;
    }
  });
  int failures = 0;
  std::string first;
  for (int i = 0; i < 3000 && failures == 0; ++i) {
    const std::string path = SwapFilePath(d.path(), i % 4);
    int err = 0;
    const int fd = CreateLockedFile(path, 0, &err);
    if (fd < 0) {
      ++failures;
      first = path + ": " + std::strerror(err);
      continue;
    }
    unlink(path.c_str());
    close(fd);
  }
  stop = true;
  scanner.join();
  EXPECT_EQ(failures, 0) << first;
  EXPECT_GT(scans.load(), 0);
}

TEST(CreatingFiles, FailedODirectCreateLeavesNothing) {
  TempDir dir("creating-ramfs");
  const std::string mnt = dir.File("mnt");
  std::filesystem::create_directories(mnt);
  if (!CanMountRamfs(mnt)) GTEST_SKIP() << "needs CAP_SYS_ADMIN to mount ramfs in a namespace";
  ExpectBounded([&]() -> std::string {
    if (!MountRamfs(mnt)) return "mount";
    int err = 0;
    const int fd = CreateLockedFile(mnt + "/strata-bench-1.dat", O_DIRECT, &err);
    if (fd >= 0 || err != EINVAL) return "expected EINVAL, got fd " + std::to_string(fd);
    std::string left;
    for (const auto& e : std::filesystem::directory_iterator(mnt)) left += " " + e.path().string();
    return left.empty() ? "" : "left behind:" + left;
  });
}

TEST(RunDirs, LockedWhileHeldLeftoverOnceReleased) {
  TempDir dir("rundir");
  std::string path;
  {
    auto d = CreateRunDir(dir.path(), kBenchStoreDirPrefix);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    path = d->path();
    EXPECT_TRUE(IsRunDirName(std::filesystem::path(path).filename().string())) << path;
    auto scan = ScanNvmePath(dir.path(), /*remove_leftovers=*/true);
    ASSERT_TRUE(scan.ok());
    EXPECT_TRUE(Has(scan->live, path));
    EXPECT_TRUE(std::filesystem::is_directory(path));
  }
  auto scan = ScanNvmePath(dir.path(), /*remove_leftovers=*/true);
  ASSERT_TRUE(scan.ok());
  ASSERT_EQ(scan->leftovers.size(), 1u);
  EXPECT_TRUE(scan->leftovers[0].directory);
  EXPECT_FALSE(std::filesystem::exists(path));
}

// `bench engine` keeps each rank's swap file in a run directory of its own: a killed run leaves
// both, and a later scan reports (and may remove) the file and then the directory.
TEST(RunDirs, BenchEngineDirAndItsSwapFileAreLeftoversOnceReleased) {
  TempDir dir("rundir-engine");
  std::string path;
  {
    auto d = CreateRunDir(dir.path(), kBenchEngineDirPrefix);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    path = d->path();
    EXPECT_TRUE(IsRunDirName(std::filesystem::path(path).filename().string())) << path;
    int err = 0;
    const int fd = CreateLockedFile(SwapFilePath(path, 0), 0, &err);
    ASSERT_GE(fd, 0) << std::strerror(err);
    ::close(fd);  // the killed rank's lock goes with it
  }
  auto scan = ScanNvmePath(dir.path(), /*remove_leftovers=*/true);
  ASSERT_TRUE(scan.ok());
  ASSERT_EQ(scan->leftovers.size(), 2u);
  EXPECT_FALSE(scan->leftovers[0].directory);
  EXPECT_TRUE(scan->leftovers[1].directory);
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace
}  // namespace strata::nvme

namespace strata {
namespace {

// `config check FIFO` and `plan --config FIFO` blocked in open(): the config reader now opens
// without waiting and refuses what is not a regular file, naming it.
TEST(ConfigFiles, FifoAndDevicesAreRefusedByNameWithoutBlocking) {
  testing::TempDir dir("config-fifo");
  const std::string fifo = dir.File("ds.json");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  nvme::ExpectBounded([&]() -> std::string {
    auto c = CheckDeepSpeedConfigFile(fifo, {});
    if (c.ok() || c.status().ToString().find("'" + fifo + "' is a FIFO, not a regular file") ==
                      std::string::npos) {
      return "check: " + c.status().ToString();
    }
    auto l = LoadDeepSpeedConfig(fifo, {});
    if (l.ok() || l.status().ToString().find("is a FIFO") == std::string::npos) {
      return "load: " + l.status().ToString();
    }
    auto d = CheckDeepSpeedConfigFile("/dev/null", {});
    if (d.ok() || d.status().ToString().find("is a character device") == std::string::npos) {
      return "/dev/null: " + d.status().ToString();
    }
    return "";
  });
  // A symbolic link to a regular config is followed: the user named it.
  const std::string real = dir.File("real.json"), link = dir.File("link.json");
  { std::ofstream(real) << R"({"train_batch_size": 8})"; }
  ASSERT_EQ(symlink(real.c_str(), link.c_str()), 0);
  auto ok = CheckDeepSpeedConfigFile(link, {});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
}

}  // namespace
}  // namespace strata
