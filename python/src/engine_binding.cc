// strata._strata.Engine: the C++ Engine (include/strata/engine.h) for a Python trainer, on
// HostDevice + Gloo (device="host") or CudaDevice + NCCL (device="cuda", one GPU per process,
// device_ordinal usually LOCAL_RANK). Tensors cross zero-copy: gather() and grad_buffer() return
// DLPack-capable ndarrays (bf16 included) that alias the engine's buffers: host memory for
// HostDevice (torch.from_dlpack gives CPU tensors), device memory of the engine's GPU for
// CudaDevice (CUDA tensors on that device).
//
// Streams (CUDA): every call here without a stream returns with its device work complete (the
// engine synchronizes its own copy and compute streams and waits for its collectives), so a
// gathered or zeroed buffer may be read by any stream once the call returns; grad_buffer(g,
// stream) only orders its zeroing before the work later queued on that stream, so writes of the
// buffer from another stream must first wait for it. In the other direction the caller orders its
// own work: kernels queued on torch's streams that read a gathered group or write a gradient
// buffer must have completed before release(g), reduce_gradients(g) or step(). The caller's host
// can stay ahead of its GPU: release(g) needs no wait where gathers_alias_home (the memory stays
// the parameters' home until step), and elsewhere may wait for an event behind the kernels that
// read g, called a group later; with overlap_comm the caller may take grad_buffer(g') before
// reduce_gradients(g), holding one reduction back until the kernels that write g's buffer have
// run (an event, not a stream synchronize). Where orders_caller_streams (one rank on CUDA), the
// caller passes its stream to grad_buffer, reduce_gradients and release instead and waits for
// nothing: the engine orders the two sides with events on the device. The torch adapter
// (strata/engine.py) does all of these.
//
// Lifetimes: a gathered view is valid until release(g) (or the next step's parameter update
// for stages 0-2, whose replica it aliases); a gradient view until reduce_gradients(g). Each view
// keeps the Python Engine object alive, never the buffer: using one past those points reads
// freed or reused memory. The torch adapter (strata/engine.py) drops its views at those points.
//
// Communicator: Gloo on the host, NCCL on CUDA (its unique id made locally at world_size 1, else
// published by rank 0 through the rendezvous store). world_size 1 needs no rendezvous. Above
// that, ranks meet through
// cpu::OpenRendezvousStore with the variables torchrun / `offloadctl launch` set (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT, STRATA_RDZV_DIR for a shared-directory file store,
// STRATA_RDZV_SECRET / STRATA_RDZV_INSECURE), then connect a Gloo communicator. Its TCP transport
// binds to STRATA_GLOO_HOSTNAME (default 127.0.0.1: one machine). The engines of a process share
// one store (ProcessRendezvous), open until the process exits.
//
// Initial weights: init_from_tensors (whole fp32 arrays on every rank), init_from_rank0 (on rank
// 0 only; the engine scatters; init_from_rank0_fill asks a callable on rank 0 for each piece as
// it is sent) or init_from_fill (a callable asked for
// the ranges this rank stores: strata.zero.Init's shards; owned_range says which those are).
// Checkpoints: save / load are Engine::Save / Engine::Load; client_state crosses as bytes.
//
// Threads: call from one thread. Calls that wait (gather, reduce_gradients, step, read_master,
// creation) release the GIL.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "core/zero/engine_stats_json.h"
#include "cpu/rendezvous/rendezvous.h"
#include "gpu/nccl_comm.h"
#include "python/src/binding_util.h"
#include "strata/comm.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/engine.h"

namespace nb = nanobind;

