// The NVMe tier of optimizer state: see nvme_state_tier.h for the layout,
// the pipeline and the error rules.
#include "strata/offload/nvme_state_tier.h"

#include <atomic>
#include <cmath>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "strata/core/slot_pool.h"
#include "strata/core/units.h"
#include "strata/nvme/aio_config.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_store.h"
#include "nvme_streaming.h"
#include "strata/offload/testing/nvme_state_tier_seam.h"

namespace strata::offload {
namespace {

uint64_t align_up(uint64_t n) { return (n + kNvmeStateAlign - 1) / kNvmeStateAlign * kNvmeStateAlign; }

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

struct IdLess {
  bool operator()(const StateId& a, const StateId& b) const {
    return std::tie(a.layer, a.group, a.rank) < std::tie(b.layer, b.group, b.rank);
  }
};

constexpr size_t kNotInOrder = static_cast<size_t>(-1);

class NvmeStateTier final : public OptimizerStateTier {
 public:
  // `io`: the I/O engine a test gave (testing::make_nvme_state_tier_on), or
  // null for one made from options.aio.
  NvmeStateTier(const NvmeStateTierOptions& options, nvme::IoEngine* io, Device& device, MemoryStats& stats)
      : options_(options), given_engine_(io), device_(device), stats_(stats) {}
  ~NvmeStateTier() override;

  Status init();

  Tier tier() const override { return Tier::kNvme; }
  std::string describe() const override { return description_; }
  Status add(const StateId& id, const std::string& name, size_t count, std::span<const float> master_init) override;
  Result<PieceState> open(const StateId& id) override;
  Status close(const StateId& id, bool modified) override;
  uint64_t bytes() const override { return published_bytes_.load(std::memory_order_relaxed); }
  void set_order(std::span<const StateId> order) override;
  void prefetch(const StateId& id) override;
  Status flush() override;
  StateTierIoStats io_stats() const override;
  bool versioned() const override { return true; }
  Status commit() override;
  Status committable() const override;
  Status rollback() override;
  uint64_t rollbacks() const override { return rollbacks_.load(std::memory_order_acquire); }
  Status add_pending(const StateId& id) override;
  Status close_pending(const StateId& id) override;
  Status pending_written(const StateId& id) override;
  Status keep_pending(const StateId& id) override;
  Status drop_pending(const StateId& id) override;

 private:
  enum class Where : uint8_t { kDisk, kReading, kOpen, kWriting };
  struct Piece {
    StateId id;
    std::string name;
    size_t count = 0;
    bool has_master = false;
    uint64_t bytes = 0;  // nvme_piece_bytes
    Where where = Where::kDisk;
    Slot slot;           // kReading, kOpen
    std::thread::id opener;  // kOpen: the thread that holds it (Note [Piece leases] in state_tier.h)
    nvme::SwapHandle io; // kReading: its read; kWriting: its write (the slot is released after it)
    bool initial = false;  // the write in flight is the first (add): a failure leaves no state
    bool prefetched = false;
    Status lost;         // the initial write failed: open() returns this
    // Note [Piece versions]: up to three SwapStore tensors per piece.
    // `committed` holds the last committed step's state, `latest` what
    // open() reads (the same until close(modified) writes another one),
    // `pending` an early update's state (close_pending) until it is kept
    // or forgotten.
    uint8_t committed = 0, latest = 0, pending = kNoVersion;
    uint8_t latest_before_write = 0;  // kWriting: `latest` to go back to if the write fails
    bool writing_pending = false;     // kWriting: the write is close_pending()'s
    Status pending_lost;              // close_pending()'s write failed
    uint8_t versions_written = 1;     // bit v: version v has been written once (its extent counted)
  };
  static constexpr uint8_t kNoVersion = 0xff;
  static constexpr uint8_t kVersions = 3;
  static nvme::TensorId tensor(size_t index, uint8_t version) {
    return static_cast<nvme::TensorId>(index) * kVersions + version;
  }
  // A version of p other than `a` and `b` (kNoVersion counts as none).
  static uint8_t version_other_than(uint8_t a, uint8_t b);
  // Counts p's version v on NVMe the first time it is written.
  void count_version(Piece& p, uint8_t version);
  // Writes p's slot (its lease just ended) as `version`: pipelined, the
  // piece is kWriting until harvest() counts it; else waited for here and
  // counted, the slot returned. `started` false: the write could not start
  // (the slot is returned). `status`: why it did not start, or the waited
  // write's result.
  struct WriteOutcome {
    bool started = false;
    Status status;
  };
  WriteOutcome write_slot(Piece& p, uint8_t version, bool pending);
  // A failed write of p's pending version, named.
  Status pending_write_lost(const Piece& p, Status error) const;
  // Waits for the pending version's write of p, if in flight (mu_ held).
  void wait_pending_write(Piece& p);
  // Waits for every write in flight (each slot comes back); returns harvest().
  Status wait_writes();
  // options_.wait_timeout_s for the writes in flight (together); harvests nothing.
  Status bound_writes() const;
  Status refused() const;

