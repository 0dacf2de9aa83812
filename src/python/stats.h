// The statistics of the engine and the file tier as Python dicts (ChunkStore.stats(),
// FileTier.stats()). Private to src/python. REQUIRES: the GIL is held.
#pragma once

#include <Python.h>  // first, as Python's headers require
#include <nanobind/nanobind.h>

#include "kvtier/engine.h"
#include "kvtier/file_tier.h"

namespace kvtier::python {

nanobind::dict CountersDict(const TierCounters& c);
nanobind::dict FileTierStatsDict(const FileTierStats& f);
nanobind::dict EngineStatsDict(const EngineStats& s);

}  // namespace kvtier::python
