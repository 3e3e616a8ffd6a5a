// The whole GPT: layer description, gradient check of the full model in
// double, fp32 executor vs double reference, hook order, errors.
#include <gtest/gtest.h>

#include <cstring>

#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/gpt_reference.h"
#include "strata/offload/resident_provider.h"
#include "test_util.h"

namespace strata::model {
namespace {

GptConfig micro_config() {
  GptConfig c;
  c.preset = "micro";
  c.vocab_size = 256;
  c.max_seq_len = 6;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  return c;
}

void make_batch(int B, int T, uint64_t seed, std::vector<int32_t>& tok, std::vector<int32_t>& tgt) {
  Rng rng(seed, 3);
  tok.resize(B * T);
  tgt.resize(B * T);
  for (auto& t : tok) t = static_cast<int32_t>(rng.below(256));
  for (auto& t : tgt) t = static_cast<int32_t>(rng.below(256));
}

TEST(GptModel, DescribesItselfAsLayersWithFlatParams) {
  auto model = GptModel::create(*preset("tiny"), 1).value();
  const auto layers = model->layers();
  ASSERT_EQ(layers.size(), 2u + model->config().n_layer);
  EXPECT_EQ(layers[0].name, "embedding");
  EXPECT_EQ(layers[0].params[kWte].name, "wte");
  EXPECT_EQ(layers[0].params[kWte].shape, (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(layers[1].name, "h0");
  EXPECT_EQ(layers[1].params[kQkvW].name, "h0.attn.qkv.weight");
  EXPECT_EQ(layers[1].params[kQkvW].shape, (std::vector<int64_t>{192, 64}));
  EXPECT_EQ(layers.back().name, "final_norm");
  size_t total = 0;
  for (const LayerSpec& l : layers) {
    size_t off = 0;
    for (const ParamTensorSpec& t : l.params) {
      EXPECT_EQ(t.offset_elements, off) << t.name;  // back to back
      EXPECT_EQ(t.offset_bytes, off * 4) << t.name;
      off += static_cast<size_t>(t.numel());
    }
    EXPECT_EQ(off, l.param_count);
    total += l.param_count;
  }
  EXPECT_EQ(static_cast<int64_t>(total), model->config().param_count());
  EXPECT_EQ(total, total_param_count(*model));
}

TEST(GptModel, PresetSizes) {
  EXPECT_NEAR(static_cast<double>(preset("small")->param_count()), 25.8e6, 0.5e6);
  EXPECT_NEAR(static_cast<double>(preset("gpt2")->param_count()), 124.5e6, 0.5e6);
  EXPECT_NEAR(static_cast<double>(preset("gpt2-medium")->param_count()), 354.8e6, 1e6);
  EXPECT_NEAR(static_cast<double>(preset("1b")->param_count()), 1.31e9, 0.02e9);
  auto bad = preset("gpt3");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("gpt2-medium"), std::string::npos) << bad.status().message();
}

TEST(GptModel, InvalidConfigsNameTheField) {
  GptConfig c = micro_config();
  c.n_embd = 10;
  c.n_head = 4;
  auto r = GptModel::create(c, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("n_head"), std::string::npos) << r.status().message();
  c = micro_config();
  c.vocab_size = 100;
  r = GptModel::create(c, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--vocab"), std::string::npos) << r.status().message();
}

TEST(GptModel, InitIsSeededPerLayerAndRoundedPerDtype) {
  GptConfig c = micro_config();
  auto a = GptModel::create(c, 7).value();
  auto b = GptModel::create(c, 7).value();
  auto other = GptModel::create(c, 8).value();
  std::vector<float> va(a->layers()[1].param_count), vb(va.size()), vo(va.size());
  a->init_layer_values(1, std::span<float>(va));
  b->init_layer_values(1, std::span<float>(vb));
  other->init_layer_values(1, std::span<float>(vo));
  EXPECT_EQ(va, vb);
  EXPECT_NE(va, vo);
  // LayerNorm weights start at 1, biases at 0.
  EXPECT_EQ(va[a->layers()[1].params[kLn1W].offset_elements], 1.0f);
  EXPECT_EQ(va[a->layers()[1].params[kQkvB].offset_elements], 0.0f);
  c.param_dtype = DType::kBF16;
  auto h = GptModel::create(c, 7).value();
  std::vector<std::byte> bytes(h->layers()[1].param_bytes);
  ASSERT_EQ(bytes.size(), va.size() * 2);
  ASSERT_TRUE(h->init_layer(1, bytes).ok());
  for (size_t i = 0; i < va.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, bytes.data() + 2 * i, 2);
    EXPECT_EQ(bits, fp32_to_bf16_bits(va[i])) << i;
  }
  EXPECT_FALSE(h->init_layer(1, std::span<std::byte>(bytes.data(), 3)).ok());
}

// Gradient of the mean loss w.r.t. every parameter of the whole model
// against central finite differences, in double.
TEST(GptModel, WholeModelGradientCheckDouble) {
  const int B = 2, T = 5;
  auto model = GptModel::create(micro_config(), 11).value();
  auto ref = GptReference::create(*model, B, T).value();
  std::vector<int32_t> tok, tgt;
  make_batch(B, T, 5, tok, tgt);
  ASSERT_TRUE(ref->forward(tok, tgt).ok());
  ASSERT_TRUE(ref->backward().ok());
  const auto grads = ref->grads();
  const double h = 1e-5;
  size_t checked = 0;
  for (size_t l = 0; l < model->layers().size(); ++l) {
    auto& p = ref->params()[l];
    for (size_t i = 0; i < p.size(); ++i) {
      const double saved = p[i];
      p[i] = saved + h;
      const double lp = ref->forward(tok, tgt).value();
      p[i] = saved - h;
      const double lm = ref->forward(tok, tgt).value();
      p[i] = saved;
      const double fd = (lp - lm) / (2 * h);
      ASSERT_TRUE(testing::close(grads[l][i], fd, 1e-5, 1e-9))
          << model->layers()[l].name << " element " << i << ": analytic " << grads[l][i] << " fd " << fd;
      ++checked;
    }
  }
  EXPECT_EQ(checked, total_param_count(*model));
}

// The tiny preset itself (0.12M parameters): 48 sampled parameters of every
// tensor, including the first and the last element, against finite differences.
TEST(GptModel, TinyPresetGradientCheckDoubleSampled) {
  const int B = 1, T = 8;
  auto model = GptModel::create(*preset("tiny"), 21).value();
  auto ref = GptReference::create(*model, B, T).value();
  std::vector<int32_t> tok, tgt;
  make_batch(B, T, 8, tok, tgt);
  ASSERT_TRUE(ref->forward(tok, tgt).ok());
  ASSERT_TRUE(ref->backward().ok());
  const auto grads = ref->grads();
  Rng rng(5);
  const double h = 1e-5;
  for (size_t l = 0; l < model->layers().size(); ++l) {
    for (const ParamTensorSpec& t : model->layers()[l].params) {
      const size_t n = static_cast<size_t>(t.numel());
      for (int s = 0; s < 48; ++s) {
        const size_t i = t.offset_elements + (s == 0 ? 0 : s == 1 ? n - 1 : rng.below(n));
        auto& p = ref->params()[l];
        const double saved = p[i];
        p[i] = saved + h;
        const double lp = ref->forward(tok, tgt).value();
        p[i] = saved - h;
        const double lm = ref->forward(tok, tgt).value();
        p[i] = saved;
        const double fd = (lp - lm) / (2 * h);
        ASSERT_TRUE(testing::close(grads[l][i], fd, 1e-5, 1e-9))
            << t.name << " element " << i - t.offset_elements << ": analytic " << grads[l][i] << " fd " << fd;
      }
    }
  }
}

TEST(GptModel, Fp32ExecutorMatchesDoubleReferenceElementwise) {
  const int B = 3, T = 16;
  auto model = GptModel::create(*preset("tiny"), 3).value();
  auto ref = GptReference::create(*model, B, T).value();
  auto params = testing::resident(*model);
  auto rig = testing::cpu_rig();
  auto exec = GptExecutor::create(*model, *rig.device, *rig.stream, B, T).value();
  std::vector<int32_t> tok, tgt;
  make_batch(B, T, 9, tok, tgt);
  const double loss_ref = ref->forward(tok, tgt).value();
  const float loss = exec->forward(tok, tgt, *params).value();
  EXPECT_NEAR(loss, loss_ref, 1e-5 * loss_ref);
  ASSERT_TRUE(ref->backward(0.5).ok());
  ASSERT_TRUE(exec->backward(0.5f, *params).ok());
  ASSERT_TRUE(params->wait_gradients().ok());  // backward only enqueues
  for (size_t l = 0; l < model->layers().size(); ++l) {
    auto g = params->grads(l);
    double max_abs = 0;
    for (double v : ref->grads()[l]) max_abs = std::max(max_abs, std::abs(v));
    for (size_t i = 0; i < g.size(); ++i)
      ASSERT_TRUE(testing::close(g[i], ref->grads()[l][i], 1e-3, 1e-4 * max_abs + 1e-9))
          << model->layers()[l].name << "[" << i << "]: fp32 " << g[i] << " fp64 " << ref->grads()[l][i];
  }
  // A second backward accumulates: the gradient doubles.
  std::vector<float> once(params->grads(1).begin(), params->grads(1).end());
  ASSERT_TRUE(exec->forward(tok, tgt, *params).ok());
  ASSERT_TRUE(exec->backward(0.5f, *params).ok());
  ASSERT_TRUE(params->wait_gradients().ok());  // backward only enqueues
  for (size_t i = 0; i < once.size(); ++i) EXPECT_NEAR(params->grads(1)[i], 2 * once[i], 1e-6 + 1e-5 * std::abs(once[i]));
}

TEST(GptModel, HooksRunLayerByLayerInOrder) {
  const int B = 1, T = 4;
  auto model = GptModel::create(micro_config(), 1).value();
  auto params = testing::resident(*model);
  auto rig = testing::cpu_rig();
  auto exec = GptExecutor::create(*model, *rig.device, *rig.stream, B, T).value();
  params->set_recording(true);
  std::vector<int32_t> tok(B * T, 65), tgt(B * T, 66);
  ASSERT_TRUE(exec->forward(tok, tgt, *params).ok());
  ASSERT_TRUE(exec->backward(1.0f, *params).ok());
  ASSERT_TRUE(params->wait_gradients().ok());
  const size_t L = 2, fin = L + 1;
  using E = offload::HookEvent;
  const Pass F = Pass::kForward, Bk = Pass::kBackward;
  auto a = [](size_t l, Pass p) { return E::acquire(l, p); };
  auto r = [](size_t l, Pass p) { return E::release(l, p); };
  // Forward: the embedding, the blocks, the final norm holding the head
  // (the tied embedding again). Backward: the head (layer 0), the final
  // norm, the blocks in reverse, the encoder (layer 0 again): layer 0 is
  // not held while the blocks run.
  const std::vector<E> want = {
      a(0, F),    r(0, F),    a(1, F),  r(1, F),  a(2, F),  r(2, F),  a(fin, F), a(0, F),  r(0, F),  r(fin, F),
      a(0, Bk),   r(0, Bk),   a(fin, Bk), r(fin, Bk), a(2, Bk), r(2, Bk), a(1, Bk), r(1, Bk), a(0, Bk), r(0, Bk)};
  EXPECT_EQ(params->events(), want);
  // Never more than the final norm and the tied embedding at once.
  EXPECT_LE(params->max_layers_held(), 2u);
}

TEST(GptModel, Bf16ParametersAreWidenedForCompute) {
  const int B = 2, T = 8;
  GptConfig c = *preset("tiny");
  auto m32 = GptModel::create(c, 4).value();
  c.param_dtype = DType::kBF16;
  auto m16 = GptModel::create(c, 4).value();
  auto p32 = testing::resident(*m32);
  auto p16 = testing::resident(*m16);
  EXPECT_EQ(p16->params(1).size() * 2, p32->params(1).size());
  // Round the fp32 copy to bf16 values: both must then compute the same loss.
  for (size_t l = 0; l < m32->layers().size(); ++l) {
    auto b = p32->params(l);
    float* f = reinterpret_cast<float*>(b.data());
    for (size_t i = 0; i < b.size() / 4; ++i) f[i] = bf16_bits_to_fp32(fp32_to_bf16_bits(f[i]));
  }
  auto rig = testing::cpu_rig();
  auto e32 = GptExecutor::create(*m32, *rig.device, *rig.stream, B, T).value();
  auto e16 = GptExecutor::create(*m16, *rig.device, *rig.stream, B, T).value();
  std::vector<int32_t> tok, tgt;
  make_batch(B, T, 2, tok, tgt);
  EXPECT_EQ(e32->forward(tok, tgt, *p32).value(), e16->forward(tok, tgt, *p16).value());
}

TEST(GptModel, BadInputsAreClearErrors) {
  auto model = GptModel::create(*preset("tiny"), 1).value();
  auto params = testing::resident(*model);
  auto rig = testing::cpu_rig();
  auto too_long = GptExecutor::create(*model, *rig.device, *rig.stream, 2, 65);
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.status().message().find("--seq 65"), std::string::npos) << too_long.status().message();
  auto small_rig = testing::cpu_rig(64 << 10);
  auto tiny_mem = GptExecutor::create(*model, *small_rig.device, *small_rig.stream, 8, 64);
  ASSERT_FALSE(tiny_mem.ok());
  EXPECT_EQ(tiny_mem.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(tiny_mem.status().message().find("--device-memory"), std::string::npos) << tiny_mem.status().message();
  auto exec = GptExecutor::create(*model, *rig.device, *rig.stream, 1, 4).value();
  std::vector<int32_t> tok = {1, 2, 300, 4}, tgt = {1, 2, 3, 4};
  auto r = exec->forward(tok, tgt, *params);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tokens[2] = 300"), std::string::npos) << r.status().message();
  std::vector<int32_t> short_tok = {1, 2};
  EXPECT_FALSE(exec->forward(short_tok, short_tok, *params).ok());
  EXPECT_EQ(exec->backward(1.0f, *params).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(exec->forward(tok, tgt, *params, Pass::kBackward).status().code(), StatusCode::kInvalidArgument);
  // A stream of another device is refused.
  auto other = testing::cpu_rig();
  auto mixed = GptExecutor::create(*model, *rig.device, *other.stream, 1, 4);
  ASSERT_FALSE(mixed.ok());
  EXPECT_NE(mixed.status().message().find("another device"), std::string::npos) << mixed.status().message();
}

}  // namespace
}  // namespace strata::model
