// `offloadctl bench engine`: the real ZeRO engine (include/strata/engine.h) trained on a synthetic
// model, on HostDevice + Gloo or (--device cuda) CudaDevice + NCCL, with the per-step figures the
// issue asks for (issue 10, "offloadctl bench engine"). cmd_bench_engine.cc parses the flags, runs
// one setting or the sweep and prints; bench_engine_run.cc runs one setting (a "variant") and
// measures it; bench_engine_ckpt.cc its checkpoint saves and loads against the disk (--save-dir).
//
// One variant: build its DeepSpeed config (the --config file or a synthetic one, with --stage,
// --offload-*, --dtype and --max-reuse-distance applied over it), create its device and
// communicators (bench_engine_run.cc, VariantBackend), Engine::Create (ResourceExhausted on any
// rank: "does not fit", agreed by all ranks), InitParameters, then warm-up and measured steps: per
// micro-step forward Gather / simulated compute / Release over every group, backward Gather /
// GradBuffer filled with synthetic values / compute / Release / ReduceGradients in reverse order;
// Step. On cuda the gradients are cast into the buffer by the device's kernels and the compute is
// a kernel that occupies every SM (bench_gpu.h). Byte counters are deltas over the measured steps;
// every rank's figures are all-gathered to rank 0.
//
// Thread safety: none; everything runs on the calling thread (the engine's own threads aside).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/zero/checkpoint_io.h"
#include "strata/checkpoint.h"
#include "strata/comm.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/status.h"
#include "tools/offloadctl/bench_gpu.h"

