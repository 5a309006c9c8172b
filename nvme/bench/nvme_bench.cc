#include "nvme/bench/nvme_bench.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>

#include "cpu/pinned_pool.h"
#include "nvme/leftovers.h"
#include "nvme/write_content.h"

namespace strata::nvme {

namespace {

using Clock = std::chrono::steady_clock;

LatencyUs Percentiles(std::vector<uint64_t>& ns) {
  LatencyUs l;
  if (ns.empty()) return l;
  std::sort(ns.begin(), ns.end());
  auto at = [&](double q) {
    return static_cast<double>(ns[std::min(ns.size() - 1, static_cast<size_t>(q * ns.size()))]) /
           1e3;
  };
  l.p50 = at(0.50);
  l.p90 = at(0.90);
  l.p99 = at(0.99);
  l.max = static_cast<double>(ns.back()) / 1e3;
  return l;
}

// One scratch file per directory, locked while it exists and removed (before the lock goes with
// the descriptor) when the benchmark ends.
struct ScratchFile {
  int fd = -1;
  std::string path;
  ScratchFile() = default;
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  ~ScratchFile() {
    if (fd < 0) return;
    unlink(path.c_str());
    close(fd);
  }
};

struct ThreadCtx {
  const ScratchFile* file = nullptr;
  std::unique_ptr<IoBackend> io;
  std::vector<char*> bufs;
  uint64_t begin = 0, end = 0;
  std::vector<uint64_t> lat_ns;
  Status status;
};

// Keeps queue_depth requests in flight over [begin, end): each completion re-arms its buffer
// with the next block; all re-armed requests of one Reap go out in one Submit.
Status RunPass(ThreadCtx& t, IoOp op, size_t bs) {
  const int fd = t.file->fd;
  const size_t qd = t.bufs.size();
  std::vector<Clock::time_point> issued(qd);
  std::vector<IoRequest> batch;
  batch.reserve(qd);
  std::vector<IoCompletion> done(qd);
  uint64_t next = t.begin;
  for (size_t i = 0; i < qd && next < t.end; ++i, next += bs) {
    if (op == IoOp::kWrite) StampUnique(t.bufs[i], bs);
    batch.push_back(IoRequest{op, fd, next, t.bufs[i], bs, i});
    issued[i] = Clock::now();
  }
  STRATA_RETURN_IF_ERROR(t.io->Submit(batch));
  while (t.io->inflight() > 0) {
    STRATA_ASSIGN_OR_RETURN(size_t n, t.io->Reap(done, 1));
    const auto now = Clock::now();
    batch.clear();
    for (size_t i = 0; i < n; ++i) {
      STRATA_RETURN_IF_ERROR(done[i].status);
      const size_t slot = static_cast<size_t>(done[i].user_data);
      t.lat_ns.push_back(static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(now - issued[slot]).count()));
      if (next < t.end) {
        if (op == IoOp::kWrite) StampUnique(t.bufs[slot], bs);
        batch.push_back(IoRequest{op, fd, next, t.bufs[slot], bs, slot});
        issued[slot] = now;
        next += bs;
      }
    }
    if (!batch.empty()) STRATA_RETURN_IF_ERROR(t.io->Submit(batch));
  }
  return Status::OK();
}

// The block sizes every pass here accepts: whole 4 KiB pages (O_DIRECT), up to 1 GiB.
Status CheckBlockBytes(uint64_t block_bytes) {
  if (block_bytes == 0 || block_bytes % kIoAlignment != 0 || block_bytes > (1u << 30)) {
    return Status::InvalidArgument("block size " + std::to_string(block_bytes) +
                                   " must be a multiple of 4096 up to 1 GiB");
  }
  return Status::OK();
}

Status ValidatePoint(const NvmeBenchPoint& p, uint64_t size) {
  STRATA_RETURN_IF_ERROR(CheckBlockBytes(p.block_bytes));
  if (p.queue_depth == 0 || p.queue_depth > 4096) {
    return Status::InvalidArgument("queue depth " + std::to_string(p.queue_depth) +
                                   " out of 1..4096");
  }
  if (p.threads == 0 || p.threads > 256) {
    return Status::InvalidArgument("threads " + std::to_string(p.threads) + " out of 1..256");
  }
  if (size < p.block_bytes * p.threads) {
    return Status::InvalidArgument("size " + std::to_string(size) + " per directory is smaller " +
                                   "than one block (" + std::to_string(p.block_bytes) +
                                   ") per thread");
  }
  return Status::OK();
}

Result<NvmeBenchResult> RunPoint(const NvmeBenchOptions& o, const NvmeBenchPoint& p,
                                 const std::vector<ScratchFile>& files) {
  const uint64_t share = o.size_bytes / files.size();
  const uint64_t per_thread = share / p.threads / p.block_bytes * p.block_bytes;
  const size_t nthreads = p.threads * files.size();
  cpu::PinnedPoolOptions po;
  po.budget_bytes = nthreads * ((p.queue_depth * p.block_bytes + cpu::kHugePageBytes - 1) /
                                cpu::kHugePageBytes * cpu::kHugePageBytes);
  po.huge_pages = o.huge_pages;
  po.register_with_cuda = false;  // disk only
  STRATA_ASSIGN_OR_RETURN(auto pool, cpu::PinnedPool::Create(po));
  std::vector<cpu::PinnedBuffer> mem;
  std::vector<ThreadCtx> ctx(nthreads);
  NvmeBenchResult r;
  r.point = p;
  r.bytes = per_thread * nthreads;
  for (size_t t = 0; t < nthreads; ++t) {
    STRATA_ASSIGN_OR_RETURN(cpu::PinnedBuffer b, pool->Allocate(p.queue_depth * p.block_bytes));
    FillIncompressible(b.data(), b.size_bytes(), 1 + t);
    for (size_t i = 0; i < p.queue_depth; ++i)
      ctx[t].bufs.push_back(b.as<char>() + i * p.block_bytes);
    ctx[t].file = &files[t / p.threads];  // threads [d * threads, (d + 1) * threads) on dir d
    ctx[t].begin = (t % p.threads) * per_thread;
    ctx[t].end = ctx[t].begin + per_thread;
    ctx[t].lat_ns.reserve(2 * per_thread / p.block_bytes);
    mem.push_back(std::move(b));
  }
  // Each thread opens (and owns) its backend and runs both passes, so a single-issuer ring is
  // legal. Barriers: ready | write pass | (fdatasync by the main thread) | read pass.
  std::barrier sync(static_cast<std::ptrdiff_t>(nthreads + 1));
  std::vector<std::thread> threads;
  for (size_t t = 0; t < nthreads; ++t) {
    threads.emplace_back([&, t] {
      ThreadCtx& c = ctx[t];
      IoBackendOptions io;
      io.kind = o.backend;
      io.queue_depth = p.queue_depth;
      io.single_issuer = true;
      io.register_files_and_buffers = o.fixed_buffers;
      auto opened = OpenIoBackend(io);
      if (opened.ok()) {
        c.io = std::move(opened).value();
        c.status = c.io->RegisterFile(c.file->fd, c.file->path);
        if (o.fixed_buffers) {
          // Unregistered IO still works; the backend's note says why registration failed.
          c.io->RegisterBuffer(mem[t].data(), mem[t].capacity_bytes()).IgnoreError();
        }
      } else {
        c.status = opened.status();
      }
      for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
        sync.arrive_and_wait();  // start
        if (c.status.ok()) c.status = RunPass(c, op, p.block_bytes);
        sync.arrive_and_wait();  // finished
      }
      c.io.reset();  // closed by the thread that owns the ring
    });
  }
  Status failed;
  for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
    sync.arrive_and_wait();
    const auto t0 = Clock::now();
    sync.arrive_and_wait();
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    std::vector<uint64_t> lat;
    for (ThreadCtx& c : ctx) {
      lat.insert(lat.end(), c.lat_ns.begin(), c.lat_ns.end());
      c.lat_ns.clear();
    }
    if (op == IoOp::kWrite) {
      for (const ScratchFile& f : files) {
        if (fdatasync(f.fd) != 0 && failed.ok()) {
          failed = Status::FromErrno(errno, "fdatasync", f.path);
        }
      }
      r.write_bytes_per_s = static_cast<double>(r.bytes) / secs;
      r.write_latency = Percentiles(lat);
    } else {
      r.read_bytes_per_s = static_cast<double>(r.bytes) / secs;
      r.read_latency = Percentiles(lat);
    }
    if (op == IoOp::kWrite) {
      // Notes are read while the threads wait at the next barrier (no IO running).
      r.backend = ctx[0].io ? std::string(IoBackendKindName(ctx[0].io->kind())) : "none";
      r.note = ctx[0].io ? ctx[0].io->note() : "";
    }
  }
  for (auto& th : threads) th.join();
  for (ThreadCtx& c : ctx) {
    if (!c.status.ok()) return c.status;
  }
  STRATA_RETURN_IF_ERROR(failed);
  if (!pool->note().empty()) r.note += (r.note.empty() ? "" : "; ") + pool->note();
  ctx.clear();
  return r;
}

