// One behavioural suite for every device backend: ordering within a
// stream, overlap of copy and compute across streams, event semantics,
// stream waits, capacity / out-of-memory, copy correctness for odd sizes.
// Backends that cannot run here (cuda without a GPU) skip with the reason.
// No timed assertions: overlap is shown by construction (a host function
// that can only finish once a copy on another stream has finished) and by
// the order of event timestamps.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/borrowed_stream.h"
#include "strata/core/device.h"
#include "strata/core/device_registry.h"
#include "strata/core/pinned_pool.h"

namespace strata {
namespace {

constexpr auto kDeadlockGuard = std::chrono::seconds(60);

class DeviceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    DeviceOptions options;
    options.device_memory_bytes = 64u << 20;
    auto device = make_device(GetParam(), options);
    if (!device.ok()) {
      ASSERT_EQ(device.status().code(), StatusCode::kUnavailable) << device.status().to_string();
      GTEST_SKIP() << device.status().message();
    }
    device_ = std::move(device).value();
    PinnedPoolOptions pool_options;
    pool_options.warn = [](std::string_view) {};
    auto pool = PinnedPool::create(device_.get(), pool_options);
    ASSERT_TRUE(pool.ok());
    pool_ = std::move(pool).value();
  }
  void TearDown() override {
    pool_.reset();
    device_.reset();
  }
  std::unique_ptr<Stream> stream() {
    auto s = device_->create_stream();
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return std::move(s).value();
  }
  std::unique_ptr<Event> event() {
    auto e = device_->create_event();
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    return std::move(e).value();
  }
  DeviceBuffer alloc(size_t bytes) {
    auto b = device_->allocate(bytes);
    EXPECT_TRUE(b.ok()) << b.status().to_string();
    return std::move(b).value();
  }
  bool is_cpu() const { return GetParam() == "cpu"; }

  std::unique_ptr<Device> device_;
  std::unique_ptr<PinnedPool> pool_;
};

// A gate a host function blocks on until the test opens it.
struct Gate {
  std::promise<void> promise;
  std::shared_future<void> future = promise.get_future().share();
  void open() { promise.set_value(); }
  bool wait() const { return future.wait_for(kDeadlockGuard) == std::future_status::ready; }
};

std::vector<uint8_t> pattern(size_t bytes, uint8_t seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(seed + i * 31 + (i >> 8));
  return v;
}

TEST_P(DeviceTest, CapsDescribeTheDevice) {
  const DeviceCaps& caps = device_->caps();
  EXPECT_EQ(caps.backend, GetParam());
  EXPECT_FALSE(caps.name.empty());
  EXPECT_GT(caps.memory_bytes, 0u);
  EXPECT_TRUE(caps.async_copies);
  auto s = stream();
  auto e = event();
  EXPECT_EQ(s->native_handle() == nullptr, is_cpu());  // cudaStream_t on cuda
  EXPECT_EQ(e->native_handle() == nullptr, is_cpu());
  if (is_cpu()) {
    EXPECT_EQ(caps.memory_bytes, 64u << 20);
    EXPECT_TRUE(caps.host_addressable);
    EXPECT_EQ(caps.copy_engines, 2);
  }
}

TEST_P(DeviceTest, CopiesOfOddSizesRoundTripFromPinnedAndPageable) {
  auto s = stream();
  for (size_t bytes : {size_t{1}, size_t{3}, size_t{255}, size_t{256}, size_t{257}, size_t{4097},
                       (size_t{1} << 20) + 13}) {
    for (bool pinned : {true, false}) {
      for (size_t offset : {size_t{0}, size_t{3}}) {  // unaligned host starts
        const auto src = pattern(bytes, static_cast<uint8_t>(bytes + offset));
        std::vector<uint8_t> pageable_in(bytes + offset), pageable_out(bytes + offset);
        auto pinned_in = pool_->allocate(bytes + offset);
        auto pinned_out = pool_->allocate(bytes + offset);
        ASSERT_TRUE(pinned_in.ok() && pinned_out.ok());
        uint8_t* in = (pinned ? pinned_in->as<uint8_t>() : pageable_in.data()) + offset;
        uint8_t* out = (pinned ? pinned_out->as<uint8_t>() : pageable_out.data()) + offset;
        std::memcpy(in, src.data(), bytes);
        std::memset(out, 0xee, bytes);
        DeviceBuffer a = alloc(bytes + 8), b = alloc(bytes + 8);
        ASSERT_TRUE(s->copy_async(a.as<uint8_t>() + 1, in, bytes, CopyKind::kHostToDevice).ok());
        ASSERT_TRUE(s->copy_async(b.as<uint8_t>() + 7, a.as<uint8_t>() + 1, bytes, CopyKind::kDeviceToDevice).ok());
        ASSERT_TRUE(s->copy_async(out, b.as<uint8_t>() + 7, bytes, CopyKind::kDeviceToHost).ok());
        ASSERT_TRUE(s->synchronize().ok());
        ASSERT_EQ(std::memcmp(out, src.data(), bytes), 0) << bytes << " bytes, pinned=" << pinned << " offset=" << offset;
      }
    }
  }
}

