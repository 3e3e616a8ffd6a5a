// The `torch` communicator (torch_distributed_communicator.h).
//
// Note [Collectives over torch.distributed]
// Queues: each CommQueue has its own gloo group (dist.new_group over every
// rank, made when the engine is made, in queue order on every rank) and its
// own ordered worker (comm's CommStream), so two queues never interleave
// their ops on one gloo group in different orders on different ranks.
// Threads: a worker takes the GIL only to call torch; torch gives it up
// while a collective runs, and every binding of the engine that can wait for
// a collective gives it up too (engine_bindings.cpp), so neither waits for
// the other. A world of one rank never touches Python.
// Arithmetic: the engine's canonical order. A reduction gathers every rank's
// contribution (all_gather for all_reduce, all_to_all for reduce_scatter:
// block r of every rank to rank r) and sums here in rank order 0..n-1 with
// comm's reduce kernels (bf16/fp16 accumulate in fp32 and round once, fp64
// and int64 in their own type), so losses are bit-identical to the local
// backend at any world size, and to mpi at two ranks (MPI may order a sum of
// more ranks its own way). Data moves as bytes (uint8 tensors viewing the
// engine's memory), so any dtype works on any torch version.
// Watchdog: every gloo op is bounded by its group's timeout, the
// communicator's CommOptions::timeout (strata.wait_timeout_s). With debug
// checks on (the default), each collective first adds one to this rank's
// arrival counter of the queue in torch.distributed's store and all-gathers
// its descriptor (op, dtype, count, root, reduction, sequence, gate): ranks
// that issued different collectives fail before data moves, a failed gate
// makes every rank skip the collective (Note [Comm gates]), and a collective
// that times out or loses a peer names the ranks whose counters show they
// never issued it. After a failure the queue is poisoned: a gloo op cannot
// be cancelled, so later collectives fail fast instead of mismatching.
// Shutdown: at interpreter exit (atexit, before finalization starts) every
// communicator drains its queues and stops its workers; a worker never takes
// the GIL once the interpreter is finalizing, and a communicator destroyed
// then leaks its Python objects rather than touch a dying interpreter.
#include "torch_distributed_communicator.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm_stream.h"
#include "host_buffers.h"
#include "interpreter.h"
#include "reduce_kernels.h"
#include "wire_desc.h"

namespace strata::python {
namespace {

using comm::CollectiveDesc;
using comm::CollectiveOp;
using comm::CommQueue;
using comm::ReduceOp;

// What a rank tells its peers before a collective (the handshake): the mpi
// backend's descriptor (wire_desc.h), gathered as an int64 tensor.
using comm::detail::from_wire;
using comm::detail::same_collective;
using comm::detail::WireDesc;

// torch's functions and the store, resolved once; touched with the GIL held.
struct TorchApi {
  py::object frombuffer, uint8, int64;
  py::object all_gather, all_to_all_single, broadcast, barrier, destroy_group;
  py::object store;  // arrival counters (a PrefixStore), or None when the default store is unreachable
  std::array<py::object, comm::kCommQueueCount> groups;
};

class TorchDistributedCommunicator;

thread_local bool on_worker = false;  // on_torch_comm_worker()

// Live communicators, stopped at interpreter exit.
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::set<TorchDistributedCommunicator*>& live_communicators() {
  static auto* live = new std::set<TorchDistributedCommunicator*>();  // leaked: outlives static destruction
  return *live;
}
void stop_all_at_exit();

class TorchDistributedCommunicator final : public comm::Communicator {
 public:
  TorchDistributedCommunicator(int rank, int world, comm::CommOptions options, std::unique_ptr<TorchApi> api)
      : rank_(rank), world_(world), options_(options), api_(std::move(api)) {
    for (int q = 0; q < comm::kCommQueueCount; ++q) {
      QueueState& state = queues_[static_cast<size_t>(q)];
      state.queue = static_cast<CommQueue>(q);
      state.all.resize(static_cast<size_t>(world_));
      state.stream = std::make_unique<comm::detail::CommStream>(
          fmt::format("comm-t{}-{}", rank_, comm::queue_name(state.queue)));
    }
    std::lock_guard<std::mutex> lock(registry_mutex());
    live_communicators().insert(this);
  }

