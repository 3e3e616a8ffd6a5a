// The NVMe tier of optimizer state: round trips of odd-sized pieces, every
// pipeline setting giving the same bytes, cpu_adam through it bit-identical
// to the pinned memory tier, faults from the injector (EIO on read and
// write, a flipped bit, transient errors), the folder lock, a piece too big
// for a slot, bounded slots, bad options (its versions:
// nvme_state_tier_versions_test.cpp).
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "nvme_state_tier_fixture.h"

namespace strata::offload {
namespace {

// --------------------------------------------------------------- round trips

TEST_F(NvmeStateTierTest, RoundTripOfOddPiecesInEveryMomentStorage) {
  for (cpu_adam::MomentStorage md :
       {cpu_adam::MomentStorage::fp32(), cpu_adam::MomentStorage::bf16(), cpu_adam::MomentStorage::int8()}) {
    SCOPED_TRACE(md.name());
    std::vector<PieceSpec> pieces = odd_pieces();
    NvmeStateTierOptions o = options(pieces, md, std::string("rt-") + std::string(md.name()));
    auto tier = make(o);
    ASSERT_TRUE(tier);
    EXPECT_EQ(tier->tier(), Tier::kNvme);
    EXPECT_NE(tier->describe().find(dir_.path()), std::string::npos) << tier->describe();
    ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
    EXPECT_EQ(tier->bytes(), capacity_of(pieces, md));
    EXPECT_EQ(stats_.get(Tier::kNvme).current_bytes, capacity_of(pieces, md));
    // Initial state: master as given, moments zero.
    std::vector<std::vector<std::byte>> written;
    for (const PieceSpec& p : pieces) {
      auto s = tier->open(p.id);
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      ASSERT_EQ(s->count, p.count);
      EXPECT_EQ(s->moments, md);
      EXPECT_EQ(s->master != nullptr, p.master && p.count > 0);  // an empty master span is no master
      if (p.count > 0) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(s->exp_avg) % 4096, 0u);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(s->exp_avg_sq) % 4096, 0u);
      }
      std::vector<float> m = master_init(p);
      if (p.master && p.count > 0) {
        EXPECT_EQ(std::memcmp(s->master, m.data(), p.count * 4), 0);
      }
      std::vector<std::byte> zeros(md.moment_bytes(p.count) + 1);  // + 1: never a null data()
      EXPECT_EQ(std::memcmp(s->exp_avg, zeros.data(), zeros.size() - 1), 0);
      EXPECT_EQ(std::memcmp(s->exp_avg_sq, zeros.data(), zeros.size() - 1), 0);
      scribble(*s, 1);
      written.push_back(snapshot(*s));
      ASSERT_TRUE(tier->close(p.id, true).ok());
    }
    ASSERT_TRUE(tier->flush().ok());
    // Read back in reverse (no prefetch hits) and check every byte.
    for (size_t k = pieces.size(); k-- > 0;) {
      auto s = tier->open(pieces[k].id);
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      EXPECT_EQ(snapshot(*s), written[k]) << name_of(pieces[k].id);
      ASSERT_TRUE(tier->close(pieces[k].id, false).ok());
    }
    StateTierIoStats io = tier->io_stats();
    EXPECT_GT(io.bytes_read, 0u);
    EXPECT_GE(io.bytes_written, 2 * capacity_of(pieces, md) - 1);  // initial state + one write-back each
  }
  // Every tier is gone: its pinned slots and NVMe bytes are no longer counted, and its folder is removed.
  EXPECT_EQ(stats_.get(Tier::kPinnedHost).current_bytes, 0u);
  EXPECT_EQ(stats_.get(Tier::kNvme).current_bytes, 0u);
  EXPECT_FALSE(std::filesystem::exists(nvme::swap_folder_path(dir_.path(), "rt-fp32", 0)));
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path()));
}

