// The rendezvous stores against hostile peers and planted files (issue 12, sections 1 and 2):
// peers without the run's secret, malformed and oversized frames, a flood of idle connections,
// slowloris frames, announced-but-unsent values, symlinks and foreign directories. Everything
// runs on 127.0.0.1 and is bounded in time.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include "cpu/rendezvous/rendezvous.h"
#include "tests/multiprocess.h"
#include "tests/rendezvous_wire.h"

namespace strata {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
namespace wire = cpu::tcp_wire;

constexpr char kSecret[] = "security-test-secret-0123456789";

// ---- How the tests open stores: the only code here that names the stores' options. ----

struct Limits {
  int max_clients = cpu::TcpKvStore::kMaxClients;
  milliseconds handshake_timeout{10000};
  milliseconds idle_timeout{300000};
  uint64_t max_store_bytes = 256ull << 20;
};

cpu::TcpKvStoreOptions Options(int port, bool is_server, const std::string& secret,
                               const Limits& limits) {
  return {.host = "127.0.0.1",
          .port = port,
          .is_server = is_server,
          .timeout = milliseconds(3000),
          .secret = secret,
          .max_clients = limits.max_clients,
          .handshake_timeout = limits.handshake_timeout,
          .idle_timeout = limits.idle_timeout,
          .max_store_bytes = limits.max_store_bytes};
}

// Rank 0's store on a kernel-chosen port.
std::unique_ptr<cpu::TcpKvStore> StartServer(int* port, const Limits& limits = {}) {
  auto s = cpu::TcpKvStore::Open(Options(0, true, kSecret, limits));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  *port = (*s)->port();
  return std::move(*s);
}

Result<std::unique_ptr<cpu::TcpKvStore>> Join(int port, const std::string& secret = kSecret,
                                              const Limits& limits = {}) {
  return cpu::TcpKvStore::Open(Options(port, false, secret, limits));
}

// A raw connection that completed the handshake with the right secret (a misbehaving rank).
int AuthenticatedRaw(int port) {
  const int fd = testing::ConnectLoopback(port);
  if (fd >= 0 && testing::ClientHandshake(fd, kSecret)) return fd;
  if (fd >= 0) ::close(fd);
  return -1;
}

// ---- end of the seam ----

uint64_t RssBytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

bool WaitFor(const std::function<bool()>& cond, milliseconds limit = milliseconds(5000)) {
  const auto end = Clock::now() + limit;
  while (!cond()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return true;
}

std::string Str(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

TEST(TcpKvStoreSecurity, PeersWithoutTheSecretCannotWriteKeys) {
  Limits limits;
  limits.handshake_timeout = milliseconds(500);
  int port = 0;
  auto server = StartServer(&port, limits);
  ASSERT_TRUE(server);
  ::testing::internal::CaptureStderr();
  // A peer that ignores the handshake and sends a SET of the key Gloo reads rank 1's address
  // from (36 bytes, short of a handshake answer): closed at the handshake deadline, nothing
  // written.
  const int raw = testing::ConnectLoopback(port);
  ASSERT_GE(raw, 0);
  const auto forged = testing::Frame(wire::kOpSet, "strata/gloo/1", 14, "10.6.6.6:31337");
  testing::SendAll(raw, forged.data(), forged.size());
  EXPECT_TRUE(testing::ClosedWithin(raw, 3000));
  ::close(raw);
  // A rank with another secret: refused at Open, and its raw equivalent closed after the verdict.
  auto wrong = Join(port, "another-secret-of-this-length");
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), Status::Code::kFailedPrecondition) << wrong.status().ToString();
  EXPECT_NE(wrong.status().ToString().find("STRATA_RDZV_SECRET"), std::string::npos);
  const int liar = testing::ConnectLoopback(port);
  ASSERT_GE(liar, 0);
  EXPECT_FALSE(testing::ClientHandshake(liar, "another-secret-of-this-length"));
  testing::SendAll(liar, forged.data(), forged.size());
  EXPECT_TRUE(testing::ClosedWithin(liar, 3000));
  ::close(liar);
  // The real rank does not find the forged key.
  auto rank1 = Join(port);
  ASSERT_TRUE(rank1.ok()) << rank1.status().ToString();
  auto got = (*rank1)->Get("strata/gloo/1", milliseconds(200));
  EXPECT_TRUE(got.status().IsDeadlineExceeded()) << "forged value served: " << Str(*got);
  ASSERT_TRUE((*rank1)->Set("strata/gloo/1", std::vector<uint8_t>{'o', 'k'}).ok());
  EXPECT_EQ(Str(*server->Get("strata/gloo/1", milliseconds(1000))), "ok");
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("authentication failed"), std::string::npos) << log;
  EXPECT_GE(server->server_stats().rejected, 3u);
}

