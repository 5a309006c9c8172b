// Options of Engine::Save (include/strata/engine.h; docs/checkpoints.md). Plain values, no
// state: thread safety is that of the engine call they are passed to. Defaults come from the
// config's `checkpoint` section when the caller passes none (SaveOptionsFromConfig).
//
// CheckpointEnv: the seam between the checkpoint protocol and the files it writes (leveldb's Env,
// reduced to what fault injection needs), through which tests inject crashes and torn writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "strata/config.h"
#include "strata/io.h"

namespace strata {

// One operation of a checkpoint save that changes what a crash leaves on disk, as CheckpointEnv
// sees it just before it is made.
struct DurableOp {
  enum class Kind : uint8_t {
    kCreate,   // a file created (a rank file, or a recycled one opened to be overwritten)
    kWrite,    // bytes appended to a small file (manifest, `latest`, client state); the chunks of
               // a rank file go through its stream's IO backend (CheckpointEnv::StreamBackend)
    kSync,     // a file fsynced
    kMakeDir,  // a directory made
    kSyncDir,  // a directory fsynced
    kRename,   // a file or directory renamed
  };
  Kind kind = Kind::kCreate;
  std::string_view path;  // the file or directory (kRename: the old name)
  // kWrite: `bytes` bytes at `data`, about to be written at `offset` of the open file `fd`.
  int fd = -1;
  uint64_t offset = 0;
  const void* data = nullptr;
  uint64_t bytes = 0;
};

// What a checkpoint's file IO goes through besides its system calls: every durable operation is
// shown to BeforeDurableOp before it is made, and every checkpoint stream (a rank file written or
// read in O_DIRECT chunks) takes its IO backend (strata/io.h) from StreamBackend. This base class
// is the default and changes nothing. A test passes its own in SaveOptions::env: one that stops
// the process at the k-th durable operation, tearing a write (a crash point), or that scripts a
// fault on one file's backend (tests/checkpoint_fault_env.h). Both are called on the thread
// making the operation; the ranks of one process may share an env, which must then be
// thread-safe.
class CheckpointEnv {
 public:
  virtual ~CheckpointEnv() = default;
  // Before every durable operation of a save, a commit or a reshard. Default: nothing.
  virtual void BeforeDurableOp(const DurableOp& /*op*/) {}
  // The IO backend of the checkpoint stream over `path`: `opened` (what the stream's settings
  // opened: the engine's io_kind, aio.queue_depth), or a backend wrapping or replacing it.
  // Default: `opened`.
  virtual std::unique_ptr<IoBackend> StreamBackend(std::string_view /*path*/,
                                                   std::unique_ptr<IoBackend> opened) {
    return opened;
  }
};

struct SaveOptions {
  // [0] Checkpoints kept in the directory after a successful save, the new one included; older
  // ones (by the time their manifest was written) are removed. 0 keeps every checkpoint. The
  // checkpoint `latest` named before the save and the new one are never removed or recycled.
  // Removal is crash-safe: a checkpoint leaves the tag namespace in one rename (and an fsync of
  // the directory) before any of its files is touched, so it is either complete or gone, never a
  // partial one that loads. Trade-off: disk space (each checkpoint holds the whole model state,
  // less frozen groups left out: exclude_frozen)
  // against how far back a run can go; a reader of an older checkpoint in another process must
  // not run against a directory a saver prunes. Only directories holding a manifest.json count.
  size_t keep_last = 0;
  // [true] With keep_last: when this save will remove the oldest checkpoint anyway, it reuses
  // that checkpoint's rank files instead of creating new ones (RocksDB's recycle_log_file_num):
  // the old checkpoint is made unloadable first (its directory renamed into `<tag>.tmp/`, the
  // directory fsynced), then each rank overwrites its old file in place and truncates it to the
  // new size. Overwriting allocated blocks skips the filesystem's block allocation and
  // unwritten-extent conversion, which on ext4 is where a fresh O_DIRECT write loses its time
  // (`offloadctl bench engine --save-dir` reports new-file and recycled saves apart). Trade-off: the old checkpoint goes before the new one is
  // complete (with keep_last N, a crash mid-save leaves N-1 older ones, `latest` among them).
  bool recycle_files = true;
  // [false] Frozen groups (GroupSpec::trainable false: a LoRA fine-tune's base weights) are left
  // out of the checkpoint: no tensors in the rank files, the manifest marks them "excluded"
  // (DeepSpeed's save_checkpoint(exclude_frozen_parameters=True)). Trade-off: the checkpoint is
  // the trained state only (a 7B LoRA's adapters and their Adam state instead of 14 GB more of
  // bf16 base per save), so it restores nothing by itself: the loading engine must already hold
  // the frozen values (from the pretrained weights it was built from) and load it with
  // LoadOptions::keep_excluded; export and reshard carry the trained groups only.
  bool exclude_frozen = false;
  // [true] false: `latest` keeps naming the checkpoint it named (DeepSpeed's
  // save_checkpoint(save_latest=False)); the new one is complete and loads by its tag. A crash
  // leaves it or nothing under the tag, as always.
  bool update_latest = true;
  // [null: the default, CheckpointEnv itself] What the save's file IO goes through (see
  // CheckpointEnv above; tests inject faults there). Not owned; must outlive the call.
  CheckpointEnv* env = nullptr;
};

// What Engine::Load restores beyond the weights (the fp32 master and the working params, always),
// the step counters and the loss scaler. A fine-tune that starts from a checkpoint's weights with
// a fresh optimizer (DeepSpeed's load_checkpoint(load_optimizer_states=False)) clears
// optimizer_states: Adam's m and v start at zero and its bias correction at step 1 again.
// Clearing lr_schedule (load_lr_scheduler_states=False) restarts the config's LR schedule from
// its first step. Either restart is kept by later saves (the manifest's adam_step_base,
// lr_step_base), so a resume continues it exactly.
//
// keep_excluded: a checkpoint saved with SaveOptions::exclude_frozen holds no values for its
// frozen groups. Without keep_excluded, Load refuses it (FailedPrecondition naming the groups,
// nothing changed): the engine's values for them would silently stand in for the saved ones.
// With it, those groups keep this engine's values (DeepSpeed's load_module_strict=False, which
// transformers' Trainer passes when it resumes a PEFT model) and everything else is restored;
// values that are not the ones the saving run was initialised with (their fingerprints in the
// manifest differ: another base model) are refused naming the groups, nothing changed.
struct LoadOptions {
  bool optimizer_states = true;
  bool lr_schedule = true;
  bool keep_excluded = false;
};

// What Engine::Save without SaveOptions uses: the config's `checkpoint` section (keep_last,
// recycle_files; include/strata/config.h CheckpointConfig), so a DeepSpeed config can set the
// retention once for every save. An explicit SaveOptions replaces it whole.
SaveOptions SaveOptionsFromConfig(const CheckpointConfig& config);

}  // namespace strata
