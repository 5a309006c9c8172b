// Rendezvous for multi-process runs: where ranks find each other before any collective.
//
// RendezvousConfig reads the variables torchrun and the deepspeed launcher set (RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT), plus STRATA_RDZV_DIR (use a file store in that shared
// directory instead of TCP), STRATA_RDZV_TIMEOUT_MS, STRATA_RDZV_SECRET / STRATA_RDZV_INSECURE
// (the TCP store's authentication) and a run id (TORCHELASTIC_RUN_ID as torchrun sets it, else
// STRATA_RUN_ID as `offloadctl launch` sets it): OpenRendezvousStore puts every key under
// "run/<run id>/" so that runs sharing a store directory never read each other's keys.
// Two KvStore implementations:
//  - FileKvStore: one file per key in a directory only this user can write (written to a
//    temp name, then renamed, so readers never see a partial value); Get polls for the file.
//  - TcpKvStore: rank 0 hosts a small server on MASTER_ADDR:MASTER_PORT (one event-loop thread;
//    every connection authenticated with the run's secret before it is served; at most
//    kMaxClients connections, deadlines for the handshake and idle connections; keys <= 4 KiB,
//    values <= 16 MiB, 256 MiB in all, bytes in flight included); every rank, rank 0 included,
//    is a client. Connecting retries until the timeout so ranks may start in any order.
//
// Thread safety: stores are thread-safe. The TCP server lives as long as rank 0's store object:
// keep it until every rank has read what it needs (the communicators end their setup with a
// barrier for that reason).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "cpu/rendezvous/file_store.h"
#include "cpu/rendezvous/tcp_store.h"
#include "strata/comm.h"

namespace strata::cpu {

struct RendezvousConfig {
  int rank = -1;
  int world_size = 0;
  int local_rank = 0;
  std::string master_addr;  // TCP store host (rank 0 listens here)
  int master_port = 0;      // TCP store port, 1..65535
  std::string file_dir;     // non-empty: file store in this shared directory instead of TCP
  std::chrono::milliseconds timeout{60000};  // connect / key wait limit
  std::string run_id;  // non-empty: keys are scoped to "run/<run_id>/" (<= 256 bytes)
  // STRATA_RDZV_SECRET: the run's shared secret, 16..4096 bytes, the same on every rank. The TCP
  // store serves only connections that prove they hold it (cpu/rendezvous/auth.h). Required
  // with TCP unless `insecure`; unused by the file store.
  std::string secret;
  // STRATA_RDZV_INSECURE=1: with no secret, run the TCP store without authentication (anyone
  // who reaches MASTER_ADDR:MASTER_PORT can read and forge keys; rank 0 warns on stderr).
  bool insecure = false;

  // Reads the environment through `getenv` (injectable for tests). kInvalidArgument naming the
  // variable when one is missing, not an integer, or out of range.
  static Result<RendezvousConfig> FromEnv(
      const std::function<const char*(const char*)>& getenv = nullptr);
  // kInvalidArgument naming the field when the configuration cannot work.
  Status Validate() const;
};

Result<std::unique_ptr<KvStore>> OpenRendezvousStore(const RendezvousConfig& config);

}  // namespace strata::cpu
