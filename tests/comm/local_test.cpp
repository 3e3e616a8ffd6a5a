// The local backend: conformance for 1-8 ranks, watchdog, mismatch
// detection, validation, asynchrony. Each rank runs on its own thread.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

#include "conformance.h"
#include "strata/comm/backends.h"
#include "strata/comm/pattern.h"
#include "strata/comm/shard.h"
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

// Runs body(rank, comm) on one thread per rank.
void run_ranks(std::vector<std::unique_ptr<Communicator>>& comms,
               const std::function<void(int, Communicator&)>& body) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r) {
    threads.emplace_back([&, r] { body(static_cast<int>(r), *comms[r]); });
  }
  for (auto& t : threads) t.join();
}

class LocalConformance : public ::testing::TestWithParam<int> {};

TEST_P(LocalConformance, EveryOpDtypeSizeAndPlacement) {
  const int n = GetParam();
  auto comms = make_group(n);
  std::vector<std::vector<std::string>> failures(static_cast<size_t>(n));
  run_ranks(comms, [&](int r, Communicator& c) { failures[static_cast<size_t>(r)] = testing::run_conformance(c); });
  for (int r = 0; r < n; ++r) {
    for (const std::string& f : failures[static_cast<size_t>(r)]) ADD_FAILURE() << f;
  }
  EXPECT_EQ(comms[0]->issued(), comms[static_cast<size_t>(n - 1)]->issued());
}

INSTANTIATE_TEST_SUITE_P(Ranks, LocalConformance, ::testing::Range(1, 9),
                         [](const ::testing::TestParamInfo<int>& info) { return std::to_string(info.param); });

