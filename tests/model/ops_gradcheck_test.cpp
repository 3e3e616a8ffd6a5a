// Every op's backward against central finite differences of its forward,
// in double precision. The scalar checked is L = sum(out * proj) for a
// fixed random proj, so dout = proj.
#include <gtest/gtest.h>

#include <functional>

#include "strata/model/cpu_ops.h"
#include "test_util.h"

namespace strata::model {
namespace {

using Vec = std::vector<double>;
using testing::random_vector;

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// forward() returns the op's output for the current inputs; backward(dout)
// returns one gradient per input (same order as `inputs`).
void check_op(const char* name, std::vector<Vec*> inputs, const std::function<Vec()>& forward,
              const std::function<std::vector<Vec>(const Vec&)>& backward) {
  const Vec out = forward();
  const Vec proj = random_vector<double>(out.size(), 99);
  const std::vector<Vec> grads = backward(proj);
  ASSERT_EQ(grads.size(), inputs.size());
  const double h = 1e-5;
  for (size_t k = 0; k < inputs.size(); ++k) {
    Vec& x = *inputs[k];
    ASSERT_EQ(grads[k].size(), x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const double saved = x[i];
      x[i] = saved + h;
      const double lp = dot(forward(), proj);
      x[i] = saved - h;
      const double lm = dot(forward(), proj);
      x[i] = saved;
      const double fd = (lp - lm) / (2 * h);
      EXPECT_TRUE(testing::close(grads[k][i], fd, 1e-6, 1e-8))
          << name << ": input " << k << " element " << i << " analytic " << grads[k][i] << " finite diff " << fd;
    }
  }
}

TEST(OpsGradCheck, Encoder) {
  const int B = 2, T = 3, C = 4, V = 5;
  const std::vector<int32_t> tokens = {1, 3, 1, 4, 1, 0};
  Vec wte = random_vector<double>(V * C, 1), wpe = random_vector<double>(T * C, 2);
  check_op("encoder", {&wte, &wpe},
           [&] {
             Vec out(B * T * C);
             cpu::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
             return out;
           },
           [&](const Vec& d) {
             Vec gw(wte.size(), 0.0), gp(wpe.size(), 0.0);
             cpu::encoder_backward(gw.data(), gp.data(), d.data(), tokens.data(), B, T, C);
             return std::vector<Vec>{gw, gp};
           });
}

TEST(OpsGradCheck, LayerNorm) {
  const int N = 3, C = 5;
  Vec x = random_vector<double>(N * C, 3), w = random_vector<double>(C, 4), b = random_vector<double>(C, 5);
  Vec mean(N), rstd(N);
  check_op("layernorm", {&x, &w, &b},
           [&] {
             Vec out(N * C);
             cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
             return out;
           },
           [&](const Vec& d) {
             Vec out(N * C), gx(x.size(), 0.0), gw(C, 0.0), gb(C, 0.0);
             cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
             cpu::layernorm_backward(gx.data(), gw.data(), gb.data(), d.data(), x.data(), w.data(), mean.data(),
                                     rstd.data(), N, C);
             return std::vector<Vec>{gx, gw, gb};
           });
}

TEST(OpsGradCheck, Matmul) {
  const int N = 4, C = 3, OC = 5;
  Vec x = random_vector<double>(N * C, 6), w = random_vector<double>(OC * C, 7), b = random_vector<double>(OC, 8);
  check_op("matmul", {&x, &w, &b},
           [&] {
             Vec out(N * OC);
             cpu::matmul_forward(out.data(), x.data(), w.data(), b.data(), N, C, OC);
             return out;
           },
           [&](const Vec& d) {
             Vec gx(x.size(), 0.0), gw(w.size(), 0.0), gb(b.size(), 0.0);
             cpu::matmul_backward(gx.data(), gw.data(), gb.data(), d.data(), x.data(), w.data(), N, C, OC);
             return std::vector<Vec>{gx, gw, gb};
           });
}

TEST(OpsGradCheck, CausalAttention) {
  const int B = 2, T = 4, C = 6, NH = 2;
  Vec qkv = random_vector<double>(B * T * 3 * C, 9);
  Vec att(B * NH * T * T), datt(B * NH * T * T);
  check_op("attention", {&qkv},
           [&] {
             Vec out(B * T * C);
             cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
             return out;
           },
           [&](const Vec& d) {
             Vec out(B * T * C), g(qkv.size(), 0.0);
             cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
             cpu::attention_backward(g.data(), datt.data(), d.data(), qkv.data(), att.data(), B, T, C, NH);
             return std::vector<Vec>{g};
           });
}

TEST(OpsGradCheck, AttentionIsCausal) {
  // Changing a later position must not change earlier outputs.
  const int B = 1, T = 5, C = 4, NH = 2;
  Vec qkv = random_vector<double>(B * T * 3 * C, 10);
  Vec att(B * NH * T * T), out1(B * T * C), out2(B * T * C);
  cpu::attention_forward(out1.data(), att.data(), qkv.data(), B, T, C, NH);
  for (int c = 0; c < 3 * C; ++c) qkv[(T - 1) * 3 * C + c] += 1.0;
  cpu::attention_forward(out2.data(), att.data(), qkv.data(), B, T, C, NH);
  for (int i = 0; i < (T - 1) * C; ++i) EXPECT_EQ(out1[i], out2[i]) << i;
}

TEST(OpsGradCheck, Gelu) {
  Vec x = random_vector<double>(9, 11, 2.0);
  check_op("gelu", {&x},
           [&] {
             Vec out(x.size());
             cpu::gelu_forward(out.data(), x.data(), x.size());
             return out;
           },
           [&](const Vec& d) {
             Vec g(x.size(), 0.0);
             cpu::gelu_backward(g.data(), x.data(), d.data(), x.size());
             return std::vector<Vec>{g};
           });
}

TEST(OpsGradCheck, Residual) {
  Vec a = random_vector<double>(7, 12), b = random_vector<double>(7, 13);
  check_op("residual", {&a, &b},
           [&] {
             Vec out(a.size());
             cpu::residual_forward(out.data(), a.data(), b.data(), a.size());
             return out;
           },
           [&](const Vec& d) {
             Vec ga(a.size(), 0.0), gb(b.size(), 0.0);
             cpu::residual_backward(ga.data(), gb.data(), d.data(), a.size());
             return std::vector<Vec>{ga, gb};
           });
}

TEST(OpsGradCheck, SoftmaxCrossEntropy) {
  const int N = 3, V = 6;
  Vec logits = random_vector<double>(N * V, 14, 2.0);
  const std::vector<int32_t> targets = {2, 0, 5};
  Vec probs(N * V), losses(N);
  // The op's output is the scalar mean loss; proj scales it.
  check_op("softmax_xent", {&logits},
           [&] { return Vec{cpu::softmax_xent_forward(probs.data(), losses.data(), logits.data(), targets.data(), N, V)}; },
           [&](const Vec& d) {
             cpu::softmax_xent_forward(probs.data(), losses.data(), logits.data(), targets.data(), N, V);
             Vec g(logits.size());
             cpu::softmax_xent_backward(g.data(), probs.data(), targets.data(), d[0] / N, N, V);
             return std::vector<Vec>{g};
           });
}

}  // namespace
}  // namespace strata::model
