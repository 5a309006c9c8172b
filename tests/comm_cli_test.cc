// offloadctl launch and bench comm, run as a user would (the binary in STRATA_OFFLOADCTL), with
// tests/comm_rank_main as the launched program. Every command runs under `timeout`.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <string>
#include "tests/test_util.h"

namespace {

using Out = strata::testing::ProcessResult;

Out Sh(const std::string& cmd, bool merge_stderr = true) {
  return strata::testing::RunShell("timeout 120 " + cmd +
                                   (merge_stderr ? " 2>&1" : " 2>/dev/null"));
}

std::string Ctl() {
  const char* p = std::getenv("STRATA_OFFLOADCTL");
  return p ? p : "offloadctl";
}

TEST(LaunchCli, StartsRanksWithTheirEnvironmentAndPrefixesOutput) {
  const Out o = Sh(Ctl() + " launch -n 4 -- " COMM_RANK_MAIN);
  EXPECT_EQ(o.exit_code, 0) << o.out;
  for (int r = 0; r < 4; ++r) {
    const std::string line =
        "[rank " + std::to_string(r) + "] rank " + std::to_string(r) + " sum 10 ok";
    EXPECT_NE(o.out.find(line), std::string::npos) << o.out;
  }
}

TEST(LaunchCli, RanksPerNodeLaysRanksOutAsNodes) {
  const Out o = Sh(Ctl() + " launch -n 4 --ranks-per-node 2 -- sh -c " +
                   "'echo env=$RANK:$LOCAL_RANK:$LOCAL_WORLD_SIZE:$GROUP_RANK:$WORLD_SIZE'");
  ASSERT_EQ(o.exit_code, 0) << o.out;
  for (const char* want : {"[rank 0] env=0:0:2:0:4", "[rank 1] env=1:1:2:0:4",
                           "[rank 2] env=2:0:2:1:4", "[rank 3] env=3:1:2:1:4"}) {
    EXPECT_NE(o.out.find(want), std::string::npos) << want << "\n" << o.out;
  }
  const Out bad = Sh(Ctl() + " launch -n 3 --ranks-per-node 2 -- true");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;  // flags that disagree: a usage error
  EXPECT_NE(bad.out.find("--ranks-per-node 2 does not divide -n 3"), std::string::npos) << bad.out;
}

// --local-rank-arg: as DeepSpeed's launcher, each rank's command ends with --local_rank=LOCAL_RANK
// (with --ranks-per-node, the rank within its node); without it nothing is appended.
TEST(LaunchCli, LocalRankArgAppendsTheRanksLocalRank) {
  const std::string echo = " -- sh -c 'echo args=$RANK:\"$*\"' sh";
  const Out o = Sh(Ctl() + " launch -n 4 --ranks-per-node 2 --local-rank-arg" + echo + " --x");
  ASSERT_EQ(o.exit_code, 0) << o.out;
  for (const char* want :
       {"[rank 0] args=0:--x --local_rank=0", "[rank 1] args=1:--x --local_rank=1",
        "[rank 2] args=2:--x --local_rank=0", "[rank 3] args=3:--x --local_rank=1"}) {
    EXPECT_NE(o.out.find(want), std::string::npos) << want << "\n" << o.out;
  }
  const Out plain = Sh(Ctl() + " launch -n 2" + echo + " --x");
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  EXPECT_NE(plain.out.find("[rank 1] args=1:--x\n"), std::string::npos) << plain.out;
  EXPECT_EQ(plain.out.find("--local_rank"), std::string::npos) << plain.out;
}

TEST(LaunchCli, EveryRunGetsItsOwnRendezvousSecret) {
  // The ranks of one run share a secret of 32 random bytes (64 hex characters); the next run's
  // differs. A secret in launch's own environment is not handed on.
  const Out a = Sh("env STRATA_RDZV_SECRET=users-own-secret-123 " + Ctl() +
                   " launch -n 2 -- sh -c 'echo secret=$STRATA_RDZV_SECRET'");
  const Out b = Sh(Ctl() + " launch -n 1 -- sh -c 'echo secret=$STRATA_RDZV_SECRET'");
  ASSERT_EQ(a.exit_code, 0) << a.out;
  ASSERT_EQ(b.exit_code, 0) << b.out;
  auto secret_of = [](const std::string& out, int rank) {
    const std::string tag = "[rank " + std::to_string(rank) + "] secret=";
    const size_t at = out.find(tag);
    return at == std::string::npos ? std::string() : out.substr(at + tag.size(), 64);
  };
  const std::string s0 = secret_of(a.out, 0);
  EXPECT_EQ(s0.find_first_not_of("0123456789abcdef"), std::string::npos) << a.out;
  EXPECT_EQ(s0.size(), 64u) << a.out;
  EXPECT_EQ(secret_of(a.out, 1), s0) << a.out;
  EXPECT_NE(secret_of(b.out, 0), s0) << b.out;
  EXPECT_EQ(a.out.find("users-own-secret"), std::string::npos) << a.out;
}

TEST(LaunchCli, FileRendezvousWorksToo) {
  const std::string dir =
      std::string(std::getenv("STRATA_TEST_TMPDIR") ? std::getenv("STRATA_TEST_TMPDIR") : "/tmp") +
      "/launch_rdzv_" + std::to_string(::getpid());
  const Out o = Sh(Ctl() + " launch -n 2 --rdzv-dir " + dir + " -- " COMM_RANK_MAIN);
  EXPECT_EQ(o.exit_code, 0) << o.out;
  EXPECT_NE(o.out.find("[rank 1] rank 1 sum 3 ok"), std::string::npos) << o.out;
}

TEST(LaunchCli, ReusingARendezvousDirectoryWorks) {
  // docs/collectives.md recommends a fixed shared --rdzv-dir: every later run must still work.
  const std::string dir =
      std::string(std::getenv("STRATA_TEST_TMPDIR") ? std::getenv("STRATA_TEST_TMPDIR") : "/tmp") +
      "/launch_rdzv_reuse_" + std::to_string(::getpid());
  // What a crashed earlier run leaves behind: its ranks' addresses under the keys Gloo uses.
  ASSERT_EQ(Sh("mkdir -p " + dir + " && cd " + dir +
               " && for k in 0 1 rank_0 rank_1; do head -c 136 /dev/zero > strata%2fgloo%2f$k; "
               "done")
                .exit_code,
            0);
  for (int run = 0; run < 3; ++run) {
    const Out o = Sh(Ctl() + " launch -n 2 --rdzv-dir " + dir + " -- " COMM_RANK_MAIN);
    EXPECT_EQ(o.exit_code, 0) << "run " << run << ": " << o.out;
    EXPECT_NE(o.out.find("[rank 1] rank 1 sum 3 ok"), std::string::npos) << o.out;
  }
  // Each run removed its own folder: only the planted leftovers remain.
  const Out ls = Sh("ls -A " + dir);
  EXPECT_EQ(
      ls.out,
      "strata%2fgloo%2f0\nstrata%2fgloo%2f1\nstrata%2fgloo%2frank_0\nstrata%2fgloo%2frank_1\n")
      << ls.out;
}

TEST(LaunchCli, OneRankDyingFailsTheJobFastWithClearErrors) {
  const Out o = Sh(Ctl() + " launch -n 3 --grace-s 10 -- " COMM_RANK_MAIN " die 1");
  EXPECT_EQ(o.exit_code, 1) << o.out;
  // Rank 1 dies on its own; the others fail on the broken collective, maybe reaped first.
  EXPECT_NE(o.out.find("launch: rank 1 exited with code 3"), std::string::npos) << o.out;
}

TEST(LaunchCli, EveryRankFailingOnItsOwnIsReported) {
  // Both ranks ignore launch's SIGTERM and fail with their own codes: whichever is reaped first,
  // the other's failure is reported too; ranks stopped by launch's signals are not failures.
  const Out o = Sh(Ctl() +
                   " launch -n 2 --grace-s 10 -- sh -c 'trap \"\" TERM; sleep 0.3; "
                   "exit $((RANK + 3))'");
  EXPECT_EQ(o.exit_code, 1) << o.out;
  EXPECT_NE(o.out.find("launch: rank 0 exited with code 3"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("launch: rank 1 exited with code 4"), std::string::npos) << o.out;
  const Out stopped = Sh(Ctl() +
                         " launch -n 2 --grace-s 10 -- sh -c 'if [ $RANK = 1 ]; then exit 5; fi; "
                         "exec sleep 60'");
  EXPECT_EQ(stopped.exit_code, 1) << stopped.out;
  EXPECT_NE(stopped.out.find("launch: rank 1 exited with code 5; stopping the other ranks"),
            std::string::npos)
      << stopped.out;
  EXPECT_EQ(stopped.out.find("launch: rank 0"), std::string::npos) << stopped.out;
}

TEST(LaunchCli, TimeoutAndSignalStopEveryRank) {
  auto t0 = std::chrono::steady_clock::now();
  Out o = Sh(Ctl() + " launch -n 2 --timeout-s 0.5 --grace-s 1 -- sleep 60");
  EXPECT_EQ(o.exit_code, 1) << o.out;
  EXPECT_NE(o.out.find("launch: timed out"), std::string::npos) << o.out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  t0 = std::chrono::steady_clock::now();
  // Signal only once both ranks run (launch's handlers are installed before it forks them): a
  // fixed sleep raced launch's start-up on a loaded machine (SIGTERM's default action, exit 143).
  const char* tmp = std::getenv("STRATA_TEST_TMPDIR");
  const std::string up =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/launch_up." + std::to_string(::getpid());
  std::filesystem::remove_all(up);
  std::filesystem::create_directories(up);
  // Each rank notes the signal it gets: launch passes on the one it got (a terminal's Ctrl-C
  // reaches every rank of a torchrun job) and exits 128 + it, as a shell reports it.
  {
    std::ofstream rank_sh(up + "/rank.sh");
    rank_sh << "trap 'touch " << up << "/int$RANK; exit 7' INT\n"
            << "trap 'touch " << up << "/term$RANK; exit 7' TERM\n"
            << "touch " << up << "/r$RANK\n"
            << "sleep 60 & wait\n";
  }
  for (const char* sig : {"TERM", "INT"}) {
    SCOPED_TRACE(sig);
    t0 = std::chrono::steady_clock::now();
    for (const char* f : {"/r0", "/r1"}) std::filesystem::remove(up + f);
    o = Sh("sh -c '" + Ctl() + " launch -n 2 --grace-s 5 -- sh " + up + "/rank.sh & pid=$!; i=0; " +
           "while [ ! -e " + up + "/r0 ] || [ ! -e " + up +
           "/r1 ]; do sleep 0.05; i=$((i+1)); [ $i -gt 400 ] && break; done; kill -" + sig +
           " $pid; wait $pid'");
    EXPECT_EQ(o.exit_code, 128 + (std::string(sig) == "INT" ? SIGINT : SIGTERM)) << o.out;
    EXPECT_NE(o.out.find("launch: interrupted"), std::string::npos) << o.out;
    const std::string got = std::string(sig) == "INT" ? "/int" : "/term";
    EXPECT_TRUE(std::filesystem::exists(up + got + "0") && std::filesystem::exists(up + got + "1"))
        << o.out;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  }
}

TEST(LaunchCli, ReturnsWhenRanksExitEvenIfTheirChildrenHoldThePipes) {
  // Rank 1 fails, leaving a background child that keeps its output pipe open for 30 s; launch
  // must stop the others, signal that child's process group too, and return promptly.
  const auto t0 = std::chrono::steady_clock::now();
  const Out o = Sh(Ctl() +
                   " launch -n 2 --grace-s 1 --timeout-s 20 -- sh -c 'if [ $RANK = 1 ]; then "
                   "(sleep 30 &); exit 3; fi; sleep 60'");
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(o.exit_code, 1) << o.out;
  EXPECT_NE(o.out.find("launch: rank 1 exited with code 3"), std::string::npos) << o.out;
  EXPECT_LT(took, std::chrono::seconds(15)) << o.out;  // not the child's 30 s
  // All ranks succeed, but one leaves a child holding stdout: launch still returns.
  const auto t1 = std::chrono::steady_clock::now();
  const Out ok = Sh(Ctl() + " launch -n 2 -- sh -c 'echo hi; (sleep 30 &); exit 0'");
  EXPECT_EQ(ok.exit_code, 0) << ok.out;
  EXPECT_NE(ok.out.find("[rank 1] hi"), std::string::npos) << ok.out;
  EXPECT_LT(std::chrono::steady_clock::now() - t1, std::chrono::seconds(15)) << ok.out;
}

TEST(LaunchCli, NoFreePortIsAClearErrorNotPortZero) {
  // 192.0.2.1 (TEST-NET-1) is no address of this host: no port can be bound there, and the ranks
  // must not be started with MASTER_PORT=0.
  const Out o =
      Sh(Ctl() + " launch -n 1 --master-addr 192.0.2.1 -- sh -c 'echo port=$MASTER_PORT'");
  EXPECT_EQ(o.exit_code, 1) << o.out;
  EXPECT_NE(o.out.find("cannot find a free port on --master-addr 192.0.2.1"), std::string::npos)
      << o.out;
  EXPECT_EQ(o.out.find("port=0"), std::string::npos) << o.out;
}

TEST(LaunchCli, UsageAndExecErrors) {
  EXPECT_EQ(Sh(Ctl() + " launch -n 2").exit_code, 2);
  const Out bad = Sh(Ctl() + " launch -n 2 -- /nonexistent/program");
  EXPECT_EQ(bad.exit_code, 1) << bad.out;
  EXPECT_NE(bad.out.find("cannot execute '/nonexistent/program'"), std::string::npos) << bad.out;
}

TEST(RankProgram, BadRendezvousSettingsGiveAClearError) {
  Out o = Sh("env -u RANK WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 " COMM_RANK_MAIN);
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.out.find("RANK is not set"), std::string::npos) << o.out;
  o =
      Sh("env RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 "
         "STRATA_RDZV_SECRET=0123456789abcdef STRATA_RDZV_TIMEOUT_MS=300 " COMM_RANK_MAIN);
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.out.find("no server answered at 127.0.0.1:1"), std::string::npos) << o.out;
  // TCP without a secret is refused before anything listens or connects.
  o =
      Sh("env -u STRATA_RDZV_SECRET RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "
         "MASTER_PORT=1 " COMM_RANK_MAIN);
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.out.find("STRATA_RDZV_SECRET is not set"), std::string::npos) << o.out;
  o =
      Sh("env RANK=0 WORLD_SIZE=2 MASTER_ADDR=not-a-host.invalid MASTER_PORT=29555 "
         "STRATA_RDZV_SECRET=0123456789abcdef " COMM_RANK_MAIN);
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.out.find("not-a-host.invalid"), std::string::npos) << o.out;
}

