// SlotPool: fixed pinned slots, blocking acquire with a holder-naming
// timeout, completion-guarded release, contention (run under TSan too).
#include "strata/core/slot_pool.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "strata/core/device.h"
#include "strata/core/device_registry.h"
#include "ipc_lock_capability.h"

namespace strata {
namespace {

using namespace std::chrono_literals;
constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * kKiB;

std::unique_ptr<Device> cpu_device() {
  auto device = make_device("cpu");
  EXPECT_TRUE(device.ok()) << device.status().to_string();
  return std::move(device).value();
}

std::unique_ptr<SlotPool> make_pool(Device& device, size_t count, size_t bytes,
                                    std::chrono::milliseconds timeout = 5000ms, std::string name = "test slots") {
  SlotPoolOptions options;
  options.slot_count = count;
  options.slot_bytes = bytes;
  options.name = std::move(name);
  options.acquire_timeout = timeout;
  auto pool = SlotPool::create(device, options);
  EXPECT_TRUE(pool.ok()) << pool.status().to_string();
  return pool.ok() ? std::move(pool).value() : nullptr;
}

TEST(SlotPool, AcquireAndReleaseHandsOutDistinctAlignedSlots) {
  auto device = cpu_device();
  auto pool = make_pool(*device, 3, 64 * kKiB + 100);
  ASSERT_TRUE(pool);
  EXPECT_EQ(pool->slot_count(), 3u);
  EXPECT_EQ(pool->slot_bytes(), 64 * kKiB + 100);
  EXPECT_EQ(pool->slot_stride(), 68 * kKiB);  // rounded up to 4096
  EXPECT_EQ(pool->total_bytes(), 3 * 68 * kKiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool->base()) % 4096, 0u);

  std::vector<Slot> held;
  std::set<size_t> indices;
  for (int i = 0; i < 3; ++i) {
    auto slot = pool->acquire("user " + std::to_string(i));
    ASSERT_TRUE(slot.ok()) << slot.status().to_string();
    EXPECT_EQ(slot->bytes(), 64 * kKiB + 100);
    EXPECT_EQ(slot->holder(), "user " + std::to_string(i));
    EXPECT_EQ(slot->data(), static_cast<char*>(pool->base()) + slot->index() * pool->slot_stride());
    EXPECT_EQ(slot->offset(), slot->index() * pool->slot_stride());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(slot->data()) % 4096, 0u);
    std::memset(slot->data(), i, slot->bytes());  // the whole slot is writable
    indices.insert(slot->index());
    held.push_back(std::move(slot).value());
  }
  EXPECT_EQ(indices.size(), 3u);
  EXPECT_EQ(pool->free_slots(), 0u);

  Slot moved = std::move(held[1]);
  EXPECT_FALSE(held[1]);
  EXPECT_TRUE(moved);
  moved.reset();
  EXPECT_FALSE(moved);
  EXPECT_EQ(pool->free_slots(), 1u);
  held.clear();
  EXPECT_EQ(pool->free_slots(), 3u);

  const SlotPoolStats stats = pool->stats();
  EXPECT_EQ(stats.acquires, 3u);
  EXPECT_EQ(stats.releases, 3u);
  EXPECT_EQ(stats.waits, 0u);
  EXPECT_EQ(stats.peak_in_use, 3u);
  EXPECT_EQ(stats.in_use, 0u);
}

TEST(SlotPool, TryAcquireFailsAtOnceWhenExhausted) {
  auto device = cpu_device();
  auto pool = make_pool(*device, 2, 4096, 5000ms, "staging");
  ASSERT_TRUE(pool);
  auto a = pool->try_acquire("reader");
  auto b = pool->try_acquire("writer");
  ASSERT_TRUE(a.ok() && b.ok());
  const auto start = std::chrono::steady_clock::now();
  auto c = pool->try_acquire("third");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);  // did not wait for the 5 s timeout
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("'staging'"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("'reader'"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("'writer'"), std::string::npos) << c.status().message();
  EXPECT_EQ(pool->stats().try_failures, 1u);
  a->reset();
  EXPECT_TRUE(pool->try_acquire("third").ok());
}

