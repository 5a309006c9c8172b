// Checks across keys of a DeepSpeed config (batch sizes, precision, offload vs. stage, NVMe
// paths) and the checks of this machine (--here).
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "core/config/config_reader.h"
#include "core/zero/lr_schedule.h"

namespace strata::config {

using Kind = ConfigDiagnostic::Kind;

namespace {

std::string I(int64_t v) { return std::to_string(v); }

// train_batch_size = micro * gas * world_size (DeepSpeed's _set_batch_related_parameters): any
// two (with the world size) determine the third; only one given means gas = 1.
void CheckBatch(Reader& r, EngineConfig& c, Json* root) {
  AutoOr<int64_t>& t = c.train_batch_size;
  AutoOr<int64_t>& m = c.train_micro_batch_size_per_gpu;
  AutoOr<int64_t>& g = c.gradient_accumulation_steps;
  const std::optional<int64_t> w = r.options().world_size;
  auto set = [&](AutoOr<int64_t>& field, const char* key, int64_t value) {
    if (field.is_auto()) r.MarkResolved(key);
    field = value;
    (*root)[key] = value;
  };
  int autos = t.is_auto() + m.is_auto() + g.is_auto();
  int values = t.has_value() + m.has_value() + g.has_value();
  if (autos > 1 || (autos == 1 && (values < 2 || !w))) return;  // left to the trainer
  std::string ws = w ? I(*w) : "";
  if (values == 3) {
    int64_t mg = m.value() * g.value();
    if (w && t.value() != mg * *w) {
      r.Error(Kind::kConflict, "train_batch_size",
              "train_batch_size " + I(t.value()) + " != train_micro_batch_size_per_gpu " +
                  I(m.value()) + " * gradient_accumulation_steps " + I(g.value()) +
                  " * world_size " + ws + " = " + I(mg * *w));
    } else if (!w && t.value() % mg != 0) {
      r.Error(Kind::kConflict, "train_batch_size",
              "train_batch_size " + I(t.value()) +
                  " is not a multiple of "
                  "train_micro_batch_size_per_gpu * gradient_accumulation_steps = " +
                  I(mg) + ": no world size multiplies out");
    }
    return;
  }
  if (t.has_value() && m.has_value()) {  // gas = t / (m * w)
    if (!w) {
      if (t.value() % m.value() != 0) {
        r.Error(Kind::kConflict, "train_batch_size",
                "train_batch_size " + I(t.value()) +
                    " is not a multiple of train_micro_batch_size_per_gpu " + I(m.value()));
      }
      return;
    }
    if (t.value() % (m.value() * *w) != 0) {
      r.Error(Kind::kConflict, "train_batch_size",
              "train_batch_size " + I(t.value()) +
                  " is not divisible by "
                  "train_micro_batch_size_per_gpu " +
                  I(m.value()) + " * world_size " + ws + ": no whole gradient_accumulation_steps");
      return;
    }
    set(g, "gradient_accumulation_steps", t.value() / (m.value() * *w));
  } else if (t.has_value() && g.has_value()) {  // micro = t / (g * w)
    if (!w) {
      if (t.value() % g.value() != 0) {
        r.Error(Kind::kConflict, "train_batch_size",
                "train_batch_size " + I(t.value()) +
                    " is not a multiple of gradient_accumulation_steps " + I(g.value()));
      }
      return;
    }
    if (t.value() % (g.value() * *w) != 0) {
      r.Error(Kind::kConflict, "train_batch_size",
              "train_batch_size " + I(t.value()) +
                  " is not divisible by "
                  "gradient_accumulation_steps " +
                  I(g.value()) + " * world_size " + ws +
                  ": no whole train_micro_batch_size_per_gpu");
      return;
    }
    set(m, "train_micro_batch_size_per_gpu", t.value() / (g.value() * *w));
  } else if (m.has_value() && g.has_value()) {
    if (w) set(t, "train_batch_size", m.value() * g.value() * *w);
  } else if (t.has_value()) {
    if (!g.is_auto()) g = int64_t{1};
    if (!w) return;
    if (t.value() % *w != 0) {
      r.Error(Kind::kConflict, "train_batch_size",
              "train_batch_size " + I(t.value()) + " is not divisible by world_size " + ws);
      return;
    }
    set(m, "train_micro_batch_size_per_gpu", t.value() / *w);
  } else if (m.has_value()) {
    if (!g.is_auto()) g = int64_t{1};
    if (w) set(t, "train_batch_size", m.value() * *w);
  } else if (r.options().require_resolved) {
    // Configs written for a trainer (Hugging Face) often leave all three to it.
    r.Error(Kind::kUnresolvedAuto, "train_batch_size",
            "neither train_batch_size nor train_micro_batch_size_per_gpu is given or supplied; "
            "DeepSpeed needs one of them to derive the others");
  } else if (autos == 0 && !r.options().trainer_fills_auto) {
    // A script's own initialize: nothing will supply them (DeepSpeed's
    // _set_batch_related_parameters refuses the config too).
    r.Error(Kind::kUnresolvedAuto, "train_batch_size",
            "neither train_batch_size nor train_micro_batch_size_per_gpu is given; DeepSpeed "
            "needs one of them (\"Either train_batch_size or train_micro_batch_size_per_gpu "
            "needs to be provided\")");
  } else if (autos == 0) {
    r.Warn(Kind::kUnresolvedAuto, "train_batch_size",
           "neither train_batch_size nor train_micro_batch_size_per_gpu is given: "
           "strata.initialize refuses the config, as DeepSpeed does; give one, or set them to "
           "\"auto\" for a trainer (the Hugging Face Trainer, accelerate) to fill");
  }
}

void CheckOffload(Reader& r, EngineConfig& c) {
  ZeroConfig& z = c.zero;
  const std::string zo = "zero_optimization.offload_optimizer";
  const std::string zp = "zero_optimization.offload_param";
  if (z.offload_optimizer.device == OffloadDevice::kNvme && z.offload_optimizer.nvme_path.empty() &&
      !r.IsUnresolved(zo + ".nvme_path")) {
    r.Error(Kind::kConflict, zo + ".nvme_path",
            "device \"nvme\" needs nvme_path: the directory for the optimizer swap files");
  }
  if (z.offload_param.device == OffloadDevice::kNvme && z.offload_param.nvme_path.empty() &&
      !r.IsUnresolved(zp + ".nvme_path")) {
    r.Error(Kind::kConflict, zp + ".nvme_path",
            "device \"nvme\" needs nvme_path: the directory for the parameter swap files");
  }
  // accelerate's DeepSpeedPlugin writes the string "none" where no path was given (DeepSpeed
  // then creates ./none).
  auto placeholder = [&](OffloadDevice device, const std::string& path, const std::string& key,
                         const char* plugin) {
    if (device != OffloadDevice::kNvme || path != "none") return;
    r.Error(Kind::kConflict, key + ".nvme_path",
            "\"none\" is accelerate's placeholder for a path not given: set the NVMe directory "
            "(DeepSpeedPlugin(" +
                std::string(plugin) + "=...), or the config's nvme_path)");
  };
  placeholder(z.offload_optimizer.device, z.offload_optimizer.nvme_path, zo,
              "offload_optimizer_nvme_path");
  placeholder(z.offload_param.device, z.offload_param.nvme_path, zp, "offload_param_nvme_path");
  // With the stage still "auto" (Accelerate fills it) nothing stage-dependent can be judged yet.
  if (r.IsUnresolved("zero_optimization.stage")) return;
  if (z.offload_optimizer.ratio < 1.0 && z.stage != 3 &&
      z.offload_optimizer.device != OffloadDevice::kNone) {
    r.Error(Kind::kConflict, zo + ".ratio",
            "partial optimizer offload (ratio < 1) needs ZeRO stage 3, the stage is " + I(z.stage));
  }
  if (z.offload_param.device != OffloadDevice::kNone && z.stage < 3) {
    r.Warn(Kind::kIgnored, zp + ".device",
           "parameter offload needs ZeRO stage 3; at stage " + I(z.stage) +
               " it is ignored and parameters stay on the GPU");
    z.offload_param.device = OffloadDevice::kNone;
  }
  if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0) {
    r.Warn(Kind::kIgnored, zo + ".device",
           "optimizer offload needs ZeRO stage 1 or above; at stage 0 it is ignored");
    z.offload_optimizer.device = OffloadDevice::kNone;
  } else if (z.offload_optimizer.device == OffloadDevice::kNvme && z.stage < 3) {
    r.Warn(Kind::kIgnored, zo + ".device",
           "NVMe optimizer offload needs ZeRO stage 3; at stage " + I(z.stage) +
               " DeepSpeed offloads the optimizer state to CPU memory instead (read as "
               "\"cpu\")");
    z.offload_optimizer.device = OffloadDevice::kCpu;
  }
}

}  // namespace

