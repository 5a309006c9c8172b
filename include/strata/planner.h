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
// state and its gradient shard on cpu/nvme, parameters on cpu/nvme) and the buffers strata's
// engine allocates for them (pinned swap buffers; on the GPU the engine's working set, by the
// engine's own rule sched::DeviceWorkingSet: per-group gradient buffers, the stage-3 gathered
// groups and param shards the step's trace keeps by stage3_max_reuse_distance, capped by
// stage3_max_live_parameters), the host cache of NVMe-homed blocks the DRAM capacity (the
// engines' host budgets) leaves room for (sched::HostCacheBytes), plus the caller's activation
// estimate. strata reduces and gathers per group, so DeepSpeed's reduce / all-gather buckets are
// not allocated and DeepSpeed's own bucket figures (4.5 x buckets at stages 1-2) do not apply.
// The model itself is unknown to the planner: activations and the largest gathered group are
// inputs; without the largest group, groups are taken as reduce_bucket_size elements (DeepSpeed's
// largest reduction unit), and the plan says so.
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
  // The devices compute on their own memory (a GPU's kernels). false: memory the host addresses
  // (strata's HostDevice stand-in), where the engine runs device-resident optimizer state on the
  // CPU, with no buffers for the device's kernels (sched::DeviceWorkingInput::device_kernels).
  bool device_kernels = true;

  // N, in 64 bits: the product of two ints overflows an int (3 x 1431655766 wrapped to 2).
  int64_t Ranks() const { return int64_t{gpus_per_node} * nodes; }
};

// The most data-parallel ranks (gpus_per_node x nodes) a plan may have: far beyond any cluster,
// and low enough that every count derived from it stays exact.
inline constexpr int64_t kMaxPlanRanks = int64_t{1} << 24;
// The most parameters a plan may have (a quadrillion): every byte count derived from it stays
// exact in 64 bits (beyond about 1e18 they saturated, and the verdict with them).
inline constexpr double kMaxPlanParams = 1e15;
// The most bytes per parameter a recipe may give one state (fp64 is 8): with kMaxPlanParams every
// state's bytes stay exact in 64 bits.
inline constexpr double kMaxRecipeBytes = 64;

// ZeRO++ (Wang et al., "ZeRO++", arXiv:2306.10209): the three stage-3 communication reductions,
// as DeepSpeed's zero_optimization keys name them. They act at stage 3 only.
//
// The wire scheme, the contract between this model and the engine (core/zero) that implements
// it. Ψ parameters, N ranks, L = gpus_per_node ranks per node (ranks ordered by node: rank r is
// on node r / L), p and g the recipe's 16-bit param and grad bytes (2), B the quantization block
// (kernels/quantize.h: INT8 values plus one fp32 scale per block, so 1 + 4/B bytes per element).
// All figures are bytes one rank receives (= sends: every collective here is symmetric) in one
// forward + backward (a micro-step), averaged over ranks.
//   Plain stage 3: ring all-gather of the params in forward and again in backward, ring
//     reduce-scatter of the grads: (N-1)/N pΨ + (N-1)/N pΨ + (N-1)/N gΨ.
//   qwZ (quantized_weights): every param all-gather moves each rank's shard as INT8 + scales:
//     (N-1)/N Ψ(1 + 4/B) instead of (N-1)/N pΨ. The receiver dequantizes to 16 bits.
//   hpZ (hpz_partition_size = k > 1; k divides N): the first gather of a parameter group in a step
//     (forward) is the global one above (quantized when qwZ) and also fills the rank's secondary
//     copy: the 16-bit 1/k slice of the group owned within its k-rank group (consecutive ranks).
//     Later gathers of the group in the same step (backward) all-gather within the k-rank group
//     only, 16-bit: (k-1)/k pΨ, all intra-node when k <= L. Costs pΨ/k of HBM per rank.
//   qgZ (quantized_gradients), INT8 (DeepSpeed's default is INT4; strata uses INT8): hierarchical
//     reduce-scatter. Each rank quantizes its gradient, all-to-all within its node (L ranks),
//     dequantizes and sums in fp32, re-quantizes its 1/L part, all-to-all across the N/L ranks
//     with the same local index, dequantizes and sums in fp32: its Ψ/N shard. Intra-node
//     (L-1)/L Ψ(1 + 4/B), inter-node (N/L-1)/(N/L) (Ψ/L)(1 + 4/B).
// Intra- vs inter-node bytes of a ring over m ranks ordered by node: each of the m links carries
// the same bytes, and the ring crosses a node boundary on m/L of its m links when it spans more
// than one node (none otherwise). So per rank on average a fraction 1/L of a ring's bytes is
// inter-node (all of it when L = 1), and the job's inter-node total is N times the per-rank
// figure. (In a real ring the last rank of each node sends all its bytes inter-node and the
// others none; the per-link bytes, which a slow link sees, are what this counts.)
inline constexpr double kZeroPlusPlusBlock = 4096;  // = kernels::kQuantBlock

