// `offloadctl bench engine`: the real ZeRO engine under a synthetic training load, one setting or
// the sweep of settings (--sweep), on 1 rank or on N under `offloadctl launch -n N` (Gloo, and
// NCCL on --device cuda, through the environment's rendezvous), on a GPU or the HostDevice
// stand-in. Rank 0 prints; every rank runs. bench_engine.h says what a run
// does; this file parses the flags, prepares the process (rendezvous, run directories, the disk
// measurement) and renders the results as a table or JSON.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cpu/rendezvous/rendezvous.h"
#include "nvme/leftovers.h"
#include "strata/device.h"
#include "strata/planner.h"
#include "tools/offloadctl/bench_engine.h"
#include "tools/offloadctl/cli_checks.h"
#include "tools/offloadctl/cli_flags.h"
#include "tools/offloadctl/commands.h"
#include "tools/offloadctl/leftover_report.h"

namespace strata::cli {
namespace {

constexpr const char* kTierKeys[] = {"device", "host", "nvme"};

// One fresh, locked run directory per --nvme-path for this rank's swap file, removed at the end
// (nvme/leftovers.h tells a killed run's directory from a live one's).
class RunDirs {
 public:
  ~RunDirs() {
    std::error_code ec;
    for (const auto& d : made_) std::filesystem::remove_all(d.path(), ec);  // before the lock goes
  }
  Result<std::vector<std::string>> Make(const std::vector<std::string>& bases) {
    std::vector<std::string> paths;
    for (const auto& base : bases) {
      STRATA_ASSIGN_OR_RETURN(nvme::RunDir d,
                              nvme::CreateRunDir(base, nvme::kBenchEngineDirPrefix));
      paths.push_back(d.path());
      made_.push_back(std::move(d));
    }
    return paths;
  }

