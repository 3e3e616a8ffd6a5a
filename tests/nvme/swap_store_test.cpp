// SwapStore: round trips, striping, reopen with verification, corruption
// detection, locking, stale folders, space checks, permissions, cleanup.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include <gtest/gtest.h>

#include "nvme_test_util.h"
#include "strata/nvme/aio_config.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/fs_probe.h"
#include "strata/nvme/swap_store.h"

namespace strata::nvme {
namespace {

using testing::bytes_equal;
using testing::ScratchDir;

class SwapStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<ScratchDir>(testing::disk_scratch_root());
    dir2_ = std::make_unique<ScratchDir>(testing::disk_scratch_root());
    ASSERT_TRUE(dir_->ok() && dir2_->ok());
    ASSERT_NO_FATAL_FAILURE(start_engine());
  }
  void start_engine() {
    IoEngineOptions o;
    o.block_size = 64 * 1024;
    o.queue_depth = 8;
    o.intra_op_parallelism = 2;
    auto engine = make_io_engine(o);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    engine_ = std::move(engine).value();
  }
  // fork() from a process with running threads can leave the child blocked
  // on a lock one of them held (the sanitizer allocator's, for one), so the
  // engine's workers are stopped first and restarted in the parent after.
  pid_t fork_without_threads() {
    engine_.reset();
    return fork();
  }
  SwapStoreOptions options(const std::string& job = "test") const {
    SwapStoreOptions so;
    so.paths = {dir_->path()};
    so.job = job;
    so.rank = 0;
    so.capacity_bytes = 4u << 20;
    so.stripe_bytes = 64 * 1024;
    so.index_bytes = 64 * 1024;
    return so;
  }
  struct Tensor {
    std::vector<std::byte> data;
    AlignedBuffer buffer;
  };
  Tensor make_tensor(std::mt19937_64& rng, uint64_t bytes) {
    Tensor t;
    t.data = testing::random_bytes(rng, bytes);
    t.buffer = std::move(AlignedBuffer::allocate(bytes, 4096)).value();
    std::memcpy(t.buffer.data(), t.data.data(), bytes);
    return t;
  }
  std::unique_ptr<ScratchDir> dir_, dir2_;
  std::unique_ptr<IoEngine> engine_;
};

TEST_F(SwapStoreTest, WriteReadRoundTripAndExtentReuse) {
  auto store = SwapStore::open(options(), *engine_);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  std::mt19937_64 rng(1);
  std::vector<Tensor> tensors;
  std::vector<SwapHandle> handles;
  for (int i = 0; i < 8; ++i) tensors.push_back(make_tensor(rng, 10000 + 50000 * i));
  for (int i = 0; i < 8; ++i) {
    auto h = (*store)->write(100 + i, tensors[i].buffer.data(), tensors[i].data.size());
    ASSERT_TRUE(h.ok());
    handles.push_back(*h);
  }
  for (auto& h : handles) ASSERT_TRUE(h.wait().ok());
  for (int i = 7; i >= 0; --i) {
    std::vector<std::byte> out(tensors[i].data.size());
    ASSERT_TRUE((*store)->read_sync(100 + i, out.data(), out.size()).ok());  // unaligned buffer is fine
    EXPECT_TRUE(bytes_equal(tensors[i].data.data(), out.data(), out.size())) << "tensor " << 100 + i;
  }
  // Rewriting a tensor is a shadow write: it moves to a fresh extent and the
  // old one is freed at the flip, so the next rewrite reuses it (first fit).
  Extent before = *(*store)->extent_of(100);
  uint64_t used_before = (*store)->stats().bytes_used;
  ASSERT_TRUE((*store)->write_sync(100, tensors[0].buffer.data(), tensors[0].data.size()).ok());
  EXPECT_NE(*(*store)->extent_of(100), before);
  EXPECT_EQ((*store)->stats().bytes_used, used_before);
  ASSERT_TRUE((*store)->write_sync(100, tensors[0].buffer.data(), tensors[0].data.size()).ok());
  EXPECT_EQ(*(*store)->extent_of(100), before);
  ASSERT_TRUE((*store)->write_sync(100, tensors[7].buffer.data(), tensors[7].data.size()).ok());
  EXPECT_EQ(*(*store)->size_of(100), tensors[7].data.size());
  uint64_t used = (*store)->stats().bytes_used;
  ASSERT_TRUE((*store)->remove(100).ok());
  EXPECT_LT((*store)->stats().bytes_used, used);
  EXPECT_FALSE((*store)->contains(100));
  std::vector<std::byte> out(16);
  EXPECT_EQ((*store)->read_sync(100, out.data(), 16).code(), StatusCode::kNotFound);
  EXPECT_EQ((*store)->read_sync(101, out.data(), 16).code(), StatusCode::kInvalidArgument);  // wrong size
  EXPECT_GT((*store)->stats().checksum_ns, 0u);
}

