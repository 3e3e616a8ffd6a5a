#pragma once
// IoEngine: asynchronous file I/O for swapping tensors to NVMe.
//
// One interface, three backends picked at run time:
//   io_uring  (liburing: batched submission, registered buffers and files,
//              optional SQPOLL)
//   libaio    (io_submit / io_getevents)
//   psync     (a thread pool of pread/pwrite; works everywhere)
// `auto` picks the best backend that works on this machine and says why.
//
// A request is a list of segments (file, offset, length, buffer) moved in one
// direction. The engine cuts it into block_size pieces and hands the pieces
// to intra_op_parallelism workers (one ring / aio context / thread group
// each) through one shared queue, so work spreads dynamically: a worker with
// free queue slots takes the next piece, whichever request it belongs to.
// Every request has its own completion (an IoHandle whose completion() is a
// strata::Completion, see core/completion.h, plus an optional callback), so
// callers wait for, chain onto or gate a device stream on what they need.
//
// Note [I/O completion rules]
//  - A request completes exactly once; its Status is ok or the first error
//    of its pieces, naming the file, offset, length (and errno).
//  - The IoCallback given to submit() runs first, on the engine worker that
//    finished the last piece, with no engine lock held; then the Completion
//    is completed (waiters wake, then() callbacks run on that same thread,
//    again with no engine lock held). So a callback may submit new requests
//    to this engine; it must not block waiting for another request of this
//    engine (it would hold up a worker that request may need).
//  - Invalid requests complete before submit() returns, on the caller.
//
// Every completion result is checked: short transfers are resubmitted for
// the rest, EAGAIN/EINTR are retried, anything else completes the request
// with a Status naming the file, offset, length and errno.
//
// Files are opened through the engine. Where the file system accepts
// O_DIRECT the engine keeps a direct descriptor and a buffered one: pieces
// whose offset, length and buffer address are aligned to the file's
// direct-I/O alignment go direct, unaligned tails go buffered (the kernel
// keeps both views coherent). Where O_DIRECT is refused (tmpfs) the engine
// uses buffered I/O and says so once per file system.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/completion.h"
#include "strata/core/status.h"

namespace strata::nvme {

enum class EngineKind : uint8_t { kAuto, kIoUring, kLibaio, kPsync };

std::string_view engine_kind_name(EngineKind kind);  // "auto", "io_uring", "libaio", "psync"
// Accepts the names above ("uring" and "aio" too). `what` names the flag or key.
Result<EngineKind> parse_engine_kind(std::string_view text, std::string_view what = "engine");

struct IoEngineOptions {
  EngineKind engine = EngineKind::kAuto;
  uint64_t block_size = 1u << 20;     // aio.block_size: bytes per piece
  uint32_t queue_depth = 8;           // aio.queue_depth: pieces in flight per worker
  uint32_t intra_op_parallelism = 1;  // aio.intra_op_parallelism: rings / contexts / thread groups
  bool single_submit = false;         // aio.single_submit: one submission call per piece
  bool overlap_events = true;         // aio.overlap_events: refill as soon as any piece completes
                                      //   (false: a worker waits for its whole batch)
  bool sqpoll = false;                // io_uring: kernel submission thread (burns a core)
  bool register_buffers = true;       // io_uring: use buffers given to register_buffer() as fixed
  bool register_files = true;         // io_uring: fixed-file table
  bool huge_page_buffers = true;      // register_buffer(): back the region with 2 MiB pages first
                                      //   (Note [Huge pages for I/O buffers], aligned_buffer.cpp)
  bool direct_io = true;              // O_DIRECT where the file system allows it
  uint32_t max_files = 64;            // open files per engine
  uint32_t max_retries = 64;          // EAGAIN / EINTR / zero-progress retries per piece

  // Checks ranges; errors name the aio key.
  Status validate() const;
};

enum class IoOp : uint8_t { kRead, kWrite };
std::string_view io_op_name(IoOp op);

using FileId = uint32_t;

enum class OpenMode : uint8_t {
  kRead,       // existing file, read only
  kReadWrite,  // existing file
  kCreate,     // read-write, created 0600 when absent (never truncated)
};

struct FileInfo {
  std::string path;
  bool direct = false;              // O_DIRECT descriptor in use for aligned pieces
  uint32_t direct_alignment = 0;    // offset / length / address alignment for direct pieces
  bool writable = false;
  std::string fallback_reason;      // why not direct, when direct is false
};

struct IoSegment {
  FileId file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  void* buffer = nullptr;
};

namespace detail {
struct RequestState;
}

// Completion of one request. Cheap to copy (shared state).
class IoHandle {
 public:
  IoHandle() = default;
  explicit IoHandle(std::shared_ptr<detail::RequestState> state) : state_(std::move(state)) {}

