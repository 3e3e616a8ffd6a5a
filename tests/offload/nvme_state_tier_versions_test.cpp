// The NVMe tier's versions (Note [Piece versions] in nvme_state_tier.h): the
// committed and the newest version through commit and rollback, a failed
// write-back that keeps the committed one, the pending version of an early
// update (kept, dropped, superseded by a redo, forgotten by a rollback; a
// failed pending write), and the pinned tier's pending buffers beside them.
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "nvme_state_tier_fixture.h"

namespace strata::offload {
namespace {

TEST_F(NvmeStateTierTest, PinnedTierPendingVersionsSwapAndOtherTiersRefuse) {
  const PieceSpec piece{{0, 0, 0}, 1000, true};
  const cpu_adam::MomentStorage md = cpu_adam::MomentStorage::fp32();
  MemoryStats mem_stats;
  auto mem = make_memory_state_tier(*device_, Tier::kPinnedHost, md, mem_stats);
  ASSERT_TRUE(mem.ok()) << mem.status().to_string();
  OptimizerStateTier& t = **mem;
  const std::vector<float> init = master_init(piece);
  ASSERT_TRUE(t.add(piece.id, name_of(piece.id), piece.count, init).ok());
  EXPECT_EQ(t.open_pending(piece.id).status().code(), StatusCode::kUnsupported);  // none added yet
  const uint64_t pinned_before = mem_stats.get(Tier::kPinnedHost).current_bytes;
  ASSERT_TRUE(t.add_pending(piece.id).ok());
  EXPECT_EQ(mem_stats.get(Tier::kPinnedHost).current_bytes - pinned_before,
            memory_piece_bytes(piece.count, true, md));  // counted like the state
  const PieceState state = t.open(piece.id).value();
  const PieceState pending = t.open_pending(piece.id).value();
  ASSERT_NE(state.master, pending.master);
  for (size_t i = 0; i < piece.count; ++i) {
    pending.master[i] = init[i] + 1.0f;
    static_cast<float*>(pending.exp_avg)[i] = 2.0f;
    static_cast<float*>(pending.exp_avg_sq)[i] = 3.0f;
  }
  // Not kept: the state is as it was.
  EXPECT_EQ(0, std::memcmp(t.open(piece.id).value().master, init.data(), piece.count * 4));
  ASSERT_TRUE(t.keep_pending(piece.id).ok());
  const PieceState kept = t.open(piece.id).value();
  EXPECT_EQ(kept.master, pending.master);  // a swap, not a copy
  EXPECT_EQ(kept.master[7], init[7] + 1.0f);
  EXPECT_EQ(static_cast<float*>(kept.exp_avg_sq)[7], 3.0f);
  EXPECT_EQ(t.open_pending(piece.id).value().master, state.master);  // the old state is the next pending buffer

  auto on_device = make_memory_state_tier(*device_, Tier::kDevice, md, mem_stats);
  ASSERT_TRUE(on_device.ok()) << on_device.status().to_string();
  ASSERT_TRUE((*on_device)->add(piece.id, name_of(piece.id), piece.count, init).ok());
  const Status device_refused = (*on_device)->add_pending(piece.id);
  EXPECT_EQ(device_refused.code(), StatusCode::kUnsupported);
  EXPECT_NE(device_refused.message().find("device memory"), std::string::npos) << device_refused.to_string();
  auto nvme = make(options({piece}, md, "pending"));
  ASSERT_TRUE(nvme);
  ASSERT_NO_FATAL_FAILURE(add_all(*nvme, {piece}));
  EXPECT_EQ(nvme->add_pending(piece.id).code(), StatusCode::kUnsupported);
}

TEST_F(NvmeStateTierTest, VersionsCommitAndRollBack) {
  const std::vector<PieceSpec> pieces = {{{0, 0, 0}, 3000, true}, {{0, 1, 0}, 5000, true}, {{1, 0, 0}, 777, false}};
  for (bool pipeline : {false, true}) {
    SCOPED_TRACE(pipeline ? "pipeline read/write" : "synchronous");
    NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), pipeline ? "versions-p" : "versions-s");
    o.pipeline_read = o.pipeline_write = pipeline;
    auto tier = make(o);
    ASSERT_TRUE(tier);
    EXPECT_TRUE(tier->versioned());
    ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
    const uint64_t one_version = tier->bytes();
    EXPECT_EQ(one_version, capacity_of(pieces, cpu_adam::MomentStorage::fp32()));
    // A "step": every piece scribbled and written.
    auto step = [&](int salt) {
      std::vector<std::vector<std::byte>> out;
      for (const PieceSpec& p : pieces) {
        auto s = tier->open(p.id);
        EXPECT_TRUE(s.ok()) << s.status().to_string();
        if (!s.ok()) return out;
        scribble(*s, salt);
        out.push_back(snapshot(*s));
        EXPECT_TRUE(tier->close(p.id, true).ok());
      }
      return out;
    };
    auto read_all = [&]() { return read_every_piece(*tier, pieces); };
    const auto initial = read_all();
    const auto step1 = step(1);
    EXPECT_EQ(read_all(), step1);  // open() reads the newest version
    EXPECT_EQ(tier->bytes(), 2 * one_version);
    ASSERT_TRUE(tier->rollback().ok());
    EXPECT_EQ(read_all(), initial);
    // Written twice before the commit: the committed version stays.
    step(2);
    const auto step3 = step(3);
    ASSERT_TRUE(tier->commit().ok());
    EXPECT_EQ(read_all(), step3);
    // Read-ahead of the pending versions, then a rollback: the committed ones.
    step(4);
    tier->prefetch(pieces[0].id);
    ASSERT_TRUE(tier->rollback().ok());
    EXPECT_EQ(read_all(), step3);
    ASSERT_TRUE(tier->rollback().ok());  // nothing pending: no change
    EXPECT_EQ(read_all(), step3);
    EXPECT_EQ(tier->bytes(), 2 * one_version);  // counted once per piece
    EXPECT_EQ(stats_.get(Tier::kNvme).current_bytes, 2 * one_version);
  }
}

