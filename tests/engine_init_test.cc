// Engine::InitFromRank0: rank 0 alone holds the full tensors and the engine sends each rank what
// it stores. Proven bit-identical to InitFromFullTensors (every rank passing the tensors) on every
// rank, at world 1/2/4 and stages 0-3 (params and optimizer on every home), with a staging window
// small enough that groups, sub-groups and parameters are cut into pieces (37 elements: crossing
// parameter, sub-group (200) and shard boundaries); bad shapes on
// rank 0 and a dead peer come back as named errors. Harness: engine_test_model.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "emulated_device.h"
#include "engine_test_model.h"

namespace strata::testing {
namespace {

std::string Config(int stage, const char* opt, const char* param, const char* precision) {
  return std::string(R"({"train_micro_batch_size_per_gpu": 3,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "bf16": {"enabled": )") +
         (std::string(precision) == "bf16" ? "true" : "false") + R"(},
  "zero_optimization": {"stage": )" +
         std::to_string(stage) + R"(, "offload_optimizer": {"device": ")" + opt +
         R"(", "nvme_path": "/tmp"},
    "offload_param": {"device": ")" +
         param + R"(", "nvme_path": "/tmp"},
    "sub_group_size": 200, "stage3_param_persistence_threshold": 64}})";
}

using Tensors = std::vector<std::vector<std::vector<float>>>;

// InitialWeights with edge values that a conversion would change: -0, the smallest subnormal,
// the largest float, a value that rounds differently in bf16.
Tensors EdgeWeights() {
  Tensors w = InitialWeights();
  auto& t = w[kMid][0];
  t[0] = -0.0f;
  t[1] = std::numeric_limits<float>::denorm_min();
  t[2] = -std::numeric_limits<float>::max();
  t[3] = 1.0f + 0x1p-8f + 0x1p-20f;
  t[t.size() - 1] = -0.0f;
  return w;
}

std::vector<std::vector<std::span<const float>>> Spans(const Tensors& w) {
  std::vector<std::vector<std::span<const float>>> s(w.size());
  for (size_t g = 0; g < w.size(); ++g) {
    for (const auto& t : w[g]) s[g].emplace_back(t);
  }
  return s;
}

std::vector<std::vector<const float*>> Pointers(const Tensors& w) {
  std::vector<std::vector<const float*>> p(w.size());
  for (size_t g = 0; g < w.size(); ++g) {
    for (const auto& t : w[g]) p[g].push_back(t.data());
  }
  return p;
}

struct Case {
  int stage;
  const char* opt;
  const char* param;
};

std::string Name(const Case& c, int world) {
  return "world " + std::to_string(world) + " stage " + std::to_string(c.stage) + " opt=" + c.opt +
         " param=" + c.param;
}

// Every stage, and stage 3 with params and optimizer away from the device.
const Case kCases[] = {{0, "none", "none"}, {1, "cpu", "none"}, {2, "none", "none"},
                       {3, "none", "none"}, {3, "cpu", "cpu"},  {3, "nvme", "nvme"}};

// Master weights (every rank's read-back, RunEngine checks they agree) after `steps` steps from
// `w`: through InitFromRank0 (rank 0's tensors only, a window of `window` bytes) or
// InitFromFullTensors on every rank.
RunResult RunInit(const Case& c, int world, const char* precision, int steps, const Tensors& w,
                  bool from_rank0, uint64_t window = 256,
                  std::function<Device*(int rank)> device = nullptr) {
  RunSpec spec;
  spec.device = std::move(device);
  spec.config_json = Config(c.stage, c.opt, c.param, precision);
  spec.world = world;
  spec.steps = steps;
  spec.init = [&](int rank, Engine& e) -> Status {
    if (!from_rank0) return e.InitFromFullTensors(Pointers(w));
    if (rank != 0) return e.InitFromRank0({}, window);  // as engine.h says the others call it
    return e.InitFromRank0(Spans(w), window);
  };
  return RunEngine(spec);
}

// The window that makes pieces of `piece` elements per rank (three buffers of world x piece
// floats).
uint64_t Window(int world, size_t piece) { return 3 * sizeof(float) * world * piece; }

