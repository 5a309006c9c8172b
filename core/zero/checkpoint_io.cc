// Checkpoint streams over an IoBackend (see checkpoint_io.h).
#include "core/zero/checkpoint_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "nvme/sim_backend.h"
#include "nvme/write_content.h"

namespace strata::zero::ckpt {

namespace {

uint64_t AlignUp(uint64_t v) { return (v + kIoAlignment - 1) / kIoAlignment * kIoAlignment; }
uint64_t AlignDown(uint64_t v) { return v / kIoAlignment * kIoAlignment; }

// Idle backends of finished streams, reused by the next stream of the same kind and depth: a
// ring's setup costs syscalls and mmaps per file, and a ring unmapped by one thread and mapped
// again at the same address by another looks to TSan like a race on its SQEs (handing a ring
// over through this mutex orders its uses). Bounded; a forked child never takes its parent's
// rings (they are shared with the parent's kernel ring), it drops them unused.
constexpr size_t kMaxIdleBackends = 16;

struct BackendPool {
  std::mutex mu;
  pid_t pid = 0;
  std::vector<std::pair<std::pair<IoBackendKind, size_t>, std::unique_ptr<IoBackend>>> idle;
};

BackendPool& Pool() {
  static BackendPool* pool = new BackendPool();  // never destroyed: streams may end at exit
  return *pool;
}

std::unique_ptr<IoBackend> TakeIdle(IoBackendKind kind, size_t depth) {
  BackendPool& p = Pool();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.pid != ::getpid()) {
    for (auto& [key, io] : p.idle) (void)io.release();  // the parent's: never touched here
    p.idle.clear();
    p.pid = ::getpid();
  }
  for (size_t i = 0; i < p.idle.size(); ++i) {
    if (p.idle[i].first == std::make_pair(kind, depth)) {
      std::unique_ptr<IoBackend> io = std::move(p.idle[i].second);
      p.idle.erase(p.idle.begin() + static_cast<std::ptrdiff_t>(i));
      return io;
    }
  }
  return nullptr;
}

// Keeps `io` for reuse when it is idle, a real backend (not the simulated one, nor what an env
// other than the default gave: it may wrap one) and the pool has room.
void ReturnIdle(const StreamOptions& o, std::unique_ptr<IoBackend> io) {
  if (io == nullptr || io->inflight() != 0 || o.kind == IoBackendKind::kSimulated ||
      &o.Env() != &DefaultEnv()) {
    return;
  }
  BackendPool& p = Pool();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.pid != ::getpid() || p.idle.size() >= kMaxIdleBackends) return;
  p.idle.emplace_back(std::make_pair(o.kind, o.depth), std::move(io));
}

// The backend the options name (an idle one from the pool when there is one).
Result<std::unique_ptr<IoBackend>> OpenOwnBackend(const StreamOptions& o) {
  if (o.kind == IoBackendKind::kSimulated) {
    nvme::SimOptions so;
    so.seed = o.sim_seed;
    so.queue_depth = o.depth;
    so.max_latency_ns = 50'000;
    return std::unique_ptr<IoBackend>(std::make_unique<nvme::SimBackend>(so));
  }
  if (auto idle = TakeIdle(o.kind, o.depth); idle != nullptr) return idle;
  IoBackendOptions bo;
  bo.kind = o.kind;
  bo.queue_depth = o.depth;
  // Chunk buffers are few and large: registration buys little, so none is attempted.
  bo.register_files_and_buffers = false;
  return OpenIoBackend(bo);
}

// The stream's backend over `path`: the options' own, as the env passes it on.
Result<std::unique_ptr<IoBackend>> OpenBackend(const StreamOptions& o, const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> io, OpenOwnBackend(o));
  io = o.Env().StreamBackend(path, std::move(io));
  if (io == nullptr)
    return Status::Internal("checkpoint stream: the env gave no backend for " + path);
  return io;
}

