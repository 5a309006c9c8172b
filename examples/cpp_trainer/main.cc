// cpp_trainer: a trainer-side program built against an installed strata (find_package(strata)).
// It checks a DeepSpeed config, plans memory for the model, then keeps a model state in the tiered
// store: registers a host-homed block and a device-homed one (the CPU stand-in device), writes a
// shard through a write lease, moves it to the device tier and reads it back. Finally it trains a
// two-layer toy model with the ZeRO engine (stage 3, optimizer offloaded to the host) on one rank
// and checks that the loss went down.
//
// Usage: cpp_trainer [ds_config.json]   (exit 0 when everything worked)
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/planner.h"
#include "strata/store.h"
#include "strata/version.h"

namespace {

int Fail(const char* what, const strata::Status& s) {
  std::fprintf(stderr, "cpp_trainer: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  std::printf("strata %s\n", STRATA_VERSION_STRING);

  // 1. The DeepSpeed config the run uses (a default ZeRO-3 config when none is given).
  const std::string text =
      R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})";
  strata::Result<strata::ParsedConfig> parsed = argc > 1 ? strata::LoadDeepSpeedConfig(argv[1])
                                                         : strata::ParseDeepSpeedConfig(text);
  if (!parsed.ok()) return Fail("config", parsed.status());

  // 2. The memory plan for a 1.3B model on 8 GPUs under that config.
  strata::PlanInput in;
  in.params = 1.3e9;
  in.capacity.gpus_per_node = 8;
  std::vector<std::string> notes;
  strata::ApplyEngineConfig(parsed->config, &in, &notes);
  strata::Result<strata::Plan> plan = strata::MakePlan(in);
  if (!plan.ok()) return Fail("plan", plan.status());
  const strata::Placement& p = plan->configured ? *plan->configured : plan->stages[3];
  std::printf("plan: stage %d, %.2f GB HBM per GPU, %.2f GB host per node, fits: %s\n", p.stage,
              p.hbm_bytes_per_gpu / 1e9, p.host_bytes_per_node / 1e9, plan->fits ? "yes" : "no");

  // 3. A shard in the tiered store: host home, cached on the (stand-in) device.
  strata::Result<std::unique_ptr<strata::Device>> device =
      strata::CreateHostDevice(strata::HostDeviceOptions{.budget_bytes = 8 << 20});
  if (!device.ok()) return Fail("device", device.status());
  strata::TieredStoreOptions so;
  so.device = device->get();
  so.device_budget_bytes = 4 << 20;
  so.host_budget_bytes = 4 << 20;
  so.use_pinned_pool = false;
  strata::Result<std::unique_ptr<strata::Store>> store = strata::OpenTieredStore(std::move(so));
  if (!store.ok()) return Fail("store", store.status());
  strata::BlockSpec spec{.name = "layer0.param16[r0]", .size_bytes = 1 << 20,
                         .dtype = strata::DType::kBF16, .kind = strata::StateKind::kParam16,
                         .home = strata::Tier::kHost};
  strata::Result<strata::BlockId> id = (*store)->Register(spec);
  if (!id.ok()) return Fail("register", id.status());
  {
    strata::Result<strata::Lease> w =
        (*store)->Acquire(*id, strata::Tier::kHost, strata::Access::kWrite, 5s);
    if (!w.ok()) return Fail("write lease", w.status());
    std::memset(w->data(), 0x5a, w->size_bytes());
    w->MarkDirty();
  }
  strata::Result<strata::Lease> r =
      (*store)->Acquire(*id, strata::Tier::kDevice, strata::Access::kRead, 5s);
  if (!r.ok()) return Fail("device lease", r.status());
  // The stand-in device's memory is host memory, so the bytes can be checked directly.
  const auto* bytes = static_cast<const unsigned char*>(r->data());
  for (uint64_t i = 0; i < r->size_bytes(); ++i) {
    if (bytes[i] != 0x5a) {
      std::fprintf(stderr, "cpp_trainer: byte %llu reads %d on the device tier\n",
                   static_cast<unsigned long long>(i), bytes[i]);
      return 1;
    }
  }
  r->Release();
  std::printf("store: %s moved to %s and read back intact\n", spec.name.c_str(),
              std::string(strata::TierName(strata::Tier::kDevice)).c_str());

  // 4. The ZeRO engine: fit w to a target by least squares (loss = 0.5 |w - t|^2, grad = w - t).
  strata::Result<strata::ParsedConfig> zcfg = strata::ParseDeepSpeedConfig(
      R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})");
  if (!zcfg.ok()) return Fail("engine config", zcfg.status());
  strata::GlooCommOptions go;  // one rank: no rendezvous store needed
  strata::Result<std::unique_ptr<strata::Communicator>> comm = strata::CreateGlooCommunicator(go);
  if (!comm.ok()) return Fail("communicator", comm.status());
  strata::ModelSpec model;
  model.groups = {{"layer0", {{"weight", {64, 32}}, {"bias", {64}}}}, {"layer1", {{"weight", {16, 64}}}}};
  strata::EngineOptions eo;
  eo.config = zcfg->config;
  eo.device = device->get();
  eo.comm = comm->get();
  eo.use_pinned_pool = false;
  strata::Result<std::unique_ptr<strata::Engine>> engine =
      strata::Engine::Create(model, std::move(eo));
  if (!engine.ok()) return Fail("engine", engine.status());
  std::printf("%s", (*engine)->layout().ToString().c_str());
  strata::Engine& e = **engine;
  strata::Status st = e.InitParameters([](size_t, size_t, size_t b, size_t end, float* out) {
    for (size_t i = b; i < end; ++i) out[i - b] = 0.0f;
  });
  if (!st.ok()) return Fail("init", st);
  auto target = [](size_t g, size_t i) { return 0.5f * static_cast<float>((g * 7 + i) % 5) - 1.0f; };
  double first_loss = 0, loss = 0;
  for (int step = 0; step < 20; ++step) {
    loss = 0;
    for (size_t g = model.groups.size(); g-- > 0;) {  // "backward", last group first
      strata::Result<strata::GatheredGroup> p = e.Gather(g);
      if (!p.ok()) return Fail("gather", p.status());
      strata::Result<void*> grad = e.GradBuffer(g);
      if (!grad.ok()) return Fail("grad buffer", grad.status());
      // HostDevice memory is host memory; on a GPU the trainer's kernels would write here.
      const auto* w = static_cast<const strata::bf16_t*>(p->data());
      auto* gr = static_cast<strata::bf16_t*>(*grad);
      for (size_t i = 0; i < p->numel(); ++i) {
        const float d = strata::Bf16ToFloat(w[i]) - target(g, i);
        loss += 0.5 * d * d;
        gr[i] = strata::FloatToBf16(d);
      }
      e.Release(std::move(*p));
      st = e.ReduceGradients(g);
      if (!st.ok()) return Fail("reduce", st);
    }
    strata::Result<strata::StepReport> rep = e.Step();
    if (!rep.ok()) return Fail("step", rep.status());
    if (step == 0) first_loss = loss;
  }
  std::printf("engine: loss %.4f -> %.4f after %lld steps\n", first_loss, loss,
              static_cast<long long>(e.global_step()));
  return loss < 0.5 * first_loss ? 0 : 1;
}
