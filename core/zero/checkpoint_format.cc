// Checkpoint format: manifest JSON, safetensors headers, durable file operations, verification.
// See checkpoint_format.h.
#include "core/zero/checkpoint_format.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <vector>

#include "core/zero/engine_internal.h"
#include "nlohmann/json.hpp"
#include "sched/zero_layout.h"
#include "sched/zero_partition.h"
#include "strata/dtype.h"

namespace strata::zero::ckpt {

using nlohmann::json;

namespace {

Status Errno(std::string_view op, const std::string& path) {
  return Status::FromErrno(errno, op, path);
}

constexpr char kManifestSumKey[] = "manifest_xxh3";
// A sealed manifest (format version 2 on) ends with its checksum member, as ToJson writes it:
// kSumHead, 16 lowercase hex digits, kSumTail. The checksum is the XXH3-64 of every byte before
// kSumHead, so any changed byte of the file is caught: before it by the sum, in it by the shape.
constexpr std::string_view kSumHead = ",\n  \"manifest_xxh3\": \"";
constexpr std::string_view kSumTail = "\"\n}\n";
constexpr size_t kSumTrailer = kSumHead.size() + 16 + kSumTail.size();

// `body`: a JSON object as json::dump(2) writes it (ending in "\n}"); returns it sealed.
std::string SealManifest(const std::string& body) {
  const std::string_view members(body.data(), body.size() - 2);  // without "\n}"
  const uint64_t sum = XXH3_64bits(members.data(), members.size());
  return std::string(members) + std::string(kSumHead) + Hex64(sum) + std::string(kSumTail);
}

bool IsLowerHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  });
}

// The checksum a sealed manifest's trailer holds; false when `text` does not end in one.
bool SealedSum(const std::string& text, std::string_view* sum) {
  if (text.size() < kSumTrailer) return false;
  const std::string_view t(text), trailer = t.substr(text.size() - kSumTrailer);
  *sum = trailer.substr(kSumHead.size(), 16);
  return trailer.substr(0, kSumHead.size()) == kSumHead && IsLowerHex(*sum) &&
         trailer.substr(kSumHead.size() + 16) == kSumTail;
}

// The manifest's own checksum against its text: checked whenever the text ends in one (whatever
// format_version says: that value is covered too); from format version 2 (`j`, the parsed text)
// it must be there. Corruption on a mismatch, or a checksum missing or not where it is written.
Status CheckManifestSum(const std::string& text, const json& j) {
  std::string_view want;
  if (SealedSum(text, &want)) {
    const uint64_t sum = XXH3_64bits(text.data(), text.size() - kSumTrailer);
    if (Hex64(sum) == want) return Status::OK();
    return Status::Corruption("manifest: checksum mismatch (" + std::string(kManifestSumKey) +
                              " says " + std::string(want) + ", its contents hash to " +
                              Hex64(sum) + "): the manifest is damaged");
  }
  if (j.contains(kManifestSumKey)) {
    return Status::Corruption(std::string("manifest: \"") + kManifestSumKey +
                              "\" is not the 16 hex digits of the last member, as written: the "
                              "manifest is damaged or was rewritten");
  }
  const json v = j.value("format_version", json());
  if (!v.is_number_integer() || v.get<int64_t>() < 2) return Status::OK();  // read on
  return Status::Corruption(std::string("manifest: no \"") + kManifestSumKey +
                            "\" (format version 2 and later have one)");
}

}  // namespace

std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Manifest
// ---------------------------------------------------------------------------------------------

std::string Manifest::RankFileName(int rank) {
  return "rank" + std::to_string(rank) + ".safetensors";
}

std::string Manifest::TensorName(const std::string& group, const char* kind, int rank) {
  return group + "." + kind + "[r" + std::to_string(rank) + "]";
}

std::string Manifest::ToJson() const {
  json j;
  j["format"] = "strata-checkpoint";
  j["format_version"] = format_version;
  j["tag"] = tag;
  j["world_size"] = world_size;
  j["stage"] = stage;
  j["precision"] = precision;
  j["param_dtype"] = param_dtype;
  j["offload_optimizer"] = offload_optimizer;
  j["offload_param"] = offload_param;
  j["global_step"] = global_step;
  j["skipped_steps"] = skipped_steps;
  j["applied_steps"] = applied_steps;
  if (adam_step_base != 0) j["adam_step_base"] = adam_step_base;
  if (lr_step_base != 0) j["lr_step_base"] = lr_step_base;
  j["last_lr"] = last_lr;
  j["loss_scaler"] = has_scaler_state ? json{{"scale", scale},
                                             {"iteration", scaler_iteration},
                                             {"last_overflow_iteration", scaler_last_overflow},
                                             {"hysteresis_left", scaler_hysteresis_left}}
                                      : json(nullptr);
  json groups_j = json::array();
  for (const GroupEntry& g : this->groups) {
    json params = json::array();
    for (const ParamEntry& p : g.params) params.push_back({{"name", p.name}, {"shape", p.shape}});
    groups_j.push_back(
        {{"name", g.name}, {"params", params}, {"numel", g.numel}, {"shard_elems", g.shard_elems}});
    if (!g.trainable) groups_j.back()["trainable"] = false;
    if (g.excluded) groups_j.back()["excluded"] = true;
    if (g.changed) groups_j.back()["changed"] = true;
    if (g.fingerprint != 0) groups_j.back()["fingerprint"] = Hex64(g.fingerprint);
  }
  j["model"] = {{"groups", groups_j}};
  j["shard_layout"] = {
      {"rule",
       "rank r's file holds elements [r*shard_elems, (r+1)*shard_elems) of each group's "
       "padded flat buffer, per state kind; elements >= numel are zero padding"},
      {"state_kinds", {"param16", "master32", "exp_avg", "exp_avg_sq"}}};
  json files_j = json::array();
  for (const FileEntry& f : files) {
    files_j.push_back({{"name", f.name},
                       {"rank", f.rank},
                       {"size_bytes", f.size_bytes},
                       {"xxh3", Hex64(f.xxh3)}});
  }
  j["files"] = files_j;
  j["client_state"] = has_client_state ? json(kClientStateName) : json(nullptr);
  auto cfg = json::parse(config_json, nullptr, false);
  j["config"] = cfg.is_discarded() ? json(config_json) : cfg;
  return format_version >= 2 ? SealManifest(j.dump(2)) : j.dump(2) + "\n";
}