TEST(SlotPool, TimeoutNamesThePoolAndEveryHolder) {
  auto device = cpu_device();
  auto pool = make_pool(*device, 2, 64 * kKiB, 50ms, "nvme staging");
  ASSERT_TRUE(pool);
  auto held = pool->acquire("read chunk 4");
  ASSERT_TRUE(held.ok());
  auto releasing = pool->acquire("write chunk 3");
  ASSERT_TRUE(releasing.ok());
  CompletionSource write_done("nvme write of 'out.bin' [0, 65536)");
  releasing->release_after(write_done.completion());
  EXPECT_FALSE(*releasing);

  const auto start = std::chrono::steady_clock::now();
  auto late = pool->acquire("copy chunk 5");
  EXPECT_GE(std::chrono::steady_clock::now() - start, 50ms);
  ASSERT_FALSE(late.ok());
  const std::string& m = late.status().message();
  EXPECT_EQ(late.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(m.find("'nvme staging'"), std::string::npos) << m;
  EXPECT_NE(m.find("2 x 64.00 KiB"), std::string::npos) << m;
  EXPECT_NE(m.find("held by 'read chunk 4'"), std::string::npos) << m;
  EXPECT_NE(m.find("'write chunk 3', waiting on 'nvme write of 'out.bin' [0, 65536)'"), std::string::npos) << m;
  EXPECT_NE(m.find("'copy chunk 5'"), std::string::npos) << m;
  EXPECT_NE(m.find("50 ms"), std::string::npos) << m;

  const SlotPoolStats stats = pool->stats();
  EXPECT_EQ(stats.timeouts, 1u);
  EXPECT_EQ(stats.waits, 1u);
  EXPECT_GE(stats.total_wait_ns, 50'000'000u);
  EXPECT_EQ(stats.pending_releases, 1u);
  write_done.complete(Status::Ok());
  EXPECT_TRUE(pool->acquire("copy chunk 5").ok());
}

TEST(SlotPool, ReleaseAfterReturnsTheSlotOnlyOnceTheCompletionCompleted) {
  auto device = cpu_device();
  auto pool = make_pool(*device, 1, 8 * kKiB);
  ASSERT_TRUE(pool);
  auto slot = pool->acquire("h2d source");
  ASSERT_TRUE(slot.ok());
  const size_t index = slot->index();
  CompletionSource copy_done("h2d copy");
  slot->release_after(copy_done.completion());
  EXPECT_EQ(pool->free_slots(), 0u);
  EXPECT_FALSE(pool->try_acquire("too early").ok());
  EXPECT_EQ(pool->stats().pending_releases, 1u);

  // A blocked acquire is woken by the completion, not by polling.
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    auto again = pool->acquire("next chunk");
    EXPECT_TRUE(again.ok()) << again.status().to_string();
    if (again.ok()) {
      EXPECT_EQ(again->index(), index);
    }
    got = true;
  });
  // The waiter is blocked in acquire() (counted as a wait) before the copy ends.
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (pool->stats().waits == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(pool->stats().waits, 1u);
  EXPECT_FALSE(got.load());
  copy_done.complete(Status::Ok());
  waiter.join();
  EXPECT_TRUE(got.load());
  const SlotPoolStats stats = pool->stats();
  EXPECT_EQ(stats.waits, 1u);
  EXPECT_EQ(stats.pending_releases, 0u);
  EXPECT_EQ(stats.failed_releases, 0u);
  EXPECT_EQ(stats.releases, 2u);
}

TEST(SlotPool, ReleaseAfterAnAlreadyCompleteCompletionReturnsAtOnce) {
  auto device = cpu_device();
  auto pool = make_pool(*device, 1, 4096);
  ASSERT_TRUE(pool);
  auto slot = pool->acquire("a");
  ASSERT_TRUE(slot.ok());
  slot->release_after(Completion());
  EXPECT_EQ(pool->free_slots(), 1u);
}

