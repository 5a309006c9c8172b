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
// segments per communicator). All-to-all is Gloo's (one chunk to and from each peer, posted at
// once). Split exchanges (color, key) and then the new pairs' addresses with two all-gathers on
// this communicator's worker (no store needed) and connects the new pairs on the same transport
// device, so a sub-communicator binds the same address. Every transport wait is bounded by
// `timeout`:
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

// GlooCommOptions and CreateGlooCommunicator are declared in include/strata/comm.h (public).

}  // namespace strata
