#include "core/config/config_keys.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <vector>

namespace strata::config {

namespace {

using K = std::string_view;

// Top level. Known-but-unread keys follow DeepSpeed's runtime/constants.py and the feature
// configs it loads (monitor, profiling, compression, ...).
constexpr std::array kTopActed = {
    K("train_batch_size"),
    // the Python adapter's: its loader, its monitors
    K("dataloader_drop_last"), K("tensorboard"), K("csv_monitor"), K("wandb"), K("log_level"),
    K("train_micro_batch_size_per_gpu"), K("gradient_accumulation_steps"), K("gradient_clipping"),
    K("steps_per_print"), K("fp16"), K("bf16"), K("bfloat16"), K("optimizer"), K("scheduler"),
    K("aio"), K("zero_optimization"), K("checkpoint"), K("prescale_gradients"),
    K("gradient_predivide_factor")};
constexpr std::array kTopKnown = {K("wall_clock_breakdown"),
                                  K("memory_breakdown"),
                                  K("zero_allow_untested_optimizer"),
                                  K("zero_force_ds_cpu_optimizer"),
                                  K("sparse_gradients"),
                                  K("amp"),
                                  K("activation_checkpointing"),
                                  K("flops_profiler"),
                                  K("comet"),
                                  K("comms_logger"),
                                  K("communication_data_type"),
                                  K("seq_parallel_communication_data_type"),
                                  K("dump_state"),
                                  K("elasticity"),
                                  K("pipeline"),
                                  K("data_types"),
                                  K("data_efficiency"),
                                  K("curriculum_learning"),
                                  K("compression_training"),
                                  K("autotuning"),
                                  K("nebula"),
                                  K("disable_allgather"),
                                  K("eigenvalue"),
                                  K("progressive_layer_drop"),
                                  K("quantize_training"),
                                  K("sparse_attention"),
                                  K("load_universal_checkpoint"),
                                  K("use_node_local_storage"),
                                  K("graph_harvesting"),
                                  K("torch_autocast"),
                                  K("hybrid_engine"),
                                  K("timers"),
                                  K("weight_quantization"),
                                  K("compile"),
                                  K("tensor_parallel"),
                                  K("deepcompile"),
                                  K("use_data_before_expert_parallel_"),
                                  K("mics_shard_size"),
                                  K("fp8"),
                                  K("zenflow"),
                                  K("managed_gradient_accumulation"),
                                  K("gradient_allreduce_op"),
                                  K("datastates"),
                                  K("vocabulary_size"),
                                  K("expert_parallel"),
                                  K("optimizer_legacy_fusion")};

constexpr std::array kFp16Acted = {K("enabled"),
                                   K("auto_cast"),
                                   K("loss_scale"),
                                   K("initial_scale_power"),
                                   K("loss_scale_window"),
                                   K("hysteresis"),
                                   K("consecutive_hysteresis"),
                                   K("min_loss_scale")};
constexpr std::array kFp16Known = {K("fp16_master_weights_and_grads")};
constexpr std::array kBf16Acted = {K("enabled")};
constexpr std::array kBf16Known = {K("immediate_grad_update"), K("check_grad_overflow"),
                                   K("bf16_master_weights_and_grads"), K("bf16_optimizer_states")};
constexpr std::array kOptimizerActed = {K("type"), K("params")};
constexpr std::array kOptimizerKnown = {K("legacy_fusion")};
// optimizer.params: the keyword arguments of DeepSpeed's Adam and AdamW (FusedAdam,
// DeepSpeedCPUAdam, torch.optim.Adam(W) with torch_adam); another name is a TypeError there.
constexpr std::array kOptimizerParamsActed = {
    K("lr"), K("betas"), K("eps"), K("weight_decay"), K("adam_w_mode"), K("bias_correction")};
constexpr std::array kOptimizerParamsKnown = {
    K("torch_adam"), K("amsgrad"),      K("set_grad_none"), K("fp32_optimizer_states"),
    K("foreach"),    K("fused"),        K("capturable"),    K("differentiable"),
    K("maximize"),   K("max_grad_norm")};
constexpr std::array kSchedulerActed = {K("type"), K("params")};
constexpr std::array kNone = std::array<K, 0>{};
constexpr std::array kAioActed = {K("block_size"),   K("queue_depth"),   K("intra_op_parallelism"),
                                  K("thread_count"), K("single_submit"), K("overlap_events"),
                                  K("use_gds")};
constexpr std::array kAioKnown = {K("io_backend")};
// strata's retention keys, then DeepSpeed's own (runtime/config.py get_checkpoint_params).
constexpr std::array kCheckpointActed = {K("keep_last"), K("recycle_files")};
constexpr std::array kCheckpointKnown = {K("tag_validation"), K("load_universal"),
                                         K("use_node_local_storage"), K("parallel_write")};

constexpr std::array kZeroActed = {K("stage"),
                                   K("offload_optimizer"),
                                   K("offload_param"),
                                   K("overlap_comm"),
                                   K("contiguous_gradients"),
                                   K("reduce_scatter"),
                                   K("reduce_bucket_size"),
                                   K("allgather_partitions"),
                                   K("allgather_bucket_size"),
                                   K("sub_group_size"),
                                   K("stage3_prefetch_bucket_size"),
                                   K("prefetch_bucket_size"),
                                   K("stage3_param_persistence_threshold"),
                                   K("param_persistence_threshold"),
                                   K("stage3_model_persistence_threshold"),
                                   K("model_persistence_threshold"),
                                   K("stage3_max_live_parameters"),
                                   K("max_live_parameters"),
                                   K("stage3_max_reuse_distance"),
                                   K("max_reuse_distance"),
                                   K("stage3_gather_16bit_weights_on_model_save"),
                                   K("gather_16bit_weights_on_model_save"),
                                   K("stage3_gather_fp16_weights_on_model_save"),
                                   K("zero_quantized_weights"),
                                   K("zero_quantized_gradients"),
                                   K("zero_hpz_partition_size"),
                                   K("cpu_offload"),
                                   K("cpu_offload_param"),
                                   K("cpu_offload_use_pin_memory"),
                                   K("leaf_module")};  // the Python adapter's (strata.zero)
constexpr std::array kZeroKnown = {K("load_from_fp32_weights"),
                                   K("elastic_checkpoint"),
                                   K("round_robin_gradients"),
                                   K("ignore_unused_parameters"),
                                   K("legacy_stage1"),
                                   K("use_multi_rank_bucket_allreduce"),
                                   K("zero_quantized_nontrainable_weights"),
                                   K("mics_shard_size"),
                                   K("mics_hierarchical_params_gather"),
                                   K("memory_efficient_linear"),
                                   K("pipeline_loading_checkpoint"),
                                   K("override_module_apply"),
                                   K("log_trace_cache_warnings"),
                                   K("stage3_module_granularity_threshold"),
                                   K("module_granularity_threshold"),
                                   K("stage3_use_all_reduce_for_fetch_params"),
                                   K("use_all_reduce_for_fetch_params"),
                                   K("zeropp_loco_param"),
                                   K("allgather_sequential"),
                                   K("stage3_allgather_sequential"),
                                   K("partition_stream_chunk_size"),
                                   K("stage3_partition_stream_chunk_size"),
                                   K("enable_sanity_checks"),
                                   K("save_muon_momentum_buffer_in_memory"),
                                   K("zenflow")};
constexpr std::array kOffloadOptActed = {K("device"),
                                         K("nvme_path"),
                                         K("buffer_count"),
                                         K("pin_memory"),
                                         K("pipeline_read"),
                                         K("pipeline_write"),
                                         K("fast_init"),
                                         K("ratio"),
                                         K("speculative_step"),
                                         K("super_offload"),
                                         K("speculation_buffer_size")};
constexpr std::array kOffloadOptKnown = {K("pipeline"), K("cpuadam_cores_perc"),
                                         K("convert_grad_on_cpu")};
constexpr std::array kOffloadParamActed = {K("device"),      K("nvme_path"),  K("buffer_count"),
                                           K("buffer_size"), K("max_in_cpu"), K("pin_memory")};

// The Python adapter's monitors (DeepSpeed's monitor/config.py models, which forbid other keys).
constexpr std::array kFileMonitorActed = {K("enabled"), K("output_path"), K("job_name")};
constexpr std::array kWandbActed = {K("enabled"), K("team"), K("group"), K("project")};

const SectionKeys kTop{kTopActed, kTopKnown, false};
const SectionKeys kFp16{kFp16Acted, kFp16Known, true};
const SectionKeys kBf16{kBf16Acted, kBf16Known, true};
const SectionKeys kOptimizer{kOptimizerActed, kOptimizerKnown, false};
const SectionKeys kOptimizerParams{kOptimizerParamsActed, kOptimizerParamsKnown, false};
const SectionKeys kScheduler{kSchedulerActed, kNone, false};
const SectionKeys kAio{kAioActed, kAioKnown, false};
const SectionKeys kCheckpoint{kCheckpointActed, kCheckpointKnown, false};
const SectionKeys kZero{kZeroActed, kZeroKnown, true};
const SectionKeys kOffloadOpt{kOffloadOptActed, kOffloadOptKnown, true};
const SectionKeys kOffloadParam{kOffloadParamActed, kNone, true};
const SectionKeys kFileMonitor{kFileMonitorActed, kNone, true};
const SectionKeys kWandb{kWandbActed, kNone, true};

}  // namespace

const SectionKeys* KeysOf(std::string_view p) {
  if (p.empty()) return &kTop;
  if (p == "fp16") return &kFp16;
  if (p == "bf16" || p == "bfloat16") return &kBf16;
  if (p == "optimizer") return &kOptimizer;
  if (p == "optimizer.params") return &kOptimizerParams;
  if (p == "scheduler") return &kScheduler;
  if (p == "aio") return &kAio;
  if (p == "checkpoint") return &kCheckpoint;
  if (p == "zero_optimization") return &kZero;
  if (p == "zero_optimization.offload_optimizer") return &kOffloadOpt;
  if (p == "zero_optimization.offload_param") return &kOffloadParam;
  if (p == "tensorboard" || p == "csv_monitor") return &kFileMonitor;
  if (p == "wandb") return &kWandb;
  return nullptr;
}

size_t EditDistance(std::string_view a, std::string_view b, size_t at_most) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    size_t row_min = cur[0];
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
      row_min = std::min(row_min, cur[j]);
    }
    // Values along a path never decrease: a row above the bound keeps the result above it.
    if (row_min > at_most) return row_min;
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

