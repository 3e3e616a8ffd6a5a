// Bindings of the engine that a caller drives (offload/engine.h, Note
// [Driving the engine]): the layer under strata.torch. The Python side
// describes the model as layers of tensor descriptions (a SpecModel) and
// calls the step's brackets, acquire and release; the engine owns every
// parameter, gradient and optimizer byte and lends a layer's parameters
// (and, in backward, its gradient buffer) as torch tensors viewing its
// memory without a copy (Note [Views through DLPack]).
//
// The engine runs on the cpu device (its memory is host memory, viewed by
// torch CPU tensors) or on a cuda device (viewed by torch cuda tensors), and
// torch's work meets the engine's through a TorchStreamOrder (Note [Torch's
// stream and the engine's] in torch_stream_order.h; Note [Views through
// DLPack]).
//
// Note [Ranks of a driven engine]
// One process is world size 1 (a local group of one). A process started by
// mpirun (or backend "mpi") is one rank of MPI_COMM_WORLD; one that joined
// torch.distributed (backend "torch": torchrun, the `deepspeed` launcher, a
// group the user made; strata/torch/_launcher.py) is one rank of its default
// group, its collectives run over gloo (Note [Collectives over
// torch.distributed]). Every collective is bounded by strata.wait_timeout_s
// (STRATA_COMM_TIMEOUT_MS overrides it). The config's
// batch keys are checked against that world, each rank runs its own
// micro-batches and the engine reduces the gradients (the mean over ranks),
// as `strata train --backend mpi` does. Every rank describes the same model
// and hands every layer's initial values in; rank 0's values are broadcast
// (DeepSpeed broadcasts the module at initialize), so a rank that built its
// model from another seed still trains the same model.
//
// Note [Lent memory outlives its release]
// torch may read a layer's parameters after the hook released them:
// autograd saves tensors for backward (F.linear saves weight.t(), a view of
// the forward's memory, not the Parameter), and a stage-3 layer's gathered
// copy may be freed and its memory reused once released (the layer was
// dropped: it departed from the recorded order, or the live cap). So the
// parameters are lent as LentParameters objects: every torch tensor viewing
// one holds it (Note [Views through DLPack]), and when the last is gone the
// lend is returned. Every release hands the engine the completion of
// every lend of the layer still out as its `memory_returned`
// (Engine::release): a gathered copy is freed only after torch dropped its
// views (a backward release too: the copy it releases may be the one kept
// since forward, whose views autograd still holds for another call of the
// same unit). The engine never waits for it, so a view kept longer only
// keeps its memory (counted against stage3_max_live_parameters) until it is
// dropped; strata.torch binds placeholders at release. Memory the layer
// keeps for good (its whole copy, stages 0-2) is not tracked; a shard lent
// in place (stage 3, world 1) is never freed.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "checked_config.h"
#include "errors.h"
#include "interpreter.h"
#include "layer_tuples.h"
#include "torch_distributed_communicator.h"
#include "torch_nccl_bootstrap.h"
#include "torch_dtypes.h"
#include "torch_stream_order.h"
#include "torch_views.h"
#include "strata/comm/backends.h"
#include "strata/core/config.h"
#include "strata/core/host_memory.h"
#include "strata/core/device_registry.h"
#include "strata/core/printable.h"
#include "strata/core/spec_model.h"
#include "strata/offload/checkpoint.h"
#include "strata/offload/engine.h"

