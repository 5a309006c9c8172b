// The checksum of swap-space stripe units: XXH3-64 of the bytes (seed 0), the same value as
// XXH3_64bits() whichever implementation computes it.
//
// Where libxxhash was built with its x86 dispatcher (Debian's is), the AVX2 / AVX-512 kernel is
// chosen at run time (unit_hash_dispatch.cc); elsewhere the library's default build runs
// (unit_hash_plain.cc, SSE2 on x86-64). CMake picks the file. On the development machine the
// dispatched kernel hashed cold 1 MiB units at 4.9-5.3 GB/s against 2.9-3.4 GB/s for the default,
// and the swap space hashes every byte it reads or writes on its IO thread.
//
// Thread safety: a pure function.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::nvme {

uint64_t UnitHash(const void* data, size_t size_bytes);

}  // namespace strata::nvme
