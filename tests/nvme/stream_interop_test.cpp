// NVMe completions driving device streams (docs/nvme.md, "Completions"):
// a stream gated on an NVMe read or a swap read copies the bytes that were
// read; a failed read fails the gated stream with the read's error; a slot
// pool's region registered once makes swap I/O use io_uring fixed buffers.
#include <cstring>

#include <gtest/gtest.h>

#include "nvme_test_util.h"
#include "strata/core/device.h"
#include "strata/core/device_registry.h"
#include "strata/core/slot_pool.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/testing/fault_injection.h"
#include "strata/nvme/swap_store.h"

namespace strata::nvme {
namespace {

using testing::bytes_equal;
using testing::ScratchDir;

constexpr uint64_t kBytes = 512 * 1024;

class StreamInterop : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<ScratchDir>(testing::disk_scratch_root());
    ASSERT_TRUE(dir_->ok());
    auto device = make_device("cpu");
    ASSERT_TRUE(device.ok()) << device.status().to_string();
    device_ = std::move(device).value();
    auto stream = device_->create_stream();
    ASSERT_TRUE(stream.ok());
    stream_ = std::move(stream).value();
    auto dbuf = device_->allocate(kBytes);
    ASSERT_TRUE(dbuf.ok());
    dbuf_ = std::move(dbuf).value();
    std::memset(dbuf_.data(), 0xAB, kBytes);  // cpu device memory is host-addressable
    auto host = AlignedBuffer::allocate(kBytes, 4096);
    ASSERT_TRUE(host.ok());
    host_ = std::move(host).value();
    std::mt19937_64 rng(testing::test_seed(41));
    bytes_ = testing::random_bytes(rng, kBytes);
  }
  IoEngineOptions engine_options() const {
    IoEngineOptions o;
    o.block_size = 64 * 1024;
    o.queue_depth = 4;
    return o;
  }
  SwapStoreOptions store_options(const std::string& job) const {
    SwapStoreOptions so;
    so.paths = {dir_->path()};
    so.job = job;
    so.capacity_bytes = 4u << 20;
    so.stripe_bytes = 64 * 1024;
    return so;
  }
  // The device buffer still holds the 0xAB fill: the gated copy was skipped.
  bool device_untouched() const {
    const auto* d = static_cast<const unsigned char*>(dbuf_.data());
    for (uint64_t i = 0; i < kBytes; ++i) {
      if (d[i] != 0xAB) return false;
    }
    return true;
  }
  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  DeviceBuffer dbuf_;
  AlignedBuffer host_;
  std::vector<std::byte> bytes_;
};

