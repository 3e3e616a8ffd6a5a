// Fault-injecting backend wrapper. See fault_injection.h.
//
// Note [Where faults enter]
// The wrapper sits between the scheduler and a real backend. On prepare it
// rolls the dice for the piece: a hard error (EIO, ENOSPC) or a transient
// one (EAGAIN, EINTR) never reaches the kernel and comes back as a
// synthetic completion; a short transfer is submitted with a shorter length
// (aligned for O_DIRECT pieces) so the kernel really moves fewer bytes; a
// torn write is submitted short as well but reported as complete. On reap
// a read may get one bit flipped, and any completion may be held back for
// a while (latency). The scheduler above sees only raw results and must
// handle them exactly as it handles the kernel's.
#include "strata/nvme/testing/fault_injection.h"

#include <cerrno>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "strata/core/printable.h"
#include <chrono>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "engine_core.h"

namespace strata::nvme {
namespace {

using Clock = std::chrono::steady_clock;

class FaultBackend final : public Backend {
 public:
  FaultBackend(std::unique_ptr<Backend> inner, const FaultPlan& plan, uint32_t worker_index,
               std::shared_ptr<FaultCounters> counters)
      : inner_(std::move(inner)), plan_(plan), rng_(plan.seed + worker_index), counters_(std::move(counters)) {}

  void prepare(Piece& p) override {
    if (!eligible(p.op)) {
      inner_->prepare(p);
      ++inner_outstanding_;
      return;
    }
    if (p.op == IoOp::kWrite && roll(plan_.enospc_probability) && counters_->spend_hard_error()) {
      counters_->enospc.fetch_add(1);
      synthetic_.push_back({&p, -ENOSPC});
      return;
    }
    if (plan_.hang_ms > 0 && counters_->spend_hard_error()) {
      counters_->hung.fetch_add(1);
      hanging_.insert(&p);  // runs; its completion is held back in reap
      inner_->prepare(p);
      ++inner_outstanding_;
      return;
    }
    if (roll(plan_.eio_probability) && counters_->spend_hard_error()) {
      counters_->eio.fetch_add(1);
      synthetic_.push_back({&p, -EIO});
      return;
    }
    if (roll(plan_.transient_probability)) {
      counters_->transient.fetch_add(1);
      synthetic_.push_back({&p, (rng_() & 1) ? -EAGAIN : -EINTR});
      return;
    }
    uint64_t unit = p.direct ? p.alignment : 1;
    bool can_shorten = p.length >= 2 * unit;
    if (p.op == IoOp::kWrite && can_shorten && roll(plan_.torn_write_probability)) {
      counters_->torn_writes.fetch_add(1);
      uint64_t kept = shorter(p.length, unit);
      reported_[&p] = static_cast<int64_t>(p.length);
      forward_with_length(p, kept);
      return;
    }
    if (can_shorten && roll(plan_.short_probability)) {
      counters_->short_transfers.fetch_add(1);
      forward_with_length(p, shorter(p.length, unit));
      return;
    }
    inner_->prepare(p);
    ++inner_outstanding_;
  }

  Status submit(const CompletionSink& sink) override { return inner_->submit(sink); }

  Status reap(uint32_t min_complete, const CompletionSink& sink) override {
    uint32_t delivered = 0;
    CompletionSink wrapped = [&](Piece& p, int64_t result) {
      --inner_outstanding_;
      auto it = reported_.find(&p);
      if (it != reported_.end()) {
        if (result >= 0) result = it->second;  // torn: claim the whole write landed
        reported_.erase(it);
      }
      if (p.op == IoOp::kRead && result > 0 && counters_->armed.load() && plan_.fault_reads && roll(plan_.corrupt_read_probability)) {
        counters_->corrupt_reads.fetch_add(1);
        uint64_t byte = rng_() % static_cast<uint64_t>(result);
        p.buffer[byte] ^= std::byte{static_cast<unsigned char>(1u << (rng_() % 8))};
      }
      if (hanging_.erase(&p) != 0) {
        delayed_.push_back({Clock::now() + std::chrono::milliseconds(plan_.hang_ms), &p, result});
        return;
      }
      if (plan_.latency_us_max > 0 && roll(plan_.latency_probability)) {
        counters_->delayed.fetch_add(1);
        auto delay = std::chrono::microseconds(1 + rng_() % plan_.latency_us_max);
        delayed_.push_back({Clock::now() + delay, &p, result});
        return;
      }
      sink(p, result);
      ++delivered;
    };
    while (true) {
      delivered += deliver_synthetic(sink);
      delivered += deliver_due(sink, false);
      if (delivered >= min_complete && min_complete > 0) break;
      if (inner_outstanding_ > 0) {
        STRATA_RETURN_IF_ERROR(inner_->reap(min_complete == 0 ? 0 : 1, wrapped));
        if (min_complete == 0) break;
      } else if (!delayed_.empty()) {
        if (min_complete == 0) break;
        delivered += deliver_due(sink, true);
      } else if (synthetic_.empty()) {
        break;  // nothing more can complete
      }
    }
    return Status::Ok();
  }

