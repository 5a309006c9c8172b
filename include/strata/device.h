// Device: the accelerator a trainer computes on, as the tiered store sees it: a budgeted pool of
// device memory, one asynchronous copy stream in each direction (host->device, device->host),
// and events to wait on.
//
// Two implementations:
//   CudaDevice (gpu/, built when STRATA_CUDA=ON): a stream-ordered cudaMallocAsync pool capped at
//     the budget, one non-blocking copy stream per direction, cudaEvent_t events, completion
//     callbacks through cudaLaunchHostFunc. Every CUDA error becomes a Status.
//   HostDevice (cpu/): the CPU stand-in. "Device memory" is host memory under an HBM-sized
//     budget; each stream is a worker thread that runs the copies as real memcpy in FIFO order.
//     The whole store and engine run, and are tested, on machines without a GPU.
//
// Ordering contract (both implementations): copies issued on one stream complete in issue order;
// the two streams are independent. A completion callback runs after the copy's bytes are in
// place and after every earlier copy of the same stream completed. Callbacks run on a thread
// owned by the device: they must be short, must not block on other copies of the same stream,
// and must not call Free/Allocate/CopyAsync/RecordEvent on this device (post work elsewhere).
//
// A trainer's own streams (torch's, on CudaDevice): the engine returns from Gather, GradBuffer,
// ReduceGradients and Step with its device work complete (its streams synchronized, its
// collectives waited for), so the trainer's kernels may read a gathered buffer or write a
// gradient buffer on any stream once the call returns. The other direction is the trainer's:
// its kernels that read a gathered group or write a gradient buffer must have completed before
// it calls Release, ReduceGradients or Step for that memory (the Python adapter waits for an
// event recorded on torch's current stream there, a group later; python/src/engine_binding.cc).
// Where Engine::gathers_alias_home, Release frees nothing and needs no wait. With overlap_comm a
// trainer may hold one gradient buffer back (Engine::GradBuffer), waiting for the event of the
// group before the one its backward now writes, never for its whole stream: the device keeps the
// queued kernels running while the host reduces. Instead of these waits, a trainer may name its
// stream (Engine::GradBuffer / ReduceGradients / Release with a caller stream, at one rank): the
// engine then orders the two sides on the device (OrderCallerStream, WaitCallerStream below) and
// the host waits for none of them.
//
// Host memory handed to CopyAsync should be registered (RegisterHost) on CUDA for the copy to be
// truly asynchronous; HostDevice accepts any host memory.
//
// Thread safety: every method may be called from any thread concurrently, except that Free of a
// pointer must not race with copies that use it (the caller orders them, see Free).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

namespace kernels {
class DeviceKernels;  // strata/device_kernels.h
}  // namespace kernels

// The two copy streams.
enum class CopyDir : uint8_t { kHostToDevice = 0, kDeviceToHost = 1 };

// A device's queues, as bits of a mask: its two copy streams (CopyAsync by direction) and its
// kernels' stream (kernels()). OrderCallerStream / WaitCallerStream order a caller's stream with
// the queues named, no more: a queue ordered needlessly stalls one side's work behind the other's
// (the caller's kernels behind the device's copies, or the copies behind the caller's kernels).
// Name every queue that uses the memory in question, and only those.
enum DeviceQueue : uint8_t {
  kHostToDeviceQueue = 1 << 0,
  kDeviceToHostQueue = 1 << 1,
  kKernelQueue = 1 << 2,
  kEveryQueue = kHostToDeviceQueue | kDeviceToHostQueue | kKernelQueue,
};

constexpr std::string_view CopyDirName(CopyDir d) noexcept {
  return d == CopyDir::kHostToDevice ? "h2d" : "d2h";
}

// Called once when an async copy completes; OK, or the error that failed it.
using CopyCallback = std::function<void(Status)>;

