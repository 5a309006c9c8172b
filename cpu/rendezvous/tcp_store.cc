#include "cpu/rendezvous/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "cpu/rendezvous/auth.h"
#include "cpu/rendezvous/tcp_protocol.h"
#include "cpu/rendezvous/tcp_server.h"

namespace strata::cpu {

namespace tcp_wire {
Result<AddrInfoPtr> Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port_s = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), port_s.c_str(), &hints, &res);
  if (rc != 0) {
    return Status::InvalidArgument("rendezvous: MASTER_ADDR '" + host +
                                   "' does not resolve: " + gai_strerror(rc));
  }
  return AddrInfoPtr(res);
}
}  // namespace tcp_wire

namespace {

using namespace tcp_wire;  // NOLINT: the wire constants, in this file only
using Clock = std::chrono::steady_clock;

Status IoAll(int fd, void* buf, size_t n, bool is_send, Clock::time_point deadline,
             std::string_view what) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return Status::DeadlineExceeded(std::string(what) + ": timed out");
    pollfd pfd{fd, static_cast<short>(is_send ? POLLOUT : POLLIN), 0};
    const int pr = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (pr < 0 && errno != EINTR) return Status::FromErrno(errno, "poll", what);
    if (pr <= 0) continue;
    const ssize_t r = is_send ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (r == 0) return Status::Unavailable(std::string(what) + ": connection closed by peer");
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Status::Unavailable(
          Status::FromErrno(errno, is_send ? "send" : "recv", what).message());
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return Status::OK();
}

// connect() bounded by `deadline`: non-blocking, then poll for the outcome. A blocking connect to
// an address that drops SYNs (a listener whose accept queue is full, a firewall) waits out the
// kernel's SYN retries, over two minutes, whatever the rendezvous timeout says. Returns 0 or the
// errno (ETIMEDOUT at the deadline); the socket is left blocking, as it was.
int ConnectBy(int fd, const sockaddr* addr, socklen_t addr_len, Clock::time_point deadline) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) return errno;
  int err = ::connect(fd, addr, addr_len) == 0 ? 0 : errno;
  // EINTR: the connection goes on asynchronously, as after EINPROGRESS.
  while (err == EINPROGRESS || err == EINTR) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      err = ETIMEDOUT;
      break;
    }
    pollfd pfd{fd, POLLOUT, 0};
    const int pr = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (pr < 0 && errno != EINTR) {
      err = errno;
    } else if (pr > 0) {
      socklen_t len = sizeof(err);
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    }
  }
  if (::fcntl(fd, F_SETFL, flags) != 0 && err == 0) err = errno;
  return err;
}

// True when the server closed the connection (or sent something unasked, which it never does):
// poll reports it readable while no request is in flight.
bool PeerHungUp(int fd) {
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0;
}

std::string Hex(uint8_t b) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "0x%02x", b);
  return buf;
}

