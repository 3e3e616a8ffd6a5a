// Collectives on streams (local backend): completions, gates, separate
// queues, fp64/int64 reductions, and issuing from several threads at once.
// Each rank runs on its own thread (and here sometimes two: one per queue).
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "strata/comm/backends.h"
#include "strata/core/device_registry.h"

namespace strata::comm {
namespace {

using namespace std::chrono_literals;

std::vector<std::unique_ptr<Communicator>> make_group(int n, std::chrono::milliseconds timeout = 20s) {
  CommOptions opts;
  opts.timeout = timeout;
  auto group = create_local_group(n, opts);
  EXPECT_TRUE(group.ok()) << group.status().to_string();
  return std::move(group).value();
}

void run_ranks(std::vector<std::unique_ptr<Communicator>>& comms,
               const std::function<void(int, Communicator&)>& body) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r) {
    threads.emplace_back([&, r] { body(static_cast<int>(r), *comms[r]); });
  }
  for (auto& t : threads) t.join();
}

bool contains(const Status& s, std::string_view text) { return s.message().find(text) != std::string::npos; }

TEST(CommQueues, GatedReduceDoesNotDelayGatherOnTheOtherQueue) {
  const int n = 2;
  auto comms = make_group(n);
  std::vector<CompletionSource> gates;
  for (int r = 0; r < n; ++r) gates.emplace_back("gradients of layer 7");
  std::vector<std::vector<float>> grads(n, std::vector<float>(4096));
  std::vector<std::vector<float>> params(n, std::vector<float>(64));
  std::vector<std::vector<float>> gathered(n, std::vector<float>(64 * n, -1.0f));
  std::vector<CommWork> reduces(n);
  std::atomic<int> gathers_done{0};
  run_ranks(comms, [&](int r, Communicator& c) {
    const auto me = static_cast<size_t>(r);
    std::fill(grads[me].begin(), grads[me].end(), static_cast<float>(r + 1));
    std::fill(params[me].begin(), params[me].end(), static_cast<float>(10 * (r + 1)));
    ASSERT_TRUE(c.wait(gates[me].completion(), CommQueue::kReduce).ok());
    auto reduce = c.all_reduce(grads[me].data(), grads[me].data(), grads[me].size(), DType::kF32, ReduceOp::kSum,
                               CommQueue::kReduce);
    ASSERT_TRUE(reduce.ok());
    EXPECT_EQ(reduce->queue(), CommQueue::kReduce);
    reduces[me] = *reduce;
    auto gather = c.all_gather(params[me].data(), gathered[me].data(), 64, DType::kF32, CommQueue::kGather);
    ASSERT_TRUE(gather.ok());
    EXPECT_EQ(gather->sequence(), 0u);  // sequences are per queue
    // The reduce queue is held by the gate; the gather still completes.
    EXPECT_TRUE(gather->wait().ok()) << gather->wait().to_string();
    ++gathers_done;
    EXPECT_FALSE(reduce->done());
    EXPECT_EQ(reduce->wait_for(20ms).code(), StatusCode::kUnavailable);
  });
  EXPECT_EQ(gathers_done.load(), n);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(gathered[static_cast<size_t>(r)][0], 10.0f);
    EXPECT_EQ(gathered[static_cast<size_t>(r)][64], 20.0f);
    EXPECT_FALSE(reduces[static_cast<size_t>(r)].done());
  }
  for (auto& g : gates) g.complete(Status::Ok());
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(reduces[static_cast<size_t>(r)].wait().ok());
    EXPECT_EQ(grads[static_cast<size_t>(r)][4095], 3.0f);
  }
  EXPECT_EQ(comms[0]->issued(CommQueue::kReduce), 1u);
  EXPECT_EQ(comms[0]->issued(CommQueue::kGather), 1u);
  EXPECT_EQ(comms[0]->issued(), 2u);
}

TEST(CommQueues, AGatherChainedOnAReduceOfTheOtherQueueSeesItsResult) {
  // The documented way to order across queues: gate one on the other's work.
  const int n = 3;
  auto comms = make_group(n);
  std::vector<std::vector<float>> buf(n, std::vector<float>(300));
  std::vector<std::vector<float>> out(n, std::vector<float>(300 * n, -1.0f));
  run_ranks(comms, [&](int r, Communicator& c) {
    auto& mine = buf[static_cast<size_t>(r)];
    std::fill(mine.begin(), mine.end(), static_cast<float>(r + 1));
    auto reduce = c.all_reduce(mine.data(), mine.data(), mine.size(), DType::kF32, ReduceOp::kMax);
    ASSERT_TRUE(reduce.ok());
    ASSERT_TRUE(c.wait(reduce->completion(), CommQueue::kGather).ok());
    auto gather = c.all_gather(mine.data(), out[static_cast<size_t>(r)].data(), mine.size(), DType::kF32,
                               CommQueue::kGather);
    ASSERT_TRUE(gather.ok());
    EXPECT_TRUE(gather->wait().ok());
    EXPECT_TRUE(reduce->done());
  });
  for (int r = 0; r < n; ++r) {
    for (float v : out[static_cast<size_t>(r)]) ASSERT_EQ(v, 3.0f) << "rank " << r;
  }
}