TEST_P(DeviceTest, SynchronousCopyAndMemset) {
  DeviceBuffer a = alloc(1000);
  ASSERT_TRUE(device_->memset(a.data(), 0x42, 1000).ok());
  std::vector<uint8_t> out(1000);
  ASSERT_TRUE(device_->copy(out.data(), a.data(), 1000, CopyKind::kDeviceToHost).ok());
  EXPECT_EQ(out[0], 0x42);
  EXPECT_EQ(out[999], 0x42);
}

TEST_P(DeviceTest, WorkOnOneStreamRunsInIssueOrder) {
  auto s = stream();
  std::vector<int> order;  // only touched by host functions of one stream
  DeviceBuffer d = alloc(4096);
  auto host = pool_->allocate(4096);
  ASSERT_TRUE(host.ok());
  uint8_t* h = host->as<uint8_t>();
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(s->launch_host([&order, i] { order.push_back(i); }).ok());
    // Each round: memset the device buffer to i, copy it back, check it in a
    // host function: only correct if memset -> copy -> check run in order.
    ASSERT_TRUE(s->memset_async(d.data(), i & 0xff, 4096).ok());
    ASSERT_TRUE(s->copy_async(h, d.data(), 4096, CopyKind::kDeviceToHost).ok());
    ASSERT_TRUE(s->launch_host([&order, h, i] { order.push_back(h[4095] == (i & 0xff) ? 1000 + i : -1); }).ok());
  }
  ASSERT_TRUE(s->synchronize().ok());
  ASSERT_EQ(order.size(), 400u);
  for (int i = 0; i < 200; ++i) {
    EXPECT_EQ(order[2 * i], i);
    EXPECT_EQ(order[2 * i + 1], 1000 + i) << "round " << i << " saw data from another round";
  }
}

TEST_P(DeviceTest, NeverRecordedEventIsComplete) {
  auto e = event();
  EXPECT_TRUE(e->query());
  EXPECT_TRUE(e->synchronize().ok());
  auto s = stream();
  EXPECT_TRUE(s->wait(*e).ok());  // waiting on it is a no-op
  EXPECT_TRUE(s->synchronize().ok());
}

TEST_P(DeviceTest, EventCompletesWhenTheWorkBeforeItHas) {
  auto s = stream();
  auto e = event();
  Gate gate;
  std::atomic<bool> before_done{false};
  ASSERT_TRUE(s->launch_host([&] {
    gate.wait();
    before_done = true;
  }).ok());
  ASSERT_TRUE(s->record(*e).ok());
  EXPECT_FALSE(e->query());  // the gated host function has not run yet
  EXPECT_FALSE(s->query());
  gate.open();
  ASSERT_TRUE(e->synchronize().ok());
  EXPECT_TRUE(before_done);
  EXPECT_TRUE(e->query());
  ASSERT_TRUE(s->synchronize().ok());
  EXPECT_TRUE(s->query());
}

TEST_P(DeviceTest, EventMayBeDestroyedWhileItsRecordIsPending) {
  auto s = stream();
  Gate gate;
  ASSERT_TRUE(s->launch_host([&] { gate.wait(); }).ok());
  {
    auto e = event();
    ASSERT_TRUE(s->record(*e).ok());
    auto waiter = stream();
    ASSERT_TRUE(waiter->wait(*e).ok());
    ASSERT_TRUE(waiter->launch_host([] {}).ok());
    gate.open();  // the waiter's stream finishes (destroyed at scope end) ...
  }               // ... and the event is gone before or while its record completes
  ASSERT_TRUE(s->synchronize().ok());
}

