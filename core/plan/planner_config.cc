// ResolveZeroSettings: a DeepSpeed config's ZeRO settings as the planner and the engine take them,
// and ApplyEngineConfig, which hands them to the planner.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "strata/config.h"
#include "strata/planner.h"
#include "sched/placement.h"

namespace strata {
namespace {

// Reads the "auto"-able size at `path`: its value, else (absent or "auto") DeepSpeed's default;
// an "auto" is recorded.
template <typename T>
double SizeOr(const AutoOr<T>& v, double fallback, const char* path, bool sizes_engine,
              ResolvedZero* r) {
  if (v.has_value()) return static_cast<double>(v.value());
  if (v.is_auto()) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%g", fallback);
    r->defaulted.push_back({path, sizes_engine});
    r->notes.push_back(std::string(path) + " is \"auto\": planned with " + buf);
  }
  return fallback;
}

// The working dtype, and the planner's recipe for it: the engine's widths per state
// (sched::StateElementBytes; gradients on the wire in the working dtype).
void ResolvePrecision(const EngineConfig& c, ResolvedZero* r) {
  const bool bf16 = c.bf16.enabled.value_or(false), fp16 = c.fp16.enabled.value_or(false);
  r->precision_conflict = bf16 && fp16;
  if (c.fp16.enabled.is_auto()) r->defaulted.push_back({"fp16.enabled", true});
  if (c.bf16.enabled.is_auto()) r->defaulted.push_back({"bf16.enabled", true});
  if (bf16) {
    r->dtype = DType::kBF16;
  } else if (fp16) {
    r->dtype = DType::kF16;
  } else if (c.bf16.enabled.is_auto() || c.fp16.enabled.is_auto()) {
    r->dtype = DType::kBF16;
    r->notes.push_back("bf16/fp16 enabled is \"auto\": planned as bf16-adam (16 B/param)");
  } else {
    r->dtype = DType::kF32;
    r->notes.push_back(
        "neither bf16 nor fp16 is enabled: planned as fp32 training (20 B/param: fp32 params, "
        "gradients, master, m and v)");
  }
  if (r->precision_conflict) r->notes.push_back("fp16 and bf16 are both enabled: planned as bf16");
  auto width = [&](StateKind k) {
    return static_cast<double>(sched::StateElementBytes(k, r->dtype));
  };
  r->recipe = Recipe{std::string(DTypeName(r->dtype)) + "-adam",
                     width(StateKind::kParam16),
                     static_cast<double>(DTypeSize(r->dtype)),
                     width(StateKind::kMaster32),
                     width(StateKind::kExpAvg),
                     width(StateKind::kExpAvgSq)};
}

}  // namespace