Status CheckOptions(const StreamOptions& o) {
  if (o.chunk_bytes == 0 || o.chunk_bytes % kIoAlignment != 0 || o.depth < 2) {
    return Status::InvalidArgument(
        "checkpoint stream: chunk_bytes " + std::to_string(o.chunk_bytes) +
        " (a multiple of 4096) and depth " + std::to_string(o.depth) + " (at least 2)");
  }
  return Status::OK();
}

// Opens O_DIRECT, falling back to buffered IO where the filesystem refuses it (EINVAL).
int OpenDirect(const std::string& path, int flags, bool* buffered) {
  int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644);
  *buffered = false;
  if (fd < 0 && errno == EINVAL) {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
    *buffered = true;
  }
  return fd;
}

Status AllocBuffers(size_t n, size_t bytes, std::vector<uint8_t*>* out) {
  for (size_t i = 0; i < n; ++i) {
    void* p = std::aligned_alloc(kIoAlignment, bytes);
    if (p == nullptr) {
      return Status::ResourceExhausted("checkpoint stream: " + std::to_string(n) + " buffers of " +
                                       std::to_string(bytes) + " bytes");
    }
    out->push_back(static_cast<uint8_t*>(p));
  }
  return Status::OK();
}

void FreeBuffers(std::vector<uint8_t*>* b) {
  for (uint8_t* p : *b) std::free(p);
  b->clear();
}

}  // namespace

CheckpointEnv& DefaultEnv() {
  static CheckpointEnv* env = new CheckpointEnv();  // never destroyed: streams may end at exit
  return *env;
}

StreamOptions StreamOptionsFromAio(int64_t block_size, int64_t queue_depth,
                                   int64_t intra_op_parallelism, IoBackendKind kind) {
  StreamOptions o;
  o.kind = kind;
  const int64_t chunk = std::clamp<int64_t>(block_size, kAioMinBlockSize, kAioMaxBlockSize);
  o.chunk_bytes = AlignUp(static_cast<uint64_t>(chunk));
  o.depth = static_cast<size_t>(
      std::clamp<int64_t>(queue_depth * std::max<int64_t>(1, intra_op_parallelism), 2, 256));
  return o;
}

// ---------------------------------------------------------------------------------------------
// MeasureDisk
// ---------------------------------------------------------------------------------------------

namespace {

// One pass of `op` over [0, bytes) of fd, `buffers.size()` chunks in flight.
Status Pump(IoBackend& io, int fd, IoOp op, uint64_t bytes, size_t chunk_bytes,
            const std::vector<uint8_t*>& buffers) {
  std::vector<size_t> free_list;
  for (size_t i = 0; i < buffers.size(); ++i) free_list.push_back(i);
  std::vector<IoCompletion> done(buffers.size());
  uint64_t next = 0;
  Status first;
  while ((next < bytes && first.ok()) || io.inflight() > 0) {
    while (!free_list.empty() && next < bytes && first.ok()) {
      const size_t b = free_list.back();
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_bytes, bytes - next));
      if (op == IoOp::kWrite) nvme::StampUnique(buffers[b], n);
      IoRequest r{op, fd, next, buffers[b], n, b};
      STRATA_RETURN_IF_ERROR(io.Submit(std::span<const IoRequest>(&r, 1)));
      free_list.pop_back();
      next += n;
    }
    STRATA_ASSIGN_OR_RETURN(size_t n, io.Reap(done, 1));
    for (size_t i = 0; i < n; ++i) {
      if (!done[i].status.ok() && first.ok()) first = done[i].status;
      free_list.push_back(static_cast<size_t>(done[i].user_data));
    }
  }
  return first;
}

