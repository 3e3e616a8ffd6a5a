// Completion / CompletionSource / when_all: the one completion model.
#include "strata/core/completion.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace strata {
namespace {

using namespace std::chrono_literals;

TEST(Completion, DefaultIsCompleteAndOk) {
  Completion c;
  EXPECT_TRUE(c.done());
  EXPECT_TRUE(c.wait().ok());
  EXPECT_TRUE(c.status().ok());
  int calls = 0;
  c.then([&](const Status& s) {
    EXPECT_TRUE(s.ok());
    ++calls;
  });
  EXPECT_EQ(calls, 1);
}

TEST(Completion, ReadyCarriesItsStatus) {
  Completion c = Completion::ready(IoError("read of 'x.swp' at offset 4096 failed"), "nvme read");
  EXPECT_TRUE(c.done());
  EXPECT_EQ(c.wait().code(), StatusCode::kIoError);
  EXPECT_EQ(c.label(), "nvme read");
}

TEST(Completion, WaitersLearnTheProducersStatus) {
  CompletionSource source("nvme read of 'x.swp' [0, 4096)");
  Completion c = source.completion();
  EXPECT_FALSE(c.done());
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("x.swp"), std::string::npos);
  EXPECT_FALSE(c.wait_for(1ms));
  std::thread producer([&] {
    std::this_thread::sleep_for(5ms);
    source.complete(IoError("pread 'x.swp' offset 0: EIO"));
  });
  Status st = c.wait();
  producer.join();
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.message().find("EIO"), std::string::npos);
  Completion copy = c;  // every copy sees the same outcome
  EXPECT_EQ(copy.wait().code(), StatusCode::kIoError);
  EXPECT_TRUE(copy.same_as(c));
}

TEST(Completion, ThenRunsOnceAfterCompletionWithNoLockHeld) {
  CompletionSource source("tile");
  Completion c = source.completion();
  std::atomic<int> calls{0};
  // A callback that chains on the same completion and waits on it: it would
  // deadlock if callbacks ran under the state's lock.
  c.then([&](const Status& s) {
    EXPECT_TRUE(s.ok());
    EXPECT_TRUE(c.done());
    EXPECT_TRUE(c.wait().ok());
    c.then([&](const Status&) { ++calls; });
    ++calls;
  });
  EXPECT_EQ(calls.load(), 0);
  source.complete(Status::Ok());
  EXPECT_EQ(calls.load(), 2);
}

TEST(Completion, AbandonedSourceFailsItsWaiters) {
  Completion c;
  {
    CompletionSource source("checksum of tensor 7");
    c = source.completion();
  }
  Status st = c.wait();
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("checksum of tensor 7"), std::string::npos);
  EXPECT_NE(st.message().find("abandoned"), std::string::npos);
}

TEST(Completion, MoveAssigningOverALiveSourceAbandonsIt) {
  CompletionSource a("first");
  Completion first = a.completion();
  a = CompletionSource("second");
  EXPECT_TRUE(first.done());
  EXPECT_EQ(first.status().code(), StatusCode::kInternal);
  a.complete(Status::Ok());
}

TEST(Completion, CompletionAfterCompleteCarriesTheOutcome) {
  CompletionSource source("write of tensor 3");
  source.complete(IoError("pwrite: ENOSPC"));
  EXPECT_EQ(source.completion().status().code(), StatusCode::kIoError);  // never a fresh "ok"
}

TEST(CompletionDeath, CompletingTwiceIsABug) {
  CompletionSource source("op");
  CompletionSource* p = &source;
  p->complete(Status::Ok());
  EXPECT_DEATH(p->complete(Status::Ok()), "completed twice");
}

TEST(WhenAll, FirstFailureInInputOrderWins) {
  CompletionSource a("a"), b("b"), c("c");
  std::vector<Completion> inputs = {a.completion(), b.completion(), c.completion()};
  Completion all = when_all(inputs, "layer 3 ready");
  EXPECT_FALSE(all.done());
  c.complete(IoError("c failed"));  // completes first, but is later in input order
  b.complete(DataLoss("b failed"));
  EXPECT_FALSE(all.done());
  a.complete(Status::Ok());
  ASSERT_TRUE(all.done());
  EXPECT_EQ(all.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(all.label(), "layer 3 ready");
}

TEST(WhenAll, EmptyAndAlreadyDoneInputs) {
  EXPECT_TRUE(when_all({}).wait().ok());
  std::vector<Completion> inputs = {Completion(), Completion::ready(Status::Ok(), "x")};
  EXPECT_TRUE(when_all(inputs).wait().ok());
}

TEST(WhenAll, OnePendingInputIsItself) {
  CompletionSource pending("nvme read of 'f.swp'");
  std::vector<Completion> inputs = {Completion(), Completion::ready(Status::Ok(), "x"), pending.completion()};
  Completion all = when_all(inputs, "layer 3 ready");
  EXPECT_TRUE(all.same_as(pending.completion()));
  EXPECT_EQ(all.label(), "nvme read of 'f.swp'");
  pending.complete(IoError("short read"));
  EXPECT_EQ(all.wait().code(), StatusCode::kIoError);
}

TEST(WhenAll, AFailedInputBeforeThePendingOneStillWins) {
  CompletionSource pending("write");
  std::vector<Completion> inputs = {Completion::ready(DataLoss("bad checksum"), "read"), pending.completion()};
  Completion all = when_all(inputs, "layer 3 ready");
  EXPECT_FALSE(all.same_as(pending.completion()));
  EXPECT_FALSE(all.done());
  pending.complete(Status::Ok());
  EXPECT_EQ(all.wait().code(), StatusCode::kDataLoss);
}

TEST(WhenAll, ManyProducerThreads) {
  constexpr int kInputs = 64;
  std::vector<CompletionSource> sources;
  std::vector<Completion> inputs;
  for (int i = 0; i < kInputs; ++i) {
    sources.emplace_back("part");
    inputs.push_back(sources.back().completion());
  }
  Completion all = when_all(inputs);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = t; i < kInputs; i += 4) sources[i].complete(Status::Ok());
    });
  EXPECT_TRUE(all.wait().ok());
  for (auto& th : threads) th.join();
}

}  // namespace
}  // namespace strata
