// `offloadctl bench nvme`: O_DIRECT write/read throughput and latency of a directory's disk over
// a sweep of block size x queue depth x threads, through strata's own IO path; prints a table,
// the best point and the DeepSpeed `aio` block for it (or JSON with --json).
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "nvme/bench/nvme_bench.h"
#include "tools/offloadctl/commands.h"
#include "tools/offloadctl/leftover_report.h"

namespace strata::cli {
namespace {

// "4096", "256K", "1M", "2G" (binary units) -> bytes; 0 on a malformed value.
uint64_t ParseBytes(const std::string& s) {
  if (s.empty()) return 0;
  size_t pos = 0;
  uint64_t v = 0;
  try {
    v = std::stoull(s, &pos);
  } catch (...) {
    return 0;
  }
  std::string unit = s.substr(pos);
  if (unit == "" || unit == "B") return v;
  if (unit == "K" || unit == "k" || unit == "KiB") return v << 10;
  if (unit == "M" || unit == "MiB") return v << 20;
  if (unit == "G" || unit == "GiB") return v << 30;
  return 0;
}

std::string HumanBytes(uint64_t b) {
  if (b % (1u << 30) == 0) return std::to_string(b >> 30) + "G";
  if (b % (1u << 20) == 0) return std::to_string(b >> 20) + "M";
  if (b % (1u << 10) == 0) return std::to_string(b >> 10) + "K";
  return std::to_string(b);
}

nlohmann::json LatencyJson(const nvme::LatencyUs& l) {
  return {{"p50", l.p50}, {"p90", l.p90}, {"p99", l.p99}, {"max", l.max}};
}

struct Args {
  std::string path;
  std::string size = "1G";
  std::vector<std::string> block_sizes = {"256K", "1M", "4M"};
  std::vector<size_t> queue_depths = {8, 32};
  std::vector<size_t> threads = {1};
  std::string backend = "auto";
  bool no_fixed_buffers = false;
  bool no_huge_pages = false;
  bool json = false;
};

int Run(const Args& a) {
  nvme::NvmeBenchOptions o;
  o.dir = a.path;
  o.size_bytes = ParseBytes(a.size);
  if (o.size_bytes == 0) {
    std::fprintf(stderr, "error: --size '%s' is not a size like 512M or 2G\n", a.size.c_str());
    return kExitUsage;
  }
  o.backend = a.backend == "io_uring" ? IoBackendKind::kIoUring
              : a.backend == "posix"  ? IoBackendKind::kPosix
                                      : IoBackendKind::kAuto;
  o.fixed_buffers = !a.no_fixed_buffers;
  o.huge_pages = !a.no_huge_pages;
  std::vector<nvme::NvmeBenchPoint> points;
  for (const std::string& bs : a.block_sizes) {
    const uint64_t b = ParseBytes(bs);
    if (b == 0) {
      std::fprintf(stderr, "error: --block-size '%s' is not a size like 1M\n", bs.c_str());
      return kExitUsage;
    }
    for (size_t qd : a.queue_depths) {
      for (size_t t : a.threads) points.push_back({static_cast<size_t>(b), qd, t});
    }
  }
  auto progress = [&](size_t i, const nvme::NvmeBenchPoint& p) {
    if (points.size() > 1) {
      std::fprintf(stderr, "[%zu/%zu] block %s, queue depth %zu, %zu thread(s)...\n", i + 1,
                   points.size(), HumanBytes(p.block_bytes).c_str(), p.queue_depth, p.threads);
    }
  };
  ReportLeftovers({a.path});
  auto results = nvme::RunNvmeBench(o, points, progress);
  if (!results.ok()) {
    std::fprintf(stderr, "error: %s\n", results.status().ToString().c_str());
    return kExitInvalid;  // a path or disk that cannot be measured
  }
  // Best: highest read + write throughput (swap traffic is both).
  const nvme::NvmeBenchResult* best = &results->front();
  for (const auto& r : *results) {
    if (r.read_bytes_per_s + r.write_bytes_per_s >
        best->read_bytes_per_s + best->write_bytes_per_s) {
      best = &r;
    }
  }
  // DeepSpeed's own key names and JSON booleans.
  nlohmann::json aio = {{"block_size", best->point.block_bytes},
                        {"queue_depth", best->point.queue_depth},
                        {"thread_count", best->point.threads},
                        {"single_submit", false},
                        {"overlap_events", true}};
  if (a.json) {
    nlohmann::json j;
    j["path"] = a.path;
    j["size_bytes"] = best->bytes;
    j["backend"] = best->backend;
    j["note"] = best->note;
    j["fixed_buffers"] = o.fixed_buffers;
    j["huge_pages"] = o.huge_pages;
    for (const auto& r : *results) {
      j["results"].push_back({{"block_size", r.point.block_bytes},
                              {"queue_depth", r.point.queue_depth},
                              {"threads", r.point.threads},
                              {"read_bytes_per_s", r.read_bytes_per_s},
                              {"write_bytes_per_s", r.write_bytes_per_s},
                              {"read_latency_us", LatencyJson(r.read_latency)},
                              {"write_latency_us", LatencyJson(r.write_latency)}});
    }
    j["best"] = j["results"][best - results->data()];
    j["read_bytes_per_s"] = best->read_bytes_per_s;
    j["write_bytes_per_s"] = best->write_bytes_per_s;
    j["aio"] = aio;
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }
  std::printf("NVMe benchmark: %s, %s per pass, backend %s%s%s\n", a.path.c_str(),
              HumanBytes(best->bytes).c_str(), best->backend.c_str(),
              best->note.empty() ? "" : " — ", best->note.c_str());
  std::printf("%8s %6s %7s | %10s %9s %9s | %10s %9s %9s\n", "block", "depth", "threads",
              "write GB/s", "p50 us", "p99 us", "read GB/s", "p50 us", "p99 us");
  for (const auto& r : *results) {
    std::printf("%8s %6zu %7zu | %10.2f %9.0f %9.0f | %10.2f %9.0f %9.0f%s\n",
                HumanBytes(r.point.block_bytes).c_str(), r.point.queue_depth, r.point.threads,
                r.write_bytes_per_s / 1e9, r.write_latency.p50, r.write_latency.p99,
                r.read_bytes_per_s / 1e9, r.read_latency.p50, r.read_latency.p99,
                &r == best ? "  <- best" : "");
  }
  std::printf("\nPaste into ds_config.json:\n\"aio\": %s\n", aio.dump(2).c_str());
  std::printf("(figures on a shared or virtual machine are noisy; compare in the same run)\n");
  return kExitOk;
}

}  // namespace

void RegisterBenchNvme(CLI::App& parent, int* exit_code) {
  auto args = std::make_shared<Args>();
  CLI::App* cmd = parent.add_subcommand(
      "nvme",
      "O_DIRECT write then read throughput and latency of a directory's disk, swept over block "
      "size x queue depth x threads through strata's io_uring path; prints the best setting and "
      "the DeepSpeed \"aio\" block for it. Uses a scratch file of --size bytes, removed after.");
  cmd->add_option("--path", args->path, "Directory on the disk to measure (an nvme_path)")
      ->required();
  cmd->add_option("--size", args->size, "Bytes per pass, e.g. 512M, 2G (default 1G)");
  cmd->add_option("--block-size", args->block_sizes,
                  "Request size(s) to sweep, multiples of 4K (default 256K 1M 4M)")
      ->delimiter(',');
  cmd->add_option("--queue-depth", args->queue_depths,
                  "Requests in flight per thread to sweep (default 8 32)")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--threads", args->threads,
                  "Thread counts to sweep, each with its own ring (default 1)")
      ->delimiter(',')
      ->check(CLI::Range(1, 256));
  cmd->add_option("--backend", args->backend, "IO backend: auto, io_uring or posix (default auto)")
      ->check(CLI::IsMember({"auto", "io_uring", "posix"}));
  cmd->add_flag("--no-fixed-buffers", args->no_fixed_buffers,
                "Do not register buffers with io_uring (to measure what registration buys)");
  cmd->add_flag("--no-huge-pages", args->no_huge_pages,
                "Do not advise huge pages for IO buffers (to measure what they buy)");
  cmd->add_flag("--json", args->json,
                "Print JSON (keys read_bytes_per_s, write_bytes_per_s of the best point, results, "
                "aio)");
  cmd->callback([args, exit_code] { *exit_code = Run(*args); });
}

}  // namespace strata::cli
