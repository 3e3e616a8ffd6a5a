// The example of docs/core.md, compiled and run, so the documentation stays true.
#include <gtest/gtest.h>

#include <algorithm>

#include "strata/core/device_registry.h"
#include "strata/core/pinned_pool.h"

namespace {

// --- copied from docs/core.md ---
strata::Status upload_and_scale(size_t count) {
  strata::DeviceOptions options;
  options.device_memory_bytes = 256u << 20;  // --device-memory 256MiB
  STRATA_ASSIGN_OR_RETURN(auto device, strata::make_device("cpu", options));
  STRATA_ASSIGN_OR_RETURN(auto pool, strata::PinnedPool::create(device.get()));
  STRATA_ASSIGN_OR_RETURN(auto host, pool->allocate(count * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(auto weights, device->allocate(count * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(auto copy, device->create_stream());
  STRATA_ASSIGN_OR_RETURN(auto compute, device->create_stream());
  STRATA_ASSIGN_OR_RETURN(auto uploaded, device->create_event());

  std::fill_n(host.as<float>(), count, 1.0f);
  STRATA_RETURN_IF_ERROR(copy->copy_async(weights.data(), host.data(), host.size_bytes(),
                                          strata::CopyKind::kHostToDevice));
  STRATA_RETURN_IF_ERROR(copy->record(*uploaded));
  STRATA_RETURN_IF_ERROR(compute->wait(*uploaded));      // compute starts after the upload
  float* w = weights.as<float>();                        // host-addressable on the cpu device
  STRATA_RETURN_IF_ERROR(compute->launch_host([w, count] {
    for (size_t i = 0; i < count; ++i) w[i] *= 2;
  }));
  return compute->synchronize();                         // first error of the stream, if any
}
// --- end of copy ---

TEST(DocsExample, UploadAndScaleRuns) {
  strata::Status st = upload_and_scale(100000);
  EXPECT_TRUE(st.ok()) << st.to_string();
  // Past the 256 MiB device: a clear OutOfMemory, not a crash.
  strata::Status oom = upload_and_scale(size_t{80} << 20);
  EXPECT_EQ(oom.code(), strata::StatusCode::kOutOfMemory) << oom.to_string();
}

}  // namespace
