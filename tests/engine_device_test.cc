// The engine's device path without a GPU: EmulatedDevice (emulated_device.h) is a device the
// host may not address whose kernels run the CUDA kernels' element code on the host, so these
// tests drive exactly the path CudaDevice takes (device-resident gradients, norms and Adam run by
// Device::kernels(), in place) and prove it gives the same bits as HostDevice, whose state the
// CPU SIMD kernels update.
//
// The bit comparison needs the AVX2 CPU target (device_equivalence.h) and is skipped, saying so,
// without it; the other tests need no particular CPU.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "device_equivalence.h"
#include "emulated_device.h"
#include "engine_test_model.h"
#include "kernels/casts.h"

namespace strata::testing {
namespace {

// One emulated device per rank, kept after the run for its counters.
struct Devices {
  std::vector<std::unique_ptr<EmulatedDevice>> per_rank;
  EmulatedDevice::Counts Total() const {
    EmulatedDevice::Counts t;
    for (const auto& d : per_rank) t += d->counts();
    return t;
  }
  uint64_t Violations(std::string* first) const {
    uint64_t v = 0;
    for (const auto& d : per_rank) {
      if (d->violations() > 0 && first->empty()) *first = d->first_violation();
      v += d->violations();
    }
    return v;
  }
};

// Makes `spec` run on emulated devices (world of them).
void UseEmulated(RunSpec& spec, Devices& devices, bool caller_streams = true) {
  for (int r = 0; r < spec.world; ++r) {
    EmulatedDeviceOptions o;
    o.host.budget_bytes = spec.device_budget;
    o.caller_streams = caller_streams;
    auto d = EmulatedDevice::Create(o);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    devices.per_rank.push_back(std::move(*d));
  }
  spec.device = [&devices](int r) -> Device* { return devices.per_rank[r].get(); };
}

// Device-resident state goes through the device's kernels, offloaded state does not, nothing
// copies or frees memory under a running kernel, and training still converges to the fp32
// reference (any CPU).
TEST(EngineDevice, DeviceResidentStateRunsOnTheDeviceKernels) {
  struct Case {
    int stage;
    const char* opt;
    const char* param;
    bool on_device;  // the optimizer state's home is the device
  };
  for (const Case c : {Case{3, "none", "none", true}, Case{2, "cpu", "none", false}}) {
    SCOPED_TRACE("stage " + std::to_string(c.stage) + " opt " + c.opt);
    RunSpec spec;
    spec.config_json = DeviceCaseConfig(c.stage, c.opt, c.param, "fp32", 0.0, 1);
    Devices devices;
    UseEmulated(spec, devices);
    RunResult res = RunEngine(spec);
    ASSERT_TRUE(res.status.ok()) << res.status.ToString();
    const EmulatedDevice::Counts n = devices.Total();
    std::string first;
    EXPECT_EQ(devices.Violations(&first), 0u) << first;
    uint64_t subs = 0;
    for (const EngineLayout& l : res.layouts) subs += l.sub_groups;
    if (c.on_device) {
      // One Adam and one fp32 param copy per sub-group and step; one accumulation per sub-group,
      // micro-step and step; a chunk-sum pass per owned sub-group and step.
      EXPECT_EQ(n.adam, subs * spec.steps);
      EXPECT_EQ(n.cast, subs * spec.steps);
      EXPECT_EQ(n.accumulate, subs * spec.steps);
      EXPECT_EQ(n.chunk_sums, subs * spec.steps);
    } else {
      EXPECT_EQ(n.adam + n.accumulate + n.chunk_sums + n.cast, 0u);
    }
    // Gradient buffers live on the device in both: cleared there by its kernels (a zero pass per
    // buffer a step takes), never by copying zeros over the link.
    EXPECT_GE(n.zero, static_cast<uint64_t>(spec.steps))
        << "gradient buffers not cleared on the device";
    const auto ref = RunReference(1, spec.steps, 1, 0.01f, 0.01f);
    const auto init = RunReference(1, 0, 1, 0.01f, 0.01f);
    EXPECT_LT(RelativeUpdateError(res.master, ref, init), 1e-4);
    EXPECT_FALSE(BitEqual(res.master, init));  // training moved the weights
  }
}

// pin_memory false (DeepSpeed's default) on a device the host cannot address: the layout's note
// says what it costs there (every copy to or from the host buffers synchronous), and how to
// avoid it. The run is otherwise the pinned one's.
TEST(EngineDevice, UnpinnedHostBuffersOnADeviceAreCalledOutInTheNotes) {
  RunSpec spec;
  spec.config_json = DeviceCaseConfig(2, "cpu", "none", "bf16", 0.0, 1);
  spec.use_pinned_pool = true;
  Devices devices;
  UseEmulated(spec, devices);
  RunResult res = RunEngine(spec);
  ASSERT_TRUE(res.status.ok()) << res.status.ToString();
  std::string notes;
  for (const std::string& n : res.layouts[0].notes) notes += n + "\n";
  EXPECT_NE(notes.find("not page-locked"), std::string::npos) << notes;
  EXPECT_NE(notes.find("synchronous"), std::string::npos) << notes;
  EXPECT_NE(notes.find("pin_memory true"), std::string::npos) << notes;
}

// The backward's reductions wait for no kernel: their accumulations and chunk sums are only
// queued, the trainer's buffers they read are freed stream-ordered behind them, and Step reads
// every sub-group's statistics back at once and waits once for all of its Adam kernels. Per step
// the device is synchronized once per gradient buffer (its clearing, before the trainer writes it)
// between the gradients and Step.
TEST(EngineDevice, ReductionsQueueTheirKernelsAndStepCollectsTheStatistics) {
  RunSpec spec;
  spec.config_json = DeviceCaseConfig(3, "none", "none", "bf16", 0.5, 1);
  Devices devices;
  // A device that orders no caller streams: each buffer freed after its reduction (the other
  // path recycles them: ANamedCallerStreamIsOrderedOnTheDeviceWithoutHostWaits).
  UseEmulated(spec, devices, /*caller_streams=*/false);
  std::vector<uint64_t> at_grads, at_step;
  auto syncs = [&devices] { return devices.per_rank[0]->counts().synchronize; };
  spec.tamper = [&](int, int, int, Grads*) { at_grads.push_back(syncs()); };
  spec.before_engine_step = [&](int, int, Engine&, nvme::SimBackend*) {
    at_step.push_back(syncs());
  };
  std::vector<uint64_t> after_step;
  spec.after_step = [&](int, int, Engine&) {
    after_step.push_back(syncs());
    return Status::OK();
  };
  RunResult res = RunEngine(spec);
  ASSERT_TRUE(res.status.ok()) << res.status.ToString();
  uint64_t trainable = 0;
  for (const GroupSpec& g : TestModel().groups) trainable += g.trainable ? 1 : 0;
  ASSERT_EQ(at_grads.size(), static_cast<size_t>(spec.steps));
  ASSERT_EQ(at_step.size(), at_grads.size());
  ASSERT_EQ(after_step.size(), at_step.size());
  const uint64_t subs = res.layouts[0].sub_groups;
  ASSERT_GT(subs, 2u);
  for (size_t i = 0; i < at_step.size(); ++i) {
    EXPECT_EQ(at_step[i] - at_grads[i], trainable) << "step " << i;
    // Step: the statistics' read-back and one wait after every sub-group's Adam is queued, not
    // one per sub-group.
    EXPECT_EQ(after_step[i] - at_step[i], 2u) << "step " << i;
  }
  const EmulatedDevice::Counts n = devices.Total();
  EXPECT_EQ(n.chunk_sums, subs * spec.steps);
  EXPECT_GT(n.deferred_frees, 0u);  // a trainer's buffer freed under its queued accumulation
  std::string first;
  EXPECT_EQ(devices.Violations(&first), 0u) << first;
  for (const StepReport& r : res.reports) {  // the norm came from the collected statistics
    EXPECT_TRUE(std::isfinite(r.grad_norm) && r.grad_norm > 0) << r.grad_norm;
  }
}

// With the trainer's stream named (one rank on a device that orders caller streams), the
// backward's gradient buffers and reductions wait for nothing on the host: each buffer's zeroing
// is ordered before the trainer's writes, and each reduction after them, on the device
// (OrderCallerStream / WaitCallerStream, once per buffer each); the kernels are never synchronized
// between the gradients and Step, and after the first buffers none is allocated (they are
// recycled in the kernels' order); the bits are those of the run on a device that orders no
// caller streams, with the optimizer on the device or offloaded. With the params offloaded, each
// release (whose device copy the store may evict and reuse) is ordered after the trainer's reads
// too; where the views are the params' home (gathers_alias_home) a release orders nothing. Two
// ranks (a collective per reduction) ignore the stream.
TEST(EngineDevice, ANamedCallerStreamIsOrderedOnTheDeviceWithoutHostWaits) {
  uint64_t trainable = 0;
  for (const GroupSpec& g : TestModel().groups) trainable += g.trainable ? 1 : 0;
  // The harness gathers every group and the tied embedding again, in forward and in backward.
  const uint64_t gathers = 2 * (TestModel().groups.size() + 1);
  struct Case {
    int world;
    const char* opt;
    const char* param;
  };
  for (const auto& [world, opt, param] :
       {Case{1, "none", "none"}, {1, "cpu", "none"}, {1, "cpu", "cpu"}, {2, "none", "none"}}) {
    SCOPED_TRACE("world " + std::to_string(world) + ", optimizer " + opt + ", params " + param);
    RunSpec spec;
    spec.world = world;
    spec.config_json = DeviceCaseConfig(3, opt, param, "bf16", 0.5, 1);
    RunSpec base = spec;
    Devices base_devices;
    UseEmulated(base, base_devices, /*caller_streams=*/false);
    const RunResult want = RunEngine(base);
    ASSERT_TRUE(want.status.ok()) << want.status.ToString();
    spec.caller_stream = 7;  // a token: the emulated device's caller is the test itself
    Devices devices;
    UseEmulated(spec, devices);
    std::vector<uint64_t> at_grads, at_step;
    auto syncs = [&devices] { return devices.per_rank[0]->counts().synchronize; };
    spec.tamper = [&](int r, int, int, Grads*) {
      if (r == 0) at_grads.push_back(syncs());
    };
    spec.before_engine_step = [&](int r, int, Engine&, nvme::SimBackend*) {
      if (r == 0) at_step.push_back(syncs());
    };
    bool alias = false;
    spec.before_step = [&](int r, int, Engine& e) {
      if (r == 0) alias = e.gathers_alias_home();
    };
    const RunResult got = RunEngine(spec);
    ASSERT_TRUE(got.status.ok()) << got.status.ToString();
    ExpectSameRun(got, want);
    const EmulatedDevice::Counts n = devices.Total();
    const uint64_t base_allocations = base_devices.Total().allocations;
    if (world == 1) {
      // Offloaded params, or the optimizer on cpu (a small model's speculative step writes the
      // params during the backward), are rewritten after a release.
      EXPECT_EQ(alias, std::string(opt) == "none" && std::string(param) == "none");
      const uint64_t releases = alias ? 0 : gathers * spec.steps;
      EXPECT_EQ(n.caller_orders, trainable * spec.steps);
      EXPECT_EQ(n.caller_waits, trainable * spec.steps + releases);
      // Each call orders only the queues its memory's users run on (DeviceQueue bits h2d, d2h,
      // kernels): a buffer's zeroing (kernels); a reduction's readers (d2h staging, kernels); a
      // release's rewriters (h2d refills, kernels). The emulated device cannot show a queue
      // left out (its caller is the host, done before it calls): these pin the masks chosen,
      // and CudaDevice's contract test checks that a named queue is ordered.
      EXPECT_EQ(n.caller_orders_on[0] + n.caller_orders_on[1], 0u);
      EXPECT_EQ(n.caller_orders_on[2], trainable * spec.steps);
      EXPECT_EQ(n.caller_waits_on[0], releases);
      EXPECT_EQ(n.caller_waits_on[1], trainable * spec.steps);
      EXPECT_EQ(n.caller_waits_on[2], trainable * spec.steps + releases);
      // At most three buffers (sched::OneRankGradBuffers) made, where the run without the stream
      // makes one per group and step.
      EXPECT_LE(n.allocations + trainable * spec.steps, base_allocations + 3);
      ASSERT_EQ(at_step.size(), at_grads.size());
      for (size_t i = 0; i < at_step.size(); ++i) {
        EXPECT_EQ(at_step[i], at_grads[i]) << "step " << i << ": the host waited for kernels";
      }
    } else {
      EXPECT_EQ(n.caller_orders + n.caller_waits, 0u);
      EXPECT_EQ(n.allocations, base_allocations);
    }
    std::string first;
    EXPECT_EQ(devices.Violations(&first), 0u) << first;
  }
}

// Gradients accumulated on the host from a device the host cannot address (the optimizer
// offloaded): with pin_memory each sub-group's reduced gradient is copied into one page-locked
// staging buffer, so no device-to-host copy of the engine lands in pageable memory (on CUDA
// those bounce through the driver's buffers); without it they do. The same where the gradient is
// kept in bf16 (one rank, one micro-step) and the store's blocks are not page-locked (no pinned
// pool here), so that it too is staged rather than copied into the block.
TEST(EngineDevice, OffloadedGradientsAreStagedInPageLockedMemoryWithPinMemory) {
  for (const auto& [pin, gas] : {std::pair{true, 2}, {false, 2}, {true, 1}, {false, 1}}) {
    SCOPED_TRACE(std::string(pin ? "pin_memory" : "no pin_memory") + ", gas " +
                 std::to_string(gas));
    RunSpec spec;
    spec.config_json = DeviceCaseConfig(3, "cpu", "none", "bf16", 0.0, gas);
    spec.gas = gas;
    const std::string key = R"("device": "cpu")";
    const size_t at = spec.config_json.find(key);
    ASSERT_NE(at, std::string::npos);
    spec.config_json.insert(at + key.size(),
                            std::string(R"(, "pin_memory": )") + (pin ? "true" : "false"));
    Devices devices;
    UseEmulated(spec, devices);
    // Counted over the steps: the store's own copies at initialisation go to its host blocks
    // (page-locked by its pinned pool, which registers with CUDA itself; not used here).
    auto pageable_d2h = [&devices] {
      return devices.Total().pageable_copies[static_cast<size_t>(CopyDir::kDeviceToHost)];
    };
    uint64_t before = 0, d2h = 0;
    spec.before_step = [&](int, int step, Engine&) {
      if (step == 0) before = pageable_d2h();
    };
    spec.after_step = [&](int, int step, Engine&) {
      if (step == spec.steps - 1) d2h = pageable_d2h() - before;
      return Status::OK();
    };
    RunResult res = RunEngine(spec);
    ASSERT_TRUE(res.status.ok()) << res.status.ToString();
    if (pin) {
      EXPECT_EQ(d2h, 0u);
    } else {
      EXPECT_GT(d2h, 0u);
    }
    EXPECT_GT(devices.per_rank[0]->stats().copies[static_cast<size_t>(CopyDir::kDeviceToHost)], 0u);
  }
}

// A sub-group larger than a staging piece (about an eighth of the largest sub-group, on
// kStatsChunk boundaries): its reduced gradient reaches the host optimizer in pieces, each copied
// while the one before is accumulated, and gives HostDevice's bits (master weights and the
// clipped step's norm) in fp32 and bf16.
TEST(EngineDevice, OffloadedGradientsStagedInPiecesGiveHostDeviceBits) {
  ModelSpec model;
  model.groups = {{"big", {{"w", {9 * kernels::kStatsChunk + 321}}}}, {"small", {{"b", {77}}}}};
  constexpr int kSteps = 3;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    auto parsed = ParseDeepSpeedConfig(
        std::string(R"({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.5,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
          "bf16": {"enabled": )") +
        (bf16 ? "true" : "false") + R"(},
          "zero_optimization": {"stage": 3, "sub_group_size": 1000000,
                                "offload_optimizer": {"device": "cpu"}}})");
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    const DType dtype = bf16 ? DType::kBF16 : DType::kF32;
    struct Run {
      std::vector<std::vector<float>> master;
      std::vector<double> norms;
      uint64_t d2h_copies = 0;  // during the steps
    };
    auto run = [&](EmulatedDevice* emulated, Run* out) {
      const std::vector<Status> st = OnHostRanks(
          1, UniqueTestDir("engine_staged_pieces"), parsed->config,
          [&](int, EngineOptions eo) -> Status {
            if (emulated != nullptr) eo.device = emulated;
            Device* device = eo.device;
            STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, std::move(eo)));
            STRATA_RETURN_IF_ERROR(
                engine->InitParameters([](size_t g, size_t, size_t b, size_t e, float* o) {
                  for (size_t i = b; i < e; ++i) o[i - b] = 0.3f * Noise(g * 7919 + i);
                }));
            const uint64_t d2h0 =
                device->stats().copies[static_cast<size_t>(CopyDir::kDeviceToHost)];
            for (int step = 0; step < kSteps; ++step) {
              for (size_t g = model.groups.size(); g-- > 0;) {
                const size_t n = model.groups[g].numel();
                std::vector<float> grad(n);
                for (size_t i = 0; i < n; ++i) grad[i] = Noise((step * 31 + g) * 1000003 + i);
                std::vector<uint8_t> bytes(n * DTypeSize(dtype));
                STRATA_RETURN_IF_ERROR(
                    kernels::Cast(grad.data(), DType::kF32, bytes.data(), dtype, n));
                STRATA_ASSIGN_OR_RETURN(void* buf, engine->GradBuffer(g));
                if (device->host_addressable()) {
                  std::memcpy(buf, bytes.data(), bytes.size());
                } else {
                  STRATA_RETURN_IF_ERROR(device->CopyAsync(CopyDir::kHostToDevice, buf,
                                                           bytes.data(), bytes.size(), nullptr));
                  STRATA_RETURN_IF_ERROR(device->Synchronize());
                }
                STRATA_RETURN_IF_ERROR(engine->ReduceGradients(g));
              }
              STRATA_ASSIGN_OR_RETURN(StepReport r, engine->Step());
              out->norms.push_back(r.grad_norm);
            }
            out->d2h_copies =
                device->stats().copies[static_cast<size_t>(CopyDir::kDeviceToHost)] - d2h0;
            out->master.resize(model.groups.size());
            for (size_t g = 0; g < model.groups.size(); ++g) {
              out->master[g].resize(model.groups[g].numel());
              STRATA_RETURN_IF_ERROR(engine->ReadMaster(g, out->master[g]));
            }
            return Status::OK();
          });
      for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
    };
    Run host, dev;
    run(nullptr, &host);
    EmulatedDeviceOptions o;
    o.host.budget_bytes = 64ull << 20;
    auto emulated = EmulatedDevice::Create(o);
    ASSERT_TRUE(emulated.ok()) << emulated.status().ToString();
    run(emulated->get(), &dev);
    ASSERT_EQ(dev.norms.size(), static_cast<size_t>(kSteps));
    for (int i = 0; i < kSteps; ++i) {
      EXPECT_EQ(std::bit_cast<uint64_t>(dev.norms[i]), std::bit_cast<uint64_t>(host.norms[i]))
          << "step " << i << ": " << dev.norms[i] << " vs " << host.norms[i];
      EXPECT_GT(dev.norms[i], 0.5) << "the step must clip, so that the norm's bits matter";
    }
    EXPECT_TRUE(BitEqual(dev.master, host.master)) << "master weights differ";
    if (bf16) {
      // One rank, one micro-step: the gradient is kept in bf16, and without pin_memory copied
      // whole into the store's block (no staging), one copy per sub-group and step.
      EXPECT_EQ(dev.d2h_copies, 2u * kSteps);
    } else {
      // 37185 elements in pieces of 8192: five copies for the big sub-group, one for the small,
      // per step (a whole-sub-group copy would make two).
      EXPECT_EQ(dev.d2h_copies, 6u * kSteps);
    }
    EXPECT_EQ((*emulated)->violations(), 0u) << (*emulated)->first_violation();
  }
}

