// Engine checkpoints (engine.h: save_checkpoint, wait_checkpoint,
// load_checkpoint; the format in checkpoint.h).
//
// Note [Asynchronous save]
// save_checkpoint() queues one snapshot task per piece on the optimizer
// thread. That thread is FIFO: the tasks run after this step's updates and
// before the next step's, so each copies a piece's state as of this step
// while the driving thread already runs the next forward. A task copies the
// piece (master, exp_avg, exp_avg_sq as fp32) into one of snapshot_slots
// slots (each the size of the largest piece: host memory does not grow with
// the state or the number of saves) and hands it to the engine's writer
// thread, which writes it and frees the slot. Full slots make the optimizer
// thread wait: that wait, not the driving thread, is what a slow disk costs
// the next step (it shows as exposed optimizer time). Then the writer
// finishes the rank's part and rank 0 commits (Note [Checkpoint atomicity]).
//
// The driving thread may read the state while the snapshot does
// (gather_state(), evaluate() and step() reaching the commit point): the NVMe
// tier lends each piece to one thread at a time (Note [Piece leases] in
// state_tier.h). The step being saved is still pending (committed at the
// next commit point), so the commit point may roll it back while the
// snapshot reads; after each piece the snapshot checks that the tier was not
// rolled back and lost no write-back since the save began, else the save
// fails: a checkpoint never mixes two steps, nor holds the step before
// under this step's tag.
//
// Note [Snapshot slots and the host budget]
// The slots are pageable host memory of the engine, counted in its
// MemoryStats (kPageableHost) while they exist. strata.host_memory_budget
// bounds the pinned plan (checked at creation) and, at each save, the
// pinned plan plus snapshot_slots x EngineMemory::snapshot_slot_bytes (the
// plan's size of one slot): a save above it is refused on every rank before
// anything is allocated or written, naming the fix.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "checkpoint_io.h"

#include "strata/comm/host_collective.h"
#include "strata/core/bounded_file.h"
#include "strata/core/durable_file.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/checksum.h"
#include "strata/nvme/fs_probe.h"

