// get_dispatch_layout (semantics §3) against the independent reference and hand-made cases.
#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/layout.hpp>

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "support/normal_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using test::fresh_seed;

void expect_layout_eq(const DispatchLayout& got, const test::RefLayout& want, std::int64_t T, int R, int E) {
  ASSERT_EQ(got.num_tokens_per_rank.dtype(), DType::int32);
  ASSERT_EQ(got.num_tokens_per_expert.dtype(), DType::int32);
  ASSERT_EQ(got.is_token_in_rank.dtype(), DType::boolean);
  ASSERT_EQ(got.num_tokens_per_rank.shape(), Shape({R}));
  ASSERT_EQ(got.num_tokens_per_expert.shape(), Shape({E}));
  ASSERT_EQ(got.is_token_in_rank.shape(), Shape({T, R}));
  for (int r = 0; r < R; ++r) EXPECT_EQ(got.num_tokens_per_rank.ptr<std::int32_t>()[r], want.num_tokens_per_rank[r]) << r;
  for (int e = 0; e < E; ++e)
    EXPECT_EQ(got.num_tokens_per_expert.ptr<std::int32_t>()[e], want.num_tokens_per_expert[e]) << e;
  for (std::int64_t i = 0; i < T * R; ++i)
    ASSERT_EQ(got.is_token_in_rank.ptr<bool>()[i], want.is_token_in_rank[static_cast<std::size_t>(i)] != 0) << i;
}

Tensor to_int32(const Tensor& idx) {
  Tensor t = Tensor::empty(DType::int32, idx.shape());
  for (std::int64_t i = 0; i < idx.numel(); ++i) t.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(idx.ptr<std::int64_t>()[i]);
  return t;
}

TEST(DispatchLayout, HandMadeCase) {
  // E = 8 on R = 4 ranks (2 experts each). Token 0 -> experts 0,1 (rank 0 once), token 1 -> 7, -1,
  // token 2 -> 2, 5 (ranks 1 and 2), token 3 -> all -1.
  std::int64_t ids[] = {0, 1, 7, -1, 2, 5, -1, -1};
  const TensorView v(ids, DType::int64, {4, 2});
  const DispatchLayout l = get_dispatch_layout(v, 8, 4);
  const std::int32_t per_rank[] = {1, 1, 1, 1};
  const std::int32_t per_expert[] = {1, 1, 1, 0, 0, 1, 0, 1};
  const bool in_rank[] = {1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0};
  EXPECT_EQ(0, std::memcmp(l.num_tokens_per_rank.data(), per_rank, sizeof(per_rank)));
  EXPECT_EQ(0, std::memcmp(l.num_tokens_per_expert.data(), per_expert, sizeof(per_expert)));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(l.is_token_in_rank.ptr<bool>()[i], in_rank[i]) << i;
}

TEST(DispatchLayout, RandomInt64AndInt32MatchReference) {
  std::mt19937_64 rng(fresh_seed());
  for (const auto& [T, K, E, R] : std::vector<std::tuple<int, int, int, int>>{
           {1, 1, 1, 1}, {37, 8, 256, 8}, {100, 9, 64, 4}, {64, 2, 6, 3}, {513, 32, 64, 1}}) {
    test::RoutingOptions opts;
    opts.p_minus_one = 0.2;
    const Tensor idx = test::random_topk_idx(rng, T, K, E, opts);
    const auto want = test::reference_layout(idx, E, R);
    expect_layout_eq(get_dispatch_layout(idx, E, R), want, T, R, E);
    expect_layout_eq(get_dispatch_layout(to_int32(idx), E, R), want, T, R, E);
  }
}

TEST(DispatchLayout, AllMinusOneAndZeroTokens) {
  Tensor idx = Tensor::empty(DType::int64, {5, 3});
  for (int i = 0; i < 15; ++i) idx.ptr<std::int64_t>()[i] = -1;
  const DispatchLayout l = get_dispatch_layout(idx, 16, 4);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(l.num_tokens_per_rank.ptr<std::int32_t>()[r], 0);
  for (int e = 0; e < 16; ++e) EXPECT_EQ(l.num_tokens_per_expert.ptr<std::int32_t>()[e], 0);
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(l.is_token_in_rank.ptr<bool>()[i]);

  const Tensor empty = Tensor::empty(DType::int32, {0, 4});
  const DispatchLayout z = get_dispatch_layout(empty, 16, 4);
  EXPECT_EQ(z.is_token_in_rank.shape(), Shape({0, 4}));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(z.num_tokens_per_rank.ptr<std::int32_t>()[r], 0);
}