  bool valid() const { return state_ != nullptr; }
  // The request's completion: its Status names file, offset and length on
  // failure; its label is "nvme read of <path> [offset, +length)".
  Completion completion() const;
  bool done() const { return completion().done(); }    // never blocks
  Status wait() const { return completion().wait(); }  // blocks; the request's status
  uint64_t bytes() const;                              // total bytes of the request

 private:
  std::shared_ptr<detail::RequestState> state_;
};

// Runs once per request, on an engine worker thread, before waiters wake and
// before then() callbacks of the completion; no engine lock is held. Keep it
// short; it may submit, it must not wait on another request of the same engine.
using IoCallback = std::function<void(const Status&)>;

struct IoEngineStats {
  uint64_t requests = 0;
  uint64_t pieces = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t direct_pieces = 0;
  uint64_t buffered_pieces = 0;
  uint64_t short_resubmits = 0;     // short transfers resubmitted for the rest
  uint64_t transient_retries = 0;   // EAGAIN / EINTR retried
  uint64_t failed_requests = 0;
  uint64_t fixed_buffer_pieces = 0; // io_uring pieces issued as READ_FIXED / WRITE_FIXED
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  IoEngine() = default;
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  virtual EngineKind kind() const = 0;
  // "io_uring: 2 rings x depth 32, fixed files, registered buffers"
  virtual std::string describe() const = 0;
  virtual const IoEngineOptions& options() const = 0;
  // Degradations the engine chose (buffered fallback, refused registration).
  virtual std::vector<std::string> notes() const = 0;

  virtual Result<FileId> open(const std::string& path, OpenMode mode) = 0;
  // Fails if requests on the file are still in flight.
  virtual Status close(FileId file) = 0;
  virtual Result<FileInfo> file_info(FileId file) const = 0;

  // Optional: lets io_uring use the region as a fixed buffer. Must be called
  // while no request is in flight. Refusals (RLIMIT_MEMLOCK) are not errors:
  // the region is used unregistered and a note says so. Other backends
  // record the region and ignore it. Register a long-lived region once (a
  // slot pool's base() / total_bytes()): every later piece whose buffer lies
  // wholly inside it is issued as READ_FIXED / WRITE_FIXED, whoever submits
  // it (the SwapStore included); stats().fixed_buffer_pieces counts them.
  virtual Status register_buffer(void* data, size_t bytes) = 0;
  virtual Status unregister_buffer(void* data) = 0;

  // Starts a request. Never blocks on I/O; invalid requests (unknown file,
  // null buffer, read-only file written) complete at once with the error.
  virtual IoHandle submit(IoOp op, std::span<const IoSegment> segments, IoCallback callback = {}) = 0;

  IoHandle read(FileId file, uint64_t offset, uint64_t length, void* buffer, IoCallback callback = {});
  IoHandle write(FileId file, uint64_t offset, uint64_t length, const void* buffer,
                 IoCallback callback = {});
  Status read_sync(FileId file, uint64_t offset, uint64_t length, void* buffer);
  Status write_sync(FileId file, uint64_t offset, uint64_t length, const void* buffer);

  virtual IoEngineStats stats() const = 0;
};

// Builds the engine `options.engine` names; kAuto picks with choose_engine().
Result<std::unique_ptr<IoEngine>> make_io_engine(const IoEngineOptions& options);

// What this machine can run, probed (a ring / context is really created).
struct EngineProbe {
  EngineKind kind;
  bool compiled = false;
  bool works = false;
  std::string detail;  // why not, or what was found
};
std::vector<EngineProbe> probe_engines();

struct EngineChoice {
  EngineKind kind = EngineKind::kPsync;
  std::string reason;
};
// io_uring if it works, else libaio, else psync; the reason names what failed.
EngineChoice choose_engine();

}  // namespace strata::nvme
