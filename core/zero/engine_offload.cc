// Engine::OffloadStates / ReloadStates (include/strata/engine.h): the device lent to other work
// between steps. The engine comes to rest, drops every device copy it can make again, and has
// the store set its device-homed blocks aside in host memory (Store::SetAside) until
// ReloadStates restores them; CheckHealthy refuses the calls that use them meanwhile.
#include <algorithm>
#include <string>
#include <vector>

#include "core/zero/engine_internal.h"

namespace strata {

namespace {

bool Chosen(const OffloadStatesOptions& o, StateKind kind) {
  return !o.kinds || std::find(o.kinds->begin(), o.kinds->end(), kind) != o.kinds->end();
}

}  // namespace

Status Engine::OffloadStates(const OffloadStatesOptions& options) {
  Impl& e = *impl_;
  STRATA_RETURN_IF_ERROR(Synchronize());  // a step running behind, the speculated Adam
  if (e.outstanding_gathers > 0) {
    return Status::FailedPrecondition("OffloadStates: " + std::to_string(e.outstanding_gathers) +
                                      " gathered group(s) not released");
  }
  if (e.grad_buffers_out > 0) {
    return Status::FailedPrecondition("OffloadStates: " + std::to_string(e.grad_buffers_out) +
                                      " gradient buffer(s) taken and not reduced (mid-backward)");
  }
  STRATA_RETURN_IF_ERROR(e.DrainReductions(true));
  // The store at rest: every queued operation (prefetches, write-behinds) done, dirty copies home.
  Status st = e.store->Flush(e.timeout());
  if (!st.ok()) return e.Fail(st.WithContext("OffloadStates"));
  // What the engine keeps on the device and can make again.
  e.DropKeptCopies();
  for (zero::GroupState& gs : e.groups) {
    gs.secondary = DeviceBuffer();
    gs.secondary_epoch = -1;
  }
  e.spare_grads.clear();
  std::vector<Ticket> evictions;
  std::vector<BlockId> aside;
  for (BlockId id = 0; id < e.store->num_blocks(); ++id) {
    const BlockSpec& spec = e.store->spec(id);
    if (spec.home != Tier::kDevice) {
      if (e.store->residency(id, Tier::kDevice) == Residency::kValid) {
        evictions.push_back(e.store->Evict(id, Tier::kDevice));
      }
    } else if (Chosen(options, spec.kind) &&
               e.store->residency(id, Tier::kDevice) == Residency::kValid) {
      aside.push_back(id);  // a block set aside already has no device copy
      if (e.store->residency(id, Tier::kHost) == Residency::kValid) {
        evictions.push_back(e.store->Evict(id, Tier::kHost));  // staged for the CPU, or a Save
      }
    }
  }
  for (const Ticket& t : evictions) {
    st = t.Wait(e.timeout());
    if (!st.ok()) return e.Fail(st.WithContext("OffloadStates: dropping a device copy"));
  }
  st = e.store->SetAside(aside, options.pin_memory);
  if (st.IsResourceExhausted()) return st;  // host memory: nothing moved, the engine as it was
  if (!st.ok()) return e.Fail(st.WithContext("OffloadStates"));
  e.aside_blocks.insert(e.aside_blocks.end(), aside.begin(), aside.end());
  // The device's cache of freed memory (CudaDevice's pool) back to the system, for the other work.
  st = e.opt.device->ReleaseCachedMemory(e.timeout());
  if (!st.ok())
    return e.Fail(st.WithContext("OffloadStates: releasing the device's cached memory"));
  return Status::OK();
}

Status Engine::ReloadStates() {
  Impl& e = *impl_;
  if (!e.failed.ok() || e.aside_blocks.empty()) return Synchronize();
  const Status st = e.store->RestoreAside(e.aside_blocks);
  std::erase_if(e.aside_blocks, [&](BlockId id) {
    return e.store->residency(id, Tier::kDevice) == Residency::kValid;
  });
  if (!st.ok() && !st.IsResourceExhausted()) return e.Fail(st.WithContext("ReloadStates"));
  return st;
}

bool Engine::states_offloaded() const { return !impl_->aside_blocks.empty(); }

}  // namespace strata
