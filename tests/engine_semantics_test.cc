// The engine's semantics beyond equivalence: communication equals the ledger, budgets refuse at
// Create naming the tier, fp16 overflow skips exactly one step, clipping by the global norm, LR
// schedules, DeepSpeed's offload traps, and faults (IO errors, torn writes, a dead peer) surface
// as named errors that leave the engine failed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "core/zero/lr_schedule.h"
#include "engine_test_model.h"
#include "nvme/bench/nvme_bench.h"

namespace strata::testing {
namespace {

std::string BaseConfig(const std::string& zero, const std::string& top = "",
                       const std::string& precision = "fp32") {
  return R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "bf16": {"enabled": )" +
         std::string(precision == "bf16" ? "true" : "false") + R"(},
  "fp16": {"enabled": )" +
         std::string(precision == "fp16" ? "true" : "false") + R"(, "initial_scale_power": 8},
  )" + top +
         R"(
  "zero_optimization": {)" +
         std::string(zero.find("sub_group_size") == std::string::npos ? R"("sub_group_size": 256, )"
                                                                      : "") +
         std::string(zero.find("persistence_threshold") == std::string::npos
                         ? R"("stage3_param_persistence_threshold": 64, )"
                         : "") +
         zero + "}}";
}

// ------------------------------------------------------------------------------------------------
// The ledger: bytes per rank per step (gas 1) for a trainer that gathers each group once in
// forward and once in backward: stages 0-2 move one all-reduce of the gradients, stage 3 1.5x.
// ------------------------------------------------------------------------------------------------

struct LedgerRun {
  Status status;
  uint64_t sent = 0;      // rank 0's ring bytes sent in collectives during one step
  uint64_t exchange = 0;  // of which the norm exchange (16 bytes per rank, all-gathered)
  uint64_t padded_params = 0;
};

// A backward pass (fp32) in which every gradient is 0.01.
Status BackwardOfConstantGrads(Engine& engine, const ModelSpec& model) {
  for (size_t g = model.groups.size(); g-- > 0;) {
    STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, engine.Gather(g));
    STRATA_ASSIGN_OR_RETURN(void* buf, engine.GradBuffer(g));
    float* f = static_cast<float*>(buf);
    for (size_t i = 0; i < model.groups[g].numel(); ++i) f[i] = 0.01f;
    engine.Release(std::move(gg));
    STRATA_RETURN_IF_ERROR(engine.ReduceGradients(g));
  }
  return Status::OK();
}

LedgerRun MeasureStep(int stage, int world) {
  LedgerRun out;
  ModelSpec model;
  model.groups = {
      {"a", {{"w", {1000}}}}, {"b", {{"w", {3000}}, {"bias", {7}}}}, {"c", {{"w", {515}}}}};
  auto parsed = ParseDeepSpeedConfig(
      BaseConfig(R"("stage": )" + std::to_string(stage) +
                 R"(, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0)"));
  if (!parsed.ok()) {
    out.status = parsed.status();
    return out;
  }
  const std::string dir = UniqueTestDir("engine_ledger");
  const std::vector<Status> st = OnHostRanks(
      world, dir, parsed->config, [&](int r, EngineOptions eo) -> Status {
        Communicator* comm = eo.comm;
        STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, std::move(eo)));
        STRATA_RETURN_IF_ERROR(
            engine->InitParameters([](size_t, size_t, size_t b, size_t e, float* o) {
              for (size_t i = b; i < e; ++i) o[i - b] = 0.001f * static_cast<float>(i % 13);
            }));
        comm->ResetStats();
        const size_t n = model.groups.size();
        for (size_t g = 0; g < n; ++g) {
          STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, engine->Gather(g));
          engine->Release(std::move(gg));
        }
        STRATA_RETURN_IF_ERROR(BackwardOfConstantGrads(*engine, model));
        STRATA_ASSIGN_OR_RETURN(StepReport rep, engine->Step());
        (void)rep;
        if (r == 0) {
          out.sent = comm->stats().total_sent_bytes();
          out.exchange = RingBytes(CommOp::kAllGather, static_cast<uint64_t>(world) * 16, world);
          // Padded elements: each group padded to world x 128.
          for (const GroupSpec& gs : model.groups) {
            const uint64_t unit = static_cast<uint64_t>(world) * 128;
            out.padded_params += (gs.numel() + unit - 1) / unit * unit;
          }
        }
        return Status::OK();
      });
  for (int r = 0; r < world; ++r) {
    if (!st[r].ok()) out.status = st[r];
  }
  return out;
}

// With overlap_comm a trainer may take gradient buffers before reducing the ones it holds (one
// held back, as the torch adapter does on a GPU, or every one first): the engine then keeps
// fewer reductions in flight, never waits on an empty queue, and the step gives the same bits
// as taking and reducing one group at a time. Stage 3 on 1 and 2 ranks.
TEST(EngineGrad, GradientBuffersTakenAheadOfTheirReductionsGiveTheSameBits) {
  ModelSpec model;
  model.groups = {{"a", {{"w", {1000}}}},
                  {"b", {{"w", {3000}}, {"bias", {7}}}},
                  {"c", {{"w", {515}}}},
                  {"d", {{"w", {700}}}}};
  auto parsed = ParseDeepSpeedConfig(BaseConfig(R"("stage": 3, "overlap_comm": true)"));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const size_t n = model.groups.size();
  // held: buffers taken ahead of the oldest reduction (0: one at a time; n: all first).
  auto run = [&](int world, size_t held, std::vector<std::vector<float>>* master) {
    const std::string dir = UniqueTestDir("engine_grad_ahead");
    const std::vector<Status> st =
        OnHostRanks(world, dir, parsed->config, [&](int r, EngineOptions eo) -> Status {
          STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, std::move(eo)));
          STRATA_RETURN_IF_ERROR(
              engine->InitParameters([](size_t, size_t, size_t b, size_t e, float* o) {
                for (size_t i = b; i < e; ++i) o[i - b] = 0.001f * static_cast<float>(i % 13);
              }));
          for (int step = 0; step < 2; ++step) {
            std::vector<size_t> taken;
            for (size_t g = n; g-- > 0;) {
              STRATA_ASSIGN_OR_RETURN(void* buf, engine->GradBuffer(g));
              float* f = static_cast<float*>(buf);
              for (size_t i = 0; i < model.groups[g].numel(); ++i) {
                f[i] = 0.01f * static_cast<float>((g + 1) * (r + 1) + (i % 5));
              }
              taken.push_back(g);
              while (taken.size() > held) {
                STRATA_RETURN_IF_ERROR(engine->ReduceGradients(taken.front()));
                taken.erase(taken.begin());
              }
            }
            for (size_t g : taken) STRATA_RETURN_IF_ERROR(engine->ReduceGradients(g));
            STRATA_RETURN_IF_ERROR(engine->Step().status());
          }
          std::vector<std::vector<float>> mine(n);  // ReadMaster is collective: every rank
          for (size_t g = 0; g < n; ++g) {
            mine[g].resize(model.groups[g].numel());
            STRATA_RETURN_IF_ERROR(engine->ReadMaster(g, mine[g]));
          }
          if (r == 0) *master = std::move(mine);
          return Status::OK();
        });
    for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
  };
  for (int world : {1, 2}) {
    std::vector<std::vector<float>> base, ahead;
    run(world, 0, &base);
    for (size_t held : {size_t{1}, n}) {
      SCOPED_TRACE("world " + std::to_string(world) + ", held " + std::to_string(held));
      run(world, held, &ahead);
      ASSERT_EQ(ahead.size(), base.size());
      for (size_t g = 0; g < n; ++g) {
        EXPECT_EQ(0, std::memcmp(ahead[g].data(), base[g].data(), base[g].size() * 4)) << g;
      }
    }
  }
}

// One rank at stage 3 (no qwZ / hpZ, a host-addressable device): the shard is the whole group,
// so Gather hands out the store's device copy itself. The device's used bytes grow by that copy
// only (no gathered buffer: 2x before), the handle points at the same memory on a second
// Gather, gradients and a Step work, and Step still refuses while a group is held.
// (Prefetch, reuse and persistence off: each Gather fetches the copy and Release evicts it.)
TEST(EngineGather, WorldOneGatherAliasesTheShardWithoutABuffer) {
  ModelSpec model;
  model.groups = {{"a", {{"w", {10000}}}}, {"b", {{"w", {20000}}}}};
  auto parsed = ParseDeepSpeedConfig(BaseConfig(
      R"("stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0,
         "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
         "offload_param": {"device": "cpu"})"));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const std::string dir = UniqueTestDir("engine_alias");
  const std::vector<Status> st =
      OnHostRanks(1, dir, parsed->config, [&](int, EngineOptions eo) -> Status {
        Device* dev = eo.device;
        STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, std::move(eo)));
        STRATA_RETURN_IF_ERROR(
            engine->InitParameters([](size_t, size_t, size_t b, size_t e, float* o) {
              for (size_t i = b; i < e; ++i) o[i - b] = 0.001f * static_cast<float>(i % 13);
            }));
        for (size_t g = 0; g < 2; ++g) {
          const uint64_t bytes = model.groups[g].numel() * 4;
          const uint64_t before = dev->stats().used_bytes;
          STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, engine->Gather(g));
          // The peak since Create grew by the store's device copy only (4 KiB units); a
          // gathered buffer as well would double it.
          const uint64_t grew = dev->stats().peak_used_bytes - before;
          EXPECT_LE(grew, (bytes + 4095) / 4096 * 4096 + 4096) << g;
          const float* w = static_cast<const float*>(gg.data());
          EXPECT_EQ(w[14], 0.001f);
          if (engine->Step().ok()) return Status::Internal("Step ran while a group was held");
          engine->Release(std::move(gg));
        }
        STRATA_RETURN_IF_ERROR(BackwardOfConstantGrads(*engine, model));
        STRATA_ASSIGN_OR_RETURN(StepReport rep, engine->Step());
        EXPECT_FALSE(rep.skipped);
        STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, engine->Gather(0));
        EXPECT_NE(static_cast<const float*>(gg.data())[14], 0.001f);  // the update is seen
        engine->Release(std::move(gg));
        return Status::OK();
      });
  ASSERT_TRUE(st[0].ok()) << st[0].ToString();
}

