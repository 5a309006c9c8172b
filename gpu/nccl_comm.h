// NcclCommunicator: the Communicator over NCCL on device buffers (see include/strata/comm.h).
// Built only when STRATA_CUDA is ON.
//
// One NCCL communicator per engine, created non-blocking (ncclConfig_t.blocking = 0) and driven on
// its own CUDA stream. Every NCCL call that returns ncclInProgress is polled with
// ncclCommGetAsyncError against the options' timeout; a handle's Wait polls its completion event
// and the communicator's async error against the caller's deadline. When a peer dies (NCCL reports
// an async error) or a deadline passes, the communicator is aborted with ncclCommAbort and the
// Status says which operation, which rank and why, instead of hanging in a kernel forever.
//
// Bootstrap: from an ncclUniqueId supplied by the trainer (options.unique_id, 128 bytes from
// NewNcclUniqueId on rank 0, shipped by any means), or exchanged through the rendezvous store
// (rank 0 publishes it under options.store_key). One rank needs neither: without an id it makes
// its own.
//
// All-to-all is grouped ncclSend/ncclRecv (one pair per peer). Split is ncclCommSplit: the new
// communicator is non-blocking too, on its own stream, with pre-division by its own world size.
// int8 moves as ncclInt8 (all-gather, broadcast, all-to-all).
//
// Pre-division uses NCCL's ncclRedOpCreatePreMulSum (scalar 1/world_size, one op per dtype).
// Barrier is an all-reduce of one float. bf16/fp16 sums use NCCL's own arithmetic.
//
// Thread safety: as Communicator; Abort may race a Wait safely (one mutex guards the comm).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/comm.h"

namespace strata {

struct NcclCommOptions {
  int rank = 0;
  int world_size = 1;
  int device = 0;  // CUDA device ordinal, usually LOCAL_RANK
  // 128-byte ncclUniqueId; empty: rank 0 creates one and publishes it through `store` (one
  // rank: makes its own, no store needed).
  std::vector<uint8_t> unique_id;
  KvStore* store = nullptr;  // not owned; used during Create only
  std::string store_key = "strata/nccl/unique_id";
  // Bound on initialization and on every in-progress poll of an enqueue.
  std::chrono::milliseconds timeout{60000};
};

// A fresh ncclUniqueId (128 bytes). kUnavailable when NCCL cannot create one (no network/GPU).
Result<std::vector<uint8_t>> NewNcclUniqueId();

// kUnavailable when no CUDA device is usable (the message carries the CUDA error);
// kDeadlineExceeded when the peers did not all join within the timeout (the comm is aborted);
// kInvalidArgument for bad options.
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclCommOptions& options);

}  // namespace strata
