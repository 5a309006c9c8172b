// The on-disk format of engine checkpoints (Engine::Save / Engine::Load, `offloadctl ckpt`): the
// manifest, the per-rank safetensors files, the crash-consistent file operations and the
// verification every reader runs first. No engine state here: the CLI uses it without an engine.
//
// Layout of `<dir>/`:
//   <tag>/manifest.json          written last, by rank 0 (see Manifest below)
//   <tag>/rank<r>.safetensors    rank r's part: for every group g (model order) and state kind
//                                 k in {param16, master32, exp_avg, exp_avg_sq}, the tensor
//                                 "<group>.<k>[r<r>]" = elements [r*S_g, (r+1)*S_g) of the
//                                 group's padded flat buffer (S_g = shard_elems, padding zero);
//                                 param16 in the working dtype, the others F32. Standard
//                                 safetensors: u64 LE header length, JSON header (with
//                                 "__metadata__"), raw little-endian data.
//   <tag>/client_state.bin       the trainer's opaque blob (only when one was given)
//   latest                        the tag of the newest complete checkpoint (one line)
//
// Crash consistency (the protocol of Save): every file is written into `<tag>.tmp/` and fsynced;
// the ranks agree that all parts are durable; rank 0 writes the manifest (sizes and XXH3 of
// every file, and its own XXH3), fsyncs it and the directory, renames `<tag>.tmp` to `<tag>`, fsyncs `<dir>`, then
// replaces `latest` atomically (latest.tmp, fsync, rename, fsync `<dir>`). A crash at any point
// leaves `latest` naming the previous complete checkpoint; a `<tag>.tmp` is never read, and a
// `<tag>/` whose files do not match its manifest is refused by VerifyCheckpoint.
//
// Durable operations (file creation, writes, fsyncs, mkdir, rename) are shown to a CheckpointEnv
// first (include/strata/checkpoint.h; DefaultEnv() when the caller passes none): the seam tests
// inject crashes through.
//
// Thread safety: free functions over files; no shared state.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/zero/checkpoint_io.h"
#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::zero::ckpt {

// The format version written; every version from kOldestFormatVersion on is read. Version 2
// added the manifest's own checksum ("manifest_xxh3"); version 1 manifests have none and load as
// before.
inline constexpr int kFormatVersion = 2;
inline constexpr int kOldestFormatVersion = 1;
inline constexpr const char* kManifestName = "manifest.json";
inline constexpr const char* kClientStateName = "client_state.bin";
inline constexpr const char* kLatestName = "latest";
// The state kinds each rank file holds per group, in file order.
inline constexpr const char* kStateKinds[] = {"param16", "master32", "exp_avg", "exp_avg_sq"};
inline constexpr size_t kNumStateKinds = 4;

struct FileEntry {
  std::string name;  // relative to the tag directory
  int rank = -1;     // -1: not a rank file (client state)
  uint64_t size_bytes = 0;
  uint64_t xxh3 = 0;
};

struct ParamEntry {
  std::string name;
  std::vector<int64_t> shape;
};

struct GroupEntry {
  std::string name;
  std::vector<ParamEntry> params;
  uint64_t numel = 0;
  uint64_t shard_elems = 0;  // S: rank r holds [r*S, (r+1)*S) of the padded flat buffer
  // false: a frozen group (GroupSpec::trainable): the rank files hold its param16 only (in JSON
  // "trainable": false, absent when true).
  bool trainable = true;
  // true: a frozen group left out at save (SaveOptions::exclude_frozen): the rank files hold
  // nothing of it (in JSON "excluded": true, absent when false; only with "trainable": false).
  bool excluded = false;
  // true: a frozen group written after its initial values (Engine::WriteParams: a LoRA fused
  // into its base): saved whole even with exclude_frozen, and marked so that an engine loading
  // it keeps saving it whole (in JSON "changed": true, absent when false; frozen groups only).
  bool changed = false;
  // A frozen group's initial values, as FrozenFingerprint sums them over the group (0: unknown,
  // as in a checkpoint from before it was recorded, or a changed group): a load that keeps an
  // excluded group's values checks that they are the ones the saving run started from (in JSON
  // "fingerprint": 16 hex digits, absent when 0).
  uint64_t fingerprint = 0;
  bool HasKind(size_t kind) const { return !excluded && (kind == 0 || trainable); }
};

