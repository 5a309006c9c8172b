// Planner tests: the ZeRO ledger, every offload combination, and the recommendation order,
// each against values computed by hand in the comments (GB = 1e9 bytes).
//
// The reference case: Ψ = 7e9 params, 1 node x 8 GPUs (N = 8), recipe bf16-adam
// (p = 2, g = 2, o = master 4 + m 4 + v 4 = 12), DeepSpeed defaults for every bucket:
// reduce = allgather = 5e8, prefetch 5e7, max_live 1e9, sub_group 1e9, max_in_cpu 1e9,
// param buffers 5 x 1e8, optimizer buffer_count 4, overlap_comm unset (true only at stage 3).
// Shard per rank: Ψ/N = 8.75e8 params.
// Memory items follow the engine's rules (sched/placement.h): the gradient shard held for the
// optimizer is fp32 (4 B, accumulated there) whatever the recipe's g (the reduction on the wire,
// the gradient buffers, PCIe); the NVMe swap buffers are (buffer_count + 1) x 4 fp32 blocks of a
// sub-group in whole 4 KiB pages; params on NVMe get buffer_count shard buffers and no DRAM
// cache. The device working set is the engine's (sched::DeviceWorkingSet), per group, not
// DeepSpeed's buckets; the largest group is not given here, so it is taken as reduce_bucket_size
// (5e8; shard 5e8 / 8 = 6.25e7): gradient buffers (group + shard) x 2 B = 1.125 GB, x3 with
// overlap_comm = 3.375 GB; from stage 1 on 8 ranks the fp32 read-back of a group (2 GB) counts
// beyond them (+0.875 GB without overlap). Stage 3 (sched::Stage3Peak): 14 groups, of which the
// reuse distance 1e9 keeps 1e9 / (2 x 5e8) + 1 = 2 across the turn of the trace: 2 gathered
// groups x 5e8 x 2 B = 2 GB (max_live's cap, 1e9 + 2 groups, would say 4), and with params off
// the GPU 2 shards x 6.25e7 x 2 B = 0.25 GB. The norm exchange is 16 B per rank (kExchange).
// The optimizer on the GPU adds its gradient-statistics scratch (kScratch), and with params off
// the GPU the param shards it writes, one per pipeline buffer (4 x 6.25e7 x 2 B = 0.5 GB).
// Host: what the DRAM capacity (1024 GB, the engines' budgets) leaves beyond the working set
// caches NVMe-homed blocks, up to their bytes beyond the swap buffers (sched::HostCacheBytes).
// (The ledger, LedgerBytesPerGpu, stays the ZeRO paper's.)
#include "strata/planner.h"

#include <gtest/gtest.h>

#include <limits>