// The device path gives HostDevice's bits at stages 0-3, every precision, with clipping (so the
// norm's chunk sums matter) and with state on the device, the host, or split between them.
TEST(EngineDevice, SameBitsAsHostDeviceOnFmaTargets) {
  const std::optional<int64_t> avx2 = Avx2Target();
  if (!avx2) GTEST_SKIP() << kNoAvx2;
  ForcedTarget forced(*avx2);
  for (const std::string precision : kDevicePrecisions) {
    for (const DeviceCase& c : kDeviceCases) {
      SCOPED_TRACE(c.Name(precision));
      RunSpec spec = c.Spec(precision);
      RunResult host = RunEngine(spec);
      ASSERT_TRUE(host.status.ok()) << host.status.ToString();
      Devices devices;
      UseEmulated(spec, devices);
      RunResult dev = RunEngine(spec);
      ASSERT_TRUE(dev.status.ok()) << dev.status.ToString();
      ExpectSameRun(dev, host);
      if (c.optimizer_on_device()) {
        EXPECT_GT(devices.Total().adam, 0u);
      } else {
        EXPECT_EQ(devices.Total().adam, 0u);
      }
      std::string first;
      EXPECT_EQ(devices.Violations(&first), 0u) << first;
    }
  }
}

// Partial offload (offload_optimizer.ratio 0.5) on a device the host cannot address: the
// device-resident sub-groups accumulate, sum and step on the device's kernels, the offloaded ones
// on the CPU, nothing runs under a copy, and the run has the full offload's bits on HostDevice
// (with the AVX2 target; without it, the reference's tolerance).
TEST(EngineDevice, PartialOffloadSplitsTheStepBetweenDeviceAndCpu) {
  const std::optional<int64_t> avx2 = Avx2Target();
  std::optional<ForcedTarget> forced;
  if (avx2) forced.emplace(*avx2);
  for (const DeviceCase& c :
       {DeviceCase{1, 3, "cpu", "none", 1}, DeviceCase{1, 3, "nvme", "cpu", 1},
        DeviceCase{2, 3, "cpu", "none", 1}}) {
    for (const std::string precision : {"fp32", "bf16"}) {
      SCOPED_TRACE(c.Name(precision));
      RunSpec spec = c.Spec(precision);
      const RunResult host_full = RunEngine(spec);
      ASSERT_TRUE(host_full.status.ok()) << host_full.status.ToString();
      spec.config_json = WithOffloadRatio(spec.config_json, 0.5);
      Devices devices;
      UseEmulated(spec, devices);
      const RunResult dev = RunEngine(spec);
      ASSERT_TRUE(dev.status.ok()) << dev.status.ToString();
      uint64_t resident = 0, subs = 0;
      for (const EngineLayout& l : dev.layouts) {
        resident += l.device_sub_groups;
        subs += l.sub_groups;
      }
      ASSERT_GT(resident, 0u);
      ASSERT_LT(resident, subs);
      const EmulatedDevice::Counts n = devices.Total();
      const auto steps = static_cast<uint64_t>(spec.steps);
      EXPECT_EQ(n.adam, resident * steps);
      EXPECT_EQ(n.accumulate, resident * steps);
      EXPECT_EQ(n.chunk_sums, resident * steps);
      EXPECT_EQ(n.cast, precision == "fp32" ? resident * steps : 0u);
      std::string first;
      EXPECT_EQ(devices.Violations(&first), 0u) << first;
      if (avx2) {
        ExpectSameRun(dev, host_full);
      } else {
        const auto ref = RunReference(c.world, spec.steps, 1, 0.01f, 0.01f);
        const auto init = RunReference(c.world, 0, 1, 0.01f, 0.01f);
        EXPECT_LT(RelativeUpdateError(dev.master, ref, init), precision == "fp32" ? 1e-4 : 0.1);
      }
    }
  }
}