// Steps in order (as the engine does) with every buffer count and pipeline
// setting: the same bytes every time; slots never above buffer_count, and
// the pinned bytes are exactly the slots.
TEST_F(NvmeStateTierTest, EveryPipelineSettingGivesIdenticalBytesWithinBufferCount) {
  std::vector<PieceSpec> pieces = odd_pieces();
  for (int extra = 0; extra < 8; ++extra) pieces.push_back({{4, static_cast<uint32_t>(extra), 0}, 3000u + 999u * extra, true});
  std::vector<std::vector<std::byte>> reference;
  int runs = 0;
  for (size_t buffers = 1; buffers <= 4; ++buffers) {
    for (int pipe = 0; pipe < 4; ++pipe) {
      const bool pr = (pipe & 1) != 0, pw = (pipe & 2) != 0;
      SCOPED_TRACE(fmt::format("buffer_count {} pipeline_read {} pipeline_write {}", buffers, pr, pw));
      NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), fmt::format("p{}", runs++));
      o.buffer_count = buffers;
      o.pipeline_read = pr;
      o.pipeline_write = pw;
      auto tier = make(o);
      ASSERT_TRUE(tier);
      EXPECT_EQ(stats_.get(Tier::kPinnedHost).current_bytes, buffers * o.slot_bytes);
      ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
      for (int step = 1; step <= 3; ++step) {
        for (const PieceSpec& p : pieces) {
          if (p.count == 0) continue;  // the engine skips empty pieces
          auto s = tier->open(p.id);
          ASSERT_TRUE(s.ok()) << s.status().to_string();
          scribble(*s, step);
          ASSERT_TRUE(tier->close(p.id, true).ok());
        }
      }
      ASSERT_TRUE(tier->flush().ok());
      std::vector<std::vector<std::byte>> got;
      for (const PieceSpec& p : pieces) {
        auto s = tier->open(p.id);
        ASSERT_TRUE(s.ok()) << s.status().to_string();
        got.push_back(snapshot(*s));
        ASSERT_TRUE(tier->close(p.id, false).ok());
      }
      if (reference.empty()) reference = got;
      for (size_t k = 0; k < pieces.size(); ++k) EXPECT_EQ(got[k], reference[k]) << name_of(pieces[k].id);
      StateTierIoStats io = tier->io_stats();
      EXPECT_EQ(io.slots, buffers);
      EXPECT_LE(io.peak_slots_in_use, buffers);
      EXPECT_GE(io.peak_slots_in_use, 1u);
      if (pr && buffers >= 2) {
        EXPECT_GT(io.prefetched_opens, 0u);  // the read-ahead was used
      } else if (!pr) {
        EXPECT_EQ(io.prefetched_opens, 0u);
      }
    }
  }
}

// The engine's out-of-order walk (gather_state: one rank's pieces only) and
// more open pieces than slots.
TEST_F(NvmeStateTierTest, OutOfOrderOpensAndTooManyOpenPieces) {
  std::vector<PieceSpec> pieces;
  for (uint32_t g = 0; g < 6; ++g)
    for (int r = 0; r < 2; ++r) pieces.push_back({{0, g, r}, 5000u + g * 100 + r, true});
  NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), "ooo");
  o.buffer_count = 2;
  auto tier = make(o);
  ASSERT_TRUE(tier);
  ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
  // An explicit order (rank 1 first), then a walk of rank 0 only with hints.
  std::vector<StateId> order;
  for (int r = 1; r >= 0; --r)
    for (uint32_t g = 0; g < 6; ++g) order.push_back({0, g, r});
  tier->set_order(order);
  for (const StateId& id : order) {
    auto s = tier->open(id);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    s->master[0] = static_cast<float>(id.group * 10 + id.rank);
    ASSERT_TRUE(tier->close(id, true).ok());
  }
  for (uint32_t g = 0; g < 6; ++g) {
    tier->prefetch({0, g, 0});
    auto s = tier->open({0, g, 0});
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    EXPECT_EQ(s->master[0], static_cast<float>(g * 10));
    ASSERT_TRUE(tier->close({0, g, 0}, false).ok());
  }
  // Two slots, two open pieces: a third open says so instead of hanging.
  ASSERT_TRUE(tier->open({0, 0, 0}).ok());
  ASSERT_TRUE(tier->open({0, 1, 0}).ok());
  auto third = tier->open({0, 2, 0});
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(third.status().message().find("buffer_count"), std::string::npos) << third.status().message();
  EXPECT_NE(third.status().message().find("layer 0 'l0' group 2 rank 0"), std::string::npos);
  ASSERT_TRUE(tier->close({0, 0, 0}, false).ok());
  ASSERT_TRUE(tier->open({0, 2, 0}).ok());
  EXPECT_LE(tier->io_stats().peak_slots_in_use, 2u);
}

