// io_uring backend (liburing): one ring per worker, batched submission,
// fixed files and registered buffers when the kernel allows them, optional
// SQPOLL. Registration refusals (RLIMIT_MEMLOCK, old kernels) degrade to
// plain descriptors and buffers and are reported as notes.
#include <liburing.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "../engine_core.h"

namespace strata::nvme {
namespace {

constexpr uint32_t kBufferSlots = 32;

class UringBackend final : public Backend {
 public:
  ~UringBackend() override {
    if (initialized_) io_uring_queue_exit(&ring_);
  }

  Status init(const BackendConfig& config, std::vector<std::string>& notes) {
    const IoEngineOptions& opt = *config.options;
    io_uring_params params{};
    if (opt.sqpoll) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = 2000;  // ms before the kernel thread sleeps
    }
    // Each slot holds at most one SQE at a time; the kernel caps rings at 32768.
    unsigned entries = std::min<unsigned>(std::max<unsigned>(config.depth, 8), 32768);
    int rc = io_uring_queue_init_params(entries, &ring_, &params);
    if (rc < 0 && opt.sqpoll) {
      if (config.worker_index == 0) {
        notes.push_back(fmt::format("io_uring SQPOLL refused ({}); rings run without it", std::strerror(-rc)));
      }
      params = io_uring_params{};
      rc = io_uring_queue_init_params(entries, &ring_, &params);
    }
    if (rc < 0) return ErrnoStatus(-rc, fmt::format("io_uring_queue_init({} entries)", entries));
    initialized_ = true;
    if (opt.register_files) {
      int frc = io_uring_register_files_sparse(&ring_, config.file_slots);
      files_registered_ = frc == 0;
      if (frc < 0 && config.worker_index == 0) {
        notes.push_back(fmt::format("io_uring fixed files refused ({}); using plain descriptors", std::strerror(-frc)));
      }
    }
    if (opt.register_buffers) {
      int brc = io_uring_register_buffers_sparse(&ring_, kBufferSlots);
      buffers_registered_ = brc == 0;
      if (brc < 0 && config.worker_index == 0) {
        notes.push_back(fmt::format("io_uring buffer table refused ({}); buffers are used unregistered",
                                    std::strerror(-brc)));
      }
    }
    return Status::Ok();
  }

  void prepare(Piece& p) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      // The SQ is full of not yet submitted entries: push them to the kernel.
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    STRATA_CHECK(sqe != nullptr, "io_uring SQ full although entries >= depth");
    bool fixed_file = p.fixed_index >= 0;
    int fd = fixed_file ? p.fixed_index : p.fd;
    unsigned len = static_cast<unsigned>(p.length);
    bool fixed_buffer = p.buffer_index >= 0 && p.buffer_index < static_cast<int>(kBufferSlots);
    if (p.op == IoOp::kRead) {
      if (fixed_buffer) io_uring_prep_read_fixed(sqe, fd, p.buffer, len, p.offset, p.buffer_index);
      else io_uring_prep_read(sqe, fd, p.buffer, len, p.offset);
    } else {
      if (fixed_buffer) io_uring_prep_write_fixed(sqe, fd, p.buffer, len, p.offset, p.buffer_index);
      else io_uring_prep_write(sqe, fd, p.buffer, len, p.offset);
    }
    if (fixed_file) io_uring_sqe_set_flags(sqe, IOSQE_FIXED_FILE);
    io_uring_sqe_set_data(sqe, &p);
    ++unsubmitted_;
  }

  Status submit(const CompletionSink&) override {
    while (unsubmitted_ > 0) {
      int rc = io_uring_submit(&ring_);
      if (rc >= 0) {
        unsubmitted_ -= std::min<uint32_t>(unsubmitted_, static_cast<uint32_t>(rc));
        if (rc == 0) break;
        continue;
      }
      if (rc == -EINTR) continue;
      if (rc == -EAGAIN || rc == -EBUSY) break;  // kernel is short of resources: retried in reap
      return ErrnoStatus(-rc, "io_uring_submit");
    }
    return Status::Ok();
  }

  // Submission and waiting share one io_uring_enter (submit_and_wait)
  // whenever a wait is needed, so a refill costs one syscall.
  Status reap(uint32_t min_complete, const CompletionSink& sink) override {
    uint32_t delivered = drain(sink);
    while (delivered < min_complete) {
      io_uring_cqe* cqe = nullptr;
      int rc = unsubmitted_ > 0 ? io_uring_submit_and_wait(&ring_, 1) : io_uring_wait_cqe(&ring_, &cqe);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME) {
        return ErrnoStatus(-rc, "io_uring wait for completions");
      }
      if (rc > 0 && unsubmitted_ > 0) unsubmitted_ -= std::min<uint32_t>(unsubmitted_, static_cast<uint32_t>(rc));
      delivered += drain(sink);
    }
    return submit(sink);  // pieces prepared since (resubmissions), or when no wait was needed
  }

  bool register_buffer(uint32_t index, void* data, size_t bytes, std::string* why) override {
    if (!buffers_registered_ || index >= kBufferSlots) {
      *why = buffers_registered_ ? "buffer table full" : "no buffer table";
      return false;
    }
    iovec iov{data, bytes};
    __u64 tag = 0;
    int rc = io_uring_register_buffers_update_tag(&ring_, index, &iov, &tag, 1);
    if (rc < 0) {
      *why = fmt::format("{} for {} bytes; RLIMIT_MEMLOCK may be too low", std::strerror(-rc), bytes);
      return false;
    }
    return true;
  }

  void unregister_buffer(uint32_t index) override {
    if (!buffers_registered_ || index >= kBufferSlots) return;
    iovec iov{nullptr, 0};
    __u64 tag = 0;
    io_uring_register_buffers_update_tag(&ring_, index, &iov, &tag, 1);
  }

  bool update_files(uint32_t first_index, const int* fds, uint32_t count) override {
    if (!files_registered_) return false;
    std::vector<int> table(fds, fds + count);
    return io_uring_register_files_update(&ring_, first_index, table.data(), count) == static_cast<int>(count);
  }

  bool files_registered() const override { return files_registered_; }

 private:
  uint32_t drain(const CompletionSink& sink) {
    uint32_t n = 0;
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe != nullptr) {
      auto* piece = static_cast<Piece*>(io_uring_cqe_get_data(cqe));
      int64_t result = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      sink(*piece, result);  // may prepare a resubmission
      ++n;
    }
    return n;
  }

  io_uring ring_{};
  bool initialized_ = false;
  bool files_registered_ = false;
  bool buffers_registered_ = false;
  uint32_t unsubmitted_ = 0;
};

}  // namespace

bool uring_compiled() { return true; }

Result<std::unique_ptr<Backend>> make_uring_backend(const BackendConfig& config, std::vector<std::string>& notes) {
  auto backend = std::make_unique<UringBackend>();
  STRATA_RETURN_IF_ERROR(backend->init(config, notes));
  return std::unique_ptr<Backend>(std::move(backend));
}

Status probe_uring() {
  io_uring ring{};
  int rc = io_uring_queue_init(8, &ring, 0);
  if (rc < 0) return ErrnoStatus(-rc, "io_uring_queue_init(8) (kernel too old, or io_uring disabled by sysctl/seccomp)");
  io_uring_sqe* sqe = io_uring_get_sqe(&ring);
  io_uring_prep_nop(sqe);
  rc = io_uring_submit_and_wait(&ring, 1);
  Status status = rc < 0 ? ErrnoStatus(-rc, "io_uring NOP submission") : Status::Ok();
  io_uring_queue_exit(&ring);
  return status;
}

}  // namespace strata::nvme
