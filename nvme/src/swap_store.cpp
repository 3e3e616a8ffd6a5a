// SwapStore: striped, preallocated, checksummed swap files. See swap_store.h.
//
// Note [Swap file layout]
// Every file: [header page (4 KiB)][tensor table ... up to index_bytes][data].
// The header names the store (magic, version, job, rank, path index and
// count, stripe, sizes, checksum block) and carries its own checksum; in the
// first path's file it also carries the tensor count, the table's size and
// the table's checksum. Format 2 (per-block checksums) table: per tensor a
// record (id, bytes, flags, run count, block count), its runs (tensor offset,
// length, data address) and one XXH3-64 per checksum block. Format 1 (one
// checksum per extent) is refused on reopen with the fix. The table is
// written by flush() and close(keep_files); between flushes the in-memory
// table is the truth and a crash leaves the folder stale (its files are
// reclaimed by the next job of the same name or by `strata swap clean`).
#include "strata/nvme/swap_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "strata/core/bounded_file.h"
#include "strata/core/units.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/checksum.h"
#include "strata/nvme/fs_probe.h"
#include "strata/nvme/swap_index.h"
#include "swap_op.h"
#include "verify_pool.h"

namespace strata::nvme {
namespace {

using swap_index::DiskHeader;
using swap_index::header_checksum;
using swap_index::kEntryValid;
using swap_index::kHeaderPage;
using swap_index::kMagic;
using swap_index::kMaxChecksumBlock;
using swap_index::kVersion;
constexpr const char* kSwapFileName = "swap.bin";
// Reads are issued in chunks of about this size so verification overlaps the I/O.
constexpr uint64_t kVerifyChunkBytes = 8u << 20;

}  // namespace

// ---------------------------------------------------------------------------

Status SwapStoreOptions::validate() const {
  if (paths.empty()) return InvalidArgument("swap store: no nvme_path given; set offload_*.nvme_path");
  STRATA_RETURN_IF_ERROR(validate_job_name(job));
  if (rank < 0) return InvalidArgument(fmt::format("swap store: rank {} is negative", rank));
  if (stripe_bytes == 0 || stripe_bytes % kHeaderPage != 0) {
    return InvalidArgument(fmt::format("swap store: stripe_bytes {} must be a positive multiple of 4096", stripe_bytes));
  }
  if (index_bytes != 0 && (index_bytes < 2 * kHeaderPage || index_bytes % kHeaderPage != 0)) {
    return InvalidArgument(fmt::format(
        "swap store: index_bytes {} must be 0 (sized from the capacity) or a multiple of 4096 and at least 8192",
        index_bytes));
  }
  if (checksum_block_bytes == 0 || checksum_block_bytes % kHeaderPage != 0 ||
      checksum_block_bytes > kMaxChecksumBlock) {
    return InvalidArgument(fmt::format(
        "swap store: checksum_block_bytes {} must be a multiple of 4096 between 4 KiB and 8 MiB (default 65536)",
        checksum_block_bytes));
  }
  if (verify_threads == 0 || verify_threads > 64) {
    return InvalidArgument(fmt::format("swap store: verify_threads {} must be between 1 and 64 (default 2)",
                                       verify_threads));
  }
  if (capacity_bytes == 0 && !open_existing) {
    return InvalidArgument("swap store: capacity_bytes is 0; size it to the bytes this rank swaps out");
  }
  for (size_t i = 0; i < paths.size(); ++i) {
    STRATA_RETURN_IF_ERROR(check_path_text(paths[i], "swap store: nvme_path"));
    for (size_t j = i + 1; j < paths.size(); ++j) {
      if (paths[i] == paths[j]) return InvalidArgument(fmt::format("swap store: nvme_path {} given twice", paths[i]));
    }
  }
  return Status::Ok();
}

SwapStore::SwapStore(const SwapStoreOptions& options, IoEngine& engine) : options_(options), engine_(engine) {
  set_block(options_.checksum_block_bytes);
  if (options_.index_bytes == 0) {
    // Room for the block checksums of a full store plus 1 MiB of records and runs.
    uint64_t blocks = (options_.capacity_bytes + block_ - 1) / block_;
    options_.index_bytes = (kHeaderPage + (1u << 20) + blocks * 8 + kHeaderPage - 1) / kHeaderPage * kHeaderPage;
  }
  pool_ = std::make_unique<VerifyPool>(options_.verify_threads);
}

void SwapStore::set_block(uint64_t block) {
  block_ = block;
  chunk_ = std::max<uint64_t>(1, kVerifyChunkBytes / block_) * block_;
}

std::string SwapStore::name() const {
  std::vector<std::string> folders;
  for (const PathFile& f : files_) folders.push_back(f.folder);
  return fmt::format("swap store of job '{}' rank {} ({})", options_.job, options_.rank, fmt::join(folders, ", "));
}

uint64_t SwapStore::index_capacity() const { return options_.index_bytes - kHeaderPage; }

std::string SwapStore::locate(uint64_t address) const {
  const uint64_t stripe = options_.stripe_bytes;
  const uint64_t k = address / stripe;
  const PathFile& f = files_[k % files_.size()];
  return fmt::format("{} offset {}", f.file_path, options_.index_bytes + (k / files_.size()) * stripe + address % stripe);
}

Result<std::unique_ptr<SwapStore>> SwapStore::open(const SwapStoreOptions& options, IoEngine& engine) {
  STRATA_RETURN_IF_ERROR(options.validate());
  std::unique_ptr<SwapStore> store(new SwapStore(options, engine));
  Status st = options.open_existing ? store->reopen_files() : store->create_files();
  if (!st.ok()) {
    store->abandon();
    return st;
  }
  return store;
}

SwapStore::~SwapStore() {
  int64_t pending = pending_ops_.load(std::memory_order_acquire);
  while (pending != 0) {
    pending_ops_.wait(pending, std::memory_order_acquire);
    pending = pending_ops_.load(std::memory_order_acquire);
  }
  close().ignore();
}

std::vector<std::string> SwapStore::file_paths() const {
  std::vector<std::string> paths;
  for (const PathFile& f : files_) paths.push_back(f.file_path);
  return paths;
}

Status SwapStore::create_files() {
  const uint64_t paths = options_.paths.size();
  const uint64_t stripes = (options_.capacity_bytes + options_.stripe_bytes - 1) / options_.stripe_bytes;
  data_bytes_per_file_ = (stripes + paths - 1) / paths * options_.stripe_bytes;
  const uint64_t file_bytes = options_.index_bytes + data_bytes_per_file_;

  // 1. Lock every folder; refuse kept stores that would be overwritten.
  for (size_t i = 0; i < paths; ++i) {
    PathFile pf;
    pf.folder = swap_folder_path(options_.paths[i], options_.job, options_.rank);
    pf.file_path = pf.folder + "/" + kSwapFileName;
    STRATA_ASSIGN_OR_RETURN(pf.lock, SwapFolderLock::acquire(pf.folder, options_.job, options_.rank));
    struct stat st {};
    if (pf.lock.previous_state() == SwapFolderState::kKept && ::stat(pf.file_path.c_str(), &st) == 0) {
      pf.lock = SwapFolderLock();  // release without touching the kept files
      return AlreadyExists(fmt::format(
          "{} holds swap files kept by a previous run of job '{}'; reopen them (open_existing) or remove them "
          "with `strata swap clean --path {} --job {} --include-kept`",
          pf.folder, options_.job, options_.paths[i], options_.job));
    }
    files_.push_back(std::move(pf));
  }
  // 2. Check space on every file system before creating anything.
  std::map<dev_t, std::pair<uint64_t, std::string>> need;  // device -> bytes, paths
  std::map<dev_t, uint64_t> reclaim;
  for (const PathFile& pf : files_) {
    struct stat dir_st {};
    if (::stat(pf.folder.c_str(), &dir_st) != 0) return ErrnoStatus(errno, fmt::format("stat {}", pf.folder));
    auto& [bytes, names] = need[dir_st.st_dev];
    bytes += file_bytes;
    names += (names.empty() ? "" : ", ") + pf.folder;
    struct stat old {};
    if (::stat(pf.file_path.c_str(), &old) == 0) reclaim[dir_st.st_dev] += static_cast<uint64_t>(old.st_blocks) * 512;
  }
  for (const auto& [dev, want] : need) {
    const std::string& first = files_[0].folder;
    std::string probe_dir = want.second.substr(0, want.second.find(','));
    STRATA_ASSIGN_OR_RETURN(uint64_t avail, available_bytes(probe_dir.empty() ? first : probe_dir));
    avail += reclaim[dev];
    if (avail < want.first) {
      return ResourceExhausted(fmt::format(
          "not enough space for swap files: {} needed on the file system of {} ({} of data for rank {} + index), "
          "{} available; lower the swapped state, add nvme_paths, or free space",
          format_bytes(want.first, true), want.second, format_bytes(options_.capacity_bytes, true), options_.rank,
          format_bytes(avail, true)));
    }
  }
  // 3. Create and preallocate, 0600.
  for (PathFile& pf : files_) {
    ::unlink(pf.file_path.c_str());  // a stale file of a dead job with this name
    int fd = ::open(pf.file_path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoStatus(errno, fmt::format("create swap file {}", pf.file_path));
    fchmod(fd, 0600);
    int rc = fallocate(fd, 0, 0, static_cast<off_t>(file_bytes));
    int err = rc == 0 ? 0 : errno;
    if (rc != 0 && (err == EOPNOTSUPP || err == ENOSYS)) {
      rc = ftruncate(fd, static_cast<off_t>(file_bytes));
      err = rc == 0 ? 0 : errno;
    }
    ::close(fd);
    if (rc != 0) {
      ::unlink(pf.file_path.c_str());
      Status st = ErrnoStatus(err, fmt::format("preallocate {} for swap file {}", format_bytes(file_bytes, true),
                                               pf.file_path));
      return st;
    }
    auto id = engine_.open(pf.file_path, OpenMode::kReadWrite);
    if (!id.ok()) {
      ::unlink(pf.file_path.c_str());
      return id.status();
    }
    pf.file = *id;
    pf.opened = true;
  }
  for (const PathFile& pf : files_) {
    STRATA_ASSIGN_OR_RETURN(FileInfo info, engine_.file_info(pf.file));
    granularity_ = std::max<uint64_t>(granularity_, info.direct_alignment);
  }
  if (options_.stripe_bytes % granularity_ != 0) {
    return InvalidArgument(fmt::format("swap store: stripe_bytes {} is not a multiple of the direct-I/O alignment {}",
                                       options_.stripe_bytes, granularity_));
  }
  allocator_ = std::make_unique<ExtentAllocator>(data_bytes_per_file_ * paths, granularity_);
  return write_headers(true);
}

Status SwapStore::write_headers(bool with_index) {
  // Serialize the table: per tensor a record, its runs, its block checksums.
  std::vector<uint64_t> table;
  uint64_t count = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<TensorId> ids;
    for (const auto& [id, e] : entries_) {
      if (e.valid) ids.push_back(id);
    }
    std::sort(ids.begin(), ids.end());
    for (TensorId id : ids) {
      const Entry& e = entries_.at(id);
      table.insert(table.end(), {id, e.bytes, kEntryValid, e.runs.size(), e.sums.size()});
      for (const SwapRun& r : e.runs) table.insert(table.end(), {r.tensor_offset, r.length, r.data_offset});
      table.insert(table.end(), e.sums.begin(), e.sums.end());
      ++count;
    }
  }
  const uint64_t table_bytes = table.size() * sizeof(uint64_t);
  if (table_bytes > index_capacity()) {
    return ResourceExhausted(fmt::format(
        "{}: the index needs {} bytes for {} tensors (records, runs, block checksums), room for {}; raise "
        "index_bytes (0 sizes it from the capacity)",
        name(), table_bytes, count, index_capacity()));
  }
  ++generation_;
  for (size_t i = 0; i < files_.size(); ++i) {
    bool has_table = with_index && i == 0;
    uint64_t write_bytes = has_table ? (kHeaderPage + table_bytes + kHeaderPage - 1) / kHeaderPage * kHeaderPage
                                     : kHeaderPage;
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(write_bytes, kHeaderPage));
    DiskHeader h{};
    std::memcpy(h.magic, kMagic, sizeof(kMagic));
    h.version = kVersion;
    h.path_index = static_cast<uint32_t>(i);
    h.path_count = static_cast<uint32_t>(files_.size());
    h.rank = options_.rank;
    h.stripe_bytes = options_.stripe_bytes;
    h.index_bytes = options_.index_bytes;
    h.data_bytes_per_file = data_bytes_per_file_;
    h.granularity = granularity_;
    h.checksum_block = block_;
    h.entry_count = has_table ? count : 0;
    h.table_bytes = has_table ? table_bytes : 0;
    h.generation = generation_;
    if (has_table && table_bytes != 0) {
      std::memcpy(buf.data() + kHeaderPage, table.data(), table_bytes);
      h.table_checksum = checksum64(table.data(), table_bytes);
    }
    std::snprintf(h.job, sizeof(h.job), "%s", options_.job.c_str());
    h.header_checksum = header_checksum(h);
    std::memcpy(buf.data(), &h, sizeof(h));
    STRATA_RETURN_IF_ERROR(engine_.write_sync(files_[i].file, 0, write_bytes, buf.data()));
  }
  return Status::Ok();
}

