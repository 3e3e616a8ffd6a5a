// CUDA kernels against the CPU ones, op by op, and the cuda executor
// against the cpu executor. Skipped when no GPU answers.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include "cpu_backend.h"
#include "cuda/cuda_ops.h"
#include "strata/core/device_registry.h"
#include "strata/model/gpt_executor.h"
#include "test_util.h"

namespace strata::model {
namespace {

using detail::CudaOps;
using testing::random_vector;

// Any cudaGetDeviceCount error (no driver, no device) means "no GPU".
#define SKIP_WITHOUT_GPU()                                                                       \
  do {                                                                                           \
    int count = 0;                                                                               \
    const cudaError_t err = cudaGetDeviceCount(&count);                                          \
    if (err != cudaSuccess || count == 0)                                                        \
      GTEST_SKIP() << "no usable GPU: " << (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices"); \
  } while (0)

// Test-side device memory (plain cudaMalloc: the ops allocate nothing).
struct Dev {
  CudaOps& ops;
  std::vector<void*> owned;
  ~Dev() {
    cudaStreamSynchronize(static_cast<cudaStream_t>(ops.stream()));
    for (void* p : owned) cudaFree(p);
  }
  void* raw(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes + 16), cudaSuccess);
    owned.push_back(p);
    return p;
  }
  float* put(const std::vector<float>& h) {
    float* p = static_cast<float*>(raw(h.size() * sizeof(float)));
    cudaMemcpy(p, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice);
    return p;
  }
  int32_t* put_ints(const std::vector<int32_t>& h) {
    int32_t* p = static_cast<int32_t*>(raw(h.size() * sizeof(int32_t)));
    cudaMemcpy(p, h.data(), h.size() * sizeof(int32_t), cudaMemcpyHostToDevice);
    return p;
  }
  float* zeros(size_t n) {
    float* p = static_cast<float*>(raw(n * sizeof(float)));
    ops.zero(p, n);
    return p;
  }
  std::vector<float> get(const float* p, size_t n) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(ops.stream()));
    std::vector<float> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost);
    return h;
  }
};

struct RawStream {
  cudaStream_t s = nullptr;
  RawStream() { cudaStreamCreate(&s); }
  ~RawStream() { cudaStreamDestroy(s); }
};

void expect_close(const std::vector<float>& gpu, const std::vector<float>& cpu, double rtol, double atol,
                  const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i)
    ASSERT_TRUE(testing::close(gpu[i], cpu[i], rtol, atol)) << what << "[" << i << "]: cuda " << gpu[i] << " cpu " << cpu[i];
}

