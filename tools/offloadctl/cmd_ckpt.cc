// `offloadctl ckpt inspect|verify|export`: engine checkpoints (core/zero/checkpoint_format.h)
// without an engine.
//   inspect DIR [--tag T] [--json]   what is in it: step, world size, stage, precision, where the
//                                    states lived, tensors, bytes per state kind and per rank
//   verify DIR [--tag T] [--json]    every file present with its size and XXH3; exit 0 valid,
//                                    1 damaged (naming the first bad file), 2 usage
//   export DIR --out F [--tag T] [--dtype bf16|fp16|fp32] [--max-shard-size SIZE]
//                                    the full parameters from the fp32 masters, named as the
//                                    trainer named them: one safetensors file, or (over SIZE)
//                                    shards <stem>-0000i-of-0000n.safetensors beside F and a
//                                    Hugging Face <stem>.safetensors.index.json; without
//                                    the frozen groups a save left out (exclude_frozen)
//   reshard DIR --out DIR2 [--world-size M] [--stage t] [--precision bf16|fp16|fp32] [--tag T]
//                                    offline resharding and precision conversion into DIR2
//                                    (core/zero/checkpoint_format.h ReshardCheckpoint); what is
//                                    not given stays as the checkpoint has it
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/zero/checkpoint_format.h"
#include "strata/dtype.h"
#include "tools/offloadctl/cli_flags.h"
#include "tools/offloadctl/commands.h"

