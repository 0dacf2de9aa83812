// One place that decides where kvtier's log lines go: standard error, always. Standard output is
// for results (`--json`, tables, the Python benchmarks' JSON), which a log line must never
// corrupt; spdlog's default logger writes to standard output.
#pragma once

namespace kvtier {

// Replaces spdlog's default logger with one writing to standard error (colored on a terminal),
// with the project's line pattern, and applies SPDLOG_LEVEL. Idempotent.
void InitLogging();

}  // namespace kvtier
