#pragma once
// Another library's stream (torch's current CUDA stream) seen as a Stream of
// a Device, so engine work and waits can be put in its order.
//
// Note [Borrowed streams]
// A borrowed stream does not own the handle: destroying it waits for the
// work this wrapper issued (its host gates read memory it owns) and leaves
// the stream itself to its owner. Work issued through it interleaves with
// the owner's own work in issue order, as CUDA orders one stream; so
// `wait(completion)` makes the owner's later kernels wait too, and
// `record_completion()` completes once the owner's earlier kernels have run.
// That is how strata.torch orders torch's kernels against the engine's
// without a host wait (python/src/torch_stream_order.h).
#include <memory>

#include "strata/core/device.h"
#include "strata/core/status.h"

namespace strata {

// `native_handle`: the backend's stream handle (cudaStream_t on cuda; null is
// the legacy default stream). The cpu device has no stream another library
// runs on (its work runs on the caller's thread): Unsupported there.
Result<std::unique_ptr<Stream>> borrow_stream(Device& device, void* native_handle);

}  // namespace strata
