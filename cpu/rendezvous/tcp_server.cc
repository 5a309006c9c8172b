#include "cpu/rendezvous/tcp_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "cpu/rendezvous/auth.h"
#include "cpu/rendezvous/tcp_protocol.h"

namespace strata::cpu {
namespace {

using namespace tcp_wire;  // NOLINT: the wire constants, in this file only

constexpr size_t kScratchBytes = 64 << 10;    // the most one recv of key or value bytes reads
constexpr size_t kReadBudgetBytes = 1 << 20;  // per connection per round, for fairness
constexpr int kAcceptsPerRound = 64;
constexpr int kLogLinesPerWindow = 20;
constexpr auto kLogWindow = std::chrono::seconds(10);
constexpr auto kAcceptPause = std::chrono::milliseconds(100);
constexpr size_t kAuthAnswerBytes = kRdzvNonceBytes + kRdzvMacBytes;

std::string PeerName(const sockaddr_storage& sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&sa);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (sa.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&sa);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

std::string Ms(std::chrono::milliseconds d) { return std::to_string(d.count()) + " ms"; }

}  // namespace

// One connection. Input is read field by field, never past the current request, so nothing is
// buffered across requests: `small` takes the fixed-size fields (the 64-byte handshake answer,
// the 5-byte op and key length, the 4-byte value length); the key (<= 4 KiB) and the value grow
// only as their bytes arrive, the value in steps reserved against the store's byte budget.
// Output: a small head and, for a GET, the stored value itself (shared, never copied).
struct TcpStoreServer::Conn {
  enum class Field { kAuth, kHead, kKey, kValueLen, kValue };

  int fd = -1;  // -1 once closed; swept at the end of the round
  std::string peer;
  bool authenticated = false;
  Clock::time_point deadline;
  RdzvNonce nonce_s{};

  Field field = Field::kAuth;
  std::array<uint8_t, kAuthAnswerBytes> small{};
  size_t small_got = 0;
  uint8_t op = 0;
  uint32_t key_len = 0;
  uint32_t value_len = 0;
  std::string key;
  std::vector<uint8_t> value;
  uint64_t reserved = 0;  // value capacity counted in buffered_bytes_

  std::vector<uint8_t> out_head;
  Value out_value;
  size_t out_off = 0;

  size_t OutBytes() const { return out_head.size() + (out_value ? out_value->size() : 0); }
  bool Sending() const { return out_off < OutBytes(); }
  bool MidRequest() const { return field != Field::kHead || small_got > 0 || Sending(); }
};

TcpStoreServer::TcpStoreServer(const TcpKvStoreOptions& o)
    : secret_(o.secret),
      endpoint_(o.host + ":" + std::to_string(o.port)),
      max_clients_(o.max_clients),
      handshake_timeout_(o.handshake_timeout),
      idle_timeout_(o.idle_timeout),
      max_store_bytes_(o.max_store_bytes),
      scratch_(kScratchBytes) {}

Result<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(const TcpKvStoreOptions& o) {
  if (o.max_clients < 1) return Status::InvalidArgument("TCP store: max_clients must be >= 1");
  if (o.handshake_timeout.count() <= 0 || o.idle_timeout.count() <= 0) {
    return Status::InvalidArgument("TCP store: handshake and idle timeouts must be > 0");
  }
  std::unique_ptr<TcpStoreServer> s(new TcpStoreServer(o));
  s->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s->wake_fd_ < 0) return Status::FromErrno(errno, "TCP store: eventfd");
  STRATA_RETURN_IF_ERROR(s->Listen(o.host, o.port));
  if (o.secret.empty()) {
    std::fprintf(stderr,
                 "strata TCP store %s: WARNING: no STRATA_RDZV_SECRET (STRATA_RDZV_INSECURE=1): "
                 "serving without authentication; anyone who reaches this port can read and "
                 "forge rendezvous keys\n",
                 s->endpoint_.c_str());
  }
  s->loop_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

TcpStoreServer::~TcpStoreServer() {
  stopping_ = true;
  if (loop_.joinable()) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
    loop_.join();
  }
  for (auto& c : conns_) {
    if (c->fd >= 0) ::close(c->fd);
  }
  if (log_suppressed_ > 0) Log("", "");  // reports the count of suppressed lines
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  WipeSecret(secret_);
}

