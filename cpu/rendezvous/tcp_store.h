// TcpKvStore: the rendezvous KvStore served by rank 0 over TCP (see cpu/rendezvous/rendezvous.h).
// Thread-safe; the server lives as long as rank 0's store object.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "strata/comm.h"

namespace strata::cpu {

class TcpKvStore final : public KvStore {
 public:
  static constexpr int kMaxClients = 1024;
  // Connects to host:port (and, when `is_server`, first listens there). kInvalidArgument when the
  // host does not resolve; kIOError when the server cannot bind (port in use: errno named);
  // kDeadlineExceeded when no server answered within `timeout`.
  // A server serves at most `max_clients` connections at once (disconnected clients are reaped
  // as new ones arrive); one more is refused with an error its first request reports
  // (kUnavailable, "too many connections").
  static Result<std::unique_ptr<TcpKvStore>> Open(const std::string& host, int port, bool is_server,
                                                  std::chrono::milliseconds timeout,
                                                  int max_clients = kMaxClients);
  // Server side: clients connected and not yet disconnected (0 on a client-only store).
  int live_clients() const;
  ~TcpKvStore() override;
  Status Set(std::string_view key, std::span<const uint8_t> value) override;
  Result<std::vector<uint8_t>> Get(std::string_view key,
                                   std::chrono::milliseconds timeout) override;
  Status Delete(std::string_view key) override;

 private:
  class Server;
  TcpKvStore() = default;
  Status Request(uint8_t op, std::string_view key, std::span<const uint8_t> value,
                 std::vector<uint8_t>* reply, bool* found);

  std::unique_ptr<Server> server_;
  std::mutex mu_;     // one request at a time on the connection
  int fd_ = -1;       // -1 once a request failed: the stream may be mid-frame
  std::string lost_;  // why fd_ was closed
  std::string endpoint_;
  std::chrono::milliseconds io_timeout_{60000};
};

// The store `config` asks for: the file store when file_dir is set, else TCP (rank 0 serves);
// with a run id, a view of it whose keys all live under "run/<run_id>/".
}  // namespace strata::cpu
