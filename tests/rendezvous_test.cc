// Rendezvous configuration from the environment and the two stores, including the errors a user
// sees for bad settings.
#include "cpu/rendezvous/rendezvous.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <future>
#include <map>
#include <memory>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <thread>

#include "tests/multiprocess.h"
#include "tests/rendezvous_wire.h"

namespace strata {
namespace {

using std::chrono::milliseconds;

Result<cpu::RendezvousConfig> FromMap(const std::map<std::string, std::string>& env) {
  return cpu::RendezvousConfig::FromEnv([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

constexpr char kSecret[] = "0123456789abcdef-test-secret";

// Options for a store on `host`:`port` with the tests' secret.
cpu::TcpKvStoreOptions Tcp(const std::string& host, int port, bool is_server, milliseconds timeout,
                           int max_clients = cpu::TcpKvStore::kMaxClients) {
  return {.host = host,
          .port = port,
          .is_server = is_server,
          .timeout = timeout,
          .secret = kSecret,
          .max_clients = max_clients};
}

void ExpectInvalid(const std::map<std::string, std::string>& env, const std::string& needle) {
  auto c = FromMap(env);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(c.status().IsInvalidArgument()) << c.status().ToString();
  EXPECT_NE(c.status().ToString().find(needle), std::string::npos) << c.status().ToString();
}

TEST(RendezvousConfig, ReadsTorchrunVariables) {
  auto c = FromMap({{"RANK", "3"},
                    {"WORLD_SIZE", "4"},
                    {"LOCAL_RANK", "1"},
                    {"MASTER_ADDR", "127.0.0.1"},
                    {"MASTER_PORT", "29500"},
                    {"STRATA_RDZV_SECRET", kSecret}});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rank, 3);
  EXPECT_EQ(c->world_size, 4);
  EXPECT_EQ(c->local_rank, 1);
  EXPECT_EQ(c->master_addr, "127.0.0.1");
  EXPECT_EQ(c->master_port, 29500);
  EXPECT_EQ(c->secret, kSecret);
  EXPECT_TRUE(c->file_dir.empty());
  auto f = FromMap({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"STRATA_RDZV_DIR", "/tmp/x"}});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->local_rank, 0);  // defaults to RANK
  EXPECT_EQ(f->file_dir, "/tmp/x");
}

// The public entry (strata/comm.h): a launched rank's place and store from its environment, as
// an embedding C++ trainer starts its communicator under offloadctl launch or torchrun.
TEST(OpenLaunchRendezvous, GivesTheRankAndAStoreTheRanksShare) {
  const std::string dir = ::testing::TempDir() + "launch_rdzv_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("STRATA_RDZV_DIR", dir.c_str(), 1);
  ::setenv("STRATA_RUN_ID", "launch-test", 1);
  ::setenv("RANK", "0", 1);
  auto r0 = OpenLaunchRendezvous();
  ::setenv("RANK", "1", 1);
  auto r1 = OpenLaunchRendezvous();
  ::unsetenv("RANK");
  auto missing = OpenLaunchRendezvous();
  for (const char* k : {"WORLD_SIZE", "STRATA_RDZV_DIR", "STRATA_RUN_ID"}) ::unsetenv(k);
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r0->rank, 0);
  EXPECT_EQ(r1->rank, 1);
  EXPECT_EQ(r1->world_size, 2);
  const std::vector<uint8_t> v = {1, 2, 3};
  ASSERT_TRUE(r0->store->Set("k", v).ok());
  auto got = r1->store->Get("k", std::chrono::milliseconds(5000));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, v);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("RANK"), std::string::npos)
      << missing.status().ToString();
  std::filesystem::remove_all(dir);
}

TEST(RendezvousConfig, BadSettingsNameTheVariable) {
  const std::map<std::string, std::string> ok = {{"RANK", "0"},
                                                 {"WORLD_SIZE", "2"},
                                                 {"MASTER_ADDR", "127.0.0.1"},
                                                 {"MASTER_PORT", "29500"},
                                                 {"STRATA_RDZV_SECRET", kSecret}};
  auto with = [&](const std::string& k, const std::string& v) {
    auto m = ok;
    if (v.empty()) {
      m.erase(k);
    } else {
      m[k] = v;
    }
    return m;
  };
  ExpectInvalid(with("RANK", ""), "RANK is not set");
  ExpectInvalid(with("RANK", "one"), "RANK='one' is not an integer");
  ExpectInvalid(with("RANK", "2"), "RANK=2 must be in [0, WORLD_SIZE=2)");
  ExpectInvalid(with("WORLD_SIZE", "0"), "WORLD_SIZE=0");
  ExpectInvalid(with("MASTER_ADDR", ""), "MASTER_ADDR is not set");
  ExpectInvalid(with("MASTER_PORT", ""), "MASTER_PORT is not set");
  ExpectInvalid(with("MASTER_PORT", "70000"), "MASTER_PORT=70000");
  ExpectInvalid(with("MASTER_PORT", "29500x"), "is not an integer");
}

