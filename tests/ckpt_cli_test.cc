// `offloadctl ckpt inspect|verify|export` over a checkpoint the engine saved (2 ranks, stage 3):
// exit codes (0 valid, 1 damaged naming the file, 2 usage), inspect's JSON, and an export whose
// tensors (the trainer's names and shapes) hold the fp32 masters, read back with this test's own
// safetensors reader and, when Python has the `safetensors` package, with it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/zero/checkpoint_format.h"
#include "engine_test_model.h"

namespace strata::testing {
namespace {

namespace ckpt = zero::ckpt;

struct Cmd {
  int code = -1;
  std::string out;  // stdout + stderr
};

// The Python to try the `safetensors` package with: $STRATA_PYTHON (e.g. a venv's), else python3.
std::string Python() {
  const char* p = std::getenv("STRATA_PYTHON");
  return p != nullptr && *p != '\0' ? p : "python3";
}

Cmd Offloadctl(const std::string& args) {
  const std::string cmd =
      std::string("timeout 60 ") + STRATA_OFFLOADCTL_PATH + " " + args + " 2>&1";
  Cmd c;
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) c.out.append(buf, n);
  const int st = ::pclose(p);
  c.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return c;
}

const char* kConfig = R"({
  "train_micro_batch_size_per_gpu": 3,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "bf16": {"enabled": true},
  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                        "offload_param": {"device": "cpu"}, "sub_group_size": 256,
                        "stage3_param_persistence_threshold": 64}
})";

