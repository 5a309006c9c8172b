// EngineConfig: a DeepSpeed JSON config (`ds_config.json`) parsed into typed fields.
//
// strata reads the config format users already have, so an existing ZeRO-Offload / ZeRO-Infinity
// config works unchanged. The parser accepts what DeepSpeed accepts (it loads configs with hjson):
// `//`, `/* */` and `#` comments, trailing commas, numbers written as numbers or strings ("5e8"),
// booleans as strings ("true"), and the value "auto" wherever DeepSpeed accepts it (below).
// Duplicate keys are rejected, as DeepSpeed does.
// Every key below falls back to DeepSpeed's default when absent. Keys that DeepSpeed knows but
// strata does not act on are kept verbatim in `EngineConfig::unacted_keys` and listed; unknown keys
// are warnings naming the nearest known key.
//
// "auto", as DeepSpeed and the trainers treat it:
// - A key a trainer fills (the Hugging Face / Accelerate / LLaMA-Factory / axolotl convention):
//   a field Hugging Face's Trainer fills is an `AutoOr<T>`; Accelerate also fills the stage, the
//   offload devices and paths and the 16-bit gather flag, plain fields that keep their default
//   while "auto". Either way the value stays "auto" after parsing unless the caller supplies it
//   (`ParseOptions::auto_values`, `world_size`, `hidden_size`); the JSON paths still "auto" are
//   listed in `unresolved_auto` (of ParsedConfig and EngineConfig), checks that need them wait,
//   and `ParseOptions::require_resolved` makes any of them an error that names them all.
// - Any other key of a section DeepSpeed reads into one of its config models (fp16, bf16,
//   zero_optimization, offload_optimizer, offload_param): DeepSpeed drops a key whose value is
//   "auto" before validation (`DeepSpeedConfigModel`, outside its strict mode), so the field
//   takes DeepSpeed's default. strata does the same and adds a note naming the key and the value
//   used; under `ParseOptions::strict` it is an error, as in DeepSpeed's strict mode.
// - Any other key (top level, optimizer, scheduler type, aio: plain dicts whose values DeepSpeed
//   uses as given): an error.
// A value supplied through `auto_values` replaces any "auto".
//
// Errors name the JSON path and what was expected (malformed JSON: also line and column).
// Warnings say what DeepSpeed (and strata) will do instead of what the user probably meant.
//
// Thread safety: all types here are plain values; the functions are pure (LoadDeepSpeedConfig
// reads one file; `check_here` also stats the nvme paths) and may run concurrently.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/status.h"

namespace strata {

// Where an offloaded state lives. DeepSpeed's "none" | "cpu" | "nvme".
enum class OffloadDevice : uint8_t { kNone = 0, kCpu, kNvme };
std::string_view OffloadDeviceName(OffloadDevice d) noexcept;  // "none", "cpu", "nvme"

// A config value that may be written "auto" (filled by the trainer) or be absent with no default
// (the batch-size triple before it can be derived).
template <typename T>
class AutoOr {
 public:
  enum class State : uint8_t { kValue, kAuto, kAbsent };

  AutoOr() : state_(State::kAbsent), value_() {}
  AutoOr(T v) : state_(State::kValue), value_(std::move(v)) {}  // NOLINT: implicit by design
  static AutoOr Auto() {
    AutoOr a;
    a.state_ = State::kAuto;
    return a;
  }
  static AutoOr Absent() { return AutoOr(); }

  State state() const noexcept { return state_; }
  bool is_auto() const noexcept { return state_ == State::kAuto; }
  bool has_value() const noexcept { return state_ == State::kValue; }
  // REQUIRES: has_value().
  const T& value() const { return value_; }
  T value_or(T fallback) const { return has_value() ? value_ : std::move(fallback); }

  friend bool operator==(const AutoOr& a, const AutoOr& b) {
    return a.state_ == b.state_ && (a.state_ != State::kValue || a.value_ == b.value_);
  }