// Read-ahead wraps around the order (the next step's first piece is read
// while this step ends) and follows prefetch() hints.
TEST_F(NvmeStateTierTest, ReadAheadWrapsToTheNextStepAndFollowsHints) {
  std::vector<PieceSpec> pieces;
  for (uint32_t g = 0; g < 6; ++g) pieces.push_back({{0, g, 0}, 3000u + g, true});
  NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), "wrap");
  o.buffer_count = 3;
  o.pipeline_write = false;  // slots free at close(), so the wrap-around read can start there
  auto tier = make(o);
  ASSERT_TRUE(tier);
  ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
  for (const PieceSpec& p : pieces) {
    ASSERT_TRUE(tier->open(p.id).ok());
    ASSERT_TRUE(tier->close(p.id, true).ok());
  }
  uint64_t before = tier->io_stats().prefetched_opens;
  ASSERT_TRUE(tier->open(pieces[0].id).ok());
  EXPECT_EQ(tier->io_stats().prefetched_opens, before + 1) << "the next step's first piece was read ahead";
  ASSERT_TRUE(tier->close(pieces[0].id, false).ok());
  // A jump: the hint moves the read-ahead to piece 4.
  tier->prefetch(pieces[4].id);
  before = tier->io_stats().prefetched_opens;
  ASSERT_TRUE(tier->open(pieces[4].id).ok());
  EXPECT_EQ(tier->io_stats().prefetched_opens, before + 1);
  ASSERT_TRUE(tier->close(pieces[4].id, false).ok());
  EXPECT_LE(tier->io_stats().peak_slots_in_use, 3u);
}

// --------------------------------------------------------------- cpu_adam parity

TEST_F(NvmeStateTierTest, CpuAdamThroughNvmeIsBitIdenticalToPinnedMemory) {
  for (cpu_adam::MomentStorage md :
       {cpu_adam::MomentStorage::fp32(), cpu_adam::MomentStorage::bf16(), cpu_adam::MomentStorage::int8()}) {
    SCOPED_TRACE(md.name());
    std::vector<PieceSpec> pieces = {{{0, 0, 0}, 70000, true}, {{0, 1, 0}, 12345, true},
                                     {{1, 0, 0}, 4096, true},  {{2, 0, 0}, 999, true}};
    MemoryStats mem_stats;
    auto mem = make_memory_state_tier(*device_, Tier::kPinnedHost, md, mem_stats);
    ASSERT_TRUE(mem.ok());
    NvmeStateTierOptions o = options(pieces, md, std::string("adam-") + std::string(md.name()));
    o.buffer_count = 3;
    auto nv = make(o);
    ASSERT_TRUE(nv);
    for (const PieceSpec& p : pieces) {
      std::vector<float> m = master_init(p);
      ASSERT_TRUE((*mem)->add(p.id, name_of(p.id), p.count, m).ok());
      ASSERT_TRUE(nv->add(p.id, name_of(p.id), p.count, m).ok());
    }
    ASSERT_TRUE(nv->flush().ok());
    cpu_adam::OptimizerOptions oo;
    oo.threads = 2;
    auto opt = cpu_adam::CpuOptimizer::create(oo);
    ASSERT_TRUE(opt.ok());
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int step = 1; step <= 6; ++step) {
      cpu_adam::StepArgs args;
      args.step = step;
      args.hyper.lr = 1e-2;
      args.hyper.weight_decay = 0.01;
      args.clip_coefficient = 0.75;
      for (const PieceSpec& p : pieces) {
        std::vector<float> grads(p.count);
        for (float& g : grads) g = normal(rng);
        for (OptimizerStateTier* t : {mem->get(), nv.get()}) {
          auto s = t->open(p.id);
          ASSERT_TRUE(s.ok()) << s.status().to_string();
          cpu_adam::StateSpans sp;
          sp.count = s->count;
          sp.params = s->master;
          sp.grads = grads.data();
          s->moments.point(sp, s->exp_avg, s->exp_avg_sq, s->count, 0);
          auto r = opt->step(args, sp);
          ASSERT_TRUE(r.ok()) << r.status().to_string();
          ASSERT_TRUE(t->close(p.id, true).ok());
        }
      }
    }
    ASSERT_TRUE(nv->flush().ok());
    for (const PieceSpec& p : pieces) {
      auto a = (*mem)->open(p.id);
      auto b = nv->open(p.id);
      ASSERT_TRUE(a.ok() && b.ok());
      std::vector<std::byte> sa = snapshot(*a), sb = snapshot(*b);
      ASSERT_EQ(sa.size(), sb.size());
      size_t first = 0;
      while (first < sa.size() && sa[first] == sb[first]) ++first;
      EXPECT_EQ(first, sa.size()) << name_of(p.id) << ": first differing byte " << first;
      ASSERT_TRUE((*mem)->close(p.id, false).ok());
      ASSERT_TRUE(nv->close(p.id, false).ok());
    }
  }
}