TEST(CkptCli, InspectVerifyExport) {
  const std::string dir = UniqueTestDir("ckpt_cli");
  RunSpec s;
  s.config_json = kConfig;
  s.world = 2;
  s.steps = 2;
  s.after_step = [&](int, int step, Engine& e) -> Status {
    return e.Save(dir, step == 0 ? "a" : "b");
  };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();

  Cmd c = Offloadctl("ckpt verify " + dir);
  EXPECT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("is valid"), std::string::npos) << c.out;
  c = Offloadctl("ckpt inspect " + dir);
  EXPECT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("world size 2, ZeRO stage 3, bf16"), std::string::npos) << c.out;
  c = Offloadctl("ckpt inspect " + dir + " --tag a --json");
  ASSERT_EQ(c.code, 0) << c.out;
  auto j = nlohmann::json::parse(c.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << c.out;
  EXPECT_EQ(j["global_step"], 1);
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["offload_optimizer"], "nvme");
  EXPECT_EQ(j["files"].size(), 2u);

  // Damage tag a: verify names the file; b (latest) stays valid.
  {
    std::fstream f(dir + "/a/rank1.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-10, std::ios::end);
    f.put('\x7f');
  }
  c = Offloadctl("ckpt verify " + dir + " --tag a");
  EXPECT_EQ(c.code, 1) << c.out;
  EXPECT_NE(c.out.find("a/rank1.safetensors is damaged"), std::string::npos) << c.out;
  EXPECT_EQ(Offloadctl("ckpt verify " + dir).code, 0);
  EXPECT_EQ(Offloadctl("ckpt verify " + dir + " --tag nope").code, 1);
  // A tag's own directory names the checkpoint too (with or without a trailing '/').
  c = Offloadctl("ckpt verify " + dir + "/b/");
  EXPECT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("/b is valid"), std::string::npos) << c.out;
  c = Offloadctl("ckpt inspect " + dir + "/a");
  EXPECT_EQ(c.code, 0) << c.out;  // inspect reads no checksum: verify finds that byte
  EXPECT_NE(c.out.find("/a (format"), std::string::npos) << c.out;
  // A file of another size than the manifest's, or missing: inspect says so and exits 1.
  const std::string rank1 = dir + "/a/rank1.safetensors";
  const std::string kept = *ckpt::ReadWholeFile(rank1);
  std::filesystem::resize_file(rank1, 0);
  c = Offloadctl("ckpt inspect " + dir + "/a");
  EXPECT_EQ(c.code, 1) << c.out;
  EXPECT_NE(c.out.find("rank1.safetensors: 0 bytes on disk, the manifest says " +
                       std::to_string(kept.size())),
            std::string::npos)
      << c.out;
  std::filesystem::remove(rank1);
  c = Offloadctl("ckpt inspect " + dir + "/a --json 2>/dev/null");
  EXPECT_EQ(c.code, 1) << c.out;
  j = nlohmann::json::parse(c.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << c.out;
  ASSERT_EQ(j["file_problems"].size(), 1u) << c.out;
  EXPECT_NE(j["file_problems"][0].get<std::string>().find("rank1.safetensors: No such file"),
            std::string::npos)
      << c.out;
  std::ofstream(rank1, std::ios::binary) << kept;
  // Through a symlink named otherwise (a `best` link to a tag), and as "." from inside it.
  std::filesystem::create_directory_symlink(dir + "/b", dir + "/best");
  c = Offloadctl("ckpt verify " + dir + "/best");
  EXPECT_EQ(c.code, 0) << c.out;
  const std::string in_tag = std::string("cd ") + dir + "/b && " + STRATA_OFFLOADCTL_PATH +
                             " ckpt verify . >/dev/null 2>&1";
  EXPECT_EQ(std::system(in_tag.c_str()), 0);
  std::filesystem::remove(dir + "/best");
  // --json: the same verdicts and exit codes, for scripts.
  c = Offloadctl("ckpt verify " + dir + " --tag a --json");
  EXPECT_EQ(c.code, 1) << c.out;
  j = nlohmann::json::parse(c.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << c.out;
  EXPECT_FALSE(j["valid"].get<bool>());
  EXPECT_NE(j["error"].get<std::string>().find("a/rank1.safetensors is damaged"), std::string::npos)
      << c.out;
  c = Offloadctl("ckpt verify " + dir + " --json");
  EXPECT_EQ(c.code, 0) << c.out;
  j = nlohmann::json::parse(c.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << c.out;
  EXPECT_TRUE(j["valid"].get<bool>());
  EXPECT_EQ(j["tag"], "b");
  EXPECT_GT(j["bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(Offloadctl("ckpt verify").code, 2);
  EXPECT_EQ(Offloadctl("ckpt verify ''").code, 2);  // not `/latest`
  c = Offloadctl("ckpt verify " + dir + "/missing");
  EXPECT_EQ(c.code, 1) << c.out;
  EXPECT_NE(c.out.find("checkpoint directory " + dir + "/missing does not exist"),
            std::string::npos)
      << c.out;
  EXPECT_EQ(Offloadctl("ckpt export " + dir + " --out x --dtype int8").code, 2);

  // Export fp32 and bf16: names, shapes, values.
  const ModelSpec model = TestModel();
  for (const char* dt : {"fp32", "bf16"}) {
    const std::string out = dir + "/model_" + dt + ".safetensors";
    c = Offloadctl("ckpt export " + dir + " --out " + out + " --dtype " + dt);
    ASSERT_EQ(c.code, 0) << c.out;
    std::string meta;
    auto locs = ckpt::ReadSafetensorsHeader(out, &meta);
    ASSERT_TRUE(locs.ok()) << locs.status().ToString();
    ASSERT_EQ(locs->size(), 6u);
    const std::string bytes = *ckpt::ReadWholeFile(out);
    size_t i = 0;
    for (size_t g = 0; g < model.groups.size(); ++g) {
      size_t off = 0;
      for (const ParamSpec& p : model.groups[g].params) {
        const ckpt::TensorLoc& t = (*locs)[i++];
        EXPECT_EQ(t.name, p.name);
        EXPECT_EQ(t.shape, p.shape);
        const size_t n = p.numel();
        for (size_t k = 0; k < n; ++k) {
          const float want = r.master[g][off + k];
          if (std::string(dt) == "fp32") {
            float got;
            std::memcpy(&got, bytes.data() + t.begin + k * 4, 4);
            ASSERT_EQ(std::memcmp(&got, &want, 4), 0) << p.name << "[" << k << "]";
          } else {
            uint16_t got;
            std::memcpy(&got, bytes.data() + t.begin + k * 2, 2);
            ASSERT_EQ(got, FloatToBf16(want).bits) << p.name << "[" << k << "]";
          }
        }
        off += n;
      }
    }
  }
  // Without --dtype: the run's own precision (bf16 here), the same bytes as asked; the directory
  // of --out is made.
  const std::string made = dir + "/made/here/model.safetensors";
  c = Offloadctl("ckpt export " + dir + " --out " + made);
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("(bf16)"), std::string::npos) << c.out;
  EXPECT_EQ(*ckpt::ReadWholeFile(made), *ckpt::ReadWholeFile(dir + "/model_bf16.safetensors"));
  // --out naming something that is not a file to replace (a directory, a FIFO: a device such as
  // /dev/full alike) or nothing: a usage error before anything is written.
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& out : {dir + "/made", fifo, std::string("''")}) {
    c = Offloadctl("ckpt export " + dir + " --out " + out);
    EXPECT_EQ(c.code, 2) << out << ": " << c.out;
    EXPECT_NE(c.out.find(out == "''" ? "--out is empty" : "not a regular file"), std::string::npos)
        << c.out;
    EXPECT_FALSE(std::filesystem::exists(out + ".tmp")) << out;
  }
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));
  EXPECT_FALSE(std::filesystem::exists(".tmp"));
  // The safetensors package, unchanged, when Python has it.
  if (std::system((Python() + " -c 'import safetensors.numpy' >/dev/null 2>&1").c_str()) == 0) {
    const std::string py = Python() +
                           " -c \"from safetensors.numpy import load_file; t = load_file('" + dir +
                           "/model_fp32.safetensors'); assert sorted(t) == "
                           "['W0','W1','W2','b0','b1','b2'], sorted(t); "
                           "assert t['W2'].shape == (36, 40)\"";
    EXPECT_EQ(std::system(py.c_str()), 0);
  } else {
    std::printf(
        "%s: safetensors not importable (set STRATA_PYTHON): checked with this test's reader "
        "only\n",
        Python().c_str());
  }
  std::filesystem::remove_all(dir);
}

