// `kvtier bench storage PATH`: what a directory's storage really delivers to chunk-sized reads.
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/units.h"
#include "probe/model_presets.h"
#include "probe/storage_probe.h"
#include "probe/units.h"
#include "tools/command.h"

namespace {

std::atomic<bool> g_stop{false};

void OnSignal(int) { g_stop.store(true); }

struct StorageArgs {
  std::string path;
  std::string file_size;
  std::string model = "qwen3-8b";
  int chunk_tokens = 256;
  std::string block_size = "1MiB";
  std::string readers = "1,16,32";
  int files_per_reader = 1;
  int control_files = 8;
  int writers = 4;
  int nfs_connections = 0;  // nfs:// only; 0: the largest reader count
  bool json = false;
  bool keep = false;
};

int RunBenchStorage(const StorageArgs& a) {
  using namespace kvtier::probe;
  auto fail = [](const kvtier::Status& s) {
    fmt::print(stderr, "error: {}\n", s.ToString());
    return s.code() == kvtier::StatusCode::kAborted ? 130 : 1;
  };
  StorageProbeOptions o;
  o.directory = a.path;
  if (!a.file_size.empty()) {
    auto size = kvtier::ParseByteCount(a.file_size);
    if (!size.ok()) return fail(size.status().WithContext("--file-size"));
    o.file_size = *size;
  } else {
    if (a.chunk_tokens < 1) return fail(kvtier::Status::InvalidArgument("--chunk-tokens must be >= 1"));
    auto layout = ResolveModelLayout(a.model);
    if (!layout.ok()) return fail(layout.status());
    o.file_size = layout->bytes_per_chunk(static_cast<uint32_t>(a.chunk_tokens));
    fmt::print(stderr, "file size: one {}-token chunk of {} ({}) = {}\n", a.chunk_tokens, a.model,
               layout->ToString(), FormatBytes(o.file_size));
  }
  auto block = kvtier::ParseByteCount(a.block_size);
  if (!block.ok()) return fail(block.status().WithContext("--block-size"));
  o.block_size = *block;
  auto readers = ParseIntList(a.readers, 1, 1024);
  if (!readers.ok()) return fail(readers.status().WithContext("--readers"));
  o.reader_counts = *readers;
  o.files_per_reader = a.files_per_reader;
  o.control_files = a.control_files;
  o.writers = a.writers;
  o.nfs_connections = a.nfs_connections;
  o.keep_files = a.keep;
  o.stop = &g_stop;
  o.progress = [](const std::string& line) {
    fmt::print(stderr, "{}\n", line);
    std::fflush(stderr);
  };

  // Ctrl-C or SIGTERM: stop within one request, remove the files, exit 130.
  struct sigaction sa = {}, old_int = {}, old_term = {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  auto report = RunStorageProbe(o);
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  if (!report.ok()) return fail(report.status());
  if (a.json) {
    fmt::print("{}\n", StorageProbeReportToJson(*report));
  } else {
    fmt::print("{}", StorageProbeReportToText(*report));
  }
  return 0;
}

void AddBenchStorage(CLI::App& parent, kvtier::tools::CommandContext& ctx) {
  auto args = std::make_shared<StorageArgs>();
  auto* cmd = parent.add_subcommand(
      "storage",
      "Measure what a directory's storage delivers to chunk-sized reads: parallel O_DIRECT reads "
      "(each reader on its own files), a single-stream control on separate files, buffered reads "
      "for contrast and O_DIRECT writes. Checks that O_DIRECT bypassed the page cache, verifies "
      "every byte read, and removes its files (also on error or Ctrl-C). Throughputs in GB/s "
      "(10^9 bytes/s). PATH may be nfs://HOST/EXPORT/PATH: the probe then speaks NFSv3 itself "
      "(no mount; no page cache, so the O_DIRECT check and buffered reads do not apply).");
  cmd->add_option("path", args->path,
                  "Directory on the storage to test (must exist, writable), or "
                  "nfs://HOST/EXPORT/PATH to test an NFS server without a mount")
      ->required();
  cmd->add_option("--file-size", args->file_size,
                  "Bytes per file, e.g. 36MiB, 4M, 1GiB (default: one chunk of --model). "
                  "K/M/G alone and KiB/MiB/GiB are powers of 1024, KB/MB/GB powers of 1000; "
                  "a bare number is bytes");
  cmd->add_option("--model", args->model,
                  "Model whose chunk size sets the file size: a preset (" +
                      fmt::format("{}", fmt::join(kvtier::probe::KnownModelNames(), ", ")) +
                      ") or a config.json path")
      ->capture_default_str();
  cmd->add_option("--chunk-tokens", args->chunk_tokens, "Tokens per chunk for --model")
      ->capture_default_str();
  cmd->add_option("--block-size", args->block_size,
                  "Bytes per read/write request, a multiple of 4 KiB (512K = 512 KiB)")
      ->capture_default_str();
  cmd->add_option("--readers", args->readers,
                  "Comma-separated reader (thread) counts, one read phase each")
      ->capture_default_str();
  cmd->add_option("--files-per-reader", args->files_per_reader,
                  "Files per reader at the largest reader count; the pool has max(readers) x "
                  "this many files and every phase reads all of them")
      ->capture_default_str();
  cmd->add_option("--control-files", args->control_files,
                  "Files read by the single-stream control, never part of the pool")
      ->capture_default_str();
  cmd->add_option("--writers", args->writers, "Threads writing the files")->capture_default_str();
  cmd->add_option("--nfs-connections", args->nfs_connections,
                  "nfs:// only: TCP connections to the server, files spread over them round "
                  "robin as they are opened (0: the largest --readers count, i.e. one per "
                  "reader; at most 256)")
      ->capture_default_str()
      ->check(CLI::Range(0, 256));
  cmd->add_flag("--json", args->json,
                "Print JSON: readers [{readers, read_GBps}], control_GBps, buffered_read_GBps, "
                "write_GBps, o_direct, ...");
  cmd->add_flag("--keep", args->keep, "Leave the files in place (in PATH/.kvtier-probe-*)");
  cmd->callback([args, &ctx] { ctx.exit_code = RunBenchStorage(*args); });
}

const bool kRegistered = kvtier::tools::RegisterCommand("bench", &AddBenchStorage);

}  // namespace