TEST(LocalComm, WatchdogNamesTheRankThatNeverCalls) {
  auto comms = make_group(3, 2000ms);  // long enough for a late thread start under TSan on 2 cores
  std::vector<Status> results(3);
  std::vector<float> bufs(3 * 1000, 1.0f);
  run_ranks(comms, [&](int r, Communicator& c) {
    if (r == 2) return;  // never calls
    auto work = c.all_reduce(&bufs[static_cast<size_t>(r) * 1000], &bufs[static_cast<size_t>(r) * 1000], 1000,
                             DType::kF32, ReduceOp::kSum);
    ASSERT_TRUE(work.ok());
    results[static_cast<size_t>(r)] = work->wait();
  });
  for (int r = 0; r < 2; ++r) {
    const Status& s = results[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
    EXPECT_NE(s.message().find("all_reduce #0"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("4000 B"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("ranks that did not arrive: 2"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("rank 2 has issued no collective yet"), std::string::npos) << s.message();
  }
  // The group is unusable now, and says why, on the late rank too.
  auto late = comms[2]->barrier();
  ASSERT_TRUE(late.ok());
  Status s = late->wait();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("ranks that did not arrive: 2"), std::string::npos) << s.message();
}

TEST(LocalComm, WatchdogNamesWhatALaggingRankIsDoing) {
  auto comms = make_group(4, 2000ms);
  std::vector<Status> results(4);
  std::vector<float> buf(4 * 16, 0.0f);
  run_ranks(comms, [&](int r, Communicator& c) {
    // Ranks 1 and 3 stop after the first barrier.
    Status first = c.barrier()->wait();
    EXPECT_TRUE(first.ok()) << first.to_string();
    if (r == 1 || r == 3) return;
    results[static_cast<size_t>(r)] = c.all_gather(&buf[static_cast<size_t>(r) * 16], buf.data() + 0, 0,
                                                   DType::kBF16)->wait();
  });
  for (int r : {0, 2}) {
    const Status& s = results[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
    EXPECT_NE(s.message().find("all_gather #1"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("did not arrive: 1, 3"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("rank 1 last entered barrier #0"), std::string::npos) << s.message();
  }
}

TEST(LocalComm, MismatchedCollectivesFailWithBothDescriptions) {
  auto comms = make_group(2);
  std::vector<Status> results(2);
  std::vector<float> send(8, 1.0f);
  std::vector<float> recv(16, 0.0f);
  run_ranks(comms, [&](int r, Communicator& c) {
    if (r == 0) {
      results[0] = c.all_reduce(send.data(), recv.data(), 8, DType::kF32, ReduceOp::kSum)->wait();
    } else {
      results[1] = c.all_gather(send.data(), recv.data() + 0, 8, DType::kF32)->wait();
    }
  });
  for (const Status& s : results) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
    EXPECT_NE(s.message().find("collective mismatch at #0"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("all_reduce(sum, fp32, count 8"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("rank 1 issued all_gather(fp32, send_count 8"), std::string::npos) << s.message();
  }
}

TEST(LocalComm, MismatchedCountIsDetected) {
  auto comms = make_group(3);
  std::vector<Status> results(3);
  std::vector<std::vector<uint16_t>> bufs(3, std::vector<uint16_t>(64));
  run_ranks(comms, [&](int r, Communicator& c) {
    const size_t count = r == 1 ? 33 : 32;
    results[static_cast<size_t>(r)] =
        c.all_reduce(bufs[static_cast<size_t>(r)].data(), bufs[static_cast<size_t>(r)].data(), count, DType::kBF16,
                     ReduceOp::kMax)->wait();
  });
  for (const Status& s : results) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("count 33"), std::string::npos) << s.message();
  }
}

TEST(LocalComm, DestroyedRankFailsPeersFast) {
  auto comms = make_group(2, 60s);
  comms[1].reset();
  float x = 1.0f;
  const auto start = std::chrono::steady_clock::now();
  Status s = comms[0]->all_reduce(&x, &x, 1, DType::kF32)->wait();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("rank 1 destroyed its communicator"), std::string::npos) << s.message();
}

TEST(LocalComm, InvalidArgumentsAreRejectedBeforeQueueing) {
  auto comms = make_group(2);
  Communicator& c = *comms[0];
  std::vector<float> buf(64);
  auto null_recv = c.all_reduce(buf.data(), nullptr, 4, DType::kF32);
  EXPECT_EQ(null_recv.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(null_recv.status().message().find("recv is null"), std::string::npos);
  auto bad_root = c.broadcast(buf.data(), buf.data(), 4, DType::kF32, 2);
  EXPECT_EQ(bad_root.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_root.status().message().find("root 2 is not a rank (world size 2)"), std::string::npos);
  // Overlapping, but not in the in-place position.
  auto overlap = c.all_reduce(buf.data(), buf.data() + 1, 8, DType::kF32);
  EXPECT_EQ(overlap.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(overlap.status().message().find("overlap"), std::string::npos);
  auto gather_overlap = c.all_gather(buf.data() + 4, buf.data(), 8, DType::kF32);  // rank 0 in place is buf+0
  EXPECT_EQ(gather_overlap.status().code(), StatusCode::kInvalidArgument);
  auto rs_overlap = c.reduce_scatter(buf.data(), buf.data() + 3, 8, DType::kF32);
  EXPECT_EQ(rs_overlap.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.issued(), 0u);  // nothing was queued
  // Zero counts need no buffers.
  std::thread peer([&] { EXPECT_TRUE(comms[1]->all_reduce(nullptr, nullptr, 0, DType::kF16)->wait().ok()); });
  EXPECT_TRUE(c.all_reduce(nullptr, nullptr, 0, DType::kF16)->wait().ok());
  peer.join();
  EXPECT_EQ(create_local_group(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(create_local_group(2000).status().message().find("world size 2000"), std::string::npos);
}

TEST(LocalComm, CollectivesAreAsynchronousAndOrdered) {
  const int n = 4;
  auto comms = make_group(n);
  constexpr size_t kCount = 1 << 16;
  std::vector<std::vector<float>> data(n, std::vector<float>(kCount));
  std::vector<std::vector<float>> gathered(n, std::vector<float>(kCount * n));
  run_ranks(comms, [&](int r, Communicator& c) {
    auto& mine = data[static_cast<size_t>(r)];
    for (size_t i = 0; i < kCount; ++i) mine[i] = static_cast<float>(r + 1);
    // Queue several without waiting: all_reduce in place, then all_gather of
    // the reduced data (ordered after it), then a barrier.
    auto w0 = c.all_reduce(mine.data(), mine.data(), kCount, DType::kF32, ReduceOp::kSum);
    auto w1 = c.all_gather(mine.data(), gathered[static_cast<size_t>(r)].data(), kCount, DType::kF32);
    auto w2 = c.barrier();
    ASSERT_TRUE(w0.ok() && w1.ok() && w2.ok());
    EXPECT_EQ(w0->sequence(), 0u);
    EXPECT_EQ(w1->sequence(), 1u);
    EXPECT_EQ(w2->sequence(), 2u);
    // "Compute" while they run, then wait in reverse order.
    volatile double acc = 0;
    for (int i = 0; i < 10000; ++i) acc = acc + i;
    EXPECT_TRUE(w2->wait().ok());
    EXPECT_TRUE(w1->done());  // ordered: completed before the barrier did
    EXPECT_TRUE(w0->done());
    EXPECT_TRUE(c.synchronize().ok());
  });
  const float expected = n * (n + 1) / 2.0f;
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < kCount * n; i += 4097) ASSERT_EQ(gathered[static_cast<size_t>(r)][i], expected);
  }
}

TEST(LocalComm, CollectivesOrderWithDeviceStreams) {
  // Rank r's "gradient" is produced by a host function on a cpu-device
  // stream; the all_reduce waits for its event, and a later stream function
  // waits for the all_reduce.
  const int n = 3;
  auto comms = make_group(n);
  std::vector<std::vector<float>> grad(n, std::vector<float>(1000, 0.0f));
  std::vector<float> seen(n, -1.0f);
  run_ranks(comms, [&](int r, Communicator& c) {
    auto device = make_device("cpu");
    ASSERT_TRUE(device.ok()) << device.status().to_string();
    auto stream = (*device)->create_stream();
    auto event = (*device)->create_event();
    ASSERT_TRUE(stream.ok() && event.ok());
    auto& g = grad[static_cast<size_t>(r)];
    ASSERT_TRUE((*stream)->launch_host([&g, r] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      std::fill(g.begin(), g.end(), static_cast<float>(r + 1));
    }).ok());
    ASSERT_TRUE((*stream)->record(**event).ok());
    ASSERT_TRUE(c.wait_event(**event).ok());
    auto work = c.all_reduce(g.data(), g.data(), g.size(), DType::kF32, ReduceOp::kSum);
    ASSERT_TRUE(work.ok());
    ASSERT_TRUE(stream_wait(**stream, *work).ok());
    ASSERT_TRUE((*stream)->launch_host([&seen, &g, r] { seen[static_cast<size_t>(r)] = g[999]; }).ok());
    ASSERT_TRUE((*stream)->synchronize().ok());
    EXPECT_TRUE(work->wait().ok());
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(seen[static_cast<size_t>(r)], 6.0f) << "rank " << r;
}

TEST(LocalComm, ReduceScatterOfPaddedShardsFollowsShardHelpers) {
  // A 10-element gradient on 4 ranks: shards of 3, padded to 12.
  EXPECT_EQ(shard_count(10, 4), 3u);
  EXPECT_EQ(padded_count(10, 4), 12u);
  EXPECT_EQ(shard_offset(10, 4, 3), 9u);
  EXPECT_EQ(shard_valid_count(10, 4, 3), 1u);
  EXPECT_EQ(shard_valid_count(2, 4, 3), 0u);
  EXPECT_EQ(shard_count(0, 4), 0u);
  auto comms = make_group(4);
  std::vector<std::vector<float>> grads(4, std::vector<float>(12, 0.0f));
  std::vector<std::vector<float>> shards(4, std::vector<float>(3, -1.0f));
  run_ranks(comms, [&](int r, Communicator& c) {
    for (size_t i = 0; i < 10; ++i) grads[static_cast<size_t>(r)][i] = static_cast<float>(i);
    EXPECT_TRUE(c.reduce_scatter(grads[static_cast<size_t>(r)].data(), shards[static_cast<size_t>(r)].data(),
                                 shard_count(10, 4), DType::kF32, ReduceOp::kAvg)->wait().ok());
  });
  for (int r = 0; r < 4; ++r) {
    for (size_t i = 0; i < 3; ++i) {
      const size_t global = shard_offset(10, 4, r) + i;
      EXPECT_EQ(shards[static_cast<size_t>(r)][i], global < 10 ? static_cast<float>(global) : 0.0f);
    }
  }
}

TEST(LocalComm, EnvironmentOverridesAreParsedStrictly) {
  setenv("STRATA_COMM_TIMEOUT_MS", "1500", 1);
  setenv("STRATA_COMM_DEBUG", "0", 1);
  auto ok = apply_comm_environment({});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->timeout.count(), 1500);
  EXPECT_FALSE(ok->debug_checks);
  setenv("STRATA_COMM_TIMEOUT_MS", "5s", 1);
  auto bad = apply_comm_environment({});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("STRATA_COMM_TIMEOUT_MS='5s'"), std::string::npos);
  // Beyond 30 days the deadline would overflow the clock (9e15 ms failed at once).
  setenv("STRATA_COMM_TIMEOUT_MS", "9000000000000000", 1);
  EXPECT_EQ(apply_comm_environment({}).status().code(), StatusCode::kInvalidArgument);
  setenv("STRATA_COMM_TIMEOUT_MS", "99999999999999999999", 1);  // ERANGE, not a saturated value
  EXPECT_EQ(apply_comm_environment({}).status().code(), StatusCode::kInvalidArgument);
  unsetenv("STRATA_COMM_TIMEOUT_MS");
  setenv("STRATA_COMM_DEBUG", "maybe", 1);
  EXPECT_EQ(apply_comm_environment({}).status().code(), StatusCode::kInvalidArgument);
  unsetenv("STRATA_COMM_DEBUG");
}

TEST(LocalComm, WatchdogTimeoutsBeyondThirtyDaysAreRefused) {
  CommOptions options;
  options.timeout = std::chrono::milliseconds(9'000'000'000'000'000LL);
  auto group = create_local_group(2, options);
  ASSERT_FALSE(group.ok());
  EXPECT_NE(group.status().message().find("out of range"), std::string::npos) << group.status().message();
  options.timeout = kMaxCommTimeout;
  EXPECT_TRUE(create_local_group(2, options).ok());
}

TEST(LocalComm, NamesParseAndRejectUnknownValues) {
  EXPECT_EQ(*parse_backend("mpi"), Backend::kMpi);
  EXPECT_EQ(*parse_op("reduce_scatter"), CollectiveOp::kReduceScatter);
  EXPECT_EQ(*parse_reduce_op("avg"), ReduceOp::kAvg);
  auto bad = parse_backend("gloo", "--backend");
  EXPECT_NE(bad.status().message().find("--backend: unknown backend 'gloo'; choose local, mpi or nccl"),
            std::string::npos);
  EXPECT_FALSE(parse_op("allreduce").ok());
  EXPECT_FALSE(parse_reduce_op("min").ok());
}

TEST(LocalComm, PatternCheckerCountsEveryWrongElement) {
  CollectiveDesc d;
  d.op = CollectiveOp::kAllReduce;
  d.dtype = DType::kBF16;
  d.count = 100;
  std::vector<uint16_t> recv(100);
  for (size_t i = 0; i < 100; ++i) recv[i] = static_cast<uint16_t>(expected_bits(d, 0, 3, i));
  size_t first = 0;
  EXPECT_EQ(count_wrong(d, 0, 3, recv.data(), &first), 0u);
  recv[17] ^= 1;
  recv[90] ^= 0x8000;
  EXPECT_EQ(count_wrong(d, 0, 3, recv.data(), &first), 2u);
  EXPECT_EQ(first, 17u);
}

}  // namespace
}  // namespace strata::comm
