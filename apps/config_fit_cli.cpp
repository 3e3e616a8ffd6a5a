// What `strata plan --fit` and `strata train --fit` share: see config_fit_cli.h.
#include "config_fit_cli.h"

#include "placement_rows.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>

#include "placement_rows.h"
#include "strata/core/bounded_file.h"
#include "strata/core/config_schema.h"
#include "strata/core/printable.h"
#include "strata/core/units.h"

namespace strata::cli {

namespace {

Result<uint64_t> cap_flag(const std::string& text, const char* flag, const char* example) {
  Result<uint64_t> b = parse_bytes(text, flag);
  if (!b.ok()) return b.status();
  if (*b == 0) return InvalidArgument(fmt::format("{} 0 leaves no room for any plan; give a size such as {} {}", flag, flag, example));
  return *b;
}

}  // namespace

Result<offload::FitCaps> fit_caps_from_flags(const FitFlags& f, uint64_t fallback_device, uint64_t fallback_host,
                                             const std::string& config_nvme_path, int ranks_per_node) {
  offload::FitCaps caps;
  caps.ranks_per_node = ranks_per_node;
  if (!f.device_memory.empty()) {
    STRATA_ASSIGN_OR_RETURN(caps.device_bytes, cap_flag(f.device_memory, "--device-memory", "2GiB"));
  } else if (fallback_device != 0) {
    caps.device_bytes = fallback_device;
  } else {
    return InvalidArgument("--fit needs --device-memory SIZE (the device's capacity per rank, e.g. 2GiB)");
  }
  if (!f.host_memory.empty()) {
    STRATA_ASSIGN_OR_RETURN(caps.host_bytes, cap_flag(f.host_memory, "--host-memory", "8GiB"));
  } else if (fallback_host != 0) {
    caps.host_bytes = fallback_host;
  } else {
    return InvalidArgument("--fit needs --host-memory SIZE (pinned host memory for the engine on this node, e.g. "
                           "8GiB; strata.host_memory_budget in the config)");
  }
  caps.nvme_path = !f.nvme_path.empty() ? f.nvme_path : config_nvme_path;
  // The free space of --nvme-path, else of the config's nvme_path (unless --nvme-size says how much to plan for).
  if (!caps.nvme_path.empty() && f.nvme_size.empty()) {
    const std::string where = !f.nvme_path.empty()
                                  ? fmt::format("--nvme-path '{}'", printable(f.nvme_path, 256))
                                  : fmt::format("the config's nvme_path '{}' (give --nvme-path DIR or --nvme-size Z to "
                                                "plan for another drive)",
                                                printable(config_nvme_path, 256));
    struct stat st {};
    if (::stat(caps.nvme_path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      return InvalidArgument(fmt::format("{} is not a folder that exists", where));
    struct statvfs vfs {};
    if (::statvfs(caps.nvme_path.c_str(), &vfs) != 0)
      return ErrnoStatus(errno, fmt::format("{}: cannot read its free space", where));
    caps.nvme_bytes = static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
    if (*caps.nvme_bytes == 0) return InvalidArgument(fmt::format("{} has no free space", where));
  }
  if (!f.nvme_size.empty()) {
    STRATA_ASSIGN_OR_RETURN(const uint64_t size, cap_flag(f.nvme_size, "--nvme-size", "100GiB"));
    if (caps.nvme_path.empty())
      return InvalidArgument("--nvme-size needs a folder for the NVMe state: give --nvme-path DIR, or nvme_path in "
                             "--config");
    caps.nvme_bytes = size;  // the space to plan for (another machine's drive), not this folder's
  }
  return caps;
}

uint64_t gpt_device_reserve_bytes(const model::GptConfig& g, DType param, DType grad, int micro_batch, int seq,
                                  uint64_t alignment) {
  const uint64_t align = std::max<uint64_t>(1, alignment);
  auto buf = [&](uint64_t bytes) { return (bytes + align - 1) / align * align; };
  const uint64_t N = static_cast<uint64_t>(micro_batch) * static_cast<uint64_t>(seq), C = g.n_embd,
                 V = g.vocab_size, L = g.n_layer, NH = g.n_head;
  const uint64_t NC = N * C, att = static_cast<uint64_t>(micro_batch) * NH * seq * seq, f = sizeof(float);
  // The executor's graph (model/src/gpt_graph.h, GptGraph::allocate), buffer by buffer.
  uint64_t total = buf(NC * f);  // encoded
  const uint64_t per_block = buf(NC * f) + 2 * buf(N * f) + buf(3 * NC * f) + buf(NC * f) + buf(att * f) +
                             buf(NC * f) + buf(NC * f) + 2 * buf(N * f) + 2 * buf(4 * NC * f) + buf(NC * f);
  total += L * per_block;
  total += 2 * buf(NC * f) + 2 * buf(N * f) + 2 * buf(N * V * f) + buf(N * f);  // proj, lnf, logits, probs, losses
  total += 3 * buf(NC * f) + buf(3 * NC * f) + buf(att * f) + 2 * buf(4 * NC * f);  // gradient scratch
  total += 2 * buf(N * sizeof(int32_t));                                           // tokens, targets
  // Working copies (executor_impl.h): one per distinct layer size, reused in stream order.
  const int64_t embedding = (static_cast<int64_t>(g.vocab_size) + g.max_seq_len) * g.n_embd;
  const int64_t block = (g.param_count() - embedding - 2 * g.n_embd) / std::max(1, g.n_layer);
  std::set<int64_t> sizes{embedding, block, 2 * static_cast<int64_t>(g.n_embd)};
  const uint64_t copies = (param != DType::kF32 ? 1 : 0) + (grad != DType::kF32 ? 1 : 0);
  for (int64_t s : sizes) total += copies * buf(static_cast<uint64_t>(s) * f);
  return total;
}

Result<offload::FitRequest> gpt_fit_request(const model::GptConfig& g, const Config& config, int world, int micro_batch,
                                            int seq, int grad_accum, const offload::HardwareProfile& profile) {
  offload::FitRequest req;
  STRATA_RETURN_IF_ERROR(g.validate());
  // The GPT's layers as the engine partitions them (model/gpt.h: the embedding, the blocks, the final norm),
  // one flat tensor each: the plan reads only their element counts and dtype, so no weights are allocated.
  const int64_t C = g.n_embd;
  const int64_t embedding = (static_cast<int64_t>(g.vocab_size) + g.max_seq_len) * C;
  const int64_t block = (g.param_count() - embedding - 2 * C) / std::max(1, g.n_layer);
  auto layer = [&](std::string name, int64_t count) {
    LayerSpec l;
    l.name = std::move(name);
    ParamTensorSpec t;
    t.name = l.name + ".flat";
    t.shape = {count};
    t.dtype = g.param_dtype;
    l.params.push_back(t);
    l.param_count = static_cast<size_t>(count);
    l.param_bytes = l.param_count * dtype_size(g.param_dtype);
    return l;
  };
  req.layers.push_back(layer("embedding", embedding));
  for (int i = 0; i < g.n_layer; ++i) req.layers.push_back(layer(fmt::format("h{}", i), block));
  req.layers.push_back(layer("final_norm", 2 * C));
  req.config = config;
  req.world = world;
  req.micro_batch = micro_batch;
  req.seq = seq;
  req.grad_accum = grad_accum;
  req.flops_per_token = g.train_flops_per_token(seq);
  req.profile = profile;
  req.device = profile.shared_cores ? offload::PlannedDevice::cpu() : offload::PlannedDevice::gpu();
  req.device_reserve = [g, seq](DType param, DType grad, int batch) {
    return gpt_device_reserve_bytes(g, param, grad, batch, seq);
  };
  return req;
}


namespace {

std::string mem_line(const offload::FitMemory& m) {
  return fmt::format("device {} (engine {}), pinned {} per rank, nvme {} per rank", format_bytes(m.device, true),
                     format_bytes(m.device_engine, true), format_bytes(m.pinned, true), format_bytes(m.nvme, true));
}

}  // namespace

std::string format_fit(const offload::FitResult& r, size_t runners_up) {
  std::string out;
  if (!r.ok()) {
    out += fmt::format("no config fits: {}\n", printable(r.missing, 2000));
    if (r.suggestions.empty()) {
      out += "no single change fits either (tried bf16, up to 64x the ranks, smaller micro batches): raise the caps\n";
    } else {
      out += "the smallest changes that fit:\n";
      for (const std::string& s : r.suggestions) out += fmt::format("  {}\n", printable(s, 2000));
    }
    out += "what bounds each placement:\n";
    for (const offload::FitCandidate& c : r.rejected)
      out += fmt::format("  {:<30} {}\n", c.label, printable(c.bound, 500));
    return out;
  }
  const offload::FitCandidate& best = r.fitting.front();
  out += fmt::format("fit: {} predicted {:.2f} ms per step; {}\n", best.label, best.predicted.step_ms,
                     printable(best.bound, 500));
  out += fmt::format("  memory: {}\n", mem_line(best.memory));
  out += fmt::format("changes ({}):\n", best.changes.size());
  for (const offload::FitChange& c : best.changes)
    out += fmt::format("  {}\n", printable(offload::describe_fit_change(c), 2000));
  if (r.fitting.size() > 1) {
    out += "runners-up:\n";
    for (size_t i = 1; i < r.fitting.size() && i <= runners_up; ++i) {
      const offload::FitCandidate& c = r.fitting[i];
      out += fmt::format("  {:<30} {:>10.2f} ms  {}\n", c.label, c.predicted.step_ms, printable(c.bound, 500));
    }
  }
  if (!r.rejected.empty()) {
    out += "do not fit:\n";
    for (const offload::FitCandidate& c : r.rejected)
      out += fmt::format("  {:<30} {}\n", c.label, printable(c.bound, 500));
  }
  return out;
}

nlohmann::ordered_json fit_to_json(const offload::FitResult& r) {
  auto cand = [](const offload::FitCandidate& c) {
    nlohmann::ordered_json j;
    j["label"] = c.label;
    j["fits"] = c.fits;
    j["predicted_step_ms"] = c.predicted.step_ms;
    j["bound"] = c.bound;
    j["memory"] = {{"device_bytes", c.memory.device},
                   {"device_engine_bytes", c.memory.device_engine},
                   {"pinned_bytes_per_rank", c.memory.pinned},
                   {"nvme_bytes_per_rank", c.memory.nvme}};
    j["changes"] = nlohmann::ordered_json::array();
    for (const offload::FitChange& ch : c.changes)
      j["changes"].push_back({{"key", ch.key}, {"before", ch.before}, {"after", ch.after}, {"reason", ch.reason}});
    return j;
  };
  nlohmann::ordered_json j;
  j["fits"] = r.ok();
  j["fitting"] = nlohmann::ordered_json::array();
  for (const auto& c : r.fitting) j["fitting"].push_back(cand(c));
  j["rejected"] = nlohmann::ordered_json::array();
  for (const auto& c : r.rejected) j["rejected"].push_back(cand(c));
  if (!r.ok()) {
    j["missing"] = r.missing;
    j["suggestions"] = r.suggestions;
  }
  return j;
}

namespace {

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) return parts;
    start = dot + 1;
  }
}

// Sets `path` in `doc` to `value`, renaming an alias the user wrote on the way (bfloat16 -> bf16).
void set_path(nlohmann::ordered_json& doc, const std::string& path, const nlohmann::ordered_json& value) {
  nlohmann::ordered_json* node = &doc;
  std::string prefix;
  const std::vector<std::string> parts = split_path(path);
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& name = parts[i];
    const std::string canonical = prefix.empty() ? name : prefix + "." + name;
    if (!node->is_object()) *node = nlohmann::ordered_json::object();
    if (const ConfigKey* key = find_config_key(canonical); key != nullptr && !node->contains(name)) {
      const std::string aliases(key->aliases);  // "a,~b": '~' marks a legacy name
      for (size_t b = 0; b < aliases.size();) {
        size_t e = aliases.find(',', b);
        if (e == std::string::npos) e = aliases.size();
        std::string a = aliases.substr(b, e - b);
        b = e + 1;
        if (!a.empty() && a.front() == '~') a.erase(0, 1);
        if (!a.empty() && node->contains(a)) {
          (*node)[name] = (*node)[a];
          node->erase(a);
        }
      }
    }
    if (i + 1 == parts.size()) {
      (*node)[name] = value;
      return;
    }
    node = &(*node)[name];
    prefix = canonical;
  }
}