TEST(EngineLedger, CommunicationEqualsTheLedger) {
  for (int world : {2, 4}) {
    std::vector<uint64_t> per_stage;
    for (int stage = 0; stage <= 3; ++stage) {
      LedgerRun run = MeasureStep(stage, world);
      ASSERT_TRUE(run.status.ok()) << run.status.ToString();
      const uint64_t all_reduce = RingBytes(CommOp::kAllReduce, run.padded_params * 4, world);
      const uint64_t moved = run.sent - run.exchange;
      if (stage < 3) {
        EXPECT_EQ(moved, all_reduce) << "stage " << stage << " world " << world;
      } else {
        EXPECT_EQ(moved, all_reduce * 3 / 2) << "stage 3 world " << world;
      }
      per_stage.push_back(moved);
    }
    EXPECT_GT(per_stage[3], per_stage[2]);
  }
}

// ------------------------------------------------------------------------------------------------
// Budgets
// ------------------------------------------------------------------------------------------------

TEST(EngineBudget, RefusesAtCreateNamingTheTier) {
  RunSpec spec;
  spec.config_json = BaseConfig(R"("stage": 0)");
  spec.device_budget = 64 << 10;  // far below 16 bytes x 4.7k params + buffers
  RunResult r = RunEngine(spec);
  ASSERT_EQ(r.status.code(), Status::Code::kResourceExhausted) << r.status.ToString();
  EXPECT_NE(r.status.message().find("hbm tier"), std::string::npos) << r.status.ToString();

  spec.config_json = BaseConfig(R"("stage": 3, "offload_optimizer": {"device": "cpu"})");
  spec.device_budget = 64ull << 20;
  spec.budgets[Tier::kHost] = 20000;
  r = RunEngine(spec);
  ASSERT_EQ(r.status.code(), Status::Code::kResourceExhausted) << r.status.ToString();
  EXPECT_NE(r.status.message().find("host tier"), std::string::npos) << r.status.ToString();
}

// One rank that cannot fit makes every rank refuse at Create (nobody waits for it).
TEST(EngineBudget, OneRankThatDoesNotFitFailsEveryRank) {
  RunSpec spec;
  spec.config_json = BaseConfig(R"("stage": 3, "offload_optimizer": {"device": "cpu"})");
  spec.world = 2;
  spec.timeout = std::chrono::milliseconds(30000);
  spec.tweak = [](int rank, EngineOptions& eo) {
    if (rank == 1) eo.budget_bytes[Tier::kHost] = 20000;
  };
  const auto t0 = std::chrono::steady_clock::now();
  RunResult r = RunEngine(spec);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  EXPECT_EQ(r.rank_status[1].code(), Status::Code::kResourceExhausted)
      << r.rank_status[1].ToString();
  EXPECT_EQ(r.rank_status[0].code(), Status::Code::kAborted) << r.rank_status[0].ToString();
  EXPECT_NE(r.rank_status[0].message().find("rank 1"), std::string::npos)
      << r.rank_status[0].ToString();
}

// Create's verdict holds for the whole run: a device budget either is refused there, naming the
// tier, or trains. The store's param shard copies take whole 4 KiB units; a plan that counted
// their exact bytes accepted 26 KiB here and then failed the first gather of 'mid'.
TEST(EngineBudget, EveryDeviceBudgetIsRefusedAtCreateOrTrains) {
  int refused = 0, trained = 0;
  for (uint64_t kib = 16; kib <= 48; ++kib) {
    RunSpec spec;
    spec.config_json = BaseConfig(
        R"("stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0,
           "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
           "offload_param": {"device": "nvme", "nvme_path": "/tmp"})");
    spec.steps = 2;
    spec.device_budget = kib << 10;
    RunResult r = RunEngine(spec);
    if (r.status.ok()) {
      ++trained;
      EXPECT_LE(r.stats[0].peak_bytes[Tier::kDevice], spec.device_budget) << kib << " KiB";
      continue;
    }
    ++refused;
    EXPECT_EQ(r.status.code(), Status::Code::kResourceExhausted) << kib << " KiB";
    EXPECT_NE(r.status.message().find("does not fit the hbm tier"), std::string::npos)
        << kib << " KiB: " << r.status.ToString();
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(trained, 0);
}

TEST(EngineBudget, PeaksStayWithinBudgetsAndNearTheLayout) {
  for (
      const char* zero :
      {R"("stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"})",
       R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_param": {"device": "nvme", "nvme_path": "/tmp"})",
       R"("stage": 2, "offload_optimizer": {"device": "cpu"})"}) {
    RunSpec spec;
    spec.config_json = BaseConfig(zero, "", "bf16");
    spec.world = 2;
    spec.steps = 2;
    RunResult r = RunEngine(spec);
    ASSERT_TRUE(r.status.ok()) << zero << ": " << r.status.ToString();
    for (int rank = 0; rank < 2; ++rank) {
      const EngineLayout& L = r.layouts[rank];
      const EngineStats& s = r.stats[rank];
      for (Tier t : kAllTiers) {
        EXPECT_LE(s.peak_bytes[t], L.budget_bytes[t]) << TierName(t) << " " << zero;
        EXPECT_LE(s.store.peak_bytes[t], s.store.budget_bytes[t]) << TierName(t);
      }
      // Host-homed states are all resident on the host: the peak is at least the layout's states
      // and, without NVMe (whose pages the store may keep cached up to the budget), at most
      // states + working set.
      EXPECT_GE(s.peak_bytes[Tier::kHost], L.state_bytes[Tier::kHost]) << zero;
      if (L.state_bytes[Tier::kNvme] == 0) {
        EXPECT_LE(s.peak_bytes[Tier::kHost],
                  L.state_bytes[Tier::kHost] + L.working_bytes[Tier::kHost])
            << zero;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// fp16 overflow, clipping, LR schedule
// ------------------------------------------------------------------------------------------------

// Also on one rank with the optimizer offloaded, where the gradient is kept in fp16
// (sched::GradStateDType): the overflow is seen in the 16-bit values.
TEST(EngineSemantics, Fp16OverflowOnOneRankSkipsTheStepOnAll) {
  struct Case {
    int stage;
    const char* offload;
    int world;
  };
  for (const Case c : {Case{0, "", 2}, Case{3, "", 2},
                       Case{3, R"(, "offload_optimizer": {"device": "cpu"})", 1}}) {
    const std::string zero = R"("stage": )" + std::to_string(c.stage) + c.offload;
    SCOPED_TRACE(zero);
    const int stage = c.stage;
    RunSpec spec;
    spec.config_json = BaseConfig(zero, "", "fp16");
    spec.world = c.world;
    spec.steps = 2;
    spec.tamper = [last = c.world - 1](int rank, int step, int, Grads* g) {
      if (rank == last && step == 1) g->W1[5] = std::numeric_limits<float>::infinity();
    };
    RunResult skipped = RunEngine(spec);
    ASSERT_TRUE(skipped.status.ok()) << skipped.status.ToString();
    ASSERT_EQ(skipped.reports.size(), 2u);
    EXPECT_FALSE(skipped.reports[0].skipped);
    EXPECT_TRUE(skipped.reports[1].skipped);
    EXPECT_TRUE(std::isinf(skipped.reports[1].grad_norm));
    EXPECT_EQ(skipped.reports[1].global_step, 2);
    // Hysteresis 2: the first overflow keeps the scale (2^8).
    EXPECT_EQ(skipped.reports[1].loss_scale, 256.0);
    EXPECT_EQ(skipped.stats[0].skipped_steps, 1);
    // Nothing applied: the weights equal those after the first step alone.
    RunSpec one = spec;
    one.steps = 1;
    one.tamper = nullptr;
    RunResult first = RunEngine(one);
    ASSERT_TRUE(first.status.ok());
    EXPECT_TRUE(BitEqual(skipped.master, first.master)) << "stage " << stage;
  }
}

// Two same-sized groups reduced in opposite orders on the two ranks: each reduction pairs one
// group's gradient with the other's, silently. Step compares the ranks' collective sequences and
// fails on every rank, naming the cause, before anything is applied; the same order steps.
// AgreeReductionOrder gives every rank rank 0's order, so a trainer can reduce in one order.
TEST(EngineSemantics, RanksReducingGroupsInDifferentOrdersFailTheStep) {
  ModelSpec model;
  model.groups = {{"a", {{"w", {96}}}}, {"b", {{"w", {96}}}}, {"frozen", {{"w", {8}}}, 0, false}};
  for (int stage : {0, 2, 3}) {
    for (bool apart : {false, true}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + (apart ? ", orders apart" : ""));
      auto parsed = ParseDeepSpeedConfig(BaseConfig(R"("stage": )" + std::to_string(stage)));
      ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
      std::vector<std::vector<uint32_t>> agreed(2);
      const std::vector<Status> st = OnHostRanks(
          2, UniqueTestDir("engine_order"), parsed->config, [&](int r, EngineOptions eo) -> Status {
            STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, std::move(eo)));
            STRATA_RETURN_IF_ERROR(
                engine->InitParameters([](size_t, size_t, size_t b, size_t e, float* o) {
                  for (size_t i = b; i < e; ++i) o[i - b] = 0.01f;
                }));
            const std::vector<uint32_t> mine =
                r == 0 ? std::vector<uint32_t>{1, 0} : std::vector<uint32_t>{0, 1};
            STRATA_ASSIGN_OR_RETURN(agreed[r], engine->AgreeReductionOrder(mine));
            for (uint32_t g : (apart ? mine : agreed[r])) {
              STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, engine->Gather(g));
              engine->Release(std::move(gg));
              STRATA_ASSIGN_OR_RETURN(void* buf, engine->GradBuffer(g));
              std::fill_n(static_cast<float*>(buf), 96, g == 0 ? 0.5f : -0.5f);
              STRATA_RETURN_IF_ERROR(engine->ReduceGradients(g));
            }
            return engine->Step().status();
          });
      for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(agreed[r], (std::vector<uint32_t>{1, 0}));
        if (!apart) {
          EXPECT_TRUE(st[r].ok()) << st[r].ToString();
          continue;
        }
        EXPECT_EQ(st[r].code(), Status::Code::kFailedPrecondition) << st[r].ToString();
        EXPECT_NE(st[r].ToString().find("gathered or reduced different groups"), std::string::npos)
            << st[r].ToString();
      }
    }
  }
}

