// Built when strata has no CUDA: there is nothing to register pinned memory with.
#include "cpu/pinned_pool.h"

namespace strata::cpu {
std::unique_ptr<HostMemoryRegistrar> MakeCudaHostRegistrar() { return nullptr; }
}  // namespace strata::cpu
