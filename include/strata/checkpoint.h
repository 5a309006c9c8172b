// Options of Engine::Save (include/strata/engine.h; docs/checkpoints.md). Plain values, no
// state: thread safety is that of the engine call they are passed to. Defaults come from the
// config's `checkpoint` section when the caller passes none (SaveOptionsFromConfig).
#pragma once

#include <cstddef>

#include "strata/config.h"

namespace strata {

struct SaveOptions {
  // [0] Checkpoints kept in the directory after a successful save, the new one included; older
  // ones (by the time their manifest was written) are removed. 0 keeps every checkpoint. The
  // checkpoint `latest` named before the save and the new one are never removed or recycled.
  // Removal is crash-safe: a checkpoint leaves the tag namespace in one rename (and an fsync of
  // the directory) before any of its files is touched, so it is either complete or gone, never a
  // partial one that loads. Trade-off: disk space (each checkpoint holds the whole model state)
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
};

// What Engine::Save without SaveOptions uses: the config's `checkpoint` section (keep_last,
// recycle_files; include/strata/config.h CheckpointConfig), so a DeepSpeed config can set the
// retention once for every save. An explicit SaveOptions replaces it whole.
SaveOptions SaveOptionsFromConfig(const CheckpointConfig& config);

}  // namespace strata