namespace {

// Keys that only matter for NVMe, given in an offload section whose device is cpu: DeepSpeed
// ignores them, which may not be what the user meant.
void CheckNvmeOnlyKeys(Reader& r, const Json* root, const char* section, OffloadDevice device,
                       std::initializer_list<const char*> keys) {
  const std::string path = std::string("zero_optimization.") + section;
  if (device != OffloadDevice::kCpu || r.IsUnresolved(path + ".device")) return;
  auto zero = root->find("zero_optimization");
  if (zero == root->end() || !zero->is_object()) return;
  auto sec = zero->find(section);
  if (sec == zero->end() || !sec->is_object()) return;
  for (const char* key : keys) {
    auto it = sec->find(key);
    if (it == sec->end() || it->is_null()) continue;
    r.Warn(Kind::kIgnored, path + "." + key,
           std::string(key) + " only applies to device \"nvme\"; with \"cpu\" it is ignored");
  }
}

// zero_optimization.leaf_module (DeepSpeed's ZeRO-3 leaf modules, which the Python adapter
// applies: strata.zero.apply_leaf_module_config): an object whose classes, names and
// name_suffixes are each a string or a list of strings.
void CheckLeafModule(Reader& r, const Json* root) {
  auto zero = root->find("zero_optimization");
  if (zero == root->end() || !zero->is_object()) return;
  auto leaf = zero->find("leaf_module");
  if (leaf == zero->end() || leaf->is_null() || (leaf->is_string() && *leaf == "auto")) return;
  const std::string path = "zero_optimization.leaf_module";
  if (!leaf->is_object()) {
    r.Error(Kind::kType, path,
            "expected an object with \"classes\", \"names\" or \"name_suffixes\", got " +
                std::string(JsonTypeName(*leaf)));
    return;
  }
  for (auto it = leaf->begin(); it != leaf->end(); ++it) {
    const std::string key = path + "." + it.key();
    if (it.key() != "classes" && it.key() != "names" && it.key() != "name_suffixes") {
      r.Error(Kind::kUnknownKey, key, "not a leaf_module key (classes, names, name_suffixes)");
      continue;
    }
    const Json& v = it.value();
    bool ok = v.is_string() || v.is_array();
    for (size_t i = 0; ok && v.is_array() && i < v.size(); ++i) ok = v[i].is_string();
    if (!ok) r.Error(Kind::kType, key, "expected a string or a list of strings");
  }
}

// DeepSpeed's 16-bit master weights, gradients and optimizer states (bf16 / fp16 sections): read,
// not acted on. strata keeps fp32 masters, gradients and Adam moments, whose bytes the plan and
// the budget checks count; a run sized for the smaller state needs to know before it is refused.
void CheckLowPrecisionStates(Reader& r, const EngineConfig& c, const Json* root) {
  const std::string counted =
      "; 'offloadctl plan' and the engine's budget checks count those bytes";
  const std::string master =
      "strata keeps fp32 master weights (4 bytes per parameter, not 2) and accumulates gradients "
      "in fp32" +
      counted;
  const char* bf16 = root->contains("bf16") ? "bf16" : "bfloat16";
  const struct {
    bool enabled;
    const char* section;
    const char* key;
    std::string why;
  } keys[] = {{c.bf16.enabled.value_or(false), bf16, "bf16_master_weights_and_grads", master},
              {c.bf16.enabled.value_or(false), bf16, "bf16_optimizer_states",
               "strata keeps Adam's moments in fp32 (8 bytes per parameter, not 4)" + counted},
              {c.fp16.enabled.value_or(false), "fp16", "fp16_master_weights_and_grads", master}};
  for (const auto& k : keys) {
    auto sec = root->find(k.section);
    if (!k.enabled || sec == root->end() || !sec->is_object()) continue;
    auto it = sec->find(k.key);
    if (it == sec->end() || !it->is_boolean() || !it->get<bool>()) continue;
    r.Warn(Kind::kIgnored, std::string(k.section) + "." + k.key, k.why);
  }
}

// Sections of DeepSpeed features strata does not run, refused where DeepSpeed turns them on:
// apex AMP (amp.enabled); sparse attention (the section's presence, as get_sparse_attention reads
// it); compression training (a technique's shared_parameters.enabled, or layer_reduction.enabled,
// as its compression scheduler reads them). `pipeline` stays a key not acted on: DeepSpeed reads
// it only for a PipelineModule, which strata does not provide.
void CheckUnsupportedSections(Reader& r, const Json* root) {
  auto enabled = [](const Json& section) {
    auto it = section.find("enabled");
    return it != section.end() && it->is_boolean() && it->get<bool>();
  };
  auto amp = root->find("amp");
  if (amp != root->end() && amp->is_object() && enabled(*amp)) {
    r.Error(Kind::kUnsupported, "amp.enabled",
            "apex AMP is not supported by strata; use the bf16 or fp16 section");
  }
  auto sparse = root->find("sparse_attention");
  if (sparse != root->end() && sparse->is_object()) {
    r.Error(Kind::kUnsupported, "sparse_attention",
            "sparse attention is not supported by strata (DeepSpeed turns it on by the section "
            "being present): remove the section");
  }
  // Features DeepSpeed turns on that would change what trains, which strata does not build:
  // accepting them would train something else without a word.
  struct Feature {
    const char* section;
    const char* what;
  };
  for (const Feature& f :
       {Feature{"progressive_layer_drop",
                "progressive layer drop (DeepSpeed passes progressive_layer_drop "
                "and pld_theta to the model's forward)"},
        Feature{"curriculum_learning",
                "curriculum learning (DeepSpeed passes curriculum_seqlen to the "
                "model's forward)"},
        Feature{"data_efficiency", "data efficiency (curriculum data sampling, random-LTD)"}}) {
    auto it = root->find(f.section);
    if (it != root->end() && it->is_object() && enabled(*it)) {
      r.Error(Kind::kUnsupported, std::string(f.section) + ".enabled",
              std::string(f.what) + " is not supported by strata: disable it");
    }
  }
  auto tp = root->find("tensor_parallel");
  if (tp != root->end() && tp->is_object()) {
    auto size = tp->find("autotp_size");
    if (size != tp->end() && size->is_number() && size->get<double>() > 1) {
      r.Error(Kind::kUnsupported, "tensor_parallel.autotp_size",
              "automatic tensor parallelism is not supported by strata (every rank holds and "
              "trains data-parallel shards of the whole model): set autotp_size to 1 or remove "
              "the section, and size the batch for world_size data-parallel ranks");
    }
  }
  auto managed = root->find("managed_gradient_accumulation");
  if (managed != root->end() &&
      ((managed->is_boolean() && !managed->get<bool>()) ||
       (managed->is_number_integer() && managed->get<int64_t>() == 0) ||
       (managed->is_string() && managed->get<std::string>() == "false"))) {
    r.Error(Kind::kUnsupported, "managed_gradient_accumulation",
            "false (the caller's step() ending each window, of any number of backwards) is not "
            "supported by strata, whose windows are gradient_accumulation_steps micro-steps: "
            "remove the key, or call engine.set_gradient_accumulation_boundary(True) before a "
            "window's last backward");
  }
  auto zero = root->find("zero_optimization");
  if (zero != root->end() && zero->is_object()) {
    auto zenflow = zero->find("zenflow");
    if (zenflow != zero->end() && zenflow->is_object()) {
      r.Error(Kind::kUnsupported, "zero_optimization.zenflow",
              "ZenFlow (selective top-k updates, DeepSpeed's ZenFlowZeroOptimizer, on by the "
              "section being present) is not supported by strata: remove the section");
    }
  }
  auto comp = root->find("compression_training");
  if (comp == root->end() || !comp->is_object()) return;
  for (auto it = comp->begin(); it != comp->end(); ++it) {
    if (!it->is_object()) continue;
    auto shared = it->find("shared_parameters");
    const bool on = it.key() == "layer_reduction"
                        ? enabled(*it)
                        : shared != it->end() && shared->is_object() && enabled(*shared);
    if (!on) continue;
    r.Error(Kind::kUnsupported,
            "compression_training." + it.key() +
                (it.key() == "layer_reduction" ? ".enabled" : ".shared_parameters.enabled"),
            "compression training (" + it.key() + ") is not supported by strata");
  }
}

// The scheduler's params as the engine reads them (zero::LrSchedule::FromConfig, the one rule),
// once nothing it reads waits for a trainer: a typo or a value DeepSpeed's scheduler refuses is
// a config error here, not first at the engine's start.
void CheckSchedule(Reader& r, const EngineConfig& c) {
  if (c.scheduler.type == SchedulerType::kNone || c.scheduler.type == SchedulerType::kOther) {
    return;  // none, or a torch.optim.lr_scheduler name (the Python adapter runs those)
  }
  for (const std::string& p : r.unresolved()) {
    if (p.rfind("scheduler.", 0) == 0 || p == "optimizer.params.lr") return;
  }
  Result<zero::LrSchedule> s = zero::LrSchedule::FromConfig(c);
  if (s.ok()) {
    for (const std::string& w : s->warnings()) {
      const size_t colon = w.find(": ");
      r.Warn(Kind::kRange, w.substr(0, colon), w.substr(colon + 2));
    }
    return;
  }
  const std::string msg(s.status().message());
  const size_t colon = msg.find(": ");
  if (colon == std::string::npos) {
    r.Error(Kind::kRange, "scheduler", msg);
  } else {
    r.Error(Kind::kRange, msg.substr(0, colon), msg.substr(colon + 2));
  }
}

// The rules shared with the engine (GradientDivisionProblem, ZeroPlusPlusStageProblem).
void CheckEngineRules(Reader& r, const EngineConfig& c) {
  const ZeroConfig& z = c.zero;
  if (!r.IsUnresolved("zero_optimization.stage")) {
    std::string zpp = ZeroPlusPlusStageProblem(
        z.stage, z.zero_quantized_weights, z.zero_quantized_gradients, z.zero_hpz_partition_size);
    if (!zpp.empty()) r.Error(Kind::kConflict, zpp.substr(0, zpp.find(':')), zpp);
  }
  if (std::optional<int64_t> w = r.options().world_size) {
    std::string div =
        GradientDivisionProblem(c.prescale_gradients, c.gradient_predivide_factor, *w);
    if (!div.empty()) r.Error(Kind::kConflict, "gradient_predivide_factor", div);
  }
}

}  // namespace

