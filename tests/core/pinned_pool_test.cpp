#include "strata/core/pinned_pool.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/device.h"
#include "strata/core/device_registry.h"
#include "ipc_lock_capability.h"

namespace strata {
namespace {

constexpr size_t kKiB = 1024;

// Pinning small buffers must work for the pinned-path tests; a machine with
// RLIMIT_MEMLOCK = 0 only runs the fallback tests.
bool can_pin(size_t bytes) { return probe_pinning(bytes).works; }

TEST(PinnedPool, ExactSizeAlignedAndPinned) {
  if (!can_pin(256 * kKiB)) GTEST_SKIP() << probe_pinning(256 * kKiB).detail;
  auto pool = PinnedPool::create(nullptr);
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  const size_t request = 100 * kKiB + 13;  // not a power of two
  auto buf = (*pool)->allocate(request);
  ASSERT_TRUE(buf.ok()) << buf.status().to_string();
  EXPECT_TRUE(buf->pinned());
  EXPECT_EQ(buf->tier(), Tier::kPinnedHost);
  EXPECT_EQ(buf->size_bytes(), request);
  EXPECT_EQ(buf->footprint_bytes(), 104 * kKiB);  // rounded to 4096 only, not to 128 KiB
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % 4096, 0u);
  std::memset(buf->data(), 0x5a, request);
  EXPECT_EQ((*pool)->pinned_bytes(), 104 * kKiB);
  TierStats s = (*pool)->stats().get(Tier::kPinnedHost);
  EXPECT_EQ(s.current_bytes, 104 * kKiB);
  EXPECT_EQ(s.allocation_count, 1u);
  EXPECT_EQ((*pool)->fallback_count(), 0u);
}

TEST(PinnedPool, FreedBlocksAreReusedByExactSize) {
  if (!can_pin(64 * kKiB)) GTEST_SKIP() << probe_pinning(64 * kKiB).detail;
  auto pool = PinnedPool::create(nullptr);
  ASSERT_TRUE(pool.ok());
  void* first = nullptr;
  {
    auto a = (*pool)->allocate(20 * kKiB);
    ASSERT_TRUE(a.ok());
    first = a->data();
  }
  EXPECT_EQ((*pool)->cached_bytes(), 20 * kKiB);
  EXPECT_EQ((*pool)->pinned_bytes(), 20 * kKiB);
  auto other = (*pool)->allocate(24 * kKiB);  // different size: a new block
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->data(), first);
  auto again = (*pool)->allocate(20 * kKiB - 100);  // same footprint: the cached block
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->data(), first);
  EXPECT_EQ((*pool)->cached_bytes(), 0u);
  EXPECT_EQ((*pool)->pinned_bytes(), 44 * kKiB);
  TierStats s = (*pool)->stats().get(Tier::kPinnedHost);
  EXPECT_EQ(s.allocated_bytes, 64 * kKiB);
  EXPECT_EQ(s.freed_bytes, 20 * kKiB);
  EXPECT_EQ(s.peak_bytes, 44 * kKiB);
  again->reset();
  other->reset();
  EXPECT_EQ((*pool)->trim(), 44 * kKiB);
  EXPECT_EQ((*pool)->pinned_bytes(), 0u);
}

TEST(PinnedPool, BudgetFallsBackToPageableWithOneWarning) {
  PinnedPoolOptions options;
  options.budget_bytes = 64 * kKiB;
  std::vector<std::string> warnings;
  options.warn = [&](std::string_view w) { warnings.emplace_back(w); };
  auto pool = PinnedPool::create(nullptr, options);
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->pinned_limit_bytes(), 64 * kKiB);
  const bool pin_ok = can_pin(32 * kKiB);
  auto small = (*pool)->allocate(32 * kKiB);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->pinned(), pin_ok);
  auto big1 = (*pool)->allocate(64 * kKiB);  // 32 + 64 > 64 KiB budget
  auto big2 = (*pool)->allocate(40 * kKiB);
  ASSERT_TRUE(big1.ok() && big2.ok());
  EXPECT_EQ(big1->tier(), Tier::kPageableHost);
  EXPECT_EQ(big2->tier(), Tier::kPageableHost);
  std::memset(big1->data(), 1, big1->size_bytes());  // usable memory
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big1->data()) % 4096, 0u);
  ASSERT_EQ(warnings.size(), 1u);  // once, not per allocation
  EXPECT_NE(warnings[0].find("budget 64.00 KiB"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("ulimit -l"), std::string::npos);
  EXPECT_EQ((*pool)->fallback_count(), pin_ok ? 2u : 3u);
  EXPECT_EQ((*pool)->stats().get(Tier::kPageableHost).current_bytes, (pin_ok ? 0 : 32 * kKiB) + 104 * kKiB);
  big1->reset();
  big2->reset();
  EXPECT_EQ((*pool)->stats().get(Tier::kPageableHost).freed_bytes, 104 * kKiB);
}

