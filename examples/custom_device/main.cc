// custom_device: a third-party device built against an installed strata (find_package(strata)),
// from the public headers alone. It implements strata::Device and strata::kernels::DeviceKernels
// (strata/device_kernels.h) the way an accelerator vendor would: its memory is opaque to the host
// (host_addressable() is false; here it lives in a HostDevice underneath, standing in for the
// accelerator's allocator and copy engines) and it computes on that memory with its own kernels
// (plain scalar loops of the header's formulas, standing in for device code). The engine then keeps
// the optimizer state on the device (ZeRO stage 2, no offload) and steps it there: the program
// trains a toy model and checks that the loss went down and that every kernel ran.
//
// Usage: custom_device   (exit 0 when everything worked)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/device_kernels.h"
#include "strata/engine.h"

namespace {

float Load(const void* p, strata::DType dt, size_t i) {
  switch (dt) {
    case strata::DType::kBF16:
      return strata::Bf16ToFloat(static_cast<const strata::bf16_t*>(p)[i]);
    case strata::DType::kF16:
      return strata::HalfToFloat(static_cast<const strata::f16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

void Store(void* p, strata::DType dt, size_t i, float v) {
  switch (dt) {
    case strata::DType::kBF16:
      static_cast<strata::bf16_t*>(p)[i] = strata::FloatToBf16(v);
      break;
    case strata::DType::kF16:
      static_cast<strata::f16_t*>(p)[i] = strata::FloatToHalf(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

// The vendor's device: memory and copies delegated, kernels its own. Kernels run synchronously
// (each call completes before it returns), which the stream contract allows.
class VendorDevice final : public strata::Device, public strata::kernels::DeviceKernels {
 public:
  explicit VendorDevice(std::unique_ptr<strata::Device> memory) : memory_(std::move(memory)) {}

  std::string name() const override { return "vendor:0 (example)"; }
  bool host_addressable() const override { return false; }
  strata::Result<void*> Allocate(uint64_t size_bytes) override {
    return memory_->Allocate(size_bytes);
  }
  strata::Status Free(void* ptr) override { return memory_->Free(ptr); }
  strata::Status CopyAsync(strata::CopyDir dir, void* dst, const void* src, uint64_t size_bytes,
                           strata::CopyCallback done) override {
    return memory_->CopyAsync(dir, dst, src, size_bytes, std::move(done));
  }
  strata::Result<std::unique_ptr<strata::DeviceEvent>> RecordEvent(strata::CopyDir dir) override {
    return memory_->RecordEvent(dir);
  }
  strata::Status Synchronize() override { return memory_->Synchronize(); }
  strata::Status RegisterHost(void* ptr, uint64_t size_bytes) override {
    return memory_->RegisterHost(ptr, size_bytes);
  }
  strata::Status UnregisterHost(void* ptr) override { return memory_->UnregisterHost(ptr); }
  strata::DeviceStats stats() const override { return memory_->stats(); }
  strata::kernels::DeviceKernels* kernels() override { return this; }

  // --- DeviceKernels (the header's formulas, element by element) ---
  strata::Status AdamStep(const strata::kernels::AdamHyper& h,
                          const strata::kernels::AdamShard& s) override {
    if (s.n > 0 && (!s.master || !s.exp_avg || !s.exp_avg_sq || !s.grad)) {
      return strata::Status::InvalidArgument("AdamStep: null array");
    }
    ++adam_calls;
    const double bc1 = h.bias_correction ? 1 - std::pow(double(h.beta1), double(h.step)) : 1;
    const double bc2 = h.bias_correction ? 1 - std::pow(double(h.beta2), double(h.step)) : 1;
    const float step_size = static_cast<float>(h.lr / bc1);
    const float inv_sqrt_bc2 = static_cast<float>(1 / std::sqrt(bc2));
    for (size_t i = 0; i < s.n; ++i) {
      float p = s.master[i], g = Load(s.grad, s.grad_dtype, i) * h.grad_scale;
      if (h.decoupled_weight_decay) {
        p *= 1 - h.lr * h.weight_decay;
      } else {
        g += h.weight_decay * p;
      }
      const float m = h.beta1 * s.exp_avg[i] + (1 - h.beta1) * g;
      const float v = h.beta2 * s.exp_avg_sq[i] + (1 - h.beta2) * g * g;
      p -= step_size * m / (std::sqrt(v) * inv_sqrt_bc2 + h.eps);
      s.master[i] = p;
      s.exp_avg[i] = m;
      s.exp_avg_sq[i] = v;
      if (s.param_out) Store(s.param_out, s.param_out_dtype, i, p);
    }
    return strata::Status::OK();
  }
  strata::Status AccumulateGrad(float* acc, const void* grad, strata::DType dt, float scale,
                                bool overwrite, size_t n) override {
    ++accumulate_calls;
    for (size_t i = 0; i < n; ++i) {
      const float g = Load(grad, dt, i) * scale;
      acc[i] = overwrite ? g : acc[i] + g;
    }
    return strata::Status::OK();
  }
  strata::Status ChunkSumSquares(const void* grad, strata::DType dt, size_t n, double* chunk_sums,
                                 bool* nonfinite) override {
    ++stats_calls;
    bool bad = false;
    for (size_t c = 0; c * strata::kernels::kStatsChunk < n; ++c) {
      double sum = 0;
      const size_t end = std::min(n, (c + 1) * strata::kernels::kStatsChunk);
      for (size_t i = c * strata::kernels::kStatsChunk; i < end; ++i) {
        const double x = Load(grad, dt, i);
        bad |= !std::isfinite(x);
        sum += x * x;
      }
      chunk_sums[c] = sum;
    }
    *nonfinite = bad;
    return strata::Status::OK();
  }
  strata::Status Cast(const void* in, strata::DType in_dtype, void* out, strata::DType out_dtype,
                      size_t n) override {
    ++cast_calls;
    for (size_t i = 0; i < n; ++i) Store(out, out_dtype, i, Load(in, in_dtype, i));
    return strata::Status::OK();
  }
  strata::Status Zero(void* ptr, uint64_t bytes) override {
    std::memset(ptr, 0, bytes);
    return strata::Status::OK();
  }
  strata::Status Synchronize(std::chrono::nanoseconds) override { return strata::Status::OK(); }

  std::atomic<int> adam_calls{0}, accumulate_calls{0}, stats_calls{0}, cast_calls{0};

 private:
  std::unique_ptr<strata::Device> memory_;
};

int Fail(const char* what, const strata::Status& s) {
  std::fprintf(stderr, "custom_device: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

}  // namespace

int main() {
  auto memory = strata::CreateHostDevice(strata::HostDeviceOptions{.budget_bytes = 64 << 20});
  if (!memory.ok()) return Fail("memory", memory.status());
  VendorDevice device(std::move(*memory));

  // Optimizer state on the device (no offload): the engine steps it with the device's kernels.
  auto cfg = strata::ParseDeepSpeedConfig(
      R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
          "zero_optimization": {"stage": 2}})");
  if (!cfg.ok()) return Fail("config", cfg.status());
  strata::GlooCommOptions go;  // one rank
  auto comm = strata::CreateGlooCommunicator(go);
  if (!comm.ok()) return Fail("communicator", comm.status());
  strata::ModelSpec model;
  model.groups = {{"layer0", {{"weight", {64, 32}}, {"bias", {64}}}}};
  strata::EngineOptions eo;
  eo.config = cfg->config;
  eo.device = &device;
  eo.comm = comm->get();
  eo.use_pinned_pool = false;
  auto engine = strata::Engine::Create(model, std::move(eo));
  if (!engine.ok()) return Fail("engine", engine.status());
  strata::Engine& e = **engine;
  strata::Status st = e.InitParameters([](size_t, size_t, size_t b, size_t end, float* out) {
    for (size_t i = b; i < end; ++i) out[i - b] = 0.0f;
  });
  if (!st.ok()) return Fail("init", st);

  // loss = 0.5 |w - t|^2; the trainer reaches device memory only through copies.
  const size_t n = model.groups[0].numel();
  std::vector<strata::bf16_t> w(n), grad(n);
  double first_loss = 0, loss = 0;
  for (int step = 0; step < 20; ++step) {
    auto p = e.Gather(0);
    if (!p.ok()) return Fail("gather", p.status());
    st = device.CopyAsync(strata::CopyDir::kDeviceToHost, w.data(), p->data(), n * 2, nullptr);
    if (st.ok()) st = device.Synchronize();
    if (!st.ok()) return Fail("copy params", st);
    loss = 0;
    for (size_t i = 0; i < n; ++i) {
      const float d = strata::Bf16ToFloat(w[i]) - (0.25f * static_cast<float>(i % 7) - 0.75f);
      loss += 0.5 * d * d;
      grad[i] = strata::FloatToBf16(d);
    }
    e.Release(std::move(*p));
    auto buf = e.GradBuffer(0);
    if (!buf.ok()) return Fail("grad buffer", buf.status());
    st = device.CopyAsync(strata::CopyDir::kHostToDevice, *buf, grad.data(), n * 2, nullptr);
    if (st.ok()) st = device.Synchronize();
    if (st.ok()) st = e.ReduceGradients(0);
    if (!st.ok()) return Fail("gradients", st);
    auto rep = e.Step();
    if (!rep.ok()) return Fail("step", rep.status());
    if (step == 0) first_loss = loss;
  }
  std::printf(
      "custom_device: loss %.4f -> %.4f; kernels: adam %d, accumulate %d, stats %d, cast %d\n",
      first_loss, loss, device.adam_calls.load(), device.accumulate_calls.load(),
      device.stats_calls.load(), device.cast_calls.load());
  const bool kernels_ran =
      device.adam_calls > 0 && device.accumulate_calls > 0 && device.stats_calls > 0;
  if (!kernels_ran) std::fprintf(stderr, "custom_device: the engine did not use the kernels\n");
  return kernels_ran && loss < 0.5 * first_loss ? 0 : 1;
}