struct ZeroPlusPlus {
  bool quantized_weights = false;     // zero_optimization.zero_quantized_weights (qwZ)
  bool quantized_gradients = false;   // zero_optimization.zero_quantized_gradients (qgZ)
  int64_t hpz_partition_size = 1;     // zero_optimization.zero_hpz_partition_size (hpZ); 1 = off
  double block = kZeroPlusPlusBlock;  // elements per INT8 block (one fp32 scale each)

  bool Any() const { return quantized_weights || quantized_gradients || hpz_partition_size > 1; }
};

// Bytes one rank receives (averaged over ranks, see ZeroPlusPlus), split by the link they cross.
struct CommBytes {
  double intra_node = 0;
  double inter_node = 0;
  double Total() const { return intra_node + inter_node; }
};

// The stage-3 collectives of one micro-step under ZeRO++ settings (all off: plain stage 3).
struct Stage3Comm {
  CommBytes param_gather_forward;   // first all-gather of each group (global; INT8 with qwZ)
  CommBytes param_gather_backward;  // second (within the hpZ group with hpZ, else global)
  CommBytes grad_reduce_scatter;    // ring (16-bit), or qgZ's two all-to-alls (INT8)
  CommBytes total;
  double hpz_secondary_bytes_per_gpu = 0;  // pΨ/k with hpZ, else 0
};

// The model above. REQUIRES: params > 0, param_bytes and grad_bytes >= 0, gpus_per_node >= 1,
// nodes >= 1, zpp.block > 0, and zpp.hpz_partition_size dividing gpus_per_node x nodes (when > 1).
Stage3Comm ZeroPlusPlusComm(const ZeroPlusPlus& zpp, double params, double param_bytes,
                            double grad_bytes, int gpus_per_node, int nodes);

