// The scheduled engine: file table, request queue, workers and completion
// checks shared by every backend. See Note [Engine structure] in
// engine_core.h.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "engine_core.h"
#include "file_probe.h"
#include "strata/core/bounded_file.h"
#include "strata/core/printable.h"
#include "strata/nvme/aligned_buffer.h"

namespace strata::nvme {

// ---------------------------------------------------------------------------
// Names and options

std::string_view engine_kind_name(EngineKind kind) {
  switch (kind) {
    case EngineKind::kAuto: return "auto";
    case EngineKind::kIoUring: return "io_uring";
    case EngineKind::kLibaio: return "libaio";
    case EngineKind::kPsync: return "psync";
  }
  return "unknown";
}

Result<EngineKind> parse_engine_kind(std::string_view text, std::string_view what) {
  if (text == "auto") return EngineKind::kAuto;
  if (text == "io_uring" || text == "uring") return EngineKind::kIoUring;
  if (text == "libaio" || text == "aio") return EngineKind::kLibaio;
  if (text == "psync" || text == "pread") return EngineKind::kPsync;
  return InvalidArgument(fmt::format("{}: unknown I/O engine '{}'; use one of auto, io_uring, libaio, psync",
                                     what, text));
}

std::string_view io_op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

Status IoEngineOptions::validate() const {
  if (block_size == 0 || block_size % 512 != 0 || block_size > (1ull << 30)) {
    return InvalidArgument(fmt::format(
        "aio.block_size = {}: must be a multiple of 512 between 512 and 1 GiB (DeepSpeed default 1048576)",
        block_size));
  }
  if (queue_depth == 0 || queue_depth > 32768) {
    return InvalidArgument(fmt::format("aio.queue_depth = {}: must be between 1 and 32768 (default 8)", queue_depth));
  }
  if (intra_op_parallelism == 0 || intra_op_parallelism > 256) {
    return InvalidArgument(fmt::format(
        "aio.intra_op_parallelism = {}: must be between 1 and 256 (rings or thread groups; default 1)",
        intra_op_parallelism));
  }
  if (max_files == 0 || max_files > 4096) {
    return InvalidArgument(fmt::format("max_files = {}: must be between 1 and 4096", max_files));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Handles

namespace detail {

void RequestState::record_error(Status status) {
  std::lock_guard<std::mutex> lock(error_mu);
  if (first_error.ok()) first_error = std::move(status);
  failed.store(true, std::memory_order_release);
}

void RequestState::finish() {
  {
    std::lock_guard<std::mutex> lock(error_mu);
    final_status = first_error;
  }
  // Move the callback out so what it captured is released once it ran
  // (callers may hold this request's handle inside that capture).
  IoCallback run = std::move(callback);
  callback = nullptr;
  if (run) run(final_status);
  run = nullptr;
  // No engine lock is held here (see Note [I/O completion rules]).
  source.complete(final_status);
}

}  // namespace detail

Completion IoHandle::completion() const {
  STRATA_CHECK(state_ != nullptr, "IoHandle::completion on an empty handle");
  return state_->completion;
}

uint64_t IoHandle::bytes() const { return state_ ? state_->total_bytes : 0; }

IoHandle IoEngine::read(FileId file, uint64_t offset, uint64_t length, void* buffer, IoCallback callback) {
  IoSegment seg{file, offset, length, buffer};
  return submit(IoOp::kRead, std::span<const IoSegment>(&seg, 1), std::move(callback));
}

IoHandle IoEngine::write(FileId file, uint64_t offset, uint64_t length, const void* buffer,
                         IoCallback callback) {
  IoSegment seg{file, offset, length, const_cast<void*>(buffer)};
  return submit(IoOp::kWrite, std::span<const IoSegment>(&seg, 1), std::move(callback));
}

Status IoEngine::read_sync(FileId file, uint64_t offset, uint64_t length, void* buffer) {
  return read(file, offset, length, buffer).wait();
}

Status IoEngine::write_sync(FileId file, uint64_t offset, uint64_t length, const void* buffer) {
  return write(file, offset, length, buffer).wait();
}

// ---------------------------------------------------------------------------
// The scheduled engine

namespace {

constexpr uint32_t kMaxRegions = 32;

struct FileSlot {
  bool in_use = false;
  bool writable = false;
  bool fixed = false;
  int direct_fd = -1;
  int buffered_fd = -1;
  uint32_t alignment = 4096;
  std::string path;
  std::string fallback_reason;
  std::atomic<int64_t> pending{0};  // requests referencing the file
};

struct Region {
  std::byte* data = nullptr;
  size_t bytes = 0;
  bool registered = false;
};

struct Worker {
  std::unique_ptr<Backend> backend;
  std::vector<Piece> slots;
  std::vector<uint32_t> free_slots;
  std::vector<uint32_t> fresh;  // slots taken in this round
  uint32_t inflight = 0;
  bool needs_submit = false;
  std::thread thread;
};

// Says "file system refuses O_DIRECT" once per file system per process.
void say_fallback_once(dev_t device, const std::string& message) {
  static std::mutex mu;
  static std::set<dev_t> said;
  std::lock_guard<std::mutex> lock(mu);
  if (said.insert(device).second) std::fprintf(stderr, "strata: nvme: %s\n", message.c_str());
}

class ScheduledEngine final : public IoEngine {
 public:
  ScheduledEngine(const IoEngineOptions& options, EngineKind kind)
      : options_(options), kind_(kind), files_(options.max_files) {}

  ~ScheduledEngine() override {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    for (Worker& w : workers_) {
      if (w.thread.joinable()) w.thread.join();
    }
    workers_.clear();  // backends (rings, contexts) close before the files
    for (FileSlot& f : files_) close_fds(f);
  }

  Status start(BackendFactory factory, BackendWrapper wrapper) {
    uint32_t worker_count = options_.intra_op_parallelism;
    uint32_t depth = options_.queue_depth;
    if (kind_ == EngineKind::kPsync) {
      // A synchronous thread keeps one piece in flight: queue_depth threads
      // per parallel group emulate one ring of that depth.
      worker_count = std::min<uint32_t>(options_.intra_op_parallelism * options_.queue_depth, 64);
      depth = 1;
    }
    workers_.resize(worker_count);
    for (uint32_t i = 0; i < worker_count; ++i) {
      BackendConfig cfg{i, depth, options_.max_files * 2, &options_};
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, factory(cfg, notes_));
      if (wrapper) backend = wrapper(std::move(backend), i);
      Worker& w = workers_[i];
      w.backend = std::move(backend);
      w.slots.resize(depth);
      for (uint32_t s = 0; s < depth; ++s) {
        w.slots[s].slot = s;
        w.free_slots.push_back(depth - 1 - s);
      }
    }
    fixed_files_ = options_.register_files && !workers_.empty() && workers_[0].backend->files_registered();
    for (uint32_t i = 0; i < worker_count; ++i) {
      workers_[i].thread = std::thread([this, i] { run_worker(workers_[i]); });
    }
    depth_per_worker_ = depth;
    return Status::Ok();
  }

  EngineKind kind() const override { return kind_; }
  const IoEngineOptions& options() const override { return options_; }

  std::string describe() const override {
    std::string text;
    switch (kind_) {
      case EngineKind::kIoUring:
        text = fmt::format("io_uring: {} ring(s) x depth {}{}{}", workers_.size(), depth_per_worker_,
                           fixed_files_ ? ", fixed files" : "", sqpoll_active() ? ", SQPOLL" : "");
        break;
      case EngineKind::kLibaio:
        text = fmt::format("libaio: {} context(s) x depth {}", workers_.size(), depth_per_worker_);
        break;
      default:
        text = fmt::format("psync: {} thread(s) (pread/pwrite)", workers_.size());
        break;
    }
    text += fmt::format(", block {} B", options_.block_size);
    if (options_.single_submit) text += ", single submit";
    if (!options_.overlap_events) text += ", batch completion";
    return text;
  }

  std::vector<std::string> notes() const override {
    std::lock_guard<std::mutex> lock(notes_mu_);
    return notes_;
  }

  Result<FileId> open(const std::string& path, OpenMode mode) override;
  Status close(FileId file) override;
  Result<FileInfo> file_info(FileId file) const override;
  Status register_buffer(void* data, size_t bytes) override;
  Status unregister_buffer(void* data) override;
  IoHandle submit(IoOp op, std::span<const IoSegment> segments, IoCallback callback) override;

  IoEngineStats stats() const override {
    IoEngineStats s;
    s.requests = requests_.load();
    s.pieces = pieces_.load();
    s.bytes_read = bytes_read_.load();
    s.bytes_written = bytes_written_.load();
    s.direct_pieces = direct_pieces_.load();
    s.buffered_pieces = buffered_pieces_.load();
    s.short_resubmits = short_resubmits_.load();
    s.transient_retries = transient_retries_.load();
    s.failed_requests = failed_requests_.load();
    s.fixed_buffer_pieces = fixed_buffer_pieces_.load();
    return s;
  }

 private:
  void add_note(std::string note) {
    std::lock_guard<std::mutex> lock(notes_mu_);
    if (std::find(notes_.begin(), notes_.end(), note) == notes_.end()) notes_.push_back(std::move(note));
  }
  static void close_fds(FileSlot& f) {
    if (f.direct_fd >= 0) ::close(f.direct_fd);
    if (f.buffered_fd >= 0) ::close(f.buffered_fd);
    f.direct_fd = f.buffered_fd = -1;
  }
  bool sqpoll_active() const {
    if (!options_.sqpoll) return false;
    for (const std::string& n : notes()) {
      if (n.find("SQPOLL refused") != std::string::npos) return false;
    }
    return true;
  }
  bool any_inflight() const { return inflight_requests_.load(std::memory_order_acquire) != 0; }

  void run_worker(Worker& w);
  void take_pieces(Worker& w, uint32_t max_pieces, bool block, bool* stop);
  void select_path(Piece& p) const;
  void on_result(Worker& w, Piece& p, int64_t result);
  void complete_piece(Worker& w, Piece& p, Status status);
  void fail_inflight(Worker& w, const Status& status);
  std::string piece_context(const Piece& p) const;

  IoEngineOptions options_;
  EngineKind kind_;
  std::vector<Worker> workers_;
  uint32_t depth_per_worker_ = 1;
  bool fixed_files_ = false;

  mutable std::mutex notes_mu_;
  std::vector<std::string> notes_;

  std::mutex files_mu_;
  std::vector<FileSlot> files_;

  std::array<Region, kMaxRegions> regions_{};
  std::atomic<uint32_t> region_count_{0};

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<detail::RequestState>> queue_;
  bool stopping_ = false;
  std::atomic<int64_t> inflight_requests_{0};

  std::atomic<uint64_t> requests_{0}, pieces_{0}, bytes_read_{0}, bytes_written_{0}, direct_pieces_{0},
      buffered_pieces_{0}, short_resubmits_{0}, transient_retries_{0}, failed_requests_{0},
      fixed_buffer_pieces_{0};
};

Result<FileId> ScheduledEngine::open(const std::string& path, OpenMode mode) {
  std::lock_guard<std::mutex> lock(files_mu_);
  uint32_t id = 0;
  while (id < files_.size() && files_[id].in_use) ++id;
  if (id == files_.size()) {
    return ResourceExhausted(fmt::format("open {}: all {} file slots of the I/O engine are in use; close files or "
                                         "raise max_files", path, files_.size()));
  }
  STRATA_RETURN_IF_ERROR(check_path_text(path, "open: the path"));
  int flags = (mode == OpenMode::kRead ? O_RDONLY : O_RDWR) | O_CLOEXEC;
  if (mode == OpenMode::kCreate) flags |= O_CREAT;
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever; it
  // is refused below, and a regular file or block device ignores the flag.
  int buffered_fd = ::open(path.c_str(), flags | O_NONBLOCK, 0600);
  if (buffered_fd < 0) {
    return ErrnoStatus(errno, fmt::format("open {} ({})", printable(path, 256),
                                          mode == OpenMode::kRead ? "read" : "read-write"));
  }
  struct stat opened {};
  if (fstat(buffered_fd, &opened) != 0 || !(S_ISREG(opened.st_mode) || S_ISBLK(opened.st_mode))) {
    const int saved = errno;
    const std::string what = fstat(buffered_fd, &opened) == 0 ? std::string(file_type_name(opened.st_mode))
                                                              : fmt::format("unknown ({})", std::strerror(saved));
    ::close(buffered_fd);
    return InvalidArgument(fmt::format("open {}: it is {}, not a regular file or block device; name a file",
                                       printable(path, 256), what));
  }
  (void)fcntl(buffered_fd, F_SETFL, fcntl(buffered_fd, F_GETFL) & ~O_NONBLOCK);
  FileSlot& f = files_[id];
  f.path = path;
  f.writable = mode != OpenMode::kRead;
  f.buffered_fd = buffered_fd;
  f.direct_fd = -1;
  f.fallback_reason.clear();
  if (options_.direct_io) {
    DirectProbe probe = probe_direct(buffered_fd, path, flags & ~O_CREAT);
    f.direct_fd = probe.fd;
    f.alignment = probe.alignment;
    if (probe.fd < 0) {
      f.fallback_reason = probe.reason;
      std::string note = fmt::format("{}: {}; using buffered I/O", path, probe.reason);
      struct stat st {};
      if (fstat(buffered_fd, &st) == 0) say_fallback_once(st.st_dev, note);
      add_note(note);
    }
  } else {
    f.alignment = 4096;
    f.fallback_reason = "direct I/O disabled by options";
  }
  f.fixed = false;
  if (fixed_files_) {
    int fds[2] = {f.direct_fd, f.buffered_fd};
    bool ok = true;
    for (Worker& w : workers_) ok = w.backend->update_files(id * 2, fds, 2) && ok;
    f.fixed = ok;
    if (!ok) add_note(fmt::format("{}: fixed-file registration refused; using plain descriptors", path));
  }
  f.pending.store(0);
  f.in_use = true;
  return id;
}

Status ScheduledEngine::close(FileId file) {
  std::lock_guard<std::mutex> lock(files_mu_);
  if (file >= files_.size() || !files_[file].in_use) {
    return InvalidArgument(fmt::format("close: file id {} is not open in this engine", file));
  }
  FileSlot& f = files_[file];
  if (f.pending.load() != 0) {
    return FailedPrecondition(fmt::format("close {}: {} request(s) still in flight; wait for them first", f.path,
                                          f.pending.load()));
  }
  if (f.fixed) {
    int fds[2] = {-1, -1};
    for (Worker& w : workers_) w.backend->update_files(file * 2, fds, 2);
  }
  close_fds(f);
  f.in_use = false;
  return Status::Ok();
}

Result<FileInfo> ScheduledEngine::file_info(FileId file) const {
  auto& self = const_cast<ScheduledEngine&>(*this);
  std::lock_guard<std::mutex> lock(self.files_mu_);
  if (file >= files_.size() || !files_[file].in_use) {
    return InvalidArgument(fmt::format("file id {} is not open in this engine", file));
  }
  const FileSlot& f = files_[file];
  return FileInfo{f.path, f.direct_fd >= 0, f.alignment, f.writable, f.fallback_reason};
}

Status ScheduledEngine::register_buffer(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0) return InvalidArgument("register_buffer: empty region");
  if (any_inflight()) {
    return FailedPrecondition("register_buffer: requests are in flight; register buffers before starting I/O");
  }
  uint32_t count = region_count_.load();
  uint32_t index = 0;
  while (index < count && regions_[index].data != nullptr) ++index;
  if (index == kMaxRegions) {
    return ResourceExhausted(fmt::format("register_buffer: all {} buffer slots are in use", kMaxRegions));
  }
  Region region{static_cast<std::byte*>(data), bytes, false};
  if (options_.huge_page_buffers) {
    std::string why = back_with_huge_pages(data, bytes);
    if (!why.empty()) add_note(why);
  }
  if (options_.register_buffers && kind_ == EngineKind::kIoUring) {
    bool ok = true;
    std::string why;
    uint32_t done_count = 0;
    for (Worker& w : workers_) {
      if (!w.backend->register_buffer(index, data, bytes, &why)) {
        ok = false;
        break;
      }
      ++done_count;
    }
    if (!ok) {
      for (uint32_t i = 0; i < done_count; ++i) workers_[i].backend->unregister_buffer(index);
      add_note(fmt::format("buffer registration refused ({}); buffers are used unregistered", why));
    }
    region.registered = ok;
  }
  regions_[index] = region;
  if (index == count) region_count_.store(count + 1, std::memory_order_release);
  return Status::Ok();
}

Status ScheduledEngine::unregister_buffer(void* data) {
  if (any_inflight()) return FailedPrecondition("unregister_buffer: requests are in flight");
  uint32_t count = region_count_.load();
  for (uint32_t i = 0; i < count; ++i) {
    if (regions_[i].data == data) {
      if (regions_[i].registered) {
        for (Worker& w : workers_) w.backend->unregister_buffer(i);
      }
      regions_[i] = Region{};
      return Status::Ok();
    }
  }
  return NotFound("unregister_buffer: region was not registered with this engine");
}

IoHandle ScheduledEngine::submit(IoOp op, std::span<const IoSegment> segments, IoCallback callback) {
  auto req = std::make_shared<detail::RequestState>();
  req->op = op;
  {
    std::string path = "?";
    if (!segments.empty()) {
      std::lock_guard<std::mutex> lock(files_mu_);
      if (segments[0].file < files_.size() && files_[segments[0].file].in_use) path = files_[segments[0].file].path;
    }
    std::string label =
        segments.empty() ? fmt::format("nvme {} (no segments)", io_op_name(op))
                         : fmt::format("nvme {} of {} [{}, +{})", io_op_name(op), path, segments[0].offset,
                                       segments[0].length);
    if (segments.size() > 1) label += fmt::format(" and {} more segment(s)", segments.size() - 1);
    req->source = CompletionSource(std::move(label));
    req->completion = req->source.completion();
  }
  req->callback = std::move(callback);
  req->segments.assign(segments.begin(), segments.end());
  requests_.fetch_add(1, std::memory_order_relaxed);

  Status invalid;
  uint64_t total = 0;
  {
    std::lock_guard<std::mutex> lock(files_mu_);
    for (const IoSegment& s : req->segments) {
      if (s.file >= files_.size() || !files_[s.file].in_use) {
        invalid = InvalidArgument(fmt::format("{} of {} bytes at offset {}: file id {} is not open in this engine",
                                              io_op_name(op), s.length, s.offset, s.file));
        break;
      }
      const FileSlot& f = files_[s.file];
      if (s.length > 0 && s.buffer == nullptr) {
        invalid = InvalidArgument(fmt::format("{} {} offset {} length {}: null buffer", io_op_name(op), f.path,
                                              s.offset, s.length));
        break;
      }
      if (op == IoOp::kWrite && !f.writable) {
        invalid = InvalidArgument(fmt::format("write {} offset {} length {}: file was opened read-only", f.path,
                                              s.offset, s.length));
        break;
      }
      if (s.offset + s.length < s.offset) {
        invalid = InvalidArgument(fmt::format("{} {}: offset {} + length {} overflows", io_op_name(op), f.path,
                                              s.offset, s.length));
        break;
      }
      total += s.length;
    }
    if (invalid.ok()) {
      for (const IoSegment& s : req->segments) files_[s.file].pending.fetch_add(1);
    }
  }
  req->total_bytes = total;
  if (!invalid.ok()) {
    failed_requests_.fetch_add(1, std::memory_order_relaxed);
    req->segments.clear();
    req->record_error(std::move(invalid));
    req->finish();
    return IoHandle(req);
  }
  // Drop empty segments; a request with no bytes completes at once.
  std::erase_if(req->segments, [](const IoSegment& s) { return s.length == 0; });
  req->bytes_left.store(total);
  if (total == 0) {
    req->finish();
    return IoHandle(req);
  }
  // Wrap the callback so the file counters drop before waiters wake.
  auto user_callback = std::move(req->callback);
  std::vector<FileId> touched;
  touched.reserve(req->segments.size());
  for (const IoSegment& s : req->segments) touched.push_back(s.file);
  req->callback = [this, user_callback = std::move(user_callback), touched = std::move(touched)](const Status& st) {
    for (FileId f : touched) files_[f].pending.fetch_sub(1);
    if (!st.ok()) failed_requests_.fetch_add(1, std::memory_order_relaxed);
    inflight_requests_.fetch_sub(1, std::memory_order_acq_rel);
    if (user_callback) user_callback(st);
  };
  inflight_requests_.fetch_add(1, std::memory_order_acq_rel);
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_.push_back(req);
  }
  queue_cv_.notify_one();
  return IoHandle(req);
}

// Chooses direct or buffered for the piece's current (offset, length, buffer).
void ScheduledEngine::select_path(Piece& p) const {
  const FileSlot& f = files_[p.file];
  uint64_t a = f.alignment;
  bool aligned = f.direct_fd >= 0 && p.offset % a == 0 && p.length % a == 0 && p.length > 0 &&
                 reinterpret_cast<uintptr_t>(p.buffer) % a == 0;
  p.direct = aligned;
  p.alignment = f.alignment;
  p.fd = aligned ? f.direct_fd : f.buffered_fd;
  p.fixed_index = f.fixed ? static_cast<int>(p.file * 2 + (aligned ? 0 : 1)) : -1;
  p.buffer_index = -1;
  uint32_t count = region_count_.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < count; ++i) {
    const Region& r = regions_[i];
    if (r.registered && p.buffer >= r.data && p.buffer + p.length <= r.data + r.bytes) {
      p.buffer_index = static_cast<int>(i);
      break;
    }
  }
}

