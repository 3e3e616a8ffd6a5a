// hangdump: an LD_PRELOAD helper that prints every thread's stack to stderr
// once, HANGDUMP_AFTER seconds after the program starts; nothing without
// that variable. scripts/gpu-check.sh preloads it into its engine runs, so
// a run that hangs on a GPU machine (where there is no debugger) leaves the
// stacks in its log before its timeout ends it; map a frame such as
// libstrata_offload.so(+0x107ca5) to a line with addr2line on the unstripped
// build the pack came from. Built by scripts/gpu-pack.sh.
//
// How: a thread sleeps, then sends SIGUSR2 to each other thread of the
// process; the handler writes the thread id and backtrace_symbols_fd().
// backtrace() is called once at load, so the handler does not load the
// unwinder (not async-signal-safe) itself.
#define _GNU_SOURCE
#include <dirent.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void write_stack(int signal_number) {
  (void)signal_number;
  void* frames[64];
  const int count = backtrace(frames, 64);
  char header[64];
  const int length = snprintf(header, sizeof header, "=== hangdump: thread %ld\n", (long)syscall(SYS_gettid));
  if (write(2, header, (size_t)length) < 0) return;
  backtrace_symbols_fd(frames, count, 2);
}

static void* dump_after(void* seconds) {
  sleep((unsigned)(size_t)seconds);
  const pid_t self = (pid_t)syscall(SYS_gettid);
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == NULL) return NULL;
  const char banner[] = "=== hangdump: every thread's stack follows\n";
  if (write(2, banner, sizeof banner - 1) < 0) return NULL;
  struct dirent* entry;
  while ((entry = readdir(tasks)) != NULL) {
    const pid_t thread = (pid_t)atoi(entry->d_name);
    if (thread <= 0 || thread == self) continue;
    syscall(SYS_tgkill, getpid(), thread, SIGUSR2);
    usleep(100000);  // one stack at a time, so the output does not interleave
  }
  closedir(tasks);
  return NULL;
}

__attribute__((constructor)) static void start_hangdump(void) {
  const char* after = getenv("HANGDUMP_AFTER");
  if (after == NULL) return;
  const long seconds = strtol(after, NULL, 10);
  if (seconds <= 0 || seconds > 86400) return;
  void* warm[4];
  backtrace(warm, 4);
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_handler = write_stack;
  action.sa_flags = SA_RESTART;
  sigaction(SIGUSR2, &action, NULL);
  pthread_t thread;
  if (pthread_create(&thread, NULL, dump_after, (void*)(size_t)seconds) == 0) pthread_detach(thread);
}
