// `offloadctl bench engine`: one variant, run and measured (see bench_engine.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/zero/engine_stats_json.h"
#include "cpu/gloo_comm.h"
#include "nvme/bench/nvme_bench.h"
#include "sched/placement.h"
#include "strata/device.h"
#include "strata/device_kernels.h"
#include "strata/planner.h"
#include "tools/offloadctl/bench_engine.h"

namespace strata::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Sec(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Deterministic values in [-1, 1) from a key (splitmix64's finaliser).
float Noise(uint64_t key) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ULL;
  key ^= key >> 33;
  return static_cast<float>(static_cast<double>(key >> 11) / static_cast<double>(1ull << 52)) -
         1.0f;
}

// The line on stderr that says where the run is (rank 0 only). On a terminal it is rewritten in
// place; otherwise (a pipe, `offloadctl launch`) each update is a line of its own.
class Progress {
 public:
  Progress(bool active, bool tty) : active_(active), tty_(tty) {}
  ~Progress() { Done(); }
  void Say(const std::string& line) {
    if (!active_) return;
    if (tty_) {
      std::fprintf(stderr, "\r\033[K%s", line.c_str());
      open_ = true;
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  }
  void Done() {
    if (open_) std::fprintf(stderr, "\n");
    open_ = false;
  }

 private:
  bool active_, tty_, open_ = false;
};

std::string FirstLine(std::string_view s) { return std::string(s.substr(0, s.find('\n'))); }

// The planner's placement (include/strata/planner.h) of the same model and setting, per rank, on
// the run's kind of device (`device_kernels`: a GPU; else the host stand-in, whose working set has
// no buffers for a device's kernels).
std::optional<PerTier<double>> PlannerBytes(const EngineConfig& c, const ModelSpec& m,
                                            const EngineVariant& v, int world, double device_bytes,
                                            double host_bytes, bool overlap_step,
                                            bool device_kernels) {
  PlanInput in;
  in.params = static_cast<double>(m.numel());
  for (const GroupSpec& g : m.groups) {
    in.largest_group_params = std::max(in.largest_group_params, static_cast<double>(g.numel()));
  }
  std::vector<std::string> notes;
  ApplyEngineConfig(c, &in, &notes);
  in.zero.speculative_step =
      sched::SpeculationOn(c.zero.offload_optimizer.speculative_step, overlap_step);
  in.zero.speculative_step_given = c.zero.offload_optimizer.speculative_step.has_value();
  in.capacity.gpus_per_node = world;
  in.capacity.nodes = 1;
  in.capacity.hbm_bytes_per_gpu = device_bytes;
  in.capacity.dram_bytes_per_node = host_bytes * world;
  in.capacity.device_kernels = device_kernels;  // the device this run uses, not a GPU's
  if (!ValidatePlanInput(in).ok()) return std::nullopt;
  const Placement pl =
      Place(in, v.stage, v.offload_optimizer, v.offload_param, in.zero.optimizer_ratio);
  PerTier<double> out;
  out[Tier::kDevice] = pl.hbm_bytes_per_gpu;
  out[Tier::kHost] = pl.host_bytes_per_node / world;
  out[Tier::kNvme] = pl.nvme_bytes_per_node / world;
  return out;
}

// Pseudo-random gradients (times the loss scale, as a trainer's backward produces them) in the
// working dtype, scaled so the model's whole gradient has global norm `norm` (--grad-norm) on
// each rank, repeated every kElems elements through the engine's gradient buffers: by
// memcpy where the host addresses the device's memory (HostDevice); else uploaded once as fp32
// and cast into each buffer by the device's kernels, rounded to nearest even as FloatToBf16 /
// FloatToHalf round on the host, so both give the same bits.
class GradPattern {
 public:
  static constexpr size_t kElems = size_t{1} << 16;
  static constexpr uint64_t kDeviceBytes = kElems * sizeof(float);  // on a device it fills
  GradPattern(Device* dev, int rank, std::chrono::nanoseconds timeout, double norm,
              uint64_t model_elems)
      : dev_(dev), rank_(rank), timeout_(timeout), norm_(norm), model_elems_(model_elems) {}
  Status Prepare(DType dt, double loss_scale) {
    if (ready_ && dt == dtype_ && loss_scale == scale_) return Status::OK();
    ready_ = false;
    dtype_ = dt;
    scale_ = loss_scale;
    std::vector<float> v(kElems);
    double sum_sq = 0;
    for (size_t i = 0; i < kElems; ++i) {
      const double x = Noise(i * 31 + rank_);
      sum_sq += x * x;
    }
    // The pattern's root mean square is about 0.58; the model repeats it over model_elems_.
    const double rms = std::sqrt(sum_sq / static_cast<double>(kElems));
    const double amplitude =
        norm_ / (rms * std::sqrt(static_cast<double>(std::max<uint64_t>(1, model_elems_))));
    for (size_t i = 0; i < kElems; ++i) {
      v[i] = static_cast<float>(amplitude * loss_scale) * Noise(i * 31 + rank_);
    }
    if (!dev_->host_addressable()) {
      STRATA_RETURN_IF_ERROR(Upload(v));
    } else {
      Encode(v);
    }
    ready_ = true;
    return Status::OK();
  }
  Status Fill(void* dst, size_t elems) {
    if (!dev_->host_addressable()) return FillOnDevice(dst, elems);
    const size_t elt = DTypeSize(dtype_);
    uint8_t* out = static_cast<uint8_t*>(dst);
    for (size_t done = 0; done < elems; done += kElems) {
      const size_t n = std::min(kElems, elems - done);
      std::memcpy(out + done * elt, bytes_.data(), n * elt);
    }
    return Status::OK();
  }

 private:
  void Encode(const std::vector<float>& v) {
    bytes_.assign(kElems * DTypeSize(dtype_), 0);
    for (size_t i = 0; i < kElems; ++i) {
      if (dtype_ == DType::kF32) {
        std::memcpy(bytes_.data() + i * 4, &v[i], 4);
      } else {
        const uint16_t b = dtype_ == DType::kBF16 ? FloatToBf16(v[i]).bits : FloatToHalf(v[i]).bits;
        std::memcpy(bytes_.data() + i * 2, &b, 2);
      }
    }
  }
  // The fp32 values into device memory, waited for (`v` is freed on return).
  Status Upload(const std::vector<float>& v) {
    if (dev_->kernels() == nullptr) {
      return Status::Unavailable("bench engine: " + dev_->name() +
                                 " is not host-addressable and offers no kernels");
    }
    if (!f32_) {
      STRATA_ASSIGN_OR_RETURN(f32_, DeviceBuffer::Make(dev_, kDeviceBytes));
    }
    STRATA_RETURN_IF_ERROR(
        dev_->CopyAsync(CopyDir::kHostToDevice, f32_.get(), v.data(), kDeviceBytes, {}));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<DeviceEvent> copied,
                            dev_->RecordEvent(CopyDir::kHostToDevice));
    return copied->Wait(timeout_).WithContext("bench engine: uploading the gradient pattern");
  }
  // Casts the pattern chunk by chunk, then waits: ReduceGradients reads the buffer next.
  Status FillOnDevice(void* dst, size_t elems) {
    kernels::DeviceKernels* k = dev_->kernels();
    const size_t elt = DTypeSize(dtype_);
    uint8_t* out = static_cast<uint8_t*>(dst);
    for (size_t done = 0; done < elems; done += kElems) {
      const size_t n = std::min(kElems, elems - done);
      STRATA_RETURN_IF_ERROR(k->Cast(f32_.get(), DType::kF32, out + done * elt, dtype_, n));
    }
    return k->Synchronize(timeout_).WithContext("bench engine: filling a gradient buffer");
  }

  Device* dev_;
  int rank_;
  std::chrono::nanoseconds timeout_;
  double norm_;
  uint64_t model_elems_;
  bool ready_ = false;
  DType dtype_ = DType::kF32;
  double scale_ = 0;
  std::vector<uint8_t> bytes_;  // host-addressable device: the pattern in the working dtype
  DeviceBuffer f32_;            // else: the fp32 values in device memory
};

struct StepSample {
  double wall_s = 0;
  StepTimings t;
  StepPhases phases;
  size_t speculated = 0, rolled_back = 0;  // StepReport's sub-group counts
  bool clipped = false, skipped = false;   // StepReport's clip coefficient > 1, overflow
};

// Times one phase of a step and the store's NVMe bytes in it (bench_engine.h, StepPhases).
class PhaseClock {
 public:
  PhaseClock(const Engine& e, PhaseFigures* into)
      : e_(e), into_(into), t0_(Clock::now()), e0_(e.Stats()) {}
  ~PhaseClock() {
    const EngineStats es = e_.Stats();
    const StoreStats& s = es.store;
    const StoreStats& s0 = e0_.store;
    into_->seconds += Sec(Clock::now() - t0_);
    into_->nvme_read_bytes += static_cast<double>(NvmeRead(s) - NvmeRead(s0));
    into_->nvme_write_bytes += static_cast<double>(NvmeWrite(s) - NvmeWrite(s0));
    into_->io_busy_s += static_cast<double>(s.io_busy_ns - s0.io_busy_ns) * 1e-9;
    into_->store_wait_s += static_cast<double>(StoreWait(es) - StoreWait(e0_)) * 1e-9;
    into_->host_room_wait_s +=
        static_cast<double>(s.room_wait_ns[Tier::kHost] - s0.room_wait_ns[Tier::kHost]) * 1e-9;
    into_->copy_busy_s += static_cast<double>(s.copy_busy_ns - s0.copy_busy_ns) * 1e-9;
    into_->checksum_s += static_cast<double>(s.checksum_ns - s0.checksum_ns) * 1e-9;
    into_->checksum_idle_s += static_cast<double>(s.checksum_idle_ns - s0.checksum_idle_ns) * 1e-9;
  }
  PhaseClock(const PhaseClock&) = delete;
  PhaseClock& operator=(const PhaseClock&) = delete;

 private:
  static uint64_t StoreWait(const EngineStats& x) {
    const StepTimings& t = x.timings;
    return t.gather_fetch_wait_ns + t.grad_lease_wait_ns + t.optimizer_io_wait_ns;
  }

  const Engine& e_;
  PhaseFigures* into_;
  Clock::time_point t0_;
  EngineStats e0_;
};

// Whether group `g` is a layer (a weight group): the simulated compute runs per layer use; the
// bias groups of --bias-groups ride along with their layer's.
bool IsLayer(const Engine& e, size_t g) { return !e.model().groups[g].name.ends_with(".bias"); }

// What the trainer does besides the engine's calls: the simulated compute per layer use (a
// kernel on `spin`'s GPU, else a sleep) and the gradients.
struct SimulatedWork {
  double compute_ms = 0;
  GpuSpin* spin = nullptr;
  GradPattern& grads;

  // The layer's compute, begun at `began`: on the host the sleep ends compute_ms after it, so
  // the time the bench spent writing the layer's gradient (a GPU's backward writes it within
  // its kernels' time) is part of the layer's compute, not added to it.
  Status Compute(const Engine& e, size_t g, Clock::time_point began) const {
    if (compute_ms <= 0 || !IsLayer(e, g)) return Status::OK();
    if (spin != nullptr) return spin->Spin(compute_ms).WithContext("simulated compute");
    std::this_thread::sleep_until(began +
                                  std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double, std::milli>(compute_ms)));
    return Status::OK();
  }
};