namespace strata::cli {
namespace {

namespace ckpt = zero::ckpt;

struct CkptArgs {
  std::string dir, tag, out, dtype;  // export: "" = the checkpoint's precision
  std::string precision;           // reshard: "" = the checkpoint's
  std::string max_shard_size;      // "" = one file
  int world_size = 0, stage = -1;  // reshard: 0 / -1 = the checkpoint's
  bool json = false;
};

// DIR naming a tag's own directory (it holds the manifest, not `latest`), without --tag: the
// checkpoint directory above it, and that tag.
CkptArgs Resolved(const CkptArgs& a) {
  if (!a.tag.empty() || !ckpt::PathExists(a.dir + "/" + ckpt::kManifestName) ||
      ckpt::PathExists(a.dir + "/" + ckpt::kLatestName)) {
    return a;
  }
  // Absolute, symlinks resolved (a `best` link to a tag, DIR "."), no trailing '/'.
  std::error_code ec;
  std::filesystem::path p = std::filesystem::weakly_canonical(a.dir, ec);
  if (ec) p = std::filesystem::path(a.dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  CkptArgs r = a;
  r.tag = p.filename().string();
  r.dir = p.has_parent_path() ? p.parent_path().string() : ".";
  return r;
}

int Fail(const char* cmd, const Status& st, bool json = false) {
  return Failure(std::string("ckpt ") + cmd, st.ToString(), kExitInvalid, json);
}

// What differs between the manifest's files and the directory, by size alone (no checksum is
// read: `ckpt verify` does that): a file missing, or of another size.
std::vector<std::string> FileProblems(const std::string& tag_dir, const ckpt::Manifest& m) {
  std::vector<std::string> problems;
  for (const auto& f : m.files) {
    std::error_code ec;
    const uintmax_t size = std::filesystem::file_size(tag_dir + "/" + f.name, ec);
    if (ec) {
      problems.push_back(f.name + ": " + ec.message());
    } else if (size != f.size_bytes) {
      problems.push_back(f.name + ": " + std::to_string(size) +
                         " bytes on disk, the manifest says " + std::to_string(f.size_bytes));
    }
  }
  return problems;
}

// DIR given empty ("" from an unset variable) would read `/latest`: a usage error.
CLI::Validator NamedDir() {
  return CLI::Validator(
      [](std::string& s) {
        return s.empty() ? std::string("empty: name the checkpoint directory") : std::string();
      },
      "DIR");
}

int RunInspect(const CkptArgs& a) {
  auto tag = ckpt::ResolveTag(a.dir, a.tag);
  if (!tag.ok()) return Fail("inspect", tag.status(), a.json);
  auto m = ckpt::ReadManifest(a.dir, *tag);
  if (!m.ok()) return Fail("inspect", m.status(), a.json);
  uint64_t params = 0, frozen = 0, excluded = 0, tensors = 0;
  for (const auto& g : m->groups) params += g.numel;
  std::map<std::string, uint64_t> per_kind;
  for (const auto& g : m->groups) {
    if (!g.trainable) frozen += g.numel;
    if (g.excluded) excluded += g.numel;
    for (size_t k = 0; k < ckpt::kNumStateKinds; ++k) {
      if (!g.HasKind(k)) continue;
      per_kind[ckpt::kStateKinds[k]] += g.shard_elems * m->ElemBytes(k) * m->world_size;
      tensors += static_cast<uint64_t>(m->world_size);
    }
  }
  uint64_t total = 0;
  for (const auto& f : m->files) total += f.size_bytes;
  const std::vector<std::string> problems = FileProblems(a.dir + "/" + *tag, *m);
  const int code = problems.empty() ? kExitOk : kExitInvalid;
  if (a.json) {
    nlohmann::json j = nlohmann::json::parse(m->ToJson());
    j["file_problems"] = problems;
    j.erase("config");
    j["params"] = params;
    j["frozen_params"] = frozen;
    j["excluded_params"] = excluded;
    j["tensors"] = tensors;
    j["bytes_per_state_kind"] = per_kind;
    j["total_bytes"] = total;
    std::printf("%s\n", j.dump(2).c_str());
    return code;
  }
  std::printf("checkpoint %s/%s (format %d)\n", a.dir.c_str(), m->tag.c_str(), m->format_version);
  char scale[64];
  std::snprintf(scale, sizeof scale, "%.6g", m->scale);
  std::printf(
      "  step %lld (%lld skipped, %lld applied), lr %.6g, loss scale %s\n",
      static_cast<long long>(m->global_step), static_cast<long long>(m->skipped_steps),
      static_cast<long long>(m->applied_steps), m->last_lr,
      m->has_scaler_state ? scale : "from the loading engine's config (precision converted)");
  std::printf("  world size %d, ZeRO stage %d, %s; states from: optimizer %s, params %s\n",
              m->world_size, m->stage, m->precision.c_str(),
              m->offload_optimizer == "none" ? "device" : m->offload_optimizer.c_str(),
              m->offload_param == "none" ? "device" : m->offload_param.c_str());
  std::printf("  model: %zu groups, %llu params (%llu frozen); %llu tensors\n",
              m->groups.size(), static_cast<unsigned long long>(params),
              static_cast<unsigned long long>(frozen), static_cast<unsigned long long>(tensors));
  if (excluded > 0) {
    std::printf(
        "  %llu frozen params left out at save (exclude_frozen): their values are not in "
        "this checkpoint\n",
        static_cast<unsigned long long>(excluded));
  }
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
  for (const std::string& p : problems) {
    std::fprintf(stderr, "offloadctl ckpt inspect: damaged: %s\n", p.c_str());
  }
  return code;
}

int RunVerify(const CkptArgs& a) {
  auto m = ckpt::VerifyCheckpoint(a.dir, a.tag);
  if (a.json) {  // {"valid", "dir", "tag", "files", "bytes"} or {"valid": false, "error"}
    nlohmann::ordered_json j = {{"valid", m.ok()}, {"dir", a.dir}};
    if (m.ok()) {
      uint64_t total = 0;
      for (const auto& f : m->files) total += f.size_bytes;
      j["tag"] = m->tag;
      j["files"] = m->files.size();
      j["bytes"] = total;
    } else {
      if (!a.tag.empty()) j["tag"] = a.tag;
      j["error"] = m.status().ToString();
    }
    std::printf("%s\n", j.dump(2).c_str());
    return m.ok() ? kExitOk : kExitInvalid;
  }
  if (!m.ok()) return Fail("verify", m.status());
  uint64_t total = 0;
  for (const auto& f : m->files) total += f.size_bytes;
  std::printf("checkpoint %s/%s is valid: %zu files, %llu bytes, checksums match\n", a.dir.c_str(),
              m->tag.c_str(), m->files.size(), static_cast<unsigned long long>(total));
  return kExitOk;
}

struct ExportTensor {
  std::string name;
  size_t group;
  uint64_t offset, numel;
  std::vector<int64_t> shape;
};

Status WriteExportBody(ckpt::FileWriter& w, const std::string& header,
                       const std::vector<const ExportTensor*>& tensors, const std::string& dtype,
                       ckpt::RangeReader& rd);

// One safetensors file of `tensors`, streamed in chunks from the masters (written as PATH.tmp,
// fsynced, renamed; the .tmp removed on a failure).
Status WriteExportFile(const std::string& path, const std::vector<const ExportTensor*>& tensors,
                       const std::string& dtype, const ckpt::Manifest& m, ckpt::RangeReader& rd) {
  const std::string st_dtype = dtype == "fp32" ? "F32" : dtype == "fp16" ? "F16" : "BF16";
  const uint64_t eb = dtype == "fp32" ? 4 : 2;
  nlohmann::json h = nlohmann::json::object();
  h["__metadata__"] = {{"format", "pt"},
                       {"source", "strata checkpoint " + m.tag},
                       {"global_step", std::to_string(m.global_step)}};
  uint64_t data = 0;
  for (const ExportTensor* t : tensors) {
    h[t->name] = {
        {"dtype", st_dtype}, {"shape", t->shape}, {"data_offsets", {data, data + t->numel * eb}}};
    data += t->numel * eb;
  }
  std::string text = h.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::string header(8, '\0');
  for (int i = 0; i < 8; ++i) header[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  header += text;
  const std::string tmp = path + ".tmp";
  STRATA_ASSIGN_OR_RETURN(ckpt::FileWriter w, ckpt::FileWriter::Create(tmp));
  Status st = WriteExportBody(w, header, tensors, dtype, rd);
  if (st.ok()) st = ckpt::RenamePath(tmp, path);
  if (!st.ok()) {
    std::error_code ignored;  // a partial file would only hold the disk: the error is the news
    std::filesystem::remove(tmp, ignored);
  }
  return st;
}

// The header, then each tensor's values converted to `dtype`, then fsync.
Status WriteExportBody(ckpt::FileWriter& w, const std::string& header,
                       const std::vector<const ExportTensor*>& tensors, const std::string& dtype,
                       ckpt::RangeReader& rd) {
  const uint64_t eb = dtype == "fp32" ? 4 : 2;
  STRATA_RETURN_IF_ERROR(w.Append(header.data(), header.size()));
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  std::vector<float> f32(kChunk);
  std::vector<uint16_t> half(kChunk);
  for (const ExportTensor* t : tensors) {
    for (uint64_t at = 0; at < t->numel; at += kChunk) {
      const uint64_t n = std::min(kChunk, t->numel - at);
      STRATA_RETURN_IF_ERROR(rd.ReadFp32(t->group, t->offset + at, n, f32.data()));
      if (eb == 4) {
        STRATA_RETURN_IF_ERROR(w.Append(f32.data(), n * 4));
        continue;
      }
      for (uint64_t i = 0; i < n; ++i) {
        half[i] = dtype == "fp16" ? FloatToHalf(f32[i]).bits : FloatToBf16(f32[i]).bits;
      }
      STRATA_RETURN_IF_ERROR(w.Append(half.data(), n * 2));
    }
  }
  return w.Finish();
}

// --out names a file to create or replace: not empty, and not something else that exists (a
// directory, a device such as /dev/full, a FIFO), which the final rename would replace.
Status CheckOutFile(const std::string& out) {
  if (out.empty()) return Status::InvalidArgument("--out is empty: name the file to write");
  std::error_code ec;
  const std::filesystem::file_status fs = std::filesystem::status(out, ec);
  if (std::filesystem::exists(fs) && !std::filesystem::is_regular_file(fs)) {
    return Status::InvalidArgument("--out '" + out +
                                   "' exists and is not a regular file (a directory, device or "
                                   "FIFO): name a file to create or replace");
  }
  return Status::OK();
}

// "5GB" as Hugging Face writes it, or any SIZE (cli_flags.h).
std::optional<uint64_t> ParseShardSize(std::string v) {
  if (v.size() > 2 && (v.back() == 'B' || v.back() == 'b') &&
      std::isalpha(static_cast<unsigned char>(v[v.size() - 2]))) {
    v.pop_back();
  }
  return ParseSize(v);
}

// Export: the full parameters, streamed in chunks from the masters of every rank file; one file,
// or shards (each at most max_shard bytes unless one tensor alone is larger) plus the index. The
// parameters of groups left out at save (exclude_frozen) are not there: *left_out counts those
// tensors, *left_out_elems their elements.
Status Export(const CkptArgs& a, size_t* tensors, size_t* files, std::string* dtype_out,
              size_t* left_out, uint64_t* left_out_elems) {
  uint64_t max_shard = UINT64_MAX;
  if (!a.max_shard_size.empty()) {
    auto v = ParseShardSize(a.max_shard_size);
    if (!v)
      return Status::InvalidArgument("--max-shard-size '" + a.max_shard_size +
                                     "' is not a size such as 5GB or 500M");
    max_shard = *v;
  }
  STRATA_RETURN_IF_ERROR(CheckOutFile(a.out));
  STRATA_ASSIGN_OR_RETURN(ckpt::Manifest m, ckpt::VerifyCheckpoint(a.dir, a.tag));
  // The run's own precision unless asked (an fp32 run's weights are not rounded by default).
  const std::string dtype = a.dtype.empty() ? m.precision : a.dtype;
  *dtype_out = dtype;
  const uint64_t eb = dtype == "fp32" ? 4 : 2;
  if (const std::filesystem::path parent = std::filesystem::path(a.out).parent_path();
      !parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) {
      return Status::IOError("create the directory of --out '" + parent.string() +
                             "': " + ec.message());
    }
  }
  // The trainer's names; prefixed by the group only when a name repeats across groups.
  std::set<std::string> seen;
  bool unique = true;
  for (const auto& g : m.groups) {
    for (const auto& p : g.params) unique = unique && seen.insert(p.name).second;
  }
  std::vector<ExportTensor> outs;
  *left_out = 0;
  *left_out_elems = 0;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    if (m.groups[g].excluded) {
      *left_out += m.groups[g].params.size();
      *left_out_elems += m.groups[g].numel;
      continue;
    }
    uint64_t off = 0;
    for (const auto& p : m.groups[g].params) {
      uint64_t n = 1;
      for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
      outs.push_back({unique ? p.name : m.groups[g].name + "." + p.name, g, off, n, p.shape});
      off += n;
    }
  }
  if (outs.empty()) {
    return Status::FailedPrecondition(a.dir + "/" + m.tag +
                                      ": every group was left out at save (exclude_frozen): "
                                      "nothing to export");
  }
  // Shards in model order, greedily filled.
  std::vector<std::vector<const ExportTensor*>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const ExportTensor& t : outs) {
    const uint64_t bytes = t.numel * eb;
    if (!shards.back().empty() && in_shard + bytes > max_shard) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(&t);
    in_shard += bytes;
    total += bytes;
  }
  ckpt::RangeReader rd(a.dir + "/" + m.tag, m);
  *tensors = outs.size();
  *files = shards.size();
  if (shards.size() == 1) return WriteExportFile(a.out, shards[0], dtype, m, rd);
  // Hugging Face's layout: <stem>-00001-of-00003.safetensors and <stem>.safetensors.index.json.
  const std::filesystem::path out(a.out);
  std::string stem = out.filename().string();
  const std::string ext = ".safetensors";
  if (stem.size() > ext.size() && stem.compare(stem.size() - ext.size(), ext.size(), ext) == 0) {
    stem.resize(stem.size() - ext.size());
  }
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    const std::string file = stem + name;
    STRATA_RETURN_IF_ERROR(
        WriteExportFile((out.parent_path() / file).string(), shards[i], dtype, m, rd));
    for (const ExportTensor* t : shards[i]) weight_map[t->name] = file;
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return ckpt::WriteSmallFile((out.parent_path() / (stem + ".safetensors.index.json")).string(),
                              index.dump(2) + "\n", true);
}

int RunExport(const CkptArgs& a) {
  size_t n = 0, files = 0, left_out = 0;
  uint64_t left_out_elems = 0;
  std::string dtype;
  Status st = Export(a, &n, &files, &dtype, &left_out, &left_out_elems);
  if (st.code() == Status::Code::kInvalidArgument) {
    std::fprintf(stderr, "offloadctl ckpt export: %s\n", st.ToString().c_str());
    return kExitUsage;
  }
  if (!st.ok()) return Fail("export", st);
  if (files == 1) {
    std::printf("exported %zu tensors (%s) to %s\n", n, dtype.c_str(), a.out.c_str());
  } else {
    std::printf(
        "exported %zu tensors (%s) in %zu shards beside %s, with a .safetensors.index.json\n", n,
        dtype.c_str(), files, a.out.c_str());
  }
  if (left_out > 0) {
    std::printf(
        "  without the %zu frozen tensors (%llu params) left out at save (exclude_frozen): "
        "take them from the model the run started from\n",
        left_out, static_cast<unsigned long long>(left_out_elems));
  }
  return kExitOk;
}

int RunReshard(const CkptArgs& a) {
  auto m = ckpt::ReshardCheckpoint(a.dir, a.tag, {a.world_size, a.stage, a.precision}, a.out);
  if (!m.ok()) return Fail("reshard", m.status());
  std::printf("resharded %s (tag %s) to world size %d, stage %d, %s%s: %s/%s\n", a.dir.c_str(),
              m->tag.c_str(), m->world_size, m->stage, m->precision.c_str(),
              m->has_scaler_state ? "" : " (loss scaler: the loading engine's config)",
              a.out.c_str(), m->tag.c_str());
  const auto unchecked = std::count_if(m->groups.begin(), m->groups.end(), [](const auto& g) {
    return g.excluded && g.fingerprint == 0;
  });
  if (unchecked > 0) {
    std::printf(
        "  note: %zu frozen group(s) left out at save have no fingerprint (a precision conversion "
        "drops them, and a checkpoint saved from values without one has none): a load keeps the "
        "engine's values for them unchecked, so build the model "
        "from the pretrained weights the run started from\n",
        static_cast<size_t>(unchecked));
  }
  return kExitOk;
}

}  // namespace