namespace {

// DeepSpeed's data_types (its FSDP-like MixedPrecisionPolicy): each a DtypeEnum name.
// param_dtype must be the precision fp16 / bf16 enable (DeepSpeed asserts it);
// grad_accum_dtype other than fp32 is not acted on (strata accumulates gradients in fp32);
// buffer_dtype is read by the Python engine, which casts the module's floating-point buffers.
// A valid value is written back as its canonical name ("fp16", "fp32", "bf16"), which the
// normalized config carries: the spellings are known here only.
void CheckDataTypes(Reader& r, const EngineConfig& c, Json* root) {
  auto sec = root->find("data_types");
  if (sec == root->end() || sec->is_null()) return;
  if (!sec->is_object()) {
    r.Error(Kind::kType, "data_types", "must be an object");
    return;
  }
  const auto canonical = [](const std::string& v) -> std::string {
    for (const auto& [name, spellings] : {std::pair<std::string, std::vector<std::string>>{
                                              "fp16", {"torch.float16", "fp16", "float16", "half"}},
                                          {"fp32", {"torch.float32", "fp32", "float32", "float"}},
                                          {"bf16", {"torch.bfloat16", "bf16", "bfloat16"}},
                                          {"int8", {"torch.int8", "int8"}}}) {
      for (const std::string& s : spellings) {
        if (v == s) return name;
      }
    }
    return "";
  };
  const std::string model = c.fp16.enabled.value_or(false)   ? "fp16"
                            : c.bf16.enabled.value_or(false) ? "bf16"
                                                             : "fp32";
  for (auto it = sec->begin(); it != sec->end(); ++it) {
    const std::string path = "data_types." + it.key();
    if (it.key() != "grad_accum_dtype" && it.key() != "param_dtype" && it.key() != "buffer_dtype") {
      r.Warn(Kind::kUnknownKey, path,
             "not a data_types key (grad_accum_dtype, param_dtype, buffer_dtype)");
      continue;
    }
    if (it->is_null()) continue;  // DeepSpeed's default
    const std::string dtype = it->is_string() ? canonical(it->get<std::string>()) : "";
    if (dtype.empty() || dtype == "int8") {
      r.Error(Kind::kType, path,
              it->dump() + " is not a floating-point dtype (\"fp32\", \"bf16\", \"fp16\")");
    } else if (it.key() == "param_dtype" && dtype != model && !c.fp16.enabled.is_auto() &&
               !c.bf16.enabled.is_auto()) {  // "auto": the trainer decides the precision
      r.Error(Kind::kConflict, path,
              dtype + " conflicts with the enabled precision (the model's parameters are " + model +
                  "): enable the matching fp16 / bf16 section or drop the key, as " +
                  "DeepSpeed asserts");
    } else if (it.key() == "grad_accum_dtype" && dtype != "fp32") {
      r.Warn(Kind::kIgnored, path,
             dtype + " is not acted on: strata accumulates gradients in fp32 whatever it says");
    }
    if (!dtype.empty()) it.value() = dtype;
  }
}

}  // namespace

