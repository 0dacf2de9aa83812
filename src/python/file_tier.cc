// FileTier (open_file_tier): kvtier's L2 on its own, reading into and writing from a buffer the
// caller owns, for an integration that already has a host-memory tier of its own (vLLM's native
// offloading, whose CPU tier is the primary). Chunks go straight between that buffer and the
// chunk files, O_DIRECT in place where the buffer's chunks are 4 KiB-aligned, on the tier's read
// and write pools; Python only submits and collects. Each job carries an id of the caller's
// choosing and lands in one completion queue when its last chunk is done, so a poll costs
// nothing while no job finished.
#include "kvtier/file_tier.h"

#include <Python.h>  // first, as Python's headers require
#include <fmt/format.h>
#include <nanobind/nanobind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvtier/chunk_key.h"
#include "kvtier/status.h"
#include "python/binding.h"
#include "python/stats.h"
#include "server/config.h"

namespace kvtier::python {
namespace {

struct FileJob {
  int64_t id = 0;
  bool read = false;
  Clock::time_point start;
  double seconds = 0;             // submission to last chunk done
  HeldBuffer buffer;              // released on a Python thread (collect or close)
  std::vector<uint8_t> chunk_ok;  // entry i is written by the one pool thread that did chunk i
  std::atomic<size_t> remaining{0};
  std::mutex mu;
  Status first_error;  // guarded by mu
};

struct FileTierCore {
  // The tier first: its destructor waits for queued and running I/O, whose callbacks use the
  // queue below.
  ~FileTierCore() { tier.reset(); }

  void ChunkDone(const std::shared_ptr<FileJob>& job, size_t i, Status s) {
    if (s.ok()) {
      if (i < job->chunk_ok.size()) job->chunk_ok[i] = 1;
    } else {
      std::lock_guard lock(job->mu);
      if (job->first_error.ok()) job->first_error = std::move(s);
    }
    if (job->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) Finish(job);
  }

  void Finish(const std::shared_ptr<FileJob>& job) {
    job->seconds = std::chrono::duration<double>(Clock::now() - job->start).count();
    std::lock_guard lock(mu);
    finished.push_back(job);
    --in_flight;
    if (in_flight == 0) idle.notify_all();
  }

  std::shared_ptr<FileTier> tier;  // guarded by mu; null once closed
  uint64_t chunk_bytes = 0;
  std::mutex mu;
  std::condition_variable idle;
  size_t in_flight = 0;                           // guarded by mu
  std::deque<std::shared_ptr<FileJob>> finished;  // guarded by mu; not yet collected
};

class PyFileTier {
 public:
  explicit PyFileTier(std::shared_ptr<FileTierCore> core) : core_(std::move(core)) {}
  PyFileTier(const PyFileTier&) = delete;
  PyFileTier& operator=(const PyFileTier&) = delete;
  ~PyFileTier() { ReapShared(std::move(core_)); }  // may wait for I/O: never on the caller
  // core_ is never null while Python can call: nanobind destroys the object only after.

  uint64_t chunk_bytes() const { return core_->chunk_bytes; }
  bool closed() const {
    std::lock_guard lock(core_->mu);
    return !core_->tier;
  }
  std::string namespace_dir() const { return Tier()->namespace_dir(); }
  std::string ChunkPath(nb::handle key) const { return Tier()->ChunkPath(ParseKey(key, "key")); }

  std::vector<bool> Contains(nb::handle keys_obj) {
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    std::shared_ptr<FileTier> tier = Tier();
    std::vector<bool> out(keys.size());
    nb::gil_scoped_release release;
    for (size_t i = 0; i < keys.size(); ++i) out[i] = tier->Contains(keys[i]);
    return out;
  }

  void Submit(bool read, int64_t job_id, nb::handle keys_obj, nb::handle buffer_obj,
              nb::handle offsets_obj) {
    const char* what = read ? "submit_read" : "submit_write";
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    std::vector<int64_t> offsets = ParseIntegers(offsets_obj, "offsets");
    if (offsets.size() != keys.size()) {
      ThrowInvalid(fmt::format("{}: {} keys but {} offsets", what, keys.size(), offsets.size()));
    }
    auto job = std::make_shared<FileJob>();
    job->buffer = HeldBuffer::Acquire(
        buffer_obj, read ? HeldBuffer::Access::kWrite : HeldBuffer::Access::kRead, "buffer");
    const uint64_t n = core_->chunk_bytes;
    for (size_t i = 0; i < offsets.size(); ++i) {
      if (offsets[i] < 0 || static_cast<uint64_t>(offsets[i]) + n > job->buffer.size()) {
        ThrowInvalid(
            fmt::format("{}: offsets[{}] = {} puts a {}-byte chunk outside the {}-byte "
                        "buffer",
                        what, i, offsets[i], n, job->buffer.size()));
      }
    }
    std::shared_ptr<FileTier> tier = Tier();
    job->id = job_id;
    job->read = read;
    job->chunk_ok.assign(keys.size(), 0);
    job->remaining.store(keys.size() + 1);  // +1: submission itself, so no chunk finishes it early
    job->start = Clock::now();
    FileTierCore* core = core_.get();
    {
      std::lock_guard lock(core->mu);
      ++core->in_flight;
    }
    nb::gil_scoped_release release;
    for (size_t i = 0; i < keys.size(); ++i) {
      uint8_t* at = job->buffer.data() + offsets[i];
      // The callbacks run on the tier's pool threads; the core outlives them (its destructor
      // destroys the tier first, which waits for them).
      auto done = [core, job, i](Status s) { core->ChunkDone(job, i, std::move(s)); };
      Status s = read ? tier->ReadAsync(keys[i], std::span<uint8_t>(at, n), done)
                      : tier->WriteAsync(keys[i], std::span<const uint8_t>(at, n), done);
      if (!s.ok()) core->ChunkDone(job, i, std::move(s));  // refused (queue full): a failed chunk
    }
    core->ChunkDone(job, keys.size(), Status::Ok());  // index past the chunks: no entry written
  }

