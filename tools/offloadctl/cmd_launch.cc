// `offloadctl launch -n N -- CMD ARGS...`: starts N local ranks of CMD with the environment that
// torchrun and the deepspeed launcher set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT, STRATA_RUN_ID, STRATA_RDZV_SECRET: random bytes fresh for each run
// that rank 0's TCP store demands, and STRATA_RDZV_DIR with --rdzv-dir: a fresh folder
// made inside the given one for this run and removed after it; with --ranks-per-node L the ranks
// are laid out as nodes of L, as a multi-node launcher would: LOCAL_RANK = RANK % L,
// LOCAL_WORLD_SIZE = L, GROUP_RANK = RANK / L, which is what hierarchical groups read (comm.h's
// RanksPerNodeFromEnv) and what tools/netns-topology.sh uses to put each node in its own network
// namespace), forwards their stdout and stderr
// line by line with a "[rank r] " prefix, and fails fast: when one rank exits non-zero or is
// killed, the others get SIGTERM (SIGKILL after a grace period) and launch exits 1 naming the rank;
// a SIGINT or SIGTERM to launch goes on to every rank as it came, and launch exits 128 + it.
//
// Lifecycle: each rank runs in its own process group (so its children are signalled too); one
// poll loop reads every rank's two pipes, reaps exits with WNOHANG and enforces --timeout-s.
// launch ends when every rank exited: output still in flight is read for up to 1 s, then the
// process groups of ranks whose pipes are still held open (by a leftover background child) get
// SIGTERM and launch returns.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cpu/rendezvous/auth.h"
#include "tools/offloadctl/commands.h"

namespace strata::cli {
namespace {

volatile sig_atomic_t g_stop_signal = 0;
void OnStopSignal(int sig) { g_stop_signal = sig; }

struct Rank {
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;
  std::string out_buf, err_buf;
  bool exited = false;
  int code = 0;  // exit status, or 128 + signal
};

// A free TCP port on `addr` (bound then released; a small race, as torchrun's own), or 0 with
// *error set when none can be bound there (addr not on this host, no ports left).
int FreePort(const std::string& addr, std::string* error) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (::inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1) a.sin_addr.s_addr = htonl(INADDR_ANY);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = std::string("socket: ") + std::strerror(errno);
    return 0;
  }
  int port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    *error = std::string("bind: ") + std::strerror(errno);
  } else if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    *error = std::string("getsockname: ") + std::strerror(errno);
  } else {
    port = ntohs(a.sin_port);
    if (port == 0) *error = "the kernel returned port 0";
  }
  ::close(fd);
  return port;
}

// Writes complete lines of `buf` with the rank prefix; keeps a partial last line (flush: all).
void Forward(int rank, std::string& buf, FILE* to, bool flush) {
  size_t start = 0, nl;
  while ((nl = buf.find('\n', start)) != std::string::npos) {
    std::fprintf(to, "[rank %d] %.*s\n", rank, static_cast<int>(nl - start), buf.data() + start);
    start = nl + 1;
  }
  buf.erase(0, start);
  if (flush && !buf.empty()) {
    std::fprintf(to, "[rank %d] %s\n", rank, buf.c_str());
    buf.clear();
  }
  std::fflush(to);
}

void Drain(int rank, int& fd, std::string& buf, FILE* to) {
  if (fd < 0) return;
  char chunk[4096];
  const ssize_t n = ::read(fd, chunk, sizeof(chunk));
  if (n > 0) {
    buf.append(chunk, static_cast<size_t>(n));
    // A rank printing without newlines must not grow memory without bound.
    Forward(rank, buf, to, buf.size() > (1u << 16));
  } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
    Forward(rank, buf, to, true);
    ::close(fd);
    fd = -1;
  }
}

// Signals every rank's process group, also of ranks that already exited: their background
// children (still in the group, perhaps holding the output pipes) must stop too. A group with
// no process left gives ESRCH, which is harmless.
void SignalAll(std::vector<Rank>& ranks, int sig) {
  for (auto& r : ranks) {
    if (r.pid > 0) ::kill(-r.pid, sig);
  }
}