// --------------------------------------------------------------- faults

TEST_F(NvmeStateTierFaultTest, EioOnReadNamesFileOffsetAndPiece) {
  for (bool pipeline_read : {false, true}) {
    SCOPED_TRACE(pipeline_read ? "pipeline_read (the failed read was started ahead)" : "read on demand");
    nvme::FaultPlan plan;
    plan.eio_probability = 1;
    plan.fault_writes = false;
    ASSERT_NO_FATAL_FAILURE(make_faulty(plan));
    std::vector<PieceSpec> pieces = {{{5, 2, 1}, 40000, true}, {{6, 0, 0}, 100, true}};
    const std::string job = pipeline_read ? "eio-read-ahead" : "eio-read";
    NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), job);
    o.pipeline_read = pipeline_read;
    {
      auto tier = make(o, engine_.get());
      ASSERT_TRUE(tier);
      counters_->arm();  // reads only: the initial writes pass, every read (also a read-ahead) fails
      ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
      auto s = tier->open({5, 2, 1});
      ASSERT_FALSE(s.ok());
      const std::string msg = s.status().message();
      std::printf("[ message  ] %s\n", s.status().to_string().c_str());
      EXPECT_EQ(s.status().code(), StatusCode::kIoError) << s.status().to_string();
      EXPECT_NE(msg.find("layer 5 'l5' group 2 rank 1"), std::string::npos) << msg;
      EXPECT_NE(msg.find(swap_file(job)), std::string::npos) << msg;
      EXPECT_NE(msg.find("offset"), std::string::npos) << msg;
      EXPECT_GT(counters_->eio.load(), 0u);
      // The fault was in the I/O, not the data: once it clears, the piece reads.
      counters_->disarm();
      auto again = tier->open({5, 2, 1});
      ASSERT_TRUE(again.ok()) << again.status().to_string();
      EXPECT_EQ(again->master[1], master_init(pieces[0])[1]);
      ASSERT_TRUE(tier->close({5, 2, 1}, false).ok());
    }
    engine_.reset();
  }
}

