// SwapStore operations: reads, shadow writes, block verification, flips.
// See Note [Swap completion rules] in swap_store.h.
//
// Note [Swap operation lifecycle]
// read   start_read checks the range, registers it as in flight (under mu_),
//        snapshots the tensor's runs and the stored block checksums, and
//        submits one engine request per chunk (chunk_ bytes, a multiple of
//        the checksum block). Each chunk's engine callback posts a verify
//        task to the verify pool (or arrives at once when verification is
//        off or the I/O failed); hashing never runs on an engine worker or on
//        the thread that waits. The last arrival finishes the operation.
// write  start_write allocates a fresh (shadow) extent for the range,
//        registers it, submits one engine request per chunk and posts one
//        hashing task per chunk of the caller's bytes. A chunk whose write
//        and hash have both arrived is, with verify_writes, read back into a
//        scratch buffer (at most kReadBackDepth per write, so the read-back
//        of chunk k overlaps the writes of the chunks after it) and compared
//        on the verify pool; without verify_writes it is done at once. When
//        every chunk is done, finish() flips the index to the shadow extent
//        (ok) or frees it (an I/O error or a mismatch, first by position).
// finish updates the tensor's entry under mu_ (flip: the replaced data goes
//        back to the allocator at once), drops pending_ops_, and completes
//        the operation's Completion with no store lock held.
#include <algorithm>
#include <chrono>
#include <limits>

#include <fmt/format.h>

#include "strata/core/units.h"
#include "strata/nvme/checksum.h"
#include "strata/nvme/swap_store.h"
#include "swap_op.h"
#include "verify_pool.h"

