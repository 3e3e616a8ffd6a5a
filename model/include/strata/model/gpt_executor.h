#pragma once
// Runs a GptModel's forward and backward on a device (cpu or cuda) for a
// fixed batch shape [B, T]. Parameters and gradients come from a
// ParameterProvider one layer at a time (see strata/core/layered_model.h);
// the executor only owns activations and per-layer working copies, which
// it allocates on the device tier under a capacity (--device-memory).
//
// Working copies: compute is fp32. On the cpu device, fp32 parameters are
// used in place and gradients accumulate straight into the provider's
// buffer; bf16/fp16 parameters are widened into a pooled fp32 copy per
// acquired layer. On cuda, every acquired layer is uploaded (and widened)
// into a pooled device buffer and its gradient is downloaded and added to
// the provider's buffer at the layer's backward release.

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "strata/core/layered_model.h"
#include "strata/core/status.h"
#include "strata/model/gpt.h"

namespace strata::model {

enum class DeviceKind { kCpu, kCuda };
// "cpu" | "cuda"; anything else names --device and the choices.
Result<DeviceKind> parse_device_kind(std::string_view name);
std::string_view device_kind_name(DeviceKind kind);
// True when this build has CUDA and a GPU answers; `why` says why not.
bool cuda_device_available(std::string* why = nullptr);

struct ExecutorMemory {
  uint64_t device_current_bytes = 0;
  uint64_t device_peak_bytes = 0;
  uint64_t device_capacity_bytes = 0;  // 0 = unlimited
};

class GptExecutor {
 public:
  virtual ~GptExecutor() = default;
  // The cpu device is a core strata::Device ("cpu" backend) whose capacity
  // is `device_capacity_bytes` (0: a quarter of host memory); cuda counts
  // its allocations against the same capacity (0: no limit). Fails with
  // OutOfMemory naming --device-memory when activations do not fit.
  static Result<std::unique_ptr<GptExecutor>> create(const GptModel& model, DeviceKind device, int batch,
                                                     int seq_len, uint64_t device_capacity_bytes);

  // tokens and targets: batch * seq_len ids in [0, vocab). Keeps the
  // activations for backward. Returns the mean cross-entropy (nats).
  virtual Result<float> forward(std::span<const int32_t> tokens, std::span<const int32_t> targets,
                                ParameterProvider& params) = 0;
  // Accumulates d(dloss * mean loss)/d(params) into the provider's gradients.
  virtual Status backward(float dloss, ParameterProvider& params) = 0;

  virtual ExecutorMemory memory() const = 0;
  virtual int batch() const = 0;
  virtual int seq_len() const = 0;
  virtual DeviceKind device() const = 0;
};

}  // namespace strata::model
