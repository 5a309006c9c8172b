// Issue 12, sections 3, 4 and 7 (command line): `offloadctl clean`, the leftover report of the
// commands that write to an nvme_path (bench nvme, bench store, bench comm), a killed bench
// store's leftovers found by the next run, FIFO configs refused without blocking, and bench
// nvme's fdatasync / fallocate failing (LD_PRELOAD shim) or no O_DIRECT (ramfs) leaving nothing.
// Every command runs under `timeout`, so a regression that blocks fails instead of hanging.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "nvme/leftovers.h"
#include "tests/file_test_util.h"
#include "tests/io_test_util.h"

namespace {

namespace fs = std::filesystem;
using strata::testing::DeadPid;
using strata::testing::NobodyUid;
using strata::testing::TempDir;
using strata::testing::WriteFile;

const char* Bin() {
  const char* bin = std::getenv("STRATA_OFFLOADCTL");
  return bin != nullptr ? bin : STRATA_OFFLOADCTL_PATH;
}

struct CliRun {
  int exit_code;
  std::string out, err;
};

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs `env ENV timeout T offloadctl ARGS` with stdout and stderr kept apart.
CliRun Offloadctl(const std::string& args, const std::string& env = "", int timeout_s = 120) {
  TempDir io("cli-io");
  const std::string err = io.File("stderr");
  const std::string cmd = "env " + env + " timeout " + std::to_string(timeout_s) + " " + Bin() +
                          " " + args + " 2>" + err;
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int rc = pclose(p);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out, ReadAll(err)};
}

// A planted nvme_path: leftovers of every kind, live files, foreign files.
struct Planted {
  explicit Planted(const TempDir& d) : dir(d.path()) {
    WriteFile(d.File("strata-bench-111.dat"), 8192);
    WriteFile(d.File("strata-swap-rank2.swp"), 4096);
    creating = d.File("strata-bench-5.dat.creating-" + std::to_string(DeadPid()));
    WriteFile(creating, 0);
    store_run = d.File("strata-bench-store-AAAAAA");
    fs::create_directory(store_run);
    WriteFile(store_run + "/strata-swap-rank0.swp", 4096);
    comm_run = d.File("strata-bench-comm.BBBBBB");
    fs::create_directory(comm_run);
    WriteFile(comm_run + "/strata%2Fgloo%2F1%2Frank0", 16);
    kept_run = d.File("strata-bench-store-CCCCCC");  // holds a file that is not strata's
    fs::create_directory(kept_run);
    WriteFile(kept_run + "/strata-swap-rank1.swp", 4096);
    WriteFile(kept_run + "/mine.txt", 3);
    WriteFile(d.File("notes.txt"), 5);
    victim = outside.File("precious.dat");
    WriteFile(victim, 4096);
    fs::create_symlink(victim, d.File("strata-bench-222.dat"));
    EXPECT_EQ(mkfifo(d.File("strata-bench-333.dat").c_str(), 0600), 0);
    if (const int nobody = NobodyUid(); nobody >= 0) {
      theirs = d.File("strata-bench-444.dat");
      WriteFile(theirs, 4096);
      EXPECT_EQ(chown(theirs.c_str(), nobody, nobody), 0);
    }
    int err = 0;
    live_fd = strata::nvme::CreateLockedFile(d.File("strata-swap-rank0.swp"), 0, &err);
    EXPECT_GE(live_fd, 0) << err;
    auto run = strata::nvme::CreateRunDir(d.path(), strata::nvme::kBenchStoreDirPrefix);
    EXPECT_TRUE(run.ok()) << run.status().ToString();
    live_run = std::move(run).value();
  }
  ~Planted() { close(live_fd); }

  std::string dir, creating, store_run, comm_run, kept_run, victim, theirs;
  TempDir outside{"clean-outside"};
  int live_fd = -1;
  strata::nvme::RunDir live_run;
};