// Opens `path` with `flags`, runs one pass (+ fsync for writes), closes; seconds taken.
Result<double> TimedPass(IoBackend& io, const std::string& path, int flags, IoOp op, uint64_t bytes,
                         size_t chunk_bytes, const std::vector<uint8_t*>& buffers, bool allocate,
                         bool* buffered) {
  const auto t0 = std::chrono::steady_clock::now();
  const int fd = OpenDirect(path, flags, buffered);
  if (fd < 0) return Status::FromErrno(errno, "open", path);
  Status st = io.RegisterFile(fd, path);
  if (st.ok() && allocate) st = io.Allocate(fd, bytes);
  if (st.ok()) st = Pump(io, fd, op, bytes, chunk_bytes, buffers);
  if (st.ok() && op == IoOp::kWrite && ::fsync(fd) != 0)
    st = Status::FromErrno(errno, "fsync", path);
  io.UnregisterFile(fd);
  if (::close(fd) != 0 && st.ok()) st = Status::FromErrno(errno, "close", path);
  STRATA_RETURN_IF_ERROR(st);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::string DiskReferencePath(const std::string& dir) {
  return dir + "/.strata-disk-reference." + std::to_string(::getpid());
}

Result<double> TimeDiskPass(const std::string& path, uint64_t bytes, const StreamOptions& options,
                            DiskPass pass, bool* buffered) {
  STRATA_RETURN_IF_ERROR(CheckOptions(options));
  if (options.kind == IoBackendKind::kSimulated) {
    return Status::InvalidArgument("MeasureDisk: the simulated backend has no disk to measure");
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> io, OpenBackend(options, path));
  std::vector<uint8_t*> buffers;
  Status st = AllocBuffers(options.depth, options.chunk_bytes, &buffers);
  // Random and never the same block twice (nvme/write_content.h): a disk that compresses or
  // deduplicates must not find the reference cheaper than the checkpoint's own state.
  for (size_t b = 0; st.ok() && b < buffers.size(); ++b) {
    nvme::FillIncompressible(buffers[b], options.chunk_bytes, b + 1);
  }
  double seconds = 0;
  if (st.ok()) {
    const int flags = pass == DiskPass::kWriteFresh  ? O_WRONLY | O_CREAT | O_TRUNC
                      : pass == DiskPass::kOverwrite ? O_WRONLY
                                                     : O_RDONLY;
    auto s =
        TimedPass(*io, path, flags, pass == DiskPass::kRead ? IoOp::kRead : IoOp::kWrite, bytes,
                  options.chunk_bytes, buffers, pass == DiskPass::kWriteFresh, buffered);
    if (s.ok()) seconds = *s;
    st = s.status();
  }
  FreeBuffers(&buffers);
  if (io->inflight() == 0) ReturnIdle(options, std::move(io));
  STRATA_RETURN_IF_ERROR(st);
  return seconds;
}

Result<DiskReference> MeasureDisk(const std::string& dir, uint64_t bytes,
                                  const StreamOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckOptions(options));
  DiskReference d;
  d.chunk_bytes = options.chunk_bytes;
  d.depth = options.depth;
  d.bytes = (std::max<uint64_t>(bytes, 1) + options.chunk_bytes - 1) / options.chunk_bytes *
            options.chunk_bytes;
  const std::string path = DiskReferencePath(dir);
  bool buffered = false;
  double seconds[3] = {0, 0, 0};
  Status st;
  for (DiskPass pass : {DiskPass::kWriteFresh, DiskPass::kOverwrite, DiskPass::kRead}) {
    auto s = TimeDiskPass(path, d.bytes, options, pass, &buffered);
    st = s.status();
    if (!st.ok()) break;
    seconds[static_cast<size_t>(pass)] = *s;
  }
  ::unlink(path.c_str());
  if (st.IsInvalidArgument()) return st;
  STRATA_RETURN_IF_ERROR(st.WithContext("disk reference " + path));
  const double b = static_cast<double>(d.bytes);
  auto rate = [&](DiskPass p) {
    const double s = seconds[static_cast<size_t>(p)];
    return s > 0 ? b / s : 0;
  };
  d.write_fresh_bytes_per_s = rate(DiskPass::kWriteFresh);
  d.write_overwrite_bytes_per_s = rate(DiskPass::kOverwrite);
  d.read_bytes_per_s = rate(DiskPass::kRead);
  if (buffered) d.note = "buffered IO (O_DIRECT refused under " + dir + ")";
  return d;
}

// ---------------------------------------------------------------------------------------------
// StreamWriter
// ---------------------------------------------------------------------------------------------

