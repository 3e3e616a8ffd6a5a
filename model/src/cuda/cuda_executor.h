#pragma once
// The cuda GptExecutor (compiled only when STRATA_HAVE_CUDA).
#include <memory>
#include <string>

#include "strata/model/gpt_executor.h"

namespace strata::model::detail {

// True when a CUDA device answers; otherwise `why` holds the driver's error.
bool cuda_probe(std::string* why);
Result<std::unique_ptr<GptExecutor>> make_cuda_executor(const GptModel& model, int batch, int seq_len,
                                                        uint64_t device_capacity_bytes);

}  // namespace strata::model::detail
