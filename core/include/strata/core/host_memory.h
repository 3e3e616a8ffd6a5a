#pragma once
// This machine's physical memory, as the kernel reports it (sysconf).
#include <cstdint>

namespace strata {

// Bytes of physical memory; 0 when the kernel does not say (callers pick
// their own fallback).
uint64_t physical_memory_bytes();

}  // namespace strata