TEST(EngineInitFromRank0, BitIdenticalToFullTensorsEveryStageAndWorld) {
  const Tensors edge = EdgeWeights();
  const Tensors plain = InitialWeights();
  for (int world : {1, 2, 4}) {
    for (const Case& c : kCases) {
      // The master right after init: exactly rank 0's values, edge values included.
      RunResult a = RunInit(c, world, "bf16", 0, edge, false);
      RunResult b = RunInit(c, world, "bf16", 0, edge, true, Window(world, 37));
      ASSERT_TRUE(a.status.ok()) << Name(c, world) << ": " << a.status.ToString();
      ASSERT_TRUE(b.status.ok()) << Name(c, world) << ": " << b.status.ToString();
      EXPECT_TRUE(BitEqual(b.master, a.master)) << Name(c, world);
      EXPECT_TRUE(std::signbit(b.master[kMid][0])) << Name(c, world) << ": -0 lost";
      // A step (stage 1: params all-gathered from the shards; stage 3 on NVMe): the working
      // params (rounded from the master) and the Adam state were set alike.
      if (c.stage != 1 && std::string(c.param) != "nvme") continue;
      RunResult ta = RunInit(c, world, "bf16", 1, plain, false);
      RunResult tb = RunInit(c, world, "bf16", 1, plain, true, Window(world, 37));
      ASSERT_TRUE(ta.status.ok()) << Name(c, world) << ": " << ta.status.ToString();
      ASSERT_TRUE(tb.status.ok()) << Name(c, world) << ": " << tb.status.ToString();
      EXPECT_TRUE(BitEqual(tb.master, ta.master)) << Name(c, world) << " after a step";
    }
  }
}

// Rank 0's values from a fill (InitFromRank0Fill): asked for on rank 0 alone, piece by piece
// (never more than a window's piece at once above one rank), and the same bits as the tensors.
TEST(EngineInitFromRank0, AFillOnRank0IsAskedPieceByPieceAndGivesTheSameBits) {
  const Tensors edge = EdgeWeights();
  constexpr size_t kPiece = 37;
  for (int world : {1, 2, 4}) {
    for (const Case& c : {kCases[0], kCases[3], kCases[4]}) {
      RunResult a = RunInit(c, world, "bf16", 0, edge, false);
      ASSERT_TRUE(a.status.ok()) << Name(c, world) << ": " << a.status.ToString();
      std::vector<size_t> calls(static_cast<size_t>(world), 0), largest(calls);
      RunSpec spec;
      spec.config_json = Config(c.stage, c.opt, c.param, "bf16");
      spec.world = world;
      spec.steps = 0;
      spec.init = [&](int rank, Engine& e) -> Status {
        const auto r = static_cast<size_t>(rank);
        return e.InitFromRank0Fill(
            [&, r](size_t g, size_t p, size_t b, size_t end, float* out) {
              ++calls[r];
              largest[r] = std::max(largest[r], end - b);
              std::memcpy(out, edge[g][p].data() + b, (end - b) * sizeof(float));
              return Status::OK();
            },
            Window(world, kPiece));
      };
      RunResult b = RunEngine(spec);
      ASSERT_TRUE(b.status.ok()) << Name(c, world) << ": " << b.status.ToString();
      EXPECT_TRUE(BitEqual(b.master, a.master)) << Name(c, world);
      EXPECT_GT(calls[0], 0u) << Name(c, world);
      for (int r = 1; r < world; ++r) EXPECT_EQ(calls[r], 0u) << Name(c, world) << " rank " << r;
      if (world > 1) EXPECT_LE(largest[0], kPiece) << Name(c, world);
    }
  }
}

// Rank 0's fill fails part way: every piece is still sent (zeros from there), then rank 0
// returns its fill's error and every other rank one saying rank 0's values failed; the engines
// stay usable, and a second call initialises them to the same bits as the tensors.
TEST(EngineInitFromRank0, AFillThatFailsPartWayFailsEveryRankAndCanBeRetried) {
  const Tensors w = InitialWeights();
  for (int world : {1, 2, 4}) {
    for (const Case& c : {kCases[0], kCases[4]}) {
      RunResult want = RunInit(c, world, "bf16", 1, w, false);
      ASSERT_TRUE(want.status.ok()) << Name(c, world) << ": " << want.status.ToString();
      std::vector<Status> first(static_cast<size_t>(world));
      RunSpec spec;
      spec.config_json = Config(c.stage, c.opt, c.param, "bf16");
      spec.world = world;
      spec.steps = 1;
      spec.init = [&](int rank, Engine& e) -> Status {
        int calls = 0;
        auto values = [&](size_t g, size_t p, size_t b, size_t end, float* out) -> Status {
          if (++calls == 3 && first[static_cast<size_t>(rank)].ok() && rank == 0) {
            return Status::InvalidArgument("the fill broke at its third range");
          }
          std::memcpy(out, w[g][p].data() + b, (end - b) * sizeof(float));
          return Status::OK();
        };
        first[static_cast<size_t>(rank)] = e.InitFromRank0Fill(values, Window(world, 37));
        if (first[static_cast<size_t>(rank)].ok()) return Status::Internal("the failure was lost");
        calls = 0;
        return e.InitFromRank0Fill(values, Window(world, 37));
      };
      RunResult got = RunEngine(spec);
      ASSERT_TRUE(got.status.ok()) << Name(c, world) << ": " << got.status.ToString();
      EXPECT_TRUE(BitEqual(got.master, want.master)) << Name(c, world);
      EXPECT_EQ(first[0].ToString(), "InvalidArgument: the fill broke at its third range");
      for (int r = 1; r < world; ++r) {
        EXPECT_TRUE(first[r].IsInvalidArgument()) << first[r].ToString();
        EXPECT_NE(first[r].ToString().find("rank 0's values failed part way"), std::string::npos)
            << first[r].ToString();
      }
    }
  }
}