  Piece& find(const StateId& id, const char* what);
  std::string piece_name(const Piece& p) const { return fmt::format("optimizer state of {}", p.name); }
  // Completed writes: state updated, each failure returned once (the first).
  Status harvest();
  // Waits for p's write (open of a piece still being written).
  Status finish_write(Piece& p);
  Status start_read(Piece& p);
  Status wait_read(Piece& p);
  // Gives up p's read (ahead or on demand): waited for, its slot returned,
  // counted in io_.read_ahead_dropped when it was read ahead; a failed read
  // is read again (and reported) on demand.
  void drop_read(Piece& p);
  // A slot for an open() of p; nullopt when every slot is held by pieces
  // other threads hold open (wait for a close, then look again).
  Result<std::optional<Slot>> acquire_for_demand(const Piece& p);
  // Note [Piece leases]: pieces open on threads other than the caller's.
  size_t open_elsewhere() const;
  // Waits (mu_ released) for a close() on another thread; DeadlineExceeded
  // saying `what` once `deadline` has passed.
  Status wait_for_a_close(std::unique_lock<std::mutex>& lock, std::chrono::steady_clock::time_point deadline,
                          const std::string& what);
  void pump();
  PieceState state_of(const Piece& p);
  size_t held_by_pieces() const { return open_count_ + reading_count_; }
  // Copies the counters for bytes() and io_stats(), which never take mu_:
  // the engine reads them from its driving thread while the optimizer
  // thread may hold mu_ waiting for a read.
  void publish();
  struct Publisher {
    NvmeStateTier* tier;
    ~Publisher() { tier->publish(); }
  };

  NvmeStateTierOptions options_;
  nvme::IoEngine* given_engine_ = nullptr;
  Device& device_;
  MemoryStats& stats_;
  std::string description_;
  uint64_t capacity_bytes_ = 0;

  std::unique_ptr<nvme::IoEngine> owned_engine_;
  nvme::IoEngine* engine_ = nullptr;
  std::unique_ptr<SlotPool> pool_;
  bool registered_ = false;
  std::unique_ptr<nvme::SwapStore> store_;  // after pool_ and the engine: destroyed first

