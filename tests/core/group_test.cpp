// Threads Group: barrier timeouts name rank, missing peer and phase; settings that must agree are
// checked on every rank.
#include <gtest/gtest.h>

#include <epmoe/error.hpp>
#include <epmoe/group.hpp>

#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include "support/random.hpp"

namespace epmoe {
namespace {

// Rethrows `e` and returns the Error, or fails the test when it is null or not an epmoe::Error.
std::pair<ErrorCode, std::string> error_of(const std::exception_ptr& e) {
  if (!e) return {ErrorCode::internal, "<no exception>"};
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    return {err.code(), err.what()};
  } catch (const std::exception& other) {
    return {ErrorCode::internal, std::string("<not an epmoe::Error> ") + other.what()};
  }
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(ThreadGroup, BarrierAndAllGather) {
  run_thread_ranks(4, [](Group& g) {
    EXPECT_EQ(g.size(), 4);
    EXPECT_EQ(g.backend(), "threads");
    for (int i = 0; i < 3; ++i) g.barrier("warmup");
    const std::int32_t mine = 100 + g.rank();
    std::array<std::int32_t, 4> all{};
    all.fill(-1);
    g.all_gather(&mine, all.data(), sizeof(mine), "gather");
    for (int r = 0; r < 4; ++r) EXPECT_EQ(all[static_cast<std::size_t>(r)], 100 + r);
  });
}

TEST(ThreadGroup, BarrierTimeoutNamesRankMissingPeerAndPhase) {
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_thread_ranks_collect(
      4,
      [](Group& g) {
        if (g.rank() == 3) return;  // never reaches the barrier
        g.barrier("layout_counts");
      },
      0.2);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(elapsed, 5.0) << "the timeout did not end the wait";
  EXPECT_FALSE(errors[3]) << "rank 3 never waited";
  for (int r = 0; r < 3; ++r) {
    const auto [code, msg] = error_of(errors[static_cast<std::size_t>(r)]);
    EXPECT_EQ(code, ErrorCode::timeout) << "rank " << r << ": " << msg;
    EXPECT_TRUE(contains(msg, "rank " + std::to_string(r))) << msg;
    EXPECT_TRUE(contains(msg, "peer 3")) << msg;
    EXPECT_TRUE(contains(msg, "layout_counts")) << msg;
  }
}

TEST(ThreadGroup, GroupIsUnusableAfterATimeout) {
  const auto errors = run_thread_ranks_collect(
      2,
      [](Group& g) {
        if (g.rank() == 1) return;
        try {
          g.barrier("first");
        } catch (const Error&) {
        }
        g.barrier("second");
      },
      0.1);
  const auto [code, msg] = error_of(errors[0]);
  EXPECT_EQ(code, ErrorCode::unusable) << msg;
}

// Ranks in different collectives (or phases, or sizes) at once: every rank raises rank_mismatch naming both, instead
// of one reading another's published pointer as the wrong thing.
TEST(ThreadGroup, RanksInDifferentCollectivesRaiseRankMismatch) {
  const std::vector<std::function<void(Group&)>> cases = {
      [](Group& g) {
        std::int32_t v = g.rank(), all[2] = {};
        if (g.rank() == 0) g.barrier("A");
        else g.all_gather(&v, all, sizeof(v), "B");
      },
      [](Group& g) { g.barrier(g.rank() == 0 ? "phase zero" : "phase one"); },
      [](Group& g) {
        std::int64_t v[2] = {g.rank(), g.rank()}, all[4] = {};
        g.all_gather(v, all, g.rank() == 0 ? 8 : 16, "sizes");
      },
      [](Group& g) {
        std::int32_t v = g.rank();
        g.broadcast(&v, sizeof(v), g.rank(), "roots");
      }};
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto errors = run_thread_ranks_collect(2, cases[i], 30.0);
    for (int r = 0; r < 2; ++r) {
      const auto [code, msg] = error_of(errors[static_cast<std::size_t>(r)]);
      EXPECT_EQ(code, ErrorCode::rank_mismatch) << "case " << i << ", rank " << r << ": " << msg;
      EXPECT_TRUE(contains(msg, "different collectives") && contains(msg, "rank 0 in") && contains(msg, "rank 1 in"))
          << "case " << i << ": " << msg;
    }
  }
}

// The words do not depend on which rank arrived last: rank 0's collective first, then the lowest rank that differs.
TEST(ThreadGroup, CollectiveMismatchIsNamedAgainstRankZeroWhicheverRankArrivesLast) {
  const std::uint64_t seed = test::fresh_seed();
  for (int round = 0; round < 12; ++round) {
    // A random rank arrives last (it waits a little first).
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(round));
    const int last = static_cast<int>(rng() % 3);
    const auto errors = run_thread_ranks_collect(3, [&](Group& g) {
      if (g.rank() == last) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      g.barrier(g.rank() == 1 ? "B" : "A");
    }, 30.0);
    int named = 0;
    for (int r = 0; r < 3; ++r) {
      const auto [code, msg] = error_of(errors[static_cast<std::size_t>(r)]);
      if (code != ErrorCode::rank_mismatch) continue;  // the others see the group broken (unusable)
      ++named;
      EXPECT_TRUE(contains(msg, "ranks met in different collectives: rank 0 in barrier 'A', rank 1 in barrier 'B'"))
          << "round " << round << ", rank " << r << ": " << msg;
    }
    EXPECT_GE(named, 1) << "round " << round << ": no rank raised rank_mismatch";
  }
}

TEST(ThreadGroup, AgreeingSettingsPass) {
  run_thread_ranks(4, [](Group& g) {
    const std::array<Setting, 3> s{{{"num_max_dispatch_tokens_per_rank", 128}, {"hidden", 7168}, {"num_experts", 256}}};
    g.check_agreement(s, "buffer_init");
  });
}

TEST(ThreadGroup, MismatchedSettingThrowsOnEveryRank) {
  const auto errors = run_thread_ranks_collect(
      4,
      [](Group& g) {
        const std::array<Setting, 2> s{
            {{"hidden", 7168}, {"num_max_dispatch_tokens_per_rank", g.rank() == 1 ? 128 : 64}}};
        g.check_agreement(s, "buffer_init");
      },
      10.0);
  for (int r = 0; r < 4; ++r) {
    const auto [code, msg] = error_of(errors[static_cast<std::size_t>(r)]);
    EXPECT_EQ(code, ErrorCode::rank_mismatch) << "rank " << r << ": " << msg;
    EXPECT_TRUE(contains(msg, "num_max_dispatch_tokens_per_rank")) << msg;
    EXPECT_TRUE(contains(msg, "64")) << msg;
    EXPECT_TRUE(contains(msg, "128")) << msg;
    EXPECT_TRUE(contains(msg, "rank 1")) << msg;
    EXPECT_TRUE(contains(msg, "buffer_init")) << msg;
  }
}

TEST(ThreadGroup, DifferentSettingListsThrowOnEveryRank) {
  const auto errors = run_thread_ranks_collect(
      3,
      [](Group& g) {
        const std::array<Setting, 1> a{{{"hidden", 7168}}};
        const std::array<Setting, 1> b{{{"num_experts", 7168}}};
        g.check_agreement(g.rank() == 2 ? std::span<const Setting>(b) : std::span<const Setting>(a), "init");
      },
      10.0);
  for (int r = 0; r < 3; ++r) {
    const auto [code, msg] = error_of(errors[static_cast<std::size_t>(r)]);
    EXPECT_EQ(code, ErrorCode::rank_mismatch) << "rank " << r << ": " << msg;
  }
}

}  // namespace
}  // namespace epmoe
