// Communicator: collective operations among the ranks of a data-parallel job (all-gather,
// reduce-scatter, all-reduce, broadcast, all-to-all, barrier) over contiguous buffers of fp32,
// bf16 or fp16 (the data-movement operations, all-gather, broadcast and all-to-all, also int8:
// ZeRO++ moves quantized blocks), each returning a CommHandle to wait on with a deadline. Backends:
// GlooCommunicator (cpu/, host buffers over TCP) and NcclCommunicator (gpu/, device buffers on the
// communicator's stream).
//
// Semantics follow NCCL: every rank issues the same collectives in the same order; rank r's
// all-gather input lands at recv + r * send_count; reduce-scatter leaves chunk r of the sum in
// rank r's recv. In place is allowed exactly where NCCL allows it (all-gather: send == recv + r *
// send_count; reduce-scatter: recv == send + r * recv_count; all-reduce: send == recv). Sums of
// bf16/fp16 are accumulated in fp32 by the Gloo backend and rounded once (round to nearest even).
//
// Groups: Split(color, key) builds sub-communicators (MPI_Comm_split / ncclCommSplit);
// SplitHierarchical below builds the two a hierarchical algorithm needs: the ranks of one node
// (intra) and the ranks with the same local index across nodes (inter). A sub-communicator is a
// Communicator like any other, with its own ranks, operation order, failure state and CommStats:
// the inter communicator's stats are the bytes that crossed node boundaries.
//
// Failure model: an operation that fails (a peer died, a transport timeout, an abort) fails its
// handle with a clear Status and puts the communicator into a failed state: every later operation
// fails fast with kAborted naming the first error. There is no recovery; build a new one.
//
// Byte accounting: each operation the backend accepted adds to CommStats, per operation kind, the
// payload bytes (what nccl-tests calls the size) and the ideal bytes a bandwidth-optimal ring sends
// and receives per rank (RingBytes below): ZeRO stages 0-2 move one all-reduce's worth per step,
// stage 3 1.5x. Separately, as each operation runs, the backend adds the bytes it actually put on
// and took off the wire (wire_*): the Gloo backend counts its rings and all-gathers transfer by
// transfer (16-bit reduce-scatter sends fp32 partial sums: 2x the ideal; 16-bit all-reduce: 1.5x);
// for algorithms it does not instrument (Gloo's fp32 all-reduce and broadcast, NCCL's kernels,
// which reduce 16-bit data natively) it adds the ideal figure. All-to-all sends one chunk to each
// peer, so its ideal and wire figures agree. Split's own exchanges are setup and not counted.
//
// Implementation: cpu/comm.cc (in strata_cpu) holds the validation and accounting every backend
// shares; a backend overrides the Do* hooks only.
//
// Thread safety: submit operations from one thread at a time (the order of collectives must match
// across ranks, so concurrent submitters would race anyway). rank(), world_size(), stats(),
// Abort() and the handles (Wait from any thread) are thread-safe.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/dtype.h"
#include "strata/status.h"

