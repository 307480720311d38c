// MpiTransport windows: allocate_window zeroes, put lands at the right offset of the right rank,
// a signal is ordered after the sender's earlier puts, wait_signal returns at once for a value already
// there and times out naming the peer (and the value it saw).
#include <epmoe/error.hpp>
#include <epmoe/mpi.hpp>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <vector>

#include "mpi/mpi_test_util.hpp"
#include "transport/cpu/transport.hpp"

namespace epmoe::test {
namespace {

std::vector<std::byte> pattern(std::uint64_t seed, int src, int dst, int round, std::size_t n) {
  auto rng = rank_rng(seed, src, static_cast<std::uint64_t>(round) * 1024 + static_cast<std::uint64_t>(dst));
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng() & 0xff);
  return v;
}

bool all_zero(const std::byte* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (p[i] != std::byte{0}) return false;
  return true;
}

TEST(MpiWindow, AllocateWindowGivesZeroedMemoryOfTheRequestedSize) {
  auto g = test_group();
  auto t = make_mpi_transport(g);
  EXPECT_EQ(t->local_window(), nullptr);
  t->allocate_window(12345, 5, "alloc");
  EXPECT_EQ(t->window_bytes(), 12345u);
  ASSERT_NE(t->local_window(), nullptr);
  EXPECT_TRUE(all_zero(t->local_window(), 12345));
  std::memset(t->local_window(), 0x77, 12345);
  // Re-allocating (another size) gives fresh zeroed memory again.
  t->allocate_window(777, 2, "realloc");
  EXPECT_EQ(t->window_bytes(), 777u);
  EXPECT_TRUE(all_zero(t->local_window(), 777));
}

TEST(MpiWindow, AllocateWindowWithDifferentSizesIsAMismatchOnEveryRank) {
  auto g = test_group();
  auto t = make_mpi_transport(g);
  const bool odd_one = g->rank() == g->size() - 1;
  auto e = catch_error([&] { t->allocate_window(odd_one ? 2048 : 1024, 4, "unequal windows"); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::rank_mismatch);
  EXPECT_NE(std::string(e->what()).find("window_bytes"), std::string::npos) << e->what();
}

TEST(MpiWindow, PutsThenSignalDeliverTheDataBeforeTheSignal) {
  // Every rank puts a distinct pattern into every rank's window (itself included), in several pieces,
  // then signals; the receiver waits for each source's signal and checks that source's region. Rounds
  // alternate between two halves, so a rank that runs ahead never overwrites a region being checked.
  const std::uint64_t seed = shared_seed();
  auto g = test_group();
  auto t = make_mpi_transport(g);
  const int R = g->size(), me = g->rank();
  const std::size_t region = 300001;  // odd size: no alignment luck
  const std::size_t half = region * static_cast<std::size_t>(R);
  t->allocate_window(2 * half, R, "window");
  for (int round = 0; round < 6; ++round) {
    const std::size_t h = static_cast<std::size_t>(round % 2) * half;
    for (int step = 0; step < R; ++step) {
      const int dst = (me + step) % R;
      auto data = pattern(seed, me, dst, round, region);
      // Three puts of uneven sizes, the last one first: order within a destination must not matter.
      const std::size_t a = region / 3, b = region / 2;
      t->put(dst, h + region * static_cast<std::size_t>(me) + b, data.data() + b, region - b);
      t->put(dst, h + region * static_cast<std::size_t>(me), data.data(), a);
      std::memset(data.data() + b, 0xee, region - b);  // the source may be reused once put returns
      t->put(dst, h + region * static_cast<std::size_t>(me) + a, data.data() + a, b - a);
      t->put(dst, h, data.data(), 0);  // an empty put is fine
      t->signal(dst, me, static_cast<std::uint64_t>(round) + 1);
    }
    for (int s = 0; s < R; ++s) {
      t->wait_signal(s, static_cast<std::uint64_t>(round) + 1, s, "wait for data");
      const auto want = pattern(seed, s, me, round, region);
      ASSERT_EQ(0, std::memcmp(t->local_window() + h + region * static_cast<std::size_t>(s), want.data(), region))
          << "round " << round << " source " << s;
    }
  }
  g->barrier("done");
}

TEST(MpiWindow, WaitSignalReturnsAtOnceForAValueAlreadyReachedAndForLargerValues) {
  // Each rank signals the next one; after a barrier every signal has landed (signal() flushes it at the target),
  // so a wait for the value signalled, or for a smaller one (the slot holds a larger value than asked), must return
  // at once: well within a bound far below the group's timeout, where a wait that polled for a value not yet there
  // would instead run into the timeout. The value the slot holds is then read back through the timeout message of
  // a wait for one more: the latest signal replaced the earlier one (41 then 100 is 100, not their sum).
  constexpr double kTimeoutS = 20.0, kAtOnceS = 2.0;
  auto g = test_group(kTimeoutS);
  auto t = make_mpi_transport(g);
  const int R = g->size(), me = g->rank(), from = (me + R - 1) % R;
  t->allocate_window(64, 1, "window");
  const auto seconds_of = [](const std::function<void()>& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  t->signal((me + 1) % R, 0, 41);
  g->barrier("the first signals have landed");
  EXPECT_LT(seconds_of([&] { t->wait_signal(0, 41, from, "wait 41"); }), kAtOnceS);
  EXPECT_LT(seconds_of([&] { t->wait_signal(0, 7, from, "wait 7"); }), kAtOnceS);  // the slot holds more than 7
  g->barrier("before the second signal");
  t->signal((me + 1) % R, 0, 100);
  g->barrier("the second signals have landed");
  EXPECT_LT(seconds_of([&] { t->wait_signal(0, 100, from, "wait 100"); }), kAtOnceS);
  EXPECT_LT(seconds_of([&] { t->wait_signal(0, 41, from, "wait 41 again"); }), kAtOnceS);
  g->barrier("every at-once wait is done");
  // No rank signals again: a wait for 101 times out (on every rank, so the group breaks everywhere alike) and
  // names the value it saw.
  g->set_timeout_s(0.3);
  auto e = catch_error([&] { t->wait_signal(0, 101, from, "wait 101"); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::timeout);
  EXPECT_NE(std::string(e->what()).find("signal slot 0 is 100, expected >= 101"), std::string::npos) << e->what();
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiWindow, WaitSignalTimesOutNamingThePeerAndBreaksTheGroup) {
  auto g = test_group(0.3);
  auto t = make_mpi_transport(g);
  const int R = g->size(), me = g->rank();
  t->allocate_window(64, 2, "window");
  const int peer = (me + 1) % R;
  auto e = catch_error([&] { t->wait_signal(1, 5, peer, "signal never sent"); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::timeout);
  const std::string what = e->what();
  EXPECT_NE(what.find(fmt::format("rank {} ", me)), std::string::npos) << what;
  EXPECT_NE(what.find(fmt::format("peer {}", peer)), std::string::npos) << what;
  EXPECT_NE(what.find("signal never sent"), std::string::npos) << what;
  auto again = catch_error([&] { g->barrier("after"); });
  ASSERT_TRUE(again);
  EXPECT_EQ(again->code(), ErrorCode::unusable);
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace epmoe::test
