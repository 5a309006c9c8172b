// `offloadctl bench store`: replays a synthetic ZeRO-3 step through the TieredStore with the
// trace-driven prefetcher, then an optimizer pipeline over NVMe-resident state, and reports the
// consumer stall fraction and the pipelined optimizer time against its IO-alone and
// compute-alone references measured in the same run.
//
// Param step: `layers` groups of `group-mb` param16 bytes on the home tier; forward 0..L-1 then
// backward L-1..0; each use acquires the group on the device, "computes" for `compute-ms`
// (sleep: the GPU's time, not the CPU's), releases it. Step 1 records the trace; later steps
// replay it and the Prefetcher (byte lookahead, Belady) drives Fetch/Evict ahead of the consumer.
// Optimizer: `subgroups` blocks of `subgroup-mb` fp32 state (master, m, v) homed on NVMe, run
// through StepPipeline: read-ahead fetch to pinned host, the SIMD AdamW of kernels/ over a
// KernelPool (oneTBB, --threads cores; bf16 gradient in, bf16 parameter out), write-behind
// eviction. The store's IO thread keeps reading ahead and writing behind while the pool computes.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/store/gather_scheduler.h"
#include "kernels/adam.h"
#include "kernels/pool.h"
#include "nvme/leftovers.h"
#include "sched/prefetcher.h"
#include "sched/step_pipeline.h"
#include "sched/trace.h"
#include "strata/store.h"
#include "tools/offloadctl/cli_flags.h"
#include "tools/offloadctl/commands.h"
#include "tools/offloadctl/leftover_report.h"

namespace strata::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kWait = std::chrono::seconds(120);
constexpr double kMiB = 1 << 20;

double Sec(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct BenchStoreArgs {
  int layers = 16;
  double group_mb = 8;
  std::string home = "nvme";
  double compute_ms = 10;
  int steps = 3;
  double device_mb = 64;
  double host_mb = 256;
  double prefetch_mb = 32;
  int subgroups = 32;
  double subgroup_mb = 12;
  int read_ahead = 2;
  int write_behind = 2;
  double pcie_gbps = 0;
  std::string io = "auto";
  std::vector<std::string> dirs;
  int stripe_kb = 1024;
  int threads = 0;
  bool json = false;
};

// One fresh subdirectory per --nvme-path (a swap file of rank 0 in each), so concurrent benches and
// the leftovers of a killed one never collide; locked while the bench runs (so its leftovers are
// told from a live run's: nvme/leftovers.h) and removed with its contents at the end. The bases
// are scanned first for leftovers of earlier runs, which are reported.
class BenchDirs {
 public:
  ~BenchDirs() {
    std::error_code ec;
    for (const auto& d : made_) std::filesystem::remove_all(d.path(), ec);  // before the lock goes
  }
  Result<std::vector<std::string>> Make(std::vector<std::string> bases) {
    if (bases.empty()) bases.push_back(std::filesystem::temp_directory_path().string());
    ReportLeftovers(bases);
    std::vector<std::string> paths;
    for (const auto& base : bases) {
      STRATA_ASSIGN_OR_RETURN(nvme::RunDir d, nvme::CreateRunDir(base, nvme::kBenchStoreDirPrefix));
      paths.push_back(d.path());
      made_.push_back(std::move(d));
    }
    return paths;
  }

 private:
  std::vector<nvme::RunDir> made_;
};

// One AdamW step (kernels/adam.h, SIMD, over the pool's threads) over a sub-group whose fp32
// master, m and v lie back to back in `state`; bf16 gradient in, bf16 parameter out: 28
// bytes/param.
Status AdamPass(kernels::KernelPool& pool, float* state, uint64_t params, const uint16_t* grad,
                uint16_t* param_out) {
  kernels::AdamHyper h;
  kernels::AdamShard sh;
  sh.master = state;
  sh.exp_avg = state + params;
  sh.exp_avg_sq = state + 2 * params;
  sh.grad = grad;
  sh.grad_dtype = DType::kBF16;
  sh.param_out = param_out;
  sh.param_out_dtype = DType::kBF16;
  sh.n = params;
  return kernels::AdamStep(pool, h, sh);
}

Result<Tier> ParseTier(const std::string& s) {
  if (s == "device") return Tier::kDevice;
  if (s == "host") return Tier::kHost;
  if (s == "nvme") return Tier::kNvme;
  return Status::InvalidArgument("--home must be device, host or nvme, not '" + s + "'");
}

struct ParamResult {
  double step_s = 0, stall_s = 0, hit_rate = 0;
  uint64_t divergences = 0;
};

// Steady-state steps only (step 1 records the trace).
Result<ParamResult> RunParamStep(Store& store, const BenchStoreArgs& a,
                                 const std::vector<BlockId>& groups) {
  sched::PrefetchConfig pc;
  pc.prefetch_bucket_bytes = static_cast<uint64_t>(a.prefetch_mb * (1 << 20));
  pc.max_live_bytes = static_cast<uint64_t>(a.device_mb * (1 << 20) * 0.9);
  pc.max_reuse_distance_bytes = 0;
  pc.host_lookahead_bytes = pc.prefetch_bucket_bytes;
  strata::store::GatherScheduler gather(&store, groups, pc);
  std::vector<sched::GroupId> order;
  for (int g = 0; g < a.layers; ++g) order.push_back(g);
  for (int g = a.layers; g-- > 0;) order.push_back(g);
  ParamResult r;
  for (int step = 0; step < a.steps; ++step) {
    store.TakeStats(true);
    const auto t0 = Clock::now();
    gather.BeginStep();
    for (sched::GroupId g : order) {
      STRATA_ASSIGN_OR_RETURN(auto lease, gather.Gather(g, kWait));
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(a.compute_ms));
      gather.Release(g, std::move(lease));
    }
    gather.EndStep();
    const double step_s = Sec(Clock::now() - t0);
    StoreStats st = store.TakeStats(false);
    if (step > 0 || a.steps == 1) {
      const double n = a.steps == 1 ? 1 : a.steps - 1;
      r.step_s += step_s / n;
      r.stall_s += st.stall_ns * 1e-9 / n;
      r.hit_rate += (st.acquires ? double(st.acquire_hits) / st.acquires : 0) / n;
    }
  }
  r.divergences = gather.trace().divergences();
  return r;
}

