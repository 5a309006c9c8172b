// DeepSpeed config -> EngineConfig: the sections, DeepSpeed's defaults and the checks across keys.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>

#include "core/config/config_reader.h"
#include "core/config/config_text.h"
#include "strata/config.h"

namespace strata {

// Defined in config_checks.cc.
namespace config {
void CheckAcrossKeys(Reader& r, EngineConfig& c, Json* root);
void CheckHere(Reader& r, const EngineConfig& c);
}  // namespace config

using config::AutoPolicy;
using config::Json;
using config::Reader;
using config::Section;
using Kind = ConfigDiagnostic::Kind;

namespace {

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// Reads `device`: none | cpu | nvme, any case (another case is a warning), null = none.
void ReadDevice(Reader& r, Section& s, OffloadDevice* out) {
  std::string used;
  Json* v = r.Find(s, {"device"}, &used);
  if (v == nullptr || v->is_null()) return;
  std::string path = r.PathOf(s, "device");
  if (r.IsUnresolvedAuto(s, v, "device", AutoPolicy::kTrainerFills)) return;  // Accelerate
  if (!v->is_string()) {
    r.Error(Kind::kType, path,
            "expected one of \"none\", \"cpu\", \"nvme\", got " +
                std::string(config::JsonTypeName(*v)) + " " + v->dump());
    return;
  }
  std::string name = v->get<std::string>();
  std::string low = Lower(name);
  if (low == "none") {
    *out = OffloadDevice::kNone;
  } else if (low == "cpu") {
    *out = OffloadDevice::kCpu;
  } else if (low == "nvme") {
    *out = OffloadDevice::kNvme;
  } else {
    r.Error(Kind::kRange, path,
            "unknown offload device \"" + name + "\"; expected one of \"none\", \"cpu\", \"nvme\"");
    return;
  }
  if (name != low) {
    r.Warn(Kind::kCase, path,
           "device \"" + name + "\" is read as \"" + low +
               "\"; DeepSpeed matches device names exactly (older versions treat it as no "
               "offload, newer ones reject it): write \"" +
               low + "\"");
  }
}

void ReadOffloadOptimizer(Reader& r, Section& zero, OffloadOptimizerConfig* o, bool* pin_given) {
  Section s = r.Child(zero, "offload_optimizer");
  if (!s.present()) return;
  ReadDevice(r, s, &o->device);
  r.String(s, {"nvme_path"}, &o->nvme_path, AutoPolicy::kTrainerFills);
  r.Int(s, {"buffer_count"}, &o->buffer_count, 0);
  *pin_given = r.Bool(s, {"pin_memory"}, &o->pin_memory);
  r.Bool(s, {"pipeline_read"}, &o->pipeline_read);
  r.Bool(s, {"pipeline_write"}, &o->pipeline_write);
  r.Bool(s, {"fast_init"}, &o->fast_init);
  if (r.Double(s, {"ratio"}, &o->ratio, 0.0) && o->ratio > 1.0) {
    r.Error(Kind::kRange, r.PathOf(s, "ratio"),
            "expected a fraction in [0, 1], got " + Json(o->ratio).dump());
  }
  bool speculate = false, super_offload = false;
  const bool speculate_given = r.Bool(s, {"speculative_step"}, &speculate);
  const bool super_given = r.Bool(s, {"super_offload"}, &super_offload);
  if (speculate_given && super_given && speculate != super_offload) {
    r.Error(Kind::kConflict, r.PathOf(s, "super_offload"),
            std::string("contradicts speculative_step (") + (speculate ? "true" : "false") +
                "): both switch the optimizer step during backward");
  }
  if (speculate_given || super_given)
    o->speculative_step = speculate_given ? speculate : super_offload;
  r.Int(s, {"speculation_buffer_size"}, &o->speculation_buffer_size, 0);
  r.FinishSection(s);
}

void ReadOffloadParam(Reader& r, Section& zero, OffloadParamConfig* p, bool* pin_given) {
  Section s = r.Child(zero, "offload_param");
  if (!s.present()) return;
  ReadDevice(r, s, &p->device);
  r.String(s, {"nvme_path"}, &p->nvme_path, AutoPolicy::kTrainerFills);
  r.Int(s, {"buffer_count"}, &p->buffer_count, 0);
  r.Int(s, {"buffer_size"}, &p->buffer_size, 0);
  r.Int(s, {"max_in_cpu"}, &p->max_in_cpu, 0);
  *pin_given = r.Bool(s, {"pin_memory"}, &p->pin_memory);
  r.FinishSection(s);
}

// The deprecated zero keys, mapped onto their replacements with a note.
void ReadDeprecatedOffload(Reader& r, Section& s, ZeroConfig* z, bool opt_given, bool param_given,
                           bool opt_pin_given, bool param_pin_given) {
  bool flag = false;
  if (r.Bool(s, {"cpu_offload"}, &flag)) {
    std::string path = r.PathOf(s, "cpu_offload");
    if (opt_given) {
      r.Error(Kind::kConflict, path,
              "deprecated 'cpu_offload' and its replacement 'offload_optimizer' are both given; "
              "keep 'offload_optimizer'");
    } else {
      if (flag) z->offload_optimizer.device = OffloadDevice::kCpu;
      r.Warn(Kind::kDeprecated, path,
             std::string("deprecated; read as \"offload_optimizer\": {\"device\": \"") +
                 (flag ? "cpu" : "none") + "\"}");
    }
  }
  flag = false;
  if (r.Bool(s, {"cpu_offload_param"}, &flag)) {
    std::string path = r.PathOf(s, "cpu_offload_param");
    if (param_given) {
      r.Error(Kind::kConflict, path,
              "deprecated 'cpu_offload_param' and its replacement 'offload_param' are both "
              "given; keep 'offload_param'");
    } else {
      if (flag) z->offload_param.device = OffloadDevice::kCpu;
      r.Warn(Kind::kDeprecated, path,
             std::string("deprecated; read as \"offload_param\": {\"device\": \"") +
                 (flag ? "cpu" : "none") + "\"}");
    }
  }
  if (r.Bool(s, {"cpu_offload_use_pin_memory"}, &flag)) {
    if (!opt_pin_given) z->offload_optimizer.pin_memory = flag;
    if (!param_pin_given) z->offload_param.pin_memory = flag;
    r.Warn(Kind::kDeprecated, r.PathOf(s, "cpu_offload_use_pin_memory"),
           std::string("deprecated; read as \"pin_memory\": ") + (flag ? "true" : "false") +
               " in offload_optimizer and offload_param (where they do not set it)");
  }
}

void ReadZero(Reader& r, Section& root, ZeroConfig* z, bool* overlap_given) {
  std::string used;
  Json* raw = r.Find(root, {"zero_optimization"}, &used);
  if (raw != nullptr && raw->is_boolean()) {
    // DeepSpeed's oldest form: "zero_optimization": true means stage 1.
    bool on = raw->get<bool>();
    z->stage = on ? 1 : 0;
    r.Warn(
        Kind::kDeprecated, "zero_optimization",
        std::string("a boolean here is deprecated; read as {\"stage\": ") + (on ? "1" : "0") + "}");
    return;
  }
  Section s = r.Child(root, "zero_optimization");
  if (!s.present()) return;
  int64_t stage = 0;
  if (r.Int(s, {"stage"}, &stage, 0, AutoPolicy::kTrainerFills)) {
    if (stage > 3) {
      r.Error(Kind::kRange, r.PathOf(s, "stage"),
              "expected a ZeRO stage 0, 1, 2 or 3, got " + std::to_string(stage));
    } else {
      z->stage = static_cast<int>(stage);
    }
  }
  bool opt_pin = false;
  bool param_pin = false;
  // Given: present as an object (null and a dropped "auto" mean absent).
  const Json* opt = r.Member(s, "offload_optimizer");
  const Json* param = r.Member(s, "offload_param");
  bool opt_given = opt != nullptr && opt->is_object();
  bool param_given = param != nullptr && param->is_object();
  ReadOffloadOptimizer(r, s, &z->offload_optimizer, &opt_pin);
  ReadOffloadParam(r, s, &z->offload_param, &param_pin);
  ReadDeprecatedOffload(r, s, z, opt_given, param_given, opt_pin, param_pin);
  *overlap_given = r.Bool(s, {"overlap_comm"}, &z->overlap_comm);
  r.Bool(s, {"contiguous_gradients"}, &z->contiguous_gradients);
  r.Bool(s, {"reduce_scatter"}, &z->reduce_scatter);
  r.AutoInt(s, {"reduce_bucket_size"}, &z->reduce_bucket_size);
  r.Bool(s, {"allgather_partitions"}, &z->allgather_partitions);
  r.Int(s, {"allgather_bucket_size"}, &z->allgather_bucket_size);
  r.Int(s, {"sub_group_size"}, &z->sub_group_size);
  r.AutoInt(s, {"stage3_prefetch_bucket_size", "prefetch_bucket_size"},
            &z->stage3_prefetch_bucket_size);
  r.AutoInt(s, {"stage3_param_persistence_threshold", "param_persistence_threshold"},
            &z->stage3_param_persistence_threshold);
  r.Int(s, {"stage3_model_persistence_threshold", "model_persistence_threshold"},
        &z->stage3_model_persistence_threshold);
  r.Int(s, {"stage3_max_live_parameters", "max_live_parameters"}, &z->stage3_max_live_parameters);
  r.Int(s, {"stage3_max_reuse_distance", "max_reuse_distance"}, &z->stage3_max_reuse_distance);
  std::string gather_used;
  Json* g =
      r.Find(s,
             {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
              "stage3_gather_fp16_weights_on_model_save"},
             &gather_used);
  if (g != nullptr) {
    std::string path = r.PathOf(s, gather_used);
    if (!r.IsUnresolvedAuto(s, g, gather_used, AutoPolicy::kTrainerFills)) {
      if (auto b = r.ToBool(*g, path)) z->stage3_gather_16bit_weights_on_model_save = *b;
    }
    if (gather_used == "stage3_gather_fp16_weights_on_model_save") {
      r.Warn(Kind::kDeprecated, path,
             "deprecated; read as 'stage3_gather_16bit_weights_on_model_save'");
    }
  }
  r.Bool(s, {"zero_quantized_weights"}, &z->zero_quantized_weights);
  r.Bool(s, {"zero_quantized_gradients"}, &z->zero_quantized_gradients);
  r.Int(s, {"zero_hpz_partition_size"}, &z->zero_hpz_partition_size, 0);
  // The Python adapter's (strata.zero); its shape is checked with the other keys (config_checks),
  // "auto" dropped as DeepSpeed drops it (its default classes apply).
  if (Json* leaf = r.Member(s, "leaf_module"); leaf != nullptr) {
    s.consumed.insert("leaf_module");
    r.IsUnresolvedAuto(s, leaf, "leaf_module", AutoPolicy::kDeepSpeedRule);
  }
  r.FinishSection(s);
}

void ReadFp16(Reader& r, Section& root, Fp16Config* f) {
  Section s = r.Child(root, "fp16");
  r.AutoBool(s, {"enabled"}, &f->enabled);
  r.Bool(s, {"auto_cast"}, &f->auto_cast);
  r.Double(s, {"loss_scale"}, &f->loss_scale, 0.0);
  r.Int(s, {"initial_scale_power"}, &f->initial_scale_power, 0);
  r.Int(s, {"loss_scale_window"}, &f->loss_scale_window, 1);
  r.Int(s, {"hysteresis"}, &f->hysteresis, 1);
  r.Bool(s, {"consecutive_hysteresis"}, &f->consecutive_hysteresis);
  r.Double(s, {"min_loss_scale"}, &f->min_loss_scale, 0.0);
  r.FinishSection(s);
}

void ReadBf16(Reader& r, Section& root, Bf16Config* b) {
  // DeepSpeed reads "bf16" and falls back to the old name "bfloat16" only when "bf16" is absent.
  std::string name = "bf16";
  if (r.Member(root, "bfloat16") != nullptr) {
    if (r.Member(root, "bf16") != nullptr) {
      r.Warn(Kind::kIgnored, "bfloat16",
             "both 'bf16' and its old name 'bfloat16' are given; 'bfloat16' is ignored");
    } else {
      name = "bfloat16";
    }
  }
  root.consumed.insert("bf16");
  root.consumed.insert("bfloat16");
  Section s = r.Child(root, name);
  r.AutoBool(s, {"enabled"}, &b->enabled);
  r.FinishSection(s);
}

}  // namespace

namespace config {
void ReadOptimizer(Reader& r, Section& root, OptimizerConfig* o);
void ReadSchedulerAndAio(Reader& r, Section& root, SchedulerConfig* sc, AioConfig* aio);
void ReadCheckpoint(Reader& r, Section& root, CheckpointConfig* c);
// Sections the Python adapter acts on (its loader's drop_last, DeepSpeed's monitors: see
// python/strata/monitor.py): their values' types checked here.
void ReadAdapterSections(Reader& r, Section& root);
}  // namespace config

ConfigCheck CheckDeepSpeedConfig(std::string_view text, const ParseOptions& options) {
  ConfigCheck check;
  ConfigDiagnostic comment_error{Kind::kSyntax, "", "", 0, 0};
  std::string stripped = config::StripComments(text, &comment_error);
  if (!comment_error.message.empty()) {
    check.errors.push_back(comment_error);
    return check;
  }
  Json doc;
  if (!config::ParseJsonStrict(stripped, &doc, &check.errors)) {
    bool syntax = std::any_of(check.errors.begin(), check.errors.end(),
                              [](const ConfigDiagnostic& d) { return d.kind == Kind::kSyntax; });
    if (!syntax) {  // duplicate keys only: the text is well-formed, so keys can be located
      config::LocateDiagnostics(stripped, {&check.errors});
    }
    return check;
  }
  if (!doc.is_object()) {
    check.errors.push_back(ConfigDiagnostic{
        Kind::kType, "",
        "expected a JSON object at the top level, got " + std::string(config::JsonTypeName(doc)), 0,
        0});
    return check;
  }
  // Hugging Face's fill-in for the ZeRO sizes from the model's hidden size.
  ParseOptions opts = options;
  if (options.hidden_size) {
    int64_t h = *options.hidden_size;
    for (const char* k : {"reduce_bucket_size"}) {
      opts.auto_values.try_emplace(std::string("zero_optimization.") + k, std::to_string(h * h));
    }
    for (const char* k : {"stage3_prefetch_bucket_size", "prefetch_bucket_size"}) {
      opts.auto_values.try_emplace(std::string("zero_optimization.") + k,
                                   std::to_string(static_cast<int64_t>(0.9 * h * h)));
    }
    for (const char* k : {"stage3_param_persistence_threshold", "param_persistence_threshold"}) {
      opts.auto_values.try_emplace(std::string("zero_optimization.") + k, std::to_string(10 * h));
    }
  }
  // Supplied values also fill batch keys that are absent, as a trainer does.
  for (const char* k :
       {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}) {
    auto it = opts.auto_values.find(k);
    if (it != opts.auto_values.end() && !doc.contains(k)) doc[k] = "auto";
  }
  Reader r(opts, &check);
  Section root;
  root.obj = &doc;
  EngineConfig c;
  r.AutoInt(root, {"train_batch_size"}, &c.train_batch_size, 1);
  r.AutoInt(root, {"train_micro_batch_size_per_gpu"}, &c.train_micro_batch_size_per_gpu, 1);
  r.AutoInt(root, {"gradient_accumulation_steps"}, &c.gradient_accumulation_steps, 1);
  r.AutoDouble(root, {"gradient_clipping"}, &c.gradient_clipping, 0.0);
  int64_t steps_per_print = 0;
  if (r.Int(root, {"steps_per_print"}, &steps_per_print, 0)) c.steps_per_print = steps_per_print;
  r.Bool(root, {"prescale_gradients"}, &c.prescale_gradients);
  if (r.Double(root, {"gradient_predivide_factor"}, &c.gradient_predivide_factor, 0.0) &&
      !(c.gradient_predivide_factor > 0)) {
    r.Error(ConfigDiagnostic::Kind::kRange, "gradient_predivide_factor",
            "expected a number > 0, got 0");
  }
  ReadFp16(r, root, &c.fp16);
  ReadBf16(r, root, &c.bf16);
  config::ReadOptimizer(r, root, &c.optimizer);
  config::ReadSchedulerAndAio(r, root, &c.scheduler, &c.aio);
  config::ReadCheckpoint(r, root, &c.checkpoint);
  config::ReadAdapterSections(r, root);
  bool overlap_given = false;
  ReadZero(r, root, &c.zero, &overlap_given);
  if (!overlap_given) c.zero.overlap_comm = c.zero.stage == 3;  // DeepSpeed's default by stage
  r.FinishSection(root);
  r.ReportUnlistedUnknownKeys();
  config::CheckAcrossKeys(r, c, &doc);
  if (options.check_here) config::CheckHere(r, c);
  r.ReportDroppedAuto(c);

  if (!r.unresolved().empty() && options.require_resolved) {
    std::string list;
    for (const std::string& p : r.unresolved()) list += (list.empty() ? "" : ", ") + p;
    r.Error(Kind::kUnresolvedAuto, r.unresolved().front(),
            "\"auto\" values need the trainer's values, still unresolved: " + list);
  }
  for (const auto& [key, value] : options.auto_values) {
    if (r.used_auto_values().count(key) == 0) {
      check.notes.push_back("the value supplied for '" + key +
                            "' is not used: the config has no \"auto\" there");
    }
  }
  config::LocateDiagnostics(stripped, {&check.errors, &check.warnings});
  if (options.strict) {
    for (ConfigDiagnostic& w : check.warnings) {
      w.message += " (an error under --strict)";
      check.errors.push_back(std::move(w));
    }
    check.warnings.clear();
  }
  if (!check.ok()) return check;
  c.unacted_keys = std::move(r.unacted());
  c.unresolved_auto = r.unresolved();
  ParsedConfig parsed;
  parsed.config = std::move(c);
  parsed.warnings = check.warnings;
  parsed.unresolved_auto = r.unresolved();
  parsed.notes = check.notes;
  parsed.normalized_json = doc.dump();
  parsed.dropped_auto = r.dropped_paths();
  check.parsed = std::move(parsed);
  return check;
}

Result<ParsedConfig> ResolveDeepSpeedConfig(const ParsedConfig& parsed,
                                            const ParseOptions& options) {
  return ParseDeepSpeedConfig(parsed.normalized_json, options);
}

Result<ParsedConfig> ParseDeepSpeedConfig(std::string_view text, const ParseOptions& options) {
  ConfigCheck check = CheckDeepSpeedConfig(text, options);
  if (check.ok()) return std::move(*check.parsed);
  std::string msg = options.source_name.empty() ? "invalid DeepSpeed config"
                                                : "invalid DeepSpeed config " + options.source_name;
  for (const ConfigDiagnostic& e : check.errors) msg += "\n  " + e.ToString();
  return Status::InvalidArgument(msg);
}

namespace {
// Configs are a few KiB; anything this large is not one (and is not read into memory).
constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;

Result<std::string> ReadFile(const std::string& path) {
  // O_NONBLOCK: opening a FIFO (or a serial device) must not wait for the other side; anything
  // but a regular file is refused below. A symbolic link is followed: the user named this path,
  // and its target is checked the same way.
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return Status::NotFound("DeepSpeed config '" + path + "' does not exist");
    return Status::FromErrno(err, "open", path);
  }
  std::string text;
  Status status;
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    status = Status::FromErrno(errno, "stat", path);
  } else if (S_ISDIR(st.st_mode)) {
    status = Status::InvalidArgument("DeepSpeed config '" + path + "' is a directory");
  } else if (!S_ISREG(st.st_mode)) {
    status = Status::InvalidArgument("DeepSpeed config '" + path + "' is " +
                                     (S_ISFIFO(st.st_mode)  ? "a FIFO"
                                      : S_ISCHR(st.st_mode) ? "a character device"
                                      : S_ISBLK(st.st_mode) ? "a block device"
                                                            : "a socket") +
                                     ", not a regular file");
  } else {
    char buf[65536];
    while (status.ok()) {
      ssize_t n = read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        status = Status::FromErrno(errno, "read", path);
      } else if (n == 0) {
        break;
      } else if (static_cast<int64_t>(text.size()) + n > kMaxConfigBytes) {
        status = Status::InvalidArgument("DeepSpeed config '" + path +
                                         "' is larger than 16 MiB: not a config");
      } else {
        text.append(buf, static_cast<size_t>(n));
      }
    }
  }
  close(fd);
  if (!status.ok()) return status;
  return text;
}
}  // namespace

Result<ParsedConfig> LoadDeepSpeedConfig(const std::string& path, const ParseOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  ParseOptions o = options;
  if (o.source_name.empty()) o.source_name = path;
  return ParseDeepSpeedConfig(text, o);
}

Result<ConfigCheck> CheckDeepSpeedConfigFile(const std::string& path, const ParseOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  ParseOptions o = options;
  if (o.source_name.empty()) o.source_name = path;
  return CheckDeepSpeedConfig(text, o);
}

}  // namespace strata
