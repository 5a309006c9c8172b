// strata._strata.check_config / plan: the config checker and the memory planner, no torch needed.
#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "core/plan/plan_report.h"
#include "core/zero/lr_schedule.h"
#include "python/src/binding_util.h"
#include "strata/config.h"
#include "strata/planner.h"

namespace nb = nanobind;

namespace strata::python {
namespace {

// `located`: the text checked is the user's (a file, JSON text), so lines and columns mean
// something; a dict serialized here has none worth naming (the path names the key).
nb::list Diagnostics(const std::vector<ConfigDiagnostic>& ds, bool located) {
  nb::list out;
  for (ConfigDiagnostic d : ds) {
    if (!located) d.line = d.column = 0;
    nb::dict e;
    e["kind"] = std::string(DiagnosticKindName(d.kind));
    e["path"] = d.path;
    e["message"] = d.message;
    e["line"] = d.line;
    e["column"] = d.column;
    e["text"] = d.ToString();
    out.append(e);
  }
  return out;
}

ParseOptions MakeParseOptions(std::optional<int64_t> world_size, bool strict, bool check_here,
                              const std::map<std::string, std::string>& auto_values,
                              std::optional<int64_t> hidden_size, bool trainer_fills_auto = true) {
  ParseOptions o;
  o.trainer_fills_auto = trainer_fills_auto;
  o.world_size = world_size;
  o.strict = strict;
  o.check_here = check_here;
  o.auto_values = auto_values;
  o.hidden_size = hidden_size;
  return o;
}

// Checks `text` (JSON; `path` non-empty: read that file instead). Never raises for config
// findings: they are in the returned dict; raises StrataError when the file cannot be read.
nb::dict CheckConfig(const std::string& text, const std::string& path,
                     std::optional<int64_t> world_size, bool strict, bool check_here,
                     const std::map<std::string, std::string>& auto_values,
                     std::optional<int64_t> hidden_size, std::optional<double> params,
                     bool trainer_fills_auto, bool located) {
  ParseOptions o = MakeParseOptions(world_size, strict, check_here, auto_values, hidden_size,
                                    trainer_fills_auto);
  ConfigCheck c = path.empty() ? CheckDeepSpeedConfig(text, o)
                               : ValueOrThrow(CheckDeepSpeedConfigFile(path, o));
  if (params) {
    if (!(*params > 0)) ThrowIfError(Status::InvalidArgument("params must be > 0"));
    CheckNvmeSpace(*params, std::max<int64_t>(1, world_size.value_or(1)), strict, &c);
  }
  nb::dict d;
  d["ok"] = c.ok();
  d["errors"] = Diagnostics(c.errors, located);
  d["warnings"] = Diagnostics(c.warnings, located);
  d["notes"] = nb::cast(c.notes);
  nb::list paths;
  for (const NvmePathSpace& n : c.nvme_paths) {
    nb::dict e;
    e["key"] = n.key;
    e["dir"] = n.dir;
    e["free_bytes"] = n.free_bytes;
    paths.append(e);
  }
  d["nvme_paths"] = paths;
  if (c.parsed) {
    d["effective_json"] = EffectiveConfigJson(c.parsed->config);
    d["normalized_json"] = c.parsed->normalized_json;
    d["unresolved_auto"] = nb::cast(c.parsed->unresolved_auto);
    d["dropped_auto"] = nb::cast(c.parsed->dropped_auto);
  }
  return d;
}

// The plan as (json text, report text, fits). Mirrors `offloadctl plan`'s flags.
std::tuple<std::string, std::string, bool> MakePlanBinding(
    double params, const std::string& config_path, int stage, const std::string& offload_optimizer,
    const std::string& offload_param, int gpus, int nodes, double hbm_gb, double dram_gb,
    double nvme_gb, double nvme_gbps, double largest_group, double activations_gb,
    int grad_accum, const std::string& recipe, double trainable) {
  PlanInput in;
  std::vector<std::string> notes;
  in.params = params;
  in.capacity.gpus_per_node = gpus;
  in.capacity.nodes = nodes;
  in.capacity.hbm_bytes_per_gpu = hbm_gb * 1e9;
  in.capacity.dram_bytes_per_node = dram_gb * 1e9;
  in.capacity.nvme_bytes_per_node = nvme_gb * 1e9;
  in.capacity.nvme_bytes_per_s_per_node = nvme_gbps * 1e9;
  in.activation_bytes_per_gpu = activations_gb * 1e9;
  in.largest_group_params = largest_group;
  in.trainable_params = trainable;
  if (gpus < 1 || nodes < 1) ThrowIfError(Status::InvalidArgument("gpus and nodes must be >= 1"));
  if (!config_path.empty()) ThrowIfError(ApplyDeepSpeedConfigFile(config_path, &in, &notes));
  if (!recipe.empty()) in.recipe = ValueOrThrow(ParseRecipe(recipe));
  if (stage >= 0) {
    in.zero.stage = stage;
    in.has_configured = true;
  }
  for (auto [name, value, dst] :
       {std::tuple{"offload_optimizer", &offload_optimizer, &in.zero.offload_optimizer},
        std::tuple{"offload_param", &offload_param, &in.zero.offload_param}}) {
    if (value->empty()) continue;
    auto dev = ParseOffloadDevice(*value);
    if (!dev) {
      ThrowIfError(Status::InvalidArgument(std::string(name) + ": expected none, cpu or nvme, got '" +
                                           *value + "'"));
    }
    *dst = *dev;
    in.has_configured = true;
  }
  if (grad_accum > 0) in.zero.gradient_accumulation_steps = grad_accum;
  ThrowIfError(ValidatePlanInput(in));
  Plan plan = ValueOrThrow(MakePlan(in));
  return {plan::PlanToJson(plan, config_path, notes).dump(),
          plan::PlanToText(plan, config_path, notes), plan.fits};
}

}  // namespace

// The config's scheduler as the engine runs it, for strata.runtime.lr_schedules' classes.
zero::LrSchedule MakeLrSchedule(const std::string& config_json) {
  ParsedConfig parsed = ValueOrThrow(ParseDeepSpeedConfig(config_json));
  return ValueOrThrow(zero::LrSchedule::FromConfig(parsed.config));
}

void BindConfig(nb::module_& m) {
  nb::class_<zero::LrSchedule>(m, "LrSchedule",
                               "zero::LrSchedule: a config's scheduler section as the engine runs "
                               "it (core/zero/lr_schedule.h), by DeepSpeed's last_batch_iteration.")
      .def(nb::new_(&MakeLrSchedule), nb::arg("config_json"))
      .def("lr_at", &zero::LrSchedule::LrAt, nb::arg("t"), nb::arg("group_lr") = nb::none(),
           "The lr at last_batch_iteration t (t < 0: before the first step) of the group whose "
           "own lr is group_lr (None: optimizer.lr's).")
      .def("betas_at", &zero::LrSchedule::BetasAt, nb::arg("t"),
           "OneCycle's (beta1, beta2) at t, or None where the schedule leaves them.")
      .def_prop_ro("notes", &zero::LrSchedule::notes)
      .def("__repr__", &zero::LrSchedule::Describe);
  m.def("check_config", &CheckConfig, nb::arg("text"), nb::arg("path") = "",
        nb::arg("world_size") = nb::none(), nb::arg("strict") = false,
        nb::arg("check_here") = false,
        nb::arg("auto_values") = std::map<std::string, std::string>{},
        nb::arg("hidden_size") = nb::none(), nb::arg("params") = nb::none(),
        nb::arg("trainer_fills_auto") = true, nb::arg("located") = true,
        "Checks a DeepSpeed config (JSON text, or the file at `path`); returns a dict of "
        "ok, errors, warnings, notes, nvme_paths and the effective config. With check_here "
        "and params: each nvme_path's free space against what the engine puts there. "
        "trainer_fills_auto=False: no trainer fills the \"auto\" left (ParseOptions).");
  m.def("plan", &MakePlanBinding, nb::arg("params"), nb::arg("config_path") = "",
        nb::arg("stage") = -1, nb::arg("offload_optimizer") = "", nb::arg("offload_param") = "",
        nb::arg("gpus") = 8, nb::arg("nodes") = 1, nb::arg("hbm_gb") = 80.0,
        nb::arg("dram_gb") = 1024.0, nb::arg("nvme_gb") = 3840.0, nb::arg("nvme_gbps") = 6.0,
        nb::arg("largest_group") = 0.0, nb::arg("activations_gb") = 0.0,
        nb::arg("grad_accum") = 0, nb::arg("recipe") = "", nb::arg("trainable") = 0.0,
        "The ZeRO memory plan (as `offloadctl plan`): (json text, report text, fits).");
}

}  // namespace strata::python
