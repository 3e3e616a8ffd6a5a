// The `mpi` backend: one rank per process under mpirun (OpenMPI).
//
// Note [MPI collectives with a watchdog]
// Each collective runs on the communicator's CommStream as
//   1. handshake (debug checks on): every rank sends its op descriptor to
//      every peer on a private control communicator (tag = sequence mod
//      32767) and receives theirs. When all arrived, descriptors are compared
//      (mismatch -> FailedPrecondition on every rank, before any data moves).
//      If the deadline passes first, the peers whose descriptors are missing
//      are the ranks that did not arrive.
//   2. the nonblocking MPI collective on a second private communicator,
//      polled with MPI_Test until done or the deadline.
// bf16/fp16 reductions are staged through fp32 scratch (convert, reduce in
// fp32 with MPI_FLOAT, convert back once), so they accumulate in fp32 like
// `local`; avg is an fp32 sum divided by the world size. fp64 and int64
// reductions gather every rank's input (all_gather / all_to_all of the
// blocks) and reduce locally in rank order, so the result is the same bits
// on every rank and equals `local`'s (these are small: norms, votes, counts).
// A failed or timed out collective poisons its queue: MPI cannot cancel a
// started collective, so later collectives fail fast instead of mismatching.
// Queues: each CommQueue has its own pair of MPI_Comm_dup communicators and
// its own CommStream, so the queues never wait for each other (below
// MPI_THREAD_MULTIPLE their MPI calls are serialized by one lock, but the
// nonblocking collectives still progress side by side).
// Gates (Note [Comm gates]): the handshake carries the rank's gate status;
// if any rank's gate failed every rank skips the collective and fails it
// naming the rank(s), and the queue stays usable. With debug checks off
// there is no handshake: the failed rank poisons its queue and skips, and
// its peers end at the watchdog (documented in docs/comm.md).
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "../comm_stream.h"
#include "../host_buffers.h"
#include "../reduce_kernels.h"
#include "../wire_desc.h"
#include "mpi_bootstrap.h"
#include "strata/comm/backends.h"
#include "strata/core/units.h"

namespace strata::comm {
namespace {

using Clock = std::chrono::steady_clock;

// MPI_Init_thread on first use; MPI_Finalize at exit if we initialized it.
struct MpiRuntime {
  bool initialized_here = false;
  int thread_level = MPI_THREAD_SINGLE;
  Status status;
  std::mutex serial_mutex;  // serializes MPI calls below MPI_THREAD_MULTIPLE

  MpiRuntime() {
    int already = 0;
    MPI_Initialized(&already);
    if (already) {
      MPI_Query_thread(&thread_level);
    } else {
      int argc = 0;
      char** argv = nullptr;
      const int rc = MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &thread_level);
      if (rc != MPI_SUCCESS) {
        status = Unavailable(fmt::format("MPI_Init_thread failed (code {}); is this run under mpirun?", rc));
        return;
      }
      initialized_here = true;
    }
    if (thread_level < MPI_THREAD_SERIALIZED) {
      status = Unsupported(fmt::format(
          "the MPI library provides thread level {} but the mpi communicator needs MPI_THREAD_SERIALIZED or "
          "better (it calls MPI from its own thread); initialize MPI with MPI_Init_thread",
          thread_level));
    }
  }
  ~MpiRuntime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (initialized_here && !finalized) MPI_Finalize();
  }
};

MpiRuntime& runtime() {
  static MpiRuntime rt;
  return rt;
}

// Lock held around MPI calls when the library is not fully thread-safe.
class MpiLock {
 public:
  MpiLock() : lock_(runtime().serial_mutex, std::defer_lock) {
    if (runtime().thread_level < MPI_THREAD_MULTIPLE) lock_.lock();
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(len));
}

Status mpi_status(int code, std::string_view what) {
  if (code == MPI_SUCCESS) return Status::Ok();
  return IoError(fmt::format("{}: {}", what, mpi_error_text(code)));
}

