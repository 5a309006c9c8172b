// `offloadctl config check ds.json`: validates a DeepSpeed config the way strata reads it and
// prints the errors, the warnings and the effective resolved config.
#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "strata/config.h"
#include "strata/planner.h"
#include "tools/offloadctl/cli_checks.h"
#include "tools/offloadctl/cli_flags.h"
#include "tools/offloadctl/commands.h"

namespace strata::cli {

namespace {

struct ConfigCheckArgs {
  std::string path;
  int64_t world_size = 0;
  int64_t hidden_size = 0;
  std::vector<std::string> set;
  bool strict = false;
  bool here = false;
  bool json = false;
  bool require_resolved = false;
  std::string params;
};

nlohmann::ordered_json DiagJson(const ConfigDiagnostic& d) {
  nlohmann::ordered_json j{
      {"kind", DiagnosticKindName(d.kind)}, {"path", d.path}, {"message", d.message}};
  if (d.line > 0) {
    j["line"] = d.line;
    j["column"] = d.column;
  }
  return j;
}

int RunCheck(const ConfigCheckArgs& a) {
  ParseOptions o;
  std::optional<double> params;
  if (a.world_size > 0) o.world_size = a.world_size;
  if (a.hidden_size > 0) o.hidden_size = a.hidden_size;
  o.strict = a.strict;
  o.check_here = a.here;
  o.require_resolved = a.require_resolved;
  if (!a.params.empty()) {
    auto p = ParseParamCount(a.params);
    if (!p.ok()) {
      return Failure("config check", "--params: " + std::string(p.status().message()), kExitUsage,
                     a.json);
    }
    params = *p;
  }
  for (const std::string& kv : a.set) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      return Failure("config check",
                     "--set expects KEY=VALUE (e.g. optimizer.params.lr=1e-4), got '" + kv + "'",
                     kExitUsage, a.json);
    }
    // A VALUE that is not JSON is taken as a string: --set ...offload_param.device=cpu.
    std::string value = kv.substr(eq + 1);
    if (nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false).is_discarded()) {
      value = nlohmann::json(value).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
    o.auto_values[kv.substr(0, eq)] = value;
  }
  Result<ConfigCheck> r = CheckDeepSpeedConfigFile(a.path, o);
  if (!r.ok()) {
    if (a.json) {
      nlohmann::ordered_json j{
          {"file", a.path}, {"valid", false}, {"read_error", r.status().ToString()}};
      std::printf("%s\n",
                  j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
    } else {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
    }
    return kExitInvalid;
  }
  ConfigCheck& c = *r;
  if (params) CheckNvmeSpace(*params, std::max<int64_t>(1, a.world_size), a.strict, &c);
  if (a.json) {
    nlohmann::ordered_json j{{"file", a.path}, {"valid", c.ok()}};
    j["errors"] = nlohmann::ordered_json::array();
    for (const auto& e : c.errors) j["errors"].push_back(DiagJson(e));
    j["warnings"] = nlohmann::ordered_json::array();
    for (const auto& w : c.warnings) j["warnings"].push_back(DiagJson(w));
    j["notes"] = c.notes;
    j["nvme_paths"] = nlohmann::ordered_json::array();
    for (const NvmePathSpace& n : c.nvme_paths) {
      j["nvme_paths"].push_back({{"key", n.key}, {"dir", n.dir}, {"free_bytes", n.free_bytes}});
    }
    if (c.parsed) {
      j["unresolved_auto"] = c.parsed->unresolved_auto;
      j["unacted_keys"] = nlohmann::ordered_json::array();
      for (const UnactedKey& k : c.parsed->config.unacted_keys) {
        j["unacted_keys"].push_back(
            {{"path", k.path}, {"value", nlohmann::ordered_json::parse(k.json_text)}});
      }
      j["effective"] = nlohmann::ordered_json::parse(EffectiveConfigJson(c.parsed->config));
    }
    std::printf("%s\n",
                j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
    return c.ok() ? kExitOk : kExitInvalid;
  }
  // Keys may hold any character ("a\u0000b"): what is printed goes through PrintableText
  // (ToString does so), or a NUL would cut the line and an escape sequence reach the terminal.
  for (const auto& e : c.errors) std::printf("error: %s\n", e.ToString().c_str());
  for (const auto& w : c.warnings) std::printf("warning: %s\n", w.ToString().c_str());
  for (const auto& n : c.notes) std::printf("note: %s\n", PrintableText(n).c_str());
  if (!c.ok()) {
    std::printf("%s: INVALID (%zu error(s), %zu warning(s))\n", a.path.c_str(), c.errors.size(),
                c.warnings.size());
    return kExitInvalid;
  }
  const ParsedConfig& p = *c.parsed;
  if (!p.unresolved_auto.empty()) {
    std::printf("\"auto\", left to the trainer (supply with --set KEY=VALUE):\n");
    for (const auto& k : p.unresolved_auto) std::printf("  %s\n", PrintableText(k).c_str());
  }
  if (!p.config.unacted_keys.empty()) {
    std::printf(
        "kept, not acted on by the engine (the Python package acts on some: torch_autocast, "
        "activation_checkpointing, wall_clock_breakdown, data_types.buffer_dtype, the monitors; "
        "docs/deepspeed-compat.md):\n");
    for (const auto& k : p.config.unacted_keys) {
      std::printf("  %s = %s\n", PrintableText(k.path).c_str(), k.json_text.c_str());
    }
  }
  std::printf("effective config:\n%s\n", EffectiveConfigJson(p.config).c_str());
  std::printf("%s: valid (%zu warning(s))\n", a.path.c_str(), c.warnings.size());
  return kExitOk;
}

}  // namespace

void RegisterConfig(CLI::App& parent, int* exit_code) {
  CLI::App* config =
      parent.add_subcommand("config", "Work with DeepSpeed configs (ds_config.json)");
  config->require_subcommand(1);
  auto args = std::make_shared<ConfigCheckArgs>();
  CLI::App* check = config->add_subcommand(
      "check",
      "Validate a DeepSpeed config as strata reads it: errors (JSON path, what was expected), "
      "warnings (what will happen instead), keys kept but not acted on, and the effective "
      "config with DeepSpeed's defaults. Exit 0 valid, 1 invalid, 2 usage error.");
  check->add_option("config", args->path, "DeepSpeed JSON config (comments allowed)")->required();
  check
      ->add_option("--world-size", args->world_size,
                   "Data-parallel ranks: checks train_batch_size = micro * grad_accum * N and "
                   "derives the missing one")
      ->check(AtLeast(1, true, true));
  check
      ->add_option("--hidden-size", args->hidden_size,
                   "Model hidden size: fills the zero_optimization \"auto\" sizes as Hugging Face "
                   "does (h*h, 0.9*h*h, 10*h)")
      ->check(AtLeast(1, true, true));
  check
      ->add_option("--set", args->set,
                   "KEY=VALUE for an \"auto\" (or an absent batch size): dotted JSON path, JSON "
                   "value (text that is not JSON is a string); repeatable, e.g. --set "
                   "train_micro_batch_size_per_gpu=4 --set optimizer.params.lr=1e-4 --set "
                   "bf16.enabled=true. A key that is not \"auto\" is left as the config "
                   "has it (said in the output)")
      ->allow_extra_args(false);
  check->add_flag("--require-resolved", args->require_resolved,
                  "An \"auto\" left unresolved is an error (what a run needs)");
  check->add_flag("--strict", args->strict, "Turn every warning into an error");
  CLI::Option* here =
      check->add_flag("--here", args->here,
                      "Also check this machine: each nvme_path in use exists and is a writable "
                      "directory, and its free space");
  check
      ->add_option("--params", args->params,
                   "With --here: the model's parameter count (7e9, 7B, 350M), to compare what "
                   "the engine puts on each nvme_path (the planner's placement of the configured "
                   "setting, --world-size ranks on this machine) with its free space")
      ->needs(here)
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            auto v = ParseParamCount(s);
            return v.ok() ? std::string() : std::string(v.status().message());
          },
          "COUNT"));
  check->add_flag("--json", args->json, "Print the result as JSON");
  check->callback([args, exit_code] { *exit_code = RunCheck(*args); });
}

}  // namespace strata::cli
