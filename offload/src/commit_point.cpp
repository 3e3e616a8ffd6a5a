// CommitPoint (commit_point.h; Note [Atomic steps] in engine.h).
#include "commit_point.h"
#include "early_updates.h"

#include <fmt/format.h>

#include "strata/comm/host_collective.h"

namespace strata::offload::engine_detail {

namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += fmt::format("{}{}", text.empty() ? "" : ", ", r);
  return text;
}

// What a completed rollback of step `t` says: what was undone and what the
// next step() repeats (`call`: the step in progress, or null).
std::string rolled_back_message(int64_t t, const std::string& cause, bool versioned, const StepMark* call) {
  // With overlap on, step t's updates ran under the step() call in progress
  // (t + 1), so that call is undone with it: two steps to feed again.
  if (versioned && call != nullptr)
    return fmt::format("step {}: the update {}; every rank rolled back to the state after step {} "
                       "(optimizer state, parameters, loss scale and data position): steps {} and {} "
                       "are undone (step {}'s update ran while step {} was in progress); the next "
                       "step() repeats step {} (a caller that feeds the batches feeds step {}'s again, "
                       "then step {}'s)",
                       t, cause, t - 1, t, call->optimizer_steps + 1, t, call->optimizer_steps + 1, t, t,
                       call->optimizer_steps + 1);
  if (versioned)
    return fmt::format("step {}: the update {}; every rank rolled back to the state after step {} "
                       "(optimizer state, parameters, loss scale and data position): step {} is undone; "
                       "the next step() repeats step {}",
                       t, cause, t - 1, t, t);
  return fmt::format("step {}: the update {}; the optimizer state holds step {} and every rank "
                     "re-derived its parameters from it{}",
                     t, cause, t,
                     call != nullptr ? "; the step in progress was dropped and the next step() repeats it" : "");
}

}  // namespace

// This rank's side of the vote: its pending step's update (and whether it
// was torn part-way), and the call's parameter reads.
struct CommitPoint::RankOutcome {
  Status update, torn, read;
};

// The vote's verdict, the same on every rank: the ranks whose update
// failed, whose update was torn part-way (a failed update no rank can
// undo), whose parameter reads failed.
struct CommitPoint::Vote {
  std::vector<int> failed_update, failed_read, torn_update;
};

Status CommitPoint::settle(const StepMark* call, double* loss) {
  // In step() every rank votes at the same point; outside it, only when a
  // step is pending (the same on every rank: an fp16 skip is agreed).
  if (!pending_ && call == nullptr) return Status::Ok();
  RankOutcome mine;
  if (pending_) {
    STRATA_ASSIGN_OR_RETURN(mine, pending_outcome());
  }
  if (call != nullptr) mine.read = ctx_.failures.take(FailureOf::kCall);
  STRATA_ASSIGN_OR_RETURN(const Vote vote, take_vote(mine, loss));
  const int64_t t = pending_mark_.optimizer_steps + 1;
  const bool was_pending = pending_;
  pending_ = false;
  if (vote.failed_update.empty()) {
    if (was_pending) STRATA_RETURN_IF_ERROR(updates_.commit_state().with_context(fmt::format("committing step {}", t)));
    if (vote.failed_read.empty()) return Status::Ok();
    return drop_call(*call, vote.failed_read, mine.read);
  }
  if (!vote.torn_update.empty()) return stop_torn(t, vote.torn_update, mine.torn);
  return roll_back(t, vote.failed_update, mine.update, call);
}

// Every update of the pending_ step has run (the forward waited for each
// layer; outside step() this waits), and its write-backs are durable: this
// rank's outcome of it.
Result<CommitPoint::RankOutcome> CommitPoint::pending_outcome() {
  for (size_t li = 0; li < ctx_.part.layer_count(); ++li) {
    const std::string what = fmt::format("the commit point of step {}: the update of {}",
                                         pending_mark_.optimizer_steps + 1, ctx_.layer_label(li));
    // Its failure is in the context's StepFailures.
    STRATA_RETURN_IF_ERROR(ctx_.wait_bounded(updates_.layer(li).update_written, what));
    STRATA_RETURN_IF_ERROR(ctx_.wait_bounded(params_.ready(li), what));
  }
  RankOutcome mine;
  mine.update = ctx_.failures.take(FailureOf::kUpdate);
  mine.torn = ctx_.failures.take(FailureOf::kTorn);
  if (mine.update.ok() && !pending_complete_)
    mine.update = Internal(fmt::format("step {}: not every layer's update was queued", pending_mark_.optimizer_steps + 1));
  // Its write-backs durable; committable() also finds a write-back whose
  // failure went to a checkpoint snapshot's read.
  if (mine.update.ok()) mine.update = updates_.state_ready_to_commit();
  nvme_bytes_.updates_settled(pending_mark_.optimizer_steps + 1);  // Note [A step's NVMe bytes]
  return mine;
}

