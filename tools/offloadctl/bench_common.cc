#include "tools/offloadctl/bench_common.h"

#include <cstdlib>

namespace strata::cli {

void AddArraySize(CLI::App* cmd, DeprecatedFlags* old, uint64_t* bytes, const std::string& help) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  CLI::Option* opt =
      cmd->add_option_function<std::string>(
             "--array-size", [bytes](const std::string& v) { *bytes = *ParseSize(v); }, help)
          ->check(SizeArg({.min_bytes = kMiB, .max_bytes = kMiB << 20}))
          ->type_name("SIZE")
          ->default_str(SizeString(*bytes));
  old->Add(cmd, "--array-mib", opt, [bytes](const std::string& v) {
    char* end = nullptr;
    const unsigned long long mib = std::strtoull(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || mib < 1 || mib > (uint64_t{1} << 20)) {
      return "'" + v + "' is not a number of MiB in 1.." + std::to_string(uint64_t{1} << 20);
    }
    *bytes = mib * kMiB;
    return std::string();
  });
}

}  // namespace strata::cli
