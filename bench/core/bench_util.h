#pragma once
// Shared by the core benchmarks: a host memcpy ceiling (median of repeats)
// that every bandwidth number is printed against.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace strata::bench {

// GB/s of memcpy for `bytes` bytes, counting bytes read + bytes written
// (2 * bytes per copy), median of `repeats` runs.
inline double memcpy_read_write_gbps(size_t bytes, int repeats = 7) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  std::vector<double> rates;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    const auto t1 = std::chrono::steady_clock::now();
    rates.push_back(2.0 * static_cast<double>(bytes) / std::chrono::duration<double>(t1 - t0).count() / 1e9);
    std::swap(a, b);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

}  // namespace strata::bench
