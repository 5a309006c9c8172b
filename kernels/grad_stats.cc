#include "kernels/grad_stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/casts.h"
#include "kernels/elem.h"
#include "kernels/pool.h"
#include "kernels/simd.h"

namespace strata::kernels {

void ExactSum::Add(double x) {
  if (!(x >= 0) || !std::isfinite(x)) {
    nonfinite_ = true;
    return;
  }
  if (x == 0) return;
  int e = 0;
  const double f = std::frexp(x, &e);  // x = f * 2^e, f in [0.5, 1)
  if (e > kMaxExp) {
    nonfinite_ = true;
    return;
  }
  auto mant = static_cast<uint64_t>(std::ldexp(f, 53));  // exact 53-bit integer
  int bit = e - 53 - kMinExp;                            // weight of mant's bit 0
  if (bit < 0) {
    if (bit <= -64) return;
    mant >>= -bit;  // truncate below the grid: deterministic
    bit = 0;
  }
  const int d = bit / 32;
  const unsigned __int128 v = static_cast<unsigned __int128>(mant) << (bit % 32);
  digit_[d] += static_cast<uint32_t>(v);
  digit_[d + 1] += static_cast<uint32_t>(v >> 32);
  digit_[d + 2] += static_cast<uint32_t>(v >> 64);  // d + 2 < kDigits as e <= kMaxExp
  if (++adds_ == (1u << 30)) Normalize();
}

void ExactSum::Normalize() {
  for (int i = 0; i + 1 < kDigits; ++i) {
    digit_[i + 1] += digit_[i] >> 32;
    digit_[i] &= 0xffffffffu;
  }
  adds_ = 0;
}

void ExactSum::Merge(const ExactSum& other) {
  ExactSum o = other;
  o.Normalize();
  Normalize();
  for (int i = 0; i < kDigits; ++i) digit_[i] += o.digit_[i];
  Normalize();
  nonfinite_ = nonfinite_ || o.nonfinite_;
}

double ExactSum::Value() const {
  if (nonfinite_) return std::numeric_limits<double>::infinity();
  ExactSum c = *this;
  c.Normalize();
  double v = 0;
  for (int i = 0; i < kDigits; ++i) {  // small to large; each term is exact, the sum rounds
    v += std::ldexp(static_cast<double>(c.digit_[i]), kMinExp + 32 * i);
  }
  return v;
}

namespace {

Status Check(const void* grad, DType dtype, size_t n) {
  if (ElemOf(dtype) < 0) {
    return Status::InvalidArgument("grad stats: dtype must be fp32, bf16 or fp16, not " +
                                   std::string(DTypeName(dtype)));
  }
  if (n > 0 && grad == nullptr) return Status::InvalidArgument("grad stats: null grad, n > 0");
  return Status::OK();
}

// Chunks of [begin, end), which starts on a chunk boundary.
void AddChunks(const void* grad, int elem, size_t begin, size_t end, ExactSum* acc) {
  for (size_t c = begin; c < end; c += kStatsChunk) {
    acc->Add(simd::SumSquares(grad, elem, c, std::min(kStatsChunk, end - c)));
  }
}

}  // namespace

Result<GradStats> ComputeGradStats(const void* grad, DType dtype, size_t n) {
  STRATA_RETURN_IF_ERROR(Check(grad, dtype, n));
  ExactSum acc;
  AddChunks(grad, ElemOf(dtype), 0, n, &acc);
  return acc.Stats();
}

namespace {

// The pooled walk both pooled calls share: `chunk(c, m)` handles elements [c, c + m) of a chunk
// (c on a kStatsChunk boundary of the shard) and returns its sum of squares, which goes into the
// partial of the thread that ran it; the exact partials are merged at the end, so the result does
// not depend on which thread took which chunk. Partials live in the pool's scratch (sized at
// Create): nothing is allocated.
template <class ChunkFn>
void PooledChunkSumsInto(KernelPool& pool, size_t n, ChunkFn chunk, ExactSum* total) {
  static_assert(sizeof(ExactSum) <= KernelPool::kScratchSlotBytes &&
                alignof(ExactSum) <= alignof(KernelPool::ScratchSlot));
  static_assert(std::is_trivially_destructible_v<ExactSum>);
  KernelPool::Scratch scratch = pool.AcquireScratch();
  for (int i = 0; i < pool.threads(); ++i) new (scratch.slot(i)) ExactSum();
  auto partial = [&](int i) { return std::launder(static_cast<ExactSum*>(scratch.slot(i))); };
  const size_t tile = (pool.tile_elems() + kStatsChunk - 1) / kStatsChunk * kStatsChunk;
  auto body = [&](int slot, size_t b, size_t e) {
    for (size_t c = b; c < e; c += kStatsChunk) {
      partial(slot)->Add(chunk(c, std::min(kStatsChunk, e - c)));
    }
  };
  pool.ForEachTile(n, tile, body);
  for (int i = 0; i < pool.threads(); ++i) total->Merge(*partial(i));
}

template <class ChunkFn>
GradStats PooledChunkSums(KernelPool& pool, size_t n, ChunkFn chunk) {
  ExactSum total;
  PooledChunkSumsInto(pool, n, chunk, &total);
  return total.Stats();
}

// AccumulateGrad of chunk [c, c + m) into acc, then its sum of squares (the chunk just written,
// in cache).
struct AccumulateChunk {
  float* acc;
  const uint8_t* grad;
  size_t bytes;
  int elem;
  float scale;
  bool overwrite;
  double operator()(size_t c, size_t m) const {
    simd::AccumulateGrad(grad + c * bytes, elem, acc + c, scale, overwrite, m);
    return simd::SumSquares(acc, simd::kElemF32, c, m);
  }
};

}  // namespace

Result<GradStats> ComputeGradStats(KernelPool& pool, const void* grad, DType dtype, size_t n) {
  STRATA_RETURN_IF_ERROR(Check(grad, dtype, n));
  const int elem = ElemOf(dtype);
  return PooledChunkSums(pool, n, [&](size_t c, size_t m) {
    return simd::SumSquares(grad, elem, c, m);
  });
}

Result<GradStats> AccumulateGradWithStats(KernelPool& pool, float* acc, const void* grad,
                                          DType grad_dtype, float scale, bool overwrite,
                                          size_t n) {
  STRATA_ASSIGN_OR_RETURN(int elem, CheckAccumulateGrad(acc, grad, grad_dtype, scale, n));
  return PooledChunkSums(pool, n,
                         AccumulateChunk{acc, static_cast<const uint8_t*>(grad),
                                         DTypeSize(grad_dtype), elem, scale, overwrite});
}

Status AccumulateGradAddStats(KernelPool& pool, float* acc, const void* grad, DType grad_dtype,
                              float scale, bool overwrite, size_t n, ExactSum* sum) {
  if (sum == nullptr) return Status::InvalidArgument("AccumulateGradAddStats: null sum");
  STRATA_ASSIGN_OR_RETURN(int elem, CheckAccumulateGrad(acc, grad, grad_dtype, scale, n));
  PooledChunkSumsInto(pool, n,
                      AccumulateChunk{acc, static_cast<const uint8_t*>(grad), DTypeSize(grad_dtype),
                                      elem, scale, overwrite},
                      sum);
  return Status::OK();
}

}  // namespace strata::kernels
