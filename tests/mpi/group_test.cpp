// MpiGroup: rank and size, barrier, all_gather, broadcast, check_agreement, isolation from the
// caller's communicator, timeouts and the unusable state after one.
#include <epmoe/error.hpp>
#include <epmoe/mpi.hpp>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "mpi/mpi_test_util.hpp"

namespace epmoe::test {
namespace {

std::vector<std::byte> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng() & 0xff);
  return v;
}

TEST(MpiGroup, RankSizeAndBackendAreThoseOfTheCommunicator) {
  auto g = test_group();
  EXPECT_EQ(g->rank(), world_rank());
  EXPECT_EQ(g->size(), world_size());
  EXPECT_EQ(g->backend(), "mpi");
}

TEST(MpiGroup, GroupOfASplitCommunicatorHasItsRanks) {
  // Odd and even world ranks form two groups; ranks are numbered inside each.
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() % 2, world_rank(), &half);
  {
    auto g = make_mpi_group(half);
    EXPECT_EQ(g->rank(), world_rank() / 2);
    EXPECT_EQ(g->size(), (world_size() + 1 - world_rank() % 2) / 2);
    std::array<int, 1> mine{world_rank()};
    std::vector<int> all(static_cast<std::size_t>(g->size()), -1);
    g->all_gather(mine.data(), all.data(), sizeof(int), "split all_gather");
    for (int r = 0; r < g->size(); ++r) EXPECT_EQ(all[static_cast<std::size_t>(r)], 2 * r + world_rank() % 2);
  }
  MPI_Comm_free(&half);
}

