#pragma once
// Internal: the scheduler shared by every backend, and the Backend seam the
// three kernel interfaces (and the fault injector) plug into.
//
// Note [Engine structure]
// ScheduledEngine owns the file table, one request queue and N workers.
// Each worker owns a Backend (an io_uring ring, an aio context or a
// synchronous pread/pwrite executor) and a fixed array of queue_depth Piece
// slots, so the hot path allocates nothing per piece. A worker loop:
//   1. takes up to (free slots) pieces from the shared queue, carving them
//      off the head request (block_size each; direct or buffered),
//   2. prepares them on its backend and submits (one batch, or one by one
//      with single_submit),
//   3. reaps at least one completion (overlap_events) or all of its batch,
//      and checks each result: done, short (resubmit the rest), transient
//      (retry), or an error that completes the request with context.
// A worker with nothing in flight sleeps on the queue's condition variable.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "strata/nvme/io_engine.h"

namespace strata::nvme {

namespace detail {

struct RequestState {
  IoOp op = IoOp::kRead;
  std::vector<IoSegment> segments;
  uint64_t total_bytes = 0;
  // Carving cursor, guarded by the engine's queue mutex.
  size_t segment_index = 0;
  uint64_t segment_cursor = 0;

  std::atomic<uint64_t> bytes_left{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  Status first_error;
  IoCallback callback;
  CompletionSource source;  // completed by finish(), after the callback
  Completion completion;    // source's, kept: a completed source hands out no more

  Status final_status;  // written before source completes

  void record_error(Status status);
  void finish();
};

}  // namespace detail

struct Piece {
  std::shared_ptr<detail::RequestState> request;
  IoOp op = IoOp::kRead;
  FileId file = 0;
  int fd = -1;              // descriptor for this attempt
  int fixed_index = -1;     // registered-file slot, -1 when not registered
  int buffer_index = -1;    // registered-buffer slot, -1 when not registered
  bool direct = false;
  uint32_t alignment = 0;   // direct alignment of the file
  uint64_t offset = 0;      // current attempt (advances on short transfers)
  uint64_t length = 0;
  std::byte* buffer = nullptr;
  uint64_t carved_offset = 0;  // the piece as carved, for error messages
  uint64_t carved_length = 0;
  uint32_t retries = 0;
  uint32_t slot = 0;        // index in the worker's slot array
};

// Receives one raw completion: bytes transferred (>= 0) or -errno.
using CompletionSink = std::function<void(Piece&, int64_t)>;

class Backend {
 public:
  virtual ~Backend() = default;
  // Queues `piece` (its fd, offset, length, buffer are read now).
  virtual void prepare(Piece& piece) = 0;
  // Hands prepared pieces to the kernel. Pieces that cannot be submitted
  // for a non-transient reason are completed through `sink` with -errno.
  virtual Status submit(const CompletionSink& sink) = 0;
  // Submits whatever is still prepared (pieces resubmitted from inside the
  // sink included), then waits until this call has delivered at least
  // `min_complete` completions (0: only what is ready), each through `sink`.
  virtual Status reap(uint32_t min_complete, const CompletionSink& sink) = 0;
  // Called when a buffer is registered / unregistered (io_uring only).
  virtual bool register_buffer(uint32_t index, void* data, size_t bytes, std::string* why) {
    return false;
  }
  virtual void unregister_buffer(uint32_t index) {}
  // Called when a file slot changes (io_uring fixed files).
  virtual bool update_files(uint32_t first_index, const int* fds, uint32_t count) { return false; }
  virtual bool files_registered() const { return false; }
};

struct BackendConfig {
  uint32_t worker_index = 0;
  uint32_t depth = 1;
  uint32_t file_slots = 0;  // fixed-file table size (2 per engine file)
  const IoEngineOptions* options = nullptr;
};

// Creates one backend per worker. `notes` collects degradations (said once).
using BackendFactory =
    std::function<Result<std::unique_ptr<Backend>>(const BackendConfig&, std::vector<std::string>& notes)>;

Result<std::unique_ptr<Backend>> make_psync_backend(const BackendConfig& config,
                                                    std::vector<std::string>& notes);
Result<std::unique_ptr<Backend>> make_uring_backend(const BackendConfig& config,
                                                    std::vector<std::string>& notes);
Result<std::unique_ptr<Backend>> make_aio_backend(const BackendConfig& config,
                                                  std::vector<std::string>& notes);
// Probes whether the kernel interface works here (creates and tears down one instance).
Status probe_uring();
Status probe_aio();
bool uring_compiled();
bool aio_compiled();

// Builds the engine for a resolved kind (not kAuto), with an optional
// backend wrapper (fault injection).
using BackendWrapper = std::function<std::unique_ptr<Backend>(std::unique_ptr<Backend>, uint32_t worker_index)>;
Result<std::unique_ptr<IoEngine>> make_scheduled_engine(const IoEngineOptions& options, EngineKind kind,
                                                        BackendWrapper wrapper);

}  // namespace strata::nvme
