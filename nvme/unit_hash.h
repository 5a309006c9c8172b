// The checksum of swap-space stripe units: XXH3-64 of the bytes (seed 0), the same value as
// XXH3_64bits() whichever implementation computes it.
//
// Where libxxhash was built with its x86 dispatcher (Debian's is), the AVX2 / AVX-512 kernel is
// chosen at run time (unit_hash_dispatch.cc); elsewhere the library's default build runs
// (unit_hash_plain.cc, SSE2 on x86-64). CMake picks the file. The dispatched kernel hashes cold
// 1 MiB units about 1.5x as fast as the default build on AVX2, and the swap space hashes
// every byte it reads or writes on its IO thread.
//
// Thread safety: a pure function.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::nvme {

uint64_t UnitHash(const void* data, size_t size_bytes);

}  // namespace strata::nvme
