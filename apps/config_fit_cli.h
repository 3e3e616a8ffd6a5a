#pragma once
// What `strata plan --fit` and `strata train --fit` share: the caps from the
// flags, the reference GPT as a fit request (its layers, FLOPs and the
// device bytes the model itself holds), the report, and writing the fitted
// config atomically. The search is offload's fit_config (config_fit.h).
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "strata/core/config.h"
#include "strata/core/status.h"
#include "strata/model/gpt_config.h"
#include "strata/offload/config_fit.h"

namespace strata::cli {

// The caps flags as given ("" = not given).
struct FitFlags {
  std::string device_memory;  // --device-memory, per rank
  std::string host_memory;    // --host-memory, per node (this process's ranks share it)
  std::string nvme_path;      // --nvme-path DIR: free space from statvfs
  std::string nvme_size;      // --nvme-size Z: the space to plan for, instead of the folder's free space
  std::string dtypes;         // --dtype list the search may use ("" = the config's)
  std::string optimizer_states;  // --optimizer-states list the search may use ("" = the config's)
  std::string grad_dtypes;       // --grad-dtypes list the search may use ("" = the config's)
};

// Caps from the flags, with `fallback_*` (the config's strata.device_memory /
// host_memory_budget, 0 = none) when a flag is not given. Every number is
// range-checked; errors name the flag and the fix.
Result<offload::FitCaps> fit_caps_from_flags(const FitFlags& flags, uint64_t fallback_device, uint64_t fallback_host,
                                             const std::string& config_nvme_path, int ranks_per_node);

// The bytes the reference GPT's executor holds on the device beside the
// engine for a micro batch: its activations, activation gradients and token
// ids (allocated at creation) and one fp32 working copy per distinct layer
// size of the parameters (when not fp32) and of the gradients (when not fp32),
// each rounded up to the device's allocation alignment.
uint64_t gpt_device_reserve_bytes(const model::GptConfig& g, DType param, DType grad, int micro_batch, int seq,
                                  uint64_t alignment = 256);

// The fit request for the reference GPT `g` (layers in any dtype).
Result<offload::FitRequest> gpt_fit_request(const model::GptConfig& g, const Config& config, int world, int micro_batch,
                                            int seq, int grad_accum, const offload::HardwareProfile& profile);


// The report: changes with reasons, runners-up and their bounds, or what
// is missing and the suggestions. `runners_up` caps the list.
std::string format_fit(const offload::FitResult& result, size_t runners_up = 5);
nlohmann::ordered_json fit_to_json(const offload::FitResult& result);

// The fitted config as the file to write: the user's own JSON (`user`, {}
// when none) with each changed key set (an alias the user wrote renamed to
// the canonical name), every "auto" replaced by the value it resolved to, and
// the caps (strata.device_memory, strata.host_memory_budget) written in.
nlohmann::ordered_json fitted_config_json(const nlohmann::ordered_json& user, const offload::FitCandidate& fitted);

// `strata train --fit`: `base` (the user's config, or defaults) fitted to the
// caps of `flags` for the run's model, world, batch; the report of the
// changes goes to `report`. No fit is an error saying what is missing and
// the smallest changes that fit. `ranks_per_node`: the ranks sharing the host cap.
Result<Config> fit_train_config(const Config& base, const model::GptConfig& g, const FitFlags& flags,
                                uint64_t default_device_bytes, int world, int ranks_per_node, int micro_batch,
                                int seq, int grad_accum, bool dtype_given, std::string& report);

// For a placement row that does not fit (`strata plan`, `strata estimate`):
// the knobs that make it fit, "reduce_bucket_size 500000000 -> 589824,
// ...", or why none does (the fit's shortfall at the knobs' floors). The
// device cap counts the model's own buffers (activations) as the run does.
std::string fit_hint(const offload::FitRequest& request, const offload::FitCaps& caps, int stage,
                     OffloadDevice optimizer, OffloadDevice param, double ratio, DType dtype,
                     const cpu_adam::MomentStorage& moments);

// What write_file_atomically refuses, checked before any work: a folder, a
// symlink, a missing or unwritable parent folder.
Status check_output_path(const std::string& path, const char* flag);

// Writes `text` to `path` atomically: a temp file in the same folder, fsync,
// rename over `path`, fsync the folder. Refuses a folder, a symlink (never
// followed out of the folder) and a missing parent; errors name `flag`.
Status write_file_atomically(const std::string& path, const std::string& text, const char* flag);

}  // namespace strata::cli
