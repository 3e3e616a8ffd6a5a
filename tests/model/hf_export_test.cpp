// Hugging Face GPT-2 export: the safetensors file read back by a parser of
// its own (names, shapes, dtypes, offsets, every value and where the Conv1D
// transposition puts it), bf16 rounding, config.json, and bad inputs. The
// PyTorch forward over the exported names is hf_export_check.py's.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "strata/model/gpt.h"
#include "strata/model/hf_export.h"
#include "strata/model/rng.h"

namespace strata::model {
namespace {
namespace fs = std::filesystem;

GptConfig small_config() {
  GptConfig c;
  c.preset = "export-test";
  c.vocab_size = 260;  // not a multiple of anything else, so swapped dims show
  c.max_seq_len = 12;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 16;
  return c;
}

// A fresh folder under the test temp dir, removed at the end.
struct TempDir {
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "strata-hf-export-XXXXXX").string();
    STRATA_CHECK(mkdtemp(tmpl.data()) != nullptr, "mkdtemp");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path, ec);
  }
  fs::path path;
};

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The safetensors layout, parsed without trusting the writer.
struct Safetensors {
  nlohmann::ordered_json header;
  uint64_t header_bytes = 0;
  std::string data;  // everything after the header
};

Safetensors parse_safetensors(const fs::path& p) {
  const std::string file = read_all(p);
  Safetensors st;
  EXPECT_GE(file.size(), 8u);
  if (file.size() < 8) return st;
  for (int i = 7; i >= 0; --i) st.header_bytes = (st.header_bytes << 8) | static_cast<uint8_t>(file[i]);
  EXPECT_LE(8 + st.header_bytes, file.size());
  st.header = nlohmann::ordered_json::parse(file.substr(8, st.header_bytes));
  st.data = file.substr(8 + st.header_bytes);
  return st;
}

