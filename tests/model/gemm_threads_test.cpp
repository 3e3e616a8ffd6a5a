// limit_gemm_threads (strata train --device-threads) must reach OpenBLAS.
// It used not to: the product path remembered the capped count as the one
// OpenBLAS already ran, so it never called openblas_set_num_threads, and
// `--device-threads 1` computed on every core (beside the CPU optimizer it
// was meant to leave a core to).
#include <cblas.h>
#include <gtest/gtest.h>

#include <vector>

#include "strata/model/cpu_ops.h"

namespace strata::model::cpu {
namespace {

// A product above the path's one-thread threshold (1e8 flops).
void large_product() {
  constexpr int n = 512;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n, 0.0f);
  gemm<float>(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  ASSERT_EQ(c[0], 0.5f * 0.25f * n);
}

// The limit is set before the process's first product, as strata train sets
// it; ctest runs every test in its own process, so this one comes first.
TEST(GemmThreads, TheLimitReachesOpenBlasAndIsLiftedAgain) {
  const int own = openblas_get_num_threads();
  if (own < 2) GTEST_SKIP() << "OpenBLAS runs one thread here: no limit to observe";
  limit_gemm_threads(1);
  large_product();
  EXPECT_EQ(openblas_get_num_threads(), 1);
  EXPECT_NE(gemm_backend_description().find("up to 1 threads"), std::string::npos) << gemm_backend_description();
  limit_gemm_threads(0);
  large_product();
  EXPECT_EQ(openblas_get_num_threads(), own);
}

}  // namespace
}  // namespace strata::model::cpu