const nlohmann::ordered_json* get_path(const nlohmann::ordered_json& doc, const std::string& path) {
  const nlohmann::ordered_json* node = &doc;
  for (const std::string& part : split_path(path)) {
    if (!node->is_object() || !node->contains(part)) return nullptr;
    node = &(*node)[part];
  }
  return node;
}

// Every "auto" in `user` (canonical paths) replaced by what `full` resolved it to.
void resolve_autos(nlohmann::ordered_json& node, const nlohmann::ordered_json& full, const std::string& prefix) {
  if (!node.is_object()) return;
  for (auto it = node.begin(); it != node.end(); ++it) {
    const std::string path = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object()) {
      resolve_autos(*it, full, path);
    } else if (it->is_string() && it->get<std::string>() == "auto") {
      const nlohmann::ordered_json* v = get_path(full, path);
      if (v != nullptr && !(v->is_string() && v->get<std::string>() == "auto")) *it = *v;
    }
  }
}

}  // namespace

nlohmann::ordered_json fitted_config_json(const nlohmann::ordered_json& user, const offload::FitCandidate& fitted) {
  nlohmann::ordered_json out = user.is_object() ? user : nlohmann::ordered_json::object();
  const nlohmann::ordered_json full = config_to_json(fitted.config);
  resolve_autos(out, full, "");
  for (const offload::FitChange& c : fitted.changes)
    if (const nlohmann::ordered_json* v = get_path(full, c.key); v != nullptr) set_path(out, c.key, *v);
  return out;
}

