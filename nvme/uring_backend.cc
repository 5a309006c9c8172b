#include "nvme/uring_backend.h"

#include <sys/uio.h>

#include <time.h>

#include <cassert>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "nvme/io_drain.h"

namespace strata::nvme {

namespace {
constexpr unsigned kMaxFixedFiles = 256;
constexpr unsigned kMaxFixedBuffers = 1024;
constexpr size_t kMaxFixedBufferBytes = size_t{1} << 30;  // kernel limit per fixed buffer
constexpr size_t kMaxSqeBytes = size_t{1} << 30;          // one SQE moves at most this

// liburing returns -errno; one helper turns it into a Status naming the call.
Status UringError(int neg_errno, const std::string& call) {
  return Status::FromErrno(-neg_errno, call);
}

// Results of io_uring_enter that leave the SQEs queued for the next entry.
bool Transient(int ret) { return ret == -EAGAIN || ret == -EBUSY || ret == -EINTR; }

uint64_t NowNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
}
}  // namespace

Result<std::unique_ptr<UringBackend>> UringBackend::Open(const IoBackendOptions& options,
                                                         std::shared_ptr<UringFaults> faults) {
  std::unique_ptr<UringBackend> b(new UringBackend());
  b->faults_ = std::move(faults);
  const unsigned entries = static_cast<unsigned>(options.queue_depth);
  unsigned flags = IORING_SETUP_CLAMP;
  if (options.sqpoll) flags |= IORING_SETUP_SQPOLL;
  if (options.single_issuer) flags |= IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
  io_uring_params params{};
  params.flags = flags;
  params.cq_entries = 2 * entries;
  params.flags |= IORING_SETUP_CQSIZE;
  int ret = io_uring_queue_init_params(entries, &b->ring_, &params);
  if (ret == -EINVAL && (flags & ~IORING_SETUP_CLAMP) != 0) {
    // An older kernel refusing the newer flags: plain flags still work.
    b->AddNote("io_uring refused setup flags " + std::to_string(flags) + "; using plain flags");
    params = io_uring_params{};
    params.flags = IORING_SETUP_CLAMP | IORING_SETUP_CQSIZE;
    params.cq_entries = 2 * entries;
    ret = io_uring_queue_init_params(entries, &b->ring_, &params);
  }
  if (ret < 0) {
    return Status::Unavailable(UringError(ret, "io_uring_queue_init").message());
  }
  b->ring_open_ = true;
  b->setup_flags_ = params.flags;
  b->slots_.resize(options.queue_depth);
  b->ready_ = BoundedQueue<IoCompletion>(options.queue_depth);
  b->deferred_.reserve(options.queue_depth);
  for (size_t i = options.queue_depth; i-- > 0;) b->free_slots_.push_back(i);
  if (options.register_files_and_buffers) {
    ret = io_uring_register_files_sparse(&b->ring_, kMaxFixedFiles);
    if (ret == 0) {
      b->files_registered_ = true;
      for (unsigned i = kMaxFixedFiles; i-- > 0;) b->free_file_slots_.push_back(i);
    } else {
      b->AddNote("fixed files refused (" +
                 UringError(ret, "io_uring_register_files_sparse").ToString() + ")");
    }
    ret = io_uring_register_buffers_sparse(&b->ring_, kMaxFixedBuffers);
    if (ret == 0) {
      b->buffers_table_ = true;
      for (unsigned i = kMaxFixedBuffers; i-- > 0;) b->free_buffer_slots_.push_back(i);
    } else {
      b->AddNote("fixed buffers refused (" +
                 UringError(ret, "io_uring_register_buffers_sparse").ToString() + ")");
    }
  }
  return b;
}

UringBackend::~UringBackend() {
  if (!ring_open_) return;
  std::vector<IoCompletion> sink(slots_.size());
  Status first;
  const bool drained = DrainInflight(*this, sink, &first);
  if (faults_ && faults_->before_queue_exit) faults_->before_queue_exit(inflight_);
  if (!drained) {
    // Closing the ring now would let the kernel write into buffers the owner is about to free.
    std::fprintf(stderr,
                 "strata: io_uring backend destroyed with %zu requests it cannot wait "
                 "for (%s); leaking the ring\n",
                 inflight_, first.ToString().c_str());
    return;
  }
  io_uring_queue_exit(&ring_);
}