 private:
  State state_;
  T value_;
};

// ---------------------------------------------------------------------------------------------
// Sections. Each field: meaning; DeepSpeed's default in [brackets]; the trade-off where one exists.
// ---------------------------------------------------------------------------------------------

// `fp16`: mixed precision with fp16 params/grads and a dynamic loss scaler.
struct Fp16Config {
  AutoOr<bool> enabled = false;         // [false] "auto": the trainer's --fp16.
  bool auto_cast = false;               // [false] cast module inputs to fp16.
  double loss_scale = 0;                // [0] 0 = dynamic scaling; > 0 = this fixed scale.
  int64_t initial_scale_power = 16;     // [16] dynamic scaling starts at 2^this.
  int64_t loss_scale_window = 1000;     // [1000] steps without overflow before the scale grows.
  int64_t hysteresis = 2;               // [2] overflows tolerated before the scale shrinks.
  bool consecutive_hysteresis = false;  // [false] refill hysteresis after a clean step.
  double min_loss_scale = 1;            // [1] the scale never drops below this.
};

// `bf16` (alias `bfloat16`): bf16 params/grads, no loss scaling.
struct Bf16Config {
  AutoOr<bool> enabled = false;  // [false] "auto": the trainer's --bf16.
};

enum class OptimizerType : uint8_t { kNone = 0, kAdam, kAdamW };
std::string_view OptimizerTypeName(OptimizerType t) noexcept;  // "none", "Adam", "AdamW"

// `optimizer`: strata runs Adam/AdamW on its own SIMD CPU kernel (or on the device when the
// optimizer state is not offloaded). kNone: the section is absent (the trainer brings its own,
// e.g. `zero_allow_untested_optimizer`).
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kNone;  // type names are case-insensitive
  AutoOr<double> lr = 1e-3;                   // [1e-3]
  AutoOr<std::pair<double, double>> betas =
      std::pair<double, double>{0.9, 0.999};  // [(0.9, 0.999)]
  AutoOr<double> eps = 1e-8;                  // [1e-8]
  AutoOr<double> weight_decay = 0.0;          // [0]
  // [true] decoupled weight decay (AdamW). DeepSpeed's "Adam" defaults to true as well; "AdamW"
  // forces it true. false = classic L2-regularised Adam.
  bool adam_w_mode = true;
  bool bias_correction = true;  // [true]
  // Other `optimizer.params` keys (e.g. amsgrad, torch_adam), raw JSON text, not acted upon.
  std::map<std::string, std::string> other_params;
};

// kOther: a name DeepSpeed does not define (it then looks in torch.optim.lr_scheduler); kept.
enum class SchedulerType : uint8_t {
  kNone = 0,
  kWarmupLR,
  kWarmupDecayLR,
  kWarmupCosineLR,
  kOneCycle,
  kLRRangeTest,
  kOther
};
std::string_view SchedulerTypeName(SchedulerType t) noexcept;

// `scheduler`: the LR schedule. Its params are kept as given (raw JSON text, "auto" as "\"auto\""
// until resolved) for the trainer-side schedule.
struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  std::string type_name;                      // as written ("" when absent)
  std::map<std::string, std::string> params;  // name -> JSON text, e.g. "warmup_num_steps" -> "100"
};

// `aio`: the asynchronous NVMe IO settings (DeepSpeed: libaio; strata: io_uring).
struct AioConfig {
  int64_t block_size = 1048576;  // [1 MiB] bytes per IO request; larger = fewer syscalls.
  int64_t queue_depth = 8;       // [8] IOs in flight per thread; deeper = more NVMe parallelism.
  // [1] IO threads per operation. The old name `thread_count`, which DeepSpeed 0.19.8 no longer
  // reads, is read when this key is absent, with a note.
  int64_t intra_op_parallelism = 1;
  bool single_submit = false;  // [false] submit IOs one at a time instead of batched.
  bool overlap_events = true;  // [true] overlap submission and completion reaping.
  bool use_gds = false;        // [false] GPUDirect Storage (not used by strata).
};

// The ranges strata runs the aio values in (the swap space's IO backend, the checkpoint
// streams); a value outside runs at the nearest bound, which the config check warns about.
inline constexpr int64_t kAioMaxQueueDepth = 1024;
inline constexpr int64_t kAioMinBlockSize = 4096;
inline constexpr int64_t kAioMaxBlockSize = int64_t{64} << 20;