void CheckAcrossKeys(Reader& r, EngineConfig& c, Json* root) {
  CheckDataTypes(r, c, root);
  CheckUnsupportedSections(r, root);
  CheckSchedule(r, c);
  CheckEngineRules(r, c);
  CheckLowPrecisionStates(r, c, root);
  CheckLeafModule(r, root);
  CheckBatch(r, c, root);
  if (c.fp16.enabled.value_or(false) && c.bf16.enabled.value_or(false)) {
    r.Error(Kind::kConflict, "bf16.enabled", "fp16 and bf16 are both enabled; enable at most one");
  }
  CheckNvmeOnlyKeys(r, root, "offload_optimizer", c.zero.offload_optimizer.device,
                    {"nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init"});
  CheckNvmeOnlyKeys(r, root, "offload_param", c.zero.offload_param.device,
                    {"nvme_path", "buffer_count", "buffer_size", "max_in_cpu"});
  CheckOffload(r, c);
}

namespace {

// Returns the free bytes at `dir`, or -1 after reporting why it cannot be used.
int64_t CheckPath(Reader& r, const std::string& key, const std::string& dir) {
  std::error_code ec;
  auto st = std::filesystem::status(dir, ec);
  if (ec || !std::filesystem::exists(st)) {
    r.Error(Kind::kMachine, key,
            "'" + dir +
                "' does not exist on this machine: create the directory on the NVMe's "
                "filesystem (strata does not create it)");
    return -1;
  }
  if (!std::filesystem::is_directory(st)) {
    r.Error(Kind::kMachine, key, "'" + dir + "' is not a directory");
    return -1;
  }
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    r.Error(Kind::kMachine, key,
            "'" + dir + "' is not writable: " + std::string(std::strerror(errno)));
    return -1;
  }
  struct statvfs vfs {};
  if (statvfs(dir.c_str(), &vfs) != 0) {
    r.Error(Kind::kMachine, key, "statvfs '" + dir + "': " + std::string(std::strerror(errno)));
    return -1;
  }
  int64_t free_bytes = static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
  r.check().notes.push_back(key + ": '" + dir + "' has " + I(free_bytes) + " bytes free");
  if (free_bytes < r.options().min_free_bytes) {
    r.Warn(Kind::kMachine, key,
           "'" + dir + "' has only " + I(free_bytes) + " bytes free (< " +
               I(r.options().min_free_bytes) + ")");
  }
  return free_bytes;
}

}  // namespace