namespace strata::offload::engine_detail {
namespace fs = std::filesystem;

namespace {

// A file this rank writes, with the running checksum of what was written (in order).
struct OutFile {
  std::string name;
  int fd = -1;
  uint64_t bytes = 0;
  bool direct = false;  // opened with O_DIRECT (else through the page cache)
  nvme::ChecksumStream sum;
  ~OutFile() {
    if (fd >= 0) ::close(fd);
  }
};

Status pwrite_all(int fd, const void* data, uint64_t bytes, uint64_t offset, const fs::path& path) {
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n =
        ::pwrite(fd, static_cast<const char*>(data) + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, fmt::format("write '{}' at offset {}", printable(path.string(), 256), offset + done));
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

// Writes one padded extent and adds it to the file's checksum (extents are
// written in file order). O_DIRECT when the file was opened so; a file
// system that refuses the direct write gets it through the page cache.
Status write_extent(OutFile& f, const std::byte* data, uint64_t bytes, uint64_t offset, const fs::path& folder) {
  const fs::path path = folder / f.name;
  Status st = pwrite_all(f.fd, data, bytes, offset, path);
  if (f.direct && nvme::direct_io_refused(st)) {  // EINVAL from the system call, not the message text
    const int flags = ::fcntl(f.fd, F_GETFL);
    if (flags >= 0 && ::fcntl(f.fd, F_SETFL, flags & ~O_DIRECT) == 0) {
      f.direct = false;
      st = pwrite_all(f.fd, data, bytes, offset, path);
    }
  }
  if (st.ok()) f.sum.update(data, bytes);
  return st;
}

}  // namespace

// Extents start 4 KiB-aligned in the files and are written whole from
// 4 KiB-aligned slots, zero-padded, so the writer can bypass the page cache
// (O_DIRECT: no copy into the cache, no write-back burst at fsync).
namespace {
constexpr uint64_t kExtentAlign = 4096;
uint64_t align_up(uint64_t n) { return (n + kExtentAlign - 1) / kExtentAlign * kExtentAlign; }

// Note [Snapshot slots and the host budget]: `count` slots of `slot_bytes`
// beside the engine's pinned plan, against this rank's share of
// strata.host_memory_budget (0: unlimited).
Status check_snapshot_budget(const EngineOptions& opt, const EngineMemory& plan, int rank, const std::string& tag,
                             size_t count, uint64_t slot_bytes) {
  const uint64_t budget = opt.host_memory_budget, slots = count * slot_bytes;
  if (budget == 0 || plan.pinned + slots <= budget) return Status::Ok();
  const uint64_t room = budget > plan.pinned ? budget - plan.pinned : 0;
  const uint64_t fit = slot_bytes == 0 ? 0 : std::min<uint64_t>(room / slot_bytes, 64);
  const std::string fewer =
      fit >= 1 ? fmt::format("lower --save-slots (CheckpointSaveOptions::snapshot_slots) to {}", fit)
               : "not even one slot fits (--save-slots, CheckpointSaveOptions::snapshot_slots, is at least 1)";
  return ResourceExhausted(fmt::format(
      "{}: checkpoint '{}' on rank {} needs {} snapshot slot(s) of {} ({} of pageable host memory; a slot holds this "
      "rank's largest piece as fp32 master and moments, 12 B per element) beside the engine's {} of pinned memory, "
      "above this rank's share of strata.host_memory_budget, {}; nothing was saved (the engine can go on training). "
      "Fix: {}, lower zero_optimization.sub_group_size (smaller pieces, smaller slots) or raise "
      "strata.host_memory_budget",
      opt.source, tag, rank, count, format_bytes(slot_bytes, true), format_bytes(slots, true),
      format_bytes(plan.pinned, true), format_bytes(budget, true), fewer));
}

// Note [Asynchronous save]: the pieces a snapshot read so far are the step
// being saved when the state was not rolled back since the save began
// (`rollbacks` then) and lost no write-back of that step.
Status check_still_current(const UpdateScheduler& updates, uint64_t rollbacks, const std::string& tag) {
  if (updates.state_rollbacks() != rollbacks)
    return Unavailable(fmt::format("checkpoint '{}': the step being saved was rolled back while its snapshot was "
                                   "taken (Note [Atomic steps]); not committed, the previous `latest` stands (the "
                                   "repeated step saves the tag again)",
                                   tag));
  return updates.state_committable().with_context(fmt::format(
      "checkpoint '{}': the step being saved lost a write-back and will be rolled back; not committed", tag));
}

// The save's own arguments: a valid tag, keep, slot count, commit timeout and folder.
Status check_save_request(const CheckpointSaveOptions& o, const std::string& tag) {
  STRATA_RETURN_IF_ERROR(check_checkpoint_tag(tag));
  if (o.keep < 0) return InvalidArgument(fmt::format("--keep {} must be >= 0 (0 keeps every tag)", o.keep));
  if (o.snapshot_slots < 1 || o.snapshot_slots > 64)
    return InvalidArgument(fmt::format("checkpoint snapshot_slots {} is not in 1..64", o.snapshot_slots));
  if (!(o.commit_timeout_s > 0) || !std::isfinite(o.commit_timeout_s))
    return InvalidArgument("checkpoint commit_timeout_s must be finite and > 0");
  if (o.dir.empty()) return InvalidArgument("the checkpoint folder (--save-dir) is empty");
  return Status::Ok();
}

// Rank 0's verdict on the save's folder and tag.
struct FolderVerdict {
  int64_t code = 0;  // 0 ok | 1 folder | 2 tag exists
  std::string why;
};

// Rank 0: the folder exists (created one level if missing) and is a real
// folder, the tag is new, and this process's own earlier attempt at the tag
// (`run_id`'s; it failed: a committed one would be `tag` itself) is removed,
// a real folder only, links never followed.
FolderVerdict check_save_folder(const fs::path& dir, const std::string& tag, const std::string& shown,
                                int64_t run_id) {
  FolderVerdict v;
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (fs::is_symlink(st)) {
    v = {1, fmt::format("checkpoint folder '{}' is a symbolic link; give the real folder", shown)};
  } else if (!fs::exists(st)) {
    if (!fs::create_directory(dir, ec) || ec)
      v = {1, fmt::format("cannot create checkpoint folder '{}': {} (its parent must exist)", shown, ec.message())};
  } else if (!fs::is_directory(st)) {
    v = {1, fmt::format("checkpoint folder '{}' is not a folder", shown)};
  }
  if (v.code == 0 && fs::exists(fs::symlink_status(dir / tag, ec)))
    v = {2, fmt::format("checkpoint tag '{}' already exists in '{}'; nothing was overwritten: give another tag or "
                        "folder",
                        tag, shown)};
  const fs::path own = dir / fmt::format(".tmp-{}-{}", tag, run_id);
  const fs::file_status own_st = fs::symlink_status(own, ec);
  if (v.code == 0 && fs::is_directory(own_st) && !fs::is_symlink(own_st)) {
    fs::remove_all(own, ec);
    if (ec)
      v = {1, fmt::format("cannot remove '{}', this run's failed earlier save of tag '{}': {}",
                          printable(own.string(), 256), tag, ec.message())};
  }
  return v;
}

// Creates this rank's `kind` file in `folder`: O_DIRECT where the file system allows it.
Status create_rank_file(OutFile& f, const fs::path& folder, int rank, const char* kind) {
  f.name = fmt::format("rank{:05d}.{}", rank, kind);
  const fs::path p = folder / f.name;
  f.fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | O_DIRECT, 0644);
  f.direct = f.fd >= 0;
  if (f.fd < 0 && errno == EINVAL)  // a file system without O_DIRECT (tmpfs): through the page cache
    f.fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (f.fd < 0) return ErrnoStatus(errno, fmt::format("create checkpoint file '{}'", printable(p.string(), 256)));
  return Status::Ok();
}

// What a rank's part of the save needs on disk, for its errors.
std::string describe_save_size(const std::string& tag, int rank, uint64_t model_bytes, uint64_t optim_bytes) {
  return fmt::format("checkpoint '{}' needs {} on rank {} ({} of fp32 master weights, {} of optimizer state)", tag,
                     format_bytes(model_bytes + optim_bytes, true), rank, format_bytes(model_bytes, true),
                     format_bytes(optim_bytes, true));
}

// The file system of `folder` has room for `bytes` (when it can tell).
Status check_room(const fs::path& folder, uint64_t bytes, const std::string& needs, const std::string& shown) {
  if (Result<uint64_t> room = nvme::available_bytes(folder.string()); room.ok() && *room < bytes)
    return ResourceExhausted(fmt::format(
        "{}; the file system of '{}' has {} free: nothing was written (the previous `latest` stands); free space, "
        "save to another folder, or keep fewer tags (keep)",
        needs, shown, format_bytes(*room, true)));
  return Status::Ok();
}
}  // namespace

// Slots of fp32 [master | pad | exp_avg exp_avg_sq | pad] for the largest
// piece, allocated at the first save and kept; counted as pageable host
// memory in the engine's stats from allocation to destruction (Note
// [Snapshot slots and the host budget]).
struct CheckpointIO::SnapshotSlots {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<nvme::AlignedBuffer> slots;
  uint64_t slot_bytes = 0;
  std::vector<size_t> free;
  MemoryStats* stats = nullptr;
  uint64_t counted = 0;  // bytes on stats' kPageableHost
  static Result<std::shared_ptr<SnapshotSlots>> allocate(size_t count, uint64_t bytes, MemoryStats& stats) {
    auto fresh = std::make_shared<SnapshotSlots>();
    fresh->stats = &stats;
    fresh->slot_bytes = bytes;
    for (size_t k = 0; k < count; ++k) {
      Result<nvme::AlignedBuffer> b = nvme::AlignedBuffer::allocate(bytes, kExtentAlign);
      if (!b.ok())
        return b.status().with_context(fmt::format("allocating checkpoint snapshot slot {} of {} ({})", k + 1, count,
                                                   format_bytes(bytes, true)));
      fresh->slots.push_back(std::move(b).value());
      fresh->free.push_back(k);
      stats.on_allocate(Tier::kPageableHost, bytes);
      fresh->counted += bytes;
    }
    return fresh;
  }
  ~SnapshotSlots() {
    if (stats != nullptr && counted != 0) stats->on_free(Tier::kPageableHost, counted);
  }
  Result<size_t> acquire(double timeout_s) {
    std::unique_lock<std::mutex> lock(mu);
    // Blocks the optimizer thread by design: this is the bound on host
    // memory; the writer frees a slot as each piece reaches the disk.
    // Bounded (strata.wait_timeout_s): a writer stuck in a hung write ends
    // the save with an error instead of holding the optimizer thread.
    if (!cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return !free.empty(); }))
      return DeadlineExceeded(fmt::format(
          "waited {:.3g} s for a checkpoint snapshot slot: all {} are held by the checkpoint writer, whose writes "
          "did not finish (a hung disk?); raise strata.wait_timeout_s if the disk is only slow",
          timeout_s, slots.size()));
    const size_t s = free.back();
    free.pop_back();
    return s;
  }
  void release(size_t s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      free.push_back(s);
    }
    cv.notify_all();
  }
};