using detail::from_wire;
using detail::same_collective;
using detail::WireDesc;

constexpr int kTagModulus = 32767;  // MPI guarantees tags up to at least 32767

// One CommQueue's transport. Touched only by its stream's thread (and by
// the destructor once the stream is stopped).
struct QueueTransport {
  CommQueue queue = CommQueue::kReduce;
  MPI_Comm data = MPI_COMM_NULL;
  MPI_Comm control = MPI_COMM_NULL;
  bool poisoned = false;
  Status poison_status;
  WireDesc my_desc{};
  std::vector<WireDesc> peer_descs;
  std::vector<float> scratch_in;
  std::vector<float> scratch_out;
  std::vector<uint64_t> scratch_wide;  // fp64/int64: every rank's input block
  std::unique_ptr<detail::CommStream> stream;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(int rank, int world, CommOptions options) : rank_(rank), world_(world), options_(options) {}

  ~MpiCommunicator() override {
    Status s = synchronize();
    s.ignore();
    for (QueueTransport& t : queues_) t.stream.reset();
    MpiLock lock;
    for (QueueTransport& t : queues_) {
      // A poisoned queue may have requests MPI cannot cancel; its
      // communicators are left to MPI_Finalize rather than freed under them.
      if (t.poisoned) continue;
      if (t.data != MPI_COMM_NULL) MPI_Comm_free(&t.data);
      if (t.control != MPI_COMM_NULL) MPI_Comm_free(&t.control);
    }
  }

  // Duplicates MPI_COMM_WORLD twice per queue and starts the queues' streams.
  Status start() {
    for (int q = 0; q < kCommQueueCount; ++q) {
      QueueTransport& t = queues_[static_cast<size_t>(q)];
      t.queue = static_cast<CommQueue>(q);
      t.peer_descs.resize(static_cast<size_t>(world_));
      {
        MpiLock lock;
        STRATA_RETURN_IF_ERROR(mpi_status(MPI_Comm_dup(MPI_COMM_WORLD, &t.data), "MPI_Comm_dup"));
        STRATA_RETURN_IF_ERROR(mpi_status(MPI_Comm_dup(MPI_COMM_WORLD, &t.control), "MPI_Comm_dup"));
        MPI_Comm_set_errhandler(t.data, MPI_ERRORS_RETURN);
        MPI_Comm_set_errhandler(t.control, MPI_ERRORS_RETURN);
      }
      t.stream = std::make_unique<detail::CommStream>(fmt::format("comm-m{}-{}", rank_, queue_name(t.queue)));
    }
    return Status::Ok();
  }