std::vector<std::string> expected_names(int n_layer) {
  std::vector<std::string> names = {"transformer.wte.weight", "transformer.wpe.weight"};
  for (int l = 0; l < n_layer; ++l)
    for (const char* s : {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                          "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                          "mlp.c_proj.weight", "mlp.c_proj.bias"})
      names.push_back("transformer.h." + std::to_string(l) + "." + s);
  names.push_back("transformer.ln_f.weight");
  names.push_back("transformer.ln_f.bias");
  return names;
}

// Hugging Face shape of each tensor, written out by hand from GPT-2's module
// definitions (Conv1D weight [in, out]).
std::vector<int64_t> expected_shape(const std::string& name, const GptConfig& c) {
  const int64_t C = c.n_embd;
  auto ends = [&](std::string_view s) { return name.size() >= s.size() && name.ends_with(s); };
  if (name == "transformer.wte.weight") return {c.vocab_size, C};
  if (name == "transformer.wpe.weight") return {c.max_seq_len, C};
  if (ends("c_attn.weight")) return {C, 3 * C};
  if (ends("c_attn.bias")) return {3 * C};
  if (ends("attn.c_proj.weight")) return {C, C};
  if (ends("c_fc.weight")) return {C, 4 * C};
  if (ends("c_fc.bias")) return {4 * C};
  if (ends("mlp.c_proj.weight")) return {4 * C, C};
  return {C};  // LayerNorm weights and biases, the projections' biases
}

// Reads every layer through the model's own values.
HfLayerReader init_reader(const GptModel& model) {
  return [&model](size_t layer, std::span<float> out) {
    model.init_layer_values(layer, out);
    return Status::Ok();
  };
}

// Every element unique and exact in fp32: (layer + 1) * 2^20 + index.
float unique_value(size_t layer, size_t index) { return static_cast<float>((layer + 1) * (size_t{1} << 20) + index); }

HfLayerReader unique_reader() {
  return [](size_t layer, std::span<float> out) {
    for (size_t i = 0; i < out.size(); ++i) out[i] = unique_value(layer, i);
    return Status::Ok();
  };
}

float f32_at(const std::string& data, uint64_t byte_offset) {
  float v;
  std::memcpy(&v, data.data() + byte_offset, 4);
  return v;
}
uint16_t u16_at(const std::string& data, uint64_t byte_offset) {
  uint16_t v;
  std::memcpy(&v, data.data() + byte_offset, 2);
  return v;
}

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Header: the expected names in order (after __metadata__), dtypes, shapes,
// offsets contiguous from 0 and covering the data exactly.
void check_header(const Safetensors& st, const GptConfig& c, const std::string& dtype) {
  EXPECT_EQ(st.header_bytes % 8, 0u) << "the data should start 8-byte aligned";
  ASSERT_TRUE(st.header.contains("__metadata__"));
  EXPECT_EQ(st.header["__metadata__"]["format"], "pt");
  const std::vector<std::string> names = expected_names(c.n_layer);
  std::vector<std::string> got;
  for (const auto& [key, value] : st.header.items())
    if (key != "__metadata__") got.push_back(key);
  ASSERT_EQ(got, names);
  EXPECT_FALSE(st.header.contains("lm_head.weight")) << "the head is tied to wte and must not be stored";
  uint64_t offset = 0;
  const uint64_t elem = dtype == "BF16" ? 2 : 4;
  for (const std::string& name : names) {
    const auto& t = st.header[name];
    EXPECT_EQ(t["dtype"], dtype) << name;
    const auto shape = t["shape"].get<std::vector<int64_t>>();
    EXPECT_EQ(shape, expected_shape(name, c)) << name;
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    const auto offsets = t["data_offsets"].get<std::vector<uint64_t>>();
    ASSERT_EQ(offsets.size(), 2u) << name;
    EXPECT_EQ(offsets[0], offset) << name;
    EXPECT_EQ(offsets[1], offset + n * elem) << name;
    offset = offsets[1];
  }
  EXPECT_EQ(offset, st.data.size());
  EXPECT_EQ(offset, static_cast<uint64_t>(c.param_count()) * elem) << "every parameter once, the head not at all";
}

// The Strata (layer, element index) that file element `i` of `name` holds.
std::pair<size_t, size_t> strata_source(const GptModel& model, const std::vector<HfTensorMapping>& map,
                                        const std::string& name, uint64_t i) {
  for (const HfTensorMapping& m : map) {
    if (m.hf_name != name) continue;
    const ParamTensorSpec& spec = model.layers()[m.layer].params[m.tensor];
    if (!m.transposed) return {m.layer, spec.offset_elements + i};
    // File [in, out] element (r, c) is Strata's [out, in] element (c, r).
    const uint64_t in = static_cast<uint64_t>(spec.shape[1]), out = static_cast<uint64_t>(spec.shape[0]);
    const uint64_t r = i / out, col = i % out;
    return {m.layer, spec.offset_elements + col * in + r};
  }
  ADD_FAILURE() << "no mapping for " << name;
  return {0, 0};
}

TEST(HfExport, InitValuesRoundTripExactlyInFp32) {
  TempDir dir;
  const GptConfig c = small_config();
  auto model = GptModel::create(c, 7).value();
  const fs::path out = dir.path / "hf";
  ASSERT_TRUE(export_hf_gpt2(c, out, init_reader(*model), {}).ok());
  EXPECT_EQ(listing(out), (std::vector<std::string>{"config.json", "model.safetensors"}));
  const Safetensors st = parse_safetensors(out / "model.safetensors");
  check_header(st, c, "F32");

  // Every value, read back through HF's own layout, equals the model's.
  std::vector<std::vector<float>> values;
  for (size_t l = 0; l < model->layers().size(); ++l) {
    values.emplace_back(model->layers()[l].param_count);
    model->init_layer_values(l, std::span<float>(values.back()));
  }
  const auto map = hf_gpt2_tensor_map(c).value();
  size_t mismatches = 0;
  for (const auto& [name, t] : st.header.items()) {
    if (name == "__metadata__") continue;
    const auto offsets = t["data_offsets"].get<std::vector<uint64_t>>();
    for (uint64_t i = 0; i < (offsets[1] - offsets[0]) / 4; ++i) {
      const auto [layer, index] = strata_source(*model, map, name, i);
      if (f32_at(st.data, offsets[0] + 4 * i) != values[layer][index]) ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(HfExport, Conv1DWeightsAreTransposedAndEveryElementLandsOnce) {
  TempDir dir;
  const GptConfig c = small_config();
  auto model = GptModel::create(c, 7).value();
  ASSERT_TRUE(export_hf_gpt2(c, dir.path, unique_reader(), {}).ok());
  const Safetensors st = parse_safetensors(dir.path / "model.safetensors");
  check_header(st, c, "F32");
  const int64_t C = c.n_embd;
  // Spot checks written from first principles: HF c_attn.weight[i][o] is
  // Strata qkv.weight[o][i], i.e. element o * C + i of block 0's qkv tensor.
  const auto& attn = st.header["transformer.h.0.attn.c_attn.weight"];
  const uint64_t base = attn["data_offsets"][0].get<uint64_t>();
  const size_t qkv_offset = model->layers()[1].params[kQkvW].offset_elements;
  for (int64_t i : {int64_t{0}, int64_t{3}, C - 1})
    for (int64_t o : {int64_t{0}, int64_t{5}, C, 2 * C + 1, 3 * C - 1})
      EXPECT_EQ(f32_at(st.data, base + 4 * static_cast<uint64_t>(i * 3 * C + o)),
                unique_value(1, qkv_offset + static_cast<size_t>(o * C + i)))
          << "c_attn.weight[" << i << "][" << o << "]";
  // mlp.c_proj: Strata [C, 4C] -> HF [4C, C].
  const auto& proj = st.header["transformer.h.1.mlp.c_proj.weight"];
  const uint64_t pbase = proj["data_offsets"][0].get<uint64_t>();
  const size_t proj_offset = model->layers()[2].params[kFcProjW].offset_elements;
  EXPECT_EQ(f32_at(st.data, pbase + 4 * static_cast<uint64_t>(7 * C + 2)),
            unique_value(2, proj_offset + static_cast<size_t>(2 * 4 * C + 7)));
  // Every Strata element appears exactly once in the file.
  std::map<float, int> seen;
  for (uint64_t off = 0; off < st.data.size(); off += 4) ++seen[f32_at(st.data, off)];
  EXPECT_EQ(seen.size(), static_cast<size_t>(c.param_count()));
  for (size_t l = 0; l < model->layers().size(); ++l)
    for (size_t i = 0; i < model->layers()[l].param_count; i += 97) EXPECT_EQ(seen[unique_value(l, i)], 1);
}

TEST(HfExport, ConfigJsonDescribesGpt2WithStrataShapes) {
  TempDir dir;
  const GptConfig c = small_config();
  auto model = GptModel::create(c, 7).value();
  ASSERT_TRUE(export_hf_gpt2(c, dir.path, init_reader(*model), {.dtype = DType::kBF16}).ok());
  const auto j = nlohmann::json::parse(read_all(dir.path / "config.json"));
  EXPECT_EQ(j["model_type"], "gpt2");
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"GPT2LMHeadModel"}));
  EXPECT_EQ(j["vocab_size"], c.vocab_size);
  EXPECT_EQ(j["n_positions"], c.max_seq_len);
  EXPECT_EQ(j["n_ctx"], c.max_seq_len);
  EXPECT_EQ(j["n_embd"], c.n_embd);
  EXPECT_EQ(j["n_layer"], c.n_layer);
  EXPECT_EQ(j["n_head"], c.n_head);
  EXPECT_TRUE(j["n_inner"].is_null());
  EXPECT_EQ(j["activation_function"], "gelu_new");
  EXPECT_DOUBLE_EQ(j["layer_norm_epsilon"].get<double>(), 1e-5);
  EXPECT_EQ(j["tie_word_embeddings"], true);
  EXPECT_EQ(j["scale_attn_weights"], true);
  EXPECT_EQ(j["scale_attn_by_inverse_layer_idx"], false);
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  for (const char* p : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) EXPECT_EQ(j[p].get<double>(), 0.0) << p;
  EXPECT_TRUE(j["bos_token_id"].is_null());
  EXPECT_TRUE(j["eos_token_id"].is_null());
}

TEST(HfExport, Bf16RoundsToNearestEven) {
  TempDir dir;
  const GptConfig c = small_config();
  // wte's first elements get values whose bf16 rounding is known by hand.
  const std::vector<std::pair<float, uint16_t>> cases = {
      {1.0f, 0x3F80},
      {1.00390625f, 0x3F80},               // 1 + 2^-8: halfway, to even (down)
      {1.01171875f, 0x3F82},               // 1 + 3 * 2^-8: halfway, to even (up)
      {1.00390625f + 0x1p-20f, 0x3F81},    // just above halfway: up
      {-2.0f, 0xC000},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {3.0e38f, 0x7F62},                   // large but finite: rounds up, stays finite
      {1e-40f, 0x0001},                    // a subnormal keeps its top bits
  };
  auto reader = [&](size_t layer, std::span<float> out) {
    for (size_t i = 0; i < out.size(); ++i) out[i] = std::ldexp(static_cast<float>(i % 1000) - 500.0f, -9);
    if (layer == 0)
      for (size_t i = 0; i < cases.size(); ++i) out[i] = cases[i].first;
    return Status::Ok();
  };
  ASSERT_TRUE(export_hf_gpt2(c, dir.path, reader, {.dtype = DType::kBF16}).ok());
  const Safetensors st = parse_safetensors(dir.path / "model.safetensors");
  check_header(st, c, "BF16");
  for (size_t i = 0; i < cases.size(); ++i)
    EXPECT_EQ(u16_at(st.data, 2 * i), cases[i].second) << "value " << cases[i].first;
  // Elsewhere every value is within half a bf16 ulp: 2^-8 relative (bf16
  // keeps 8 significant bits).
  const uint64_t lnf = st.header["transformer.ln_f.weight"]["data_offsets"][0].get<uint64_t>();
  for (uint64_t i = 0; i < static_cast<uint64_t>(c.n_embd); ++i) {
    const float want = std::ldexp(static_cast<float>(i % 1000) - 500.0f, -9);
    const float got = bf16_bits_to_fp32(u16_at(st.data, lnf + 2 * i));
    EXPECT_LE(std::abs(got - want), std::abs(want) * 0x1p-8f) << i;
  }
}

TEST(HfExport, ReadsEachLayerOnceInOrderWithItsSize) {
  TempDir dir;
  const GptConfig c = small_config();
  auto model = GptModel::create(c, 7).value();
  std::vector<std::pair<size_t, size_t>> calls;
  auto reader = [&](size_t layer, std::span<float> out) {
    calls.emplace_back(layer, out.size());
    model->init_layer_values(layer, out);
    return Status::Ok();
  };
  ASSERT_TRUE(export_hf_gpt2(c, dir.path, reader, {}).ok());
  ASSERT_EQ(calls.size(), model->layers().size());
  for (size_t l = 0; l < calls.size(); ++l) {
    EXPECT_EQ(calls[l].first, l);
    EXPECT_EQ(calls[l].second, model->layers()[l].param_count);
  }
}

TEST(HfExport, RejectsDtypesOtherThanFp32AndBf16BeforeTouchingTheDisk) {
  TempDir dir;
  const GptConfig c = small_config();
  for (DType bad : {DType::kF16, DType::kF64, DType::kI64}) {
    const Status st = export_hf_gpt2(c, dir.path / "out", unique_reader(), {.dtype = bad});
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find(std::string(dtype_name(bad))), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("fp32 or bf16"), std::string::npos) << st.message();
  }
  EXPECT_FALSE(fs::exists(dir.path / "out"));
}

TEST(HfExport, RejectsAnInvalidModelConfig) {
  TempDir dir;
  GptConfig c = small_config();
  c.n_head = 5;  // 16 % 5 != 0
  const Status st = export_hf_gpt2(c, dir.path, unique_reader(), {});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("n_head"), std::string::npos) << st.message();
  EXPECT_TRUE(listing(dir.path).empty());
}

