#include "cpu/rendezvous/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <map>
#include <thread>

namespace strata::cpu {
namespace {

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

Result<addrinfo*> Resolve(const std::string& host, int port, bool passive) {
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
  return res;
}

constexpr uint8_t kOpSet = 1;
constexpr uint8_t kOpGet = 2;
constexpr uint8_t kOpDelete = 3;
constexpr uint8_t kReplyRefused = 0xEE;  // first reply byte when the server refuses a client
constexpr uint32_t kMaxKeyBytes = 4096;
constexpr uint32_t kMaxValueBytes = 16u << 20;
constexpr uint64_t kMaxStoreBytes = 256ull << 20;

}  // namespace

// ---------------------------------------------------------------------------
// TcpKvStore server: a thread per client connection, a map under one mutex.
// Request: u8 op | u32 key_len | key | u32 value_len | value. Reply to SET: u8 1. Reply to GET:
// u8 found | u32 len | value. Reply to DELETE: u8 1. Malformed or oversized requests close the
// connection.
// ---------------------------------------------------------------------------
class TcpKvStore::Server {
 public:
  explicit Server(int max_clients) : max_clients_(max_clients) {}
  ~Server() {
    stopping_ = true;
    if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& c : clients_) ::shutdown(c->fd, SHUT_RDWR);
    }
    if (acceptor_.joinable()) acceptor_.join();
    for (auto& c : clients_) {
      c->thread.join();
      ::close(c->fd);
    }
    if (listen_fd_ >= 0) ::close(listen_fd_);
  }

  // Clients being served now (finished ones are reaped when the next client connects).
  int live_clients() {
    std::lock_guard<std::mutex> lock(mu_);
    int live = 0;
    for (auto& c : clients_) live += c->done ? 0 : 1;
    return live;
  }

  Status Listen(const std::string& host, int port) {
    addrinfo* res = nullptr;
    STRATA_ASSIGN_OR_RETURN(res, Resolve(host, port, true));
    int last_err = 0;
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      const int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
        listen_fd_ = fd;
        break;
      }
      last_err = errno;
      ::close(fd);
    }
    ::freeaddrinfo(res);
    if (listen_fd_ < 0) {
      return Status::FromErrno(last_err, "TCP store: bind/listen",
                               host + ":" + std::to_string(port));
    }
    acceptor_ = std::thread([this] { AcceptLoop(); });
    return Status::OK();
  }

 private:
  struct Client {
    int fd = -1;
    std::atomic<bool> done{false};
    std::thread thread;
  };

  // Joins the threads of clients that disconnected and closes their sockets.
  void Reap() {
    std::vector<std::unique_ptr<Client>> finished;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = clients_.begin(); it != clients_.end();) {
        if ((*it)->done) {
          finished.push_back(std::move(*it));
          it = clients_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& c : finished) {
      c->thread.join();
      ::close(c->fd);
    }
  }

  // Tells a client over the limit why it is turned away (one kReplyRefused byte, which it reads
  // as the reply to its first request), then closes; the short drain avoids a reset that could
  // destroy the byte before the client reads it.
  static void Refuse(int fd) {
    const uint8_t refused = kReplyRefused;
    (void)::send(fd, &refused, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    ::shutdown(fd, SHUT_WR);
    pollfd p{fd, POLLIN, 0};
    char sink[512];
    if (::poll(&p, 1, 200) > 0) (void)::recv(fd, sink, sizeof(sink), MSG_DONTWAIT);
    ::close(fd);
  }

  void AcceptLoop() {
    while (!stopping_) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // shut down (or a fatal error: clients will time out with a clear message)
      }
      Reap();
      std::unique_lock<std::mutex> lock(mu_);
      if (stopping_) {
        ::close(fd);
        continue;
      }
      if (static_cast<int>(clients_.size()) >= max_clients_) {
        lock.unlock();
        Refuse(fd);
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto c = std::make_unique<Client>();
      c->fd = fd;
      Client* raw = c.get();
      c->thread = std::thread([this, raw] {
        Serve(raw->fd);
        raw->done = true;
      });
      clients_.push_back(std::move(c));
    }
  }

  void Serve(int fd) {
    while (!stopping_) {
      // Blocking reads: the destructor's shutdown() wakes them.
      const auto forever = Clock::now() + std::chrono::hours(24 * 365);
      uint8_t op = 0;
      uint32_t klen = 0, vlen = 0;
      if (!IoAll(fd, &op, 1, false, forever, "TCP store server").ok()) return;
      if (!IoAll(fd, &klen, 4, false, forever, "TCP store server").ok() || klen > kMaxKeyBytes)
        return;
      std::string key(klen, '\0');
      if (!IoAll(fd, key.data(), klen, false, forever, "TCP store server").ok()) return;
      if (!IoAll(fd, &vlen, 4, false, forever, "TCP store server").ok() || vlen > kMaxValueBytes)
        return;
      std::vector<uint8_t> value(vlen);
      if (!IoAll(fd, value.data(), vlen, false, forever, "TCP store server").ok()) return;
      std::vector<uint8_t> reply;
      if (op == kOpSet) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = map_.find(key);
        const uint64_t old = it == map_.end() ? 0 : it->second.size();
        if (total_bytes_ - old + vlen > kMaxStoreBytes) return;  // over budget: drop the client
        total_bytes_ = total_bytes_ - old + vlen;
        map_[key] = std::move(value);
        reply.push_back(1);
      } else if (op == kOpGet) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = map_.find(key);
        const uint32_t len = it == map_.end() ? 0 : static_cast<uint32_t>(it->second.size());
        reply.push_back(it == map_.end() ? 0 : 1);
        reply.resize(5);
        std::memcpy(reply.data() + 1, &len, 4);
        if (it != map_.end()) reply.insert(reply.end(), it->second.begin(), it->second.end());
      } else if (op == kOpDelete) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = map_.find(key);
        if (it != map_.end()) {
          total_bytes_ -= it->second.size();
          map_.erase(it);
        }
        reply.push_back(1);
      } else {
        return;
      }
      if (!IoAll(fd, reply.data(), reply.size(), true, forever, "TCP store server").ok()) return;
    }
  }

  std::atomic<bool> stopping_{false};
  int listen_fd_ = -1;
  std::thread acceptor_;
  std::mutex mu_;
  const int max_clients_;
  std::list<std::unique_ptr<Client>> clients_;  // live, or finished and not yet reaped
  std::map<std::string, std::vector<uint8_t>> map_;
  uint64_t total_bytes_ = 0;
};

