// strata io-bench: sequential read and write throughput through the real
// IoEngine (O_DIRECT, aligned buffers registered with the engine), and a
// --sweep over block sizes, queue depths, thread counts and engines that
// ends with a ready-to-paste "aio" config block.
//
//   strata io-bench --path DIR [--size 4GiB] [--engine auto|io_uring|libaio|psync]
//                   [--block-size 1MiB] [--queue-depth 32] [--threads T]
//                   [--mode read|write|both] [--json] [--sweep]
//                   [--file NAME [--overwrite]]
//   strata io-bench --path DIR --swap [--tensor-size 64MiB] [--swap-inflight 4]
//                   [--swap-verify-writes on|off|both]
//
// --swap measures the path the engine uses instead of the raw engine:
// tensors written and read through a SwapStore (per-block checksums on the
// verify pool, verified reads; verify_writes as asked) from buffers of a
// SlotPool whose region is registered with the engine once (io_uring fixed
// buffers). The timed writes overwrite written space (a first, untimed pass
// lays the files out), like fio over a laid-out file.
//
// Every number a flag takes is range-checked (an error names the flag and
// the range). The test file stays inside --path: --file is a name in that
// folder (no '..', no link, nothing outside it), and an existing file is
// overwritten only when io-bench created it (it leaves a `.NAME.io-bench`
// marker recording the file's device and inode) or --overwrite is given.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "command.h"
#include "strata/core/device_registry.h"
#include "strata/core/pinned_pool.h"
#include "strata/core/printable.h"
#include "strata/core/slot_pool.h"
#include "strata/core/units.h"
#include "strata/nvme/aio_config.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/fs_probe.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_store.h"

namespace strata::cli {
namespace {

using nvme::EngineKind;
namespace fs = std::filesystem;

struct IoBenchOptions {
  std::string path;
  std::string size = "4GiB";
  std::string engine = "auto";
  std::string block_size = "1MiB";
  std::string queue_depth = "32";
  std::string threads = "1";
  std::string mode = "both";
  bool overwrite = false;
  bool json = false;
  bool sweep = false;
  bool keep = false;
  bool sqpoll = false;
  std::string file;  // fixed test file (kept), instead of a temporary one
  std::string sweep_block_sizes = "256KiB,1MiB,4MiB";
  std::string sweep_queue_depths = "8,32";
  std::string sweep_threads = "1,2";
  std::string huge_pages = "on";
  bool swap = false;
  std::string tensor_size = "64MiB";
  std::string swap_inflight = "4";
  std::string swap_verify_writes = "both";
};

struct Trial {
  EngineKind engine = EngineKind::kAuto;
  uint64_t block_size = 1u << 20;
  uint32_t queue_depth = 32;
  uint32_t threads = 1;
};

struct TrialResult {
  std::string engine;
  std::string mode;
  uint64_t block_size = 0;
  uint32_t queue_depth = 0;
  uint32_t threads = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  double gb_per_s = 0;
  std::string io = "direct";  // direct | buffered | mixed: how the pieces of this row reached the file
  std::string variant = "raw";  // raw (the engine) | swap (SwapStore, checksums on)
  int verify_writes = -1;       // swap rows: 0 / 1
  bool huge_pages = false;      // the buffers are backed by 2 MiB pages
  uint64_t pieces = 0;          // engine pieces of this row, and how many used a registered (fixed) buffer
  uint64_t fixed_pieces = 0;
  std::vector<std::string> notes;
};

// Limits of the numeric flags (the engine's own limits, see IoEngineOptions::validate).
constexpr uint64_t kMaxQueueDepth = 32768;
constexpr uint64_t kMaxThreads = 256;
constexpr uint64_t kMinBlock = 512;
constexpr uint64_t kMaxBlock = 1ull << 30;

// A whole number for `flag` in [lo, hi]; values that would wrap are refused, not cut.
Result<uint32_t> parse_ranged(const std::string& text, const std::string& flag, uint64_t lo, uint64_t hi) {
  auto v = parse_count(text, flag);
  if (!v.ok() || *v < lo || *v > hi) {
    return InvalidArgument(fmt::format("{} {}: must be a whole number between {} and {}", flag,
                                       text.size() > 40 ? text.substr(0, 40) + "..." : text, lo, hi));
  }
  return static_cast<uint32_t>(*v);
}

Result<uint64_t> parse_block(const std::string& text, const std::string& flag) {
  auto v = parse_bytes(text, flag);
  if (!v.ok() || *v < kMinBlock || *v > kMaxBlock || *v % 512 != 0) {
    return InvalidArgument(fmt::format("{} {}: must be a multiple of 512 bytes between 512 and 1GiB", flag,
                                       text.size() > 40 ? text.substr(0, 40) + "..." : text));
  }
  return *v;
}

// Streams `size` bytes sequentially through the engine, keeping up to
// 2 x threads x depth block requests outstanding.
Result<double> stream(nvme::IoEngine& engine, nvme::FileId file, nvme::IoOp op, uint64_t size, uint64_t block,
                      uint32_t outstanding_max, std::byte* window, uint64_t window_bytes) {
  std::deque<nvme::IoHandle> inflight;
  auto start = std::chrono::steady_clock::now();
  uint64_t offset = 0;
  Status first_error;
  while (offset < size || !inflight.empty()) {
    while (offset < size && inflight.size() < outstanding_max) {
      uint64_t length = std::min(block, size - offset);
      std::byte* buf = window + (offset % window_bytes);
      inflight.push_back(op == nvme::IoOp::kRead ? engine.read(file, offset, length, buf)
                                                 : engine.write(file, offset, length, buf));
      offset += length;
    }
    Status st = inflight.front().wait();
    inflight.pop_front();
    if (!st.ok() && first_error.ok()) first_error = st;
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!first_error.ok()) return first_error;
  return seconds;
}

// --huge-pages on: the buffers are 2 MiB-aligned and backed by 2 MiB pages
// (nvme::back_with_huge_pages; Note [Huge pages for I/O buffers] in
// nvme/src/aligned_buffer.cpp); off: 4 KiB pages, as fio's buffers are.
constexpr uintptr_t kHugePage = 2u << 20;

Status drop_cache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("open {}", path));
  fdatasync(fd);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return Status::Ok();
}