TEST(EngineSemantics, AgreeReductionOrderRefusesAListThatIsNotEveryTrainableGroupOnce) {
  ModelSpec model;
  model.groups = {{"a", {{"w", {8}}}}, {"b", {{"w", {8}}}}, {"frozen", {{"w", {8}}}, 0, false}};
  auto parsed = ParseDeepSpeedConfig(BaseConfig(R"("stage": 1)"));
  ASSERT_TRUE(parsed.ok());
  const std::vector<Status> st = OnHostRanks(
      1, UniqueTestDir("engine_order1"), parsed->config, [&](int, EngineOptions eo) -> Status {
        STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, std::move(eo)));
        const std::vector<std::pair<std::vector<uint32_t>, std::string>> bad = {
            {{0}, "1 groups listed, the model has 2"},
            {{0, 0}, "group 0 listed twice"},
            {{0, 2}, "group 2 is frozen"},
            {{0, 7}, "group 7 out of range"}};
        for (const auto& [order, why] : bad) {
          auto r = engine->AgreeReductionOrder(order);
          if (r.ok() || r.status().code() != Status::Code::kInvalidArgument ||
              r.status().ToString().find(why) == std::string::npos) {
            return Status::Internal("expected '" + why + "', got " + r.status().ToString());
          }
        }
        STRATA_ASSIGN_OR_RETURN(auto same,
                                engine->AgreeReductionOrder(std::vector<uint32_t>{1, 0}));
        return same == std::vector<uint32_t>{1, 0} ? Status::OK() : Status::Internal("changed");
      });
  EXPECT_TRUE(st[0].ok()) << st[0].ToString();
}

// A backward that raised part way (one group reduced, another's buffer still out), after a
// complete micro-step of the same window: DiscardGradients drops the window, and the next one
// (two micro-steps: more reductions than the window had room for, were the dropped ones still
// counted) steps to the bits of a run that never saw the dropped gradients. Save (the
// window closed by the discard) is taken right after it. Stages 0/2/3 on 1 and 2 ranks,
// gradient_accumulation_steps 2. With the optimizer offloaded and speculative_step, b's Adam ran
// ahead at its dropped second reduction: rolled back, and the next window speculates again.
TEST(EngineSemantics, DiscardGradientsDropsTheWindowAsIfNeverTaken) {
  ModelSpec model;
  model.groups = {{"a", {{"w", {96}}}}, {"b", {{"w", {200}}, {"bias", {5}}}}};
  const std::vector<size_t> sizes = {96, 205};
  const std::string speculate =
      R"(, "offload_optimizer": {"device": "cpu", "speculative_step": true,
      "speculation_buffer_size": 1000000000})";
  for (int stage : {0, 2, 3, -3}) {
    for (int world : {1, 2}) {
      const bool spec = stage < 0;
      SCOPED_TRACE("stage " + std::to_string(stage) + " on " + std::to_string(world));
      std::string config = BaseConfig(
          R"("stage": )" + std::to_string(spec ? -stage : stage) + (spec ? speculate : ""),
          R"("gradient_clipping": 0.0,)");  // unclipped: a speculation is kept
      config.replace(config.find(R"("gradient_accumulation_steps": 1)"), 32,
                     R"("gradient_accumulation_steps": 2)");
      auto parsed = ParseDeepSpeedConfig(config);
      ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
      // One micro-step whose gradients are `value` (scaled by the rank), every group reduced.
      auto micro_step = [&](Engine& e, int r, float value) -> Status {
        for (size_t g = 2; g-- > 0;) {
          STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, e.Gather(g));
          e.Release(std::move(gg));
          STRATA_ASSIGN_OR_RETURN(void* buf, e.GradBuffer(g));
          std::fill_n(static_cast<float*>(buf), sizes[g], value * static_cast<float>(r + 1));
          STRATA_RETURN_IF_ERROR(e.ReduceGradients(g));
        }
        return Status::OK();
      };
      std::vector<std::vector<std::vector<float>>> masters(2, {{}, {}});
      for (bool discarded : {false, true}) {
        const std::string dir = UniqueTestDir("engine_discard");
        const std::vector<Status> st =
            OnHostRanks(world, dir, parsed->config, [&](int r, EngineOptions eo) -> Status {
              STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, std::move(eo)));
              STRATA_RETURN_IF_ERROR(
                  engine->InitParameters([](size_t, size_t, size_t b, size_t e, float* o) {
                    for (size_t i = b; i < e; ++i) o[i - b] = 0.01f * static_cast<float>(i % 7);
                  }));
              if (discarded) {
                STRATA_RETURN_IF_ERROR(micro_step(*engine, r, 3.0f));
                // The raising backward: b reduced, a's buffer filled but never reduced.
                STRATA_ASSIGN_OR_RETURN(void* b, engine->GradBuffer(1));
                std::fill_n(static_cast<float*>(b), sizes[1], 40.0f);
                STRATA_RETURN_IF_ERROR(engine->ReduceGradients(1));
                {  // a's params gathered for that backward, the handle dropped as it unwinds
                  STRATA_ASSIGN_OR_RETURN(GatheredGroup dropped, engine->Gather(0));
                  STRATA_ASSIGN_OR_RETURN(void* a, engine->GradBuffer(0));
                  std::fill_n(static_cast<float*>(a), sizes[0], -40.0f);
                }
                STRATA_RETURN_IF_ERROR(engine->DiscardGradients());
                STRATA_RETURN_IF_ERROR(engine->Save(dir + "/ckpt", "after_discard"));
              }
              STRATA_RETURN_IF_ERROR(micro_step(*engine, r, 0.5f));
              STRATA_RETURN_IF_ERROR(micro_step(*engine, r, -0.25f));
              STRATA_ASSIGN_OR_RETURN(StepReport rep, engine->Step());
              if (spec && rep.speculated_sub_groups == 0) {
                return Status::Internal(std::string(discarded ? "after the drop" : "without one") +
                                        ": the step kept no speculation");
              }
              for (size_t g = 0; g < 2; ++g) {
                std::vector<float> m(sizes[g]);
                STRATA_RETURN_IF_ERROR(engine->ReadMaster(g, m));
                if (r == 0) masters[discarded][g] = std::move(m);
              }
              return Status::OK();
            });
        for (int r = 0; r < world; ++r) ASSERT_TRUE(st[r].ok()) << r << ": " << st[r].ToString();
      }
      EXPECT_TRUE(BitEqual(masters[0], masters[1]));
      EXPECT_NE(masters[0][0][0], 0.0f);  // it stepped
    }
  }
}

