// The `nccl` backend: GPU collectives on device buffers.
//
// Note [NCCL on the comm stream]
// Each communicator owns a CUDA stream and an event. The CommStream worker
// launches the NCCL call on that stream, records the event and polls it
// (cudaEventQuery, ncclCommGetAsyncError) until it completes or the watchdog
// deadline passes; then the communicator is aborted (ncclCommAbort) and
// poisoned. NCCL cannot say which ranks did not arrive, so the message says
// so. The unique id is bootstrapped over MPI when launched by mpirun, through
// a file for single-host launches (rank 0 writes it atomically, others wait
// for it), and locally for world size 1. 16-bit reductions are NCCL's own
// (reduced in the element type); avg is ncclAvg.
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "../comm_stream.h"
#include "strata/comm/backends.h"
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

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, cudaEvent_t event, float* barrier_word, int device, int rank,
                   int world, CommOptions options)
      : comm_(comm), cuda_stream_(stream), event_(event), barrier_word_(barrier_word), device_(device), rank_(rank),
        world_(world), options_(options) {
    stream_ = std::make_unique<detail::CommStream>(fmt::format("comm-nccl-{}", rank));
  }
  ~NcclCommunicator() override {
    Status s = synchronize();
    s.ignore();
    stream_.reset();
    cudaSetDevice(device_);
    if (comm_ != nullptr) {
      if (poisoned_) {
        ncclCommAbort(comm_);
      } else {
        ncclCommDestroy(comm_);
      }
    }
    cudaFree(barrier_word_);
    cudaEventDestroy(event_);
    cudaStreamDestroy(cuda_stream_);
  }

  Backend backend() const override { return Backend::kNccl; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  Result<CommBuffer> allocate_buffer(size_t bytes) override {
    if (bytes == 0) return CommBuffer();
    STRATA_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      return OutOfMemory(fmt::format("nccl comm buffer of {} on cuda:{}: {}", format_bytes(bytes, true), device_,
                                     cudaGetErrorString(e)));
    }
    return CommBuffer(p, bytes, [](void* q) { cudaFree(q); });
  }
  Status upload(void* dst, const void* src, size_t bytes) override {
    STRATA_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
    return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy host to device");
  }
  Status download(void* dst, const void* src, size_t bytes) override {
    STRATA_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
    return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
  }

 protected:
  Result<CommWork> submit_task(std::function<Status()> task) override {
    return stream_->enqueue(issued(), std::move(task));
  }
  Result<CommWork> submit(const CollectiveDesc& desc, uint64_t sequence) override {
    return stream_->enqueue(sequence, [this, desc, sequence] { return execute(desc, sequence); });
  }

 private:
  std::string where(const CollectiveDesc& d, uint64_t sequence) const {
    return fmt::format("{} #{} ({} B) on nccl rank {} of {} (cuda:{})", op_name(d.op), sequence,
                       recv_bytes(d, world_), rank_, world_, device_);
  }
  Status poison(Status s) {
    poisoned_ = true;
    poison_status_ = s;
    return s;
  }
  Status launch(const CollectiveDesc& d);
  Status execute(const CollectiveDesc& d, uint64_t sequence);

  ncclComm_t comm_;
  cudaStream_t cuda_stream_;
  cudaEvent_t event_;
  float* barrier_word_;
  const int device_;
  const int rank_;
  const int world_;
  const CommOptions options_;
  bool poisoned_ = false;
  Status poison_status_;
  std::unique_ptr<detail::CommStream> stream_;
};

Status NcclCommunicator::launch(const CollectiveDesc& d) {
  const ncclDataType_t type = nccl_type(d.dtype);
  switch (d.op) {
    case CollectiveOp::kAllGather:
      return nccl_status(ncclAllGather(d.send, d.recv, d.count, type, comm_, cuda_stream_), "ncclAllGather");
    case CollectiveOp::kReduceScatter:
      return nccl_status(ncclReduceScatter(d.send, d.recv, d.count, type, nccl_op(d.reduce), comm_, cuda_stream_),
                         "ncclReduceScatter");
    case CollectiveOp::kAllReduce:
      return nccl_status(ncclAllReduce(d.send, d.recv, d.count, type, nccl_op(d.reduce), comm_, cuda_stream_),
                         "ncclAllReduce");
    case CollectiveOp::kBroadcast:
      return nccl_status(ncclBroadcast(d.send, d.recv, d.count, type, d.root, comm_, cuda_stream_), "ncclBroadcast");
    case CollectiveOp::kBarrier: {
      // NCCL has no barrier: an all_reduce of one element is one.
      return nccl_status(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm_, cuda_stream_),
                         "ncclAllReduce (barrier)");
    }
  }
  return Internal("unknown collective");
}

