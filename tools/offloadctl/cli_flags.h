// The option vocabulary the offloadctl subcommands share, so that one thing has one spelling:
// - SIZE: bytes, with an optional binary suffix: 4096, 256K, 1M, 2G, 1T (also KiB, KB; any
//   case; K = 1024). Every option that takes a size in bytes takes a SIZE.
// - `--nvme-path DIR`, repeatable: a directory on the NVMe tier (DeepSpeed's `nvme_path`), on
//   every subcommand that puts files there.
// - `--io-backend auto|io_uring|posix`.
//
// Thread safety: none needed; everything here runs while the command line is parsed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include "strata/io.h"

namespace strata::cli {

// A SIZE (see above) in bytes; nullopt when `s` is not one or is 0.
std::optional<uint64_t> ParseSize(std::string_view s);

// Limits of a SIZE option, in bytes.
struct SizeRule {
  uint64_t min_bytes = 1;
  uint64_t multiple_bytes = 1;
  uint64_t max_bytes = UINT64_MAX;
};
// A CLI11 validator for a SIZE within `rule`; the error names the value and the rule, e.g.
// "'lots' is not a size such as 4096, 256K, 1M or 2G". Give the option ->type_name("SIZE").
// As ->transform() it also rewrites the value as a byte count, for an option bound to a number.
CLI::Validator SizeArg(SizeRule rule = {});

// "64M", "1G", "4096": the shortest exact SIZE spelling of `bytes`, for help texts and output.
std::string SizeString(uint64_t bytes);

// Adds `--nvme-path DIR` (repeatable, one directory per occurrence) appending to *dirs.
CLI::Option* AddNvmePathOption(CLI::App* cmd, std::vector<std::string>* dirs,
                               const std::string& help);

// A failed command: "offloadctl COMMAND: MESSAGE" on stderr and, where the command was asked
// for --json, {"error": MESSAGE, "exit_code": CODE} on stdout too, so that a script reading
// stdout gets JSON whatever happened. Returns `exit_code`.
int Failure(std::string_view command, std::string_view message, int exit_code, bool json);
// The stdout half of Failure: {"error": MESSAGE, "exit_code": CODE}.
void PrintJsonFailure(std::string_view message, int exit_code);

// Adds `--io-backend auto|io_uring|posix` storing the name in *name.
CLI::Option* AddIoBackendOption(CLI::App* cmd, std::string* name);
// The backend named by --io-backend. InvalidArgument names the accepted values.
Result<IoBackendKind> IoBackendFromName(const std::string& name);

}  // namespace strata::cli
