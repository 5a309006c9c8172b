// Memory planner: the ZeRO model-state ledger and the placement of every ZeRO shard and buffer
// on the three tiers (GPU HBM, host DRAM, NVMe) for a model of Ψ parameters trained data-parallel
// on N = gpus_per_node x nodes ranks, with feasibility against capacities and a recommendation.
//
// The ledger (Rajbhandari et al., "ZeRO", SC'20) with the default recipe (bf16 params, bf16
// grads, fp32 master, fp32 Adam m and v: 16 bytes per parameter), per GPU:
//   stage 0: 16Ψ   stage 1: 4Ψ + 12Ψ/N   stage 2: 2Ψ + 14Ψ/N   stage 3: 16Ψ/N
// and in general, with p, g, o the recipe's bytes per parameter for params, grads and optimizer
// state (master + m + v): (p+g+o)Ψ, (p+g)Ψ + oΨ/N, pΨ + (g+o)Ψ/N, (p+g+o)Ψ/N.
//
// On top of the ledger the planner places what the DeepSpeed offload settings move (optimizer
// state and its gradient shard on cpu/nvme, parameters on cpu/nvme) and the buffers the config
// implies (reduce / all-gather buckets, the stage-3 gathered working set, pinned swap buffers),
// plus the caller's activation estimate. The model itself is unknown to the planner: activations
// and the largest gathered group are inputs, never guessed.
//
// Units: parameter counts and element counts are doubles (7e9), bytes are doubles. "GB" in
// printed output is 1e9 bytes (as the ZeRO ledger is usually quoted: 7e9 x 16 B = 112 GB).
//
// Thread safety: everything here is a pure function of its arguments.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/config.h"
#include "strata/status.h"
#include "strata/store.h"

namespace strata {

// OffloadDevice and OffloadDeviceName come from config.h (DeepSpeed's none | cpu | nvme).
// Accepts "none", "cpu", "nvme" (lower case only).
std::optional<OffloadDevice> ParseOffloadDevice(std::string_view s) noexcept;

// Tier and TierName come from store.h ("hbm", "host", "nvme").

// Bytes per parameter of each model state. The ledger's totals follow from these.
struct Recipe {
  std::string name = "bf16-adam";
  double param_bytes = 2;     // working params used by forward/backward (bf16)
  double grad_bytes = 2;      // gradients as reduced and handed to the optimizer (bf16)
  double master_bytes = 4;    // fp32 master copy updated by the optimizer; 0 = no master copy
  double momentum_bytes = 4;  // Adam m (exp_avg)
  double variance_bytes = 4;  // Adam v (exp_avg_sq)

  double OptimizerBytes() const { return master_bytes + momentum_bytes + variance_bytes; }
  double TotalBytes() const { return param_bytes + grad_bytes + OptimizerBytes(); }
};

// The named recipes, default first: bf16-adam (2+2+4+4+4 = 16), fp16-adam (same), fp32-grads
// (2+4+4+4+4 = 18), no-master (2+2+0+4+4 = 12), bf16-pure (2+2+0+2+2 = 8), adam8bit (2+2+4+1+1 =
// 10), fp32 (4+4+0+4+4 = 16).
const std::vector<Recipe>& KnownRecipes();
// A known recipe name, or a custom "P:G:MASTER:M:V" list of bytes per parameter (e.g.
// "2:4:4:4:4"). InvalidArgument names the problem (unknown name, bad or negative number).
Result<Recipe> ParseRecipe(std::string_view spec);

// What the machine offers. Defaults: one node of 8 x H100 80 GB, 1024 GB host DRAM, one
// 3.84 TB NVMe drive at 6 GB/s. Capacities are what the trainer may use: subtract the CUDA
// context, allocator slack and the OS yourself.
struct Capacity {
  double hbm_bytes_per_gpu = 80e9;
  double dram_bytes_per_node = 1024e9;
  double nvme_bytes_per_node = 3840e9;
  int gpus_per_node = 8;
  int nodes = 1;
  double nvme_bytes_per_s_per_node = 6e9;  // aggregate NVMe bandwidth of a node