// Every directory exists, and none is given twice (under another name either: a second file
// on the same disk would halve what each measures).
Status CheckDirs(const std::vector<std::string>& dirs) {
  std::vector<std::pair<dev_t, ino_t>> seen;
  for (const std::string& dir : dirs) {
    struct stat st {};
    if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return Status::NotFound("benchmark path '" + dir + "' is not an existing directory");
    }
    if (std::find(seen.begin(), seen.end(), std::pair{st.st_dev, st.st_ino}) != seen.end()) {
      return Status::InvalidArgument("benchmark path '" + dir + "' is given twice");
    }
    seen.emplace_back(st.st_dev, st.st_ino);
  }
  return Status::OK();
}

Status CreateScratchFile(const std::string& dir, uint64_t size_bytes, ScratchFile* f) {
  f->path = dir + "/strata-bench-" + std::to_string(getpid()) + ".dat";
  // Locked while it exists (leftovers.h), so a swap space starting meanwhile does not take it
  // for a crashed run's leftover, and a crash's leftover is reported by the next start.
  int err = 0;
  f->fd = CreateLockedFile(f->path, O_DIRECT, &err);
  if (f->fd < 0) {
    if (err == EINVAL) {
      return Status::InvalidArgument("benchmark path '" + dir +
                                     "': the filesystem does not support O_DIRECT");
    }
    return Status::FromErrno(err, "create benchmark file", f->path);
  }
  if (int e = posix_fallocate(f->fd, 0, static_cast<off_t>(size_bytes)); e != 0) {
    return Status::FromErrno(e, "preallocate " + std::to_string(size_bytes) + " bytes for",
                             f->path);
  }
  return Status::OK();
}

