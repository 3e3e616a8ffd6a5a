// The checkpoint format (checkpoint.h): manifest JSON, folder resolution,
// the reader and verifier, durable-file helpers.
#include "strata/offload/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>

#include <fmt/format.h>

#include "strata/core/bounded_file.h"
#include "strata/core/durable_file.h"
#include "strata/core/printable.h"
#include "strata/nvme/checksum.h"

namespace strata::offload {
namespace fs = std::filesystem;

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

Result<uint64_t> parse_hex64(const nlohmann::json& v, const std::string& what) {
  if (!v.is_string() || v.get<std::string>().size() != 16)
    return InvalidArgument(fmt::format("{}: the checksum must be 16 hex digits", what));
  const std::string s = v.get<std::string>();
  uint64_t x = 0;
  for (const char c : s) {
    int d = 0;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else return InvalidArgument(fmt::format("{}: the checksum '{}' is not lower-case hex", what, printable(s, 32)));
    x = x << 4 | static_cast<uint64_t>(d);
  }
  return x;
}

std::string default_checkpoint_tag(int64_t steps_begun) { return fmt::format("global_step{}", steps_begun); }

Status check_checkpoint_tag(const std::string& tag) {
  if (tag.empty() || tag.size() > 128)
    return InvalidArgument(fmt::format("checkpoint tag '{}' must be 1..128 characters", printable_ascii(tag, 160)));
  if (tag.front() == '.')
    return InvalidArgument(fmt::format("checkpoint tag '{}' must not start with '.' (those names are the save's "
                                       "temporary folders)",
                                       printable_ascii(tag, 160)));
  for (const char c : tag)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-'))
      return InvalidArgument(fmt::format("checkpoint tag '{}' may hold only letters, digits, '.', '_' and '-'",
                                         printable_ascii(tag, 160)));
  if (tag == "latest") return InvalidArgument("checkpoint tag 'latest' is the name of the pointer file; pick another");
  return Status::Ok();
}

// ---------------------------------------------------------------- interrupted saves

Result<std::vector<InterruptedSave>> find_interrupted_saves(const fs::path& dir) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (ec || !fs::is_directory(st) || fs::is_symlink(st))
    return InvalidArgument(fmt::format("'{}' is not a checkpoint folder (a real folder, not a link)",
                                       printable(dir.string(), 256)));
  std::vector<InterruptedSave> out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-", 0) != 0) continue;
    const fs::file_status es = e.symlink_status(ec);
    if (ec || !fs::is_directory(es) || fs::is_symlink(es)) continue;
    const size_t dash = name.rfind('-');
    if (dash == std::string::npos || dash <= 5 || dash + 1 >= name.size() || dash + 1 + 10 < name.size()) continue;
    int64_t pid = 0;
    bool digits = true;
    for (size_t i = dash + 1; i < name.size(); ++i) {
      if (name[i] < '0' || name[i] > '9') digits = false;
      else pid = pid * 10 + (name[i] - '0');
    }
    if (!digits || pid <= 0 || pid > INT32_MAX) continue;
    InterruptedSave s;
    s.name = name;
    s.tag = name.substr(5, dash - 5);
    s.pid = pid;
    s.running = ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
    out.push_back(std::move(s));
  }
  if (ec) return ErrnoStatus(ec.value(), fmt::format("list '{}'", printable(dir.string(), 256)));
  std::sort(out.begin(), out.end(), [](const InterruptedSave& a, const InterruptedSave& b) { return a.name < b.name; });
  return out;
}

Status remove_interrupted_save(const fs::path& dir, const InterruptedSave& save) {
  if (save.name.rfind(".tmp-", 0) != 0 || save.name.find('/') != std::string::npos || save.name == ".tmp-")
    return InvalidArgument(fmt::format("'{}' is not an interrupted save's folder", printable(save.name, 128)));
  if (::kill(static_cast<pid_t>(save.pid), 0) == 0 || errno == EPERM)
    return FailedPrecondition(fmt::format("'{}': process {} is running; its save may still be in progress",
                                          printable(save.name, 128), save.pid));
  const fs::path p = dir / save.name;
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(p, ec);
  if (ec || !fs::is_directory(st) || fs::is_symlink(st))
    return InvalidArgument(fmt::format("'{}' is not a real folder", printable(p.string(), 256)));
  fs::remove_all(p, ec);  // never follows links inside
  if (ec) return ErrnoStatus(ec.value(), fmt::format("remove '{}'", printable(p.string(), 256)));
  return Status::Ok();
}