  mutable std::mutex mu_;
  std::condition_variable closed_;  // a piece was closed (Note [Piece leases])
  std::atomic<uint64_t> rollbacks_{0};
  std::vector<Piece> pieces_;
  std::map<StateId, size_t, IdLess> index_;
  std::vector<size_t> order_;       // piece indices, open() order
  std::vector<size_t> order_pos_;   // per piece: position in order_, or kNotInOrder
  size_t cursor_ = 0;               // position of the last opened piece in order_
  std::vector<size_t> writing_;     // pieces with a write in flight
  size_t open_count_ = 0, reading_count_ = 0;
  uint64_t state_bytes_ = 0;  // on NVMe: both versions once written
  uint64_t added_bytes_ = 0;  // one version of every piece added
  Status lost_write_;  // the first write-back that failed since the last commit or rollback
  StateTierIoStats io_;
  mutable std::mutex published_mu_;   // guards published_ (never held while waiting)
  StateTierIoStats published_;
  std::atomic<uint64_t> published_bytes_{0};
  alignas(64) std::byte empty_[64] = {};  // where an empty piece points
};

// ---------------------------------------------------------------- set-up

Status NvmeStateTier::init() {
  const NvmeStateTierOptions& o = options_;
  if (o.nvme_paths.empty())
    return InvalidArgument("NVMe optimizer state: no nvme_path given (zero_optimization.offload_optimizer.nvme_path)");
  if (o.buffer_count < 1 || o.buffer_count > 65536)
    return InvalidArgument(fmt::format(
        "NVMe optimizer state: buffer_count {} is out of range 1..65536 (zero_optimization.offload_optimizer."
        "buffer_count; 4 or more overlaps reads, steps and writes)",
        o.buffer_count));
  if (o.slot_bytes == 0)
    return InvalidArgument("NVMe optimizer state: slot_bytes is 0; size slots for the largest piece "
                           "(nvme_piece_bytes of sub_group_size elements)");
  if (o.capacity_bytes == 0)
    return InvalidArgument("NVMe optimizer state: capacity_bytes is 0; pass the sum of nvme_piece_bytes over the "
                           "pieces to be added");
  options_.slot_bytes = align_up(o.slot_bytes);

  STRATA_ASSIGN_OR_RETURN(engine_, io_engine_for(given_engine_, o.aio, owned_engine_, "NVMe optimizer state"));
  STRATA_ASSIGN_OR_RETURN(pool_, registered_slots(device_, *engine_, stats_, o.buffer_count, options_.slot_bytes,
                                                  kNvmeStateAlign, "NVMe optimizer state",
                                                  "lower zero_optimization.offload_optimizer.buffer_count or "
                                                  "sub_group_size"));
  registered_ = true;

  nvme::SwapStoreOptions so;
  so.paths = o.nvme_paths;
  so.job = o.job;
  so.rank = o.rank;
  // Two versions of the state (Note [Piece versions]), one more state's
  // worth so pieces of uneven sizes find room in fragmented free space, and
  // shadow space: every write in flight holds a slot, so at most
  // buffer_count fresh extents exist beside the versions (one slot more for
  // uneven sizes).
  capacity_bytes_ = o.capacity_bytes;
  // A third version per piece with pending_versions.
  so.capacity_bytes = (o.pending_versions ? 4 : 3) * o.capacity_bytes + (o.buffer_count + 1) * options_.slot_bytes;
  so.verify_checksums = o.verify_checksums;
  so.verify_writes = o.verify_writes;
  Result<std::unique_ptr<nvme::SwapStore>> store = nvme::SwapStore::open(so, *engine_);
  if (!store.ok()) return store.status().with_context("NVMe optimizer state");
  store_ = std::move(store).value();

  std::string paths;
  for (const std::string& p : o.nvme_paths) paths += (paths.empty() ? "" : ", ") + p;
  description_ = fmt::format("NVMe ({}; {}; {} x {} pinned slots; pipeline read {}, write {})", paths,
                             engine_->describe(), o.buffer_count, format_bytes(options_.slot_bytes, true),
                             o.pipeline_read ? "on" : "off", o.pipeline_write ? "on" : "off");
  io_.slots = o.buffer_count;
  publish();
  return Status::Ok();
}

NvmeStateTier::~NvmeStateTier() {
  // Nothing may touch a slot or the store after this: wait for every
  // operation, return every slot, then close the store (removes the files).
  for (Piece& p : pieces_) {
    if (p.io.valid()) p.io.wait().ignore();
    p.io = {};
    p.slot.reset();
  }
  if (store_) store_->close().ignore();
  store_.reset();
  if (state_bytes_ > 0) stats_.on_free(Tier::kNvme, state_bytes_);
  if (registered_) engine_->unregister_buffer(pool_->base()).ignore();
  pool_.reset();
  owned_engine_.reset();
}

// ---------------------------------------------------------------- helpers

NvmeStateTier::Piece& NvmeStateTier::find(const StateId& id, const char* what) {
  auto it = index_.find(id);
  STRATA_CHECK(it != index_.end(), fmt::format("{} of an optimizer state piece (layer {} group {} rank {}) that was "
                                               "never added",
                                               what, id.layer, id.group, id.rank));
  return pieces_[it->second];
}

PieceState NvmeStateTier::state_of(const Piece& p) {
  PieceState s;
  s.count = p.count;
  s.moments = options_.moments;
  if (p.count == 0) {
    s.exp_avg = s.exp_avg_sq = empty_;
    s.master = p.has_master ? reinterpret_cast<float*>(empty_) : nullptr;
    return s;
  }
  auto* base = static_cast<std::byte*>(p.slot.data());
  const uint64_t master_bytes = p.has_master ? align_up(p.count * sizeof(float)) : 0;
  const uint64_t moment_bytes = align_up(options_.moments.moment_bytes(p.count));
  s.master = p.has_master ? reinterpret_cast<float*>(base) : nullptr;
  s.exp_avg = base + master_bytes;
  s.exp_avg_sq = base + master_bytes + moment_bytes;
  return s;
}

Status NvmeStateTier::harvest() {
  Status first;
  for (size_t k = 0; k < writing_.size();) {
    Piece& p = pieces_[writing_[k]];
    if (!p.io.done()) {
      ++k;
      continue;
    }
    Status st = p.io.wait();
    p.io = {};
    p.where = Where::kDisk;
    const bool was_pending = p.writing_pending;
    p.writing_pending = false;
    if (st.ok()) {
      io_.bytes_written += p.bytes;
      ++io_.writes;
    } else if (was_pending) {
      // No step's state is lost: the update is redone (pending_written()).
      p.pending_lost = pending_write_lost(p, std::move(st));
    } else {
      Status named = std::move(st).with_context(
          fmt::format("{}: {}", piece_name(p),
                      p.initial ? "the initial write to NVMe failed (the piece has no state)"
                                : "the write-back to NVMe failed (the previous version stays readable)"));
      if (p.initial) p.lost = named;
      p.latest = p.latest_before_write;  // the shadow write left that version as it was
      if (!p.initial && lost_write_.ok()) lost_write_ = named;
      if (first.ok()) first = std::move(named);
    }
    p.initial = false;
    writing_[k] = writing_.back();
    writing_.pop_back();
  }
  return first;
}

Status NvmeStateTier::finish_write(Piece& p) {
  const uint64_t t0 = now_ns();
  p.io.wait().ignore();  // harvest() reads the status
  io_.write_wait_ns += now_ns() - t0;
  return harvest();
}

Status NvmeStateTier::start_read(Piece& p) {
  Result<nvme::SwapHandle> r = store_->read(tensor(static_cast<size_t>(&p - pieces_.data()), p.latest), p.slot.data(), p.bytes);
  if (!r.ok()) return r.status().with_context(fmt::format("reading {} from NVMe", piece_name(p)));
  p.io = *r;
  p.where = Where::kReading;
  ++reading_count_;
  return Status::Ok();
}

Status NvmeStateTier::wait_read(Piece& p) {
  const uint64_t t0 = now_ns();
  Status st = p.io.wait();
  io_.read_wait_ns += now_ns() - t0;
  p.io = {};
  --reading_count_;
  if (!st.ok()) {
    p.slot.reset();
    p.where = Where::kDisk;
    p.prefetched = false;
    return std::move(st).with_context(fmt::format("reading {} from NVMe", piece_name(p)));
  }
  io_.bytes_read += p.bytes;
  ++io_.reads;
  return Status::Ok();
}

void NvmeStateTier::drop_read(Piece& p) {
  if (p.prefetched) ++io_.read_ahead_dropped;
  wait_read(p).ignore();
  p.slot.reset();
  p.where = Where::kDisk;
  p.prefetched = false;
}

Result<std::optional<Slot>> NvmeStateTier::acquire_for_demand(const Piece& want) {
  const std::string holder = piece_name(want);
  for (;;) {
    Result<Slot> slot = pool_->try_acquire(holder);
    if (slot.ok()) return std::optional<Slot>(std::move(slot).value());
    // A slot not held by an open or read-ahead piece is a write-back in
    // flight (or just finished): it comes back by itself.
    if (held_by_pieces() < pool_->slot_count()) {
      STRATA_ASSIGN_OR_RETURN(Slot s, pool_->acquire(holder));
      return std::optional<Slot>(std::move(s));
    }
    // Every slot holds an open or read-ahead piece: drop the read-ahead
    // piece farthest in the order from the one wanted.
    const size_t n = order_.size();
    const size_t from = order_pos_[&want - pieces_.data()];
    size_t victim = kNotInOrder, best = 0;
    for (size_t i = 0; i < pieces_.size(); ++i) {
      if (pieces_[i].where != Where::kReading) continue;
      const size_t pos = order_pos_[i];
      size_t distance = n + 1;  // pieces outside the order go first
      if (pos != kNotInOrder && from != kNotInOrder) distance = (pos + n - from) % n;
      if (victim == kNotInOrder || distance > best) victim = i, best = distance;
    }
    // Every slot holds an open piece: another thread's close frees one.
    if (victim == kNotInOrder && open_elsewhere() > 0) return std::optional<Slot>();
    if (victim == kNotInOrder)
      return FailedPrecondition(fmt::format(
          "opening {}: all {} NVMe state slots hold open pieces; close one first (or raise "
          "zero_optimization.offload_optimizer.buffer_count)",
          holder, pool_->slot_count()));
    drop_read(pieces_[victim]);
  }
}

void NvmeStateTier::pump() {
  if (!options_.pipeline_read || order_.empty()) return;
  const size_t n = order_.size();
  size_t ahead = 0;
  for (size_t d = 1; d < n && ahead < options_.buffer_count; ++d) {
    Piece& q = pieces_[order_[(cursor_ + d) % n]];
    if (q.count == 0 || !q.lost.ok()) continue;
    ++ahead;
    // A piece with a pending version is read only once keep_pending() says
    // which version is the newest (a redo opens it on demand): read now, it
    // would be dropped there. It keeps its place in the window.
    if (q.pending != kNoVersion) continue;
    if (q.where == Where::kOpen || q.where == Where::kReading) continue;
    if (q.where == Where::kWriting) break;  // read it once its write-back is done
    Result<Slot> slot = pool_->try_acquire(piece_name(q));
    if (!slot.ok()) break;
    q.slot = std::move(slot).value();
    if (!start_read(q).ok()) {  // read again on demand by open(), which reports the error
      q.slot.reset();
      break;
    }
    q.prefetched = true;
  }
  io_.peak_slots_in_use = std::max(io_.peak_slots_in_use, pool_->stats().peak_in_use);
}

// ---------------------------------------------------------------- the interface

Status NvmeStateTier::add(const StateId& id, const std::string& name, size_t count,
                          std::span<const float> master_init) {
  std::lock_guard<std::mutex> lock(mu_);
  Publisher publisher{this};
  STRATA_CHECK(index_.find(id) == index_.end(), "optimizer state piece added twice");
  STRATA_CHECK(master_init.empty() || master_init.size() == count, "master init size mismatch");
  const bool has_master = !master_init.empty();
  const uint64_t bytes = nvme_piece_bytes(count, has_master, options_.moments);
  if (bytes > options_.slot_bytes) {
    const uint64_t per_element =
        static_cast<uint64_t>(std::ceil((has_master ? 4 : 0) + options_.moments.bytes_per_element()));
    return InvalidArgument(fmt::format(
        "optimizer state of {} ({} elements, {} with master and moments) does not fit one NVMe state slot of {}; "
        "lower zero_optimization.sub_group_size so a piece has at most {} elements, or make the slots larger",
        name, count, format_bytes(bytes, true), format_bytes(options_.slot_bytes, true),
        (options_.slot_bytes / per_element) / 1024 * 1024 - 1024));
  }
  if (added_bytes_ + bytes > capacity_bytes_)
    return ResourceExhausted(fmt::format(
        "optimizer state of {} ({}) exceeds the NVMe state capacity of {} ({} already added); size capacity_bytes "
        "as the sum of nvme_piece_bytes over the pieces",
        name, format_bytes(bytes, true), format_bytes(capacity_bytes_, true), format_bytes(added_bytes_, true)));
  Status pending = harvest();

  Piece p;
  p.id = id;
  p.name = name;
  p.count = count;
  p.has_master = has_master;
  p.bytes = bytes;
  const size_t index = pieces_.size();
  if (count > 0) {
    // Through a slot: moments zero, master copied in, written as one extent;
    // the slot returns to the pool when the write completes.
    STRATA_ASSIGN_OR_RETURN(Slot slot, pool_->acquire(fmt::format("initial state of {}", name)));
    std::memset(slot.data(), 0, bytes);
    if (has_master) std::memcpy(slot.data(), master_init.data(), count * sizeof(float));
    Result<nvme::SwapHandle> w = store_->write(tensor(index, 0), slot.data(), bytes);
    if (!w.ok()) return w.status().with_context(fmt::format("writing the initial optimizer state of {}", name));
    slot.release_after(w->completion());
    p.io = *w;
    p.where = Where::kWriting;
    p.initial = true;
    writing_.push_back(index);
    stats_.on_allocate(Tier::kNvme, bytes);
    state_bytes_ += bytes;
    added_bytes_ += bytes;
  }
  pieces_.push_back(std::move(p));
  index_.emplace(id, index);
  order_pos_.push_back(order_.size());
  order_.push_back(index);
  cursor_ = order_.size() - 1;  // the first open() is of the first piece
  io_.peak_slots_in_use = std::max(io_.peak_slots_in_use, pool_->stats().peak_in_use);
  return pending;
}

Result<PieceState> NvmeStateTier::open(const StateId& id) {
  std::unique_lock<std::mutex> lock(mu_);
  Publisher publisher{this};
  STRATA_RETURN_IF_ERROR(harvest());
  Piece& p = find(id, "open");
  const size_t index = static_cast<size_t>(&p - pieces_.data());
  if (order_pos_[index] != kNotInOrder) cursor_ = order_pos_[index];
  if (p.count == 0) {
    pump();
    return state_of(p);
  }
  // Note [Piece leases] in state_tier.h: a piece (or every slot) held by
  // another thread is waited for; the loop looks again after each wait.
  const auto deadline = std::chrono::steady_clock::now() + kPieceOpenWait;
  for (;;) {
    if (p.where == Where::kOpen) {
      STRATA_CHECK(p.opener != std::this_thread::get_id(),
                   fmt::format("{} opened twice by one thread", piece_name(p)));
      STRATA_RETURN_IF_ERROR(
          wait_for_a_close(lock, deadline, fmt::format("opening {}, open on another thread", piece_name(p))));
      continue;
    }
    if (p.where == Where::kWriting) STRATA_RETURN_IF_ERROR(finish_write(p));
    if (!p.lost.ok()) return p.lost;
    if (p.where == Where::kReading) {
      if (p.prefetched) ++io_.prefetched_opens;
      break;
    }
    STRATA_ASSIGN_OR_RETURN(std::optional<Slot> slot, acquire_for_demand(p));
    if (!slot) {
      STRATA_RETURN_IF_ERROR(wait_for_a_close(
          lock, deadline,
          fmt::format("opening {}: all {} NVMe state slots hold pieces open on other threads", piece_name(p),
                      pool_->slot_count())));
      continue;
    }
    p.slot = std::move(*slot);
    Status st = start_read(p);
    if (!st.ok()) {
      p.slot.reset();
      return st;
    }
    break;
  }
  STRATA_RETURN_IF_ERROR(wait_read(p));
  p.where = Where::kOpen;
  p.opener = std::this_thread::get_id();
  p.prefetched = false;
  ++open_count_;
  pump();
  return state_of(p);
}

size_t NvmeStateTier::open_elsewhere() const {
  const std::thread::id me = std::this_thread::get_id();
  size_t n = 0;
  for (const Piece& p : pieces_)
    if (p.where == Where::kOpen && p.opener != me) ++n;
  return n;
}

Status NvmeStateTier::wait_for_a_close(std::unique_lock<std::mutex>& lock,
                                       std::chrono::steady_clock::time_point deadline, const std::string& what) {
  if (closed_.wait_until(lock, deadline) == std::cv_status::timeout)
    return DeadlineExceeded(fmt::format(
        "{}: waited {} s for the other thread (the optimizer or a checkpoint snapshot) to close it (Note [Piece "
        "leases] in state_tier.h); that thread is stuck",
        what, kPieceOpenWait.count()));
  return Status::Ok();
}

Status NvmeStateTier::close(const StateId& id, bool modified) {
  std::lock_guard<std::mutex> lock(mu_);
  Publisher publisher{this};
  Piece& p = find(id, "close");
  if (p.count == 0) return harvest();
  STRATA_CHECK(p.where == Where::kOpen, fmt::format("{} closed but not open", piece_name(p)));
  --open_count_;
  p.where = Where::kDisk;
  closed_.notify_all();  // Note [Piece leases]: another thread may wait for it (or for its slot)
  Status result;
  if (!modified) {
    p.slot.reset();
  } else {
    // Never over the committed version: the pending one if this step wrote
    // the piece already, else the other one (Note [Piece versions]).
    // A pending version it had is superseded (its update was redone).
    p.pending = kNoVersion;
    p.pending_lost = Status::Ok();
    const uint8_t version = p.latest != p.committed ? p.latest : version_other_than(p.committed, kNoVersion);
    p.latest_before_write = p.latest;
    WriteOutcome w = write_slot(p, version, /*pending=*/false);
    if (!w.started) {
      result = std::move(w.status).with_context(fmt::format("writing {} back to NVMe", piece_name(p)));
    } else {
      p.latest = version;
      count_version(p, version);
      if (!w.status.ok()) {
        p.latest = p.latest_before_write;
        result = std::move(w.status).with_context(fmt::format(
            "{}: the write-back to NVMe failed (the previous version stays readable)", piece_name(p)));
      }
    }
    if (!result.ok() && lost_write_.ok()) lost_write_ = result;
  }
  Status pending = harvest();
  if (result.ok()) result = std::move(pending);
  pump();
  return result;
}

void NvmeStateTier::set_order(std::span<const StateId> order) {
  std::lock_guard<std::mutex> lock(mu_);
  order_.clear();
  order_pos_.assign(pieces_.size(), kNotInOrder);
  for (const StateId& id : order) {
    const size_t index = static_cast<size_t>(&find(id, "set_order") - pieces_.data());
    STRATA_CHECK(order_pos_[index] == kNotInOrder, "set_order lists a piece twice");
    order_pos_[index] = order_.size();
    order_.push_back(index);
  }
  cursor_ = order_.empty() ? 0 : order_.size() - 1;
  // Read-ahead outside the new order's first window gives its slot back (at
  // most buffer_count reads are waited for), then reading starts there.
  Publisher publisher{this};
  for (size_t i = 0; i < pieces_.size(); ++i) {
    Piece& q = pieces_[i];
    if (q.where != Where::kReading) continue;
    if (order_pos_[i] != kNotInOrder && order_pos_[i] < options_.buffer_count) continue;
    drop_read(q);
  }
  pump();
}

void NvmeStateTier::prefetch(const StateId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  Publisher publisher{this};
  auto it = index_.find(id);
  if (it == index_.end() || order_.empty()) return;
  const size_t pos = order_pos_[it->second];
  if (pos != kNotInOrder) {
    const size_t n = order_.size();
    cursor_ = (pos + n - 1) % n;
    // The order jumped: read-ahead pieces outside the new window give their
    // slots back (a read still in flight is waited for: at most
    // buffer_count of them, and none when the hint agrees with the order).
    for (size_t i = 0; i < pieces_.size(); ++i) {
      Piece& q = pieces_[i];
      if (q.where != Where::kReading) continue;
      const size_t qpos = order_pos_[i];
      if (qpos != kNotInOrder && (qpos + n - pos) % n < options_.buffer_count) continue;
      drop_read(q);
    }
    pump();
    return;
  }
  // Outside the order: read it alone if a slot is free.
  Piece& p = pieces_[it->second];
  if (p.count == 0 || p.where != Where::kDisk || !p.lost.ok() || p.pending != kNoVersion || !options_.pipeline_read)
    return;
  Result<Slot> slot = pool_->try_acquire(piece_name(p));
  if (!slot.ok()) return;
  p.slot = std::move(slot).value();
  if (!start_read(p).ok()) p.slot.reset();
  else p.prefetched = true;
}

Status NvmeStateTier::bound_writes() const {
  if (options_.wait_timeout_s <= 0) return Status::Ok();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                                std::chrono::duration<double>(options_.wait_timeout_s));
  for (size_t i : writing_) {
    const Piece& p = pieces_[i];
    if (!p.io.completion().wait_for(std::max(deadline - std::chrono::steady_clock::now(), std::chrono::nanoseconds(0))))
      return DeadlineExceeded(fmt::format("the write-back of {} ('{}') did not complete in {} s (strata.wait_timeout_s; "
                                          "a hung drive? raise it if the drive is only slow)",
                                          piece_name(p), p.io.completion().label(), options_.wait_timeout_s));
  }
  return Status::Ok();
}

Status NvmeStateTier::wait_writes() {
  const uint64_t t0 = now_ns();
  STRATA_RETURN_IF_ERROR(bound_writes());
  for (size_t i : writing_) pieces_[i].io.wait().ignore();
  if (!writing_.empty()) io_.write_wait_ns += now_ns() - t0;
  return harvest();
}

Status NvmeStateTier::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  Publisher publisher{this};
  Status st = wait_writes();
  pump();
  return st;
}

