// TieredStore's NVMe tier: opening the nvme::SwapSpace once every NVMe-homed block is registered
// (explicitly or at the first NVMe operation). See the "Phases" paragraph of
// include/strata/store.h. The IO thread that drives the space is in store_threads.cc.
#include <algorithm>

#include "core/store/store_internal.h"
#include "nvme/swap_space.h"

namespace strata::store {

Status TieredStore::NvmeReadyFor(BlockId id) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (id >= blocks_.size() || blocks_[id]->spec.home != Tier::kNvme) return Status::OK();
    if (nvme_state_ == NvmeState::kOpen) {
      return nvme_status_.ok() ? Status::OK() : nvme_status_.WithContext(Name(*blocks_[id]));
    }
  }
  Status s = OpenNvme();
  if (s.ok()) return s;
  std::lock_guard<std::mutex> l(mu_);
  return s.WithContext(Name(*blocks_[id]));
}

Status TieredStore::OpenNvme() {
  std::lock_guard<std::mutex> serial(nvme_open_mu_);
  std::vector<nvme::SwapBlockSpec> specs;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (nvme_state_ == NvmeState::kOpen) return nvme_status_;
    if (budget_[Tier::kNvme] == 0) {
      return Status::FailedPrecondition("TieredStore::OpenNvme: the NVMe tier is disabled");
    }
    nvme_state_ = NvmeState::kOpening;  // Register of NVMe-homed blocks is refused from here
    for (const auto& bp : blocks_) {
      if (bp->spec.home == Tier::kNvme) specs.push_back({bp->id, bp->alloc_bytes});
    }
  }
  // Slow (preallocation) and outside mu_: the store keeps serving host and device blocks.
  // The IO thread does not run yet, so the backend is ours.
  Status s;
  std::unique_ptr<nvme::SwapSpace> swap;
  if (!specs.empty()) {
    nvme::SwapSpaceOptions so;
    so.paths = options_.nvme_paths;
    so.rank = options_.rank;
    so.stripe_unit_bytes = options_.stripe_unit_bytes;
    so.allow_buffered_io = options_.allow_buffered_io;
    so.max_inflight_ops = std::max<size_t>(1, options_.max_inflight_ios);
    auto created = nvme::SwapSpace::Create(so, specs, options_.io.get());
    if (created.ok()) {
      swap = std::move(created).value();
      const uint64_t host_bytes = host_alloc_->capacity_bytes();
      Status rb = options_.io->RegisterBuffer(host_base_, host_bytes);
      if (rb.ok()) {
        host_registered_ = true;
      } else if (!rb.IsUnavailable()) {
        s = rb;
      }
    } else {
      s = created.status();
    }
    if (!s.ok()) swap.reset();  // removes the files it created
  }
  s = s.WithContext("TieredStore: opening the NVMe tier");
  std::lock_guard<std::mutex> l(mu_);
  if (swap) {
    if (!swap->note().empty()) note_ += swap->note() + "\n";
    // The IO path's preallocations: one job slot per block (the NVMe-homed ones are all
    // registered by now) and room for each to be queued once.
    io_jobs_.assign(blocks_.size(), IoJob{});
    {
      std::lock_guard<std::mutex> io(io_mu_);
      io_queue_ = nvme::BoundedQueue<BlockId>(blocks_.size());
    }
    {
      std::lock_guard<std::mutex> mv(mv_mu_);
      io_events_.reserve(std::max<size_t>(1, options_.max_inflight_ios));
    }
    swap_ = std::move(swap);
    io_thread_ = std::thread([this] { IoLoop(); });
  }
  nvme_status_ = s;
  nvme_state_ = NvmeState::kOpen;
  return s;
}

bool TieredStore::nvme_open() const {
  std::lock_guard<std::mutex> l(mu_);
  return nvme_state_ == NvmeState::kOpen && nvme_status_.ok();
}

std::vector<std::string> TieredStore::nvme_files() const {
  std::lock_guard<std::mutex> l(mu_);
  return swap_ ? swap_->files() : std::vector<std::string>{};
}

}  // namespace strata::store
