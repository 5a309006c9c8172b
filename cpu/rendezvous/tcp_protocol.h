// Wire format of the TCP rendezvous store, shared by its client (tcp_store.cc) and server
// (tcp_server.cc). Integers are little-endian (every supported host is).
//
// Handshake: see cpu/rendezvous/auth.h. After it, one request at a time:
//   request   u8 op | u32 key_len | key | u32 value_len | value   (value_len 0 for GET, DELETE)
//   reply     SET, DELETE: u8 1.   GET: u8 found | u32 len | value.
// Anything else (an unknown op, a key or value over its limit, a value with GET/DELETE) is a
// malformed frame: the server closes the connection.
#pragma once

#include <netdb.h>

#include <cstdint>
#include <memory>
#include <string>

#include "strata/status.h"

namespace strata::cpu::tcp_wire {

inline constexpr uint8_t kOpSet = 1;
inline constexpr uint8_t kOpGet = 2;
inline constexpr uint8_t kOpDelete = 3;

inline constexpr uint8_t kHello = 0xA1;  // then u8 version and the server's nonce
inline constexpr uint8_t kProtocolVersion = 1;
inline constexpr uint8_t kAuthOk = 0xA2;      // then the server's MAC
inline constexpr uint8_t kAuthFailed = 0xEA;  // then close
inline constexpr uint8_t kRefused = 0xEE;     // instead of kHello: too many connections

inline constexpr uint32_t kMaxKeyBytes = 4096;
inline constexpr uint32_t kMaxValueBytes = 16u << 20;

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { ::freeaddrinfo(a); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// Resolves host:port for TCP (defined in tcp_store.cc). kInvalidArgument naming MASTER_ADDR when
// the host does not resolve.
Result<AddrInfoPtr> Resolve(const std::string& host, int port, bool passive);

}  // namespace strata::cpu::tcp_wire
