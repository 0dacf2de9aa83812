// A temporary directory removed (with its contents) when the object goes out of scope.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvtier::testing {

class TempDir {
 public:
  // Created under $KVTIER_TEST_TMPDIR, else the system temporary directory (a real filesystem
  // with O_DIRECT on the machines this project is tested on).
  explicit TempDir(const std::string& prefix = "kvtier-test") {
    const char* base = std::getenv("KVTIER_TEST_TMPDIR");
    std::string pattern = (base ? std::filesystem::path(base) : std::filesystem::temp_directory_path())
                              .append(prefix + "-XXXXXX")
                              .string();
    char* made = mkdtemp(pattern.data());
    path_ = made ? made : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace kvtier::testing
