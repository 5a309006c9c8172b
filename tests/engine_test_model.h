// The engine's equivalence model: a small tied-weight MLP with hand-written forward and backward,
// trained by the real engine on HostDevice + Gloo (one thread per rank), and a plain
// single-process fp32 AdamW reference.
//
//   h0 = tanh(W0 x + b0)        W0 [32 x 24]  (group "embed"), b0 [32] ("embed.bias")
//   h1 = tanh(W1 h0 + b1)       W1 [40 x 32]  ("mid"),         b1 [40] ("mid.bias")
//   h2 = tanh(W2 h1 + b2)       W2 [36 x 40], b2 [36] ("top"; W2 is 36 x 40 so shapes differ)
//   y  = W0' (h2[0:32])         the tied output projection: W0 is gathered again at the end of
//                               forward and at the start of backward
//   loss = mean over the micro-batch of 0.5 |y - t|^2
// Biases are under the persistence threshold the tests configure; "top" holds a weight and a bias.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cpu/gloo_comm.h"
#include "cpu/rendezvous/file_store.h"
#include "multiprocess.h"
#include "nvme/sim_backend.h"
#ifdef STRATA_ENGINE_TEST_CUDA
#include "gpu/nccl_comm.h"
#endif
#include "strata/comm.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/engine.h"

namespace strata::testing {

inline constexpr int kIn = 24, kH0 = 32, kH1 = 40, kH2 = 36;
inline constexpr int kBatch = 3;  // samples per micro-batch per rank

enum G : size_t { kEmbed = 0, kEmbedBias, kMid, kMidBias, kTop, kGroups };

inline ModelSpec TestModel() {
  ModelSpec m;
  m.groups = {
      {"embed", {{"W0", {kH0, kIn}}}},
      {"embed.bias", {{"b0", {kH0}}}},
      {"mid", {{"W1", {kH1, kH0}}}},
      {"mid.bias", {{"b1", {kH1}}}},
      {"top", {{"W2", {kH2, kH1}}, {"b2", {kH2}}}},
  };
  return m;
}

// Deterministic values in [-1, 1) from a key.
inline float Noise(uint64_t key) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ULL;
  key ^= key >> 33;
  return static_cast<float>(static_cast<double>(key >> 11) / static_cast<double>(1ull << 52)) -
         1.0f;
}

// Initial weights: params[g][p] as full fp32 tensors.
inline std::vector<std::vector<std::vector<float>>> InitialWeights() {
  const ModelSpec m = TestModel();
  std::vector<std::vector<std::vector<float>>> w(m.groups.size());
  for (size_t g = 0; g < m.groups.size(); ++g) {
    for (size_t p = 0; p < m.groups[g].params.size(); ++p) {
      const size_t n = m.groups[g].params[p].numel();
      std::vector<float> t(n);
      const float scale = m.groups[g].params[p].shape.size() == 2 ? 0.3f : 0.05f;
      for (size_t i = 0; i < n; ++i) t[i] = scale * Noise(1000003ull * (g * 16 + p + 1) + i);
      w[g].push_back(std::move(t));
    }
  }
  return w;
}

// Sample s of micro-batch (step, micro, rank): input x[kIn], target t[kIn].
inline void Sample(int step, int micro, int rank, int s, float* x, float* t) {
  const uint64_t base = ((static_cast<uint64_t>(step) * 64 + micro) * 64 + rank) * 64 + s;
  for (int i = 0; i < kIn; ++i) {
    x[i] = Noise(base * 1000 + i);
    t[i] = 0.5f * Noise(base * 1000 + 500 + i);
  }
}

// Float views of the model's params: W0, b0, W1, b1, W2, b2.
struct Params {
  std::vector<float> W0, b0, W1, b1, W2, b2;
};
using Grads = Params;

