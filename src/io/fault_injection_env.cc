// FaultInjectionEnv: a seeded fault injector in front of a real Env, in the spirit of leveldb's
// fault-injection env and RocksDB's FaultInjectionTestFS. The real I/O still happens (through the
// base Env); faults replace or distort it.
#include "io/fault_injection_env.h"

#include <fmt/format.h>

#include <cerrno>
#include <filesystem>

namespace kvtier {

namespace {
std::string ParentOf(const std::string& path) {
  return std::filesystem::path(path).parent_path().string();
}
}  // namespace

class FaultFile final : public File {
 public:
  FaultFile(FaultInjectionEnv* env, std::unique_ptr<File> base)
      : env_(env), base_(std::move(base)) {}

  const std::string& path() const override { return base_->path(); }
  bool direct() const override { return base_->direct(); }

  // Never reports Progress: data may still be altered (bit flips) after the transfer completes.
  Status Submit(std::span<IoOp> ops, IoObserver* observer) override {
    env_->CountCall();
    // Decide every op's fate under the lock, do the I/O without it.
    enum Fate { kPass, kFail, kShort };
    std::vector<Fate> fate(ops.size(), kPass);
    std::vector<int> err(ops.size(), 0);
    std::vector<IoOp> forward;
    std::vector<size_t> where;
    {
      std::lock_guard<std::mutex> lock(env_->mu_);
      const auto& o = env_->options_;
      for (size_t i = 0; i < ops.size(); ++i) {
        IoOp op = ops[i];
        bool read = op.kind == IoOp::Kind::kRead;
        if (env_->enabled_) {
          if (read && env_->Draw(o.read_error)) {
            fate[i] = kFail, err[i] = EIO, ++env_->counters_.read_errors;
          } else if (!read && env_->Draw(o.write_error)) {
            fate[i] = kFail, err[i] = o.write_errno, ++env_->counters_.write_errors;
          } else if (!read && env_->Draw(o.no_space)) {
            fate[i] = kFail, err[i] = ENOSPC, ++env_->counters_.no_space;
          } else if (op.len > 1 && env_->Draw(read ? o.short_read : o.short_write)) {
            // Keep O_DIRECT transfers on the alignment grid, as the kernel does.
            size_t unit = base_->direct() ? kDirectIoAlignment : 1;
            size_t units = op.len / unit;
            if (units >= 2) {
              fate[i] = kShort;
              op.len = unit * (1 + env_->Uniform(units - 1));
              ++(read ? env_->counters_.short_reads : env_->counters_.short_writes);
            }
          }
        }
        if (fate[i] != kFail && !read && !env_->ClaimSpaceLocked(path(), op.offset + op.len)) {
          fate[i] = kFail, err[i] = ENOSPC, ++env_->counters_.no_space;
        }
        if (fate[i] != kFail) {
          forward.push_back(op);
          where.push_back(i);
        }
      }
    }
    if (observer) observer->Submitted();
    KVTIER_RETURN_IF_ERROR(base_->Submit(forward, nullptr));
    std::lock_guard<std::mutex> lock(env_->mu_);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (fate[i] == kFail) ops[i].result = -err[i];
    }
    for (size_t j = 0; j < forward.size(); ++j) {
      IoOp& op = ops[where[j]];
      op.result = forward[j].result;
      if (op.result <= 0) continue;
      if (op.kind == IoOp::Kind::kWrite) {
        env_->paths_[path()].unsynced.push_back({op.offset, static_cast<uint64_t>(op.result)});
      } else if (env_->enabled_ && env_->Draw(env_->options_.bit_flip)) {
        uint64_t bit = env_->Uniform(static_cast<uint64_t>(op.result) * 8);
        op.buf[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
        ++env_->counters_.bit_flips;
      }
    }
    return Status::Ok();
  }

  Status Sync() override {
    env_->CountCall();
    {
      std::lock_guard<std::mutex> lock(env_->mu_);
      if (env_->enabled_ && env_->Draw(env_->options_.sync_error)) {
        ++env_->counters_.sync_errors;
        return Status::FromErrno(EIO, fmt::format("fdatasync {} (injected)", path()));
      }
    }
    KVTIER_RETURN_IF_ERROR(base_->Sync());
    std::lock_guard<std::mutex> lock(env_->mu_);
    auto it = env_->paths_.find(path());
    if (it != env_->paths_.end()) it->second.unsynced.clear();
    return Status::Ok();
  }

