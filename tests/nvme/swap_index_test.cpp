// The swap index decoder (swap_index.h) against files written by the store:
// a real index decodes to the store's own runs; truncation and crafted
// fields are DataLoss naming the file; a truncated swap file is refused on
// reopen. Issue 16 (the fuzz target tests/fuzz/fuzz_swap_index.cpp covers
// arbitrary bytes).
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include <gtest/gtest.h>

#include "nvme_test_util.h"
#include "strata/nvme/checksum.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_index.h"
#include "strata/nvme/swap_store.h"

namespace strata::nvme {
namespace {
namespace si = swap_index;

class SwapIndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<testing::ScratchDir>(STRATA_NVME_TEST_SCRATCH);
    IoEngineOptions eo;
    eo.engine = EngineKind::kPsync;
    auto engine = make_io_engine(eo);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    engine_ = std::move(*engine);
  }
  SwapStoreOptions options() const {
    SwapStoreOptions so;
    so.paths = {dir_->path()};
    so.job = "index";
    so.capacity_bytes = 4u << 20;
    so.index_bytes = 64u << 10;
    so.checksum_block_bytes = 16u << 10;
    so.keep_files = true;
    return so;
  }
  // Writes two tensors (one split by a range write) and closes, keeping the files.
  std::vector<std::vector<SwapRun>> write_store() {
    auto store = SwapStore::open(options(), *engine_);
    EXPECT_TRUE(store.ok()) << store.status().to_string();
    std::vector<std::byte> data(200000, std::byte{7});
    EXPECT_TRUE((*store)->write_sync(1, data.data(), data.size()).ok());
    EXPECT_TRUE((*store)->write_sync(2, data.data(), 5000).ok());
    auto h = (*store)->write_range(1, 32u << 10, std::span<const std::byte>(data.data(), 16u << 10));
    EXPECT_TRUE(h.ok() && h->wait().ok());
    std::vector<std::vector<SwapRun>> runs;
    for (TensorId id : {1, 2}) runs.push_back((*store)->runs_of(id).value());
    EXPECT_TRUE((*store)->close().ok());
    return runs;
  }
  std::vector<std::byte> file_prefix(size_t bytes) const {
    std::ifstream in(dir_->path() + "/strata-index/rank0/swap.bin", std::ios::binary);
    std::vector<char> all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    all.resize(std::min(all.size(), bytes));
    std::vector<std::byte> out(all.size());
    std::memcpy(out.data(), all.data(), all.size());
    return out;
  }
  std::unique_ptr<testing::ScratchDir> dir_;
  std::unique_ptr<IoEngine> engine_;
};

TEST_F(SwapIndexTest, RealIndexDecodesToTheStoresRuns) {
  auto runs = write_store();
  std::vector<std::byte> file = file_prefix(64u << 10);
  auto h = si::decode_header(file.data(), si::kHeaderPage, "swap.bin");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  auto entries = si::decode_table(*h, file.data() + si::kHeaderPage, file.size() - si::kHeaderPage, "swap.bin");
  ASSERT_TRUE(entries.ok()) << entries.status().to_string();
  ASSERT_EQ(entries->size(), 2u);
  EXPECT_EQ((*entries)[0].runs, runs[0]);
  EXPECT_GE((*entries)[0].runs.size(), 2u);  // the range write split tensor 1
  EXPECT_EQ((*entries)[1].runs, runs[1]);
  EXPECT_EQ((*entries)[1].sums.size(), 1u);
}

TEST_F(SwapIndexTest, TruncatedOrCraftedIndexIsDataLossNamingTheFile) {
  write_store();
  std::vector<std::byte> file = file_prefix(64u << 10);
  auto h = si::decode_header(file.data(), si::kHeaderPage, "swap.bin");
  ASSERT_TRUE(h.ok());
  // Truncated header and table.
  auto short_header = si::decode_header(file.data(), 100, "swap.bin");
  EXPECT_TRUE(short_header.status().is_data_loss());
  auto short_table = si::decode_table(*h, file.data() + si::kHeaderPage, h->table_bytes - 8, "swap.bin");
  EXPECT_TRUE(short_table.status().is_data_loss());
  EXPECT_NE(short_table.status().message().find("swap.bin: swap index table is truncated"), std::string::npos);
  // A crafted header with a valid checksum: a zero stripe would divide by zero later.
  si::DiskHeader bad = *h;
  bad.stripe_bytes = 0;
  bad.header_checksum = si::header_checksum(bad);
  std::vector<std::byte> page(file.begin(), file.begin() + si::kHeaderPage);
  std::memcpy(page.data(), &bad, sizeof(bad));
  auto crafted = si::decode_header(page.data(), page.size(), "swap.bin");
  EXPECT_TRUE(crafted.status().is_data_loss());
  EXPECT_NE(crafted.status().message().find("invalid swap header: stripe 0 bytes"), std::string::npos);
  // A crafted table: tensor 2's run moved onto tensor 1's first run (checksum fixed up).
  std::vector<uint64_t> words(h->table_bytes / 8);
  std::memcpy(words.data(), file.data() + si::kHeaderPage, h->table_bytes);
  // Tensor 1's record is first; tensor 2's record follows tensor 1's runs and sums.
  size_t t2 = si::kRecordWords + si::kRunWords * words[3] + words[4];
  ASSERT_EQ(words[t2], 2u);
  words[t2 + si::kRecordWords + 2] = words[si::kRecordWords + 2];  // same data address
  si::DiskHeader h2 = *h;
  h2.table_checksum = checksum64(words.data(), h->table_bytes);
  auto overlap = si::decode_table(h2, reinterpret_cast<const std::byte*>(words.data()), h->table_bytes, "swap.bin");
  EXPECT_TRUE(overlap.status().is_data_loss());
  EXPECT_NE(overlap.status().message().find("overlaps another run"), std::string::npos) << overlap.status().message();
}

TEST_F(SwapIndexTest, TruncatedSwapFileIsRefusedOnReopen) {
  write_store();
  std::string path = dir_->path() + "/strata-index/rank0/swap.bin";
  ASSERT_EQ(::truncate(path.c_str(), 64u << 10), 0);
  SwapStoreOptions so = options();
  so.open_existing = true;
  auto store = SwapStore::open(so, *engine_);
  ASSERT_FALSE(store.ok());
  EXPECT_TRUE(store.status().is_data_loss()) << store.status().to_string();
  EXPECT_NE(store.status().message().find("swap.bin is truncated"), std::string::npos) << store.status().message();
}

TEST_F(SwapIndexTest, SymlinkedSwapFileIsRefusedOnReopen) {
  write_store();
  std::string path = dir_->path() + "/strata-index/rank0/swap.bin";
  std::string elsewhere = dir_->path() + "/elsewhere.bin";
  ASSERT_EQ(::rename(path.c_str(), elsewhere.c_str()), 0);
  ASSERT_EQ(::symlink(elsewhere.c_str(), path.c_str()), 0);
  SwapStoreOptions so = options();
  so.open_existing = true;
  auto store = SwapStore::open(so, *engine_);
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find("swap.bin is not a regular file (a symbolic link?)"), std::string::npos)
      << store.status().message();
}

}  // namespace
}  // namespace strata::nvme
