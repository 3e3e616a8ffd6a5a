// The `local` backend: N ranks as threads of one process.
//
// Note [Local collectives]
// Ranks share one LocalGroup. A collective is a sequence of rendezvous
// (group barriers) with direct copies from peers' buffers in between, so
// every byte crosses memory once (no staging):
//   phase 0  every rank posts its descriptor (op, dtype, count, buffers);
//            the last to arrive compares them (debug check, always on here).
//   all_gather      rank r copies peer p's send into recv[p]; phase 1.
//   reduce_scatter  rank r reduces the r-th chunk of every peer's send into
//                   its recv (fp32 accumulation, rank order); phase 1.
//   all_reduce      the buffer is split into n balanced chunks; rank r
//                   reduces chunk r of every send into its own recv; phase 1;
//                   rank r copies chunk p from peer p's recv; phase 2.
//   broadcast       non-roots copy the root's send; phase 1.
// The final rendezvous keeps a rank from returning (and its caller from
// reusing buffers) while peers still read them. In-place layouts are safe
// because within a phase no rank writes a region another rank reads.
// Watchdog: every rendezvous waits until the op's deadline; on expiry the
// group is aborted with a message naming the ranks that did not arrive and
// what each was last doing; all later collectives fail with that status.
// Queues: each CommQueue has its own LocalGroup (its own rendezvous state,
// the local twin of an MPI_Comm_dup) and its own CommStream.
// Gates (Note [Comm gates]): phase 0 also posts the rank's gate status; the
// last rank to arrive tallies them, and if any rank's gate failed every rank
// skips the collective (no data moves) and fails it, the failed rank with
// its gate's Status, the others naming that rank and quoting its error. The
// group stays usable: all ranks skipped the same collective.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "comm_stream.h"
#include "host_buffers.h"
#include "reduce_kernels.h"
#include "strata/comm/backends.h"
#include "strata/core/units.h"

namespace strata::comm {
namespace {

using Clock = std::chrono::steady_clock;

// The outcome of the gate tally of one collective's phase 0.
struct GateVote {
  std::vector<int> failed;  // ranks whose gate failed, ascending
  Status first;             // the lowest such rank's gate Status
};

class LocalGroup {
 public:
  LocalGroup(int world_size, CommOptions options, CommQueue queue)
      : world_size_(world_size), options_(options), queue_(queue), slots_(static_cast<size_t>(world_size)) {}

  int world_size() const { return world_size_; }
  const CommOptions& options() const { return options_; }

  // Group barrier number `phase` of collective `sequence`. Phase 0 posts
  // `desc` and `gate` (the rank's gate status), checks that every rank posted
  // the same collective, and returns the gate tally in *vote.
  Status rendezvous(int rank, uint64_t sequence, int phase, const CollectiveDesc* desc, Clock::time_point deadline,
                    const Status* gate = nullptr, GateVote* vote = nullptr);

  // Descriptor rank `peer` posted for the current collective; valid between
  // its phase 0 and the collective's last rendezvous.
  const CollectiveDesc& posted(int peer) const { return slots_[static_cast<size_t>(peer)].desc; }

  Status abort_status() {
    std::lock_guard<std::mutex> lock(mutex_);
    return aborted_ ? abort_status_ : Status::Ok();
  }

  // A rank's communicator is gone: peers waiting for it fail at once.
  void depart(int rank) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slots_[static_cast<size_t>(rank)].departed = true;
    }
    cv_.notify_all();
  }

 private:
  struct Slot {
    CollectiveDesc desc;
    Status gate;
    uint64_t sequence = 0;
    bool posted_any = false;
    bool departed = false;
    uint64_t arrivals = 0;  // rendezvous entered
    int phase = 0;
  };
  std::string describe_slot(int peer) const;
  Status abort_locked(Status status) {
    if (!aborted_) {
      aborted_ = true;
      abort_status_ = std::move(status);
    }
    cv_.notify_all();
    return abort_status_;
  }
  Status check_descriptors_locked(uint64_t sequence) const;