  // Finished jobs since the last call: (job, ok, chunks, error, seconds).
  nb::list Finished() {
    std::deque<std::shared_ptr<FileJob>> done;
    {
      std::lock_guard lock(core_->mu);
      done.swap(core_->finished);
    }
    nb::list out;
    for (const std::shared_ptr<FileJob>& job : done) {
      job->buffer.Release();
      size_t chunks = 0;
      if (job->read) {
        while (chunks < job->chunk_ok.size() && job->chunk_ok[chunks]) ++chunks;
      } else {
        for (uint8_t ok : job->chunk_ok) chunks += ok;
      }
      std::string error;
      {
        std::lock_guard lock(job->mu);
        if (!job->first_error.ok()) error = job->first_error.ToString();
      }
      out.append(nb::make_tuple(job->id, error.empty(), chunks, error, job->seconds));
    }
    return out;
  }

  size_t in_flight() const {
    std::lock_guard lock(core_->mu);
    return core_->in_flight;
  }

  bool WaitIdle(std::optional<double> timeout) {
    std::shared_ptr<FileTierCore> core = core_;
    const auto deadline =
        timeout ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(CheckedTimeout(*timeout)))
                : Clock::time_point::max();
    for (;;) {
      bool idle;
      {
        nb::gil_scoped_release release;
        std::unique_lock lock(core->mu);
        // Slices of 100 ms let Ctrl-C through.
        const auto until = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
        idle = core->idle.wait_until(lock, until, [&] { return core->in_flight == 0; });
      }
      if (idle) return true;
      if (Clock::now() >= deadline) return false;
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
    }
  }

  nb::dict Stats() const { return FileTierStatsDict(Tier()->Stats()); }

  // Waits for every submitted job, then closes the tier. Results stay collectable; the buffers
  // of jobs not collected yet are given back now, so the caller can release its memory.
  void Close() {
    std::shared_ptr<FileTier> tier;
    {
      std::lock_guard lock(core_->mu);
      tier = std::move(core_->tier);
    }
    if (tier) {
      nb::gil_scoped_release release;
      (void)tier->Drain();  // jobs submitted before; a Submit racing close holds its own ref
      tier.reset();
    }
    std::lock_guard lock(core_->mu);
    for (const std::shared_ptr<FileJob>& job : core_->finished) job->buffer.Release();
  }

 private:
  std::shared_ptr<FileTier> Tier() const {
    std::lock_guard lock(core_->mu);
    if (!core_->tier) throw StatusError("closed", "the file tier is closed");
    return core_->tier;
  }

  std::shared_ptr<FileTierCore> core_;
};

PyFileTier* OpenFileTier(const KeyNamespace& ns, uint64_t chunk_bytes, nb::handle l2,
                         int64_t max_queued_chunks, std::optional<bool> sync_data) {
  if (chunk_bytes == 0) ThrowInvalid("open_file_tier: chunk_bytes must be positive");
  if (max_queued_chunks < 1) ThrowInvalid("open_file_tier: max_queued_chunks must be positive");
  const std::string text = JsonTextOf(l2, "l2 must be a JSON string or a dict");
  // The same JSON, parsing and mapping as `kvtier serve --l2`.
  server::ServeConfig config;
  config.chunk_size = ns.chunk_tokens;
  config.chunk_bytes = chunk_bytes;
  config.http_port = -1;
  config.l2.push_back(Unwrap(server::ParseL2Spec(text)));
  auto options = server::BuildServerOptions(config);
  if (!options.ok()) Throw(options.status().WithContext("open_file_tier"));
  FileTierOptions fo = *options->engine.file;
  fo.ns = ns;
  fo.chunk_bytes = chunk_bytes;
  fo.max_queued_reads = fo.max_queued_writes = static_cast<size_t>(max_queued_chunks);
  if (sync_data) fo.sync_data = *sync_data;  // else the l2 JSON's (true unless it says false)
  auto core = std::make_shared<FileTierCore>();
  core->chunk_bytes = chunk_bytes;
  {
    nb::gil_scoped_release release;
    core->tier = Unwrap(FileTier::Open(fo));
  }
  return new PyFileTier(std::move(core));
}

}  // namespace