// fp32 working params (the param block is a copy of the master), and the default window (one
// piece per sub-group) and a window of one element per rank.
TEST(EngineInitFromRank0, Fp32AndWindowSizes) {
  for (const Case& c : {Case{0, "none", "none"}, Case{3, "cpu", "nvme"}}) {
    RunResult a = RunInit(c, 2, "fp32", 1, InitialWeights(), false);
    ASSERT_TRUE(a.status.ok()) << a.status.ToString();
    // Below one element per rank (clamped to one: every element its own all-to-all) at stage 3.
    std::vector<uint64_t> windows = {Engine::kInitWindowBytes};
    if (c.stage == 3) windows.push_back(1);
    for (uint64_t window : windows) {
      RunResult b = RunInit(c, 2, "fp32", 1, InitialWeights(), true, window);
      ASSERT_TRUE(b.status.ok()) << b.status.ToString();
      EXPECT_TRUE(BitEqual(b.master, a.master)) << Name(c, 2) << " window " << window;
    }
  }
}

// A device the host cannot address (EmulatedDevice: every staging byte goes through CopyAsync,
// and a copy under a running kernel is a violation): the same bits, no violation.
TEST(EngineInitFromRank0, DeviceTheHostCannotAddress) {
  const Tensors w = EdgeWeights();
  for (const Case& c : {Case{0, "none", "none"}, Case{3, "none", "none"}}) {
    RunResult results[2];
    for (bool from_rank0 : {false, true}) {
      std::vector<std::unique_ptr<EmulatedDevice>> devices;
      for (int r = 0; r < 2; ++r) {
        auto d = EmulatedDevice::Create(EmulatedDeviceOptions{});
        ASSERT_TRUE(d.ok()) << d.status().ToString();
        devices.push_back(std::move(*d));
      }
      results[from_rank0] = RunInit(c, 2, "bf16", 1, w, from_rank0, Window(2, 37),
                                    [&](int r) -> Device* { return devices[r].get(); });
      ASSERT_TRUE(results[from_rank0].status.ok()) << results[from_rank0].status.ToString();
      for (const auto& d : devices) EXPECT_EQ(d->violations(), 0u) << d->first_violation();
    }
    EXPECT_TRUE(BitEqual(results[1].master, results[0].master)) << Name(c, 2);
  }
}

// A tensor of the wrong size on rank 0: rank 0 names the group and parameter, rank 1 says rank 0
// refused; nothing failed, and a corrected call on the same engines then succeeds.
TEST(EngineInitFromRank0, BadShapeOnRank0IsNamedOnEveryRank) {
  const Tensors good = InitialWeights();
  Tensors bad = good;
  bad[kTop][1].pop_back();  // b2: 35 values for shape [36]
  std::vector<Status> first(2);
  RunSpec spec;
  spec.config_json = Config(3, "cpu", "none", "bf16");
  spec.world = 2;
  spec.steps = 1;
  spec.init = [&](int rank, Engine& e) -> Status {
    first[rank] = e.InitFromRank0(rank == 0 ? Spans(bad) : decltype(Spans(bad)){});
    STRATA_RETURN_IF_ERROR(e.health());
    return e.InitFromRank0(rank == 0 ? Spans(good) : decltype(Spans(good)){});
  };
  RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(first[0].code(), Status::Code::kInvalidArgument) << first[0].ToString();
  EXPECT_NE(first[0].ToString().find("top.b2"), std::string::npos) << first[0].ToString();
  EXPECT_NE(first[0].ToString().find("[36]"), std::string::npos) << first[0].ToString();
  EXPECT_EQ(first[1].code(), Status::Code::kInvalidArgument) << first[1].ToString();
  EXPECT_NE(first[1].ToString().find("rank 0"), std::string::npos) << first[1].ToString();
  // The corrected call trained from the same weights as InitFromFullTensors does.
  RunResult ref = RunInit({3, "cpu", "none"}, 2, "bf16", 1, good, false);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  EXPECT_TRUE(BitEqual(r.master, ref.master));
}

