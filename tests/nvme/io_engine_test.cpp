// The integrity suite, run identically on every engine (io_uring, libaio,
// psync) and every location (disk with O_DIRECT, disk buffered, tmpfs):
// random sizes and offsets, unaligned buffers and tails, concurrent
// requests from several threads, multi-segment requests, callbacks, and
// errors that name their culprit.
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "nvme_test_util.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/io_engine.h"

namespace strata::nvme {
namespace {

using testing::bytes_equal;
using testing::ScratchDir;

enum class Location { kDiskDirect, kDiskBuffered, kTmpfs };

std::string location_name(Location l) {
  switch (l) {
    case Location::kDiskDirect: return "DiskDirect";
    case Location::kDiskBuffered: return "DiskBuffered";
    case Location::kTmpfs: return "Tmpfs";
  }
  return "?";
}

struct Param {
  EngineKind engine;
  Location location;
};

class IoEngineIntegrity : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    const Param p = GetParam();
    bool works = false;
    for (const EngineProbe& probe : probe_engines()) {
      if (probe.kind == p.engine) works = probe.works;
    }
    if (!works) GTEST_SKIP() << engine_kind_name(p.engine) << " does not work on this machine";
    std::string root = p.location == Location::kTmpfs ? testing::tmpfs_root() : testing::disk_scratch_root();
    if (root.empty()) GTEST_SKIP() << "no writable tmpfs at /dev/shm";
    dir_ = std::make_unique<ScratchDir>(root);
    ASSERT_TRUE(dir_->ok()) << "cannot create a scratch folder under " << root;
  }

  IoEngineOptions options(uint64_t block_size = 64 * 1024, uint32_t depth = 8, uint32_t threads = 2) const {
    IoEngineOptions o;
    o.engine = GetParam().engine;
    o.block_size = block_size;
    o.queue_depth = depth;
    o.intra_op_parallelism = threads;
    o.direct_io = GetParam().location != Location::kDiskBuffered;
    return o;
  }

  std::unique_ptr<IoEngine> make(const IoEngineOptions& o) {
    auto engine = make_io_engine(o);
    EXPECT_TRUE(engine.ok()) << engine.status().to_string();
    return engine.ok() ? std::move(engine).value() : nullptr;
  }

  std::unique_ptr<ScratchDir> dir_;
};

TEST_P(IoEngineIntegrity, RandomSizesAndOffsetsMatchReferenceModel) {
  uint64_t seed = testing::test_seed(1234);
  std::mt19937_64 rng(seed);
  auto engine = make(options());
  ASSERT_NE(engine, nullptr);
  const uint64_t file_bytes = 2u << 20;
  std::string path = dir_->file("data.bin");
  auto file = engine->open(path, OpenMode::kCreate);
  ASSERT_TRUE(file.ok()) << file.status().to_string();

  // Reference model: what the file must contain.
  std::vector<std::byte> model = testing::random_bytes(rng, file_bytes);
  auto buf = AlignedBuffer::allocate(file_bytes + 8192, 4096);
  ASSERT_TRUE(buf.ok());
  std::memcpy(buf->data(), model.data(), file_bytes);
  ASSERT_TRUE(engine->write_sync(*file, 0, file_bytes, buf->data()).ok());

  for (int round = 0; round < 60; ++round) {
    // Mix aligned and unaligned offsets, lengths and buffer addresses.
    bool aligned = rng() % 2 == 0;
    uint64_t length = aligned ? 4096 * (1 + rng() % 64) : 1 + rng() % 300000;
    uint64_t offset = aligned ? 4096 * (rng() % ((file_bytes - length) / 4096 + 1)) : rng() % (file_bytes - length);
    size_t shift = aligned ? 0 : 1 + rng() % 4095;
    std::byte* io = buf->data() + shift;
    if (rng() % 2 == 0) {
      std::vector<std::byte> data = testing::random_bytes(rng, length);
      std::memcpy(io, data.data(), length);
      Status st = engine->write_sync(*file, offset, length, io);
      ASSERT_TRUE(st.ok()) << st.to_string();
      std::memcpy(model.data() + offset, data.data(), length);
    } else {
      std::memset(io, 0xEE, length);
      Status st = engine->read_sync(*file, offset, length, io);
      ASSERT_TRUE(st.ok()) << st.to_string();
      ASSERT_TRUE(bytes_equal(model.data() + offset, io, length))
          << "round " << round << " offset " << offset << " length " << length << " seed " << seed;
    }
  }
  // Whole file, then compare against the model.
  std::memset(buf->data(), 0, file_bytes);
  ASSERT_TRUE(engine->read_sync(*file, 0, file_bytes, buf->data()).ok());
  EXPECT_TRUE(bytes_equal(model.data(), buf->data(), file_bytes)) << "seed " << seed;
  IoEngineStats stats = engine->stats();
  EXPECT_GT(stats.buffered_pieces, 0u);  // unaligned pieces took the buffered path
  auto info = engine->file_info(*file);
  ASSERT_TRUE(info.ok());
  if (GetParam().location == Location::kDiskDirect && info->direct) {
    EXPECT_GT(stats.direct_pieces, 0u);
  }
  if (GetParam().location == Location::kDiskBuffered) {
    EXPECT_EQ(stats.direct_pieces, 0u);
  }
  EXPECT_TRUE(engine->close(*file).ok());
}

