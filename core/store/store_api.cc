// The public parts of include/strata/store.h that every implementation shares: Ticket, Lease,
// Store::MakeLease, and the factory of the tiered store.
#include <memory>
#include <mutex>

#include "core/store/store_internal.h"
#include "core/store/tiered_store.h"
#include "strata/store.h"

namespace strata {

// ---------------------------------------------------------------------------
// Ticket and Lease.
// ---------------------------------------------------------------------------
Status Ticket::Wait(std::chrono::nanoseconds timeout) const {
  if (!s_) return Status::FailedPrecondition("Ticket::Wait on an empty ticket");
  std::unique_lock<std::mutex> l(s_->mu);
  if (!s_->cv.wait_for(l, timeout, [&] { return s_->done; })) {
    return Status::DeadlineExceeded("store operation did not finish within the timeout");
  }
  if (!s_->status.ok()) s_->delivered = true;
  return s_->status;
}

void Ticket::Then(std::function<void(Status)> fn) const {
  if (!s_) {
    fn(Status::FailedPrecondition("Ticket::Then on an empty ticket"));
    return;
  }
  {
    std::lock_guard<std::mutex> l(s_->mu);
    if (!s_->done) {
      s_->then.push_back(std::move(fn));
      return;
    }
    if (!s_->status.ok()) s_->delivered = true;
  }
  fn(s_->status);
}

bool Ticket::ready() const {
  if (!s_) return false;
  std::lock_guard<std::mutex> l(s_->mu);
  return s_->done;
}

Lease& Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    Release();
    store_ = o.store_;
    block_ = o.block_;
    tier_ = o.tier_;
    access_ = o.access_;
    data_ = o.data_;
    size_bytes_ = o.size_bytes_;
    dirty_ = o.dirty_;
    o.store_ = nullptr;
  }
  return *this;
}

void Lease::Release() {
  if (store_ == nullptr) return;
  store_->ReleaseLease(*this);
  store_ = nullptr;
  data_ = nullptr;
}

Lease Store::MakeLease(BlockId id, Tier tier, Access access, void* data, uint64_t size_bytes) {
  Lease l;
  l.store_ = this;
  l.block_ = id;
  l.tier_ = tier;
  l.access_ = access;
  l.data_ = data;
  l.size_bytes_ = size_bytes;
  return l;
}

Result<std::unique_ptr<Store>> OpenTieredStore(TieredStoreOptions options) {
  STRATA_ASSIGN_OR_RETURN(auto s, store::TieredStore::Open(std::move(options)));
  return std::unique_ptr<Store>(std::move(s));
}

}  // namespace strata