// `checkpoint`: DeepSpeed's section (tag_validation, load_universal, use_node_local_storage,
// parallel_write: kept unread) with strata's retention keys, which DeepSpeed ignores (it reads the
// section as a plain dict). Engine::Save without SaveOptions takes these (SaveOptionsFromConfig,
// include/strata/checkpoint.h, documents each in full).
struct CheckpointConfig {
  // [0] Checkpoints kept in the save directory after each save, the new one included; older ones
  // are removed (never `latest`'s). 0 keeps every one. Disk space against how far back a run can
  // go.
  int64_t keep_last = 0;
  // [true] With keep_last: a save that will remove the oldest checkpoint overwrites its files in
  // place instead of creating new ones (no block allocation: faster on ext4). The oldest goes
  // before the new one is complete: a crash mid-save leaves keep_last - 1 older ones.
  bool recycle_files = true;
};

// `zero_optimization.offload_optimizer`: where the fp32 master weights and Adam m, v live and
// where the Adam step runs (cpu and nvme both compute on the CPU).
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;  // [none]
  std::string nvme_path;                        // [none] REQUIRED when device = nvme.
  int64_t buffer_count = 4;                     // [4] pinned swap buffers for NVMe states.
  bool pin_memory = false;                      // [false] page-locked host copies (faster DMA,
                                                // scarce memory).
  bool pipeline_read = false;                   // [false] read sub-group i+1 during step i.
  bool pipeline_write = false;                  // [false] write sub-group i-1 during step i.
  bool fast_init = false;                       // [false] skip zero-filling NVMe state files.
  double ratio = 1.0;                           // [1.0] fraction of the optimizer state
                                                // offloaded (ZeRO-Offload++ partial offload).
  // [unset: on wherever it applies, unless EngineOptions::overlap_step] The CPU Adam of a group
  // runs during backward, as soon as its gradient is final, before the global norm and the overflow
  // check are known; a step that turns out to need clipping or skipping undoes those groups exactly
  // and redoes them (DeepSpeed's SuperOffload "speculation, then validation"; the bits never
  // change). `super_offload` is read as this key. Applies at stage 3 with the optimizer offloaded
  // (cpu or nvme); elsewhere, when asked for, a layout note.
  std::optional<bool> speculative_step;
  // [-1: auto] Elements of optimizer state whose pre-update copy (master, m, v and the working
  // params: 12 + 2 bytes each at 16-bit) the speculation may hold in host memory; groups beyond
  // it step after backward as without. auto: a quarter of the rank's offloaded elements, or all of
  // them up to 256 MiB of copies where that is more, within the host budget's room. Memory
  // against how much of the step can overlap backward.
  int64_t speculation_buffer_size = -1;
};

// `zero_optimization.offload_param` (ZeRO-3 only): where the bf16/fp16 parameter shards live.
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;  // [none]
  std::string nvme_path;                        // [none] REQUIRED when device = nvme.
  int64_t buffer_count = 5;                     // [5] pinned swap buffers for params on NVMe.
  int64_t buffer_size = 100000000;              // [1e8] elements per swap buffer.
  int64_t max_in_cpu = 1000000000;              // [1e9] param elements kept in host memory
                                                // when device = nvme.
  bool pin_memory = false;                      // [false]
};

