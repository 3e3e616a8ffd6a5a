#pragma once
// Runs a GptModel's forward and backward on a Device stream (cpu or cuda)
// for a fixed batch shape [B, T]. Parameters and gradients come from a
// ParameterProvider one layer at a time (see strata/core/layered_model.h);
// the executor owns only activations, token ids and per-layer working
// copies, all allocated from the Device (counted in its device tier, under
// its capacity, --device-memory on the cpu device).
//
// Note [Executor on a stream]
// Every kernel is stream work on the Stream given at creation: on the cpu
// device each op is a Stream::launch_host call (run in order by the
// stream's worker), on cuda each op is a kernel or cuBLAS call on the
// stream's cudaStream_t, and every copy is Stream::copy_async. Before the
// first op that reads a layer, the stream waits for the layer's ready
// Completion; after the last one, the executor records a Completion and
// passes it to the provider's release. So:
//  - forward() enqueues the pass and then synchronizes the stream, because
//    it returns the loss (read from the loss the stream work wrote). It
//    fails with the stream's Status: a failed ready Completion, a failed op;
//  - backward() returns as soon as the pass is ENQUEUED; the gradients are
//    complete when the `done` of each kBackward release has completed (or
//    after Stream::synchronize);
//  - the caller must not run work of its own on the stream in between; the
//    executor, the Device and the Stream must outlive the enqueued work (the
//    executor's destructor synchronizes the stream).
// Errors of the stream are sticky, as in CUDA: after a failed pass the
// stream (and this executor) stay failed; create new ones to retry.
//
// Working copies: compute is fp32. Parameters are used in place when they
// are fp32 and addressable by the device's kernels (cpu device: any tier;
// cuda: Tier::kDevice); otherwise they are copied (cuda, host tier) and
// widened into a pooled fp32 working copy per acquired layer. Gradients
// accumulate in place when the provider wants fp32 in addressable memory;
// otherwise into a zeroed fp32 working copy that is added into the
// provider's buffer (rounded to its grad dtype) at the layer's release.

#include <cstdint>
#include <memory>
#include <span>

#include "strata/core/device.h"
#include "strata/core/device_registry.h"
#include "strata/core/layered_model.h"
#include "strata/core/status.h"
#include "strata/model/gpt.h"

namespace strata::model {

struct ExecutorMemory {
  uint64_t device_current_bytes = 0;  // the Device's device tier, all users
  uint64_t device_peak_bytes = 0;
  uint64_t device_capacity_bytes = 0;  // 0 = unlimited
};

class GptExecutor {
 public:
  virtual ~GptExecutor() = default;
  // `stream` must belong to `device`. Allocates the activations at once and
  // fails with OutOfMemory naming --device-memory when they do not fit.
  static Result<std::unique_ptr<GptExecutor>> create(const GptModel& model, Device& device, Stream& stream, int batch,
                                                     int seq_len);

  // tokens and targets: batch * seq_len ids in [0, vocab). `pass` is
  // Pass::kForward (keeps the activations for backward) or Pass::kEval
  // (no backward may follow; the provider is asked with kEval). Returns the
  // mean cross-entropy (nats) once the pass has run (Note [Executor on a stream]).
  virtual Result<float> forward(std::span<const int32_t> tokens, std::span<const int32_t> targets,
                                ParameterProvider& params, Pass pass = Pass::kForward) = 0;
  // Enqueues the accumulation of d(dloss * mean loss)/d(params) into the
  // provider's gradients; needs a kForward pass before it.
  virtual Status backward(float dloss, ParameterProvider& params) = 0;

  virtual ExecutorMemory memory() const = 0;
  virtual int batch() const = 0;
  virtual int seq_len() const = 0;
  virtual DeviceKind device_kind() const = 0;  // kCpu or kCuda
  virtual Device& device() const = 0;
  virtual Stream& stream() const = 0;
};

}  // namespace strata::model