namespace strata {
namespace {

using D = OffloadDevice;
constexpr double kExchange = 8 * 16;  // the norm exchange: 16 B per rank
// The device optimizer's gradient statistics: a slot per sub-group the rank steps,
// 8 x (ceil(elements / 4096) + 2 x sub-groups) B (sched::DeviceWorkingSet): at stages 1-3 the
// rank's 8.75e8 elements (213624 chunks) in 14 sub-groups (one per group's shard); at stage 0
// (the optimizer not partitioned) the layout's 8 copies of them, 7e9 elements (1708985 chunks)
// in 112 (an upper bound: a rank sums its own partition's).
constexpr double kScratch = 8 * (213624 + 2 * 14);
constexpr double kScratch0 = 8 * (1708985 + 2 * 112);

// The placements below leave out the speculative step's rollback copies (a host item of their
// own: PlannerPlace.SpeculativeStepCopies).
PlanInput Ref() {
  PlanInput in;
  in.params = 7e9;
  in.zero.speculative_step = false;  // the key given false
  in.zero.speculative_step_given = true;
  return in;
}

// Sum of the items on one tier whose name contains `what`.
double ItemBytes(const Placement& p, Tier tier, std::string_view what) {
  double sum = 0;
  for (const PlanItem& it : p.items) {
    if (it.tier == tier && it.name.find(what) != std::string::npos) sum += it.bytes;
  }
  return sum;
}

TEST(PlannerLedger, SevenBillionOnEightGpus) {
  const Recipe r;  // default bf16-adam
  EXPECT_DOUBLE_EQ(r.TotalBytes(), 16);
  // 16 x 7 = 112; 4 x 7 + 12 x 7 / 8 = 28 + 10.5; 2 x 7 + 14 x 7 / 8 = 14 + 12.25; 16 x 7 / 8.
  EXPECT_DOUBLE_EQ(LedgerBytesPerGpu(r, 0, 7e9, 8), 112e9);
  EXPECT_DOUBLE_EQ(LedgerBytesPerGpu(r, 1, 7e9, 8), 38.5e9);
  EXPECT_DOUBLE_EQ(LedgerBytesPerGpu(r, 2, 7e9, 8), 26.25e9);
  EXPECT_DOUBLE_EQ(LedgerBytesPerGpu(r, 3, 7e9, 8), 14e9);
  auto plan = MakePlan(Ref());
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_DOUBLE_EQ(plan->ledger_bytes_per_gpu[0], 112e9);
  EXPECT_DOUBLE_EQ(plan->ledger_bytes_per_gpu[3], 14e9);
}

TEST(PlannerLedger, OtherRecipes) {
  auto fp32g = ParseRecipe("fp32-grads");  // 2 + 4 + 12 = 18
  ASSERT_TRUE(fp32g.ok());
  EXPECT_DOUBLE_EQ(fp32g->TotalBytes(), 18);
  // stage 1: (2+4) x 7 + 12 x 7 / 8 = 42 + 10.5; stage 2: 2 x 7 + 16 x 7 / 8 = 14 + 14.
  EXPECT_DOUBLE_EQ(LedgerBytesPerGpu(*fp32g, 1, 7e9, 8), 52.5e9);
  EXPECT_DOUBLE_EQ(LedgerBytesPerGpu(*fp32g, 2, 7e9, 8), 28e9);
  auto a8 = ParseRecipe("adam8bit");  // 2 + 2 + 4 + 1 + 1 = 10; stage 3: 10 x 7 / 8 = 8.75
  ASSERT_TRUE(a8.ok());
  EXPECT_DOUBLE_EQ(LedgerBytesPerGpu(*a8, 3, 7e9, 8), 8.75e9);
  auto nm = ParseRecipe("no-master");  // 2 + 2 + 0 + 4 + 4 = 12; stage 0: 84
  ASSERT_TRUE(nm.ok());
  EXPECT_DOUBLE_EQ(LedgerBytesPerGpu(*nm, 0, 7e9, 8), 84e9);
  auto custom = ParseRecipe("2:2:4:2:2");  // 12; stage 2: 2 x 7 + 10 x 7 / 8 = 14 + 8.75
  ASSERT_TRUE(custom.ok()) << custom.status().ToString();
  EXPECT_DOUBLE_EQ(LedgerBytesPerGpu(*custom, 2, 7e9, 8), 22.75e9);
  // One rank: every stage is the full 16 bytes per parameter.
  for (int s = 0; s < 4; ++s) EXPECT_DOUBLE_EQ(LedgerBytesPerGpu(Recipe{}, s, 1e9, 1), 16e9);
}

TEST(PlannerLedger, RecipeAndCountParsingErrors) {
  EXPECT_TRUE(ParseRecipe("bogus").status().IsInvalidArgument());
  EXPECT_NE(ParseRecipe("bogus").status().message().find("bf16-adam"), std::string_view::npos);
  EXPECT_TRUE(ParseRecipe("2:2:4:4").status().IsInvalidArgument());
  EXPECT_TRUE(ParseRecipe("2:2:4:4:4:4").status().IsInvalidArgument());
  EXPECT_TRUE(ParseRecipe("2:-2:4:4:4").status().IsInvalidArgument());
  EXPECT_TRUE(ParseRecipe("2:x:4:4:4").status().IsInvalidArgument());
  EXPECT_TRUE(ParseRecipe("0:0:0:0:0").status().IsInvalidArgument());
  EXPECT_DOUBLE_EQ(*ParseParamCount("7e9"), 7e9);
  EXPECT_DOUBLE_EQ(*ParseParamCount("7B"), 7e9);
  EXPECT_DOUBLE_EQ(*ParseParamCount("1.5T"), 1.5e12);
  EXPECT_DOUBLE_EQ(*ParseParamCount("350M"), 350e6);
  EXPECT_DOUBLE_EQ(*ParseParamCount("125k"), 125e3);
  EXPECT_DOUBLE_EQ(*ParseParamCount("7000000000"), 7e9);
  for (const char* bad : {"", "B", "7X", "-7B", "0", "abc", "7BB", "nan", "inf"}) {
    EXPECT_TRUE(ParseParamCount(bad).status().IsInvalidArgument()) << bad;
  }
}

TEST(PlannerParse, ParamCountMustBeAWholeNumberAfterTheSuffix) {
  EXPECT_DOUBLE_EQ(*ParseParamCount("7.5B"), 7.5e9);
  EXPECT_DOUBLE_EQ(*ParseParamCount("1.1B"), 1.1e9);
  EXPECT_DOUBLE_EQ(*ParseParamCount("0.5k"), 500);
  EXPECT_DOUBLE_EQ(*ParseParamCount("1"), 1);
  for (const char* bad : {"7.5", "0.5", "1.0000001k", "2.5e0", "0.0001k"}) {
    const auto r = ParseParamCount(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().ToString().find("whole number"), std::string::npos)
        << r.status().ToString();
  }
}

TEST(PlannerPlace, NoOffloadEachStage) {
  const PlanInput in = Ref();
  // Stage 0: 112 + fp32 grads 2 x 7 = 126 + gradient buffers 1.125 (overlap off) = 127.125 GB
  // (no read-back: the optimizer is not partitioned).
  EXPECT_DOUBLE_EQ(Place(in, 0, D::kNone, D::kNone).hbm_bytes_per_gpu,
                   127.125e9 + kExchange + kScratch0);
  // Stage 1: what stage 2 holds, 30 GB: params 14 + optimizer shard 10.5 + the fp32 grad shard
  // 3.5 (the engine keeps the reduced shard the optimizer steps; full gradients exist only in
  // the gradient buffers) + 1.125 + read-back 0.875.
  EXPECT_DOUBLE_EQ(Place(in, 1, D::kNone, D::kNone).hbm_bytes_per_gpu,
                   30e9 + kExchange + kScratch);
  // Stage 2: 26.25 + 1.75 (fp32 grad shard) + 1.125 + 0.875 = 30 GB.
  EXPECT_DOUBLE_EQ(Place(in, 2, D::kNone, D::kNone).hbm_bytes_per_gpu, 30e9 + kExchange + kScratch);
  // Stage 3: 14 + 1.75 (fp32 grad shard) + gradient buffers 3.375 (overlap on by default)
  //          + gathered 2 -> 21.125 GB.
  const Placement s3 = Place(in, 3, D::kNone, D::kNone);
  EXPECT_DOUBLE_EQ(s3.hbm_bytes_per_gpu, 21.125e9 + kExchange + kScratch);
  EXPECT_DOUBLE_EQ(ItemBytes(s3, Tier::kDevice, "gathered"), 2e9);
  EXPECT_DOUBLE_EQ(ItemBytes(s3, Tier::kDevice, "bucket"), 0);  // DeepSpeed's: not allocated
  EXPECT_DOUBLE_EQ(s3.host_bytes_per_node, 0);
  EXPECT_DOUBLE_EQ(s3.nvme_bytes_per_node, 0);
  EXPECT_DOUBLE_EQ(s3.pcie_bytes_per_gpu, 0);
}

// ZeRO-Offload on one GPU with one micro-step: the engine keeps the gradient the CPU Adam reads in
// bf16 (sched::GradStateDType), 2 B/param on the host instead of 4; with gradient accumulation or
// a second rank it is accumulated, in fp32. NVMe-homed gradients follow the same rule.
TEST(PlannerPlace, OneRankOneMicroStepKeepsOffloadedGradientsIn16Bits) {
  PlanInput in = Ref();
  in.capacity.gpus_per_node = 1;
  Placement p = Place(in, 3, D::kCpu, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, "grads (16-bit"), 2 * 7e9);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, "grads (fp32)"), 0);
  p = Place(in, 3, D::kNvme, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kNvme, "grads (16-bit"), 2 * 7e9);
  in.zero.gradient_accumulation_steps = 2;
  p = Place(in, 3, D::kCpu, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, "grads (fp32)"), 4 * 7e9);
  in.zero.gradient_accumulation_steps = 1;
  in.capacity.gpus_per_node = 2;
  p = Place(in, 3, D::kCpu, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, "grads (fp32)"), 2 * 4 * 7e9 / 2);
  // Not offloaded: on the device, in fp32 for its kernels.
  in.capacity.gpus_per_node = 1;
  p = Place(in, 3, D::kNone, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kDevice, "grads (fp32)"), 4 * 7e9);
}

