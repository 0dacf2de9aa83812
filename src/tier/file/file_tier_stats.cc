// The schema of the file tier's statistics (FileTierStatFields, kvtier/file_tier.h).
#include <cstddef>
#include <iterator>
#include <span>

#include "kvtier/file_tier.h"

namespace kvtier {
namespace {

using F = FileTierStats;
constexpr FileTierStatField kFileTierStatFields[] = {
    {"chunks", "Chunks in the index", &F::chunks},
    {"bytes", "File bytes of the indexed chunks", &F::bytes},
    {"capacity_bytes", "Configured capacity (0: unlimited)", &F::capacity_bytes},
    {"reads", "Read calls, asynchronous ones included", &F::reads},
    {"writes", "Write calls, asynchronous ones included", &F::writes},
    {"hits", "Reads that returned data", &F::hits},
    {"misses", "Reads that found no chunk", &F::misses},
    {"bytes_read", "Payload bytes read", &F::bytes_read},
    {"bytes_written", "Payload bytes written", &F::bytes_written},
    {"evictions", "Chunks removed to make room", &F::evictions},
    {"rejections", "Asynchronous calls refused (queue full) and writes refused (no room)",
     &F::rejections},
    {"errors", "I/O errors returned to callers", &F::errors},
    {"corrupt", "Files that failed a check (removed)", &F::corrupt},
    {"foreign", "Files of another namespace or chunk size (left in place)", &F::foreign},
    {"disk_rechecks", "Reads of keys not in the index", &F::disk_rechecks},
    {"found_on_disk", "Chunks another process or host wrote, indexed when found",
     &F::found_on_disk},
    {"rescans", "Listings of the namespace completed", &F::rescans},
    {"rescan_failures", "Listings that failed (the index was left as it was)",
     &F::rescan_failures},
    {"rescan_added", "Chunks listings found that the index lacked", &F::rescan_added},
    {"rescan_dropped", "Indexed chunks listings found gone", &F::rescan_dropped},
    {"last_rescan_us", "Duration of the last listing and its update (us)", &F::last_rescan_us},
    {"probes", "Keys looked up on the storage after a lookup missed", &F::probes},
    {"probe_hits", "Probed keys found (and indexed)", &F::probe_hits},
    {"probes_dropped", "Misses not probed because the probe queue was full", &F::probes_dropped},
    {"queued_probes", "Keys waiting to be probed now", &F::queued_probes},
    {"negative_cache_entries", "Keys known absent now", &F::negative_cache_entries},
    {"stale_temps_removed", "Temporary files of dead writers removed at open",
     &F::stale_temps_removed},
    {"bounce_copies", "Transfers through a bounce buffer (unaligned caller)", &F::bounce_copies},
    {"queued_reads", "Reads queued now", &F::queued_reads},
    {"queued_writes", "Writes queued now", &F::queued_writes},
    {"write_no_space", "Writes failed with ENOSPC or EDQUOT after evicting", &F::write_no_space},
    {"write_read_only", "Writes failed with EROFS", &F::write_read_only},
    {"write_permission", "Writes failed with EACCES or EPERM", &F::write_permission},
    {"read_queue_full", "Asynchronous reads refused, queue full", &F::read_queue_full},
    {"write_queue_full", "Asynchronous writes refused, queue full", &F::write_queue_full},
    {"reads_unwanted", "Queued reads skipped, no longer wanted (a load past its deadline)",
     &F::reads_unwanted},
    {"disk_full", "ENOSPC answers seen (evicted and retried)", &F::disk_full},
    {"effective_capacity_bytes", "The capacity now: configured, or lower after ENOSPC",
     &F::effective_capacity_bytes},
    {"non_regular", "Chunk paths that were not regular files (counted as foreign)",
     &F::non_regular},
    {"stalled_reads", "Reads running longer than the stall timeout now", &F::stalled_reads},
    {"stalled_writes", "Writes running longer than the stall timeout now", &F::stalled_writes},
    {"replacement_threads", "Threads started to replace stalled ones", &F::replacement_threads},
};
// The numbers are the fields before o_direct, each with one row: a number added without its row
// (or a row naming a field twice) does not compile.
static_assert(offsetof(FileTierStats, o_direct) ==
              std::size(kFileTierStatFields) * sizeof(uint64_t));
constexpr bool EveryRowNamesItsOwnField() {
  for (size_t i = 0; i < std::size(kFileTierStatFields); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (kFileTierStatFields[i].field == kFileTierStatFields[j].field) return false;
    }
  }
  return true;
}
static_assert(EveryRowNamesItsOwnField());

}  // namespace

std::span<const FileTierStatField> FileTierStatFields() { return kFileTierStatFields; }

}  // namespace kvtier