// A point in a stream's order. Complete once every copy issued on that stream before the event
// was recorded has completed. Move-only; owned by whoever recorded it.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // True when complete; an error when the stream failed.
  virtual Result<bool> Query() = 0;
  // Blocks until complete. DeadlineExceeded after `timeout`; the stream's error if it failed.
  virtual Status Wait(std::chrono::nanoseconds timeout) = 0;
};

struct DeviceStats {
  uint64_t budget_bytes = 0;
  uint64_t used_bytes = 0;            // bytes allocated now
  uint64_t peak_used_bytes = 0;       // high-water mark since creation
  uint64_t bytes_copied[2] = {0, 0};  // per CopyDir, completed copies
  uint64_t copies[2] = {0, 0};
};

class Device {
 public:
  virtual ~Device() = default;
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // "cuda:0 (NVIDIA H200)" or "host-standin".
  virtual std::string name() const = 0;
  // True when device pointers are host-addressable (HostDevice): tests and the bandwidth
  // benchmark may then touch device memory directly.
  virtual bool host_addressable() const = 0;

  // Allocates `size_bytes` (> 0) of device memory, aligned to at least 256 bytes.
  // ResourceExhausted when the budget (or, on CUDA, the device) has no room: the caller frees
  // something and retries. InvalidArgument for size 0. The pointer is owned by the caller and
  // returned with Free.
  virtual Result<void*> Allocate(uint64_t size_bytes) = 0;
  // Returns memory from Allocate, stream-ordered and without blocking: the budget is available
  // again at once, the memory is reused only after both streams completed every copy issued
  // before the call, and the kernels (kernels()) every kernel enqueued before it. InvalidArgument
  // for an unknown pointer.
  // REQUIRES: no copy using `ptr` is issued afterwards.
  virtual Status Free(void* ptr) = 0;

  // Queues a copy of `size_bytes` on the stream `dir`: host `src` -> device `dst` for
  // kHostToDevice, device `src` -> host `dst` for kDeviceToHost. Returns once queued;
  // `done` (may be empty) runs when the copy completed. An error returned here means nothing was
  // queued and `done` is not called. REQUIRES: both ranges stay valid until completion.
  virtual Status CopyAsync(CopyDir dir, void* dst, const void* src, uint64_t size_bytes,
                           CopyCallback done) = 0;

  // Records an event on stream `dir` (see DeviceEvent).
  virtual Result<std::unique_ptr<DeviceEvent>> RecordEvent(CopyDir dir) = 0;
  // Blocks until both streams are idle; returns the first stream error, if any.
  virtual Status Synchronize() = 0;

  // A caller's own stream (CUDA: a cudaStream_t as an integer; 0 is the legacy default stream,
  // torch's default), ordered with this device's streams without the host waiting, where
  // orders_caller_streams() (CudaDevice; not HostDevice, whose callers are the host: the engine
  // then waits on the host instead):
  //   OrderCallerStream: work the caller queues on `stream` from now on runs after the work
  //     queued so far on the device's `queues` (DeviceQueue bits; CudaDevice: `stream` waits
  //     for an event on each of those streams).
  //   WaitCallerStream: work queued on the device's `queues` from now on runs after the work
  //     queued on `stream` so far (CudaDevice: each of those streams waits for an event on
  //     `stream`).
  // Free stays safe for memory the caller used: it is ordered after every queue, so one queue
  // ordered after the caller's stream is enough. FailedPrecondition where
  // !orders_caller_streams(); InvalidArgument for an empty or unknown mask.
  virtual bool orders_caller_streams() const { return false; }
  virtual Status OrderCallerStream(uintptr_t /*stream*/, uint8_t /*queues*/) {
    return NoCallerStreams();
  }
  virtual Status WaitCallerStream(uintptr_t /*stream*/, uint8_t /*queues*/) {
    return NoCallerStreams();
  }

  // Page-locks host memory for async copies (cudaHostRegister). No-op on HostDevice.
  // Unavailable when the OS refuses to lock (RLIMIT_MEMLOCK); copies then still work, slower.
  virtual Status RegisterHost(void* ptr, uint64_t size_bytes) = 0;
  virtual Status UnregisterHost(void* ptr) = 0;