namespace {

constexpr uint64_t kMaxLatestBytes = 4096;  // a tag name
constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 30;

// A group's model description adds up (a format-1 manifest has no checksum, and the readers
// that do not compare it with a model, zero_to_fp32, export and reshard, size what they write
// from it): every dimension >= 1, the parameters' elements sum to numel, and shard_elems is the
// engine's partition of numel over the world size.
Status CheckGroupLayout(const GroupEntry& g, int world_size) {
  const auto bad = [&](const std::string& what) {
    return Status::Corruption("manifest: group '" + g.name + "': " + what);
  };
  constexpr uint64_t kMaxElems = uint64_t{1} << 56;  // far past any model, far from overflow
  uint64_t total = 0;
  for (const ParamEntry& p : g.params) {
    uint64_t n = 1;
    for (int64_t d : p.shape) {
      if (d < 1 || static_cast<uint64_t>(d) > kMaxElems / n) {
        return bad("parameter '" + p.name + "' has a dimension " + std::to_string(d) +
                   " out of range");
      }
      n *= static_cast<uint64_t>(d);
    }
    total += n;
    if (total > kMaxElems) return bad("more elements than any model holds");
  }
  if (g.params.empty() || total != g.numel) {
    return bad("its parameters' shapes hold " + std::to_string(total) + " elements, numel says " +
               std::to_string(g.numel));
  }
  const uint64_t want = sched::ShardElems(g.numel, world_size, kShardAlignElems);
  if (g.shard_elems != want) {
    return bad("shard_elems " + std::to_string(g.shard_elems) + " is not " + std::to_string(want) +
               ", numel " + std::to_string(g.numel) + " over " + std::to_string(world_size) +
               " rank(s)");
  }
  return Status::OK();
}

}  // namespace

Result<Manifest> Manifest::FromJson(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) {
    return Status::Corruption("manifest is not valid JSON (" + std::to_string(text.size()) +
                              " bytes: truncated or damaged)");
  }
  if (!j.is_object()) return Status::Corruption("manifest is not a JSON object");
  Manifest m;
  try {
    STRATA_RETURN_IF_ERROR(CheckManifestSum(text, j));
    if (j.value("format", "") != "strata-checkpoint") {
      return Status::Corruption("manifest: \"format\" is not \"strata-checkpoint\"");
    }
    m.format_version = j.at("format_version").get<int>();
    if (m.format_version < kOldestFormatVersion || m.format_version > kFormatVersion) {
      return Status::FailedPrecondition(
          "checkpoint format version " + std::to_string(m.format_version) + ", this build reads " +
          std::to_string(kOldestFormatVersion) + " to " + std::to_string(kFormatVersion));
    }
    m.tag = j.at("tag").get<std::string>();
    m.world_size = j.at("world_size").get<int>();
    m.stage = j.at("stage").get<int>();
    m.precision = j.at("precision").get<std::string>();
    m.param_dtype = j.at("param_dtype").get<std::string>();
    m.offload_optimizer = j.at("offload_optimizer").get<std::string>();
    m.offload_param = j.at("offload_param").get<std::string>();
    m.global_step = j.at("global_step").get<int64_t>();
    m.skipped_steps = j.at("skipped_steps").get<int64_t>();
    m.applied_steps = j.at("applied_steps").get<int64_t>();
    m.adam_step_base = j.value("adam_step_base", int64_t{0});
    m.lr_step_base = j.value("lr_step_base", int64_t{0});
    m.last_lr = j.at("last_lr").get<double>();
    const json& ls = j.at("loss_scaler");
    m.has_scaler_state = !ls.is_null();
    if (m.has_scaler_state) {
      m.scale = ls.at("scale").get<double>();
      m.scaler_iteration = ls.at("iteration").get<int64_t>();
      m.scaler_last_overflow = ls.at("last_overflow_iteration").get<int64_t>();
      m.scaler_hysteresis_left = ls.at("hysteresis_left").get<int64_t>();
    }
    for (const json& g : j.at("model").at("groups")) {
      GroupEntry ge;
      ge.name = g.at("name").get<std::string>();
      ge.numel = g.at("numel").get<uint64_t>();
      ge.shard_elems = g.at("shard_elems").get<uint64_t>();
      ge.trainable = g.value("trainable", true);
      ge.excluded = g.value("excluded", false);
      ge.changed = g.value("changed", false);
      if (g.contains("fingerprint")) {
        ge.fingerprint = std::strtoull(g.at("fingerprint").get<std::string>().c_str(), nullptr, 16);
      }
      if ((ge.excluded || ge.changed) && ge.trainable) {
        return Status::Corruption("manifest: group '" + ge.name + "' is " +
                                  (ge.excluded ? "excluded" : "changed") +
                                  " but trainable (only frozen groups are)");
      }
      if (ge.excluded && ge.changed) {
        return Status::Corruption("manifest: group '" + ge.name +
                                  "' is excluded and changed (a changed group is saved whole)");
      }
      for (const json& p : g.at("params")) {
        ge.params.push_back(
            {p.at("name").get<std::string>(), p.at("shape").get<std::vector<int64_t>>()});
      }
      m.groups.push_back(std::move(ge));
    }
    for (const json& f : j.at("files")) {
      FileEntry fe;
      fe.name = f.at("name").get<std::string>();
      fe.rank = f.at("rank").get<int>();
      fe.size_bytes = f.at("size_bytes").get<uint64_t>();
      fe.xxh3 = std::strtoull(f.at("xxh3").get<std::string>().c_str(), nullptr, 16);
      if (fe.name.empty() || fe.name.find('/') != std::string::npos) {
        return Status::Corruption("manifest: file name '" + fe.name + "' is not a plain name");
      }
      m.files.push_back(std::move(fe));
    }
    m.has_client_state = !j.at("client_state").is_null();
    const json& cfg = j.at("config");
    m.config_json = cfg.is_string() ? cfg.get<std::string>() : cfg.dump(2);
  } catch (const json::exception& e) {
    return Status::Corruption(std::string("manifest: ") + e.what());
  }
  if (m.world_size < 1 || m.stage < 0 || m.stage > 3 || m.groups.empty() ||
      (m.param_dtype != "BF16" && m.param_dtype != "F16" && m.param_dtype != "F32")) {
    return Status::Corruption("manifest: world_size, stage, param_dtype or model out of range");
  }
  int rank_files = 0;
  for (const FileEntry& f : m.files) rank_files += f.rank >= 0;
  if (rank_files != m.world_size) {
    return Status::Corruption("manifest: " + std::to_string(rank_files) +
                              " rank files for world size " + std::to_string(m.world_size));
  }
  for (const GroupEntry& g : m.groups) STRATA_RETURN_IF_ERROR(CheckGroupLayout(g, m.world_size));
  return m;
}

