// SwapStore for pipelines: range reads and writes of part of a tensor,
// per-block checksums, shadow writes (flip only after the write verified,
// space reused after flips), completions that carry the Status without a
// waiter, the versioned index.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include "nvme_test_util.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/testing/fault_injection.h"
#include "strata/nvme/swap_store.h"

namespace strata::nvme {
namespace {

using testing::bytes_equal;
using testing::ScratchDir;

constexpr uint64_t kBlock = 16 * 1024;  // checksum block in these tests

class SwapRangeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<ScratchDir>(testing::disk_scratch_root());
    ASSERT_TRUE(dir_->ok());
    IoEngineOptions o;
    o.block_size = 64 * 1024;
    o.queue_depth = 8;
    o.intra_op_parallelism = 2;
    auto engine = make_io_engine(o);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    engine_ = std::move(engine).value();
  }
  SwapStoreOptions options(const std::string& job) const {
    SwapStoreOptions so;
    so.paths = {dir_->path()};
    so.job = job;
    so.capacity_bytes = 4u << 20;
    so.stripe_bytes = 64 * 1024;
    so.index_bytes = 64 * 1024;
    so.checksum_block_bytes = kBlock;
    return so;
  }
  std::string swap_file(const std::string& job) const { return swap_folder_path(dir_->path(), job, 0) + "/swap.bin"; }
  // Flips one byte of the data address `address` behind the store's back.
  void corrupt(const std::string& job, const SwapStoreOptions& so, uint64_t address) {
    int fd = ::open(swap_file(job).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    off_t where = static_cast<off_t>(so.index_bytes + address);
    unsigned char byte = 0;
    ASSERT_EQ(pread(fd, &byte, 1, where), 1);
    byte ^= 0x10;
    ASSERT_EQ(pwrite(fd, &byte, 1, where), 1);
    fsync(fd);
    ::close(fd);
  }
  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<IoEngine> engine_;
};

TEST_F(SwapRangeTest, RangeReadsAndCopyOnWriteRangeWritesRoundTrip) {
  auto store = SwapStore::open(options("range"), *engine_);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_EQ((*store)->checksum_block_bytes(), kBlock);
  std::mt19937_64 rng(21);
  const uint64_t bytes = 16 * kBlock + 100;  // a partial last block
  std::vector<std::byte> expect = testing::random_bytes(rng, bytes);
  ASSERT_TRUE((*store)->write_sync(7, expect.data(), bytes).ok());

  // A tile in the middle, into an unaligned buffer (buffered I/O for it).
  std::vector<std::byte> tile(3 * kBlock + 1);
  auto r = (*store)->read_range(7, 2 * kBlock, std::span<std::byte>(tile.data() + 1, 3 * kBlock));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(r->wait().ok());
  EXPECT_TRUE(bytes_equal(expect.data() + 2 * kBlock, tile.data() + 1, 3 * kBlock));

  // Rewrite blocks [5, 9) and the tail block; each is a shadow write of its blocks.
  std::vector<std::byte> patch = testing::random_bytes(rng, 4 * kBlock);
  ASSERT_TRUE((*store)->write_range(7, 5 * kBlock, patch)->wait().ok());
  std::memcpy(expect.data() + 5 * kBlock, patch.data(), patch.size());
  std::vector<std::byte> tail = testing::random_bytes(rng, kBlock + 100);
  ASSERT_TRUE((*store)->write_range(7, 15 * kBlock, tail)->wait().ok());
  std::memcpy(expect.data() + 15 * kBlock, tail.data(), tail.size());
  auto runs = (*store)->runs_of(7);
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ(runs->size(), 4u);  // [0,5) [5,9) [9,15) [15,end)
  EXPECT_EQ((*store)->extent_of(7).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*store)->stats().flips, 3u);

  std::vector<std::byte> whole(bytes);
  ASSERT_TRUE((*store)->read_sync(7, whole.data(), bytes).ok());
  EXPECT_TRUE(bytes_equal(expect.data(), whole.data(), bytes));
  // A range across the run boundaries.
  std::vector<std::byte> across(8 * kBlock);
  ASSERT_TRUE((*store)->read_range(7, 4 * kBlock, across)->wait().ok());
  EXPECT_TRUE(bytes_equal(expect.data() + 4 * kBlock, across.data(), across.size()));
  // The space of the replaced blocks went back: one tensor's worth is in use.
  uint64_t granule = 4096;
  EXPECT_EQ((*store)->stats().bytes_used, (bytes + granule - 1) / granule * granule);
  EXPECT_TRUE((*store)->verify_all().ok());
}