namespace strata::python {
namespace {

using ParamList = std::vector<std::tuple<std::string, std::vector<int64_t>>>;
using GroupList = std::vector<std::tuple<std::string, ParamList>>;
// Optimizer groups as {"lr", "beta1", "beta2", "eps", "weight_decay"} -> value, each optional.
using OptimizerGroupList = std::vector<std::map<std::string, double>>;
using FloatArray = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;

nb::dlpack::dtype ToDLPack(DType dt) {
  switch (dt) {
    case DType::kF32:
      return nb::dtype<float>();
    case DType::kBF16:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case DType::kF16:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    default:
      throw StatusError(Status::InvalidArgument("no DLPack dtype for the engine's dtype"));
  }
}

std::string_view DTypeLabel(DType dt) {
  switch (dt) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    default:
      return "?";
  }
}

// JSON (zero::EngineStatsJson and the like) as the Python object json.loads makes of it.
nb::object ToPython(const nlohmann::json& j) {
  return nb::module_::import_("json").attr("loads")(j.dump());
}

nb::dict TierDict(const PerTier<uint64_t>& t) {
  nb::dict d;
  for (Tier tier : kAllTiers) d[nb::str(std::string(TierName(tier)).c_str())] = t[tier];
  return d;
}

// One value per group (`what` names the argument in the error), applied by `set`; empty: none.
template <typename T, typename Set>
void SetPerGroup(const char* what, const std::vector<T>& values, ModelSpec* model, Set set) {
  if (values.empty()) return;
  if (values.size() != model->groups.size()) {
    ThrowIfError(Status::InvalidArgument(std::string(what) + ": " +
                                         std::to_string(values.size()) + " value(s) for " +
                                         std::to_string(model->groups.size()) + " group(s)"));
  }
  for (size_t g = 0; g < values.size(); ++g) set(model->groups[g], values[g]);
}

OptimizerGroupOptions ToOptimizerGroup(const std::map<std::string, double>& d, size_t index) {
  OptimizerGroupOptions o;
  for (const auto& [key, value] : d) {
    std::optional<double>* field = key == "lr"             ? &o.lr
                                   : key == "beta1"        ? &o.beta1
                                   : key == "beta2"        ? &o.beta2
                                   : key == "eps"          ? &o.eps
                                   : key == "weight_decay" ? &o.weight_decay
                                                           : nullptr;
    if (field == nullptr) {
      ThrowIfError(Status::InvalidArgument(
          "optimizer_groups[" + std::to_string(index) + "]: unknown key '" + key +
          "' (lr, beta1, beta2, eps, weight_decay)"));
    }
    *field = value;
  }
  return o;
}

std::optional<StateKind> StateKindFromName(std::string_view name) {
  for (StateKind k : {StateKind::kParam16, StateKind::kGrad, StateKind::kMaster32,
                      StateKind::kExpAvg, StateKind::kExpAvgSq}) {
    if (StateKindName(k) == name) return k;
  }
  return std::nullopt;
}

std::vector<OptimizerGroupOptions> ToOptimizerGroups(const OptimizerGroupList& groups) {
  std::vector<OptimizerGroupOptions> out;
  for (size_t i = 0; i < groups.size(); ++i) out.push_back(ToOptimizerGroup(groups[i], i));
  return out;
}

// The rendezvous store of this process for `rc`, shared by all its engines: rank 0's TCP store
// listens on MASTER_PORT, which a second engine could not bind again (an actor beside a critic,
// a student beside its teacher, TRL's reference model). A store, once opened, lives until the
// process exits (torch.distributed's lives until destroy_process_group), so that every rank sees
// the same server whatever order its engines are closed in. `engine` counts the engines created on
// it in this process: every rank creates its engines in the same order (as DeepSpeed's initialize
// requires, its collectives included), so the n-th engine's communicator keys are the same on every
// rank and no other engine's.
struct SharedRendezvous {
  KvStore* store;
  uint64_t engine;
};

Result<SharedRendezvous> ProcessRendezvous(const cpu::RendezvousConfig& rc) {
  struct Opened {
    std::unique_ptr<KvStore> store;
    uint64_t engines = 0;
  };
  static std::mutex mu;
  static auto* stores = new std::map<std::string, Opened>();  // never destroyed (see above)
  const std::string key =
      (rc.file_dir.empty() ? "tcp:" + rc.master_addr + ":" + std::to_string(rc.master_port)
                           : "file:" + rc.file_dir) +
      "|" + rc.run_id;
  std::lock_guard<std::mutex> l(mu);
  Opened& o = (*stores)[key];
  if (!o.store) {
    Result<std::unique_ptr<KvStore>> opened = cpu::OpenRendezvousStore(rc);
    if (!opened.ok()) {
      stores->erase(key);
      return opened.status();
    }
    o.store = std::move(*opened);
  }
  return SharedRendezvous{o.store.get(), o.engines++};
}

class PyEngine {
 public:
  PyEngine(const GroupList& groups, const std::string& config_json, int rank, int world_size,
           const std::vector<std::string>& nvme_paths, uint64_t device_budget_bytes,
           int64_t timeout_ms, const std::string& io, int master_port, bool overlap_step,
           const OptimizerGroupList& optimizer_groups,
           const std::vector<uint32_t>& group_optimizer,
           const std::vector<bool>& group_trainable, const std::string& device,
           int device_ordinal) {
    if (device != "host" && device != "cuda") {
      ThrowIfError(Status::InvalidArgument("device must be host or cuda, got '" + device + "'"));
    }
    ModelSpec model;
    for (const auto& [gname, params] : groups) {
      GroupSpec g{gname, {}};
      for (const auto& [pname, shape] : params) g.params.push_back({pname, shape});
      model.groups.push_back(std::move(g));
    }
    SetPerGroup("group_optimizer", group_optimizer, &model,
                [](GroupSpec& g, uint32_t v) { g.optimizer_group = v; });
    SetPerGroup("group_trainable", group_trainable, &model,
                [](GroupSpec& g, bool v) { g.trainable = v; });
    ThrowIfError(model.Validate());
    ParseOptions po;
    po.world_size = world_size;
    po.source_name = "config";
    ParsedConfig parsed = ValueOrThrow(ParseDeepSpeedConfig(config_json, po));
    checkpoint_config_ = parsed.config.checkpoint;
    const auto timeout = std::chrono::milliseconds(timeout_ms);
    nb::gil_scoped_release unlocked;
    if (device == "cuda") {
      CudaDeviceOptions co;
      co.device_ordinal = device_ordinal;
      co.budget_bytes = device_budget_bytes;
      device_ = ValueOrThrow(CreateCudaDevice(co));
      device_ordinal_ = device_ordinal;
    } else {
      HostDeviceOptions ho;
      ho.budget_bytes = device_budget_bytes;
      device_ = ValueOrThrow(CreateHostDevice(ho));
    }
    if (world_size > 1) {
      // master_port > 0 replaces MASTER_PORT (torchrun's own store already listens there).
      const std::string port = std::to_string(master_port);
      auto getenv = [&](const char* name) -> const char* {
        if (master_port > 0 && std::strcmp(name, "MASTER_PORT") == 0) return port.c_str();
        return std::getenv(name);
      };
      cpu::RendezvousConfig rc = ValueOrThrow(cpu::RendezvousConfig::FromEnv(getenv));
      if (rc.rank != rank || rc.world_size != world_size) {
        ThrowIfError(Status::InvalidArgument(
            "rank/world_size (" + std::to_string(rank) + "/" + std::to_string(world_size) +
            ") differ from RANK/WORLD_SIZE in the environment (" + std::to_string(rc.rank) + "/" +
            std::to_string(rc.world_size) + ")"));
      }
      rendezvous_ = ValueOrThrow(ProcessRendezvous(rc));
    }
    comm_ = ValueOrThrow(device == "cuda" ? CreateNccl(rank, world_size, timeout)
                                          : CreateGloo(rank, world_size, timeout));
    EngineOptions eo;
    eo.config = parsed.config;
    eo.device = device_.get();
    eo.comm = comm_.get();
    eo.nvme_paths = nvme_paths;
    // The host slab from the pinned pool: on huge pages whatever pin_memory says (a 1 MiB
    // O_DIRECT IO from 4 KiB pages is split in two on a virtio disk), locked only when the
    // config's pin_memory asks (EngineOptions::use_pinned_pool).
    eo.use_pinned_pool = true;
    eo.timeout = timeout;
    eo.overlap_step = overlap_step;
    eo.optimizer_groups = ToOptimizerGroups(optimizer_groups);
    if (io == "posix") {
      eo.io_kind = IoBackendKind::kPosix;
    } else if (io == "uring") {
      eo.io_kind = IoBackendKind::kIoUring;
    } else if (io != "auto") {
      ThrowIfError(Status::InvalidArgument("io must be auto, posix or uring, got '" + io + "'"));
    }
    engine_ = ValueOrThrow(Engine::Create(model, std::move(eo)));
    gathered_.resize(model.groups.size());
  }