// The client side of the handshake (cpu/rendezvous/auth.h) on a connected socket. *retry is set
// when the failure may pass (the connection closed before a verdict: the server was starting,
// stopping, or displaced this connection to admit another).
Status Handshake(int fd, const std::string& secret, Clock::time_point deadline,
                 const std::string& what, bool* retry) {
  *retry = false;
  auto io = [&](void* buf, size_t n, bool is_send) {
    Status st = IoAll(fd, buf, n, is_send, deadline, what);
    if (st.IsUnavailable()) *retry = true;
    if (st.IsDeadlineExceeded()) {
      return Status::DeadlineExceeded(what +
                                      ": no rendezvous handshake completed in time (is the "
                                      "process on MASTER_PORT this run's rank 0?)");
    }
    return st;
  };
  uint8_t hello[2] = {0, 0};
  STRATA_RETURN_IF_ERROR(io(hello, 1, false));
  if (hello[0] == kRefused) {
    return Status::Unavailable(what + ": the server refused this client: too many connections");
  }
  if (hello[0] != kHello) {
    return Status::FailedPrecondition(what + ": not a strata rendezvous store (greeting byte " +
                                      Hex(hello[0]) + ")");
  }
  STRATA_RETURN_IF_ERROR(io(hello + 1, 1, false));
  if (hello[1] != kProtocolVersion) {
    return Status::FailedPrecondition(what + ": the server speaks rendezvous protocol " +
                                      std::to_string(hello[1]) + ", this build " +
                                      std::to_string(kProtocolVersion));
  }
  RdzvNonce nonce_s{}, nonce_c{};
  STRATA_RETURN_IF_ERROR(io(nonce_s.data(), nonce_s.size(), false));
  STRATA_RETURN_IF_ERROR(FillRandom(nonce_c));
  STRATA_ASSIGN_OR_RETURN(RdzvMac mac_c, HandshakeMac(secret, nonce_s, nonce_c, RdzvRole::kClient));
  uint8_t answer[kRdzvNonceBytes + kRdzvMacBytes];
  std::memcpy(answer, nonce_c.data(), kRdzvNonceBytes);
  std::memcpy(answer + kRdzvNonceBytes, mac_c.data(), kRdzvMacBytes);
  STRATA_RETURN_IF_ERROR(io(answer, sizeof(answer), true));
  uint8_t verdict = 0;
  STRATA_RETURN_IF_ERROR(io(&verdict, 1, false));
  if (verdict == kAuthFailed) {
    return Status::FailedPrecondition(
        what +
        ": the server rejected this rank's credentials: its STRATA_RDZV_SECRET differs "
        "from rank 0's (or only one side set STRATA_RDZV_INSECURE=1)");
  }
  if (verdict != kAuthOk) {
    return Status::FailedPrecondition(what + ": unexpected handshake reply " + Hex(verdict));
  }
  RdzvMac mac_s{};
  STRATA_RETURN_IF_ERROR(io(mac_s.data(), mac_s.size(), false));
  STRATA_ASSIGN_OR_RETURN(RdzvMac want, HandshakeMac(secret, nonce_s, nonce_c, RdzvRole::kServer));
  if (!MacEqual(want, mac_s)) {
    *retry = false;
    return Status::FailedPrecondition(
        what +
        ": the server could not prove it holds STRATA_RDZV_SECRET: it is not this run's "
        "rank 0 (another process on MASTER_PORT, or a different secret)");
  }
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<TcpKvStore>> TcpKvStore::Open(const TcpKvStoreOptions& o) {
  STRATA_RETURN_IF_ERROR(CheckRendezvousSecret(o.secret, o.insecure));
  if (o.timeout.count() <= 0) return Status::InvalidArgument("TCP store: timeout must be > 0");
  if (o.port < (o.is_server ? 0 : 1) || o.port > 65535) {
    return Status::InvalidArgument("TCP store: port " + std::to_string(o.port) +
                                   " is not in [1, 65535]");
  }
  std::unique_ptr<TcpKvStore> store(new TcpKvStore());
  store->host_ = o.host;
  store->port_ = o.port;
  store->secret_ = o.secret;
  store->io_timeout_ = o.timeout;
  store->idle_timeout_ = o.idle_timeout;
  if (o.is_server) {
    STRATA_ASSIGN_OR_RETURN(store->server_, TcpStoreServer::Start(o));
    store->port_ = store->server_->port();
  }
  store->endpoint_ = o.host + ":" + std::to_string(store->port_);
  std::lock_guard<std::mutex> lock(store->mu_);
  STRATA_RETURN_IF_ERROR(store->Connect(Clock::now() + o.timeout));
  return store;
}

Status TcpKvStore::Connect(Clock::time_point deadline) {
  STRATA_ASSIGN_OR_RETURN(tcp_wire::AddrInfoPtr res, tcp_wire::Resolve(host_, port_, false));
  const std::string what = "TCP store " + endpoint_;
  std::string last_error = "none";
  while (true) {
    for (addrinfo* a = res.get(); a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (const int err = ConnectBy(fd, a->ai_addr, a->ai_addrlen, deadline); err != 0) {
        last_error = std::strerror(err);
        ::close(fd);
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      bool retry = false;
      const Status st = Handshake(fd, secret_, deadline, what, &retry);
      if (st.ok()) {
        fd_ = fd;
        last_used_ = Clock::now();
        return Status::OK();
      }
      ::close(fd);
      if (!retry) return st;
      last_error = std::string(st.message());
    }
    if (Clock::now() >= deadline) {
      return Status::DeadlineExceeded(
          "TCP store: no server answered at " + endpoint_ + " within " +
          std::to_string(io_timeout_.count()) + " ms (last error: " + last_error +
          "); is rank 0 running with the same MASTER_ADDR/MASTER_PORT?");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

TcpKvStore::~TcpKvStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
  WipeSecret(secret_);
}

Status TcpKvStore::Request(uint8_t op, std::string_view key, std::span<const uint8_t> value,
                           std::vector<uint8_t>* reply, bool* found) {
  if (key.size() > kMaxKeyBytes || value.size() > kMaxValueBytes) {
    return Status::InvalidArgument("TCP store: key or value too large for key '" +
                                   std::string(key.substr(0, 64)) + "'");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!lost_.empty()) {
    return Status::Unavailable("TCP store " + endpoint_ +
                               ": connection unusable after an earlier failure (" + lost_ + ")");
  }
  const auto deadline = Clock::now() + io_timeout_;
  // The server closes connections idle for idle_timeout: reconnect (a fresh connection holds no
  // stale reply) when it did, or before it is likely to.
  if (fd_ >= 0 && (Clock::now() - last_used_ >= idle_timeout_ / 2 || PeerHungUp(fd_))) {
    ::close(fd_);
    fd_ = -1;
  }
  if (fd_ < 0) STRATA_RETURN_IF_ERROR(Connect(deadline));
  std::vector<uint8_t> frame(1 + 4 + key.size() + 4 + value.size());
  const uint32_t klen = static_cast<uint32_t>(key.size());
  const uint32_t vlen = static_cast<uint32_t>(value.size());
  frame[0] = op;
  std::memcpy(frame.data() + 1, &klen, 4);
  std::memcpy(frame.data() + 5, key.data(), key.size());
  std::memcpy(frame.data() + 5 + key.size(), &vlen, 4);
  if (!value.empty()) std::memcpy(frame.data() + 9 + key.size(), value.data(), value.size());
  const std::string what = "TCP store " + endpoint_;
  // A request cut short (timeout, closed peer) leaves the stream mid-frame: a later reply could
  // be read as this request's. So any failure closes the connection for good.
  auto lose = [&](std::string why) {
    ::close(fd_);
    fd_ = -1;
    lost_ = std::move(why);
  };
  auto io = [&](void* buf, size_t n, bool is_send) {
    Status st = IoAll(fd_, buf, n, is_send, deadline, what);
    if (!st.ok()) lose(st.ToString());
    return st;
  };
  STRATA_RETURN_IF_ERROR(io(frame.data(), frame.size(), true));
  uint8_t head = 0;
  STRATA_RETURN_IF_ERROR(io(&head, 1, false));
  last_used_ = Clock::now();
  if (op != kOpGet) return Status::OK();
  uint32_t len = 0;
  STRATA_RETURN_IF_ERROR(io(&len, 4, false));
  if (len > kMaxValueBytes) {
    lose("reply of " + std::to_string(len) + " bytes exceeds the value limit");
    return Status::Unavailable(what + ": " + lost_);
  }
  reply->resize(len);
  STRATA_RETURN_IF_ERROR(io(reply->data(), len, false));
  *found = head == 1;
  return Status::OK();
}

Status TcpKvStore::Set(std::string_view key, std::span<const uint8_t> value) {
  return Request(kOpSet, key, value, nullptr, nullptr);
}

int TcpKvStore::live_clients() const { return server_ ? server_->stats().connections : 0; }

TcpStoreStats TcpKvStore::server_stats() const {
  return server_ ? server_->stats() : TcpStoreStats{};
}

Status TcpKvStore::Delete(std::string_view key) {
  return Request(kOpDelete, key, {}, nullptr, nullptr);
}

Result<std::vector<uint8_t>> TcpKvStore::Get(std::string_view key,
                                             std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  auto sleep = std::chrono::milliseconds(1);
  while (true) {
    std::vector<uint8_t> v;
    bool found = false;
    STRATA_RETURN_IF_ERROR(Request(kOpGet, key, {}, &v, &found));
    if (found) return v;
    if (Clock::now() >= deadline) {
      return Status::DeadlineExceeded("TCP store " + endpoint_ + ": key '" + std::string(key) +
                                      "' did not appear within " + std::to_string(timeout.count()) +
                                      " ms");
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::milliseconds(20));
  }
}
}  // namespace strata::cpu
