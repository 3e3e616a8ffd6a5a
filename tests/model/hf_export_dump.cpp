// For hf_export_check.py: exports a small GPT (seeded values with every
// bias and LayerNorm parameter perturbed, so a swapped or misnamed one
// shows) as a Hugging Face GPT-2 folder, and writes Strata's logits for a
// batch of tokens next to it.
//
//   strata_hf_export_dump OUT_DIR fp32|bf16
//     OUT_DIR/model/{model.safetensors,config.json}
//     OUT_DIR/tokens.i32   [B*T] int32 little-endian
//     OUT_DIR/logits.f64   [B*T, V] float64 little-endian
//     OUT_DIR/meta.json    {"batch", "seq", "vocab", "dtype", "loss"}
//
// The logits come from the double-precision forward built from Strata's own
// CPU ops (strata/model/cpu_ops.h) in the order of model/src/gpt_graph.h;
// that forward's mean loss must equal GptReference::forward's on the same
// values (1e-12 relative), which ties these logits to Strata's reference.
// With bf16, the reference runs on the bf16-rounded values the file holds.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "strata/model/cpu_ops.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_reference.h"
#include "strata/model/hf_export.h"
#include "strata/model/rng.h"

namespace {
using namespace strata;
using namespace strata::model;

int fail(const std::string& message) {
  std::fprintf(stderr, "strata_hf_export_dump: %s\n", message.c_str());
  return 1;
}

template <typename T>
bool write_raw(const std::filesystem::path& p, const std::vector<T>& v) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return static_cast<bool>(f);
}