  const int world_size_;
  const CommOptions options_;
  const CommQueue queue_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
  uint64_t generation_ = 0;  // completed rendezvous
  int waiting_ = 0;
  GateVote vote_;  // tally of the last completed phase 0
  bool aborted_ = false;
  Status abort_status_;
};

std::string LocalGroup::describe_slot(int peer) const {
  const Slot& s = slots_[static_cast<size_t>(peer)];
  if (s.departed) return fmt::format("rank {} destroyed its communicator", peer);
  if (!s.posted_any) return fmt::format("rank {} has issued no collective yet", peer);
  return fmt::format("rank {} last entered {} #{} (phase {})", peer, describe(s.desc, world_size_), s.sequence,
                     s.phase);
}

Status LocalGroup::check_descriptors_locked(uint64_t sequence) const {
  const CollectiveDesc& a = slots_[0].desc;
  for (int p = 1; p < world_size_; ++p) {
    const CollectiveDesc& b = slots_[static_cast<size_t>(p)].desc;
    const bool same = a.op == b.op && (a.op == CollectiveOp::kBarrier ||
                                       (a.dtype == b.dtype && a.count == b.count &&
                                        (a.op != CollectiveOp::kBroadcast || a.root == b.root) &&
                                        ((a.op != CollectiveOp::kAllReduce && a.op != CollectiveOp::kReduceScatter) ||
                                         a.reduce == b.reduce)));
    if (!same) {
      return FailedPrecondition(fmt::format(
          "collective mismatch at #{} on local ({} ranks, queue {}): rank 0 issued {} but rank {} issued {}. "
          "Every rank must issue the same collectives, with the same dtype, count, root and reduction, in the same "
          "order on each queue (a classic ZeRO-3 hang: a parameter gathered on some ranks only); the group is "
          "unusable now",
          sequence, world_size_, queue_name(queue_), describe(a, world_size_), p, describe(b, world_size_)));
    }
  }
  return Status::Ok();
}

Status LocalGroup::rendezvous(int rank, uint64_t sequence, int phase, const CollectiveDesc* desc,
                              Clock::time_point deadline, const Status* gate, GateVote* vote) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (aborted_) return abort_status_;
  Slot& me = slots_[static_cast<size_t>(rank)];
  if (desc != nullptr) {
    me.desc = *desc;
    me.gate = gate != nullptr ? *gate : Status::Ok();
    me.sequence = sequence;
    me.posted_any = true;
  }
  me.phase = phase;
  ++me.arrivals;
  const uint64_t my_generation = generation_;
  if (++waiting_ == world_size_) {
    if (phase == 0) {
      Status mismatch = check_descriptors_locked(sequence);
      if (!mismatch.ok()) return abort_locked(std::move(mismatch));
      vote_ = GateVote{};
      for (int p = 0; p < world_size_; ++p) {
        const Status& g = slots_[static_cast<size_t>(p)].gate;
        if (g.ok()) continue;
        if (vote_.failed.empty()) vote_.first = g;
        vote_.failed.push_back(p);
      }
      if (vote != nullptr) *vote = vote_;
    }
    waiting_ = 0;
    ++generation_;
    cv_.notify_all();
    return Status::Ok();
  }
  for (;;) {
    // vote_ cannot change before this rank reads it: the next tally needs
    // this rank's next arrival.
    if (generation_ != my_generation) {
      if (phase == 0 && vote != nullptr) *vote = vote_;
      return Status::Ok();
    }
    if (aborted_) return abort_status_;
    bool someone_departed = false;
    for (const Slot& s : slots_) someone_departed |= s.departed;
    const bool timed_out = options_.timeout.count() > 0 && Clock::now() >= deadline;
    if (timed_out || someone_departed) {
      std::vector<int> missing;
      std::string details;
      for (int p = 0; p < world_size_; ++p) {
        const Slot& s = slots_[static_cast<size_t>(p)];
        if (s.arrivals <= my_generation || s.departed) {
          missing.push_back(p);
          details += "; " + describe_slot(p);
        }
      }
      const CollectiveDesc& mine = me.desc;
      std::string reason = timed_out ? fmt::format("did not complete within {} ms", options_.timeout.count())
                                     : std::string("cannot complete");
      return abort_locked(DeadlineExceeded(fmt::format(
          "comm watchdog: {} #{} ({} B) on local rank {} of {} (queue {}) {}: ranks that did not arrive: {}{}. "
          "Hint: every rank must issue the same collectives in the same order on each queue; if a rank is "
          "legitimately slow raise CommOptions::timeout or STRATA_COMM_TIMEOUT_MS",
          op_name(mine.op), sequence, recv_bytes(mine, world_size_), rank, world_size_, queue_name(queue_), reason,
          detail::format_rank_list(missing), details)));
    }
    if (options_.timeout.count() > 0) {
      cv_.wait_until(lock, deadline);
    } else {
      cv_.wait(lock);
    }
  }
}

