#include "cpu/rendezvous/rendezvous.h"

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu/rendezvous/auth.h"

namespace strata::cpu {
namespace {

Result<int> ParseIntEnv(const std::function<const char*(const char*)>& env, const char* name,
                        bool required, int fallback) {
  const char* v = env(name);
  if (v == nullptr || *v == '\0') {
    if (required)
      return Status::InvalidArgument(std::string("rendezvous: ") + name + " is not set");
    return fallback;
  }
  int out = 0;
  const char* end = v + std::strlen(v);
  auto [p, ec] = std::from_chars(v, end, out);
  if (ec != std::errc() || p != end) {
    return Status::InvalidArgument(std::string("rendezvous: ") + name + "='" + v +
                                   "' is not an integer");
  }
  return out;
}

// Full-buffer send/recv bounded by `deadline`. kDeadlineExceeded / kUnavailable (peer closed).
}  // namespace

// ---------------------------------------------------------------------------
// RendezvousConfig
// ---------------------------------------------------------------------------
Result<RendezvousConfig> RendezvousConfig::FromEnv(
    const std::function<const char*(const char*)>& getenv_fn) {
  const std::function<const char*(const char*)> env =
      getenv_fn ? getenv_fn : [](const char* n) -> const char* { return std::getenv(n); };
  RendezvousConfig c;
  STRATA_ASSIGN_OR_RETURN(c.rank, ParseIntEnv(env, "RANK", true, 0));
  STRATA_ASSIGN_OR_RETURN(c.world_size, ParseIntEnv(env, "WORLD_SIZE", true, 0));
  STRATA_ASSIGN_OR_RETURN(c.local_rank, ParseIntEnv(env, "LOCAL_RANK", false, c.rank));
  const char* dir = env("STRATA_RDZV_DIR");
  if (dir != nullptr) c.file_dir = dir;
  const char* addr = env("MASTER_ADDR");
  if (addr != nullptr) c.master_addr = addr;
  const bool tcp = c.file_dir.empty();
  STRATA_ASSIGN_OR_RETURN(c.master_port, ParseIntEnv(env, "MASTER_PORT", tcp, 0));
  int timeout_ms = 0;
  STRATA_ASSIGN_OR_RETURN(timeout_ms, ParseIntEnv(env, "STRATA_RDZV_TIMEOUT_MS", false, 60000));
  c.timeout = std::chrono::milliseconds(timeout_ms);
  const char* run_id = env("TORCHELASTIC_RUN_ID");
  if (run_id == nullptr || *run_id == '\0') run_id = env("STRATA_RUN_ID");
  if (run_id != nullptr) c.run_id = run_id;
  const char* secret = env("STRATA_RDZV_SECRET");
  if (secret != nullptr) c.secret = secret;
  const char* insecure = env("STRATA_RDZV_INSECURE");
  if (insecure != nullptr && *insecure != '\0' && std::strcmp(insecure, "0") != 0) {
    if (std::strcmp(insecure, "1") != 0) {
      return Status::InvalidArgument(std::string("rendezvous: STRATA_RDZV_INSECURE='") + insecure +
                                     "' must be 1 or 0");
    }
    c.insecure = true;
  }
  STRATA_RETURN_IF_ERROR(c.Validate());
  return c;
}

Status RendezvousConfig::Validate() const {
  if (world_size < 1) {
    return Status::InvalidArgument("rendezvous: WORLD_SIZE=" + std::to_string(world_size) +
                                   " must be >= 1");
  }
  if (rank < 0 || rank >= world_size) {
    return Status::InvalidArgument("rendezvous: RANK=" + std::to_string(rank) +
                                   " must be in [0, WORLD_SIZE=" + std::to_string(world_size) +
                                   ")");
  }
  if (local_rank < 0) return Status::InvalidArgument("rendezvous: LOCAL_RANK must be >= 0");
  if (timeout.count() <= 0) {
    return Status::InvalidArgument("rendezvous: STRATA_RDZV_TIMEOUT_MS must be > 0");
  }
  if (run_id.size() > 256) {
    return Status::InvalidArgument(
        "rendezvous: the run id (TORCHELASTIC_RUN_ID / STRATA_RUN_ID) "
        "is longer than 256 bytes");
  }
  if (file_dir.empty()) {
    if (master_addr.empty()) {
      return Status::InvalidArgument(
          "rendezvous: MASTER_ADDR is not set (or set STRATA_RDZV_DIR for a file store)");
    }
    if (master_port < 1 || master_port > 65535) {
      return Status::InvalidArgument("rendezvous: MASTER_PORT=" + std::to_string(master_port) +
                                     " must be in [1, 65535]");
    }
    STRATA_RETURN_IF_ERROR(CheckRendezvousSecret(secret, insecure));
  }
  return Status::OK();
}
}  // namespace strata::cpu
