#include "strata/comm/communicator.h"

#include <cerrno>
#include <cstdlib>
#include <limits>

#include <fmt/format.h>

#include "strata/core/printable.h"

#include "strata/core/units.h"

namespace strata::comm {

std::string_view backend_name(Backend backend) {
  switch (backend) {
    case Backend::kLocal: return "local";
    case Backend::kMpi: return "mpi";
    case Backend::kNccl: return "nccl";
    case Backend::kTorch: return "torch";
  }
  return "?";
}

std::string_view op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllGather: return "all_gather";
    case CollectiveOp::kReduceScatter: return "reduce_scatter";
    case CollectiveOp::kAllReduce: return "all_reduce";
    case CollectiveOp::kBroadcast: return "broadcast";
    case CollectiveOp::kBarrier: return "barrier";
  }
  return "?";
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

Result<Backend> parse_backend(std::string_view text, std::string_view what) {
  for (Backend b : {Backend::kLocal, Backend::kMpi, Backend::kNccl}) {
    if (text == backend_name(b)) return b;
  }
  return InvalidArgument(fmt::format("{}: unknown backend '{}'; choose local, mpi or nccl", what, text));
}

Result<CollectiveOp> parse_op(std::string_view text, std::string_view what) {
  for (CollectiveOp op : {CollectiveOp::kAllGather, CollectiveOp::kReduceScatter, CollectiveOp::kAllReduce,
                          CollectiveOp::kBroadcast, CollectiveOp::kBarrier}) {
    if (text == op_name(op)) return op;
  }
  return InvalidArgument(fmt::format(
      "{}: unknown collective '{}'; choose all_gather, reduce_scatter, all_reduce, broadcast or barrier", what, text));
}

Result<ReduceOp> parse_reduce_op(std::string_view text, std::string_view what) {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    if (text == reduce_op_name(op)) return op;
  }
  return InvalidArgument(fmt::format("{}: unknown reduction '{}'; choose sum, avg or max", what, text));
}

Status validate_comm_options(const CommOptions& options) {
  if (options.timeout.count() < 0 || options.timeout > kMaxCommTimeout)
    return InvalidArgument(fmt::format("comm watchdog timeout {} ms is out of range: use 0 (no watchdog) .. {} ms (30 "
                                       "days) (--timeout-ms, STRATA_COMM_TIMEOUT_MS, CommOptions::timeout)",
                                       options.timeout.count(), kMaxCommTimeout.count()));
  return Status::Ok();
}

Result<CommOptions> apply_comm_environment(CommOptions options) {
  if (const char* t = std::getenv("STRATA_COMM_TIMEOUT_MS"); t != nullptr && *t != '\0') {
    char* end = nullptr;
    errno = 0;
    const long long ms = std::strtoll(t, &end, 10);
    if (end == t || *end != '\0' || ms < 0 || errno == ERANGE || ms > kMaxCommTimeout.count()) {
      return InvalidArgument(fmt::format(
          "STRATA_COMM_TIMEOUT_MS='{}' is not an integer of milliseconds in 0..{} (0 = no watchdog)", printable(t, 64),
          kMaxCommTimeout.count()));
    }
    options.timeout = std::chrono::milliseconds(ms);
  }
  if (const char* d = std::getenv("STRATA_COMM_DEBUG"); d != nullptr && *d != '\0') {
    const std::string_view v(d);
    if (v == "1" || v == "true" || v == "on") {
      options.debug_checks = true;
    } else if (v == "0" || v == "false" || v == "off") {
      options.debug_checks = false;
    } else {
      return InvalidArgument(fmt::format("STRATA_COMM_DEBUG='{}' must be 0 or 1", d));
    }
  }
  return options;
}

size_t recv_bytes(const CollectiveDesc& desc, int world_size) {
  const size_t elt = dtype_size(desc.dtype);
  switch (desc.op) {
    case CollectiveOp::kAllGather: return desc.count * static_cast<size_t>(world_size) * elt;
    case CollectiveOp::kReduceScatter:
    case CollectiveOp::kAllReduce:
    case CollectiveOp::kBroadcast: return desc.count * elt;
    case CollectiveOp::kBarrier: return 0;
  }
  return 0;
}

std::string describe(const CollectiveDesc& desc, int world_size) {
  const std::string bytes = format_bytes(recv_bytes(desc, world_size), true);
  switch (desc.op) {
    case CollectiveOp::kBarrier: return "barrier";
    case CollectiveOp::kAllGather:
      return fmt::format("all_gather({}, send_count {}, {} out)", dtype_name(desc.dtype), desc.count, bytes);
    case CollectiveOp::kReduceScatter:
      return fmt::format("reduce_scatter({}, {}, recv_count {}, {} out)", reduce_op_name(desc.reduce),
                         dtype_name(desc.dtype), desc.count, bytes);
    case CollectiveOp::kAllReduce:
      return fmt::format("all_reduce({}, {}, count {}, {})", reduce_op_name(desc.reduce), dtype_name(desc.dtype),
                         desc.count, bytes);
    case CollectiveOp::kBroadcast:
      return fmt::format("broadcast(root {}, {}, count {}, {})", desc.root, dtype_name(desc.dtype), desc.count,
                         bytes);
  }
  return "?";
}