 private:
  std::vector<nvme::RunDir> made_;
};

// The setting of a single run: --config's, with --stage and --offload-* over it (stage 3 without
// either).
Result<EngineVariant> ResolveVariant(const BenchEngineArgs& a) {
  EngineVariant v;
  if (!a.config.empty()) {
    auto f = LoadDeepSpeedConfig(a.config);
    if (!f.ok()) return f.status().WithContext("--config " + a.config);
    v.stage = f->config.zero.stage;
    v.offload_optimizer = f->config.zero.offload_optimizer.device;
    v.offload_param = f->config.zero.offload_param.device;
  }
  if (a.stage >= 0) v.stage = a.stage;
  if (!a.offload_optimizer.empty()) v.offload_optimizer = *ParseOffloadDevice(a.offload_optimizer);
  if (!a.offload_param.empty()) v.offload_param = *ParseOffloadDevice(a.offload_param);
  return v;
}

// The sweep: stages 0, 2 and 3, then stage 3's offload variants (NVMe with --nvme-path only),
// the optimizer half offloaded (offload_optimizer.ratio 0.5: the other half steps on the device)
// before the full offload. Each sets its ratio (1 where none is given), so a --config's ratio
// does not reach the stages below 3, which refuse it.
std::vector<EngineVariant> SweepVariants(const BenchEngineArgs& a) {
  using D = OffloadDevice;
  std::vector<EngineVariant> v = {{0, D::kNone, D::kNone, 1.0}, {2, D::kNone, D::kNone, 1.0},
                                  {3, D::kNone, D::kNone, 1.0}, {3, D::kCpu, D::kNone, 0.5},
                                  {3, D::kCpu, D::kNone, 1.0},  {3, D::kCpu, D::kCpu, 1.0}};
  if (!a.nvme_paths.empty()) v.push_back({3, D::kNvme, D::kNvme, 1.0});
  return v;
}

bool UsesNvme(const EngineVariant& v) {
  return v.offload_optimizer == OffloadDevice::kNvme ||
         (v.stage == 3 && v.offload_param == OffloadDevice::kNvme);
}

// Rendezvous from the environment `offloadctl launch` (or torchrun) sets, else one rank.
Status OpenProcess(const BenchEngineArgs& a, BenchProcess* p) {
  p->timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  p->progress_tty = ::isatty(STDERR_FILENO) != 0;
  STRATA_ASSIGN_OR_RETURN(p->io_kind, IoBackendFromName(a.io_backend));
  if (std::getenv("WORLD_SIZE") == nullptr) return Status::OK();
  STRATA_ASSIGN_OR_RETURN(cpu::RendezvousConfig cfg, cpu::RendezvousConfig::FromEnv());
  p->rank = cfg.rank;
  p->world = cfg.world_size;
  p->timeout = std::max(p->timeout, cfg.timeout);
  if (p->world > 1) {
    STRATA_ASSIGN_OR_RETURN(p->rendezvous, cpu::OpenRendezvousStore(cfg));
  }
  return Status::OK();
}

// This rank's GPU: LOCAL_RANK (as `offloadctl launch` and torchrun set it), else 0.
Result<int> LocalGpu() {
  const char* v = std::getenv("LOCAL_RANK");
  if (v == nullptr || *v == '\0') return 0;
  int n = -1;
  const auto [end, ec] = std::from_chars(v, v + std::strlen(v), n);
  if (ec != std::errc() || *end != '\0' || n < 0) {
    return Status::InvalidArgument("LOCAL_RANK=" + std::string(v) + " is not a GPU ordinal");
  }
  return n;
}

// The PCIe reference: a pinned buffer of this size to and from the device, best of kPcieRepeats.
constexpr size_t kPcieBytes = size_t{256} << 20;
constexpr int kPcieRepeats = 5;

// --device: cuda when a CudaDevice can be created on this rank's GPU (a probe with a small pool,
// destroyed at once; auto falls back to the host without one), then the PCIe reference.
Status ResolveDevice(const BenchEngineArgs& a, BenchProcess* p) {
  if (a.device == "host") return Status::OK();
  STRATA_ASSIGN_OR_RETURN(p->device_ordinal, LocalGpu());
  CudaDeviceOptions probe;
  probe.device_ordinal = p->device_ordinal;
  probe.budget_bytes = uint64_t{1} << 20;
  auto gpu = CreateCudaDevice(probe);
  if (!gpu.ok()) {
    if (a.device == "auto") return Status::OK();
    return Status::Unavailable("--device cuda: no usable GPU " +
                               std::to_string(p->device_ordinal) + ": " +
                               std::string(gpu.status().message()));
  }
  gpu->reset();
  p->cuda = true;
  auto pcie = MeasurePcie(p->device_ordinal, kPcieBytes, kPcieRepeats);
  if (!pcie.ok()) return pcie.status().WithContext("--device cuda: PCIe reference");
  p->pcie = *pcie;
  return Status::OK();
}

// The planner's intra/inter-node rule for a ring over every rank (planner.h, ZeroPlusPlus): the
// inter-node fraction of its bytes.
double RingInterFraction(int ranks_per_node, int nodes) {
  const CommBytes one = ZeroPlusPlusComm({}, 1, 1, 0, ranks_per_node, nodes).param_gather_forward;
  return one.Total() > 0 ? one.inter_node / one.Total() : 0.0;
}

// This rank's measured bytes per step by link: the communicator over all ranks split by the
// planner's ring rule, plus the ZeRO++ sub-communicators' own (intra- or inter-node by
// construction).
CommBytes MeasuredCommSplit(const VariantResult& r, const RankFigures& f) {
  const double global =
      f.comm_bytes_per_step - f.comm_intra_bytes_per_step - f.comm_inter_bytes_per_step;
  const double frac = RingInterFraction(r.ranks_per_node, r.world_size / r.ranks_per_node);
  return CommBytes{global * (1 - frac) + f.comm_intra_bytes_per_step,
                   global * frac + f.comm_inter_bytes_per_step};
}

double Sum(const std::vector<RankFigures>& r, double RankFigures::*field) {
  double s = 0;
  for (const RankFigures& f : r) s += f.*field;
  return s;
}

// The seed's ledger: stages 0-2 move one all-reduce of the gradients per step, stage 3 the
// planner's ZeroPlusPlusComm (plain: 1.5x; with ZeRO++ its qwZ / hpZ / qgZ figures), split
// intra/inter-node by the planner's rule.
CommBytes LedgerCommBytes(const VariantResult& r) {
  const int nodes = r.world_size / r.ranks_per_node;
  if (r.variant.stage == 3) {
    ZeroPlusPlus zpp;
    zpp.quantized_weights = r.layout.quantized_weights;
    zpp.quantized_gradients = r.layout.quantized_gradients;
    zpp.hpz_partition_size = r.layout.hpz_partition_size;
    const double elt = static_cast<double>(DTypeSize(r.dtype));
    return ZeroPlusPlusComm(zpp, static_cast<double>(r.params), elt, elt, r.ranks_per_node, nodes)
        .total;
  }
  const double ar = static_cast<double>(
      RingBytes(CommOp::kAllReduce, r.params * DTypeSize(r.dtype), r.world_size));
  const double inter = ar * RingInterFraction(r.ranks_per_node, nodes);
  return CommBytes{ar - inter, inter};
}

nlohmann::json TierJson(const double* v) {
  return {{"device", v[0]}, {"host", v[1]}, {"nvme", v[2]}};
}

// The step's phases (bench_engine.h, StepPhases): each rank's mean per measured step, the
// slowest rank's seconds and all ranks' bytes; with the split paired reference, each phase's
// bytes at the disk's read and write rates of those passes (the medians over the steps of each
// pass's bytes over its read phases' and its write phases' seconds): the phase's share of the
// issue's disk_bound_s, and the phase's io_efficiency against it.
nlohmann::json PhasesJson(const VariantResult& r) {
  std::vector<double> read_rates, write_rates;
  for (size_t i = 0; i < r.paired_split_s.size(); ++i) {
    if (r.paired_split_read_s[i] > 0) {
      read_rates.push_back(r.paired_read_bytes[i] / r.paired_split_read_s[i]);
    }
    if (r.paired_split_write_s[i] > 0 && r.paired_write_bytes[i] > 0) {
      write_rates.push_back(r.paired_write_bytes[i] / r.paired_split_write_s[i]);
    }
  }
  const double read_rate = Median(read_rates), write_rate = Median(write_rates);
  nlohmann::json out = nlohmann::json::object();
  for (const StepPhaseRef& ph : kStepPhases) {
    double secs = 0;   // the slowest rank's
    PhaseFigures all;  // all ranks' sums
    for (const RankFigures& f : r.ranks) {
      const PhaseFigures& x = f.phases.*ph.field;
      secs = std::max(secs, x.seconds);
      all.AddScaled(x, 1.0);
    }
    const double rd = all.nvme_read_bytes, wr = all.nvme_write_bytes;
    // The fractions: all ranks' NVMe-busy (store-wait, host-room-wait, device-copy) time over all
    // ranks' phase time.
    const auto share = [&](double s) { return all.seconds > 0 ? s / all.seconds : 0.0; };
    nlohmann::json j = {{"seconds", secs},
                        {"nvme_read_bytes", rd},
                        {"nvme_write_bytes", wr},
                        {"nvme_bytes_per_s", secs > 0 ? (rd + wr) / secs : 0.0},
                        {"io_busy_fraction", share(all.io_busy_s)},
                        {"store_wait_fraction", share(all.store_wait_s)},
                        {"host_room_wait_fraction", share(all.host_room_wait_s)},
                        {"copy_busy_fraction", share(all.copy_busy_s)},
                        {"checksum_fraction", share(all.checksum_s)},
                        {"checksum_idle_fraction", share(all.checksum_idle_s)}};
    const bool rated = read_rate > 0 && (wr <= 0 || write_rate > 0);
    if (rated) {
      const double bound = rd / read_rate + (wr > 0 ? wr / write_rate : 0.0);
      j["disk_bound_split_s"] = bound;
      j["io_efficiency_split"] = secs > 0 ? bound / secs : 0.0;
    }
    out[ph.name] = j;
  }
  if (!read_rates.empty()) {
    out["split_read_bytes_per_s"] = read_rate;
    out["split_write_bytes_per_s"] = write_rate;
  }
  return out;
}

// On cuda, each rank's own link (one GPU per rank): the busiest rank's copies per step at the
// reference rates. The two directions have a stream each over a full-duplex link, so the bound
// is the slower direction's time.
nlohmann::json PcieJson(const VariantResult& r, double step_s) {
  double h2d = 0, d2h = 0;
  for (const RankFigures& f : r.ranks) {
    h2d = std::max(h2d, f.h2d_bytes_per_step);
    d2h = std::max(d2h, f.d2h_bytes_per_step);
  }
  const PcieReference& ref = *r.pcie;
  const auto secs = [](double bytes, double gbps) { return gbps > 0 ? bytes / (gbps * 1e9) : 0.0; };
  const double bound = std::max(secs(h2d, ref.h2d_gbps), secs(d2h, ref.d2h_gbps));
  return {{"h2d_bytes_per_step", h2d},   {"d2h_bytes_per_step", d2h},
          {"ref_h2d_gbps", ref.h2d_gbps}, {"ref_d2h_gbps", ref.d2h_gbps},
          {"bound_s", bound},            {"step_vs_bound", bound > 0 ? step_s / bound : 0.0}};
}

nlohmann::json VariantJson(const BenchEngineArgs& a, const VariantResult& r) {
  nlohmann::json j;
  j["variant"] = r.variant.Name();
  j["stage"] = r.variant.stage;
  j["offload_optimizer"] =
      OffloadDeviceName(r.fits ? r.layout.offload_optimizer : r.variant.offload_optimizer);
  j["offload_param"] = OffloadDeviceName(r.fits ? r.layout.offload_param : r.variant.offload_param);
  j["fits"] = r.fits;
  j["world_size"] = r.world_size;
  j["params"] = r.params;
  j["device"] = r.device_name;
  double planner[3] = {0, 0, 0};
  if (r.planner_bytes) {
    for (Tier t : kAllTiers) planner[static_cast<size_t>(t)] = (*r.planner_bytes)[t];
  }
  j["planner_bytes"] = r.planner_bytes ? TierJson(planner) : nlohmann::json();
  if (!r.fits) {
    j["refused"] = r.refused;
    return j;
  }
  const RankFigures& me = r.ranks.front();
  double mean = 0;
  for (double s : r.step_s) mean += s / static_cast<double>(r.step_s.size());
  j["dtype"] = DTypeName(r.dtype);
  j["gradient_accumulation_steps"] = r.gradient_accumulation_steps;
  j["steps"] = a.steps;
  j["warmup_steps"] = a.warmup_steps;
  j["overlap_step"] = a.overlap_step;
  j["speculative_step"] = a.speculative_step.empty() ? "config" : a.speculative_step;
  j["compute_ms"] = a.compute_ms;
  j["grad_norm"] = a.grad_norm;
  j["clipped_steps"] = r.clipped_steps;
  j["skipped_steps"] = r.skipped_steps;
  j["init_s"] = r.init_s;
  j["step_s"] = me.step_s;
  j["step_s_mean"] = mean;
  j["step_s_all"] = r.step_s;
  j["breakdown"] = {{"gather_wait_s", r.gather_wait_s},
                    {"reduce_wait_s", r.reduce_wait_s},
                    {"optimizer_s", r.optimizer_s},
                    {"optimizer_io_wait_s", r.optimizer_io_wait_s},
                    {"step_call_s", r.step_call_s},
                    {"compute_s", r.compute_s},
                    {"speculative_optimizer_s", r.speculative_optimizer_s},
                    {"speculated_sub_groups", r.speculated_sub_groups},
                    {"rolled_back_sub_groups", r.rolled_back_sub_groups}};
  j["stall_fraction"] = mean > 0 ? (r.gather_wait_s + r.reduce_wait_s) / mean : 0.0;
  // NVMe traffic of all ranks together: they share the disks under --nvme-path.
  const double rd = Sum(r.ranks, &RankFigures::nvme_read_bytes_per_step);
  const double wr = Sum(r.ranks, &RankFigures::nvme_write_bytes_per_step);
  j["nvme_bytes_per_step"] = rd + wr;
  j["nvme_read_bytes_per_step"] = rd;
  j["nvme_write_bytes_per_step"] = wr;
  // --disk-reference-paired-split: each measured step against the pass that followed it (read
  // phases + write phases: the step's bytes at the disk's separate read and write rates).
  std::vector<double> split_ratios;
  for (size_t i = 0; i < r.paired_split_s.size() && i < r.step_s.size(); ++i) {
    if (r.paired_split_s[i] > 0 && r.step_s[i] > 0) {
      split_ratios.push_back(r.paired_split_s[i] / r.step_s[i]);
    }
  }
  j["disk_reference_paired_split"] = {
      {"measured", !split_ratios.empty()},     {"seconds", r.paired_split_s},
      {"read_seconds", r.paired_split_read_s}, {"write_seconds", r.paired_split_write_s},
      {"read_bytes", r.paired_read_bytes},     {"write_bytes", r.paired_write_bytes},
      {"span_bytes", r.paired_span_bytes},     {"ratios", split_ratios}};
  j["io_efficiency_paired_split"] = Median(split_ratios);
  j["phases"] = PhasesJson(r);
  const CommBytes ledger_split = LedgerCommBytes(r);
  const double ledger = ledger_split.Total();
  const CommBytes measured = MeasuredCommSplit(r, me);
  j["comm_bytes_per_rank"] = me.comm_bytes_per_step;
  j["comm_wire_bytes_per_rank"] = me.comm_wire_bytes_per_step;
  j["ledger_comm_bytes_per_rank"] = ledger;
  j["comm_vs_ledger"] = ledger > 0 ? me.comm_bytes_per_step / ledger : 0.0;
  j["ranks_per_node"] = r.ranks_per_node;
  j["comm_bytes_per_rank_split"] = {{"intra_node", measured.intra_node},
                                    {"inter_node", measured.inter_node}};
  j["ledger_comm_bytes_per_rank_split"] = {{"intra_node", ledger_split.intra_node},
                                           {"inter_node", ledger_split.inter_node}};
  j["zero_pp"] = {{"quantized_weights", r.layout.quantized_weights},
                  {"quantized_gradients", r.layout.quantized_gradients},
                  {"hpz_partition_size", r.layout.hpz_partition_size},
                  {"hpz_secondary_bytes", r.layout.hpz_secondary_bytes}};
  double peak[3] = {0, 0, 0}, budget[3], plan[3];
  for (const RankFigures& f : r.ranks) {
    for (int t = 0; t < 3; ++t) peak[t] = std::max(peak[t], f.peak_bytes[t]);
  }
  for (Tier t : kAllTiers) {
    const size_t i = static_cast<size_t>(t);
    budget[i] = static_cast<double>(r.budget_bytes[i]);
    plan[i] = static_cast<double>(r.layout.state_bytes[t] + r.layout.working_bytes[t] +
                                  r.layout.cache_bytes[t]);
  }
  j["peak_bytes"] = TierJson(peak);
  j["budget_bytes"] = TierJson(budget);
  j["plan_bytes"] = TierJson(plan);
  j["pcie"] = r.pcie ? PcieJson(r, me.step_s) : nlohmann::json();
  if (r.pcie) {
    double used = 0;
    for (const RankFigures& f : r.ranks) used = std::max(used, f.device_peak_used_bytes);
    j["device_peak_used_bytes"] = used;
  }
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankFigures& f : r.ranks) {
    ranks.push_back({{"step_s", f.step_s},
                     {"peak_bytes", TierJson(f.peak_bytes)},
                     {"nvme_read_bytes_per_step", f.nvme_read_bytes_per_step},
                     {"nvme_write_bytes_per_step", f.nvme_write_bytes_per_step},
                     {"comm_bytes", f.comm_bytes_per_step},
                     {"comm_intra_node_subcomm_bytes", f.comm_intra_bytes_per_step},
                     {"comm_inter_node_subcomm_bytes", f.comm_inter_bytes_per_step},
                     {"comm_wire_bytes", f.comm_wire_bytes_per_step}});
  }
  j["ranks"] = ranks;
  j["engine_stats"] = r.engine_stats;
  j["notes"] = r.notes;
  if (!a.save_dir.empty()) j["checkpoint"] = CheckpointJson(r);
  return j;
}

std::string Gb(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", bytes / 1e9);
  return b;
}

// The device, and on cuda its PCIe traffic against the reference rates.
void PrintDevice(const nlohmann::json& j) {
  std::printf("  device %s", j["device"].get<std::string>().c_str());
  if (const auto& x = j["pcie"]; !x.is_null()) {
    std::printf(
        "; PCIe per step h2d %s GB, d2h %s GB; reference h2d %.1f GB/s, d2h %.1f GB/s: bound "
        "%.3f s, step / bound %.2f; pool peak %s GB",
        Gb(x["h2d_bytes_per_step"]).c_str(), Gb(x["d2h_bytes_per_step"]).c_str(),
        x["ref_h2d_gbps"].get<double>(), x["ref_d2h_gbps"].get<double>(),
        x["bound_s"].get<double>(), x["step_vs_bound"].get<double>(),
        Gb(j["device_peak_used_bytes"]).c_str());
  }
  std::printf("\n");
}

void PrintVariant(const nlohmann::json& j, const std::string& model) {
  std::printf("bench engine: %s, %s, %d rank(s)", j["variant"].get<std::string>().c_str(),
              model.c_str(), j["world_size"].get<int>());
  if (!j["fits"].get<bool>()) {
    std::printf("\n  does not fit: %s\n", j["refused"].get<std::string>().c_str());
    return;
  }
  std::printf(", %s, %d micro-step(s) per step, %.1f ms compute per layer use\n",
              j["dtype"].get<std::string>().c_str(), j["gradient_accumulation_steps"].get<int>(),
              j["compute_ms"].get<double>());
  PrintDevice(j);
  const auto& b = j["breakdown"];
  std::printf(
      "  step %.3f s (median of %zu; mean %.3f): gather wait %.3f, reduce wait %.3f, optimizer "
      "%.3f (IO wait %.3f), simulated compute %.3f; stall fraction %.3f\n",
      j["step_s"].get<double>(), j["step_s_all"].size(), j["step_s_mean"].get<double>(),
      b["gather_wait_s"].get<double>(), b["reduce_wait_s"].get<double>(),
      b["optimizer_s"].get<double>(), b["optimizer_io_wait_s"].get<double>(),
      b["compute_s"].get<double>(), j["stall_fraction"].get<double>());
  if (b["speculative_optimizer_s"].get<double>() > 0 ||
      b["rolled_back_sub_groups"].get<double>() > 0) {
    std::printf(
        "  speculative step: %.3f s of Adam during the backward; %.1f sub-groups kept, %.1f "
        "undone per step\n",
        b["speculative_optimizer_s"].get<double>(), b["speculated_sub_groups"].get<double>(),
        b["rolled_back_sub_groups"].get<double>());
  }
  const auto& sp = j["engine_stats"]["speculation"];
  if (sp["adaptive"].get<bool>() && sp["probes"].get<int>() > 0) {
    std::printf(
        "  speculative step timed both ways (%d probe(s)): %.3f s per step speculating, %.3f s "
        "not; the next step %s\n",
        sp["probes"].get<int>(), sp["on_s"].get<double>(), sp["off_s"].get<double>(),
        sp["next"].get<bool>() ? "speculates" : "does not speculate");
  }
  if (j["clipped_steps"].get<int>() > 0 || j["skipped_steps"].get<int>() > 0) {
    std::printf("  of %zu measured steps %d clipped (--grad-norm %.3g), %d skipped on overflow\n",
                j["step_s_all"].size(), j["clipped_steps"].get<int>(), j["grad_norm"].get<double>(),
                j["skipped_steps"].get<int>());
  }
  std::printf("  nvme %s GB/step (read %s, write %s)", Gb(j["nvme_bytes_per_step"]).c_str(),
              Gb(j["nvme_read_bytes_per_step"]).c_str(),
              Gb(j["nvme_write_bytes_per_step"]).c_str());
  if (j["disk_reference_paired_split"]["measured"].get<bool>()) {
    std::printf(
        "\n  paired, split (its reads and its writes each alone): io efficiency %.2f "
        "(median; per step",
        j["io_efficiency_paired_split"].get<double>());
    for (const auto& x : j["disk_reference_paired_split"]["ratios"]) {
      std::printf(" %.2f", x.get<double>());
    }
    std::printf(")");
  }
  std::printf("\n  phases (mean per step):");
  const char* sep = "";
  for (const StepPhaseRef& ph : kStepPhases) {
    const auto& x = j["phases"][ph.name];
    std::printf("%s %s %.3f s (NVMe read %s GB, write %s", sep, ph.name, x["seconds"].get<double>(),
                Gb(x["nvme_read_bytes"]).c_str(), Gb(x["nvme_write_bytes"]).c_str());
    if (x.contains("io_efficiency_split")) {
      std::printf("; %.2f of the split disk", x["io_efficiency_split"].get<double>());
    }
    if (x["nvme_read_bytes"].get<double>() + x["nvme_write_bytes"].get<double>() > 0) {
      std::printf("; disk busy %.2f; hashing %.3f (%.3f with the disk idle)",
                  x["io_busy_fraction"].get<double>(), x["checksum_fraction"].get<double>(),
                  x["checksum_idle_fraction"].get<double>());
    }
    std::printf("; store wait %.2f; host full %.2f; copying %.2f",
                x["store_wait_fraction"].get<double>(), x["host_room_wait_fraction"].get<double>(),
                x["copy_busy_fraction"].get<double>());
    std::printf(")");
    sep = ";";
  }
  if (j["ledger_comm_bytes_per_rank"].get<double>() > 0) {
    std::printf("\n  comm %s GB/rank/step, ledger %s (x%.3f)\n",
                Gb(j["comm_bytes_per_rank"]).c_str(), Gb(j["ledger_comm_bytes_per_rank"]).c_str(),
                j["comm_vs_ledger"].get<double>());
  } else {
    std::printf("\n  comm %s GB/rank/step (one rank: the ledger moves nothing)\n",
                Gb(j["comm_bytes_per_rank"]).c_str());
  }
  const auto& cs = j["comm_bytes_per_rank_split"];
  const auto& ls = j["ledger_comm_bytes_per_rank_split"];
  std::printf(
      "  comm by link (%d rank(s) per node): intra-node %s GB, inter-node %s GB; ledger %s, %s\n",
      j["ranks_per_node"].get<int>(), Gb(cs["intra_node"]).c_str(), Gb(cs["inter_node"]).c_str(),
      Gb(ls["intra_node"]).c_str(), Gb(ls["inter_node"]).c_str());
  const auto& zpp = j["zero_pp"];
  if (zpp["quantized_weights"].get<bool>() || zpp["quantized_gradients"].get<bool>() ||
      zpp["hpz_partition_size"].get<int>() > 1) {
    std::printf("  ZeRO++: qwZ %s, qgZ %s, hpZ %d (secondary copy %s GB)\n",
                zpp["quantized_weights"].get<bool>() ? "on" : "off",
                zpp["quantized_gradients"].get<bool>() ? "on" : "off",
                zpp["hpz_partition_size"].get<int>(), Gb(zpp["hpz_secondary_bytes"]).c_str());
  }
  std::printf("  %-7s %12s %12s %12s %12s   (GB, per rank)\n", "tier", "peak", "budget",
              "engine plan", "planner");
  for (const char* t : kTierKeys) {
    std::printf("  %-7s %12s %12s %12s %12s\n", t, Gb(j["peak_bytes"][t]).c_str(),
                Gb(j["budget_bytes"][t]).c_str(), Gb(j["plan_bytes"][t]).c_str(),
                j["planner_bytes"].is_null() ? "-" : Gb(j["planner_bytes"][t]).c_str());
  }
  if (j.contains("checkpoint")) PrintCheckpoint(j["checkpoint"]);
  for (const auto& n : j["notes"]) std::printf("  note: %s\n", n.get<std::string>().c_str());
}

std::string Triple(const nlohmann::json& t) {
  if (t.is_null()) return "-";
  return Gb(t["device"]) + "/" + Gb(t["host"]) + "/" + Gb(t["nvme"]);
}

void PrintSweep(const nlohmann::json& j, const std::string& model) {
  const auto& v0 = j["variants"].front();
  std::printf(
      "bench engine --sweep: %s, %d rank(s), device %s; memory in GB per rank (device/host/nvme)\n",
      model.c_str(), j["world_size"].get<int>(), v0["device"].get<std::string>().c_str());
  std::printf("%-34s %-5s %9s %24s %24s %24s\n", "variant", "fits", "step_s", "peak", "engine plan",
              "planner");
  for (const auto& v : j["variants"]) {
    const bool fits = v["fits"].get<bool>();
    char step[32] = "-";
    if (fits) std::snprintf(step, sizeof step, "%.3f", v["step_s"].get<double>());
    std::printf("%-34s %-5s %9s %24s %24s %24s\n", v["variant"].get<std::string>().c_str(),
                fits ? "yes" : "no", step, fits ? Triple(v["peak_bytes"]).c_str() : "-",
                fits ? Triple(v["plan_bytes"]).c_str() : "-", Triple(v["planner_bytes"]).c_str());
    if (!fits) std::printf("    does not fit: %s\n", v["refused"].get<std::string>().c_str());
  }
  if (j["recommendation"].is_null()) {
    std::printf("recommendation: none (no setting fits the budgets)\n");
  } else {
    std::printf("recommendation: %s (the fastest that fits: %.3f s/step)\n",
                j["recommendation"]["variant"].get<std::string>().c_str(),
                j["recommendation"]["step_s"].get<double>());
  }
}

int Fail(const BenchEngineArgs& a, int code, const std::string& msg) {
  return Failure("bench engine", msg, code, a.json);
}

int RunBenchEngine(const BenchEngineArgs& a) {
  auto psi = ParseParamCount(a.params);
  if (!psi.ok()) return Fail(a, kExitUsage, "--params: " + std::string(psi.status().message()));
  auto model = SyntheticModel(*psi, a.layers, a.bias_groups);
  if (!model.ok()) return Fail(a, kExitUsage, std::string(model.status().message()));
  BenchProcess p;
  if (Status s = OpenProcess(a, &p); !s.ok())
    return Fail(a, kExitInvalid, "rendezvous: " + s.ToString());
  if (Status s = ResolveDevice(a, &p); !s.ok()) return Fail(a, kExitInvalid, s.ToString());
  std::vector<EngineVariant> variants;
  if (a.sweep) {
    variants = SweepVariants(a);
  } else {
    auto v = ResolveVariant(a);
    if (!v.ok()) return Fail(a, kExitInvalid, v.status().ToString());
    variants = {*v};
  }
  const bool nvme =
      !a.nvme_paths.empty() || std::any_of(variants.begin(), variants.end(), UsesNvme);
  RunDirs dirs;
  if (nvme) {
    std::vector<std::string> bases = a.nvme_paths;
    if (bases.empty()) bases.push_back(std::filesystem::temp_directory_path().string());
    if (p.rank == 0) ReportLeftovers(bases);
    auto made = dirs.Make(bases);
    if (!made.ok()) return Fail(a, kExitInvalid, "--nvme-path: " + made.status().ToString());
    p.nvme_dirs = *made;
  }
  if (!a.save_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(a.save_dir, ec);
    if (ec) return Fail(a, kExitInvalid, "--save-dir " + a.save_dir + ": " + ec.message());
  }
  const std::string model_text = std::to_string(model->numel()) + " params in " +
                                 std::to_string(model->groups.size()) + " groups";
  nlohmann::json out;
  nlohmann::json best;
  for (const EngineVariant& v : variants) {
    auto r = RunEngineVariant(a, v, *model, p);
    if (!r.ok()) return Fail(a, kExitInvalid, v.Name() + ": " + r.status().ToString());
    if (p.rank != 0) continue;
    nlohmann::json j = VariantJson(a, *r);
    if (!a.sweep) {
      out = std::move(j);
      out["layers"] = a.layers;
      out["groups"] = model->groups.size();
      break;
    }
    if (r->fits && (best.is_null() || j["step_s"].get<double>() < best["step_s"].get<double>())) {
      best = {{"variant", j["variant"]}, {"step_s", j["step_s"]}};
    }
    out["variants"].push_back(std::move(j));
  }
  if (p.rank != 0) return kExitOk;
  bool fits;
  if (a.sweep) {
    out["world_size"] = p.world;
    out["params"] = model->numel();
    out["layers"] = a.layers;
    out["groups"] = model->groups.size();
    out["recommendation"] = best;
    fits = !best.is_null();
  } else {
    fits = out["fits"].get<bool>();
  }
  if (a.json) {
    std::printf("%s\n", out.dump(2).c_str());
  } else if (a.sweep) {
    PrintSweep(out, model_text);
  } else {
    PrintVariant(out, model_text);
  }
  return fits ? kExitOk : kExitInvalid;
}

// A COUNT that may be 0 (stage3_max_reuse_distance 0: never keep a released group).
CLI::Validator CountOrZero() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (s == "0") return {};
        auto n = ParseParamCount(s);
        return n.ok() ? std::string() : std::string(n.status().message());
      },
      "COUNT");
}

}  // namespace