inline void ZeroLike(const Params& p, Grads* g) {
  g->W0.assign(p.W0.size(), 0);
  g->b0.assign(p.b0.size(), 0);
  g->W1.assign(p.W1.size(), 0);
  g->b1.assign(p.b1.size(), 0);
  g->W2.assign(p.W2.size(), 0);
  g->b2.assign(p.b2.size(), 0);
}

// Adds the gradient of the micro-batch's loss (times `loss_mult`) to *g; returns the loss.
inline double ForwardBackward(const Params& p, int step, int micro, int rank, float loss_mult,
                              Grads* g) {
  double loss = 0;
  for (int s = 0; s < kBatch; ++s) {
    float x[kIn], t[kIn], h0[kH0], h1[kH1], h2[kH2], y[kIn];
    Sample(step, micro, rank, s, x, t);
    for (int i = 0; i < kH0; ++i) {
      float a = p.b0[i];
      for (int j = 0; j < kIn; ++j) a += p.W0[i * kIn + j] * x[j];
      h0[i] = std::tanh(a);
    }
    for (int i = 0; i < kH1; ++i) {
      float a = p.b1[i];
      for (int j = 0; j < kH0; ++j) a += p.W1[i * kH0 + j] * h0[j];
      h1[i] = std::tanh(a);
    }
    for (int i = 0; i < kH2; ++i) {
      float a = p.b2[i];
      for (int j = 0; j < kH1; ++j) a += p.W2[i * kH1 + j] * h1[j];
      h2[i] = std::tanh(a);
    }
    for (int j = 0; j < kIn; ++j) {
      float a = 0;
      for (int i = 0; i < kH0; ++i) a += p.W0[i * kIn + j] * h2[i];
      y[j] = a;
    }
    // Backward of loss_mult * mean_s 0.5 |y - t|^2.
    const float k = loss_mult / kBatch;
    float dy[kIn], dh2[kH2] = {}, dh1[kH1] = {}, dh0[kH0] = {};
    for (int j = 0; j < kIn; ++j) {
      dy[j] = k * (y[j] - t[j]);
      loss += 0.5 * (y[j] - t[j]) * (y[j] - t[j]) / kBatch;
    }
    for (int i = 0; i < kH0; ++i) {
      for (int j = 0; j < kIn; ++j) {
        g->W0[i * kIn + j] += h2[i] * dy[j];
        dh2[i] += p.W0[i * kIn + j] * dy[j];
      }
    }
    for (int i = 0; i < kH2; ++i) {
      const float da = dh2[i] * (1 - h2[i] * h2[i]);
      g->b2[i] += da;
      for (int j = 0; j < kH1; ++j) {
        g->W2[i * kH1 + j] += da * h1[j];
        dh1[j] += p.W2[i * kH1 + j] * da;
      }
    }
    for (int i = 0; i < kH1; ++i) {
      const float da = dh1[i] * (1 - h1[i] * h1[i]);
      g->b1[i] += da;
      for (int j = 0; j < kH0; ++j) {
        g->W1[i * kH0 + j] += da * h0[j];
        dh0[j] += p.W1[i * kH0 + j] * da;
      }
    }
    for (int i = 0; i < kH0; ++i) {
      const float da = dh0[i] * (1 - h0[i] * h0[i]);
      g->b0[i] += da;
      for (int j = 0; j < kIn; ++j) g->W0[i * kIn + j] += da * x[j];
    }
  }
  return loss;
}

