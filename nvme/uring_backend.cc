#include "nvme/uring_backend.h"

#include <sys/uio.h>

#include <cerrno>

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
}  // namespace

Result<std::unique_ptr<UringBackend>> UringBackend::Open(const IoBackendOptions& options) {
  std::unique_ptr<UringBackend> b(new UringBackend());
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
  while (inflight_ > 0) {
    if (!Reap(sink, 1).ok()) break;  // a broken ring: nothing more can be waited for
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

io_uring_sqe* UringBackend::GetSqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {
    // SQ full of prepared entries: hand them to the kernel and take a fresh one.
    (void)io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
  }
  return sqe;
}

void UringBackend::Prep(size_t slot) {
  const IoProgress& p = slots_[slot].progress;
  const IoRequest& r = p.request;
  io_uring_sqe* sqe = GetSqe();
  // Each slot has at most one SQE outstanding and the SQ holds >= queue_depth entries, so after
  // a submit there is always room.
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
  for (const IoRequest& r : batch) {
    size_t slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[slot].used = true;
    slots_[slot].progress = IoProgress{r};
    Prep(slot);
  }
  inflight_ += batch.size();
  int ret = io_uring_submit(&ring_);
  // Transient refusals leave the SQEs queued; Reap submits them. The requests are accepted.
  if (ret < 0 && ret != -EAGAIN && ret != -EBUSY && ret != -EINTR) {
    return UringError(ret, "io_uring_submit");
  }
  return Status::OK();
}

Status UringBackend::DrainCqes() {
  io_uring_cqe* cqe = nullptr;
  while (io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe != nullptr) {
    const size_t slot = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    if (slot >= slots_.size() || !slots_[slot].used) {
      return Status::Internal("io_uring CQE for unknown slot " + std::to_string(slot));
    }
    IoProgress& p = slots_[slot].progress;
    Status error;
    switch (p.Advance(res, FileName(p.request.fd), &error)) {
      case IoProgress::Next::kReissue:
        Prep(slot);
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
  return Status::OK();
}

Result<size_t> UringBackend::Reap(std::span<IoCompletion> out, size_t min_complete) {
  const size_t want = std::min(min_complete, inflight_);
  if (ready_.size() < want || ready_.empty()) {
    // DEFER_TASKRUN posts completions only when we enter the kernel: do so once even to poll.
    int ret = io_uring_submit_and_get_events(&ring_);
    if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
      return UringError(ret, "io_uring_submit_and_get_events");
    }
  }
  STRATA_RETURN_IF_ERROR(DrainCqes());
  while (ready_.size() < want) {
    int ret = io_uring_submit_and_wait(&ring_, 1);
    if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
      return UringError(ret, "io_uring_submit_and_wait");
    }
    STRATA_RETURN_IF_ERROR(DrainCqes());
  }
  if (io_uring_sq_ready(&ring_) > 0) {  // re-issued remainders go out now, not at the next call
    int ret = io_uring_submit(&ring_);
    if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
      return UringError(ret, "io_uring_submit");
    }
  }
  const size_t n = std::min(out.size(), ready_.size());
  for (size_t i = 0; i < n; ++i) {
    out[i] = std::move(ready_.front());
    ready_.pop_front();
  }
  inflight_ -= n;
  return n;
}

}  // namespace strata::nvme
