// The `kvtier` command line: server, benchmarks, planner and cache-directory tools.
#include <fmt/format.h>

#include <cstdio>
#include <system_error>

#include "common/logging.h"
#include "tools/command.h"

int main(int argc, char** argv) {
  kvtier::InitLogging();  // to stderr: stdout carries results; SPDLOG_LEVEL=debug for detail
  CLI::App app{"kvtier: a tiered KV-cache offload engine for LLM inference", "kvtier"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");

  kvtier::tools::CommandContext ctx;
  app.add_subcommand("version", "Print the kvtier version")->callback([] {
    fmt::print("kvtier {}\n", KVTIER_VERSION);
  });
  kvtier::tools::AddAllCommands(app, ctx);

  try {
    CLI11_PARSE(app, argc, argv);
  } catch (const std::system_error& e) {
    // fmt::print throws when its stream cannot be written (a full disk under a redirected
    // stdout or log): an error and exit code 1, not std::terminate's abort. The message goes
    // wherever still takes it: stderr may be the file that is full.
    std::fprintf(stderr, "kvtier: %s\n", e.what());
    return 1;
  }
  return ctx.exit_code;
}