TcpStoreStats TcpStoreServer::stats() const {
  TcpStoreStats s;
  s.connections = connections_.load(std::memory_order_relaxed);
  s.authenticated = authenticated_.load(std::memory_order_relaxed);
  s.stored_bytes = stored_bytes_.load(std::memory_order_relaxed);
  s.buffered_bytes = buffered_bytes_.load(std::memory_order_relaxed);
  s.rejected = rejected_.load(std::memory_order_relaxed);
  s.displaced = displaced_.load(std::memory_order_relaxed);
  s.refused = refused_.load(std::memory_order_relaxed);
  return s;
}

Status TcpStoreServer::Listen(const std::string& host, int port) {
  STRATA_ASSIGN_OR_RETURN(AddrInfoPtr res, Resolve(host, port, true));
  int last_err = 0;
  for (addrinfo* a = res.get(); a != nullptr; a = a->ai_next) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
      listen_fd_ = fd;
      break;
    }
    last_err = errno;
    ::close(fd);
  }
  if (listen_fd_ < 0) {
    return Status::FromErrno(last_err, "TCP store: bind/listen", host + ":" + std::to_string(port));
  }
  sockaddr_storage sa{};
  socklen_t len = sizeof(sa);
  if (::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    return Status::FromErrno(errno, "TCP store: getsockname", endpoint_);
  }
  port_ = sa.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port)
                                   : ntohs(reinterpret_cast<sockaddr_in*>(&sa)->sin_port);
  endpoint_ = host + ":" + std::to_string(port_);
  return Status::OK();
}

// The loop. Each round polls the wake eventfd, the listening socket (unless accepting is paused
// after EMFILE) and every connection: for POLLOUT while it has a reply to send, else POLLIN.
// The poll timeout is the nearest connection deadline (at most 1 s). Then, in order: connections
// with events are served (reads stop at the end of a request, whose reply is sent at once as far
// as the socket takes it), new connections are accepted, deadlines are enforced, and closed
// connections are swept. Partial IO is the normal case: every state survives EAGAIN. Errors on
// one connection close that connection only.
void TcpStoreServer::Loop() {
  std::vector<pollfd> fds;
  while (!stopping_.load()) {
    auto now = Clock::now();
    const bool accepting = now >= accept_paused_until_;
    auto next = now + std::chrono::seconds(1);
    if (!accepting) next = std::min(next, accept_paused_until_);
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
    for (auto& c : conns_) {
      fds.push_back({c->fd, static_cast<short>(c->Sending() ? POLLOUT : POLLIN), 0});
      next = std::min(next, c->deadline);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 0))) < 0 &&
        errno != EINTR) {
      Log("", std::string("poll: ") + std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (stopping_.load()) break;
    const size_t polled = conns_.size();  // accepting below appends
    for (size_t i = 0; i < polled; ++i) {
      if (fds[i + 2].revents != 0 && conns_[i]->fd >= 0) Service(*conns_[i], fds[i + 2].revents);
    }
    if (fds[1].revents != 0) AcceptSome();
    ExpireDeadlines(Clock::now());
    std::erase_if(conns_, [](const std::unique_ptr<Conn>& c) { return c->fd < 0; });
  }
}

TcpStoreServer::Conn* TcpStoreServer::OldestUnauthenticated() {
  for (auto& c : conns_) {
    if (c->fd >= 0 && !c->authenticated) return c.get();
  }
  return nullptr;
}