TEST_F(NvmeStateTierFaultTest, EioOnWriteKeepsThePreviousStateReadable) {
  for (bool pipeline_write : {false, true}) {
    SCOPED_TRACE(pipeline_write ? "pipeline_write" : "synchronous write");
    nvme::FaultPlan plan;
    plan.eio_probability = 1;
    plan.fault_reads = false;
    plan.clean_pieces = 1;  // the write fails mid-way
    ASSERT_NO_FATAL_FAILURE(make_faulty(plan));
    std::vector<PieceSpec> pieces = {{{1, 0, 0}, 60000, true}, {{1, 1, 0}, 5000, false}};
    const std::string job = pipeline_write ? "eio-write-async" : "eio-write-sync";
    NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), job);
    o.pipeline_write = pipeline_write;
    {
      auto tier = make(o, engine_.get());
      ASSERT_TRUE(tier);
      ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
      auto s = tier->open({1, 0, 0});
      ASSERT_TRUE(s.ok());
      const std::vector<std::byte> before = snapshot(*s);
      scribble(*s, 9);
      // Every initial write ended first, so the armed fault hits this write-back.
      ASSERT_TRUE(tier->flush().ok());
      counters_->arm(1);
      Status st = tier->close({1, 0, 0}, true);
      // Asynchronous: the failure comes from close() when the write already
      // failed (a fast fault), else from the next call (flush).
      if (pipeline_write && st.ok()) st = tier->flush();
      counters_->disarm();
      ASSERT_FALSE(st.ok());
      std::printf("[ message  ] %s\n", st.to_string().c_str());
      EXPECT_EQ(st.code(), StatusCode::kIoError) << st.to_string();
      EXPECT_NE(st.message().find("layer 1 'l1' group 0 rank 0"), std::string::npos) << st.message();
      EXPECT_NE(st.message().find(swap_file(job)), std::string::npos) << st.message();
      EXPECT_NE(st.message().find("offset"), std::string::npos) << st.message();
      EXPECT_NE(st.message().find("previous version"), std::string::npos) << st.message();
      EXPECT_TRUE(tier->flush().ok()) << "a failure is reported once";
      auto back = tier->open({1, 0, 0});
      ASSERT_TRUE(back.ok()) << back.status().to_string();
      EXPECT_EQ(snapshot(*back), before);
      ASSERT_TRUE(tier->close({1, 0, 0}, false).ok());
    }
    engine_.reset();
  }
}

TEST_F(NvmeStateTierFaultTest, FlippedBitIsDataLossNamingThePiece) {
  nvme::FaultPlan plan;
  plan.corrupt_read_probability = 1;
  plan.fault_writes = false;
  ASSERT_NO_FATAL_FAILURE(make_faulty(plan));
  std::vector<PieceSpec> pieces = {{{3, 4, 0}, 20000, true}};
  NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::bf16(), "flip");
  auto tier = make(o, engine_.get());
  ASSERT_TRUE(tier);
  counters_->arm();  // reads only, read-ahead included
  ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
  auto s = tier->open({3, 4, 0});
  counters_->disarm();
  ASSERT_FALSE(s.ok());
  std::printf("[ message  ] %s\n", s.status().to_string().c_str());
  EXPECT_EQ(s.status().code(), StatusCode::kDataLoss) << s.status().to_string();
  EXPECT_NE(s.status().message().find("layer 3 'l3' group 4 rank 0"), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("checksum mismatch"), std::string::npos) << s.status().message();
  EXPECT_GT(counters_->corrupt_reads.load(), 0u);
}

TEST_F(NvmeStateTierFaultTest, TransientErrorsAndShortTransfersAreInvisible) {
  nvme::FaultPlan plan;
  plan.seed = 11;
  plan.transient_probability = 0.3;
  plan.short_probability = 0.3;
  ASSERT_NO_FATAL_FAILURE(make_faulty(plan));
  counters_->arm();
  std::vector<PieceSpec> pieces = odd_pieces();
  NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), "transient");
  auto tier = make(o, engine_.get());
  ASSERT_TRUE(tier);
  ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
  for (int step = 1; step <= 2; ++step)
    for (const PieceSpec& p : pieces) {
      auto s = tier->open(p.id);
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      if (step == 1 && p.master && p.count > 0) {
        std::vector<float> m = master_init(p);
        EXPECT_EQ(std::memcmp(s->master, m.data(), p.count * 4), 0);
      }
      ASSERT_TRUE(tier->close(p.id, true).ok());
    }
  ASSERT_TRUE(tier->flush().ok());
  EXPECT_GT(counters_->transient.load() + counters_->short_transfers.load(), 0u);
}

// --------------------------------------------------------------- bad input