TEST(CommQueues, FailedGateFailsTheCollectiveOnEveryRankNamingIt) {
  const int n = 3;
  auto comms = make_group(n);
  std::vector<std::vector<Status>> results(n);
  std::vector<float> buf(n * 16, 1.0f);
  run_ranks(comms, [&](int r, Communicator& c) {
    auto& out = results[static_cast<size_t>(r)];
    float* mine = buf.data() + static_cast<size_t>(r) * 16;
    if (r == 1) {
      CompletionSource read("nvme read of 'layer3.swp' [0, 4096)");
      ASSERT_TRUE(c.wait(read.completion()).ok());
      read.complete(IoError("pread 'layer3.swp' at offset 0: EIO (injected)"));
    } else {
      ASSERT_TRUE(c.wait(Completion::ready(Status::Ok(), "nothing")).ok());
    }
    out.push_back(c.all_reduce(mine, mine, 16, DType::kF32)->wait());
    // The queue is failed from then on, on every rank (like a stream) ...
    out.push_back(c.barrier()->wait());
    // ... but the other queue is independent.
    out.push_back(c.barrier(CommQueue::kGather)->wait());
  });
  for (int r = 0; r < n; ++r) {
    const auto& out = results[static_cast<size_t>(r)];
    ASSERT_EQ(out.size(), 3u);
    const Status& s = out[0];
    EXPECT_EQ(s.code(), StatusCode::kIoError) << "rank " << r << ": " << s.to_string();
    EXPECT_TRUE(contains(s, "all_reduce #0 on local rank")) << s.message();
    EXPECT_TRUE(contains(s, "EIO (injected)")) << s.message();
    if (r == 1) {
      EXPECT_TRUE(contains(s, "gate 'nvme read of 'layer3.swp' [0, 4096)' on comm queue reduce failed")) << s.message();
    } else {
      EXPECT_TRUE(contains(s, "the gate of rank(s) 1 failed, so every rank skipped it")) << s.message();
    }
    EXPECT_FALSE(out[1].ok());
    EXPECT_TRUE(contains(out[1], "barrier #1")) << out[1].message();
    EXPECT_TRUE(out[2].ok()) << out[2].to_string();
  }
  EXPECT_FALSE(comms[0]->synchronize().ok());
  EXPECT_TRUE(comms[0]->synchronize(CommQueue::kGather).ok());
}

