// Decoding of the swap index. See swap_index.h; compiled alone into the
// swap_index fuzz target, so it depends only on core's Status and the
// checksum.
#include "strata/nvme/swap_index.h"

#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>

#include "strata/nvme/checksum.h"

namespace strata::nvme::swap_index {

uint64_t header_checksum(const DiskHeader& h) { return checksum64(&h, offsetof(DiskHeader, header_checksum)); }

std::string header_job(const DiskHeader& h) { return std::string(h.job, strnlen(h.job, sizeof(h.job))); }

uint64_t data_capacity(const DiskHeader& header) {
  return header.data_bytes_per_file * static_cast<uint64_t>(header.path_count);
}

uint64_t reserved_bytes(const DiskHeader& header, uint64_t bytes) {
  return (bytes + header.granularity - 1) / header.granularity * header.granularity;
}

Result<DiskHeader> decode_header(const std::byte* page, size_t bytes, const std::string& path,
                                 const std::string& remove_hint) {
  if (bytes < sizeof(DiskHeader)) {
    return DataLoss(fmt::format("{}: swap file header is truncated ({} of {} bytes)", path, bytes,
                                sizeof(DiskHeader)));
  }
  DiskHeader h{};
  std::memcpy(&h, page, sizeof(h));
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) {
    return DataLoss(fmt::format("{} is not a Strata swap file (bad magic)", path));
  }
  // The version comes before the header checksum: the header's layout depends on it.
  if (h.version != kVersion) {
    return Unsupported(fmt::format(
        "{}: swap index format version {}, this build reads version {} only (version 2 keeps one checksum per "
        "checksum block for range I/O; version 1 kept one per extent). Rewrite the tensors with the build that "
        "wrote them{}",
        path, h.version, kVersion, remove_hint.empty() ? "" : ", or " + remove_hint));
  }
  if (h.header_checksum != header_checksum(h)) {
    return DataLoss(fmt::format("{}: header checksum mismatch (stored {:016x}, computed {:016x})", path,
                                h.header_checksum, header_checksum(h)));
  }
  // A header with a good checksum can still be crafted or written by a
  // buggy build: check every field the store divides by or adds up.
  auto bad = [&](const std::string& why) { return DataLoss(fmt::format("{}: invalid swap header: {}", path, why)); };
  if (h.path_count == 0 || h.path_count > 4096 || h.path_index >= h.path_count) {
    return bad(fmt::format("path {} of {}", h.path_index, h.path_count));
  }
  if (h.stripe_bytes == 0 || h.stripe_bytes % kHeaderPage != 0 || h.stripe_bytes > kMaxDataBytes) {
    return bad(fmt::format("stripe {} bytes (a positive multiple of 4096)", h.stripe_bytes));
  }
  if (h.index_bytes < 2 * kHeaderPage || h.index_bytes % kHeaderPage != 0 || h.index_bytes > kMaxDataBytes) {
    return bad(fmt::format("index {} bytes (a multiple of 4096, at least 8192)", h.index_bytes));
  }
  if (h.data_bytes_per_file % h.stripe_bytes != 0 || h.data_bytes_per_file > kMaxDataBytes / h.path_count) {
    return bad(fmt::format("{} data bytes per file over {} paths with a {} byte stripe", h.data_bytes_per_file,
                           h.path_count, h.stripe_bytes));
  }
  if (h.checksum_block == 0 || h.checksum_block % kHeaderPage != 0 || h.checksum_block > kMaxChecksumBlock ||
      h.granularity == 0 || h.checksum_block % h.granularity != 0) {
    return bad(fmt::format("checksum block {} / granularity {}", h.checksum_block, h.granularity));
  }
  if (h.table_bytes > h.index_bytes - kHeaderPage || h.table_bytes % sizeof(uint64_t) != 0) {
    return bad(fmt::format("a {} byte table, room for {}", h.table_bytes, h.index_bytes - kHeaderPage));
  }
  if (h.entry_count > h.table_bytes / (kRecordWords * sizeof(uint64_t))) {
    return bad(fmt::format("{} tensors in a {} byte table", h.entry_count, h.table_bytes));
  }
  return h;
}

