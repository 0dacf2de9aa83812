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

nb::dict FileTierStatsDict(const FileTierStats& f) {
  nb::dict file;
  file["chunks"] = f.chunks;
  file["bytes"] = f.bytes;
  file["capacity_bytes"] = f.capacity_bytes;
  file["reads"] = f.reads;
  file["writes"] = f.writes;
  file["hits"] = f.hits;
  file["misses"] = f.misses;
  file["bytes_read"] = f.bytes_read;
  file["bytes_written"] = f.bytes_written;
  file["evictions"] = f.evictions;
  file["rejections"] = f.rejections;
  file["errors"] = f.errors;
  file["corrupt"] = f.corrupt;
  file["foreign"] = f.foreign;
  file["disk_rechecks"] = f.disk_rechecks;
  file["found_on_disk"] = f.found_on_disk;
  file["stale_temps_removed"] = f.stale_temps_removed;
  file["bounce_copies"] = f.bounce_copies;
  file["queued_reads"] = f.queued_reads;
  file["queued_writes"] = f.queued_writes;
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
