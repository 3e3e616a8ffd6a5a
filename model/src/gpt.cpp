#include "strata/model/gpt.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "strata/model/rng.h"

namespace strata::model {
namespace {

void add_tensor(LayerSpec& layer, DType dtype, std::string name, std::vector<int64_t> shape) {
  ParamTensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dtype = dtype;
  t.offset_elements = layer.param_count;
  t.offset_bytes = layer.param_bytes;
  layer.param_count += static_cast<size_t>(t.numel());
  layer.param_bytes += static_cast<size_t>(t.numel()) * dtype_size(dtype);
  layer.params.push_back(std::move(t));
}

enum class InitKind { kNormal, kNormalResidual, kZero, kOne };

InitKind init_kind(const std::string& name) {
  auto ends_with = [&](std::string_view s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (ends_with("attn.proj.weight") || ends_with("mlp.proj.weight")) return InitKind::kNormalResidual;
  if (ends_with("ln1.weight") || ends_with("ln2.weight") || ends_with("lnf.weight")) return InitKind::kOne;
  if (ends_with(".bias")) return InitKind::kZero;
  return InitKind::kNormal;
}

}  // namespace

GptModel::GptModel(const GptConfig& config, uint64_t seed) : config_(config), seed_(seed) {
  const DType dt = config.param_dtype;
  const int64_t C = config.n_embd;
  LayerSpec emb;
  emb.name = "embedding";
  add_tensor(emb, dt, "wte", {config.vocab_size, C});
  add_tensor(emb, dt, "wpe", {config.max_seq_len, C});
  layers_.push_back(std::move(emb));
  for (int l = 0; l < config.n_layer; ++l) {
    LayerSpec b;
    b.name = fmt::format("h{}", l);
    const std::string p = b.name + ".";
    add_tensor(b, dt, p + "ln1.weight", {C});
    add_tensor(b, dt, p + "ln1.bias", {C});
    add_tensor(b, dt, p + "attn.qkv.weight", {3 * C, C});
    add_tensor(b, dt, p + "attn.qkv.bias", {3 * C});
    add_tensor(b, dt, p + "attn.proj.weight", {C, C});
    add_tensor(b, dt, p + "attn.proj.bias", {C});
    add_tensor(b, dt, p + "ln2.weight", {C});
    add_tensor(b, dt, p + "ln2.bias", {C});
    add_tensor(b, dt, p + "mlp.fc.weight", {4 * C, C});
    add_tensor(b, dt, p + "mlp.fc.bias", {4 * C});
    add_tensor(b, dt, p + "mlp.proj.weight", {C, 4 * C});
    add_tensor(b, dt, p + "mlp.proj.bias", {C});
    layers_.push_back(std::move(b));
  }
  LayerSpec fin;
  fin.name = "final_norm";
  add_tensor(fin, dt, "lnf.weight", {C});
  add_tensor(fin, dt, "lnf.bias", {C});
  layers_.push_back(std::move(fin));
}

Result<std::unique_ptr<GptModel>> GptModel::create(const GptConfig& config, uint64_t seed) {
  STRATA_RETURN_IF_ERROR(config.validate());
  return std::unique_ptr<GptModel>(new GptModel(config, seed));
}

template <typename T>
void GptModel::init_values(size_t layer_index, std::span<T> out) const {
  STRATA_CHECK(layer_index < layers_.size(), "init_values: layer index out of range");
  const LayerSpec& layer = layers_[layer_index];
  STRATA_CHECK(out.size() == layer.param_count, "init_values: output size != layer param_count");
  Rng rng(seed_, layer_index);
  const double residual_std = 0.02 / std::sqrt(2.0 * config_.n_layer);
  for (const ParamTensorSpec& t : layer.params) {
    T* dst = out.data() + t.offset_elements;
    const size_t n = static_cast<size_t>(t.numel());
    switch (init_kind(t.name)) {
      case InitKind::kZero: std::fill(dst, dst + n, T(0)); break;
      case InitKind::kOne: std::fill(dst, dst + n, T(1)); break;
      case InitKind::kNormal:
        for (size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(0.02 * rng.normal()));
        break;
      case InitKind::kNormalResidual:
        for (size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(residual_std * rng.normal()));
        break;
    }
  }
}

void GptModel::init_layer_values(size_t layer_index, std::span<float> out) const {
  init_values(layer_index, out);
}
void GptModel::init_layer_values(size_t layer_index, std::span<double> out) const {
  init_values(layer_index, out);
}

Status GptModel::init_layer_fp32(size_t layer_index, std::span<float> values) const {
  if (layer_index >= layers_.size())
    return InvalidArgument(fmt::format("init_layer_fp32: layer index {} out of range (model has {} layers)",
                                       layer_index, layers_.size()));
  if (values.size() != layers_[layer_index].param_count)
    return InvalidArgument(fmt::format("init_layer_fp32: layer '{}' has {} elements, got {}",
                                       layers_[layer_index].name, layers_[layer_index].param_count, values.size()));
  init_values(layer_index, values);
  return Status::Ok();
}

Status GptModel::init_layer(size_t layer_index, std::span<std::byte> params) const {
  if (layer_index >= layers_.size())
    return InvalidArgument(fmt::format("init_layer: layer index {} out of range (model has {} layers)",
                                       layer_index, layers_.size()));
  const LayerSpec& layer = layers_[layer_index];
  if (params.size() != layer.param_bytes)
    return InvalidArgument(fmt::format("init_layer: layer '{}' needs {} bytes, got {}", layer.name,
                                       layer.param_bytes, params.size()));
  std::vector<float> values(layer.param_count);
  init_values(layer_index, std::span<float>(values));
  for (const ParamTensorSpec& t : layer.params) {
    const float* src = values.data() + t.offset_elements;
    std::byte* dst = params.data() + t.offset_bytes;
    const size_t n = static_cast<size_t>(t.numel());
    switch (t.dtype) {
      case DType::kF32: std::memcpy(dst, src, n * sizeof(float)); break;
      case DType::kBF16:
        for (size_t i = 0; i < n; ++i) {
          const uint16_t bits = fp32_to_bf16_bits(src[i]);
          std::memcpy(dst + 2 * i, &bits, 2);
        }
        break;
      case DType::kF16:
        for (size_t i = 0; i < n; ++i) {
          const uint16_t bits = fp32_to_fp16_bits(src[i]);
          std::memcpy(dst + 2 * i, &bits, 2);
        }
        break;
      case DType::kF64:
      case DType::kI64:
        return InvalidArgument(fmt::format("init_layer: tensor '{}' has dtype {}; parameters are fp32, bf16 or fp16",
                                           t.name, dtype_name(t.dtype)));
    }
  }
  return Status::Ok();
}

}  // namespace strata::model
