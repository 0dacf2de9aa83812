// The `kvtier` command line: server, benchmarks, planner and cache-directory tools.
#include <fmt/format.h>
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

  CLI11_PARSE(app, argc, argv);
  return ctx.exit_code;
}