void UringBackend::AddNote(const std::string& line) {
  if (!note_.empty()) note_ += "; ";
  note_ += line;
}

Status UringBackend::RegisterFile(int fd, std::string_view path) {
  STRATA_RETURN_IF_ERROR(IoBackend::RegisterFile(fd, path));
  if (!files_registered_ || fixed_files_.count(fd) != 0 || free_file_slots_.empty()) {
    return Status::OK();
  }
  unsigned idx = free_file_slots_.back();
  int ret = io_uring_register_files_update(&ring_, idx, &fd, 1);
  if (ret < 0) {
    AddNote("fixed file refused for '" + std::string(path) + "' (" +
            UringError(ret, "io_uring_register_files_update").ToString() + ")");
    return Status::OK();  // plain fd IO still works
  }
  free_file_slots_.pop_back();
  fixed_files_[fd] = idx;
  return Status::OK();
}

void UringBackend::UnregisterFile(int fd) {
  auto it = fixed_files_.find(fd);
  if (it != fixed_files_.end()) {
    int none = -1;
    (void)io_uring_register_files_update(&ring_, it->second, &none, 1);
    free_file_slots_.push_back(it->second);
    fixed_files_.erase(it);
  }
  IoBackend::UnregisterFile(fd);
}

// A buffer larger than the kernel's 1 GiB per fixed buffer is registered as consecutive
// pieces; a request that straddles two pieces simply goes out unregistered.
Status UringBackend::RegisterBuffer(void* base, size_t size_bytes) {
  if (!buffers_table_) return Status::Unavailable("io_uring fixed buffers unavailable: " + note_);
  if (size_bytes == 0) return Status::InvalidArgument("io_uring fixed buffer of 0 bytes");
  const uintptr_t start = reinterpret_cast<uintptr_t>(base);
  if (buffers_.count(start) != 0) {
    return Status::InvalidArgument("io_uring fixed buffer at this address already registered");
  }
  const size_t pieces = (size_bytes + kMaxFixedBufferBytes - 1) / kMaxFixedBufferBytes;
  if (free_buffer_slots_.size() < pieces) {
    return Status::ResourceExhausted("io_uring fixed buffer table full (" +
                                     std::to_string(kMaxFixedBuffers) + " entries)");
  }
  for (size_t off = 0; off < size_bytes; off += kMaxFixedBufferBytes) {
    const size_t len = std::min(kMaxFixedBufferBytes, size_bytes - off);
    const unsigned idx = free_buffer_slots_.back();
    iovec iov{reinterpret_cast<void*>(start + off), len};
    __u64 tag = 0;
    int ret = io_uring_register_buffers_update_tag(&ring_, idx, &iov, &tag, 1);
    if (ret < 0) {
      UnregisterBuffer(base);  // the pieces registered so far
      return Status::Unavailable(UringError(ret, "io_uring_register_buffers_update_tag").message());
    }
    free_buffer_slots_.pop_back();
    buffers_[start + off] = RegisteredBuffer{len, idx, start};
  }
  return Status::OK();
}

void UringBackend::UnregisterBuffer(void* base) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(base);
  auto it = buffers_.find(start);
  while (it != buffers_.end() && it->second.group_base == start) {
    iovec iov{nullptr, 0};
    __u64 tag = 0;
    (void)io_uring_register_buffers_update_tag(&ring_, it->second.index, &iov, &tag, 1);
    free_buffer_slots_.push_back(it->second.index);
    it = buffers_.erase(it);
  }
}

// Each slot has at most one SQE outstanding and the SQ holds >= queue_depth entries, so an SQE
// is always free; running out means that bookkeeping broke.
io_uring_sqe* UringBackend::GetSqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  assert(sqe != nullptr && "io_uring SQ full although every slot has at most one SQE");
  if (sqe == nullptr) {  // release builds: hand the SQ to the kernel and take a fresh one
    (void)io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
  }
  if (sqe == nullptr) {
    std::fprintf(stderr, "strata: io_uring SQ full with %zu slots in use\n", in_kernel_);
    std::abort();  // a programmer error: continuing would lose a request
  }
  return sqe;
}

