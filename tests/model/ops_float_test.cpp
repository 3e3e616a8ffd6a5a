// The fp32 fast paths (OpenBLAS sgemm, TBB-parallel loops) against the
// straightforward reference (triple-loop gemm) and against the same op in
// double, element by element.
#include <gtest/gtest.h>

#include "strata/model/cpu_ops.h"
#include "test_util.h"

namespace strata::model {
namespace {

using testing::random_vector;

std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

void expect_close(const std::vector<float>& f, const std::vector<double>& d, double rtol, double atol, const char* what) {
  ASSERT_EQ(f.size(), d.size());
  for (size_t i = 0; i < f.size(); ++i)
    EXPECT_TRUE(testing::close(f[i], d[i], rtol, atol)) << what << "[" << i << "]: fp32 " << f[i] << " vs fp64 " << d[i];
}

TEST(OpsFloat, SgemmMatchesReferenceLoopElementwise) {
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const int M = 37, N = 29, K = 53;
      const int lda = ta ? M + 3 : K + 2, ldb = tb ? K + 1 : N + 4, ldc = N + 5;
      auto A = random_vector<float>(static_cast<size_t>(ta ? K : M) * lda, 1);
      auto B = random_vector<float>(static_cast<size_t>(tb ? N : K) * ldb, 2);
      auto C1 = random_vector<float>(static_cast<size_t>(M) * ldc, 3);
      auto C2 = C1;
      cpu::gemm<float>(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, 0.25f, C1.data(), ldc);
      cpu::gemm_reference<float>(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, 0.25f, C2.data(), ldc);
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j)
          EXPECT_TRUE(testing::close(C1[i * ldc + j], C2[i * ldc + j], 1e-4, 1e-4))
              << "ta=" << ta << " tb=" << tb << " at " << i << "," << j;
      // Padding columns beyond N are untouched.
      auto C0 = random_vector<float>(static_cast<size_t>(M) * ldc, 3);
      for (int i = 0; i < M; ++i)
        for (int j = N; j < ldc; ++j) EXPECT_EQ(C1[i * ldc + j], C0[i * ldc + j]);
    }
}

TEST(OpsFloat, MatmulForwardBackwardMatchesDouble) {
  const int N = 24, C = 20, OC = 36;
  auto x = random_vector<float>(N * C, 4), w = random_vector<float>(OC * C, 5), b = random_vector<float>(OC, 6);
  auto d = random_vector<float>(N * OC, 7);
  std::vector<float> out(N * OC), gx(N * C, 0), gw(OC * C, 0), gb(OC, 0);
  std::vector<double> outd(N * OC), gxd(N * C, 0), gwd(OC * C, 0), gbd(OC, 0);
  auto xd = widen(x), wd = widen(w), bd = widen(b), dd = widen(d);
  cpu::matmul_forward(out.data(), x.data(), w.data(), b.data(), N, C, OC);
  cpu::matmul_forward(outd.data(), xd.data(), wd.data(), bd.data(), N, C, OC);
  cpu::matmul_backward(gx.data(), gw.data(), gb.data(), d.data(), x.data(), w.data(), N, C, OC);
  cpu::matmul_backward(gxd.data(), gwd.data(), gbd.data(), dd.data(), xd.data(), wd.data(), N, C, OC);
  expect_close(out, outd, 1e-4, 1e-4, "out");
  expect_close(gx, gxd, 1e-4, 1e-4, "dinp");
  expect_close(gw, gwd, 1e-4, 1e-4, "dw");
  expect_close(gb, gbd, 1e-4, 1e-4, "dbias");
}