// One unit of a rewrite pass: its file and offset.
struct Unit {
  int fd;
  uint64_t offset;
};

}  // namespace

Result<NvmeRewriteResult> RunNvmeRewrite(const NvmeRewriteOptions& o) {
  if (o.files.empty()) return Status::InvalidArgument("rewrite pass: no file");
  STRATA_RETURN_IF_ERROR(CheckBlockBytes(o.block_bytes).WithContext("rewrite pass"));
  if (o.queue_depth == 0 || o.queue_depth > 4096) {
    return Status::InvalidArgument("rewrite pass: queue depth " + std::to_string(o.queue_depth) +
                                   " (1..4096)");
  }
  const uint64_t bs = o.block_bytes;
  const uint64_t reads = (o.read_bytes + bs - 1) / bs, writes = (o.write_bytes + bs - 1) / bs;
  if (reads == 0) {
    return Status::InvalidArgument("rewrite pass: no read (a unit is written back only from its "
                                   "own read)");
  }
  // The files, opened in place; each closed on every path out.
  struct Fd {
    int fd = -1;
    ~Fd() {
      if (fd >= 0) close(fd);
    }
  };
  std::vector<Fd> fds(o.files.size());
  std::vector<uint64_t> units(o.files.size());
  for (size_t f = 0; f < o.files.size(); ++f) {
    struct stat st {};
    if (lstat(o.files[f].c_str(), &st) != 0) {
      const int err = errno;
      if (err == ENOENT) return Status::NotFound("rewrite pass: no file '" + o.files[f] + "'");
      return Status::FromErrno(err, "rewrite pass: stat", o.files[f]);
    }
    if (!S_ISREG(st.st_mode)) {  // never through a link, never a device or a directory
      return Status::InvalidArgument("rewrite pass: '" + o.files[f] + "' is not a regular file");
    }
    fds[f].fd = open(o.files[f].c_str(), O_RDWR | O_DIRECT | O_CLOEXEC | O_NOFOLLOW);
    if (fds[f].fd < 0) return Status::FromErrno(errno, "rewrite pass: open", o.files[f]);
    if (fstat(fds[f].fd, &st) != 0) return Status::FromErrno(errno, "rewrite pass: stat", o.files[f]);
    units[f] = static_cast<uint64_t>(st.st_size) / bs;
  }
  // Positions: round r visits unit r of every file that has one (as the swap space stripes).
  std::vector<Unit> span;
  for (uint64_t r = 0, more = 1; more != 0; ++r) {
    more = 0;
    for (size_t f = 0; f < fds.size(); ++f) {
      if (r < units[f]) {
        span.push_back(Unit{fds[f].fd, r * bs});
        more = 1;
      }
    }
  }
  const uint64_t S = span.size();
  if (S == 0) {
    return Status::InvalidArgument("rewrite pass: the files hold no whole block of " +
                                   std::to_string(bs) + " bytes");
  }
  // Read j: spread evenly over the span (or revisiting it in order when reading more); it is
  // written back (j+1)W/R - jW/R times.
  auto position = [&](uint64_t j) {
    return S >= reads ? (j * S / reads + o.first_unit) % S : (j + o.first_unit) % S;
  };
  auto write_count = [&](uint64_t j) {
    return static_cast<uint32_t>((j + 1) * writes / reads - j * writes / reads);
  };
  const size_t nbuf = static_cast<size_t>(std::max<uint64_t>(
      o.queue_depth, std::min<uint64_t>(o.buffer_bytes / bs, reads)));
  cpu::PinnedPoolOptions po;
  po.budget_bytes = (nbuf * bs + cpu::kHugePageBytes - 1) / cpu::kHugePageBytes * cpu::kHugePageBytes;
  po.lock_memory = false;
  po.register_with_cuda = false;
  STRATA_ASSIGN_OR_RETURN(auto pool, cpu::PinnedPool::Create(po));
  STRATA_ASSIGN_OR_RETURN(cpu::PinnedBuffer mem, pool->Allocate(nbuf * bs));
  IoBackendOptions io;
  io.kind = o.backend;
  io.queue_depth = o.queue_depth;
  io.single_issuer = true;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> backend, OpenIoBackend(io));
  for (size_t f = 0; f < fds.size(); ++f) {
    STRATA_RETURN_IF_ERROR(backend->RegisterFile(fds[f].fd, o.files[f]));
  }
  backend->RegisterBuffer(mem.data(), nbuf * bs).IgnoreError();  // unregistered IO works too

  struct Buf {
    uint64_t pos = 0;
    uint32_t writes_left = 0;
    bool reading = false;
  };
  std::vector<Buf> bufs(nbuf);
  std::deque<size_t> free_bufs, ready;  // ready: read back, waiting to be written
  for (size_t b = 0; b < nbuf; ++b) free_bufs.push_back(b);
  uint64_t issued_r = 0, issued_w = 0;
  std::vector<IoRequest> batch;
  batch.reserve(o.queue_depth);
  std::vector<IoCompletion> done(o.queue_depth);
  Status first;
  // Phases that only read and only write, each drained before the next starts.
  bool reading = true;
  double phase_seconds[2] = {0, 0};  // read, write
  const auto t0 = Clock::now();
  auto phase_t0 = t0;
  while (true) {
    batch.clear();
    while (first.ok() && backend->inflight() + batch.size() < o.queue_depth) {
      if (reading ? issued_r >= reads || free_bufs.empty() : ready.empty()) break;
      size_t b;
      if (reading) {
        b = free_bufs.front();
        free_bufs.pop_front();
        bufs[b].pos = position(issued_r);
        bufs[b].writes_left = write_count(issued_r);
        bufs[b].reading = true;
        ++issued_r;
      } else {
        b = ready.front();
        ready.pop_front();
        bufs[b].reading = false;
        ++issued_w;
      }
      const Unit& u = span[bufs[b].pos];
      batch.push_back(IoRequest{reading ? IoOp::kRead : IoOp::kWrite, u.fd, u.offset,
                                mem.as<char>() + b * bs, bs, b});
    }
    if (!batch.empty()) {
      Status st = backend->Submit(batch);
      if (!st.ok() && first.ok()) first = st;  // none of the batch was queued
    }
    if (backend->inflight() == 0) {
      if (!first.ok()) break;
      // The phase is over: nothing more of its kind can start and its IO is done.
      const auto now = Clock::now();
      phase_seconds[reading ? 0 : 1] += std::chrono::duration<double>(now - phase_t0).count();
      phase_t0 = now;
      if (ready.empty() && issued_r >= reads) break;
      reading = !reading;
      continue;
    }
    auto n = backend->Reap(done, 1);
    if (!n.ok()) {
      if (first.ok()) first = n.status();
      break;  // the backend keeps what it cannot reap; its destructor waits for it
    }
    for (size_t i = 0; i < *n; ++i) {
      const size_t b = static_cast<size_t>(done[i].user_data);
      if (!done[i].status.ok()) {
        if (first.ok()) first = done[i].status.WithContext("rewrite pass");
        continue;
      }
      if (bufs[b].reading) {
        (bufs[b].writes_left > 0 ? ready : free_bufs).push_back(b);
      } else if (--bufs[b].writes_left > 0) {
        ready.push_back(b);
      } else {
        free_bufs.push_back(b);
      }
    }
  }
  NvmeRewriteResult r;
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  STRATA_RETURN_IF_ERROR(first);
  r.read_bytes = issued_r * bs;
  r.write_bytes = issued_w * bs;
  r.span_bytes = S * bs;
  r.read_seconds = phase_seconds[0];
  r.write_seconds = phase_seconds[1];
  r.backend = IoBackendKindName(backend->kind());
  r.note = backend->note();
  if (!pool->note().empty()) r.note += (r.note.empty() ? "" : "; ") + pool->note();
  return r;
}

Result<std::vector<NvmeBenchResult>> RunNvmeBench(
    const NvmeBenchOptions& options, const std::vector<NvmeBenchPoint>& points,
    const std::function<void(size_t, const NvmeBenchPoint&)>& progress) {
  if (points.empty()) return Status::InvalidArgument("no benchmark points");
  if (options.dirs.empty()) return Status::InvalidArgument("no benchmark directory");
  const uint64_t share = options.size_bytes / options.dirs.size();
  for (const NvmeBenchPoint& p : points) STRATA_RETURN_IF_ERROR(ValidatePoint(p, share));
  STRATA_RETURN_IF_ERROR(CheckDirs(options.dirs));
  std::vector<ScratchFile> files(options.dirs.size());
  for (size_t d = 0; d < files.size(); ++d) {
    STRATA_RETURN_IF_ERROR(CreateScratchFile(options.dirs[d], share, &files[d]));
  }
  std::vector<NvmeBenchResult> results;
  for (size_t i = 0; i < points.size(); ++i) {
    if (progress) progress(i, points[i]);
    STRATA_ASSIGN_OR_RETURN(NvmeBenchResult r, RunPoint(options, points[i], files));
    results.push_back(std::move(r));
  }
  return results;
}

}  // namespace strata::nvme