Communicator::~Communicator() = default;

namespace {

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a);
  const auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

// Checks the aliasing rule of docs/comm.md: send and recv are disjoint, or
// exactly in the documented in-place position.
// `what()` names the collective in the error (formatted only then).
template <class What>
Status check_aliasing(const CollectiveDesc& d, int rank, int world, const What& what) {
  const size_t elt = dtype_size(d.dtype);
  const auto* send = static_cast<const char*>(d.send);
  auto* recv = static_cast<char*>(d.recv);
  size_t send_bytes = 0;
  size_t out_bytes = 0;
  const char* in_place_send = nullptr;  // where send must be to count as in place
  switch (d.op) {
    case CollectiveOp::kAllGather:
      send_bytes = d.count * elt;
      out_bytes = d.count * elt * static_cast<size_t>(world);
      in_place_send = recv + static_cast<size_t>(rank) * d.count * elt;
      break;
    case CollectiveOp::kReduceScatter:
      send_bytes = d.count * elt * static_cast<size_t>(world);
      out_bytes = d.count * elt;
      if (send != nullptr && recv == send + static_cast<size_t>(rank) * d.count * elt) return Status::Ok();
      break;
    case CollectiveOp::kAllReduce:
    case CollectiveOp::kBroadcast:
      send_bytes = d.count * elt;
      out_bytes = d.count * elt;
      in_place_send = recv;
      break;
    case CollectiveOp::kBarrier: return Status::Ok();
  }
  if (in_place_send != nullptr && send == in_place_send) return Status::Ok();
  if (d.op == CollectiveOp::kBroadcast && send == nullptr) return Status::Ok();
  if (overlaps(send, send_bytes, recv, out_bytes)) {
    return InvalidArgument(fmt::format(
        "{}: send [{}, +{} B) and recv [{}, +{} B) overlap but are not in the in-place position; use disjoint "
        "buffers or the in-place layout of docs/comm.md",
        what(), static_cast<const void*>(send), send_bytes, static_cast<void*>(recv), out_bytes));
  }
  return Status::Ok();
}

}  // namespace

Result<CommWork> Communicator::validate_and_submit(const CollectiveDesc& d, CommQueue queue) {
  const int world = world_size();
  const int me = rank();
  // Names the collective in an error (formatted only then: this runs per collective).
  auto what = [&] {
    return fmt::format("{} on {} rank {} of {} (queue {})", op_name(d.op), backend_name(backend()), me, world,
                       queue_name(queue));
  };
  if (queue_index(queue) < 0 || queue_index(queue) >= kCommQueueCount) {
    return InvalidArgument(fmt::format("{}: unknown comm queue {}", what(), queue_index(queue)));
  }
  const size_t elt = d.op == CollectiveOp::kBarrier ? 1 : dtype_size(d.dtype);
  if (elt == 0) return InvalidArgument(fmt::format("{}: unknown dtype {}", what(), static_cast<int>(d.dtype)));
  const bool reduces = d.op == CollectiveOp::kAllReduce || d.op == CollectiveOp::kReduceScatter;
  if (reduces && d.dtype == DType::kI64 && d.reduce == ReduceOp::kAvg) {
    return InvalidArgument(fmt::format("{}: avg of int64 is not defined (it would truncate); use sum and divide, "
                                       "or reduce fp64", what()));
  }
  const size_t factor =
      (d.op == CollectiveOp::kAllGather || d.op == CollectiveOp::kReduceScatter) ? static_cast<size_t>(world) : 1;
  if (d.count > std::numeric_limits<size_t>::max() / elt / factor) {
    return InvalidArgument(fmt::format("{}: count {} overflows the byte size", what(), d.count));
  }
  if (d.op != CollectiveOp::kBarrier && d.count > 0) {
    if (d.recv == nullptr) return InvalidArgument(fmt::format("{}: recv is null for count {}", what(), d.count));
    const bool send_needed = d.op != CollectiveOp::kBroadcast || d.root == me;
    if (send_needed && d.send == nullptr) {
      return InvalidArgument(fmt::format("{}: send is null for count {}", what(), d.count));
    }
  }
  if (d.op == CollectiveOp::kBroadcast && (d.root < 0 || d.root >= world)) {
    return InvalidArgument(fmt::format("{}: root {} is not a rank (world size {})", what(), d.root, world));
  }
  if (d.reduce != ReduceOp::kSum && d.reduce != ReduceOp::kAvg && d.reduce != ReduceOp::kMax) {
    return InvalidArgument(fmt::format("{}: unknown reduction {}", what(), static_cast<int>(d.reduce)));
  }
  if (d.count > 0) STRATA_RETURN_IF_ERROR(check_aliasing(d, me, world, what));
  QueueState& q = queues_[static_cast<size_t>(queue_index(queue))];
  std::lock_guard<std::mutex> lock(q.mutex);
  STRATA_ASSIGN_OR_RETURN(CommWork work, submit(d, queue, q.next_sequence));
  ++q.next_sequence;
  q.last = work;
  return work;
}

