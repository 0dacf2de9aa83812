// Where tests find the loopback NFS server that scripts/nfs-server.sh starts: the export's URL
// ($KVTIER_TEST_NFS_URL) and the same export as a local directory ($KVTIER_TEST_NFS_EXPORT_DIR),
// so a test can look at what it wrote over NFS from the server's side, and the other way round.
// Tests that need it are skipped without it, unless $KVTIER_REQUIRE_NFS=1 (the test command
// sets it): then they fail, so a suite that was promised NFS cannot pass without it.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

namespace kvtier::testing {

// A fresh directory inside the export, removed afterwards: `url` and `local` name the same one.
class NfsTempDir {
 public:
  NfsTempDir(const std::string& url_root, const std::string& export_dir,
             const std::string& prefix) {
    std::string pattern = export_dir + "/" + prefix + "-XXXXXX";
    char* made = mkdtemp(pattern.data());
    if (made == nullptr) return;
    std::filesystem::permissions(pattern, std::filesystem::perms::all);
    local_ = pattern;
    url_ = url_root + "/" + std::filesystem::path(pattern).filename().string();
  }
  ~NfsTempDir() {
    std::error_code ec;
    if (!local_.empty()) std::filesystem::remove_all(local_, ec);
  }
  NfsTempDir(const NfsTempDir&) = delete;
  NfsTempDir& operator=(const NfsTempDir&) = delete;

  bool ok() const { return !local_.empty(); }
  const std::string& url() const { return url_; }
  const std::string& local() const { return local_; }

 private:
  std::string url_, local_;
};

inline bool NfsRequired() {
  const char* r = std::getenv("KVTIER_REQUIRE_NFS");
  return r != nullptr && std::string(r) == "1";
}

// A fresh directory in the test server's export, or null: not configured (a failure when
// required) or not creatable (a failure). Use KVTIER_NFS_TEST_DIR below.
inline std::unique_ptr<NfsTempDir> NfsTestDir(const std::string& prefix) {
  const char* url = std::getenv("KVTIER_TEST_NFS_URL");
  const char* local = std::getenv("KVTIER_TEST_NFS_EXPORT_DIR");
  if (url == nullptr || local == nullptr || !*url || !*local) {
    if (NfsRequired()) {
      ADD_FAILURE() << "KVTIER_REQUIRE_NFS=1 but KVTIER_TEST_NFS_URL / KVTIER_TEST_NFS_EXPORT_DIR "
                       "are not set (eval \"$(scripts/nfs-server.sh env)\")";
    }
    return nullptr;
  }
  auto dir = std::make_unique<NfsTempDir>(url, local, prefix);
  if (!dir->ok()) {
    ADD_FAILURE() << "cannot create a directory in the NFS export " << local;
    return nullptr;
  }
  return dir;
}

}  // namespace kvtier::testing

// Declares `var`, a NfsTempDir in the test server's export; skips the test when no server is
// configured (fails when one is required), returns when the directory cannot be made.
#define KVTIER_NFS_TEST_DIR(var, prefix)                                            \
  auto var = ::kvtier::testing::NfsTestDir(prefix);                                 \
  if (!var) {                                                                       \
    if (!::kvtier::testing::NfsRequired() && !::testing::Test::HasFailure()) {      \
      GTEST_SKIP() << "no NFS test server (eval \"$(scripts/nfs-server.sh env)\")"; \
    }                                                                               \
    return;                                                                         \
  }