TEST(HfExport, RefusesToReplaceExistingFilesUnlessOverwrite) {
  TempDir dir;
  const GptConfig c = small_config();
  auto model = GptModel::create(c, 7).value();
  ASSERT_TRUE(export_hf_gpt2(c, dir.path, init_reader(*model), {}).ok());
  const std::string first = read_all(dir.path / "model.safetensors");

  Status st = export_hf_gpt2(c, dir.path, unique_reader(), {});
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists) << st.to_string();
  EXPECT_NE(st.message().find("model.safetensors"), std::string::npos) << st.message();
  EXPECT_EQ(read_all(dir.path / "model.safetensors"), first);
  EXPECT_EQ(listing(dir.path), (std::vector<std::string>{"config.json", "model.safetensors"}));

  // config.json alone is enough to refuse: it would describe another model.
  fs::remove(dir.path / "model.safetensors");
  st = export_hf_gpt2(c, dir.path, unique_reader(), {});
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists) << st.to_string();
  EXPECT_NE(st.message().find("config.json"), std::string::npos) << st.message();
  EXPECT_EQ(listing(dir.path), (std::vector<std::string>{"config.json"}));

  ASSERT_TRUE(export_hf_gpt2(c, dir.path, unique_reader(), {.overwrite = true}).ok());
  const Safetensors after = parse_safetensors(dir.path / "model.safetensors");
  EXPECT_EQ(f32_at(after.data, 0), unique_value(0, 0));
  EXPECT_EQ(listing(dir.path), (std::vector<std::string>{"config.json", "model.safetensors"}));
}