  ~PyEngine() { Close(); }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  Result<std::unique_ptr<Communicator>> CreateGloo(int rank, int world_size,
                                                   std::chrono::milliseconds timeout) {
    GlooCommOptions go;
    go.rank = rank;
    go.world_size = world_size;
    go.timeout = timeout;
    go.store = rendezvous_.store;
    go.store_prefix = "strata/engine" + std::to_string(rendezvous_.engine) + "/gloo";
    if (const char* h = std::getenv("STRATA_GLOO_HOSTNAME"); h != nullptr && *h != '\0') {
      go.hostname = h;
    }
    return CreateGlooCommunicator(go);
  }

  // NCCL on this process's GPU; more than one rank exchange the unique id in the store.
  Result<std::unique_ptr<Communicator>> CreateNccl(int rank, int world_size,
                                                   std::chrono::milliseconds timeout) {
    NcclCommOptions no;
    no.rank = rank;
    no.world_size = world_size;
    no.device = device_ordinal_;
    no.timeout = timeout;
    no.store = rendezvous_.store;
    no.store_key = "strata/engine" + std::to_string(rendezvous_.engine) + "/nccl/unique_id";
    return CreateNcclCommunicator(no);
  }

  // "host", or "cuda:N".
  std::string DeviceLabel() const {
    return device_ordinal_ < 0 ? "host" : "cuda:" + std::to_string(device_ordinal_);
  }

  // Releases every gathered group and lets go of the engine, the communicator and the device:
  // destroyed now, or by the last view handed out (a tensor autograd saved, a state_dict's) once
  // that is freed.
  void Close() {
    if (engine_) {
      for (auto& g : gathered_) {
        if (g) engine_->Release(std::move(*g));
        g.reset();
      }
    }
    engine_.reset();
    comm_.reset();
    device_.reset();
  }

  Engine& engine() {
    if (!engine_) throw StatusError(Status::FailedPrecondition("the engine was closed"));
    return *engine_;
  }

  size_t CheckGroup(size_t g) {
    if (g >= engine().model().groups.size()) {
      throw nb::index_error(("group " + std::to_string(g) + " out of range (" +
                             std::to_string(engine().model().groups.size()) + " groups)")
                                .c_str());
    }
    return g;
  }

  void InitFromTensors(const std::vector<std::vector<FloatArray>>& tensors) {
    const ModelSpec& m = engine().model();
    if (tensors.size() != m.groups.size()) {
      ThrowIfError(Status::InvalidArgument("init: " + std::to_string(tensors.size()) +
                                           " groups given, the model has " +
                                           std::to_string(m.groups.size())));
    }
    std::vector<std::vector<const float*>> ptrs(m.groups.size());
    for (size_t g = 0; g < m.groups.size(); ++g) {
      if (tensors[g].size() != m.groups[g].params.size()) {
        ThrowIfError(Status::InvalidArgument("init: group '" + m.groups[g].name + "' has " +
                                             std::to_string(m.groups[g].params.size()) +
                                             " params, " + std::to_string(tensors[g].size()) +
                                             " given"));
      }
      for (size_t p = 0; p < tensors[g].size(); ++p) {
        if (tensors[g][p].size() != m.groups[g].params[p].numel()) {
          ThrowIfError(Status::InvalidArgument(
              "init: " + m.groups[g].name + "." + m.groups[g].params[p].name + " has " +
              std::to_string(m.groups[g].params[p].numel()) + " elements, " +
              std::to_string(tensors[g][p].size()) + " given"));
        }
        ptrs[g].push_back(tensors[g][p].data());
      }
    }
    nb::gil_scoped_release unlocked;
    ThrowIfError(engine().InitFromFullTensors(ptrs));
  }