TEST(TcpKvStoreSecurity, ARankRefusesAServerThatDoesNotHoldTheSecret) {
  // Whoever bound MASTER_PORT first is not trusted: it must prove the secret too.
  testing::FakeRankZero fake("a-guess-at-the-secret-0000", [](int c) {
    const uint8_t reply[] = {1, 1, 0, 0, 0, 'X'};  // would be a GET reply "X"
    (void)testing::SendAll(c, reply, sizeof(reply));
    testing::ClosedWithin(c, 3000);
  });
  ASSERT_GT(fake.port(), 0);
  auto rank = Join(fake.port());
  if (rank.ok()) rank->reset();  // lets the fake server finish
  fake.Join();
  ASSERT_FALSE(rank.ok()) << "trusted a server without the secret";
  EXPECT_EQ(rank.status().code(), Status::Code::kFailedPrecondition) << rank.status().ToString();
  EXPECT_NE(rank.status().ToString().find("could not prove"), std::string::npos)
      << rank.status().ToString();
}

TEST(TcpKvStoreSecurity, NoSecretIsRefusedUnlessInsecureIsAskedFor) {
  auto none = cpu::TcpKvStore::Open(Options(0, true, "", {}));
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(none.status().IsInvalidArgument()) << none.status().ToString();
  EXPECT_NE(none.status().ToString().find("STRATA_RDZV_SECRET is not set"), std::string::npos);
  auto short_secret = cpu::TcpKvStore::Open(Options(0, true, "hunter2", {}));
  EXPECT_TRUE(short_secret.status().IsInvalidArgument()) << short_secret.status().ToString();
  auto o = Options(0, true, "", {});
  o.insecure = true;
  ::testing::internal::CaptureStderr();
  auto insecure = cpu::TcpKvStore::Open(o);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(insecure.ok()) << insecure.status().ToString();
  EXPECT_NE(log.find("WARNING"), std::string::npos) << log;
  // The environment: TCP needs STRATA_RDZV_SECRET; the file store does not.
  auto env = [](std::map<std::string, std::string> m) {
    m.emplace("RANK", "0");
    m.emplace("WORLD_SIZE", "2");
    return cpu::RendezvousConfig::FromEnv([m](const char* n) -> const char* {
      auto it = m.find(n);
      return it == m.end() ? nullptr : it->second.c_str();
    });
  };
  const std::map<std::string, std::string> tcp = {{"MASTER_ADDR", "127.0.0.1"},
                                                  {"MASTER_PORT", "29500"}};
  auto missing = env(tcp);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().ToString().find("STRATA_RDZV_SECRET"), std::string::npos);
  auto with = tcp;
  with["STRATA_RDZV_SECRET"] = "short";
  EXPECT_TRUE(env(with).status().IsInvalidArgument());
  with["STRATA_RDZV_SECRET"] = kSecret;
  ASSERT_TRUE(env(with).ok());
  EXPECT_EQ(env(with)->secret, kSecret);
  with = tcp;
  with["STRATA_RDZV_INSECURE"] = "1";
  ASSERT_TRUE(env(with).ok());
  EXPECT_TRUE(env(with)->insecure);
  with["STRATA_RDZV_INSECURE"] = "yes";
  EXPECT_TRUE(env(with).status().IsInvalidArgument());
  EXPECT_TRUE(env({{"STRATA_RDZV_DIR", "/tmp/x"}}).ok());
}

