#pragma once
// Export of the reference GPT as a Hugging Face GPT-2 checkpoint: a folder
// with model.safetensors and config.json that
// `transformers.GPT2LMHeadModel.from_pretrained(folder)` loads.
//
// The values come from a callback, one Strata layer at a time (a checkpoint
// reader, a trained model's provider, init values in tests), and go to the
// file as they come: at most one layer's fp32 values and one tensor's
// converted bytes are in memory at once, whatever the model's size.
//
// Tensor names (Strata -> Hugging Face; docs/export.md has the full table and
// the architecture check):
//   wte, wpe                      -> transformer.wte.weight, transformer.wpe.weight
//   h<i>.ln1/ln2.{weight,bias}    -> transformer.h.<i>.ln_1/ln_2.{weight,bias}
//   h<i>.attn.qkv/proj, mlp.fc/proj -> ...attn.c_attn/c_proj, mlp.c_fc/c_proj, weights
//                                    TRANSPOSED: HF's Conv1D stores [in, out],
//                                    Strata's linear layers [out, in]
//   lnf.{weight,bias}             -> transformer.ln_f.{weight,bias}
// The LM head is tied to wte and not stored (tie_word_embeddings: true).

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/model/gpt_config.h"

namespace strata::model {

struct HfExportOptions {
  DType dtype = DType::kF32;  // of the stored tensors: kF32 or kBF16 (round to nearest even)
  bool overwrite = false;     // replace an existing model.safetensors / config.json in `out`
};

// Fills `out` with Strata layer `layer`'s values in the model's flat layout
// (GptModel::layers()[layer]: tensors at offset_elements, out.size() ==
// param_count), as fp32.
using HfLayerReader = std::function<Status(size_t layer, std::span<float> out)>;

// One tensor of the exported file, in file order.
struct HfTensorMapping {
  std::string hf_name;          // "transformer.h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;   // as stored in the file (transposed for Conv1D weights)
  size_t layer = 0;             // Strata layer index
  size_t tensor = 0;            // index into the layer's LayerSpec::params
  bool transposed = false;      // stored as the transpose of Strata's [out, in]
};

// Every tensor of the export of `config`, in the order they are stored.
// Fails if the config does not validate.
Result<std::vector<HfTensorMapping>> hf_gpt2_tensor_map(const GptConfig& config);

// The text of config.json for `config` with tensors stored as `dtype`.
Result<std::string> hf_gpt2_config_json(const GptConfig& config, DType dtype);

// Writes OUT/model.safetensors and OUT/config.json. `out` must be an
// existing directory or one that can be created (its parent exists). Refuses
// (AlreadyExists) to replace either file unless options.overwrite. Both files
// are written under temporary names in `out`, fsync'd, then renamed, and the
// directory is fsync'd: an error or a crash never leaves a half-written
// model.safetensors or config.json under the final names (a crash may leave a
// ".*.tmp-*" file behind). read_layer is called once per layer in order
// 0..L+1; its error is returned with the layer named.
Status export_hf_gpt2(const GptConfig& config, const std::filesystem::path& out, const HfLayerReader& read_layer,
                      const HfExportOptions& options = {});

}  // namespace strata::model