// A LoRA fine-tune: 7B frozen at 2 B/param, only the adapters' 40M at 16 B (master, m, v, fp32
// grad) on 8 GPUs, stage 3 with the optimizer and the params on cpu.
TEST(PlannerPlace, FrozenParamsCostTheirWorkingParamsOnly) {
  PlanInput in = Ref();
  in.params = 7.04e9;
  in.trainable_params = 4e7;
  const Placement p = Place(in, 3, D::kCpu, D::kCpu);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, "params, 1/N shard"), 8 * 2 * 7.04e9 / 8);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, "optimizer state"), 8 * 12 * 4e7 / 8);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, "grads (fp32)"), 8 * 4 * 4e7 / 8);
  // Gradient buffers for the largest trainable group only: 3 x (4e7 + 4e7 / 8) x 2 bytes, not
  // the 5e8-element group (reduce_bucket_size) the frozen layers are counted in.
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kDevice, "gradient buffers, 3 x"), 3 * (4e7 + 5e6) * 2);
  // All trainable: the same params, 176 times the optimizer state.
  in.trainable_params = 0;
  const Placement all = Place(in, 3, D::kCpu, D::kCpu);
  EXPECT_DOUBLE_EQ(ItemBytes(all, Tier::kHost, "optimizer state"), 8 * 12 * 7.04e9 / 8);
  in.trainable_params = 8e9;
  EXPECT_EQ(ValidatePlanInput(in).code(), Status::Code::kInvalidArgument);
}

// A LoRA fine-tune's collectives: the trainable 20M are reduced (by DDP too) and, below stage 3,
// gathered after the step; stage 3 gathers all 7B twice. The fp32 read-back (stage 1-2, several
// ranks) is of a trained group: the largest trainable, not the 5e8-element frozen one.
TEST(PlannerComm, FrozenParamsAreNeitherReducedNorGatheredAfterTheStep) {
  PlanInput in = Ref();  // 7e9 params, 8 GPUs, 2-byte params and grads
  in.trainable_params = 2e7;
  // DDP: 2 x (7/8) x 2 B x 2e7 = 70 MB; stages 0-2 the same (stage 1-2: (7/8) x (2 + 2) x 2e7).
  for (int s = 0; s < 3; ++s) {
    const Placement p = Place(in, s, D::kNone, D::kNone);
    EXPECT_DOUBLE_EQ(p.comm.ddp_bytes_per_rank, 7e7) << s;
    EXPECT_DOUBLE_EQ(p.comm.bytes_per_rank, 7e7) << s;
  }
  // Stage 3: (7/8) x (2 x 2 B x 7e9 + 2 B x 2e7) = 24.535 GB.
  const Placement s3 = Place(in, 3, D::kNone, D::kNone);
  EXPECT_DOUBLE_EQ(s3.comm.bytes_per_rank, 0.875 * (4 * 7e9 + 2 * 2e7));
  // fp32 read-back at stage 1: 4 B x 2e7 beyond the gradient buffers (2e7 + 2.5e6) x 2 B
  // (overlap_comm off below stage 3).
  const Placement s1 = Place(in, 1, D::kNone, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(s1, Tier::kDevice, "fp32 read-back"), 4 * 2e7 - 2.25e7 * 2);
}

TEST(PlannerPlace, WorkingSetFollowsOverlapAndLargestGroup) {
  PlanInput in = Ref();
  in.zero.overlap_comm = true;
  // Stage 2 with overlap_comm: 26.25 + 1.75 (fp32 grad shard) + 3 x 1.125 (more than the
  // 2 GB read-back) = 31.375 GB. (DeepSpeed's 4.5 x buckets would say 37.)
  EXPECT_DOUBLE_EQ(Place(in, 2, D::kNone, D::kNone).hbm_bytes_per_gpu,
                   31.375e9 + kExchange + kScratch);
  in.zero.overlap_comm = false;
  in.largest_group_params = 1.2e9;
  // Stage 3, overlap off, group 1.2e9 (shard 1.5e8): 15.75 + gradient buffers 1.35e9 x 2 = 2.7
  // + read-back 4.8 - 2.7 = 2.1 + gathered: 6 groups, the reuse distance keeps 1e9 / 2.4e9 + 1 =
  // 1, at least two held: 2 x 1.2e9 x 2 = 4.8 -> 25.35. Statistics: the rank's 8.75e8
  // elements in 6 sub-groups (shards of the 6 groups).
  const double scratch = 8 * (213624 + 2 * 6);
  EXPECT_DOUBLE_EQ(Place(in, 3, D::kNone, D::kNone).hbm_bytes_per_gpu,
                   25.35e9 + kExchange + scratch);
  in.activation_bytes_per_gpu = 20e9;  // added as given: 45.35 GB
  EXPECT_DOUBLE_EQ(Place(in, 3, D::kNone, D::kNone).hbm_bytes_per_gpu,
                   45.35e9 + kExchange + scratch);
  // A tiny model: the group and the gathered set never exceed the model (1e6 params):
  // 18e6 / 8 = 2.25e6 + gradient buffers (1e6 + 1.25e5) x 2 = 2.25e6 + read-back 4e6 - 2.25e6
  // = 1.75e6 + gathered 1e6 x 2 = 8.25e6 (overlap off), + 20 GB activations, + the statistics
  // slot of the rank's one 1.25e5 sub-group (31 chunks + 2).
  in.params = 1e6;
  in.largest_group_params = 0;
  EXPECT_DOUBLE_EQ(Place(in, 3, D::kNone, D::kNone).hbm_bytes_per_gpu,
                   8.25e6 + kExchange + 20e9 + 8 * (31 + 2));
}

// The working set is counted in 64-bit integers: a model of 1e15 params with settings as large
// neither overflows nor loses its figure (gathered: min(1e15, 1e15 + 2e15) x 2 B).
TEST(PlannerPlace, HugeModelsDoNotOverflowTheWorkingSet) {
  PlanInput in = Ref();
  in.params = 1e15;
  in.largest_group_params = 1e15;
  in.zero.max_live_parameters = 1e15;
  in.zero.overlap_comm = true;
  const Placement p = Place(in, 3, D::kCpu, D::kCpu);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kDevice, "gathered"), 2e15);
  // Gradient buffers 3 x (1e15 + 1.25e14) x 2 B.
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kDevice, "gradient buffers"), 6.75e15);
}

