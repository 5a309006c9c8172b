// Test helper: runs a function in N forked processes (the ranks of a loopback job) and collects
// their exit codes, killing every rank still alive at the deadline so that no test can hang.
// A rank reports failure by returning a non-empty message (printed with its rank) or by dying.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace strata::testing {

inline constexpr int kRankKilled = -1000;  // the rank was still running at the deadline

// Returns one exit code per rank: 0 ok, 1 the function returned a message, 128+sig if killed by a
// signal, kRankKilled when the deadline killed it.
inline std::vector<int> RunRanks(int world, const std::function<std::string(int rank)>& fn,
                                 std::chrono::seconds deadline = std::chrono::seconds(90)) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(world, -1);
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::string err = fn(r);
      if (!err.empty()) std::fprintf(stderr, "[rank %d] %s\n", r, err.c_str());
      std::fflush(stderr);
      ::_exit(err.empty() ? 0 : 1);
    }
    pids[r] = pid;
  }
  std::vector<int> codes(world, kRankKilled);
  std::vector<bool> done(world, false);
  const auto end = std::chrono::steady_clock::now() + deadline;
  int left = world;
  while (left > 0 && std::chrono::steady_clock::now() < end) {
    for (int r = 0; r < world; ++r) {
      if (done[r] || pids[r] < 0) continue;
      int st = 0;
      if (::waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        done[r] = true;
        --left;
        codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int r = 0; r < world; ++r) {
    if (!done[r] && pids[r] > 0) {
      ::kill(pids[r], SIGKILL);
      int st = 0;
      ::waitpid(pids[r], &st, 0);
      std::fprintf(stderr, "[rank %d] killed at the test deadline\n", r);
    }
  }
  return codes;
}

// A unique directory under STRATA_TEST_TMPDIR (or /tmp) for one test.
inline std::string UniqueTestDir(const std::string& name) {
  const char* base = std::getenv("STRATA_TEST_TMPDIR");
  std::string root = base ? base : "/tmp";
  std::string cmd = "mkdir -p '" + root + "'";
  if (std::system(cmd.c_str()) != 0) return root;
  std::string tmpl = root + "/" + name + ".XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  return ::mkdtemp(buf.data()) ? std::string(buf.data()) : root;
}

}  // namespace strata::testing