Result<std::vector<TrialResult>> run_trial(const std::string& file_path, uint64_t size, const Trial& trial,
                                           bool do_write, bool do_read, bool sqpoll, bool huge_pages) {
  struct stat before {};
  bool already_written = ::stat(file_path.c_str(), &before) == 0 && static_cast<uint64_t>(before.st_size) >= size &&
                         static_cast<uint64_t>(before.st_blocks) * 512 >= size;
  nvme::IoEngineOptions o;
  o.engine = trial.engine;
  o.block_size = trial.block_size;
  o.queue_depth = trial.queue_depth;
  o.intra_op_parallelism = trial.threads;
  o.sqpoll = sqpoll;
  o.huge_page_buffers = huge_pages;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoEngine> engine, nvme::make_io_engine(o));
  uint32_t outstanding = std::max<uint32_t>(2 * trial.threads * trial.queue_depth, 2);
  uint64_t window_bytes = std::min<uint64_t>(size, static_cast<uint64_t>(outstanding) * trial.block_size);
  window_bytes = (window_bytes + trial.block_size - 1) / trial.block_size * trial.block_size;
  // Pinned buffers from the core pool (mlock; pageable with one warning when RLIMIT_MEMLOCK refuses).
  std::vector<std::string> pool_warnings;
  PinnedPoolOptions pool_options;
  pool_options.warn = [&pool_warnings](std::string_view w) { pool_warnings.emplace_back(w); };
  if (huge_pages) pool_options.alignment_bytes = kHugePage;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<PinnedPool> pool, PinnedPool::create(nullptr, pool_options));
  STRATA_ASSIGN_OR_RETURN(PinnedBuffer window, pool->allocate(window_bytes));
  auto* window_data = window.as<std::byte>();
  for (size_t i = 0; i < window_bytes; i += 4096) window_data[i] = static_cast<std::byte>(i / 4096);
  std::string huge_note = huge_pages ? nvme::back_with_huge_pages(window_data, window_bytes) : "";
  if (!huge_note.empty()) pool_warnings.push_back(huge_note);
  STRATA_RETURN_IF_ERROR(engine->register_buffer(window_data, window_bytes));
  STRATA_ASSIGN_OR_RETURN(nvme::FileId file, engine->open(file_path, nvme::OpenMode::kCreate));
  std::vector<TrialResult> results;
  nvme::IoEngineStats before_stats = engine->stats();
  auto record = [&](const char* mode, double seconds) {
    TrialResult r;
    r.engine = std::string(nvme::engine_kind_name(engine->kind()));
    r.mode = mode;
    r.block_size = trial.block_size;
    r.queue_depth = trial.queue_depth;
    r.threads = trial.threads;
    r.huge_pages = huge_pages && huge_note.empty();
    r.bytes = size;
    r.seconds = seconds;
    r.gb_per_s = seconds > 0 ? static_cast<double>(size) / seconds / 1e9 : 0;
    r.notes = engine->notes();
    nvme::IoEngineStats stats = engine->stats();
    const uint64_t pieces = stats.pieces - before_stats.pieces;
    const uint64_t buffered = stats.buffered_pieces - before_stats.buffered_pieces;
    r.pieces = pieces;
    r.fixed_pieces = stats.fixed_buffer_pieces - before_stats.fixed_buffer_pieces;
    before_stats = stats;
    r.io = buffered == 0 ? "direct" : buffered == pieces ? "buffered" : "mixed";
    if (buffered > 0) {
      r.notes.push_back(fmt::format("{} of {} {} pieces went through the page cache (no O_DIRECT)", buffered, pieces,
                                    mode));
    }
    if (!window.pinned()) r.notes.push_back("buffer not pinned (RLIMIT_MEMLOCK); pageable memory used");
    for (const std::string& w : pool_warnings) r.notes.push_back(w);
    results.push_back(std::move(r));
  };
  // The file is preallocated (as swap files are), so writes overwrite.
  {
    int fd = ::open(file_path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, fmt::format("open {}", file_path));
    int rc = fallocate(fd, 0, 0, static_cast<off_t>(size));
    int err = errno;
    ::close(fd);
    if (rc != 0 && err != EOPNOTSUPP) {
      return ErrnoStatus(err, fmt::format("preallocate {} for {}", format_bytes(size, true), file_path));
    }
  }
  if (do_write) {
    STRATA_ASSIGN_OR_RETURN(double s, stream(*engine, file, nvme::IoOp::kWrite, size, trial.block_size, outstanding,
                                             window_data, window_bytes));
    record("write", s);
  }
  if (do_read) {
    if (!do_write && !already_written) {
      // Write every byte once, untimed: an unwritten extent reads as zeros without touching the disk.
      STRATA_ASSIGN_OR_RETURN(double s, stream(*engine, file, nvme::IoOp::kWrite, size, trial.block_size,
                                               outstanding, window_data, window_bytes));
      (void)s;
      before_stats = engine->stats();
    }
    STRATA_RETURN_IF_ERROR(drop_cache(file_path));
    STRATA_ASSIGN_OR_RETURN(double s, stream(*engine, file, nvme::IoOp::kRead, size, trial.block_size, outstanding,
                                             window_data, window_bytes));
    record("read", s);
  }
  STRATA_RETURN_IF_ERROR(engine->close(file));
  STRATA_RETURN_IF_ERROR(engine->unregister_buffer(window_data));
  return results;
}

