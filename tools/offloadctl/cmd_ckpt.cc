// `offloadctl ckpt inspect|verify|export`: engine checkpoints (core/zero/checkpoint_format.h)
// without an engine.
//   inspect DIR [--tag T] [--json]   what is in it: step, world size, stage, precision, where the
//                                    states lived, tensors, bytes per state kind and per rank
//   verify DIR [--tag T]             every file present with its size and XXH3; exit 0 valid,
//                                    1 damaged (naming the first bad file), 2 usage
//   export DIR --out F [--tag T] [--dtype bf16|fp16|fp32]
//                                    one safetensors file of the full parameters from the fp32
//                                    masters, named as the trainer named them
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/zero/checkpoint_format.h"
#include "strata/dtype.h"
#include "tools/offloadctl/commands.h"

namespace strata::cli {
namespace {

namespace ckpt = zero::ckpt;

struct CkptArgs {
  std::string dir, tag, out, dtype = "bf16";
  bool json = false;
};

int Fail(const char* cmd, const Status& st) {
  std::fprintf(stderr, "offloadctl ckpt %s: %s\n", cmd, st.ToString().c_str());
  return kExitInvalid;
}

int RunInspect(const CkptArgs& a) {
  auto tag = ckpt::ResolveTag(a.dir, a.tag);
  if (!tag.ok()) return Fail("inspect", tag.status());
  auto m = ckpt::ReadManifest(a.dir, *tag);
  if (!m.ok()) return Fail("inspect", m.status());
  uint64_t params = 0;
  for (const auto& g : m->groups) params += g.numel;
  std::map<std::string, uint64_t> per_kind;
  for (const auto& g : m->groups) {
    for (size_t k = 0; k < ckpt::kNumStateKinds; ++k) {
      per_kind[ckpt::kStateKinds[k]] += g.shard_elems * m->ElemBytes(k) * m->world_size;
    }
  }
  uint64_t total = 0;
  for (const auto& f : m->files) total += f.size_bytes;
  if (a.json) {
    nlohmann::json j = nlohmann::json::parse(m->ToJson());
    j.erase("config");
    j["params"] = params;
    j["tensors"] = m->groups.size() * ckpt::kNumStateKinds * m->world_size;
    j["bytes_per_state_kind"] = per_kind;
    j["total_bytes"] = total;
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }
  std::printf("checkpoint %s/%s (format %d)\n", a.dir.c_str(), m->tag.c_str(), m->format_version);
  std::printf("  step %lld (%lld skipped, %lld applied), lr %.6g, loss scale %.6g\n",
              static_cast<long long>(m->global_step), static_cast<long long>(m->skipped_steps),
              static_cast<long long>(m->applied_steps), m->last_lr, m->scale);
  std::printf("  world size %d, ZeRO stage %d, %s; states from: optimizer %s, params %s\n",
              m->world_size, m->stage, m->precision.c_str(),
              m->offload_optimizer == "none" ? "device" : m->offload_optimizer.c_str(),
              m->offload_param == "none" ? "device" : m->offload_param.c_str());
  std::printf("  model: %zu groups, %llu params; %zu tensors\n", m->groups.size(),
              static_cast<unsigned long long>(params),
              m->groups.size() * ckpt::kNumStateKinds * m->world_size);
  std::printf("  bytes per state kind (all ranks):\n");
  for (size_t k = 0; k < ckpt::kNumStateKinds; ++k) {
    std::printf("    %-11s %llu\n", ckpt::kStateKinds[k],
                static_cast<unsigned long long>(per_kind[ckpt::kStateKinds[k]]));
  }
  std::printf("  files:\n");
  for (const auto& f : m->files) {
    std::printf("    %-24s %12llu bytes  xxh3 %s\n", f.name.c_str(),
                static_cast<unsigned long long>(f.size_bytes), ckpt::Hex64(f.xxh3).c_str());
  }
  std::printf("  total %llu bytes; client state: %s\n", static_cast<unsigned long long>(total),
              m->has_client_state ? "yes" : "none");
  return kExitOk;
}

int RunVerify(const CkptArgs& a) {
  auto m = ckpt::VerifyCheckpoint(a.dir, a.tag);
  if (!m.ok()) return Fail("verify", m.status());
  uint64_t total = 0;
  for (const auto& f : m->files) total += f.size_bytes;
  std::printf("checkpoint %s/%s is valid: %zu files, %llu bytes, checksums match\n", a.dir.c_str(),
              m->tag.c_str(), m->files.size(), static_cast<unsigned long long>(total));
  return kExitOk;
}

// Export: the full parameters, streamed in chunks from the masters of every rank file.
Status Export(const CkptArgs& a, size_t* tensors) {
  STRATA_ASSIGN_OR_RETURN(ckpt::Manifest m, ckpt::VerifyCheckpoint(a.dir, a.tag));
  const std::string st_dtype = a.dtype == "fp32" ? "F32" : a.dtype == "fp16" ? "F16" : "BF16";
  const uint64_t eb = a.dtype == "fp32" ? 4 : 2;
  // The trainer's names; prefixed by the group only when a name repeats across groups.
  std::set<std::string> seen;
  bool unique = true;
  for (const auto& g : m.groups) {
    for (const auto& p : g.params) unique = unique && seen.insert(p.name).second;
  }
  struct Out {
    std::string name;
    size_t group;
    uint64_t offset, numel;
    std::vector<int64_t> shape;
  };
  std::vector<Out> outs;
  nlohmann::json h = nlohmann::json::object();
  h["__metadata__"] = {{"format", "pt"}, {"source", "strata checkpoint " + m.tag},
                       {"global_step", std::to_string(m.global_step)}};
  uint64_t data = 0;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    uint64_t off = 0;
    for (const auto& p : m.groups[g].params) {
      uint64_t n = 1;
      for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
      Out o{unique ? p.name : m.groups[g].name + "." + p.name, g, off, n, p.shape};
      h[o.name] = {{"dtype", st_dtype}, {"shape", p.shape}, {"data_offsets", {data, data + n * eb}}};
      data += n * eb;
      off += n;
      outs.push_back(std::move(o));
    }
  }
  std::string text = h.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::string header(8, '\0');
  for (int i = 0; i < 8; ++i) header[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  header += text;
  const std::string tmp = a.out + ".tmp";
  STRATA_ASSIGN_OR_RETURN(ckpt::FileWriter w, ckpt::FileWriter::Create(tmp));
  STRATA_RETURN_IF_ERROR(w.Append(header.data(), header.size()));
  ckpt::RangeReader rd(a.dir + "/" + m.tag, m);
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  std::vector<float> f32(kChunk);
  std::vector<uint16_t> half(kChunk);
  for (const Out& o : outs) {
    for (uint64_t at = 0; at < o.numel; at += kChunk) {
      const uint64_t n = std::min(kChunk, o.numel - at);
      STRATA_RETURN_IF_ERROR(rd.Read(o.group, 1, o.offset + at, n, f32.data()));
      if (eb == 4) {
        STRATA_RETURN_IF_ERROR(w.Append(f32.data(), n * 4));
        continue;
      }
      for (uint64_t i = 0; i < n; ++i) {
        half[i] = a.dtype == "fp16" ? FloatToHalf(f32[i]).bits : FloatToBf16(f32[i]).bits;
      }
      STRATA_RETURN_IF_ERROR(w.Append(half.data(), n * 2));
    }
  }
  STRATA_RETURN_IF_ERROR(w.Finish());
  STRATA_RETURN_IF_ERROR(ckpt::RenamePath(tmp, a.out));
  *tensors = outs.size();
  return Status::OK();
}

int RunExport(const CkptArgs& a) {
  size_t n = 0;
  Status st = Export(a, &n);
  if (!st.ok()) return Fail("export", st);
  std::printf("exported %zu tensors (%s) to %s\n", n, a.dtype.c_str(), a.out.c_str());
  return kExitOk;
}

}  // namespace

void RegisterCkpt(CLI::App& parent, int* exit_code) {
  auto args = std::make_shared<CkptArgs>();
  CLI::App* ck = parent.add_subcommand("ckpt", "Inspect, verify and export engine checkpoints");
  ck->require_subcommand(1);
  CLI::App* inspect = ck->add_subcommand("inspect", "What a checkpoint holds (no checksums read)");
  inspect->add_option("DIR", args->dir, "Checkpoint directory (holds `latest` and tag directories)")->required();
  inspect->add_option("--tag", args->tag, "Tag to inspect (default: the one `latest` names)");
  inspect->add_flag("--json", args->json, "Print JSON");
  inspect->callback([args, exit_code] { *exit_code = RunInspect(*args); });
  CLI::App* verify = ck->add_subcommand(
      "verify", "Check completeness and every checksum: exit 0 valid, 1 damaged (the file named), 2 usage");
  verify->add_option("DIR", args->dir, "Checkpoint directory")->required();
  verify->add_option("--tag", args->tag, "Tag to verify (default: the one `latest` names)");
  verify->callback([args, exit_code] { *exit_code = RunVerify(*args); });
  CLI::App* exp = ck->add_subcommand(
      "export", "One safetensors file of the full parameters (from the fp32 masters), verified first");
  exp->add_option("DIR", args->dir, "Checkpoint directory")->required();
  exp->add_option("--tag", args->tag, "Tag to export (default: the one `latest` names)");
  exp->add_option("--out", args->out, "Output .safetensors file (written as OUT.tmp, then renamed)")->required();
  exp->add_option("--dtype", args->dtype, "bf16 (default), fp16 or fp32 (round to nearest even)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  exp->callback([args, exit_code] { *exit_code = RunExport(*args); });
}

}  // namespace strata::cli