void UringBackend::Prep(size_t slot) {
  const IoProgress& p = slots_[slot].progress;
  const IoRequest& r = p.request;
  io_uring_sqe* sqe = GetSqe();
  ++in_kernel_;
  const unsigned len = static_cast<unsigned>(std::min(p.remaining_bytes(), kMaxSqeBytes));
  int fd = r.fd;
  bool fixed_file = false;
  if (auto f = fixed_files_.find(r.fd); f != fixed_files_.end()) {
    fd = static_cast<int>(f->second);
    fixed_file = true;
  }
  int buf_index = -1;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p.next_buffer());
  if (!buffers_.empty()) {
    auto it = buffers_.upper_bound(addr);
    if (it != buffers_.begin()) {
      --it;
      if (addr + len <= it->first + it->second.size_bytes)
        buf_index = static_cast<int>(it->second.index);
    }
  }
  if (r.op == IoOp::kRead) {
    if (buf_index >= 0) {
      io_uring_prep_read_fixed(sqe, fd, p.next_buffer(), len, p.next_offset(), buf_index);
    } else {
      io_uring_prep_read(sqe, fd, p.next_buffer(), len, p.next_offset());
    }
  } else {
    if (buf_index >= 0) {
      io_uring_prep_write_fixed(sqe, fd, p.next_buffer(), len, p.next_offset(), buf_index);
    } else {
      io_uring_prep_write(sqe, fd, p.next_buffer(), len, p.next_offset());
    }
  }
  if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data64(sqe, slot);
}

Status UringBackend::Submit(std::span<const IoRequest> batch) {
  for (const IoRequest& r : batch) STRATA_RETURN_IF_ERROR(ValidateRequest(r));
  if (inflight_ + batch.size() > slots_.size()) {
    return Status::ResourceExhausted("io_uring backend: " + std::to_string(inflight_) +
                                     " in flight + " + std::to_string(batch.size()) +
                                     " submitted > queue depth " + std::to_string(slots_.size()));
  }
  if (batch.empty()) return Status::OK();
  for (const IoRequest& r : batch) {
    size_t slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[slot].used = true;
    slots_[slot].progress = IoProgress{r};
    Prep(slot);
  }
  int ret = 0;
  if (faults_ && faults_->submit_result && (ret = faults_->submit_result()) < 0) {
    // What a failed io_uring_enter leaves behind: the SQ tail published, nothing consumed.
    ring_.sq.sqe_head = ring_.sq.sqe_tail;
    io_uring_smp_store_release(ring_.sq.ktail, ring_.sq.sqe_tail);
  } else {
    ret = io_uring_submit(&ring_);
  }
  // Transient refusals leave the SQEs queued; Reap submits them. The requests are accepted.
  if (ret >= 0 || Transient(ret)) {
    inflight_ += batch.size();
    return Status::OK();
  }
  // A hard error: the batch must not go out later (all or nothing). Take its SQEs back and
  // free its slots; SQEs queued before it (re-issues) stay and go out with the next entry.
  if (!RetractSqes(static_cast<unsigned>(batch.size()))) {
    inflight_ += batch.size();  // already consumed (SQPOLL): they complete normally
    return Status::OK();
  }
  in_kernel_ -= batch.size();
  for (size_t i = 0; i < batch.size(); ++i) {  // the retracted SQEs name the batch's slots
    const io_uring_sqe& sqe = ring_.sq.sqes[(ring_.sq.sqe_tail + i) & ring_.sq.ring_mask];
    const size_t slot = static_cast<size_t>(sqe.user_data);
    slots_[slot].used = false;
    free_slots_.push_back(slot);
  }
  return UringError(ret, "io_uring_submit");
}

bool UringBackend::RetractSqes(unsigned n) {
  if ((ring_.flags & IORING_SETUP_SQPOLL) != 0) return false;
  io_uring_sq& sq = ring_.sq;
  const unsigned ktail = *sq.ktail;
  const unsigned khead = io_uring_smp_load_acquire(sq.khead);
  if (sq.sqe_tail != ktail || ktail - khead < n) return false;
  sq.sqe_tail -= n;
  sq.sqe_head = sq.sqe_tail;
  io_uring_smp_store_release(sq.ktail, sq.sqe_tail);
  return true;
}

