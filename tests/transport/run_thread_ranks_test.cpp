// run_thread_ranks rethrows the failing rank's own exception whichever rank failed (not the 'unusable' the
// others saw of it) and releases the others at once; a rank that returns before its peers' collective releases
// them at once too.
#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "support/random.hpp"

namespace epmoe {
namespace {

using test::fresh_seed;

// Rank `failing` throws `thrown` while the other ranks wait in a barrier; the caller gets exactly `thrown`, and
// at once: the failure releases the waiting ranks long before their 60 s timeout.
template <class Thrown>
void expect_root_cause(int num_ranks, int failing, const Thrown& thrown) {
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
  } catch (const Thrown& e) {
    EXPECT_EQ(std::string(e.what()), std::string(thrown.what()));
    if constexpr (std::is_same_v<Thrown, Error>) EXPECT_EQ(e.code(), thrown.code());
  } catch (const std::exception& e) {
    ADD_FAILURE() << "another exception came: " << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

TEST(RunThreadRanks, AHigherRankFailingWhileLowerRanksWaitRethrowsItsOwnError) {
  expect_root_cause(2, 1, Error(ErrorCode::invalid_argument, "epmoe: invalid argument 'w1': from rank one"));
  expect_root_cause(3, 2, std::runtime_error("rank two's own failure"));
}

TEST(RunThreadRanks, ALowerRankFailingWhileHigherRanksWaitRethrowsItsOwnError) {
  expect_root_cause(2, 0, Error(ErrorCode::invalid_argument, "epmoe: invalid argument 'x': from rank zero"));
  expect_root_cause(3, 1, std::runtime_error("rank one's own failure"));
}

// A rank that returns while the others wait for it in a barrier can never arrive (the first rank to see it may
// break the group for the others: they name it through that rank's message): they raise unusable naming it and the phase at once, not after their timeout.
TEST(RunThreadRanks, ARankReturningEarlyReleasesItsPeersAtOnce) {
  for (const int returning : {0, 2}) {
    const auto start = std::chrono::steady_clock::now();
    try {
      run_thread_ranks(
          3,
          [&](Group& g) {
            g.barrier("both meet here");
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

}  // namespace
}  // namespace epmoe
