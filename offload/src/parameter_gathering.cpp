// ParameterGathering (Note [Parameter gathering] in parameter_gathering.h).
#include "parameter_gathering.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

namespace strata::offload::engine_detail {

ParameterGathering::~ParameterGathering() { stop_reader(); }

void ParameterGathering::stop_reader() {
  if (!shard_reader_) return;
  ctx_.wait_at_teardown(shard_reader_->submit([] { return Status::Ok(); }, {}, "the end of the shard reader's queue",
                                              /*sticky=*/false),
                        "the parameter shard reader's queued reads");
  shard_reader_.reset();
}

Status ParameterGathering::init(const std::string& job_name) {
  const EngineOptions& opt = ctx_.opt;
  auto bounded = [this](const Completion& c, std::string_view what) { return ctx_.wait_bounded(c, what); };
  live_.emplace(ctx_.frees.get(), bounded);
  const size_t n = ctx_.part.layer_count();
  layers_.resize(n);
  holdings_.resize(n);
  trace_.emplace(n);
  std::vector<PrefetchPolicy::Layer> sizes(n);
  for (size_t li = 0; li < n; ++li) {
    const LayerPlacement& where = ctx_.where(li);
    sizes[li] = {ctx_.part.layer(li).elements, ctx_.part.layer(li).padded_elements,
                 !where.persistent() && !where.acquired_in_place};
  }
  policy_.emplace(PrefetchPolicy::Caps{static_cast<uint64_t>(opt.prefetch_bucket_size),
                                       static_cast<uint64_t>(opt.max_live_parameters),
                                       static_cast<uint64_t>(opt.max_reuse_distance)},
                  std::move(sizes));
  if (ctx_.placement.param_shards_use_nvme()) STRATA_RETURN_IF_ERROR(make_param_swap(job_name));
  return Status::Ok();
}

// offload_param nvme: the swap store for the shards the placement puts on
// NVMe (every partitioned layer after the first max_in_cpu shard elements,
// which stay in pinned host memory), with slots for the largest of them.
Status ParameterGathering::make_param_swap(const std::string& job_name) {
  const EngineOptions& opt = ctx_.opt;
  if (!ctx_.placement.params_sharded()) return InvalidArgument(fmt::format("{}: offload_param nvme needs stage 3", opt.source));
  uint64_t capacity = 0, largest = 0, largest_elements = 0;
  std::string largest_name;
  for (size_t li = 0; li < ctx_.part.layer_count(); ++li) {
    const LayerPlacement& where = ctx_.where(li);
    if (!where.shard_on_nvme()) continue;
    const LayerPartition& layer_part = ctx_.part.layer(li);
    const uint64_t bytes = layer_part.shard_elements * where.param_element_bytes;
    capacity += bytes;
    if (bytes > largest) {
      largest = bytes;
      largest_elements = layer_part.shard_elements;
      largest_name = ctx_.layer_label(li);
    }
  }
  if (capacity == 0) return Status::Ok();  // everything fits max_in_cpu: no NVMe I/O at all
  if (static_cast<uint64_t>(opt.nvme_param.buffer_size) < largest_elements)
    return InvalidArgument(fmt::format(
        "{}: zero_optimization.offload_param.buffer_size {} elements is smaller than the largest parameter shard on "
        "NVMe ({} elements, {}); raise buffer_size to at least {}",
        opt.source, opt.nvme_param.buffer_size, largest_elements, largest_name, largest_elements));
  ParamSwapOptions o;
  o.path = opt.nvme_param.path;
  o.job = job_name + "-params";
  o.rank = ctx_.rank;
  o.buffer_count = static_cast<size_t>(opt.nvme_param.buffer_count);
  o.slot_bytes = largest;
  o.capacity_bytes = capacity;
  o.aio = opt.nvme.aio;
  o.verify_checksums = opt.nvme.verify_checksums;
  o.io_engine = ctx_.faults.param_io();
  STRATA_ASSIGN_OR_RETURN(swap_, ParamSwap::create(o, ctx_.device, ctx_.stats));
  shard_reader_ = std::make_unique<SerialWorker>(fmt::format("parameter shard reader of rank {}", ctx_.rank));
  return Status::Ok();
}

Status ParameterGathering::init_layer(size_t li, const std::byte* padded) {
  const LayerPartition& layer_part = ctx_.part.layer(li);
  const LayerPlacement& where = ctx_.where(li);
  LayerParams& l = layers_[li];
  const std::string lname = ctx_.layer_label(li);
  if (where.persistent()) {
    const size_t bytes = layer_part.padded_elements * where.param_element_bytes;
    STRATA_ASSIGN_OR_RETURN(l.full_params, ctx_.alloc_device(bytes, "parameters of " + lname));
    if (padded == nullptr) return ctx_.device.memset(l.full_params.data(), 0, bytes);
    return ctx_.device.copy(l.full_params.data(), padded, bytes, CopyKind::kHostToDevice);
  }
  STRATA_ASSIGN_OR_RETURN(l.shard, make_shard_home(ctx_, li, swap_.get(), shard_reader_.get()));
  // The shard is made where it lives (a slot, the host shard), not in a
  // shard-sized temporary first (Note [Shards made in place]).
  return l.shard->create([&](std::span<std::byte> shard) {
    if (padded == nullptr)
      std::memset(shard.data(), 0, shard.size());
    else
      cut_own_pieces(li, std::span<const std::byte>(padded, layer_part.padded_elements * where.param_element_bytes), shard);
  });
}

Result<ParameterGathering::Lease> ParameterGathering::acquire(size_t li, Pass pass, bool training) {
  LayerParams& l = layers_[li];
  const LayerPlacement& where = ctx_.where(li);
  Lease lease;
  if (where.persistent()) {
    lease.params = l.full_params.as<std::byte>();
    lease.ready = lease.update_ready = l.params_ready;
  } else if (where.acquired_in_place) {
    lease.params = l.shard->resident();
    lease.ready = lease.update_ready = l.shard_ready;
  } else {
    if (!l.prefetch_failure.ok()) {
      Status failed = std::move(l.prefetch_failure);
      l.prefetch_failure = Status::Ok();
      return failed.with_context(
          fmt::format("acquire of {} for {} on rank {}", ctx_.layer_label(li), pass_name(pass), ctx_.rank));
    }
    if (!holdings_[li].gathered) {
      // On demand: wait for frees in flight when the live cap would be passed.
      STRATA_RETURN_IF_ERROR(make_room_for_gather(li).with_context("freeing gathered parameters"));
      STRATA_RETURN_IF_ERROR(issue_gather(li));
    }
    lease.update_ready = l.shard_ready;
    lease.params = l.gathered.as<std::byte>();
    lease.ready = l.gathered_ready;
    prefetch_after_acquire(training);
  }
  ++holdings_[li].held;
  return lease;
}

Status ParameterGathering::issue_gather(size_t li, bool* allocated) {
  LayerParams& l = layers_[li];
  const LayerPartition& layer_part = ctx_.part.layer(li);
  if (allocated != nullptr) *allocated = false;
  STRATA_ASSIGN_OR_RETURN(l.gathered, ctx_.alloc_device(layer_part.padded_elements * element_bytes(li), [&] {
                            return "gathered parameters of " + ctx_.layer_label(li);
                          }));
  live_->hold(layer_part.padded_elements);
  if (allocated != nullptr) *allocated = true;
  // What was queued against the buffer: on failure it is handed back (and
  // uncounted) once all of it completed, never while a copy may still write it.
  std::vector<Completion> queued;
  Status st = queue_gather(li, queued);
  if (st.ok()) return st;
  live_->give_back(std::move(l.gathered), when_all(queued, fmt::format("failed gather of layer {}", li)),
                   layer_part.padded_elements);
  return st.with_context("gathering the parameters of " + ctx_.layer_label(li));
}

Status ParameterGathering::queue_gather(size_t li, std::vector<Completion>& queued) {
  LayerParams& l = layers_[li];
  const LayerPartition& layer_part = ctx_.part.layer(li);
  const LayerPlacement& where = ctx_.where(li);
  const size_t eb = where.param_element_bytes;
  const int rank = ctx_.rank;
  comm::Communicator& comm = ctx_.comm;
  std::byte* full = l.gathered.as<std::byte>();
  STRATA_RETURN_IF_ERROR(l.shard->stage_for_gather(full, l.shard_ready, queued));
  STRATA_RETURN_IF_ERROR(ctx_.faults.gather(ctx_.steps_begun, rank, li));
  Completion last;
  for (const SubGroup& g : layer_part.groups) {
    STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.all_gather(l.shard->gather_source(g, full), full + g.padded_begin * eb,
                                                              g.piece, where.param_dtype, comm::CommQueue::kGather));
    last = w.completion();
    queued.push_back(last);
  }
  ctx_.transfers.gather_bytes += layer_part.padded_elements * eb;
  l.gathered_ready = last;
  holdings_[li].gathered = true;
  return Status::Ok();
}

