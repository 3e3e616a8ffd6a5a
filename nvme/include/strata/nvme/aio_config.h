#pragma once
// The config's `aio` section (strata/core/config.h) as IoEngine options.

#include <string>
#include <vector>

#include "strata/core/config.h"
#include "strata/nvme/io_engine.h"

namespace strata::nvme {

struct IoEngineConfig {
  IoEngineOptions options;
  std::vector<std::string> notes;  // settings Strata accepts but handles differently (use_gds)
};

// Maps block_size, queue_depth, intra_op_parallelism, single_submit,
// overlap_events and engine; checks the result with IoEngineOptions::validate.
Result<IoEngineConfig> io_engine_config(const AioConfig& aio);

// The inverse, as the JSON object to paste under "aio": exactly the keys
// and types the config parser accepts (block_size, queue_depth,
// intra_op_parallelism, single_submit, overlap_events, engine).
nlohmann::ordered_json aio_config_block(const IoEngineOptions& options, EngineKind engine);

}  // namespace strata::nvme