Status SwapStore::flush() {
  if (closed_) return FailedPrecondition("swap store flush: the store is closed");
  if (pending_ops_.load() != 0) {
    return FailedPrecondition(fmt::format("swap store flush: {} operation(s) in flight; wait for them first",
                                          pending_ops_.load()));
  }
  STRATA_RETURN_IF_ERROR(write_headers(true));
  for (const PathFile& pf : files_) {
    int fd = ::open(pf.file_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, fmt::format("open {} for fdatasync", pf.file_path));
    int rc = fdatasync(fd);
    int err = errno;
    ::close(fd);
    if (rc != 0) return ErrnoStatus(err, fmt::format("fdatasync {}", pf.file_path));
  }
  return Status::Ok();
}

Status SwapStore::reopen_files() {
  for (size_t i = 0; i < options_.paths.size(); ++i) {
    PathFile pf;
    pf.folder = swap_folder_path(options_.paths[i], options_.job, options_.rank);
    pf.file_path = pf.folder + "/" + kSwapFileName;
    struct stat st {};
    if (::stat(pf.file_path.c_str(), &st) != 0) {
      return NotFound(fmt::format("reopen swap store: {} does not exist (no kept store for job '{}' rank {} on {})",
                                  pf.file_path, options_.job, options_.rank, options_.paths[i]));
    }
    // Never follow a link out of the swap folder (Note [No links in swap folders]).
    if (::lstat(pf.file_path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      return FailedPrecondition(fmt::format("reopen swap store: {} is not a regular file (a symbolic link?); swap "
                                            "files are never links, remove it",
                                            pf.file_path));
    }
    STRATA_ASSIGN_OR_RETURN(pf.lock, SwapFolderLock::acquire(pf.folder, options_.job, options_.rank));
    files_.push_back(std::move(pf));
    auto id = engine_.open(files_.back().file_path, OpenMode::kReadWrite);
    if (!id.ok()) return id.status();
    files_.back().file = *id;
    files_.back().opened = true;
  }
  STRATA_RETURN_IF_ERROR(read_index());
  if (options_.verify_on_open) return verify_all().with_context("verifying reopened swap store");
  return Status::Ok();
}

Status SwapStore::read_index() {
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer page, AlignedBuffer::allocate(kHeaderPage, kHeaderPage));
  DiskHeader first{};
  for (size_t i = 0; i < files_.size(); ++i) {
    STRATA_RETURN_IF_ERROR(engine_.read_sync(files_[i].file, 0, kHeaderPage, page.data()));
    const std::string& path = files_[i].file_path;
    STRATA_ASSIGN_OR_RETURN(
        DiskHeader h,
        swap_index::decode_header(page.data(), kHeaderPage, path,
                                  fmt::format("remove the kept store with `strata swap clean --path {} --job {} "
                                              "--include-kept`",
                                              options_.paths[i], options_.job)));
    if (h.path_index != i || h.path_count != files_.size() || h.rank != options_.rank ||
        swap_index::header_job(h) != options_.job) {
      return InvalidArgument(fmt::format(
          "{}: belongs to job '{}' rank {} as path {} of {}, but was opened as job '{}' rank {} path {} of {}; "
          "give the same nvme_paths in the same order",
          path, swap_index::header_job(h), h.rank, h.path_index, h.path_count, options_.job, options_.rank, i,
          files_.size()));
    }
    if (i == 0) first = h;
    else if (h.stripe_bytes != first.stripe_bytes || h.data_bytes_per_file != first.data_bytes_per_file ||
             h.index_bytes != first.index_bytes) {
      return DataLoss(fmt::format("{}: stripe or size differs from {}", path, files_[0].file_path));
    }
    // Every extent the index describes must lie inside the file.
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, fmt::format("stat {}", path));
    if (static_cast<uint64_t>(st.st_size) < h.index_bytes + h.data_bytes_per_file) {
      return DataLoss(fmt::format("{} is truncated: {} bytes, its header describes {} (index {} + data {})", path,
                                  st.st_size, h.index_bytes + h.data_bytes_per_file, h.index_bytes,
                                  h.data_bytes_per_file));
    }
  }
  options_.stripe_bytes = first.stripe_bytes;
  options_.index_bytes = first.index_bytes;
  data_bytes_per_file_ = first.data_bytes_per_file;
  granularity_ = first.granularity;
  generation_ = first.generation;
  const std::string& path0 = files_[0].file_path;
  set_block(first.checksum_block);
  options_.checksum_block_bytes = first.checksum_block;
  options_.capacity_bytes = data_bytes_per_file_ * files_.size();
  allocator_ = std::make_unique<ExtentAllocator>(data_bytes_per_file_ * files_.size(), granularity_);
  if (first.table_bytes == 0 && first.entry_count == 0) return Status::Ok();
  uint64_t read_bytes = (first.table_bytes + kHeaderPage - 1) / kHeaderPage * kHeaderPage;
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer table_buf, AlignedBuffer::allocate(std::max(read_bytes, kHeaderPage),
                                                                           kHeaderPage));
  if (read_bytes != 0) {
    STRATA_RETURN_IF_ERROR(engine_.read_sync(files_[0].file, kHeaderPage, read_bytes, table_buf.data()));
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<swap_index::IndexEntry> decoded,
                          swap_index::decode_table(first, table_buf.data(), read_bytes, path0));
  std::lock_guard<std::mutex> lock(mu_);
  for (swap_index::IndexEntry& d : decoded) {
    Entry e;
    e.id = d.id;
    e.bytes = d.bytes;
    e.valid = d.valid;
    e.runs = std::move(d.runs);
    e.sums = std::move(d.sums);
    for (const SwapRun& run : e.runs) {
      // The decoder checked the runs do not overlap; the allocator must agree.
      Status st = allocator_->reserve(Extent{run.data_offset, allocator_->round_up(run.length)});
      if (!st.ok()) return DataLoss(fmt::format("{}: tensor {}: {}", path0, e.id, st.message()));
    }
    table_bytes_ += record_bytes(e);
    entries_[e.id] = std::move(e);
  }
  return Status::Ok();
}