std::vector<std::string> RemovedPaths(const nlohmann::json& j) {
  std::vector<std::string> out;
  for (const auto& p : j["paths"]) {
    for (const auto& e : p["removed"]) out.push_back(e["path"].get<std::string>());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(CleanCli, RemovesOnlyUnlockedStrataFilesAndEmptyRunDirectories) {
  TempDir d("clean");
  Planted p(d);
  std::vector<std::string> expected = {d.File("strata-bench-111.dat"),
                                       d.File("strata-swap-rank2.swp"),
                                       p.creating,
                                       p.store_run + "/strata-swap-rank0.swp",
                                       p.store_run,
                                       p.comm_run + "/strata%2Fgloo%2F1%2Frank0",
                                       p.comm_run,
                                       p.kept_run + "/strata-swap-rank1.swp"};
  std::sort(expected.begin(), expected.end());

  CliRun dry = Offloadctl("clean --dry-run --json --nvme-path " + d.path());
  ASSERT_EQ(dry.exit_code, 0) << dry.out << dry.err;
  auto j = nlohmann::json::parse(dry.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << dry.out;
  EXPECT_EQ(RemovedPaths(j), expected) << dry.out;
  EXPECT_TRUE(j["dry_run"].get<bool>());
  EXPECT_TRUE(fs::exists(d.File("strata-bench-111.dat"))) << "--dry-run removed something";
  EXPECT_TRUE(fs::exists(p.store_run));

  CliRun r = Offloadctl("clean --nvme-path " + d.path());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("removed " + d.File("strata-bench-111.dat") + " (8192 bytes, 8.00 KiB)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("removed 8 leftover(s), freed "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("kept " + d.File("strata-swap-rank0.swp") + ": in use"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("left alone (not strata's) " + d.File("strata-bench-222.dat") +
                       ": a symbolic link"),
            std::string::npos)
      << r.out;
  for (const std::string& gone : expected) EXPECT_FALSE(fs::exists(gone)) << gone;
  // Live, foreign and unknown entries stay; the link's target is untouched.
  for (const std::string& kept :
       {d.File("strata-swap-rank0.swp"), p.live_run.path(), d.File("notes.txt"), p.kept_run,
        p.kept_run + "/mine.txt", d.File("strata-bench-333.dat"), p.victim}) {
    EXPECT_TRUE(fs::exists(kept)) << kept;
  }
  EXPECT_TRUE(fs::is_symlink(d.File("strata-bench-222.dat")));
  EXPECT_EQ(fs::file_size(p.victim), 4096u);
  if (!p.theirs.empty()) {
    EXPECT_TRUE(fs::exists(p.theirs));
    EXPECT_NE(r.out.find(p.theirs + ": a regular file owned by uid"), std::string::npos) << r.out;
  }

  CliRun again = Offloadctl("clean --json --nvme-path " + d.path());
  ASSERT_EQ(again.exit_code, 0) << again.out << again.err;
  EXPECT_EQ(nlohmann::json::parse(again.out)["count"].get<int>(), 0) << again.out;
}

TEST(CleanCli, RepeatablePathsMissingPathAndUsage) {
  TempDir a("clean-a"), b("clean-b");
  WriteFile(a.File("strata-bench-1.dat"), 4096);
  WriteFile(b.File("strata-bench-2.dat"), 4096);
  CliRun r = Offloadctl("clean --json --nvme-path " + a.path() + " --nvme-path " +
                        a.File("missing") + " --nvme-path " + b.path());
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;  // one path could not be cleaned
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["count"].get<int>(), 2);
  EXPECT_NE(j["paths"][1]["error"].get<std::string>().find("missing"), std::string::npos);
  EXPECT_FALSE(fs::exists(a.File("strata-bench-1.dat")));
  EXPECT_FALSE(fs::exists(b.File("strata-bench-2.dat")));
  EXPECT_EQ(Offloadctl("clean").exit_code, 2);
}

// Found by the issue: nothing ever mentioned a killed run's files.
TEST(LeftoverReport, BenchNvmeNamesLeftoversTheirSizesAndTheCleanCommand) {
  TempDir d("report-nvme");
  WriteFile(d.File("strata-bench-999.dat"), 1 << 20);
  fs::create_directory(d.File("strata-bench-store-DDDDDD"));
  WriteFile(d.File("strata-bench-store-DDDDDD/strata-swap-rank0.swp"), 4096);
  CliRun r =
      Offloadctl("bench nvme --json --size 1M --block-size 64K --queue-depth 2 --nvme-path " + d.path());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_FALSE(nlohmann::json::parse(r.out, nullptr, false).is_discarded()) << r.out;
  EXPECT_NE(r.err.find("3 leftover(s) of strata runs that did not end cleanly in " + d.path()),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find(d.File("strata-bench-999.dat") + " (1048576 bytes"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find(d.File("strata-bench-store-DDDDDD") + "/ (empty directory)"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("remove them with: offloadctl clean --nvme-path " + d.path()),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(fs::exists(d.File("strata-bench-999.dat"))) << "a report must not remove";
}

// kill -9 during bench store: its swap file sits in a per-run subdirectory the next run never
// used to look at.
TEST(LeftoverReport, KilledBenchStoreIsReportedByTheNextRunAndCleaned) {
  TempDir d("report-store");
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    execl(Bin(), Bin(), "bench", "store", "--layers", "2", "--group-size", "1M", "--home", "nvme",
          "--compute-ms", "200", "--steps", "100", "--subgroups", "1", "--subgroup-size", "1M",
          "--io-backend", "posix", "--nvme-path", d.path().c_str(), static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  std::string swap;
  for (int i = 0; i < 600 && swap.empty(); ++i) {  // up to 60 s for the swap file to appear
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    for (const auto& e : fs::directory_iterator(d.path())) {
      if (fs::exists(e.path() / "strata-swap-rank0.swp")) swap = e.path() / "strata-swap-rank0.swp";
    }
  }
  kill(pid, SIGKILL);
  int st = 0;
  waitpid(pid, &st, 0);
  ASSERT_FALSE(swap.empty()) << "bench store never made its swap file";
  ASSERT_TRUE(fs::exists(swap));
  CliRun report =
      Offloadctl("bench nvme --size 1M --block-size 64K --queue-depth 2 --nvme-path " + d.path());
  ASSERT_EQ(report.exit_code, 0) << report.out << report.err;
  EXPECT_NE(report.err.find(swap + " ("), std::string::npos) << report.err;
  EXPECT_NE(report.err.find("offloadctl clean --nvme-path " + d.path()), std::string::npos)
      << report.err;
  CliRun r = Offloadctl("clean --nvme-path " + d.path());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::is_empty(d.path())) << r.out;
}

TEST(LeftoverReport, BenchStoreAndBenchCommReportTheirBases) {
  TempDir d("report-bases");
  WriteFile(d.File("strata-bench-77.dat"), 4096);
  CliRun store = Offloadctl(
      "bench store --json --layers 2 --group-size 1M --device-budget 3M --host-budget 16M "
      "--prefetch-size 2M --compute-ms 0.5 --steps 2 --subgroups 2 --subgroup-size 1M "
      "--io-backend posix --nvme-path " +
      d.path());
  ASSERT_EQ(store.exit_code, 0) << store.out << store.err;
  EXPECT_NE(store.err.find(d.File("strata-bench-77.dat")), std::string::npos) << store.err;
  EXPECT_NE(store.err.find("offloadctl clean --nvme-path " + d.path()), std::string::npos);
  // bench comm's rendezvous directory lives in $TMPDIR; a killed run's is reported.
  TempDir tmp("report-tmp");
  fs::create_directory(tmp.File("strata-bench-comm.EEEEEE"));
  WriteFile(tmp.File("strata-bench-comm.EEEEEE/strata%2Fgloo%2F1%2Frank0"), 16);
  // A long key's name (prefix~SHA-256) and a temp file of a killed Set ("<key>.tmp.<pid>.<seq>")
  // are the store's names too, not foreign ones.
  WriteFile(tmp.File("strata-bench-comm.EEEEEE/strata%2Fk~0123abcd"), 16);
  WriteFile(tmp.File("strata-bench-comm.EEEEEE/strata%2Fk.tmp.4242.7"), 16);
  CliRun comm = Offloadctl("bench comm -n 2 --min-bytes 1K --max-bytes 1K --iters 1 --warmup 0",
                           "TMPDIR=" + tmp.path());
  ASSERT_EQ(comm.exit_code, 0) << comm.out << comm.err;
  EXPECT_EQ(comm.err.find("a name strata does not use"), std::string::npos) << comm.err;
  EXPECT_NE(comm.err.find(tmp.File("strata-bench-comm.EEEEEE") + "/ (empty directory)"),
            std::string::npos)
      << comm.err;
  EXPECT_NE(comm.err.find("offloadctl clean --nvme-path " + tmp.path()), std::string::npos);
  // Its own directory is gone after a clean run; the planted one stays until cleaned.
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(tmp.path())) left.push_back(e.path().string());
  EXPECT_EQ(left, std::vector<std::string>{tmp.File("strata-bench-comm.EEEEEE")});
}

// `config check FIFO` and `plan --config FIFO` blocked in open() forever.
TEST(ConfigCli, FifoConfigIsRefusedByNameWithoutWaiting) {
  TempDir d("config-fifo-cli");
  const std::string fifo = d.File("ds.json");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  CliRun check = Offloadctl("config check " + fifo, "", 20);
  EXPECT_EQ(check.exit_code, 1) << check.out << check.err;  // 124 would be the timeout
  EXPECT_NE(check.err.find("'" + fifo + "' is a FIFO, not a regular file"), std::string::npos)
      << check.err;
  CliRun plan = Offloadctl("plan --params 1B --gpus 1 --config " + fifo, "", 20);
  EXPECT_EQ(plan.exit_code, 1) << plan.out << plan.err;
  EXPECT_NE(plan.err.find("is a FIFO"), std::string::npos) << plan.err;
}

// The one place strata syncs (bench nvme's fdatasync after the write pass), and its fallocate,
// failed through an LD_PRELOAD shim: a clear error naming the call and the file, exit 1, and no
// scratch file left behind.
TEST(BenchNvmeFaults, FdatasyncAndFallocateFailuresAreNamedAndLeaveNothing) {
  TempDir d("nvme-sync");
  const std::string preload = std::string("LD_PRELOAD=") + STRATA_FAULT_SHIM_PATH +
                              " ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0";
  const std::string args =
      "bench nvme --size 1M --block-size 64K --queue-depth 2 --nvme-path " + d.path();
  CliRun sync = Offloadctl(args, preload + " STRATA_FAULT_FDATASYNC=5");
  EXPECT_EQ(sync.exit_code, 1) << sync.out << sync.err;
  EXPECT_NE(sync.err.find("fdatasync '" + d.path() + "/strata-bench-"), std::string::npos)
      << sync.err;
  EXPECT_NE(sync.err.find("errno 5"), std::string::npos) << sync.err;
  EXPECT_TRUE(fs::is_empty(d.path()));
  CliRun falloc = Offloadctl(args, preload + " STRATA_FAULT_FALLOCATE=28");
  EXPECT_EQ(falloc.exit_code, 1) << falloc.out << falloc.err;
  EXPECT_NE(falloc.err.find("preallocate 1048576 bytes"), std::string::npos) << falloc.err;
  EXPECT_NE(falloc.err.find("errno 28"), std::string::npos) << falloc.err;
  EXPECT_TRUE(fs::is_empty(d.path()));
}

// On a filesystem without O_DIRECT, bench nvme left a 0-byte `*.creating-<pid>` file per run.
TEST(BenchNvmeFaults, NoODirectLeavesNoCreatingFile) {
  TempDir d("nvme-ramfs");
  const std::string mnt = d.File("mnt");
  fs::create_directories(mnt);
  const pid_t pid = fork();
  if (pid == 0) {
    if (unshare(CLONE_NEWNS) != 0 ||
        mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        mount("none", mnt.c_str(), "ramfs", 0, nullptr) != 0) {
      std::_Exit(3);
    }
    CliRun r = Offloadctl("bench nvme --size 1M --block-size 64K --queue-depth 2 --nvme-path " + mnt);
    const bool named = r.exit_code == 1 && r.err.find("O_DIRECT") != std::string::npos;
    std::fprintf(stderr, "exit %d: %s", r.exit_code, r.err.c_str());
    for (const auto& e : fs::directory_iterator(mnt)) {
      std::fprintf(stderr, "left behind: %s\n", e.path().c_str());
    }
    std::_Exit(named && fs::is_empty(mnt) ? 0 : 1);
  }
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st));
  if (WEXITSTATUS(st) == 3) GTEST_SKIP() << "needs CAP_SYS_ADMIN to mount ramfs in a namespace";
  EXPECT_EQ(WEXITSTATUS(st), 0) << "see the child's stderr above";
}

}  // namespace
