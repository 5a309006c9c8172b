// offloadctl: the strata command line. Benchmarks storage tiers, plans memory for a model,
// checks DeepSpeed configs, launches and inspects runs. See README.md and `offloadctl --help`.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "strata/version.h"
#include "tools/offloadctl/cli_flags.h"
#include "tools/offloadctl/commands.h"

int main(int argc, char** argv) {
  CLI::App app{
      "offloadctl: plan, check, benchmark and run strata, the heterogeneous offload storage "
      "engine for large-model training.\nExit codes: 0 ok, 1 the checked thing is invalid or does "
      "not fit, 2 usage error."};
  app.set_version_flag("--version", std::string("offloadctl ") + STRATA_VERSION_STRING +
                                        (STRATA_VERSION_HAS_CUDA ? " (CUDA)" : ""));
  app.require_subcommand(1);
  int exit_code = strata::cli::kExitOk;
  strata::cli::RegisterPlan(app, &exit_code);
  strata::cli::RegisterConfig(app, &exit_code);
  strata::cli::RegisterClean(app, &exit_code);
  strata::cli::RegisterCkpt(app, &exit_code);

  CLI::App* bench = app.add_subcommand(
      "bench", "Measure a tier or kernel of this machine against a same-run reference");
  bench->require_subcommand(1);
  strata::cli::RegisterBenchNvme(*bench, &exit_code);
  strata::cli::RegisterBenchComm(*bench, &exit_code);
  strata::cli::RegisterBenchStore(*bench, &exit_code);
  strata::cli::RegisterBenchEngine(*bench, &exit_code);
  strata::cli::RegisterLaunch(app, &exit_code);
  strata::cli::RegisterBenchDram(*bench, &exit_code);
  strata::cli::RegisterBenchAdam(*bench, &exit_code);

  // An unknown command word, at any level ("bench nvm"): CLI11 would say "A subcommand is
  // required", which misleads.
  const CLI::App* level = &app;
  std::string path = "offloadctl";
  for (int i = 1; i < argc && argv[i][0] != '-' && !level->get_subcommands({}).empty(); ++i) {
    std::string known;
    const CLI::App* next = nullptr;
    for (const CLI::App* sub : level->get_subcommands({})) {
      known += (known.empty() ? "" : ", ") + sub->get_name();
      if (sub->get_name() == argv[i]) next = sub;
    }
    if (next == nullptr) {
      std::fprintf(stderr, "%s: unknown command '%s' (the commands: %s; --help)\n", path.c_str(),
                   argv[i], known.c_str());
      return strata::cli::kExitUsage;
    }
    level = next;
    path += " " + next->get_name();
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    // A script that asked for JSON reads stdout: the usage error is there too.
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]) == "--json") {
        strata::cli::PrintJsonFailure(e.what(), strata::cli::kExitUsage);
        break;
      }
    }
    return strata::cli::kExitUsage;
  }
  return exit_code;
}
