#pragma once
// The NVMe state tier tests' scratch folders, pieces, snapshots and fixtures
// (nvme_state_tier_test.cpp, nvme_state_tier_versions_test.cpp). Each test
// executable has one translation unit, so the anonymous namespace is its own.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "strata/core/device_registry.h"
#include "strata/cpu_adam/optimizer.h"
#include "strata/nvme/testing/fault_injection.h"
#include "strata/offload/testing/nvme_state_tier_seam.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_dir.h"
#include "strata/offload/nvme_state_tier.h"
#include "strata/offload/state_tier.h"

namespace strata::offload {
namespace {

// A fresh folder on the build tree's disk (O_DIRECT works there even where
// /tmp is tmpfs), removed at scope exit.
class ScratchDir {
 public:
  ScratchDir() {
    std::filesystem::create_directories(STRATA_OFFLOAD_TEST_SCRATCH);
    std::string tmpl = std::string(STRATA_OFFLOAD_TEST_SCRATCH) + "/nvme-tier-XXXXXX";
    if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct PieceSpec {
  StateId id;
  size_t count;
  bool master;
};

// Odd sizes: one element, not a multiple of 1024, above a 64 KiB checksum
// block, an empty piece, pieces with and without master.
[[maybe_unused]] std::vector<PieceSpec> odd_pieces() {
  return {{{0, 0, 0}, 1, true},     {{0, 1, 0}, 1000, false}, {{1, 0, 0}, 4097, true},
          {{1, 1, 0}, 0, true},     {{2, 0, 0}, 30011, true}, {{2, 0, 1}, 17000, false},
          {{3, 0, 0}, 2048, true}};
}

[[maybe_unused]] std::string name_of(const StateId& id) { return fmt::format("layer {} 'l{}' group {} rank {}", id.layer, id.layer, id.group, id.rank); }

[[maybe_unused]] std::vector<float> master_init(const PieceSpec& p) {
  std::vector<float> v(p.master ? p.count : 0);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.001f * static_cast<float>((i * 7919 + p.id.layer * 31 + p.id.group) % 2000) - 1.0f;
  return v;
}

[[maybe_unused]] uint64_t capacity_of(const std::vector<PieceSpec>& pieces, const cpu_adam::MomentStorage& md) {
  uint64_t total = 0;
  for (const PieceSpec& p : pieces) total += nvme_piece_bytes(p.count, p.master, md);
  return total;
}

[[maybe_unused]] uint64_t largest_piece(const std::vector<PieceSpec>& pieces, const cpu_adam::MomentStorage& md) {
  uint64_t m = 0;
  for (const PieceSpec& p : pieces) m = std::max(m, nvme_piece_bytes(p.count, p.master, md));
  return m;
}

// The bytes of a piece's state, master first.
[[maybe_unused]] std::vector<std::byte> snapshot(const PieceState& s) {
  const size_t moment_bytes = s.moments.moment_bytes(s.count);
  std::vector<std::byte> out;
  auto append = [&](const void* p, size_t n) {
    auto* b = static_cast<const std::byte*>(p);
    out.insert(out.end(), b, b + n);
  };
  if (s.master != nullptr) append(s.master, s.count * sizeof(float));
  append(s.exp_avg, moment_bytes);
  append(s.exp_avg_sq, moment_bytes);
  return out;
}

// A deterministic change of every byte of the state, different per step.
[[maybe_unused]] void scribble(const PieceState& s, int step) {
  const size_t moment_bytes = s.moments.moment_bytes(s.count);
  auto fill = [&](void* p, size_t n, int salt) {
    auto* b = static_cast<unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(b[i] * 3 + i * 13 + step * 101 + salt);
  };
  if (s.master != nullptr) fill(s.master, s.count * sizeof(float), 1);
  fill(s.exp_avg, moment_bytes, 2);
  fill(s.exp_avg_sq, moment_bytes, 3);
}

class NvmeStateTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    DeviceOptions o;
    o.device_memory_bytes = 64u << 20;
    auto d = make_device("cpu", o);
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    device_ = std::move(d).value();
  }

  NvmeStateTierOptions options(const std::vector<PieceSpec>& pieces, const cpu_adam::MomentStorage& md,
                               const std::string& job = "t") {
    NvmeStateTierOptions o;
    o.nvme_paths = {dir_.path()};
    o.job = job;
    o.rank = 0;
    o.capacity_bytes = capacity_of(pieces, md);
    o.slot_bytes = largest_piece(pieces, md);
    o.moments = md;
    o.buffer_count = 3;
    o.aio.block_size = 64 * 1024;
    return o;
  }

  // `io`: the tier's I/O through this engine (a fault-injecting one) instead of one made from o.aio.
  std::unique_ptr<OptimizerStateTier> make(const NvmeStateTierOptions& o, nvme::IoEngine* io = nullptr) {
    auto t = io != nullptr ? testing::make_nvme_state_tier_on(o, *io, *device_, stats_)
                           : make_nvme_state_tier(o, *device_, stats_);
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    return t.ok() ? std::move(t).value() : nullptr;
  }

  // Every piece's state as open() reads it (the newest version), closed unmodified.
  static std::vector<std::vector<std::byte>> read_every_piece(OptimizerStateTier& t,
                                                             const std::vector<PieceSpec>& pieces) {
    std::vector<std::vector<std::byte>> out;
    for (const PieceSpec& p : pieces) {
      auto s = t.open(p.id);
      EXPECT_TRUE(s.ok()) << s.status().to_string();
      if (!s.ok()) return out;
      out.push_back(snapshot(*s));
      EXPECT_TRUE(t.close(p.id, false).ok());
    }
    return out;
  }

  static void add_all(OptimizerStateTier& t, const std::vector<PieceSpec>& pieces) {
    for (const PieceSpec& p : pieces) {
      std::vector<float> m = master_init(p);
      ASSERT_TRUE(t.add(p.id, name_of(p.id), p.count, m).ok());
    }
    Status st = t.flush();
    ASSERT_TRUE(st.ok()) << st.to_string();
  }

  ScratchDir dir_;
  std::unique_ptr<Device> device_;
  MemoryStats stats_;
};

// --------------------------------------------------------------- faults

class NvmeStateTierFaultTest : public NvmeStateTierTest {
 protected:
  void make_faulty(const nvme::FaultPlan& plan) {
    nvme::IoEngineOptions io;
    io.block_size = 64 * 1024;
    auto e = nvme::make_fault_injecting_engine(io, plan, &counters_);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    engine_ = std::move(e).value();
    counters_->disarm();
  }
  std::string swap_file(const std::string& job) const {
    return nvme::swap_folder_path(dir_.path(), job, 0) + "/swap.bin";
  }
  std::shared_ptr<nvme::FaultCounters> counters_;
  std::unique_ptr<nvme::IoEngine> engine_;
};

}  // namespace
}  // namespace strata::offload