  Backend backend() const override { return Backend::kMpi; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  Result<CommBuffer> allocate_buffer(size_t bytes) override { return allocate_host_comm_buffer(bytes, "mpi"); }
  Status upload(void* dst, const void* src, size_t bytes) override { return host_copy(dst, src, bytes); }
  Status download(void* dst, const void* src, size_t bytes) override { return host_copy(dst, src, bytes); }

 protected:
  Status submit_gate(CommQueue queue, const Completion* completion, Event* event) override {
    QueueTransport& t = queues_[static_cast<size_t>(queue_index(queue))];
    if (t.stream == nullptr) return FailedPrecondition("mpi communicator is shutting down");
    t.stream->enqueue_gate(detail::host_gate(queue, completion, event));
    return Status::Ok();
  }
  Result<CommWork> submit(const CollectiveDesc& desc, CommQueue queue, uint64_t sequence) override {
    QueueTransport& t = queues_[static_cast<size_t>(queue_index(queue))];
    if (t.stream == nullptr) return FailedPrecondition("mpi communicator is shutting down");
    return t.stream->enqueue(sequence, queue, where(t, desc, sequence), [this, &t, desc, sequence](const Status& gate) {
      return Completion::ready(execute(t, desc, sequence, gate));
    });
  }

 private:
  Status execute(QueueTransport& t, const CollectiveDesc& d, uint64_t sequence, const Status& gate);
  Status handshake(QueueTransport& t, const CollectiveDesc& d, uint64_t sequence, const Status& gate,
                   Clock::time_point deadline);
  Status run_collective(QueueTransport& t, const CollectiveDesc& d, uint64_t sequence, Clock::time_point deadline);
  // Polls `requests` until all complete (true) or the deadline passes
  // (false); an MPI error ends the poll with *error_code set.
  bool poll_all(std::vector<MPI_Request>& requests, Clock::time_point deadline, int* error_code);
  static Status poison(QueueTransport& t, Status status) {
    t.poisoned = true;
    t.poison_status = status;
    return status;
  }
  std::string where(const QueueTransport& t, const CollectiveDesc& d, uint64_t sequence) const {
    return fmt::format("{} #{} ({} B) on mpi rank {} of {} (queue {})", op_name(d.op), sequence,
                       recv_bytes(d, world_), rank_, world_, queue_name(t.queue));
  }

  const int rank_;
  const int world_;
  const CommOptions options_;
  std::array<QueueTransport, kCommQueueCount> queues_;
};

bool MpiCommunicator::poll_all(std::vector<MPI_Request>& requests, Clock::time_point deadline, int* error_code) {
  *error_code = MPI_SUCCESS;
  if (requests.empty()) return true;
  const bool bounded = options_.timeout.count() > 0;
  for (uint64_t spin = 0;; ++spin) {
    int flag = 0;
    {
      MpiLock lock;
      const int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        *error_code = rc;
        return true;
      }
    }
    if (flag) return true;
    if ((spin & 63) == 0 && bounded && Clock::now() >= deadline) return false;
    // MPI progresses only inside MPI calls, so keep testing; yield the core
    // to other ranks (oversubscribed runs) and nap only after a long wait.
    if (spin > 200000) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else if (spin > 64) {
      sched_yield();
    }
  }
}

