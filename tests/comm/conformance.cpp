#include "conformance.h"

#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "strata/comm/pattern.h"

namespace strata::comm::testing {
namespace {

struct Case {
  CollectiveDesc desc;
  bool in_place = false;
};

std::string case_name(const Case& c, int rank, int world) {
  return fmt::format("{} {} rank {} of {}", describe(c.desc, world), c.in_place ? "in-place" : "out-of-place", rank,
                     world);
}

// Runs one case; returns "" on success or a failure line.
std::string run_case(Communicator& comm, Case c) {
  const int rank = comm.rank();
  const int world = comm.world_size();
  const size_t elt = dtype_size(c.desc.dtype);
  const size_t n_send = send_count(c.desc, world);
  const size_t n_recv = recv_count(c.desc, world);
  std::vector<unsigned char> host_send(std::max<size_t>(n_send, 1) * elt);
  std::vector<unsigned char> host_recv(std::max<size_t>(n_recv, 1) * elt);
  fill_send_pattern(c.desc, rank, world, host_send.data());
  fill_sentinel(c.desc.dtype, host_recv.data(), n_recv);

  // Device (or host) buffers. In place, one buffer holds both.
  Result<CommBuffer> a = comm.allocate_buffer(std::max(n_send, n_recv) * elt + 64);
  Result<CommBuffer> b = comm.allocate_buffer(n_recv * elt + 64);
  if (!a.ok()) return a.status().to_string();
  if (!b.ok()) return b.status().to_string();
  auto* buf_a = static_cast<char*>(a->data());
  auto* buf_b = static_cast<char*>(b->data());
  const void* send = buf_a;
  void* recv = buf_b;
  Status st;
  if (!c.in_place) {
    if (n_send > 0) st = comm.upload(buf_a, host_send.data(), n_send * elt);
    if (st.ok() && n_recv > 0) st = comm.upload(buf_b, host_recv.data(), n_recv * elt);
  } else {
    switch (c.desc.op) {
      case CollectiveOp::kAllGather: {
        // recv = buf_a (world * count), own shard already in place.
        recv = buf_a;
        std::vector<unsigned char> staged(host_recv);
        std::memcpy(staged.data() + static_cast<size_t>(rank) * c.desc.count * elt, host_send.data(),
                    c.desc.count * elt);
        if (n_recv > 0) st = comm.upload(buf_a, staged.data(), n_recv * elt);
        send = buf_a + static_cast<size_t>(rank) * c.desc.count * elt;
        break;
      }
      case CollectiveOp::kReduceScatter:
        if (n_send > 0) st = comm.upload(buf_a, host_send.data(), n_send * elt);
        send = buf_a;
        recv = buf_a + static_cast<size_t>(rank) * c.desc.count * elt;
        break;
      case CollectiveOp::kAllReduce:
        if (n_send > 0) st = comm.upload(buf_a, host_send.data(), n_send * elt);
        send = buf_a;
        recv = buf_a;
        break;
      case CollectiveOp::kBroadcast:
        if (n_send > 0) {
          st = comm.upload(buf_a, rank == c.desc.root ? host_send.data() : host_recv.data(), n_send * elt);
        }
        send = buf_a;
        recv = buf_a;
        break;
      case CollectiveOp::kBarrier: break;
    }
  }
  if (!st.ok()) return st.to_string();

  Result<CommWork> work = Status(Internal("unreached"));
  switch (c.desc.op) {
    case CollectiveOp::kAllGather: work = comm.all_gather(send, recv, c.desc.count, c.desc.dtype); break;
    case CollectiveOp::kReduceScatter:
      work = comm.reduce_scatter(send, recv, c.desc.count, c.desc.dtype, c.desc.reduce);
      break;
    case CollectiveOp::kAllReduce: work = comm.all_reduce(send, recv, c.desc.count, c.desc.dtype, c.desc.reduce); break;
    case CollectiveOp::kBroadcast:
      work = comm.broadcast(send, recv, c.desc.count, c.desc.dtype, c.desc.root);
      break;
    case CollectiveOp::kBarrier: work = comm.barrier(); break;
  }
  if (!work.ok()) return fmt::format("{}: submit failed: {}", case_name(c, rank, world), work.status().to_string());
  Status done = work->wait();
  if (!done.ok()) return fmt::format("{}: {}", case_name(c, rank, world), done.to_string());
  if (!work->done()) return fmt::format("{}: wait() returned but done() is false", case_name(c, rank, world));
  if (n_recv > 0) {
    Status d = comm.download(host_recv.data(), recv, n_recv * elt);
    if (!d.ok()) return d.to_string();
  }
  size_t first = 0;
  const size_t wrong = count_wrong(c.desc, rank, world, host_recv.data(), &first);
  if (wrong > 0) {
    return fmt::format("{}: {} wrong elements, first at {}: got 0x{:x} want 0x{:x}", case_name(c, rank, world), wrong,
                       first, element_bits(c.desc.dtype, host_recv.data(), first),
                       expected_bits(c.desc, rank, world, first));
  }
  return "";
}

}  // namespace

std::vector<size_t> conformance_sizes(int world, bool large) {
  std::vector<size_t> sizes{0, 1, static_cast<size_t>(world) + 1, 3 * static_cast<size_t>(world) - 1,
                            1000 + static_cast<size_t>(world)};
  if (large) sizes.push_back(4099);
  return sizes;
}

std::vector<std::string> run_conformance(Communicator& comm, const ConformanceOptions& options) {
  std::vector<std::string> failures;
  const int world = comm.world_size();
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kF64, DType::kI64}) {
    for (size_t count : conformance_sizes(world, options.large_sizes)) {
      for (bool in_place : {false, true}) {
        std::vector<Case> cases;
        Case c;
        c.in_place = in_place;
        c.desc.dtype = dtype;
        c.desc.count = count;
        c.desc.op = CollectiveOp::kAllGather;
        cases.push_back(c);
        for (ReduceOp r : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
          if (r == ReduceOp::kAvg && dtype_size(dtype) == 2 && !options.check_avg_16bit) continue;
          if (r == ReduceOp::kAvg && dtype == DType::kI64) continue;  // rejected at issue
          c.desc.reduce = r;
          c.desc.op = CollectiveOp::kReduceScatter;
          cases.push_back(c);
          c.desc.op = CollectiveOp::kAllReduce;
          cases.push_back(c);
        }
        c.desc.reduce = ReduceOp::kSum;
        c.desc.op = CollectiveOp::kBroadcast;
        c.desc.root = static_cast<int>(count % static_cast<size_t>(world));
        cases.push_back(c);
        c.desc.root = 0;
        c.desc.op = CollectiveOp::kBarrier;
        cases.push_back(c);
        for (const Case& one : cases) {
          std::string failure = run_case(comm, one);
          if (!failure.empty()) failures.push_back(std::move(failure));
          if (failures.size() > 20) return failures;  // the group is likely broken; stop early
        }
      }
    }
  }
  return failures;
}

}  // namespace strata::comm::testing