// One piece of this rank's state in a save: its layer, group and element count.
struct CheckpointIO::SnapshotPiece {
  size_t li, gi;
  size_t count;
};

struct CheckpointIO::SaveState {
  std::string tag;
  fs::path dir, tmp;
  int rank = 0, world = 1;
  OutFile model, optim;
  std::vector<CheckpointExtent> extents;  // file 0: model, 1: optim (this rank's numbering)
  CheckpointManifest manifest;            // rank 0: everything but files and extents
  int keep = 0;
  double commit_timeout_s = 600;
  std::optional<testing::CheckpointCrash> crash;  // the engine's faults.checkpoint_crash
  Clock::time_point t0;
  std::mutex mu;
  Status error;  // the first failure of a snapshot or write task
  // Set by the engine's destructor: rank 0 stops waiting for its peers (a
  // peer that failed may never report); its own files are still written.
  std::atomic<bool> abandon{false};
  SerialWorker* writer = nullptr;  // the engine's checkpoint writer (one thread for every save)
  CompletionSource done{"checkpoint save"};
  Completion done_c = done.completion();
  CompletionSource snapped{"checkpoint snapshot"};
  Completion snapped_c = snapped.completion();
  double seconds = 0;
  uint64_t rollbacks = 0;  // the optimizer state tier's rollbacks() when the save began

  void fail(const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.ok()) error = s;
  }
  Status first_error() {
    std::lock_guard<std::mutex> lock(mu);
    return error;
  }
};

// ---------------------------------------------------------------- save

Result<std::optional<CheckpointSaveDone>> CheckpointIO::wait_save() {
  if (!pending_save_) return std::optional<CheckpointSaveDone>();
  std::shared_ptr<SaveState> s = std::move(pending_save_);
  pending_save_.reset();
  // The caller asked for the save's end (next save, --save-sync, end of training).
  STRATA_RETURN_IF_ERROR(ctx_.wait_bounded(s->done_c, fmt::format("checkpoint '{}' being written", s->tag)));
  const Status st = s->done_c.status();
  if (!st.ok()) return st.with_context(fmt::format("checkpoint '{}' in '{}'", s->tag, printable(s->dir.string(), 256)));
  CheckpointSaveDone d;
  d.tag = s->tag;
  d.committed = true;
  d.seconds = s->seconds;
  d.bytes = s->model.bytes + s->optim.bytes;
  return std::optional<CheckpointSaveDone>(d);
}

void CheckpointIO::abandon_save() {
  if (pending_save_) pending_save_->abandon.store(true);
}