std::string fit_hint(const offload::FitRequest& req, const offload::FitCaps& caps, int stage, OffloadDevice optimizer,
                     OffloadDevice param, double ratio, DType dtype, const cpu_adam::MomentStorage& moments) {
  offload::FitCaps c = caps;
  if (c.nvme_bytes && c.nvme_path.empty()) c.nvme_path = "nvme_path";  // only the knobs are shown
  Result<offload::FitCandidate> f = offload::fit_placement(req, c, stage, optimizer, param, ratio, dtype, moments);
  if (!f.ok()) return f.status().message();
  if (!f->fits) return fmt::format("no knob fits it: {}", f->bound);
  std::string knobs;
  for (const offload::FitChange& ch : f->changes) {
    if (ch.key.rfind("strata.", 0) == 0 || ch.key.rfind("train_", 0) == 0 || ch.key == "gradient_accumulation_steps" ||
        ch.key.find("nvme_path") != std::string::npos || ch.key == "zero_optimization.stage" ||
        ch.key.find(".device") != std::string::npos || ch.key.find("enabled") != std::string::npos ||
        ch.key.find("ratio") != std::string::npos)
      continue;
    knobs += fmt::format("{}{} {} -> {}", knobs.empty() ? "" : ", ", ch.key.substr(ch.key.rfind('.') + 1), ch.before,
                         ch.after);
  }
  return knobs.empty() ? std::string("fits as is once the model's buffers are counted")
                       : fmt::format("fits with {}", knobs);
}

