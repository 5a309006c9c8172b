// Device contract tests. Built twice: device_test (HostDevice) and, with STRATA_CUDA=ON,
// cuda_device_test (CudaDevice, label gpu, skipped when no GPU is present).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "strata/device.h"
#ifdef STRATA_TEST_CUDA
#include <cuda_runtime.h>

#include "strata/device_kernels.h"
#endif

namespace strata {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kBudget = 8ull << 20;

class DeviceContract : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef STRATA_TEST_CUDA
    CudaDeviceOptions o;
    o.budget_bytes = kBudget;
    auto d = CreateCudaDevice(o);
    if (!d.ok() && d.status().code() == Status::Code::kUnavailable) {
      GTEST_SKIP() << "no GPU: " << d.status().ToString();
    }
#else
    HostDeviceOptions o;
    o.budget_bytes = kBudget;
    auto d = CreateHostDevice(o);
#endif
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dev_ = std::move(d).value();
  }
  std::unique_ptr<Device> dev_;
};

// Waits (bounded) for `n` callbacks.
struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  int count = 0;
  Status first_error;
  void Done(Status s) {
    std::lock_guard<std::mutex> l(mu);
    if (!s.ok() && first_error.ok()) first_error = s;
    ++count;
    cv.notify_all();
  }
  bool WaitFor(int n) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, 30s, [&] { return count >= n; });
  }
};

TEST_F(DeviceContract, BudgetIsEnforcedAndFreed) {
  auto a = dev_->Allocate(kBudget / 2);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = dev_->Allocate(kBudget / 2);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  auto c = dev_->Allocate(4096);
  EXPECT_TRUE(c.status().IsResourceExhausted()) << c.status().ToString();
  EXPECT_EQ(dev_->stats().used_bytes, kBudget);
  ASSERT_TRUE(dev_->Free(*a).ok());
  auto d = dev_->Allocate(4096);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(dev_->Free(*b).ok());
  EXPECT_TRUE(dev_->Free(*d).ok());
  EXPECT_EQ(dev_->stats().used_bytes, 0u);
  EXPECT_EQ(dev_->stats().peak_used_bytes, kBudget);
}

TEST_F(DeviceContract, BadArgumentsAreRejected) {
  EXPECT_TRUE(dev_->Allocate(0).status().IsInvalidArgument());
  int x;
  EXPECT_TRUE(dev_->Free(&x).IsInvalidArgument());
}

TEST_F(DeviceContract, RoundTripThroughDeviceMemory) {
  constexpr size_t n = 1 << 20;
  std::vector<uint8_t> src(n), dst(n, 0);
  std::iota(src.begin(), src.end(), 7);
  ASSERT_TRUE(dev_->RegisterHost(src.data(), n).ok());
  ASSERT_TRUE(dev_->RegisterHost(dst.data(), n).ok());
  auto buf = DeviceBuffer::Make(dev_.get(), n);
  ASSERT_TRUE(buf.ok());
  Latch latch;
  ASSERT_TRUE(dev_->CopyAsync(CopyDir::kHostToDevice, buf->get(), src.data(), n,
                              [&](Status s) { latch.Done(s); })
                  .ok());
  ASSERT_TRUE(latch.WaitFor(1));
  ASSERT_TRUE(dev_->CopyAsync(CopyDir::kDeviceToHost, dst.data(), buf->get(), n, {}).ok());
  auto ev = dev_->RecordEvent(CopyDir::kDeviceToHost);
  ASSERT_TRUE(ev.ok());
  ASSERT_TRUE((*ev)->Wait(30s).ok());
  EXPECT_TRUE(*(*ev)->Query());
  EXPECT_EQ(src, dst);
  EXPECT_TRUE(latch.first_error.ok());
  EXPECT_GE(dev_->stats().bytes_copied[0], n);
  EXPECT_GE(dev_->stats().bytes_copied[1], n);
  buf->Reset();
  EXPECT_TRUE(dev_->UnregisterHost(src.data()).ok());
  EXPECT_TRUE(dev_->UnregisterHost(dst.data()).ok());
}