  Result<uint64_t> Size() override {
    env_->CountCall();
    return base_->Size();
  }
  Status Preallocate(uint64_t bytes) override {
    env_->CountCall();
    {
      std::lock_guard<std::mutex> lock(env_->mu_);
      if ((env_->enabled_ && env_->Draw(env_->options_.no_space)) ||
          !env_->ClaimSpaceLocked(path(), bytes)) {
        ++env_->counters_.no_space;
        return Status::FromErrno(ENOSPC, fmt::format("fallocate {} (injected)", path()));
      }
    }
    return base_->Preallocate(bytes);
  }

 private:
  FaultInjectionEnv* const env_;
  std::unique_ptr<File> base_;
};

FaultInjectionEnv::FaultInjectionEnv(Env* base, const FaultInjectionOptions& options)
    : base_(base), options_(options), rng_(options.seed) {}

FaultInjectionEnv::~FaultInjectionEnv() = default;

void FaultInjectionEnv::SetOptions(const FaultInjectionOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  options_ = options;
  rng_.seed(options.seed);
}

void FaultInjectionEnv::SetEnabled(bool enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  enabled_ = enabled;
}

FaultInjectionEnv::Counters FaultInjectionEnv::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

bool FaultInjectionEnv::ClaimSpaceLocked(const std::string& path, uint64_t end) {
  PathState& state = paths_[path];
  if (end <= state.size) return true;
  const uint64_t growth = end - state.size;
  if (options_.space_bytes != 0 && space_used_ + growth > options_.space_bytes) return false;
  space_used_ += growth;
  state.size = end;
  return true;
}

bool FaultInjectionEnv::Draw(double p) {
  if (p <= 0) return false;
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < p;
}

uint64_t FaultInjectionEnv::Uniform(uint64_t n) {
  return n == 0 ? 0 : std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_);
}

void FaultInjectionEnv::AdvanceClock(std::chrono::nanoseconds by) {
  std::lock_guard lock(mu_);
  clock_advance_ += by;
}

std::chrono::steady_clock::time_point FaultInjectionEnv::Now() const {
  CountCall();
  std::lock_guard lock(mu_);
  return base_->Now() + clock_advance_;
}

std::string FaultInjectionEnv::io_engine_name() const {
  return base_->io_engine_name() + "+faults";
}

#define KVTIER_MAYBE_FAIL_METADATA(what)                                 \
  do {                                                                   \
    std::lock_guard<std::mutex> lock(mu_);                               \
    if (enabled_ && Draw(options_.metadata_error)) {                     \
      ++counters_.metadata_errors;                                       \
      return Status::FromErrno(EIO, fmt::format("{} (injected)", what)); \
    }                                                                    \
  } while (0)

void FaultInjectionEnv::StallOpens(std::string fragment) {
  std::lock_guard<std::mutex> lock(mu_);
  stall_fragment_ = std::move(fragment);
}

void FaultInjectionEnv::ReleaseStalls() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stall_fragment_.clear();
    ++stall_generation_;
  }
  stall_cv_.notify_all();
}

uint64_t FaultInjectionEnv::stalled_now() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stalled_now_;
}

uint64_t FaultInjectionEnv::WaitForStalls(uint64_t n, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  stall_cv_.wait_for(lock, timeout, [&] { return stalled_now_ >= n; });
  return stalled_now_;
}

Result<std::unique_ptr<File>> FaultInjectionEnv::Open(const std::string& path,
                                                      const OpenOptions& options) {
  CountCall();
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (enabled_ && !stall_fragment_.empty() && path.find(stall_fragment_) != std::string::npos) {
      ++stalled_now_;
      stall_cv_.notify_all();  // WaitForStalls (stalled opens recheck their generation)
      const uint64_t generation = stall_generation_;
      stall_cv_.wait(lock, [&] { return stall_generation_ != generation; });
      --stalled_now_;
      return Status::FromErrno(EIO, fmt::format("open {} (stalled, injected)", path));
    }
  }
  KVTIER_MAYBE_FAIL_METADATA(fmt::format("open {}", path));
  bool existed = options.create && base_->Stat(path).ok();
  KVTIER_ASSIGN_OR_RETURN(auto file, base_->Open(path, options));
  if (options.create && !existed) {
    std::lock_guard<std::mutex> lock(mu_);
    paths_[path].unsynced_entry = true;
  }
  return std::unique_ptr<File>(new FaultFile(this, std::move(file)));
}