// Wrong group and parameter counts on rank 0 are named too (one rank: no communicator).
TEST(EngineInitFromRank0, WrongCountsAreNamed) {
  Tensors w = InitialWeights();
  std::vector<Status> st;
  RunSpec spec;
  spec.config_json = Config(0, "none", "none", "fp32");
  spec.steps = 0;
  spec.init = [&](int, Engine& e) -> Status {
    Tensors fewer_groups(w.begin(), w.end() - 1);
    st.push_back(e.InitFromRank0(Spans(fewer_groups)));
    Tensors fewer_params = w;
    fewer_params[kTop].pop_back();
    st.push_back(e.InitFromRank0(Spans(fewer_params)));
    return e.InitFromRank0(Spans(w));
  };
  RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(st.size(), 2u);
  EXPECT_NE(st[0].ToString().find("4 groups given, the model has 5"), std::string::npos)
      << st[0].ToString();
  EXPECT_NE(st[1].ToString().find("group 'top' has 2 parameters, 1 given"), std::string::npos)
      << st[1].ToString();
}

// A peer that dies before the scatter: rank 0's call fails within the timeout, naming the
// operation, and the engine is failed.
TEST(EngineInitFromRank0, DeadPeerIsNamedWithinTheDeadline) {
  const Tensors w = InitialWeights();
  Status root;
  bool failed_after = false;
  RunSpec spec;
  spec.config_json = Config(2, "none", "none", "bf16");
  spec.world = 2;
  spec.steps = 0;
  spec.timeout = std::chrono::milliseconds(3000);
  spec.init = [&](int rank, Engine& e) -> Status {
    if (rank == 1) return Status::Aborted("rank 1 died (test)");
    root = e.InitFromRank0(Spans(w));
    failed_after = !e.health().ok();
    return root;
  };
  const auto t0 = std::chrono::steady_clock::now();
  RunResult r = RunEngine(spec);
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(root.ok());
  EXPECT_NE(root.ToString().find("InitFromRank0"), std::string::npos) << root.ToString();
  EXPECT_TRUE(failed_after);
  EXPECT_LT(took, std::chrono::seconds(30)) << root.ToString();
  EXPECT_FALSE(r.rank_status[0].ok());
}

// ------------------------------------------------------------------------------------------------
// Engine::WriteParams: the working params of some groups at any step, the masters kept.
// ------------------------------------------------------------------------------------------------

// Group g's gathered params as floats (HostDevice: the host may read them).
Result<std::vector<float>> GatheredValues(Engine& e, size_t g) {
  STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, e.Gather(g));
  std::vector<float> out(gg.numel());
  for (size_t i = 0; i < out.size(); ++i) {
    if (gg.dtype() == DType::kF32) {
      out[i] = static_cast<const float*>(gg.data())[i];
    } else {
      out[i] = Bf16ToFloat(bf16_t{static_cast<const uint16_t*>(gg.data())[i]});
    }
  }
  e.Release(std::move(gg));
  return out;
}

Result<std::vector<float>> Master(Engine& e, size_t g) {
  std::vector<float> m(e.model().groups[g].numel());
  STRATA_RETURN_IF_ERROR(e.ReadMaster(g, m));
  return m;
}

// Two bf16 steps at every placement on one and two ranks, `after_step(step, engine)` on every
// rank after each; every rank's result must be OK.
void ForEveryPlacement(const std::function<Status(int step, Engine& e)>& after_step) {
  for (int world : {1, 2}) {
    for (const Case& c : kCases) {
      RunSpec spec;
      spec.config_json = Config(c.stage, c.opt, c.param, "bf16");
      spec.world = world;
      spec.steps = 2;
      spec.after_step = [&](int, int step, Engine& e) { return after_step(step, e); };
      RunResult r = RunEngine(spec);
      EXPECT_TRUE(r.status.ok()) << Name(c, world) << ": " << r.status.ToString();
      for (const Status& st : r.rank_status)
        EXPECT_TRUE(st.ok()) << Name(c, world) << ": " << st.ToString();
    }
  }
}