// An Inf gradient on the device is seen by the device's chunk sums: the fp16 step is skipped and
// the loss scaler updated exactly as on HostDevice.
TEST(EngineDevice, OverflowOnTheDeviceSkipsTheStepAsOnTheHost) {
  RunSpec spec;
  spec.config_json = DeviceCaseConfig(2, "none", "none", "fp16", 0.0, 1);
  spec.tamper = [](int, int step, int, Grads* g) {
    if (step == 1) g->W1[7] = std::numeric_limits<float>::infinity();
  };
  RunResult host = RunEngine(spec);
  ASSERT_TRUE(host.status.ok()) << host.status.ToString();
  Devices devices;
  UseEmulated(spec, devices);
  RunResult dev = RunEngine(spec);
  ASSERT_TRUE(dev.status.ok()) << dev.status.ToString();
  ASSERT_EQ(dev.reports.size(), 3u);
  ASSERT_EQ(host.reports.size(), 3u);
  EXPECT_FALSE(dev.reports[0].skipped);
  EXPECT_TRUE(dev.reports[1].skipped);
  EXPECT_TRUE(std::isinf(dev.reports[1].grad_norm));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(dev.reports[i].skipped, host.reports[i].skipped) << "step " << i;
    EXPECT_EQ(dev.reports[i].loss_scale, host.reports[i].loss_scale) << "step " << i;
  }
  EXPECT_TRUE(BitEqual(dev.master, host.master));  // the skipped step applied nothing on either
  EXPECT_GT(devices.Total().chunk_sums, 0u);
}