using LocalGroups = std::array<std::shared_ptr<LocalGroup>, kCommQueueCount>;

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(LocalGroups groups, int rank) : groups_(std::move(groups)), rank_(rank) {
    for (int q = 0; q < kCommQueueCount; ++q) {
      // One rank: no peer to wait for (Note [Idle queues of one rank]).
      streams_[static_cast<size_t>(q)] = std::make_unique<detail::CommStream>(
          fmt::format("comm-l{}-{}", rank, queue_name(static_cast<CommQueue>(q))), groups_[0]->world_size() == 1);
    }
  }
  ~LocalCommunicator() override {
    // Queued collectives finish (or time out) before the rank leaves. Then
    // peers learn we are gone.
    synchronize().ignore();
    for (auto& stream : streams_) stream.reset();
    for (auto& group : groups_) group->depart(rank_);
  }

  Backend backend() const override { return Backend::kLocal; }
  int rank() const override { return rank_; }
  int world_size() const override { return groups_[0]->world_size(); }

  Result<CommBuffer> allocate_buffer(size_t bytes) override { return allocate_host_comm_buffer(bytes, "local"); }
  Status upload(void* dst, const void* src, size_t bytes) override { return host_copy(dst, src, bytes); }
  Status download(void* dst, const void* src, size_t bytes) override { return host_copy(dst, src, bytes); }

 protected:
  Status submit_gate(CommQueue queue, const Completion* completion, Event* event) override {
    streams_[static_cast<size_t>(queue_index(queue))]->enqueue_gate(detail::host_gate(queue, completion, event));
    return Status::Ok();
  }
  Result<CommWork> submit(const CollectiveDesc& desc, CommQueue queue, uint64_t sequence) override {
    return streams_[static_cast<size_t>(queue_index(queue))]->enqueue(
        sequence, queue, where(desc, queue, sequence), [this, desc, queue, sequence](const Status& gate) {
          return Completion::ready(execute(desc, queue, sequence, gate));
        });
  }

 private:
  std::string where(const CollectiveDesc& d, CommQueue queue, uint64_t sequence) const {
    return fmt::format("{} #{} on local rank {} of {} (queue {})", op_name(d.op), sequence, rank_, world_size(),
                       queue_name(queue));
  }
  Status execute(const CollectiveDesc& d, CommQueue queue, uint64_t sequence, const Status& gate);

  LocalGroups groups_;
  const int rank_;
  std::array<std::unique_ptr<detail::CommStream>, kCommQueueCount> streams_;
};

