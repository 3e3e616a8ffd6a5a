// The `nccl` backend: GPU collectives on device buffers.
//
// Note [NCCL on the comm stream]
// Each CommQueue has its own ncclComm (NCCL requires separate communicators
// for collectives that may run concurrently) and its own Stream from the
// cuda Device (its cudaStream_t via native_handle()); buffers come from the
// same Device, so they are counted in its memory stats. The queue's
// CommStream worker only launches: gates become device-side stream waits
// (Stream::wait(Completion) / Stream::wait(Event), no host thread parked),
// the collective is enqueued on the queue's stream, and its completion is
// the stream's record_completion(): nobody spins on the host. One watchdog
// thread per communicator wakes a few times per timeout and checks the
// oldest collective of each queue against its deadline and
// ncclCommGetAsyncError; on expiry or an asynchronous error it aborts that
// queue's ncclComm (ncclCommAbort), fails every collective in flight on it,
// and poisons the queue. NCCL cannot say which ranks did not arrive, so the
// message says so. A gate that fails cannot be voted without an extra
// collective: this rank still takes part (its peers do not hang) and its
// collectives on that queue fail with the gate's Status (docs/comm.md).
// The unique ids (one per queue) are bootstrapped by the caller's own
// share_ids when given (strata.torch: torch.distributed), over MPI when
// launched by mpirun, through a file for single-host launches (rank 0 writes
// it atomically, others wait for it), and locally for world size 1. 16-bit
// reductions are NCCL's own (reduced in the element type); avg is ncclAvg.
//
// Note [One rank needs no NCCL]
// With one rank every collective is the identity (a sum, avg, min or max of
// one value is that value, exactly), so an out-of-place collective is a
// device-to-device copy on the queue's stream and an in-place one, or a
// barrier, is nothing. NCCL is still initialized (the queues, the watchdog
// and the failure paths stay the same). Measured on an H200 with NCCL
// 2.28.9 (docs/gpu-results.md, 2026-12-04): one rank's out-of-place fp64
// avg all_reduce and reduce_scatter of 4099 elements left the last element
// unwritten; with several ranks NCCL is used as before, and that case has
// not run on GPUs yet.
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "../comm_stream.h"
#include "strata/comm/backends.h"
#include "strata/core/device_registry.h"
#include "strata/core/units.h"
#if defined(STRATA_HAVE_MPI)
#include "../mpi/mpi_bootstrap.h"
#endif