// A kernel fault (here in the first gradient accumulation of step 1) fails the engine with the
// device's error.
TEST(EngineDevice, KernelFaultFailsTheEngine) {
  RunSpec spec;
  spec.config_json = DeviceCaseConfig(2, "none", "none", "bf16", 0.0, 1);
  Devices devices;
  UseEmulated(spec, devices);
  spec.before_step = [&devices](int r, int step, Engine&) {
    if (step == 1) devices.per_rank[r]->FailNextKernel(Status::Internal("injected kernel fault"));
  };
  RunResult res = RunEngine(spec);
  ASSERT_FALSE(res.status.ok());
  EXPECT_NE(res.status.ToString().find("injected kernel fault"), std::string::npos)
      << res.status.ToString();
}

// Offloaded gradients from a device the host cannot address: with overlap_comm the engine's
// accumulate thread stages each reduced gradient to the host and accumulates it there, behind
// the backward. A failed staging copy fails the engine at the trainer's next call, naming the
// group, and the step is never applied.
TEST(EngineDevice, FailedAccumulationCopyBehindTheBackwardFailsNamingTheGroup) {
  RunSpec spec;
  spec.config_json = DeviceCaseConfig(3, "cpu", "none", "fp32", 0.0, 1);
  spec.steps = 2;
  spec.timeout = std::chrono::milliseconds(20000);
  Devices devices;
  UseEmulated(spec, devices);
  spec.before_step = [&devices](int rank, int step, Engine&) {
    if (step == 1) {
      devices.per_rank[rank]->FailNextCopy(CopyDir::kDeviceToHost,
                                           Status::IOError("injected copy fault"));
    }
  };
  RunResult r = RunEngine(spec);
  ASSERT_FALSE(r.rank_status[0].ok());
  const std::string msg = r.rank_status[0].ToString();
  EXPECT_EQ(r.rank_status[0].code(), Status::Code::kIOError) << msg;
  EXPECT_NE(msg.find("gradient accumulation of group '"), std::string::npos) << msg;
  EXPECT_NE(msg.find("injected copy fault"), std::string::npos) << msg;
  EXPECT_EQ(r.reports.size(), 1u);
}