  // InitFromRank0: rank 0 passes tensors[g][p] (contiguous float32 CPU arrays), every other rank
  // an empty list; the engine checks rank 0's sizes (naming the parameter and its shape) and
  // scatters to each rank what it stores (collective).
  void InitFromRank0(const std::vector<std::vector<FloatArray>>& tensors) {
    std::vector<std::vector<std::span<const float>>> spans(tensors.size());
    for (size_t g = 0; g < tensors.size(); ++g) {
      for (const FloatArray& a : tensors[g]) spans[g].emplace_back(a.data(), a.size());
    }
    nb::gil_scoped_release unlocked;
    ThrowIfError(engine().InitFromRank0(spans));
  }

  // InitParameters with a Python callable fill(group, param, begin, end) -> float32 array of
  // end - begin values (collective; strata.zero.Init's shards feed it).
  void InitFromFill(const nb::callable& fill) {
    RunWithPythonFill(fill, [&](const CheckedParamFill& f) {
      return engine().InitParameters([&](size_t g, size_t p, size_t b, size_t e, float* out) {
        f(g, p, b, e, out).IgnoreError();
      });
    });
  }

  // WriteParams with a Python callable fill(group, param, begin, end) -> float32 array
  // (collective): the working params of `groups` only, the masters kept; a fill that raises
  // writes nothing.
  void WriteParams(const std::vector<size_t>& groups, const nb::callable& fill) {
    RunWithPythonFill(fill,
                      [&](const CheckedParamFill& f) { return engine().WriteParams(groups, f); });
  }

  // WriteOptimizerState of one parameter's "master32", "exp_avg" or "exp_avg_sq" from a Python
  // callable fill(group, param, begin, end) -> float32 array (collective).
  void WriteState(size_t g, size_t p, const std::string& kind, const nb::callable& fill) {
    CheckGroup(g);
    const std::optional<StateKind> k = StateKindFromName(kind);
    if (!k) throw nb::value_error(("write_state: unknown state kind '" + kind + "'").c_str());
    RunWithPythonFill(
        fill, [&](const CheckedParamFill& f) { return engine().WriteOptimizerState(g, p, *k, f); });
  }

  // InitFromRank0Fill with rank 0's values from fill(group, param, begin, end), asked for as
  // they are sent (collective; the other ranks' fill is never called). A Python error on rank 0
  // is raised there; the other ranks raise the engine's error saying rank 0's values failed.
  void InitFromRank0Fill(const nb::callable& fill) {
    RunWithPythonFill(fill,
                      [&](const CheckedParamFill& f) { return engine().InitFromRank0Fill(f); });
  }

  // run(f) without the GIL, f calling the Python fill (PythonFill); then the fill's own error if
  // it raised, else run's.
  template <class Run>
  void RunWithPythonFill(const nb::callable& fill, Run run) {
    std::exception_ptr error;
    const CheckedParamFill f = PythonFill(fill, error);
    Status st;
    {
      nb::gil_scoped_release unlocked;  // the fill takes it back for each call
      st = run(f);
    }
    if (error) std::rethrow_exception(error);
    ThrowIfError(st);
  }

  // A Python fill as the engine's, called without the GIL held: each call takes it. The engine is
  // C++ without exceptions: the first Python error is kept in `error` (raised by the caller once
  // the engine returns) and reported as a failed fill; later calls fill zeros.
  // The caller keeps `fill` and `error` alive while the result is used.
  CheckedParamFill PythonFill(const nb::callable& fill, std::exception_ptr& error) {
    return [fill = &fill, error = &error, m = &engine().model()](size_t g, size_t p, size_t b,
                                                                 size_t e, float* out) -> Status {
      std::memset(out, 0, (e - b) * sizeof(float));
      const std::string what = m->groups[g].name + "." + m->groups[g].params[p].name + "[" +
                               std::to_string(b) + ":" + std::to_string(e) + "]";
      if (*error) return Status::Aborted("the fill failed earlier; " + what + " not asked");
      nb::gil_scoped_acquire gil;
      try {
        nb::object got = (*fill)(g, p, b, e);
        FloatArray a;
        if (!nb::try_cast<FloatArray>(got, a)) {
          throw StatusError(Status::InvalidArgument(
              "fill returned " + std::string(nb::type_name(got.type()).c_str()) + " for " + what +
              ", not a contiguous float32 array of " + std::to_string(e - b) + " values"));
        }
        if (a.size() != e - b) {
          throw StatusError(Status::InvalidArgument("fill returned " + std::to_string(a.size()) +
                                                    " values for " + what));
        }
        std::memcpy(out, a.data(), (e - b) * sizeof(float));
        return Status::OK();
      } catch (...) {
        *error = std::current_exception();
        return Status::InvalidArgument("the fill failed for " + what);
      }
    };
  }

  // keep_last / recycle_files left as None take the config's checkpoint section
  // (SaveOptionsFromConfig), as Engine::Save without SaveOptions does.
  void Save(const std::string& dir, const std::string& tag, const nb::bytes& client_state,
            std::optional<size_t> keep_last, std::optional<bool> recycle_files, bool exclude_frozen,
            bool update_latest) {
    std::vector<uint8_t> blob(client_state.size());
    if (!blob.empty()) std::memcpy(blob.data(), client_state.c_str(), blob.size());
    SaveOptions so = SaveOptionsFromConfig(checkpoint_config_);
    if (keep_last) so.keep_last = *keep_last;
    if (recycle_files) so.recycle_files = *recycle_files;
    so.exclude_frozen = exclude_frozen;
    so.update_latest = update_latest;
    nb::gil_scoped_release unlocked;
    ThrowIfError(engine().Save(dir, tag, so, blob));
  }

