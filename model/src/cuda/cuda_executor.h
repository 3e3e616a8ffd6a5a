#pragma once
// The cuda GptExecutor (compiled only when STRATA_HAVE_CUDA).
#include <memory>

#include "strata/core/device.h"
#include "strata/model/gpt_executor.h"

namespace strata::model::detail {

// `device` is a "cuda" strata::Device and `stream` one of its streams.
Result<std::unique_ptr<GptExecutor>> make_cuda_executor(const GptModel& model, Device& device, Stream& stream,
                                                        int batch, int seq_len);

}  // namespace strata::model::detail