Result<std::vector<IndexEntry>> decode_table(const DiskHeader& h, const std::byte* table_bytes, size_t available,
                                             const std::string& path) {
  if (available < h.table_bytes) {
    return DataLoss(fmt::format("{}: swap index table is truncated ({} of {} bytes)", path, available,
                                h.table_bytes));
  }
  uint64_t actual = checksum64(table_bytes, h.table_bytes);
  if (actual != h.table_checksum) {
    return DataLoss(fmt::format("{}: swap index checksum mismatch (stored {:016x}, computed {:016x})", path,
                                h.table_checksum, actual));
  }
  std::vector<uint64_t> table(h.table_bytes / sizeof(uint64_t));
  if (!table.empty()) std::memcpy(table.data(), table_bytes, h.table_bytes);
  const uint64_t capacity = data_capacity(h);
  const uint64_t block = h.checksum_block;
  size_t at = 0;
  auto take = [&](uint64_t n) -> const uint64_t* {
    if (table.size() - at < n) return nullptr;
    const uint64_t* p = table.data() + at;
    at += n;
    return p;
  };
  std::vector<IndexEntry> entries;
  std::set<TensorId> ids;
  std::map<uint64_t, uint64_t> used;  // reserved extents: offset -> end
  for (uint64_t t = 0; t < h.entry_count; ++t) {
    const uint64_t* rec = take(kRecordWords);
    if (rec == nullptr) return DataLoss(fmt::format("{}: index table ends inside tensor record {}", path, t));
    IndexEntry e;
    e.id = rec[0];
    e.bytes = rec[1];
    e.valid = (rec[2] & kEntryValid) != 0;
    const uint64_t run_count = rec[3];
    const uint64_t block_count = rec[4];
    auto bad = [&](const std::string& why) {
      return DataLoss(fmt::format("{}: index entry {} (tensor {}) is invalid: {}", path, t, e.id, why));
    };
    if (!ids.insert(e.id).second) return bad("the tensor id appears twice");
    if (e.bytes > capacity) return bad(fmt::format("{} bytes, more than the {} byte data space", e.bytes, capacity));
    if (block_count != (e.bytes + block - 1) / block) {
      return bad(fmt::format("{} block checksums for {} bytes", block_count, e.bytes));
    }
    const uint64_t left = table.size() - at;
    if (run_count > left / kRunWords || block_count > left - run_count * kRunWords) {
      return bad("the table ends inside its runs or checksums");
    }
    const uint64_t* runs = take(kRunWords * run_count);
    const uint64_t* sums = take(block_count);
    uint64_t covered = 0;
    for (uint64_t r = 0; r < run_count; ++r) {
      SwapRun run{runs[kRunWords * r], runs[kRunWords * r + 1], runs[kRunWords * r + 2]};
      if (run.tensor_offset != covered || run.length == 0 || run.length > e.bytes - covered) {
        return bad(fmt::format("run {} [{}, +{}) does not continue the tensor's bytes at {} of {}", r,
                               run.tensor_offset, run.length, covered, e.bytes));
      }
      const uint64_t reserved = reserved_bytes(h, run.length);
      if (run.data_offset % h.granularity != 0 || run.data_offset > capacity || reserved > capacity - run.data_offset) {
        return bad(fmt::format("run {} at data address {} (+{}) is outside the {} byte data space or unaligned", r,
                               run.data_offset, reserved, capacity));
      }
      const uint64_t end = run.data_offset + reserved;
      auto next = used.lower_bound(run.data_offset);
      bool overlaps = (next != used.end() && next->first < end) ||
                      (next != used.begin() && std::prev(next)->second > run.data_offset);
      if (overlaps) {
        return bad(fmt::format("run {} at data address [{}, {}) overlaps another run", r, run.data_offset, end));
      }
      used.emplace(run.data_offset, end);
      covered += run.length;
      e.runs.push_back(run);
    }
    if (covered != e.bytes) return bad(fmt::format("runs cover {} of {} bytes", covered, e.bytes));
    if (block_count != 0) e.sums.assign(sums, sums + block_count);
    entries.push_back(std::move(e));
  }
  if (at != table.size()) {
    return DataLoss(fmt::format("{}: swap index table has {} bytes after its {} tensor records", path,
                                (table.size() - at) * sizeof(uint64_t), h.entry_count));
  }
  return entries;
}

}  // namespace strata::nvme::swap_index