// The writer's last task: durable files, this rank's report, rank 0's commit.
Status CheckpointIO::finish_save(SaveState& s) {
  STRATA_RETURN_IF_ERROR(s.first_error());
  for (OutFile* f : {&s.model, &s.optim}) {
    if (::fsync(f->fd) != 0)
      return ErrnoStatus(errno, fmt::format("fsync '{}'", printable((s.tmp / f->name).string(), 256)));
    ::close(f->fd);
    f->fd = -1;
  }
  nlohmann::json report;
  report["rank"] = s.rank;
  // Files and extents in the manifest's own form (file indices local to this rank).
  report["files"] = nlohmann::json::array();
  for (const OutFile* f : {&s.model, &s.optim})
    report["files"].push_back({{"name", f->name},
                               {"rank", s.rank},
                               {"kind", f == &s.model ? "model" : "optim"},
                               {"bytes", f->bytes},
                               {"xxh3", hex64(f->sum.digest())}});
  report["extents"] = nlohmann::json::array();
  for (const CheckpointExtent& e : s.extents)
    report["extents"].push_back({e.file, e.layer, e.begin, e.count, e.offset, hex64(e.xxh3)});
  STRATA_RETURN_IF_ERROR(write_file_atomically(s.tmp, fmt::format("rank{:05d}.json", s.rank), report.dump()));
  if (s.rank != 0) return Status::Ok();
  FaultHooks::checkpoint_point_reached(s.crash, "after-rank-files", s.tag);

  // Rank 0: every rank's report (or its failure) appended to the manifest,
  // which from_json then checks as a loader would: what is committed reads back.
  nlohmann::json mj = s.manifest.to_json();
  const auto deadline = Clock::now() + std::chrono::duration<double>(s.commit_timeout_s);
  for (int r = 0; r < s.world; ++r) {
    const fs::path rep = s.tmp / fmt::format("rank{:05d}.json", r);
    const fs::path failed = s.tmp / fmt::format("rank{:05d}.failed", r);
    std::error_code ec;
    while (!fs::exists(rep, ec)) {
      if (fs::exists(failed, ec)) {
        Result<std::string> why = read_regular_file(failed.string(), 64 << 10, {.what = "failure report", .flag = "", .hint = ""});
        return IoError(fmt::format("rank {} could not write its part: {}", r,
                                   why.ok() ? printable(*why, 2048) : std::string("(unreadable report)")));
      }
      if (s.abandon.load())
        return Unavailable(fmt::format("the engine was destroyed before rank {} reported its files; the checkpoint was "
                                       "not committed (the previous `latest` stands; call wait_checkpoint() before "
                                       "destroying the engine)",
                                       r));
      if (Clock::now() > deadline)
        return DeadlineExceeded(fmt::format("rank {} did not report its files in {:g} s; the checkpoint was not "
                                            "committed (the previous `latest` stands)",
                                            r, s.commit_timeout_s));
      // Peers write their reports on their own writer threads (or processes):
      // polling the folder needs no collective from this background thread.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    STRATA_ASSIGN_OR_RETURN(std::string text, read_regular_file(rep.string(), kMaxManifestBytes, {.what = "rank report", .flag = "", .hint = ""}));
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.contains("files") || !j["files"].is_array() || j["files"].size() != 2 ||
        !j.contains("extents") || !j["extents"].is_array())
      return DataLoss(fmt::format("rank report '{}' is damaged", printable(rep.string(), 256)));
    const uint64_t base = mj["files"].size();
    for (nlohmann::json& f : j["files"]) mj["files"].push_back(std::move(f));
    for (nlohmann::json& e : j["extents"]) {
      if (!e.is_array() || e.empty() || !e[0].is_number_unsigned())
        return DataLoss(fmt::format("rank report '{}' is damaged", printable(rep.string(), 256)));
      e[0] = base + e[0].get<uint64_t>();
      mj["extents"].push_back(std::move(e));
    }
  }
  STRATA_RETURN_IF_ERROR(CheckpointManifest::from_json(mj, (s.tmp / "manifest.json").string()).status());
  FaultHooks::checkpoint_point_reached(s.crash, "before-manifest", s.tag);
  STRATA_RETURN_IF_ERROR(write_file_atomically(s.tmp, "manifest.json", mj.dump(1)));
  FaultHooks::checkpoint_point_reached(s.crash, "before-rename", s.tag);
  const fs::path final_dir = s.dir / s.tag;
  if (::rename(s.tmp.c_str(), final_dir.c_str()) != 0)
    return ErrnoStatus(errno, fmt::format("rename '{}' to '{}' (does the tag exist already?)",
                                          printable(s.tmp.string(), 256), printable(final_dir.string(), 256)));
  STRATA_RETURN_IF_ERROR(fsync_folder(s.dir));
  FaultHooks::checkpoint_point_reached(s.crash, "before-latest", s.tag);
  STRATA_RETURN_IF_ERROR(write_file_atomically(s.dir, "latest", s.tag + "\n"));
  FaultHooks::checkpoint_point_reached(s.crash, "after-latest", s.tag);
  if (s.keep > 0) STRATA_RETURN_IF_ERROR(prune_checkpoints(s.dir, s.keep, s.tag));
  return Status::Ok();
}

// Keeps the newest `keep` complete tags of `dir` (by their manifests' step
// count), never `current`; removes only real folders directly inside `dir`
// that hold a manifest of this format.
Status CheckpointIO::prune_checkpoints(const fs::path& dir, int keep, const std::string& current) {
  std::vector<std::pair<int64_t, std::string>> tags;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const fs::file_status st = e.symlink_status(ec);
    if (ec || !fs::is_directory(st)) continue;  // links and files are never touched
    const std::string name = e.path().filename().string();
    if (name.empty() || name.front() == '.' || !check_checkpoint_tag(name).ok()) continue;
    Result<CheckpointReader> r = CheckpointReader::open(e.path());
    if (!r.ok()) continue;  // not a complete checkpoint of ours: leave it
    tags.push_back({r->manifest().scalars.steps_begun, name});
  }
  std::sort(tags.begin(), tags.end(), std::greater<>());
  int kept = 0;
  for (const auto& [step, name] : tags) {
    if (name == current || kept < keep) {
      ++kept;
      continue;
    }
    fs::remove_all(dir / name, ec);  // remove_all never follows links inside
    if (ec)
      return ErrnoStatus(ec.value(), fmt::format("remove old checkpoint '{}' (--keep {})",
                                                 printable((dir / name).string(), 256), keep));
  }
  return Status::Ok();
}