// ---------------------------------------------------------------------------------------------
// safetensors
// ---------------------------------------------------------------------------------------------

std::string RankFileHeader(const Manifest& m, int rank, uint64_t* data_start,
                           std::vector<TensorLoc>* locs) {
  // nlohmann's default object sorts keys; safetensors readers do not care about key order, and
  // the data offsets keep file order.
  json h = json::object();
  h["__metadata__"] = {{"format", "strata-checkpoint"},
                       {"format_version", std::to_string(m.format_version)},
                       {"rank", std::to_string(rank)},
                       {"world_size", std::to_string(m.world_size)}};
  std::vector<TensorLoc> l;
  uint64_t off = 0;
  for (const GroupEntry& g : m.groups) {
    for (size_t k = 0; k < kNumStateKinds; ++k) {
      TensorLoc t;
      if (!g.HasKind(k)) {  // a frozen group's optimizer state, an excluded group's anything:
                            // an empty place, not in the file
        t.begin = t.end = off;
        l.push_back(std::move(t));
        continue;
      }
      t.name = Manifest::TensorName(g.name, kStateKinds[k], rank);
      t.dtype = k == 0 ? m.param_dtype : "F32";
      t.shape = {static_cast<int64_t>(g.shard_elems)};
      t.begin = off;
      off += g.shard_elems * m.ElemBytes(k);
      t.end = off;
      h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
      l.push_back(std::move(t));
    }
  }
  std::string text = h.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  const uint64_t n = text.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  *data_start = out.size();
  for (TensorLoc& t : l) {
    t.begin += *data_start;
    t.end += *data_start;
  }
  if (locs != nullptr) *locs = std::move(l);
  return out;
}

Result<std::vector<TensorLoc>> ReadSafetensorsHeader(const std::string& path,
                                                     std::string* metadata_json) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("open", path);
  struct stat st {};
  ::fstat(fd, &st);
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  uint8_t len_bytes[8];
  Status s = ReadAt(fd, path, 0, len_bytes, 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  std::string text;
  if (s.ok() && (n > (uint64_t{100} << 20) || 8 + n > file_size)) {
    s = Status::Corruption(path + ": safetensors header length " + std::to_string(n) +
                           " does not fit the file (" + std::to_string(file_size) + " bytes)");
  }
  if (s.ok()) {
    text.resize(n);
    s = ReadAt(fd, path, 8, text.data(), n);
  }
  ::close(fd);
  STRATA_RETURN_IF_ERROR(s);
  json h = json::parse(text, nullptr, false);
  if (h.is_discarded() || !h.is_object()) return Status::Corruption(path + ": header is not JSON");
  std::vector<TensorLoc> out;
  try {
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (metadata_json != nullptr) *metadata_json = it.value().dump();
        continue;
      }
      TensorLoc t;
      t.name = it.key();
      t.dtype = it.value().at("dtype").get<std::string>();
      t.shape = it.value().at("shape").get<std::vector<int64_t>>();
      const auto offs = it.value().at("data_offsets").get<std::vector<uint64_t>>();
      if (offs.size() != 2 || offs[0] > offs[1] || 8 + n + offs[1] > file_size) {
        return Status::Corruption(path + ": tensor '" + t.name + "' lies outside the file");
      }
      t.begin = 8 + n + offs[0];
      t.end = 8 + n + offs[1];
      out.push_back(std::move(t));
    }
  } catch (const json::exception& e) {
    return Status::Corruption(path + ": " + e.what());
  }
  std::sort(out.begin(), out.end(),
            [](const TensorLoc& a, const TensorLoc& b) { return a.begin < b.begin; });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------------