TEST(OpsFloat, LayerNormAttentionGeluSoftmaxMatchDouble) {
  const int B = 2, T = 9, C = 12, NH = 3, N = B * T, V = 11;
  // LayerNorm
  auto x = random_vector<float>(N * C, 8), w = random_vector<float>(C, 9), b = random_vector<float>(C, 10);
  auto d = random_vector<float>(N * C, 11);
  std::vector<float> o(N * C), m(N), r(N), gx(N * C, 0), gw(C, 0), gb(C, 0);
  std::vector<double> od(N * C), md(N), rd(N), gxd(N * C, 0), gwd(C, 0), gbd(C, 0);
  auto xd = widen(x), wd = widen(w), bd = widen(b), dd = widen(d);
  cpu::layernorm_forward(o.data(), m.data(), r.data(), x.data(), w.data(), b.data(), N, C);
  cpu::layernorm_forward(od.data(), md.data(), rd.data(), xd.data(), wd.data(), bd.data(), N, C);
  cpu::layernorm_backward(gx.data(), gw.data(), gb.data(), d.data(), x.data(), w.data(), m.data(), r.data(), N, C);
  cpu::layernorm_backward(gxd.data(), gwd.data(), gbd.data(), dd.data(), xd.data(), wd.data(), md.data(), rd.data(), N, C);
  expect_close(o, od, 1e-4, 1e-5, "ln out");
  expect_close(gx, gxd, 1e-4, 1e-4, "ln dinp");
  expect_close(gw, gwd, 1e-4, 1e-4, "ln dw");
  expect_close(gb, gbd, 1e-4, 1e-4, "ln db");
  // Attention
  auto qkv = random_vector<float>(N * 3 * C, 12);
  auto da = random_vector<float>(N * C, 13);
  std::vector<float> ao(N * C), att(B * NH * T * T), datt(B * NH * T * T), gq(N * 3 * C, 0);
  std::vector<double> aod(N * C), attd(B * NH * T * T), dattd(B * NH * T * T), gqd(N * 3 * C, 0);
  auto qkvd = widen(qkv), dad = widen(da);
  cpu::attention_forward(ao.data(), att.data(), qkv.data(), B, T, C, NH);
  cpu::attention_forward(aod.data(), attd.data(), qkvd.data(), B, T, C, NH);
  cpu::attention_backward(gq.data(), datt.data(), da.data(), qkv.data(), att.data(), B, T, C, NH);
  cpu::attention_backward(gqd.data(), dattd.data(), dad.data(), qkvd.data(), attd.data(), B, T, C, NH);
  expect_close(ao, aod, 1e-4, 1e-5, "attn out");
  expect_close(gq, gqd, 1e-4, 1e-4, "attn dqkv");
  // GELU
  std::vector<float> go(N * C), gg(N * C, 0);
  std::vector<double> god(N * C), ggd(N * C, 0);
  cpu::gelu_forward(go.data(), x.data(), go.size());
  cpu::gelu_forward(god.data(), xd.data(), god.size());
  cpu::gelu_backward(gg.data(), x.data(), d.data(), gg.size());
  cpu::gelu_backward(ggd.data(), xd.data(), dd.data(), ggd.size());
  expect_close(go, god, 1e-5, 1e-6, "gelu out");
  expect_close(gg, ggd, 1e-5, 1e-6, "gelu dinp");
  // Softmax cross-entropy
  auto logits = random_vector<float>(N * V, 14, 3.0);
  std::vector<int32_t> tgt(N);
  for (int i = 0; i < N; ++i) tgt[i] = (i * 7) % V;
  std::vector<float> p(N * V), l(N), dl(N * V);
  std::vector<double> pd(N * V), ld(N), dld(N * V);
  auto logitsd = widen(logits);
  const float loss = cpu::softmax_xent_forward(p.data(), l.data(), logits.data(), tgt.data(), N, V);
  const double lossd = cpu::softmax_xent_forward(pd.data(), ld.data(), logitsd.data(), tgt.data(), N, V);
  EXPECT_NEAR(loss, lossd, 1e-5 * std::abs(lossd));
  cpu::softmax_xent_backward(dl.data(), p.data(), tgt.data(), 1.0f / N, N, V);
  cpu::softmax_xent_backward(dld.data(), pd.data(), tgt.data(), 1.0 / N, N, V);
  expect_close(p, pd, 1e-5, 1e-7, "probs");
  expect_close(dl, dld, 1e-5, 1e-7, "dlogits");
}

TEST(OpsFloat, EncoderAccumulatesRepeatedTokensDeterministically) {
  const int B = 3, T = 4, C = 70, V = 8;  // C > one 64-wide channel block
  std::vector<int32_t> tok = {1, 1, 1, 2, 3, 1, 0, 7, 1, 1, 2, 2};
  auto d = random_vector<float>(B * T * C, 15);
  std::vector<float> g1(V * C, 0), p1(T * C, 0), g2(V * C, 0), p2(T * C, 0);
  cpu::encoder_backward(g1.data(), p1.data(), d.data(), tok.data(), B, T, C);
  cpu::encoder_backward(g2.data(), p2.data(), d.data(), tok.data(), B, T, C);
  EXPECT_EQ(g1, g2);
  EXPECT_EQ(p1, p2);
  // Row 1, channel 69: the sum of dout over the positions holding token 1, in order.
  float want = 0;
  for (int i = 0; i < B * T; ++i)
    if (tok[i] == 1) want += d[i * C + 69];
  EXPECT_EQ(g1[1 * C + 69], want);
}

}  // namespace
}  // namespace strata::model