namespace strata::cli {

struct BenchEngineArgs {
  std::string params = "100M";  // COUNT (k/M/B/T)
  int layers = 8;               // weight groups; params split evenly
  bool bias_groups = false;     // a small bias group after each weight group
  // EngineOptions::overlap_step: the optimizer step runs behind the next forward. The measured
  // steps then start after the warm-up's step has finished, and the last one ends when its own
  // step has (Synchronize), so they hold exactly `steps` optimizer steps and their bytes.
  bool overlap_step = false;
  // offload_optimizer.speculative_step over the config's: "on", "off" ("" = the config's: on
  // where it applies), and speculation_buffer_size (COUNT; "" = the config's).
  std::string speculative_step;
  std::string speculation_buffer;
  std::string config;             // DeepSpeed config file ("" = synthetic)
  int stage = -1;                 // -1: the config's (3 without --config)
  std::string offload_optimizer;  // "" = the config's
  std::string offload_param;      // "" = the config's
  std::vector<std::string> nvme_paths;
  int steps = 3;  // measured
  // Not measured: the first records the trace (and writes the swap file's fresh extents for the
  // first time: about half the rewrite rate on this disk), the second is the first to prefetch
  // and keep gathered copies by it (on HostDevice their first touch: +23 s on a 4B step of 55 s),
  // the third still ran 8-25 % slow in three 4B runs of four (a disk-side transient: the same IO
  // in flight at a lower rate). docs/benchmarks.md, "bench engine".
  int warmup_steps = 3;
  double compute_ms = 0;  // simulated compute per layer use (forward, backward each)
  // The synthetic gradient's global norm on each rank (before the loss scale): below the
  // synthetic config's gradient_clipping (1.0) no step clips, as in most steps of a run.
  double grad_norm = 0.5;
  double host_gb = 0;     // host budget, GB = 1e9 bytes (0: what the layout needs)
  double device_gb = 4;   // the device's budget: HostDevice's, or the CudaDevice pool's
  // auto: cuda when a CudaDevice can be created on this rank's GPU (LOCAL_RANK, else 0), else
  // host; cuda: that or an error; host: the HostDevice stand-in.
  std::string device = "auto";
  std::string dtype;      // "" = the config's precision (bf16 without --config)
  std::string io_backend = "auto";
  std::string max_reuse_distance;  // COUNT for stage3_max_reuse_distance ("" = config's)
  // After each measured step, Engine::Flush, then a pass of nvme::RunNvmeRewrite over the
  // engine's own swap files moving that step's NVMe reads and writes (its bytes unchanged) in
  // read-only and write-only phases of at least 1 GiB, timed apart: the
  // disk_bound_s, the step's reads at the disk's read rate plus its writes at its write rate, at
  // the step's minutes and on its extents. io_efficiency_paired_split is the median over steps of
  // (read phases + write phases) / step. Not with overlap_step (each pass waits for its step's
  // optimizer).
  bool disk_reference_paired_split = false;
  double timeout_s = 600;
  // ZeRO++ over the config's (docs/collectives.md, "ZeRO++"): --qwz, --qgz, --hpz K; the node size its
  // hierarchy uses (0: LOCAL_WORLD_SIZE, as `offloadctl launch` sets it).
  bool qwz = false, qgz = false;
  int hpz = 0;  // 0: the config's zero_hpz_partition_size
  int ranks_per_node = 0;
  bool sweep = false;
  bool json = false;
  // Checkpoint: after the measured steps, `save_repeat` reference/checkpoint pairs under
  // <save_dir>/bench-v<N>/ (shared by the ranks; replaced): each a disk reference and a timed
  // Save + Load, in alternating order (bench_engine_ckpt.cc) ("" = none).
  std::string save_dir;
  int save_repeat = 3;
  // The saves' retention: --keep-last / --no-recycle-files over the config's `checkpoint` section.
  std::optional<int64_t> keep_last;
  bool no_recycle_files = false;
};

// One (stage, offload) setting.
struct EngineVariant {
  int stage = 3;
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;
  // offload_optimizer.ratio for the sweep's partial offload (the config's own when unset).
  std::optional<double> optimizer_ratio;
  std::string Name() const;  // "stage 3 + opt nvme + param nvme"
};

// One phase of a training step as the trainer sees it, per measured step (the mean), one rank:
// wall time, the store's NVMe bytes in that time (IO started earlier and completing in it
// counts where it completes) and the time the store had NVMe IO in flight (StoreStats::
// io_busy_ns, added at each completion: the busy time since the previous completion counts in
// the phase where this one falls, so at most one IO's latency crosses a phase boundary).
// busy / seconds is the share of the phase the disk was working: well below 1 in a
// phase that moves bytes, the engine left the disk idle (the trainer's thread or the CPU was the
// bound); near 1 with a low io_efficiency_split, the disk was slow on the phase's pattern.
//
// store_wait_s: the time the trainer's thread was blocked on the store in the phase (EngineStats:
// gather_fetch_wait_ns + grad_lease_wait_ns + optimizer_io_wait_ns). The rest of the phase is
// CPU work: the trainer's own (the synthetic gradients, the simulated compute) and the engine's
// (gathered copies, gradient accumulation, Adam). A phase with the disk idle and little store
// wait is CPU-bound; one with the disk idle and much store wait is held by the store's own
// work (device copies, a full host budget). host_room_wait_s: the time the store had an operation
// parked for room in the host budget (StoreStats::room_wait_ns): a prefetch or a gather waiting
// for the host to drop a copy. copy_busy_s: the time the store had a device copy in flight
// (StoreStats::copy_busy_ns, added where the copies go idle). checksum_s: the IO thread's time
// computing and verifying the NVMe checksums (StoreStats::checksum_ns); checksum_idle_s, the part
// of it with no IO in flight, in which the disk waited for the hashing (checksum_idle_ns): set
// against the phase's idle disk time (seconds - io_busy_s), it is what the checksums cost there.
struct PhaseFigures {
  double seconds = 0;
  double nvme_read_bytes = 0, nvme_write_bytes = 0;
  double io_busy_s = 0;
  double store_wait_s = 0;
  double host_room_wait_s = 0;
  double copy_busy_s = 0;
  double checksum_s = 0;
  double checksum_idle_s = 0;

