// CudaDevice: the Device contract (include/strata/device.h) on a CUDA GPU.
//
// Memory: an own cudaMemPool_t on the device, its release threshold set to the budget so freed
// blocks stay cached; the budget itself is enforced here by byte accounting. Free is
// stream-ordered: a private `free_` stream waits on events recorded on both copy streams and the
// kernels' stream, then cudaFreeAsync, so memory is never reused before earlier copies and
// kernels finish (nor, after a WaitCallerStream on any of them, before the caller's work), and
// the caller never blocks. Allocation runs on another private stream, `alloc_`, synchronized
// right away, which makes the pointer usable on every stream. That wait is short because
// `alloc_` carries nothing but allocations and the pool may not make it wait for a free in
// flight (cudaMemPoolReuseAllowInternalDependencies off): it reuses only blocks whose free has
// run. Allocate waits for the frees in flight (`free_`) only where the live bytes and those
// still being freed would pass the budget together (so the pool, which holds both, stays within
// it), or where the device is out of memory (then it tries once more). With one stream for both,
// every Allocate after a Free waited for all the device work queued before that Free, the
// trainer's included: the engine allocates per group per step, so the host ran in lockstep with
// the GPU.
// Copies: one non-blocking stream per direction; completion callbacks through cudaLaunchHostFunc
// (the callback must not call CUDA, as the contract already requires).
// Kernels (Device::kernels): kernels/cuda_kernels.h's kernels enqueued on a third non-blocking
// stream, `compute_`.
// A caller's stream (OrderCallerStream / WaitCallerStream): events between it and the copy and
// compute streams named (DeviceQueue bits), in the direction asked; the host never waits.
// Errors: every runtime call goes through STRATA_CUDA_STATUS; nothing aborts.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <span>
#include <thread>
#include <unordered_map>
#include <utility>

#include "gpu/cuda_check.h"
#include "kernels/cuda_kernels.h"
#include "strata/device.h"
#include "strata/device_kernels.h"

namespace strata {
namespace {

// Polls `query` (cudaErrorNotReady: not yet) with a backoff, sleeping, not spinning, until it
// reports completion or an error (named `what`), or `timeout` passes (DeadlineExceeded).
template <class Query>
Status PollUntilDone(Query query, std::chrono::nanoseconds timeout, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto nap = std::chrono::microseconds(5);
  for (;;) {
    const cudaError_t err = query();
    if (err != cudaErrorNotReady) return CudaStatus(err, what, __FILE__, __LINE__);
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::DeadlineExceeded(std::string("CudaDevice: ") + what + " timed out");
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
}

class CudaEvent final : public DeviceEvent {
 public:
  CudaEvent(int ordinal, cudaEvent_t e) : ordinal_(ordinal), e_(e) {}
  ~CudaEvent() override {
    cudaSetDevice(ordinal_);
    cudaEventDestroy(e_);
  }
  Result<bool> Query() override {
    cudaError_t err = cudaEventQuery(e_);
    if (err == cudaErrorNotReady) return false;
    STRATA_RETURN_IF_ERROR(STRATA_CUDA_STATUS(err));
    return true;
  }
  // cudaEventSynchronize has no deadline: poll instead.
  Status Wait(std::chrono::nanoseconds timeout) override {
    const cudaEvent_t e = e_;
    return PollUntilDone([e] { return cudaEventQuery(e); }, timeout, "cudaEventQuery (event wait)");
  }

 private:
  int ordinal_;
  cudaEvent_t e_;
};

// The device's kernels (strata/device_kernels.h): cuda_kernels.h on the compute stream.
class CudaKernels final : public kernels::DeviceKernels {
 public:
  CudaKernels(int ordinal, const cudaStream_t* stream) : ordinal_(ordinal), stream_(stream) {}
  Status AdamStep(const kernels::AdamHyper& hyper, const kernels::AdamShard& shard) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    return kernels::CudaAdamStep(hyper, shard, *stream_);
  }
  Status AccumulateGrad(float* acc, const void* grad, DType grad_dtype, float scale, bool overwrite,
                        size_t n) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    return kernels::CudaAccumulateGrad(acc, grad, grad_dtype, scale, overwrite, n, *stream_);
  }
  Status ChunkSumSquares(const void* grad, DType dtype, size_t n, double* chunk_sums,
                         bool* nonfinite) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    return kernels::CudaChunkSumSquares(grad, dtype, n, chunk_sums, nonfinite, *stream_);
  }
  Status Cast(const void* in, DType in_dtype, void* out, DType out_dtype, size_t n) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    return kernels::CudaCast(in, in_dtype, out, out_dtype, n, *stream_);
  }
  Status Zero(void* ptr, uint64_t bytes) override {
    if (bytes > 0 && ptr == nullptr) return Status::InvalidArgument("Zero: null pointer");
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr, 0, bytes, *stream_));
    return Status::OK();
  }
  Status Synchronize(std::chrono::nanoseconds timeout) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    const cudaStream_t s = *stream_;
    return PollUntilDone([s] { return cudaStreamQuery(s); }, timeout,
                         "cudaStreamQuery (kernel synchronize)");
  }

 private:
  const int ordinal_;
  const cudaStream_t* stream_;  // CudaDevice::compute_, created before any call
};