// A piece's snapshot waits for its layer's last update and for everything
// that writes the layer's parameters after it (the stage 1-2 all-gather
// rewrites this rank's own piece in place too).
Completion CheckpointIO::snapshot_gate(size_t li) {
  // update_written fails when the update did: a failed step is never saved.
  const Completion both[] = {updates_.layer(li).update_written, params_.ready(li)};
  return when_all(both, fmt::format("layer {} updated", li));
}

CheckpointIO::~CheckpointIO() = default;

Result<CheckpointSaveInfo> CheckpointIO::save(const CheckpointSaveOptions& o, const CheckpointScalarsNow& now,
                                              const EngineMemory& predicted) {
  const auto t0 = Clock::now();
  // One save at a time: the previous one must have finished (its error is this call's).
  STRATA_RETURN_IF_ERROR(wait_save().status());
  const std::string tag = o.tag.empty() ? default_checkpoint_tag(now.steps_begun) : o.tag;
  STRATA_RETURN_IF_ERROR(check_save_request(o, tag));
  const std::string shown = printable(o.dir, 256);
  const size_t nslots = static_cast<size_t>(o.snapshot_slots);
  const uint64_t slot_bytes = predicted.snapshot_slot_bytes;
  STRATA_RETURN_IF_ERROR(agree_snapshot_budget(predicted, tag, nslots, slot_bytes));
  STRATA_ASSIGN_OR_RETURN(const int64_t run_id, agree_save_folder(o.dir, tag, shown));
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<SaveState> s, open_save(o, tag, run_id, t0));
  s->manifest = save_manifest(o, tag, now);
  const std::vector<SnapshotPiece> pieces = lay_out_pieces(*s, slot_bytes);
  const std::string needs = describe_save_size(tag, rank, s->model.bytes, s->optim.bytes);
  // A file system without room for this rank's files fails the save before a byte is written (the save's
  // error, so every rank and wait_checkpoint() learn of it as of a failed write), saying how much it needs.
  if (const Status room = check_room(s->tmp, s->model.bytes + s->optim.bytes, needs, shown); !room.ok())
    s->fail(room);
  STRATA_RETURN_IF_ERROR(prepare_snapshot_slots(nslots, slot_bytes));
  s->writer = writer_.get();
  queue_snapshots(s, pieces, needs);
  queue_save_end(s);
  CheckpointSaveInfo info;
  info.tag = tag;
  info.bytes = s->model.bytes + s->optim.bytes;
  pending_save_ = s;
  // ratio < 1: the device part is stepped by a second thread, outside the
  // FIFO above; the next step must not start before the snapshot is taken.
  if (ctx_.split()) {
    STRATA_RETURN_IF_ERROR(ctx_.wait_bounded(s->snapped_c, fmt::format("the snapshot of checkpoint '{}'", tag)));
    STRATA_RETURN_IF_ERROR(s->snapped_c.status());
  }
  if (o.sync) {
    Result<std::optional<CheckpointSaveDone>> d = wait_save();
    if (!d.ok()) return d.status();
  }
  info.blocked_ms = ms_since(t0);
  return info;
}

// Every rank's previous save is over (each waited for its own), so rank 0
// may remove this run's own unfinished attempt at the same tag (a step rolled
// back and saved again, Note [Atomic steps]). The same collective counts the
// ranks whose snapshot slots do not fit the host budget: then every rank
// refuses, before anything is written.
Status CheckpointIO::agree_snapshot_budget(const EngineMemory& predicted, const std::string& tag, size_t nslots,
                                           uint64_t slot_bytes) {
  const Status fits = check_snapshot_budget(opt, predicted, rank, tag, nslots, slot_bytes);
  const double refused = fits.ok() ? 0 : 1;
  double all = 0;
  STRATA_RETURN_IF_ERROR(comm::host_collective(
      comm, &refused, sizeof(double), &all, sizeof(double),
      [&](const void* s, void* r) {
        return comm.all_reduce(s, r, 1, DType::kF64, comm::ReduceOp::kSum, comm::CommQueue::kReduce);
      },
      "starting the checkpoint save"));
  if (!fits.ok()) return fits;
  if (all != 0)
    return ResourceExhausted(fmt::format(
        "checkpoint '{}': the snapshot slots of {} other rank(s) do not fit strata.host_memory_budget (see their "
        "errors); nothing was saved (the engine can go on training)",
        tag, static_cast<int64_t>(all)));
  return Status::Ok();
}