// Note [io-bench --swap]
// The engine's swap path, timed: `inflight` tensors of `tensor_bytes` in
// flight through one SwapStore, their buffers slots of one SlotPool whose
// whole region is registered with the engine. Writes are shadow writes
// (fresh extent, hash on the verify pool while the chunks are written,
// read-back when verify_writes is on, then the index flips); reads are
// verified block by block while later chunks are read. An untimed first
// pass writes every tensor, plus the headroom shadow writes use, so the
// timed writes overwrite written blocks, as fio's do.
Result<std::vector<TrialResult>> run_swap_trial(const std::string& dir, uint64_t size, const Trial& trial,
                                                uint64_t tensor_bytes, uint32_t inflight, bool verify_writes,
                                                bool do_write, bool do_read, bool sqpoll, bool huge_pages) {
  nvme::IoEngineOptions o;
  o.engine = trial.engine;
  o.block_size = trial.block_size;
  o.queue_depth = trial.queue_depth;
  o.intra_op_parallelism = trial.threads;
  o.sqpoll = sqpoll;
  o.huge_page_buffers = huge_pages;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoEngine> engine, nvme::make_io_engine(o));
  std::vector<std::string> notes;
  DeviceOptions device_options;
  device_options.device_memory_bytes = std::max<uint64_t>(uint64_t{1} << 30, 2ull * inflight * tensor_bytes);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, make_device("cpu", device_options));
  SlotPoolOptions po;
  po.slot_count = inflight;
  po.slot_bytes = tensor_bytes;
  po.name = "io-bench swap buffers";
  if (huge_pages) po.alignment = kHugePage;
  std::unique_ptr<SlotPool> pool;
  std::vector<Slot> slots;
  nvme::AlignedBuffer fallback;
  std::byte* base = nullptr;
  size_t region = 0;
  bool huge = false;
  auto created = SlotPool::create(*device, po);
  if (created.ok()) {
    pool = std::move(*created);
    for (uint32_t i = 0; i < inflight; ++i) {
      STRATA_ASSIGN_OR_RETURN(Slot slot, pool->try_acquire("io-bench"));
      slots.push_back(std::move(slot));
    }
    base = static_cast<std::byte*>(pool->base());
    region = pool->total_bytes();
    std::string huge_note = huge_pages ? nvme::back_with_huge_pages(base, region) : "";
    if (!huge_note.empty()) notes.push_back(huge_note);
    huge = huge_pages && huge_note.empty();
  } else {
    // The engine's own staging would fail the same way; measure anyway, and say so.
    notes.push_back("slot pool could not be pinned (" + created.status().message() +
                    "); aligned pageable buffers registered instead");
    STRATA_ASSIGN_OR_RETURN(fallback, nvme::AlignedBuffer::allocate(static_cast<size_t>(inflight) * tensor_bytes, 4096));
    base = fallback.data();
    region = static_cast<size_t>(inflight) * tensor_bytes;
  }
  auto buffer = [&](uint32_t k) -> std::byte* {
    return pool ? slots[k].as<std::byte>() : base + static_cast<size_t>(k) * tensor_bytes;
  };
  for (uint32_t k = 0; k < inflight; ++k) {
    std::byte* b = buffer(k);
    for (uint64_t i = 0; i < tensor_bytes; i += 8) {
      uint64_t v = (i + 1) * 0x9e3779b97f4a7c15ull + k;
      std::memcpy(b + i, &v, std::min<uint64_t>(8, tensor_bytes - i));
    }
  }
  STRATA_RETURN_IF_ERROR(engine->register_buffer(base, region));
  const uint64_t count = size / tensor_bytes;
  const uint64_t headroom = static_cast<uint64_t>(inflight) + 1;
  nvme::SwapStoreOptions so;
  so.paths = {dir};
  so.job = fmt::format("io-bench-{}", getpid());
  so.capacity_bytes = (count + headroom) * tensor_bytes;
  so.verify_checksums = true;
  so.verify_writes = verify_writes;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::SwapStore> store, nvme::SwapStore::open(so, *engine));
  // Streams one pass over ids [0, n): each buffer is reused once its previous operation is done.
  auto pass = [&](bool write, uint64_t n) -> Result<double> {
    std::vector<nvme::SwapHandle> pending(inflight);
    auto start = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < n; ++i) {
      uint32_t k = static_cast<uint32_t>(i % inflight);
      if (pending[k].valid()) STRATA_RETURN_IF_ERROR(pending[k].wait());
      STRATA_ASSIGN_OR_RETURN(pending[k], write ? store->write(i, buffer(k), tensor_bytes)
                                                : store->read(i, buffer(k), tensor_bytes));
    }
    for (nvme::SwapHandle& h : pending) {
      if (h.valid()) STRATA_RETURN_IF_ERROR(h.wait());
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  STRATA_ASSIGN_OR_RETURN(double layout, pass(true, count + headroom));
  (void)layout;
  for (uint64_t i = count; i < count + headroom; ++i) STRATA_RETURN_IF_ERROR(store->remove(i));
  std::vector<TrialResult> results;
  nvme::IoEngineStats before = engine->stats();
  nvme::SwapStats swap_before = store->stats();
  auto record = [&](const char* mode, double seconds) {
    TrialResult r;
    r.engine = std::string(nvme::engine_kind_name(engine->kind()));
    r.mode = mode;
    r.block_size = trial.block_size;
    r.queue_depth = trial.queue_depth;
    r.threads = trial.threads;
    r.bytes = count * tensor_bytes;
    r.seconds = seconds;
    r.gb_per_s = seconds > 0 ? static_cast<double>(r.bytes) / seconds / 1e9 : 0;
    r.variant = "swap";
    r.huge_pages = huge;
    r.verify_writes = verify_writes ? 1 : 0;
    r.notes = engine->notes();
    nvme::IoEngineStats stats = engine->stats();
    nvme::SwapStats ss = store->stats();
    const uint64_t pieces = stats.pieces - before.pieces;
    const uint64_t buffered = stats.buffered_pieces - before.buffered_pieces;
    r.pieces = pieces;
    r.fixed_pieces = stats.fixed_buffer_pieces - before.fixed_buffer_pieces;
    r.io = buffered == 0 ? "direct" : buffered == pieces ? "buffered" : "mixed";
    if (buffered > 0) {
      r.notes.push_back(fmt::format("{} of {} swap {} pieces went through the page cache (no O_DIRECT)", buffered,
                                    pieces, mode));
    }
    const double hash_s = static_cast<double>(ss.checksum_ns - swap_before.checksum_ns) / 1e9;
    r.notes.push_back(fmt::format("swap {}: {} tensors of {}, {} in flight, checksums on, verify_writes {}; hashing "
                                  "took {:.3f} s on the verify pool ({:.1f} GB/s per thread){}",
                                  mode, count, format_bytes(tensor_bytes, true), inflight, verify_writes ? "on" : "off",
                                  hash_s, hash_s > 0 ? static_cast<double>(ss.bytes_written - swap_before.bytes_written +
                                                                           ss.bytes_read - swap_before.bytes_read +
                                                                           ss.bytes_read_back - swap_before.bytes_read_back) /
                                                           hash_s / 1e9
                                                     : 0.0,
                                  ss.bytes_read_back > swap_before.bytes_read_back
                                      ? fmt::format(", {} read back", format_bytes(ss.bytes_read_back -
                                                                                   swap_before.bytes_read_back, true))
                                      : ""));
    for (const std::string& n : notes) r.notes.push_back(n);
    before = stats;
    swap_before = ss;
    results.push_back(std::move(r));
  };
  if (do_write) {
    STRATA_ASSIGN_OR_RETURN(double s, pass(true, count));
    record("write", s);
  }
  if (do_read) {
    for (const std::string& f : store->file_paths()) STRATA_RETURN_IF_ERROR(drop_cache(f));
    STRATA_ASSIGN_OR_RETURN(double s, pass(false, count));
    record("read", s);
  }
  STRATA_RETURN_IF_ERROR(store->close());
  store.reset();
  STRATA_RETURN_IF_ERROR(engine->unregister_buffer(base));
  return results;
}