namespace strata {

enum class CommOp : uint8_t {
  kAllGather = 0,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kBarrier,
  kAllToAll
};
inline constexpr size_t kCommOpCount = 6;

constexpr std::string_view CommOpName(CommOp op) noexcept {
  switch (op) {
    case CommOp::kAllGather:
      return "all_gather";
    case CommOp::kReduceScatter:
      return "reduce_scatter";
    case CommOp::kAllReduce:
      return "all_reduce";
    case CommOp::kBroadcast:
      return "broadcast";
    case CommOp::kBarrier:
      return "barrier";
    case CommOp::kAllToAll:
      return "all_to_all";
  }
  return "?";
}

// Bytes one rank sends (== receives) in a bandwidth-optimal ring for an operation whose payload is
// `payload_bytes` (all-gather: the gathered output; reduce-scatter and all-to-all: the full input;
// all-reduce and broadcast: the buffer). These are the factors nccl-tests uses for busbw: (N-1)/N
// for all-gather, reduce-scatter and all-to-all (every chunk but one's own leaves the rank),
// 2(N-1)/N for all-reduce, 1 for broadcast (counted as the root's send and each other rank's
// receive: see CommOpBytes). Integer division: exact when payload divides by N.
constexpr uint64_t RingBytes(CommOp op, uint64_t payload_bytes, int world_size) noexcept {
  const uint64_t n = world_size > 0 ? static_cast<uint64_t>(world_size) : 1;
  switch (op) {
    case CommOp::kAllGather:
    case CommOp::kReduceScatter:
    case CommOp::kAllToAll:
      return payload_bytes * (n - 1) / n;
    case CommOp::kAllReduce:
      return 2 * payload_bytes * (n - 1) / n;
    case CommOp::kBroadcast:
      return n > 1 ? payload_bytes : 0;
    case CommOp::kBarrier:
      return 0;
  }
  return 0;
}

// nccl-tests' busbw factor (bus bytes / payload bytes) for one operation kind.
constexpr double BusBandwidthFactor(CommOp op, int world_size) noexcept {
  const double n = world_size > 0 ? world_size : 1;
  switch (op) {
    case CommOp::kAllGather:
    case CommOp::kReduceScatter:
    case CommOp::kAllToAll:
      return (n - 1) / n;
    case CommOp::kAllReduce:
      return 2 * (n - 1) / n;
    case CommOp::kBroadcast:
      return 1;
    case CommOp::kBarrier:
      return 0;
  }
  return 0;
}

struct CommOpBytes {
  uint64_t calls = 0;                // operations accepted (a coalesced call counts its parts)
  uint64_t payload_bytes = 0;        // sum of payloads (see RingBytes)
  uint64_t sent_bytes = 0;           // this rank's ring send volume (broadcast: root only)
  uint64_t received_bytes = 0;       // this rank's ring receive volume (broadcast: non-roots only)
  uint64_t wire_sent_bytes = 0;      // bytes the backend actually sent (operations that ran)
  uint64_t wire_received_bytes = 0;  // bytes the backend actually received
};

struct CommStats {
  std::array<CommOpBytes, kCommOpCount> ops{};
  const CommOpBytes& of(CommOp op) const { return ops[static_cast<size_t>(op)]; }
  CommOpBytes& of(CommOp op) { return ops[static_cast<size_t>(op)]; }
  uint64_t total_sent_bytes() const {
    uint64_t s = 0;
    for (const auto& o : ops) s += o.sent_bytes;
    return s;
  }
  uint64_t total_wire_sent_bytes() const {
    uint64_t s = 0;
    for (const auto& o : ops) s += o.wire_sent_bytes;
    return s;
  }
};

// The asynchronous completion of one submitted operation; implemented by each backend.
class CommWork {
 public:
  virtual ~CommWork() = default;
  // Blocks until the operation finished or `deadline` passed. Returns its Status when finished;
  // kDeadlineExceeded when still running at the deadline. What happens then is the backend's:
  // Gloo leaves the operation running (its transport timeout bounds it; wait again, or Abort);
  // NCCL aborts the communicator, since a kernel waiting for a dead peer would spin forever.
  // Callable repeatedly and from any thread.
  virtual Status WaitUntil(std::chrono::steady_clock::time_point deadline) = 0;
  // True once finished (successfully or not); never blocks.
  virtual bool Ready() = 0;
};

// A copyable, shared handle on one submitted operation. Buffers handed to the
// operation must stay valid until a Wait returned something other than kDeadlineExceeded (or the
// communicator was destroyed, which waits for its operations).
class [[nodiscard]] CommHandle {
 public:
  CommHandle() = default;
  explicit CommHandle(std::shared_ptr<CommWork> work) : work_(std::move(work)) {}

  // See CommWork::WaitUntil. An empty handle returns kFailedPrecondition.
  Status WaitUntil(std::chrono::steady_clock::time_point deadline) const;
  Status WaitFor(std::chrono::milliseconds timeout) const;
  bool Ready() const { return work_ && work_->Ready(); }
  bool valid() const { return work_ != nullptr; }

 private:
  std::shared_ptr<CommWork> work_;
};

// Reduction options. predivide: multiply every rank's input by 1/world_size before the sum (in
// fp32), DeepSpeed's gradient pre-division that keeps fp16 sums from overflowing.
struct ReduceOptions {
  bool predivide = false;
};

// One all-gather of a coalesced call: send_count elements from `send`, world_size * send_count
// into `recv`.
struct AllGatherPart {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t send_count = 0;
};

// One reduce-scatter of a coalesced call: world_size * recv_count elements from `send`,
// recv_count into `recv`.
struct ReduceScatterPart {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t recv_count = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  // "gloo" or "nccl".
  virtual std::string_view backend() const noexcept = 0;

