// strata checkpoint inspect|verify|export|clean: what a --save-dir holds, whether
// it is intact, and the model out of it as a Hugging Face GPT-2 folder.
//
//   strata checkpoint inspect DIR[/TAG] [--json]
//   strata checkpoint verify  DIR[/TAG]
//   strata checkpoint export  DIR[/TAG] --out OUT [--dtype fp32|bf16] [--overwrite]
//   strata checkpoint clean   DIR [--dry-run]
//
// DIR resolves to its `latest` tag (offload/checkpoint.h). export streams
// one layer's fp32 master at a time from the rank shards into
// model.safetensors (docs/export.md).
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "command.h"
#include "strata/core/dtype.h"
#include "strata/core/printable.h"
#include "strata/core/units.h"
#include "strata/model/gpt_config.h"
#include "strata/model/hf_export.h"
#include "strata/offload/checkpoint.h"

namespace strata::cli {
namespace {

struct CheckpointCliOptions {
  std::string path;
  bool json = false;
  std::string out;
  std::string dtype = "fp32";
  bool overwrite = false;
  bool dry_run = false;
};

int fail(const char* sub, const Status& st) {
  fmt::print(stderr, "strata checkpoint {}: error: {}\n", sub, printable_message(st.to_string()));
  return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

int run_inspect(const CheckpointCliOptions& o) {
  Result<offload::CheckpointReader> r = offload::CheckpointReader::open(o.path);
  if (!r.ok()) return fail("inspect", r.status());
  const offload::CheckpointManifest& m = r->manifest();
  if (o.json) {
    nlohmann::json j = m.to_json();
    j["folder"] = r->folder().string();
    j["total_bytes"] = m.total_bytes();
    fmt::print("{}\n", j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace));
    return 0;
  }
  fmt::print("checkpoint '{}' (format version {})\n", printable(r->folder().string(), 256), m.version);
  fmt::print("  tag {}: step {} ({} step calls, {} skipped), data position {}\n", m.tag, m.scalars.optimizer_steps,
             m.scalars.steps_begun, m.scalars.scaler_overflow_count,
             m.scalars.data_position ? fmt::format("{} micro-batches", *m.scalars.data_position)
                                     : std::string("none (the caller kept its own)"));
  fmt::print("  saved by {} rank{}: stage {}, optimizer {} on {}, params on {}, moments {}, sub_group_size {}\n",
             m.world_size, m.world_size == 1 ? "" : "s", m.stage, m.optimizer, m.offload_optimizer, m.offload_param,
             m.moment_dtype, m.sub_group_size);
  fmt::print("  loss scale {:g}\n", m.scalars.loss_scale);
  uint64_t elements = 0, frozen_elements = 0;
  size_t frozen = 0;
  for (const offload::CheckpointLayer& l : m.layers) {
    elements += l.elements;
    if (l.frozen) ++frozen, frozen_elements += l.elements;
  }
  fmt::print("  model: {} layers, {} parameters", m.layers.size(), elements);
  if (frozen != 0)
    fmt::print(" ({} frozen layer{} of {} parameters not stored: their values are the model's own)", frozen,
               frozen == 1 ? "" : "s", frozen_elements);
  if (m.app.is_object() && m.app.contains("model")) fmt::print(" ({})", printable(m.app["model"].dump(), 256));
  fmt::print("\n  files ({} in all):\n", format_bytes(m.total_bytes(), true));
  for (const offload::CheckpointFile& f : m.files)
    fmt::print("    {:<18} rank {:>4}  {:>12}  xxh3 {}\n", f.name, f.rank, format_bytes(f.bytes, true),
               offload::hex64(f.xxh3));
  fmt::print("  {} extents; run `strata checkpoint verify` to check every checksum\n", m.extents.size());
  // Saves that were killed leave their temporary folder beside the tags.
  Result<std::vector<offload::InterruptedSave>> left = offload::find_interrupted_saves(r->folder().parent_path());
  if (left.ok())
    for (const offload::InterruptedSave& t : *left)
      fmt::print("  interrupted save of tag {} (never read): {} — {}\n", printable(t.tag, 128), printable(t.name, 160),
                 t.running ? fmt::format("process {} still runs", t.pid)
                           : std::string("`strata checkpoint clean` removes it"));
  return 0;
}

int run_verify(const CheckpointCliOptions& o) {
  Result<offload::CheckpointReader> r = offload::CheckpointReader::open(o.path);
  if (!r.ok()) return fail("verify", r.status());
  const Status st = r->verify();
  if (!st.ok()) return fail("verify", st);
  fmt::print("checkpoint '{}': {} files, {} extents, {} verified (XXH3)\n", printable(r->folder().string(), 256),
             r->manifest().files.size(), r->manifest().extents.size(), format_bytes(r->manifest().total_bytes(), true));
  return 0;
}

// The GPT's shape as `strata train` recorded it in the manifest.
Result<model::GptConfig> gpt_of(const offload::CheckpointManifest& m) {
  const nlohmann::json& app = m.app;
  if (!app.is_object() || !app.contains("model") || !app["model"].is_object())
    return FailedPrecondition("the checkpoint does not record a GPT's shape (it was not saved by strata train); "
                              "export needs one");
  const nlohmann::json& j = app["model"];
  model::GptConfig g;
  auto field = [&](const char* key, int& out) -> Status {
    if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < 1 ||
        j[key].get<int64_t>() > (int64_t{1} << 30))
      return InvalidArgument(fmt::format("checkpoint manifest app.model.{} is missing or out of range", key));
    out = static_cast<int>(j[key].get<int64_t>());
    return Status::Ok();
  };
  STRATA_RETURN_IF_ERROR(field("n_layer", g.n_layer));
  STRATA_RETURN_IF_ERROR(field("n_head", g.n_head));
  STRATA_RETURN_IF_ERROR(field("n_embd", g.n_embd));
  STRATA_RETURN_IF_ERROR(field("vocab_size", g.vocab_size));
  STRATA_RETURN_IF_ERROR(field("max_seq_len", g.max_seq_len));
  STRATA_RETURN_IF_ERROR(g.validate());
  return g;
}

int run_export(const CheckpointCliOptions& o) {
  if (o.out.empty()) return fail("export", InvalidArgument("--out OUT is required (the folder to write)"));
  Result<DType> dt = parse_dtype(o.dtype);
  if (!dt.ok() || (*dt != DType::kF32 && *dt != DType::kBF16))
    return fail("export", InvalidArgument(fmt::format("--dtype '{}' is not fp32 or bf16", printable(o.dtype, 32))));
  Result<offload::CheckpointReader> r = offload::CheckpointReader::open(o.path);
  if (!r.ok()) return fail("export", r.status());
  Result<model::GptConfig> g = gpt_of(r->manifest());
  if (!g.ok()) return fail("export", g.status());
  model::HfExportOptions eo;
  eo.dtype = *dt;
  eo.overwrite = o.overwrite;
  const size_t layers = r->manifest().layers.size();
  const Status st = model::export_hf_gpt2(
      *g, o.out,
      [&](size_t layer, std::span<float> out) -> Status {
        if (layer >= layers || out.size() != r->manifest().layers[layer].elements)
          return FailedPrecondition(fmt::format("the checkpoint's layer {} does not match the recorded GPT shape", layer));
        return r->read(layer, offload::CheckpointState::kMaster, 0, out);
      },
      eo);
  if (!st.ok()) return fail("export", st);
  fmt::print("exported '{}' tag {} (step {}) to '{}': model.safetensors ({}) and config.json; load it with "
             "transformers.GPT2LMHeadModel.from_pretrained (docs/export.md)\n",
             printable(r->folder().string(), 256), r->manifest().tag, r->manifest().scalars.optimizer_steps,
             printable(o.out, 256), dtype_name(*dt));
  return 0;
}

int run_clean(const CheckpointCliOptions& o) {
  Result<std::vector<offload::InterruptedSave>> left = offload::find_interrupted_saves(o.path);
  if (!left.ok()) return fail("clean", left.status());
  int kept = 0, removed = 0;
  for (const offload::InterruptedSave& t : *left) {
    if (t.running) {
      fmt::print("kept     {} (process {} still runs: its save may be in progress)\n", printable(t.name, 160), t.pid);
      ++kept;
      continue;
    }
    if (o.dry_run) {
      fmt::print("would remove {} (interrupted save of tag {})\n", printable(t.name, 160), printable(t.tag, 128));
      continue;
    }
    const Status st = offload::remove_interrupted_save(o.path, t);
    if (!st.ok()) return fail("clean", st);
    fmt::print("removed  {} (interrupted save of tag {})\n", printable(t.name, 160), printable(t.tag, 128));
    ++removed;
  }
  fmt::print("{}: {} interrupted save(s) removed, {} kept; complete tags and `latest` are never touched\n",
             printable(o.path, 256), removed, kept);
  return 0;
}

CommandRegistration checkpoint_command("checkpoint", [](CLI::App& root) {
  CLI::App* group = root.add_subcommand("checkpoint", "Inspect, verify or export checkpoints of strata train --save-dir");
  group->require_subcommand(1);
  {
    auto o = std::make_shared<CheckpointCliOptions>();
    CLI::App* cmd = group->add_subcommand("inspect", "Print a checkpoint's manifest: step, placement, files, sizes");
    cmd->add_option("path", o->path, "DIR (its latest tag) or DIR/TAG")->required();
    cmd->add_flag("--json", o->json, "Print the manifest as JSON");
    cmd->callback([o] { exit_with(run_inspect(*o)); });
  }
  {
    auto o = std::make_shared<CheckpointCliOptions>();
    CLI::App* cmd = group->add_subcommand("verify", "Check every file's and extent's XXH3 checksum");
    cmd->add_option("path", o->path, "DIR (its latest tag) or DIR/TAG")->required();
    cmd->callback([o] { exit_with(run_verify(*o)); });
  }
  {
    auto o = std::make_shared<CheckpointCliOptions>();
    CLI::App* cmd = group->add_subcommand(
        "clean", "Remove the temporary folders of saves that were interrupted (their process no longer runs)");
    cmd->add_option("path", o->path, "The --save-dir folder")->required();
    cmd->add_flag("--dry-run", o->dry_run, "Only say what would be removed");
    cmd->callback([o] { exit_with(run_clean(*o)); });
  }
  {
    auto o = std::make_shared<CheckpointCliOptions>();
    CLI::App* cmd = group->add_subcommand(
        "export", "Write the model as a Hugging Face GPT-2 folder (model.safetensors + config.json)");
    cmd->add_option("path", o->path, "DIR (its latest tag) or DIR/TAG")->required();
    cmd->add_option("--out", o->out, "The folder to write (created one level deep if missing)")->required();
    cmd->add_option("--dtype", o->dtype, "fp32 | bf16")->capture_default_str();
    cmd->add_flag("--overwrite", o->overwrite, "Replace model.safetensors / config.json already in --out");
    cmd->callback([o] { exit_with(run_export(*o)); });
  }
});

}  // namespace
}  // namespace strata::cli