// Everything manifest.json holds. Field names in JSON are the member names. From format
// version 2 the manifest's last member is its own checksum, "manifest_xxh3": the XXH3-64 (16
// lowercase hex digits) of every byte of the file before that member's `,\n  "manifest_xxh3"`,
// so any changed byte of the manifest (the sizes and checksums of the other files included) is
// refused. A rewritten manifest must be written by ToJson again.
struct Manifest {
  int format_version = kFormatVersion;  // as read (a version 1 manifest stays 1 until rewritten)
  std::string tag;
  int world_size = 1;
  int stage = 0;
  std::string precision;    // "bf16" | "fp16" | "fp32"
  std::string param_dtype;  // safetensors dtype of param16: "BF16" | "F16" | "F32"
  std::string offload_optimizer, offload_param;  // where the states lived ("none" = device)
  std::vector<GroupEntry> groups;
  int64_t global_step = 0, skipped_steps = 0, applied_steps = 0;
  // LoadOptions' restarts (absent in JSON when 0).
  int64_t adam_step_base = 0, lr_step_base = 0;
  double last_lr = 0;
  // Loss scaler (core/zero/loss_scaler.h LossScalerState).
  double scale = 1;
  int64_t scaler_iteration = 0, scaler_last_overflow = -1, scaler_hysteresis_left = 0;
  // False after a precision conversion ("loss_scaler": null in JSON; the four fields above are
  // then placeholders): the loading engine starts its scaler as its own config says.
  bool has_scaler_state = true;
  std::string config_json;       // EffectiveConfigJson of the saving engine
  std::vector<FileEntry> files;  // rank files in rank order, then the client state if any
  bool has_client_state = false;

  // The manifest file's text; with "manifest_xxh3" from format version 2.
  std::string ToJson() const;
  // Corruption naming the field for a malformed manifest, and for a checksum that does not match
  // (checked whenever present, before anything else is read) or is missing from version 2 on;
  // FailedPrecondition for a format_version outside kOldestFormatVersion..kFormatVersion.
  static Result<Manifest> FromJson(const std::string& text);
  // "rank<r>.safetensors"
  static std::string RankFileName(int rank);
  // "<group>.<kind>[r<rank>]"
  static std::string TensorName(const std::string& group, const char* kind, int rank);
  uint64_t ElemBytes(size_t kind) const { return kind == 0 ? DTypeBytes(param_dtype) : 4; }
  static uint64_t DTypeBytes(const std::string& dtype) { return dtype == "F32" ? 4 : 2; }
};

// One tensor's place in a rank file.
struct TensorLoc {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // absolute file offsets
};

// The safetensors header for rank `rank` of `m` (tensors in file order), padded with spaces so
// the data starts 8-byte aligned; *data_start receives the absolute offset of the data, and
// `locs` (optional) every tensor's place.
std::string RankFileHeader(const Manifest& m, int rank, uint64_t* data_start,
                           std::vector<TensorLoc>* locs);
// Parses the header of a safetensors file (any: rank files, exports). Corruption naming `path`.
Result<std::vector<TensorLoc>> ReadSafetensorsHeader(const std::string& path,
                                                     std::string* metadata_json = nullptr);

// --- files ----------------------------------------------------------------------------------

// A file written sequentially with the XXH3 of everything written. Move-only. Its creation,
// every Append and the fsync of Finish are durable operations of `env`, which must outlive it.
class FileWriter {
 public:
  FileWriter() = default;
  FileWriter(FileWriter&& o) noexcept;
  FileWriter& operator=(FileWriter&& o) noexcept;
  ~FileWriter();
  static Result<FileWriter> Create(const std::string& path, CheckpointEnv& env = DefaultEnv());
  Status Append(const void* data, uint64_t bytes);
  // fsync + close. The file's size and checksum are then final.
  Status Finish();
  uint64_t size_bytes() const { return size_; }
  uint64_t xxh3() const;

 private:
  int fd_ = -1;
  std::string path_;
  uint64_t size_ = 0;
  void* state_ = nullptr;  // XXH3_state_t
  CheckpointEnv* env_ = &DefaultEnv();
};

// Durable operations of `env`.
Status MakeDir(const std::string& path, CheckpointEnv& env = DefaultEnv());  // EEXIST is fine
Status FsyncDir(const std::string& path, CheckpointEnv& env = DefaultEnv());
Status RenamePath(const std::string& from, const std::string& to,
                  CheckpointEnv& env = DefaultEnv());
// `from` and `to` (both existing) trade names in one step (renameat2 RENAME_EXCHANGE), a
// durable operation of `env` (kRename, path `from`). Where the filesystem cannot (EINVAL, ENOSYS,
// EOPNOTSUPP: NFS, some overlays), `to` is renamed to `aside` first and `from` to `to` after,
// with a moment in which neither is under `to`.
Status ExchangePaths(const std::string& from, const std::string& to, const std::string& aside,
                     CheckpointEnv& env = DefaultEnv());