std::vector<IoSegment> SwapStore::segments_for(const Extent& extent, uint64_t bytes, void* data) const {
  std::vector<IoSegment> segs;
  const uint64_t stripe = options_.stripe_bytes;
  const uint64_t paths = files_.size();
  uint64_t v = extent.offset;
  uint64_t done = 0;
  while (done < bytes) {
    uint64_t k = v / stripe;
    uint64_t within = v % stripe;
    uint64_t len = std::min(stripe - within, bytes - done);
    FileId file = files_[k % paths].file;
    uint64_t offset = options_.index_bytes + (k / paths) * stripe + within;
    void* buf = static_cast<std::byte*>(data) + done;
    if (!segs.empty() && segs.back().file == file && segs.back().offset + segs.back().length == offset) {
      segs.back().length += len;
    } else {
      segs.push_back(IoSegment{file, offset, len, buf});
    }
    v += len;
    done += len;
  }
  return segs;
}

std::vector<IoSegment> SwapStore::segments_for_runs(const std::vector<SwapRun>& runs, uint64_t offset,
                                                     uint64_t length, std::byte* data) const {
  std::vector<IoSegment> segs;
  const uint64_t end = offset + length;
  for (const SwapRun& r : runs) {
    const uint64_t a = std::max(offset, r.tensor_offset);
    const uint64_t b = std::min(end, r.tensor_offset + r.length);
    if (a >= b) continue;
    std::vector<IoSegment> part =
        segments_for(Extent{r.data_offset + (a - r.tensor_offset), b - a}, b - a, data + (a - offset));
    for (const IoSegment& seg : part) {
      if (!segs.empty() && segs.back().file == seg.file && segs.back().offset + segs.back().length == seg.offset &&
          static_cast<std::byte*>(segs.back().buffer) + segs.back().length == seg.buffer) {
        segs.back().length += seg.length;
      } else {
        segs.push_back(seg);
      }
    }
  }
  return segs;
}