TEST_F(NvmeStateTierFaultTest, CommitReportsAFailedWriteBackAndKeepsTheCommittedVersion) {
  nvme::FaultPlan plan;
  plan.eio_probability = 1;
  plan.fault_reads = false;
  ASSERT_NO_FATAL_FAILURE(make_faulty(plan));
  const std::vector<PieceSpec> pieces = {{{1, 0, 0}, 6000, true}, {{1, 1, 0}, 5000, true}};
  NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), "commit-eio");
  o.pipeline_write = true;
  {
    auto tier = make(o, engine_.get());
    ASSERT_TRUE(tier);
    ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
    std::vector<std::vector<std::byte>> before;
    int reported = 0;
    for (const PieceSpec& p : pieces) {
      auto s = tier->open(p.id);
      ASSERT_TRUE(s.ok());
      before.push_back(snapshot(*s));
      scribble(*s, 5);
      if (p.id.group == 1) {
        // The first piece's pipelined write-back done first (else, on a loaded machine, its last
        // chunk could still be in flight when the fault is armed and be the one that fails).
        ASSERT_TRUE(tier->flush().ok());
        counters_->arm(0, 1);  // the second piece's write-back fails
      }
      if (!tier->close(p.id, true).ok()) ++reported;
    }
    // The EIO comes from close() or from commit(), once; either way commit()
    // refuses the step (again if close() reported it): roll it back.
    Status st = tier->commit();
    ASSERT_FALSE(st.ok());
    if (reported == 0) {
      EXPECT_EQ(st.code(), StatusCode::kIoError) << st.to_string();
      EXPECT_NE(st.message().find("layer 1 'l1' group 1 rank 0"), std::string::npos) << st.message();
    } else {
      EXPECT_EQ(st.code(), StatusCode::kIoError) << st.to_string();  // the lost write's own error, again
      EXPECT_NE(st.message().find("roll the step back"), std::string::npos) << st.message();
      EXPECT_NE(st.message().find("layer 1 'l1' group 1 rank 0"), std::string::npos) << st.message();
    }
    EXPECT_LE(reported, 1);
    EXPECT_EQ(counters_->eio.load(), 1u);
    EXPECT_FALSE(tier->commit().ok());  // still refused
    ASSERT_TRUE(tier->rollback().ok());
    for (size_t i = 0; i < pieces.size(); ++i) {
      auto s = tier->open(pieces[i].id);
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      EXPECT_EQ(snapshot(*s), before[i]);
      ASSERT_TRUE(tier->close(pieces[i].id, false).ok());
    }
    EXPECT_TRUE(tier->commit().ok());  // after the rollback: committable again
  }
  engine_.reset();
}

// --------------------------------------------------------------- pending versions (early updates)