Status RemoveTree(const std::string& path);  // missing is fine
bool PathExists(const std::string& path);
// A regular file's bytes. InvalidArgument for anything else (a FIFO would block, a device never
// end); Corruption when it is larger than `max_bytes`.
Result<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes = UINT64_MAX);
// Writes `text` to path (tmp name + fsync + rename + fsync dir when `atomic`).
Status WriteSmallFile(const std::string& path, const std::string& text, bool atomic,
                      CheckpointEnv& env = DefaultEnv());
// Size and XXH3 of a file, streamed.
Status HashFile(const std::string& path, uint64_t* size_bytes, uint64_t* xxh3);
// Reads [offset, offset+bytes) of a file into out (an open-per-call pread loop).
Status ReadAt(int fd, const std::string& path, uint64_t offset, void* out, uint64_t bytes);

// --- checkpoints ----------------------------------------------------------------------------

// The tag `latest` names (tag empty) or `tag` itself; NotFound naming the path when neither
// exists.
Result<std::string> ResolveTag(const std::string& dir, const std::string& tag);
// Reads and parses <dir>/<tag>/manifest.json. NotFound / Corruption naming the file. A tag
// directory renamed after its save loads under its new name (the result's `tag`); one named
// "*.tmp" (a save that did not finish) is Corruption.
Result<Manifest> ReadManifest(const std::string& dir, const std::string& tag);
// Checks that every file of the manifest exists with its size and checksum. `files`: indices of
// m.files to check (empty: all). NotFound / Corruption naming the first missing or damaged file.
Status VerifyFiles(const std::string& dir, const Manifest& m,
                   const std::vector<size_t>& files = {});
// Only that m.files[i] exists with its size: NotFound / Corruption naming it.
Status CheckFileSize(const std::string& dir, const Manifest& m, size_t i);
// The header of rank `rank`'s file at `path` lays out the tensors the manifest implies: their
// places in the file (RankFileHeader's, with the file's offsets). Corruption naming `path`.
Result<std::vector<TensorLoc>> CheckRankFileHeader(const std::string& path, const Manifest& m,
                                                   int rank);
// ReadManifest + VerifyFiles (all) + every rank file's header matches the manifest.
Result<Manifest> VerifyCheckpoint(const std::string& dir, const std::string& tag);

// Reads global element ranges of one state kind of one group from a checkpoint's rank files
// (whichever ranks hold them: the range is cut at shard boundaries); zeros past the saved padded
// buffer. Each rank file is opened on first use, its tensors' places taken from its own header
// and checked against the manifest's layout (Corruption naming the file), and read as a stream
// (checkpoint_io.h: O_DIRECT chunks with read-ahead), so reads should come in file order per
// file: group by group, state kind by kind, elements ascending (what Engine::Load and export
// do). Not thread-safe.
class RangeReader {
 public:
  // `tag_dir`: <dir>/<tag>. `m` must outlive the reader. `hash_rank` >= 0: that rank's file is
  // hashed as it streams (FileXxh3).
  RangeReader(std::string tag_dir, const Manifest& m, const StreamOptions& options = {},
              int hash_rank = -1);
  ~RangeReader();
  RangeReader(const RangeReader&) = delete;
  RangeReader& operator=(const RangeReader&) = delete;
  // Elements [begin, begin+elems) of group g's state kind (index into kStateKinds) into out
  // (elems * m.ElemBytes(kind) bytes).
  // FailedPrecondition for an optimizer state of a frozen group, and for anything of an
  // excluded one (the files hold none).
  Status Read(size_t g, size_t kind, uint64_t begin, uint64_t elems, void* out);
  // The parameters' fp32 values: the master of a trainable group, a frozen group's param16
  // widened (exactly) to fp32.
  Status ReadFp32(size_t g, uint64_t begin, uint64_t elems, float* out);
  // The XXH3 of all of rank r's file (r == hash_rank), reading what was not read yet.
  // FailedPrecondition when it was read out of order (then hash it with HashFile).
  Result<uint64_t> FileXxh3(int r);

 private:
  std::string Path(int r) const;
  Status Open(int r);

  std::string dir_;
  const Manifest& m_;
  StreamOptions options_;
  int hash_rank_ = -1;
  std::vector<std::unique_ptr<StreamReader>> streams_;
  std::vector<std::vector<TensorLoc>> locs_;
};

