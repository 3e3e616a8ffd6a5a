// SwapStore: striped, preallocated, checksummed swap files. See swap_store.h.
//
// Note [Swap file layout]
// Every file: [header page (4 KiB)][entry table ... up to index_bytes][data].
// The header names the store (magic, version, job, rank, path index and
// count, stripe, sizes) and carries its own checksum; in the first path's
// file it also carries the entry count and the checksum of the entry table
// that follows it. Each entry is (tensor id, extent offset, extent length,
// tensor bytes, XXH3-64 of the bytes, flags). The table is written by
// flush() and close(keep_files); between flushes the in-memory table is the
// truth and a crash leaves the folder stale (its files are reclaimed by the
// next job of the same name or by `strata swap clean`).
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

#include "strata/core/units.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/checksum.h"
#include "strata/nvme/fs_probe.h"

namespace strata::nvme {
namespace {

constexpr char kMagic[8] = {'S', 'T', 'R', 'S', 'W', 'A', 'P', '1'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderPage = 4096;
constexpr const char* kSwapFileName = "swap.bin";
// Reads are issued in chunks of this size so verification overlaps the I/O.
constexpr uint64_t kVerifyChunkBytes = 8u << 20;

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
  uint64_t entry_count;
  uint64_t generation;
  uint64_t table_checksum;
  char job[72];
  uint64_t header_checksum;  // XXH3 of every byte before this field
};
static_assert(sizeof(DiskHeader) < kHeaderPage);

struct DiskEntry {
  uint64_t id;
  uint64_t offset;
  uint64_t length;
  uint64_t bytes;
  uint64_t checksum;
  uint64_t flags;
};
constexpr uint64_t kEntryValid = 1;

uint64_t header_checksum(const DiskHeader& h) { return checksum64(&h, offsetof(DiskHeader, header_checksum)); }

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

}  // namespace

namespace detail {

struct SwapOpState {
  SwapStore* store = nullptr;
  TensorId id = 0;
  bool is_write = false;
  Extent extent;
  uint64_t bytes = 0;
  void* data = nullptr;
  uint64_t expected_checksum = 0;
  bool verify = true;

  std::shared_ptr<SwapCounters> counters;
  std::atomic<int> remaining{1};
  std::mutex status_mu;
  Status io_status;
  // Reads are split into chunks with their own completions so that wait()
  // can hash chunk i while later chunks are still being read.
  std::vector<IoHandle> chunks;
  std::vector<uint64_t> chunk_bytes;

  void record(const Status& st) {
    if (st.ok()) return;
    std::lock_guard<std::mutex> lock(status_mu);
    if (io_status.ok()) io_status = st;
  }
  uint64_t checksum = 0;

  std::atomic<uint32_t> done{0};
  std::mutex wait_mu;
  bool checked = false;
  Status final_status;

  std::string describe() const {
    return fmt::format("tensor {} (extent [{}, +{}), {} bytes)", id, extent.offset, extent.length, bytes);
  }

