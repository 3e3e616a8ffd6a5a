// docs/config.md and the defaults document, generated from the key table.
#include <cmath>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "strata/core/config.h"
#include "strata/core/config_schema.h"

namespace strata {
namespace {

std::string number_text(double x) {
  if (x == std::floor(x) && std::fabs(x) < 1e15) return fmt::format("{}", static_cast<int64_t>(x));
  return fmt::format("{}", x);
}

std::string allowed_text(const ConfigKey& k) {
  std::string out;
  if (k.type == KeyType::kEnum) {
    std::string choices(k.choices);
    size_t pos = 0;
    while ((pos = choices.find('|', pos)) != std::string::npos) {
      choices.replace(pos, 1, ", ");
      pos += 2;
    }
    out = choices;
    if (k.has(kKeyCaseless)) out += " (any case)";
  } else if (k.type == KeyType::kInteger || k.type == KeyType::kNumber || k.type == KeyType::kNumberPair) {
    const bool lo = std::isfinite(k.min), hi = std::isfinite(k.max);
    const std::string lo_op = k.has(kKeyMinExclusive) ? ">" : "≥";
    const std::string hi_op = k.type == KeyType::kNumberPair ? "<" : "≤";
    if (lo && hi) out = fmt::format("{} {}, {} {}", lo_op, number_text(k.min), hi_op, number_text(k.max));
    else if (lo) out = fmt::format("{} {}", lo_op, number_text(k.min));
    else if (hi) out = fmt::format("{} {}", hi_op, number_text(k.max));
  } else if (k.type == KeyType::kBytes) {
    out = "bytes or \"256MiB\", \"80GB\"";
  }
  auto append = [&out](std::string_view more) {
    if (!out.empty()) out += "; ";
    out += more;
  };
  if (k.has(kKeyNullable)) append("null");
  if (k.has(kKeyAuto)) append("\"auto\"");
  return out;
}

std::string default_text(const ConfigKey& k) {
  if (!k.default_note.empty()) return std::string(k.default_note);
  return fmt::format("`{}`", k.default_json);
}

std::string meaning_text(const ConfigKey& k) {
  std::string out(k.meaning);
  if (!k.applies_to.empty()) {
    std::string types(k.applies_to);
    size_t pos = 0;
    while ((pos = types.find('|', pos)) != std::string::npos) {
      types.replace(pos, 1, ", ");
      pos += 2;
    }
    out += fmt::format(" Types: {}.", types);
  }
  if (!k.aliases.empty()) {
    std::string names;
    std::string_view rest = k.aliases;
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      std::string_view alias = rest.substr(0, comma);
      const bool legacy = !alias.empty() && alias.front() == '~';
      if (legacy) alias.remove_prefix(1);
      if (!names.empty()) names += ", ";
      names += fmt::format("`{}`{}", alias, legacy ? " (legacy, warns)" : "");
      rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    }
    out += fmt::format(" Also accepted as {}.", names);
  }
  if (k.has(kKeyRequired)) out += " Required.";
  if (k.has(kKeyDeprecated)) out += " (warns)";
  return out;
}

void table_rows(std::string& md, std::string_view parent) {
  md += "| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n";
  for (const ConfigKey& k : config_keys()) {
    if (k.type == KeyType::kSection || k.parent() != parent) continue;
    md += fmt::format("| `{}` | {} | {} | {} | {} |\n", k.name(), key_type_name(k.type), default_text(k), allowed_text(k),
                      meaning_text(k));
  }
}

}  // namespace