Status SwapStore::remove(TensorId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return NotFound(fmt::format("swap remove: tensor {} is not in the store", id));
  Entry& e = it->second;
  if (!e.inflight.empty()) {
    return FailedPrecondition(fmt::format("swap remove of tensor {}: {} operation(s) on it are in flight", id,
                                          e.inflight.size()));
  }
  for (const SwapRun& r : e.runs) {
    STRATA_RETURN_IF_ERROR(allocator_->free(Extent{r.data_offset, allocator_->round_up(r.length)}));
  }
  if (e.valid) table_bytes_ -= record_bytes(e);
  entries_.erase(it);
  return Status::Ok();
}

bool SwapStore::contains(TensorId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.count(id) != 0;
}

Result<uint64_t> SwapStore::size_of(TensorId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return NotFound(fmt::format("tensor {} is not in the swap store", id));
  return it->second.bytes;
}

Result<Extent> SwapStore::extent_of(TensorId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return NotFound(fmt::format("tensor {} is not in the swap store", id));
  const Entry& e = it->second;
  if (e.runs.size() != 1) {
    return FailedPrecondition(fmt::format("tensor {} lives in {} runs (range writes split it); use runs_of()", id,
                                          e.runs.size()));
  }
  return Extent{e.runs[0].data_offset, allocator_->round_up(e.runs[0].length)};
}

