// Rendering of a memory plan: see plan_report.h.
#include "core/plan/plan_report.h"

#include <cstdarg>
#include <cstdio>
#include <string>

namespace strata::plan {
namespace {

// printf into a std::string.
[[gnu::format(printf, 2, 3)]] void Out(std::string& s, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  s += buf;
}

std::string Gb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GB", bytes / 1e9);
  return buf;
}

std::string Count(double n) {
  char buf[32];
  if (n >= 1e12) {
    std::snprintf(buf, sizeof(buf), "%.3gT", n / 1e12);
  } else if (n >= 1e9) {
    std::snprintf(buf, sizeof(buf), "%.3gB", n / 1e9);
  } else if (n >= 1e6) {
    std::snprintf(buf, sizeof(buf), "%.3gM", n / 1e6);
  } else {
    std::snprintf(buf, sizeof(buf), "%g", n);
  }
  return buf;
}

std::string G(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// Pads to `width` columns, counting UTF-8 code points (Ψ is two bytes, one column).
std::string PadRight(std::string text, size_t width) {
  size_t cols = 0;
  for (unsigned char ch : text) cols += (ch & 0xC0) != 0x80;
  if (cols < width) text.append(width - cols, ' ');
  return text;
}

// Devices as a user reads them: "none" means the state stays on the GPU.
const char* Where(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone:
      return "gpu";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "?";
}

std::string Setting(const Placement& p) {
  std::string s = "stage " + std::to_string(p.stage);
  if (p.offload_optimizer != OffloadDevice::kNone && p.optimizer_ratio < 1.0) {
    // Partial offload: the share of the sub-groups' elements offloaded, and the ratio asked for.
    char share[96];
    std::snprintf(share, sizeof share, ", optimizer %.0f%% on %s (ratio %g)",
                  p.optimizer_offloaded_fraction * 100, Where(p.offload_optimizer),
                  p.optimizer_ratio);
    s += share;
  } else if (p.offload_optimizer != OffloadDevice::kNone) {
    s += std::string(", optimizer on ") + Where(p.offload_optimizer);
  }
  if (p.offload_param != OffloadDevice::kNone) {
    s += std::string(", params on ") + Where(p.offload_param);
  }
  if (p.offload_optimizer == OffloadDevice::kNone && p.offload_param == OffloadDevice::kNone) {
    s += ", no offload";
  }
  return s;
}

std::string FitsWord(const Placement& p) {
  if (p.Fits()) return "yes";
  std::string s = "no (";
  if (!p.fits_hbm) s += "HBM";
  if (!p.fits_host) s += std::string(s.size() > 4 ? "+" : "") + "DRAM";
  if (!p.fits_nvme) s += std::string(s.size() > 4 ? "+" : "") + "NVMe";
  return s + ")";
}

std::string Formula(const Recipe& r, int stage) {
  const double p = r.param_bytes, g = r.grad_bytes, o = r.OptimizerBytes();
  switch (stage) {
    case 0:
      return G(p + g + o) + "Ψ";
    case 1:
      return G(p + g) + "Ψ + " + G(o) + "Ψ/N";
    case 2:
      return G(p) + "Ψ + " + G(g + o) + "Ψ/N";
    default:
      return G(p + g + o) + "Ψ/N";
  }
}

void Header(std::string& s, const Plan& plan, const std::string& config_path) {
  const PlanInput& in = plan.input;
  const Recipe& r = in.recipe;
  const Capacity& c = in.capacity;
  Out(s, "strata memory plan (GB = 1e9 bytes)\n");
  Out(s,
      "  model     %s params (Ψ = %g); recipe %s: params %g + grads %g + master %g + m %g + "
      "v %g = %g B/param\n",
      Count(in.params).c_str(), in.params, r.name.c_str(), r.param_bytes, r.grad_bytes,
      r.master_bytes, r.momentum_bytes, r.variance_bytes, r.TotalBytes());
  Out(s, "  cluster   %d node%s x %d GPUs = %lld data-parallel ranks (N)\n", c.nodes,
      c.nodes == 1 ? "" : "s", c.gpus_per_node, static_cast<long long>(c.Ranks()));
  Out(s, "  capacity  HBM %g GB/GPU, host DRAM %g GB/node, NVMe %g GB/node at %g GB/s\n",
      c.hbm_bytes_per_gpu / 1e9, c.dram_bytes_per_node / 1e9, c.nvme_bytes_per_node / 1e9,
      c.nvme_bytes_per_s_per_node / 1e9);
  Out(s, "  inputs    activations %s/GPU, largest gathered group %s, gradient accumulation %g\n",
      Gb(in.activation_bytes_per_gpu).c_str(),
      in.largest_group_params > 0 ? Count(in.largest_group_params).c_str() : "not given",
      in.zero.gradient_accumulation_steps);
  const ZeroSettings& z = in.zero;
  if (in.has_configured) {
    Out(s, "  config    %s%sstage %d, optimizer on %s, params on %s\n", config_path.c_str(),
        config_path.empty() ? "" : ": ", z.stage, Where(z.offload_optimizer),
        Where(z.offload_param));
  }
  Out(s,
      "  buckets   reduce %s, all-gather %s, prefetch %s, max live %s, sub-group %s "
      "(elements); overlap_comm %s\n",
      Count(z.reduce_bucket_size).c_str(), Count(z.allgather_bucket_size).c_str(),
      Count(z.prefetch_bucket_size).c_str(), Count(z.max_live_parameters).c_str(),
      Count(z.sub_group_size).c_str(),
      z.overlap_comm ? (*z.overlap_comm ? "on" : "off") : "default (on at stage 3)");
}

void LedgerTable(std::string& s, const Plan& plan) {
  Out(s, "\nZeRO model states per GPU (the ledger: no offload, no buffers, no activations)\n");
  Out(s, "  %-5s  %-17s %11s\n", "stage", "formula", "per GPU");
  for (int st = 0; st < 4; ++st) {
    Out(s, "  %-5d  %s %11s\n", st, PadRight(Formula(plan.input.recipe, st), 17).c_str(),
        Gb(plan.ledger_bytes_per_gpu[st]).c_str());
  }
  if (plan.input.trainable_params > 0 && plan.input.trainable_params < plan.input.params) {
    Out(s,
        "  (the ledger counts every parameter trained, as the paper's formulas do; the settings "
        "below train %s of them, the rest frozen)\n",
        Count(plan.input.trainable_params).c_str());
  }
}

void PlacementRow(std::string& s, const std::string& label, const Placement& p) {
  Out(s, "  %-44s %11s %11s %11s  %s\n", label.c_str(), Gb(p.hbm_bytes_per_gpu).c_str(),
      Gb(p.host_bytes_per_node).c_str(), Gb(p.nvme_bytes_per_node).c_str(), FitsWord(p).c_str());
}

void StageTable(std::string& s, const Plan& plan) {
  const ZeroSettings& z = plan.input.zero;
  Out(s, "\nPer stage with optimizer on %s, params on %s (buffers and activations included)\n",
      Where(z.offload_optimizer), Where(z.offload_param));
  Out(s, "  %-44s %11s %11s %11s  %s\n", "setting", "HBM/GPU", "DRAM/node", "NVMe/node", "fits");
  for (const Placement& p : plan.stages) PlacementRow(s, Setting(p), p);
  Out(s, "  collectives per rank and step (ideal ring bytes, one micro-batch):\n");
  for (const Placement& p : plan.stages) {
    Out(s, "    stage %d: %s = %.2fx DDP's all-reduce (%s)", p.stage,
        Gb(p.comm.bytes_per_rank).c_str(), p.comm.ratio, Gb(p.comm.ddp_bytes_per_rank).c_str());
    if (plan.input.capacity.nodes > 1) {
      Out(s, "; inter-node %s (DDP %s)", Gb(p.comm.split.inter_node).c_str(),
          Gb(p.comm.ddp_inter_node_bytes_per_rank).c_str());
    }
    Out(s, "%s\n", p.comm.zero_plus_plus ? "  [ZeRO++]" : "");
  }
  for (const Placement& p : plan.stages) {
    for (const std::string& n : p.notes) Out(s, "  note: stage %d: %s\n", p.stage, n.c_str());
  }
}

// The two stage-3 models side by side: plain and with the configured ZeRO++ settings.
struct Stage3Pair {
  Stage3Comm plain, zpp;
};
Stage3Pair Stage3Models(const PlanInput& in) {
  const Capacity& c = in.capacity;
  const Recipe& r = in.recipe;
  return {ZeroPlusPlusComm(ZeroPlusPlus{}, in.params, r.param_bytes, r.grad_bytes, c.gpus_per_node,
                           c.nodes),
          ZeroPlusPlusComm(in.zero.zero_plus_plus, in.params, r.param_bytes, r.grad_bytes,
                           c.gpus_per_node, c.nodes)};
}

double RatioOr0(double a, double b) { return b > 0 ? a / b : 0; }

void ZeroPlusPlusSection(std::string& s, const Plan& plan) {
  const ZeroPlusPlus& z = plan.input.zero.zero_plus_plus;
  if (!z.Any()) return;
  const Stage3Pair m = Stage3Models(plan.input);
  Out(s,
      "\nZeRO++ at stage 3: qwZ %s, qgZ %s, hpZ %s; INT8 blocks of %g + one fp32 scale\n"
      "  bytes per rank per micro-step, intra-node / inter-node\n",
      z.quantized_weights ? "on" : "off", z.quantized_gradients ? "on" : "off",
      z.hpz_partition_size > 1 ? ("k = " + std::to_string(z.hpz_partition_size)).c_str() : "off",
      z.block);
  Out(s, "  %-24s %25s %25s\n", "collective", "plain stage 3", "ZeRO++");
  const struct {
    const char* name;
    CommBytes plain, zpp;
  } rows[] = {{"param all-gather fwd", m.plain.param_gather_forward, m.zpp.param_gather_forward},
              {"param all-gather bwd", m.plain.param_gather_backward, m.zpp.param_gather_backward},
              {"grad reduce-scatter", m.plain.grad_reduce_scatter, m.zpp.grad_reduce_scatter},
              {"total", m.plain.total, m.zpp.total}};
  for (const auto& r : rows) {
    Out(s, "  %-24s %11s / %11s %11s / %11s\n", r.name, Gb(r.plain.intra_node).c_str(),
        Gb(r.plain.inter_node).c_str(), Gb(r.zpp.intra_node).c_str(), Gb(r.zpp.inter_node).c_str());
  }
  const double ddp = plan.stages[3].comm.ddp_bytes_per_rank;
  Out(s, "  total %.2fx plain stage 3 (%.2fx DDP's all-reduce, plain %.2fx)",
      RatioOr0(m.zpp.total.Total(), m.plain.total.Total()), RatioOr0(m.zpp.total.Total(), ddp),
      RatioOr0(m.plain.total.Total(), ddp));
  if (plan.input.capacity.nodes > 1) {
    Out(s, "; inter-node %.2fx plain stage 3",
        RatioOr0(m.zpp.total.inter_node, m.plain.total.inter_node));
  }
  Out(s, "\n");
  if (m.zpp.hpz_secondary_bytes_per_gpu > 0) {
    Out(s, "  hpZ secondary param copy: %s per GPU in HBM (in the stage-3 figures above)\n",
        Gb(m.zpp.hpz_secondary_bytes_per_gpu).c_str());
  }
}

void TierDetail(std::string& s, const Placement& p, Tier tier, const char* title, double cap) {
  Out(s, "  %s\n", title);
  for (const PlanItem& it : p.items) {
    if (it.tier != tier) continue;
    Out(s, "    %-58s %11s%s\n", it.name.c_str(), Gb(it.bytes).c_str(),
        it.pinned ? "  pinned" : "");
  }
  const double total = tier == Tier::kDevice ? p.hbm_bytes_per_gpu
                       : tier == Tier::kHost ? p.host_bytes_per_node
                                             : p.nvme_bytes_per_node;
  const bool fits = tier == Tier::kDevice ? p.fits_hbm
                    : tier == Tier::kHost ? p.fits_host
                                          : p.fits_nvme;
  Out(s, "    %-58s %11s of %s (%.0f%%) %s\n", "total", Gb(total).c_str(), Gb(cap).c_str(),
      cap > 0 ? 100 * total / cap : 0.0, fits ? "fits" : "DOES NOT FIT");
  if (tier == Tier::kHost && p.host_pinned_bytes_per_node > 0) {
    Out(s, "    %-58s %11s\n", "of which pinned (page-locked)",
        Gb(p.host_pinned_bytes_per_node).c_str());
  }
  if (tier == Tier::kHost && p.host_cache_bytes_per_node > 0) {
    Out(s, "    %-58s %11s\n", "of which cache (the working set is the rest)",
        Gb(p.host_cache_bytes_per_node).c_str());
  }
}

void Traffic(std::string& s, const Plan& plan, const Placement& p, const char* indent) {
  if (p.comm.ddp_bytes_per_rank > 0) {
    Out(s, "%scollectives %s per rank per micro-step (%.2fx DDP's all-reduce)\n", indent,
        Gb(p.comm.bytes_per_rank).c_str(), p.comm.ratio);
  } else {
    Out(s, "%scollectives none (one rank)\n", indent);
  }
  Out(s, "%sper optimizer step (%g micro-step%s): PCIe %s per GPU", indent,
      plan.input.zero.gradient_accumulation_steps,
      plan.input.zero.gradient_accumulation_steps == 1 ? "" : "s",
      Gb(p.pcie_bytes_per_gpu).c_str());
  if (p.nvme_io_bytes_per_node > 0) {
    Out(s, ", NVMe %s per node\n%s  = %.1f s at %g GB/s; %.2f GB/s needed to fit a %g s step",
        Gb(p.nvme_io_bytes_per_node).c_str(), indent, p.nvme_io_seconds,
        plan.input.capacity.nvme_bytes_per_s_per_node / 1e9, p.nvme_required_bytes_per_s / 1e9,
        plan.input.target_step_seconds);
  }
  Out(s, "\n");
}

void Detail(std::string& s, const Plan& plan, const Placement& p, const char* title) {
  const Capacity& c = plan.input.capacity;
  Out(s, "\n%s: %s\n", title, Setting(p).c_str());
  TierDetail(s, p, Tier::kDevice, "HBM per GPU", c.hbm_bytes_per_gpu);
  TierDetail(s, p, Tier::kHost, "host DRAM per node", c.dram_bytes_per_node);
  TierDetail(s, p, Tier::kNvme, "NVMe per node", c.nvme_bytes_per_node);
  Traffic(s, plan, p, "  ");
  for (const std::string& n : p.notes) Out(s, "  note: %s\n", n.c_str());
}

void Ladder(std::string& s, const Plan& plan) {
  Out(s, "\nRecommendation: the first setting that fits, tried in this order\n");
  Out(s, "  %-44s %11s %11s %11s  %s\n", "setting", "HBM/GPU", "DRAM/node", "NVMe/node", "fits");
  for (size_t i = 0; i < plan.ladder.size(); ++i) {
    std::string row;
    PlacementRow(row, Setting(plan.ladder[i]), plan.ladder[i]);
    row.pop_back();
    if (plan.recommended == i) row += "   <- recommended";
    s += row + "\n";
    const Placement& p = plan.ladder[i];
    if (p.nvme_io_bytes_per_node > 0) {
      Out(s, "      NVMe IO %s per node per step: %.1f s at %g GB/s, %.2f GB/s for a %g s step\n",
          Gb(p.nvme_io_bytes_per_node).c_str(), p.nvme_io_seconds,
          plan.input.capacity.nvme_bytes_per_s_per_node / 1e9, p.nvme_required_bytes_per_s / 1e9,
          plan.input.target_step_seconds);
    }
  }
  if (!plan.recommended) {
    Out(s, "  -> nothing fits: add GPUs or nodes, more host DRAM or NVMe, or shrink the model\n");
    return;
  }
  const Placement& r = plan.ladder[*plan.recommended];
  Out(s, "  -> %s: HBM %s of %s per GPU", Setting(r).c_str(), Gb(r.hbm_bytes_per_gpu).c_str(),
      Gb(plan.input.capacity.hbm_bytes_per_gpu).c_str());
  if (r.host_bytes_per_node > 0) Out(s, ", DRAM %s per node", Gb(r.host_bytes_per_node).c_str());
  if (r.nvme_bytes_per_node > 0) Out(s, ", NVMe %s per node", Gb(r.nvme_bytes_per_node).c_str());
  Out(s, "\n");
  Traffic(s, plan, r, "     ");
  if (plan.configured && (plan.configured->stage != r.stage ||
                          plan.configured->offload_optimizer != r.offload_optimizer ||
                          plan.configured->offload_param != r.offload_param ||
                          plan.configured->optimizer_ratio != r.optimizer_ratio)) {
    const Placement& c = *plan.configured;
    if (c.Fits()) {
      Out(s,
          "     the configured %s fits too: PCIe %s per GPU per step and %.2fx DDP's "
          "collective bytes, against %s and %.2fx for the recommended one\n",
          Setting(c).c_str(), Gb(c.pcie_bytes_per_gpu).c_str(), c.comm.ratio,
          Gb(r.pcie_bytes_per_gpu).c_str(), r.comm.ratio);
    } else {
      Out(s, "     the configured %s does not fit: %s\n", Setting(c).c_str(), FitsWord(c).c_str());
    }
  }
}

}  // namespace

std::string PlanToText(const Plan& plan, const std::string& config_path,
                       const std::vector<std::string>& notes) {
  std::string s;
  Header(s, plan, config_path);
  for (const std::string& n : notes) Out(s, "  note: %s\n", n.c_str());
  LedgerTable(s, plan);
  StageTable(s, plan);
  ZeroPlusPlusSection(s, plan);
  if (plan.configured) {
    Detail(s, plan, *plan.configured, "Configured setting");
  } else if (plan.recommended) {
    Detail(s, plan, plan.ladder[*plan.recommended], "Recommended setting");
  }
  Ladder(s, plan);
  if (plan.configured) {
    Out(s, "\nVerdict: the configured %s %s\n", Setting(*plan.configured).c_str(),
        plan.fits ? "FITS" : "DOES NOT FIT");
  } else {
    Out(s, "\nVerdict: %s\n", plan.fits ? "FITS (with the recommended setting)" : "DOES NOT FIT");
  }
  return s;
}

namespace {

nlohmann::json SplitJson(const CommBytes& c) {
  return {{"intra_node_bytes", c.intra_node},
          {"inter_node_bytes", c.inter_node},
          {"total_bytes", c.Total()}};
}

nlohmann::json Stage3Json(const Stage3Comm& c) {
  return {{"param_gather_forward", SplitJson(c.param_gather_forward)},
          {"param_gather_backward", SplitJson(c.param_gather_backward)},
          {"grad_reduce_scatter", SplitJson(c.grad_reduce_scatter)},
          {"total", SplitJson(c.total)},
          {"hpz_secondary_bytes_per_gpu", c.hpz_secondary_bytes_per_gpu}};
}

// ZeRO++ settings and the stage-3 collectives per rank and micro-step, plain and with them.
nlohmann::json ZeroPlusPlusJson(const Plan& plan) {
  const ZeroPlusPlus& z = plan.input.zero.zero_plus_plus;
  const Stage3Pair m = Stage3Models(plan.input);
  const double ddp = plan.stages[3].comm.ddp_bytes_per_rank;
  return {{"zero_quantized_weights", z.quantized_weights},
          {"zero_quantized_gradients", z.quantized_gradients},
          {"zero_hpz_partition_size", z.hpz_partition_size},
          {"quant_block", z.block},
          {"plain_stage3", Stage3Json(m.plain)},
          {"stage3", Stage3Json(m.zpp)},
          {"ratio_to_plain_stage3", RatioOr0(m.zpp.total.Total(), m.plain.total.Total())},
          {"inter_node_ratio_to_plain_stage3",
           RatioOr0(m.zpp.total.inter_node, m.plain.total.inter_node)},
          {"ratio_to_ddp", RatioOr0(m.zpp.total.Total(), ddp)}};
}

nlohmann::json PlacementJson(const Placement& p) {
  nlohmann::json items = nlohmann::json::array();
  for (const PlanItem& it : p.items) {
    items.push_back({{"tier", TierName(it.tier)},
                     {"name", it.name},
                     {"bytes", it.bytes},
                     {"pinned", it.pinned}});
  }
  return {{"stage", p.stage},
          {"offload_optimizer", OffloadDeviceName(p.offload_optimizer)},
          {"offload_param", OffloadDeviceName(p.offload_param)},
          {"optimizer_ratio", p.optimizer_ratio},
          {"optimizer_offloaded_fraction", p.optimizer_offloaded_fraction},
          {"hbm_bytes_per_gpu", p.hbm_bytes_per_gpu},
          {"host_bytes_per_node", p.host_bytes_per_node},
          {"host_pinned_bytes_per_node", p.host_pinned_bytes_per_node},
          {"host_cache_bytes_per_node", p.host_cache_bytes_per_node},
          {"nvme_bytes_per_node", p.nvme_bytes_per_node},
          {"comm",
           {{"bytes_per_rank", p.comm.bytes_per_rank},
            {"ddp_bytes_per_rank", p.comm.ddp_bytes_per_rank},
            {"ratio_to_ddp", p.comm.ratio},
            {"intra_node_bytes_per_rank", p.comm.split.intra_node},
            {"inter_node_bytes_per_rank", p.comm.split.inter_node},
            {"ddp_inter_node_bytes_per_rank", p.comm.ddp_inter_node_bytes_per_rank},
            {"zero_plus_plus", p.comm.zero_plus_plus}}},
          {"pcie_bytes_per_gpu", p.pcie_bytes_per_gpu},
          {"nvme_io_bytes_per_node", p.nvme_io_bytes_per_node},
          {"nvme_io_seconds", p.nvme_io_seconds},
          {"nvme_required_bytes_per_s", p.nvme_required_bytes_per_s},
          {"fits", p.Fits()},
          {"fits_hbm", p.fits_hbm},
          {"fits_host", p.fits_host},
          {"fits_nvme", p.fits_nvme},
          {"items", items},
          {"notes", p.notes}};
}

}  // namespace

nlohmann::json PlanToJson(const Plan& plan, const std::string& config_path,
                          const std::vector<std::string>& notes) {
  const PlanInput& in = plan.input;
  const Recipe& r = in.recipe;
  const Capacity& c = in.capacity;
  const ZeroSettings& z = in.zero;
  nlohmann::json j;
  j["input"] = {
      {"params", in.params},
      {"gpus_per_node", c.gpus_per_node},
      {"nodes", c.nodes},
      {"ranks", c.Ranks()},
      {"recipe",
       {{"name", r.name},
        {"param_bytes", r.param_bytes},
        {"grad_bytes", r.grad_bytes},
        {"master_bytes", r.master_bytes},
        {"momentum_bytes", r.momentum_bytes},
        {"variance_bytes", r.variance_bytes},
        {"total_bytes", r.TotalBytes()}}},
      {"capacity",
       {{"hbm_bytes_per_gpu", c.hbm_bytes_per_gpu},
        {"dram_bytes_per_node", c.dram_bytes_per_node},
        {"nvme_bytes_per_node", c.nvme_bytes_per_node},
        {"nvme_bytes_per_s_per_node", c.nvme_bytes_per_s_per_node}}},
      {"activation_bytes_per_gpu", in.activation_bytes_per_gpu},
      {"largest_group_params", in.largest_group_params},
      {"target_step_seconds", in.target_step_seconds},
      {"config", config_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(config_path)},
      {"zero",
       {{"stage", z.stage},
        {"offload_optimizer", OffloadDeviceName(z.offload_optimizer)},
        {"offload_param", OffloadDeviceName(z.offload_param)},
        {"overlap_comm", z.overlap_comm ? nlohmann::json(*z.overlap_comm) : nullptr},
        {"reduce_bucket_size", z.reduce_bucket_size},
        {"allgather_bucket_size", z.allgather_bucket_size},
        {"stage3_prefetch_bucket_size", z.prefetch_bucket_size},
        {"stage3_max_live_parameters", z.max_live_parameters},
        {"sub_group_size", z.sub_group_size},
        {"gradient_accumulation_steps", z.gradient_accumulation_steps},
        {"zero_quantized_weights", z.zero_plus_plus.quantized_weights},
        {"zero_quantized_gradients", z.zero_plus_plus.quantized_gradients},
        {"zero_hpz_partition_size", z.zero_plus_plus.hpz_partition_size}}}};
  j["ledger"] = nlohmann::json::array();
  for (int st = 0; st < 4; ++st) {
    j["ledger"].push_back({{"stage", st},
                           {"formula", Formula(r, st)},
                           {"bytes_per_gpu", plan.ledger_bytes_per_gpu[st]}});
  }
  j["stages"] = nlohmann::json::array();
  for (const Placement& p : plan.stages) j["stages"].push_back(PlacementJson(p));
  j["configured"] = plan.configured ? PlacementJson(*plan.configured) : nullptr;
  j["ladder"] = nlohmann::json::array();
  for (const Placement& p : plan.ladder) j["ladder"].push_back(PlacementJson(p));
  j["recommended"] = plan.recommended ? nlohmann::json(*plan.recommended) : nullptr;
  j["zero_plus_plus"] = ZeroPlusPlusJson(plan);
  j["fits"] = plan.fits;
  j["notes"] = notes;
  return j;
}

}  // namespace strata::plan
