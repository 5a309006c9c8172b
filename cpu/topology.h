// Topology: cores, hardware threads and NUMA nodes of this machine, from hwloc, and binding of
// memory to a node.
//
// Thread safety: after Detect() returns, every const method may be called from any thread
// (hwloc's read-only queries on a loaded topology are thread-safe).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "strata/status.h"

struct hwloc_topology;

namespace strata::cpu {

class Topology {
 public:
  // Loads the machine topology. Internal: hwloc failed to init or load (errno in the message).
  static Result<std::unique_ptr<Topology>> Detect();
  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  int cores() const noexcept { return cores_; }
  int hardware_threads() const noexcept { return pus_; }
  // NUMA nodes (at least 1: a machine without NUMA information is one node).
  int numa_nodes() const noexcept { return numa_nodes_; }
  // The NUMA node (logical index) the calling thread runs on, or -1 if it spans several.
  int CurrentNumaNode() const;
  // Binds the pages of [base, base+size_bytes) to `node` (hwloc_set_area_membind, strict
  // binding). Call before the pages are first touched. InvalidArgument: node out of range.
  // Unavailable: the OS refused the binding (errno in the message).
  Status BindMemory(void* base, size_t size_bytes, int node) const;
  // "2 cores, 2 threads, 1 NUMA node".
  std::string Summary() const;

 private:
  Topology() = default;
  hwloc_topology* topo_ = nullptr;
  int cores_ = 0;
  int pus_ = 0;
  int numa_nodes_ = 1;
};

}  // namespace strata::cpu