// ---------------------------------------------------------------- manifest

uint64_t CheckpointManifest::total_bytes() const {
  uint64_t n = 0;
  for (const CheckpointFile& f : files) n += f.bytes;
  return n;
}

nlohmann::json CheckpointManifest::to_json() const {
  nlohmann::ordered_json j;
  j["format"] = kCheckpointFormatName;
  j["version"] = version;
  j["tag"] = tag;
  j["world_size"] = world_size;
  j["stage"] = stage;
  j["offload_optimizer"] = offload_optimizer;
  j["offload_param"] = offload_param;
  j["moment_dtype"] = moment_dtype;
  j["optimizer"] = optimizer;
  j["sub_group_size"] = sub_group_size;
  j["step"] = scalars.optimizer_steps;
  j["step_calls"] = scalars.steps_begun;
  if (scalars.data_position) j["data_position"] = *scalars.data_position;
  else j["data_position"] = nullptr;
  j["loss_scaler"] = {{"scale", scalars.loss_scale},
                      {"iteration", scalars.scaler_iteration},
                      {"last_overflow_iteration", scalars.scaler_last_overflow},
                      {"hysteresis_left", scalars.scaler_hysteresis_left},
                      {"overflow_count", scalars.scaler_overflow_count}};
  nlohmann::ordered_json ls = nlohmann::ordered_json::array();
  for (const CheckpointLayer& l : layers) {
    ls.push_back({{"name", l.name}, {"elements", l.elements}, {"dtype", l.dtype}});
    if (l.frozen) ls.back()["frozen"] = true;  // absent: trained (the key older checkpoints do not have)
  }
  j["layers"] = ls;
  nlohmann::ordered_json fs_ = nlohmann::ordered_json::array();
  for (const CheckpointFile& f : files)
    fs_.push_back({{"name", f.name}, {"rank", f.rank}, {"kind", f.model ? "model" : "optim"}, {"bytes", f.bytes},
                   {"xxh3", hex64(f.xxh3)}});
  j["files"] = fs_;
  nlohmann::ordered_json es = nlohmann::ordered_json::array();
  for (const CheckpointExtent& e : extents)
    es.push_back({e.file, e.layer, e.begin, e.count, e.offset, hex64(e.xxh3)});
  j["extents_columns"] = {"file", "layer", "begin", "count", "offset", "xxh3"};
  j["extents"] = es;
  j["app"] = app;
  return nlohmann::json::parse(j.dump());
}

namespace {

// Typed access to manifest keys: every error names the key and the file.
struct Fields {
  const nlohmann::json& j;
  const std::string& source;
  std::string where;