// Work queued on each of `waiters` from now on runs after the work queued on `on` so far: one
// event recorded on `on` that they wait for (the host does not).
Status StreamsWait(std::span<const cudaStream_t> waiters, cudaStream_t on) {
  cudaEvent_t e;
  STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  Status st = STRATA_CUDA_STATUS(cudaEventRecord(e, on));
  for (size_t i = 0; st.ok() && i < waiters.size(); ++i) {
    st = STRATA_CUDA_STATUS(cudaStreamWaitEvent(waiters[i], e, 0));
  }
  cudaEventDestroy(e);  // released once complete; the waits already captured it
  return st;
}

void CUDART_CB RunCallback(void* arg) {
  auto* cb = static_cast<CopyCallback*>(arg);
  (*cb)(Status::OK());
  delete cb;
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::string name, uint64_t budget)
      : ordinal_(ordinal), name_(std::move(name)), budget_(budget), kernels_(ordinal, &compute_) {}

  Status Init() {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    for (cudaStream_t* s : {&streams_[0], &streams_[1], &compute_, &alloc_, &free_}) {
      STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
    }
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = ordinal_;
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool_, &props));
    pool_created_ = true;
    uint64_t threshold = budget_;
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
    int wait_for_frees = 0;  // see the file comment
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowInternalDependencies, &wait_for_frees));
    return Status::OK();
  }

  ~CudaDevice() override {
    cudaSetDevice(ordinal_);
    for (cudaStream_t s : {streams_[0], streams_[1], compute_}) {
      if (s) cudaStreamSynchronize(s);
    }
    for (auto& [p, n] : live_) cudaFreeAsync(p, free_);
    for (cudaStream_t s : {alloc_, free_}) {
      if (s) cudaStreamSynchronize(s);
    }
    for (cudaStream_t s : {streams_[0], streams_[1], compute_, alloc_, free_}) {
      if (s) cudaStreamDestroy(s);
    }
    if (pool_created_) cudaMemPoolDestroy(pool_);
  }

  std::string name() const override { return name_; }
  bool host_addressable() const override { return false; }
  kernels::DeviceKernels* kernels() override { return &kernels_; }

  Result<void*> Allocate(uint64_t size_bytes) override {
    if (size_bytes == 0) return Status::InvalidArgument("CudaDevice::Allocate: size 0");
    bool crowded = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (used_ + size_bytes > budget_) {
        return Status::ResourceExhausted("CudaDevice: allocating " + std::to_string(size_bytes) +
                                         " bytes would exceed the budget of " +
                                         std::to_string(budget_));
      }
      used_ += size_bytes;
      peak_ = std::max(peak_, used_);
      // The pool holds the live blocks and those whose free is queued and has not run (it may
      // not reuse them yet): past the budget together, this waits for the frees first, so the
      // pool's memory stays within the budget while the host runs ahead of the device.
      crowded = used_ + freeing_ > budget_;
    }
    void* p = nullptr;
    Status s = STRATA_CUDA_STATUS(cudaSetDevice(ordinal_));
    if (s.ok() && crowded) s = STRATA_CUDA_STATUS(cudaStreamSynchronize(free_));
    if (s.ok()) {
      cudaError_t err = cudaMallocFromPoolAsync(&p, size_bytes, pool_, alloc_);
      if (err == cudaErrorMemoryAllocation) {
        // The room may be in blocks whose free has not run yet: wait for those, then retry.
        (void)cudaGetLastError();
        err = cudaStreamSynchronize(free_);
        if (err == cudaSuccess) err = cudaMallocFromPoolAsync(&p, size_bytes, pool_, alloc_);
      }
      s = STRATA_CUDA_STATUS(err);
    }
    if (s.ok()) s = STRATA_CUDA_STATUS(cudaStreamSynchronize(alloc_));
    std::lock_guard<std::mutex> l(mu_);
    if (!s.ok()) {
      // An out-of-memory stays in CUDA's per-thread last error, where the next launch check on
      // this thread (ours or torch's) would report it for an unrelated kernel.
      (void)cudaGetLastError();
      used_ -= size_bytes;
      return s;
    }
    live_.emplace(p, size_bytes);
    return p;
  }

  Status Free(void* ptr) override {
    uint64_t n;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = live_.find(ptr);
      if (it == live_.end()) return Status::InvalidArgument("CudaDevice::Free: unknown pointer");
      n = it->second;
      live_.erase(it);
      used_ -= n;
    }
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    for (cudaStream_t s : Streams(kEveryQueue).span()) {
      STRATA_RETURN_IF_ERROR(StreamsWait({&free_, 1}, s));
    }
    STRATA_CUDA_RETURN_IF_ERROR(cudaFreeAsync(ptr, free_));
    // Counted until the free has run (a host function behind it on `free_`).
    auto* done = new FreeDone{this, n};
    {
      std::lock_guard<std::mutex> l(mu_);
      freeing_ += n;
    }
    Status st = STRATA_CUDA_STATUS(cudaLaunchHostFunc(free_, &CudaDevice::FreeRan, done));
    if (!st.ok()) {
      delete done;
      std::lock_guard<std::mutex> l(mu_);
      freeing_ -= n;
    }
    return st;
  }

  Status ReleaseCachedMemory(std::chrono::nanoseconds timeout) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    const cudaStream_t s = free_;  // every Free's cudaFreeAsync, after the queues it waited on
    STRATA_RETURN_IF_ERROR(PollUntilDone([s] { return cudaStreamQuery(s); }, timeout,
                                         "cudaStreamQuery (frees before a trim)"));
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemPoolTrimTo(pool_, 0));
    return Status::OK();
  }

  Status CopyAsync(CopyDir dir, void* dst, const void* src, uint64_t size_bytes,
                   CopyCallback done) override {
    cudaStream_t s = streams_[static_cast<int>(dir)];
    cudaMemcpyKind kind =
        dir == CopyDir::kHostToDevice ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, size_bytes, kind, s));
    bytes_[static_cast<int>(dir)].fetch_add(size_bytes, std::memory_order_relaxed);
    copies_[static_cast<int>(dir)].fetch_add(1, std::memory_order_relaxed);
    if (done) {
      auto* cb = new CopyCallback(std::move(done));
      Status st = STRATA_CUDA_STATUS(cudaLaunchHostFunc(s, RunCallback, cb));
      if (!st.ok()) {
        delete cb;
        return st;
      }
    }
    return Status::OK();
  }

  Result<std::unique_ptr<DeviceEvent>> RecordEvent(CopyDir dir) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    cudaEvent_t e;
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    auto ev = std::make_unique<CudaEvent>(ordinal_, e);
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(e, streams_[static_cast<int>(dir)]));
    return std::unique_ptr<DeviceEvent>(std::move(ev));
  }

  Status Synchronize() override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    for (cudaStream_t s : streams_) STRATA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    return Status::OK();
  }

  bool orders_caller_streams() const override { return true; }
  Status OrderCallerStream(uintptr_t stream, uint8_t queues) override {
    STRATA_RETURN_IF_ERROR(CheckQueues(queues));
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    const auto caller = reinterpret_cast<cudaStream_t>(stream);
    for (cudaStream_t s : Streams(queues).span()) {
      STRATA_RETURN_IF_ERROR(StreamsWait({&caller, 1}, s));
    }
    return Status::OK();
  }
  Status WaitCallerStream(uintptr_t stream, uint8_t queues) override {
    STRATA_RETURN_IF_ERROR(CheckQueues(queues));
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    return StreamsWait(Streams(queues).span(), reinterpret_cast<cudaStream_t>(stream));
  }

  Status RegisterHost(void* ptr, uint64_t size_bytes) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    cudaError_t err = cudaHostRegister(ptr, size_bytes, cudaHostRegisterDefault);
    if (err == cudaErrorMemoryAllocation || err == cudaErrorHostMemoryAlreadyRegistered) {
      cudaGetLastError();  // clear the sticky-free error state
      if (err == cudaErrorHostMemoryAlreadyRegistered) return Status::OK();
      return Status::Unavailable("cudaHostRegister refused to page-lock " +
                                 std::to_string(size_bytes) + " bytes (RLIMIT_MEMLOCK?)");
    }
    return STRATA_CUDA_STATUS(err);
  }
  Status UnregisterHost(void* ptr) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    return STRATA_CUDA_STATUS(cudaHostUnregister(ptr));
  }

  DeviceStats stats() const override {
    DeviceStats st;
    std::lock_guard<std::mutex> l(mu_);
    st.budget_bytes = budget_;
    st.used_bytes = used_;
    st.peak_used_bytes = peak_;
    for (int i = 0; i < 2; ++i) {
      st.bytes_copied[i] = bytes_[i].load(std::memory_order_relaxed);
      st.copies[i] = copies_[i].load(std::memory_order_relaxed);
    }
    return st;
  }

 private:
  // The streams of `queues` (DeviceQueue bits: the copy streams by direction and the kernels').
  struct StreamSet {
    cudaStream_t at[3] = {};
    size_t n = 0;
    std::span<const cudaStream_t> span() const { return {at, n}; }
  };
  StreamSet Streams(uint8_t queues) const {
    const std::pair<uint8_t, cudaStream_t> all[] = {
        {kHostToDeviceQueue, streams_[static_cast<size_t>(CopyDir::kHostToDevice)]},
        {kDeviceToHostQueue, streams_[static_cast<size_t>(CopyDir::kDeviceToHost)]},
        {kKernelQueue, compute_}};
    StreamSet out;
    for (const auto& [bit, s] : all) {
      if ((queues & bit) != 0) out.at[out.n++] = s;
    }
    return out;
  }

  const int ordinal_;
  const std::string name_;
  const uint64_t budget_;
  cudaStream_t streams_[2] = {nullptr, nullptr};
  cudaStream_t compute_ = nullptr;  // kernels_ (Device::kernels)
  cudaStream_t alloc_ = nullptr;    // allocations only (see the file comment)
  cudaStream_t free_ = nullptr;     // frees, each after the queues it waits on
  cudaMemPool_t pool_{};
  bool pool_created_ = false;
  // A free queued on `free_`, for its host function (FreeRan) once it has run.
  struct FreeDone {
    CudaDevice* device;
    uint64_t bytes;
  };
  static void CUDART_CB FreeRan(void* arg) {
    auto* d = static_cast<FreeDone*>(arg);
    {
      std::lock_guard<std::mutex> l(d->device->mu_);
      d->device->freeing_ -= d->bytes;
    }
    delete d;
  }

  mutable std::mutex mu_;
  uint64_t used_ = 0;
  uint64_t freeing_ = 0;  // freed bytes whose cudaFreeAsync has not run yet (see Allocate)
  uint64_t peak_ = 0;
  std::unordered_map<void*, uint64_t> live_;
  std::atomic<uint64_t> bytes_[2] = {0, 0};
  std::atomic<uint64_t> copies_[2] = {0, 0};
  CudaKernels kernels_;
};

}  // namespace

Result<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options) {
  int count = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (options.device_ordinal < 0 || options.device_ordinal >= count) {
    return Status::Unavailable("CUDA device " + std::to_string(options.device_ordinal) +
                               " does not exist (" + std::to_string(count) + " found)");
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device_ordinal));
  cudaDeviceProp prop;
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.device_ordinal));
  uint64_t budget = options.budget_bytes;
  if (budget == 0) {
    size_t free_bytes = 0, total = 0;
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total));
    budget = free_bytes / 10 * 9;
  }
  auto dev = std::make_unique<CudaDevice>(
      options.device_ordinal,
      "cuda:" + std::to_string(options.device_ordinal) + " (" + prop.name + ")", budget);
  STRATA_RETURN_IF_ERROR(dev->Init());
  return std::unique_ptr<Device>(std::move(dev));
}

}  // namespace strata