TEST(HfExport, AFailingReaderLeavesNoModelBehindAndKeepsTheOldOne) {
  TempDir dir;
  const GptConfig c = small_config();
  auto failing = [](size_t layer, std::span<float> out) -> Status {
    if (layer == 2) return DataLoss("checksum mismatch in shard 'rank1/model.bin' at offset 4096");
    std::fill(out.begin(), out.end(), 1.0f);
    return Status::Ok();
  };
  Status st = export_hf_gpt2(c, dir.path / "fresh", failing, {});
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.to_string();
  EXPECT_NE(st.message().find("layer 2 ('h1'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("rank1/model.bin"), std::string::npos) << st.message();
  EXPECT_TRUE(listing(dir.path / "fresh").empty()) << "no model, no config, no temporary";

  // With overwrite, a failed export leaves the previous export as it was.
  auto model = GptModel::create(c, 7).value();
  ASSERT_TRUE(export_hf_gpt2(c, dir.path / "old", init_reader(*model), {}).ok());
  const std::string old_model = read_all(dir.path / "old" / "model.safetensors");
  const std::string old_config = read_all(dir.path / "old" / "config.json");
  st = export_hf_gpt2(c, dir.path / "old", failing, {.overwrite = true});
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.to_string();
  EXPECT_EQ(read_all(dir.path / "old" / "model.safetensors"), old_model);
  EXPECT_EQ(read_all(dir.path / "old" / "config.json"), old_config);
  EXPECT_EQ(listing(dir.path / "old"), (std::vector<std::string>{"config.json", "model.safetensors"}));
}

TEST(HfExport, AFailedWriteNamesTheFileAndOffsetAndLeavesNothing) {
  TempDir dir;
  const GptConfig c = small_config();
  // RLIMIT_FSIZE makes write() fail with EFBIG past 16 KiB (the file is
  // ~44 KiB), as a full disk would, without needing one.
  struct rlimit old_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old_limit;
  small.rlim_cur = 16 << 10;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const Status st = export_hf_gpt2(c, dir.path, unique_reader(), {});
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old_limit), 0);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("model.safetensors"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("at offset 16384"), std::string::npos) << st.message();
  EXPECT_TRUE(listing(dir.path).empty()) << "the temporary must be removed";
}