// This run's own rendezvous folder: a fresh mkdtemp folder inside the shared `parent`, so that a
// --rdzv-dir reused across runs never hands a rank the keys of an earlier (dead) run.
std::string MakeRunDir(const std::string& parent) {
  if (::mkdir(parent.c_str(), 0755) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "launch: --rdzv-dir '%s': mkdir: %s\n", parent.c_str(),
                 std::strerror(errno));
    return {};
  }
  std::string tmpl = parent + "/run.XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    std::fprintf(stderr, "launch: --rdzv-dir '%s': mkdtemp: %s\n", parent.c_str(),
                 std::strerror(errno));
    return {};
  }
  return tmpl;
}

// cmds[r]: rank r's command line.
int RunRanks(int n, int per_node, const std::string& addr, int port, const std::string& rdzv_dir,
             const std::string& run_id, double timeout_s, double grace_s,
             const std::vector<std::vector<std::string>>& cmds);

// local_rank_arg: each rank's command gets --local_rank=LOCAL_RANK appended, as DeepSpeed's
// launcher passes it (scripts written for it read args.local_rank before initialize).
int RunLaunch(int n, int per_node, const std::string& addr, int port,
              const std::string& rdzv_parent, double timeout_s, double grace_s,
              const std::vector<std::string>& cmd, bool local_rank_arg) {
  if (per_node == 0) per_node = n;
  if (n % per_node != 0) {
    std::fprintf(stderr, "launch: --ranks-per-node %d does not divide -n %d\n", per_node, n);
    return kExitUsage;  // the flags disagree: nothing was started
  }
  std::vector<std::vector<std::string>> cmds(n, cmd);
  for (int r = 0; r < n && local_rank_arg; ++r) {
    cmds[r].push_back("--local_rank=" + std::to_string(r % per_node));
  }
  if (port == 0) {
    std::string error;
    port = FreePort(addr, &error);
    if (port == 0) {
      std::fprintf(stderr,
                   "launch: cannot find a free port on --master-addr %s (%s); rank 0 serves the "
                   "rendezvous there, so it must be an address of this host, or pass "
                   "--master-port\n",
                   addr.c_str(), error.c_str());
      return kExitInvalid;
    }
  }
  std::string rdzv_dir,
      run_id = "launch-" + std::to_string(::getpid()) + "-" +
               std::to_string(std::chrono::system_clock::now().time_since_epoch().count());
  if (!rdzv_parent.empty()) {
    rdzv_dir = MakeRunDir(rdzv_parent);
    if (rdzv_dir.empty()) return kExitInvalid;
    run_id = std::filesystem::path(rdzv_dir).filename().string();
  }
  auto secret = cpu::GenerateRendezvousSecret();
  if (!secret.ok()) {
    std::fprintf(stderr, "launch: %s\n", secret.status().ToString().c_str());
    return kExitInvalid;
  }
  ::setenv("STRATA_RDZV_SECRET", secret->c_str(), 1);  // inherited by this run's ranks only
  const int rc = RunRanks(n, per_node, addr, port, rdzv_dir, run_id, timeout_s, grace_s, cmds);
  if (!rdzv_dir.empty()) {
    std::error_code ec;  // best effort: the folder is this run's alone
    std::filesystem::remove_all(rdzv_dir, ec);
  }
  return rc;
}

