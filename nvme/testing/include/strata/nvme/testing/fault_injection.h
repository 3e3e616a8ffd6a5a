#pragma once
// A fault-injecting engine for tests, in the spirit of a simulated storage:
// a real engine whose backend is wrapped so that, driven by a seed, raw
// completions come back as EIO, ENOSPC, EAGAIN/EINTR, short transfers,
// late, torn (a write that stored only a prefix but reports full length)
// or with a flipped bit in the data read. Faults enter below the engine's
// completion checks, so tests exercise the very code that handles real
// kernel results: transient faults must be retried transparently, hard
// faults must surface as a Status with file, offset, length and errno, and
// torn or corrupted data must be caught by the swap store's checksums.
//
// Test code, not part of the installed API: this header and its library
// strata_nvme_testing live under nvme/testing/, which no install() rule
// reaches; the tests and the strata-testing binary (STRATA_FAULTS) link it.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>

#include "strata/nvme/io_engine.h"

namespace strata::nvme {

struct FaultPlan {
  uint64_t seed = 1;
  double eio_probability = 0;             // hard read/write error
  double enospc_probability = 0;          // writes only
  double transient_probability = 0;       // EAGAIN or EINTR: retried by the engine
  double short_probability = 0;           // short read/write: rest resubmitted
  double torn_write_probability = 0;      // prefix stored, full length reported
  double corrupt_read_probability = 0;    // one bit flipped in data read
  double latency_probability = 0;         // completion delayed by up to latency_us_max
  uint32_t latency_us_max = 0;
  // A hung device: every faulted I/O (within the hard-error budget, which a
  // hang spends like a hard error) runs, but its completion is held back
  // hang_ms after it arrived. 0: none.
  uint32_t hang_ms = 0;
  // Which directions the faults above apply to (latency applies to both).
  bool fault_reads = true;
  bool fault_writes = true;
  // The first `clean_pieces` pieces of a faulted direction pass untouched,
  // so a fault lands in the middle of a request ("EIO mid-write").
  uint64_t clean_pieces = 0;
  // Hard errors (EIO, ENOSPC) injected at most; -1: no limit.
  int64_t max_hard_errors = -1;
};

// A plan from text, for the STRATA_FAULTS environment variable of
// `strata-testing train` (the test-only build of the CLI; docs/engine.md
// "Errors"): comma-separated key=value, e.g.
// "eio=1,reads=0,after=20,count=1" (one EIO on the 21st write piece).
// Keys: eio, enospc, transient, short, torn, corrupt (probabilities 0..1),
// reads, writes (0 or 1), after (clean pieces), count (hard errors and hangs
// at most), hang (milliseconds a faulted I/O's completion is held back), seed. An unknown key or a bad value is InvalidArgument naming `source`
// and the key.
Result<FaultPlan> parse_fault_plan(std::string_view text, std::string_view source = "STRATA_FAULTS");

struct FaultCounters {
  std::atomic<uint64_t> eio{0};
  std::atomic<uint64_t> enospc{0};
  std::atomic<uint64_t> transient{0};
  std::atomic<uint64_t> short_transfers{0};
  std::atomic<uint64_t> torn_writes{0};
  std::atomic<uint64_t> corrupt_reads{0};
  std::atomic<uint64_t> delayed{0};
  std::atomic<uint64_t> hung{0};

  // Live control for tests: faults are injected only while armed; arm()
  // restarts the clean-piece count (FaultPlan::clean_pieces semantics).
  std::atomic<bool> armed{true};
  std::atomic<int64_t> clean_left{0};
  // Hard errors (EIO, ENOSPC) still to inject; -1: no limit. A budget of 1
  // models a one-off failure the next attempt gets past.
  std::atomic<int64_t> hard_errors_left{-1};
  void arm(uint64_t clean_pieces = 0, int64_t max_hard_errors = -1) {
    clean_left.store(static_cast<int64_t>(clean_pieces));
    hard_errors_left.store(max_hard_errors);
    armed.store(true);
  }
  // Takes one hard error from the budget; false when it is spent.
  bool spend_hard_error() {
    int64_t left = hard_errors_left.load();
    while (left != 0) {
      if (left < 0) return true;
      if (hard_errors_left.compare_exchange_weak(left, left - 1)) return true;
    }
    return false;
  }
  void disarm() { armed.store(false); }
};

// An engine of kind `options.engine` (kAuto allowed) with faults injected
// per `plan`. `counters`, when given, receives a live view of what was
// injected. Worker w draws from seed + w, so one worker is fully reproducible.
Result<std::unique_ptr<IoEngine>> make_fault_injecting_engine(
    const IoEngineOptions& options, const FaultPlan& plan,
    std::shared_ptr<FaultCounters>* counters = nullptr);

}  // namespace strata::nvme
