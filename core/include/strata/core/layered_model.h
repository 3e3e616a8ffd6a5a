#pragma once
// The contract between a model and whoever owns its parameters.
//
// A LayeredModel describes itself as an ordered list of layers, each with
// its parameter tensors (name, shape, dtype, byte offset inside the layer's
// one flat allocation). It never allocates or assumes resident parameters:
// before it reads a layer it asks a ParameterProvider for it (acquire), and
// it tells the provider when it is done (release). The model runs on a
// device stream; the provider decides where the bytes live and when they
// are ready, and learns from each release when the model's stream is done
// with them.
//
// Note [Acquire and release]
// - acquire(i, kForward | kEval) is the "before forward" hook: the provider
//   returns the flat parameter bytes of layer i in the layer's declared
//   dtypes. kEval is a forward whose activations are not kept: no backward
//   follows, and the provider hands out no gradient buffer (grads null).
// - acquire(i, kBackward) returns the parameters again plus a gradient
//   buffer of param_count elements of LayerMemory::grad_dtype into which the
//   model ACCUMULATES (+=, in fp32, rounded once per acquire to grad_dtype).
//   Zeroing between optimizer steps is the provider's job (begin_step), so
//   gradient accumulation over micro-batches is free.
// - LayerMemory::ready gates the model: its stream waits for it (Stream::
//   wait(const Completion&)) before any work that reads the parameters or
//   touches the gradients. A provider that fetches a layer asynchronously
//   (NVMe read, H2D copy, all-gather) returns at once with a pending ready
//   Completion; if that Completion fails, the pass fails with its Status.
// - release(i, pass, done) is the "after forward/backward" hook. It is
//   called once the model has ENQUEUED its last use of the layer; `done`
//   completes (with the stream's Status) when that work has run. Until then
//   the pointers must stay valid and unchanged; after a kBackward `done`,
//   the layer's gradient for this micro-batch is complete and may be taken
//   away (reduced, copied to the host, stepped by the optimizer).
// - Acquires nest: a layer may be acquired again while it is held. Every
//   acquire has exactly one matching release with the same pass. A GPT's
//   LM head reuses the token embedding of layer 0 (tied weights): layer 0 is
//   acquired for the encoder, again (nested) for the head in forward, and in
//   backward twice, NOT held in between: once for the head at the start and
//   once for the encoder at the end. The head's gradient is summed into the
//   buffer before the encoder's, as it always was, so results do not depend
//   on whether the provider keeps the layer in between.
// - Calls come from one thread (the one driving the model). The sequence is
//   deterministic for a given model and batch shape, so a provider may
//   record it in the first step and prefetch from the recording afterwards.
//
// Note [Steps and micro-batches]
// Whoever drives training (the engine, a test) brackets the passes:
//   begin_step()                       before the first micro-batch of an
//                                      optimizer step (zero the gradients)
//   forward, backward of micro-batch k (acquire/release as above)
//   end_micro_batch(last)              after micro-batch k's backward was
//                                      enqueued; last on the final one
// Evaluation passes (kEval) may come between steps, outside any bracket.
// The model itself never calls these two; their defaults do nothing, which
// is correct for a provider that keeps every gradient resident.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/core/completion.h"
#include "strata/core/device.h"
#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"