namespace strata::python {
namespace {

// Row-major with no gaps: what a flat read of size * itemsize bytes from ptr
// covers exactly.
bool c_contiguous(const py::buffer_info& b) {
  py::ssize_t expected = b.itemsize;
  for (size_t d = b.shape.size(); d-- > 0;) {
    if (b.shape[d] != 1 && b.strides[d] != expected) return false;
    expected *= b.shape[d];
  }
  return true;
}

using offload::Engine;
using offload::EngineOptions;
using offload::StepOutcome;
using offload::StepOutcomeKind;

Result<Pass> pass_named(const std::string& name) {
  if (name == "forward") return Pass::kForward;
  if (name == "backward") return Pass::kBackward;
  if (name == "eval") return Pass::kEval;
  return InvalidArgument(fmt::format("pass '{}' is not forward, backward or eval", printable(name, 32)));
}

const char* outcome_name(StepOutcomeKind kind) {
  switch (kind) {
    case StepOutcomeKind::kApplied: return "applied";
    case StepOutcomeKind::kRolledBack: return "rolled_back";
    case StepOutcomeKind::kDropped: return "dropped";
  }
  return "?";
}

// The communicator for `backend`: "local" (one process), "mpi" (a rank of
// mpirun's world), "torch" (a rank of torch.distributed's default group), or
// "auto": mpi under mpirun, else torch when torch.distributed is initialized
// with several ranks, else local. A launcher's WORLD_SIZE above 1 with no
// group to join is an error, never a silent run of one rank.
std::string chosen_backend(const std::string& backend) {
  if (backend == "local" || backend == "mpi" || backend == "torch") return backend;
  if (backend != "auto")
    raise_status(InvalidArgument(fmt::format("backend '{}' is not auto, local, mpi or torch", printable(backend, 32))));
  if (comm::launched_by_mpi()) return "mpi";
  if (torch_distributed_world_size() > 1) return "torch";
  const char* world = std::getenv("WORLD_SIZE");
  if (world != nullptr && *world != '\0' && std::string_view(world) != "1")
    raise_status(FailedPrecondition(fmt::format(
        "WORLD_SIZE={} (a torchrun-style launcher started this process) but torch.distributed is not initialized, so "
        "this engine would train alone as one rank: call strata.torch.init_distributed() (or "
        "torch.distributed.init_process_group) before making it, or use strata.torch.initialize, which joins the job",
        printable(world, 32))));
  return "local";
}

// strata.wait_timeout_s of the config, the bound of every collective (the
// communicator is made before the config is checked against its world, so
// this reads the one key; an invalid value is reported by the full check).
std::chrono::milliseconds bounded_wait(const std::optional<std::string>& path, const std::optional<std::string>& text) {
  Config defaults;
  double seconds = defaults.strata.wait_timeout_s;
  if (path.has_value() != text.has_value()) {
    const ConfigCheck check = path ? check_config_file(*path, {}) : check_config_text(*text, {});
    const double read = check.config.strata.wait_timeout_s;
    if (read >= 0.001 && read <= 604800) seconds = read;
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

// A collective some ranks never issued (the watchdog's or the handshake's words, on every backend).
bool left_out_ranks(const Status& status) {
  const std::string& m = status.message();
  return m.find("ranks that did not arrive") != std::string::npos ||
         m.find("collective mismatch") != std::string::npos;
}

uint64_t quarter_of_host_memory() {
  const uint64_t physical = physical_memory_bytes();
  return physical != 0 ? physical / 4 : uint64_t{1} << 30;
}

py::dict metrics_dict(const offload::StepMetrics& m) {
  py::dict d;
  d["step"] = m.step;
  d["loss"] = m.loss;
  d["lr"] = m.lr;
  d["beta1"] = m.beta1;
  d["loss_scale"] = m.loss_scale;
  d["grad_norm"] = m.grad_norm;
  d["skipped"] = m.skipped;
  d["tokens_per_s"] = m.tokens_per_s;
  d["step_ms"] = m.step_ms;
  d["forward_ms"] = m.forward_ms;
  d["backward_ms"] = m.backward_ms;
  d["optimizer_ms"] = m.optimizer_ms;
  d["wait_reduce_ms"] = m.wait_reduce_ms;
  d["wait_optimizer_ms"] = m.wait_optimizer_ms;
  py::list waits;
  for (const auto& w : m.optimizer_waits) waits.append(py::make_tuple(w.layer, w.ms));
  d["optimizer_waits"] = waits;
  d["speculated_layers"] = m.speculated_layers;
  d["redone_layers"] = m.redone_layers;
  d["wait_gather_ms"] = m.wait_gather_ms;
  d["wait_nvme_ms"] = m.wait_nvme_ms;
  d["h2d_bytes"] = m.h2d_bytes;
  d["d2h_bytes"] = m.d2h_bytes;
  d["gather_bytes"] = m.gather_bytes;
  d["reduce_bytes"] = m.reduce_bytes;
  d["nvme_read_bytes"] = m.nvme_read_bytes;
  d["nvme_write_bytes"] = m.nvme_write_bytes;
  d["peak_device_bytes"] = m.peak_device_bytes;
  d["peak_pinned_bytes"] = m.peak_pinned_bytes;
  d["peak_host_bytes"] = m.peak_host_bytes;
  d["peak_nvme_bytes"] = m.peak_nvme_bytes;
  return d;
}

py::dict memory_dict(const offload::EngineMemory& m) {
  py::dict d;
  d["device"] = m.device;
  d["device_params"] = m.device_params;
  d["device_grads"] = m.device_grads;
  d["device_optimizer"] = m.device_optimizer;
  d["device_gathered"] = m.device_gathered;
  d["pinned"] = m.pinned;
  d["pinned_optimizer"] = m.pinned_optimizer;
  d["pinned_grads"] = m.pinned_grads;
  d["pinned_staging"] = m.pinned_staging;
  d["pinned_params"] = m.pinned_params;
  d["pinned_speculation"] = m.pinned_speculation;
  d["nvme"] = m.nvme;
  return d;
}


// One acquire's parameters lent to torch (Note [Lent memory outlives its
// release]): every view holds it (Note [Views through DLPack]), and
// `returned` completes when the last view is freed, on the thread that
// frees it; on a device, once torch's stream the layer was lent on has run
// the work issued before that (Note [Torch's stream and the engine's]).
class LentParameters {
 public:
  LentParameters(std::string label, std::shared_ptr<TorchStreamOrder> order, uintptr_t torch_stream)
      : returned_(std::make_shared<CompletionSource>(label)), label_(std::move(label)), order_(std::move(order)),
        torch_stream_(torch_stream) {}
  ~LentParameters() {
    if (order_ == nullptr || order_->waits_on_host()) {
      returned_->complete(Status::Ok());
      return;
    }
    Result<Completion> after = order_->issued_so_far(torch_stream_, label_);
    if (!after.ok()) {
      returned_->complete(after.status());
      return;
    }
    after->then([returned = returned_](const Status& status) { returned->complete(status); });
  }
  LentParameters(const LentParameters&) = delete;
  LentParameters& operator=(const LentParameters&) = delete;
  Completion returned() const { return returned_->completion(); }

 private:
  std::shared_ptr<CompletionSource> returned_;
  std::string label_;
  std::shared_ptr<TorchStreamOrder> order_;
  uintptr_t torch_stream_;
};

// Where the engine runs and how torch's work is ordered against it, as
// strata.torch chose it (Note [Torch's stream and the engine's]).
struct EngineDevice {
  DeviceKind kind = DeviceKind::kCpu;
  int ordinal = 0;
  std::string stream_order = "host";  // "host" | "device" | "recorded" (the cuda order played on the cpu device)
};

EngineDevice checked_engine_device(const std::string& device_kind, int ordinal, const std::string& stream_order) {
  EngineDevice choice;
  if (device_kind == "cuda") choice.kind = DeviceKind::kCuda;
  else if (device_kind != "cpu")
    raise_status(InvalidArgument(fmt::format("device '{}' is not cpu or cuda", printable(device_kind, 32))));
  if (ordinal < 0 || (choice.kind == DeviceKind::kCpu && ordinal != 0))
    raise_status(InvalidArgument(fmt::format("device ordinal {} is out of range for the {} device", ordinal,
                                             device_kind)));
  choice.ordinal = ordinal;
  const bool fits = choice.kind == DeviceKind::kCuda ? stream_order == "device"
                                                     : (stream_order == "host" || stream_order == "recorded");
  if (!fits)
    raise_status(InvalidArgument(fmt::format("stream order '{}' does not go with the {} device (cpu: host or "
                                             "recorded; cuda: device)",
                                             printable(stream_order, 32), device_kind)));
  choice.stream_order = stream_order;
  return choice;
}

class DrivenEngine {
 public:
  static std::unique_ptr<DrivenEngine> create(const std::optional<std::string>& config_path,
                                              const std::optional<std::string>& config_text,
                                              const std::vector<LayerTuple>& layers, uint64_t device_memory,
                                              const std::string& backend, const std::string& job_name,
                                              const std::string& resume_hint, const std::string& device_kind,
                                              int ordinal, const std::string& stream_order) {
    const EngineDevice engine_device = checked_engine_device(device_kind, ordinal, stream_order);
    // The ranks (Note [Ranks of a driven engine]): one process, this process
    // as one rank of mpirun's world, or one rank of torch.distributed's.
    const std::string chosen = chosen_backend(backend);
    const std::string origin = backend == "auto" ? fmt::format("{} (backend 'auto')", chosen == "mpi"
                                                                                          ? "mpirun started this process"
                                                                                          : "torch.distributed is initialized")
                                                 : fmt::format("backend '{}'", backend);
    comm::CommOptions comm_options;
    if (chosen != "local") {
      comm_options.timeout = bounded_wait(config_path, config_text);
      comm_options = value_or_raise(comm::apply_comm_environment(comm_options));
    }
    // GPU ranks of a torch launcher reduce device memory: NCCL, made once the engine's cuda Device exists
    // (Note [NCCL for torch ranks]). GPU ranks of mpirun are not wired yet.
    const bool torch_gpu_ranks =
        engine_device.kind == DeviceKind::kCuda && chosen == "torch" && torch_distributed_world_size() > 1;
    if (engine_device.kind == DeviceKind::kCuda && chosen == "mpi")
      raise_status(Unsupported(fmt::format("strata.torch on the cuda device under mpirun ({}): GPU ranks are joined "
                                           "through torch.distributed; launch with torchrun (or the deepspeed "
                                           "launcher), or train on the cpu device",
                                           origin)));
    // (One GPU rank of a torch launcher needs no communicator: the engine's local group of one.)
    const bool gpu_under_torch = engine_device.kind == DeviceKind::kCuda && chosen == "torch";
    std::unique_ptr<comm::Communicator> ranks;
    if (chosen != "local" && !gpu_under_torch) {
      Result<std::unique_ptr<comm::Communicator>> created = [&]() -> Result<std::unique_ptr<comm::Communicator>> {
        if (chosen == "torch") return create_torch_distributed_communicator(comm_options);  // calls torch: GIL held
        py::gil_scoped_release unlocked;
        return comm::create_mpi_communicator(comm_options);
      }();
      if (!created.ok()) raise_status(created.status().with_context(origin));
      ranks = std::move(*created);
    }
    const int world = torch_gpu_ranks ? torch_distributed_world_size() : ranks ? ranks->world_size() : 1;
    ConfigOptions options;
    options.world_size = world;
    options.world_size_origin =
        world == 1 && !ranks ? std::string("strata.torch (one process)")
        : chosen == "mpi"    ? fmt::format("the MPI communicator (mpirun -np {})", world)
                             : fmt::format("torch.distributed's world (WORLD_SIZE {})", world);
    const ConfigCheck check = checked_config(config_path, config_text, options);
    EngineOptions engine_options = value_or_raise(offload::engine_options_from_config(check.config));
    engine_options.job_name = job_name;  // empty: the engine's default
    if (!resume_hint.empty()) engine_options.resume_hint = resume_hint;  // the Python call, not the CLI's flag

    auto self = std::unique_ptr<DrivenEngine>(new DrivenEngine());
    self->model_ = std::make_unique<SpecModel>(value_or_raise(SpecModel::create(describe_layers(layers))));
    DeviceOptions device_options;
    // As `strata train`: the argument, else strata.device_memory, else a quarter of host memory (cpu) or the
    // whole GPU (cuda: strata.torch passes the budget it computed, Note [One device, two allocators]).
    const uint64_t asked = device_memory != 0 ? device_memory : check.config.strata.device_memory;
    device_options.device_memory_bytes = asked != 0 ? asked : quarter_of_host_memory();
    device_options.cuda_memory_limit_bytes = asked;
    device_options.ordinal = engine_device.ordinal;
    self->device_ = value_or_raise(make_device(engine_device.kind, device_options));
    self->view_device_ = ViewDevice{engine_device.kind == DeviceKind::kCuda, engine_device.ordinal};
    if (engine_device.stream_order == "device") {
      self->order_ = make_device_order(*self->device_);
    } else if (engine_device.stream_order == "recorded") {
      auto recorded = std::make_shared<RecordedStreamOrder>(*self->device_);
      self->recorded_ = recorded.get();
      self->order_ = std::move(recorded);
    } else {
      self->order_ = make_host_order();
    }
    if (torch_gpu_ranks) {  // calls torch (the ids' broadcast): GIL held
      Result<std::unique_ptr<comm::Communicator>> created =
          create_nccl_for_torch_ranks(*self->device_, engine_device.ordinal, comm_options);
      if (!created.ok()) raise_status(created.status().with_context(origin));
      ranks = std::move(*created);
    }
    if (ranks) self->comms_.push_back(std::move(ranks));
    else self->comms_ = value_or_raise(comm::create_local_group(1));
    // Making the engine runs collectives (the torch communicator's workers take the GIL).
    Result<std::unique_ptr<Engine>> engine = [&] {
      py::gil_scoped_release unlocked;
      return Engine::create(engine_options, *self->model_, *self->device_, *self->comms_[0]);
    }();
    self->engine_ = value_or_raise(std::move(engine));
    self->grad_accum_ = engine_options.grad_accum;
    return self;
  }

  // Tearing the engine down waits for its collectives, whose workers may need the GIL.
  ~DrivenEngine() {
    if (on_torch_comm_worker()) {
      // Python's collector dropped this engine on a comm worker, which the
      // teardown would wait for: it runs on a thread of its own (the views'
      // Python objects go here, the GIL held).
      std::thread([engine = std::move(engine_), comms = std::move(comms_), model = std::move(model_),
                   device = std::move(device_), order = std::move(order_)]() mutable {
        engine.reset();
        if (order) order->close();
        comms.clear();
        model.reset();
        device.reset();
      }).detach();
      return;
    }
    const bool finalizing = interpreter_finalizing();
    std::optional<py::gil_scoped_release> unlocked;
    if (PyGILState_Check() != 0 && !finalizing) unlocked.emplace();
    engine_.reset();
    if (order_) order_->close();  // before the device goes: lends torch returns later order against nothing
    comms_.clear();
  }

  size_t layer_count() const { return model_->layers().size(); }
  int rank() const { return comms_[0]->rank(); }
  int world_size() const { return comms_[0]->world_size(); }
  std::string backend() const { return std::string(comm::backend_name(comms_[0]->backend())); }
  int64_t grad_accum() const { return grad_accum_; }

  // The layer's tensors as (name, shape, dtype, offset_bytes, offset_elements).
  py::list layer_tensors(size_t li) const {
    check_layer(li);
    py::list out;
    for (const ParamTensorSpec& t : model_->layers()[li].params)
      out.append(py::make_tuple(t.name, t.shape, torch_dtype_name(t.dtype), t.offset_bytes, t.offset_elements));
    return out;
  }

  void put_initial_layer(size_t li, py::buffer params, std::optional<py::buffer> fp32, int root) {
    check_layer(li);
    if (root < 0 || root >= world_size())
      raise_status(InvalidArgument(fmt::format("put_initial_layer(): rank {} (whose values every rank takes) is not "
                                               "in 0..{}", root, world_size() - 1)));
    // The engine reads both as flat runs of memory: a strided view (every
    // other element, a broadcast) would be read as other bytes or past its end.
    const py::buffer_info p = params.request();
    if (!c_contiguous(p))
      raise_status(InvalidArgument(fmt::format("layer {}: the packed parameter bytes must be one contiguous buffer "
                                               "(a strided or expanded view is not); pass a contiguous copy",
                                               li)));
    std::span<const float> values;
    py::buffer_info f;
    if (fp32) {
      f = fp32->request();
      if (f.itemsize != 4 || f.format != py::format_descriptor<float>::format())
        raise_status(InvalidArgument(fmt::format("layer {}: the fp32 values must be a float32 buffer", li)));
      if (!c_contiguous(f))
        raise_status(InvalidArgument(fmt::format("layer {}: the fp32 values must be one contiguous buffer", li)));
      values = std::span<const float>(static_cast<const float*>(f.ptr), static_cast<size_t>(f.size));
    }
    auto bytes = std::span<const std::byte>(static_cast<const std::byte*>(p.ptr),
                                            static_cast<size_t>(p.size * p.itemsize));
    // The work runs without the GIL; its error is raised once it is held again.
    const Status put = [&]() -> Status {
      py::gil_scoped_release unlocked;
      // Several ranks: rank `root`'s values on every rank (rank 0's at
      // initialize, as DeepSpeed broadcasts the module), so ranks that built
      // the model from different seeds still train one model.
      std::vector<std::byte> root_bytes;
      std::vector<float> root_values;
      if (world_size() > 1) {
        STRATA_RETURN_IF_ERROR(broadcast_from(root, bytes, root_bytes, fmt::format("layer {}'s initial values", li)));
        bytes = root_bytes;
        if (!values.empty()) {
          const std::span<const std::byte> raw(reinterpret_cast<const std::byte*>(values.data()),
                                               values.size_bytes());
          std::vector<std::byte> received;
          STRATA_RETURN_IF_ERROR(
              broadcast_from(root, raw, received, fmt::format("layer {}'s fp32 initial values", li)));
          root_values.resize(values.size());
          std::memcpy(root_values.data(), received.data(), received.size());
          values = root_values;
        }
      }
      return engine_->put_initial_layer(li, bytes, values);
    }();
    throw_if_error(put);
  }

  void begin_step() { call([&] { return engine_->begin_step(); }); }
  double gradient_scale() const { return engine_->gradient_scale(); }
  void begin_micro_batch(bool last) { call([&] { return engine_->begin_micro_batch(last); }); }
  void end_micro_batch(double mean_loss, int64_t tokens) {
    call([&] { return engine_->end_micro_batch(mean_loss, tokens); });
  }
  py::dict finish_step() {
    Result<StepOutcome> outcome = [&] {
      py::gil_scoped_release unlocked;
      return engine_->finish_step();
    }();
    const StepOutcome out = value_or_raise(std::move(outcome));
    py::dict d;
    d["outcome"] = outcome_name(out.kind);
    d["state_step"] = out.state_step;
    d["reason"] = out.applied() ? std::string() : out.reason.to_string();
    d["metrics"] = out.applied() ? py::object(metrics_dict(out.metrics)) : py::object(py::none());
    return d;
  }
  // Engine::abandon_step; the lends of the dropped step stay tracked until torch returns them.
  // Torch's queued work on the given-up step runs out first (Note [Torch's stream and the engine's]): the
  // engine then zeroes and frees what those kernels touched.
  void abandon_step() {
    call([&] {
      Status drained = order_->drain();
      Status abandoned = engine_->abandon_step();
      return abandoned.ok() ? drained : abandoned;
    });
  }
  void begin_evaluation() { call([&] { return engine_->begin_evaluation(); }); }
  double finish_evaluation(double loss_sum, int64_t batches) {
    Result<double> r = [&] {
      py::gil_scoped_release unlocked;
      return engine_->finish_evaluation(loss_sum, batches);
    }();
    return value_or_raise(std::move(r));
  }

  // The layer's parameters (and in backward its gradient buffer) as torch
  // tensors viewing engine memory, once everything they wait for is done:
  // ({name: tensor}, {name: tensor} or None). `from_dlpack` is torch's
  // (Note [Views through DLPack]). Memory the layer keeps for good (its
  // whole copy on the device, stages 0-2; a gradient buffer) is viewed by
  // the same dict of tensors as long as it stays at one address, so a
  // caller may keep them; other parameters (stage 3) get new views that
  // hold their lend (Note [Lent memory outlives its release]).
  py::tuple acquire(size_t li, const std::string& pass_name, const py::object& from_dlpack, uintptr_t torch_stream) {
    check_layer(li);
    const Pass pass = value_or_raise(pass_named(pass_name));
    const std::string what = fmt::format("layer {} {}", li, pass_name);
    Result<LayerMemory> memory = [&]() -> Result<LayerMemory> {
      py::gil_scoped_release unlocked;
      const TorchStreamOrder::Waiter waiter = order_->waiter(torch_stream, what);  // keeps its stream for the call
      STRATA_ASSIGN_OR_RETURN(LayerMemory m, engine_->acquire(li, pass, waiter.waiter));
      // Torch's work on the layer runs after `ready`: a host wait on the cpu device, a stream wait on cuda.
      Status ready = order_->wait_for(m.ready, torch_stream, what);
      if (!ready.ok()) {
        engine_->release(li, pass, Completion()).ignore();
        return ready;
      }
      return m;
    }();
    const LayerMemory m = value_or_raise(std::move(memory));
    try {
      const std::vector<ParamTensorSpec>& tensors = model_->layers()[li].params;
      py::object params;
      if (keeps_layer_whole(li)) {
        params = cached_views(permanent_views_, li, m.params, ViewLayout{}, from_dlpack);
      } else {
        auto lent = std::make_shared<LentParameters>(fmt::format("layer {} lent to torch", li), order_, torch_stream);
        lent_[li].push_back(lent->returned());  // a later release of the layer may free this memory
        params = torch_views(from_dlpack, m.params, tensors, ViewLayout{}, view_device_, lent);
      }
      py::object grads = py::none();
      if (m.grads != nullptr)
        grads = cached_views(grad_views_, li, static_cast<std::byte*>(m.grads), ViewLayout{true, m.grad_dtype},
                             from_dlpack);
      return py::make_tuple(params, grads);
    } catch (...) {
      // torch refused a view: the caller gets no layer, so the engine does
      // not keep it held (a stage-3 copy would otherwise never be dropped).
      try {
        release(li, pass_name, torch_stream);
      } catch (...) {  // the refusal is the error to report
      }
      throw;
    }
  }
  void release(size_t li, const std::string& pass_name, uintptr_t torch_stream) {
    check_layer(li);
    const Pass pass = value_or_raise(pass_named(pass_name));
    // The memory is returned once no torch view of any lend of the layer is
    // left (this release may end the hold of a copy kept since forward).
    std::vector<Completion>& out = lent_[li];
    std::erase_if(out, [](const Completion& c) { return c.done(); });
    const Completion returned = out.empty()      ? Completion()
                                : out.size() == 1 ? out.front()  // the usual case: no join, no label to format
                                                  : when_all(out, fmt::format("layer {} returned by torch", li));
    // The pass is over once torch's work issued so far has run: at once on the cpu device, a completion
    // recorded on torch's stream on cuda (the engine's reductions and frees wait for it). Recorded without
    // the GIL: the launch may block while torch's queue is full behind a held wait.
    call([&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(Completion done, order_->issued_so_far(torch_stream, fmt::format("layer {} {}", li,
                                                                                                 pass_name)));
      return engine_->release(li, pass, done, returned);
    });
  }

  py::list gather_state(size_t li, const std::string& kind) {
    check_layer(li);
    Engine::StateKind k = Engine::StateKind::kMaster;
    if (kind == "exp_avg") k = Engine::StateKind::kExpAvg;
    else if (kind == "exp_avg_sq") k = Engine::StateKind::kExpAvgSq;
    else if (kind != "master")
      raise_status(InvalidArgument(fmt::format("state kind '{}' is not master, exp_avg or exp_avg_sq", printable(kind, 32))));
    Result<std::vector<float>> values = [&] {
      py::gil_scoped_release unlocked;
      return engine_->gather_state(li, k);
    }();
    return py::cast(value_or_raise(std::move(values)));
  }
  void synchronize() { call([&] { return engine_->synchronize(); }); }

  // The recorded stand-in's log (Note [Torch's stream and the engine's]): [(op, torch stream, what)].
  py::list stream_order_log() const {
    if (recorded_ == nullptr)
      raise_status(FailedPrecondition("stream_order_log(): this engine was not made with stream_order 'recorded'"));
    py::list out;
    for (const StreamOrderEntry& e : recorded_->entries()) out.append(py::make_tuple(e.op, e.torch_stream, e.what));
    return out;
  }

  // Checkpoints (docs/checkpoints.md): `app_json` is stored as the
  // manifest's "app" (strata.torch keeps its client_state there).
  py::dict save_checkpoint(const std::string& dir, const std::string& tag, int keep, bool sync,
                           const std::string& app_json) {
    offload::CheckpointSaveOptions options;
    options.dir = dir;
    options.tag = tag;
    options.keep = keep;
    options.sync = sync;
    try {
      options.app = nlohmann::json::parse(app_json);
    } catch (const nlohmann::json::exception& e) {
      raise_status(InvalidArgument(fmt::format("the checkpoint's app state is not JSON: {}", e.what())));
    }
    Result<offload::CheckpointSaveInfo> info = [&] {
      py::gil_scoped_release unlocked;
      return engine_->save_checkpoint(options);
    }();
    if (!info.ok() && world_size() > 1 && left_out_ranks(info.status()))
      raise_status(info.status().with_context(
          "save_checkpoint() is collective: call save_checkpoint on every rank (as DeepSpeed requires), not on rank "
          "0 only"));
    const offload::CheckpointSaveInfo saved = value_or_raise(std::move(info));
    py::dict d;
    d["tag"] = saved.tag;
    d["blocked_ms"] = saved.blocked_ms;
    d["bytes"] = saved.bytes;
    return d;
  }
  // The save in flight, waited for: None when there was none.
  py::object wait_checkpoint() {
    Result<std::optional<offload::CheckpointSaveDone>> done = [&] {
      py::gil_scoped_release unlocked;
      return engine_->wait_checkpoint();
    }();
    const std::optional<offload::CheckpointSaveDone> d = value_or_raise(std::move(done));
    if (!d) return py::none();
    py::dict out;
    out["tag"] = d->tag;
    out["committed"] = d->committed;
    out["seconds"] = d->seconds;
    out["bytes"] = d->bytes;
    return out;
  }
  // Loads DIR (its latest tag) or a tag folder into this fresh engine:
  // {"tag", "step", "step_calls", "app_json"}.
  py::dict load_checkpoint(const std::string& dir_or_tag) {
    Result<offload::CheckpointManifest> manifest = [&] {
      py::gil_scoped_release unlocked;
      return engine_->load_checkpoint(dir_or_tag);
    }();
    const offload::CheckpointManifest m = value_or_raise(std::move(manifest));
    py::dict d;
    d["tag"] = m.tag;
    d["step"] = m.scalars.optimizer_steps;
    d["step_calls"] = m.scalars.steps_begun;
    d["app_json"] = m.app.dump();
    return d;
  }
  // The manifest's app data of DIR (its latest tag) or a tag folder, read and checked, nothing loaded.
  std::string checkpoint_app_json(const std::string& dir_or_tag) const {
    Result<offload::CheckpointReader> reader = [&] {
      py::gil_scoped_release unlocked;
      return offload::CheckpointReader::open(dir_or_tag);
    }();
    return value_or_raise(std::move(reader)).manifest().app.dump();
  }
  py::dict predicted_memory() const { return memory_dict(engine_->predicted_memory()); }
  py::dict measured_memory() const { return memory_dict(engine_->measured_memory()); }
  int64_t optimizer_steps() const { return engine_->optimizer_steps(); }
  int64_t steps_begun() const { return engine_->steps_begun(); }
  // The placement's answer (StatePlacement): layer li's parameters stay whole at one address (stages 0-2, and
  // stage-3 layers below the persistence threshold), so views of them stay valid after a release.
  bool keeps_layer_whole(size_t li) const {
    check_layer(li);
    return engine_->placement().layers[li].persistent();
  }
  void set_step_lr(double lr) { throw_if_error(engine_->set_step_lr(lr)); }
  std::string describe() const { return engine_->describe(); }
  // Where the driving thread is (Note [Driving the engine]), as strata.engine.Engine names it.
  std::string phase() const {
    switch (engine_->phase()) {
      case offload::Engine::Phase::kIdle: return "idle";
      case offload::Engine::Phase::kStep: return "step";
      case offload::Engine::Phase::kMicroBatch: return "micro_batch";
      case offload::Engine::Phase::kEvaluation: return "evaluation";
    }
    raise_status(Internal("the engine's phase has no name"));
  }
  // Raises why the engine stopped (Engine::stopped(): an error it could not roll back); nothing while it can go on.
  void raise_if_stopped() const { throw_if_error(engine_->stopped()); }
  int layer_holds(size_t li) const {
    check_layer(li);
    return value_or_raise(engine_->layer_holds(li));
  }

 private:
  DrivenEngine() = default;
  void check_layer(size_t li) const {
    if (li >= model_->layers().size())
      raise_status(InvalidArgument(fmt::format("layer {} is out of range: the model has {} layers", li,
                                               model_->layers().size())));
  }
  // Rank `root`'s `mine` into `out` on every rank; the sizes must agree
  // (every rank described the same model).
  Status broadcast_from(int root, std::span<const std::byte> mine, std::vector<std::byte>& out,
                        const std::string& what) {
    comm::Communicator& c = *comms_[0];
    // Sizes first, as one f64 per rank gathered, so a rank with another model is named, not hung.
    const double my_size = static_cast<double>(mine.size());
    std::vector<double> sizes(static_cast<size_t>(c.world_size()));
    STRATA_ASSIGN_OR_RETURN(comm::CommWork gathered, c.all_gather(&my_size, sizes.data(), 1, DType::kF64));
    STRATA_RETURN_IF_ERROR(gathered.wait());
    for (size_t r = 0; r < sizes.size(); ++r)
      if (sizes[r] != my_size)
        return InvalidArgument(fmt::format("{}: rank {} has {} bytes, rank {} has {:.0f}: every rank must describe the "
                                           "same model (the same units, shapes and dtypes)",
                                           what, c.rank(), mine.size(), r, sizes[r]));
    out.assign(mine.begin(), mine.end());
    // Parameters are 2- or 4-byte elements: moved as 2-byte words (bits, no arithmetic).
    STRATA_ASSIGN_OR_RETURN(comm::CommWork sent, c.broadcast(out.data(), out.data(), out.size() / 2, DType::kF16, root));
    return sent.wait();
  }
  template <typename F>
  void call(F&& f) {
    Status s;
    {
      py::gil_scoped_release unlocked;
      s = f();
    }
    throw_if_error(s);
  }

  // Views of memory that stays put (Note [Views through DLPack]), per layer:
  // rebuilt only when the layer's memory moved or changed dtype.
  struct CachedViews {
    const std::byte* address = nullptr;
    ViewLayout layout;
    py::object views;
  };
  py::object cached_views(std::vector<CachedViews>& cache, size_t li, std::byte* address, ViewLayout layout,
                          const py::object& from_dlpack) {
    if (cache.size() <= li) cache.resize(model_->layers().size());
    CachedViews& cached = cache[li];
    if (cached.views && cached.address == address && cached.layout.gradients == layout.gradients &&
        cached.layout.grad_dtype == layout.grad_dtype)
      return cached.views;
    cached = CachedViews{address, layout,
                         torch_views(from_dlpack, address, model_->layers()[li].params, layout, view_device_, {})};
    return cached.views;
  }

  // Declaration order is destruction order reversed: the engine goes first.
  std::unique_ptr<SpecModel> model_;
  std::unique_ptr<Device> device_;
  ViewDevice view_device_;
  // Shared with the lends torch still holds (LentParameters).
  std::shared_ptr<TorchStreamOrder> order_;
  RecordedStreamOrder* recorded_ = nullptr;  // order_ when it is the recorded stand-in
  std::vector<std::unique_ptr<comm::Communicator>> comms_;
  std::unique_ptr<Engine> engine_;
  int64_t grad_accum_ = 1;
  // Per layer: the lends of its (non-permanent) parameters torch may still hold.
  std::map<size_t, std::vector<Completion>> lent_;
  std::vector<CachedViews> permanent_views_, grad_views_;
};

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<DrivenEngine> driven(m, "DrivenEngine");
  driven.def("set_step_lr", &DrivenEngine::set_step_lr, py::arg("lr"));
  driven
      .def_static("create", &DrivenEngine::create, py::arg("config_path"), py::arg("config_text"), py::arg("layers"),
                  py::arg("device_memory") = 0, py::arg("backend") = "auto", py::arg("job_name") = "",
                  py::arg("resume_hint") = "", py::arg("device") = "cpu", py::arg("ordinal") = 0,
                  py::arg("stream_order") = "host")
      .def_property_readonly("layer_count", &DrivenEngine::layer_count)
      .def_property_readonly("rank", &DrivenEngine::rank)
      .def_property_readonly("world_size", &DrivenEngine::world_size)
      .def_property_readonly("backend", &DrivenEngine::backend)
      .def_property_readonly("grad_accum", &DrivenEngine::grad_accum)
      .def("layer_tensors", &DrivenEngine::layer_tensors)
      .def("put_initial_layer", &DrivenEngine::put_initial_layer, py::arg("layer"), py::arg("params"),
           py::arg("fp32") = py::none(), py::arg("root") = 0)
      .def("begin_step", &DrivenEngine::begin_step)
      .def("gradient_scale", &DrivenEngine::gradient_scale)
      .def("begin_micro_batch", &DrivenEngine::begin_micro_batch, py::arg("last"))
      .def("end_micro_batch", &DrivenEngine::end_micro_batch, py::arg("mean_loss"), py::arg("tokens"))
      .def("finish_step", &DrivenEngine::finish_step)
      .def("begin_evaluation", &DrivenEngine::begin_evaluation)
      .def("finish_evaluation", &DrivenEngine::finish_evaluation, py::arg("loss_sum"), py::arg("batches"))
      .def("abandon_step", &DrivenEngine::abandon_step)
      .def("acquire", &DrivenEngine::acquire, py::arg("layer"), py::arg("pass_name"), py::arg("from_dlpack"),
           py::arg("torch_stream") = 0)
      .def("release", &DrivenEngine::release, py::arg("layer"), py::arg("pass_name"), py::arg("torch_stream") = 0)
      .def("stream_order_log", &DrivenEngine::stream_order_log)
      .def("gather_state", &DrivenEngine::gather_state, py::arg("layer"), py::arg("kind") = "master")
      .def("synchronize", &DrivenEngine::synchronize)
      .def("save_checkpoint", &DrivenEngine::save_checkpoint, py::arg("dir"), py::arg("tag") = "", py::arg("keep") = 0,
           py::arg("sync") = false, py::arg("app_json") = "{}")
      .def("wait_checkpoint", &DrivenEngine::wait_checkpoint)
      .def("load_checkpoint", &DrivenEngine::load_checkpoint, py::arg("dir_or_tag"))
      .def("checkpoint_app_json", &DrivenEngine::checkpoint_app_json, py::arg("dir_or_tag"))
      .def("predicted_memory", &DrivenEngine::predicted_memory)
      .def("measured_memory", &DrivenEngine::measured_memory)
      .def_property_readonly("optimizer_steps", &DrivenEngine::optimizer_steps)
      .def_property_readonly("steps_begun", &DrivenEngine::steps_begun)
      .def("keeps_layer_whole", &DrivenEngine::keeps_layer_whole, py::arg("layer"))
      .def_property_readonly("phase", &DrivenEngine::phase)
      .def("layer_holds", &DrivenEngine::layer_holds, py::arg("layer"))
      .def("raise_if_stopped", &DrivenEngine::raise_if_stopped)
      .def("describe", &DrivenEngine::describe);
}

}  // namespace strata::python
