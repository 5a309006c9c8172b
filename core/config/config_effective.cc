// The effective config as JSON in DeepSpeed's key names: every field, defaults filled in.
#include <nlohmann/json.hpp>

#include "core/config/config_reader.h"
#include "strata/config.h"

namespace strata::config {

namespace {

template <typename T>
Json AutoJson(const AutoOr<T>& v) {
  if (v.is_auto()) return "auto";
  if (!v.has_value()) return nullptr;
  return v.value();
}

Json AutoJson(const AutoOr<std::pair<double, double>>& v) {
  if (v.is_auto()) return "auto";
  if (!v.has_value()) return nullptr;
  return Json::array({v.value().first, v.value().second});
}

Json RawMap(const std::map<std::string, std::string>& m) {
  Json o = Json::object();
  for (const auto& [k, text] : m) o[k] = Json::parse(text, nullptr, false);
  return o;
}

Json Nvme(const std::string& p) { return p.empty() ? Json(nullptr) : Json(p); }

Json ZeroJson(const ZeroConfig& z) {
  const OffloadOptimizerConfig& o = z.offload_optimizer;
  const OffloadParamConfig& p = z.offload_param;
  return Json{
      {"stage", z.stage},
      {"offload_optimizer",
       {{"device", OffloadDeviceName(o.device)},
        {"nvme_path", Nvme(o.nvme_path)},
        {"buffer_count", o.buffer_count},
        {"pin_memory", o.pin_memory},
        {"pipeline_read", o.pipeline_read},
        {"pipeline_write", o.pipeline_write},
        {"fast_init", o.fast_init},
        {"ratio", o.ratio},
        {"speculative_step", o.speculative_step ? Json(*o.speculative_step) : Json("auto")},
        {"speculation_buffer_size",
         o.speculation_buffer_size < 0 ? Json("auto") : Json(o.speculation_buffer_size)}}},
      {"offload_param",
       {{"device", OffloadDeviceName(p.device)},
        {"nvme_path", Nvme(p.nvme_path)},
        {"buffer_count", p.buffer_count},
        {"buffer_size", p.buffer_size},
        {"max_in_cpu", p.max_in_cpu},
        {"pin_memory", p.pin_memory}}},
      {"overlap_comm", z.overlap_comm},
      {"contiguous_gradients", z.contiguous_gradients},
      {"reduce_scatter", z.reduce_scatter},
      {"reduce_bucket_size", AutoJson(z.reduce_bucket_size)},
      {"allgather_partitions", z.allgather_partitions},
      {"allgather_bucket_size", z.allgather_bucket_size},
      {"sub_group_size", z.sub_group_size},
      {"stage3_prefetch_bucket_size", AutoJson(z.stage3_prefetch_bucket_size)},
      {"stage3_param_persistence_threshold", AutoJson(z.stage3_param_persistence_threshold)},
      {"stage3_model_persistence_threshold", z.stage3_model_persistence_threshold},
      {"stage3_max_live_parameters", z.stage3_max_live_parameters},
      {"stage3_max_reuse_distance", z.stage3_max_reuse_distance},
      {"stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save},
      {"zero_quantized_weights", z.zero_quantized_weights},
      {"zero_quantized_gradients", z.zero_quantized_gradients},
      {"zero_hpz_partition_size", z.zero_hpz_partition_size},
  };
}

}  // namespace

Json EffectiveJson(const EngineConfig& c) {
  Json j;
  j["train_batch_size"] = AutoJson(c.train_batch_size);
  j["train_micro_batch_size_per_gpu"] = AutoJson(c.train_micro_batch_size_per_gpu);
  j["gradient_accumulation_steps"] = AutoJson(c.gradient_accumulation_steps);
  j["gradient_clipping"] = AutoJson(c.gradient_clipping);
  j["steps_per_print"] = c.steps_per_print ? Json(*c.steps_per_print) : Json(nullptr);
  j["prescale_gradients"] = c.prescale_gradients;
  j["gradient_predivide_factor"] = c.gradient_predivide_factor;
  const Fp16Config& f = c.fp16;
  j["fp16"] = {{"enabled", AutoJson(f.enabled)},
               {"auto_cast", f.auto_cast},
               {"loss_scale", f.loss_scale},
               {"initial_scale_power", f.initial_scale_power},
               {"loss_scale_window", f.loss_scale_window},
               {"hysteresis", f.hysteresis},
               {"consecutive_hysteresis", f.consecutive_hysteresis},
               {"min_loss_scale", f.min_loss_scale}};
  j["bf16"] = {{"enabled", AutoJson(c.bf16.enabled)}};
  const OptimizerConfig& o = c.optimizer;
  if (o.type == OptimizerType::kNone) {
    j["optimizer"] = nullptr;
  } else {
    Json params = {{"lr", AutoJson(o.lr)},         {"betas", AutoJson(o.betas)},
                   {"eps", AutoJson(o.eps)},       {"weight_decay", AutoJson(o.weight_decay)},
                   {"adam_w_mode", o.adam_w_mode}, {"bias_correction", o.bias_correction}};
    Json other = RawMap(o.other_params);
    for (auto it = other.begin(); it != other.end(); ++it) params[it.key()] = it.value();
    j["optimizer"] = {{"type", OptimizerTypeName(o.type)}, {"params", params}};
  }
  if (c.scheduler.type == SchedulerType::kNone) {
    j["scheduler"] = nullptr;
  } else {
    j["scheduler"] = {{"type", c.scheduler.type_name}, {"params", RawMap(c.scheduler.params)}};
  }
  const AioConfig& a = c.aio;
  j["aio"] = {{"block_size", a.block_size},
              {"queue_depth", a.queue_depth},
              {"intra_op_parallelism", a.intra_op_parallelism},
              {"single_submit", a.single_submit},
              {"overlap_events", a.overlap_events},
              {"use_gds", a.use_gds}};
  j["zero_optimization"] = ZeroJson(c.zero);
  j["checkpoint"] = {{"keep_last", c.checkpoint.keep_last},
                     {"recycle_files", c.checkpoint.recycle_files}};
  // Fields whose type cannot say "auto" (the stage, devices, paths) are marked from the list.
  for (const std::string& path : c.unresolved_auto) {
    Json* node = &j;
    std::string rest = path;
    for (size_t dot; node != nullptr && (dot = rest.find('.')) != std::string::npos;) {
      auto it = node->find(rest.substr(0, dot));
      node = it != node->end() && it->is_object() ? &*it : nullptr;
      rest = rest.substr(dot + 1);
    }
    if (node == nullptr) continue;
    if (!node->contains(rest) && node->contains("stage3_" + rest)) rest = "stage3_" + rest;
    if (node->contains(rest)) (*node)[rest] = "auto";
  }
  return j;
}

}  // namespace strata::config

namespace strata {

std::string EffectiveConfigJson(const EngineConfig& c, int indent) {
  return config::EffectiveJson(c).dump(indent);
}

}  // namespace strata