TEST_P(DeviceTest, StreamWaitsForEventOfAnotherStream) {
  auto producer = stream();
  auto consumer = stream();
  auto ready = event();
  Gate gate;
  std::atomic<bool> produced{false};
  std::atomic<int> consumer_saw{-1};
  ASSERT_TRUE(producer->launch_host([&] {
    gate.wait();
    produced = true;
  }).ok());
  ASSERT_TRUE(producer->record(*ready).ok());
  ASSERT_TRUE(consumer->wait(*ready).ok());
  ASSERT_TRUE(consumer->launch_host([&] { consumer_saw = produced ? 1 : 0; }).ok());
  gate.open();  // only now can the producer, and therefore the consumer, run
  ASSERT_TRUE(consumer->synchronize().ok());
  EXPECT_EQ(consumer_saw, 1);
  ASSERT_TRUE(producer->synchronize().ok());
}

TEST_P(DeviceTest, WaitUsesTheRecordCurrentAtTheTimeOfTheWait) {
  auto slow = stream();
  auto fast = stream();
  auto consumer = stream();
  auto e = event();
  Gate gate;
  std::atomic<bool> slow_done{false};
  std::atomic<int> saw{-1};
  ASSERT_TRUE(slow->launch_host([&] {
    gate.wait();
    slow_done = true;
  }).ok());
  ASSERT_TRUE(slow->record(*e).ok());
  ASSERT_TRUE(consumer->wait(*e).ok());  // captures the record on `slow`
  ASSERT_TRUE(fast->record(*e).ok());    // re-recording must not release the wait
  ASSERT_TRUE(fast->synchronize().ok());
  ASSERT_TRUE(consumer->launch_host([&] { saw = slow_done ? 1 : 0; }).ok());
  gate.open();
  ASSERT_TRUE(consumer->synchronize().ok());
  EXPECT_EQ(saw, 1);
  ASSERT_TRUE(slow->synchronize().ok());
}

