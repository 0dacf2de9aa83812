// A temporary directory for tests that run against either storage: a local directory by default,
// or one inside the NFS test export (src/testing/nfs_target.h) when $KVTIER_TEST_STORAGE=nfs.
// The same test binary then checks the same behaviour over both.
//
//   testing::StorageDir dir;
//   o.root = dir.path();                             // what a tier is given: a path or nfs:// URL
//   fs::remove(dir.LocalOf(tier->ChunkPath(key)));   // what the test touches behind its back
//
// In NFS mode the directory is known twice: as an nfs:// URL (path(), for tiers, fsck, Envs) and
// as this host's view of the same directory (local(), for std::filesystem and ::open). Without
// $KVTIER_TEST_NFS_URL and $KVTIER_TEST_NFS_EXPORT_DIR, or in a build without libnfs, NFS mode
// fails the test with the reason, and falls back to a local directory so that nothing the test
// does afterwards lands anywhere unexpected.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "kvtier/io.h"
#include "testing/nfs_target.h"
#include "testing/temp_dir.h"

namespace kvtier::testing {

// True when $KVTIER_TEST_STORAGE is "nfs" (the tests' storage is the NFS test export).
inline bool StorageIsNfs() {
  const char* s = std::getenv("KVTIER_TEST_STORAGE");
  return s != nullptr && std::string(s) == "nfs";
}

class StorageDir {
 public:
  explicit StorageDir(const std::string& prefix = "kvtier-test") {
    if (StorageIsNfs()) {
      const char* url = std::getenv("KVTIER_TEST_NFS_URL");
      const char* exported = std::getenv("KVTIER_TEST_NFS_EXPORT_DIR");
      if (url == nullptr || exported == nullptr || !*url || !*exported) {
        ADD_FAILURE() << "KVTIER_TEST_STORAGE=nfs needs KVTIER_TEST_NFS_URL and "
                         "KVTIER_TEST_NFS_EXPORT_DIR (eval \"$(scripts/nfs-server.sh env)\")";
      } else if (!NfsSupported()) {
        ADD_FAILURE() << "KVTIER_TEST_STORAGE=nfs, but this build has no NFS client (libnfs)";
      } else {
        nfs_ = std::make_unique<NfsTempDir>(url, exported, prefix);
        if (nfs_->ok()) {
          path_ = nfs_->url();
          local_ = nfs_->local();
          return;
        }
        ADD_FAILURE() << "cannot create a directory in the NFS export " << exported;
        nfs_.reset();
      }
    }
    local_dir_ = std::make_unique<TempDir>(prefix);
    path_ = local_ = local_dir_->path();
  }
  StorageDir(const StorageDir&) = delete;
  StorageDir& operator=(const StorageDir&) = delete;

  bool nfs() const { return nfs_ != nullptr; }
  // The directory as a tier, fsck or an Env is given it: a local path, or an nfs:// URL.
  const std::string& path() const { return path_; }
  // The same directory on this host's filesystem.
  const std::string& local() const { return local_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }
  // `p` (path() or a path under it, such as a FileTier::ChunkPath) on this host's filesystem;
  // any other path unchanged.
  std::string LocalOf(const std::string& p) const {
    if (p == path_) return local_;
    if (p.size() > path_.size() && p.starts_with(path_) && p[path_.size()] == '/') {
      return local_ + p.substr(path_.size());
    }
    return p;
  }

 private:
  std::unique_ptr<NfsTempDir> nfs_;
  std::unique_ptr<TempDir> local_dir_;
  std::string path_, local_;
};

}  // namespace kvtier::testing