// Rank 0 checks the folder and the tag and picks the save's temporary name
// (its run id); every rank learns the verdict, so all fail or none.
Result<int64_t> CheckpointIO::agree_save_folder(const fs::path& dir, const std::string& tag,
                                                const std::string& shown) {
  const int64_t own_run_id = static_cast<int64_t>(::getpid());
  const FolderVerdict v = rank == 0 ? check_save_folder(dir, tag, shown, own_run_id) : FolderVerdict{};
  const int64_t verdict[2] = {v.code, own_run_id};
  int64_t agreed[2] = {0, 0};
  STRATA_RETURN_IF_ERROR(comm::host_collective(
      comm, verdict, sizeof(verdict), agreed, sizeof(agreed),
      [&](const void* s, void* r) { return comm.broadcast(s, r, 2, DType::kI64, 0, comm::CommQueue::kReduce); },
      "agreeing on the checkpoint folder"));
  if (agreed[0] != 0) {
    if (rank == 0) return (agreed[0] == 2 ? AlreadyExists(v.why) : InvalidArgument(v.why));
    return FailedPrecondition(fmt::format("rank 0 refused checkpoint tag '{}' in '{}' (see rank 0's error)", tag, shown));
  }
  return agreed[1];
}

// The save's state, its temporary folder (every rank) and this rank's two files, open.
Result<std::shared_ptr<CheckpointIO::SaveState>> CheckpointIO::open_save(const CheckpointSaveOptions& o,
                                                                         const std::string& tag, int64_t run_id,
                                                                         Clock::time_point t0) {
  auto s = std::make_shared<SaveState>();
  s->tag = tag;
  s->dir = o.dir;
  s->tmp = s->dir / fmt::format(".tmp-{}-{}", tag, run_id);
  s->rank = rank;
  s->world = world;
  s->keep = o.keep;
  s->commit_timeout_s = o.commit_timeout_s;
  s->crash = faults.checkpoint_crash();
  s->t0 = t0;
  s->rollbacks = updates_.state_rollbacks();
  {
    std::error_code ec;
    fs::create_directory(s->tmp, ec);  // every rank; EEXIST from another rank is fine
    const fs::file_status st = fs::symlink_status(s->tmp, ec);
    if (!fs::is_directory(st) || fs::is_symlink(st))
      return IoError(fmt::format("cannot create the save's folder '{}'", printable(s->tmp.string(), 256)));
  }
  STRATA_RETURN_IF_ERROR(create_rank_file(s->model, s->tmp, rank, "model"));
  STRATA_RETURN_IF_ERROR(create_rank_file(s->optim, s->tmp, rank, "optim"));
  return s;
}

// The manifest's scalars, as of this step (rank 0 writes them).
CheckpointManifest CheckpointIO::save_manifest(const CheckpointSaveOptions& o, const std::string& tag,
                                               const CheckpointScalarsNow& now) const {
  CheckpointManifest m;
  m.tag = tag;
  m.world_size = world;
  m.stage = opt.stage;
  m.offload_optimizer = offload_device_name(opt.offload_optimizer);
  m.offload_param = offload_device_name(opt.offload_param);
  m.moment_dtype = std::string(opt.moments.name());
  m.optimizer = cpu_adam::optimizer_kind_name(opt.optimizer);
  m.sub_group_size = opt.sub_group_size;
  m.scalars.optimizer_steps = now.optimizer_steps;
  m.scalars.steps_begun = now.steps_begun;
  m.scalars.data_position = now.data_position;
  const LossScalerState& ls = now.scaler;
  m.scalars.loss_scale = ls.scale;
  m.scalars.scaler_iteration = ls.iteration;
  m.scalars.scaler_last_overflow = ls.last_overflow_iteration;
  m.scalars.scaler_hysteresis_left = ls.hysteresis_left;
  m.scalars.scaler_overflow_count = ls.overflow_count;
  for (size_t li = 0; li < part.layer_count(); ++li)
    m.layers.push_back({model.layers()[li].name, part.layer(li).elements,
                        std::string(dtype_name(ctx_.where(li).param_dtype)), ctx_.where(li).frozen});
  m.app = o.app;
  return m;
}

// This rank's pieces, in order, and where each goes in its files (the
// save's extents and file sizes).
std::vector<CheckpointIO::SnapshotPiece> CheckpointIO::lay_out_pieces(SaveState& s, uint64_t slot_bytes) const {
  std::vector<SnapshotPiece> pieces;
  size_t largest = 0;
  for (size_t li = 0; li < part.layer_count(); ++li) {
    if (ctx_.where(li).frozen) continue;  // not stored (Note [Frozen layers in checkpoints])
    const LayerPartition& layer_part = part.layer(li);
    for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
      const size_t n = layer_part.piece_real(layer_part.groups[gi], rank);
      if (n == 0) continue;
      pieces.push_back({li, gi, n});
      largest = std::max(largest, n);
      CheckpointExtent me{0, li, layer_part.piece_begin(layer_part.groups[gi], rank), n, s.model.bytes, 0};
      CheckpointExtent oe{1, li, me.begin, n, s.optim.bytes, 0};
      s.model.bytes += align_up(4 * n);
      s.optim.bytes += align_up(8 * n);
      s.extents.push_back(me);
      s.extents.push_back(oe);
    }
  }
  STRATA_CHECK(slot_bytes == align_up(4 * largest) + align_up(8 * largest),
               "the plan's snapshot slot holds exactly this rank's largest piece");
  return pieces;
}

// The snapshot slots for `nslots` and the writer thread, kept between saves.
Status CheckpointIO::prepare_snapshot_slots(size_t nslots, uint64_t slot_bytes) {
  if (!snapshot_slots_ || snapshot_slots_->slots.size() != nslots) {
    // The previous save is over: nothing uses the old slots; they go first,
    // so the host memory never holds both.
    snapshot_slots_.reset();
    STRATA_ASSIGN_OR_RETURN(snapshot_slots_, SnapshotSlots::allocate(nslots, slot_bytes, stats));
  }
  // Its tasks never fail (a save's errors are the save's), so one thread serves every save.
  if (!writer_) writer_ = std::make_unique<SerialWorker>(fmt::format("checkpoint writer of rank {}", rank));
  return Status::Ok();
}

