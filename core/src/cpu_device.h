#pragma once
// Internal: the cpu backend (see Note [cpu device] in cpu_device.cpp).
#include <memory>

#include "strata/core/device.h"

namespace strata::detail {

Result<std::unique_ptr<Device>> make_cpu_device(const DeviceOptions& options);

}  // namespace strata::detail
