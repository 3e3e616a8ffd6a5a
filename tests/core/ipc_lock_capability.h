#pragma once
// For tests of pinning limits, run in forked children: RLIMIT_MEMLOCK binds
// mlock only without CAP_IPC_LOCK (Note [CAP_IPC_LOCK lifts RLIMIT_MEMLOCK]
// in core/src/pinned_pool.cpp), so a test of the limit drops the capability
// first (whether the process holds it: probe_pinning().ipc_lock_capability).
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace strata::test {

// Clears CAP_IPC_LOCK from the effective set; false when that failed.
inline bool drop_ipc_lock() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  data[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  return syscall(SYS_capset, &header, data) == 0;
}

// Lowers the soft RLIMIT_MEMLOCK; false when that failed.
inline bool lower_memlock(rlim_t bytes) {
  struct rlimit lim {};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return false;
  lim.rlim_cur = bytes;
  return setrlimit(RLIMIT_MEMLOCK, &lim) == 0;
}

}  // namespace strata::test