Status FaultInjectionEnv::Rename(const std::string& from, const std::string& to) {
  CountCall();
  KVTIER_MAYBE_FAIL_METADATA(fmt::format("rename {} to {}", from, to));
  KVTIER_RETURN_IF_ERROR(base_->Rename(from, to));
  std::lock_guard<std::mutex> lock(mu_);
  PathState state;
  if (auto it = paths_.find(from); it != paths_.end()) {
    state = std::move(it->second);
    paths_.erase(it);
  }
  if (auto it = paths_.find(to); it != paths_.end()) space_used_ -= it->second.size;  // replaced
  state.unsynced_entry = true;  // the new name exists only once `to`'s directory is synced
  paths_[to] = std::move(state);
  return Status::Ok();
}

Status FaultInjectionEnv::Unlink(const std::string& path) {
  CountCall();
  KVTIER_MAYBE_FAIL_METADATA(fmt::format("unlink {}", path));
  KVTIER_RETURN_IF_ERROR(base_->Unlink(path));
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = paths_.find(path); it != paths_.end()) {
    space_used_ -= it->second.size;
    paths_.erase(it);
  }
  return Status::Ok();
}

Status FaultInjectionEnv::CreateDirs(const std::string& path) {
  CountCall();
  KVTIER_MAYBE_FAIL_METADATA(fmt::format("mkdir -p {}", path));
  return base_->CreateDirs(path);
}

Status FaultInjectionEnv::RemoveDir(const std::string& path) {
  CountCall();
  return base_->RemoveDir(path);
}

Result<std::vector<DirEntry>> FaultInjectionEnv::List(const std::string& dir) {
  CountCall();
  KVTIER_MAYBE_FAIL_METADATA(fmt::format("list {}", dir));
  return base_->List(dir);
}

Result<FileInfo> FaultInjectionEnv::Stat(const std::string& path) {
  CountCall();
  KVTIER_MAYBE_FAIL_METADATA(fmt::format("stat {}", path));
  return base_->Stat(path);
}

Status FaultInjectionEnv::SyncDir(const std::string& dir) {
  CountCall();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (enabled_ && Draw(options_.sync_error)) {
      ++counters_.sync_errors;
      return Status::FromErrno(EIO, fmt::format("fsync directory {} (injected)", dir));
    }
  }
  KVTIER_RETURN_IF_ERROR(base_->SyncDir(dir));
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [path, state] : paths_) {
    if (ParentOf(path) == dir) state.unsynced_entry = false;
  }
  return Status::Ok();
}

Status FaultInjectionEnv::SimulateCrash() {
  std::unordered_map<std::string, PathState> paths;
  {
    std::lock_guard<std::mutex> lock(mu_);
    paths.swap(paths_);
    space_used_ = 0;  // what survives now counts as having existed before
  }
  Status first;
  for (auto& [path, state] : paths) {
    if (state.unsynced_entry) {
      Status s = base_->Unlink(path);
      if (!s.ok() && !s.IsNotFound() && first.ok()) first = s;
      continue;
    }
    if (state.unsynced.empty()) continue;
    OpenOptions o;
    o.write = true;
    auto file = base_->Open(path, o);
    if (!file.ok()) {
      if (!file.status().IsNotFound() && first.ok()) first = file.status();
      continue;
    }
    for (const Range& r : state.unsynced) {
      std::vector<uint8_t> zeros(r.len, 0);
      IoOp op = IoOp::Write(r.offset, zeros);
      Status s = WriteExact(**file, std::span<IoOp>(&op, 1));
      if (!s.ok() && first.ok()) first = s;
    }
  }
  return first;
}

}  // namespace kvtier