// A checkpoint saved without its frozen groups (SaveOptions::exclude_frozen): inspect says how
// many parameters were left out, export writes the trained ones with their masters and names
// the rest as left out, and a checkpoint of frozen groups only has nothing to export.
TEST(CkptCli, ExcludedFrozenGroupsAreSaidAndNotExported) {
  const std::string dir = UniqueTestDir("ckpt_cli_excl");
  ModelSpec model = TestModel();
  model.groups[kMid].trainable = false;
  model.groups[kTop].trainable = false;
  RunSpec s;
  s.config_json = kConfig;
  s.world = 2;
  s.steps = 1;
  s.model = model;
  s.after_step = [&](int, int, Engine& e) -> Status {
    SaveOptions o;
    o.exclude_frozen = true;
    return e.Save(dir, "lean", o);
  };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  const uint64_t left_out = model.groups[kMid].numel() + model.groups[kTop].numel();
  Cmd c = Offloadctl("ckpt inspect " + dir);
  EXPECT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find(std::to_string(left_out) + " frozen params left out at save"),
            std::string::npos)
      << c.out;
  c = Offloadctl("ckpt inspect " + dir + " --json");
  ASSERT_EQ(c.code, 0) << c.out;
  auto j = nlohmann::json::parse(c.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << c.out;
  EXPECT_EQ(j["excluded_params"].get<uint64_t>(), left_out);
  EXPECT_TRUE(j["model"]["groups"][kMid]["excluded"].get<bool>());
  EXPECT_EQ(Offloadctl("ckpt verify " + dir).code, 0);
  // Resharded, the groups stay out with their fingerprints; converted to another precision they
  // lose them (of values rounded to bf16), which reshard says.
  c = Offloadctl("ckpt reshard " + dir + " --world-size 1 --out " + dir + "/one");
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_EQ(c.out.find("no fingerprint"), std::string::npos) << c.out;
  c = Offloadctl("ckpt reshard " + dir + " --precision fp32 --out " + dir + "/fp32");
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("note: 2 frozen group(s) left out at save have no fingerprint"),
            std::string::npos)
      << c.out;
  const std::string out = dir + "/adapters.safetensors";
  c = Offloadctl("ckpt export " + dir + " --out " + out + " --dtype fp32");
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("exported 3 tensors"), std::string::npos) << c.out;
  EXPECT_NE(c.out.find("without the 3 frozen tensors (" + std::to_string(left_out) +
                       " params) left out at save"),
            std::string::npos)
      << c.out;
  auto locs = ckpt::ReadSafetensorsHeader(out);
  ASSERT_TRUE(locs.ok()) << locs.status().ToString();
  std::set<std::string> names;
  for (const ckpt::TensorLoc& t : *locs) names.insert(t.name);
  EXPECT_EQ(names, (std::set<std::string>{"W0", "b0", "b1"}));
  const std::string bytes = *ckpt::ReadWholeFile(out);
  for (const ckpt::TensorLoc& t : *locs) {
    const size_t g = t.name == "W0" ? kEmbed : t.name == "b0" ? kEmbedBias : kMidBias;
    ASSERT_EQ(t.end - t.begin, r.master[g].size() * 4) << t.name;
    EXPECT_EQ(std::memcmp(bytes.data() + t.begin, r.master[g].data(), t.end - t.begin), 0)
        << t.name;
  }
  // Every group frozen and left out: nothing to export, said so.
  for (GroupSpec& g : model.groups) g.trainable = false;
  RunSpec none = s;
  none.model = model;
  none.steps = 0;
  none.after_step = nullptr;
  none.after_init = [&](int, Engine& e) -> Status {
    SaveOptions o;
    o.exclude_frozen = true;
    return e.Save(dir + "/none", "t", o);
  };
  r = RunEngine(none);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  c = Offloadctl("ckpt export " + dir + "/none --out " + dir + "/none.safetensors");
  EXPECT_EQ(c.code, 1) << c.out;
  EXPECT_NE(c.out.find("nothing to export"), std::string::npos) << c.out;
  std::filesystem::remove_all(dir);
}

