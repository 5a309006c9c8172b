#include "core/zero/engine_stats_json.h"

#include <string>

namespace strata::zero {
namespace {

nlohmann::json TierJson(const PerTier<uint64_t>& t) {
  nlohmann::json j = nlohmann::json::object();
  for (Tier tier : kAllTiers) j[std::string(TierName(tier))] = t[tier];
  return j;
}

}  // namespace

nlohmann::json StepTimingsJson(const StepTimings& t) {
  return {{"gather_wait_ns", t.gather_wait_ns},
          {"gather_fetch_wait_ns", t.gather_fetch_wait_ns},
          {"reduce_wait_ns", t.reduce_wait_ns},
          {"grad_lease_wait_ns", t.grad_lease_wait_ns},
          {"optimizer_ns", t.optimizer_ns},
          {"optimizer_io_wait_ns", t.optimizer_io_wait_ns},
          {"step_ns", t.step_ns},
          {"speculative_optimizer_ns", t.speculative_optimizer_ns}};
}

nlohmann::json EngineStatsJson(const EngineStats& s) {
  nlohmann::json j = StepTimingsJson(s.timings);
  j["global_step"] = s.global_step;
  j["skipped_steps"] = s.skipped_steps;
  j["peak_bytes"] = TierJson(s.peak_bytes);
  const StoreStats& st = s.store;
  nlohmann::json moved = nlohmann::json::object();
  for (Tier from : kAllTiers) {
    for (Tier to : kAllTiers) {
      if (st.bytes_moved[from][to] == 0) continue;
      moved[std::string(TierName(from)) + "->" + std::string(TierName(to))] =
          st.bytes_moved[from][to];
    }
  }
  j["store"] = {{"bytes_moved", moved},
                {"stall_ns", st.stall_ns},
                {"acquires", st.acquires},
                {"acquire_hits", st.acquire_hits},
                {"used_bytes", TierJson(st.used_bytes)},
                {"peak_bytes", TierJson(st.peak_bytes)},
                {"budget_bytes", TierJson(st.budget_bytes)},
                {"io_busy_ns", st.io_busy_ns},
                {"io_bytes", st.io_bytes},
                {"checksum_ns", st.checksum_ns},
                {"checksum_bytes", st.checksum_bytes},
                {"checksum_idle_ns", st.checksum_idle_ns},
                {"room_wait_ns", TierJson(st.room_wait_ns)},
                {"copy_bytes", st.copy_bytes},
                {"evictions", st.evictions},
                {"errors", st.errors}};
  nlohmann::json comm = nlohmann::json::object();
  for (size_t i = 0; i < kCommOpCount; ++i) {
    const CommOpBytes& o = s.comm.ops[i];
    comm[std::string(CommOpName(static_cast<CommOp>(i)))] = {
        {"calls", o.calls},
        {"payload_bytes", o.payload_bytes},
        {"sent_bytes", o.sent_bytes},
        {"received_bytes", o.received_bytes},
        {"wire_sent_bytes", o.wire_sent_bytes},
        {"wire_received_bytes", o.wire_received_bytes}};
  }
  j["comm"] = comm;
  const SpeculationStats& sp = s.speculation;
  j["speculation"] = {{"applies", sp.applies}, {"adaptive", sp.adaptive}, {"next", sp.next},
                      {"probes", sp.probes},   {"on_s", sp.on_s},         {"off_s", sp.off_s}};
  return j;
}

}  // namespace strata::zero