TEST(PlannerPlace, Stage3OptimizerCpu) {
  const Placement p = Place(Ref(), 3, D::kCpu, D::kNone);
  // HBM: param shard 2 x 8.75e8 = 1.75 + gradient buffers 3.375 + gathered 2 = 7.125 GB (grads
  // and optimizer state left the GPU).
  EXPECT_DOUBLE_EQ(p.hbm_bytes_per_gpu, 7.125e9 + kExchange);
  // Host per node: 8 GPUs x (12 + 4) B x 8.75e8 = 84 + 28 = 112 GB; not pinned by default.
  EXPECT_DOUBLE_EQ(p.host_bytes_per_node, 112e9);
  EXPECT_DOUBLE_EQ(p.host_pinned_bytes_per_node, 0);
  EXPECT_DOUBLE_EQ(p.nvme_bytes_per_node, 0);
  // PCIe per GPU: grad shard down 1.75 + updated param shard up 1.75 = 3.5 GB.
  EXPECT_DOUBLE_EQ(p.pcie_bytes_per_gpu, 3.5e9);
  EXPECT_DOUBLE_EQ(p.nvme_io_bytes_per_node, 0);
}

// offload_optimizer.speculative_step's rollback copies (sched::SpeculationBufferBytes): by
// default a quarter of a rank's optimizer elements at 12 + 2 bytes (8 x 8.75e8 / 4 x 14 = 24.5
// GB per node), speculation_buffer_size elements when given, none without an offloaded optimizer,
// and never more than the host capacity leaves.
TEST(PlannerPlace, SpeculativeStepCopies) {
  PlanInput in = Ref();
  in.zero.speculative_step = true;
  const std::string item = "speculative step rollback copies";
  Placement p = Place(in, 3, D::kCpu, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, item), 24.5e9);
  EXPECT_DOUBLE_EQ(p.host_bytes_per_node, 112e9 + 24.5e9);
  in.zero.speculation_buffer_size = 1e8;
  p = Place(in, 3, D::kNvme, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, item), 8 * 1e8 * 14);
  EXPECT_DOUBLE_EQ(ItemBytes(Place(in, 3, D::kNone, D::kNone), Tier::kHost, item), 0);
  in.zero.speculation_buffer_size = -1;
  in.capacity.dram_bytes_per_node = 120e9;  // 8 GB left beside the 112 GB of states
  EXPECT_DOUBLE_EQ(ItemBytes(Place(in, 3, D::kCpu, D::kNone), Tier::kHost, item), 8e9);
}

// The key unset, a small model whose NVMe-homed optimizer state fits the room the copies would
// take (sched::SpeculationRoomCaches): no copies; the host cache holds all of it. 1e7 params on 8
// GPUs in sub-groups of 1e5: 1.5e7 B of fp32 state per rank, 5 x 4 x 4e5 B of it in the swap
// buffers, the rest under the 256 MiB floor. The key given: the copies (1.25e6 elements x 14 B
// per rank, all of them).
TEST(PlannerPlace, SpeculationRoomCachesASmallModelsNvmeState) {
  PlanInput in = Ref();
  in.params = 1e7;
  in.largest_group_params = 1e6;
  in.zero.sub_group_size = 1e5;
  in.zero.speculative_step = true;
  in.zero.speculative_step_given = false;
  const std::string item = "speculative step rollback copies";
  Placement p = Place(in, 3, D::kNvme, D::kNone);
  const double nvme = ItemBytes(p, Tier::kNvme, "");
  const double swap = ItemBytes(p, Tier::kHost, "swap buffers");
  ASSERT_GT(nvme, swap);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, item), 0);
  EXPECT_NEAR(p.host_cache_bytes_per_node, nvme - swap, 8);
  EXPECT_DOUBLE_EQ(p.nvme_io_bytes_per_node, 0);  // the engine writes none of it home
  // overlap_step (the speculation off unless asked for): the same memory, so the same cache.
  in.zero.speculative_step = false;
  EXPECT_NEAR(Place(in, 3, D::kNvme, D::kNone).host_cache_bytes_per_node, nvme - swap, 8);
  in.zero.speculative_step = true;
  in.zero.speculative_step_given = true;
  p = Place(in, 3, D::kNvme, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, item), 8 * 1.25e6 * 14);
  // Beside the copies the 1024 GB still cache all of it: no IO either.
  EXPECT_DOUBLE_EQ(p.nvme_io_bytes_per_node, 0);
  // The optimizer on cpu: nothing NVMe-homed to cache; the copies as before.
  in.zero.speculative_step_given = false;
  EXPECT_DOUBLE_EQ(ItemBytes(Place(in, 3, D::kCpu, D::kNone), Tier::kHost, item), 8 * 1.25e6 * 14);
}

TEST(PlannerPlace, Stage3OptimizerCpuParamCpuPinned) {
  PlanInput in = Ref();
  in.zero.optimizer_pin_memory = true;
  in.zero.param_pin_memory = true;
  const Placement p = Place(in, 3, D::kCpu, D::kCpu);
  // HBM: gradient buffers 3.375 + gathered 2 + param shards 0.25 = 5.625 GB. Host: 112 + params
  // 8 x 2 x 8.75e8 = 14 -> 126 GB, all of it pinned (nothing on NVMe: no cache).
  EXPECT_DOUBLE_EQ(p.hbm_bytes_per_gpu, 5.625e9 + kExchange);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kDevice, "param shards on the device"), 0.25e9);
  EXPECT_DOUBLE_EQ(p.host_cache_bytes_per_node, 0);
  EXPECT_DOUBLE_EQ(p.host_bytes_per_node, 126e9);
  EXPECT_DOUBLE_EQ(p.host_pinned_bytes_per_node, 126e9);
  // PCIe: grads down 1.75 + forward and backward shard up 2 x 1.75 = 5.25 GB.
  EXPECT_DOUBLE_EQ(p.pcie_bytes_per_gpu, 5.25e9);
}