void RegisterFileTier(nb::module_& m) {
  nb::class_<PyFileTier>(
      m, "FileTier",
      "kvtier's file tier (L2) on its own, moving chunks between the files and a buffer the "
      "caller owns (e.g. another system's host-memory cache), O_DIRECT in place where the "
      "buffer's chunks are 4 KiB-aligned. Jobs run on the tier's read and write pools with the "
      "GIL released; finished() collects them. Thread-safe.")
      .def_prop_ro("chunk_bytes", &PyFileTier::chunk_bytes, "Bytes of one chunk.")
      .def_prop_ro("closed", &PyFileTier::closed, "True after close().")
      .def_prop_ro("namespace_dir", &PyFileTier::namespace_dir,
                   "The folder of this namespace's chunk files.")
      .def_prop_ro("in_flight", &PyFileTier::in_flight, "Jobs submitted and not yet finished.")
      .def("chunk_path", &PyFileTier::ChunkPath, nb::arg("key"),
           "Where the chunk of ``key`` lives, whether or not it exists.")
      .def("contains", &PyFileTier::Contains, nb::arg("keys"),
           (std::string("Whether each key has a chunk: kvtier's index, and for a key not in it "
                        "at most one stat of its file per half second (chunks other processes or "
                        "hosts wrote). ") +
            kKeysDoc)
               .c_str())
      .def(
          "submit_read",
          [](PyFileTier& t, int64_t job, nb::handle keys, nb::handle buffer, nb::handle offsets) {
            t.Submit(true, job, keys, buffer, offsets);
          },
          nb::arg("job"), nb::arg("keys"), nb::arg("buffer"), nb::arg("offsets"),
          "Reads the chunk of keys[i] into ``buffer`` (writable, C-contiguous) at byte "
          "offsets[i], asynchronously; ``job`` is the caller's id for finished(). The buffer is "
          "held until the job is collected (or the tier closed). A missing, corrupt or foreign "
          "chunk fails its read and is never written into the buffer as data the result calls "
          "good.")
      .def(
          "submit_write",
          [](PyFileTier& t, int64_t job, nb::handle keys, nb::handle buffer, nb::handle offsets) {
            t.Submit(false, job, keys, buffer, offsets);
          },
          nb::arg("job"), nb::arg("keys"), nb::arg("buffer"), nb::arg("offsets"),
          "Writes chunk_bytes of ``buffer`` at offsets[i] as the chunk of keys[i], "
          "asynchronously (checksummed, published by rename, capacity enforced; keys already "
          "stored are skipped). ``job`` is the caller's id for finished().")
      .def("finished", &PyFileTier::Finished,
           "Jobs finished since the last call, as tuples (job, ok, chunks, error, seconds): "
           "``chunks`` is the leading chunks read for a read and the chunks stored for a write, "
           "``error`` the first failure (\"\" when ok), ``seconds`` from submission to the last "
           "chunk. Never blocks.")
      .def("wait_idle", &PyFileTier::WaitIdle, nb::arg("timeout") = nb::none(),
           "Waits (GIL released) until no job is in flight; False if ``timeout`` seconds passed "
           "first.")
      .def("stats", &PyFileTier::Stats, "The file tier's statistics as a dict.")
      .def("close", &PyFileTier::Close,
           "Waits for every submitted job, then closes the tier; idempotent. Results stay "
           "collectable through finished(); buffers are given back now.")
      .def("__enter__", [](nb::object self) { return self; })
      .def("__exit__", [](PyFileTier& t, nb::args) {
        t.Close();
        return false;
      });

  m.def("open_file_tier", &OpenFileTier, nb::arg("ns"), nb::arg("chunk_bytes"), nb::arg("l2"),
        nb::kw_only(), nb::arg("max_queued_chunks") = 65536, nb::arg("sync_data") = nb::none(),
        nb::rv_policy::take_ownership,
        "Opens kvtier's file tier for ``ns`` and ``chunk_bytes``-byte chunks. ``l2`` is the JSON "
        "object `kvtier serve --l2` takes, as a string or dict: {\"type\": \"fs\", \"path\": ..., "
        "\"max_size_gb\": ..., \"read_threads\": ..., \"write_threads\": ...}. The index is "
        "rebuilt from the directory. ``max_queued_chunks`` bounds the chunks waiting for a "
        "read or write thread; a chunk beyond it fails its job (code \"rejected\"). ``sync_data`` "
        "False skips the fdatasync before each chunk's publication (docs/file-format.md: a "
        "power loss may then leave chunks that fail their checksum, which read as misses); "
        "given, it overrides the l2 object's \"sync_data\" (default true).");
}

}  // namespace kvtier::python