TEST(SlotPool, AFailedReleaseCompletionStillReturnsTheSlotAndIsCounted) {
  auto device = cpu_device();
  auto pool = make_pool(*device, 1, 4096);
  ASSERT_TRUE(pool);
  auto slot = pool->acquire("writer");
  ASSERT_TRUE(slot.ok());
  CompletionSource write("nvme write");
  slot->release_after(write.completion());
  write.complete(IoError("pwrite 'x.swp' at 4096: disk gone"));
  EXPECT_EQ(pool->free_slots(), 1u);
  const SlotPoolStats stats = pool->stats();
  EXPECT_EQ(stats.failed_releases, 1u);
  EXPECT_NE(stats.last_release_error.find("disk gone"), std::string::npos) << stats.last_release_error;
  // An abandoned producer (rule 3 of completion.h) also frees the slot.
  auto again = pool->acquire("writer 2");
  ASSERT_TRUE(again.ok());
  {
    CompletionSource abandoned("dropped write");
    again->release_after(abandoned.completion());
  }
  EXPECT_EQ(pool->free_slots(), 1u);
  EXPECT_EQ(pool->stats().failed_releases, 2u);
}

TEST(SlotPool, ReleaseAfterStreamWorkKeepsTheSlotUntilTheCopyRan) {
  auto device = cpu_device();
  auto pool = make_pool(*device, 1, 64 * kKiB);
  ASSERT_TRUE(pool);
  auto stream = device->create_stream();
  ASSERT_TRUE(stream.ok());
  auto dst = device->allocate(64 * kKiB);
  ASSERT_TRUE(dst.ok());

  auto slot = pool->acquire("h2d chunk 0");
  ASSERT_TRUE(slot.ok());
  std::memset(slot->data(), 0x5A, slot->bytes());
  std::atomic<bool> copy_issued_work_ran{false};
  // Hold the stream busy so the copy is still queued when we release.
  ASSERT_TRUE((*stream)->launch_host([&] {
    std::this_thread::sleep_for(50ms);
    copy_issued_work_ran = true;
  }).ok());
  ASSERT_TRUE((*stream)->copy_async(dst->data(), slot->data(), slot->bytes(), CopyKind::kHostToDevice).ok());
  slot->release_after((*stream)->record_completion());

  auto reused = pool->acquire("h2d chunk 1");
  ASSERT_TRUE(reused.ok()) << reused.status().to_string();
  EXPECT_TRUE(copy_issued_work_ran.load());  // the slot came back only after the stream's work
  std::memset(reused->data(), 0x11, reused->bytes());  // overwriting now cannot change the copy
  ASSERT_TRUE((*stream)->synchronize().ok());
  const auto* bytes = static_cast<const unsigned char*>(dst->data());  // cpu device memory is host-addressable
  size_t wrong = 0;
  for (size_t i = 0; i < 64 * kKiB; ++i) wrong += bytes[i] != 0x5A;
  EXPECT_EQ(wrong, 0u);
}

// The same reuse rule on the cuda device: slots come from cudaHostAlloc, so
// the H2D copy is truly asynchronous and the slot must not be reused before
// the stream's completion. Skips without a usable GPU.
TEST(SlotPool, CudaSlotsAreReusedOnlyAfterTheAsyncCopyRan) {
  auto device_or = make_device("cuda");
  if (!device_or.ok()) GTEST_SKIP() << device_or.status().to_string();
  auto device = std::move(device_or).value();
  constexpr size_t kBytes = 32 * kMiB;  // large enough that the copy is still running when we release
  auto pool = make_pool(*device, 1, kBytes, 10000ms, "cuda staging");
  ASSERT_TRUE(pool);
  auto stream = device->create_stream();
  ASSERT_TRUE(stream.ok());
  auto dev = device->allocate(kBytes);
  ASSERT_TRUE(dev.ok());
  auto back = make_pool(*device, 1, kBytes, 10000ms, "cuda readback");
  ASSERT_TRUE(back);

  auto slot = pool->acquire("h2d");
  ASSERT_TRUE(slot.ok());
  std::memset(slot->data(), 0x5A, kBytes);
  ASSERT_TRUE((*stream)->copy_async(dev->data(), slot->data(), kBytes, CopyKind::kHostToDevice).ok());
  slot->release_after((*stream)->record_completion());
  auto reused = pool->acquire("overwrite");  // waits for the copy's completion
  ASSERT_TRUE(reused.ok()) << reused.status().to_string();
  std::memset(reused->data(), 0x11, kBytes);

  auto readback = back->acquire("d2h");
  ASSERT_TRUE(readback.ok());
  ASSERT_TRUE((*stream)->copy_async(readback->data(), dev->data(), kBytes, CopyKind::kDeviceToHost).ok());
  ASSERT_TRUE((*stream)->synchronize().ok());
  const auto* bytes = readback->as<const unsigned char>();
  size_t wrong = 0;
  for (size_t i = 0; i < kBytes; ++i) wrong += bytes[i] != 0x5A;
  EXPECT_EQ(wrong, 0u);
  EXPECT_EQ(pool->memory_stats().get(Tier::kPinnedHost).current_bytes, kBytes);
}