int RunRanks(int n, int per_node, const std::string& addr, int port, const std::string& rdzv_dir,
             const std::string& run_id, double timeout_s, double grace_s,
             const std::vector<std::vector<std::string>>& cmds) {
  // Ranks run in their own process groups, so a Ctrl-C reaches only launch: forward it.
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGHUP, &sa, nullptr);
  std::vector<Rank> ranks(n);
  std::vector<std::vector<char*>> argvs(n);  // made before the forks: the child only execs
  for (int r = 0; r < n; ++r) {
    for (const auto& a : cmds[r]) argvs[r].push_back(const_cast<char*>(a.c_str()));
    argvs[r].push_back(nullptr);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < n; ++r) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      std::fprintf(stderr, "launch: pipe: %s\n", std::strerror(errno));
      SignalAll(ranks, SIGKILL);
      return kExitInvalid;
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);
      // If launch itself dies (even by SIGKILL), the rank is told to stop.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::signal(SIGHUP, SIG_DFL);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r % per_node).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(per_node).c_str(), 1);
      ::setenv("GROUP_RANK", std::to_string(r / per_node).c_str(), 1);
      ::setenv("MASTER_ADDR", addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (!rdzv_dir.empty()) ::setenv("STRATA_RDZV_DIR", rdzv_dir.c_str(), 1);
      ::setenv("STRATA_RUN_ID", run_id.c_str(), 1);
      ::execvp(argvs[r][0], argvs[r].data());
      std::fprintf(stderr, "launch: cannot execute '%s': %s\n", argvs[r][0], std::strerror(errno));
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    ranks[r].pid = pid;
    ranks[r].out_fd = out[0];
    ranks[r].err_fd = err[0];
    if (pid < 0) {
      std::fprintf(stderr, "launch: fork: %s\n", std::strerror(errno));
      SignalAll(ranks, SIGKILL);
      return kExitInvalid;
    }
  }
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  Clock::time_point kill_at = Clock::time_point::max();
  int failed_rank = -1;
  int interrupted = 0;  // the signal that stopped launch (SIGINT, SIGTERM), if one did
  std::string why;
  int running = n;
  // Once every rank exited, output still in the pipes is read for at most this long: a rank's
  // leftover background child may hold a pipe open for ever.
  constexpr auto kDrainAfterExit = std::chrono::seconds(1);
  Clock::time_point drain_until = Clock::time_point::max();
  while (true) {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> who;  // rank, is_err
    for (int r = 0; r < n; ++r) {
      if (ranks[r].out_fd >= 0)
        fds.push_back({ranks[r].out_fd, POLLIN, 0}), who.push_back({r, false});
      if (ranks[r].err_fd >= 0)
        fds.push_back({ranks[r].err_fd, POLLIN, 0}), who.push_back({r, true});
    }
    if (running == 0 && fds.empty()) break;
    if (running == 0 && Clock::now() >= drain_until) {
      for (auto& rk : ranks) {
        // A leftover child of this rank holds its pipe: it outlived the rank, stop it.
        if (rk.out_fd >= 0 || rk.err_fd >= 0) ::kill(-rk.pid, SIGTERM);
        for (int* fd : {&rk.out_fd, &rk.err_fd}) {
          if (*fd >= 0) ::close(*fd);
          *fd = -1;
        }
        Forward(static_cast<int>(&rk - ranks.data()), rk.out_buf, stdout, true);
        Forward(static_cast<int>(&rk - ranks.data()), rk.err_buf, stderr, true);
      }
      break;
    }
    ::poll(fds.data(), fds.size(), 50);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Rank& rk = ranks[who[i].first];
      if (who[i].second) {
        Drain(who[i].first, rk.err_fd, rk.err_buf, stderr);
      } else {
        Drain(who[i].first, rk.out_fd, rk.out_buf, stdout);
      }
    }
    for (int r = 0; r < n; ++r) {
      if (ranks[r].exited) continue;
      int st = 0;
      if (::waitpid(ranks[r].pid, &st, WNOHANG) != ranks[r].pid) continue;
      ranks[r].exited = true;
      --running;
      ranks[r].code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      if (ranks[r].code == 0) continue;
      const std::string how = WIFEXITED(st)
                                  ? "exited with code " + std::to_string(ranks[r].code)
                                  : std::string("was killed by signal ") + strsignal(WTERMSIG(st));
      if (failed_rank >= 0) {
        // Which of two ranks reaped in one pass died first is unknown (a rank whose peer died
        // often fails too, at once): every rank's own failure is reported, not only the
        // first one reaped. A rank ended by launch's own signals is not a failure of its own.
        const bool stopped =
            WIFSIGNALED(st) && (WTERMSIG(st) == SIGTERM || WTERMSIG(st) == SIGKILL);
        if (!stopped) std::fprintf(stderr, "launch: rank %d %s\n", r, how.c_str());
        continue;
      }
      failed_rank = r;
      why = how;
      std::fprintf(stderr, "launch: rank %d %s; stopping the other ranks\n", r, why.c_str());
      SignalAll(ranks, SIGTERM);
      kill_at = Clock::now() +
                std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_s));
    }
    if (running == 0 && drain_until == Clock::time_point::max()) {
      drain_until = Clock::now() + kDrainAfterExit;
    }
    if (g_stop_signal != 0 && failed_rank < 0) {
      failed_rank = n;
      interrupted = g_stop_signal;
      why = std::string("interrupted by ") + strsignal(g_stop_signal);
      std::fprintf(stderr, "launch: %s; stopping all ranks\n", why.c_str());
      // The ranks get the signal launch got, as a terminal's Ctrl-C reaches every process of a
      // torchrun job: a Python rank ends by KeyboardInterrupt and runs its exit handlers (its
      // engine removes its swap files), where SIGTERM would end it without them.
      SignalAll(ranks, g_stop_signal);
      kill_at = Clock::now() +
                std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_s));
    }
    const auto now = Clock::now();
    if (timeout_s > 0 && failed_rank < 0 &&
        now - start > std::chrono::duration<double>(timeout_s)) {
      failed_rank = n;  // none of them: the job as a whole
      char secs[32];
      std::snprintf(secs, sizeof secs, "%g", timeout_s);
      why = std::string("timed out after ") + secs + " s";
      std::fprintf(stderr, "launch: %s; stopping all ranks\n", why.c_str());
      SignalAll(ranks, SIGTERM);
      kill_at =
          now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_s));
    }
    if (now >= kill_at) {
      SignalAll(ranks, SIGKILL);
      kill_at = Clock::time_point::max();
    }
  }
  if (interrupted != 0) return 128 + interrupted;  // as a shell reports a job it interrupted
  if (failed_rank >= 0) return kExitInvalid;
  return kExitOk;
}

}  // namespace

