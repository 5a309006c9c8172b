// `offloadctl clean --nvme-path DIR [--nvme-path DIR ...] [--dry-run] [--json]`: removes what
// runs of strata commands that did not end cleanly (killed, crashed) left in nvme paths: strata's
// swap and benchmark files that no live process holds locked, and the per-run directories of
// `bench store` / `bench comm` once empty (nvme/leftovers.h). It never follows a symbolic link and
// never removes anything that is not strata's: other names, other users' files, FIFOs, devices.
// Also the leftover report every nvme_path-writing command prints (leftover_report.h).
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "nvme/leftovers.h"
#include "tools/offloadctl/commands.h"
#include "tools/offloadctl/leftover_report.h"

namespace strata::cli {
namespace {

std::string Human(uint64_t bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%llu bytes, %.2f %s", static_cast<unsigned long long>(bytes), v,
                  units[u]);
  }
  return buf;
}

std::string Describe(const nvme::LeftoverEntry& e) {
  return e.directory ? e.path + "/ (empty directory)" : e.path + " (" + Human(e.size_bytes) + ")";
}

nlohmann::json EntryJson(const nvme::LeftoverEntry& e) {
  return {{"path", e.path},
          {"size_bytes", e.size_bytes},
          {"disk_bytes", e.disk_bytes},
          {"directory", e.directory}};
}

struct CleanArgs {
  std::vector<std::string> paths;
  bool dry_run = false;
  bool json = false;
};

int RunClean(const CleanArgs& a) {
  nlohmann::json j = {{"dry_run", a.dry_run}, {"paths", nlohmann::json::array()}};
  uint64_t freed = 0;
  size_t count = 0;
  bool errors = false;
  const char* verb = a.dry_run ? "would remove" : "removed";
  for (const std::string& path : a.paths) {
    auto scan = nvme::ScanNvmePath(path, /*remove_leftovers=*/!a.dry_run);
    nlohmann::json pj = {{"path", path}};
    if (!scan.ok()) {
      errors = true;
      pj["error"] = scan.status().ToString();
      j["paths"].push_back(pj);
      if (!a.json) std::fprintf(stderr, "offloadctl clean: %s\n", scan.status().ToString().c_str());
      continue;
    }
    pj["removed"] = nlohmann::json::array();
    for (const nvme::LeftoverEntry& e : scan->leftovers) {
      ++count;
      freed += e.disk_bytes;
      pj["removed"].push_back(EntryJson(e));
      if (!a.json) std::printf("%s %s\n", verb, Describe(e).c_str());
    }
    pj["live"] = scan->live;
    pj["foreign"] = nlohmann::json::array();
    for (const std::string& live : scan->live) {
      if (!a.json) std::printf("kept %s: in use by a live process\n", live.c_str());
    }
    for (const nvme::ForeignEntry& f : scan->foreign) {
      pj["foreign"].push_back({{"path", f.path}, {"why", f.why}});
      if (!a.json) std::printf("left alone (not strata's) %s: %s\n", f.path.c_str(), f.why.c_str());
    }
    pj["failed"] = nlohmann::json::array();
    for (const nvme::ForeignEntry& f : scan->failed) {
      errors = true;
      pj["failed"].push_back({{"path", f.path}, {"error", f.why}});
      if (!a.json) {
        std::fprintf(stderr, "offloadctl clean: could not remove %s: %s\n", f.path.c_str(),
                     f.why.c_str());
      }
    }
    j["paths"].push_back(pj);
  }
  j["count"] = count;
  j["freed_bytes"] = freed;
  if (a.json) {
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s %zu leftover(s), %s %s\n", verb, count, a.dry_run ? "would free" : "freed",
                Human(freed).c_str());
  }
  return errors ? kExitInvalid : kExitOk;
}

}  // namespace

std::string ShellQuote(const std::string& s) {
  const bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("/._-+,:=@%", c) != nullptr;
  });
  if (plain) return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

void ReportLeftovers(const std::vector<std::string>& dirs) {
  std::vector<std::string> seen;
  for (const std::string& dir : dirs) {
    if (std::find(seen.begin(), seen.end(), dir) != seen.end()) continue;
    seen.push_back(dir);
    auto scan = nvme::ScanNvmePath(dir, /*remove_leftovers=*/false);
    if (!scan.ok()) continue;  // the command reports an unusable path itself
    if (!scan->leftovers.empty()) {
      uint64_t disk = 0;
      for (const auto& e : scan->leftovers) disk += e.disk_bytes;
      std::fprintf(stderr,
                   "offloadctl: %zu leftover(s) of strata runs that did not end cleanly in %s "
                   "(%s on disk):\n",
                   scan->leftovers.size(), dir.c_str(), Human(disk).c_str());
      for (const auto& e : scan->leftovers) std::fprintf(stderr, "  %s\n", Describe(e).c_str());
      std::fprintf(stderr, "  remove them with: offloadctl clean --nvme-path %s\n",
                   ShellQuote(dir).c_str());
    }
    for (const auto& f : scan->foreign) {
      std::fprintf(stderr, "offloadctl: %s is %s, not strata's: left alone\n", f.path.c_str(),
                   f.why.c_str());
    }
  }
}

constexpr char kCleanHelp[] =
    "Remove what strata runs that did not end cleanly (killed, crashed) left in nvme paths: swap "
    "and benchmark files no live process holds locked, and empty per-run directories. Never "
    "follows symbolic links; never removes files that are not strata's (other names, other "
    "users, FIFOs, devices).";

void RegisterClean(CLI::App& parent, int* exit_code) {
  auto args = std::make_shared<CleanArgs>();
  CLI::App* cmd = parent.add_subcommand("clean", kCleanHelp);
  cmd->add_option("--nvme-path", args->paths, "Directory to clean; repeat for several")->required();
  cmd->add_flag("--dry-run", args->dry_run, "List what would be removed; remove nothing");
  cmd->add_flag("--json", args->json,
                "Print JSON (dry_run, count, freed_bytes, paths: removed, live, foreign, failed)");
  cmd->callback([args, exit_code] { *exit_code = RunClean(*args); });
}

}  // namespace strata::cli