TEST_F(SwapRangeTest, BadRangesAreRejectedWithTheirNumbers) {
  auto store = SwapStore::open(options("badrange"), *engine_);
  ASSERT_TRUE(store.ok());
  const uint64_t bytes = 16 * kBlock + 100;
  std::vector<std::byte> data(bytes, std::byte{1});
  ASSERT_TRUE((*store)->write_sync(3, data.data(), bytes).ok());
  std::vector<std::byte> buf(2 * kBlock);

  auto past = (*store)->read_range(3, 16 * kBlock, buf);  // 200 bytes would be left, 32 KiB asked
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = past.status().message();
  EXPECT_NE(m.find("tensor 3"), std::string::npos) << m;
  EXPECT_NE(m.find("offset " + std::to_string(16 * kBlock)), std::string::npos) << m;
  EXPECT_NE(m.find("length " + std::to_string(2 * kBlock)), std::string::npos) << m;
  EXPECT_NE(m.find("size is " + std::to_string(bytes)), std::string::npos) << m;
  auto past_write = (*store)->write_range(3, 20 * kBlock, std::span<const std::byte>(buf));
  ASSERT_FALSE(past_write.ok());
  EXPECT_NE(past_write.status().message().find("past the tensor's end"), std::string::npos);

  auto unaligned = (*store)->read_range(3, 100, buf);
  EXPECT_EQ(unaligned.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unaligned.status().message().find("checksum block"), std::string::npos) << unaligned.status().message();
  auto short_len = (*store)->write_range(3, kBlock, std::span<const std::byte>(buf.data(), 5000));
  EXPECT_EQ(short_len.status().code(), StatusCode::kInvalidArgument);
  auto empty = (*store)->read_range(3, 0, std::span<std::byte>());
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*store)->read_range(99, 0, buf).status().code(), StatusCode::kNotFound);
  auto missing = (*store)->write_range(99, 0, std::span<const std::byte>(buf));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("write the whole tensor first"), std::string::npos);
  // Nothing was left in flight or allocated by the refusals.
  EXPECT_EQ((*store)->stats().flips, 1u);
  EXPECT_TRUE((*store)->close().ok());
}

