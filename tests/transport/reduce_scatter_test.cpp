// Group::reduce_scatter_sum: the threads override and the base-class default (what a Group implemented elsewhere,
// e.g. in Python, gets) against a hand-written rank-order float32 sum, bit for bit.
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "support/random.hpp"

namespace epmoe {
namespace {

// Forwards everything but reduce_scatter_sum, so the base class's default runs.
class DefaultReduceScatterGroup final : public Group {
 public:
  explicit DefaultReduceScatterGroup(Group& g) : g_(g) {}
  int rank() const override { return g_.rank(); }
  int size() const override { return g_.size(); }
  std::string_view backend() const override { return "forwarding"; }
  void barrier(std::string_view phase) override { g_.barrier(phase); }
  void all_gather(const void* s, void* r, std::size_t b, std::string_view phase) override { g_.all_gather(s, r, b, phase); }
  void broadcast(void* d, std::size_t b, int root, std::string_view phase) override { g_.broadcast(d, b, root, phase); }

 private:
  Group& g_;
};

// Values of very different magnitudes, so a different order of the additions would show in the bits.
std::vector<float> rank_values(std::uint64_t seed, int rank, std::size_t n) {
  std::mt19937_64 rng(seed * 131 + static_cast<std::uint64_t>(rank));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
  return v;
}

TEST(ReduceScatter, ThreadsAndDefaultSumInRankOrderBitForBit) {
  const std::uint64_t seed = test::fresh_seed();
  for (int R : {1, 2, 3, 4})
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{5000}, std::size_t{9000}}) {
      std::vector<std::vector<float>> send(static_cast<std::size_t>(R));
      for (int r = 0; r < R; ++r) send[static_cast<std::size_t>(r)] = rank_values(seed, r, static_cast<std::size_t>(R) * count);
      std::vector<std::vector<float>> fast(static_cast<std::size_t>(R)), slow(static_cast<std::size_t>(R));
      run_thread_ranks(R, [&](Group& g) {
        const auto me = static_cast<std::size_t>(g.rank());
        fast[me].assign(count, -7.0f);
        slow[me].assign(count, -7.0f);
        g.reduce_scatter_sum(send[me].data(), fast[me].data(), count, "test reduce_scatter");
        DefaultReduceScatterGroup d(g);
        d.reduce_scatter_sum(send[me].data(), slow[me].data(), count, "test reduce_scatter default");
      });
      for (int r = 0; r < R; ++r) {
        const auto rr = static_cast<std::size_t>(r);
        for (std::size_t i = 0; i < count; ++i) {
          float want = send[0][rr * count + i];
          for (int q = 1; q < R; ++q) want += send[static_cast<std::size_t>(q)][rr * count + i];
          ASSERT_EQ(std::memcmp(&fast[rr][i], &want, 4), 0) << "threads R=" << R << " rank " << r << " i " << i;
          ASSERT_EQ(std::memcmp(&slow[rr][i], &want, 4), 0) << "default R=" << R << " rank " << r << " i " << i;
        }
      }
    }
}

TEST(ReduceScatter, NullPointersAreRefusedNamingThem) {
  run_thread_ranks(1, [&](Group& g) {
    float x = 1.0f;
    try {
      g.reduce_scatter_sum(nullptr, &x, 1, "test");
      ADD_FAILURE() << "null send accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("send"), std::string::npos) << e.what();
    }
    g.reduce_scatter_sum(nullptr, nullptr, 0, "test");  // nothing to move
  });
}

}  // namespace
}  // namespace epmoe
