// NcclCommunicator on the GPUs present (label gpu; skipped without a GPU): every operation and
// dtype at world size 1 against a local reference, pre-division, and a peer that never joins
// making initialization fail at the deadline (aborted, no hang).
#include "gpu/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>

namespace strata {
namespace {

using std::chrono::milliseconds;

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device"

std::vector<uint8_t> Encode(DType dt, const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * DTypeSize(dt));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else if (dt == DType::kBF16) {
      const bf16_t b = FloatToBf16(v[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      const f16_t h = FloatToHalf(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

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

TEST(NcclComm, BadOptionsAreRejected) {
  NcclCommOptions o;
  o.world_size = 2;
  o.rank = 2;
  EXPECT_TRUE(CreateNcclCommunicator(o).status().IsInvalidArgument());
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device for the unique-id checks";
  o.rank = 0;
  o.unique_id = {1, 2, 3};
  auto c = CreateNcclCommunicator(o);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(c.status().IsInvalidArgument()) << c.status().ToString();
}

}  // namespace
}  // namespace strata