  // The I/O and (for writes) the checksum both arrive; the last one finishes.
  void arrive() {
    if (remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    SwapStore* s = store;  // every record() happened before its arrive(); the acq_rel count orders them
    s->finish_op(id, io_status.ok(), checksum, is_write);
    if (!io_status.ok()) {
      final_status = io_status.with_context(fmt::format("swap {} of {}", is_write ? "write" : "read", describe()));
    }
    done.store(1, std::memory_order_release);
    done.notify_all();
    // Last touch of the store: the destructor waits for pending_ops_ to drain.
    if (s->pending_ops_.fetch_sub(1, std::memory_order_acq_rel) == 1) s->pending_ops_.notify_all();
  }
};

}  // namespace detail

bool SwapHandle::done() const {
  STRATA_CHECK(state_ != nullptr, "SwapHandle::done on an empty handle");
  return state_->done.load(std::memory_order_acquire) != 0;
}

Status SwapHandle::wait() {
  STRATA_CHECK(state_ != nullptr, "SwapHandle::wait on an empty handle");
  detail::SwapOpState& st = *state_;
  std::lock_guard<std::mutex> lock(st.wait_mu);
  if (st.checked) return st.final_status;
  // Hash each chunk as soon as it has arrived, in order, overlapping the
  // hashing with the reads of the chunks after it.
  std::optional<ChecksumStream> stream;
  uint64_t hash_ns = 0;
  if (!st.is_write && st.verify) {
    stream.emplace();
    uint64_t offset = 0;
    for (size_t i = 0; i < st.chunks.size(); ++i) {
      if (!st.chunks[i].wait().ok()) {
        stream.reset();
        break;
      }
      uint64_t t0 = now_ns();
      stream->update(static_cast<const std::byte*>(st.data) + offset, st.chunk_bytes[i]);
      hash_ns += now_ns() - t0;
      offset += st.chunk_bytes[i];
    }
  }
  while (st.done.load(std::memory_order_acquire) == 0) st.done.wait(0, std::memory_order_acquire);
  st.checked = true;
  if (!st.is_write && st.final_status.ok() && stream.has_value()) {
    uint64_t actual = stream->digest();
    st.counters->checksum_ns.fetch_add(hash_ns, std::memory_order_relaxed);
    if (actual != st.expected_checksum) {
      st.counters->verify_failures.fetch_add(1, std::memory_order_relaxed);
      st.final_status = DataLoss(fmt::format(
          "checksum mismatch reading {} from {}: stored xxh3 {:016x}, read back {:016x}; the swap data is "
          "corrupt (torn write, bit rot or a file changed behind Strata's back)",
          st.describe(), fmt::join(st.counters->file_paths, ", "), st.expected_checksum, actual));
    }
  }
  return st.final_status;
}

// ---------------------------------------------------------------------------

Status SwapStoreOptions::validate() const {
  if (paths.empty()) return InvalidArgument("swap store: no nvme_path given; set offload_*.nvme_path");
  STRATA_RETURN_IF_ERROR(validate_job_name(job));
  if (rank < 0) return InvalidArgument(fmt::format("swap store: rank {} is negative", rank));
  if (stripe_bytes == 0 || stripe_bytes % kHeaderPage != 0) {
    return InvalidArgument(fmt::format("swap store: stripe_bytes {} must be a positive multiple of 4096", stripe_bytes));
  }
  if (index_bytes < 2 * kHeaderPage || index_bytes % kHeaderPage != 0) {
    return InvalidArgument(fmt::format("swap store: index_bytes {} must be a multiple of 4096 and at least 8192",
                                       index_bytes));
  }
  if (capacity_bytes == 0 && !open_existing) {
    return InvalidArgument("swap store: capacity_bytes is 0; size it to the bytes this rank swaps out");
  }
  for (size_t i = 0; i < paths.size(); ++i) {
    for (size_t j = i + 1; j < paths.size(); ++j) {
      if (paths[i] == paths[j]) return InvalidArgument(fmt::format("swap store: nvme_path {} given twice", paths[i]));
    }
  }
  return Status::Ok();
}

SwapStore::SwapStore(const SwapStoreOptions& options, IoEngine& engine) : options_(options), engine_(engine) {}

Result<std::unique_ptr<SwapStore>> SwapStore::open(const SwapStoreOptions& options, IoEngine& engine) {
  STRATA_RETURN_IF_ERROR(options.validate());
  std::unique_ptr<SwapStore> store(new SwapStore(options, engine));
  Status st = options.open_existing ? store->reopen_files() : store->create_files();
  if (!st.ok()) {
    store->abandon();
    return st;
  }
  store->counters_->file_paths = store->file_paths();
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
  const uint64_t max_entries = (options_.index_bytes - kHeaderPage) / sizeof(DiskEntry);
  std::vector<DiskEntry> table;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, e] : entries_) {
      if (!e.valid) continue;
      table.push_back(DiskEntry{id, e.extent.offset, e.extent.length, e.bytes, e.checksum, kEntryValid});
    }
  }
  if (table.size() > max_entries) {
    return ResourceExhausted(fmt::format("swap index holds {} tensors at most (index_bytes {}); raise index_bytes",
                                         max_entries, options_.index_bytes));
  }
  std::sort(table.begin(), table.end(), [](const DiskEntry& a, const DiskEntry& b) { return a.id < b.id; });
  ++generation_;
  for (size_t i = 0; i < files_.size(); ++i) {
    bool has_table = with_index && i == 0;
    uint64_t table_bytes = table.size() * sizeof(DiskEntry);
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
    h.entry_count = has_table ? table.size() : 0;
    h.generation = generation_;
    if (has_table && !table.empty()) {
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
    STRATA_ASSIGN_OR_RETURN(pf.lock, SwapFolderLock::acquire(pf.folder, options_.job, options_.rank));
    files_.push_back(std::move(pf));
    auto id = engine_.open(files_.back().file_path, OpenMode::kReadWrite);
    if (!id.ok()) return id.status();
    files_.back().file = *id;
    files_.back().opened = true;
  }
  counters_->file_paths = file_paths();
  STRATA_RETURN_IF_ERROR(read_index());
  if (options_.verify_on_open) return verify_all().with_context("verifying reopened swap store");
  return Status::Ok();
}

