// TcpStoreServer: the server half of TcpKvStore (cpu/rendezvous/tcp_store.h); internal.
//
// One thread runs a poll loop over the listening socket and every connection (non-blocking), so
// a connection costs a socket and a small struct, never a thread. Each connection first gets the
// handshake of cpu/rendezvous/auth.h and is served only once the peer proved it holds the
// secret. Limits (TcpKvStoreOptions): connections held at once (a new one displaces the oldest
// unauthenticated one), a handshake deadline from accept, an idle deadline reset by each served
// request, and one byte budget for stored data plus value bytes buffered in flight. A peer that
// fails authentication, sends a malformed frame or misses a deadline is closed at once, with a
// line on stderr (at most 20 per 10 s; the rest are counted).
//
// Thread safety: Start and the destructor from one thread; stats() from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cpu/rendezvous/tcp_store.h"
#include "strata/status.h"

namespace strata::cpu {

class TcpStoreServer {
 public:
  // Listens on options.host:options.port (port 0: the kernel picks) and starts the loop.
  // kInvalidArgument when the host does not resolve; kIOError when it cannot bind or listen.
  static Result<std::unique_ptr<TcpStoreServer>> Start(const TcpKvStoreOptions& options);
  // Stops the loop and closes every connection.
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }
  TcpStoreStats stats() const;

 private:
  struct Conn;
  using Clock = std::chrono::steady_clock;
  using Value = std::shared_ptr<const std::vector<uint8_t>>;

  explicit TcpStoreServer(const TcpKvStoreOptions& options);
  Status Listen(const std::string& host, int port);
  void Loop();
  void AcceptSome();
  Conn* OldestUnauthenticated();
  void Service(Conn& c, short revents);
  void ReadSome(Conn& c);
  void Consume(Conn& c, size_t n);
  void OnAuthAnswer(Conn& c);
  void OnHeader(Conn& c);
  void Execute(Conn& c);
  bool ReserveValue(Conn& c, uint64_t size);
  void SendSome(Conn& c);
  void ExpireDeadlines(Clock::time_point now);
  void Close(Conn& c, const std::string& why);
  void Reject(Conn& c, const std::string& why);
  void Log(const std::string& peer, const std::string& what);

  // Configuration (const after Start).
  std::string secret_;
  std::string endpoint_;
  const int max_clients_;
  const std::chrono::milliseconds handshake_timeout_;
  const std::chrono::milliseconds idle_timeout_;
  const uint64_t max_store_bytes_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: the destructor wakes the loop through it
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread loop_;

  // Loop thread only.
  std::vector<std::unique_ptr<Conn>> conns_;  // in accept order; closed ones swept each round
  int open_ = 0;                              // conns_ not yet closed
  std::map<std::string, Value, std::less<>> map_;
  std::vector<uint8_t> scratch_;  // receives key and value bytes before they are appended
  Clock::time_point accept_paused_until_{};
  Clock::time_point log_window_start_{};
  int log_lines_ = 0;
  uint64_t log_suppressed_ = 0;

  // Written by the loop thread, read by stats().
  std::atomic<int> connections_{0};
  std::atomic<int> authenticated_{0};
  std::atomic<uint64_t> stored_bytes_{0};
  std::atomic<uint64_t> buffered_bytes_{0};
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> displaced_{0};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace strata::cpu