// A device copy past its deadline (its stream held up behind work that never ends) fails the
// call with DeadlineExceeded, but the copy is still queued and moves its bytes once the stream
// runs again. Where the host side was memory of the call's own (here the gradient statistics
// Step reads back), the copy must find it still there: CopySync copies through pieces its
// completion owns. Under ASan a copy into the call's freed buffer is a heap-use-after-free.
TEST(EngineDevice, ACopyPastItsDeadlineMovesOnlyMemoryItsCompletionOwns) {
  RunSpec spec;
  spec.config_json = DeviceCaseConfig(3, "none", "none", "bf16", 0.5, 1);
  spec.steps = 2;
  spec.timeout = std::chrono::milliseconds(1000);
  Devices devices;
  UseEmulated(spec, devices);
  spec.before_engine_step = [&devices](int r, int step, Engine&, nvme::SimBackend*) {
    if (step == 1) devices.per_rank[r]->HoldNextCopy(CopyDir::kDeviceToHost);
  };
  RunResult res = RunEngine(spec);
  ASSERT_FALSE(res.status.ok());
  EXPECT_EQ(res.status.code(), Status::Code::kDeadlineExceeded) << res.status.ToString();
  EXPECT_NE(res.status.ToString().find("device copy (d2h"), std::string::npos)
      << res.status.ToString();
  EXPECT_EQ(res.reports.size(), 1u);  // step 1 was not applied
  // The call and its engine are gone; the copy runs now.
  EXPECT_GE(devices.per_rank[0]->ReleaseHeldCopies(), 1u);
  ASSERT_TRUE(devices.per_rank[0]->Synchronize().ok());
}