Result<std::unique_ptr<TcpKvStore>> TcpKvStore::Open(const std::string& host, int port,
                                                     bool is_server,
                                                     std::chrono::milliseconds timeout,
                                                     int max_clients) {
  if (max_clients < 1) return Status::InvalidArgument("TCP store: max_clients must be >= 1");
  std::unique_ptr<TcpKvStore> store(new TcpKvStore());
  store->endpoint_ = host + ":" + std::to_string(port);
  store->io_timeout_ = timeout;
  if (is_server) {
    store->server_ = std::make_unique<Server>(max_clients);
    STRATA_RETURN_IF_ERROR(store->server_->Listen(host, port));
  }
  addrinfo* res = nullptr;
  STRATA_ASSIGN_OR_RETURN(res, Resolve(host, port, false));
  const auto deadline = Clock::now() + timeout;
  int last_err = 0;
  while (store->fd_ < 0 && Clock::now() < deadline) {
    for (addrinfo* a = res; a != nullptr && store->fd_ < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        store->fd_ = fd;
      } else {
        last_err = errno;
        ::close(fd);
      }
    }
    if (store->fd_ < 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::freeaddrinfo(res);
  if (store->fd_ < 0) {
    return Status::DeadlineExceeded("TCP store: no server answered at " + store->endpoint_ +
                                    " within " + std::to_string(timeout.count()) +
                                    " ms (last error: " + std::strerror(last_err) +
                                    "); is rank 0 running with the same MASTER_ADDR/MASTER_PORT?");
  }
  return store;
}

TcpKvStore::~TcpKvStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

Status TcpKvStore::Request(uint8_t op, std::string_view key, std::span<const uint8_t> value,
                           std::vector<uint8_t>* reply, bool* found) {
  if (key.size() > kMaxKeyBytes || value.size() > kMaxValueBytes) {
    return Status::InvalidArgument("TCP store: key or value too large for key '" +
                                   std::string(key.substr(0, 64)) + "'");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) {
    return Status::Unavailable("TCP store " + endpoint_ +
                               ": connection unusable after an earlier failure (" + lost_ + ")");
  }
  const auto deadline = Clock::now() + io_timeout_;
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
  auto io = [&](void* buf, size_t n, bool is_send) {
    Status st = IoAll(fd_, buf, n, is_send, deadline, what);
    if (!st.ok()) {
      ::close(fd_);
      fd_ = -1;
      lost_ = st.ToString();
    }
    return st;
  };
  STRATA_RETURN_IF_ERROR(io(frame.data(), frame.size(), true));
  uint8_t head = 0;
  STRATA_RETURN_IF_ERROR(io(&head, 1, false));
  if (head == kReplyRefused) {
    ::close(fd_);
    fd_ = -1;
    lost_ = "the server refused this client: too many connections";
    return Status::Unavailable(what + ": " + lost_);
  }
  if (op != kOpGet) return Status::OK();
  uint32_t len = 0;
  STRATA_RETURN_IF_ERROR(io(&len, 4, false));
  if (len > kMaxValueBytes) {
    ::close(fd_);
    fd_ = -1;
    lost_ = "reply of " + std::to_string(len) + " bytes exceeds the value limit";
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

int TcpKvStore::live_clients() const { return server_ ? server_->live_clients() : 0; }

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