TEST(TcpKvStore, UnresolvableHostAndAbsentServerGiveClearErrors) {
  auto bad = cpu::TcpKvStore::Open(Tcp("no-such-host.invalid", 29500, false, milliseconds(200)));
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(bad.status().IsInvalidArgument()) << bad.status().ToString();
  EXPECT_NE(bad.status().ToString().find("no-such-host.invalid"), std::string::npos);
  // Port 1 on loopback: nobody listens (and we are not allowed to), so connect is refused.
  const auto t0 = std::chrono::steady_clock::now();
  auto absent = cpu::TcpKvStore::Open(Tcp("127.0.0.1", 1, false, milliseconds(300)));
  ASSERT_FALSE(absent.ok());
  EXPECT_TRUE(absent.status().IsDeadlineExceeded()) << absent.status().ToString();
  EXPECT_NE(absent.status().ToString().find("127.0.0.1:1"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

// connect() itself keeps to the timeout. A listener whose accept queue is full drops SYNs, and a
// blocking connect to it waited out the kernel's SYN retries (over 2 minutes) whatever the
// rendezvous timeout said. Open runs on its own thread, so a hang fails the test instead of
// blocking the binary.
TEST(TcpKvStore, ConnectKeepsToTheTimeout) {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 0), 0);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  // Fill the accept queue (backlog 0 holds one) with connections nobody accepts.
  std::vector<int> fillers;
  for (int i = 0; i < 3; ++i) {
    const int c = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    ::connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    fillers.push_back(c);
  }
  std::this_thread::sleep_for(milliseconds(200));
  auto done = std::make_shared<std::promise<Status>>();
  std::future<Status> result = done->get_future();
  const auto t0 = std::chrono::steady_clock::now();
  std::thread([done, port] {
    auto s = cpu::TcpKvStore::Open(Tcp("127.0.0.1", port, false, milliseconds(500)));
    done->set_value(s.ok() ? Status::OK() : s.status());
  }).detach();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "TcpKvStore::Open still in connect() after 20 s with a 500 ms timeout";
  const Status st = result.get();
  EXPECT_TRUE(st.IsDeadlineExceeded()) << st.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  for (int c : fillers) ::close(c);
  ::close(listener);
}

TEST(TcpKvStore, ServerAndClientsExchangeKeys) {
  // Let the kernel pick a port for the server: bind port 0 is not exposed, so probe a few.
  std::unique_ptr<cpu::TcpKvStore> server;
  int port = 0;
  for (int p = 29600 + (::getpid() % 2000); p < 29600 + (::getpid() % 2000) + 50 && !server; ++p) {
    auto s = cpu::TcpKvStore::Open(Tcp("127.0.0.1", p, true, milliseconds(2000)));
    if (s.ok()) {
      server = std::move(*s);
      port = p;
    }
  }
  ASSERT_TRUE(server) << "no free port";
  auto client = cpu::TcpKvStore::Open(Tcp("127.0.0.1", port, false, milliseconds(2000)));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  std::thread late([&] {
    std::this_thread::sleep_for(milliseconds(50));
    const std::vector<uint8_t> v = {1, 2, 3};
    EXPECT_TRUE(server->Set("k/late", v).ok());
  });
  auto got = (*client)->Get("k/late", milliseconds(5000));  // waits for the key
  late.join();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, (std::vector<uint8_t>{1, 2, 3}));
  auto missing = (*client)->Get("k/never", milliseconds(100));
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(missing.status().IsDeadlineExceeded());
  EXPECT_NE(missing.status().ToString().find("k/never"), std::string::npos);
  // Oversized keys are refused before anything is sent.
  const Status big = (*client)->Set(std::string(5000, 'k'), std::vector<uint8_t>{1});
  EXPECT_TRUE(big.IsInvalidArgument()) << big.ToString();
  // Server gone: the client fails instead of hanging.
  server.reset();
  auto after = (*client)->Get("k/late", milliseconds(1000));
  EXPECT_FALSE(after.ok());
}

TEST(FileKvStore, SetGetAndTimeout) {
  auto s = cpu::FileKvStore::Open(testing::UniqueTestDir("filekv"));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const std::vector<uint8_t> v = {9, 8};
  ASSERT_TRUE((*s)->Set("a/b c", v).ok());
  auto got = (*s)->Get("a/b c", milliseconds(100));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, v);
  auto missing = (*s)->Get("zzz", milliseconds(50));
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(missing.status().IsDeadlineExceeded());
  auto notdir = cpu::FileKvStore::Open("/proc/version");
  EXPECT_FALSE(notdir.ok());
}

