// TcpKvStore: the rendezvous KvStore served by rank 0 over TCP (see cpu/rendezvous/rendezvous.h).
//
// Every connection is authenticated with the run's secret before any request is served (HMAC
// challenge-response in both directions, cpu/rendezvous/auth.h). The server is one event-loop
// thread (cpu/rendezvous/tcp_server.h) with a bound on everything a peer can make it hold:
// connections, time to authenticate, idle time, bytes buffered for requests in flight.
//
// Thread-safe; the server lives as long as rank 0's store object.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "strata/comm.h"

namespace strata::cpu {

class TcpStoreServer;

struct TcpKvStoreOptions {
  static constexpr int kMaxClients = 1024;

  // MASTER_ADDR: the server listens on this address only (never a wildcard unless it is one).
  std::string host;
  // MASTER_PORT. 0 with is_server: the kernel picks a free port (read it back with port()).
  int port = 0;
  // Rank 0: serve the store here (and be a client of it like every other rank).
  bool is_server = false;
  // Connecting (retried until then, so ranks may start in any order) and each request's IO.
  std::chrono::milliseconds timeout{60000};
  // The run's secret (STRATA_RDZV_SECRET), 16..4096 bytes, the same on every rank.
  std::string secret;
  // With no secret: serve and connect without authentication (STRATA_RDZV_INSECURE=1). Anyone
  // who reaches the port can then read and forge keys; the server warns on stderr.
  bool insecure = false;
  // Server: connections held at once, authenticated or not. A connection arriving at the limit
  // displaces the oldest one that has not authenticated yet; when every one has, it is refused
  // (its Open fails with kUnavailable, "too many connections"). Each costs two fds on this host.
  int max_clients = kMaxClients;
  // Server: time from accept to a completed handshake. A handshake is one round trip, so this
  // only needs to cover a slow network; shorter frees slots held by silent peers sooner.
  std::chrono::milliseconds handshake_timeout{10000};
  // Server: an authenticated connection is closed when no complete request arrived for this long
  // (a request trickled in slower than that is cut too). Clients reconnect by themselves after an
  // idle close (and proactively past half of it), so this bounds held slots, not a run's length.
  std::chrono::milliseconds idle_timeout{300000};
  // Server: stored keys and values plus the bytes buffered for requests still arriving. A
  // request that would cross it closes its connection.
  uint64_t max_store_bytes = 256ull << 20;
};

// Server counters, for tests and diagnostics.
struct TcpStoreStats {
  int connections = 0;          // open now, authenticated or not
  int authenticated = 0;        // open now and authenticated
  uint64_t stored_bytes = 0;    // keys and values held
  uint64_t buffered_bytes = 0;  // reserved for requests still arriving
  uint64_t rejected = 0;        // closed for failed authentication, a malformed frame or a deadline
  uint64_t displaced = 0;       // unauthenticated connections closed to admit a newer one
  uint64_t refused = 0;         // connections refused: every slot held by an authenticated peer
};

class TcpKvStore final : public KvStore {
 public:
  static constexpr int kMaxClients = TcpKvStoreOptions::kMaxClients;
  // Connects to host:port and authenticates (first listening there when `is_server`).
  // kInvalidArgument when the host does not resolve or the secret is missing or malformed;
  // kIOError when the server cannot bind (port in use: errno named); kDeadlineExceeded when no
  // server answered within the timeout; kUnavailable when the server refused this client (too
  // many connections); kFailedPrecondition when either side failed authentication (the ranks'
  // STRATA_RDZV_SECRET differ, or what answers at host:port is not this run's rank 0).
  static Result<std::unique_ptr<TcpKvStore>> Open(const TcpKvStoreOptions& options);
  ~TcpKvStore() override;

  // The port the store is on (the kernel's choice when opened with port 0).
  int port() const { return port_; }
  // Server side: connections open now (0 on a client-only store).
  int live_clients() const;
  // Server side: counters (all zero on a client-only store).
  TcpStoreStats server_stats() const;

  Status Set(std::string_view key, std::span<const uint8_t> value) override;
  Result<std::vector<uint8_t>> Get(std::string_view key,
                                   std::chrono::milliseconds timeout) override;
  Status Delete(std::string_view key) override;

 private:
  TcpKvStore() = default;
  // Connects and authenticates within `deadline`, retrying what a later try may fix.
  Status Connect(std::chrono::steady_clock::time_point deadline);
  Status Request(uint8_t op, std::string_view key, std::span<const uint8_t> value,
                 std::vector<uint8_t>* reply, bool* found);

  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mu_;     // one request at a time on the connection
  int fd_ = -1;       // -1: not connected (idle-closed) or, with lost_ set, unusable for good
  std::string lost_;  // why fd_ was closed after a failed request: the stream may be mid-frame
  std::string host_;
  int port_ = 0;
  std::string endpoint_;
  std::string secret_;
  std::chrono::milliseconds io_timeout_{60000};
  std::chrono::milliseconds idle_timeout_{300000};
  std::chrono::steady_clock::time_point last_used_{};
};

}  // namespace strata::cpu