namespace strata::nvme {
namespace {

constexpr uint64_t kRecordHeaderBytes = 5 * sizeof(uint64_t);  // id, bytes, flags, runs, blocks
constexpr uint64_t kRunBytes = 3 * sizeof(uint64_t);
constexpr uint64_t kWholeRange = std::numeric_limits<uint64_t>::max() / 2;
constexpr size_t kScratchKept = 4;    // read-back buffers kept between writes
constexpr size_t kReadBackDepth = 2;  // read-back buffers per write

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

bool overlaps(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen) { return a < b + blen && b < a + alen; }

uint64_t blocks_for(uint64_t bytes, uint64_t block) { return (bytes + block - 1) / block; }

}  // namespace

Completion SwapHandle::completion() const {
  STRATA_CHECK(state_ != nullptr, "SwapHandle::completion on an empty handle");
  return state_->completion;
}

uint64_t SwapStore::record_bytes(const Entry& e) const {
  return kRecordHeaderBytes + kRunBytes * e.runs.size() + sizeof(uint64_t) * e.sums.size();
}

// ---------------------------------------------------------------------------
// Public entry points

Result<SwapHandle> SwapStore::write(TensorId id, const void* data, uint64_t bytes) {
  if (bytes == 0 || data == nullptr) {
    return InvalidArgument(fmt::format("swap write of tensor {}: empty tensor or null buffer", id));
  }
  return start_write(id, 0, bytes, static_cast<const std::byte*>(data), true);
}

Result<SwapHandle> SwapStore::read(TensorId id, void* data, uint64_t bytes) {
  if (data == nullptr) return InvalidArgument(fmt::format("swap read of tensor {}: null buffer", id));
  return start_read(id, 0, bytes, static_cast<std::byte*>(data), true, options_.verify_checksums);
}

Result<SwapHandle> SwapStore::read_range(TensorId id, uint64_t offset, std::span<std::byte> dst) {
  if (dst.data() == nullptr && !dst.empty()) {
    return InvalidArgument(fmt::format("swap read_range of tensor {}: null buffer", id));
  }
  return start_read(id, offset, dst.size(), dst.data(), false, options_.verify_checksums);
}

Result<SwapHandle> SwapStore::write_range(TensorId id, uint64_t offset, std::span<const std::byte> src) {
  if (src.data() == nullptr && !src.empty()) {
    return InvalidArgument(fmt::format("swap write_range of tensor {}: null buffer", id));
  }
  return start_write(id, offset, src.size(), src.data(), false);
}

Status SwapStore::write_sync(TensorId id, const void* data, uint64_t bytes) {
  STRATA_ASSIGN_OR_RETURN(SwapHandle h, write(id, data, bytes));
  return h.wait();
}

Status SwapStore::read_sync(TensorId id, void* data, uint64_t bytes) {
  STRATA_ASSIGN_OR_RETURN(SwapHandle h, read(id, data, bytes));
  return h.wait();
}

// ---------------------------------------------------------------------------
// Checks (under mu_)

Status SwapStore::check_range(const char* what, const Entry& e, uint64_t offset, uint64_t length) const {
  if (length == 0) {
    return InvalidArgument(fmt::format("{} of tensor {}: empty range at offset {}", what, e.id, offset));
  }
  if (offset > e.bytes || length > e.bytes - offset) {
    return InvalidArgument(fmt::format(
        "{} of tensor {}: range offset {} length {} ends at byte {}, past the tensor's end (its size is {} bytes)",
        what, e.id, offset, length, offset + length, e.bytes));
  }
  if (offset % block_ != 0 || (length % block_ != 0 && offset + length != e.bytes)) {
    return InvalidArgument(fmt::format(
        "{} of tensor {}: range offset {} length {} is not aligned to the {} B checksum block (the offset must be "
        "a multiple of it, and the length too unless the range ends at the tensor's end, byte {}); align "
        "sub-group tiles to checksum_block_bytes",
        what, e.id, offset, length, block_, e.bytes));
  }
  return Status::Ok();
}

Status SwapStore::check_overlap(const char* what, const Entry& e, uint64_t offset, uint64_t length,
                                bool is_write) const {
  for (const InFlight& f : e.inflight) {
    if (!is_write && !f.is_write) continue;  // reads of the same bytes may overlap
    if (!overlaps(offset, length, f.offset, f.length)) continue;
    auto range = [](uint64_t o, uint64_t l) {
      return l >= kWholeRange ? std::string("(whole tensor)") : fmt::format("[{}, +{})", o, l);
    };
    return FailedPrecondition(fmt::format(
        "{} of tensor {} {}: overlaps an in-flight {} of {} of the same tensor; wait for it first", what, e.id,
        range(offset, length), f.is_write ? "write" : "read", range(f.offset, f.length)));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Reads

Result<SwapHandle> SwapStore::start_read(TensorId id, uint64_t offset, uint64_t length, std::byte* dst, bool whole,
                                         bool verify) {
  const char* what = whole ? "swap read" : "swap read_range";
  if (closed_) return FailedPrecondition(fmt::format("{} of tensor {}: the store is closed", what, id));
  auto op = std::make_shared<detail::SwapOpState>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) {
      return NotFound(fmt::format("{}: tensor {} was never written to this store", what, id));
    }
    Entry& e = it->second;
    if (!e.valid) {
      return DataLoss(fmt::format("{} of tensor {}: no valid data (its first write failed or is still in flight)",
                                  what, id));
    }
    if (whole) {
      if (length != e.bytes) {
        return InvalidArgument(fmt::format("{} of tensor {}: asked for {} bytes, stored {}", what, id, length,
                                           e.bytes));
      }
    } else {
      STRATA_RETURN_IF_ERROR(check_range(what, e, offset, length));
    }
    STRATA_RETURN_IF_ERROR(check_overlap(what, e, offset, length, false));
    op->serial = next_serial_++;
    e.inflight.push_back(InFlight{op->serial, offset, length, false});
    op->runs = e.runs;
    if (verify) {
      uint64_t first = offset / block_;
      op->sums.assign(e.sums.begin() + static_cast<ptrdiff_t>(first),
                      e.sums.begin() + static_cast<ptrdiff_t>(first + blocks_for(length, block_)));
    }
  }
  op->id = id;
  op->whole = whole;
  op->verify = verify;
  op->offset = offset;
  op->length = length;
  op->data = dst;
  op->counters = counters_;
  const size_t chunks = static_cast<size_t>(blocks_for(length, chunk_));
  op->chunk_status.resize(chunks);
  op->remaining.store(static_cast<int64_t>(chunks));
  op->source = CompletionSource(fmt::format("swap read of {}", op->what()));
  op->completion = op->source.completion();
  pending_ops_.fetch_add(1, std::memory_order_acq_rel);
  counters_->bytes_read.fetch_add(length, std::memory_order_relaxed);
  for (size_t c = 0; c < chunks; ++c) {
    uint64_t at = c * chunk_;
    uint64_t len = std::min(chunk_, length - at);
    std::vector<IoSegment> segs = segments_for_runs(op->runs, offset + at, len, dst + at);
    engine_.submit(IoOp::kRead, segs, [this, op, c](const Status& st) { io_done(op, c, st); });
  }
  return SwapHandle(op);
}

// Runs on an engine worker: hand the hashing to the verify pool.
void SwapStore::io_done(const std::shared_ptr<detail::SwapOpState>& op, size_t chunk, const Status& st) {
  if (!st.ok() || !op->verify) {
    op->record_io(st);
    arrive(op);
    return;
  }
  pool_->post([this, op, chunk] {
    verify_chunk(op, chunk);
    arrive(op);
  });
}

// Runs on the verify pool: checks the blocks of one read chunk.
void SwapStore::verify_chunk(const std::shared_ptr<detail::SwapOpState>& op, size_t chunk) {
  const uint64_t at = chunk * chunk_;
  const uint64_t len = std::min(chunk_, op->length - at);
  uint64_t t0 = now_ns();
  Status result;
  for (uint64_t b = 0; b < len; b += block_) {
    uint64_t n = std::min(block_, len - b);
    uint64_t actual = checksum64(op->data + at + b, n);
    uint64_t index = (at + b) / block_;
    if (actual == op->sums[index]) continue;
    // Name the block, the run's extent, the file and offset, and both sums.
    uint64_t tensor_at = op->offset + at + b;
    const SwapRun* run = &op->runs.front();
    for (const SwapRun& r : op->runs) {
      if (tensor_at >= r.tensor_offset && tensor_at < r.tensor_offset + r.length) run = &r;
    }
    uint64_t address = run->data_offset + (tensor_at - run->tensor_offset);
    result = DataLoss(fmt::format(
        "checksum mismatch reading tensor {} block {} (tensor bytes [{}, +{}), extent [{}, +{}), {}): stored xxh3 "
        "{:016x}, read back {:016x}; the swap data is corrupt (torn write, bit rot or a file changed behind "
        "Strata's back)",
        op->id, tensor_at / block_, tensor_at, n, run->data_offset, allocator_->round_up(run->length),
        locate(address), op->sums[index], actual));
    break;
  }
  op->counters->checksum_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  if (!result.ok()) {
    std::lock_guard<std::mutex> lock(op->mu);
    op->chunk_status[chunk] = std::move(result);
  }
}

// The last arrival moves the operation on: reads finish, writes verify or finish.
void SwapStore::arrive(const std::shared_ptr<detail::SwapOpState>& op) {
  if (op->remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  Status io;
  Status verified;
  {
    std::lock_guard<std::mutex> lock(op->mu);
    io = op->io_status;
    for (const Status& s : op->chunk_status) {
      if (!s.ok()) {
        verified = s;
        break;
      }
    }
  }
  if (!io.ok()) {
    std::string context = op->is_write
        ? fmt::format("swap write of {} to the shadow extent [{}, +{}) (the previous version is intact)",
                      op->what(), op->fresh.offset, op->fresh.length)
        : fmt::format("swap read of {}", op->what());
    finish(op, std::move(io).with_context(context));
    return;
  }
  if (op->is_write && verified.is_data_loss()) {
    op->counters->write_verify_failures.fetch_add(1, std::memory_order_relaxed);
  }
  finish(op, verified);
}

// ---------------------------------------------------------------------------
// Writes

Result<SwapHandle> SwapStore::start_write(TensorId id, uint64_t offset, uint64_t length, const std::byte* src,
                                          bool whole) {
  const char* what = whole ? "swap write" : "swap write_range";
  if (closed_) return FailedPrecondition(fmt::format("{} of tensor {}: the store is closed", what, id));
  auto op = std::make_shared<detail::SwapOpState>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(id);
    bool created = false;
    uint64_t delta = 0;
    if (whole) {
      if (it == entries_.end()) {
        Entry fresh_entry;
        fresh_entry.id = id;
        it = entries_.emplace(id, std::move(fresh_entry)).first;
        created = true;
      } else {
        STRATA_RETURN_IF_ERROR(check_overlap(what, it->second, 0, kWholeRange, true));
      }
      const Entry& e = it->second;
      uint64_t after = kRecordHeaderBytes + kRunBytes + sizeof(uint64_t) * blocks_for(length, block_);
      uint64_t before = e.valid ? record_bytes(e) : 0;
      delta = after > before ? after - before : 0;
    } else {
      if (it == entries_.end()) {
        return NotFound(fmt::format("{}: tensor {} is not in this store; write the whole tensor first", what, id));
      }
      const Entry& e = it->second;
      if (!e.valid) {
        return FailedPrecondition(fmt::format(
            "{} of tensor {}: it has no valid version to update (its first write failed or is in flight)", what, id));
      }
      STRATA_RETURN_IF_ERROR(check_range(what, e, offset, length));
      STRATA_RETURN_IF_ERROR(check_overlap(what, e, offset, length, true));
      delta = 2 * kRunBytes;  // a range write splits at most one run into three
    }
    auto fail = [&](Status st) {
      if (created) entries_.erase(id);
      return st;
    };
    const uint64_t room = index_capacity();
    if (table_bytes_ + table_reserved_ + delta > room) {
      return fail(ResourceExhausted(fmt::format(
          "{} of tensor {}: the index of the {} is full ({} of {} bytes of tensor records used or reserved, {} "
          "more needed); raise index_bytes (0 sizes it from the capacity)",
          what, id, name(), table_bytes_ + table_reserved_, room, delta)));
    }
    auto fresh = allocator_->allocate(length);
    if (!fresh.ok()) {
      return fail(ResourceExhausted(fmt::format(
          "{} of {}: no room in the {} for its shadow extent: {} needed, {} free "
          "(largest free extent {}). A write goes to a fresh extent and the old version is freed only after it "
          "verified, so the capacity must hold every stored tensor plus one shadow per in-flight write; raise "
          "capacity_bytes (by the largest tensor written at once) or wait for in-flight writes first",
          what, whole ? fmt::format("tensor {} ({} bytes)", id, length)
                      : fmt::format("tensor {} range [{}, +{})", id, offset, length),
          name(), format_bytes(allocator_->round_up(length), true),
          format_bytes(allocator_->free_bytes(), true), format_bytes(allocator_->largest_free(), true))));
    }
    table_reserved_ += delta;
    op->table_delta = delta;
    op->fresh = *fresh;
    op->serial = next_serial_++;
    it->second.inflight.push_back(InFlight{op->serial, whole ? 0 : offset, whole ? kWholeRange : length, true});
  }
  op->id = id;
  op->is_write = true;
  op->whole = whole;
  op->verify = options_.verify_writes;
  op->offset = offset;
  op->length = length;
  op->data = const_cast<std::byte*>(src);  // only read: the source of the write and of its checksums
  op->counters = counters_;
  op->sums.resize(blocks_for(length, block_));
  const size_t chunks = static_cast<size_t>(blocks_for(length, chunk_));
  op->remaining.store(static_cast<int64_t>(chunks));  // each chunk arrives once: written, hashed, verified
  op->chunk_left = std::make_unique<std::atomic<int>[]>(chunks);
  for (size_t c = 0; c < chunks; ++c) op->chunk_left[c].store(2);  // its write request and its hashing task
  op->chunk_status.resize(chunks);
  op->source = CompletionSource(fmt::format("swap write of {}", op->what()));
  op->completion = op->source.completion();
  pending_ops_.fetch_add(1, std::memory_order_acq_rel);
  counters_->bytes_written.fetch_add(length, std::memory_order_relaxed);
  for (size_t c = 0; c < chunks; ++c) {
    uint64_t at = c * chunk_;
    uint64_t len = std::min(chunk_, length - at);
    std::vector<IoSegment> segs = segments_for(Extent{op->fresh.offset + at, len}, len, op->data + at);
    engine_.submit(IoOp::kWrite, segs, [this, op, c](const Status& st) {
      op->record_io(st);
      chunk_written(op, c);
    });
  }
  // Hash the caller's bytes on the verify pool while the write is in flight
  // (the engine only reads them).
  for (size_t c = 0; c < chunks; ++c) {
    pool_->post([this, op, c] {
      uint64_t t0 = now_ns();
      uint64_t at = c * chunk_;
      uint64_t len = std::min(chunk_, op->length - at);
      for (uint64_t b = 0; b < len; b += block_) {
        op->sums[(at + b) / block_] = checksum64(op->data + at + b, std::min(block_, len - b));
      }
      op->counters->checksum_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
      chunk_written(op, c);
    });
  }
  return SwapHandle(op);
}

// A chunk's write request or its hashing task arrived; after both, the
// chunk is read back (verify_writes) or done. Runs on an engine worker or a
// verify thread.
void SwapStore::chunk_written(const std::shared_ptr<detail::SwapOpState>& op, size_t chunk) {
  if (op->chunk_left[chunk].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  bool failed;
  {
    std::lock_guard<std::mutex> lock(op->mu);
    failed = !op->io_status.ok();
  }
  if (!op->verify || failed) {
    arrive(op);
    return;
  }
  // Take a scratch slot of this write, or wait in `ready` for one.
  size_t slot = 0;
  {
    std::lock_guard<std::mutex> lock(op->mu);
    if (!op->scratch_free.empty()) {
      slot = op->scratch_free.back();
      op->scratch_free.pop_back();
    } else if (op->scratch.size() < kReadBackDepth) {
      op->scratch.reserve(kReadBackDepth);  // data pointers stay put either way
      slot = op->scratch.size();
      op->scratch.emplace_back();
    } else {
      op->ready.push_back(chunk);
      return;
    }
  }
  read_back(op, chunk, slot);
}

// Reads chunk `chunk` of the shadow extent into scratch slot `slot`, then
// compares it on the verify pool against the checksums of the caller's bytes.
void SwapStore::read_back(const std::shared_ptr<detail::SwapOpState>& op, size_t chunk, size_t slot) {
  const uint64_t at = chunk * chunk_;
  const uint64_t len = std::min(chunk_, op->length - at);
  std::byte* buffer;
  {
    std::lock_guard<std::mutex> lock(op->mu);
    buffer = op->scratch[slot].data();
  }
  if (buffer == nullptr) {
    // Scratch buffers (one chunk each) are kept for the next write: a fresh
    // 8 MiB allocation per write would cost its page faults every time.
    AlignedBuffer fresh;
    {
      std::lock_guard<std::mutex> lock(scratch_mu_);
      if (!scratch_free_.empty()) {
        fresh = std::move(scratch_free_.back());
        scratch_free_.pop_back();
      }
    }
    if (fresh.size() == 0) {
      auto made = AlignedBuffer::allocate(chunk_, granularity_);
      if (!made.ok()) {
        {
          std::lock_guard<std::mutex> lock(op->mu);
          op->chunk_status[chunk] =
              std::move(made).status().with_context(fmt::format("verifying the swap write of {}", op->what()));
        }
        release_scratch(op, slot);  // the next waiting chunk tries again
        arrive(op);
        return;
      }
      fresh = std::move(made).value();
    }
    buffer = fresh.data();
    std::lock_guard<std::mutex> lock(op->mu);
    op->scratch[slot] = std::move(fresh);
  }
  op->counters->bytes_read_back.fetch_add(len, std::memory_order_relaxed);
  std::vector<IoSegment> segs = segments_for(Extent{op->fresh.offset + at, len}, len, buffer);
  engine_.submit(IoOp::kRead, segs, [this, op, chunk, slot, at, len, buffer](const Status& st) {
    if (!st.ok()) {
      {
        std::lock_guard<std::mutex> lock(op->mu);
        op->chunk_status[chunk] = st.with_context(
            fmt::format("reading back the swap write of {} (the previous version is intact)", op->what()));
      }
      release_scratch(op, slot);
      arrive(op);
      return;
    }
    pool_->post([this, op, chunk, slot, at, len, buffer] {
      uint64_t t0 = now_ns();
      Status result;
      for (uint64_t b = 0; b < len; b += block_) {
        uint64_t n = std::min(block_, len - b);
        uint64_t actual = checksum64(buffer + b, n);
        uint64_t expected = op->sums[(at + b) / block_];
        if (actual == expected) continue;
        uint64_t tensor_at = op->offset + at + b;
        result = DataLoss(fmt::format(
            "swap write of {} did not verify at block {} (tensor bytes [{}, +{})): wrote xxh3 {:016x}, read back "
            "{:016x} from the shadow extent [{}, +{}) at {} (a torn or lost write); the previous version of "
            "tensor {} is intact and still readable",
            op->what(), tensor_at / block_, tensor_at, n, expected, actual, op->fresh.offset, op->fresh.length,
            locate(op->fresh.offset + at + b), op->id));
        break;
      }
      op->counters->checksum_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
      if (!result.ok()) {
        std::lock_guard<std::mutex> lock(op->mu);
        op->chunk_status[chunk] = std::move(result);
      }
      release_scratch(op, slot);
      arrive(op);
    });
  });
}

// Hands scratch slot `slot` to the next chunk waiting for one, or frees it.
void SwapStore::release_scratch(const std::shared_ptr<detail::SwapOpState>& op, size_t slot) {
  size_t next = 0;
  {
    std::lock_guard<std::mutex> lock(op->mu);
    if (op->ready.empty()) {
      op->scratch_free.push_back(slot);
      return;
    }
    next = op->ready.front();
    op->ready.erase(op->ready.begin());
  }
  read_back(op, next, slot);
}

// ---------------------------------------------------------------------------
// Completion

void SwapStore::replace_runs(Entry& e, uint64_t offset, uint64_t length, uint64_t address) {
  const uint64_t end = offset + length;
  std::vector<SwapRun> out;
  out.reserve(e.runs.size() + 2);
  for (const SwapRun& r : e.runs) {
    const uint64_t rend = r.tensor_offset + r.length;
    if (rend <= offset || r.tensor_offset >= end) {
      out.push_back(r);
      continue;
    }
    if (r.tensor_offset < offset) out.push_back(SwapRun{r.tensor_offset, offset - r.tensor_offset, r.data_offset});
    const uint64_t a = std::max(offset, r.tensor_offset);
    const uint64_t b = std::min(end, rend);
    // Only the tensor's last run has a partial tail; its reservation is rounded up.
    const uint64_t freed = b == e.bytes ? allocator_->round_up(b - a) : b - a;
    Status st = allocator_->free(Extent{r.data_offset + (a - r.tensor_offset), freed});
    STRATA_CHECK(st.ok(), "swap store: freeing replaced data failed: " + st.message());
    if (rend > end) out.push_back(SwapRun{end, rend - end, r.data_offset + (end - r.tensor_offset)});
  }
  out.push_back(SwapRun{offset, length, address});
  std::sort(out.begin(), out.end(), [](const SwapRun& x, const SwapRun& y) { return x.tensor_offset < y.tensor_offset; });
  // Merge neighbours that are contiguous on disk too (whole granules only).
  std::vector<SwapRun> merged;
  for (const SwapRun& r : out) {
    if (!merged.empty()) {
      SwapRun& m = merged.back();
      if (m.data_offset + m.length == r.data_offset && m.length % granularity_ == 0) {
        m.length += r.length;
        continue;
      }
    }
    merged.push_back(r);
  }
  e.runs = std::move(merged);
}

void SwapStore::finish(const std::shared_ptr<detail::SwapOpState>& op, Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(op->id);
    STRATA_CHECK(it != entries_.end(), "swap store: operation finished for an unknown tensor");
    Entry& e = it->second;
    std::erase_if(e.inflight, [&](const InFlight& f) { return f.serial == op->serial; });
    if (op->is_write) {
      table_reserved_ -= op->table_delta;
      if (status.ok()) {
        uint64_t before = e.valid ? record_bytes(e) : 0;
        if (op->whole) {
          for (const SwapRun& r : e.runs) {
            Status st = allocator_->free(Extent{r.data_offset, allocator_->round_up(r.length)});
            STRATA_CHECK(st.ok(), "swap store: freeing the previous version failed: " + st.message());
          }
          e.runs = {SwapRun{0, op->length, op->fresh.offset}};
          e.bytes = op->length;
          e.sums = std::move(op->sums);
        } else {
          replace_runs(e, op->offset, op->length, op->fresh.offset);
          std::copy(op->sums.begin(), op->sums.end(), e.sums.begin() + static_cast<ptrdiff_t>(op->offset / block_));
        }
        e.valid = true;
        table_bytes_ = table_bytes_ - before + record_bytes(e);
      } else {
        Status st = allocator_->free(op->fresh);
        STRATA_CHECK(st.ok(), "swap store: freeing a failed write's shadow extent failed: " + st.message());
      }
    }
  }
  if (op->is_write && status.ok()) op->counters->flips.fetch_add(1, std::memory_order_relaxed);
  if (!op->is_write && status.is_data_loss()) op->counters->verify_failures.fetch_add(1, std::memory_order_relaxed);
  if (!op->scratch.empty()) {
    std::lock_guard<std::mutex> lock(scratch_mu_);
    for (AlignedBuffer& b : op->scratch) {
      if (b.size() != 0 && scratch_free_.size() < kScratchKept) scratch_free_.push_back(std::move(b));
    }
    op->scratch.clear();
  }
  // Last touch of the store: the destructor waits for pending_ops_ to drain.
  if (pending_ops_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_ops_.notify_all();
  op->source.complete(std::move(status));
}

}  // namespace strata::nvme