TEST_F(DeviceContract, CallbacksOfOneStreamRunInIssueOrder) {
  constexpr int kCopies = 64;
  constexpr size_t n = 4096;
  std::vector<uint8_t> host(n * kCopies, 1);
  auto buf = DeviceBuffer::Make(dev_.get(), n * kCopies);
  ASSERT_TRUE(buf.ok());
  std::mutex mu;
  std::vector<int> order;
  Latch latch;
  for (int i = 0; i < kCopies; ++i) {
    ASSERT_TRUE(dev_->CopyAsync(CopyDir::kHostToDevice, static_cast<char*>(buf->get()) + i * n,
                                host.data() + i * n, n,
                                [&, i](Status s) {
                                  {
                                    std::lock_guard<std::mutex> l(mu);
                                    order.push_back(i);
                                  }
                                  latch.Done(s);
                                })
                    .ok());
  }
  ASSERT_TRUE(latch.WaitFor(kCopies));
  ASSERT_TRUE(dev_->Synchronize().ok());
  std::vector<int> expect(kCopies);
  std::iota(expect.begin(), expect.end(), 0);
  EXPECT_EQ(order, expect);
}

TEST_F(DeviceContract, FreeAfterCopiesIsSafe) {
  // Freeing right after issuing a copy must not let the copy touch reused memory.
  constexpr size_t n = 256 << 10;
  std::vector<uint8_t> src(n, 0xAB), back(n, 0);
  for (int round = 0; round < 8; ++round) {
    auto p = dev_->Allocate(n);
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE(dev_->CopyAsync(CopyDir::kHostToDevice, *p, src.data(), n, {}).ok());
    auto h2d = dev_->RecordEvent(CopyDir::kHostToDevice);
    ASSERT_TRUE(h2d.ok());
    ASSERT_TRUE((*h2d)->Wait(30s).ok());  // the streams are independent: order them
    ASSERT_TRUE(dev_->CopyAsync(CopyDir::kDeviceToHost, back.data(), *p, n, {}).ok());
    auto ev = dev_->RecordEvent(CopyDir::kDeviceToHost);
    ASSERT_TRUE(ev.ok());
    ASSERT_TRUE(dev_->Free(*p).ok());  // while the D2H copy may still run
    ASSERT_TRUE((*ev)->Wait(30s).ok());
    EXPECT_EQ(back, src);
    std::fill(back.begin(), back.end(), 0);
  }
  EXPECT_EQ(dev_->stats().used_bytes, 0u);
}

#ifdef STRATA_TEST_CUDA
// A caller's stream ordered with the device's on the device, the host waiting for neither: the
// caller's copy of a buffer runs after the device's kernels zeroed it (OrderCallerStream, behind
// a queue of other kernels that make the race likely), and the device's copy of the buffer after
// the caller filled it (WaitCallerStream).
TEST_F(DeviceContract, CallerStreamsAreOrderedOnTheDevice) {
  ASSERT_TRUE(dev_->orders_caller_streams());
  kernels::DeviceKernels* k = dev_->kernels();
  ASSERT_NE(k, nullptr);
  constexpr size_t n = 1 << 20;
  auto buf = DeviceBuffer::Make(dev_.get(), n);
  auto copy = DeviceBuffer::Make(dev_.get(), n);
  auto busy = DeviceBuffer::Make(dev_.get(), 4 * n);
  ASSERT_TRUE(buf.ok() && copy.ok() && busy.ok());
  std::vector<uint8_t> host(n, 0xAB), out(n, 1);
  ASSERT_TRUE(dev_->RegisterHost(host.data(), n).ok());
  ASSERT_TRUE(dev_->RegisterHost(out.data(), n).ok());
  ASSERT_TRUE(dev_->CopyAsync(CopyDir::kHostToDevice, buf->get(), host.data(), n, {}).ok());
  ASSERT_TRUE(dev_->Synchronize().ok());
  cudaStream_t caller;
  ASSERT_EQ(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking), cudaSuccess);
  for (int i = 0; i < 200; ++i) ASSERT_TRUE(k->Zero(busy->get(), 4 * n).ok());
  ASSERT_TRUE(k->Zero(buf->get(), n).ok());
  ASSERT_TRUE(dev_->OrderCallerStream(reinterpret_cast<uintptr_t>(caller), kKernelQueue).ok());
  ASSERT_EQ(cudaMemcpyAsync(copy->get(), buf->get(), n, cudaMemcpyDeviceToDevice, caller),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(caller), cudaSuccess);
  ASSERT_TRUE(dev_->CopyAsync(CopyDir::kDeviceToHost, out.data(), copy->get(), n, {}).ok());
  ASSERT_TRUE(dev_->Synchronize().ok());
  EXPECT_EQ(out, std::vector<uint8_t>(n, 0)) << "the caller read the buffer before its zeroing";
  // The other direction: the caller fills the buffer behind its own queue; the device's copy
  // runs after.
  for (int i = 0; i < 200; ++i) {
    ASSERT_EQ(cudaMemsetAsync(busy->get(), i, 4 * n, caller), cudaSuccess);
  }
  ASSERT_EQ(cudaMemsetAsync(buf->get(), 0x5C, n, caller), cudaSuccess);
  ASSERT_TRUE(dev_->WaitCallerStream(reinterpret_cast<uintptr_t>(caller), kDeviceToHostQueue).ok());
  ASSERT_TRUE(dev_->CopyAsync(CopyDir::kDeviceToHost, out.data(), buf->get(), n, {}).ok());
  ASSERT_TRUE(dev_->Synchronize().ok());
  EXPECT_EQ(out, std::vector<uint8_t>(n, 0x5C)) << "the device read the buffer before the fill";
  ASSERT_TRUE(k->Synchronize(30s).ok());
  for (const uint8_t bad : {uint8_t{0}, uint8_t{kEveryQueue + 1}}) {
    EXPECT_EQ(dev_->OrderCallerStream(reinterpret_cast<uintptr_t>(caller), bad).code(),
              Status::Code::kInvalidArgument);
    EXPECT_EQ(dev_->WaitCallerStream(reinterpret_cast<uintptr_t>(caller), bad).code(),
              Status::Code::kInvalidArgument);
  }
  EXPECT_EQ(cudaStreamDestroy(caller), cudaSuccess);
  ASSERT_TRUE(dev_->UnregisterHost(host.data()).ok());
  ASSERT_TRUE(dev_->UnregisterHost(out.data()).ok());
}

