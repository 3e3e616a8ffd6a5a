#pragma once
// Statistics the CLI's bench and report commands print over repeated timings.
#include <algorithm>
#include <chrono>
#include <vector>

namespace strata::cli {

// The median of `samples` (the mean of the two middle ones for an even count); 0 for none.
inline double median(std::vector<double> samples) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  return n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
}

// Seconds of the steady clock since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace strata::cli