// After step 0 every rank writes kMid's params (values that bf16 rounds): Gather gives their
// rounding, the other groups and every master are unchanged; after step 1 (trained on the
// written params) kMid's params are the rounding of its master again.
TEST(EngineWriteParams, WritesTheWorkingParamsAndTheNextStepRecomputesThemFromTheMasters) {
  auto written = [](size_t i) { return 0.25f + 0x1p-12f * static_cast<float>(i % 97); };
  auto bf16 = [](float v) { return Bf16ToFloat(FloatToBf16(v)); };
  ForEveryPlacement(
      [&](int step, Engine& e) -> Status {
        std::vector<std::vector<float>> params, masters;
        for (size_t g = 0; g < kGroups; ++g) {
          STRATA_ASSIGN_OR_RETURN(std::vector<float> v, GatheredValues(e, g));
          STRATA_ASSIGN_OR_RETURN(std::vector<float> m, Master(e, g));
          params.push_back(std::move(v));
          masters.push_back(std::move(m));
        }
        if (step == 1) {
          for (size_t i = 0; i < masters[kMid].size(); ++i) {
            if (params[kMid][i] != bf16(masters[kMid][i])) {
              return Status::Internal("after the next step: param " + std::to_string(i) +
                                      " is not its master's rounding");
            }
          }
          return Status::OK();
        }
        const size_t groups[] = {kMid};
        STRATA_RETURN_IF_ERROR(
            e.WriteParams(groups, [&](size_t g, size_t p, size_t b, size_t end, float* o) {
              if (g != kMid) return Status::Internal("asked for a group not named");
              size_t base = 0;  // the parameter's first element in the group
              for (size_t q = 0; q < p; ++q) base += e.model().groups[g].params[q].numel();
              for (size_t i = b; i < end; ++i) o[i - b] = written(base + i);
              return Status::OK();
            }));
        for (size_t g = 0; g < kGroups; ++g) {
          STRATA_ASSIGN_OR_RETURN(std::vector<float> v, GatheredValues(e, g));
          STRATA_ASSIGN_OR_RETURN(std::vector<float> m, Master(e, g));
          if (!BitEqual({m}, {masters[g]})) {
            return Status::Internal("group " + std::to_string(g) + ": the master changed");
          }
          for (size_t i = 0; i < v.size(); ++i) {
            const float want = g == kMid ? bf16(written(i)) : params[g][i];
            if (std::memcmp(&v[i], &want, sizeof want) != 0) {
              return Status::Internal("group " + std::to_string(g) + " param " + std::to_string(i) +
                                      ": " + std::to_string(v[i]) + " read, " +
                                      std::to_string(want) + " written");
            }
          }
        }
        return Status::OK();
      });
}

// Initialised again after its groups were gathered and released, before any step (what
// GatheredParameters(modifier_rank=...) does then, and on a frozen model's engine, which never
// steps): at stage 3 on 2 ranks with every group persistent (kept gathered after Release), each
// group then reads the new values, not the copy kept from before.
TEST(EngineInit, InitAgainAfterGathersDropsTheKeptCopies) {
  std::string cfg = Config(3, "none", "none", "fp32");
  const std::string threshold = R"("stage3_param_persistence_threshold": 64)";
  cfg.replace(cfg.find(threshold), threshold.size(),
              R"("stage3_param_persistence_threshold": 1000000000)");
  RunSpec spec;
  spec.config_json = cfg;
  spec.world = 2;
  spec.steps = 1;
  const Tensors w = InitialWeights();
  auto twice = [&](size_t g, size_t p, size_t b, size_t end, float* o) {
    for (size_t i = b; i < end; ++i) o[i - b] = 2.0f * w[g][p][i];
  };
  spec.init = [&](int, Engine& e) -> Status {
    STRATA_RETURN_IF_ERROR(e.InitFromFullTensors(Pointers(w)));
    for (size_t g = 0; g < kGroups; ++g) {
      STRATA_RETURN_IF_ERROR(GatheredValues(e, g).status());  // kept after its release
    }
    STRATA_RETURN_IF_ERROR(e.InitParameters(twice));
    for (size_t g = 0; g < kGroups; ++g) {
      STRATA_ASSIGN_OR_RETURN(std::vector<float> v, GatheredValues(e, g));
      size_t i = 0;
      for (const std::vector<float>& t : w[g]) {
        for (float x : t) {
          if (v[i] != 2.0f * x) {
            return Status::Internal("group " + std::to_string(g) + " value " + std::to_string(i) +
                                    ": " + std::to_string(v[i]) + " read, " +
                                    std::to_string(2.0f * x) + " initialised");
          }
          ++i;
        }
      }
    }
    return Status::OK();
  };
  RunResult r = RunEngine(spec);
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  for (const Status& st : r.rank_status) EXPECT_TRUE(st.ok()) << st.ToString();
}

// ------------------------------------------------------------------------------------------------
// Engine::WriteOptimizerState: one parameter's master or moment at any step, the rest kept.
// ------------------------------------------------------------------------------------------------

Result<std::vector<float>> State(Engine& e, size_t g, StateKind kind) {
  std::vector<float> v(e.model().groups[g].numel());
  STRATA_RETURN_IF_ERROR(e.ReadOptimizerState(g, kind, v));
  return v;
}

