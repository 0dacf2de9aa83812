// The driver of a stress run (stress.h): starts the server and the role processes, disrupts
// them at random until the run's end, then judges what is left.
//
// Thread-safety: one run per process at a time (it waits for its children by pid).
#pragma once

#include <string>

#include "stress/stress.h"

namespace kvtier::stress {

// One run. REQUIRES: `options` valid (ValidateStressOptions), with its seed chosen (non-zero),
// its working directory made (and in isolated runs the tenant file written there), and `program`
// the absolute path of the executable to start. The returned report's dir and dir_removed are
// left to the caller.
StressReport DriveStress(const StressOptions& options);

}  // namespace kvtier::stress