// Several threads acquire, fill, check and release through completions that
// other threads complete; a slot reused before its completion would show up
// as a corrupted pattern in the completer's check. Run under TSan as well.
TEST(SlotPool, ContentionWithCompletionGuardedReuse) {
  constexpr int kThreads = 6;
  constexpr int kIterations = 300;
  constexpr size_t kSlotBytes = 16 * kKiB;
  auto device = cpu_device();
  auto pool = make_pool(*device, 3, kSlotBytes, 20000ms, "contended");
  ASSERT_TRUE(pool);

  struct Pending {
    CompletionSource source;
    const uint32_t* words;
    uint32_t pattern;
  };
  std::mutex queue_mutex;
  std::condition_variable queue_cv;
  std::deque<Pending> queue;
  bool producers_done = false;
  std::atomic<uint64_t> wrong{0};
  std::atomic<uint64_t> failures{0};

  auto check = [&](const uint32_t* words, uint32_t pattern) {
    uint64_t bad = 0;
    for (size_t i = 0; i < kSlotBytes / 4; ++i) bad += words[i] != (pattern ^ static_cast<uint32_t>(i));
    wrong += bad;
  };

  std::vector<std::thread> completers;
  for (int c = 0; c < 2; ++c) {
    completers.emplace_back([&] {
      for (;;) {
        Pending p;
        {
          std::unique_lock<std::mutex> lock(queue_mutex);
          queue_cv.wait(lock, [&] { return !queue.empty() || producers_done; });
          if (queue.empty()) return;
          p = std::move(queue.front());
          queue.pop_front();
        }
        check(p.words, p.pattern);  // the slot is still ours: nobody may have reused it
        p.source.complete(Status::Ok());
      }
    });
  }
  std::vector<std::thread> users;
  for (int t = 0; t < kThreads; ++t) {
    users.emplace_back([&, t] {
      for (int it = 0; it < kIterations; ++it) {
        auto slot = pool->acquire("thread " + std::to_string(t) + " iteration " + std::to_string(it));
        if (!slot.ok()) {
          ++failures;
          ADD_FAILURE() << slot.status().to_string();
          return;
        }
        const uint32_t pattern = static_cast<uint32_t>(t) << 24 | static_cast<uint32_t>(it);
        auto* words = slot->as<uint32_t>();
        for (size_t i = 0; i < kSlotBytes / 4; ++i) words[i] = pattern ^ static_cast<uint32_t>(i);
        check(words, pattern);
        CompletionSource source("consumer of thread " + std::to_string(t));
        slot->release_after(source.completion());
        {
          std::lock_guard<std::mutex> lock(queue_mutex);
          queue.push_back(Pending{std::move(source), words, pattern});
        }
        queue_cv.notify_one();
      }
    });
  }
  for (auto& u : users) u.join();
  {
    std::lock_guard<std::mutex> lock(queue_mutex);
    producers_done = true;
  }
  queue_cv.notify_all();
  for (auto& c : completers) c.join();

  EXPECT_EQ(failures.load(), 0u);
  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_EQ(pool->free_slots(), 3u);
  const SlotPoolStats stats = pool->stats();
  EXPECT_EQ(stats.acquires, uint64_t{kThreads} * kIterations);
  EXPECT_EQ(stats.releases, uint64_t{kThreads} * kIterations);
  EXPECT_EQ(stats.in_use, 0u);
  EXPECT_EQ(stats.pending_releases, 0u);
  EXPECT_EQ(stats.peak_in_use, 3u);
  EXPECT_GT(stats.waits, 0u);  // 6 users on 3 slots must have waited
}

