// The planner's collective-volume model (the public part, ZeroPlusPlusComm, is in
// include/strata/planner.h): each stage's comm volume per rank and its intra/inter-node split,
// and the checks of the ZeRO++ settings. Pure functions.
#pragma once

#include <string>
#include <vector>

#include "strata/planner.h"
#include "strata/status.h"

namespace strata::plan {

// The collectives of `stage` for `in` (ZeRO++ from in.zero.zero_plus_plus at stage 3).
// REQUIRES: ValidatePlanInput(in) is OK.
CommVolume StageComm(const PlanInput& in, int stage);

// InvalidArgument naming the JSON path: an hpZ partition size < 0, not dividing N, or neither a
// divisor nor a multiple of gpus_per_node (a group must lie within a node or span whole nodes);
// a quantization block that is not positive.
Status ValidateZeroPlusPlus(const ZeroPlusPlus& zpp, const Capacity& capacity);

// Notes for ZeRO++ settings that `stage` ignores (they act at stage 3 only).
void NoteZeroPlusPlus(const ZeroPlusPlus& zpp, int stage, std::vector<std::string>* notes);

}  // namespace strata::plan
