// GlooCommunicator: the Communicator over Gloo's TCP transport, on host buffers, so that
// multi-process ZeRO runs work on machines without a GPU (see include/strata/comm.h).
//
// Gloo's collectives are synchronous; this backend runs them, in submission order, on one worker
// thread per communicator fed by a bounded queue (queue_depth operations; a submit that finds the
// queue full waits up to `timeout`, then fails with kResourceExhausted). All-gather, all-reduce
// (fp32), broadcast and barrier are Gloo's own algorithms; reduce-scatter is a ring over Gloo's
// unbound buffers whose partial sums travel in fp32, so bf16/fp16 sums are accumulated in fp32 and
// rounded once; 16-bit all-reduce is that ring (over world_size chunks) followed by an all-gather
// of the rounded 16-bit chunks. Rings run per segment of scratch_elems elements (scratch: two fp32
// segments per communicator). Every transport wait is bounded by `timeout`:
// a peer that exits makes the others fail at once (connection closed) and a peer that hangs makes
// them fail at the timeout, with a Status naming the operation, its sequence number and the cause.
//
// Thread safety: as Communicator.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "strata/comm.h"

namespace strata {

struct GlooCommOptions {
  int rank = 0;
  int world_size = 1;
  // Rendezvous store used during Create only (not owned). REQUIRES: non-null when world_size > 1.
  KvStore* store = nullptr;
  // Keys are "<store_prefix>/..." so that several communicators can share one store.
  std::string store_prefix = "strata/gloo";
  // Address the TCP transport binds to (this host's address as the peers see it).
  std::string hostname = "127.0.0.1";
  // Bound on rendezvous, every transport wait and a full submit queue. Longer tolerates slow
  // peers; shorter detects a hung peer sooner.
  std::chrono::milliseconds timeout{60000};
  // Operations submitted but not finished. Bounds memory held by queued closures.
  size_t queue_depth = 64;
  // fp32 elements per reduction segment (scratch memory = 2 * 4 * scratch_elems bytes).
  size_t scratch_elems = size_t{1} << 20;
};

// Connects to all peers (full mesh through the store), then runs a barrier so that the store may
// be dropped afterwards. kInvalidArgument for bad options; kDeadlineExceeded / kUnavailable when
// peers do not show up or the transport fails, with Gloo's message.
// Sets SIGPIPE to SIG_IGN when it has the default action (a dead peer must fail a collective with
// kUnavailable, not kill this process); a handler the program installed is left alone.
Result<std::unique_ptr<Communicator>> CreateGlooCommunicator(const GlooCommOptions& options);

}  // namespace strata