FileWriter::FileWriter(FileWriter&& o) noexcept { *this = std::move(o); }

FileWriter& FileWriter::operator=(FileWriter&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    if (state_ != nullptr) XXH3_freeState(static_cast<XXH3_state_t*>(state_));
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    size_ = o.size_;
    state_ = o.state_;
    env_ = o.env_;
    o.fd_ = -1;
    o.state_ = nullptr;
  }
  return *this;
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (state_ != nullptr) XXH3_freeState(static_cast<XXH3_state_t*>(state_));
}

Result<FileWriter> FileWriter::Create(const std::string& path, CheckpointEnv& env) {
  env.BeforeDurableOp({.kind = DurableOp::Kind::kCreate, .path = path});
  FileWriter w;
  w.env_ = &env;
  w.fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w.fd_ < 0) return Errno("create", path);
  w.path_ = path;
  w.state_ = XXH3_createState();
  if (w.state_ == nullptr) return Status::ResourceExhausted("XXH3_createState");
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(w.state_));
  return w;
}

Status FileWriter::Append(const void* data, uint64_t bytes) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  env_->BeforeDurableOp({.kind = DurableOp::Kind::kWrite,
                         .path = path_,
                         .fd = fd_,
                         .offset = size_,
                         .data = p,
                         .bytes = bytes});
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), p, bytes);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd_, p + done, std::min<uint64_t>(bytes - done, uint64_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("write", path_);
    }
    if (n == 0) return Status::IOError(path_ + ": write wrote nothing");
    done += static_cast<uint64_t>(n);
  }
  size_ += bytes;
  return Status::OK();
}

Status FileWriter::Finish() {
  env_->BeforeDurableOp({.kind = DurableOp::Kind::kSync, .path = path_});
  if (::fsync(fd_) != 0) return Errno("fsync", path_);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return Errno("close", path_);
  return Status::OK();
}

uint64_t FileWriter::xxh3() const {
  return state_ != nullptr ? XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_)) : 0;
}

Status MakeDir(const std::string& path, CheckpointEnv& env) {
  env.BeforeDurableOp({.kind = DurableOp::Kind::kMakeDir, .path = path});
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) return Errno("mkdir", path);
  return Status::OK();
}

Status FsyncDir(const std::string& path, CheckpointEnv& env) {
  env.BeforeDurableOp({.kind = DurableOp::Kind::kSyncDir, .path = path});
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open directory", path);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::FromErrno(err, "fsync directory", path);
  return Status::OK();
}

Status RenamePath(const std::string& from, const std::string& to, CheckpointEnv& env) {
  env.BeforeDurableOp({.kind = DurableOp::Kind::kRename, .path = from});
  if (::rename(from.c_str(), to.c_str()) != 0) return Errno("rename to " + to, from);
  return Status::OK();
}

Status ExchangePaths(const std::string& from, const std::string& to, const std::string& aside,
                     CheckpointEnv& env) {
  env.BeforeDurableOp({.kind = DurableOp::Kind::kRename, .path = from});
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
    return Status::OK();
  }
  if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) {
    return Errno("exchange with " + to, from);
  }
  STRATA_RETURN_IF_ERROR(RenamePath(to, aside, env));
  return RenamePath(from, to, env);
}

Status RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return Status::IOError("remove " + path + ": " + ec.message());
  return Status::OK();
}

bool PathExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

Status ReadAt(int fd, const std::string& path, uint64_t offset, void* out, uint64_t bytes) {
  uint8_t* p = static_cast<uint8_t*>(out);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, p + done, std::min<uint64_t>(bytes - done, uint64_t{1} << 30),
                              static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("read", path);
    }
    if (n == 0) {
      return Status::Corruption(path + ": ends at " + std::to_string(offset + done) +
                                " bytes, expected at least " + std::to_string(offset + bytes));
    }
    done += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

