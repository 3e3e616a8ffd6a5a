#include "strata/nvme/aio_config.h"

#include <fmt/format.h>

namespace strata::nvme {

Result<IoEngineConfig> io_engine_config(const AioConfig& aio) {
  IoEngineConfig out;
  IoEngineOptions& o = out.options;
  if (aio.block_size <= 0 || aio.queue_depth <= 0 || aio.intra_op_parallelism <= 0) {
    return InvalidArgument(fmt::format("aio: block_size {}, queue_depth {} and intra_op_parallelism {} must be positive",
                                       aio.block_size, aio.queue_depth, aio.intra_op_parallelism));
  }
  o.block_size = static_cast<uint64_t>(aio.block_size);
  o.queue_depth = static_cast<uint32_t>(std::min<int64_t>(aio.queue_depth, UINT32_MAX));
  o.intra_op_parallelism = static_cast<uint32_t>(std::min<int64_t>(aio.intra_op_parallelism, UINT32_MAX));
  o.single_submit = aio.single_submit;
  o.overlap_events = aio.overlap_events;
  switch (aio.engine) {
    case AioEngineKind::kAuto: o.engine = EngineKind::kAuto; break;
    case AioEngineKind::kIoUring: o.engine = EngineKind::kIoUring; break;
    case AioEngineKind::kLibaio: o.engine = EngineKind::kLibaio; break;
    case AioEngineKind::kPsync: o.engine = EngineKind::kPsync; break;
  }
  if (aio.use_gds) {
    out.notes.push_back("aio.use_gds = true: GPUDirect Storage is not implemented; NVMe data moves through pinned "
                        "host memory");
  }
  STRATA_RETURN_IF_ERROR(o.validate());
  return out;
}

nlohmann::ordered_json aio_config_block(const IoEngineOptions& o, EngineKind engine) {
  return nlohmann::ordered_json{{"block_size", o.block_size},
                                {"queue_depth", o.queue_depth},
                                {"intra_op_parallelism", o.intra_op_parallelism},
                                {"single_submit", o.single_submit},
                                {"overlap_events", o.overlap_events},
                                {"engine", std::string(engine_kind_name(engine))}};
}

}  // namespace strata::nvme