TEST(TcpKvStoreSecurity, GarbageAndOversizedFramesCloseTheConnection) {
  int port = 0;
  auto server = StartServer(&port);
  ASSERT_TRUE(server);
  const int baseline = server->live_clients();  // the server's own client
  // Before authenticating: 64 bytes of garbage.
  {
    const int fd = testing::ConnectLoopback(port);
    ASSERT_GE(fd, 0);
    const std::string junk(64, '\x7f');
    testing::SendAll(fd, junk.data(), junk.size());
    EXPECT_TRUE(testing::ClosedWithin(fd, 3000));
    ::close(fd);
  }
  const uint32_t huge = 0xFFFFFFFFu;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> frames = {
      {"unknown op", testing::Frame(0x77, "k", 0)},
      {"key length 4 GiB", {wire::kOpSet, 0xFF, 0xFF, 0xFF, 0xFF}},
      {"key length 4097", testing::Frame(wire::kOpSet, std::string(4097, 'k'), 0)},
      {"value length 4 GiB", testing::Frame(wire::kOpSet, "k", huge)},
      {"value length 16 MiB + 1", testing::Frame(wire::kOpSet, "k", (16u << 20) + 1)},
      {"GET with a value", testing::Frame(wire::kOpGet, "k", 5, "abcde")},
      {"DELETE with a value", testing::Frame(wire::kOpDelete, "k", 1, "a")},
  };
  for (const auto& [what, frame] : frames) {
    const int fd = AuthenticatedRaw(port);
    ASSERT_GE(fd, 0) << what;
    testing::SendAll(fd, frame.data(), frame.size());
    EXPECT_TRUE(testing::ClosedWithin(fd, 3000)) << what << ": connection left open";
    ::close(fd);
  }
  // Every one of those sockets was reclaimed, and the store still serves.
  EXPECT_TRUE(WaitFor([&] { return server->live_clients() == baseline; }))
      << server->live_clients() << " connections open, want " << baseline;
  auto rank = Join(port);
  ASSERT_TRUE(rank.ok()) << rank.status().ToString();
  EXPECT_TRUE((*rank)->Set("k", std::vector<uint8_t>{1}).ok());
  EXPECT_FALSE(server->Get("k", milliseconds(1000)).status().IsDeadlineExceeded());
}

// Raises the soft fd limit so that `want` descriptors fit; returns what is available.
rlim_t EnsureFds(rlim_t want) {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
  if (rl.rlim_cur < want) {
    rl.rlim_cur = std::min(want, rl.rlim_max);
    (void)::setrlimit(RLIMIT_NOFILE, &rl);
    (void)::getrlimit(RLIMIT_NOFILE, &rl);
  }
  return rl.rlim_cur;
}