// Note [Piece versions]: with pending_versions a piece keeps an early
// update's state as a third version beside the committed one and the newest
// one: open() keeps reading the newest until keep_pending(); drop_pending(),
// a normal write of the piece (a redo) and rollback() forget it.
TEST_F(NvmeStateTierTest, PendingVersionsBesideTheCommittedAndTheNewest) {
  const std::vector<PieceSpec> pieces = {{{0, 0, 0}, 3000, true}, {{0, 1, 0}, 5000, true}, {{1, 0, 0}, 777, false},
                                         {{1, 1, 0}, 0, true}};
  for (bool pipeline : {false, true}) {
    SCOPED_TRACE(pipeline ? "pipeline read/write" : "synchronous");
    NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), pipeline ? "pending-p" : "pending-s");
    o.pipeline_read = o.pipeline_write = pipeline;
    o.pending_versions = true;
    auto tier = make(o);
    ASSERT_TRUE(tier);
    ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
    for (const PieceSpec& p : pieces) ASSERT_TRUE(tier->add_pending(p.id).ok());
    const uint64_t one_version = tier->bytes();
    // Every piece opened, scribbled with `salt` and closed as `how` says.
    enum class Close { kModified, kPending };
    auto walk = [&](int salt, Close how) {
      std::vector<std::vector<std::byte>> out;
      for (const PieceSpec& p : pieces) {
        auto s = tier->open(p.id);
        EXPECT_TRUE(s.ok()) << s.status().to_string();
        if (!s.ok()) return out;
        scribble(*s, salt);
        out.push_back(snapshot(*s));
        const Status closed = how == Close::kPending ? tier->close_pending(p.id) : tier->close(p.id, true);
        EXPECT_TRUE(closed.ok()) << closed.to_string();
      }
      return out;
    };
    auto read_all = [&]() { return read_every_piece(*tier, pieces); };
    auto keep_all = [&]() {
      for (const PieceSpec& p : pieces) {
        EXPECT_TRUE(tier->pending_written(p.id).ok());
        const Status kept = tier->keep_pending(p.id);
        EXPECT_TRUE(kept.ok()) << kept.to_string();
      }
    };
    // Step 1 written, not committed; step 2's early updates beside it.
    const auto step1 = walk(1, Close::kModified);
    const auto early2 = walk(2, Close::kPending);
    EXPECT_EQ(read_all(), step1);  // the newest version, not the pending one
    EXPECT_EQ(tier->bytes(), 3 * one_version);
    ASSERT_TRUE(tier->commit().ok());  // step 1: the pending version is no step's yet
    EXPECT_EQ(read_all(), step1);
    keep_all();
    EXPECT_EQ(read_all(), early2);
    // A rollback now goes back to step 1 (step 2 is not committed).
    ASSERT_TRUE(tier->rollback().ok());
    EXPECT_EQ(read_all(), step1);
    // Dropped: nothing to keep, the state stays.
    walk(3, Close::kPending);
    for (const PieceSpec& p : pieces) ASSERT_TRUE(tier->drop_pending(p.id).ok());
    EXPECT_EQ(read_all(), step1);
    EXPECT_EQ(tier->keep_pending(pieces[0].id).code(), StatusCode::kFailedPrecondition);
    // Redone: a normal write of the piece supersedes its pending version.
    walk(4, Close::kPending);
    const auto redo = walk(5, Close::kModified);
    EXPECT_EQ(read_all(), redo);
    EXPECT_EQ(tier->pending_written(pieces[0].id).code(), StatusCode::kFailedPrecondition);
    ASSERT_TRUE(tier->commit().ok());
    // Forgotten by a rollback; the read-ahead of the replaced version is
    // dropped when a pending one is kept.
    walk(6, Close::kPending);
    ASSERT_TRUE(tier->rollback().ok());
    EXPECT_EQ(tier->keep_pending(pieces[1].id).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(read_all(), redo);
    const auto early7 = walk(7, Close::kPending);
    tier->prefetch(pieces[0].id);
    keep_all();
    EXPECT_EQ(read_all(), early7);
    ASSERT_TRUE(tier->commit().ok());
    EXPECT_EQ(read_all(), early7);
    EXPECT_EQ(tier->bytes(), 3 * one_version);  // each version counted once per piece
    EXPECT_EQ(stats_.get(Tier::kNvme).current_bytes, 3 * one_version);
  }
}