// The snapshot tasks (Note [Asynchronous save]); none fails the optimizer
// thread: a failure is the save's, recorded and reported by wait_save().
void CheckpointIO::queue_snapshots(const std::shared_ptr<SaveState>& s, const std::vector<SnapshotPiece>& pieces,
                                   const std::string& needs) {
  std::shared_ptr<SnapshotSlots> slots = snapshot_slots_;
  size_t extent = 0;
  for (const SnapshotPiece& p : pieces) {
    const size_t e = extent;
    extent += 2;
    const Completion snapped = updates_.queue_on_optimizer_thread(
        [this, s, slots, p, e, needs]() -> Status {
          snapshot_piece(s, slots, p, e, needs);
          return Status::Ok();
        },
        snapshot_gate(p.li), fmt::format("checkpoint snapshot of {}", ctx_.state_name(p.li, p.gi, rank)),
        /*sticky=*/false);
    // A failed update (the gate) is the save's failure, not the optimizer
    // thread's: the step is rolled back and training goes on.
    snapped.then([s](const Status& st) {
      if (!st.ok()) s->fail(st.with_context("the step being saved did not complete"));
    });
  }
}

// On the optimizer thread: piece `p`'s state into a slot, zero-padded, handed
// to the writer (its extents are `e` and `e + 1`).
void CheckpointIO::snapshot_piece(const std::shared_ptr<SaveState>& s, const std::shared_ptr<SnapshotSlots>& slots,
                                  const SnapshotPiece& p, size_t e, const std::string& needs) {
  if (!s->first_error().ok()) return;
  Result<size_t> slot = slots->acquire(opt.wait_timeout_s);
  if (!slot.ok()) {
    s->fail(slot.status().with_context(fmt::format("taking the snapshot of {}", ctx_.state_name(p.li, p.gi, rank))));
    return;
  }
  const size_t k = *slot;
  std::byte* base = slots->slots[k].data();
  float* master = reinterpret_cast<float*>(base);
  float* moments = reinterpret_cast<float*>(base + align_up(4 * p.count));
  Status st = updates_.read_piece_state(p.li, p.gi, rank, master, moments, moments + p.count);
  if (st.ok()) st = check_still_current(updates_, s->rollbacks, s->tag);
  if (!st.ok()) {
    slots->release(k);
    s->fail(st.with_context(fmt::format("taking the snapshot of {}", ctx_.state_name(p.li, p.gi, rank))));
    return;
  }
  // Zero padding: the files' bytes (and checksums) are deterministic.
  std::memset(base + 4 * p.count, 0, align_up(4 * p.count) - 4 * p.count);
  std::memset(base + align_up(4 * p.count) + 8 * p.count, 0, align_up(8 * p.count) - 8 * p.count);
  s->writer->submit([s, slots, p, e, k, needs]() -> Status {
    write_snapshot(*s, *slots, p, e, k, needs);
    return Status::Ok();
  });
}

// On the writer thread: slot `k` (piece `p`) checksummed and written at its
// extents, the slot freed; a failure is the save's.
void CheckpointIO::write_snapshot(SaveState& s, SnapshotSlots& slots, const SnapshotPiece& p, size_t e, size_t k,
                                  const std::string& needs) {
  const std::byte* b = slots.slots[k].data();
  const std::byte* mv = b + align_up(4 * p.count);
  Status w = Status::Ok();
  if (s.first_error().ok()) {
    CheckpointExtent& me = s.extents[e];
    CheckpointExtent& oe = s.extents[e + 1];
    me.xxh3 = nvme::checksum64(b, 4 * p.count);
    oe.xxh3 = nvme::checksum64(mv, 8 * p.count);
    w = write_extent(s.model, b, align_up(4 * p.count), me.offset, s.tmp);
    if (w.ok()) w = write_extent(s.optim, mv, align_up(8 * p.count), oe.offset, s.tmp);
  }
  slots.release(k);
  if (!w.ok() && (w.system_errno() == ENOSPC || w.system_errno() == EDQUOT))
    w = Status(w.code(), fmt::format("{}; {} in all", w.message(), needs), w.system_errno());
  if (!w.ok()) s.fail(w);
}

// After the last snapshot (whatever the optimizer thread's state), the
// writer finishes: it runs after every piece's write, which was queued first.
void CheckpointIO::queue_save_end(const std::shared_ptr<SaveState>& s) {
  Completion last =
      updates_.queue_on_optimizer_thread([] { return Status::Ok(); }, {}, "checkpoint snapshot end", /*sticky=*/true);
  last.then([this, s](const Status& st) {
    if (!st.ok()) s->fail(st.with_context("the optimizer thread failed before the snapshot was taken"));
    s->snapped.complete(s->first_error());
    s->writer->submit([this, s]() -> Status {
      end_save(*s);
      return Status::Ok();
    });
  });
}

// The writer's last task for a save: finish it, or record its failure (and
// tell rank 0 through this rank's failure file), then complete it.
void CheckpointIO::end_save(SaveState& s) {
  Status f = finish_save(s);
  if (!f.ok()) {
    s.fail(f);
    // Rank 0 learns of it from this file instead of waiting out its timeout.
    if (s.rank != 0) write_file_atomically(s.tmp, fmt::format("rank{:05d}.failed", s.rank), f.to_string()).ignore();
  }
  s.seconds = std::chrono::duration<double>(Clock::now() - s.t0).count();
  s.done.complete(s.first_error());
}

