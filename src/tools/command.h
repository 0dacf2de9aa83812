// How subcommands of the `kvtier` CLI plug in.
//
// Each command lives in its own `src/tools/<name>_cmd.cc` and registers itself at static
// initialisation time:
//
//   namespace {
//   void AddPlan(CLI::App& parent, kvtier::tools::CommandContext& ctx) {
//     auto* cmd = parent.add_subcommand("plan", "Predict whether KV offload pays");
//     ...
//     cmd->callback([&ctx, ...] { ctx.exit_code = RunPlan(...); });
//   }
//   const bool kRegistered = kvtier::tools::RegisterCommand("", &AddPlan);
//   }  // namespace
//
// `group` is "" for a top-level command or the name of a group ("bench") for `kvtier bench X`.
// The CMake target globs *_cmd.cc, so adding a command touches no shared file.
#pragma once

#include <string>
#include <string_view>

#include <CLI/CLI.hpp>

namespace kvtier::tools {

struct CommandContext {
  int exit_code = 0;  // what `kvtier` returns once the chosen command's callback has run
};

using CommandAdder = void (*)(CLI::App& parent, CommandContext& ctx);

// Always returns true (so it can initialise a static). Groups are created on first use.
bool RegisterCommand(std::string_view group, CommandAdder adder);

// Builds the whole CLI; used by main and by tests of the CLI.
void AddAllCommands(CLI::App& app, CommandContext& ctx);

}  // namespace kvtier::tools