// After step 0 every rank writes the master of kTop's second parameter and the exp_avg_sq of its
// first: those ranges read back as written, every other value of every state as before, the
// working params of the written master are its rounding (the rest unchanged); step 1 trains
// from there on every placement. Then the refusals.
TEST(EngineWriteOptimizerState, WritesOneParametersStateAndKeepsTheRest) {
  // Masters in [-0.5, 0), second moments small and positive (Adam takes their square root).
  auto written = [](size_t i) { return -0.5f + 0x1p-11f * static_cast<float>(i % 89); };
  auto written_sq = [](size_t i) { return 0x1p-20f * static_cast<float>(i % 89 + 1); };
  auto bf16 = [](float v) { return Bf16ToFloat(FloatToBf16(v)); };
  ForEveryPlacement([&](int step, Engine& e) -> Status {
    if (step == 1) return Status::OK();
    const auto& params = e.model().groups[kTop].params;
    const size_t begin = params[0].numel(), end = begin + params[1].numel();
    const StateKind kinds[] = {StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq};
    std::vector<std::vector<std::vector<float>>> before(kGroups);
    std::vector<std::vector<float>> gathered(kGroups);
    for (size_t g = 0; g < kGroups; ++g) {
      for (StateKind k : kinds) {
        STRATA_ASSIGN_OR_RETURN(std::vector<float> v, State(e, g, k));
        before[g].push_back(std::move(v));
      }
      STRATA_ASSIGN_OR_RETURN(gathered[g], GatheredValues(e, g));
    }
    auto fill = [&](size_t g, size_t p, size_t b, size_t stop, float* o) -> Status {
      if (g != kTop) return Status::Internal("asked for another group");
      for (size_t i = b; i < stop; ++i) o[i - b] = p == 1 ? written(begin + i) : written_sq(i);
      return Status::OK();
    };
    STRATA_RETURN_IF_ERROR(e.WriteOptimizerState(kTop, 1, StateKind::kMaster32, fill));
    STRATA_RETURN_IF_ERROR(e.WriteOptimizerState(kTop, 0, StateKind::kExpAvgSq, fill));
    for (size_t g = 0; g < kGroups; ++g) {
      for (size_t k = 0; k < 3; ++k) {
        STRATA_ASSIGN_OR_RETURN(std::vector<float> v, State(e, g, kinds[k]));
        for (size_t i = 0; i < v.size(); ++i) {
          const bool master_written = g == kTop && k == 0 && i >= begin && i < end;
          const bool sq_written = g == kTop && k == 2 && i < begin;
          const float want = master_written ? written(i)
                             : sq_written   ? written_sq(i)
                                            : before[g][k][i];
          if (std::memcmp(&v[i], &want, sizeof want) != 0) {
            return Status::Internal("group " + std::to_string(g) + " " +
                                    std::string(StateKindName(kinds[k])) + "[" + std::to_string(i) +
                                    "]: " + std::to_string(v[i]) + " read, " +
                                    std::to_string(want) + " wanted");
          }
        }
      }
      STRATA_ASSIGN_OR_RETURN(std::vector<float> v, GatheredValues(e, g));
      for (size_t i = 0; i < v.size(); ++i) {
        const float want = g == kTop && i >= begin && i < end ? bf16(written(i)) : gathered[g][i];
        if (std::memcmp(&v[i], &want, sizeof want) != 0) {
          return Status::Internal("group " + std::to_string(g) + " param[" + std::to_string(i) +
                                  "]: " + std::to_string(v[i]) + " gathered, " +
                                  std::to_string(want) + " wanted");
        }
      }
    }
    auto zeros = [](size_t, size_t, size_t b, size_t stop, float* o) {
      std::fill(o, o + (stop - b), 0.0f);
      return Status::OK();
    };
    if (e.WriteOptimizerState(kTop, 0, StateKind::kParam16, zeros).code() !=
            Status::Code::kInvalidArgument ||
        e.WriteOptimizerState(kTop, params.size(), StateKind::kMaster32, zeros).code() !=
            Status::Code::kInvalidArgument) {
      return Status::Internal("param16 or a parameter out of range was not refused");
    }
    STRATA_ASSIGN_OR_RETURN(GatheredGroup held, e.Gather(kMid));
    const Status gathered_out = e.WriteOptimizerState(kTop, 0, StateKind::kExpAvg, zeros);
    e.Release(std::move(held));
    if (gathered_out.code() != Status::Code::kFailedPrecondition) {
      return Status::Internal("written while a group was gathered: " + gathered_out.ToString());
    }
    return Status::OK();
  });
}

