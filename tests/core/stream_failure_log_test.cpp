// The cuda device's failure bookkeeping (core/src/stream_failure_log.h), on
// its own: a stream's failures by op number, and those it takes over from
// the streams it waited on through events (Note [Failures across event
// waits]). The cuda device cannot run without a GPU; this logic can.
#include <gtest/gtest.h>

#include <memory>
#include <thread>
#include <vector>

#include "stream_failure_log.h"

namespace strata::detail {
namespace {

std::shared_ptr<StreamFailureLog> new_log() { return std::make_shared<StreamFailureLog>(); }

TEST(StreamFailureLog, AFailureCountsFromItsOpOn) {
  auto log = new_log();
  log->fail(5, IoError("kernel failed"));
  log->fail(9, IoError("a later failure is not the first"));
  EXPECT_TRUE(log->failure_up_to(4).ok());
  EXPECT_EQ(log->failure_up_to(5).message(), "kernel failed");
  EXPECT_EQ(log->failure_up_to(100).message(), "kernel failed");
  log->fail(2, IoError("an earlier one, reported late"));
  EXPECT_EQ(log->failure_up_to(5).message(), "an earlier one, reported late");
}

TEST(StreamFailureLog, AWaitCarriesTheFailuresBeforeTheEventFromTheWaitOn) {
  auto recorder = new_log(), waiter = new_log();
  recorder->fail(1, IoError("copy failed"));
  waiter->link(/*from_op=*/3, recorder, /*source_op=*/2);  // the event was recorded after op 2
  EXPECT_TRUE(waiter->failure_up_to(2).ok()) << "work before the wait does not depend on the event";
  const Status st = waiter->failure_up_to(3);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("copy failed"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("stream waited on an event recorded after a failure"), std::string::npos)
      << st.message();
}

TEST(StreamFailureLog, AFailureAfterTheEventIsNotTheWaitersConcern) {
  auto recorder = new_log(), waiter = new_log();
  waiter->link(3, recorder, 2);
  recorder->fail(4, IoError("after the event"));
  EXPECT_TRUE(waiter->failure_up_to(100).ok());
}

TEST(StreamFailureLog, FailuresTravelAlongAChainOfWaits) {
  auto a = new_log(), b = new_log(), c = new_log();
  a->fail(1, IoError("a failed"));
  b->link(2, a, 1);  // b waits on a's event after op 1
  c->link(5, b, 3);  // c waits on b's event after op 3 (after b's wait)
  EXPECT_NE(c->failure_up_to(5).message().find("a failed"), std::string::npos);
  EXPECT_TRUE(c->failure_up_to(4).ok());
}

TEST(StreamFailureLog, TheEarliestFailureWinsBetweenItsOwnAndAWaitedOne) {
  auto recorder = new_log(), waiter = new_log();
  recorder->fail(1, IoError("waited"));
  waiter->link(3, recorder, 1);
  waiter->fail(7, IoError("own"));
  EXPECT_NE(waiter->failure_up_to(10).message().find("waited"), std::string::npos);
  auto other = new_log(), late_waiter = new_log();
  other->fail(1, IoError("waited"));
  late_waiter->fail(2, IoError("own"));
  late_waiter->link(3, other, 1);
  EXPECT_EQ(late_waiter->failure_up_to(10).message(), "own");
}

TEST(StreamFailureLog, StreamsThatWaitOnEachOthersEventsEndTheirWalk) {
  // a records an event after op 1; b waits on it at its op 2 and records an
  // event after op 2; a waits on that at its op 3 (op numbers grow with issue
  // time, so each step of the walk looks at earlier work).
  auto a = new_log(), b = new_log();
  b->link(2, a, 1);
  a->link(3, b, 2);
  EXPECT_TRUE(a->failure_up_to(UINT64_MAX).ok());
  EXPECT_TRUE(b->failure_up_to(UINT64_MAX).ok());
  a->fail(1, IoError("a's first op"));
  EXPECT_NE(b->failure_up_to(2).message().find("a's first op"), std::string::npos);
  EXPECT_EQ(a->failure_up_to(3).message(), "a's first op");
  // Each holds the other: settled (as a destroyed cuda stream's log is), the cycle is gone.
  a->settle_up_to(UINT64_MAX);
  b->settle_up_to(UINT64_MAX);
  EXPECT_TRUE(a->links.empty());
  EXPECT_TRUE(b->links.empty());
}

TEST(StreamFailureLog, SettlingMakesWaitedFailuresOwnAndDropsThoseLinksOnly) {
  auto recorder = new_log(), quiet = new_log(), waiter = new_log();
  recorder->fail(1, IoError("copy failed"));
  waiter->link(2, quiet, 5);
  waiter->link(3, recorder, 1);
  waiter->link(8, recorder, 1);  // a wait the stream has not passed yet
  waiter->settle_up_to(4);
  ASSERT_EQ(waiter->links.size(), 1u) << "only the link past op 4 stays";
  EXPECT_EQ(waiter->links.front().from_op, 8u);
  EXPECT_EQ(waiter->failed_at, 3u) << "the failure became the waiter's own, at its wait";
  EXPECT_NE(waiter->failure_up_to(3).message().find("copy failed"), std::string::npos);
  waiter->settle_up_to(UINT64_MAX);
  EXPECT_TRUE(waiter->links.empty());
}

TEST(StreamFailureLog, ReadersNeverMissAFailureWhileItIsSettled) {
  auto recorder = new_log(), waiter = new_log();
  recorder->fail(1, IoError("copy failed"));
  waiter->link(2, recorder, 1);
  std::thread settler([&] { waiter->settle_up_to(2); });
  for (int i = 0; i < 10000; ++i) ASSERT_FALSE(waiter->failure_up_to(2).ok()) << "read " << i;
  settler.join();
  EXPECT_FALSE(waiter->failure_up_to(2).ok());
}

}  // namespace
}  // namespace strata::detail