namespace {

// The '_'-separated words of a key, sorted: "comm_overlap" and "overlap_comm" have the same.
std::vector<std::string_view> Words(std::string_view key) {
  std::vector<std::string_view> words;
  size_t start = 0;
  while (start <= key.size()) {
    size_t end = key.find('_', start);
    if (end == std::string_view::npos) end = key.size();
    if (end > start) words.push_back(key.substr(start, end - start));
    start = end + 1;
  }
  std::sort(words.begin(), words.end());
  return words;
}

size_t Diff(size_t a, size_t b) { return a > b ? a - b : b - a; }

}  // namespace

std::string Suggest(const SectionKeys& keys, std::string_view key) {
  if (key.size() > kMaxSuggestKeyBytes) return "";
  std::string lower(key);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // Only a key with a '_' can be another key's words reordered (else it would be that key).
  const bool has_words = lower.find('_') != std::string::npos;
  const std::vector<std::string_view> words =
      has_words ? Words(lower) : std::vector<std::string_view>{};
  const size_t limit = std::max<size_t>(2, key.size() / 3);
  std::string best;
  size_t best_d = SIZE_MAX;
  auto consider = [&](std::string_view k) {
    const bool contains =
        lower.size() >= 4 && (lower.size() <= k.size() ? k.find(lower) != std::string_view::npos
                                                       : lower.find(k) != std::string::npos);
    size_t d = SIZE_MAX;
    if (has_words && Words(k) == words) {
      d = 1;
    } else if (contains || Diff(lower.size(), k.size()) <= limit) {
      // The distance is at least the difference in length: the rest can never be close. A
      // containing key is accepted at any distance, so its distance is computed in full.
      d = EditDistance(lower, k, contains ? SIZE_MAX : limit);
    }
    if ((d <= limit || contains) && d < best_d) {
      best_d = d;
      best = std::string(k);
    }
  };
  for (K k : keys.acted) consider(k);
  for (K k : keys.known) consider(k);
  return best;
}

}  // namespace strata::config
