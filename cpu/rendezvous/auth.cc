#include "cpu/rendezvous/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace strata::cpu {

Status FillRandom(std::span<uint8_t> out) {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::getrandom(out.data() + done, out.size() - done, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "rendezvous: getrandom");
    }
    done += static_cast<size_t>(n);
  }
  return Status::OK();
}

Result<std::string> GenerateRendezvousSecret() {
  std::array<uint8_t, 32> raw{};
  STRATA_RETURN_IF_ERROR(FillRandom(raw));
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * raw.size());
  for (uint8_t b : raw) {
    hex += kHex[b >> 4];
    hex += kHex[b & 15];
  }
  OPENSSL_cleanse(raw.data(), raw.size());
  return hex;
}

Status CheckRendezvousSecret(std::string_view secret, bool insecure) {
  if (secret.empty()) {
    if (insecure) return Status::OK();
    return Status::InvalidArgument(
        "rendezvous: STRATA_RDZV_SECRET is not set. The TCP store that rank 0 serves on "
        "MASTER_ADDR:MASTER_PORT only answers ranks that prove they hold the run's secret: set the "
        "same random value on every rank (e.g. `export STRATA_RDZV_SECRET=$(openssl rand -hex "
        "32)`; `offloadctl launch` does it for you), or STRATA_RDZV_INSECURE=1 to run without "
        "authentication on a host and network no one else can reach");
  }
  if (secret.size() < kRdzvSecretMinBytes || secret.size() > kRdzvSecretMaxBytes) {
    return Status::InvalidArgument(
        "rendezvous: STRATA_RDZV_SECRET is " + std::to_string(secret.size()) +
        " bytes; it must be " + std::to_string(kRdzvSecretMinBytes) + ".." +
        std::to_string(kRdzvSecretMaxBytes) + " bytes of random text (openssl rand -hex 32)");
  }
  return Status::OK();
}

Result<RdzvMac> HandshakeMac(std::string_view secret, const RdzvNonce& nonce_s,
                             const RdzvNonce& nonce_c, RdzvRole role) {
  static constexpr std::string_view kClientContext = "strata-rdzv-v1 client";
  static constexpr std::string_view kServerContext = "strata-rdzv-v1 server";
  const std::string_view context = role == RdzvRole::kClient ? kClientContext : kServerContext;
  uint8_t msg[2 * kRdzvNonceBytes + kServerContext.size()];
  static_assert(kClientContext.size() == kServerContext.size());
  std::memcpy(msg, nonce_s.data(), kRdzvNonceBytes);
  std::memcpy(msg + kRdzvNonceBytes, nonce_c.data(), kRdzvNonceBytes);
  std::memcpy(msg + 2 * kRdzvNonceBytes, context.data(), context.size());
  RdzvMac mac{};
  unsigned int len = 0;
  // An empty key (insecure mode) still needs a valid pointer for OpenSSL.
  static const uint8_t kNoKey = 0;
  const void* key = secret.empty() ? static_cast<const void*>(&kNoKey) : secret.data();
  const uint8_t* out = ::HMAC(EVP_sha256(), key, static_cast<int>(secret.size()), msg, sizeof(msg),
                              mac.data(), &len);
  // Fails only when libcrypto refuses the key (e.g. a FIPS provider and an empty key): never
  // hand back a MAC that both sides could agree on without the secret.
  if (out == nullptr || len != mac.size()) {
    return Status::Internal("rendezvous: HMAC-SHA256 failed in libcrypto");
  }
  return mac;
}

bool MacEqual(const RdzvMac& a, const RdzvMac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

void WipeSecret(std::string& s) {
  if (!s.empty()) OPENSSL_cleanse(s.data(), s.size());
  s.clear();
}

}  // namespace strata::cpu
