// borrow_stream (Note [Borrowed streams] in strata/core/borrowed_stream.h).
#include "strata/core/borrowed_stream.h"

#include <fmt/format.h>

#if defined(STRATA_HAVE_CUDA)
#include "cuda/cuda_device.h"
#endif

namespace strata {

Result<std::unique_ptr<Stream>> borrow_stream(Device& device, void* native_handle) {
  const std::string& backend = device.caps().backend;
#if defined(STRATA_HAVE_CUDA)
  if (backend == "cuda") return detail::borrow_cuda_stream(device, native_handle);
#endif
  return Unsupported(fmt::format(
      "the {} device has no stream another library runs on (its work runs on the calling thread), so none can be "
      "borrowed; order work against it on the host",
      backend));
}

}  // namespace strata
