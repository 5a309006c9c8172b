// Rendezvous configuration from the environment and the two stores, including the errors a user
// sees for bad settings.
#include "cpu/rendezvous.h"

#include <gtest/gtest.h>

#include <map>
#include <thread>

#include "tests/multiprocess.h"

namespace strata {
namespace {

using std::chrono::milliseconds;

Result<RendezvousConfig> FromMap(const std::map<std::string, std::string>& env) {
  return RendezvousConfig::FromEnv([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
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
                    {"MASTER_PORT", "29500"}});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rank, 3);
  EXPECT_EQ(c->world_size, 4);
  EXPECT_EQ(c->local_rank, 1);
  EXPECT_EQ(c->master_addr, "127.0.0.1");
  EXPECT_EQ(c->master_port, 29500);
  EXPECT_TRUE(c->file_dir.empty());
  auto f = FromMap({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"STRATA_RDZV_DIR", "/tmp/x"}});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->local_rank, 0);  // defaults to RANK
  EXPECT_EQ(f->file_dir, "/tmp/x");
}

TEST(RendezvousConfig, BadSettingsNameTheVariable) {
  const std::map<std::string, std::string> ok = {
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
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
  auto bad = TcpKvStore::Open("no-such-host.invalid", 29500, false, milliseconds(200));
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(bad.status().IsInvalidArgument()) << bad.status().ToString();
  EXPECT_NE(bad.status().ToString().find("no-such-host.invalid"), std::string::npos);
  // Port 1 on loopback: nobody listens (and we are not allowed to), so connect is refused.
  const auto t0 = std::chrono::steady_clock::now();
  auto absent = TcpKvStore::Open("127.0.0.1", 1, false, milliseconds(300));
  ASSERT_FALSE(absent.ok());
  EXPECT_TRUE(absent.status().IsDeadlineExceeded()) << absent.status().ToString();
  EXPECT_NE(absent.status().ToString().find("127.0.0.1:1"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

TEST(TcpKvStore, ServerAndClientsExchangeKeys) {
  // Let the kernel pick a port for the server: bind port 0 is not exposed, so probe a few.
  std::unique_ptr<TcpKvStore> server;
  int port = 0;
  for (int p = 29600 + (::getpid() % 2000); p < 29600 + (::getpid() % 2000) + 50 && !server; ++p) {
    auto s = TcpKvStore::Open("127.0.0.1", p, true, milliseconds(2000));
    if (s.ok()) {
      server = std::move(*s);
      port = p;
    }
  }
  ASSERT_TRUE(server) << "no free port";
  auto client = TcpKvStore::Open("127.0.0.1", port, false, milliseconds(2000));
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
  auto s = FileKvStore::Open(testing::UniqueTestDir("filekv"));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const std::vector<uint8_t> v = {9, 8};
  ASSERT_TRUE((*s)->Set("a/b c", v).ok());
  auto got = (*s)->Get("a/b c", milliseconds(100));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, v);
  auto missing = (*s)->Get("zzz", milliseconds(50));
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(missing.status().IsDeadlineExceeded());
  auto notdir = FileKvStore::Open("/proc/version");
  EXPECT_FALSE(notdir.ok());
}

}  // namespace
}  // namespace strata