// Ranks started with another model or config are refused at Create, every rank naming what
// differs, instead of hanging in unmatched collectives or stepping with their own lr. A rank's
// own offload placement is allowed.
TEST(EngineSemantics, RanksWithAnotherModelOrConfigAreRefusedNamingWhat) {
  ModelSpec model;
  model.groups = {{"a", {{"w", {96}}}}, {"b", {{"w", {40}}}}};
  ModelSpec wider = model;
  wider.groups[1].params[0].shape = {48};
  struct Case {
    const char* what;
    std::string rank1_zero, rank1_top;
    const ModelSpec* rank1_model;
    const char* names;  // "" : accepted
  } cases[] = {
      {"same", R"("stage": 2)", "", &model, ""},
      {"own offload", R"("stage": 2, "offload_optimizer": {"device": "cpu"})", "", &model, ""},
      {"stage", R"("stage": 3)", "", &model, "precision, zero_optimization settings"},
      {"shape", R"("stage": 2)", "", &wider, "model"},
      {"lr", R"("stage": 2)", "lr1e-3", &model, "optimizer or LR schedule"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto base = ParseDeepSpeedConfig(BaseConfig(R"("stage": 2)"));
    std::string other_text = BaseConfig(c.rank1_zero);
    if (c.rank1_top == "lr1e-3") other_text.replace(other_text.find("0.01"), 4, "1e-3");
    auto other = ParseDeepSpeedConfig(other_text);
    ASSERT_TRUE(base.ok() && other.ok());
    const std::vector<Status> st = OnHostRanks(
        2, UniqueTestDir("engine_agree"), base->config, [&](int r, EngineOptions eo) -> Status {
          if (r == 1) eo.config = other->config;
          return Engine::Create(r == 1 ? *c.rank1_model : model, std::move(eo)).status();
        });
    for (int r = 0; r < 2; ++r) {
      if (std::string(c.names).empty()) {
        EXPECT_TRUE(st[r].ok()) << r << ": " << st[r].ToString();
      } else {
        EXPECT_EQ(st[r].code(), Status::Code::kInvalidArgument) << r << ": " << st[r].ToString();
        EXPECT_NE(st[r].message().find(std::string("rank 1's ") + c.names), std::string::npos)
            << st[r].ToString();
      }
    }
  }
}

// A handle kept past its engine (a trainer's member declared before the engine's) is destroyed
// after it without touching the freed store.
TEST(EngineSemantics, AGatheredGroupMayOutliveItsEngine) {
  ModelSpec model;
  model.groups = {{"a", {{"w", {96}}}}, {"b", {{"w", {40}}}}};
  for (int stage : {0, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto parsed = ParseDeepSpeedConfig(BaseConfig(R"("stage": )" + std::to_string(stage)));
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    const std::vector<Status> st = OnHostRanks(
        1, UniqueTestDir("engine_outlive"), parsed->config, [&](int, EngineOptions eo) -> Status {
          GatheredGroup kept;
          {
            STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, std::move(eo)));
            STRATA_RETURN_IF_ERROR(
                engine->InitParameters([](size_t, size_t, size_t b, size_t e, float* o) {
                  std::fill(o, o + (e - b), 1.0f);
                }));
            Result<GatheredGroup> g = engine->Gather(0);
            if (!g.ok()) return g.status();
            kept = std::move(*g);
          }
          return kept ? Status::OK() : Status::Internal("the handle was emptied");
        });
    EXPECT_TRUE(st[0].ok()) << st[0].ToString();
  }
}

TEST(EngineSemantics, ClippingByTheGlobalNormIsPlacementIndependent) {
  std::vector<std::vector<float>> base;
  for (
      const char* zero :
      {R"("stage": 0)", R"("stage": 2, "offload_optimizer": {"device": "cpu"})",
       R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_param": {"device": "cpu"})"}) {
    RunSpec spec;
    spec.config_json = BaseConfig(zero, R"("gradient_clipping": 0.05,)");
    spec.world = 2;
    spec.steps = 2;
    RunResult r = RunEngine(spec);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    // The reported norm is the global one: compare with the gradients computed directly.
    Grads sum;
    const auto init = InitialWeights();
    Params p{init[kEmbed][0],   init[kEmbedBias][0], init[kMid][0],
             init[kMidBias][0], init[kTop][0],       init[kTop][1]};
    ZeroLike(p, &sum);
    for (int rank = 0; rank < 2; ++rank) ForwardBackward(p, 0, 0, rank, 1.0f, &sum);
    double sq = 0;
    for (size_t g = 0; g < kGroups; ++g) {
      for (auto* t : GroupTensors(sum, g)) {
        for (float v : *t) sq += (v / 2.0) * (v / 2.0);
      }
    }
    EXPECT_NEAR(r.reports[0].grad_norm, std::sqrt(sq), 1e-5 * std::sqrt(sq));
    EXPECT_GT(r.reports[0].clip_coefficient, 1.0);
    EXPECT_NEAR(r.reports[0].clip_coefficient, (r.reports[0].grad_norm + 1e-6) / 0.05,
                1e-9 * r.reports[0].clip_coefficient);
    if (base.empty()) {
      base = r.master;
    } else {
      EXPECT_TRUE(BitEqual(r.master, base)) << zero;
    }
  }
}

// One rank, one micro-step, the optimizer offloaded: the gradient shard is kept in the working
// 16-bit dtype (sched::GradStateDType), the Adam reading it as it was reduced. The step's bits,
// the clipped norm's included, are those of the fp32 gradient on the device (stage 0), on the
// host or NVMe, with the speculative step, and in fp16 with its loss scale; the layout keeps the
// 16-bit blocks where it offloads and fp32 on the device.
TEST(EngineSemantics, SixteenBitGradientHomeGivesTheFp32Bits) {
  for (const char* precision : {"bf16", "fp16"}) {
    SCOPED_TRACE(precision);
    std::vector<std::vector<float>> base;
    std::vector<double> norms;
    for (
        const char* zero :
        {R"("stage": 0)", R"("stage": 2, "offload_optimizer": {"device": "cpu"})",
         R"("stage": 3, "offload_optimizer": {"device": "cpu", "speculative_step": true})",
         R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_param": {"device": "cpu"})"}) {
      SCOPED_TRACE(zero);
      RunSpec spec;
      spec.config_json = BaseConfig(zero, R"("gradient_clipping": 0.05,)", precision);
      spec.steps = 3;
      RunResult r = RunEngine(spec);
      ASSERT_TRUE(r.status.ok()) << r.status.ToString();
      ASSERT_EQ(r.reports.size(), 3u);
      EXPECT_GT(r.reports[0].clip_coefficient, 1.0) << "the norm's bits must matter";
      const bool offloaded = std::string(zero).find("offload_optimizer") != std::string::npos;
      const EngineLayout& l = r.layouts[0];
      const DType working = std::string(precision) == "bf16" ? DType::kBF16 : DType::kF16;
      EXPECT_EQ(l.grad_dtype, offloaded ? working : DType::kF32) << l.ToString();
      if (base.empty()) {
        base = r.master;
        for (const StepReport& rep : r.reports) norms.push_back(rep.grad_norm);
        continue;
      }
      EXPECT_TRUE(BitEqual(r.master, base));
      for (size_t i = 0; i < norms.size(); ++i) {
        EXPECT_EQ(std::bit_cast<uint64_t>(r.reports[i].grad_norm),
                  std::bit_cast<uint64_t>(norms[i]))
            << "step " << i;
      }
    }
  }
}

// Stage 1 with the config's WarmupLR from 0 to 0.01 over `warmup` steps, linear, for `steps`.
RunSpec LinearWarmup(int warmup, int steps) {
  RunSpec spec;
  spec.config_json = BaseConfig(
      R"("stage": 1)",
      R"("scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": )" +
          std::to_string(warmup) + R"(, "warmup_type": "linear"}},)");
  spec.steps = steps;
  return spec;
}

TEST(EngineSemantics, LrScheduleAsDeepSpeed) {
  RunSpec spec = LinearWarmup(4, 4);
  RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  // DeepSpeed: the first applied step runs at t = -1 (the constructor's lr: warmup_min_lr), the
  // second at t = 0 (gamma 0), then linear.
  ASSERT_EQ(r.reports.size(), 4u);
  EXPECT_EQ(r.reports[0].lr, 0.0);
  EXPECT_EQ(r.reports[1].lr, 0.0);
  EXPECT_DOUBLE_EQ(r.reports[2].lr, 0.01 * 1 / 4);
  EXPECT_DOUBLE_EQ(r.reports[3].lr, 0.01 * 2 / 4);
  // lr 0 for two steps: AdamW with lr 0 leaves every weight exactly as initialized.
  RunSpec two = spec;
  two.steps = 2;
  RunResult r2 = RunEngine(two);
  ASSERT_TRUE(r2.status.ok());
  const auto init = InitialWeights();
  for (size_t g = 0; g < kGroups; ++g) {
    std::vector<float> flat;
    for (const auto& t : init[g]) flat.insert(flat.end(), t.begin(), t.end());
    EXPECT_EQ(r2.master[g], flat) << "group " << g;
  }
}

// A script moving the schedule as it moves DeepSpeed's scheduler object (its
// last_batch_iteration is the position minus one): the next step runs at the position set, and
// later steps count on from there.
TEST(EngineSemantics, SetSchedulePositionMovesTheConfigSchedule) {
  RunSpec spec = LinearWarmup(10, 3);
  spec.before_step = [](int, int step, Engine& e) {
    EXPECT_EQ(e.schedule_position(), step == 0 ? 0 : step == 1 ? 1 : 8);
    if (step == 0) {
      EXPECT_EQ(e.SetSchedulePosition(-1).code(), Status::Code::kInvalidArgument);
      EXPECT_EQ(e.schedule_position(), 0);
    }
    if (step == 1) {
      ASSERT_TRUE(e.SetSchedulePosition(7).ok());  // DeepSpeed's load_state_dict({lbi: 6})
      EXPECT_DOUBLE_EQ(e.lr(), 0.01 * 6 / 10);
    }
  };
  const RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.reports.size(), 3u);
  EXPECT_EQ(r.reports[0].lr, 0.0);  // t = -1
  EXPECT_DOUBLE_EQ(r.reports[1].lr, 0.01 * 6 / 10);
  EXPECT_DOUBLE_EQ(r.reports[2].lr, 0.01 * 7 / 10);
}

// The master weights of TestModel's groups, flat, as InitialWeights has them.
std::vector<float> InitialMaster(size_t g) {
  const auto init = InitialWeights();
  std::vector<float> flat;
  for (const auto& t : init[g]) flat.insert(flat.end(), t.begin(), t.end());
  return flat;
}

// TestModel with its bias groups in optimizer group 1.
ModelSpec BiasesInGroupOne() {
  ModelSpec m = TestModel();
  m.groups[kEmbedBias].optimizer_group = 1;
  m.groups[kMidBias].optimizer_group = 1;
  return m;
}