// ---------------------------------------------------------------- load

Result<CheckpointReader> CheckpointIO::open_for_load(const std::string& given) const {
  STRATA_ASSIGN_OR_RETURN(CheckpointReader reader, CheckpointReader::open(given));
  const CheckpointManifest& m = reader.manifest();
  const std::string src = printable(reader.folder().string(), 256);
  if (m.layers.size() != part.layer_count())
    return FailedPrecondition(fmt::format("checkpoint '{}' holds a model of {} layers, this model has {}: it was saved "
                                          "from another model shape",
                                          src, m.layers.size(), part.layer_count()));
  for (size_t li = 0; li < part.layer_count(); ++li) {
    const std::string& name = model.layers()[li].name;
    if (m.layers[li].name != name || m.layers[li].elements != part.layer(li).elements)
      return FailedPrecondition(fmt::format(
          "checkpoint '{}' layer {} is '{}' with {} elements, this model's is '{}' with {}: it was saved from another "
          "model shape (check --preset/--layers/--embd/--heads/--vocab/--seq)",
          src, li, printable(m.layers[li].name, 64), m.layers[li].elements, printable(name, 64),
          part.layer(li).elements));
    // Note [Frozen layers in checkpoints]
    if (m.layers[li].frozen != ctx_.where(li).frozen)
      return FailedPrecondition(fmt::format(
          "checkpoint '{}' layer {} ('{}') is {} there and {} in this model: {}", src, li, printable(name, 64),
          m.layers[li].frozen ? "frozen" : "trained", ctx_.where(li).frozen ? "frozen" : "trained",
          m.layers[li].frozen ? "the checkpoint has no values for it (it stores no frozen layer); freeze it here too, "
                                "or start its training from the model's values with a fresh run"
                              : "loading would drop its trained values; train it here too (requires_grad / trainable)"));
  }
  if (m.optimizer != cpu_adam::optimizer_kind_name(opt.optimizer))
    return FailedPrecondition(fmt::format("checkpoint '{}' was saved with optimizer {}, this run uses {}: its moments "
                                          "do not apply",
                                          src, m.optimizer, cpu_adam::optimizer_kind_name(opt.optimizer)));
  return reader;
}

Status CheckpointIO::load_state(CheckpointReader& reader) {
  for (size_t li = 0; li < part.layer_count(); ++li) {
    if (ctx_.where(li).frozen) continue;  // the model's own values stay (Note [Frozen layers in checkpoints])
    const LayerPartition& layer_part = part.layer(li);
    const LayerPlacement& layer_where = ctx_.where(li);
    const bool persistent = layer_where.persistent();
    // The master values this rank needs, read once: the whole layer when its
    // parameters are kept whole (persistent), else this rank's shard (the
    // shard layout, padding zero). Both the parameters and the owned
    // pieces' state come from it.
    std::vector<float> master(persistent ? layer_part.padded_elements : layer_part.shard_elements, 0.0f);
    if (persistent) {
      STRATA_RETURN_IF_ERROR(reader.read(li, CheckpointState::kMaster, 0, std::span<float>(master.data(), layer_part.elements)));
    } else {
      for (const SubGroup& g : layer_part.groups) {
        const size_t n = layer_part.piece_real(g, rank);
        if (n == 0) continue;  // all padding (its begin may lie past the layer's end)
        STRATA_RETURN_IF_ERROR(reader.read(li, CheckpointState::kMaster, layer_part.piece_begin(g, rank),
                                           std::span<float>(master.data() + g.shard_offset, n)));
      }
    }
    std::vector<std::byte> values(master.size() * layer_where.param_element_bytes);
    master_to_params(layer_where.param_dtype, master.data(), values.data(), master.size());
    if (persistent) {
      STRATA_RETURN_IF_ERROR(params_.write_whole(li, values));
    } else {
      STRATA_RETURN_IF_ERROR(params_.replace_shard(li, values));  // a fresh engine: off the step path
    }
    // The optimizer state of every owned piece (a partitioned layer's owned
    // pieces are this rank's: stage 3).
    std::vector<float> moments;
    for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
      const SubGroup& g = layer_part.groups[gi];
      for (int r = ctx_.owned_rank_begin(); r < ctx_.owned_rank_end(); ++r) {
        const size_t n = layer_part.piece_real(g, r);
        if (n == 0) continue;
        STRATA_CHECK(persistent || r == rank, "a partitioned layer's owned pieces are this rank's");
        const uint64_t b = layer_part.piece_begin(g, r);
        const float* m = master.data() + (persistent ? b : g.shard_offset);
        moments.resize(2 * n);
        STRATA_RETURN_IF_ERROR(reader.read(li, CheckpointState::kExpAvg, b, std::span<float>(moments.data(), n)));
        STRATA_RETURN_IF_ERROR(reader.read(li, CheckpointState::kExpAvgSq, b, std::span<float>(moments.data() + n, n)));
        STRATA_RETURN_IF_ERROR(updates_.write_piece_state(li, gi, r, m, moments.data(), moments.data() + n)
                                   .with_context(fmt::format("loading {}", ctx_.state_name(li, gi, r))));
      }
    }
  }
  // The loaded state is the committed one (Note [Piece versions]).
  return updates_.commit_state().with_context("writing the loaded optimizer state");
}

}  // namespace strata::offload::engine_detail
