// psync backend: pread/pwrite on the worker thread. The scheduler gives each
// psync worker one slot, so a group of threads emulates a ring's depth.
#include <unistd.h>

#include <cerrno>

#include "engine_core.h"

namespace strata::nvme {
namespace {

class PsyncBackend final : public Backend {
 public:
  explicit PsyncBackend(uint32_t depth) { pending_.reserve(depth); running_.reserve(depth); }

  void prepare(Piece& piece) override {
    pending_.push_back(Pending{&piece, piece.op, piece.fd, piece.offset, piece.length, piece.buffer});
  }

  Status submit(const CompletionSink&) override { return Status::Ok(); }

  Status reap(uint32_t min_complete, const CompletionSink& sink) override {
    uint32_t delivered = 0;
    // Pieces resubmitted from inside the sink land in pending_ again and
    // run in the next round, so one call finishes what it was asked for.
    while (!pending_.empty() && (delivered < min_complete || min_complete == 0)) {
      running_.swap(pending_);
      for (const Pending& p : running_) {
        ssize_t n = p.op == IoOp::kRead ? ::pread(p.fd, p.buffer, p.length, static_cast<off_t>(p.offset))
                                        : ::pwrite(p.fd, p.buffer, p.length, static_cast<off_t>(p.offset));
        int64_t result = n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
        sink(*p.piece, result);
        ++delivered;
      }
      running_.clear();
      if (min_complete == 0) break;
    }
    return Status::Ok();
  }

 private:
  struct Pending {
    Piece* piece;
    IoOp op;
    int fd;
    uint64_t offset;
    uint64_t length;
    std::byte* buffer;
  };
  std::vector<Pending> pending_;
  std::vector<Pending> running_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_psync_backend(const BackendConfig& config, std::vector<std::string>&) {
  return std::unique_ptr<Backend>(std::make_unique<PsyncBackend>(config.depth));
}

}  // namespace strata::nvme