TEST(HfExport, OutputFolderRules) {
  TempDir dir;
  const GptConfig c = small_config();
  // A file where the folder should be.
  { std::ofstream(dir.path / "afile") << "x"; }
  Status st = export_hf_gpt2(c, dir.path / "afile", unique_reader(), {});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("afile"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("not a folder"), std::string::npos) << st.message();
  EXPECT_EQ(read_all(dir.path / "afile"), "x");

  // Only one level is created.
  st = export_hf_gpt2(c, dir.path / "missing" / "out", unique_reader(), {});
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.to_string();
  EXPECT_NE(st.message().find("missing"), std::string::npos) << st.message();
  EXPECT_FALSE(fs::exists(dir.path / "missing"));

  // A trailing separator names the same folder, created here.
  ASSERT_TRUE(export_hf_gpt2(c, (dir.path / "new").string() + "/", unique_reader(), {}).ok());
  EXPECT_EQ(listing(dir.path / "new"), (std::vector<std::string>{"config.json", "model.safetensors"}));

  // A folder where model.safetensors should be: never replaced, even with overwrite.
  fs::create_directories(dir.path / "clash" / "model.safetensors");
  st = export_hf_gpt2(c, dir.path / "clash", unique_reader(), {.overwrite = true});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("not a regular file"), std::string::npos) << st.message();
  EXPECT_TRUE(fs::is_directory(dir.path / "clash" / "model.safetensors"));

  // A read-only folder: an error naming it, nothing left behind (root
  // ignores permissions, so only checked when they bind).
  fs::create_directory(dir.path / "ro");
  fs::permissions(dir.path / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  if (::access((dir.path / "ro").c_str(), W_OK) != 0) {
    st = export_hf_gpt2(c, dir.path / "ro", unique_reader(), {});
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("ro/.model.safetensors.tmp-"), std::string::npos) << st.message();
    EXPECT_TRUE(listing(dir.path / "ro").empty());
  }
  fs::permissions(dir.path / "ro", fs::perms::owner_all);
}

TEST(HfExport, TensorMapCoversEveryParameterOnce) {
  const GptConfig c = small_config();
  const auto map = hf_gpt2_tensor_map(c).value();
  auto model = GptModel::create(c, 1).value();
  std::map<std::pair<size_t, size_t>, int> used;
  for (const HfTensorMapping& m : map) ++used[{m.layer, m.tensor}];
  size_t tensors = 0;
  for (size_t l = 0; l < model->layers().size(); ++l)
    for (size_t t = 0; t < model->layers()[l].params.size(); ++t, ++tensors) EXPECT_EQ((used[{l, t}]), 1);
  EXPECT_EQ(map.size(), tensors);
  EXPECT_FALSE(hf_gpt2_tensor_map(GptConfig{.n_head = 3}).ok());
}

}  // namespace
}  // namespace strata::model