TEST(EngineSemantics, OptimizerGroupsCarryTheirOwnHyperparameters) {
  RunSpec base;
  base.config_json = BaseConfig(R"("stage": 2, "offload_optimizer": {"device": "cpu"})");
  base.world = 2;
  base.steps = 2;
  const RunResult plain = RunEngine(base);
  ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
  // Two groups with the config's hyperparameters: the same bits as one.
  RunSpec same = base;
  same.model = BiasesInGroupOne();
  same.tweak = [](int, EngineOptions& o) { o.optimizer_groups.resize(2); };
  const RunResult r_same = RunEngine(same);
  ASSERT_TRUE(r_same.status.ok()) << r_same.status.ToString();
  EXPECT_TRUE(BitEqual(r_same.master, plain.master));
  // Group 1 at lr 0 (decoupled decay is lr x weight_decay: none either) keeps its weights; group
  // 0 takes exactly the first step it takes with one group (later steps see other biases).
  base.steps = 1;
  const RunResult one = RunEngine(base);
  ASSERT_TRUE(one.status.ok()) << one.status.ToString();
  RunSpec frozen_lr = same;
  frozen_lr.steps = 1;
  frozen_lr.tweak = [](int, EngineOptions& o) {
    o.optimizer_groups.resize(2);
    o.optimizer_groups[1].lr = 0.0;
  };
  const RunResult r = RunEngine(frozen_lr);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  for (size_t g = 0; g < kGroups; ++g) {
    if (g == kEmbedBias || g == kMidBias) {
      EXPECT_EQ(r.master[g], InitialMaster(g)) << "group " << g;
    } else {
      EXPECT_EQ(r.master[g], one.master[g]) << "group " << g;
    }
  }
}

// Stage 1, TestModel with its biases in optimizer group 1 (both groups the config's values).
RunSpec TwoOptimizerGroups(int steps) {
  RunSpec spec;
  spec.config_json = BaseConfig(R"("stage": 1)");
  spec.model = BiasesInGroupOne();
  spec.steps = steps;
  spec.tweak = [](int, EngineOptions& o) { o.optimizer_groups.resize(2); };
  return spec;
}

TEST(EngineSemantics, SetLearningRatesDrivesEveryGroupFromTheNextStep) {
  RunSpec spec = TwoOptimizerGroups(2);
  spec.before_step = [](int, int step, Engine& e) {
    const double bad[] = {0.0};
    ASSERT_EQ(e.SetLearningRates(bad).code(), Status::Code::kInvalidArgument);
    const double negative[] = {0.0, -1.0};
    ASSERT_EQ(e.SetLearningRates(negative).code(), Status::Code::kInvalidArgument);
    if (step == 0) {  // an empty list hands the lrs back to the groups' own (no schedule here)
      const std::vector<double> own = e.lrs();
      const double other[] = {0.5, 0.5};
      ASSERT_TRUE(e.SetLearningRates(other).ok());
      ASSERT_NE(e.lrs(), own);
      ASSERT_TRUE(e.SetLearningRates({}).ok());
      EXPECT_EQ(e.lrs(), own);
    }
    const double lrs[] = {0.0, step == 0 ? 0.0 : 0.02};
    ASSERT_TRUE(e.SetLearningRates(lrs).ok());
    EXPECT_EQ(e.lrs(), std::vector<double>(std::begin(lrs), std::end(lrs)));
  };
  const RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.reports.size(), 2u);
  EXPECT_EQ(r.reports[0].lr, 0.0);  // group 0's
  for (size_t g = 0; g < kGroups; ++g) {
    const bool moved = g == kEmbedBias || g == kMidBias;  // only group 1, only in step 2
    EXPECT_EQ(r.master[g] != InitialMaster(g), moved) << "group " << g;
  }
}

// A frozen group keeps its initial weights bit for bit, stores no optimizer state and refuses a
// gradient while the other groups train; across stages, placements and 2 ranks.
TEST(EngineSemantics, FrozenGroupStoresParamsOnlyAndNeverChanges) {
  for (const char* zero : {R"("stage": 1)", R"("stage": 2, "offload_optimizer": {"device": "cpu"})",
                           R"("stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"})"}) {
    SCOPED_TRACE(zero);
    RunSpec base;
    base.config_json = BaseConfig(zero);
    base.world = 2;
    base.steps = 1;
    const RunResult plain = RunEngine(base);
    ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
    RunSpec spec = base;
    spec.model = TestModel();
    spec.model->groups[kMidBias].trainable = false;
    spec.steps = 2;
    spec.before_step = [](int, int, Engine& e) {
      EXPECT_EQ(e.GradBuffer(kMidBias).status().code(), Status::Code::kFailedPrecondition);
      EXPECT_EQ(e.ReduceGradients(kMidBias).code(), Status::Code::kFailedPrecondition);
    };
    const RunResult r = RunEngine(spec);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.master[kMidBias], InitialMaster(kMidBias));
    EXPECT_NE(r.master[kMid], InitialMaster(kMid));
    // The layout: the frozen group's optimizer state and gradient are not there.
    ASSERT_FALSE(r.layouts.empty());
    EXPECT_LT(r.layouts[0].sub_groups, plain.layouts[0].sub_groups);
    uint64_t frozen_total = 0, plain_total = 0;
    for (Tier t : kAllTiers) {
      frozen_total += r.layouts[0].state_bytes[t];
      plain_total += plain.layouts[0].state_bytes[t];
    }
    EXPECT_LT(frozen_total, plain_total);
  }
  // The largest group frozen: the gradient buffers are the largest trainable group's, so the
  // device working set shrinks (the rule `offloadctl plan --trainable` uses too).
  RunSpec plain;
  plain.config_json = BaseConfig(R"("stage": 3, "offload_optimizer": {"device": "cpu"})");
  plain.world = 2;
  plain.steps = 1;
  RunSpec top_frozen = plain;
  top_frozen.model = TestModel();
  top_frozen.model->groups[kTop].trainable = false;
  const RunResult a = RunEngine(plain), b = RunEngine(top_frozen);
  ASSERT_TRUE(a.status.ok() && b.status.ok()) << a.status.ToString() << b.status.ToString();
  EXPECT_LT(b.layouts[0].working_bytes[Tier::kDevice], a.layouts[0].working_bytes[Tier::kDevice]);
}

TEST(EngineSemantics, OptimizerGroupOutOfRangeOrBadIsRefusedNamingIt) {
  RunSpec spec;
  spec.config_json = BaseConfig(R"("stage": 1)");
  spec.model = BiasesInGroupOne();
  RunResult r = RunEngine(spec);  // group 1 named, no optimizer_groups given
  EXPECT_EQ(r.status.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(r.status.message().find("model.groups[1] ('embed.bias'): optimizer_group 1"),
            std::string::npos)
      << r.status.ToString();
  spec.tweak = [](int, EngineOptions& o) {
    o.optimizer_groups.resize(2);
    o.optimizer_groups[1].eps = -1.0;
  };
  r = RunEngine(spec);
  EXPECT_EQ(r.status.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(r.status.message().find("optimizer_groups[1]"), std::string::npos)
      << r.status.ToString();
}

// A model whose every group is frozen (one that only runs forward: a reference model) needs no
// "optimizer" section: partitioned at stage 3 on 2 ranks, its groups gather to their initial
// values. One trainable group and the missing optimizer is refused, naming optimizer.type.
TEST(EngineSemantics, AFrozenModelNeedsNoOptimizer) {
  ModelSpec model;
  model.groups = {{"a", {{"w", {1000}}}}, {"b", {{"w", {300}}, {"bias", {7}}}}};
  for (GroupSpec& g : model.groups) g.trainable = false;
  auto parsed = ParseDeepSpeedConfig(R"({"train_micro_batch_size_per_gpu": 2,
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                            "offload_param": {"device": "cpu"}}})");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  // Tensor t's element i of group g (InitParameters' fill is per tensor, ReadMaster's per group).
  auto value = [](size_t g, size_t t, size_t i) {
    return 0.001f * static_cast<float>((g * 31 + t * 7 + i) % 17);
  };
  const std::vector<Status> st = OnHostRanks(
      2, UniqueTestDir("engine_frozen_no_optimizer"), parsed->config,
      [&](int, EngineOptions eo) -> Status {
        STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, std::move(eo)));
        STRATA_RETURN_IF_ERROR(
            engine->InitParameters([&](size_t g, size_t t, size_t b, size_t e, float* o) {
              for (size_t i = b; i < e; ++i) o[i - b] = value(g, t, i);
            }));
        for (size_t g = 0; g < model.groups.size(); ++g) {
          std::vector<float> full(model.groups[g].numel());
          STRATA_RETURN_IF_ERROR(engine->ReadMaster(g, full));
          size_t at = 0;
          for (size_t t = 0; t < model.groups[g].params.size(); ++t) {
            for (size_t i = 0; i < model.groups[g].params[t].numel(); ++i, ++at) {
              if (full[at] != value(g, t, i)) {
                return Status::Internal("group " + std::to_string(g) + " tensor " +
                                        std::to_string(t) + " element " + std::to_string(i) +
                                        " changed");
              }
            }
          }
          STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, engine->Gather(g));
          engine->Release(std::move(gg));
        }
        return Status::OK();
      });
  for (const Status& s : st) EXPECT_TRUE(s.ok()) << s.ToString();
  model.groups[1].trainable = true;
  const std::vector<Status> refused =
      OnHostRanks(1, UniqueTestDir("engine_frozen_no_optimizer"), parsed->config,
                  [&](int, EngineOptions eo) -> Status {
                    return Engine::Create(model, std::move(eo)).status();
                  });
  EXPECT_EQ(refused[0].code(), Status::Code::kInvalidArgument);
  EXPECT_NE(refused[0].message().find("optimizer.type"), std::string::npos)
      << refused[0].ToString();
}

