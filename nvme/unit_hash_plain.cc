// UnitHash through libxxhash's default build (see unit_hash.h).
#include <xxhash.h>

#include "nvme/unit_hash.h"

namespace strata::nvme {

uint64_t UnitHash(const void* data, size_t size_bytes) { return XXH3_64bits(data, size_bytes); }

}  // namespace strata::nvme
