#include "strata/model/hf_export.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <system_error>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "strata/core/durable_file.h"
#include "strata/model/gpt.h"

// Note [Streaming export]
// The safetensors header holds every tensor's dtype, shape and byte range,
// all of which follow from the config, so the header is written first and
// the tensors after it in header order, each as soon as its Strata layer has
// been read. Strata's layer order (embedding, blocks, final norm) is already
// Hugging Face's tensor order, so one pass over the layers suffices and
// memory is one layer's fp32 values plus one tensor's converted bytes.
//
// Note [Never a half-written file]
// Both files are written under ".<name>.tmp-XXXXXX" in the output folder (so
// the rename stays on one file system), fsync'd, closed (close errors are
// write errors on some file systems), renamed over the final names, and the
// folder is fsync'd so the renames are durable. Without `overwrite` the
// renames use RENAME_NOREPLACE, so a file that appeared after the up-front
// check is still never replaced. Any failure before the renames unlinks the
// temporaries (RAII); a crash can leave only a temporary behind.

namespace strata::model {
namespace fs = std::filesystem;
namespace {

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kConfigFile = "config.json";

// Hugging Face names of a block's tensors, by BlockTensor index, and
// whether the file stores the transpose (HF's Conv1D keeps [in, out]).
struct BlockName {
  const char* strata_suffix;
  const char* hf_suffix;
  bool transposed;
};
constexpr BlockName kBlockNames[kBlockTensorCount] = {
    {"ln1.weight", "ln_1.weight", false},       {"ln1.bias", "ln_1.bias", false},
    {"attn.qkv.weight", "attn.c_attn.weight", true}, {"attn.qkv.bias", "attn.c_attn.bias", false},
    {"attn.proj.weight", "attn.c_proj.weight", true}, {"attn.proj.bias", "attn.c_proj.bias", false},
    {"ln2.weight", "ln_2.weight", false},       {"ln2.bias", "ln_2.bias", false},
    {"mlp.fc.weight", "mlp.c_fc.weight", true}, {"mlp.fc.bias", "mlp.c_fc.bias", false},
    {"mlp.proj.weight", "mlp.c_proj.weight", true}, {"mlp.proj.bias", "mlp.c_proj.bias", false},
};

Status check_dtype(DType dtype) {
  if (dtype == DType::kF32 || dtype == DType::kBF16) return Status::Ok();
  return InvalidArgument(fmt::format("hf export: dtype {} is not supported; export as fp32 or bf16 (--dtype fp32|bf16)",
                                     dtype_name(dtype)));
}

const char* safetensors_dtype(DType dtype) { return dtype == DType::kBF16 ? "BF16" : "F32"; }

std::vector<HfTensorMapping> tensor_map(const GptModel& model) {
  std::vector<HfTensorMapping> map;
  auto add = [&](size_t layer, size_t tensor, std::string hf_name, bool transposed) {
    const ParamTensorSpec& spec = model.layers()[layer].params[tensor];
    HfTensorMapping m;
    m.hf_name = std::move(hf_name);
    m.shape = spec.shape;
    if (transposed) {
      STRATA_CHECK(m.shape.size() == 2, "hf export: a transposed tensor must be a matrix");
      std::swap(m.shape[0], m.shape[1]);
    }
    m.layer = layer;
    m.tensor = tensor;
    m.transposed = transposed;
    map.push_back(std::move(m));
  };
  const size_t emb = model.embedding_layer();
  STRATA_CHECK(model.layers()[emb].params[kWte].name == "wte" && model.layers()[emb].params[kWpe].name == "wpe",
               "hf export: the embedding layer's layout changed; update the name map");
  add(emb, kWte, "transformer.wte.weight", false);
  add(emb, kWpe, "transformer.wpe.weight", false);
  for (int l = 0; l < model.config().n_layer; ++l) {
    const size_t li = model.block_layer(l);
    const LayerSpec& layer = model.layers()[li];
    STRATA_CHECK(layer.params.size() == kBlockTensorCount, "hf export: a block's tensor count changed");
    for (size_t t = 0; t < kBlockTensorCount; ++t) {
      const BlockName& n = kBlockNames[t];
      STRATA_CHECK(layer.params[t].name == fmt::format("{}.{}", layer.name, n.strata_suffix),
                   "hf export: a block's tensor layout changed; update the name map");
      add(li, t, fmt::format("transformer.h.{}.{}", l, n.hf_suffix), n.transposed);
    }
  }
  const size_t fin = model.final_layer();
  STRATA_CHECK(model.layers()[fin].params[kLnfW].name == "lnf.weight" &&
                   model.layers()[fin].params[kLnfB].name == "lnf.bias",
               "hf export: the final layer's layout changed; update the name map");
  add(fin, kLnfW, "transformer.ln_f.weight", false);
  add(fin, kLnfB, "transformer.ln_f.bias", false);
  return map;
}

// Header JSON, padded with spaces to a multiple of 8 bytes (as the
// safetensors writer does, so the data starts 8-byte aligned).
std::string safetensors_header(const std::vector<HfTensorMapping>& map, DType dtype, uint64_t* data_bytes) {
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const HfTensorMapping& m : map) {
    uint64_t n = 1;
    for (int64_t d : m.shape) n *= static_cast<uint64_t>(d);
    const uint64_t bytes = n * dtype_size(dtype);
    header[m.hf_name] = {{"dtype", safetensors_dtype(dtype)}, {"shape", m.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  *data_bytes = offset;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

// A file being written under a temporary name in its final folder; unlinked
// unless committed.
class TempFile {
 public:
  static Result<std::unique_ptr<TempFile>> create(const fs::path& dir, std::string_view final_name) {
    std::string tmpl = (dir / fmt::format(".{}.tmp-XXXXXX", final_name)).string();
    const int fd = mkostemp(tmpl.data(), O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, fmt::format("hf export: creating a temporary file '{}'", tmpl));
    auto file = std::unique_ptr<TempFile>(new TempFile(fd, fs::path(tmpl), dir / final_name));
    // mkostemp creates 0600; an exported model is for others to read.
    if (::fchmod(fd, 0644) != 0) return ErrnoStatus(errno, fmt::format("hf export: chmod of '{}'", tmpl));
    return file;
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }

  const fs::path& final_path() const { return final_; }
  uint64_t offset() const { return offset_; }

  Status write(const void* data, size_t bytes) {
    const auto* p = static_cast<const std::byte*>(data);
    while (bytes > 0) {
      const ssize_t n = ::write(fd_, p, std::min<size_t>(bytes, size_t{1} << 30));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, fmt::format("hf export: writing '{}' (as '{}') at offset {}", final_.string(),
                                              tmp_.string(), offset_));
      }
      p += n;
      bytes -= static_cast<size_t>(n);
      offset_ += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

  // fsync and close: after this the data is durable under the temporary name.
  Status finish() {
    if (::fsync(fd_) != 0) return ErrnoStatus(errno, fmt::format("hf export: fsync of '{}'", tmp_.string()));
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) return ErrnoStatus(errno, fmt::format("hf export: close of '{}'", tmp_.string()));
    return Status::Ok();
  }

  // Renames over the final name (never replacing one unless `overwrite`).
  Status commit(bool overwrite) {
    STRATA_CHECK(fd_ < 0, "TempFile::commit before finish");
    int rc = ::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, final_.c_str(), overwrite ? 0 : RENAME_NOREPLACE);
    if (rc != 0 && !overwrite && (errno == EINVAL || errno == ENOSYS)) {
      // A file system without RENAME_NOREPLACE: the up-front check stands in.
      std::error_code ec;
      if (fs::exists(fs::symlink_status(final_, ec))) errno = EEXIST;
      else rc = ::rename(tmp_.c_str(), final_.c_str());
    }
    if (rc != 0) {
      const int err = errno;
      if (err == EEXIST)
        return AlreadyExists(fmt::format("hf export: '{}' appeared while exporting; not replacing it (pass "
                                         "overwrite, or export to an empty folder)", final_.string()));
      return ErrnoStatus(err, fmt::format("hf export: renaming '{}' to '{}'", tmp_.string(), final_.string()));
    }
    committed_ = true;
    return Status::Ok();
  }

 private:
  TempFile(int fd, fs::path tmp, fs::path final) : fd_(fd), tmp_(std::move(tmp)), final_(std::move(final)) {}
  int fd_;
  fs::path tmp_, final_;
  uint64_t offset_ = 0;
  bool committed_ = false;
};

// `out` (without a trailing separator) exists as a folder afterwards.
Status prepare_out_dir(const fs::path& out) {
  std::error_code ec;
  const fs::file_status st = fs::status(out, ec);
  if (fs::exists(st)) {
    if (fs::is_directory(st)) return Status::Ok();
    return InvalidArgument(fmt::format("hf export: output '{}' exists and is not a folder; name a folder (it is "
                                       "created if missing) for model.safetensors and config.json", out.string()));
  }
  if (ec && ec != std::errc::no_such_file_or_directory)
    return IoError(fmt::format("hf export: cannot stat output '{}': {}", out.string(), ec.message()));
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  if (!fs::is_directory(parent, ec))
    return NotFound(fmt::format("hf export: cannot create output folder '{}': its parent '{}' is not an existing "
                                "folder; create the parent first (only one level is created)",
                                out.string(), parent.string()));
  if (::mkdir(out.c_str(), 0755) != 0 && errno != EEXIST)
    return ErrnoStatus(errno, fmt::format("hf export: creating output folder '{}'", out.string()));
  return fsync_folder(parent).with_context("hf export");
}

Status check_target(const fs::path& path, bool overwrite) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (!fs::exists(st)) return Status::Ok();
  if (!fs::is_regular_file(st) && !fs::is_symlink(st))
    return InvalidArgument(fmt::format("hf export: '{}' exists and is not a regular file; remove it or export to "
                                       "another folder", path.string()));
  if (!overwrite)
    return AlreadyExists(fmt::format("hf export: '{}' already exists; not replacing it (pass overwrite / "
                                     "--overwrite, or export to an empty folder)", path.string()));
  return Status::Ok();
}

// Stores one tensor's `numel` values from `src` (Strata's layout) into `dst`
// through `store`, transposing Strata's [out, in] to the file's [in, out]
// when the mapping says so.
template <typename Store>
void convert_into(const float* src, const HfTensorMapping& m, size_t numel, std::byte* dst, Store store) {
  if (!m.transposed) {
    for (size_t i = 0; i < numel; ++i) store(dst, i, src[i]);
    return;
  }
  // Strata [out, in] -> file [in, out], in tiles so both sides stay in cache.
  const size_t rows = static_cast<size_t>(m.shape[1]), cols = static_cast<size_t>(m.shape[0]);  // Strata's
  constexpr size_t kTile = 64;
  for (size_t r0 = 0; r0 < rows; r0 += kTile)
    for (size_t c0 = 0; c0 < cols; c0 += kTile)
      for (size_t c = c0; c < std::min(cols, c0 + kTile); ++c)
        for (size_t r = r0; r < std::min(rows, r0 + kTile); ++r) store(dst, c * rows + r, src[r * cols + c]);
}

void convert(const float* src, const HfTensorMapping& m, size_t numel, DType dtype, std::vector<std::byte>& out) {
  out.resize(numel * dtype_size(dtype));
  if (dtype == DType::kF32) {
    convert_into(src, m, numel, out.data(),
                 [](std::byte* d, size_t i, float v) { std::memcpy(d + 4 * i, &v, 4); });
  } else {
    convert_into(src, m, numel, out.data(), [](std::byte* d, size_t i, float v) {
      const uint16_t bits = fp32_to_bf16_bits(v);
      std::memcpy(d + 2 * i, &bits, 2);
    });
  }
}

Status write_model(const GptModel& model, const std::vector<HfTensorMapping>& map, TempFile& file,
                   const HfLayerReader& read_layer, DType dtype) {
  uint64_t data_bytes = 0;
  const std::string header = safetensors_header(map, dtype, &data_bytes);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  STRATA_RETURN_IF_ERROR(file.write(len, sizeof(len)));
  STRATA_RETURN_IF_ERROR(file.write(header.data(), header.size()));
  const uint64_t data_start = file.offset();

  std::vector<float> values;      // one layer, fp32
  std::vector<std::byte> scratch;  // one tensor, converted
  size_t next = 0;                 // index into map
  for (size_t li = 0; li < model.layers().size(); ++li) {
    const LayerSpec& layer = model.layers()[li];
    values.assign(layer.param_count, 0.0f);
    Status st = read_layer(li, std::span<float>(values));
    if (!st.ok())
      return st.with_context(fmt::format("hf export: reading layer {} ('{}', {} values)", li, layer.name,
                                         layer.param_count));
    for (; next < map.size() && map[next].layer == li; ++next) {
      const HfTensorMapping& m = map[next];
      const ParamTensorSpec& spec = layer.params[m.tensor];
      const float* src = values.data() + spec.offset_elements;
      const size_t numel = static_cast<size_t>(spec.numel());
      if (dtype == DType::kF32 && !m.transposed) {
        STRATA_RETURN_IF_ERROR(file.write(src, numel * sizeof(float)));
      } else {
        convert(src, m, numel, dtype, scratch);
        STRATA_RETURN_IF_ERROR(file.write(scratch.data(), scratch.size()));
      }
    }
  }
  STRATA_CHECK(next == map.size(), "hf export: a mapped tensor's layer was never read");
  STRATA_CHECK(file.offset() - data_start == data_bytes, "hf export: bytes written differ from the header");
  return Status::Ok();
}

}  // namespace

Result<std::vector<HfTensorMapping>> hf_gpt2_tensor_map(const GptConfig& config) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<GptModel> model, GptModel::create(config, 0));
  return tensor_map(*model);
}

