#pragma once
// One rank's side of the collective conformance suite, shared by the local
// (threads), mpi (processes) and nccl tests: every op, dtype and size class
// (zero, one, non-divisible, multi-tile), in place and out of place, checked
// bit for bit against strata/comm/pattern.h. Returns one line per failure.

#include <string>
#include <vector>

#include "strata/comm/communicator.h"

namespace strata::comm::testing {

struct ConformanceOptions {
  bool check_avg_16bit = true;  // nccl averages 16-bit types its own way
  bool large_sizes = true;      // include a multi-tile size (> 1024 elements per rank)
};

std::vector<std::string> run_conformance(Communicator& comm, const ConformanceOptions& options = {});

// Sizes (elements) the suite uses for a world size: 0, 1, world + 1 (not a
// multiple of world for world > 1), 3 * world - 1, 1000 + world, 4099 (large).
std::vector<size_t> conformance_sizes(int world_size, bool large);

}  // namespace strata::comm::testing