// The vote: which ranks' updates, and which ranks' parameter reads, failed.
// An update torn part-way (2 in the vote) is a failed update no rank can
// undo. `loss` (a step only): this rank's loss sum in, the sum over ranks
// in rank order out.
Result<CommitPoint::Vote> CommitPoint::take_vote(const RankOutcome& mine, double* loss) {
  Vote vote;
  if (ctx_.world == 1) {
    if (!mine.update.ok() || !mine.torn.ok()) vote.failed_update.push_back(0);
    if (!mine.torn.ok()) vote.torn_update.push_back(0);
    if (!mine.read.ok()) vote.failed_read.push_back(0);
    return vote;
  }
  // One row per rank: {its loss (step() only), update failed (2: torn), read failed}.
  const double row[3] = {loss != nullptr ? *loss : 0.0, !mine.torn.ok() ? 2.0 : mine.update.ok() ? 0.0 : 1.0,
                         mine.read.ok() ? 0.0 : 1.0};
  std::vector<double> all(3 * static_cast<size_t>(ctx_.world));
  STRATA_RETURN_IF_ERROR(comm::host_collective(
      ctx_.comm, row, sizeof(row), all.data(), all.size() * sizeof(double),
      [&](const void* s, void* r) { return ctx_.comm.all_gather(s, r, 3, DType::kF64, comm::CommQueue::kReduce); },
      "summing the loss over ranks and agreeing on the step's updates"));
  double total = 0;
  for (int r = 0; r < ctx_.world; ++r) {
    const double* theirs = all.data() + 3 * static_cast<size_t>(r);
    total += theirs[0];
    if (theirs[1] != 0.0) vote.failed_update.push_back(r);
    if (theirs[1] == 2.0) vote.torn_update.push_back(r);
    if (theirs[2] != 0.0) vote.failed_read.push_back(r);
  }
  if (loss != nullptr) *loss = total;
  return vote;
}

// A parameter read of this call failed (on the ranks `failed_read`; `read`:
// this rank's failure): nothing was updated from it; the call is dropped on
// every rank.
Status CommitPoint::drop_call(const StepMark& call, const std::vector<int>& failed_read, const Status& read) {
  const std::string cause = read.ok() ? fmt::format("failed on rank {}", rank_list(failed_read))
                                      : fmt::format("failed on rank {} (here: {})", rank_list(failed_read),
                                                    read.message());
  // Layers the dropped call stepped early go back (Note [Early, exact updates]).
  STRATA_RETURN_IF_ERROR(updates_.early().undo_every().status());
  STRATA_RETURN_IF_ERROR(back_to(call));
  ctx_.recovered = true;
  ctx_.recovery = StepOutcomeKind::kDropped;
  return Status(read.ok() ? StatusCode::kUnavailable : read.code(),
                fmt::format("step {}: reading the parameters {}; the step was dropped on every rank (the state is "
                            "the one after step {}); the next step() repeats it",
                            call.optimizer_steps + 1, cause, call.optimizer_steps));
}

// An update of state kept in place (pinned host or device memory) that
// failed part-way left pieces of step t beside pieces of step t-1, and no
// copy of t-1 exists: neither committing nor rolling back is exact. Every
// rank stops (not `ctx_.recovered`: stop_unless_recovered), committing nothing.
Status CommitPoint::stop_torn(int64_t t, const std::vector<int>& torn_update, const Status& torn) {
  return Status(torn.ok() ? StatusCode::kDataLoss : torn.code(),
                fmt::format("step {}: the update failed part-way on rank {}{}; that optimizer state is updated in "
                            "place (offload_optimizer {}) with no copy of step {}, so the step can neither be "
                            "committed nor rolled back",
                            t, rank_list(torn_update), torn.ok() ? "" : " (here: " + torn.message() + ")",
                            offload_device_name(ctx_.opt.offload_optimizer), t - 1));
}

