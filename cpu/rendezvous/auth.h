// Rendezvous authentication: the run's shared secret and the HMAC-SHA256 challenge-response the
// TCP store runs on every connection before it serves a single request.
//
// Handshake (fixed-size fields, nothing else on the connection before it completes):
//   server -> client  u8 kHello | u8 kProtocolVersion | nonce_s[32]   (or u8 kRefused, then close)
//   client -> server  nonce_c[32] | HMAC(secret, nonce_s || nonce_c || "strata-rdzv-v1 client")
//   server -> client  u8 kAuthOk | HMAC(secret, nonce_s || nonce_c || "strata-rdzv-v1 server")
//                     (or u8 kAuthFailed, then close)
// Nonces come from getrandom(2), so a recorded answer is useless on any later connection; the
// server's own MAC proves to the client that it talks to a holder of the secret (rank 0), not to
// whoever bound MASTER_PORT first. MACs are compared in constant time (CRYPTO_memcmp).
// What it does not do: authenticate or encrypt each later message. An attacker who can rewrite
// TCP segments between ranks is out of scope, as for Gloo's own data plane (docs/collectives.md).
//
// Thread safety: free functions without shared state.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata::cpu {

inline constexpr size_t kRdzvNonceBytes = 32;
inline constexpr size_t kRdzvMacBytes = 32;
// A secret shorter than this is refused: it must be random and unguessable.
inline constexpr size_t kRdzvSecretMinBytes = 16;
inline constexpr size_t kRdzvSecretMaxBytes = 4096;

using RdzvNonce = std::array<uint8_t, kRdzvNonceBytes>;
using RdzvMac = std::array<uint8_t, kRdzvMacBytes>;

enum class RdzvRole : uint8_t { kClient, kServer };

// Fills `out` from getrandom(2). kIOError with errno when the kernel cannot provide randomness.
Status FillRandom(std::span<uint8_t> out);

// A fresh secret for one run: 32 random bytes as 64 hex characters (what `offloadctl launch`
// exports as STRATA_RDZV_SECRET). kIOError when no randomness is available.
Result<std::string> GenerateRendezvousSecret();

// kOk when `secret` can authenticate a TCP store (or is empty with `insecure` set); else
// kInvalidArgument naming STRATA_RDZV_SECRET and how to set it.
Status CheckRendezvousSecret(std::string_view secret, bool insecure);

// HMAC-SHA256(secret, nonce_s || nonce_c || context of `role`): the proof `role` sends.
// kInternal when libcrypto refuses (e.g. a FIPS provider and the empty key of insecure mode).
Result<RdzvMac> HandshakeMac(std::string_view secret, const RdzvNonce& nonce_s,
                             const RdzvNonce& nonce_c, RdzvRole role);

// Constant-time equality (CRYPTO_memcmp): the time taken says nothing about where they differ.
bool MacEqual(const RdzvMac& a, const RdzvMac& b);

// Overwrites the bytes of `s` (OPENSSL_cleanse) and clears it.
void WipeSecret(std::string& s);

}  // namespace strata::cpu
