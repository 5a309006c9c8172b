// Checkpoint file IO through the project's IO layer (strata/io.h): a rank file is written and
// read as a stream of large aligned chunks, O_DIRECT, driven by an IoBackend (io_uring, posix or
// the simulated one), with a bounded set of staging buffers.
//
// StreamWriter: Append copies bytes into the current chunk buffer (and into the running XXH3);
// a full chunk is submitted as one write at its file offset while the next one fills; at most
// `depth` chunks exist, so a save stages depth x chunk_bytes of host memory whatever the size
// of the shard (many small blocks become few large writes). Finish writes the last chunk padded
// to 4 KiB, waits for every write, truncates the file to the bytes appended, fsyncs and closes.
//
// StreamReader: reads one file front to back with up to `depth` chunks in flight ahead of the
// reader (read-ahead), serving Read(offset, bytes) from them. Offsets must not go backwards
// between calls: a read behind the stream (or far ahead of it) restarts it there, which is
// correct but slow. With `hash` set, every chunk passed over in order is hashed; HashToEnd then
// reads the rest and returns the XXH3 of the whole file, or FailedPrecondition when the stream
// restarted (not every byte was seen in order).
//
// Files on a filesystem without O_DIRECT (tmpfs) are opened buffered (same requests, one copy
// more); StreamOptions::note() says so.
//
// Fault injection (include/strata/checkpoint.h CheckpointEnv, from StreamOptions::env): every
// stream takes its IoBackend from the env's StreamBackend (a test wraps it to tear or fail chosen
// chunk writes), and StreamWriter shows the env its file's creation and fsync (DurableOp).
//
// Thread safety: none; one thread drives a stream. Each stream owns its IoBackend.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "strata/checkpoint.h"
#include "strata/io.h"
#include "strata/status.h"

namespace strata::zero::ckpt {

// The default CheckpointEnv (the base class: changes nothing), for callers that pass none.
CheckpointEnv& DefaultEnv();

struct StreamOptions {
  // The backend kind (kSimulated: nvme::SimBackend with `sim_seed`).
  IoBackendKind kind = IoBackendKind::kAuto;
  uint64_t sim_seed = 1;
  // Bytes per IO request (DeepSpeed aio.block_size), rounded up to 4 KiB.
  size_t chunk_bytes = size_t{1} << 20;
  // Chunks per stream (DeepSpeed aio.queue_depth x intra_op_parallelism): the IOs in flight and
  // the host memory a stream stages (depth x chunk_bytes). At least 2.
  size_t depth = 8;
  // What the streams' IO goes through (not owned); null: DefaultEnv().
  CheckpointEnv* env = nullptr;
  CheckpointEnv& Env() const { return env != nullptr ? *env : DefaultEnv(); }
};

// Chunk size and depth of the engine's `aio` settings (block_size, queue_depth x
// intra_op_parallelism), clamped to [4 KiB, 64 MiB] and [2, 256].
StreamOptions StreamOptionsFromAio(int64_t block_size, int64_t queue_depth,
                                   int64_t intra_op_parallelism, IoBackendKind kind);

// The disk under `dir` as the checkpoint streams see it: the reference their throughput is
// judged by (`offloadctl bench engine --save-dir`, the CheckpointThroughput figure). One scratch
// file of `bytes` (rounded up to whole chunks) goes through the same backend kind, chunk size and
// depth as `options`, in three timed passes:
//   fresh      created, preallocated as StreamWriter::Create does, written, fsynced: what a save
//              into a new file pays (on ext4, converting unwritten extents as it goes);
//   overwrite  the same file written again in place, fsynced: what a save into a recycled file
//              and the swap write-back of a load pay (no allocation, no extent conversion);
//   read       the file read back.
// Each rate counts from open to fsync. Size it as the checkpoint (or at least 1 GiB): a short
// run is absorbed by caches below a virtual disk and reports several times the disk's rate.
// The file (under `dir`, named .strata-disk-reference.<pid>) is removed. IOError naming it.
struct DiskReference {
  uint64_t bytes = 0;
  size_t chunk_bytes = 0, depth = 0;
  double write_fresh_bytes_per_s = 0;
  double write_overwrite_bytes_per_s = 0;
  double read_bytes_per_s = 0;
  std::string note;  // buffered IO where O_DIRECT was refused
};
Result<DiskReference> MeasureDisk(const std::string& dir, uint64_t bytes,
                                  const StreamOptions& options);

// One of MeasureDisk's passes, for a caller that interleaves them with the saves it judges (so a
// disk whose rate drifts between measurements does not decide a ratio) or runs them on several
// ranks at once, each over its own file (the reference for N ranks saving at once).
enum class DiskPass : uint8_t { kWriteFresh, kOverwrite, kRead };
// The scratch file MeasureDisk uses under `dir` (one per process).
std::string DiskReferencePath(const std::string& dir);
// Times `pass` over [0, bytes) of `path` (bytes: a whole number of chunks) as MeasureDisk does:
// seconds from open to fsync (writes) or the last read. kOverwrite and kRead need the file a
// kWriteFresh pass made; the caller removes it. *buffered is set when O_DIRECT was refused.
// InvalidArgument for the simulated backend or bad options; IOError naming the path.
Result<double> TimeDiskPass(const std::string& path, uint64_t bytes, const StreamOptions& options,
                            DiskPass pass, bool* buffered);

class StreamWriter {
 public:
  // Creates (truncates) `path` and, when `expected_bytes` > 0, preallocates that much
  // (IoBackend::Allocate; ENOSPC here, before any write; O_DIRECT writes inside the file's size
  // do not serialize on extending it). With `reuse`, an existing file is kept and overwritten in
  // place (its allocated blocks reused, extended when short; Finish truncates it to the bytes
  // appended): a recycled checkpoint file. IOError naming the path; InvalidArgument for bad
  // options.
  static Result<std::unique_ptr<StreamWriter>> Create(const std::string& path,
                                                      const StreamOptions& options,
                                                      uint64_t expected_bytes = 0,
                                                      bool reuse = false);
  ~StreamWriter();  // waits for writes in flight; an unfinished file stays as it is
  StreamWriter(const StreamWriter&) = delete;
  StreamWriter& operator=(const StreamWriter&) = delete;