  Status missing(const char* key) const {
    return InvalidArgument(fmt::format("checkpoint manifest '{}': key '{}{}' is missing or has the wrong type; the "
                                       "manifest was not written by this Strata or is damaged",
                                       printable(source, 256), where, key));
  }
  template <class T>
  Result<T> integer(const char* key, T lo, T hi) const {
    if (!j.contains(key) || !j[key].is_number_integer()) return missing(key);
    // Read wide first: a value outside T must be refused, not wrapped.
    const auto& v = j[key];
    long double x = v.is_number_unsigned() ? static_cast<long double>(v.get<uint64_t>())
                                           : static_cast<long double>(v.get<int64_t>());
    if (x < static_cast<long double>(lo) || x > static_cast<long double>(hi))
      return InvalidArgument(fmt::format("checkpoint manifest '{}': '{}{}' = {} is outside [{}, {}]",
                                         printable(source, 256), where, key, v.dump(), lo, hi));
    return v.is_number_unsigned() ? static_cast<T>(v.get<uint64_t>()) : static_cast<T>(v.get<int64_t>());
  }
  Result<std::string> string(const char* key) const {
    if (!j.contains(key) || !j[key].is_string()) return missing(key);
    return j[key].get<std::string>();
  }
  Result<double> number(const char* key) const {
    if (!j.contains(key) || !j[key].is_number()) return missing(key);
    return j[key].get<double>();
  }
};

constexpr int64_t kI64Max = INT64_MAX;
constexpr uint64_t kMaxElements = 1ull << 48;

Status check_format(const Fields& f, const std::string& src) {
  STRATA_ASSIGN_OR_RETURN(std::string format, f.string("format"));
  if (format != kCheckpointFormatName)
    return InvalidArgument(fmt::format("'{}' is not a Strata checkpoint manifest (format '{}', expected '{}')", src,
                                       printable(format, 64), kCheckpointFormatName));
  return Status::Ok();
}

// The version (one this Strata reads), the tag and the run the checkpoint was saved from.
Result<CheckpointManifest> read_header(const Fields& f, const std::string& src) {
  CheckpointManifest m;
  STRATA_ASSIGN_OR_RETURN(m.version, f.integer<int>("version", 1, 1 << 20));
  if (m.version > kCheckpointFormatVersion)
    return Unsupported(fmt::format("checkpoint '{}' has format version {}, newer than this Strata reads ({}); "
                                   "load it with a newer Strata",
                                   src, m.version, kCheckpointFormatVersion));
  STRATA_ASSIGN_OR_RETURN(m.tag, f.string("tag"));
  STRATA_ASSIGN_OR_RETURN(m.world_size, f.integer<int>("world_size", 1, 1 << 20));
  STRATA_ASSIGN_OR_RETURN(m.stage, f.integer<int>("stage", 0, 3));
  STRATA_ASSIGN_OR_RETURN(m.offload_optimizer, f.string("offload_optimizer"));
  STRATA_ASSIGN_OR_RETURN(m.offload_param, f.string("offload_param"));
  STRATA_ASSIGN_OR_RETURN(m.moment_dtype, f.string("moment_dtype"));
  STRATA_ASSIGN_OR_RETURN(m.optimizer, f.string("optimizer"));
  STRATA_ASSIGN_OR_RETURN(m.sub_group_size, f.integer<int64_t>("sub_group_size", 1, kI64Max));
  return m;
}

// The step counters, the data position and the loss scaler's state.
Result<CheckpointScalars> read_scalars(const Fields& f, const std::string& src) {
  const nlohmann::json& j = f.j;
  CheckpointScalars s;
  STRATA_ASSIGN_OR_RETURN(s.optimizer_steps, f.integer<int64_t>("step", 0, kI64Max));
  STRATA_ASSIGN_OR_RETURN(s.steps_begun, f.integer<int64_t>("step_calls", s.optimizer_steps, kI64Max));
  if (j.contains("data_position") && j["data_position"].is_null()) {
    s.data_position.reset();
  } else {
    STRATA_ASSIGN_OR_RETURN(s.data_position, f.integer<uint64_t>("data_position", 0, UINT64_MAX));
  }
  if (!j.contains("loss_scaler") || !j["loss_scaler"].is_object()) return f.missing("loss_scaler");
  const Fields scaler{j["loss_scaler"], f.source, "loss_scaler."};
  STRATA_ASSIGN_OR_RETURN(s.loss_scale, scaler.number("scale"));
  STRATA_ASSIGN_OR_RETURN(s.scaler_iteration, scaler.integer<int64_t>("iteration", 0, kI64Max));
  STRATA_ASSIGN_OR_RETURN(s.scaler_last_overflow, scaler.integer<int64_t>("last_overflow_iteration", -1, kI64Max));
  STRATA_ASSIGN_OR_RETURN(s.scaler_hysteresis_left, scaler.integer<int64_t>("hysteresis_left", 0, kI64Max));
  STRATA_ASSIGN_OR_RETURN(s.scaler_overflow_count, scaler.integer<int64_t>("overflow_count", 0, kI64Max));
  if (!std::isfinite(s.loss_scale) || s.loss_scale <= 0)
    return InvalidArgument(fmt::format("checkpoint manifest '{}': loss_scaler.scale must be finite and > 0", src));
  return s;
}

Result<std::vector<CheckpointLayer>> read_layers(const Fields& f, const std::string& src) {
  const nlohmann::json& j = f.j;
  if (!j.contains("layers") || !j["layers"].is_array()) return f.missing("layers");
  std::vector<CheckpointLayer> layers;
  for (size_t i = 0; i < j["layers"].size(); ++i) {
    Fields l{j["layers"][i], f.source, fmt::format("layers[{}].", i)};
    if (!l.j.is_object()) return f.missing(fmt::format("layers[{}]", i).c_str());
    CheckpointLayer cl;
    STRATA_ASSIGN_OR_RETURN(cl.name, l.string("name"));
    STRATA_ASSIGN_OR_RETURN(cl.elements, l.integer<uint64_t>("elements", 0, kMaxElements));
    STRATA_ASSIGN_OR_RETURN(cl.dtype, l.string("dtype"));
    if (l.j.contains("frozen")) {
      if (!l.j["frozen"].is_boolean())
        return InvalidArgument(fmt::format("checkpoint manifest '{}': layers[{}].frozen is not true or false", src, i));
      cl.frozen = l.j["frozen"].get<bool>();
    }
    layers.push_back(std::move(cl));
  }
  return layers;
}

// The files, each named for its rank and kind (nothing that could leave the folder), each once.
Result<std::vector<CheckpointFile>> read_files(const Fields& f, const std::string& src, int world_size) {
  const nlohmann::json& j = f.j;
  if (!j.contains("files") || !j["files"].is_array()) return f.missing("files");
  std::vector<CheckpointFile> files;
  std::map<std::string, size_t> names;
  for (size_t i = 0; i < j["files"].size(); ++i) {
    Fields l{j["files"][i], f.source, fmt::format("files[{}].", i)};
    if (!l.j.is_object()) return f.missing(fmt::format("files[{}]", i).c_str());
    CheckpointFile cf;
    STRATA_ASSIGN_OR_RETURN(cf.name, l.string("name"));
    STRATA_ASSIGN_OR_RETURN(cf.rank, l.integer<int>("rank", 0, world_size - 1));
    STRATA_ASSIGN_OR_RETURN(std::string kind, l.string("kind"));
    if (kind != "model" && kind != "optim")
      return InvalidArgument(fmt::format("checkpoint manifest '{}': files[{}].kind '{}' is not model or optim", src, i,
                                         printable(kind, 32)));
    cf.model = kind == "model";
    STRATA_ASSIGN_OR_RETURN(cf.bytes, l.integer<uint64_t>("bytes", 0, UINT64_MAX / 2));
    if (!l.j.contains("xxh3")) return l.missing("xxh3");
    STRATA_ASSIGN_OR_RETURN(cf.xxh3, parse_hex64(l.j["xxh3"], fmt::format("checkpoint manifest '{}': files[{}].xxh3",
                                                                          src, i)));
    // File names are ours: rankNNNNN.model|optim, nothing that could leave the folder.
    if (cf.name != fmt::format("rank{:05d}.{}", cf.rank, kind))
      return InvalidArgument(fmt::format("checkpoint manifest '{}': files[{}].name '{}' is not rank{:05d}.{}", src, i,
                                         printable(cf.name, 64), cf.rank, kind));
    if (!names.emplace(cf.name, i).second)
      return InvalidArgument(fmt::format("checkpoint manifest '{}': file '{}' is listed twice", src, cf.name));
    files.push_back(std::move(cf));
  }
  return files;
}

// One extent, [file, layer, begin, count, offset, xxh3], inside a listed
// file and a trained layer of `m` (its layers and files read).
Result<CheckpointExtent> read_extent(const nlohmann::json& e, const std::string& what, const CheckpointManifest& m) {
  if (!e.is_array() || e.size() != 6)
    return InvalidArgument(what + " is not [file, layer, begin, count, offset, xxh3]");
  for (size_t k = 0; k < 5; ++k)
    if (!e[k].is_number_unsigned() && !(e[k].is_number_integer() && e[k].get<int64_t>() >= 0))
      return InvalidArgument(fmt::format("{}[{}] is not a non-negative integer", what, k));
  CheckpointExtent ce;
  ce.file = e[0].get<uint64_t>();
  ce.layer = e[1].get<uint64_t>();
  ce.begin = e[2].get<uint64_t>();
  ce.count = e[3].get<uint64_t>();
  ce.offset = e[4].get<uint64_t>();
  STRATA_ASSIGN_OR_RETURN(ce.xxh3, parse_hex64(e[5], what));
  if (ce.file >= m.files.size()) return InvalidArgument(fmt::format("{}: file {} does not exist", what, ce.file));
  if (ce.layer >= m.layers.size()) return InvalidArgument(fmt::format("{}: layer {} does not exist", what, ce.layer));
  if (m.layers[ce.layer].frozen)
    return InvalidArgument(fmt::format("{}: layer {} is frozen, which a checkpoint stores no extents of", what,
                                       ce.layer));
  if (ce.count == 0 || ce.count > kMaxElements || ce.begin > m.layers[ce.layer].elements ||
      ce.count > m.layers[ce.layer].elements - ce.begin)
    return InvalidArgument(fmt::format("{}: elements [{}, +{}) are outside layer {} ({} elements)", what, ce.begin,
                                       ce.count, ce.layer, m.layers[ce.layer].elements));
  const uint64_t bytes = m.extent_bytes(ce);
  if (ce.offset > m.files[ce.file].bytes || bytes > m.files[ce.file].bytes - ce.offset)
    return InvalidArgument(fmt::format("{}: bytes [{}, +{}) are outside file '{}' ({} bytes)", what, ce.offset, bytes,
                                       m.files[ce.file].name, m.files[ce.file].bytes));
  return ce;
}

Result<std::vector<CheckpointExtent>> read_extents(const Fields& f, const std::string& src,
                                                   const CheckpointManifest& m) {
  const nlohmann::json& j = f.j;
  if (!j.contains("extents") || !j["extents"].is_array()) return f.missing("extents");
  std::vector<CheckpointExtent> extents;
  for (size_t i = 0; i < j["extents"].size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(CheckpointExtent ce,
                            read_extent(j["extents"][i], fmt::format("checkpoint manifest '{}': extents[{}]", src, i), m));
    extents.push_back(ce);
  }
  return extents;
}

// Every trained layer tiled exactly by the extents of one kind (model: in .model files, else optim).
Status check_tiling(const CheckpointManifest& m, bool model, const std::string& src) {
  const char* kind = model ? "model" : "optim";
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> per(m.layers.size());
  for (const CheckpointExtent& e : m.extents)
    if (m.files[e.file].model == model) per[e.layer].push_back({e.begin, e.count});
  for (size_t li = 0; li < per.size(); ++li) {
    if (m.layers[li].frozen) continue;  // Note [Frozen layers in checkpoints]
    std::sort(per[li].begin(), per[li].end());
    uint64_t at = 0;
    for (const auto& [b, c] : per[li]) {
      if (b != at)
        return InvalidArgument(fmt::format("checkpoint manifest '{}': the {} extents of layer {} ('{}') {} at "
                                           "element {}",
                                           src, kind, li, printable(m.layers[li].name, 64),
                                           b < at ? "overlap" : "leave a gap", std::min(b, at)));
      at = b + c;
    }
    if (at != m.layers[li].elements)
      return InvalidArgument(fmt::format("checkpoint manifest '{}': the {} extents of layer {} ('{}') cover {} of "
                                         "its {} elements",
                                         src, kind, li, printable(m.layers[li].name, 64), at, m.layers[li].elements));
  }
  return Status::Ok();
}

}  // namespace

