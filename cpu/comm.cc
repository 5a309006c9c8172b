// The Communicator base (include/strata/comm.h): the argument checks and byte accounting every
// backend shares (GlooCommunicator here in cpu/, NcclCommunicator in gpu/ only override the Do*
// hooks), the hierarchical groups and the launcher's ranks-per-node variables.
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "strata/comm.h"

namespace strata {

Status CommHandle::WaitUntil(std::chrono::steady_clock::time_point deadline) const {
  if (!work_) return Status::FailedPrecondition("Wait on an empty CommHandle");
  return work_->WaitUntil(deadline);
}

Status CommHandle::WaitFor(std::chrono::milliseconds timeout) const {
  return WaitUntil(std::chrono::steady_clock::now() + timeout);
}

namespace {
bool Overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}
// Reductions: fp32, bf16, fp16.
Status CheckDType(DType dtype, std::string_view op) {
  if (dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16) return Status::OK();
  return Status::InvalidArgument(std::string(op) + ": dtype " + std::string(DTypeName(dtype)) +
                                 " is not supported (fp32, bf16, fp16)");
}
// Data movement (all-gather, broadcast, all-to-all): int8 too.
Status CheckMoveDType(DType dtype, std::string_view op) {
  if (dtype == DType::kI8) return Status::OK();
  return CheckDType(dtype, op);
}
Status CheckPtrs(const void* send, const void* recv, size_t count, std::string_view op) {
  if (count > 0 && (send == nullptr || recv == nullptr)) {
    return Status::InvalidArgument(std::string(op) + ": null buffer with count " +
                                   std::to_string(count));
  }
  return Status::OK();
}
}  // namespace

void Communicator::Account(CommOp op, uint64_t payload_bytes, bool sends, bool receives) {
  const uint64_t ring = RingBytes(op, payload_bytes, world_size_);
  std::lock_guard<std::mutex> lock(stats_mu_);
  CommOpBytes& s = stats_.of(op);
  ++s.calls;
  s.payload_bytes += payload_bytes;
  if (sends) s.sent_bytes += ring;
  if (receives) s.received_bytes += ring;
  if (wire_bytes_are_ideal_) {
    if (sends) s.wire_sent_bytes += ring;
    if (receives) s.wire_received_bytes += ring;
  }
}

void Communicator::AddWireBytes(CommOp op, uint64_t sent, uint64_t received) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.of(op).wire_sent_bytes += sent;
  stats_.of(op).wire_received_bytes += received;
}

CommStats Communicator::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

void Communicator::ResetStats() {
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_ = CommStats{};
}

Result<CommHandle> Communicator::AllGather(const void* send, void* recv, size_t send_count,
                                           DType dtype) {
  const AllGatherPart part{send, recv, send_count};
  return AllGatherCoalesced(std::span<const AllGatherPart>(&part, 1), dtype);
}

Result<CommHandle> Communicator::AllGatherCoalesced(std::span<const AllGatherPart> parts,
                                                    DType dtype) {
  STRATA_RETURN_IF_ERROR(CheckMoveDType(dtype, "all_gather"));
  const size_t elt = DTypeSize(dtype);
  for (const AllGatherPart& p : parts) {
    STRATA_RETURN_IF_ERROR(CheckPtrs(p.send, p.recv, p.send_count, "all_gather"));
    const size_t in_bytes = p.send_count * elt;
    const auto* own = static_cast<const char*>(p.recv) + static_cast<size_t>(rank_) * in_bytes;
    if (p.send != own &&
        Overlap(p.send, in_bytes, p.recv, in_bytes * static_cast<size_t>(world_size_))) {
      return Status::InvalidArgument(
          "all_gather: send overlaps recv but is not the in-place slot recv + rank * send_count");
    }
  }
  auto h = DoAllGather(parts, dtype);
  if (h.ok()) {
    for (const AllGatherPart& p : parts) {
      Account(CommOp::kAllGather, p.send_count * elt * static_cast<uint64_t>(world_size_), true,
              true);
    }
  }
  return h;
}

Result<CommHandle> Communicator::ReduceScatter(const void* send, void* recv, size_t recv_count,
                                               DType dtype, ReduceOptions options) {
  const ReduceScatterPart part{send, recv, recv_count};
  return ReduceScatterCoalesced(std::span<const ReduceScatterPart>(&part, 1), dtype, options);
}

Result<CommHandle> Communicator::ReduceScatterCoalesced(std::span<const ReduceScatterPart> parts,
                                                        DType dtype, ReduceOptions options) {
  STRATA_RETURN_IF_ERROR(CheckDType(dtype, "reduce_scatter"));
  const size_t elt = DTypeSize(dtype);
  for (const ReduceScatterPart& p : parts) {
    STRATA_RETURN_IF_ERROR(CheckPtrs(p.send, p.recv, p.recv_count, "reduce_scatter"));
    const size_t out_bytes = p.recv_count * elt;
    const auto* own = static_cast<const char*>(p.send) + static_cast<size_t>(rank_) * out_bytes;
    if (p.recv != own &&
        Overlap(p.send, out_bytes * static_cast<size_t>(world_size_), p.recv, out_bytes)) {
      return Status::InvalidArgument(
          "reduce_scatter: recv overlaps send but is not the in-place slot send + rank * "
          "recv_count");
    }
  }
  auto h = DoReduceScatter(parts, dtype, options);
  if (h.ok()) {
    for (const ReduceScatterPart& p : parts) {
      Account(CommOp::kReduceScatter, p.recv_count * elt * static_cast<uint64_t>(world_size_), true,
              true);
    }
  }
  return h;
}