Status NcclCommunicator::execute(const CollectiveDesc& d, uint64_t sequence) {
  if (poisoned_) {
    return FailedPrecondition(fmt::format("{}: communicator unusable after an earlier failure: {}", where(d, sequence),
                                          poison_status_.message()));
  }
  const Clock::time_point deadline = Clock::now() + options_.timeout;
  STRATA_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
  if (d.op != CollectiveOp::kBarrier && d.count == 0) return Status::Ok();
  Status launched = launch(d);
  if (!launched.ok()) return poison(launched.with_context(where(d, sequence)));
  Status recorded = cuda_status(cudaEventRecord(event_, cuda_stream_), "cudaEventRecord");
  if (!recorded.ok()) return poison(recorded.with_context(where(d, sequence)));
  for (uint64_t spin = 0;; ++spin) {
    const cudaError_t q = cudaEventQuery(event_);
    if (q == cudaSuccess) return Status::Ok();
    if (q != cudaErrorNotReady) return poison(cuda_status(q, "cudaEventQuery").with_context(where(d, sequence)));
    ncclResult_t async_error = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async_error);
    if (async_error != ncclSuccess && async_error != ncclInProgress) {
      return poison(nccl_status(async_error, "NCCL asynchronous error").with_context(where(d, sequence)));
    }
    if (options_.timeout.count() > 0 && (spin & 63) == 0 && Clock::now() >= deadline) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      return poison(DeadlineExceeded(fmt::format(
          "comm watchdog: {} did not complete within {} ms; the NCCL communicator was aborted. Ranks that did not "
          "arrive: unknown (NCCL does not report arrival; run the same schedule on the mpi backend with "
          "STRATA_COMM_DEBUG=1 to find them). Hint: raise CommOptions::timeout or STRATA_COMM_TIMEOUT_MS if a rank "
          "is merely slow",
          where(d, sequence), options_.timeout.count())));
    }
    if (spin > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
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
Status exchange_id_through_file(ncclUniqueId* id, int rank, const std::string& path,
                                std::chrono::milliseconds timeout) {
  if (rank == 0) {
    const std::string tmp = fmt::format("{}.tmp.{}", path, getpid());
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return ErrnoStatus(errno, fmt::format("writing the NCCL id file {}", tmp));
    const size_t written = std::fwrite(id, 1, sizeof(*id), f);
    const bool closed = std::fclose(f) == 0;
    if (written != sizeof(*id) || !closed) return IoError(fmt::format("short write of the NCCL id file {}", tmp));
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      return ErrnoStatus(errno, fmt::format("renaming {} to the NCCL id file {}", tmp, path));
    }
    return Status::Ok();
  }
  const auto deadline = Clock::now() + (timeout.count() > 0 ? timeout : std::chrono::milliseconds(600000));
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      in.read(reinterpret_cast<char*>(id), sizeof(*id));
      if (in.gcount() == static_cast<std::streamsize>(sizeof(*id))) return Status::Ok();
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

  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank == 0) STRATA_RETURN_IF_ERROR(nccl_status(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  if (world > 1) {
    if (via_mpi) {
#if defined(STRATA_HAVE_MPI)
      STRATA_RETURN_IF_ERROR(detail::mpi_broadcast_bytes(&id, sizeof(id), 0));
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
      STRATA_RETURN_IF_ERROR(exchange_id_through_file(&id, rank, path, options.common.timeout));
    }
  }
  ncclComm_t comm = nullptr;
  STRATA_RETURN_IF_ERROR(nccl_status(ncclCommInitRank(&comm, world, id, rank),
                                     fmt::format("ncclCommInitRank(rank {} of {}, cuda:{})", rank, world, device)));
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
  float* word = nullptr;
  Status s = cuda_status(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  if (s.ok()) s = cuda_status(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  if (s.ok()) s = cuda_status(cudaMalloc(reinterpret_cast<void**>(&word), sizeof(float)), "cudaMalloc");
  if (s.ok()) s = cuda_status(cudaMemset(word, 0, sizeof(float)), "cudaMemset");
  if (!s.ok()) {
    if (word != nullptr) cudaFree(word);
    if (event != nullptr) cudaEventDestroy(event);
    if (stream != nullptr) cudaStreamDestroy(stream);
    ncclCommDestroy(comm);
    return s;
  }
  return std::unique_ptr<Communicator>(
      std::make_unique<NcclCommunicator>(comm, stream, event, word, device, rank, world, options.common));
}

}  // namespace strata::comm
