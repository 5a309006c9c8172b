// NcclCommunicator on the GPUs present (label gpu; skipped without a GPU): every operation and
// dtype at world size 1 against a local reference, pre-division, and a peer that never joins
// making initialization fail at the deadline (aborted, no hang). The CUDA error mapping tests run
// without a GPU: they inject errors into cudaGetDeviceCount (below).
#include "gpu/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "cpu/rendezvous/rendezvous.h"
#include "gpu/cuda_check.h"
#include "strata/device.h"
#include "tests/comm_test_util.h"
#include "tests/multiprocess.h"

// Error injection: this binary defines cudaGetDeviceCount itself, so the linker binds the library
// code under test to this one instead of libcudart's. It returns the injected error when one is
// set and otherwise forwards to the real runtime, so the GPU tests see the GPUs as usual.
static std::atomic<cudaError_t> g_injected_cuda_error{cudaSuccess};

extern "C" cudaError_t CUDARTAPI cudaGetDeviceCount(int* count) {
  const cudaError_t injected = g_injected_cuda_error.load();
  if (injected != cudaSuccess) return injected;
  using Fn = cudaError_t (*)(int*);
  static const Fn real = reinterpret_cast<Fn>(::dlsym(RTLD_NEXT, "cudaGetDeviceCount"));
  return real != nullptr ? real(count) : cudaErrorUnknown;
}