// Carves up to max_pieces off the queue head (block_size each). Direct
// pieces are trimmed to whole alignment units; the unaligned rest of a
// segment becomes a buffered piece of its own.
void ScheduledEngine::take_pieces(Worker& w, uint32_t max_pieces, bool block, bool* stop) {
  std::unique_lock<std::mutex> lock(queue_mu_);
  if (block) {
    queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
  }
  if (queue_.empty()) {
    *stop = stopping_;
    return;
  }
  uint32_t taken = 0;
  while (taken < max_pieces && !queue_.empty()) {
    detail::RequestState& req = *queue_.front();
    const IoSegment& seg = req.segments[req.segment_index];
    const FileSlot& f = files_[seg.file];
    uint64_t offset = seg.offset + req.segment_cursor;
    std::byte* buffer = static_cast<std::byte*>(seg.buffer) + req.segment_cursor;
    uint64_t length = std::min<uint64_t>(options_.block_size, seg.length - req.segment_cursor);
    uint64_t a = f.alignment;
    if (f.direct_fd >= 0 && offset % a == 0 && reinterpret_cast<uintptr_t>(buffer) % a == 0 && length >= a) {
      length -= length % a;  // whole units go direct; the tail follows as its own piece
    }
    uint32_t slot = w.free_slots.back();
    w.free_slots.pop_back();
    w.fresh.push_back(slot);
    Piece& p = w.slots[slot];
    p.request = queue_.front();
    p.op = req.op;
    p.file = seg.file;
    p.offset = p.carved_offset = offset;
    p.length = p.carved_length = length;
    p.buffer = buffer;
    p.retries = 0;
    ++taken;
    req.segment_cursor += length;
    if (req.segment_cursor == seg.length) {
      req.segment_cursor = 0;
      if (++req.segment_index == req.segments.size()) queue_.pop_front();
    }
  }
  bool more = !queue_.empty();
  lock.unlock();
  if (more) queue_cv_.notify_one();  // let an idle worker share the rest
}