// ReadOptimizerState(kGrad) between the reductions and Step is the gradient the step uses (no
// clipping configured): Adam's first moment after the first step (from zeros) is (1 - beta1)
// times it, divided by the loss scale with fp16 (the gradient read is still scaled, as DeepSpeed's
// safe_get_full_grad); across stages, offloads, precisions and 2 ranks (the read is whole on every
// rank). After Step no gradient is there to read; a frozen group has none.
TEST(EngineSemantics, GradientReadBeforeStepIsTheOneAdamUses) {
  for (const char* precision : {"fp32", "bf16", "fp16"}) {
    for (
        const char* zero :
        {R"("stage": 1)", R"("stage": 2, "offload_optimizer": {"device": "cpu"})",
         R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_param": {"device": "cpu"})"}) {
      SCOPED_TRACE(std::string(precision) + " " + zero);
      const float scale =
          std::string(precision) == "fp16" ? 256.0f : 1.0f;  // 2^initial_scale_power
      RunSpec spec;
      spec.config_json = BaseConfig(zero, R"("gradient_clipping": 0.0,)", precision);
      spec.world = 2;
      spec.steps = 1;
      std::vector<std::vector<std::vector<float>>> grads(2,
                                                         std::vector<std::vector<float>>(kGroups));
      spec.before_engine_step = [&](int r, int, Engine& e, nvme::SimBackend*) {
        for (size_t g = 0; g < kGroups; ++g) {
          grads[r][g].resize(e.model().groups[g].numel());
          ASSERT_TRUE(e.ReadOptimizerState(g, StateKind::kGrad, grads[r][g]).ok());
        }
      };
      spec.after_step = [&](int r, int, Engine& e) -> Status {
        for (size_t g = 0; g < kGroups; ++g) {
          std::vector<float> m(e.model().groups[g].numel());
          STRATA_RETURN_IF_ERROR(e.ReadOptimizerState(g, StateKind::kExpAvg, m));
          for (size_t i = 0; i < m.size(); ++i) {
            const float want = 0.1f * grads[r][g][i] / scale;
            if (std::fabs(m[i] - want) > 1e-6f * std::fabs(want) + 1e-12f) {
              return Status::Internal("group " + std::to_string(g) + " element " +
                                      std::to_string(i) + ": exp_avg " + std::to_string(m[i]) +
                                      ", 0.1 x gradient read " + std::to_string(want));
            }
          }
        }
        std::vector<float> again(e.model().groups[kTop].numel());
        const Status st = e.ReadOptimizerState(kTop, StateKind::kGrad, again);
        if (st.code() != Status::Code::kFailedPrecondition) {
          return Status::Internal("a gradient read after Step: " + st.ToString());
        }
        return Status::OK();
      };
      const RunResult res = RunEngine(spec);
      ASSERT_TRUE(res.status.ok()) << res.status.ToString();
      EXPECT_EQ(grads[0], grads[1]);  // whole on both ranks
      bool nonzero = false;
      for (float v : grads[0][kTop]) nonzero = nonzero || v != 0.0f;
      EXPECT_TRUE(nonzero);
    }
  }
  RunSpec frozen;
  frozen.config_json = BaseConfig(R"("stage": 2)");
  frozen.model = TestModel();
  frozen.model->groups[kMidBias].trainable = false;
  frozen.steps = 1;
  frozen.before_engine_step = [](int, int, Engine& e, nvme::SimBackend*) {
    std::vector<float> out(e.model().groups[kMidBias].numel());
    EXPECT_EQ(e.ReadOptimizerState(kMidBias, StateKind::kGrad, out).code(),
              Status::Code::kInvalidArgument);
  };
  const RunResult r = RunEngine(frozen);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
}

// OneCycle's cycled momentum reaches the Adam of every placement as the same betas handed over
// by SetHyperparameters (a client scheduler's), and changes the result.
TEST(EngineSemantics, OneCycleMomentumIsTheStepsBetas) {
  const std::string one_cycle =
      R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 2, "cycle_min_mom": 0.8, "cycle_max_mom": 0.95}},)";
  // t = -1, 0, 1, 2 (DeepSpeed's last_batch_iteration of applied steps 1..4); scale 0, .5, 1, .5.
  const double lrs[] = {0.001, 0.0055, 0.01, 0.0055};
  const double beta1s[] = {0.8, 0.875, 0.8, 0.875};
  for (const char* zero :
       {R"("stage": 1)", R"("stage": 3, "offload_optimizer": {"device": "cpu"})"}) {
    SCOPED_TRACE(zero);
    RunSpec spec;
    spec.config_json = BaseConfig(zero, one_cycle);
    spec.steps = 4;
    spec.before_step = [&](int, int step, Engine& e) {
      ASSERT_EQ(e.betas().size(), 1u);
      EXPECT_DOUBLE_EQ(e.betas()[0].first, beta1s[step]);
      EXPECT_EQ(e.betas()[0].second, 0.99);  // DeepSpeed's OneCycle writes (momentum, 0.99)
      EXPECT_DOUBLE_EQ(e.lr(), lrs[step]);
    };
    const RunResult r = RunEngine(spec);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(r.reports[i].lr, lrs[i]) << i;

    RunSpec client;
    client.config_json = BaseConfig(zero);
    client.steps = 4;
    client.before_step = [&](int, int step, Engine& e) {
      OptimizerGroupOptions o;
      o.lr = r.reports[step].lr;
      o.beta1 = beta1s[step];
      o.beta2 = 0.99;
      ASSERT_TRUE(e.SetHyperparameters({&o, 1}).ok());
    };
    const RunResult c = RunEngine(client);
    ASSERT_TRUE(c.status.ok()) << c.status.ToString();
    EXPECT_TRUE(BitEqual(r.master, c.master));

    RunSpec flat = spec;  // the same lrs, the config's betas
    flat.config_json =
        BaseConfig(zero, std::string(one_cycle).insert(one_cycle.find("\"cycle_min_mom\""),
                                                       R"("cycle_momentum": false, )"));
    flat.before_step = nullptr;
    const RunResult f = RunEngine(flat);
    ASSERT_TRUE(f.status.ok()) << f.status.ToString();
    EXPECT_FALSE(BitEqual(r.master, f.master));
  }
}

TEST(EngineSemantics, SetHyperparametersRefusesWithoutChangingAnything) {
  RunSpec spec = TwoOptimizerGroups(1);
  spec.before_step = [](int, int, Engine& e) {
    const auto before = e.betas();
    std::vector<OptimizerGroupOptions> g(1);
    EXPECT_EQ(e.SetHyperparameters(g).code(), Status::Code::kInvalidArgument);  // count
    g.resize(2);
    g[0].lr = 0.1;  // lr for one group only
    Status st = e.SetHyperparameters(g);
    EXPECT_NE(st.message().find("optimizer group 1"), std::string::npos) << st.ToString();
    g[0].lr.reset();
    g[1].beta1 = 0.5;  // without beta2
    EXPECT_EQ(e.SetHyperparameters(g).code(), Status::Code::kInvalidArgument);
    g[1].beta2 = 1.0;  // Adam refuses it
    st = e.SetHyperparameters(g);
    EXPECT_NE(st.message().find("beta2"), std::string::npos) << st.ToString();
    EXPECT_EQ(e.betas(), before);
    g[1].beta2 = 0.9;
    g[0].eps = 1e-6;
    ASSERT_TRUE(e.SetHyperparameters(g).ok());
    EXPECT_EQ(e.betas()[1], std::make_pair(0.5, 0.9));
    EXPECT_EQ(e.betas()[0], before[0]);
  };
  const RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
}

// DeepSpeed's set_train_batch_size: an engine configured with accumulation 1 and set to 2 before
// its first step trains to the bits of one configured with 2; across placements and 2 ranks
// (the reduced gradient's scale is 1 / (world * accumulation)).
TEST(EngineSemantics, SetGradientAccumulationStepsGivesTheConfiguredBits) {
  for (const char* zero :
       {R"("stage": 1)", R"("stage": 3, "offload_optimizer": {"device": "cpu"})"}) {
    for (int world : {1, 2}) {
      SCOPED_TRACE(std::string(zero) + " world " + std::to_string(world));
      RunSpec configured;
      configured.config_json = BaseConfig(zero);
      const std::string one = R"("gradient_accumulation_steps": 1)";
      configured.config_json.replace(configured.config_json.find(one), one.size(),
                                     R"("gradient_accumulation_steps": 2)");
      configured.world = world;
      configured.gas = 2;
      RunSpec set = configured;
      set.config_json = BaseConfig(zero);
      set.before_step = [](int, int step, Engine& e) {
        if (step != 0) return;
        EXPECT_EQ(e.SetGradientAccumulationSteps(0).code(), Status::Code::kInvalidArgument);
        ASSERT_TRUE(e.SetGradientAccumulationSteps(2).ok());
        EXPECT_EQ(e.gradient_accumulation_steps(), 2);
      };
      set.before_engine_step = [](int, int, Engine& e, nvme::SimBackend*) {
        const Status st = e.SetGradientAccumulationSteps(3);  // this step's gradients are in
        EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
        EXPECT_NE(st.message().find("between steps"), std::string::npos) << st.ToString();
        EXPECT_EQ(e.gradient_accumulation_steps(), 2);
      };
      const RunResult a = RunEngine(configured);
      const RunResult b = RunEngine(set);
      ASSERT_TRUE(a.status.ok()) << a.status.ToString();
      ASSERT_TRUE(b.status.ok()) << b.status.ToString();
      EXPECT_TRUE(BitEqual(a.master, b.master));
    }
  }
}

