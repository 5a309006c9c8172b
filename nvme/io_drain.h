// DrainInflight: waits until an IoBackend has nothing in flight, the one rule every cleanup path
// (IoBackend::Execute after a failure, backend destructors, SwapSpace::Close) must keep before
// it frees a buffer, closes a file or a ring.
//
// Errors do not stop the wait: a failed completion or a failed Reap is recorded (the first one
// wins) and reaping goes on. Only a backend that cannot make progress at all (Reap failing
// kMaxDrainFailures times in a row, with a short sleep between: a broken ring, a ring driven
// from the wrong thread) ends the wait early; then IO may still be in flight and the caller must
// keep its buffers and files (leak them) rather than free them.
//
// Thread safety: as IoBackend (the owner thread only).
#pragma once

#include <span>

#include "strata/io.h"
#include "strata/status.h"

namespace strata::nvme {

// Failed Reaps in a row (each followed by a 1 ms sleep) before a drain gives up.
inline constexpr int kMaxDrainFailures = 100;

// Reaps into `sink` (REQUIRES: non-empty) until io.inflight() == 0. Returns true when nothing is
// in flight any more. *first_error (may be OK on entry) receives the first error seen.
bool DrainInflight(IoBackend& io, std::span<IoCompletion> sink, Status* first_error);

}  // namespace strata::nvme