void RegisterCkpt(CLI::App& parent, int* exit_code) {
  auto args = std::make_shared<CkptArgs>();
  CLI::App* ck =
      parent.add_subcommand("ckpt", "Inspect, verify, export and reshard engine checkpoints");
  ck->require_subcommand(1);
  CLI::App* inspect = ck->add_subcommand("inspect", "What a checkpoint holds (no checksums read)");
  inspect
      ->add_option("DIR", args->dir,
                   "Checkpoint directory (holds `latest` and tag directories), or a tag's "
                   "own directory")
      ->required()
      ->check(NamedDir());
  inspect->add_option("--tag", args->tag, "Tag to inspect (default: the one `latest` names)");
  inspect->add_flag("--json", args->json, "Print JSON");
  inspect->callback([args, exit_code] { *exit_code = RunInspect(Resolved(*args)); });
  CLI::App* verify = ck->add_subcommand(
      "verify",
      "Check completeness and every checksum: exit 0 valid, 1 damaged (the file named), 2 usage");
  verify->add_option("DIR", args->dir, "Checkpoint directory")->required()->check(NamedDir());
  verify->add_option("--tag", args->tag, "Tag to verify (default: the one `latest` names)");
  verify->add_flag("--json", args->json,
                   "Print JSON: valid, tag, files and bytes, or valid false and the error (the "
                   "exit code as without it)");
  verify->callback([args, exit_code] { *exit_code = RunVerify(Resolved(*args)); });
  CLI::App* exp = ck->add_subcommand(
      "export",
      "One safetensors file of the full parameters (from the fp32 masters), verified first");
  exp->add_option("DIR", args->dir, "Checkpoint directory")->required()->check(NamedDir());
  exp->add_option("--tag", args->tag, "Tag to export (default: the one `latest` names)");
  exp->add_option("--out", args->out, "Output .safetensors file (written as OUT.tmp, then renamed)")
      ->required();
  exp->add_option(
         "--dtype", args->dtype,
         "bf16, fp16 or fp32 (default: the checkpoint's precision; narrower ones round to nearest "
         "even)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  exp->add_option("--max-shard-size", args->max_shard_size,
                  "Split into shards of at most this many bytes (5GB, 500M: SIZE; a tensor larger "
                  "than it gets a shard of its own), with a Hugging Face index json")
      ->type_name("SIZE");
  exp->callback([args, exit_code] { *exit_code = RunExport(Resolved(*args)); });
  CLI::App* rs = ck->add_subcommand(
      "reshard",
      "Rewrite a checkpoint for another world size, ZeRO stage or precision (offline), verified "
      "first");
  rs->add_option("DIR", args->dir, "Checkpoint directory")->required()->check(NamedDir());
  rs->add_option("--tag", args->tag, "Tag to reshard (default: the one `latest` names)");
  rs->add_option("--world-size", args->world_size,
                 "Ranks of the new layout (default: the checkpoint's)")
      ->check(CLI::Range(1, 4096));
  rs->add_option("--stage", args->stage, "ZeRO stage of the new layout (default: the checkpoint's)")
      ->check(CLI::Range(0, 3));
  rs->add_option("--precision", args->precision,
                 "bf16, fp16 or fp32 (default: the checkpoint's). Another precision re-derives "
                 "the params from the fp32 masters (round to nearest even, as the optimizer "
                 "does), keeps masters, Adam state and counters, and resets the loss scaler "
                 "to the loading engine's config")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  rs->add_option("--out", args->out, "Output checkpoint directory (the same tag, and its `latest`)")
      ->required();
  rs->callback([args, exit_code] { *exit_code = RunReshard(Resolved(*args)); });
}

}  // namespace strata::cli
