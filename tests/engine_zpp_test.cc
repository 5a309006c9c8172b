// ZeRO++ in the engine (issue 14): qwZ (quantized weight all-gather), hpZ (secondary partition
// within groups of k ranks) and qgZ (hierarchical quantized gradient reduce-scatter), on 4 ranks
// over Gloo threads laid out as 2 "nodes" of 2 ranks. Proven: hpZ alone is bit-for-bit plain
// stage 3; the quantized runs train within a stated tolerance of it; the bytes each rank moves
// per step, intra- and inter-node, are the planner's figures; fp16 overflow under qgZ skips the
// step on every rank; the hpZ copy is in the layout and the budget; keys that cannot work are
// refused naming the key. Model and harness: engine_test_model.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "engine_test_model.h"
#include "strata/planner.h"

namespace strata::testing {
namespace {

constexpr int kWorld = 4, kPerNode = 2, kSteps = 3;

// Stage 3 (unless `stage`), AdamW, re-gathering every use (stage3_max_reuse_distance 0) so that
// the later gathers of a step are real collectives; `zpp` is spliced into zero_optimization.
std::string Config(const std::string& precision, const std::string& zpp, int stage = 3,
                   const char* opt = "none", const char* param = "none") {
  return R"({
  "train_micro_batch_size_per_gpu": 3,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "bf16": {"enabled": )" +
         std::string(precision == "bf16" ? "true" : "false") + R"(},
  "fp16": {"enabled": )" +
         std::string(precision == "fp16" ? "true" : "false") + R"(, "initial_scale_power": 8},
  "zero_optimization": {
    "stage": )" +
         std::to_string(stage) + R"(,
    "offload_optimizer": {"device": ")" +
         opt + R"(", "nvme_path": "/tmp"},
    "offload_param": {"device": ")" +
         param + R"(", "nvme_path": "/tmp"},
    "sub_group_size": 256,
    "stage3_max_reuse_distance": 0,
    "stage3_param_persistence_threshold": 64)" +
         (zpp.empty() ? "" : ",\n    " + zpp) + R"(
  }
})";
}

RunSpec Spec(const std::string& config) {
  RunSpec s;
  s.config_json = config;
  s.world = kWorld;
  s.steps = kSteps;
  s.ranks_per_node = kPerNode;
  return s;
}

std::vector<std::vector<float>> Initial() { return RunReference(kWorld, 0, 1, 0.01f, 0.01f); }

// ------------------------------------------------------------------------------------------------
// hpZ alone: the secondary copy holds exactly the bits the global all-gather delivered, so the
// later (intra-group) gathers give the same params and training is bit-for-bit plain stage 3.
// ------------------------------------------------------------------------------------------------