TEST(TcpKvStoreSecurity, IdleConnectionsCannotLockTheRanksOut) {
  // 1,100 connections that never authenticate, more than the server's 1,024 slots, held open
  // for longer than the test (the handshake deadline is 60 s): the real ranks still join. Both
  // ends live in this process, so it needs ~2,200 descriptors; where the hard limit is lower,
  // the test scales the server's slots down and keeps 76 idle connections more than slots.
  Limits limits;
  limits.handshake_timeout = milliseconds(60000);
  int idle_count = 1100;
  const rlim_t fds = EnsureFds(2400);
  if (fds < 2400) {
    limits.max_clients = static_cast<int>((fds - 200) / 2) - 76;
    idle_count = limits.max_clients + 76;
    std::printf("RLIMIT_NOFILE is %llu: %d slots, %d idle connections\n",
                static_cast<unsigned long long>(fds), limits.max_clients, idle_count);
  }
  ASSERT_GT(limits.max_clients, 8);
  int port = 0;
  auto server = StartServer(&port, limits);
  ASSERT_TRUE(server);
  ::testing::internal::CaptureStderr();  // the displaced connections are logged
  std::vector<int> idle;
  for (int i = 0; i < idle_count; ++i) {
    const int fd = testing::ConnectLoopback(port);
    ASSERT_GE(fd, 0) << "connection " << i << ": " << std::strerror(errno);
    idle.push_back(fd);
  }
  std::vector<std::thread> ranks;
  std::vector<std::string> errors(3);
  for (int r = 1; r <= 3; ++r) {
    ranks.emplace_back([&, r] {
      auto s = Join(port);
      if (!s.ok()) return void(errors[r - 1] = s.status().ToString());
      const Status st = (*s)->Set("rank" + std::to_string(r), std::vector<uint8_t>{uint8_t(r)});
      if (!st.ok()) return void(errors[r - 1] = st.ToString());
      for (int q = 1; q <= 3; ++q) {
        auto v = (*s)->Get("rank" + std::to_string(q), milliseconds(5000));
        if (!v.ok()) return void(errors[r - 1] = v.status().ToString());
      }
    });
  }
  for (auto& t : ranks) t.join();
  (void)::testing::internal::GetCapturedStderr();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r + 1;
  const auto stats = server->server_stats();
  EXPECT_LE(stats.connections, limits.max_clients);
  EXPECT_GE(stats.displaced, static_cast<uint64_t>(idle_count - limits.max_clients));
  for (int fd : idle) ::close(fd);
}

TEST(TcpKvStoreSecurity, SlowlorisFramesHitTheDeadlines) {
  Limits limits;
  limits.handshake_timeout = milliseconds(300);
  limits.idle_timeout = milliseconds(500);
  int port = 0;
  auto server = StartServer(&port, limits);
  ASSERT_TRUE(server);
  // One byte every 40 ms never completes a frame in time; each byte must not extend the deadline.
  auto trickle_until_closed = [](int fd, const std::vector<uint8_t>& bytes) {
    const auto end = Clock::now() + std::chrono::seconds(4);
    for (size_t i = 0; Clock::now() < end; ++i) {
      if (i < bytes.size()) (void)::send(fd, &bytes[i], 1, MSG_NOSIGNAL);
      if (testing::ClosedWithin(fd, 40)) return true;
    }
    return false;
  };
  const auto frame = testing::Frame(wire::kOpSet, std::string(60, 'k'), 40, std::string(40, 'v'));
  const int pre = testing::ConnectLoopback(port);
  ASSERT_GE(pre, 0);
  EXPECT_TRUE(trickle_until_closed(pre, std::vector<uint8_t>(frame.size(), 0x42)))
      << "an unauthenticated trickle held its connection";
  ::close(pre);
  const int post = AuthenticatedRaw(port);
  ASSERT_GE(post, 0);
  EXPECT_TRUE(trickle_until_closed(post, frame)) << "an authenticated trickle held its connection";
  ::close(post);
  // A real rank idle past the timeout is closed too, and reconnects on its next request: with
  // the server's idle timeout (it reconnects before it), or with a longer one (it notices).
  auto same = Join(port, kSecret, limits);
  Limits patient = limits;
  patient.idle_timeout = milliseconds(600000);
  auto longer = Join(port, kSecret, patient);
  ASSERT_TRUE(same.ok() && longer.ok());
  ASSERT_TRUE((*same)->Set("a", std::vector<uint8_t>{1}).ok());
  ASSERT_TRUE((*longer)->Set("b", std::vector<uint8_t>{2}).ok());
  // Every connection idles out, the server's own rank's included.
  EXPECT_TRUE(WaitFor([&] { return server->live_clients() == 0; }));
  EXPECT_TRUE((*same)->Get("b", milliseconds(1000)).ok());
  EXPECT_TRUE((*longer)->Get("a", milliseconds(1000)).ok());
  EXPECT_TRUE(server->Get("a", milliseconds(1000)).ok());
  EXPECT_GE(server->server_stats().rejected, 2u);
}