  // Each call validates, accounts and enqueues; the returned handle completes the operation.
  // Errors returned directly (nothing enqueued): kInvalidArgument for an unsupported dtype (int8
  // in a reduction),
  // a null buffer with a non-zero count, a root out of range, or buffers that overlap other than
  // in the in-place layouts above; kAborted when the communicator already failed.
  Result<CommHandle> AllGather(const void* send, void* recv, size_t send_count, DType dtype);
  // Several all-gathers as one operation (NCCL: one group launch). Parts are independent.
  Result<CommHandle> AllGatherCoalesced(std::span<const AllGatherPart> parts, DType dtype);
  Result<CommHandle> ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                   ReduceOptions options = {});
  Result<CommHandle> ReduceScatterCoalesced(std::span<const ReduceScatterPart> parts, DType dtype,
                                            ReduceOptions options = {});
  Result<CommHandle> AllReduce(const void* send, void* recv, size_t count, DType dtype,
                               ReduceOptions options = {});
  // On the root, `buf` is the source; elsewhere it receives.
  Result<CommHandle> Broadcast(void* buf, size_t count, DType dtype, int root);
  Result<CommHandle> Barrier();
  // Rank r sends chunk j (count elements at send + j * count) to rank j and receives rank j's
  // chunk r into recv + j * count; send and recv hold world_size * count elements each and must
  // not overlap (no in-place form). Any dtype (int8 included: the data is only moved).
  Result<CommHandle> AllToAll(const void* send, void* recv, size_t count, DType dtype);

  // Splits this communicator: the ranks that pass the same `color` form one new communicator, in
  // which they are ordered by (key, rank here). Collective: every rank of this communicator calls
  // it, at the same place in its sequence of operations (it is ordered after the operations
  // submitted before it; Gloo exchanges the new transport addresses over this communicator, NCCL
  // calls ncclCommSplit). Blocks until the new communicator is connected or the timeout of this
  // one passed. The new communicator inherits this one's options (timeout, queue depth, device)
  // and is independent afterwards: its own operation order, stats, failure state; it may outlive
  // this one. kInvalidArgument for color < 0; kAborted when this communicator failed; a failure
  // during the split (a peer died, the timeout) fails this communicator too.
  Result<std::unique_ptr<Communicator>> Split(int color, int key);

  // Puts the communicator into the failed state: queued and later operations fail with kAborted
  // carrying `reason`; NCCL aborts its communicator, Gloo lets a running operation end at its
  // transport timeout. Idempotent.
  virtual void Abort(std::string_view reason) = 0;

  CommStats stats() const;
  void ResetStats();

 protected:
  Communicator(int rank, int world_size) : rank_(rank), world_size_(world_size) {}

  // Backend hooks: arguments are validated (dtype is fp32/bf16/fp16, pointers non-null where
  // counts are non-zero, root in range) and accounted.
  virtual Result<CommHandle> DoAllGather(std::span<const AllGatherPart> parts, DType dtype) = 0;
  virtual Result<CommHandle> DoReduceScatter(std::span<const ReduceScatterPart> parts, DType dtype,
                                             ReduceOptions options) = 0;
  virtual Result<CommHandle> DoAllReduce(const void* send, void* recv, size_t count, DType dtype,
                                         ReduceOptions options) = 0;
  virtual Result<CommHandle> DoBroadcast(void* buf, size_t count, DType dtype, int root) = 0;
  virtual Result<CommHandle> DoBarrier() = 0;
  // Both backends implement these two; the defaults (kFailedPrecondition naming the backend) let
  // a test double that needs neither leave them out.
  // REQUIRES: send and recv do not overlap; non-null where count > 0.
  virtual Result<CommHandle> DoAllToAll(const void* /*send*/, void* /*recv*/, size_t /*count*/,
                                        DType /*dtype*/) {
    return Status::FailedPrecondition("all_to_all: not supported by backend " +
                                      std::string(backend()));
  }
  // REQUIRES: color >= 0.
  virtual Result<std::unique_ptr<Communicator>> DoSplit(int /*color*/, int /*key*/) {
    return Status::FailedPrecondition("split: not supported by backend " + std::string(backend()));
  }

  // Adds bytes the backend actually transferred for an operation of kind `op` (any thread).
  void AddWireBytes(CommOp op, uint64_t sent, uint64_t received);
  // A backend that cannot observe its transfers (NCCL) sets this in its constructor: every
  // accepted operation then adds its ideal ring figures to the wire figures too.
  bool wire_bytes_are_ideal_ = false;

 private:
  void Account(CommOp op, uint64_t payload_bytes, bool sends, bool receives);

  const int rank_;
  const int world_size_;
  mutable std::mutex stats_mu_;
  CommStats stats_;
};

// A small key-value store for rendezvous (exchanging transport addresses or an ncclUniqueId).
// Implementations: a file store (shared directory) and a TCP store (cpu/rendezvous/rendezvous.h).
// Thread safety: implementations are thread-safe.
class KvStore {
 public:
  virtual ~KvStore() = default;
  // Publishes `value` under `key` (overwrites). kIOError/kUnavailable when the store is
  // unreachable.
  virtual Status Set(std::string_view key, std::span<const uint8_t> value) = 0;
  // Blocks until `key` exists, then returns its value. kDeadlineExceeded naming the key when it
  // did not appear within `timeout`; kUnavailable when the store went away.
  virtual Result<std::vector<uint8_t>> Get(std::string_view key,
                                           std::chrono::milliseconds timeout) = 0;
  // Removes `key` (no error when it is absent). Callers delete what they published once every
  // reader is known to have read it (after a setup barrier), so that a store directory reused by
  // a later run holds no stale values. kIOError/kUnavailable when the store is unreachable.
  virtual Status Delete(std::string_view key) = 0;
};