// Every rank gets here with the same lists: roll back together (the
// re-derivation's gathers are collectives every rank issues). `update`:
// this rank's failure.
Status CommitPoint::roll_back(int64_t t, const std::vector<int>& failed_update, const Status& update,
                              const StepMark* call) {
  const std::string cause = update.ok() ? fmt::format("failed on rank {}", rank_list(failed_update))
                                        : fmt::format("failed on rank {} (here: {})", rank_list(failed_update),
                                                      update.message());
  const bool versioned = updates_.state_versioned();
  const Status undone = undo_pending_step(versioned, call);
  const StatusCode code = update.ok() ? StatusCode::kUnavailable : update.code();
  if (!undone.ok())
    return Status(code, fmt::format("step {}: the update {}; rolling back failed too: {}", t, cause, undone.message()));
  ctx_.recovered = true;
  ctx_.recovery = versioned ? StepOutcomeKind::kRolledBack : StepOutcomeKind::kDropped;
  return Status(code, rolled_back_message(t, cause, versioned, call));
}

// The call in progress is dropped with the step: the layers it stepped
// early go back first (Note [Early, exact updates]; state kept in place),
// then the state's step, then the parameters. A versioned tier is back at
// step t-1: the counters go back there. The memory tiers hold step t (their
// update runs in place and only a parameter copy failed): the step() call
// in progress is dropped.
Status CommitPoint::undo_pending_step(bool versioned, const StepMark* call) {
  Status undone = updates_.early().undo_every().status();
  if (undone.ok()) undone = updates_.abandon_state_step();
  if (undone.ok()) undone = rederive_params();
  if (undone.ok()) {
    if (versioned) undone = back_to(pending_mark_);
    else if (call != nullptr) undone = back_to(*call);
  }
  return undone;
}

Status CommitPoint::back_to(const StepMark& m) {
  STRATA_RETURN_IF_ERROR(restore_counters_(m));
  grads_.forget_zeroing();
  return Status::Ok();
}

Status CommitPoint::rederive_params() {
  std::vector<float> master;
  std::vector<std::byte> values;
  for (size_t li = 0; li < ctx_.part.layer_count(); ++li) {
    const LayerPlacement& where = ctx_.where(li);
    const LayerPartition& layer_part = ctx_.part.layer(li);
    const size_t eb = where.param_element_bytes;
    const std::string context = "re-deriving the parameters of " + ctx_.layer_label(li);
    if (where.frozen) continue;  // never stepped: its parameters are as they were
    if (where.persistent()) {
      // The owned pieces into the full parameters, then (stages 1-3) every
      // rank's pieces gathered, as the update does.
      for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
        const SubGroup& g = layer_part.groups[gi];
        for (int r = ctx_.owned_rank_begin(); r < ctx_.owned_rank_end(); ++r) {
          const size_t n = layer_part.piece_real(g, r);
          if (n == 0) continue;
          master.resize(n);
          values.resize(n * eb);
          STRATA_RETURN_IF_ERROR(updates_.read_piece_state(li, gi, r, master.data(), nullptr, nullptr).with_context(context));
          master_to_params(where.param_dtype, master.data(), values.data(), n);
          STRATA_RETURN_IF_ERROR(params_.write_whole_piece(li, g, r, values.data(), n));
        }
      }
      STRATA_RETURN_IF_ERROR(params_.regather_whole(li));
      continue;
    }
    // Stage 3: this rank's shard (padding zero, as at the start).
    values.assign(layer_part.shard_elements * eb, std::byte{0});
    for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
      const SubGroup& g = layer_part.groups[gi];
      const size_t n = layer_part.piece_real(g, ctx_.rank);
      if (n == 0) continue;
      master.resize(n);
      STRATA_RETURN_IF_ERROR(updates_.read_piece_state(li, gi, ctx_.rank, master.data(), nullptr, nullptr).with_context(context));
      master_to_params(where.param_dtype, master.data(), values.data() + g.shard_offset * eb, n);
    }
    STRATA_RETURN_IF_ERROR(params_.replace_shard(li, values));
  }
  return Status::Ok();
}

}  // namespace strata::offload::engine_detail
