// `offloadctl plan`: the ZeRO memory plan of a model on a cluster, as a readable report or JSON.
// Exit codes: 0 the configured setting (or, without one, some setting) fits; 1 it does not fit
// or the config is invalid; 2 usage error.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/plan/plan_report.h"
#include "strata/planner.h"
#include "tools/offloadctl/cli_checks.h"
#include "tools/offloadctl/cli_flags.h"
#include "tools/offloadctl/commands.h"

namespace strata::cli {
namespace {

struct PlanFlags {
  std::string params;
  std::string trainable;
  int gpus = 8;
  int nodes = 1;
  double hbm_gb = 80;
  double dram_gb = 1024;
  double nvme_gb = 3840;
  double nvme_gbps = 6;
  double activations_gb = 0;
  std::string largest_group;
  std::string recipe;
  std::string config;
  int stage = -1;
  std::string offload_optimizer;
  std::string offload_param;
  double offload_ratio = -1;  // -1: as the config says
  double grad_accum = 0;
  double step_seconds = 10;
  bool json = false;
  // ZeRO++ overrides of the config (-1 / "" : as the config says).
  std::string quantized_weights, quantized_gradients;
  int64_t hpz = -1;
};

int Usage(const PlanFlags& f, const std::string& msg) {
  return Failure("plan", msg, kExitUsage, f.json);
}

// Builds the PlanInput: defaults, then the config file, then the flags that override it.
// Returns an exit code on failure, -1 on success.
int BuildInput(const PlanFlags& f, PlanInput* in, std::vector<std::string>* notes) {
  auto psi = ParseParamCount(f.params);
  if (!psi.ok()) return Usage(f, "--params: " + std::string(psi.status().message()));
  in->params = *psi;
  // Plain digits only: "7" for 7B (a count with a unit or an exponent says what it means).
  const bool unit = std::any_of(f.params.begin(), f.params.end(), [](char ch) {
    return std::isalpha(static_cast<unsigned char>(ch));
  });
  if (*psi < 1e6 && !unit) {
    notes->push_back("--params " + f.params + " is " + std::to_string(static_cast<int64_t>(*psi)) +
                     " parameters: a model's count takes a unit (" + f.params + "M, " + f.params +
                     "B)");
  }
  if (f.gpus < 1) return Usage(f, "--gpus must be >= 1");
  if (f.nodes < 1) return Usage(f, "--nodes must be >= 1");
  in->capacity.gpus_per_node = f.gpus;
  in->capacity.nodes = f.nodes;
  in->capacity.hbm_bytes_per_gpu = f.hbm_gb * 1e9;
  in->capacity.dram_bytes_per_node = f.dram_gb * 1e9;
  in->capacity.nvme_bytes_per_node = f.nvme_gb * 1e9;
  in->capacity.nvme_bytes_per_s_per_node = f.nvme_gbps * 1e9;
  in->activation_bytes_per_gpu = f.activations_gb * 1e9;
  in->target_step_seconds = f.step_seconds;
  if (!f.trainable.empty()) {
    auto t = ParseParamCount(f.trainable);
    if (!t.ok()) return Usage(f, "--trainable: " + std::string(t.status().message()));
    in->trainable_params = *t;
  }
  if (!f.largest_group.empty()) {
    auto g = ParseParamCount(f.largest_group);
    if (!g.ok()) return Usage(f, "--largest-group: " + std::string(g.status().message()));
    in->largest_group_params = *g;
  }
  // The cluster first: the config's batch-size check needs N, and it must be a valid N.
  if (Status valid = ValidatePlanInput(*in); !valid.ok())
    return Usage(f, std::string(valid.message()));
  if (!f.config.empty()) {
    Status s = ApplyDeepSpeedConfigFile(f.config, in, notes);
    // Every flag applied so far is valid: what fails now is the config (its JSON path named),
    // and an invalid config exits 1 whichever rule caught it.
    if (s.ok()) s = ValidatePlanInput(*in);
    if (!s.ok()) {
      return Failure("plan", "--config " + f.config + ": " + s.ToString(), kExitInvalid, f.json);
    }
  }
  if (!f.recipe.empty()) {
    auto r = ParseRecipe(f.recipe);
    if (!r.ok()) return Usage(f, "--recipe: " + std::string(r.status().message()));
    in->recipe = *r;
  }
  if (f.stage >= 0) {
    in->zero.stage = f.stage;
    in->has_configured = true;
  }
  for (auto [flag, value, dst] :
       {std::tuple{"--offload-optimizer", &f.offload_optimizer, &in->zero.offload_optimizer},
        std::tuple{"--offload-param", &f.offload_param, &in->zero.offload_param}}) {
    if (value->empty()) continue;
    auto d = ParseOffloadDevice(*value);
    if (!d)
      return Usage(f, std::string(flag) + ": expected none, cpu or nvme, got '" + *value + "'");
    *dst = *d;
    in->has_configured = true;
  }
  if (f.offload_ratio >= 0) {
    if (in->zero.offload_optimizer == OffloadDevice::kNone) {
      return Usage(
          f,
          "--offload-ratio: the share of the optimizer offloaded (DeepSpeed's "
          "offload_optimizer.ratio) needs an offloaded optimizer: add --offload-optimizer cpu "
          "(or nvme), or a config that offloads it");
    }
    in->zero.optimizer_ratio = f.offload_ratio;
    in->has_configured = true;
  }
  if (f.grad_accum > 0 && f.grad_accum != std::floor(f.grad_accum)) {
    char given[32];
    std::snprintf(given, sizeof(given), "%g", f.grad_accum);
    return Usage(f, std::string("--grad-accum: a whole number of micro-steps, not ") + given);
  }
  if (f.grad_accum > 0) in->zero.gradient_accumulation_steps = f.grad_accum;
  ZeroPlusPlus& zpp = in->zero.zero_plus_plus;
  for (auto [flag, value, dst] :
       {std::tuple{"--zero-quantized-weights", &f.quantized_weights, &zpp.quantized_weights},
        std::tuple{"--zero-quantized-gradients", &f.quantized_gradients,
                   &zpp.quantized_gradients}}) {
    if (value->empty()) continue;
    if (*value != "true" && *value != "false") {
      return Usage(f, std::string(flag) + ": expected true or false, got '" + *value + "'");
    }
    *dst = *value == "true";
  }
  if (f.hpz >= 0) zpp.hpz_partition_size = f.hpz;
  Status valid = ValidatePlanInput(*in);
  if (!valid.ok()) return Usage(f, std::string(valid.message()));
  return -1;
}

int RunPlan(const PlanFlags& f) {
  PlanInput in;
  std::vector<std::string> notes;
  if (int rc = BuildInput(f, &in, &notes); rc >= 0) return rc;
  auto plan = MakePlan(in);
  if (!plan.ok()) return Usage(f, std::string(plan.status().message()));
  if (in.largest_group_params == 0) {
    notes.push_back(
        "the largest gathered group is not given (--largest-group): the device's gradient "
        "buffers and gathered groups assume groups of reduce_bucket_size elements (DeepSpeed's "
        "largest reduction unit); strata reduces and gathers per group");
  }
  if (in.activation_bytes_per_gpu == 0) {
    notes.push_back("activations are not given (--activations-gb): HBM figures exclude them");
  }
  if (f.json) {
    std::printf("%s\n", plan::PlanToJson(*plan, f.config, notes).dump(2).c_str());
  } else {
    std::fputs(plan::PlanToText(*plan, f.config, notes).c_str(), stdout);
  }
  return plan->fits ? kExitOk : kExitInvalid;
}

}  // namespace

void RegisterPlan(CLI::App& parent, int* exit_code) {
  auto f = std::make_shared<PlanFlags>();
  CLI::App* cmd = parent.add_subcommand(
      "plan",
      "Plan memory for training a model with ZeRO: the ledger per stage, bytes per tier (HBM, "
      "host DRAM, NVMe) under the offload settings, comm volume (intra/inter-node, ZeRO++), "
      "verdict, recommendation");
  cmd->footer(
      "The recommendation is the first setting that fits, in this order: the lowest stage "
      "without offload, then stage 3 with the optimizer on cpu, then params on cpu too, NVMe "
      "last (with its traffic per step and the bandwidth it needs). GB = 1e9 bytes.\n"
      "Exit: 0 fits, 1 does not fit (or invalid --config), 2 usage error. 'Fits' judges the "
      "configured setting when --config, --stage or --offload-* is given, else the "
      "recommendation.");
  cmd->add_option("--params", f->params,
                  "Model parameter count: 7e9, 7000000000, 7B, 350M, 1.5T (k/M/B/T suffixes)")
      ->required();
  cmd->add_option("--trainable", f->trainable,
                  "Parameters that train (a LoRA fine-tune: the adapters' count); the rest are "
                  "frozen and cost their working params only. Default: all of --params");
  cmd->add_option("--gpus", f->gpus, "GPUs per node (data-parallel ranks per node)")
      ->capture_default_str();
  cmd->add_option("--nodes", f->nodes, "Number of nodes; N = gpus x nodes ranks")
      ->capture_default_str();
  cmd->add_option("--hbm-gb", f->hbm_gb,
                  "Usable HBM per GPU in GB (default: H100/H200-class 80 GB; subtract the CUDA "
                  "context and allocator slack)")
      ->capture_default_str()
      ->check(AtLeast(0));
  cmd->add_option(
         "--dram-gb", f->dram_gb,
         "Host DRAM per node the engine may use (its host budgets), GB; what the working set "
         "leaves is planned as the store's cache of NVMe-homed blocks")
      ->capture_default_str()
      ->check(AtLeast(0));
  cmd->add_option("--nvme-gb", f->nvme_gb,
                  "Usable NVMe space per node in GB (default: one 3.84 TB drive)")
      ->capture_default_str()
      ->check(AtLeast(0));
  cmd->add_option("--nvme-gbps", f->nvme_gbps,
                  "Aggregate NVMe bandwidth per node in GB/s, to time NVMe traffic per step "
                  "(default: one PCIe Gen4 drive; measure yours with offloadctl bench)")
      ->capture_default_str()
      ->check(AtLeast(0, false));
  cmd->add_option("--activations-gb", f->activations_gb,
                  "Activation memory per GPU in GB, your estimate (not guessed by the planner)")
      ->capture_default_str()
      ->check(AtLeast(0));
  cmd->add_option("--largest-group", f->largest_group,
                  "Parameters in the largest gathered group (a layer or the embedding), e.g. "
                  "131M; counted in the stage-3 gathered set");
  cmd->add_option("--recipe", f->recipe,
                  "Bytes per parameter: bf16-adam (2+2+4+4+4, default), fp16-adam, fp32-grads, "
                  "no-master, bf16-pure, adam8bit, fp32, or P:G:MASTER:M:V (e.g. 2:4:4:4:4). "
                  "With --config the default follows its bf16/fp16 sections");
  cmd->add_option("--config", f->config,
                  "DeepSpeed config (ds_config.json): stage, offload settings, buckets, "
                  "gradient_accumulation_steps, precision")
      ->check(CLI::ExistingFile);
  cmd->add_option("--stage", f->stage, "ZeRO stage 0-3 to check (overrides --config)")
      ->check(CLI::Range(0, 3));
  cmd->add_option("--offload-optimizer", f->offload_optimizer,
                  "Optimizer state device to check: none, cpu, nvme (overrides --config)");
  cmd->add_option("--offload-param", f->offload_param,
                  "Parameter device to check: none, cpu, nvme (overrides --config)");
  cmd->add_option("--offload-ratio", f->offload_ratio,
                  "offload_optimizer.ratio to check, 0-1 (overrides --config): the share of the "
                  "optimizer offloaded at stage 3, the rest on the GPU (partial offload)")
      ->check(cli::Between(0.0, 1.0));
  cmd->add_option("--grad-accum", f->grad_accum,
                  "Gradient accumulation steps (overrides --config; default 1): scales the "
                  "per-step PCIe and NVMe traffic")
      ->check(AtLeast(0, false));
  cmd->add_option("--step-seconds", f->step_seconds,
                  "Target optimizer-step time in seconds: the NVMe bandwidth needed is the NVMe "
                  "traffic per step divided by this")
      ->capture_default_str()
      ->check(AtLeast(0, false));
  cmd->add_option("--zero-quantized-weights", f->quantized_weights,
                  "ZeRO++ qwZ, true or false (overrides --config): stage-3 param all-gathers in "
                  "INT8 + one fp32 scale per 4096 elements");
  cmd->add_option("--zero-quantized-gradients", f->quantized_gradients,
                  "ZeRO++ qgZ, true or false (overrides --config): INT8 hierarchical gradient "
                  "reduce-scatter (all-to-all within the node, then across nodes)");
  cmd->add_option("--zero-hpz-partition-size", f->hpz,
                  "ZeRO++ hpZ group size k (overrides --config; 1 = off): a secondary 1/k copy "
                  "of the 16-bit params per GPU, so the backward all-gather stays in the group")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  cmd->add_flag("--json", f->json, "Print the plan as JSON (bytes, not GB)");
  cmd->callback([f, exit_code] { *exit_code = RunPlan(*f); });
}

}  // namespace strata::cli