  nb::bytes Load(const std::string& dir, const std::string& tag, bool optimizer_states,
                 bool lr_schedule, bool keep_excluded) {
    std::vector<uint8_t> blob;
    LoadOptions options;
    options.optimizer_states = optimizer_states;
    options.lr_schedule = lr_schedule;
    options.keep_excluded = keep_excluded;
    {
      nb::gil_scoped_release unlocked;
      ThrowIfError(engine().Load(dir, tag, &blob, options));
    }
    return nb::bytes(reinterpret_cast<const char*>(blob.data()), blob.size());
  }

  // Per-parameter views at `base` (the group's flat buffer, params back to back).
  nb::list Views(size_t g, void* base) {
    const GroupSpec& gs = engine().model().groups[g];
    const size_t elt = DTypeSize(engine().dtype());
    const nb::dlpack::dtype dt = ToDLPack(engine().dtype());
    // The views' owner keeps the memory they alias: a tensor that outlives close() reads the
    // engine's last values, never freed memory.
    auto* kept = new Kept{device_, comm_, engine_};
    nb::capsule owner(kept, [](void* k) noexcept { delete static_cast<Kept*>(k); });
    nb::list out;
    size_t off = 0;
    for (const ParamSpec& p : gs.params) {
      std::vector<size_t> shape(p.shape.begin(), p.shape.end());
      out.append(nb::ndarray<nb::array_api>(
          static_cast<uint8_t*>(base) + off * elt, shape.size(), shape.data(), owner, nullptr, dt,
          device_ordinal_ < 0 ? nb::device::cpu::value : nb::device::cuda::value,
          device_ordinal_ < 0 ? 0 : device_ordinal_));
      off += p.numel();
    }
    return out;
  }

  nb::list Gather(size_t g) {
    CheckGroup(g);
    if (!gathered_[g]) {
      Result<GatheredGroup> r = [&] {
        nb::gil_scoped_release unlocked;
        return engine().Gather(g);
      }();
      gathered_[g] = ValueOrThrow(std::move(r));
    }
    return Views(g, const_cast<void*>(gathered_[g]->data()));
  }

  bool IsGathered(size_t g) { return gathered_[CheckGroup(g)].has_value(); }

  void Release(size_t g, std::optional<uintptr_t> stream) {
    CheckGroup(g);
    std::optional<GatheredGroup> gathered = std::exchange(gathered_[g], std::nullopt);
    if (!gathered) return;
    Status st;
    {
      // The release may wait for the store's copies, which now queue behind torch's stream.
      nb::gil_scoped_release unlocked;
      if (stream) {
        st = engine().Release(std::move(*gathered), *stream);
      } else {
        engine().Release(std::move(*gathered));
      }
    }
    ThrowIfError(st);
  }

  nb::list GradBuffer(size_t g, std::optional<uintptr_t> stream) {
    CheckGroup(g);
    Result<void*> buf = [&] {
      nb::gil_scoped_release unlocked;  // a new buffer's allocation may wait for the device
      return engine().GradBuffer(g, stream);
    }();
    return Views(g, ValueOrThrow(std::move(buf)));
  }

  void ReduceGradients(size_t g, std::optional<uintptr_t> stream) {
    CheckGroup(g);
    nb::gil_scoped_release unlocked;
    ThrowIfError(engine().ReduceGradients(g, stream));
  }

  std::vector<uint32_t> AgreeReductionOrder(const std::vector<uint32_t>& order) {
    Result<std::vector<uint32_t>> agreed = [&] {
      nb::gil_scoped_release unlocked;
      return engine().AgreeReductionOrder(order);
    }();
    return ValueOrThrow(std::move(agreed));
  }

  void DiscardGradients() {
    nb::gil_scoped_release unlocked;
    ThrowIfError(engine().DiscardGradients());
  }

  nb::dict Step() {
    Result<StepReport> r = [&] {
      nb::gil_scoped_release unlocked;
      return engine().Step();
    }();
    StepReport rep = ValueOrThrow(std::move(r));
    nb::dict d;
    d["global_step"] = rep.global_step;
    d["skipped"] = rep.skipped;
    d["grad_norm"] = rep.grad_norm;
    d["loss_scale"] = rep.loss_scale;
    d["lr"] = rep.lr;
    d["clip_coefficient"] = rep.clip_coefficient;
    d["speculated_sub_groups"] = rep.speculated_sub_groups;
    d["rolled_back_sub_groups"] = rep.rolled_back_sub_groups;
    d["timings"] = ToPython(zero::StepTimingsJson(rep.timings));
    return d;
  }

  nb::ndarray<nb::numpy, float> ReadMaster(size_t g) { return ReadState(g, "master32"); }

  // kind: "master32", "exp_avg" or "exp_avg_sq" (Engine::ReadOptimizerState).
  nb::ndarray<nb::numpy, float> ReadState(size_t g, const std::string& kind) {
    CheckGroup(g);
    const std::optional<StateKind> k = StateKindFromName(kind);
    if (!k) throw nb::value_error(("read_state: unknown state kind '" + kind + "'").c_str());
    const size_t n = engine().model().groups[g].numel();
    auto* data = new float[n];
    nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    {
      nb::gil_scoped_release unlocked;
      ThrowIfError(engine().ReadOptimizerState(g, *k, std::span<float>(data, n)));
    }
    return nb::ndarray<nb::numpy, float>(data, {n}, owner);
  }

  nb::dict Stats() { return nb::cast<nb::dict>(ToPython(zero::EngineStatsJson(engine().Stats()))); }