Result<CheckpointManifest> CheckpointManifest::from_json(const nlohmann::json& j, const std::string& source) {
  const std::string src = printable(source, 256);
  if (!j.is_object()) return InvalidArgument(fmt::format("checkpoint manifest '{}' is not a JSON object", src));
  const Fields f{j, source, ""};
  STRATA_RETURN_IF_ERROR(check_format(f, src));
  STRATA_ASSIGN_OR_RETURN(CheckpointManifest m, read_header(f, src));
  STRATA_ASSIGN_OR_RETURN(m.scalars, read_scalars(f, src));
  STRATA_ASSIGN_OR_RETURN(m.layers, read_layers(f, src));
  STRATA_ASSIGN_OR_RETURN(m.files, read_files(f, src, m.world_size));
  STRATA_ASSIGN_OR_RETURN(m.extents, read_extents(f, src, m));
  STRATA_RETURN_IF_ERROR(check_tiling(m, true, src));
  STRATA_RETURN_IF_ERROR(check_tiling(m, false, src));
  if (j.contains("app")) m.app = j["app"];
  return m;
}

// ---------------------------------------------------------------- resolve, reader

Result<fs::path> resolve_checkpoint(const fs::path& given) {
  const std::string shown = printable(given.string(), 256);
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(given, ec);
  if (ec || !fs::exists(st))
    return NotFound(fmt::format("checkpoint '{}' does not exist; give the --save-dir folder or one of its tags", shown));
  if (fs::is_symlink(st))
    return InvalidArgument(fmt::format("checkpoint '{}' is a symbolic link; give the real folder", shown));
  if (!fs::is_directory(st))
    return InvalidArgument(fmt::format("checkpoint '{}' is not a folder; give the --save-dir folder or one of its tags",
                                       shown));
  if (fs::exists(fs::symlink_status(given / "manifest.json", ec))) return given;
  const fs::path latest = given / "latest";
  if (!fs::exists(fs::symlink_status(latest, ec)))
    return NotFound(fmt::format("'{}' holds neither manifest.json nor a 'latest' file: no complete checkpoint was "
                                "saved there (a save interrupted before its end leaves only a .tmp-* folder)",
                                shown));
  STRATA_ASSIGN_OR_RETURN(std::string text,
                          read_regular_file(latest.string(), 4096,
                                            {.what = "checkpoint pointer", .flag = "",
                                             .hint = "it should hold one tag name; give DIR/TAG instead"}));
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.pop_back();
  STRATA_RETURN_IF_ERROR(check_checkpoint_tag(text).with_context(
      fmt::format("reading '{}'", printable(latest.string(), 256))));
  const fs::path tag = given / text;
  const fs::file_status ts = fs::symlink_status(tag, ec);
  if (!fs::is_directory(ts) || fs::is_symlink(ts))
    return NotFound(fmt::format("'{}' names tag '{}', which is not a folder in '{}'", printable(latest.string(), 256),
                                printable_ascii(text, 160), shown));
  return tag;
}

