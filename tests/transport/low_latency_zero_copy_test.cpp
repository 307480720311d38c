// The zero-copy low-latency combine (semantics §5): get_next_low_latency_combine_buffer hands out a view of the
// next call's half of the window, a combine with zero_copy sends it instead of x, the two halves' slabs are distinct
// and no call writes them; DeepEP's test sequence (one dispatch combined twice, the second zero-copy) on CPU ranks.
#include <gtest/gtest.h>

#include <cstring>

#include "transport/low_latency_test_common.hpp"

namespace epmoe::test::ll {
namespace {

Case zero_copy_case() {
  Case c;
  c.R = 3;
  c.E = 6;
  c.K = 3;
  c.H = 256;
  c.tmax = 7;
  c.T = {7, 0, 4};  // T = Tmax, a rank with no tokens, and one in between
  return c;
}

void copy_into(const TensorView& dst, const Tensor& src) {
  ASSERT_EQ(dst.nbytes(), src.nbytes());
  std::memcpy(dst.data, src.data(), src.nbytes());
}

TEST(LowLatencyZeroCopy, SlabIsNextHalfOfWindowAndCombineSendsIt) {
  const Case c = zero_copy_case();
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const auto in = make_inputs(rng, c);
  const auto y1 = make_expert_out(rng, c), y2 = make_expert_out(rng, c), junk = make_expert_out(rng, c);
  const auto ref = reference_low_latency_dispatch(in, c.E);
  const auto want1 = reference_low_latency_combine(in, ref, y1, c.E);
  const auto want2 = reference_low_latency_combine(in, ref, y2, c.E);
  const std::int64_t El = c.E / c.R, rows = static_cast<std::int64_t>(c.R) * c.tmax;
  std::vector<Tensor> got1(3), got2(3);
  std::vector<int> distinct(3, 0), kept(3, 0);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const auto r = static_cast<std::size_t>(g.rank());
    auto d = b.low_latency_dispatch(dispatch_args(c, in[r]));  // call 0, half 0
    const TensorView s1 = b.get_next_low_latency_combine_buffer(d.handle);  // call 1's (half 1)
    ASSERT_EQ(s1.dtype, DType::bf16);
    ASSERT_EQ(s1.shape, (Shape{El, rows, c.H}));
    ASSERT_EQ(s1.strides, (Shape{rows * c.H, c.H, 1}));
    copy_into(s1, y1[r]);
    LowLatencyCombineArgs ca;
    ca.topk_idx = in[r].topk_idx;
    ca.topk_weights = in[r].topk_weights;
    ca.handle = &d.handle;
    ca.zero_copy = true;  // x undefined: the slab is sent
    got1[r] = clone(b.low_latency_combine(ca).combined_x);
    const TensorView s2 = b.get_next_low_latency_combine_buffer(d.handle);  // call 2's (half 0)
    distinct[r] = s2.data != s1.data;
    copy_into(s2, y2[r]);
    ca.x = junk[r];  // given with zero_copy: checked, not sent
    got2[r] = clone(b.low_latency_combine(ca).combined_x);
    // No call wrote the first slab.
    kept[r] = std::memcmp(s1.data, y1[r].data(), y1[r].nbytes()) == 0;
  });
  for (int r = 0; r < c.R; ++r) {
    const auto i = static_cast<std::size_t>(r);
    EXPECT_EQ(distinct[i], 1) << "rank " << r << " seed " << seed;
    EXPECT_EQ(kept[i], 1) << "rank " << r << " seed " << seed;
    expect_bf16_equal(got1[i], want1[i], "zero-copy combine, rank " + std::to_string(r));
    expect_bf16_equal(got2[i], want2[i], "second zero-copy combine of one dispatch, rank " + std::to_string(r));
  }
}

TEST(LowLatencyZeroCopy, ErrorsNameTheArgument) {
  const Case c = zero_copy_case();
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  std::vector<Caught> foreign(3), shape(3), empty(3);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const auto r = static_cast<std::size_t>(g.rank());
    auto d = b.low_latency_dispatch(dispatch_args(c, in[r]));
    LowLatencyHandle other = d.handle;
    other.buffer_id += 1000;
    foreign[r] = catch_error([&] { b.get_next_low_latency_combine_buffer(other); });
    empty[r] = catch_error([&] { b.get_next_low_latency_combine_buffer(LowLatencyHandle{}); });
    Tensor wrong = Tensor::empty(DType::bf16, {1, 2, c.H});
    LowLatencyCombineArgs ca;
    ca.x = wrong;
    ca.topk_idx = in[r].topk_idx;
    ca.topk_weights = in[r].topk_weights;
    ca.handle = &d.handle;
    ca.zero_copy = true;
    shape[r] = catch_error([&] { b.low_latency_combine(ca); });  // refused before any communication
    ca.x = TensorView{};
    b.low_latency_combine(ca);  // the buffer is still in step on every rank
  });
  for (std::size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(foreign[r].code, ErrorCode::invalid_argument) << foreign[r].what;
    EXPECT_NE(foreign[r].what.find("handle"), std::string::npos) << foreign[r].what;
    EXPECT_EQ(empty[r].code, ErrorCode::invalid_argument) << empty[r].what;
    EXPECT_EQ(shape[r].code, ErrorCode::invalid_argument) << shape[r].what;
    EXPECT_NE(shape[r].what.find("'x'"), std::string::npos) << shape[r].what;
  }
}

}  // namespace
}  // namespace epmoe::test::ll