Result<Config> fit_train_config(const Config& base, const model::GptConfig& g, const FitFlags& flags,
                                uint64_t default_device_bytes, int world, int ranks_per_node, int micro_batch,
                                int seq, int grad_accum, bool dtype_given, std::string& report) {
  const auto& z = base.zero_optimization;
  const std::string config_nvme = !z.offload_optimizer.nvme_path.empty() ? z.offload_optimizer.nvme_path
                                                                         : z.offload_param.nvme_path;
  STRATA_ASSIGN_OR_RETURN(
      offload::FitCaps caps,
      fit_caps_from_flags(flags, base.strata.device_memory != 0 ? base.strata.device_memory : default_device_bytes,
                          base.strata.host_memory_budget, config_nvme, ranks_per_node));
  STRATA_ASSIGN_OR_RETURN(offload::FitRequest req,
                          gpt_fit_request(g, base, world, micro_batch, seq, grad_accum, offload::builtin_cpu_profile()));
  if (dtype_given) req.dtypes = {g.param_dtype};
  if (!flags.optimizer_states.empty()) {
    STRATA_ASSIGN_OR_RETURN(req.moment_storages, parse_moment_list(flags.optimizer_states, "--optimizer-states"));
  }
  if (!flags.grad_dtypes.empty()) {
    STRATA_ASSIGN_OR_RETURN(req.grad_dtypes, parse_dtype_list(flags.grad_dtypes, "--grad-dtypes", "gradient"));
  }
  STRATA_ASSIGN_OR_RETURN(offload::FitResult r, offload::fit_config(req, caps));
  if (!r.ok()) {
    std::string hint;
    for (const std::string& s : r.suggestions) hint += (hint.empty() ? "" : "; or ") + s;
    return ResourceExhausted(fmt::format("--fit: no config fits the caps (device {} per rank, host {}{}): {}{}",
                                         format_bytes(caps.device_bytes, true), format_bytes(caps.host_bytes, true),
                                         caps.nvme_bytes ? fmt::format(", nvme {}", format_bytes(*caps.nvme_bytes, true))
                                                         : std::string(", no --nvme-path"),
                                         r.missing, hint.empty() ? std::string("; raise the caps")
                                                                 : "; the smallest changes that fit: " + hint));
  }
  const offload::FitCandidate& best = r.fitting.front();
  report = fmt::format("fit      {}: predicted {:.2f} ms per step; {}; {}\n", best.label, best.predicted.step_ms,
                       printable(best.bound, 500), mem_line(best.memory));
  for (const offload::FitChange& c : best.changes)
    report += fmt::format("fit      {}\n", printable(offload::describe_fit_change(c), 2000));
  Config fitted = best.config;
  fitted.source = base.source.empty() ? std::string("--fit") : base.source + " (fitted)";
  return fitted;
}