Result<CheckpointReader> CheckpointReader::open(const fs::path& dir_or_tag) {
  STRATA_ASSIGN_OR_RETURN(fs::path folder, resolve_checkpoint(dir_or_tag));
  const fs::path mpath = folder / "manifest.json";
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(mpath, ec)))
    return InvalidArgument(fmt::format("'{}' is a symbolic link; a checkpoint's files are never links",
                                       printable(mpath.string(), 256)));
  STRATA_ASSIGN_OR_RETURN(std::string text,
                          read_regular_file(mpath.string(), kMaxManifestBytes,
                                            {.what = "checkpoint manifest", .flag = "",
                                             .hint = "give a folder written by strata train --save-dir"}));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded())
    return InvalidArgument(fmt::format("checkpoint manifest '{}' is not valid JSON (damaged or truncated)",
                                       printable(mpath.string(), 256)));
  CheckpointReader r;
  r.folder_ = folder;
  STRATA_ASSIGN_OR_RETURN(r.manifest_, CheckpointManifest::from_json(j, mpath.string()));
  const CheckpointManifest& m = r.manifest_;
  r.index_.resize(m.layers.size());
  for (size_t i = 0; i < m.extents.size(); ++i)
    r.index_[m.extents[i].layer][m.files[m.extents[i].file].model ? 0 : 1].push_back(i);
  for (auto& per_layer : r.index_)
    for (auto& v : per_layer)
      std::sort(v.begin(), v.end(), [&](size_t a, size_t b) { return m.extents[a].begin < m.extents[b].begin; });
  for (const CheckpointFile& f : r.manifest_.files) {
    const fs::path p = folder / f.name;
    struct stat st{};
    if (::lstat(p.c_str(), &st) != 0)
      return ErrnoStatus(errno, fmt::format("checkpoint file '{}' (listed in manifest.json)", printable(p.string(), 256)));
    if (!S_ISREG(st.st_mode))
      return InvalidArgument(fmt::format("checkpoint file '{}' is not a regular file", printable(p.string(), 256)));
    if (static_cast<uint64_t>(st.st_size) != f.bytes)
      return DataLoss(fmt::format("checkpoint file '{}' has {} bytes, the manifest says {} (truncated or replaced)",
                                  printable(p.string(), 256), st.st_size, f.bytes));
  }
  return r;
}