TEST(PlannerPlace, Stage3ParamOffloadOnly) {
  const Placement cpu = Place(Ref(), 3, D::kNone, D::kCpu);
  // HBM: fp32 grads shard 3.5 + optimizer shard 12 x 8.75e8 = 10.5 + gradient buffers 3.375
  // + gathered 2 + param shards 0.25 + the shards the device optimizer writes 0.5 = 20.125.
  EXPECT_DOUBLE_EQ(cpu.hbm_bytes_per_gpu, 20.125e9 + kExchange + kScratch);
  EXPECT_DOUBLE_EQ(ItemBytes(cpu, Tier::kDevice, "device optimizer writes"), 0.5e9);
  EXPECT_DOUBLE_EQ(cpu.host_bytes_per_node, 14e9);
  // PCIe: shard up twice 3.5 + updated shard down 1.75 = 5.25 GB.
  EXPECT_DOUBLE_EQ(cpu.pcie_bytes_per_gpu, 5.25e9);

  const Placement nvme = Place(Ref(), 3, D::kNone, D::kNvme);
  EXPECT_DOUBLE_EQ(nvme.hbm_bytes_per_gpu, 20.125e9 + kExchange + kScratch);
  // Host: swap buffers 8 x 5 x (1e8 x 2 B, in 4 KiB pages: 200003584) = 8.0001 GB, and the
  // 1024 GB leave room to cache the rest of the 14 GB of params: 14 GB in all.
  EXPECT_DOUBLE_EQ(ItemBytes(nvme, Tier::kHost, "swap buffers"), 8.0 * 5 * 200003584);
  EXPECT_DOUBLE_EQ(nvme.host_cache_bytes_per_node, 14e9 - 8.0 * 5 * 200003584);
  EXPECT_DOUBLE_EQ(nvme.host_bytes_per_node, 14e9);
  EXPECT_DOUBLE_EQ(nvme.host_pinned_bytes_per_node, 14e9);
  // NVMe: 8 x 2 x 8.75e8 = 14 GB, all of it cached: after the first step no IO (the engine's
  // nvme_state_cached). Where the host caches only part (10 GB: 2 GB beside the buffers), each
  // step reads the params for forward and backward and writes them once: 3 x 1.75 x 8 = 42 GB.
  EXPECT_DOUBLE_EQ(nvme.nvme_bytes_per_node, 14e9);
  EXPECT_DOUBLE_EQ(nvme.nvme_io_bytes_per_node, 0);
  PlanInput tight = Ref();
  tight.capacity.dram_bytes_per_node = 10e9;
  const Placement paged = Place(tight, 3, D::kNone, D::kNvme);
  EXPECT_GT(paged.host_cache_bytes_per_node, 0);
  EXPECT_DOUBLE_EQ(paged.nvme_io_bytes_per_node, 42e9);
}

TEST(PlannerPlace, Stage3OptimizerNvme) {
  PlanInput in = Ref();
  const Placement p = Place(in, 3, D::kNvme, D::kNone);
  EXPECT_DOUBLE_EQ(p.hbm_bytes_per_gpu, 7.125e9 + kExchange);
  // Host: swap buffers 8 x (4 + 1) x 4 x 6.25e7 (a group of reduce_bucket_size 5e8 split over 8
  // ranks; sub_group_size 1e9 is larger) x 4 B (in 4 KiB pages: 250003456) = 40.0006 GB, and the
  // rest of the 112 GB on NVMe cached: no IO. 5 GB of buffers per rank < 10.5 GB of state.
  const double buffers = 8.0 * 5 * 4 * 250003456;
  EXPECT_DOUBLE_EQ(p.host_bytes_per_node, 112e9);
  EXPECT_DOUBLE_EQ(p.host_cache_bytes_per_node, 112e9 - buffers);
  EXPECT_DOUBLE_EQ(p.nvme_io_bytes_per_node, 0);
  EXPECT_TRUE(p.notes.empty()) << p.notes[0];
  // NVMe: optimizer 8 x 12 x 8.75e8 = 84 + fp32 grads 8 x 4 x 8.75e8 = 28 -> 112 GB.
  EXPECT_DOUBLE_EQ(p.nvme_bytes_per_node, 112e9);
  // No room for a cache (DRAM holds the buffers only). IO per rank: read+write optimizer
  // 2 x 10.5 = 21 + grads written and read 2 x 1 x 3.5 = 7 -> 28 GB; x 8 = 224 GB per node; at
  // 6 GB/s: 224/6 s; in a 10 s step: 22.4 GB/s.
  PlanInput bare = in;
  bare.capacity.dram_bytes_per_node = buffers;
  const Placement b = Place(bare, 3, D::kNvme, D::kNone);
  EXPECT_DOUBLE_EQ(b.host_cache_bytes_per_node, 0);
  EXPECT_DOUBLE_EQ(b.nvme_io_bytes_per_node, 224e9);
  EXPECT_DOUBLE_EQ(b.nvme_io_seconds, 224.0 / 6.0);
  EXPECT_DOUBLE_EQ(b.nvme_required_bytes_per_s, 22.4e9);
  // A model whose largest group is the whole model (--largest-group 7e9): one sub-group of
  // min(1e9, 8.75e8) per rank, its buffers 1 x 4 x 8.75e8 x 4 B = 14 GB >= 10.5 GB of state:
  // noted, naming sub_group_size.
  PlanInput whole = in;
  whole.largest_group_params = 7e9;
  const Placement w = Place(whole, 3, D::kNvme, D::kNone);
  ASSERT_EQ(w.notes.size(), 1u);
  EXPECT_NE(w.notes[0].find("sub_group_size"), std::string::npos);

  in.zero.sub_group_size = 1e8;
  in.zero.gradient_accumulation_steps = 4;
  const Placement q = Place(in, 3, D::kNvme, D::kCpu);
  EXPECT_TRUE(q.notes.empty());  // 5 x 4 x 6.25e7 x 4 B = 5 GB < 10.5 GB per rank
  // HBM 5.625. Host: buffers 40.0006 (the group's shard 6.25e7 < sub_group_size 1e8) + params
  // 14 + the cache of the rest of the 112 GB on NVMe.
  EXPECT_DOUBLE_EQ(q.hbm_bytes_per_gpu, 5.625e9 + kExchange);
  EXPECT_DOUBLE_EQ(q.host_cache_bytes_per_node, 112e9 - buffers);
  EXPECT_DOUBLE_EQ(q.host_bytes_per_node, 126e9);
  // All of it cached: no IO. With 100 GB (22 GB of cache): per rank 21 + fp32 grads
  // 2 x 4 x 3.5 = 28 -> 49; x 8 = 392 GB.
  EXPECT_DOUBLE_EQ(q.nvme_io_bytes_per_node, 0);
  PlanInput tight = in;
  tight.capacity.dram_bytes_per_node = 100e9;
  EXPECT_DOUBLE_EQ(Place(tight, 3, D::kNvme, D::kCpu).nvme_io_bytes_per_node, 392e9);
  // PCIe: grads down each micro-step 4 x 1.75 = 7 + shard up 2 x 4 x 1.75 = 14 -> 21 GB.
  EXPECT_DOUBLE_EQ(q.pcie_bytes_per_gpu, 21e9);
}