void CheckHere(Reader& r, const EngineConfig& c) {
  auto check = [&r](const char* key, OffloadDevice device, const std::string& dir) {
    if (device != OffloadDevice::kNvme || dir.empty()) return;
    const int64_t free_bytes = CheckPath(r, key, dir);
    struct stat st {};
    const uint64_t fs = ::stat(dir.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_dev) : 0;
    if (free_bytes >= 0) r.check().nvme_paths.push_back({key, dir, free_bytes, fs});
  };
  const ZeroConfig& z = c.zero;
  check("zero_optimization.offload_optimizer.nvme_path", z.offload_optimizer.device,
        z.offload_optimizer.nvme_path);
  check("zero_optimization.offload_param.nvme_path", z.offload_param.device,
        z.offload_param.nvme_path);
}

}  // namespace strata::config

namespace strata {

std::string ZeroPlusPlusStageProblem(int64_t stage, bool quantized_weights,
                                     bool quantized_gradients, int64_t hpz_partition_size) {
  if (stage == 3) return "";
  const char* key = quantized_weights        ? "zero_optimization.zero_quantized_weights"
                    : quantized_gradients    ? "zero_optimization.zero_quantized_gradients"
                    : hpz_partition_size > 1 ? "zero_optimization.zero_hpz_partition_size"
                                             : nullptr;
  if (key == nullptr) return "";
  return std::string(key) +
         ": ZeRO++ works on the stage-3 parameter all-gather and gradient reduce-scatter; "
         "zero_optimization.stage is " +
         std::to_string(stage) + " (set it to 3)";
}

std::string GradientDivisionProblem(bool prescale_gradients, double gradient_predivide_factor,
                                    int64_t world_size) {
  if (prescale_gradients || gradient_predivide_factor == 1.0 ||
      gradient_predivide_factor == static_cast<double>(world_size)) {
    return "";
  }
  return "gradient_predivide_factor: " + config::Json(gradient_predivide_factor).dump() +
         " is supported as 1 or the world size (" + std::to_string(world_size) + ") only";
}

}  // namespace strata