// A launched rank's place in its job and the store its ranks meet through, from the environment
// `offloadctl launch` and torchrun set: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
// (rank 0 serves an authenticated TCP store there, STRATA_RDZV_SECRET being the run's secret),
// or STRATA_RDZV_DIR (a file store in that shared directory); keys scoped to the run id. What
// GlooCommOptions::store (and an NCCL communicator's ncclUniqueId exchange) needs at world > 1.
// kInvalidArgument naming the variable that is missing or wrong (cpu/rendezvous/rendezvous.h).
struct LaunchRendezvous {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::unique_ptr<KvStore> store;  // rank 0's serves the others: keep it until they are set up
};
Result<LaunchRendezvous> OpenLaunchRendezvous();

// ---------------------------------------------------------------------------
// Hierarchical groups: ranks are laid out node by node (the launchers' convention: rank =
// node * ranks_per_node + local_rank), so a node is `group_size` consecutive ranks.
// ---------------------------------------------------------------------------
struct HierarchicalComms {
  int group_size = 1;  // ranks per group (a node, or hpZ's partition size)
  // The group_size consecutive ranks holding this rank: [g * group_size, (g + 1) * group_size)
  // with g = rank / group_size; intra->rank() == rank % group_size.
  std::unique_ptr<Communicator> intra;
  // The world_size / group_size ranks with this rank's index in their group (one per group,
  // i.e. per node): intra->rank() + k * group_size; inter->rank() == rank / group_size.
  std::unique_ptr<Communicator> inter;
};

// Builds both groups from `comm` with two Splits (intra first, then inter; collective on every
// rank of comm). kInvalidArgument when group_size < 1 or does not divide comm's world size.
// group_size == world size: intra spans the job and inter is one rank per communicator;
// group_size 1: the reverse.
Result<HierarchicalComms> SplitHierarchical(Communicator& comm, int group_size);

// Ranks per node of a launched job: LOCAL_WORLD_SIZE (set by torchrun, the deepspeed launcher and
// `offloadctl launch`), checked against WORLD_SIZE `world_size` (must divide it) and LOCAL_RANK
// (must be below it, and rank % local world size when RANK is set: the node-by-node layout the
// groups assume). Absent: world_size (one node). kInvalidArgument naming the variable otherwise.
// `getenv` is injectable for tests.
Result<int> RanksPerNodeFromEnv(int world_size, const char* (*getenv)(const char*) = nullptr);

// ---------------------------------------------------------------------------
// The Gloo backend (cpu/gloo_comm.cc): collectives over TCP on host buffers, for runs without a
// GPU (and with HostDevice). Its behaviour is documented in cpu/gloo_comm.h.
// ---------------------------------------------------------------------------
struct GlooCommOptions {
  int rank = 0;
  int world_size = 1;
  // Rendezvous store used during Create only (not owned). REQUIRES: non-null when world_size > 1.
  KvStore* store = nullptr;
  // Keys are "<store_prefix>/..." so that several communicators can share one store.
  std::string store_prefix = "strata/gloo";
  // Address the TCP transport binds to (this host's address as the peers see it). Empty: the
  // environment's STRATA_GLOO_HOSTNAME (how a launcher gives each node its address, e.g.
  // tools/netns-topology.sh), else 127.0.0.1 (one machine).
  std::string hostname;
  // Bound on rendezvous, every transport wait and a full submit queue. Longer tolerates slow
  // peers; shorter detects a hung peer sooner.
  std::chrono::milliseconds timeout{60000};
  // Operations submitted but not finished. Bounds memory held by queued closures.
  size_t queue_depth = 64;
  // fp32 elements per reduction segment (scratch memory = 2 * 4 * scratch_elems bytes).
  size_t scratch_elems = size_t{1} << 20;
};

// Connects to all peers (full mesh through the store), then runs a barrier so that the store may
// be dropped afterwards. kInvalidArgument for bad options; kDeadlineExceeded / kUnavailable when
// peers do not show up or the transport fails, with Gloo's message.
// Sets SIGPIPE to SIG_IGN when it has the default action (a dead peer must fail a collective with
// kUnavailable, not kill this process); a handler the program installed is left alone.
Result<std::unique_ptr<Communicator>> CreateGlooCommunicator(const GlooCommOptions& options);

}  // namespace strata