// DeepSpeed's ZeRO-Infinity tutorial config on one GPU with 64 GB of DRAM: sub_group_size 1e9
// makes the optimizer swap buffers most of a host tier that does not fit (less than the state
// they page, so the note above stays quiet): the note names sub_group_size. With 1e8 it fits and
// nothing is noted.
TEST(PlannerPlace, SwapBuffersThatOverflowTheHostNameSubGroupSize) {
  PlanInput in = Ref();
  in.capacity.gpus_per_node = 1;
  in.capacity.dram_bytes_per_node = 64e9;
  in.largest_group_params = 1e9;  // sub-groups of sub_group_size, not of a smaller group
  in.zero.sub_group_size = 1e9;
  const Placement p = Place(in, 3, D::kNvme, D::kNvme);
  EXPECT_GT(p.host_bytes_per_node, 64e9);
  ASSERT_EQ(p.notes.size(), 1u);
  EXPECT_NE(p.notes[0].find("does not hold the setting"), std::string::npos) << p.notes[0];
  EXPECT_NE(p.notes[0].find("sub_group_size"), std::string::npos) << p.notes[0];
  in.zero.sub_group_size = 1e8;
  const Placement q = Place(in, 3, D::kNvme, D::kNvme);
  EXPECT_LE(q.host_bytes_per_node, 64e9);
  EXPECT_TRUE(q.notes.empty()) << q.notes[0];
}

// The host cache is what the DRAM capacity (the engines' host budgets) leaves beyond the working
// set, up to the NVMe-homed bytes; max_in_cpu does not bound it.
TEST(PlannerPlace, Stage3AllNvmeCacheIsWhatTheBudgetLeaves) {
  PlanInput in = Ref();
  in.zero.max_in_cpu = 2.5e8;  // accepted, not used
  in.zero.sub_group_size = 1e8;
  // The group's shard 6.25e7 < sub_group_size: 40.0006 + 8.0001
  const double buffers = 8.0 * 5 * 4 * 250003456 + 8.0 * 5 * 200003584;
  Placement p = Place(in, 3, D::kNvme, D::kNvme);
  EXPECT_DOUBLE_EQ(p.hbm_bytes_per_gpu, 5.625e9 + kExchange);
  // 1024 GB: room for all 126 GB on NVMe.
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, "swap buffers"), buffers);
  EXPECT_DOUBLE_EQ(p.host_bytes_per_node, 126e9);
  // 75 GB: the cache takes the 2.9994 GB left; at the working set itself, none.
  in.capacity.dram_bytes_per_node = 75e9;
  p = Place(in, 3, D::kNvme, D::kNvme);
  EXPECT_DOUBLE_EQ(p.host_bytes_per_node, 75e9);
  EXPECT_DOUBLE_EQ(p.host_cache_bytes_per_node, 75e9 - buffers);
  EXPECT_TRUE(p.fits_host);
  in.capacity.dram_bytes_per_node = buffers;
  p = Place(in, 3, D::kNvme, D::kNvme);
  EXPECT_DOUBLE_EQ(p.host_cache_bytes_per_node, 0);
  EXPECT_DOUBLE_EQ(p.host_bytes_per_node, buffers);
  EXPECT_TRUE(p.fits_host);
  in.capacity.dram_bytes_per_node = 1024e9;
  // NVMe: 112 + params 14 = 126 GB.
  EXPECT_DOUBLE_EQ(p.nvme_bytes_per_node, 126e9);
  // IO per rank: optimizer+grads 28 + params 8.75e8 x 2 B x (2 reads + 1 write) = 5.25 -> 33.25;
  // x 8 = 266 GB.
  EXPECT_DOUBLE_EQ(p.nvme_io_bytes_per_node, 266e9);
  // With 1024 GB everything is cached: none.
  EXPECT_DOUBLE_EQ(Place(in, 3, D::kCpu, D::kNvme).nvme_io_bytes_per_node, 0);
}

TEST(PlannerPlace, OffloadBelowStage3FollowsDeepSpeed) {
  const PlanInput in = Ref();
  // Stage 2 + optimizer cpu (ZeRO-Offload): HBM params 14 + gradient buffers 1.125 + read-back
  // 0.875 = 16; host 112.
  const Placement s2 = Place(in, 2, D::kCpu, D::kNone);
  EXPECT_DOUBLE_EQ(s2.hbm_bytes_per_gpu, 16e9 + kExchange);
  EXPECT_DOUBLE_EQ(s2.host_bytes_per_node, 112e9);
  EXPECT_TRUE(s2.notes.empty());
  // Stage 1 holds the full 16-bit params like stage 2, and its fp32 grad shard with the optimizer
  // on the host (the engine's layout): 14 + 2 = 16; host 112.
  const Placement s1 = Place(in, 1, D::kCpu, D::kNone);
  EXPECT_DOUBLE_EQ(s1.hbm_bytes_per_gpu, 16e9 + kExchange);
  EXPECT_DOUBLE_EQ(s1.host_bytes_per_node, 112e9);
  EXPECT_DOUBLE_EQ(s1.pcie_bytes_per_gpu, 3.5e9);
  // NVMe optimizer offload below stage 3 becomes cpu; param offload is ignored: as s2.
  const Placement s2n = Place(in, 2, D::kNvme, D::kNvme);
  EXPECT_EQ(s2n.offload_optimizer, D::kCpu);
  EXPECT_EQ(s2n.offload_param, D::kNone);
  EXPECT_EQ(s2n.notes.size(), 2u);
  EXPECT_DOUBLE_EQ(s2n.hbm_bytes_per_gpu, 16e9 + kExchange);
  EXPECT_DOUBLE_EQ(s2n.nvme_bytes_per_node, 0);
  // Stage 0 ignores optimizer offload: 127.125 GB as without it.
  const Placement s0 = Place(in, 0, D::kCpu, D::kCpu);
  EXPECT_EQ(s0.offload_optimizer, D::kNone);
  EXPECT_DOUBLE_EQ(s0.hbm_bytes_per_gpu, 127.125e9 + kExchange + kScratch0);
  EXPECT_DOUBLE_EQ(s0.host_bytes_per_node, 0);
}

