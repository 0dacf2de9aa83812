// EnvWrapper: an Env that passes every call to another, for tests that change one or two calls
// (an open that hangs, a hook before a reply) and leave the rest as the real Env does them.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "kvtier/io.h"

namespace kvtier {

class EnvWrapper : public Env {
 public:
  explicit EnvWrapper(Env* base) : base_(base) {}  // `base` must outlive this

  std::string io_engine_name() const override { return base_->io_engine_name(); }
  uint64_t direct_fallbacks() const override { return base_->direct_fallbacks(); }
  Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& options) override {
    return base_->Open(path, options);
  }
  Status Rename(const std::string& from, const std::string& to) override {
    return base_->Rename(from, to);
  }
  Status Unlink(const std::string& path) override { return base_->Unlink(path); }
  Status CreateDirs(const std::string& path) override { return base_->CreateDirs(path); }
  Status RemoveDir(const std::string& path) override { return base_->RemoveDir(path); }
  Result<std::vector<DirEntry>> List(const std::string& dir) override { return base_->List(dir); }
  Result<FileInfo> Stat(const std::string& path) override { return base_->Stat(path); }
  Status SyncDir(const std::string& dir) override { return base_->SyncDir(dir); }
  std::chrono::steady_clock::time_point Now() const override { return base_->Now(); }
  Result<std::vector<TreeEntry>> ListTree(const std::string& dir) override {
    return base_->ListTree(dir);
  }
  bool publishes_at_sync() const override { return base_->publishes_at_sync(); }

 protected:
  Env* base() const { return base_; }

 private:
  Env* base_;
};

}  // namespace kvtier