void RegisterBenchEngine(CLI::App& bench, int* exit_code) {
  auto a = std::make_shared<BenchEngineArgs>();
  CLI::App* c = bench.add_subcommand(
      "engine",
      "Train a synthetic model with the real ZeRO engine (on a GPU with NCCL, or the HostDevice "
      "stand-in with Gloo: --device) and report the step time and its breakdown, stall "
      "fraction, NVMe traffic (with --disk-reference-paired-split: against the disk's own read "
      "and write rates, io efficiency), comm bytes against the ledger, peak memory per tier "
      "against the budget and the plan, and on a GPU its PCIe traffic against the link's own "
      "rates. N ranks: offloadctl launch -n N -- offloadctl bench engine ...; rank 0 prints.");
  c->add_option("--params", a->params, "Model parameters: 350M, 1.5B, 7e9 (k/M/B/T)")
      ->capture_default_str();
  c->add_option("--layers", a->layers, "Parameter groups (layers), params split evenly")
      ->check(AtLeast(1, true, true))
      ->capture_default_str();
  c->add_flag("--overlap-step", a->overlap_step,
              "Run each optimizer step behind the next forward (EngineOptions::overlap_step: "
              "stage 3 with the optimizer offloaded)");
  c->add_option("--speculative-step", a->speculative_step,
                "offload_optimizer.speculative_step over the config's: each group's Adam during "
                "the backward (default: the config's; auto: the key unset, timed both ways over "
                "the first steps, the faster kept; --warmup-steps 8 measures the choice)")
      ->check(CLI::IsMember({"on", "off", "auto"}));
  c->add_option("--speculation-buffer", a->speculation_buffer,
                "offload_optimizer.speculation_buffer_size (COUNT, k/M/B; 0: none) over the "
                "config's")
      ->check(CountOrZero());
  c->add_flag("--bias-groups", a->bias_groups,
              "Add a small bias group (sqrt(params/layers) elements, under the persistence "
              "threshold) after each layer, taken from its params");
  c->add_option("--config", a->config,
                "DeepSpeed config (ds_config.json); --stage, --offload-*, --dtype, "
                "--max-reuse-distance and --nvme-path override it")
      ->check(CLI::ExistingFile);
  CLI::Option* stage =
      c->add_option("--stage", a->stage, "ZeRO stage 0-3 (default: the config's, else 3)")
          ->check(CLI::Range(0, 3));
  CLI::Option* opt = c->add_option("--offload-optimizer", a->offload_optimizer,
                                   "Optimizer state on none, cpu or nvme (default: the config's)")
                         ->check(CLI::IsMember({"none", "cpu", "nvme"}));
  CLI::Option* par =
      c->add_option("--offload-param", a->offload_param,
                    "Parameters on none, cpu or nvme, stage 3 (default: the config's)")
          ->check(CLI::IsMember({"none", "cpu", "nvme"}));
  AddNvmePathOption(c, &a->nvme_paths,
                    "Directory for the swap files (nvme_path); repeat for several SSDs. A fresh "
                    "subdirectory per rank is made and removed in each (default: the temp dir)");
  c->add_option("--steps", a->steps, "Measured steps")
      ->check(AtLeast(1, true, true))
      ->capture_default_str();
  c->add_option("--warmup-steps", a->warmup_steps,
                "Steps before the measured ones (the first records the trace and first writes "
                "the swap files; the second is the first to prefetch and keep gathered copies "
                "by it, their memory touched for the first time; a third can still be slow on "
                "a virtual disk)")
      ->check(AtLeast(0, true, true))
      ->capture_default_str();
  c->add_option("--compute-ms", a->compute_ms,
                "Simulated compute per layer use, forward and backward each, between Gather and "
                "Release: on cuda a kernel occupying every SM that long, waited for; on the host a "
                "sleep (the GPU's time, not the CPU's) that ends that long after the layer's use "
                "began, the bench's writing of its gradient included")
      ->check(AtLeast(0))
      ->capture_default_str();
  c->add_option("--grad-norm", a->grad_norm,
                "Global norm of the synthetic gradient on each rank: below the config's "
                "gradient_clipping (the synthetic config's: 1.0) no step clips; above it every "
                "step does (with speculative_step: its rollback)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  c->add_option("--host-gb", a->host_gb,
                "Host memory budget per rank, GB (1e9 bytes); 0: what the engine's layout needs "
                "plus 16 MiB. With an NVMe tier on io_uring the whole budget is pinned at start")
      ->check(AtLeast(0))
      ->capture_default_str();
  c->add_option("--device-gb", a->device_gb,
                "Device memory budget per rank, GB: the CudaDevice pool's on cuda, the "
                "HostDevice stand-in's on the host")
      ->check(AtLeast(0, false))
      ->capture_default_str();
  c->add_option("--device", a->device,
                "cuda: the engine on this rank's GPU (LOCAL_RANK, else 0) with NCCL, and the "
                "PCIe reference; host: the HostDevice stand-in with Gloo; auto: cuda when a GPU "
                "is usable, else host")
      ->check(CLI::IsMember({"auto", "cuda", "host"}))
      ->capture_default_str();
  c->add_option("--dtype", a->dtype,
                "Precision bf16, fp16 or fp32 (default: the config's, else bf16)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  AddIoBackendOption(c, &a->io_backend);
  c->add_option("--max-reuse-distance", a->max_reuse_distance,
                "stage3_max_reuse_distance (COUNT; 0: re-gather every layer in backward, as the "
                "ledger's 1.5x assumes). Default: the config's (DeepSpeed: 1e9)")
      ->check(CountOrZero());
  c->add_flag("--disk-reference-paired-split", a->disk_reference_paired_split,
              "After each measured step, Engine::Flush and a pass over the engine's own swap "
              "files moving the step's reads in read-only phases and its writes in write-only "
              "phases (up to 1 GiB each, timed apart), every byte rewritten unchanged "
              "(nvme::RunNvmeRewrite): io_efficiency_paired_split, the median of (read phases + "
              "write phases) / step, the step's bytes at the disk's separate read and write "
              "rates at the step's minutes; it also prices each phase of the step (JSON phases: "
              "forward, backward, optimizer, each io_efficiency_split)")
      ->excludes("--overlap-step");
  c->add_flag("--qwz", a->qwz,
              "ZeRO++ qwZ (zero_quantized_weights): INT8 stage-3 parameter all-gather");
  c->add_flag("--qgz", a->qgz,
              "ZeRO++ qgZ (zero_quantized_gradients): hierarchical INT8 gradient reduce-scatter "
              "(all-to-all within the node, then across nodes)");
  c->add_option("--hpz", a->hpz,
                "ZeRO++ hpZ (zero_hpz_partition_size): a secondary 16-bit copy of 1/K of the "
                "params, so later gathers in a step stay within groups of K ranks (0: the "
                "config's)")
      ->check(AtLeast(0, true, true));
  c->add_option("--ranks-per-node", a->ranks_per_node,
                "Ranks per node for ZeRO++'s hierarchy (0: LOCAL_WORLD_SIZE, else one node)")
      ->check(AtLeast(0, true, true));
  c->add_option("--timeout-s", a->timeout_s, "Bound on every wait of the engine and collectives")
      ->check(AtLeast(0, false))
      ->capture_default_str();
  CLI::Option* sweep = c->add_flag(
      "--sweep", a->sweep,
      "Run stages 0, 2, 3 and stage 3 with the optimizer on cpu, + params on cpu, both on nvme "
      "(with --nvme-path); report each against its plan and recommend the fastest that fits");
  sweep->excludes(stage)->excludes(opt)->excludes(par);
  c->add_option("--save-dir", a->save_dir,
                "After the measured steps, run --save-repeat pairs under DIR/bench-v<N>/ (shared "
                "by the ranks), each a checkpoint (Save, then Load; timed) and a reference (every "
                "rank's stream at once, O_DIRECT with the checkpoint's chunk size, depth and size: "
                "new file, overwrite, read), in alternating order: each "
                "pair's ratio of the disk's time for the bytes moved (swap traffic too) to the "
                "checkpoint's, and the medians (docs/benchmarks.md, \"Checkpoint throughput\")");
  c->add_option("--save-repeat", a->save_repeat,
                "Reference/checkpoint pairs with --save-dir (their median is the figure)")
      ->check(AtLeast(1, true, true))
      ->capture_default_str();
  c->add_option("--keep-last", a->keep_last,
                "SaveOptions keep_last of the --save-dir saves: checkpoints kept, the new one "
                "included (0: all; the bench then removes all but `latest` between pairs, "
                "untimed). Default: the config's checkpoint.keep_last (0)")
      ->check(AtLeast(0, true, true));
  c->add_flag("--no-recycle-files", a->no_recycle_files,
              "With --keep-last: saves write new files instead of overwriting the retired "
              "checkpoint's (SaveOptions recycle_files false; default: checkpoint.recycle_files)");
  c->add_flag("--json", a->json, "Print one JSON object");
  c->callback([a, exit_code] { *exit_code = RunBenchEngine(*a); });
}

}  // namespace strata::cli