// `ckpt reshard` and `ckpt export --max-shard-size`: the resharded copy verifies and inspects
// at its new world size and stage; the shards and the Hugging Face index cover every tensor once,
// within the size, and hold the masters (the safetensors package loads them when available).
TEST(CkptCli, ReshardAndShardedExport) {
  const std::string dir = UniqueTestDir("ckpt_cli2");
  RunSpec s;
  s.config_json = kConfig;
  s.world = 2;
  s.steps = 1;
  s.after_step = [&](int, int, Engine& e) -> Status { return e.Save(dir + "/src", "t"); };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();

  Cmd c = Offloadctl("ckpt reshard " + dir + "/src --world-size 3 --stage 1 --out " + dir + "/w3");
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_EQ(Offloadctl("ckpt verify " + dir + "/w3").code, 0);
  c = Offloadctl("ckpt inspect " + dir + "/w3 --json");
  ASSERT_EQ(c.code, 0) << c.out;
  auto j = nlohmann::json::parse(c.out, nullptr, false);
  EXPECT_EQ(j["world_size"], 3);
  EXPECT_EQ(j["stage"], 1);
  EXPECT_EQ(
      Offloadctl("ckpt reshard " + dir + "/src --world-size 0 --stage 1 --out " + dir + "/x").code,
      2);
  EXPECT_EQ(
      Offloadctl("ckpt reshard " + dir + "/src --world-size 3 --stage 1 --out " + dir + "/w3").code,
      1);

  // A checkpoint of an fp32 run exports fp32 unless asked otherwise: no rounding by default.
  c = Offloadctl("ckpt reshard " + dir + "/src --precision fp32 --out " + dir + "/f32");
  ASSERT_EQ(c.code, 0) << c.out;
  c = Offloadctl("ckpt export " + dir + "/f32 --out " + dir + "/f32.safetensors");
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("(fp32)"), std::string::npos) << c.out;

  // fp32 bytes in model order: W0 3072, b0 128, W1 5120, b1 160, W2 5760, b2 144; at most 6000
  // bytes per shard: [W0 b0] [W1 b1] [W2 b2].
  const std::string out = dir + "/hf/model.safetensors";
  std::filesystem::create_directories(dir + "/hf");
  c = Offloadctl("ckpt export " + dir + "/w3 --out " + out + " --dtype fp32 --max-shard-size 6000");
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_FALSE(std::filesystem::exists(out));
  auto index = nlohmann::json::parse(*ckpt::ReadWholeFile(dir + "/hf/model.safetensors.index.json"),
                                     nullptr, false);
  ASSERT_FALSE(index.is_discarded());
  const ModelSpec model = TestModel();
  uint64_t total = 0;
  size_t seen = 0;
  std::set<std::string> files;
  for (size_t g = 0; g < model.groups.size(); ++g) {
    size_t off = 0;
    for (const ParamSpec& p : model.groups[g].params) {
      ASSERT_TRUE(index["weight_map"].contains(p.name)) << p.name;
      const std::string file = index["weight_map"][p.name];
      files.insert(file);
      auto locs = ckpt::ReadSafetensorsHeader(dir + "/hf/" + file);
      ASSERT_TRUE(locs.ok()) << locs.status().ToString();
      const std::string bytes = *ckpt::ReadWholeFile(dir + "/hf/" + file);
      EXPECT_LE(bytes.size() - locs->front().begin, 6000u) << file;
      for (const ckpt::TensorLoc& t : *locs) {
        if (t.name != p.name) continue;
        ++seen;
        EXPECT_EQ(t.shape, p.shape);
        ASSERT_EQ(std::memcmp(bytes.data() + t.begin, r.master[g].data() + off, p.numel() * 4), 0)
            << p.name;
      }
      total += p.numel() * 4;
      off += p.numel();
    }
  }
  EXPECT_EQ(seen, 6u);
  EXPECT_EQ(files.size(), 3u);
  EXPECT_TRUE(files.count("model-00001-of-00003.safetensors")) << *files.begin();
  EXPECT_EQ(index["metadata"]["total_size"], total);
  EXPECT_EQ(Offloadctl("ckpt export " + dir + "/w3 --out x --max-shard-size lots").code, 2);
  // --out a bare name: the shards and the index in the working directory.
  const std::string bare = std::string("cd ") + dir + " && " + STRATA_OFFLOADCTL_PATH +
                           " ckpt export w3 --out bare.safetensors --dtype fp32 "
                           "--max-shard-size 6000 >/dev/null";
  EXPECT_EQ(std::system(bare.c_str()), 0);
  EXPECT_TRUE(std::filesystem::exists(dir + "/bare.safetensors.index.json"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/bare-00003-of-00003.safetensors"));
  if (std::system((Python() + " -c 'import safetensors.numpy' >/dev/null 2>&1").c_str()) == 0) {
    const std::string py =
        Python() + " -c \"import json; from safetensors.numpy import load_file; d='" + dir +
        "/hf/'; ix = json.load(open(d + 'model.safetensors.index.json')); t = {}; "
        "[t.update(load_file(d + f)) for f in sorted(set(ix['weight_map'].values()))]; "
        "assert sorted(t) == ['W0','W1','W2','b0','b1','b2'], sorted(t); "
        "assert t['W1'].shape == (40, 32)\"";
    EXPECT_EQ(std::system(py.c_str()), 0);
  } else {
    std::printf(
        "%s: safetensors not importable (set STRATA_PYTHON): checked with this test's reader "
        "only\n",
        Python().c_str());
  }
  std::filesystem::remove_all(dir);
}

// The manifest's own checksum: one flipped byte of it and `verify` and `inspect` exit 1 naming
// the manifest; a checkpoint written before (format 1, no checksum) verifies and inspects as
// format 1, and `reshard` rewrites it in the current format, sealed.
TEST(CkptCli, ManifestChecksum) {
  const std::string dir = UniqueTestDir("ckpt_cli_manifest");
  RunSpec s;
  s.config_json = kConfig;
  s.world = 2;
  s.steps = 1;
  s.after_step = [&](int, int, Engine& e) -> Status { return e.Save(dir, "t"); };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  const std::string path = dir + "/t/" + ckpt::kManifestName;
  const std::string sealed = *ckpt::ReadWholeFile(path);

  std::string flipped = sealed;
  const std::string key = "\"global_step\": ";
  ASSERT_NE(flipped.find(key), std::string::npos);
  flipped[flipped.find(key) + key.size()] ^= 1;
  std::ofstream(path, std::ios::trunc | std::ios::binary) << flipped;
  for (const char* cmd : {"verify", "inspect", "inspect --json"}) {
    Cmd c = Offloadctl("ckpt " + std::string(cmd) + " " + dir);
    EXPECT_EQ(c.code, 1) << cmd << ": " << c.out;
    EXPECT_NE(c.out.find(path + ": manifest: checksum mismatch"), std::string::npos)
        << cmd << ": " << c.out;
  }

  auto m = ckpt::Manifest::FromJson(sealed);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  m->format_version = 1;  // as written before the manifest had a checksum
  std::ofstream(path, std::ios::trunc | std::ios::binary) << m->ToJson();
  EXPECT_EQ(Offloadctl("ckpt verify " + dir).code, 0);
  Cmd c = Offloadctl("ckpt inspect " + dir);
  EXPECT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("(format 1)"), std::string::npos) << c.out;
  c = Offloadctl("ckpt reshard " + dir + " --world-size 1 --out " + dir + "/w1");
  ASSERT_EQ(c.code, 0) << c.out;
  c = Offloadctl("ckpt inspect " + dir + "/w1 --json");
  ASSERT_EQ(c.code, 0) << c.out;
  auto j = nlohmann::json::parse(c.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << c.out;
  EXPECT_EQ(j["format_version"], ckpt::kFormatVersion);
  EXPECT_TRUE(j.contains("manifest_xxh3")) << c.out;
  std::filesystem::remove_all(dir);
}

// `ckpt reshard --precision`: a bf16 checkpoint converted to fp16 (world size and stage kept when
// not given) verifies, inspects as fp16 with F16 params equal to Cast(master) and no loss-scaler
// state, and a precision that is not bf16/fp16/fp32 is a usage error naming the flag.
TEST(CkptCli, ReshardConvertsPrecision) {
  const std::string dir = UniqueTestDir("ckpt_cli3");
  RunSpec s;
  s.config_json = kConfig;
  s.world = 2;
  s.steps = 1;
  s.after_step = [&](int, int, Engine& e) -> Status { return e.Save(dir + "/src", "t"); };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();

  Cmd c = Offloadctl("ckpt reshard " + dir + "/src --precision fp16 --out " + dir + "/fp16");
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("world size 2, stage 3, fp16"), std::string::npos) << c.out;
  EXPECT_EQ(Offloadctl("ckpt verify " + dir + "/fp16").code, 0);
  c = Offloadctl("ckpt inspect " + dir + "/fp16 --json");
  ASSERT_EQ(c.code, 0) << c.out;
  auto j = nlohmann::json::parse(c.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << c.out;
  EXPECT_EQ(j["precision"], "fp16");
  EXPECT_EQ(j["param_dtype"], "F16");
  EXPECT_TRUE(j["loss_scaler"].is_null()) << j["loss_scaler"];
  c = Offloadctl("ckpt inspect " + dir + "/fp16");
  EXPECT_NE(c.out.find("loss scale from the loading engine's config"), std::string::npos) << c.out;
  auto m = ckpt::VerifyCheckpoint(dir + "/fp16", "");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ckpt::RangeReader rd(dir + "/fp16/t", *m);
  for (size_t g = 0; g < m->groups.size(); ++g) {
    std::vector<uint16_t> params(m->groups[g].numel);
    ASSERT_TRUE(rd.Read(g, 0, 0, params.size(), params.data()).ok());
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_EQ(params[i], FloatToHalf(r.master[g][i]).bits) << "group " << g << " [" << i << "]";
    }
  }
  c = Offloadctl("ckpt reshard " + dir + "/src --precision int8 --out " + dir + "/x");
  EXPECT_EQ(c.code, 2) << c.out;
  EXPECT_NE(c.out.find("--precision"), std::string::npos) << c.out;
  EXPECT_FALSE(std::filesystem::exists(dir + "/x"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata::testing
