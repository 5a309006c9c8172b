// zero::EngineStatsJson, the one serializer of EngineStats behind the Python binding's
// Engine.stats() (and its step reports' "timings": StepTimingsJson) and `offloadctl bench
// engine`'s "engine_stats": every key the Python adapter and its tests read, each carrying its
// own field.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "core/zero/engine_stats_json.h"

namespace strata::zero {
namespace {

std::set<std::string> Keys(const nlohmann::json& j) {
  std::set<std::string> k;
  for (const auto& [key, value] : j.items()) k.insert(key);
  return k;
}

TEST(EngineStatsJson, EveryFieldUnderItsKey) {
  EngineStats s{};  // every counter zero
  s.global_step = 7;
  s.skipped_steps = 1;
  s.peak_bytes[Tier::kDevice] = 11;
  s.peak_bytes[Tier::kNvme] = 13;
  s.timings = {.gather_wait_ns = 1,
               .gather_fetch_wait_ns = 2,
               .reduce_wait_ns = 3,
               .grad_lease_wait_ns = 4,
               .optimizer_ns = 5,
               .optimizer_io_wait_ns = 6,
               .step_ns = 7,
               .speculative_optimizer_ns = 8};
  s.store.bytes_moved[Tier::kHost][Tier::kNvme] = 100;
  s.store.stall_ns = 21;
  s.store.acquires = 22;
  s.store.acquire_hits = 23;
  s.store.used_bytes[Tier::kHost] = 24;
  s.store.peak_bytes[Tier::kHost] = 25;
  s.store.budget_bytes[Tier::kHost] = 26;
  s.store.io_busy_ns = 27;
  s.store.io_bytes = 28;
  s.store.checksum_ns = 33;
  s.store.checksum_bytes = 34;
  s.store.checksum_idle_ns = 35;
  s.store.room_wait_ns[Tier::kHost] = 29;
  s.store.copy_bytes = 30;
  s.store.evictions = 31;
  s.store.errors = 32;
  s.comm.ops[static_cast<size_t>(CommOp::kReduceScatter)] = {.calls = 41,
                                                             .payload_bytes = 42,
                                                             .sent_bytes = 43,
                                                             .received_bytes = 44,
                                                             .wire_sent_bytes = 45,
                                                             .wire_received_bytes = 46};
  s.speculation = {
      .applies = true, .adaptive = true, .next = false, .probes = 2, .on_s = 0.5, .off_s = 0.25};
  const nlohmann::json j = EngineStatsJson(s);
  EXPECT_EQ(j["speculation"], nlohmann::json({{"applies", true},
                                              {"adaptive", true},
                                              {"next", false},
                                              {"probes", 2},
                                              {"on_s", 0.5},
                                              {"off_s", 0.25}}));
  EXPECT_EQ(Keys(j),
            (std::set<std::string>{"global_step", "skipped_steps", "peak_bytes", "gather_wait_ns",
                                   "gather_fetch_wait_ns", "reduce_wait_ns", "grad_lease_wait_ns",
                                   "optimizer_ns", "optimizer_io_wait_ns", "step_ns",
                                   "speculative_optimizer_ns", "store", "comm", "speculation"}));
  EXPECT_EQ(j["global_step"], 7);
  EXPECT_EQ(j["skipped_steps"], 1);
  EXPECT_EQ(j["peak_bytes"], nlohmann::json({{"hbm", 11}, {"host", 0}, {"nvme", 13}}));
  // The timings flat, as StepTimingsJson gives a step report's.
  const nlohmann::json t = StepTimingsJson(s.timings);
  EXPECT_EQ(t, nlohmann::json({{"gather_wait_ns", 1},
                               {"gather_fetch_wait_ns", 2},
                               {"reduce_wait_ns", 3},
                               {"grad_lease_wait_ns", 4},
                               {"optimizer_ns", 5},
                               {"optimizer_io_wait_ns", 6},
                               {"step_ns", 7},
                               {"speculative_optimizer_ns", 8}}));
  for (const auto& [key, value] : t.items()) EXPECT_EQ(j[key], value) << key;
  const nlohmann::json& st = j["store"];
  EXPECT_EQ(st["bytes_moved"], nlohmann::json({{"host->nvme", 100}}));  // pairs that moved any
  EXPECT_EQ(st["stall_ns"], 21);
  EXPECT_EQ(st["acquires"], 22);
  EXPECT_EQ(st["acquire_hits"], 23);
  EXPECT_EQ(st["used_bytes"]["host"], 24);
  EXPECT_EQ(st["peak_bytes"]["host"], 25);
  EXPECT_EQ(st["budget_bytes"]["host"], 26);
  EXPECT_EQ(st["io_busy_ns"], 27);
  EXPECT_EQ(st["io_bytes"], 28);
  EXPECT_EQ(st["checksum_ns"], 33);
  EXPECT_EQ(st["checksum_bytes"], 34);
  EXPECT_EQ(st["checksum_idle_ns"], 35);
  EXPECT_EQ(st["room_wait_ns"], nlohmann::json({{"hbm", 0}, {"host", 29}, {"nvme", 0}}));
  EXPECT_EQ(st["copy_bytes"], 30);
  EXPECT_EQ(st["evictions"], 31);
  EXPECT_EQ(st["errors"], 32);
  EXPECT_EQ(Keys(j["comm"]), (std::set<std::string>{"all_gather", "reduce_scatter", "all_reduce",
                                                    "broadcast", "barrier", "all_to_all"}));
  EXPECT_EQ(j["comm"]["reduce_scatter"], nlohmann::json({{"calls", 41},
                                                         {"payload_bytes", 42},
                                                         {"sent_bytes", 43},
                                                         {"received_bytes", 44},
                                                         {"wire_sent_bytes", 45},
                                                         {"wire_received_bytes", 46}}));
}

}  // namespace
}  // namespace strata::zero