  // N, in 64 bits: the product of two ints overflows an int (3 x 1431655766 wrapped to 2).
  int64_t Ranks() const { return int64_t{gpus_per_node} * nodes; }
};

// The most data-parallel ranks (gpus_per_node x nodes) a plan may have: far beyond any cluster,
// and low enough that every count derived from it stays exact.
inline constexpr int64_t kMaxPlanRanks = int64_t{1} << 24;

// The ZeRO and offload settings that change placement: the subset of DeepSpeed's
// zero_optimization the planner needs, with DeepSpeed's defaults. Sizes are in elements.
struct ZeroSettings {
  int stage = 0;  // 0..3
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;
  bool optimizer_pin_memory = false;  // offload_optimizer.pin_memory
  bool param_pin_memory = false;      // offload_param.pin_memory
  double optimizer_buffer_count = 4;  // offload_optimizer.buffer_count (nvme swap buffers)
  double param_buffer_count = 5;      // offload_param.buffer_count
  double param_buffer_size = 1e8;     // offload_param.buffer_size (elements)
  double max_in_cpu = 1e9;            // offload_param.max_in_cpu: validated, not planned (strata
                                      // keeps no DRAM cache of NVMe params)
  // overlap_comm; unset means DeepSpeed's default: true at stage 3, false below.
  std::optional<bool> overlap_comm;
  double reduce_bucket_size = 5e8;
  double allgather_bucket_size = 5e8;
  double prefetch_bucket_size = 5e7;  // stage3_prefetch_bucket_size
  double max_live_parameters = 1e9;   // stage3_max_live_parameters
  // Elements per optimizer sub-group (the NVMe swap unit). 0, as DeepSpeed reads it: every
  // parameter tensor is a sub-group of its own (sized from largest_group_params when given).
  double sub_group_size = 1e9;
  double gradient_accumulation_steps = 1;
};

struct PlanInput {
  double params = 0;                    // Ψ. REQUIRES > 0.
  double largest_group_params = 0;      // largest gathered group (a layer); 0 = not given
  double activation_bytes_per_gpu = 0;  // the caller's estimate, added to HBM
  double target_step_seconds = 10;      // optimizer-step time the NVMe traffic must fit in
  Recipe recipe;
  ZeroSettings zero;
  Capacity capacity;
  // True when zero.stage / offloads come from the user (config or flags): the verdict is
  // then about that setting; otherwise about the recommendation.
  bool has_configured = false;
};

// One line of a placement: a state or buffer on a tier. HBM items are per GPU; host and NVMe
// items are per node (the sum over the node's ranks).
struct PlanItem {
  Tier tier;
  std::string name;
  double bytes = 0;
  bool pinned = false;  // host items: page-locked
};

// Bytes a rank sends per optimizer step in collectives, against DDP's gradient all-reduce.
struct CommVolume {
  double bytes_per_rank = 0;      // ring algorithm: (N-1)/N x volume
  double ddp_bytes_per_rank = 0;  // DDP all-reduce of the gradients: 2 (N-1)/N gΨ
  double ratio = 0;               // bytes_per_rank / ddp (the coefficient, defined for N = 1)
};

// The placement of one (stage, offload) setting.
struct Placement {
  int stage = 0;
  OffloadDevice offload_optimizer = OffloadDevice::kNone;  // effective (after DeepSpeed rules)
  OffloadDevice offload_param = OffloadDevice::kNone;
  std::vector<PlanItem> items;
  double hbm_bytes_per_gpu = 0;
  double host_bytes_per_node = 0;
  double host_pinned_bytes_per_node = 0;
  double nvme_bytes_per_node = 0;
  CommVolume comm;
  double pcie_bytes_per_gpu = 0;         // host <-> GPU copies per optimizer step
  double nvme_io_bytes_per_node = 0;     // NVMe reads + writes per optimizer step
  double nvme_io_seconds = 0;            // at Capacity::nvme_bytes_per_s_per_node
  double nvme_required_bytes_per_s = 0;  // to fit the traffic in target_step_seconds
  bool fits_hbm = false, fits_host = false, fits_nvme = false;
  std::vector<std::string> notes;  // settings ignored or changed, and why

  bool Fits() const { return fits_hbm && fits_host && fits_nvme; }
};

struct Plan {
  PlanInput input;
  std::array<double, 4> ledger_bytes_per_gpu{};  // the ZeRO formulas, stage 0..3
  std::array<Placement, 4> stages;               // each stage under the configured offload settings
  std::optional<Placement> configured;           // input.zero as given, when input.has_configured
  // The candidates in recommendation order, each evaluated; the first that fits is chosen.
  std::vector<Placement> ladder;
  std::optional<size_t> recommended;  // index into ladder; empty when nothing fits
  // The verdict: the configured setting fits (when there is one), else something fits.
  bool fits = false;
};

// Model-state bytes per GPU of the ZeRO ledger (no offload, no buffers).
// REQUIRES: 0 <= stage <= 3, ranks >= 1.
double LedgerBytesPerGpu(const Recipe& recipe, int stage, double params, int64_t ranks);

// The placement of one setting. Follows DeepSpeed: optimizer offload needs stage >= 1,
// optimizer NVMe offload below stage 3 becomes cpu, param offload needs stage 3 (each with a note).
// REQUIRES: ValidatePlanInput(in) is OK and 0 <= stage <= 3.
Placement Place(const PlanInput& in, int stage, OffloadDevice optimizer, OffloadDevice param);

// InvalidArgument naming the field when a count is not positive, a size is negative, a stage
// is outside 0..3, gpus x nodes exceeds kMaxPlanRanks or a recipe byte count is negative. The
// fields of `zero` are named by their DeepSpeed JSON path ("zero_optimization.sub_group_size");
// a config that CheckDeepSpeedConfig accepts always passes here.
Status ValidatePlanInput(const PlanInput& in);

// The whole plan. Recommendation order: stages 0, 1, 2, 3 without offload (the lowest that
// fits); then stage 3 + optimizer on cpu; + params on cpu; then NVMe last: optimizer on nvme
// with params on cpu, then both on nvme.
Result<Plan> MakePlan(const PlanInput& in);

// Maps a parsed DeepSpeed config onto `in`: zero_optimization's stage, offload settings, buckets
// and sub_group_size, gradient_accumulation_steps, and the recipe from the precision sections
// (bf16 -> bf16-adam, fp16 -> fp16-adam, neither -> fp32). Sets in->has_configured. A value the
// planner cannot take as written ("auto" sizes, a partial offload ratio) falls back to DeepSpeed's
// default with a line appended to *notes. REQUIRES: in and notes non-null.
void ApplyEngineConfig(const EngineConfig& config, PlanInput* in, std::vector<std::string>* notes);

// Loads `path` (world size = in->capacity.Ranks(), for the batch-size rule), applies it with
// ApplyEngineConfig and appends the config's warnings to *notes. NotFound / IOError when the
// file cannot be read; InvalidArgument listing every config error.
Status ApplyDeepSpeedConfigFile(const std::string& path, PlanInput* in,
                                std::vector<std::string>* notes);

// Parses a parameter count: "7e9", "7000000000", "7B", "1.5T", "350M", "125k" (k M B/G T,
// case-insensitive). InvalidArgument for anything else or a non-positive value.
Result<double> ParseParamCount(std::string_view s);

}  // namespace strata