namespace strata {

struct ParamTensorSpec {
  std::string name;             // "h3.attn.qkv.weight"
  std::vector<int64_t> shape;   // row-major
  DType dtype = DType::kF32;
  size_t offset_bytes = 0;      // inside the layer's flat parameter allocation
  size_t offset_elements = 0;   // inside the layer's gradient buffer
  // Training of this tensor. A layer's tensors are all trainable or all
  // frozen (a frozen layer has parameters only: no gradient, no optimizer
  // state). weight_decay: this tensor's, or the optimizer's when absent
  // (Hugging Face's no-decay groups: biases, norms). lr_scale: its learning
  // rate is the schedule's times this.
  bool trainable = true;
  std::optional<double> weight_decay;
  double lr_scale = 1.0;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

struct LayerSpec {
  std::string name;             // "embedding", "h0", ..., "final_norm"
  std::vector<ParamTensorSpec> params;
  size_t param_bytes = 0;       // size of the flat parameter allocation
  size_t param_count = 0;       // elements, = size of the gradient buffer
};

enum class Pass : uint8_t { kForward = 0, kBackward = 1, kEval = 2 };

constexpr const char* pass_name(Pass p) {
  switch (p) {
    case Pass::kForward: return "forward";
    case Pass::kBackward: return "backward";
    case Pass::kEval: return "eval";
  }
  return "?";
}

// What a provider hands the model for one layer.
struct LayerMemory {
  // LayerSpec::param_bytes bytes, tensors at offset_bytes, declared dtypes.
  std::byte* params = nullptr;
  // Where `params` lives: Tier::kDevice (memory of the model's Device) or a
  // host tier (kPinnedHost, kPageableHost), which a cuda model copies to the
  // device itself. kNvme is not addressable and is rejected.
  Tier params_tier = Tier::kPageableHost;
  // kBackward only: param_count elements of grad_dtype (kF32, kBF16 or
  // kF16), accumulated into; null in kForward and kEval.
  void* grads = nullptr;
  DType grad_dtype = DType::kF32;
  Tier grads_tier = Tier::kPageableHost;
  // The model's stream waits for this before touching the layer. A
  // default-constructed Completion is complete: "resident, nothing to wait".
  Completion ready;
};

class ParameterProvider {
 public:
  virtual ~ParameterProvider() = default;
  // "Before forward/backward" hook. Errors (I/O, out of memory) abort the pass.
  virtual Result<LayerMemory> acquire(size_t layer_index, Pass pass) = 0;
  // "After forward/backward" hook, see Note [Acquire and release]: `done`
  // completes when the model's stream has finished with the layer.
  virtual Status release(size_t layer_index, Pass pass, const Completion& done) = 0;
  // Note [Steps and micro-batches].
  virtual Status begin_step() { return Status::Ok(); }
  virtual Status end_micro_batch(bool last) { return Status::Ok(); }
};

// A model as the engine sees it: ordered layers of parameter tensors, and
// how to initialise each layer on its own (so an engine can initialise a
// model that never fits anywhere at once, layer by layer).
class LayeredModel {
 public:
  virtual ~LayeredModel() = default;
  virtual std::span<const LayerSpec> layers() const = 0;
  // Writes the deterministic initial values of layer `layer_index` (seeded
  // at construction) into `params` (param_bytes bytes, declared dtypes).
  virtual Status init_layer(size_t layer_index, std::span<std::byte> params) const = 0;
  // The same values in fp32 before any rounding to the declared dtypes
  // (param_count elements at offset_elements): an optimizer's fp32 master
  // weights start from these.
  virtual Status init_layer_fp32(size_t layer_index, std::span<float> values) const = 0;
  // False for a model whose initial values are handed to its owner from
  // outside, layer by layer (a SpecModel: Engine::put_initial_layer); then
  // init_layer and init_layer_fp32 give zeros.
  virtual bool provides_initial_values() const { return true; }
};

// How a training loop runs a model it does not know: one micro-batch at a
// time against a provider, on the model's own device stream. The runner
// owns its data (which batch comes next), so a loop needs no token types.
class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  virtual const LayeredModel& model() const = 0;
  // Forward and backward of the next training batch. `loss_scale` scales
  // the gradient of the batch's mean loss (1/k for accumulation over k).
  // Returns the mean loss once the forward has run; the backward is only
  // enqueued: each layer's gradient is complete when the `done` of its
  // kBackward release has completed.
  virtual Result<float> train_micro_batch(float loss_scale, ParameterProvider& provider) = 0;
  // Mean loss of evaluation batch `index` (< eval_batch_count()), one
  // Pass::kEval forward; returns once it has run.
  virtual Result<float> eval_batch(size_t index, ParameterProvider& provider) = 0;
  virtual size_t eval_batch_count() const = 0;
  // Tokens (or samples) one micro-batch trains on, for throughput.
  virtual uint64_t tokens_per_micro_batch() const = 0;
  // Where the training data stands: micro-batches drawn so far, or nullopt
  // when the runner cannot tell (the default). A checkpoint stores it;
  // seek_data() moves a fresh runner there, so a resumed run trains on the
  // batches the first run would have, and an engine that rolls a failed
  // step back moves it back to the step's start. A runner that cannot seek
  // (the default) makes those an explicit error, never a silent restart.
  virtual std::optional<uint64_t> data_position() const { return std::nullopt; }
  virtual Status seek_data(uint64_t micro_batches) {
    return Unsupported(fmt_seek_refusal(micro_batches));
  }
  // The stream the model's work runs on, or null. A provider may enqueue a
  // host function on it in acquire(), before returning, to time when the
  // stream reaches the layer (exposed-wait metrics); nothing else.
  virtual Stream* model_stream() { return nullptr; }

 private:
  static std::string fmt_seek_refusal(uint64_t micro_batches) {
    return "this model runner cannot move its training data (to micro-batch " + std::to_string(micro_batches) +
           "): it does not implement ModelRunner::seek_data";
  }
};

// Total parameter elements of a model.
inline size_t total_param_count(const LayeredModel& m) {
  size_t n = 0;
  for (const LayerSpec& l : m.layers()) n += l.param_count;
  return n;
}

}  // namespace strata