Status NvmeStateTier::commit() {
  std::lock_guard<std::mutex> lock(mu_);
  Publisher publisher{this};
  STRATA_RETURN_IF_ERROR(wait_writes());
  // A step with a lost write-back is never committed, even once its error
  // has been reported: only rollback() goes on from here.
  if (!lost_write_.ok()) return refused();
  for (Piece& p : pieces_) p.committed = p.latest;
  return Status::Ok();
}

// The lost write's own error (its file, offset and piece), as not committable.
Status NvmeStateTier::refused() const {
  return lost_write_.with_context(
      "a write-back failed since the last commit (roll the step back instead of committing it)");
}

Status NvmeStateTier::committable() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_write_.ok() ? Status::Ok() : refused();
}

Status NvmeStateTier::rollback() {
  std::unique_lock<std::mutex> lock(mu_);
  Publisher publisher{this};
  // Note [Piece leases]: pieces other threads hold open (a checkpoint
  // snapshot's read) are closed first; the caller holds none.
  const auto deadline = std::chrono::steady_clock::now() + kPieceOpenWait;
  while (open_count_ > 0) {
    for (const Piece& p : pieces_)
      STRATA_CHECK(p.where != Where::kOpen || p.opener != std::this_thread::get_id(),
                   fmt::format("{} is open during a rollback", piece_name(p)));
    STRATA_RETURN_IF_ERROR(wait_for_a_close(
        lock, deadline,
        fmt::format("rolling back the optimizer state on NVMe, {} piece(s) open on another thread", open_count_)));
  }
  // A write-back that does not end cannot be forgotten (it writes a slot).
  STRATA_RETURN_IF_ERROR(bound_writes());
  rollbacks_.fetch_add(1, std::memory_order_acq_rel);
  // The failed step's write-backs and their errors go with it.
  wait_writes().ignore();
  for (Piece& p : pieces_) {
    if (p.where == Where::kReading) drop_read(p);  // read-ahead of a version being forgotten
    p.latest = p.committed;
    p.pending = kNoVersion;
    p.pending_lost = Status::Ok();
  }
  lost_write_ = Status::Ok();
  pump();
  return Status::Ok();
}