Result<std::string> hf_gpt2_config_json(const GptConfig& config, DType dtype) {
  STRATA_RETURN_IF_ERROR(config.validate());
  STRATA_RETURN_IF_ERROR(check_dtype(dtype));
  // GPT2Config fields; see docs/export.md for why each value is what it is.
  nlohmann::ordered_json j;
  j["architectures"] = {"GPT2LMHeadModel"};
  j["model_type"] = "gpt2";
  j["vocab_size"] = config.vocab_size;
  j["n_positions"] = config.max_seq_len;
  j["n_ctx"] = config.max_seq_len;
  j["n_embd"] = config.n_embd;
  j["n_layer"] = config.n_layer;
  j["n_head"] = config.n_head;
  j["n_inner"] = nullptr;  // 4 * n_embd, as Strata's MLP
  j["activation_function"] = "gelu_new";  // the tanh approximation, as Strata's
  j["layer_norm_epsilon"] = 1e-5;         // Strata's LayerNorm eps (cpu_ops.cpp, the CUDA kernels)
  j["resid_pdrop"] = 0.0;                 // Strata trains without dropout
  j["embd_pdrop"] = 0.0;
  j["attn_pdrop"] = 0.0;
  j["initializer_range"] = 0.02;
  j["scale_attn_weights"] = true;  // 1 / sqrt(head size)
  j["scale_attn_by_inverse_layer_idx"] = false;
  j["reorder_and_upcast_attn"] = false;
  j["tie_word_embeddings"] = true;
  j["use_cache"] = true;
  // Strata's tokenizer is bytes (ids 0..255) with no special tokens; GPT-2's
  // 50256 would name a token that does not exist or means something else.
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = nullptr;
  j["torch_dtype"] = dtype == DType::kBF16 ? "bfloat16" : "float32";
  j["strata"] = {{"exporter", "strata checkpoint export"},
                 {"format_version", 1},
                 {"preset", config.preset},
                 {"tokenizer", "bytes: one token per byte, ids 0..255 (not GPT-2's BPE)"}};
  return j.dump(2) + "\n";
}