struct OptResult {
  double pipelined_s = 0, io_s = 0, compute_s = 0;
  uint32_t max_reads = 0, max_writes = 0;
};

Result<OptResult> RunOptimizer(Store& store, const BenchStoreArgs& a,
                               const std::vector<BlockId>& subs, kernels::KernelPool& pool) {
  const uint64_t bytes = store.spec(subs[0]).size_bytes;
  const uint64_t params = bytes / 12;
  std::vector<uint16_t> grad(params, 0x3A83);  // bf16 ~1e-3
  std::vector<uint16_t> param_out(params);
  sched::PipelineOptions po{static_cast<uint32_t>(a.read_ahead),
                            static_cast<uint32_t>(a.write_behind),
                            static_cast<uint32_t>(a.read_ahead + 1 + a.write_behind)};
  auto run = [&](bool compute, sched::PipelineStats* st) -> Status {
    sched::PipelineStages s;
    s.read = [&](size_t i, uint32_t, sched::StageDone done) {
      store.Fetch(subs[i], Tier::kHost).Then(std::move(done));
      return Status::OK();
    };
    s.compute = [&](size_t i, uint32_t) -> Status {
      STRATA_ASSIGN_OR_RETURN(auto l, store.Acquire(subs[i], Tier::kHost, Access::kWrite, kWait));
      if (compute) {
        STRATA_RETURN_IF_ERROR(
            AdamPass(pool, static_cast<float*>(l.data()), params, grad.data(), param_out.data()));
      }
      l.MarkDirty();  // IO alone still writes every sub-group back
      return Status::OK();
    };
    s.write = [&](size_t i, uint32_t, sched::StageDone done) {
      store.Evict(subs[i], Tier::kHost).Then(std::move(done));
      return Status::OK();
    };
    return sched::StepPipeline(po).Run(subs.size(), s, st);
  };
  OptResult r;
  sched::PipelineStats st;
  STRATA_RETURN_IF_ERROR(run(false, &st));  // warm-up: every sub-group written once
  STRATA_RETURN_IF_ERROR(run(false, &st));
  r.io_s = st.total_ns * 1e-9;
  {  // compute alone, on resident memory of the same size
    // A ring of distinct buffers larger than a last-level cache, so the reference streams from
    // DRAM as the pipelined run does.
    const size_t ring = std::min<size_t>(subs.size(), 4);
    std::vector<std::vector<float>> bufs(ring, std::vector<float>(3 * params, 0.f));
    const auto t0 = Clock::now();
    for (size_t i = 0; i < subs.size(); ++i) {
      STRATA_RETURN_IF_ERROR(
          AdamPass(pool, bufs[i % ring].data(), params, grad.data(), param_out.data()));
    }
    r.compute_s = Sec(Clock::now() - t0);
  }
  STRATA_RETURN_IF_ERROR(run(true, &st));
  r.pipelined_s = st.total_ns * 1e-9;
  r.max_reads = st.max_reads_in_flight;
  r.max_writes = st.max_writes_in_flight;
  return r;
}