  Status Append(const void* data, uint64_t bytes);
  // Waits for every write, truncates to size_bytes(), fsyncs and closes. The first write error
  // (naming the file and offset) if any.
  Status Finish();
  uint64_t size_bytes() const { return size_; }
  uint64_t xxh3() const;
  // "buffered IO (O_DIRECT refused on PATH)" or empty.
  const std::string& note() const { return note_; }

 private:
  StreamWriter() = default;
  Status SubmitCurrent(size_t length_bytes);
  Status ReapOne();
  Status Drain();

  std::string path_;
  int fd_ = -1;
  StreamOptions opt_;
  std::unique_ptr<IoBackend> io_;
  std::vector<uint8_t*> buffers_;
  std::vector<size_t> free_;  // buffer indices not in flight
  size_t cur_ = 0;            // the buffer being filled
  size_t fill_ = 0;           // bytes in it
  uint64_t submitted_ = 0;    // file offset of the next chunk
  uint64_t size_ = 0;
  void* state_ = nullptr;  // XXH3_state_t
  Status first_error_;
  std::string note_;
};

class StreamReader {
 public:
  // Opens `path` for reading. NotFound / IOError naming the path.
  static Result<std::unique_ptr<StreamReader>> Open(const std::string& path,
                                                    const StreamOptions& options, bool hash);
  ~StreamReader();  // waits for reads in flight
  StreamReader(const StreamReader&) = delete;
  StreamReader& operator=(const StreamReader&) = delete;

  // Copies [offset, offset + bytes) of the file into out. Corruption naming the file when the
  // range passes its end; IOError from the backend.
  Status Read(uint64_t offset, void* out, uint64_t bytes);
  // Reads the rest of the file; the XXH3 of all of it (see the header comment).
  Result<uint64_t> HashToEnd();
  uint64_t size_bytes() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  struct Chunk {
    uint64_t offset = 0;
    size_t length = 0;
    bool ready = false;
    size_t buffer = 0;
  };
  StreamReader() = default;
  Status Restart(uint64_t offset);
  Status IssueAhead();
  Status WaitFront();
  void PopFront();
  Status Drain();

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  StreamOptions opt_;
  std::unique_ptr<IoBackend> io_;
  std::vector<uint8_t*> buffers_;
  std::vector<size_t> free_;
  std::deque<Chunk> window_;  // in file order, contiguous
  uint64_t next_issue_ = 0;
  bool hashing_ = false;
  bool hash_broken_ = false;
  void* state_ = nullptr;  // XXH3_state_t
  Status first_error_;
};

}  // namespace strata::zero::ckpt
