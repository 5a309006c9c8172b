// EmulatedDevice: a test device that the host may not address, with kernels
// (strata/device_kernels.h) that run the CUDA kernels' per-element code (kernels/cuda_math.h) on
// the host. It lets CI, without a GPU, drive the engine down the path it takes on CudaDevice:
// device-resident state computed in place by the device's kernels, every other byte moved through
// CopyAsync.
//
// Memory and copies: a HostDevice underneath (device memory is host RAM under the budget, one
// copy thread per direction), but host_addressable() is false, so the engine treats its pointers
// as opaque device memory.
// Compute stream: one worker thread runs the kernels in FIFO order, each after `kernel_delay`, so a
// caller that reads results without Synchronize sees stale bytes. The stream is bounded
// (`max_queued_kernels`; a call blocks for room). While a kernel is queued or running, the memory
// it touches is checked: a CopyAsync overlapping it counts as a violation (violations(): the
// engine must synchronize first, as on a GPU), and a Free of such memory is stream-ordered as
// CudaDevice's (the memory returns once the kernel has run). FailNextKernel makes
// the next kernel fail, reported by the next Synchronize (a kernel fault, as a GPU reports one);
// FailNextCopy the next copy in one direction.
// A caller's stream (Device::OrderCallerStream / WaitCallerStream): the caller here is the test
// on the host, so ordering its later work after the device's means the host waiting for the
// queues named (the kernels, or the copies) as queued so far (counted in caller_orders and per
// queue, not in synchronize, and leaving a kernel fault to the next Synchronize); waiting for its
// work is nothing (caller_waits). That
// keeps the bits and the violation checks exact while the counts show which ordering the engine
// asked for.
//
// Exactness: the element code is cuda_math.h's, the arguments those of cuda_kernels.cu
// (simd::FoldAdamArgs), so results are the CUDA kernels' bits (cuda_kernels.h). Include this only
// from a file built with -ffp-contract=off (cuda_math.h's host primitives need it).
//
// Thread safety: as Device; the counters may be read from any thread.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/adam.h"
#include "kernels/adam_math.h"
#include "kernels/cuda_math.h"
#include "kernels/elem.h"
#include "kernels/grad_stats.h"
#include "kernels/simd.h"
#include "strata/device.h"
#include "strata/device_kernels.h"