Status RunBenchStore(const BenchStoreArgs& a, nlohmann::json* out) {
  if (a.layers < 1 || a.steps < 1 || a.subgroups < 1 || a.group_mb <= 0 || a.subgroup_mb <= 0) {
    return Status::InvalidArgument(
        "--layers, --steps, --subgroups, --group-size and "
        "--subgroup-size must be positive");
  }
  if (a.threads < 0 || a.stripe_kb <= 0 || a.stripe_kb % 4 != 0) {
    return Status::InvalidArgument(
        "--threads must be >= 0 and --stripe-size a positive multiple of 4K");
  }
  if (a.read_ahead < 0 || a.write_behind < 0 || a.pcie_gbps < 0 || a.compute_ms < 0 ||
      a.device_mb <= 0 || a.host_mb <= 0 || a.prefetch_mb <= 0) {
    return Status::InvalidArgument(
        "--read-ahead, --write-behind, --pcie-gbps and --compute-ms "
        "must be >= 0; --device-budget, --host-budget, --prefetch-size > 0");
  }
  STRATA_ASSIGN_OR_RETURN(Tier home, ParseTier(a.home));
  auto mb = [](double x) { return static_cast<uint64_t>(x * (1 << 20)); };
  HostDeviceOptions ho;
  ho.budget_bytes = mb(a.device_mb) + mb(a.group_mb) * (home == Tier::kDevice ? a.layers : 0);
  ho.copy_bandwidth_bytes_per_s = static_cast<uint64_t>(a.pcie_gbps * 1e9);
  STRATA_ASSIGN_OR_RETURN(auto device, CreateHostDevice(ho));
  IoBackendOptions io;
  STRATA_ASSIGN_OR_RETURN(io.kind, IoBackendFromName(a.io));
  STRATA_ASSIGN_OR_RETURN(auto backend, OpenIoBackend(io));
  const std::string backend_note = backend->note();
  TieredStoreOptions so;
  so.device_budget_bytes = ho.budget_bytes;
  so.host_budget_bytes = mb(a.host_mb) + mb(a.group_mb) * (home == Tier::kHost ? a.layers : 0);
  so.nvme_capacity_bytes = mb(a.group_mb) * a.layers + mb(a.subgroup_mb) * a.subgroups + mb(8);
  so.device = device.get();
  so.io = std::move(backend);
  BenchDirs dirs;
  STRATA_ASSIGN_OR_RETURN(so.nvme_paths, dirs.Make(a.dirs));
  so.stripe_unit_bytes = static_cast<size_t>(a.stripe_kb) * 1024;
  STRATA_ASSIGN_OR_RETURN(auto store, OpenTieredStore(std::move(so)));
  std::vector<BlockId> groups, subs;
  for (int g = 0; g < a.layers; ++g) {
    STRATA_ASSIGN_OR_RETURN(
        auto id, store->Register({"layer" + std::to_string(g) + ".param16", mb(a.group_mb),
                                  DType::kBF16, StateKind::kParam16, home}));
    groups.push_back(id);
  }
  for (int i = 0; i < a.subgroups; ++i) {
    STRATA_ASSIGN_OR_RETURN(auto id, store->Register({"subgroup" + std::to_string(i) + ".state",
                                                      mb(a.subgroup_mb) / 12 * 12, DType::kF32,
                                                      StateKind::kMaster32, Tier::kNvme}));
    subs.push_back(id);
  }
  STRATA_RETURN_IF_ERROR(store->OpenNvme());  // every NVMe block is registered: lay out the swap
  if (home == Tier::kNvme) {
    // Write every group once (a run loads its checkpoint): NVMe blocks never written read as
    // zeros without IO, which would measure nothing.
    for (BlockId g : groups) {
      STRATA_ASSIGN_OR_RETURN(auto l, store->Acquire(g, Tier::kHost, Access::kWrite, kWait));
      std::memset(l.data(), 0x3C, l.size_bytes());
      l.MarkDirty();
      l.Release();
      STRATA_RETURN_IF_ERROR(store->Evict(g, Tier::kHost).Wait(kWait));
    }
  }
  STRATA_ASSIGN_OR_RETURN(ParamResult p, RunParamStep(*store, a, groups));
  StoreStats st = store->TakeStats(true);
  kernels::PoolOptions kpo;
  kpo.threads = a.threads;
  STRATA_ASSIGN_OR_RETURN(auto pool, kernels::KernelPool::Create(kpo));
  STRATA_ASSIGN_OR_RETURN(OptResult o, RunOptimizer(*store, a, subs, *pool));
  StoreStats ost = store->TakeStats(false);
  const double ref = std::max(o.io_s, o.compute_s);
  const double hidden = o.io_s + o.compute_s - o.pipelined_s;
  nlohmann::json j;
  j["stall_fraction"] = p.step_s > 0 ? p.stall_s / p.step_s : 0.0;
  j["pipeline_ratio"] = ref > 0 ? o.pipelined_s / ref : 0.0;
  j["overlap_efficiency"] = std::min(o.io_s, o.compute_s) > 0
                                ? std::clamp(hidden / std::min(o.io_s, o.compute_s), 0.0, 1.0)
                                : 0.0;
  j["param_step"] = {
      {"layers", a.layers},
      {"group_bytes", mb(a.group_mb)},
      {"home", a.home},
      {"compute_ms_per_layer", a.compute_ms},
      {"step_s", p.step_s},
      {"stall_s", p.stall_s},
      {"prefetch_hit_rate", p.hit_rate},
      {"trace_divergences", p.divergences},
      {"bytes_nvme_to_host", st.bytes_moved[Tier::kNvme][Tier::kHost]},
      {"bytes_host_to_device", st.bytes_moved[Tier::kHost][Tier::kDevice]},
      {"copy_gbps", st.copy_busy_ns ? st.copy_bytes / (st.copy_busy_ns * 1e-9) / 1e9 : 0.0}};
  j["optimizer"] = {
      {"subgroups", a.subgroups},
      {"subgroup_bytes", mb(a.subgroup_mb)},
      {"read_ahead", a.read_ahead},
      {"write_behind", a.write_behind},
      {"pipelined_s", o.pipelined_s},
      {"io_alone_s", o.io_s},
      {"compute_alone_s", o.compute_s},
      {"max_reads_in_flight", o.max_reads},
      {"max_writes_in_flight", o.max_writes},
      {"compute", "kernels::AdamStep (AdamW, bf16 grad in, bf16 param out) on a KernelPool"},
      {"adam_threads", pool->threads()},
      {"io_gbps", ost.io_busy_ns ? ost.io_bytes / (ost.io_busy_ns * 1e-9) / 1e9 : 0}};
  j["peak_bytes"] = {{"device", st.peak_bytes[Tier::kDevice]},
                     {"host", std::max(st.peak_bytes[Tier::kHost], ost.peak_bytes[Tier::kHost])},
                     {"nvme", st.peak_bytes[Tier::kNvme]}};
  j["budget_bytes"] = {{"device", st.budget_bytes[Tier::kDevice]},
                       {"host", st.budget_bytes[Tier::kHost]},
                       {"nvme", st.budget_bytes[Tier::kNvme]}};
  j["nvme_paths"] = a.dirs.empty() ? 1 : a.dirs.size();
  j["notes"] = backend_note + store->note();
  *out = std::move(j);
  return Status::OK();
}