// Overlap of copy and compute across streams, shown by construction: the
// copy stream waits for the event recorded as "compute" starts, and the
// compute host function can only finish after the copy's last byte has
// landed in host memory (it polls a copied marker). So the copy runs
// strictly inside the compute interval; a device that serialized streams,
// or ran copies on the compute thread, would never finish (the deadlock
// guard then fails the test). The event timestamps must order:
// compute start <= copy start <= compute end. (The poll reads memory a copy
// engine writes, as a GPU's DMA would; ThreadSanitizer reports that one
// deliberate race between the engine's memcpy and the atomic load.)
TEST_P(DeviceTest, CopyOnOneStreamOverlapsComputeOnAnother) {
  auto compute = stream();
  auto copy = stream();
  auto compute_start = event(), compute_end = event(), copy_start = event();
  const size_t bytes = 4u << 20;
  DeviceBuffer big = alloc(bytes), marker_dev = alloc(64);
  auto big_host = pool_->allocate(bytes);
  auto marker_host = pool_->allocate(64);
  auto one = pool_->allocate(64);
  ASSERT_TRUE(big_host.ok() && marker_host.ok() && one.ok());
  std::memset(big_host->data(), 3, bytes);
  std::memset(marker_host->data(), 0, 64);
  std::memset(one->data(), 1, 64);
  ASSERT_TRUE(device_->copy(marker_dev.data(), one->data(), 64, CopyKind::kHostToDevice).ok());

  std::atomic<bool> saw_copy{false};
  auto* marker = marker_host->as<uint8_t>();
  ASSERT_TRUE(compute->record(*compute_start).ok());
  ASSERT_TRUE(compute->launch_host([&saw_copy, marker] {
    const auto deadline = std::chrono::steady_clock::now() + kDeadlockGuard;
    while (std::chrono::steady_clock::now() < deadline) {
      if (std::atomic_ref<uint8_t>(*marker).load(std::memory_order_acquire) == 1) {
        saw_copy = true;
        return;
      }
      std::this_thread::yield();
    }
  }).ok());
  ASSERT_TRUE(compute->record(*compute_end).ok());

  ASSERT_TRUE(copy->wait(*compute_start).ok());
  ASSERT_TRUE(copy->record(*copy_start).ok());
  ASSERT_TRUE(copy->copy_async(big.data(), big_host->data(), bytes, CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(copy->copy_async(marker, marker_dev.data(), 64, CopyKind::kDeviceToHost).ok());

  ASSERT_TRUE(compute->synchronize().ok());
  ASSERT_TRUE(copy->synchronize().ok());
  EXPECT_TRUE(saw_copy) << "the copy never ran while compute was running on another stream";
  auto compute_to_copy = device_->elapsed_ms(*compute_start, *copy_start);
  auto copy_to_end = device_->elapsed_ms(*copy_start, *compute_end);
  ASSERT_TRUE(compute_to_copy.ok()) << compute_to_copy.status().to_string();
  ASSERT_TRUE(copy_to_end.ok()) << copy_to_end.status().to_string();
  EXPECT_GE(*compute_to_copy, 0.0);
  EXPECT_GE(*copy_to_end, 0.0);
  std::vector<uint8_t> check(bytes);
  ASSERT_TRUE(device_->copy(check.data(), big.data(), bytes, CopyKind::kDeviceToHost).ok());
  EXPECT_EQ(check[bytes - 1], 3);
}

TEST_P(DeviceTest, PageableDeviceToHostCopyIsDoneWhenCallReturns) {
  // As cudaMemcpyAsync: a copy into pageable host memory has completed when
  // the call returns, so pageable copies never overlap with the host.
  auto s = stream();
  DeviceBuffer d = alloc(1 << 16);
  ASSERT_TRUE(device_->memset(d.data(), 0x77, 1 << 16).ok());
  std::vector<uint8_t> out(1 << 16, 0);
  ASSERT_TRUE(s->copy_async(out.data(), d.data(), out.size(), CopyKind::kDeviceToHost).ok());
  EXPECT_EQ(out.back(), 0x77);
  EXPECT_EQ(out.front(), 0x77);
  ASSERT_TRUE(s->synchronize().ok());
}

TEST_P(DeviceTest, OutOfMemoryNamesRequestedInUseAndLimit) {
  const uint64_t too_much = device_->caps().memory_bytes + (uint64_t{1} << 30);
  auto held = device_->allocate(1 << 20);
  ASSERT_TRUE(held.ok());
  auto r = device_->allocate(too_much);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory);
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("requested"), std::string::npos) << m;
  EXPECT_NE(m.find("in use"), std::string::npos) << m;
  EXPECT_NE(m.find("limit"), std::string::npos) << m;
  if (is_cpu()) {
    EXPECT_NE(m.find("in use 1.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("limit 64.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("--device-memory"), std::string::npos) << m;
  }
}

TEST_P(DeviceTest, CudaMemoryLimitCapsStrataAllocations) {
  if (is_cpu()) GTEST_SKIP() << "the cpu device's capacity is device_memory_bytes (tested above)";
  DeviceOptions options;
  options.cuda_memory_limit_bytes = 64u << 20;
  auto capped = make_device("cuda", options);
  ASSERT_TRUE(capped.ok()) << capped.status().to_string();
  EXPECT_EQ((*capped)->caps().memory_bytes, 64u << 20);
  auto a = (*capped)->allocate(48u << 20);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  auto b = (*capped)->allocate(17u << 20);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(b.status().message().find("--device-memory"), std::string::npos) << b.status().message();
  a->reset();
  EXPECT_TRUE((*capped)->allocate(17u << 20).ok());  // the cap is returned by frees
}

TEST_P(DeviceTest, CapacityIsReturnedByFreeAndFreeAsync) {
  if (!is_cpu()) GTEST_SKIP() << "exact capacity accounting is a cpu-device property";
  std::vector<DeviceBuffer> buffers;
  for (int i = 0; i < 4; ++i) buffers.push_back(alloc(16u << 20));  // fills the 64 MiB cap
  EXPECT_EQ(device_->memory_in_use_bytes(), 64u << 20);
  EXPECT_EQ(device_->allocate(1).status().code(), StatusCode::kOutOfMemory);
  buffers.pop_back();  // synchronous free
  EXPECT_TRUE(device_->allocate(1).ok());
  auto s = stream();
  Gate gate;
  ASSERT_TRUE(s->launch_host([&] { gate.wait(); }).ok());
  ASSERT_TRUE(s->free_async(std::move(buffers.back())).ok());
  EXPECT_EQ(device_->memory_in_use_bytes(), 48u << 20);  // not yet: the stream is blocked
  gate.open();
  ASSERT_TRUE(s->synchronize().ok());
  EXPECT_EQ(device_->memory_in_use_bytes(), 32u << 20);
  const TierStats st = device_->memory_stats().get(Tier::kDevice);
  EXPECT_EQ(st.peak_bytes, 64u << 20);
  EXPECT_EQ(st.current_bytes, 32u << 20);
}

// Note [Accounts]: a client's account holds what the device counts for the
// client's allocations (cpu: the 256-byte footprint of an odd size), and
// drops a stream-ordered free when the device does (when the free runs).
TEST_P(DeviceTest, AnAccountHoldsTheDevicesOwnCountOfItsAllocations) {
  MemoryStats account;
  const uint64_t device_before = device_->memory_stats().get(Tier::kDevice).current_bytes;
  DeviceBuffer mine = device_->allocate(1000, account).value();
  DeviceBuffer other = alloc(4096);  // not the client's
  const uint64_t mine_counted = device_->memory_stats().get(Tier::kDevice).current_bytes - device_before - 4096;
  if (is_cpu()) {
    EXPECT_EQ(mine_counted, 1024u) << "the cpu device counts the 256-byte footprint";
  }
  EXPECT_EQ(account.get(Tier::kDevice).current_bytes, mine_counted);
  void* pinned = device_->allocate_pinned_host(5000, account).value();
  EXPECT_EQ(account.get(Tier::kPinnedHost).current_bytes, 5000u);
  DeviceBuffer second = device_->allocate(256, account).value();
  EXPECT_EQ(account.get(Tier::kDevice).current_bytes, mine_counted + 256);
  EXPECT_EQ(account.get(Tier::kDevice).peak_bytes, mine_counted + 256);

  auto s = stream();
  Gate gate;
  ASSERT_TRUE(s->launch_host([&] { gate.wait(); }).ok());
  ASSERT_TRUE(s->free_async(std::move(second)).ok());
  if (is_cpu()) {
    EXPECT_EQ(account.get(Tier::kDevice).current_bytes, mine_counted + 256) << "the free has not run";
  }
  gate.open();
  ASSERT_TRUE(s->synchronize().ok());
  EXPECT_EQ(account.get(Tier::kDevice).current_bytes, mine_counted);
  mine.reset();
  device_->free_pinned_host(pinned, 5000);
  EXPECT_EQ(account.get(Tier::kDevice).current_bytes, 0u);
  EXPECT_EQ(account.get(Tier::kPinnedHost).current_bytes, 0u);
  EXPECT_EQ(account.get(Tier::kDevice).peak_bytes, mine_counted + 256);
  EXPECT_EQ(account.get(Tier::kDevice).allocation_count, 2u);
  EXPECT_EQ(account.get(Tier::kDevice).free_count, 2u);
  other.reset();
  EXPECT_EQ(device_->memory_stats().get(Tier::kDevice).current_bytes, device_before);
  // Without an account the device counts as before, and no account sees it.
  void* plain = device_->allocate_pinned_host(4096).value();
  device_->free_pinned_host(plain, 4096);
  EXPECT_EQ(account.get(Tier::kPinnedHost).allocation_count, 1u);
}

TEST_P(DeviceTest, HostFunctionExceptionIsAStickyStreamError) {
  auto s = stream();
  ASSERT_TRUE(s->launch_host([] { throw std::runtime_error("kernel blew up"); }).ok());
  Status st = s->synchronize();
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("kernel blew up"), std::string::npos);
  EXPECT_FALSE(s->synchronize().ok());  // sticky
}