// A copy past its deadline into memory the engine holds (a gradient copied to the host for the
// offloaded optimizer: fp32 through the staging buffer, StageFromDevice; bf16, kept in bf16,
// straight into the store's block, CopyDirect): every later call refuses, and destroying
// the engine waits for the copy before that memory goes, so the late copy lands in memory that is
// still the engine's.
TEST(EngineDevice, AnEngineWhoseCopyOverranWaitsForItBeforeItsMemoryGoes) {
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    RunSpec spec;
    spec.config_json = DeviceCaseConfig(3, "cpu", "none", precision, 0.0, 1);
    spec.steps = 2;
    spec.timeout = std::chrono::milliseconds(1000);
    Devices devices;
    UseEmulated(spec, devices);
    std::thread releaser;
    std::atomic<int64_t> released_at{0};
    using Clock = std::chrono::steady_clock;
    auto now_ns = [] { return Clock::now().time_since_epoch().count(); };
    spec.before_step = [&](int r, int step, Engine&) {
      if (step != 1) return;
      devices.per_rank[r]->HoldNextCopy(CopyDir::kDeviceToHost);
      // The stream runs again well after the engine gave up on the copy (its timeout: 1 s,
      // room for step 0 on a loaded machine).
      releaser = std::thread([&, r] {
        std::this_thread::sleep_for(std::chrono::milliseconds(3000));
        released_at = now_ns();
        devices.per_rank[r]->ReleaseHeldCopies();
      });
    };
    RunResult res = RunEngine(spec);
    const int64_t returned_at = now_ns();
    ASSERT_TRUE(releaser.joinable());
    releaser.join();
    ASSERT_FALSE(res.status.ok());
    const std::string msg = res.status.ToString();
    EXPECT_EQ(res.status.code(), Status::Code::kDeadlineExceeded) << msg;
    EXPECT_NE(msg.find("did not finish"), std::string::npos) << msg;
    EXPECT_EQ(res.reports.size(), 1u);
    // The engine (destroyed inside RunEngine) ended only after the held copy was let go.
    EXPECT_GT(released_at.load(), 0);
    EXPECT_GE(returned_at, released_at.load());
  }
}

}  // namespace
}  // namespace strata::testing
