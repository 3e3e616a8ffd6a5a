#pragma once
// The same GPT forward and backward in double precision on the CPU, over
// plain per-layer arrays instead of a ParameterProvider: the reference for
// gradient checks against finite differences and for comparing the fp32
// executors with.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "strata/core/status.h"
#include "strata/model/gpt.h"

namespace strata::model {

class GptReference {
 public:
  // Parameters start at the model's initial values (exactly the fp32 ones,
  // widened); gradients at zero.
  static Result<std::unique_ptr<GptReference>> create(const GptModel& model, int batch, int seq_len);
  ~GptReference();

  // Per layer, laid out by ParamTensorSpec::offset_elements.
  std::vector<std::vector<double>>& params() { return params_; }
  std::vector<std::vector<double>>& grads() { return grads_; }
  void zero_grads();

  Result<double> forward(std::span<const int32_t> tokens, std::span<const int32_t> targets);
  // grads += d(dloss * mean loss)/d(params)
  Status backward(double dloss = 1.0);

 private:
  struct Impl;
  explicit GptReference(const GptModel& model);
  const GptModel& model_;
  std::vector<std::vector<double>> params_, grads_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::model
