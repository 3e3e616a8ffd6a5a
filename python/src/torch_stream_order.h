#pragma once
// How torch's work and the engine's meet (strata.torch on the cpu and cuda
// devices).
//
// Note [Torch's stream and the engine's]
// A layer the engine lends comes with `ready` (its gather, its update); torch
// must not read it before. Torch's work on the layer must be over before
// the engine reduces its gradients or reuses its memory. On the cpu device
// torch runs each op before the call returns, so the first is a host wait
// and the second is already true when the hook runs. On cuda torch only
// queues kernels on its current stream: a host wait there would stall the
// queue (and a torch.cuda.synchronize() the whole GPU), so torch's stream is
// borrowed (Note [Borrowed streams]) and made to wait for `ready` on the
// device, and the pass's end is a completion recorded on that stream after
// the hook (the engine's reductions and frees wait for it). The stream is
// the one current when the hook runs, so a `torch.cuda.stream(s)` block is
// followed. The same order decides when lent memory comes back: the last
// torch view freed on the host is not the last kernel reading it, so on a
// device the return waits for the stream the memory was lent on.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strata/core/completion.h"
#include "strata/core/device.h"
#include "strata/core/status.h"
#include "strata/offload/acquire_waiter.h"

namespace strata::python {

class TorchStreamOrder {
 public:
  virtual ~TorchStreamOrder() = default;
  // Torch's work issued on `torch_stream` from now on runs after `ready`.
  // `what` names the layer and pass (for errors and the recorded order).
  virtual Status wait_for(const Completion& ready, uintptr_t torch_stream, const std::string& what) = 0;
  // Completes once the work torch issued on `torch_stream` so far has run.
  virtual Result<Completion> issued_so_far(uintptr_t torch_stream, const std::string& what) = 0;
  // Who waits for a layer acquired for torch's work on `torch_stream`: the
  // step metrics' exposed waits start when it reaches the layer (Note [Who
  // waits for an acquired layer]): the host on the cpu device, torch's
  // stream on a device. `keep` holds that stream's wrapper for the acquire
  // (a drain() or close() may let go of it meanwhile). Never fails: where
  // the stream cannot be had (the order closed, a borrow refused) nothing is
  // probed, and the wait itself reports the failure if it needs the stream.
  struct Waiter {
    offload::AcquireWaiter waiter = offload::AcquireWaiter::model_stream();
    std::shared_ptr<Stream> keep;
  };
  virtual Waiter waiter(uintptr_t torch_stream, const std::string& what) = 0;
  // Whether wait_for() blocks the calling thread (then call it without the GIL).
  virtual bool waits_on_host() const = 0;
  // The engine and its device are going: streams are let go, and a lend
  // torch returns later has nothing left to order against.
  virtual void close() {}
  // Waits on the host until torch's work queued so far on every stream seen
  // has run: a step given up part-way (a torch error mid-pass) must not let
  // the engine zero or free what torch's queued kernels still touch. Only on
  // that failure path; the wrappers are made anew afterwards, so a failure
  // logged on one does not fail every later pass.
  virtual Status drain() { return Status::Ok(); }
};

// The cpu device: torch's ops run on the calling thread.
std::unique_ptr<TorchStreamOrder> make_host_order();
// A device with streams (cuda): torch's streams borrowed, no host wait.
std::unique_ptr<TorchStreamOrder> make_device_order(Device& device);

// One entry of a recorded order: ("wait" | "record", the torch stream, what).
struct StreamOrderEntry {
  std::string op;
  uintptr_t torch_stream = 0;
  std::string what;
};

// The cuda order played on the cpu device, for tests of the front end's
// device branch without a GPU: each torch stream handle gets a stream of the
// cpu device; wait_for() makes it wait for `ready` and, because torch's cpu
// ops run on the host, then waits for that stream on the host (the stand-in
// for the GPU running the queued kernels, not a wait the cuda order does);
// issued_so_far() records a completion on it. Every call is logged.
class RecordedStreamOrder final : public TorchStreamOrder {
 public:
  explicit RecordedStreamOrder(Device& device) : device_(device) {}
  Status wait_for(const Completion& ready, uintptr_t torch_stream, const std::string& what) override;
  Result<Completion> issued_so_far(uintptr_t torch_stream, const std::string& what) override;
  Waiter waiter(uintptr_t torch_stream, const std::string& what) override;
  bool waits_on_host() const override { return true; }
  void close() override;
  Status drain() override;
  std::vector<StreamOrderEntry> entries() const;

 private:
  Result<std::shared_ptr<Stream>> stream_of(uintptr_t torch_stream);
  Device& device_;
  mutable std::mutex mutex_;
  std::map<uintptr_t, std::shared_ptr<Stream>> streams_;
  std::vector<StreamOrderEntry> entries_;
  bool closed_ = false;
};

}  // namespace strata::python