// --- host-signalled completions (Note [Failed gates] in cpu_device.cpp) ---

TEST_P(DeviceTest, StreamWaitsOnAHostCompletionBeforeItsCopy) {
  auto s = stream();
  auto e = event();
  constexpr size_t kBytes = 64 << 10;
  const auto src = pattern(kBytes, 9);
  auto host = pool_->allocate(kBytes);
  ASSERT_TRUE(host.ok());
  std::memset(host->data(), 0, kBytes);  // the "read" has not landed yet
  DeviceBuffer d = alloc(kBytes);
  CompletionSource read("nvme read of 'w.swp' [0, 65536)");
  ASSERT_TRUE(s->wait(read.completion()).ok());
  ASSERT_TRUE(s->copy_async(d.data(), host->data(), kBytes, CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(s->record(*e).ok());
  Completion copied = s->record_completion();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(e->query());  // gated: nothing after the wait has run
  EXPECT_FALSE(copied.done());
  std::memcpy(host->data(), src.data(), kBytes);  // the read lands, then completes
  read.complete(Status::Ok());
  ASSERT_TRUE(copied.wait_for(kDeadlockGuard));
  EXPECT_TRUE(copied.status().ok());
  ASSERT_TRUE(e->synchronize().ok());
  std::vector<uint8_t> out(kBytes);
  ASSERT_TRUE(device_->copy(out.data(), d.data(), kBytes, CopyKind::kDeviceToHost).ok());
  EXPECT_EQ(out, src);
}

// Note [Idle streams run small work inline] (cpu device): a small memset
// on an idle stream is done when the call returns; on a stream with work
// queued it waits its turn like any other item.
TEST_P(DeviceTest, SmallWorkRunsInlineOnlyWhenTheStreamIsIdle) {
  if (!is_cpu()) GTEST_SKIP() << "a property of the cpu device's streams";
  auto s = stream();
  constexpr size_t kBytes = 256;
  DeviceBuffer d = alloc(kBytes);
  auto* bytes = static_cast<const uint8_t*>(d.data());  // cpu device memory is host memory
  ASSERT_TRUE(s->memset_async(d.data(), 7, kBytes).ok());
  Completion idle = s->record_completion();
  EXPECT_TRUE(idle.done());  // idle stream: ran on this thread
  EXPECT_EQ(bytes[0], 7);
  EXPECT_EQ(bytes[kBytes - 1], 7);
  ASSERT_TRUE(s->wait(Completion()).ok());  // a gate on completed work is no item

  CompletionSource gate("the test's gate");
  ASSERT_TRUE(s->wait(gate.completion()).ok());
  ASSERT_TRUE(s->memset_async(d.data(), 9, kBytes).ok());
  auto out = pool_->allocate(kBytes);  // pinned: a pageable copy would wait for the gate right here
  ASSERT_TRUE(out.ok());
  auto* copied = static_cast<uint8_t*>(out->data());
  std::memset(copied, 1, kBytes);
  ASSERT_TRUE(s->copy_async(copied, d.data(), kBytes, CopyKind::kDeviceToHost).ok());
  Completion queued = s->record_completion();
  EXPECT_FALSE(queued.done());  // behind the open gate: nothing after it ran
  EXPECT_EQ(bytes[0], 7);
  EXPECT_EQ(copied[0], 1);
  gate.complete(Status::Ok());
  ASSERT_TRUE(queued.wait_for(kDeadlockGuard));
  EXPECT_TRUE(queued.status().ok());
  EXPECT_EQ(bytes[0], 9);
  EXPECT_EQ(std::vector<uint8_t>(copied, copied + kBytes), std::vector<uint8_t>(kBytes, 9));
}

TEST_P(DeviceTest, FailedCompletionFailsTheGatedStreamAndEveryWaiter) {
  auto s = stream();
  auto other = stream();
  auto e = event();
  DeviceBuffer d = alloc(4096);
  auto host = pool_->allocate(4096);
  ASSERT_TRUE(host.ok());
  std::atomic<bool> ran_before{false}, ran_after{false}, ran_downstream{false};
  ASSERT_TRUE(s->launch_host([&] { ran_before = true; }).ok());
  CompletionSource read("nvme read of tensor 'h3.attn' from 'r0.swp'");
  ASSERT_TRUE(s->wait(read.completion()).ok());
  ASSERT_TRUE(s->copy_async(d.data(), host->data(), 4096, CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(s->launch_host([&] { ran_after = true; }).ok());
  ASSERT_TRUE(s->record(*e).ok());
  Completion done = s->record_completion();
  ASSERT_TRUE(other->wait(*e).ok());  // a second stream downstream of the failure
  ASSERT_TRUE(other->launch_host([&] { ran_downstream = true; }).ok());

  read.complete(IoError("pread 'r0.swp' offset 1048576 length 4096: Input/output error (EIO)"));
  const Status st = s->synchronize();
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.message().find("r0.swp"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("1048576"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("h3.attn"), std::string::npos) << st.message();  // the gate's label
  EXPECT_TRUE(ran_before);
  EXPECT_FALSE(ran_after);  // work after a failed gate never runs on missing data
  EXPECT_EQ(e->synchronize().code(), StatusCode::kIoError);
  EXPECT_EQ(done.wait().code(), StatusCode::kIoError);
  EXPECT_EQ(other->synchronize().code(), StatusCode::kIoError);
  EXPECT_FALSE(ran_downstream);
  EXPECT_EQ(s->synchronize().code(), StatusCode::kIoError);  // sticky
}

TEST_P(DeviceTest, RecordCompletionChainsHostCodeOntoStreamWork) {
  auto s = stream();
  Gate gate;
  ASSERT_TRUE(s->launch_host([&] { gate.wait(); }).ok());
  Completion c = s->record_completion();
  std::atomic<int> chained{0};
  c.then([&](const Status& st) { chained = st.ok() ? 1 : -1; });
  EXPECT_FALSE(c.done());
  EXPECT_EQ(chained.load(), 0);
  gate.open();
  ASSERT_TRUE(c.wait_for(kDeadlockGuard));
  // Callbacks run right after the outcome is published (waiters may wake
  // first), so give the completing thread a moment.
  const auto deadline = std::chrono::steady_clock::now() + kDeadlockGuard;
  while (chained.load() == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(chained.load(), 1);
  ASSERT_TRUE(s->synchronize().ok());
}

// Note [Borrowed streams]: a wait put through the wrapper holds the owner's
// own later work; destroying the wrapper leaves the owner's stream usable.
TEST_P(DeviceTest, ABorrowedStreamOrdersItsOwnersWorkAndStaysTheOwners) {
  auto owner = stream();
  auto borrowed = borrow_stream(*device_, owner->native_handle());
  if (is_cpu()) {
    ASSERT_FALSE(borrowed.ok());
    EXPECT_EQ(borrowed.status().code(), StatusCode::kUnsupported) << borrowed.status().to_string();
    EXPECT_NE(borrowed.status().message().find("order work against it on the host"), std::string::npos);
    return;
  }
  ASSERT_TRUE(borrowed.ok()) << borrowed.status().to_string();
  CompletionSource gate("the engine's gather");
  ASSERT_TRUE((*borrowed)->wait(gate.completion()).ok());
  auto after = event();
  ASSERT_TRUE(owner->record(*after).ok());  // the owner's own work, issued after the borrowed wait
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(after->query()) << "the owner's work ran before the wait put through the borrowed stream";
  gate.complete(Status::Ok());
  ASSERT_TRUE(after->synchronize().ok());
  Completion recorded = (*borrowed)->record_completion();
  ASSERT_TRUE(recorded.wait_for(kDeadlockGuard));
  borrowed->reset();  // the wrapper goes; the owner's stream stays
  DeviceBuffer buffer = alloc(64);
  std::vector<std::byte> host(64, std::byte{7});
  ASSERT_TRUE(owner->copy_async(buffer.data(), host.data(), host.size(), CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(owner->synchronize().ok());
}

TEST_P(DeviceTest, AnAlreadyFailedCompletionFailsTheStreamAtOnce) {
  auto s = stream();
  ASSERT_TRUE(s->wait(Completion::ready(DataLoss("checksum mismatch in tensor 7 extent 3"), "verify")).ok());
  EXPECT_EQ(s->synchronize().code(), StatusCode::kDataLoss);
  ASSERT_TRUE(s->wait(Completion()).ok());  // waiting on nothing is fine
}

TEST_P(DeviceTest, StreamWaitOnAnEventOfAnotherDeviceIsAnError) {
  DeviceOptions options;
  options.device_memory_bytes = 1u << 20;
  auto other_device = make_device("cpu", options);
  ASSERT_TRUE(other_device.ok());
  auto foreign = (*other_device)->create_event();
  ASSERT_TRUE(foreign.ok());
  auto s = stream();
  const Status st = s->wait(**foreign);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("another device"), std::string::npos);
}

TEST_P(DeviceTest, CpuDeviceRejectsHostPointersAsDevicePointers) {
  if (!is_cpu()) GTEST_SKIP() << "pointer checks are a cpu-device feature";
  auto s = stream();
  std::vector<uint8_t> host(100), other(100);
  Status st = s->copy_async(host.data(), other.data(), 100, CopyKind::kHostToDevice);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not inside a live device allocation"), std::string::npos) << st.message();
  DeviceBuffer d = alloc(100);
  EXPECT_EQ(s->copy_async(host.data(), d.data(), 101, CopyKind::kDeviceToHost).code(), StatusCode::kInvalidArgument)
      << "one byte past the end";
  EXPECT_EQ(s->memset_async(host.data(), 0, 10).code(), StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, ElapsedNeedsCompletedEvents) {
  auto a = event(), b = event();
  EXPECT_FALSE(device_->elapsed_ms(*a, *b).ok());
  auto s = stream();
  ASSERT_TRUE(s->record(*a).ok());
  ASSERT_TRUE(s->launch_host([] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }).ok());
  ASSERT_TRUE(s->record(*b).ok());
  ASSERT_TRUE(s->synchronize().ok());
  auto ms = device_->elapsed_ms(*a, *b);
  ASSERT_TRUE(ms.ok()) << ms.status().to_string();
  EXPECT_GT(*ms, 0.0);
}

std::string backend_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }
INSTANTIATE_TEST_SUITE_P(Backends, DeviceTest, ::testing::Values("cpu", "cuda"), backend_name);

// A backend that implements only the required Stream methods gets correct,
// synchronizing fallbacks for the optional ones.
class RequiredOnlyStream final : public Stream {
 public:
  RequiredOnlyStream(Device* device, std::unique_ptr<Stream> inner) : Stream(device), inner_(std::move(inner)) {}
  Status copy_async(void* d, const void* s, size_t n, CopyKind k) override { return inner_->copy_async(d, s, n, k); }
  Status launch_host(HostFn fn) override { return inner_->launch_host(std::move(fn)); }
  Status record(Event& e) override { return inner_->record(e); }
  Status synchronize() override { return inner_->synchronize(); }

 private:
  std::unique_ptr<Stream> inner_;
};

TEST(DeviceFallbacks, OptionalStreamMethodsFallBackBySynchronizing) {
  auto device = make_device("cpu");
  ASSERT_TRUE(device.ok());
  Device& dev = **device;
  auto inner = dev.create_stream();
  ASSERT_TRUE(inner.ok());
  RequiredOnlyStream s(&dev, std::move(inner).value());
  auto buf = dev.allocate(1000);
  ASSERT_TRUE(buf.ok());
  std::atomic<int> steps{0};
  ASSERT_TRUE(s.launch_host([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    steps = 1;
  }).ok());
  ASSERT_TRUE(s.memset_async(buf->data(), 9, 1000).ok());  // fallback synchronized first
  EXPECT_EQ(steps, 1);
  EXPECT_EQ(buf->as<uint8_t>()[999], 9);
  auto e = dev.create_event();
  ASSERT_TRUE(e.ok());
  auto other = dev.create_stream();
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE((*other)->launch_host([&] { steps = 2; }).ok());
  ASSERT_TRUE((*other)->record(**e).ok());
  ASSERT_TRUE(s.wait(**e).ok());  // fallback: the host waits for the event
  EXPECT_EQ(steps, 2);
  EXPECT_TRUE(s.query());
  const uint64_t before = dev.memory_in_use_bytes();
  ASSERT_TRUE(s.free_async(std::move(buf).value()).ok());
  EXPECT_EQ(dev.memory_in_use_bytes(), before - 1024);  // 1000 rounded to 256

  // Completions: the host waits for the gate and returns its Status;
  // record_completion synchronizes and carries the stream's Status.
  CompletionSource gate("slow producer");
  std::thread producer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    steps = 3;
    gate.complete(Status::Ok());
  });
  ASSERT_TRUE(s.wait(gate.completion()).ok());
  EXPECT_EQ(steps, 3);
  producer.join();
  EXPECT_EQ(s.wait(Completion::ready(IoError("read failed"), "read")).code(), StatusCode::kIoError);
  Completion done = s.record_completion();
  EXPECT_TRUE(done.done());
  EXPECT_TRUE(done.status().ok());
}

TEST(DeviceRegistry, ListsBackendsWithReasons) {
  auto backends = list_backends();
  ASSERT_EQ(backends.size(), 2u);
  EXPECT_EQ(backends[0].name, "cpu");
  EXPECT_TRUE(backends[0].available);
  EXPECT_EQ(backends[1].name, "cuda");
  EXPECT_FALSE(backends[1].reason.empty());
  if (!backends[1].available) {
    auto r = make_device("cuda");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(r.status().message().find(backends[1].reason), std::string::npos);
  }
}

TEST(DeviceRegistry, UnknownBackendAndBadOptions) {
  auto r = make_device("tpu");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("'tpu'"), std::string::npos);
  EXPECT_NE(r.status().message().find("cpu, cuda"), std::string::npos);
  DeviceOptions options;
  options.device_memory_bytes = 0;
  auto z = make_device("cpu", options);
  ASSERT_FALSE(z.ok());
  EXPECT_EQ(z.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(z.status().message().find("--device-memory"), std::string::npos);
}

}  // namespace
}  // namespace strata