std::string ScheduledEngine::piece_context(const Piece& p) const {
  const FileSlot& f = files_[p.file];
  return fmt::format("{} {} offset {} length {}{}", io_op_name(p.op), f.path, p.offset, p.length,
                     p.direct ? " (O_DIRECT)" : "");
}

void ScheduledEngine::complete_piece(Worker& w, Piece& p, Status status) {
  std::shared_ptr<detail::RequestState> req = std::move(p.request);
  if (!status.ok()) req->record_error(std::move(status));
  uint64_t n = p.carved_length;
  w.free_slots.push_back(p.slot);
  --w.inflight;
  if (req->bytes_left.fetch_sub(n, std::memory_order_acq_rel) == n) req->finish();
}

void ScheduledEngine::on_result(Worker& w, Piece& p, int64_t result) {
  if (result < 0) {
    int err = static_cast<int>(-result);
    if ((err == EAGAIN || err == EINTR) && p.retries < options_.max_retries) {
      ++p.retries;
      transient_retries_.fetch_add(1, std::memory_order_relaxed);
      w.backend->prepare(p);
      w.needs_submit = true;
      return;
    }
    std::string what = piece_context(p);
    if (err == EAGAIN || err == EINTR) what += fmt::format(" (still failing after {} retries)", p.retries);
    Status st = ErrnoStatus(err, what);
    if (err == ENOSPC) st = std::move(st).with_context("disk full");
    complete_piece(w, p, std::move(st));
    return;
  }
  uint64_t done = static_cast<uint64_t>(result);
  if (done > p.length) {
    complete_piece(w, p, Internal(fmt::format("{}: kernel reported {} bytes, more than asked", piece_context(p), done)));
    return;
  }
  if (p.op == IoOp::kRead) bytes_read_.fetch_add(done, std::memory_order_relaxed);
  else bytes_written_.fetch_add(done, std::memory_order_relaxed);
  if (done == p.length) {
    complete_piece(w, p, Status::Ok());
    return;
  }
  if (done == 0) {
    if (p.op == IoOp::kRead) {
      complete_piece(w, p, IoError(fmt::format("{}: unexpected end of file (file is shorter than offset + length)",
                                               piece_context(p))));
      return;
    }
    if (++p.retries > options_.max_retries) {
      complete_piece(w, p, IoError(fmt::format("{}: write made no progress after {} attempts", piece_context(p),
                                               p.retries)));
      return;
    }
  }
  // Short transfer: resubmit the rest, direct if it is still aligned.
  short_resubmits_.fetch_add(1, std::memory_order_relaxed);
  p.offset += done;
  p.buffer += done;
  p.length -= done;
  select_path(p);
  w.backend->prepare(p);
  w.needs_submit = true;
}

