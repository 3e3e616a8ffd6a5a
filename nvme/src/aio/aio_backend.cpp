// libaio backend: one io context per worker, iocbs live in a per-slot array.
// Buffered (non-O_DIRECT) pieces make io_submit synchronous in the kernel;
// they are still correct, only slower.
#include <libaio.h>

#include <cerrno>
#include <cstring>
#include <ctime>

#include <fmt/format.h>

#include "../engine_core.h"

namespace strata::nvme {
namespace {

class AioBackend final : public Backend {
 public:
  ~AioBackend() override {
    if (initialized_) io_destroy(ctx_);
  }

  Status init(const BackendConfig& config) {
    int rc = io_setup(static_cast<int>(config.depth), &ctx_);
    if (rc < 0) {
      return ErrnoStatus(-rc, fmt::format("io_setup({}) (check /proc/sys/fs/aio-max-nr)", config.depth));
    }
    initialized_ = true;
    iocbs_.resize(config.depth);
    pending_.reserve(config.depth);
    events_.resize(config.depth);
    return Status::Ok();
  }

  void prepare(Piece& p) override {
    iocb& cb = iocbs_[p.slot];
    if (p.op == IoOp::kRead) io_prep_pread(&cb, p.fd, p.buffer, p.length, static_cast<long long>(p.offset));
    else io_prep_pwrite(&cb, p.fd, p.buffer, p.length, static_cast<long long>(p.offset));
    cb.data = &p;
    pending_.push_back(&cb);
  }

  Status submit(const CompletionSink& sink) override {
    size_t first = 0;
    while (first < pending_.size()) {
      int rc = io_submit(ctx_, static_cast<long>(pending_.size() - first), pending_.data() + first);
      if (rc > 0) {
        first += static_cast<size_t>(rc);
        in_kernel_ += static_cast<uint32_t>(rc);
        continue;
      }
      if (rc == -EINTR) continue;
      if (rc == -EAGAIN || rc == 0) break;  // retried after the next completions
      // The first iocb was refused (bad descriptor, misalignment): complete it
      // with the error and go on with the rest.
      iocb* refused = pending_[first++];
      sink(*static_cast<Piece*>(refused->data), rc);
    }
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<long>(first));
    return Status::Ok();
  }

  Status reap(uint32_t min_complete, const CompletionSink& sink) override {
    uint32_t delivered = 0;
    while (true) {
      STRATA_RETURN_IF_ERROR(submit(sink));
      if (in_kernel_ == 0) {
        if (pending_.empty() || min_complete == 0) return Status::Ok();
        // Nothing accepted yet (EAGAIN): back off briefly and retry.
        timespec pause{0, 100000};
        nanosleep(&pause, nullptr);
        continue;
      }
      long min_nr = min_complete == 0 ? 0 : 1;
      int rc = io_getevents(ctx_, min_nr, static_cast<long>(events_.size()), events_.data(), nullptr);
      if (rc == -EINTR) continue;
      if (rc < 0) return ErrnoStatus(-rc, "io_getevents");
      in_kernel_ -= static_cast<uint32_t>(rc);
      for (int i = 0; i < rc; ++i) {
        auto* piece = static_cast<Piece*>(events_[i].data);
        // res is the byte count or -errno, carried in an unsigned long.
        int64_t result = static_cast<int64_t>(static_cast<long>(events_[i].res));
        sink(*piece, result);
      }
      delivered += static_cast<uint32_t>(rc);
      if (delivered >= min_complete) return Status::Ok();
    }
  }

 private:
  io_context_t ctx_ = nullptr;
  bool initialized_ = false;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> pending_;
  std::vector<io_event> events_;
  uint32_t in_kernel_ = 0;
};

}  // namespace

bool aio_compiled() { return true; }

Result<std::unique_ptr<Backend>> make_aio_backend(const BackendConfig& config, std::vector<std::string>&) {
  auto backend = std::make_unique<AioBackend>();
  STRATA_RETURN_IF_ERROR(backend->init(config));
  return std::unique_ptr<Backend>(std::move(backend));
}

Status probe_aio() {
  io_context_t ctx = nullptr;
  int rc = io_setup(4, &ctx);
  if (rc < 0) return ErrnoStatus(-rc, "io_setup(4) (libaio unavailable or aio-max-nr exhausted)");
  io_destroy(ctx);
  return Status::Ok();
}

}  // namespace strata::nvme
