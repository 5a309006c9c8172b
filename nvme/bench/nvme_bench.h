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

// The disk's own time for a read/write mix: `bench engine`'s reference for io_efficiency (README
// "offloadctl bench engine"). A step moves its NVMe bytes as reads and writes in flight at once
// (read-ahead of sub-group i+1 beside write-behind of i-1), in stripe units, at the engine's ring
// depth, over gigabytes: a separate burst of each direction measures neither that mix nor a disk
// whose writes a hypervisor's cache absorbs for the first gigabyte or so. This pass moves
// `read_bytes` + `write_bytes` in the same proportion, interleaved unit by unit, with reads and
// writes in one queue of queue_depth per stream (one stream per rank: each rank has its own ring).
//
// Layout: one scratch file per directory, together `span_bytes` of positions (default: every unit
// of a pass, unit k in file k mod #dirs), first written in full (the prefill: steady-state swap
// writes overwrite written extents, and reads must read real extents, not fallocated zeros), then
// the mixed passes over those positions in order, so each read is of data written earlier. No
// fsync: the step does none. Files are removed afterwards.
//
// Buffers: each stream's units cycle through `buffer_bytes` of huge-page memory, the next free
// block-sized slot in turn (least recently used first), as a step's IO streams through its host
// tier, never the same few megabytes. On a disk whose VMM copies each IO (this VM's), a buffer
// set that the CPU caches hold moves faster than any step can: 1 MiB units at depth 8, half
// reads, measured 4.3 GB/s cycling through 8-16 MiB, 3.8 through 48 MiB, and 3.0-3.3 from 64 MiB
// up to 4 GiB (the step's own IO measured 3.0-3.1 GB/s in its optimizer phase at 500M params).
struct NvmeMixOptions {
  std::vector<std::string> dirs;  // at least one; the swap files' directories
  // The mix to move, all directories together; each rounded up to whole blocks, at least one
  // block in total.
  uint64_t read_bytes = 0, write_bytes = 0;
  size_t block_bytes = size_t{1} << 20;  // the swap space's stripe unit
  size_t queue_depth = 8;                // per stream: the engine's aio.queue_depth
  size_t streams = 1;                    // rings, each with its own thread (ranks)
  // Per stream: the memory its units cycle through (see "Buffers" above), rounded down to whole
  // blocks and capped at what the stream moves; never less than queue_depth blocks (the old
  // reference: those blocks only, cache-hot). 256 MiB is 4x the 64 MiB from which the rate no
  // longer falls on this VM and bounds the reference's memory (it runs after the engine closed).
  size_t buffer_bytes = size_t{256} << 20;
  // Mixed passes over the prefilled file, one after the other; the result is the fastest, the
  // disk's best for this mix, so a slow patch of a shared disk during one pass (seen here: the
  // same reference 1.8 and 2.7 GB/s in two runs of a 4B step) never flatters what is compared
  // with it. 1..64.
  size_t passes = 1;
  // The bytes of file the passes touch, all directories together (rounded down to whole blocks,
  // at least one): a pass moving more revisits them in order, one moving less spreads its units
  // evenly over them; the prefill writes all of them. 0: what a pass moves (each unit once).
  // A step touches its whole swap footprint, and on a disk whose host caches what was touched
  // recently (this VM's), a reference over fewer bytes is faster than the step can be: random
  // 1 MiB units, depth 8, half reads, measured 1.24 GB/s over a 60 GB file against 1.70 over 8 GB,
  // and 1.15 GB/s for the first 8 GB touched of the 60 GB file against 1.62 for the same 8 GB
  // again.
  uint64_t span_bytes = 0;
  IoBackendKind backend = IoBackendKind::kAuto;
  bool fixed_buffers = true;
  bool huge_pages = true;
};

struct NvmeMixResult {
  uint64_t read_bytes = 0, write_bytes = 0;  // moved by the mixed pass
  double seconds = 0;                        // the fastest mixed pass
  std::vector<double> pass_seconds;          // every mixed pass, in order
  double prefill_write_bytes_per_s = 0;      // the prefill: a write-only pass over the span
  uint64_t span_bytes = 0;                   // the file bytes the passes touched (all dirs)
  size_t buffer_bytes = 0;                   // per stream, as used (see NvmeMixOptions)
  std::string backend, note;
};

// InvalidArgument: no directory (or one given twice), a block size not a multiple of 4 KiB,
// zero depth or streams, nothing to move. NotFound / IOError as RunNvmeBench.
Result<NvmeMixResult> RunNvmeMix(const NvmeMixOptions& options);

// The disk's own time for a read/write mix, moved over existing files in place and leaving their
// bytes as they were: `bench engine --disk-reference-paired` runs it over the engine's own swap
// files between steps (Engine::Flush has brought the engine to rest), so the reference touches
// the step's very extents at the step's time, on a disk whose rate drifts by minutes (this VM's:
// 0.4-3.3 GB/s within one 4B run), and needs no second file of the footprint's size.
//
// Each unit (block_bytes, in file order, unit p in file p mod #files at (p / #files) blocks) is
// read into a buffer and later written back from it unchanged, `read_bytes` and `write_bytes` in
// proportion and interleaved unit by unit in one queue of queue_depth, as RunNvmeMix. Reads spread
// evenly over the files' whole units, starting `first_unit` in (successive passes start
// elsewhere); fewer writes than reads leave some units unwritten, more write some twice. A unit
// is written only from its own completed read, so a crash or a failed IO mid-pass leaves every
// unit with its old bytes (or a failed write's unknown bytes, as any failed write: the swap space's
// checksums then report the block). The files' tails shorter than a block are not touched.
//
// REQUIRES: nothing else writes the files during the pass.
struct NvmeRewriteOptions {
  std::vector<std::string> files;  // existing regular files, at least one block in all
  uint64_t read_bytes = 0, write_bytes = 0;  // rounded up to whole blocks; reads > 0
  size_t block_bytes = size_t{1} << 20;
  size_t queue_depth = 8;
  // Memory the units cycle through, in whole blocks (at least queue_depth; at most what is read):
  // as NvmeMixOptions::buffer_bytes. Huge pages, not locked.
  size_t buffer_bytes = size_t{256} << 20;
  uint64_t first_unit = 0;
  IoBackendKind backend = IoBackendKind::kAuto;
  // False: reads and writes interleaved unit by unit in one queue (the disk's time for the mix
  // moved together, its best). True: alternate phases that only read (until every buffer holds a
  // unit read back) and only write (until those are written back), each drained before the next
  // starts, timed apart: the disk's read rate and write rate for the same units at the same
  // minutes, so read_seconds + write_seconds is the disk_bound_s (the step's bytes at
  // the disk's separate read and write rates). Each drain idles the queue for about one IO's
  // latency per buffer_bytes moved: use a buffer of a few hundred MiB or more.
  bool split = false;
};

struct NvmeRewriteResult {
  uint64_t read_bytes = 0, write_bytes = 0, span_bytes = 0;  // moved; the files' whole blocks
  double seconds = 0;
  // With `split`: the time of the read-only and of the write-only phases (their sum is
  // `seconds` less the switches between phases); 0 otherwise.
  double read_seconds = 0, write_seconds = 0;
  std::string backend, note;
};

// InvalidArgument: no file, a block size not a multiple of 4 KiB, depth 0, no read, files with
// no whole block. NotFound / IOError (errno, file): opening or IO. The pass stops at the first
// failed IO and reports it after the IO in flight completed.
Result<NvmeRewriteResult> RunNvmeRewrite(const NvmeRewriteOptions& options);

}  // namespace strata::nvme
