#include "gpu/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <mutex>
#include <thread>

#include "gpu/cuda_check.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

Status NcclStatus(ncclResult_t r, const std::string& what, ncclComm_t comm) {
  std::string msg = what + ": " + ncclGetErrorString(r);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') msg += " (" + std::string(last) + ")";
  }
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return Status::InvalidArgument(msg);
  if (r == ncclRemoteError || r == ncclSystemError) return Status::Unavailable(msg);
  return Status::Internal(msg);
}

// A failed NCCL call (anything but success or, for non-blocking communicators, in progress)
// becomes a Status naming the call and place, with the communicator's last error when given.
#define STRATA_NCCL_RETURN(call, comm)                                                          \
  do {                                                                                          \
    const ncclResult_t r_ = (call);                                                             \
    if (r_ != ncclSuccess && r_ != ncclInProgress) {                                            \
      return NcclStatus(                                                                        \
          r_, std::string(#call) + " at " + __FILE__ + ":" + std::to_string(__LINE__), (comm)); \
    }                                                                                           \
  } while (0)

ncclDataType_t ToNccl(DType t) {
  switch (t) {
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI8:
      return ncclInt8;
    default:
      return ncclFloat32;
  }
}

// Shared by the communicator and its handles: the comm, its health, one mutex over both.
struct NcclState {
  std::mutex mu;
  ncclComm_t comm = nullptr;
  bool aborted = false;
  Status failed;  // first error; OK while healthy
  std::string name;

  // Aborts once and records `why`. REQUIRES: mu held.
  void AbortLocked(Status why) {
    if (failed.ok()) failed = std::move(why);
    if (!aborted && comm != nullptr) {
      ncclCommAbort(comm);
      aborted = true;
    }
  }

  // Polls the async state until not in progress; aborts on error or at the deadline.
  // REQUIRES: mu held.
  Status PollLocked(const std::string& what, Clock::time_point deadline) {
    auto sleep = std::chrono::microseconds(20);
    while (true) {
      if (!failed.ok())
        return Status::Aborted(what + ": communicator failed earlier: " + failed.ToString());
      ncclResult_t async = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
      if (r != ncclSuccess) async = r;
      if (async == ncclSuccess) return Status::OK();
      if (async != ncclInProgress) {
        Status st = NcclStatus(async, what + " (" + name + ")", comm);
        AbortLocked(st);
        return st;
      }
      if (Clock::now() >= deadline) {
        Status st = Status::DeadlineExceeded(what + " (" + name +
                                             ") still in progress at the deadline; communicator "
                                             "aborted (a peer may have died or never joined)");
        AbortLocked(st);
        return st;
      }
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
    }
  }
};

class NcclWork final : public CommWork {
 public:
  NcclWork(std::shared_ptr<NcclState> state, cudaEvent_t ev, std::string what)
      : state_(std::move(state)), ev_(ev), what_(std::move(what)) {}
  ~NcclWork() override { cudaEventDestroy(ev_); }

  // Lifecycle: the event was recorded after the collective on the comm's stream. Completion is
  // the event; failure is an NCCL async error (a dead peer) or the caller's deadline, both of
  // which abort the communicator so that the stream's kernels return instead of spinning.
  Status WaitUntil(Clock::time_point deadline) override {
    auto sleep = std::chrono::microseconds(10);
    while (true) {
      {
        std::lock_guard<std::mutex> lock(state_->mu);
        if (done_) return result_;
        const cudaError_t q = cudaEventQuery(ev_);
        if (q == cudaSuccess) return Finish(Status::OK());
        if (q != cudaErrorNotReady) {
          return Finish(CudaStatus(q, "cudaEventQuery", __FILE__, __LINE__).WithContext(what_));
        }
        if (!state_->failed.ok()) {
          return Finish(Status::Aborted(what_ + ": " + state_->failed.ToString()));
        }
        ncclResult_t async = ncclSuccess;
        const ncclResult_t query = ncclCommGetAsyncError(state_->comm, &async);
        if (query != ncclSuccess) async = query;  // cannot even ask: treat as the error
        if (async != ncclSuccess && async != ncclInProgress) {
          Status st = NcclStatus(async, what_ + " (" + state_->name + ")", state_->comm);
          state_->AbortLocked(st);
          return Finish(st);
        }
        if (Clock::now() >= deadline) {
          Status st = Status::DeadlineExceeded(what_ + " (" + state_->name +
                                               ") not finished by the deadline; communicator "
                                               "aborted");
          state_->AbortLocked(st);
          return Finish(st);
        }
      }
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(500));
    }
  }

  bool Ready() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    return done_ || cudaEventQuery(ev_) != cudaErrorNotReady;
  }

 private:
  Status Finish(Status st) {
    done_ = true;
    result_ = st;
    return st;
  }
  std::shared_ptr<NcclState> state_;
  cudaEvent_t ev_;
  const std::string what_;
  bool done_ = false;  // guarded by state_->mu
  Status result_;
};

