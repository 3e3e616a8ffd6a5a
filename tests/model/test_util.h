#pragma once
#include <cmath>
#include <vector>

#include "strata/model/rng.h"

namespace strata::model::testing {

template <typename T>
std::vector<T> random_vector(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed, 7);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(scale * rng.normal());
  return v;
}

// |a - b| <= atol + rtol * |b|
inline bool close(double a, double b, double rtol, double atol) { return std::abs(a - b) <= atol + rtol * std::abs(b); }

}  // namespace strata::model::testing