TEST(EngineWriteParams, AGatheredGroupOrAGroupOutOfRangeIsRefusedAndNothingIsWritten) {
  RunSpec spec;
  spec.config_json = Config(3, "cpu", "none", "bf16");
  spec.steps = 1;
  Status gathered, out_of_range;
  bool unchanged = false;
  spec.after_step = [&](int, int, Engine& e) -> Status {
    STRATA_ASSIGN_OR_RETURN(std::vector<float> before, GatheredValues(e, kTop));
    auto fill = [](size_t, size_t, size_t b, size_t end, float* o) {
      std::fill(o, o + (end - b), 3.0f);
      return Status::OK();
    };
    STRATA_ASSIGN_OR_RETURN(GatheredGroup held, e.Gather(kMid));
    const size_t top[] = {kTop};
    gathered = e.WriteParams(top, fill);
    e.Release(std::move(held));
    const size_t bad[] = {kGroups};
    out_of_range = e.WriteParams(bad, fill);
    STRATA_ASSIGN_OR_RETURN(std::vector<float> after, GatheredValues(e, kTop));
    unchanged = before == after;
    return e.health();
  };
  RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(gathered.code(), Status::Code::kFailedPrecondition) << gathered.ToString();
  EXPECT_NE(gathered.ToString().find("not released"), std::string::npos) << gathered.ToString();
  EXPECT_EQ(out_of_range.code(), Status::Code::kInvalidArgument) << out_of_range.ToString();
  EXPECT_NE(out_of_range.ToString().find("out of range"), std::string::npos);
  EXPECT_TRUE(unchanged);
}

// A fill that fails on one rank (part way through its pieces) writes nothing on any rank: that
// rank gets its own error, the other one InvalidArgument naming it, and training goes on.
TEST(EngineWriteParams, AFillThatFailsOnOneRankWritesNothingAnywhere) {
  for (int stage : {2, 3}) {
    RunSpec spec;
    spec.config_json = Config(stage, "cpu", "none", "bf16");
    spec.world = 2;
    spec.steps = 2;
    std::vector<Status> got(2);
    std::vector<char> unchanged(2, 0);  // one per rank thread (vector<bool> packs bits)
    spec.after_step = [&](int rank, int step, Engine& e) -> Status {
      if (step != 0) return Status::OK();
      STRATA_ASSIGN_OR_RETURN(std::vector<float> before, GatheredValues(e, kMid));
      int calls = 0;
      const size_t groups[] = {kMid, kTop};
      got[rank] = e.WriteParams(groups, [&](size_t, size_t, size_t b, size_t end, float* o) {
        if (rank == 1 && ++calls == 2) return Status::Corruption("rank 1's second piece");
        std::fill(o, o + (end - b), 7.0f);
        return Status::OK();
      });
      STRATA_ASSIGN_OR_RETURN(std::vector<float> after, GatheredValues(e, kMid));
      unchanged[rank] = before == after;
      return e.health();
    };
    RunResult r = RunEngine(spec);
    ASSERT_TRUE(r.status.ok()) << "stage " << stage << ": " << r.status.ToString();
    EXPECT_EQ(got[1].code(), Status::Code::kCorruption) << got[1].ToString();
    EXPECT_EQ(got[0].code(), Status::Code::kInvalidArgument) << got[0].ToString();
    EXPECT_NE(got[0].ToString().find("rank 1"), std::string::npos) << got[0].ToString();
    EXPECT_TRUE(unchanged[0] && unchanged[1]) << "stage " << stage;
    EXPECT_EQ(r.reports.size(), 2u) << "stage " << stage << ": training stopped";
  }
}

// ------------------------------------------------------------------------------------------------
// Engine::RestoreProgress: another trainer's resume (WriteOptimizerState for the states, then the
// counters, the schedule's position and the loss scaler).
// ------------------------------------------------------------------------------------------------

std::string WarmupConfig(int stage, const char* opt, const char* precision) {
  std::string c = Config(stage, opt, opt, precision);
  c.pop_back();  // the closing brace
  return c + R"(, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
    "warmup_max_lr": 0.01, "warmup_num_steps": 5}}, "fp16": {"enabled": )" +
         (std::string(precision) == "fp16" ? "true" : "false") + R"(, "initial_scale_power": 4}})";
}