Status check_output_path(const std::string& path, const char* flag) {
  if (path.empty()) return InvalidArgument(fmt::format("{} is empty: give the path of the file to write", flag));
  const std::string shown = printable(path, 256);
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode))
      return InvalidArgument(fmt::format("{} '{}' is a symbolic link; give the path of a plain file (Strata never "
                                         "writes through a link)",
                                         flag, shown));
    if (S_ISDIR(st.st_mode))
      return InvalidArgument(fmt::format("{} '{}' is a folder; give a file path inside it, e.g. '{}/NAME.json'", flag,
                                         shown, shown));
    // A FIFO would block the write at the end until something reads it; a device is no result file.
    if (!S_ISREG(st.st_mode))
      return InvalidArgument(fmt::format("{} '{}' is not a regular file ({}); give the path of a file to write",
                                         flag, shown, file_type_name(st.st_mode)));
  } else if (errno != ENOENT) {
    return ErrnoStatus(errno, fmt::format("{} '{}'", flag, shown));
  }
  const std::filesystem::path p(path);
  const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
  const std::string base = p.filename().string();
  if (base.empty() || base == "." || base == "..")
    return InvalidArgument(fmt::format("{} '{}' names no file", flag, shown));
  struct stat ds {};
  if (::stat(dir.c_str(), &ds) != 0 || !S_ISDIR(ds.st_mode))
    return InvalidArgument(fmt::format("{} '{}': its folder '{}' does not exist; create it first", flag, shown,
                                       printable(dir.string(), 256)));
  if (::access(dir.c_str(), W_OK) != 0)
    return ErrnoStatus(errno, fmt::format("{} '{}': its folder '{}' is not writable", flag, shown,
                                          printable(dir.string(), 256)));
  return Status::Ok();
}

Status write_file_atomically(const std::string& path, const std::string& text, const char* flag) {
  STRATA_RETURN_IF_ERROR(check_output_path(path, flag));
  const std::string shown = printable(path, 256);
  const std::filesystem::path p(path);
  const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
  const std::string base = p.filename().string();
  const std::string tmp = (dir / fmt::format(".{}.tmp.{}", base, ::getpid())).string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0)
    return ErrnoStatus(errno, fmt::format("{} '{}': cannot create a file in its folder '{}' (does the folder exist "
                                          "and is it writable?)",
                                          flag, shown, printable(dir.string(), 256)));
  size_t done = 0;
  int err = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      err = errno;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, fmt::format("{} '{}': writing the file", flag, shown));
  }
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::Ok();
}

}  // namespace strata::cli