Result<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Errno("open", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    Status e = Errno("stat", path);
    ::close(fd);
    return e;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + " is not a regular file");
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    return Status::Corruption(path + " is " + std::to_string(st.st_size) +
                              " bytes, more than the " + std::to_string(max_bytes) +
                              " such a file may hold");
  }
  std::string out;
  char buf[65536];
  for (;;) {
    if (out.size() > max_bytes) {  // grew while being read
      ::close(fd);
      return Status::Corruption(path + " grew past " + std::to_string(max_bytes) +
                                " bytes while being read");
    }
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      Status st = Errno("read", path);
      ::close(fd);
      return st;
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

Status WriteSmallFile(const std::string& path, const std::string& text, bool atomic,
                      CheckpointEnv& env) {
  const std::string target = atomic ? path + ".tmp" : path;
  STRATA_ASSIGN_OR_RETURN(FileWriter w, FileWriter::Create(target, env));
  STRATA_RETURN_IF_ERROR(w.Append(text.data(), text.size()));
  STRATA_RETURN_IF_ERROR(w.Finish());
  if (!atomic) return Status::OK();
  STRATA_RETURN_IF_ERROR(RenamePath(target, path, env));
  const std::string parent = std::filesystem::path(path).parent_path().string();
  return FsyncDir(parent.empty() ? "." : parent, env);  // a bare name: the working directory
}

Status HashFile(const std::string& path, uint64_t* size_bytes, uint64_t* xxh3) {
  // O_DIRECT with read-ahead (checkpoint_io.h), default chunking.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<StreamReader> r,
                          StreamReader::Open(path, StreamOptions{}, true));
  STRATA_ASSIGN_OR_RETURN(*xxh3, r->HashToEnd());
  *size_bytes = r->size_bytes();
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------------------------

Result<std::string> ResolveTag(const std::string& dir, const std::string& tag) {
  if (!tag.empty()) {
    if (tag.find('/') != std::string::npos || tag == "." || tag == ".." || tag == kLatestName) {
      return Status::InvalidArgument("checkpoint tag '" + tag + "' is not a plain name");
    }
    return tag;
  }
  if (dir.empty()) return Status::InvalidArgument("the checkpoint directory is empty: name one");
  if (!PathExists(dir)) return Status::NotFound("checkpoint directory " + dir + " does not exist");
  const std::string latest = dir + "/" + kLatestName;
  auto text = ReadWholeFile(latest, kMaxLatestBytes);
  if (!text.ok()) {
    if (!text.status().IsNotFound()) return text.status();  // not a file, too large
    return Status::NotFound("no checkpoint in " + dir + " (" + latest +
                            " is missing: " + std::string(text.status().message()) + ")");
  }
  // Whitespace around the name (a "\r\n" an editor wrote) is not part of it, as DeepSpeed's
  // and strata's Python readers strip it.
  std::string t = *text;
  const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!t.empty() && blank(t.back())) t.pop_back();
  t.erase(0, std::find_if_not(t.begin(), t.end(), blank) - t.begin());
  if (t.empty() || t.find('/') != std::string::npos || t == "." || t == "..") {
    return Status::Corruption(latest + ": does not name a tag");
  }
  return t;
}

Result<Manifest> ReadManifest(const std::string& dir, const std::string& tag) {
  const std::string tag_dir = dir + "/" + tag;
  const std::string path = tag_dir + "/" + kManifestName;
  if (!PathExists(tag_dir)) {
    const bool partial = PathExists(tag_dir + ".tmp");
    return Status::NotFound("checkpoint " + tag_dir + " does not exist" +
                            (partial ? " (only an incomplete " + tag +
                                           ".tmp, from a save that "
                                           "did not finish)"
                                     : std::string()));
  }
  auto text = ReadWholeFile(path, kMaxManifestBytes);
  if (!text.ok()) {
    // DeepSpeed's save_checkpoint wrote it: only the Python engine reads those.
    const bool deepspeed = PathExists(tag_dir + "/mp_rank_00_model_states.pt") ||
                           PathExists(tag_dir + "/zero_pp_rank_0_mp_rank_00_model_states.pt");
    return Status::NotFound(
        "checkpoint file " + path +
        " is missing or unreadable: " + std::string(text.status().message()) +
        (deepspeed ? " (" + tag_dir +
                         " is a checkpoint DeepSpeed wrote: strata resumes from it with the "
                         "Python engine's load_checkpoint, docs/checkpoints.md)"
                   : std::string()));
  }
  auto m = Manifest::FromJson(*text);
  if (!m.ok()) return Status(m.status().code(), path + ": " + std::string(m.status().message()));
  if (m->tag != tag) {
    // A save's unfinished directory (or one being retired) is no checkpoint. A tag directory
    // renamed after its save ("best", "final": DeepSpeed builds its paths from the tag and
    // checks nothing inside) loads under its new name.
    if (tag.size() > 4 && tag.compare(tag.size() - 4, 4, ".tmp") == 0) {
      return Status::Corruption(path + ": names tag '" + m->tag + "': " + tag +
                                " is an unfinished save's directory, not a checkpoint");
    }
    m->tag = tag;
  }
  return m;
}

Status CheckFileSize(const std::string& dir, const Manifest& m, size_t i) {
  const FileEntry& f = m.files[i];
  const std::string path = dir + "/" + m.tag + "/" + f.name;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::NotFound("checkpoint file " + path + " is missing");
  }
  if (static_cast<uint64_t>(st.st_size) != f.size_bytes) {
    return Status::Corruption("checkpoint file " + path +
                              " is damaged: " + std::to_string(st.st_size) +
                              " bytes, the manifest says " + std::to_string(f.size_bytes));
  }
  return Status::OK();
}

Status VerifyFiles(const std::string& dir, const Manifest& m, const std::vector<size_t>& files) {
  std::vector<size_t> which = files;
  if (which.empty()) {
    for (size_t i = 0; i < m.files.size(); ++i) which.push_back(i);
  }
  for (size_t i : which) {
    const FileEntry& f = m.files[i];
    const std::string path = dir + "/" + m.tag + "/" + f.name;
    STRATA_RETURN_IF_ERROR(CheckFileSize(dir, m, i));
    uint64_t size = 0, sum = 0;
    STRATA_RETURN_IF_ERROR(HashFile(path, &size, &sum));
    if (size != f.size_bytes || sum != f.xxh3) {
      return Status::Corruption("checkpoint file " + path + " is damaged: XXH3 " + Hex64(sum) +
                                ", the manifest says " + Hex64(f.xxh3));
    }
  }
  return Status::OK();
}

namespace {

// Whether a rank file's tensors (`got`, file order) are the ones RankFileHeader lays out in
// `want`; on true, `want` takes the file's offsets (its empty places, a frozen group's optimizer
// states, stay empty).
bool MatchLayout(const std::vector<TensorLoc>& got, std::vector<TensorLoc>* want) {
  size_t i = 0;
  for (TensorLoc& w : *want) {
    if (w.name.empty()) continue;
    if (i >= got.size()) return false;
    const TensorLoc& g = got[i++];
    if (g.name != w.name || g.dtype != w.dtype || g.shape != w.shape ||
        g.end - g.begin != w.end - w.begin) {
      return false;
    }
    w.begin = g.begin;
    w.end = g.end;
  }
  return i == got.size();
}

}  // namespace

