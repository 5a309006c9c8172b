#include "cpu/topology.h"

#include <hwloc.h>

#include <cerrno>

namespace strata::cpu {

// One macro turns an hwloc failure (-1 with errno) into a Status naming the call and line.
#define STRATA_HWLOC_CHECK(call)                                                             \
  do {                                                                                       \
    if ((call) < 0) {                                                                        \
      return Status::FromErrno(errno, #call " at " __FILE__ ":" + std::to_string(__LINE__)); \
    }                                                                                        \
  } while (0)

Result<std::unique_ptr<Topology>> Topology::Detect() {
  std::unique_ptr<Topology> t(new Topology());
  STRATA_HWLOC_CHECK(hwloc_topology_init(&t->topo_));
  STRATA_HWLOC_CHECK(hwloc_topology_load(t->topo_));
  t->cores_ = std::max(1, hwloc_get_nbobjs_by_type(t->topo_, HWLOC_OBJ_CORE));
  t->pus_ = std::max(1, hwloc_get_nbobjs_by_type(t->topo_, HWLOC_OBJ_PU));
  t->numa_nodes_ = std::max(1, hwloc_get_nbobjs_by_type(t->topo_, HWLOC_OBJ_NUMANODE));
  return t;
}

Topology::~Topology() {
  if (topo_ != nullptr) hwloc_topology_destroy(topo_);
}

int Topology::CurrentNumaNode() const {
  hwloc_bitmap_t cpus = hwloc_bitmap_alloc();
  int node = -1;
  if (hwloc_get_last_cpu_location(topo_, cpus, HWLOC_CPUBIND_THREAD) == 0) {
    hwloc_bitmap_t nodes = hwloc_bitmap_alloc();
    hwloc_cpuset_to_nodeset(topo_, cpus, nodes);
    if (hwloc_bitmap_weight(nodes) == 1) {
      unsigned os_index = static_cast<unsigned>(hwloc_bitmap_first(nodes));
      hwloc_obj_t obj = hwloc_get_numanode_obj_by_os_index(topo_, os_index);
      if (obj != nullptr) node = static_cast<int>(obj->logical_index);
    }
    hwloc_bitmap_free(nodes);
  }
  hwloc_bitmap_free(cpus);
  return node;
}

Status Topology::BindMemory(void* base, size_t size_bytes, int node) const {
  if (node < 0 || node >= numa_nodes_) {
    return Status::InvalidArgument("NUMA node " + std::to_string(node) +
                                   " out of range (machine has " + std::to_string(numa_nodes_) +
                                   ")");
  }
  hwloc_obj_t obj = hwloc_get_obj_by_type(topo_, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(node));
  if (obj == nullptr)
    return Status::InvalidArgument("NUMA node " + std::to_string(node) + " not found");
  if (hwloc_set_area_membind(topo_, base, size_bytes, obj->nodeset, HWLOC_MEMBIND_BIND,
                             HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_STRICT) < 0) {
    Status s =
        Status::FromErrno(errno, "hwloc_set_area_membind to NUMA node " + std::to_string(node));
    return Status::Unavailable(s.message());
  }
  return Status::OK();
}

std::string Topology::Summary() const {
  return std::to_string(cores_) + " cores, " + std::to_string(pus_) + " threads, " +
         std::to_string(numa_nodes_) + (numa_nodes_ == 1 ? " NUMA node" : " NUMA nodes");
}

}  // namespace strata::cpu