void TcpStoreServer::AcceptSome() {
  for (int i = 0; i < kAcceptsPerRound; ++i) {
    sockaddr_storage sa{};
    socklen_t len = sizeof(sa);
    const int fd =
        ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // Out of descriptors: an unauthenticated connection gives its one back; if there is none,
      // pause accepting briefly instead of spinning on a listening socket that stays readable.
      const int err = errno;
      if ((err == EMFILE || err == ENFILE) && OldestUnauthenticated() != nullptr) {
        displaced_.fetch_add(1, std::memory_order_relaxed);
        Close(*OldestUnauthenticated(), "closed before authenticating: out of file descriptors");
        continue;
      }
      Log("", std::string("accept: ") + std::strerror(err) + "; pausing accepts for 100 ms");
      accept_paused_until_ = Clock::now() + kAcceptPause;
      return;
    }
    std::string peer = PeerName(sa);
    if (open_ >= max_clients_) {
      if (Conn* victim = OldestUnauthenticated()) {
        displaced_.fetch_add(1, std::memory_order_relaxed);
        Close(*victim, "closed before authenticating: at the limit of " +
                           std::to_string(max_clients_) + " connections, a newer one needs room");
      } else {
        // The peer reads this byte instead of the hello; it has sent nothing yet, so the close
        // is a clean FIN that does not destroy the byte.
        refused_.fetch_add(1, std::memory_order_relaxed);
        Log(peer, "refused: all " + std::to_string(max_clients_) +
                      " connections are authenticated ranks (too many connections)");
        const uint8_t refused = kRefused;
        (void)::send(fd, &refused, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        ::close(fd);
        continue;
      }
    }
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->peer = std::move(peer);
    c->deadline = Clock::now() + handshake_timeout_;
    if (const Status st = FillRandom(c->nonce_s); !st.ok()) {
      Log(c->peer, "closed: " + st.ToString());
      ::close(fd);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    c->out_head = {kHello, kProtocolVersion};
    c->out_head.insert(c->out_head.end(), c->nonce_s.begin(), c->nonce_s.end());
    ++open_;
    connections_.store(open_, std::memory_order_relaxed);
    conns_.push_back(std::move(c));
    SendSome(*conns_.back());
  }
}

void TcpStoreServer::Service(Conn& c, short revents) {
  if ((revents & POLLNVAL) != 0) return Close(c, "");
  if (c.Sending()) {
    SendSome(c);  // POLLERR / POLLHUP surface as a send error
  } else {
    ReadSome(c);  // a hang-up surfaces as a zero-length read
  }
}

void TcpStoreServer::ReadSome(Conn& c) {
  size_t budget = kReadBudgetBytes;
  while (c.fd >= 0 && !c.Sending() && budget > 0) {
    // Fixed-size fields are read in place; key and value bytes through scratch_, so their
    // buffers grow by what arrived, never by what was announced.
    uint8_t* dst = scratch_.data();
    size_t want = 0;
    switch (c.field) {
      case Conn::Field::kAuth:
        want = kAuthAnswerBytes - c.small_got;
        dst = c.small.data() + c.small_got;
        break;
      case Conn::Field::kHead:
        want = 5 - c.small_got;
        dst = c.small.data() + c.small_got;
        break;
      case Conn::Field::kValueLen:
        want = 4 - c.small_got;
        dst = c.small.data() + c.small_got;
        break;
      case Conn::Field::kKey:
        want = c.key_len - c.key.size();
        break;
      case Conn::Field::kValue:
        want = std::min<size_t>(c.value_len - c.value.size(), scratch_.size());
        break;
    }
    const ssize_t r = ::recv(c.fd, dst, want, 0);
    if (r == 0) {
      return Close(c, c.authenticated && c.MidRequest() ? "closed by the peer mid-request" : "");
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) Close(c, "");
      return;
    }
    const size_t got = static_cast<size_t>(r);
    budget -= std::min(budget, got);
    if (c.field == Conn::Field::kKey) c.key.append(reinterpret_cast<const char*>(dst), got);
    if (c.field == Conn::Field::kValue) {
      if (!ReserveValue(c, c.value.size() + got)) {
        return Reject(c, "closed: a " + std::to_string(c.value_len) +
                             "-byte value would exceed the store's byte budget of " +
                             std::to_string(max_store_bytes_));
      }
      c.value.insert(c.value.end(), dst, dst + got);
    }
    Consume(c, got);
  }
}

