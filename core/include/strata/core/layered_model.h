#pragma once
// The contract between a model and whoever owns its parameters.
//
// A LayeredModel describes itself as an ordered list of layers, each with
// its parameter tensors (name, shape, dtype, byte offset inside the layer's
// one flat allocation). It never assumes its parameters are resident: before
// it reads a layer's parameters it asks a ParameterProvider for them
// (acquire), and it tells the provider when it is done (release). After the
// release of a layer in the backward pass, that layer's gradient for the
// current micro-batch is complete and may be taken away (reduced, copied to
// the host, stepped by the optimizer).
//
// Note [Acquire and release]
// - acquire(i, kForward) is the "before forward" hook: the provider returns
//   the flat parameter bytes of layer i in the layer's declared dtypes.
//   grads is null in the forward pass.
// - acquire(i, kBackward) returns the parameters again plus an fp32
//   gradient buffer of layer_param_count(i) elements into which the model
//   ACCUMULATES (+=). Zeroing between optimizer steps is the provider's job,
//   so gradient accumulation over micro-batches is free.
// - release(i, kBackward) is the "after backward" hook.
// - Acquires nest: a layer may be acquired again while it is held (tied
//   weights: a GPT's LM head reuses the token embedding of layer 0, so
//   layer 0 is acquired at the start of forward, again for the head, and
//   released for the last time after the embedding's backward). Every
//   acquire has exactly one matching release with the same pass.
// - The pointers stay valid until the matching release and are only used
//   by the model from the calling thread.
// - The sequence of calls is deterministic for a given model and batch
//   shape, so a provider may record it in the first step and prefetch from
//   the recording afterwards.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata {

struct ParamTensorSpec {
  std::string name;             // "h3.attn.qkv.weight"
  std::vector<int64_t> shape;   // row-major
  DType dtype = DType::kF32;
  size_t offset_bytes = 0;      // inside the layer's flat parameter allocation
  size_t offset_elements = 0;   // inside the layer's fp32 gradient buffer
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
  size_t param_count = 0;       // elements, = size of the fp32 gradient buffer
};

enum class Pass : uint8_t { kForward = 0, kBackward = 1 };

constexpr const char* pass_name(Pass p) { return p == Pass::kForward ? "forward" : "backward"; }

// What a provider hands the model for one layer.
struct LayerMemory {
  std::byte* params = nullptr;  // LayerSpec::param_bytes bytes, tensors at offset_bytes
  float* grads = nullptr;       // LayerSpec::param_count fp32 elements (backward only)
};

class ParameterProvider {
 public:
  virtual ~ParameterProvider() = default;
  // "Before forward/backward" hook. Errors (I/O, out of memory) abort the pass.
  virtual Result<LayerMemory> acquire(size_t layer_index, Pass pass) = 0;
  // "After forward/backward" hook; after a kBackward release the layer's
  // gradient for this micro-batch is complete.
  virtual Status release(size_t layer_index, Pass pass) = 0;
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
};

// Total parameter elements of a model.
inline size_t total_param_count(const LayeredModel& m) {
  size_t n = 0;
  for (const LayerSpec& l : m.layers()) n += l.param_count;
  return n;
}

}  // namespace strata