  nb::dict Layout() {
    const EngineLayout& L = engine().layout();
    nb::dict d;
    d["stage"] = L.stage;
    d["offload_optimizer"] = std::string(OffloadDeviceName(L.offload_optimizer));
    d["offload_param"] = std::string(OffloadDeviceName(L.offload_param));
    d["dtype"] = std::string(DTypeLabel(L.dtype));
    d["grad_dtype"] = std::string(DTypeLabel(L.grad_dtype));
    d["world_size"] = L.world_size;
    d["rank"] = L.rank;
    d["params"] = L.params;
    d["sub_groups"] = L.sub_groups;
    d["optimizer_ratio"] = L.optimizer_ratio;  // partial offload (offload_optimizer.ratio)
    d["device_sub_groups"] = L.device_sub_groups;
    d["offloaded_fraction"] = L.offloaded_fraction;
    d["state_bytes"] = TierDict(L.state_bytes);
    d["working_bytes"] = TierDict(L.working_bytes);
    d["cache_bytes"] = TierDict(L.cache_bytes);
    d["budget_bytes"] = TierDict(L.budget_bytes);
    d["notes"] = nb::cast(L.notes);
    d["text"] = L.ToString();
    return d;
  }

  DeviceStats device_stats() const { return device_ ? device_->stats() : DeviceStats{}; }

 private:
  // What a view's owner holds; destroyed engine first, as Close() does.
  struct Kept {
    std::shared_ptr<Device> device;
    std::shared_ptr<Communicator> comm;
    std::shared_ptr<Engine> engine;
  };

  int device_ordinal_ = -1;  // the CUDA device, -1 on HostDevice
  std::shared_ptr<Device> device_;
  SharedRendezvous rendezvous_{nullptr, 0};  // world_size > 1: the process's store
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Engine> engine_;
  std::vector<std::optional<GatheredGroup>> gathered_;
  CheckpointConfig checkpoint_config_;  // save()'s retention when the caller names none
};

}  // namespace

