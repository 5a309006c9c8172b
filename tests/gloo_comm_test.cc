// GlooCommunicator over loopback: every operation and dtype against a locally computed reference,
// with 1, 2 and 4 ranks (forked processes), odd sizes, in-place layouts, segmenting, byte counts,
// a rank that dies, and bounded async submission.
#include "cpu/gloo_comm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <future>
#include <sstream>

#include <poll.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "cpu/rendezvous/rendezvous.h"
#include "tests/comm_test_util.h"
#include "tests/multiprocess.h"

namespace strata {
namespace {

using std::chrono::milliseconds;
using testing::Encode;
using testing::RunRanks;

// Rank r's input element i: small integers, exact in bf16/fp16 and in every fp32 partial sum, so
// that the result is independent of summation order and comparable bit for bit.
float Value(int r, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + r * 13) % 17) - 8);
}

std::vector<float> Inputs(int r, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = Value(r, i);
  return v;
}

// Returns "" when equal, else the first differing element.
std::string Compare(const std::string& what, const std::vector<uint8_t>& got,
                    const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return what + ": size " + std::to_string(got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) return what + ": byte " + std::to_string(i) + " differs";
  }
  return "";
}

struct Job {
  std::unique_ptr<KvStore> store;
  std::unique_ptr<Communicator> comm;
};

// Builds rank r's communicator through a file store in `dir`.
Result<Job> Connect(const std::string& dir, int rank, int world, size_t scratch_elems = 1 << 20,
                    milliseconds timeout = milliseconds(30000)) {
  Job job;
  STRATA_ASSIGN_OR_RETURN(auto fs, cpu::FileKvStore::Open(dir));
  job.store = std::move(fs);
  GlooCommOptions o;
  o.rank = rank;
  o.world_size = world;
  o.store = job.store.get();
  o.timeout = timeout;
  o.scratch_elems = scratch_elems;
  STRATA_ASSIGN_OR_RETURN(job.comm, CreateGlooCommunicator(o));
  return job;
}

Status WaitOp(Result<CommHandle> h) {
  if (!h.ok()) return h.status();
  return h->WaitFor(milliseconds(30000));
}

#define RANK_CHECK(cond, msg)             \
  do {                                    \
    if (!(cond)) return std::string(msg); \
  } while (0)
