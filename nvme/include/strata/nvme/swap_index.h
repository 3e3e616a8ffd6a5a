#pragma once
// The swap store's on-disk index (Note [Swap file layout] in
// swap_store.cpp): the header page of every swap file and the tensor table
// in the first one. Decoding is a pure function of the bytes, separate from
// the store, so it can be fuzzed alone (tests/fuzz/fuzz_swap_index.cpp).
// Internal to the swap store; public for tests and tools.
//
// A header or table that decodes is self-consistent: sizes are in range and
// cannot overflow, every run of every tensor lies inside the data space
// ([0, data_bytes_per_file x path_count)), the runs of a tensor tile its
// bytes in order, no two runs' reserved extents overlap, ids are unique and
// each tensor has one checksum per block. Anything else is DataLoss naming
// the file and what is wrong (Unsupported for another format version).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/nvme/swap_store.h"

namespace strata::nvme::swap_index {

inline constexpr char kMagic[8] = {'S', 'T', 'R', 'S', 'W', 'A', 'P', '1'};
// 2: per-block checksums and runs (1: one checksum per extent).
inline constexpr uint32_t kVersion = 2;
inline constexpr uint64_t kHeaderPage = 4096;
inline constexpr uint64_t kMaxChecksumBlock = 8u << 20;
inline constexpr uint64_t kEntryValid = 1;
// Words per table record (id, bytes, flags, run count, block count) and per run.
inline constexpr uint64_t kRecordWords = 5;
inline constexpr uint64_t kRunWords = 3;
// No data space beyond this (2^60 bytes): keeps every sum of sizes and
// offsets in the index far from wrapping.
inline constexpr uint64_t kMaxDataBytes = 1ull << 60;

struct DiskHeader {
  char magic[8];
  uint32_t version;
  uint32_t path_index;
  uint32_t path_count;
  int32_t rank;
  uint64_t stripe_bytes;
  uint64_t index_bytes;
  uint64_t data_bytes_per_file;
  uint64_t granularity;
  uint64_t checksum_block;
  uint64_t entry_count;
  uint64_t table_bytes;
  uint64_t generation;
  uint64_t table_checksum;
  char job[72];
  uint64_t header_checksum;  // XXH3 of every byte before this field
};
static_assert(sizeof(DiskHeader) < kHeaderPage);

// XXH3 of the header bytes before header_checksum.
uint64_t header_checksum(const DiskHeader& h);
// The job name recorded in the header (up to its first NUL).
std::string header_job(const DiskHeader& h);

// Decodes and checks one header page (`bytes` of it available). `path`
// names the file in errors; `remove_hint` is appended to the Unsupported
// error of another format version (how to remove the kept store).
Result<DiskHeader> decode_header(const std::byte* page, size_t bytes, const std::string& path,
                                 const std::string& remove_hint = "");

struct IndexEntry {
  TensorId id = 0;
  uint64_t bytes = 0;
  bool valid = false;
  std::vector<SwapRun> runs;   // tile [0, bytes) in order
  std::vector<uint64_t> sums;  // one per checksum block
};

// Decodes the tensor table that `header` (already decoded) describes from
// the `available` bytes that follow the header page: checks the table's
// checksum and every rule above.
Result<std::vector<IndexEntry>> decode_table(const DiskHeader& header, const std::byte* table, size_t available,
                                             const std::string& path);

// The data space the header describes: data_bytes_per_file x path_count.
uint64_t data_capacity(const DiskHeader& header);
// `bytes` rounded up to the header's granularity (the extent a run reserves).
uint64_t reserved_bytes(const DiskHeader& header, uint64_t bytes);

}  // namespace strata::nvme::swap_index