Result<CommHandle> Communicator::AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                           ReduceOptions options) {
  STRATA_RETURN_IF_ERROR(CheckDType(dtype, "all_reduce"));
  STRATA_RETURN_IF_ERROR(CheckPtrs(send, recv, count, "all_reduce"));
  const size_t bytes = count * DTypeSize(dtype);
  if (send != recv && Overlap(send, bytes, recv, bytes)) {
    return Status::InvalidArgument("all_reduce: send and recv overlap but are not equal");
  }
  auto h = DoAllReduce(send, recv, count, dtype, options);
  if (h.ok()) Account(CommOp::kAllReduce, bytes, true, true);
  return h;
}

Result<CommHandle> Communicator::Broadcast(void* buf, size_t count, DType dtype, int root) {
  STRATA_RETURN_IF_ERROR(CheckMoveDType(dtype, "broadcast"));
  STRATA_RETURN_IF_ERROR(CheckPtrs(buf, buf, count, "broadcast"));
  if (root < 0 || root >= world_size_) {
    return Status::InvalidArgument("broadcast: root " + std::to_string(root) +
                                   " out of range for world size " + std::to_string(world_size_));
  }
  auto h = DoBroadcast(buf, count, dtype, root);
  if (h.ok()) Account(CommOp::kBroadcast, count * DTypeSize(dtype), rank_ == root, rank_ != root);
  return h;
}

Result<CommHandle> Communicator::Barrier() {
  auto h = DoBarrier();
  if (h.ok()) Account(CommOp::kBarrier, 0, false, false);
  return h;
}

Result<CommHandle> Communicator::AllToAll(const void* send, void* recv, size_t count, DType dtype) {
  STRATA_RETURN_IF_ERROR(CheckMoveDType(dtype, "all_to_all"));
  STRATA_RETURN_IF_ERROR(CheckPtrs(send, recv, count, "all_to_all"));
  const uint64_t bytes = count * DTypeSize(dtype) * static_cast<uint64_t>(world_size_);
  if (Overlap(send, bytes, recv, bytes)) {
    return Status::InvalidArgument("all_to_all: send and recv overlap (no in-place form)");
  }
  auto h = DoAllToAll(send, recv, count, dtype);
  if (h.ok()) Account(CommOp::kAllToAll, bytes, true, true);
  return h;
}

Result<std::unique_ptr<Communicator>> Communicator::Split(int color, int key) {
  if (color < 0) {
    return Status::InvalidArgument("split: color " + std::to_string(color) + " must be >= 0");
  }
  return DoSplit(color, key);
}

Result<HierarchicalComms> SplitHierarchical(Communicator& comm, int group_size) {
  const int n = comm.world_size(), r = comm.rank();
  if (group_size < 1 || n % group_size != 0) {
    return Status::InvalidArgument("hierarchical groups: group size " + std::to_string(group_size) +
                                   " must be >= 1 and divide the world size " + std::to_string(n));
  }
  HierarchicalComms h;
  h.group_size = group_size;
  STRATA_ASSIGN_OR_RETURN(h.intra, comm.Split(r / group_size, r));
  STRATA_ASSIGN_OR_RETURN(h.inter, comm.Split(r % group_size, r));
  return h;
}

Result<int> RanksPerNodeFromEnv(int world_size, const char* (*getenv_fn)(const char*)) {
  if (getenv_fn == nullptr) getenv_fn = [](const char* n) -> const char* { return std::getenv(n); };
  auto parse = [&](const char* name, int* out) -> Status {
    const char* v = getenv_fn(name);
    if (v == nullptr || *v == '\0') return Status::NotFound(name);
    const char* end = v + std::strlen(v);
    auto [p, ec] = std::from_chars(v, end, *out);
    if (ec != std::errc() || p != end) {
      return Status::InvalidArgument(std::string(name) + "='" + v + "' is not an integer");
    }
    return Status::OK();
  };
  int local = 0;
  Status st = parse("LOCAL_WORLD_SIZE", &local);
  if (st.code() == Status::Code::kNotFound) return world_size;
  STRATA_RETURN_IF_ERROR(st);
  if (local < 1 || world_size % local != 0) {
    return Status::InvalidArgument(
        "LOCAL_WORLD_SIZE=" + std::to_string(local) +
        " must be >= 1 and divide WORLD_SIZE=" + std::to_string(world_size));
  }
  int local_rank = 0, rank = 0;
  st = parse("LOCAL_RANK", &local_rank);
  if (st.ok() && (local_rank < 0 || local_rank >= local)) {
    return Status::InvalidArgument("LOCAL_RANK=" + std::to_string(local_rank) +
                                   " must be in [0, LOCAL_WORLD_SIZE=" + std::to_string(local) +
                                   ")");
  }
  if (!st.ok() && st.code() != Status::Code::kNotFound) return st;
  const Status rank_st = parse("RANK", &rank);
  if (st.ok() && rank_st.ok() && rank % local != local_rank) {
    return Status::InvalidArgument(
        "LOCAL_RANK=" + std::to_string(local_rank) + " is not RANK=" + std::to_string(rank) +
        " mod LOCAL_WORLD_SIZE=" + std::to_string(local) + ": ranks are not laid out node by node");
  }
  if (!rank_st.ok() && rank_st.code() != Status::Code::kNotFound) return rank_st;
  return local;
}

}  // namespace strata