Status SwapStore::read_index() {
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer page, AlignedBuffer::allocate(kHeaderPage, kHeaderPage));
  DiskHeader first{};
  for (size_t i = 0; i < files_.size(); ++i) {
    STRATA_RETURN_IF_ERROR(engine_.read_sync(files_[i].file, 0, kHeaderPage, page.data()));
    DiskHeader h{};
    std::memcpy(&h, page.data(), sizeof(h));
    const std::string& path = files_[i].file_path;
    if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) {
      return DataLoss(fmt::format("{} is not a Strata swap file (bad magic)", path));
    }
    if (h.header_checksum != header_checksum(h)) {
      return DataLoss(fmt::format("{}: header checksum mismatch (stored {:016x}, computed {:016x})", path,
                                  h.header_checksum, header_checksum(h)));
    }
    if (h.version != kVersion) {
      return Unsupported(fmt::format("{}: swap format version {} (this build reads {})", path, h.version, kVersion));
    }
    if (h.path_index != i || h.path_count != files_.size() || h.rank != options_.rank ||
        std::string(h.job, strnlen(h.job, sizeof(h.job))) != options_.job) {
      return InvalidArgument(fmt::format(
          "{}: belongs to job '{}' rank {} as path {} of {}, but was opened as job '{}' rank {} path {} of {}; "
          "give the same nvme_paths in the same order",
          path, std::string(h.job, strnlen(h.job, sizeof(h.job))), h.rank, h.path_index, h.path_count, options_.job,
          options_.rank, i, files_.size()));
    }
    if (i == 0) first = h;
    else if (h.stripe_bytes != first.stripe_bytes || h.data_bytes_per_file != first.data_bytes_per_file) {
      return DataLoss(fmt::format("{}: stripe or size differs from {}", path, files_[0].file_path));
    }
  }
  options_.stripe_bytes = first.stripe_bytes;
  options_.index_bytes = first.index_bytes;
  data_bytes_per_file_ = first.data_bytes_per_file;
  granularity_ = first.granularity;
  generation_ = first.generation;
  options_.capacity_bytes = data_bytes_per_file_ * files_.size();
  allocator_ = std::make_unique<ExtentAllocator>(data_bytes_per_file_ * files_.size(), granularity_);
  uint64_t max_entries = (options_.index_bytes - kHeaderPage) / sizeof(DiskEntry);
  if (first.entry_count > max_entries) {
    return DataLoss(fmt::format("{}: index claims {} entries, room for {}", files_[0].file_path, first.entry_count,
                                max_entries));
  }
  uint64_t table_bytes = first.entry_count * sizeof(DiskEntry);
  if (table_bytes == 0) return Status::Ok();
  uint64_t read_bytes = (table_bytes + kHeaderPage - 1) / kHeaderPage * kHeaderPage;
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer table_buf, AlignedBuffer::allocate(read_bytes, kHeaderPage));
  STRATA_RETURN_IF_ERROR(engine_.read_sync(files_[0].file, kHeaderPage, read_bytes, table_buf.data()));
  uint64_t actual = checksum64(table_buf.data(), table_bytes);
  if (actual != first.table_checksum) {
    return DataLoss(fmt::format("{}: swap index checksum mismatch (stored {:016x}, computed {:016x})",
                                files_[0].file_path, first.table_checksum, actual));
  }
  std::vector<DiskEntry> table(first.entry_count);
  std::memcpy(table.data(), table_buf.data(), table_bytes);
  std::lock_guard<std::mutex> lock(mu_);
  for (const DiskEntry& d : table) {
    Extent extent{d.offset, d.length};
    Status st = allocator_->reserve(extent);
    if (!st.ok() || d.bytes > d.length) {
      return DataLoss(fmt::format("{}: index entry for tensor {} has an invalid extent [{}, +{}): {}",
                                  files_[0].file_path, d.id, d.offset, d.length, st.message()));
    }
    entries_[d.id] = Entry{d.id, extent, d.bytes, d.checksum, (d.flags & kEntryValid) != 0, 0};
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

void SwapStore::finish_op(TensorId id, bool ok, uint64_t checksum, bool is_write) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  STRATA_CHECK(it != entries_.end(), "swap store: operation finished for an unknown tensor");
  Entry& e = it->second;
  --e.pending;
  if (is_write) {
    e.valid = ok;
    e.checksum = checksum;
  }
}

