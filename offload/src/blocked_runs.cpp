// plan_blocked_steps (Note [Runs in 8-bit blocks] in blocked_runs.h).
#include "blocked_runs.h"

#include <algorithm>

#include "strata/core/status.h"

namespace strata::offload::engine_detail {

BlockedSteps plan_blocked_steps(std::span<const ElementRun> runs, size_t piece_count, size_t block_elements) {
  STRATA_CHECK(block_elements > 0, "8-bit moment blocks of 0 elements");
  BlockedSteps out;
  size_t next_run = 0;  // the first run that may still intersect the current block
  for (size_t first = 0; first < piece_count; first += block_elements) {
    const size_t end = std::min(piece_count, first + block_elements);
    while (next_run < runs.size() && runs[next_run].offset + runs[next_run].count <= first) ++next_run;
    std::vector<BlockedSteps::Range> parts;
    for (size_t r = next_run; r < runs.size() && runs[r].offset < end; ++r) {
      const size_t b = std::max(first, runs[r].offset), e = std::min(end, runs[r].offset + runs[r].count);
      if (b < e) parts.push_back({r, b, e - b});
    }
    if (parts.empty()) continue;  // no run here: nothing to step
    if (parts.size() == 1 && parts[0].first == first && parts[0].count == end - first) {
      // A whole block of one run: joins the previous range when it continues it.
      if (!out.whole.empty() && out.whole.back().run == parts[0].run &&
          out.whole.back().first + out.whole.back().count == first)
        out.whole.back().count += end - first;
      else
        out.whole.push_back(parts[0]);
      continue;
    }
    out.shared.push_back({first, end - first, std::move(parts)});
  }
  return out;
}

}  // namespace strata::offload::engine_detail