// ---------------------------------------------------------------- pending versions (Note [Piece versions])

uint8_t NvmeStateTier::version_other_than(uint8_t a, uint8_t b) {
  for (uint8_t v = 0; v < kVersions; ++v)
    if (v != a && v != b) return v;
  return kNoVersion;  // unreachable: three versions, two excluded at most
}

void NvmeStateTier::count_version(Piece& p, uint8_t version) {
  const uint8_t bit = static_cast<uint8_t>(1u << version);
  if ((p.versions_written & bit) != 0) return;
  p.versions_written |= bit;
  stats_.on_allocate(Tier::kNvme, p.bytes);
  state_bytes_ += p.bytes;
}

Status NvmeStateTier::add_pending(const StateId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  find(id, "add_pending");
  if (!options_.pending_versions)
    return Unsupported(describe() + " was created without pending versions (NvmeStateTierOptions::pending_versions)");
  return Status::Ok();
}

Status NvmeStateTier::close_pending(const StateId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  Publisher publisher{this};
  Piece& p = find(id, "close_pending");
  STRATA_CHECK(options_.pending_versions, "close_pending on an NVMe tier without pending versions");
  if (p.count == 0) return harvest();
  STRATA_CHECK(p.where == Where::kOpen, fmt::format("{} closed but not open", piece_name(p)));
  --open_count_;
  p.where = Where::kDisk;
  closed_.notify_all();  // Note [Piece leases]
  // Never over the committed version nor the newest one (the step before
  // may still be rolled back, and a redo reads the newest).
  const uint8_t version = version_other_than(p.committed, p.latest);
  p.pending = kNoVersion;
  p.pending_lost = Status::Ok();
  WriteOutcome w = write_slot(p, version, /*pending=*/true);
  if (!w.started) {
    p.pending_lost = std::move(w.status).with_context(
        fmt::format("writing the pending version of {} to NVMe", piece_name(p)));
  } else {
    p.pending = version;
    count_version(p, version);
    if (!w.status.ok()) p.pending_lost = pending_write_lost(p, std::move(w.status));
  }
  Status pending = harvest();
  pump();
  return pending;  // (a failed pending write is pending_written()'s to report)
}