TEST(PinnedPool, CachedBlocksAreEvictedBeforeFallingBack) {
  if (!can_pin(64 * kKiB)) GTEST_SKIP() << probe_pinning(64 * kKiB).detail;
  PinnedPoolOptions options;
  options.budget_bytes = 64 * kKiB;
  options.warn = [](std::string_view) { FAIL() << "no fallback expected"; };
  auto pool = PinnedPool::create(nullptr, options);
  ASSERT_TRUE(pool.ok());
  { auto a = (*pool)->allocate(48 * kKiB); ASSERT_TRUE(a.ok()); }
  EXPECT_EQ((*pool)->cached_bytes(), 48 * kKiB);
  auto b = (*pool)->allocate(40 * kKiB);  // needs the cached 48 KiB released first
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->pinned());
  EXPECT_EQ((*pool)->cached_bytes(), 0u);
  EXPECT_EQ((*pool)->pinned_bytes(), 40 * kKiB);
}

TEST(PinnedPool, NoFallbackMeansOutOfMemoryNamingTheLimit) {
  PinnedPoolOptions options;
  options.budget_bytes = 16 * kKiB;
  options.allow_pageable_fallback = false;
  auto pool = PinnedPool::create(nullptr, options);
  ASSERT_TRUE(pool.ok());
  auto buf = (*pool)->allocate(20 * kKiB);
  ASSERT_FALSE(buf.ok());
  EXPECT_EQ(buf.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(buf.status().message().find("pinned limit 16.00 KiB"), std::string::npos) << buf.status().message();
  EXPECT_NE(buf.status().message().find("ulimit -l"), std::string::npos);
}

TEST(PinnedPool, BadAlignmentIsRejected) {
  PinnedPoolOptions options;
  options.alignment_bytes = 3000;
  auto pool = PinnedPool::create(nullptr, options);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(pool.status().message().find("alignment_bytes 3000"), std::string::npos);
}

TEST(PinnedPool, LargerAlignmentAndZeroBytes) {
  PinnedPoolOptions options;
  options.alignment_bytes = 1 << 16;
  auto pool = PinnedPool::create(nullptr, options);
  ASSERT_TRUE(pool.ok());
  auto buf = (*pool)->allocate(1000);
  ASSERT_TRUE(buf.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % (1 << 16), 0u);
  EXPECT_EQ(buf->footprint_bytes(), size_t{1} << 16);
  auto empty = (*pool)->allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_FALSE(*empty);
}

// RLIMIT_MEMLOCK, in forked children so the test process keeps its limit.
// Child exit code 0 = all expectations held; otherwise the failed check's number.
int run_in_child(int (*body)()) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

TEST(PinnedPool, RespectsRlimitMemlockAtCreation) {
  const int rc = run_in_child([]() -> int {
    if (!test::drop_ipc_lock() || !test::lower_memlock(64 * kKiB)) return 1;
    int warned = 0;
    PinnedPoolOptions options;
    options.warn = [&](std::string_view w) { warned += std::string(w).find("RLIMIT_MEMLOCK 64.00 KiB") != std::string::npos; };
    auto pool = PinnedPool::create(nullptr, options);
    if (!pool.ok()) return 2;
    if ((*pool)->pinned_limit_bytes() != 64 * kKiB) return 3;
    auto buf = (*pool)->allocate(1 << 20);
    if (!buf.ok() || buf->tier() != Tier::kPageableHost) return 4;
    if (warned != 1) return 5;
    return 0;
  });
  EXPECT_EQ(rc, 0);
}

// With CAP_IPC_LOCK the kernel ignores RLIMIT_MEMLOCK, and so must the pool:
// it used to send everything past the soft limit to pageable memory although
// mlock would have pinned it (root in a container, 8 MiB limit).
TEST(PinnedPool, CapIpcLockLiftsTheMemlockBound) {
  if (!probe_pinning().ipc_lock_capability) GTEST_SKIP() << "this process does not hold CAP_IPC_LOCK";
  const int rc = run_in_child([]() -> int {
    if (!test::lower_memlock(64 * kKiB)) return 1;
    int warned = 0;
    PinnedPoolOptions options;
    options.warn = [&](std::string_view) { ++warned; };
    auto pool = PinnedPool::create(nullptr, options);
    if (!pool.ok()) return 2;
    if ((*pool)->pinned_limit_bytes() != 0) return 3;  // 0: no limit
    auto buf = (*pool)->allocate(1 << 20);
    if (!buf.ok() || buf->tier() != Tier::kPinnedHost) return 4;
    if (warned != 0) return 5;
    const PinningProbe probe = probe_pinning();
    if (!probe.ipc_lock_capability || probe.memlock_limit_bytes != 64 * kKiB) return 6;
    if (probe.detail.find("not applied: CAP_IPC_LOCK") == std::string::npos) return 7;
    return 0;
  });
  EXPECT_EQ(rc, 0);
}

TEST(PinnedPool, FallsBackWhenMlockItselfFails) {
  // The limit drops after the pool was created, so the pool's own check
  // passes and mlock() is what refuses (ENOMEM/EPERM).
  const int rc = run_in_child([]() -> int {
    int warned = 0;
    PinnedPoolOptions options;
    options.warn = [&](std::string_view w) { warned += std::string(w).find("mlock") != std::string::npos; };
    auto pool = PinnedPool::create(nullptr, options);
    if (!pool.ok()) return 1;
    if (!test::drop_ipc_lock()) return 0;  // cannot make mlock refuse here: nothing to test
    if (!test::lower_memlock(16 * kKiB)) return 2;
    std::vector<char> probe(64 * kKiB, 1);  // sanitizer runtimes make mlock a no-op that succeeds
    if (mlock(probe.data(), probe.size()) == 0) return 0;
    auto buf = (*pool)->allocate(1 << 20);
    if (!buf.ok() || buf->tier() != Tier::kPageableHost) return 3;
    if (warned != 1) return 4;
    if ((*pool)->pinned_bytes() != 0) return 5;  // the reservation was undone
    return 0;
  });
  EXPECT_EQ(rc, 0);
}

TEST(PinnedPool, PinsThroughTheDeviceSoCopiesAreAsync) {
  if (!can_pin(64 * kKiB)) GTEST_SKIP() << probe_pinning(64 * kKiB).detail;
  auto device = make_device("cpu");
  ASSERT_TRUE(device.ok());
  for (PinMethod method : {PinMethod::kRegister, PinMethod::kAllocate}) {
    PinnedPoolOptions options;
    options.method = method;
    auto pool = PinnedPool::create(device->get(), options);
    ASSERT_TRUE(pool.ok());
    auto host = (*pool)->allocate(10000);
    ASSERT_TRUE(host.ok());
    ASSERT_TRUE(host->pinned());
    std::memset(host->data(), 7, 10000);
    auto dev = (*device)->allocate(10000);
    ASSERT_TRUE(dev.ok());
    ASSERT_TRUE((*device)->copy(dev->data(), host->data(), 10000, CopyKind::kHostToDevice).ok());
    EXPECT_EQ(dev->as<uint8_t>()[9999], 7);
  }
}

TEST(PinnedPool, ThreadSafe) {
  PinnedPoolOptions options;
  options.budget_bytes = 256 * kKiB;  // some allocations pin, some fall back
  options.warn = [](std::string_view) {};
  auto pool = PinnedPool::create(nullptr, options);
  ASSERT_TRUE(pool.ok());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        auto buf = (*pool)->allocate(static_cast<size_t>((t + 1) * 4096 * (1 + i % 5)));
        if (buf.ok()) std::memset(buf->data(), t, buf->size_bytes());
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ((*pool)->stats().get(Tier::kPinnedHost).current_bytes, 0u);
  EXPECT_EQ((*pool)->stats().get(Tier::kPageableHost).current_bytes, 0u);
  EXPECT_LE((*pool)->pinned_bytes(), 256 * kKiB);
  EXPECT_EQ((*pool)->pinned_bytes(), (*pool)->cached_bytes());
}

TEST(PinnedPool, ProbeReportsTheLimit) {
  PinningProbe probe = probe_pinning();
  EXPECT_FALSE(probe.detail.empty());
  EXPECT_NE(probe.detail.find("RLIMIT_MEMLOCK"), std::string::npos);
  EXPECT_GT(probe.memlock_limit_bytes, 0u);
}

}  // namespace
}  // namespace strata