// stage3_max_live_parameters for an on-demand gather of layer `li`: wait
// for frees in flight, then drop the kept copies the policy names, in its
// order, until the gather fits or nothing else can go.
Status ParameterGathering::make_room_for_gather(size_t li) {
  const uint64_t more = ctx_.part.layer(li).padded_elements, cap = policy_->live_cap();
  STRATA_RETURN_IF_ERROR(live_->make_room(more, cap));
  if (policy_->fits(live_->live(), more)) return Status::Ok();
  for (size_t j : policy_->drops_to_make_room(li, holdings_)) {
    STRATA_RETURN_IF_ERROR(drop_gathered(j, layers_[j].last_use));
    STRATA_RETURN_IF_ERROR(live_->make_room(more, cap));
    if (policy_->fits(live_->live(), more)) break;
  }
  return Status::Ok();
}

void ParameterGathering::prefetch_after_acquire(bool training) {
  const uint64_t cap = policy_->live_cap();
  for (size_t lj : policy_->gathers_after_acquire(*trace_, training, holdings_, live_->held())) {
    // The frees in flight are waited for, as an on-demand gather would.
    if (!live_->make_room(ctx_.part.layer(lj).padded_elements, cap).ok()) break;
    bool allocated = false;
    if (Status st = issue_gather(lj, &allocated); !st.ok()) {
      // Out of memory for the buffer (nothing queued or counted): it is
      // gathered on demand, and the error said then if it persists. A
      // failure after that (the buffer went back once its queued work
      // completed) is the layer's acquire's error.
      if (allocated) layers_[lj].prefetch_failure = st.with_context("prefetching");
      break;
    }
  }
}

