// ZeRO collectives: the bucketed, coalesced all-gather of groups' parameter shards into the full
// buffer, and the bucketed reduce-scatter of a full gradient buffer into the local grad shards,
// over any Communicator and the layouts of sched/zero_partition.h.
//
// One coalesced call per bucket (NCCL: one group launch; Gloo: one queued task). Each group's
// all-gather reads the rank's shard in place from the shard buffer and writes its padded full
// buffer directly: no staging buffer, no interleaving copy.
//
// Thread safety: as the Communicator it drives (submit from one thread).
#pragma once

#include <vector>

#include "sched/zero_partition.h"
#include "strata/comm.h"

namespace strata::zero {

class ZeroCollectives {
 public:
  // `comm` and `plan` are not owned and must outlive this object.
  // REQUIRES: plan->world_size == comm->world_size().
  ZeroCollectives(Communicator* comm, const sched::PartitionPlan* plan, DType dtype)
      : comm_(comm), plan_(plan), dtype_(dtype) {}

  // Gathers groups [first, end): shards from `shard_buf` (the rank's shard buffer, all groups)
  // into `full_buf` (the full buffer, all groups). Returns one handle per bucket, in order.
  // kInvalidArgument for a bad range or bucket size, or when the plan's world size differs from
  // the communicator's; otherwise what the Communicator returns. When a bucket fails to submit
  // after earlier ones were submitted, the communicator is aborted (ranks' sequences diverged) and
  // the earlier buckets are waited for before the error returns, so no operation outlives the
  // call using the caller's buffers.
  Result<std::vector<CommHandle>> AllGatherGroups(const void* shard_buf, void* full_buf,
                                                  size_t first, size_t end, size_t bucket_elems);

  // Reduce-scatters groups [first, end) of the full gradient buffer `full_grads` into the rank's
  // grad shard buffer `shard_grads`. REQUIRES: the padding elements of full_grads are zero (they
  // are summed into the shards' padding).
  Result<std::vector<CommHandle>> ReduceScatterGroups(const void* full_grads, void* shard_grads,
                                                      size_t first, size_t end, size_t bucket_elems,
                                                      ReduceOptions options = {});

 private:
  Status Check() const;
  Status FailAfterSubmitted(const std::vector<CommHandle>& submitted, const char* kind,
                            size_t bucket, size_t buckets, const Status& error);
  Communicator* comm_;
  const sched::PartitionPlan* plan_;
  DType dtype_;
};

// ZeRO++ (issue 14) sizes, the one place the engine's layout and its collectives take them from.
// Wire format: kernels/quantize.h (Int8WireLayout, kQuantBlock); one rank's shard of S elements
// quantizes to Int8WireLayout(S).total_bytes.
struct ZppWorkingBytes {
  uint64_t device = 0;  // wire buffers of the quantized collectives
  uint64_t host = 0;    // fp32 sums (qgZ) and, on a device the host cannot address, staging
};

// hpZ: elements of a rank's secondary slice of a group (the padded group over the group size k).
inline size_t HpzSecondaryElems(const sched::GroupShard& s, int world, int k) {
  return s.padded_elems(world) / static_cast<size_t>(k);
}

// The quantized collectives' buffers for the largest shard (`shard_elems`) and group
// (`padded_elems`) in the working dtype of `elt` bytes:
//   qwZ: the gathered wire buffers (world of them) and this rank's;
//   qgZ: the intra-node all-to-all's send and receive (world wire chunks each), the inter-node
//        one's (nodes chunks each); fp32 sums: nodes shards after the first hop, one after the
//        second.
// Staging (host_addressable false): the full group and every wire buffer pass through the host.
ZppWorkingBytes ZppWorking(bool qwz, bool qgz, int world, int nodes, uint64_t shard_elems,
                           uint64_t padded_elems, size_t elt, bool host_addressable);

// Waits for every handle with one deadline; returns the first error.
Status WaitAll(const std::vector<CommHandle>& handles,
               std::chrono::steady_clock::time_point deadline);

}  // namespace strata::zero
