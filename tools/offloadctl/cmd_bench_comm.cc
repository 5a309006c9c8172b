// `offloadctl bench comm`: all-gather, reduce-scatter and all-reduce bandwidth over message sizes,
// reported as nccl-tests does: time per op, algbw = size / time, busbw = algbw * factor
// ((N-1)/N for all-gather and reduce-scatter, 2(N-1)/N for all-reduce), where size is the
// gathered output, the reduce-scatter input, or the all-reduce buffer. Backends: gloo (N forked
// local ranks on loopback) and nccl (one rank per GPU, when built with CUDA and a GPU is present).
//
// Lifecycle: the command forks N ranks (no exec) that meet through a file store in a fresh temp
// directory; rank 0 times each size after a barrier and writes one result line per measurement to
// a pipe; the parent prints them and kills every rank still alive at --timeout-s.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cpu/gloo_comm.h"
#include "cpu/rendezvous/rendezvous.h"
#include "nvme/leftovers.h"
#include "tools/offloadctl/bench_comm_backend.h"
#include "tools/offloadctl/cli_flags.h"
#include "tools/offloadctl/commands.h"
#include "tools/offloadctl/leftover_report.h"

namespace strata::cli {
namespace {

struct BenchOpts {
  std::string backend = "gloo";
  int n = 2;
  std::string dtype = "bf16";
  size_t min_bytes = 1024;
  size_t max_bytes = 16u << 20;
  int warmup = 2;
  int iters = 5;
  double timeout_s = 300;
  bool json = false;
};

constexpr CommOp kOps[] = {CommOp::kAllGather, CommOp::kReduceScatter, CommOp::kAllReduce,
                           CommOp::kAllToAll};

Result<BenchBackend> MakeBackend(const BenchOpts& o, int rank, KvStore* store) {
  if (o.backend == "nccl") return MakeNcclBenchBackend(rank, o.n, store);
  GlooCommOptions g;
  g.rank = rank;
  g.world_size = o.n;
  g.store = store;
  BenchBackend b;
  STRATA_ASSIGN_OR_RETURN(b.comm, CreateGlooCommunicator(g));
  b.alloc = [](size_t bytes) { return std::malloc(bytes ? bytes : 1); };
  b.free = [](void* p) { std::free(p); };
  b.upload = [](void* d, const void* s, size_t n) { std::memcpy(d, s, n); };
  return b;
}

// The element count one rank passes for a requested message of `bytes`: all-gather,
// reduce-scatter and all-to-all take a per-rank count (rounded down), all-reduce the whole buffer.
size_t OpCount(CommOp op, size_t bytes, size_t n, size_t elt) {
  return op == CommOp::kAllReduce ? bytes / elt : bytes / (n * elt);
}

// The payload the operation really moves (nccl-tests' size): the rounded count, not the request.
size_t MovedBytes(CommOp op, size_t bytes, size_t n, size_t elt) {
  const size_t count = OpCount(op, bytes, n, elt);
  return op == CommOp::kAllReduce ? count * elt : n * count * elt;
}

Result<CommHandle> Issue(Communicator& c, CommOp op, void* a, void* b, size_t bytes, DType dt) {
  const size_t elt = DTypeSize(dt), n = static_cast<size_t>(c.world_size());
  const size_t count = OpCount(op, bytes, n, elt);
  switch (op) {
    case CommOp::kAllGather:
      return c.AllGather(a, b, count, dt);
    case CommOp::kReduceScatter:
      return c.ReduceScatter(a, b, count, dt);
    case CommOp::kAllToAll:
      return c.AllToAll(a, b, count, dt);
    default:
      return c.AllReduce(a, b, count, dt);
  }
}

// One rank's run; rank 0 writes "op bytes seconds" lines to `out_fd`. Returns a message on error.
std::string RunRank(const BenchOpts& o, DType dt, int rank, const std::string& dir, int out_fd) {
  auto store = cpu::FileKvStore::Open(dir);
  if (!store.ok()) return store.status().ToString();
  auto be = MakeBackend(o, rank, store->get());
  if (!be.ok()) return be.status().ToString();
  Communicator& c = *be->comm;
  void* a = be->alloc(o.max_bytes);
  void* b = be->alloc(o.max_bytes);
  if (a == nullptr || b == nullptr) return "cannot allocate 2 x " + std::to_string(o.max_bytes);
  std::vector<uint8_t> fill(o.max_bytes);
  for (size_t i = 0; i < fill.size(); ++i) fill[i] = static_cast<uint8_t>(i % 61 == 0 ? 0x3f : 0);
  be->upload(a, fill.data(), fill.size());
  const auto deadline = [] { return std::chrono::steady_clock::now() + std::chrono::seconds(120); };
  std::string err;
  for (size_t bytes = o.min_bytes; bytes <= o.max_bytes && err.empty(); bytes *= 2) {
    if (bytes / (static_cast<size_t>(o.n) * DTypeSize(dt)) == 0) continue;
    for (CommOp op : kOps) {
      std::vector<CommHandle> hs;
      for (int k = 0; k < o.warmup; ++k) {
        auto h = Issue(c, op, a, b, bytes, dt);
        if (!h.ok()) return h.status().ToString();
        hs.push_back(*h);
      }
      auto bar = c.Barrier();
      if (!bar.ok()) return bar.status().ToString();
      hs.push_back(*bar);
      for (auto& h : hs) {
        const Status st = h.WaitUntil(deadline());
        if (!st.ok()) return st.ToString();
      }
      hs.clear();
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < o.iters; ++k) {
        auto h = Issue(c, op, a, b, bytes, dt);
        if (!h.ok()) return h.status().ToString();
        hs.push_back(*h);
      }
      for (auto& h : hs) {
        const Status st = h.WaitUntil(deadline());
        if (!st.ok()) return st.ToString();
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rank == 0) {
        const size_t moved =
            MovedBytes(op, bytes, static_cast<size_t>(c.world_size()), DTypeSize(dt));
        const std::string line = std::string(CommOpName(op)) + " " + std::to_string(moved) + " " +
                                 std::to_string(s / o.iters) + "\n";
        if (::write(out_fd, line.data(), line.size()) < 0) return "result pipe closed";
      }
    }
  }
  be->free(a);
  be->free(b);
  return "";
}

int RunBench(const BenchOpts& o) {
  const auto dt = ParseDType(o.dtype);
  if (!dt || *dt == DType::kI8) {
    return Failure("bench comm", "--dtype '" + o.dtype + "' is not fp32, bf16 or fp16", kExitUsage,
                   o.json);
  }
  if (o.min_bytes == 0 || o.min_bytes > o.max_bytes) {
    return Failure("bench comm", "need 0 < --min-bytes <= --max-bytes", kExitUsage, o.json);
  }
  // The rendezvous directory, in $TMPDIR (or /tmp): locked while this run (and its forked
  // ranks) live, so a killed run's directory is reported by the next one (nvme/leftovers.h).
  std::error_code ec;
  std::string tmp = std::filesystem::temp_directory_path(ec).string();
  if (ec) tmp = "/tmp";
  ReportLeftovers({tmp});
  auto run_dir = nvme::CreateRunDir(tmp, nvme::kBenchCommDirPrefix);
  if (!run_dir.ok()) {
    std::fprintf(stderr, "bench comm: %s\n", run_dir.status().ToString().c_str());
    return kExitInvalid;
  }
  const std::string dir = run_dir->path();
  int pfd[2];
  if (::pipe(pfd) != 0) return kExitInvalid;
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < o.n; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(pfd[0]);
      const std::string err = RunRank(o, *dt, r, dir, pfd[1]);
      if (!err.empty()) std::fprintf(stderr, "bench comm: rank %d: %s\n", r, err.c_str());
      std::fflush(stderr);
      ::_exit(err.empty() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  ::close(pfd[1]);
  ::fcntl(pfd[0], F_SETFL, O_NONBLOCK);
  std::string text;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.timeout_s);
  int alive = o.n;
  // The first failure is named; the ranks killed because of it (or of the timeout) are not.
  bool failed = false;
  std::vector<bool> done(o.n, false);
  auto stop_the_rest = [&] {
    for (int q = 0; q < o.n; ++q) {
      if (!done[q]) ::kill(pids[q], SIGKILL);  // fail fast: peers would wait for it
    }
  };
  while (alive > 0) {
    char buf[4096];
    ssize_t got;
    while ((got = ::read(pfd[0], buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(got));
    for (int r = 0; r < o.n; ++r) {
      int st = 0;
      if (done[r] || ::waitpid(pids[r], &st, WNOHANG) != pids[r]) continue;
      done[r] = true;
      --alive;
      if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
      if (!failed) {
        // A rank that returned an error printed it; one that died did not: say how, as launch.
        if (WIFSIGNALED(st)) {
          std::fprintf(stderr, "bench comm: rank %d was killed by signal %d (%s)\n", r,
                       WTERMSIG(st), strsignal(WTERMSIG(st)));
        } else {
          std::fprintf(stderr, "bench comm: rank %d exited with code %d\n", r, WEXITSTATUS(st));
        }
        failed = true;
      }
      stop_the_rest();
    }
    if (!failed && std::chrono::steady_clock::now() > end) {
      std::fprintf(stderr, "bench comm: timed out after %.0f s\n", o.timeout_s);
      stop_the_rest();
      failed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ssize_t got;
  char buf[4096];
  while ((got = ::read(pfd[0], buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(got));
  ::close(pfd[0]);
  std::filesystem::remove_all(dir);
  if (failed) return kExitInvalid;

  nlohmann::json results = nlohmann::json::array();
  std::istringstream in(text);
  std::string op;
  size_t bytes;
  double secs;
  if (!o.json) {
    std::printf("# offloadctl bench comm: backend %s, %d ranks, %s, %d iters (+%d warmup)\n",
                o.backend.c_str(), o.n, o.dtype.c_str(), o.iters, o.warmup);
    std::printf("# figures on a shared machine are noisy; busbw as nccl-tests defines it\n");
    std::printf("%-15s %12s %12s %12s %12s\n", "op", "size_B", "time_us", "algbw_GB/s",
                "busbw_GB/s");
  }
  while (in >> op >> bytes >> secs) {
    CommOp kind = CommOp::kAllReduce;
    for (CommOp k : kOps) {
      if (CommOpName(k) == op) kind = k;
    }
    const double algbw = static_cast<double>(bytes) / secs / 1e9;
    const double busbw = algbw * BusBandwidthFactor(kind, o.n);
    if (o.json) {
      results.push_back({{"op", op},
                         {"size_bytes", bytes},
                         {"time_us", secs * 1e6},
                         {"algbw_gbps", algbw},
                         {"busbw_gbps", busbw}});
    } else {
      std::printf("%-15s %12zu %12.1f %12.3f %12.3f\n", op.c_str(), bytes, secs * 1e6, algbw,
                  busbw);
    }
  }
  if (o.json) {
    nlohmann::json j = {{"backend", o.backend}, {"world_size", o.n},  {"dtype", o.dtype},
                        {"iters", o.iters},     {"warmup", o.warmup}, {"results", results}};
    std::printf("%s\n", j.dump(2).c_str());
  }
  return kExitOk;
}

}  // namespace

void RegisterBenchComm(CLI::App& bench, int* exit_code) {
  auto* cmd = bench.add_subcommand(
      "comm",
      "Collective bandwidth (all-gather, reduce-scatter, all-reduce, all-to-all) over message "
      "sizes, "
      "as nccl-tests reports it (algbw, busbw). Example: offloadctl bench comm -n 4");
  auto o = std::make_shared<BenchOpts>();
  cmd->add_option("--backend", o->backend,
                  "gloo (local ranks over loopback TCP) or nccl (one "
                  "rank per GPU; needs a CUDA build and GPUs)")
      ->check(CLI::IsMember({"gloo", "nccl"}))
      ->default_val("gloo");
  cmd->add_option("-n,--nproc", o->n, "Number of ranks")->check(CLI::Range(1, 64))->default_val(2);
  cmd->add_option("--dtype", o->dtype, "Element type: fp32, bf16 or fp16")->default_val("bf16");
  cmd->add_option("--min-bytes", o->min_bytes, "Smallest message (a SIZE: 4096, 1K, 2M)")
      ->transform(SizeArg())
      ->type_name("SIZE")
      ->default_str("1K");
  cmd->add_option("--max-bytes", o->max_bytes, "Largest message (sizes double from the smallest)")
      ->transform(SizeArg())
      ->type_name("SIZE")
      ->default_str("16M");
  cmd->add_option("--warmup", o->warmup, "Untimed iterations per size")
      ->check(CLI::Range(0, 1000))
      ->default_val(2);
  cmd->add_option("--iters", o->iters, "Timed iterations per size")
      ->check(CLI::Range(1, 1000))
      ->default_val(5);
  cmd->add_option("--timeout-s", o->timeout_s, "Kill every rank after this many seconds")
      ->check(CLI::PositiveNumber)
      ->default_val(300);
  cmd->add_flag("--json", o->json, "Print the results as JSON");
  cmd->callback([o, exit_code] { *exit_code = RunBench(*o); });
}

}  // namespace strata::cli
