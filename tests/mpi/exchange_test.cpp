// MpiTransport::exchange: random row blocks (contiguous, strided, indexed in runs or at random; several
// fields; zero-count destinations; a rank that offers nothing) arrive byte for byte as their source
// offered them. Every rank regenerates every other rank's offer from the shared seed to check them.
#include <epmoe/error.hpp>
#include <epmoe/mpi.hpp>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string_view>
#include <vector>

#include "mpi/mpi_test_util.hpp"
#include "transport/cpu/transport.hpp"

namespace epmoe::test {
namespace {

/// The fields of one exchange: equal on every rank (drawn from the shared seed).
struct FieldShape {
  int num_fields = 1;
  std::vector<std::size_t> row_bytes;  // per field
  int nothing_rank = -1;               // offers no rows at all
};

FieldShape make_shape(std::uint64_t seed, int round, int R) {
  auto rng = rank_rng(seed, -1, static_cast<std::uint64_t>(round));
  FieldShape s;
  s.num_fields = 1 + static_cast<int>(rng() % 4);
  const std::size_t sizes[] = {1, 4, 12, 16, 64, 200, 1000, 14336};
  for (int f = 0; f < s.num_fields; ++f) s.row_bytes.push_back(sizes[rng() % std::size(sizes)]);
  s.nothing_rank = round % (R + 1) == R ? -1 : round % (R + 1);  // sometimes every rank offers rows
  return s;
}

/// What rank `src` offers in one round: storage, indices and the RowBlocks over them.
struct Offer {
  std::vector<std::vector<std::byte>> storage;  // one array per (destination, field)
  std::vector<std::vector<std::int32_t>> index;
  std::vector<RowBlock> blocks;  // [d * F + f]
};

Offer make_offer(std::uint64_t seed, int round, int src, int R, const FieldShape& shape) {
  auto rng = rank_rng(seed, src, static_cast<std::uint64_t>(round));
  const int F = shape.num_fields;
  Offer o;
  o.storage.resize(static_cast<std::size_t>(R * F));
  o.index.resize(static_cast<std::size_t>(R * F));
  o.blocks.resize(static_cast<std::size_t>(R * F));
  for (int d = 0; d < R; ++d) {
    // A quarter of the destinations get nothing; the nothing rank offers no rows to anyone.
    std::int64_t count = rng() % 4 == 0 ? 0 : static_cast<std::int64_t>(rng() % 60);
    if (src == shape.nothing_rank) count = 0;
    for (int f = 0; f < F; ++f) {
      const std::size_t k = static_cast<std::size_t>(d * F + f), rb = shape.row_bytes[static_cast<std::size_t>(f)];
      RowBlock& b = o.blocks[k];
      b.count = count;
      b.row_bytes = rb;
      // 0 contiguous, 1 strided, 2 random indices (repeats too), 3 ascending indices in runs of 5
      const int kind = static_cast<int>(rng() % 4);
      b.stride_bytes = kind == 1 ? rb + 1 + rng() % 37 : rb;
      const std::int64_t source_rows = kind == 2 ? 1 + static_cast<std::int64_t>(rng() % 80) : count + count / 5 + 3;
      const std::int64_t first = kind >= 2 ? 0 : static_cast<std::int64_t>(rng() % 3);  // base not at row 0
      auto& bytes = o.storage[k];
      bytes.resize(static_cast<std::size_t>(source_rows) * b.stride_bytes + rb);
      for (auto& x : bytes) x = static_cast<std::byte>(rng() & 0xff);
      b.base = bytes.data() + static_cast<std::size_t>(first) * b.stride_bytes;
      if (kind >= 2) {
        auto& idx = o.index[k];
        for (std::int64_t i = 0; i < count; ++i)
          idx.push_back(static_cast<std::int32_t>(kind == 2 ? rng() % source_rows : i + i / 5));
        b.index = idx.data();
      }
    }
  }
  return o;
}

void expect_received(const std::vector<RowBlock>& received, std::uint64_t seed, int round, int me, int R,
                     const FieldShape& shape) {
  const int F = shape.num_fields;
  ASSERT_EQ(received.size(), static_cast<std::size_t>(R * F));
  for (int s = 0; s < R; ++s) {
    const Offer theirs = make_offer(seed, round, s, R, shape);
    for (int f = 0; f < F; ++f) {
      const RowBlock& got = received[static_cast<std::size_t>(s * F + f)];
      const RowBlock& want = theirs.blocks[static_cast<std::size_t>(me * F + f)];
      ASSERT_EQ(got.count, want.count) << "round " << round << " source " << s << " field " << f;
      ASSERT_EQ(got.row_bytes, want.row_bytes) << "round " << round << " source " << s << " field " << f;
      for (std::int64_t i = 0; i < got.count; ++i)
        ASSERT_EQ(0, std::memcmp(got.row(i), want.row(i), want.row_bytes))
            << "round " << round << " source " << s << " field " << f << " row " << i;
    }
  }
}

// Both ways of sending indexed rows (BufferOptions::mpi_pack_rows): packed first, or an hindexed datatype.
class MpiExchange : public ::testing::TestWithParam<const char*> {
 protected:
  std::unique_ptr<Transport> make_transport(std::shared_ptr<Group> g) const {
    return make_mpi_transport(std::move(g), std::string_view(GetParam()) == "pack");
  }
};

TEST_P(MpiExchange, RandomRowBlocksArriveAsTheirSourceOfferedThem) {
  const std::uint64_t seed = shared_seed();
  auto g = test_group();
  auto t = make_transport(g);
  const int R = g->size(), me = g->rank();
  for (int round = 0; round < 24; ++round) {
    const FieldShape shape = make_shape(seed, round, R);
    const Offer mine = make_offer(seed, round, me, R, shape);
    const auto received = t->exchange(mine.blocks, shape.num_fields, "test exchange");
    expect_received(received, seed, round, me, R, shape);
    t->end_exchange("test end_exchange");
  }
}

TEST_P(MpiExchange, TwoExchangesBeforeOneEndExchangeKeepTheirViewsApart) {
  const std::uint64_t seed = shared_seed();
  auto g = test_group();
  auto t = make_transport(g);
  const int R = g->size(), me = g->rank();
  const FieldShape a = make_shape(seed, 100, R), b = make_shape(seed, 101, R);
  const Offer offer_a = make_offer(seed, 100, me, R, a), offer_b = make_offer(seed, 101, me, R, b);
  const auto got_a = t->exchange(offer_a.blocks, a.num_fields, "first");
  const auto got_b = t->exchange(offer_b.blocks, b.num_fields, "second");
  expect_received(got_a, seed, 100, me, R, a);
  expect_received(got_b, seed, 101, me, R, b);
  t->end_exchange("end both");
}

TEST_P(MpiExchange, EveryRankOfferingNothingReceivesNothing) {
  auto g = test_group();
  auto t = make_transport(g);
  const int R = g->size();
  std::vector<RowBlock> none(static_cast<std::size_t>(R * 2));
  for (auto& b : none) b.row_bytes = 8;
  const auto got = t->exchange(none, 2, "empty exchange");
  ASSERT_EQ(got.size(), none.size());
  for (const RowBlock& b : got) EXPECT_EQ(b.count, 0);
  t->end_exchange("empty end");
}

INSTANTIATE_TEST_SUITE_P(Strategies, MpiExchange, ::testing::Values("pack", "datatype"));

TEST(MpiExchangeFault, TimesOutNamingTheRankThatSkippedIt) {
  auto g = test_group(0.5);
  auto t = make_mpi_transport(g);
  const int R = g->size(), me = g->rank(), skipper = R - 1;
  std::vector<std::byte> row(64, std::byte{1});
  std::vector<RowBlock> offer(static_cast<std::size_t>(R));
  for (auto& b : offer) b = RowBlock{row.data(), 64, 64, nullptr, 1};
  if (me != skipper) {
    auto e = catch_error([&] { t->exchange(offer, 1, "skipped exchange"); });
    ASSERT_TRUE(e);
    EXPECT_EQ(e->code(), ErrorCode::timeout);
    const std::string what = e->what();
    EXPECT_NE(what.find(fmt::format("rank {} ", me)), std::string::npos) << what;
    EXPECT_NE(what.find(fmt::format("peer {}", skipper)), std::string::npos) << what;
    EXPECT_NE(what.find("skipped exchange"), std::string::npos) << what;
    auto again = catch_error([&] { t->exchange(offer, 1, "after the timeout"); });
    ASSERT_TRUE(again);
    EXPECT_EQ(again->code(), ErrorCode::unusable);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiExchangeFault, MakeMpiTransportRejectsAThreadsGroup) {
  ThreadWorld world(1);
  auto e = catch_error([&] { make_mpi_transport(world.group(0)); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::invalid_argument);
}

}  // namespace
}  // namespace epmoe::test