// A key too long for a file name (255 bytes) worked for the TCP store but failed here with
// ENAMETOOLONG: such keys are stored under a prefix and their SHA-256, distinct from each other.
TEST(FileKvStore, KeysLongerThanAFileNameWork) {
  auto s = cpu::FileKvStore::Open(testing::UniqueTestDir("filekv-long"));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const std::string a = std::string(300, 'k') + "a";
  const std::string b = std::string(300, 'k') + "b";
  const std::string slashes(1000, '/');  // 3000 bytes escaped
  const std::string at_limit(200, 'x');  // the longest stored as itself
  for (const std::string* key : {&a, &b, &slashes, &at_limit}) {
    const std::vector<uint8_t> v(key->begin() + static_cast<ptrdiff_t>(key->size()) - 1,
                                 key->end());
    const Status set = (*s)->Set(*key, v);
    ASSERT_TRUE(set.ok()) << key->size() << " bytes: " << set.ToString();
  }
  for (const std::string* key : {&a, &b, &slashes, &at_limit}) {
    auto got = (*s)->Get(*key, milliseconds(100));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, std::vector<uint8_t>(1, static_cast<uint8_t>(key->back())));
  }
  ASSERT_TRUE((*s)->Delete(a).ok());
  EXPECT_TRUE((*s)->Get(a, milliseconds(20)).status().IsDeadlineExceeded());
  EXPECT_TRUE((*s)->Get(b, milliseconds(20)).ok());
}

TEST(RendezvousConfig, RunIdScopesKeysSoAReusedDirectoryHoldsNoStaleValues) {
  const std::string dir = testing::UniqueTestDir("rdzv_runid");
  auto torch = FromMap({{"RANK", "0"},
                        {"WORLD_SIZE", "1"},
                        {"STRATA_RDZV_DIR", dir},
                        {"TORCHELASTIC_RUN_ID", "job7"},
                        {"STRATA_RUN_ID", "other"}});
  ASSERT_TRUE(torch.ok()) << torch.status().ToString();
  EXPECT_EQ(torch->run_id, "job7");  // torchrun's wins
  auto run1 = FromMap(
      {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"STRATA_RDZV_DIR", dir}, {"STRATA_RUN_ID", "run1"}});
  auto run2 = FromMap(
      {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"STRATA_RDZV_DIR", dir}, {"STRATA_RUN_ID", "run2"}});
  ASSERT_TRUE(run1.ok() && run2.ok());
  EXPECT_EQ(run1->run_id, "run1");
  auto s1 = cpu::OpenRendezvousStore(*run1);
  auto s2 = cpu::OpenRendezvousStore(*run2);
  ASSERT_TRUE(s1.ok() && s2.ok());
  const std::vector<uint8_t> old_addr = {1, 2, 3};
  ASSERT_TRUE((*s1)->Set("strata/gloo/rank_0", old_addr).ok());
  // The second run does not see the first run's value under the same key.
  auto stale = (*s2)->Get("strata/gloo/rank_0", milliseconds(50));
  EXPECT_TRUE(stale.status().IsDeadlineExceeded()) << stale.status().ToString();
  // Deleting removes the file; deleting an absent key is fine.
  ASSERT_TRUE((*s1)->Delete("strata/gloo/rank_0").ok());
  EXPECT_TRUE((*s1)->Delete("strata/gloo/rank_0").ok());
  EXPECT_TRUE((*s1)->Get("strata/gloo/rank_0", milliseconds(20)).status().IsDeadlineExceeded());
  auto too_long = FromMap({{"RANK", "0"},
                           {"WORLD_SIZE", "1"},
                           {"STRATA_RDZV_DIR", dir},
                           {"STRATA_RUN_ID", std::string(300, 'x')}});
  EXPECT_TRUE(too_long.status().IsInvalidArgument());
}