TEST_F(StreamInterop, StreamWaitsOnAnNvmeReadThenCopiesIt) {
  auto engine = make_io_engine(engine_options());
  ASSERT_TRUE(engine.ok());
  auto file = (*engine)->open(dir_->file("gate.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*engine)->write_sync(*file, 0, kBytes, bytes_.data()).ok());
  std::memset(host_.data(), 0, kBytes);

  IoHandle read = (*engine)->read(*file, 0, kBytes, host_.data());
  EXPECT_NE(read.completion().label().find("gate.bin"), std::string::npos) << read.completion().label();
  ASSERT_TRUE(stream_->wait(read.completion()).ok());
  ASSERT_TRUE(stream_->copy_async(dbuf_.data(), host_.data(), kBytes, CopyKind::kHostToDevice).ok());
  Completion copied = stream_->record_completion();
  ASSERT_TRUE(stream_->synchronize().ok());
  EXPECT_TRUE(copied.wait().ok());
  EXPECT_TRUE(read.done());
  EXPECT_TRUE(bytes_equal(bytes_.data(), dbuf_.data(), kBytes));
  ASSERT_TRUE((*engine)->close(*file).ok());
}

TEST_F(StreamInterop, StreamWaitsOnAVerifiedSwapRead) {
  auto engine = make_io_engine(engine_options());
  ASSERT_TRUE(engine.ok());
  auto store = SwapStore::open(store_options("gate"), **engine);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  ASSERT_TRUE((*store)->write_sync(5, bytes_.data(), kBytes).ok());
  // A tile of the tensor, gated and copied to the device.
  const uint64_t tile = 128 * 1024;
  auto h = (*store)->read_range(5, 2 * tile, std::span<std::byte>(host_.data(), tile));
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE(stream_->wait(h->completion()).ok());
  ASSERT_TRUE(stream_->copy_async(dbuf_.data(), host_.data(), tile, CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(stream_->synchronize().ok());
  EXPECT_TRUE(bytes_equal(bytes_.data() + 2 * tile, dbuf_.data(), tile));
}

TEST_F(StreamInterop, FailedReadFailsTheGatedStreamWithItsError) {
  FaultPlan plan;
  plan.seed = 43;
  plan.eio_probability = 1.0;
  plan.fault_writes = false;
  auto engine = make_fault_injecting_engine(engine_options(), plan);
  ASSERT_TRUE(engine.ok());
  std::string path = dir_->file("bad.bin");
  auto file = (*engine)->open(path, OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*engine)->write_sync(*file, 0, kBytes, bytes_.data()).ok());

  IoHandle read = (*engine)->read(*file, 0, kBytes, host_.data());
  stream_->wait(read.completion()).ignore();  // exact gates enqueue; the fallback returns the error here
  stream_->copy_async(dbuf_.data(), host_.data(), kBytes, CopyKind::kHostToDevice).ignore();
  auto event = device_->create_event();
  ASSERT_TRUE(event.ok());
  stream_->record(**event).ignore();
  Status st = stream_->synchronize();
  ASSERT_FALSE(st.ok()) << "a failed read gated a copy and the stream reported success";
  EXPECT_EQ(st.code(), StatusCode::kIoError) << st.to_string();
  EXPECT_NE(st.message().find(path), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("offset"), std::string::npos) << st.message();
  Status ev = (*event)->synchronize();
  EXPECT_EQ(ev.code(), StatusCode::kIoError) << ev.to_string();
  EXPECT_NE(ev.message().find(path), std::string::npos) << ev.message();
  EXPECT_EQ(read.wait().code(), StatusCode::kIoError);
  EXPECT_TRUE(device_untouched()) << "the copy after a failed gate ran";
  ASSERT_TRUE((*engine)->close(*file).ok());
}

TEST_F(StreamInterop, FailedSwapReadNamesTheTensorOnTheStream) {
  FaultPlan plan;
  plan.seed = 44;
  plan.eio_probability = 1.0;
  plan.fault_writes = false;
  std::shared_ptr<FaultCounters> counters;
  auto engine = make_fault_injecting_engine(engine_options(), plan, &counters);
  ASSERT_TRUE(engine.ok());
  counters->disarm();
  auto store = SwapStore::open(store_options("badgate"), **engine);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  ASSERT_TRUE((*store)->write_sync(6, bytes_.data(), kBytes).ok());
  counters->arm();
  auto h = (*store)->read(6, host_.data(), kBytes);
  ASSERT_TRUE(h.ok());
  stream_->wait(h->completion()).ignore();
  stream_->copy_async(dbuf_.data(), host_.data(), kBytes, CopyKind::kHostToDevice).ignore();
  Completion after = stream_->record_completion();
  Status st = stream_->synchronize();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kIoError) << st.to_string();
  EXPECT_NE(st.message().find("tensor 6"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("swap.bin offset"), std::string::npos) << st.message();
  EXPECT_EQ(after.wait().code(), StatusCode::kIoError);
  EXPECT_TRUE(device_untouched());
}

// A slot pool's region registered once: the swap store's reads and writes
// into its slots go out as io_uring READ_FIXED / WRITE_FIXED.
TEST_F(StreamInterop, SlotPoolRegionServesSwapIoAsFixedBuffers) {
  bool uring = false;
  for (const EngineProbe& p : probe_engines()) {
    if (p.kind == EngineKind::kIoUring) uring = p.works;
  }
  if (!uring) GTEST_SKIP() << "io_uring does not work here";
  SlotPoolOptions po;
  po.slot_count = 2;
  po.slot_bytes = kBytes;
  po.name = "nvme staging";
  auto pool = SlotPool::create(*device_, po);
  if (!pool.ok()) GTEST_SKIP() << "cannot pin a slot pool here: " << pool.status().to_string();
  IoEngineOptions o = engine_options();
  o.engine = EngineKind::kIoUring;
  auto engine = make_io_engine(o);
  ASSERT_TRUE(engine.ok());
  ASSERT_TRUE((*engine)->register_buffer((*pool)->base(), (*pool)->total_bytes()).ok());
  for (const std::string& note : (*engine)->notes()) {
    if (note.find("registration refused") != std::string::npos) GTEST_SKIP() << note;
  }
  auto store = SwapStore::open(store_options("fixed"), **engine);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  auto in = (*pool)->acquire("swap write source", kBytes);
  auto out = (*pool)->acquire("swap read target", kBytes);
  ASSERT_TRUE(in.ok() && out.ok());
  std::memcpy(in->data(), bytes_.data(), kBytes);
  uint64_t before = (*engine)->stats().fixed_buffer_pieces;
  ASSERT_TRUE((*store)->write_sync(1, in->data(), kBytes).ok());
  uint64_t after_write = (*engine)->stats().fixed_buffer_pieces;
  EXPECT_GE(after_write - before, kBytes / o.block_size) << "the write did not use fixed buffers";
  ASSERT_TRUE((*store)->read_sync(1, out->data(), kBytes).ok());
  EXPECT_GE((*engine)->stats().fixed_buffer_pieces - after_write, kBytes / o.block_size);
  EXPECT_TRUE(bytes_equal(bytes_.data(), out->data(), kBytes));
  // A buffer outside the region is not fixed.
  uint64_t mark = (*engine)->stats().fixed_buffer_pieces;
  ASSERT_TRUE((*store)->read_sync(1, host_.data(), kBytes).ok());
  EXPECT_EQ((*engine)->stats().fixed_buffer_pieces, mark);
  ASSERT_TRUE((*store)->close().ok());
  ASSERT_TRUE((*engine)->unregister_buffer((*pool)->base()).ok());
}

}  // namespace
}  // namespace strata::nvme