Status LocalCommunicator::execute(const CollectiveDesc& d, CommQueue queue, uint64_t sequence, const Status& gate) {
  LocalGroup& g = *groups_[static_cast<size_t>(queue_index(queue))];
  const int n = g.world_size();
  const Clock::time_point deadline = Clock::now() + g.options().timeout;
  GateVote vote;
  STRATA_RETURN_IF_ERROR(g.rendezvous(rank_, sequence, 0, &d, deadline, &gate, &vote));
  if (!vote.failed.empty()) {
    if (!gate.ok()) return gate.with_context(fmt::format("{} not run", where(d, queue, sequence)));
    return Status(vote.first.code(),
                  fmt::format("{} not run: the gate of rank(s) {} failed, so every rank skipped it: {}",
                              where(d, queue, sequence), detail::format_rank_list(vote.failed),
                              vote.first.message()));
  }
  if (d.op == CollectiveOp::kBarrier || d.count == 0) return Status::Ok();

  const size_t elt = dtype_size(d.dtype);
  auto* recv = static_cast<char*>(d.recv);
  switch (d.op) {
    case CollectiveOp::kAllGather: {
      const size_t chunk = d.count * elt;
      for (int p = 0; p < n; ++p) {
        const auto* src = static_cast<const char*>(g.posted(p).send);
        char* dst = recv + static_cast<size_t>(p) * chunk;
        if (src != dst) std::memcpy(dst, src, chunk);
      }
      return g.rendezvous(rank_, sequence, 1, nullptr, deadline);
    }
    case CollectiveOp::kReduceScatter: {
      std::vector<const void*> inputs(static_cast<size_t>(n));
      const size_t offset = static_cast<size_t>(rank_) * d.count * elt;
      for (int p = 0; p < n; ++p) inputs[static_cast<size_t>(p)] = static_cast<const char*>(g.posted(p).send) + offset;
      detail::reduce_elements(d.dtype, d.reduce, inputs.data(), n, d.count, d.recv, n);
      return g.rendezvous(rank_, sequence, 1, nullptr, deadline);
    }
    case CollectiveOp::kAllReduce: {
      auto chunk_begin = [&](int p) { return d.count * static_cast<size_t>(p) / static_cast<size_t>(n); };
      const size_t begin = chunk_begin(rank_);
      const size_t len = chunk_begin(rank_ + 1) - begin;
      std::vector<const void*> inputs(static_cast<size_t>(n));
      for (int p = 0; p < n; ++p) {
        inputs[static_cast<size_t>(p)] = static_cast<const char*>(g.posted(p).send) + begin * elt;
      }
      detail::reduce_elements(d.dtype, d.reduce, inputs.data(), n, len, recv + begin * elt, n);
      STRATA_RETURN_IF_ERROR(g.rendezvous(rank_, sequence, 1, nullptr, deadline));
      for (int p = 0; p < n; ++p) {
        if (p == rank_) continue;
        const size_t b = chunk_begin(p);
        const size_t l = chunk_begin(p + 1) - b;
        std::memcpy(recv + b * elt, static_cast<const char*>(g.posted(p).recv) + b * elt, l * elt);
      }
      return g.rendezvous(rank_, sequence, 2, nullptr, deadline);
    }
    case CollectiveOp::kBroadcast: {
      const auto* src = static_cast<const char*>(g.posted(d.root).send);
      if (src != recv) std::memcpy(recv, src, d.count * elt);
      return g.rendezvous(rank_, sequence, 1, nullptr, deadline);
    }
    case CollectiveOp::kBarrier: break;
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> create_local_group(int world_size, CommOptions options) {
  if (world_size < 1 || world_size > 1024) {
    return InvalidArgument(fmt::format("local comm: world size {} out of range; use 1..1024 ranks (--ranks)",
                                       world_size));
  }
  STRATA_RETURN_IF_ERROR(validate_comm_options(options));
  LocalGroups groups;
  for (int q = 0; q < kCommQueueCount; ++q) {
    groups[static_cast<size_t>(q)] = std::make_shared<LocalGroup>(world_size, options, static_cast<CommQueue>(q));
  }
  std::vector<std::unique_ptr<Communicator>> ranks;
  ranks.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) ranks.push_back(std::make_unique<LocalCommunicator>(groups, r));
  return ranks;
}

}  // namespace strata::comm
