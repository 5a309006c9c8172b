// `offloadctl bench nvme`: O_DIRECT write/read throughput and latency of the disks under one
// or more directories (all at once) over a sweep of block size x queue depth x threads, through
// strata's own IO path; prints a table, the best point and the DeepSpeed `aio` block for it (or
// JSON with --json).
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "nvme/bench/nvme_bench.h"
#include "tools/offloadctl/cli_flags.h"
#include "tools/offloadctl/commands.h"
#include "tools/offloadctl/leftover_report.h"

namespace strata::cli {
namespace {

nlohmann::json LatencyJson(const nvme::LatencyUs& l) {
  return {{"p50", l.p50}, {"p90", l.p90}, {"p99", l.p99}, {"max", l.max}};
}

struct Args {
  std::vector<std::string> nvme_paths;
  std::string size = "1G";
  std::vector<std::string> block_sizes = {"256K", "1M", "4M"};
  std::vector<size_t> queue_depths = {8, 32};
  std::vector<size_t> threads = {1};
  std::string io_backend = "auto";
  bool no_fixed_buffers = false;
  bool no_huge_pages = false;
  bool json = false;
};

std::string Joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

int Run(const Args& a) {
  nvme::NvmeBenchOptions o;
  o.dirs = a.nvme_paths;
  o.size_bytes = *ParseSize(a.size);  // validated by SizeArg
  o.backend = *IoBackendFromName(a.io_backend);
  o.fixed_buffers = !a.no_fixed_buffers;
  o.huge_pages = !a.no_huge_pages;
  // The default sweep keeps the block sizes one pass of --size holds (a block per thread in
  // each directory); a block size given that it does not hold is a usage error.
  const bool default_blocks = a.block_sizes == Args{}.block_sizes;
  const uint64_t per_dir = o.size_bytes / std::max<size_t>(1, a.nvme_paths.size());
  std::vector<nvme::NvmeBenchPoint> points;
  std::string skipped;
  for (const std::string& bs : a.block_sizes) {
    const uint64_t b = *ParseSize(bs);
    if (b == 0 || b % 4096 != 0) {
      return Failure("bench nvme", "--block-size " + bs + " is not a multiple of 4K", kExitUsage,
                     a.json);
    }
    for (size_t t : a.threads) {
      if (per_dir < b * t) {
        if (!default_blocks) {
          return Failure("bench nvme",
                         "--size " + a.size + " holds less than one " + bs + " block per thread (" +
                             std::to_string(t) + " thread(s) in each of " +
                             std::to_string(a.nvme_paths.size()) +
                             " directories): raise --size or lower --block-size",
                         kExitUsage, a.json);
        }
        skipped += (skipped.empty() ? "" : ", ") + bs + " x " + std::to_string(t) + " thread(s)";
        continue;
      }
      for (size_t qd : a.queue_depths) points.push_back({static_cast<size_t>(b), qd, t});
    }
  }
  if (points.empty()) {
    return Failure("bench nvme",
                   "--size " + a.size +
                       " holds no block of the sweep per thread: raise --size or give a smaller "
                       "--block-size",
                   kExitUsage, a.json);
  }
  if (!skipped.empty()) {
    std::fprintf(stderr, "offloadctl bench nvme: skipping %s: larger than --size %s per thread\n",
                 skipped.c_str(), a.size.c_str());
  }
  auto progress = [&](size_t i, const nvme::NvmeBenchPoint& p) {
    if (points.size() > 1) {
      std::fprintf(stderr, "[%zu/%zu] block %s, queue depth %zu, %zu thread(s)...\n", i + 1,
                   points.size(), SizeString(p.block_bytes).c_str(), p.queue_depth, p.threads);
    }
  };
  ReportLeftovers(a.nvme_paths);
  auto results = nvme::RunNvmeBench(o, points, progress);
  if (!results.ok()) {  // a path or disk that cannot be measured
    return Failure("bench nvme", results.status().ToString(), kExitInvalid, a.json);
  }
  // Best: highest read + write throughput (swap traffic is both).
  const nvme::NvmeBenchResult* best = &results->front();
  for (const auto& r : *results) {
    if (r.read_bytes_per_s + r.write_bytes_per_s >
        best->read_bytes_per_s + best->write_bytes_per_s) {
      best = &r;
    }
  }
  // The keys DeepSpeed 0.19.8 reads (runtime/swap_tensor/constants.py), with JSON booleans:
  // intra_op_parallelism, not the old thread_count that it ignores. strata's config reader acts
  // on each of them (bench_nvme_cli_test feeds this block back through it).
  nlohmann::ordered_json aio = {{"block_size", best->point.block_bytes},
                                {"queue_depth", best->point.queue_depth},
                                {"intra_op_parallelism", best->point.threads},
                                {"single_submit", false},
                                {"overlap_events", true},
                                {"use_gds", false}};
  if (a.json) {
    nlohmann::json j;
    j["nvme_paths"] = a.nvme_paths;
    j["path"] = a.nvme_paths.front();  // the first of nvme_paths; kept for older scripts
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
  std::printf("NVMe benchmark: %s, %s per pass, backend %s%s%s\n", Joined(a.nvme_paths).c_str(),
              SizeString(best->bytes).c_str(), best->backend.c_str(),
              best->note.empty() ? "" : " — ", best->note.c_str());
  std::printf("%8s %6s %7s | %10s %9s %9s | %10s %9s %9s\n", "block", "depth", "threads",
              "write GB/s", "p50 us", "p99 us", "read GB/s", "p50 us", "p99 us");
  for (const auto& r : *results) {
    std::printf("%8s %6zu %7zu | %10.2f %9.0f %9.0f | %10.2f %9.0f %9.0f%s\n",
                SizeString(r.point.block_bytes).c_str(), r.point.queue_depth, r.point.threads,
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
      "O_DIRECT write then read throughput and latency of the disks under one or more "
      "directories, swept over block size x queue depth x threads through strata's io_uring "
      "path; prints the best setting and the DeepSpeed \"aio\" block for it. Uses a scratch "
      "file per directory, --size bytes in all, removed after.");
  AddNvmePathOption(cmd, &args->nvme_paths,
                    "Directory on a disk to measure (an nvme_path); repeat for several disks, "
                    "measured at once with --threads threads each (their aggregate)");
  cmd->add_option("--size", args->size, "Bytes per pass over all directories (default 1G)")
      ->check(SizeArg())
      ->type_name("SIZE");
  cmd->add_option("--block-size", args->block_sizes,
                  "Request size(s) to sweep, multiples of 4K (default 256K 1M 4M)")
      ->delimiter(',')
      ->check(SizeArg())
      ->type_name("SIZE");
  cmd->add_option("--queue-depth", args->queue_depths,
                  "Requests in flight per thread to sweep (default 8 32)")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--threads", args->threads,
                  "Thread counts per directory to sweep, each thread with its own ring: the aio "
                  "block's intra_op_parallelism (default 1)")
      ->delimiter(',')
      ->check(CLI::Range(1, 256));
  AddIoBackendOption(cmd, &args->io_backend);
  cmd->add_flag("--no-fixed-buffers", args->no_fixed_buffers,
                "Do not register buffers with io_uring (to measure what registration buys)");
  cmd->add_flag("--no-huge-pages", args->no_huge_pages,
                "Do not advise huge pages for IO buffers (to measure what they buy)");
  cmd->add_flag("--json", args->json,
                "Print JSON (keys read_bytes_per_s, write_bytes_per_s of the best point, results, "
                "aio)");
  cmd->callback([args, exit_code] {
    if (args->nvme_paths.empty()) {
      *exit_code = Failure("bench nvme", "--nvme-path DIR is required", kExitUsage, args->json);
      return;
    }
    *exit_code = Run(*args);
  });
}

}  // namespace strata::cli
