// Content of the blocks a disk measurement writes (`bench nvme`'s write pass, the checkpoint's
// reference passes): random, and never the same block twice.
//
// Why: a virtual disk may compress or deduplicate what it stores, and then writes one buffer
// again and again (fio's scramble_buffers=0) markedly faster than fresh content. The engine's own
// blocks (fp32 master, Adam moments, 16-bit params,
// gradients) repeat nowhere, so a reference that repeats a pattern is a faster disk than the one
// the engine writes to. fio's defaults are followed: random buffers, and every write stamped
// (scramble_buffers) so that no two blocks are equal.
//
// Thread-safety: none needed; each function writes only the buffer it is given. Call
// StampUnique on a buffer only while no IO uses it (before it is submitted).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace strata::nvme {

// The granularity at which blocks are told apart: 4 KiB, the smallest block a disk or a
// deduplicating layer keys on.
inline constexpr size_t kStampBytes = 4096;

// splitmix64: a full-period 64-bit generator, enough to defeat compression.
inline uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Fills `bytes` of `buf` with random words from `seed` (a tail shorter than a word too).
inline void FillIncompressible(void* buf, size_t bytes, uint64_t seed) {
  auto* p = static_cast<unsigned char*>(buf);
  uint64_t s = seed;
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const uint64_t v = SplitMix64(&s);
    std::memcpy(p + i, &v, 8);
  }
  if (i < bytes) {
    const uint64_t v = SplitMix64(&s);
    std::memcpy(p + i, &v, bytes - i);
  }
}

// Makes the next write of `buf` unlike the others: the first 8 bytes of every 4 KiB become
// words drawn from a stream seeded by a process-wide write counter. One store per 4 KiB.
inline void StampUnique(void* buf, size_t bytes) {
  static std::atomic<uint64_t> writes{0};
  const uint64_t seq = writes.fetch_add(1, std::memory_order_relaxed);
  auto* p = static_cast<unsigned char*>(buf);
  uint64_t s = seq * 0xD1B54A32D192ED03ull;
  for (size_t off = 0; off + 8 <= bytes; off += kStampBytes) {
    const uint64_t v = SplitMix64(&s);
    std::memcpy(p + off, &v, 8);
  }
}

}  // namespace strata::nvme