// A range read hashes only its own blocks: a corrupt block elsewhere does
// not fail it, and a range over the corrupt block names that block.
TEST_F(SwapRangeTest, RangeReadsVerifyTheirBlocksOnly) {
  SwapStoreOptions so = options("blocks");
  auto store = SwapStore::open(so, *engine_);
  ASSERT_TRUE(store.ok());
  std::mt19937_64 rng(22);
  const uint64_t bytes = 32 * kBlock;
  std::vector<std::byte> data = testing::random_bytes(rng, bytes);
  ASSERT_TRUE((*store)->write_sync(5, data.data(), bytes).ok());
  Extent e = *(*store)->extent_of(5);
  corrupt("blocks", so, e.offset + 20 * kBlock + 77);

  uint64_t read_before = (*store)->stats().bytes_read;
  std::vector<std::byte> tile(4 * kBlock);
  ASSERT_TRUE((*store)->read_range(5, 8 * kBlock, tile)->wait().ok());
  EXPECT_TRUE(bytes_equal(data.data() + 8 * kBlock, tile.data(), tile.size()));
  EXPECT_EQ((*store)->stats().bytes_read - read_before, tile.size());  // not the whole tensor

  Status st = (*store)->read_range(5, 18 * kBlock, tile)->wait();
  ASSERT_EQ(st.code(), StatusCode::kDataLoss) << st.to_string();
  EXPECT_NE(st.message().find("tensor 5 block 20"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("extent [" + std::to_string(e.offset)), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("stored xxh3"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(swap_file("blocks")), std::string::npos) << st.message();
  EXPECT_EQ((*store)->stats().verify_failures, 1u);
}

// The completion completes with the verified Status with nobody waiting:
// hashing runs on the store's verify threads, not on a waiter.
TEST_F(SwapRangeTest, CompletionCarriesTheVerifiedStatusWithoutAWaiter) {
  SwapStoreOptions so = options("nowait");
  auto store = SwapStore::open(so, *engine_);
  ASSERT_TRUE(store.ok());
  std::mt19937_64 rng(23);
  const uint64_t bytes = 8 * kBlock;
  std::vector<std::byte> data = testing::random_bytes(rng, bytes);
  ASSERT_TRUE((*store)->write_sync(1, data.data(), bytes).ok());
  ASSERT_TRUE((*store)->write_sync(2, data.data(), bytes).ok());
  corrupt("nowait", so, (*store)->extent_of(2)->offset + 3 * kBlock);

  std::vector<std::byte> out1(bytes), out2(bytes);
  auto good = (*store)->read(1, out1.data(), bytes);
  auto bad = (*store)->read(2, out2.data(), bytes);
  ASSERT_TRUE(good.ok() && bad.ok());
  EXPECT_NE(bad->completion().label().find("swap read of tensor 2"), std::string::npos);
  std::mutex mu;
  std::vector<Status> seen;
  std::vector<std::thread::id> threads;
  for (const SwapHandle* h : {&*good, &*bad}) {
    h->completion().then([&](const Status& s) {
      std::lock_guard<std::mutex> lock(mu);
      seen.push_back(s);
      threads.push_back(std::this_thread::get_id());
    });
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!(good->done() && bad->done()) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(good->done() && bad->done()) << "no completion without a waiter";
  EXPECT_TRUE(good->completion().status().ok()) << good->completion().status().to_string();
  EXPECT_EQ(bad->completion().status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad->completion().status().message().find("block 3"), std::string::npos);
  EXPECT_TRUE(bytes_equal(data.data(), out1.data(), bytes));
  // done() turns true before the callbacks run (waiters wake first): give
  // the completing thread until the deadline to run them.
  auto callbacks_ran = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return seen.size() == 2;
  };
  while (!callbacks_ran() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_GT((*store)->stats().checksum_ns, 0u);
}

// Shadow writes reuse the space they free: 100 rewrites (whole and range)
// leave the used bytes, the file size and the free-list shape unchanged.
TEST_F(SwapRangeTest, ExtentsAreReusedAcrossHundredRewrites) {
  auto store = SwapStore::open(options("reuse"), *engine_);
  ASSERT_TRUE(store.ok());
  std::mt19937_64 rng(24);
  const uint64_t bytes = 24 * kBlock + 512;
  std::vector<std::byte> data = testing::random_bytes(rng, bytes);
  std::vector<std::byte> other = testing::random_bytes(rng, 10 * kBlock);
  ASSERT_TRUE((*store)->write_sync(1, data.data(), bytes).ok());
  ASSERT_TRUE((*store)->write_sync(2, other.data(), other.size()).ok());
  const SwapStats start = (*store)->stats();
  struct stat st0 {};
  ASSERT_EQ(::stat(swap_file("reuse").c_str(), &st0), 0);
  size_t max_runs = 0;
  for (int i = 0; i < 100; ++i) {
    if (i % 3 == 0) {
      data = testing::random_bytes(rng, bytes);
      ASSERT_TRUE((*store)->write_sync(1, data.data(), bytes).ok()) << "rewrite " << i;
    } else {
      uint64_t first = rng() % 24, count = 1 + rng() % (24 - first);
      std::vector<std::byte> patch = testing::random_bytes(rng, count * kBlock);
      ASSERT_TRUE((*store)->write_range(1, first * kBlock, patch)->wait().ok()) << "range rewrite " << i;
      std::memcpy(data.data() + first * kBlock, patch.data(), patch.size());
    }
    max_runs = std::max(max_runs, (*store)->runs_of(1)->size());
    EXPECT_EQ((*store)->stats().bytes_used, start.bytes_used) << "rewrite " << i;
  }
  EXPECT_GT(max_runs, 1u);
  EXPECT_EQ((*store)->stats().flips, start.flips + 100);
  struct stat st1 {};
  ASSERT_EQ(::stat(swap_file("reuse").c_str(), &st1), 0);
  EXPECT_EQ(st1.st_size, st0.st_size);
  std::vector<std::byte> out(bytes);
  ASSERT_TRUE((*store)->read_sync(1, out.data(), bytes).ok());
  EXPECT_TRUE(bytes_equal(data.data(), out.data(), bytes));
  std::vector<std::byte> out2(other.size());
  ASSERT_TRUE((*store)->read_sync(2, out2.data(), out2.size()).ok());
  EXPECT_TRUE(bytes_equal(other.data(), out2.data(), other.size()));
}

TEST_F(SwapRangeTest, NoRoomForTheShadowSaysWhatIsNeeded) {
  SwapStoreOptions so = options("tight");
  so.capacity_bytes = 1u << 20;
  auto store = SwapStore::open(so, *engine_);
  ASSERT_TRUE(store.ok());
  std::mt19937_64 rng(25);
  std::vector<std::byte> v1 = testing::random_bytes(rng, 640 * 1024);
  ASSERT_TRUE((*store)->write_sync(9, v1.data(), v1.size()).ok());
  std::vector<std::byte> v2 = testing::random_bytes(rng, v1.size());
  auto w = (*store)->write(9, v2.data(), v2.size());
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kResourceExhausted);
  const std::string& m = w.status().message();
  EXPECT_NE(m.find("tensor 9"), std::string::npos) << m;
  EXPECT_NE(m.find("swap store of job 'tight'"), std::string::npos) << m;
  EXPECT_NE(m.find("640.00 KiB needed"), std::string::npos) << m;
  EXPECT_NE(m.find("384.00 KiB free"), std::string::npos) << m;
  EXPECT_NE(m.find("one shadow per in-flight write"), std::string::npos) << m;
  EXPECT_NE(m.find("capacity_bytes"), std::string::npos) << m;
  // A range rewrite that fits still works, and the old bytes are intact.
  std::vector<std::byte> patch = testing::random_bytes(rng, 4 * kBlock);
  ASSERT_TRUE((*store)->write_range(9, 0, patch)->wait().ok());
  std::memcpy(v1.data(), patch.data(), patch.size());
  std::vector<std::byte> out(v1.size());
  ASSERT_TRUE((*store)->read_sync(9, out.data(), out.size()).ok());
  EXPECT_TRUE(bytes_equal(v1.data(), out.data(), out.size()));
}

// Writes may not overlap other in-flight operations on the same bytes;
// disjoint tiles of one tensor and overlapping reads may run together.
TEST_F(SwapRangeTest, OverlappingWriteInFlightIsRefused) {
  // No faults: one write piece of w1 is held back (it runs; its completion
  // comes 2 s late), so w1 is in flight while the clash is tried.
  FaultPlan plan;
  plan.hang_ms = 2000;
  plan.fault_reads = false;
  IoEngineOptions o;
  o.block_size = 64 * 1024;
  std::shared_ptr<FaultCounters> counters;
  auto slow = make_fault_injecting_engine(o, plan, &counters);
  ASSERT_TRUE(slow.ok());
  counters->disarm();
  auto store = SwapStore::open(options("overlap"), **slow);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  std::mt19937_64 rng(26);
  std::vector<std::byte> data = testing::random_bytes(rng, 16 * kBlock);
  ASSERT_TRUE((*store)->write_sync(4, data.data(), data.size()).ok());
  std::vector<std::byte> a = testing::random_bytes(rng, 4 * kBlock), b = testing::random_bytes(rng, 4 * kBlock);
  std::vector<std::byte> r1(4 * kBlock), r2(4 * kBlock);
  counters->arm(0, 1);  // w1's first piece
  auto w1 = (*store)->write_range(4, 0, a);
  ASSERT_TRUE(w1.ok());
  auto w2 = (*store)->write_range(4, 8 * kBlock, b);  // disjoint: fine
  ASSERT_TRUE(w2.ok()) << w2.status().to_string();
  auto q1 = (*store)->read_range(4, 12 * kBlock, r1);
  auto q2 = (*store)->read_range(4, 12 * kBlock, r2);  // reads of the same bytes: fine
  ASSERT_TRUE(q1.ok() && q2.ok());
  ASSERT_FALSE(w1->done());
  auto clash = (*store)->write_range(4, 2 * kBlock, a);
  ASSERT_FALSE(clash.ok());
  EXPECT_EQ(clash.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(clash.status().message().find("in-flight write of [0, +" + std::to_string(4 * kBlock) + ")"),
            std::string::npos)
      << clash.status().message();
  auto whole = (*store)->write(4, data.data(), data.size());
  EXPECT_EQ(whole.status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(w1->wait().ok());
  ASSERT_TRUE(w2->wait().ok());
  ASSERT_TRUE(q1->wait().ok() && q2->wait().ok());
  EXPECT_TRUE(bytes_equal(data.data() + 12 * kBlock, r1.data(), r1.size()));
  EXPECT_TRUE(bytes_equal(data.data() + 12 * kBlock, r2.data(), r2.size()));
  EXPECT_TRUE((*store)->close().ok());
}

TEST_F(SwapRangeTest, ReopenKeepsRunsAndBlockChecksums) {
  SwapStoreOptions so = options("keep");
  so.keep_files = true;
  std::mt19937_64 rng(27);
  std::vector<std::byte> data = testing::random_bytes(rng, 12 * kBlock + 7);
  std::vector<SwapRun> runs;
  {
    auto store = SwapStore::open(so, *engine_);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->write_sync(11, data.data(), data.size()).ok());
    std::vector<std::byte> patch = testing::random_bytes(rng, 2 * kBlock);
    ASSERT_TRUE((*store)->write_range(11, 4 * kBlock, patch)->wait().ok());
    std::memcpy(data.data() + 4 * kBlock, patch.data(), patch.size());
    runs = *(*store)->runs_of(11);
    ASSERT_TRUE((*store)->close().ok());
  }
  SwapStoreOptions again = so;
  again.open_existing = true;
  again.capacity_bytes = 0;
  again.keep_files = false;
  again.checksum_block_bytes = 64 * 1024;  // the kept store's block size wins
  auto store = SwapStore::open(again, *engine_);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_EQ((*store)->checksum_block_bytes(), kBlock);
  EXPECT_EQ(*(*store)->runs_of(11), runs);
  std::vector<std::byte> tile(2 * kBlock);
  ASSERT_TRUE((*store)->read_range(11, 4 * kBlock, tile)->wait().ok());
  EXPECT_TRUE(bytes_equal(data.data() + 4 * kBlock, tile.data(), tile.size()));
  std::vector<std::byte> whole(data.size());
  ASSERT_TRUE((*store)->read_sync(11, whole.data(), whole.size()).ok());
  EXPECT_TRUE(bytes_equal(data.data(), whole.data(), whole.size()));
}

TEST_F(SwapRangeTest, OlderIndexFormatIsRefusedWithTheFix) {
  SwapStoreOptions so = options("old");
  so.keep_files = true;
  {
    auto store = SwapStore::open(so, *engine_);
    ASSERT_TRUE(store.ok());
    std::vector<std::byte> data(8192, std::byte{3});
    ASSERT_TRUE((*store)->write_sync(1, data.data(), data.size()).ok());
    ASSERT_TRUE((*store)->close().ok());
  }
  // Stamp format version 1 (the per-extent checksum index) over the header.
  int fd = ::open(swap_file("old").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint32_t v1 = 1;
  ASSERT_EQ(pwrite(fd, &v1, sizeof(v1), 8), static_cast<ssize_t>(sizeof(v1)));
  ::close(fd);
  SwapStoreOptions again = so;
  again.open_existing = true;
  auto store = SwapStore::open(again, *engine_);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kUnsupported);
  const std::string& m = store.status().message();
  EXPECT_NE(m.find("format version 1"), std::string::npos) << m;
  EXPECT_NE(m.find("reads version 2"), std::string::npos) << m;
  EXPECT_NE(m.find("strata swap clean"), std::string::npos) << m;
  EXPECT_NE(m.find(swap_file("old")), std::string::npos) << m;
}

TEST_F(SwapRangeTest, BadChecksumOptionsAreRejected) {
  SwapStoreOptions so = options("opts");
  so.checksum_block_bytes = 1000;
  EXPECT_NE(SwapStore::open(so, *engine_).status().message().find("checksum_block_bytes 1000"), std::string::npos);
  so.checksum_block_bytes = 16u << 20;
  EXPECT_EQ(SwapStore::open(so, *engine_).status().code(), StatusCode::kInvalidArgument);
  so = options("opts");
  so.verify_threads = 0;
  EXPECT_NE(SwapStore::open(so, *engine_).status().message().find("verify_threads"), std::string::npos);
  so = options("opts");
  so.index_bytes = 100;
  EXPECT_NE(SwapStore::open(so, *engine_).status().message().find("index_bytes 100"), std::string::npos);
}

// With index_bytes 0 the index is sized from the capacity; a too small
// explicit index says so when it fills up.
TEST_F(SwapRangeTest, IndexSizeFollowsCapacityAndFullIndexIsNamed) {
  SwapStoreOptions so = options("index");
  so.index_bytes = 0;
  so.capacity_bytes = 64u << 20;
  auto store = SwapStore::open(so, *engine_);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_GE((*store)->options().index_bytes, (64u << 20) / kBlock * 8);
  ASSERT_TRUE((*store)->close().ok());

  SwapStoreOptions small = options("index2");
  small.index_bytes = 8192;  // 4 KiB of table: 42 records of 4-block tensors
  auto tiny = SwapStore::open(small, *engine_);
  ASSERT_TRUE(tiny.ok());
  std::vector<std::byte> data(4 * kBlock, std::byte{1});
  Status last;
  for (TensorId id = 0; id < 60 && last.ok(); ++id) last = (*tiny)->write_sync(id, data.data(), data.size());
  ASSERT_EQ(last.code(), StatusCode::kResourceExhausted) << last.to_string();
  EXPECT_NE(last.message().find("raise index_bytes"), std::string::npos) << last.message();
  EXPECT_TRUE((*tiny)->flush().ok());  // what was accepted still fits the index
}

}  // namespace
}  // namespace strata::nvme