void RegisterLaunch(CLI::App& parent, int* exit_code) {
  auto* cmd = parent.add_subcommand(
      "launch",
      "Start N local ranks of a command with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
      "MASTER_PORT set (as torchrun does), prefix their output with the rank, and stop all of "
      "them as soon as one fails. Example: offloadctl launch -n 4 -- ./train --config ds.json");
  struct Opts {
    int n = 2;
    int per_node = 0;
    std::string addr = "127.0.0.1";
    int port = 0;
    std::string rdzv_dir;
    double timeout_s = 0;
    double grace_s = 5;
    bool local_rank_arg = false;
    std::vector<std::string> command;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("-n,--nproc", o->n, "Number of local ranks to start")
      ->check(CLI::Range(1, 4096))
      ->default_val(2);
  cmd->add_option("--ranks-per-node", o->per_node,
                  "Lay the ranks out as nodes of this many (LOCAL_RANK = RANK % L, "
                  "LOCAL_WORLD_SIZE = L, GROUP_RANK = RANK / L); must divide -n; 0: one node")
      ->check(CLI::Range(0, 4096))
      ->default_val(0);
  cmd->add_option("--master-addr", o->addr,
                  "MASTER_ADDR given to the ranks (rank 0 serves the "
                  "TCP rendezvous store there)")
      ->default_val("127.0.0.1");
  cmd->add_option("--master-port", o->port, "MASTER_PORT given to the ranks; 0 picks a free port")
      ->check(CLI::Range(0, 65535))
      ->default_val(0);
  cmd->add_option(
      "--rdzv-dir", o->rdzv_dir,
      "Shared directory for a file rendezvous store: each run uses (and afterwards removes) a "
      "fresh folder inside it, exported as STRATA_RDZV_DIR");
  cmd->add_option("--timeout-s", o->timeout_s,
                  "Stop every rank after this many seconds (0: no "
                  "limit); exit 1")
      ->check(CLI::NonNegativeNumber)
      ->default_val(0);
  cmd->add_option("--grace-s", o->grace_s,
                  "Seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(CLI::NonNegativeNumber)
      ->default_val(5);
  cmd->add_flag("--local-rank-arg", o->local_rank_arg,
                "Append --local_rank=LOCAL_RANK to each rank's command, as DeepSpeed's launcher "
                "does (for scripts written for it, which read args.local_rank)");
  cmd->add_option("command", o->command, "The command and its arguments, after --")->required();
  cmd->callback([o, exit_code] {
    *exit_code = RunLaunch(o->n, o->per_node, o->addr, o->port, o->rdzv_dir, o->timeout_s,
                           o->grace_s, o->command, o->local_rank_arg);
  });
}

}  // namespace strata::cli
