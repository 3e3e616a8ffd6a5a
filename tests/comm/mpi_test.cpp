// The mpi backend, run by ctest under `mpirun -np 2` and `-np 4` (one rank
// per process). Every rank runs every test in the same order.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "conformance.h"
#include "strata/comm/backends.h"

namespace strata::comm {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<Communicator> make_comm(std::chrono::milliseconds timeout = 20s) {
  CommOptions opts;
  opts.timeout = timeout;
  auto comm = create_mpi_communicator(opts);
  EXPECT_TRUE(comm.ok()) << comm.status().to_string();
  return comm.ok() ? std::move(comm).value() : nullptr;
}

TEST(MpiComm, EveryOpDtypeSizeAndPlacement) {
  auto comm = make_comm();
  ASSERT_NE(comm, nullptr);
  EXPECT_GE(comm->world_size(), 1);
  for (const std::string& f : testing::run_conformance(*comm)) ADD_FAILURE() << f;
  EXPECT_TRUE(comm->barrier()->wait().ok());
}

TEST(MpiComm, AsynchronousOpsOverlapAndStayOrdered) {
  auto comm = make_comm();
  ASSERT_NE(comm, nullptr);
  const int n = comm->world_size();
  constexpr size_t kCount = 1 << 15;
  std::vector<float> mine(kCount, static_cast<float>(comm->rank() + 1));
  std::vector<float> gathered(kCount * static_cast<size_t>(n));
  auto w0 = comm->all_reduce(mine.data(), mine.data(), kCount, DType::kF32, ReduceOp::kMax);
  auto w1 = comm->all_gather(mine.data(), gathered.data(), kCount, DType::kF32);
  ASSERT_TRUE(w0.ok() && w1.ok());
  EXPECT_TRUE(w1->wait().ok());
  EXPECT_TRUE(w0->done());
  for (size_t i = 0; i < gathered.size(); i += 1009) ASSERT_EQ(gathered[i], static_cast<float>(n));
}

TEST(MpiComm, MismatchedCollectivesFailOnEveryRank) {
  auto comm = make_comm();
  ASSERT_NE(comm, nullptr);
  if (comm->world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<float> send(8, 1.0f);
  std::vector<float> recv(8 * static_cast<size_t>(comm->world_size()));
  Status s = comm->rank() == 0 ? comm->all_gather(send.data(), recv.data(), 8, DType::kF32)->wait()
                               : comm->all_reduce(send.data(), recv.data(), 8, DType::kF32)->wait();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
  EXPECT_NE(s.message().find("collective mismatch at #0 on mpi"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("all_gather(fp32, send_count 8"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("all_reduce(sum, fp32, count 8"), std::string::npos) << s.message();
  // Poisoned: later collectives fail fast.
  Status later = comm->barrier()->wait();
  EXPECT_EQ(later.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(later.message().find("unusable after an earlier failure"), std::string::npos) << later.message();
  // A fresh communicator works.
  auto fresh = make_comm();
  ASSERT_NE(fresh, nullptr);
  EXPECT_TRUE(fresh->barrier()->wait().ok());
}

TEST(MpiComm, WatchdogNamesTheRankThatNeverCalls) {
  // 2 s: oversubscribed ranks (TSan, 4 processes on 2 cores) that called a
  // moment late must not be named as missing.
  auto comm = make_comm(2000ms);
  auto sync = make_comm();  // lines the ranks up before the call and afterwards
  ASSERT_NE(comm, nullptr);
  ASSERT_NE(sync, nullptr);
  if (comm->world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int missing = comm->world_size() - 1;
  EXPECT_TRUE(sync->barrier()->wait().ok());
  if (comm->rank() != missing) {
    std::vector<float> buf(1000, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    Status s = comm->all_reduce(buf.data(), buf.data(), 1000, DType::kF32)->wait();
    EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
    EXPECT_NE(s.message().find("all_reduce #0 (4000 B)"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(fmt::format("ranks that did not arrive: {}", missing)), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find(fmt::format("rank {} has not issued #0", missing)), std::string::npos) << s.message();
  }
  EXPECT_TRUE(sync->barrier()->wait().ok());
}

// Rank p's inputs, computable on every rank: norm-like partial sums of far
// apart magnitudes (the sum's bits depend on its order) and int64 counts
// that overflow (the sum wraps).
std::vector<double> fp64_input(int rank, size_t count) {
  std::mt19937_64 rng(1000 + static_cast<uint64_t>(rank));
  std::uniform_real_distribution<double> mant(-1.0, 1.0);
  std::uniform_int_distribution<int> expo(-40, 40);
  std::vector<double> v(count);
  for (double& x : v) x = std::ldexp(mant(rng), expo(rng));
  return v;
}
std::vector<int64_t> int64_input(int rank, size_t count) {
  std::mt19937_64 rng(2000 + static_cast<uint64_t>(rank));
  std::vector<int64_t> v(count);
  for (int64_t& x : v) x = static_cast<int64_t>(rng());
  return v;
}

TEST(MpiComm, Fp64AndInt64SumsAndMaxAreBitExactInRankOrder) {
  auto comm = make_comm();
  ASSERT_NE(comm, nullptr);
  const int n = comm->world_size();
  const int me = comm->rank();
  const size_t count = 1027;
  const size_t total = count * static_cast<size_t>(n);
  std::vector<std::vector<double>> d;
  std::vector<std::vector<int64_t>> q;
  for (int p = 0; p < n; ++p) {
    d.push_back(fp64_input(p, total));
    q.push_back(int64_input(p, total));
  }
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
    std::vector<double> ar(total), rs(count);
    auto a = comm->all_reduce(d[static_cast<size_t>(me)].data(), ar.data(), total, DType::kF64, op);
    auto b = comm->reduce_scatter(d[static_cast<size_t>(me)].data(), rs.data(), count, DType::kF64, op,
                                  CommQueue::kGather);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_TRUE(a->wait().ok()) << a->wait().to_string();
    ASSERT_TRUE(b->wait().ok()) << b->wait().to_string();
    auto ref = [&](size_t i) {
      double acc = d[0][i];
      for (int p = 1; p < n; ++p) acc = op == ReduceOp::kMax ? std::max(acc, d[static_cast<size_t>(p)][i])
                                                             : acc + d[static_cast<size_t>(p)][i];
      return op == ReduceOp::kAvg ? acc / n : acc;
    };
    for (size_t i = 0; i < total; ++i) {
      ASSERT_EQ(std::bit_cast<uint64_t>(ar[i]), std::bit_cast<uint64_t>(ref(i))) << reduce_op_name(op) << " " << i;
    }
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(std::bit_cast<uint64_t>(rs[i]), std::bit_cast<uint64_t>(ref(static_cast<size_t>(me) * count + i)));
    }
    if (op == ReduceOp::kAvg) continue;
    std::vector<int64_t> qar = q[static_cast<size_t>(me)];  // in place
    std::vector<int64_t> qrs(count);
    auto e = comm->all_reduce(qar.data(), qar.data(), total, DType::kI64, op);
    auto f = comm->reduce_scatter(q[static_cast<size_t>(me)].data(), qrs.data(), count, DType::kI64, op);
    ASSERT_TRUE(e.ok() && f.ok());
    ASSERT_TRUE(f->wait().ok());
    ASSERT_TRUE(e->wait().ok());
    auto qref = [&](size_t i) {
      uint64_t sum = static_cast<uint64_t>(q[0][i]);
      int64_t mx = q[0][i];
      for (int p = 1; p < n; ++p) {
        sum += static_cast<uint64_t>(q[static_cast<size_t>(p)][i]);
        mx = std::max(mx, q[static_cast<size_t>(p)][i]);
      }
      return op == ReduceOp::kMax ? mx : static_cast<int64_t>(sum);
    };
    for (size_t i = 0; i < total; ++i) ASSERT_EQ(qar[i], qref(i)) << i;
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(qrs[i], qref(static_cast<size_t>(me) * count + i)) << i;
  }
}

TEST(MpiComm, GatedReduceQueueDoesNotHoldTheGatherQueue) {
  auto comm = make_comm();
  ASSERT_NE(comm, nullptr);
  const int n = comm->world_size();
  CompletionSource gate("gradients of layer 0");
  std::vector<float> grad(256, static_cast<float>(comm->rank() + 1));
  std::vector<float> shard(64, static_cast<float>(comm->rank()));
  std::vector<float> full(64 * static_cast<size_t>(n));
  ASSERT_TRUE(comm->wait(gate.completion(), CommQueue::kReduce).ok());
  auto reduce = comm->all_reduce(grad.data(), grad.data(), grad.size(), DType::kF32);
  auto gather = comm->all_gather(shard.data(), full.data(), 64, DType::kF32, CommQueue::kGather);
  ASSERT_TRUE(reduce.ok() && gather.ok());
  EXPECT_TRUE(gather->wait().ok());
  EXPECT_FALSE(reduce->done());
  for (int p = 0; p < n; ++p) EXPECT_EQ(full[static_cast<size_t>(p) * 64], static_cast<float>(p));
  gate.complete(Status::Ok());
  EXPECT_TRUE(reduce->wait().ok());
  EXPECT_EQ(grad[255], static_cast<float>(n * (n + 1) / 2));
}

TEST(MpiComm, FailedGateIsVotedSoEveryRankSkipsTheCollective) {
  auto comm = make_comm();
  ASSERT_NE(comm, nullptr);
  if (comm->world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<float> buf(16, 1.0f);
  CompletionSource read("nvme read of 'layer0.swp' [0, 64)");
  if (comm->rank() == 1) {
    ASSERT_TRUE(comm->wait(read.completion()).ok());
    read.complete(IoError("pread 'layer0.swp' at offset 0: EIO (injected)"));
  } else {
    read.complete(Status::Ok());
  }
  Status s = comm->all_reduce(buf.data(), buf.data(), 16, DType::kF32)->wait();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("all_reduce #0 ("), std::string::npos) << s.message();
  if (comm->rank() == 1) {
    EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
    EXPECT_NE(s.message().find("EIO (injected)"), std::string::npos) << s.message();
  } else {
    EXPECT_NE(s.message().find("the gate of rank(s) 1 failed, so every rank skipped it"), std::string::npos)
        << s.message();
  }
  EXPECT_EQ(buf[0], 1.0f);  // no data moved
  // The reduce queue is failed on every rank; the gather queue is not.
  EXPECT_FALSE(comm->barrier()->wait().ok());
  EXPECT_TRUE(comm->barrier(CommQueue::kGather)->wait().ok());
}

}  // namespace
}  // namespace strata::comm