TEST_F(SwapStoreTest, FilesAre0600InJobRankFolderAndRemovedOnClose) {
  auto store = SwapStore::open(options("perm"), *engine_);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  std::string folder = swap_folder_path(dir_->path(), "perm", 0);
  std::string file = folder + "/swap.bin";
  struct stat st {};
  ASSERT_EQ(::stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_GE(static_cast<uint64_t>(st.st_size), (4u << 20) + 64 * 1024);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 4u << 20);  // preallocated, not sparse
  ASSERT_TRUE((*store)->close().ok());
  EXPECT_FALSE(std::filesystem::exists(folder));
  EXPECT_FALSE(std::filesystem::exists(dir_->path() + "/strata-perm"));
}

TEST_F(SwapStoreTest, StripesOverSeveralPaths) {
  SwapStoreOptions so = options("stripe");
  so.paths = {dir_->path(), dir2_->path()};
  auto store = SwapStore::open(so, *engine_);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  std::mt19937_64 rng(2);
  Tensor t = make_tensor(rng, 5 * 64 * 1024 + 777);  // six stripes
  ASSERT_TRUE((*store)->write_sync(1, t.buffer.data(), t.data.size()).ok());
  std::vector<std::byte> out(t.data.size());
  ASSERT_TRUE((*store)->read_sync(1, out.data(), out.size()).ok());
  EXPECT_TRUE(bytes_equal(t.data.data(), out.data(), out.size()));
  // Stripe 1 of the tensor lives at the start of the second file's data area.
  std::string second = swap_folder_path(dir2_->path(), "stripe", 0) + "/swap.bin";
  int fd = ::open(second.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::vector<std::byte> stripe(64 * 1024);
  ASSERT_EQ(pread(fd, stripe.data(), stripe.size(), static_cast<off_t>(so.index_bytes)),
            static_cast<ssize_t>(stripe.size()));
  ::close(fd);
  EXPECT_TRUE(bytes_equal(t.data.data() + 64 * 1024, stripe.data(), stripe.size()));
}

TEST_F(SwapStoreTest, SurvivesReopenWithDataVerified) {
  SwapStoreOptions so = options("reopen");
  so.paths = {dir_->path(), dir2_->path()};
  so.keep_files = true;
  std::mt19937_64 rng(3);
  std::vector<Tensor> tensors;
  for (int i = 0; i < 6; ++i) tensors.push_back(make_tensor(rng, 4096 * (1 + i * 7) + i * 13));
  {
    auto store = SwapStore::open(so, *engine_);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    for (int i = 0; i < 6; ++i) {
      ASSERT_TRUE((*store)->write_sync(1000 + i, tensors[i].buffer.data(), tensors[i].data.size()).ok());
    }
    ASSERT_TRUE((*store)->remove(1002).ok());
    ASSERT_TRUE((*store)->close().ok());
  }
  auto folders = list_swap_folders(dir_->path());
  ASSERT_TRUE(folders.ok());
  ASSERT_EQ(folders->size(), 1u);
  EXPECT_EQ((*folders)[0].state, SwapFolderState::kKept);
  // Creating a new store over kept files is refused with the fix.
  SwapStoreOptions fresh = so;
  fresh.keep_files = false;
  auto refused = SwapStore::open(fresh, *engine_);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(refused.status().message().find("strata swap clean"), std::string::npos);

  SwapStoreOptions again = so;
  again.open_existing = true;
  again.capacity_bytes = 0;
  again.keep_files = false;  // this time remove on close
  auto store = SwapStore::open(again, *engine_);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_EQ((*store)->ids(), (std::vector<TensorId>{1000, 1001, 1003, 1004, 1005}));
  for (int i : {0, 1, 3, 4, 5}) {
    std::vector<std::byte> out(tensors[i].data.size());
    ASSERT_TRUE((*store)->read_sync(1000 + i, out.data(), out.size()).ok());
    EXPECT_TRUE(bytes_equal(tensors[i].data.data(), out.data(), out.size()));
  }
  // The allocator was rebuilt: new tensors do not overlap old ones.
  Tensor extra = make_tensor(rng, 3 * 4096);
  ASSERT_TRUE((*store)->write_sync(7, extra.buffer.data(), extra.data.size()).ok());
  for (int i : {0, 1, 3, 4, 5}) {
    std::vector<std::byte> out(tensors[i].data.size());
    ASSERT_TRUE((*store)->read_sync(1000 + i, out.data(), out.size()).ok());
  }
  ASSERT_TRUE((*store)->close().ok());
  EXPECT_FALSE(std::filesystem::exists(swap_folder_path(dir_->path(), "reopen", 0)));
}

TEST_F(SwapStoreTest, CorruptionIsCaughtAndNamed) {
  SwapStoreOptions so = options("corrupt");
  auto store = SwapStore::open(so, *engine_);
  ASSERT_TRUE(store.ok());
  std::mt19937_64 rng(4);
  Tensor t = make_tensor(rng, 50000);
  ASSERT_TRUE((*store)->write_sync(42, t.buffer.data(), t.data.size()).ok());
  Extent e = *(*store)->extent_of(42);
  // Flip a byte behind the store's back.
  std::string file = swap_folder_path(dir_->path(), "corrupt", 0) + "/swap.bin";
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  off_t where = static_cast<off_t>(so.index_bytes + e.offset + 12345);
  unsigned char byte = 0;
  ASSERT_EQ(pread(fd, &byte, 1, where), 1);
  byte ^= 0x40;
  ASSERT_EQ(pwrite(fd, &byte, 1, where), 1);
  fsync(fd);
  ::close(fd);
  std::vector<std::byte> out(t.data.size());
  Status st = (*store)->read_sync(42, out.data(), out.size());
  ASSERT_EQ(st.code(), StatusCode::kDataLoss) << st.to_string();
  EXPECT_NE(st.message().find("tensor 42"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("extent [" + std::to_string(e.offset)), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("stored xxh3"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("read back"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(file), std::string::npos) << st.message();
  EXPECT_EQ((*store)->stats().verify_failures, 1u);
  EXPECT_EQ((*store)->verify_all().code(), StatusCode::kDataLoss);
}

// Tensors above the 8 MiB read chunk are verified chunk by chunk; a flipped
// byte in a late chunk is still caught, and a clean one still passes.
TEST_F(SwapStoreTest, LargeTensorIsVerifiedAcrossReadChunks) {
  SwapStoreOptions so = options("large");
  so.capacity_bytes = 24u << 20;
  auto store = SwapStore::open(so, *engine_);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  std::mt19937_64 rng(12);
  const uint64_t bytes = (20u << 20) + 333;
  Tensor t = make_tensor(rng, bytes);
  ASSERT_TRUE((*store)->write_sync(9, t.buffer.data(), bytes).ok());
  auto out = AlignedBuffer::allocate(bytes, 4096);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE((*store)->read_sync(9, out->data(), bytes).ok());
  EXPECT_TRUE(bytes_equal(t.data.data(), out->data(), bytes));
  Extent e = *(*store)->extent_of(9);
  std::string file = swap_folder_path(dir_->path(), "large", 0) + "/swap.bin";
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  off_t where = static_cast<off_t>(so.index_bytes + e.offset + (17u << 20) + 5);
  unsigned char byte = 0;
  ASSERT_EQ(pread(fd, &byte, 1, where), 1);
  byte ^= 1;
  ASSERT_EQ(pwrite(fd, &byte, 1, where), 1);
  fsync(fd);
  ::close(fd);
  Status st = (*store)->read_sync(9, out->data(), bytes);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.to_string();
}

TEST_F(SwapStoreTest, VerificationCanBeTurnedOff) {
  SwapStoreOptions so = options("noverify");
  so.verify_checksums = false;
  auto store = SwapStore::open(so, *engine_);
  ASSERT_TRUE(store.ok());
  std::mt19937_64 rng(5);
  Tensor t = make_tensor(rng, 8192);
  ASSERT_TRUE((*store)->write_sync(1, t.buffer.data(), t.data.size()).ok());
  Extent e = *(*store)->extent_of(1);
  std::string file = swap_folder_path(dir_->path(), "noverify", 0) + "/swap.bin";
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char junk = 0xA5;
  ASSERT_EQ(pwrite(fd, &junk, 1, static_cast<off_t>(so.index_bytes + e.offset)), 1);
  fsync(fd);
  ::close(fd);
  std::vector<std::byte> out(8192);
  EXPECT_TRUE((*store)->read_sync(1, out.data(), out.size()).ok());  // not checked, by request
  EXPECT_EQ((*store)->stats().verify_failures, 0u);
  EXPECT_EQ((*store)->verify_all().code(), StatusCode::kDataLoss);  // explicit verification still checks
}

TEST_F(SwapStoreTest, SecondJobOnSameFolderIsRefused) {
  auto first = SwapStore::open(options("locked"), *engine_);
  ASSERT_TRUE(first.ok());
  auto second = SwapStore::open(options("locked"), *engine_);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("in use by pid " + std::to_string(getpid())), std::string::npos)
      << second.status().message();
  auto folders = list_swap_folders(dir_->path());
  ASSERT_TRUE(folders.ok());
  ASSERT_EQ(folders->size(), 1u);
  EXPECT_EQ((*folders)[0].state, SwapFolderState::kActive);
  // An active folder is never cleaned.
  auto cleaned = clean_swap_folders(dir_->path(), CleanOptions{});
  ASSERT_TRUE(cleaned.ok());
  EXPECT_TRUE(cleaned->empty());
  // The first store still works.
  std::mt19937_64 rng(6);
  Tensor t = make_tensor(rng, 4096);
  EXPECT_TRUE((*first)->write_sync(1, t.buffer.data(), 4096).ok());
}

TEST_F(SwapStoreTest, StaleFoldersOfDeadJobsAreReportedAndCleaned) {
  // A child process opens a store and dies without closing it.
  pid_t child = fork_without_threads();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto engine = make_io_engine(IoEngineOptions{});
    SwapStoreOptions so = options("dead");
    if (!engine.ok()) _exit(2);
    auto store = SwapStore::open(so, **engine);
    _exit(store.ok() ? 0 : 1);  // no close(): the folder is left behind
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  ASSERT_NO_FATAL_FAILURE(start_engine());
  auto live = SwapStore::open(options("alive"), *engine_);
  ASSERT_TRUE(live.ok());
  auto folders = list_swap_folders(dir_->path());
  ASSERT_TRUE(folders.ok());
  ASSERT_EQ(folders->size(), 2u);
  EXPECT_EQ((*folders)[0].job, "alive");
  EXPECT_EQ((*folders)[0].state, SwapFolderState::kActive);
  EXPECT_EQ((*folders)[1].job, "dead");
  EXPECT_EQ((*folders)[1].state, SwapFolderState::kStale);
  EXPECT_EQ((*folders)[1].pid, child);
  EXPECT_GE((*folders)[1].bytes, 4u << 20);
  CleanOptions dry;
  dry.dry_run = true;
  auto would = clean_swap_folders(dir_->path(), dry);
  ASSERT_TRUE(would.ok());
  ASSERT_EQ(would->size(), 1u);
  EXPECT_TRUE(std::filesystem::exists((*would)[0].path));
  auto cleaned = clean_swap_folders(dir_->path(), CleanOptions{});
  ASSERT_TRUE(cleaned.ok());
  ASSERT_EQ(cleaned->size(), 1u);
  EXPECT_EQ((*cleaned)[0].job, "dead");
  EXPECT_FALSE(std::filesystem::exists(dir_->path() + "/strata-dead"));
  // A new job with a dead job's name reclaims its stale folder.
  live = FailedPrecondition("closed before the next fork");  // the store uses engine_
  pid_t child2 = fork_without_threads();
  ASSERT_GE(child2, 0);
  if (child2 == 0) {
    auto engine = make_io_engine(IoEngineOptions{});
    if (!engine.ok()) _exit(2);
    auto store = SwapStore::open(options("dead2"), **engine);
    _exit(store.ok() ? 0 : 1);
  }
  ASSERT_EQ(waitpid(child2, &status, 0), child2);
  ASSERT_NO_FATAL_FAILURE(start_engine());
  auto reclaimed = SwapStore::open(options("dead2"), *engine_);
  EXPECT_TRUE(reclaimed.ok()) << reclaimed.status().to_string();
}

TEST_F(SwapStoreTest, OutOfSpaceIsReportedUpFrontWithBytes) {
  SwapStoreOptions so = options("huge");
  so.capacity_bytes = 1ull << 50;  // 1 PiB
  auto store = SwapStore::open(so, *engine_);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(store.status().message().find("needed"), std::string::npos) << store.status().message();
  EXPECT_NE(store.status().message().find("available"), std::string::npos) << store.status().message();
  EXPECT_NE(store.status().message().find("TiB"), std::string::npos) << store.status().message();
  // Nothing was created.
  EXPECT_FALSE(std::filesystem::exists(dir_->path() + "/strata-huge/rank0/swap.bin"));
  EXPECT_FALSE(std::filesystem::exists(dir_->path() + "/strata-huge"));
}

TEST_F(SwapStoreTest, BadOptionsAreRejected) {
  SwapStoreOptions so = options("bad/name");
  EXPECT_EQ(SwapStore::open(so, *engine_).status().code(), StatusCode::kInvalidArgument);
  so = options();
  so.paths.clear();
  EXPECT_NE(SwapStore::open(so, *engine_).status().message().find("nvme_path"), std::string::npos);
  so = options();
  so.stripe_bytes = 1000;
  EXPECT_EQ(SwapStore::open(so, *engine_).status().code(), StatusCode::kInvalidArgument);
  so = options();
  so.open_existing = true;
  auto missing = SwapStore::open(so, *engine_);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  so = options("full");
  so.capacity_bytes = 64 * 1024;
  auto store = SwapStore::open(so, *engine_);
  ASSERT_TRUE(store.ok());
  std::vector<std::byte> big(128 * 1024);
  auto w = (*store)->write(1, big.data(), big.size());
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kResourceExhausted);
}

TEST_F(SwapStoreTest, CloseWithOperationsInFlightFails) {
  auto store = SwapStore::open(options("busy"), *engine_);
  ASSERT_TRUE(store.ok());
  std::mt19937_64 rng(8);
  Tensor t = make_tensor(rng, 1u << 20);
  auto h = (*store)->write(1, t.buffer.data(), t.data.size());
  ASSERT_TRUE(h.ok());
  Status st = (*store)->close();
  if (!st.ok()) {
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  }
  EXPECT_TRUE(h->wait().ok());
  EXPECT_TRUE((*store)->close().ok());
}

TEST(AioConfig, MapsTheConfigSection) {
  AioConfig aio;
  aio.block_size = 2 << 20;
  aio.queue_depth = 32;
  aio.intra_op_parallelism = 2;
  aio.single_submit = true;
  aio.overlap_events = false;
  aio.engine = AioEngineKind::kLibaio;
  aio.use_gds = true;
  auto cfg = io_engine_config(aio);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  EXPECT_EQ(cfg->options.block_size, 2u << 20);
  EXPECT_EQ(cfg->options.queue_depth, 32u);
  EXPECT_EQ(cfg->options.intra_op_parallelism, 2u);
  EXPECT_TRUE(cfg->options.single_submit);
  EXPECT_FALSE(cfg->options.overlap_events);
  EXPECT_EQ(cfg->options.engine, EngineKind::kLibaio);
  ASSERT_EQ(cfg->notes.size(), 1u);
  EXPECT_NE(cfg->notes[0].find("use_gds"), std::string::npos);
  aio.block_size = 1000;
  EXPECT_NE(io_engine_config(aio).status().message().find("aio.block_size"), std::string::npos);
}

// The block io-bench --sweep prints must be accepted as-is by the config parser.
TEST(AioConfig, SweepBlockParsesAsConfig) {
  IoEngineOptions o;
  o.block_size = 262144;
  o.queue_depth = 32;
  o.intra_op_parallelism = 2;
  for (EngineKind kind : {EngineKind::kIoUring, EngineKind::kLibaio, EngineKind::kPsync, EngineKind::kAuto}) {
    nlohmann::ordered_json doc;
    doc["aio"] = aio_config_block(o, kind);
    auto config = parse_config_text(doc.dump());
    ASSERT_TRUE(config.ok()) << config.status().to_string() << "\n" << doc.dump();
    auto back = io_engine_config(config->aio);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(back->options.block_size, o.block_size);
    EXPECT_EQ(back->options.queue_depth, o.queue_depth);
    EXPECT_EQ(back->options.intra_op_parallelism, o.intra_op_parallelism);
    EXPECT_EQ(back->options.engine, kind);
  }
}

TEST(FsProbe, ReportsTypeDirectIoAlignmentAndSpace) {
  ScratchDir dir(testing::disk_scratch_root());
  ASSERT_TRUE(dir.ok());
  auto probe = probe_path(dir.path());
  ASSERT_TRUE(probe.ok()) << probe.status().to_string();
  EXPECT_FALSE(probe->fs_type.empty());
  EXPECT_GT(probe->free_bytes, 0u);
  if (probe->direct_io) {
    EXPECT_GE(probe->direct_alignment, 512u);
    EXPECT_LE(probe->direct_alignment, 4096u);
  } else {
    EXPECT_FALSE(probe->direct_detail.empty());
  }
  std::string shm = testing::tmpfs_root();
  if (!shm.empty()) {
    auto p = probe_path(shm);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->fs_type, "tmpfs");
  }
  auto missing = probe_path(dir.path() + "/does-not-exist");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("does-not-exist"), std::string::npos);
}

}  // namespace
}  // namespace strata::nvme