// A SIZE option of bench store kept in MiB (BenchStoreArgs' unit).
void AddMibSize(CLI::App* c, const std::string& name, double* mib, const std::string& help) {
  c->add_option_function<std::string>(
       name, [mib](const std::string& v) { *mib = *ParseSize(v) / kMiB; }, help)
      ->check(SizeArg())
      ->type_name("SIZE")
      ->default_str(SizeString(static_cast<uint64_t>(*mib * kMiB)));
}

}  // namespace

void RegisterBenchStore(CLI::App& bench, int* exit_code) {
  auto args = std::make_shared<BenchStoreArgs>();
  CLI::App* c = bench.add_subcommand(
      "store",
      "Replay a synthetic ZeRO-3 step (prefetch over the tiered store) and an optimizer "
      "pipeline over NVMe-resident state; report stall fraction and pipeline ratio. "
      "The device is the CPU stand-in (HostDevice). Timings on a shared machine are noisy.");
  c->add_option("--layers", args->layers, "Parameter groups (layers)")->capture_default_str();
  AddMibSize(c, "--group-size", &args->group_mb, "param16 bytes per group");
  c->add_option("--home", args->home, "Home tier of the params: device, host or nvme")
      ->capture_default_str();
  c->add_option("--compute-ms", args->compute_ms, "Simulated compute per layer use (ms)")
      ->capture_default_str();
  c->add_option("--steps", args->steps, "Steps (the first records the trace)")
      ->capture_default_str();
  AddMibSize(c, "--device-budget", &args->device_mb, "Device (HBM) cache budget");
  AddMibSize(c, "--host-budget", &args->host_mb, "Pinned host cache budget");
  AddMibSize(c, "--prefetch-size", &args->prefetch_mb,
             "Prefetch lookahead (stage3_prefetch_bucket_size x 2 bytes)");
  c->add_option("--subgroups", args->subgroups, "Optimizer sub-groups")->capture_default_str();
  AddMibSize(c, "--subgroup-size", &args->subgroup_mb,
             "fp32 optimizer state (master, m, v) bytes per sub-group");
  c->add_option("--read-ahead", args->read_ahead, "Optimizer read-ahead depth")
      ->capture_default_str();
  c->add_option("--write-behind", args->write_behind, "Optimizer write-behind depth")
      ->capture_default_str();
  c->add_option("--pcie-gbps", args->pcie_gbps,
                "Simulated host<->device link GB/s (0: memcpy speed)")
      ->capture_default_str();
  AddIoBackendOption(c, &args->io);
  AddNvmePathOption(
      c, &args->dirs,
      "Directory for the swap files (DeepSpeed's nvme_path); repeat for several SSDs (blocks are "
      "striped over all). A fresh subdirectory is made and removed in each (default: the temp "
      "dir)");
  c->add_option_function<std::string>(
       "--stripe-size",
       [args](const std::string& v) { args->stripe_kb = static_cast<int>(*ParseSize(v) / 1024); },
       "Stripe unit over the --nvme-path directories, a multiple of 4K")
      ->check(SizeArg({.multiple_bytes = 4096, .max_bytes = uint64_t{1} << 30}))
      ->type_name("SIZE")
      ->default_str(SizeString(uint64_t(args->stripe_kb) * 1024));
  c->add_option("--threads", args->threads,
                "Threads of the Adam KernelPool, the calling thread included (0: every CPU)")
      ->capture_default_str();
  c->add_flag("--json", args->json, "Print one JSON object");
  c->callback([args, exit_code] {
    nlohmann::json j;
    Status s = RunBenchStore(*args, &j);
    if (!s.ok()) {
      *exit_code = Failure("bench store", s.ToString(),
                           s.IsInvalidArgument() ? kExitUsage : kExitInvalid, args->json);
      return;
    }
    if (args->json) {
      std::printf("%s\n", j.dump(2).c_str());
      return;
    }
    std::printf(
        "param step: %d layers x %.1f MiB on %s, %.1f ms compute/layer\n"
        "  step %.3f s, consumers waited %.3f s: stall fraction %.3f, prefetch hit rate %.2f\n"
        "optimizer: %d sub-groups x %.1f MiB on nvme, read-ahead %d, write-behind %d\n"
        "  pipelined %.3f s, IO alone %.3f s, compute alone %.3f s: pipeline ratio %.3f, "
        "overlap efficiency %.2f\n"
        "peaks: device %llu, host %llu bytes\n",
        args->layers, args->group_mb, args->home.c_str(), args->compute_ms,
        j["param_step"]["step_s"].get<double>(), j["param_step"]["stall_s"].get<double>(),
        j["stall_fraction"].get<double>(), j["param_step"]["prefetch_hit_rate"].get<double>(),
        args->subgroups, args->subgroup_mb, args->read_ahead, args->write_behind,
        j["optimizer"]["pipelined_s"].get<double>(), j["optimizer"]["io_alone_s"].get<double>(),
        j["optimizer"]["compute_alone_s"].get<double>(), j["pipeline_ratio"].get<double>(),
        j["overlap_efficiency"].get<double>(),
        (unsigned long long)j["peak_bytes"]["device"].get<uint64_t>(),
        (unsigned long long)j["peak_bytes"]["host"].get<uint64_t>());
    if (!j["notes"].get<std::string>().empty()) {
      std::printf("notes: %s\n", j["notes"].get<std::string>().c_str());
    }
  });
}

}  // namespace strata::cli