TEST(PlannerPlace, HostAndNvmeScaleWithGpusPerNodeNotNodes) {
  PlanInput in = Ref();
  in.capacity.gpus_per_node = 4;
  in.capacity.nodes = 2;  // N = 8 again, shard 8.75e8
  const Placement p = Place(in, 3, D::kCpu, D::kCpu);
  EXPECT_DOUBLE_EQ(p.hbm_bytes_per_gpu, 5.625e9 + kExchange);
  // 4 GPUs x (12 + 4 + 2) B x 8.75e8 = 63 GB per node.
  EXPECT_DOUBLE_EQ(p.host_bytes_per_node, 63e9);
}

TEST(PlannerComm, RelativeToDdp) {
  const PlanInput in = Ref();
  // DDP: 2 x (7/8) x 2 B x 7e9 = 24.5 GB per rank.
  for (int s = 0; s < 3; ++s) {
    const Placement p = Place(in, s, D::kNone, D::kNone);
    EXPECT_DOUBLE_EQ(p.comm.ddp_bytes_per_rank, 24.5e9);
    EXPECT_DOUBLE_EQ(p.comm.bytes_per_rank, 24.5e9) << s;
    EXPECT_DOUBLE_EQ(p.comm.ratio, 1.0);
  }
  // Stage 3: (7/8) x (2 + 2 x 2) x 7e9 = 36.75 GB, 1.5x.
  const Placement s3 = Place(in, 3, D::kNone, D::kNone);
  EXPECT_DOUBLE_EQ(s3.comm.bytes_per_rank, 36.75e9);
  EXPECT_DOUBLE_EQ(s3.comm.ratio, 1.5);
  // fp32 grads: DDP moves 4 B/param twice; stage 1 moves 4 + 2: 0.75x; stage 3 (4 + 4): 1x.
  PlanInput f = in;
  f.recipe = *ParseRecipe("fp32-grads");
  EXPECT_DOUBLE_EQ(Place(f, 1, D::kNone, D::kNone).comm.ratio, 0.75);
  EXPECT_DOUBLE_EQ(Place(f, 3, D::kNone, D::kNone).comm.ratio, 1.0);
  // One rank: nothing moves, the ratio is still defined.
  f.capacity.gpus_per_node = 1;
  EXPECT_DOUBLE_EQ(Place(f, 3, D::kNone, D::kNone).comm.bytes_per_rank, 0);
}

// Which rung of the ladder is chosen, as capacities shrink.
size_t Recommended(const PlanInput& in) {
  auto plan = MakePlan(in);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  return plan->recommended.value_or(99);
}

TEST(PlannerRecommend, LadderOrder) {
  PlanInput in = Ref();
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->ladder.size(), 11u);
  // Stage 3 with a partial optimizer offload (ratio 0.25, 0.5, 0.75) before the full one: each
  // rung offloads more and needs less HBM.
  for (size_t i = 4; i <= 7; ++i) {
    EXPECT_EQ(plan->ladder[i].stage, 3);
    EXPECT_EQ(plan->ladder[i].offload_optimizer, D::kCpu);
    EXPECT_EQ(plan->ladder[i].offload_param, D::kNone);
    EXPECT_DOUBLE_EQ(plan->ladder[i].optimizer_ratio,
                     i == 7 ? 1.0 : 0.25 * static_cast<double>(i - 3));
    EXPECT_LT(plan->ladder[i].hbm_bytes_per_gpu, plan->ladder[i - 1].hbm_bytes_per_gpu) << i;
    EXPECT_GT(plan->ladder[i].host_bytes_per_node, plan->ladder[i - 1].host_bytes_per_node) << i;
  }
  EXPECT_EQ(plan->ladder[10].offload_param, D::kNvme);
  {
    // The smallest offload that fits is chosen: exactly the half-offloaded rung's HBM.
    PlanInput half = in;
    half.capacity.hbm_bytes_per_gpu = plan->ladder[5].hbm_bytes_per_gpu;
    EXPECT_EQ(Recommended(half), 5u);
  }
  // 80 GB: stage 0 needs 127.125, stage 1 needs 30 -> stage 1 (rung 1).
  EXPECT_EQ(Recommended(in), 1u);
  EXPECT_TRUE(plan->fits);
  in.capacity.hbm_bytes_per_gpu = 31e9;  // stage 1 holds what stage 2 holds (30): still rung 1
  EXPECT_EQ(Recommended(in), 1u);
  EXPECT_DOUBLE_EQ(plan->ladder[1].hbm_bytes_per_gpu, plan->ladder[2].hbm_bytes_per_gpu);
  in.capacity.hbm_bytes_per_gpu = 24e9;  // stage 3: 23.125
  EXPECT_EQ(Recommended(in), 3u);
  in.capacity.hbm_bytes_per_gpu = 8e9;  // stage 3 + optimizer cpu: 7.125 HBM, 112 host
  EXPECT_EQ(Recommended(in), 7u);
  in.capacity.hbm_bytes_per_gpu = 7e9;  // + params cpu (and the NVMe rungs): 5.625 HBM, 126 host
  EXPECT_EQ(Recommended(in), 8u);
  in.capacity.dram_bytes_per_node = 100e9;  // 126 host no longer fits; optimizer nvme + params
  // cpu: swap buffers 8 x (4 + 1) x 4 x 6.25e7 (a reduce_bucket_size group's shard) x 4 B = 40 GB
  // + 14 params = 54.0005 host (and a cache in the rest)
  EXPECT_EQ(Recommended(in), 9u);
  in.capacity.dram_bytes_per_node = 50e9;  // all nvme: 40 + 8.0007 param buffers = 48.0007
  EXPECT_EQ(Recommended(in), 10u);
  in.capacity.dram_bytes_per_node = 45e9;
  EXPECT_EQ(Recommended(in), 99u);
  in.zero.sub_group_size = 1e7;  // swap buffers 8 x 5 x 4 x 1e7 x 4 B = 6.4 GB: + 14 = 20.4005
  EXPECT_EQ(Recommended(in), 9u);
  in.capacity.nvme_bytes_per_node = 100e9;  // NVMe needs 126
  EXPECT_EQ(Recommended(in), 99u);
}