// One training step of the synthetic model: `gas` micro-steps of forward and backward, then Step.
Result<StepSample> TrainStep(Engine& e, int gas, const SimulatedWork& work) {
  const size_t groups = e.model().groups.size();
  const auto t0 = Clock::now();
  StepSample out;
  for (int micro = 0; micro < gas; ++micro) {
    {
      PhaseClock clock(e, &out.phases.forward);
      for (size_t g = 0; g < groups; ++g) {
        STRATA_ASSIGN_OR_RETURN(GatheredGroup p, e.Gather(g));
        STRATA_RETURN_IF_ERROR(work.Compute(e, g, Clock::now()));
        e.Release(std::move(p));
      }
    }
    PhaseClock clock(e, &out.phases.backward);
    STRATA_RETURN_IF_ERROR(work.grads.Prepare(e.dtype(), e.LossScale()));
    for (size_t g = groups; g-- > 0;) {
      STRATA_ASSIGN_OR_RETURN(GatheredGroup p, e.Gather(g));
      const Clock::time_point began = Clock::now();
      STRATA_ASSIGN_OR_RETURN(void* buf, e.GradBuffer(g));
      STRATA_RETURN_IF_ERROR(work.grads.Fill(buf, e.model().groups[g].numel()));
      STRATA_RETURN_IF_ERROR(work.Compute(e, g, began));
      e.Release(std::move(p));
      STRATA_RETURN_IF_ERROR(e.ReduceGradients(g));
    }
  }
  {
    PhaseClock clock(e, &out.phases.optimizer);
    STRATA_ASSIGN_OR_RETURN(StepReport rep, e.Step());
    out.t = rep.timings;
    out.speculated = rep.speculated_sub_groups;
    out.rolled_back = rep.rolled_back_sub_groups;
    out.clipped = rep.clip_coefficient > 1;
    out.skipped = rep.skipped;
  }
  out.wall_s = Sec(Clock::now() - t0);
  return out;
}