namespace strata::comm {
namespace {

using Clock = std::chrono::steady_clock;

Status cuda_status(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return Status::Ok();
  return IoError(fmt::format("{}: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

Status nccl_status(ncclResult_t r, std::string_view what) {
  if (r == ncclSuccess) return Status::Ok();
  const char* last = ncclGetLastError(nullptr);
  return IoError(fmt::format("{}: {}{}{}", what, ncclGetErrorString(r), last != nullptr && *last ? ": " : "",
                             last != nullptr ? last : ""));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF64: return ncclFloat64;
    case DType::kI64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

// One collective in flight: completed exactly once, by its stream's
// completion or by the watchdog, whichever comes first.
struct InFlight {
  explicit InFlight(std::string label, Clock::time_point deadline_at)
      : source(std::move(label)), deadline(deadline_at) {}
  void complete_once(Status s) {
    if (!completed.exchange(true)) source.complete(std::move(s));
  }
  std::atomic<bool> completed{false};
  CompletionSource source;
  const Clock::time_point deadline;
};

struct NcclQueue {
  CommQueue queue = CommQueue::kReduce;
  ncclComm_t comm = nullptr;
  std::unique_ptr<Stream> stream;
  DeviceBuffer barrier_word;
  std::unique_ptr<detail::CommStream> worker;
  std::mutex mutex;  // comm, in_flight, poison (worker launches vs watchdog aborts)
  std::deque<std::shared_ptr<InFlight>> in_flight;
  bool poisoned = false;
  Status poison_status;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::unique_ptr<Device> owned, Device* device, int ordinal, int rank, int world,
                   CommOptions options)
      : owned_device_(std::move(owned)), device_(device), ordinal_(ordinal), rank_(rank), world_(world),
        options_(options) {}

  // Creates each queue's stream, barrier word and ncclComm, then the workers
  // and the watchdog. `ids` holds one unique id per queue.
  Status start(const ncclUniqueId* ids) {
    for (int q = 0; q < kCommQueueCount; ++q) {
      NcclQueue& nq = queues_[static_cast<size_t>(q)];
      nq.queue = static_cast<CommQueue>(q);
      STRATA_ASSIGN_OR_RETURN(nq.stream, device_->create_stream());
      STRATA_ASSIGN_OR_RETURN(nq.barrier_word, device_->allocate(sizeof(float)));
      STRATA_RETURN_IF_ERROR(device_->memset(nq.barrier_word.data(), 0, sizeof(float)));
      STRATA_RETURN_IF_ERROR(cuda_status(cudaSetDevice(ordinal_), "cudaSetDevice"));
      STRATA_RETURN_IF_ERROR(nccl_status(
          ncclCommInitRank(&nq.comm, world_, ids[q], rank_),
          fmt::format("ncclCommInitRank(rank {} of {}, cuda:{}, queue {})", rank_, world_, ordinal_,
                      queue_name(nq.queue))));
      nq.worker = std::make_unique<detail::CommStream>(fmt::format("comm-n{}-{}", rank_, queue_name(nq.queue)));
    }
    watchdog_ = std::thread([this] { watch(); });
    return Status::Ok();
  }

  ~NcclCommunicator() override {
    Status s = synchronize();
    s.ignore();
    for (NcclQueue& nq : queues_) nq.worker.reset();
    {
      std::lock_guard<std::mutex> lock(watchdog_mutex_);
      stopping_ = true;
    }
    watchdog_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    cudaSetDevice(ordinal_);
    for (NcclQueue& nq : queues_) {
      if (nq.comm != nullptr) {
        if (nq.poisoned) {
          ncclCommAbort(nq.comm);
        } else {
          ncclCommDestroy(nq.comm);
        }
      }
      nq.barrier_word.reset();
      nq.stream.reset();
    }
  }

  Backend backend() const override { return Backend::kNccl; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  // Device memory from the Device (counted in its memory stats).
  Result<CommBuffer> allocate_buffer(size_t bytes) override {
    if (bytes == 0) return CommBuffer();
    Result<DeviceBuffer> buffer = device_->allocate(bytes);
    if (!buffer.ok()) {
      return buffer.status().with_context(
          fmt::format("nccl comm buffer of {} on cuda:{}", format_bytes(bytes, true), ordinal_));
    }
    auto owner = std::make_shared<DeviceBuffer>(std::move(buffer).value());
    void* data = owner->data();
    return CommBuffer(data, bytes, [owner](void*) { owner->reset(); });
  }
  Status upload(void* dst, const void* src, size_t bytes) override {
    return device_->copy(dst, src, bytes, CopyKind::kHostToDevice);
  }
  Status download(void* dst, const void* src, size_t bytes) override {
    return device_->copy(dst, src, bytes, CopyKind::kDeviceToHost);
  }

 protected:
  // Device-side: the queue's stream waits; the worker does not.
  Status submit_gate(CommQueue queue, const Completion* completion, Event* event) override {
    NcclQueue& nq = queues_[static_cast<size_t>(queue_index(queue))];
    Stream* stream = nq.stream.get();
    if (completion != nullptr) {
      nq.worker->enqueue_gate([stream, gate = *completion] { return stream->wait(gate); });
    } else {
      nq.worker->enqueue_gate([stream, event] { return stream->wait(*event); });
    }
    return Status::Ok();
  }
  Result<CommWork> submit(const CollectiveDesc& desc, CommQueue queue, uint64_t sequence) override {
    NcclQueue& nq = queues_[static_cast<size_t>(queue_index(queue))];
    return nq.worker->enqueue(sequence, queue, where(nq, desc, sequence),
                              [this, &nq, desc, sequence](const Status& gate) {
                                return execute(nq, desc, sequence, gate);
                              });
  }

 private:
  std::string where(const NcclQueue& nq, const CollectiveDesc& d, uint64_t sequence) const {
    return fmt::format("{} #{} ({} B) on nccl rank {} of {} (cuda:{}, queue {})", op_name(d.op), sequence,
                       recv_bytes(d, world_), rank_, world_, ordinal_, queue_name(nq.queue));
  }
  static Status poison_locked(NcclQueue& nq, Status s) {
    if (!nq.poisoned) {
      nq.poisoned = true;
      nq.poison_status = s;
    }
    return s;
  }
  Status launch(NcclQueue& nq, const CollectiveDesc& d);
  Completion execute(NcclQueue& nq, const CollectiveDesc& d, uint64_t sequence, const Status& gate);
  void watch();

  std::unique_ptr<Device> owned_device_;  // first member: destroyed last
  Device* device_;
  const int ordinal_;
  const int rank_;
  const int world_;
  const CommOptions options_;
  std::array<NcclQueue, kCommQueueCount> queues_;
  std::mutex watchdog_mutex_;
  std::condition_variable watchdog_cv_;
  bool stopping_ = false;
  std::thread watchdog_;
};

Status NcclCommunicator::launch(NcclQueue& nq, const CollectiveDesc& d) {
  const ncclDataType_t type = nccl_type(d.dtype);
  auto cuda_stream = static_cast<cudaStream_t>(nq.stream->native_handle());
  if (world_ == 1) {  // Note [One rank needs no NCCL]
    if (d.op == CollectiveOp::kBarrier || d.send == d.recv) return Status::Ok();
    return cuda_status(cudaMemcpyAsync(d.recv, d.send, recv_bytes(d, 1), cudaMemcpyDeviceToDevice, cuda_stream),
                       "cudaMemcpyAsync (one rank's collective)");
  }
  switch (d.op) {
    case CollectiveOp::kAllGather:
      return nccl_status(ncclAllGather(d.send, d.recv, d.count, type, nq.comm, cuda_stream), "ncclAllGather");
    case CollectiveOp::kReduceScatter:
      return nccl_status(ncclReduceScatter(d.send, d.recv, d.count, type, nccl_op(d.reduce), nq.comm, cuda_stream),
                         "ncclReduceScatter");
    case CollectiveOp::kAllReduce:
      return nccl_status(ncclAllReduce(d.send, d.recv, d.count, type, nccl_op(d.reduce), nq.comm, cuda_stream),
                         "ncclAllReduce");
    case CollectiveOp::kBroadcast:
      return nccl_status(ncclBroadcast(d.send, d.recv, d.count, type, d.root, nq.comm, cuda_stream),
                         "ncclBroadcast");
    case CollectiveOp::kBarrier: {
      // NCCL has no barrier: an all_reduce of one element is one.
      void* word = nq.barrier_word.data();
      return nccl_status(ncclAllReduce(word, word, 1, ncclFloat32, ncclSum, nq.comm, cuda_stream),
                         "ncclAllReduce (barrier)");
    }
  }
  return Internal("unknown collective");
}

Completion NcclCommunicator::execute(NcclQueue& nq, const CollectiveDesc& d, uint64_t sequence, const Status& gate) {
  const std::string what = where(nq, d, sequence);
  auto op = std::make_shared<InFlight>(what, Clock::now() + options_.timeout);
  Completion done = op->source.completion();
  Status refused;  // completed outside the lock: callbacks may call back into the communicator
  {
    std::lock_guard<std::mutex> lock(nq.mutex);
    if (nq.poisoned) {
      refused = FailedPrecondition(
          fmt::format("{}: queue unusable after an earlier failure: {}", what, nq.poison_status.message()));
    } else if (Status set = cuda_status(cudaSetDevice(ordinal_), "cudaSetDevice"); !set.ok()) {
      refused = set.with_context(what);
    } else if (d.op == CollectiveOp::kBarrier || d.count > 0) {
      // Launched even behind a failed gate, so the peers do not hang.
      Status launched = launch(nq, d);
      if (!launched.ok()) refused = poison_locked(nq, launched.with_context(what));
    }
    if (refused.ok()) nq.in_flight.push_back(op);
  }
  if (!refused.ok()) {
    op->complete_once(std::move(refused));
    return done;
  }
  Status gate_failure = gate.ok() ? Status::Ok() : gate.with_context(fmt::format("{} ran behind a failed gate", what));
  nq.stream->record_completion().then([op, gate_failure, what](const Status& s) {
    if (!gate_failure.ok()) return op->complete_once(gate_failure);
    op->complete_once(s.ok() ? s : s.with_context(what));
  });
  watchdog_cv_.notify_all();
  return done;
}

void NcclCommunicator::watch() {
  const auto period = options_.timeout.count() > 0
                          ? std::clamp(options_.timeout / 8, std::chrono::milliseconds(1), std::chrono::milliseconds(200))
                          : std::chrono::milliseconds(200);
  std::unique_lock<std::mutex> wlock(watchdog_mutex_);
  while (!stopping_) {
    watchdog_cv_.wait_for(wlock, period);
    if (stopping_) break;
    wlock.unlock();
    for (NcclQueue& nq : queues_) {
      std::vector<std::shared_ptr<InFlight>> failed;
      Status failure;
      {
        std::lock_guard<std::mutex> lock(nq.mutex);
        while (!nq.in_flight.empty() && nq.in_flight.front()->completed.load()) nq.in_flight.pop_front();
        if (nq.in_flight.empty() || nq.comm == nullptr) continue;
        ncclResult_t async_error = ncclSuccess;
        ncclCommGetAsyncError(nq.comm, &async_error);
        const std::string oldest = std::string(nq.in_flight.front()->source.completion().label());
        if (async_error != ncclSuccess && async_error != ncclInProgress) {
          failure = nccl_status(async_error, "NCCL asynchronous error").with_context(oldest);
        } else if (options_.timeout.count() > 0 && Clock::now() >= nq.in_flight.front()->deadline) {
          failure = DeadlineExceeded(fmt::format(
              "comm watchdog: {} did not complete within {} ms; the queue's NCCL communicator was aborted. Ranks "
              "that did not arrive: unknown (NCCL does not report arrival; run the same schedule on the mpi "
              "backend with STRATA_COMM_DEBUG=1 to find them). Hint: raise CommOptions::timeout or "
              "STRATA_COMM_TIMEOUT_MS if a rank is merely slow (or waits on a gate)",
              oldest, options_.timeout.count()));
        } else {
          continue;
        }
        cudaSetDevice(ordinal_);
        ncclCommAbort(nq.comm);
        nq.comm = nullptr;
        poison_locked(nq, failure).ignore();
        failed.assign(nq.in_flight.begin(), nq.in_flight.end());
        nq.in_flight.clear();
      }
      for (auto& op : failed) op->complete_once(failure);  // outside the lock: callbacks run here
    }
    wlock.lock();
  }
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (end != v && *end == '\0') ? static_cast<int>(x) : fallback;
}

// Rank 0 writes the id to `path` atomically (write tmp, rename); the others
// wait for the file until the deadline.
Status exchange_id_through_file(ncclUniqueId* ids, size_t count, int rank, const std::string& path,
                                std::chrono::milliseconds timeout) {
  const size_t bytes = count * sizeof(ncclUniqueId);
  if (rank == 0) {
    const std::string tmp = fmt::format("{}.tmp.{}", path, getpid());
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return ErrnoStatus(errno, fmt::format("writing the NCCL id file {}", tmp));
    const size_t written = std::fwrite(ids, 1, bytes, f);
    const bool closed = std::fclose(f) == 0;
    if (written != bytes || !closed) return IoError(fmt::format("short write of the NCCL id file {}", tmp));
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      return ErrnoStatus(errno, fmt::format("renaming {} to the NCCL id file {}", tmp, path));
    }
    return Status::Ok();
  }
  const auto deadline = Clock::now() + (timeout.count() > 0 ? timeout : std::chrono::milliseconds(600000));
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      in.read(reinterpret_cast<char*>(ids), static_cast<std::streamsize>(bytes));
      if (in.gcount() == static_cast<std::streamsize>(bytes)) return Status::Ok();
    }
    if (Clock::now() >= deadline) {
      return DeadlineExceeded(fmt::format(
          "rank {} waited {} ms for the NCCL id file {} that rank 0 writes; is rank 0 running with the same "
          "--nccl-id-file / STRATA_NCCL_ID_FILE on a shared file system?",
          rank, timeout.count(), path));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

bool nccl_compiled() { return true; }

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
}

Result<int> cuda_device_count() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cuda_status(e, "cudaGetDeviceCount");
  }
  return n;
}

Result<std::unique_ptr<Communicator>> create_nccl_communicator(NcclOptions options) {
  STRATA_RETURN_IF_ERROR(validate_comm_options(options.common));
  STRATA_ASSIGN_OR_RETURN(int devices, cuda_device_count());
  if (devices <= 0) return Unsupported("nccl communicator: no CUDA device on this machine; use --backend mpi or local");
  int rank = options.rank;
  int world = options.world_size;
  bool via_mpi = false;
#if defined(STRATA_HAVE_MPI)
  if ((rank < 0 || world < 0) && launched_by_mpi()) {
    STRATA_RETURN_IF_ERROR(detail::mpi_world(&rank, &world));
    via_mpi = true;
  }
#endif
  if (rank < 0) rank = env_int("STRATA_RANK", 0);
  if (world < 0) world = env_int("STRATA_WORLD_SIZE", 1);
  if (world < 1 || rank < 0 || rank >= world) {
    return InvalidArgument(fmt::format("nccl communicator: rank {} is not in a world of {} (STRATA_RANK / "
                                       "STRATA_WORLD_SIZE or NcclOptions)", rank, world));
  }
  int device = options.device;
  if (device < 0) device = env_int("OMPI_COMM_WORLD_LOCAL_RANK", rank) % devices;
  if (device >= devices) {
    return InvalidArgument(fmt::format("nccl communicator: cuda:{} does not exist ({} devices)", device, devices));
  }
  STRATA_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "cudaSetDevice"));