TEST(CommQueues, GatherEnqueuedAfterAComputeCompletionAndStreamGatedOnIt) {
  // Rank r "computes" its shard on a cpu-device stream; the all_gather is
  // gated on the stream's completion (no host wait), and a later stream
  // function is gated on the all_gather's completion.
  const int n = 3;
  auto comms = make_group(n);
  std::vector<std::vector<float>> shard(n, std::vector<float>(100, 0.0f));
  std::vector<std::vector<float>> full(n, std::vector<float>(100 * n, 0.0f));
  std::vector<float> seen(n, -1.0f);
  run_ranks(comms, [&](int r, Communicator& c) {
    auto device = make_device("cpu");
    ASSERT_TRUE(device.ok()) << device.status().to_string();
    auto stream = (*device)->create_stream();
    ASSERT_TRUE(stream.ok());
    auto& mine = shard[static_cast<size_t>(r)];
    auto& out = full[static_cast<size_t>(r)];
    ASSERT_TRUE((*stream)->launch_host([&mine, r] {
      std::this_thread::sleep_for(30ms);
      std::fill(mine.begin(), mine.end(), static_cast<float>(r + 1));
    }).ok());
    ASSERT_TRUE(c.wait((*stream)->record_completion(), CommQueue::kGather).ok());
    auto work = c.all_gather(mine.data(), out.data(), 100, DType::kF32, CommQueue::kGather);
    ASSERT_TRUE(work.ok());
    ASSERT_TRUE((*stream)->wait(work->completion()).ok());
    ASSERT_TRUE((*stream)->launch_host([&seen, &out, r] { seen[static_cast<size_t>(r)] = out[250]; }).ok());
    EXPECT_TRUE((*stream)->synchronize().ok());
    EXPECT_TRUE(work->wait().ok());
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(seen[static_cast<size_t>(r)], 3.0f) << "rank " << r;
}

TEST(CommQueues, StreamGatedOnAFailedCollectiveFailsWithItsStatus) {
  auto comms = make_group(2);
  std::vector<Status> stream_status(2);
  std::vector<float> buf(32, 1.0f);
  run_ranks(comms, [&](int r, Communicator& c) {
    auto device = make_device("cpu");
    ASSERT_TRUE(device.ok());
    auto stream = (*device)->create_stream();
    ASSERT_TRUE(stream.ok());
    float* mine = buf.data() + 16 * r;
    // Mismatched counts: the collective fails on both ranks.
    auto work = c.all_reduce(mine, mine, r == 0 ? 8 : 9, DType::kF32);
    ASSERT_TRUE(work.ok());
    ASSERT_TRUE(stream_wait(**stream, *work).ok());
    stream_status[static_cast<size_t>(r)] = (*stream)->synchronize();
  });
  for (const Status& s : stream_status) {
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(contains(s, "collective mismatch at #0")) << s.to_string();
  }
}

// A rank-order reference: ((x0 + x1) + x2) + ... in the element type.
template <typename T>
T rank_order(const std::vector<std::vector<T>>& in, size_t i, ReduceOp op) {
  T acc = in[0][i];
  for (size_t p = 1; p < in.size(); ++p) {
    if constexpr (std::is_same_v<T, int64_t>) {
      acc = op == ReduceOp::kMax ? std::max(acc, in[p][i])
                                 : static_cast<int64_t>(static_cast<uint64_t>(acc) + static_cast<uint64_t>(in[p][i]));
    } else {
      acc = op == ReduceOp::kMax ? std::max(acc, in[p][i]) : acc + in[p][i];
    }
  }
  if constexpr (std::is_same_v<T, double>) {
    if (op == ReduceOp::kAvg) acc /= static_cast<double>(in.size());
  }
  return acc;
}

template <typename T>
uint64_t bits_of(T v) {
  return std::bit_cast<uint64_t>(v);
}

class WideReductions : public ::testing::TestWithParam<int> {};

TEST_P(WideReductions, SumsAndMaxOfFp64AndInt64AreBitExactInRankOrder) {
  const int n = GetParam();
  auto comms = make_group(n);
  const size_t count = 1027;  // not a multiple of the world size or the tile
  std::mt19937_64 rng(static_cast<uint64_t>(n));
  std::uniform_real_distribution<double> mant(-1.0, 1.0);
  std::uniform_int_distribution<int> expo(-40, 40);
  // Norm-like partial sums: magnitudes far apart, so the order of the sum
  // shows in the bits; int64 counts near the limit, so the sum wraps.
  std::vector<std::vector<double>> d(n, std::vector<double>(count * n));
  std::vector<std::vector<int64_t>> q(n, std::vector<int64_t>(count * n));
  for (auto& v : d) for (double& x : v) x = std::ldexp(mant(rng), expo(rng));
  for (auto& v : q) for (int64_t& x : v) x = static_cast<int64_t>(rng());
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
    std::vector<std::vector<double>> ar_d(n, std::vector<double>(count * n));
    std::vector<std::vector<double>> rs_d(n, std::vector<double>(count));
    std::vector<std::vector<int64_t>> ar_q(n, std::vector<int64_t>(count * n));
    std::vector<std::vector<int64_t>> rs_q(n, std::vector<int64_t>(count));
    run_ranks(comms, [&](int r, Communicator& c) {
      const auto me = static_cast<size_t>(r);
      auto a = c.all_reduce(d[me].data(), ar_d[me].data(), count * n, DType::kF64, op);
      auto b = c.reduce_scatter(d[me].data(), rs_d[me].data(), count, DType::kF64, op);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_TRUE(a->wait().ok());
      EXPECT_TRUE(b->wait().ok());
      if (op == ReduceOp::kAvg) {
        auto bad = c.all_reduce(q[me].data(), ar_q[me].data(), count, DType::kI64, ReduceOp::kAvg);
        EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
        EXPECT_TRUE(contains(bad.status(), "avg of int64 is not defined")) << bad.status().to_string();
        return;
      }
      // int64 on the other queue, in place.
      std::copy(q[me].begin(), q[me].end(), ar_q[me].begin());
      auto e = c.all_reduce(ar_q[me].data(), ar_q[me].data(), count * n, DType::kI64, op, CommQueue::kGather);
      auto f = c.reduce_scatter(q[me].data(), rs_q[me].data(), count, DType::kI64, op, CommQueue::kGather);
      ASSERT_TRUE(e.ok() && f.ok());
      EXPECT_TRUE(e->wait().ok());
      EXPECT_TRUE(f->wait().ok());
    });
    for (int r = 0; r < n; ++r) {
      const auto me = static_cast<size_t>(r);
      for (size_t i = 0; i < count * n; ++i) {
        ASSERT_EQ(bits_of(ar_d[me][i]), bits_of(rank_order(d, i, op)))
            << "fp64 all_reduce " << reduce_op_name(op) << " rank " << r << " i " << i;
      }
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(bits_of(rs_d[me][i]), bits_of(rank_order(d, me * count + i, op)))
            << "fp64 reduce_scatter " << reduce_op_name(op) << " rank " << r << " i " << i;
      }
      if (op == ReduceOp::kAvg) continue;
      for (size_t i = 0; i < count * n; ++i) ASSERT_EQ(ar_q[me][i], rank_order(q, i, op)) << "rank " << r;
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(rs_q[me][i], rank_order(q, me * count + i, op)) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, WideReductions, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return std::to_string(info.param); });

TEST(CommQueues, TwoThreadsPerRankIssueOnTheTwoQueuesConcurrently) {
  // The engine's shape: a prefetch thread gathers while a backward thread
  // reduces, on the same communicator. Run under TSan (see docs/comm.md).
  const int n = 2;
  constexpr int kRounds = 40;
  constexpr size_t kCount = 512;
  auto comms = make_group(n);
  std::vector<std::vector<float>> grads(n, std::vector<float>(kCount));
  std::vector<std::vector<float>> shards(n, std::vector<float>(kCount));
  std::vector<std::vector<float>> gathered(n, std::vector<float>(kCount * n));
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    Communicator& c = *comms[static_cast<size_t>(r)];
    auto& g = grads[static_cast<size_t>(r)];
    auto& sh = shards[static_cast<size_t>(r)];
    auto& out = gathered[static_cast<size_t>(r)];
    threads.emplace_back([&, r] {
      for (int i = 0; i < kRounds; ++i) {
        std::fill(g.begin(), g.end(), static_cast<float>(r + i));
        auto w = c.all_reduce(g.data(), g.data(), kCount, DType::kF32, ReduceOp::kSum, CommQueue::kReduce);
        if (!w.ok() || !w->wait().ok() || g[kCount - 1] != static_cast<float>(2 * i + 1)) ++wrong;
      }
    });
    threads.emplace_back([&, r] {
      for (int i = 0; i < kRounds; ++i) {
        std::fill(sh.begin(), sh.end(), static_cast<float>(100 * r + i));
        auto w = c.all_gather(sh.data(), out.data(), kCount, DType::kF32, CommQueue::kGather);
        if (!w.ok() || !w->wait().ok() || out[0] != static_cast<float>(i) ||
            out[kCount] != static_cast<float>(100 + i)) {
          ++wrong;
        }
        if (i % 8 == 0) (void)c.issued();  // readers race with issuers too
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  for (auto& c : comms) {
    EXPECT_EQ(c->issued(CommQueue::kReduce), static_cast<uint64_t>(kRounds));
    EXPECT_EQ(c->issued(CommQueue::kGather), static_cast<uint64_t>(kRounds));
    EXPECT_TRUE(c->synchronize().ok());
  }
}

// Note [Idle queues of one rank]: a one-rank group's collective issued on an
// idle queue is complete on return; one issued behind a pending gate waits
// for it, in order.
TEST(CommQueues, OneRankRunsACollectiveInlineOnlyOnAnIdleQueue) {
  auto comms = make_group(1);
  Communicator& c = *comms[0];
  std::vector<float> send{1, 2, 3, 4}, recv(4, 0);
  auto first = c.all_reduce(send.data(), recv.data(), send.size(), DType::kF32, ReduceOp::kSum);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_TRUE(first->completion().done());
  EXPECT_EQ(recv, send);
  ASSERT_TRUE(c.wait(Completion(), CommQueue::kReduce).ok());  // a gate on completed work is not queued

  CompletionSource gate("the test's gate");
  ASSERT_TRUE(c.wait(gate.completion(), CommQueue::kReduce).ok());
  std::vector<float> later{5, 6, 7, 8}, got(4, 0);
  auto second = c.all_reduce(later.data(), got.data(), later.size(), DType::kF32, ReduceOp::kSum);
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  EXPECT_FALSE(second->completion().done());  // behind the pending gate
  EXPECT_EQ(got, std::vector<float>(4, 0));
  gate.complete(Status::Ok());
  ASSERT_TRUE(second->wait().ok());
  EXPECT_EQ(got, later);
}

TEST(CommQueues, QueueNamesParse) {
  EXPECT_EQ(*parse_queue("gather"), CommQueue::kGather);
  EXPECT_EQ(queue_name(CommQueue::kReduce), "reduce");
  auto bad = parse_queue("prefetch", "--queue");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(bad.status(), "--queue: unknown comm queue 'prefetch'; choose reduce, gather or update"));
  auto comms = make_group(1);
  EXPECT_EQ(comms[0]->barrier(static_cast<CommQueue>(7)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(comms[0]->wait(Completion(), static_cast<CommQueue>(7)).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::comm