TEST(EngineZpp, HpzAloneIsBitIdenticalToStage3) {
  for (const std::string precision : {"bf16", "fp16", "fp32"}) {
    RunResult plain = RunEngine(Spec(Config(precision, "")));
    ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
    if (precision == "bf16") {  // 0 is off, as in DeepSpeed (and the planner)
      RunResult off = RunEngine(Spec(Config(precision, R"("zero_hpz_partition_size": 0)")));
      ASSERT_TRUE(off.status.ok()) << off.status.ToString();
      EXPECT_TRUE(BitEqual(off.master, plain.master));
    }
    for (int k : {2, 4}) {
      RunResult hpz =
          RunEngine(Spec(Config(precision, R"("zero_hpz_partition_size": )" + std::to_string(k))));
      ASSERT_TRUE(hpz.status.ok()) << precision << " k " << k << ": " << hpz.status.ToString();
      EXPECT_TRUE(BitEqual(hpz.master, plain.master)) << precision << " k " << k;
      // The later gathers really ran within the group: the group communicator moved bytes.
      const uint64_t group_bytes = hpz.stats[0].comm_intra.of(CommOp::kAllGather).sent_bytes +
                                   hpz.stats[0].comm_inter.of(CommOp::kAllGather).sent_bytes;
      EXPECT_GT(group_bytes, 0u) << precision << " k " << k;
      EXPECT_LT(hpz.stats[0].comm.of(CommOp::kAllGather).sent_bytes,
                plain.stats[0].comm.of(CommOp::kAllGather).sent_bytes)
          << precision << " k " << k;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// qwZ, qgZ and all three: within tolerance of the unquantized stage-3 run (bf16), measured as the
// error relative to the distance training moved the weights. INT8 blocks of 4096 carry about
// 1/254 of a block's largest magnitude per element; Adam's m / sqrt(v) normalises the gradient
// noise into lr-sized steps, so the tolerance is that of the 16-bit runs against fp32 (0.1).
// ------------------------------------------------------------------------------------------------

TEST(EngineZpp, QuantizedRunsTrainWithinToleranceOfStage3) {
  const std::string precision = "bf16";
  RunResult plain = RunEngine(Spec(Config(precision, "")));
  ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
  const auto init = Initial();
  struct Case {
    const char* name;
    std::string zpp;
  } cases[] = {
      {"qwZ", R"("zero_quantized_weights": true)"},
      {"hpZ+qwZ", R"("zero_quantized_weights": true, "zero_hpz_partition_size": 2)"},
      {"qgZ", R"("zero_quantized_gradients": true)"},
      {"qwZ+hpZ+qgZ", R"("zero_quantized_weights": true, "zero_hpz_partition_size": 2,
                         "zero_quantized_gradients": true)"},
  };
  for (const Case& c : cases) {
    RunResult r = RunEngine(Spec(Config(precision, c.zpp)));
    ASSERT_TRUE(r.status.ok()) << c.name << ": " << r.status.ToString();
    for (const StepReport& rep : r.reports) EXPECT_FALSE(rep.skipped) << c.name;
    const double err = RelativeUpdateError(r.master, plain.master, init);
    std::printf("%s: relative error against plain stage 3 %.4g\n", c.name, err);
    EXPECT_LT(err, 0.1) << c.name;
    // Quantization changed something (the comparison is not vacuous), and training moved.
    EXPECT_FALSE(BitEqual(r.master, plain.master)) << c.name;
    EXPECT_GT(RelativeUpdateError(init, plain.master, init), 0.99);
  }
}

// ------------------------------------------------------------------------------------------------
// qgZ with fp16: an inf in one rank's gradient makes its INT8 block's scale NaN, the reduced
// shard NaN, and the step is skipped on every rank (the loss scale halves), as without qgZ.
// ------------------------------------------------------------------------------------------------

TEST(EngineZpp, QgzFp16OverflowSkipsTheStepOnEveryRank) {
  for (const std::string& zpp :
       {std::string(R"("zero_quantized_gradients": true)"),
        std::string(R"("zero_quantized_gradients": true, "zero_quantized_weights": true,
                        "zero_hpz_partition_size": 2)")}) {
    RunSpec spec = Spec(Config("fp16", zpp));
    std::vector<int> skipped(kWorld, 0);
    spec.tamper = [](int rank, int step, int, Grads* g) {
      if (rank == 3 && step == 1) g->W1[7] = std::numeric_limits<float>::infinity();
    };
    spec.after_step = [&](int rank, int, Engine& e) -> Status {
      skipped[rank] = static_cast<int>(e.Stats().skipped_steps);
      return Status::OK();
    };
    RunResult r = RunEngine(spec);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    ASSERT_EQ(r.reports.size(), static_cast<size_t>(kSteps));
    EXPECT_FALSE(r.reports[0].skipped);
    EXPECT_TRUE(r.reports[1].skipped) << zpp;
    EXPECT_FALSE(r.reports[2].skipped);
    EXPECT_TRUE(std::isinf(r.reports[1].grad_norm));
    for (int rank = 0; rank < kWorld; ++rank) EXPECT_EQ(skipped[rank], 1) << "rank " << rank;
    for (const auto& g : r.master) {
      for (float v : g) ASSERT_TRUE(std::isfinite(v));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The hpZ secondary copy is a device state in the layout, and the device budget must hold it.
// ------------------------------------------------------------------------------------------------

// Params and optimizer on the host, so the device holds no store blocks (the store rounds each
// to 4 KiB) and its need is the engine's own buffers plus, with hpZ, the secondary copy.
TEST(EngineZpp, BudgetIncludesTheHpzSecondaryCopy) {
  RunSpec plain = Spec(Config("bf16", "", 3, "cpu", "cpu"));
  plain.steps = 0;
  RunResult a = RunEngine(plain);
  ASSERT_TRUE(a.status.ok()) << a.status.ToString();
  RunSpec hpz = Spec(Config("bf16", R"("zero_hpz_partition_size": 2)", 3, "cpu", "cpu"));
  hpz.steps = 0;
  RunResult b = RunEngine(hpz);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  // 1/2 of every padded group (padded to 4 x 128 elements), 2 bytes each.
  uint64_t expect = 0;
  for (const GroupSpec& g : TestModel().groups) {
    const uint64_t unit = kWorld * 128;
    expect += (g.numel() + unit - 1) / unit * unit / 2 * 2;
  }
  const EngineLayout& la = a.layouts[0];
  const EngineLayout& lb = b.layouts[0];
  EXPECT_EQ(lb.hpz_secondary_bytes, expect);
  EXPECT_EQ(lb.state_bytes[Tier::kDevice], la.state_bytes[Tier::kDevice] + expect);
  EXPECT_EQ(lb.hpz_partition_size, 2);
  EXPECT_NE(lb.ToString().find("hpZ"), std::string::npos) << lb.ToString();
  // A device budget that holds plain stage 3 but not the secondary copy: refused, naming the tier.
  const uint64_t fits_plain =
      la.state_bytes[Tier::kDevice] + la.working_bytes[Tier::kDevice] + expect / 2;
  ASSERT_LT(fits_plain, lb.state_bytes[Tier::kDevice] + lb.working_bytes[Tier::kDevice]);
  plain.budgets[Tier::kDevice] = fits_plain;
  RunResult fits = RunEngine(plain);
  EXPECT_TRUE(fits.status.ok()) << fits.status.ToString();
  hpz.budgets[Tier::kDevice] = fits_plain;
  RunResult refused = RunEngine(hpz);
  ASSERT_EQ(refused.status.code(), Status::Code::kResourceExhausted) << refused.status.ToString();
  EXPECT_NE(refused.status.message().find("hbm tier"), std::string::npos)
      << refused.status.ToString();
}

// ------------------------------------------------------------------------------------------------
// The ledger: bytes each rank sends per step equal the planner's ZeRO++ model (ZeroPlusPlusComm)
// for a trainer that gathers each group once in forward and once in backward. Groups are
// multiples of 4 ranks x 4096 (the quantization block), so no padding and whole blocks: the
// figures are exact. Per collective, and split intra/inter-node by the planner's rule for rings
// over all ranks (1/L of their bytes cross a node boundary) plus the sub-communicators' bytes.
// ------------------------------------------------------------------------------------------------

struct StepBytes {
  Status status;
  CommStats global, intra, inter;  // rank-0 deltas over one step, norm exchange removed
};

StepBytes MeasureZppStep(const std::string& zpp, int world, int per_node) {
  StepBytes out;
  ModelSpec model;
  model.groups = {{"a", {{"w", {16384}}}}, {"b", {{"w", {128, 256}}}}, {"c", {{"w", {16384}}}}};
  auto parsed = ParseDeepSpeedConfig(Config("bf16", zpp));
  if (!parsed.ok()) {
    out.status = parsed.status();
    return out;
  }
  const std::string dir = UniqueTestDir("engine_zpp_ledger");
  const std::vector<Status> st = OnHostRanks(
      world, dir, parsed->config, [&](int r, EngineOptions eo) -> Status {
        eo.ranks_per_node = per_node;
        STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, std::move(eo)));
        STRATA_RETURN_IF_ERROR(
            engine->InitParameters([](size_t g, size_t, size_t b, size_t e, float* o) {
              for (size_t i = b; i < e; ++i) o[i - b] = 0.02f * Noise(g * 100000 + i);
            }));
        const EngineStats before = engine->Stats();
        const size_t n = model.groups.size();
        for (size_t g = 0; g < n; ++g) {
          STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, engine->Gather(g));
          engine->Release(std::move(gg));
        }
        for (size_t g = n; g-- > 0;) {
          STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, engine->Gather(g));
          STRATA_ASSIGN_OR_RETURN(void* buf, engine->GradBuffer(g));
          auto* b16 = static_cast<uint16_t*>(buf);
          for (size_t i = 0; i < model.groups[g].numel(); ++i) {
            b16[i] = FloatToBf16(0.01f * Noise(7 * r + 1000003 * g + i)).bits;
          }
          engine->Release(std::move(gg));
          STRATA_RETURN_IF_ERROR(engine->ReduceGradients(g));
        }
        STRATA_ASSIGN_OR_RETURN(StepReport rep, engine->Step());
        if (rep.skipped) return Status::Internal("step skipped");
        const EngineStats after = engine->Stats();
        if (r == 0) {
          auto delta = [](const CommStats& a, const CommStats& b) {
            CommStats d;
            for (size_t i = 0; i < kCommOpCount; ++i) {
              d.ops[i].sent_bytes = a.ops[i].sent_bytes - b.ops[i].sent_bytes;
              d.ops[i].received_bytes = a.ops[i].received_bytes - b.ops[i].received_bytes;
            }
            return d;
          };
          out.global = delta(after.comm, before.comm);
          out.intra = delta(after.comm_intra, before.comm_intra);
          out.inter = delta(after.comm_inter, before.comm_inter);
          out.global.of(CommOp::kAllGather).sent_bytes -=
              RingBytes(CommOp::kAllGather, static_cast<uint64_t>(world) * 16, world);
        }
        return Status::OK();
      });
  for (int r = 0; r < world; ++r) {
    if (!st[r].ok() && out.status.ok()) out.status = st[r].WithContext("rank " + std::to_string(r));
  }
  std::system(("rm -rf '" + dir + "'").c_str());
  return out;
}

TEST(EngineZpp, CommBytesPerRankEqualThePlanner) {
  const double psi = 65536;  // the model above
  struct Case {
    const char* name;
    std::string zpp;
    ZeroPlusPlus planner;
  } cases[] = {
      {"plain", "", {}},
      {"qwZ", R"("zero_quantized_weights": true)", {true, false, 1}},
      {"hpZ", R"("zero_hpz_partition_size": 2)", {false, false, 2}},
      {"qgZ", R"("zero_quantized_gradients": true)", {false, true, 1}},
      {"qwZ+hpZ+qgZ",
       R"("zero_quantized_weights": true, "zero_hpz_partition_size": 2,
          "zero_quantized_gradients": true)",
       {true, true, 2}},
  };
  // The planner's intra/inter rule for a ring over every rank: its split of one byte.
  const CommBytes ring =
      ZeroPlusPlusComm({}, 1, 1, 0, kPerNode, kWorld / kPerNode).param_gather_forward;
  const double ring_inter = ring.inter_node / ring.Total();
  double plain_inter = 0;
  for (const Case& c : cases) {
    StepBytes m = MeasureZppStep(c.zpp, kWorld, kPerNode);
    ASSERT_TRUE(m.status.ok()) << c.name << ": " << m.status.ToString();
    const Stage3Comm want = ZeroPlusPlusComm(c.planner, psi, 2, 2, kPerNode, kWorld / kPerNode);
    const bool hpz = c.planner.hpz_partition_size > 1, qgz = c.planner.quantized_gradients;
    // Per collective.
    EXPECT_DOUBLE_EQ(
        double(m.global.of(CommOp::kAllGather).sent_bytes),
        want.param_gather_forward.Total() + (hpz ? 0.0 : want.param_gather_backward.Total()))
        << c.name;
    EXPECT_DOUBLE_EQ(double(m.global.of(CommOp::kReduceScatter).sent_bytes),
                     qgz ? 0.0 : want.grad_reduce_scatter.Total())
        << c.name;
    EXPECT_DOUBLE_EQ(double(m.intra.total_sent_bytes()),
                     (qgz ? want.grad_reduce_scatter.intra_node : 0.0) +
                         (hpz ? want.param_gather_backward.Total() : 0.0))
        << c.name;
    EXPECT_DOUBLE_EQ(double(m.inter.total_sent_bytes()),
                     qgz ? want.grad_reduce_scatter.inter_node : 0.0)
        << c.name;
    // Split by link, as the planner reports it.
    const double global = double(m.global.total_sent_bytes());
    const double intra = global * (1 - ring_inter) + double(m.intra.total_sent_bytes());
    const double inter = global * ring_inter + double(m.inter.total_sent_bytes());
    EXPECT_NEAR(intra, want.total.intra_node, 1e-6 * want.total.Total()) << c.name;
    EXPECT_NEAR(inter, want.total.inter_node, 1e-6 * want.total.Total()) << c.name;
    if (std::string(c.name) == "plain") plain_inter = inter;
    std::printf("%-12s bytes/rank/step: intra-node %.0f, inter-node %.0f (%.3f x plain)\n", c.name,
                intra, inter, plain_inter > 0 ? inter / plain_inter : 0.0);
  }
}

// ------------------------------------------------------------------------------------------------
// Keys that cannot work: a clear error naming the key.
// ------------------------------------------------------------------------------------------------

TEST(EngineZpp, RefusesKeysThatCannotWorkNamingTheKey) {
  struct Case {
    std::string config;
    int ranks_per_node;
    const char* names;
  } cases[] = {
      {Config("bf16", R"("zero_hpz_partition_size": 3)"), kPerNode, "zero_hpz_partition_size"},
      {Config("bf16", R"("zero_hpz_partition_size": 8)"), kPerNode, "zero_hpz_partition_size"},
      {Config("bf16", R"("zero_quantized_weights": true)", 2), kPerNode, "zero_quantized_weights"},
      {Config("bf16", R"("zero_quantized_gradients": true)", 1), kPerNode,
       "zero_quantized_gradients"},
      {Config("bf16", R"("zero_hpz_partition_size": 2)", 2), kPerNode, "zero_hpz_partition_size"},
      {Config("bf16", R"("zero_quantized_gradients": true)"), 3, "ranks_per_node"},
  };
  for (const Case& c : cases) {
    RunSpec spec = Spec(c.config);
    spec.steps = 0;
    spec.ranks_per_node = c.ranks_per_node;
    RunResult r = RunEngine(spec);
    ASSERT_EQ(r.status.code(), Status::Code::kInvalidArgument)
        << c.names << ": " << r.status.ToString();
    EXPECT_NE(r.status.message().find(c.names), std::string::npos) << r.status.ToString();
  }
}

// qwZ: a NaN in the weights cannot be quantized; the gather fails naming the parameter (never a
// silent zero), and the engine is failed.
TEST(EngineZpp, NonFiniteWeightUnderQwzIsAnErrorNamingTheTensor) {
  RunSpec spec = Spec(Config("bf16", R"("zero_quantized_weights": true)"));
  spec.steps = 1;
  const auto init = InitialWeights();
  spec.init = [&](int, Engine& e) {
    return e.InitParameters([&](size_t g, size_t p, size_t b, size_t end, float* out) {
      for (size_t i = b; i < end; ++i) {
        out[i - b] = g == kMid && i == 5 ? std::numeric_limits<float>::quiet_NaN() : init[g][p][i];
      }
    });
  };
  RunResult r = RunEngine(spec);
  ASSERT_FALSE(r.status.ok());
  EXPECT_NE(r.status.message().find("mid.W1"), std::string::npos) << r.status.ToString();
  EXPECT_NE(r.status.message().find("non-finite"), std::string::npos) << r.status.ToString();
}

}  // namespace
}  // namespace strata::testing