TEST(BenchCommCli, JsonHasNcclTestsFigures) {
  const Out o = Sh(Ctl() + " bench comm -n 2 --min-bytes 4K --max-bytes 16K --iters 2 --json",
                   /*merge_stderr=*/false);
  ASSERT_EQ(o.exit_code, 0) << o.out;
  const auto j = nlohmann::json::parse(o.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << o.out;
  EXPECT_EQ(j["backend"], "gloo");
  EXPECT_EQ(j["world_size"], 2);
  ASSERT_EQ(j["results"].size(), 12u);  // 3 sizes x 4 ops
  for (const auto& r : j["results"]) {
    const double factor = r["op"] == "all_reduce" ? 1.0 : 0.5;  // 2(N-1)/N, (N-1)/N at N=2
    EXPECT_TRUE(r["op"] == "all_gather" || r["op"] == "reduce_scatter" || r["op"] == "all_reduce" ||
                r["op"] == "all_to_all")
        << r.dump();
    EXPECT_GT(r["time_us"].get<double>(), 0);
    EXPECT_NEAR(r["busbw_gbps"].get<double>(), factor * r["algbw_gbps"].get<double>(), 1e-9);
    EXPECT_NEAR(r["algbw_gbps"].get<double>(),
                r["size_bytes"].get<double>() / (r["time_us"].get<double>() * 1e-6) / 1e9, 1e-6);
  }
}

TEST(BenchCommCli, ReportsTheBytesActuallyMoved) {
  // 1000 B of fp32 over 3 ranks: all-gather / reduce-scatter / all-to-all move 3 x 83 elements =
  // 996 B; the
  // all-reduce moves all 250 elements = 1000 B. Bandwidths follow the moved size.
  const Out o = Sh(Ctl() +
                       " bench comm -n 3 --dtype fp32 --min-bytes 1000 --max-bytes 1000 "
                       "--iters 1 --json",
                   /*merge_stderr=*/false);
  ASSERT_EQ(o.exit_code, 0) << o.out;
  const auto j = nlohmann::json::parse(o.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << o.out;
  ASSERT_EQ(j["results"].size(), 4u) << o.out;
  for (const auto& r : j["results"]) {
    const uint64_t want = r["op"] == "all_reduce" ? 1000 : 996;
    EXPECT_EQ(r["size_bytes"].get<uint64_t>(), want) << r.dump();
    EXPECT_NEAR(r["algbw_gbps"].get<double>(),
                static_cast<double>(want) / (r["time_us"].get<double>() * 1e-6) / 1e9, 1e-6);
  }
}

// A rank that dies by a signal cannot say so itself: bench comm names it and the signal (it
// exited 1 without a word). Rank processes are bench comm's children; one is killed with SIGUSR1
// as soon as it exists, well before its 1000 iterations of 16 MiB end.
TEST(BenchCommCli, ARankKilledByASignalIsNamed) {
  const auto t0 = std::chrono::steady_clock::now();
  const Out o =
      Sh("sh -c '" + Ctl() +
         " bench comm -n 2 --dtype fp32 --min-bytes 16M --max-bytes 16M --iters 1000 "
         "--timeout-s 100 & pid=$!; i=0; rank=; while [ -z \"$rank\" ] && [ $i -lt 400 ]; "
         "do sleep 0.05; i=$((i+1)); rank=$(pgrep -P $pid | head -n 1); done; "
         "kill -USR1 $rank; wait $pid'");
  EXPECT_EQ(o.exit_code, 1) << o.out;
  EXPECT_NE(o.out.find("was killed by signal " + std::to_string(SIGUSR1)), std::string::npos)
      << o.out;
  EXPECT_NE(o.out.find("bench comm: rank "), std::string::npos) << o.out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
}

TEST(BenchCommCli, BadOptionsAreUsageErrors) {
  EXPECT_EQ(Sh(Ctl() + " bench comm --dtype int8").exit_code, 2);
  EXPECT_EQ(Sh(Ctl() + " bench comm --min-bytes 1M --max-bytes 1K").exit_code, 2);
  EXPECT_EQ(Sh(Ctl() + " bench comm --backend mpi").exit_code, 2);
  // Sizes read as every offloadctl SIZE: no negative wrapping round to 2^64 - 1, no zero.
  const Out neg = Sh(Ctl() + " bench comm --min-bytes -1 --max-bytes 1K");
  EXPECT_EQ(neg.exit_code, 2);
  EXPECT_NE(neg.out.find("is not a size"), std::string::npos) << neg.out;
  EXPECT_EQ(Sh(Ctl() + " bench comm --min-bytes 0").exit_code, 2);
}

}  // namespace