#define RANK_OK(expr)                                                 \
  do {                                                                \
    const Status s_ = (expr);                                         \
    if (!s_.ok()) return std::string(#expr) + " -> " + s_.ToString(); \
  } while (0)

// All operations on one dtype and count, each against its reference.
std::string CheckAllOps(Communicator& c, DType dt, size_t n) {
  const int w = c.world_size(), r = c.rank();
  const size_t elt = DTypeSize(dt);
  std::string err;
  // all-gather (out of place, then in place)
  {
    std::vector<float> want_f;
    for (int q = 0; q < w; ++q) {
      auto v = Inputs(q, n);
      want_f.insert(want_f.end(), v.begin(), v.end());
    }
    const auto want = Encode(dt, want_f);
    const auto in = Encode(dt, Inputs(r, n));
    std::vector<uint8_t> out(want.size(), 0xee);
    RANK_OK(WaitOp(c.AllGather(in.data(), out.data(), n, dt)));
    if (!(err = Compare("all_gather", out, want)).empty()) return err;
    std::vector<uint8_t> inplace(want.size(), 0xee);
    if (n > 0) std::memcpy(inplace.data() + r * n * elt, in.data(), n * elt);
    RANK_OK(WaitOp(c.AllGather(inplace.data() + r * n * elt, inplace.data(), n, dt)));
    if (!(err = Compare("all_gather in place", inplace, want)).empty()) return err;
  }
  // reduce-scatter, plain and pre-divided, out of place and in place
  for (bool pre : {false, true}) {
    const auto in = Encode(dt, Inputs(r, n * w));
    std::vector<float> want_f(n);
    for (size_t i = 0; i < n; ++i) {
      float s = 0;
      for (int q = 0; q < w; ++q) s += Value(q, r * n + i) * (pre ? 1.0f / w : 1.0f);
      want_f[i] = s;
    }
    const auto want = Encode(dt, want_f);
    std::vector<uint8_t> out(n * elt, 0xee);
    RANK_OK(WaitOp(c.ReduceScatter(in.data(), out.data(), n, dt, {.predivide = pre})));
    if (!(err = Compare("reduce_scatter", out, want)).empty()) return err;
    auto inplace = in;
    RANK_OK(WaitOp(
        c.ReduceScatter(inplace.data(), inplace.data() + r * n * elt, n, dt, {.predivide = pre})));
    std::vector<uint8_t> slot(inplace.begin() + r * n * elt, inplace.begin() + (r + 1) * n * elt);
    if (!(err = Compare("reduce_scatter in place", slot, want)).empty()) return err;
  }
  // all-reduce
  for (bool pre : {false, true}) {
    std::vector<float> want_f(n);
    for (size_t i = 0; i < n; ++i) {
      float s = 0;
      for (int q = 0; q < w; ++q) s += Value(q, i) * (pre ? 1.0f / w : 1.0f);
      want_f[i] = s;
    }
    const auto want = Encode(dt, want_f);
    auto buf = Encode(dt, Inputs(r, n));
    const auto in = buf;
    std::vector<uint8_t> out(buf.size(), 0xee);
    RANK_OK(WaitOp(c.AllReduce(in.data(), out.data(), n, dt, {.predivide = pre})));
    if (!(err = Compare("all_reduce", out, want)).empty()) return err;
    RANK_OK(WaitOp(c.AllReduce(buf.data(), buf.data(), n, dt, {.predivide = pre})));
    if (!(err = Compare("all_reduce in place", buf, want)).empty()) return err;
  }
  // broadcast from the last rank
  {
    const int root = w - 1;
    auto buf = r == root ? Encode(dt, Inputs(root, n)) : std::vector<uint8_t>(n * elt, 0);
    RANK_OK(WaitOp(c.Broadcast(buf.data(), n, dt, root)));
    if (!(err = Compare("broadcast", buf, Encode(dt, Inputs(root, n)))).empty()) return err;
  }
  RANK_OK(WaitOp(c.Barrier()));
  return "";
}

struct Param {
  int world;
  DType dtype;
};

class GlooAllOpsTest : public ::testing::TestWithParam<Param> {};

TEST_P(GlooAllOpsTest, EveryOpMatchesLocalReference) {
  const Param p = GetParam();
  const std::string dir = testing::UniqueTestDir("gloo_ops");
  auto codes = RunRanks(p.world, [&](int r) -> std::string {
    // scratch_elems 64: long buffers run in several segments, counts straddle segment edges.
    auto job = Connect(dir, r, p.world, /*scratch_elems=*/64);
    if (!job.ok()) return job.status().ToString();
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{13}, size_t{129}, size_t{1001}}) {
      std::string err = CheckAllOps(*job->comm, p.dtype, n);
      if (!err.empty()) return "n=" + std::to_string(n) + ": " + err;
    }
    return "";
  });
  for (int r = 0; r < p.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, GlooAllOpsTest,
                         ::testing::Values(Param{1, DType::kF32}, Param{1, DType::kBF16},
                                           Param{1, DType::kF16}, Param{2, DType::kF32},
                                           Param{2, DType::kBF16}, Param{2, DType::kF16},
                                           Param{4, DType::kF32}, Param{4, DType::kBF16},
                                           Param{4, DType::kF16}),
                         [](const auto& info) {
                           return "w" + std::to_string(info.param.world) + "_" +
                                  std::string(DTypeName(info.param.dtype));
                         });