Status MpiCommunicator::handshake(QueueTransport& t, const CollectiveDesc& d, uint64_t sequence, const Status& gate,
                                  Clock::time_point deadline) {
  t.my_desc = detail::to_wire(d, sequence, !gate.ok());
  const MPI_Comm control = t.control;
  const WireDesc& my_desc = t.my_desc;
  std::vector<WireDesc>& peer_descs = t.peer_descs;
  const int tag = static_cast<int>(sequence % kTagModulus);
  const int words = sizeof(WireDesc) / sizeof(uint64_t);
  std::vector<MPI_Request> recvs;
  std::vector<int> recv_peer;
  std::vector<MPI_Request> sends;
  {
    MpiLock lock;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      MPI_Request r;
      STRATA_RETURN_IF_ERROR(mpi_status(
          MPI_Irecv(&peer_descs[static_cast<size_t>(p)], words, MPI_UINT64_T, p, tag, control, &r), "MPI_Irecv"));
      recvs.push_back(r);
      recv_peer.push_back(p);
      STRATA_RETURN_IF_ERROR(mpi_status(MPI_Isend(&my_desc, words, MPI_UINT64_T, p, tag, control, &r), "MPI_Isend"));
      sends.push_back(r);
    }
  }
  int err = MPI_SUCCESS;
  if (poll_all(recvs, deadline, &err)) {
    STRATA_RETURN_IF_ERROR(mpi_status(err, fmt::format("handshake of {}", where(t, d, sequence))));
    if (!poll_all(sends, deadline, &err)) {
      return poison(t, DeadlineExceeded(fmt::format("comm watchdog: {}: handshake sends did not complete within {} ms",
                                                    where(t, d, sequence), options_.timeout.count())));
    }
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      const WireDesc& other = peer_descs[static_cast<size_t>(p)];
      if (!same_collective(my_desc, other)) {
        return poison(t, FailedPrecondition(fmt::format(
            "collective mismatch at #{} on mpi ({} ranks, queue {}): rank {} issued {} but rank {} issued {} (its "
            "#{}). Every rank must issue the same collectives, with the same dtype, count, root and reduction, in "
            "the same order on each queue (a classic ZeRO-3 hang: a parameter gathered on some ranks only); the "
            "queue is unusable now",
            sequence, world_, queue_name(t.queue), rank_, describe(d, world_), p, describe(from_wire(other), world_),
            other.sequence)));
      }
    }
    // The gate tally: every rank saw the same flags, so all skip together.
    std::vector<int> failed;
    for (int p = 0; p < world_; ++p) {
      const WireDesc& w = p == rank_ ? my_desc : peer_descs[static_cast<size_t>(p)];
      if (w.gate_failed != 0) failed.push_back(p);
    }
    if (failed.empty()) return Status::Ok();
    if (!gate.ok()) return gate.with_context(fmt::format("{} not run", where(t, d, sequence)));
    return FailedPrecondition(fmt::format(
        "{} not run: the gate of rank(s) {} failed, so every rank skipped it; rank {}'s log has the gate's error",
        where(t, d, sequence), detail::format_rank_list(failed), failed.front()));
  }
  // Timed out: the peers whose descriptors are missing did not arrive.
  std::vector<int> missing;
  std::string details;
  {
    MpiLock lock;
    for (size_t i = 0; i < recvs.size(); ++i) {
      int done = 0;
      MPI_Test(&recvs[i], &done, MPI_STATUS_IGNORE);
      if (done) continue;
      const int p = recv_peer[i];
      missing.push_back(p);
      MPI_Cancel(&recvs[i]);
      MPI_Wait(&recvs[i], MPI_STATUS_IGNORE);
      details += fmt::format("; rank {} has not issued #{}", p, sequence);
    }
    for (MPI_Request& r : sends) {
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);  // tiny eager sends complete on their own
    }
  }
  return poison(t, DeadlineExceeded(fmt::format(
      "comm watchdog: {} did not complete within {} ms: ranks that did not arrive: {}{}. Hint: every rank must "
      "issue the same collectives in the same order on each queue; if a rank is legitimately slow (or waits on "
      "a gate) raise CommOptions::timeout or STRATA_COMM_TIMEOUT_MS",
      where(t, d, sequence), options_.timeout.count(), detail::format_rank_list(missing), details)));
}

Status MpiCommunicator::execute(QueueTransport& t, const CollectiveDesc& d, uint64_t sequence, const Status& gate) {
  if (t.poisoned) {
    return FailedPrecondition(fmt::format("{}: queue unusable after an earlier failure: {}", where(t, d, sequence),
                                          t.poison_status.message()));
  }
  const Clock::time_point deadline = Clock::now() + options_.timeout;
  if (options_.debug_checks && world_ > 1) {
    STRATA_RETURN_IF_ERROR(handshake(t, d, sequence, gate, deadline));
  } else if (!gate.ok()) {
    if (world_ == 1) return gate.with_context(fmt::format("{} not run", where(t, d, sequence)));
    // No handshake to tell the peers: skip, poison, and let their watchdog
    // end the collective (Note [Comm gates]).
    return poison(t, gate.with_context(fmt::format(
                         "{} not run (debug checks off: the peers cannot be told and will end at their watchdog; "
                         "set STRATA_COMM_DEBUG=1 to have them skip it too)",
                         where(t, d, sequence))));
  }
  Status s = run_collective(t, d, sequence, deadline);
  if (!s.ok() && !t.poisoned) poison(t, s).ignore();
  return s;
}

