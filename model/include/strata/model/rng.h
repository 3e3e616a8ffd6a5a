#pragma once
// Small, portable, seeded random numbers (splitmix64 + Box-Muller), so that
// initial weights and batch order are the same on every platform and
// standard library (std::normal_distribution is not).

#include <cmath>
#include <cstdint>

namespace strata::model {

class Rng {
 public:
  explicit Rng(uint64_t seed, uint64_t stream = 0) : state_(mix(seed ^ mix(stream + 0x632be59bd9b4e019ull))) {}

  uint64_t next_u64() {
    state_ += 0x9e3779b97f4a7c15ull;
    return mix(state_);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n), n > 0 (multiply-shift, negligible bias for n << 2^64).
  uint64_t below(uint64_t n) { return static_cast<uint64_t>((static_cast<__uint128_t>(next_u64()) * n) >> 64); }
  // Standard normal.
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1 = uniform();
    const double u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * M_PI * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * M_PI * u2);
  }

 private:
  static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t state_;
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace strata::model