// Logits [B*T, V] of the GPT with parameters `p` (per layer, flat layout).
std::vector<double> forward_logits(const GptModel& model, const std::vector<std::vector<double>>& p,
                                   const std::vector<int32_t>& tokens, int B, int T) {
  const GptConfig& c = model.config();
  const int N = B * T, C = c.n_embd, V = c.vocab_size, NH = c.n_head;
  const size_t NC = static_cast<size_t>(N) * C;
  auto at = [&](size_t layer, int tensor) { return p[layer].data() + model.layers()[layer].params[tensor].offset_elements; };
  std::vector<double> x(NC), ln(NC), qkv(3 * NC), att(static_cast<size_t>(B) * NH * T * T), atty(NC), proj(NC),
      res2(NC), fch(4 * NC), gelu(4 * NC), mean(N), rstd(N);
  cpu::encoder_forward(x.data(), tokens.data(), at(0, kWte), at(0, kWpe), B, T, C);
  for (int l = 0; l < c.n_layer; ++l) {
    const size_t li = model.block_layer(l);
    cpu::layernorm_forward(ln.data(), mean.data(), rstd.data(), x.data(), at(li, kLn1W), at(li, kLn1B), N, C);
    cpu::matmul_forward(qkv.data(), ln.data(), at(li, kQkvW), at(li, kQkvB), N, C, 3 * C);
    cpu::attention_forward(atty.data(), att.data(), qkv.data(), B, T, C, NH);
    cpu::matmul_forward(proj.data(), atty.data(), at(li, kAttnProjW), at(li, kAttnProjB), N, C, C);
    cpu::residual_forward(res2.data(), x.data(), proj.data(), NC);
    cpu::layernorm_forward(ln.data(), mean.data(), rstd.data(), res2.data(), at(li, kLn2W), at(li, kLn2B), N, C);
    cpu::matmul_forward(fch.data(), ln.data(), at(li, kFcW), at(li, kFcB), N, C, 4 * C);
    cpu::gelu_forward(gelu.data(), fch.data(), 4 * NC);
    cpu::matmul_forward(proj.data(), gelu.data(), at(li, kFcProjW), at(li, kFcProjB), N, 4 * C, C);
    cpu::residual_forward(x.data(), res2.data(), proj.data(), NC);
  }
  const size_t lf = model.final_layer();
  cpu::layernorm_forward(ln.data(), mean.data(), rstd.data(), x.data(), at(lf, kLnfW), at(lf, kLnfB), N, C);
  std::vector<double> logits(static_cast<size_t>(N) * V);
  cpu::matmul_forward(logits.data(), ln.data(), at(0, kWte), static_cast<const double*>(nullptr), N, C, V);
  return logits;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return fail("usage: strata_hf_export_dump OUT_DIR fp32|bf16");
  const std::filesystem::path out = argv[1];
  const std::string dtype_arg = argv[2];
  if (dtype_arg != "fp32" && dtype_arg != "bf16") return fail("dtype must be fp32 or bf16, got " + dtype_arg);
  const DType dtype = dtype_arg == "bf16" ? DType::kBF16 : DType::kF32;

  GptConfig c;
  c.preset = "export-check";
  c.vocab_size = 300;  // > 256 and != max_seq: a swapped wte/wpe or a wrong vocab shows
  c.max_seq_len = 24;
  c.n_layer = 3;
  c.n_head = 4;
  c.n_embd = 32;
  const int B = 2, T = 20;
  auto model_or = GptModel::create(c, 42);
  if (!model_or.ok()) return fail(model_or.status().to_string());
  const GptModel& model = **model_or;

  // Seeded values, everything perturbed (biases and LayerNorms are 0 and 1
  // at init, which would hide a mix-up among them), as fp32; rounded to
  // bf16 when that is what the file will hold.
  std::vector<std::vector<float>> values;
  std::vector<std::vector<double>> wide;
  for (size_t l = 0; l < model.layers().size(); ++l) {
    std::vector<float> v(model.layers()[l].param_count);
    model.init_layer_values(l, std::span<float>(v));
    Rng rng(1234, l);
    for (float& x : v) {
      x += static_cast<float>(0.05 * rng.normal());
      if (dtype == DType::kBF16) x = bf16_bits_to_fp32(fp32_to_bf16_bits(x));
    }
    wide.emplace_back(v.begin(), v.end());
    values.push_back(std::move(v));
  }

  std::error_code ec;
  std::filesystem::create_directories(out, ec);
  const Status st = export_hf_gpt2(
      c, out / "model",
      [&](size_t layer, std::span<float> dst) {
        std::copy(values[layer].begin(), values[layer].end(), dst.begin());
        return Status::Ok();
      },
      {.dtype = dtype, .overwrite = true});
  if (!st.ok()) return fail(st.to_string());

  Rng rng(7, 3);
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T), targets(tokens.size());
  for (auto& t : tokens) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.vocab_size)));
  for (auto& t : targets) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.vocab_size)));
  const std::vector<double> logits = forward_logits(model, wide, tokens, B, T);

  // The same values through GptReference: its loss must match ours.
  std::vector<double> probs(logits.size()), losses(tokens.size());
  const double loss = cpu::softmax_xent_forward(probs.data(), losses.data(), logits.data(), targets.data(),
                                                B * T, c.vocab_size);
  auto ref_or = GptReference::create(model, B, T);
  if (!ref_or.ok()) return fail(ref_or.status().to_string());
  (*ref_or)->params() = wide;
  auto ref_loss = (*ref_or)->forward(tokens, targets);
  if (!ref_loss.ok()) return fail(ref_loss.status().to_string());
  if (!(std::abs(loss - *ref_loss) <= 1e-12 * std::abs(*ref_loss)))
    return fail(fmt::format("the logits' loss {:.17g} differs from GptReference's {:.17g}", loss, *ref_loss));

  nlohmann::json meta = {{"batch", B}, {"seq", T}, {"vocab", c.vocab_size}, {"dtype", dtype_arg}, {"loss", loss}};
  std::ofstream(out / "meta.json") << meta.dump(2) << "\n";
  if (!write_raw(out / "tokens.i32", tokens) || !write_raw(out / "logits.f64", logits))
    return fail("cannot write into " + out.string());
  std::printf("exported %s (%s) to %s; reference loss %.6f\n", c.describe().c_str(), dtype_arg.c_str(),
              (out / "model").string().c_str(), loss);
  return 0;
}