// Creates the engine; nullptr (with *refused set) when the placement does not fit on this rank.
Result<std::unique_ptr<Engine>> CreateOrRefuse(const ModelSpec& model, EngineOptions eo,
                                               std::string* refused) {
  auto created = Engine::Create(model, std::move(eo));
  if (created.ok()) return std::move(*created);
  if (created.status().IsResourceExhausted()) {
    *refused = FirstLine(created.status().message());
    return std::unique_ptr<Engine>();
  }
  return created.status().WithContext("Engine::Create");
}

// --disk-reference-paired-split: the engine brought to rest, every rank's pass over its own swap
// files at once (each its own step's bytes), the slowest rank's phases and all ranks' bytes into
// `r`.
Status PairedDiskPass(const BenchProcess& p, Communicator& comm, Engine& e, size_t index,
                      double read_bytes, double write_bytes, VariantResult* r) {
  STRATA_RETURN_IF_ERROR(e.Flush().WithContext("paired disk reference: Engine::Flush"));
  // Every engine at rest before any rank's pass writes; a pass writes back only what it read, so
  // a step that read nothing from NVMe on some rank has no pass (noted once).
  std::vector<std::string> files = e.nvme_files();
  STRATA_ASSIGN_OR_RETURN(
      std::vector<double> reads,
      AllGatherDoubles(comm, {!files.empty() && read_bytes >= 1.0 ? 1.0 : 0.0}, p.timeout));
  nvme::NvmeRewriteResult pass;
  double all_s = 0, rd_s = 0, wr_s = 0, rd = 0, wr = 0, span = 0;
  if (std::find(reads.begin(), reads.end(), 0.0) != reads.end()) {
    const std::string note =
        "paired disk reference: a step read nothing from NVMe on some rank (or it has no NVMe "
        "tier), so no pass followed it: a pass writes back only what it read";
    if (std::find(r->notes.begin(), r->notes.end(), note) == r->notes.end()) {
      r->notes.push_back(note);
    }
  } else {
    // Phases of up to 1 GiB (the default buffer): each drain idles the queue for about one IO's
    // latency, under 1 % of a phase here.
    nvme::NvmeRewriteOptions o;
    o.files = std::move(files);
    o.read_bytes = static_cast<uint64_t>(read_bytes);
    o.write_bytes = static_cast<uint64_t>(write_bytes);
    o.block_bytes = TieredStoreOptions{}.stripe_unit_bytes;  // the engine leaves it at the default
    o.queue_depth = r->io_queue_depth;
    o.first_unit = index * 104729;  // successive passes start elsewhere
    o.backend = p.io_kind;
    auto ran = nvme::RunNvmeRewrite(o);
    if (ran.ok()) pass = *ran;
    const Status st = ran.status();
    // Every rank reports (a failed pass as -1), so none waits for a peer that gave up.
    STRATA_ASSIGN_OR_RETURN(
        std::vector<double> all,
        AllGatherDoubles(
            comm,
            {st.ok() ? pass.read_seconds : -1.0, pass.write_seconds,
             static_cast<double>(pass.read_bytes), static_cast<double>(pass.write_bytes),
             static_cast<double>(pass.span_bytes)},
            p.timeout));
    STRATA_RETURN_IF_ERROR(st.WithContext("paired disk reference"));
    for (int q = 0; q < p.world; ++q) {
      const double* f = all.data() + 5 * q;
      if (f[0] < 0) {
        return Status::Aborted("paired disk reference: rank " + std::to_string(q) +
                               "'s pass failed (its own error says why)");
      }
      all_s = std::max(all_s, f[0] + f[1]);
      rd_s = std::max(rd_s, f[0]);
      wr_s = std::max(wr_s, f[1]);
      rd += f[2];
      wr += f[3];
      span += f[4];
    }
    r->paired_span_bytes = span;
  }
  // Aligned with the steps: 0 is no pass.
  r->paired_split_s.push_back(all_s);
  r->paired_split_read_s.push_back(rd_s);
  r->paired_split_write_s.push_back(wr_s);
  r->paired_read_bytes.push_back(rd);
  r->paired_write_bytes.push_back(wr);
  return Status::OK();
}