Result<std::vector<SwapRun>> SwapStore::runs_of(TensorId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return NotFound(fmt::format("tensor {} is not in the swap store", id));
  return it->second.runs;
}

std::vector<TensorId> SwapStore::ids() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TensorId> out;
  for (const auto& [id, e] : entries_) out.push_back(id);
  std::sort(out.begin(), out.end());
  return out;
}

Status SwapStore::verify_all() {
  std::vector<std::pair<TensorId, uint64_t>> todo;
  uint64_t largest = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, e] : entries_) {
      if (!e.valid) continue;
      todo.emplace_back(id, e.bytes);
      largest = std::max(largest, e.bytes);
    }
  }
  if (todo.empty()) return Status::Ok();
  std::sort(todo.begin(), todo.end());
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(largest, granularity_));
  for (const auto& [id, bytes] : todo) {
    // Verified on the verify threads, whatever verify_checksums says.
    STRATA_ASSIGN_OR_RETURN(SwapHandle h, start_read(id, 0, bytes, buf.data(), true, true));
    STRATA_RETURN_IF_ERROR(h.wait());
  }
  return Status::Ok();
}

void SwapStore::abandon() {
  closed_ = true;
  for (PathFile& pf : files_) {
    if (pf.opened) engine_.close(pf.file).ignore();
    pf.opened = false;
    if (options_.open_existing) {
      if (pf.lock.previous_state() == SwapFolderState::kKept) pf.lock.set_state(SwapFolderState::kKept).ignore();
      pf.lock = SwapFolderLock();
      continue;
    }
    ::unlink(pf.file_path.c_str());
    pf.lock.release_and_remove();
    ::rmdir(pf.folder.c_str());
    std::string job_dir = pf.folder.substr(0, pf.folder.rfind('/'));
    ::rmdir(job_dir.c_str());
  }
}