namespace strata::testing {

struct EmulatedDeviceOptions {
  HostDeviceOptions host;  // the memory budget and the copy streams
  // How long each kernel waits before it runs: widens the window in which an unsynchronized read
  // sees stale bytes. Default 100 us.
  std::chrono::microseconds kernel_delay{100};
  // Kernels queued on the compute stream before a call blocks for room.
  size_t max_queued_kernels = 64;
  // orders_caller_streams(): the engine's stream-ordered paths (false: its host-waiting ones).
  bool caller_streams = true;
};

class EmulatedDevice final : public Device, private kernels::DeviceKernels {
 public:
  static Result<std::unique_ptr<EmulatedDevice>> Create(const EmulatedDeviceOptions& o) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> inner, CreateHostDevice(o.host));
    return std::unique_ptr<EmulatedDevice>(new EmulatedDevice(std::move(inner), o));
  }
  ~EmulatedDevice() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  // Kernel calls enqueued, by kind, Synchronize calls, and frees of memory a queued kernel
  // touched (returned once it has run).
  struct Counts {
    uint64_t adam = 0, accumulate = 0, chunk_sums = 0, cast = 0, zero = 0, synchronize = 0;
    uint64_t deferred_frees = 0;
    uint64_t caller_orders = 0, caller_waits = 0;  // OrderCallerStream, WaitCallerStream
    // Per queue named in those calls (DeviceQueue's bit order: h2d, d2h, kernels).
    uint64_t caller_orders_on[3] = {0, 0, 0}, caller_waits_on[3] = {0, 0, 0};
    uint64_t allocations = 0;
    // Copies with a completion callback (the engine's) whose host side is not page-locked
    // (outside every RegisterHost range), per CopyDir: on CUDA those bounce through the driver.
    uint64_t pageable_copies[2] = {0, 0};

    // Summed field by field (several ranks' devices).
    Counts& operator+=(const Counts& o) {
      for (auto f : {&Counts::adam, &Counts::accumulate, &Counts::chunk_sums, &Counts::cast,
                     &Counts::zero, &Counts::synchronize, &Counts::deferred_frees,
                     &Counts::caller_orders, &Counts::caller_waits, &Counts::allocations}) {
        this->*f += o.*f;
      }
      for (int i = 0; i < 3; ++i) {
        caller_orders_on[i] += o.caller_orders_on[i];
        caller_waits_on[i] += o.caller_waits_on[i];
      }
      for (int d = 0; d < 2; ++d) pageable_copies[d] += o.pageable_copies[d];
      return *this;
    }
  };
  Counts counts() const {
    std::lock_guard<std::mutex> l(mu_);
    return counts_;
  }
  // Copies and frees that touched memory of a kernel not yet synchronized, with the first one
  // described.
  uint64_t violations() const {
    std::lock_guard<std::mutex> l(mu_);
    return violations_;
  }
  std::string first_violation() const {
    std::lock_guard<std::mutex> l(mu_);
    return first_violation_;
  }
  void FailNextKernel(Status st) {
    std::lock_guard<std::mutex> l(mu_);
    inject_ = std::move(st);
  }
  // The next copy in direction `dir` that has a completion callback (the engine's; the test
  // harness's own copies have none) moves nothing and completes with `st` (a failed DMA).
  void FailNextCopy(CopyDir dir, Status st) {
    std::lock_guard<std::mutex> l(mu_);
    copy_fault_[static_cast<size_t>(dir)] = std::move(st);
  }

  // The next copy in direction `dir` that has a completion callback, and every copy after it in
  // that direction, waits queued (not run) until ReleaseHeldCopies: a stream held up behind work
  // that does not end (a collective whose peer died, a hung kernel). Synchronize waits for the
  // held copies; events recorded meanwhile do not. ReleaseHeldCopies runs them in order and
  // returns how many it released.
  void HoldNextCopy(CopyDir dir) {
    std::lock_guard<std::mutex> l(mu_);
    hold_next_[static_cast<size_t>(dir)] = true;
  }
  size_t ReleaseHeldCopies() {
    std::vector<HeldCopy> run;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (size_t d = 0; d < 2; ++d) {
        holding_[d] = hold_next_[d] = false;
        for (HeldCopy& c : held_[d]) run.push_back(std::move(c));
        held_[d].clear();
      }
      releasing_ = true;
    }
    for (HeldCopy& c : run) {
      Status st = inner_->CopyAsync(c.dir, c.dst, c.src, c.bytes, c.done);
      if (!st.ok() && c.done) c.done(st);
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      releasing_ = false;  // issued: the streams underneath have them now
    }
    cv_.notify_all();
    return run.size();
  }

  // --- Device ---
  std::string name() const override { return "emulated-device"; }
  bool host_addressable() const override { return false; }
  kernels::DeviceKernels* kernels() override { return this; }
  Result<void*> Allocate(uint64_t size_bytes) override {
    STRATA_ASSIGN_OR_RETURN(void* p, inner_->Allocate(size_bytes));
    std::lock_guard<std::mutex> l(mu_);
    ++counts_.allocations;
    sizes_[reinterpret_cast<uintptr_t>(p)] = size_bytes;
    return p;
  }
  // Stream-ordered as CudaDevice's: memory a queued kernel touches is returned once that kernel
  // has run (counted in deferred_frees), never under it.
  Status Free(void* ptr) override {
    {
      std::unique_lock<std::mutex> l(mu_);
      auto it = sizes_.find(reinterpret_cast<uintptr_t>(ptr));
      if (it != sizes_.end()) {
        const Range r = Span(ptr, it->second);
        sizes_.erase(it);
        if (TouchedLocked(r)) {
          ++counts_.deferred_frees;
          queue_.push_back(std::make_unique<Kernel>(
              Kernel{{}, [this, ptr] { inner_->Free(ptr).IgnoreError(); }, /*delay=*/false}));
          cv_.notify_all();
          return Status::OK();
        }
      }
    }
    return inner_->Free(ptr);
  }
  Status CopyAsync(CopyDir dir, void* dst, const void* src, uint64_t size_bytes,
                   CopyCallback done) override {
    Status fault;
    {
      std::lock_guard<std::mutex> l(mu_);
      CheckLocked(dir == CopyDir::kHostToDevice ? dst : src, size_bytes, "CopyAsync");
      if (done && !RegisteredLocked(Span(dir == CopyDir::kHostToDevice ? src : dst, size_bytes))) {
        ++counts_.pageable_copies[static_cast<size_t>(dir)];
      }
      if (done) fault = std::exchange(copy_fault_[static_cast<size_t>(dir)], Status::OK());
      const size_t d = static_cast<size_t>(dir);
      if (done && hold_next_[d]) holding_[d] = true;
      if (holding_[d]) {
        held_[d].push_back(HeldCopy{dir, dst, src, size_bytes, std::move(done)});
        return Status::OK();
      }
    }
    if (!fault.ok()) {
      done(fault);
      return Status::OK();
    }
    return inner_->CopyAsync(dir, dst, src, size_bytes, std::move(done));
  }
  Result<std::unique_ptr<DeviceEvent>> RecordEvent(CopyDir dir) override {
    return inner_->RecordEvent(dir);
  }
  Status Synchronize() override {
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return held_[0].empty() && held_[1].empty() && !releasing_; });
    }
    return inner_->Synchronize();
  }
  bool orders_caller_streams() const override { return opt_.caller_streams; }
  Status OrderCallerStream(uintptr_t /*stream*/, uint8_t queues) override {
    STRATA_RETURN_IF_ERROR(CheckQueues(queues));
    {
      std::unique_lock<std::mutex> l(mu_);
      ++counts_.caller_orders;
      CountQueues(queues, counts_.caller_orders_on);
      // Only the queues named: the kernels, or the copies (both directions: the host device
      // underneath synchronizes them together).
      if ((queues & kKernelQueue) != 0) cv_.wait(l, [&] { return queue_.empty(); });
    }
    return (queues & (kHostToDeviceQueue | kDeviceToHostQueue)) != 0 ? inner_->Synchronize()
                                                                     : Status::OK();
  }
  Status WaitCallerStream(uintptr_t /*stream*/, uint8_t queues) override {
    STRATA_RETURN_IF_ERROR(CheckQueues(queues));
    std::lock_guard<std::mutex> l(mu_);
    ++counts_.caller_waits;
    CountQueues(queues, counts_.caller_waits_on);
    return Status::OK();
  }
  Status RegisterHost(void* ptr, uint64_t size_bytes) override {
    STRATA_RETURN_IF_ERROR(inner_->RegisterHost(ptr, size_bytes));
    std::lock_guard<std::mutex> l(mu_);
    registered_[reinterpret_cast<uintptr_t>(ptr)] = size_bytes;
    return Status::OK();
  }
  Status UnregisterHost(void* ptr) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      registered_.erase(reinterpret_cast<uintptr_t>(ptr));
    }
    return inner_->UnregisterHost(ptr);
  }
  DeviceStats stats() const override { return inner_->stats(); }

 private:
  using Range = std::pair<uintptr_t, uintptr_t>;  // [begin, end)
  struct Kernel {
    std::vector<Range> touches;
    std::function<void()> run;
    bool delay = true;  // a kernel waits kernel_delay first; a deferred free does not
  };

  EmulatedDevice(std::unique_ptr<Device> inner, const EmulatedDeviceOptions& o)
      : inner_(std::move(inner)), opt_(o), worker_([this] { Work(); }) {}

  static void CountQueues(uint8_t queues, uint64_t (&on)[3]) {
    for (int i = 0; i < 3; ++i) on[i] += (queues >> i) & 1u;
  }
  static Range Span(const void* p, size_t bytes) {
    const auto b = reinterpret_cast<uintptr_t>(p);
    return {b, b + bytes};
  }

  // REQUIRES: mu_ held.
  bool RegisteredLocked(const Range& r) const {
    auto it = registered_.upper_bound(r.first);
    if (it == registered_.begin()) return false;
    --it;
    return r.second <= it->first + it->second;
  }
  // REQUIRES: mu_ held.
  bool TouchedLocked(const Range& r) const {
    for (const auto& k : queue_) {
      for (const Range& t : k->touches) {
        if (r.first < t.second && t.first < r.second) return true;
      }
    }
    return false;
  }
  // REQUIRES: mu_ held.
  void CheckLocked(const void* p, uint64_t bytes, const char* what) {
    if (TouchedLocked(Span(p, bytes)) && violations_++ == 0) {
      first_violation_ = std::string(what) + " of " + std::to_string(bytes) +
                         " bytes overlaps a kernel not yet synchronized";
    }
  }

  Status Enqueue(std::vector<Range> touches, std::function<void()> run, uint64_t Counts::*count) {
    auto k = std::make_unique<Kernel>(Kernel{std::move(touches), std::move(run)});
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return queue_.size() < opt_.max_queued_kernels; });
    ++(counts_.*count);
    queue_.push_back(std::move(k));
    cv_.notify_all();
    return Status::OK();
  }

  void Work() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Kernel* k = queue_.front().get();
      // A deferred free neither waits nor takes an injected fault: it is no kernel.
      Status fault = k->delay ? std::exchange(inject_, Status::OK()) : Status::OK();
      l.unlock();
      if (k->delay) std::this_thread::sleep_for(opt_.kernel_delay);
      if (fault.ok()) k->run();  // a faulting kernel writes nothing
      l.lock();
      if (!fault.ok() && fault_.ok()) fault_ = fault;
      queue_.pop_front();
      cv_.notify_all();
    }
  }

  // --- DeviceKernels: cuda_kernels.cu's validation and element code, on the host ---
  Status AdamStep(const kernels::AdamHyper& hyper, const kernels::AdamShard& shard) override {
    STRATA_RETURN_IF_ERROR(kernels::ValidateAdam(hyper, shard));
    const kernels::simd::AdamArgs a = kernels::simd::FoldAdamArgs(hyper, shard);
    const size_t n = shard.n;
    std::vector<Range> touches = {Span(a.master, n * 4), Span(a.exp_avg, n * 4),
                                  Span(a.exp_avg_sq, n * 4),
                                  Span(a.grad, n * DTypeSize(shard.grad_dtype))};
    if (a.param_out != nullptr) touches.push_back(Span(a.param_out, n * 2));
    return Enqueue(
        std::move(touches),
        [a, n] {
          for (size_t i = 0; i < n; ++i) {
            float p = a.master[i], m = a.exp_avg[i], v = a.exp_avg_sq[i];
            const float g = LoadAny(a.grad_elem, a.grad, i);
            if (a.l2) {
              kernels::adam_math::AdamElement<true>(a, g, p, m, v);
            } else {
              kernels::adam_math::AdamElement<false>(a, g, p, m, v);
            }
            a.master[i] = p;
            a.exp_avg[i] = m;
            a.exp_avg_sq[i] = v;
            if (a.out_elem != kernels::simd::kElemNone) {
              static_cast<uint16_t*>(a.param_out)[i] = NarrowAny(a.out_elem, p);
            }
          }
        },
        &Counts::adam);
  }

  Status AccumulateGrad(float* acc, const void* grad, DType grad_dtype, float scale, bool overwrite,
                        size_t n) override {
    const int elem = kernels::ElemOf(grad_dtype);
    if (elem < 0) return Status::InvalidArgument("emulated accumulate grad: bad grad dtype");
    if (!std::isfinite(scale)) return Status::InvalidArgument("emulated accumulate: scale");
    if (n > 0 && (acc == nullptr || grad == nullptr)) {
      return Status::InvalidArgument("emulated accumulate grad: null acc or grad with n > 0");
    }
    return Enqueue(
        {Span(acc, n * 4), Span(grad, n * DTypeSize(grad_dtype))},
        [=] {
          for (size_t i = 0; i < n; ++i) {
            const float g = LoadAny(elem, grad, i);
            acc[i] = overwrite ? kernels::cuda_math::OverwriteElement(g, scale)
                               : kernels::cuda_math::AccumulateElement(acc[i], g, scale);
          }
        },
        &Counts::accumulate);
  }

  Status ChunkSumSquares(const void* grad, DType dtype, size_t n, double* chunk_sums,
                         bool* nonfinite) override {
    const int elem = kernels::ElemOf(dtype);
    if (elem < 0) return Status::InvalidArgument("emulated chunk sum squares: bad dtype");
    if (nonfinite == nullptr) return Status::InvalidArgument("emulated chunk sums: null flag");
    if (n > 0 && (grad == nullptr || chunk_sums == nullptr)) {
      return Status::InvalidArgument("emulated chunk sum squares: null grad or sums with n > 0");
    }
    const size_t chunks = (n + kernels::kStatsChunk - 1) / kernels::kStatsChunk;
    return Enqueue(
        {Span(grad, n * DTypeSize(dtype)), Span(chunk_sums, chunks * 8), Span(nonfinite, 1)},
        [=] {
          *nonfinite = false;
          for (size_t c = 0; c < chunks; ++c) {
            const size_t begin = c * kernels::kStatsChunk;
            const size_t count = std::min(kernels::kStatsChunk, n - begin);
            double lanes[kernels::cuda_math::kChunkLanes];
            for (int j = 0; j < kernels::cuda_math::kChunkLanes; ++j) {
              lanes[j] = LaneSum(elem, grad, begin, count, j);
            }
            chunk_sums[c] = kernels::cuda_math::CombineChunkLanes(lanes);
            if (!std::isfinite(chunk_sums[c])) *nonfinite = true;
          }
        },
        &Counts::chunk_sums);
  }

  Status Cast(const void* in, DType in_dtype, void* out, DType out_dtype, size_t n) override {
    if (n > 0 && (in == nullptr || out == nullptr)) {
      return Status::InvalidArgument("emulated cast: null input or output with n > 0");
    }
    const int from = kernels::ElemOf(in_dtype), to = kernels::ElemOf(out_dtype);
    const bool same = in_dtype == out_dtype;
    const bool narrow = from == kernels::simd::kElemF32 && to > 0;
    const bool widen = to == kernels::simd::kElemF32 && from > 0;
    if (!same && !narrow && !widen) {
      return Status::InvalidArgument("emulated cast: unsupported conversion " +
                                     std::string(DTypeName(in_dtype)) + " -> " +
                                     std::string(DTypeName(out_dtype)));
    }
    return Enqueue(
        {Span(in, n * DTypeSize(in_dtype)), Span(out, n * DTypeSize(out_dtype))},
        [=] {
          if (same) {
            std::memcpy(out, in, n * DTypeSize(in_dtype));
          } else if (narrow) {
            for (size_t i = 0; i < n; ++i) {
              static_cast<uint16_t*>(out)[i] = NarrowAny(to, static_cast<const float*>(in)[i]);
            }
          } else {
            for (size_t i = 0; i < n; ++i) static_cast<float*>(out)[i] = LoadAny(from, in, i);
          }
        },
        &Counts::cast);
  }

  Status Zero(void* ptr, uint64_t bytes) override {
    if (bytes > 0 && ptr == nullptr) return Status::InvalidArgument("emulated zero: null pointer");
    return Enqueue({Span(ptr, bytes)}, [=] { std::memset(ptr, 0, bytes); }, &Counts::zero);
  }
  Status Synchronize(std::chrono::nanoseconds timeout) override {
    std::unique_lock<std::mutex> l(mu_);
    ++counts_.synchronize;
    if (!cv_.wait_for(l, timeout, [&] { return queue_.empty(); })) {
      return Status::DeadlineExceeded("emulated device: kernel synchronize timed out");
    }
    return std::exchange(fault_, Status::OK());
  }

  static float LoadAny(int elem, const void* p, size_t i) {
    switch (elem) {
      case kernels::simd::kElemBF16:
        return kernels::cuda_math::LoadElem<kernels::simd::kElemBF16>(p, i);
      case kernels::simd::kElemF16:
        return kernels::cuda_math::LoadElem<kernels::simd::kElemF16>(p, i);
      default:
        return kernels::cuda_math::LoadElem<kernels::simd::kElemF32>(p, i);
    }
  }
  static uint16_t NarrowAny(int elem, float x) {
    return elem == kernels::simd::kElemBF16
               ? kernels::cuda_math::Narrow<kernels::simd::kElemBF16>(x)
               : kernels::cuda_math::Narrow<kernels::simd::kElemF16>(x);
  }
  static double LaneSum(int elem, const void* g, size_t begin, size_t count, int lane) {
    switch (elem) {
      case kernels::simd::kElemBF16:
        return kernels::cuda_math::ChunkLaneSum<kernels::simd::kElemBF16>(g, begin, count, lane);
      case kernels::simd::kElemF16:
        return kernels::cuda_math::ChunkLaneSum<kernels::simd::kElemF16>(g, begin, count, lane);
      default:
        return kernels::cuda_math::ChunkLaneSum<kernels::simd::kElemF32>(g, begin, count, lane);
    }
  }

  std::unique_ptr<Device> inner_;
  const EmulatedDeviceOptions opt_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Kernel>> queue_;  // FIFO, unfinished; the front is the one running
  std::map<uintptr_t, uint64_t> sizes_;        // live allocations
  std::map<uintptr_t, uint64_t> registered_;   // RegisterHost ranges: begin -> bytes
  Counts counts_;
  uint64_t violations_ = 0;
  std::string first_violation_;
  Status inject_, fault_;
  Status copy_fault_[2];  // FailNextCopy, per CopyDir
  struct HeldCopy {
    CopyDir dir;
    void* dst;
    const void* src;
    uint64_t bytes;
    CopyCallback done;
  };
  bool hold_next_[2] = {false, false}, holding_[2] = {false, false};  // HoldNextCopy, per CopyDir
  std::vector<HeldCopy> held_[2];
  bool releasing_ = false;  // ReleaseHeldCopies is issuing the held copies
  bool stop_ = false;
  std::thread worker_;  // last: starts once everything above is constructed
};

}  // namespace strata::testing
