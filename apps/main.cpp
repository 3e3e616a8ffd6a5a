// strata: command line of the Strata offload engine. Subcommands register
// themselves (see command.h); this file only builds the parser and runs it.
#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <exception>
#include <new>
#include <system_error>

#include "command.h"
#include "flag_guards.h"
#include "strata/core/printable.h"
#include "strata/core/build_info.h"

int main(int argc, char** argv) {
  // CUDA loads a kernel at its first launch by default, and loading may wait
  // for the whole device, which a stream gated on host work never lets go
  // idle. Strata loads its own kernels up front (docs/core.md); cuBLAS's are
  // loaded at context creation instead, set here before any thread starts
  // and any CUDA call. A user's CUDA_MODULE_LOADING wins (overwrite = 0).
  // Cost measured on an H200: a tiny run took 4 s instead of 1 s
  // (docs/gpu-results.md, run 3).
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  // A stream parked on a gate (cuStreamWaitValue32) holds up every stream
  // that CUDA maps onto the same hardware queue, and there are 8 by default.
  // A rank has up to six streams of its own, plus three NCCL queues and
  // NCCL's internal streams, so the maximum of 32 queues keeps the gated
  // streams from sharing one with those that would release them. A user's
  // setting wins. Not measured to matter yet: the H200 run had one rank and
  // ran the same with 8 and 32 (docs/gpu-results.md, run 2).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  CLI::App app{"strata: heterogeneous memory offload engine for training large models"};
  app.set_version_flag("--version", std::string(strata::build_info().version));
  app.require_subcommand(1);
  // CLI11's own errors quote the offending value as typed; escape sequences in
  // it would reach the terminal.
  app.failure_message([](const CLI::App* failed, const CLI::Error& e) {
    return strata::printable_message(strata::cli::parse_failure_message(failed, e));
  });
  auto& commands = strata::cli::registered_commands();
  std::sort(commands.begin(), commands.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [name, setup] : commands) setup(app);
  strata::cli::guard_number_flags(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "strata: error: out of host memory (an allocation failed); the run needs more memory than this "
                 "machine or its limits give: use a smaller model (--preset), --batch or --seq, or offload less to "
                 "the host; `strata estimate` shows the footprint\n");
    return 1;
  } catch (const std::system_error& e) {
    std::fprintf(stderr, "strata: error: %s (the system refused a resource: threads, files or memory; check ulimit)\n",
                 strata::printable_message(e.what()).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata: error: %s\n", strata::printable_message(e.what()).c_str());
    return 1;
  }
  return 0;
}