NvmeStateTier::WriteOutcome NvmeStateTier::write_slot(Piece& p, uint8_t version, bool pending) {
  const size_t index = static_cast<size_t>(&p - pieces_.data());
  Result<nvme::SwapHandle> w = store_->write(tensor(index, version), p.slot.data(), p.bytes);
  if (!w.ok()) {
    p.slot.reset();
    return {false, w.status()};
  }
  if (options_.pipeline_write) {
    p.slot.release_after(w->completion());
    p.io = *w;
    p.where = Where::kWriting;
    p.writing_pending = pending;
    writing_.push_back(index);
    return {true, Status::Ok()};
  }
  const uint64_t t0 = now_ns();
  Status st = w->wait();  // pipeline_write off: each write-back ends before close returns
  io_.write_wait_ns += now_ns() - t0;
  p.slot.reset();
  if (st.ok()) {
    io_.bytes_written += p.bytes;
    ++io_.writes;
  }
  return {true, std::move(st)};
}

Status NvmeStateTier::pending_write_lost(const Piece& p, Status error) const {
  return std::move(error).with_context(
      fmt::format("{}: the write of its pending version (an early update) to NVMe failed", piece_name(p)));
}

void NvmeStateTier::wait_pending_write(Piece& p) {
  if (p.where != Where::kWriting || !p.writing_pending) return;
  const uint64_t t0 = now_ns();
  // Blocks (mu_ held) for this one write: keeping or redoing the early
  // update depends on whether it ended whole. harvest() takes the same
  // status later.
  Status st = p.io.wait();
  io_.write_wait_ns += now_ns() - t0;
  if (!st.ok() && p.pending_lost.ok()) p.pending_lost = pending_write_lost(p, std::move(st));
}

