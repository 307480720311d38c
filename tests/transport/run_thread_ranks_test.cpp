// run_thread_ranks rethrows the failing rank's own exception whichever rank failed (not the 'unusable' the
// others saw of it), naming that rank, and releases the others at once; a rank that returns before its peers'
// collective releases them at once too.
#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <epmoe/timeout.hpp>
#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <thread>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/random.hpp"

namespace epmoe {
namespace {

using test::fresh_seed;

// Rank `failing` throws `thrown` while the other ranks wait in a barrier; the caller gets, at once (the failure
// releases the waiting ranks long before their 60 s timeout), an exception whose message is `want`: an epmoe::Error of
// the same code, or for another std::exception a std::runtime_error nesting the one thrown (its type and message).
template <class Thrown>
void expect_root_cause(int num_ranks, int failing, const Thrown& thrown, const std::string& want) {
  const auto start = std::chrono::steady_clock::now();
  try {
    run_thread_ranks(
        num_ranks,
        [&](Group& g) {
          if (g.rank() == failing) throw thrown;
          g.barrier("waiting for the failing rank");
        },
        60.0);
    ADD_FAILURE() << "nothing thrown";
  } catch (const Error& e) {
    EXPECT_TRUE((std::is_same_v<Thrown, Error>)) << "an epmoe::Error came for another exception: " << e.what();
    EXPECT_EQ(std::string(e.what()), want);
    if constexpr (std::is_same_v<Thrown, Error>) EXPECT_EQ(e.code(), thrown.code());
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), want);
    try {
      std::rethrow_if_nested(e);
      ADD_FAILURE() << "nothing nested in " << e.what();
    } catch (const Thrown& original) {
      EXPECT_EQ(std::string(original.what()), std::string(thrown.what()));
    } catch (...) {
      ADD_FAILURE() << "another exception is nested in " << e.what();
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "another exception came: " << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

// An epmoe error comes back naming the rank that raised it, with its code; found by a fresh user: another exception
// came back as thrown, naming no rank. It comes back naming the rank too, the one thrown nested in it.
TEST(RunThreadRanks, AHigherRankFailingWhileLowerRanksWaitRethrowsItsOwnError) {
  expect_root_cause(2, 1, Error(ErrorCode::invalid_argument, "epmoe: invalid argument 'w1': from rank one"),
                    "epmoe: rank 1: invalid argument 'w1': from rank one");
  expect_root_cause(3, 2, Error(ErrorCode::out_of_memory, "epmoe: out of memory: from rank two"),
                    "epmoe: rank 2: out of memory: from rank two");
  expect_root_cause(3, 2, std::runtime_error("rank two's own failure"), "rank 2: rank two's own failure");
  expect_root_cause(2, 1, std::out_of_range("vector index 7"), "rank 1: vector index 7");
}

TEST(RunThreadRanks, ALowerRankFailingWhileHigherRanksWaitRethrowsItsOwnError) {
  expect_root_cause(2, 0, Error(ErrorCode::invalid_argument, "epmoe: invalid argument 'x': from rank zero"),
                    "epmoe: rank 0: invalid argument 'x': from rank zero");
  expect_root_cause(3, 1, std::runtime_error("rank one's own failure"), "rank 1: rank one's own failure");
  expect_root_cause(3, 0, std::logic_error("rank 0: already named"), "rank 0: already named");
}

// Something that is no std::exception has no message to name the rank in: it comes back as thrown.
TEST(RunThreadRanks, AThrownValueThatIsNoExceptionComesBackAsThrown) {
  try {
    run_thread_ranks(
        2,
        [](Group& g) {
          if (g.rank() == 1) throw 42;
          g.barrier("waiting for rank 1");
        },
        60.0);
    ADD_FAILURE() << "nothing thrown";
  } catch (int v) {
    EXPECT_EQ(v, 42);
  }
}

// The rank goes after "epmoe: ", once: a message that names a rank first already says whose it is.
TEST(RunThreadRanks, NamingRankPutsTheRankFirstUnlessOneIsNamed) {
  EXPECT_EQ(naming_rank("epmoe: invalid argument 'x': expected a, got b", 3),
            "epmoe: rank 3: invalid argument 'x': expected a, got b");
  EXPECT_EQ(naming_rank("epmoe: rank 0: timed out after 1 s", 3), "epmoe: rank 0: timed out after 1 s");
  EXPECT_EQ(naming_rank("no prefix", 1), "rank 1: no prefix");
  EXPECT_EQ(naming_rank("rank 2: named", 1), "rank 2: named");
  // A message that starts with the word, not with a rank's number, names no rank.
  EXPECT_EQ(naming_rank("rank one fails", 1), "rank 1: rank one fails");
  EXPECT_EQ(naming_rank("epmoe: ranks differ", 1), "epmoe: rank 1: ranks differ");
  EXPECT_EQ(naming_rank("rank ", 1), "rank 1: rank ");
}

// ThreadWorld::abort records the order of the failures, once per rank (first_root_cause's `order`).
TEST(RunThreadRanks, ThreadWorldRecordsTheOrderOfTheFailures) {
  ThreadWorld world(4);
  EXPECT_EQ(world.failure_order(), (std::vector<int>{-1, -1, -1, -1}));
  world.abort(2, "first");
  world.abort(0, "second");
  world.abort(2, "again");
  EXPECT_EQ(world.failure_order(), (std::vector<int>{1, -1, 0, -1}));
  EXPECT_THROW(world.abort(4, "no such rank"), Error);
}

// A rank that returns while the others wait for it in a barrier can never arrive (the first rank to see it may
// break the group for the others: they name it through that rank's message): they raise unusable naming it and the phase at once, not after their timeout.
TEST(RunThreadRanks, ARankReturningEarlyReleasesItsPeersAtOnce) {
  // Repeated: which waiting rank sees the returned one first varies, and the message must name it every time.
  for (int repeat = 0; repeat < 20; ++repeat)
  for (const int returning : {0, 1, 3}) {
    const auto start = std::chrono::steady_clock::now();
    try {
      run_thread_ranks(
          4,
          [&](Group& g) {
            g.barrier("all meet here");
            if (g.rank() == returning) return;
            g.barrier("the returned rank never comes");
          },
          60.0);
      ADD_FAILURE() << "nothing thrown";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.code(), ErrorCode::unusable) << what;
      EXPECT_NE(what.find("rank(s) " + std::to_string(returning) + " returned"), std::string::npos) << what;
      EXPECT_NE(what.find("the returned rank never comes"), std::string::npos) << what;
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
  }
}

// A rank that comes too late: the others time out. What comes back is a timeout naming the late rank and the
// phase (not the 'unusable' the late rank, or a peer woken by the first timeout, saw of it).
TEST(RunThreadRanks, ALateRankComesBackAsATimeoutNamingIt) {
  for (int repeat = 0; repeat < 5; ++repeat) {
    try {
      run_thread_ranks(
          3,
          [&](Group& g) {
            if (g.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(400));
            g.barrier("the late rank's phase");
          },
          0.1);
      ADD_FAILURE() << "nothing thrown";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.code(), ErrorCode::timeout) << what;
      EXPECT_NE(what.find("peer 1"), std::string::npos) << what;
      EXPECT_NE(what.find("the late rank's phase"), std::string::npos) << what;
    }
  }
}

// A timeout past what the clocks hold (infinity: no timeout) waits, instead of wrapping around to one already past.
TEST(RunThreadRanks, AnInfiniteTimeoutWaits) {
  EXPECT_FALSE(Deadline(std::numeric_limits<double>::infinity()).expired());
  EXPECT_FALSE(Deadline(1e300).expired());
  run_thread_ranks(
      2,
      [](Group& g) {
        EXPECT_EQ(g.timeout_s(), kMaxTimeoutS);
        if (g.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        g.barrier("a late rank under no timeout");
      },
      std::numeric_limits<double>::infinity());
}

}  // namespace
}  // namespace epmoe