TEST(DispatchLayout, EveryTokenToOneExpert) {
  std::mt19937_64 rng(fresh_seed());
  test::RoutingOptions opts;
  opts.only_expert = 13;
  const Tensor idx = test::random_topk_idx(rng, 50, 4, 16, opts);
  const DispatchLayout l = get_dispatch_layout(idx, 16, 2);
  EXPECT_EQ(l.num_tokens_per_expert.ptr<std::int32_t>()[13], 50);
  EXPECT_EQ(l.num_tokens_per_rank.ptr<std::int32_t>()[0], 0);
  EXPECT_EQ(l.num_tokens_per_rank.ptr<std::int32_t>()[1], 50);
}

TEST(DispatchLayout, RepeatedExpertCountsEachEntryButTokenOncePerRank) {
  std::int64_t ids[] = {3, 3, 2};
  const DispatchLayout l = get_dispatch_layout(TensorView(ids, DType::int64, {1, 3}), 4, 2);
  EXPECT_EQ(l.num_tokens_per_expert.ptr<std::int32_t>()[3], 2);
  EXPECT_EQ(l.num_tokens_per_expert.ptr<std::int32_t>()[2], 1);
  EXPECT_EQ(l.num_tokens_per_rank.ptr<std::int32_t>()[1], 1);
}

TEST(DispatchLayout, StridedViewIsRead) {
  // Column 1 of a [3, 2] tensor as a [3, 1] view.
  std::int64_t ids[] = {0, 3, 0, 1, 0, -1};
  const TensorView v(ids + 1, DType::int64, Shape{3, 1}, Shape{2, 1}, Device::cpu());
  const DispatchLayout l = get_dispatch_layout(v, 4, 2);
  EXPECT_EQ(l.num_tokens_per_expert.ptr<std::int32_t>()[0], 0);
  EXPECT_EQ(l.num_tokens_per_expert.ptr<std::int32_t>()[1], 1);
  EXPECT_EQ(l.num_tokens_per_expert.ptr<std::int32_t>()[3], 1);
}

template <class Fn>
std::string error_of(Fn&& fn, ErrorCode code) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

TEST(DispatchLayout, OutOfRangeIdNamesValueAndPosition) {
  std::int64_t ids[] = {0, 1, 2, 16, 4, 5};
  std::string msg = error_of([&] { get_dispatch_layout(TensorView(ids, DType::int64, {3, 2}), 16, 4); },
                             ErrorCode::invalid_argument);
  EXPECT_NE(msg.find("topk_idx"), std::string::npos) << msg;
  EXPECT_NE(msg.find("16 at [1, 1]"), std::string::npos) << msg;
  std::int32_t ids32[] = {0, -2};
  msg = error_of([&] { get_dispatch_layout(TensorView(ids32, DType::int32, {1, 2}), 16, 4); }, ErrorCode::invalid_argument);
  EXPECT_NE(msg.find("-2 at [0, 1]"), std::string::npos) << msg;
}

TEST(DispatchLayout, BadArgumentsAreRejected) {
  std::int64_t ids[] = {0, 1};
  const TensorView v(ids, DType::int64, {1, 2});
  std::string msg = error_of([&] { get_dispatch_layout(v, 10, 4); }, ErrorCode::invalid_argument);
  EXPECT_NE(msg.find("num_experts"), std::string::npos) << msg;
  EXPECT_NE(msg.find("multiple of num_ranks (4)"), std::string::npos) << msg;
  error_of([&] { get_dispatch_layout(v, 0, 1); }, ErrorCode::invalid_argument);
  error_of([&] { get_dispatch_layout(v, 4, 0); }, ErrorCode::invalid_argument);
  msg = error_of([&] { get_dispatch_layout(v, 2050, 2); }, ErrorCode::invalid_argument);
  EXPECT_NE(msg.find("1024"), std::string::npos) << msg;
  float f[] = {0, 1};
  msg = error_of([&] { get_dispatch_layout(TensorView(f, DType::fp32, {1, 2}), 4, 2); }, ErrorCode::invalid_argument);
  EXPECT_NE(msg.find("float32"), std::string::npos) << msg;
  error_of([&] { get_dispatch_layout(TensorView(ids, DType::int64, {2}), 4, 2); }, ErrorCode::invalid_argument);
  error_of([&] { get_dispatch_layout(TensorView(), 4, 2); }, ErrorCode::invalid_argument);
}

TEST(DispatchLayout, BufferMethodUsesGroupSize) {
  std::mt19937_64 rng(fresh_seed());
  const Tensor idx = test::random_topk_idx(rng, 20, 3, 12, {});
  run_thread_ranks(3, [&](Group& g) {
    Buffer buf(std::shared_ptr<Group>(&g, [](Group*) {}));
    const DispatchLayout l = buf.get_dispatch_layout(idx, 12);
    EXPECT_EQ(l.is_token_in_rank.shape(), Shape({20, 3}));
  });
  expect_layout_eq(get_dispatch_layout(idx, 12, 3), test::reference_layout(idx, 12, 3), 20, 3, 12);
}

}  // namespace
}  // namespace epmoe
