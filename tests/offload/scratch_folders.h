#pragma once
// Scratch folders of the engine tests: made fresh (per process: ctest runs
// parameterized cases side by side) under gtest's TempDir, and removed when
// the test process ends (a test reads its files until its last assertion).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace strata::offload::testing_scratch {

class ScratchFolders : public ::testing::Environment {
 public:
  static ScratchFolders& get() {
    static ScratchFolders* registered =
        static_cast<ScratchFolders*>(::testing::AddGlobalTestEnvironment(new ScratchFolders));
    return *registered;
  }
  void add(const std::filesystem::path& p) { made_.push_back(p); }
  void TearDown() override {
    std::error_code ec;
    for (const std::filesystem::path& p : made_) std::filesystem::remove_all(p, ec);
  }

 private:
  std::vector<std::filesystem::path> made_;
};

// TempDir()/<prefix><name>-<pid>, empty (removed first), removed at exit;
// `create`: made as an empty folder.
inline std::filesystem::path fresh_scratch_folder(const std::string& prefix, const std::string& name,
                                                  bool create = false) {
  const std::filesystem::path p =
      std::filesystem::path(::testing::TempDir()) / (prefix + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  if (create) std::filesystem::create_directories(p);
  ScratchFolders::get().add(p);
  return p;
}

}  // namespace strata::offload::testing_scratch