Status ParameterGathering::drop_gathered(size_t li, const Completion& done) {
  LayerParams& l = layers_[li];
  if (!holdings_[li].gathered) return Status::Ok();
  // Its users: the gather that filled it (and the H2D before), the model's last pass over it.
  const Completion users[] = {l.gathered_ready, done};
  live_->give_back(std::move(l.gathered),
                   when_all(users, fmt::format("the gathered parameters of layer {} (its gather and passes)", li)),
                   ctx_.part.layer(li).padded_elements, l.returned);
  holdings_[li].gathered = false;
  return Status::Ok();
}

Status ParameterGathering::release(size_t li, const Completion& done, const PassPosition& at,
                                   const Completion& returned) {
  LayerParams& l = layers_[li];
  --holdings_[li].held;
  if (ctx_.where(li).persistent()) return Status::Ok();
  l.last_use = done;
  l.returned = returned;
  if (holdings_[li].held > 0) return Status::Ok();
  if (!policy_->keep_on_release(li, *trace_, at)) STRATA_RETURN_IF_ERROR(drop_gathered(li, done));
  return Status::Ok();
}

Status ParameterGathering::release_every_held(const Completion& done) {
  PassPosition nowhere;  // neither training nor evaluating: nothing is kept for a next use
  for (size_t li = 0; li < layers_.size(); ++li)
    while (holdings_[li].held > 0) STRATA_RETURN_IF_ERROR(release(li, done, nowhere));
  return Status::Ok();
}

