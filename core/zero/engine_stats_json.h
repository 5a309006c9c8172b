// EngineStats and StepTimings as JSON: the one serializer behind the Python binding's
// Engine.stats() / Engine.step()["timings"] (python/src/engine_binding.cc) and `offloadctl bench
// engine`'s "engine_stats" (tools/offloadctl). Keys: global_step, skipped_steps, peak_bytes
// (per tier: "hbm", "host", "nvme"), the StepTimings totals flat (gather_wait_ns,
// gather_fetch_wait_ns, reduce_wait_ns, grad_lease_wait_ns, optimizer_ns, optimizer_io_wait_ns,
// step_ns), store {bytes_moved {"<from>-><to>": bytes, pairs that moved any}, stall_ns,
// acquires, acquire_hits, used_bytes, peak_bytes, budget_bytes, io_busy_ns, io_bytes,
// checksum_ns, checksum_bytes, checksum_idle_ns, room_wait_ns, copy_bytes, evictions, errors} and
// comm {<op name>: {calls, payload_bytes, sent_bytes, received_bytes, wire_sent_bytes,
// wire_received_bytes}} of the communicator over all ranks.
#pragma once

#include <nlohmann/json.hpp>

#include "strata/engine.h"

namespace strata::zero {

nlohmann::json StepTimingsJson(const StepTimings& t);
nlohmann::json EngineStatsJson(const EngineStats& s);

}  // namespace strata::zero
