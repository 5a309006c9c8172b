// The planner's ZeRO++ model (include/strata/planner.h, ZeroPlusPlus): bytes per rank per
// micro-step for qwZ / hpZ / qgZ split intra / inter-node, the hpZ copy in stage-3 HBM, the ratio
// against DDP, validation, and the config keys. Every figure is computed by hand in the comments.
//
// The case: Ψ = 1e9, 2 nodes x 4 GPUs (L = 4, N = 8), bf16-adam (p = g = 2 B), B = 4096, so an
// INT8 element costs 1 + 4/4096 = 1.0009765625 B.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "strata/config.h"
#include "strata/planner.h"

namespace strata {
namespace {

using D = OffloadDevice;
constexpr double kInt8 = 1.0009765625;

PlanInput Case() {
  PlanInput in;
  in.params = 1e9;
  in.capacity.gpus_per_node = 4;
  in.capacity.nodes = 2;
  return in;
}

Stage3Comm Model(const ZeroPlusPlus& z, int gpus = 4, int nodes = 2) {
  return ZeroPlusPlusComm(z, 1e9, 2, 2, gpus, nodes);
}

TEST(PlannerZeroPlusPlus, PlainStage3RingSplit) {
  const Stage3Comm c = Model(ZeroPlusPlus{});
  // Each collective: 7/8 x 2 B x 1e9 = 1.75e9; the ring crosses nodes on 2 of its 8 links: 1/4.
  for (const CommBytes& b :
       {c.param_gather_forward, c.param_gather_backward, c.grad_reduce_scatter}) {
    EXPECT_DOUBLE_EQ(b.inter_node, 0.4375e9);
    EXPECT_DOUBLE_EQ(b.intra_node, 1.3125e9);
  }
  EXPECT_DOUBLE_EQ(c.total.Total(), 5.25e9);
  EXPECT_DOUBLE_EQ(c.total.inter_node, 1.3125e9);
  EXPECT_DOUBLE_EQ(c.hpz_secondary_bytes_per_gpu, 0);
  // One node: nothing inter-node. One GPU per node: everything.
  EXPECT_DOUBLE_EQ(Model(ZeroPlusPlus{}, 8, 1).total.inter_node, 0);
  EXPECT_DOUBLE_EQ(Model(ZeroPlusPlus{}, 1, 8).total.intra_node, 0);
  EXPECT_DOUBLE_EQ(Model(ZeroPlusPlus{}, 1, 8).total.inter_node, 5.25e9);
}

TEST(PlannerZeroPlusPlus, QuantizedWeightsHalveBothGathers) {
  ZeroPlusPlus z;
  z.quantized_weights = true;
  const Stage3Comm c = Model(z);
  // 7/8 x 1e9 x 1.0009765625 = 875854492.1875, 1/4 inter-node.
  EXPECT_DOUBLE_EQ(c.param_gather_forward.Total(), 875854492.1875);
  EXPECT_DOUBLE_EQ(c.param_gather_forward.inter_node, 218963623.046875);
  EXPECT_DOUBLE_EQ(c.param_gather_backward.Total(), 875854492.1875);  // no hpZ: global again
  EXPECT_DOUBLE_EQ(c.grad_reduce_scatter.Total(), 1.75e9);            // untouched
}

TEST(PlannerZeroPlusPlus, HpzKeepsBackwardGatherInTheNode) {
  ZeroPlusPlus z;
  z.hpz_partition_size = 4;
  const Stage3Comm c = Model(z);
  EXPECT_DOUBLE_EQ(c.param_gather_forward.Total(), 1.75e9);  // 16-bit global
  // Within 4 ranks of one node: 3/4 x 2 x 1e9 = 1.5e9, all intra-node.
  EXPECT_DOUBLE_EQ(c.param_gather_backward.intra_node, 1.5e9);
  EXPECT_DOUBLE_EQ(c.param_gather_backward.inter_node, 0);
  EXPECT_DOUBLE_EQ(c.hpz_secondary_bytes_per_gpu, 5e8);  // 2 B x 1e9 / 4
  // k = 8 spans both nodes: 7/8 x 2e9, 1/4 of it inter-node.
  z.hpz_partition_size = 8;
  EXPECT_DOUBLE_EQ(Model(z).param_gather_backward.inter_node, 0.4375e9);
  // k = 2 within a node: 1/2 x 2e9.
  z.hpz_partition_size = 2;
  EXPECT_DOUBLE_EQ(Model(z).param_gather_backward.intra_node, 1e9);
  EXPECT_DOUBLE_EQ(Model(z).hpz_secondary_bytes_per_gpu, 1e9);
}

TEST(PlannerZeroPlusPlus, QuantizedGradientsHierarchical) {
  ZeroPlusPlus z;
  z.quantized_gradients = true;
  const Stage3Comm c = Model(z);
  // Intra: 3/4 x 1e9 x 1.0009765625; inter: (2-1)/2 x (1e9 / 4) x 1.0009765625.
  EXPECT_DOUBLE_EQ(c.grad_reduce_scatter.intra_node, 750732421.875);
  EXPECT_DOUBLE_EQ(c.grad_reduce_scatter.inter_node, 125122070.3125);
  // One node: the second all-to-all has one rank, moves nothing.
  EXPECT_DOUBLE_EQ(Model(z, 8, 1).grad_reduce_scatter.inter_node, 0);
  EXPECT_DOUBLE_EQ(Model(z, 8, 1).grad_reduce_scatter.intra_node, 7.0 / 8 * 1e9 * kInt8);
}

TEST(PlannerZeroPlusPlus, AllThreeCutInterNodeBytesBelowAThird) {
  ZeroPlusPlus z;
  z.quantized_weights = z.quantized_gradients = true;
  z.hpz_partition_size = 4;
  const Stage3Comm c = Model(z);
  // Inter-node: fwd 218963623.046875 + bwd 0 + grads 125122070.3125 = 344085693.359375,
  // against plain 1.3125e9: 0.2622x.
  EXPECT_DOUBLE_EQ(c.total.inter_node, 344085693.359375);
  EXPECT_NEAR(c.total.inter_node / 1.3125e9, 0.26216, 1e-5);
  // Total: 875854492.1875 + 1.5e9 + 875854492.1875 (= 750732421.875 + 125122070.3125).
  EXPECT_DOUBLE_EQ(c.total.Total(), 875854492.1875 * 2 + 1.5e9);
}

TEST(PlannerZeroPlusPlus, PlacementCarriesCommAndHpzCopy) {
  PlanInput in = Case();
  in.zero.zero_plus_plus.quantized_weights = true;
  in.zero.zero_plus_plus.quantized_gradients = true;
  in.zero.zero_plus_plus.hpz_partition_size = 4;
  const Placement plain = Place(Case(), 3, D::kNone, D::kNone);
  const Placement p = Place(in, 3, D::kNone, D::kNone);
  // DDP: 2 x 7/8 x 2 B x 1e9 = 3.5e9, 1/4 inter-node.
  EXPECT_DOUBLE_EQ(p.comm.ddp_bytes_per_rank, 3.5e9);
  EXPECT_DOUBLE_EQ(p.comm.ddp_inter_node_bytes_per_rank, 0.875e9);
  EXPECT_DOUBLE_EQ(plain.comm.ratio, 1.5);
  EXPECT_DOUBLE_EQ(p.comm.bytes_per_rank, 875854492.1875 * 2 + 1.5e9);
  EXPECT_DOUBLE_EQ(p.comm.ratio, (875854492.1875 * 2 + 1.5e9) / 3.5e9);
  EXPECT_DOUBLE_EQ(p.comm.split.inter_node, 344085693.359375);
  EXPECT_TRUE(p.comm.zero_plus_plus);
  EXPECT_FALSE(plain.comm.zero_plus_plus);
  // The hpZ copy is one more HBM item at stage 3: 2 B x 1e9 / 4.
  EXPECT_DOUBLE_EQ(p.hbm_bytes_per_gpu - plain.hbm_bytes_per_gpu, 5e8);
  // Below stage 3 nothing changes but a note, when that stage is the configured one.
  EXPECT_TRUE(Place(in, 2, D::kNone, D::kNone).notes.empty());
  in.zero.stage = 2;
  in.has_configured = true;
  const Placement s2 = Place(in, 2, D::kNone, D::kNone);
  EXPECT_DOUBLE_EQ(s2.hbm_bytes_per_gpu, Place(Case(), 2, D::kNone, D::kNone).hbm_bytes_per_gpu);
  EXPECT_DOUBLE_EQ(s2.comm.bytes_per_rank, 3.5e9);  // (2 + 2) x 7/8 x 1e9
  bool noted = false;
  for (const std::string& n : s2.notes) noted |= n.find("stage 3 only") != std::string::npos;
  EXPECT_TRUE(noted);
}

TEST(PlannerZeroPlusPlus, OneRankRatioIsTheTwoRankOne) {
  PlanInput in = Case();
  in.capacity.gpus_per_node = 1;
  in.capacity.nodes = 1;
  in.zero.zero_plus_plus.quantized_weights = true;
  const Placement p = Place(in, 3, D::kNone, D::kNone);
  EXPECT_DOUBLE_EQ(p.comm.bytes_per_rank, 0);
  // Two ranks: (1/2)(2 x 1.0009765625 + 2) / ((1/2) x 4).
  EXPECT_DOUBLE_EQ(p.comm.ratio, (2 * kInt8 + 2) / 4);
}

TEST(PlannerZeroPlusPlus, ValidationNamesTheKey) {
  PlanInput in = Case();
  in.zero.zero_plus_plus.hpz_partition_size = 3;  // does not divide N = 8
  Status s = ValidatePlanInput(in);
  EXPECT_TRUE(s.IsInvalidArgument());
  EXPECT_NE(s.ToString().find("zero_optimization.zero_hpz_partition_size"), std::string::npos);
  EXPECT_NE(s.ToString().find("world size 8"), std::string::npos) << s.ToString();
  // Divides N = 12 but straddles nodes of 4 partially.
  in.capacity.nodes = 3;
  in.zero.zero_plus_plus.hpz_partition_size = 6;
  s = ValidatePlanInput(in);
  EXPECT_TRUE(s.IsInvalidArgument());
  EXPECT_NE(s.ToString().find("gpus_per_node"), std::string::npos) << s.ToString();
  in.zero.zero_plus_plus.hpz_partition_size = 12;  // three whole nodes
  EXPECT_TRUE(ValidatePlanInput(in).ok());
  in.zero.zero_plus_plus.hpz_partition_size = 0;  // DeepSpeed's range allows 0: off
  EXPECT_TRUE(ValidatePlanInput(in).ok());
  EXPECT_FALSE(MakePlan(in)->stages[3].comm.zero_plus_plus);
}

TEST(PlannerZeroPlusPlus, ConfigKeysMapped) {
  auto parsed = ParseDeepSpeedConfig(R"({"train_micro_batch_size_per_gpu": 1,
    "bf16": {"enabled": true},
    "zero_optimization": {"stage": 3, "zero_quantized_weights": true,
                          "zero_quantized_gradients": true, "zero_hpz_partition_size": 4}})");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  PlanInput in = Case();
  std::vector<std::string> notes;
  ApplyEngineConfig(parsed->config, &in, &notes);
  const ZeroPlusPlus& z = in.zero.zero_plus_plus;
  EXPECT_TRUE(z.quantized_weights);
  EXPECT_TRUE(z.quantized_gradients);
  EXPECT_EQ(z.hpz_partition_size, 4);
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(plan->configured.has_value());
  EXPECT_DOUBLE_EQ(plan->configured->comm.split.inter_node, 344085693.359375);
}

}  // namespace
}  // namespace strata