// Every group's master, exp_avg and exp_avg_sq, whole (collective).
Result<Tensors> AllStates(Engine& e) {
  Tensors out(kGroups);
  for (size_t g = 0; g < kGroups; ++g) {
    for (StateKind k : {StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      STRATA_ASSIGN_OR_RETURN(std::vector<float> v, State(e, g, k));
      out[g].push_back(std::move(v));
    }
  }
  return out;
}

// Two steps, then every state read out and written into a fresh engine with the progress restored,
// as a resume from another trainer's checkpoint does: steps 2..4 give the masters of the
// uninterrupted run bit for bit, at one and two ranks, with the schedule still warming up.
TEST(EngineRestoreProgress, StatesWrittenAndProgressRestoredTrainOnAsTheUninterruptedRun) {
  for (int world : {1, 2}) {
    for (const Case& c : {Case{1, "none", "none"}, Case{3, "cpu", "cpu"}}) {
      RunSpec whole;
      whole.config_json = WarmupConfig(c.stage, c.opt, "bf16");
      whole.world = world;
      whole.steps = 5;
      const RunResult uninterrupted = RunEngine(whole);
      ASSERT_TRUE(uninterrupted.status.ok()) << uninterrupted.status.ToString();

      Tensors saved;
      RunSpec first = whole;
      first.steps = 2;
      first.after_step = [&](int rank, int step, Engine& e) -> Status {
        if (step != 1) return Status::OK();
        STRATA_ASSIGN_OR_RETURN(Tensors s, AllStates(e));
        if (rank == 0) saved = std::move(s);
        return Status::OK();
      };
      ASSERT_TRUE(RunEngine(first).status.ok());
      ASSERT_EQ(saved.size(), kGroups);

      RunSpec resumed = whole;
      resumed.first_step = 2;
      resumed.after_init = [&](int, Engine& e) -> Status {
        for (size_t g = 0; g < kGroups; ++g) {
          const auto& params = e.model().groups[g].params;
          for (size_t k = 0; k < 3; ++k) {
            const StateKind kind = k == 0   ? StateKind::kMaster32
                                   : k == 1 ? StateKind::kExpAvg
                                            : StateKind::kExpAvgSq;
            size_t base = 0;
            for (size_t p = 0; p < params.size(); ++p) {
              auto fill = [&](size_t, size_t, size_t b, size_t end, float* o) {
                std::copy(saved[g][k].begin() + base + b, saved[g][k].begin() + base + end, o);
                return Status::OK();
              };
              STRATA_RETURN_IF_ERROR(e.WriteOptimizerState(g, p, kind, fill));
              base += params[p].numel();
            }
          }
        }
        TrainingProgress p;
        p.global_step = 2;
        p.optimizer_step = 2;
        p.schedule_position = 2;
        STRATA_RETURN_IF_ERROR(e.RestoreProgress(p));
        if (e.global_step() != 2 || e.schedule_position() != 2) {
          return Status::Internal("the counters were not restored");
        }
        return Status::OK();
      };
      const RunResult r = RunEngine(resumed);
      ASSERT_TRUE(r.status.ok()) << r.status.ToString();
      ASSERT_EQ(r.master.size(), uninterrupted.master.size());
      for (size_t g = 0; g < r.master.size(); ++g) {
        EXPECT_EQ(0, std::memcmp(r.master[g].data(), uninterrupted.master[g].data(),
                                 r.master[g].size() * sizeof(float)))
            << "stage " << c.stage << ", world " << world << ", group " << g;
      }
      EXPECT_EQ(r.reports.back().global_step, 5);
      EXPECT_DOUBLE_EQ(r.reports.back().lr, uninterrupted.reports.back().lr);
    }
  }
}

// The refusals change nothing; the fp16 scaler takes the given state.
TEST(EngineRestoreProgress, RefusesImpossibleCountsAndRestoresTheLossScaler) {
  RunSpec spec;
  spec.config_json = WarmupConfig(2, "none", "fp16");
  spec.steps = 1;
  spec.after_micro = [](int, int, int, Engine& e) -> Status {
    TrainingProgress p;
    p.global_step = 1;
    if (e.RestoreProgress(p).code() != Status::Code::kFailedPrecondition) {
      return Status::Internal("restored mid-accumulation");
    }
    return Status::OK();
  };
  spec.after_step = [](int, int, Engine& e) -> Status {
    const double scale = e.CurrentLossScale();
    for (TrainingProgress p : {TrainingProgress{.global_step = -1},
                               TrainingProgress{.global_step = 3, .skipped_steps = 4},
                               TrainingProgress{.global_step = 3, .loss_scale = -2},
                               TrainingProgress{.global_step = 3, .loss_scale = std::nan("")}}) {
      const Status st = e.RestoreProgress(p);
      if (st.code() != Status::Code::kInvalidArgument) {
        return Status::Internal("not refused: " + st.ToString());
      }
    }
    if (e.global_step() != 1 || e.CurrentLossScale() != scale) {
      return Status::Internal("a refused RestoreProgress changed the engine");
    }
    TrainingProgress p{.global_step = 9,
                       .skipped_steps = 2,
                       .optimizer_step = 7,
                       .schedule_position = 7,
                       .loss_scale = 128,
                       .scaler_iteration = 9,
                       .scaler_last_overflow = 6,
                       .scaler_hysteresis_left = 1};
    STRATA_RETURN_IF_ERROR(e.RestoreProgress(p));
    if (e.global_step() != 9 || e.CurrentLossScale() != 128 || e.schedule_position() != 7 ||
        e.Stats().skipped_steps != 2) {
      return Status::Internal("restored " + std::to_string(e.global_step()) + ", scale " +
                              std::to_string(e.CurrentLossScale()));
    }
    return Status::OK();
  };
  const RunResult r = RunEngine(spec);
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  for (const Status& st : r.rank_status) EXPECT_TRUE(st.ok()) << st.ToString();
}

}  // namespace
}  // namespace strata::testing
