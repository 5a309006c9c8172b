// Sub-communicators (Split, SplitHierarchical) and all-to-all over Gloo on loopback (forked ranks):
// group membership and order, collectives inside the groups against a local reference, the
// intra/inter byte accounting a hierarchical caller reports, int8 data movement, all-to-all's
// validation, a rank dying during all-to-all, and LOCAL_WORLD_SIZE parsing.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>

#include "cpu/gloo_comm.h"
#include "cpu/rendezvous/rendezvous.h"
#include "tests/multiprocess.h"

namespace strata {
namespace {

using std::chrono::milliseconds;
using testing::RunRanks;

#define RANK_CHECK(cond, msg)             \
  do {                                    \
    if (!(cond)) return std::string(msg); \
  } while (0)
#define RANK_OK(expr)                                                 \
  do {                                                                \
    const Status s_ = (expr);                                         \
    if (!s_.ok()) return std::string(#expr) + " -> " + s_.ToString(); \
  } while (0)

struct Job {
  std::unique_ptr<KvStore> store;
  std::unique_ptr<Communicator> comm;
};

Result<Job> Connect(const std::string& dir, int rank, int world,
                    milliseconds timeout = milliseconds(30000)) {
  Job job;
  STRATA_ASSIGN_OR_RETURN(auto fs, cpu::FileKvStore::Open(dir));
  job.store = std::move(fs);
  GlooCommOptions o;
  o.rank = rank;
  o.world_size = world;
  o.store = job.store.get();
  o.timeout = timeout;
  STRATA_ASSIGN_OR_RETURN(job.comm, CreateGlooCommunicator(o));
  return job;
}

Status WaitOp(Result<CommHandle> h) {
  if (!h.ok()) return h.status();
  return h->WaitFor(milliseconds(30000));
}

// All-to-all of int8 (the qgZ layout): rank r's chunk j element i is a value naming (r, j, i);
// after the exchange chunk j of recv must be rank j's chunk r.
std::string CheckAllToAll(Communicator& c, size_t count) {
  const int w = c.world_size(), r = c.rank();
  auto val = [](int from, int to, size_t i) {
    return static_cast<int8_t>((from * 31 + to * 7 + static_cast<int>(i)) % 251 - 125);
  };
  std::vector<int8_t> send(count * w), recv(count * w, 0);
  for (int j = 0; j < w; ++j) {
    for (size_t i = 0; i < count; ++i) send[j * count + i] = val(r, j, i);
  }
  RANK_OK(WaitOp(c.AllToAll(send.data(), recv.data(), count, DType::kI8)));
  for (int j = 0; j < w; ++j) {
    for (size_t i = 0; i < count; ++i) {
      RANK_CHECK(recv[j * count + i] == val(j, r, i),
                 "all_to_all: chunk " + std::to_string(j) + " element " + std::to_string(i));
    }
  }
  return "";
}

TEST(CommGroups, AllToAllMovesEveryChunkAndCountsItsBytes) {
  for (int world : {1, 3, 4}) {
    const std::string dir = testing::UniqueTestDir("a2a");
    auto codes = RunRanks(world, [&](int r) -> std::string {
      auto job = Connect(dir, r, world);
      if (!job.ok()) return job.status().ToString();
      Communicator& c = *job->comm;
      for (size_t n : {size_t{0}, size_t{1}, size_t{13}, size_t{4099}}) {
        std::string err = CheckAllToAll(c, n);
        if (!err.empty()) return "n=" + std::to_string(n) + ": " + err;
      }
      // fp32 with 100 elements per peer: payload 400 * w bytes, (w-1)/w of it leaves the rank.
      c.ResetStats();
      std::vector<float> s(100 * world), d(100 * world);
      for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<float>(r * 1000 + i);
      RANK_OK(WaitOp(c.AllToAll(s.data(), d.data(), 100, DType::kF32)));
      for (int j = 0; j < world; ++j) {
        RANK_CHECK(d[j * 100 + 5] == static_cast<float>(j * 1000 + r * 100 + 5), "fp32 value");
      }
      const CommOpBytes a = c.stats().of(CommOp::kAllToAll);
      const uint64_t want = 400u * (world - 1);
      RANK_CHECK(a.calls == 1 && a.payload_bytes == 400u * world, "calls/payload");
      RANK_CHECK(a.sent_bytes == want && a.received_bytes == want, "ideal bytes");
      RANK_CHECK(a.wire_sent_bytes == want && a.wire_received_bytes == want, "wire bytes");
      return "";
    });
    for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "world " << world << " rank " << r;
  }
}

TEST(CommGroups, AllToAllValidatesBeforeEnqueue) {
  auto job = Connect(testing::UniqueTestDir("a2a_args"), 0, 1);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  Communicator& c = *job->comm;
  std::vector<float> a(16);
  EXPECT_TRUE(c.AllToAll(a.data(), a.data(), 8, DType::kF32).status().IsInvalidArgument());
  EXPECT_TRUE(c.AllToAll(a.data(), a.data() + 4, 8, DType::kF32).status().IsInvalidArgument());
  EXPECT_TRUE(c.AllToAll(nullptr, a.data(), 4, DType::kF32).status().IsInvalidArgument());
  EXPECT_TRUE(c.Split(-1, 0).status().IsInvalidArgument());
  EXPECT_EQ(c.stats().of(CommOp::kAllToAll).calls, 0u);
  c.Abort("test");
  auto h = c.AllToAll(a.data(), a.data() + 8, 8, DType::kF32);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Status::Code::kAborted);
  EXPECT_EQ(c.Split(0, 0).status().code(), Status::Code::kAborted);
}

TEST(CommGroups, SplitOrdersMembersByKeyThenRank) {
  // 5 ranks: colors {0,1,0,1,0}; keys reverse the order within color 0 and tie within color 1.
  const std::string dir = testing::UniqueTestDir("split_order");
  constexpr int kWorld = 5;
  auto codes = RunRanks(kWorld, [&](int r) -> std::string {
    auto job = Connect(dir, r, kWorld);
    if (!job.ok()) return job.status().ToString();
    const int color = r % 2;
    const int key = color == 0 ? -r : 7;
    auto sub = job->comm->Split(color, key);
    if (!sub.ok()) return sub.status().ToString();
    Communicator& s = **sub;
    const std::map<int, std::pair<int, int>> want = {
        {0, {2, 3}}, {2, {1, 3}}, {4, {0, 3}}, {1, {0, 2}}, {3, {1, 2}}};
    RANK_CHECK(s.rank() == want.at(r).first && s.world_size() == want.at(r).second,
               "sub rank " + std::to_string(s.rank()) + " of " + std::to_string(s.world_size()));
    // An all-gather inside the group lands each member's parent rank at its sub rank.
    float mine = static_cast<float>(r);
    std::vector<float> all(s.world_size(), -1);
    RANK_OK(WaitOp(s.AllGather(&mine, all.data(), 1, DType::kF32)));
    const std::vector<float> members =
        color == 0 ? std::vector<float>{4, 2, 0} : std::vector<float>{1, 3};
    RANK_CHECK(all == members, "members in the wrong order");
    // The parent still works after (and independently of) the split.
    float x = 1;
    RANK_OK(WaitOp(job->comm->AllReduce(&x, &x, 1, DType::kF32)));
    RANK_CHECK(x == kWorld, "parent all_reduce after split");
    // A split of a split.
    auto sub2 = s.Split(0, 0);
    if (!sub2.ok()) return sub2.status().ToString();
    RANK_CHECK((*sub2)->world_size() == s.world_size(), "split of split");
    RANK_OK(WaitOp((*sub2)->Barrier()));
    return "";
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(CommGroups, HierarchicalGroupsRunCollectivesAndCountTheirOwnBytes) {
  // 4 ranks as 2 nodes x 2: intra {0,1} {2,3}, inter {0,2} {1,3}. The hierarchical reduce-scatter
  // (reduce-scatter inside the node, then across nodes on the node's shard) equals the flat one.
  const std::string dir = testing::UniqueTestDir("hier");
  constexpr int kWorld = 4, kL = 2;
  constexpr size_t kShard = 6;  // elements each rank ends with
  auto codes = RunRanks(kWorld, [&](int r) -> std::string {
    auto job = Connect(dir, r, kWorld);
    if (!job.ok()) return job.status().ToString();
    auto h = SplitHierarchical(*job->comm, kL);
    if (!h.ok()) return h.status().ToString();
    Communicator& intra = *h->intra;
    Communicator& inter = *h->inter;
    RANK_CHECK(intra.rank() == r % kL && intra.world_size() == kL, "intra rank");
    RANK_CHECK(inter.rank() == r / kL && inter.world_size() == kWorld / kL, "inter rank");
    // Flat reference: element e of rank q's input is q * 100 + e.
    std::vector<float> in(kShard * kWorld);
    for (size_t e = 0; e < in.size(); ++e) in[e] = static_cast<float>(r * 100 + e);
    std::vector<float> flat(kShard);
    RANK_OK(WaitOp(job->comm->ReduceScatter(in.data(), flat.data(), kShard, DType::kF32)));
    // Hierarchical: chunk order so that intra rank l ends with the chunks of every rank whose
    // local index is l, i.e. global chunks {l, l + L}: the layout the inter step then splits.
    std::vector<float> permuted(in.size());
    for (int l = 0; l < kL; ++l) {
      for (int g = 0; g < kWorld / kL; ++g) {
        const int chunk = g * kL + l;
        std::memcpy(&permuted[(l * (kWorld / kL) + g) * kShard], &in[chunk * kShard],
                    kShard * sizeof(float));
      }
    }
    std::vector<float> partial(kShard * (kWorld / kL)), out(kShard);
    RANK_OK(WaitOp(
        intra.ReduceScatter(permuted.data(), partial.data(), kShard * (kWorld / kL), DType::kF32)));
    RANK_OK(WaitOp(inter.ReduceScatter(partial.data(), out.data(), kShard, DType::kF32)));
    RANK_CHECK(out == flat, "hierarchical reduce-scatter differs from the flat one");
    // Each sub-communicator counted only its own operation: intra moved (L-1)/L of the full
    // input, inter (N/L-1)/(N/L) of a node's share; the split itself counted nothing.
    const auto is = intra.stats().of(CommOp::kReduceScatter);
    const auto es = inter.stats().of(CommOp::kReduceScatter);
    RANK_CHECK(is.calls == 1 && is.wire_sent_bytes == in.size() * 4 / 2, "intra bytes");
    RANK_CHECK(es.calls == 1 && es.wire_sent_bytes == partial.size() * 4 / 2, "inter bytes");
    RANK_CHECK(intra.stats().of(CommOp::kAllGather).calls == 0, "split counted as an all-gather");
    RANK_CHECK(job->comm->stats().of(CommOp::kAllGather).calls == 0, "split counted on parent");
    // Sub-communicators run concurrently with each other (separate pairs, separate workers).
    float a = 1, b = 1;
    auto ha = intra.AllReduce(&a, &a, 1, DType::kF32);
    auto hb = inter.AllReduce(&b, &b, 1, DType::kF32);
    RANK_OK(WaitOp(std::move(ha)));
    RANK_OK(WaitOp(std::move(hb)));
    RANK_CHECK(a == kL && b == kWorld / kL, "concurrent sub all_reduce");
    // int8 all-gather inside the node (qwZ's quantized blocks).
    int8_t q = static_cast<int8_t>(-r);
    int8_t got[kL] = {};
    RANK_OK(WaitOp(intra.AllGather(&q, got, 1, DType::kI8)));
    RANK_CHECK(got[0] == -(r / kL * kL) && got[1] == -(r / kL * kL + 1), "int8 all_gather");
    return "";
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(CommGroups, SplitHierarchicalRejectsAGroupSizeThatDoesNotDivide) {
  auto job = Connect(testing::UniqueTestDir("hier_bad"), 0, 1);
  ASSERT_TRUE(job.ok());
  EXPECT_TRUE(SplitHierarchical(*job->comm, 0).status().IsInvalidArgument());
  EXPECT_TRUE(SplitHierarchical(*job->comm, 2).status().IsInvalidArgument());
  auto one = SplitHierarchical(*job->comm, 1);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->intra->world_size(), 1);
  EXPECT_EQ(one->inter->world_size(), 1);
}

TEST(CommGroups, RankThatExitsDuringAllToAllMakesOthersFail) {
  const std::string dir = testing::UniqueTestDir("a2a_dies");
  constexpr int kWorld = 3;
  auto codes = RunRanks(
      kWorld,
      [&](int r) -> std::string {
        auto job = Connect(dir, r, kWorld, milliseconds(20000));
        if (!job.ok()) return job.status().ToString();
        auto sub = job->comm->Split(0, r);
        if (!sub.ok()) return sub.status().ToString();
        if (r == 1) ::_exit(0);  // dies before the all-to-all
        std::vector<float> s(3 << 16, 1.0f), d(3 << 16);
        auto h = (*sub)->AllToAll(s.data(), d.data(), 1 << 16, DType::kF32);
        if (!h.ok()) return h.status().ToString();
        const Status st = h->WaitFor(milliseconds(25000));
        RANK_CHECK(!st.ok(), "all_to_all succeeded without rank 1");
        RANK_CHECK(st.message().find("not finished by the wait deadline") == std::string::npos,
                   "hang: " + st.ToString());
        RANK_CHECK(st.message().find("gloo all_to_all") != std::string::npos &&
                       st.message().find("split color 0") != std::string::npos,
                   "message does not name the op and group: " + st.ToString());
        auto again = (*sub)->Barrier();
        RANK_CHECK(!again.ok() && again.status().code() == Status::Code::kAborted,
                   "later op did not fail fast");
        return "";
      },
      std::chrono::seconds(60));
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

std::map<std::string, std::string> g_env;  // what FakeEnv returns
const char* FakeEnv(const char* name) {
  auto it = g_env.find(name);
  return it == g_env.end() ? nullptr : it->second.c_str();
}

TEST(CommGroups, RanksPerNodeFromEnv) {
  g_env.clear();
  EXPECT_EQ(RanksPerNodeFromEnv(8, FakeEnv).value(), 8);  // unset: one node
  g_env["LOCAL_WORLD_SIZE"] = "4";
  EXPECT_EQ(RanksPerNodeFromEnv(8, FakeEnv).value(), 4);
  g_env["LOCAL_RANK"] = "1";
  g_env["RANK"] = "5";
  EXPECT_EQ(RanksPerNodeFromEnv(8, FakeEnv).value(), 4);
  g_env["RANK"] = "6";
  auto bad = RanksPerNodeFromEnv(8, FakeEnv);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().ToString().find("node by node"), std::string::npos);
  g_env["RANK"] = "5";
  g_env["LOCAL_RANK"] = "4";
  EXPECT_NE(RanksPerNodeFromEnv(8, FakeEnv).status().ToString().find("LOCAL_RANK=4"),
            std::string::npos);
  g_env["LOCAL_RANK"] = "1";
  g_env["LOCAL_WORLD_SIZE"] = "3";
  EXPECT_NE(RanksPerNodeFromEnv(8, FakeEnv).status().ToString().find("divide WORLD_SIZE=8"),
            std::string::npos);
  g_env["LOCAL_WORLD_SIZE"] = "x";
  EXPECT_NE(RanksPerNodeFromEnv(8, FakeEnv).status().ToString().find("not an integer"),
            std::string::npos);
}

}  // namespace
}  // namespace strata