Result<std::unique_ptr<StreamWriter>> StreamWriter::Create(const std::string& path,
                                                           const StreamOptions& options,
                                                           uint64_t expected_bytes, bool reuse) {
  STRATA_RETURN_IF_ERROR(CheckOptions(options));
  options.Env().BeforeDurableOp({.kind = DurableOp::Kind::kCreate, .path = path});
  std::unique_ptr<StreamWriter> w(new StreamWriter());
  w->path_ = path;
  w->opt_ = options;
  bool buffered = false;
  w->fd_ = OpenDirect(path, O_WRONLY | O_CREAT | (reuse ? 0 : O_TRUNC), &buffered);
  if (w->fd_ < 0) return Status::FromErrno(errno, "create", path);
  if (buffered) w->note_ = "buffered IO (O_DIRECT refused on " + path + ")";
  STRATA_ASSIGN_OR_RETURN(w->io_, OpenBackend(options, path));
  STRATA_RETURN_IF_ERROR(w->io_->RegisterFile(w->fd_, path));
  if (expected_bytes > 0) STRATA_RETURN_IF_ERROR(w->io_->Allocate(w->fd_, AlignUp(expected_bytes)));
  STRATA_RETURN_IF_ERROR(AllocBuffers(options.depth, options.chunk_bytes, &w->buffers_));
  for (size_t i = 1; i < options.depth; ++i) w->free_.push_back(i);
  w->cur_ = 0;
  w->state_ = XXH3_createState();
  if (w->state_ == nullptr) return Status::ResourceExhausted("XXH3_createState");
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(w->state_));
  return w;
}

StreamWriter::~StreamWriter() {
  const bool drained = Drain().ok() || (io_ && io_->inflight() == 0);
  if (fd_ >= 0) {
    if (io_) io_->UnregisterFile(fd_);
    ::close(fd_);
  }
  if (drained) ReturnIdle(opt_, std::move(io_));
  FreeBuffers(&buffers_);
  if (state_ != nullptr) XXH3_freeState(static_cast<XXH3_state_t*>(state_));
}

uint64_t StreamWriter::xxh3() const {
  return state_ != nullptr ? XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_)) : 0;
}

Status StreamWriter::ReapOne() {
  IoCompletion c;
  STRATA_ASSIGN_OR_RETURN(size_t n, io_->Reap(std::span<IoCompletion>(&c, 1), 1));
  if (n == 1) {
    if (!c.status.ok() && first_error_.ok()) first_error_ = c.status;
    free_.push_back(static_cast<size_t>(c.user_data));
  }
  return Status::OK();
}

Status StreamWriter::Drain() {
  while (io_ && io_->inflight() > 0) {
    Status st = ReapOne();
    if (!st.ok()) {
      if (first_error_.ok()) first_error_ = st;
      return st;
    }
  }
  return first_error_;
}

Status StreamWriter::SubmitCurrent(size_t length_bytes) {
  const size_t io_bytes = AlignUp(length_bytes);
  std::memset(buffers_[cur_] + length_bytes, 0, io_bytes - length_bytes);
  IoRequest r{IoOp::kWrite, fd_, submitted_, buffers_[cur_], io_bytes, cur_};
  STRATA_RETURN_IF_ERROR(io_->Submit(std::span<const IoRequest>(&r, 1)));
  submitted_ += io_bytes;
  fill_ = 0;
  while (free_.empty()) STRATA_RETURN_IF_ERROR(ReapOne());
  STRATA_RETURN_IF_ERROR(first_error_);
  cur_ = free_.back();
  free_.pop_back();
  return Status::OK();
}

Status StreamWriter::Append(const void* data, uint64_t bytes) {
  STRATA_RETURN_IF_ERROR(first_error_);
  if (fd_ < 0) return Status::FailedPrecondition(path_ + ": Append after Finish");
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, bytes);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(bytes, opt_.chunk_bytes - fill_));
    std::memcpy(buffers_[cur_] + fill_, p, n);
    fill_ += n;
    p += n;
    bytes -= n;
    size_ += n;
    if (fill_ == opt_.chunk_bytes) STRATA_RETURN_IF_ERROR(SubmitCurrent(fill_));
  }
  return Status::OK();
}