ResolvedZero ResolveZeroSettings(const EngineConfig& c) {
  ResolvedZero r;
  ResolvePrecision(c, &r);
  const ZeroConfig& z = c.zero;
  // An "auto" size takes the default the config reader gives an absent key (DeepSpeed's).
  const ZeroConfig d;
  ZeroSettings& s = r.zero;
  s.stage = z.stage;
  s.offload_optimizer = z.offload_optimizer.device;
  s.offload_param = z.offload_param.device;
  s.optimizer_pin_memory = z.offload_optimizer.pin_memory;
  s.param_pin_memory = z.offload_param.pin_memory;
  s.optimizer_buffer_count = static_cast<double>(z.offload_optimizer.buffer_count);
  s.speculative_step = sched::SpeculationOn(z.offload_optimizer.speculative_step, false);
  s.speculative_step_given = z.offload_optimizer.speculative_step.has_value();
  s.speculation_buffer_size = static_cast<double>(z.offload_optimizer.speculation_buffer_size);
  s.optimizer_ratio = z.offload_optimizer.ratio;
  s.param_buffer_count = static_cast<double>(z.offload_param.buffer_count);
  s.param_buffer_size = static_cast<double>(z.offload_param.buffer_size);
  s.max_in_cpu = static_cast<double>(z.offload_param.max_in_cpu);
  s.overlap_comm = z.overlap_comm;
  // strata reduces per group: the bucket size only stands in for the planner's largest group.
  s.reduce_bucket_size =
      SizeOr(z.reduce_bucket_size, static_cast<double>(d.reduce_bucket_size.value()), "zero_optimization.reduce_bucket_size", false, &r);
  s.allgather_bucket_size = static_cast<double>(z.allgather_bucket_size);
  s.prefetch_bucket_size = SizeOr(z.stage3_prefetch_bucket_size,
                                  static_cast<double>(d.stage3_prefetch_bucket_size.value()),
                                  "zero_optimization.stage3_prefetch_bucket_size", true, &r);
  s.max_live_parameters = static_cast<double>(z.stage3_max_live_parameters);
  s.max_reuse_distance = static_cast<double>(z.stage3_max_reuse_distance);
  s.param_persistence_threshold =
      SizeOr(z.stage3_param_persistence_threshold,
             static_cast<double>(d.stage3_param_persistence_threshold.value()),
             "zero_optimization.stage3_param_persistence_threshold", true, &r);
  s.model_persistence_threshold = static_cast<double>(z.stage3_model_persistence_threshold);
  s.sub_group_size = static_cast<double>(z.sub_group_size);
  s.zero_plus_plus.quantized_weights = z.zero_quantized_weights;
  s.zero_plus_plus.quantized_gradients = z.zero_quantized_gradients;
  s.zero_plus_plus.hpz_partition_size = z.zero_hpz_partition_size;
  s.gradient_accumulation_steps =
      SizeOr(c.gradient_accumulation_steps, 1, "gradient_accumulation_steps", true, &r);
  r.stage_auto = c.IsAuto("zero_optimization.stage");
  return r;
}

void ApplyEngineConfig(const EngineConfig& c, PlanInput* in, std::vector<std::string>* notes) {
  ResolvedZero r = ResolveZeroSettings(c);
  in->recipe = r.recipe;
  in->zero = r.zero;
  notes->insert(notes->end(), r.notes.begin(), r.notes.end());
  // Accelerate writes "auto" for the stage and the offload devices and fills them from its own
  // settings. Their defaults must not pass for a choice: an "auto" stage leaves the setting
  // open (the verdict covers the recommendation, unless --stage picks one), an "auto" device is
  // planned as none.
  if (r.stage_auto) {
    notes->push_back(
        "zero_optimization.stage is \"auto\": no stage is configured, so the verdict is about "
        "the recommendation; pass --stage to check one");
  }
  for (const char* path :
       {"zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device"}) {
    if (c.IsAuto(path)) {
      notes->push_back(std::string(path) +
                       " is \"auto\": planned as none; pass --offload-optimizer / "
                       "--offload-param to check an offload");
    }
  }
  in->has_configured = !r.stage_auto;
}

Status ApplyDeepSpeedConfigFile(const std::string& path, PlanInput* in,
                                std::vector<std::string>* notes) {
  ParseOptions options;
  options.world_size = in->capacity.Ranks();
  STRATA_ASSIGN_OR_RETURN(ParsedConfig parsed, LoadDeepSpeedConfig(path, options));
  for (const ConfigDiagnostic& w : parsed.warnings) notes->push_back("config: " + w.ToString());
  ApplyEngineConfig(parsed.config, in, notes);
  return Status::OK();
}

