#pragma once
// Communicator: the collectives ZeRO needs between data-parallel ranks.
//
//   all_gather      recv[world * send_count] <- every rank's send[send_count],
//                   rank-major (rank r's elements land at r * send_count).
//   reduce_scatter  recv[recv_count] <- reduce over ranks of
//                   send[rank * recv_count .. +recv_count]; send holds
//                   world * recv_count elements.
//   all_reduce      recv[count] <- reduce over ranks of send[count].
//   broadcast       recv[count] <- root's send[count] (send is read on root only).
//   barrier         returns when every rank has reached it.
//
// Every call is asynchronous: it validates its arguments, queues the
// collective on one of the communicator's ordered queues (CommQueue, default
// kReduce; see strata/comm/queue.h) and returns a CommWork whose Completion
// completes when the collective has (Note [Comm stream] in docs/comm.md).
// Buffers must stay valid and unmodified until then. Ops on one queue run in
// issue order, so ranks must issue the same collectives in the same order on
// each queue; the queues are independent of each other.
//
// Dependencies: wait(completion, queue) gates the later collectives of a
// queue on a Completion (an NVMe read, a device stream's
// record_completion(), another queue's work) without parking a thread per
// dependency; stream.wait(work.completion()) gates a device stream on a
// collective. A failed gate fails the gated collectives with its Status on
// every rank (Note [Comm gates] in docs/comm.md).
//
// Threads (Note [Comm threads] in docs/comm.md): every public method is
// thread-safe. Calls on different queues may run concurrently from different
// threads (e.g. the prefetcher gathers while the backward thread reduces);
// calls on one queue are serialized, and their order is the queue's order, so
// concurrent issuers of one queue must agree on an order themselves (in
// practice: one issuing thread per queue). Destruction must not race with
// any call.
//
// In place: all_gather when send == recv + rank * send_count; reduce_scatter
// when recv == send + rank * recv_count; all_reduce and broadcast when
// send == recv. Any other overlap of send and recv is rejected.
//
// Sizes: counts are elements, not bytes; any count, zero included, is valid
// and a zero-count op is still a collective every rank must issue. Shards of
// a tensor whose size is not a multiple of the world size are padded by the
// caller to shard_count() elements (the last rank's shard holds the padding),
// see strata/comm/shard.h.
//
// Reductions (sum, avg, max) of bf16 and fp16 accumulate in fp32 and round
// once (RNE) at the end on local and mpi; nccl reduces in the element type
// (NCCL's own rule). avg is the fp32 sum divided by the world size.
// fp64 and int64 (global gradient norms, overflow votes, token counts):
// sum and max, and avg for fp64; local and mpi sum exactly in rank order
// 0..n-1, so every rank gets the same bits as a sequential loop over ranks;
// int64 sums wrap modulo 2^64; avg of int64 is rejected (sum, then divide).
//
// Buffers are host memory for local and mpi and device memory for nccl;
// allocate_buffer()/upload()/download() give backend-neutral buffers.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "strata/comm/queue.h"
#include "strata/comm/work.h"
#include "strata/core/device.h"
#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata::comm {

// kTorch: collectives over torch.distributed (gloo), made by the Python
// binding (python/src/torch_distributed_communicator.h); comm/ itself has no
// factory for it.
enum class Backend : uint8_t { kLocal = 0, kMpi = 1, kNccl = 2, kTorch = 3 };
enum class CollectiveOp : uint8_t { kAllGather = 0, kReduceScatter, kAllReduce, kBroadcast, kBarrier };
enum class ReduceOp : uint8_t { kSum = 0, kAvg, kMax };

std::string_view backend_name(Backend backend);
std::string_view op_name(CollectiveOp op);
std::string_view reduce_op_name(ReduceOp op);
// "local" | "mpi" | "nccl"; the error names `what` (a flag or key) and lists the choices.
Result<Backend> parse_backend(std::string_view text, std::string_view what = "backend");
Result<CollectiveOp> parse_op(std::string_view text, std::string_view what = "op");
Result<ReduceOp> parse_reduce_op(std::string_view text, std::string_view what = "reduce op");

struct CommOptions {
  // Watchdog: a collective not complete this long after it started on this
  // rank fails with DeadlineExceeded naming the op, its sequence number, its
  // bytes and the ranks that did not arrive. Zero waits forever.
  // Environment: STRATA_COMM_TIMEOUT_MS (see apply_comm_environment).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Debug checks: every rank's op descriptor (op, dtype, count, root, reduce
  // op, sequence number) is compared before data moves, so ranks issuing
  // different collectives fail with a message instead of hanging or
  // corrupting memory. local: always on (free). mpi: one small message
  // exchange per op, which is also how the watchdog knows which ranks did
  // not arrive. nccl: not available. Environment: STRATA_COMM_DEBUG=0|1.
  bool debug_checks = true;
};

// The longest watchdog a communicator accepts (30 days): a deadline
// beyond it would overflow the clock (9e15 ms used to fail at once).
inline constexpr std::chrono::milliseconds kMaxCommTimeout{30LL * 24 * 3600 * 1000};
// InvalidArgument when options.timeout is negative or above kMaxCommTimeout.
Status validate_comm_options(const CommOptions& options);