Status StreamWriter::Finish() {
  if (fd_ < 0) return Status::FailedPrecondition(path_ + ": Finish twice");
  if (fill_ > 0 && first_error_.ok()) STRATA_RETURN_IF_ERROR(SubmitCurrent(fill_));
  STRATA_RETURN_IF_ERROR(Drain());
  if (::ftruncate(fd_, static_cast<off_t>(size_)) != 0)
    return Status::FromErrno(errno, "truncate", path_);
  opt_.Env().BeforeDurableOp({.kind = DurableOp::Kind::kSync, .path = path_});
  if (::fsync(fd_) != 0) return Status::FromErrno(errno, "fsync", path_);
  io_->UnregisterFile(fd_);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return Status::FromErrno(errno, "close", path_);
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// StreamReader
// ---------------------------------------------------------------------------------------------

Result<std::unique_ptr<StreamReader>> StreamReader::Open(const std::string& path,
                                                         const StreamOptions& options, bool hash) {
  STRATA_RETURN_IF_ERROR(CheckOptions(options));
  std::unique_ptr<StreamReader> r(new StreamReader());
  r->path_ = path;
  r->opt_ = options;
  bool buffered = false;
  r->fd_ = OpenDirect(path, O_RDONLY, &buffered);
  if (r->fd_ < 0) {
    if (errno == ENOENT) return Status::NotFound("checkpoint file " + path + " is missing");
    return Status::FromErrno(errno, "open", path);
  }
  struct stat st {};
  if (::fstat(r->fd_, &st) != 0) return Status::FromErrno(errno, "stat", path);
  r->size_ = static_cast<uint64_t>(st.st_size);
  STRATA_ASSIGN_OR_RETURN(r->io_, OpenBackend(options, path));
  STRATA_RETURN_IF_ERROR(r->io_->RegisterFile(r->fd_, path));
  STRATA_RETURN_IF_ERROR(AllocBuffers(options.depth, options.chunk_bytes, &r->buffers_));
  for (size_t i = 0; i < options.depth; ++i) r->free_.push_back(i);
  r->hashing_ = hash;
  if (hash) {
    r->state_ = XXH3_createState();
    if (r->state_ == nullptr) return Status::ResourceExhausted("XXH3_createState");
    XXH3_64bits_reset(static_cast<XXH3_state_t*>(r->state_));
  }
  return r;
}

StreamReader::~StreamReader() {
  const bool drained = Drain().ok() || (io_ && io_->inflight() == 0);
  if (fd_ >= 0) {
    if (io_) io_->UnregisterFile(fd_);
    ::close(fd_);
  }
  if (drained) ReturnIdle(opt_, std::move(io_));
  FreeBuffers(&buffers_);
  if (state_ != nullptr) XXH3_freeState(static_cast<XXH3_state_t*>(state_));
}

Status StreamReader::Drain() {
  std::vector<IoCompletion> done(opt_.depth);
  while (io_ && io_->inflight() > 0) {
    auto n = io_->Reap(done, 1);
    if (!n.ok()) return n.status();
    for (size_t i = 0; i < *n; ++i) {
      for (Chunk& c : window_) {
        if (c.buffer == done[i].user_data) c.ready = true;
      }
      if (!done[i].status.ok() && first_error_.ok()) first_error_ = done[i].status;
    }
  }
  return first_error_;
}

Status StreamReader::Restart(uint64_t offset) {
  STRATA_RETURN_IF_ERROR(Drain());
  for (const Chunk& c : window_) free_.push_back(c.buffer);
  window_.clear();
  next_issue_ = AlignDown(offset);
  if (hashing_) hash_broken_ = true;
  return Status::OK();
}

// Fills the free buffers with the next chunks of the file. The tail past the last whole 4 KiB
// block is read synchronously (an O_DIRECT read there returns short).
Status StreamReader::IssueAhead() {
  const uint64_t aligned_end = AlignDown(size_);
  while (!free_.empty() && next_issue_ < size_) {
    Chunk c;
    c.offset = next_issue_;
    c.buffer = free_.back();
    if (next_issue_ < aligned_end) {
      c.length =
          static_cast<size_t>(std::min<uint64_t>(opt_.chunk_bytes, aligned_end - next_issue_));
      IoRequest r{IoOp::kRead, fd_, c.offset, buffers_[c.buffer], c.length, c.buffer};
      STRATA_RETURN_IF_ERROR(io_->Submit(std::span<const IoRequest>(&r, 1)));
    } else {
      c.length = static_cast<size_t>(size_ - next_issue_);
      ssize_t n;
      do {
        n = ::pread(fd_, buffers_[c.buffer], kIoAlignment, static_cast<off_t>(c.offset));
      } while (n < 0 && errno == EINTR);
      if (n < 0) return Status::FromErrno(errno, "read", path_);
      if (static_cast<size_t>(n) < c.length) {
        return Status::Corruption(path_ + ": shrank to " + std::to_string(c.offset + n) +
                                  " bytes while being read");
      }
      c.ready = true;
    }
    free_.pop_back();
    next_issue_ += c.length;
    window_.push_back(c);
  }
  return Status::OK();
}

Status StreamReader::WaitFront() {
  std::vector<IoCompletion> done(opt_.depth);
  while (!window_.front().ready) {
    STRATA_ASSIGN_OR_RETURN(size_t n, io_->Reap(done, 1));
    for (size_t i = 0; i < n; ++i) {
      for (Chunk& c : window_) {
        if (c.buffer == done[i].user_data) c.ready = true;
      }
      if (!done[i].status.ok() && first_error_.ok()) first_error_ = done[i].status;
    }
    STRATA_RETURN_IF_ERROR(first_error_);
  }
  return Status::OK();
}

void StreamReader::PopFront() {
  const Chunk& c = window_.front();
  if (hashing_ && !hash_broken_) {
    XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), buffers_[c.buffer], c.length);
  }
  free_.push_back(c.buffer);
  window_.pop_front();
}