TEST(TcpKvStoreSecurity, AnnouncedButUnsentValuesReserveNoMemory) {
  // 20 connections each announce a 16 MiB value and send 1,000 bytes of it. The server used to
  // allocate and zero-fill the announced length at once (320 MiB here).
  int port = 0;
  auto server = StartServer(&port);
  ASSERT_TRUE(server);
  const uint64_t rss0 = RssBytes();
  std::vector<int> conns;
  for (int i = 0; i < 20; ++i) {
    const int fd = AuthenticatedRaw(port);
    ASSERT_GE(fd, 0);
    const auto f =
        testing::Frame(wire::kOpSet, "big" + std::to_string(i), 16u << 20, std::string(1000, 'v'));
    ASSERT_TRUE(testing::SendAll(fd, f.data(), f.size()));
    conns.push_back(fd);
  }
  EXPECT_TRUE(WaitFor([&] { return server->server_stats().buffered_bytes >= 20 * 1000; }));
  std::this_thread::sleep_for(milliseconds(100));
  // At most twice what arrived (buffers grow by doubling), nothing for what was only announced.
  EXPECT_LE(server->server_stats().buffered_bytes, 2u * 20 * 1000);
  EXPECT_LT(RssBytes(), rss0 + (64u << 20)) << "RSS grew from " << rss0 << " to " << RssBytes();
  for (int fd : conns) ::close(fd);
  EXPECT_TRUE(WaitFor([&] { return server->server_stats().buffered_bytes == 0; }));
}

TEST(TcpKvStoreSecurity, BytesInFlightCountAgainstTheStoreBudget) {
  // A 1 MiB budget: 40 connections that each send 64 KiB of announced 16 MiB values would hold
  // 2.5 MiB. The ones over the budget are closed; stored and buffered bytes never exceed it.
  Limits limits;
  limits.max_store_bytes = 1u << 20;
  int port = 0;
  auto server = StartServer(&port, limits);
  ASSERT_TRUE(server);
  std::vector<int> conns;
  for (int i = 0; i < 40; ++i) {
    const int fd = AuthenticatedRaw(port);
    ASSERT_GE(fd, 0);
    const auto f = testing::Frame(wire::kOpSet, "v" + std::to_string(i), 16u << 20,
                                  std::string(64 << 10, 'v'));
    (void)testing::SendAll(fd, f.data(), f.size());
    conns.push_back(fd);
  }
  EXPECT_TRUE(WaitFor([&] { return server->server_stats().rejected >= 40 - 16; }));
  int closed = 0;
  for (int fd : conns) closed += testing::ClosedWithin(fd, 20) ? 1 : 0;
  const auto stats = server->server_stats();
  EXPECT_GE(closed, 40 - 16) << "over-budget requests were left open";
  EXPECT_LE(stats.buffered_bytes + stats.stored_bytes, limits.max_store_bytes);
  for (int fd : conns) ::close(fd);
  EXPECT_TRUE(WaitFor([&] { return server->server_stats().buffered_bytes == 0; }));
  // With the budget free again, a rank stores what fits and is refused what does not.
  auto rank = Join(port);
  ASSERT_TRUE(rank.ok()) << rank.status().ToString();
  EXPECT_TRUE((*rank)->Set("small", std::vector<uint8_t>(1000, 1)).ok());
  EXPECT_FALSE((*rank)->Set("large", std::vector<uint8_t>(2u << 20, 1)).ok());
  EXPECT_LE(server->server_stats().stored_bytes, limits.max_store_bytes);
}

