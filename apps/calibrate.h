#pragma once
// strata report --calibrate: measures this machine's component rates and
// writes a hardware profile (strata/offload/hardware_profile.h) for
// `strata plan`. report_calibrate.cpp; docs/offload-bench.md.
#include <string>

namespace strata::cli {

struct CalibrateOptions {
  bool requested = false;  // --calibrate
  std::string path;     // folder for the NVMe measurement ("" : the system's temporary folder, said in the profile)
  std::string out;      // profile file ("" : print it)
  bool out_given = false;  // --out was given (an empty --out is refused, not taken as "print it")
  std::string preset = "small";  // the model whose shapes the compute rate is measured on
  int batch = 4, seq = 64, steps = 9;  // compute: the median of `steps` steps after one warm-up
  int ranks = 1;  // local ranks sharing this machine during the compute measurement
  std::string config;  // a DeepSpeed config whose aio section the NVMe measurement uses ("": the defaults)
  std::string dtype = "bf16";  // --calibrate-dtype: the parameter dtype the compute is timed in
  std::string device = "cpu";  // --calibrate-device: cpu, cuda or auto: where the copies go and the model computes
  int device_threads = 0;     // --calibrate-device-threads: the cpu device's compute threads (0: every core)
  int optimizer_threads = 0;  // --calibrate-optimizer-threads: the CPU Adam rates' threads (0: every core)
};

// Returns the process exit code; errors go to stderr naming the culprit.
int run_calibrate(const CalibrateOptions& options);

}  // namespace strata::cli