// One rank, accumulation 1, bf16 with the optimizer offloaded: the gradients are kept as
// reduced, in bf16, so the accumulation cannot change; the refusal names why and changes nothing.
TEST(EngineSemantics, SetGradientAccumulationStepsRefusedWhereGradientsAreKeptAsReduced) {
  RunSpec spec;
  spec.config_json =
      BaseConfig(R"("stage": 2, "offload_optimizer": {"device": "cpu"})", "", "bf16");
  spec.steps = 1;
  spec.before_step = [](int, int, Engine& e) {
    const Status st = e.SetGradientAccumulationSteps(2);
    EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.message().find("gradient_accumulation_steps > 1"), std::string::npos)
        << st.ToString();
    EXPECT_EQ(e.gradient_accumulation_steps(), 1);
  };
  const RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
}

TEST(EngineSemantics, UnsupportedSettingsAreClearErrorsAtCreate) {
  RunSpec spec;
  spec.config_json =
      BaseConfig(R"("stage": 1)", R"("scheduler": {"type": "StepLR", "params": {}},)");
  RunResult r = RunEngine(spec);
  EXPECT_EQ(r.status.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(r.status.message().find("scheduler.type"), std::string::npos) << r.status.ToString();
  spec.config_json = R"({"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 1}})";
  r = RunEngine(spec);
  EXPECT_EQ(r.status.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(r.status.message().find("optimizer.type"), std::string::npos) << r.status.ToString();
}

// ------------------------------------------------------------------------------------------------
// DeepSpeed's offload traps (docs/deepspeed-compat.md, "DeepSpeed's offload pitfalls")
// ------------------------------------------------------------------------------------------------

// (a) shards and sub-groups whose sizes are not multiples of the O_DIRECT alignment, (b) the tied
// W0 used at the end of forward and the start of backward with params on NVMe and prefetch on,
// (c) buffer_count 1, (d) pin_memory false: all run, bit-identical to stage 0, with notes.
TEST(EngineTraps, OddShapesTiedWeightsSmallBuffersUnpinned) {
  RunSpec base;
  base.config_json = BaseConfig(R"("stage": 0)", "", "bf16");
  base.world = 2;
  RunResult ref = RunEngine(base);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  RunSpec spec = base;
  spec.config_json = BaseConfig(
      R"("stage": 3, "sub_group_size": 200,
         "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 1, "pin_memory": false},
         "offload_param": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 1, "pin_memory": false})",
      "", "bf16");
  spec.use_pinned_pool = true;
  spec.io = IoBackendKind::kAuto;
  RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_TRUE(BitEqual(r.master, ref.master));
  std::string notes;
  for (const std::string& n : r.layouts[0].notes) notes += n + "\n";
  EXPECT_NE(notes.find("buffer_count 1"), std::string::npos) << notes;
  EXPECT_NE(notes.find("not page-locked"), std::string::npos) << notes;
  // The host stand-in's copies are memcpy either way: no word of synchronous device copies.
  EXPECT_EQ(notes.find("synchronous"), std::string::npos) << notes;
}

// sub_group_size 0 (valid DeepSpeed, accepted by `config check` and `plan`: each tensor a
// sub-group) runs, with the same bits as any other sub-group size.
TEST(EngineSemantics, SubGroupSizeZeroRunsAsDeepSpeedAllowsIt) {
  RunSpec base;
  base.config_json = BaseConfig(R"("stage": 0)");
  base.world = 2;
  RunResult ref = RunEngine(base);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  RunSpec spec = base;
  spec.config_json =
      BaseConfig(R"("stage": 3, "sub_group_size": 0, "offload_optimizer": {"device": "cpu"})");
  RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_TRUE(BitEqual(r.master, ref.master));
  // Sub-groups as large as the largest tensor (W1, 1280 elements): fewer than with 256.
  RunSpec small = spec;
  small.config_json = BaseConfig(R"("stage": 3, "offload_optimizer": {"device": "cpu"})");
  RunResult s256 = RunEngine(small);
  ASSERT_TRUE(s256.status.ok()) << s256.status.ToString();
  EXPECT_LT(r.layouts[0].sub_groups, s256.layouts[0].sub_groups);
}

// ------------------------------------------------------------------------------------------------
// IO economy
// ------------------------------------------------------------------------------------------------

uint64_t NvmeReadBytes(const Engine& e) {
  const StoreStats s = e.Stats().store;
  uint64_t b = 0;
  for (Tier t : kAllTiers) b += s.bytes_moved[Tier::kNvme][t];
  return b;
}

// EngineStats' waits count the step in progress, so a trainer (bench engine's phases) can time
// its forward and backward by two Stats() calls; the store waits are parts of the Gather and
// reduction waits, and after the last Step the totals are the reports' sums. Without
// overlap_comm: with it the accumulations run behind the backward, their lease waits are not the
// trainer's, and the last ones are collected in Step.
TEST(EngineStats, WaitsCountTheStepInProgressAndSplitOutTheStore) {
  RunSpec spec;
  spec.config_json = BaseConfig(
      R"("stage": 3, "sub_group_size": 1000000, "overlap_comm": false,
         "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
         "offload_param": {"device": "nvme", "nvme_path": "/tmp"})");
  spec.steps = 2;
  std::vector<EngineStats> at_start(spec.steps), before_step(spec.steps);
  spec.before_step = [&](int, int s, Engine& e) { at_start[s] = e.Stats(); };
  spec.before_engine_step = [&](int, int s, Engine& e, nvme::SimBackend*) {
    before_step[s] = e.Stats();
  };
  RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  StepTimings sum;
  for (int s = 0; s < spec.steps; ++s) {
    const StepTimings& a = at_start[s].timings;
    const StepTimings& b = before_step[s].timings;
    // The forward and backward of step s, before its Step: counted already.
    EXPECT_GT(b.gather_wait_ns, a.gather_wait_ns) << s;
    EXPECT_GT(b.gather_fetch_wait_ns, a.gather_fetch_wait_ns) << s;
    EXPECT_GT(b.reduce_wait_ns, a.reduce_wait_ns) << s;
    EXPECT_GT(b.grad_lease_wait_ns, a.grad_lease_wait_ns) << s;
    EXPECT_LE(b.gather_fetch_wait_ns - a.gather_fetch_wait_ns, b.gather_wait_ns - a.gather_wait_ns);
    EXPECT_LE(b.grad_lease_wait_ns - a.grad_lease_wait_ns, b.reduce_wait_ns - a.reduce_wait_ns);
    // Nothing of the step's own: its optimizer figures arrive with it.
    EXPECT_EQ(b.optimizer_ns, a.optimizer_ns) << s;
    const StepTimings& t = r.reports[s].timings;
    EXPECT_EQ(t.gather_wait_ns, b.gather_wait_ns - a.gather_wait_ns) << s;
    EXPECT_EQ(t.grad_lease_wait_ns, b.grad_lease_wait_ns - a.grad_lease_wait_ns) << s;
    sum.gather_wait_ns += t.gather_wait_ns;
    sum.gather_fetch_wait_ns += t.gather_fetch_wait_ns;
    sum.reduce_wait_ns += t.reduce_wait_ns;
    sum.grad_lease_wait_ns += t.grad_lease_wait_ns;
    sum.optimizer_ns += t.optimizer_ns;
    sum.step_ns += t.step_ns;
  }
  const StepTimings& end = r.stats[0].timings;
  EXPECT_EQ(end.gather_wait_ns, sum.gather_wait_ns);
  EXPECT_EQ(end.gather_fetch_wait_ns, sum.gather_fetch_wait_ns);
  EXPECT_EQ(end.reduce_wait_ns, sum.reduce_wait_ns);
  EXPECT_EQ(end.grad_lease_wait_ns, sum.grad_lease_wait_ns);
  EXPECT_EQ(end.optimizer_ns, sum.optimizer_ns);
  EXPECT_EQ(end.step_ns, sum.step_ns);
}

TEST(EngineIo, Stage3StepNeverReadsTheParamsItReplaces) {
  // Params on NVMe, optimizer state in host memory, nothing prefetched or kept between uses: the
  // step's only possible NVMe reads are of the param blocks its Adam writes. At stage 3 it writes
  // every element of them (this rank's shard, one sub-group per group here), so it reads none.
  RunSpec spec;
  spec.config_json = BaseConfig(
      R"("stage": 3, "sub_group_size": 1000000, "stage3_prefetch_bucket_size": 0,
         "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0,
         "offload_optimizer": {"device": "cpu"},
         "offload_param": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 2})");
  spec.steps = 3;
  spec.budgets[Tier::kHost] = 132 << 10;  // 2 of the 5 param shards: the params are paged
  spec.device_budget = 36 << 10;          // about the working set: the params are paged there too
  std::vector<uint64_t> before(spec.steps), forward_backward(spec.steps), step(spec.steps);
  uint64_t start = 0;
  spec.before_step = [&](int, int s, Engine& e) { start = NvmeReadBytes(e); };
  spec.before_engine_step = [&](int, int s, Engine& e, nvme::SimBackend*) {
    before[s] = NvmeReadBytes(e);
    forward_backward[s] = before[s] - start;
  };
  spec.after_step = [&](int, int s, Engine& e) {
    step[s] = NvmeReadBytes(e) - before[s];
    return Status::OK();
  };
  RunResult r = RunEngine(spec);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  for (int s = 0; s < spec.steps; ++s) {
    EXPECT_GT(forward_backward[s], 0u) << "step " << s << ": the gathers read the params";
    EXPECT_EQ(step[s], 0u) << "step " << s;
  }
  // The same result as with the params in host memory (the bytes the step replaced unread).
  RunSpec host = spec;
  host.config_json = BaseConfig(
      R"("stage": 3, "sub_group_size": 1000000, "offload_optimizer": {"device": "cpu"},
         "offload_param": {"device": "cpu"})");
  host.before_step = nullptr;
  host.before_engine_step = nullptr;
  host.after_step = nullptr;
  host.budgets = {};
  host.device_budget = RunSpec{}.device_budget;
  RunResult ref = RunEngine(host);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  EXPECT_TRUE(BitEqual(r.master, ref.master));
}