Result<size_t> UringBackend::DrainCqes() {
  size_t seen = 0;
  io_uring_cqe* cqe = nullptr;
  while (io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe != nullptr) {
    const size_t slot = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
    int res = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    if (slot >= slots_.size() || !slots_[slot].used) {
      return Status::Internal("io_uring CQE for unknown slot " + std::to_string(slot));
    }
    --in_kernel_;
    IoProgress& p = slots_[slot].progress;
    if (faults_ && faults_->cqe_res) res = faults_->cqe_res(p.request, p.done_bytes, res);
    Status error;
    const IoProgress::Next next = p.Advance(res, FileName(p.request.fd), &error);
    if (!(next == IoProgress::Next::kReissue && p.last_was_eagain)) ++seen;
    switch (next) {
      case IoProgress::Next::kReissue:
        if (p.last_was_eagain) {
          deferred_.push_back(Deferred{slot, NowNs() + RetryBackoffNs(p.retries)});
        } else {
          Prep(slot);
        }
        continue;
      case IoProgress::Next::kDone:
        ready_.push_back(p.Complete(Status::OK()));
        break;
      case IoProgress::Next::kFailed:
        ready_.push_back(p.Complete(std::move(error)));
        break;
    }
    slots_[slot].used = false;
    free_slots_.push_back(slot);
  }
  return seen;
}

void UringBackend::ReissueDeferred(size_t first_n) {
  if (deferred_.empty()) return;
  const uint64_t now = NowNs();
  size_t keep = 0;
  for (size_t i = 0; i < deferred_.size(); ++i) {
    const Deferred d = deferred_[i];
    if (i < first_n || d.not_before_ns <= now) {
      Prep(d.slot);
    } else {
      deferred_[keep++] = d;
    }
  }
  deferred_.resize(keep);
}

Status UringBackend::Enter(unsigned wait_nr) {
  int ret = 0;
  if (faults_ && faults_->enter_result && (ret = faults_->enter_result()) < 0) {
    // injected failure
  } else if (wait_nr == 0) {
    // DEFER_TASKRUN posts completions only when we enter the kernel: do so even to poll.
    ret = io_uring_submit_and_get_events(&ring_);
  } else {
    ret = io_uring_submit_and_wait(&ring_, wait_nr);
  }
  if (ret < 0 && !Transient(ret)) return UringError(ret, "io_uring_enter");
  return Status::OK();
}

// One pass: enter the kernel (submitting re-issues, collecting completions), handle the CQEs,
// re-issue EAGAIN-parked slots once another completion came or their backoff passed, and wait
// for one more completion until `want` are ready. When only parked slots are left, sleep out the
// earliest backoff instead of waiting on a ring that has nothing to complete.
Result<size_t> UringBackend::Reap(std::span<IoCompletion> out, size_t min_complete) {
  const size_t want = std::min(min_complete, inflight_);
  if (ready_.size() < want || ready_.empty() || io_uring_sq_ready(&ring_) > 0) {
    STRATA_RETURN_IF_ERROR(Enter(0));
  }
  for (;;) {
    const size_t parked_before = deferred_.size();
    STRATA_ASSIGN_OR_RETURN(size_t seen, DrainCqes());
    // A completion other than a new EAGAIN frees the device a little: retry the older parked.
    ReissueDeferred(seen > 0 ? parked_before : 0);
    if (ready_.size() >= want) break;
    if (in_kernel_ == 0 && !deferred_.empty()) {
      uint64_t earliest = deferred_.front().not_before_ns;
      for (const Deferred& d : deferred_) earliest = std::min(earliest, d.not_before_ns);
      const uint64_t now = NowNs();
      if (earliest > now) std::this_thread::sleep_for(std::chrono::nanoseconds(earliest - now));
      ReissueDeferred(deferred_.size());
    }
    STRATA_RETURN_IF_ERROR(Enter(1));
  }
  if (io_uring_sq_ready(&ring_) > 0) {  // re-issued remainders go out now, not at the next call
    STRATA_RETURN_IF_ERROR(Enter(0));
  }
  const size_t n = std::min(out.size(), ready_.size());
  for (size_t i = 0; i < n; ++i) out[i] = ready_.pop_front();
  inflight_ -= n;
  return n;
}

}  // namespace strata::nvme