  bool register_buffer(uint32_t index, void* data, size_t bytes, std::string* why) override {
    return inner_->register_buffer(index, data, bytes, why);
  }
  void unregister_buffer(uint32_t index) override { inner_->unregister_buffer(index); }
  bool update_files(uint32_t first, const int* fds, uint32_t count) override {
    return inner_->update_files(first, fds, count);
  }
  bool files_registered() const override { return inner_->files_registered(); }

 private:
  struct Synthetic {
    Piece* piece;
    int64_t result;
  };
  struct Delayed {
    Clock::time_point due;
    Piece* piece;
    int64_t result;
  };

  // Armed, a faulted direction, and past the clean pieces.
  bool eligible(IoOp op) {
    if (!counters_->armed.load(std::memory_order_acquire)) return false;
    if (!(op == IoOp::kRead ? plan_.fault_reads : plan_.fault_writes)) return false;
    int64_t left = counters_->clean_left.load();
    while (left > 0) {
      if (counters_->clean_left.compare_exchange_weak(left, left - 1)) return false;
    }
    return true;
  }
  bool roll(double probability) {
    if (probability <= 0) return false;
    return std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < probability;
  }
  // A length in [unit, length - unit], a multiple of unit.
  uint64_t shorter(uint64_t length, uint64_t unit) {
    uint64_t units = length / unit;
    return unit * (1 + rng_() % (units - 1));
  }
  void forward_with_length(Piece& p, uint64_t length) {
    uint64_t full = p.length;
    p.length = length;
    inner_->prepare(p);  // backends copy what they need at prepare time
    p.length = full;
    ++inner_outstanding_;
  }
  uint32_t deliver_synthetic(const CompletionSink& sink) {
    if (synthetic_.empty()) return 0;
    std::vector<Synthetic> batch;
    batch.swap(synthetic_);
    for (const Synthetic& s : batch) sink(*s.piece, s.result);  // may queue new synthetic ones
    return static_cast<uint32_t>(batch.size());
  }
  uint32_t deliver_due(const CompletionSink& sink, bool wait_for_first) {
    if (delayed_.empty()) return 0;
    if (wait_for_first) {
      Clock::time_point earliest = delayed_.front().due;
      for (const Delayed& d : delayed_) earliest = std::min(earliest, d.due);
      std::this_thread::sleep_until(earliest);
    }
    Clock::time_point now = Clock::now();
    std::vector<Delayed> due;
    for (size_t i = 0; i < delayed_.size();) {
      if (delayed_[i].due <= now) {
        due.push_back(delayed_[i]);
        delayed_[i] = delayed_.back();
        delayed_.pop_back();
      } else {
        ++i;
      }
    }
    for (const Delayed& d : due) sink(*d.piece, d.result);
    return static_cast<uint32_t>(due.size());
  }