void BindEngine(nb::module_& m) {
  nb::class_<PyEngine>(m, "Engine")
      .def(nb::init<const GroupList&, const std::string&, int, int, const std::vector<std::string>&,
                    uint64_t, int64_t, const std::string&, int, bool, const OptimizerGroupList&,
                    const std::vector<uint32_t>&, const std::vector<bool>&, const std::string&,
                    int>(),
           nb::arg("groups"), nb::arg("config_json"), nb::arg("rank") = 0,
           nb::arg("world_size") = 1, nb::arg("nvme_paths") = std::vector<std::string>{},
           nb::arg("device_budget_bytes") = uint64_t{8} << 30, nb::arg("timeout_ms") = 300000,
           nb::arg("io") = "auto", nb::arg("master_port") = 0, nb::arg("overlap_step") = false,
           nb::arg("optimizer_groups") = OptimizerGroupList{},
           nb::arg("group_optimizer") = std::vector<uint32_t>{},
           nb::arg("group_trainable") = std::vector<bool>{}, nb::arg("device") = "host",
           nb::arg("device_ordinal") = 0,
           "Creates the engine for `groups` ([(group name, [(param name, shape)])], forward "
           "order) and a DeepSpeed config (JSON text) on HostDevice + Gloo (device='host') or "
           "CudaDevice + NCCL on GPU device_ordinal (device='cuda'; device_budget_bytes 0: 90 % "
           "of the GPU's free memory). overlap_step: "
           "EngineOptions::overlap_step (the optimizer step runs behind the next forward). "
           "optimizer_groups: EngineOptions::optimizer_groups as dicts of lr, beta1, beta2, eps, "
           "weight_decay (each optional); group_optimizer[g]: group g's optimizer group; "
           "group_trainable[g] false: group g is frozen (GroupSpec::trainable).")
      .def("init_from_tensors", &PyEngine::InitFromTensors, nb::arg("tensors"),
           "Initial weights: tensors[g][p] a contiguous float32 CPU array (collective).")
      .def("init_from_rank0", &PyEngine::InitFromRank0, nb::arg("tensors"),
           "Initial weights held by rank 0 alone: tensors[g][p] a contiguous float32 CPU array on "
           "rank 0, [] elsewhere; the engine scatters each rank what it stores (collective).")
      .def("init_from_rank0_fill", &PyEngine::InitFromRank0Fill, nb::arg("fill"),
           "init_from_rank0 with rank 0's values from fill(group, param, begin, end) -> float32 "
           "array, asked for piece by piece as they are sent (rank 0 never holds the model in "
           "fp32 at once; the other ranks' fill is never called; collective).")
      .def("init_from_fill", &PyEngine::InitFromFill, nb::arg("fill"),
           "Initial weights from fill(group, param, begin, end) -> float32 array (collective); "
           "asked only for the element ranges this rank stores.")
      .def("write_params", &PyEngine::WriteParams, nb::arg("groups"), nb::arg("fill"),
           "Engine::WriteParams: the working params of `groups` from fill(group, param, begin, "
           "end) -> float32 array, at any step; the fp32 masters and Adam state kept, so the next "
           "step recomputes them (collective).")
      .def("write_state", &PyEngine::WriteState, nb::arg("group"), nb::arg("param"),
           nb::arg("kind"), nb::arg("fill"),
           "Engine::WriteOptimizerState: parameter `param` of `group`'s master32 (and its "
           "working params), exp_avg or exp_avg_sq from fill(group, param, begin, end) -> "
           "float32 array, at any step, every other value kept (collective).")
      .def("save", &PyEngine::Save, nb::arg("dir"), nb::arg("tag"), nb::arg("client_state"),
           nb::arg("keep_last") = nb::none(), nb::arg("recycle_files") = nb::none(),
           nb::arg("exclude_frozen") = false, nb::arg("update_latest") = true,
           "Engine::Save (collective, at an accumulation boundary); keep_last / recycle_files "
           "/ exclude_frozen / update_latest as strata::SaveOptions (include/strata/checkpoint.h): "
           "0 keeps every "
           "checkpoint; None takes the config's checkpoint section (keep_last 0, recycle_files "
           "true).")
      .def("load", &PyEngine::Load, nb::arg("dir"), nb::arg("tag") = "",
           nb::arg("optimizer_states") = true, nb::arg("lr_schedule") = true,
           nb::arg("keep_excluded") = false,
           "Engine::Load (collective) with LoadOptions; returns the saved client_state bytes.")
      .def("gather", &PyEngine::Gather, nb::arg("group"),
           "The group's parameters as zero-copy DLPack arrays (working dtype), valid until "
           "release(group). Gathering a gathered group returns views of the same buffer.")
      .def("is_gathered", &PyEngine::IsGathered, nb::arg("group"))
      .def_prop_ro(
          "swap_files", [](PyEngine& e) { return e.engine().swap_files(); },
          "Engine::swap_files: this rank's swap files (what close removes).")
      .def(
          "is_persistent", [](PyEngine& e, size_t g) { return e.engine().persistent(g); },
          nb::arg("group"),
          "Engine::persistent: stage 3, no larger than stage3_param_persistence_threshold.")
      .def("release", &PyEngine::Release, nb::arg("group"), nb::arg("stream") = nb::none(),
           "stream: where orders_caller_streams and the release frees or reuses memory (not "
           "gathers_alias_home), that memory is rewritten only after the work queued on that "
           "stream so far (the caller's kernels that read the group), with no wait on the host.")
      .def("grad_buffer", &PyEngine::GradBuffer, nb::arg("group"), nb::arg("stream") = nb::none(),
           "Zeroed gradient views (working dtype) for this micro-step, valid until "
           "reduce_gradients(group). stream: the caller's CUDA stream (torch's cuda_stream) "
           "where orders_caller_streams: the zeroing is then ordered before its later work, "
           "not waited for.")
      .def("reduce_gradients", &PyEngine::ReduceGradients, nb::arg("group"),
           nb::arg("stream") = nb::none(),
           "stream: where orders_caller_streams, the reduction runs after the work queued on "
           "that stream so far (the caller's writes of the buffer), with no wait on the host.")
      .def("agree_reduction_order", &PyEngine::AgreeReductionOrder, nb::arg("order"),
           "Rank 0's order of the trainable groups' reductions, on every rank (collective).")
      .def("discard_gradients", &PyEngine::DiscardGradients,
           "Drops the gradients taken since the last step (a backward that raised, a skipped "
           "micro-batch); gradient views taken must no longer be used.")
      .def("step", &PyEngine::Step, "The optimizer step (collective); returns the step report.")
      .def("read_state", &PyEngine::ReadState, nb::arg("group"), nb::arg("kind"),
           "The group's optimizer state (master32, exp_avg or exp_avg_sq) whole, fp32 "
           "(collective).")
      .def("read_master", &PyEngine::ReadMaster, nb::arg("group"),
           "The group's fp32 master weights, flat (collective).")
      .def("stats", &PyEngine::Stats)
      .def("layout", &PyEngine::Layout)
      .def("close", &PyEngine::Close)
      .def_prop_ro(
          "loss_scale", [](PyEngine& e) { return e.engine().CurrentLossScale(); },
          "The fp16 loss scale (DeepSpeed's cur_scale; 1 otherwise).")
      .def_prop_ro(
          "backward_scale", [](PyEngine& e) { return e.engine().LossScale(); },
          "Engine::LossScale: what the loss is multiplied by before backward (with "
          "fp16 the loss scale / gradient_accumulation_steps).")
      .def_prop_ro("lr", [](PyEngine& e) { return e.engine().lr(); })
      .def_prop_ro(
          "lrs", [](PyEngine& e) { return e.engine().lrs(); },
          "The lr of each optimizer group for the next step.")
      .def_prop_rw(
          "schedule_position", [](PyEngine& e) { return e.engine().schedule_position(); },
          [](PyEngine& e, int64_t k) { ThrowIfError(e.engine().SetSchedulePosition(k)); },
          "Engine::schedule_position: the config's LR schedule's steps taken (settable).")
      .def(
          "restore_progress",
          [](PyEngine& e, int64_t global_step, int64_t skipped_steps, int64_t optimizer_step,
             int64_t schedule_position, double loss_scale, int64_t scaler_iteration,
             int64_t scaler_last_overflow, int64_t scaler_hysteresis_left) {
            TrainingProgress p;
            p.global_step = global_step;
            p.skipped_steps = skipped_steps;
            p.optimizer_step = optimizer_step;
            p.schedule_position = schedule_position;
            p.loss_scale = loss_scale;
            p.scaler_iteration = scaler_iteration;
            p.scaler_last_overflow = scaler_last_overflow;
            p.scaler_hysteresis_left = scaler_hysteresis_left;
            ThrowIfError(e.engine().RestoreProgress(p));
          },
          nb::arg("global_step"), nb::arg("skipped_steps"), nb::arg("optimizer_step"),
          nb::arg("schedule_position"), nb::arg("loss_scale") = 0.0,
          nb::arg("scaler_iteration") = 0, nb::arg("scaler_last_overflow") = -1,
          nb::arg("scaler_hysteresis_left") = 0,
          "Engine::RestoreProgress: the counters, schedule position and loss scaler of another "
          "trainer's checkpoint.")
      .def(
          "set_lrs",
          [](PyEngine& e, const std::vector<double>& lrs) {
            ThrowIfError(e.engine().SetLearningRates(lrs));
          },
          nb::arg("lrs"),
          "Engine::SetLearningRates: each optimizer group's lr from the next step on (a client "
          "scheduler); the config's schedule no longer applies. [] hands them back to it.")
      .def_prop_ro(
          "betas",
          [](PyEngine& e) {
            std::vector<std::tuple<double, double>> out;
            for (const auto& [b1, b2] : e.engine().betas()) out.emplace_back(b1, b2);
            return out;
          },
          "Each optimizer group's (beta1, beta2) for the next step (OneCycle's momentum).")
      .def(
          "set_hyperparameters",
          [](PyEngine& e, const OptimizerGroupList& groups) {
            ThrowIfError(e.engine().SetHyperparameters(ToOptimizerGroups(groups)));
          },
          nb::arg("groups"),
          "Engine::SetHyperparameters: per optimizer group, a dict of lr, beta1, beta2, eps, "
          "weight_decay (each optional) for the next step on.")
      .def(
          "use_schedule_betas", [](PyEngine& e) { e.engine().UseScheduleBetas(); },
          "Engine::UseScheduleBetas: the betas the config's schedule sets (OneCycle) again.")
      .def(
          "set_gradient_accumulation_steps",
          [](PyEngine& e, int64_t steps) {
            ThrowIfError(e.engine().SetGradientAccumulationSteps(steps));
          },
          nb::arg("steps"),
          "Engine::SetGradientAccumulationSteps: the accumulation of the steps that follow "
          "(between steps).")
      .def_prop_ro("gradient_accumulation_steps",
                   [](PyEngine& e) { return e.engine().gradient_accumulation_steps(); })
      .def(
          "offload_states",
          [](PyEngine& e, const std::optional<std::vector<std::string>>& kinds, bool pin_memory) {
            OffloadStatesOptions o;
            o.pin_memory = pin_memory;
            if (kinds) o.kinds.emplace();
            for (const std::string& k : kinds.value_or(std::vector<std::string>{})) {
              const auto kind = StateKindFromName(k);
              if (!kind) {
                ThrowIfError(
                    Status::InvalidArgument("offload_states: unknown state kind '" + k +
                                            "' (param16, grad, master32, exp_avg, exp_avg_sq)"));
              }
              o.kinds->push_back(*kind);
            }
            ThrowIfError(e.engine().OffloadStates(o));
          },
          nb::arg("kinds") = nb::none(), nb::arg("pin_memory") = true,
          "Engine::OffloadStates: the device-homed blocks of `kinds` (all when None) into host "
          "memory, every device copy the engine keeps dropped, until reload_states.")
      .def(
          "reload_states", [](PyEngine& e) { ThrowIfError(e.engine().ReloadStates()); },
          "Engine::ReloadStates: everything offload_states moved back to the device.")
      .def_prop_ro("states_offloaded", [](PyEngine& e) { return e.engine().states_offloaded(); })
      .def_prop_ro(
          "device_used_bytes", [](PyEngine& e) { return e.device_stats().used_bytes; },
          "Bytes the engine holds on its device now (Device::stats), 0 once closed.")
      .def_prop_ro(
          "device_peak_bytes", [](PyEngine& e) { return e.device_stats().peak_used_bytes; },
          "The most bytes the engine held on its device at once, 0 once closed.")
      .def_prop_ro("global_step", [](PyEngine& e) { return e.engine().global_step(); })
      .def_prop_ro("rank", [](PyEngine& e) { return e.engine().rank(); })
      .def_prop_ro("world_size", [](PyEngine& e) { return e.engine().world_size(); })
      .def_prop_ro(
          "gathers_alias_home", [](PyEngine& e) { return e.engine().gathers_alias_home(); },
          "True when gather's views are the parameters' device-resident home (Engine::"
          "gathers_alias_home): release frees nothing, so it needs no wait for the caller's "
          "stream.")
      .def_prop_ro(
          "orders_caller_streams", [](PyEngine& e) { return e.engine().orders_caller_streams(); },
          "Engine::orders_caller_streams: grad_buffer, reduce_gradients and release take the "
          "caller's stream and order it on the device (one rank, on CUDA).")
      .def_prop_ro("dtype", [](PyEngine& e) { return std::string(DTypeLabel(e.engine().dtype())); })
      .def_prop_ro("device", &PyEngine::DeviceLabel, "host, or cuda:N.")
      .def_prop_ro("num_groups", [](PyEngine& e) { return e.engine().model().groups.size(); })
      .def(
          "health", [](PyEngine& e) { ThrowIfError(e.engine().health()); },
          "Raises the error that failed the engine, if any.");
  m.def(
      "owned_range",
      [](size_t numel, int world_size, int rank) {
        const auto [begin, end] = ValueOrThrow(Engine::OwnedRange(numel, world_size, rank));
        return std::make_tuple(begin, end);
      },
      nb::arg("numel"), nb::arg("world_size"), nb::arg("rank"),
      "[begin, end) of a group of `numel` elements that `rank` stores at stage 3.");
}

}  // namespace strata::python