namespace {
Status pread_all(const fs::path& path, uint64_t offset, void* dst, uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("open '{}'", printable(path.string(), 256)));
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, static_cast<char*>(dst) + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      ::close(fd);
      if (err == 0)
        return DataLoss(fmt::format("'{}' ends at byte {} inside an extent [{}, +{})", printable(path.string(), 256),
                                    offset + done, offset, bytes));
      return ErrnoStatus(err, fmt::format("read '{}' at offset {}", printable(path.string(), 256), offset + done));
    }
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return Status::Ok();
}
}  // namespace

Status CheckpointReader::read(size_t layer, CheckpointState kind, uint64_t begin, std::span<float> out) {
  const CheckpointManifest& m = manifest_;
  if (layer >= m.layers.size() || begin > m.layers[layer].elements || out.size() > m.layers[layer].elements - begin)
    return InvalidArgument(fmt::format("checkpoint read of layer {} elements [{}, +{}) is out of range", layer, begin,
                                       out.size()));
  if (m.layers[layer].frozen && !out.empty())
    return FailedPrecondition(fmt::format("checkpoint '{}' does not store layer {} ('{}'): it was frozen (Note [Frozen "
                                          "layers in checkpoints]); its values are the model's own",
                                          printable(folder_.string(), 256), layer, printable(m.layers[layer].name, 64)));
  const bool want_model = kind == CheckpointState::kMaster;
  uint64_t at = begin;
  const uint64_t end = begin + out.size();
  while (at < end) {
    // The last extent that begins at or before `at` (the extents tile the layer).
    const std::vector<size_t>& sorted = index_[layer][want_model ? 0 : 1];
    auto it = std::upper_bound(sorted.begin(), sorted.end(), at,
                               [&](uint64_t v, size_t i) { return v < m.extents[i].begin; });
    STRATA_CHECK(it != sorted.begin(), "from_json checked that every layer is tiled");
    const size_t found = *std::prev(it);
    STRATA_CHECK(at < m.extents[found].begin + m.extents[found].count, "from_json checked that every layer is tiled");
    const CheckpointExtent& e = m.extents[found];
    const size_t k = want_model ? 0 : 1;
    std::vector<float>& cache = cached_[k];
    if (cached_extent_[k] != found) {
      cached_extent_[k] = SIZE_MAX;  // until the new extent is read and checked
      const uint64_t bytes = m.extent_bytes(e);
      cache.assign(bytes / 4, 0.0f);
      const fs::path path = folder_ / m.files[e.file].name;
      STRATA_RETURN_IF_ERROR(pread_all(path, e.offset, cache.data(), bytes));
      if (nvme::checksum64(cache.data(), bytes) != e.xxh3) {
        return DataLoss(fmt::format("checkpoint file '{}': extent at byte {} (layer {} '{}', elements [{}, +{})) does "
                                    "not match its checksum; the file is damaged: resume from an earlier tag",
                                    printable(path.string(), 256), e.offset, e.layer,
                                    printable(m.layers[e.layer].name, 64), e.begin, e.count));
      }
      cached_extent_[k] = found;
    }
    const uint64_t n = std::min(end, e.begin + e.count) - at;
    const uint64_t skip = kind == CheckpointState::kExpAvgSq ? e.count : 0;
    std::memcpy(out.data() + (at - begin), cache.data() + skip + (at - e.begin), n * sizeof(float));
    at += n;
  }
  return Status::Ok();
}