// Note [Piece versions]: rollback() returns every piece to its committed
// version, commit() makes the newest the committed one; a piece written twice
// in one step keeps the committed version; read-ahead of a dropped version
// is dropped; the second version is counted once as NVMe bytes.
// Note [Pending versions in memory]: the pinned tier's second buffer per
// piece; keeping it is a swap (the old state becomes the next pending
// buffer), not keeping it leaves the state as it was. Other tiers refuse.
// --------------------------------------------------------------- two callers

// Two threads open pieces of one tier (the engine's optimizer thread takes a
// checkpoint snapshot while its driving thread reads state or rolls a step
// back): a piece open on one thread is waited for, never opened twice; a
// slot held by another thread's open piece is waited for, not refused; a
// rollback waits for the other thread's close.
void OpenOnAnotherThreadIsWaitedFor(OptimizerStateTier& tier, const StateId& a, const StateId& b, bool rollback) {
  using namespace std::chrono_literals;
  std::atomic<bool> opened{false}, closing{false};
  std::vector<std::byte> written;
  std::thread holder([&] {
    auto s = tier.open(a);
    if (!s.ok()) {
      ADD_FAILURE() << s.status().to_string();
      opened = closing = true;
      return;
    }
    scribble(*s, 9);
    written = snapshot(*s);
    opened = true;
    std::this_thread::sleep_for(150ms);  // the other thread asks meanwhile
    closing = true;
    EXPECT_TRUE(tier.close(a, true).ok());
  });
  while (!opened) std::this_thread::sleep_for(1ms);
  // The same piece: returned only after the holder's close, with its bytes.
  auto same = tier.open(a);
  EXPECT_TRUE(closing.load()) << "open() returned while another thread held the piece open";
  holder.join();
  ASSERT_TRUE(same.ok()) << same.status().to_string();
  EXPECT_EQ(snapshot(*same), written);
  ASSERT_TRUE(tier.close(a, false).ok());
  // Slots: the holder takes `a` again; `b` needs a slot (one slot: the
  // holder's) and waits for it instead of failing.
  opened = closing = false;
  std::thread second([&] {
    auto s = tier.open(a);
    if (!s.ok()) {
      ADD_FAILURE() << s.status().to_string();
      opened = closing = true;
      return;
    }
    opened = true;
    std::this_thread::sleep_for(150ms);
    closing = true;
    EXPECT_TRUE(tier.close(a, false).ok());
  });
  while (!opened) std::this_thread::sleep_for(1ms);
  if (rollback) {
    Status st = tier.rollback();
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(closing.load()) << "rollback() ran while another thread held a piece open";
  } else {
    auto other = tier.open(b);
    EXPECT_TRUE(other.ok()) << other.status().to_string();
    if (other.ok()) {
      EXPECT_TRUE(tier.close(b, false).ok());
    }
  }
  second.join();
}

TEST_F(NvmeStateTierTest, APieceOpenOnAnotherThreadIsWaitedForNeverOpenedTwice) {
  const std::vector<PieceSpec> pieces = {{{0, 0, 0}, 3000, true}, {{0, 1, 0}, 5000, true}};
  for (size_t slots : {size_t{1}, size_t{3}}) {
    for (bool rollback : {false, true}) {
      SCOPED_TRACE(fmt::format("{} slot(s), {}", slots, rollback ? "rollback" : "open of another piece"));
      NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), fmt::format("threads-{}-{}", slots, rollback));
      o.buffer_count = slots;
      auto tier = make(o);
      ASSERT_TRUE(tier);
      ASSERT_NO_FATAL_FAILURE(add_all(*tier, pieces));
      OpenOnAnotherThreadIsWaitedFor(*tier, pieces[0].id, pieces[1].id, rollback);
      ASSERT_TRUE(tier->commit().ok());
    }
  }
}

TEST_F(NvmeStateTierTest, FolderLockedByALiveRunIsRefused) {
  std::vector<PieceSpec> pieces = {{{0, 0, 0}, 1000, true}};
  NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), "locked");
  auto first = make(o);
  ASSERT_TRUE(first);
  auto second = make_nvme_state_tier(o, *device_, stats_);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition) << second.status().to_string();
  EXPECT_NE(second.status().message().find("NVMe optimizer state"), std::string::npos);
  // The refused tier released what it had pinned; the first one still counts.
  EXPECT_EQ(stats_.get(Tier::kPinnedHost).current_bytes, o.buffer_count * o.slot_bytes);
  first.reset();
  EXPECT_TRUE(make(o)) << "the folder is free once the first tier is gone";
}