Result<std::vector<TensorLoc>> CheckRankFileHeader(const std::string& path, const Manifest& m,
                                                   int rank) {
  uint64_t data_start = 0;
  std::vector<TensorLoc> want;
  RankFileHeader(m, rank, &data_start, &want);
  STRATA_ASSIGN_OR_RETURN(std::vector<TensorLoc> got, ReadSafetensorsHeader(path));
  if (!MatchLayout(got, &want)) {
    return Status::Corruption(path + ": its tensors do not match the manifest's layout");
  }
  return want;
}

Result<Manifest> VerifyCheckpoint(const std::string& dir, const std::string& tag) {
  STRATA_ASSIGN_OR_RETURN(std::string t, ResolveTag(dir, tag));
  STRATA_ASSIGN_OR_RETURN(Manifest m, ReadManifest(dir, t));
  STRATA_RETURN_IF_ERROR(VerifyFiles(dir, m));
  for (const FileEntry& f : m.files) {
    if (f.rank < 0) continue;
    STRATA_RETURN_IF_ERROR(CheckRankFileHeader(dir + "/" + t + "/" + f.name, m, f.rank).status());
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// RangeReader
// ---------------------------------------------------------------------------------------------

RangeReader::RangeReader(std::string tag_dir, const Manifest& m, const StreamOptions& options,
                         int hash_rank)
    : dir_(std::move(tag_dir)), m_(m), options_(options), hash_rank_(hash_rank) {
  streams_.resize(static_cast<size_t>(m.world_size));
  locs_.resize(static_cast<size_t>(m.world_size));
}

RangeReader::~RangeReader() = default;

Status RangeReader::Read(size_t g, size_t kind, uint64_t begin, uint64_t elems, void* out) {
  if (m_.groups[g].excluded) {
    return Status::FailedPrecondition("group '" + m_.groups[g].name +
                                      "' is frozen and was left out at save (exclude_frozen): the "
                                      "checkpoint holds nothing of it");
  }
  if (!m_.groups[g].HasKind(kind)) {
    return Status::FailedPrecondition("group '" + m_.groups[g].name + "' is frozen: the checkpoint "
                                      "holds no " + std::string(kStateKinds[kind]) + " for it");
  }
  const uint64_t eb = m_.ElemBytes(kind);
  const uint64_t s = m_.groups[g].shard_elems;
  uint8_t* dst = static_cast<uint8_t*>(out);
  const uint64_t end = begin + elems;
  const uint64_t saved_end = s * static_cast<uint64_t>(m_.world_size);
  for (uint64_t at = begin; at < end;) {
    if (at >= saved_end) {
      std::memset(dst + (at - begin) * eb, 0, (end - at) * eb);
      break;
    }
    const int r = static_cast<int>(at / s);
    const uint64_t hi = std::min(end, (static_cast<uint64_t>(r) + 1) * s);
    STRATA_RETURN_IF_ERROR(Open(r));
    const TensorLoc& t = locs_[static_cast<size_t>(r)][g * kNumStateKinds + kind];
    const uint64_t off = t.begin + (at - static_cast<uint64_t>(r) * s) * eb;
    STRATA_RETURN_IF_ERROR(
        streams_[static_cast<size_t>(r)]->Read(off, dst + (at - begin) * eb, (hi - at) * eb));
    at = hi;
  }
  return Status::OK();
}

Status RangeReader::ReadFp32(size_t g, uint64_t begin, uint64_t elems, float* out) {
  if (m_.groups[g].trainable) return Read(g, 1, begin, elems, out);
  if (m_.param_dtype == "F32") return Read(g, 0, begin, elems, out);
  // 16-bit values in the upper half of out, widened from the front (each slot is read before
  // any wider value reaches it).
  uint16_t* half = reinterpret_cast<uint16_t*>(out) + elems;
  STRATA_RETURN_IF_ERROR(Read(g, 0, begin, elems, half));
  const bool bf16 = m_.param_dtype == "BF16";
  for (uint64_t i = 0; i < elems; ++i) {
    out[i] = bf16 ? Bf16ToFloat(bf16_t{half[i]}) : HalfToFloat(f16_t{half[i]});
  }
  return Status::OK();
}

Result<uint64_t> RangeReader::FileXxh3(int r) {
  if (r != hash_rank_) return Status::FailedPrecondition(Path(r) + ": not hashed while read");
  STRATA_RETURN_IF_ERROR(Open(r));
  return streams_[static_cast<size_t>(r)]->HashToEnd();
}

std::string RangeReader::Path(int r) const { return dir_ + "/" + Manifest::RankFileName(r); }

Status RangeReader::Open(int r) {
  if (streams_[static_cast<size_t>(r)] != nullptr) return Status::OK();
  STRATA_ASSIGN_OR_RETURN(locs_[static_cast<size_t>(r)], CheckRankFileHeader(Path(r), m_, r));
  STRATA_ASSIGN_OR_RETURN(streams_[static_cast<size_t>(r)],
                          StreamReader::Open(Path(r), options_, r == hash_rank_));
  return Status::OK();
}

Status CommitCheckpoint(const std::string& dir, const Manifest& m, CheckpointEnv& env,
                        bool update_latest) {
  const std::string tmp = dir + "/" + m.tag + ".tmp", final_dir = dir + "/" + m.tag;
  STRATA_RETURN_IF_ERROR(WriteSmallFile(tmp + "/" + kManifestName, m.ToJson(), false, env));
  STRATA_RETURN_IF_ERROR(FsyncDir(tmp, env));
  const bool replaces = PathExists(final_dir);
  // The replaced checkpoint ends under a `.tmp` name (never read; a later save removes what a
  // crash leaves): `tmp` after an exchange, `aside` where the filesystem cannot exchange.
  const std::string aside = final_dir + ".replaced.tmp";
  if (replaces) {
    STRATA_RETURN_IF_ERROR(ExchangePaths(tmp, final_dir, aside, env));
  } else {
    STRATA_RETURN_IF_ERROR(RenamePath(tmp, final_dir, env));
  }
  STRATA_RETURN_IF_ERROR(FsyncDir(dir, env));
  if (update_latest) {
    STRATA_RETURN_IF_ERROR(WriteSmallFile(dir + "/" + kLatestName, m.tag + "\n", true, env));
  }
  if (!replaces) return Status::OK();
  STRATA_RETURN_IF_ERROR(RemoveTree(tmp));
  return RemoveTree(aside);
}

uint64_t FrozenFingerprint(uint64_t first, const float* v, uint64_t n, uint64_t numel,
                           DType dtype) {
  constexpr uint64_t kStride = 64;
  uint64_t sum = 0;
  const uint64_t end = std::min(first + n, numel);
  for (uint64_t i = (first + kStride - 1) / kStride * kStride; i < end; i += kStride) {
    const float x = v[i - first];
    uint32_t bits;
    if (dtype == DType::kBF16) {
      bits = FloatToBf16(x).bits;
    } else if (dtype == DType::kF16) {
      bits = FloatToHalf(x).bits;
    } else {
      std::memcpy(&bits, &x, sizeof bits);
    }
    uint64_t h = (i * 0x9E3779B97F4A7C15ull) ^ bits;  // splitmix64's finalizer over (index, bits)
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    sum += h ^ (h >> 31);
  }
  return sum;
}

// ---------------------------------------------------------------------------------------------
// Offline resharding
// ---------------------------------------------------------------------------------------------

namespace {

// The safetensors dtype of param16 at `precision`; empty for an unknown precision.
std::string ParamDType(const std::string& precision) {
  if (precision == "bf16") return "BF16";
  if (precision == "fp16") return "F16";
  if (precision == "fp32") return "F32";
  return "";
}

}  // namespace

Status ConvertManifestPrecision(Manifest* m, const std::string& precision) {
  const std::string dtype = ParamDType(precision);
  if (dtype.empty()) {
    return Status::InvalidArgument("precision '" + precision + "' is not bf16, fp16 or fp32");
  }
  if (precision == m->precision) return Status::OK();
  m->precision = precision;
  m->param_dtype = dtype;
  // Frozen fingerprints are of values rounded to the old working dtype: unknown in the new one.
  for (GroupEntry& g : m->groups) g.fingerprint = 0;
  m->has_scaler_state = false;
  m->scale = 1;
  m->scaler_iteration = 0;
  m->scaler_last_overflow = -1;
  m->scaler_hysteresis_left = 0;
  // The recorded config says which precision the states are in; its other fp16 settings stay
  // (they are what a scaler would start from, but the loading engine's own config decides).
  json cfg = json::parse(m->config_json, nullptr, false);
  if (cfg.is_object()) {
    cfg["fp16"]["enabled"] = precision == "fp16";
    cfg["bf16"]["enabled"] = precision == "bf16";
    m->config_json = cfg.dump(2);
  }
  return Status::OK();
}

void ParamsFromMaster(const float* master, uint64_t n, const std::string& param_dtype, void* out) {
  if (param_dtype == "F32") {
    std::memcpy(out, master, n * 4);
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(out);
  if (param_dtype == "F16") {
    for (uint64_t i = 0; i < n; ++i) o[i] = FloatToHalf(master[i]).bits;
  } else {
    for (uint64_t i = 0; i < n; ++i) o[i] = FloatToBf16(master[i]).bits;
  }
}

namespace {
Status WriteResharded(const std::string& dir, const Manifest& m, const std::string& out_dir,
                      const StreamOptions& options, Manifest* manifest);
}  // namespace

Result<Manifest> ReshardCheckpoint(const std::string& dir, const std::string& tag,
                                   const ReshardTarget& to, const std::string& out_dir,
                                   const StreamOptions& options) {
  if ((to.world_size != 0 && (to.world_size < 1 || to.world_size > 4096)) || to.stage < -1 ||
      to.stage > 3) {
    return Status::InvalidArgument("reshard: world size " + std::to_string(to.world_size) +
                                   " (1..4096) and stage " + std::to_string(to.stage) + " (0..3)");
  }
  if (!to.precision.empty() && ParamDType(to.precision).empty()) {
    return Status::InvalidArgument("reshard: precision '" + to.precision +
                                   "' is not bf16, fp16 or fp32");
  }
  std::error_code ec;
  if (std::filesystem::equivalent(dir, out_dir, ec)) {
    return Status::InvalidArgument("reshard: --out must be another directory than " + dir);
  }
  // Inside one of the source's tag directories, the copy would nest in the checkpoint it reads.
  const std::filesystem::path out_path = std::filesystem::weakly_canonical(out_dir, ec);
  for (std::filesystem::path p = out_path; !ec && p.has_parent_path() && p != p.parent_path();
       p = p.parent_path()) {
    std::error_code same;
    if (std::filesystem::equivalent(p.parent_path(), dir, same)) {
      if (PathExists(p.string() + "/" + kManifestName)) {
        return Status::InvalidArgument("reshard: --out " + out_dir + " is inside " + p.string() +
                                       ", a checkpoint of " + dir + ": name a directory outside");
      }
      break;
    }
  }
  STRATA_ASSIGN_OR_RETURN(Manifest m, VerifyCheckpoint(dir, tag));
  Manifest n = m;
  n.format_version = kFormatVersion;  // written in this build's format, whatever it was read from
  const int world_size = to.world_size != 0 ? to.world_size : m.world_size;
  n.world_size = world_size;
  n.stage = to.stage >= 0 ? to.stage : m.stage;
  if (!to.precision.empty()) STRATA_RETURN_IF_ERROR(ConvertManifestPrecision(&n, to.precision));
  n.files.clear();
  std::vector<size_t> numels;
  for (const GroupEntry& g : m.groups) numels.push_back(g.numel);
  STRATA_ASSIGN_OR_RETURN(sched::PartitionPlan plan,
                          sched::PlanPartition(numels, world_size, kShardAlignElems));
  for (size_t g = 0; g < n.groups.size(); ++g) n.groups[g].shard_elems = plan.groups[g].shard_elems;
  const std::string final_dir = out_dir + "/" + m.tag, tmp = final_dir + ".tmp";
  if (PathExists(final_dir)) {
    return Status::FailedPrecondition("reshard: " + final_dir + " already exists");
  }
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return Status::IOError("create " + out_dir + ": " + ec.message());
  CheckpointEnv& env = options.Env();
  STRATA_RETURN_IF_ERROR(RemoveTree(tmp));
  STRATA_RETURN_IF_ERROR(MakeDir(tmp, env));
  Status st = WriteResharded(dir, m, out_dir, options, &n);
  if (!st.ok()) {
    RemoveTree(tmp).IgnoreError();  // never read, but it would hold the disk (a full one)
    return st;
  }
  return n;
}

namespace {

// ReshardCheckpoint's files into out_dir/<tag>.tmp, then the commit: each rank file of the new
// layout from the source's ranges, and the client state.
Status WriteResharded(const std::string& dir, const Manifest& m, const std::string& out_dir,
                      const StreamOptions& options, Manifest* manifest) {
  Manifest& n = *manifest;
  const int world_size = n.world_size;
  const bool convert = n.param_dtype != m.param_dtype;
  CheckpointEnv& env = options.Env();
  const std::string tmp = out_dir + "/" + m.tag + ".tmp";
  RangeReader rd(dir + "/" + m.tag, m, options);
  std::vector<uint8_t> buf(size_t{4} << 20);
  // Converting: param16 is re-derived from the masters, read by a second stream (so that each
  // stream still reads its files in order).
  std::vector<float> master;
  std::unique_ptr<RangeReader> master_rd;
  if (convert) master_rd = std::make_unique<RangeReader>(dir + "/" + m.tag, m, options);
  for (int r = 0; r < world_size; ++r) {
    uint64_t data_start = 0;
    std::vector<TensorLoc> locs;
    const std::string header = RankFileHeader(n, r, &data_start, &locs);
    const std::string path = tmp + "/" + Manifest::RankFileName(r);
    STRATA_ASSIGN_OR_RETURN(
        std::unique_ptr<StreamWriter> w,
        StreamWriter::Create(path, options, locs.empty() ? 0 : locs.back().end));
    STRATA_RETURN_IF_ERROR(w->Append(header.data(), header.size()));
    // File order: group by group, kind by kind (RankFileHeader's order).
    for (size_t g = 0; g < n.groups.size(); ++g) {
      const uint64_t s = n.groups[g].shard_elems;
      for (size_t k = 0; k < kNumStateKinds; ++k) {
        if (!n.groups[g].HasKind(k)) continue;
        const uint64_t eb = n.ElemBytes(k), step = buf.size() / eb;
        for (uint64_t at = 0; at < s; at += step) {
          const uint64_t cnt = std::min(step, s - at);
          const uint64_t begin = static_cast<uint64_t>(r) * s + at;
          if (k == 0 && convert) {
            master.resize(cnt);
            STRATA_RETURN_IF_ERROR(master_rd->ReadFp32(g, begin, cnt, master.data()));
            ParamsFromMaster(master.data(), cnt, n.param_dtype, buf.data());
          } else {
            STRATA_RETURN_IF_ERROR(rd.Read(g, k, begin, cnt, buf.data()));
          }
          STRATA_RETURN_IF_ERROR(w->Append(buf.data(), cnt * eb));
        }
      }
    }
    STRATA_RETURN_IF_ERROR(w->Finish());
    n.files.push_back({Manifest::RankFileName(r), r, w->size_bytes(), w->xxh3()});
  }
  if (m.has_client_state) {
    STRATA_ASSIGN_OR_RETURN(std::string blob,
                            ReadWholeFile(dir + "/" + m.tag + "/" + kClientStateName));
    STRATA_ASSIGN_OR_RETURN(FileWriter w, FileWriter::Create(tmp + "/" + kClientStateName, env));
    STRATA_RETURN_IF_ERROR(w.Append(blob.data(), blob.size()));
    STRATA_RETURN_IF_ERROR(w.Finish());
    n.files.push_back({kClientStateName, -1, w.size_bytes(), w.xxh3()});
  }
  return CommitCheckpoint(out_dir, n, env);
}

}  // namespace

}  // namespace strata::zero::ckpt
