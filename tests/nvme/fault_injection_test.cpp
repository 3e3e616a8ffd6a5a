// Fault injection: every injected fault either is retried transparently
// (EAGAIN, EINTR, short transfers, latency) or surfaces as a Status with
// file, offset, length and errno (EIO, ENOSPC); torn writes and flipped bits
// are caught by the swap store's checksums. Each test prints its seed
// (replay with STRATA_TEST_SEED=<seed>).
#include <algorithm>
#include <chrono>
#include <cstring>

#include <gtest/gtest.h>

#include "nvme_test_util.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/testing/fault_injection.h"
#include "strata/nvme/swap_store.h"

namespace strata::nvme {
namespace {

using testing::bytes_equal;
using testing::ScratchDir;

class FaultInjection : public ::testing::TestWithParam<EngineKind> {
 protected:
  void SetUp() override {
    bool works = false;
    for (const EngineProbe& probe : probe_engines()) {
      if (probe.kind == GetParam()) works = probe.works;
    }
    if (!works) GTEST_SKIP() << engine_kind_name(GetParam()) << " does not work here";
    dir_ = std::make_unique<ScratchDir>(testing::disk_scratch_root());
    ASSERT_TRUE(dir_->ok());
  }
  IoEngineOptions options() const {
    IoEngineOptions o;
    o.engine = GetParam();
    o.block_size = 16 * 1024;
    o.queue_depth = 8;
    o.intra_op_parallelism = 2;
    o.max_retries = 1000;
    return o;
  }
  std::unique_ptr<ScratchDir> dir_;
};

TEST_P(FaultInjection, TransientShortAndLateCompletionsAreRetriedTransparently) {
  FaultPlan plan;
  plan.seed = testing::test_seed(20261130);
  plan.transient_probability = 0.15;
  plan.short_probability = 0.3;
  plan.latency_probability = 0.2;
  plan.latency_us_max = 300;
  std::shared_ptr<FaultCounters> counters;
  auto engine = make_fault_injecting_engine(options(), plan, &counters);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  auto file = (*engine)->open(dir_->file("faults.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  std::mt19937_64 rng(plan.seed);
  const uint64_t n = 1u << 20;
  auto src = AlignedBuffer::allocate(n + 4096, 4096);
  auto dst = AlignedBuffer::allocate(n + 4096, 4096);
  auto data = testing::random_bytes(rng, n);
  std::memcpy(src->data(), data.data(), n);
  ASSERT_TRUE((*engine)->write_sync(*file, 0, n, src->data()).ok()) << "seed " << plan.seed;
  // Unaligned pieces too (buffered path, byte-granular short transfers).
  ASSERT_TRUE((*engine)->write_sync(*file, n, 5000, src->data() + 7).ok()) << "seed " << plan.seed;
  ASSERT_TRUE((*engine)->read_sync(*file, 0, n, dst->data()).ok()) << "seed " << plan.seed;
  EXPECT_TRUE(bytes_equal(src->data(), dst->data(), n)) << "seed " << plan.seed;
  ASSERT_TRUE((*engine)->read_sync(*file, n, 5000, dst->data() + 3).ok()) << "seed " << plan.seed;
  EXPECT_TRUE(bytes_equal(src->data() + 7, dst->data() + 3, 5000)) << "seed " << plan.seed;
  EXPECT_GT(counters->transient.load(), 0u);
  EXPECT_GT(counters->short_transfers.load(), 0u);
  EXPECT_GT(counters->delayed.load(), 0u);
  IoEngineStats stats = (*engine)->stats();
  EXPECT_EQ(stats.transient_retries, counters->transient.load());
  EXPECT_GE(stats.short_resubmits, counters->short_transfers.load());
  EXPECT_EQ(stats.failed_requests, 0u);
}

// A hung device (FaultPlan::hang_ms): the I/O runs, its completion comes
// only hang_ms later, with the right data; the budget makes it one-off.
TEST_P(FaultInjection, AHangHoldsTheCompletionBack) {
  FaultPlan plan;
  plan.hang_ms = 300;
  plan.fault_writes = false;
  plan.max_hard_errors = 1;
  std::shared_ptr<FaultCounters> counters;
  auto engine = make_fault_injecting_engine(options(), plan, &counters);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  auto file = (*engine)->open(dir_->file("hang.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  const uint64_t n = 16 * 1024;
  auto src = AlignedBuffer::allocate(n, 4096);
  auto dst = AlignedBuffer::allocate(n, 4096);
  for (uint64_t i = 0; i < n; ++i) src->data()[i] = static_cast<std::byte>(i * 7);
  ASSERT_TRUE((*engine)->write_sync(*file, 0, n, src->data()).ok());
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE((*engine)->read_sync(*file, 0, n, dst->data()).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(300));
  EXPECT_TRUE(bytes_equal(src->data(), dst->data(), n));
  EXPECT_EQ(counters->hung.load(), 1u);
  ASSERT_TRUE((*engine)->read_sync(*file, 0, n, dst->data()).ok());  // the budget is spent: not held back
  EXPECT_EQ(counters->hung.load(), 1u);
}

TEST_P(FaultInjection, HardErrorsSurfaceWithFileOffsetLengthAndErrno) {
  FaultPlan plan;
  plan.seed = testing::test_seed(77);
  plan.eio_probability = 0.2;
  std::shared_ptr<FaultCounters> counters;
  auto engine = make_fault_injecting_engine(options(), plan, &counters);
  ASSERT_TRUE(engine.ok());
  std::string path = dir_->file("eio.bin");
  auto file = (*engine)->open(path, OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  auto buf = AlignedBuffer::allocate(64 * 1024, 4096);
  int failed = 0;
  for (int i = 0; i < 40; ++i) {
    Status st = (*engine)->write_sync(*file, static_cast<uint64_t>(i) * 65536, 65536, buf->data());
    if (st.ok()) continue;
    ++failed;
    EXPECT_EQ(st.code(), StatusCode::kIoError) << st.to_string();
    EXPECT_NE(st.message().find(path), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("offset"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("length"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("errno 5"), std::string::npos) << st.message();
  }
  EXPECT_GT(failed, 0) << "seed " << plan.seed;
  EXPECT_GT(counters->eio.load(), 0u);
  EXPECT_EQ((*engine)->stats().failed_requests, static_cast<uint64_t>(failed));
}

TEST_P(FaultInjection, EnospcSurfacesAsResourceExhausted) {
  FaultPlan plan;
  plan.seed = testing::test_seed(5);
  plan.enospc_probability = 1.0;
  auto engine = make_fault_injecting_engine(options(), plan);
  ASSERT_TRUE(engine.ok());
  auto file = (*engine)->open(dir_->file("full.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  auto buf = AlignedBuffer::allocate(8192, 4096);
  Status st = (*engine)->write_sync(*file, 0, 8192, buf->data());
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.to_string();
  EXPECT_NE(st.message().find("disk full"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("full.bin"), std::string::npos) << st.message();
  // Reads are unaffected by ENOSPC.
  EXPECT_TRUE((*engine)->read_sync(*file, 0, 0, buf->data()).ok());
}

TEST_P(FaultInjection, PersistentTransientErrorGivesUpWithContext) {
  FaultPlan plan;
  plan.seed = testing::test_seed(9);
  plan.transient_probability = 1.0;
  IoEngineOptions o = options();
  o.max_retries = 5;
  auto engine = make_fault_injecting_engine(o, plan);
  ASSERT_TRUE(engine.ok());
  auto file = (*engine)->open(dir_->file("busy.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  auto buf = AlignedBuffer::allocate(4096, 4096);
  Status st = (*engine)->write_sync(*file, 0, 4096, buf->data());
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("retries"), std::string::npos) << st.message();
  EXPECT_TRUE(st.retryable()) << st.to_string();
}

// Torn writes and flipped bits must never come back as good data.
TEST_P(FaultInjection, TornWritesAndCorruptReadsAreCaughtByChecksums) {
  FaultPlan plan;
  plan.seed = testing::test_seed(4242);
  plan.torn_write_probability = 0.05;
  plan.corrupt_read_probability = 0.03;
  plan.short_probability = 0.1;
  std::shared_ptr<FaultCounters> counters;
  auto engine = make_fault_injecting_engine(options(), plan, &counters);
  ASSERT_TRUE(engine.ok());
  SwapStoreOptions so;
  so.paths = {dir_->path()};
  so.job = "faults";
  so.capacity_bytes = 8u << 20;
  // Without write read-back, a torn write flips the index and must be caught
  // when the tensor is read (ShadowWrite* below cover the read-back).
  so.verify_writes = false;
  auto store = SwapStore::open(so, **engine);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  std::mt19937_64 rng(plan.seed);
  constexpr int kTensors = 24;
  std::vector<std::vector<std::byte>> tensors;
  std::vector<AlignedBuffer> buffers;
  for (int i = 0; i < kTensors; ++i) {
    uint64_t bytes = 4096 * (4 + rng() % 40) + (i % 3 == 0 ? 100 : 0);
    tensors.push_back(testing::random_bytes(rng, bytes));
    auto b = AlignedBuffer::allocate(bytes, 4096);
    ASSERT_TRUE(b.ok());
    std::memcpy(b->data(), tensors.back().data(), bytes);
    buffers.push_back(std::move(b).value());
    ASSERT_TRUE((*store)->write_sync(static_cast<TensorId>(i), buffers.back().data(), bytes).ok());
  }
  int caught = 0;
  for (int i = 0; i < kTensors; ++i) {
    uint64_t bytes = tensors[i].size();
    std::memset(buffers[i].data(), 0, bytes);
    Status st = (*store)->read_sync(static_cast<TensorId>(i), buffers[i].data(), bytes);
    if (st.ok()) {
      EXPECT_TRUE(bytes_equal(tensors[i].data(), buffers[i].data(), bytes))
          << "tensor " << i << " came back wrong with an ok status; seed " << plan.seed;
    } else {
      ++caught;
      EXPECT_TRUE(st.is_data_loss()) << st.to_string();
      EXPECT_NE(st.message().find("tensor " + std::to_string(i)), std::string::npos) << st.message();
      EXPECT_NE(st.message().find("stored xxh3"), std::string::npos) << st.message();
    }
  }
  uint64_t injected = counters->torn_writes.load() + counters->corrupt_reads.load();
  EXPECT_GT(injected, 0u) << "seed " << plan.seed << " injected nothing; raise the probabilities";
  EXPECT_GT(caught, 0) << "seed " << plan.seed;
  EXPECT_LE(static_cast<uint64_t>(caught), injected);
  EXPECT_EQ((*store)->stats().verify_failures, static_cast<uint64_t>(caught));
}

// Shadow writes: a write that fails or tears in the middle leaves the
// previous version intact, bit for bit, and the error names the tensor.
class ShadowWriteFaults : public FaultInjection {
 protected:
  // A store on an engine whose writes fail per `plan` once armed (reads are clean).
  void open_store(FaultPlan plan, const std::string& job, uint64_t bytes = 256 * 1024) {
    bytes_ = bytes;
    plan.fault_reads = false;
    auto engine = make_fault_injecting_engine(options(), plan, &counters_);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    engine_ = std::move(engine).value();
    counters_->disarm();
    SwapStoreOptions so;
    so.paths = {dir_->path()};
    so.job = job;
    so.capacity_bytes = std::max<uint64_t>(4u << 20, 3 * bytes_);
    so.stripe_bytes = 64 * 1024;
    so.checksum_block_bytes = 16 * 1024;
    auto store = SwapStore::open(so, *engine_);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    store_ = std::move(store).value();
    std::mt19937_64 rng(plan.seed);
    old_ = testing::random_bytes(rng, bytes_);
    fresh_ = testing::random_bytes(rng, bytes_);
    ASSERT_TRUE(store_->write_sync(3, old_.data(), bytes_).ok());
    used_ = store_->stats().bytes_used;
  }
  // The previous version reads back bit for bit, whole and as a range, and
  // the failed write's shadow extent went back to the allocator.
  void expect_old_version_intact() {
    counters_->disarm();
    EXPECT_EQ(store_->stats().bytes_used, used_);
    std::vector<std::byte> out(bytes_);
    ASSERT_TRUE(store_->read_sync(3, out.data(), bytes_).ok());
    EXPECT_TRUE(bytes_equal(old_.data(), out.data(), bytes_));
    std::vector<std::byte> tile(64 * 1024);
    ASSERT_TRUE(store_->read_range(3, 64 * 1024, tile)->wait().ok());
    EXPECT_TRUE(bytes_equal(old_.data() + 64 * 1024, tile.data(), tile.size()));
    // And the store still takes writes.
    ASSERT_TRUE(store_->write_sync(3, fresh_.data(), bytes_).ok());
    ASSERT_TRUE(store_->read_sync(3, out.data(), bytes_).ok());
    EXPECT_TRUE(bytes_equal(fresh_.data(), out.data(), bytes_));
  }
  static constexpr uint64_t kBytes = 256 * 1024;  // 16 engine pieces of 16 KiB
  uint64_t bytes_ = kBytes;
  std::shared_ptr<FaultCounters> counters_;
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<SwapStore> store_;
  std::vector<std::byte> old_, fresh_;
  uint64_t used_ = 0;
};

TEST_P(ShadowWriteFaults, EioMidWriteKeepsThePreviousVersion) {
  FaultPlan plan;
  plan.seed = testing::test_seed(31);
  plan.eio_probability = 1.0;
  ASSERT_NO_FATAL_FAILURE(open_store(plan, "eio-shadow"));
  counters_->arm(/*clean_pieces=*/5);  // five pieces land, then EIO
  Status st = store_->write_sync(3, fresh_.data(), kBytes);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kIoError) << st.to_string();
  EXPECT_NE(st.message().find("tensor 3"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("previous version is intact"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("swap.bin offset"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("errno 5"), std::string::npos) << st.message();
  EXPECT_GT(counters_->eio.load(), 0u);
  ASSERT_NO_FATAL_FAILURE(expect_old_version_intact());
  // A range write failing mid-way keeps the old tile too.
  counters_->arm(2);
  std::vector<std::byte> patch(128 * 1024, std::byte{0x5A});
  Status range = store_->write_range(3, 0, patch)->wait();
  EXPECT_EQ(range.code(), StatusCode::kIoError) << range.to_string();
  EXPECT_NE(range.message().find("tensor 3 range [0, +131072)"), std::string::npos) << range.message();
  counters_->disarm();
  std::vector<std::byte> out(kBytes);
  ASSERT_TRUE(store_->read_sync(3, out.data(), kBytes).ok());
  EXPECT_TRUE(bytes_equal(fresh_.data(), out.data(), kBytes));
}

TEST_P(ShadowWriteFaults, TornWriteMidWriteIsCaughtBeforeTheFlip) {
  FaultPlan plan;
  plan.seed = testing::test_seed(32);
  plan.torn_write_probability = 1.0;
  ASSERT_NO_FATAL_FAILURE(open_store(plan, "torn-shadow"));
  counters_->arm(/*clean_pieces=*/5);  // five pieces land whole, then every piece tears
  Status st = store_->write_sync(3, fresh_.data(), kBytes);
  ASSERT_FALSE(st.ok()) << "a torn write flipped the index";
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.to_string();
  EXPECT_NE(st.message().find("tensor 3"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("did not verify"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("torn"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("previous version of tensor 3 is intact"), std::string::npos) << st.message();
  EXPECT_GT(counters_->torn_writes.load(), 0u);
  EXPECT_EQ(store_->stats().write_verify_failures, 1u);
  ASSERT_NO_FATAL_FAILURE(expect_old_version_intact());
}

// A large write is written and read back chunk by chunk (8 MiB chunks, two
// read-back buffers); a tear in a late chunk still stops the flip.
TEST_P(ShadowWriteFaults, TornWriteInALateChunkOfALargeTensor) {
  FaultPlan plan;
  plan.seed = testing::test_seed(33);
  plan.torn_write_probability = 1.0;
  const uint64_t bytes = (20u << 20) + 4096;  // 3 chunks
  ASSERT_NO_FATAL_FAILURE(open_store(plan, "torn-large", bytes));
  counters_->arm(/*clean_pieces=*/1100);  // of 1281 pieces of 16 KiB: the tear lands in the last chunk
  Status st = store_->write_sync(3, fresh_.data(), bytes);
  ASSERT_EQ(st.code(), StatusCode::kDataLoss) << st.to_string();
  EXPECT_NE(st.message().find("did not verify at block"), std::string::npos) << st.message();
  EXPECT_GT(counters_->torn_writes.load(), 0u);
  EXPECT_GE(store_->stats().bytes_read_back, 2 * bytes - (1u << 20));
  ASSERT_NO_FATAL_FAILURE(expect_old_version_intact());
}

INSTANTIATE_TEST_SUITE_P(AllEngines, ShadowWriteFaults,
                         ::testing::Values(EngineKind::kIoUring, EngineKind::kLibaio, EngineKind::kPsync),
                         [](const ::testing::TestParamInfo<EngineKind>& info) {
                           std::string name(engine_kind_name(info.param));
                           name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
                           return name;
                         });

INSTANTIATE_TEST_SUITE_P(AllEngines, FaultInjection,
                         ::testing::Values(EngineKind::kIoUring, EngineKind::kLibaio, EngineKind::kPsync),
                         [](const ::testing::TestParamInfo<EngineKind>& info) {
                           std::string name(engine_kind_name(info.param));
                           name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
                           return name;
                         });

}  // namespace

// STRATA_FAULTS text: every key, defaults kept, bad keys and values named.
TEST(FaultPlanText, ParsesEveryKeyAndNamesTheBadOne) {
  Result<FaultPlan> p = parse_fault_plan("eio=1,enospc=0.5,transient=0.25,short=0.125,torn=0.5,corrupt=0.75,"
                                         "reads=0,writes=1,after=20,count=1,hang=250,seed=7");
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->eio_probability, 1.0);
  EXPECT_EQ(p->enospc_probability, 0.5);
  EXPECT_EQ(p->transient_probability, 0.25);
  EXPECT_EQ(p->short_probability, 0.125);
  EXPECT_EQ(p->torn_write_probability, 0.5);
  EXPECT_EQ(p->corrupt_read_probability, 0.75);
  EXPECT_FALSE(p->fault_reads);
  EXPECT_TRUE(p->fault_writes);
  EXPECT_EQ(p->clean_pieces, 20u);
  EXPECT_EQ(p->max_hard_errors, 1);
  EXPECT_EQ(p->hang_ms, 250u);
  EXPECT_EQ(p->seed, 7u);
  Result<FaultPlan> empty = parse_fault_plan("");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->eio_probability, 0.0);
  EXPECT_EQ(empty->max_hard_errors, -1);
  for (const char* bad : {"eio=2", "eio=-0.1", "eio=", "eio", "reads=2", "after=-1", "count=x", "seed=1e3",
                          "bogus=1", "eio=nan", "after=99999999999999999999", "hang=-1", "hang=3600001"}) {
    Result<FaultPlan> b = parse_fault_plan(bad);
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(b.status().message().find("STRATA_FAULTS"), std::string::npos) << b.status().message();
    const std::string key = std::string(bad).substr(0, std::string(bad).find('='));
    EXPECT_NE(b.status().message().find(key + " '"), std::string::npos) << b.status().message();
  }
  // Control characters are escaped in the message.
  Result<FaultPlan> ctl = parse_fault_plan("eio=\x1b[31m");
  ASSERT_FALSE(ctl.ok());
  EXPECT_EQ(ctl.status().message().find('\x1b'), std::string::npos);
}

// A budget of hard errors: the first `count` faults, then clean I/O.
TEST(FaultPlanText, HardErrorBudgetIsSpentOnce) {
  FaultCounters c;
  c.arm(0, 2);
  EXPECT_TRUE(c.spend_hard_error());
  EXPECT_TRUE(c.spend_hard_error());
  EXPECT_FALSE(c.spend_hard_error());
  c.arm(0, -1);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(c.spend_hard_error());
}

}  // namespace strata::nvme