Status export_hf_gpt2(const GptConfig& config, const fs::path& out_arg, const HfLayerReader& read_layer,
                      const HfExportOptions& options) {
  STRATA_RETURN_IF_ERROR(check_dtype(options.dtype));
  if (!read_layer) return InvalidArgument("hf export: no layer reader given");
  if (out_arg.empty()) return InvalidArgument("hf export: the output folder is empty; name one (--out DIR)");
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<GptModel> model, GptModel::create(config, 0));
  const std::vector<HfTensorMapping> map = tensor_map(*model);
  STRATA_ASSIGN_OR_RETURN(std::string config_text, hf_gpt2_config_json(config, options.dtype));

  // "out/" and "out" are the same folder; the parent of "out/" is not.
  fs::path out = out_arg.lexically_normal();
  if (!out.has_filename() && out.has_parent_path() && out != out.root_path()) out = out.parent_path();
  STRATA_RETURN_IF_ERROR(prepare_out_dir(out));
  STRATA_RETURN_IF_ERROR(check_target(out / kModelFile, options.overwrite));
  STRATA_RETURN_IF_ERROR(check_target(out / kConfigFile, options.overwrite));

  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<TempFile> model_file, TempFile::create(out, kModelFile));
  STRATA_RETURN_IF_ERROR(write_model(*model, map, *model_file, read_layer, options.dtype));
  STRATA_RETURN_IF_ERROR(model_file->finish());
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<TempFile> config_file, TempFile::create(out, kConfigFile));
  STRATA_RETURN_IF_ERROR(config_file->write(config_text.data(), config_text.size()));
  STRATA_RETURN_IF_ERROR(config_file->finish());

  STRATA_RETURN_IF_ERROR(model_file->commit(options.overwrite));
  Status st = config_file->commit(options.overwrite);
  if (!st.ok()) {
    // Without overwrite there was no model.safetensors before: take ours back
    // rather than leave it beside someone else's config.json.
    if (!options.overwrite) ::unlink(model_file->final_path().c_str());
    return st;
  }
  return fsync_folder(out).with_context("hf export");
}

}  // namespace strata::model