TEST(GlooComm, Bf16SumIsAccumulatedInFp32AndRoundedOnce) {
  // 256 + 1 + 1 in bf16 step by step would round 257 back to 256 twice; in fp32 it is 258 exactly.
  const std::string dir = testing::UniqueTestDir("gloo_bf16acc");
  auto codes = RunRanks(3, [&](int r) -> std::string {
    auto job = Connect(dir, r, 3);
    if (!job.ok()) return job.status().ToString();
    const float v = r == 0 ? 256.0f : 1.0f;
    std::vector<bf16_t> in(3, FloatToBf16(v));
    bf16_t out{};
    RANK_OK(WaitOp(job->comm->ReduceScatter(in.data(), &out, 1, DType::kBF16)));
    RANK_CHECK(Bf16ToFloat(out) == 258.0f, "sum " + std::to_string(Bf16ToFloat(out)));
    bf16_t ar = FloatToBf16(v);
    RANK_OK(WaitOp(job->comm->AllReduce(&ar, &ar, 1, DType::kBF16)));
    RANK_CHECK(Bf16ToFloat(ar) == 258.0f, "all_reduce sum " + std::to_string(Bf16ToFloat(ar)));
    return "";
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(GlooComm, ByteCountsFollowRingFormulas) {
  const std::string dir = testing::UniqueTestDir("gloo_bytes");
  constexpr int kWorld = 4;
  auto codes = RunRanks(kWorld, [&](int r) -> std::string {
    auto job = Connect(dir, r, kWorld);
    if (!job.ok()) return job.status().ToString();
    Communicator& c = *job->comm;
    std::vector<bf16_t> shard(100), full(400);
    RANK_OK(WaitOp(c.AllGather(shard.data(), full.data(), 100, DType::kBF16)));
    RANK_OK(WaitOp(c.ReduceScatter(full.data(), shard.data(), 100, DType::kBF16)));
    RANK_OK(WaitOp(c.AllReduce(full.data(), full.data(), 400, DType::kBF16)));
    RANK_OK(WaitOp(c.Broadcast(full.data(), 400, DType::kBF16, 2)));
    const CommStats s = c.stats();
    // 400 bf16 = 800 payload bytes; a ring moves 3/4 of it for AG and RS, 6/4 for AR.
    RANK_CHECK(s.of(CommOp::kAllGather).payload_bytes == 800, "ag payload");
    RANK_CHECK(s.of(CommOp::kAllGather).sent_bytes == 600, "ag sent");
    RANK_CHECK(s.of(CommOp::kReduceScatter).received_bytes == 600, "rs received");
    RANK_CHECK(s.of(CommOp::kAllReduce).sent_bytes == 1200, "ar sent");
    RANK_CHECK(s.of(CommOp::kBroadcast).sent_bytes == (r == 2 ? 800u : 0u), "bc sent");
    RANK_CHECK(s.of(CommOp::kBroadcast).received_bytes == (r == 2 ? 0u : 800u), "bc received");
    RANK_CHECK(s.total_sent_bytes() == 600 + 600 + 1200 + (r == 2 ? 800u : 0u), "total");
    // Measured on the wire: the all-gather moves the ideal bytes; the bf16 reduce-scatter sends
    // fp32 partial sums (2x: 3 steps x 100 x 4 B); the bf16 all-reduce is that ring over
    // 100-element chunks plus a bf16 all-gather of 3 chunks (1200 + 600 = 1.5x the ideal 1200).
    const auto& ag = s.of(CommOp::kAllGather);
    const auto& rs = s.of(CommOp::kReduceScatter);
    const auto& ar = s.of(CommOp::kAllReduce);
    RANK_CHECK(ag.wire_sent_bytes == 600 && ag.wire_received_bytes == 600, "ag wire");
    RANK_CHECK(rs.wire_sent_bytes == 1200 && rs.wire_received_bytes == 1200,
               "rs wire " + std::to_string(rs.wire_sent_bytes));
    RANK_CHECK(ar.wire_sent_bytes == 1800 && ar.wire_received_bytes == 1800,
               "ar wire " + std::to_string(ar.wire_sent_bytes));
    RANK_CHECK(s.total_wire_sent_bytes() >= s.total_sent_bytes(), "wire below ideal");
    // fp32 reductions need no widening: wire == ideal.
    c.ResetStats();
    std::vector<float> f(400);
    std::vector<float> fs(100);
    RANK_OK(WaitOp(c.ReduceScatter(f.data(), fs.data(), 100, DType::kF32)));
    RANK_CHECK(c.stats().of(CommOp::kReduceScatter).wire_sent_bytes ==
                   c.stats().of(CommOp::kReduceScatter).sent_bytes,
               "fp32 rs wire");
    return "";
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(GlooComm, SetupRemovesItsRendezvousKeys) {
  // A store directory reused by a later run must not hand out this run's (then dead) addresses.
  const std::string dir = testing::UniqueTestDir("gloo_cleanup");
  auto codes = RunRanks(2, [&](int r) -> std::string {
    auto job = Connect(dir, r, 2);
    if (!job.ok()) return job.status().ToString();
    return "";
  });
  ASSERT_EQ(codes[0], 0);
  ASSERT_EQ(codes[1], 0);
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir)) left.push_back(e.path().string());
  EXPECT_TRUE(left.empty()) << left.size() << " keys left, e.g. " << left[0];
}

TEST(GlooComm, ManyOpsInFlightCompleteInOrder) {
  const std::string dir = testing::UniqueTestDir("gloo_async");
  auto codes = RunRanks(2, [&](int r) -> std::string {
    Job job;
    auto fs = cpu::FileKvStore::Open(dir);
    if (!fs.ok()) return fs.status().ToString();
    job.store = std::move(*fs);
    GlooCommOptions o;
    o.rank = r;
    o.world_size = 2;
    o.store = job.store.get();
    o.queue_depth = 3;  // submitting 16 ops waits for room: the queue stays bounded
    o.timeout = milliseconds(30000);
    auto comm = CreateGlooCommunicator(o);
    if (!comm.ok()) return comm.status().ToString();
    std::vector<std::vector<float>> bufs(16, std::vector<float>(33));
    std::vector<CommHandle> hs;
    for (size_t k = 0; k < bufs.size(); ++k) {
      for (size_t i = 0; i < 33; ++i) bufs[k][i] = static_cast<float>(k + i + r);
      auto h = (*comm)->AllReduce(bufs[k].data(), bufs[k].data(), 33, DType::kF32);
      if (!h.ok()) return h.status().ToString();
      hs.push_back(*h);
    }
    for (size_t k = 0; k < hs.size(); ++k) {
      RANK_OK(hs[k].WaitFor(milliseconds(30000)));
      for (size_t i = 0; i < 33; ++i) {
        RANK_CHECK(bufs[k][i] == static_cast<float>(2 * (k + i) + 1), "wrong sum");
      }
    }
    return "";
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

TEST(GlooComm, WaitPastItsDeadlineLeavesTheOperationRunning) {
  const std::string dir = testing::UniqueTestDir("gloo_wait");
  auto codes = RunRanks(2, [&](int r) -> std::string {
    auto job = Connect(dir, r, 2);
    if (!job.ok()) return job.status().ToString();
    if (r == 1) std::this_thread::sleep_for(milliseconds(500));  // joins late
    float x = static_cast<float>(r + 1);
    auto h = job->comm->AllReduce(&x, &x, 1, DType::kF32);
    if (!h.ok()) return h.status().ToString();
    if (r == 0) {
      const Status early = h->WaitFor(milliseconds(10));
      RANK_CHECK(early.code() == Status::Code::kDeadlineExceeded, early.ToString());
      RANK_CHECK(!h->Ready(), "ready before the peer joined");
    }
    RANK_OK(h->WaitFor(milliseconds(20000)));  // the same handle completes later
    RANK_CHECK(h->Ready() && x == 3.0f, "sum " + std::to_string(x));
    return "";
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

TEST(GlooComm, AbortWakesASubmitterWaitingForQueueSpace) {
  const std::string dir = testing::UniqueTestDir("gloo_abort_full");
  int release[2];
  ASSERT_EQ(::pipe(release), 0);  // rank 0 -> rank 1: "you may exit now"
  auto codes = RunRanks(2, [&](int r) -> std::string {
    auto fs = cpu::FileKvStore::Open(dir);
    if (!fs.ok()) return fs.status().ToString();
    GlooCommOptions o;
    o.rank = r;
    o.world_size = 2;
    o.store = fs->get();
    o.timeout = milliseconds(20000);
    o.queue_depth = 1;
    auto comm = CreateGlooCommunicator(o);
    if (!comm.ok()) return comm.status().ToString();
    if (r == 1) {  // joins no collective until rank 0 is done, then exits
      pollfd p{release[0], POLLIN, 0};
      ::poll(&p, 1, 20000);
      return "";
    }
    auto busy = (*comm)->Barrier();  // runs, waiting for rank 1: the queue is full
    if (!busy.ok()) return busy.status().ToString();
    std::promise<Status> blocked;
    auto result = blocked.get_future();
    std::thread submitter([&] {
      float x = 1;
      auto h = (*comm)->AllReduce(&x, &x, 1, DType::kF32);
      blocked.set_value(h.ok() ? Status::OK() : h.status());
    });
    std::this_thread::sleep_for(milliseconds(200));
    (*comm)->Abort("test abort");
    const bool woke = result.wait_for(std::chrono::seconds(8)) == std::future_status::ready;
    (void)!::write(release[1], "x", 1);  // lets rank 1 exit, which ends the barrier
    submitter.join();
    RANK_CHECK(woke, "the submitter still waited for queue space after Abort");
    const Status st = result.get();
    RANK_CHECK(st.code() == Status::Code::kAborted, st.ToString());
    RANK_CHECK(st.ToString().find("test abort") != std::string::npos, st.ToString());
    return "";
  });
  ::close(release[0]);
  ::close(release[1]);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

TEST(GlooComm, RankThatExitsMakesOthersFailWithinDeadline) {
  const std::string dir = testing::UniqueTestDir("gloo_dies");
  constexpr int kWorld = 3;
  auto codes = RunRanks(
      kWorld,
      [&](int r) -> std::string {
        auto job = Connect(dir, r, kWorld, 1 << 20, milliseconds(20000));
        if (!job.ok()) return job.status().ToString();
        std::vector<float> buf(1 << 16, 1.0f);
        RANK_OK(WaitOp(job->comm->AllReduce(buf.data(), buf.data(), buf.size(), DType::kF32)));
        if (r == 1) ::_exit(0);  // dies without closing anything, before the next collective
        const auto t0 = std::chrono::steady_clock::now();
        auto h = job->comm->AllReduce(buf.data(), buf.data(), buf.size(), DType::kF32);
        if (!h.ok()) return h.status().ToString();
        const Status st = h->WaitFor(milliseconds(25000));
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        RANK_CHECK(!st.ok(), "all_reduce succeeded without rank 1");
        RANK_CHECK(st.code() != Status::Code::kDeadlineExceeded ||
                       st.message().find("not finished by the wait deadline") == std::string::npos,
                   "the wait itself timed out (hang): " + st.ToString());
        RANK_CHECK(st.message().find("gloo all_reduce") != std::string::npos,
                   "message does not name the op: " + st.ToString());
        std::fprintf(stderr, "[rank %d] failed after %.2f s as expected: %s\n", r, s,
                     st.ToString().c_str());
        // The communicator is now failed: later ops fail fast and name the first error.
        auto again = job->comm->Barrier();
        RANK_CHECK(!again.ok() && again.status().code() == Status::Code::kAborted,
                   "later op did not fail fast");
        return "";
      },
      std::chrono::seconds(60));
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(GlooComm, RankThatExitsDuringACollectiveMakesOthersFail) {
  const std::string dir = testing::UniqueTestDir("gloo_dies_mid");
  constexpr int kWorld = 4;
  auto codes = RunRanks(
      kWorld,
      [&](int r) -> std::string {
        auto job = Connect(dir, r, kWorld, 1 << 12, milliseconds(20000));
        if (!job.ok()) return job.status().ToString();
        // 32 MiB in 4 Ki-element segments: over 6000 dependent ring steps, far longer than the 5 ms
        // after which rank 2 dies, and no rank can finish without rank 2's last steps.
        std::vector<float> buf(8 << 20, 1.0f);
        auto h = job->comm->ReduceScatter(buf.data(), buf.data() + r * (buf.size() / kWorld),
                                          buf.size() / kWorld, DType::kF32);
        if (!h.ok()) return h.status().ToString();
        if (r == 2) {
          std::this_thread::sleep_for(milliseconds(5));
          ::_exit(0);
        }
        const Status st = h->WaitFor(milliseconds(25000));
        RANK_CHECK(!st.ok(), "reduce-scatter succeeded although rank 2 died during it");
        RANK_CHECK(st.message().find("not finished by the wait deadline") == std::string::npos,
                   "hang: " + st.ToString());
        RANK_CHECK(st.message().find("gloo reduce_scatter") != std::string::npos, st.ToString());
        return "";
      },
      std::chrono::seconds(60));
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(GlooComm, HungPeerMakesOthersFailAtTheTimeout) {
  const std::string dir = testing::UniqueTestDir("gloo_hangs");
  auto codes = RunRanks(
      2,
      [&](int r) -> std::string {
        auto job = Connect(dir, r, 2, 1 << 20, milliseconds(500));
        if (!job.ok()) return job.status().ToString();
        if (r == 1) {  // alive but never joins the collective
          std::this_thread::sleep_for(std::chrono::seconds(3));
          ::_exit(0);
        }
        float x = 1;
        auto h = job->comm->AllReduce(&x, &x, 1, DType::kF32);
        if (!h.ok()) return h.status().ToString();
        const Status st = h->WaitFor(milliseconds(20000));
        RANK_CHECK(st.code() == Status::Code::kDeadlineExceeded,
                   "expected a timeout: " + st.ToString());
        RANK_CHECK(st.message().find("gloo all_reduce") != std::string::npos, st.ToString());
        return "";
      },
      std::chrono::seconds(30));
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

TEST(GlooComm, MissingPeerGivesClearRendezvousError) {
  const std::string dir = testing::UniqueTestDir("gloo_missing");
  auto job = Connect(dir, 0, 2, 1 << 20, milliseconds(300));  // rank 1 never starts
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), Status::Code::kDeadlineExceeded) << job.status().ToString();
  EXPECT_NE(job.status().ToString().find("gloo rendezvous (rank 0 of 2"), std::string::npos)
      << job.status().ToString();
}

TEST(GlooComm, BadTransportHostnameGivesClearError) {
  auto fs = cpu::FileKvStore::Open(testing::UniqueTestDir("gloo_badhost"));
  ASSERT_TRUE(fs.ok());
  GlooCommOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.store = fs->get();
  o.hostname = "no-such-host.invalid";
  o.timeout = milliseconds(500);
  auto c = CreateGlooCommunicator(o);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().ToString().find("transport on 'no-such-host.invalid'"), std::string::npos)
      << c.status().ToString();
  o.hostname = "127.0.0.1";
  o.store = nullptr;
  EXPECT_TRUE(CreateGlooCommunicator(o).status().IsInvalidArgument());
  o.rank = 2;
  EXPECT_TRUE(CreateGlooCommunicator(o).status().IsInvalidArgument());
}

TEST(GlooComm, InvalidArgumentsAreRejectedBeforeEnqueue) {
  auto job = Connect(testing::UniqueTestDir("gloo_args"), 0, 1);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  Communicator& c = *job->comm;
  std::vector<float> a(8), b(8);
  EXPECT_TRUE(c.AllReduce(a.data(), b.data(), 8, DType::kI8).status().IsInvalidArgument());
  EXPECT_TRUE(c.AllReduce(nullptr, b.data(), 8, DType::kF32).status().IsInvalidArgument());
  EXPECT_TRUE(c.AllReduce(a.data(), a.data() + 1, 4, DType::kF32).status().IsInvalidArgument());
  EXPECT_TRUE(c.Broadcast(a.data(), 8, DType::kF32, 1).status().IsInvalidArgument());
  c.Abort("test");
  auto h = c.Barrier();
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Status::Code::kAborted);
  EXPECT_NE(h.status().ToString().find("test"), std::string::npos);
  // Neither rejected nor refused operations are counted.
  EXPECT_EQ(c.stats().of(CommOp::kAllReduce).calls, 0u);
  EXPECT_EQ(c.stats().of(CommOp::kBarrier).calls, 0u);
}

TEST(GlooComm, TcpStoreRendezvousWorks) {
  // Port from the kernel (bind 0), released just before use: a small race, acceptable in tests.
  int port = 0;
  {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    socklen_t len = sizeof(a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    ::close(fd);
  }
  auto codes = RunRanks(2, [&](int r) -> std::string {
    cpu::TcpKvStoreOptions so;
    so.host = "127.0.0.1";
    so.port = port;
    so.is_server = r == 0;
    so.timeout = milliseconds(20000);
    so.secret = "gloo-test-secret-0123456789";
    auto store = cpu::TcpKvStore::Open(so);
    if (!store.ok()) return store.status().ToString();
    GlooCommOptions o;
    o.rank = r;
    o.world_size = 2;
    o.store = store->get();
    auto comm = CreateGlooCommunicator(o);
    if (!comm.ok()) return comm.status().ToString();
    return CheckAllOps(**comm, DType::kF32, 9);
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

}  // namespace
}  // namespace strata