Status StreamReader::Read(uint64_t offset, void* out, uint64_t bytes) {
  STRATA_RETURN_IF_ERROR(first_error_);
  if (offset + bytes > size_) {
    return Status::Corruption(path_ + ": ends at " + std::to_string(size_) +
                              " bytes, expected at least " + std::to_string(offset + bytes));
  }
  uint8_t* dst = static_cast<uint8_t*>(out);
  while (bytes > 0) {
    // Behind the stream, or beyond what the window will reach soon: start over there.
    const uint64_t window_begin = window_.empty() ? next_issue_ : window_.front().offset;
    if (offset < window_begin || offset >= next_issue_ + opt_.chunk_bytes * opt_.depth) {
      STRATA_RETURN_IF_ERROR(Restart(offset));
    }
    STRATA_RETURN_IF_ERROR(IssueAhead());
    if (window_.empty()) return Status::Internal(path_ + ": read-ahead window empty");
    STRATA_RETURN_IF_ERROR(WaitFront());
    const Chunk& c = window_.front();
    if (offset >= c.offset + c.length) {
      PopFront();
      continue;
    }
    const uint64_t n = std::min<uint64_t>(bytes, c.offset + c.length - offset);
    std::memcpy(dst, buffers_[c.buffer] + (offset - c.offset), n);
    dst += n;
    offset += n;
    bytes -= n;
    if (offset == c.offset + c.length) PopFront();
  }
  // Keep the disk busy while the caller uses what it read.
  return IssueAhead();
}

Result<uint64_t> StreamReader::HashToEnd() {
  if (!hashing_) return Status::FailedPrecondition(path_ + ": not opened for hashing");
  for (;;) {
    STRATA_RETURN_IF_ERROR(IssueAhead());
    if (window_.empty()) break;
    STRATA_RETURN_IF_ERROR(WaitFront());
    PopFront();
  }
  if (hash_broken_) return Status::FailedPrecondition(path_ + ": read out of order, not hashed");
  return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_));
}

}  // namespace strata::zero::ckpt