TEST(TcpKvStore, ARequestThatTimedOutMakesTheConnectionUnusable) {
  // A slow server: it answers the first GET only after the client gave up, with value "A". The
  // client must not read that late reply as the answer to its next request.
  testing::FakeRankZero server(kSecret, [](int c) {
    char buf[256];
    pollfd q{c, POLLIN, 0};
    if (::poll(&q, 1, 5000) == 1) (void)::recv(c, buf, sizeof(buf), 0);  // request 1
    std::this_thread::sleep_for(milliseconds(400));  // past the client's timeout
    const uint8_t reply[] = {1, 1, 0, 0, 0, 'A'};    // found, len 1, "A"
    (void)::send(c, reply, sizeof(reply), MSG_NOSIGNAL);
    if (::poll(&q, 1, 2000) == 1) (void)::recv(c, buf, sizeof(buf), 0);  // request 2, if any
    (void)::send(c, reply, sizeof(reply), MSG_NOSIGNAL);
    std::this_thread::sleep_for(milliseconds(200));
  });
  ASSERT_GT(server.port(), 0);
  auto client = cpu::TcpKvStore::Open(Tcp("127.0.0.1", server.port(), false, milliseconds(150)));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto first = (*client)->Get("slow", milliseconds(10));
  EXPECT_TRUE(first.status().IsDeadlineExceeded()) << first.status().ToString();
  std::this_thread::sleep_for(milliseconds(600));  // the late reply has arrived by now
  auto second = (*client)->Get("other", milliseconds(10));
  ASSERT_FALSE(second.ok()) << "read a stale reply: "
                            << std::string(second->begin(), second->end());
  EXPECT_TRUE(second.status().IsUnavailable()) << second.status().ToString();
  EXPECT_NE(second.status().ToString().find("earlier failure"), std::string::npos)
      << second.status().ToString();
  EXPECT_TRUE((*client)->Set("k", std::vector<uint8_t>{1}).IsUnavailable());
}

std::unique_ptr<cpu::TcpKvStore> ServerOnSomePort(int* port, int max_clients) {
  for (int p = 33600 + (::getpid() % 2000); p < 33600 + (::getpid() % 2000) + 50; ++p) {
    auto s = cpu::TcpKvStore::Open(Tcp("127.0.0.1", p, true, milliseconds(2000), max_clients));
    if (s.ok()) {
      *port = p;
      return std::move(*s);
    }
  }
  return nullptr;
}

TEST(TcpKvStore, ServerForgetsClientsThatLeft) {
  // More clients over its lifetime than it may serve at once: each one must still be served.
  int port = 0;
  auto server = ServerOnSomePort(&port, cpu::TcpKvStore::kMaxClients);
  ASSERT_TRUE(server) << "no free port";
  for (int i = 0; i < cpu::TcpKvStore::kMaxClients + 100; ++i) {
    auto c = cpu::TcpKvStore::Open(Tcp("127.0.0.1", port, false, milliseconds(2000)));
    ASSERT_TRUE(c.ok()) << "client " << i << ": " << c.status().ToString();
    const Status st = (*c)->Set("k", std::vector<uint8_t>{static_cast<uint8_t>(i)});
    ASSERT_TRUE(st.ok()) << "client " << i << ": " << st.ToString();
  }
  EXPECT_LT(server->live_clients(), 64);  // the ones that left were reaped
}

TEST(TcpKvStore, AClientOverTheLimitGetsAClearError) {
  int port = 0;
  auto server = ServerOnSomePort(&port, /*max_clients=*/2);  // the server's own client is one
  ASSERT_TRUE(server) << "no free port";
  auto a = cpu::TcpKvStore::Open(Tcp("127.0.0.1", port, false, milliseconds(2000)));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE((*a)->Set("a", std::vector<uint8_t>{1}).ok());
  // Every slot is held by an authenticated client: the next one is refused as it connects.
  auto b = cpu::TcpKvStore::Open(Tcp("127.0.0.1", port, false, milliseconds(2000)));
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(b.status().IsUnavailable()) << b.status().ToString();
  EXPECT_NE(b.status().ToString().find("too many connections"), std::string::npos)
      << b.status().ToString();
  // Once a client leaves, a new one is served (as soon as the server saw the first one close).
  a->reset();
  bool served = false;
  for (int attempt = 0; attempt < 100 && !served; ++attempt) {
    auto c = cpu::TcpKvStore::Open(Tcp("127.0.0.1", port, false, milliseconds(2000)));
    served = c.ok() && (*c)->Set("c", std::vector<uint8_t>{1}).ok();
    if (!served) std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_TRUE(served);
}

TEST(TcpKvStore, DeleteRemovesAKey) {
  std::unique_ptr<cpu::TcpKvStore> server;
  for (int p = 31600 + (::getpid() % 2000); p < 31600 + (::getpid() % 2000) + 50 && !server; ++p) {
    auto s = cpu::TcpKvStore::Open(Tcp("127.0.0.1", p, true, milliseconds(2000)));
    if (s.ok()) server = std::move(*s);
  }
  ASSERT_TRUE(server) << "no free port";
  ASSERT_TRUE(server->Set("k", std::vector<uint8_t>{7}).ok());
  ASSERT_TRUE(server->Get("k", milliseconds(100)).ok());
  ASSERT_TRUE(server->Delete("k").ok());
  EXPECT_TRUE(server->Delete("k").ok());
  EXPECT_TRUE(server->Get("k", milliseconds(50)).status().IsDeadlineExceeded());
}

}  // namespace
}  // namespace strata