// ---- File store ----

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(FileKvStoreSecurity, ASymlinkPlantedAtTheTempNameIsNotFollowed) {
  const std::string root = testing::UniqueTestDir("filekv_symlink");
  const std::string dir = root + "/store";
  const std::string victim = root + "/victim";
  { std::ofstream(victim) << "precious"; }
  auto store = cpu::FileKvStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  // The temp names a rank of this process would use: "<key>.tmp.<pid>" and
  // "<key>.tmp.<pid>.<n>"; each points at the victim.
  const std::string base = dir + "/strata%2fgloo%2f0.tmp." + std::to_string(::getpid());
  std::vector<std::string> planted = {base};
  for (int n = 0; n < 8; ++n) planted.push_back(base + "." + std::to_string(n));
  for (const auto& p : planted) ASSERT_EQ(::symlink(victim.c_str(), p.c_str()), 0) << p;
  const std::vector<uint8_t> addr = {'1', '0', '.', '0', '.', '0', '.', '1'};
  ASSERT_TRUE((*store)->Set("strata/gloo/0", addr).ok());
  EXPECT_EQ(ReadAll(victim), "precious") << "the rank wrote through a planted symlink";
  auto got = (*store)->Get("strata/gloo/0", milliseconds(100));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, addr);
  struct stat st {};
  ASSERT_EQ(::lstat((dir + "/strata%2fgloo%2f0").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  for (const auto& p : planted) {
    ASSERT_EQ(::lstat(p.c_str(), &st), 0) << p;
    EXPECT_TRUE(S_ISLNK(st.st_mode)) << p << " was replaced";
  }
}

TEST(FileKvStoreSecurity, AKeyIsNeverReadThroughASymlink) {
  const std::string root = testing::UniqueTestDir("filekv_keylink");
  const std::string victim = root + "/secret-file";
  { std::ofstream(victim) << "not a rendezvous value"; }
  auto store = cpu::FileKvStore::Open(root + "/store");
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_EQ(::symlink(victim.c_str(), (root + "/store/k").c_str()), 0);
  auto got = (*store)->Get("k", milliseconds(100));
  ASSERT_FALSE(got.ok()) << "read through a symlink: " << Str(*got);
  EXPECT_TRUE(got.status().IsCorruption()) << got.status().ToString();
}

TEST(FileKvStoreSecurity, TheDirectoryMustBeThisUsersAlone) {
  const std::string root = testing::UniqueTestDir("filekv_perms");
  // Created 0700.
  ASSERT_TRUE(cpu::FileKvStore::Open(root + "/fresh").ok());
  struct stat st {};
  ASSERT_EQ(::stat((root + "/fresh").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  // An existing directory that others may write is refused; 0755 of this user is fine.
  const std::string shared = root + "/shared";
  ASSERT_EQ(::mkdir(shared.c_str(), 0700), 0);
  for (mode_t mode : {0777, 0775, 0757, 01777}) {
    ASSERT_EQ(::chmod(shared.c_str(), mode), 0);
    auto s = cpu::FileKvStore::Open(shared);
    ASSERT_FALSE(s.ok()) << "accepted mode " << std::oct << mode;
    EXPECT_TRUE(s.status().IsInvalidArgument()) << s.status().ToString();
    EXPECT_NE(s.status().ToString().find("writable"), std::string::npos) << s.status().ToString();
  }
  ASSERT_EQ(::chmod(shared.c_str(), 0755), 0);
  EXPECT_TRUE(cpu::FileKvStore::Open(shared).ok());
  // A directory of another user is refused, whatever its mode.
  std::string foreign = "/usr";
  if (::geteuid() == 0) {
    foreign = root + "/foreign";
    ASSERT_EQ(::mkdir(foreign.c_str(), 0700), 0);
    ASSERT_EQ(::chown(foreign.c_str(), 65534, 65534), 0);
  }
  ASSERT_EQ(::stat(foreign.c_str(), &st), 0);
  ASSERT_NE(st.st_uid, ::geteuid());
  auto s = cpu::FileKvStore::Open(foreign);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().ToString().find("owned by uid"), std::string::npos) << s.status().ToString();
}

}  // namespace
}  // namespace strata