Status NvmeStateTier::pending_written(const StateId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  Publisher publisher{this};
  Piece& p = find(id, "pending_written");
  if (p.count == 0) return Status::Ok();
  wait_pending_write(p);
  if (!p.pending_lost.ok()) return p.pending_lost;
  if (p.pending == kNoVersion)
    return FailedPrecondition(fmt::format("{} has no pending version (close_pending was not called)", piece_name(p)));
  return Status::Ok();
}

Status NvmeStateTier::keep_pending(const StateId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  Publisher publisher{this};
  Piece& p = find(id, "keep_pending");
  if (p.count == 0) return Status::Ok();
  STRATA_CHECK(p.where != Where::kOpen, fmt::format("{}: keep_pending while it is open", piece_name(p)));
  wait_pending_write(p);
  if (!p.pending_lost.ok()) return p.pending_lost;
  if (p.pending == kNoVersion)
    return FailedPrecondition(fmt::format("{} has no pending version to keep", piece_name(p)));
  if (p.where == Where::kReading) drop_read(p);  // read-ahead of the version it replaces
  p.latest = p.pending;
  p.pending = kNoVersion;
  pump();
  return Status::Ok();
}

Status NvmeStateTier::drop_pending(const StateId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  Piece& p = find(id, "drop_pending");
  // A write of it still in flight ends on its own: the piece's next open()
  // waits for it before anything writes that version again.
  p.pending = kNoVersion;
  p.pending_lost = Status::Ok();
  return Status::Ok();
}