Status MpiCommunicator::run_collective(QueueTransport& t, const CollectiveDesc& d, uint64_t sequence,
                                       Clock::time_point deadline) {
  const MPI_Comm data = t.data;
  const size_t elt = dtype_size(d.dtype);
  if (d.op != CollectiveOp::kBarrier && d.count > static_cast<size_t>(INT_MAX)) {
    return Unsupported(fmt::format("{}: count {} exceeds MPI's int count limit {}; split the buffer",
                                   where(t, d, sequence), d.count, INT_MAX));
  }
  const int count = static_cast<int>(d.count);
  const bool wide = elt == 8;                           // fp64 / int64: gathered, reduced here
  const bool is16 = elt == 2;                           // bf16 / fp16: staged through fp32
  const MPI_Datatype move_type = wide ? MPI_UINT64_T : (is16 ? MPI_UINT16_T : MPI_FLOAT);
  const MPI_Op mpi_op = d.reduce == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_SUCCESS;
  // Post-processing after completion: avg division and 16-bit conversion
  // (fp32 result in `reduced`), or the rank-order reduction of the gathered
  // 64-bit blocks in t.scratch_wide.
  float* reduced = nullptr;
  size_t reduced_count = 0;
  bool reduce_gathered = false;
  switch (d.op) {
    case CollectiveOp::kBarrier: {
      MpiLock lock;
      rc = MPI_Ibarrier(data, &req);
      break;
    }
    case CollectiveOp::kAllGather: {
      const void* send = d.send == static_cast<char*>(d.recv) + static_cast<size_t>(rank_) * d.count * elt
                             ? MPI_IN_PLACE
                             : d.send;
      if (d.count == 0) break;
      MpiLock lock;
      rc = MPI_Iallgather(send, count, move_type, d.recv, count, move_type, data, &req);
      break;
    }
    case CollectiveOp::kBroadcast: {
      if (d.count == 0) break;
      if (rank_ == d.root && d.send != d.recv) std::memcpy(d.recv, d.send, d.count * elt);
      MpiLock lock;
      rc = MPI_Ibcast(d.recv, count, move_type, d.root, data, &req);
      break;
    }
    case CollectiveOp::kReduceScatter: {
      if (d.count == 0) break;
      if (wide) {
        // Block r of every rank's send lands at t.scratch_wide[p * count].
        t.scratch_wide.resize(d.count * static_cast<size_t>(world_));
        reduce_gathered = true;
        MpiLock lock;
        rc = MPI_Ialltoall(d.send, count, MPI_UINT64_T, t.scratch_wide.data(), count, MPI_UINT64_T, data, &req);
        break;
      }
      const size_t total = d.count * static_cast<size_t>(world_);
      const float* in = static_cast<const float*>(d.send);
      if (is16) {
        t.scratch_in.resize(total);
        detail::to_fp32(d.dtype, d.send, t.scratch_in.data(), total);
        in = t.scratch_in.data();
      }
      const bool in_place = static_cast<const char*>(d.send) + static_cast<size_t>(rank_) * d.count * elt ==
                            static_cast<const char*>(d.recv);
      float* out = static_cast<float*>(d.recv);
      if (is16 || in_place) {
        t.scratch_out.resize(d.count);
        out = t.scratch_out.data();
      }
      reduced = out;
      reduced_count = d.count;
      MpiLock lock;
      rc = MPI_Ireduce_scatter_block(in, out, count, MPI_FLOAT, mpi_op, data, &req);
      break;
    }
    case CollectiveOp::kAllReduce: {
      if (d.count == 0) break;
      if (wide) {
        t.scratch_wide.resize(d.count * static_cast<size_t>(world_));
        reduce_gathered = true;
        MpiLock lock;
        rc = MPI_Iallgather(d.send, count, MPI_UINT64_T, t.scratch_wide.data(), count, MPI_UINT64_T, data, &req);
        break;
      }
      float* out = static_cast<float*>(d.recv);
      const void* in = d.send == d.recv ? MPI_IN_PLACE : d.send;
      if (is16) {
        t.scratch_out.resize(d.count);
        detail::to_fp32(d.dtype, d.send, t.scratch_out.data(), d.count);
        out = t.scratch_out.data();
        in = MPI_IN_PLACE;
      }
      reduced = out;
      reduced_count = d.count;
      MpiLock lock;
      rc = MPI_Iallreduce(in, out, count, MPI_FLOAT, mpi_op, data, &req);
      break;
    }
  }
  STRATA_RETURN_IF_ERROR(mpi_status(rc, where(t, d, sequence)));
  if (req != MPI_REQUEST_NULL) {
    std::vector<MPI_Request> reqs{req};
    int err = MPI_SUCCESS;
    if (!poll_all(reqs, deadline, &err)) {
      return poison(t, DeadlineExceeded(fmt::format(
          "comm watchdog: {} did not complete within {} ms although {}; a rank may have died or stalled inside "
          "MPI. Hint: check the other ranks' logs; raise CommOptions::timeout or STRATA_COMM_TIMEOUT_MS if they "
          "are merely slow",
          where(t, d, sequence), options_.timeout.count(),
          options_.debug_checks ? "every rank arrived (handshake complete)"
                                : "arrival is unknown (debug checks off: STRATA_COMM_DEBUG=0)")));
    }
    STRATA_RETURN_IF_ERROR(mpi_status(err, where(t, d, sequence)));
  }
  if (reduce_gathered) {
    std::vector<const void*> inputs(static_cast<size_t>(world_));
    for (int p = 0; p < world_; ++p) {
      inputs[static_cast<size_t>(p)] = t.scratch_wide.data() + static_cast<size_t>(p) * d.count;
    }
    detail::reduce_elements(d.dtype, d.reduce, inputs.data(), world_, d.count, d.recv, world_);
  }
  if (reduced != nullptr) {
    if (d.reduce == ReduceOp::kAvg) {
      const auto n = static_cast<float>(world_);
      for (size_t i = 0; i < reduced_count; ++i) reduced[i] /= n;
    }
    if (is16) {
      detail::from_fp32(d.dtype, reduced, d.recv, reduced_count);
    } else if (reduced != d.recv) {
      std::memcpy(d.recv, reduced, reduced_count * sizeof(float));
    }
  }
  return Status::Ok();
}

}  // namespace

