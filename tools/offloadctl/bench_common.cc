#include "tools/offloadctl/bench_common.h"

namespace strata::cli {

void AddArraySize(CLI::App* cmd, uint64_t* bytes, const std::string& help) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  cmd->add_option_function<std::string>(
         "--array-size", [bytes](const std::string& v) { *bytes = *ParseSize(v); }, help)
      ->check(SizeArg({.min_bytes = kMiB, .max_bytes = kMiB << 20}))
      ->type_name("SIZE")
      ->default_str(SizeString(*bytes));
}

}  // namespace strata::cli