void NvmeStateTier::publish() {
  std::lock_guard<std::mutex> lock(published_mu_);
  published_ = io_;
  published_bytes_.store(state_bytes_, std::memory_order_relaxed);
}

StateTierIoStats NvmeStateTier::io_stats() const {
  StateTierIoStats s;
  {
    std::lock_guard<std::mutex> lock(published_mu_);
    s = published_;
  }
  s.peak_slots_in_use = std::max(s.peak_slots_in_use, pool_->stats().peak_in_use);
  return s;
}

}  // namespace

uint64_t nvme_piece_bytes(size_t count, bool has_master, const cpu_adam::MomentStorage& moments) {
  if (count == 0) return 0;
  return (has_master ? align_up(count * sizeof(float)) : 0) + 2 * align_up(moments.moment_bytes(count));
}

namespace {

Result<std::unique_ptr<OptimizerStateTier>> make_tier(const NvmeStateTierOptions& options, nvme::IoEngine* io,
                                                      Device& device, MemoryStats& stats) {
  auto tier = std::make_unique<NvmeStateTier>(options, io, device, stats);
  STRATA_RETURN_IF_ERROR(tier->init());
  return std::unique_ptr<OptimizerStateTier>(std::move(tier));
}

}  // namespace

Result<std::unique_ptr<OptimizerStateTier>> make_nvme_state_tier(const NvmeStateTierOptions& options, Device& device,
                                                                 MemoryStats& stats) {
  return make_tier(options, nullptr, device, stats);
}

Result<std::unique_ptr<OptimizerStateTier>> testing::make_nvme_state_tier_on(const NvmeStateTierOptions& options,
                                                                            nvme::IoEngine& io, Device& device,
                                                                            MemoryStats& stats) {
  return make_tier(options, &io, device, stats);
}

}  // namespace strata::offload