// Advances the request state by `n` bytes just read into the current field.
void TcpStoreServer::Consume(Conn& c, size_t n) {
  switch (c.field) {
    case Conn::Field::kAuth:
      if ((c.small_got += n) == kAuthAnswerBytes) OnAuthAnswer(c);
      return;
    case Conn::Field::kHead:
      if ((c.small_got += n) == 5) OnHeader(c);
      return;
    case Conn::Field::kKey:
      if (c.key.size() == c.key_len) c.field = Conn::Field::kValueLen;
      return;
    case Conn::Field::kValueLen:
      if ((c.small_got += n) < 4) return;
      std::memcpy(&c.value_len, c.small.data(), 4);
      c.small_got = 0;
      if (c.value_len > kMaxValueBytes || (c.op != kOpSet && c.value_len != 0)) {
        return Reject(c, "closed: malformed request (value length " + std::to_string(c.value_len) +
                             " for op " + std::to_string(c.op) + ")");
      }
      c.field = Conn::Field::kValue;
      if (c.value_len == 0) Execute(c);
      return;
    case Conn::Field::kValue:
      if (c.value.size() == c.value_len) Execute(c);
      return;
  }
}

void TcpStoreServer::OnAuthAnswer(Conn& c) {
  RdzvNonce nonce_c{};
  RdzvMac mac_c{};
  std::memcpy(nonce_c.data(), c.small.data(), kRdzvNonceBytes);
  std::memcpy(mac_c.data(), c.small.data() + kRdzvNonceBytes, kRdzvMacBytes);
  c.small_got = 0;
  auto want = HandshakeMac(secret_, c.nonce_s, nonce_c, RdzvRole::kClient);
  if (!want.ok() || !MacEqual(*want, mac_c)) {
    const uint8_t failed = kAuthFailed;
    (void)::send(c.fd, &failed, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    return Reject(c, want.ok() ? "closed: authentication failed (wrong or no STRATA_RDZV_SECRET)"
                               : "closed: " + want.status().ToString());
  }
  auto mine = HandshakeMac(secret_, c.nonce_s, nonce_c, RdzvRole::kServer);
  if (!mine.ok()) return Reject(c, "closed: " + mine.status().ToString());
  c.authenticated = true;
  authenticated_.fetch_add(1, std::memory_order_relaxed);
  c.field = Conn::Field::kHead;
  c.out_head = {kAuthOk};
  c.out_head.insert(c.out_head.end(), mine->begin(), mine->end());
  SendSome(c);
}

void TcpStoreServer::OnHeader(Conn& c) {
  c.op = c.small[0];
  std::memcpy(&c.key_len, c.small.data() + 1, 4);
  c.small_got = 0;
  if ((c.op != kOpSet && c.op != kOpGet && c.op != kOpDelete) || c.key_len > kMaxKeyBytes) {
    return Reject(c, "closed: malformed request header (op " + std::to_string(c.op) +
                         ", key length " + std::to_string(c.key_len) + ")");
  }
  c.key.clear();
  c.field = c.key_len == 0 ? Conn::Field::kValueLen : Conn::Field::kKey;
}

// Grows the value buffer of `c` to hold `size` bytes that arrived: at most doubling, never past
// the announced length, and only within the byte budget. false: over budget.
bool TcpStoreServer::ReserveValue(Conn& c, uint64_t size) {
  if (size <= c.reserved) return true;
  const uint64_t cap = std::min<uint64_t>(c.value_len, std::max<uint64_t>(size, 2 * c.reserved));
  const uint64_t extra = cap - c.reserved;
  if (stored_bytes_.load() + buffered_bytes_.load() + extra > max_store_bytes_) return false;
  c.value.reserve(cap);
  c.reserved = cap;
  buffered_bytes_.fetch_add(extra, std::memory_order_relaxed);
  return true;
}

void TcpStoreServer::Execute(Conn& c) {
  c.field = Conn::Field::kHead;
  c.out_head.clear();
  if (c.op == kOpSet) {
    auto it = map_.find(c.key);
    const uint64_t old = it == map_.end() ? 0 : c.key.size() + it->second->size();
    const uint64_t now = c.key.size() + c.value.size();
    // The value's bytes are already in buffered_bytes_; the key's are added here.
    const uint64_t after = stored_bytes_.load() - old + now + buffered_bytes_.load() - c.reserved;
    if (after > max_store_bytes_) {
      return Reject(c, "closed: key '" + c.key.substr(0, 64) +
                           "' would exceed the store's byte budget of " +
                           std::to_string(max_store_bytes_));
    }
    auto value = std::make_shared<const std::vector<uint8_t>>(std::move(c.value));
    c.value = {};
    buffered_bytes_.fetch_sub(c.reserved, std::memory_order_relaxed);
    c.reserved = 0;
    stored_bytes_.fetch_add(now - old, std::memory_order_relaxed);  // wraps correctly if smaller
    if (it == map_.end()) {
      map_.emplace(c.key, std::move(value));
    } else {
      it->second = std::move(value);
    }
    c.out_head = {1};
  } else if (c.op == kOpGet) {
    auto it = map_.find(c.key);
    const uint32_t len = it == map_.end() ? 0 : static_cast<uint32_t>(it->second->size());
    c.out_head.resize(5);
    c.out_head[0] = it == map_.end() ? 0 : 1;
    std::memcpy(c.out_head.data() + 1, &len, 4);
    if (it != map_.end()) c.out_value = it->second;
  } else {
    if (auto it = map_.find(c.key); it != map_.end()) {
      stored_bytes_.fetch_sub(c.key.size() + it->second->size(), std::memory_order_relaxed);
      map_.erase(it);
    }
    c.out_head = {1};
  }
  c.key.clear();
  SendSome(c);
}

void TcpStoreServer::SendSome(Conn& c) {
  while (c.Sending()) {
    const uint8_t* p = nullptr;
    size_t n = 0;
    if (c.out_off < c.out_head.size()) {
      p = c.out_head.data() + c.out_off;
      n = c.out_head.size() - c.out_off;
    } else {
      const size_t at = c.out_off - c.out_head.size();
      p = c.out_value->data() + at;
      n = c.out_value->size() - at;
    }
    const ssize_t w = ::send(c.fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) Close(c, "");
      return;
    }
    c.out_off += static_cast<size_t>(w);
  }
  c.out_head.clear();
  c.out_value.reset();
  c.out_off = 0;
  // A served request (or the completed handshake) starts the idle period; the handshake
  // deadline, though, runs from accept and is not extended by sending the hello.
  if (c.authenticated) c.deadline = Clock::now() + idle_timeout_;
}