bool mpi_compiled() { return true; }

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return "unknown";
  std::string s(text, static_cast<size_t>(len));
  const size_t nl = s.find_first_of("\n,");
  if (nl != std::string::npos) s.resize(nl);
  return s;
}

Result<std::unique_ptr<Communicator>> create_mpi_communicator(CommOptions options) {
  STRATA_RETURN_IF_ERROR(validate_comm_options(options));
  MpiRuntime& rt = runtime();
  STRATA_RETURN_IF_ERROR(rt.status);
  int rank = 0;
  int world = 1;
  {
    MpiLock lock;
    STRATA_RETURN_IF_ERROR(mpi_status(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank"));
    STRATA_RETURN_IF_ERROR(mpi_status(MPI_Comm_size(MPI_COMM_WORLD, &world), "MPI_Comm_size"));
  }
  auto comm = std::make_unique<MpiCommunicator>(rank, world, options);
  STRATA_RETURN_IF_ERROR(comm->start());
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata::comm

namespace strata::comm::detail {

Status mpi_world(int* rank, int* world_size) {
  STRATA_RETURN_IF_ERROR(runtime().status);
  MpiLock lock;
  STRATA_RETURN_IF_ERROR(mpi_status(MPI_Comm_rank(MPI_COMM_WORLD, rank), "MPI_Comm_rank"));
  return mpi_status(MPI_Comm_size(MPI_COMM_WORLD, world_size), "MPI_Comm_size");
}

Status mpi_broadcast_bytes(void* data, size_t bytes, int root) {
  STRATA_RETURN_IF_ERROR(runtime().status);
  MpiLock lock;
  return mpi_status(MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
}

}  // namespace strata::comm::detail