TEST(SlotPool, TheRegionIsCountedAsPinnedHostMemory) {
  auto device = cpu_device();
  const TierStats before = MemoryStats::process().get(Tier::kPinnedHost);
  {
    auto pool = make_pool(*device, 4, 100000);
    ASSERT_TRUE(pool);
    const size_t region = 4 * 102400;  // 100000 rounded up to 4096 = 102400
    EXPECT_EQ(pool->total_bytes(), region);
    EXPECT_EQ(pool->memory_stats().get(Tier::kPinnedHost).current_bytes, region);
    EXPECT_EQ(pool->memory_stats().get(Tier::kPageableHost).current_bytes, 0u);
    EXPECT_EQ(MemoryStats::process().get(Tier::kPinnedHost).current_bytes, before.current_bytes + region);
    auto slot = pool->acquire("x");  // occupancy does not change the pinned count
    ASSERT_TRUE(slot.ok());
    EXPECT_EQ(pool->memory_stats().get(Tier::kPinnedHost).current_bytes, region);
  }
  EXPECT_EQ(MemoryStats::process().get(Tier::kPinnedHost).current_bytes, before.current_bytes);
}

TEST(SlotPool, LargeAlignmentIsHonoured) {
  auto device = cpu_device();
  SlotPoolOptions options;
  options.slot_count = 3;
  options.slot_bytes = 10000;
  options.alignment = 64 * kKiB;
  auto pool = SlotPool::create(*device, options);
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*pool)->base()) % (64 * kKiB), 0u);
  EXPECT_EQ((*pool)->slot_stride(), 64 * kKiB);
  std::vector<Slot> slots;
  for (int i = 0; i < 3; ++i) {
    auto slot = (*pool)->acquire("a");
    ASSERT_TRUE(slot.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(slot->data()) % (64 * kKiB), 0u);
    std::memset(slot->data(), 1, (*pool)->slot_stride());  // inside the pinned allocation
    slots.push_back(std::move(slot).value());
  }
}

void expect_bad(Device& device, SlotPoolOptions options, std::string_view needle) {
  auto pool = SlotPool::create(device, options);
  ASSERT_FALSE(pool.ok()) << "accepted, expected an error naming " << needle;
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(pool.status().message().find(needle), std::string::npos) << pool.status().message();
  EXPECT_NE(pool.status().message().find("'bad'"), std::string::npos) << pool.status().message();
}

TEST(SlotPool, BadOptionsNameTheField) {
  auto device = cpu_device();
  SlotPoolOptions ok;
  ok.slot_count = 2;
  ok.slot_bytes = 4096;
  ok.name = "bad";
  SlotPoolOptions o = ok;
  o.slot_count = 0;
  expect_bad(*device, o, "slot_count is 0");
  o = ok;
  o.slot_count = 1'000'000;
  expect_bad(*device, o, "slot_count 1000000");
  o = ok;
  o.slot_bytes = 0;
  expect_bad(*device, o, "slot_bytes is 0");
  o = ok;
  o.alignment = 3000;
  expect_bad(*device, o, "alignment 3000");
  o = ok;
  o.alignment = 32;
  expect_bad(*device, o, "alignment 32");
  o = ok;
  o.acquire_timeout = 0ms;
  expect_bad(*device, o, "acquire_timeout");
  o = ok;
  o.slot_bytes = std::numeric_limits<size_t>::max() - 10;
  expect_bad(*device, o, "slot_bytes");
  o = ok;
  o.slot_count = 65536;
  o.slot_bytes = std::numeric_limits<size_t>::max() / 1024;
  expect_bad(*device, o, "overflows");
  o = ok;
  o.slot_count = 4;
  o.slot_bytes = size_t{1} << 48;  // 256 TiB each
  expect_bad(*device, o, "physical memory");
}