Status CheckpointReader::verify() {
  std::vector<std::byte> buf(8u << 20);
  for (size_t fi = 0; fi < manifest_.files.size(); ++fi) {
    const CheckpointFile& f = manifest_.files[fi];
    const fs::path path = folder_ / f.name;
    // Extents first (they name where the damage is), then the whole file.
    for (const CheckpointExtent& e : manifest_.extents) {
      if (e.file != fi) continue;
      const uint64_t bytes = manifest_.extent_bytes(e);
      nvme::ChecksumStream cs;
      for (uint64_t off = 0; off < bytes; off += buf.size()) {
        const uint64_t n = std::min<uint64_t>(buf.size(), bytes - off);
        STRATA_RETURN_IF_ERROR(pread_all(path, e.offset + off, buf.data(), n));
        cs.update(buf.data(), n);
      }
      if (cs.digest() != e.xxh3)
        return DataLoss(fmt::format("checkpoint file '{}': extent at byte {} ({} bytes; layer {} '{}', elements [{}, "
                                    "+{})) does not match its checksum",
                                    printable(path.string(), 256), e.offset, bytes, e.layer,
                                    printable(manifest_.layers[e.layer].name, 64), e.begin, e.count));
    }
    nvme::ChecksumStream cs;
    for (uint64_t off = 0; off < f.bytes; off += buf.size()) {
      const uint64_t n = std::min<uint64_t>(buf.size(), f.bytes - off);
      STRATA_RETURN_IF_ERROR(pread_all(path, off, buf.data(), n));
      cs.update(buf.data(), n);
    }
    if (cs.digest() != f.xxh3)
      return DataLoss(fmt::format("checkpoint file '{}' ({} bytes) does not match its checksum",
                                  printable(path.string(), 256), f.bytes));
  }
  return Status::Ok();
}

}  // namespace strata::offload