// A caller's stream held by a host function until Open() (or the end of the scope), with the
// device's kernel queue ordered after it: a Free then waits behind it.
class HeldStream {
 public:
  explicit HeldStream(Device& dev) {
    ok_ = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) == cudaSuccess &&
          cudaLaunchHostFunc(stream_, &Hold, this) == cudaSuccess &&
          dev.WaitCallerStream(reinterpret_cast<uintptr_t>(stream_), kKernelQueue).ok();
  }
  ~HeldStream() {
    Open();
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  HeldStream(const HeldStream&) = delete;
  HeldStream& operator=(const HeldStream&) = delete;
  bool ok() const { return ok_; }
  void Open() {
    {
      std::lock_guard<std::mutex> l(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  // Whether the held work has run.
  bool passed() {
    std::lock_guard<std::mutex> l(mu_);
    return passed_;
  }

 private:
  static void CUDART_CB Hold(void* arg) {
    auto* h = static_cast<HeldStream*>(arg);
    std::unique_lock<std::mutex> l(h->mu_);
    h->cv_.wait_for(l, 30s, [h] { return h->open_; });
    h->passed_ = true;
  }
  cudaStream_t stream_ = nullptr;
  bool ok_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false, passed_ = false;
};

// A Free is ordered behind the device's queues, and they behind the caller's stream here; the
// next Allocate must not wait for that work (the engine allocates once per group per step, so a
// wait there paced the host by the GPU), and must not hand out the freed block before it ran.
TEST_F(DeviceContract, AllocateDoesNotWaitForTheWorkAFreeIsOrderedBehind) {
  ASSERT_TRUE(dev_->orders_caller_streams());
  constexpr size_t n = 1 << 20;
  auto first = dev_->Allocate(n);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = [&] {
    HeldStream held(*dev_);
    EXPECT_TRUE(held.ok());
    EXPECT_TRUE(dev_->Free(*first).ok());
    auto got = dev_->Allocate(n);
    EXPECT_FALSE(held.passed()) << "Allocate waited for the caller's queued work";
    return got;
  }();
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_NE(*second, *first) << "the freed block was reused before its free ran";
  ASSERT_TRUE(dev_->Free(*second).ok());
  EXPECT_EQ(dev_->stats().used_bytes, 0u);
}

// Blocks whose free has not run stay in the pool: where they and the live ones would pass the
// budget together, Allocate waits for the frees (so the pool stays within the budget).
TEST_F(DeviceContract, AllocateWaitsForFreesInFlightPastTheBudget) {
  auto big = dev_->Allocate(kBudget * 3 / 4);
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  HeldStream held(*dev_);
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(dev_->Free(*big).ok());
  std::thread opener([&] {
    std::this_thread::sleep_for(200ms);
    held.Open();
  });
  auto half = dev_->Allocate(kBudget / 2);
  const bool waited = held.passed();
  opener.join();
  ASSERT_TRUE(half.ok()) << half.status().ToString();
  EXPECT_TRUE(waited) << "Allocate did not wait for the free in flight";
  ASSERT_TRUE(dev_->Free(*half).ok());
}
#else
// HostDevice's callers are the host: no caller streams to order (the engine waits instead).
TEST_F(DeviceContract, HostDeviceOrdersNoCallerStreams) {
  EXPECT_FALSE(dev_->orders_caller_streams());
  EXPECT_EQ(dev_->OrderCallerStream(0, kEveryQueue).code(), Status::Code::kFailedPrecondition);
  EXPECT_EQ(dev_->WaitCallerStream(0, kEveryQueue).code(), Status::Code::kFailedPrecondition);
}
#endif

#ifndef STRATA_TEST_CUDA
TEST(HostDeviceTest, SimulatedLinkMakesEventsPending) {
  HostDeviceOptions o;
  o.budget_bytes = 4 << 20;
  o.copy_bandwidth_bytes_per_s = 1 << 20;  // 1 MiB/s: a 512 KiB copy takes >= 0.5 s
  auto d = CreateHostDevice(o);
  ASSERT_TRUE(d.ok());
  auto buf = DeviceBuffer::Make(d->get(), 512 << 10);
  ASSERT_TRUE(buf.ok());
  std::vector<uint8_t> host(512 << 10, 3);
  ASSERT_TRUE(
      (*d)->CopyAsync(CopyDir::kHostToDevice, buf->get(), host.data(), host.size(), {}).ok());
  auto ev = (*d)->RecordEvent(CopyDir::kHostToDevice);
  ASSERT_TRUE(ev.ok());
  EXPECT_TRUE((*ev)->Wait(1ms).IsDeadlineExceeded());
  EXPECT_TRUE((*ev)->Wait(30s).ok());
  EXPECT_EQ(std::memcmp(buf->get(), host.data(), host.size()), 0);
}

TEST(HostDeviceTest, CallbackMayNotReenterTheStream) {
  auto d = CreateHostDevice({});
  ASSERT_TRUE(d.ok());
  Device* dev = d->get();
  auto buf = DeviceBuffer::Make(dev, 4096);
  ASSERT_TRUE(buf.ok());
  std::vector<uint8_t> host(4096);
  Latch latch;
  Status inner;
  ASSERT_TRUE(dev->CopyAsync(CopyDir::kHostToDevice, buf->get(), host.data(), 4096,
                             [&](Status) {
                               inner = dev->CopyAsync(CopyDir::kHostToDevice, buf->get(),
                                                      host.data(), 4096, {});
                               latch.Done(Status::OK());
                             })
                  .ok());
  ASSERT_TRUE(latch.WaitFor(1));
  EXPECT_EQ(inner.code(), Status::Code::kFailedPrecondition);
}

TEST(HostDeviceTest, FreedMemoryIsReusedWithinTheBudget) {
  auto d = CreateHostDevice({.budget_bytes = 1 << 20});
  ASSERT_TRUE(d.ok());
  auto a = (*d)->Allocate(256 << 10);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE((*d)->Free(*a).ok());
  auto b = (*d)->Allocate(256 << 10);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, *a);  // cached, like a CUDA pool: no new mapping, no page faults
  // Cached bytes give way to a request that needs the whole budget.
  ASSERT_TRUE((*d)->Free(*b).ok());
  auto c = (*d)->Allocate(1 << 20);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE((*d)->Free(*c).ok());
}

TEST(HostDeviceTest, InvalidOptions) {
  HostDeviceOptions o;
  o.budget_bytes = 0;
  EXPECT_TRUE(CreateHostDevice(o).status().IsInvalidArgument());
}

TEST(CudaDeviceFactoryTest, ReportsUnavailableOrWorks) {
  auto d = CreateCudaDevice({});
  if (!d.ok()) {
    EXPECT_TRUE(d.status().IsUnavailable()) << d.status().ToString();
    EXPECT_FALSE(d.status().message().empty());
  }
}
#endif

}  // namespace
}  // namespace strata
