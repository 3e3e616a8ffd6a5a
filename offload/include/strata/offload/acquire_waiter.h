#pragma once
// Who waits for the layer an acquire lends (Engine::acquire's third
// argument).
//
// Note [Who waits for an acquired layer]
// The step metrics' exposed waits (wait_optimizer_ms, wait_gather_ms,
// optimizer_waits) time a layer's wait from the moment the model reaches
// it to the moment its parameters are ready, split at the moment its
// update was in place. "Reaches" depends on who waits:
//   the engine's model stream   (the default; Engine::create's
//                               model_stream): when that stream runs up to
//                               the acquire, as the built-in runner's
//                               passes do; no model stream, no probe;
//   the host                    the caller blocks on `ready` at once (a
//                               driven caller on the cpu device, such as
//                               strata.torch there): the acquire's moment;
//   a stream of the caller's    queued work waits for `ready` on it (torch's
//                               current stream on a GPU): when that stream
//                               runs up to the acquire (a host function on
//                               it, only for a layer not ready yet).
// The waiter only decides when the probe starts: what is lent, and when it
// is ready, is the same for all three. A probe that cannot be queued on its
// stream is dropped (the acquire stands). On a GPU the host function runs
// on CUDA's one callback thread, as the engine's other host functions do: a
// cost to measure on the first run (a pair of timing events would avoid it).
#include "strata/core/device.h"

namespace strata::offload {

class AcquireWaiter {
 public:
  static AcquireWaiter model_stream() { return AcquireWaiter(Kind::kModelStream, nullptr); }
  static AcquireWaiter host() { return AcquireWaiter(Kind::kHost, nullptr); }
  // `stream` must outlive the acquire call (the probe is queued on it there).
  static AcquireWaiter stream(Stream& stream) { return AcquireWaiter(Kind::kStream, &stream); }

  bool is_host() const { return kind_ == Kind::kHost; }
  // The stream the probe is queued on: the caller's, else `engines_model_stream` (may be null: no probe).
  Stream* stream_or(Stream* engines_model_stream) const {
    return kind_ == Kind::kStream ? stream_ : kind_ == Kind::kModelStream ? engines_model_stream : nullptr;
  }

 private:
  enum class Kind { kModelStream, kHost, kStream };
  AcquireWaiter(Kind kind, Stream* stream) : kind_(kind), stream_(stream) {}
  Kind kind_;
  Stream* stream_;
};

}  // namespace strata::offload