  // Every member, in order: the one list that sums, means and the doubles ranks exchange use.
  static constexpr double PhaseFigures::*kFields[] = {
      &PhaseFigures::seconds,     &PhaseFigures::nvme_read_bytes, &PhaseFigures::nvme_write_bytes,
      &PhaseFigures::io_busy_s,   &PhaseFigures::store_wait_s,    &PhaseFigures::host_room_wait_s,
      &PhaseFigures::copy_busy_s, &PhaseFigures::checksum_s,      &PhaseFigures::checksum_idle_s};
  // this += k * o, member by member.
  void AddScaled(const PhaseFigures& o, double k) {
    for (auto f : kFields) this->*f += k * (o.*f);
  }
};

// The phases of a step: forward (every micro-step's Gather / compute / Release over the groups),
// backward (Gather / GradBuffer / compute / Release / ReduceGradients in reverse), optimizer
// (Step; for the last measured step also Synchronize). With overlap_step the optimizer runs
// behind the next forward: its IO then falls in that forward, its wait in the Step call.
struct StepPhases {
  PhaseFigures forward, backward, optimizer;
};
// Name and member of each phase, in step order (JSON keys and the text form).
struct StepPhaseRef {
  const char* name;
  PhaseFigures StepPhases::*field;
};
inline constexpr StepPhaseRef kStepPhases[] = {{"forward", &StepPhases::forward},
                                               {"backward", &StepPhases::backward},
                                               {"optimizer", &StepPhases::optimizer}};

// What one rank measured, as rank 0 receives it (all-gathered as doubles).
struct RankFigures {
  double peak_bytes[3] = {0, 0, 0};  // device, host, nvme
  double nvme_read_bytes_per_step = 0;
  double nvme_write_bytes_per_step = 0;
  double comm_bytes_per_step = 0;       // ring bytes sent (CommStats sent_bytes)
  double comm_wire_bytes_per_step = 0;  // bytes the backend really sent
  // ZeRO++ sub-communicators (EngineStats::comm_intra / comm_inter), ring bytes sent; included
  // in comm_bytes_per_step.
  double comm_intra_bytes_per_step = 0, comm_inter_bytes_per_step = 0;
  double step_s = 0;  // median
  StepPhases phases;  // means over the measured steps
  // The device's copies (DeviceStats bytes_copied) per measured step, and its pool's peak.
  double h2d_bytes_per_step = 0, d2h_bytes_per_step = 0;
  double device_peak_used_bytes = 0;
};

// --save-dir: one reference/checkpoint pair (bench_engine_ckpt.cc).
struct CheckpointPair {
  bool reference_first = false;
  bool recycled = false;  // the save overwrote a retired checkpoint's files
  double save_s = 0, load_s = 0;
  // Swap traffic of the save and the load, all ranks (store bytes moved from and to the NVMe
  // tier): disk bytes the checkpoint moves besides its own files.
  double save_swap_read_bytes = 0, save_swap_write_bytes = 0;
  double load_swap_read_bytes = 0, load_swap_write_bytes = 0;
  // Every rank's stream at once, each of its rank file's size: total bytes / the slowest time.
  zero::ckpt::DiskReference disk;
};

struct VariantResult {
  EngineVariant variant;  // as requested
  std::string device_name;  // Device::name(): "cuda:0 (NVIDIA H200)" or "host-standin"
  // On cuda: the process's PCIe reference (BenchProcess::pcie).
  std::optional<PcieReference> pcie;
  bool fits = true;
  std::string refused;  // why it does not fit (the engine's ResourceExhausted message)
  // Set when it fits (this rank's engine).
  EngineLayout layout;
  std::vector<double> step_s;  // per measured step, wall time of the whole training step
  double gather_wait_s = 0, reduce_wait_s = 0, optimizer_s = 0, optimizer_io_wait_s = 0;
  // speculative_step: the Adam run during the backward, and the sub-groups it kept / undid.
  double speculative_optimizer_s = 0, speculated_sub_groups = 0, rolled_back_sub_groups = 0;
  // Measured steps that clipped (global norm above gradient_clipping: --grad-norm) or were
  // skipped on overflow.
  int clipped_steps = 0, skipped_steps = 0;
  double step_call_s = 0;  // Engine::Step alone (means over the measured steps)
  double compute_s = 0;    // simulated compute per step
  double init_s = 0;       // InitParameters
  size_t params = 0;       // model elements
  DType dtype = DType::kBF16;
  int world_size = 1;
  int ranks_per_node = 1;  // the node size the intra/inter split uses (--ranks-per-node / env)
  int gradient_accumulation_steps = 1;
  std::vector<RankFigures> ranks;  // rank 0: every rank's; others: their own
  std::vector<std::string> notes;
  // The planner's Place() for the same setting, per rank (HBM per GPU, host and NVMe per node /
  // ranks); unset when the planner refuses its input.
  std::optional<PerTier<double>> planner_bytes;
  uint64_t budget_bytes[3] = {0, 0, 0};
  // --save-dir: the pairs, the checkpoint's bytes (all ranks' files), the retention the saves
  // used, this rank's host peak after them (EngineStats) and its stream buffers (outside it).
  std::vector<CheckpointPair> checkpoint_pairs;
  uint64_t checkpoint_bytes = 0;
  SaveOptions save_options;
  double checkpoint_host_peak_bytes = 0, checkpoint_stream_bytes = 0;
  // The NVMe tier's IO shape (the paired split reference uses it): aio.queue_depth per rank.
  size_t io_queue_depth = 8;
  // --disk-reference-paired-split: per measured step, the pass's read phases and write phases
  // (each the slowest rank's) and their sum (the slowest rank's; 0: no pass, the step read
  // nothing from NVMe), and the bytes it moved (all ranks; each rank its own step's reads and
  // writes over its swap files).
  std::vector<double> paired_split_s, paired_split_read_s, paired_split_write_s;
  std::vector<double> paired_read_bytes, paired_write_bytes;
  double paired_span_bytes = 0;  // the swap files' whole blocks, all ranks
  // Rank 0's Engine::Stats after the measured steps, as zero::EngineStatsJson gives it.
  nlohmann::json engine_stats;
};

// What every variant of one process shares.
struct BenchProcess {
  int rank = 0, world = 1;
  std::unique_ptr<KvStore> rendezvous;  // null with one rank
  std::chrono::milliseconds timeout{600000};
  std::vector<std::string> nvme_dirs;  // this rank's run directory in each --nvme-path
  IoBackendKind io_kind = IoBackendKind::kAuto;
  int variants_run = 0;  // numbers each variant's communicator keys
  bool progress_tty = false;
  // --device resolved: cuda on GPU `device_ordinal`, with the link's reference rates measured
  // once per run; else the HostDevice stand-in.
  bool cuda = false;
  int device_ordinal = 0;
  std::optional<PcieReference> pcie;
};

// Reads the config for `v` (ParseDeepSpeedConfig of the file or the synthetic one, with the
// flags applied; "auto" values resolved as a Hugging Face trainer would, `hidden_size` for the
// bucket sizes). InvalidArgument names the config or flag at fault.
Result<ParsedConfig> BuildEngineConfig(const BenchEngineArgs& a, const EngineVariant& v,
                                       const BenchProcess& p, int64_t hidden_size);

// The synthetic model: `layers` groups "layerI" with one weight each, params split evenly (the
// remainder in the last), plus "layerI.bias" groups of sqrt(params / layers) elements when
// bias_groups (taken from the weights, so the total stays `params`).
Result<ModelSpec> SyntheticModel(double params, int layers, bool bias_groups);

// Runs `v` on every rank (collective). A setting that does not fit is a result, not an error;
// an error is anything else that stopped the engine.
Result<VariantResult> RunEngineVariant(const BenchEngineArgs& a, const EngineVariant& v,
                                       const ModelSpec& model, BenchProcess& p);

// --save-dir: what MeasureCheckpoint needs of the variant's run.
struct CheckpointBench {
  std::string dir;  // <save_dir>/bench-v<N>
  Communicator& comm;
  std::chrono::milliseconds timeout;
  zero::ckpt::StreamOptions stream;  // the engine's checkpoint streams (its aio settings)
  SaveOptions save_options;
  std::function<void(const std::string&)> say;  // progress line
};

// Runs a.save_repeat reference/checkpoint pairs (collective) into r->checkpoint_pairs.
Status MeasureCheckpoint(const BenchEngineArgs& a, const CheckpointBench& c, Engine& engine,
                         VariantResult* r);
// The "checkpoint" object of the JSON report, and its text form.
nlohmann::json CheckpointJson(const VariantResult& r);
void PrintCheckpoint(const nlohmann::json& checkpoint);

// Helpers shared by the bench engine's files. Every rank's `mine` (n doubles each), in rank
// order (collective); the median (0 for none); store bytes read from / written to the NVMe tier.
Result<std::vector<double>> AllGatherDoubles(Communicator& comm, const std::vector<double>& mine,
                                             std::chrono::milliseconds timeout);
double Median(std::vector<double> v);
uint64_t NvmeRead(const StoreStats& s);
uint64_t NvmeWrite(const StoreStats& s);

}  // namespace strata::cli