// `zero_optimization`: the ZeRO stage and its buckets and thresholds. Sizes count elements
// (DeepSpeed's convention), not bytes.
struct ZeroConfig {
  // [0] What is sharded across the data-parallel ranks: 0 nothing (DDP), 1 optimizer state,
  // 2 + gradients, 3 + parameters. Higher stages hold less per rank; stage 3 adds 50 % traffic.
  int stage = 0;
  OffloadOptimizerConfig offload_optimizer;  // [absent = device none]
  OffloadParamConfig offload_param;          // [absent = device none] stage 3 only
  // [true at stage 3, else false] Overlap gradient reduction with backward: faster, but needs
  // room for in-flight buckets (about 4.5x reduce_bucket_size at stage 2).
  bool overlap_comm = false;
  // [true] Copy gradients into one contiguous buffer as they are produced: no fragmentation,
  // one extra copy.
  bool contiguous_gradients = true;
  bool reduce_scatter = true;  // [true] reduce-scatter instead of all-reduce for gradients.
  // [5e8] Elements reduced at a time. Larger = fewer, more efficient collectives, more memory.
  // "auto" (Hugging Face): hidden_size^2.
  AutoOr<int64_t> reduce_bucket_size = int64_t{500000000};
  bool allgather_partitions = true;  // [true] all-gather (vs. broadcasts) updated params (1-2).
  // [5e8] Elements all-gathered at a time (stages 1-2): size vs. efficiency as above.
  int64_t allgather_bucket_size = 500000000;
  // [1e9] Elements per optimizer-step unit (the NVMe swap and CPU Adam pipeline granularity).
  // Smaller = less pinned memory per step, more per-unit overhead.
  int64_t sub_group_size = 1000000000;
  // [5e7] Parameter elements fetched ahead of use (stage 3). Larger hides more latency and holds
  // more memory. "auto": 0.9 * hidden_size^2.
  AutoOr<int64_t> stage3_prefetch_bucket_size = int64_t{50000000};
  // [1e5] Parameters smaller than this stay unsharded on every rank: fewer tiny all-gathers,
  // more memory. "auto": 10 * hidden_size.
  AutoOr<int64_t> stage3_param_persistence_threshold = int64_t{100000};
  // [int64 max] Cap on the total elements kept unsharded by the persistence threshold.
  int64_t stage3_model_persistence_threshold = std::numeric_limits<int64_t>::max();
  // [1e9] Gathered parameter elements resident per GPU before releasing: memory vs. re-fetches.
  int64_t stage3_max_live_parameters = 1000000000;
  // [1e9] Do not release a parameter reused within this many elements: memory vs. re-fetches.
  int64_t stage3_max_reuse_distance = 1000000000;
  // [false] (alias gather_16bit_weights_on_model_save, deprecated
  // stage3_gather_fp16_weights_on_model_save) gather a full 16-bit state dict at save time:
  // a loadable model file, at the cost of the full model's memory on one rank.
  bool stage3_gather_16bit_weights_on_model_save = false;
  bool zero_quantized_weights = false;    // [false] ZeRO++ qwZ: int8 parameter all-gathers.
  bool zero_quantized_gradients = false;  // [false] ZeRO++ qgZ: quantized gradient reduction.
  // [1] ZeRO++ hpZ: ranks holding a secondary parameter copy (e.g. GPUs per node); 1 = off.
  // Trades memory for intra-node all-gathers.
  int64_t zero_hpz_partition_size = 1;
};

// A key DeepSpeed knows (or a known section's unknown key) that strata keeps but does not act on.
struct UnactedKey {
  std::string path;       // e.g. "wall_clock_breakdown", "zero_optimization.round_robin_gradients"
  std::string json_text;  // its value, as compact JSON
};

struct EngineConfig {
  // The batch triple: train_batch_size = micro * gradient_accumulation_steps * world_size.
  // Any two (plus the world size) determine the third; absent ones are derived when possible.
  AutoOr<int64_t> train_batch_size;                // [derived]
  AutoOr<int64_t> train_micro_batch_size_per_gpu;  // [derived]
  AutoOr<int64_t> gradient_accumulation_steps;     // [derived; 1 when only one size is given]
  AutoOr<double> gradient_clipping =
      1.0;  // [1.0, as DeepSpeed 0.19.8] 0 = no clipping; else max norm.
  // [unset, DeepSpeed's None: no progress lines] strata prints no progress lines either; the
  // Python adapter's steps_per_print() returns it.
  std::optional<int64_t> steps_per_print;
  // DeepSpeed's gradient averaging: divide each rank's gradient by the world size before the
  // reduction (prescale_gradients, or gradient_predivide_factor = world size) or the sum after it
  // (factor 1). Other factors are refused: GradientDivisionProblem.
  bool prescale_gradients = false;         // [false]
  double gradient_predivide_factor = 1.0;  // [1.0]
  Fp16Config fp16;
  Bf16Config bf16;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  AioConfig aio;
  ZeroConfig zero;
  CheckpointConfig checkpoint;
  std::vector<UnactedKey> unacted_keys;  // in document order
  // JSON paths still "auto" (as ParsedConfig::unresolved_auto). Besides the AutoOr fields,
  // Accelerate also fills zero_optimization.stage, the offload devices and nvme_paths and
  // stage3_gather_16bit_weights_on_model_save: while "auto", those plain fields hold their
  // defaults and only this list says they are not settled. Resolve before relying on them.
  std::vector<std::string> unresolved_auto;

