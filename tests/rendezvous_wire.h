// Test helpers that speak the TCP rendezvous store's wire protocol by hand
// (cpu/rendezvous/auth.h, cpu/rendezvous/tcp_protocol.h): to play an attacker without the
// secret, a misbehaving rank, or a fake rank 0.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/rendezvous/auth.h"
#include "cpu/rendezvous/tcp_protocol.h"

namespace strata::testing {

// A blocking TCP connection to 127.0.0.1:port, or -1.
inline int ConnectLoopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return fd;
  if (fd >= 0) ::close(fd);
  return -1;
}

// A listening socket on a kernel-chosen loopback port; returns {fd, port}.
inline std::pair<int, int> ListenLoopback() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::listen(fd, 4) != 0) {
    return {-1, 0};
  }
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return {fd, ntohs(a.sin_port)};
}

// The next connection on listening socket `lfd`, or -1 when none arrives within timeout_ms.
inline int AcceptWithin(int lfd, int timeout_ms) {
  pollfd p{lfd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) != 1) return -1;
  return ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
}

inline bool SendAll(int fd, const void* buf, size_t n) {
  const auto* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

inline bool RecvAll(int fd, void* buf, size_t n, int timeout_ms = 5000) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    pollfd q{fd, POLLIN, 0};
    if (::poll(&q, 1, timeout_ms) != 1) return false;
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// True when the peer closed the connection (EOF or reset) within timeout_ms; data is discarded.
inline bool ClosedWithin(int fd, int timeout_ms) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  char sink[4096];
  while (std::chrono::steady_clock::now() < end) {
    pollfd q{fd, POLLIN, 0};
    if (::poll(&q, 1, 20) != 1) continue;
    const ssize_t r = ::recv(fd, sink, sizeof(sink), MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
  return false;
}

// The client half of the handshake. True when the server accepted `secret`.
inline bool ClientHandshake(int fd, const std::string& secret) {
  uint8_t hello[2 + cpu::kRdzvNonceBytes];
  if (!RecvAll(fd, hello, sizeof(hello)) || hello[0] != cpu::tcp_wire::kHello) return false;
  cpu::RdzvNonce nonce_s{}, nonce_c{};
  std::memcpy(nonce_s.data(), hello + 2, nonce_s.size());
  if (!cpu::FillRandom(nonce_c).ok()) return false;
  auto mac = cpu::HandshakeMac(secret, nonce_s, nonce_c, cpu::RdzvRole::kClient);
  if (!mac.ok()) return false;
  if (!SendAll(fd, nonce_c.data(), nonce_c.size()) || !SendAll(fd, mac->data(), mac->size())) {
    return false;
  }
  uint8_t verdict[1 + cpu::kRdzvMacBytes];
  return RecvAll(fd, verdict, sizeof(verdict)) && verdict[0] == cpu::tcp_wire::kAuthOk;
}

// The server half of the handshake on an accepted socket, proving `secret`.
inline bool ServerHandshake(int fd, const std::string& secret) {
  cpu::RdzvNonce nonce_s{}, nonce_c{};
  if (!cpu::FillRandom(nonce_s).ok()) return false;
  uint8_t hello[2 + cpu::kRdzvNonceBytes] = {cpu::tcp_wire::kHello,
                                             cpu::tcp_wire::kProtocolVersion};
  std::memcpy(hello + 2, nonce_s.data(), nonce_s.size());
  uint8_t answer[cpu::kRdzvNonceBytes + cpu::kRdzvMacBytes];
  if (!SendAll(fd, hello, sizeof(hello)) || !RecvAll(fd, answer, sizeof(answer))) return false;
  std::memcpy(nonce_c.data(), answer, nonce_c.size());
  auto mac = cpu::HandshakeMac(secret, nonce_s, nonce_c, cpu::RdzvRole::kServer);
  if (!mac.ok()) return false;
  const uint8_t ok = cpu::tcp_wire::kAuthOk;
  return SendAll(fd, &ok, 1) && SendAll(fd, mac->data(), mac->size());
}

// A fake rank 0 on a loopback port: a thread accepts one connection, runs the server half of the
// handshake proving `secret`, then `serve(fd)`, and closes it. Joined by Join or the destructor.
class FakeRankZero {
 public:
  FakeRankZero(std::string secret, std::function<void(int fd)> serve) {
    std::tie(lfd_, port_) = ListenLoopback();
    if (lfd_ < 0) return;
    thread_ = std::thread([this, secret = std::move(secret), serve = std::move(serve)] {
      const int c = AcceptWithin(lfd_, 5000);
      if (c < 0) return;
      if (ServerHandshake(c, secret)) serve(c);
      ::close(c);
    });
  }
  ~FakeRankZero() { Join(); }
  void Join() {
    if (thread_.joinable()) thread_.join();
    if (lfd_ >= 0) ::close(lfd_);
    lfd_ = -1;
  }
  int port() const { return port_; }  // 0 when no socket could listen

 private:
  int lfd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

// A request frame: op | key_len | key | value_len | value. `value_len` is what the frame
// announces; only `value` is included (fewer bytes announce a value never sent in full).
inline std::vector<uint8_t> Frame(uint8_t op, std::string_view key, uint32_t value_len,
                                  std::string_view value = {}) {
  std::vector<uint8_t> f(1 + 4 + key.size() + 4);
  const uint32_t key_len = static_cast<uint32_t>(key.size());
  f[0] = op;
  std::memcpy(f.data() + 1, &key_len, 4);
  std::memcpy(f.data() + 5, key.data(), key.size());
  std::memcpy(f.data() + 5 + key.size(), &value_len, 4);
  f.insert(f.end(), value.begin(), value.end());
  return f;
}

}  // namespace strata::testing