void TcpStoreServer::ExpireDeadlines(Clock::time_point now) {
  for (auto& c : conns_) {
    if (c->fd < 0 || c->deadline > now) continue;
    if (!c->authenticated) {
      Reject(*c, "closed: did not authenticate within " + Ms(handshake_timeout_));
    } else if (c->MidRequest()) {
      Reject(*c, "closed: request incomplete after the idle timeout of " + Ms(idle_timeout_));
    } else {
      Close(*c, "");  // idle: the client reconnects when it needs the store again
    }
  }
}

void TcpStoreServer::Reject(Conn& c, const std::string& why) {
  rejected_.fetch_add(1, std::memory_order_relaxed);
  Close(c, why);
}

void TcpStoreServer::Close(Conn& c, const std::string& why) {
  if (c.fd < 0) return;
  if (!why.empty()) Log(c.peer, why);
  buffered_bytes_.fetch_sub(c.reserved, std::memory_order_relaxed);
  c.reserved = 0;
  c.value = {};
  c.key = {};
  c.out_value.reset();
  if (c.authenticated) authenticated_.fetch_sub(1, std::memory_order_relaxed);
  ::close(c.fd);
  c.fd = -1;
  --open_;
  connections_.store(open_, std::memory_order_relaxed);
}

void TcpStoreServer::Log(const std::string& peer, const std::string& what) {
  const auto now = Clock::now();
  if (now - log_window_start_ >= kLogWindow || what.empty()) {
    if (log_suppressed_ > 0) {
      std::fprintf(stderr, "strata TCP store %s: %llu similar lines suppressed\n",
                   endpoint_.c_str(), static_cast<unsigned long long>(log_suppressed_));
    }
    log_window_start_ = now;
    log_lines_ = 0;
    log_suppressed_ = 0;
  }
  if (what.empty()) return;
  if (log_lines_ >= kLogLinesPerWindow) {
    ++log_suppressed_;
    return;
  }
  ++log_lines_;
  std::fprintf(stderr, "strata TCP store %s: %s%s%s%s\n", endpoint_.c_str(),
               peer.empty() ? "" : "connection from ", peer.c_str(), peer.empty() ? "" : ": ",
               what.c_str());
}

}  // namespace strata::cpu
