// Engine selection: probing what works here and building the chosen engine.
#include <fmt/format.h>

#include "engine_core.h"

namespace strata::nvme {

#ifndef STRATA_NVME_HAVE_URING
bool uring_compiled() { return false; }
Status probe_uring() { return Unsupported("built without liburing (install liburing-dev and rebuild)"); }
Result<std::unique_ptr<Backend>> make_uring_backend(const BackendConfig&, std::vector<std::string>&) {
  return Unsupported("io_uring engine: built without liburing (install liburing-dev and rebuild)");
}
#endif
#ifndef STRATA_NVME_HAVE_AIO
bool aio_compiled() { return false; }
Status probe_aio() { return Unsupported("built without libaio (install libaio-dev and rebuild)"); }
Result<std::unique_ptr<Backend>> make_aio_backend(const BackendConfig&, std::vector<std::string>&) {
  return Unsupported("libaio engine: built without libaio (install libaio-dev and rebuild)");
}
#endif

std::vector<EngineProbe> probe_engines() {
  std::vector<EngineProbe> probes;
  auto add = [&](EngineKind kind, bool compiled, const Status& st, const char* ok_detail) {
    EngineProbe p{kind, compiled, compiled && st.ok(), ""};
    p.detail = !compiled ? std::string("not built") : st.ok() ? std::string(ok_detail) : st.message();
    probes.push_back(std::move(p));
  };
  add(EngineKind::kIoUring, uring_compiled(), uring_compiled() ? probe_uring() : Status::Ok(),
      "ring created, NOP completed");
  add(EngineKind::kLibaio, aio_compiled(), aio_compiled() ? probe_aio() : Status::Ok(), "io_setup succeeded");
  add(EngineKind::kPsync, true, Status::Ok(), "pread/pwrite thread pool (always available)");
  return probes;
}

EngineChoice choose_engine() {
  std::vector<EngineProbe> probes = probe_engines();
  std::string why_not;
  for (const EngineProbe& p : probes) {
    if (p.works) {
      EngineChoice choice{p.kind, ""};
      if (p.kind == EngineKind::kIoUring) {
        choice.reason = "io_uring works here (batched submission, fixed files, registered buffers)";
      } else {
        choice.reason = fmt::format("{} is the best engine that works here; {}", engine_kind_name(p.kind), why_not);
      }
      return choice;
    }
    if (!why_not.empty()) why_not += "; ";
    why_not += fmt::format("{} unavailable: {}", engine_kind_name(p.kind), p.detail);
  }
  return EngineChoice{EngineKind::kPsync, why_not};
}

Result<std::unique_ptr<IoEngine>> make_io_engine(const IoEngineOptions& options) {
  EngineKind kind = options.engine;
  if (kind == EngineKind::kAuto) kind = choose_engine().kind;
  return make_scheduled_engine(options, kind, nullptr);
}

}  // namespace strata::nvme