// A variant's device and communicators. `comm` is Gloo, always: the bench's own exchanges
// (AllGatherDoubles, the paired disk pass, the checkpoint pairs) move host memory, which NCCL
// cannot. The engine's is NCCL on cuda (device memory), else `comm` itself.
struct VariantBackend {
  bool cuda = false;  // every rank on its GPU
  std::unique_ptr<Device> device;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Communicator> engine_comm;  // cuda: NCCL
  std::unique_ptr<GpuSpin> spin;              // cuda with --compute-ms
  Communicator& engine() { return engine_comm ? *engine_comm : *comm; }
};

// The device on cuda: the CudaDevice pool with room for the bench's gradient pattern beside the
// engine's budget (the engine accounts for every byte of its own).
Result<std::unique_ptr<Device>> MakeDevice(const BenchProcess& p, bool cuda, double device_bytes) {
  if (!cuda) {
    HostDeviceOptions ho;
    ho.budget_bytes = static_cast<uint64_t>(device_bytes);
    return CreateHostDevice(ho);
  }
  CudaDeviceOptions co;
  co.device_ordinal = p.device_ordinal;
  co.budget_bytes = static_cast<uint64_t>(device_bytes) + GradPattern::kDeviceBytes;
  return CreateCudaDevice(co);
}

// Creates the variant's backend (collective). `key` numbers its rendezvous keys.
Result<VariantBackend> MakeVariantBackend(const BenchEngineArgs& a, const BenchProcess& p,
                                          const std::string& key, double device_bytes) {
  VariantBackend b;
  GlooCommOptions go;
  go.rank = p.rank;
  go.world_size = p.world;
  go.store = p.rendezvous.get();
  go.store_prefix = key;
  go.timeout = p.timeout;
  STRATA_ASSIGN_OR_RETURN(b.comm, CreateGlooCommunicator(go));
  // --device auto decides per rank (--device cuda fails on a rank without a GPU): the GPU only
  // when every rank has one, since NCCL would wait for a rank on the host.
  STRATA_ASSIGN_OR_RETURN(std::vector<double> on,
                          AllGatherDoubles(*b.comm, {p.cuda ? 1.0 : 0.0}, p.timeout));
  b.cuda = std::count(on.begin(), on.end(), 1.0) == p.world;
  STRATA_ASSIGN_OR_RETURN(b.device, MakeDevice(p, b.cuda, device_bytes));
  if (!b.cuda) return b;
  STRATA_ASSIGN_OR_RETURN(b.engine_comm, MakeEngineNccl(p.rank, p.world, p.device_ordinal,
                                                        p.rendezvous.get(), key + "/nccl",
                                                        p.timeout));
  if (a.compute_ms > 0) {
    STRATA_ASSIGN_OR_RETURN(b.spin, MakeGpuSpin(p.device_ordinal));
  }
  return b;
}

// The device's copies per measured step and its pool's peak into `f`.
void DeviceFigures(const DeviceStats& before, const DeviceStats& after, double steps,
                   RankFigures* f) {
  const auto moved = [&](CopyDir d) {
    const size_t i = static_cast<size_t>(d);
    return static_cast<double>(after.bytes_copied[i] - before.bytes_copied[i]) / steps;
  };
  f->h2d_bytes_per_step = moved(CopyDir::kHostToDevice);
  f->d2h_bytes_per_step = moved(CopyDir::kDeviceToHost);
  f->device_peak_used_bytes = static_cast<double>(after.peak_used_bytes);
}