// The last steps of a save, once every file of `m` is durable in <dir>/<m.tag>.tmp: writes the
// manifest, fsyncs it and the directory, renames the directory to <dir>/<m.tag>, fsyncs <dir>,
// and replaces <dir>/latest atomically. Where <dir>/<m.tag> exists (a tag saved again) the two
// directories trade names in one step (ExchangePaths), so a crash leaves the old or the new
// checkpoint under the tag, never neither; the old one, then named `.tmp`, is removed last.
// `update_latest` false leaves <dir>/latest as it is.
Status CommitCheckpoint(const std::string& dir, const Manifest& m,
                        CheckpointEnv& env = DefaultEnv(), bool update_latest = true);

// --- offline resharding and precision conversion -------------------------------------------

// What ReshardCheckpoint rewrites a checkpoint into.
struct ReshardTarget {
  int world_size = 0;     // ranks of the new layout, 1..4096; 0 = the checkpoint's
  int stage = -1;         // ZeRO stage 0..3; -1 = the checkpoint's
  std::string precision;  // "bf16" | "fp16" | "fp32"; "" = the checkpoint's
};

// Precision conversion, the one rule (used by ReshardCheckpoint; Engine::Load refuses another
// precision and names this way out). The fp32 master is the truth:
// - param16 is re-derived from the master, element by element, exactly as AdamStep writes its
//   param_out (ParamsFromMaster: round to nearest even; NaN stays NaN; fp16 overflows to +-Inf
//   beyond 65504; fp32: the master's bits), padding stays zero;
// - master32, Adam exp_avg / exp_avg_sq, the step counters, LR position and client state are
//   copied unchanged;
// - the loss scaler's state is dropped (Manifest::has_scaler_state false): an engine loading the
//   result starts its scaler from its own config, as DeepSpeed starts one (to fp16: dynamic at
//   2^fp16.initial_scale_power with full hysteresis, or the static fp16.loss_scale; to bf16 /
//   fp32: no scaling);
// - gradients: a checkpoint never holds any (Save refuses mid-accumulation), so none convert;
// - frozen groups' fingerprints (of values rounded to the old dtype) are dropped: a group left
//   out at save is then kept by the loading engine unchecked.
// ConvertManifestPrecision sets m's precision, param_dtype, the recorded config's
// bf16/fp16 "enabled" and drops the scaler state and the fingerprints; nothing when `precision`
// is m's already.
// InvalidArgument naming the value when it is not bf16, fp16 or fp32.
Status ConvertManifestPrecision(Manifest* m, const std::string& precision);
// n param16 elements of `param_dtype` ("BF16" | "F16" | "F32") from n fp32 master elements.
void ParamsFromMaster(const float* master, uint64_t n, const std::string& param_dtype, void* out);

// Offline resharding (`offloadctl ckpt reshard`): rewrites the verified checkpoint `tag` of
// `dir` ("" = latest) for `to` (world size, ZeRO stage, precision) into `out_dir` (same tag,
// shards as an engine of that world size cuts them, every state's global elements copied
// exactly, padding zero; another precision converted as above), with the same crash-consistent
// protocol as a save (`<tag>.tmp`, fsync, rename, `latest`). The result loads into such an engine
// on its fast path (each rank reads its own file). InvalidArgument: world_size outside 1..4096,
// stage outside 0..3, precision not bf16/fp16/fp32, out_dir == dir; FailedPrecondition: the tag
// exists in out_dir; the errors of VerifyCheckpoint; IOError naming the file (nothing under
// `<tag>/` or `latest` of out_dir is then written). Its file IO goes through options.Env().
Result<Manifest> ReshardCheckpoint(const std::string& dir, const std::string& tag,
                                   const ReshardTarget& to, const std::string& out_dir,
                                   const StreamOptions& options = {});

std::string Hex64(uint64_t v);

// Part of a frozen group's fingerprint: values v[0..n) at indices [first, first+n) of the group's
// flat buffer (indices >= numel, the padding, count nothing), as the engine stores them in
// `dtype` (each rounded so: values initialised again from their stored copies widened give the
// same fingerprint). A group's fingerprint is the sum (mod 2^64) of the parts over disjoint
// ranges covering it, so any layout (world size, stage) computes the same one from the ranges
// its ranks hold. A sample (one index in 64) of the stored bits, each mixed with its index: it
// tells apart weights built from other values (another checkpoint, a random initialisation) at a
// cost next to nothing beside filling them.
uint64_t FrozenFingerprint(uint64_t first, const float* v, uint64_t n, uint64_t numel, DType dtype);

}  // namespace strata::zero::ckpt
