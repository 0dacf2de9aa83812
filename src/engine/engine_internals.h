// Tests' access to an Engine's tiers and internal steps, which the public API does not expose.
#pragma once

#include "kvtier/engine.h"
#include "kvtier/file_tier.h"
#include "kvtier/memory_tier.h"

namespace kvtier {

struct EngineInternals {
  static MemoryTier& memory(Engine& engine);
  static FileTier* file(Engine& engine);  // null without L2
  // One retry of the write-throughs deferred for want of room, as a completing write runs it.
  static void ResubmitDeferred(Engine& engine);
};

}  // namespace kvtier