// Warm-up and measured steps; fills the timing fields and this rank's figures of `r`.
Status MeasureSteps(const BenchEngineArgs& a, const BenchProcess& p, VariantBackend& b, Engine& e,
                    Progress& progress, VariantResult* r) {
  Communicator& comm = *b.comm;
  uint64_t model_elems = 0;
  for (const GroupSpec& gs : e.model().groups) model_elems += gs.numel();
  GradPattern grads(b.device.get(), p.rank, p.timeout, a.grad_norm, model_elems);
  const SimulatedWork work{a.compute_ms, b.spin.get(), grads};
  StepPhases phases;  // means over the measured steps
  EngineStats before = e.Stats();
  DeviceStats device_before = b.device->stats();
  const int total = a.warmup_steps + a.steps;
  for (int s = 0; s < total; ++s) {
    if (s == a.warmup_steps) {
      // overlap_step: the warm-up's step ends before the measured ones start (else the first
      // measured step would carry it; no-op without overlap). Its optimizer timings are then
      // reported by the first measured Step and the last step's by none: the breakdown still
      // averages `steps` optimizer steps.
      STRATA_RETURN_IF_ERROR(e.Synchronize().WithContext("the warm-up's step"));
      before = e.Stats();
      device_before = b.device->stats();
    }
    const EngineStats step_before = e.Stats();
    STRATA_ASSIGN_OR_RETURN(StepSample x, TrainStep(e, r->gradient_accumulation_steps, work));
    if (s + 1 == total) {
      // The last step's optimizer, which overlap_step leaves running: it is this step's.
      const auto t0 = Clock::now();
      PhaseClock clock(e, &x.phases.optimizer);
      STRATA_RETURN_IF_ERROR(e.Synchronize().WithContext("the last step"));
      x.wall_s += Sec(Clock::now() - t0);
    }
    char line[200];
    std::snprintf(line, sizeof line, "bench engine: %s: step %d/%d%s: %.3f s",
                  r->variant.Name().c_str(), s + 1, total, s < a.warmup_steps ? " (warm-up)" : "",
                  x.wall_s);
    progress.Say(line);
    if (s < a.warmup_steps) continue;
    r->step_s.push_back(x.wall_s);
    if (a.disk_reference_paired_split) {
      const EngineStats step_after = e.Stats();
      progress.Say("bench engine: " + r->variant.Name() + ": paired split disk pass " +
                   std::to_string(r->step_s.size()) + "/" + std::to_string(a.steps));
      const double rd =
          static_cast<double>(NvmeRead(step_after.store) - NvmeRead(step_before.store));
      const double wr =
          static_cast<double>(NvmeWrite(step_after.store) - NvmeWrite(step_before.store));
      STRATA_RETURN_IF_ERROR(PairedDiskPass(p, comm, e, r->step_s.size() - 1, rd, wr, r));
    }
    const double n = a.steps;
    r->gather_wait_s += x.t.gather_wait_ns * 1e-9 / n;
    r->reduce_wait_s += x.t.reduce_wait_ns * 1e-9 / n;
    r->optimizer_s += x.t.optimizer_ns * 1e-9 / n;
    r->optimizer_io_wait_s += x.t.optimizer_io_wait_ns * 1e-9 / n;
    r->speculative_optimizer_s += x.t.speculative_optimizer_ns * 1e-9 / n;
    r->speculated_sub_groups += static_cast<double>(x.speculated) / n;
    r->rolled_back_sub_groups += static_cast<double>(x.rolled_back) / n;
    r->clipped_steps += x.clipped ? 1 : 0;
    r->skipped_steps += x.skipped ? 1 : 0;
    r->step_call_s += x.t.step_ns * 1e-9 / n;
    for (const StepPhaseRef& ph : kStepPhases) {
      PhaseFigures& into = phases.*ph.field;
      const PhaseFigures& got = x.phases.*ph.field;
      into.AddScaled(got, 1.0 / n);
    }
  }
  const EngineStats after = e.Stats();
  r->engine_stats = zero::EngineStatsJson(after);
  const double n = a.steps;
  RankFigures f;
  for (Tier t : kAllTiers) f.peak_bytes[static_cast<size_t>(t)] = after.peak_bytes[t];
  f.nvme_read_bytes_per_step = (NvmeRead(after.store) - NvmeRead(before.store)) / n;
  f.nvme_write_bytes_per_step = (NvmeWrite(after.store) - NvmeWrite(before.store)) / n;
  f.comm_intra_bytes_per_step =
      (after.comm_intra.total_sent_bytes() - before.comm_intra.total_sent_bytes()) / n;
  f.comm_inter_bytes_per_step =
      (after.comm_inter.total_sent_bytes() - before.comm_inter.total_sent_bytes()) / n;
  f.comm_bytes_per_step = (after.comm.total_sent_bytes() - before.comm.total_sent_bytes()) / n +
                          f.comm_intra_bytes_per_step + f.comm_inter_bytes_per_step;
  f.comm_wire_bytes_per_step =
      (after.comm.total_wire_sent_bytes() + after.comm_intra.total_wire_sent_bytes() +
       after.comm_inter.total_wire_sent_bytes() - before.comm.total_wire_sent_bytes() -
       before.comm_intra.total_wire_sent_bytes() - before.comm_inter.total_wire_sent_bytes()) /
      n;
  f.step_s = Median(r->step_s);
  f.phases = phases;
  DeviceFigures(device_before, b.device->stats(), n, &f);
  r->ranks = {f};
  size_t layers = 0;
  for (size_t g = 0; g < e.model().groups.size(); ++g) layers += IsLayer(e, g) ? 1 : 0;
  r->compute_s =
      2.0 * a.compute_ms * 1e-3 * static_cast<double>(layers) * r->gradient_accumulation_steps;
  return Status::OK();
}