Result<std::unique_ptr<Communicator>> WrapComm(const NcclCommOptions& o,
                                               std::shared_ptr<NcclState> state);

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclCommOptions& o, std::shared_ptr<NcclState> st, cudaStream_t stream,
                   float* scratch)
      : Communicator(o.rank, o.world_size),
        opts_(o),
        state_(std::move(st)),
        stream_(stream),
        scratch_(scratch) {
    // NCCL's kernels are opaque (and reduce 16-bit data natively): wire figures are the ideal ones.
    wire_bytes_are_ideal_ = true;
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (!state_->aborted) {
        for (auto& op : premul_) {
          if (op.created) ncclRedOpDestroy(op.op, state_->comm);
        }
        // Flush in-flight work, bounded by the timeout (PollLocked aborts past it).
        const ncclResult_t fr = ncclCommFinalize(state_->comm);
        if (fr != ncclSuccess && fr != ncclInProgress) {
          state_->AbortLocked(NcclStatus(fr, "ncclCommFinalize", state_->comm));
        } else {
          state_->PollLocked("ncclCommFinalize", Clock::now() + opts_.timeout).IgnoreError();
        }
        if (!state_->aborted) ncclCommDestroy(state_->comm);
      }
      // Handles that outlive the communicator see this instead of a dangling comm.
      if (state_->failed.ok()) state_->failed = Status::Aborted("communicator destroyed");
      state_->comm = nullptr;
    }
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }

  std::string_view backend() const noexcept override { return "nccl"; }

  void Abort(std::string_view reason) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->AbortLocked(Status::Aborted("communicator aborted: " + std::string(reason)));
  }

  Status InitPreMulOps() {
    std::lock_guard<std::mutex> lock(state_->mu);
    const float inv = 1.0f / static_cast<float>(world_size());
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      PreMul& p = premul_[static_cast<size_t>(t)];
      uint16_t bits16 = t == DType::kBF16 ? FloatToBf16(inv).bits : FloatToHalf(inv).bits;
      void* scalar = t == DType::kF32 ? static_cast<void*>(const_cast<float*>(&inv))
                                      : static_cast<void*>(&bits16);
      STRATA_NCCL_RETURN(
          ncclRedOpCreatePreMulSum(&p.op, scalar, ToNccl(t), ncclScalarHostImmediate, state_->comm),
          state_->comm);
      STRATA_RETURN_IF_ERROR(
          state_->PollLocked("ncclRedOpCreatePreMulSum", Clock::now() + opts_.timeout));
      p.created = true;
    }
    return Status::OK();
  }

 protected:
  Result<CommHandle> DoAllGather(std::span<const AllGatherPart> parts, DType dtype) override {
    return Enqueue(
        "all_gather",
        [&](ncclComm_t c) {
          for (const auto& p : parts) {
            const ncclResult_t r =
                ncclAllGather(p.send, p.recv, p.send_count, ToNccl(dtype), c, stream_);
            if (r != ncclSuccess && r != ncclInProgress) return r;
          }
          return ncclSuccess;
        },
        parts.size() > 1);
  }

  Result<CommHandle> DoReduceScatter(std::span<const ReduceScatterPart> parts, DType dtype,
                                     ReduceOptions o) override {
    const ncclRedOp_t op = OpFor(dtype, o);
    return Enqueue(
        "reduce_scatter",
        [&](ncclComm_t c) {
          for (const auto& p : parts) {
            const ncclResult_t r =
                ncclReduceScatter(p.send, p.recv, p.recv_count, ToNccl(dtype), op, c, stream_);
            if (r != ncclSuccess && r != ncclInProgress) return r;
          }
          return ncclSuccess;
        },
        parts.size() > 1);
  }

  Result<CommHandle> DoAllReduce(const void* send, void* recv, size_t count, DType dtype,
                                 ReduceOptions o) override {
    const ncclRedOp_t op = OpFor(dtype, o);
    return Enqueue(
        "all_reduce",
        [&](ncclComm_t c) {
          return ncclAllReduce(send, recv, count, ToNccl(dtype), op, c, stream_);
        },
        false);
  }

  Result<CommHandle> DoBroadcast(void* buf, size_t count, DType dtype, int root) override {
    return Enqueue(
        "broadcast",
        [&](ncclComm_t c) {
          return ncclBroadcast(buf, buf, count, ToNccl(dtype), root, c, stream_);
        },
        false);
  }

  Result<CommHandle> DoAllToAll(const void* send, void* recv, size_t count, DType dtype) override {
    const size_t chunk = count * DTypeSize(dtype);
    const int n = world_size();
    return Enqueue(
        "all_to_all",
        [&](ncclComm_t c) {
          // Grouped point-to-point (NCCL's own ncclAlltoAll is 2.28+ only): one send and one
          // receive per peer, the own chunk included (NCCL copies it locally).
          for (int j = 0; j < n; ++j) {
            const auto* s = static_cast<const uint8_t*>(send) + static_cast<size_t>(j) * chunk;
            auto* d = static_cast<uint8_t*>(recv) + static_cast<size_t>(j) * chunk;
            ncclResult_t r = ncclSend(s, count, ToNccl(dtype), j, c, stream_);
            if (r != ncclSuccess && r != ncclInProgress) return r;
            r = ncclRecv(d, count, ToNccl(dtype), j, c, stream_);
            if (r != ncclSuccess && r != ncclInProgress) return r;
          }
          return ncclSuccess;
        },
        true);
  }

  // ncclCommSplit (collective on this communicator), polled like initialisation; the new
  // communicator gets its own stream, scratch and pre-division ops (1 / its world size).
  Result<std::unique_ptr<Communicator>> DoSplit(int color, int key) override {
    auto st = std::make_shared<NcclState>();
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      const std::string what =
          "nccl split #" + std::to_string(seq_++) + " (color " + std::to_string(color) + ")";
      if (!state_->failed.ok()) {
        return Status::Aborted(what +
                               ": communicator failed earlier: " + state_->failed.ToString());
      }
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      const ncclResult_t r = ncclCommSplit(state_->comm, color, key, &st->comm, &config);
      if (r != ncclSuccess && r != ncclInProgress) {
        Status err = NcclStatus(r, what + " (" + state_->name + ")", state_->comm);
        state_->AbortLocked(err);
        return err;
      }
      STRATA_RETURN_IF_ERROR(state_->PollLocked(what, Clock::now() + opts_.timeout));
      std::lock_guard<std::mutex> sub_lock(st->mu);
      Status sub = st->comm == nullptr ? Status::Internal(what + ": no communicator returned")
                                       : st->PollLocked(what, Clock::now() + opts_.timeout);
      if (!sub.ok()) {
        state_->AbortLocked(sub);  // the peers of this split wait in it: fail them too
        return sub;
      }
    }
    NcclCommOptions o = opts_;
    int sub_rank = 0, sub_size = 1;
    STRATA_NCCL_RETURN(ncclCommUserRank(st->comm, &sub_rank), st->comm);
    STRATA_NCCL_RETURN(ncclCommCount(st->comm, &sub_size), st->comm);
    o.rank = sub_rank;
    o.world_size = sub_size;
    o.unique_id.clear();
    o.store = nullptr;
    st->name = "rank " + std::to_string(sub_rank) + " of " + std::to_string(sub_size) +
               " on device " + std::to_string(o.device) + ", split color " + std::to_string(color);
    return WrapComm(o, std::move(st));
  }

  Result<CommHandle> DoBarrier() override {
    return Enqueue(
        "barrier",
        [&](ncclComm_t c) {
          return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, c, stream_);
        },
        false);
  }

 private:
  struct PreMul {
    ncclRedOp_t op{};
    bool created = false;
  };

  ncclRedOp_t OpFor(DType t, ReduceOptions o) const {
    return o.predivide ? premul_[static_cast<size_t>(t)].op : ncclSum;
  }

  template <typename Fn>
  Result<CommHandle> Enqueue(const char* kind, Fn&& fn, bool group) {
    std::lock_guard<std::mutex> lock(state_->mu);
    const std::string what = std::string("nccl ") + kind + " #" + std::to_string(seq_++);
    if (!state_->failed.ok()) {
      return Status::Aborted(what + ": communicator failed earlier: " + state_->failed.ToString());
    }
    const auto deadline = Clock::now() + opts_.timeout;
    if (group) STRATA_NCCL_RETURN(ncclGroupStart(), state_->comm);
    ncclResult_t r = fn(state_->comm);
    if (group) {
      const ncclResult_t e = ncclGroupEnd();
      if (r == ncclSuccess || r == ncclInProgress) r = e;
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      Status st = NcclStatus(r, what + " (" + state_->name + ")", state_->comm);
      state_->AbortLocked(st);
      return st;
    }
    STRATA_RETURN_IF_ERROR(state_->PollLocked(what, deadline));
    cudaEvent_t ev = nullptr;
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    const cudaError_t rec = cudaEventRecord(ev, stream_);
    if (rec != cudaSuccess) {
      cudaEventDestroy(ev);
      return CudaStatus(rec, "cudaEventRecord", __FILE__, __LINE__);
    }
    return CommHandle(std::make_shared<NcclWork>(state_, ev, what));
  }

  const NcclCommOptions opts_;
  std::shared_ptr<NcclState> state_;
  cudaStream_t stream_;
  float* scratch_;  // one device float for the barrier
  PreMul premul_[3];
  uint64_t seq_ = 0;
};