std::string config_keys_markdown() {
  std::string md;
  md += "# Config reference\n\n";
  md += "<!-- Generated from the key table in core/src/config_schema.cpp by `strata config defaults --markdown`.\n"
        "     Do not edit by hand: the test ConfigDocs.MarkdownIsUpToDate fails when this file differs. -->\n\n";
  md += "Strata reads DeepSpeed JSON configs (`ds_config.json`) strictly: every key below is known, typed and\n"
        "range-checked; an unknown key is an error naming its JSON path with a did-you-mean; a string where a\n"
        "boolean or number belongs (`\"false\"`, `\"1e9\"`) is an error; invalid combinations are errors that\n"
        "say the fix. Numbers written like `5e8` are accepted for integer keys when they are whole.\n"
        "Check a file with `strata config check FILE [--world-size N]`, print it resolved with\n"
        "`strata config show FILE`. Sizes in `zero_optimization` and the offload sections count elements,\n"
        "as in DeepSpeed; `aio.block_size` and the `strata` section count bytes. A byte key (type *bytes*)\n"
        "takes a whole number from 0 to 18446744073709551615 (2^64 - 1), kept exactly, or a size string such\n"
        "as `\"64GiB\"`; a negative, fractional or larger number is an error naming the key, never clamped.\n\n";
  md += "`\"auto\"` (written by the Hugging Face integration) is accepted where the *allowed* column says so.\n"
        "The batch keys resolve from each other and the world size; the bucket sizes resolve from the model's\n"
        "hidden size when known (h², 0.9 h², 10 h), else to their defaults; the rest stay unresolved\n"
        "(a warning) until the launcher supplies them.\n\n";
  md += "## Top level\n\n";
  table_rows(md, "");
  for (const ConfigKey& k : config_keys()) {
    if (k.type != KeyType::kSection) continue;
    md += fmt::format("\n## `{}`\n\n{}\n\n", k.path, meaning_text(k));
    table_rows(md, k.path);
  }
  md += "\n## Rules that join several keys\n\n"
        "- `offload_optimizer` needs stage 1, 2 or 3; `offload_param` below stage 3 has no effect (a warning;\n"
        "  DeepSpeed ignores it too) and resolves to `none`.\n"
        "- `device: \"nvme\"` needs `nvme_path`; `nvme_path` with another device is ignored (warning).\n"
        "- `offload_optimizer.ratio` below 1 needs stage 3.\n"
        "- `aio` is a top-level section; nested anywhere else it is an error that says so.\n"
        "- `fp16.enabled` and `bf16.enabled` cannot both be true.\n"
        "- `train_batch_size` = `train_micro_batch_size_per_gpu` × `gradient_accumulation_steps` × world size;\n"
        "  any two give the third, three that do not multiply out are an error showing the arithmetic.\n"
        "  `strata config check` takes the world size from `--world-size`; `strata train` from `--ranks`, under\n"
        "  `mpirun --backend mpi` from the MPI communicator, with `--backend nccl` from the launcher's\n"
        "  `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `STRATA_WORLD_SIZE` or `WORLD_SIZE`.\n"
        "- `max_grad_norm` inside `optimizer.params` is an error: use the top-level `gradient_clipping`.\n"
        "- Optimizer and scheduler parameters must belong to the chosen type; required scheduler parameters\n"
        "  must be given.\n"
        "- Deprecated `cpu_offload`, `cpu_offload_param`, `cpu_offload_use_pin_memory` map to the offload\n"
        "  sections with a warning, and are an error together with the section they replace.\n"
        "- `stage3_*` keys below stage 3, ZeRO++ and `use_gds` settings are accepted with a warning: they have\n"
        "  no effect.\n"
        "- DeepSpeed mechanisms Strata does not have are accepted with a warning that says why they have no\n"
        "  effect: `allgather_bucket_size` and `stage3_model_persistence_threshold` whenever given,\n"
        "  `reduce_scatter: false`, `round_robin_gradients: true`.\n"
        "- Duplicate keys in one object are an error.\n"
        "- `reduce_bucket_size: 0` is DeepSpeed's \"each gradient reduced on its own\": Strata's bucket is never\n"
        "  smaller than one layer, so 0 (like 1) reduces each layer's gradients on their own.\n"
        "- Every other key of DeepSpeed's config is known too: [deepspeed-keys.md](deepspeed-keys.md) lists them\n"
        "  with what Strata does (a warning when it has no effect, an error when it turns on a feature that\n"
        "  changes what training computes).\n";
  return md;
}

nlohmann::ordered_json config_defaults_json() {
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  for (const ConfigKey& k : config_keys()) {
    if (k.type == KeyType::kSection || k.has(kKeyDeprecated) || k.has(kKeyIgnored)) continue;
    if (k.parent() == "scheduler.params") continue;  // no scheduler by default
    if (k.parent() == "optimizer.params" && !k.applies_to.empty() &&
        k.applies_to.find("Adam") == std::string_view::npos) {
      continue;  // the default optimizer is Adam
    }
    nlohmann::ordered_json* node = &root;
    std::string_view path = k.path;
    size_t start = 0;
    while (true) {
      const size_t dot = path.find('.', start);
      const std::string part(path.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
      node = &(*node)[part];
      if (dot == std::string_view::npos) break;
      start = dot + 1;
    }
    *node = nlohmann::ordered_json::parse(k.default_json);
  }
  return root;
}

}  // namespace strata