std::vector<double> Pack(const RankFigures& f) {
  std::vector<double> d = {f.peak_bytes[0],
                           f.peak_bytes[1],
                           f.peak_bytes[2],
                           f.nvme_read_bytes_per_step,
                           f.nvme_write_bytes_per_step,
                           f.comm_bytes_per_step,
                           f.comm_wire_bytes_per_step,
                           f.step_s,
                           f.comm_intra_bytes_per_step,
                           f.comm_inter_bytes_per_step,
                           f.h2d_bytes_per_step,
                           f.d2h_bytes_per_step,
                           f.device_peak_used_bytes};
  for (const StepPhaseRef& ph : kStepPhases) {
    const PhaseFigures& x = f.phases.*ph.field;
    for (auto field : PhaseFigures::kFields) d.push_back(x.*field);
  }
  return d;
}

RankFigures Unpack(const double* d) {
  RankFigures f;
  std::copy(d, d + 3, f.peak_bytes);
  f.nvme_read_bytes_per_step = d[3];
  f.nvme_write_bytes_per_step = d[4];
  f.comm_bytes_per_step = d[5];
  f.comm_wire_bytes_per_step = d[6];
  f.step_s = d[7];
  f.comm_intra_bytes_per_step = d[8];
  f.comm_inter_bytes_per_step = d[9];
  f.h2d_bytes_per_step = d[10];
  f.d2h_bytes_per_step = d[11];
  f.device_peak_used_bytes = d[12];
  const double* x = d + 13;
  for (const StepPhaseRef& ph : kStepPhases) {
    PhaseFigures& into = f.phases.*ph.field;
    for (auto field : PhaseFigures::kFields) into.*field = *x++;
  }
  return f;
}

}  // namespace

// Doubles travel as pairs of fp32 words: an all-gather copies bytes and never computes on them.
Result<std::vector<double>> AllGatherDoubles(Communicator& comm, const std::vector<double>& mine,
                                             std::chrono::milliseconds timeout) {
  const size_t n = mine.size();
  std::vector<double> all(n * static_cast<size_t>(comm.world_size()));
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<ptrdiff_t>(n * comm.rank()));
  if (comm.world_size() == 1) return all;
  STRATA_ASSIGN_OR_RETURN(
      CommHandle h, comm.AllGather(all.data() + n * comm.rank(), all.data(), 2 * n, DType::kF32));
  STRATA_RETURN_IF_ERROR(h.WaitUntil(Clock::now() + timeout));
  return all;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

uint64_t NvmeRead(const StoreStats& s) {
  uint64_t b = 0;
  for (Tier t : kAllTiers) b += s.bytes_moved[Tier::kNvme][t];
  return b;
}

uint64_t NvmeWrite(const StoreStats& s) {
  uint64_t b = 0;
  for (Tier t : kAllTiers) b += s.bytes_moved[t][Tier::kNvme];
  return b;
}

std::string EngineVariant::Name() const {
  std::string s = "stage " + std::to_string(stage);
  if (offload_optimizer != OffloadDevice::kNone) {
    s += " + opt " + std::string(OffloadDeviceName(offload_optimizer));
    if (optimizer_ratio && *optimizer_ratio < 1.0) {
      char ratio[32];
      std::snprintf(ratio, sizeof ratio, " (ratio %g)", *optimizer_ratio);
      s += ratio;
    }
  }
  if (offload_param != OffloadDevice::kNone) {
    s += " + param " + std::string(OffloadDeviceName(offload_param));
  }
  return s;
}

Result<ModelSpec> SyntheticModel(double params, int layers, bool bias_groups) {
  if (layers < 1) return Status::InvalidArgument("--layers must be >= 1");
  const double per_layer = std::floor(params / layers);
  const int64_t bias = bias_groups ? std::max<int64_t>(1, std::llround(std::sqrt(per_layer))) : 0;
  if (per_layer - static_cast<double>(bias) < 1) {
    return Status::InvalidArgument("--params " + std::to_string(static_cast<int64_t>(params)) +
                                   " is too small for " + std::to_string(layers) + " layers");
  }
  ModelSpec m;
  for (int l = 0; l < layers; ++l) {
    int64_t w = static_cast<int64_t>(per_layer) - bias;
    if (l == layers - 1)
      w += static_cast<int64_t>(params) - static_cast<int64_t>(per_layer) * layers;
    const std::string name = "layer" + std::to_string(l);
    m.groups.push_back({name, {{"weight", {w}}}});
    if (bias_groups) m.groups.push_back({name + ".bias", {{"bias", {bias}}}});
  }
  STRATA_RETURN_IF_ERROR(m.Validate());
  return m;
}