namespace strata {
namespace {

using std::chrono::milliseconds;
using testing::Encode;

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device"

struct DeviceBuf {
  explicit DeviceBuf(size_t bytes) : bytes(bytes) {
    EXPECT_EQ(cudaMalloc(&p, bytes ? bytes : 1), cudaSuccess);
  }
  ~DeviceBuf() { cudaFree(p); }
  void Put(const std::vector<uint8_t>& v) {
    ASSERT_EQ(cudaMemcpy(p, v.data(), v.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<uint8_t> Get() const {
    std::vector<uint8_t> v(bytes);
    EXPECT_EQ(cudaMemcpy(v.data(), p, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  void* p = nullptr;
  size_t bytes;
};

class NcclSingleRank : public ::testing::TestWithParam<DType> {};

TEST_P(NcclSingleRank, EveryOpMatchesReference) {
  REQUIRE_GPU();
  const DType dt = GetParam();
  auto uid = NewNcclUniqueId();
  ASSERT_TRUE(uid.ok()) << uid.status().ToString();
  NcclCommOptions o;
  o.unique_id = *uid;
  o.timeout = milliseconds(60000);
  auto comm = CreateNcclCommunicator(o);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  Communicator& c = **comm;
  EXPECT_EQ(c.backend(), "nccl");
  const size_t n = 1001, elt = DTypeSize(dt);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<int>(i % 17) - 8);
  const auto in = Encode(dt, x);
  DeviceBuf a(n * elt), b(n * elt);
  a.Put(in);
  auto wait = [](Result<CommHandle> h) {
    return h.ok() ? h->WaitFor(milliseconds(30000)) : h.status();
  };
  ASSERT_TRUE(wait(c.AllGather(a.p, b.p, n, dt)).ok());
  EXPECT_EQ(b.Get(), in);
  ASSERT_TRUE(wait(c.ReduceScatter(a.p, b.p, n, dt)).ok());
  EXPECT_EQ(b.Get(), in);
  ASSERT_TRUE(wait(c.AllReduce(a.p, b.p, n, dt, {.predivide = true})).ok());
  EXPECT_EQ(b.Get(), in);  // 1/1 pre-division is exact
  ASSERT_TRUE(wait(c.Broadcast(a.p, n, dt, 0)).ok());
  EXPECT_EQ(a.Get(), in);
  ASSERT_TRUE(wait(c.Barrier()).ok());
  EXPECT_EQ(c.stats().of(CommOp::kAllGather).payload_bytes, n * elt);
}

INSTANTIATE_TEST_SUITE_P(DTypes, NcclSingleRank,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// ZeRO++'s communication on one rank: all-to-all (grouped send/recv) and an int8 all-gather on a
// communicator made by Split, which counts its own bytes and leaves the parent usable.
TEST(NcclComm, SplitAndAllToAllOnOneRank) {
  REQUIRE_GPU();
  auto uid = NewNcclUniqueId();
  ASSERT_TRUE(uid.ok()) << uid.status().ToString();
  NcclCommOptions o;
  o.unique_id = *uid;
  o.timeout = milliseconds(60000);
  auto comm = CreateNcclCommunicator(o);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  auto wait = [](Result<CommHandle> h) {
    return h.ok() ? h->WaitFor(milliseconds(30000)) : h.status();
  };
  auto sub = (*comm)->Split(3, 0);
  ASSERT_TRUE(sub.ok()) << sub.status().ToString();
  Communicator& s = **sub;
  EXPECT_EQ(s.rank(), 0);
  EXPECT_EQ(s.world_size(), 1);
  const size_t n = 4097;
  std::vector<uint8_t> in(n);
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<uint8_t>(i * 37 + 5);
  DeviceBuf a(n), b(n);
  a.Put(in);
  ASSERT_TRUE(wait(s.AllToAll(a.p, b.p, n, DType::kI8)).ok());
  EXPECT_EQ(b.Get(), in);
  b.Put(std::vector<uint8_t>(n, 0));
  ASSERT_TRUE(wait(s.AllGather(a.p, b.p, n, DType::kI8)).ok());
  EXPECT_EQ(b.Get(), in);
  EXPECT_EQ(s.stats().of(CommOp::kAllToAll).calls, 1u);
  EXPECT_EQ(s.stats().of(CommOp::kAllToAll).payload_bytes, n);
  EXPECT_EQ((*comm)->stats().of(CommOp::kAllToAll).calls, 0u);
  EXPECT_TRUE(s.AllToAll(a.p, a.p, n, DType::kI8).status().IsInvalidArgument());
  EXPECT_TRUE(s.AllReduce(a.p, b.p, n, DType::kI8).status().IsInvalidArgument());
  float x = 2;
  DeviceBuf f(4);
  f.Put(std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&x), reinterpret_cast<uint8_t*>(&x) + 4));
  ASSERT_TRUE(wait((*comm)->AllReduce(f.p, f.p, 1, DType::kF32)).ok());  // parent still works
  sub->reset();
  ASSERT_TRUE(wait((*comm)->Barrier()).ok());
}

TEST(NcclComm, PeerThatNeverJoinsFailsInitAtTheDeadline) {
  REQUIRE_GPU();
  auto uid = NewNcclUniqueId();
  ASSERT_TRUE(uid.ok()) << uid.status().ToString();
  NcclCommOptions o;
  o.rank = 0;
  o.world_size = 2;  // rank 1 never starts
  o.unique_id = *uid;
  o.timeout = milliseconds(3000);
  const auto t0 = std::chrono::steady_clock::now();
  auto comm = CreateNcclCommunicator(o);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), Status::Code::kDeadlineExceeded) << comm.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST(NcclComm, RankOutOfRangeIsRejectedBeforeTouchingCuda) {
  NcclCommOptions o;
  o.world_size = 2;
  o.rank = 2;
  EXPECT_TRUE(CreateNcclCommunicator(o).status().IsInvalidArgument());
  o.rank = 0;
  o.timeout = milliseconds(0);
  EXPECT_TRUE(CreateNcclCommunicator(o).status().IsInvalidArgument());
}

TEST(NcclComm, OneRankNeedsNeitherAnIdNorAStore) {
  REQUIRE_GPU();
  NcclCommOptions o;  // world_size 1, no unique_id, no store
  auto comm = CreateNcclCommunicator(o);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  EXPECT_EQ((*comm)->world_size(), 1);
  o.world_size = 2;  // more ranks must share an id: refused without one and without a store
  EXPECT_TRUE(CreateNcclCommunicator(o).status().IsInvalidArgument());
}

TEST(NcclComm, BadUniqueIdIsRejected) {
  REQUIRE_GPU();
  NcclCommOptions o;
  o.world_size = 2;
  o.unique_id = {1, 2, 3};
  auto c = CreateNcclCommunicator(o);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(c.status().IsInvalidArgument()) << c.status().ToString();
  EXPECT_NE(c.status().ToString().find("unique_id has 3 bytes"), std::string::npos);
}

// Makes cudaGetDeviceCount fail with `err` for its lifetime.
struct InjectCudaError {
  explicit InjectCudaError(cudaError_t err) { g_injected_cuda_error = err; }
  ~InjectCudaError() { g_injected_cuda_error = cudaSuccess; }
};

TEST(CudaStatus, MapsErrorsToCodes) {
  EXPECT_TRUE(CudaStatus(cudaSuccess, "f()", "x.cc", 1).ok());
  const Status oom = CudaStatus(cudaErrorMemoryAllocation, "cudaMalloc(&p, n)", "x.cc", 7);
  EXPECT_TRUE(oom.IsResourceExhausted()) << oom.ToString();
  EXPECT_NE(oom.message().find("cudaMalloc(&p, n)"), std::string::npos) << oom.ToString();
  EXPECT_NE(oom.message().find("cudaErrorMemoryAllocation"), std::string::npos);
  EXPECT_NE(oom.message().find("x.cc:7"), std::string::npos) << oom.ToString();
  for (cudaError_t e : {cudaErrorNoDevice, cudaErrorInsufficientDriver, cudaErrorInvalidDevice}) {
    EXPECT_TRUE(CudaStatus(e, "f()", "x.cc", 1).IsUnavailable()) << cudaGetErrorName(e);
  }
  EXPECT_EQ(CudaStatus(cudaErrorLaunchFailure, "f()", "x.cc", 1).code(), Status::Code::kInternal);
}

// Issue 9: nccl_comm.cc had its own CUDA mapping, which turned out-of-memory into Internal. Both
// CUDA users now map a CUDA error the same way (cuda_check.h).
TEST(CudaStatus, NcclAndDeviceMapCudaErrorsAlike) {
  NcclCommOptions o;
  o.unique_id.assign(128, 0);
  const std::pair<cudaError_t, Status::Code> cases[] = {
      {cudaErrorMemoryAllocation, Status::Code::kResourceExhausted},
      {cudaErrorNoDevice, Status::Code::kUnavailable},
      {cudaErrorLaunchFailure, Status::Code::kInternal},
  };
  for (const auto& [err, code] : cases) {
    InjectCudaError inject(err);
    const Status nccl = CreateNcclCommunicator(o).status();
    EXPECT_EQ(nccl.code(), code) << nccl.ToString();
    EXPECT_NE(nccl.message().find("cudaGetDeviceCount"), std::string::npos) << nccl.ToString();
    EXPECT_NE(nccl.message().find(cudaGetErrorName(err)), std::string::npos) << nccl.ToString();
    const Status dev = CreateCudaDevice({}).status();
    EXPECT_EQ(dev.code(), code) << dev.ToString();
  }
}

// ---------------------------------------------------------------------------
// Two ranks on two GPUs. Each rank is a fresh process running this binary with a filter for the
// DISABLED_ rank body below (exec, not fork: CUDA must not be inherited across fork), so ctest
// lists the body as disabled, never as passed.
// ---------------------------------------------------------------------------
float Value(int r, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + r * 13) % 17) - 8);
}

int GpuCountInChild() {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    ::_exit(n > 100 ? 100 : n);
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 0;
}

std::vector<int> SpawnRanks(int world, const std::string& mode, const std::string& dir) {
  return testing::RunRanks(
      world,
      [&](int r) -> std::string {
        ::setenv("STRATA_NCCL_RANK", std::to_string(r).c_str(), 1);
        ::setenv("STRATA_NCCL_WORLD", std::to_string(world).c_str(), 1);
        ::setenv("STRATA_NCCL_MODE", mode.c_str(), 1);
        ::setenv("STRATA_NCCL_DIR", dir.c_str(), 1);
        ::execl("/proc/self/exe", "nccl_comm_test", "--gtest_filter=NcclRank.DISABLED_Body",
                "--gtest_also_run_disabled_tests", static_cast<char*>(nullptr));
        return "exec failed";
      },
      std::chrono::seconds(120));
}

TEST(NcclComm, TwoRanksEveryOpAndDtype) {
  if (GpuCountInChild() < 2) GTEST_SKIP() << "needs 2 GPUs";
  auto codes = SpawnRanks(2, "ops", testing::UniqueTestDir("nccl_ops"));
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

TEST(NcclComm, PeerThatDiesMakesTheOtherFailAndAbort) {
  if (GpuCountInChild() < 2) GTEST_SKIP() << "needs 2 GPUs";
  auto codes = SpawnRanks(2, "die", testing::UniqueTestDir("nccl_die"));
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

TEST(NcclRank, DISABLED_Body) {
  const char* rank_s = std::getenv("STRATA_NCCL_RANK");
  if (rank_s == nullptr) GTEST_SKIP() << "run by the two-rank tests only";
  const int r = std::atoi(rank_s), w = std::atoi(std::getenv("STRATA_NCCL_WORLD"));
  const std::string mode = std::getenv("STRATA_NCCL_MODE");
  auto store = cpu::FileKvStore::Open(std::getenv("STRATA_NCCL_DIR"));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  NcclCommOptions o;
  o.rank = r;
  o.world_size = w;
  o.device = r;
  o.store = store->get();
  o.timeout = milliseconds(30000);
  auto comm = CreateNcclCommunicator(o);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  Communicator& c = **comm;
  auto wait = [](Result<CommHandle> h, milliseconds t = milliseconds(30000)) {
    return h.ok() ? h->WaitFor(t) : h.status();
  };
  if (mode == "die") {
    DeviceBuf buf(1 << 20);
    ASSERT_TRUE(wait(c.AllReduce(buf.p, buf.p, (1 << 20) / 4, DType::kF32)).ok());
    if (r == 1) ::_exit(0);
    const auto t0 = std::chrono::steady_clock::now();
    const Status st =
        wait(c.AllReduce(buf.p, buf.p, (1 << 20) / 4, DType::kF32), milliseconds(10000));
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("nccl all_reduce"), std::string::npos) << st.ToString();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(40));
    auto again = c.Barrier();
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.status().code(), Status::Code::kAborted) << again.status().ToString();
    return;
  }
  const size_t n = 1001;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const size_t elt = DTypeSize(dt);
    std::vector<float> mine(n), gathered, rs_in(n * w), rs_want(n), ar_want(n);
    for (size_t i = 0; i < n; ++i) mine[i] = Value(r, i);
    for (int q = 0; q < w; ++q) {
      for (size_t i = 0; i < n; ++i) gathered.push_back(Value(q, i));
    }
    for (size_t i = 0; i < n * w; ++i) rs_in[i] = Value(r, i);
    for (size_t i = 0; i < n; ++i) {
      for (int q = 0; q < w; ++q) {
        rs_want[i] += Value(q, r * n + i);
        ar_want[i] += Value(q, i);
      }
    }
    DeviceBuf a(n * w * elt), b(n * w * elt);
    a.Put(Encode(dt, mine));
    ASSERT_TRUE(wait(c.AllGather(a.p, b.p, n, dt)).ok());
    EXPECT_EQ(b.Get(), Encode(dt, gathered)) << DTypeName(dt);
    a.Put(Encode(dt, rs_in));
    DeviceBuf out(n * elt);
    ASSERT_TRUE(wait(c.ReduceScatter(a.p, out.p, n, dt)).ok());
    EXPECT_EQ(out.Get(), Encode(dt, rs_want)) << DTypeName(dt);
    a.Put(Encode(dt, mine));
    ASSERT_TRUE(wait(c.AllReduce(a.p, out.p, n, dt, {.predivide = true})).ok());
    std::vector<float> avg(ar_want);
    for (float& x : avg) x /= static_cast<float>(w);
    EXPECT_EQ(out.Get(), Encode(dt, avg)) << DTypeName(dt);
    if (r == 1) out.Put(Encode(dt, mine));
    ASSERT_TRUE(wait(c.Broadcast(out.p, n, dt, 1)).ok());
    std::vector<float> from1(n);
    for (size_t i = 0; i < n; ++i) from1[i] = Value(1, i);
    EXPECT_EQ(out.Get(), Encode(dt, from1)) << DTypeName(dt);
  }
  ASSERT_TRUE(wait(c.Barrier()).ok());
}

}  // namespace
}  // namespace strata