TEST(PlannerRecommend, VerdictFollowsConfiguredSetting) {
  PlanInput in = Ref();
  in.has_configured = true;
  in.zero.stage = 0;  // 127.125 GB does not fit 80 although stage 1 would
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(plan->configured.has_value());
  EXPECT_FALSE(plan->fits);
  EXPECT_EQ(plan->recommended.value_or(99), 1u);
  in.zero.stage = 3;
  in.zero.offload_optimizer = D::kCpu;
  in.zero.offload_param = D::kCpu;
  plan = MakePlan(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->fits);
  EXPECT_DOUBLE_EQ(plan->configured->hbm_bytes_per_gpu, 5.625e9 + kExchange);
  // The per-stage table applies the configured offload to every stage.
  EXPECT_DOUBLE_EQ(plan->stages[2].hbm_bytes_per_gpu, 16e9 + kExchange);
  EXPECT_DOUBLE_EQ(plan->stages[3].host_bytes_per_node, 126e9);
}

TEST(PlannerValidate, NamesTheField) {
  PlanInput in = Ref();
  in.params = 0;
  EXPECT_NE(MakePlan(in).status().message().find("params"), std::string_view::npos);
  in = Ref();
  in.capacity.gpus_per_node = 0;
  EXPECT_TRUE(MakePlan(in).status().IsInvalidArgument());
  in = Ref();
  in.zero.stage = 4;
  EXPECT_NE(MakePlan(in).status().message().find("stage"), std::string_view::npos);
  in = Ref();
  in.zero.reduce_bucket_size = -1;
  EXPECT_NE(MakePlan(in).status().message().find("reduce_bucket_size"), std::string_view::npos);
  in = Ref();
  in.zero.gradient_accumulation_steps = 0;
  EXPECT_TRUE(MakePlan(in).status().IsInvalidArgument());
  // The zero fields by their JSON path, as the config names them.
  in = Ref();
  in.zero.sub_group_size = -1;
  EXPECT_NE(MakePlan(in).status().message().find("zero_optimization.sub_group_size"),
            std::string_view::npos)
      << MakePlan(in).status().ToString();
}

// N = gpus x nodes in 64 bits: 3 x 1431655766 wrapped to 2 in an int (and "fit"), 65536 x 65536
// to 0 (and "inf GB"). Beyond kMaxPlanRanks is refused, naming the product.
TEST(PlannerValidate, RanksDoNotOverflow) {
  PlanInput in = Ref();
  in.capacity.gpus_per_node = 3;
  in.capacity.nodes = 1431655766;
  EXPECT_EQ(in.capacity.Ranks(), int64_t{4294967298});
  Status s = ValidatePlanInput(in);
  EXPECT_TRUE(s.IsInvalidArgument());
  EXPECT_NE(s.message().find("4294967298"), std::string_view::npos) << s.ToString();
  in.capacity.gpus_per_node = 65536;
  in.capacity.nodes = 65536;
  EXPECT_TRUE(ValidatePlanInput(in).IsInvalidArgument());
  in.capacity.gpus_per_node = 8;
  in.capacity.nodes = static_cast<int>(kMaxPlanRanks / 8);
  ASSERT_TRUE(ValidatePlanInput(in).ok());
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_DOUBLE_EQ(plan->ledger_bytes_per_gpu[3], 16 * 7e9 / static_cast<double>(kMaxPlanRanks));
}

// Beyond kMaxPlanParams the byte counts saturated (1e19 and 5e19 planned alike, and "fits"):
// refused, naming the count; at the limit every placement's figures stay finite and ordered.
TEST(PlannerValidate, ParamsBeyondTheExactRangeAreRefused) {
  PlanInput in = Ref();
  in.params = 1e19;
  Status s = ValidatePlanInput(in);
  EXPECT_TRUE(s.IsInvalidArgument());
  EXPECT_NE(s.message().find("beyond"), std::string_view::npos) << s.ToString();
  in.params = kMaxPlanParams;
  in.capacity.gpus_per_node = 8;
  in.capacity.nodes = static_cast<int>(kMaxPlanRanks / 8);
  ASSERT_TRUE(ValidatePlanInput(in).ok());
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_DOUBLE_EQ(plan->ledger_bytes_per_gpu[0], 16 * kMaxPlanParams);
  EXPECT_LT(plan->ledger_bytes_per_gpu[3], plan->ledger_bytes_per_gpu[2]);
}

// A largest group beyond the model, a recipe beyond any state's bytes, an activation size that
// overflowed to infinity: refused, naming the value and what is wrong with it.
TEST(PlannerValidate, LargestGroupRecipeAndInfinitiesAreChecked) {
  PlanInput in = Ref();
  in.largest_group_params = in.params * 2;
  Status s = ValidatePlanInput(in);
  EXPECT_TRUE(s.IsInvalidArgument());
  EXPECT_NE(s.message().find("largest group params"), std::string_view::npos) << s.ToString();
  in.largest_group_params = in.params;
  EXPECT_TRUE(ValidatePlanInput(in).ok());

  in = Ref();
  in.recipe.master_bytes = 1e20;
  s = ValidatePlanInput(in);
  EXPECT_TRUE(s.IsInvalidArgument());
  EXPECT_NE(s.message().find("at most 64"), std::string_view::npos) << s.ToString();

  in = Ref();
  in.activation_bytes_per_gpu = std::numeric_limits<double>::infinity();
  s = ValidatePlanInput(in);
  EXPECT_TRUE(s.IsInvalidArgument());
  EXPECT_NE(s.message().find("must be finite"), std::string_view::npos) << s.ToString();
}

// sub_group_size 0 is valid DeepSpeed (each parameter tensor is its own sub-group; the config
// reader accepts it, and a published axolotl config has it): planned, not refused. The NVMe
// swap buffers then hold the largest tensor's shard, bounded by the largest group given.
TEST(PlannerPlace, SubGroupSizeZeroIsOneTensorPerSubGroup) {
  PlanInput in = Ref();
  in.zero.sub_group_size = 0;
  ASSERT_TRUE(ValidatePlanInput(in).ok()) << ValidatePlanInput(in).ToString();
  Placement p = Place(in, 3, D::kNvme, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, "swap buffers"), 0);
  ASSERT_EQ(p.notes.size(), 1u);
  EXPECT_NE(p.notes[0].find("--largest-group"), std::string::npos) << p.notes[0];
  in.largest_group_params = 8e8;  // shard 1e8 per rank: 8 GPUs x 5 x 4 blocks of 1e8 x 4 B
  p = Place(in, 3, D::kNvme, D::kNone);
  EXPECT_DOUBLE_EQ(ItemBytes(p, Tier::kHost, "swap buffers"), 8.0 * 5 * 4 * 400003072);
  EXPECT_TRUE(p.notes.empty());
}

}  // namespace
}  // namespace strata