Result<ParsedConfig> BuildEngineConfig(const BenchEngineArgs& a, const EngineVariant& v,
                                       const BenchProcess& p, int64_t hidden_size) {
  nlohmann::json j;
  const std::string source = a.config.empty() ? "the synthetic config" : "--config " + a.config;
  if (!a.config.empty()) {
    auto file = LoadDeepSpeedConfig(a.config);
    if (!file.ok()) return file.status().WithContext("--config " + a.config);
    j = nlohmann::json::parse(file->normalized_json, nullptr, false);
    if (!j.is_object()) return Status::InvalidArgument("--config " + a.config + ": not an object");
  } else {
    j = {{"train_micro_batch_size_per_gpu", 1},
         {"gradient_accumulation_steps", 1},
         {"gradient_clipping", 1.0},
         {"bf16", {{"enabled", true}}}};
  }
  if (!j.contains("optimizer")) {
    j["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 1e-4}, {"weight_decay", 0.01}}}};
  }
  nlohmann::json& z = j["zero_optimization"];
  z["stage"] = v.stage;
  auto place = [&](const char* key, OffloadDevice d) {
    z[key]["device"] = std::string(OffloadDeviceName(d));
    if (d == OffloadDevice::kNvme && !p.nvme_dirs.empty()) z[key]["nvme_path"] = p.nvme_dirs[0];
    // The synthetic config on a GPU pins offloaded state, as a tuned offload config does: copies
    // from pageable memory run at a fraction of the link's rate. A --config keeps its own.
    if (a.config.empty() && p.cuda && d != OffloadDevice::kNone) z[key]["pin_memory"] = true;
  };
  place("offload_optimizer", v.offload_optimizer);
  place("offload_param", v.offload_param);
  if (a.speculative_step == "auto") {
    if (z.contains("offload_optimizer")) {
      for (const char* k : {"speculative_step", "super_offload"}) z["offload_optimizer"].erase(k);
    }
  } else if (!a.speculative_step.empty()) {
    z["offload_optimizer"]["speculative_step"] = a.speculative_step == "on";
  }
  if (!a.speculation_buffer.empty()) {
    auto n = ParseParamCount(a.speculation_buffer);
    z["offload_optimizer"]["speculation_buffer_size"] = n.ok() ? static_cast<int64_t>(*n) : 0;
  }
  if (v.optimizer_ratio) z["offload_optimizer"]["ratio"] = *v.optimizer_ratio;
  if (!a.max_reuse_distance.empty()) {
    auto n = ParseParamCount(a.max_reuse_distance);
    z["stage3_max_reuse_distance"] = n.ok() ? static_cast<int64_t>(*n) : 0;
  }
  if (a.sweep && v.stage != 3) {
    // ZeRO++ acts at stage 3; the sweep's lower stages run without it.
    for (const char* k :
         {"zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size"}) {
      z.erase(k);
    }
  }
  // A single run below stage 3 keeps them: the engine refuses, naming the key.
  const bool zpp_applies = v.stage == 3 || !a.sweep;
  if (a.qwz && zpp_applies) z["zero_quantized_weights"] = true;
  if (a.qgz && zpp_applies) z["zero_quantized_gradients"] = true;
  if (a.hpz > 0 && zpp_applies) z["zero_hpz_partition_size"] = a.hpz;
  if (!a.dtype.empty()) {
    j.erase("fp16");
    j.erase("bf16");
    j.erase("bfloat16");
    if (a.dtype == "bf16") j["bf16"] = {{"enabled", true}};
    if (a.dtype == "fp16") j["fp16"] = {{"enabled", true}};
  }
  ParseOptions po;
  po.world_size = p.world;
  po.source_name = source;
  po.hidden_size = std::max<int64_t>(1, hidden_size);
  po.auto_values = {{"train_micro_batch_size_per_gpu", "1"},
                    {"gradient_accumulation_steps", "1"},
                    {"gradient_clipping", "1.0"},
                    {"optimizer.params.lr", "1e-4"},
                    {"optimizer.params.betas", "[0.9, 0.999]"},
                    {"optimizer.params.eps", "1e-8"},
                    {"optimizer.params.weight_decay", "0.0"},
                    {"fp16.enabled", a.dtype == "fp16" ? "true" : "false"},
                    {"bf16.enabled", a.dtype == "fp16" || a.dtype == "fp32" ? "false" : "true"}};
  return ParseDeepSpeedConfig(j.dump(), po);
}

Result<VariantResult> RunEngineVariant(const BenchEngineArgs& a, const EngineVariant& v,
                                       const ModelSpec& model, BenchProcess& p) {
  VariantResult r;
  r.variant = v;
  r.world_size = p.world;
  r.ranks_per_node = a.ranks_per_node;
  if (r.ranks_per_node == 0) {
    STRATA_ASSIGN_OR_RETURN(r.ranks_per_node, RanksPerNodeFromEnv(p.world));
  }
  if (r.ranks_per_node < 1 || p.world % r.ranks_per_node != 0) {
    return Status::InvalidArgument("--ranks-per-node " + std::to_string(r.ranks_per_node) +
                                   " does not divide the world size " + std::to_string(p.world));
  }
  r.params = model.numel();
  size_t largest = 0;
  for (const GroupSpec& g : model.groups) largest = std::max(largest, g.numel());
  const auto hidden = static_cast<int64_t>(std::sqrt(static_cast<double>(largest)));
  STRATA_ASSIGN_OR_RETURN(ParsedConfig cfg, BuildEngineConfig(a, v, p, hidden));
  for (const ConfigDiagnostic& w : cfg.warnings) r.notes.push_back("config: " + w.ToString());
  r.gradient_accumulation_steps =
      static_cast<int>(cfg.config.gradient_accumulation_steps.value_or(1));
  r.io_queue_depth =
      static_cast<size_t>(std::clamp<int64_t>(cfg.config.aio.queue_depth, 1, kAioMaxQueueDepth));
  const double device_bytes = a.device_gb * 1e9, host_bytes = a.host_gb * 1e9;
  Progress progress(p.rank == 0, p.progress_tty);
  progress.Say("bench engine: " + v.Name() + ": creating the engine");

  STRATA_ASSIGN_OR_RETURN(
      VariantBackend b,
      MakeVariantBackend(a, p, "strata/bench-engine/" + std::to_string(p.variants_run++),
                         device_bytes));
  r.planner_bytes = PlannerBytes(cfg.config, model, v, p.world, device_bytes, host_bytes,
                                 a.overlap_step, !b.device->host_addressable());
  Communicator& comm = *b.comm;
  r.device_name = b.device->name();
  if (b.cuda) r.pcie = p.pcie;
  if (p.cuda && !b.cuda) {
    r.notes.push_back("--device auto: some rank has no usable GPU, so every rank runs on the host");
  }
  EngineOptions eo;
  eo.config = cfg.config;
  eo.device = b.device.get();
  eo.comm = &b.engine();
  eo.budget_bytes[Tier::kDevice] = static_cast<uint64_t>(device_bytes);
  eo.budget_bytes[Tier::kHost] = static_cast<uint64_t>(host_bytes);
  eo.nvme_paths = p.nvme_dirs;
  eo.io_kind = p.io_kind;
  eo.timeout = p.timeout;
  eo.ranks_per_node = r.ranks_per_node;
  eo.overlap_step = a.overlap_step;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          CreateOrRefuse(model, std::move(eo), &r.refused));
  // Every rank must agree before the first collective of the engine: a rank that does not fit
  // would leave the others waiting for it.
  STRATA_ASSIGN_OR_RETURN(std::vector<double> fit,
                          AllGatherDoubles(comm, {engine ? 1.0 : 0.0}, p.timeout));
  for (int q = 0; q < p.world; ++q) {
    if (fit[q] == 0 && r.refused.empty()) r.refused = "rank " + std::to_string(q) + " does not fit";
  }
  r.fits = r.refused.empty();
  if (!r.fits) return r;
  r.layout = engine->layout();
  r.dtype = engine->dtype();
  for (const std::string& n : r.layout.notes) r.notes.push_back(n);
  for (Tier t : kAllTiers) r.budget_bytes[static_cast<size_t>(t)] = r.layout.budget_bytes[t];
  // The planner for the host budget the engine took (without --host-gb: its working set plus
  // sched::kHostBudgetSlackBytes), as a user would give it to `offloadctl plan --dram-gb`.
  r.planner_bytes = PlannerBytes(cfg.config, model, v, p.world, device_bytes,
                                 static_cast<double>(r.layout.budget_bytes[Tier::kHost]),
                                 a.overlap_step, !b.device->host_addressable());

  progress.Say("bench engine: " + v.Name() + ": initialising " + std::to_string(r.params) +
               " parameters");
  const auto t0 = Clock::now();
  STRATA_RETURN_IF_ERROR(engine
                             ->InitParameters([](size_t g, size_t, size_t b, size_t e, float* out) {
                               for (size_t i = b; i < e; ++i)
                                 out[i - b] = 0.02f * Noise((uint64_t{g} << 40) + i);
                             })
                             .WithContext("InitParameters"));
  r.init_s = Sec(Clock::now() - t0);
  STRATA_RETURN_IF_ERROR(MeasureSteps(a, p, b, *engine, progress, &r));
  if (!a.save_dir.empty()) {
    const AioConfig& aio = cfg.config.aio;
    SaveOptions so = SaveOptionsFromConfig(cfg.config.checkpoint);
    if (a.keep_last) so.keep_last = static_cast<size_t>(*a.keep_last);
    if (a.no_recycle_files) so.recycle_files = false;
    const CheckpointBench c{
        a.save_dir + "/bench-v" + std::to_string(p.variants_run - 1),
        comm,
        p.timeout,
        zero::ckpt::StreamOptionsFromAio(aio.block_size, aio.queue_depth, aio.intra_op_parallelism,
                                         p.io_kind),
        so,
        [&](const std::string& what) { progress.Say("bench engine: " + v.Name() + ": " + what); }};
    STRATA_RETURN_IF_ERROR(MeasureCheckpoint(a, c, *engine, &r));
  }
  progress.Done();
  STRATA_ASSIGN_OR_RETURN(std::vector<double> all,
                          AllGatherDoubles(comm, Pack(r.ranks[0]), p.timeout));
  r.ranks.clear();
  const size_t k = all.size() / static_cast<size_t>(p.world);
  for (int q = 0; q < p.world; ++q) r.ranks.push_back(Unpack(all.data() + k * q));
  return r;
}

}  // namespace strata::cli
