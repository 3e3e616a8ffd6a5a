// Fuzz target: the swap store's index reader (header page + tensor table,
// nvme/swap_index.h), as a crashed or corrupted run leaves it on disk.
// Input: one flag byte, then the start of a swap file (header page, table).
// Flag bit 0 set: the target first recomputes the table and header
// checksums, so mutations reach the structural checks behind them instead
// of stopping at a checksum mismatch.
// Properties: a bad index is an error (DataLoss, or Unsupported for another
// format version) with a message naming the file, never a crash; an index
// that decodes describes tensors whose runs tile their bytes in order, lie
// inside the data space (and so inside the file the header describes) and
// do not overlap; ids are unique; one checksum per block.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "strata/nvme/checksum.h"
#include "strata/nvme/swap_index.h"

namespace {
namespace si = strata::nvme::swap_index;

[[noreturn]] void property_failed(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_swap_index: property failed: %s\n%s\n", what, detail.substr(0, 2000).c_str());
  std::abort();
}

const std::string kPath = "/nvme/strata-fuzz/rank0/swap.bin";

void check_error(const strata::Status& st) {
  if (st.ok()) property_failed("an error result with an OK status", "");
  if (!st.is_data_loss() && st.code() != strata::StatusCode::kUnsupported) {
    property_failed("a bad index gave neither DataLoss nor Unsupported", st.to_string());
  }
  if (st.message().find(kPath) == std::string::npos) property_failed("the error does not name the file", st.message());
}

void check_entries(const si::DiskHeader& h, const std::vector<si::IndexEntry>& entries) {
  if (entries.size() != h.entry_count) property_failed("entry count differs from the header", "");
  const uint64_t capacity = si::data_capacity(h);
  // The data space lies inside the file the header describes.
  if (capacity / h.path_count != h.data_bytes_per_file) property_failed("the data space wraps", "");
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  std::set<strata::nvme::TensorId> ids;
  for (const si::IndexEntry& e : entries) {
    if (!ids.insert(e.id).second) property_failed("a tensor id decoded twice", std::to_string(e.id));
    if (e.sums.size() != (e.bytes + h.checksum_block - 1) / h.checksum_block) {
      property_failed("checksum count does not match the size", std::to_string(e.id));
    }
    uint64_t covered = 0;
    for (const strata::nvme::SwapRun& r : e.runs) {
      if (r.tensor_offset != covered || r.length == 0) property_failed("runs do not tile the tensor", "");
      covered += r.length;
      const uint64_t reserved = si::reserved_bytes(h, r.length);
      if (reserved < r.length || r.data_offset > capacity || reserved > capacity - r.data_offset) {
        property_failed("a run lies outside the data space", std::to_string(r.data_offset));
      }
      extents.emplace_back(r.data_offset, r.data_offset + reserved);
    }
    if (covered != e.bytes) property_failed("runs do not cover the tensor", std::to_string(e.id));
  }
  std::sort(extents.begin(), extents.end());
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].first < extents[i - 1].second) property_failed("two runs overlap", "");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool fix_checksums = (data[0] & 1) != 0;
  std::vector<std::byte> file(reinterpret_cast<const std::byte*>(data + 1),
                              reinterpret_cast<const std::byte*>(data + size));
  const size_t page = std::min<size_t>(file.size(), si::kHeaderPage);
  if (fix_checksums && file.size() >= sizeof(si::DiskHeader)) {
    si::DiskHeader h{};
    std::memcpy(&h, file.data(), sizeof(h));
    const size_t available = file.size() - page;
    h.table_checksum = strata::nvme::checksum64(file.data() + page, std::min<uint64_t>(h.table_bytes, available));
    h.header_checksum = si::header_checksum(h);
    std::memcpy(file.data(), &h, sizeof(h));
  }
  auto header = si::decode_header(file.data(), page, kPath, "remove it");
  if (!header.ok()) {
    check_error(header.status());
    return 0;
  }
  auto entries = si::decode_table(*header, file.data() + page, file.size() - page, kPath);
  if (!entries.ok()) {
    check_error(entries.status());
    return 0;
  }
  check_entries(*header, *entries);
  return 0;
}
