// The two renderings of a strata::Plan, shared by `offloadctl plan` and the Python package
// (strata.plan): a readable report (GB = 1e9 bytes) and JSON (bytes). `config_path` is "" when no
// --config was given; `notes` are extra lines from building the input (config mapping, missing
// inputs).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/planner.h"

namespace strata::plan {

std::string PlanToText(const Plan& plan, const std::string& config_path,
                       const std::vector<std::string>& notes);

nlohmann::json PlanToJson(const Plan& plan, const std::string& config_path,
                          const std::vector<std::string>& notes);

}  // namespace strata::plan