void ScheduledEngine::fail_inflight(Worker& w, const Status& status) {
  for (Piece& p : w.slots) {
    if (p.request) complete_piece(w, p, status.with_context(piece_context(p)));
  }
}

void ScheduledEngine::run_worker(Worker& w) {
  CompletionSink sink = [this, &w](Piece& p, int64_t result) { on_result(w, p, result); };
  const uint32_t depth = static_cast<uint32_t>(w.slots.size());
  w.fresh.reserve(depth);
  while (true) {
    uint32_t free_count = depth - w.inflight;
    if (free_count > 0) {
      bool stop = false;
      w.fresh.clear();
      take_pieces(w, free_count, w.inflight == 0, &stop);
      if (w.fresh.empty() && w.inflight == 0) {
        if (stop) break;
        continue;
      }
      for (uint32_t slot : w.fresh) {
        Piece& p = w.slots[slot];
        ++w.inflight;
        pieces_.fetch_add(1, std::memory_order_relaxed);
        if (p.request->failed.load(std::memory_order_acquire)) {
          complete_piece(w, p, Status::Ok());  // the request already failed; skip its rest
          continue;
        }
        select_path(p);
        (p.direct ? direct_pieces_ : buffered_pieces_).fetch_add(1, std::memory_order_relaxed);
        if (p.buffer_index >= 0) fixed_buffer_pieces_.fetch_add(1, std::memory_order_relaxed);
        w.backend->prepare(p);
        w.needs_submit = true;
        if (options_.single_submit) {
          w.needs_submit = false;
          Status st = w.backend->submit(sink);
          if (!st.ok()) fail_inflight(w, st);
        }
      }
    }
    // reap() submits what is prepared first (io_uring: in the same syscall
    // as the wait), so a separate submit is needed only with nothing to reap.
    if (w.inflight > 0) {
      w.needs_submit = false;
      uint32_t min_complete = options_.overlap_events ? 1 : w.inflight;
      Status st = w.backend->reap(min_complete, sink);
      if (!st.ok()) fail_inflight(w, st);
    } else if (w.needs_submit) {
      w.needs_submit = false;
      Status st = w.backend->submit(sink);
      if (!st.ok()) fail_inflight(w, st);
    }
  }
}

}  // namespace

Result<std::unique_ptr<IoEngine>> make_scheduled_engine(const IoEngineOptions& options, EngineKind kind,
                                                        BackendWrapper wrapper) {
  STRATA_RETURN_IF_ERROR(options.validate());
  BackendFactory factory;
  switch (kind) {
    case EngineKind::kIoUring: factory = make_uring_backend; break;
    case EngineKind::kLibaio: factory = make_aio_backend; break;
    case EngineKind::kPsync: factory = make_psync_backend; break;
    case EngineKind::kAuto: return Internal("make_scheduled_engine: resolve kAuto first");
  }
  auto engine = std::make_unique<ScheduledEngine>(options, kind);
  STRATA_RETURN_IF_ERROR(engine->start(std::move(factory), std::move(wrapper)));
  return std::unique_ptr<IoEngine>(std::move(engine));
}

}  // namespace strata::nvme