TEST(CudaOps, EveryOpMatchesCpu) {
  SKIP_WITHOUT_GPU();
  RawStream stream;
  CudaOps ops(stream.s);
  ASSERT_TRUE(ops.ok()) << ops.error();
  Dev dev{ops, {}};
  detail::CpuOps<float> cpu;
  const int B = 2, T = 17, C = 24, NH = 4, N = B * T, V = 300;
  // encoder
  std::vector<int32_t> tok(N);
  for (int i = 0; i < N; ++i) tok[i] = (i * 37) % V;
  int32_t* dtok = dev.put_ints(tok);
  auto wte = random_vector<float>(V * C, 1), wpe = random_vector<float>(T * C, 2);
  std::vector<float> enc(N * C);
  cpu.encoder_forward(enc.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  float* denc = dev.zeros(N * C);
  ops.encoder_forward(denc, dtok, dev.put(wte), dev.put(wpe), B, T, C);
  expect_close(dev.get(denc, N * C), enc, 0, 0, "encoder_forward");
  auto dout = random_vector<float>(N * C, 3);
  std::vector<float> gwte(V * C, 0), gwpe(T * C, 0);
  cpu.encoder_backward(gwte.data(), gwpe.data(), dout.data(), tok.data(), B, T, C);
  float *dgwte = dev.zeros(V * C), *dgwpe = dev.zeros(T * C);
  ops.encoder_backward(dgwte, dgwpe, dev.put(dout), dtok, B, T, C);
  expect_close(dev.get(dgwte, V * C), gwte, 1e-6, 1e-6, "encoder_backward dwte");
  expect_close(dev.get(dgwpe, T * C), gwpe, 1e-6, 1e-6, "encoder_backward dwpe");
  // layernorm
  auto x = random_vector<float>(N * C, 4), w = random_vector<float>(C, 5), b = random_vector<float>(C, 6);
  std::vector<float> ln(N * C), m(N), r(N), gx(N * C, 0), gw(C, 0), gb(C, 0);
  cpu.layernorm_forward(ln.data(), m.data(), r.data(), x.data(), w.data(), b.data(), N, C);
  cpu.layernorm_backward(gx.data(), gw.data(), gb.data(), dout.data(), x.data(), w.data(), m.data(), r.data(), N, C);
  float *dln = dev.zeros(N * C), *dm = dev.zeros(N), *dr = dev.zeros(N), *dx = dev.put(x), *dw = dev.put(w);
  float *dgx = dev.zeros(N * C), *dgw = dev.zeros(C), *dgb = dev.zeros(C), *dd = dev.put(dout);
  ops.layernorm_forward(dln, dm, dr, dx, dw, dev.put(b), N, C);
  ops.layernorm_backward(dgx, dgw, dgb, dd, dx, dw, dm, dr, N, C);
  expect_close(dev.get(dln, N * C), ln, 1e-5, 1e-5, "layernorm_forward");
  expect_close(dev.get(dgx, N * C), gx, 1e-4, 1e-5, "layernorm_backward dinp");
  expect_close(dev.get(dgw, C), gw, 1e-4, 1e-5, "layernorm_backward dw");
  expect_close(dev.get(dgb, C), gb, 1e-4, 1e-5, "layernorm_backward db");
  // matmul
  const int OC = 3 * C;
  auto mw = random_vector<float>(OC * C, 7), mb = random_vector<float>(OC, 8), md = random_vector<float>(N * OC, 9);
  std::vector<float> mo(N * OC), mgx(N * C, 0), mgw(OC * C, 0), mgb(OC, 0);
  cpu.matmul_forward(mo.data(), x.data(), mw.data(), mb.data(), N, C, OC);
  cpu.matmul_backward(mgx.data(), mgw.data(), mgb.data(), md.data(), x.data(), mw.data(), N, C, OC);
  float *dmo = dev.zeros(N * OC), *dmw = dev.put(mw), *dmgx = dev.zeros(N * C), *dmgw = dev.zeros(OC * C),
        *dmgb = dev.zeros(OC);
  ops.matmul_forward(dmo, dx, dmw, dev.put(mb), N, C, OC);
  ops.matmul_backward(dmgx, dmgw, dmgb, dev.put(md), dx, dmw, N, C, OC);
  expect_close(dev.get(dmo, N * OC), mo, 1e-4, 1e-4, "matmul_forward");
  expect_close(dev.get(dmgx, N * C), mgx, 1e-4, 1e-4, "matmul_backward dinp");
  expect_close(dev.get(dmgw, OC * C), mgw, 1e-4, 1e-4, "matmul_backward dw");
  expect_close(dev.get(dmgb, OC), mgb, 1e-4, 1e-4, "matmul_backward dbias");
  // attention
  auto qkv = random_vector<float>(N * 3 * C, 10);
  std::vector<float> ao(N * C), att(B * NH * T * T), datt(B * NH * T * T), gq(N * 3 * C, 0);
  cpu.attention_forward(ao.data(), att.data(), qkv.data(), B, T, C, NH);
  cpu.attention_backward(gq.data(), datt.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH);
  float *dao = dev.zeros(N * C), *datt_d = dev.zeros(B * NH * T * T), *dscratch = dev.zeros(B * NH * T * T);
  float *dqkv = dev.put(qkv), *dgq = dev.zeros(N * 3 * C);
  ops.attention_forward(dao, datt_d, dqkv, B, T, C, NH);
  ops.attention_backward(dgq, dscratch, dd, dqkv, datt_d, B, T, C, NH);
  expect_close(dev.get(dao, N * C), ao, 1e-4, 1e-5, "attention_forward");
  expect_close(dev.get(datt_d, B * NH * T * T), att, 1e-4, 1e-6, "attention_forward att");
  expect_close(dev.get(dgq, N * 3 * C), gq, 1e-3, 1e-5, "attention_backward");
  // gelu, residual
  std::vector<float> go(N * C), gg(N * C, 0), ro(N * C);
  cpu.gelu_forward(go.data(), x.data(), go.size());
  cpu.gelu_backward(gg.data(), x.data(), dout.data(), gg.size());
  cpu.residual_forward(ro.data(), x.data(), dout.data(), ro.size());
  float *dgo = dev.zeros(N * C), *dgg = dev.zeros(N * C), *dro = dev.zeros(N * C);
  ops.gelu_forward(dgo, dx, N * C);
  ops.gelu_backward(dgg, dx, dd, N * C);
  ops.residual_forward(dro, dx, dd, N * C);
  expect_close(dev.get(dgo, N * C), go, 1e-5, 1e-6, "gelu_forward");
  expect_close(dev.get(dgg, N * C), gg, 1e-5, 1e-6, "gelu_backward");
  expect_close(dev.get(dro, N * C), ro, 0, 0, "residual_forward");
  // softmax cross-entropy
  auto logits = random_vector<float>(N * V, 11, 2.0);
  std::vector<float> p(N * V), l(N), dl(N * V);
  float loss = 0;
  cpu.softmax_xent_forward(p.data(), l.data(), logits.data(), tok.data(), N, V, &loss);
  cpu.softmax_xent_backward(dl.data(), p.data(), tok.data(), 1.0f / N, N, V);
  float *dp = dev.zeros(N * V), *dlosses = dev.zeros(N), *ddl = dev.zeros(N * V);
  ops.softmax_xent_forward(dp, dlosses, dev.put(logits), dtok, N, V);
  float dloss = 0;
  for (float v : dev.get(dlosses, N)) dloss += v;
  dloss /= static_cast<float>(N);
  ops.softmax_xent_backward(ddl, dp, dtok, 1.0f / N, N, V);
  EXPECT_NEAR(dloss, loss, 1e-5 * loss);
  expect_close(dev.get(dp, N * V), p, 1e-5, 1e-8, "softmax probs");
  expect_close(dev.get(ddl, N * V), dl, 1e-5, 1e-8, "softmax_xent_backward");
  ASSERT_TRUE(ops.ok()) << ops.error();
}

TEST(CudaOps, ExecutorMatchesCpuExecutor) {
  SKIP_WITHOUT_GPU();
  const int B = 2, T = 32;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    GptConfig c = *preset("tiny");
    c.param_dtype = dt;
    auto model = GptModel::create(c, 5).value();
    auto pc = testing::resident(*model);
    auto pg = testing::resident(*model);
    auto cpu_rig = testing::cpu_rig();
    auto gpu = make_device("cuda").value();
    auto gpu_stream = gpu->create_stream().value();
    auto ec = GptExecutor::create(*model, *cpu_rig.device, *cpu_rig.stream, B, T).value();
    auto eg_r = GptExecutor::create(*model, *gpu, *gpu_stream, B, T);
    ASSERT_TRUE(eg_r.ok()) << eg_r.status().to_string();
    auto eg = std::move(eg_r).value();
    std::vector<int32_t> tok(B * T), tgt(B * T);
    for (int i = 0; i < B * T; ++i) {
      tok[i] = (i * 13) % 256;
      tgt[i] = (i * 29 + 3) % 256;
    }
    const float lc = ec->forward(tok, tgt, *pc).value();
    const float lg = eg->forward(tok, tgt, *pg).value();
    EXPECT_NEAR(lg, lc, 1e-4 * lc);
    ASSERT_TRUE(ec->backward(1.0f, *pc).ok());
    ASSERT_TRUE(eg->backward(1.0f, *pg).ok());
    ASSERT_TRUE(pc->wait_gradients().ok());
    ASSERT_TRUE(pg->wait_gradients().ok());
    for (size_t l = 0; l < model->layers().size(); ++l) {
      auto a = pg->grads(l), b = pc->grads(l);
      float max_abs = 0;
      for (float v : b) max_abs = std::max(max_abs, std::abs(v));
      for (size_t i = 0; i < a.size(); ++i)
        ASSERT_TRUE(testing::close(a[i], b[i], 1e-3, 1e-3 * max_abs + 1e-8))
            << model->layers()[l].name << "[" << i << "]: cuda " << a[i] << " cpu " << b[i];
    }
  }
}

}  // namespace
}  // namespace strata::model
