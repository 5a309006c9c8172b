#include "kernels/targets.h"

#include "hwy/targets.h"

namespace strata::kernels {

// HWY_TARGETS here equals the set the *_simd.cc files were compiled for: same flags, same
// Highway defaults (no file overrides them).
std::vector<int64_t> SupportedKernelTargets() { return hwy::SupportedAndGeneratedTargets(); }

std::string KernelTargetName(int64_t target) { return hwy::TargetName(target); }

int64_t ActiveKernelTarget() {
  const int64_t t = hwy::SupportedTargets() & HWY_TARGETS;
  return t & -t;  // lowest bit = best target
}

void ForceTargetForTest(int64_t target) { hwy::SetSupportedTargetsForTest(target); }

}  // namespace strata::kernels