Status SwapStore::close() {
  if (closed_) return Status::Ok();
  if (pending_ops_.load() != 0) {
    return FailedPrecondition(fmt::format("swap store close: {} operation(s) in flight; wait for them first",
                                          pending_ops_.load()));
  }
  Status result;
  if (options_.keep_files) {
    result = flush();
    if (!result.ok()) return result;  // stay open: the caller may retry or close without keeping
  }
  closed_ = true;
  for (PathFile& pf : files_) {
    if (pf.opened) {
      Status st = engine_.close(pf.file);
      if (!st.ok() && result.ok()) result = st;
      pf.opened = false;
    }
    if (options_.keep_files) {
      Status ks = pf.lock.set_state(SwapFolderState::kKept);
      if (!ks.ok() && result.ok()) result = ks;
      pf.lock = SwapFolderLock();
      continue;
    }
    ::unlink(pf.file_path.c_str());
    pf.lock.release_and_remove();
    ::rmdir(pf.folder.c_str());
    std::string job_dir = pf.folder.substr(0, pf.folder.rfind('/'));
    ::rmdir(job_dir.c_str());  // only succeeds when no other rank is left
  }
  return result;
}

SwapStats SwapStore::stats() const {
  SwapStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.tensors = entries_.size();
    if (allocator_) {
      s.bytes_free = allocator_->free_bytes();
      s.bytes_used = allocator_->capacity() - allocator_->free_bytes();
    }
  }
  s.bytes_written = counters_->bytes_written.load();
  s.bytes_read = counters_->bytes_read.load();
  s.checksum_ns = counters_->checksum_ns.load();
  s.verify_failures = counters_->verify_failures.load();
  s.write_verify_failures = counters_->write_verify_failures.load();
  s.flips = counters_->flips.load();
  s.bytes_read_back = counters_->bytes_read_back.load();
  return s;
}

}  // namespace strata::nvme