// The communicator around an initialised NCCL comm: its stream, barrier scratch and pre-division
// ops. On failure the comm is aborted.
Result<std::unique_ptr<Communicator>> WrapComm(const NcclCommOptions& o,
                                               std::shared_ptr<NcclState> state) {
  cudaStream_t stream = nullptr;
  float* scratch = nullptr;
  cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaMalloc(reinterpret_cast<void**>(&scratch), sizeof(float));
  if (e != cudaSuccess) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->AbortLocked(Status::Aborted("setup failed"));
    if (stream != nullptr) cudaStreamDestroy(stream);
    return CudaStatus(e, "cudaStreamCreate/cudaMalloc", __FILE__, __LINE__);
  }
  auto comm = std::make_unique<NcclCommunicator>(o, std::move(state), stream, scratch);
  STRATA_RETURN_IF_ERROR(comm->InitPreMulOps());
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace

Result<std::vector<uint8_t>> NewNcclUniqueId() {
  ncclUniqueId id;
  STRATA_NCCL_RETURN(ncclGetUniqueId(&id), nullptr);
  return std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                              reinterpret_cast<uint8_t*>(&id) + sizeof(id));
}

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclCommOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return Status::InvalidArgument("nccl: rank " + std::to_string(o.rank) +
                                   " not in [0, world_size=" + std::to_string(o.world_size) + ")");
  }
  if (o.timeout.count() <= 0) return Status::InvalidArgument("nccl: timeout must be > 0");
  int count = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (o.device < 0 || o.device >= count) {
    return Status::InvalidArgument("nccl: device " + std::to_string(o.device) + " not in [0, " +
                                   std::to_string(count) + ")");
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(o.device));

  std::vector<uint8_t> uid = o.unique_id;
  // Exchanged through the store: more than one rank and no id given.
  const bool exchanged = uid.empty() && o.world_size > 1;
  if (uid.empty() && !exchanged) {
    STRATA_ASSIGN_OR_RETURN(uid, NewNcclUniqueId());  // one rank: its own id, nothing to share
  } else if (exchanged) {
    if (o.store == nullptr) {
      return Status::InvalidArgument("nccl: neither a unique_id nor a rendezvous store given");
    }
    if (o.rank == 0) {
      STRATA_ASSIGN_OR_RETURN(uid, NewNcclUniqueId());
      STRATA_RETURN_IF_ERROR(o.store->Set(o.store_key, uid));
    } else {
      STRATA_ASSIGN_OR_RETURN(uid, o.store->Get(o.store_key, o.timeout));
    }
  }
  ncclUniqueId id;
  if (uid.size() != sizeof(id)) {
    return Status::InvalidArgument("nccl: unique_id has " + std::to_string(uid.size()) +
                                   " bytes, expected " + std::to_string(sizeof(id)));
  }
  std::memcpy(&id, uid.data(), sizeof(id));

  auto state = std::make_shared<NcclState>();
  state->name = "rank " + std::to_string(o.rank) + " of " + std::to_string(o.world_size) +
                " on device " + std::to_string(o.device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommInitRankConfig(&state->comm, o.world_size, id, o.rank, &config);
  {
    std::lock_guard<std::mutex> lock(state->mu);
    if (r != ncclSuccess && r != ncclInProgress) {
      Status st = NcclStatus(r, "ncclCommInitRankConfig (" + state->name + ")", state->comm);
      if (state->comm != nullptr) state->AbortLocked(st);
      return st;
    }
    STRATA_RETURN_IF_ERROR(state->PollLocked("ncclCommInitRankConfig", Clock::now() + o.timeout));
  }
  // Initialisation is collective: once it finished every rank has read the id, so rank 0 removes
  // it and a store directory reused by a later run cannot hand out this stale id.
  if (exchanged && o.rank == 0) {
    (void)o.store->Delete(o.store_key);  // best effort: keys are also scoped by run id
  }
  return WrapComm(o, std::move(state));
}

}  // namespace strata
