// Which SIMD targets the kernels were compiled for and which one runs. The kernels dispatch at
// run time to the best compiled target the CPU supports (AVX3 = AVX-512, AVX2, SSE4, SSSE3,
// SCALAR), so one binary serves a mixed fleet. Target ids are Highway's HWY_* bit values, passed
// as plain int64_t so no Highway header leaks out.
//
// Thread safety: the queries are thread-safe. ForceTargetForTest changes a process-wide setting:
// call it only while no kernel runs (tests, benchmarks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::kernels {

// The compiled targets this CPU supports, best first.
std::vector<int64_t> SupportedKernelTargets();
// "AVX3", "AVX2", "SSE4", "SSSE3", "SCALAR", ...
std::string KernelTargetName(int64_t target);
// The target dispatch picks now (the best supported, or the forced one).
int64_t ActiveKernelTarget();

// Makes dispatch use `target` (one of SupportedKernelTargets()) until called with 0, which
// restores the normal choice.
void ForceTargetForTest(int64_t target);

}  // namespace strata::kernels