template <typename T, typename Parse>
Result<std::vector<T>> parse_list(const std::string& text, const std::string& flag, Parse parse) {
  std::vector<T> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(pos, comma - pos);
    if (!item.empty()) {
      STRATA_ASSIGN_OR_RETURN(T value, parse(item));
      out.push_back(value);
    }
    pos = comma + 1;
  }
  if (out.empty()) return InvalidArgument(fmt::format("{}: empty list", flag));
  return out;
}

nlohmann::ordered_json result_json(const TrialResult& r) {
  return nlohmann::ordered_json{{"engine", r.engine},       {"mode", r.mode},       {"block_size", r.block_size},
                        {"queue_depth", r.queue_depth}, {"threads", r.threads}, {"bytes", r.bytes},
                        {"seconds", r.seconds},     {"gb_per_s", r.gb_per_s}, {"io", r.io},
                        {"variant", r.variant}, {"huge_pages", r.huge_pages}, {"pieces", r.pieces}, {"fixed_buffer_pieces", r.fixed_pieces},
                        {"verify_writes", r.verify_writes < 0 ? nlohmann::ordered_json() : nlohmann::ordered_json(r.verify_writes == 1)},
                        {"notes", r.notes}};
}

// The marker io-bench leaves beside a test file it created: the file's
// device and inode, so a different file later given the same name is not
// taken for ours.
std::string marker_path(const std::string& dir, const std::string& name) { return dir + "/." + name + ".io-bench"; }