// A shared nvme_path is hostile input: a job folder that is a symbolic link
// (here to a folder outside the path) is never followed.
TEST_F(NvmeStateTierTest, LinkedJobFolderIsNotFollowed) {
  ScratchDir elsewhere;
  ASSERT_FALSE(elsewhere.path().empty());
  std::filesystem::create_directory_symlink(elsewhere.path(), dir_.path() + "/strata-linked");
  std::vector<PieceSpec> pieces = {{{0, 0, 0}, 1000, true}};
  auto t = make_nvme_state_tier(options(pieces, cpu_adam::MomentStorage::fp32(), "linked"), *device_, stats_);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kFailedPrecondition) << t.status().to_string();
  EXPECT_NE(t.status().message().find("link"), std::string::npos) << t.status().message();
  EXPECT_TRUE(std::filesystem::is_empty(elsewhere.path()));
}

TEST_F(NvmeStateTierTest, PieceTooBigForASlotNamesSubGroupSizeAndSlot) {
  std::vector<PieceSpec> pieces = {{{0, 0, 0}, 10000, true}};
  NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), "big");
  o.slot_bytes = 64 * 1024;
  auto tier = make(o);
  ASSERT_TRUE(tier);
  std::vector<float> m = master_init(pieces[0]);
  Status st = tier->add(pieces[0].id, "layer 0 'wte' group 0 rank 0", 10000, m);
  std::printf("[ message  ] %s\n", st.to_string().c_str());
  ASSERT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("layer 0 'wte' group 0 rank 0"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("sub_group_size"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("64.00 KiB"), std::string::npos) << st.message();
  EXPECT_EQ(tier->bytes(), 0u);
}

TEST_F(NvmeStateTierTest, BadOptionsNameTheField) {
  std::vector<PieceSpec> pieces = {{{0, 0, 0}, 1000, true}};
  auto expect_bad = [&](NvmeStateTierOptions o, const char* needle) {
    auto t = make_nvme_state_tier(o, *device_, stats_);
    ASSERT_FALSE(t.ok()) << needle;
    EXPECT_NE(t.status().message().find(needle), std::string::npos) << t.status().message();
  };
  NvmeStateTierOptions o = options(pieces, cpu_adam::MomentStorage::fp32(), "bad");
  NvmeStateTierOptions b = o;
  b.buffer_count = 0;
  expect_bad(b, "buffer_count");
  b = o;
  b.slot_bytes = 0;
  expect_bad(b, "slot_bytes");
  b = o;
  b.capacity_bytes = 0;
  expect_bad(b, "capacity_bytes");
  b = o;
  b.nvme_paths.clear();
  expect_bad(b, "nvme_path");
  b = o;
  b.job = "../escape";
  expect_bad(b, "job");
  b = o;
  b.aio.queue_depth = 0;
  expect_bad(b, "queue_depth");
  EXPECT_EQ(stats_.get(Tier::kPinnedHost).current_bytes, 0u);
  // More state than the drive holds: refused up front (ENOSPC predicted), nothing left behind.
  b = o;
  b.capacity_bytes = 1ull << 50;
  auto huge = make_nvme_state_tier(b, *device_, stats_);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted) << huge.status().to_string();
  EXPECT_NE(huge.status().message().find("available"), std::string::npos) << huge.status().message();
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path()));
  // More state than the capacity given: refused at add() with the sizes.
  auto tier = make(o);
  ASSERT_TRUE(tier);
  std::vector<float> m(1000, 1.0f);
  ASSERT_TRUE(tier->add({0, 0, 0}, "a", 1000, m).ok());
  Status st = tier->add({0, 1, 0}, "b", 1000, m);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.to_string();
  EXPECT_NE(st.message().find("capacity"), std::string::npos);
}

}  // namespace
}  // namespace strata::offload