void CheckNvmeSpace(double params, int64_t ranks, bool strict, ConfigCheck* check) {
  if (check->nvme_paths.empty()) return;
  auto skip = [check](const std::string& why) {
    check->notes.push_back("nvme_path free space not compared with the model's state: " + why);
  };
  if (!check->ok() || !check->parsed) return skip("the config has errors");
  PlanInput in;
  in.params = params;
  in.capacity.gpus_per_node = ranks;
  in.capacity.nodes = 1;
  std::vector<std::string> ignored;
  ApplyEngineConfig(check->parsed->config, &in, &ignored);
  if (!in.has_configured) return skip("zero_optimization.stage is \"auto\"");
  if (Status st = ValidatePlanInput(in); !st.ok()) return skip(std::string(st.message()));
  const Placement p = Place(in, in.zero.stage, in.zero.offload_optimizer, in.zero.offload_param,
                            in.zero.optimizer_ratio);
  if (p.nvme_bytes_per_node <= 0) {
    return skip("stage " + std::to_string(p.stage) +
                " with these offload devices puts nothing on NVMe");
  }
  auto bytes = [](double v) { return std::to_string(static_cast<int64_t>(std::ceil(v))); };
  const std::string who = bytes(params) + " parameters on " + std::to_string(ranks) +
                          (ranks == 1 ? " rank" : " ranks, all counted as on this machine");
  // The engine stripes its swap files evenly over the distinct nvme_paths (nvme/swap_space.h):
  // each holds an equal share of everything on NVMe. One comparison per filesystem (directories
  // on it share its free space), under the first key that names it.
  const std::vector<NvmePathSpace>& paths = check->nvme_paths;
  std::vector<std::string> dirs;
  std::string all;  // what is on NVMe
  for (const NvmePathSpace& at : paths) {
    if (std::find(dirs.begin(), dirs.end(), at.dir) == dirs.end()) dirs.push_back(at.dir);
    const bool param = at.key.find(".offload_param.") != std::string::npos;
    all += std::string(all.empty() ? "" : " and ") +
           (param ? "the params" : "the optimizer state with its gradients");
  }
  auto same_fs = [](const NvmePathSpace& a, const NvmePathSpace& b) {
    return a.dir == b.dir || (a.filesystem != 0 && a.filesystem == b.filesystem);
  };
  for (size_t i = 0; i < paths.size(); ++i) {
    bool seen = false;
    for (size_t j = 0; j < i; ++j) seen = seen || same_fs(paths[j], paths[i]);
    if (seen) continue;
    std::vector<std::string> here;  // the distinct directories on this filesystem
    for (const NvmePathSpace& at : paths) {
      if (same_fs(at, paths[i]) && std::find(here.begin(), here.end(), at.dir) == here.end()) {
        here.push_back(at.dir);
      }
    }
    const double need =
        p.nvme_bytes_per_node * static_cast<double>(here.size()) / static_cast<double>(dirs.size());
    std::string where = "'" + here[0] + "'";
    for (size_t k = 1; k < here.size(); ++k) where += " and '" + here[k] + "'";
    if (here.size() > 1) where += " (one filesystem)";
    const std::string what = here.size() == dirs.size()
                                 ? all
                                 : std::to_string(here.size()) + "/" + std::to_string(dirs.size()) +
                                       " of the swap files striped over the nvme_paths (" + all +
                                       ")";
    const NvmePathSpace& path = paths[i];
    const std::string holds = what + " for " + who;
    if (need <= static_cast<double>(path.free_bytes)) {
      check->notes.push_back(path.key + ": " + where + " holds " + bytes(need) + " bytes (" +
                             holds + ") of its " + std::to_string(path.free_bytes) + " bytes free");
      continue;
    }
    ConfigDiagnostic d{ConfigDiagnostic::Kind::kMachine, path.key,
                       where + " needs " + bytes(need) + " bytes (" + holds +
                           "; the engine allocates its swap files whole when it starts) but has " +
                           std::to_string(path.free_bytes) + " bytes free"};
    if (strict || ranks == 1) {
      // One rank: exactly what this machine's engine allocates, so the run cannot start.
      if (ranks > 1) d.message += " (an error under --strict)";
      check->errors.push_back(std::move(d));
    } else {
      d.message += " (a warning: other ranks may run on other machines; an error under --strict)";
      check->warnings.push_back(std::move(d));
    }
  }
}

}  // namespace strata
