#pragma once
// Shared helpers for the nvme tests: scratch folders on a disk and on tmpfs,
// seeded random data, and elementwise comparison that names the first
// differing byte.
#include <sys/statfs.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "strata/nvme/io_engine.h"

namespace strata::nvme::testing {

// A fresh directory, removed with its contents at scope exit.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& parent) {
    std::filesystem::create_directories(parent);
    std::string tmpl = parent + "/nvme-test-XXXXXX";
    char* made = mkdtemp(tmpl.data());
    if (made != nullptr) path_ = made;
  }
  ~ScratchDir() {
    if (!path_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::string disk_scratch_root() { return STRATA_NVME_TEST_SCRATCH; }

// /dev/shm when it is a tmpfs, else empty (tests that need tmpfs skip).
inline std::string tmpfs_root() {
  struct statfs fs {};
  if (statfs("/dev/shm", &fs) == 0 && static_cast<uint64_t>(fs.f_type) == 0x01021994 && access("/dev/shm", W_OK) == 0) {
    return "/dev/shm";
  }
  return "";
}

// Seed from STRATA_TEST_SEED or a fixed default; printed so a failure can be replayed.
inline uint64_t test_seed(uint64_t fallback) {
  const char* env = std::getenv("STRATA_TEST_SEED");
  uint64_t seed = env != nullptr ? std::strtoull(env, nullptr, 10) : fallback;
  std::printf("[ seed     ] STRATA_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

inline std::vector<std::byte> random_bytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> v(n);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<std::byte>(rng());
  return v;
}

// Elementwise: reports the first differing offset, never a norm.
inline ::testing::AssertionResult bytes_equal(const void* expected, const void* actual, size_t n) {
  auto* e = static_cast<const unsigned char*>(expected);
  auto* a = static_cast<const unsigned char*>(actual);
  for (size_t i = 0; i < n; ++i) {
    if (e[i] != a[i]) {
      return ::testing::AssertionFailure() << "first difference at byte " << i << " of " << n << ": expected "
                                           << int(e[i]) << ", got " << int(a[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

inline std::vector<EngineKind> working_engines() {
  std::vector<EngineKind> kinds;
  for (const EngineProbe& p : probe_engines()) {
    if (p.works) kinds.push_back(p.kind);
  }
  return kinds;
}

}  // namespace strata::nvme::testing
