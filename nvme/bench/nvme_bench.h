// NVMe benchmark engine behind `offloadctl bench nvme`: sequential O_DIRECT write then read
// throughput and per-request latency of one file per directory, at one (block size, queue
// depth, threads) point, through strata's own IoBackend and pinned pool (so it measures what
// swap IO gets).
//
// Each directory (an nvme_path, typically one per SSD) gets `threads` threads, all directories
// at once, so several directories measure the aggregate that a store striping over them sees.
// Each thread owns a backend (its own ring), queue_depth pinned buffers of block_bytes
// (registered as io_uring fixed buffers when allowed) and a contiguous slice of its directory's
// file, and keeps queue_depth requests in flight. The write pass runs first so the read pass
// reads real extents (reading fallocated-but-unwritten extents would return zeros without
// touching disk).
//
// Thread safety: RunNvmeBench is self-contained; concurrent calls need distinct directories.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/io.h"
#include "strata/status.h"

namespace strata::nvme {

struct NvmeBenchPoint {
  size_t block_bytes = size_t{1} << 20;
  size_t queue_depth = 32;
  size_t threads = 1;  // per directory: DeepSpeed's aio intra_op_parallelism
};

struct NvmeBenchOptions {
  // Where the scratch files go, one per directory (removed afterwards). At least one.
  std::vector<std::string> dirs;
  // Bytes per pass over all directories, split evenly; each directory's share is rounded down
  // to block_bytes * threads.
  uint64_t size_bytes = 1ull << 30;
  IoBackendKind backend = IoBackendKind::kAuto;
  bool fixed_buffers = true;  // register pinned buffers with io_uring
  bool huge_pages = true;     // MADV_HUGEPAGE on IO buffers
};

struct LatencyUs {
  double p50 = 0, p90 = 0, p99 = 0, max = 0;
};

struct NvmeBenchResult {
  NvmeBenchPoint point;
  uint64_t bytes = 0;  // per pass, all directories
  double write_bytes_per_s = 0;
  double read_bytes_per_s = 0;
  LatencyUs write_latency;
  LatencyUs read_latency;
  std::string backend;  // "io_uring" / "posix"
  std::string note;     // backend and pool degradations, if any
};

// Runs the sweep (every point, in order), calling progress(i, point) before each.
// InvalidArgument: no directory, a directory given twice, a point with a zero or non-4
// KiB-multiple block, zero depth or threads, or a share of the size smaller than one block per
// thread. NotFound: a directory missing. IOError: file creation or IO failed (errno, file).
// InvalidArgument as well when a directory's filesystem lacks O_DIRECT.
Result<std::vector<NvmeBenchResult>> RunNvmeBench(
    const NvmeBenchOptions& options, const std::vector<NvmeBenchPoint>& points,
    const std::function<void(size_t, const NvmeBenchPoint&)>& progress = {});

// The disk's read rate and write rate for a step's bytes, moved over existing files in place and
// leaving their bytes as they were: `bench engine --disk-reference-paired-split` runs it over the
// engine's own swap files after each measured step (Engine::Flush has brought the engine to
// rest), so the reference touches the step's very extents at the step's time, on a disk whose
// rate drifts by minutes, and needs no second file of the footprint's size.
//
// Each unit (block_bytes, in file order, unit p in file p mod #files at (p / #files) blocks) is
// read into a buffer and later written back from it unchanged, `read_bytes` and `write_bytes` in
// proportion. The pass alternates phases that only read (until every buffer holds a unit read
// back, or every read is issued) and only write (until those are written back), each drained
// before the next starts and timed apart: read_seconds + write_seconds is the
// disk_bound_s, the step's reads at the disk's read rate plus its writes at its write rate. Each
// drain idles the queue for about one IO's latency per buffer_bytes moved: use a buffer of a
// few hundred MiB or more. Reads spread evenly over the files' whole units, starting
// `first_unit` in (successive passes start elsewhere); fewer writes than reads leave some units
// unwritten, more write some twice. A unit is written only from its own completed read, so a
// crash or a failed IO mid-pass leaves every unit with its old bytes (or a failed write's unknown
// bytes, as any failed write: the swap space's checksums then report the block). The files'
// tails shorter than a block are not touched.
//
// REQUIRES: nothing else writes the files during the pass.
struct NvmeRewriteOptions {
  std::vector<std::string> files;  // existing regular files, at least one block in all
  uint64_t read_bytes = 0, write_bytes = 0;  // rounded up to whole blocks; reads > 0
  size_t block_bytes = size_t{1} << 20;
  size_t queue_depth = 8;
  // Memory the units cycle through, in whole blocks (at least queue_depth; at most what is
  // read): one phase's bytes. Huge pages, not locked.
  size_t buffer_bytes = size_t{1} << 30;
  uint64_t first_unit = 0;
  IoBackendKind backend = IoBackendKind::kAuto;
};

struct NvmeRewriteResult {
  uint64_t read_bytes = 0, write_bytes = 0, span_bytes = 0;  // moved; the files' whole blocks
  double seconds = 0;
  // The time of the read-only and of the write-only phases (their sum is `seconds` less the
  // switches between phases).
  double read_seconds = 0, write_seconds = 0;
  std::string backend, note;
};

// InvalidArgument: no file, a block size not a multiple of 4 KiB, depth 0, no read, files with
// no whole block. NotFound / IOError (errno, file): opening or IO. The pass stops at the first
// failed IO and reports it after the IO in flight completed.
Result<NvmeRewriteResult> RunNvmeRewrite(const NvmeRewriteOptions& options);

}  // namespace strata::nvme