// The group's tensors as float vectors, in group order.
// Whether two runs' master weights are the same bits.
inline bool BitEqual(const std::vector<std::vector<float>>& a,
                     const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t g = 0; g < a.size(); ++g) {
    if (a[g].size() != b[g].size() ||
        std::memcmp(a[g].data(), b[g].data(), a[g].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

// ||a - b|| / ||b - init||: the error relative to how far training moved the weights.
inline double RelativeUpdateError(const std::vector<std::vector<float>>& a,
                                  const std::vector<std::vector<float>>& b,
                                  const std::vector<std::vector<float>>& init) {
  double num = 0, den = 0;
  for (size_t g = 0; g < a.size(); ++g) {
    for (size_t i = 0; i < a[g].size(); ++i) {
      num += (double(a[g][i]) - b[g][i]) * (double(a[g][i]) - b[g][i]);
      den += (double(b[g][i]) - init[g][i]) * (double(b[g][i]) - init[g][i]);
    }
  }
  return std::sqrt(num / den);
}

// The largest |a - b| over every element of two runs' master weights.
inline double MaxAbsDiff(const std::vector<std::vector<float>>& a,
                         const std::vector<std::vector<float>>& b) {
  double d = 0;
  for (size_t g = 0; g < a.size(); ++g) {
    for (size_t i = 0; i < a[g].size(); ++i) d = std::max(d, std::fabs(double(a[g][i]) - b[g][i]));
  }
  return d;
}

inline std::vector<std::vector<float>*> GroupTensors(Params& p, size_t g) {
  switch (g) {
    case kEmbed:
      return {&p.W0};
    case kEmbedBias:
      return {&p.b0};
    case kMid:
      return {&p.W1};
    case kMidBias:
      return {&p.b1};
    default:
      return {&p.W2, &p.b2};
  }
}

// Reads a gathered group, copied to host memory at `host`, into float tensors.
inline void Unpack(const GatheredGroup& gg, const uint8_t* host,
                   std::vector<std::vector<float>*> out) {
  const size_t elt = DTypeSize(gg.dtype());
  for (size_t i = 0; i < out.size(); ++i) {
    const size_t n = out[i]->size();
    const uint8_t* at =
        host + (static_cast<const uint8_t*>(gg.param(i)) - static_cast<const uint8_t*>(gg.data()));
    (void)elt;
    if (gg.dtype() == DType::kF32) {
      std::memcpy(out[i]->data(), at, n * 4);
    } else {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(at);
      for (size_t j = 0; j < n; ++j) {
        (*out[i])[j] =
            gg.dtype() == DType::kBF16 ? Bf16ToFloat(bf16_t{src[j]}) : HalfToFloat(f16_t{src[j]});
      }
    }
  }
}

// Writes float gradients into a group's gradient buffer in `dt`.
inline void Pack(DType dt, std::vector<std::vector<float>*> in, void* dst) {
  size_t off = 0;
  for (auto* t : in) {
    for (float v : *t) {
      if (dt == DType::kF32) {
        std::memcpy(static_cast<float*>(dst) + off, &v, 4);
      } else if (dt == DType::kBF16) {
        static_cast<uint16_t*>(dst)[off] = FloatToBf16(v).bits;
      } else {
        static_cast<uint16_t*>(dst)[off] = FloatToHalf(v).bits;
      }
      ++off;
    }
  }
}

struct RunResult {
  Status status;
  std::vector<std::vector<float>> master;  // per group (rank 0's read-back)
  std::vector<StepReport> reports;         // rank 0's
  std::vector<EngineStats> stats;          // per rank, after the run
  std::vector<EngineLayout> layouts;       // per rank
  std::vector<Status> rank_status;         // per rank
};

// The trainer's wait for its own copy: the copies queued so far in direction `dir` (not the
// whole device: the engine's copies in the other direction may be held up).
inline Status WaitForCopies(Device& device, CopyDir dir) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<DeviceEvent> ev, device.RecordEvent(dir));
  return ev->Wait(std::chrono::seconds(60));
}

struct RunSpec {
  std::string config_json;
  int world = 1;
  int steps = 3;
  int gas = 1;  // must match the config
  IoBackendKind io = IoBackendKind::kSimulated;
  PerTier<uint64_t> budgets{};
  uint64_t device_budget = 64ull << 20;
  // Called on rank r after its gradients of (step, micro) are computed, before they are packed:
  // lets a test poison them.
  std::function<void(int rank, int step, int micro, Grads*)> tamper;
  // Called before each step on every rank (e.g. to inject a fault).
  std::function<void(int rank, int step, Engine&)> before_step;
  // Called on every rank after the step's gradients were all reduced, right before Step().
  std::function<void(int rank, int step, Engine&, nvme::SimBackend* sim)> before_engine_step;
  // With the simulated backend: called before each step on every rank (inject IO faults).
  std::function<void(int rank, int step, nvme::SimBackend&)> inject;
  bool use_pinned_pool = false;
  // Adjusts rank r's engine options before Create.
  std::function<void(int rank, EngineOptions&)> tweak;
  // CudaDevice + NCCL (one rank; tests built with STRATA_ENGINE_TEST_CUDA) instead of HostDevice
  // + Gloo.
  bool cuda = false;
  // Rank r's device instead of HostDevice (with Gloo), owned by the caller and outliving the run.
  std::function<Device*(int rank)> device;
  // Rank die_rank returns (destroying its engine and communicator) before step die_step.
  int die_rank = -1, die_step = -1;
  std::chrono::milliseconds timeout{60000};
  // Checkpoint tests: `init` replaces InitFromFullTensors (e.g. loads a checkpoint); the run
  // takes steps first_step .. steps-1 (the data of those steps); `after_step` runs on every rank
  // after each Step (e.g. saves).
  std::function<Status(int rank, Engine&)> init;
  // Runs on every rank after the default InitFromFullTensors (when `init` is not set): a load
  // that keeps some of the initial values.
  std::function<Status(int rank, Engine&)> after_init;
  int first_step = 0;
  std::function<Status(int rank, int step, Engine&)> after_step;
  // Runs on every rank after micro-step `micro` of `step` has reduced its gradients (the last
  // one's before before_engine_step): a call inside the accumulation window.
  std::function<Status(int rank, int step, int micro, Engine&)> after_micro;
  // The trainer's stream for GradBuffer, ReduceGradients and Release (device.h; a token on an
  // emulated device), or none.
  std::optional<uintptr_t> caller_stream;
  // A group the trainer keeps gathered (a second handle, taken in the forward) until every
  // reduction of the micro-step is queued, and `hold_for` longer: a module held across its
  // backward.
  std::optional<size_t> hold_gathered;
  std::chrono::milliseconds hold_for{0};
  // The model the engine is created with (default TestModel(); training needs TestModel()).
  std::optional<ModelSpec> model;
  // EngineOptions::ranks_per_node (ZeRO++'s node groups; 0: from the environment).
  int ranks_per_node = 0;
  // The data (micro, rank) that rank `rank`'s micro-step `micro` trains on (default: its own),
  // so that a run at another world size and accumulation sees the same global batch.
  std::function<std::pair<int, int>(int rank, int micro)> data_key;
};

// Runs `body` on `world` threads, one rank each, with a Gloo communicator (rendezvous in
// `rdzv_dir`) and a HostDevice, and EngineOptions holding `config` and both (no pinned pool);
// returns each rank's status.
inline std::vector<Status> OnHostRanks(
    int world, const std::string& rdzv_dir, const EngineConfig& config,
    const std::function<Status(int rank, EngineOptions options)>& body) {
  std::vector<Status> st(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      st[r] = [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(auto store, cpu::FileKvStore::Open(rdzv_dir));
        GlooCommOptions go;
        go.rank = r;
        go.world_size = world;
        go.store = store.get();
        STRATA_ASSIGN_OR_RETURN(auto comm, CreateGlooCommunicator(go));
        STRATA_ASSIGN_OR_RETURN(auto dev, CreateHostDevice({}));
        EngineOptions eo;
        eo.config = config;
        eo.device = dev.get();
        eo.comm = comm.get();
        eo.use_pinned_pool = false;
        return body(r, std::move(eo));
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  return st;
}

// Runs the engine's training of TestModel on `world` threads; returns rank 0's master weights.
inline RunResult RunEngine(const RunSpec& spec) {
  RunResult res;
  auto parsed = ParseDeepSpeedConfig(spec.config_json);
  if (!parsed.ok()) {
    res.status = parsed.status();
    return res;
  }
  const std::string dir = UniqueTestDir("engine");
  // Removed however the run ends (a failing run returns early); never the root it falls back to.
  const std::unique_ptr<const std::string, void (*)(const std::string*)> remove_dir(
      &dir, [](const std::string* d) {
        if (std::filesystem::path(*d).filename().string().rfind("engine.", 0) == 0) {
          std::error_code ec;
          std::filesystem::remove_all(*d, ec);
        }
      });
  const std::string nvme = dir + "/nvme";
  ::mkdir(nvme.c_str(), 0700);
  const auto init = InitialWeights();
  std::vector<Status> statuses(spec.world);
  std::vector<std::vector<std::vector<float>>> masters(spec.world);
  res.stats.resize(spec.world);
  res.layouts.resize(spec.world);
  auto rank_main = [&](int r) -> Status {
    STRATA_ASSIGN_OR_RETURN(auto store, cpu::FileKvStore::Open(dir + "/rdzv"));
    std::unique_ptr<Communicator> comm;
    std::unique_ptr<Device> dev;
    if (spec.cuda) {
#ifdef STRATA_ENGINE_TEST_CUDA
      CudaDeviceOptions co;
      co.budget_bytes = spec.device_budget;
      STRATA_ASSIGN_OR_RETURN(dev, CreateCudaDevice(co));
      NcclCommOptions no;
      STRATA_ASSIGN_OR_RETURN(no.unique_id, NewNcclUniqueId());
      STRATA_ASSIGN_OR_RETURN(comm, CreateNcclCommunicator(no));
#else
      return Status::Unavailable("built without STRATA_ENGINE_TEST_CUDA");
#endif
    } else {
      GlooCommOptions go;
      go.rank = r;
      go.world_size = spec.world;
      go.store = store.get();
      go.timeout = spec.timeout;
      STRATA_ASSIGN_OR_RETURN(comm, CreateGlooCommunicator(go));
      HostDeviceOptions ho;
      ho.budget_bytes = spec.device_budget;
      STRATA_ASSIGN_OR_RETURN(dev, CreateHostDevice(ho));
    }
    Device* const device = spec.device ? spec.device(r) : dev.get();
    // Device memory through host staging when the device is not host-addressable (CUDA).
    auto to_host = [&](const void* src, size_t bytes) -> Result<std::vector<uint8_t>> {
      std::vector<uint8_t> h(bytes);
      if (device->host_addressable()) {
        std::memcpy(h.data(), src, bytes);
        return h;
      }
      STRATA_RETURN_IF_ERROR(
          device->CopyAsync(CopyDir::kDeviceToHost, h.data(), src, bytes, nullptr));
      STRATA_RETURN_IF_ERROR(WaitForCopies(*device, CopyDir::kDeviceToHost));
      return h;
    };
    auto to_device = [&](void* dst, const std::vector<uint8_t>& h) -> Status {
      if (device->host_addressable()) {
        std::memcpy(dst, h.data(), h.size());
        return Status::OK();
      }
      STRATA_RETURN_IF_ERROR(
          device->CopyAsync(CopyDir::kHostToDevice, dst, h.data(), h.size(), nullptr));
      return WaitForCopies(*device, CopyDir::kHostToDevice);
    };
    EngineOptions eo;
    eo.config = parsed->config;
    eo.device = device;
    eo.comm = comm.get();
    eo.budget_bytes = spec.budgets;
    eo.nvme_paths = {nvme};
    eo.io_kind = spec.io;
    nvme::SimBackend* sim = nullptr;
    if (spec.io == IoBackendKind::kSimulated) {
      nvme::SimOptions so;
      so.seed = 7 + r;
      so.max_latency_ns = 50'000;
      auto backend = std::make_unique<nvme::SimBackend>(so);
      sim = backend.get();
      eo.io = std::move(backend);
    }
    eo.use_pinned_pool = spec.use_pinned_pool;
    eo.timeout = spec.timeout;
    eo.ranks_per_node = spec.ranks_per_node;
    if (spec.tweak) spec.tweak(r, eo);
    STRATA_ASSIGN_OR_RETURN(auto engine,
                            Engine::Create(spec.model ? *spec.model : TestModel(), std::move(eo)));
    res.layouts[r] = engine->layout();
    std::vector<std::vector<const float*>> ptrs(init.size());
    for (size_t g = 0; g < init.size(); ++g) {
      for (const auto& t : init[g]) ptrs[g].push_back(t.data());
    }
    if (spec.init) {
      STRATA_RETURN_IF_ERROR(spec.init(r, *engine));
    } else {
      STRATA_RETURN_IF_ERROR(engine->InitFromFullTensors(ptrs));
      if (spec.after_init) STRATA_RETURN_IF_ERROR(spec.after_init(r, *engine));
    }
    Params p;
    p.W0.resize(kH0 * kIn);
    p.b0.resize(kH0);
    p.W1.resize(kH1 * kH0);
    p.b1.resize(kH1);
    p.W2.resize(kH2 * kH1);
    p.b2.resize(kH2);
    auto gather = [&](size_t g) -> Status {
      STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, engine->Gather(g));
      STRATA_ASSIGN_OR_RETURN(std::vector<uint8_t> host,
                              to_host(gg.data(), gg.numel() * DTypeSize(gg.dtype())));
      Unpack(gg, host.data(), GroupTensors(p, g));
      if (spec.caller_stream) return engine->Release(std::move(gg), *spec.caller_stream);
      engine->Release(std::move(gg));
      return Status::OK();
    };
    for (int step = spec.first_step; step < spec.steps; ++step) {
      if (r == spec.die_rank && step == spec.die_step) return Status::Aborted("rank died (test)");
      if (spec.before_step) spec.before_step(r, step, *engine);
      if (spec.inject && sim != nullptr) spec.inject(r, step, *sim);
      for (int micro = 0; micro < spec.gas; ++micro) {
        // Forward: every group in order, then W0 again for the tied projection.
        std::optional<GatheredGroup> held;
        if (spec.hold_gathered) {
          STRATA_ASSIGN_OR_RETURN(held, engine->Gather(*spec.hold_gathered));
        }
        for (size_t g = 0; g < kGroups; ++g) STRATA_RETURN_IF_ERROR(gather(g));
        STRATA_RETURN_IF_ERROR(gather(kEmbed));
        // Backward: the tied W0 first, then the layers in reverse.
        STRATA_RETURN_IF_ERROR(gather(kEmbed));
        for (size_t g = kGroups; g-- > 0;) STRATA_RETURN_IF_ERROR(gather(g));
        Grads gr;
        ZeroLike(p, &gr);
        const auto [data_micro, data_rank] =
            spec.data_key ? spec.data_key(r, micro) : std::pair<int, int>{micro, r};
        ForwardBackward(p, step, data_micro, data_rank, static_cast<float>(engine->LossScale()),
                        &gr);
        if (spec.tamper) spec.tamper(r, step, micro, &gr);
        for (size_t g = kGroups; g-- > 0;) {
          if (!engine->model().groups[g].trainable) continue;  // frozen: no gradient
          STRATA_ASSIGN_OR_RETURN(void* buf, engine->GradBuffer(g, spec.caller_stream));
          std::vector<uint8_t> host(TestModel().groups[g].numel() * DTypeSize(engine->dtype()));
          Pack(engine->dtype(), GroupTensors(gr, g), host.data());
          STRATA_RETURN_IF_ERROR(to_device(buf, host));
          STRATA_RETURN_IF_ERROR(engine->ReduceGradients(g, spec.caller_stream));
        }
        if (held) {
          std::this_thread::sleep_for(spec.hold_for);
          engine->Release(std::move(*held));
        }
        if (spec.after_micro) STRATA_RETURN_IF_ERROR(spec.after_micro(r, step, micro, *engine));
      }
      if (spec.before_engine_step) spec.before_engine_step(r, step, *engine, sim);
      STRATA_ASSIGN_OR_RETURN(StepReport rep, engine->Step());
      if (r == 0) res.reports.push_back(rep);
      if (spec.after_step) STRATA_RETURN_IF_ERROR(spec.after_step(r, step, *engine));
    }
    masters[r].resize(kGroups);
    for (size_t g = 0; g < kGroups; ++g) {
      masters[r][g].resize(TestModel().groups[g].numel());
      STRATA_RETURN_IF_ERROR(engine->ReadMaster(g, masters[r][g]));
    }
    res.stats[r] = engine->Stats();
    return Status::OK();
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < spec.world; ++r) threads.emplace_back([&, r] { statuses[r] = rank_main(r); });
  for (auto& t : threads) t.join();
  res.rank_status = statuses;
  for (int r = 0; r < spec.world; ++r) {
    if (!statuses[r].ok()) {
      res.status = Status(statuses[r].code(),
                          "rank " + std::to_string(r) + ": " + std::string(statuses[r].message()));
      return res;
    }
  }
  // Every rank must read back the same master weights.
  for (int r = 1; r < spec.world; ++r) {
    if (masters[r] != masters[0]) {
      res.status = Status::Internal("rank " + std::to_string(r) + " read different master weights");
      return res;
    }
  }
  res.master = std::move(masters[0]);
  return res;
}

// The reference: single-process fp32 AdamW (torch.optim.AdamW's formula) over the same data.
inline std::vector<std::vector<float>> RunReference(int world, int steps, int gas, float lr,
                                                    float wd) {
  const auto init = InitialWeights();
  Params p{init[kEmbed][0],   init[kEmbedBias][0], init[kMid][0],
           init[kMidBias][0], init[kTop][0],       init[kTop][1]};
  Grads m, v;
  ZeroLike(p, &m);
  ZeroLike(p, &v);
  for (int step = 0; step < steps; ++step) {
    Grads sum;
    ZeroLike(p, &sum);
    for (int r = 0; r < world; ++r) {
      for (int micro = 0; micro < gas; ++micro) ForwardBackward(p, step, micro, r, 1.0f, &sum);
    }
    const double bc1 = 1 - std::pow(0.9, step + 1), bc2 = 1 - std::pow(0.999, step + 1);
    for (size_t g = 0; g < kGroups; ++g) {
      auto pt = GroupTensors(p, g), gt = GroupTensors(sum, g), mt = GroupTensors(m, g),
           vt = GroupTensors(v, g);
      for (size_t t = 0; t < pt.size(); ++t) {
        for (size_t i = 0; i < pt[t]->size(); ++i) {
          const float grad = (*gt[t])[i] / static_cast<float>(world * gas);
          float& w = (*pt[t])[i];
          w *= 1 - lr * wd;
          float& mm = (*mt[t])[i];
          float& vv = (*vt[t])[i];
          mm = 0.9f * mm + 0.1f * grad;
          vv = 0.999f * vv + 0.001f * grad * grad;
          w -= static_cast<float>(lr / bc1) * mm /
               (std::sqrt(vv) / static_cast<float>(std::sqrt(bc2)) + 1e-8f);
        }
      }
    }
  }
  std::vector<std::vector<float>> out(kGroups);
  for (size_t g = 0; g < kGroups; ++g) {
    for (auto* t : GroupTensors(p, g)) out[g].insert(out[g].end(), t->begin(), t->end());
  }
  return out;
}

// `config_json` with zero_optimization.offload_optimizer.ratio set to `ratio` (partial offload).
inline std::string WithOffloadRatio(std::string config_json, double ratio) {
  const std::string key = "\"offload_optimizer\": {";
  const size_t at = config_json.find(key);
  if (at == std::string::npos) return config_json;
  config_json.insert(at + key.size(), "\"ratio\": " + std::to_string(ratio) + ", ");
  return config_json;
}

}  // namespace strata::testing