  ~TorchDistributedCommunicator() override {
    const bool finalizing = interpreter_finalizing();
    const bool holds_gil = PyGILState_Check() != 0;
    {
      // The workers may need the GIL to finish what is queued.
      std::optional<py::gil_scoped_release> unlocked;
      if (holds_gil && !finalizing) unlocked.emplace();
      {
        std::lock_guard<std::mutex> lock(registry_mutex());
        live_communicators().erase(this);
      }
      stop_workers();
    }
    if (holds_gil) {
      release_groups(finalizing);
    } else if (!finalizing) {
      py::gil_scoped_acquire gil;
      release_groups(false);
    } else {
      (void)api_.release();  // no GIL to be had: leaked, the interpreter is going away
    }
  }

  comm::Backend backend() const override { return comm::Backend::kTorch; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Result<comm::CommBuffer> allocate_buffer(size_t bytes) override {
    return comm::allocate_host_comm_buffer(bytes, "torch");
  }
  Status upload(void* dst, const void* src, size_t bytes) override { return comm::host_copy(dst, src, bytes); }
  Status download(void* dst, const void* src, size_t bytes) override { return comm::host_copy(dst, src, bytes); }

  // Drops the Python objects (GIL held); the gloo groups are destroyed
  // first (a local act), unless the interpreter is finalizing.
  void release_groups(bool finalizing) {
    if (!finalizing && api_->destroy_group) {
      for (py::object& group : api_->groups) {
        if (!group || group.is_none()) continue;
        try {
          api_->destroy_group(group);
        } catch (py::error_already_set&) {  // torch tore its groups down already: nothing left to free
        }
      }
    }
    api_.reset();
  }

  // Runs what is queued, then ends the workers; later collectives fail. The
  // caller must not hold the GIL (the workers may need it).
  void stop_workers() {
    for (QueueState& q : queues_) {
      std::unique_ptr<comm::detail::CommStream> stream;
      {
        std::lock_guard<std::mutex> lock(q.stream_mutex);
        stream = std::move(q.stream);
      }
      stream.reset();  // joins after the queued items ran
    }
  }

 protected:
  Result<comm::CommWork> submit(const CollectiveDesc& desc, CommQueue queue, uint64_t sequence) override {
    QueueState& q = queues_[static_cast<size_t>(comm::queue_index(queue))];
    std::lock_guard<std::mutex> lock(q.stream_mutex);
    if (q.stream == nullptr) return FailedPrecondition(fmt::format("{}: {}", where(q, desc, sequence), kStopped));
    return q.stream->enqueue(sequence, queue, where(q, desc, sequence), [this, &q, desc, sequence](const Status& gate) {
      return Completion::ready(execute(q, desc, sequence, gate));
    });
  }
  Status submit_gate(CommQueue queue, const Completion* completion, Event* event) override {
    QueueState& q = queues_[static_cast<size_t>(comm::queue_index(queue))];
    std::lock_guard<std::mutex> lock(q.stream_mutex);
    if (q.stream == nullptr) return FailedPrecondition(fmt::format("a gate on queue {}: {}", comm::queue_name(queue),
                                                                   kStopped));
    q.stream->enqueue_gate(comm::detail::host_gate(queue, completion, event));
    return Status::Ok();
  }

 private:
  static constexpr const char* kStopped =
      "the torch communicator is stopped (the interpreter is exiting, or its engine is being destroyed)";

  // One CommQueue's state; touched by its worker only (stream by submit too, under stream_mutex).
  struct QueueState {
    CommQueue queue = CommQueue::kReduce;
    std::mutex stream_mutex;
    std::unique_ptr<comm::detail::CommStream> stream;
    bool poisoned = false;
    Status poison_status;
    // Handshake and reduction buffers: they live as long as the communicator,
    // so a peer's late write into a timed-out op lands in memory still owned.
    WireDesc mine{};
    std::vector<WireDesc> all;
    std::vector<std::byte> scratch;
  };

  std::string where(const QueueState& q, const CollectiveDesc& d, uint64_t sequence) const {
    return fmt::format("{} #{} ({} B) on torch rank {} of {} (queue {})", comm::op_name(d.op), sequence,
                       comm::recv_bytes(d, world_), rank_, world_, comm::queue_name(q.queue));
  }
  static Status poison(QueueState& q, Status status) {
    q.poisoned = true;
    q.poison_status = status;
    return status;
  }
  size_t elements_bytes(const CollectiveDesc& d) const {
    return d.op == CollectiveOp::kBarrier ? 0 : d.count * dtype_size(d.dtype);
  }

  Status execute(QueueState& q, const CollectiveDesc& d, uint64_t sequence, const Status& gate);
  Status run_alone(const CollectiveDesc& d, const Status& gate);
  // The torch part of a collective (GIL held): the handshake and the data
  // movement; a reduction's inputs are left in q.scratch.
  Status exchange(QueueState& q, const CollectiveDesc& d, uint64_t sequence, const Status& gate);
  Status handshake(QueueState& q, const CollectiveDesc& d, uint64_t sequence, const Status& gate);
  void move_data(QueueState& q, const CollectiveDesc& d);
  // Why a torch call failed, naming the ranks that never issued the collective (from the store's counters).
  Status failure(QueueState& q, const CollectiveDesc& d, uint64_t sequence, const std::string& why, bool handshake);
  py::object bytes_tensor(const void* data, size_t bytes, const py::object& dtype) const {
    auto view = py::memoryview::from_memory(const_cast<void*>(data), static_cast<py::ssize_t>(bytes), false);
    return api_->frombuffer(view, py::arg("dtype") = dtype);
  }
  py::list split(const py::object& flat) const { return py::list(flat.attr("chunk")(world_)); }
  std::string arrival_key(int rank, const QueueState& q) const {
    return fmt::format("{}/{}", comm::queue_name(q.queue), rank);
  }

  const int rank_;
  const int world_;
  const comm::CommOptions options_;
  std::unique_ptr<TorchApi> api_;
  std::array<QueueState, comm::kCommQueueCount> queues_;
};

Status TorchDistributedCommunicator::execute(QueueState& q, const CollectiveDesc& d, uint64_t sequence,
                                             const Status& gate) {
  if (q.poisoned)
    return FailedPrecondition(fmt::format("{}: queue unusable after an earlier failure: {}", where(q, d, sequence),
                                          q.poison_status.message()));
  if (world_ == 1) return run_alone(d, gate);
  if (interpreter_finalizing())
    return poison(q, FailedPrecondition(fmt::format("{}: the Python interpreter is shutting down", where(q, d, sequence))));
  Status exchanged;
  {
    py::gil_scoped_acquire gil;
    struct OnWorker {
      OnWorker() { on_worker = true; }
      ~OnWorker() { on_worker = false; }
    } marked;
    exchanged = exchange(q, d, sequence, gate);
  }
  STRATA_RETURN_IF_ERROR(exchanged);
  // The reductions, in rank order, without the GIL.
  const size_t bytes = elements_bytes(d);
  if (d.count == 0) return Status::Ok();
  if (d.op == CollectiveOp::kAllReduce || d.op == CollectiveOp::kReduceScatter) {
    std::vector<const void*> inputs(static_cast<size_t>(world_));
    for (int p = 0; p < world_; ++p) inputs[static_cast<size_t>(p)] = q.scratch.data() + static_cast<size_t>(p) * bytes;
    comm::detail::reduce_elements(d.dtype, d.reduce, inputs.data(), world_, d.count, d.recv, world_);
  } else if (d.op == CollectiveOp::kBroadcast) {
    std::memcpy(d.recv, q.scratch.data(), bytes);
  }
  return Status::Ok();
}

Status TorchDistributedCommunicator::run_alone(const CollectiveDesc& d, const Status& gate) {
  if (!gate.ok()) return gate.with_context(fmt::format("{} on torch rank 0 of 1 not run", comm::op_name(d.op)));
  const size_t bytes = elements_bytes(d);
  if (d.count == 0) return Status::Ok();
  switch (d.op) {
    case CollectiveOp::kAllGather:
    case CollectiveOp::kBroadcast:
      if (d.send != d.recv) std::memmove(d.recv, d.send, bytes);
      break;
    case CollectiveOp::kAllReduce:
    case CollectiveOp::kReduceScatter: {
      const void* inputs[1] = {d.send};
      comm::detail::reduce_elements(d.dtype, d.reduce, inputs, 1, d.count, d.recv, 1);
      break;
    }
    case CollectiveOp::kBarrier: break;
  }
  return Status::Ok();
}

Status TorchDistributedCommunicator::exchange(QueueState& q, const CollectiveDesc& d, uint64_t sequence,
                                              const Status& gate) {
  if (options_.debug_checks) {
    STRATA_RETURN_IF_ERROR(handshake(q, d, sequence, gate));
  } else if (!gate.ok()) {
    // No handshake to tell the peers: skip, poison, and let their watchdog end the collective (Note [Comm gates]).
    return poison(q, gate.with_context(fmt::format(
                         "{} not run (debug checks off: the peers cannot be told and will end at their watchdog; "
                         "set STRATA_COMM_DEBUG=1 to have them skip it too)",
                         where(q, d, sequence))));
  }
  try {
    move_data(q, d);
  } catch (py::error_already_set& e) {
    return poison(q, failure(q, d, sequence, e.what(), false));
  }
  return Status::Ok();
}

Status TorchDistributedCommunicator::handshake(QueueState& q, const CollectiveDesc& d, uint64_t sequence,
                                               const Status& gate) {
  q.mine = comm::detail::to_wire(d, sequence, !gate.ok());
  try {
    if (!api_->store.is_none()) api_->store.attr("add")(arrival_key(rank_, q), 1);
    const py::object all = bytes_tensor(q.all.data(), q.all.size() * sizeof(WireDesc), api_->int64);
    api_->all_gather(split(all), bytes_tensor(&q.mine, sizeof(WireDesc), api_->int64), py::arg("group") = api_->groups[static_cast<size_t>(comm::queue_index(q.queue))]);
  } catch (py::error_already_set& e) {
    return poison(q, failure(q, d, sequence, e.what(), true));
  }
  for (int p = 0; p < world_; ++p) {
    const WireDesc& other = q.all[static_cast<size_t>(p)];
    if (p != rank_ && !same_collective(q.mine, other)) {
      return poison(q, FailedPrecondition(fmt::format(
          "collective mismatch at #{} on torch ({} ranks, queue {}): rank {} issued {} but rank {} issued {} (its "
          "#{}). Every rank must issue the same collectives, with the same dtype, count, root and reduction, in "
          "the same order on each queue (a rank that skipped a collective call such as save_checkpoint, or a "
          "parameter gathered on some ranks only); the queue is unusable now",
          sequence, world_, comm::queue_name(q.queue), rank_, comm::describe(d, world_), p,
          comm::describe(from_wire(other), world_), other.sequence)));
    }
  }
  std::vector<int> failed;  // every rank sees the same flags, so all skip together
  for (int p = 0; p < world_; ++p)
    if (q.all[static_cast<size_t>(p)].gate_failed != 0) failed.push_back(p);
  if (failed.empty()) return Status::Ok();
  if (!gate.ok()) return gate.with_context(fmt::format("{} not run", where(q, d, sequence)));
  return FailedPrecondition(fmt::format(
      "{} not run: the gate of rank(s) {} failed, so every rank skipped it; rank {}'s log has the gate's error",
      where(q, d, sequence), comm::detail::format_rank_list(failed), failed.front()));
}

void TorchDistributedCommunicator::move_data(QueueState& q, const CollectiveDesc& d) {
  const py::object& group = api_->groups[static_cast<size_t>(comm::queue_index(q.queue))];
  const size_t bytes = elements_bytes(d);
  const auto world = static_cast<size_t>(world_);
  switch (d.op) {
    case CollectiveOp::kBarrier:
      if (!options_.debug_checks) api_->barrier(py::arg("group") = group);  // else the handshake was one
      return;
    case CollectiveOp::kAllGather:
      if (bytes == 0) return;
      api_->all_gather(split(bytes_tensor(d.recv, bytes * world, api_->uint8)),
                       bytes_tensor(d.send, bytes, api_->uint8), py::arg("group") = group);
      return;
    case CollectiveOp::kAllReduce:
      if (bytes == 0) return;
      q.scratch.resize(bytes * world);
      api_->all_gather(split(bytes_tensor(q.scratch.data(), bytes * world, api_->uint8)),
                       bytes_tensor(d.send, bytes, api_->uint8), py::arg("group") = group);
      return;
    case CollectiveOp::kReduceScatter:
      if (bytes == 0) return;
      q.scratch.resize(bytes * world);  // block p: rank p's block for this rank
      api_->all_to_all_single(bytes_tensor(q.scratch.data(), bytes * world, api_->uint8),
                              bytes_tensor(d.send, bytes * world, api_->uint8), py::arg("group") = group);
      return;
    case CollectiveOp::kBroadcast:
      if (bytes == 0) return;
      q.scratch.resize(bytes);
      if (rank_ == d.root) std::memcpy(q.scratch.data(), d.send, bytes);
      // The group spans every rank, so its ranks are the global ones.
      api_->broadcast(bytes_tensor(q.scratch.data(), bytes, api_->uint8), d.root, py::arg("group") = group);
      return;
  }
}

Status TorchDistributedCommunicator::failure(QueueState& q, const CollectiveDesc& d, uint64_t sequence,
                                             const std::string& why, bool handshake) {
  const bool timed_out = why.find("imed out") != std::string::npos || why.find("imeout") != std::string::npos;
  std::vector<int> missing;
  std::string details;
  std::string unknown;
  if (api_->store.is_none()) {
    unknown = "; which ranks arrived is unknown (torch.distributed's store is not reachable)";
  } else {
    try {
      for (int p = 0; p < world_; ++p) {
        if (p == rank_) continue;
        const auto issued = api_->store.attr("add")(arrival_key(p, q), 0).cast<int64_t>();
        if (issued <= static_cast<int64_t>(sequence)) {
          missing.push_back(p);
          details += fmt::format("; rank {} has issued {} collective(s) on queue {}, not #{}", p, issued,
                                 comm::queue_name(q.queue), sequence);
        }
      }
    } catch (py::error_already_set& e) {
      unknown = fmt::format("; which ranks arrived is unknown (the store did not answer: {})", e.what());
    }
  }
  // pybind11 appends the Python traceback ("\n\nAt:\n  file(line): ..."): the first part is torch's error.
  const std::string gloo = why.substr(0, std::min<size_t>(why.find("\n\nAt:"), 600));
  const std::string hint =
      "Hint: every rank must issue the same collectives in the same order on each queue (a call such as "
      "save_checkpoint made on some ranks only leaves the others out); if a rank is legitimately slow raise "
      "strata.wait_timeout_s or STRATA_COMM_TIMEOUT_MS";
  if (!missing.empty()) {
    const std::string head = timed_out ? fmt::format("did not complete within {} ms", options_.timeout.count())
                                       : std::string("failed");
    const std::string text = fmt::format("comm watchdog: {} {}: ranks that did not arrive: {}{} (torch.distributed: "
                                         "{}). {}",
                                         where(q, d, sequence), head, comm::detail::format_rank_list(missing), details,
                                         gloo, hint);
    return timed_out ? DeadlineExceeded(text) : Unavailable(text);
  }
  const std::string arrival =
      !unknown.empty() ? unknown.substr(2)
      : handshake      ? std::string("every rank issued it")
                       : std::string("every rank arrived (handshake complete)");
  const std::string text = fmt::format(
      "comm watchdog: {} {} although {}: a rank may have died or stalled inside torch.distributed (torch.distributed: "
      "{}). {}",
      where(q, d, sequence), timed_out ? fmt::format("did not complete within {} ms", options_.timeout.count()) : "failed",
      options_.debug_checks ? arrival : std::string("arrival is unknown (debug checks off: STRATA_COMM_DEBUG=0)"), gloo,
      hint);
  return timed_out ? DeadlineExceeded(text) : Unavailable(text);
}

void stop_all_at_exit() {
  std::vector<TorchDistributedCommunicator*> live;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    live.assign(live_communicators().begin(), live_communicators().end());
  }
  if (live.empty()) return;
  py::gil_scoped_release unlocked;
  std::lock_guard<std::mutex> lock(registry_mutex());  // a communicator destroyed meanwhile waits for this
  for (TorchDistributedCommunicator* c : live_communicators()) c->stop_workers();
}

// Every torch.distributed object this needs, or an error saying what is missing.
Result<std::unique_ptr<TorchApi>> resolve_torch(const comm::CommOptions& options, int world, int* rank) {
  auto api = std::make_unique<TorchApi>();
  try {
    py::module_ torch = py::module_::import("torch");
    py::module_ dist = py::module_::import("torch.distributed");
    if (!dist.attr("is_available")().cast<bool>())
      return Unsupported("this torch was built without torch.distributed: the engine cannot join a torch launcher's "
                         "job; install a torch with distributed support or launch with mpirun");
    if (!dist.attr("is_initialized")().cast<bool>())
      return FailedPrecondition("backend 'torch': torch.distributed is not initialized; call "
                                "strata.torch.init_distributed() (or torch.distributed.init_process_group) first");
    *rank = dist.attr("get_rank")().cast<int>();
    api->frombuffer = torch.attr("frombuffer");
    api->uint8 = torch.attr("uint8");
    api->int64 = torch.attr("int64");
    api->all_gather = dist.attr("all_gather");
    api->all_to_all_single = dist.attr("all_to_all_single");
    api->broadcast = dist.attr("broadcast");
    api->barrier = dist.attr("barrier");
    api->destroy_group = dist.attr("destroy_process_group");
    // The longest watchdog for "no watchdog": gloo needs a finite timeout.
    const auto ms = options.timeout.count() > 0 ? options.timeout.count() : comm::kMaxCommTimeout.count();
    const py::object timeout = py::module_::import("datetime").attr("timedelta")(py::arg("milliseconds") = ms);
    if (world > 1) {
      for (py::object& group : api->groups)
        group = dist.attr("new_group")(py::arg("timeout") = timeout, py::arg("backend") = "gloo");
    }
    api->store = py::none();
    if (options.debug_checks && world > 1) {
      // Each communicator counts under its own prefix: every rank makes its engines in the same order.
      static int made = 0;
      try {
        py::object store = dist.attr("distributed_c10d").attr("_get_default_store")();
        api->store = dist.attr("PrefixStore")(fmt::format("strata-comm-{}", made++), store);
      } catch (py::error_already_set&) {
        api->store = py::none();  // ranks that did not arrive are then not named
      }
    }
  } catch (py::error_already_set& e) {
    return Unavailable(fmt::format("backend 'torch': making the engine's gloo groups failed: {}", e.what()));
  }
  return api;
}

}  // namespace

bool on_torch_comm_worker() { return on_worker; }

int torch_distributed_world_size() {
  py::dict modules = py::module_::import("sys").attr("modules");
  if (!modules.contains("torch.distributed")) return 0;
  py::object dist = modules["torch.distributed"];
  if (!dist.attr("is_available")().cast<bool>() || !dist.attr("is_initialized")().cast<bool>()) return 0;
  return dist.attr("get_world_size")().cast<int>();
}

Result<std::unique_ptr<comm::Communicator>> create_torch_distributed_communicator(comm::CommOptions options) {
  STRATA_RETURN_IF_ERROR(comm::validate_comm_options(options));
  const int world = torch_distributed_world_size();
  int rank = 0;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<TorchApi> api, resolve_torch(options, world, &rank));
  {
    static bool stop_registered = false;  // the GIL serializes this
    if (!stop_registered) {
      py::module_::import("atexit").attr("register")(py::cpp_function([] { stop_all_at_exit(); }));
      stop_registered = true;
    }
  }
  return std::unique_ptr<comm::Communicator>(
      std::make_unique<TorchDistributedCommunicator>(rank, world, options, std::move(api)));
}

}  // namespace strata::python