Result<SwapHandle> SwapStore::write(TensorId id, const void* data, uint64_t bytes) {
  if (closed_) return FailedPrecondition(fmt::format("swap write of tensor {}: the store is closed", id));
  if (bytes == 0 || data == nullptr) {
    return InvalidArgument(fmt::format("swap write of tensor {}: empty tensor or null buffer", id));
  }
  auto state = std::make_shared<detail::SwapOpState>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) {
      uint64_t max_entries = (options_.index_bytes - kHeaderPage) / sizeof(DiskEntry);
      if (entries_.size() >= max_entries) {
        return ResourceExhausted(fmt::format("swap write of tensor {}: the index holds {} tensors at most; raise "
                                             "index_bytes", id, max_entries));
      }
      STRATA_ASSIGN_OR_RETURN(Extent extent, allocator_->allocate(bytes));
      it = entries_.emplace(id, Entry{id, extent, bytes, 0, false, 0}).first;
    } else {
      Entry& e = it->second;
      if (e.pending != 0) {
        return FailedPrecondition(fmt::format("swap write of tensor {}: {} operation(s) on it still in flight",
                                              id, e.pending));
      }
      if (e.extent.length < allocator_->round_up(bytes)) {
        STRATA_RETURN_IF_ERROR(allocator_->free(e.extent));
        auto extent = allocator_->allocate(bytes);
        if (!extent.ok()) {
          allocator_->reserve(e.extent).ignore();  // keep the old extent; its data stays valid
          return std::move(extent).status().with_context(fmt::format("swap write of tensor {}", id));
        }
        e.extent = *extent;
      }
      e.bytes = bytes;
    }
    Entry& e = it->second;
    e.valid = false;
    ++e.pending;
    state->extent = e.extent;
  }
  state->store = this;
  state->counters = counters_;
  state->id = id;
  state->is_write = true;
  state->bytes = bytes;
  state->data = const_cast<void*>(data);
  state->remaining.store(2);
  pending_ops_.fetch_add(1, std::memory_order_acq_rel);
  std::vector<IoSegment> segs = segments_for(state->extent, bytes, const_cast<void*>(data));
  engine_.submit(IoOp::kWrite, segs, [state](const Status& st) {
    state->record(st);
    state->arrive();
  });
  // Hash the bytes while the write is in flight (the engine only reads them).
  uint64_t t0 = now_ns();
  state->checksum = checksum64(data, bytes);
  counters_->checksum_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  counters_->bytes_written.fetch_add(bytes, std::memory_order_relaxed);
  state->arrive();
  return SwapHandle(state);
}