  std::unique_ptr<Backend> inner_;
  FaultPlan plan_;
  std::mt19937_64 rng_;
  std::shared_ptr<FaultCounters> counters_;
  uint32_t inner_outstanding_ = 0;
  std::vector<Synthetic> synthetic_;
  std::vector<Delayed> delayed_;
  std::unordered_map<Piece*, int64_t> reported_;
  std::unordered_set<Piece*> hanging_;
};

}  // namespace

Result<std::unique_ptr<IoEngine>> make_fault_injecting_engine(const IoEngineOptions& options, const FaultPlan& plan,
                                                              std::shared_ptr<FaultCounters>* counters) {
  auto shared = std::make_shared<FaultCounters>();
  shared->clean_left.store(static_cast<int64_t>(plan.clean_pieces));
  shared->hard_errors_left.store(plan.max_hard_errors);
  if (counters != nullptr) *counters = shared;
  EngineKind kind = options.engine == EngineKind::kAuto ? choose_engine().kind : options.engine;
  BackendWrapper wrapper = [plan, shared](std::unique_ptr<Backend> inner, uint32_t worker_index) {
    return std::unique_ptr<Backend>(std::make_unique<FaultBackend>(std::move(inner), plan, worker_index, shared));
  };
  return make_scheduled_engine(options, kind, std::move(wrapper));
}

}  // namespace strata::nvme

namespace strata::nvme {

Result<FaultPlan> parse_fault_plan(std::string_view text, std::string_view source) {
  FaultPlan plan;
  const std::string shown = printable(text, 200);
  size_t at = 0;
  while (at <= text.size()) {
    size_t end = text.find(',', at);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view item = text.substr(at, end - at);
    at = end + 1;
    if (item.empty()) {
      if (end == text.size()) break;
      continue;
    }
    const size_t eq = item.find('=');
    const std::string key(item.substr(0, eq == std::string_view::npos ? item.size() : eq));
    const std::string value(eq == std::string_view::npos ? std::string_view() : item.substr(eq + 1));
    auto bad = [&](const char* want) {
      return InvalidArgument(fmt::format("{} '{}': {} '{}' must be {} (keys: eio, enospc, transient, short, torn, "
                                         "corrupt, reads, writes, after, count, hang, seed)",
                                         source, shown, printable(key, 32), printable(value, 32), want));
    };
    auto probability = [&](double& out) -> Status {
      char* e = nullptr;
      const double v = std::strtod(value.c_str(), &e);
      if (value.empty() || e == nullptr || *e != '\0' || !(v >= 0.0 && v <= 1.0)) return bad("a probability in 0..1");
      out = v;
      return Status::Ok();
    };
    auto integer = [&](int64_t lo, int64_t hi, int64_t& out) -> Status {
      char* e = nullptr;
      errno = 0;
      const long long v = std::strtoll(value.c_str(), &e, 10);
      if (value.empty() || e == nullptr || *e != '\0' || errno != 0 || v < lo || v > hi)
        return bad(fmt::format("an integer in {}..{}", lo, hi).c_str());
      out = v;
      return Status::Ok();
    };
    int64_t n = 0;
    if (key == "eio") STRATA_RETURN_IF_ERROR(probability(plan.eio_probability));
    else if (key == "enospc") STRATA_RETURN_IF_ERROR(probability(plan.enospc_probability));
    else if (key == "transient") STRATA_RETURN_IF_ERROR(probability(plan.transient_probability));
    else if (key == "short") STRATA_RETURN_IF_ERROR(probability(plan.short_probability));
    else if (key == "torn") STRATA_RETURN_IF_ERROR(probability(plan.torn_write_probability));
    else if (key == "corrupt") STRATA_RETURN_IF_ERROR(probability(plan.corrupt_read_probability));
    else if (key == "reads" || key == "writes") {
      STRATA_RETURN_IF_ERROR(integer(0, 1, n));
      (key == "reads" ? plan.fault_reads : plan.fault_writes) = n == 1;
    } else if (key == "after") {
      STRATA_RETURN_IF_ERROR(integer(0, int64_t{1} << 40, n));
      plan.clean_pieces = static_cast<uint64_t>(n);
    } else if (key == "count") {
      STRATA_RETURN_IF_ERROR(integer(0, int64_t{1} << 40, n));
      plan.max_hard_errors = n;
    } else if (key == "hang") {
      STRATA_RETURN_IF_ERROR(integer(0, 3'600'000, n));
      plan.hang_ms = static_cast<uint32_t>(n);
    } else if (key == "seed") {
      STRATA_RETURN_IF_ERROR(integer(0, int64_t{1} << 62, n));
      plan.seed = static_cast<uint64_t>(n);
    } else {
      return bad("a known key");
    }
  }
  return plan;
}

}  // namespace strata::nvme