Result<CommWork> Communicator::all_gather(const void* send, void* recv, size_t send_count, DType dtype,
                                          CommQueue queue) {
  CollectiveDesc d;
  d.op = CollectiveOp::kAllGather;
  d.dtype = dtype;
  d.count = send_count;
  d.send = send;
  d.recv = recv;
  return validate_and_submit(d, queue);
}

Result<CommWork> Communicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                              ReduceOp op, CommQueue queue) {
  CollectiveDesc d;
  d.op = CollectiveOp::kReduceScatter;
  d.dtype = dtype;
  d.reduce = op;
  d.count = recv_count;
  d.send = send;
  d.recv = recv;
  return validate_and_submit(d, queue);
}

Result<CommWork> Communicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                                          CommQueue queue) {
  CollectiveDesc d;
  d.op = CollectiveOp::kAllReduce;
  d.dtype = dtype;
  d.reduce = op;
  d.count = count;
  d.send = send;
  d.recv = recv;
  return validate_and_submit(d, queue);
}

Result<CommWork> Communicator::broadcast(const void* send, void* recv, size_t count, DType dtype, int root,
                                         CommQueue queue) {
  CollectiveDesc d;
  d.op = CollectiveOp::kBroadcast;
  d.dtype = dtype;
  d.root = root;
  d.count = count;
  d.send = send;
  d.recv = recv;
  return validate_and_submit(d, queue);
}

Result<CommWork> Communicator::barrier(CommQueue queue) {
  CollectiveDesc d;
  d.op = CollectiveOp::kBarrier;
  return validate_and_submit(d, queue);
}

Status Communicator::synchronize(CommQueue queue) {
  if (queue_index(queue) < 0 || queue_index(queue) >= kCommQueueCount) {
    return InvalidArgument(fmt::format("synchronize: unknown comm queue {}", queue_index(queue)));
  }
  CommWork last;
  {
    const QueueState& q = queues_[static_cast<size_t>(queue_index(queue))];
    std::lock_guard<std::mutex> lock(q.mutex);
    last = q.last;
  }
  return last.wait();
}

Status Communicator::synchronize() {
  Status first;
  for (CommQueue q : kAllCommQueues) {
    Status s = synchronize(q);
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  return first;
}

Status Communicator::wait(const Completion& completion, CommQueue queue) {
  if (queue_index(queue) < 0 || queue_index(queue) >= kCommQueueCount) {
    return InvalidArgument(fmt::format("wait: unknown comm queue {}", queue_index(queue)));
  }
  if (completion.done() && completion.status().ok()) return Status::Ok();  // a gate that orders nothing
  QueueState& q = queues_[static_cast<size_t>(queue_index(queue))];
  std::lock_guard<std::mutex> lock(q.mutex);
  return submit_gate(queue, &completion, nullptr);
}

Status Communicator::wait_event(Event& event, CommQueue queue) {
  if (queue_index(queue) < 0 || queue_index(queue) >= kCommQueueCount) {
    return InvalidArgument(fmt::format("wait_event: unknown comm queue {}", queue_index(queue)));
  }
  QueueState& q = queues_[static_cast<size_t>(queue_index(queue))];
  std::lock_guard<std::mutex> lock(q.mutex);
  return submit_gate(queue, nullptr, &event);
}

uint64_t Communicator::issued(CommQueue queue) const {
  if (queue_index(queue) < 0 || queue_index(queue) >= kCommQueueCount) return 0;
  const QueueState& q = queues_[static_cast<size_t>(queue_index(queue))];
  std::lock_guard<std::mutex> lock(q.mutex);
  return q.next_sequence;
}

uint64_t Communicator::issued() const {
  uint64_t total = 0;
  for (CommQueue q : kAllCommQueues) total += issued(q);
  return total;
}

Status stream_wait(Stream& stream, const CommWork& work) { return stream.wait(work.completion()); }

}  // namespace strata::comm
