#pragma once
// Checkpoints: the on-disk format, its reader and verifier. The engine
// writes them (Engine::save_checkpoint, engine.h) and reads them back
// (Engine::load_checkpoint); `strata checkpoint inspect|verify|export` use
// the reader alone.
//
// Note [Checkpoint layout]
//   DIR/latest               the newest complete tag, one line; replaced last
//   DIR/TAG/manifest.json    what the checkpoint is (below)
//   DIR/TAG/rankNNNNN.model  fp32 master weights of rank N's pieces
//   DIR/TAG/rankNNNNN.optim  fp32 exp_avg then exp_avg_sq of the same pieces
//   DIR/.tmp-TAG-RUN/        a save in progress (never read; a crash leaves it)
// The state is stored world-independent: an extent is a run of one layer's
// flat elements [begin, begin + count) — fp32 whatever the parameter and
// moment dtypes were — so a checkpoint of world size N loads at any world
// size M, stage or placement: each rank reads the extents its new pieces
// overlap. 16-bit parameters are not stored: they are the master rounded to
// their dtype, which is how the engine derives them after every step.
//
// Note [Frozen layers in checkpoints]
// A frozen layer (TensorDescription::trainable false: a LoRA base, a frozen
// embedding) never changes, so a checkpoint does not store it: the manifest
// lists it with "frozen": true and no extents (DeepSpeed's
// exclude_frozen_parameters). Loading takes its values from the model the
// engine was given (put_initial_layer), and a checkpoint whose frozen layers
// are not this model's frozen layers is refused, naming the layer: a layer
// trained in the checkpoint but frozen here would drop its trained values,
// one frozen there but trained here has none to load. Whether the frozen
// values are the same is the caller's to check (strata.torch stores a hash
// of each frozen layer in the manifest's app data and compares it at load).
//
// Note [Checkpoint atomicity]
// Every rank writes only its own files into the save's temporary folder,
// fsyncs them and then its rankNNNNN.json (sizes, XXH3 checksums, extents).
// Rank 0 waits for every rank's report, writes manifest.json (temporary
// name, fsync, rename), renames the folder to TAG, fsyncs DIR, then replaces
// `latest` the same way. A crash at any moment leaves either no TAG (the
// temporary folder is never read) or a complete one, and `latest` names a
// complete tag throughout.
#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/core/status.h"

namespace strata::offload {

inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr const char* kCheckpointFormatName = "strata-checkpoint";
// A manifest larger than this is refused unread (a user's file: bounded).
inline constexpr uint64_t kMaxManifestBytes = 256ull << 20;

// The state kinds a checkpoint stores per element.
enum class CheckpointState : uint8_t { kMaster, kExpAvg, kExpAvgSq };

struct CheckpointFile {
  std::string name;   // "rank00000.model"
  int rank = 0;
  bool model = true;  // .model (master) or .optim (moments)
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;  // of the whole file
};

struct CheckpointExtent {
  size_t file = 0;    // index into files
  size_t layer = 0;
  uint64_t begin = 0, count = 0;  // layer elements
  uint64_t offset = 0;            // bytes into the file
  uint64_t xxh3 = 0;              // of the extent's bytes (count x 4, or 2 x count x 4 for .optim)
};

struct CheckpointLayer {
  std::string name;
  uint64_t elements = 0;
  std::string dtype;  // the parameters' dtype when saved ("bf16")
  // A frozen layer (no optimizer state; Note [Frozen layers in checkpoints]):
  // no extents, its values are the model's own at load.
  bool frozen = false;
};

// Counters the engine restores on resume (besides the tensors).
struct CheckpointScalars {
  // The engine's two counters, under the engine's names (Engine::optimizer_steps,
  // Engine::steps_begun); the manifest keeps its keys "step" and "step_calls".
  int64_t optimizer_steps = 0;  // optimizer updates applied
  int64_t steps_begun = 0;      // steps begun (skipped fp16 steps included)
  // Micro-batches the model's runner had drawn (ModelRunner::data_position);
  // null when the engine had no runner or its runner could not tell.
  std::optional<uint64_t> data_position;
  double loss_scale = 1;
  int64_t scaler_iteration = 0, scaler_last_overflow = -1, scaler_hysteresis_left = 1, scaler_overflow_count = 0;
};

struct CheckpointManifest {
  int version = kCheckpointFormatVersion;
  std::string tag;
  int world_size = 1;
  int stage = 0;
  std::string offload_optimizer, offload_param, moment_dtype, optimizer;
  int64_t sub_group_size = 0;
  CheckpointScalars scalars;
  std::vector<CheckpointLayer> layers;
  std::vector<CheckpointFile> files;
  std::vector<CheckpointExtent> extents;  // every layer tiled exactly, per kind
  nlohmann::json app = nlohmann::json::object();  // what the caller stored (strata train: config, model, data)

