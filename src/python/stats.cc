// The statistics of the engine and the file tier as Python dicts.
#include "python/stats.h"  // first: it includes Python.h, which must come first

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "kvtier/engine.h"
#include "kvtier/file_tier.h"
#include "kvtier/memory_tier.h"

namespace nb = nanobind;

namespace kvtier::python {

// The tier and engine counters come from their schema (kvtier/engine.h), as /stats and /metrics do.
nb::dict CountersDict(const TierCounters& c) {
  nb::dict d;
  for (const TierCounterField& f : TierCounterFields()) d[std::string(f.name).c_str()] = c.*f.field;
  return d;
}

// The file tier's numbers from their schema (kvtier/file_tier.h), as /stats' tiers.file.detail.
nb::dict FileTierStatsDict(const FileTierStats& f) {
  nb::dict file;
  for (const FileTierStatField& field : FileTierStatFields()) {
    file[std::string(field.name).c_str()] = f.*field.field;
  }
  file["o_direct"] = f.o_direct;
  file["io_engine"] = f.io_engine;
  return file;
}

nb::dict EngineStatsDict(const EngineStats& s) {
  nb::dict mem;
  const MemoryTierStats& m = s.memory_detail;
  mem["capacity_bytes"] = m.capacity_bytes;
  mem["slot_bytes"] = m.slot_bytes;
  mem["num_slots"] = m.num_slots;
  mem["resident"] = m.resident;
  mem["pinned"] = m.pinned;
  mem["huge_pages"] = m.huge_pages;
  mem["lookups"] = m.lookups;
  mem["hits"] = m.hits;
  mem["misses"] = m.misses;
  mem["bytes_in"] = m.bytes_in;
  mem["bytes_out"] = m.bytes_out;
  mem["evictions"] = m.evictions;
  mem["dirty"] = m.dirty;
  mem["dirty_evictions"] = m.dirty_evictions;
  mem["dirty_refusals"] = m.dirty_refusals;
  mem["rejections"] = m.rejections;
  mem["errors"] = m.errors;
  nb::dict d;
  d["memory"] = CountersDict(s.memory);
  d["memory_detail"] = mem;
  d["has_file"] = s.has_file;
  if (s.has_file) {
    d["file"] = CountersDict(s.file);
    d["file_detail"] = FileTierStatsDict(s.file_detail);
  }
  for (const EngineCounterField& f : EngineCounterFields()) {
    d[std::string(f.name).c_str()] = s.*f.field;
  }
  return d;
}

}  // namespace kvtier::python