  // Whether the key at dotted JSON `path` is still "auto" (e.g. "zero_optimization.stage").
  bool IsAuto(std::string_view path) const {
    for (const std::string& p : unresolved_auto) {
      if (p == path) return true;
    }
    return false;
  }
};

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

struct ParseOptions {
  // The data-parallel world size, for the batch-size rule. Unset: the rule is checked only when
  // all three sizes are given (then world_size = train / (micro * gas) must be a whole number).
  std::optional<int64_t> world_size;
  // Values for "auto" keys, by dotted JSON path ("train_micro_batch_size_per_gpu",
  // "optimizer.params.lr", "scheduler.params.total_num_steps"), each as JSON text ("4", "1e-4",
  // "[0.9, 0.95]", "true"). A supplied value replaces only an "auto"; it is type-checked like the
  // config itself.
  std::map<std::string, std::string> auto_values;
  // The model's hidden size: fills the three zero_optimization "auto" sizes as Hugging Face does
  // (reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h,
  // stage3_param_persistence_threshold = 10*h).
  std::optional<int64_t> hidden_size;
  // An "auto" left unresolved is an error (naming every such key) instead of being listed.
  bool require_resolved = false;
  // Whether a trainer fills the "auto" values the Hugging Face / Accelerate convention leaves to
  // it (they stay unresolved). false (a script's own deepspeed.initialize, no trainer): DeepSpeed's
  // rule applies to them too, so those in its config-model sections (zero_optimization and its
  // offload sections, fp16, bf16) are dropped and take their defaults, with a note, as
  // DeepSpeed's initialize does (ParsedConfig::dropped_auto lists them); the others stay
  // unresolved, and a config that gives no batch size at all is an error (nothing will supply
  // one; with a trainer it is a warning).
  bool trainer_fills_auto = true;
  // Every warning becomes an error.
  bool strict = false;
  // Check on this machine that each nvme_path in use exists, is a directory and is writable, and
  // report its free space (a note, a warning below `min_free_bytes`, and
  // ConfigCheck::nvme_paths). What the engine writes there depends on the model's size: the
  // planner compares it (CheckNvmeSpace, strata/planner.h).
  bool check_here = false;
  int64_t min_free_bytes = int64_t{1} << 30;  // [1 GiB] the free-space warning threshold
  // Names the config in ParseDeepSpeedConfig's error message; Load/Check*File default it to the
  // path. May be empty.
  std::string source_name;
};

struct ConfigDiagnostic {
  enum class Kind : uint8_t {
    kSyntax,  // malformed JSON (line, column set)
    kDuplicateKey,
    kType,      // wrong type / unparsable value
    kRange,     // out of range (stage 4, negative size, ...)
    kConflict,  // fp16 and bf16 both on, batch sizes that do not multiply out, ...
    kUnresolvedAuto,
    kUnsupported,  // valid DeepSpeed that strata cannot run (another optimizer type)
    kUnknownKey,
    kDeprecated,
    kIgnored,  // accepted, but has no effect (offload_param below stage 3, ...)
    kCase,     // a name in another case ("None")
    kMachine,  // --here checks: nvme_path missing, not writable, little free space
  };
  Kind kind;
  std::string path;     // dotted JSON path ("zero_optimization.offload_param.device"); "" = root
  std::string message;  // what is wrong and what was expected / what will happen instead
  int line = 0;         // 1-based, of the key at `path` (or the nearest enclosing one, or
  int column = 0;       // the malformed token); 0 = unknown (a key that is absent)
  // "path (line L, column C): message"; parts that are unknown are left out. Path and message
  // pass through PrintableText: a key may hold any character, NUL and escapes included.
  std::string ToString() const;
};
std::string_view DiagnosticKindName(ConfigDiagnostic::Kind k) noexcept;

// `text` fit for a terminal or a log line: control characters (C0, DEL, C1) and bytes that are not
// UTF-8 are written as \xNN, everything else is kept. For printing keys and paths of a config,
// which JSON lets hold any character ("a\u0000b" would otherwise print as "a").
std::string PrintableText(std::string_view text);