Status ParameterGathering::drop_unheld() {
  for (size_t li = 0; li < layers_.size(); ++li)
    if (!ctx_.where(li).persistent() && holdings_[li].held == 0)
      STRATA_RETURN_IF_ERROR(drop_gathered(li, layers_[li].last_use));
  return Status::Ok();
}

Status ParameterGathering::take_unclaimed_prefetch_failure() {
  for (size_t li = 0; li < layers_.size(); ++li)
    if (LayerParams& l = layers_[li]; !l.prefetch_failure.ok()) {
      Status failed = std::move(l.prefetch_failure);
      l.prefetch_failure = Status::Ok();
      return failed.with_context(fmt::format("{} (not acquired after its prefetch failed) on rank {}",
                                             ctx_.layer_label(li), ctx_.rank));
    }
  return Status::Ok();
}

std::byte* ParameterGathering::param_location(size_t li, const SubGroup& g, int r) {
  LayerParams& l = layers_[li];
  const size_t eb = element_bytes(li);
  if (ctx_.where(li).persistent())
    return l.full_params.as<std::byte>() + ctx_.part.layer(li).piece_begin(g, r) * eb;
  STRATA_CHECK(r == ctx_.rank, "a stage-3 rank holds only its own shard");
  std::byte* shard = l.shard->resident();
  STRATA_CHECK(shard != nullptr, "a shard on NVMe is updated in a parameter slot, not in place");
  return shard + g.shard_offset * eb;
}

Completion ParameterGathering::writable_after(size_t li, const Completion& reduced) {
  if (!ctx_.where(li).acquired_in_place) return reduced;
  // Lent in place: the update writes the memory the model reads, so it also
  // waits for the layer's last release (its backward's is in `reduced`
  // already, a forward-only use is not): released (ok or not: then nobody
  // reads it any more) and reduced.
  auto released = std::make_shared<CompletionSource>(fmt::format("layer {} released", li));
  layers_[li].last_use.then([released](const Status&) { released->complete(Status::Ok()); });
  const Completion both[] = {reduced, released->completion()};
  return when_all(both, fmt::format("layer {} released and its gradient reduced", li));
}

Result<Slot> ParameterGathering::update_slot(size_t li) { return layers_[li].shard->update_slot(); }

Result<Completion> ParameterGathering::write_back(size_t li, Slot staging) {
  return layers_[li].shard->write_back(std::move(staging));
}

Status ParameterGathering::publish_update(size_t li, const Completion& updated) {
  LayerParams& l = layers_[li];
  if (!ctx_.where(li).persistent()) {
    l.shard_ready = updated;
    return Status::Ok();
  }
  if (ctx_.stage0()) {
    l.params_ready = updated;
    return Status::Ok();
  }
  // A queue gate on kUpdate (Note [Exact overlap]): the gather sends the updated pieces.
  STRATA_RETURN_IF_ERROR(ctx_.comm.wait(updated, comm::CommQueue::kUpdate));
  STRATA_ASSIGN_OR_RETURN(l.params_ready, gather_persistent(li));
  return Status::Ok();
}

Result<Completion> ParameterGathering::gather_persistent(size_t li) {
  LayerParams& l = layers_[li];
  const LayerPartition& layer_part = ctx_.part.layer(li);
  const size_t eb = element_bytes(li);
  std::byte* full = l.full_params.as<std::byte>();
  Completion last;
  for (const SubGroup& g : layer_part.groups) {
    STRATA_ASSIGN_OR_RETURN(comm::CommWork w,
                            ctx_.comm.all_gather(full + layer_part.piece_begin(g, ctx_.rank) * eb,
                                                 full + g.padded_begin * eb, g.piece, ctx_.where(li).param_dtype,
                                                 comm::CommQueue::kUpdate));
    last = w.completion();
  }
  ctx_.transfers.gather_bytes += layer_part.padded_elements * eb;
  return last;
}

Status ParameterGathering::write_whole(size_t li, std::span<const std::byte> padded) {
  return ctx_.device.copy(layers_[li].full_params.data(), padded.data(), padded.size(), CopyKind::kHostToDevice);
}