  // The Device the queues' streams and buffers come from.
  std::unique_ptr<Device> owned;
  Device* dev = options.cuda_device;
  if (dev == nullptr) {
    DeviceOptions dopts;
    dopts.ordinal = device;
    Result<std::unique_ptr<Device>> made = make_device("cuda", dopts);
    if (!made.ok()) return made.status().with_context(fmt::format("nccl communicator on cuda:{}", device));
    owned = std::move(made).value();
    dev = owned.get();
  } else if (dev->caps().backend != "cuda" || dev->caps().ordinal != device) {
    return InvalidArgument(fmt::format(
        "nccl communicator: NcclOptions::cuda_device is {} {} but the communicator runs on cuda:{}; pass the cuda "
        "Device of that GPU (or none)",
        dev->caps().backend, dev->caps().ordinal, device));
  }

  std::array<ncclUniqueId, kCommQueueCount> ids;
  std::memset(ids.data(), 0, sizeof(ids));
  if (rank == 0) {
    for (ncclUniqueId& id : ids) STRATA_RETURN_IF_ERROR(nccl_status(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  }
  if (world > 1) {
    if (options.share_ids) {
      STRATA_RETURN_IF_ERROR(options.share_ids(std::as_writable_bytes(std::span<ncclUniqueId>(ids))));
    } else if (via_mpi) {
#if defined(STRATA_HAVE_MPI)
      STRATA_RETURN_IF_ERROR(detail::mpi_broadcast_bytes(ids.data(), sizeof(ids), 0));
#endif
    } else {
      std::string path = options.id_file;
      if (path.empty()) {
        if (const char* e = std::getenv("STRATA_NCCL_ID_FILE")) path = e;
      }
      if (path.empty()) {
        return InvalidArgument(fmt::format(
            "nccl communicator: world size {} needs a unique-id bootstrap: launch under mpirun or set "
            "STRATA_NCCL_ID_FILE (NcclOptions::id_file) to a fresh path every rank can read", world));
      }
      STRATA_RETURN_IF_ERROR(exchange_id_through_file(ids.data(), ids.size(), rank, path, options.common.timeout));
    }
  }
  auto comm = std::make_unique<NcclCommunicator>(std::move(owned), dev, device, rank, world, options.common);
  STRATA_RETURN_IF_ERROR(comm->start(ids.data()));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata::comm