TEST(MpiGroup, BarrierWaitsForEveryRank) {
  // Every rank adds 1 to a counter on world rank 0 (one-sided, outside epmoe), late ranks after a
  // delay; after the barrier every rank must read the full count.
  auto g = test_group();
  const int R = g->size();
  std::int64_t* counter = nullptr;
  MPI_Win win;
  MPI_Win_allocate(sizeof(std::int64_t), sizeof(std::int64_t), MPI_INFO_NULL, MPI_COMM_WORLD, &counter, &win);
  for (int round = 1; round <= 3; ++round) {
    *counter = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Win_lock_all(0, win);
    std::this_thread::sleep_for(std::chrono::milliseconds(20 * ((g->rank() + round) % R)));
    const std::int64_t one = 1;
    std::int64_t old = 0;
    MPI_Fetch_and_op(&one, &old, MPI_INT64_T, 0, 0, MPI_SUM, win);
    MPI_Win_flush(0, win);
    g->barrier("test barrier");
    std::int64_t seen = 0;
    MPI_Fetch_and_op(nullptr, &seen, MPI_INT64_T, 0, 0, MPI_NO_OP, win);
    MPI_Win_flush(0, win);
    EXPECT_EQ(seen, R) << "round " << round;
    MPI_Win_unlock_all(win);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  MPI_Win_free(&win);
}

TEST(MpiGroup, AllGatherReturnsEveryRanksBytesInRankOrder) {
  const std::uint64_t seed = shared_seed();
  auto g = test_group();
  const int R = g->size();
  for (const std::size_t bytes : {0, 1, 13, 4099, 1 << 20}) {
    auto rng = rank_rng(seed, g->rank(), bytes);
    const auto mine = random_bytes(rng, bytes);
    std::vector<std::byte> all(bytes * static_cast<std::size_t>(R) + 1, std::byte{0xa5});  // + a guard byte
    g->all_gather(mine.data(), all.data(), bytes, "test all_gather");
    for (int r = 0; r < R; ++r) {
      auto their_rng = rank_rng(seed, r, bytes);
      const auto theirs = random_bytes(their_rng, bytes);
      const std::byte* got = all.data() + bytes * static_cast<std::size_t>(r);
      EXPECT_TRUE(bytes == 0 || 0 == std::memcmp(got, theirs.data(), bytes))
          << bytes << " bytes from rank " << r;
    }
    EXPECT_EQ(all.back(), std::byte{0xa5}) << "all_gather wrote past size() * bytes";
  }
}

TEST(MpiGroup, BroadcastCopiesTheRootsBytesToEveryRank) {
  const std::uint64_t seed = shared_seed();
  auto g = test_group();
  for (int root = 0; root < g->size(); ++root)
    for (const std::size_t bytes : {0, 7, 100003}) {
      auto rng = rank_rng(seed, root, bytes);
      const auto expected = random_bytes(rng, bytes);
      std::vector<std::byte> data(bytes + 1, std::byte{0x5a});
      if (g->rank() == root && bytes) std::memcpy(data.data(), expected.data(), bytes);
      g->broadcast(data.data(), bytes, root, "test broadcast");
      EXPECT_TRUE(bytes == 0 || 0 == std::memcmp(data.data(), expected.data(), bytes))
          << bytes << " bytes from root " << root;
      EXPECT_EQ(data.back(), std::byte{0x5a});
    }
}

TEST(MpiGroup, BroadcastRejectsARootOutsideTheGroupBeforeCommunicating) {
  auto g = test_group();
  int x = 0;
  auto e = catch_error([&] { g->broadcast(&x, sizeof(x), g->size(), "bad root"); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::invalid_argument);
  EXPECT_NE(std::string(e->what()).find("root"), std::string::npos) << e->what();
  g->barrier("still usable after a rejected argument");
}

TEST(MpiGroup, CheckAgreementPassesWhenEqualAndThrowsOnEveryRankOnAMismatch) {
  auto g = test_group();
  const Setting equal[] = {{"hidden", 7168}, {"num_experts", 64}};
  EXPECT_NO_THROW(g->check_agreement(equal, "agree"));

  // The last rank has a different hidden size: every rank must throw rank_mismatch naming it.
  const bool odd_one = g->rank() == g->size() - 1;
  const Setting differ[] = {{"hidden", odd_one ? 4096 : 7168}, {"num_experts", 64}};
  auto e = catch_error([&] { g->check_agreement(differ, "disagree"); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::rank_mismatch);
  const std::string what = e->what();
  EXPECT_NE(what.find("hidden"), std::string::npos) << what;
  EXPECT_NE(what.find("4096"), std::string::npos) << what;
  EXPECT_NE(what.find("7168"), std::string::npos) << what;

  // Checking a different list of settings is a mismatch too.
  const Setting names_a[] = {{"hidden", 1}};
  const Setting names_b[] = {{"num_experts", 1}};
  auto e2 = catch_error([&] { g->check_agreement(odd_one ? names_b : names_a, "different names"); });
  ASSERT_TRUE(e2);
  EXPECT_EQ(e2->code(), ErrorCode::rank_mismatch);

  g->barrier("usable after a mismatch");
}

TEST(MpiGroup, TrafficNeverMatchesTheCallersReceives) {
  // A wildcard receive posted on the caller's communicator must not see any of the group's messages.
  auto g = test_group();
  const int R = g->size(), me = g->rank();
  int caller_msg = -1;
  MPI_Request caller_recv;
  MPI_Irecv(&caller_msg, 1, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &caller_recv);
  std::vector<int> all(static_cast<std::size_t>(R));
  for (int i = 0; i < 10; ++i) {
    g->barrier("isolation barrier");
    g->all_gather(&me, all.data(), sizeof(int), "isolation all_gather");
    int v = me;
    g->broadcast(&v, sizeof(v), i % R, "isolation broadcast");
  }
  int flag = 1;
  MPI_Test(&caller_recv, &flag, MPI_STATUS_IGNORE);
  EXPECT_EQ(flag, 0) << "the caller's wildcard receive matched a message of the group";
  // Complete it with a message of the caller's own, once every rank has checked (collectives never
  // match point-to-point receives, so the barrier cannot complete it either).
  MPI_Barrier(MPI_COMM_WORLD);
  const int token = 1000 + me;
  MPI_Send(&token, 1, MPI_INT, (me + 1) % R, 7, MPI_COMM_WORLD);
  MPI_Wait(&caller_recv, MPI_STATUS_IGNORE);
  EXPECT_EQ(caller_msg, 1000 + (me + R - 1) % R);
}

TEST(MpiGroup, MakeMpiGroupRejectsANullCommunicator) {
  auto e = catch_error([] { make_mpi_group(MPI_COMM_NULL); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::invalid_argument);
  EXPECT_NE(std::string(e->what()).find("comm"), std::string::npos) << e->what();
}

TEST(MpiGroup, BarrierTimesOutWhenARankSkipsItAndTheGroupBecomesUnusable) {
  auto g = test_group(0.5);
  const int me = g->rank(), skipper = g->size() - 1;
  if (me != skipper) {
    const auto start = std::chrono::steady_clock::now();
    auto e = catch_error([&] { g->barrier("skipped barrier"); });
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_TRUE(e);
    EXPECT_EQ(e->code(), ErrorCode::timeout);
    const std::string what = e->what();
    EXPECT_NE(what.find(fmt::format("rank {} ", me)), std::string::npos) << what;
    EXPECT_NE(what.find("skipped barrier"), std::string::npos) << what;
    EXPECT_NE(what.find("one or more peers"), std::string::npos) << what;
    EXPECT_GE(waited, 0.5);
    EXPECT_LT(waited, 10.0);
    // Every later call says the group is broken.
    auto again = catch_error([&] { g->barrier("after the timeout"); });
    ASSERT_TRUE(again);
    EXPECT_EQ(again->code(), ErrorCode::unusable);
    int x = 0;
    auto bc = catch_error([&] { g->broadcast(&x, sizeof(x), 0, "after the timeout"); });
    ASSERT_TRUE(bc);
    EXPECT_EQ(bc->code(), ErrorCode::unusable);
  }
  // The skipping rank (and everyone) continues on the caller's communicator, untouched by the fault.
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiGroup, AllGatherTimesOutWhenARankSkipsIt) {
  auto g = test_group(0.3);
  const int me = g->rank();
  if (me != 0) {
    std::vector<int> all(static_cast<std::size_t>(g->size()));
    auto e = catch_error([&] { g->all_gather(&me, all.data(), sizeof(int), "skipped all_gather"); });
    ASSERT_TRUE(e);
    EXPECT_EQ(e->code(), ErrorCode::timeout);
    EXPECT_NE(std::string(e->what()).find("skipped all_gather"), std::string::npos) << e->what();
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace epmoe::test
