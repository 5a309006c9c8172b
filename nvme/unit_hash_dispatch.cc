// UnitHash through libxxhash's x86 run-time dispatcher (see unit_hash.h).
#include <xxh_x86dispatch.h>

#include "nvme/unit_hash.h"

namespace strata::nvme {

uint64_t UnitHash(const void* data, size_t size_bytes) {
  return XXH3_64bits_dispatch(data, size_bytes);
}

}  // namespace strata::nvme