  virtual DeviceStats stats() const = 0;

  // Hands memory the device caches for reuse after Free back to the system once the frees issued
  // so far have completed, so other users of the device (another framework in the process) can
  // have it: CudaDevice trims its memory pool (cudaMemPoolTrimTo), whose release threshold
  // otherwise keeps freed memory for the next Allocate. Waits for those frees (at most
  // `timeout`). The default (HostDevice: freed memory returns at once) does nothing.
  virtual Status ReleaseCachedMemory(std::chrono::nanoseconds timeout) {
    (void)timeout;
    return Status::OK();
  }

  // The kernels that compute on this device's memory in place, on a compute stream of the
  // device's own (strata/device_kernels.h), or nullptr when it offers none. The engine runs
  // gradient accumulation, norms and the optimizer step of device-resident state with them
  // instead of staging the state through host memory. CudaDevice: the CUDA kernels
  // (kernels/cuda_kernels.h). HostDevice: nullptr (the engine's CPU kernels address its memory).
  // Owned by the device; valid for its lifetime.
  virtual kernels::DeviceKernels* kernels() { return nullptr; }

 private:
  Status NoCallerStreams() const {
    return Status::FailedPrecondition(name() + " orders no caller streams");
  }

 protected:
  // For OrderCallerStream / WaitCallerStream: the mask names at least one queue and no other bit.
  Status CheckQueues(uint8_t queues) const {
    if (queues != 0 && (queues & ~kEveryQueue) == 0) return Status::OK();
    return Status::InvalidArgument(name() + ": queue mask " + std::to_string(queues) +
                                   " names no device queue (DeviceQueue bits)");
  }
};

// A move-only RAII handle on device memory: freed (stream-ordered) on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* dev, void* ptr, uint64_t size_bytes)
      : dev_(dev), ptr_(ptr), size_bytes_(size_bytes) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      dev_ = o.dev_;
      ptr_ = o.ptr_;
      size_bytes_ = o.size_bytes_;
      o.dev_ = nullptr;
      o.ptr_ = nullptr;
      o.size_bytes_ = 0;
    }
    return *this;
  }
  ~DeviceBuffer() { Reset(); }
  static Result<DeviceBuffer> Make(Device* dev, uint64_t size_bytes) {
    STRATA_ASSIGN_OR_RETURN(void* p, dev->Allocate(size_bytes));
    return DeviceBuffer(dev, p, size_bytes);
  }
  void Reset() {
    if (dev_ && ptr_) dev_->Free(ptr_).IgnoreError();
    dev_ = nullptr;
    ptr_ = nullptr;
    size_bytes_ = 0;
  }
  void* get() const { return ptr_; }
  uint64_t size_bytes() const { return size_bytes_; }
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  Device* dev_ = nullptr;
  void* ptr_ = nullptr;
  uint64_t size_bytes_ = 0;
};

// ---------------------------------------------------------------------------
// Factories.
// ---------------------------------------------------------------------------

struct HostDeviceOptions {
  // The "HBM" size: Allocate fails with ResourceExhausted past it. Default 1 GiB.
  uint64_t budget_bytes = 1ull << 30;
  // Simulated link bandwidth per stream in bytes/s (0 = as fast as memcpy). Lets benchmarks and
  // tests model a PCIe link; a copy then takes at least size / bandwidth.
  uint64_t copy_bandwidth_bytes_per_s = 0;
  // Queued copies per stream before CopyAsync blocks for room (bounded queue).
  uint32_t max_queued_copies = 4096;
};
// Never fails except for invalid options (InvalidArgument).
Result<std::unique_ptr<Device>> CreateHostDevice(const HostDeviceOptions& options);

struct CudaDeviceOptions {
  int device_ordinal = 0;
  // Pool cap. 0 = 90 % of the free device memory at creation.
  uint64_t budget_bytes = 0;
};
// Unavailable when strata was built without CUDA, when no GPU or driver is present, or when the
// ordinal does not exist (the message says which).
Result<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options);

}  // namespace strata