bool created_by_io_bench(const std::string& marker, const struct stat& st) {
  int fd = ::open(marker.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[128] = {};
  struct stat mst {};
  bool regular = ::fstat(fd, &mst) == 0 && S_ISREG(mst.st_mode);
  ssize_t n = regular ? ::pread(fd, buf, sizeof(buf) - 1, 0) : -1;
  ::close(fd);
  if (n <= 0) return false;
  return std::string(buf, static_cast<size_t>(n)) ==
         fmt::format("dev={} ino={}\n", static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
}

// Resolves --file inside --path (see the header comment) and creates the
// file when it is new. Returns the path to use.
Result<std::string> prepare_test_file(const std::string& dir, const std::string& file, bool overwrite, bool* created) {
  *created = false;
  std::string name = file;
  if (!file.empty() && file.front() == '/') {
    // An absolute path is accepted only when it names a file directly in --path.
    std::error_code ec1, ec2;
    fs::path parent = fs::canonical(fs::path(file).parent_path(), ec1);
    fs::path base = fs::canonical(dir, ec2);
    if (ec1 || ec2 || parent != base) {
      return InvalidArgument(fmt::format("--file {}: outside --path {}; give a file name inside --path",
                                         printable(file), printable(dir)));
    }
    name = fs::path(file).filename().string();
  }
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    return InvalidArgument(fmt::format(
        "--file {}: must be a file name inside --path {} (no '/', no '..'); io-bench writes only there",
        printable(file), printable(dir)));
  }
  std::string path = dir + "/" + name;
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode)) {
      return InvalidArgument(fmt::format("--file {}: {} is a symbolic link; io-bench does not follow links",
                                         printable(file), printable(path)));
    }
    if (!S_ISREG(st.st_mode)) {
      return InvalidArgument(fmt::format("--file {}: {} is not a regular file", printable(file), printable(path)));
    }
    if (!overwrite && !created_by_io_bench(marker_path(dir, name), st)) {
      return FailedPrecondition(fmt::format(
          "--file {}: {} exists and was not created by io-bench; its contents would be overwritten. Pass "
          "--overwrite to allow it, or give a new name",
          printable(file), printable(path)));
    }
    return path;
  }
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("create test file {}", path));
  ::fstat(fd, &st);
  ::close(fd);
  *created = true;
  std::string text = fmt::format("dev={} ino={}\n", static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
  std::string marker = marker_path(dir, name);
  int mfd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (mfd >= 0) {
    if (::write(mfd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
      ::close(mfd);
      ::unlink(marker.c_str());
    } else {
      ::close(mfd);
    }
  }
  return path;
}

int io_bench_failed(const Status& st) {
  fmt::print(stderr, "strata io-bench: {}\n", printable_message(st.to_string()));
  return 1;
}

int run_io_bench(const IoBenchOptions& opts) {
  if (opts.path.empty())
    return io_bench_failed(InvalidArgument("--path DIR is required (a directory on the drive to test)"));
  auto size = parse_bytes(opts.size, "--size");
  if (!size.ok()) return io_bench_failed(size.status());
  auto block = parse_block(opts.block_size, "--block-size");
  if (!block.ok()) return io_bench_failed(block.status());
  auto queue_depth = parse_ranged(opts.queue_depth, "--queue-depth", 1, kMaxQueueDepth);
  if (!queue_depth.ok()) return io_bench_failed(queue_depth.status());
  auto thread_count = parse_ranged(opts.threads, "--threads", 1, kMaxThreads);
  if (!thread_count.ok()) return io_bench_failed(thread_count.status());
  auto tensor_bytes = parse_bytes(opts.tensor_size, "--tensor-size");
  if (!tensor_bytes.ok() || *tensor_bytes < 4096 || *tensor_bytes > (4ull << 30) || *tensor_bytes % 4096 != 0) {
    return io_bench_failed(InvalidArgument(fmt::format(
        "--tensor-size {}: must be a multiple of 4096 bytes between 4KiB and 4GiB", opts.tensor_size.substr(0, 40))));
  }
  auto swap_inflight = parse_ranged(opts.swap_inflight, "--swap-inflight", 1, 64);
  if (!swap_inflight.ok()) return io_bench_failed(swap_inflight.status());
  if (opts.huge_pages != "on" && opts.huge_pages != "off") {
    return io_bench_failed(
        InvalidArgument(fmt::format("--huge-pages {}: use on or off", opts.huge_pages.substr(0, 40))));
  }
  const bool huge_pages = opts.huge_pages == "on";
  std::vector<bool> swap_verify_modes;
  if (opts.swap_verify_writes == "on" || opts.swap_verify_writes == "both") swap_verify_modes.push_back(true);
  if (opts.swap_verify_writes == "off" || opts.swap_verify_writes == "both") swap_verify_modes.push_back(false);
  if (swap_verify_modes.empty()) {
    return io_bench_failed(InvalidArgument(
        fmt::format("--swap-verify-writes {}: use on, off or both", opts.swap_verify_writes.substr(0, 40))));
  }
  if (opts.swap && *size < *tensor_bytes) {
    return io_bench_failed(
        InvalidArgument(fmt::format("--size {} is smaller than --tensor-size {}", opts.size, opts.tensor_size)));
  }
  if (opts.swap && !opts.file.empty())
    return io_bench_failed(InvalidArgument("--file: not used with --swap (it uses swap folders)"));
  auto engine = nvme::parse_engine_kind(opts.engine, "--engine");
  if (!engine.ok()) return io_bench_failed(engine.status());
  if (opts.mode != "read" && opts.mode != "write" && opts.mode != "both") {
    return io_bench_failed(InvalidArgument(fmt::format("--mode {}: use read, write or both", opts.mode)));
  }
  if (*size < *block) {
    return io_bench_failed(
        InvalidArgument(fmt::format("--size {} is smaller than --block-size {}", opts.size, opts.block_size)));
  }
  auto probe = nvme::probe_path(opts.path);
  if (!probe.ok()) return io_bench_failed(probe.status().with_context("--path"));
  if (probe->free_bytes < *size) {
    return io_bench_failed(
        ResourceExhausted(fmt::format("--path {}: {} needed for the test file, {} available; lower --size", opts.path,
                                      format_bytes(*size, true), format_bytes(probe->free_bytes, true))));
  }
  bool do_write = opts.mode != "read";
  bool do_read = opts.mode != "write";

  std::vector<Trial> trials;
  if (opts.sweep) {
    auto blocks = parse_list<uint64_t>(opts.sweep_block_sizes, "--sweep-block-sizes",
                                       [](const std::string& s) { return parse_block(s, "--sweep-block-sizes"); });
    auto depths = parse_list<uint32_t>(opts.sweep_queue_depths, "--sweep-queue-depths", [](const std::string& s) {
      return parse_ranged(s, "--sweep-queue-depths", 1, kMaxQueueDepth);
    });
    auto threads = parse_list<uint32_t>(opts.sweep_threads, "--sweep-threads", [](const std::string& s) {
      return parse_ranged(s, "--sweep-threads", 1, kMaxThreads);
    });
    if (!blocks.ok()) return io_bench_failed(blocks.status());
    if (!depths.ok()) return io_bench_failed(depths.status());
    if (!threads.ok()) return io_bench_failed(threads.status());
    std::vector<EngineKind> engines;
    if (*engine == EngineKind::kAuto) {
      for (const nvme::EngineProbe& p : nvme::probe_engines()) {
        if (p.works) engines.push_back(p.kind);
      }
    } else {
      engines.push_back(*engine);
    }
    for (EngineKind e : engines)
      for (uint64_t b : *blocks)
        for (uint32_t d : *depths)
          for (uint32_t t : *threads) {
            if (b <= *size) trials.push_back(Trial{e, b, d, t});
          }
  } else {
    trials.push_back(Trial{*engine, *block, *queue_depth, *thread_count});
  }
  for (const Trial& t : trials) {
    nvme::IoEngineOptions o;
    o.block_size = t.block_size;
    o.queue_depth = t.queue_depth;
    o.intra_op_parallelism = t.threads;
    Status st = o.validate();
    if (!st.ok()) return io_bench_failed(st);
  }

  bool created = false;
  std::string file_path;  // --swap uses swap folders instead
  if (!opts.swap) {
    auto prepared = prepare_test_file(
        opts.path, opts.file.empty() ? fmt::format("strata-io-bench-{}.dat", getpid()) : opts.file, opts.overwrite,
        &created);
    if (!prepared.ok()) return io_bench_failed(prepared.status());
    file_path = *prepared;
  }
  bool keep = opts.keep || !opts.file.empty();
  auto remove_test_file = [&] {
    if (keep || file_path.empty()) return;
    ::unlink(file_path.c_str());
    const std::string name = fs::path(file_path).filename().string();
    ::unlink(marker_path(opts.path, name).c_str());
  };
  if (!opts.json) {
    fmt::print("strata io-bench: {} on {} ({}), {} per run, O_DIRECT {}\n", opts.path, probe->fs_type,
               format_bytes(probe->free_bytes, true) + " free", format_bytes(*size, true),
               probe->direct_io ? fmt::format("yes (alignment {} B)", probe->direct_alignment)
                                : "no: " + probe->direct_detail + " (buffered: page-cache speed, not the drive's)");
    fmt::print("{:<9} {:<6} {:>10} {:>6} {:>8} {:>10} {:>9} {:>8}\n", "engine", "mode", "block", "depth", "threads",
               "bytes", "seconds", "GB/s");
  }
  std::vector<TrialResult> all;
  std::vector<std::string> notes;
  auto take = [&](Result<std::vector<TrialResult>> results) -> bool {
    if (!results.ok()) {
      remove_test_file();
      io_bench_failed(results.status());
      return false;
    }
    for (TrialResult& r : *results) {
      if (!opts.json) {
        fmt::print("{:<9} {:<6} {:>10} {:>6} {:>8} {:>10} {:>9.3f} {:>8.3f}{}\n", r.engine, r.mode,
                   format_bytes(r.block_size, true), r.queue_depth, r.threads, format_bytes(r.bytes, true), r.seconds,
                   r.gb_per_s,
                   r.variant == "swap" ? fmt::format("  swap, verify_writes {}", r.verify_writes ? "on" : "off") : "");
        std::fflush(stdout);
      }
      for (const std::string& n : r.notes) {
        if (std::find(notes.begin(), notes.end(), n) == notes.end()) notes.push_back(n);
      }
      all.push_back(std::move(r));
    }
    return true;
  };
  for (const Trial& t : trials) {
    if (opts.swap) {
      for (bool vw : swap_verify_modes) {
        if (!take(run_swap_trial(opts.path, *size, t, *tensor_bytes, *swap_inflight, vw, do_write, do_read,
                                 opts.sqpoll, huge_pages))) {
          return 1;
        }
      }
    } else if (!take(run_trial(file_path, *size, t, do_write, do_read, opts.sqpoll, huge_pages))) {
      return 1;
    }
  }
  remove_test_file();

  nlohmann::ordered_json aio;
  if (opts.sweep) {
    // Best configuration by combined throughput of the modes measured.
    std::map<std::tuple<std::string, uint64_t, uint32_t, uint32_t>, double> score;
    for (const TrialResult& r : all) score[{r.engine, r.block_size, r.queue_depth, r.threads}] += r.gb_per_s;
    auto best = std::max_element(score.begin(), score.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
    const auto& [e, b, d, t] = best->first;
    nvme::IoEngineOptions o;
    o.block_size = b;
    o.queue_depth = d;
    o.intra_op_parallelism = t;
    aio = nvme::aio_config_block(o, nvme::parse_engine_kind(e).value_or(EngineKind::kAuto));
  }
  if (opts.json) {
    nlohmann::ordered_json out;
    out["results"] = nlohmann::ordered_json::array();
    for (const TrialResult& r : all) out["results"].push_back(result_json(r));
    out["notes"] = notes;
    if (opts.sweep) out["aio"] = aio;
    fmt::print("{}\n", out.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
  } else {
    for (const std::string& n : notes) fmt::print("note: {}\n", n);
    if (opts.sweep) {
      fmt::print("\nBest configuration ({} of the modes measured); paste into your config:\n",
                 do_read && do_write ? "sum" : "throughput");
      fmt::print("\"aio\": {}\n", aio.dump(2));
      fmt::print("(the disk's speed may drift between runs: repeat a sweep before trusting small differences)\n");
    }
  }
  return 0;
}

CommandRegistration io_bench_command("io-bench", [](CLI::App& root) {
  auto opts = std::make_shared<IoBenchOptions>();
  CLI::App* cmd = root.add_subcommand("io-bench", "Measure sequential NVMe read/write throughput through the I/O engine");
  cmd->add_option("--path", opts->path, "Directory on the drive to test (a temporary file is created there)")->required();
  cmd->add_option("--size", opts->size, "Bytes per run (default 4GiB)");
  cmd->add_option("--engine", opts->engine, "auto|io_uring|libaio|psync (default auto; with --sweep: every working one)");
  cmd->add_option("--block-size", opts->block_size, "Bytes per request (aio.block_size, default 1MiB)");
  cmd->add_option("--queue-depth", opts->queue_depth, "Requests in flight per thread (aio.queue_depth, default 32)");
  cmd->add_option("--threads", opts->threads, "Rings / contexts / thread groups (aio.intra_op_parallelism, default 1)");
  cmd->add_option("--mode", opts->mode, "read|write|both (default both)");
  cmd->add_flag("--json", opts->json, "Print {\"results\":[...]} as JSON");
  cmd->add_flag("--sweep", opts->sweep, "Try block sizes, depths, threads and engines; print the best \"aio\" block");
  cmd->add_option("--sweep-block-sizes", opts->sweep_block_sizes, "Block sizes for --sweep (default 256KiB,1MiB,4MiB)");
  cmd->add_option("--sweep-queue-depths", opts->sweep_queue_depths, "Queue depths for --sweep (default 8,32)");
  cmd->add_option("--sweep-threads", opts->sweep_threads, "Thread counts for --sweep (default 1,2)");
  cmd->add_flag("--keep", opts->keep, "Keep the test file");
  cmd->add_flag("--sqpoll", opts->sqpoll, "io_uring: kernel submission-polling thread (costs a core)");
  cmd->add_option("--file", opts->file, "Use (and keep) this file name inside --path; reads skip the initial fill "
                                        "when it is already written");
  cmd->add_flag("--overwrite", opts->overwrite, "Allow --file to name an existing file io-bench did not create");
  cmd->add_option("--huge-pages", opts->huge_pages,
                  "on|off: back the I/O buffers with 2 MiB pages (default on; Note [Huge pages for I/O buffers])");
  cmd->add_flag("--swap", opts->swap, "Measure the engine's swap path: tensors through a SwapStore (checksums, "
                                      "verified reads) from a registered SlotPool");
  cmd->add_option("--tensor-size", opts->tensor_size, "--swap: bytes per tensor (default 64MiB)");
  cmd->add_option("--swap-inflight", opts->swap_inflight, "--swap: tensors in flight (default 4)");
  cmd->add_option("--swap-verify-writes", opts->swap_verify_writes,
                  "--swap: on|off|both: read each write back before the index flips (default both)");
  cmd->callback([opts] { exit_with(run_io_bench(*opts)); });
});

}  // namespace
}  // namespace strata::cli
