// The mpi backend, run by ctest under `mpirun -np 2` and `-np 4` (one rank
// per process). Every rank runs every test in the same order.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
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
  auto comm = make_comm(300ms);
  auto sync = make_comm();  // to line the ranks up again afterwards
  ASSERT_NE(comm, nullptr);
  ASSERT_NE(sync, nullptr);
  if (comm->world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int missing = comm->world_size() - 1;
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

}  // namespace
}  // namespace strata::comm