TEST(SlotPool, AskingForMoreThanASlotHoldsIsAnError) {
  auto device = cpu_device();
  auto pool = make_pool(*device, 2, 8 * kKiB, 5000ms, "small");
  ASSERT_TRUE(pool);
  EXPECT_TRUE(pool->check_fits(8 * kKiB).ok());
  auto fits = pool->acquire("exact", 8 * kKiB);
  EXPECT_TRUE(fits.ok());
  std::vector<Status> refused;
  refused.push_back(pool->acquire("big", 8 * kKiB + 1).status());
  refused.push_back(pool->try_acquire("big", 1 * kMiB).status());
  for (const Status& result : refused) {
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(result.message().find("'small'"), std::string::npos) << result.message();
    EXPECT_NE(result.message().find("a slot holds 8.00 KiB"), std::string::npos) << result.message();
  }
  EXPECT_EQ(pool->stats().acquires, 1u);  // the refused requests took nothing
}

TEST(SlotPoolDeathTest, DestroyingThePoolWithASlotOutIsABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto device = cpu_device();
        auto pool = make_pool(*device, 1, 4096, 5000ms, "leaky");
        auto slot = pool->acquire("forgotten holder");
        pool.reset();
      },
      "forgotten holder");
}

TEST(SlotPoolDeathTest, APendingReleaseThatNeverCompletesIsNamedAfterTheTimeout) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto device = cpu_device();
        auto pool = make_pool(*device, 1, 4096, 20ms, "stuck");
        CompletionSource never("d2h copy that never ends");
        auto slot = pool->acquire("d2h");
        slot->release_after(never.completion());
        pool.reset();
      },
      "d2h copy that never ends");
}

// Pinning refused -> an error, never pageable memory. In a child without
// CAP_IPC_LOCK (root ignores RLIMIT_MEMLOCK otherwise) and a 64 KiB limit.
int drop_ipc_lock_and_lower_memlock() {
  if (!test::drop_ipc_lock() || !test::lower_memlock(64 * kKiB)) return 1;
  // Sanitizer runtimes turn mlock into a no-op that succeeds: nothing to test then.
  std::vector<char> probe(1 * kMiB, 1);
  if (mlock(probe.data(), probe.size()) == 0) {
    munlock(probe.data(), probe.size());
    return 1;
  }
  return 0;
}

// SlotPoolOptions::account: the device counts the pool's region in the
// client's account (Note [Accounts] in device.h), as the pool counts it.
TEST(SlotPool, TheDeviceCountsTheRegionInTheGivenAccount) {
  auto device = cpu_device();
  MemoryStats account;
  {
    SlotPoolOptions options;
    options.slot_count = 3;
    options.slot_bytes = 5000;
    options.name = "accounted";
    options.account = &account;
    auto pool = SlotPool::create(*device, options);
    ASSERT_TRUE(pool.ok()) << pool.status().to_string();
    EXPECT_EQ(account.get(Tier::kPinnedHost).current_bytes, (*pool)->memory_stats().get(Tier::kPinnedHost).current_bytes);
    EXPECT_EQ(account.get(Tier::kPinnedHost).current_bytes, 3u * 8192);
  }
  EXPECT_EQ(account.get(Tier::kPinnedHost).current_bytes, 0u);
  EXPECT_EQ(account.get(Tier::kPinnedHost).peak_bytes, 3u * 8192);
}

TEST(SlotPool, RefusedPinningFailsCreationWithAMemlockHint) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (drop_ipc_lock_and_lower_memlock() != 0) _exit(77);
    auto device = make_device("cpu");
    if (!device.ok()) _exit(2);
    const uint64_t pinned_before = MemoryStats::process().get(Tier::kPinnedHost).current_bytes;
    SlotPoolOptions options;
    options.slot_count = 4;
    options.slot_bytes = 1 * kMiB;
    options.name = "refused";
    auto pool = SlotPool::create(**device, options);
    if (pool.ok()) _exit(3);
    const std::string m = pool.status().message();
    if (pool.status().code() != StatusCode::kOutOfMemory) _exit(4);
    if (m.find("'refused'") == std::string::npos) _exit(5);
    if (m.find("RLIMIT_MEMLOCK is 64.00 KiB") == std::string::npos) _exit(6);
    if (m.find("never falls back to pageable") == std::string::npos) _exit(7);
    if (MemoryStats::process().get(Tier::kPinnedHost).current_bytes != pinned_before) _exit(8);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "child died";
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "cannot make mlock fail here (CAP_IPC_LOCK kept, or a sanitizer makes mlock a no-op)";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace strata