// The ZeRO and offload settings that change placement: the subset of DeepSpeed's
// zero_optimization the planner needs, with DeepSpeed's defaults. Sizes are in elements.
struct ZeroSettings {
  int stage = 0;  // 0..3
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;
  bool optimizer_pin_memory = false;  // offload_optimizer.pin_memory
  bool param_pin_memory = false;      // offload_param.pin_memory
  double optimizer_buffer_count = 4;  // offload_optimizer.buffer_count (nvme swap buffers)
  // offload_optimizer.speculative_step (unset: on) and speculation_buffer_size (< 0: auto): the
  // rollback copies' host item (sched::SpeculationBufferBytes) where the optimizer is offloaded.
  bool speculative_step = true;
  // The key was given: its room never goes to the host cache (sched::SpeculationRoomCaches).
  bool speculative_step_given = false;
  double speculation_buffer_size = -1;
  // offload_optimizer.ratio: the share of the optimizer offloaded at stage 3 (partial offload:
  // sched::DeviceResidentSubGroups keeps the rest on the device).
  double optimizer_ratio = 1.0;
  double param_buffer_count = 5;      // offload_param.buffer_count
  double param_buffer_size = 1e8;     // offload_param.buffer_size (elements)
  double max_in_cpu = 1e9;            // offload_param.max_in_cpu: validated, not planned (the
                                      // host cache is what the budget leaves: HostCacheBytes)
  // overlap_comm; unset means DeepSpeed's default: true at stage 3, false below.
  std::optional<bool> overlap_comm;
  // The size of a group when PlanInput::largest_group_params is not given (strata allocates no
  // bucket of this size: it reduces per group).
  double reduce_bucket_size = 5e8;
  double allgather_bucket_size = 5e8;  // validated, not planned (strata gathers per group)
  double prefetch_bucket_size = 5e7;   // stage3_prefetch_bucket_size: how far ahead, not bytes held
  double max_live_parameters = 1e9;    // stage3_max_live_parameters: caps the gathered groups kept
  // stage3_max_reuse_distance: a released group used again within this many gathered elements
  // stays on the device (with max_live, sets the stage-3 groups kept: sched::Stage3Peak).
  double max_reuse_distance = 1e9;
  double param_persistence_threshold = 1e5;  // stage3_param_persistence_threshold
  double model_persistence_threshold = 9.2e18;  // stage3_model_persistence_threshold (no cap)
  // Elements per optimizer sub-group (the NVMe swap unit). 0, as DeepSpeed reads it: every
  // parameter tensor is a sub-group of its own (sized from largest_group_params when given).
  double sub_group_size = 1e9;
  double gradient_accumulation_steps = 1;
  // ZeRO++ (stage 3 only; ignored with a note below). hpZ's secondary copy is an HBM item.
  ZeroPlusPlus zero_plus_plus;
};