// Applies STRATA_COMM_TIMEOUT_MS / STRATA_COMM_DEBUG to `options`; a
// malformed value is an InvalidArgument naming the variable. The factories
// take options as given; the strata CLI applies the environment first.
Result<CommOptions> apply_comm_environment(CommOptions options);

// A buffer the backend's collectives can use (host memory for local and mpi,
// device memory from the communicator's Device for nccl). Move-only; frees
// itself.
class CommBuffer {
 public:
  using Deleter = std::function<void(void* data)>;
  CommBuffer() = default;
  CommBuffer(void* data, size_t bytes, Deleter deleter) : data_(data), bytes_(bytes), deleter_(deleter) {}
  CommBuffer(CommBuffer&& other) noexcept { swap(other); }
  CommBuffer& operator=(CommBuffer&& other) noexcept { CommBuffer tmp(std::move(other)); swap(tmp); return *this; }
  CommBuffer(const CommBuffer&) = delete;
  CommBuffer& operator=(const CommBuffer&) = delete;
  ~CommBuffer() { if (data_ != nullptr && deleter_ != nullptr) deleter_(data_); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void swap(CommBuffer& o) noexcept { std::swap(data_, o.data_); std::swap(bytes_, o.bytes_); std::swap(deleter_, o.deleter_); }
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Deleter deleter_ = nullptr;
};

// What a collective is: the descriptor ranks compare in debug checks.
struct CollectiveDesc {
  CollectiveOp op = CollectiveOp::kBarrier;
  DType dtype = DType::kF32;
  ReduceOp reduce = ReduceOp::kSum;
  int root = 0;
  size_t count = 0;          // send_count / recv_count / count as in the call
  const void* send = nullptr;
  void* recv = nullptr;
};
// "all_reduce(sum, bf16, count 1000, 2000 B)"
std::string describe(const CollectiveDesc& desc, int world_size);
// Bytes the op moves into this rank's recv buffer (the "size" of nccl-tests
// for all_reduce/broadcast; world * count * elt for all_gather).
size_t recv_bytes(const CollectiveDesc& desc, int world_size);

class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual Backend backend() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  Result<CommWork> all_gather(const void* send, void* recv, size_t send_count, DType dtype,
                              CommQueue queue = CommQueue::kReduce);
  Result<CommWork> reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                  ReduceOp op = ReduceOp::kSum, CommQueue queue = CommQueue::kReduce);
  Result<CommWork> all_reduce(const void* send, void* recv, size_t count, DType dtype,
                              ReduceOp op = ReduceOp::kSum, CommQueue queue = CommQueue::kReduce);
  Result<CommWork> broadcast(const void* send, void* recv, size_t count, DType dtype, int root,
                             CommQueue queue = CommQueue::kReduce);
  Result<CommWork> barrier(CommQueue queue = CommQueue::kReduce);

  // Waits for every collective issued so far on every queue (on `queue`);
  // returns the first error (in queue order).
  Status synchronize();
  Status synchronize(CommQueue queue);

  // Gates (Note [Comm gates] in docs/comm.md): collectives issued on `queue`
  // after this call start only once `completion` has completed, e.g. a
  // layer's gradients (stream.record_completion()) or an NVMe read. No host
  // thread is parked per gate: the queue's worker waits in order (local,
  // mpi) or the queue's device stream waits (nccl). If `completion` fails,
  // the gated collectives fail with its Status (named "gate '<label>'") on
  // this rank, and every peer fails them too, naming this rank: the queue is
  // failed from then on, like a device stream.
  Status wait(const Completion& completion, CommQueue queue = CommQueue::kReduce);
  // The same for a device event (on nccl a device-side stream wait; on local
  // and mpi the worker synchronizes the event). `event` must stay alive until
  // the next collective on `queue` has started.
  Status wait_event(Event& event, CommQueue queue = CommQueue::kReduce);

  // Backend-neutral buffers and host copies (synchronous).
  virtual Result<CommBuffer> allocate_buffer(size_t bytes) = 0;
  virtual Status upload(void* dst, const void* host_src, size_t bytes) = 0;
  virtual Status download(void* host_dst, const void* src, size_t bytes) = 0;

  // Collectives issued so far on `queue` (the next one gets this sequence
  // number), and on all queues together.
  uint64_t issued(CommQueue queue) const;
  uint64_t issued() const;

 protected:
  Communicator() = default;
  // Queues a validated collective on `queue` with sequence number `sequence`
  // (called with the queue's issue lock held, so in queue order).
  virtual Result<CommWork> submit(const CollectiveDesc& desc, CommQueue queue, uint64_t sequence) = 0;
  // Appends a gate to `queue` (exactly one of `completion` / `event` is set;
  // called with the queue's issue lock held).
  virtual Status submit_gate(CommQueue queue, const Completion* completion, Event* event) = 0;

 private:
  struct QueueState {
    mutable std::mutex mutex;  // issue lock: sequence numbers and submission order
    uint64_t next_sequence = 0;
    CommWork last;
  };
  Result<CommWork> validate_and_submit(const CollectiveDesc& desc, CommQueue queue);
  std::array<QueueState, kCommQueueCount> queues_;
};

// Later work on `stream` waits until `work` has completed, and fails with the
// collective's Status if it failed: stream.wait(work.completion()) (no host
// thread blocks; see Stream::wait(const Completion&)).
Status stream_wait(Stream& stream, const CommWork& work);

}  // namespace strata::comm
