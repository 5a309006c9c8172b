#include "tools/offloadctl/cli_flags.h"

#include <cctype>
#include <cstdio>
#include <limits>

#include <nlohmann/json.hpp>

namespace strata::cli {

std::optional<uint64_t> ParseSize(std::string_view s) {
  size_t pos = 0;
  uint64_t v = 0;
  while (pos < s.size() && std::isdigit(static_cast<unsigned char>(s[pos]))) {
    const unsigned digit = static_cast<unsigned>(s[pos] - '0');
    if (v > (std::numeric_limits<uint64_t>::max() - digit) / 10) return std::nullopt;
    v = v * 10 + digit;
    ++pos;
  }
  if (pos == 0 || v == 0) return std::nullopt;
  std::string unit;
  for (char c : s.substr(pos))
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  int shift = 0;
  if (!unit.empty() && unit != "b") {
    switch (unit[0]) {
      case 'k':
        shift = 10;
        break;
      case 'm':
        shift = 20;
        break;
      case 'g':
        shift = 30;
        break;
      case 't':
        shift = 40;
        break;
      default:
        return std::nullopt;
    }
    const std::string rest = unit.substr(1);
    if (!rest.empty() && rest != "b" && rest != "ib") return std::nullopt;
  }
  if (v > (std::numeric_limits<uint64_t>::max() >> shift)) return std::nullopt;
  return v << shift;
}

std::string SizeString(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"T", "G", "M", "K"};
  for (int i = 0; i < 4; ++i) {
    const int shift = 40 - 10 * i;
    if (bytes != 0 && bytes % (uint64_t{1} << shift) == 0) {
      return std::to_string(bytes >> shift) + kUnits[i];
    }
  }
  return std::to_string(bytes);
}

CLI::Validator SizeArg(SizeRule rule) {
  return CLI::Validator(
      [rule](std::string& s) -> std::string {
        const std::optional<uint64_t> v = ParseSize(s);
        if (!v) return "'" + s + "' is not a size such as 4096, 256K, 1M or 2G";
        if (*v < rule.min_bytes) return "must be at least " + SizeString(rule.min_bytes);
        if (*v > rule.max_bytes) return "must be at most " + SizeString(rule.max_bytes);
        if (*v % rule.multiple_bytes != 0) {
          return "must be a multiple of " + SizeString(rule.multiple_bytes) + ", got " + s;
        }
        s = std::to_string(*v);  // kept by ->transform() (a numeric option), dropped by ->check()
        return {};
      },
      "");  // the option's type name says SIZE
}

CLI::Option* AddNvmePathOption(CLI::App* cmd, std::vector<std::string>* dirs,
                               const std::string& help) {
  return cmd->add_option("--nvme-path", *dirs, help)->type_name("DIR")->allow_extra_args(false);
}

CLI::Option* AddIoBackendOption(CLI::App* cmd, std::string* name) {
  return cmd
      ->add_option("--io-backend", *name,
                   "IO path: io_uring, posix (pread/pwrite workers) or auto (io_uring when the "
                   "kernel allows it, else posix)")
      ->check(CLI::IsMember({"auto", "io_uring", "posix"}))
      ->capture_default_str();
}

Result<IoBackendKind> IoBackendFromName(const std::string& name) {
  if (name == "auto") return IoBackendKind::kAuto;
  if (name == "io_uring") return IoBackendKind::kIoUring;
  if (name == "posix") return IoBackendKind::kPosix;
  return Status::InvalidArgument("IO backend must be auto, io_uring or posix, not '" + name + "'");
}

int Failure(std::string_view command, std::string_view message, int exit_code, bool json) {
  std::fprintf(stderr, "offloadctl %.*s: %.*s\n", static_cast<int>(command.size()), command.data(),
               static_cast<int>(message.size()), message.data());
  if (json) PrintJsonFailure(message, exit_code);
  return exit_code;
}

void PrintJsonFailure(std::string_view message, int exit_code) {
  const nlohmann::ordered_json j = {{"error", std::string(message)}, {"exit_code", exit_code}};
  std::printf("%s\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
}

}  // namespace strata::cli