TEST_P(IoEngineIntegrity, UnalignedTailRoundTrips) {
  auto engine = make(options(16 * 1024));
  ASSERT_NE(engine, nullptr);
  auto file = engine->open(dir_->file("tail.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  std::mt19937_64 rng(7);
  const uint64_t length = 3 * 16384 + 4096 + 123;  // whole blocks, a whole page, then 123 bytes
  auto src = AlignedBuffer::allocate(length, 4096);
  auto dst = AlignedBuffer::allocate(length, 4096);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto data = testing::random_bytes(rng, length);
  std::memcpy(src->data(), data.data(), length);
  ASSERT_TRUE(engine->write_sync(*file, 0, length, src->data()).ok());
  struct stat st {};
  ASSERT_EQ(::stat(dir_->file("tail.bin").c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), length);
  ASSERT_TRUE(engine->read_sync(*file, 0, length, dst->data()).ok());
  EXPECT_TRUE(bytes_equal(src->data(), dst->data(), length));
}

TEST_P(IoEngineIntegrity, ConcurrentRequestsFromSeveralThreads) {
  uint64_t seed = testing::test_seed(99);
  auto engine = make(options(32 * 1024, 4, 2));
  ASSERT_NE(engine, nullptr);
  auto file = engine->open(dir_->file("concurrent.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  constexpr int kThreads = 4;
  constexpr int kRequests = 12;
  constexpr uint64_t kChunk = 100 * 1024 + 512;  // crosses blocks, unaligned end
  std::atomic<int> callbacks{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      auto src = AlignedBuffer::allocate(kChunk * kRequests, 4096);
      auto dst = AlignedBuffer::allocate(kChunk * kRequests, 4096);
      if (!src.ok() || !dst.ok()) {
        failures++;
        return;
      }
      auto data = testing::random_bytes(rng, kChunk * kRequests);
      std::memcpy(src->data(), data.data(), data.size());
      std::vector<IoHandle> handles;
      for (int r = 0; r < kRequests; ++r) {
        uint64_t offset = (static_cast<uint64_t>(t) * kRequests + r) * kChunk;
        handles.push_back(engine->write(*file, offset, kChunk, src->data() + r * kChunk,
                                        [&](const Status& st) { callbacks++; }));
      }
      for (IoHandle& h : handles) {
        if (!h.wait().ok()) failures++;
      }
      handles.clear();
      for (int r = kRequests - 1; r >= 0; --r) {  // reverse order: completions are per request
        uint64_t offset = (static_cast<uint64_t>(t) * kRequests + r) * kChunk;
        handles.push_back(engine->read(*file, offset, kChunk, dst->data() + r * kChunk));
      }
      for (IoHandle& h : handles) {
        if (!h.wait().ok()) failures++;
      }
      if (!bytes_equal(src->data(), dst->data(), kChunk * kRequests)) failures++;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0) << "seed " << seed;
  EXPECT_EQ(callbacks.load(), kThreads * kRequests);
}

TEST_P(IoEngineIntegrity, MultiSegmentRequestAcrossFiles) {
  auto engine = make(options(8192, 4, 1));
  ASSERT_NE(engine, nullptr);
  auto a = engine->open(dir_->file("a.bin"), OpenMode::kCreate);
  auto b = engine->open(dir_->file("b.bin"), OpenMode::kCreate);
  ASSERT_TRUE(a.ok() && b.ok());
  std::mt19937_64 rng(3);
  auto src = AlignedBuffer::allocate(3 * 65536, 4096);
  auto dst = AlignedBuffer::allocate(3 * 65536, 4096);
  auto data = testing::random_bytes(rng, 3 * 65536);
  std::memcpy(src->data(), data.data(), data.size());
  std::vector<IoSegment> segs = {{*a, 0, 65536, src->data()},
                                 {*b, 4096, 65536, src->data() + 65536},
                                 {*a, 65536, 65536, src->data() + 131072}};
  ASSERT_TRUE(engine->submit(IoOp::kWrite, segs).wait().ok());
  for (auto& s : segs) s.buffer = static_cast<std::byte*>(s.buffer) - src->data() + dst->data();
  IoHandle h = engine->submit(IoOp::kRead, segs);
  ASSERT_TRUE(h.wait().ok());
  EXPECT_EQ(h.bytes(), 3u * 65536);
  EXPECT_TRUE(bytes_equal(src->data(), dst->data(), 3 * 65536));
}

TEST_P(IoEngineIntegrity, LargeRequestIsSplitIntoBlocks) {
  auto engine = make(options(4096, 16, 2));
  ASSERT_NE(engine, nullptr);
  auto file = engine->open(dir_->file("split.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  auto buf = AlignedBuffer::allocate(1u << 20, 4096);
  ASSERT_TRUE(engine->write_sync(*file, 0, 1u << 20, buf->data()).ok());
  EXPECT_GE(engine->stats().pieces, 256u);
  EXPECT_EQ(engine->stats().bytes_written, 1u << 20);
}

TEST_P(IoEngineIntegrity, ReadPastEndOfFileNamesFileAndOffset) {
  auto engine = make(options());
  ASSERT_NE(engine, nullptr);
  std::string path = dir_->file("short.bin");
  auto file = engine->open(path, OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  auto buf = AlignedBuffer::allocate(65536, 4096);
  ASSERT_TRUE(engine->write_sync(*file, 0, 8192, buf->data()).ok());
  Status st = engine->read_sync(*file, 4096, 65536, buf->data());
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find(path), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("end of file"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("offset"), std::string::npos) << st.message();
}

// A FIFO would block the open until a writer came (forever); a folder, a
// socket or a name cut at a NUL byte is not a file to read or write either.
TEST_P(IoEngineIntegrity, OpenRefusesWhatIsNotAFileWithoutBlocking) {
  auto engine = make(options());
  ASSERT_NE(engine, nullptr);
  const std::string fifo = dir_->file("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  for (OpenMode mode : {OpenMode::kRead, OpenMode::kReadWrite}) {
    Result<FileId> opened = engine->open(fifo, mode);
    ASSERT_FALSE(opened.ok());
    EXPECT_NE(opened.status().message().find("a FIFO, not a regular file"), std::string::npos)
        << opened.status().message();
  }
  Result<FileId> folder = engine->open(dir_->file(""), OpenMode::kRead);
  ASSERT_FALSE(folder.ok());
  EXPECT_NE(folder.status().message().find("a directory"), std::string::npos) << folder.status().message();
  const std::string victim = dir_->file("victim");
  std::string cut = victim;
  cut += std::string("\0tail", 5);
  Result<FileId> nul = engine->open(cut, OpenMode::kCreate);
  ASSERT_FALSE(nul.ok());
  EXPECT_EQ(nul.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(nul.status().message().find("NUL byte at offset"), std::string::npos) << nul.status().message();
  struct stat st {};
  EXPECT_NE(stat(victim.c_str(), &st), 0) << "the name before the NUL was not created";
}

TEST_P(IoEngineIntegrity, InvalidRequestsCompleteWithErrors) {
  auto engine = make(options());
  ASSERT_NE(engine, nullptr);
  std::string path = dir_->file("ro.bin");
  {
    auto f = engine->open(path, OpenMode::kCreate);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(engine->close(*f).ok());
  }
  auto ro = engine->open(path, OpenMode::kRead);
  ASSERT_TRUE(ro.ok());
  auto buf = AlignedBuffer::allocate(4096, 4096);
  Status st = engine->write_sync(*ro, 0, 4096, buf->data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("read-only"), std::string::npos) << st.message();
  st = engine->read_sync(*ro + 17, 0, 4096, buf->data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not open"), std::string::npos) << st.message();
  st = engine->read_sync(*ro, 0, 4096, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  auto missing = engine->open(dir_->file("missing/nothing.bin"), OpenMode::kRead);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nothing.bin"), std::string::npos);
  // Zero-length requests complete at once.
  EXPECT_TRUE(engine->read_sync(*ro, 0, 0, buf->data()).ok());
}

TEST_P(IoEngineIntegrity, RegisteredBufferRoundTrips) {
  auto engine = make(options(65536, 8, 2));
  ASSERT_NE(engine, nullptr);
  auto buf = AlignedBuffer::allocate(1u << 20, 4096);
  ASSERT_TRUE(engine->register_buffer(buf->data(), buf->size()).ok());
  auto file = engine->open(dir_->file("fixed.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  std::mt19937_64 rng(11);
  auto data = testing::random_bytes(rng, 1u << 20);
  std::memcpy(buf->data(), data.data(), data.size());
  ASSERT_TRUE(engine->write_sync(*file, 0, 1u << 20, buf->data()).ok());
  std::memset(buf->data(), 0, 1u << 20);
  ASSERT_TRUE(engine->read_sync(*file, 0, 1u << 20, buf->data()).ok());
  EXPECT_TRUE(bytes_equal(data.data(), buf->data(), 1u << 20));
  EXPECT_TRUE(engine->unregister_buffer(buf->data()).ok());
}

// The completion model (docs/nvme.md, "Completions"): the request's
// Completion carries its Status and label; the IoCallback runs before then()
// callbacks, both on an engine thread with no engine lock held, so a
// callback may submit to the same engine.
TEST_P(IoEngineIntegrity, CompletionCarriesStatusAndCallbacksMaySubmit) {
  auto engine = make(options(16 * 1024, 4, 1));
  ASSERT_NE(engine, nullptr);
  std::string path = dir_->file("chain.bin");
  auto file = engine->open(path, OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  const uint64_t n = 256 * 1024;
  std::mt19937_64 rng(12);
  auto data = testing::random_bytes(rng, n);
  auto src = AlignedBuffer::allocate(n, 4096);
  auto dst = AlignedBuffer::allocate(n, 4096);
  std::memcpy(src->data(), data.data(), n);

  // The write's callback submits the read-back from the engine's own worker.
  std::mutex mu;
  std::vector<std::string> order;
  IoHandle chained;
  std::atomic<bool> chained_set{false};
  IoHandle write = engine->write(*file, 0, n, src->data(), [&](const Status& st) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(st.ok() ? "callback ok" : "callback failed");
    chained = engine->read(*file, 0, n, dst->data());
    chained_set = true;
  });
  write.completion().then([&](const Status& st) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(st.ok() ? "then ok" : "then failed");
  });
  EXPECT_NE(write.completion().label().find("nvme write of " + path + " [0, +262144)"), std::string::npos)
      << write.completion().label();
  ASSERT_TRUE(write.wait().ok());
  ASSERT_TRUE(chained_set.load());
  ASSERT_TRUE(chained.completion().wait().ok());
  EXPECT_TRUE(bytes_equal(data.data(), dst->data(), n));
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_GE(order.size(), 1u);
    EXPECT_EQ(order[0], "callback ok");  // then() may have run on this thread if it came late
  }
  // A failed request's Completion names the file and offset, for every observer.
  IoHandle past = engine->read(*file, n, 65536, dst->data());
  Status via_then;
  std::atomic<bool> got{false};
  past.completion().then([&](const Status& st) {
    via_then = st;
    got = true;
  });
  Status st = past.completion().wait();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find(path), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("offset "), std::string::npos) << st.message();  // of the first failed piece
  EXPECT_NE(st.message().find("end of file"), std::string::npos) << st.message();
  EXPECT_EQ(past.wait().code(), st.code());
  EXPECT_TRUE(past.done());
  while (!got.load()) std::this_thread::yield();
  EXPECT_EQ(via_then.message(), st.message());
  // Invalid requests complete before submit() returns.
  IoHandle invalid = engine->read(*file + 9, 0, 4096, dst->data());
  EXPECT_TRUE(invalid.completion().done());
  EXPECT_EQ(invalid.completion().status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(engine->close(*file).ok());
}

TEST_P(IoEngineIntegrity, BatchCompletionAndSingleSubmitModes) {
  IoEngineOptions o = options(16384, 4, 1);
  o.overlap_events = false;
  o.single_submit = true;
  auto engine = make(o);
  ASSERT_NE(engine, nullptr);
  auto file = engine->open(dir_->file("modes.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  std::mt19937_64 rng(5);
  auto src = AlignedBuffer::allocate(300000, 4096);
  auto dst = AlignedBuffer::allocate(300000, 4096);
  auto data = testing::random_bytes(rng, 300000);
  std::memcpy(src->data(), data.data(), data.size());
  ASSERT_TRUE(engine->write_sync(*file, 0, 300000, src->data()).ok());
  ASSERT_TRUE(engine->read_sync(*file, 0, 300000, dst->data()).ok());
  EXPECT_TRUE(bytes_equal(src->data(), dst->data(), 300000));
  EXPECT_NE(engine->describe().find("single submit"), std::string::npos) << engine->describe();
}

std::vector<Param> all_params() {
  std::vector<Param> params;
  for (EngineKind e : {EngineKind::kIoUring, EngineKind::kLibaio, EngineKind::kPsync}) {
    for (Location l : {Location::kDiskDirect, Location::kDiskBuffered, Location::kTmpfs}) params.push_back({e, l});
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(AllEngines, IoEngineIntegrity, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           std::string engine(engine_kind_name(info.param.engine));
                           engine.erase(std::remove(engine.begin(), engine.end(), '_'), engine.end());
                           return engine + "_" + location_name(info.param.location);
                         });

TEST(IoEngineSqpoll, RoundTripWithKernelSubmissionThread) {
  bool works = false;
  for (const EngineProbe& p : probe_engines()) {
    if (p.kind == EngineKind::kIoUring) works = p.works;
  }
  if (!works) GTEST_SKIP() << "io_uring does not work here";
  ScratchDir dir(testing::disk_scratch_root());
  ASSERT_TRUE(dir.ok());
  IoEngineOptions o;
  o.engine = EngineKind::kIoUring;
  o.sqpoll = true;
  o.block_size = 65536;
  auto engine = make_io_engine(o);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  auto file = (*engine)->open(dir.file("sqpoll.bin"), OpenMode::kCreate);
  ASSERT_TRUE(file.ok());
  std::mt19937_64 rng(21);
  auto src = AlignedBuffer::allocate(1u << 20, 4096);
  auto dst = AlignedBuffer::allocate(1u << 20, 4096);
  auto data = testing::random_bytes(rng, 1u << 20);
  std::memcpy(src->data(), data.data(), data.size());
  ASSERT_TRUE((*engine)->write_sync(*file, 0, 1u << 20, src->data()).ok());
  ASSERT_TRUE((*engine)->read_sync(*file, 0, 1u << 20, dst->data()).ok());
  EXPECT_TRUE(bytes_equal(src->data(), dst->data(), 1u << 20));
  // Either SQPOLL is on, or its refusal is reported.
  bool reported = false;
  for (const std::string& n : (*engine)->notes()) reported = reported || n.find("SQPOLL") != std::string::npos;
  EXPECT_TRUE((*engine)->describe().find("SQPOLL") != std::string::npos || reported);
}

TEST(IoEngineOptions, ValidateNamesTheKey) {
  IoEngineOptions o;
  o.block_size = 1000;
  Status st = o.validate();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("aio.block_size"), std::string::npos);
  o = IoEngineOptions{};
  o.queue_depth = 0;
  EXPECT_NE(o.validate().message().find("aio.queue_depth"), std::string::npos);
  o = IoEngineOptions{};
  o.intra_op_parallelism = 0;
  EXPECT_NE(o.validate().message().find("aio.intra_op_parallelism"), std::string::npos);
  EXPECT_FALSE(make_io_engine(o).ok());
}

TEST(IoEngineOptions, ParseEngineKind) {
  EXPECT_EQ(*parse_engine_kind("io_uring"), EngineKind::kIoUring);
  EXPECT_EQ(*parse_engine_kind("libaio"), EngineKind::kLibaio);
  EXPECT_EQ(*parse_engine_kind("psync"), EngineKind::kPsync);
  EXPECT_EQ(*parse_engine_kind("auto"), EngineKind::kAuto);
  auto bad = parse_engine_kind("uringg", "--engine");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--engine"), std::string::npos);
  EXPECT_NE(bad.status().message().find("io_uring"), std::string::npos);
}

TEST(IoEngineSelection, AutoPicksAWorkingEngineAndSaysWhy) {
  EngineChoice choice = choose_engine();
  EXPECT_FALSE(choice.reason.empty());
  bool found = false;
  for (const EngineProbe& p : probe_engines()) {
    if (p.kind == choice.kind) found = p.works;
  }
  EXPECT_TRUE(found) << engine_kind_name(choice.kind) << ": " << choice.reason;
  auto engine = make_io_engine(IoEngineOptions{});
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ((*engine)->kind(), choice.kind);
}

// Buffers of 2 MiB or more start on a 2 MiB boundary, so the huge-page
// advice can back them (Note [Huge pages for I/O buffers]); small ones keep
// the alignment asked for.
TEST(AlignedBufferTest, LargeBuffersAreHugePageAligned) {
  auto large = AlignedBuffer::allocate((2u << 20) + 4096, 4096);
  ASSERT_TRUE(large.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large->data()) % (2u << 20), 0u);
  EXPECT_EQ(large->size(), (2u << 20) + 4096);
  auto small = AlignedBuffer::allocate(8192, 4096);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->alignment(), 4096u);
}

// register_buffer() backs a registered region with 2 MiB pages (Note [Huge
// pages for I/O buffers]) or says why not in a note; with the option off it
// leaves the pages alone.
uint64_t anon_huge_kb_at(const void* p) {
  std::FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return 0;
  char line[512];
  bool inside = false;
  uint64_t kb = 0;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && std::strchr(line, '-') < std::strchr(line, ' ')) {
      inside = addr >= lo && addr < hi;
    } else if (inside && std::sscanf(line, "AnonHugePages: %lu kB", &lo) == 1) {
      kb = lo;
    }
  }
  std::fclose(f);
  return kb;
}

TEST(HugePageBuffers, RegisteredRegionIsBackedByHugePagesOrNoted) {
  for (bool on : {true, false}) {
    IoEngineOptions o;
    o.engine = EngineKind::kPsync;
    o.huge_page_buffers = on;
    auto engine = make_io_engine(o);
    ASSERT_TRUE(engine.ok());
    constexpr size_t kBytes = 8u << 20;
    void* region = std::aligned_alloc(2u << 20, kBytes);
    ASSERT_NE(region, nullptr);
    std::memset(region, 1, kBytes);  // faulted in as whatever pages the system gives
    const uint64_t before = anon_huge_kb_at(region);
    ASSERT_TRUE((*engine)->register_buffer(region, kBytes).ok());
    const uint64_t after = anon_huge_kb_at(region);
    bool noted = false;
    for (const std::string& n : (*engine)->notes()) noted = noted || n.find("2 MiB pages refused") != std::string::npos;
    if (on) {
      EXPECT_TRUE(after >= (kBytes >> 10) || noted) << "AnonHugePages " << after << " kB, no note";
    } else {
      EXPECT_EQ(after, before);
      EXPECT_FALSE(noted);
    }
    ASSERT_TRUE((*engine)->unregister_buffer(region).ok());
    std::free(region);
  }
}

}  // namespace
}  // namespace strata::nvme