TEST(EngineIo, FlushRestsTheEngineSoItsSwapFilesCanBeRewrittenBetweenSteps) {
  // Between steps, Flush and a pass that reads every unit of the engine's own swap files and
  // writes it back unchanged (bench engine --disk-reference-paired-split): the engine trains on,
  // verifying every read against its checksums, to the bits of a run without the passes. Flush
  // refuses while a gathered group is held.
  RunSpec spec;
  spec.config_json = BaseConfig(
      R"("stage": 3, "sub_group_size": 1000000,
         "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
         "offload_param": {"device": "nvme", "nvme_path": "/tmp"})");
  spec.io = IoBackendKind::kPosix;  // real files
  spec.steps = 3;
  RunResult plain = RunEngine(spec);
  ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();

  int passes = 0;
  spec.after_step = [&](int, int s, Engine& e) -> Status {
    const std::vector<std::string> files = e.nvme_files();
    if (files.empty()) return Status::Internal("no swap files");
    for (const std::string& f : files) {
      if (!std::filesystem::is_regular_file(f)) return Status::Internal("no file " + f);
    }
    if (s == 1) {
      auto held = e.Gather(0);
      STRATA_RETURN_IF_ERROR(held.status());
      Status refused = e.Flush();
      e.Release(std::move(*held));
      if (refused.code() != Status::Code::kFailedPrecondition) {
        return Status::Internal("Flush with a group held: " + refused.ToString());
      }
    }
    STRATA_RETURN_IF_ERROR(e.Flush());
    uint64_t bytes = 0;
    for (const std::string& f : files) bytes += std::filesystem::file_size(f);
    nvme::NvmeRewriteOptions o;
    o.files = files;
    o.block_bytes = 4096;  // every unit of the small test model's files
    o.read_bytes = bytes;
    o.write_bytes = bytes;
    o.queue_depth = 4;
    o.buffer_bytes = 64 << 10;
    o.backend = IoBackendKind::kPosix;
    STRATA_ASSIGN_OR_RETURN(nvme::NvmeRewriteResult r, nvme::RunNvmeRewrite(o));
    if (r.write_bytes != bytes / 4096 * 4096) return Status::Internal("rewrote too little");
    ++passes;
    return Status::OK();
  };
  RunResult rewritten = RunEngine(spec);
  ASSERT_TRUE(rewritten.status.ok()) << rewritten.status.ToString();
  EXPECT_EQ(passes, spec.steps);
  EXPECT_TRUE(BitEqual(rewritten.master, plain.master));
}

// ------------------------------------------------------------------------------------------------
// Faults
// ------------------------------------------------------------------------------------------------

TEST(EngineFaults, IoErrorFailsTheStepNamingTheBlockAndStaysFailed) {
  RunSpec spec;
  spec.config_json =
      BaseConfig(R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"})");
  spec.world = 2;
  spec.steps = 3;
  spec.timeout = std::chrono::milliseconds(20000);
  spec.budgets[Tier::kHost] = 96 << 10;  // tight: NVMe-homed state is paged, not kept cached
  spec.inject = [](int rank, int step, nvme::SimBackend& sim) {
    if (rank == 0 && step == 1) sim.InjectFault(IoOp::kRead, nvme::SimFault::kEio, 1000);
  };
  Status later;
  spec.before_step = [&](int rank, int step, Engine& e) {
    if (rank == 0 && step == 2) later = e.health();
  };
  RunResult r = RunEngine(spec);
  ASSERT_FALSE(r.rank_status[0].ok());
  EXPECT_EQ(r.rank_status[0].code(), Status::Code::kIOError) << r.rank_status[0].ToString();
  // The block is named (a sub-group's state of some group, on rank 0).
  EXPECT_NE(r.rank_status[0].message().find("[r0"), std::string::npos)
      << r.rank_status[0].ToString();
  // The peer fails too (its collectives see the dead rank), within the deadline.
  EXPECT_FALSE(r.rank_status[1].ok());
}

// One rank, optimizer state on NVMe paged through a tight host budget (one that cached all of
// it would write nothing home), `fault` on the first write of step 1 (step 0's optimizer waited
// for all its writes: step 1's first writes are its gradients' write-behind).
RunResult RunWithStep1WriteFault(nvme::SimFault fault) {
  RunSpec spec;
  spec.config_json =
      BaseConfig(R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"})");
  spec.steps = 3;
  spec.timeout = std::chrono::milliseconds(20000);
  spec.budgets[Tier::kHost] = 96 << 10;
  spec.inject = [fault](int, int step, nvme::SimBackend& sim) {
    if (step == 1) sim.InjectFault(IoOp::kWrite, fault, 1);
  };
  return RunEngine(spec);
}

TEST(EngineFaults, TornWriteIsCaughtByTheChecksumNeverApplied) {
  RunResult r = RunWithStep1WriteFault(nvme::SimFault::kTorn);
  ASSERT_FALSE(r.rank_status[0].ok());
  const std::string msg = r.rank_status[0].ToString();
  EXPECT_TRUE(r.rank_status[0].code() == Status::Code::kIOError ||
              r.rank_status[0].code() == Status::Code::kCorruption)
      << msg;
  EXPECT_NE(msg.find("[r0"), std::string::npos) << msg;
}

TEST(EngineFaults, FailedGradientWriteBehindFailsItsStepNamingTheBlock) {
  // A completed NVMe-homed gradient is written home during the backward (Accumulate), with no
  // one waiting on it; a failed write must still fail the step that wrote it.
  RunResult r = RunWithStep1WriteFault(nvme::SimFault::kEio);
  ASSERT_FALSE(r.rank_status[0].ok());
  const std::string msg = r.rank_status[0].ToString();
  EXPECT_EQ(r.rank_status[0].code(), Status::Code::kIOError) << msg;
  EXPECT_NE(msg.find("gradient write-behind"), std::string::npos) << msg;
  EXPECT_NE(msg.find(".grad[r0"), std::string::npos) << msg;
  // Only step 0 reported: step 1 was never applied.
  EXPECT_EQ(r.reports.size(), 1u);
}

TEST(EngineFaults, CachedNvmeStateIsWrittenHomeOnlyByFlushWhichNamesAFailedBlock) {
  // The default host budget of this small model caches every NVMe-homed block: no step writes
  // any home (the NVMe bytes written stay what the first step left), and Flush writes them all;
  // a failed write fails it with the block's name.
  RunSpec spec;
  spec.config_json =
      BaseConfig(R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"})");
  spec.steps = 3;
  spec.timeout = std::chrono::milliseconds(20000);
  std::vector<uint64_t> written;
  nvme::SimBackend* backend = nullptr;
  Status flushed;
  spec.before_engine_step = [&](int, int, Engine&, nvme::SimBackend* sim) { backend = sim; };
  spec.after_step = [&](int, int step, Engine& e) -> Status {
    written.push_back(e.Stats().store.bytes_moved[Tier::kHost][Tier::kNvme]);
    if (step == 2) {
      if (backend == nullptr) return Status::Internal("no simulated backend");
      backend->InjectFault(IoOp::kWrite, nvme::SimFault::kEio, 1);
      flushed = e.Flush();
    }
    return Status::OK();
  };
  RunResult r = RunEngine(spec);
  ASSERT_EQ(written.size(), 3u) << r.status.ToString();
  EXPECT_EQ(written[1], written[0]);
  EXPECT_EQ(written[2], written[0]);
  ASSERT_FALSE(flushed.ok());
  EXPECT_EQ(flushed.code(), Status::Code::kIOError) << flushed.ToString();
  EXPECT_NE(flushed.ToString().find("[r0"), std::string::npos) << flushed.ToString();
}

TEST(EngineFaults, DeadPeerIsANamedErrorWithinTheDeadline) {
  RunSpec spec;
  spec.config_json = BaseConfig(R"("stage": 3)");
  spec.world = 2;
  spec.steps = 3;
  spec.timeout = std::chrono::milliseconds(10000);
  // Rank 1 dies before its second step: its engine and communicator go away mid-run.
  spec.die_rank = 1;
  spec.die_step = 1;
  const auto t0 = std::chrono::steady_clock::now();
  RunResult r = RunEngine(spec);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(r.rank_status[0].ok());
  const std::string msg = r.rank_status[0].ToString();
  // Named: the operation that found the peer gone (a gather of a group, by name).
  EXPECT_NE(msg.find("group '"), std::string::npos) << msg;
  EXPECT_LT(waited, std::chrono::seconds(30)) << msg;
}

}  // namespace
}  // namespace strata::testing