// Read-ahead never reads a piece whose pending version is not kept yet (it
// would read the version the keep replaces and drop it there): such a piece
// holds its place in the window, and is read once kept, in the version kept.
// A redo reads the newest version on demand.
TEST_F(NvmeStateTierTest, ReadAheadWaitsForAPendingVersionToBeKept) {
  const std::vector<PieceSpec> pieces = {{{3, 0, 0}, 3000, true}, {{2, 0, 0}, 5000, true}, {{1, 0, 0}, 4000, true},
                                         {{0, 0, 0}, 2000, true}};
  NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), "pending-read-ahead");
  o.pipeline_read = o.pipeline_write = true;
  o.pending_versions = true;
  o.buffer_count = 2;  // the window: two pieces ahead
  auto tier = make(o);
  ASSERT_TRUE(tier);
  ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
  std::vector<StateId> order;
  for (const PieceSpec& p : pieces) {
    ASSERT_TRUE(tier->add_pending(p.id).ok());
    order.push_back(p.id);
  }
  // Early updates of every piece: pending versions beside the newest.
  std::vector<std::vector<std::byte>> early(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    auto s = tier->open(pieces[i].id);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    scribble(*s, 1);
    early[i] = snapshot(*s);
    ASSERT_TRUE(tier->close_pending(pieces[i].id).ok());
  }
  ASSERT_TRUE(tier->flush().ok());
  const StateTierIoStats before = tier->io_stats();
  // The walk starts again: nothing is read while the pieces wait for their
  // keep. Pieces 0 and 1 kept: read ahead now, in their kept version; piece
  // 3's pending version dropped: read ahead in its newest; the redo of piece
  // 2 reads its newest version on demand.
  tier->set_order(order);
  for (size_t i : {0, 1}) {
    const Status kept = tier->keep_pending(pieces[i].id);
    ASSERT_TRUE(kept.ok()) << kept.to_string();
  }
  ASSERT_TRUE(tier->drop_pending(pieces[3].id).ok());
  for (size_t i = 0; i < pieces.size(); ++i) {
    SCOPED_TRACE(fmt::format("piece {}", i));
    auto s = tier->open(pieces[i].id);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    if (i < 2) EXPECT_EQ(snapshot(*s), early[i]);
    else EXPECT_NE(snapshot(*s), early[i]);  // the newest version, not the pending one
    ASSERT_TRUE(tier->close(pieces[i].id, i == 2).ok());
  }
  const StateTierIoStats after = tier->io_stats();
  EXPECT_EQ(after.read_ahead_dropped, before.read_ahead_dropped);
  EXPECT_EQ(after.prefetched_opens - before.prefetched_opens, 3u) << "pieces 0, 1 and 3 were read ahead";
  EXPECT_EQ(after.reads - before.reads, pieces.size()) << "every piece read once";
}

// A pending version whose write fails is no lost step: pending_written()
// names the piece, the commit of the step before goes through, the pending
// version cannot be kept, and a normal write (the redo) succeeds.
TEST_F(NvmeStateTierFaultTest, AFailedPendingWriteIsRedoneNotALostStep) {
  nvme::FaultPlan plan;
  plan.eio_probability = 1;
  plan.fault_reads = false;
  ASSERT_NO_FATAL_FAILURE(make_faulty(plan));
  const std::vector<PieceSpec> pieces = {{{2, 0, 0}, 6000, true}};
  for (bool pipeline : {false, true}) {
    SCOPED_TRACE(pipeline ? "pipeline write" : "synchronous write");
    NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), pipeline ? "pending-eio-p" : "pending-eio-s");
    o.pipeline_write = pipeline;
    o.pending_versions = true;
    auto tier = make(o, engine_.get());
    ASSERT_TRUE(tier);
    ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
    const StateId id = pieces[0].id;
    ASSERT_TRUE(tier->add_pending(id).ok());
    auto s = tier->open(id);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    const std::vector<std::byte> before = snapshot(*s);
    scribble(*s, 1);
    counters_->arm(0, 1);
    tier->close_pending(id).ignore();  // the failure is pending_written()'s to report
    const Status written = tier->pending_written(id);
    counters_->disarm();
    EXPECT_EQ(written.code(), StatusCode::kIoError) << written.to_string();
    EXPECT_NE(written.message().find("layer 2 'l2' group 0 rank 0"), std::string::npos) << written.message();
    EXPECT_NE(written.message().find("pending version"), std::string::npos) << written.message();
    EXPECT_FALSE(tier->keep_pending(id).ok());
    const Status committed = tier->commit();
    EXPECT_TRUE(committed.ok()) << committed.to_string();
    auto again = tier->open(id);
    ASSERT_TRUE(again.ok()) << again.status().to_string();
    EXPECT_EQ(snapshot(*again), before);
    scribble(*again, 2);
    const std::vector<std::byte> redone = snapshot(*again);
    ASSERT_TRUE(tier->close(id, true).ok());
    ASSERT_TRUE(tier->commit().ok());
    auto after = tier->open(id);
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(snapshot(*after), redone);
    ASSERT_TRUE(tier->close(id, false).ok());
    EXPECT_EQ(counters_->eio.exchange(0), 1u);
  }
}

}  // namespace
}  // namespace strata::offload