struct PlanInput {
  double params = 0;                    // Ψ. REQUIRES > 0.
  // Parameters that train (the rest are frozen: a fine-tune's base weights, stored as working
  // params only, with no gradient, master or Adam state). 0 = all of params; REQUIRES <= params.
  double trainable_params = 0;
  double largest_group_params = 0;      // largest gathered group (a layer); 0 = not given (taken
                                        // as zero.reduce_bucket_size, never more than params)
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

// Bytes a rank sends per optimizer step (one micro-step) in collectives, against DDP's gradient
// all-reduce. Stage 3 follows ZeroPlusPlusComm (ZeRO++ included when configured); intra/inter
// split as described at ZeroPlusPlus (rings: 1/L of the bytes inter-node when nodes > 1).
struct CommVolume {
  double bytes_per_rank = 0;      // ring algorithm: (N-1)/N x volume
  double ddp_bytes_per_rank = 0;  // DDP all-reduce of the gradients: 2 (N-1)/N gΨ
  // bytes_per_rank / ddp. For N = 1 (nothing moves) the ratio the same setting has on 2 ranks of
  // one node without hpZ: the coefficient of the formulas.
  double ratio = 0;
  CommBytes split;  // bytes_per_rank by link
  double ddp_inter_node_bytes_per_rank = 0;
  bool zero_plus_plus = false;  // stage 3 with some ZeRO++ setting on
};

// The placement of one (stage, offload) setting.
struct Placement {
  int stage = 0;
  OffloadDevice offload_optimizer = OffloadDevice::kNone;  // effective (after DeepSpeed rules)
  OffloadDevice offload_param = OffloadDevice::kNone;
  // Partial optimizer offload (sched::DeviceResidentSubGroups): the ratio applied (1: all of the
  // offloaded optimizer, or no offload) and the share of the sub-groups' elements offloaded.
  double optimizer_ratio = 1.0;
  double optimizer_offloaded_fraction = 1.0;
  std::vector<PlanItem> items;
  double hbm_bytes_per_gpu = 0;
  double host_bytes_per_node = 0;
  double host_pinned_bytes_per_node = 0;
  // Of host_bytes_per_node, the store's cache of NVMe-homed blocks: what the host capacity
  // (the engine's budget) leaves beyond the working set, at most the NVMe-homed bytes
  // (sched::HostCacheBytes). The working set is host_bytes_per_node minus this.
  double host_cache_bytes_per_node = 0;
  double nvme_bytes_per_node = 0;
  // Of nvme_bytes_per_node, the params at offload_param.nvme_path; the rest (the optimizer
  // state and its gradients) is at offload_optimizer.nvme_path.
  double nvme_param_bytes_per_node = 0;
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
// `optimizer_ratio`: offload_optimizer.ratio (partial offload at stage 3).
Placement Place(const PlanInput& in, int stage, OffloadDevice optimizer, OffloadDevice param,
                double optimizer_ratio = 1.0);

// InvalidArgument naming the field when a count is not positive, a size is negative, a stage
// is outside 0..3, gpus x nodes exceeds kMaxPlanRanks or a recipe byte count is negative. The
// fields of `zero` are named by their DeepSpeed JSON path ("zero_optimization.sub_group_size");
// a config that CheckDeepSpeedConfig accepts always passes here.
Status ValidatePlanInput(const PlanInput& in);

// The whole plan. Recommendation order: stages 0, 1, 2, 3 without offload (the lowest that
// fits); then stage 3 + optimizer on cpu; + params on cpu; then NVMe last: optimizer on nvme
// with params on cpu, then both on nvme.
Result<Plan> MakePlan(const PlanInput& in);

// One reading of a DeepSpeed config's ZeRO settings, shared by the memory planner
// (ApplyEngineConfig) and the engine (Engine::Create), so that both act on the same values and
// defaults: the precision, zero_optimization's stage, offload devices, buffers, stage-3 limits,
// sub_group_size and ZeRO++, and gradient_accumulation_steps. A value left "auto" takes
// DeepSpeed's default and is listed in `defaulted` (and in `notes`, in words); the engine refuses
// those it acts on (`sizes_engine`), the planner plans with the defaults.
struct ResolvedZero {
  struct Defaulted {
    std::string path;   // the JSON path, e.g. "zero_optimization.stage3_prefetch_bucket_size"
    bool sizes_engine;  // false for keys the engine allocates nothing by (reduce_bucket_size)
  };
  DType dtype = DType::kF32;  // bf16 if enabled, else fp16 if enabled, else fp32
  bool precision_conflict = false;  // fp16 and bf16 both enabled (the engine refuses it)
  Recipe recipe;                    // the planner's ledger for dtype
  ZeroSettings zero;
  bool stage_auto = false;  // zero_optimization.stage "auto": no stage is configured
  std::vector<Defaulted> defaulted;
  std::vector<std::string> notes;  // the planner's remarks (defaults taken, partial offload)
};
ResolvedZero ResolveZeroSettings(const EngineConfig& config);

// Maps a parsed DeepSpeed config onto `in` by ResolveZeroSettings: zero_optimization's stage, offload settings, buckets
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

// `offloadctl config check --here --params N` and strata.check_config(check_here=True,
// params=N): compares each nvme_path's free space (check->nvme_paths, measured under
// ParseOptions::check_here) with what the engine puts there for a model of `params` parameters
// trained by `ranks` ranks, all counted as on this machine: the configured setting's placement
// (Place: the optimizer state with its gradients and the params, striped evenly over the distinct
// nvme_paths as the engine's swap space lays them out, each filesystem compared once with the
// shares of the paths on it: NvmePathSpace::filesystem). The engine allocates its swap
// files whole when it starts, so less free is a warning naming the key and both figures (an
// error when `strict`, as ParseOptions::strict makes the checks' warnings); each path that has
// room gets a note. Nothing is compared (a note says why) where the config has errors, its stage
// is "auto", or the placement puts nothing on NVMe. REQUIRES: params > 0, ranks >= 1, check
// non-null.
void CheckNvmeSpace(double params, int64_t ranks, bool strict, ConfigCheck* check);

// Parses a parameter count: "7e9", "7000000000", "7B", "1.5T", "350M", "125k" (k M B/G T,
// case-insensitive). InvalidArgument for anything else or a non-positive value.
Result<double> ParseParamCount(std::string_view s);

}  // namespace strata