  nlohmann::json to_json() const;
  // Checks the structure completely: format name and version (a newer
  // version is refused with the version it needs), every key's type and
  // range, files and extents that exist and do not overlap, every layer
  // tiled exactly by the extents of each kind. `source` names the file.
  static Result<CheckpointManifest> from_json(const nlohmann::json& j, const std::string& source);
  uint64_t extent_bytes(const CheckpointExtent& e) const { return e.count * (files[e.file].model ? 4 : 8); }
  uint64_t total_bytes() const;
};

// A checkpoint tag folder resolved from what a user gave: DIR (its `latest`),
// DIR/TAG, or a folder holding manifest.json. Never follows a symbolic link
// for the tag folder or its files.
Result<std::filesystem::path> resolve_checkpoint(const std::filesystem::path& dir_or_tag);

// Reads and checks a tag folder's manifest and the sizes of its files.
class CheckpointReader {
 public:
  static Result<CheckpointReader> open(const std::filesystem::path& dir_or_tag);
  const CheckpointManifest& manifest() const { return manifest_; }
  const std::filesystem::path& folder() const { return folder_; }
  // Elements [begin, begin + out.size()) of `layer`'s `kind` state, as fp32.
  // Reads each overlapped extent whole and checks its checksum (DataLoss
  // naming the file, the layer and the extent); keeps the last extent read
  // of each file kind, so walking a layer in order reads each extent once.
  Status read(size_t layer, CheckpointState kind, uint64_t begin, std::span<float> out);
  // Every file's and extent's checksum; DataLoss naming the first bad one.
  Status verify();

 private:
  std::filesystem::path folder_;
  CheckpointManifest manifest_;
  // Per layer and kind (model, optim): extent indices sorted by begin, for
  // a binary search (a checkpoint of many ranks has many extents).
  std::vector<std::array<std::vector<size_t>, 2>> index_;
  // The last extent read per file kind (model, optim), for sequential walks
  // that alternate master and moments.
  std::array<size_t, 2> cached_extent_{SIZE_MAX, SIZE_MAX};
  std::array<std::vector<float>, 2> cached_;
};

// Validates a tag name: [A-Za-z0-9._-], 1..128 characters, not starting with '.'.
Status check_checkpoint_tag(const std::string& tag);
// "global_step12": the default tag of a save after `step` steps (DeepSpeed's naming).
std::string default_checkpoint_tag(int64_t steps_begun);

// The temporary folder of a save that did not finish (".tmp-TAG-PID" inside
// a --save-dir): PID is the saving run's rank-0 process.
struct InterruptedSave {
  std::string name;  // ".tmp-global_step8-1234"
  std::string tag;
  int64_t pid = 0;
  bool running = false;  // a process with that id runs on this machine (the save may be in progress)
};
// The interrupted saves directly inside `dir` (never following a link).
Result<std::vector<InterruptedSave>> find_interrupted_saves(const std::filesystem::path& dir);
// Removes one of them: only a real folder directly inside `dir` whose name
// is an interrupted save's; refuses one whose process still runs.
Status remove_interrupted_save(const std::filesystem::path& dir, const InterruptedSave& save);

// A checksum as the manifest writes it (16 lower-case hex digits), and back;
// the error names `what`.
std::string hex64(uint64_t v);
Result<uint64_t> parse_hex64(const nlohmann::json& v, const std::string& what);

}  // namespace strata::offload