Result<SwapHandle> SwapStore::read(TensorId id, void* data, uint64_t bytes) {
  if (closed_) return FailedPrecondition(fmt::format("swap read of tensor {}: the store is closed", id));
  if (data == nullptr) return InvalidArgument(fmt::format("swap read of tensor {}: null buffer", id));
  auto state = std::make_shared<detail::SwapOpState>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) {
      return NotFound(fmt::format("swap read: tensor {} was never written to this store", id));
    }
    Entry& e = it->second;
    if (!e.valid) {
      return DataLoss(fmt::format("swap read of tensor {}: no valid data (its last write failed or is still in "
                                  "flight)", id));
    }
    if (bytes != e.bytes) {
      return InvalidArgument(fmt::format("swap read of tensor {}: asked for {} bytes, stored {}", id, bytes, e.bytes));
    }
    ++e.pending;
    state->extent = e.extent;
    state->expected_checksum = e.checksum;
  }
  state->store = this;
  state->counters = counters_;
  state->id = id;
  state->bytes = bytes;
  state->data = data;
  state->verify = options_.verify_checksums;
  const uint64_t chunk = kVerifyChunkBytes;
  const int chunk_count = static_cast<int>((bytes + chunk - 1) / chunk);
  state->remaining.store(chunk_count);
  state->chunks.reserve(static_cast<size_t>(chunk_count));
  state->chunk_bytes.reserve(static_cast<size_t>(chunk_count));
  pending_ops_.fetch_add(1, std::memory_order_acq_rel);
  counters_->bytes_read.fetch_add(bytes, std::memory_order_relaxed);
  for (uint64_t done = 0; done < bytes; done += chunk) {
    uint64_t length = std::min(chunk, bytes - done);
    std::vector<IoSegment> segs =
        segments_for(Extent{state->extent.offset + done, length}, length, static_cast<std::byte*>(data) + done);
    state->chunk_bytes.push_back(length);
    // Callbacks use only record()/arrive(), never the chunk vectors.
    state->chunks.push_back(engine_.submit(IoOp::kRead, segs, [state](const Status& st) {
      state->record(st);
      state->arrive();
    }));
  }
  return SwapHandle(state);
}

Status SwapStore::write_sync(TensorId id, const void* data, uint64_t bytes) {
  STRATA_ASSIGN_OR_RETURN(SwapHandle h, write(id, data, bytes));
  return h.wait();
}

Status SwapStore::read_sync(TensorId id, void* data, uint64_t bytes) {
  STRATA_ASSIGN_OR_RETURN(SwapHandle h, read(id, data, bytes));
  return h.wait();
}

Status SwapStore::remove(TensorId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return NotFound(fmt::format("swap remove: tensor {} is not in the store", id));
  if (it->second.pending != 0) {
    return FailedPrecondition(fmt::format("swap remove of tensor {}: operations on it are in flight", id));
  }
  STRATA_RETURN_IF_ERROR(allocator_->free(it->second.extent));
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
  return it->second.extent;
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
  bool saved = options_.verify_checksums;
  options_.verify_checksums = true;
  Status result;
  for (const auto& [id, bytes] : todo) {
    result = read_sync(id, buf.data(), bytes);
    if (!result.ok()) break;
  }
  options_.verify_checksums = saved;
  return result;
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
  return s;
}

}  // namespace strata::nvme