struct ParsedConfig {
  EngineConfig config;
  std::vector<ConfigDiagnostic> warnings;    // empty under strict (they became errors)
  std::vector<std::string> unresolved_auto;  // JSON paths still "auto", in document order
  // Information, not findings (as ConfigCheck::notes): an "auto" dropped as DeepSpeed drops it
  // and the default used, the old aio name `thread_count`, free space under check_here.
  std::vector<std::string> notes;
  // The config as JSON after comment stripping and "auto" substitution (compact), for re-parsing
  // with more values.
  std::string normalized_json;
  // JSON paths whose "auto" was dropped as DeepSpeed drops it (the field took its default): a
  // config without them means the same.
  std::vector<std::string> dropped_auto;
};

// Everything a check found, valid or not. `parsed` is set when there are no errors.
// An nvme_path in use, checked on this machine (ParseOptions::check_here).
struct NvmePathSpace {
  std::string key;  // "zero_optimization.offload_optimizer.nvme_path" or ".offload_param."
  std::string dir;
  int64_t free_bytes = 0;  // statvfs: f_bavail x f_frsize
  uint64_t filesystem = 0;  // stat's st_dev: directories on one filesystem share its free space
};

struct ConfigCheck {
  std::vector<ConfigDiagnostic> errors;
  std::vector<ConfigDiagnostic> warnings;
  std::optional<ParsedConfig> parsed;
  // Information, not findings: each "auto" dropped as DeepSpeed drops it ("<path>: ... DeepSpeed's
  // default <value> applies"), the old aio name `thread_count`, free space under check_here.
  std::vector<std::string> notes;
  // Under check_here: each nvme_path in use that is a writable directory, in the order of the
  // keys above (one entry per key, also where both name the same directory).
  std::vector<NvmePathSpace> nvme_paths;
  bool ok() const { return errors.empty(); }
};

// Parses and validates `text` (a DeepSpeed config). Never fails as a call: all findings are in
// the returned ConfigCheck.
ConfigCheck CheckDeepSpeedConfig(std::string_view text, const ParseOptions& options = {});

// As CheckDeepSpeedConfig; InvalidArgument when there is any error, its message listing every
// error, one per line.
Result<ParsedConfig> ParseDeepSpeedConfig(std::string_view text, const ParseOptions& options = {});

// Reads `path` and parses it (source_name defaults to path). NotFound: no such file; IOError: it
// cannot be read (errno in the message); InvalidArgument: a directory, a file over 16 MiB, or (as
// ParseDeepSpeedConfig) an invalid config.
Result<ParsedConfig> LoadDeepSpeedConfig(const std::string& path, const ParseOptions& options = {});
// Reads `path` and checks it; a read failure is returned as Status (as LoadDeepSpeedConfig).
Result<ConfigCheck> CheckDeepSpeedConfigFile(const std::string& path,
                                             const ParseOptions& options = {});

// Re-checks an earlier result with more values (typically: parsed at startup, resolved once the
// trainer knows world size, batch sizes and hidden size). Values already substituted stay; the
// warnings are recomputed. InvalidArgument as ParseDeepSpeedConfig.
Result<ParsedConfig> ResolveDeepSpeedConfig(const ParsedConfig& parsed,
                                            const ParseOptions& options);

// The effective config (every field, defaults filled, "auto" where unresolved) as pretty JSON in
// DeepSpeed's key names.
std::string EffectiveConfigJson(const EngineConfig& config, int indent = 2);

// Rules that need more than one key or the world size, shared by `offloadctl config check` /
// CheckDeepSpeedConfig (when ParseOptions::world_size is known) and the engine (Engine::Create),
// so that a config the check accepts is not refused at start. Each returns "" when the config is
// fine, else the message (its JSON path first).
//
// ZeRO++ (qwZ, qgZ, hpZ) below stage 3: DeepSpeed ignores these keys there; strata refuses them,
// since they would not do what they say. `hpz_partition_size` 1 is off.
std::string ZeroPlusPlusStageProblem(int64_t stage, bool quantized_weights,
                                     bool quantized_gradients, int64_t hpz_partition_size);
// gradient_predivide_factor other than 1 or the world size (without prescale_gradients): strata
// divides before or after the reduction, nothing in between.
std::string GradientDivisionProblem(bool prescale_gradients, double gradient_predivide_factor,
                                    int64_t world_size);

}  // namespace strata
