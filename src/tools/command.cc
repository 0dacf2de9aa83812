#include "tools/command.h"

#include <map>
#include <utility>
#include <vector>

namespace kvtier::tools {
namespace {

std::vector<std::pair<std::string, CommandAdder>>& Registry() {
  static std::vector<std::pair<std::string, CommandAdder>> registry;
  return registry;
}

const std::map<std::string, std::string>& GroupDescriptions() {
  static const std::map<std::string, std::string> descriptions = {
      {"bench", "Benchmarks that compare kvtier with the physical limit measured in the same run"},
  };
  return descriptions;
}

}  // namespace

bool RegisterCommand(std::string_view group, CommandAdder adder) {
  Registry().emplace_back(std::string(group), adder);
  return true;
}

void AddAllCommands(CLI::App& app, CommandContext& ctx) {
  std::map<std::string, CLI::App*> groups;
  for (const auto& [group, adder] : Registry()) {
    CLI::App* parent = &app;
    if (!group.empty()) {
      auto it = groups.find(group);
      if (it == groups.end()) {
        auto desc = GroupDescriptions().find(group);
        CLI::App* g = app.add_subcommand(
            group, desc == GroupDescriptions().end() ? group : desc->second);
        g->require_subcommand(1);
        it = groups.emplace(group, g).first;
      }
      parent = it->second;
    }
    adder(*parent, ctx);
  }
}

}  // namespace kvtier::tools