Status ParameterGathering::write_whole_piece(size_t li, const SubGroup& g, int r, const std::byte* values,
                                             size_t count) {
  const size_t eb = element_bytes(li);
  return ctx_.device.copy(layers_[li].full_params.as<std::byte>() + ctx_.part.layer(li).piece_begin(g, r) * eb,
                          values, count * eb, CopyKind::kHostToDevice);
}

Status ParameterGathering::regather_whole(size_t li) {
  if (!ctx_.stage0() && ctx_.world > 1) {
    STRATA_ASSIGN_OR_RETURN(Completion last, gather_persistent(li));
    // Off the step path (a rollback, a load): the next forward reads these parameters.
    STRATA_RETURN_IF_ERROR(ctx_.wait_status(last, "gathering the re-derived parameters of " + ctx_.layer_label(li)));
  }
  layers_[li].params_ready = Completion();
  return Status::Ok();
}

Status ParameterGathering::replace_shard(size_t li, std::span<const std::byte> values) {
  // The shard is whole already: written from where it is (no slot copy).
  return replace_shard_with(li, [&] { return layers_[li].shard->put(values); });
}

Status ParameterGathering::replace_shard_from_layer(size_t li, std::span<const std::byte> values) {
  return replace_shard_with(li, [&] {
    return layers_[li].shard->refill([&](std::span<std::byte> shard) { cut_own_pieces(li, values, shard); });
  });
}

Status ParameterGathering::replace_shard_with(size_t li, const std::function<Status()>& write) {
  LayerParams& l = layers_[li];
  // A gathered copy holds the replaced values: dropped (none outlives a
  // step's backward; this is for a failure elsewhere).
  if (holdings_[li].gathered && holdings_[li].held == 0) STRATA_RETURN_IF_ERROR(drop_gathered(li, l.last_use));
  STRATA_RETURN_IF_ERROR(write());
  l.shard_ready = Completion();
  return Status::Ok();
}

// Note [Shards made in place]: a shard made from a layer's values or from
// nothing (initial values, zeros at creation) is filled where it is written
// from: a slot of the swap store for a shard on NVMe, the pinned host shard
// itself, and only for a device shard a host copy first (ShardHome::create
// and refill). Filling a shard-sized temporary and copying it was a
// transient the size of the largest layer at world size 1: ~200 MiB at
// engine creation of a 355M GPT-2 (docs/performance.md). A load or a
// rollback hands in a whole shard: ShardHome::put writes it as it is.

void ParameterGathering::cut_own_pieces(size_t li, std::span<const std::byte> values, std::span<std::byte> shard) const {
  const LayerPartition& layer_part = ctx_.part.layer(li);
  const size_t eb = element_bytes(li);
  STRATA_CHECK(shard.size() == layer_part.shard_elements * eb, "a shard's bytes");
  std::memset(shard.data(), 0, shard.size());
  for (const SubGroup& g : layer_part.groups) {
    const size_t begin = layer_part.piece_begin(g, ctx_.rank) * eb;
    const size_t given = begin < values.size() ? std::min(g.piece * eb, values.size() - begin) : 0;
    if (given > 0) std::memcpy(shard.data() + g.shard_offset * eb, values.data() + begin, given);
  }
}

Result<std::vector<float>> ParameterGathering::shard_fp32(size_t li) {
  const LayerParams& l = layers_[li];
  const LayerPlacement& where = ctx_.where(li);
  const LayerPartition& layer_part = ctx_.part.layer(li);
  const size_t eb = where.param_element_bytes;
  std::vector<std::byte> shard(layer_part.shard_elements * eb);
  if (where.persistent()) {
    for (const SubGroup& g : layer_part.groups)
      STRATA_RETURN_IF_ERROR(ctx_.device.copy(shard.data() + g.shard_offset * eb,
                                              l.full_params.as<std::byte>() + layer_part.piece_begin(g, ctx_.rank) * eb,
                                              g.piece * eb, CopyKind::kDeviceToHost));
  } else {
    STRATA_RETURN_IF_ERROR(l.shard->read(shard));
  }
  std::vector<float> out(layer_part.shard_elements);
  params_to_fp32(where.param_dtype, shard.data(), out.data(), out.size());
  return out;
}

}  // namespace strata::offload::engine_detail
